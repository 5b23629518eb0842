"""The llama.cpp behaviours the runner relies on, each pinned by name, so that a llama.cpp
upgrade that changes one fails here, loudly and by name, rather than somewhere downstream.

docs/upgrading-llama-cpp.md says what to do when one fails. Each test says which part of the
runner depends on the behaviour. They run on tiny generated models (seconds each).

- sliding-window cells: a sliding-window layer keeps only its window's KV cells (without
  ``--swa-full``), so ``llama_memory_seq_pos_min`` rises as a sequence grows; the runner reuses
  a cached prefix only while that position is at most ``len - window`` (``window_intact``).
- state size: a sequence's saved state is a fixed header plus, per cached token and layer, one
  K and one V row at the cache's type; slot files (``ops/slot_file.rs``) bound what they accept
  by that.
- sampler semantics: the sampler chain the runner builds (``new_sampler``) from llama.cpp's
  samplers: a seed reproduces a sampled text, ``top_k 1``, ``min_p 1`` and ``top_p 0`` leave only
  the best token (so equal greedy decoding), and penalties see the prompt and subtract the
  presence penalty from every token in the window.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from llamarunner import Server

from helpers import complete, slot_file_state
from tinymodel import (
    HEAD_DIM,
    N_HEAD_KV,
    N_LAYER,
    SPARK_SLIDING_WINDOW,
    write_cycle_model,
    write_spark2_5_model,
    write_tiny_model,
)

StartServer = Callable[..., Server]

START = "the cat is the dog and the world of hello "


# --- sliding-window cells -------------------------------------------------------------------


def cached_after(srv: Server, generate: int) -> int:
    """Prompt tokens reused by a short prompt after a generation of `generate` tokens from a
    prompt that shares its start (both on the one slot)."""
    complete(srv.url, START + "and more", temperature=0, num_predict=generate, ignore_eos=True)
    _, done = complete(srv.url, START + "again", temperature=0, num_predict=1)
    return int(done["prompt_cached_count"])


@pytest.mark.parametrize("swa_full", [False, True])
def test_sliding_window_layers_drop_cells_past_their_window(
    tmp_path: Path, start_server: StartServer, swa_full: bool
) -> None:
    model = write_spark2_5_model(tmp_path / "swa.gguf")
    srv = start_server(model, parallel=1, ctx_size=2048, batch_size=32, swa_full=swa_full)
    # Well inside the window: the shared start is reused.
    short = cached_after(srv, 16)
    assert short > 20, short
    # Past the window and a batch (llama.cpp keeps window + n_ubatch cells): the start's cells
    # are gone from the window layer; reusing them would attend to overwritten cells.
    long = cached_after(srv, SPARK_SLIDING_WINDOW + 200)
    if swa_full:
        assert long == short
    else:
        assert long == 0


# --- state size -----------------------------------------------------------------------------


def state_length(file: Path) -> tuple[int, int]:
    """(tokens, llama.cpp state bytes) of a slot file (the layout of ops/slot_file.rs: magic,
    version, fingerprint, description, tokens, state, checksum)."""
    n_tokens, _, state_len = slot_file_state(file.read_bytes())
    return n_tokens, state_len


# f16 K and V rows, per token and layer (the default cache type).
ROW_BYTES = 2 * HEAD_DIM * N_HEAD_KV
PER_TOKEN = N_LAYER * 2 * ROW_BYTES
# llama.cpp's sequence state beside the rows (llama_kv_cache::state_write): per cell its
# position, its count of sequence ids and the one id (12 bytes); once, the stream and cell
# counts and per layer the K/V type and row size: 80 bytes for this 2-layer model with
# llama-cpp-sys-2 0.1.161, 72 with 0.1.154 (its slot files do not load in 0.1.161). A change
# means llama.cpp's state format changed: see docs/upgrading-llama-cpp.md.
STATE_PER_TOKEN_EXTRA = 12
STATE_HEADER = 80


def test_sequence_state_is_a_header_plus_k_and_v_rows_per_token_and_layer(
    tmp_path: Path, start_server: StartServer
) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf")
    slots = tmp_path / "slots"
    srv = start_server(model, parallel=1, ctx_size=1024, slot_save_path=str(slots))
    sizes = {}
    for repeat in (1, 4):
        complete(srv.url, START * repeat, temperature=0, num_predict=1)
        name = f"s{repeat}.bin"
        r = httpx.post(f"{srv.url}/slots/0?action=save", json={"filename": name}, timeout=30)
        assert r.status_code == 200, r.text
        n_tokens, state = state_length(slots / name)
        assert n_tokens == r.json()["n_saved"]
        sizes[n_tokens] = state
    (n1, s1), (n2, s2) = sorted(sizes.items())
    assert (s2 - s1) == (n2 - n1) * (PER_TOKEN + STATE_PER_TOKEN_EXTRA), sizes
    assert s1 - n1 * (PER_TOKEN + STATE_PER_TOKEN_EXTRA) == STATE_HEADER, sizes


# --- sampler semantics ----------------------------------------------------------------------

SAMPLED: dict[str, Any] = {"temperature": 1.5, "num_predict": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = write_tiny_model(tmp_path_factory.mktemp("pins") / "tiny.gguf", seed=3)
    with Server(str(model), port=0, threads=2, parallel=1, ctx_size=1024) as srv:
        yield srv


def test_a_seed_reproduces_a_sampled_text(tiny: Server) -> None:
    a, _ = complete(tiny.url, START, seed=11, **SAMPLED)
    b, _ = complete(tiny.url, START, seed=11, **SAMPLED)
    c, _ = complete(tiny.url, START, seed=12, **SAMPLED)
    assert a == b
    assert a != c  # 24 tokens at temperature 1.5 on random weights: seeds differ


@pytest.mark.parametrize("only_the_best", [{"top_k": 1}, {"min_p": 1.0}, {"top_p": 0.0}], ids=str)
def test_truncation_to_the_best_token_is_greedy(
    tiny: Server, only_the_best: dict[str, Any]
) -> None:
    greedy, _ = complete(tiny.url, START, temperature=0, num_predict=24, ignore_eos=True)
    sampled, _ = complete(tiny.url, START, seed=5, **SAMPLED, **only_the_best)
    assert sampled == greedy


def test_presence_penalty_covers_the_prompt_and_the_output(tmp_path: Path) -> None:
    # The cycle model continues "abcdefgh" with its next letter and wraps to "a": greedy, it
    # repeats the prompt's letters. A presence penalty of 1000 over the whole context makes
    # every token already seen (prompt or output) lose to any unseen one. ("habcd" is "▁", h, a,
    # b, c, d: one token per letter; a prompt starting with "a" would make " a" one token.)
    model = write_cycle_model(tmp_path / "cycle.gguf", "abcdefgh")
    with Server(str(model), port=0, threads=2, parallel=1, ctx_size=512) as srv:
        plain, _ = complete(srv.url, "habcd", temperature=0, num_predict=8, ignore_eos=True)
        assert plain == "efghabcd", plain
        text, _ = complete(
            srv.url,
            "habcd",
            temperature=0,
            num_predict=8,
            ignore_eos=True,
            presence_penalty=1000.0,
            repeat_last_n=-1,
        )
    assert text.startswith("efg"), text
    letters = [ch for ch in "habcd" + text if ch in "abcdefgh"]
    assert len(letters) == len(set(letters)), text
