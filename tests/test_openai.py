"""The OpenAI dialect (/v1) driven by the official ``openai`` client, on the tiny model."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from llamarunner import AsyncClient, Server

from helpers import wait_idle
from tinymodel import write_tiny_model

MODEL = "tiny"
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "hello there"},
]
# The tiny model is random: ignore_eos makes token counts exact.
EXACT = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(tiny_server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("model", MODEL)
    kwargs.setdefault("messages", CHAT)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(**kwargs)


def test_models_list_the_alias(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_completion_with_usage(client: openai.OpenAI) -> None:
    r = chat(client, max_tokens=8, extra_body=EXACT)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert r.object == "chat.completion"
    assert r.model == MODEL
    assert r.id.startswith("chatcmpl-")
    assert r.usage is not None
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_chat_stream_equals_the_whole_answer_and_reports_cached_tokens(
    client: openai.OpenAI,
) -> None:
    whole = chat(client, max_tokens=12, extra_body=EXACT)
    chunks = list(
        chat(
            client,
            max_tokens=12,
            extra_body=EXACT,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == 12
    # The same conversation again: all but the last prompt token come from the cache.
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_text_completions_stream_and_not(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="once upon", max_tokens=6, temperature=0, extra_body=EXACT
    )
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 6
    streamed = client.completions.create(
        model=MODEL, prompt="once upon", max_tokens=6, temperature=0, extra_body=EXACT, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_a_long_answer_not_streamed_is_the_streamed_one(client: openai.OpenAI) -> None:
    """The engine sends a response that is not streamed in large pieces (here a piece once 256
    log-probability entries have gathered, then the rest at the end), not a token at a time:
    the same text and entries as a stream."""
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "prompt": "once upon",
        "max_tokens": 400,
        "temperature": 0,
        "logprobs": 1,
        "extra_body": EXACT,
    }
    whole = client.completions.create(**kwargs)
    assert whole.usage is not None and whole.usage.completion_tokens == 400
    streamed = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
    tokens = [
        t
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens or []
    ]
    assert whole.choices[0].logprobs is not None
    assert tokens == whole.choices[0].logprobs.tokens
    assert len(tokens) == 400


def test_stop_ends_before_the_stop_string(client: openai.OpenAI) -> None:
    full = chat(client, max_tokens=16, extra_body=EXACT).choices[0].message.content
    stop = full[5:7]
    r = chat(client, max_tokens=16, extra_body=EXACT, stop=[stop, "never-seen"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[: full.index(stop)]


def test_seed_makes_sampling_repeatable(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        r = chat(client, max_tokens=12, temperature=1.0, seed=seed, extra_body=EXACT)
        return str(r.choices[0].message.content)

    assert sample(7) == sample(7)
    assert sample(8) != sample(7)
    assert len({sample(s) for s in range(5)}) > 1
    # Above 2**32 the seed wraps, as in Ollama (llama.cpp's samplers take 32 bits).
    assert sample(2**32 + 7) == sample(7)


N = 40


def answer(client: openai.OpenAI, **kwargs: Any) -> str:
    """The text of a 40-token chat answer (greedy unless a temperature is given)."""
    extra = {"ignore_eos": True, **kwargs.pop("extra_body", {})}
    r = chat(client, max_tokens=N, extra_body=extra, **kwargs)
    assert r.usage is not None and r.usage.completion_tokens == N
    return str(r.choices[0].message.content)


def test_penalties_change_greedy_output(client: openai.OpenAI) -> None:
    """Each penalty, alone, changes what a greedy answer repeats; OpenAI's default has none."""
    plain = answer(client)
    assert answer(client, extra_body={"repeat_penalty": 1.0}) == plain  # off by default
    assert answer(client, presence_penalty=2.0) != plain
    assert answer(client, frequency_penalty=2.0) != plain
    assert answer(client, extra_body={"repeat_penalty": 3.0}) != plain
    # repeat_last_n 0 switches the penalties off.
    assert answer(client, extra_body={"repeat_penalty": 3.0, "repeat_last_n": 0}) == plain


def test_sampling_extras_take_effect(client: openai.OpenAI) -> None:
    """At temperature 1 with a seed, each truncation that keeps only the likeliest token makes
    the answer the greedy one; typical_p and a logit bias change it."""
    greedy = answer(client)
    sampled = answer(client, temperature=1.0, seed=11)
    assert sampled != greedy
    assert answer(client, temperature=1.0, seed=11) == sampled
    assert answer(client, temperature=1.0, seed=11, extra_body={"top_k": 1}) == greedy
    assert answer(client, temperature=1.0, seed=11, top_p=0.0001) == greedy
    assert answer(client, temperature=1.0, seed=11, extra_body={"min_p": 1.0}) == greedy
    assert (
        answer(client, temperature=1.0, seed=11, extra_body={"top_k": 0, "typical_p": 0.05})
        != sampled
    )

    # A bias against the greedy answer's first token (a byte token: id 3 + byte) makes the
    # greedy answer start otherwise.
    def first_token(**kwargs: Any) -> list[int]:
        r = chat(client, max_tokens=1, logprobs=True, extra_body=EXACT, **kwargs)
        assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content
        return list(r.choices[0].logprobs.content[0].bytes or [])

    first = first_token()
    assert len(first) == 1, first
    assert first_token(logit_bias={str(3 + first[0]): -100}) != first
    assert answer(client, logit_bias={str(3 + first[0]): -100}) != greedy


def test_logit_bias_forces_a_token(client: openai.OpenAI) -> None:
    # The tiny vocabulary: <unk> <s> </s>, then the 256 byte tokens <0x00>.. (id 3 + byte).
    q = 3 + ord("Q")
    r = chat(client, max_tokens=3, logit_bias={str(q): 100}, extra_body=EXACT)
    assert r.choices[0].message.content == "QQQ"


def test_logprobs_in_chat_and_completions(client: openai.OpenAI) -> None:
    r = chat(client, max_tokens=6, logprobs=True, top_logprobs=3, extra_body=EXACT)
    assert r.choices[0].logprobs is not None
    content = r.choices[0].logprobs.content
    assert content is not None and len(content) == 6
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0
        assert len(t.top_logprobs) == 3
        values = [a.logprob for a in t.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the sampled token is the most likely one.
        assert t.top_logprobs[0].token == t.token
        assert math.isclose(t.top_logprobs[0].logprob, t.logprob, rel_tol=1e-5)
        # A byte token that is part of a character reads as U+FFFD; its bytes are exact.
        assert bytes(t.bytes or []).decode("utf-8", "replace") == t.token

    c = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=4, temperature=0, logprobs=2, extra_body=EXACT
    )
    lp = c.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert "".join(lp.tokens) == c.choices[0].text
    assert len(lp.token_logprobs) == 4 and lp.top_logprobs is not None
    assert all(len(alternatives) == 2 for alternatives in lp.top_logprobs)
    assert lp.text_offset is not None and lp.text_offset[0] == 0


def test_json_schema_output_validates(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "colour": {"enum": ["red", "green", "blue"]},
        },
        "required": ["ok", "colour"],
        "additionalProperties": False,
    }
    r = chat(
        client,
        max_tokens=60,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        },
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_object_output_parses(client: openai.OpenAI, seed: int) -> None:
    r = chat(
        client,
        max_tokens=300,
        temperature=0.5,
        seed=seed,
        response_format={"type": "json_object"},
    )
    content = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", content
    assert isinstance(json.loads(content), dict), content


def test_chat_stops_at_the_end_of_turn_marker(client: openai.OpenAI, tiny_server: Server) -> None:
    """The tiny model's template is ChatML: a chat answer ends where the model writes
    ``<|im_end|>`` as text (a grammar makes it), in every dialect; a plain completion, which
    has no template, does not stop there."""
    grammar = 'root ::= "ab<|im_end|>cd"'
    r = chat(client, max_tokens=40, extra_body={"grammar": grammar})
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("ab", "stop")
    streamed = chat(client, max_tokens=40, extra_body={"grammar": grammar}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "ab"
    native = tiny_server.client().chat(CHAT, grammar=grammar, num_predict=40, temperature=0)
    assert (native.text, native.done_reason) == ("ab", "stop")
    plain = client.completions.create(
        model=MODEL, prompt="x", max_tokens=40, temperature=0, extra_body={"grammar": grammar}
    )
    assert plain.choices[0].text == "ab<|im_end|>cd"
    assert tiny_server.client().complete("x", grammar=grammar, num_predict=40).text == (
        "ab<|im_end|>cd"
    )


def test_embeddings_are_normalized_floats_or_base64(client: openai.OpenAI) -> None:
    # The client asks for base64 by default and decodes it.
    r = client.embeddings.create(model=MODEL, input=["the cat", "a dog"])
    assert [d.index for d in r.data] == [0, 1]
    for d in r.data:
        assert len(d.embedding) == 64
        assert math.isclose(math.sqrt(sum(x * x for x in d.embedding)), 1.0, rel_tol=1e-4)
    floats = client.embeddings.create(model=MODEL, input="the cat", encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(r.data[0].embedding, rel=1e-6)
    assert r.usage.prompt_tokens > 0


def error_of(call: Any) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value


def test_errors_have_openai_shape_and_status(client: openai.OpenAI, tiny_server: Server) -> None:
    # Any model name is the served model (as on llama-server), and the answer names it.
    assert chat(client, model="gpt-4o", max_tokens=2).model == "tiny"
    e = error_of(lambda: client.models.retrieve("gpt-4o"))
    assert isinstance(e, openai.NotFoundError)
    assert e.body["code"] == "model_not_found" and "tiny" in e.body["message"]
    assert e.body["type"] == "invalid_request_error"
    for kwargs, code in [
        ({"n": 9}, "invalid_request"),
        ({"temperature": 5}, "invalid_request"),
        ({"messages": []}, "invalid_request"),
        ({"logprobs": False, "top_logprobs": 2}, "invalid_request"),
        ({"extra_body": {"grammar": "root ::= ("}}, "invalid_request"),
        ({"messages": [{"role": "user", "content": "x " * 600}]}, "context_length_exceeded"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                    }
                ]
            },
            # This server has no vision projector (--mmproj).
            "images_not_supported",
        ),
    ]:
        kwargs.setdefault("max_tokens", 2)
        e = error_of(lambda kwargs=kwargs: chat(client, **kwargs))
        assert isinstance(e, openai.BadRequestError), kwargs
        assert e.body["code"] == code, (kwargs, e.body)
    # Truncation is for the native API; a chat too long for a slot is an error, as OpenAI's.
    r = httpx.post(f"{tiny_server.url}/v1/chat/completions", content=b"{", timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_json"


def test_chat_template_from_gguf_and_override(tmp_path: Path, start_server: Any) -> None:
    template = (
        "{% for m in messages %}<<{{ m.role | upper }}>>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<<BOT>>{% endif %}"
    )
    model = write_tiny_model(tmp_path / "templated.gguf", chat_template=template)
    msgs = [{"role": "user", "content": "hi"}]
    srv = start_server(model)
    r = httpx.post(f"{srv.url}/apply-template", json={"messages": msgs}, timeout=10)
    assert r.json() == {"prompt": "<<USER>>hi<<BOT>>"}
    names = httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in names] == ["templated"]  # the file stem
    srv = start_server(model, chat_template="chatml")
    r = httpx.post(f"{srv.url}/apply-template", json={"messages": msgs}, timeout=10)
    assert r.json()["prompt"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    jinja = tmp_path / "mine.jinja"
    jinja.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    srv = start_server(model, chat_template=str(jinja))
    r = httpx.post(f"{srv.url}/apply-template", json={"messages": msgs}, timeout=10)
    assert r.json()["prompt"] == "[hi]"


def test_a_gguf_template_that_does_not_compile_falls_back_to_the_family(
    tmp_path: Path, start_server: Any
) -> None:
    model = write_tiny_model(tmp_path / "broken.gguf", chat_template="{% for %}")
    srv = start_server(model)
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{srv.url}/apply-template", json={"messages": msgs}, timeout=10)
    # The tiny model (llama, no turn markers in its vocabulary): ChatML.
    assert r.json()["prompt"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    r = httpx.post(
        f"{srv.url}/v1/chat/completions",
        json={"messages": msgs, "max_tokens": 2, "ignore_eos": True},
        timeout=10,
    )
    assert r.status_code == 200, r.text


def test_a_template_error_is_a_400(tmp_path: Path, start_server: Any) -> None:
    template = "{{ raise_exception('roles must alternate') }}"
    srv = start_server(write_tiny_model(tmp_path / "strict.gguf", chat_template=template))
    r = httpx.post(
        f"{srv.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}]},
        timeout=10,
    )
    assert r.status_code == 400
    assert "roles must alternate" in r.json()["error"]["message"]


def test_native_chat_matches_the_openai_dialect(client: openai.OpenAI, tiny_server: Server) -> None:
    greedy = {"temperature": 0, "repeat_penalty": 1.0, "ignore_eos": True}
    via_openai = chat(client, max_tokens=10, extra_body=EXACT).choices[0].message.content
    native = tiny_server.client().chat(CHAT, num_predict=10, **greedy)
    assert native.text == via_openai
    assert native.done_reason == "length"
    with tiny_server.client().chat(CHAT, stream=True, num_predict=10, **greedy) as stream:
        assert "".join(c.content for c in stream) == via_openai
    r = httpx.post(
        f"{tiny_server.url}/completion",
        json={"prompt": "x", "messages": CHAT},
        timeout=10,
    )
    assert r.status_code == 400 and "not both" in r.json()["error"]["message"]


def test_async_client_chat(tiny_server: Server) -> None:
    async def main() -> int:
        async with AsyncClient(tiny_server.url) as c:
            answer = await c.chat(CHAT, num_predict=4, temperature=0, ignore_eos=True)
        return answer.eval_count

    assert asyncio.run(main()) == 4


def test_leaving_a_stream_early_frees_the_slot(client: openai.OpenAI, tiny_server: Server) -> None:
    stream = chat(client, max_tokens=100_000, extra_body=EXACT, stream=True)
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    stream.close()
    wait_idle(tiny_server.url)
