"""llamarunner.Client and AsyncClient against a real server on the tiny model."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

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
from llamarunner.client import resolve_base_url


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
    deadline = time.monotonic() + 10
    while client.health().slots_processing:
        assert time.monotonic() < deadline
        time.sleep(0.01)
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
    # One slot and a queue of one: a running request, a waiting one, and the third is refused.
    srv = start_server(tiny_model, parallel=1, ctx_size=60000, max_queue=1)
    client = srv.client(max_retries=0)
    running = client.complete("a", stream=True, temperature=1, ignore_eos=True)
    chunks = iter(running)  # keep a reference: a dropped iterator closes the stream
    next(chunks)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.complete, "b", num_predict=2, ignore_eos=True)
        time.sleep(0.3)
        with pytest.raises(RateLimitError) as e:
            client.complete("c", num_predict=1)
        assert e.value.status_code == 429
        assert e.value.type == "overloaded"
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
    assert h.slots_idle == 2


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
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert (await client.complete("next", num_predict=2, ignore_eos=True)).eval_count == 2

    asyncio.run(main())
