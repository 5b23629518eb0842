"""llamarunner.Client and AsyncClient against a real server on the tiny model."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from llamarunner import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AsyncClient,
    BadRequestError,
    Client,
    Completion,
    LlamaRunnerError,
    NotFoundError,
    RateLimitError,
    Server,
    ServiceUnavailableError,
)
from llamarunner import client as client_module
from llamarunner.client import resolve_base_url

from helpers import wait_idle


@pytest.fixture
def no_retry_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries without the back-off sleeps, to keep the tests fast."""
    monkeypatch.setattr(client_module, "_RETRY_DELAYS", (0.0,))


def test_complete(tiny_server: Server) -> None:
    with tiny_server.client() as client:
        c = client.complete("hello", num_predict=6, temperature=0)
    assert isinstance(c, Completion)
    assert c.eval_count == 6
    assert c.done_reason == "length"
    assert c.prompt_eval_count >= 2
    assert c.eval_duration > 0


def test_stream_yields_chunks_then_stats(tiny_server: Server) -> None:
    with (
        Client(tiny_server.url) as client,
        client.complete("hello", stream=True, num_predict=5, temperature=0) as stream,
    ):
        chunks = list(stream)
    assert chunks[-1].done and chunks[-1].eval_count == 5
    assert all(not c.done for c in chunks[:-1])
    whole = Client(tiny_server.url).complete("hello", num_predict=5, temperature=0)
    assert "".join(c.content for c in chunks) == whole.text


def test_leaving_a_stream_early_frees_the_slot(
    tiny_model: Path, start_server: Callable[..., Server]
) -> None:
    srv = start_server(tiny_model, parallel=1, ctx_size=60000)
    client = srv.client()
    with client.complete("hello", stream=True, temperature=1, ignore_eos=True) as stream:
        for _ in stream:
            break
    wait_idle(srv.url)
    assert client.complete("next", num_predict=2, ignore_eos=True).eval_count == 2


def test_errors_are_typed(tiny_server: Server) -> None:
    client = tiny_server.client()
    with pytest.raises(BadRequestError) as e:
        client.complete("x", top_p=5)
    assert e.value.status_code == 400
    assert e.value.type == "invalid_request"
    assert "top_p" in e.value.message
    with pytest.raises(NotFoundError):
        client._send("GET", "/nope")


def test_connection_error() -> None:
    client = Client("http://127.0.0.1:9", max_retries=0)
    with pytest.raises(APIConnectionError):
        client.complete("x")


def test_429_and_503_are_typed(tiny_model: Path, start_server: Callable[..., Server]) -> None:
    # One slot and a queue of one: with a request running, of two more sent at once one waits
    # and the other is refused. Which is which is up to the race, so no sleep decides it.
    srv = start_server(tiny_model, parallel=1, ctx_size=60000, max_queue=1)
    client = srv.client(max_retries=0)
    running = client.complete("a", stream=True, temperature=1, ignore_eos=True)
    chunks = iter(running)  # keep a reference: a dropped iterator closes the stream
    next(chunks)
    with ThreadPoolExecutor(2) as pool:
        both = [
            pool.submit(client.complete, prompt, num_predict=2, ignore_eos=True)
            for prompt in ("b", "c")
        ]
        done, _ = wait(both, timeout=30, return_when=FIRST_COMPLETED)
        assert len(done) == 1, "neither request was refused"
        refused = done.pop()
        with pytest.raises(RateLimitError) as e:
            refused.result()
        assert e.value.status_code == 429
        assert e.value.type == "overloaded"
        (waiting,) = [f for f in both if f is not refused]
        assert not waiting.done(), "the other one waits for the slot"
        running.close()
        assert waiting.result(timeout=30).eval_count == 2
    url = srv.url
    srv.stop()
    with pytest.raises(APIConnectionError):
        Client(url, max_retries=0).complete("x")


def test_base_url_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMARUNNER_HOST", "0.0.0.0:9000")
    assert resolve_base_url() == "http://127.0.0.1:9000"
    monkeypatch.setenv("LLAMARUNNER_HOST", "https://example.org:443")
    assert resolve_base_url() == "https://example.org:443"
    monkeypatch.delenv("LLAMARUNNER_HOST")
    assert resolve_base_url() == "http://127.0.0.1:8080"
    assert resolve_base_url("http://h:1/") == "http://h:1"


def test_async_client(tiny_server: Server) -> None:
    async def main() -> None:
        async with AsyncClient(tiny_server.url) as client:
            assert (await client.health()).status == "ready"
            await client.wait_ready(5)
            c = await client.complete("hello", num_predict=4, temperature=0)
            assert c.eval_count == 4
            stream = await client.complete("hello", stream=True, num_predict=4, temperature=0)
            async with stream:
                chunks = [chunk async for chunk in stream]
            assert "".join(ch.content for ch in chunks) == c.text
            with pytest.raises(BadRequestError):
                await client.complete("x", mirostat=9)
            results = await asyncio.gather(
                *(
                    client.complete(f"the {w}", num_predict=3, ignore_eos=True)
                    for w in ("cat", "dog", "world")
                )
            )
            assert [r.eval_count for r in results] == [3, 3, 3]

    asyncio.run(main())


def test_wait_ready_and_health(tiny_server: Server) -> None:
    client = Client(tiny_server.url)
    h = client.wait_ready(5)
    assert h.status == "ready"
    # Earlier tests' slots are released just after their last step.
    wait_idle(tiny_server.url)
    h = client.health()
    assert (h.slots_idle, h.slots_processing) == (2, 0)


def mock_client(handler: Callable[[httpx.Request], httpx.Response], **kw: object) -> Client:
    http = httpx.Client(transport=httpx.MockTransport(handler))
    return Client("http://runner.test", http_client=http, **kw)  # type: ignore[arg-type]


def test_503_while_loading_is_retried_then_raised() -> None:
    calls: list[str] = []

    def loading(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        body = {"error": {"message": "the model is still loading", "type": "model_loading"}}
        return httpx.Response(503, json=body)

    with pytest.raises(ServiceUnavailableError) as e:
        mock_client(loading, max_retries=2).complete("x")
    assert e.value.status_code == 503
    assert e.value.type == "model_loading"
    assert len(calls) == 3  # first try + 2 retries


def test_503_then_success() -> None:
    answers = iter([503, 200])

    def handler(request: httpx.Request) -> httpx.Response:
        if next(answers) == 503:
            return httpx.Response(503, json={"error": {"message": "loading", "type": "x"}})
        lines = '{"content":"hi","done":false}\n{"content":"","done":true,"done_reason":"stop"}\n'
        return httpx.Response(200, text=lines)

    c = mock_client(handler).complete("x")
    assert (c.text, c.done_reason) == ("hi", "stop")


def test_400_is_never_retried_and_timeouts_are_typed() -> None:
    calls: list[int] = []

    def bad(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(400, json={"error": {"message": "no", "type": "invalid_request"}})

    with pytest.raises(BadRequestError):
        mock_client(bad).complete("x")
    assert len(calls) == 1

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    with pytest.raises(APITimeoutError):
        mock_client(slow).complete("x")


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_line_separators_inside_the_text_do_not_split_a_line(use_async: bool) -> None:
    """NDJSON lines end at "\\n" only. JSON strings may carry U+2028, U+2029 and U+0085
    unescaped (this server escapes them; Ollama's writes U+0085 as it is, and any server may),
    so a reader that splits where str.splitlines does (httpx's iter_lines) breaks such a line
    in two."""
    text = "a\u2028b\u2029c\u0085d"
    piece = json.dumps({"content": text, "done": False}, ensure_ascii=False)
    assert "\u2028" in piece  # raw, as the server sends it
    body = (piece + "\n" + '{"content":"","done":true,"done_reason":"stop"}\n').encode()

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body)

    if use_async:

        async def main() -> str:
            async with async_mock_client(handler) as c:
                return (await c.complete("x")).text

        assert asyncio.run(main()) == text
    else:
        assert mock_client(handler).complete("x").text == text


def test_error_inside_a_stream_raises() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        lines = (
            '{"content":"a","done":false}\n'
            '{"done":true,"done_reason":"error","error":{"message":"boom","type":"internal_error"}}\n'
        )
        return httpx.Response(200, text=lines)

    with pytest.raises(APIStatusError) as e:
        mock_client(handler).complete("x")
    assert e.value.type == "internal_error"
    assert isinstance(e.value, LlamaRunnerError)


def test_async_stream_early_exit_frees_the_slot(
    tiny_model: Path, start_server: Callable[..., Server]
) -> None:
    srv = start_server(tiny_model, parallel=1, ctx_size=60000)

    async def main() -> None:
        async with AsyncClient(srv.url) as client:
            stream = await client.complete("hello", stream=True, temperature=1, ignore_eos=True)
            async with stream:
                async for _ in stream:
                    break
            deadline = time.monotonic() + 10
            while (await client.health()).slots_processing:
                assert time.monotonic() < deadline, "the slot stayed busy"
                await asyncio.sleep(0.01)
            assert (await client.complete("next", num_predict=2, ignore_eos=True)).eval_count == 2

    asyncio.run(main())


# --- retry rules: connection errors and 503 are retried, nothing else, never mid-stream ----

OK_LINES = '{"content":"hi","done":false}\n{"content":"","done":true,"done_reason":"stop"}\n'
LOADING = {"error": {"message": "the model is still loading", "type": "model_loading"}}


def async_mock_client(
    handler: Callable[[httpx.Request], httpx.Response], **kw: object
) -> AsyncClient:
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return AsyncClient("http://runner.test", http_client=http, **kw)  # type: ignore[arg-type]


def flaky(failures: list[Any]) -> tuple[Callable[[httpx.Request], httpx.Response], list[str]]:
    """A handler that answers with (or raises) each of ``failures`` in turn, then succeeds."""
    calls: list[str] = []
    left = list(failures)

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if left:
            failure = left.pop(0)
            if isinstance(failure, Exception):
                raise failure
            return httpx.Response(failure, json=LOADING)
        return httpx.Response(200, text=OK_LINES)

    return handler, calls


def connect_error() -> httpx.ConnectError:
    return httpx.ConnectError("connection refused")


@pytest.mark.usefixtures("no_retry_delay")
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_connection_errors_and_503_are_retried(use_async: bool) -> None:
    def run(handler: Callable[[httpx.Request], httpx.Response], **kw: object) -> Completion:
        if use_async:

            async def main() -> Completion:
                async with async_mock_client(handler, **kw) as c:
                    return await c.complete("x")

            return asyncio.run(main())
        return mock_client(handler, **kw).complete("x")

    # Two failures, two retries: the third try answers.
    handler, calls = flaky([connect_error(), 503])
    assert run(handler, max_retries=2).text == "hi"
    assert len(calls) == 3
    # One failure too many: the last one is raised, typed.
    handler, calls = flaky([connect_error(), connect_error(), connect_error()])
    with pytest.raises(APIConnectionError):
        run(handler, max_retries=2)
    assert len(calls) == 3
    handler, calls = flaky([503, 503])
    with pytest.raises(ServiceUnavailableError):
        run(handler, max_retries=1)
    assert len(calls) == 2
    # max_retries=0: one try only.
    handler, calls = flaky([503])
    with pytest.raises(ServiceUnavailableError):
        run(handler, max_retries=0)
    assert len(calls) == 1


@pytest.mark.usefixtures("no_retry_delay")
@pytest.mark.parametrize("status", [400, 404, 429, 500])
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_other_errors_are_never_retried(status: int, use_async: bool) -> None:
    handler, calls = flaky([status])
    with pytest.raises(APIStatusError) as e:
        if use_async:

            async def main() -> None:
                async with async_mock_client(handler, max_retries=3) as c:
                    await c.complete("x")

            asyncio.run(main())
        else:
            mock_client(handler, max_retries=3).complete("x")
    assert e.value.status_code == status
    assert len(calls) == 1


class BrokenStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A body that sends one line, then loses the connection."""

    def __iter__(self) -> Iterator[bytes]:
        yield b'{"content":"a","done":false}\n'
        raise httpx.ReadError("connection reset")

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'{"content":"a","done":false}\n'
        raise httpx.ReadError("connection reset")


@pytest.mark.usefixtures("no_retry_delay")
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_stream_that_breaks_is_never_retried(stream: bool, use_async: bool) -> None:
    """Once the answer has started, a lost connection is an error, never a second request
    (which would generate, and bill, the text twice)."""
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(200, stream=BrokenStream())

    received: list[str] = []

    async def run_async() -> None:
        async with async_mock_client(handler, max_retries=3) as c:
            if stream:
                s = await c.complete("x", stream=True)
                async with s:
                    async for chunk in s:
                        received.append(chunk.content)
            else:
                await c.complete("x")

    with pytest.raises(APIConnectionError):
        if use_async:
            asyncio.run(run_async())
        elif stream:
            with mock_client(handler, max_retries=3).complete("x", stream=True) as s:
                for chunk in s:
                    received.append(chunk.content)
        else:
            mock_client(handler, max_retries=3).complete("x")
    assert len(calls) == 1
    assert received == (["a"] if stream else [])


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_wait_ready_times_out_while_loading_and_raises_a_failed_load(use_async: bool) -> None:
    def loading(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/health"
        return httpx.Response(503, json={"status": "loading", "progress": 0.5})

    def failed(request: httpx.Request) -> httpx.Response:
        body = {"status": "error", "progress": 0.0, "error": "llama.cpp could not load m.gguf"}
        return httpx.Response(500, json=body)

    def wait_ready(handler: Callable[[httpx.Request], httpx.Response], timeout: float) -> None:
        if use_async:

            async def main() -> None:
                async with async_mock_client(handler) as c:
                    await c.wait_ready(timeout)

            asyncio.run(main())
        else:
            mock_client(handler).wait_ready(timeout)

    started = time.monotonic()
    with pytest.raises(APITimeoutError, match="not ready within"):
        wait_ready(loading, 0.3)
    assert 0.3 <= time.monotonic() - started < 5
    with pytest.raises(APIStatusError) as e:
        wait_ready(failed, 30)
    assert e.value.type == "model_load_failed"
    assert "could not load" in e.value.message


def test_wait_ready_times_out_when_nothing_listens() -> None:
    started = time.monotonic()
    with pytest.raises(APITimeoutError):
        Client("http://127.0.0.1:9", max_retries=0).wait_ready(0.3)
    assert time.monotonic() - started < 5
