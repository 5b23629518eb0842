"""The library: every model this machine holds where a model argument can name it (a models
directory, the Hugging Face cache, Ollama's store), with what its GGUF header says; and the
removal of a model from the Hugging Face cache (never from Ollama's store, never a file the
user put somewhere)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import huggingface, ollama_store
from .errors import ModelSourceError
from .models_dir import discover

FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4",
}
"""``general.file_type`` (llama.cpp's ``llama_ftype``) as its quantization's name."""


@dataclass(frozen=True)
class LibraryModel:
    """A model the library holds: the name a model argument takes, its source
    (``models-dir``, ``huggingface``, ``ollama``), its file(s), projector and its source's
    default settings (Ollama's params and system prompt)."""

    name: str
    source: str
    path: Path
    size: int
    mmproj: Path | None = None
    defaults: dict[str, Any] = field(default_factory=dict)


def _total_size(paths: list[Path]) -> int:
    total = 0
    for p in paths:
        with suppress(OSError):
            total += p.stat().st_size
    return total


def _hf_models(s: huggingface.HubSettings) -> Iterator[LibraryModel]:
    if not s.cache_dir.is_dir():
        return
    for folder in sorted(s.cache_dir.glob("models--*--*")):
        owner_repo = folder.name[len("models--") :].split("--", 1)
        ref = huggingface.parse_ref("/".join(owner_repo))
        if ref is None:
            continue
        cached = huggingface.cached_files(ref, s)
        if cached is None:
            continue
        commit, files = cached
        snapshot = folder / "snapshots" / commit
        for f in files:
            info = huggingface.split_info(f.path)
            if info is None or not huggingface.is_model_file(f.path) or info.index != 1:
                continue
            try:
                plan = huggingface.plan_files(huggingface.HfRef(ref.repo, info.tag or None), files)
            except ModelSourceError:
                continue
            if plan.model[0].path != f.path:
                continue  # its tag names another file first: no name reaches it
            name = f"{ref.repo}:{info.tag}" if info.tag else ref.repo
            paths = [snapshot / p.path for p in plan.model]
            mmproj = snapshot / plan.mmproj.path if plan.mmproj else None
            yield LibraryModel(name, "huggingface", paths[0], _total_size(paths), mmproj)


def list_models(models_dir: str | Path | None = None) -> list[LibraryModel]:
    """Every model of the models directory, the Hugging Face cache and Ollama's store."""
    out: list[LibraryModel] = []
    if models_dir is not None:
        for m in discover(models_dir):
            out.append(LibraryModel(m.name, "models-dir", m.path, _total_size([m.path]), m.mmproj))
    out.extend(_hf_models(huggingface.HubSettings.from_env(offline=True)))
    root = ollama_store.store_root()
    for name in ollama_store.list_models(root):
        try:
            model = ollama_store.read_model(name, root)
        except ModelSourceError:
            continue
        if model is not None:
            out.append(
                LibraryModel(
                    str(name), "ollama", model.path, model.size, model.mmproj, model.defaults
                )
            )
    return out


def gguf_summary(path: Path) -> dict[str, Any]:
    """What a GGUF header says of a model: architecture, ``general.name``, quantization,
    context length, parameters (when written), chat template; the whole metadata under
    ``metadata``. Raises ValueError for a file that is not GGUF."""
    from .. import _core

    meta: dict[str, Any] = json.loads(_core.gguf_metadata(str(path)))
    arch = meta.get("general.architecture")
    file_type = meta.get("general.file_type")
    return {
        "architecture": arch,
        "general_name": meta.get("general.name"),
        "quantization": FILE_TYPES.get(file_type, str(file_type))
        if isinstance(file_type, int)
        else None,
        "context_length": meta.get(f"{arch}.context_length") if arch else None,
        "parameters": meta.get("general.size_label"),
        "chat_template": meta.get("tokenizer.chat_template"),
        "metadata": meta,
    }


def remove(spec: str) -> list[Path]:
    """Removes the Hugging Face model ``spec`` (``owner/repo[:QUANT]``) from the cache: its
    files (a blob only when it is in the repository's ``blobs/`` and no other snapshot points
    to it), and the repository's folder when no file of it is left. Returns the files
    removed. Raises ModelSourceError (``not_ours`` for anything not in that cache)."""
    ref = huggingface.parse_ref(spec)
    if ref is None:
        name = ollama_store.parse_name(spec)
        where = (
            "a model of Ollama's store: remove it with `ollama rm`"
            if name is not None and ollama_store.read_model(name) is not None
            else "not a model llamarunner downloaded"
        )
        raise ModelSourceError(
            f"{spec!r} is {where}; only the Hugging Face cache's models are removed", "not_ours"
        )
    s = huggingface.HubSettings.from_env(offline=True)
    cached = huggingface.cached_files(ref, s)
    if cached is None:
        raise ModelSourceError(
            f"{ref.repo} is not in the Hugging Face cache {s.cache_dir}", "not_found"
        )
    commit, files = cached
    plan = huggingface.plan_files(ref, files)
    folder = s.cache_dir / ref.cache_folder
    snapshot = folder / "snapshots" / commit
    others = {f.path for f in files} - {f.path for f in plan.model}
    # The projector goes too when no other model of the repository is left to use it.
    drop = list(plan.model)
    if plan.mmproj is not None and not any(huggingface.is_model_file(p) for p in others):
        drop.append(plan.mmproj)
    blobs = (folder / "blobs").resolve()
    removed = []
    for f in drop:
        link = snapshot / f.path
        blob = link.resolve()
        try:
            link.unlink()
        except OSError:
            continue
        removed.append(link)
        # Only a blob of this repository's cache, and only one no other snapshot points to.
        if blob.parent != blobs:
            continue
        if not any(p.resolve() == blob for p in (folder / "snapshots").rglob("*")):
            with suppress(OSError):
                blob.unlink()
    left = [p for p in (folder / "snapshots").rglob("*") if p.is_file() or p.is_symlink()]
    partial = list((folder / "blobs").glob("*.incomplete"))
    if not left and not partial:
        shutil.rmtree(folder, ignore_errors=True)
    return removed
