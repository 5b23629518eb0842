"""``--backend-sampling``: a request whose sampling needs only its best ``k`` logits per token
has that top-k cut in the decode's own graph (on the device of the model's output layer; the
CPU here), and its sampler runs on those ``k`` candidates. The tokens must be those sampled
from the whole vocabulary's logits: the same requests, one at a time (so that each decode's
batch is the same), give the same texts with the flag and without it, for the requests it
cuts (OpenAI's defaults, top-p and min-p after the top-k, bans of ``ignore_eos``, greedy when
it does not draft) and for those it leaves whole (log-probabilities, penalties, a grammar, a
logit bias, no top-k, greedy drafting by prompt lookup: llama.cpp cuts one position per
sequence and decode, and a draft's verification reads several). The log says when the first
cut was attached, so that a flag that never cut anything fails."""

from __future__ import annotations

import resource
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from llamarunner import Server

from helpers import ServeProcess, complete, status_kib
from tinyvision import b64, image_bytes, write_tiny_projector

# Cut on the device: their chains' first cut is a top-k (or greedy) with nothing before it
# but bans (greedy only with --draft-max 0: a sequence that drafts is left whole).
CUT: list[dict[str, Any]] = [
    {"seed": 1},
    {"seed": 2, "temperature": 0.8, "top_k": 40, "top_p": 0.9},
    {"temperature": 0},
    {"temperature": 0, "ignore_eos": True},
    {"seed": 5, "ignore_eos": True, "min_p": 0.05},
    {"seed": 6, "top_k": 3, "n_probs": 0},
]
# Left whole: something in the chain reads more than the best few logits.
WHOLE: list[dict[str, Any]] = [
    {"seed": 11, "n_probs": 3},
    {"seed": 12, "repeat_penalty": 1.2, "top_k": 40},
    {"seed": 13, "top_k": 0},
    {"seed": 14, "logit_bias": [[5, 3.0]]},
    {"seed": 15, "json_schema": {"type": "array", "items": {"type": "integer"}}},
]

FIRST_CUT = r"--backend-sampling: the first top-k cut is attached"


def complete_native(url: str, i: int, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(
        url + "/completion",
        json={"prompt": f"request {i}: " + "a b " * i, "n_predict": 24, **body},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, dict)
    return out


def serve(model: Path, *flags: str) -> ServeProcess:
    return ServeProcess(str(model), "--port", "0", "--threads", "2", "--ctx-size", "512", *flags)


def texts(url: str, bodies: list[dict[str, Any]]) -> list[str]:
    return [str(complete_native(url, i, body)["content"]) for i, body in enumerate(bodies)]


@pytest.mark.parametrize("drafts", ["--draft-max=16", "--draft-max=0"])
def test_the_device_cut_samples_what_the_whole_vocabulary_does(
    tiny_model: Path, drafts: str
) -> None:
    bodies = CUT + WHOLE
    with serve(tiny_model, "--parallel", "1", drafts) as plain:
        want = texts(plain.wait_ready(), bodies)
    assert len(set(want)) > 5, want  # the requests differ, so a mix-up would show
    with serve(tiny_model, "--parallel", "1", drafts, "--backend-sampling") as cut:
        url = cut.wait_ready()
        got = texts(url, bodies)
        assert got == want
        cut.wait_for(FIRST_CUT, timeout=5)
        # The log-probabilities of a request left whole are whole-vocabulary ones.
        probs = complete_native(url, 0, {"seed": 11, "n_probs": 3})["completion_probabilities"]
        assert all(len(p["top_logprobs"]) == 3 for p in probs)
        assert "refused" not in cut.log and "panicked" not in cut.log


def test_sequences_cut_and_whole_share_batches(tiny_model: Path) -> None:
    """Requests of both kinds at once: every answer complete, in batches where some
    positions come back cut and others whole, slots going from one kind to the other."""
    bodies = (CUT + WHOLE) * 2
    with serve(tiny_model, "--parallel", "4", "--backend-sampling") as srv:
        url = srv.wait_ready()
        for _ in range(2):
            with ThreadPoolExecutor(6) as pool:
                outs = list(pool.map(lambda ib: complete_native(url, *ib), enumerate(bodies)))
            for out in outs:
                assert out["stop_type"] in ("limit", "eos"), out
                assert 0 < out["tokens_predicted"] <= 24, out
        srv.wait_for(FIRST_CUT, timeout=5)
        r = httpx.get(url + "/health", timeout=10)
        assert r.status_code == 200


def test_deterministic_mode_refuses_the_flag(tiny_model: Path) -> None:
    with serve(tiny_model, "--deterministic", "--backend-sampling") as srv:
        assert srv.wait(timeout=60) != 0
        assert "--backend-sampling" in srv.log


def test_a_prompt_that_ends_with_an_image_samples_as_without_the_flag(
    start_server: Callable[..., Server], tiny_model: Path, tmp_path: Path
) -> None:
    """A prompt that ends with an image samples its first token from the image's last
    position, decoded by the projector's own batches on the same context: the sequence's cut
    (attached when its text before the image was decoded) cuts that position too, and the
    token sampled from it is the one sampled from the whole row."""
    projector = write_tiny_projector(tmp_path / "tiny-mmproj.gguf")
    # Without the repetition penalty of Ollama's defaults (which `options` gets), which would
    # keep the whole logits.
    options = {"temperature": 1.0, "seed": 4, "num_predict": 8, "repeat_penalty": 1.0}
    prompts = ["[img-0]", "hello [img-0]", "hello [img-0] world"]
    images = {"images": [{"id": 0, "data": b64(image_bytes(colour=(220, 20, 40)))}]}

    def answers(**flags: Any) -> list[str]:
        srv = start_server(tiny_model, parallel=1, ctx_size=512, mmproj=str(projector), **flags)
        return [complete(srv.url, p, images, **options)[0] for p in prompts]

    assert answers(backend_sampling=True) == answers()


@contextmanager
def address_space_limit(pid: int, limit: int) -> Iterator[None]:
    """Process ``pid`` may map no more than ``limit`` bytes (``RLIMIT_AS``) inside the block."""
    soft, hard = resource.prlimit(pid, resource.RLIMIT_AS)
    resource.prlimit(pid, resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.prlimit(pid, resource.RLIMIT_AS, (soft, hard))


THREW = "llama.cpp threw in a decode"
GAVE_UP = "--backend-sampling: off"


@pytest.mark.real_model
def test_a_graph_that_no_longer_fits_stops_the_cuts_not_the_server(default_model: Path) -> None:
    """The first attached chain makes llama.cpp reserve a compute buffer twice the size of
    load's; with no memory for it (on a GPU: the model and its cache fill the device; here an
    address-space limit), llama_decode throws. Rust cannot catch a C++ exception, so the server
    aborted with every request in it. Now the cuts stop and the batch is decoded again without
    them: the request is answered, the next ones too."""
    body = {"prompt": "Hello there", "max_tokens": 8, "seed": 3}
    # On the CPU, where the compute buffers are the process's memory (a GPU build's would be
    # the device's, out of the limit's reach).
    flags = ("--backend-sampling", "--parallel", "4", "--ctx-size", "2048", "--n-gpu-layers", "0")
    with serve(default_model, *flags) as p:
        url = p.wait_ready()
        pid = p.proc.pid
        # The graph with a chain holds a second row of logits per position of a micro-batch
        # (512): 512 MiB more for Gemma 3 (523 to 1,036 MiB measured). Half of that is left.
        n_vocab = httpx.get(url + "/props", timeout=30).json()["model"]["n_vocab"]
        room = 512 * n_vocab * 4 // 2
        # VmSize: the address space the process holds.
        with address_space_limit(pid, status_kib(pid, "VmSize") * 1024 + room):
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, (r.text, p.log)
        p.wait_for(THREW)
        p.wait_for(GAVE_UP)
        assert FIRST_CUT in p.log
        first = r.json()["choices"][0]["text"]
        # The same request alone again: the same text, sampled from whole rows as the first
        # was after the cuts stopped.
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == first
        with ThreadPoolExecutor(4) as pool:
            again = list(pool.map(lambda i: complete_native(url, i, {"seed": i}), range(4)))
        assert all(a["content"] for a in again), again
        assert p.proc.poll() is None
        assert p.log.count(THREW) == 1, p.log
