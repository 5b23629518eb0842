"""`build_app`: the Ray Serve application (the ingress bound to the replica deployment)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application, Deployment

from ..config import ServerConfig, default_cache_ram_mib
from ..router import models_memory_mib, router_config_json, served_models
from ..settings import DEFAULT_KEEP_ALIVE, DEFAULT_MODELS_MAX, DEFAULT_MODELS_MEMORY
from .affinity import AffinityPolicy
from .ingress import Ingress, key_digest
from .replica import LlamaReplica

ROUTERS = ("affinity", "pow2")
REPLICA_DEPLOYMENT = "LlamaReplica"
INGRESS_DEPLOYMENT = "LlamaIngress"
# By path, so that a Serve config file can name it too.
ROUTER_PATH = "llamarunner.ray.router:PrefixAffinityRouter"
AUTOSCALING_POLICY_PATH = "llamarunner.ray.autoscaling:gauge_policy"


def build_app(
    model: str | None = None,
    *,
    replicas: int = 1,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    ray_actor_options: Mapping[str, Any] | None = None,
    routing: str = "affinity",
    affinity: AffinityPolicy | Mapping[str, Any] | None = None,
    max_ongoing_requests: int | None = None,
    routing_stats_period_s: float = 1.0,
    autoscaling: Mapping[str, Any] | None = None,
    models: Sequence[str | Path] | None = None,
    models_dir: str | Path | None = None,
    models_preset: str | Path | None = None,
    library: bool = False,
    models_max: int = DEFAULT_MODELS_MAX,
    keep_alive: str | float = DEFAULT_KEEP_ALIVE,
    models_memory: int = DEFAULT_MODELS_MEMORY,
    **server_config: Any,
) -> Application:
    """A Ray Serve application serving ``model`` from ``replicas`` replicas behind one HTTP
    ingress that speaks the native, OpenAI and Ollama APIs.

    Many models: ``models_dir``, ``models`` (files), ``library`` and ``models_preset`` as for
    `llamarunner.Server`; then every replica is a router of them all (each model loaded on
    its first request there, at most ``models_max`` at once, unloaded after ``keep_alive``
    idle), and the routing key leads with the request's ``model``, so a conversation goes to
    the replica where its model holds its prefix. ``models_memory`` -1 (the default): the
    replicas share 80 % of the memory of the machine this runs on.

    ``server_config`` is each replica's configuration, as `llamarunner.Server` takes it
    (``parallel``, ``ctx_size``, ``threads``, ...; ``LLAMARUNNER_*`` variables apply as for
    ``llamarunner serve``); ``host`` and ``port`` are ignored (a replica's server listens on
    loopback; Serve's HTTP options say where the application listens). ``model`` must be a
    path every node can read; None: the default model, installed on every node.

    ``min_replicas``/``max_replicas``: autoscale between them (starting at ``replicas``) with
    `autoscaling.gauge_policy`, on the replicas' own gauges, aiming at ``parallel`` requests
    running or waiting per replica; ``autoscaling`` adds or overrides Ray Serve
    ``autoscaling_config`` fields (``upscale_delay_s``, ``target_ongoing_requests``, ...).
    ``ray_actor_options``: resources of each replica (default ``{"num_cpus": threads}``, 1
    when ``threads`` is 0). ``routing``: "affinity" (`PrefixAffinityRouter`, tuned by
    ``affinity``, an `AffinityPolicy` or its fields) or "pow2" (Ray Serve's default
    power-of-two-choices router). ``max_ongoing_requests``: requests Ray sends one replica
    at once (default ``2 * parallel``: its slots plus as many waiting); the rest wait in
    the router.
    """
    if routing not in ROUTERS:
        raise ValueError(f"routing must be one of {', '.join(ROUTERS)}, not {routing!r}")
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    many = models_dir is not None or bool(models) or models_preset is not None or library
    if many and model is not None:
        raise ValueError("give model, or models / models_dir / models_preset, not both")
    config = ServerConfig.resolve({"model": model, **server_config})
    if config.parallel < 1:
        raise ValueError("parallel must be >= 1")
    policy = (
        affinity if isinstance(affinity, AffinityPolicy) else AffinityPolicy(**(affinity or {}))
    )
    options: dict[str, Any] = {
        "name": REPLICA_DEPLOYMENT,
        "ray_actor_options": dict(
            ray_actor_options
            if ray_actor_options is not None
            else {"num_cpus": config.threads if config.threads > 0 else 1}
        ),
        "max_ongoing_requests": max_ongoing_requests or 2 * config.parallel,
        "graceful_shutdown_timeout_s": max(config.shutdown_timeout, 1.0),
        "health_check_period_s": 2.0,
        # A replica that cannot load the model (a bad file on its node) fails the deployment
        # after a few tries instead of being retried for minutes.
        "max_constructor_retry_count": 3,
    }
    if min_replicas is not None or max_replicas is not None:
        lo = 1 if min_replicas is None else min_replicas
        hi = max(replicas, lo) if max_replicas is None else max_replicas
        if not 0 <= lo <= replicas <= hi or hi < 1:
            raise ValueError("need 0 <= min_replicas <= replicas <= max_replicas, max >= 1")
        options["autoscaling_config"] = {
            "min_replicas": lo,
            "max_replicas": hi,
            "initial_replicas": replicas,
            "target_ongoing_requests": config.parallel,
            "policy": {"policy_function": AUTOSCALING_POLICY_PATH},
            **(autoscaling or {}),
        }
    else:
        options["num_replicas"] = replicas
    if routing == "affinity":
        options["request_router_config"] = {
            "request_router_class": ROUTER_PATH,
            "request_router_kwargs": dataclasses.asdict(policy),
            "request_routing_stats_period_s": routing_stats_period_s,
        }
    replica: Deployment = serve.deployment(**options)(LlamaReplica)
    ingress: Deployment = serve.deployment(
        name=INGRESS_DEPLOYMENT,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=config.max_connections,
    )(Ingress)
    replica_config = dataclasses.asdict(config)
    most = max(1, options.get("autoscaling_config", {}).get("max_replicas", replicas))
    router: dict[str, Any] | None = None
    if many:
        if models_max < 1:
            raise ValueError("models_max must be >= 1")
        files = [str(m) for m in models or []]
        # The router's configuration, made here as each replica's `Server` makes it, so that
        # an empty directory, a bad presets file, keep-alive or memory budget is refused now,
        # not in every replica (which reads the paths again: they must exist on every node).
        router_config_json(
            config,
            served_models(files, models_dir, models_preset, library=library),
            models_max=models_max,
            keep_alive=keep_alive,
            models_memory=models_memory,
        )
        router = {
            "models": files,
            "models_dir": None if models_dir is None else str(models_dir),
            "models_preset": None if models_preset is None else str(models_preset),
            "models_max": models_max,
            "keep_alive": keep_alive,
            # Replicas may share a node: by default they share its budget.
            "models_memory": models_memory_mib(models_memory) // most
            if models_memory == -1
            else models_memory,
        }
    if config.cache_ram < 0:
        # Each replica's prompt cache would take a quarter of its node's memory; replicas may
        # share a node, so by default they share that quarter (and a replica's models, its
        # share).
        share = most * (models_max if many else 1)
        replica_config["cache_ram"] = default_cache_ram_mib() // share
    app: Application = ingress.bind(
        replica.bind(replica_config, router),
        config.max_body,
        [key_digest(k) for k in config.api_keys()],
    )
    return app


def app_builder(args: dict[str, Any]) -> Application:
    """For a Serve config file: ``import_path: llamarunner.ray:app_builder`` with ``args``
    holding `build_app`'s keywords (``model``, ``replicas``, ``parallel``, ...)."""
    return build_app(**args)
