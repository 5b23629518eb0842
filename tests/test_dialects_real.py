"""The dialects on the real default model (Gemma 3 270M, which has no chat template of
its own, so the built-in Gemma one is used): the same conversation gives the same greedy text
through the native API, OpenAI's chat and Responses APIs, Ollama's and Anthropic's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest

from llamarunner import Server

from helpers import complete

pytestmark = pytest.mark.real_model

# Gemma 3 270M is a base model: one example exchange makes it answer in kind.
CONVERSATION = [
    {"role": "user", "content": "What is the capital of Italy?"},
    {"role": "assistant", "content": "The capital of Italy is Rome."},
    {"role": "user", "content": "What is the capital of France?"},
]
N = 24


@pytest.fixture(scope="module")
def gemma(default_model: Path) -> Iterator[Server]:
    # One slot: every request after the first finds the same cached prefix, so each dialect's
    # prompt is decoded in batches of the same shape (llama.cpp's CPU kernels are not
    # batch-invariant; see test_real_model.py). No drafting: how far it drafts adapts to what
    # earlier requests accepted, so the same request can be verified in batches of other
    # widths, and this model's answer has near-ties after its first sentence (a CI run: the
    # second /completion said " maddenin" where the chat completion after it said "paying").
    with Server(
        str(default_model), port=0, parallel=1, ctx_size=1024, threads=2, draft_max=0
    ) as srv:
        yield srv


def test_same_conversation_same_greedy_text_in_every_dialect(gemma: Server) -> None:
    name = httpx.get(f"{gemma.url}/v1/models", timeout=10).json()["data"][0]["id"]
    assert name == "gemma-3-270m-q4_k_m"
    prompt = httpx.post(
        f"{gemma.url}/apply-template", json={"messages": CONVERSATION}, timeout=10
    ).json()["prompt"]
    assert prompt == (
        "<start_of_turn>user\nWhat is the capital of Italy?<end_of_turn>\n"
        "<start_of_turn>model\nThe capital of Italy is Rome.<end_of_turn>\n"
        "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    greedy = {"temperature": 0, "num_predict": N, "repeat_penalty": 1.0}
    complete(gemma.url, prompt, **greedy)  # warm the slot's cache

    native, _ = complete(gemma.url, prompt, **greedy)
    with openai.OpenAI(base_url=f"{gemma.url}/v1", api_key="unused", max_retries=0) as oa:
        r = oa.chat.completions.create(
            model=name,
            messages=CONVERSATION,
            temperature=0,
            max_tokens=N,  # type: ignore[arg-type]
        )
        via_openai = r.choices[0].message.content
        streamed = oa.chat.completions.create(
            model=name,
            messages=CONVERSATION,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=N,
            stream=True,
        )
        via_openai_stream = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        via_responses = oa.responses.create(
            model=name,
            input=CONVERSATION,  # type: ignore[arg-type]
            temperature=0,
            max_output_tokens=N,
        ).output_text
    via_ollama = (
        ollama.Client(host=gemma.url)
        .chat(model=name, messages=CONVERSATION, options=greedy)
        .message.content
    )
    with anthropic.Anthropic(base_url=gemma.url, api_key="unused", max_retries=0) as an:
        m = an.messages.create(
            model=name,
            messages=CONVERSATION,  # type: ignore[arg-type]
            max_tokens=N,
            extra_body={"temperature": 0},
        )
        via_anthropic = "".join(b.text for b in m.content if b.type == "text")
        with an.messages.stream(
            model=name,
            messages=CONVERSATION,  # type: ignore[arg-type]
            max_tokens=N,
            extra_body={"temperature": 0},
        ) as s:
            via_anthropic_stream = "".join(s.text_stream)
    print(f"\ngreedy answer: {native!r}")
    assert native.startswith("The capital of France is Paris.")
    assert via_openai == native
    assert via_openai_stream == native
    assert via_ollama == native
    assert via_anthropic == native
    assert via_responses == native
    assert via_anthropic_stream == native


def test_json_schema_on_the_real_model(gemma: Server) -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
        },
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    with openai.OpenAI(base_url=f"{gemma.url}/v1", api_key="unused", max_retries=0) as oa:
        r = oa.chat.completions.create(
            model="gemma-3-270m-q4_k_m",
            messages=[{"role": "user", "content": "Name the capital of France and its country."}],
            temperature=0,
            max_tokens=80,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "place", "schema": schema},
            },
        )
    answer = json.loads(r.choices[0].message.content or "")
    jsonschema.validate(answer, schema)
    print(f"\njson answer: {answer}")
    assert "Paris" in answer["city"]
