"""Shared fixtures: tiny GGUF models, in-process servers, the real default model.

Tests marked ``real_model`` run on the default model and are skipped when it is not
installed, unless ``LLAMARUNNER_TESTS_REQUIRE_REAL_MODEL`` is set (CI sets it): then a
skipped real-model test is a failure, so a green run cannot hide that they never ran.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any, Callable

import pytest

from llamarunner import NoModelError, Server

from tinymodel import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture(scope="session")
def eos_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("models") / "eos.gguf", always_eos=True)


@pytest.fixture
def start_server() -> Iterator[Callable[..., Server]]:
    """Starts in-process servers on free ports; stops them after the test."""
    started: list[Server] = []

    def start(model: Path | str, **settings: Any) -> Server:
        settings.setdefault("port", 0)
        settings.setdefault("threads", 2)
        srv = Server(str(model), **settings)
        started.append(srv)
        srv.start()
        srv.wait_ready(timeout=120)
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny model, 2 slots of 512 tokens, served under the alias "tiny" (its file is
    tiny-model.gguf, so the name the OpenAI and Ollama APIs see proves --alias applies)."""
    model = write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-model.gguf")
    with Server(str(model), port=0, parallel=2, ctx_size=512, threads=2, alias="tiny") as srv:
        yield srv


REQUIRE_REAL_MODEL_ENV = "LLAMARUNNER_TESTS_REQUIRE_REAL_MODEL"


def real_model_required() -> bool:
    return os.environ.get(REQUIRE_REAL_MODEL_ENV, "") not in ("", "0")


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The default model's file. Only "not installed" skips (or fails, when required); any
    other error (a broken package, say) is an error of the tests that need it."""
    from llamarunner import default_model_path

    try:
        return default_model_path()
    except NoModelError as e:
        if real_model_required():
            pytest.fail(f"{REQUIRE_REAL_MODEL_ENV} is set but the default model is missing: {e}")
        pytest.skip(f"default model not installed: {e}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    """With ``LLAMARUNNER_TESTS_REQUIRE_REAL_MODEL`` set, a real-model test that was skipped,
    for whatever reason, fails."""
    outcome = yield
    report = outcome.get_result()
    if (
        report.skipped
        and real_model_required()
        and item.get_closest_marker("real_model") is not None
        and not hasattr(report, "wasxfail")
    ):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"real-model test skipped while {REQUIRE_REAL_MODEL_ENV} is set: {reason}"
