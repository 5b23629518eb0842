"""Prefix affinity without Ray: the routing key of a request and the table of which replica
served which prefix. The Ray request router (`router.py`) holds one `PrefixTable` and asks
it; nothing here touches Ray, so it is tested on its own.

A routing key is text whose prefixes follow the prompt's: a conversation's next turn has the
previous turn's key as its prefix, as the prompt the replica renders has the previous prompt
(and answer) as its prefix. It is not the prompt itself (the replica applies the chat
template); it only has to grow the same way. It is computed in Rust (`_core.route`) from each
dialect's own reading of the request, so every dialect is keyed as the server parses it.

A ``/v1/responses`` request that continues a stored response (``previous_response_id``) must
reach the replica that stored it: `ResponseHomes` remembers which one did, from its answer.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .. import _core

# Keys are cut to this many characters: prompts that agree this far share a replica, and the
# table's memory stays bounded (keys per replica x this). The answer header of
# ``POST /v1/responses`` that names the response the replica stored.
MAX_KEY_CHARS, RESPONSE_ID_HEADER = _core.routing_constants()


def route(path: str, body: bytes) -> tuple[str | None, str | None]:
    """The routing key of a POST to ``path`` (no query string) with JSON ``body``, and the
    stored response it continues (``previous_response_id`` of ``/v1/responses``), both as the
    server parses the request (`_core.route`, built from each dialect's own reader in
    ``crates/llamarunner-core/src/dialects/routing_key.rs``).

    The key: the model the request names leads (on replicas that serve many models, a
    conversation goes where its model holds its prefix), then the conversation's messages
    (role, content) in order, or the prompt's text, or the texts to embed; at most
    `MAX_KEY_CHARS` characters. None when the request has no prompt (routes that generate
    nothing, an empty prompt, bodies that are not JSON objects, JSON nested too deep to
    parse: the replica answers those). A body the dialect refuses is keyed by its fields'
    plain text (the replica answers it a 400 wherever it goes)."""
    return _core.route(path, body)


def routing_key(path: str, body: bytes) -> str | None:
    """The routing key of a request to ``path`` with JSON ``body`` (see `route`)."""
    return route(path, body)[0]


# Response ids remembered per ingress (the replica's store keeps 1024 each).
MAX_RESPONSE_HOMES = 1 << 16


class ResponseHomes:
    """Which replica stored which `/v1/responses` response: learned from the answers
    (`RESPONSE_ID_HEADER` and the replica's name), so that a request naming it as its
    ``previous_response_id`` (or ``GET``/``DELETE /v1/responses/{id}``) is sent there: no
    other replica holds it, and it would answer a 404. Most recent ``limit`` ids, the oldest
    forgotten first."""

    def __init__(self, limit: int = MAX_RESPONSE_HOMES) -> None:
        self.limit = limit
        self._homes: OrderedDict[str, str] = OrderedDict()

    def learn(self, response_id: str, replica: str) -> None:
        self._homes[response_id] = replica
        self._homes.move_to_end(response_id)
        while len(self._homes) > self.limit:
            self._homes.popitem(last=False)

    def home(self, response_id: str | None) -> str | None:
        if not response_id:
            return None
        return self._homes.get(response_id)

    def __len__(self) -> int:
        return len(self._homes)


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (binary search on slices, so
    the comparisons run in C)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class AffinityPolicy:
    """How the router trades cache locality for load (documented in docs/scaling.md).

    A request goes to the replica that served its longest prefix when that prefix is a whole
    earlier request's key (the request continues it: a conversation's next turn) or covers at
    least ``min_match_ratio`` of the key (a shared system prompt, say), unless that replica's
    queue is longer than the least-loaded candidate's by more than ``max_queue_imbalance``
    requests; then (and for keys no replica holds) two random candidates are taken and the
    less loaded one wins
    (power of two choices), ties broken by the fewer cached prefixes."""

    min_match_ratio: float = 0.5
    max_queue_imbalance: int = 4
    max_prefixes_per_replica: int = 256

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_match_ratio <= 1.0:
            raise ValueError("min_match_ratio must be within 0..1")
        if self.max_queue_imbalance < 0:
            raise ValueError("max_queue_imbalance must be >= 0")
        if self.max_prefixes_per_replica < 1:
            raise ValueError("max_prefixes_per_replica must be >= 1")


class PrefixTable:
    """Which replica served which keys: per replica, its most recent keys (LRU, bounded). A
    key that extends one the replica holds replaces it (the same conversation, one turn on)."""

    def __init__(self, max_per_replica: int = 256) -> None:
        self.max_per_replica = max_per_replica
        self._keys: dict[str, OrderedDict[str, None]] = {}

    def replicas(self) -> list[str]:
        return list(self._keys)

    def size(self, replica: str) -> int:
        return len(self._keys.get(replica, ()))

    def insert(self, replica: str, key: str) -> None:
        keys = self._keys.setdefault(replica, OrderedDict())
        for old in [k for k in keys if key.startswith(k)]:
            del keys[old]
        keys[key] = None
        keys.move_to_end(key)
        while len(keys) > self.max_per_replica:
            keys.popitem(last=False)

    def remove(self, replica: str) -> None:
        self._keys.pop(replica, None)

    def best_match(self, key: str, candidates: Sequence[str]) -> tuple[str | None, int, bool]:
        """The candidate holding the longest prefix of ``key``, that prefix's length, and
        whether it is a whole key the replica was sent (``key`` continues it: the next turn
        of a conversation); (None, 0, False) when none holds any."""
        best: str | None = None
        best_len = 0
        whole = False
        for replica in candidates:
            for held in reversed(self._keys.get(replica, OrderedDict())):
                n = common_prefix_len(key, held)
                if n > best_len or (n == best_len and n == len(held) and not whole and n):
                    best, best_len, whole = replica, n, n == len(held)
        return best, best_len, whole


def choose(
    key: str | None,
    candidates: Sequence[str],
    load: Mapping[str, float],
    table: PrefixTable,
    policy: AffinityPolicy,
    rng: random.Random | None = None,
) -> list[list[str]]:
    """Ranked candidates for a request (the router's answer to Ray): first rank the replica
    holding the key's prefix when affinity applies, else two power-of-two choices; the rest
    follow as the fallback rank, least loaded first."""
    if not candidates:
        return []
    rng = rng or random.Random()
    # Ties in load go to the replica holding fewer prefixes when the request has a key (it
    # spreads new conversations), else at random.
    tiebreak = {r: (table.size(r) if key else 0, rng.random()) for r in candidates}

    def order(r: str) -> tuple[float, int, float]:
        return (load.get(r, 0.0), *tiebreak[r])

    least = min(candidates, key=order)
    if key:
        best, matched, whole = table.best_match(key, candidates)
        if (
            best is not None
            and (whole or matched >= policy.min_match_ratio * len(key))
            and load.get(best, 0.0) - load.get(least, 0.0) <= policy.max_queue_imbalance
        ):
            rest = sorted((r for r in candidates if r != best), key=order)
            return [[best], rest] if rest else [[best]]
    pair = rng.sample(list(candidates), min(2, len(candidates)))
    first = min(pair, key=order)
    rest = sorted((r for r in candidates if r != first), key=order)
    return [[first], rest] if rest else [[first]]


# How long the router counts a request it chose against a replica without hearing that it
# completed. The replica's own gauges (routing stats, refreshed every
# ``request_routing_stats_period_s``, 1 s by default) show a running request within a period
# or two, so the router's count only has to bridge that gap; past this age it is dropped, so
# a request whose completion never reaches the router (cancelled before it was sent, say)
# cannot skew routing for long.
IN_FLIGHT_TTL_S = 15.0

# Completed request ids remembered, so that a routing callback arriving after the request
# already completed does not count it again.
_FINISHED_MEMORY = 4096


class InFlight:
    """The requests a router has sent that have not completed, by replica.

    Ray Serve tells the router about a request three times, in an order it does not fix:
    the router's own choice, ``on_request_routed`` once the replica accepted it, and
    ``on_request_completed`` when it finished (its done-callback is registered before Ray
    waits for the acceptance, so a fast request such as GET /health can complete first).
    A count must neither outlive its request (a replica would look busy for ever and get no
    keyless request again) nor miss one sent in a burst."""

    def __init__(self, ttl_s: float = IN_FLIGHT_TTL_S) -> None:
        self.ttl_s = ttl_s
        # request id -> (replica, when counted), oldest first.
        self._counted: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._by_replica: dict[str, int] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()

    def chosen(self, request_id: str, replica: str, now: float) -> None:
        """The router chose ``replica`` for the request (a new try: a replica that refused
        it gets it no more)."""
        self._finished.pop(request_id, None)
        self._count(request_id, replica, now)

    def routed(self, request_id: str, replica: str, now: float) -> None:
        """The replica accepted the request (it may have completed already)."""
        if request_id not in self._finished:
            self._count(request_id, replica, now)

    def completed(self, request_id: str, replica: str) -> None:
        """The request to ``replica`` completed, or was refused or cancelled there."""
        counted = self._counted.get(request_id)
        if counted is not None and counted[0] != replica:
            return  # a refused try's callback, after the retry went elsewhere
        self._drop(request_id)
        self._finished[request_id] = None
        while len(self._finished) > _FINISHED_MEMORY:
            self._finished.popitem(last=False)

    def count(self, replica: str, now: float) -> int:
        self._expire(now)
        return self._by_replica.get(replica, 0)

    def forget(self, replica: str) -> None:
        """The replica is gone: its requests are not counted any more."""
        for request_id in [r for r, (name, _) in self._counted.items() if name == replica]:
            self._drop(request_id)

    def retain(self, live: set[str]) -> None:
        """Only ``live`` replicas are left: the others' requests are not counted any more."""
        for replica in [r for r in self._by_replica if r not in live]:
            self.forget(replica)

    def _count(self, request_id: str, replica: str, now: float) -> None:
        counted = self._counted.get(request_id)
        if counted is not None and counted[0] == replica:
            return
        self._drop(request_id)
        self._counted[request_id] = (replica, now)
        self._by_replica[replica] = self._by_replica.get(replica, 0) + 1

    def _drop(self, request_id: str) -> None:
        counted = self._counted.pop(request_id, None)
        if counted is None:
            return
        left = self._by_replica.get(counted[0], 0) - 1
        if left > 0:
            self._by_replica[counted[0]] = left
        else:
            self._by_replica.pop(counted[0], None)

    def _expire(self, now: float) -> None:
        while self._counted:
            request_id, (_, when) = next(iter(self._counted.items()))
            if now - when < self.ttl_s:
                break
            self._drop(request_id)
