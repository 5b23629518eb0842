"""llamarunner: a fast, dependable local LLM runner on llama.cpp.

>>> from llamarunner import Server
>>> with Server("model.gguf", port=0) as srv:  # doctest: +SKIP
...     print(srv.url)
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

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
from .server import EngineStoppedError, Health, ModelLoadError, Server

try:
    __version__ = version("llamarunner")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

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
