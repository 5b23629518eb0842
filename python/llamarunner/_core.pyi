"""Stubs for the native module (crates/llamarunner-py)."""

class ModelLoadError(RuntimeError):
    """The model could not be loaded."""

class NativeServer:
    @property
    def url(self) -> str: ...
    def health(self) -> tuple[str, float, str | None, int, int]: ...
    def stop(self) -> None: ...

def start(config_json: str) -> NativeServer: ...
def version() -> str: ...
def gguf_metadata(path: str) -> str:
    """A GGUF file's metadata as a JSON object: every key (arrays of more than 64 as
    ``{"array_of": TYPE, "length": N}``) and ``tensor_count``; ValueError for a file that is not
    GGUF."""

def list_devices() -> str:
    """Every compute device llama.cpp's backends found, as a JSON array of objects with
    name, description, backend, kind, memory_free and memory_total (bytes)."""

def default_config() -> str: ...
def start_router(config_json: str) -> NativeServer: ...
def route(path: str, body: bytes) -> tuple[str | None, str | None]:
    """(routing key, previous_response_id) of a POST to ``path`` with ``body``, as the
    server's dialects read it."""

def routing_constants() -> tuple[int, str]:
    """(MAX_KEY_CHARS, RESPONSE_ID_HEADER)."""
