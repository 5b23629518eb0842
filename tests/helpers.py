"""Small HTTP helpers for the end-to-end tests."""

from __future__ import annotations

import json
import queue
import re
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


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 10) -> None:
    """Polls ``condition`` until it holds; fails naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def slots_processing(url: str) -> int:
    return int(httpx.get(f"{url}/health", timeout=10).json()["slots_processing"])


def wait_idle(url: str, timeout: float = 10) -> None:
    """Waits until no slot is busy (the slot table is published just after each step)."""
    wait_until(lambda: slots_processing(url) == 0, "every slot to be idle", timeout)


class Neighbour:
    """A generation running beside a test's own requests: a streamed request that cannot end
    on its own for a long while (``ignore_eos``, a huge ``num_predict``), started and waited
    for (its first token arrived) on entry. `still_running` proves that it overlapped
    everything the test ran since: it started before and has not ended. Leaving the block
    cancels it (closing the connection frees its slot).

    >>> with Neighbour(url) as n:  # doctest: +SKIP
    ...     text, _ = complete(url, ...)
    ...     n.still_running()
    """

    def __init__(self, url: str, prompt: str = "the world of", **options: Any) -> None:
        self.url = url
        self.body = {
            "prompt": prompt,
            "options": {"num_predict": 1_000_000, "ignore_eos": True, **options},
        }
        self._cm: Any = None

    def __enter__(self) -> Neighbour:
        self._cm = httpx.stream("POST", f"{self.url}/completion", json=self.body, timeout=60)
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

    def __exit__(self, *exc: object) -> None:
        self._cm.__exit__(None, None, None)
        wait_idle(self.url)


def run_together(
    url: str, bodies: list[dict[str, Any]], path: str = "/completion"
) -> tuple[list[tuple[str, dict[str, Any]]], list[dict[str, Any]]]:
    """Runs native streamed requests side by side: each thread opens its stream and waits for
    its first token, then, with every request started, the slot table is read (the caller
    proves the overlap from it: every request still busy), then the streams are read to the
    end. Returns (text, final message) per body and that slot table."""
    n = len(bodies)
    started = threading.Barrier(n + 1, timeout=120)
    snapped = threading.Event()
    results: list[Any] = [None] * n

    def run(i: int) -> None:
        try:
            with httpx.stream("POST", f"{url}{path}", json=bodies[i], timeout=300) as r:
                assert r.status_code == 200, r.read()
                text: list[str] = []
                final = None
                first = True
                for msg in ndjson(r):
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

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    slots: list[dict[str, Any]] = []
    try:
        started.wait()
        slots = httpx.get(f"{url}/slots", timeout=10).json()["slots"]
    except threading.BrokenBarrierError:
        pass  # a request failed before it started: its error is raised below
    finally:
        snapped.set()
        for t in threads:
            t.join(300)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    assert slots, "the requests never all started"
    return results, slots


def assert_all_busy(slots: list[dict[str, Any]], n: int) -> None:
    """The slot table shows ``n`` requests generating at once."""
    busy = [s for s in slots if s["busy"]]
    assert len(busy) == n, f"the requests did not overlap: {slots}"


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


def locked_kib(pid: int) -> int:
    """VmLck of process ``pid``: memory it holds locked (mlock), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmLck:"):
            return int(line.split()[1])
    raise AssertionError("no VmLck in /proc/PID/status")
