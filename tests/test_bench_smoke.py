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
