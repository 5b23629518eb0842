"""Every generation control of /completion changes the output the way it should (tiny model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from llamarunner import Server

from helpers import Neighbour, complete, parse_ndjson

N = 40


def greedy(srv: Server, prompt: str = "the cat is", **options: Any) -> str:
    return complete(srv.url, prompt, temperature=0, num_predict=N, **options)[0]


def sampled(srv: Server, prompt: str = "the cat is", **options: Any) -> str:
    options = {"temperature": 1.0, "seed": 1234, "num_predict": N, **options}
    return complete(srv.url, prompt, **options)[0]


def test_top_k_1_is_greedy(tiny_server: Server) -> None:
    assert sampled(tiny_server, top_k=1) == greedy(tiny_server)


def test_top_p_tiny_is_greedy(tiny_server: Server) -> None:
    assert sampled(tiny_server, top_k=0, top_p=0.0001) == greedy(tiny_server)


def test_min_p_1_is_greedy(tiny_server: Server) -> None:
    assert sampled(tiny_server, top_k=0, top_p=1.0, min_p=1.0) == greedy(tiny_server)


def test_typical_p_changes_sampling(tiny_server: Server) -> None:
    base = sampled(tiny_server, top_k=0, top_p=1.0)
    assert sampled(tiny_server, top_k=0, top_p=1.0, typical_p=0.05) != base


def test_temperature_changes_sampling(tiny_server: Server) -> None:
    assert sampled(tiny_server, temperature=0.3) != sampled(tiny_server, temperature=3.0)


def test_seed_changes_and_fixes_sampling(tiny_server: Server) -> None:
    a = sampled(tiny_server, seed=1)
    assert sampled(tiny_server, seed=1) == a
    assert sampled(tiny_server, seed=2) != a


def test_seed_above_2_to_the_32_is_accepted_and_wraps(tiny_server: Server) -> None:
    # llama.cpp's samplers take a 32-bit seed; larger ones wrap, as Ollama's uint32(seed).
    big = sampled(tiny_server, seed=2**32 + 1234)
    assert sampled(tiny_server, seed=2**32 + 1234) == big
    assert big == sampled(tiny_server, seed=1234)
    assert big != sampled(tiny_server, seed=1235)
    assert sampled(tiny_server, seed=2**40 + 77) == sampled(tiny_server, seed=77)


@pytest.mark.parametrize("seed", [2**32 - 1, 2**63 - 1])
def test_every_explicit_seed_is_repeatable(tiny_server: Server, seed: int) -> None:
    # Both wrap to 0xFFFFFFFF, which llama.cpp's samplers take for "pick a random seed"
    # (LLAMA_DEFAULT_SEED); an explicit seed must still give the same text every time.
    assert sampled(tiny_server, seed=seed) == sampled(tiny_server, seed=seed)


def test_same_seed_same_text_with_neighbours(
    tiny_model: Path, start_server: Callable[..., Server]
) -> None:
    # No cap on a request's tokens: the neighbour lasts until it is left (the default cap, ten
    # slot contexts, ends it in a second or two, which a starved test thread can outlast).
    srv = start_server(tiny_model, parallel=2, ctx_size=512, max_tokens=10**9)
    alone = sampled(srv, "a dog and", seed=99)
    # A second sequence generates in the same batches for the whole request.
    with Neighbour(srv.url, "the world of", seed=5, temperature=1.0) as neighbour:
        together = sampled(srv, "a dog and", seed=99)
        neighbour.still_running()
    assert together == alone


@pytest.mark.parametrize(
    "penalty",
    [
        {"repeat_penalty": 3.0},
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
    ],
)
def test_penalties_change_greedy_output(tiny_server: Server, penalty: dict[str, float]) -> None:
    plain = greedy(tiny_server, repeat_penalty=1.0)
    assert greedy(tiny_server, **{"repeat_penalty": 1.0, **penalty}) != plain


def test_repeat_last_n_zero_disables_the_penalty(tiny_server: Server) -> None:
    plain = greedy(tiny_server, repeat_penalty=1.0)
    assert greedy(tiny_server, repeat_penalty=3.0, repeat_last_n=0) == plain


@pytest.mark.parametrize("mode", [1, 2])
def test_mirostat_generates(tiny_server: Server, mode: int) -> None:
    _, final = complete(tiny_server.url, "hello", mirostat=mode, seed=3, num_predict=N)
    assert final["eval_count"] == N
    assert sampled(tiny_server, mirostat=mode) != sampled(tiny_server)


@pytest.mark.parametrize("mode", [1, 2])
def test_mirostat_tau_and_eta_take_effect(tiny_server: Server, mode: int) -> None:
    def text(**options: Any) -> str:
        return sampled(tiny_server, mirostat=mode, ignore_eos=True, **options)

    base = text(mirostat_tau=5.0, mirostat_eta=0.1)
    assert text(mirostat_tau=5.0, mirostat_eta=0.1) == base
    # A target surprise near zero keeps only the likeliest tokens: greedy.
    assert text(mirostat_tau=0.01, mirostat_eta=0.1) != base
    assert text(mirostat_tau=5.0, mirostat_eta=1.0) != base


def test_stop_string_is_never_returned(tiny_server: Server) -> None:
    full = greedy(tiny_server)
    stop = full[15:18]
    text, final = complete(tiny_server.url, "the cat is", temperature=0, num_predict=N, stop=[stop])
    assert final["done_reason"] == "stop"
    assert stop not in text
    assert full.startswith(text)
    assert text == full[: full.index(stop)]


def test_grammar_constrains_output(tiny_server: Server) -> None:
    for seed in range(5):
        r = httpx.post(
            f"{tiny_server.url}/completion",
            json={
                "prompt": "answer:",
                "grammar": 'root ::= "yes" | "no"',
                "options": {"seed": seed, "num_predict": 20, "temperature": 1.0},
            },
        )
        assert r.status_code == 200, r.text
        lines = parse_ndjson(r.text)
        out = "".join(line.get("content", "") for line in lines)
        assert out in ("yes", "no")
        assert lines[-1]["done_reason"] == "stop"


def test_invalid_grammar_is_400_with_the_parser_message(tiny_server: Server) -> None:
    r = httpx.post(
        f"{tiny_server.url}/completion", json={"prompt": "x", "grammar": 'root ::= "yes'}
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request"
    assert "invalid grammar: unterminated string at line 1, column 10" in err["message"]


def test_format_json_schema_output_validates(tiny_server: Server) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
        "required": ["ok", "n"],
    }
    r = httpx.post(
        f"{tiny_server.url}/completion",
        json={"prompt": "json:", "format": schema, "options": {"num_predict": 60, "seed": 1}},
    )
    assert r.status_code == 200, r.text
    lines = parse_ndjson(r.text)
    out = json.loads("".join(line.get("content", "") for line in lines))
    assert isinstance(out["ok"], bool)
    assert isinstance(out["n"], int)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"format": "xml"}, "invalid format"),
        ({"format": 5}, "invalid format"),
        ({"options": {"top_p": 2}}, "top_p"),
        ({"options": {"top_k": -5}}, "top_k"),
        ({"options": {"mirostat": 7}}, "mirostat"),
        ({"options": {"stop": [1]}}, "stop"),
        ({"options": {"stop": [""]}}, "stop"),
        ({"options": {"temperature": -1}}, "temperature"),
        ({"options": {"min_p": 1.5}}, "min_p"),
        ({"options": {"repeat_last_n": -2}}, "repeat_last_n"),
    ],
)
def test_bad_values_name_the_option(
    tiny_server: Server, body: dict[str, Any], fragment: str
) -> None:
    r = httpx.post(f"{tiny_server.url}/completion", json={"prompt": "x", **body})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]


# --------------------------------------------------------------------------------------------
# llama-server's samplers: DRY, XTC, top-n-sigma, dynamic temperature


@pytest.fixture(scope="module")
def looper(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A model whose greedy text is "alph " over and over: a repeat DRY must break."""
    from tinymodel import write_cycle_model

    model = write_cycle_model(tmp_path_factory.mktemp("loop") / "loop.gguf", "alph ")
    with Server(str(model), port=0, ctx_size=512, threads=2, alias="loop") as srv:
        yield srv


def test_dry_breaks_a_repeat_even_when_greedy(looper: Server) -> None:
    plain = greedy(looper, "x", repeat_penalty=1.0)
    assert plain == ("alph " * 10)[:N]
    dry = greedy(looper, "x", repeat_penalty=1.0, dry_multiplier=5.0, dry_allowed_length=2)
    assert dry != plain
    # Broken where a repeat grows past the allowed length, not before.
    assert dry[:5] == plain[:5]

    # A later allowed length lets the loop run longer before DRY breaks it.
    def kept(text: str) -> int:
        return next((i for i, (a, b) in enumerate(zip(text, plain)) if a != b), len(text))

    later = greedy(looper, "x", repeat_penalty=1.0, dry_multiplier=5.0, dry_allowed_length=12)
    assert kept(later) > kept(dry), (dry, later)
    # Sequence breakers are taken (their effect depends on how the vocabulary splits them).
    assert greedy(looper, "x", dry_multiplier=5.0, dry_sequence_breakers=[" ", "ph"])


@pytest.mark.parametrize(
    "option",
    [
        {"xtc_probability": 1.0, "xtc_threshold": 0.01},
        {"top_n_sigma": 0.01},
        {"dynatemp_range": 0.9, "dynatemp_exponent": 0.5},
    ],
)
def test_sampled_text_changes_with_each_sampler(
    tiny_server: Server, option: dict[str, Any]
) -> None:
    base = sampled(tiny_server, top_k=0, top_p=1.0)
    assert sampled(tiny_server, top_k=0, top_p=1.0) == base
    changed = sampled(tiny_server, top_k=0, top_p=1.0, **option)
    assert changed != base
    # Fixed by the seed, as the others are.
    assert sampled(tiny_server, top_k=0, top_p=1.0, **option) == changed


def test_the_samplers_are_read_in_every_dialect(looper: Server) -> None:
    """The same DRY request through the OpenAI, Anthropic and Responses dialects breaks the
    loop the same way as the native one."""
    # ignore_eos everywhere: once DRY breaks the loop, an end token may come next.
    native = greedy(looper, "x", repeat_penalty=1.0, dry_multiplier=5.0, ignore_eos=True)
    extra = {"dry_multiplier": 5.0, "temperature": 0, "ignore_eos": True}
    chat = httpx.post(
        f"{looper.url}/v1/completions",
        json={"model": "loop", "prompt": "x", "max_tokens": N, **extra},
        timeout=60,
    ).json()["choices"][0]["text"]
    assert chat == native
    for path, body, read in [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": N},
            lambda r: r["choices"][0]["message"]["content"],
        ),
        (
            "/v1/messages",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": N},
            lambda r: r["content"][0]["text"],
        ),
        (
            "/v1/responses",
            {"input": "x", "max_output_tokens": N},
            lambda r: r["output"][0]["content"][0]["text"],
        ),
    ]:
        on = httpx.post(f"{looper.url}{path}", json={"model": "loop", **body, **extra}, timeout=60)
        off = httpx.post(
            f"{looper.url}{path}",
            json={"model": "loop", **body, "temperature": 0, "ignore_eos": True},
            timeout=60,
        )
        assert on.status_code == 200 and off.status_code == 200, (path, on.text)
        assert read(off.json()).startswith("alph alph alph"), path
        assert read(on.json()) != read(off.json()), path
    ollama = httpx.post(
        f"{looper.url}/api/generate",
        json={
            "model": "loop",
            "prompt": "x",
            "raw": True,
            "stream": False,
            "options": {
                "num_predict": N,
                "repeat_penalty": 1.0,
                "dry_multiplier": 5.0,
                "temperature": 0,
                "ignore_eos": True,
            },
        },
        timeout=60,
    ).json()["response"]
    assert ollama == native


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        ("/completion", {"prompt": "x", "options": {"dry_multiplier": -1}}, "dry_multiplier"),
        (
            "/completion",
            {"prompt": "x", "options": {"dry_sequence_breakers": ["a\u0000"]}},
            "dry_sequence_breakers",
        ),
        (
            "/completion",
            {"prompt": "x", "options": {"dry_sequence_breakers": ["b"] * 17}},
            "dry_sequence_breakers",
        ),
        (
            "/completion",
            {"prompt": "x", "options": {"dry_penalty_last_n": -5}},
            "dry_penalty_last_n",
        ),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": "x", "xtc_probability": 2},
            "xtc_probability",
        ),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_n_sigma": 1e9},
            "top_n_sigma",
        ),
        (
            "/v1/messages",
            {
                "model": "tiny",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "x"}],
                "dynatemp_range": -1,
            },
            "dynatemp_range",
        ),
        ("/v1/responses", {"model": "tiny", "input": "x", "dry_base": float("1e40")}, "dry_base"),
    ],
)
def test_bad_sampler_values_are_400s_naming_them(
    tiny_server: Server, path: str, body: dict[str, Any], fragment: str
) -> None:
    r = httpx.post(f"{tiny_server.url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert fragment in r.text


def test_a_huge_dry_window_is_clamped_to_the_slot(tiny_server: Server) -> None:
    # llama.cpp allocates DRY's ring of recent tokens at its window: 2^31 would be gigabytes.
    text = greedy(tiny_server, dry_multiplier=0.5, dry_penalty_last_n=2**31 - 1)
    assert isinstance(text, str) and text


# --- the shortlist: a chain whose first cut is a top-k sees only its candidates ----------------
# (backend/shortlist.rs). A top-n-sigma of 100 keeps every token and makes the same chain see
# the whole vocabulary, so the same seed must give the same text both ways.

WHOLE_VOCABULARY = {"top_n_sigma": 100.0}

SHORTLISTED = [
    {},  # the OpenAI dialect's defaults: top-k 40, no penalty
    {"top_p": 0.9, "repeat_penalty": 1.1, "repeat_last_n": 64},  # Ollama's defaults
    {"presence_penalty": 1.5, "frequency_penalty": 0.7, "repeat_last_n": 16, "top_k": 8},
    {"top_k": 200, "min_p": 0.02, "temperature": 1.6},
    {"logit_bias": {"2": 4.0, "30": 8.0, "31": -100}, "top_k": 5},
    {"ignore_eos": True, "repeat_penalty": 1.3},
]


def openai_text(srv: Server, model: str, prompt: str, **body: Any) -> str:
    r = httpx.post(
        f"{srv.url}/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 1.2} | body,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


@pytest.mark.parametrize("options", SHORTLISTED, ids=lambda o: ",".join(o) or "defaults")
def test_the_shortlist_samples_as_the_whole_vocabulary(
    tiny_server: Server, options: dict[str, Any]
) -> None:
    model = tiny_server.client().models()[0]["id"]
    texts = set()
    for seed in (1, 2, 3):
        short = openai_text(tiny_server, model, "the cat is", seed=seed, **options)
        whole = openai_text(
            tiny_server, model, "the cat is", seed=seed, **options, **WHOLE_VOCABULARY
        )
        assert short == whole, (seed, short, whole)
        texts.add(short)
    assert len(texts) > 1, "the seeds should sample differently"


STORY = "Write a short story about a lighthouse keeper."


@pytest.fixture(scope="module")
def default_server(default_model: Any) -> Any:
    # Sampled texts are compared token for token, so every compared request must decode
    # alike: no drafts, and a first request that caches the prompt, so that each compared one
    # decodes only its last token (llama.cpp's CPU kernels are not batch-invariant).
    with Server(
        str(default_model), port=0, ctx_size=1024, parallel=1, threads=2, draft_max=0
    ) as srv:
        model = srv.client().models()[0]["id"]
        openai_text(srv, model, STORY, max_tokens=1)
        yield srv


@pytest.mark.parametrize("options", SHORTLISTED[:3], ids=lambda o: ",".join(o) or "defaults")
def test_the_shortlist_samples_as_the_whole_vocabulary_of_the_default_model(
    default_server: Server, options: dict[str, Any]
) -> None:
    # 262,144 tokens, of which the shortlist hands the chain at most 320.
    model = default_server.client().models()[0]["id"]
    for seed in (7, 8):
        short = openai_text(default_server, model, STORY, seed=seed, **options)
        whole = openai_text(default_server, model, STORY, seed=seed, **options, **WHOLE_VOCABULARY)
        assert short == whole, (seed, short, whole)
