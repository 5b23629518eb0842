"""`Client` and `AsyncClient` for a llamarunner server, in the style of the `ollama` and
`openai` clients: typed results, streaming iterators that are also context managers, and
exceptions that carry the status code and the server's error type."""

# What each call sends and how its answer is read lives once, in `_requests`; the two clients
# here only differ in how they send (httpx.Client / httpx.AsyncClient), wait and iterate.

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar, overload

import httpx

from . import _health, _requests
from ._errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    LlamaRunnerError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitError,
    ServiceUnavailableError,
)
from ._requests import Think
from ._results import Completion, CompletionChunk, HealthStatus, TokenPiece
from .config import API_KEY_ENV, DEFAULT_HOST, DEFAULT_PORT, _split_host

__all__ = [
    "DEFAULT_TIMEOUT",
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
    "HealthStatus",
    "LlamaRunnerError",
    "NotFoundError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "RateLimitError",
    "ServiceUnavailableError",
    "Stream",
    "TokenPiece",
    "resolve_api_key",
    "resolve_base_url",
]

_T = TypeVar("_T")

DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=60.0, pool=60.0)
_RETRY_DELAYS = (0.25, 0.5, 1.0, 2.0, 4.0)


def _retry_delay(attempt: int) -> float:
    """Seconds to wait before retry number ``attempt`` (from 0)."""
    return _RETRY_DELAYS[min(attempt, len(_RETRY_DELAYS) - 1)]


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


def _configure(http: httpx.Client | httpx.AsyncClient, base_url: str, api_key: str | None) -> None:
    """Points ``http`` at the server and adds the ``Authorization`` header, if any."""
    http.base_url = httpx.URL(base_url)
    key = resolve_api_key(api_key)
    if key:
        http.headers.update({"Authorization": f"Bearer {key}"})


# --- sync ----------------------------------------------------------------------------------


class Stream:
    """Streamed completion chunks. Leaving it early (``break``, ``close()``, the ``with``
    block) closes the connection, which cancels the sequence on the server."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self._body = response.iter_bytes()
        self._decoder = _requests.ChunkDecoder()

    def __iter__(self) -> Iterator[CompletionChunk]:
        try:
            for data in self._body:
                yield from self._decoder.feed(data)
                if self._decoder.done:
                    return
            yield from self._decoder.finish()
        except httpx.TransportError as e:
            raise _requests.broken_stream(e) from e
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
        _configure(self._http, self.base_url, api_key)

    def _send(
        self, method: str, path: str, *, json_body: Any = None, stream: bool = False
    ) -> httpx.Response:
        """Sends with retries on connection errors and 503, before any stream starts."""
        retries = _requests.Retries(self.base_url, path, self.max_retries)
        while True:
            try:
                request = self._http.build_request(method, path, json=json_body)
                response = self._http.send(request, stream=stream)
            except httpx.TransportError as e:
                retries.send_failed(e)
            else:
                if response.status_code < 400:
                    return response
                body = response.read()
                response.close()
                retries.status_failed(response.status_code, body)
            time.sleep(_retry_delay(retries.next()))

    def _call(self, request: _requests.Request[_T]) -> _T:
        if request.checked:
            response = self._send(request.method, request.path, json_body=request.json)
        else:
            try:
                response = self._http.request(request.method, request.path, json=request.json)
            except httpx.TransportError as e:
                raise _requests.unreachable(self.base_url, e) from e
        return request.parse(response.json())

    def _generate(self, request: _requests.StreamRequest, stream: bool) -> Completion | Stream:
        response = self._send(request.method, request.path, json_body=request.json, stream=True)
        s = Stream(response)
        if stream:
            return s
        with s:
            return _requests.completion(list(s))

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
        return self._generate(_requests.generate(prompt, grammar, format, options), stream)

    @overload
    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        stream: Literal[False] = False,
        grammar: str | None = None,
        format: Any = None,
        think: Think = None,
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
        think: Think = None,
        **options: Any,
    ) -> Stream: ...

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        stream: bool = False,
        grammar: str | None = None,
        format: Any = None,
        think: Think = None,
        **options: Any,
    ) -> Completion | Stream:
        """Answers a conversation (``[{"role": ..., "content": ...}, ...]``), rendered with the
        model's chat template; otherwise as `complete`. ``think`` (Ollama's: true, false,
        ``"high"``/``"medium"``/``"low"``) asks the template to think or not, and splits a
        thinking model's ``<think>`` reasoning from the answer: it comes in ``thinking`` (of
        the `Completion`, or of the chunks that carry it); None leaves the text as generated."""
        request = _requests.generate(messages, grammar, format, options, think)
        return self._generate(request, stream)

    def embed(self, text: str, *, truncate: bool = False, model: str | None = None) -> list[float]:
        """The embedding of ``text`` (pooled, not normalized)."""
        return self._call(_requests.embed(text, truncate, model))

    def rerank(
        self,
        query: str,
        documents: list[str],
        *,
        top_n: int | None = None,
        model: str | None = None,
    ) -> list[tuple[int, float]]:
        """``(index, relevance score)`` of each of ``documents`` against ``query``, most relevant
        first (at most ``top_n``), from a reranker model (rank pooling)."""
        return self._call(_requests.rerank(query, documents, top_n, model))

    def models(self) -> list[dict[str, Any]]:
        """The models the server serves (``id``; on a server of many, ``status`` too)."""
        return self._call(_requests.models())

    def load(self, model: str) -> None:
        """Loads ``model`` on a server of many models; returns once it is loaded."""
        self._call(_requests.load(model))

    def unload(self, model: str) -> None:
        """Unloads ``model`` on a server of many models."""
        self._call(_requests.unload(model))

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
        return self._call(_requests.tokenize(text, add_special, with_pieces))

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens`` (special tokens as written); ids outside the vocabulary raise
        `BadRequestError`."""
        return self._call(_requests.detokenize(tokens))

    def health(self) -> HealthStatus:
        """The server's state (does not raise for loading or failed models)."""
        return self._call(_requests.health())

    def wait_ready(self, timeout: float = 120.0) -> HealthStatus:
        """Blocks until the model is loaded; raises `APIStatusError` (type
        ``model_load_failed`` or ``engine_stopped``) when /health says "error"."""
        wait = _requests.ready_wait(self.base_url, timeout)
        return _health.wait_ready(self._reachable_health, wait, _requests.POLL_INTERVAL)

    def _reachable_health(self) -> HealthStatus | None:
        """`health`, or None when the server cannot be reached (yet)."""
        try:
            return self.health()
        except APIConnectionError:
            return None

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
        decoder = _requests.ChunkDecoder()
        try:
            async for data in self._response.aiter_bytes():
                for chunk in decoder.feed(data):
                    yield chunk
                if decoder.done:
                    return
            for chunk in decoder.finish():
                yield chunk
        except httpx.TransportError as e:
            raise _requests.broken_stream(e) from e
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
        _configure(self._http, self.base_url, api_key)

    async def _send(
        self, method: str, path: str, *, json_body: Any = None, stream: bool = False
    ) -> httpx.Response:
        retries = _requests.Retries(self.base_url, path, self.max_retries)
        while True:
            try:
                request = self._http.build_request(method, path, json=json_body)
                response = await self._http.send(request, stream=stream)
            except httpx.TransportError as e:
                retries.send_failed(e)
            else:
                if response.status_code < 400:
                    return response
                body = await response.aread()
                await response.aclose()
                retries.status_failed(response.status_code, body)
            await asyncio.sleep(_retry_delay(retries.next()))

    async def _call(self, request: _requests.Request[_T]) -> _T:
        if request.checked:
            response = await self._send(request.method, request.path, json_body=request.json)
        else:
            try:
                response = await self._http.request(request.method, request.path, json=request.json)
            except httpx.TransportError as e:
                raise _requests.unreachable(self.base_url, e) from e
        return request.parse(response.json())

    async def _generate(
        self, request: _requests.StreamRequest, stream: bool
    ) -> Completion | AsyncStream:
        response = await self._send(
            request.method, request.path, json_body=request.json, stream=True
        )
        s = AsyncStream(response)
        if stream:
            return s
        async with s:
            return _requests.completion([c async for c in s])

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
        request = _requests.generate(prompt, grammar, format, options)
        return await self._generate(request, stream)

    @overload
    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        stream: Literal[False] = False,
        grammar: str | None = None,
        format: Any = None,
        think: Think = None,
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
        think: Think = None,
        **options: Any,
    ) -> AsyncStream: ...

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        stream: bool = False,
        grammar: str | None = None,
        format: Any = None,
        think: Think = None,
        **options: Any,
    ) -> Completion | AsyncStream:
        """Answers a conversation; see `Client.chat`."""
        request = _requests.generate(messages, grammar, format, options, think)
        return await self._generate(request, stream)

    async def embed(
        self, text: str, *, truncate: bool = False, model: str | None = None
    ) -> list[float]:
        """The embedding of ``text`` (pooled, not normalized)."""
        return await self._call(_requests.embed(text, truncate, model))

    async def rerank(
        self,
        query: str,
        documents: list[str],
        *,
        top_n: int | None = None,
        model: str | None = None,
    ) -> list[tuple[int, float]]:
        """Ranks ``documents`` against ``query``; see `Client.rerank`."""
        return await self._call(_requests.rerank(query, documents, top_n, model))

    async def models(self) -> list[dict[str, Any]]:
        """The models the server serves; see `Client.models`."""
        return await self._call(_requests.models())

    async def load(self, model: str) -> None:
        """Loads ``model`` on a server of many models; see `Client.load`."""
        await self._call(_requests.load(model))

    async def unload(self, model: str) -> None:
        """Unloads ``model`` on a server of many models."""
        await self._call(_requests.unload(model))

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
        return await self._call(_requests.tokenize(text, add_special, with_pieces))

    async def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens``; see `Client.detokenize`."""
        return await self._call(_requests.detokenize(tokens))

    async def health(self) -> HealthStatus:
        return await self._call(_requests.health())

    async def wait_ready(self, timeout: float = 120.0) -> HealthStatus:
        wait = _requests.ready_wait(self.base_url, timeout)
        return await _health.wait_ready_async(self._reachable_health, wait, _requests.POLL_INTERVAL)

    async def _reachable_health(self) -> HealthStatus | None:
        """`health`, or None when the server cannot be reached (yet)."""
        try:
            return await self.health()
        except APIConnectionError:
            return None

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
