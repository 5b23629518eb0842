"""Hostile input on every route of the three dialects (native, OpenAI /v1, Ollama /api).

Property-based (hypothesis): each POST route gets bodies that mix valid requests with hostile
values (wrong JSON types, huge and negative numbers, 2**63 and friends, empty and very long
strings, deeply nested JSON, unknown fields, bytes that are not JSON or not UTF-8, huge stop
lists, out-of-range logit_bias ids, invalid and nested grammars, extreme options, odd chat
messages). Every answer must be:

- never a 5xx, and never a hang (no answer within REQUEST_TIMEOUT s) or a crash;
- when status >= 400, JSON in the dialect's error shape (native ``{"error": {"message",
  "type"}}``, OpenAI ``{"error": {"message", "type", "param", "code"}}``, Ollama
  ``{"error": "..."}``);
- when 200 and streamed, a stream that ends properly (native NDJSON: last line ``done: true``;
  SSE: ``data: [DONE]``; Ollama: last line ``done: true``), without an error in it.

After each route's run the server must be healthy with no busy slot.

The server runs in a subprocess (``llamarunner serve``) so that a crash fails a test instead of
killing pytest; a watchdog kills it if its RSS passes RSS_LIMIT_MB, and it is restarted after
a failing test. Named hostile requests follow the property-based tests; the regression tests
(a)-(d) at the end start servers of their own.

``LLAMARUNNER_HOSTILE_EXAMPLES`` sets hypothesis' examples per route (default 120).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from helpers import WatchedServer, metric, wait_idle, wait_until
from tinymodel import FIM_TOKENS, write_tiny_model

# Hypothesis keeps a cache (and by default an example database) under ./.hypothesis; keep the
# working tree clean.
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "llamarunner-hypothesis")

EXAMPLES = int(os.environ.get("LLAMARUNNER_HOSTILE_EXAMPLES", "120"))
REQUEST_TIMEOUT = 30.0  # seconds; no answer within this is a hang
RSS_LIMIT_MB = 1024  # the watchdog kills a server past this (a failure, and it spares the host)
MODEL = "tiny"
# The shared hostile server: small slots, so that long prompts are truncated or refused and
# unbounded generations (num_predict -1 or huge) stop after ten slot contexts.
HOSTILE_FLAGS = ("--parallel", "2", "--ctx-size", "256", "--alias", MODEL)

HSETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)

pytestmark = pytest.mark.timeout(600)


# --------------------------------------------------------------------------------------------
# A server in a subprocess


class ServerDied(BaseException):
    """The server process is gone. A BaseException, so that hypothesis neither catches it nor
    shrinks (every later example would fail the same way for an unrelated reason)."""


class ServerHung(BaseException):
    """A request got no answer within REQUEST_TIMEOUT (not shrunk either: each try would cost
    the whole timeout)."""


# --------------------------------------------------------------------------------------------
# Exchanges and what every answer must look like


@dataclass
class Reply:
    status: int
    content_type: str
    body: bytes
    seconds: float


def dialect_of(path: str) -> str:
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    if path.startswith("/v1/"):
        return "openai"
    if path.startswith("/api/"):
        return "ollama"
    return "native"


def show(body: bytes | None, limit: int = 600) -> str:
    """A request or response body for a failure message, cut when long."""
    if body is None:
        return "(no body)"
    text = body[:limit].decode("utf-8", errors="backslashreplace")
    return text + (f"... ({len(body)} bytes)" if len(body) > limit else "")


def exchange(
    client: httpx.Client,
    srv: WatchedServer,
    method: str,
    path: str,
    body: bytes | None,
    timeout: float = REQUEST_TIMEOUT,
) -> Reply:
    """Sends one request and reads its whole answer within ``timeout`` (a stream too)."""
    started = time.monotonic()
    deadline = started + timeout
    what = f"{method} {path} {show(body)}"
    try:
        with client.stream(
            method,
            f"{srv.url}{path}",
            content=body,
            headers={"content-type": "application/json"} if body is not None else {},
            timeout=timeout,
        ) as r:
            chunks = []
            for chunk in r.iter_bytes():
                chunks.append(chunk)
                if time.monotonic() > deadline:
                    srv.tainted = True
                    raise ServerHung(f"the answer to {what} was still streaming after {timeout} s")
            reply = Reply(
                r.status_code,
                r.headers.get("content-type", ""),
                b"".join(chunks),
                time.monotonic() - started,
            )
    except httpx.TimeoutException as e:
        srv.tainted = True
        raise ServerHung(f"no answer within {timeout} s ({e!r}) to {what}") from None
    except httpx.TransportError as e:
        if srv.died_within(5):
            raise ServerDied(f"the server died answering {what}: {srv.describe()}") from None
        raise AssertionError(f"transport error {e!r} answering {what}") from None
    if not srv.alive():
        time.sleep(0.1)
        raise ServerDied(f"the server died after answering {what}: {srv.describe()}")
    return reply


def error_shape_problem(dialect: str, data: bytes) -> str | None:
    try:
        err = json.loads(data)
    except ValueError:
        return f"the error body is not JSON: {show(data, 200)}"
    if not isinstance(err, dict) or "error" not in err:
        return f"the error body has no 'error': {show(data, 200)}"
    e = err["error"]
    if dialect == "anthropic" and err.get("type") != "error":
        return f"an Anthropic error must be {{'type': 'error', 'error': ...}}: {show(data, 200)}"
    if dialect == "ollama":
        if not isinstance(e, str) or not e:
            return f"an Ollama error must be {{'error': str}}: {show(data, 200)}"
        return None
    keys = ("message", "type", "param", "code") if dialect == "openai" else ("message", "type")
    if not isinstance(e, dict) or any(k not in e for k in keys):
        return f"a {dialect} error must be {{'error': {{{', '.join(keys)}}}}}: {show(data, 200)}"
    if not isinstance(e["message"], str) or not isinstance(e["type"], str):
        return f"error message and type must be strings: {show(data, 200)}"
    return None


def json_lines(data: bytes) -> list[Any]:
    return [json.loads(line) for line in data.decode("utf-8").split("\n") if line.strip()]


def sse_payloads(data: bytes) -> list[str]:
    return [
        line[len("data:") :].strip()
        for line in data.decode("utf-8").split("\n")
        if line.startswith("data:")
    ]


def numbers(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in v
    )


def llama_server_answer_problem(reply: Reply, want_stream: bool, what: str) -> str | None:
    """What is wrong with an answer in llama-server's native format (`/infill`, and
    `/completion` in its format): events ending with ``stop: true``, or one such object."""
    data = reply.body
    if "text/event-stream" in reply.content_type:
        events = [json.loads(p) for p in sse_payloads(data)]
        if not events or events[-1].get("stop") is not True:
            return f"the {what} stream does not end with stop:true: {show(data[-300:])}"
        if any("error" in e for e in events):
            return f"an error inside the {what} stream: {show(data[-300:])}"
        return None
    if want_stream:
        return f"stream:true answered {reply.content_type}, not SSE"
    obj = json.loads(data)
    # Several prompts: one answer each, in their order.
    answers = obj if isinstance(obj, list) else [obj]
    if isinstance(obj, list) and [a.get("index") for a in obj] != list(range(len(obj))):
        return f"several answers out of order: {show(data)}"
    for a in answers:
        if a.get("stop") is not True or not isinstance(a.get("content"), str):
            return f"not a {what} answer: {show(data)}"
    return None


def stream_problem(path: str, request: Any, reply: Reply) -> str | None:
    """What is wrong with a 200 answer, or None."""
    data = reply.body
    want_stream = isinstance(request, dict) and request.get("stream") is True
    try:
        if path == "/completion" and "application/x-ndjson" not in reply.content_type:
            # llama-server's format (dialects/llama_server/).
            return llama_server_answer_problem(reply, want_stream, "completion")
        if path == "/completion":
            lines = json_lines(data)
            if not lines:
                return "an empty NDJSON stream"
            if any(m.get("done") for m in lines[:-1]) or lines[-1].get("done") is not True:
                return f"the NDJSON stream does not end with one done:true line: {lines[-1]}"
            if "error" in lines[-1]:
                return f"the stream ended with an error: {lines[-1]}"
            return None
        if path == "/infill":
            return llama_server_answer_problem(reply, want_stream, "infill")
        if path in ("/v1/chat/completions", "/v1/completions"):
            if "text/event-stream" in reply.content_type:
                payloads = sse_payloads(data)
                if not payloads or payloads[-1] != "[DONE]":
                    return f"the SSE stream does not end with data: [DONE]: {show(data[-300:])}"
                for p in payloads[:-1]:
                    if "error" in json.loads(p):
                        return f"an error inside the SSE stream: {p[:300]}"
                return None
            if want_stream:
                return f"stream:true answered {reply.content_type}, not SSE"
            obj = json.loads(data)
            choices = obj.get("choices")
            n = request.get("n") if isinstance(request, dict) else None
            want = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
            if not isinstance(choices, list) or len(choices) != want or "usage" not in obj:
                return f"not a completion object with {want} choices: {show(data)}"
            return None
        if path == "/v1/responses":
            if "text/event-stream" in reply.content_type:
                events = [json.loads(p) for p in sse_payloads(data)]
                kinds = [e.get("type") for e in events]
                ends = ("response.completed", "response.incomplete")
                if not kinds or kinds[0] != "response.created" or kinds[-1] not in ends:
                    return f"the event stream is not response.created ... completed: {kinds}"
                return None
            if want_stream:
                return f"stream:true answered {reply.content_type}, not SSE"
            obj = json.loads(data)
            if obj.get("object") != "response" or obj.get("status") not in (
                "completed",
                "incomplete",
            ):
                return f"not a finished response object: {show(data)}"
            return None
        if path == "/v1/messages":
            if "text/event-stream" in reply.content_type:
                events = [json.loads(p) for p in sse_payloads(data)]
                kinds = [e.get("type") for e in events]
                if not kinds or kinds[0] != "message_start" or kinds[-1] != "message_stop":
                    return f"the event stream is not message_start ... message_stop: {kinds}"
                if "error" in kinds:
                    return f"an error inside the event stream: {show(data[-300:])}"
                return None
            if want_stream:
                return f"stream:true answered {reply.content_type}, not SSE"
            obj = json.loads(data)
            if obj.get("type") != "message" or not isinstance(obj.get("content"), list):
                return f"not a message object: {show(data)}"
            return None
        if path in ("/api/generate", "/api/chat"):
            lines = json_lines(data)
            if not lines:
                return "an empty answer"
            if any("error" in m for m in lines):
                return f"an error inside the stream: {next(m for m in lines if 'error' in m)}"
            if any(m.get("done") for m in lines[:-1]) or lines[-1].get("done") is not True:
                return f"the Ollama stream does not end with done:true: {lines[-1]}"
            return None
        obj = json.loads(data)
        if path == "/embedding":
            ok = numbers(obj.get("embedding")) and len(obj["embedding"]) > 0
        elif path == "/v1/embeddings":
            ok = all(
                numbers(d.get("embedding")) or isinstance(d.get("embedding"), str)
                for d in obj.get("data", [None])
            )
        elif path == "/api/embed":
            ok = isinstance(obj.get("embeddings"), list) and all(
                numbers(v) for v in obj["embeddings"]
            )
        elif path == "/api/embeddings":
            ok = numbers(obj.get("embedding"))
        elif path == "/v1/messages/count_tokens" or path.endswith("/input_tokens"):
            ok = isinstance(obj.get("input_tokens"), int)
        elif path == "/apply-template":
            ok = isinstance(obj.get("prompt"), str)
        elif path == "/tokenize":
            ok = isinstance(obj.get("tokens"), list) and all(
                isinstance(t, int) or (isinstance(t, dict) and isinstance(t.get("id"), int))
                for t in obj["tokens"]
            )
        elif path == "/detokenize":
            ok = isinstance(obj.get("content"), str)
        else:
            ok = isinstance(obj, dict)
        return None if ok else f"unexpected 200 body: {show(data)}"
    except (ValueError, AttributeError, TypeError) as e:
        return f"a 200 body that does not parse ({e!r}): {show(data)}"


def check(path: str, request_body: bytes | None, reply: Reply) -> list[str]:
    """Every problem with one answer."""
    problems = []
    if reply.status >= 500:
        problems.append(f"status {reply.status}")
    if reply.status >= 400:
        p = error_shape_problem(dialect_of(path), reply.body)
        if p:
            problems.append(p)
    elif reply.status == 200:
        try:
            request = json.loads(request_body) if request_body else None
        except (ValueError, RecursionError):  # not JSON, or nested too deep for Python
            request = None
        p = stream_problem(path, request, reply)
        if p:
            problems.append(p)
    else:
        problems.append(f"unexpected status {reply.status}")
    return problems


# Every failure seen in this module (hypothesis' final, shrunk ones), printed at its end
# (pytest -s) so that one run lists them all.
FAILURES: list[str] = []


# Statuses seen per route, printed at the module's end: what the bodies exercised.
STATUSES: dict[str, Counter[int]] = defaultdict(Counter)


def record(where: str, e: BaseException) -> None:
    for sub in getattr(e, "exceptions", None) or [e]:
        FAILURES.append(f"{where}: {sub}")


def assert_good(path: str, body: bytes | None, reply: Reply, method: str = "POST") -> None:
    problems = check(path, body, reply)
    if problems:
        raise AssertionError(
            f"{method} {path} -> {reply.status} in {reply.seconds:.2f} s: {'; '.join(problems)}\n"
            f"  request: {show(body)}\n  response: {show(reply.body)}"
        )


# --------------------------------------------------------------------------------------------
# Strategies

WORDS = ["the", "a", "hello", "world", "cat", "dog", "is", "and", "of", "to"]
PROMPTS = st.one_of(
    st.lists(st.sampled_from(WORDS), min_size=1, max_size=12).map(" ".join),
    st.text(min_size=1, max_size=30),
)
INTS = st.one_of(
    st.integers(-3, 8),
    st.sampled_from(
        [
            2**31 - 1,
            2**31,
            -(2**31),
            -(2**31) - 1,
            2**32,
            2**53 + 1,
            2**63 - 1,
            2**63,
            2**64,
            -(2**63),
            -(2**63) - 1,
            10**40,
        ]
    ),
    st.integers(),
)
FLOATS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(
        [0.0, -0.0, 5e-324, 1e-45, 0.5, 1.5, 2.0000001, -2.0000001, 100.00001, 3.4e38, 1e39, 1e308]
    ),
)
LONG_TEXT = st.builds(
    lambda s, n: s * n,
    st.sampled_from(
        ["a", "hello ", "é", "🦙", "\x00", "<s>", "</s>", "\ufffd", "\ud800", "\n", "{{ x }}"]
    ),
    # Up to ~64k tokens: long enough to be truncated or refused, short enough to tokenize in
    # about a second (test_oversized_prompts_are_refused_quickly covers megabytes).
    st.integers(1, 8000),
)
STRINGS = st.one_of(
    st.just(""),
    st.text(max_size=40),
    LONG_TEXT,
    st.sampled_from(["NaN", "Infinity", "-1", "null", "{}", MODEL, "json", 'root ::= "a"']),
)
JSON_ANY = st.recursive(
    st.none() | st.booleans() | INTS | FLOATS | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=8,
)
HOSTILE = st.one_of(st.none(), st.booleans(), INTS, FLOATS, STRINGS, JSON_ANY)


def either(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's valid values, often, else any hostile value."""
    return st.one_of(valid, valid, HOSTILE)


SMALL_N = st.integers(0, 4)
# One prompt as llama-server's /completion takes it: a text, token ids (texts among them),
# or {"prompt_string": ...} (with multimodal_data, which is refused).
LLAMA_SERVER_PROMPT = st.one_of(
    PROMPTS,
    st.lists(st.integers(-2, 40_000), min_size=1, max_size=6),
    st.lists(st.one_of(st.integers(-2, 300), PROMPTS), min_size=1, max_size=6),
    st.fixed_dictionaries(
        {"prompt_string": PROMPTS},
        optional={"multimodal_data": st.lists(st.text(max_size=8), max_size=2)},
    ),
)
BOOLS = either(st.booleans())
STOP = st.one_of(
    st.text(max_size=3),
    st.lists(st.text(max_size=4), max_size=6),
    st.integers(0, 20000).map(lambda n: [f"stop{i}" for i in range(n)]),
    st.lists(HOSTILE, max_size=3),
)
LOGIT_BIAS = st.one_of(
    st.dictionaries(
        st.one_of(
            st.integers(-3, 300).map(str),
            st.sampled_from(
                [
                    "99999999",
                    "-1",
                    "2147483647",
                    "2147483648",
                    "-2147483649",
                    "1e3",
                    "0x10",
                    " 5",
                    "",
                    "abc",
                    "9" * 40,
                ]
            ),
        ),
        st.one_of(st.floats(-100, 100), FLOATS, HOSTILE),
        max_size=5,
    ),
    st.integers(0, 50000).map(lambda n: {str(i): 1.0 for i in range(n)}),
    HOSTILE,
)


def nested_parens(depth: int) -> str:
    return "root ::= " + "(" * depth + '"a"' + ")" * depth


def rule_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"'


GRAMMARS = st.one_of(
    st.sampled_from(
        [
            'root ::= "a"',
            "root ::= [a-z]+",
            'root ::= "a" root',
            "root ::= root",
            'root ::= root "a"',
            "root ::=",
            "",
            " ",
            "root",
            "root ::= (",
            'root ::= ")"',
            "root ::= [",
            'root ::= "\\',
            "root ::= x",
            'x ::= "a"',
            'root ::= ("")*',
            'root ::= ("a"?)*',
            'root ::= ("a"*)*',
            "root ::= [^\\x00-\\xff]",
            'root ::= "\\x{ffffffff}"',
            'root ::= "\\U00110000"',
            'root ::= "a"{2,1}',
            'root ::= "a"{1000}',
            'root ::= "a"{0}',
            'root ::= "\\u0000"',
            "root ::= [\\x00]",
            'root ::= "a" | ',
            '# only a comment\nroot ::= "a" # trailing',
        ]
    ),
    st.integers(1, 64).map(nested_parens),
    st.integers(65, 400).map(nested_parens),
    st.integers(1, 3000).map(rule_chain),
    st.text(max_size=40),
    HOSTILE,
)
LEAF_SCHEMAS = st.sampled_from(
    [
        {"type": "string"},
        {"type": "integer"},
        {"type": "number"},
        {"type": "boolean"},
        {"type": "null"},
        {},
        {"type": "string", "pattern": "^[a-z]+$"},
        {"type": "string", "pattern": "(((("},
        {"type": "string", "minLength": 2, "maxLength": 1},
        {"type": "string", "maxLength": 2**40},
        {"type": "integer", "minimum": 5, "maximum": 1},
        {"enum": [1, "a", None]},
        {"enum": []},
        {"const": "x"},
        {"type": "bogus"},
        {"type": 5},
        {"$ref": "#"},
        {"$ref": "#/nope"},
        {"$ref": "http://example.com/schema"},
        {"type": "string", "format": "date"},
        {"type": ["string", "null"]},
    ]
)
SCHEMAS = st.recursive(
    LEAF_SCHEMAS,
    lambda c: st.one_of(
        st.dictionaries(st.text(max_size=5), c, max_size=3).map(
            lambda p: {"type": "object", "properties": p, "required": list(p)}
        ),
        c.map(lambda i: {"type": "array", "items": i}),
        st.builds(
            lambda i, lo, hi: {"type": "array", "items": i, "minItems": lo, "maxItems": hi},
            c,
            INTS,
            INTS,
        ),
        st.lists(c, max_size=3).map(lambda xs: {"anyOf": xs}),
        st.lists(c, max_size=3).map(lambda xs: {"allOf": xs}),
        c.map(lambda x: {"type": "object", "additionalProperties": x}),
    ),
    max_leaves=6,
)


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


FORMATS = st.one_of(
    st.sampled_from(["json", "", "JSON", "xml", None]),
    SCHEMAS,
    st.integers(1, 60).map(nested_schema),
    HOSTILE,
)
RESPONSE_FORMATS = st.one_of(
    st.just({"type": "json_object"}),
    st.just({"type": "text"}),
    SCHEMAS.map(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}),
    # llama-server's shapes: a schema beside json_object, or directly under json_schema.
    st.builds(lambda s: {"type": "json_object", "schema": s}, st.one_of(SCHEMAS, HOSTILE)),
    st.builds(lambda s: {"type": "json_schema", "schema": s}, st.one_of(SCHEMAS, HOSTILE)),
    st.builds(lambda t: {"type": t}, HOSTILE),
    HOSTILE,
)
ROLES = st.one_of(
    st.sampled_from(["system", "user", "assistant", "tool", "developer", "function", ""]),
    st.sampled_from([" ", "USER", "ipython", "<|im_start|>"]),
    st.text(max_size=10),
    HOSTILE,
)
PARTS = st.one_of(
    PROMPTS.map(lambda t: {"type": "text", "text": t}),
    st.sampled_from(
        [
            {"type": "image_url", "image_url": {"url": "data:,"}},
            {"type": "text"},
            {"type": "text", "text": 5},
            {"type": 5},
            {"text": "no type"},
        ]
    ),
    HOSTILE,
)
CONTENTS = st.one_of(PROMPTS, STRINGS, st.none(), st.lists(PARTS, max_size=3), HOSTILE)
MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {"role": ROLES, "content": CONTENTS},
        optional={
            "name": STRINGS,
            "tool_calls": HOSTILE,
            "images": either(st.lists(st.text(max_size=5), max_size=2)),
            "tool_call_id": st.text(max_size=5),
            "thinking": PROMPTS,
        },
    ),
    HOSTILE,
)
VALID_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system"]), "content": PROMPTS}
    ),
    min_size=1,
    max_size=3,
)
MESSAGES = st.one_of(
    VALID_MESSAGES,
    st.lists(MESSAGE, max_size=5),
    st.integers(0, 5000).map(
        lambda n: [{"role": ("user", "assistant")[i % 2], "content": "hi"} for i in range(n)]
    ),
    HOSTILE,
)
MODELS = either(st.sampled_from([MODEL, f"{MODEL}:latest", "tiny-model.gguf", "", "gpt-4o"]))

# llama-server's samplers, in every dialect (DRY's window and breakers are where llama.cpp
# allocates and where the bindings panic on a NUL).
SAMPLER_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "dry_multiplier": either(st.floats(0, 5)),
    "dry_base": either(st.floats(0, 3)),
    "dry_allowed_length": INTS,
    "dry_penalty_last_n": INTS,
    "dry_sequence_breakers": either(
        st.lists(st.one_of(st.text(max_size=5), st.just("a\u0000b")), max_size=20)
    ),
    "xtc_probability": either(st.floats(0, 1)),
    "xtc_threshold": either(st.floats(0, 1)),
    "top_n_sigma": either(st.floats(-1, 5)),
    "dynatemp_range": either(st.floats(0, 2)),
    "dynatemp_exponent": either(st.floats(0, 2)),
}
OPTION_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "num_predict": either(SMALL_N),
    "num_keep": either(st.integers(-2, 10)),
    "temperature": either(st.floats(0, 2)),
    "top_k": either(st.integers(0, 100)),
    "top_p": either(st.floats(0, 1)),
    "min_p": either(st.floats(0, 1)),
    "typical_p": either(st.floats(0, 1)),
    "repeat_last_n": st.one_of(
        st.integers(-2, 64), st.sampled_from([2147483647, 2**31, 100000, -(2**31)]), HOSTILE
    ),
    "repeat_penalty": either(st.floats(0, 2)),
    "presence_penalty": either(st.floats(-2, 2)),
    "frequency_penalty": either(st.floats(-2, 2)),
    "mirostat": either(st.integers(-1, 3)),
    "mirostat_tau": either(st.floats(0, 10)),
    "mirostat_eta": either(st.floats(0, 1)),
    "seed": INTS,
    "stop": STOP,
    "ignore_eos": BOOLS,
    # Ollama options this runner does not use: they must be ignored, whatever their value.
    "num_ctx": INTS,
    "num_batch": INTS,
    "num_gpu": INTS,
    "num_thread": INTS,
    "use_mmap": HOSTILE,
    "tfs_z": FLOATS,
    "penalize_newline": HOSTILE,
    **SAMPLER_FIELDS,
}
OPTIONS = st.one_of(
    st.fixed_dictionaries(
        {"num_predict": SMALL_N},
        optional={k: v for k, v in OPTION_FIELDS.items() if k != "num_predict"},
    ),
    HOSTILE,
)

OPENAI_COMMON: dict[str, st.SearchStrategy[Any]] = {
    "model": MODELS,
    "stream": BOOLS,
    "deterministic": BOOLS,
    "stream_options": either(st.fixed_dictionaries({"include_usage": BOOLS})),
    "max_tokens": either(SMALL_N),
    "max_completion_tokens": either(SMALL_N),
    "temperature": either(st.floats(0, 2)),
    "top_p": either(st.floats(0, 1)),
    "stop": STOP,
    "seed": INTS,
    "presence_penalty": either(st.floats(-2, 2)),
    "frequency_penalty": either(st.floats(-2, 2)),
    "logit_bias": LOGIT_BIAS,
    "n": either(st.integers(0, 3)),
    "best_of": either(st.integers(0, 3)),
    "response_format": RESPONSE_FORMATS,
    "logprobs": either(st.one_of(st.booleans(), st.integers(0, 21))),
    "top_logprobs": either(st.integers(0, 21)),
    "tools": either(st.just([{"type": "function", "function": {"name": "f"}}])),
    "top_k": OPTION_FIELDS["top_k"],
    "min_p": OPTION_FIELDS["min_p"],
    "typical_p": OPTION_FIELDS["typical_p"],
    "repeat_penalty": OPTION_FIELDS["repeat_penalty"],
    "repeat_last_n": OPTION_FIELDS["repeat_last_n"],
    "mirostat": OPTION_FIELDS["mirostat"],
    "mirostat_tau": OPTION_FIELDS["mirostat_tau"],
    "mirostat_eta": OPTION_FIELDS["mirostat_eta"],
    "ignore_eos": BOOLS,
    "grammar": GRAMMARS,
    # llama-server's top-level schema, progress reports and template switches.
    "json_schema": either(st.one_of(SCHEMAS, HOSTILE)),
    "return_progress": BOOLS,
    # llama-server's debug object (the answer in its format, the rendered prompt).
    "verbose": BOOLS,
    "add_generation_prompt": BOOLS,
    "continue_final_message": BOOLS,
    "user": STRINGS,
    **SAMPLER_FIELDS,
}
ANTHROPIC_BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": either(PROMPTS)}),
    st.fixed_dictionaries(
        {
            "type": st.just("image"),
            "source": either(
                st.fixed_dictionaries(
                    {
                        "type": st.sampled_from(["base64", "url", "file"]),
                        "media_type": either(st.sampled_from(["image/png", "text/plain"])),
                        "data": either(st.text(max_size=12)),
                        "url": STRINGS,
                    }
                )
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": either(st.sampled_from(["toolu_1", ""])),
            "name": either(st.sampled_from(["f", "get_weather", ""])),
            "input": either(st.dictionaries(st.text(max_size=4), HOSTILE, max_size=3)),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_result"),
            "tool_use_id": either(st.just("toolu_1")),
            "content": either(
                st.one_of(
                    PROMPTS,
                    st.lists(
                        st.fixed_dictionaries({"type": st.just("text"), "text": PROMPTS}),
                        max_size=2,
                    ),
                )
            ),
            "is_error": BOOLS,
        }
    ),
    st.fixed_dictionaries(
        {
            "type": either(st.sampled_from(["thinking", "document", "redacted_thinking"])),
            "thinking": STRINGS,
        }
    ),
    HOSTILE,
)
ANTHROPIC_MESSAGES = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {
                "role": either(st.sampled_from(["user", "assistant", "system"])),
                "content": st.one_of(PROMPTS, st.lists(ANTHROPIC_BLOCK, max_size=4), HOSTILE),
            }
        ),
        max_size=4,
    ),
    HOSTILE,
)
ANTHROPIC_TOOL = st.fixed_dictionaries(
    {
        "name": either(st.sampled_from(["f", "get_weather", "", "a b"])),
        "input_schema": either(
            st.sampled_from(
                [{"type": "object"}, {"type": "object", "properties": {"a": {"type": "integer"}}}]
            )
        ),
    },
    optional={
        "type": either(st.sampled_from(["custom", "web_search_20250305"])),
        "description": STRINGS,
    },
)
ANTHROPIC_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": MODELS,
    "messages": ANTHROPIC_MESSAGES,
    "system": either(st.one_of(PROMPTS, st.lists(ANTHROPIC_BLOCK, max_size=2))),
    "max_tokens": either(SMALL_N),
    "stop_sequences": STOP,
    "stream": BOOLS,
    "deterministic": BOOLS,
    "temperature": either(st.floats(0, 1.5)),
    "top_p": either(st.floats(0, 1)),
    "top_k": either(st.integers(-1, 100)),
    "tools": either(st.lists(ANTHROPIC_TOOL, max_size=3)),
    "tool_choice": either(
        st.fixed_dictionaries(
            {"type": either(st.sampled_from(["auto", "any", "tool", "none"]))},
            optional={"name": either(st.just("f")), "disable_parallel_tool_use": BOOLS},
        )
    ),
    "thinking": either(
        st.fixed_dictionaries(
            {"type": either(st.sampled_from(["enabled", "disabled"]))},
            optional={"budget_tokens": either(st.integers(0, 5000))},
        )
    ),
    "metadata": HOSTILE,
    "ignore_eos": BOOLS,
    **SAMPLER_FIELDS,
}
RESPONSES_PART = st.one_of(
    st.fixed_dictionaries(
        {"type": either(st.sampled_from(["input_text", "output_text"])), "text": either(PROMPTS)}
    ),
    st.fixed_dictionaries(
        {"type": st.just("input_image"), "image_url": either(st.sampled_from(["data:,", "x"]))}
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["input_file", "refusal"]), "file_id": STRINGS}),
    HOSTILE,
)
RESPONSES_ITEM = st.one_of(
    st.fixed_dictionaries(
        {
            "role": either(st.sampled_from(["user", "assistant", "system", "developer", "tool"])),
            "content": st.one_of(PROMPTS, st.lists(RESPONSES_PART, max_size=3), HOSTILE),
        },
        optional={"type": st.just("message")},
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": either(st.just("call_1")),
            "name": either(st.just("f")),
            "arguments": either(st.sampled_from(["{}", "{", '{"a": 1}'])),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call_output"),
            "call_id": either(st.just("call_1")),
            "output": either(PROMPTS),
        }
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference"])}),
    HOSTILE,
)
RESPONSES_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": MODELS,
    "input": either(st.one_of(PROMPTS, st.lists(RESPONSES_ITEM, max_size=4))),
    "instructions": STRINGS,
    "previous_response_id": either(st.sampled_from(["resp_nope", ""])),
    "store": BOOLS,
    "stream": BOOLS,
    "deterministic": BOOLS,
    "max_output_tokens": either(SMALL_N),
    "temperature": either(st.floats(0, 2.5)),
    "top_p": either(st.floats(0, 1)),
    "tools": either(
        st.lists(
            st.fixed_dictionaries(
                {
                    "type": either(st.sampled_from(["function", "web_search"])),
                    "name": either(st.sampled_from(["f", "", "a b"])),
                },
                optional={"parameters": either(st.just({"type": "object"}))},
            ),
            max_size=3,
        )
    ),
    "tool_choice": either(
        st.one_of(
            st.sampled_from(["auto", "none", "required"]),
            st.fixed_dictionaries({"type": st.just("function"), "name": either(st.just("f"))}),
        )
    ),
    "parallel_tool_calls": BOOLS,
    "text": either(
        st.fixed_dictionaries(
            {
                "format": either(
                    st.sampled_from(
                        [
                            {"type": "text"},
                            {"type": "json_object"},
                            {"type": "json_schema", "name": "x", "schema": {"type": "object"}},
                            {"type": "json_schema"},
                        ]
                    )
                )
            }
        )
    ),
    "reasoning": either(
        st.fixed_dictionaries({"effort": either(st.sampled_from(["none", "high"]))})
    ),
    "truncation": either(st.sampled_from(["auto", "disabled"])),
    "metadata": HOSTILE,
    "ignore_eos": BOOLS,
    "return_progress": BOOLS,
    "timings_per_token": BOOLS,
    **SAMPLER_FIELDS,
}
ANTHROPIC_VALID_MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": PROMPTS}),
    min_size=1,
    max_size=3,
)
OLLAMA_COMMON: dict[str, st.SearchStrategy[Any]] = {
    "model": MODELS,
    "stream": BOOLS,
    "deterministic": BOOLS,
    "format": FORMATS,
    "options": OPTIONS,
    "think": either(st.sampled_from([False, True, "high"])),
    "keep_alive": either(st.sampled_from(["5m", 0, -1, "forever", "-1ns"])),
}


@dataclass(frozen=True)
class Route:
    path: str
    base: st.SearchStrategy[dict[str, Any]]
    fields: dict[str, st.SearchStrategy[Any]]
    has_options: bool = False
    label: str = ""
    """The route's name in the tests when one path has two formats (default: the path)."""


def small_options() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {"num_predict": st.integers(1, 4)},
        optional={"temperature": st.sampled_from([0, 0.7]), "ignore_eos": st.booleans()},
    )


ROUTES = {
    r.label or r.path: r
    for r in [
        Route(
            "/completion",
            st.one_of(
                st.fixed_dictionaries({"prompt": PROMPTS, "options": small_options()}),
                st.fixed_dictionaries({"messages": VALID_MESSAGES, "options": small_options()}),
            ),
            {
                "prompt": either(PROMPTS),
                "Prompt": either(PROMPTS),
                "messages": MESSAGES,
                "options": OPTIONS,
                "Options": OPTIONS,
                "grammar": GRAMMARS,
                "format": FORMATS,
                "images": either(st.lists(st.text(max_size=5), max_size=2)),
                "shift": BOOLS,
                "truncate": BOOLS,
                # The hostile server has no adapters: any id is refused, [] and null are fine.
                "lora": either(
                    st.lists(
                        st.fixed_dictionaries(
                            {"id": st.integers(-1, 2), "scale": st.floats(-20, 20)}
                        ),
                        max_size=2,
                    )
                ),
            },
            has_options=True,
        ),
        Route(
            "/completion",
            st.fixed_dictionaries({"prompt": PROMPTS, "n_predict": st.integers(1, 4)}),
            {
                **{
                    k: v
                    for k, v in OPTION_FIELDS.items()
                    if k not in ("num_predict", "lora", "speculative")
                },
                "prompt": either(
                    st.one_of(
                        LLAMA_SERVER_PROMPT,
                        # Several prompts, answered together.
                        st.lists(LLAMA_SERVER_PROMPT, min_size=1, max_size=10),
                    )
                ),
                "n_predict": either(SMALL_N),
                "stream": BOOLS,
                "deterministic": BOOLS,
                "grammar": GRAMMARS,
                "json_schema": either(SCHEMAS),
                "n_probs": either(SMALL_N),
                "post_sampling_probs": BOOLS,
                "return_tokens": BOOLS,
                "cache_prompt": BOOLS,
                "return_progress": BOOLS,
                "timings_per_token": BOOLS,
                "n_cmpl": either(st.integers(-1, 3)),
                "logit_bias": either(
                    st.one_of(
                        st.lists(
                            st.tuples(
                                st.one_of(st.integers(-2, 40_000), STRINGS),
                                st.one_of(st.just(False), st.floats(-200, 200), HOSTILE),
                            ).map(list),
                            max_size=4,
                        ),
                        st.dictionaries(
                            st.one_of(STRINGS, st.integers(-2, 40_000).map(str)),
                            st.one_of(st.just(False), st.floats(-200, 200)),
                            max_size=4,
                        ),
                    )
                ),
            },
            label="/completion (llama-server's format)",
        ),
        Route(
            "/infill",
            st.fixed_dictionaries(
                {"input_prefix": PROMPTS, "input_suffix": PROMPTS, "n_predict": st.integers(1, 4)}
            ),
            {
                **{k: v for k, v in OPTION_FIELDS.items() if k != "num_predict"},
                "input_prefix": either(st.one_of(PROMPTS, LONG_TEXT)),
                "input_suffix": either(st.one_of(PROMPTS, LONG_TEXT)),
                "prompt": either(st.one_of(PROMPTS, LONG_TEXT)),
                "input_extra": either(
                    st.lists(
                        st.one_of(
                            st.fixed_dictionaries(
                                {"text": STRINGS}, optional={"filename": either(STRINGS)}
                            ),
                            HOSTILE,
                        ),
                        max_size=4,
                    )
                ),
                "n_predict": SMALL_N,
                "stream": BOOLS,
                "deterministic": BOOLS,
                "cache_prompt": BOOLS,
                "grammar": GRAMMARS,
                "t_max_prompt_ms": INTS,
                "samplers": HOSTILE,
            },
        ),
        Route(
            "/embedding",
            st.fixed_dictionaries({"content": PROMPTS}),
            {"content": either(PROMPTS), "Content": either(PROMPTS), "truncate": BOOLS},
        ),
        Route(
            "/v1/rerank",
            st.fixed_dictionaries(
                {"query": PROMPTS, "documents": st.lists(PROMPTS, min_size=1, max_size=3)}
            ),
            {
                "query": either(PROMPTS),
                "documents": either(
                    st.lists(
                        st.one_of(PROMPTS, st.fixed_dictionaries({"text": PROMPTS})), max_size=4
                    )
                ),
                "texts": either(st.lists(PROMPTS, max_size=3)),
                "top_n": either(INTS),
                "truncate": BOOLS,
                "return_documents": BOOLS,
            },
        ),
        Route(
            "/apply-template",
            st.fixed_dictionaries({"messages": VALID_MESSAGES}),
            {"messages": MESSAGES, "add_generation_prompt": BOOLS},
        ),
        Route(
            "/tokenize",
            st.fixed_dictionaries({"content": PROMPTS}),
            {
                "content": either(st.one_of(PROMPTS, LONG_TEXT)),
                "add_special": BOOLS,
                "with_pieces": BOOLS,
            },
        ),
        Route(
            "/detokenize",
            st.fixed_dictionaries({"tokens": st.lists(st.integers(0, 268), max_size=40)}),
            {"tokens": either(st.lists(INTS, max_size=40))},
        ),
        Route(
            "/v1/chat/completions",
            st.fixed_dictionaries(
                {
                    "model": st.just(MODEL),
                    "messages": VALID_MESSAGES,
                    "max_tokens": st.integers(1, 4),
                    "stream": st.booleans(),
                }
            ),
            {**OPENAI_COMMON, "messages": MESSAGES},
        ),
        Route(
            "/v1/completions",
            st.fixed_dictionaries(
                {
                    "model": st.just(MODEL),
                    "prompt": PROMPTS,
                    "max_tokens": st.integers(1, 4),
                    "stream": st.booleans(),
                }
            ),
            {
                **OPENAI_COMMON,
                "prompt": either(st.one_of(PROMPTS, st.lists(PROMPTS, max_size=3))),
                "echo": BOOLS,
                "suffix": STRINGS,
            },
        ),
        Route(
            "/v1/embeddings",
            st.fixed_dictionaries({"model": st.just(MODEL), "input": PROMPTS}),
            {
                "model": MODELS,
                "input": either(
                    st.one_of(
                        PROMPTS,
                        st.lists(PROMPTS, max_size=8),
                        st.lists(st.integers(0, 300), max_size=5),
                        # Token ids of any size and sign, and strings mixed with id arrays
                        # (OpenAI's and llama-server's shapes), nested where they may not be.
                        st.lists(INTS, min_size=1, max_size=5),
                        st.lists(
                            st.one_of(PROMPTS, st.lists(INTS, max_size=5), HOSTILE),
                            max_size=4,
                        ),
                    )
                ),
                "encoding_format": either(st.sampled_from(["float", "base64", "", "hex"])),
                "dimensions": either(st.integers(0, 128)),
                "user": STRINGS,
            },
        ),
        Route(
            "/v1/responses",
            st.fixed_dictionaries(
                {
                    "model": st.just(MODEL),
                    "input": st.one_of(PROMPTS, ANTHROPIC_VALID_MESSAGES),
                    "max_output_tokens": st.integers(1, 4),
                    "stream": st.booleans(),
                }
            ),
            RESPONSES_FIELDS,
        ),
        Route(
            "/v1/messages",
            st.fixed_dictionaries(
                {
                    "model": st.just(MODEL),
                    "messages": ANTHROPIC_VALID_MESSAGES,
                    "max_tokens": st.integers(1, 4),
                    "stream": st.booleans(),
                }
            ),
            ANTHROPIC_FIELDS,
        ),
        Route(
            "/v1/messages/count_tokens",
            st.fixed_dictionaries({"model": st.just(MODEL), "messages": ANTHROPIC_VALID_MESSAGES}),
            ANTHROPIC_FIELDS,
        ),
        Route(
            "/api/generate",
            st.fixed_dictionaries(
                {
                    "model": st.just(MODEL),
                    "prompt": PROMPTS,
                    "options": small_options(),
                    "stream": st.booleans(),
                }
            ),
            {
                **OLLAMA_COMMON,
                "prompt": either(PROMPTS),
                "system": STRINGS,
                "suffix": STRINGS,
                "template": STRINGS,
                "raw": BOOLS,
                "images": either(st.lists(st.text(max_size=5), max_size=2)),
                "context": either(st.lists(st.integers(0, 300), max_size=5)),
            },
            has_options=True,
        ),
        Route(
            "/api/chat",
            st.fixed_dictionaries(
                {
                    "model": st.just(MODEL),
                    "messages": VALID_MESSAGES,
                    "options": small_options(),
                    "stream": st.booleans(),
                }
            ),
            {
                **OLLAMA_COMMON,
                "messages": MESSAGES,
                "tools": either(st.just([{"type": "function", "function": {"name": "f"}}])),
            },
            has_options=True,
        ),
        Route(
            "/api/embed",
            st.fixed_dictionaries({"model": st.just(MODEL), "input": PROMPTS}),
            {
                "model": MODELS,
                "input": either(st.one_of(PROMPTS, st.lists(PROMPTS, max_size=8))),
                "truncate": BOOLS,
                "dimensions": either(st.integers(0, 128)),
                "options": OPTIONS,
                "keep_alive": HOSTILE,
            },
        ),
        Route(
            "/api/embeddings",
            st.fixed_dictionaries({"model": st.just(MODEL), "prompt": PROMPTS}),
            {"model": MODELS, "prompt": either(PROMPTS), "options": OPTIONS},
        ),
        Route(
            "/api/show",
            st.fixed_dictionaries({"model": st.just(MODEL)}),
            {"model": MODELS, "name": MODELS, "verbose": BOOLS},
        ),
    ]
}
# The token counts of llama-server (and OpenAI's Responses) take the generation's body.
for _generating, _counting in [
    ("/v1/chat/completions", "/v1/chat/completions/input_tokens"),
    ("/v1/responses", "/v1/responses/input_tokens"),
]:
    ROUTES[_counting] = dataclasses.replace(ROUTES[_generating], path=_counting)


def raw_variants(valid: bytes) -> st.SearchStrategy[bytes]:
    """Bodies that are not (valid) JSON, or JSON that is nested too deep, derived from a valid
    body where that makes them nastier."""
    return st.one_of(
        st.binary(max_size=64),
        st.sampled_from(
            [
                b"",
                b"null",
                b"[]",
                b"{",
                b"}",
                b'"just a string"',
                b"\xff\xfe\xfd",
                b'{"prompt": "\xff\xfe", "content": "\xc3\x28", "input": "\xed\xa0\x80"}',
                b'{"prompt": "a", "options": {"temperature": NaN, "num_predict": 1}}',
                b'{"prompt": "a", "options": {"top_p": Infinity, "num_predict": 1}}',
                b'{"prompt": "\\ud800", "content": "\\udfff", "input": "\\ud800\\u0041"}',
                b"[" * 100000 + b"]" * 100000,
                b'{"a":' * 20000 + b"1" + b"}" * 20000,
                b'{"options": ' + b"[" * 5000 + b"]" * 5000 + b"}",
            ]
        ),
        st.just(b"\xef\xbb\xbf" + valid),  # a byte-order mark
        st.just(valid + b" trailing garbage"),
        st.just(valid[: len(valid) // 2]),  # cut short
        st.just(valid.replace(b"{", b'{"dup": 1, "dup": 2, ', 1)),
        st.integers(1, 5000).map(lambda d: valid[:-1] + b', "deep": ' + b"[" * d + b"]" * d + b"}"),
        st.just(valid.replace(b'"', b"'")),
        st.just(valid.replace(b"a", b"\xff")),
    )


@st.composite
def bodies(draw: st.DrawFn, route: Route) -> bytes:
    body: dict[str, Any] = draw(route.base)
    kind = draw(st.sampled_from(["valid", "mutated", "mutated", "mutated", "mutated", "raw"]))
    if kind == "raw":
        return draw(raw_variants(json.dumps(body).encode()))
    if kind == "mutated":
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(["set", "set", "set", "option", "drop", "unknown"]))
            if op == "set":
                name = draw(st.sampled_from(sorted(route.fields)))
                body[name] = draw(route.fields[name])
            elif op == "option" and route.has_options:
                options = body.get("options")
                if isinstance(options, dict):
                    name = draw(st.sampled_from(sorted(OPTION_FIELDS)))
                    options[name] = draw(OPTION_FIELDS[name])
            elif op == "drop" and body:
                body.pop(draw(st.sampled_from(sorted(body))))
            elif op == "unknown":
                body[draw(st.text(max_size=12))] = draw(HOSTILE)
    return json.dumps(body).encode()


# --------------------------------------------------------------------------------------------
# The shared hostile server


class Target:
    """The module's server; restarted when a test left it dead, hung or suspect."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        self.model = model
        self.log_dir = log_dir
        self.server: WatchedServer | None = None
        self.suspect = False

    def ensure(self) -> WatchedServer:
        if self.server is not None and (self.suspect or not self.server.alive()):
            self.server.stop(graceful=False)
            self.server = None
        if self.server is None:
            self.server = WatchedServer(
                self.model, self.log_dir, *HOSTILE_FLAGS, rss_limit_mb=RSS_LIMIT_MB
            )
            self.suspect = False
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    d = tmp_path_factory.mktemp("hostile")
    # With fill-in-the-middle tokens, so that /infill and completions' suffix get past them.
    t = Target(write_tiny_model(d / "tiny-model.gguf", fim=FIM_TOKENS), d)
    yield t
    t.close()
    print("\n=== test_hostile: statuses per route ===")
    for path, counts in sorted(STATUSES.items()):
        print(f"{path}: {dict(sorted(counts.items()))}")
    if FAILURES:
        print(f"\n=== test_hostile: {len(FAILURES)} failing exchange(s) ===")
        for f in FAILURES:
            print(f)


@pytest.fixture
def server(target: Target) -> Iterator[WatchedServer]:
    """The shared server, healthy at the start; restarted after a test that left it dead or
    still busy with a request that hung."""
    srv = target.ensure()
    yield srv
    if srv.tainted or not srv.alive():
        target.suspect = True


def run_route(srv: WatchedServer, path: str, strategy: st.SearchStrategy[bytes]) -> None:
    with httpx.Client() as client:

        @HSETTINGS
        @given(body=strategy)
        def one(body: bytes) -> None:
            reply = exchange(client, srv, "POST", path, body)
            STATUSES[path][reply.status] += 1
            assert_good(path, body, reply)

        try:
            one()
        except BaseException as e:
            record(f"POST {path}", e)
            raise
    wait_idle(srv.url)


# --------------------------------------------------------------------------------------------
# The property-based tests


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_hostile_bodies(server: WatchedServer, path: str) -> None:
    route = ROUTES[path]
    run_route(server, route.path, bodies(route))


GET_PATHS = [
    "/health",
    "/slots",
    "/v1/models",
    f"/v1/models/{MODEL}",
    "/api/tags",
    "/api/ps",
    "/api/version",
    "/",
]
PATH_SEGMENTS = st.one_of(
    st.sampled_from(["", "..", "%00", "%ff", "%2e%2e", "%", "a" * 5000, MODEL, "v1", "api"]),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.~%", max_size=20),
)
WRONG_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]


def shape_problems(path: str, reply: Reply) -> list[str]:
    """Never a 5xx; an error in the shape of the dialect of the path the server saw (httpx
    resolves dot segments)."""
    problems = []
    if reply.status >= 500:
        problems.append(f"status {reply.status}")
    if reply.status >= 400:
        p = error_shape_problem(dialect_of(httpx.URL(f"http://host{path}").path), reply.body)
        if p:
            problems.append(p)
    return problems


@st.composite
def paths(draw: st.DrawFn) -> tuple[str, str]:
    """(method, path): a route's own method on the route with odd segments appended."""
    base = draw(st.sampled_from([*GET_PATHS, *ROUTES, "/v1/models/", "/api/pull", "/api", "/v1"]))
    extra = draw(st.lists(PATH_SEGMENTS, max_size=2))
    path = "/".join([base.rstrip("/") or "", *extra]) if extra else base
    path = path if path.startswith("/") else "/" + path
    # The route the server will see (httpx resolves dot segments) decides the method.
    return ("POST" if httpx.URL(f"http://host{path}").path in ROUTES else "GET"), path


def test_hostile_paths(server: WatchedServer) -> None:
    """Unknown paths, odd model names and percent-escapes: never a 5xx, errors in the path's
    dialect's shape."""
    with httpx.Client() as client:

        @HSETTINGS
        @given(request=paths())
        def one(request: tuple[str, str]) -> None:
            method, path = request
            body = b"{}" if method == "POST" else None
            reply = exchange(client, server, method, path, body)
            problems = shape_problems(path, reply)
            assert not problems, f"{method} {path[:200]} -> {reply.status}: {'; '.join(problems)}"

        try:
            one()
        except BaseException as e:
            record("paths", e)
            raise
    wait_idle(server.url)


def test_wrong_methods_answer_in_the_dialects_shape(server: WatchedServer) -> None:
    """Every route with every method it does not serve: a JSON error in its dialect's shape."""
    failures = []
    for path in [*GET_PATHS, *ROUTES]:
        own = "POST" if path in ROUTES else "GET"
        for method in WRONG_METHODS:
            if method == own:
                continue
            # A connection each: test_options_with_a_body_keeps_the_connection_usable is about
            # reusing one.
            with httpx.Client() as client:
                body = b"{}" if method != "GET" else None
                reply = exchange(client, server, method, path, body)
            problems = shape_problems(path, reply)
            if problems:
                failures.append(f"{method} {path} -> {reply.status}: {'; '.join(problems)}")
    if failures:
        record("wrong methods", AssertionError(f"{len(failures)} answers, e.g. {failures[0]}"))
    assert not failures, f"{len(failures)} bad answers:\n" + "\n".join(failures)


def test_options_with_a_body_keeps_the_connection_usable(server: WatchedServer) -> None:
    """An OPTIONS request with a body (sent a moment after its headers, as a second packet),
    then a GET on the same keep-alive connection: the GET is answered (or the OPTIONS answer
    said ``Connection: close``)."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(
            b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n"
        )
        time.sleep(0.2)
        s.sendall(b"{}")
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 "), first
        if b"connection: close" in first.lower():
            return
        time.sleep(0.2)
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            second = s.recv(65536)
        except OSError as e:
            second = repr(e).encode()
    assert second.startswith(b"HTTP/1.1 200"), (
        f"the keep-alive connection was dropped after {first.splitlines()[0]!r} without "
        f"'Connection: close'; the next request got {second[:100]!r}"
    )


# --------------------------------------------------------------------------------------------
# Named hostile requests, on the shared server (restarted after a failure)

DEEP_GRAMMAR = nested_parens(50000)
LONG_PROMPT = "hello " * 2000

NAMED: list[tuple[str, str, dict[str, Any]]] = [
    (
        "grammar-dead-end-with-ignore-eos",
        "/completion",
        {
            "prompt": "hi",
            "grammar": 'root ::= "a"',
            "options": {"num_predict": 4, "ignore_eos": True},
        },
    ),
    (
        "grammar-huge-repetition",
        "/completion",
        {"prompt": "hi", "grammar": 'root ::= "a"{100000000}', "options": {"num_predict": 2}},
    ),
    (
        "grammar-repetition-min-above-max",
        "/completion",
        {"prompt": "hi", "grammar": 'root ::= "a"{2,1}', "options": {"num_predict": 2}},
    ),
    (
        "grammar-rule-chain-6000",
        "/completion",
        {"prompt": "hi", "grammar": rule_chain(6000), "options": {"num_predict": 2}},
    ),
    (
        "grammar-nullable-star",
        "/completion",
        {"prompt": "hi", "grammar": 'root ::= ("a"?)* "b"', "options": {"num_predict": 2}},
    ),
    (
        "recursive-schema-ref",
        "/api/generate",
        {
            "model": MODEL,
            "prompt": "hi",
            "stream": False,
            "format": {"$ref": "#"},
            "options": {"num_predict": 2},
        },
    ),
    (
        "num-keep-huge-with-truncation",
        "/completion",
        {"prompt": LONG_PROMPT, "options": {"num_keep": 2**62, "num_predict": 2}},
    ),
    (
        "num-keep-negative-with-truncation",
        "/completion",
        {"prompt": LONG_PROMPT, "options": {"num_keep": -5, "num_predict": 2}},
    ),
    (
        "num-keep-huge-with-shift",
        "/completion",
        {"prompt": "hi", "options": {"num_keep": 2**62, "num_predict": 600, "ignore_eos": True}},
    ),
    (
        "top-k-huge-mirostat",
        "/completion",
        {
            "prompt": "hi",
            "options": {"top_k": 2**31 - 1, "mirostat": 2, "mirostat_tau": 1e30, "num_predict": 3},
        },
    ),
    (
        "stop-list-20000",
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "hi",
            "max_tokens": 200,
            "ignore_eos": True,
            "stop": [f"never{i}" for i in range(20000)],
        },
    ),
    (
        "logprobs-all-tokens-stream",
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 20,
            "stream": True,
            "logit_bias": {"2": -100, "3": 100},
        },
    ),
    ("nul-in-prompt", "/completion", {"prompt": "a\x00b", "options": {"num_predict": 2}}),
    ("nul-in-embedding", "/api/embed", {"model": MODEL, "input": ["a\x00b", "\x00"]}),
    ("only-special-tokens", "/completion", {"prompt": "<s></s><s>", "options": {"num_predict": 2}}),
    (
        "thousands-of-messages",
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi " * 50}] * 3000,
            "max_tokens": 2,
        },
    ),
]


@pytest.mark.parametrize("path,body", [(p, b) for _, p, b in NAMED], ids=[n for n, _, _ in NAMED])
def test_named_hostile_request(server: WatchedServer, path: str, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    with httpx.Client() as client:
        try:
            reply = exchange(client, server, "POST", path, data)
            assert_good(path, data, reply)
        except (ServerDied, ServerHung) as e:
            record(f"POST {path}", e)
            pytest.fail(str(e))
        except AssertionError as e:
            record(f"POST {path}", e)
            raise
    assert server.peak_rss_kb < 1024 * 1024, f"RSS peaked at {server.peak_rss_kb // 1024} MB"
    wait_idle(server.url)


def test_oversized_prompts_are_refused_quickly(server: WatchedServer) -> None:
    """A 3 MB prompt in each dialect: answered (refused in the dialect's JSON shape, or cut to
    the slot) within REQUEST_TIMEOUT, not left tokenizing for minutes."""
    huge = "a" * (3 * 1024 * 1024)
    with httpx.Client() as client:
        for path, body in [
            ("/completion", {"prompt": huge}),
            ("/v1/completions", {"model": MODEL, "prompt": huge, "max_tokens": 1}),
            ("/api/generate", {"model": MODEL, "prompt": huge}),
        ]:
            data = json.dumps(body).encode()
            try:
                assert_good(path, data, exchange(client, server, "POST", path, data))
            except (ServerDied, ServerHung, AssertionError) as e:
                record(f"POST {path}", e)
                pytest.fail(str(e))


# --------------------------------------------------------------------------------------------
# Regression tests, each on a server of its own


@pytest.fixture
def spawn(tmp_path: Path, tiny_model: Path) -> Iterator[Callable[..., WatchedServer]]:
    """Starts subprocess servers of the tiny model (alias "tiny"); stops them afterwards."""
    started: list[WatchedServer] = []

    def start(*flags: str, rss_limit_mb: int = RSS_LIMIT_MB) -> WatchedServer:
        srv = WatchedServer(tiny_model, tmp_path, *flags, rss_limit_mb=rss_limit_mb)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


def post(srv: WatchedServer, path: str, body: dict[str, Any], timeout: float) -> httpx.Response:
    """One request; a crash or a hang fails the test with the server's state."""
    try:
        return httpx.post(f"{srv.url}{path}", json=body, timeout=timeout)
    except httpx.TimeoutException:
        pytest.fail(f"{path} got no answer within {timeout} s")
    except httpx.TransportError as e:
        srv.died_within(5)  # a dying server: its state, once it is gone
        pytest.fail(f"{path} got no answer ({e!r}); {srv.describe()}")


@pytest.mark.parametrize(
    "path,body",
    [
        ("/completion", {"prompt": "hi", "grammar": DEEP_GRAMMAR, "options": {"num_predict": 3}}),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": "hi", "grammar": DEEP_GRAMMAR, "max_tokens": 3},
        ),
    ],
    ids=["native", "openai"],
)
def test_a_deeply_nested_grammar_is_a_400_not_a_crash(
    spawn: Callable[..., WatchedServer], path: str, body: dict[str, Any]
) -> None:
    srv = spawn("--parallel", "1")
    r = post(srv, path, body, timeout=30)
    assert r.status_code == 400, f"{r.status_code} {r.text[:300]}"
    assert error_shape_problem(dialect_of(path), r.content) is None, r.text[:300]
    assert srv.alive(), srv.describe()
    wait_idle(srv.url)


@pytest.mark.parametrize(
    "path,body",
    [
        (
            "/completion",
            {"prompt": "hi", "options": {"repeat_last_n": 2147483647, "num_predict": 3}},
        ),
        (
            "/api/generate",
            {
                "model": "tiny",
                "prompt": "hi",
                "raw": True,
                "stream": False,
                "options": {"repeat_last_n": 2147483647, "num_predict": 3},
            },
        ),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": "hi", "max_tokens": 3, "repeat_last_n": 2147483647},
        ),
    ],
    ids=["native", "ollama", "openai"],
)
def test_b_a_huge_repeat_last_n_is_cheap(
    spawn: Callable[..., WatchedServer], path: str, body: dict[str, Any]
) -> None:
    # The watchdog kills the server at 1.5 GB (the host's sake); the bound asserted is 1 GB.
    srv = spawn("--parallel", "1", rss_limit_mb=1536)
    before = srv.rss_kb()
    started, cpu_before = time.monotonic(), srv.cpu_seconds()
    r = post(srv, path, body, timeout=60)
    elapsed, cpu = time.monotonic() - started, srv.cpu_seconds() - cpu_before
    peak_mb = srv.peak_rss_kb // 1024
    print(
        f"\n[b] {path}: {r.status_code} in {elapsed:.3f} s ({cpu:.3f} s of CPU), "
        f"RSS {before // 1024} MB before, peak {peak_mb} MB"
    )
    assert r.status_code == 200, f"{r.status_code} {r.text[:300]}"
    # The server's CPU time, not the wall clock (which a loaded machine stretches): a scan of
    # 2^31 penalty entries per token would take seconds of it; three tokens take milliseconds.
    assert cpu < 2.5, f"took {cpu:.2f} s of CPU"
    assert peak_mb < 1024, f"RSS peaked at {peak_mb} MB"
    assert srv.alive(), srv.describe()


# A server for `Busy` lets one request generate 10^9 tokens: without `--max-tokens`,
# `num_predict` stops at ten slot contexts, which the tiny model generates in a few seconds.
BUSY_FLAGS = ("--max-tokens", str(10**9))


class Busy:
    """A long streaming generation holding a slot, read on a thread until ``stop()`` closes it
    (which cancels it on the server). Its server needs `BUSY_FLAGS`."""

    def __init__(self, url: str) -> None:
        # num_predict huge with ignore_eos: it runs until stop().
        self.body = {"prompt": "the cat", "options": {"num_predict": 10**9, "ignore_eos": True}}
        self.url = url
        self.lines = 0
        self.status: int | None = None
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.finished = threading.Event()
        self._stop = threading.Event()
        self._client = httpx.Client(timeout=60)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with self._client.stream("POST", f"{self.url}/completion", json=self.body) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line:
                        self.lines += 1
                        self.started.set()
                    if self._stop.is_set():
                        return
        except BaseException as e:
            self.error = e
        finally:
            self._client.close()
            self.finished.set()
            self.started.set()

    def wait_started(self) -> None:
        assert self.started.wait(30), "the long generation did not start"
        assert self.status == 200 and not self.finished.is_set(), (self.status, self.error)

    def running(self) -> bool:
        return not self.finished.is_set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def slots_busy(url: str) -> int:
    return sum(1 for s in httpx.get(f"{url}/slots", timeout=5).json() if s["busy"])


# How long test_c waits for an answer that must not wait for the busy slot.
REQUEST_WAIT = 60


def test_c_a_busy_slot_does_not_delay_embeddings_or_validation_errors(
    spawn: Callable[..., WatchedServer],
) -> None:
    srv = spawn("--parallel", "1", "--ctx-size", "1024", *BUSY_FLAGS)
    busy = Busy(srv.url)
    try:
        busy.wait_started()
        assert slots_busy(srv.url) == 1
        checks: list[tuple[str, str, dict[str, Any], int]] = [
            ("embedding", "/embedding", {"content": "hello world"}, 200),
            (
                "prompt too long, truncate false",
                "/completion",
                {"prompt": "hello " * 2000, "truncate": False, "options": {"num_predict": 1}},
                400,
            ),
            (
                "logit_bias id outside the vocabulary",
                "/v1/chat/completions",
                {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 1,
                    "logit_bias": {"99999999": 1},
                },
                400,
            ),
            (
                "invalid grammar",
                "/completion",
                {"prompt": "hi", "grammar": "root ::= (", "options": {"num_predict": 1}},
                400,
            ),
        ]
        # Each must be answered while the only slot stays busy with a generation that cannot
        # end for a long while (10^9 tokens): an answer that waited for the slot would never
        # come (and time out). No bound on the wall-clock time: a loaded machine stretches it.
        results = []
        for name, path, body, want in checks:
            started = time.monotonic()
            try:
                r = httpx.post(f"{srv.url}{path}", json=body, timeout=REQUEST_WAIT)
                got = f"{r.status_code} {r.text[:120]}"
                ok = r.status_code == want and busy.running()
            except httpx.TimeoutException:
                got, ok = f"no answer within {REQUEST_WAIT} s", False
            elapsed = time.monotonic() - started
            results.append((ok, f"{name}: {got} after {elapsed:.2f} s (want {want})"))
            assert srv.alive(), srv.describe()
        print("\n[c] " + "\n[c] ".join(text for _, text in results))
        assert busy.running(), "the long generation ended early: the checks proved nothing"
        failed = [text for ok, text in results if not ok]
        assert not failed, "while the only slot was busy:\n" + "\n".join(failed)
    finally:
        busy.stop()
    wait_idle(srv.url)


def raw_post(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """Sends a POST on a socket of its own and returns the socket, unread."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    data = json.dumps(body).encode()
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


def read_status(s: socket.socket, timeout: float) -> int | None:
    """The response's status code, or None when none came within ``timeout``."""
    s.settimeout(timeout)
    try:
        head = s.recv(64)
    except (socket.timeout, TimeoutError):
        return None
    m = re.match(rb"HTTP/1\.1 (\d{3})", head)
    assert m, f"not an HTTP response: {head!r}"
    return int(m.group(1))


def read_all(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except (socket.timeout, TimeoutError):
            break
        if not chunk:
            break
        chunks.append(chunk)
        if b'"done":true' in b"".join(chunks[-2:]):
            break
    return b"".join(chunks)


def test_d_cancelled_queued_requests_leave_the_queue(
    spawn: Callable[..., WatchedServer],
) -> None:
    srv = spawn("--parallel", "1", "--max-queue", "2", "--ctx-size", "1024", *BUSY_FLAGS)
    busy = Busy(srv.url)
    opened: list[socket.socket] = []
    try:
        busy.wait_started()
        body = {"prompt": "queued", "options": {"num_predict": 2}}
        queued = [raw_post(srv.url, "/completion", body) for _ in range(2)]
        opened += queued
        wait_until(lambda: metric(srv.url, "requests_waiting") == 2, "two requests queued")
        for s in queued:
            assert read_status(s, 0.2) is None, "a request answered though the slot is busy"
        # The queue is full: one more is refused at once.
        r = httpx.post(f"{srv.url}/completion", json=body, timeout=30)
        assert r.status_code == 429, f"with the queue full: {r.status_code} {r.text[:200]}"
        # The two queued clients go away; the server drops them from the queue.
        for s in queued:
            s.shutdown(socket.SHUT_RDWR)
            s.close()
        wait_until(
            lambda: metric(srv.url, "requests_waiting") == 0, "the cancelled requests to leave"
        )
        fresh = [raw_post(srv.url, "/completion", body) for _ in range(2)]
        opened += fresh
        # Both wait in the queue (a refused one would not be counted), unanswered.
        wait_until(lambda: metric(srv.url, "requests_waiting") == 2, "the new requests queued")
        statuses = [read_status(s, 0.2) for s in fresh]
        print(f"\n[d] after the queued clients left, two new requests: {statuses} (None = queued)")
        assert busy.running(), "the long generation ended early: the check proved nothing"
        assert statuses == [None, None], (
            f"new requests were answered {statuses} while the slot was busy: the cancelled "
            "requests still hold the queue"
        )
        # Free the slot: both are served.
        busy.stop()
        for s in fresh:
            answer = read_all(s, 30)
            assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
            assert b'"done":true' in answer, answer[-300:]
    finally:
        busy.stop()
        for s in opened:
            s.close()
    wait_idle(srv.url)
