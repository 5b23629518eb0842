"""The server's own ceiling: tokens/s and CPU time per token when a decode costs nothing.

    python -m benches.sampling_ceiling                       # default model, 64 and 256 streams
    python -m benches.sampling_ceiling --streams 64 --presets openai,full --threads 1,2
    python -m benches.sampling_ceiling --model M.gguf --seconds 20 --out ceiling.md

On a GPU a small model's decode step takes a millisecond or two, and what the server does
between steps (sampling over the whole vocabulary, penalties, grammars, text, stop strings,
HTTP) decides the throughput. This runs ours with ``--null-decode``: the model is loaded and
its context made, but every decode returns at once with synthetic logits of the model's real
vocabulary (262,144 tokens for the default model), so only the server's own work is left.
For each sampler preset, number of streams and ``--sampling-threads`` it keeps that many
clients busy (closed loop, non-streaming ``/v1/completions`` of ``--tokens`` tokens on
average with ``ignore_eos``, so the clients' own work stays small; the lengths are spread so
that the streams do not all end in the same step) and prints, over a window once every
stream is busy, the tokens/s sustained (the server's own count, ``/metrics``), the server's CPU
time per token (from /proc, every thread), the engine thread's alone (the serial work between two
decodes, which a GPU waits for) and the speed-up over the first thread count. The
server is pinned (``taskset``) to as many cores as it has sampling threads, so that a row says
what a machine of that many cores sustains (``--no-pin``: anywhere). The presets:

- ``openai``: OpenAI's defaults as served (temperature 1, top-p 1, top-k 40 as Ollama's
  and llama-server's default)
- ``full``: temperature 1 over the whole vocabulary (top-k 0: a softmax of every logit)
- ``ollama``: Ollama's defaults (temperature 0.8, top-k 40, top-p 0.9, repeat penalty 1.1
  over the last 64 tokens)
- ``penalties``: presence and frequency penalties with top-p 0.95 and no top-k
- ``grammar``: a JSON-schema constraint (a JSON string), checked token by token
- ``lookup``: prompt-lookup drafting asked for (``speculative``) on text that seldom repeats
  (temperature 2 over the top 40 tokens): every step, each sequence's last tokens (up to
  4,096) are searched for its tail on the engine thread, and most searches find nothing and
  run the whole history, the lookup's worst case. Long prompts make the history long, and
  ``--draft-always`` keeps the lookups on where drafts would not pay:
  ``--prompt-words 1500 --ctx 4096 --tokens 1024 --server-args=--draft-always``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benches.load import WORDS, _process, free_port, peak_rss_mb

PRESETS: dict[str, dict[str, Any]] = {
    "openai": {},
    "full": {"top_k": 0},
    "ollama": {
        "temperature": 0.8,
        "top_k": 40,
        "top_p": 0.9,
        "repeat_penalty": 1.1,
        "repeat_last_n": 64,
    },
    "penalties": {
        "top_k": 0,
        "top_p": 0.95,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
    },
    "grammar": {"json_schema": {"type": "string"}},
    "lookup": {"speculative": True, "temperature": 2.0},
}


@dataclass
class Result:
    preset: str
    streams: int
    threads: int
    tokens: int
    seconds: float
    cpu_seconds: float
    engine_cpu_seconds: float
    """The engine thread's CPU time (its name: ``llamarunner-engine``)."""
    failed: int
    rss_mb: float
    client_cores: float
    """The clients' CPU use over the window, in cores (they share the machine)."""

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def cpu_us_per_token(self) -> float:
        return 1e6 * self.cpu_seconds / self.tokens if self.tokens else 0.0

    @property
    def engine_us_per_token(self) -> float:
        return 1e6 * self.engine_cpu_seconds / self.tokens if self.tokens else 0.0


def stat_seconds(stat: Path) -> float:
    """User + system CPU time in a /proc `stat` file (a process's or one thread's)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of every thread of process `pid`."""
    return stat_seconds(Path(f"/proc/{pid}/stat"))


def engine_cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid`'s engine threads (``llamarunner-engine``, which
    /proc shortens to 15 characters)."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().startswith("llamarunner-eng"):
                total += stat_seconds(task / "stat")
        except OSError:
            continue  # the thread ended
    return total


def generated(url: str) -> float:
    """The server's count of tokens generated (``/metrics``), every request's."""
    text = httpx.get(url + "/metrics", timeout=30).text
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llamarunner:generation_tokens_total")
    ]
    if not values:
        raise RuntimeError("/metrics has no llamarunner:generation_tokens_total")
    return sum(values)


async def drive(
    url: str, streams: int, body: dict[str, Any], seconds: float, words: int = 8
) -> int:
    """`streams` clients sending requests back to back until `seconds` have passed, each
    prompt `words` words long; the requests that failed."""
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    failed = 0
    end = time.perf_counter() + seconds
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:

        async def one(i: int) -> None:
            nonlocal failed
            n = 0
            while time.perf_counter() < end:
                prompt = " ".join(WORDS[(i * 7 + n * 3 + k) % len(WORDS)] for k in range(words))
                n += 1
                # Lengths from half to one and a half times the mean, so that the streams
                # do not end (and the clients send again) all in the same step.
                spread = 0.5 + ((i * 37 + n * 11) % 101) / 100
                request = {**body, "max_tokens": max(1, round(body["max_tokens"] * spread))}
                try:
                    r = await client.post(
                        "/v1/completions",
                        json={**request, "prompt": prompt, "seed": 1000 * i + n},
                    )
                    r.raise_for_status()
                except httpx.HTTPError:
                    if time.perf_counter() < end:
                        failed += 1

        await asyncio.gather(*(one(i) for i in range(streams)))
    return failed


def measure(args: argparse.Namespace, preset: str, streams: int, threads: int) -> Result:
    port = free_port()
    # The server on as many cores as it has sampling threads (the clients anywhere): what a
    # machine of that many cores sustains.
    pin = ["taskset", "-c", f"0-{threads - 1}"] if args.pin and shutil.which("taskset") else []
    cmd = [
        *pin,
        sys.executable,
        "-m",
        "llamarunner",
        "serve",
        args.model,
        "--port",
        str(port),
        "--null-decode",
        "--parallel",
        str(streams),
        "--ctx-size",
        str(args.ctx),
        "--batch-size",
        str(max(512, streams)),
        "--sampling-threads",
        str(threads),
        "--threads",
        "1",
        *shlex.split(args.server_args),
    ]
    body = {"max_tokens": args.tokens, "ignore_eos": True, **PRESETS[preset]}
    name = f"llamarunner --null-decode (sampling threads {threads})"
    with _process(cmd, name, port, "openai") as server:
        pid = server.proc.pid
        # The window opens once every stream is busy; the tokens are the server's count
        # (requests still running when it closes count what they generated in it).
        loop = asyncio.new_event_loop()
        try:
            task = loop.create_task(
                drive(
                    server.url,
                    streams,
                    body,
                    args.warmup + args.seconds + 60,
                    args.prompt_words,
                )
            )
            loop.run_until_complete(asyncio.sleep(args.warmup))
            tokens0, cpu0, t0 = generated(server.url), cpu_seconds(pid), time.perf_counter()
            client0, engine0 = cpu_seconds(os.getpid()), engine_cpu_seconds(pid)
            loop.run_until_complete(asyncio.sleep(args.seconds))
            tokens1, cpu1, t1 = generated(server.url), cpu_seconds(pid), time.perf_counter()
            client1, engine1 = cpu_seconds(os.getpid()), engine_cpu_seconds(pid)
            rss = peak_rss_mb(pid)
            task.cancel()
            try:
                failed = loop.run_until_complete(task)
            except asyncio.CancelledError:
                failed = 0
        finally:
            loop.close()
    tokens = int(tokens1 - tokens0)
    client = (client1 - client0) / (t1 - t0)
    return Result(
        preset,
        streams,
        threads,
        tokens,
        t1 - t0,
        cpu1 - cpu0,
        engine1 - engine0,
        failed,
        rss,
        client,
    )


def table(results: list[Result], machine: str) -> str:
    base: dict[tuple[str, int], float] = {}
    lines = [
        f"machine: {machine}",
        "",
        "| preset | streams | sampling threads (= cores) | tokens/s | server CPU µs/token | "
        "engine thread µs/token | speed-up | server cores busy | clients' cores busy | "
        "peak RSS MB | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        first = base.setdefault((r.preset, r.streams), r.tps)
        speedup = r.tps / first if first else 0.0
        lines.append(
            f"| {r.preset} | {r.streams} | {r.threads} | {r.tps:,.0f} | "
            f"{r.cpu_us_per_token:,.0f} | {r.engine_us_per_token:,.2f} | {speedup:.2f}x | "
            f"{r.cpu_seconds / r.seconds:.2f} | "
            f"{r.client_cores:.2f} | {r.rss_mb:,.0f} | {r.failed} |"
        )
    return "\n".join(lines)


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def default_model() -> str:
    from llamarunner import default_model_path

    return str(default_model_path())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="GGUF model (default: the default model)")
    p.add_argument("--streams", default="64,256", help="concurrent streams, comma-separated")
    p.add_argument("--presets", default="openai,ollama,full,penalties,grammar")
    p.add_argument("--threads", default="1,2", help="--sampling-threads values, comma-separated")
    p.add_argument("--tokens", type=int, default=512, help="tokens per request")
    p.add_argument("--ctx", type=int, default=768, help="context per slot")
    p.add_argument("--prompt-words", type=int, default=8, help="words per prompt")
    p.add_argument(
        "--server-args",
        default="",
        help="more flags for the server, one string (e.g. '--draft-always')",
    )
    p.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="do not pin the server to as many cores as it has sampling threads",
    )
    p.add_argument("--seconds", type=float, default=10.0, help="measured window per row")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--out", help="also write the table to this file")
    args = p.parse_args(argv)
    args.model = args.model or default_model()
    presets = [s for s in args.presets.split(",") if s]
    unknown = [s for s in presets if s not in PRESETS]
    if unknown:
        p.error(f"unknown presets {unknown}; known: {', '.join(PRESETS)}")
    results = []
    for preset in presets:
        for streams in (int(s) for s in args.streams.split(",")):
            for threads in (int(t) for t in args.threads.split(",")):
                r = measure(args, preset, streams, threads)
                print(
                    f"{preset} streams={streams} threads={threads}: {r.tps:,.0f} tokens/s, "
                    f"{r.cpu_us_per_token:,.0f} CPU µs/token, "
                    f"engine thread {r.engine_us_per_token:,.2f} µs/token",
                    file=sys.stderr,
                    flush=True,
                )
                results.append(r)
    out = table(results, machine())
    print(out)
    if args.out:
        Path(args.out).write_text(out + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
