"""The library's commands: ``llamarunner pull``, ``list``, ``show`` and ``rm`` (`sources`);
and `resolve_source`, the model argument of ``serve`` and ``run`` as files."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .arguments import add_source_arguments
from .sources import ModelSourceError, ResolvedModel, resolve_model
from .sources.library import LibraryModel, gguf_summary, list_models, remove
from .sources.progress import (
    JsonProgress,
    NoProgress,
    Progress,
    TerminalProgress,
    human_size,
)
from .sources.resolve import looks_like_path

FAILED = 1


def add_library_parsers(sub: Any) -> None:
    p = sub.add_parser(
        "pull",
        help="download a model from Hugging Face (OWNER/REPO[:QUANT])",
        description=(
            "Fetch a model into the Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub, else "
            "~/.cache/huggingface/hub; shared with llama.cpp's -hf and other tools) with its "
            "projector, taking a cut connection up where it stopped and checking each file's "
            "SHA-256. "
            "MODEL is OWNER/REPO[:QUANT] (or hf.co/OWNER/REPO:QUANT): the file whose name "
            "holds QUANT, else Q4_K_M, else Q8_0, else the first GGUF; split files whole. A "
            "model already on this machine (a file, the cache, Ollama's store) is not fetched "
            "again. HF_ENDPOINT and HF_TOKEN are honoured."
        ),
    )
    p.add_argument("model", metavar="MODEL")
    add_source_arguments(p, hf_repo=False)
    p.add_argument(
        "--progress",
        choices=["auto", "json", "none"],
        default="auto",
        help="auto: a bar on a terminal, a line every few seconds otherwise; json: Ollama's "
        "/api/pull progress objects on stdout, one per line",
    )

    p = sub.add_parser(
        "list",
        help="list the models on this machine",
        description=(
            "Every model a MODEL argument can name here: --models-dir's, the Hugging Face "
            "cache's, Ollama's store's; with its size and what its GGUF header says."
        ),
    )
    p.add_argument("--models-dir", metavar="DIR", help="a models directory to list too")
    p.add_argument("--json", action="store_true", help="a JSON array instead of a table")

    p = sub.add_parser(
        "show",
        help="show a model's metadata",
        description=(
            "What MODEL resolves to here (nothing is downloaded) and what its GGUF header "
            "says: architecture, quantization, context length, chat template, and the "
            "defaults its source gives (Ollama's params and system prompt)."
        ),
    )
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--models-dir", metavar="DIR", help="a models directory to look in too")
    p.add_argument("--json", action="store_true", help="everything as JSON, all the metadata")
    p.add_argument("--template", action="store_true", help="print the chat template only")

    p = sub.add_parser(
        "rm",
        help="remove a model from the Hugging Face cache",
        description=(
            "Remove OWNER/REPO[:QUANT]'s files from the Hugging Face cache (and the "
            "repository's folder when no model of it is left). Ollama's store and files "
            "elsewhere are never touched."
        ),
    )
    p.add_argument("model", metavar="MODEL")


def resolve_source(spec: str | None, args: argparse.Namespace) -> ResolvedModel | None:
    """The model argument (or ``-hf``'s) as files, fetched with a progress bar (`sources`);
    None for the default model and for a path. Raises ModelSourceError."""
    if spec is None or (args.hf_repo is None and looks_like_path(spec)):
        return None  # the default model, or a path: the engine reports a bad file
    return resolve_model(
        spec,
        offline=args.offline,
        mmproj=not args.no_mmproj,
        huggingface_only=args.hf_repo is not None,
        progress=TerminalProgress(),
    )


def _error(message: str, code: int = FAILED) -> int:
    print(f"llamarunner: error: {message}", file=sys.stderr)
    return code


def pull(args: argparse.Namespace) -> int:
    progress: Progress
    if args.progress == "json":
        progress = JsonProgress()
    elif args.progress == "none":
        progress = NoProgress()
    else:
        progress = TerminalProgress()
    try:
        resolved = resolve_model(
            args.model, offline=args.offline, mmproj=not args.no_mmproj, progress=progress
        )
    except ModelSourceError as e:
        if args.progress == "json":
            print(json.dumps({"error": str(e), "type": e.kind}), flush=True)
        return _error(str(e), e.exit_code)
    if args.progress == "json":
        progress.status("success")
        return 0
    where = {
        "file": "a file",
        "models-dir": "in the models directory",
        "huggingface": "in the Hugging Face cache",
        "ollama": "in Ollama's store",
    }[resolved.source]
    projector = f" (projector {resolved.mmproj})" if resolved.mmproj else ""
    print(f"{resolved.name}: {where}: {resolved.path}{projector}")
    return 0


def _row(m: LibraryModel) -> dict[str, Any]:
    try:
        summary = gguf_summary(m.path)
    except (ValueError, OSError):
        summary = {}
    return {
        "name": m.name,
        "source": m.source,
        "path": str(m.path),
        "size": m.size,
        "architecture": summary.get("architecture"),
        "quantization": summary.get("quantization"),
        "context_length": summary.get("context_length"),
        "mmproj": str(m.mmproj) if m.mmproj else None,
    }


def list_command(args: argparse.Namespace) -> int:
    try:
        rows = [_row(m) for m in list_models(args.models_dir)]
    except (ModelSourceError, ValueError) as e:
        return _error(str(e))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no models: pull one (llamarunner pull OWNER/REPO[:QUANT])")
        return 0
    header = ("NAME", "SOURCE", "SIZE", "ARCH", "QUANT", "CONTEXT", "PROJECTOR")
    table = [header]
    for r in rows:
        table.append(
            (
                r["name"],
                r["source"],
                human_size(r["size"]),
                r["architecture"] or "?",
                r["quantization"] or "?",
                str(r["context_length"] or "?"),
                "yes" if r["mmproj"] else "",
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def show(args: argparse.Namespace) -> int:
    try:
        resolved = resolve_model(args.model, models_dir=args.models_dir, download=False)
    except ModelSourceError as e:
        return _error(str(e), e.exit_code)
    try:
        summary = gguf_summary(resolved.path)
    except ValueError as e:
        return _error(str(e))
    if args.template:
        print(summary["chat_template"] or "")
        return 0 if summary["chat_template"] else _error("the model has no chat template")
    out = {
        "name": resolved.name,
        "source": resolved.source,
        "path": str(resolved.path),
        "mmproj": str(resolved.mmproj) if resolved.mmproj else None,
        "defaults": resolved.defaults,
        **summary,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for key in ("name", "source", "path", "mmproj", "architecture", "general_name"):
        if out.get(key) is not None:
            print(f"{key.replace('_', ' '):15} {out[key]}")
    for key in ("quantization", "context_length", "parameters"):
        if out.get(key) is not None:
            print(f"{key.replace('_', ' '):15} {out[key]}")
    template = summary["chat_template"]
    print(
        f"{'chat template':15} "
        + (f"{len(template)} characters (--template)" if template else "none")
    )
    for name, value in resolved.defaults.items():
        print(f"{name.replace('_', ' '):15} {value!r}")
    for note in resolved.notes:
        print(f"note: {note}")
    print(f"{'fit here':15} {fit_estimate(resolved.path, resolved.mmproj)}")
    return 0


def fit_estimate(model: Path, mmproj: Path | None) -> str:
    """Where the model's weights would go on this machine: the GPUs' free memory (less
    --fit-target's default margin) against the files' size. An estimate: the fit made at load
    (`--fit`) also counts the KV cache and compute buffers."""
    from . import _core, _gpu_modules
    from .settings import SERVER_SETTINGS

    size = sum(p.stat().st_size for p in (model, mmproj) if p is not None)
    try:
        _gpu_modules.prepare()
        devices = json.loads(_core.list_devices())
    except RuntimeError as e:
        return f"unknown ({e})"
    gpus = [d for d in devices if d["kind"] in ("gpu", "integrated_gpu")]
    if not gpus:
        return f"on the CPU: no GPU found ({size / 2**20:.0f} MiB of weights in RAM)"
    margin = int(SERVER_SETTINGS["fit_target"].default) << 20
    free = sum(max(0, int(d["memory_free"]) - margin) for d in gpus)
    names = ", ".join(str(d["name"]) for d in gpus)
    if free >= size:
        return f"all layers on {names} ({size / 2**20:.0f} MiB of {free / 2**20:.0f} MiB free)"
    share = free / size if size else 0.0
    return (
        f"about {share:.0%} of the layers on {names} ({free / 2**20:.0f} MiB free for "
        f"{size / 2**20:.0f} MiB of weights), the rest on the CPU"
    )


def rm(args: argparse.Namespace) -> int:
    try:
        removed = remove(args.model)
    except ModelSourceError as e:
        return _error(str(e))
    for p in removed:
        print(f"removed {p}")
    return 0


COMMANDS = {"pull": pull, "list": list_command, "show": show, "rm": rm}
"""Each library command's function, by its name."""
