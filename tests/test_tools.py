"""Tool calling and reasoning output, per template family, on the tiny model.

Each family (generic: the tiny model's built-in ChatML template; hermes, llama3 and mistral:
the templates under tests/templates/, with the structure of Qwen 2.5's, Llama 3.1's and
Mistral v3's) gets: the exact prompt of a multi-turn conversation with tools, calls and
results; a required call that parses and validates against its schema; a named call; free text
in auto mode; the streamed deltas of a call, which reassemble into the same call. Reasoning:
a model that writes ``OK</think>`` over and over behind a thinking template.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from llamarunner import AsyncClient, Completion, Server
from llamarunner import Client as LlamaClient

from helpers import TINY_WEATHER_PARAMS as WEATHER_PARAMS
from tinymodel import write_cycle_model, write_tiny_model

TEMPLATES = Path(__file__).parent / "templates"
FAMILIES = ["generic", "hermes", "llama3", "mistral"]
TEMPLATE_OF = {
    "generic": None,
    "hermes": "hermes.jinja",
    "llama3": "llama31.jinja",
    "mistral": "mistral.jinja",
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": WEATHER_PARAMS,
    },
}
ADD_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
ADD = {"type": "function", "function": {"name": "add", "parameters": ADD_PARAMS}}
SCHEMAS = {"get_weather": WEATHER_PARAMS, "add": ADD_PARAMS}

HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Paris", "unit": "celsius"}',
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
]
ASK = [{"role": "user", "content": "weather in Paris"}]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tools") / "tiny-model.gguf")


@pytest.fixture(scope="module")
def servers(tiny_path: Path) -> Iterator[dict[str, Server]]:
    """One server per family (the same tiny model, the family's template)."""
    started: dict[str, Server] = {}
    try:
        for family, template in TEMPLATE_OF.items():
            settings: dict[str, Any] = {"port": 0, "ctx_size": 2048, "threads": 2}
            settings["alias"] = "tiny"
            if template is not None:
                settings["chat_template"] = str(TEMPLATES / template)
            srv = Server(str(tiny_path), **settings)
            srv.start()
            srv.wait_ready(timeout=120)
            started[family] = srv
        yield started
    finally:
        for srv in started.values():
            srv.stop()


def client_of(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


def tool_json(tool: dict[str, Any]) -> str:
    """A tool as the templates' ``tojson`` writes it (keys in the order given, as
    transformers' and llama.cpp's ``tojson`` keep them; Python's separators)."""
    f = tool["function"]
    as_template_sees = {
        "type": "function",
        "function": {
            "name": f["name"],
            "description": f.get("description", ""),
            "parameters": f["parameters"],
        },
    }
    return json.dumps(as_template_sees)


def expected_prompt(family: str) -> str:
    """The prompt of HISTORY with WEATHER offered, as each family's template writes it."""
    tool = tool_json(WEATHER)
    if family == "generic":
        # The built-in ChatML template knows no tools: they are introduced in the system
        # prompt, the call is written in the generic format, the result is a user turn.
        params = json.dumps(WEATHER_PARAMS, separators=(",", ":"))
        instructions = (
            "You can call these functions:\n"
            '{"name": "get_weather", "description": "Current weather in a city", '
            f'"parameters": {params}}}\n\n'
            "To call a function, answer with only this, and nothing else:\n"
            '{"name": "function_name", "arguments": {"argument":"value"}}\n'
            "The arguments must follow the function's parameters schema. If no function "
            "fits, answer the user normally."
        )
        return (
            f"<|im_start|>system\nBe brief.\n\n{instructions}<|im_end|>\n"
            "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
            '<|im_start|>assistant\n{"name": "get_weather", "arguments": '
            '{"city":"Paris","unit":"celsius"}}<|im_end|>\n'
            "<|im_start|>user\nResult of get_weather: 21 degrees<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
    if family == "hermes":
        return (
            "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions "
            "to assist with the user query.\n\nYou are provided with function signatures "
            f"within <tools></tools> XML tags:\n<tools>\n{tool}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call><|im_end|>\n"
            "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
            '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "celsius"}}\n</tool_call><|im_end|>\n'
            "<|im_start|>user\n<tool_response>\n21 degrees\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )
    if family == "llama3":
        return (
            "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
            "Be brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\n"
            "Given the following functions, please respond with a JSON for a function call "
            "with its proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of '
            "argument name and its value}.Do not use variables.\n\n"
            f"{tool}\n\nWeather in Paris?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
            '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
            "<|eot_id|>"
            "<|start_header_id|>ipython<|end_header_id|>\n\n21 degrees<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
    assert family == "mistral"
    return (
        f"[AVAILABLE_TOOLS] [{tool}][/AVAILABLE_TOOLS][INST] Weather in Paris?[/INST]"
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}, "id": "call_1"}]</s>'
        '[TOOL_RESULTS] {"content": "21 degrees", "call_id": "call_1"}[/TOOL_RESULTS]'
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_a_conversation_with_tools_renders_as_the_family_expects(
    servers: dict[str, Server], family: str
) -> None:
    r = httpx.post(
        f"{servers[family].url}/apply-template",
        json={"messages": HISTORY, "tools": [WEATHER]},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == expected_prompt(family)


def check_call(call: Any, name: str | None = None) -> dict[str, Any]:
    """A call from the openai client: an id, a known function, arguments (a JSON string)
    that validate against that function's schema."""
    assert call.type == "function"
    assert call.id.startswith("call_") and len(call.id) > 10
    assert call.function.name in SCHEMAS
    if name is not None:
        assert call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return {"name": call.function.name, "arguments": args}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_required_call_parses_and_validates(servers: dict[str, Server], family: str) -> None:
    with client_of(servers[family]) as client:
        for seed in range(3):
            r = client.chat.completions.create(
                model="tiny",
                messages=ASK,  # type: ignore[arg-type]
                tools=[WEATHER, ADD],  # type: ignore[list-item]
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=400,
                seed=seed,
            )
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
            check_call(choice.message.tool_calls[0])


# What Pydantic's model_json_schema() writes for a nested model: $defs and local $refs, one
# of them recursive.
SHIP_PARAMS = {
    "type": "object",
    "$defs": {
        "Address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "Parcel": {
            "type": "object",
            "properties": {
                "kg": {"type": "integer", "minimum": 0, "maximum": 99},
                "inner": {"anyOf": [{"$ref": "#/$defs/Parcel"}, {"type": "null"}]},
            },
            "required": ["kg", "inner"],
            "additionalProperties": False,
        },
    },
    "properties": {"to": {"$ref": "#/$defs/Address"}, "parcel": {"$ref": "#/$defs/Parcel"}},
    "required": ["to", "parcel"],
    "additionalProperties": False,
}
SHIP = {"type": "function", "function": {"name": "ship", "parameters": SHIP_PARAMS}}


@pytest.mark.parametrize("family", FAMILIES)
def test_tools_whose_schemas_refer_to_their_own_defs_are_called(
    servers: dict[str, Server], family: str
) -> None:
    # The tool's schema sits inside the call's grammar, where "#" is the call: its local
    # references are rebased, with another tool beside it.
    srv = servers[family]
    with client_of(srv) as client:
        for seed in range(2):
            r = client.chat.completions.create(
                model="tiny",
                messages=ASK,  # type: ignore[arg-type]
                tools=[WEATHER, SHIP],  # type: ignore[list-item]
                tool_choice={"type": "function", "function": {"name": "ship"}},
                parallel_tool_calls=False,
                max_tokens=600,
                seed=seed,
            )
            choice = r.choices[0]
            if choice.finish_reason == "length":
                continue  # a random model may nest parcels past the limit
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.tool_calls is not None
            call = choice.message.tool_calls[0]
            assert call.function.name == "ship"  # type: ignore[union-attr]
            jsonschema.validate(json.loads(call.function.arguments), SHIP_PARAMS)  # type: ignore[union-attr]
    ask = [{"role": "user", "content": "ship it"}]
    messages = httpx.post(
        f"{srv.url}/v1/messages",
        json={
            "model": "tiny",
            "max_tokens": 600,
            "messages": ask,
            "tool_choice": {"type": "tool", "name": "ship"},
            "tools": [{"name": "ship", "input_schema": SHIP_PARAMS}],
        },
        timeout=120,
    )
    assert messages.status_code == 200, messages.text
    responses = httpx.post(
        f"{srv.url}/v1/responses",
        json={
            "model": "tiny",
            "input": "ship it",
            "max_output_tokens": 600,
            "tool_choice": "required",
            "tools": [{"type": "function", "name": "ship", "parameters": SHIP_PARAMS}],
        },
        timeout=120,
    )
    assert responses.status_code == 200, responses.text


@pytest.mark.parametrize("family", FAMILIES)
def test_a_named_function_is_the_one_called(servers: dict[str, Server], family: str) -> None:
    with client_of(servers[family]) as client:
        r = client.chat.completions.create(
            model="tiny",
            messages=ASK,  # type: ignore[arg-type]
            tools=[WEATHER, ADD],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "add"}},
            max_tokens=600,
            temperature=0,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call, "add")


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_mode_with_free_text_returns_text(servers: dict[str, Server], family: str) -> None:
    with client_of(servers[family]) as client:
        r = client.chat.completions.create(
            model="tiny",
            messages=ASK,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        choice = r.choices[0]
        assert choice.finish_reason == "length"
        assert choice.message.tool_calls is None
        assert choice.message.content
        # The same text as without tools offered but with their prompt: "auto" leaves free
        # text free (the lazy grammar never triggered).
        assert r.usage is not None and r.usage.completion_tokens == 12
        none = client.chat.completions.create(
            model="tiny",
            messages=ASK,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice="none",
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert none.choices[0].message.tool_calls is None
        assert none.choices[0].message.content


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_call_deltas_reassemble_into_the_same_call(
    servers: dict[str, Server], family: str
) -> None:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": ASK,
        "tools": [WEATHER, ADD],
        "tool_choice": "required",
        "max_tokens": 800,
        "temperature": 0,
    }
    with client_of(servers[family]) as client:
        whole = client.chat.completions.create(**body)
        assert whole.choices[0].finish_reason == "tool_calls"
        assert whole.choices[0].message.tool_calls
        expected = [check_call(c) for c in whole.choices[0].message.tool_calls]
        calls: dict[int, dict[str, str]] = {}
        ids: dict[int, str] = {}
        finish = None
        for chunk in client.chat.completions.create(**body, stream=True):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            for tc in delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                if tc.id:
                    ids[tc.index] = tc.id
                if tc.function and tc.function.name:
                    slot["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        got = [
            {"name": calls[i]["name"], "arguments": json.loads(calls[i]["arguments"])}
            for i in sorted(calls)
        ]
        assert got == expected
        assert all(ids[i].startswith("call_") for i in calls)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            'the function "x", which is not among',
        ),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [{"type": "function"}]}, "tools[0].function is required"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "function.name must"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"x": {"type": "banana"}},
                            },
                        },
                    }
                ]
            },
            'parameters schema of "f" is invalid: parameters.properties.x.type',
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters must be a JSON schema object",
        ),
        ({"tools": [WEATHER, WEATHER]}, "offered twice"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "cannot be combined"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": {"a": 1}}, "tools"),
    ],
)
def test_bad_tools_are_400s_naming_the_problem(
    servers: dict[str, Server], body: dict[str, Any], message: str
) -> None:
    srv = servers["hermes"]
    r = httpx.post(
        f"{srv.url}/v1/chat/completions",
        json={"model": "tiny", "messages": ASK, "max_tokens": 4, **body},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"], r.text
    # The same through Ollama's endpoint (tools only; Ollama has no tool_choice).
    if "tool_choice" not in body and "response_format" not in body and "parallel" not in str(body):
        r = httpx.post(
            f"{srv.url}/api/chat",
            json={"model": "tiny", "messages": ASK, "stream": False, **body},
            timeout=30,
        )
        assert r.status_code == 400, r.text
        assert message in r.json()["error"], r.text


def test_ollama_chat_with_tools_and_tool_results(servers: dict[str, Server]) -> None:
    """Ollama's shapes: assistant calls with object arguments, `tool` results by tool_name;
    the answer in auto mode is text."""
    srv = servers["hermes"]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "function": {
                        "name": "get_weather",
                        "arguments": {"city": "Paris", "unit": "celsius"},
                    }
                }
            ],
        },
        {"role": "tool", "tool_name": "get_weather", "content": "21 degrees"},
    ]
    body = {
        "model": "tiny",
        "messages": messages,
        "tools": [WEATHER],
        "stream": False,
        "options": {"num_predict": 8, "temperature": 0},
    }
    r = httpx.post(f"{srv.url}/api/chat", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["done"] is True
    assert isinstance(out["message"]["content"], str)
    lines = []
    with httpx.stream(
        "POST", f"{srv.url}/api/chat", json={**body, "stream": True}, timeout=60
    ) as s:
        for line in s.iter_bytes():
            lines.append(line)
    parsed = [json.loads(x) for x in b"".join(lines).split(b"\n") if x.strip()]
    assert parsed[-1]["done"] is True
    streamed = "".join(p["message"]["content"] for p in parsed)
    assert streamed == out["message"]["content"]
    # The prompt had the call and the result in the template's own shape.
    prompt = httpx.post(
        f"{srv.url}/apply-template", json={"messages": messages, "tools": [WEATHER]}, timeout=30
    ).json()["prompt"]
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n</tool_call>" in prompt
    )
    assert "<tool_response>\n21 degrees\n</tool_response>" in prompt


# --------------------------------------------------------------------------------------------
# Reasoning


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Writes "OK</think>" over and over (a cycle model)."""
    return write_cycle_model(tmp_path_factory.mktemp("think") / "thinker.gguf", "OK</think>")


@pytest.fixture(scope="module")
def think_server(thinker: Path) -> Iterator[Server]:
    with Server(
        str(thinker),
        port=0,
        ctx_size=512,
        threads=2,
        alias="thinker",
        chat_template=str(TEMPLATES / "qwen3.jinja"),
    ) as srv:
        yield srv


OK_BODY = {"model": "thinker", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12}


def test_reasoning_is_split_out_in_openai_answers(think_server: Server) -> None:
    with client_of(think_server) as client:
        r = client.chat.completions.create(**OK_BODY, temperature=0)  # type: ignore[arg-type]
        message = r.choices[0].message
        # "OK</think>OK</think>" cut at 12 bytes: thinking "OK", then the answer "OK".
        assert message.model_extra is not None
        assert message.model_extra["reasoning_content"] == "OK"
        assert message.content == "OK"
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(
            **OK_BODY,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
        ):
            if chunk.choices:
                extra = chunk.choices[0].delta.model_extra or {}
                reasoning += extra.get("reasoning_content") or ""
                content += chunk.choices[0].delta.content or ""
        assert (reasoning, content) == ("OK", "OK")


def test_a_schema_constrains_the_answer_after_the_thinking(think_server: Server) -> None:
    # The template opens the think block: the schema applies from its end on, so the thinking
    # stays free ("OK") and the answer is the JSON, in every chat dialect. (The cycle model
    # takes all the whitespace the JSON layout allows: 200 tokens.)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
    }
    chat = httpx.post(
        f"{think_server.url}/v1/chat/completions",
        json={
            **OK_BODY,
            "max_tokens": 200,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": schema},
            },
        },
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    message = chat.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "OK", message
    assert chat.json()["choices"][0]["finish_reason"] == "stop", chat.text
    jsonschema.validate(json.loads(message["content"]), schema)
    ollama = httpx.post(
        f"{think_server.url}/api/chat",
        json={**OK_BODY, "format": schema, "stream": False, "options": {"num_predict": 200}},
        timeout=60,
    )
    assert ollama.status_code == 200, ollama.text
    assert ollama.json()["message"]["thinking"] == "OK", ollama.text
    jsonschema.validate(json.loads(ollama.json()["message"]["content"]), schema)


def test_reasoning_is_thinking_in_ollama_answers(think_server: Server) -> None:
    body = {**OK_BODY, "options": {"num_predict": 12, "temperature": 0}, "stream": False}
    r = httpx.post(f"{think_server.url}/api/chat", json=body, timeout=60).json()
    assert (r["message"]["thinking"], r["message"]["content"]) == ("OK", "OK")
    with httpx.stream("POST", f"{think_server.url}/api/chat", json={**body, "stream": True}) as s:
        lines = [json.loads(x) for x in s.read().split(b"\n") if x.strip()]
    thinking = "".join(x["message"].get("thinking", "") for x in lines)
    content = "".join(x["message"]["content"] for x in lines)
    assert (thinking, content) == ("OK", "OK")
    # think: false asks the template not to think and leaves the text as is.
    off = httpx.post(
        f"{think_server.url}/api/chat", json={**body, "think": False}, timeout=60
    ).json()
    assert "thinking" not in off["message"]
    assert off["message"]["content"] == "OK</think>OK"
    bad = httpx.post(f"{think_server.url}/api/chat", json={**body, "think": "very"}, timeout=60)
    assert bad.status_code == 400 and "think must be" in bad.json()["error"]


def test_reasoning_is_thinking_in_native_chat_answers(think_server: Server) -> None:
    # The native chat (POST /completion with messages) splits it as /api/chat does when the
    # request gives `think`: reasoning chunks carry `thinking`, the others `content`.
    body = {**OK_BODY, "think": True, "options": {"num_predict": 12, "temperature": 0}}
    with httpx.stream("POST", f"{think_server.url}/completion", json=body, timeout=60) as s:
        assert s.status_code == 200
        lines = [json.loads(x) for x in s.read().split(b"\n") if x.strip()]
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] == 12
    thinking = "".join(x.get("thinking", "") for x in lines)
    content = "".join(x["content"] for x in lines)
    assert (thinking, content) == ("OK", "OK")
    assert all(not (x.get("thinking") and x["content"]) for x in lines), lines
    with LlamaClient(think_server.url) as client:
        c = client.chat(OK_BODY["messages"], think=True, num_predict=12, temperature=0)
        assert (c.thinking, c.text) == ("OK", "OK")
        with client.chat(
            OK_BODY["messages"], stream=True, think="high", num_predict=12, temperature=0
        ) as stream:
            chunks = list(stream)
        assert "".join(ch.thinking for ch in chunks) == "OK"
        assert "".join(ch.content for ch in chunks) == "OK"
        # Without `think`, the text as generated (as before); think: false, as /api/chat.
        plain = client.chat(OK_BODY["messages"], num_predict=12, temperature=0)
        assert (plain.thinking, plain.text) == ("", "OK</think>OK")
        off = client.chat(OK_BODY["messages"], think=False, num_predict=12, temperature=0)
        assert (off.thinking, off.text) == ("", "OK</think>OK")

    async def in_async() -> Completion:
        async with AsyncClient(think_server.url) as client:
            return await client.chat(OK_BODY["messages"], think=True, num_predict=12, temperature=0)

    c = asyncio.run(in_async())
    assert (c.thinking, c.text) == ("OK", "OK")
    for bad, why in (
        ({**body, "think": "very"}, "think must be"),
        ({"prompt": "hi", "think": True}, "think: thinking is split out of a conversation"),
    ):
        r = httpx.post(f"{think_server.url}/completion", json=bad, timeout=60)
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text


def test_reasoning_format_none_leaves_the_text(thinker: Path) -> None:
    with (
        Server(
            str(thinker),
            port=0,
            ctx_size=512,
            threads=2,
            alias="thinker",
            chat_template=str(TEMPLATES / "qwen3.jinja"),
            reasoning_format="none",
        ) as srv,
        client_of(srv) as client,
    ):
        r = client.chat.completions.create(**OK_BODY, temperature=0)  # type: ignore[arg-type]
        message = r.choices[0].message
        assert message.content == "OK</think>OK"
        assert "reasoning_content" not in (message.model_extra or {})


def test_reasoning_format_is_a_setting(thinker: Path) -> None:
    from llamarunner.config import ServerConfig

    env = {"LLAMARUNNER_REASONING_FORMAT": "none"}
    assert ServerConfig.resolve(env=env).reasoning_format == "none"
    assert ServerConfig.resolve(env={}).reasoning_format == "auto"
    with pytest.raises(ValueError, match="unknown variant `deepseek`, expected `auto` or `none`"):
        Server(str(thinker), port=0, reasoning_format="deepseek").start()
