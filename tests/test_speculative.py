"""Speculative decoding (prompt-lookup drafts) end to end on real llama.cpp: the output with
drafts is the output without them, single and batched, with stop strings, ``num_predict``,
EOG, grammars and logprobs (each with drafts made: the counts say so); drafted and accepted
tokens are reported; the settings and the request field are validated."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llamarunner import Server, ServerConfig

from helpers import (
    assert_all_busy,
    choice_logprobs,
    complete,
    openai_greedy,
    openai_stream,
    run_together,
    same_or_near_tie,
    text_same_or_near_tie,
    wait_idle,
)
from tinymodel import model_tensors, write_chain_model, write_tiny_model

# A prompt that repeats itself: lookups find drafts in it.
REPEAT = "one two three four five six seven eight " * 6


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The random tiny model, 4 slots: its output never repeats, so its drafts are (nearly)
    all rejected and rolled back. Every draft found is verified (`draft_always`): these tests
    are about verification, and the adaptation would stop drafts that are rejected."""
    model = write_tiny_model(tmp_path_factory.mktemp("spec") / "tiny.gguf")
    with Server(str(model), port=0, parallel=4, ctx_size=512, threads=2, draft_always=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def looper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A tiny model whose layers add nothing (their output projections are zero): the next
    token is a function of the last one, so greedy output falls into a loop at once and
    drafts are accepted. Every draft found is verified (`draft_always`), so that how much is
    drafted does not follow the step times measured while the tests run."""
    with Server(
        str(loop_model(tmp_path_factory)),
        port=0,
        parallel=4,
        ctx_size=512,
        threads=2,
        draft_always=True,
    ) as srv:
        yield srv


def loop_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with layers that add nothing (`looper`)."""
    tensors = model_tensors()
    for name in tensors:
        if name.endswith(("attn_output.weight", "ffn_down.weight")):
            tensors[name] = tensors[name] * 0
    return write_tiny_model(tmp_path_factory.mktemp("spec") / "loop.gguf", tensors=tensors)


def run(url: str, prompt: str, speculative: bool, **options: Any) -> tuple[str, dict[str, Any]]:
    options.setdefault("temperature", 0)
    # The random tiny model soon emits EOG; most cases generate on past it. Without the
    # repetition penalty (default 1.1) a loop stays a loop.
    options.setdefault("ignore_eos", True)
    options.setdefault("repeat_penalty", 1.0)
    return complete(url, prompt, {"speculative": speculative}, **options)


def test_greedy_output_with_rejected_drafts_is_the_output_without(tiny4: Server) -> None:
    # Long enough for the random model's output to repeat itself, so that lookups draft:
    # from every prompt (with or without the penalty), and under each penalty.
    prompts = [(REPEAT, 120), ("abc", 200), ("x" * 30, 200)]
    drafts: dict[tuple[str, float], int] = {}
    for prompt, n in prompts:
        for penalty in (1.0, 1.1):
            plain, plain_final = run(
                tiny4.url, prompt, False, num_predict=n, repeat_penalty=penalty
            )
            drafted, final = run(tiny4.url, prompt, True, num_predict=n, repeat_penalty=penalty)
            assert drafted == plain, prompt
            assert final["eval_count"] == plain_final["eval_count"] == n
            assert plain_final["draft_count"] == 0
            assert 0 <= final["draft_accepted_count"] <= final["draft_count"]
            drafts[prompt, penalty] = final["draft_count"]
    assert all(drafts[p, 1.0] + drafts[p, 1.1] > 0 for p, _ in prompts), drafts
    assert all(sum(drafts[p, q] for p, _ in prompts) > 0 for q in (1.0, 1.1)), drafts
    # Drafts were made from the repetitive prompt (and the cut cells did not change the text).
    _, final = run(tiny4.url, REPEAT, True, num_predict=120)
    assert final["draft_count"] > 0, final
    # Ending at EOG, as without drafts, after rejected drafts. Prompts after which the random
    # model reaches EOG within 120 tokens, having drafted before (on this model: 17 to 102
    # tokens, 16 to 48 drafted); a near-tie on another CPU may send one elsewhere, so one of
    # them reaching it is enough.
    eog = 0
    for prompt in (REPEAT + "t", REPEAT + "j", REPEAT + "u", "one two three one two three one two"):
        plain, plain_final = run(tiny4.url, prompt, False, num_predict=120, ignore_eos=False)
        drafted, final = run(tiny4.url, prompt, True, num_predict=120, ignore_eos=False)
        assert (drafted, final["done_reason"]) == (plain, plain_final["done_reason"]), prompt
        assert final["eval_count"] == plain_final["eval_count"], prompt
        # No stop strings: "stop" before the limit is EOG.
        if final["done_reason"] == "stop" and final["eval_count"] < 120:
            eog += final["draft_count"] > final["draft_accepted_count"]
    assert eog > 0, "no prompt reached EOG after drafts"


def test_greedy_output_with_accepted_drafts_is_the_output_without(looper: Server) -> None:
    for prompt in (REPEAT, "abc", "hello world"):
        plain, _ = run(looper.url, prompt, False, num_predict=100)
        drafted, final = run(looper.url, prompt, True, num_predict=100)
        assert drafted == plain
        assert final["eval_count"] == 100
        # Nearly every token after the loop closed came from an accepted draft.
        assert final["draft_accepted_count"] > 50, final
    # Greedy requests draft by default (the server's default --draft-max).
    _, final = complete(
        looper.url, "abc", temperature=0, num_predict=40, ignore_eos=True, repeat_penalty=1.0
    )
    assert final["draft_accepted_count"] > 0, final


@pytest.mark.parametrize("model", ["tiny4", "looper"])
def test_four_concurrent_requests_with_drafts_match_their_plain_output(
    model: str, request: pytest.FixtureRequest
) -> None:
    """Each of four streams decoded together with drafts gives its text alone without.

    The prompts are ones whose text does not depend on the batch's shape even without drafts:
    llama.cpp's CPU kernels are not batch-invariant (test_real_model.py explains), and on the
    random model a near-tie after some prompts ("hello " * 10, the first 80 characters of
    REPEAT) flips a greedy choice when the sequence is decoded beside others, drafts or not.
    """
    srv: Server = request.getfixturevalue(model)
    prompts = [
        "one two three one two three one two",
        "abc abc abc abc",
        "the cat sat on the mat " * 3,
        "1 2 3 1 2 3 1 2 3",
    ]
    plain = [run(srv.url, p, False, num_predict=320)[0] for p in prompts]
    wait_idle(srv.url)
    options = {"temperature": 0, "num_predict": 320, "ignore_eos": True, "repeat_penalty": 1.0}
    together, slots = run_together(
        srv.url, [{"prompt": p, "options": options, "speculative": True} for p in prompts]
    )
    # All four were generating at once (the slot table is polled while they run: a tiny
    # model's streams take well under a second), so their drafts shared batches.
    assert_all_busy(slots, 4)
    for p, want, (got, final) in zip(prompts, plain, together):
        assert got == want, p
        assert final["eval_count"] == 320
        assert final["draft_count"] > 0, (p, final)
    if model == "looper":
        assert all(final["draft_accepted_count"] > 0 for _, final in together)


def test_eog_inside_accepted_drafts_ends_the_output_there(
    tmp_path: Path, start_server: Any
) -> None:
    """A model that writes the alphabet, then EOS (`write_chain_model`), after a prompt that
    holds the alphabet: lookups draft it, and the draft made at "Z" (" hello", from the
    prompt) is rejected for EOS. The text ends at EOG, well before `num_predict`, as
    without drafts."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    srv = start_server(
        write_chain_model(tmp_path / "chain.gguf", alphabet), ctx_size=512, draft_always=True
    )
    for spec in (False, True):
        text, final = run(srv.url, alphabet + " hello", spec, num_predict=80, ignore_eos=False)
        assert (text, final["done_reason"], final["eval_count"]) == (alphabet, "stop", 27)
        if spec:
            assert 0 < final["draft_accepted_count"] < final["draft_count"], final
        else:
            assert final["draft_count"] == 0, final


@pytest.mark.parametrize("model", ["tiny4", "looper"])
def test_stop_strings_num_predict_grammar_and_logprobs_are_unchanged(
    model: str, request: pytest.FixtureRequest
) -> None:
    """Each case drafts (lookups find nothing in REPEAT's first tokens: the cases run long
    enough for the output to repeat itself), and its output is the output without drafts."""
    tiny4: Server = request.getfixturevalue(model)
    full, _ = run(tiny4.url, REPEAT, False, num_predict=120)
    # A stop string inside the generated text, found after drafts were made: 3 characters
    # from the 60th on the random model, which drafts late; 30 on the looper, whose loop
    # holds every short string from its first tokens.
    stop = full[60:63] if model == "tiny4" else full[60:90]
    for spec in (False, True):
        text, final = run(tiny4.url, REPEAT, spec, num_predict=120, stop=[stop])
        assert text == full[: full.index(stop)]
        assert final["done_reason"] == "stop"
        assert (final["draft_count"] > 0) == spec, final
    for n in (1, 2, 5, 13, 90):
        a, fa = run(tiny4.url, REPEAT, False, num_predict=n)
        b, fb = run(tiny4.url, REPEAT, True, num_predict=n)
        assert a == b and fa["eval_count"] == fb["eval_count"] == n
    assert fb["draft_count"] > 0, fb  # n = 90
    # A grammar: drafts the grammar does not allow are cut by the verification.
    grammar = 'root ::= ("ab" | "cd" | " ")+'
    a, _ = complete(
        tiny4.url,
        REPEAT,
        {"grammar": grammar, "speculative": False},
        temperature=0,
        num_predict=40,
        ignore_eos=True,
    )
    b, fb = complete(
        tiny4.url,
        REPEAT,
        {"grammar": grammar, "speculative": True},
        temperature=0,
        num_predict=40,
        ignore_eos=True,
    )
    assert a == b and set(a) <= set("abcd ")
    # Drafts were made under the grammar (from the output's own repeats), and verified.
    assert fb["draft_count"] > 0, fb
    if model == "looper":
        assert fb["draft_accepted_count"] > 0, fb
    # Logprobs through the OpenAI dialect, with usage reporting the predictions.
    outs = []
    for spec in (False, True):
        r = httpx.post(
            f"{tiny4.url}/v1/completions",
            json={
                "prompt": REPEAT,
                "max_tokens": 90,
                "temperature": 0,
                "logprobs": 2,
                "ignore_eos": True,
                "speculative": spec,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        outs.append(r.json())
    assert outs[0]["choices"][0]["text"] == outs[1]["choices"][0]["text"]
    assert (
        outs[0]["choices"][0]["logprobs"]["tokens"] == outs[1]["choices"][0]["logprobs"]["tokens"]
    )
    lp = [o["choices"][0]["logprobs"]["token_logprobs"] for o in outs]
    assert lp[0] == pytest.approx(lp[1], abs=1e-3)
    details = [o["usage"]["completion_tokens_details"] for o in outs]
    assert details[0] == {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
    assert sum(details[1].values()) > 0, details
    if model == "looper":
        assert details[1]["accepted_prediction_tokens"] > 0


def test_sampled_requests_draft_only_when_asked_and_metrics_count(looper: Server) -> None:
    tiny4 = looper
    _, greedy = run(looper.url, "abc", True, num_predict=30)
    # Whether a sampled text repeats enough to draft depends on the seed. Seed 1 drafts with the
    # llama.cpp of llama-cpp-sys-2 0.1.154 (16 drafted) and of 0.1.161 (15). Seed 5 did with the
    # former only: since 0.1.161 llama.cpp's dist sampler draws a random number even when top-p
    # or min-p left one candidate, so the same seed gives another text.
    sampled = {"temperature": 0.8, "seed": 1, "num_predict": 40, "ignore_eos": True}
    _, final = complete(tiny4.url, REPEAT, **sampled)
    assert final["draft_count"] == 0
    # Asked for, drafts are made, and the sampler still draws every token: same seed, same text.
    a, _ = complete(tiny4.url, REPEAT, {"speculative": False}, **sampled)
    b, fb = complete(tiny4.url, REPEAT, {"speculative": True}, **sampled)
    assert a == b
    assert fb["draft_count"] > 0
    # `options.speculative` works too (Ollama's requests have no top-level extras).
    _, fc = complete(tiny4.url, REPEAT, speculative=True, **sampled)
    assert fc["draft_count"] > 0
    text = httpx.get(f"{tiny4.url}/metrics").text

    def value(name: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith(f"llamarunner:{name}{{"))
        return float(line.rsplit(" ", 1)[1])

    drafted = value("spec_decode_num_draft_tokens_total")
    assert drafted >= fb["draft_count"] + fc["draft_count"] + greedy["draft_count"]
    accepted = value("spec_decode_num_accepted_tokens_total")
    assert greedy["draft_accepted_count"] <= accepted <= drafted


def test_adaptive_drafting_drafts_a_loop_and_keeps_its_text(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Without `draft_always` (the default), a greedy request in a loop makes right guesses,
    drafts, and has its drafts accepted; the text is the text without drafts."""
    with Server(
        str(loop_model(tmp_path_factory)), port=0, parallel=2, ctx_size=512, threads=2
    ) as srv:
        plain, _ = run(srv.url, "abc", False, num_predict=120)
        drafted, final = run(srv.url, "abc", True, num_predict=120)
    assert drafted == plain
    assert final["draft_accepted_count"] > 20, final
    assert final["draft_accepted_count"] >= 0.8 * final["draft_count"], final


@pytest.mark.parametrize("bad", ["yes", 1, 0, [], {}])
def test_a_speculative_field_that_is_not_a_boolean_is_a_400(tiny4: Server, bad: Any) -> None:
    cases = [
        ("/completion", {"prompt": "x", "speculative": bad}),
        ("/completion", {"prompt": "x", "options": {"speculative": bad}}),
        ("/v1/completions", {"prompt": "x", "speculative": bad}),
        ("/api/generate", {"model": "tiny", "prompt": "x", "options": {"speculative": bad}}),
    ]
    for path, body in cases:
        r = httpx.post(f"{tiny4.url}{path}", json=body, timeout=30)
        assert r.status_code == 400, (path, body, r.text)
        assert "speculative" in r.text, r.text
    wait_idle(tiny4.url)


def test_speculation_off_server_wide(tiny_model: Path, start_server: Any) -> None:
    # Both look up 1-grams and verify every draft found (`draft_always`): no drafts is then
    # `draft_max` 0's doing, not what the adaptation measured on a loaded machine.
    srv = start_server(tiny_model, draft_max=0, spec_ngram=1, draft_always=True)
    plain, final = run(srv.url, REPEAT, True, num_predict=60)
    assert final["draft_count"] == 0
    srv2 = start_server(tiny_model, draft_max=4, draft_min=2, spec_ngram=1, draft_always=True)
    text, final = complete(
        srv2.url, REPEAT, temperature=0, num_predict=60, ignore_eos=True, repeat_penalty=1.0
    )
    assert text == plain
    assert final["draft_count"] > 0


@pytest.mark.parametrize(
    "settings, name",
    [
        ({"draft_max": 65}, "draft-max"),
        ({"draft_max": -1}, "draft-max"),
        ({"draft_max": 4, "draft_min": 5}, "draft-min"),
        ({"spec_ngram": 0}, "spec-ngram"),
        ({"spec_ngram": 33}, "spec-ngram"),
    ],
)
def test_bad_speculation_settings_are_refused(
    tiny_model: Path, settings: dict[str, int], name: str
) -> None:
    with pytest.raises(ValueError, match=name):
        Server(str(tiny_model), port=0, **settings).start()


def test_flags_and_environment_reach_the_config(tiny_model: Path) -> None:
    cfg = ServerConfig.resolve(
        {"draft_max": 16}, env={"LLAMARUNNER_DRAFT_MIN": "3", "LLAMARUNNER_SPEC_NGRAM": "4"}
    )
    assert (cfg.draft_max, cfg.draft_min, cfg.spec_ngram) == (16, 3, 4)
    out = subprocess.run(
        [sys.executable, "-m", "llamarunner", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    for flag in ("--draft-max", "--draft-min", "--spec-ngram"):
        assert flag in out
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "llamarunner",
            "serve",
            str(tiny_model),
            "--draft-max",
            "100",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "draft-max" in r.stderr


# --- the default model ---------------------------------------------------------------------

PASSAGE = (
    "The river town woke slowly. Fishermen pulled their boats onto the gravel, the baker "
    "opened his shutters, and the schoolteacher walked the long way round to avoid the mud. "
    "By nine the market square was full of voices: farmers selling apples and cheese, a "
    "tinker mending pots, children chasing a dog that had stolen a loaf. "
)


@pytest.fixture(scope="module")
def gemma(default_model: Path) -> Iterator[Server]:
    with Server(str(default_model), port=0, parallel=4, ctx_size=1024, threads=2) as srv:
        yield srv


def gemma_prompt(i: int) -> str:
    chunk = PASSAGE.replace("river", ["river", "harbour", "mountain", "forest"][i % 4])
    return (
        "<start_of_turn>user\nRepeat the following text exactly, word for word.\n\n"
        f"{chunk}<end_of_turn>\n<start_of_turn>model\n"
    )


@pytest.mark.real_model
def test_default_model_greedy_text_with_drafts_is_the_text_without(gemma: Server) -> None:
    prompt = gemma_prompt(0)
    plain = openai_greedy(gemma.url, prompt, 64, speculative=False)
    drafted = openai_greedy(gemma.url, prompt, 64, speculative=True)
    same_or_near_tie(choice_logprobs(plain), choice_logprobs(drafted))
    # The model repeats its input: most drafts are right.
    details = drafted["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 20, details
    # The native dialect: the same request with drafts. (Not the same counts: how much is
    # drafted follows the step times measured as the server runs, so two runs may draft
    # differently, and so decode their positions in batches of other widths.)
    text, final = run(gemma.url, prompt, True, num_predict=64, ignore_eos=False)
    text_same_or_near_tie(plain, text)
    assert final["draft_accepted_count"] > 20, final


@pytest.fixture(scope="module")
def gemma_drafting_always(default_model: Path) -> Iterator[Server]:
    """The default model with drafts verified at every width (`--draft-always`): by default a
    step of 3 or more sequences drafts only after a try there paid (`sched/payoff.rs`), which
    on a CPU it does not."""
    with Server(
        str(default_model), port=0, parallel=4, ctx_size=1024, threads=2, draft_always=True
    ) as srv:
        yield srv


@pytest.mark.real_model
def test_default_model_four_concurrent_with_drafts_match_their_plain_text(
    gemma_drafting_always: Server,
) -> None:
    gemma = gemma_drafting_always
    prompts = [gemma_prompt(i) for i in range(4)]
    plain = [openai_greedy(gemma.url, p, 48, speculative=False) for p in prompts]
    wait_idle(gemma.url)
    body = {
        "max_tokens": 48,
        "temperature": 0,
        "logprobs": 2,
        "speculative": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    together, slots = run_together(
        gemma.url,
        [{"prompt": p, **body} for p in prompts],
        "/v1/completions",
        openai_stream,
    )
    assert_all_busy(slots, 4)
    equal = 0
    for want, (text, final) in zip(plain, together):
        assert "".join(final["logprobs"]["tokens"]) == text
        equal += same_or_near_tie(choice_logprobs(want), final["logprobs"])
    details = [final["usage"]["completion_tokens_details"] for _, final in together]
    assert all(
        d["accepted_prediction_tokens"] + d["rejected_prediction_tokens"] > 0 for d in details
    ), details
    # Most streams matched exactly.
    assert equal >= 2, equal
