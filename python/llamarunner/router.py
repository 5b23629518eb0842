"""Many models behind one endpoint: which models a router serves (a models directory, or
several model files) and the configuration the native router takes.

A models directory holds models as ``NAME.gguf`` files, or as folders ``NAME/`` holding one
model file and, for images, its projector (``mmproj*.gguf``). Each model is served by its
name; the router starts each model's engine (``python -m llamarunner._engine``) on demand.
A presets file (``--models-preset``, TOML) gives models their own settings, one table per
model: ``[coder]`` with ``ctx-size = 8192``, ``parallel = 2``, ``model = "path.gguf"`` (a
model not in the directory; or a name the resolver takes, ``owner/repo:Q4_K_M``),
``alias = "code"`` (the name it is served by) and any other ``serve`` flag but the front's
HTTP ones.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import ServerConfig, default_cache_ram_mib, total_memory_bytes
from .settings import (
    DEFAULT_KEEP_ALIVE,
    DEFAULT_MODELS_MAX,
    DEFAULT_MODELS_MEMORY,
    SERVER_SETTINGS,
)
from .sources.library import list_models
from .sources.models_dir import ModelFile, discover, from_files
from .sources.resolve import ResolvedModel, looks_like_path, resolve_model

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
    models: list[ModelFile],
    presets: dict[str, dict[str, Any]],
    path: str | Path,
    *,
    offline: bool = False,
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
        out.append(_with_settings(m, presets.get(m.name, {}), offline))
    for name, settings in presets.items():
        if name not in by_name:
            out.append(_with_settings(ModelFile(name, Path(settings["model"])), settings, offline))
    seen: set[str] = set()
    for m in out:
        if m.name in seen:
            raise ValueError(f"two models are served as {m.name!r}: rename one (alias = ...)")
        seen.add(m.name)
    return out


def served_models(
    models: Sequence[str | ResolvedModel],
    models_dir: str | Path | None = None,
    models_preset: str | Path | None = None,
    *,
    offline: bool = False,
    library: bool = False,
    mmproj: bool = True,
) -> list[ModelFile]:
    """Every model a router serves: ``models`` (files, or names `sources.resolve` resolves,
    fetching what it must unless ``offline``), then ``models_dir``'s, then with ``library``
    the Hugging Face cache's and Ollama's store's (`sources.library`; a name taken already
    stays with its model; their projectors unless not ``mmproj``), with the settings (and
    extra models) of ``models_preset``.
    Raises ValueError as `discover` and `read_presets` do, ModelSourceError as the resolver
    does."""
    files = [_model_file(m, offline) for m in models]
    if models_dir is not None:
        files += discover(models_dir)
    if library:
        taken = {m.name for m in files}
        for entry in list_models():
            if entry.source != "models-dir" and entry.name not in taken:
                taken.add(entry.name)
                projector = entry.mmproj if mmproj else None
                files.append(ModelFile(entry.name, entry.path, projector, defaults=entry.defaults))
    if models_preset is not None:
        files = apply_presets(files, read_presets(models_preset), models_preset, offline=offline)
    return files


def _model_file(m: str | ResolvedModel, offline: bool) -> ModelFile:
    if isinstance(m, ResolvedModel):
        return model_file(m)
    if looks_like_path(m) or Path(m).expanduser().is_file():
        return from_files([m])[0]  # a bad file is reported when its engine loads it
    return model_file(resolve_model(m, offline=offline))


def model_file(resolved: ResolvedModel) -> ModelFile:
    """A resolved model as a router serves it: a file by its file name without ``.gguf``,
    a name by that name."""
    if resolved.source == "file":
        return from_files([str(resolved.path)])[0]
    return ModelFile(resolved.name, resolved.path, resolved.mmproj, defaults=resolved.defaults)


def _with_settings(m: ModelFile, settings: dict[str, Any], offline: bool) -> ModelFile:
    """``m`` with a preset's settings; a preset's ``model`` may be a file or a name the
    resolver takes (``owner/repo:QUANT``, ``name:tag``), which brings its projector and
    defaults."""
    rest = dict(settings)
    path, mmproj, defaults = m.path, m.mmproj, m.defaults
    given = rest.pop("model", None)
    if given:
        source = _model_file(str(given), offline=offline)
        path, mmproj, defaults = source.path, source.mmproj or mmproj, source.defaults
    if rest.get("mmproj"):
        mmproj = Path(rest.pop("mmproj")).expanduser()
    alias = rest.pop("alias", None) or m.name
    return ModelFile(alias, path, mmproj, rest, defaults)


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


def model_spec(base: ServerConfig, m: ModelFile, models_max: int) -> dict[str, Any]:
    """One model of a router, as the native router takes it: ``base``'s settings with the
    model's own (a preset's), its file, projector and name, and its source's defaults for
    the settings ``base`` leaves at theirs. A ``cache_ram`` of -1 (the default) is its share
    of the default budget: up to ``models_max`` engines share it, as replicas on one node
    do."""
    per_model = dataclasses.replace(
        base,
        **m.settings,
        model=str(m.path),
        mmproj=str(m.mmproj) if m.mmproj else base.mmproj,
        alias=m.name,
    )
    for name, value in m.defaults.items():
        if getattr(per_model, name) == SERVER_SETTINGS[name].default:
            setattr(per_model, name, value)
    if per_model.cache_ram == -1:
        per_model.cache_ram = default_cache_ram_mib() // max(1, models_max)
    return {"name": m.name, "path": str(m.path), "config": json.loads(per_model.to_json())}


def router_config_json(
    base: ServerConfig,
    models: list[ModelFile],
    *,
    models_max: int = DEFAULT_MODELS_MAX,
    keep_alive: str | float = DEFAULT_KEEP_ALIVE,
    models_memory: int = DEFAULT_MODELS_MEMORY,
    allow_pull: bool = False,
    offline: bool = False,
    mmproj: bool = True,
) -> str:
    """The native router's configuration: the front's HTTP settings from ``base``, and each
    model's (`model_spec`). With ``allow_pull``, ``POST /api/pull`` fetches models with
    ``python -m llamarunner._pull`` (given ``base`` and ``models_max`` to make the model's
    configuration as here, ``offline`` and ``mmproj`` as the resolver takes them), and the
    router may start with no model."""
    if not models and not allow_pull:
        raise ValueError("no models to serve: the models directory holds no .gguf file")
    front = dataclasses.asdict(base)
    front["model"] = ""
    for name in ("api_key_file", "slot_save_path", "draft_model"):
        if front[name]:
            front[name] = str(Path(front[name]).expanduser())
    config: dict[str, Any] = {
        "front": front,
        "models": [model_spec(base, m, models_max) for m in models],
        "models_max": models_max,
        "models_memory": models_memory_mib(models_memory),
        "keep_alive": keep_alive_seconds(keep_alive),
        "engine_command": [sys.executable, "-m", "llamarunner._engine"],
    }
    if allow_pull:
        config["pull"] = {
            "command": [sys.executable, "-m", "llamarunner._pull"],
            "input": json.dumps(
                {
                    "base": dataclasses.asdict(base),
                    "models_max": models_max,
                    "offline": offline,
                    "mmproj": mmproj,
                }
            ),
        }
    return json.dumps(config)
