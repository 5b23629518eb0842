"""Starts a server from llama-server's command line, for llama.cpp's own server tests
(`benches/conformance.py`): either llama-server itself or llamarunner, both on one local model.

llama.cpp's tests (`tools/server/tests/utils.py`) start `$LLAMA_SERVER_BIN_PATH` with
llama-server's flags and a model from Hugging Face (`--hf-repo`/`--hf-file`). This program
stands in for that binary: the model flags are replaced by `--model $CONFORMANCE_MODEL` (there
is no hub here, and both servers must serve the same model), and then

- with `CONFORMANCE_TARGET=llama-server`, it runs `$CONFORMANCE_LLAMA_SERVER` with the other
  flags unchanged;
- with `CONFORMANCE_TARGET=llamarunner`, it runs `llamarunner serve` with each flag mapped to
  ours (`FLAG_MAP`, below). Flags that only tune llama-server, or that name a feature we
  deliberately lack, are dropped and said on stderr: the tests that need them fail and
  `conformance.py` lists them.

The mapping follows each flag's meaning, not its spelling: llama-server's `--ctx-size` is the
whole cache, shared by `--parallel` slots; ours is per sequence, so it is divided (at least
256 per slot); with `--kv-unified` both share one cache of that size (ours holds ctx-size x
parallel cells).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Sequence

# llama-server flag -> (our flag or None to drop, takes a value). Flags absent here are dropped
# with a note; their value (when the next word is not a flag) goes with them.
FLAG_MAP: dict[str, tuple[str | None, bool]] = {
    "--host": ("--host", True),
    "--port": ("--port", True),
    "--threads": ("--threads", True),
    "-t": ("--threads", True),
    "--batch-size": ("--batch-size", True),
    "-b": ("--batch-size", True),
    "--n-gpu-layers": ("--n-gpu-layers", True),
    "-ngl": ("--n-gpu-layers", True),
    "--alias": ("--alias", True),
    "-a": ("--alias", True),
    "--api-key": ("--api-key", True),
    "--slot-save-path": ("--slot-save-path", True),
    "--lora": ("--lora", True),
    "--swa-full": ("--swa-full", False),
    "--backend-sampling": ("--backend-sampling", False),
    "--chat-template-file": ("--chat-template", True),
    "--model-draft": ("--draft-model", True),
    "-md": ("--draft-model", True),
    "--spec-draft-n-max": ("--draft-max", True),
    "--spec-draft-n-min": ("--draft-min", True),
    "--cors-origins": ("--allow-origin", True),
    "--reasoning": ("--reasoning", True),
    "-rea": ("--reasoning", True),
    "--verbose": ("--verbose", False),
    # Ours always batches continuously, serves embeddings, reranking and /slots, renders
    # templates with Jinja; the context shift and /metrics are off unless asked for (as there).
    "--cont-batching": (None, False),
    "--embedding": (None, False),
    "--embeddings": (None, False),
    "--reranking": (None, False),
    "--metrics": ("--metrics", False),
    "--slots": (None, False),
    "--jinja": (None, False),
    "--context-shift": ("--context-shift", False),
    "--no-context-shift": ("--no-context-shift", False),
    "--kv-unified": ("--kv-unified", False),
    "--no-ui": (None, False),
    "--offline": (None, False),
    "--seed": ("--seed", True),
    "-s": ("--seed", True),
    "--temp": ("--temp", True),
    "--top-k": ("--top-k", True),
    "--top-p": ("--top-p", True),
    "--min-p": ("--min-p", True),
    "--repeat-penalty": ("--repeat-penalty", True),
    "--repeat-last-n": ("--repeat-last-n", True),
    "--presence-penalty": ("--presence-penalty", True),
    "--frequency-penalty": ("--frequency-penalty", True),
    "--mirostat": ("--mirostat", True),
    "--mirostat-lr": ("--mirostat-lr", True),
    "--mirostat-ent": ("--mirostat-ent", True),
    "--typical": ("--typical", True),
    "--dry-multiplier": ("--dry-multiplier", True),
    "--dry-base": ("--dry-base", True),
    "--dry-allowed-length": ("--dry-allowed-length", True),
    "--dry-penalty-last-n": ("--dry-penalty-last-n", True),
    "--xtc-probability": ("--xtc-probability", True),
    "--xtc-threshold": ("--xtc-threshold", True),
    "--top-nsigma": ("--top-n-sigma", True),
    "--top-n-sigma": ("--top-n-sigma", True),
    "--dynatemp-range": ("--dynatemp-range", True),
    "--dynatemp-exp": ("--dynatemp-exp", True),
    "--pooling": ("--pooling", True),
    # Tuning that has no counterpart: llama.cpp's micro-batch.
    "--ubatch-size": (None, True),
    "-ub": (None, True),
}

# Handled below: the model, the cache size and slots, and flags whose values change.
MODEL_FLAGS = {"--model", "-m", "--hf-repo", "-hfr", "-hf", "--hf-file", "-hff", "--model-url"}


def _value_follows(args: Sequence[str], i: int) -> bool:
    """Whether the word after flag `i` is its value: not a flag (a negative number is a
    value: `--n-predict -1`)."""
    if i + 1 >= len(args):
        return False
    word = args[i + 1]
    if word.startswith("-") and len(word) > 1:
        try:
            float(word)
        except ValueError:
            return False
    return True


# Our built-in templates (`--chat-template NAME`).
BUILTIN_TEMPLATES = {"gemma", "chatml", "llama3", "phi3", "mistral", "command-r"}


def chat_template(value: str) -> list[str]:
    """llama-server's `--chat-template` is a built-in name or a Jinja template's text; ours is
    a built-in name or a file: the text goes to a file."""
    if value in BUILTIN_TEMPLATES or os.path.isfile(value):
        return ["--chat-template", value]
    if "{%" in value or "{{" in value:
        fd, path = tempfile.mkstemp(suffix=".jinja", prefix="shim-template-")
        with os.fdopen(fd, "w") as f:
            f.write(value)
        return ["--chat-template", path]
    print(f"llama_server_shim: --chat-template {value} dropped (no such built-in)", file=sys.stderr)
    return []


def llamarunner_command(args: Sequence[str], model: str) -> list[str]:
    """`llamarunner serve` arguments for llama-server's `args`."""
    out: list[str] = []
    ctx: int | None = None
    parallel = 4  # llama-server's default ("auto": 4 slots)
    i = 0
    while i < len(args):
        flag = args[i]
        takes = _value_follows(args, i)
        value = args[i + 1] if takes else ""
        if flag in MODEL_FLAGS:
            i += 2 if takes else 1
            continue
        if flag in ("--ctx-size", "-c"):
            ctx = int(value)
        elif flag in ("--parallel", "-np"):
            parallel = max(1, int(value))
        elif flag in ("--n-predict", "-n"):
            out += ["--n-predict", value]
        elif flag in ("-fa", "--flash-attn"):
            out += ["--flash-attn", {"1": "on", "0": "off"}.get(value, value)]
        elif flag in ("-ctk", "--cache-type-k"):
            out += ["--kv-cache-type", value]
        elif flag in ("-ctv", "--cache-type-v"):
            pass  # ours sets K and V together (-ctk)
        elif flag == "--cache-ram":
            out += ["--cache-ram", value]
        elif flag == "--chat-template":
            out += chat_template(value)
        elif flag == "--reasoning-format":
            out += ["--reasoning-format", "none" if value == "none" else "auto"]
        elif flag in FLAG_MAP:
            ours, has_value = FLAG_MAP[flag]
            if ours is not None:
                out += [ours, value] if has_value else [ours]
            i += 2 if has_value and takes else 1
            continue
        else:
            print(f"llama_server_shim: {flag} {value} dropped (no counterpart)", file=sys.stderr)
        i += 2 if takes else 1
    out += ["--parallel", str(parallel)]
    # llama-server's defaults where ours differ: every browser origin allowed (unless server
    # tools or MCP servers are on, which make it loopback, ours always), no context shift, no
    # /metrics.
    explicit_origins = "--cors-origins" in args
    tools = any(f in args for f in ("--tools", "--mcp-servers-config", "--mcp-servers-json"))
    if not explicit_origins and not tools:
        out += ["--allow-origin", "*"]
    if "--context-shift" not in out:
        out.append("--no-context-shift")
    if "--metrics" in out:
        out.remove("--metrics")
    else:
        out.append("--no-metrics")
    if ctx and "--kv-unified" in out:
        # One cache of the same size, shared: ours holds ctx-size x parallel cells.
        out += ["--ctx-size", str(max(16, ctx // parallel))]
    elif ctx:
        out += ["--ctx-size", str(max(256, ctx // parallel))]
    return [sys.executable, "-m", "llamarunner", "serve", model, *out]


def llama_server_command(args: Sequence[str], model: str, binary: str) -> list[str]:
    """llama-server's own arguments, the model flags replaced by the local model."""
    out: list[str] = []
    i = 0
    while i < len(args):
        if args[i] in MODEL_FLAGS:
            i += 2 if _value_follows(args, i) else 1
            continue
        out.append(args[i])
        i += 1
    return [binary, "--model", model, *out]


def main(argv: Sequence[str]) -> None:
    model = os.environ["CONFORMANCE_MODEL"]
    if os.environ.get("CONFORMANCE_TARGET") == "llama-server":
        cmd = llama_server_command(argv, model, os.environ["CONFORMANCE_LLAMA_SERVER"])
    else:
        cmd = llamarunner_command(argv, model)
    print("llama_server_shim: " + " ".join(cmd), file=sys.stderr, flush=True)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
