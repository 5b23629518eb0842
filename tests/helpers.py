"""Small HTTP helpers for the end-to-end tests."""

from __future__ import annotations

import itertools
import json
import os
import queue
import re
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import httpx


def ndjson(response: httpx.Response) -> Iterator[Any]:
    """The JSON lines of a streamed NDJSON answer, each parsed whole. Lines end at "\\n" only:
    httpx's ``iter_lines`` also splits at U+0085, U+2028 and U+2029, which JSON strings carry
    unescaped (and a random model writes)."""
    buffer = b""
    for chunk in response.iter_bytes():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line.decode("utf-8"))
    if buffer.strip():
        yield json.loads(buffer.decode("utf-8"))


def parse_ndjson(text: str) -> list[Any]:
    """The JSON lines of a whole NDJSON body (split at "\\n" only, see `ndjson`)."""
    return [json.loads(line) for line in text.split("\n") if line.strip()]


def complete(
    url: str, prompt: str, body: dict[str, Any] | None = None, **options: Any
) -> tuple[str, dict[str, Any]]:
    """Runs one streaming completion (``body``: extra top-level fields such as ``shift``);
    returns (text, final message)."""
    text = []
    request = {"prompt": prompt, "options": options, **(body or {})}
    with httpx.stream("POST", f"{url}/completion", json=request, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for msg in ndjson(r):
            if msg["done"]:
                assert "error" not in msg, msg
                return "".join(text), msg
            text.append(msg["content"])
    raise AssertionError("stream ended without a final message")


def token_ids(url: str, text: str, add_special: bool = False) -> list[int]:
    """``POST /tokenize``'s token ids of ``text`` (special tokens parsed; BOS only when
    ``add_special``)."""
    r = httpx.post(
        f"{url}/tokenize", json={"content": text, "add_special": add_special}, timeout=30
    )
    assert r.status_code == 200, r.text
    out: list[int] = r.json()["tokens"]
    return out


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Polls ``condition`` until it holds; fails naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def slots_processing(url: str) -> int:
    return int(httpx.get(f"{url}/health", timeout=10).json()["slots_processing"])


def wait_idle(url: str, timeout: float = 60) -> dict[str, Any]:
    """Polls until /health is 200 with no slot processing and /slots shows no busy slot (the
    slot table is published just after each step); returns the last /health, or fails with
    what was seen."""
    deadline = time.monotonic() + timeout
    seen: Any = None
    while True:
        try:
            h = httpx.get(f"{url}/health", timeout=5)
            s = httpx.get(f"{url}/slots", timeout=5)
            seen = (h.status_code, h.text, s.text)
            if (
                h.status_code == 200
                and h.json().get("slots_processing") == 0
                and not any(slot.get("busy") for slot in s.json())
            ):
                return dict(h.json())
        except httpx.HTTPError as e:
            seen = repr(e)
        if time.monotonic() > deadline:
            raise AssertionError(f"the server is not idle after {timeout} s: {seen}")
        time.sleep(0.05)


_neighbour_ids = itertools.count()


class Neighbour:
    """A generation running beside a test's own requests: a streamed request that cannot end
    on its own for a long while (``ignore_eos``, a huge ``num_predict``), started and waited
    for (its first token arrived) on entry. `still_running` proves that it overlapped
    everything the test ran since: it started before and has not ended. `slot` is its entry
    in the slot table (found by its ``X-Request-Id``): how far it got, whether it is paused.
    Its stream is not read after the first token, so once the connection's buffers fill its
    generation pauses, for good (`assert_generating` checks it did not). Leaving the block
    cancels it (closing the connection frees its slot). Without `--max-tokens` the server stops
    it at ten slot contexts: a server with small slots needs `max_tokens` for it to last.

    >>> with Neighbour(url) as n:  # doctest: +SKIP
    ...     text, _ = complete(url, ...)
    ...     n.still_running()
    """

    def __init__(self, url: str, prompt: str = "the world of", **options: Any) -> None:
        self.url = url
        self.request_id = f"neighbour-{os.getpid()}-{next(_neighbour_ids)}"
        self.body = {
            "prompt": prompt,
            "options": {"num_predict": 1_000_000, "ignore_eos": True, **options},
        }
        self._cm: Any = None

    def __enter__(self) -> Neighbour:
        self._cm = httpx.stream(
            "POST",
            f"{self.url}/completion",
            json=self.body,
            headers={"X-Request-Id": self.request_id},
            timeout=60,
        )
        r = self._cm.__enter__()
        assert r.status_code == 200, r.read()
        # Keep the iterator: a dropped one is closed, and with it the connection.
        self._lines = ndjson(r)
        first = next(self._lines)
        assert first["done"] is False, first
        return self

    def still_running(self, others: int = 0) -> None:
        """Asserts that the neighbour is still generating, once the test's own requests
        (``others`` of them may still be running) have left their slots."""
        wait_until(
            lambda: slots_processing(self.url) <= 1 + others,
            "the test's own requests to leave their slots",
        )
        assert slots_processing(self.url) == 1 + others, "the neighbour ended too early"

    def slot(self) -> dict[str, Any]:
        """Its entry in the slot table; fails when no slot holds it."""
        slots = httpx.get(f"{self.url}/slots", timeout=10).json()
        mine = [s for s in slots if s["request_id"] == self.request_id]
        assert len(mine) == 1, f"no slot holds the neighbour {self.request_id}: {slots}"
        return dict(mine[0])

    def generated(self) -> int:
        """Tokens it has generated so far (the slot table's count)."""
        return int(self.slot()["generated_tokens"])

    def assert_generating(self, since: int) -> None:
        """Asserts that it generated tokens after `generated` returned ``since`` and has
        generated at every step since: it is decoding and not paused (its stream is not
        read, so a pause would have lasted)."""
        slot = self.slot()
        assert slot["busy"] and slot["phase"] == "decode", slot
        assert not slot["paused"], f"the neighbour's generation paused: {slot}"
        assert slot["generated_tokens"] > since, f"the neighbour made no progress: {slot}"

    def __exit__(self, *exc: object) -> None:
        self._cm.__exit__(None, None, None)
        wait_idle(self.url)


def openai_stream(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """An OpenAI ``/v1/completions`` SSE stream (with ``stream_options.include_usage``) as the
    native stream's messages: ``{"done": False, "content": ...}`` per chunk with text, then one
    ``{"done": True, "usage": ..., "finish_reason": ..., "logprobs": ...}`` whose logprobs
    gather every chunk's ``tokens`` and ``top_logprobs`` (empty lists without logprobs)."""
    tokens: list[str] = []
    top: list[dict[str, float]] = []
    finish = None
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if chunk.get("usage"):
            yield {
                "done": True,
                "usage": chunk["usage"],
                "finish_reason": finish,
                "logprobs": {"tokens": tokens, "top_logprobs": top},
            }
            continue
        choice = chunk["choices"][0]
        finish = choice["finish_reason"] or finish
        if choice.get("logprobs"):
            tokens += choice["logprobs"]["tokens"]
            top += choice["logprobs"]["top_logprobs"]
        if choice["text"]:
            yield {"done": False, "content": choice["text"]}


_together_ids = itertools.count()


class SlotWatch:
    """Polls ``GET /slots`` on a thread, from `start` until `stop`, for the first table that
    shows every one of ``request_ids`` in a slot at once, generating (phase "decode"): proof
    that those requests overlapped, whatever the speed of the machine (the table is read
    while they run, not after some fixed time). `table` is that table, or None."""

    def __init__(self, url: str, request_ids: list[str]) -> None:
        self.url = url
        self.ids = set(request_ids)
        self.table: list[dict[str, Any]] | None = None
        self.polls = 0
        self.most = 0  # the most of the requests seen generating at once
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with httpx.Client(timeout=30) as client:
                while not self._stop.is_set():
                    slots = client.get(f"{self.url}/slots").json()
                    self.polls += 1
                    generating = {
                        s["request_id"]
                        for s in slots
                        if s["busy"] and s["phase"] == "decode" and s["request_id"] in self.ids
                    }
                    self.most = max(self.most, len(generating))
                    if generating == self.ids:
                        self.table = slots
                        return
                    time.sleep(0.001)
        except BaseException as e:
            self.error = e

    def start(self) -> SlotWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.ident is None:  # never started
            return
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the /slots poller hung"
        if self.error is not None:
            raise self.error


def metric(url: str, name: str) -> float:
    """The value of the unlabelled (but for ``model_name``) sample ``llamarunner:<name>`` of
    ``GET /metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith((f"llamarunner:{name}{{", f"llamarunner:{name} ")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no llamarunner:{name} in /metrics")


# Most slots one holder takes: OpenAI's `n` choices of one request (the server's MAX_CHOICES).
HOLD_MAX = 8


class _SlotHolder:
    """Streamed generations that hold ``count`` slots (at most `HOLD_MAX`) until `release`
    (they cannot end by themselves for a long while): ``n`` choices of one OpenAI
    ``/v1/completions`` stream, so that one closed connection frees them all in the same
    engine turn. On return from the constructor each choice has its first token out."""

    def __init__(self, url: str, count: int = 1) -> None:
        assert 1 <= count <= HOLD_MAX, count
        body = {
            "prompt": "hold",
            "n": count,
            "stream": True,
            "max_tokens": 1_000_000,
            "ignore_eos": True,
            "temperature": 0,
        }
        self._cm = httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60)
        r = self._cm.__enter__()
        try:
            assert r.status_code == 200, r.read()
            self._lines = r.iter_lines()  # kept: a dropped iterator closes the connection
            begun: set[int] = set()
            while len(begun) < count:
                line = next(self._lines)
                if line.startswith("data: "):
                    chunk = json.loads(line.removeprefix("data: "))
                    for choice in chunk["choices"]:
                        assert choice["finish_reason"] is None, chunk
                        begun.add(choice["index"])
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Closes the connection: the server cancels the generations and frees their slots."""
        self._cm.__exit__(None, None, None)


def run_together(
    url: str,
    bodies: list[dict[str, Any]],
    path: str = "/completion",
    messages: Callable[[httpx.Response], Iterator[dict[str, Any]]] = ndjson,
) -> tuple[list[tuple[str, dict[str, Any]]], list[dict[str, Any]]]:
    """Runs streamed requests side by side (native NDJSON, or another dialect's stream read
    as native messages by `messages`, e.g. `openai_stream`), each with an ``X-Request-Id`` of
    its own, on an idle server. So that they start together however slow the machine (or
    late a thread), every slot is first held by a generation (`_SlotHolder`: one stream of
    several choices); the requests are sent, and once the metrics show all of them waiting in
    the queue, the holders leave at once: the slots free in one engine turn and the requests
    take them in the same step. Each thread waits for its first token; with every request
    started, the slot table is read; then the streams are read to the end. A `SlotWatch`
    polls the slot table all the while. Returns (text, final message) per body and a slot
    table to prove the overlap from (`assert_all_busy`): the first the watch saw with every
    request generating, else (it never saw that) the one read once all had started."""
    n = len(bodies)
    run_id = next(_together_ids)
    ids = [f"together-{os.getpid()}-{run_id}-{i}" for i in range(n)]
    started = threading.Barrier(n + 1, timeout=120)
    snapped = threading.Event()
    results: list[Any] = [None] * n

    def run(i: int) -> None:
        try:
            with httpx.stream(
                "POST",
                f"{url}{path}",
                json=bodies[i],
                headers={"X-Request-Id": ids[i]},
                timeout=300,
            ) as r:
                assert r.status_code == 200, r.read()
                text: list[str] = []
                final = None
                first = True
                for msg in messages(r):
                    if first:
                        first = False
                        assert not msg["done"], msg
                        started.wait()
                        assert snapped.wait(120)
                    if msg["done"]:
                        final = msg
                        break
                    text.append(msg["content"])
                assert final is not None and "error" not in final, final
                results[i] = ("".join(text), final)
        except BaseException as e:
            started.abort()
            results[i] = e

    def failed() -> bool:
        return any(isinstance(r, BaseException) for r in results)

    total = len(httpx.get(f"{url}/slots", timeout=10).json())
    holders: list[_SlotHolder] = []
    watch = SlotWatch(url, ids)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    slots: list[dict[str, Any]] = []
    try:
        # As few holders as can take every slot: one connection's close frees its slots at
        # once, so that the requests waiting take them in one step (a holder per slot, closed
        # one by one, let a fast request finish before the last had started).
        for first in range(0, total, HOLD_MAX):
            holders.append(_SlotHolder(url, min(HOLD_MAX, total - first)))
        watch.start()
        for t in threads:
            t.start()
        wait_until(
            lambda: failed() or metric(url, "requests_waiting") == n,
            f"the {n} requests to wait in the queue",
        )
        for h in holders:
            h.release()
        holders = []
        started.wait()
        slots = httpx.get(f"{url}/slots", timeout=10).json()
    except threading.BrokenBarrierError:
        pass  # a request failed before it started: its error is raised below
    finally:
        for h in holders:
            h.release()
        if not slots:
            started.abort()  # this thread failed before the barrier: the others stop waiting
        snapped.set()
        for t in threads:
            if t.ident is not None:  # started
                t.join(300)
        watch.stop()
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        # The first error that is not another thread's broken barrier.
        raise next(
            (e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0]
        )
    assert slots, "the requests never all started"
    if watch.table is not None:
        return results, watch.table
    print(f"\n{watch.polls} reads of /slots saw at most {watch.most} of {n} generating at once")
    return results, slots


def assert_all_busy(slots: list[dict[str, Any]], n: int) -> None:
    """The slot table shows ``n`` requests, each in a slot of its own, generating at once."""
    busy = [s for s in slots if s["busy"]]
    assert len(busy) == n, f"the requests did not overlap: {slots}"
    assert all(s["phase"] == "decode" for s in busy), f"not all generating: {slots}"
    ids = {s["request_id"] for s in busy}
    assert None not in ids and len(ids) == n, f"not {n} requests: {slots}"


# --- comparing greedy runs of the real model ---------------------------------------------
#
# llama.cpp's CPU kernels are not batch-invariant: the logits of a position differ in their
# last bits with the number of rows decoded with it (its sgemm runs only for two or more rows,
# repacked Q4_K weights use gemm from four rows and gemv below, flash attention switches to a
# tiled kernel from a number of query rows), and which kernels run depends on the CPU (a machine
# without AVX2 runs none of the repacked ones). So two greedy runs of one prompt whose positions
# were decoded in batches of other shapes (a prefix cached or not, other sequences beside it,
# drafts verified with it) may part where the two best tokens are nearly tied. Measured on the
# default model: a position's logprobs move by up to ~0.1 nats between such runs; one CI
# machine's run had its two best 0.20 nats apart where this machine's had them 0.04 apart, and
# on a machine without AVX2 " Paris" and " The" after "Q: What is the capital of France?\nA:"
# are 0.011 apart. So the checks are:
# - exact: every token of a greedy run is the best of its own position's logprobs (a draft is
#   kept only where the sampler picks it; no sequence samples another's row);
# - the texts are equal, or part at a flip of a near-tie: each run's token there is the other's
#   second best, and each run had its two best within NEAR_TIE nats. Crossed sequences, wrong
#   positions or a draft leaking into attention move logits far past that.
NEAR_TIE = 0.5


def openai_greedy(url: str, prompt: str, n: int, **extra: Any) -> dict[str, Any]:
    """A greedy ``/v1/completions`` answer of `n` tokens with the top 2 logprobs of each."""
    r = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 2, **extra},
        timeout=600,
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def best_two(top: dict[str, float]) -> list[tuple[float, str]]:
    return sorted(((v, k) for k, v in top.items()), reverse=True)[:2]


def assert_greedy(logprobs: dict[str, Any]) -> None:
    """Every token is the best (or tied best) of its position's top logprobs."""
    for i, (token, top) in enumerate(zip(logprobs["tokens"], logprobs["top_logprobs"])):
        assert top[token] == max(top.values()), f"token {i} {token!r} is not the best: {top}"


def same_or_near_tie(plain: dict[str, Any], drafted: dict[str, Any]) -> bool:
    """Whether two greedy runs' tokens (each run's `logprobs`: tokens and top 2; `plain` is
    the reference) are the same; if not, asserts that they part at a flipped near-tie (see
    NEAR_TIE)."""
    assert_greedy(plain)
    assert_greedy(drafted)
    want, got = plain["tokens"], drafted["tokens"]
    if want == got:
        return True
    k = next((i for i, (x, y) in enumerate(zip(want, got)) if x != y), None)
    assert k is not None, f"one text is a prefix of the other:\n{want}\n{got}"
    ours, theirs = best_two(plain["top_logprobs"][k]), best_two(drafted["top_logprobs"][k])
    why = f"parted at token {k}: {want[k]!r} {ours} vs {got[k]!r} {theirs}\n{want}\n{got}"
    assert len(ours) == len(theirs) == 2, why
    assert ours[1][1] == got[k] and theirs[1][1] == want[k], why
    assert ours[0][0] - ours[1][0] < NEAR_TIE and theirs[0][0] - theirs[1][0] < NEAR_TIE, why
    return False


def text_same_or_near_tie(plain: dict[str, Any], text: str) -> None:
    """A text without logprobs (the native dialect's) against a plain OpenAI run: the same, or
    parted where the plain run's two best tokens were within NEAR_TIE nats and the text went
    on with the second (its first characters)."""
    want = plain["choices"][0]["text"]
    if text == want:
        return
    k = next((i for i, (x, y) in enumerate(zip(want, text)) if x != y), min(len(want), len(text)))
    lp = plain["choices"][0]["logprobs"]
    at = max(i for i, offset in enumerate(lp["text_offset"]) if offset <= k)
    ours = best_two(lp["top_logprobs"][at])
    why = f"parted at token {at} ({lp['tokens'][at]!r}), best two {ours}:\n{want!r}\n{text!r}"
    assert len(ours) == 2 and ours[0][0] - ours[1][0] < NEAR_TIE, why
    second = want[: lp["text_offset"][at]] + ours[1][1]
    assert text.startswith(second) or second.startswith(text), why


def choice_logprobs(response: dict[str, Any]) -> dict[str, Any]:
    return dict(response["choices"][0]["logprobs"])


# --- llamarunner serve in a subprocess ----------------------------------------------------


class ServeProcess:
    """``llamarunner serve`` in a subprocess, its stderr read by a thread (so no read can
    hang the test): `wait_ready` returns the URL from the "ready on" line, `log` is
    everything it printed so far."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llamarunner", "serve", *args],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._queue.put(line)
        self._queue.put(None)

    def _drain(self, timeout: float) -> bool:
        """Moves the lines read so far into ``lines``; False at the end of stderr."""
        try:
            line = self._queue.get(timeout=timeout)
        except queue.Empty:
            return True
        while True:
            if line is None:
                return False
            self.lines.append(line)
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                return True

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match[str]:
        """The first line of stderr that matches ``pattern``, waiting up to ``timeout`` s."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for line in self.lines[seen:]:
                m = re.search(pattern, line)
                if m:
                    return m
            seen = len(self.lines)
            left = deadline - time.monotonic()
            assert left > 0, f"no line matched {pattern!r} in {timeout} s: {self.log}"
            if not self._drain(min(left, 0.2)):
                for line in self.lines[seen:]:
                    m = re.search(pattern, line)
                    if m:
                        return m
                raise AssertionError(f"stderr ended without {pattern!r}: {self.log}")

    def wait_ready(self, timeout: float = 120) -> str:
        return self.wait_for(r"ready on (http://\S+)", timeout).group(1)

    def wait(self, timeout: float = 60) -> int:
        """Waits for the process to exit; returns its exit code and reads the rest of stderr."""
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout)
        while self._drain(0):
            if self._queue.empty():
                break
        return code

    @property
    def log(self) -> str:
        self._drain(0)
        return "".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def stream_lines(url: str, body: dict[str, Any], path: str = "/completion") -> Iterator[Any]:
    """The JSON lines of a streamed answer, each parsed whole (never a transport chunk)."""
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        yield from ndjson(r)


def model_file_is_mapped(pid: int, model: Path) -> bool:
    """Whether process ``pid`` has ``model`` memory-mapped."""
    target = str(model.resolve())
    maps = Path(f"/proc/{pid}/maps").read_text()
    return any(line.endswith(target) for line in maps.splitlines())


def status_kib(pid: int, field: str) -> int:
    """A ``kB`` field of ``/proc/PID/status`` (``VmLck``, ``VmSize`` ...) of process ``pid``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/PID/status")


def locked_kib(pid: int) -> int:
    """VmLck of process ``pid``: memory it holds locked (mlock), in KiB."""
    return status_kib(pid, "VmLck")


LOG_ALARMS = re.compile(r"GGML_ASSERT|panicked|fatal|overflow|Segmentation|Aborted| ERROR ")


_server_ids = itertools.count()


def _signal_name(rc: int | None) -> str:
    if rc is None:
        return "running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


LOG_ALARMS = re.compile(r"GGML_ASSERT|panicked|fatal|overflow|Segmentation|Aborted| ERROR ")


def log_digest(log: str) -> str:
    """What a server log says of a failure: its alarming lines (not the debugger's backtrace
    that follows a GGML_ASSERT), else its last lines."""
    lines = log.splitlines()
    alarms = [ln for ln in lines if LOG_ALARMS.search(ln)][:10]
    return "\n    ".join(alarms or lines[-10:])


class WatchedServer:
    """``python -m llamarunner serve`` on a free port, its output in a log file; a watchdog
    thread samples its RSS (peak kept) and kills it past ``rss_limit_mb``."""

    def __init__(
        self, model: Path | None, log_dir: Path, *flags: str, rss_limit_mb: int = 1024
    ) -> None:
        self.log_path = log_dir / f"server-{next(_server_ids)}.log"
        self.rss_limit_mb = rss_limit_mb
        self.peak_rss_kb = 0
        self.killed_for: str | None = None
        self.tainted = False  # a request hung or it died: restart it before further use
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("LLAMARUNNER_") or k == "LLAMARUNNER_LOG"
        }
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llamarunner",
                "serve",
                *([str(model)] if model is not None else []),
                "--port",
                "0",
                "--threads",
                "1",
                *flags,
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self._stop_watch = threading.Event()
        self._watch = threading.Thread(target=self._watchdog, daemon=True)
        self._watch.start()
        try:
            self.url = self._wait_ready(120)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"ready on (http://\S+)", self.log())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server did not start: {self.describe()}")
            time.sleep(0.05)
        raise RuntimeError(f"the server was not ready within {timeout} s: {self.describe()}")

    def _watchdog(self) -> None:
        while not self._stop_watch.is_set() and self.proc.poll() is None:
            rss = self.rss_kb()
            self.peak_rss_kb = max(self.peak_rss_kb, rss)
            if rss > self.rss_limit_mb * 1024:
                self.killed_for = (
                    f"RSS {rss // 1024} MB passed {self.rss_limit_mb} MB: killed by the watchdog"
                )
                self.proc.kill()
                return
            time.sleep(0.01)

    def rss_kb(self) -> int:
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
        except OSError:
            pass
        return 0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def died_within(self, timeout: float) -> bool:
        """Whether the process has exited or does within ``timeout`` s (after a transport
        error, to tell a server that is dying from one that dropped a connection)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def cpu_seconds(self) -> float:
        """The CPU time (user and system, all threads) the process has used: what a request
        costs, whatever else the machine is running, where wall-clock time is not."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        # utime and stime: fields 14 and 15 of stat(5), the 12th and 13th after the name.
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def describe(self) -> str:
        """The process state and the tail of its log, for failure messages."""
        rc = self.proc.poll()
        why = f" ({self.killed_for})" if self.killed_for else ""
        if rc == -signal.SIGKILL and not self.killed_for:
            why = " (not by this test's watchdog: the kernel's OOM killer, or another process)"
        return (
            f"server {_signal_name(rc)}{why}, peak RSS {self.peak_rss_kb // 1024} MB; "
            f"log:\n    {log_digest(self.log())}"
        )

    def stop(self, graceful: bool = True) -> int | None:
        """Ctrl-C (SIGKILL after 30 s), or SIGKILL at once when not ``graceful``."""
        self._stop_watch.set()
        if self.proc.poll() is None:
            if graceful:
                self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30 if graceful else 0.01)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()
        return self.proc.returncode


def assert_serve_refuses(model: Path, flag: str, value: str) -> None:
    """``llamarunner serve MODEL --FLAG=VALUE`` exits with 2 and names the flag."""
    r = subprocess.run(
        [
            *(sys.executable, "-m", "llamarunner", "serve", str(model)),
            *("--port", "0", f"--{flag}={value}"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert flag in r.stderr, r.stderr


# A get_weather tool's parameters for the tiny random models. The city is ASCII letters: the
# random model writes bytes that are not UTF-8, whose replacement characters a validator counts
# differently from the grammar.
TINY_WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z]{1,12}$"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}


def replicas_of(url: str, want: int = 2, timeout: float = 120) -> set[str]:
    """The replica names GET /health reaches (keyless: power of two choices), polled until
    ``want`` have answered or ``timeout`` s have passed.

    Polled, not counted over a fixed number of tries: the router weighs each replica's load
    by its gauges, which are up to a stats period (1 s) old, and Ray moves a request to the
    next rank when its queue-length probe of the first misses its deadline (a loaded machine
    can), so a replica may get none of a quick burst."""
    from llamarunner.ray import REPLICA_HEADER  # only Ray's tests call this

    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(seen) < want and time.monotonic() < deadline:
        r = httpx.get(f"{url}/health", timeout=30)
        assert r.status_code == 200
        seen.add(r.headers[REPLICA_HEADER])
        time.sleep(0.05)
    return seen


def slot_file_state(data: bytes) -> tuple[int, int, int]:
    """(tokens, where llama.cpp's state starts, its bytes) in a slot file (the layout of
    ops/slot_file.rs: magic, version, fingerprint, description, tokens, state, checksum)."""
    at = 8 + 4 + 32
    (desc_len,) = struct.unpack_from("<H", data, at)
    at += 2 + desc_len
    (n_tokens,) = struct.unpack_from("<I", data, at)
    at += 4 + 4 * n_tokens
    (state_len,) = struct.unpack_from("<Q", data, at)
    assert at + 8 + state_len + 32 == len(data)
    return n_tokens, at + 8, state_len
