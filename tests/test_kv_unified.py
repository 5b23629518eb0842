"""One KV cache the slots share (``--kv-unified``): a sequence may use more than a slot's
share, and sequences that together need more than the cache wait swapped out to RAM instead
of failing (``sched/shared_cache.rs``)."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import httpx

from llamarunner import Server

from helpers import complete


def generate(url: str, prompt: str, n: int) -> int:
    """Tokens generated for ``prompt`` when asked for ``n``, end-of-generation ignored and no
    context shift (a full slot ends the answer)."""
    _, final = complete(
        url, prompt, body={"shift": False}, num_predict=n, temperature=0, ignore_eos=True
    )
    count: int = final["eval_count"]
    return count


def test_one_sequence_takes_more_than_a_slot_s_share(
    tiny_model: Path, start_server: Callable[..., Server]
) -> None:
    # Four slots of 256 cells each without --kv-unified; one cache of 1024 with it.
    own = start_server(tiny_model, parallel=4, ctx_size=256)
    assert generate(own.url, "one two", 400) < 260
    srv = start_server(tiny_model, parallel=4, ctx_size=256, kv_unified=True)
    props = httpx.get(f"{srv.url}/props", timeout=30).json()
    assert (props["n_ctx"], props["n_ctx_total"]) == (1024, 1024), props
    assert generate(srv.url, "one two", 400) == 400


def test_sequences_that_overflow_the_cache_all_finish(
    tiny_model: Path, start_server: Callable[..., Server]
) -> None:
    srv = start_server(tiny_model, parallel=4, ctx_size=256, kv_unified=True)
    # 4 x ~305 cells into 1024: at least one sequence waits swapped out for room. The four
    # come as one llama-server-format request of four prompts, each queued as soon as the one
    # before has its slot: they overlap whatever the machine's speed (four requests from four
    # threads did not always: on a loaded machine the first could finish before the last came).
    prompts = [f"request number {i}" for i in range(4)]
    body = {"prompt": prompts, "n_predict": 300, "ignore_eos": True, "temperature": 0}
    r = httpx.post(f"{srv.url}/completion", json=body, timeout=300)
    assert r.status_code == 200, r.text
    answers = [a["tokens_predicted"] for a in r.json()]
    assert answers == [300] * 4
    # The swap-outs are counted.
    metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
    swaps = re.search(r"^llamarunner:kv_swapped_out_total\{[^}]*\} (\S+)$", metrics, re.M)
    assert swaps is not None and float(swaps.group(1)) >= 1, metrics
    # Nothing is left behind: every slot free, and the cache within its cells.
    slots = httpx.get(f"{srv.url}/slots", timeout=30).json()
    assert not any(s["is_processing"] for s in slots), slots
    # Then a lone sequence still gets the whole cache (the idle slots' cells make room).
    assert generate(srv.url, "one two", 1000) == 1000


def test_a_request_admitted_while_others_wait_swapped_out_still_finishes(
    tiny_model: Path, start_server: Callable[..., Server]
) -> None:
    # Two slots over 512 cells, three long requests: the third waits for a slot, the first two
    # for cells.
    srv = start_server(tiny_model, parallel=2, ctx_size=256, kv_unified=True)
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda i: generate(srv.url, f"long {i}", 300), range(3)))
    assert answers == [300] * 3


def test_the_deterministic_mode_refuses_a_shared_cache(tiny_model: Path) -> None:
    r = subprocess.run(
        [
            *(sys.executable, "-m", "llamarunner", "serve", str(tiny_model)),
            *("--port", "0", "--deterministic", "--kv-unified"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "--deterministic cannot run with" in r.stderr and "--kv-unified" in r.stderr, r.stderr
