"""A models directory (``--models-dir``): models as ``NAME.gguf`` files, or as folders
``NAME/`` holding one model file and, for images, its projector (``mmproj*.gguf``), each
served by its name; and models given as files, served by their file names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelFile:
    """One model a router serves."""

    name: str
    path: Path
    mmproj: Path | None = None
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Its own settings (``ServerConfig`` fields) over the server's, from a presets file."""
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Its source's defaults (Ollama's params) for the settings the server leaves at their
    defaults."""


def _is_projector(path: Path) -> bool:
    return path.name.lower().startswith("mmproj")


def discover(models_dir: str | Path) -> list[ModelFile]:
    """The models in ``models_dir``, sorted by name: ``NAME.gguf`` files, and folders holding
    one model file (and optionally its ``mmproj*.gguf`` projector) served as the folder's
    name. Raises ValueError when the directory cannot be read or a folder is ambiguous."""
    root = Path(models_dir).expanduser()
    if not root.is_dir():
        raise ValueError(f"--models-dir {models_dir}: not a directory")
    found: list[ModelFile] = []
    for entry in sorted(root.iterdir()):
        if entry.is_file() and entry.suffix.lower() == ".gguf" and not _is_projector(entry):
            found.append(ModelFile(entry.stem, entry))
        elif entry.is_dir():
            ggufs = sorted(p for p in entry.iterdir() if p.suffix.lower() == ".gguf")
            models = [p for p in ggufs if not _is_projector(p)]
            projectors = [p for p in ggufs if _is_projector(p)]
            if not models:
                continue
            if len(models) > 1 or len(projectors) > 1:
                raise ValueError(
                    f"--models-dir: {entry} holds {len(models)} model files and "
                    f"{len(projectors)} projectors; a model's folder holds one of each at most"
                )
            found.append(ModelFile(entry.name, models[0], projectors[0] if projectors else None))
    return found


def from_files(paths: list[str]) -> list[ModelFile]:
    """Models given as files, each served by its file name without ``.gguf``."""
    out = []
    for p in paths:
        path = Path(p).expanduser()
        name = path.name[: -len(".gguf")] if path.name.lower().endswith(".gguf") else path.name
        out.append(ModelFile(name, path))
    return out
