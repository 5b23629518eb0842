"""Waiting for a model to load, once for every caller: poll a health source until it says
"ready"; raise when it says "error" (and "stopped", for callers that say so) or when the time
is up. `ReadyWait` holds the rules; `wait_ready` (blocking) and `wait_ready_async` (asyncio)
are the loops around them; once it serves, `watch_serving` polls on until the engine dies.
The sources: the native server's ``health()`` (`Health`: `Server`,
``llamarunner serve`` and ``run``) and a client's ``GET /health`` (`Client`, `AsyncClient`,
which poll None when the server cannot be reached). Each caller says which error each
outcome raises, so their messages and exception types stay their own.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

ENGINE_STOPPED = "the engine stopped"
"""The runner's prefix for an engine that ended while it should have been serving."""
LOAD_FAILED = "the model failed to load"
"""The reason of an "error" health without one."""


@dataclass(frozen=True)
class Health:
    """The server's load state."""

    status: str
    """"loading", "ready", "error" or "stopped"."""
    progress: float
    """Model load progress, 0..1."""
    error: str | None
    """Why loading failed or the engine stopped, when status is "error"."""
    slots_busy: int
    slots_total: int


class HealthLike(Protocol):
    """What a health answer has (`Health`, `HealthStatus`)."""

    @property
    def status(self) -> str: ...
    @property
    def progress(self) -> float: ...
    @property
    def error(self) -> str | None: ...


H = TypeVar("H", bound=HealthLike)


class HealthFailed(Exception):
    """A health that said "error" (or "stopped"), for a caller that answers it itself."""

    def __init__(self, health: HealthLike) -> None:
        super().__init__(health.error)
        self.health = health


def failure_reason(h: HealthLike) -> str:
    """Why an "error" health failed."""
    return h.error or LOAD_FAILED


def engine_stopped(reason: str) -> bool:
    """Whether ``reason`` (`failure_reason`) is an engine that stopped after it served, not a
    model that did not load."""
    return reason.startswith(ENGINE_STOPPED)


class ReadyWait(Generic[H]):
    """The rules of a wait: ``check`` each health polled (None: the source could not be
    reached). ``timeout`` None waits for ever (``timed_out`` makes the error of a timeout);
    ``stopped`` None polls on through "stopped"; ``progress`` is told the load progress of each
    health that is not ready yet."""

    def __init__(
        self,
        timeout: float | None,
        *,
        failed: Callable[[H], BaseException],
        timed_out: Callable[[], BaseException] | None = None,
        stopped: Callable[[H], BaseException] | None = None,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._failed = failed
        self._timed_out = timed_out or (lambda: TimeoutError(f"not ready within {timeout} s"))
        self._stopped = stopped
        self._progress = progress

    def check(self, h: H | None) -> H | None:
        """``h`` when the model is ready; None to poll again. Raises ``failed(h)`` for
        "error", ``stopped(h)`` for "stopped", ``timed_out()`` once the deadline has passed."""
        if h is not None:
            if h.status == "ready":
                return h
            if h.status == "error":
                raise self._failed(h)
            if h.status == "stopped" and self._stopped is not None:
                raise self._stopped(h)
            if self._progress is not None:
                self._progress(h.progress)
        if self._deadline is not None and time.monotonic() > self._deadline:
            raise self._timed_out()
        return None


def wait_ready(poll: Callable[[], H | None], wait: ReadyWait[H], interval: float) -> H:
    """Polls every ``interval`` seconds until ``wait`` says ready (or raises)."""
    while True:
        ready = wait.check(poll())
        if ready is not None:
            return ready
        time.sleep(interval)


async def wait_ready_async(
    poll: Callable[[], Awaitable[H | None]], wait: ReadyWait[H], interval: float
) -> H:
    """`wait_ready` for a source polled with ``await``."""
    import asyncio  # only the async client needs it

    while True:
        ready = wait.check(await poll())
        if ready is not None:
            return ready
        await asyncio.sleep(interval)


def watch_serving(
    poll: Callable[[], H], interval: float, *, until: Callable[[], bool] | None = None
) -> H | None:
    """Polls a serving model's health every ``interval`` seconds: returns the first "error"
    health (the engine died after it served: a panic, say), or None once ``until()`` is true."""
    while True:
        h = poll()
        if h.status == "error":
            return h
        if until is not None and until():
            return None
        time.sleep(interval)
