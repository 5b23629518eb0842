"""`gauge_policy`: a Ray Serve autoscaling policy on the replicas' own gauges.

Each replica reports its server's ``requests_running``, ``requests_waiting`` and
``kv_cache_usage_perc`` (``LlamaReplica.record_autoscaling_stats``, the `/metrics` gauges);
Ray aggregates them per replica over ``look_back_period_s``. The policy asks for enough
replicas that each has ``target_ongoing_requests`` (by default ``--parallel``) requests
running or waiting, and one more while the mean KV cache usage is above `KV_HIGH` (the
slots are nearly full of long sequences). Ray applies
``min_replicas``/``max_replicas`` and the up/down-scale delays. Before any replica has
reported, it falls back on Ray's own count of ongoing requests.
"""

from __future__ import annotations

import math
from typing import Any

KV_HIGH = 0.9


def desired_replicas(
    running: float, waiting: float, kv_usage: float | None, target: float, kv_high: float
) -> int:
    """Replicas for ``running + waiting`` requests at ``target`` per replica, plus one when
    the mean KV usage is above ``kv_high``; at least 1 (Ray bounds it by min/max)."""
    want = math.ceil((running + waiting) / max(target, 1e-9))
    if kv_usage is not None and kv_usage > kv_high:
        want += 1
    return max(want, 1)


def gauge_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """The policy function (``autoscaling_config.policy.policy_function``); ``ctx`` is Ray
    Serve's ``AutoscalingContext``."""
    state: dict[str, Any] = dict(ctx.policy_state or {})
    target = float(ctx.config.get_target_ongoing_requests()) if ctx.config is not None else 1.0
    metrics = ctx.aggregated_metrics or {}
    running = metrics.get("requests_running") or {}
    waiting = metrics.get("requests_waiting") or {}
    kv = metrics.get("kv_cache_usage_perc") or {}
    if not running and not waiting:
        total = float(ctx.total_num_requests or 0.0)
        return desired_replicas(total, 0.0, None, target, KV_HIGH), state
    kv_mean = sum(kv.values()) / len(kv) if kv else None
    load = (float(sum(running.values())), float(sum(waiting.values())))
    return desired_replicas(*load, kv_mean, target, KV_HIGH), state
