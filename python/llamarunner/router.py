"""Many models behind one endpoint: which models a router serves (a models directory, or
several model files) and the configuration the native router takes.

A models directory holds models as ``NAME.gguf`` files, or as folders ``NAME/`` holding one
model file and, for images, its projector (``mmproj*.gguf``). Each model is served by its
name; the router starts each model's engine (``python -m llamarunner._engine``) on demand.
A presets file (``--models-preset``, TOML) gives models their own settings, one table per
model: ``[coder]`` with ``ctx-size = 8192``, ``parallel = 2``, ``model = "path.gguf"`` (a
model not in the directory), ``alias = "code"`` (the name it is served by) and any other
``serve`` flag but the front's HTTP ones.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ServerConfig, default_cache_ram_mib, total_memory_bytes
from .settings import DEFAULT_KEEP_ALIVE, DEFAULT_MODELS_MAX, DEFAULT_MODELS_MEMORY

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.9 and 3.10
    import tomli as tomllib

# --models-memory -1: this share of the machine's memory.
DEFAULT_MODELS_MEMORY_SHARE = 0.8


def models_memory_mib(value: int) -> int:
    """``--models-memory``: MiB the loaded models' estimates may add up to; -1: 80 % of the
    machine's memory; 0: no budget. Raises ValueError below -1."""
    if value < -1:
        raise ValueError(f"--models-memory {value}: give MiB, -1 (80 % of memory) or 0 (off)")
    if value == -1:
        return int(total_memory_bytes() * DEFAULT_MODELS_MEMORY_SHARE) >> 20
    return value


@dataclass(frozen=True)
class ModelFile:
    """One model a router serves."""

    name: str
    path: Path
    mmproj: Path | None = None
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Its own settings (``ServerConfig`` fields) over the server's, from a presets file."""


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


# Settings of the front alone: one address, one policy for every model.
FRONT_ONLY = (
    "host",
    "port",
    "api_key",
    "api_key_file",
    "allow_origin",
    "max_body",
    "max_connections",
    "header_timeout",
    "idle_timeout",
    "shutdown_timeout",
)


def _preset_value(path: Path, section: str, key: str, value: Any, default: Any) -> Any:
    """A preset's value, checked against the type of the setting's default."""
    where = f"--models-preset {path}: [{section}] {key}"
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, list):
        ok = isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        )
    else:  # str or str | None
        ok = isinstance(value, str)
    if not ok:
        raise ValueError(f"{where} = {value!r}: expected a {type(default).__name__} value")
    return value


def read_presets(path: str | Path) -> dict[str, dict[str, Any]]:
    """The tables of a presets file: each model's name and its settings, as ``ServerConfig``
    field names (``ctx-size`` or ``ctx_size``) with checked values. Raises ValueError on an
    unreadable file, bad TOML, an unknown or front-only setting, or a value of the wrong
    type."""
    file = Path(path).expanduser()
    try:
        tables = tomllib.loads(file.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--models-preset {path}: {e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--models-preset {path}: not TOML: {e}") from e
    defaults = ServerConfig()
    fields = {f.name for f in dataclasses.fields(ServerConfig)}
    presets: dict[str, dict[str, Any]] = {}
    for section, table in tables.items():
        if not isinstance(table, dict):
            raise ValueError(
                f"--models-preset {path}: {section} = {table!r} is outside a [model] table"
            )
        settings: dict[str, Any] = {}
        for key, value in table.items():
            name = key.replace("-", "_")
            if name not in fields:
                raise ValueError(f"--models-preset {path}: [{section}] {key}: no such setting")
            if name in FRONT_ONLY:
                raise ValueError(
                    f"--models-preset {path}: [{section}] {key} is the front's, one for every "
                    f"model: give it as a flag"
                )
            settings[name] = _preset_value(file, section, key, value, getattr(defaults, name))
        presets[section] = settings
    return presets


def apply_presets(
    models: list[ModelFile], presets: dict[str, dict[str, Any]], path: str | Path
) -> list[ModelFile]:
    """``models`` with their presets' settings, and the presets' models that name a file
    (``model = ...``) not among them. A preset's ``alias`` is the name its model is served
    by. Raises ValueError on a preset that names no model, or two models of one name."""
    out: list[ModelFile] = []
    by_name = {m.name: m for m in models}
    for name, settings in presets.items():
        if name in by_name:
            continue
        if not settings.get("model"):
            known = ", ".join(sorted(by_name)) or "none"
            raise ValueError(
                f"--models-preset {path}: [{name}] is no model being served ({known}) and "
                f"gives no model = PATH"
            )
    for m in models:
        out.append(_with_settings(m, presets.get(m.name, {})))
    for name, settings in presets.items():
        if name not in by_name:
            out.append(_with_settings(ModelFile(name, Path(settings["model"])), settings))
    seen: set[str] = set()
    for m in out:
        if m.name in seen:
            raise ValueError(f"two models are served as {m.name!r}: rename one (alias = ...)")
        seen.add(m.name)
    return out


def served_models(
    models: list[str],
    models_dir: str | Path | None = None,
    models_preset: str | Path | None = None,
) -> list[ModelFile]:
    """Every model a router serves: the files in ``models``, then ``models_dir``'s, with the
    settings (and extra models) of ``models_preset``. Raises ValueError as `discover` and
    `read_presets` do."""
    files = from_files(models)
    if models_dir is not None:
        files += discover(models_dir)
    if models_preset is not None:
        files = apply_presets(files, read_presets(models_preset), models_preset)
    return files


def _with_settings(m: ModelFile, settings: dict[str, Any]) -> ModelFile:
    rest = dict(settings)
    path = Path(rest.pop("model")).expanduser() if rest.get("model") else m.path
    mmproj = Path(rest.pop("mmproj")).expanduser() if rest.get("mmproj") else m.mmproj
    alias = rest.pop("alias", None) or m.name
    return ModelFile(alias, path, mmproj, rest)


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
    models_memory: int = DEFAULT_MODELS_MEMORY,
) -> str:
    """The native router's configuration: the front's HTTP settings from ``base``, and for
    each model ``base``'s other settings with its file (and projector). A model whose
    ``cache_ram`` is the default (-1) gets its share of the default budget: up to
    ``models_max`` engines share it, as replicas on one node do."""
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
            **m.settings,
            model=str(m.path),
            mmproj=str(m.mmproj) if m.mmproj else base.mmproj,
            alias=m.name,
        )
        if per_model.cache_ram == -1:
            per_model.cache_ram = default_cache_ram_mib() // max(1, models_max)
        specs.append(
            {"name": m.name, "path": str(m.path), "config": json.loads(per_model.to_json())}
        )
    return json.dumps(
        {
            "front": front,
            "models": specs,
            "models_max": models_max,
            "models_memory": models_memory_mib(models_memory),
            "keep_alive": keep_alive_seconds(keep_alive),
            "engine_command": [sys.executable, "-m", "llamarunner._engine"],
        }
    )
