"""Hostile tool requests (property-based, as tests/test_hostile.py): generated `tools` (valid
and broken names, schemas of every shape including invalid and deeply nested ones, wrong JSON
types), `tool_choice`, `parallel_tool_calls` and conversations with calls and tool results, on
the OpenAI and Ollama chat endpoints and /apply-template of a server in a subprocess. Every
answer must be a 200 that ends properly or a 4xx in the dialect's error shape; never a 5xx, a
hang or a crash; and the server stays healthy with no busy slot. A 400 about a tool names it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_hostile import (
    HOSTILE,
    HSETTINGS,
    SCHEMAS,
    STATUSES,
    STRINGS,
    Target,
    assert_good,
    either,
    exchange,
    nested_schema,
    record,
)

from helpers import WatchedServer, wait_idle
from tinymodel import write_tiny_model

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny"
NAMES = st.one_of(
    st.sampled_from(["get_weather", "add", "f", "a.b-c_d", "x" * 64]),
    st.sampled_from(["", "a b", "x" * 65, "é", '"', "\\", "<tool_call>", "\n"]),
    STRINGS,
)
PARAMETERS = st.one_of(
    SCHEMAS.map(lambda s: {"type": "object", "properties": {"x": s}, "required": ["x"]}),
    SCHEMAS,
    st.integers(1, 60).map(lambda d: {"type": "object", "properties": {"x": nested_schema(d)}}),
    st.just({"type": "object", "properties": {"x": {"type": "banana"}}}),
    st.just({"type": "object", "properties": {"x": {"$ref": "#/nope"}}}),
    st.just({"type": "object", "properties": {"x": {"$ref": "#"}}}),
    st.just({"type": "object", "properties": {f"p{i}": {} for i in range(200)}}),
    HOSTILE,
)
TOOL = st.one_of(
    st.fixed_dictionaries(
        {
            "type": either(st.just("function")),
            "function": st.fixed_dictionaries(
                {"name": NAMES},
                optional={"description": either(st.text(max_size=20)), "parameters": PARAMETERS},
            ),
        }
    ),
    HOSTILE,
)
TOOLS = st.one_of(st.lists(TOOL, max_size=4), HOSTILE)
CHOICES = st.one_of(
    st.sampled_from(["auto", "none", "required", "any", "sometimes", ""]),
    NAMES.map(lambda n: {"type": "function", "function": {"name": n}}),
    HOSTILE,
)
CALL = st.fixed_dictionaries(
    {
        "id": either(st.just("call_1")),
        "type": either(st.just("function")),
        "function": either(
            st.fixed_dictionaries(
                {
                    "name": NAMES,
                    "arguments": st.one_of(
                        st.just('{"x": 1}'), st.just("not json"), st.just({"x": 1}), HOSTILE
                    ),
                }
            )
        ),
    }
)
MESSAGES = st.lists(
    st.one_of(
        st.just({"role": "user", "content": "weather in Paris"}),
        st.builds(
            lambda calls: {"role": "assistant", "content": None, "tool_calls": calls},
            st.one_of(st.lists(CALL, max_size=2), HOSTILE),
        ),
        st.builds(
            lambda c, i, n: {"role": "tool", "content": c, "tool_call_id": i, "tool_name": n},
            either(st.text(max_size=20)),
            either(st.just("call_1")),
            either(NAMES),
        ),
    ),
    min_size=1,
    max_size=4,
)


@st.composite
def bodies(draw: st.DrawFn, path: str) -> bytes:
    body: dict[str, Any] = {"model": MODEL, "messages": draw(MESSAGES), "tools": draw(TOOLS)}
    if path == "/v1/chat/completions":
        body["max_tokens"] = draw(st.integers(0, 24))
        if draw(st.booleans()):
            body["tool_choice"] = draw(CHOICES)
        if draw(st.booleans()):
            body["parallel_tool_calls"] = draw(either(st.booleans()))
        body["stream"] = draw(st.booleans())
    elif path == "/api/chat":
        body["options"] = {"num_predict": draw(st.integers(0, 24))}
        body["stream"] = draw(st.booleans())
    elif draw(st.booleans()):
        body["tool_choice"] = draw(CHOICES)
    return json.dumps(body).encode()


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    d = tmp_path_factory.mktemp("tools-hostile")
    t = Target(write_tiny_model(d / "tiny-model.gguf"), d)
    yield t
    t.close()
    print("\n=== test_tools_hostile: statuses per route ===")
    for path, counts in sorted(STATUSES.items()):
        print(f"{path}: {dict(sorted(counts.items()))}")


@pytest.fixture
def server(target: Target) -> Iterator[WatchedServer]:
    srv = target.ensure()
    yield srv
    if srv.tainted or not srv.alive():
        target.suspect = True


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat", "/apply-template"])
def test_hostile_tool_requests(server: WatchedServer, path: str) -> None:
    with httpx.Client() as client:

        @HSETTINGS
        @given(body=bodies(path))
        def one(body: bytes) -> None:
            reply = exchange(client, server, "POST", path, body)
            STATUSES[path][reply.status] += 1
            assert_good(path, body, reply)
            if reply.status == 400 and b'"tools"' in body:
                error = json.loads(reply.body)["error"]
                text = error if isinstance(error, str) else error["message"]
                assert text, reply.body

        try:
            one()
        except BaseException as e:
            record(f"POST {path} (tools)", e)
            raise
    wait_idle(server.url)


def test_a_schema_that_does_not_convert_names_its_tool(server: WatchedServer) -> None:
    for parameters, words in [
        ({"type": "object", "properties": {"x": {"type": "banana"}}}, "banana"),
        ({"type": "object", "properties": {"x": nested_schema(40)}}, "deeper"),
        ({"type": "object", "properties": {f"p{i}": {} for i in range(600)}}, "properties"),
    ]:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [
                {"type": "function", "function": {"name": "lookup", "parameters": parameters}}
            ],
            "tool_choice": "required",
        }
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "lookup" in message or "tools[0]" in message, message
        assert words in message, message
    wait_idle(server.url)
