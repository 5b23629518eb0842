"""The one wait for a model to load (`llamarunner._health`), as `Server`, the clients,
``serve`` and ``run`` use it, and the watch of a serving engine (``serve``, a router's engine
processes): their rules, without a server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from llamarunner._health import (
    HealthFailed,
    ReadyWait,
    engine_stopped,
    failure_reason,
    wait_ready,
    wait_ready_async,
    watch_serving,
)


@dataclass(frozen=True)
class H:
    status: str
    progress: float = 0.0
    error: str | None = None


def polls(*answers: H | None) -> Iterator[H | None]:
    yield from answers
    raise AssertionError("polled after the wait should have ended")


def test_it_polls_through_loading_and_unreachable_until_ready() -> None:
    seen: list[float] = []
    answers = polls(None, H("loading", 0.25), H("loading", 0.5), H("ready", 1.0))
    wait = ReadyWait[H](5, failed=HealthFailed, progress=seen.append)
    assert wait_ready(lambda: next(answers), wait, 0.0) == H("ready", 1.0)
    assert seen == [0.25, 0.5]


def test_error_raises_the_callers_error() -> None:
    answers = polls(H("loading"), H("error", error="bad file"))
    wait = ReadyWait[H](5, failed=lambda h: ValueError(failure_reason(h)))
    with pytest.raises(ValueError, match="bad file"):
        wait_ready(lambda: next(answers), wait, 0.0)


def test_stopped_raises_only_when_the_caller_says_so() -> None:
    answers = polls(H("stopped"), H("ready"))
    wait = ReadyWait[H](5, failed=HealthFailed)
    assert wait_ready(lambda: next(answers), wait, 0.0).status == "ready"
    answers = polls(H("stopped"))
    wait = ReadyWait[H](5, failed=HealthFailed, stopped=HealthFailed)
    with pytest.raises(HealthFailed) as e:
        wait_ready(lambda: next(answers), wait, 0.0)
    assert e.value.health == H("stopped")


def test_it_times_out_with_the_callers_error() -> None:
    wait = ReadyWait[H](0.05, failed=HealthFailed, timed_out=lambda: TimeoutError("late"))
    with pytest.raises(TimeoutError, match="late"):
        wait_ready(lambda: H("loading"), wait, 0.01)
    wait = ReadyWait[H](0.05, failed=HealthFailed, timed_out=lambda: TimeoutError("late"))
    with pytest.raises(TimeoutError, match="late"):
        wait_ready(lambda: None, wait, 0.01)


def test_the_async_loop_has_the_same_rules() -> None:
    answers = polls(None, H("loading", 0.5), H("ready", 1.0))

    async def poll() -> H | None:
        return next(answers)

    wait = ReadyWait[H](5, failed=HealthFailed)
    assert asyncio.run(wait_ready_async(poll, wait, 0.0)) == H("ready", 1.0)


def test_a_failure_is_a_failed_load_or_a_stopped_engine() -> None:
    assert failure_reason(H("error")) == "the model failed to load"
    assert not engine_stopped(failure_reason(H("error", error="no such file")))
    assert engine_stopped(failure_reason(H("error", error="the engine stopped: panic")))


def test_the_watch_of_a_serving_engine_ends_when_it_dies_or_when_told() -> None:
    answers = polls(H("ready"), H("ready"), H("error", error="the engine stopped: panic"))
    died = watch_serving(lambda: next(answers), 0.0)
    assert died is not None and died.error == "the engine stopped: panic"
    # Told to end (a router's engine whose router is gone): None, after a last look.
    answers = polls(H("ready"), H("ready"))
    calls = iter([False, True])
    assert watch_serving(lambda: next(answers), 0.0, until=lambda: next(calls)) is None
    # An engine that died is reported even when told to end at the same time.
    answers = polls(H("error", error="x"))
    assert watch_serving(lambda: next(answers), 0.0, until=lambda: True) == H("error", error="x")
