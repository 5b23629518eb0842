"""Models from Hugging Face: ``owner/repo[:QUANT]`` (also ``hf.co/owner/repo:QUANT``), the
GGUF files picked as llama-server's ``-hf`` picks them, fetched with ``huggingface_hub`` into
its cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), the
one llama.cpp, transformers and every other tool share, so nothing is downloaded twice.

``HF_ENDPOINT``, ``HF_TOKEN`` and ``HF_HUB_OFFLINE`` are read when a model is fetched (not when
this module is imported). A connection cut during a download is taken up with a range request
where the written part ends (huggingface_hub 2.x starts a file stopped by the process's end
again), the file is checked against the SHA-256 the hub gives (one that does not match is
removed), and a download the disk cannot hold is refused before it starts.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ModelSourceError
from .progress import NoProgress, Progress

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_TAGS = ("Q4_K_M", "Q8_0")
"""Without a tag, the first of these a file name holds; else the first model file."""

_PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "huggingface.co/", "hf.co/")
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}$")
_SPLIT = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)
_FILE_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-")
"""GGUF files of a repository that are not its model (projectors, importance matrices,
drafting heads)."""


@dataclass(frozen=True)
class HfRef:
    """``owner/repo`` and the quantization ``tag`` asked for (None: the default choice)."""

    repo: str
    tag: str | None = None

    def __str__(self) -> str:
        return f"{self.repo}:{self.tag}" if self.tag else self.repo

    @property
    def cache_folder(self) -> str:
        """Its folder in the cache (``models--owner--repo``)."""
        return "models--" + self.repo.replace("/", "--")


def parse_ref(text: str, *, prefixed_only: bool = False) -> HfRef | None:
    """``owner/repo[:TAG]``, with or without ``hf.co/`` (or ``huggingface.co/``) before it;
    None when ``text`` is not one (a path, a bare name). ``prefixed_only``: only with a
    prefix."""
    rest = text.strip()
    prefixed = False
    for prefix in _PREFIXES:
        if rest.lower().startswith(prefix):
            rest, prefixed = rest[len(prefix) :], True
            break
    if prefixed_only and not prefixed:
        return None
    repo, sep, tag = rest.partition(":")
    parts = repo.split("/")
    if len(parts) != 2 or not all(_PART.match(p) for p in parts):
        return None
    if any(p.endswith(".gguf") for p in parts) or ".." in repo:
        return None
    if sep and not _TAG.match(tag):
        return None
    # Ollama's clients say `:latest` for "the default": the default file here.
    return HfRef(repo, tag if sep and tag.lower() != "latest" else None)


@dataclass(frozen=True)
class RepoFile:
    """A file of a repository: its path there, size and SHA-256 (None where the hub gives
    none: files kept in git rather than LFS)."""

    path: str
    size: int | None = None
    sha256: str | None = None


@dataclass(frozen=True)
class SplitInfo:
    prefix: str
    """The name without ``.gguf`` and the split suffix (the tag included)."""
    tag: str
    index: int
    count: int


def split_info(path: str) -> SplitInfo | None:
    """What a GGUF file's name says: its split part (``-00001-of-00003``) and quantization
    tag (``Q4_K_M`` in ``model-Q4_K_M.gguf``); None for a file that is not a GGUF."""
    if not path.lower().endswith(".gguf"):
        return None
    prefix = path[: -len(".gguf")]
    index = count = 1
    m = _SPLIT.match(prefix)
    if m:
        prefix, index, count = m.group(1), int(m.group(2)), int(m.group(3))
    t = _FILE_TAG.search(prefix)
    return SplitInfo(prefix, t.group(1).upper() if t else "", index, count)


def is_model_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1].lower()
    return name.endswith(".gguf") and not any(k in name for k in _NOT_MODELS)


def _quant_bits(tag: str) -> int:
    m = re.search(r"[0-9]+", tag)
    return int(m.group(0)) if m else 0


@dataclass(frozen=True)
class Plan:
    """The files a reference needs: the model's (every split part, in order) and its
    projector's."""

    model: tuple[RepoFile, ...]
    mmproj: RepoFile | None

    @property
    def files(self) -> tuple[RepoFile, ...]:
        return self.model + ((self.mmproj,) if self.mmproj else ())


def tags_in(files: Sequence[RepoFile]) -> list[str]:
    """The quantization tags the repository's model files have, sorted."""
    tags = set()
    for f in files:
        info = split_info(f.path)
        if info is not None and info.tag and is_model_file(f.path):
            tags.add(info.tag)
    return sorted(tags)


def _first_model(files: Sequence[RepoFile], tag: str | None) -> RepoFile | None:
    candidates = [f for f in files if is_model_file(f.path)]
    firsts = []
    for f in candidates:
        info = split_info(f.path)
        if info is not None and (info.count <= 1 or info.index == 1):
            firsts.append(f)
    for t in [tag] if tag else list(DEFAULT_TAGS):
        # The tag whole: `F16` is not found in `BF16`.
        pattern = re.compile(r"(?<![A-Za-z0-9])" + re.escape(t) + r"[.-]", re.IGNORECASE)
        for f in firsts:
            if pattern.search(f.path):
                return f
    if tag is None and firsts:
        return firsts[0]
    return None


def _split_parts(files: Sequence[RepoFile], first: RepoFile) -> tuple[RepoFile, ...]:
    info = split_info(first.path)
    if info is None or info.count <= 1:
        return (first,)
    parts = {}
    for f in files:
        other = split_info(f.path)
        if other is not None and other.count == info.count and other.prefix == info.prefix:
            parts[other.index] = f
    return tuple(parts[i] for i in sorted(parts))


def _best_projector(files: Sequence[RepoFile], model: str) -> RepoFile | None:
    """The ``mmproj*.gguf`` beside the model: in the deepest folder the model's path shares,
    then of the nearest quantization width."""
    model_dir = model.split("/")[:-1]
    model_bits = _quant_bits((split_info(model) or SplitInfo("", "", 1, 1)).tag)
    best: tuple[int, int] | None = None
    chosen = None
    for f in files:
        name = f.path.rsplit("/", 1)[-1].lower()
        if not name.endswith(".gguf") or "mmproj" not in name:
            continue
        sib_dir = f.path.split("/")[:-1]
        if sib_dir != model_dir[: len(sib_dir)]:
            continue
        info = split_info(f.path)
        diff = abs(_quant_bits(info.tag if info else "") - model_bits)
        key = (-len(sib_dir), diff)
        if best is None or key < best:
            best, chosen = key, f
    return chosen


def plan_files(ref: HfRef, files: Sequence[RepoFile], *, mmproj: bool = True) -> Plan:
    """The files to fetch for ``ref`` from a repository holding ``files`` (sorted by path):
    the first model file whose name holds the tag (case-insensitive, whole: not after a letter
    or digit, and followed by ``.`` or ``-``), or without a tag Q4_K_M, then Q8_0, then the
    first model file; all its split parts; and, unless ``mmproj`` is False, the projector
    beside it. Raises ModelSourceError (``no_file``) when there is none."""
    ordered = sorted(files, key=lambda f: f.path)
    first = _first_model(ordered, ref.tag)
    if first is None:
        if not any(is_model_file(f.path) for f in ordered):
            raise ModelSourceError(f"{ref.repo} holds no GGUF model file", "no_file")
        tags = ", ".join(tags_in(ordered)) or "none"
        raise ModelSourceError(
            f"{ref.repo} has no GGUF file for the tag {ref.tag!r}; its tags: {tags}", "no_file"
        )
    parts = _split_parts(ordered, first)
    info = split_info(first.path)
    if info is not None and len(parts) != info.count:
        raise ModelSourceError(
            f"{ref.repo}: {first.path} is split in {info.count} files but the repository "
            f"holds {len(parts)} of them",
            "no_file",
        )
    return Plan(parts, _best_projector(ordered, first.path) if mmproj else None)


@dataclass(frozen=True)
class HubSettings:
    """Where the hub is and what may be fetched, read from the environment when used."""

    endpoint: str
    token: str | None
    cache_dir: Path
    offline: bool

    @classmethod
    def from_env(cls, offline: bool = False) -> HubSettings:
        env = os.environ
        if env.get("HF_HUB_CACHE"):
            cache = Path(env["HF_HUB_CACHE"])
        elif env.get("HF_HOME"):
            cache = Path(env["HF_HOME"]) / "hub"
        else:
            cache = (
                Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface" / "hub"
            )
        truthy = ("1", "true", "yes", "on")
        return cls(
            endpoint=(env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/"),
            token=env.get("HF_TOKEN") or None,
            cache_dir=cache.expanduser(),
            offline=offline or env.get("HF_HUB_OFFLINE", "").strip().lower() in truthy,
        )


@dataclass(frozen=True)
class HfModel:
    """A model fetched (or found in the cache): its first file (llama.cpp finds the other
    split parts beside it) and its projector."""

    ref: HfRef
    path: Path
    mmproj: Path | None
    commit: str
    files: tuple[RepoFile, ...]


def _hub() -> Any:
    try:
        import huggingface_hub
        import huggingface_hub.errors
        import huggingface_hub.utils
    except ImportError:  # pragma: no cover - a dependency; only a broken install lacks it
        raise ModelSourceError(
            "fetching from Hugging Face needs huggingface_hub: pip install huggingface_hub",
            "network",
        ) from None
    return huggingface_hub


def cached_files(ref: HfRef, s: HubSettings) -> tuple[str, list[RepoFile]] | None:
    """The commit ``main`` points to in the cache, and the files of that snapshot there (with
    their sizes); None when the repository is not cached."""
    folder = s.cache_dir / ref.cache_folder
    try:
        commit = (folder / "refs" / "main").read_bytes().decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    snapshot = folder / "snapshots" / commit
    if not re.fullmatch(r"[0-9a-f]{40}", commit) or not snapshot.is_dir():
        return None
    files = []
    for p in sorted(snapshot.rglob("*")):
        if p.is_file():
            files.append(RepoFile(p.relative_to(snapshot).as_posix(), p.stat().st_size))
    return commit, files


def remote_files(ref: HfRef, s: HubSettings) -> tuple[str, list[RepoFile]]:
    """The commit of ``main`` on the hub and its files, with sizes and SHA-256s. Raises
    ModelSourceError: ``not_found``, ``unauthorized``, ``network``."""
    hub = _hub()
    errors = hub.errors
    api = hub.HfApi(endpoint=s.endpoint, token=s.token)
    try:
        info = api.model_info(ref.repo, revision="main", files_metadata=True)
    except errors.GatedRepoError:
        raise ModelSourceError(
            f"{ref.repo} is gated on {s.endpoint}: accept its terms on its page with the "
            f"account of your token, and set HF_TOKEN to that token",
            "unauthorized",
        ) from None
    except errors.HfHubHTTPError as e:
        # RepositoryNotFoundError and the others: told apart by the status (the hub answers
        # 401 for a private or gated repository without a token, and for a missing one).
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            token = "the token in HF_TOKEN" if s.token else "no token (set HF_TOKEN)"
            raise ModelSourceError(
                f"{ref.repo} on {s.endpoint} is private, gated or does not exist, and the "
                f"hub refused {token} ({status})",
                "unauthorized",
            ) from None
        if status == 404:
            raise ModelSourceError(
                f"no repository {ref.repo} on {s.endpoint} (404)", "not_found"
            ) from None
        raise ModelSourceError(f"{s.endpoint} answered: {e}", "network") from None
    except Exception as e:  # connection refused, DNS, TLS, timeouts: whatever httpx raises
        raise ModelSourceError(
            f"could not reach {s.endpoint} for {ref.repo}: {type(e).__name__}: {e}", "network"
        ) from None
    files = []
    for sib in info.siblings or []:
        lfs = getattr(sib, "lfs", None)
        sha = getattr(lfs, "sha256", None) if lfs is not None else None
        size = getattr(lfs, "size", None) if lfs is not None else None
        files.append(RepoFile(sib.rfilename, size if size is not None else sib.size, sha))
    return str(info.sha), files


def _cached_path(ref: HfRef, s: HubSettings, commit: str, f: RepoFile) -> Path | None:
    p = s.cache_dir / ref.cache_folder / "snapshots" / commit / f.path
    return p if p.is_file() else None


def _has_blob(folder: Path, f: RepoFile) -> bool:
    """Whether the cache holds ``f``'s content already (under another commit: linked, not
    downloaded)."""
    return bool(f.sha256) and (folder / "blobs" / str(f.sha256)).is_file()


def _check_disk(ref: HfRef, s: HubSettings, missing: Sequence[RepoFile]) -> None:
    need = sum(f.size or 0 for f in missing)
    if need == 0:
        return
    try:
        s.cache_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(s.cache_dir).free
    except OSError as e:
        raise ModelSourceError(f"the Hugging Face cache {s.cache_dir}: {e}", "io") from None
    if free < need:
        raise ModelSourceError(
            f"{ref} needs {need / 1e9:.2f} GB but {s.cache_dir} has {free / 1e9:.2f} GB free",
            "disk_full",
        )


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def _watch(folder: Path, f: RepoFile, progress: Progress) -> Iterator[None]:
    """Tells ``progress`` how far ``huggingface_hub``'s partial file (``blobs/*.incomplete``)
    has come, from a thread, while the download runs."""
    progress.start(f.path, f.sha256, f.size)
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.2):
            done = 0
            for p in (folder / "blobs").glob("*.incomplete"):
                with suppress(OSError):
                    done += p.stat().st_size
            progress.update(done)

    t = threading.Thread(target=poll, name="download-progress", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
    progress.update(f.size or 0)


def _download(ref: HfRef, s: HubSettings, f: RepoFile, progress: Progress) -> Path:
    """Downloads ``f`` of ``main`` into the cache (``huggingface_hub`` takes a cut connection
    up with a range request and points ``refs/main`` at the commit); checks its SHA-256."""
    hub = _hub()
    errors = hub.errors
    folder = s.cache_dir / ref.cache_folder
    had_blob = _has_blob(folder, f)
    # Our own progress (from the partial file's size) instead of tqdm's bars.
    hub.utils.disable_progress_bars()
    with _watch(folder, f, progress):
        try:
            path = Path(
                hub.hf_hub_download(
                    ref.repo,
                    f.path,
                    revision="main",
                    cache_dir=s.cache_dir,
                    endpoint=s.endpoint,
                    token=s.token,
                )
            )
        except errors.HfHubHTTPError as e:
            raise ModelSourceError(f"downloading {ref.repo}/{f.path}: {e}", "network") from None
        except OSError as e:
            raise ModelSourceError(f"downloading {ref.repo}/{f.path}: {e}", "network") from None
        except Exception as e:  # connection cuts past the retries, timeouts
            raise ModelSourceError(
                f"downloading {ref.repo}/{f.path}: {type(e).__name__}: {e}", "network"
            ) from None
    progress.finish()
    if f.sha256 and not had_blob:
        blob = path.resolve()
        try:
            got = sha256_of(blob)
        except OSError as e:
            raise ModelSourceError(f"{ref.repo}/{f.path}: {e}", "io") from None
        if got != f.sha256:
            for p in (path, blob):
                with suppress(OSError):
                    p.unlink()
            raise ModelSourceError(
                f"{ref.repo}/{f.path}: the downloaded file's SHA-256 is {got}, the hub's is "
                f"{f.sha256}; the file was removed",
                "hash_mismatch",
            )
    return path


def fetch(
    ref: HfRef,
    *,
    settings: HubSettings | None = None,
    mmproj: bool = True,
    download: bool = True,
    progress: Progress | None = None,
) -> HfModel:
    """The model ``ref`` names, from the cache or downloaded into it. Offline (or without
    ``download``) only the cache is used; when the hub cannot be reached a cached copy is
    used. Raises ModelSourceError."""
    s = settings or HubSettings.from_env()
    progress = progress or NoProgress()
    local = cached_files(ref, s)
    if s.offline or not download:
        if local is None:
            why = "offline (HF_HUB_OFFLINE or --offline)" if s.offline else "not downloading"
            raise ModelSourceError(
                f"{ref.repo} is not in the Hugging Face cache {s.cache_dir}, and {why}",
                "offline",
            )
        commit, files = local
        plan = plan_files(ref, files, mmproj=mmproj)
        paths = {f.path: _cached_path(ref, s, commit, f) for f in plan.files}
        for name, path in paths.items():
            if path is None:
                raise ModelSourceError(
                    f"{ref}: {name} is not in the cache {s.cache_dir}", "offline"
                )
    else:
        try:
            commit, files = remote_files(ref, s)
        except ModelSourceError as e:
            if e.kind != "network" or local is None:
                raise
            commit, files = local
            progress.status(f"{e}; using the cached copy")
        plan = plan_files(ref, files, mmproj=mmproj)
        paths = {f.path: _cached_path(ref, s, commit, f) for f in plan.files}
        missing = [f for f in plan.files if paths[f.path] is None]
        folder = s.cache_dir / ref.cache_folder
        _check_disk(ref, s, [f for f in missing if not _has_blob(folder, f)])
        for f in missing:
            paths[f.path] = _download(ref, s, f, progress)
    model = paths[plan.model[0].path]
    proj = paths[plan.mmproj.path] if plan.mmproj is not None else None
    assert model is not None
    return HfModel(ref, model, proj, commit, plan.files)
