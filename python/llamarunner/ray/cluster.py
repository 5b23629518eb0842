"""``llamarunner cluster``: start or join a Ray cluster, serve `build_app` on it until Ctrl-C
or SIGTERM, then remove what was started (the application; the Ray cluster too when this
command started it)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

import ray
from ray import serve

from ..arguments import many_models, serve_settings
from ..config import NoModelError, ServerConfig
from ..sources import ModelSourceError
from .app import build_app

APP_NAME = "llamarunner"

# Flags of `cluster` that are not server settings.
CLUSTER_FLAGS = (
    "command",
    "replicas",
    "min_replicas",
    "max_replicas",
    "address",
    "num_cpus",
    "num_gpus",
    "routing",
    "max_queue_imbalance",
    "min_match_ratio",
)


def _say(message: str) -> None:
    print(f"llamarunner: {message}", file=sys.stderr, flush=True)


def run_cluster(args: argparse.Namespace) -> int:
    values = vars(args)
    models, router_flags, settings = serve_settings(args, exclude=CLUSTER_FLAGS)
    try:
        many = many_models(models, router_flags, settings)
    except ValueError as e:
        _say(f"error: {e}")
        return 2
    if router_flags.get("allow_pull"):
        _say(
            "error: --allow-pull is for `serve`; fetch models on each node with `llamarunner pull`"
        )
        return 2
    router_flags.pop("allow_pull", None)
    server_config = {k: v for k, v in settings.items() if v is not None}
    router = {k: v for k, v in router_flags.items() if v is not None}
    if many:
        server_config.pop("model", None)
        router["models"] = models
    try:
        # The endpoint's address: flags, then LLAMARUNNER_HOST/PORT, as for `serve`.
        config = ServerConfig.resolve(server_config)
    except (ValueError, TypeError) as e:
        _say(f"error: {e}")
        return 2
    server_config.pop("host", None)
    server_config.pop("port", None)
    affinity = {
        k: values[k] for k in ("max_queue_imbalance", "min_match_ratio") if values[k] is not None
    }
    actor_options: dict[str, Any] | None = None
    if args.num_cpus is not None or args.num_gpus is not None:
        threads = config.threads if config.threads > 0 else 1
        actor_options = {
            "num_cpus": args.num_cpus if args.num_cpus is not None else threads,
            "num_gpus": args.num_gpus or 0,
        }
    try:
        app = build_app(
            replicas=args.replicas,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            ray_actor_options=actor_options,
            routing=args.routing,
            affinity=affinity,
            **router,
            **server_config,
        )
    except (ValueError, TypeError, NoModelError) as e:
        _say(f"error: {e}")
        return 2
    except ModelSourceError as e:
        _say(f"error: {e}")
        return e.exit_code

    started_ray = args.address is None
    if started_ray and not many:
        # One machine: the replicas read the model here, so a missing one is a usage error
        # now rather than replicas failing to start.
        try:
            model = config.with_model_resolved().model or ""
        except NoModelError as e:
            _say(f"error: {e}")
            return 2
        except ModelSourceError as e:
            _say(f"error: {e}")
            return e.exit_code
        if not Path(model).expanduser().is_file():
            _say(f"error: no such model file: {model}")
            return 2

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    host, port = config.host, config.port
    try:
        if started_ray:
            _say("starting a local Ray cluster")
            ray.init(address="local", logging_level=logging.WARNING)
        else:
            _say(f"joining the Ray cluster at {args.address}")
            ray.init(address=args.address, logging_level=logging.WARNING)
        # Ray's driver installs its own SIGTERM handler (it aborts the process): ours again.
        signal.signal(signal.SIGTERM, on_sigterm)
        serve.start(http_options={"host": host, "port": port})
        what = "many models" if many else config.model or "the default model"
        _say(f"deploying {args.replicas} replica(s) of {what}")
        serve.run(app, name=APP_NAME, route_prefix="/")
        _say(f"ready on http://{host}:{port} ({args.replicas} replica(s), routing {args.routing})")
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        _say("shutting down")
        return 0
    except Exception as e:  # deployment failed: a bad model on a replica, say
        _say(f"error: {e}")
        return 1
    finally:
        _shutdown(started_ray)


def _shutdown(started_ray: bool) -> None:
    try:
        if ray.is_initialized():
            if started_ray:
                serve.shutdown()  # type: ignore[no-untyped-call]
            else:
                serve.delete(APP_NAME)
    finally:
        if ray.is_initialized():
            ray.shutdown()
