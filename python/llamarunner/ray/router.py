"""`PrefixAffinityRouter`: Ray Serve's request-router API (``ray.serve.request_router``) with
the policy of `affinity.choose`.

Ray Serve makes one router per deployment handle (here: per ingress replica); each keeps its
own `PrefixTable` of what it sent where. A replica's load is the larger of two readings: the
server's own gauges (``requests_running + requests_waiting`` from `/metrics`, delivered as the
replica's routing stats every ``request_routing_stats_period_s``, so up to that old, but
counting every router's requests), and the requests this router has chosen it for that have
not completed (`affinity.InFlight`: counted when chosen, so exact at once, but blind to other
routers'): a burst sent within one stats period is still seen.

Ray's own queue-length cache of each replica is not read. It is set from the count a replica
reports when it accepts a request and decremented when one completes; those two messages
cross, so after concurrent requests the cache can hold a request that has finished, for up to
its staleness timeout (10 s). Idle replicas then differ by a phantom request, and every keyless
request goes to the other one (seen: 40 GET /health in a row to one of two idle replicas).
"""

from __future__ import annotations

import random
import time
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from .affinity import AffinityPolicy, InFlight, PrefixTable, choose
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
        self.in_flight = InFlight()

    def replica_load(self, replica: RunningReplica) -> float:
        queued = self.in_flight.count(replica.replica_id.unique_id, time.monotonic())
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
                self._chosen(pending_request, pinned.replica_id.unique_id)
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
            self._chosen(pending_request, ranks[0][0])
        return [[by_name[name] for name in rank] for rank in ranks]

    def _chosen(self, pending_request: PendingRequest | None, name: str) -> None:
        if pending_request is not None:
            request_id = pending_request.metadata.internal_request_id
            self.in_flight.chosen(request_id, name, time.monotonic())

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        request_id = pending_request.metadata.internal_request_id
        self.in_flight.routed(request_id, replica_id.unique_id, time.monotonic())
        req = _proxy_request(pending_request)
        if req is not None and req.routing_key:
            self.table.insert(replica_id.unique_id, req.routing_key)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.in_flight.completed(internal_request_id, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.remove(replica_id.unique_id)
        self.in_flight.forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for name in self.table.replicas():
            if name not in live:
                self.table.remove(name)
        self.in_flight.retain(live)
