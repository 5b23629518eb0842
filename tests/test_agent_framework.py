"""A real agent framework's tool loop end to end on the default model (Gemma 3 270M): the
OpenAI Agents SDK (``openai-agents``) runs an agent with a function tool against llamarunner,
through its Chat Completions model (``/v1/chat/completions``) and its Responses model
(``/v1/responses``), whole and streamed. The first turn forces a call (``tool_choice:
"required"``: the server's grammar makes the base model's call well-formed); the SDK then runs
the tool, sends its result back and resets the tool choice to ``auto``, and the model answers
from the result. Tracing is off and every request goes to the local server through an explicit
client: nothing is sent to OpenAI."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llamarunner import Server

if sys.version_info < (3, 10):
    pytest.skip("openai-agents needs Python 3.10 or later", allow_module_level=True)

from agents import (
    Agent,
    FunctionTool,
    MessageOutputItem,
    Model,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    StopAtTools,
    ToolCallItem,
    ToolCallOutputItem,
    TResponseInputItem,
    function_tool,
    set_tracing_disabled,
)
from agents.result import RunResultBase
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

pytestmark = pytest.mark.real_model

set_tracing_disabled(True)

NAME = "gemma-3-270m-q4_k_m"
# What the tool answers: not the example's weather, so an answer that states it read the result.
TEMPERATURE = "17 degrees celsius"
WEATHER = f"{TEMPERATURE}, foggy"
ASK: TResponseInputItem = {"role": "user", "content": "What is the weather in Paris?"}
# Gemma 3 270M is a base model: an example exchange earlier in the conversation (a call, its
# result, the answer) makes it answer in kind. The items are the SDK's input (the Responses
# API's shape); its Chat Completions model turns them into chat messages.
EXAMPLE_CALL: list[TResponseInputItem] = [
    {"role": "user", "content": "What is the weather in Rome?"},
    {
        "type": "function_call",
        "call_id": "call_rome",
        "name": "get_weather",
        "arguments": '{"city": "Rome"}',
    },
    {"type": "function_call_output", "call_id": "call_rome", "output": "25 degrees celsius, sunny"},
]
ROME_ANSWER = "It is 25 degrees celsius and sunny in Rome."
EXAMPLE_TEXT_ANSWER: list[TResponseInputItem] = [
    *EXAMPLE_CALL,
    {"role": "assistant", "content": ROME_ANSWER},
]
EXAMPLE_FINAL_ANSWER_TOOL: list[TResponseInputItem] = [
    *EXAMPLE_CALL,
    {
        "type": "function_call",
        "call_id": "call_rome_answer",
        "name": "final_answer",
        "arguments": json.dumps({"answer": ROME_ANSWER}),
    },
    {"type": "function_call_output", "call_id": "call_rome_answer", "output": ROME_ANSWER},
]
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}


@pytest.fixture(scope="module")
def gemma(default_model: Path) -> Iterator[Server]:
    # No drafts: greedy decisions are compared, and drafting changes batch shapes with load.
    with Server(
        str(default_model), port=0, parallel=1, ctx_size=2048, threads=2, draft_max=0
    ) as srv:
        yield srv


def make_tools(calls: list[tuple[str, str]]) -> tuple[FunctionTool, FunctionTool]:
    """get_weather and final_answer, each recording its calls (name, argument) in ``calls``."""

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: The city's name.
        """
        calls.append(("get_weather", city))
        return WEATHER

    @function_tool
    def final_answer(answer: str) -> str:
        """Give the user the final answer.

        Args:
            answer: The answer.
        """
        calls.append(("final_answer", answer))
        return answer

    return get_weather, final_answer


def make_model(api: str, client: AsyncOpenAI) -> Model:
    if api == "chat":
        return OpenAIChatCompletionsModel(model=NAME, openai_client=client)
    return OpenAIResponsesModel(model=NAME, openai_client=client)


class Wire:
    """The requests the SDK sent (path, JSON body) and the status of each answer: event hooks
    of the openai client's HTTP client (httpx's or httpx2's, whichever that openai is built on,
    hence ``Any``)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.statuses: list[int] = []

    async def on_request(self, request: Any) -> None:
        self.requests.append((request.url.path, json.loads(request.content)))

    async def on_response(self, response: Any) -> None:
        self.statuses.append(response.status_code)


async def run_agent(
    url: str, api: str, agent: Agent[Any], inputs: list[TResponseInputItem], stream: bool
) -> tuple[RunResultBase, Wire]:
    """Runs ``agent`` (its model is set here) to its end on the server at ``url``."""
    wire = Wire()
    hooks: dict[str, Any] = {"request": [wire.on_request], "response": [wire.on_response]}
    async with DefaultAsyncHttpxClient(event_hooks=hooks, timeout=120) as http:
        client = AsyncOpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0, http_client=http
        )
        agent = agent.clone(model=make_model(api, client))
        if not stream:
            return await Runner.run(agent, inputs, max_turns=4), wire
        streamed = Runner.run_streamed(agent, inputs, max_turns=4)
        async for _ in streamed.stream_events():
            pass
        return streamed, wire


def tool_results_sent(api: str, body: dict[str, Any]) -> list[str]:
    """The tool results a request carries (the chat API's tool messages, the Responses API's
    function_call_output items)."""
    if api == "chat":
        return [m["content"] for m in body["messages"] if m.get("role") == "tool"]
    return [i["output"] for i in body["input"] if i.get("type") == "function_call_output"]


def check_the_exchange(api: str, result: RunResultBase, wire: Wire) -> None:
    """Two requests to the API's endpoint, both answered 200: the first forces a call (one, not
    parallel), the second (the SDK reset the tool choice) carries the tool's result after the
    example's; the SDK's usage counts both."""
    assert [path for path, _ in wire.requests] == [PATHS[api]] * 2, wire.requests
    assert wire.statuses == [200, 200], wire.statuses
    first, second = (body for _, body in wire.requests)
    assert first["tool_choice"] == "required", first
    assert first["parallel_tool_calls"] is False, first
    assert second.get("tool_choice", "auto") == "auto", second
    assert tool_results_sent(api, second)[-1] == WEATHER, second
    usage = result.context_wrapper.usage
    assert usage.requests == 2, usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0, usage


def forced_settings(max_tokens: int) -> ModelSettings:
    """Greedy, the first call forced, one call at a time: with parallel calls allowed (up to 16)
    the base model repeats the forced call until max_tokens."""
    return ModelSettings(
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=max_tokens,
        # Streamed, the SDK asks a server other than OpenAI's for usage only when told.
        include_usage=True,
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_agent_answers_in_text_after_the_tool_call(gemma: Server, stream: bool) -> None:
    """Chat Completions: the forced call runs the tool, and the model's text answer (the run's
    final output) states the tool's result.

    The base model does not end its turn after the answer (``<end_of_turn>`` is never among its
    likely tokens there): the text runs on to max_tokens (``finish_reason: "length"``), which
    the SDK's Chat Completions model takes as the final output. Through the Responses API the
    same cut answer is ``status: "incomplete"``, which the SDK raises for (ModelBehaviorError),
    rightly on both sides; so there the loop ends with a final-answer tool (the next test)."""
    calls: list[tuple[str, str]] = []
    get_weather, _ = make_tools(calls)
    agent: Agent[Any] = Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        tools=[get_weather],
        model_settings=forced_settings(max_tokens=48),
    )
    result, wire = asyncio.run(
        run_agent(gemma.url, "chat", agent, [*EXAMPLE_TEXT_ANSWER, ASK], stream)
    )
    assert calls == [("get_weather", "Paris")], calls
    items = result.new_items
    assert [type(i) for i in items] == [ToolCallItem, ToolCallOutputItem, MessageOutputItem], items
    call, output = items[0], items[1]
    assert isinstance(call, ToolCallItem) and isinstance(output, ToolCallOutputItem)
    assert getattr(call.raw_item, "name", None) == "get_weather", call.raw_item
    assert json.loads(getattr(call.raw_item, "arguments", "")) == {"city": "Paris"}
    assert output.output == WEATHER
    assert isinstance(result.final_output, str)
    assert TEMPERATURE in result.final_output, result.final_output
    check_the_exchange("chat", result, wire)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_agent_loop_ends_with_a_final_answer_tool(gemma: Server, api: str, stream: bool) -> None:
    """The loop ends with the model's answer given as a final_answer tool call (the agent
    stops at it): the forced first call gets the weather; in the second turn (tool choice
    ``auto``) the model calls final_answer by itself, in kind with the example, and the lazy
    grammar closes the call, so the turn ends, where a text answer of this base model runs on
    (see the test above)."""
    calls: list[tuple[str, str]] = []
    agent: Agent[Any] = Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        tools=list(make_tools(calls)),
        tool_use_behavior=StopAtTools(stop_at_tool_names=["final_answer"]),
        model_settings=forced_settings(max_tokens=64),
    )
    result, wire = asyncio.run(
        run_agent(gemma.url, api, agent, [*EXAMPLE_FINAL_ANSWER_TOOL, ASK], stream)
    )
    assert [name for name, _ in calls] == ["get_weather", "final_answer"], calls
    assert calls[0][1] == "Paris", calls
    answer = calls[1][1]
    assert TEMPERATURE in answer, answer
    assert result.final_output == answer
    items = result.new_items
    kinds = [ToolCallItem, ToolCallOutputItem, ToolCallItem, ToolCallOutputItem]
    assert [type(i) for i in items] == kinds, items
    assert [getattr(i.raw_item, "name", None) for i in items[::2]] == [
        "get_weather",
        "final_answer",
    ]
    outputs = [i.output for i in items if isinstance(i, ToolCallOutputItem)]
    assert outputs == [WEATHER, answer], outputs
    check_the_exchange(api, result, wire)
