"""`Server`: the runner inside the calling Python process.

The Rust core runs the HTTP server and the engine on its own threads; Python only holds a
handle, so the GIL is free while requests are served.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from . import _core, _gpu_modules
from ._health import Health, ReadyWait, engine_stopped, failure_reason, wait_ready
from .client import Client
from .config import ServerConfig
from .router import router_config_json, served_models
from .settings import DEFAULT_KEEP_ALIVE, DEFAULT_MODELS_MAX, DEFAULT_MODELS_MEMORY

ModelLoadError = _core.ModelLoadError

_POLL_INTERVAL = 0.02
"""Seconds between two ``health()`` calls of `Server.wait_ready`."""


class EngineStoppedError(RuntimeError):
    """The engine thread ended while the server should have been serving (it panicked, for
    example): requests cannot be answered any more. Stop the server and start a new one."""


def _load_failure(h: Health) -> ModelLoadError | EngineStoppedError:
    """The error an "error" health raises: the model did not load, or the engine stopped."""
    reason = failure_reason(h)
    return EngineStoppedError(reason) if engine_stopped(reason) else ModelLoadError(reason)


class Server:
    """A llamarunner server in this process.

    >>> with Server("model.gguf", parallel=2, port=0) as srv:  # doctest: +SKIP
    ...     print(srv.url)
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: ServerConfig | None = None,
        models_dir: str | Path | None = None,
        models: Sequence[str | Path] | None = None,
        models_preset: str | Path | None = None,
        library: bool = False,
        allow_pull: bool = False,
        models_max: int = DEFAULT_MODELS_MAX,
        keep_alive: str | float = DEFAULT_KEEP_ALIVE,
        models_memory: int = DEFAULT_MODELS_MEMORY,
        **settings: Any,
    ) -> None:
        """One model (``model``, default the default model, or a name `llamarunner.sources`
        resolves), or many behind one endpoint: ``models_dir`` (every model in it by its
        name), ``models`` (files by file name, or names), ``library`` (every model of the
        Hugging Face cache and Ollama's store), ``allow_pull`` (``POST /api/pull`` fetches
        more), with ``models_preset`` (a TOML file: per-model
        settings, more models; see `llamarunner.router`), each loaded on its first request in
        a process of its own, at most ``models_max`` at once and at most ``models_memory`` MiB
        by their estimates (-1: 80 % of the machine's memory; 0: no budget), unloaded after
        ``keep_alive`` idle (seconds or "5m"; negative: never). The other settings apply to
        every model."""
        overrides = dict(settings)
        if model is not None:
            overrides["model"] = str(model)
        if config is None:
            config = ServerConfig.resolve(overrides)
        else:
            config = dataclasses.replace(config, **overrides)
        self._router_json: str | None = None
        many = models_dir is not None or bool(models) or models_preset is not None
        if many or library or allow_pull:
            files = served_models(
                [str(m) for m in models or []], models_dir, models_preset, library=library
            )
            self._router_json = router_config_json(
                config,
                files,
                models_max=models_max,
                keep_alive=keep_alive,
                models_memory=models_memory,
                allow_pull=allow_pull,
            )
            self.config = config
        else:
            self.config = config.with_model_resolved()
        self._native: _core.NativeServer | None = None

    def start(self) -> Server:
        """Binds the port and starts loading the model (with many models: serves at once,
        each model loading on its first request); returns at once."""
        if self._native is None:
            if self._router_json is not None:
                self._native = _core.start_router(self._router_json)
            else:
                _gpu_modules.prepare()
                self._native = _core.start(self.config.to_json())
        return self

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8080``."""
        if self._native is None:
            raise RuntimeError("the server is not started")
        return self._native.url

    def health(self) -> Health:
        """Current load state; "error" (with the reason in ``error``) when the model failed to
        load or the engine stopped since. `wait_ready` raises for those."""
        if self._native is None:
            return Health("stopped", 0.0, None, 0, 0)
        return Health(*self._native.health())

    def wait_ready(self, timeout: float | None = None) -> Server:
        """Blocks until the model is loaded; raises `ModelLoadError` if loading fails and
        `EngineStoppedError` if the engine has stopped."""
        wait: ReadyWait[Health] = ReadyWait(
            timeout,
            failed=_load_failure,
            stopped=lambda h: RuntimeError("the server is not running"),
            timed_out=lambda: TimeoutError(f"the model did not load within {timeout} s"),
        )
        wait_ready(self.health, wait, _POLL_INTERVAL)
        return self

    def client(self, **kwargs: Any) -> Client:
        """A `Client` for this server, sending its first API key if it has any."""
        kwargs.setdefault("api_key", self.config.first_api_key() or "")
        return Client(self.url, **kwargs)

    def stop(self) -> None:
        """Stops serving and frees the model and the port."""
        if self._native is not None:
            self._native.stop()
            self._native = None

    def __enter__(self) -> Server:
        self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __del__(self) -> None:
        native = getattr(self, "_native", None)
        if native is not None:
            native.stop()
