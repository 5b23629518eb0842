"""How wide the KV cache is that decode steps attend over, ours against llama-server's.

llama.cpp attends over each sequence's stream of cells up to its highest used cell, padded to
256. Both servers are run on the parallel-8 load of `benches.load` with `LLAMA_KV_CACHE_DEBUG=1`,
which logs every `find_slot`: the stream's highest used cell + 1 (`n`), its used cells, its head
and size; the table compares them per cache (full layers, sliding-window layers).

    python -m benches.kv_widths --llama-server ~/peer/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import re
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benches import load

FIND_SLOT = re.compile(
    r"stream\[(\d+)\], n = +(\d+), used = +(\d+), head = +(\d+), size = +(\d+), n_swa = +(\d+)"
)


@contextmanager
def logged(log: Path, verbose_flag: str | None) -> Iterator[None]:
    """Servers started inside log llama.cpp's `find_slot` lines to ``log``."""
    real = subprocess.Popen

    def popen(cmd: list[str], **kw: Any) -> Any:
        if not any("serve" in str(c) for c in cmd):
            return real(cmd, **kw)
        kw["env"] = {
            **(kw.get("env") or os.environ),
            "LLAMA_KV_CACHE_DEBUG": "1",
            "LLAMARUNNER_LOG": "debug",
        }
        out = open(log, "w")  # noqa: SIM115 (the server's, closed when it exits)
        kw["stdout"] = kw["stderr"] = out
        return real([*cmd, verbose_flag] if verbose_flag else cmd, **kw)

    subprocess.Popen = popen  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        subprocess.Popen = real  # type: ignore[misc]


def widths(log: Path) -> list[tuple[str, int, float, float, str]]:
    """Per cache: find_slot calls, mean `n`, mean used cells, padded widths (count by width)."""
    seen: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    for line in log.read_text(errors="replace").splitlines():
        if m := FIND_SLOT.search(line):
            _, n, used, _, _, n_swa = map(int, m.groups())
            seen[n_swa].append((n, used))
    rows = []
    for n_swa, calls in sorted(seen.items()):
        padded = collections.Counter(max(256, -(-n // 256) * 256) for n, _ in calls)
        rows.append(
            (
                "full" if n_swa == 0 else f"window {n_swa}",
                len(calls),
                sum(n for n, _ in calls) / len(calls),
                sum(u for _, u in calls) / len(calls),
                ", ".join(f"{w}: {c}" for w, c in sorted(padded.items())),
            )
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    p.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    p.add_argument("--rounds", type=int, default=2, help="rounds of 8 clients x 3 requests")
    args = p.parse_args()
    if args.model is None:
        from llamarunner import default_model_path

        args.model = str(default_model_path())
    plan = load.Plan(model=args.model, threads=2, requests=3, rng=random.Random(1))
    prompts = [load.distinct(plan, 8, 178) for _ in range(args.rounds)]
    out = Path(tempfile.mkdtemp(prefix="kv-widths-"))
    table = []
    for name in ("llamarunner", "llama-server"):
        log = out / f"{name}.log"
        with logged(log, "-v" if name == "llama-server" else None):
            if name == "llamarunner":
                server = load.ours(args.model, 8, 4096, 2, dialect="openai")
            else:
                server = load.llama_server(args.llama_server, args.model, 8, 4096, 2)
            with server as srv:
                for round_prompts in prompts:
                    load.run_clients(srv, round_prompts, 64)
        table += [(name, *row) for row in widths(log)]
    print(f"logs in {out}")
    print("| server | cache | find_slot calls | mean n | mean used | n padded to 256: calls |")
    print("|---|---|---|---|---|---|")
    for name, cache, calls, n, used, padded in table:
        print(f"| {name} | {cache} | {calls} | {n:.0f} | {used:.0f} | {padded} |")


if __name__ == "__main__":
    main()
