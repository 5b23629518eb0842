"""Sliding-window attention (Gemma 3: 5 of every 6 layers see the last 512 positions) on the
real default model. By default, as in llama-server, those layers keep only their window's KV
cells, which saves most of the KV memory; a cached sequence cut back past its window has lost
cells and must be decoded again, never reused. `--swa-full` keeps every cell instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from llamarunner import Server

from helpers import complete

# Two 900-token generations; slow on a busy 2-core machine.
pytestmark = [pytest.mark.real_model, pytest.mark.timeout(900)]

START = "The history of the lighthouse begins with fires on hills. "
# Ignoring EOS, long enough to roll the window layers' cells (512 + a 32-token batch, padded).
LONG = {"temperature": 0, "num_predict": 900, "ignore_eos": True}
SHORT = {"temperature": 0, "num_predict": 16}


def run(model: Path, swa_full: bool) -> tuple[tuple[str, int], tuple[str, int]]:
    """(text, cached tokens) of the short prompt on a fresh slot, then again after a long
    generation from a prompt that shares its start."""
    # No drafting: the long generation in between retunes how far it drafts, so the short
    # prompt's answer could be verified in batches of other widths the second time.
    settings = {"parallel": 1, "ctx_size": 2048, "batch_size": 32, "threads": 2, "draft_max": 0}
    with Server(str(model), port=0, swa_full=swa_full, **settings) as srv:
        short = START + "Its keepers"
        fresh, f = complete(srv.url, short, **SHORT)
        long, _ = complete(srv.url, START + "In antiquity", **LONG)
        assert len(long) > 1000
        after, a = complete(srv.url, short, **SHORT)
        return (fresh, f["prompt_cached_count"]), (after, a["prompt_cached_count"])


def test_a_prefix_cut_back_past_the_window_is_decoded_again(default_model: Path) -> None:
    (fresh, fresh_cached), (after, after_cached) = run(default_model, swa_full=False)
    assert fresh_cached == 0
    # The shared start is in the slot, but its window cells were overwritten: not reused...
    assert after_cached == 0
    # ...and decoded again exactly as on a fresh slot (same batches, same kernels).
    assert after == fresh


def test_with_swa_full_the_same_prefix_is_reused(default_model: Path) -> None:
    (_, _), (_, after_cached) = run(default_model, swa_full=True)
    # BOS + the shared start: what the default mode above had to decode again.
    assert after_cached > 10
