"""One resolver for a model argument (``serve MODEL``, ``run MODEL``, ``pull``, ``show``,
``Server(model=...)``, a router's names): it turns what a user typed into files, so that the
engine only ever sees files. Looked up in this order:

1. an existing file (a name ending in ``.gguf``, or holding a path separator, is a path only);
2. a name in ``--models-dir`` (``NAME.gguf`` or ``NAME/``);
3. ``owner/repo[:QUANT]`` (or ``hf.co/owner/repo:QUANT``) of a repository the Hugging Face
   cache holds (its file chosen from the hub's list, what is missing fetched; the cache alone
   when offline or the hub cannot be reached);
4. ``NAME[:TAG]`` in Ollama's store;
5. ``owner/repo[:QUANT]`` downloaded from Hugging Face (unless offline, or told not to).

What is on this machine comes before the network: a model Ollama already holds is served in
place rather than fetched again under a name that means the same thing on both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import huggingface, ollama_store
from .errors import ModelSourceError
from .models_dir import discover
from .progress import NoProgress, Progress


@dataclass(frozen=True)
class ResolvedModel:
    """A model argument made files: the model (its first split part), the projector found
    with it, the name it is served by, where it came from (``file``, ``models-dir``,
    ``huggingface``, ``ollama``), and the source's default settings (Ollama's ``params``
    and ``system`` prompt)."""

    path: Path
    name: str
    source: str
    mmproj: Path | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    """What the user should know (options of the source no setting takes)."""


def looks_like_path(text: str) -> bool:
    return (
        text.lower().endswith(".gguf") or text.startswith(("/", "./", "../", "~")) or "\\" in text
    )


def _from_models_dir(name: str, models_dir: str | Path) -> ResolvedModel | None:
    try:
        found = discover(models_dir)
    except ValueError:
        return None
    for m in found:
        if m.name == name:
            return ResolvedModel(m.path, m.name, "models-dir", m.mmproj)
    return None


def _from_ollama(model: ollama_store.OllamaModel) -> ResolvedModel:
    notes: tuple[str, ...] = ()
    if model.ignored_params:
        notes = (
            f"Ollama's params of {model.name} not taken (no server setting): "
            + ", ".join(model.ignored_params),
        )
    return ResolvedModel(model.path, str(model.name), "ollama", model.mmproj, model.defaults, notes)


def _from_hf(m: huggingface.HfModel) -> ResolvedModel:
    return ResolvedModel(m.path, str(m.ref), "huggingface", m.mmproj)


def resolve_model(
    spec: str,
    *,
    models_dir: str | Path | None = None,
    offline: bool = False,
    mmproj: bool = True,
    download: bool = True,
    huggingface_only: bool = False,
    files: bool = True,
    progress: Progress | None = None,
) -> ResolvedModel:
    """``spec`` as files, looked up in the module's order. ``huggingface_only``: ``spec`` is a
    Hugging Face reference (``-hf``); ``files=False``: not a file either (what a client may
    ask a server to pull: never a path on the server's disk). ``mmproj=False`` leaves out
    the projector a source brings. Raises ModelSourceError (``not_found`` listing where it
    looked, or the source's own error)."""
    found = _resolve(spec, models_dir, offline, mmproj, download, huggingface_only, files, progress)
    if not mmproj and found.mmproj is not None and found.source != "file":
        found = dataclasses.replace(found, mmproj=None)
    return found


def _resolve(
    spec: str,
    models_dir: str | Path | None,
    offline: bool,
    mmproj: bool,
    download: bool,
    huggingface_only: bool,
    files: bool,
    progress: Progress | None,
) -> ResolvedModel:
    progress = progress or NoProgress()
    text = spec.strip()
    if not text:
        raise ModelSourceError("an empty model name", "bad_name")
    hf_ref = huggingface.parse_ref(text)
    if huggingface_only:
        if hf_ref is None:
            raise ModelSourceError(
                f"{spec!r} is not a Hugging Face reference (owner/repo[:QUANT])", "bad_name"
            )
        settings = huggingface.HubSettings.from_env(offline)
        return _from_hf(
            huggingface.fetch(
                hf_ref, settings=settings, mmproj=mmproj, download=download, progress=progress
            )
        )
    looked: list[str] = []
    if not files:
        if looks_like_path(text):
            raise ModelSourceError(
                f"{spec!r}: give a Hugging Face OWNER/REPO[:QUANT] or an Ollama NAME[:TAG], "
                f"not a path",
                "bad_name",
            )
    else:
        try:
            path = Path(text).expanduser()
            is_file = path.is_file()
        except (ValueError, RuntimeError, OSError):  # a NUL byte, ~nobody
            raise ModelSourceError(f"{spec!r} is not a usable file name", "bad_name") from None
        if is_file:
            return ResolvedModel(path, path.name, "file")
        if looks_like_path(text):
            raise ModelSourceError(f"no such model file: {path}", "not_found")
        looked.append(f"no file {path}")
    if models_dir is not None:
        found = _from_models_dir(text, models_dir)
        if found is not None:
            return found
        looked.append(f"no model {text!r} in --models-dir {models_dir}")
    settings = huggingface.HubSettings.from_env(offline)
    if hf_ref is not None:
        if huggingface.cached_files(hf_ref, settings) is not None:
            # The repository is cached: the file is chosen from the hub's list when it can be
            # reached (another quantization may be the default one), else from the cache's.
            return _from_hf(
                huggingface.fetch(
                    hf_ref, settings=settings, mmproj=mmproj, download=download, progress=progress
                )
            )
        looked.append(f"not in the Hugging Face cache {settings.cache_dir}")
    name = ollama_store.parse_name(text)
    if name is not None:
        root = ollama_store.store_root()
        model = ollama_store.read_model(name, root)
        if model is not None:
            return _from_ollama(model)
        looked.append(f"not in Ollama's store {root} (as {name})")
    if hf_ref is not None and download and not settings.offline:
        return _from_hf(
            huggingface.fetch(hf_ref, settings=settings, mmproj=mmproj, progress=progress)
        )
    if hf_ref is not None:
        looked.append("not downloaded (offline)" if settings.offline else "not downloaded")
    if hf_ref is None and name is None:
        raise ModelSourceError(
            f"{spec!r} is no model file, Hugging Face reference (owner/repo[:QUANT]) or "
            f"Ollama name (name[:tag])",
            "bad_name",
        )
    raise ModelSourceError(f"no model {spec!r}: " + "; ".join(looked), "not_found")
