"""Models from where people keep them (`llamarunner.sources`): Hugging Face through a local
stand-in of the hub (``HF_ENDPOINT``), Ollama's store generated as Ollama writes it, the one
resolver, and the library commands (``pull``, ``list``, ``show``, ``rm``). Nothing here
reaches a real hub."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamarunner import Server
from llamarunner.sources import ModelSourceError, ollama_store, resolve_model
from llamarunner.sources import huggingface as hf
from llamarunner.sources.huggingface import HfRef, RepoFile, parse_ref, plan_files

from hf_standin import HubStandIn, Repo
from tinymodel import write_tiny_model
from tinyvision import write_tiny_projector

REPO = "tester/tiny-GGUF"


# --- choosing files (pure) ---------------------------------------------------------------


def files(*names: str) -> list[RepoFile]:
    return [RepoFile(n, 10) for n in names]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("owner/repo", HfRef("owner/repo")),
        ("owner/repo:Q4_K_M", HfRef("owner/repo", "Q4_K_M")),
        ("hf.co/owner/repo:q8_0", HfRef("owner/repo", "q8_0")),
        ("huggingface.co/owner/repo", HfRef("owner/repo")),
        ("https://huggingface.co/owner/repo", HfRef("owner/repo")),
        ("llama3.2", None),
        ("llama3.2:1b", None),
        ("a/b/c", None),
        ("../repo", None),
        ("owner/..", None),
        ("owner/model.gguf", None),
        ("owner/repo:", None),
        ("owner/repo:a/b", None),
        ("/abs/path", None),
    ],
)
def test_parse_ref(text: str, expected: HfRef | None) -> None:
    assert parse_ref(text) == expected


def test_tag_matched_case_insensitively_then_defaults() -> None:
    repo = files("m-F16.gguf", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "README.md")
    assert plan_files(HfRef("o/r", "q8_0"), repo).model[0].path == "m-Q8_0.gguf"
    assert plan_files(HfRef("o/r"), repo).model[0].path == "m-Q4_K_M.gguf"
    no_q4 = files("m-F16.gguf", "m-Q8_0.gguf")
    assert plan_files(HfRef("o/r"), no_q4).model[0].path == "m-Q8_0.gguf"
    neither = files("b-F16.gguf", "a-IQ3_M.gguf")
    assert plan_files(HfRef("o/r"), neither).model[0].path == "a-IQ3_M.gguf"


def test_tag_whole_and_latest_is_the_default() -> None:
    repo = files("m-BF16.gguf", "m-F16.gguf", "m-Q4_K_M.gguf")
    assert plan_files(HfRef("o/r", "F16"), repo).model[0].path == "m-F16.gguf"
    assert parse_ref("o/r:latest") == HfRef("o/r")
    assert plan_files(parse_ref("o/r:latest") or HfRef(""), repo).model[0].path == "m-Q4_K_M.gguf"


def test_tag_is_not_a_pattern() -> None:
    with pytest.raises(ModelSourceError) as e:
        plan_files(HfRef("o/r", "Q4.K"), files("m-Q4_K_M.gguf", "m-Q4XK.gguf"))
    assert e.value.kind == "no_file"


def test_split_files_whole_and_projector_beside() -> None:
    repo = files(
        "big/m-Q4_K_M-00002-of-00003.gguf",
        "big/m-Q4_K_M-00001-of-00003.gguf",
        "big/m-Q4_K_M-00003-of-00003.gguf",
        "big/mmproj-m-f16.gguf",
        "mmproj-other-f16.gguf",
        "m-Q8_0.gguf",
    )
    plan = plan_files(HfRef("o/r", "Q4_K_M"), repo)
    assert [f.path for f in plan.model] == [
        f"big/m-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)
    ]
    assert plan.mmproj is not None and plan.mmproj.path == "big/mmproj-m-f16.gguf"
    assert plan_files(HfRef("o/r", "Q4_K_M"), repo, mmproj=False).mmproj is None
    # Not the projector, the importance matrix or a drafting head as the model.
    odd = files("imatrix.gguf", "mmproj-m-f16.gguf", "m-Q6_K.gguf")
    assert plan_files(HfRef("o/r"), odd).model[0].path == "m-Q6_K.gguf"


def test_missing_split_part_and_missing_tag_and_no_gguf() -> None:
    with pytest.raises(ModelSourceError, match="split in 3 files but the repository holds 2"):
        plan_files(
            HfRef("o/r"), files("m-Q4_K_M-00001-of-00003.gguf", "m-Q4_K_M-00002-of-00003.gguf")
        )
    with pytest.raises(ModelSourceError, match="its tags: Q4_K_M, Q8_0"):
        plan_files(HfRef("o/r", "Q2_K"), files("m-Q4_K_M.gguf", "m-Q8_0.gguf"))
    with pytest.raises(ModelSourceError, match="holds no GGUF model file"):
        plan_files(HfRef("o/r"), files("model.safetensors", "mmproj-f16.gguf"))


# --- a hub stand-in ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("hub-weights")
    model = write_tiny_model(d / "tiny.gguf").read_bytes()
    other = write_tiny_model(d / "other.gguf", seed=1).read_bytes()
    projector = write_tiny_projector(d / "mmproj.gguf").read_bytes()
    write_tiny_model(d / "split.gguf", split_max_tensors=8)
    parts = sorted(d.glob("split-0000*-of-*.gguf"))
    assert len(parts) > 1
    out = {"Q4_K_M": model, "Q8_0": other, "mmproj": projector}
    for p in parts:
        out[p.name.replace("split", "tiny-Q5_K_M")] = p.read_bytes()
    return out


@pytest.fixture
def hub(
    weights: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[HubStandIn]:
    with HubStandIn() as stand_in:
        stand_in.repos[REPO] = Repo(
            {
                "tiny-Q4_K_M.gguf": weights["Q4_K_M"],
                "tiny-Q8_0.gguf": weights["Q8_0"],
                "mmproj-tiny-f16.gguf": weights["mmproj"],
                "README.md": b"# tiny\n",
                **{k: v for k, v in weights.items() if k.startswith("tiny-Q5_K_M")},
            }
        )
        monkeypatch.setenv("HF_ENDPOINT", stand_in.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama-empty"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_HOME", raising=False)
        yield stand_in


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llamarunner", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ),
    )


def gets(hub: HubStandIn) -> list[str]:
    return [r.path for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]


def test_pull_then_cached_then_offline(hub: HubStandIn, weights: dict[str, bytes]) -> None:
    out = cli("pull", REPO)
    assert out.returncode == 0, out.stderr
    assert f"{REPO}: in the Hugging Face cache" in out.stdout
    assert "downloading tiny-Q4_K_M.gguf" in out.stderr  # plain lines: not a terminal
    downloaded = gets(hub)
    assert any(p.endswith("/tiny-Q4_K_M.gguf") for p in downloaded)
    assert any(p.endswith("/mmproj-tiny-f16.gguf") for p in downloaded)
    assert not any("Q8_0" in p for p in downloaded)
    resolved = resolve_model(REPO)
    assert resolved.path.read_bytes() == weights["Q4_K_M"]
    assert resolved.mmproj is not None and resolved.mmproj.read_bytes() == weights["mmproj"]
    # The cache's layout is huggingface_hub's own: a snapshot link into a blob by SHA-256.
    sha = hashlib.sha256(weights["Q4_K_M"]).hexdigest()
    assert resolved.path.resolve().name == sha
    # Again: nothing is downloaded, and offline works from the cache.
    before = len(gets(hub))
    assert cli("pull", REPO).returncode == 0
    assert cli("pull", "--offline", REPO).returncode == 0
    assert len(gets(hub)) == before


def test_pull_json_progress_as_ollama_streams_it(hub: HubStandIn) -> None:
    out = cli("pull", "--progress", "json", f"hf.co/{REPO}:Q8_0", "--no-mmproj")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert lines[-1] == {"status": "success"}
    pulling = [x for x in lines if x.get("status", "").startswith("pulling sha256:")]
    assert pulling and pulling[-1]["completed"] == pulling[-1]["total"] > 0
    assert not any("mmproj" in p for p in gets(hub))


def test_split_model_fetched_whole_and_served(
    hub: HubStandIn, start_server: Callable[..., Server]
) -> None:
    srv = start_server(f"{REPO}:Q5_K_M", mmproj=None)
    parts = [p for p in gets(hub) if "Q5_K_M" in p]
    assert len(parts) == len({k for k in hub.repos[REPO].files if "Q5_K_M" in k}) > 1
    models = httpx.get(f"{srv.url}/v1/models").json()["data"]
    assert models[0]["id"] == f"{REPO}:Q5_K_M"
    r = httpx.post(f"{srv.url}/completion", json={"prompt": "ab", "n_predict": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 4


def test_resume_after_a_cut_connection(hub: HubStandIn) -> None:
    """A connection cut mid-file is taken up again with a range request from where the
    written part ends (huggingface_hub writes in 10 MiB chunks: the file is larger), and the
    file's SHA-256 is checked."""
    chunk = 10 << 20
    data = os.urandom(chunk + (2 << 20))
    hub.repos["tester/big"] = Repo(
        {"big-Q4_K_M.gguf": data}, cut_once={"big-Q4_K_M.gguf": chunk + 4096}
    )
    resolved = resolve_model("tester/big")
    assert resolved.path.read_bytes() == data
    first, again = hub.downloads("big-Q4_K_M.gguf")
    assert {k.lower(): v for k, v in first.headers.items()}.get("range") is None
    assert {k.lower(): v for k, v in again.headers.items()}.get("range") == f"bytes={chunk}-"


def test_corrupted_download_is_removed_and_not_served(hub: HubStandIn, tmp_path: Path) -> None:
    hub.repos[REPO].corrupt.add("tiny-Q4_K_M.gguf")
    out = cli("serve", REPO, "--port", "0")
    assert out.returncode == 1, out.stderr
    assert "SHA-256" in out.stderr and "removed" in out.stderr
    cache = tmp_path / "hf-cache" / "models--tester--tiny-GGUF"
    assert not list(cache.glob("snapshots/*/tiny-Q4_K_M.gguf"))
    sha = hashlib.sha256(hub.repos[REPO].files["tiny-Q4_K_M.gguf"]).hexdigest()
    assert not (cache / "blobs" / sha).exists()


def test_hub_errors_a_user_can_act_on(hub: HubStandIn, weights: dict[str, bytes]) -> None:
    hub.repos["tester/private"] = Repo({"p-Q4_K_M.gguf": weights["Q4_K_M"]}, private_token="s3cret")
    hub.repos["tester/gated"] = Repo({"g-Q4_K_M.gguf": weights["Q4_K_M"]}, gated=True)
    hub.repos["tester/no-gguf"] = Repo({"model.safetensors": b"x"})

    def kind(spec: str) -> tuple[str, str]:
        with pytest.raises(ModelSourceError) as e:
            resolve_model(spec)
        return e.value.kind, str(e.value)

    k, message = kind("tester/missing")
    assert k == "not_found" and "404" in message
    k, message = kind("tester/private")
    assert k == "unauthorized" and "HF_TOKEN" in message and "401" in message
    k, message = kind("tester/gated")
    assert k == "unauthorized" and "HF_TOKEN" in message
    k, message = kind(f"{REPO}:IQ1_S")
    assert k == "no_file" and "Q4_K_M, Q5_K_M, Q8_0" in message
    k, message = kind("tester/no-gguf")
    assert k == "no_file"
    os.environ["HF_TOKEN"] = "s3cret"
    try:
        assert resolve_model("tester/private").path.read_bytes() == weights["Q4_K_M"]
    finally:
        del os.environ["HF_TOKEN"]
    # The CLI: exit 2 for a name that is not there, 1 for what is not the argument's fault.
    out = cli("serve", "tester/missing", "--port", "0")
    assert out.returncode == 2 and "no repository tester/missing" in out.stderr
    out = cli("pull", "tester/gated")
    assert out.returncode == 1 and "gated" in out.stderr


def test_offline_and_unreachable_hub(hub: HubStandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModelSourceError) as e:
        resolve_model(REPO, offline=True)
    assert e.value.kind == "not_found" and "offline" in str(e.value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = cli("pull", REPO)
    assert out.returncode == 2 and "not in the Hugging Face cache" in out.stderr
    assert gets(hub) == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    resolve_model(REPO)
    # The hub gone: the cached copy is used.
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert hf.fetch(parse_ref(REPO) or HfRef(REPO)).path.is_file()


def test_disk_too_small_checked_before_downloading(
    hub: HubStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    real = shutil.disk_usage

    def tiny_disk(path: Any) -> Any:
        return real(path)._replace(free=1000)

    monkeypatch.setattr(hf.shutil, "disk_usage", tiny_disk)
    with pytest.raises(ModelSourceError) as e:
        resolve_model(REPO)
    assert e.value.kind == "disk_full"
    assert gets(hub) == []


def test_hf_flag_and_list_show_rm(hub: HubStandIn, tmp_path: Path) -> None:
    out = cli("serve", "-hf", REPO, "llamarunner.gguf")
    assert out.returncode == 2 and "not both" in out.stderr
    assert cli("pull", f"{REPO}:Q8_0").returncode == 0
    assert cli("pull", REPO).returncode == 0
    listed = json.loads(cli("list", "--json").stdout)
    names = {m["name"]: m for m in listed}
    assert {f"{REPO}:Q4_K_M", f"{REPO}:Q8_0"} <= set(names)
    q4 = names[f"{REPO}:Q4_K_M"]
    assert q4["source"] == "huggingface" and q4["architecture"] == "llama"
    assert q4["quantization"] == "F32" and q4["context_length"] == 65536 and q4["mmproj"]
    shown = json.loads(cli("show", "--json", f"{REPO}:Q8_0").stdout)
    assert shown["architecture"] == "llama" and shown["metadata"]["tensor_count"] > 0
    assert "tiny-Q8_0.gguf" in shown["path"]
    removed = cli("rm", f"{REPO}:Q8_0")
    assert removed.returncode == 0 and "tiny-Q8_0.gguf" in removed.stdout
    names = {m["name"] for m in json.loads(cli("list", "--json").stdout)}
    assert f"{REPO}:Q8_0" not in names and f"{REPO}:Q4_K_M" in names
    assert cli("rm", REPO).returncode == 0
    assert not (tmp_path / "hf-cache" / "models--tester--tiny-GGUF").exists()
    out = cli("rm", "tmp/model.gguf")
    assert out.returncode == 1 and "not a model llamarunner downloaded" in out.stderr


# --- Ollama's store ------------------------------------------------------------------------


def write_blob(root: Path, data: bytes) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def write_manifest(root: Path, name: str, layers: dict[str, bytes]) -> Path:
    """A manifest as Ollama writes it for ``name`` (``model:tag``, default namespace)."""
    model, tag = name.split(":")
    path = root / "manifests" / "registry.ollama.ai" / "library" / model / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    config = write_blob(root, b'{"model_format":"gguf"}')
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", **config},
        "layers": [
            {"mediaType": f"application/vnd.ollama.image.{kind}", **write_blob(root, data)}
            for kind, data in layers.items()
        ],
    }
    path.write_text(json.dumps(manifest))
    return path


@pytest.fixture
def store(weights: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "ollama"
    params = {"temperature": 0.25, "top_k": 7, "stop": ["<|end|>"], "num_ctx": 4096}
    write_manifest(
        root,
        "tiny:latest",
        {
            "model": weights["Q4_K_M"],
            "params": json.dumps(params).encode(),
            "system": b"You are tiny.",
            "template": b"{{ .Prompt }}",
            "license": b"MIT",
        },
    )
    write_manifest(root, "seer:1b", {"model": weights["Q8_0"], "projector": weights["mmproj"]})
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # no hub
    return root


def test_ollama_model_served_in_place_through_the_ollama_client(
    store: Path, weights: dict[str, bytes], start_server: Callable[..., Server]
) -> None:
    resolved = resolve_model("tiny")
    assert resolved.source == "ollama" and resolved.name == "tiny:latest"
    assert resolved.path.parent == store / "blobs"  # the blob itself, not a copy
    assert resolved.defaults == {"temp": 0.25, "top_k": 7, "system_prompt": "You are tiny."}
    assert any("num_ctx" in n and "stop" in n for n in resolved.notes)
    srv = start_server("tiny")
    assert srv.config.temp == 0.25 and srv.config.top_k == 7 and srv.config.alias == "tiny:latest"
    client = ollama.Client(host=srv.url)
    names = [m.model for m in client.list().models]
    assert names == ["tiny:latest"]
    answer = client.generate(model="tiny", prompt="ab", options={"num_predict": 3})
    assert answer.done and answer.eval_count == 3
    # An explicit setting wins over the model's params.
    srv2 = start_server("tiny:latest", temp=0.9)
    assert srv2.config.temp == 0.9 and srv2.config.top_k == 7
    seer = resolve_model("seer:1b")
    assert seer.mmproj is not None and seer.mmproj.read_bytes() == weights["mmproj"]


def test_ollama_store_errors(store: Path, weights: dict[str, bytes]) -> None:
    write_manifest(store, "broken:latest", {"model": weights["Q8_0"]})
    blob = store / "blobs" / f"sha256-{hashlib.sha256(weights['Q8_0']).hexdigest()}"
    (store / "blobs" / "keep").write_bytes(blob.read_bytes())
    manifest = store / "manifests/registry.ollama.ai/library/broken/latest"
    data = json.loads(manifest.read_text())
    data["layers"][0]["digest"] = "sha256:" + "0" * 64
    manifest.write_text(json.dumps(data))
    with pytest.raises(ModelSourceError, match=r"blob sha256-0+ is missing") as e:
        resolve_model("broken")
    assert e.value.kind == "bad_manifest"
    manifest.write_text("{not json")
    with pytest.raises(ModelSourceError, match="not JSON"):
        resolve_model("broken")
    data["layers"][0]["digest"] = "sha256:../../../../etc/passwd"
    manifest.write_text(json.dumps(data))
    with pytest.raises(ModelSourceError, match="is not sha256:<hex>"):
        resolve_model("broken")
    for bad in ("../ollama/x", "a/../../b", "x:../../y", "a/b/c/d"):
        with pytest.raises(ModelSourceError) as e:
            resolve_model(bad)
        assert e.value.kind in ("bad_name", "not_found")
    out = cli("serve", "nothing-here", "--port", "0")
    assert out.returncode == 2
    assert "not in Ollama's store" in out.stderr and "no file" in out.stderr
    out = cli("rm", "tiny")
    assert out.returncode == 1 and "ollama rm" in out.stderr
    assert (store / "manifests/registry.ollama.ai/library/tiny/latest").is_file()


def test_odd_stores_are_errors_not_crashes(
    store: Path, weights: dict[str, bytes], tmp_path: Path
) -> None:
    # A params layer with numbers no setting holds: ignored, not a crash.
    write_manifest(
        store,
        "wild:latest",
        {"model": weights["Q8_0"], "params": b'{"seed": 1e999, "temperature": NaN, "top_k": 3}'},
    )
    wild = resolve_model("wild")
    assert wild.defaults == {"top_k": 3}
    # A manifest that is not UTF-8.
    manifest = store / "manifests/registry.ollama.ai/library/wild/latest"
    manifest.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ModelSourceError, match="not UTF-8"):
        resolve_model("wild")
    # A blob that is a link out of the store: refused, nothing read there.
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    write_manifest(store, "leaky:latest", {"model": weights["Q8_0"], "system": b"x"})
    system_blob = store / "blobs" / f"sha256-{hashlib.sha256(b'x').hexdigest()}"
    system_blob.unlink()
    system_blob.symlink_to(outside)
    with pytest.raises(ModelSourceError, match="leads out of the store"):
        resolve_model("leaky")
    # --no-mmproj leaves out the projector of a model of the store too.
    assert resolve_model("seer:1b", mmproj=False).mmproj is None
    # list skips what it cannot read, and shows the rest.
    listed = {m["name"] for m in json.loads(cli("list", "--json").stdout)}
    assert {"tiny:latest", "seer:1b"} <= listed and "wild:latest" not in listed


def test_rm_touches_only_the_repositorys_own_blobs(hub: HubStandIn, tmp_path: Path) -> None:
    hub.repos["tester/mixed"] = Repo(
        {"m-Q4_K_M.gguf": b"GGUF-not-really", "config.json": b"{}", "v-Q8_0.gguf": b"GGUF-v"}
    )
    resolve_model("tester/mixed:Q4_K_M", mmproj=False)
    resolve_model("tester/mixed:Q8_0", mmproj=False)
    folder = tmp_path / "hf-cache" / "models--tester--mixed"
    (snapshot,) = (folder / "snapshots").iterdir()
    # A snapshot entry planted to point out of the cache: rm removes the link, not the target.
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (snapshot / "v-Q8_0.gguf").unlink()
    (snapshot / "v-Q8_0.gguf").symlink_to(victim)
    assert cli("rm", "tester/mixed:Q8_0").returncode == 0
    assert victim.read_text() == "keep me"
    assert cli("rm", "tester/mixed:Q4_K_M").returncode == 0
    assert not (snapshot / "m-Q4_K_M.gguf").exists()
    assert not list((folder / "snapshots").rglob("*.gguf"))


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab./:\\-_~%0\x00"), max_size=24))
def test_hostile_names_never_leave_the_store(name: str) -> None:
    """Whatever the name, it parses to nothing or to a manifest path inside the store, and
    the resolver's answer is a ModelSourceError or a model, never another exception."""
    root = Path("/nonexistent-store")
    parsed = ollama_store.parse_name(name)
    if parsed is not None:
        path = parsed.manifest(root)
        assert ".." not in path.relative_to(root).parts
    with contextlib.suppress(ModelSourceError):
        resolve_model(name, offline=True)


def test_list_and_show_ollama_models(store: Path) -> None:
    listed = {m["name"]: m for m in json.loads(cli("list", "--json").stdout)}
    assert listed["tiny:latest"]["source"] == "ollama"
    assert listed["seer:1b"]["mmproj"]
    shown = cli("show", "tiny")
    assert shown.returncode == 0, shown.stderr
    assert "temp            0.25" in shown.stdout and "You are tiny." in shown.stdout
    # Where the weights would go here (lavapipe's device in CI's wheel run, else the CPU).
    fit = next(line for line in shown.stdout.splitlines() if line.startswith("fit here"))
    assert "on the CPU: no GPU found" in fit or "layers on" in fit


def test_library_serves_the_caches_by_name_with_the_models_system_prompt(
    hub: HubStandIn, weights: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    resolve_model(f"{REPO}:Q8_0", mmproj=False)
    store = tmp_path / "ollama"
    write_manifest(store, "tiny:latest", {"model": weights["Q4_K_M"], "system": b"You are tiny."})
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    with Server(library=True, port=0, threads=2) as srv:
        srv.wait_ready(timeout=60)
        names = {m["id"] for m in httpx.get(f"{srv.url}/v1/models").json()["data"]}
        assert names == {f"{REPO}:Q8_0", "tiny:latest"}
        tags = [m.model for m in ollama.Client(host=srv.url).list().models]
        assert sorted(tags) == sorted(names)

        def template(model: str, messages: list[dict[str, str]]) -> str:
            r = httpx.post(
                f"{srv.url}/apply-template",
                json={"model": model, "messages": messages},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            return str(r.json()["prompt"])

        hello = [{"role": "user", "content": "hello"}]
        # Ollama's name without its tag finds NAME:latest; its system prompt is the default.
        assert "You are tiny." in template("tiny", hello)
        own = template("tiny", [{"role": "system", "content": "Be brief."}, *hello])
        assert "Be brief." in own and "You are tiny." not in own
        assert "You are tiny." not in template(f"{REPO}:Q8_0", hello)
        answer = ollama.Client(host=srv.url).chat(
            model="tiny", messages=hello, options={"num_predict": 2}
        )
        assert answer.done


def test_system_prompt_flag(tiny_model: Path, start_server: Callable[..., Server]) -> None:
    srv = start_server(tiny_model, system_prompt="Answer in French.")
    r = httpx.post(
        f"{srv.url}/apply-template", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert "Answer in French." in r.json()["prompt"]
    r = httpx.post(
        f"{srv.url}/v1/chat/completions",
        json={"messages": [{"role": "developer", "content": "Terse."}], "max_tokens": 1},
    )
    assert r.status_code == 200


def test_api_pull_on_a_router_that_allows_it(
    hub: HubStandIn, weights: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The official ollama client's pull, list and show on a router started with nothing but
    --allow-pull: the pull streams Ollama's progress, the model is then listed and served."""
    store = tmp_path / "ollama"
    write_manifest(store, "tiny:latest", {"model": weights["Q4_K_M"]})
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    with Server(allow_pull=True, port=0, threads=2) as srv:
        client = ollama.Client(host=srv.url)
        assert client.list().models == []
        progress = list(client.pull(f"{REPO}:Q8_0", stream=True))
        assert progress[-1].status == "success"
        assert any(p.total and p.completed == p.total for p in progress)
        # From Ollama's store: nothing to download.
        assert client.pull("tiny").status == "success"
        names = sorted(m.model for m in client.list().models)
        assert names == sorted([f"{REPO}:Q8_0", "tiny:latest"])
        # Served: loaded on the first request; a second pull finds it there.
        answer = client.generate(model=f"{REPO}:Q8_0", prompt="ab", options={"num_predict": 2})
        assert answer.done and answer.eval_count == 2
        assert client.show("tiny").details.family == "llama"
        before = len(gets(hub))
        assert client.pull(f"{REPO}:Q8_0").status == "success"
        assert len(gets(hub)) == before
        # Errors in Ollama's shape: a name nowhere, a repository with no such tag.
        with pytest.raises(ollama.ResponseError) as e:
            client.pull("tester/missing")
        assert e.value.status_code == 404 and "no repository" in e.value.error
        lines = [
            json.loads(line)
            for line in httpx.post(
                f"{srv.url}/api/pull", json={"model": f"{REPO}:IQ1_S"}, timeout=60
            ).text.splitlines()
        ]
        assert lines[-1]["type"] == "no_file" and "its tags" in lines[-1]["error"]
        r = httpx.post(f"{srv.url}/api/pull", json={"model": ""}, timeout=10)
        assert r.status_code == 400
        # Never a file of the server's disk, whatever a client names.
        for path in (str(tmp_path / "ollama" / "blobs"), "/etc/passwd", "../x.gguf"):
            r = httpx.post(f"{srv.url}/api/pull", json={"model": path, "stream": False})
            assert r.status_code == 404 and "not a path" in r.json()["error"], r.text
        # Pulled as hf.co/...: served under its own name, and found by the name asked.
        assert client.pull(f"hf.co/{REPO}:Q8_0").status == "success"
        assert len([m for m in client.list().models if m.model == f"{REPO}:Q8_0"]) == 1
        answer = client.generate(model=f"hf.co/{REPO}:Q8_0", prompt="a", options={"num_predict": 1})
        assert answer.done
        # Ollama's delete: from our cache only; a model of Ollama's store stays.
        assert client.delete(f"{REPO}:Q8_0").status == "success"
        assert f"{REPO}:Q8_0" not in [m.model for m in client.list().models]
        assert not list((tmp_path / "hf-cache").rglob("tiny-Q8_0.gguf"))
        with pytest.raises(ollama.ResponseError) as e:
            client.delete("tiny")
        assert e.value.status_code == 400 and "ollama rm" in e.value.error
        assert "tiny:latest" in [m.model for m in client.list().models]
        with pytest.raises(ollama.ResponseError) as e:
            client.delete("never-pulled")
        assert e.value.status_code == 404
        # Ollama's show of a model not served is a 404 (it pulls nothing).
        with pytest.raises(ollama.ResponseError) as e:
            client.show(REPO)
        assert e.value.status_code == 404
        # A request naming a model not served yet pulls it first.
        answer = client.generate(model=REPO, prompt="ab", options={"num_predict": 2})
        assert answer.done and REPO in [m.model for m in client.list().models]
        r = httpx.post(
            f"{srv.url}/v1/completions",
            json={"model": "tester/missing", "prompt": "a", "max_tokens": 1},
            timeout=60,
        )
        assert r.status_code == 404 and "no repository" in r.json()["error"]["message"]


def test_a_pull_running_is_listed_with_its_progress(hub: HubStandIn) -> None:
    import threading

    # huggingface_hub writes 10 MiB at a time: a 12 MiB file (at 64 KiB per 20 ms) shows
    # progress once its first 10 MiB are written. The stand-in holds the rest back until the
    # listing has shown that progress (a poll that only had the last ~0.6 s of the download
    # to see it in could miss it on a loaded machine).
    data = os.urandom(12 << 20)
    progressed = threading.Event()
    hub.repos["tester/big"] = Repo(
        {"big-Q4_K_M.gguf": data},
        slow={"big-Q4_K_M.gguf": 0.02},
        hold={"big-Q4_K_M.gguf": (11 << 20, progressed)},
    )
    with Server(allow_pull=True, port=0, threads=2) as srv:
        done: list[Any] = []
        t = threading.Thread(
            target=lambda: done.append(ollama.Client(host=srv.url).pull("tester/big"))
        )
        t.start()
        seen: list[dict[str, Any]] = []
        try:
            while t.is_alive():
                listed = httpx.get(f"{srv.url}/models", timeout=10).json()["data"]
                status = [m["status"] for m in listed if m["id"] == "tester/big"]
                seen += status
                if any(st.get("progress", 0) > 0 for st in status):
                    progressed.set()
                time.sleep(0.05)
        finally:
            progressed.set()
        t.join()
        assert done[0].status == "success"
        pulling = [st for st in seen if st["value"] == "pulling"]
        assert pulling, seen
        assert all(st["total"] == len(data) for st in pulling if "total" in st), pulling
        assert any(0 < st.get("progress", 0) <= 1 for st in pulling), pulling
        after = httpx.get(f"{srv.url}/models", timeout=10).json()["data"]
        assert [(m["id"], m["status"]["value"]) for m in after] == [("tester/big", "unloaded")]


def test_api_pull_is_refused_without_allow_pull(
    hub: HubStandIn, tiny_model: Path, tmp_path: Path
) -> None:
    with Server(models=[str(tiny_model)], port=0, threads=2) as srv:
        r = httpx.post(f"{srv.url}/api/pull", json={"model": REPO, "stream": False}, timeout=10)
        assert r.status_code == 404 and "--allow-pull" in r.json()["error"]
        r = httpx.post(f"{srv.url}/api/pull", json={"model": "tiny", "stream": False}, timeout=10)
        assert r.status_code == 200 and r.json() == {"status": "success"}
    assert gets(hub) == []


def test_a_preset_names_a_model_the_resolver_finds(hub: HubStandIn, tmp_path: Path) -> None:
    from llamarunner.router import served_models

    preset = tmp_path / "presets.toml"
    preset.write_text(f'[small]\nmodel = "{REPO}:Q8_0"\nctx-size = 256\n')
    (small,) = served_models([], models_preset=preset)
    assert small.name == "small" and small.settings == {"ctx_size": 256}
    assert small.path.name == "tiny-Q8_0.gguf" and "hf-cache" in str(small.path)
    assert small.mmproj is not None and small.mmproj.name == "mmproj-tiny-f16.gguf"


def test_a_blob_llama_cpp_cannot_load_is_a_clear_error(store: Path, tmp_path: Path) -> None:
    """Ollama's engine writes some models in a layout stock llama.cpp does not read: serving
    one fails with the model's name and why, never a crash."""
    write_manifest(store, "odd:latest", {"model": b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64})
    out = cli("serve", "odd", "--port", "0")
    assert out.returncode == 2, out.stderr
    assert "model failed to load" in out.stderr
    assert "odd:latest of Ollama's store" in out.stderr


def test_hostile_pull_bodies_are_refused_before_any_pull(hub: HubStandIn) -> None:
    with Server(allow_pull=True, port=0, threads=2) as srv:
        for body in (
            {"model": 5},
            {"model": ["a"]},
            {"model": {"nested": {"deeper": "x"}}},
            {"model": "x" * 300},
            {"model": "a\nb"},
            {"model": "a\x00b"},
            {},
        ):
            r = httpx.post(f"{srv.url}/api/pull", json=body, timeout=10)
            assert r.status_code == 400, (body, r.text)
            r = httpx.request("DELETE", f"{srv.url}/api/delete", json=body, timeout=10)
            assert r.status_code == 400, (body, r.text)
        r = httpx.post(f"{srv.url}/api/pull", content=b"{not json", timeout=10)
        assert r.status_code == 400
        # A name with a line separator comes back escaped: the stream's lines stay whole.
        r = httpx.post(f"{srv.url}/api/pull", json={"model": "a\u2028b"}, timeout=60)
        lines = r.text.splitlines()
        assert len(r.content.split(b"\n")) == 2 and "\u2028" not in r.text, r.text
        assert json.loads(lines[-1])["error"]
    assert gets(hub) == []


@settings(max_examples=200, deadline=None)
@given(
    cut=st.integers(min_value=0, max_value=4096), flips=st.lists(st.integers(0, 4095), max_size=8)
)
def test_gguf_metadata_of_broken_files_is_an_error_not_a_crash(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, cut: int, flips: list[int]
) -> None:
    """ggml's reader gets truncated and corrupted headers (the tiny model's first 4 KiB):
    an answer or a ValueError, never an abort."""
    from llamarunner import _core

    data = bytearray(tiny_model.read_bytes()[:cut])
    for at in flips:
        if at < len(data):
            data[at] ^= 0xFF
    path = tmp_path_factory.mktemp("gguf") / "broken.gguf"
    path.write_bytes(bytes(data))
    with contextlib.suppress(ValueError):
        json.loads(_core.gguf_metadata(str(path)))
