"""Soak: thousands of requests with random parameters across the three dialects on the tiny
model, about 30 % of streams cut mid-stream, queued requests abandoned, bursts that overflow
the queue (429, counted). Afterwards the server must be idle with nothing queued, its RSS back
near its value after warm-up, and still answering correctly.

A subprocess ``llamarunner serve`` (--parallel 4 --max-queue 16). ``LLAMARUNNER_SOAK_SECONDS``
sets the duration (default 90); the summary line is printed (``pytest -s``) and, when
``LLAMARUNNER_SOAK_REPORT`` names a file, written there.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from helpers import WatchedServer, metric, wait_idle

SECONDS = float(os.environ.get("LLAMARUNNER_SOAK_SECONDS", "90"))
MODEL = "tiny"
PARALLEL = 4
MAX_QUEUE = 16
# The prompt cache holds at most CACHE_RAM_MB of states (a default budget, a quarter of the
# machine's memory, would let RSS grow by gigabytes of retained states, by design).
CACHE_RAM_MB = 16
FLAGS = (
    *("--parallel", str(PARALLEL), "--max-queue", str(MAX_QUEUE), "--ctx-size", "512"),
    *("--cache-ram", str(CACHE_RAM_MB)),
)
WORKERS = 10  # steady clients (fewer than slots + queue: they alone never see a 429)
BURST = 64  # requests fired at once, every BURST_EVERY s: these overflow the queue
BURST_EVERY = 6.0
DISCONNECT_SHARE = 0.3
REQUEST_TIMEOUT = 30.0  # no answer within this is a hang
RSS_GROWTH_LIMIT_MB = 64
RSS_KILL_MB = 1024
WORDS = ["the", "a", "hello", "world", "cat", "dog", "is", "and", "of", "to"]
REFERENCE = {
    "prompt": "the dog and the cat of the world",
    "options": {"num_predict": 8, "temperature": 0, "ignore_eos": True},
}

pytestmark = pytest.mark.timeout(int(SECONDS) + 300)


# --------------------------------------------------------------------------------------------
# Random requests


@dataclass
class Spec:
    method: str
    path: str
    body: dict[str, Any] | None = None
    stream: bool = False  # the answer is a stream (NDJSON or SSE)


def words(rng: random.Random, lo: int = 1, hi: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def prompt(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.2:  # shared prefixes: cache reuse across slots
        return "the world is a cat and the dog is " + words(rng, 1, 4)
    if r < 0.25:  # long: truncated on the native API, near the slot's size
        return words(rng, 200, 400)
    return words(rng)


def options(rng: random.Random) -> dict[str, Any]:
    o: dict[str, Any] = {"num_predict": rng.randint(1, 16)}
    for name, value in [
        ("temperature", lambda: rng.choice([0, 0.2, 0.8, 1.5])),
        ("top_k", lambda: rng.choice([0, 1, 5, 40])),
        ("top_p", lambda: rng.choice([0.5, 0.9, 1.0])),
        ("min_p", lambda: rng.choice([0.0, 0.05])),
        ("typical_p", lambda: rng.choice([0.7, 1.0])),
        ("repeat_last_n", lambda: rng.choice([-1, 0, 16, 64])),
        ("repeat_penalty", lambda: rng.choice([1.0, 1.1, 1.5])),
        ("presence_penalty", lambda: rng.choice([0.0, 0.5])),
        ("frequency_penalty", lambda: rng.choice([0.0, 0.5])),
        ("mirostat", lambda: rng.choice([0, 1, 2])),
        ("seed", lambda: rng.randint(-1, 2**32)),
        ("stop", lambda: [rng.choice(["a", "the", "\n", "xyz"])]),
        ("ignore_eos", lambda: rng.random() < 0.5),
    ]:
        if rng.random() < 0.3:
            o[name] = value()
    return o


def messages(rng: random.Random) -> list[dict[str, str]]:
    out = []
    if rng.random() < 0.3:
        out.append({"role": "system", "content": "you are a cat"})
    for i in range(rng.randint(1, 3) * 2 - 1):
        out.append({"role": ("user", "assistant")[i % 2], "content": words(rng)})
    return out


def openai_extras(rng: random.Random, chat: bool) -> dict[str, Any]:
    o = options(rng)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": o.pop("num_predict")}
    for name in ("temperature", "top_p", "seed", "stop", "top_k", "repeat_penalty", "ignore_eos"):
        if name in o:
            body[name] = o[name]
    if "temperature" in body:
        body["temperature"] = min(body["temperature"], 2)
    if rng.random() < 0.15:
        body["logit_bias"] = {str(rng.randint(3, 268)): rng.choice([-100, 5, 100])}
    if rng.random() < 0.15:
        if chat:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
        else:
            body["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.1:
        body["response_format"] = {"type": "json_object"}
    return body


def random_spec(rng: random.Random) -> Spec:
    kind = rng.choices(
        [
            "native",
            "native-chat",
            "native-grammar",
            "embedding",
            "template",
            "v1-chat",
            "v1-completions",
            "v1-embeddings",
            "api-generate",
            "api-chat",
            "api-embed",
            "get",
        ],
        weights=[6, 2, 1, 2, 1, 6, 4, 2, 4, 4, 2, 1],
    )[0]
    stream = rng.random() < 0.7
    if kind == "native":
        return Spec("POST", "/completion", {"prompt": prompt(rng), "options": options(rng)}, True)
    if kind == "native-chat":
        return Spec(
            "POST", "/completion", {"messages": messages(rng), "options": options(rng)}, True
        )
    if kind == "native-grammar":
        body: dict[str, Any] = {"prompt": prompt(rng), "options": options(rng)}
        if rng.random() < 0.5:
            body["grammar"] = rng.choice(["root ::= [a-z ]+", 'root ::= ("cat" | "dog") " " root?'])
        else:
            body["format"] = rng.choice(
                ["json", {"type": "object", "properties": {"a": {"type": "integer"}}}]
            )
        return Spec("POST", "/completion", body, True)
    if kind == "embedding":
        return Spec("POST", "/embedding", {"content": prompt(rng), "truncate": True})
    if kind == "template":
        return Spec("POST", "/apply-template", {"messages": messages(rng)})
    if kind == "v1-chat":
        body = {**openai_extras(rng, True), "messages": messages(rng), "stream": stream}
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        return Spec("POST", "/v1/chat/completions", body, stream)
    if kind == "v1-completions":
        body = {**openai_extras(rng, False), "prompt": words(rng), "stream": stream}
        return Spec("POST", "/v1/completions", body, stream)
    if kind == "v1-embeddings":
        inputs: Any = words(rng) if rng.random() < 0.5 else [words(rng) for _ in range(3)]
        return Spec("POST", "/v1/embeddings", {"model": MODEL, "input": inputs})
    if kind == "api-generate":
        body = {"model": MODEL, "prompt": words(rng), "options": options(rng), "stream": stream}
        if rng.random() < 0.3:
            body["raw"] = True
        if rng.random() < 0.1:
            body["format"] = "json"
        return Spec("POST", "/api/generate", body, stream)
    if kind == "api-chat":
        body = {
            "model": MODEL,
            "messages": messages(rng),
            "options": options(rng),
            "stream": stream,
        }
        return Spec("POST", "/api/chat", body, stream)
    if kind == "api-embed":
        return Spec("POST", "/api/embed", {"model": MODEL, "input": [words(rng), words(rng)]})
    path = rng.choice(["/health", "/slots", "/v1/models", "/api/tags", "/api/ps", "/api/version"])
    return Spec("GET", path)


def problem_with(spec: Spec, status: int, data: bytes) -> str | None:
    """What is wrong with a whole answer (200 or 429 expected), or None."""
    if status == 429:
        return None
    if status != 200:
        return f"status {status}: {data[:300]!r}"
    try:
        text = data.decode("utf-8")
        if spec.path in ("/v1/chat/completions", "/v1/completions") and spec.stream:
            # Lines end at "\n" only: str.splitlines also splits at U+0085, U+2028, ... that a
            # random model writes into JSON strings (unescaped, as JSON allows).
            payloads = [ln[5:].strip() for ln in text.split("\n") if ln.startswith("data:")]
            if not payloads or payloads[-1] != "[DONE]":
                return f"SSE without data: [DONE]: {text[-300:]!r}"
            if any("error" in json.loads(p) for p in payloads[:-1]):
                return f"an error in the SSE stream: {text[-300:]!r}"
        elif spec.path in ("/completion", "/api/generate", "/api/chat"):
            lines = [json.loads(ln) for ln in text.split("\n") if ln.strip()]
            if not lines or lines[-1].get("done") is not True or "error" in lines[-1]:
                return f"a stream that does not end with done:true: {text[-300:]!r}"
            if spec.path == "/completion" and lines[-1].get("done_reason") not in (
                "stop",
                "length",
            ):
                return f"done_reason {lines[-1].get('done_reason')!r}"
        elif spec.method == "POST":
            json.loads(text)
    except ValueError as e:
        return f"a body that does not parse ({e}): {data[:300]!r}"
    return None


@dataclass
class Stats:
    by_status: Counter[int] = field(default_factory=Counter)
    disconnects: int = 0
    abandoned: int = 0  # burst requests given up before any answer (cancelled while queued)
    timeouts: int = 0
    transport_errors: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(self.by_status.values()) + self.abandoned + self.timeouts + self.transport_errors

    def problem(self, spec: Spec, what: str) -> None:
        if len(self.problems) < 25:
            self.problems.append(f"{spec.method} {spec.path} {json.dumps(spec.body)[:300]}: {what}")


async def send(
    client: httpx.AsyncClient,
    spec: Spec,
    stats: Stats,
    rng: random.Random,
    disconnect: bool = False,
) -> None:
    """One request, read to its end or cut after a few lines (``disconnect``)."""
    try:
        async with client.stream(spec.method, spec.path, json=spec.body) as r:
            if r.status_code == 200 and spec.stream and disconnect:
                cut, lines = rng.randint(1, 3), []
                async for line in r.aiter_lines():
                    lines.append(line)
                    final = '"done":true' in line or line.strip() == "data: [DONE]"
                    if not final and sum(1 for ln in lines if ln.strip()) >= cut:
                        stats.by_status[200] += 1
                        stats.disconnects += 1
                        return  # leaving the block closes the connection mid-stream
                data = "\n".join(lines).encode()
            else:
                data = await r.aread()
            stats.by_status[r.status_code] += 1
            p = problem_with(spec, r.status_code, data)
            if p:
                stats.problem(spec, p)
    except httpx.TimeoutException as e:
        stats.timeouts += 1
        stats.problem(spec, f"no answer within {REQUEST_TIMEOUT} s ({e!r})")
    except httpx.TransportError as e:
        stats.transport_errors += 1
        stats.problem(spec, f"transport error {e!r}")


async def worker(
    client: httpx.AsyncClient, seed: int, deadline: float, stats: Stats, alive: Callable[[], bool]
) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline and alive():
        spec = random_spec(rng)
        await send(client, spec, stats, rng, disconnect=rng.random() < DISCONNECT_SHARE)


async def bursts(
    client: httpx.AsyncClient, seed: int, deadline: float, stats: Stats, alive: Callable[[], bool]
) -> None:
    """Every BURST_EVERY s, BURST non-streamed requests at once; a few are abandoned while
    they wait for a slot."""
    rng = random.Random(seed)
    while time.monotonic() + BURST_EVERY < deadline:
        await asyncio.sleep(BURST_EVERY)
        if not alive():
            return

        async def one(i: int) -> None:
            spec = Spec(
                "POST",
                "/completion",
                {"prompt": words(rng), "options": {"num_predict": 16, "ignore_eos": True}},
                True,
            )
            if i % 8 == 0:
                try:
                    await asyncio.wait_for(send(client, spec, stats, rng), rng.uniform(0.01, 0.1))
                except asyncio.TimeoutError:
                    stats.abandoned += 1
            else:
                await send(client, spec, stats, rng)

        await asyncio.gather(*(one(i) for i in range(BURST)))


async def soak(url: str, seconds: float, stats: Stats, alive: Callable[[], bool]) -> None:
    """WORKERS steady clients and the bursts, until ``seconds`` pass or the server dies."""
    limits = httpx.Limits(max_connections=WORKERS + BURST + 8, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT, limits=limits) as client:
        deadline = time.monotonic() + seconds
        await asyncio.gather(
            *(worker(client, i, deadline, stats, alive) for i in range(WORKERS)),
            bursts(client, 1000, deadline, stats, alive),
        )


async def warm_up(url: str, stats: Stats, alive: Callable[[], bool]) -> None:
    """Every kind of request a few times, one after another (until the server dies)."""
    rng = random.Random(12345)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT) as client:
        for _ in range(80):
            await send(client, random_spec(rng), stats, rng)
            if not alive():
                return


def complete(url: str) -> tuple[str, dict[str, Any]]:
    with httpx.stream("POST", f"{url}/completion", json=REFERENCE, timeout=30) as r:
        assert r.status_code == 200, r.read()
        lines = [json.loads(ln) for ln in r.iter_lines() if ln.strip()]
    return "".join(m.get("content", "") for m in lines), lines[-1]


def settled_rss_kb(srv: WatchedServer) -> int:
    """RSS once idle: the least of a few samples over a second."""
    samples = []
    for _ in range(5):
        time.sleep(0.2)
        samples.append(srv.rss_kb())
    return min(samples)


async def all_accepted(url: str, n: int) -> list[int]:
    """Sends n requests at once; their statuses."""
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT) as client:
        body = {"prompt": "hello", "options": {"num_predict": 4, "ignore_eos": True}}
        rs = await asyncio.gather(*(client.post("/completion", json=body) for _ in range(n)))
        return [r.status_code for r in rs]


def report(summary: str, problems: list[str]) -> None:
    """Prints the summary (``pytest -s``) and writes it to LLAMARUNNER_SOAK_REPORT if set."""
    text = summary + "\n" + "".join(f"  {p}\n" for p in problems)
    print("\n" + text, end="")
    path = os.environ.get("LLAMARUNNER_SOAK_REPORT")
    if path:
        Path(path).write_text(text)


def test_soak(tmp_path: Path, tiny_model: Path) -> None:
    srv = WatchedServer(tiny_model, tmp_path, "--alias", MODEL, *FLAGS, rss_limit_mb=RSS_KILL_MB)
    try:
        warm = Stats()
        reference_text, reference_final = complete(srv.url)
        asyncio.run(warm_up(srv.url, warm, srv.alive))
        if not srv.alive() or warm.problems:
            died = "" if srv.alive() else f"; {srv.describe()}"
            report(f"soak: aborted in warm-up after {warm.requests} requests{died}", warm.problems)
        assert srv.alive(), f"the server died during warm-up: {srv.describe()}\n" + "\n".join(
            warm.problems[:3]
        )
        assert not warm.problems, "\n".join(warm.problems)
        wait_idle(srv.url)
        rss_warm = settled_rss_kb(srv)
        srv.peak_rss_kb = rss_warm

        stats = Stats()
        started = time.monotonic()
        asyncio.run(soak(srv.url, SECONDS, stats, srv.alive))
        elapsed = time.monotonic() - started
        alive = srv.alive()
        rss_peak = srv.peak_rss_kb

        idle_problem = None
        try:
            assert alive, srv.describe()
            wait_idle(srv.url)
        except (AssertionError, httpx.HTTPError) as e:
            idle_problem = str(e)
        rss_after = settled_rss_kb(srv) if alive else 0
        report(
            f"soak: {stats.requests} requests in {elapsed:.1f} s "
            f"({stats.requests / elapsed:.1f}/s); by status {dict(sorted(stats.by_status.items()))}"
            f"; disconnects {stats.disconnects}; abandoned while queued {stats.abandoned}; "
            f"timeouts {stats.timeouts}; transport errors {stats.transport_errors}; "
            f"problems {len(stats.problems)}; RSS after warm-up {rss_warm // 1024} MB, "
            f"peak {rss_peak // 1024} MB, after {rss_after // 1024} MB"
            + ("" if alive else "; the server DIED"),
            stats.problems,
        )

        assert alive, f"the server died after {elapsed:.1f} s: {srv.describe()}\n" + "\n".join(
            stats.problems[:3]
        )
        assert idle_problem is None, idle_problem
        assert not stats.problems, "\n".join(stats.problems)
        assert stats.requests >= 5 * SECONDS, "the server served too few requests"
        assert stats.by_status[429] > 0, "the bursts never overflowed the queue"
        # Nothing is left in the queue: as many requests as it holds are all accepted.
        statuses = asyncio.run(all_accepted(srv.url, MAX_QUEUE))
        assert statuses == [200] * MAX_QUEUE, f"after the soak: {Counter(statuses)}"
        wait_idle(srv.url)
        # The prompt cache kept its budget through the churn, and it is all RSS may keep.
        cached = metric(srv.url, "prompt_cache_bytes")
        assert 0 < cached <= CACHE_RAM_MB << 20, cached
        assert rss_after <= rss_warm + (RSS_GROWTH_LIMIT_MB + CACHE_RAM_MB) * 1024, (
            f"RSS grew from {rss_warm // 1024} MB to {rss_after // 1024} MB "
            f"(the prompt cache holds {cached / 2**20:.1f} MiB)"
        )
        text, final = complete(srv.url)
        assert final["done"] is True and final["done_reason"] == "length", final
        assert final["eval_count"] == reference_final["eval_count"] == 8, final
        assert text == reference_text, (text, reference_text)
    finally:
        srv.stop()
