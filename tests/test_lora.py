"""LoRA adapters end to end on the tiny model: several adapters with scales (``--lora
PATH[:SCALE]``), per request (``lora`` in native, OpenAI and Ollama requests), the default scales
(``GET``/``POST /lora-adapters``), batching and prefix caching by scale set, and every error
path. The reference for an adapter set is the tiny model with those adapters merged into its
weights (``W + scale * B @ A``), served without adapters: greedy output must match it exactly.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from llamarunner import ModelLoadError, Server
from llamarunner.config import ServerConfig

from helpers import assert_all_busy, complete, run_together, wait_idle
from tinylora import Pairs, merged_tensors, tiny_adapter, write_adapter
from tinymodel import write_tiny_model

set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "llamarunner-hypothesis")

GREEDY: dict[str, Any] = {
    "temperature": 0,
    "num_predict": 12,
    "ignore_eos": True,
    "repeat_penalty": 1.0,
}
PROMPTS = ("the cat is", "hello world", "of the dog")
# Two adapters on different tensors, so that together they differ from either alone.
NAMES_0 = ["output.weight", "blk.0.attn_q.weight", "blk.0.attn_v.weight"]
NAMES_1 = ["blk.1.ffn_down.weight", "blk.0.attn_output.weight"]


class Fixture:
    """The adapters' files and pairs, and a server with both loaded at default scale 0."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path0, self.pairs0 = tiny_adapter(root / "first.gguf", NAMES_0, seed=7)
        self.path1, self.pairs1 = tiny_adapter(root / "second.gguf", NAMES_1, seed=8)
        self.server = Server(
            str(write_tiny_model(root / "tiny.gguf")),
            port=0,
            threads=2,
            parallel=4,
            ctx_size=512,
            lora=[f"{self.path0}:0", f"{self.path1}:0"],
        )
        self._references: dict[tuple[float, float], Server] = {}

    def reference(self, s0: float, s1: float) -> Server:
        """A server of the tiny model with the adapters merged in at these scales."""
        key = (s0, s1)
        if key not in self._references:
            adapters: list[tuple[Pairs, float]] = [(self.pairs0, s0), (self.pairs1, s1)]
            model = write_tiny_model(
                self.root / f"merged-{s0}-{s1}.gguf", tensors=merged_tensors(adapters)
            )
            srv = Server(str(model), port=0, threads=2)
            srv.start()
            srv.wait_ready(timeout=120)
            self._references[key] = srv
        return self._references[key]

    def close(self) -> None:
        for srv in self._references.values():
            srv.stop()


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fixture]:
    fx = Fixture(tmp_path_factory.mktemp("lora"))
    with fx.server:
        try:
            yield fx
        finally:
            fx.close()


def scales(s0: float, s1: float) -> list[dict[str, Any]]:
    return [{"id": 0, "scale": s0}, {"id": 1, "scale": s1}]


def text_of(url: str, prompt: str, lora_field: Any = None) -> str:
    body = {} if lora_field is None else {"lora": lora_field}
    return complete(url, prompt, body, **GREEDY)[0]


def test_scale_0_is_the_base_model_and_scales_match_the_merged_weights(lora: Fixture) -> None:
    url = lora.server.url
    base = lora.reference(0, 0).url
    for prompt in PROMPTS:
        plain = text_of(base, prompt)
        # Defaults (both at 0), an explicit 0, and an empty list: the base model.
        assert text_of(url, prompt) == plain
        assert text_of(url, prompt, scales(0, 0)) == plain
        assert text_of(url, prompt, []) == plain
        for s0, s1 in ((1, 0), (0, 1), (1, 1), (0.5, -1)):
            got = text_of(url, prompt, scales(s0, s1))
            assert got == text_of(lora.reference(s0, s1).url, prompt), (prompt, s0, s1)
    # The adapters do change the model, and compose: together unlike either alone.
    outputs = {
        s: "".join(text_of(url, p, scales(*s)) for p in PROMPTS)
        for s in ((0, 0), (1, 0), (0, 1), (1, 1))
    }
    assert len(set(outputs.values())) == 4, outputs


def test_listed_adapters_only_and_unlisted_ones_are_off(lora: Fixture) -> None:
    url = lora.server.url
    prompt = PROMPTS[0]
    only_second = text_of(url, prompt, [{"id": 1, "scale": 1}])
    assert only_second == text_of(url, prompt, scales(0, 1))
    assert only_second != text_of(url, prompt, scales(1, 1))


def test_openai_and_ollama_requests_take_scales(lora: Fixture) -> None:
    url = lora.server.url
    prompt = PROMPTS[1]
    want = text_of(url, prompt, scales(1, 1))
    assert want != text_of(url, prompt)
    r = httpx.post(
        f"{url}/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": GREEDY["num_predict"],
            "temperature": 0,
            "ignore_eos": True,
            "lora": scales(1, 1),
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    r = httpx.post(
        f"{url}/api/generate",
        json={
            "model": "tiny",
            "prompt": prompt,
            "raw": True,
            "stream": False,
            "options": {**GREEDY, "lora": scales(1, 1)},
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["response"] == want


def test_post_lora_adapters_sets_the_defaults(lora: Fixture) -> None:
    url = lora.server.url
    listing = httpx.get(f"{url}/lora-adapters").json()
    assert listing == [
        {"id": 0, "path": "first.gguf", "scale": 0.0},
        {"id": 1, "path": "second.gguf", "scale": 0.0},
    ]
    prompt = PROMPTS[2]
    base = text_of(url, prompt)
    try:
        r = httpx.post(f"{url}/lora-adapters", json=[{"id": 1, "scale": 0.5}])
        assert r.status_code == 200, r.text
        assert [a["scale"] for a in r.json()] == [0.0, 0.5]
        assert [a["scale"] for a in httpx.get(f"{url}/lora-adapters").json()] == [0.0, 0.5]
        assert text_of(url, prompt) == text_of(url, prompt, scales(0, 0.5))
        assert text_of(url, prompt) != base
        # A request's own list still wins over the defaults.
        assert text_of(url, prompt, []) == base
    finally:
        httpx.post(f"{url}/lora-adapters", json=[])
    assert text_of(url, prompt) == base


def test_concurrent_requests_of_different_sets_answer_as_each_alone(lora: Fixture) -> None:
    """Four sets at once in four slots: each decode batch holds one set, so every answer is
    the one the request gets alone."""
    url = lora.server.url
    sets = [scales(0, 0), scales(1, 0), scales(0, 1), scales(1, 1)]
    # Long enough for the four to overlap: the slot table, polled while they run, shows all
    # four generating at once (each in a slot of its own, by request id).
    # No drafts: they change the batches' shapes (as in test_native's concurrent test).
    options = {**GREEDY, "num_predict": 256, "speculative": False}
    bodies = [
        {"prompt": f"the {w} is a", "options": options, "lora": s}
        for w, s in zip(("cat", "dog", "world", "hello"), sets)
    ]
    alone = [complete(url, b["prompt"], {"lora": b["lora"]}, **options)[0] for b in bodies]
    wait_idle(url)
    results, slots = run_together(url, bodies)
    assert_all_busy(slots, 4)
    assert all(final["eval_count"] == 256 for _, final in results), results
    assert [text for text, _ in results] == alone
    assert len(set(alone)) == 4


def test_the_prefix_cache_is_not_reused_across_sets(lora: Fixture) -> None:
    """The prompt cached under one set is decoded afresh under a set no request used yet (so
    no slot holds a cache of it), and answers as the merged reference does."""
    url = lora.server.url
    prompt = "zebra quilts: the cat is a dog and the world is"
    body = {"lora": scales(1, 0)}
    complete(url, prompt, body, **GREEDY)
    _, again = complete(url, prompt, body, **GREEDY)
    assert again["prompt_cached_count"] > 0
    other_text, other = complete(url, prompt, {"lora": scales(0.25, 0.25)}, **GREEDY)
    assert other["prompt_cached_count"] == 0
    assert other_text == text_of(lora.reference(0.25, 0.25).url, prompt)


# --- errors ------------------------------------------------------------------------------


BAD_LISTS: list[Any] = [
    {"id": 0, "scale": 1},
    "0:1",
    7,
    [0.5],
    [{"id": 2, "scale": 1}],
    [{"id": -1, "scale": 1}],
    [{"id": "0", "scale": 1}],
    [{"id": 0.5, "scale": 1}],
    [{"id": 0}],
    [{"scale": 1}],
    [{"id": 0, "scale": "1"}],
    [{"id": 0, "scale": None}],
    [{"id": 0, "scale": 1e6}],
    [{"id": 0, "scale": -10.5}],
    [{"id": 0, "scale": 1, "alpha": 2}],
    [{"id": 0, "scale": 1}, {"id": 0, "scale": 0.5}],
    [{"id": 2**64, "scale": 1}],
]


@pytest.mark.parametrize("bad", BAD_LISTS, ids=[repr(b)[:30] for b in BAD_LISTS])
def test_bad_lora_fields_are_400_invalid_lora_in_every_dialect(lora: Fixture, bad: Any) -> None:
    url = lora.server.url
    r = httpx.post(f"{url}/completion", json={"prompt": "hi", "lora": bad})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_lora"
    r = httpx.post(f"{url}/completion", json={"prompt": "hi", "options": {"lora": bad}})
    assert r.status_code == 400, r.text
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "lora": bad},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_lora"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "lora": bad})
    assert r.status_code == 400, r.text
    r = httpx.post(
        f"{url}/api/generate", json={"model": "tiny", "prompt": "hi", "options": {"lora": bad}}
    )
    assert r.status_code == 400, r.text
    assert "lora" in r.json()["error"]
    r = httpx.post(f"{url}/lora-adapters", json=bad)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_lora"


def test_bad_post_lora_adapters_bodies_change_nothing(lora: Fixture) -> None:
    url = lora.server.url
    before = httpx.get(f"{url}/lora-adapters").json()
    for content in (b"", b"{", b"null", b"[{]", "[\u2028]".encode()):
        r = httpx.post(
            f"{url}/lora-adapters", content=content, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400, (content, r.text)
        assert r.json()["error"]["type"] in ("invalid_json", "invalid_lora"), r.text
    r = httpx.post(f"{url}/lora-adapters", json=[{"id": 0, "scale": 1}, {"id": 7, "scale": 1}])
    assert r.status_code == 400
    assert httpx.get(f"{url}/lora-adapters").json() == before
    assert httpx.put(f"{url}/lora-adapters", json=[]).status_code == 405


FINITE = st.floats(allow_nan=False, allow_infinity=False)
ENTRY = st.one_of(
    st.fixed_dictionaries(
        {
            "id": st.one_of(st.integers(-2, 3), FINITE, st.text(max_size=2)),
            "scale": st.one_of(
                st.floats(allow_nan=False, allow_infinity=False, min_value=-20, max_value=20),
                st.integers(-20, 20),
                st.none(),
                st.text(max_size=3),
            ),
        }
    ),
    st.dictionaries(st.text(max_size=5), st.integers() | FINITE | st.none(), max_size=3),
    st.integers() | FINITE | st.text(max_size=4) | st.none(),
)
LORA_VALUES = st.one_of(
    st.lists(ENTRY, max_size=4), st.none(), st.integers(), st.text(max_size=5), ENTRY
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=LORA_VALUES)
def test_hypothesis_lora_fields_get_200_or_400_never_more(lora: Fixture, value: Any) -> None:
    url = lora.server.url
    r = httpx.post(
        f"{url}/completion",
        json={"prompt": "hi", "lora": value, "options": {"num_predict": 2}},
        timeout=30,
    )
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["type"] in ("invalid_lora", "invalid_json"), r.text
    else:
        assert r.text.strip().splitlines()[-1].find('"done":true') >= 0, r.text


def test_the_route_needs_the_api_key(tmp_path: Path, start_server: Callable[..., Server]) -> None:
    path, _ = tiny_adapter(tmp_path / "a.gguf", NAMES_0, seed=1)
    srv = start_server(write_tiny_model(tmp_path / "m.gguf"), lora=[str(path)], api_key=["k"])
    assert httpx.get(f"{srv.url}/lora-adapters").status_code == 401
    assert httpx.post(f"{srv.url}/lora-adapters", json=[]).status_code == 401
    auth = {"Authorization": "Bearer k"}
    assert httpx.get(f"{srv.url}/lora-adapters", headers=auth).json() == [
        {"id": 0, "path": "a.gguf", "scale": 1.0}
    ]


def test_a_slot_file_is_restored_only_under_the_scales_it_was_saved_with(
    tmp_path: Path, start_server: Callable[..., Server]
) -> None:
    """A slot file records the scale set its cache was computed under: restoring it while the
    defaults are another set would serve KV cells of other weights, so it is refused (400
    invalid_slot_file naming the scales) until the defaults are that set again."""
    path, _ = tiny_adapter(tmp_path / "a.gguf", NAMES_0, seed=3)
    srv = start_server(
        write_tiny_model(tmp_path / "m.gguf"),
        lora=[f"{path}:0"],
        slot_save_path=str(tmp_path / "slots"),
    )
    url = srv.url
    complete(url, "the cat is", {"lora": [{"id": 0, "scale": 1.5}]}, **GREEDY)
    wait_idle(url)
    slots = httpx.get(f"{url}/slots", timeout=10).json()
    slot = next(s["id"] for s in slots if s["cached_tokens"] > 0)
    saved = httpx.post(f"{url}/slots/{slot}?action=save", json={"filename": "scaled.bin"})
    assert saved.status_code == 200, saved.text
    refused = httpx.post(f"{url}/slots/{slot}?action=restore", json={"filename": "scaled.bin"})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["type"] == "invalid_slot_file"
    assert "1.5" in refused.json()["error"]["message"]
    # With the defaults set to the file's scales it is the same cache again.
    assert httpx.post(f"{url}/lora-adapters", json=[{"id": 0, "scale": 1.5}]).status_code == 200
    restored = httpx.post(f"{url}/slots/{slot}?action=restore", json={"filename": "scaled.bin"})
    assert restored.status_code == 200, restored.text
    assert restored.json()["n_restored"] == saved.json()["n_saved"] > 0


def test_a_server_without_adapters_refuses_any_id(tiny_server: Server) -> None:
    url = tiny_server.url
    assert httpx.get(f"{url}/lora-adapters").json() == []
    r = httpx.post(f"{url}/completion", json={"prompt": "hi", "lora": [{"id": 0, "scale": 1}]})
    assert r.status_code == 400
    assert "none" in r.json()["error"]["message"]
    r = httpx.post(
        f"{url}/completion",
        json={"prompt": "hi", "lora": [], "options": {"num_predict": 1}},
    )
    assert r.status_code == 200


def load_error(model: Path, lora: list[str]) -> str:
    srv = Server(str(model), port=0, threads=2, lora=lora).start()
    try:
        with pytest.raises(ModelLoadError) as e:
            srv.wait_ready(timeout=60)
        return str(e.value)
    finally:
        srv.stop()


def test_bad_adapter_files_fail_the_load_naming_the_file(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m.gguf")
    good, _ = tiny_adapter(tmp_path / "good.gguf", NAMES_0, seed=1)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + b"\0" * 60)
    # Shapes that do not fit the model (rank 4 on a 64 x 64 tensor, but A has 65 columns).
    wrong = write_adapter(
        tmp_path / "wrong.gguf",
        "llama",
        {"blk.0.attn_q.weight": (np.zeros((4, 65)), np.zeros((64, 4)))},
        4.0,
    )
    # Another architecture's adapter.
    foreign = write_adapter(tmp_path / "foreign.gguf", "gemma3", {}, 4.0)
    for bad in (garbage, wrong, foreign, tmp_path / "missing.gguf"):
        message = load_error(model, [str(good), str(bad)])
        assert "LoRA" in message and bad.name in message, message
        assert "\n" not in message


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llamarunner", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("spec", ["a.gguf:nan", "a.gguf:inf", "a.gguf:11", "a.gguf:-1e9"])
def test_cli_bad_scale_is_one_line_and_exit_2(tiny_model: Path, spec: str) -> None:
    r = run_cli("serve", str(tiny_model), "--port", "0", "--lora", spec)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "LoRA scale" in last, r.stderr


def test_lora_specs_from_the_environment_are_a_comma_list() -> None:
    cfg = ServerConfig.resolve(env={"LLAMARUNNER_LORA": "a.gguf:0.5, C:\\x\\b.gguf"})
    assert cfg.lora == ["a.gguf:0.5", "C:\\x\\b.gguf"]
    assert ServerConfig(lora=[Path("x.gguf")]).lora == ["x.gguf"]


@pytest.mark.parametrize("scale", ["NaN", "Infinity", "-Infinity", "1e999", "-1e400"])
def test_non_finite_scales_in_raw_json_are_400(lora: Fixture, scale: str) -> None:
    url = lora.server.url
    entries = '[{"id": 0, "scale": ' + scale + "}]"
    body = '{"prompt": "hi", "lora": ' + entries + "}"
    for path in ("/completion", "/v1/completions"):
        r = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.text)
    r = httpx.post(
        f"{url}/lora-adapters",
        content=entries,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400, r.text
