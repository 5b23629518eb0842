"""Observability end to end through the built package: `GET /metrics` (parsed with
Prometheus's own parser, counters moving by exactly what known requests did), `--no-metrics`,
request ids (given, made, a hostile one replaced), the access line, and JSON logs of a
`llamarunner serve` subprocess."""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from llamarunner import Server, ServerConfig
from llamarunner.cli import build_parser, serve_settings

from helpers import ServeProcess, ndjson, wait_idle, wait_until

KEY = "metrics-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PREFIX = "llamarunner:"
# Generations that cannot stop early (a random model may write EOS): they end by length.
FIXED = {"ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny model: one slot, one place in the queue (so a 429 is easy to cause), behind an
    API key (so is a 401), served as "tiny"."""
    from tinymodel import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("metrics") / "tiny.gguf")
    with Server(
        str(model),
        port=0,
        parallel=1,
        ctx_size=512,
        threads=2,
        max_queue=1,
        api_key=KEY,
        alias="tiny",
        # A request that asks for endless tokens lasts until its client leaves (the default
        # cap, ten slot contexts, ends it in a second or two: a test thread starved that long
        # saw its 429 probe queued and answered instead).
        max_tokens=10**9,
    ) as s:
        yield s


class Scrape:
    """One `GET /metrics`, parsed by prometheus_client."""

    def __init__(self, url: str) -> None:
        r = httpx.get(f"{url}/metrics", headers=AUTH, timeout=10)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/plain"), r.headers
        self.families: dict[str, Metric] = {
            f.name: f for f in text_string_to_metric_families(r.text)
        }

    def value(self, sample: str, **labels: str) -> float:
        """The sample called ``sample`` (prefix implied) whose labels include ``labels``
        (a bucket's ``le`` compared as a number)."""
        name = PREFIX + sample

        def matches(have: dict[str, str]) -> bool:
            for k, v in labels.items():
                if k == "le" and k in have:
                    if float(have[k]) != float(v):
                        return False
                elif have.get(k) != v:
                    return False
            return True

        found = [
            s.value
            for f in self.families.values()
            for s in f.samples
            if s.name == name and matches(s.labels)
        ]
        assert len(found) == 1, f"{len(found)} samples {name}{labels}"
        return float(found[0])


def delta(before: Scrape, after: Scrape, sample: str, **labels: str) -> float:
    return after.value(sample, **labels) - before.value(sample, **labels)


def test_every_metric_is_exported_with_its_type_and_the_model_name(srv: Server) -> None:
    m = Scrape(srv.url)
    expected = {
        "requests_running": "gauge",
        "requests_waiting": "gauge",
        "num_requests_running": "gauge",
        "num_requests_waiting": "gauge",
        "kv_cache_usage_perc": "gauge",
        "slots_total": "gauge",
        "model_load_seconds": "gauge",
        "model_info": "gauge",
        # prometheus_client names a counter's family without its _total suffix.
        "prompt_tokens": "counter",
        "generation_tokens": "counter",
        "prompt_tokens_cached": "counter",
        "request_success": "counter",
        "requests_rejected": "counter",
        "context_shifts": "counter",
        "prompt_truncations": "counter",
        "time_to_first_token_seconds": "histogram",
        "inter_token_latency_seconds": "histogram",
        "e2e_request_latency_seconds": "histogram",
        "request_queue_time_seconds": "histogram",
        "request_prompt_tokens": "histogram",
        "request_generation_tokens": "histogram",
        "grammar_compile_seconds": "histogram",
        "grammar_compile_failures": "counter",
        "grammar_sequences": "counter",
        "grammar_token_checks": "counter",
        "grammar_masks": "counter",
        "grammar_mask_seconds": "counter",
    }
    for name, kind in expected.items():
        family = m.families.get(PREFIX + name)
        assert family is not None, f"{PREFIX}{name} missing: {sorted(m.families)}"
        assert family.type == kind, (name, family.type)
        assert family.documentation, name
        for sample in family.samples:
            assert sample.labels.get("model_name") == "tiny", sample
    assert m.value("slots_total") == 1
    assert m.value("model_load_seconds") > 0
    assert 0 <= m.value("kv_cache_usage_perc") <= 1
    assert (
        m.value(
            "model_info",
            model="tiny",
            file="tiny.gguf",
            architecture="llama",
            quantization="F32",
            ctx_size="512",
            parallel="1",
        )
        == 1
    )
    for reason in ("stop", "length", "timeout"):
        assert m.value("request_success_total", finished_reason=reason) >= 0
    for reason in ("queue_full", "invalid", "unauthorized", "cancelled"):
        assert m.value("requests_rejected_total", reason=reason) >= 0


def test_grammar_work_is_counted(srv: Server) -> None:
    """A compile per grammar (a refused one counted as a failure too), and per constrained
    sequence its token checks: one per generated token at least."""
    before = Scrape(srv.url)
    r = httpx.post(
        f"{srv.url}/completion",
        json={
            "prompt": "yes or no?",
            "grammar": 'root ::= "yes" | "no"',
            "options": {"temperature": 0, "num_predict": 8},
        },
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    lines = list(ndjson(r))
    generated = lines[-1]["eval_count"]
    assert "".join(line.get("content", "") for line in lines) in ("yes", "no")
    bad = httpx.post(
        f"{srv.url}/completion",
        json={"prompt": "x", "grammar": "root ::= ("},
        headers=AUTH,
        timeout=60,
    )
    assert bad.status_code == 400, bad.text
    wait_idle_keyed(srv.url)
    after = Scrape(srv.url)
    assert delta(before, after, "grammar_compile_seconds_count") == 2
    assert delta(before, after, "grammar_compile_seconds_sum") > 0
    assert delta(before, after, "grammar_compile_failures_total") == 1
    assert delta(before, after, "grammar_sequences_total") == 1
    assert delta(before, after, "grammar_token_checks_total") >= generated
    masks = delta(before, after, "grammar_masks_total")
    assert 0 <= masks <= delta(before, after, "grammar_token_checks_total")
    assert (delta(before, after, "grammar_mask_seconds_total") > 0) == (masks > 0)


def test_counters_move_by_exactly_what_each_dialect_reports(srv: Server) -> None:
    url = srv.url
    wait_idle_keyed(url)
    before = Scrape(url)
    finals: list[tuple[int, int, int]] = []  # (prompt, cached, generated) per generation

    # Native, streamed (twice: the second reuses the first one's cache).
    for _ in range(2):
        with httpx.stream(
            "POST",
            f"{url}/completion",
            headers=AUTH,
            json={"prompt": "hello world", "options": {"num_predict": 4, **FIXED}},
            timeout=60,
        ) as r:
            assert r.status_code == 200
            last = list(ndjson(r))[-1]
        finals.append((last["prompt_eval_count"], last["prompt_cached_count"], last["eval_count"]))
    assert finals[1][1] > 0, "the second prompt should reuse the cache"
    # OpenAI chat, one JSON answer; OpenAI text completion, streamed with usage.
    r = httpx.post(
        f"{url}/v1/chat/completions",
        headers=AUTH,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **FIXED},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    finals.append(
        (u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], u["completion_tokens"])
    )
    r = httpx.post(
        f"{url}/v1/completions",
        headers=AUTH,
        json={
            "prompt": "the cat",
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
            **FIXED,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    chunks = [
        json.loads(line[6:])
        for line in r.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    u = next(c["usage"] for c in chunks if c.get("usage"))
    finals.append(
        (u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], u["completion_tokens"])
    )
    # Ollama: generate as one object, chat streamed (no cached count on Ollama's wire: the
    # native answers above carry it; these two start from a prompt unlike the others').
    ollama: list[tuple[str, dict[str, Any]]] = [
        ("/api/generate", {"prompt": "a dog", "raw": True, "stream": False}),
        ("/api/chat", {"messages": [{"role": "user", "content": "yo"}]}),
    ]
    for path, body in ollama:
        r = httpx.post(
            f"{url}{path}",
            headers=AUTH,
            json={"model": "tiny", **body, "options": {"num_predict": 2, **FIXED}},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        last = json.loads(r.text.strip().split("\n")[-1])
        finals.append((last["prompt_eval_count"], -1, last["eval_count"]))
    # An embedding: its tokens are prompt tokens, it is not a generation.
    r = httpx.post(f"{url}/v1/embeddings", headers=AUTH, json={"input": "hello there"}, timeout=60)
    assert r.status_code == 200, r.text
    embedded = r.json()["usage"]["prompt_tokens"]

    wait_idle_keyed(url)
    after = Scrape(url)
    n = len(finals)
    prompt = sum(f[0] for f in finals)
    generated = sum(f[2] for f in finals)
    assert generated == 4 + 4 + 3 + 5 + 2 + 2
    assert delta(before, after, "generation_tokens_total") == generated
    assert delta(before, after, "prompt_tokens_total") == prompt + embedded
    # Ollama's answers do not say how much of their prompt was cached: between none and all.
    known = sum(f[1] for f in finals if f[1] >= 0)
    unknown = sum(f[0] for f in finals if f[1] < 0)
    assert known > 0
    assert known <= delta(before, after, "prompt_tokens_cached_total") <= known + unknown
    assert delta(before, after, "request_success_total", finished_reason="length") == n
    assert delta(before, after, "request_success_total", finished_reason="stop") == 0
    for histogram in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert delta(before, after, f"{histogram}_count") == n, histogram
    # One gap between each two consecutive tokens of a request.
    assert delta(before, after, "inter_token_latency_seconds_count") == generated - n
    assert delta(before, after, "request_generation_tokens_sum") == generated
    assert delta(before, after, "request_prompt_tokens_sum") == prompt
    # Buckets are cumulative, the last one is everything.
    assert delta(before, after, "request_generation_tokens_bucket", le="+Inf") == n
    assert delta(before, after, "request_generation_tokens_bucket", le="5.0") == n
    assert delta(before, after, "request_generation_tokens_bucket", le="2.0") == 2
    for reason in ("invalid", "queue_full", "unauthorized", "cancelled"):
        assert delta(before, after, "requests_rejected_total", reason=reason) == 0
    # Scraping changes nothing: counters never reset.
    again = Scrape(url)
    assert again.value("generation_tokens_total") == after.value("generation_tokens_total")


def wait_idle_keyed(url: str) -> None:
    """Waits until no request holds the slot or waits (the tiny server needs its key)."""

    def idle() -> bool:
        m = Scrape(url)
        return m.value("requests_running") == 0 and m.value("requests_waiting") == 0

    wait_until(idle, "the server to be idle", timeout=30)


def test_rejections_are_counted_by_reason(srv: Server) -> None:
    url = srv.url
    wait_idle_keyed(url)
    before = Scrape(url)
    # 400: a body that is not JSON, and an option out of range.
    r = httpx.post(f"{url}/completion", headers=AUTH, content=b"{", timeout=10)
    assert r.status_code == 400
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"prompt": "x", "n": 9}, timeout=10)
    assert r.status_code == 400
    # 401: no key.
    r = httpx.post(f"{url}/completion", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 401
    # 429: the one slot generates, the one queue place is taken, the next is refused.
    endless = {"prompt": "busy", "options": {"num_predict": 1_000_000, **FIXED}}
    queued: dict[str, Any] = {}
    with httpx.stream(
        "POST", f"{url}/completion", headers=AUTH, json=endless, timeout=60
    ) as running:
        assert running.status_code == 200
        lines = ndjson(running)  # kept: a dropped iterator closes the connection
        assert next(lines)["done"] is False

        def wait_in_queue() -> None:
            r = httpx.post(
                f"{url}/completion",
                headers=AUTH,
                json={"prompt": "next", "options": {"num_predict": 2, **FIXED}},
                timeout=60,
            )
            queued["status"] = r.status_code
            queued["last"] = json.loads(r.text.strip().split("\n")[-1])

        t = threading.Thread(target=wait_in_queue)
        t.start()
        wait_until(lambda: Scrape(url).value("requests_waiting") == 1, "a request in the queue", 30)
        during = Scrape(url)
        assert during.value("requests_running") == 1
        assert during.value("num_requests_waiting") == 1
        assert 0 < during.value("kv_cache_usage_perc") <= 1
        r = httpx.post(f"{url}/completion", headers=AUTH, json={"prompt": "x"}, timeout=10)
        assert r.status_code == 429, r.text
        # Leaving the block closes the stream: the client left mid-generation.
    t.join(timeout=60)
    assert queued["status"] == 200 and queued["last"]["eval_count"] == 2, queued
    wait_until(
        lambda: delta(before, Scrape(url), "requests_rejected_total", reason="cancelled") == 1,
        "the cancel to be counted",
        30,
    )
    after = Scrape(url)
    assert delta(before, after, "requests_rejected_total", reason="invalid") == 2
    assert delta(before, after, "requests_rejected_total", reason="unauthorized") == 1
    assert delta(before, after, "requests_rejected_total", reason="queue_full") == 1
    assert delta(before, after, "requests_rejected_total", reason="cancelled") == 1
    # Only the queued one finished; the cancelled one's tokens still count as generated.
    assert delta(before, after, "request_success_total", finished_reason="length") == 1
    assert delta(before, after, "e2e_request_latency_seconds_count") == 1
    assert delta(before, after, "time_to_first_token_seconds_count") == 2
    assert delta(before, after, "generation_tokens_total") >= 2 + 1


def test_request_ids_round_trip(srv: Server) -> None:
    url = srv.url
    r = httpx.post(
        f"{url}/v1/chat/completions",
        headers={**AUTH, "X-Request-Id": "order-1234.retry:2"},
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "order-1234.retry:2"
    assert r.json()["id"] == "chatcmpl-order-1234.retry:2"
    r = httpx.post(
        f"{url}/v1/completions",
        headers={**AUTH, "X-Request-Id": "c-1"},
        json={"prompt": "x", "max_tokens": 1},
        timeout=60,
    )
    assert r.json()["id"] == "cmpl-c-1"
    # Made when absent; a hostile one (too long, or characters that could forge a log line)
    # is replaced, never echoed.
    for given in [None, "x" * 129, 'a" status=200 forged="', "two words", "tab\there"]:
        headers = dict(AUTH)
        if given is not None:
            headers["X-Request-Id"] = given
        r = httpx.get(f"{url}/v1/models", headers=headers, timeout=10)
        made = r.headers["x-request-id"]
        assert made != given
        assert uuid.UUID(made).version == 4, made
    # Every answer carries it, errors included.
    for method, path, headers, status in [
        ("POST", "/completion", {}, 401),
        ("POST", "/completion", AUTH, 400),
        ("GET", "/no/such/route", AUTH, 404),
        ("GET", "/health", {}, 200),
    ]:
        r = httpx.request(
            method, f"{url}{path}", headers={**headers, "X-Request-Id": "err-7"}, timeout=10
        )
        assert r.status_code == status, (path, r.text)
        assert r.headers["x-request-id"] == "err-7", path


def test_a_busy_slot_shows_its_request_id(srv: Server) -> None:
    url = srv.url
    wait_idle_keyed(url)
    body = {"prompt": "busy", "options": {"num_predict": 1_000_000, **FIXED}}
    headers = {**AUTH, "X-Request-Id": "slot-holder-1"}
    with httpx.stream("POST", f"{url}/completion", headers=headers, json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["x-request-id"] == "slot-holder-1"
        lines = ndjson(r)  # kept: a dropped iterator closes the connection
        assert next(lines)["done"] is False
        seen: list[Any] = []

        def shown() -> bool:
            seen[:] = httpx.get(f"{url}/slots", headers=AUTH, timeout=10).json()
            return any(s["busy"] for s in seen)

        wait_until(shown, "the slot table to show the busy slot")
        assert [s["request_id"] for s in seen if s["busy"]] == ["slot-holder-1"], seen
    wait_until(
        lambda: all(
            s["request_id"] is None and not s["busy"]
            for s in httpx.get(f"{url}/slots", headers=AUTH, timeout=10).json()
        ),
        "the slot to be free again",
    )


def test_no_metrics_answers_501(tiny_model: Path, start_server: Callable[..., Server]) -> None:
    # As llama-server answers when its metrics are off.
    srv = start_server(tiny_model, no_metrics=True)
    r = httpx.get(f"{srv.url}/metrics", timeout=10)
    assert r.status_code == 501
    assert r.json()["error"]["type"] == "not_supported"
    # Everything else still works, request ids included.
    r = httpx.post(
        f"{srv.url}/completion",
        json={"prompt": "hi", "options": {"num_predict": 1}},
        headers={"X-Request-Id": "no-metrics-1"},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "no-metrics-1"
    wait_idle(srv.url)


def test_flags_and_environment_reach_the_config() -> None:
    args = build_parser().parse_args(["serve", "m.gguf", "--no-metrics", "--log-format", "json"])
    overrides = serve_settings(args)[2]
    cfg = ServerConfig.resolve(overrides, env={})
    assert (cfg.no_metrics, cfg.log_format) == (True, "json")
    cfg = ServerConfig.resolve({}, env={})
    assert (cfg.no_metrics, cfg.log_format) == (False, "text")
    cfg = ServerConfig.resolve(
        {}, env={"LLAMARUNNER_NO_METRICS": "1", "LLAMARUNNER_LOG_FORMAT": "json"}
    )
    assert (cfg.no_metrics, cfg.log_format) == (True, "json")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--log-format", "xml"])


def serve_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMARUNNER_")}
    env.update(extra)
    return env


def json_lines(log: str) -> list[dict[str, Any]]:
    """The JSON log lines (the CLI's own "loading" and "ready on" lines are plain text)."""
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


def test_json_logs_carry_the_request_id(tiny_model: Path) -> None:
    # Our debug logs on, to see the engine's lines about the request too.
    env = serve_env(LLAMARUNNER_LOG="info,llamarunner_core=debug,llama-cpp-2=warn")
    with ServeProcess(
        str(tiny_model), "--port", "0", "--log-format", "json", "--threads", "2", env=env
    ) as proc:
        url = proc.wait_ready()
        with httpx.stream(
            "POST",
            f"{url}/completion",
            headers={"X-Request-Id": "json-log-1"},
            json={"prompt": "hello", "options": {"num_predict": 3, **FIXED}},
            timeout=60,
        ) as r:
            final = list(ndjson(r))[-1]
        proc.wait_for(r'^(?=.*"message":"access")(?=.*"request_id":"json-log-1")')
        lines = json_lines(proc.log)
        assert lines, proc.log
        for line in lines:
            assert {"timestamp", "level", "message"} <= line.keys(), line
        access = [
            x for x in lines if x["message"] == "access" and x.get("request_id") == "json-log-1"
        ]
        assert len(access) == 1, lines
        a = access[0]
        assert a["level"] == "INFO"
        assert (a["method"], a["route"], a["status"]) == ("POST", "/completion", 200)
        assert a["prompt_tokens"] == final["prompt_eval_count"]
        assert a["cached_tokens"] == final["prompt_cached_count"]
        assert a["generated_tokens"] == 3 == final["eval_count"]
        assert a["finish_reason"] == "length"
        for field in ("queue_ms", "ttft_ms", "total_ms"):
            assert isinstance(a[field], float) and a[field] >= 0, (field, a)
        assert a["ttft_ms"] >= a["queue_ms"] and a["total_ms"] >= a["ttft_ms"], a
        # The engine's lines about the request are in its span.
        admitted = [x for x in lines if x["message"] == "sequence admitted"]
        assert admitted and admitted[-1]["span"]["request_id"] == "json-log-1", admitted
        # A refused request's access line, with its own id.
        r = httpx.post(f"{url}/completion", content=b"{", timeout=10)
        rid = r.headers["x-request-id"]
        proc.wait_for(rf'"request_id":"{rid}"')
        refused = [x for x in json_lines(proc.log) if x.get("request_id") == rid]
        assert refused[0]["status"] == 400 and refused[0]["error"] == "invalid", refused
        # llama.cpp's own chatter (target llama-cpp-2) stays out without --verbose.
        chatter = [
            x
            for x in json_lines(proc.log)
            if x.get("target", "").startswith("llama-cpp-2") and x["level"] in ("INFO", "DEBUG")
        ]
        assert not chatter, chatter[:3]


def test_verbose_lets_llama_cpp_speak(tiny_model: Path) -> None:
    with ServeProcess(
        str(tiny_model), "--port", "0", "--log-format", "json", "--verbose", env=serve_env()
    ) as proc:
        proc.wait_ready()
        chatter = [x for x in json_lines(proc.log) if x.get("target", "").startswith("llama-cpp-2")]
        assert any(x["level"] == "INFO" for x in chatter), proc.log[-2000:]


def test_text_access_line(tiny_model: Path) -> None:
    with ServeProcess(str(tiny_model), "--port", "0", "--threads", "2", env=serve_env()) as proc:
        url = proc.wait_ready()
        with httpx.stream(
            "POST",
            f"{url}/v1/chat/completions",
            headers={"X-Request-Id": "text-log-1"},
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "stream": True,
                **FIXED,
            },
            timeout=60,
        ) as r:
            assert r.status_code == 200
            r.read()
        line = proc.wait_for(r'access .*request_id="?text-log-1').string
        assert " INFO " in line, line
        line = line.replace('"', "")  # text values are written quoted
        for field in (
            "method=POST",
            "route=/v1/chat/completions",
            "status=200",
            "generated_tokens=2",
            "cached_tokens=",
            "prompt_tokens=",
            "queue_ms=",
            "ttft_ms=",
            "total_ms=",
            "finish_reason=length",
        ):
            assert field in line, (field, line)
        # Probes and scrapes are not logged at info.
        httpx.get(f"{url}/health", headers={"X-Request-Id": "probe-1"}, timeout=10)
        httpx.post(f"{url}/completion", content=b"{", headers={"X-Request-Id": "after-1"})
        proc.wait_for(r'request_id="?after-1')
        assert "probe-1" not in proc.log
