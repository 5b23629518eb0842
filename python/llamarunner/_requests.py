"""The request/response core that `Client` and `AsyncClient` share. Each API call is built
here as a `Request` (one JSON answer, and the function that parses it) or a `StreamRequest` (a
generation, answered with NDJSON chunks that `ChunkDecoder` reads); here too are the rules for
which failures are retried and which error each one raises. Nothing here does I/O: the two
clients only send, wait and iterate."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Generic, Literal, TypeVar, Union

import httpx

from ._errors import STATUS_ERRORS, APIConnectionError, APIStatusError, APITimeoutError
from ._health import ReadyWait, engine_stopped, failure_reason
from ._results import Completion, CompletionChunk, HealthStatus, TokenPiece

T = TypeVar("T")

POLL_INTERVAL = 0.05
"""Seconds between two /health calls of `wait_ready`."""


# --- request descriptions ------------------------------------------------------------------


@dataclass(frozen=True)
class Request(Generic[T]):
    """A call answered with one JSON body, which ``parse`` turns into the call's result."""

    method: str
    path: str
    json: Any
    parse: Callable[[Any], T]
    checked: bool = True
    """Retried on connection errors and 503, and an error status raised (`status_failure`).
    False for /health: one try, and the body parsed whatever the status."""


@dataclass(frozen=True)
class StreamRequest:
    """A generation, answered with NDJSON `CompletionChunk` lines (`ChunkDecoder`); sent with
    the retries of a checked `Request`, which stop once the stream has started."""

    method: str
    path: str
    json: dict[str, Any]


# Keyword arguments of `complete` and `chat` that are top-level fields of the native request,
# not sampling options (`model`: which model, on a server of many).
_TOP_LEVEL = ("truncate", "shift", "model")


Think = Union[bool, Literal["high", "medium", "low"], None]
"""`chat`'s ``think``: the template asked to think (true, a level) or not (false), and the
reasoning split out into ``thinking``; None: the text as generated."""


def generate(
    prompt: str | Sequence[Mapping[str, Any]],
    grammar: str | None,
    format: Any,
    options: Mapping[str, Any],
    think: Think = None,
) -> StreamRequest:
    """`complete` (a ``str`` prompt) or `chat` (a sequence of messages, ``think`` its
    reasoning switch)."""
    sampling = dict(options)
    body: dict[str, Any] = {name: sampling.pop(name) for name in _TOP_LEVEL if name in sampling}
    body["options"] = sampling
    if isinstance(prompt, str):
        body["prompt"] = prompt
    else:
        body["messages"] = [dict(m) for m in prompt]
    if grammar is not None:
        body["grammar"] = grammar
    if format is not None:
        body["format"] = format
    if think is not None:
        body["think"] = think
    return StreamRequest("POST", "/completion", body)


def embed(text: str, truncate: bool, model: str | None = None) -> Request[list[float]]:
    body: dict[str, Any] = {"content": text, "truncate": truncate}
    if model is not None:
        body["model"] = model
    return Request("POST", "/embedding", body, _embedding)


def rerank(
    query: str, documents: list[str], top_n: int | None, model: str | None = None
) -> Request[list[tuple[int, float]]]:
    """Ranks ``documents`` against ``query`` on a reranker (`POST /v1/rerank`)."""
    body: dict[str, Any] = {"query": query, "documents": documents}
    if top_n is not None:
        body["top_n"] = top_n
    if model is not None:
        body["model"] = model
    return Request(
        "POST",
        "/v1/rerank",
        body,
        lambda data: [(int(r["index"]), float(r["relevance_score"])) for r in data["results"]],
    )


def models() -> Request[list[dict[str, Any]]]:
    """The models served (`/v1/models`; on a server of many, each with its ``status``)."""
    return Request("GET", "/v1/models", None, lambda data: list(data["data"]))


def load(model: str) -> Request[None]:
    """Loads ``model`` on a server of many (`POST /models/load`), answered once loaded."""
    return Request("POST", "/models/load", {"model": model}, lambda data: None)


def unload(model: str) -> Request[None]:
    """Unloads ``model`` on a server of many (`POST /models/unload`)."""
    return Request("POST", "/models/unload", {"model": model}, lambda data: None)


def tokenize(
    text: str, add_special: bool, with_pieces: bool
) -> Request[list[int] | list[TokenPiece]]:
    body = {"content": text, "add_special": add_special, "with_pieces": with_pieces}
    parse: Callable[[Any], list[int] | list[TokenPiece]] = (
        _token_pieces if with_pieces else _token_ids
    )
    return Request("POST", "/tokenize", body, parse)


def detokenize(tokens: Sequence[int]) -> Request[str]:
    return Request("POST", "/detokenize", {"tokens": list(tokens)}, _content)


def health() -> Request[HealthStatus]:
    return Request("GET", "/health", None, _health, checked=False)


# --- response parsing ----------------------------------------------------------------------


def _known_fields(cls: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    """The items of ``data`` that are fields of the dataclass ``cls`` (newer servers may send
    more)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def _embedding(data: Any) -> list[float]:
    return list(data["embedding"])


def _token_ids(data: Any) -> list[int]:
    return [int(t) for t in data["tokens"]]


def _token_pieces(data: Any) -> list[TokenPiece]:
    return [
        TokenPiece(int(t["id"]), t["piece"] if isinstance(t["piece"], str) else bytes(t["piece"]))
        for t in data["tokens"]
    ]


def _content(data: Any) -> str:
    return str(data["content"])


def _health(data: Any) -> HealthStatus:
    return HealthStatus(**_known_fields(HealthStatus, data))


def parse_chunk(line: str) -> CompletionChunk:
    """One NDJSON line of a generation; an error line raises `APIStatusError`."""
    data = json.loads(line)
    if data.get("error"):
        err = data["error"]
        message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        kind = err.get("type") if isinstance(err, dict) else None
        raise APIStatusError(message, status_code=500, type=kind)
    data.setdefault("content", "")
    return CompletionChunk(**_known_fields(CompletionChunk, data))


class ChunkDecoder:
    """Reads a generation's body, fed as it arrives, into `CompletionChunk`s, up to the final
    one (``done``). Lines split at "\\n" only: JSON strings may hold U+2028, U+2029 or U+0085
    unescaped, where httpx's `iter_lines` (as `str.splitlines`) would split too."""

    def __init__(self) -> None:
        self._pending = b""
        self.done = False
        """The final chunk has been read: stop reading the body."""

    def feed(self, data: bytes) -> Iterator[CompletionChunk]:
        """The chunks of the lines ``data`` completes, each parsed as it is taken."""
        *lines, self._pending = (self._pending + data).split(b"\n")
        return self._parse(lines)

    def finish(self) -> Iterator[CompletionChunk]:
        """The chunk of a last line without "\\n", if any, once the body has ended."""
        pending, self._pending = self._pending, b""
        return self._parse([pending])

    def _parse(self, lines: list[bytes]) -> Iterator[CompletionChunk]:
        for line in lines:
            if self.done:
                return
            text = line.decode("utf-8")
            if text:
                chunk = parse_chunk(text)
                self.done = chunk.done
                yield chunk


def completion(chunks: Sequence[CompletionChunk]) -> Completion:
    """A whole generation's chunks as one `Completion`."""
    final = chunks[-1] if chunks else None
    if final is None or not final.done:
        raise APIConnectionError("the stream ended before the final message")
    joined = ("content", "thinking", "done")
    stats = {k: v for k, v in vars(final).items() if k not in joined and v is not None}
    return Completion(
        text="".join(c.content for c in chunks),
        thinking="".join(c.thinking for c in chunks),
        **stats,
    )


# --- failures ------------------------------------------------------------------------------


def status_error(status: int, body: bytes) -> APIStatusError:
    """The error an error status stands for, with the message and type of its JSON body."""
    message, kind = body.decode("utf-8", "replace").strip(), None
    try:
        err = json.loads(body)["error"]
        if isinstance(err, dict):
            message, kind = str(err.get("message", message)), err.get("type")
        else:
            message = str(err)
    except (ValueError, KeyError, TypeError):
        pass
    return STATUS_ERRORS.get(status, APIStatusError)(message, status_code=status, type=kind)


def unreachable(base_url: str, e: httpx.TransportError) -> APIConnectionError:
    return APIConnectionError(f"cannot reach {base_url}: {e}")


class Retries:
    """The tries of one checked call (`Request.checked`, `StreamRequest`): a connection error
    or a 503 is retried while tries are left (``max_retries`` after the first), a timeout and
    any other error status never. The clients send, and call `sent_failed` or `status_failed`
    when a try fails, which raise the call's error or return to let it be tried again after
    the delay of `attempt` (then `next`)."""

    def __init__(self, base_url: str, path: str, max_retries: int) -> None:
        self.base_url = base_url
        self.path = path
        self.max_retries = max_retries
        self.attempt = 0
        """Tries that failed and were retried so far."""

    def _can_retry(self) -> bool:
        return self.attempt < self.max_retries

    def send_failed(self, e: httpx.TransportError) -> None:
        """A request that could not be sent: raises `APITimeoutError` for a timeout, else
        `APIConnectionError` once no try is left."""
        if isinstance(e, httpx.TimeoutException):
            raise APITimeoutError(f"request to {self.base_url}{self.path} timed out") from e
        if not self._can_retry():
            raise unreachable(self.base_url, e) from e

    def status_failed(self, status: int, body: bytes) -> None:
        """An error status: raises its error (`status_error`), unless it is a 503 and a try is
        left."""
        if not (status == 503 and self._can_retry()):
            raise status_error(status, body)

    def next(self) -> int:
        """Counts a retry; returns the number of the one before it (from 0), for its delay."""
        self.attempt += 1
        return self.attempt - 1


def broken_stream(e: httpx.TransportError) -> APIConnectionError:
    """A connection lost once the answer has started (never retried: the text would be
    generated twice)."""
    if isinstance(e, httpx.TimeoutException):
        return APITimeoutError(f"the stream timed out: {e}")
    return APIConnectionError(f"the connection broke during the stream: {e}")


def health_error(h: HealthStatus) -> APIStatusError:
    """The error a failed /health stands for: the model did not load, or the engine stopped."""
    message = failure_reason(h)
    kind = "engine_stopped" if engine_stopped(message) else "model_load_failed"
    return APIStatusError(message, status_code=500, type=kind)


def ready_wait(base_url: str, timeout: float) -> ReadyWait[HealthStatus]:
    """The rules of `wait_ready`: poll /health until it says "ready"; raise `health_error`
    when it says "error", and `APITimeoutError` when the deadline has passed."""
    return ReadyWait(
        timeout,
        failed=health_error,
        timed_out=lambda: APITimeoutError(f"{base_url} was not ready within {timeout} s"),
    )
