"""What clients written for llama.cpp's llama-server rely on (docs/endpoints.md, "Drop-in for
llama-server's clients"), through the official ``openai`` client and plain HTTP, on the tiny
model: any model name, routes without ``/v1``, constraints honoured or refused, conversations
that cannot be rendered refused, the context error's sizes, token-id embeddings, prompt
progress, input token counts, the template's thinking switch and variables."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llamarunner import Server

from tinymodel import N_EMBD, vocabulary, write_tiny_model

CHAT = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def root_client(tiny_server: Server) -> Iterator[openai.OpenAI]:
    """A client given the server's root as its base URL (no ``/v1``), as some tools are."""
    with openai.OpenAI(base_url=tiny_server.url, api_key="unused", max_retries=0) as c:
        yield c


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_any_model_name_and_the_routes_without_v1(
    root_client: openai.OpenAI, tiny_server: Server
) -> None:
    answer = root_client.chat.completions.create(
        model="gpt-4o-mini",
        messages=CHAT,
        max_tokens=3,
        temperature=0,  # type: ignore[arg-type]
    )
    assert answer.model == "tiny" and answer.usage is not None
    text = root_client.completions.create(model="anything", prompt="hi", max_tokens=2)
    assert text.model == "tiny" and len(text.choices) == 1
    vectors = root_client.embeddings.create(model="text-embedding-3-small", input="hi")
    assert len(vectors.data[0].embedding) > 0
    assert [m.id for m in root_client.models.list().data] == ["tiny"]
    assert httpx.get(f"{tiny_server.url}/v1/health").status_code == 200
    # Ollama's routes keep the 404 its clients pull a model on.
    r = post(tiny_server, "/api/generate", {"model": "llama3", "prompt": "hi"})
    assert r.status_code == 404, r.text


def test_the_model_list_carries_llama_server_s_meta(tiny_server: Server, tmp_path: Path) -> None:
    """llama-server's ``meta`` of a model (clients read the slot's context there)."""
    entry = httpx.get(f"{tiny_server.url}/models", timeout=10).json()["data"][0]
    meta = entry["meta"]
    props = httpx.get(f"{tiny_server.url}/props", timeout=10).json()
    assert meta["n_ctx"] == props["default_generation_settings"]["n_ctx"] == 512
    assert meta["n_ctx_train"] == 65536
    assert meta["n_vocab"] == len(vocabulary()[0])
    assert meta["n_embd"] == N_EMBD
    assert meta["n_params"] == props["model"]["n_params"] > N_EMBD * meta["n_vocab"]
    # The tiny model's file has the same size whatever its random weights.
    assert meta["size"] == write_tiny_model(tmp_path / "same.gguf").stat().st_size
    one = httpx.get(f"{tiny_server.url}/v1/models/tiny", timeout=10).json()
    assert one["meta"] == meta


def test_constraints_are_honoured_or_refused(tiny_server: Server) -> None:
    base = {"messages": CHAT, "max_tokens": 12, "temperature": 0}
    for constraint in (
        {"json_schema": {"const": "42"}},
        {"response_format": {"type": "json_object", "schema": {"const": "42"}}},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"const": "42"}}}},
    ):
        r = post(tiny_server, "/chat/completions", {**base, **constraint})
        assert r.status_code == 200, (constraint, r.text)
        assert json.loads(r.json()["choices"][0]["message"]["content"]) == "42", constraint
    for bad in (
        {"response_format": {"type": 123}},
        {"response_format": {"type": "sound"}},
        {"response_format": {"type": "json_object", "schema": 123}},
        {"response_format": {"type": "json_object", "schema": {"type": "hiccup"}}},
        {"json_schema": {"const": "42"}, "grammar": 'root ::= "a"'},
    ):
        r = post(tiny_server, "/v1/chat/completions", {**base, **bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error", r.text


def test_verbose_answers_carry_the_rendered_prompt(tiny_server: Server) -> None:
    """llama-server's ``verbose``: a whole answer carries ``__verbose``, the answer in its
    native format with the prompt as the template rendered it; not without it."""
    chat = [{"role": "system", "content": "Book"}, {"role": "user", "content": "best book?"}]
    base = {"messages": chat, "max_tokens": 3, "temperature": 0}
    answer = post(tiny_server, "/v1/chat/completions", {**base, "verbose": True}).json()
    verbose = answer["__verbose"]
    assert "Book" in verbose["prompt"] and "best book?" in verbose["prompt"], verbose
    assert verbose["content"] == answer["choices"][0]["message"]["content"]
    assert verbose["tokens_predicted"] == answer["usage"]["completion_tokens"]
    assert verbose["generation_settings"]["n_predict"] == 3
    once = {"prompt": "Once", "max_tokens": 2, "verbose": True}
    text = post(tiny_server, "/v1/completions", once)
    assert text.json()["__verbose"]["prompt"] == "Once", text.text
    for body in (base, {**base, "verbose": False}):
        assert "__verbose" not in post(tiny_server, "/v1/chat/completions", body).json()


def test_conversations_that_cannot_be_rendered_are_refused(tiny_server: Server) -> None:
    two_answers = [
        {"role": "user", "content": "test"},
        {"role": "assistant", "content": "test"},
        {"role": "assistant", "content": "test"},
    ]
    r = post(tiny_server, "/v1/chat/completions", {"messages": two_answers})
    assert r.status_code == 400 and "2 or more assistant" in r.text, r.text
    prefill = [*CHAT, {"role": "assistant", "content": "Hello"}]
    both = {"add_generation_prompt": True, "continue_final_message": True}
    r = post(tiny_server, "/v1/chat/completions", {"messages": prefill, **both})
    assert r.status_code == 400, r.text
    ok = {"add_generation_prompt": False, "continue_final_message": True, "max_tokens": 2}
    assert post(tiny_server, "/v1/chat/completions", {"messages": prefill, **ok}).is_success


def test_a_prompt_too_long_says_its_size_and_the_slot_s(tiny_server: Server) -> None:
    r = post(tiny_server, "/v1/chat/completions", {"messages": CHAT * 200})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert err["type"] == "exceed_context_size_error"
    assert err["n_ctx"] == 512 and err["n_prompt_tokens"] > 512


def test_embeddings_of_token_ids_equal_those_of_their_text(tiny_server: Server) -> None:
    ids = httpx.post(f"{tiny_server.url}/tokenize", json={"content": "the cat"}).json()["tokens"]
    r = post(tiny_server, "/v1/embeddings", {"input": ["the cat", ids, ids]})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == [0, 1, 2]
    assert data[1]["embedding"] == data[2]["embedding"]
    # The text is tokenized with BOS; the ids are embedded as given.
    assert len(data[0]["embedding"]) == len(data[1]["embedding"])
    for bad in ([[10**9]], [1.5], [[]], [{"a": 1}]):
        r = post(tiny_server, "/v1/embeddings", {"input": bad})
        assert r.status_code == 400, (bad, r.text)


def test_prompt_progress_is_streamed_when_asked(tiny_server: Server) -> None:
    body = {
        "messages": [{"role": "user", "content": "This is a test " * 10}],
        "max_tokens": 3,
        "stream": True,
        "return_progress": True,
    }
    progress = []
    with httpx.stream("POST", f"{tiny_server.url}/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: ") :])
                if "prompt_progress" in chunk:
                    assert chunk["choices"] == []
                    progress.append(chunk["prompt_progress"])
    assert len(progress) >= 2, progress
    first, last = progress[0], progress[-1]
    assert first["processed"] == first["cache"]
    assert last["processed"] == last["total"] > 0
    assert all(a["processed"] < b["processed"] for a, b in zip(progress, progress[1:]))


def sse_data(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON objects of a streamed answer's ``data:`` lines."""
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(x[len("data: ") :]) for x in r.iter_lines() if x.startswith("data: {")]


def test_timings_per_token_are_streamed_when_asked(tiny_server: Server) -> None:
    """llama-server's ``timings_per_token``: the Responses API's text deltas and the text
    events of ``/completion`` carry the timings so far; the last event the engine's own."""
    body = {"max_output_tokens": 4, "temperature": 0, "stream": True, "timings_per_token": True}
    events = sse_data(tiny_server, "/responses", {**body, "input": "This is a test " * 5})
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and all("timings" in e for e in deltas), events
    counts = [e["timings"]["predicted_n"] for e in deltas]
    assert counts == sorted(counts) and counts[0] >= 1
    for e in deltas:
        t = e["timings"]
        assert t["prompt_n"] + t["cache_n"] > 0 and t["prompt_ms"] >= 0, t
        assert "prompt_per_second" in t and "predicted_per_second" in t
    completed = [e for e in events if e["type"] in ("response.completed", "response.incomplete")]
    assert (
        completed[0]["timings"]["predicted_n"] == completed[0]["response"]["usage"]["output_tokens"]
    )
    # Not asked: no timings on the deltas, the last event's still.
    events = sse_data(tiny_server, "/responses", {**body, "timings_per_token": False, "input": "x"})
    assert not any("timings" in e for e in events if e["type"].endswith(".delta")), events
    chunks = sse_data(
        tiny_server,
        "/completion",
        {"prompt": "Once", "n_predict": 3, "stream": True, "timings_per_token": True},
    )
    text = [c for c in chunks if not c["stop"]]
    assert text and all(c["timings"]["predicted_n"] >= 1 for c in text), chunks


def test_the_server_s_seed_seeds_the_requests_that_give_none(tmp_path: Path) -> None:
    """``--seed`` (llama-server's): a request without a seed gets the server's, so the same
    request gives the same text; one with its own keeps it."""
    model = write_tiny_model(tmp_path / "tiny.gguf")
    with Server(str(model), port=0, parallel=1, ctx_size=256, threads=2, seed=42) as srv:
        body = {"prompt": "Once upon a", "n_predict": 12, "temperature": 1.5, "cache_prompt": False}
        texts = {post(srv, "/completion", body).json()["content"] for _ in range(3)}
        assert len(texts) == 1, texts
        chat = {"messages": CHAT, "max_tokens": 12, "temperature": 1.5, "cache_prompt": False}
        answers = {
            post(srv, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
            for _ in range(2)
        }
        assert len(answers) == 1, answers
        props = httpx.get(f"{srv.url}/props").json()
        assert props["default_generation_settings"]["params"]["seed"] == 42
        own = {post(srv, "/completion", {**body, "seed": s}).json()["content"] for s in range(6)}
        assert len(own) > 1, own


def test_the_server_s_sampling_flags_fill_what_requests_leave_out(tmp_path: Path) -> None:
    """``--temp`` and the rest (llama-server's): a request in any API that leaves the field
    out samples with the server's value; one that sends it keeps its own."""
    model = write_tiny_model(tmp_path / "tiny.gguf")
    with Server(str(model), port=0, parallel=1, ctx_size=256, threads=2, temp=0.0, top_k=5) as srv:
        props = httpx.get(f"{srv.url}/props").json()["default_generation_settings"]["params"]
        assert (props["temperature"], props["top_k"]) == (0.0, 5)
        chat = {"messages": CHAT, "max_tokens": 12}
        greedy = post(srv, "/v1/chat/completions", {**chat, "temperature": 0}).json()
        for _ in range(2):
            left_out = post(srv, "/v1/chat/completions", chat).json()
            assert left_out["choices"][0]["message"] == greedy["choices"][0]["message"]
        ollama = {"model": "tiny", "prompt": "Once upon a", "stream": False}
        want = post(srv, "/api/generate", {**ollama, "options": {"temperature": 0}}).json()
        got = post(srv, "/api/generate", {**ollama, "options": {"num_predict": 12}}).json()
        assert got["response"].startswith(want["response"][:12]), (got, want)
        # Sent: the request's own (hot sampling differs across seeds).
        texts = {
            post(
                srv,
                "/completion",
                {"prompt": "Once", "n_predict": 8, "temperature": 2.0, "top_k": 0, "seed": s},
            ).json()["content"]
            for s in range(5)
        }
        assert len(texts) > 1, texts


def test_the_server_s_penalty_and_mirostat_flags_fill_what_requests_leave_out(
    tmp_path: Path,
) -> None:
    """``--repeat-penalty``, ``--mirostat``, ``--dry-multiplier``, ``--xtc-probability`` and
    the rest (llama-server's): /props reports them, and a request that leaves them out samples
    as one that sends the same values."""
    model = write_tiny_model(tmp_path / "tiny.gguf")
    flags = {
        "repeat_penalty": 1.8,
        "repeat_last_n": 32,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "mirostat": 2,
        "mirostat_lr": 0.2,
        "mirostat_ent": 4.0,
        "typical": 0.9,
        "dry_multiplier": 0.8,
        "dry_base": 2.0,
        "dry_allowed_length": 3,
        "dry_penalty_last_n": 64,
        "xtc_probability": 0.5,
        "xtc_threshold": 0.2,
        "top_n_sigma": 1.5,
        "dynatemp_range": 0.3,
        "dynatemp_exp": 1.5,
    }
    with Server(str(model), port=0, parallel=1, ctx_size=256, threads=2, **flags) as srv:
        props = httpx.get(f"{srv.url}/props").json()["default_generation_settings"]["params"]
        wire = {
            "repeat_penalty": 1.8,
            "repeat_last_n": 32,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.25,
            "mirostat": 2,
            "mirostat_eta": 0.2,
            "mirostat_tau": 4.0,
            "typical_p": 0.9,
            "dry_multiplier": 0.8,
            "dry_base": 2.0,
            "dry_allowed_length": 3,
            "dry_penalty_last_n": 64,
            "xtc_probability": 0.5,
            "xtc_threshold": 0.2,
            "top_n_sigma": 1.5,
            "dynatemp_range": 0.3,
            "dynatemp_exponent": 1.5,
        }
        for name, value in wire.items():
            assert props[name] == pytest.approx(value), (name, props[name])
        base = {"prompt": "Once upon a", "n_predict": 16, "temperature": 0.8, "seed": 7}
        left_out = post(srv, "/completion", base).json()["content"]
        assert post(srv, "/completion", {**base, **wire}).json()["content"] == left_out
        chat = {"messages": CHAT, "max_tokens": 16, "temperature": 0.8, "seed": 7}
        left_out = post(srv, "/v1/chat/completions", chat).json()["choices"][0]["message"]
        sent = post(srv, "/v1/chat/completions", {**chat, **wire}).json()
        assert sent["choices"][0]["message"] == left_out


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--mirostat", "3"),
        ("--typical", "1.5"),
        ("--repeat-penalty", "-1"),
        ("--repeat-last-n", "-2"),
        ("--dry-multiplier", "-0.5"),
        ("--dry-allowed-length", "-1"),
        ("--xtc-probability", "1.5"),
        ("--top-n-sigma", "nan"),
        ("--dynatemp-range", "11"),
    ],
)
def test_a_bad_sampling_flag_is_refused_at_start(tmp_path: Path, flag: str, value: str) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf")
    serve = [sys.executable, "-m", "llamarunner", "serve", str(model), "--port", "0"]
    proc = subprocess.run([*serve, flag, value], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert flag.lstrip("-") in proc.stderr, proc.stderr


def test_the_server_s_token_limit_and_context_shift_fill_what_requests_leave_out(
    tmp_path: Path,
) -> None:
    """``--n-predict`` and ``--no-context-shift`` (llama-server's): a request that names no
    limit generates the server's number of tokens, one that names one keeps it; a sequence
    that fills its slot ends there unless the request asks for the shift."""
    model = write_tiny_model(tmp_path / "tiny.gguf")
    with Server(
        str(model), port=0, parallel=1, ctx_size=256, threads=2, n_predict=7, context_shift=False
    ) as srv:
        base = {"prompt": "Once", "temperature": 0, "ignore_eos": True}
        assert post(srv, "/completion", base).json()["tokens_predicted"] == 7
        assert post(srv, "/completion", {**base, "n_predict": -1}).json()["tokens_predicted"] == 7
        chat = {"messages": CHAT, "temperature": 0, "ignore_eos": True}
        assert post(srv, "/v1/chat/completions", chat).json()["usage"]["completion_tokens"] == 7
        # A limit past the slot: it ends where the slot is full, with "length", unshifted...
        full = post(srv, "/completion", {**base, "n_predict": 400}).json()
        assert full["stop_type"] == "limit" and full["tokens_predicted"] < 256, full
        # ... unless the request says shift (the native format's field).
        native = {"num_predict": 300, "temperature": 0, "ignore_eos": True}
        shifted = post(srv, "/completion", {"prompt": "Once", "options": native, "shift": True})
        final = [json.loads(line) for line in shifted.text.splitlines() if line.strip()][-1]
        assert final["eval_count"] == 300, final


@pytest.mark.parametrize("value", ["-2", "x"])
def test_a_bad_n_predict_is_refused_at_start(tmp_path: Path, value: str) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf")
    serve = [sys.executable, "-m", "llamarunner", "serve", str(model), "--port", "0"]
    proc = subprocess.run(
        [*serve, "--n-predict", value], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert "n-predict" in proc.stderr, proc.stderr


def test_input_tokens_are_the_generation_s_prompt_tokens(tiny_server: Server) -> None:
    counted = post(tiny_server, "/v1/chat/completions/input_tokens", {"messages": CHAT})
    assert counted.status_code == 200, counted.text
    assert counted.json()["object"] == "response.input_tokens"
    generated = post(tiny_server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})
    assert counted.json()["input_tokens"] == generated.json()["usage"]["prompt_tokens"]
    r = post(tiny_server, "/responses/input_tokens", {"input": "hello there"})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text


def test_header_names_are_written_in_title_case(tiny_server: Server) -> None:
    """As llama-server writes them: some clients compare header names as written."""
    import http.client
    from urllib.parse import urlsplit

    url = urlsplit(tiny_server.url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        response.read()
        names = [name for name, _ in response.getheaders()]
    finally:
        conn.close()
    assert response.status == 200
    assert "Process-Start-Time-Unix" in names and "Content-Type" in names, names


# A thinking template in the shape llama.cpp ships QwQ's and DeepSeek-R1's: the block opened
# for the answer, closed at once unless `enable_thinking`; and the variables llama-server gives
# every template (today's `date_string`) and a request's own kwargs (`note`).
THINKING_TEMPLATE = (
    "[{{ date_string }}|{{ note | default('-') }}]"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
    "{% if not enable_thinking %}</think>{% endif %}{% endif %}"
)


def apply_template(server: Server, **fields: Any) -> httpx.Response:
    return post(server, "/apply-template", {"messages": CHAT, **fields})


def test_thinking_follows_the_request_then_the_server_s_reasoning_flag(
    tmp_path: Path, start_server: Callable[..., Server]
) -> None:
    model = write_tiny_model(tmp_path / "thinking.gguf")
    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    auto = start_server(model, chat_template=str(template))
    # --reasoning auto: a template that reads enable_thinking thinks.
    prompt = apply_template(auto).json()["prompt"]
    assert prompt.endswith("<think>\n"), prompt
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%d %b %Y")
    yesterday = (
        datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=1)
    ).strftime("%d %b %Y")
    assert prompt.startswith((f"[{today}|-]", f"[{yesterday}|-]")), prompt
    for switch in (
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"reasoning_effort": "none"},
        {"think": False},
    ):
        prompt = apply_template(auto, **switch).json()["prompt"]
        assert prompt.endswith("<think>\n</think>"), (switch, prompt)
    prompt = apply_template(auto, chat_template_kwargs={"note": "hi"}).json()["prompt"]
    assert "|hi]" in prompt, prompt
    # The chat completion renders the same way: closing the block costs tokens.
    count = "/v1/chat/completions/input_tokens"
    thinking = post(auto, count, {"messages": CHAT}).json()["input_tokens"]
    closed = post(
        auto, count, {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    ).json()["input_tokens"]
    assert closed > thinking, (closed, thinking)
    for bad in (
        {"chat_template_kwargs": {"enable_thinking": "false"}},
        {"chat_template_kwargs": {"messages": []}},
        {"chat_template_kwargs": ["enable_thinking"]},
        {"reasoning_effort": "extreme"},
    ):
        for path, kind in (
            ("/apply-template", "invalid_request"),
            ("/v1/chat/completions", "invalid_request_error"),
        ):
            r = post(auto, path, {"messages": CHAT, "max_tokens": 1, **bad})
            assert r.status_code == 400, (path, bad, r.text)
            assert r.json()["error"]["type"] == kind, r.text
    # --reasoning off: closed unless the request asks.
    off = start_server(model, chat_template=str(template), reasoning="off")
    assert apply_template(off).json()["prompt"].endswith("<think>\n</think>")
    prompt = apply_template(off, chat_template_kwargs={"enable_thinking": True}).json()["prompt"]
    assert prompt.endswith("<think>\n"), prompt


def test_completion_in_llama_server_s_format(tiny_server: Server) -> None:
    """A `/completion` body with llama-server's fields gets llama-server's answer; one in the
    Ollama runner's shape keeps the runner's NDJSON."""
    body = {"prompt": "I believe the meaning of life is", "n_predict": 4, "temperature": 0}
    r = post(tiny_server, "/completion", body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["stop"] is True and answer["model"] == "tiny"
    assert answer["stop_type"] == "limit" and answer["tokens_predicted"] == 4
    timings = answer["timings"]
    assert timings["predicted_n"] == 4
    assert timings["prompt_n"] + timings["cache_n"] == answer["tokens_evaluated"] > 0
    assert answer["generation_settings"]["n_predict"] == 4
    # The same prompt again: its tokens come from the cache, and the text is the same.
    again = post(tiny_server, "/completion", body).json()
    assert again["content"] == answer["content"]
    assert again["timings"]["cache_n"] > 0
    # Streamed: partial answers, then the statistics; no [DONE].
    events = []
    with httpx.stream(
        "POST", f"{tiny_server.url}/completion", json={**body, "stream": True}, timeout=60
    ) as s:
        assert s.status_code == 200
        assert s.headers["content-type"].startswith("text/event-stream")
        for line in s.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == answer["content"]
    assert events[-1]["timings"]["predicted_n"] == 4
    # The sampled tokens' ids and probabilities, when asked, whole and streamed.
    asked = {**body, "n_probs": 3, "return_tokens": True}
    answer = post(tiny_server, "/completion", asked).json()
    assert len(answer["tokens"]) == 4 and all(isinstance(t, int) for t in answer["tokens"])
    probs = answer["completion_probabilities"]
    assert [p["id"] for p in probs] == answer["tokens"]
    for p in probs:
        assert p["logprob"] <= 0 and isinstance(p["bytes"], list) and len(p["top_logprobs"]) == 3
    # Greedy: the sampled token is the most likely one.
    assert all(p["id"] == p["top_logprobs"][0]["id"] for p in probs)
    streamed = []
    with httpx.stream(
        "POST", f"{tiny_server.url}/completion", json={**asked, "stream": True}, timeout=60
    ) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                streamed.append(json.loads(line[len("data: ") :]))
    ids = [t for e in streamed if not e["stop"] for t in e["tokens"]]
    assert ids == answer["tokens"], streamed
    # After the sampler chain (`post_sampling_probs`): probabilities of what top-k 3 left,
    # each position's summing to one, the sampled token among them; greedy: all on its pick.
    for extra, k in (({"temperature": 1.0, "top_k": 3, "seed": 5}, 3), ({}, 1)):
        post_chain = {**body, **extra, "n_probs": 5, "post_sampling_probs": True}
        probs = post(tiny_server, "/completion", post_chain).json()["completion_probabilities"]
        assert len(probs) == 4
        for p in probs:
            assert "logprob" not in p and "top_logprobs" not in p, p
            top = p["top_probs"]
            assert 1 <= len(top) <= k and all(0.0 < t["prob"] <= 1.0 for t in top), p
            assert sum(t["prob"] for t in top) == pytest.approx(1.0, abs=1e-4), p
            assert p["id"] in [t["id"] for t in top] and 0.0 < p["prob"] <= 1.0, p
            if k == 1:
                assert p["prob"] == 1.0, p
    # Token ids as the prompt.
    ids = post(tiny_server, "/tokenize", {"content": "hello"}).json()["tokens"]
    r = post(tiny_server, "/completion", {"prompt": ids, "n_predict": 2})
    assert r.status_code == 200 and r.json()["tokens_evaluated"] == len(ids), r.text
    # Alone too: a prompt of token ids is llama-server's format (the runner's prompt is text).
    r = post(tiny_server, "/completion", {"prompt": ids})
    assert r.status_code == 200 and r.json()["stop"] is True, r.text
    # Several prompts in one request: one answer each, in their order; token ids and texts
    # mixed in one prompt; llama-server's prompt object.
    several = {"prompt": ["I believe", ids, {"prompt_string": "hi"}], "n_predict": 2}
    r = post(tiny_server, "/completion", several)
    assert r.status_code == 200, r.text
    assert [a["index"] for a in r.json()] == [0, 1, 2] and r.json()[0]["prompt"] == "I believe"
    r = post(tiny_server, "/completion", {"prompt": [*ids, " and more"], "n_predict": 2})
    assert r.status_code == 200 and r.json()["tokens_evaluated"] > len(ids), r.text
    r = post(tiny_server, "/completion", {"prompt": {"prompt_string": "x", "multimodal_data": []}})
    assert r.status_code == 400 and r.json()["error"]["type"] == "images_not_supported"
    # logit_bias, by token id (both shapes) or by text: a banned token is never sampled.
    greedy = {"prompt": "I believe the meaning of life is", "n_predict": 1, "temperature": 0}
    first = post(tiny_server, "/completion", {**greedy, "return_tokens": True}).json()["tokens"][0]
    for bias in ([[first, False]], {str(first): -100}, [[first, -100]]):
        r = post(tiny_server, "/completion", {**greedy, "return_tokens": True, "logit_bias": bias})
        assert r.status_code == 200 and r.json()["tokens"][0] != first, (bias, r.text)
    text = post(tiny_server, "/detokenize", {"tokens": [first]}).json()["content"]
    by_text = {**greedy, "return_tokens": True, "logit_bias": {text: False}}
    r = post(tiny_server, "/completion", by_text)
    assert r.status_code == 200, r.text
    # /completions without /v1: llama-server's own format for a body naming no model (as
    # llama-server answers there), OpenAI's for an OpenAI client's (it always names one).
    r = post(tiny_server, "/completions", {"prompt": "I believe", "n_predict": 2})
    assert r.status_code == 200 and r.json()["stop"] is True and "content" in r.json(), r.text
    r = post(tiny_server, "/completions", {"model": "x", "prompt": "I believe", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
    # The Ollama runner's format is unchanged.
    r = post(tiny_server, "/completion", {"prompt": "hi", "options": {"num_predict": 2}})
    assert r.headers["content-type"] == "application/x-ndjson"
    assert json.loads(r.text.splitlines()[-1])["done"] is True
    for bad in (
        {"prompt": "hi", "n_predict": 2, "n_probs": 21},
        {"prompt": "hi", "n_predict": 2, "grammar": 'root ::= "a"', "json_schema": {}},
        {"prompt": ["a", "b"], "n_predict": 2, "stream": True},
        {"prompt": "hi", "n_predict": 2, "logit_bias": 3},
        {"prompt": "hi", "n_predict": 2, "logit_bias": [[1, "x"]]},
        {"prompt": "", "n_predict": 2},
        {"prompt": "hi", "temperature": -1},
        {"prompt": "hi", "n_cmpl": 2},
        # Token ids outside the vocabulary: the client's error, not the server's.
        {"prompt": [1, 10_000_000]},
        {"prompt": [1, 2**31]},
    ):
        r = post(tiny_server, "/completion", bad)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["type"] == "invalid_request", r.text


def llamacpp_metrics(server: Server) -> dict[str, float]:
    """llama-server's families on ``/metrics``: unlabelled samples, each with HELP and TYPE."""
    text = httpx.get(f"{server.url}/metrics").text
    values = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:"):
            name, value = line.split(" ")
            assert "{" not in name, line
            assert f"# TYPE {name} " in text and f"# HELP {name} " in text, name
            values[name.removeprefix("llamacpp:")] = float(value)
    return values


def test_llama_server_s_metrics_count_what_the_answers_say(tiny_server: Server) -> None:
    before = llamacpp_metrics(tiny_server)
    timings = []
    for n in (1, 5):
        body = {"prompt": "the quick brown fox", "n_predict": n, "temperature": 0}
        timings.append(post(tiny_server, "/completion", body).json()["timings"])
    after = llamacpp_metrics(tiny_server)

    def grew(name: str) -> float:
        return after[name] - before[name]

    assert grew("prompt_tokens_total") == sum(t["prompt_n"] for t in timings)
    assert grew("prompt_tokens_cached_total") == sum(t["cache_n"] for t in timings)
    assert grew("tokens_predicted_total") == 6
    assert grew("n_decode_total") >= 5
    assert after["requests_processing"] == 0
    # The first token comes with the prompt's decode: no generation rate for one token.
    assert timings[0]["predicted_per_second"] == 0.0
    assert timings[1]["predicted_per_second"] > 0
