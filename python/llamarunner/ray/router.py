"""`PrefixAffinityRouter`: Ray Serve's request-router API (``ray.serve.request_router``) with
the policy of `affinity.choose`.

Ray Serve makes one router per deployment handle (here: per ingress replica); each keeps its
own `PrefixTable` of what it sent where. A replica's load is the largest of three readings:
the server's own gauges (``requests_running + requests_waiting`` from `/metrics`, delivered
as the replica's routing stats every ``request_routing_stats_period_s``, so up to that old),
Ray's queue-length cache of the replica (as fresh as its last probe), and the requests this
router has chosen it for that have not completed (counted when chosen, so exact at once, but
blind to other routers'): a burst sent within one stats period is still seen.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from .affinity import AffinityPolicy, PrefixTable, choose
from .replica import ProxyRequest


def _proxy_request(pending: PendingRequest | None) -> ProxyRequest | None:
    if pending is None:
        return None
    for arg in pending.args:
        if isinstance(arg, ProxyRequest):
            return arg
    return None


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Sends a request to the replica that served its prefix, unless that one is much busier
    than the least-loaded one (see `AffinityPolicy`)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = AffinityPolicy(**kwargs)
        self.table = PrefixTable(self.policy.max_prefixes_per_replica)
        self._rng = random.Random()
        self._in_flight: dict[str, int] = {}
        # The replica each uncompleted request is counted against, by Ray's request id.
        self._counted: dict[str, str] = {}

    def replica_load(self, replica: RunningReplica) -> float:
        queued = max(
            self.replica_queue_len_cache.get(replica.replica_id) or 0,
            self._in_flight.get(replica.replica_id.unique_id, 0),
        )
        stats = replica.routing_stats or {}
        served = float(stats.get("requests_running", 0.0)) + float(
            stats.get("requests_waiting", 0.0)
        )
        return max(float(queued), served)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        req = _proxy_request(pending_request)
        if req is not None and req.replica is not None:
            pinned = by_name.get(req.replica)
            if pinned is not None:
                self._count(pending_request, pinned.replica_id.unique_id)
                return [[pinned]]
        load = {name: self.replica_load(r) for name, r in by_name.items()}
        ranks = choose(
            req.routing_key if req else None,
            list(by_name),
            load,
            self.table,
            self.policy,
            self._rng,
        )
        # Counted against its first choice at once: the next request's choice (a burst's
        # requests are chosen one after another before any is sent) sees it. Ray's callbacks
        # come later: `on_request_routed` once the replica has accepted (a round trip; a CI
        # run routed a whole burst home before it), and corrects the count if Ray sent the
        # request elsewhere.
        if ranks and ranks[0]:
            self._count(pending_request, ranks[0][0])
        return [[by_name[name] for name in rank] for rank in ranks]

    def _count(self, pending_request: PendingRequest | None, name: str) -> None:
        """Counts the request as in flight on `name` (moving it there if counted elsewhere)."""
        if pending_request is None:
            return
        request_id = pending_request.metadata.internal_request_id
        old = self._counted.get(request_id)
        if old == name:
            return
        if old is not None:
            self._uncount(old)
        self._counted[request_id] = name
        self._in_flight[name] = self._in_flight.get(name, 0) + 1

    def _uncount(self, name: str) -> None:
        left = self._in_flight.get(name, 0) - 1
        if left > 0:
            self._in_flight[name] = left
        else:
            self._in_flight.pop(name, None)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        self._count(pending_request, replica_id.unique_id)
        req = _proxy_request(pending_request)
        if req is not None and req.routing_key:
            self.table.insert(replica_id.unique_id, req.routing_key)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        name = self._counted.pop(internal_request_id, None)
        if name is not None:
            self._uncount(name)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.remove(replica_id.unique_id)
        self._in_flight.pop(replica_id.unique_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for name in self.table.replicas():
            if name not in live:
                self.table.remove(name)
                self._in_flight.pop(name, None)
