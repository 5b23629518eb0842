"""OpenAI's Responses API (/v1/responses) driven by the official ``openai`` SDK, on tiny
models: text, statuses, the event stream, previous_response_id and the store, function tools
and their outputs, text.format, reasoning, errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from llamarunner import Server

from helpers import TINY_WEATHER_PARAMS as WEATHER_SCHEMA
from tinymodel import write_chain_model, write_cycle_model, write_tiny_model

TEMPLATES = Path(__file__).parent / "templates"
MODEL = "tiny"
GREEDY = {"temperature": 0}
# The tiny model is random: ignore_eos makes token counts exact.
EXACT = {"ignore_eos": True}
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": WEATHER_SCHEMA,
}
FORCED: Any = {"type": "function", "name": "get_weather"}


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = write_tiny_model(tmp_path_factory.mktemp("responses") / "tiny-model.gguf")
    with Server(str(model), port=0, parallel=2, ctx_size=4096, threads=2, alias=MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with sdk(server.url) as c:
        yield c


def test_a_response_and_its_statuses(client: openai.OpenAI, tmp_path: Path) -> None:
    r = client.responses.create(
        model=MODEL, input="hello there", max_output_tokens=8, temperature=0, extra_body=EXACT
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"]
    assert r.output_text
    assert r.usage is not None and r.usage.output_tokens == 8
    assert r.usage.total_tokens == r.usage.input_tokens + 8
    assert r.max_output_tokens == 8 and r.temperature == 0
    chain = write_chain_model(tmp_path / "chain.gguf", "Hi, Bob!")
    with (
        Server(str(chain), port=0, ctx_size=512, threads=2, alias="chain") as srv,
        sdk(srv.url) as c,
    ):
        done = c.responses.create(model="chain", input="hello", temperature=0)
        assert done.status == "completed" and done.incomplete_details is None
        assert done.output_text == "Hi, Bob!"


def test_the_stream_is_the_response_events_and_equals_the_whole_answer(
    server: Server, client: openai.OpenAI
) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "input": [{"role": "user", "content": "hello there"}],
        "instructions": "Be terse.",
        "max_output_tokens": 10,
        "temperature": 0,
    }
    whole = client.responses.create(**body, extra_body=EXACT)
    with client.responses.stream(**body, extra_body=EXACT) as s:
        deltas = "".join(e.delta for e in s if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    with httpx.stream(
        "POST",
        f"{server.url}/v1/responses",
        json={**body, **EXACT, "stream": True},
        timeout=60,
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    names = [line[len("event: ") :] for line in raw.splitlines() if line.startswith("event: ")]
    datas = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    assert [d["type"] for d in datas] == names
    assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert {d["response"]["id"] for d in datas if "response" in d} == {datas[0]["response"]["id"]}
    last = datas[-1]["response"]
    assert last["output"][0]["content"][0]["text"] == whole.output_text
    assert last["usage"]["output_tokens"] == 10


def test_the_sdk_stream_helper_completes_a_finished_response(tmp_path: Path) -> None:
    chain = write_chain_model(tmp_path / "chain.gguf", "Hi, Bob!")
    with (
        Server(str(chain), port=0, ctx_size=512, threads=2, alias="chain") as srv,
        sdk(srv.url) as c,
    ):
        with c.responses.stream(model="chain", input="hello", temperature=0) as s:
            text = "".join(e.delta for e in s if e.type == "response.output_text.delta")
            final = s.get_final_response()
        assert text == "Hi, Bob!" == final.output_text
        assert final.status == "completed"


def test_previous_response_id_continues_the_conversation_and_store_false_keeps_nothing(
    client: openai.OpenAI,
) -> None:
    first = client.responses.create(
        model=MODEL, input="hello there", max_output_tokens=6, temperature=0, extra_body=EXACT
    )
    assert first.usage is not None
    follow = client.responses.create(
        model=MODEL,
        input="and again",
        previous_response_id=first.id,
        max_output_tokens=4,
        temperature=0,
        extra_body=EXACT,
    )
    assert follow.previous_response_id == first.id
    assert follow.usage is not None
    # The follow-up's prompt holds the first turn, its answer and the new input.
    assert follow.usage.input_tokens > first.usage.input_tokens + 6
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    unkept = client.responses.create(
        model=MODEL, input="hello", max_output_tokens=2, store=False, extra_body=EXACT
    )
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_a_forced_function_call_and_its_output(client: openai.OpenAI) -> None:
    ask: Any = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.responses.create(
        model=MODEL,
        input=ask,
        tools=[WEATHER],
        tool_choice=FORCED,
        parallel_tool_calls=False,
        max_output_tokens=400,
        temperature=0,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_SCHEMA)
    with client.responses.stream(
        model=MODEL,
        input=ask,
        tools=[WEATHER],
        tool_choice=FORCED,
        parallel_tool_calls=False,
        max_output_tokens=400,
        temperature=0,
    ) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    streamed = [o for o in final.output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    # The result goes back as a function_call_output continuing the response.
    answer = client.responses.create(
        model=MODEL,
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "21C"}],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=4,
        extra_body=EXACT,
    )
    assert [o.type for o in answer.output] == ["message"]
    # The same turn sent whole, without the store.
    whole: Any = [
        *ask,
        {
            "type": "function_call",
            "call_id": calls[0].call_id,
            "name": "get_weather",
            "arguments": calls[0].arguments,
        },
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21C"},
    ]
    again = client.responses.create(
        model=MODEL,
        input=whole,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=4,
        store=False,
        extra_body=EXACT,
    )
    assert answer.usage is not None and again.usage is not None
    assert again.usage.input_tokens == answer.usage.input_tokens


def test_text_format_json_schema_constrains_the_answer(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model=MODEL,
        input="hello",
        max_output_tokens=60,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "thing", "schema": schema}},
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_reasoning_is_a_reasoning_item(tmp_path: Path) -> None:
    thinker = write_cycle_model(tmp_path / "thinker.gguf", "OK</think>")
    with (
        Server(
            str(thinker),
            port=0,
            ctx_size=512,
            threads=2,
            alias="thinker",
            chat_template=str(TEMPLATES / "qwen3.jinja"),
        ) as srv,
        sdk(srv.url) as c,
    ):
        # "OK</think>OK</think>" cut at 12 bytes: thinking "OK", then the answer "OK".
        r = c.responses.create(model="thinker", input="hi", max_output_tokens=12, temperature=0)
        assert [o.type for o in r.output] == ["reasoning", "message"]
        assert r.output[0].content[0].text == "OK"  # type: ignore[union-attr,index]
        assert r.output_text == "OK"
        with c.responses.stream(
            model="thinker", input="hi", max_output_tokens=12, temperature=0
        ) as s:
            kinds = [e.type for e in s]
        assert "response.reasoning_text.delta" in kinds
        off = c.responses.create(
            model="thinker",
            input="hi",
            max_output_tokens=12,
            temperature=0,
            reasoning={"effort": "none"},
        )
        assert [o.type for o in off.output] == ["message"]


def test_errors_are_openais(server: Server, client: openai.OpenAI) -> None:
    # Any model name is the served model (as on llama-server), and the answer names it.
    assert client.responses.create(model="gpt-5", input="x", max_output_tokens=2).model == MODEL
    for kwargs, names in [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input_file",
        ),
        ({"background": True}, "background"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
        # Echoed and kept with the response: bounded as OpenAI bounds it.
        ({"metadata": {"k": [0] * 100_000}}, "metadata"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"metadata": "tag"}, "metadata"),
    ]:
        body = {"model": MODEL, "input": "x", **kwargs}
        r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
        assert r.status_code == 400, (kwargs, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and names in err["message"], err
    assert httpx.post(f"{server.url}/v1/responses", json={"model": MODEL}).status_code == 400
    gone = httpx.get(f"{server.url}/v1/responses/resp_nope", timeout=10)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"


def test_an_answer_names_the_response_it_stored(server: Server) -> None:
    # A router of many servers (Ray's ingress) learns there which one holds the response.
    body: dict[str, Any] = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **EXACT}
    whole = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert whole.status_code == 200
    assert whole.headers["x-llamarunner-response-id"] == whole.json()["id"]
    with httpx.stream(
        "POST", f"{server.url}/v1/responses", json={**body, "stream": True}, timeout=60
    ) as streamed:
        named = streamed.headers["x-llamarunner-response-id"]
        text = "".join(streamed.iter_text())
    assert f'"id":"{named}"' in text.replace(" ", "")
    unkept = httpx.post(f"{server.url}/v1/responses", json={**body, "store": False}, timeout=60)
    assert unkept.status_code == 200 and "x-llamarunner-response-id" not in unkept.headers
