"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) driven by the official
``anthropic`` SDK, on tiny models: text, stop reasons, the event stream, tool use and tool
results, thinking, token counts, errors and auth."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from llamarunner import Server

from helpers import TINY_WEATHER_PARAMS as WEATHER_SCHEMA
from tinymodel import write_chain_model, write_cycle_model, write_tiny_model

TEMPLATES = Path(__file__).parent / "templates"
MODEL = "tiny"
HELLO: list[Any] = [{"role": "user", "content": "hello there"}]
# The SDK no longer has sampling arguments; the API still takes them (extra_body).
GREEDY = {"temperature": 0}
# The tiny model is random: ignore_eos makes token counts exact.
EXACT = {**GREEDY, "ignore_eos": True}
CHAIN_TEXT = "Hi, Bob!"
WEATHER: Any = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": WEATHER_SCHEMA,
}


def sdk(url: str, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = write_tiny_model(tmp_path_factory.mktemp("anthropic") / "tiny-model.gguf")
    with Server(str(model), port=0, parallel=2, ctx_size=4096, threads=2, alias=MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[anthropic.Anthropic]:
    with sdk(server.url) as c:
        yield c


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[anthropic.Anthropic]:
    """A model that answers "Hi, Bob!" and ends its turn."""
    model = write_chain_model(tmp_path_factory.mktemp("chain") / "chain.gguf", CHAIN_TEXT)
    with (
        Server(str(model), port=0, ctx_size=512, threads=2, alias="chain") as srv,
        sdk(srv.url) as c,
    ):
        yield c


def test_a_message_with_usage(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model=MODEL, max_tokens=8, messages=HELLO, extra_body=EXACT)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.id.startswith("msg_")
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert [b.type for b in m.content] == ["text"]
    assert m.usage.output_tokens == 8
    assert m.usage.input_tokens > 5


def test_the_stream_is_anthropics_event_sequence_and_equals_the_whole_answer(
    server: Server, client: anthropic.Anthropic
) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 10,
        "messages": HELLO,
        "system": "Be terse.",
    }
    whole = client.messages.create(**body, extra_body=EXACT)
    with client.messages.stream(**body, extra_body=EXACT) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == whole.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10
    # The second time the prompt is cached: Anthropic counts those tokens apart.
    total = final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
    assert total == whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
    # The raw events: names and order as Anthropic sends them.
    with httpx.stream(
        "POST", f"{server.url}/v1/messages", json={**body, **EXACT, "stream": True}, timeout=60
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    names = [line[len("event: ") :] for line in raw.splitlines() if line.startswith("event: ")]
    datas = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    assert [d["type"] for d in datas] == names
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert datas[0]["message"]["usage"]["input_tokens"] == total
    assert datas[-2]["delta"]["stop_reason"] == "max_tokens"


def test_stop_reasons_end_turn_and_stop_sequence(chain: anthropic.Anthropic) -> None:
    m = chain.messages.create(model="chain", max_tokens=50, messages=HELLO, extra_body=GREEDY)
    assert m.content[0].text == CHAIN_TEXT  # type: ignore[union-attr]
    assert (m.stop_reason, m.stop_sequence) == ("end_turn", None)
    m = chain.messages.create(
        model="chain", max_tokens=50, messages=HELLO, extra_body=GREEDY, stop_sequences=["Bo", "zz"]
    )
    assert m.content[0].text == "Hi, "  # type: ignore[union-attr]
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "Bo")
    with chain.messages.stream(
        model="chain", max_tokens=50, messages=HELLO, extra_body=GREEDY, stop_sequences=["Bo"]
    ) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "Bo")
    assert final.content[0].text == "Hi, "  # type: ignore[union-attr]


def test_a_last_assistant_message_is_continued(chain: anthropic.Anthropic) -> None:
    # Prefill: the answer carries on from the assistant's text ("Hi, B" -> "ob!"), and the
    # prompt counted is the one continued.
    prefill: Any = [*HELLO, {"role": "assistant", "content": "Hi, B"}]
    m = chain.messages.create(model="chain", max_tokens=50, messages=prefill, extra_body=GREEDY)
    assert m.content[0].text == "ob!"  # type: ignore[union-attr]
    assert m.stop_reason == "end_turn"
    counted = chain.messages.count_tokens(model="chain", messages=prefill)
    assert counted.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    whole = chain.messages.create(model="chain", max_tokens=50, messages=HELLO, extra_body=GREEDY)
    assert whole.content[0].text == CHAIN_TEXT  # type: ignore[union-attr]


def test_a_forced_tool_is_a_tool_use_block_whole_and_streamed(
    client: anthropic.Anthropic,
) -> None:
    forced: Any = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    m = client.messages.create(
        model=MODEL,
        max_tokens=400,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice=forced,
        extra_body=GREEDY,
    )
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    assert uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER_SCHEMA)
    with client.messages.stream(
        model=MODEL,
        max_tokens=400,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice=forced,
        extra_body=GREEDY,
    ) as s:
        final = s.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed] == [(b.name, b.input) for b in uses]


def test_a_conversation_with_tool_results_is_answered_and_counted(
    client: anthropic.Anthropic,
) -> None:
    messages: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                {
                    "type": "tool_use",
                    "id": "toolu_01",
                    "name": "get_weather",
                    "input": {"city": "Paris", "unit": "celsius"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": "21 degrees"},
                {"type": "text", "text": "Thanks."},
            ],
        },
    ]
    counted = client.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER])
    m = client.messages.create(
        model=MODEL, max_tokens=4, messages=messages, tools=[WEATHER], extra_body=GREEDY
    )
    cached = m.usage.cache_read_input_tokens or 0
    assert counted.input_tokens == m.usage.input_tokens + cached
    without_tools = client.messages.count_tokens(model=MODEL, messages=messages)
    # The generic template shows the tools in the system prompt.
    assert without_tools.input_tokens < counted.input_tokens
    short = client.messages.count_tokens(model=MODEL, messages=HELLO)
    assert 0 < short.input_tokens < without_tools.input_tokens


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[anthropic.Anthropic]:
    """Writes "OK</think>" over and over behind a thinking (Qwen 3) template."""
    model = write_cycle_model(tmp_path_factory.mktemp("think") / "thinker.gguf", "OK</think>")
    with (
        Server(
            str(model),
            port=0,
            ctx_size=512,
            threads=2,
            alias="thinker",
            chat_template=str(TEMPLATES / "qwen3.jinja"),
        ) as srv,
        sdk(srv.url) as c,
    ):
        yield c


def test_thinking_is_a_thinking_block(thinker: anthropic.Anthropic) -> None:
    hi: Any = [{"role": "user", "content": "hi"}]
    # "OK</think>OK</think>" cut at 12 bytes: thinking "OK", then the answer "OK".
    m = thinker.messages.create(model="thinker", max_tokens=12, messages=hi, extra_body=GREEDY)
    assert [
        (b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content
    ] == [
        ("thinking", "OK"),
        ("text", "OK"),
    ]
    with thinker.messages.stream(
        model="thinker", max_tokens=12, messages=hi, extra_body=GREEDY
    ) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert "thinking" in kinds and "text" in kinds
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "OK"  # type: ignore[union-attr]
    # thinking disabled: the template is asked not to think and the text is left as is.
    off = thinker.messages.create(
        model="thinker",
        max_tokens=12,
        messages=hi,
        extra_body=GREEDY,
        thinking={"type": "disabled"},
    )
    assert [b.type for b in off.content] == ["text"]
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        thinker.messages.create(
            model="thinker",
            max_tokens=12,
            messages=hi,
            thinking={"type": "enabled", "budget_tokens": 2048},
        )


def test_output_config_format_constrains_the_answer_to_the_schema(
    client: anthropic.Anthropic,
) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    m = client.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=HELLO,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)  # type: ignore[union-attr]


def test_errors_are_in_anthropics_shape(server: Server, client: anthropic.Anthropic) -> None:
    # Any model name is the served model (as on llama-server), and the answer names it.
    named = client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=HELLO)
    assert named.model == MODEL
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model=MODEL, max_tokens=4, messages=HELLO, extra_body={"temperature": 1.5}
        )
    assert "temperature" in str(bad.value)
    for body, names in [
        ({"model": MODEL, "messages": HELLO}, "max_tokens"),
        ({"model": MODEL, "max_tokens": 4}, "messages"),
        (
            {"model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
            "messages.0.role",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": HELLO,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "tools.0",
        ),
        (b"{not json", "invalid"),
    ]:
        r = httpx.post(
            f"{server.url}/v1/messages",
            **({"content": body} if isinstance(body, bytes) else {"json": body}),
            timeout=30,
        )
        assert r.status_code == 400, (body, r.text)
        err = r.json()
        assert err["type"] == "error"
        assert err["error"]["type"] == "invalid_request_error"
        assert names in err["error"]["message"], (names, err)
    r = httpx.get(f"{server.url}/v1/messages", timeout=10)
    assert r.status_code == 405 and r.json()["type"] == "error"
    # An empty conversation is taken, as llama-server takes it (Anthropic's API refuses it), and
    # so is a thinking budget under Anthropic's 1024: with or without a system prompt.
    for body in [
        {"model": MODEL, "max_tokens": 3, "messages": []},
        {"model": MODEL, "max_tokens": 3, "messages": [], "system": "Be terse."},
        {
            "model": MODEL,
            "max_tokens": 60,
            "messages": HELLO,
            "thinking": {"type": "enabled", "budget_tokens": 50},
        },
    ]:
        r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
        assert r.status_code == 200, (body, r.text)
        assert r.json()["type"] == "message"


def test_the_api_key_is_read_from_x_api_key(tiny_model: Path) -> None:
    with Server(str(tiny_model), port=0, ctx_size=256, threads=2, api_key="sekrit") as srv:
        with sdk(srv.url, "wrong") as c, pytest.raises(anthropic.AuthenticationError) as e:
            c.messages.create(model="tiny", max_tokens=2, messages=HELLO)
        assert e.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        with sdk(srv.url, "sekrit") as c:
            m = c.messages.create(model="tiny", max_tokens=2, messages=HELLO, extra_body=EXACT)
            assert m.usage.output_tokens == 2
