"""Tool calling with the official ``openai``, ``ollama`` and ``anthropic`` clients on the
default model (Gemma 3 270M, generic tool format: its template does not render tools, so the
system prompt introduces them). The grammar makes every call well-formed: ``unit`` always obeys
its enum."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import ollama
import openai
import pytest

from llamarunner import Server

pytestmark = pytest.mark.real_model

NAME = "gemma-3-270m-q4_k_m"
PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": PARAMS,
    },
}
# Gemma 3 270M is a base model: one example exchange (a call, its result, the answer) makes
# it answer in kind.
EXAMPLE: list[dict[str, Any]] = [
    {"role": "user", "content": "What is the weather in Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_rome",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Rome", "unit": "celsius"}',
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_rome", "content": "25 degrees celsius, sunny"},
    {"role": "assistant", "content": "It is 25 degrees celsius and sunny in Rome."},
]
ASK = {"role": "user", "content": "What is the weather in Paris?"}


@pytest.fixture(scope="module")
def gemma(default_model: Path) -> Iterator[Server]:
    # No drafts: greedy decisions are compared, and drafting changes batch shapes with load.
    with Server(
        str(default_model), port=0, parallel=1, ctx_size=2048, threads=2, draft_max=0
    ) as srv:
        yield srv


def test_openai_required_call_then_the_answer(gemma: Server) -> None:
    with openai.OpenAI(base_url=f"{gemma.url}/v1", api_key="unused", max_retries=0) as client:
        messages: list[Any] = [ASK]
        r = client.chat.completions.create(
            model=NAME,
            messages=messages,
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice="required",
            temperature=0,
            max_tokens=128,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls and len(choice.message.tool_calls) >= 1
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, PARAMS)
        assert args["unit"] in ("celsius", "fahrenheit")
        # The result goes back; the next turn answers in text.
        messages += [
            choice.message,
            {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius, cloudy"},
        ]
        r = client.chat.completions.create(
            model=NAME,
            messages=messages,
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice="none",
            temperature=0,
            max_tokens=48,
        )
        assert r.choices[0].message.content
        assert r.choices[0].message.tool_calls is None
        assert r.choices[0].finish_reason in ("stop", "length")


def test_openai_auto_mode_calls_in_kind_and_the_call_is_valid(gemma: Server) -> None:
    """With an example exchange the base model starts a call by itself; the lazy grammar
    takes over from `{"name"` and the call validates."""
    with openai.OpenAI(base_url=f"{gemma.url}/v1", api_key="unused", max_retries=0) as client:
        r = client.chat.completions.create(
            model=NAME,
            messages=[*EXAMPLE, ASK],  # type: ignore[list-item]
            tools=[WEATHER],  # type: ignore[list-item]
            temperature=0,
            max_tokens=128,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.tool_calls
        args = json.loads(choice.message.tool_calls[0].function.arguments)
        jsonschema.validate(args, PARAMS)
        assert args["city"] == "Paris"


def test_ollama_client_calls_and_gets_the_answer(gemma: Server) -> None:
    client = ollama.Client(host=gemma.url)
    example: list[dict[str, Any]] = [
        EXAMPLE[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "function": {
                        "name": "get_weather",
                        "arguments": {"city": "Rome", "unit": "celsius"},
                    }
                }
            ],
        },
        {"role": "tool", "tool_name": "get_weather", "content": "25 degrees celsius, sunny"},
        EXAMPLE[3],
    ]
    messages: list[Any] = [*example, ASK]
    r = client.chat(
        model=NAME,
        messages=messages,
        tools=[WEATHER],
        options={"temperature": 0, "num_predict": 128},
    )
    assert r.message.tool_calls, r.message
    call = r.message.tool_calls[0]
    assert call.function.name == "get_weather"
    args = dict(call.function.arguments)
    jsonschema.validate(args, PARAMS)
    # Streamed: the call arrives as a line of its own, the same call.
    calls = []
    for part in client.chat(
        model=NAME,
        messages=messages,
        tools=[WEATHER],
        options={"temperature": 0, "num_predict": 128},
        stream=True,
    ):
        calls.extend(part.message.tool_calls or [])
    # The second request reuses the first one's cached prefix, so its last prompt positions
    # are decoded in batches of other shapes; where two argument values are nearly tied that
    # can tip the greedy choice (helpers.NEAR_TIE). The end of the turn after a call is one such
    # near tie on this base model: in CI the streamed answer once went on to call again (five
    # calls, cut by num_predict) where the whole one stopped after one. So: every streamed call
    # is the same function with valid arguments, and the first is for the same city.
    assert calls, "the streamed answer made no call"
    assert all(c.function.name == "get_weather" for c in calls), calls
    for c in calls:
        jsonschema.validate(dict(c.function.arguments), PARAMS)
    streamed = dict(calls[0].function.arguments)
    assert streamed.get("city") == args.get("city"), (streamed, args)
    # The result goes back; the next turn answers.
    messages += [r.message, {"role": "tool", "tool_name": "get_weather", "content": "18 degrees"}]
    r = client.chat(model=NAME, messages=messages, options={"temperature": 0, "num_predict": 48})
    assert r.message.content


def test_anthropic_tool_use_then_the_answer(gemma: Server) -> None:
    """The agent loop in Anthropic's shape: a forced tool_use, its tool_result sent back, a
    text answer; the auto mode with an example exchange calls for Paris."""
    tool: Any = {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "input_schema": PARAMS,
    }
    example: Any = [
        {"role": "user", "content": "What is the weather in Rome?"},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_rome",
                    "name": "get_weather",
                    "input": {"city": "Rome", "unit": "celsius"},
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_rome",
                    "content": "25 degrees celsius, sunny",
                }
            ],
        },
        {"role": "assistant", "content": "It is 25 degrees celsius and sunny in Rome."},
    ]
    greedy = {"temperature": 0}
    with anthropic.Anthropic(base_url=gemma.url, api_key="unused", max_retries=0) as client:
        messages: Any = [ASK]
        m = client.messages.create(
            model=NAME,
            messages=messages,
            tools=[tool],
            tool_choice={"type": "any"},
            max_tokens=128,
            extra_body=greedy,
        )
        assert m.stop_reason == "tool_use"
        use = next(b for b in m.content if b.type == "tool_use")
        assert use.name == "get_weather"
        jsonschema.validate(use.input, PARAMS)
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in m.content]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": use.id,
                        "content": "18 degrees celsius, cloudy",
                    }
                ],
            },
        ]
        m = client.messages.create(
            model=NAME,
            messages=messages,
            tools=[tool],
            tool_choice={"type": "none"},
            max_tokens=48,
            extra_body=greedy,
        )
        assert m.stop_reason in ("end_turn", "max_tokens")
        assert [b.type for b in m.content] == ["text"]
        m = client.messages.create(
            model=NAME,
            messages=[*example, ASK],
            tools=[tool],
            max_tokens=128,
            extra_body=greedy,
        )
        assert m.stop_reason == "tool_use", m.content
        use = next(b for b in m.content if b.type == "tool_use")
        assert use.input["city"] == "Paris"  # type: ignore[index]
