"""Shared fixtures: tiny GGUF models, in-process servers, the real default model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest

from llamarunner import Server

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


@pytest.fixture(scope="session")
def default_model() -> Path:
    try:
        from llamarunner import default_model_path

        return default_model_path()
    except Exception as e:  # not installed
        pytest.skip(f"default model not installed: {e}")
