"""llama.cpp's own server tests against llama-server and llamarunner, on the same model.

    python -m benches.conformance --llama-cpp CHECKOUT --llama-server PEER/bin/llama-server \\
        [--model MODEL.gguf] [--files test_chat_completion test_tokenize ...] \\
        [--test-python PY] [--marks "not slow"] [--json OUT.json]

CHECKOUT is a llama.cpp checkout, or a git directory of one (the `ngxson/llama.cpp` mirror):
its `tools/server/tests` are read from there (its HEAD for a git directory) and never copied
into this repository. They start `$LLAMA_SERVER_BIN_PATH` with llama-server's flags; here that
is `benches/llama_server_shim.py`, which serves MODEL (default: the default model) from either
server, mapping the flags to ours for llamarunner. The tests need their own requirements
(`pip install -r tools/server/tests/requirements.txt` into the Python given by
`--test-python`; default: this one). llamarunner runs from this Python.

Printed per file: tests run, passed on llama-server, passed on ours, passed on both; then each
test that passes on llama-server and fails on ours, with the first line of its failure. Tests
that fail on llama-server too (most often an answer the tests expect from their own tiny
model) say nothing about compatibility and are only counted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_FILES = [
    "test_chat_completion",
    "test_compat_anthropic",
    "test_compat_oai_responses",
    "test_tool_call",
    "test_metrics",
    "test_embedding",
    "test_tokenize",
    "test_template",
    "test_infill",
    "test_rerank",
    "test_security",
    "test_completion",
    "test_ctx_shift",
    "test_slot_save",
]
SHIM = Path(__file__).resolve().with_name("llama_server_shim.py")
TARGETS = ("llama-server", "llamarunner")


@dataclass
class FileResult:
    """One test file's outcome on each server: test id -> None (passed) or why it failed."""

    outcomes: dict[str, dict[str, str | None]] = field(default_factory=dict)

    def passed(self, target: str) -> set[str]:
        return {t for t, why in self.outcomes.get(target, {}).items() if why is None}


def tests_dir(checkout: Path, into: Path) -> Path:
    """`tools/server/tests` of a checkout, or extracted from a git directory's HEAD with the
    chat templates some tests read (`models/templates`, by a path relative to the tests)."""
    direct = checkout / "tools" / "server" / "tests"
    if (direct / "unit").is_dir():
        return direct
    archive = subprocess.run(
        ["git", "-C", str(checkout), "archive", "HEAD", "tools/server/tests", "models/templates"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "tools" / "server" / "tests"


def wrapper(path: Path) -> Path:
    """An executable that runs the shim with this Python (llamarunner's)."""
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{SHIM}" "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def outcomes(junit: Path) -> dict[str, str | None]:
    """Test id -> None when it passed, else the first line of why (skips count as failed)."""
    found: dict[str, str | None] = {}
    if not junit.exists():
        return found
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "?")
        why: str | None = None
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                text = (node.get("message") or node.text or tag).strip()
                why = f"{tag}: " + (text.splitlines() or [""])[0][:200]
                break
        found[name] = why
    return found


def run_file(
    tests: Path,
    name: str,
    target: str,
    env: dict[str, str],
    out: Path,
    python: str,
    timeout: int,
    marks: str | None = None,
) -> dict[str, str | None]:
    junit = out / f"{name}.{target}.xml"
    log = out / f"{name}.{target}.log"
    cmd = [python, "-m", "pytest", f"unit/{name}.py", "-q", "-p", "no:cacheprovider"]
    if marks:
        cmd += ["-m", marks]
    cmd += [f"--junitxml={junit}", "-o", "junit_family=xunit1"]
    with open(log, "w") as f:
        try:
            subprocess.run(
                cmd,
                cwd=tests,
                env={**env, "CONFORMANCE_TARGET": target},
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            f.write(f"\nconformance: {name} on {target} passed its {timeout} s limit\n")
    return outcomes(junit)


def report(results: dict[str, FileResult]) -> str:
    lines = [
        f"{'file':<28}{'run':>6}{'llama-server':>14}{'ours':>7}{'both':>7}",
    ]
    total = [0, 0, 0, 0]
    gaps: list[str] = []
    for name, r in results.items():
        run = len(r.outcomes.get("llama-server", {}) or r.outcomes.get("llamarunner", {}))
        theirs, ours = r.passed("llama-server"), r.passed("llamarunner")
        both = theirs & ours
        row = [run, len(theirs), len(ours), len(both)]
        total = [a + b for a, b in zip(total, row)]
        lines.append(f"{name:<28}{row[0]:>6}{row[1]:>14}{row[2]:>7}{row[3]:>7}")
        for test in sorted(theirs - ours):
            why = r.outcomes.get("llamarunner", {}).get(test, "not run")
            gaps.append(f"  {name}::{test}: {why}")
    lines.append(f"{'all':<28}{total[0]:>6}{total[1]:>14}{total[2]:>7}{total[3]:>7}")
    if total[1]:
        lines.append(f"passing on both / passing on llama-server: {total[3] / total[1]:.1%}")
    if gaps:
        lines += ["", "passing on llama-server, failing on ours:", *gaps]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--llama-cpp", type=Path, required=True, help="checkout or git directory")
    p.add_argument("--llama-server", type=Path, required=True, help="llama-server binary")
    p.add_argument("--model", type=Path, help="GGUF both serve (default: the default model)")
    p.add_argument("--files", nargs="+", default=DEFAULT_FILES, help="tests/unit files, no .py")
    p.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    p.add_argument("--test-python", default=sys.executable, help="Python with the tests' deps")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per file and server")
    p.add_argument(
        "--marks",
        help='pytest -m expression, e.g. "not slow" (what llama.cpp\'s tests.sh runs by default)',
    )
    p.add_argument("--json", type=Path, help="write every outcome here")
    p.add_argument("--keep", type=Path, help="keep the logs and junit files in this directory")
    args = p.parse_args()
    model = args.model
    if model is None:
        from llamarunner.config import default_model_path

        model = default_model_path()
    work = Path(tempfile.mkdtemp(prefix="conformance-"))
    out = args.keep or work / "out"
    out.mkdir(parents=True, exist_ok=True)
    tests = tests_dir(args.llama_cpp.resolve(), work)
    env = {
        **os.environ,
        "LLAMA_SERVER_BIN_PATH": str(wrapper(work / "llama-server")),
        "CONFORMANCE_MODEL": str(Path(model).resolve()),
        "CONFORMANCE_LLAMA_SERVER": str(args.llama_server.resolve()),
        "LLAMA_CACHE": str(work / "cache"),
    }
    results: dict[str, FileResult] = {}
    for name in args.files:
        if not (tests / "unit" / f"{name}.py").exists():
            print(f"conformance: no unit/{name}.py in the checkout; skipped", file=sys.stderr)
            continue
        r = results.setdefault(name, FileResult())
        for target in args.targets:
            r.outcomes[target] = run_file(
                tests, name, target, env, out, args.test_python, args.timeout, args.marks
            )
            got = r.outcomes[target]
            passed = sum(why is None for why in got.values())
            print(f"{name} on {target}: {passed}/{len(got)} passed", file=sys.stderr, flush=True)
    print(report(results))
    if args.json:
        args.json.write_text(
            json.dumps({n: r.outcomes for n, r in results.items()}, indent=1, sort_keys=True)
        )
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
