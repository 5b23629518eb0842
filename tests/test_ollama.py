"""The Ollama dialect (/api) driven by the official ``ollama`` client, on the tiny model."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import jsonschema
import ollama
import pytest

from llamarunner import Server

from helpers import wait_idle

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "hello there"}]
GREEDY: dict[str, Any] = {"temperature": 0, "num_predict": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(tiny_server: Server) -> ollama.Client:
    return ollama.Client(host=tiny_server.url)


def test_chat_stream_and_not(client: ollama.Client) -> None:
    r = client.chat(model=MODEL, messages=MESSAGES, options=GREEDY)
    assert r.done and r.done_reason == "length"
    assert r.message.role == "assistant" and r.message.content
    assert r.eval_count == 8 and r.prompt_eval_count and r.prompt_eval_count > 5
    assert r.total_duration and r.eval_duration and r.prompt_eval_duration
    parts = list(client.chat(model=MODEL, messages=MESSAGES, options=GREEDY, stream=True))
    assert parts[-1].done and parts[-1].done_reason == "length"
    assert all(not p.done for p in parts[:-1])
    assert "".join(p.message.content or "" for p in parts) == r.message.content
    # The ":latest" tag Ollama users type is accepted.
    again = client.chat(model=f"{MODEL}:latest", messages=MESSAGES, options=GREEDY)
    assert again.message.content == r.message.content


def test_generate_templated_raw_and_system(client: ollama.Client, tiny_server: Server) -> None:
    r = client.generate(model=MODEL, prompt="hello there", options=GREEDY)
    assert r.done_reason == "length" and r.eval_count == 8
    chat = client.chat(model=MODEL, messages=MESSAGES, options=GREEDY)
    assert r.response == chat.message.content  # the same rendered prompt
    # raw: the prompt as is, equal to the native API's answer to the same text.
    raw = client.generate(model=MODEL, prompt="hello there", raw=True, options=GREEDY)
    native = tiny_server.client().complete("hello there", **GREEDY)
    assert raw.response == native.text
    with_system = client.generate(model=MODEL, prompt="hello", system="Be brief.", options=GREEDY)
    assert with_system.prompt_eval_count and with_system.prompt_eval_count > (
        r.prompt_eval_count or 0
    )
    streamed = list(client.generate(model=MODEL, prompt="hello there", options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == r.response
    # Nothing to generate: Ollama answers "load".
    assert client.generate(model=MODEL).done_reason == "load"


def test_format_schema_output_validates(client: ollama.Client) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    r = client.chat(
        model=MODEL, messages=MESSAGES, format=schema, options={"temperature": 0, "num_predict": 60}
    )
    jsonschema.validate(json.loads(r.message.content or ""), schema)
    assert r.done_reason == "stop"


def test_format_json_output_parses(client: ollama.Client) -> None:
    """Every output that ends (the tiny model's random weights may also write one string to
    the token limit) is a JSON object; some do end."""
    stopped = 0
    for seed in range(8):
        options = {"temperature": 0.5, "seed": seed, "num_predict": 300}
        r = client.generate(model=MODEL, prompt="json:", format="json", options=options)
        c = client.chat(model=MODEL, messages=MESSAGES, format="json", options=options)
        for done_reason, text in ((r.done_reason, r.response), (c.done_reason, c.message.content)):
            assert done_reason in ("stop", "length"), done_reason
            if done_reason == "stop":
                stopped += 1
                assert isinstance(json.loads(text or ""), dict), text
    assert stopped >= 4, stopped


def test_chat_stops_at_the_end_of_turn_marker(client: ollama.Client) -> None:
    """The template (ChatML) ends a turn with ``<|im_end|>``: an answer that writes it as text
    stops there (a schema makes the model write it); a raw prompt, with no template, does
    not."""
    schema = {
        "type": "object",
        "properties": {"t": {"enum": ["ab<|im_end|>cd"]}},
        "required": ["t"],
        "additionalProperties": False,
    }
    options = {"temperature": 0, "num_predict": 60}
    r = client.chat(model=MODEL, messages=MESSAGES, format=schema, options=options)
    content = r.message.content or ""
    assert r.done_reason == "stop"
    assert content.endswith('"ab') and "<|im_end|>" not in content, content
    g = client.generate(model=MODEL, prompt="hello", format=schema, options=options)
    assert g.done_reason == "stop"
    assert g.response.endswith('"ab') and "<|im_end|>" not in g.response, g.response
    raw = client.generate(model=MODEL, prompt="hello", raw=True, format=schema, options=options)
    assert json.loads(raw.response) == {"t": "ab<|im_end|>cd"}


def test_ignored_fields_change_nothing(client: ollama.Client, tiny_server: Server) -> None:
    """keep_alive (the model is always loaded) and context (Ollama's deprecated token context)
    are accepted and ignored: the answer is the one without them."""
    body = {"model": MODEL, "prompt": "hello there", "stream": False, "options": GREEDY}
    plain = httpx.post(f"{tiny_server.url}/api/generate", json=body, timeout=30)
    assert plain.status_code == 200, plain.text
    for extra in ({"keep_alive": "5m"}, {"keep_alive": -1}, {"context": [1, 2, 3, 260, 261]}):
        r = httpx.post(f"{tiny_server.url}/api/generate", json={**body, **extra}, timeout=30)
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["response"] == plain.json()["response"], extra
        assert r.json()["prompt_eval_count"] == plain.json()["prompt_eval_count"], extra
    chat = {"model": MODEL, "messages": MESSAGES, "stream": False, "options": GREEDY}
    base = httpx.post(f"{tiny_server.url}/api/chat", json=chat, timeout=30).json()
    r = httpx.post(f"{tiny_server.url}/api/chat", json={**chat, "keep_alive": "1h"}, timeout=30)
    assert r.json()["message"] == base["message"]


def test_model_management_is_404(client: ollama.Client, tiny_server: Server) -> None:
    calls = [
        lambda: client.push("tiny"),
        lambda: client.create(model="mine", from_=MODEL),
        lambda: client.copy(MODEL, "tiny2"),
        lambda: client.delete(MODEL),
    ]
    for call in calls:
        with pytest.raises(ollama.ResponseError) as info:
            call()
        assert info.value.status_code == 404
        assert "serves the models it was started with" in info.value.error
    for path in ("/api/push", "/api/create", "/api/copy", "/api/delete"):
        method = "DELETE" if path == "/api/delete" else "POST"
        r = httpx.request(method, f"{tiny_server.url}{path}", json={"model": MODEL}, timeout=10)
        assert r.status_code == 404, path
        assert "cannot push, create, copy or delete models" in r.json()["error"], path
    # A pull of the served model finds it there; of another, a 404 that says how to get it.
    assert client.pull(MODEL).status == "success"
    assert [p.status for p in client.pull(MODEL, stream=True)] == ["success"]
    with pytest.raises(ollama.ResponseError) as info:
        client.pull("llama3")
    assert info.value.status_code == 404 and "llamarunner pull" in info.value.error


def test_embed_is_normalized(client: ollama.Client) -> None:
    r = client.embed(model=MODEL, input=["the cat", "a dog"])
    assert len(r.embeddings) == 2
    for v in r.embeddings:
        assert len(v) == 64
        assert math.isclose(math.sqrt(sum(x * x for x in v)), 1.0, rel_tol=1e-4)
    one = client.embed(model=MODEL, input="the cat")
    assert one.embeddings[0] == pytest.approx(r.embeddings[0], rel=1e-5)
    legacy = client.embeddings(model=MODEL, prompt="the cat")
    assert len(legacy.embedding) == 64


def test_list_show_ps_version(client: ollama.Client, tiny_server: Server) -> None:
    models = client.list().models
    assert [m.model for m in models] == [MODEL]
    assert models[0].size and models[0].size > 0
    assert models[0].details and models[0].details.family == "llama"
    assert models[0].details.quantization_level == "F32"
    shown = client.show(MODEL)
    assert shown.details and shown.details.format == "gguf"
    assert shown.modelinfo and shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == 65536
    assert shown.template and "im_start" in shown.template  # the ChatML fallback
    running = client.ps().models
    assert [m.model for m in running] == [MODEL]
    assert running[0].context_length == 512
    version = httpx.get(f"{tiny_server.url}/api/version", timeout=10).json()
    assert isinstance(version["version"], str)
    assert httpx.get(tiny_server.url, timeout=10).text == "llamarunner is running"


def test_errors_are_ollama_shaped(client: ollama.Client, tiny_server: Server) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="llama3:8b", messages=MESSAGES)
    assert info.value.status_code == 404
    assert "llama3:8b" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.show("llama3:8b")
    assert info.value.status_code == 404
    for options in ({"temperature": -1}, {"top_p": 3}):
        with pytest.raises(ollama.ResponseError) as info:
            client.generate(model=MODEL, prompt="x", options=options)
        assert info.value.status_code == 400, options
    r = httpx.post(
        f"{tiny_server.url}/api/chat",
        json={"model": MODEL, "messages": MESSAGES, "format": "yaml"},
        timeout=10,
    )
    assert r.status_code == 400 and "format" in r.json()["error"]
    bad_schema = {"type": "object", "properties": {"age": {"type": "banana"}}}
    r = httpx.post(
        f"{tiny_server.url}/api/chat",
        json={"model": MODEL, "messages": MESSAGES, "format": bad_schema},
        timeout=10,
    )
    assert r.status_code == 400
    assert "schema.properties.age.type" in r.json()["error"], r.json()
    r = httpx.post(f"{tiny_server.url}/api/chat", json={"messages": MESSAGES}, timeout=10)
    assert r.status_code == 400 and r.json() == {"error": "model is required"}
    r = httpx.post(f"{tiny_server.url}/api/generate", content=b"{", timeout=10)
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    r = httpx.post(
        f"{tiny_server.url}/api/chat",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x", "images": ["AAAA"]}]},
        timeout=10,
    )
    assert r.status_code == 400 and "images" in r.json()["error"]


def test_leaving_a_stream_early_frees_the_slot(client: ollama.Client, tiny_server: Server) -> None:
    options = {"num_predict": 100_000, "ignore_eos": True}
    with httpx.stream(
        "POST",
        f"{tiny_server.url}/api/chat",
        json={"model": MODEL, "messages": MESSAGES, "options": options},
        timeout=10,
    ) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    wait_idle(tiny_server.url)


def test_logprobs_on_generate_and_chat(client: ollama.Client, tiny_server: Server) -> None:
    """Ollama's `logprobs` / `top_logprobs`: one entry per generated token, each with its
    alternatives best first, whole and streamed; the same figures as the OpenAI dialect's."""
    g = client.generate(model=MODEL, prompt="hello", options=GREEDY, logprobs=True, top_logprobs=3)
    assert g.logprobs is not None and len(g.logprobs) == 8
    for entry in g.logprobs:
        assert entry.logprob <= 0
        assert entry.top_logprobs is not None and len(entry.top_logprobs) == 3
        alternatives = [t.logprob for t in entry.top_logprobs]
        assert alternatives == sorted(alternatives, reverse=True)
        # Of the raw logits (ignore_eos bans end tokens after them): none above the best.
        assert entry.logprob <= alternatives[0] + 1e-5
    streamed = list(
        client.generate(
            model=MODEL, prompt="hello", options=GREEDY, logprobs=True, top_logprobs=3, stream=True
        )
    )
    entries = [e for part in streamed for e in (part.logprobs or [])]
    assert [(e.token, round(e.logprob, 4)) for e in entries] == [
        (e.token, round(e.logprob, 4)) for e in g.logprobs
    ]
    c = client.chat(model=MODEL, messages=MESSAGES, options=GREEDY, logprobs=True)
    assert c.logprobs is not None and len(c.logprobs) == 8
    assert all(not e.top_logprobs for e in c.logprobs)
    parts = list(
        client.chat(model=MODEL, messages=MESSAGES, options=GREEDY, logprobs=True, stream=True)
    )
    assert sum(len(p.logprobs or []) for p in parts) == 8
    plain = client.generate(model=MODEL, prompt="hello", options=GREEDY)
    assert plain.logprobs is None
    for body, fragment in [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "needs logprobs"),
    ]:
        r = httpx.post(
            f"{tiny_server.url}/api/generate",
            json={"model": MODEL, "prompt": "x", "stream": False, **body},
            timeout=30,
        )
        assert r.status_code == 400 and fragment in r.json()["error"], r.text
