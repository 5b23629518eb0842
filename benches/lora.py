"""What mixing LoRA scale sets costs: 4 clients on 4 slots of the default model with a random
adapter generated from its tensor shapes (``tests/tinylora.py``).

    python -m benches.lora                       # default model, 2 threads
    python -m benches.lora --requests 3 --tokens 64 --repeat 2

Scenarios, each on its own ``llamarunner serve --parallel 4``: no adapter loaded; the adapter
loaded, every client at scale 1 (one set); clients alternating between scale 1 and 0 (two
sets: llamarunner decodes one set per batch, the sets taking turns as long as a change of set
is worth: ``crates/llamarunner-core/src/sched/lora.rs``); four clients at four
scales (four sets). Every request generates exactly ``--tokens`` tokens (``ignore_eos``,
greedy, without drafting unless ``--speculative``: a random-weight model repeats itself, and
its drafts would be verified in wide steps) after a ~200-token prompt. Prints a table
(aggregate generated tokens/s, TTFT and inter-token latency from the client); with
``--repeat``, the median row of each scenario. Under it, for each run of several sets, what
the server's step trace says of the timed part: its steps, its changes of set and so the mean
turn, the median decode of the steps that kept the set and of those that changed it, and the
change cost the scheduler measured last.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benches.load import Row, Running, _process, free_port, peak_rss_mb, table, text

SCENARIOS: list[tuple[str, list[float] | None]] = [
    ("no adapter loaded", None),
    ("one set: all at scale 1", [1.0, 1.0, 1.0, 1.0]),
    ("two sets: scale 1 / 0 alternating", [1.0, 0.0, 1.0, 0.0]),
    ("four sets: scales 1, 0, 0.5, -0.5", [1.0, 0.0, 0.5, -0.5]),
]


def make_adapter(model: Path, directory: Path) -> Path:
    """The random adapter (``tests/tinylora.py``, which the tests use too)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tinylora import adapter_for_model

    return Path(adapter_for_model(model, directory / "bench-adapter.gguf", seed=1))


def stream(
    url: str, prompt: str, tokens: int, scale: float | None, speculative: bool = False
) -> tuple[float, list[float]]:
    """One greedy streamed completion; (TTFT, inter-token gaps) in seconds."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "options": {"num_predict": tokens, "temperature": 0, "ignore_eos": True},
        "speculative": speculative,
    }
    if scale is not None:
        body["lora"] = [{"id": 0, "scale": scale}]
    start = time.perf_counter()
    stamps: list[float] = []
    with httpx.stream("POST", f"{url}/completion", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.strip():
                continue
            msg = json.loads(line)
            if msg.get("done"):
                if msg.get("eval_count") != tokens:
                    raise RuntimeError(f"generated {msg.get('eval_count')} tokens: {msg}")
                break
            if msg.get("content"):
                stamps.append(time.perf_counter())
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])]


def scenario(
    server: Running, name: str, scales: list[float] | None, args: argparse.Namespace
) -> Row:
    rng = random.Random(7)
    prompts = [[text(rng, args.prompt_words) for _ in range(args.requests)] for _ in range(4)]
    ttft: list[float] = []
    itl: list[float] = []

    def client(i: int) -> None:
        for p in prompts[i]:
            scale = None if scales is None else scales[i]
            t, gaps = stream(server.url, p, args.tokens, scale, args.speculative)
            ttft.append(t)
            itl.extend(gaps)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    return Row(
        server=server.name,
        scenario=name,
        clients=4,
        requests=4 * args.requests,
        tokens=4 * args.requests * args.tokens,
        seconds=seconds,
        ttft=ttft,
        itl=itl,
        rss_mb=peak_rss_mb(server.proc.pid),
    )


# A step's line in the trace (`sched/batch.rs`): its decode time, whether it changed set and
# the scheduler's change cost (once measured).
STEP = re.compile(
    r" step .*?decode_us=(\d+) .*?lora_changed=(true|false)(?: lora_change_us=(-?\d+))?"
)


def turns(name: str, trace: str) -> str:
    """One line on the steps of ``trace`` (the server's step trace; see the docstring)."""
    steps = [m.groups() for m in STEP.finditer(trace)]
    if not steps:
        return f"{name}: no steps traced"
    kept = [int(us) for us, changed, _ in steps if changed == "false"]
    changed = [int(us) for us, changed, _ in steps if changed == "true"]
    costs = [int(cost) for _, _, cost in steps if cost is not None]

    def ms(us: list[int]) -> str:
        return f"{statistics.median(us) / 1000:.2f} ms" if us else "-"

    turn = f"{len(steps) / len(changed):.1f}" if changed else "-"
    cost = f"{costs[-1] / 1000:.2f} ms" if costs else "not measured"
    return (
        f"{name}: {len(steps)} steps, {len(changed)} changes of set (a turn of {turn} steps); "
        f"median decode {ms(kept)} keeping the set, {ms(changed)} changing it; "
        f"the scheduler's change cost: {cost}"
    )


def serve(
    model: Path, adapter: Path | None, threads: int, ctx_size: int, trace: Path | None = None
) -> Any:
    port = free_port()
    cmd = [sys.executable, "-m", "llamarunner", "serve", str(model), "--port", str(port)]
    cmd += ["--parallel", "4", "--ctx-size", str(ctx_size), "--threads", str(threads)]
    name = "llamarunner (parallel 4)"
    if adapter is not None:
        cmd += ["--lora", f"{adapter}:0"]
        name = "llamarunner (parallel 4, 1 adapter)"
    return _process(cmd, name, port, "native", trace)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="GGUF file (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--repeat", type=int, default=1, help="runs of every scenario (medians)")
    ap.add_argument("--prompt-words", type=int, default=178, help="words in each prompt")
    ap.add_argument("--ctx-size", type=int, default=1024, help="the server's --ctx-size")
    ap.add_argument(
        "--speculative",
        action="store_true",
        help="let the requests draft (the server's default for greedy requests)",
    )
    ap.add_argument(
        "--scenarios",
        default="no,one,two,four",
        help="the scenarios to run, by their first word (default: all)",
    )
    args = ap.parse_args(argv)
    if args.model:
        model = Path(args.model)
    else:
        from llamarunner import default_model_path

        model = default_model_path()
    wanted = set(args.scenarios.split(","))
    chosen = [(name, scales) for name, scales in SCENARIOS if name.split()[0] in wanted]
    if not chosen:
        ap.error(f"no scenario named {args.scenarios!r}: no, one, two or four")
    runs: dict[str, list[Row]] = {name: [] for name, _ in chosen}
    traced: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        adapter = make_adapter(model, Path(tmp))
        for _ in range(args.repeat):
            for name, scales in chosen:
                several = scales is not None and len(set(scales)) > 1
                trace = Path(tmp) / "trace.log" if several else None
                with serve(
                    model, None if scales is None else adapter, args.threads, args.ctx_size, trace
                ) as server:
                    # Warm up (and apply each set once) before timing.
                    for s in sorted(set(scales or [0.0])):
                        stream(server.url, "warm up", 4, None if scales is None else s)
                    timed = trace.stat().st_size if trace is not None else 0
                    runs[name].append(scenario(server, name, scales, args))
                if trace is not None:
                    with trace.open(errors="replace") as f:
                        f.seek(timed)
                        traced.append(turns(name, f.read()))
    rows = []
    for name, _ in chosen:
        ordered = sorted(runs[name], key=lambda r: r.tokens / r.seconds)
        rows.append(ordered[len(ordered) // 2])
    print(table(rows))
    if traced:
        print()
        print("\n".join(f"- {line}" for line in traced))
    return 0


if __name__ == "__main__":
    sys.exit(main())
