"""Models Ollama pulled, served in place: ``NAME[:TAG]`` (``llama3.2``, ``qwen3:8b``,
``user/model:tag``, ``hf.co/owner/repo:Q4_K_M``) is looked up in Ollama's store
(``$OLLAMA_MODELS``, else ``~/.ollama/models``) as Ollama writes it:
``manifests/<host>/<namespace>/<model>/<tag>`` (host ``registry.ollama.ai``, namespace
``library`` and tag ``latest`` when not given) is a JSON manifest whose layers name blobs
``blobs/sha256-<hex>``: the ``application/vnd.ollama.image.model`` layer is the GGUF, the
``projector`` layer its vision projector, the ``params`` layer (JSON) the model's default
options and the ``system`` layer its default system prompt. Nothing is copied; nothing outside
the store is read, whatever the name or the manifest says.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ModelSourceError

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
MEDIA = "application/vnd.ollama.image."
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")
MAX_SMALL_LAYER = 1 << 20
"""The most a params or system layer may hold (they are a few hundred bytes)."""

PARAMS_TO_SETTINGS = {
    "temperature": "temp",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "seed": "seed",
}
"""The ``params`` options a server takes as its defaults: Ollama's name, the setting's."""


def store_root() -> Path:
    """``$OLLAMA_MODELS``, else ``~/.ollama/models``."""
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


@dataclass(frozen=True)
class OllamaName:
    host: str
    namespace: str
    model: str
    tag: str

    def __str__(self) -> str:
        """As Ollama shows it: ``model:tag``, with the namespace and host when not the
        default ones."""
        if self.host == DEFAULT_HOST and self.namespace == DEFAULT_NAMESPACE:
            return f"{self.model}:{self.tag}"
        if self.host == DEFAULT_HOST:
            return f"{self.namespace}/{self.model}:{self.tag}"
        return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"

    def manifest(self, root: Path) -> Path:
        return root / "manifests" / self.host / self.namespace / self.model / self.tag


def parse_name(text: str) -> OllamaName | None:
    """``[host/][namespace/]model[:tag]`` as Ollama takes it; None for a name it would not
    take (a path, ``..``, an empty part)."""
    rest, sep, tag = text.strip().partition(":")
    if sep and not _TAG.match(tag):
        return None
    parts = rest.split("/")
    if not 1 <= len(parts) <= 3 or not all(_PART.match(p) and ".." not in p for p in parts):
        return None
    host, namespace = DEFAULT_HOST, DEFAULT_NAMESPACE
    if len(parts) == 3:
        host, namespace, model = parts
    elif len(parts) == 2:
        namespace, model = parts
    else:
        (model,) = parts
    if model.lower().endswith(".gguf"):
        return None
    return OllamaName(host, namespace, model, tag if sep else DEFAULT_TAG)


@dataclass(frozen=True)
class OllamaModel:
    """A model of Ollama's store: its name, GGUF blob, projector blob and default settings
    (setting names: ``params``' options, and ``system_prompt`` from the ``system`` layer)."""

    name: OllamaName
    path: Path
    size: int
    mmproj: Path | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    ignored_params: tuple[str, ...] = ()
    """``params`` options no server setting takes (``stop``, ``num_ctx``, ...)."""


def _blob(root: Path, where: str, layer: Any) -> tuple[Path, int]:
    if not isinstance(layer, dict):
        raise ModelSourceError(f"{where}: a layer is not an object", "bad_manifest")
    digest = layer.get("digest")
    m = _DIGEST.match(digest) if isinstance(digest, str) else None
    if m is None:
        raise ModelSourceError(
            f"{where}: a layer's digest {digest!r} is not sha256:<hex>", "bad_manifest"
        )
    path = root / "blobs" / f"sha256-{m.group(1)}"
    try:
        # A blob is a file of the store's blobs/, never a link out of it.
        if path.resolve().parent != (root / "blobs").resolve():
            raise ModelSourceError(
                f"{where}: its blob {path.name} leads out of the store", "bad_manifest"
            )
        size = path.stat().st_size
    except (OSError, RuntimeError):
        raise ModelSourceError(
            f"{where}: its blob {path.name} is missing from {root / 'blobs'} (pull it again "
            f"with ollama)",
            "bad_manifest",
        ) from None
    if not path.is_file():
        raise ModelSourceError(f"{where}: its blob {path} is not a file", "bad_manifest")
    return path, size


def _small_text(path: Path, where: str) -> str:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_SMALL_LAYER + 1)
    except OSError as e:
        raise ModelSourceError(f"{where}: {e}", "bad_manifest") from None
    if len(data) > MAX_SMALL_LAYER:
        raise ModelSourceError(
            f"{where}: {path.name} is larger than a params or system layer", "bad_manifest"
        )
    return data.decode("utf-8", errors="replace")


def read_model(name: OllamaName, root: Path | None = None) -> OllamaModel | None:
    """The model ``name`` names in the store; None when the store has no such manifest.
    Raises ModelSourceError (``bad_manifest``) for a manifest that cannot be used."""
    root = root or store_root()
    manifest = name.manifest(root)
    where = f"Ollama model {name} ({manifest})"
    try:
        # A manifest is a file of the store, never a link out of it.
        real = manifest.resolve()
        if not real.is_relative_to(root.resolve()):
            raise ModelSourceError(f"{where}: the manifest is outside the store", "bad_manifest")
        if not manifest.is_file():
            return None
        if manifest.stat().st_size > MAX_SMALL_LAYER:
            raise ModelSourceError(f"{where}: the manifest is too large", "bad_manifest")
        text = manifest.read_bytes().decode("utf-8")
    except (OSError, RuntimeError):  # unreadable, a link loop
        return None
    except UnicodeDecodeError:
        raise ModelSourceError(f"{where}: the manifest is not UTF-8", "bad_manifest") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ModelSourceError(f"{where}: the manifest is not JSON: {e}", "bad_manifest") from None
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, list):
        raise ModelSourceError(f"{where}: the manifest has no layers", "bad_manifest")
    by_type: dict[str, Any] = {}
    for layer in layers:
        media = layer.get("mediaType") if isinstance(layer, dict) else None
        if isinstance(media, str) and media.startswith(MEDIA):
            by_type.setdefault(media[len(MEDIA) :], layer)
    if "model" not in by_type:
        raise ModelSourceError(f"{where}: the manifest has no model layer", "bad_manifest")
    path, size = _blob(root, where, by_type["model"])
    mmproj = _blob(root, where, by_type["projector"])[0] if "projector" in by_type else None
    defaults: dict[str, Any] = {}
    ignored: list[str] = []
    if "params" in by_type:
        params_path = _blob(root, where, by_type["params"])[0]
        try:
            params = json.loads(_small_text(params_path, where))
        except (ValueError, RecursionError) as e:
            raise ModelSourceError(
                f"{where}: its params are not JSON: {e}", "bad_manifest"
            ) from None
        if not isinstance(params, dict):
            raise ModelSourceError(f"{where}: its params are not an object", "bad_manifest")
        for key, value in params.items():
            setting = PARAMS_TO_SETTINGS.get(key)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            ok = ok and math.isfinite(value) and abs(value) < 2**63
            if setting is None or not ok:
                ignored.append(key)
                continue
            defaults[setting] = int(value) if setting in ("top_k", "seed") else float(value)
    if "system" in by_type:
        system = _small_text(_blob(root, where, by_type["system"])[0], where)
        if system:
            defaults["system_prompt"] = system
    return OllamaModel(name, path, size, mmproj, defaults, tuple(sorted(ignored)))


def list_models(root: Path | None = None) -> Iterator[OllamaName]:
    """Every manifest's name in the store, sorted."""
    root = root or store_root()
    base = root / "manifests"
    try:
        manifests = sorted(base.glob("*/*/*/*")) if base.is_dir() else []
    except (OSError, RuntimeError):
        return
    for manifest in manifests:
        if not manifest.is_file():
            continue
        host, namespace, model, tag = manifest.relative_to(base).parts
        name = OllamaName(host, namespace, model, tag)
        if parse_name(str(name)) == name:
            yield name
