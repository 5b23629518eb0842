"""The load benchmark runs end to end (briefly, on the tiny model) so it cannot rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_bench_harness_runs(tiny_model: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "benches.load",
            "--model",
            str(tiny_model),
            "--scenarios",
            "single,parallel2,shared,mixed",
            "--requests",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for scenario in ("single:", "parallel 2:", "shared prefix:", "distinct:", "mixed:"):
        assert scenario in out, out
    assert "baseline: --parallel 1" in out


def test_lora_bench_runs(tiny_model: Path) -> None:
    r = subprocess.run(
        [
            *(sys.executable, "-m", "benches.lora", "--model", str(tiny_model)),
            *("--requests", "1", "--tokens", "4"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    for scenario in ("no adapter loaded", "one set", "two sets", "four sets"):
        assert scenario in r.stdout, r.stdout


def test_agent_loop_bench_runs(tiny_model: Path) -> None:
    r = subprocess.run(
        [
            *(sys.executable, "-m", "benches.agent_loop", "--model", str(tiny_model)),
            *("--conversations", "3", "--slots", "2", "--clients", "2", "--rounds", "2"),
            *("--max-tokens", "4", "--ctx", "16384"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| llamarunner")]
    assert [row.split(" | ")[1] for row in rows] == ["first turns", "follow-ups"], r.stdout
    # Each follow-up continues its own conversation, from a slot or the prompt cache.
    follow_cached = float(rows[1].split(" | ")[7].rstrip(" %"))
    assert follow_cached > 50, r.stdout
