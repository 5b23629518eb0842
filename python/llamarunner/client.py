"""`Client` and `AsyncClient` for a llamarunner server, in the style of the `ollama` and
`openai` clients: typed results, streaming iterators that are also context managers, and
exceptions that carry the status code and the server's error type."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from types import TracebackType
from typing import Any, Literal, overload

import httpx

from .config import API_KEY_ENV, DEFAULT_HOST, DEFAULT_PORT, _split_host

DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=60.0, pool=60.0)
_RETRY_DELAYS = (0.25, 0.5, 1.0, 2.0, 4.0)


# --- errors --------------------------------------------------------------------------------


class LlamaRunnerError(Exception):
    """Base of every error this client raises."""


class APIConnectionError(LlamaRunnerError):
    """The server could not be reached."""


class APITimeoutError(APIConnectionError):
    """The request timed out."""


class APIStatusError(LlamaRunnerError):
    """The server answered with an error status (or an error inside a stream)."""

    def __init__(self, message: str, *, status_code: int, type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type

    def __str__(self) -> str:
        return f"{self.status_code} {self.type or 'error'}: {self.message}"


class BadRequestError(APIStatusError):
    """400: the request is invalid."""


class AuthenticationError(APIStatusError):
    """401: the server requires an API key and none, or a wrong one, was sent."""


class PermissionDeniedError(APIStatusError):
    """403: refused whatever the key (a foreign ``Host`` or ``Origin`` header)."""


class NotFoundError(APIStatusError):
    """404: no such endpoint."""


class PayloadTooLargeError(APIStatusError):
    """413: the request body is larger than the server's ``--max-body``."""


class RateLimitError(APIStatusError):
    """429: too many requests are waiting for a slot."""


class ServiceUnavailableError(APIStatusError):
    """503: the model is loading or the server is stopping."""


_STATUS_ERRORS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    413: PayloadTooLargeError,
    429: RateLimitError,
    503: ServiceUnavailableError,
}


def _status_error(status: int, body: bytes) -> APIStatusError:
    message, kind = body.decode("utf-8", "replace").strip(), None
    try:
        err = json.loads(body)["error"]
        if isinstance(err, dict):
            message, kind = str(err.get("message", message)), err.get("type")
        else:
            message = str(err)
    except (ValueError, KeyError, TypeError):
        pass
    return _STATUS_ERRORS.get(status, APIStatusError)(message, status_code=status, type=kind)


# --- results -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Completion:
    """A finished completion."""

    text: str
    done_reason: str
    prompt_eval_count: int = 0
    prompt_cached_count: int = 0
    prompt_eval_duration: int = 0
    """Nanoseconds."""
    eval_count: int = 0
    eval_duration: int = 0
    """Nanoseconds."""


@dataclass(frozen=True)
class CompletionChunk:
    """One line of a streamed completion; the last has ``done=True`` and the statistics."""

    content: str
    done: bool
    done_reason: str | None = None
    prompt_eval_count: int | None = None
    prompt_cached_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


@dataclass(frozen=True)
class HealthStatus:
    """The server's state."""

    status: str
    progress: float
    slots_idle: int = 0
    slots_processing: int = 0
    error: str | None = None


@dataclass(frozen=True)
class TokenPiece:
    """A token and the text it renders to (`Client.tokenize` with ``with_pieces=True``)."""

    id: int
    piece: str | bytes
    """Its text (special tokens as written, ``<s>``); bytes when they are not valid UTF-8 by
    themselves (part of a character)."""


def _tokens(data: Any, with_pieces: bool) -> list[int] | list[TokenPiece]:
    tokens = data["tokens"]
    if not with_pieces:
        return [int(t) for t in tokens]
    return [
        TokenPiece(int(t["id"]), t["piece"] if isinstance(t["piece"], str) else bytes(t["piece"]))
        for t in tokens
    ]


def _tokenize_body(text: str, add_special: bool, with_pieces: bool) -> dict[str, Any]:
    return {"content": text, "add_special": add_special, "with_pieces": with_pieces}


def _build(cls: Any, data: dict[str, Any]) -> Any:
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def _chunk(line: str) -> CompletionChunk:
    data = json.loads(line)
    if data.get("error"):
        err = data["error"]
        message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        kind = err.get("type") if isinstance(err, dict) else None
        raise APIStatusError(message, status_code=500, type=kind)
    data.setdefault("content", "")
    return _build(CompletionChunk, data)  # type: ignore[no-any-return]


def _completion(chunks: list[CompletionChunk]) -> Completion:
    final = chunks[-1] if chunks else None
    if final is None or not final.done:
        raise APIConnectionError("the stream ended before the final message")
    stats = {k: v for k, v in vars(final).items() if k not in ("content", "done") and v is not None}
    return Completion(text="".join(c.content for c in chunks), **stats)


# Keyword arguments of `complete` and `chat` that are top-level fields of the native request,
# not sampling options.
_TOP_LEVEL = ("truncate", "shift")


def _body(
    prompt: str | Sequence[Mapping[str, Any]],
    grammar: str | None,
    format: Any,
    options: dict[str, Any],
) -> dict[str, Any]:
    options = dict(options)
    body: dict[str, Any] = {name: options.pop(name) for name in _TOP_LEVEL if name in options}
    body["options"] = options
    if isinstance(prompt, str):
        body["prompt"] = prompt
    else:
        body["messages"] = [dict(m) for m in prompt]
    if grammar is not None:
        body["grammar"] = grammar
    if format is not None:
        body["format"] = format
    return body


def resolve_base_url(base_url: str | None = None) -> str:
    """The argument, else ``LLAMARUNNER_HOST``, else http://127.0.0.1:8080."""
    if base_url:
        return base_url.rstrip("/")
    env = os.environ.get("LLAMARUNNER_HOST")
    if env:
        scheme = env.split("://", 1)[0] if "://" in env else "http"
        host, port = _split_host(env)
        if host in ("0.0.0.0", "::", ""):
            host = DEFAULT_HOST
        if ":" in host:
            host = f"[{host}]"
        return f"{scheme}://{host}:{port or DEFAULT_PORT}"
    return f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"


def resolve_api_key(api_key: str | None = None) -> str | None:
    """The argument (``""``: none), else the first key in ``LLAMARUNNER_API_KEY``."""
    if api_key is not None:
        return api_key or None
    keys = [k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",")]
    return next((k for k in keys if k), None)


def _headers(api_key: str | None) -> dict[str, str]:
    key = resolve_api_key(api_key)
    return {"Authorization": f"Bearer {key}"} if key else {}


def _health_error(h: HealthStatus) -> APIStatusError:
    """The error a failed /health stands for: the model did not load, or the engine stopped."""
    message = h.error or "the model failed to load"
    kind = "engine_stopped" if message.startswith("the engine stopped") else "model_load_failed"
    return APIStatusError(message, status_code=500, type=kind)


def _ndjson_lines(chunks: Iterator[bytes]) -> Iterator[str]:
    """NDJSON lines, split at "\n" only: JSON strings may hold U+2028, U+2029 or U+0085
    unescaped, where httpx's `iter_lines` (as `str.splitlines`) would split too."""
    pending = b""
    for chunk in chunks:
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            yield line.decode("utf-8")
    if pending:
        yield pending.decode("utf-8")


async def _ndjson_lines_async(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """`_ndjson_lines` for an async body."""
    pending = b""
    async for chunk in chunks:
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            yield line.decode("utf-8")
    if pending:
        yield pending.decode("utf-8")


def _broken_stream(e: httpx.TransportError) -> APIConnectionError:
    """A connection lost once the answer has started (never retried: the text would be
    generated twice)."""
    if isinstance(e, httpx.TimeoutException):
        return APITimeoutError(f"the stream timed out: {e}")
    return APIConnectionError(f"the connection broke during the stream: {e}")


def _should_retry(response: httpx.Response | None, attempt: int, max_retries: int) -> bool:
    if attempt >= max_retries:
        return False
    return response is None or response.status_code == 503


# --- sync ----------------------------------------------------------------------------------


class Stream:
    """Streamed completion chunks. Leaving it early (``break``, ``close()``, the ``with``
    block) closes the connection, which cancels the sequence on the server."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self._lines = _ndjson_lines(response.iter_bytes())

    def __iter__(self) -> Iterator[CompletionChunk]:
        try:
            for line in self._lines:
                if line:
                    chunk = _chunk(line)
                    yield chunk
                    if chunk.done:
                        return
        except httpx.TransportError as e:
            raise _broken_stream(e) from e
        finally:
            self.close()

    def close(self) -> None:
        self._response.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client:
    """A synchronous client. ``api_key`` is sent as ``Authorization: Bearer``; by default the
    first key in ``LLAMARUNNER_API_KEY`` (``api_key=""``: none).

    >>> client = Client()  # LLAMARUNNER_HOST or http://127.0.0.1:8080
    >>> client.complete("Hello", num_predict=8).text  # doctest: +SKIP
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        timeout: float | httpx.Timeout | None = None,
        api_key: str | None = None,
        max_retries: int = 2,
        http_client: httpx.Client | None = None,
    ) -> None:
        self.base_url = resolve_base_url(base_url)
        self.max_retries = max_retries
        self._http = http_client or httpx.Client(
            timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
        )
        self._http.base_url = httpx.URL(self.base_url)
        self._http.headers.update(_headers(api_key))

    def _send(
        self, method: str, path: str, *, json_body: Any = None, stream: bool = False
    ) -> httpx.Response:
        """Sends with retries on connection errors and 503, before any stream starts."""
        attempt = 0
        while True:
            response: httpx.Response | None = None
            try:
                request = self._http.build_request(method, path, json=json_body)
                response = self._http.send(request, stream=stream)
            except httpx.TimeoutException as e:
                raise APITimeoutError(f"request to {self.base_url}{path} timed out") from e
            except httpx.TransportError as e:
                if not _should_retry(None, attempt, self.max_retries):
                    raise APIConnectionError(f"cannot reach {self.base_url}: {e}") from e
            if response is not None:
                if response.status_code < 400:
                    return response
                body = response.read()
                response.close()
                if not _should_retry(response, attempt, self.max_retries):
                    raise _status_error(response.status_code, body)
            time.sleep(_RETRY_DELAYS[min(attempt, len(_RETRY_DELAYS) - 1)])
            attempt += 1

    @overload
    def complete(
        self,
        prompt: str,
        *,
        stream: Literal[False] = False,
        grammar: str | None = None,
        format: Any = None,
        **options: Any,
    ) -> Completion: ...

    @overload
    def complete(
        self,
        prompt: str,
        *,
        stream: Literal[True],
        grammar: str | None = None,
        format: Any = None,
        **options: Any,
    ) -> Stream: ...

    def complete(
        self,
        prompt: str,
        *,
        stream: bool = False,
        grammar: str | None = None,
        format: Any = None,
        **options: Any,
    ) -> Completion | Stream:
        """Completes ``prompt``. ``options`` are Ollama's (``num_predict``, ``temperature``,
        ``top_k``, ``stop``, ``seed``, ...); ``format`` is ``"json"`` or a JSON schema."""
        return self._generate(_body(prompt, grammar, format, options), stream)

    def _generate(self, body: dict[str, Any], stream: bool) -> Completion | Stream:
        s = Stream(self._send("POST", "/completion", json_body=body, stream=True))
        if stream:
            return s
        with s:
            return _completion(list(s))

    @overload
    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        stream: Literal[False] = False,
        grammar: str | None = None,
        format: Any = None,
        **options: Any,
    ) -> Completion: ...

    @overload
    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        stream: Literal[True],
        grammar: str | None = None,
        format: Any = None,
        **options: Any,
    ) -> Stream: ...

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        stream: bool = False,
        grammar: str | None = None,
        format: Any = None,
        **options: Any,
    ) -> Completion | Stream:
        """Answers a conversation (``[{"role": ..., "content": ...}, ...]``), rendered with the
        model's chat template; otherwise as `complete`."""
        return self._generate(_body(messages, grammar, format, options), stream)

    def embed(self, text: str, *, truncate: bool = False) -> list[float]:
        """The embedding of ``text`` (pooled, not normalized)."""
        r = self._send("POST", "/embedding", json_body={"content": text, "truncate": truncate})
        return list(r.json()["embedding"])

    @overload
    def tokenize(
        self, text: str, *, add_special: bool = False, with_pieces: Literal[False] = False
    ) -> list[int]: ...

    @overload
    def tokenize(
        self, text: str, *, add_special: bool = False, with_pieces: Literal[True]
    ) -> list[TokenPiece]: ...

    def tokenize(
        self, text: str, *, add_special: bool = False, with_pieces: bool = False
    ) -> list[int] | list[TokenPiece]:
        """The model's tokens for ``text`` (special tokens in it parsed). ``add_special`` adds
        BOS (and EOS) when the model wants them, as prompts get; ``with_pieces`` returns each
        token with its text."""
        body = _tokenize_body(text, add_special, with_pieces)
        return _tokens(self._send("POST", "/tokenize", json_body=body).json(), with_pieces)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens`` (special tokens as written); ids outside the vocabulary raise
        `BadRequestError`."""
        r = self._send("POST", "/detokenize", json_body={"tokens": list(tokens)})
        return str(r.json()["content"])

    def health(self) -> HealthStatus:
        """The server's state (does not raise for loading or failed models)."""
        try:
            r = self._http.get("/health")
        except httpx.TransportError as e:
            raise APIConnectionError(f"cannot reach {self.base_url}: {e}") from e
        return _build(HealthStatus, r.json())  # type: ignore[no-any-return]

    def wait_ready(self, timeout: float = 120.0) -> HealthStatus:
        """Blocks until the model is loaded; raises `APIStatusError` (type
        ``model_load_failed`` or ``engine_stopped``) when /health says "error"."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                h = self.health()
                if h.status == "ready":
                    return h
                if h.status == "error":
                    raise _health_error(h)
            except APIConnectionError:
                pass
            if time.monotonic() > deadline:
                raise APITimeoutError(f"{self.base_url} was not ready within {timeout} s")
            time.sleep(0.05)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# --- async ---------------------------------------------------------------------------------


class AsyncStream:
    """Async twin of `Stream`."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[CompletionChunk]:
        try:
            async for line in _ndjson_lines_async(self._response.aiter_bytes()):
                if line:
                    chunk = _chunk(line)
                    yield chunk
                    if chunk.done:
                        return
        except httpx.TransportError as e:
            raise _broken_stream(e) from e
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        await self._response.aclose()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncClient:
    """An asyncio client with the same methods as `Client`."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        timeout: float | httpx.Timeout | None = None,
        api_key: str | None = None,
        max_retries: int = 2,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        self.base_url = resolve_base_url(base_url)
        self.max_retries = max_retries
        self._http = http_client or httpx.AsyncClient(
            timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
        )
        self._http.base_url = httpx.URL(self.base_url)
        self._http.headers.update(_headers(api_key))

    async def _send(
        self, method: str, path: str, *, json_body: Any = None, stream: bool = False
    ) -> httpx.Response:
        attempt = 0
        while True:
            response: httpx.Response | None = None
            try:
                request = self._http.build_request(method, path, json=json_body)
                response = await self._http.send(request, stream=stream)
            except httpx.TimeoutException as e:
                raise APITimeoutError(f"request to {self.base_url}{path} timed out") from e
            except httpx.TransportError as e:
                if not _should_retry(None, attempt, self.max_retries):
                    raise APIConnectionError(f"cannot reach {self.base_url}: {e}") from e
            if response is not None:
                if response.status_code < 400:
                    return response
                body = await response.aread()
                await response.aclose()
                if not _should_retry(response, attempt, self.max_retries):
                    raise _status_error(response.status_code, body)
            await asyncio.sleep(_RETRY_DELAYS[min(attempt, len(_RETRY_DELAYS) - 1)])
            attempt += 1

    @overload
    async def complete(
        self,
        prompt: str,
        *,
        stream: Literal[False] = False,
        grammar: str | None = None,
        format: Any = None,
        **options: Any,
    ) -> Completion: ...

    @overload
    async def complete(
        self,
        prompt: str,
        *,
        stream: Literal[True],
        grammar: str | None = None,
        format: Any = None,
        **options: Any,
    ) -> AsyncStream: ...

    async def complete(
        self,
        prompt: str,
        *,
        stream: bool = False,
        grammar: str | None = None,
        format: Any = None,
        **options: Any,
    ) -> Completion | AsyncStream:
        """Completes ``prompt``; see `Client.complete`."""
        return await self._generate(_body(prompt, grammar, format, options), stream)

    async def _generate(self, body: dict[str, Any], stream: bool) -> Completion | AsyncStream:
        s = AsyncStream(await self._send("POST", "/completion", json_body=body, stream=True))
        if stream:
            return s
        async with s:
            return _completion([c async for c in s])

    @overload
    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        stream: Literal[False] = False,
        grammar: str | None = None,
        format: Any = None,
        **options: Any,
    ) -> Completion: ...

    @overload
    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        stream: Literal[True],
        grammar: str | None = None,
        format: Any = None,
        **options: Any,
    ) -> AsyncStream: ...

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        stream: bool = False,
        grammar: str | None = None,
        format: Any = None,
        **options: Any,
    ) -> Completion | AsyncStream:
        """Answers a conversation; see `Client.chat`."""
        return await self._generate(_body(messages, grammar, format, options), stream)

    async def embed(self, text: str, *, truncate: bool = False) -> list[float]:
        """The embedding of ``text`` (pooled, not normalized)."""
        r = await self._send(
            "POST", "/embedding", json_body={"content": text, "truncate": truncate}
        )
        return list(r.json()["embedding"])

    @overload
    async def tokenize(
        self, text: str, *, add_special: bool = False, with_pieces: Literal[False] = False
    ) -> list[int]: ...

    @overload
    async def tokenize(
        self, text: str, *, add_special: bool = False, with_pieces: Literal[True]
    ) -> list[TokenPiece]: ...

    async def tokenize(
        self, text: str, *, add_special: bool = False, with_pieces: bool = False
    ) -> list[int] | list[TokenPiece]:
        """The model's tokens for ``text``; see `Client.tokenize`."""
        body = _tokenize_body(text, add_special, with_pieces)
        r = await self._send("POST", "/tokenize", json_body=body)
        return _tokens(r.json(), with_pieces)

    async def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens``; see `Client.detokenize`."""
        r = await self._send("POST", "/detokenize", json_body={"tokens": list(tokens)})
        return str(r.json()["content"])

    async def health(self) -> HealthStatus:
        try:
            r = await self._http.get("/health")
        except httpx.TransportError as e:
            raise APIConnectionError(f"cannot reach {self.base_url}: {e}") from e
        return _build(HealthStatus, r.json())  # type: ignore[no-any-return]

    async def wait_ready(self, timeout: float = 120.0) -> HealthStatus:
        deadline = time.monotonic() + timeout
        while True:
            try:
                h = await self.health()
                if h.status == "ready":
                    return h
                if h.status == "error":
                    raise _health_error(h)
            except APIConnectionError:
                pass
            if time.monotonic() > deadline:
                raise APITimeoutError(f"{self.base_url} was not ready within {timeout} s")
            await asyncio.sleep(0.05)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
