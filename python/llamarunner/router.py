"""Many models behind one endpoint: which models a router serves (a models directory, or
several model files) and the configuration the native router takes.

A models directory holds models as ``NAME.gguf`` files, or as folders ``NAME/`` holding one
model file and, for images, its projector (``mmproj*.gguf``). Each model is served by its
name; the router starts each model's engine (``python -m llamarunner._engine``) on demand.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ServerConfig

DEFAULT_MODELS_MAX = 4
DEFAULT_KEEP_ALIVE = "5m"


@dataclass(frozen=True)
class ModelFile:
    """One model a router serves."""

    name: str
    path: Path
    mmproj: Path | None = None


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


def keep_alive_seconds(value: str | float | int) -> float:
    """``--keep-alive``: seconds, or a duration such as "5m", "1h", "30s"; negative: for
    ever. Raises ValueError otherwise."""
    if isinstance(value, (int, float)):
        return float(value)
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            try:
                return float(text[: -len(unit)]) * units[unit]
            except ValueError:
                break
    raise ValueError(f"--keep-alive {value!r}: give seconds or a duration such as 5m, 1h, 30s")


def router_config_json(
    base: ServerConfig,
    models: list[ModelFile],
    *,
    models_max: int = DEFAULT_MODELS_MAX,
    keep_alive: str | float = DEFAULT_KEEP_ALIVE,
) -> str:
    """The native router's configuration: the front's HTTP settings from ``base``, and for
    each model ``base``'s other settings with its file (and projector)."""
    if not models:
        raise ValueError("no models to serve: the models directory holds no .gguf file")
    front = dataclasses.asdict(base)
    front["model"] = ""
    for name in ("api_key_file", "slot_save_path", "draft_model"):
        if front[name]:
            front[name] = str(Path(front[name]).expanduser())
    specs: list[dict[str, Any]] = []
    for m in models:
        per_model = dataclasses.replace(
            base,
            model=str(m.path),
            mmproj=str(m.mmproj) if m.mmproj else base.mmproj,
            alias=m.name,
        )
        specs.append(
            {"name": m.name, "path": str(m.path), "config": json.loads(per_model.to_json())}
        )
    return json.dumps(
        {
            "front": front,
            "models": specs,
            "models_max": models_max,
            "keep_alive": keep_alive_seconds(keep_alive),
            "engine_command": [sys.executable, "-m", "llamarunner._engine"],
        }
    )
