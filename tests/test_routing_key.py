"""The Ray routing key is the server's own reading of each dialect's request (`_core.route`,
``crates/llamarunner-core/src/dialects/routing_key.rs``): a conversation's next turn, in any
dialect, has the previous turn's key as its prefix, and two conversations do not share one;
a ``/v1/responses`` follow-up goes to the replica that stored the response it continues."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

try:
    import ray  # noqa: F401
except ImportError:
    if os.environ.get("LLAMARUNNER_TESTS_REQUIRE_RAY", "") not in ("", "0"):
        raise
    pytest.skip("Ray Serve is not installed (pip install '.[ray]')", allow_module_level=True)

from llamarunner.ray.affinity import (
    RESPONSE_ID_HEADER,
    PrefixTable,
    ResponseHomes,
    route,
    routing_key,
)
from llamarunner.ray.ingress import learn_home, request_route
from llamarunner.ray.replica import REPLICA_HEADER


def _chat(topic: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    first = [{"role": "system", "content": "brief"}, {"role": "user", "content": topic}]
    second = [*first, {"role": "assistant", "content": "so"}, {"role": "user", "content": "more"}]
    return first, second


def _turns(path: str, topic: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two consecutive turns of a conversation about ``topic``, in the shape of ``path``."""
    first, second = _chat(topic)
    if path in ("/completion", "/v1/chat/completions", "/api/chat"):
        return {"model": "m", "messages": first}, {"model": "m", "messages": second}
    if path == "/v1/messages":
        return (
            {"model": "m", "max_tokens": 8, "system": "brief", "messages": first[1:]},
            {"model": "m", "max_tokens": 8, "system": "brief", "messages": second[1:]},
        )
    if path == "/v1/responses":
        items = [
            {"role": "user", "content": topic},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "so"}],
            },
            {"role": "user", "content": [{"type": "input_text", "text": "more"}]},
        ]
        return (
            {"model": "m", "instructions": "brief", "input": topic},
            {"model": "m", "instructions": "brief", "input": items},
        )
    if path == "/infill":
        extra = [{"filename": "a.py", "text": topic}]
        return (
            {"model": "m", "input_extra": extra, "input_prefix": "def f("},
            {
                "model": "m",
                "input_extra": extra,
                "input_prefix": "def f(x):\n",
                "input_suffix": "\n",
            },
        )
    # Text prompts (/v1/completions, /api/generate): the next prompt continues the text.
    return {"model": "m", "prompt": topic}, {"model": "m", "prompt": topic + " so. more"}


DIALECTS = [
    "/completion",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/api/generate",
    "/api/chat",
    "/infill",
]


def _key(path: str, body: object) -> str | None:
    return routing_key(path, json.dumps(body).encode())


@pytest.mark.parametrize("path", DIALECTS)
def test_every_dialects_next_turn_extends_its_key(path: str) -> None:
    first, second = _turns(path, "cats")
    k1, k2 = _key(path, first), _key(path, second)
    assert k1 and k2 and k2.startswith(k1) and k2 != k1
    assert k1.startswith("model\x1fm\x1e")
    # Another conversation shares the model's lead, not the turn.
    other = _key(path, _turns(path, "dogs")[0])
    assert other and not other.startswith(k1) and not k2.startswith(other)
    # The table sends the next turn where the first went (a whole earlier key).
    table = PrefixTable()
    table.insert("a", k1)
    table.insert("b", other)
    assert table.best_match(k2, ["a", "b"]) == ("a", len(k1), True)


def test_one_conversation_is_one_key_in_every_chat_dialect() -> None:
    first, _ = _chat("cats")
    keys = {
        _key("/v1/chat/completions", {"model": "m", "messages": first}),
        _key("/api/chat", {"model": "m", "messages": first}),
        _key("/completion", {"model": "m", "messages": first}),
        _key("/v1/messages", {"model": "m", "system": "brief", "messages": first[1:]}),
        _key("/v1/responses", {"model": "m", "instructions": "brief", "input": "cats"}),
    }
    assert keys == {"model\x1fm\x1esystem\x1fbrief\x1euser\x1fcats\x1e"}


def test_routes_that_generate_nothing_have_no_key() -> None:
    for path in ("/tokenize", "/v1/messages/count_tokens", "/v1/rerank", "/api/show"):
        assert _key(path, {"content": "x", "messages": [{"role": "user", "content": "x"}]}) is None


def test_a_responses_follow_up_goes_to_the_replica_that_stored_its_response() -> None:
    homes = ResponseHomes(limit=2)
    # The first turn: keyed by its input; its answer names the response and the replica.
    first = json.dumps({"model": "m", "input": "hi"}).encode()
    assert request_route("POST", "/v1/responses", [], first, []) == (
        "model\x1fm\x1euser\x1fhi\x1e",
        None,
    )
    learn_home(
        homes,
        [
            ("content-type", "application/json"),
            (RESPONSE_ID_HEADER, "resp_1"),
            (REPLICA_HEADER, "r2"),
        ],
    )
    # The follow-up names it: it is pinned there, whatever the prefix table says.
    follow = json.dumps({"model": "m", "previous_response_id": "resp_1", "input": "more"})
    key, previous = request_route("POST", "/v1/responses", [], follow.encode(), [])
    assert previous == "resp_1" and homes.home(previous) == "r2"
    assert key == "model\x1fm\x1eprevious_response_id\x1fresp_1\x1euser\x1fmore\x1e"
    # So are reading and deleting it.
    assert request_route("GET", "/v1/responses/resp_1", [], b"", []) == (None, "resp_1")
    assert request_route("DELETE", "/v1/responses/resp_1", [], b"", []) == (None, "resp_1")
    assert request_route("GET", "/v1/responses/a/b", [], b"", []) == (None, None)
    # Not for a client without the server's key (it gets the replica's 401 anywhere).
    assert request_route("GET", "/v1/responses/resp_1", [], b"", [b"x" * 32]) == (None, None)
    # An answer that stored nothing teaches nothing; the oldest ids are forgotten.
    learn_home(homes, [(REPLICA_HEADER, "r1")])
    assert len(homes) == 1
    learn_home(homes, [(RESPONSE_ID_HEADER, "resp_2"), (REPLICA_HEADER, "r1")])
    learn_home(homes, [(RESPONSE_ID_HEADER, "resp_3"), (REPLICA_HEADER, "r1")])
    assert homes.home("resp_1") is None and homes.home("resp_3") == "r1"
    assert homes.home(None) is None


def test_route_of_unparsable_bodies() -> None:
    assert route("/v1/responses", b"{") == (None, None)
    assert route("/v1/responses", b'{"previous_response_id": 5, "input": "x"}')[1] is None
