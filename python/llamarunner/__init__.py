"""llamarunner: a fast, dependable local LLM runner on llama.cpp.

>>> from llamarunner import Server
>>> with Server("model.gguf", port=0) as srv:  # doctest: +SKIP
...     print(srv.url)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._health import Health
    from .client import (
        APIConnectionError,
        APIStatusError,
        APITimeoutError,
        AsyncClient,
        AsyncStream,
        AuthenticationError,
        BadRequestError,
        Client,
        Completion,
        CompletionChunk,
        HealthStatus,
        LlamaRunnerError,
        NotFoundError,
        PayloadTooLargeError,
        PermissionDeniedError,
        RateLimitError,
        ServiceUnavailableError,
        Stream,
        TokenPiece,
    )
    from .config import NoModelError, ServerConfig, default_model_path
    from .server import EngineStoppedError, ModelLoadError, Server

    __version__: str

# Imported on first use (PEP 562): a model's engine process under a router
# (`python -m llamarunner._engine`) needs only `_core`, and importing the client (httpx) and
# reading the package's metadata took ~0.3 s of every model load.
_LAZY = {
    "config": ("NoModelError", "ServerConfig", "default_model_path"),
    "_health": ("Health",),
    "server": ("EngineStoppedError", "ModelLoadError", "Server"),
}


def __getattr__(name: str) -> Any:
    import importlib

    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("llamarunner")
        except PackageNotFoundError:  # running from a source tree
            value = "0.0.0"
    else:
        module = next((m for m, names in _LAZY.items() if name in names), None)
        if module is None and name in __all__:
            module = "client"
        if module is None:
            raise AttributeError(f"module 'llamarunner' has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncClient",
    "AsyncStream",
    "AuthenticationError",
    "BadRequestError",
    "Client",
    "Completion",
    "CompletionChunk",
    "EngineStoppedError",
    "Health",
    "HealthStatus",
    "LlamaRunnerError",
    "ModelLoadError",
    "NoModelError",
    "NotFoundError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "RateLimitError",
    "Server",
    "ServerConfig",
    "ServiceUnavailableError",
    "Stream",
    "TokenPiece",
    "__version__",
    "default_model_path",
]
