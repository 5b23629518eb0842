"""The benchmarks run end to end (briefly, on the tiny model) so they cannot rot."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def run_bench(module: str, model: Path, *args: str) -> str:
    """Runs ``python -m benches.<module> --model MODEL ARGS``; checks it exits 0 and returns
    its stdout."""
    r = subprocess.run(
        [sys.executable, "-m", f"benches.{module}", "--model", str(model), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_bench_harness_runs(tiny_model: Path) -> None:
    out = run_bench(
        "load", tiny_model, "--scenarios", "single,parallel2,shared,mixed", "--requests", "1"
    )
    for scenario in ("single:", "parallel 2:", "shared prefix:", "distinct:", "mixed:"):
        assert scenario in out, out
    assert "baseline: --parallel 1" in out


def test_router_bench_runs(tiny_model: Path) -> None:
    out = run_bench(
        "load", tiny_model, "--scenarios", "single", "--requests", "1", "--router",
        "--repeat", "2", "--together",
    )  # fmt: skip
    assert "llamarunner router (parallel 1)" in out and "load included" in out, out
    assert "Through the router against the same model served directly" in out, out
    assert "| single: prompt ~200, gen 128 | " in out.split("served directly")[-1], out
    # Both rounds ran on the same two servers, and each round gave a paired ratio.
    paired = out.split("Paired by round")[-1]
    assert "| router / direct | single: prompt ~200, gen 128 | " in paired, out
    per_round = paired.split("gen 128 | ")[1].split(" | ")[0].split()
    assert len(per_round) == 2 and all(float(x) > 0 for x in per_round), out


def test_router_load_bench_runs(tiny_model: Path) -> None:
    out = run_bench(
        "router_load", tiny_model, "--rounds", "2", "--parallel", "1", "--ctx-size", "256"
    )
    assert "| llamarunner router |" in out and "round 2:" in out


def test_lora_bench_runs(tiny_model: Path) -> None:
    out = run_bench("lora", tiny_model, "--requests", "1", "--tokens", "4")
    for scenario in ("no adapter loaded", "one set", "two sets", "four sets"):
        assert scenario in out, out
    # The step trace of each run of several sets: every set had to be applied in turn.
    traced = [line for line in out.splitlines() if line.startswith("- ")]
    assert [line.split(":")[0] for line in traced] == ["- two sets", "- four sets"], out
    for line in traced:
        assert re.search(r": [1-9]\d* steps, [1-9]\d* changes of set", line), out


def test_agent_loop_bench_runs(tiny_model: Path) -> None:
    out = run_bench(
        "agent_loop",
        tiny_model,
        *("--conversations", "3", "--slots", "2", "--clients", "2", "--rounds", "2"),
        *("--max-tokens", "4", "--ctx", "16384"),
    )
    rows = [line for line in out.splitlines() if line.startswith("| llamarunner")]
    assert [row.split(" | ")[1] for row in rows] == ["first turns", "follow-ups"], out
    # Each follow-up continues its own conversation, from a slot or the prompt cache.
    follow_cached = float(rows[1].split(" | ")[7].rstrip(" %"))
    assert follow_cached > 50, out


def test_router_hop_bench_runs(tiny_model: Path) -> None:
    out = run_bench("router_hop", tiny_model, "--blocks", "2", "--per-block", "3")
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 3 * 2, out  # the header, 3 kinds x 2 connection kinds
    for line in rows[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[2]) > 0 and float(cells[3]) > 0, line


def test_determinism_bench_runs(tiny_model: Path) -> None:
    out = run_bench("determinism", tiny_model, "--tokens", "4", "--ctx", "256")
    assert "| llamarunner (parallel 4, --cache-ram 0) | greedy |" in out, out
    assert "| llamarunner (parallel 4, --cache-ram 0 --deterministic) | greedy |" in out, out
    assert "/8 |" in out, out
