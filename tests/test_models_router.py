"""Many models behind one endpoint (`serve --models-dir DIR`, several MODELs): routing by the
request's `model` in every dialect, listings, load on demand (once), `--models-max`,
`keep_alive`, load/unload routes, a model that fails to load, an engine killed mid-stream,
and hostile names and bodies, against `llamarunner serve` in a subprocess with tiny models
that each write their own word."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import WatchedServer, parse_ndjson
from tinymodel import write_cycle_model

pytestmark = pytest.mark.timeout(600)

WORDS = {"alpha": "alph ", "bravo": "brvo "}
TIMEOUT = 60.0


def make_models_dir(root: Path) -> Path:
    d = root / "models"
    d.mkdir()
    for name, text in WORDS.items():
        write_cycle_model(d / f"{name}.gguf", text)
    return d


def start(models_dir: Path, log_dir: Path, *flags: str) -> WatchedServer:
    return WatchedServer(
        None, log_dir, "--models-dir", str(models_dir), "--ctx-size", "256", *flags
    )


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_models_dir(tmp_path_factory.mktemp("router"))


@pytest.fixture(scope="module")
def router(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WatchedServer]:
    srv = start(models_dir, tmp_path_factory.mktemp("router-log"), "--keep-alive", "-1")
    yield srv
    srv.stop()


def completion(url: str, model: str, n: int = 10, **extra: Any) -> httpx.Response:
    body = {"model": model, "prompt": "x", "max_tokens": n, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)


def statuses(url: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{url}/models", timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return {m["id"]: m["status"] for m in r.json()["data"]}


def starts(url: str, model: str) -> int:
    """How many times the router has started `model`'s engine (its metric)."""
    metrics = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    name = f'llamarunner:router_model_starts_total{{model_name="{model}"}} '
    return next(int(float(ln[len(name) :])) for ln in metrics.splitlines() if ln.startswith(name))


def wait_status(url: str, model: str, value: str, within: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while True:
        s = statuses(url)[model]
        if s["value"] == value or time.monotonic() > deadline:
            assert s["value"] == value, s
            return s
        time.sleep(0.05)


def test_each_dialect_reaches_the_model_it_names(router: WatchedServer) -> None:
    url = router.url
    for name, text in WORDS.items():
        r = completion(url, name)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == (text * 3)[:10]
        assert r.json()["model"] == name
        g = httpx.post(
            f"{url}/api/generate",
            json={"model": name, "prompt": "x", "stream": False, "options": {"num_predict": 5}},
            timeout=TIMEOUT,
        )
        assert g.status_code == 200, g.text
        assert g.json()["response"] == text[:5]
        n = httpx.post(
            f"{url}/completion",
            json={"model": name, "prompt": "x", "options": {"num_predict": 5, "temperature": 0}},
            timeout=TIMEOUT,
        )
        assert "".join(c.get("content", "") for c in parse_ndjson(n.text)) == text[:5]
        # Ollama's clients add ":latest"; a GET takes the model as ?model=.
        assert completion(url, f"{name}:latest").status_code == 200
        props = httpx.get(f"{url}/props", params={"model": name}, timeout=TIMEOUT)
        assert props.status_code == 200 and props.json()["model_alias"] == name
        a = httpx.post(
            f"{url}/v1/messages",
            json={
                "model": name,
                "max_tokens": 5,
                "temperature": 0,
                "messages": [{"role": "user", "content": "x"}],
            },
            timeout=TIMEOUT,
        )
        assert a.status_code == 200, a.text
        assert a.json()["content"] == [{"type": "text", "text": text[:5]}]
        assert a.json()["model"] == name
        resp = httpx.post(
            f"{url}/v1/responses",
            json={"model": name, "input": "x", "max_output_tokens": 5, "temperature": 0},
            timeout=TIMEOUT,
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["output"][0]["content"][0]["text"] == text[:5]


def test_listings_name_every_model_and_say_which_are_loaded(router: WatchedServer) -> None:
    url = router.url
    assert completion(url, "alpha").status_code == 200
    ids = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    assert ids == ["alpha", "bravo"]
    assert [m["name"] for m in httpx.get(f"{url}/api/tags").json()["models"]] == ids
    loaded = {m["name"]: m for m in httpx.get(f"{url}/api/ps").json()["models"]}
    assert "alpha" in loaded
    # The engine's own account of its GPU share (0 on a machine without a GPU).
    props = httpx.get(f"{url}/props", params={"model": "alpha"}).json()
    assert loaded["alpha"]["size_vram"] == props["devices"]["vram_bytes"]
    alpha = statuses(url)["alpha"]
    assert alpha["value"] == "loaded" and alpha["memory_bytes"] > 0 and alpha["pid"] > 0
    one = httpx.get(f"{url}/v1/models/alpha")
    assert one.status_code == 200 and one.json()["id"] == "alpha"
    h = httpx.get(f"{url}/health")
    assert h.status_code == 200 and h.json()["status"] == "ready"


def test_metrics_carry_each_models_name_in_one_exposition(router: WatchedServer) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    url = router.url
    for name in WORDS:
        assert completion(url, name).status_code == 200
    r = httpx.get(f"{url}/metrics", timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    generated = {
        s.labels["model_name"]: s.value
        for s in families["llamarunner:generation_tokens"].samples
        if s.name.endswith("_total")
    }
    assert set(generated) == set(WORDS) and min(generated.values()) >= 10, generated
    # Each family's HELP and TYPE once, with both models' samples under it.
    assert r.text.count("# TYPE llamarunner:generation_tokens_total ") == 1
    state = {
        (s.labels["model_name"], s.labels["state"]): s.value
        for s in families["llamarunner:router_model_state"].samples
    }
    assert state[("alpha", "loaded")] == 1 and state[("alpha", "unloaded")] == 0
    starts = {
        s.labels["model_name"]: s.value
        for s in families["llamarunner:router_model_starts"].samples
        if s.name.endswith("_total")
    }
    assert starts["alpha"] >= 1, starts


def test_unknown_and_missing_models_get_errors_in_the_dialects_shape(
    router: WatchedServer,
) -> None:
    url = router.url
    r = completion(url, "nope")
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["type"] and "alpha" in err["message"] and "bravo" in err["message"]
    o = httpx.post(f"{url}/api/generate", json={"model": "nope", "prompt": "x"})
    assert o.status_code == 404 and isinstance(o.json()["error"], str), o.text
    assert httpx.get(f"{url}/v1/models/nope").status_code == 404
    # With several models, one must be named.
    m = httpx.post(f"{url}/v1/completions", json={"prompt": "x"})
    assert m.status_code == 400 and "alpha" in m.text, m.text
    bad = httpx.post(f"{url}/v1/completions", content=b"{not json")
    assert bad.status_code == 400, bad.text
    a = httpx.post(f"{url}/v1/messages", json={"model": "nope", "max_tokens": 1, "messages": []})
    assert a.status_code == 404, a.text
    assert a.json()["type"] == "error" and a.json()["error"]["type"] == "not_found_error"
    assert "alpha" in a.json()["error"]["message"]


def test_load_and_unload_routes(router: WatchedServer) -> None:
    url = router.url
    r = httpx.post(f"{url}/models/load", json={"model": "bravo"}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json() == {"success": True}, r.text
    assert statuses(url)["bravo"]["value"] == "loaded"
    r = httpx.post(f"{url}/models/unload", json={"model": "bravo"}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert statuses(url)["bravo"]["value"] == "unloaded"
    assert completion(url, "bravo").status_code == 200  # loaded again on demand
    for body in ({}, {"model": 3}, {"model": ""}, [1]):
        assert httpx.post(f"{url}/models/load", json=body).status_code == 400, body
    assert httpx.post(f"{url}/models/load", json={"model": "nope"}).status_code == 404
    assert httpx.post(f"{url}/models/load", content=b"\xff").status_code == 400


def test_a_get_loads_no_model_and_ollamas_unload_loads_none_first(
    models_dir: Path, tmp_path: Path
) -> None:
    srv = start(models_dir, tmp_path)
    url = srv.url
    try:
        # A web page's <img src=".../props?model=bravo"> must not pull models into memory.
        r = httpx.get(f"{url}/props", params={"model": "bravo"}, timeout=TIMEOUT)
        assert r.status_code == 503 and "POST /models/load" in r.text, r.text
        assert statuses(url)["bravo"]["value"] == "unloaded"
        # `ollama stop` (no prompt, keep_alive 0) on a model that is not loaded loads nothing.
        stop = {"model": "bravo", "keep_alive": 0}
        r = httpx.post(f"{url}/api/generate", json=stop, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["done_reason"] == "unload", r.text
        assert statuses(url)["bravo"]["value"] == "unloaded"
        # On a loaded one it unloads it; /api/chat with no messages too.
        assert completion(url, "bravo").status_code == 200
        assert httpx.get(f"{url}/props", params={"model": "bravo"}).status_code == 200
        r = httpx.post(f"{url}/api/chat", json={**stop, "messages": []}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        assert r.json()["done_reason"] == "unload" and r.json()["message"]["content"] == ""
        assert statuses(url)["bravo"]["value"] == "unloaded"
        assert starts(url, "bravo") == 1
    finally:
        srv.stop()


def test_posts_to_unknown_routes_and_padded_names_load_nothing(
    models_dir: Path, tmp_path: Path
) -> None:
    srv = start(models_dir, tmp_path)
    url = srv.url
    try:
        # No engine serves these routes: a 404 from the router, with no model loaded for it.
        for route in ("/no/such/route", "/api/delete", "/v1/chat/completions/x"):
            r = httpx.post(f"{url}{route}", json={"model": "bravo"}, timeout=TIMEOUT)
            assert r.status_code == 404, (route, r.text)
        # Nor GETs, whatever model they name, or none.
        for route in ("/no/such/route", "/v1/nope", "/no/such/route?model=bravo"):
            r = httpx.get(f"{url}{route}", timeout=TIMEOUT)
            assert r.status_code == 404 and "no route for GET" in r.text, r.text
        # Ollama's pull of a model served here: there already, nothing loaded.
        r = httpx.post(f"{url}/api/pull", json={"model": "bravo"}, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json() == {"status": "success"}
        for route in ("/props", "/slots", "/v1/responses/resp_1"):
            r = httpx.post(f"{url}{route}", json={"model": "bravo"}, timeout=TIMEOUT)
            assert r.status_code == 405, (route, r.text)
        # Names are exact, as the engines compare them: a padded one is not served.
        for name in (" bravo ", "bravo\n", "  "):
            r = completion(url, name)
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        assert statuses(url)["bravo"]["value"] == "unloaded"
        assert starts(url, "bravo") == 0
    finally:
        srv.stop()


def test_names_that_are_other_models_tags_or_file_names_reach_their_own_model(
    tmp_path: Path,
) -> None:
    # alpha.gguf.gguf is served as "alpha.gguf" and alpha:latest.gguf as "alpha:latest": the
    # exact name comes before another model's tag or file name.
    d = tmp_path / "models"
    d.mkdir()
    words = {"alpha": "alph ", "alpha.gguf": "dotg ", "alpha:latest": "late "}
    for name, text in words.items():
        write_cycle_model(d / f"{name}.gguf", text)
    srv = start(d, tmp_path)
    try:
        listed = httpx.get(f"{srv.url}/v1/models", timeout=TIMEOUT).json()["data"]
        assert sorted(m["id"] for m in listed) == sorted(words)
        for name, text in words.items():
            r = completion(srv.url, name)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == (text * 2)[:10], name
            assert r.json()["model"] == name
    finally:
        srv.stop()


def test_a_request_just_after_its_idle_engine_is_killed_starts_it_again(
    models_dir: Path, tmp_path: Path
) -> None:
    # The request reaches a dead engine's port before the router has seen the process end:
    # unanswered, it waits for the exit and goes to the model started again.
    slots = tmp_path / "slots"
    srv = start(models_dir, tmp_path, "--slot-save-path", str(slots))
    url = srv.url
    try:
        for _ in range(4):
            assert completion(url, "alpha").status_code == 200
            pid = statuses(url)["alpha"]["pid"]
            os.kill(pid, signal.SIGKILL)
            r = completion(url, "alpha")
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == (WORDS["alpha"] * 2)[:10]
            assert statuses(url)["alpha"]["pid"] != pid
        # A slot action is not sent again: the new engine's slot is empty, and a save would
        # overwrite the file with nothing.
        save = {"model": "alpha", "filename": "kept.bin"}
        r = httpx.post(f"{url}/slots/0?action=save", json=save, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["n_saved"] > 0, r.text
        size = (slots / "kept.bin").stat().st_size
        # `?model=` names the model of a slot action whose body names none.
        query = f"{url}/slots/0?action=save&model=alpha"
        r = httpx.post(query, json={"filename": "query.bin"}, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["n_saved"] > 0, r.text
        os.kill(statuses(url)["alpha"]["pid"], signal.SIGKILL)
        r = httpx.post(f"{url}/slots/0?action=save", json=save, timeout=TIMEOUT)
        assert r.status_code == 503, r.text
        assert (slots / "kept.bin").stat().st_size == size
        assert srv.alive()
    finally:
        srv.stop()


def test_concurrent_first_requests_load_the_model_once(models_dir: Path, tmp_path: Path) -> None:
    srv = start(models_dir, tmp_path)
    try:
        results: list[int] = []

        def one() -> None:
            results.append(completion(srv.url, "alpha").status_code)

        threads = [threading.Thread(target=one) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [200] * 6
        assert srv.log().count("loading a model") == 1, srv.log()
    finally:
        srv.stop()


def test_models_max_unloads_the_idle_model_never_the_busy_one(
    models_dir: Path, tmp_path: Path
) -> None:
    srv = start(models_dir, tmp_path, "--models-max", "1")
    url = srv.url
    try:
        assert completion(url, "alpha").status_code == 200
        assert completion(url, "bravo").status_code == 200
        s = statuses(url)
        assert s["alpha"]["value"] == "unloaded" and s["bravo"]["value"] == "loaded", s
        # bravo busy streaming (until the client leaves): alpha cannot take its place.
        body = {"model": "bravo", "prompt": "x", "max_tokens": 100000, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            busy = completion(url, "alpha")
            assert busy.status_code == 429, busy.text
            assert "models-max" in busy.json()["error"]["message"]
        # The client left: bravo is idle once the router sees it, and gives way.
        deadline = time.monotonic() + 10
        while (r := completion(url, "alpha")).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert r.status_code == 200, r.text
    finally:
        srv.stop()


def test_models_memory_refuses_a_model_that_cannot_fit_and_makes_room_for_one_that_can(
    models_dir: Path, tmp_path: Path
) -> None:
    # A tiny model's estimate: ~2.6 MiB of model, KV and buffers and 64 MiB of engine process.
    for log_dir in ("small", "room"):
        (tmp_path / log_dir).mkdir()
    small = start(models_dir, tmp_path / "small", "--models-memory", "10", "--cache-ram", "0")
    try:
        r = completion(small.url, "alpha")
        assert r.status_code == 507, r.text
        err = r.json()["error"]
        assert err["code"] == "insufficient_memory" and "--models-memory 10 MiB" in err["message"]
        assert statuses(small.url)["alpha"]["value"] == "unloaded"
        assert small.alive()
    finally:
        small.stop()
    srv = start(models_dir, tmp_path / "room", "--models-memory", "100", "--cache-ram", "0")
    url = srv.url
    try:
        assert completion(url, "alpha").status_code == 200
        estimate = statuses(url)["alpha"]["memory_estimate_bytes"]
        assert 64 << 20 < estimate < 100 << 20, estimate
        assert completion(url, "bravo").status_code == 200  # alpha, idle, gave way
        s = statuses(url)
        assert s["alpha"]["value"] == "unloaded" and s["bravo"]["value"] == "loaded", s
        body = {"model": "bravo", "prompt": "x", "max_tokens": 100000, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            busy = completion(url, "alpha")
            assert busy.status_code == 503, busy.text
            assert "--models-memory" in busy.json()["error"]["message"]
    finally:
        srv.stop()


def test_keep_alive_zero_and_idle_expiry_unload(models_dir: Path, tmp_path: Path) -> None:
    srv = start(models_dir, tmp_path, "--keep-alive", "3s")
    url = srv.url
    try:
        g = httpx.post(
            f"{url}/api/generate",
            json={"model": "alpha", "prompt": "x", "stream": False, "keep_alive": 0},
            timeout=TIMEOUT,
        )
        assert g.status_code == 200, g.text
        wait_status(url, "alpha", "unloaded", within=3)
        assert completion(url, "bravo").status_code == 200
        assert statuses(url)["bravo"]["value"] == "loaded"
        wait_status(url, "bravo", "unloaded", within=10)  # idle past --keep-alive 3s
        # A request's keep_alive -1 keeps it past the server's default.
        g = httpx.post(
            f"{url}/api/generate",
            json={"model": "bravo", "prompt": "x", "stream": False, "keep_alive": "-1"},
            timeout=TIMEOUT,
        )
        assert g.status_code == 200, g.text
        time.sleep(4)
        assert statuses(url)["bravo"]["value"] == "loaded"
        bad = httpx.post(
            f"{url}/api/generate",
            json={"model": "bravo", "prompt": "x", "keep_alive": "soon"},
            timeout=TIMEOUT,
        )
        assert bad.status_code == 400 and "keep_alive" in bad.json()["error"], bad.text
    finally:
        srv.stop()


def test_a_model_that_fails_to_load_leaves_the_others_serving(
    tmp_path: Path,
) -> None:
    d = make_models_dir(tmp_path)
    (d / "broken.gguf").write_bytes(b"GGUF" + os.urandom(4000))
    (d / "notgguf.gguf").write_bytes(b"PK\x03\x04" + os.urandom(4000))
    srv = start(d, tmp_path)
    url = srv.url
    try:
        r = completion(url, "broken")
        assert r.status_code == 500, r.text
        assert r.json()["error"]["message"], r.text
        s = statuses(url)["broken"]
        assert s["value"] == "failed" and s["error"], s
        h = httpx.get(f"{url}/health").json()
        assert h["status"] == "ready"
        assert next(m for m in h["models"] if m["id"] == "broken")["status"] == "failed"
        # A file that is not a GGUF model ends its engine before it serves: the reason it
        # wrote on its way out is the one given.
        r = completion(url, "notgguf")
        assert r.status_code == 500, r.text
        assert "is not a GGUF model file" in r.json()["error"]["message"], r.text
        assert "is not a GGUF model file" in statuses(url)["notgguf"]["error"]
        assert completion(url, "alpha").status_code == 200
        assert srv.alive()
    finally:
        srv.stop()


def test_an_engine_killed_mid_stream_fails_its_stream_only_and_restarts(
    models_dir: Path, tmp_path: Path
) -> None:
    srv = start(models_dir, tmp_path)
    url = srv.url
    try:
        assert completion(url, "alpha").status_code == 200
        assert completion(url, "bravo").status_code == 200
        pid = statuses(url)["alpha"]["pid"]
        other: dict[str, Any] = {}

        def bravo_stream() -> None:
            body = {"model": "bravo", "prompt": "x", "max_tokens": 300, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
                other["lines"] = [ln for ln in r.iter_lines() if ln]

        body = {"model": "alpha", "prompt": "x", "max_tokens": 100000, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            t = threading.Thread(target=bravo_stream)
            t.start()
            os.kill(pid, signal.SIGKILL)
            rest = [ln for ln in lines if ln.startswith("data: ")]
        t.join()
        last = json.loads(rest[-1][len("data: ") :])
        assert "error" in last, rest[-3:]
        assert other["lines"][-1] == "data: [DONE]", other["lines"][-3:]
        wait_status(url, "alpha", "failed")
        assert completion(url, "alpha").status_code == 200  # started again
        assert statuses(url)["alpha"]["pid"] != pid
    finally:
        srv.stop()


def test_the_router_stops_its_engines(models_dir: Path, tmp_path: Path) -> None:
    srv = start(models_dir, tmp_path)
    assert completion(srv.url, "alpha").status_code == 200
    pid = statuses(srv.url)["alpha"]["pid"]
    assert srv.stop() == 0
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_a_presets_file_gives_models_their_own_settings_and_adds_models(
    models_dir: Path, tmp_path: Path
) -> None:
    extra = tmp_path / "elsewhere.gguf"
    write_cycle_model(extra, "chrl ")
    preset = tmp_path / "models.toml"
    preset.write_text(
        f"""
[bravo]
ctx-size = 512
parallel = 2
alias = "b2"

[charlie]
model = "{extra}"
ctx_size = 1024
"""
    )
    srv = start(models_dir, tmp_path, "--models-preset", str(preset))
    url = srv.url
    try:
        assert list(statuses(url)) == ["alpha", "b2", "charlie"]
        for name in ("alpha", "b2", "charlie"):
            assert (
                httpx.post(f"{url}/models/load", json={"model": name}, timeout=TIMEOUT).status_code
                == 200
            )
        props = {
            name: httpx.get(f"{url}/props", params={"model": name}, timeout=TIMEOUT).json()
            for name in ("alpha", "b2", "charlie")
        }
        assert [(p["n_ctx"], p["total_slots"]) for p in props.values()] == [
            (256, 1),  # the flags' --ctx-size 256
            (512, 2),  # --ctx-size is each slot's
            (1024, 1),
        ]
        assert props["b2"]["model_alias"] == "b2"
        assert completion(url, "charlie", n=5).json()["choices"][0]["text"] == "chrl "
        assert completion(url, "bravo").status_code == 404  # served as b2 only
    finally:
        srv.stop()


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("[alpha]\nctx-sise = 5\n", "ctx-sise: no such setting"),
        ("[alpha]\nport = 9000\n", "port is the front's"),
        ('[alpha]\nctx-size = "big"\n', "expected a int"),
        ("[alpha]\nflash-attn = 1\n", "expected a str"),
        ("[alpha\n", "not TOML"),
        ("[ghost]\nctx-size = 64\n", "[ghost] is no model"),
        ("ctx-size = 64\n", "outside a [model] table"),
        ('[alpha]\nalias = "bravo"\n', "two models are served as 'bravo'"),
    ],
)
def test_bad_presets_are_usage_errors(
    models_dir: Path, tmp_path: Path, text: str, fragment: str
) -> None:
    preset = tmp_path / "bad.toml"
    preset.write_text(text)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "llamarunner",
            "serve",
            "--port",
            "0",
            "--models-dir",
            str(models_dir),
            "--models-preset",
            str(preset),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert fragment in r.stderr, r.stderr


NAMES = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["../alpha", "alpha\u0000", "ALPHA", "alpha:", ":latest", "a" * 5000]),
    st.integers(),
    st.none(),
    st.lists(st.text(max_size=3), max_size=2),
)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(name=NAMES, route=st.sampled_from(["/v1/completions", "/api/generate", "/models/load"]))
def test_hostile_model_names_get_client_errors(
    router: WatchedServer, name: Any, route: str
) -> None:
    r = httpx.post(
        f"{router.url}{route}",
        json={"model": name, "prompt": "x", "stream": False},
        timeout=TIMEOUT,
    )
    assert r.status_code in (400, 404), (name, r.status_code, r.text)
    assert router.alive()


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--models-dir", "/nonexistent/models"], "not a directory"),
        (["--models-dir", "EMPTY"], "no models"),
        (["--models-dir", "MODELS", "--alias", "x"], "--alias"),
        (["--models-dir", "MODELS", "--keep-alive", "soon"], "--keep-alive"),
        (["--models-dir", "MODELS", "--models-max", "0"], "--models-max"),
        (["MODELS/alpha.gguf", "--models-max", "2"], "--models-max"),
        (["MODELS/alpha.gguf", "--models-memory", "2"], "--models-memory"),
        (["--models-dir", "MODELS", "--models-memory", "-2"], "--models-memory -2"),
    ],
)
def test_bad_router_settings_are_usage_errors(
    models_dir: Path, tmp_path: Path, flags: list[str], fragment: str
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    args = [a.replace("EMPTY", str(empty)).replace("MODELS", str(models_dir)) for a in flags]
    r = subprocess.run(
        [sys.executable, "-m", "llamarunner", "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert fragment in r.stderr, r.stderr


def test_in_process_server_with_a_models_dir(models_dir: Path) -> None:
    from llamarunner import Server

    with Server(models_dir=models_dir, models_max=1, port=0, ctx_size=256) as srv:
        client = srv.client()
        assert [m["id"] for m in client.models()] == ["alpha", "bravo"]
        client.load("bravo")
        assert statuses(srv.url)["bravo"]["value"] == "loaded"
        answer = client.complete("x", model="alpha", num_predict=5, temperature=0)
        assert answer.text == WORDS["alpha"]
        assert statuses(srv.url)["bravo"]["value"] == "unloaded"  # --models-max 1
        client.unload("alpha")
        assert statuses(srv.url)["alpha"]["value"] == "unloaded"


@pytest.mark.real_model
def test_the_official_clients_switch_between_the_default_model_and_a_tiny_one(
    default_model: Path, tmp_path: Path
) -> None:
    import ollama
    import openai

    from llamarunner import Server

    d = tmp_path / "models"
    d.mkdir()
    (d / "gemma").mkdir()
    (d / "gemma" / default_model.name).symlink_to(default_model)
    write_cycle_model(d / "alpha.gguf", WORDS["alpha"])
    question = [{"role": "user", "content": "What is the capital of France?"}]
    with Server(models_dir=d, port=0, ctx_size=1024, threads=2) as srv:
        oa = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        assert sorted(m.id for m in oa.models.list()) == ["alpha", "gemma"]
        for _ in range(2):  # switching back and forth
            r = oa.chat.completions.create(
                model="gemma", messages=question, max_tokens=12, temperature=0
            )
            # (Greedy text is not compared across requests: llama.cpp's CPU kernels are not
            # batch-invariant, and a cached prefix changes the prompt's batches.)
            assert r.model == "gemma" and r.choices[0].message.content, r
            assert r.usage is not None and r.usage.completion_tokens == 12
            stream = oa.completions.create(
                model="alpha", prompt="x", max_tokens=10, temperature=0, stream=True
            )
            assert "".join(c.choices[0].text for c in stream) == (WORDS["alpha"] * 2)[:10]
        ol = ollama.Client(host=srv.url)
        assert {m.model for m in ol.list().models} == {"alpha", "gemma"}
        chat = ol.chat(
            model="gemma:latest",
            messages=question,
            options={"num_predict": 12, "temperature": 0},
        )
        assert chat.message.content and chat.eval_count == 12, chat
        assert {m.model for m in ol.ps().models} == {"alpha", "gemma"}
        with pytest.raises(ollama.ResponseError) as e:
            ol.generate(model="nope", prompt="x")
        assert e.value.status_code == 404 and "gemma" in str(e.value)


def test_a_sliding_window_models_estimate_is_near_what_it_takes(
    default_model: Path, tmp_path: Path
) -> None:
    # Gemma 3: 15 of its 18 layers slide over 512 tokens. With 4 slots of 8,192 tokens, llama.cpp
    # gives those layers 4 x 1,024 cells, not 4 x 8,192: counting them whole doubled the
    # estimate (1,021 MB against 500 MB taken); `--swa-full` gives them the whole context.
    d = tmp_path / "models"
    d.mkdir()
    (d / "gemma.gguf").symlink_to(default_model)
    taken = {}
    for swa_full in (False, True):
        log_dir = tmp_path / f"log-{swa_full}"
        log_dir.mkdir()
        flags = ["--ctx-size", "8192", "--parallel", "4", "--cache-ram", "0"]
        srv = WatchedServer(
            None, log_dir, "--models-dir", str(d), *flags, *(["--swa-full"] if swa_full else [])
        )
        try:
            r = httpx.post(f"{srv.url}/models/load", json={"model": "gemma"}, timeout=TIMEOUT)
            assert r.status_code == 200, r.text
            assert completion(srv.url, "gemma", n=4).status_code == 200
            s = statuses(srv.url)["gemma"]
            taken[swa_full] = (s["memory_estimate_bytes"], s["memory_bytes"])
        finally:
            srv.stop()
    (estimate, rss), (full_estimate, full_rss) = taken[False], taken[True]
    # Windowed: within a few tens of MB of what the engine holds, on the high side.
    assert 0.9 * rss < estimate < 1.4 * rss, taken
    # The full cache's extra 15 x 4 x 7,168 cells of 1 KiB each (440 MiB) are in its estimate.
    cells = 15 * 4 * (8192 - 1024)
    assert full_estimate - estimate == cells * 1024, taken
    assert full_rss > rss + 0.5 * cells * 1024, taken


def test_an_engine_process_imports_only_the_core() -> None:
    # Every load starts `python -m llamarunner._engine`: importing the client (httpx) and the
    # package's metadata with it took ~0.3 s of each load.
    heavy = ("httpx", "llamarunner.client", "llamarunner.server", "importlib.metadata")
    code = f"import sys, llamarunner._engine; print([m for m in {heavy!r} if m in sys.modules])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
    # The package's names are all still there, on first use.
    code = "import llamarunner; print(all(getattr(llamarunner, n) for n in llamarunner.__all__))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "True", r.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["a.gguf", "b.gguf", "--alias", "one"], "--alias names one model"),
        (["m.gguf", "--models-max", "2"], "are for many models"),
        (["m.gguf", "--keep-alive", "5m"], "are for many models"),
    ],
)
def test_serve_refuses_flags_that_do_not_go_with_its_models(flags: list[str], message: str) -> None:
    cmd = [sys.executable, "-m", "llamarunner", "serve", *flags, "--port", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr


def test_engines_load_one_after_another(models_dir: Path, tmp_path: Path) -> None:
    """Two models asked for at once: the second engine starts once the first is ready, so that
    each engine's fit before load sees the GPU memory the other already holds."""
    srv = start(models_dir, tmp_path)
    try:
        results: list[int] = []

        def one(name: str) -> None:
            results.append(completion(srv.url, name).status_code)

        threads = [threading.Thread(target=one, args=(n,)) for n in ("alpha", "bravo")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [200, 200]
        # The router's lines (an engine's own "model loaded" line names no vram_bytes).
        events = [
            ("start" if "loading a model" in line else "ready", line)
            for line in srv.log().splitlines()
            if "loading a model" in line or ("model loaded" in line and "vram_bytes=" in line)
        ]
        assert [kind for kind, _ in events] == ["start", "ready", "start", "ready"], events
    finally:
        srv.stop()
