"""Structured output that no request can break: generated JSON schemas and GBNF grammars on
every route that takes one, against a server in a subprocess (a crash is seen, not suffered),
and a conformance check that constrained output validates and keeps the schema's order.

The generators aim at what used to reach llama.cpp's C++ grammar code: ``pattern`` strings
over the regex metacharacters, ``$ref`` graphs with cycles and dangling references, long and
odd property names, nested combinators, and GBNF grammars built from random grammar trees
with wide alternations and nested nullable rules.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import WatchedServer, parse_ndjson
from tinymodel import write_tiny_model

MODEL = "tiny"
EXAMPLES = int(os.environ.get("LLAMARUNNER_STRUCTURED_EXAMPLES", "40"))
REQUEST_TIMEOUT = 60.0
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
pytestmark = pytest.mark.timeout(900)

# ------------------------------------------------------------------------------------------
# Generators

META = list("^$*+?.()[]{}|\\-,:!=<>")
PATTERNS = st.one_of(
    st.text(alphabet=META + list("az09 \n"), max_size=16),
    st.sampled_from(["^*$", "(", "a{2,1}", "[z-a]", "(?P<x>a)", "\\", "a**", "(a|)*", "x{99999}"]),
    st.text(alphabet=META, min_size=200, max_size=400),
)
NAMES = st.one_of(
    st.text(max_size=12),
    st.text(alphabet='ab"\\\n\u0000é', min_size=100, max_size=300),
    st.sampled_from(["", '"', "\\", "$ref", "properties", "\u0000", "\U0001f600" * 20]),
)
LEAVES = st.one_of(
    st.sampled_from(
        [
            {"type": "string"},
            {"type": "integer", "minimum": -5, "maximum": 5},
            {"type": "number"},
            {"type": "boolean"},
            {"type": "null"},
            {},
            {"type": "string", "format": "date"},
            {"type": "string", "format": "email"},
            {"type": "string", "minLength": 3, "maxLength": 1},
            {"type": "integer", "minimum": 9, "maximum": 1},
            {"enum": []},
            {"type": "bogus"},
            {"type": "string", "maxLength": 2**40},
        ]
    ),
    PATTERNS.map(lambda p: {"type": "string", "pattern": p}),
    st.lists(st.one_of(st.text(max_size=8), st.integers(), st.none()), max_size=5).map(
        lambda v: {"enum": v}
    ),
    st.text(max_size=8).map(lambda c: {"const": c}),
    st.sampled_from(["#", "#/$defs/d0", "#/$defs/missing", "#/properties", "http://x/y"]).map(
        lambda r: {"$ref": r}
    ),
)


def combine(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.dictionaries(NAMES, children, max_size=4).map(
            lambda p: {"type": "object", "properties": p, "required": list(p)[:2]}
        ),
        st.builds(
            lambda p, extra: {"type": "object", "properties": p, "additionalProperties": extra},
            st.dictionaries(NAMES, children, max_size=3),
            st.one_of(st.booleans(), children),
        ),
        children.map(lambda i: {"type": "array", "items": i, "maxItems": 3}),
        st.lists(children, min_size=1, max_size=3).map(lambda xs: {"anyOf": xs}),
        st.lists(children, min_size=1, max_size=3).map(lambda xs: {"oneOf": xs}),
        st.lists(children, min_size=1, max_size=3).map(lambda xs: {"allOf": xs}),
        children.map(lambda x: {"not": x}),
    )


SCHEMAS = st.recursive(LEAVES, combine, max_leaves=8)


@st.composite
def ref_graphs(draw: st.DrawFn) -> dict[str, Any]:
    """``$defs`` whose members refer to each other (cycles included) and to nothing."""
    n = draw(st.integers(1, 6))
    targets = st.sampled_from([f"#/$defs/d{i}" for i in range(n)] + ["#/$defs/nope", "#"])
    member = st.one_of(
        targets.map(lambda r: {"$ref": r}),
        st.lists(targets, min_size=1, max_size=3).map(
            lambda rs: {"anyOf": [{"$ref": r} for r in rs] + [{"type": "integer"}]}
        ),
        targets.map(
            lambda r: {"type": "object", "properties": {"next": {"$ref": r}}, "required": ["next"]}
        ),
        targets.map(lambda r: {"type": "array", "items": {"$ref": r}, "maxItems": 2}),
        LEAVES,
    )
    defs = {f"d{i}": draw(member) for i in range(n)}
    return {"$defs": defs, "$ref": draw(targets)}


ANY_SCHEMA = st.one_of(SCHEMAS, ref_graphs())


def gbnf_literal(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


@st.composite
def gbnf_grammars(draw: st.DrawFn) -> str:
    """A random grammar tree: rules of alternatives of sequences of literals, classes, rule
    references (defined, undefined, recursive), groups and postfix operators."""
    n = draw(st.integers(1, 5))
    names = [f"r{i}" for i in range(n)]
    postfix = st.sampled_from(["", "", "*", "+", "?", "{2}", "{0,3}", "{1,}", "{,2}", "{3,1}"])

    def element(depth: int) -> st.SearchStrategy[str]:
        leaf = st.one_of(
            st.text(max_size=4).map(gbnf_literal),
            st.sampled_from(["[a-z]", '[^"\\\\]', "[0-9]", ".", "[\\x00-\\x7f]", "[]", '""']),
            st.sampled_from([*names, "undefined", "root"]),
        )
        if depth >= 3:
            return leaf
        return st.one_of(
            leaf,
            st.lists(element(depth + 1), min_size=1, max_size=3).map(
                lambda xs: "(" + " | ".join(xs) + ")"
            ),
        )

    def alternative() -> st.SearchStrategy[str]:
        return st.lists(
            st.tuples(element(0), postfix).map(lambda ep: ep[0] + ep[1]), min_size=0, max_size=4
        ).map(" ".join)

    rules = [
        f"{name} ::= " + " | ".join(draw(st.lists(alternative(), min_size=1, max_size=3)) or ['""'])
        for name in ["root", *names]
    ]
    return "\n".join(rules)


def wide_alternation(n: int) -> str:
    return "root ::= (" + " | ".join(['"a"'] * n) + ")*"


def nullable_chain(depth: int) -> str:
    lines = ["root ::= l0"]
    lines += [f'l{i} ::= l{i + 1} l{i + 1} | ""' for i in range(depth)]
    lines.append(f'l{depth} ::= "x" | ""')
    return "\n".join(lines)


GRAMMARS = st.one_of(
    gbnf_grammars(),
    st.integers(1, 3000).map(wide_alternation),
    st.integers(1, 30).map(nullable_chain),
    st.text(max_size=30),
)

# ------------------------------------------------------------------------------------------
# Routes: (path, body for a schema or grammar)

Body = Callable[[Any], dict[str, Any]]
CHAT = [{"role": "user", "content": "hi"}]
SCHEMA_ROUTES: dict[str, Body] = {
    "native format": lambda s: {"prompt": "x", "format": s, "options": {"num_predict": 6}},
    "ollama generate format": lambda s: {
        "model": MODEL,
        "prompt": "x",
        "format": s,
        "stream": False,
        "options": {"num_predict": 6},
    },
    "ollama chat format": lambda s: {
        "model": MODEL,
        "messages": CHAT,
        "format": s,
        "stream": False,
        "options": {"num_predict": 6},
    },
    "openai response_format": lambda s: {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": 6,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}},
    },
    "openai tools": lambda s: {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": 6,
        "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": s}}],
    },
    "apply-template tools": lambda s: {
        "messages": CHAT,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": s}}],
    },
}
PATHS = {
    "native format": "/completion",
    "ollama generate format": "/api/generate",
    "ollama chat format": "/api/chat",
    "openai response_format": "/v1/chat/completions",
    "openai tools": "/v1/chat/completions",
    "apply-template tools": "/apply-template",
    "native grammar": "/completion",
    "openai completions grammar": "/v1/completions",
    "openai chat grammar": "/v1/chat/completions",
}
GRAMMAR_ROUTES: dict[str, Body] = {
    "native grammar": lambda g: {"prompt": "x", "grammar": g, "options": {"num_predict": 6}},
    "openai completions grammar": lambda g: {
        "model": MODEL,
        "prompt": "x",
        "grammar": g,
        "max_tokens": 6,
    },
    "openai chat grammar": lambda g: {
        "model": MODEL,
        "messages": CHAT,
        "grammar": g,
        "max_tokens": 6,
    },
}
STATUSES: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)


def error_problem(path: str, body: bytes) -> str | None:
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return f"not an error body: {body[:300]!r}"
    if path.startswith("/api/"):
        return None if isinstance(err, str) and err else f"not an Ollama error: {err!r}"
    keys = ("message", "type", "code") if path.startswith("/v1/") else ("message", "type")
    if not isinstance(err, dict) or any(k not in err for k in keys):
        return f"not a {path} error: {err!r}"
    return None


class Target:
    def __init__(self, model: Path, log_dir: Path) -> None:
        self.model, self.log_dir = model, log_dir
        self.server: WatchedServer | None = None

    def ensure(self) -> WatchedServer:
        if self.server is None or not self.server.alive():
            self.server = WatchedServer(
                self.model, self.log_dir, "--parallel", "2", "--ctx-size", "2048", "--alias", MODEL
            )
        return self.server


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    d = tmp_path_factory.mktemp("structured")
    t = Target(write_tiny_model(d / "tiny-model.gguf"), d)
    yield t
    print("\n=== test_structured_output: statuses per route ===")
    for route, counts in sorted(STATUSES.items()):
        print(f"{route}: {dict(sorted(counts.items()))}")
    if t.server is not None:
        t.server.stop()


def send(client: httpx.Client, srv: WatchedServer, route: str, body: dict[str, Any]) -> int:
    return send_response(client, srv, route, body).status_code


def too_long(r: httpx.Response) -> bool:
    """Whether a 400 says the prompt outgrew the slot (tools are rendered into the prompt, so
    a valid schema with long enums can make a prompt too long: a right answer, not a refusal
    of the schema)."""
    return r.status_code == 400 and (
        "context_length_exceeded" in r.text or "exceeds the context length" in r.text
    )


def send_response(
    client: httpx.Client, srv: WatchedServer, route: str, body: dict[str, Any]
) -> httpx.Response:
    path = PATHS[route]
    what = f"{route} {json.dumps(body)[:400]}"
    try:
        r = client.post(f"{srv.url}{path}", json=body, timeout=REQUEST_TIMEOUT)
    except httpx.TimeoutException:
        pytest.fail(f"no answer within {REQUEST_TIMEOUT} s to {what}")
    except httpx.TransportError as e:
        srv.died_within(5)  # a dying server: its state, once it is gone
        pytest.fail(
            f"transport error {e!r} (server alive: {srv.alive()}) to {what}: {srv.describe()}"
        )
    assert srv.alive(), f"the server died answering {what}: {srv.describe()}"
    assert r.status_code in (200, 400), f"{r.status_code} {r.text[:300]} to {what}"
    if r.status_code == 400:
        problem = error_problem(path, r.content)
        assert problem is None, f"{problem} to {what}"
    STATUSES[route][r.status_code] += 1
    return r


def plain_request_answers(client: httpx.Client, srv: WatchedServer) -> None:
    started = time.monotonic()
    r = client.post(
        f"{srv.url}/completion",
        json={"prompt": "hello", "options": {"num_predict": 2}},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert time.monotonic() - started < 30


GENERATED: dict[str, tuple[Body, st.SearchStrategy[Any]]] = {
    **{route: (body, ANY_SCHEMA) for route, body in SCHEMA_ROUTES.items()},
    **{route: (body, GRAMMARS) for route, body in GRAMMAR_ROUTES.items()},
}


@pytest.mark.parametrize("route", sorted(GENERATED))
def test_generated_schemas_and_grammars_get_a_200_or_a_400(target: Target, route: str) -> None:
    srv = target.ensure()
    body, strategy = GENERATED[route]
    with httpx.Client() as client:

        @SETTINGS
        @given(value=strategy)
        def one(value: Any) -> None:
            send(client, srv, route, body(value))

        one()
        plain_request_answers(client, srv)


# Valid schemas: what OpenAI's structured outputs and llama-server accept.
VALID_LEAVES = st.one_of(
    st.sampled_from(
        [
            {"type": "string", "maxLength": 12},
            {"type": "integer", "minimum": -50, "maximum": 50},
            {"type": "number", "minimum": 0, "maximum": 10},
            {"type": "boolean"},
            {"type": "null"},
            {"type": "string", "pattern": "^[a-z]{1,6}$"},
            {"type": "string", "format": "date"},
            {"type": "string", "enum": [f"v{i}" for i in range(150)]},
            {"const": "fixed"},
            {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
        ]
    ),
)
PROPERTY_NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=10)


def valid_combine(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.dictionaries(PROPERTY_NAMES, children, min_size=1, max_size=4).map(
            lambda p: {
                "type": "object",
                "properties": p,
                "required": list(p),
                "additionalProperties": False,
            }
        ),
        children.map(lambda i: {"type": "array", "items": i, "minItems": 1, "maxItems": 3}),
    )


VALID_SCHEMAS = st.recursive(VALID_LEAVES, valid_combine, max_leaves=6).filter(
    lambda s: s.get("type") == "object"
)


def keys_in_schema_order(value: Any, schema: dict[str, Any]) -> bool:
    if isinstance(value, dict) and "properties" in schema:
        order = list(schema["properties"])
        if [k for k in order if k in value] != list(value):
            return False
        return all(keys_in_schema_order(value[k], schema["properties"][k]) for k in value)
    if isinstance(value, list) and "items" in schema:
        return all(keys_in_schema_order(v, schema["items"]) for v in value)
    return True


def test_constrained_output_validates_and_keeps_the_schemas_order(target: Target) -> None:
    srv = target.ensure()
    finished = 0
    with httpx.Client() as client:

        @SETTINGS
        @given(schema=VALID_SCHEMAS, seed=st.integers(0, 1000))
        def one(schema: dict[str, Any], seed: int) -> None:
            nonlocal finished
            r = client.post(
                f"{srv.url}/completion",
                json={
                    "prompt": "json:",
                    "format": schema,
                    "options": {"num_predict": 200, "seed": seed, "temperature": 1.0},
                },
                timeout=REQUEST_TIMEOUT,
            )
            assert r.status_code == 200, f"{r.text} for {schema}"
            lines = parse_ndjson(r.text)
            text = "".join(line.get("content", "") for line in lines)
            if lines[-1]["done_reason"] != "stop":
                return
            finished += 1
            value = json.loads(text)
            jsonschema.validate(value, schema)
            assert keys_in_schema_order(value, schema), (text, schema)

        one()
    assert finished >= EXAMPLES // 2, f"only {finished} of {EXAMPLES} outputs finished"


def test_valid_schemas_mostly_succeed_on_every_schema_route(target: Target) -> None:
    """The hostile suites must fail when a route refuses everything: valid schemas get 200s."""
    srv = target.ensure()
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    with httpx.Client() as client:

        @settings(SETTINGS, max_examples=max(EXAMPLES // 4, 5))
        @given(schema=VALID_SCHEMAS)
        def one(schema: dict[str, Any]) -> None:
            for route, body in SCHEMA_ROUTES.items():
                r = send_response(client, srv, route, body(schema))
                outcome = "200" if r.status_code == 200 else "too long" if too_long(r) else r.text
                counts[route][outcome] += 1

        one()
    for route, c in counts.items():
        refused = {k: n for k, n in c.items() if k not in ("200", "too long")}
        assert not refused, f"{route}: valid schemas refused: {refused}"
        assert c["200"] >= sum(c.values()) // 2, f"{route}: {dict(c)}"


def test_the_named_crash_and_freeze_are_harmless(target: Target) -> None:
    """The schema that crashed llama.cpp's converter is a 400; the grammar that froze every
    stream runs while a plain stream keeps flowing beside it."""
    srv = target.ensure()
    with httpx.Client() as client:
        r = client.post(
            f"{srv.url}/completion",
            json={"prompt": "x", "format": {"type": "string", "pattern": "^*$"}},
            timeout=REQUEST_TIMEOUT,
        )
        assert r.status_code == 400, r.text
        assert (
            "pattern" in r.json()["error"]["message"]
            or "regex" in r.json()["error"]["message"].lower()
        ), r.text
        freeze = {
            "prompt": "x",
            "grammar": wide_alternation(2000),
            "options": {"num_predict": 64},
        }
        result: dict[str, Any] = {}

        def constrained() -> None:
            result["r"] = httpx.post(f"{srv.url}/completion", json=freeze, timeout=120)

        t = threading.Thread(target=constrained)
        t.start()
        started = time.monotonic()
        plain = client.post(
            f"{srv.url}/completion",
            json={"prompt": "hello", "options": {"num_predict": 32}},
            timeout=120,
        )
        plain_s = time.monotonic() - started
        t.join(120)
        assert plain.status_code == 200
        assert result["r"].status_code == 200, result["r"].text
        lines = parse_ndjson(result["r"].text)
        text = "".join(line.get("content", "") for line in lines)
        assert set(text) <= {"a"}, text
        assert lines[-1]["done_reason"] in ("stop", "length")
        assert plain_s < 60, f"a plain stream beside the wide grammar took {plain_s:.1f} s"


@pytest.mark.parametrize(
    "route, body",
    [
        ("/completion", {"prompt": "x", "format": {"$ref": "#"}}),
        (
            "/completion",
            {
                "prompt": "x",
                "format": {
                    "$ref": "#/$defs/a",
                    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                },
            },
        ),
        ("/completion", {"prompt": "x", "grammar": "root ::= a\na ::= b\nb ::= a"}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "loop", "schema": {"$ref": "#"}},
                },
            },
        ),
    ],
)
def test_a_schema_or_grammar_that_matches_no_text_is_a_400(
    target: Target, route: str, body: dict[str, Any]
) -> None:
    # Once an empty answer that said "stop".
    srv = target.ensure()
    r = httpx.post(f"{srv.url}{route}", json=body, timeout=REQUEST_TIMEOUT)
    assert r.status_code == 400, r.text
    assert "matches no text" in r.text, r.text
