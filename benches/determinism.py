"""Does the same request give the same text however it is served? (issue #44)

For each prompt, the same ``/completion`` request is sent to an otherwise idle server with
``cache_prompt: false`` (the whole prompt decoded afresh), then with ``cache_prompt: true`` (the
prompt found in the slot: only what the server chooses to decode again is decoded), then once
more afresh while three other streams (unseeded, other prompts and lengths) run beside it. The
table counts the prompts whose texts equal the first's, for seeded sampling (temperature 1, one
seed) and greedy decoding, and gives the median number of prompt tokens the cached request
decoded (``timings.prompt_n``): for ours, ours with ``--deterministic`` and, given
``--llama-server``, llama.cpp's server, on the same model, threads, slots and context in the
same run.

    python -m benches.determinism [--model GGUF] [--llama-server PATH] [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from benches.load import Running, llama_server, ours

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Once upon a time",
    "Write a short poem about the sea:",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Q: What is the capital of France?\nA:",
    "List three fruits:\n1.",
    "In 1492, Columbus sailed across the Atlantic Ocean and reached the islands of the "
    "Caribbean, where he",
    "Translate to French: I like apples and oranges very much because they are sweet.",
    "The meaning of life, according to many philosophers who have thought about it for a long "
    "time, is",
]

NOISE = "Noise: a story about a lighthouse keeper who counted the waves every night and"

# Slots: the request and the three streams beside it.
PARALLEL = 4


@dataclass
class Row:
    server: str
    sampling: str
    cached: int
    beside: int
    prompts: int
    redecoded: float


def complete(server: Running, prompt: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{server.url}/completion", json={"prompt": prompt, **body}, timeout=600)
    r.raise_for_status()
    answer: dict[str, Any] = r.json()
    return answer


def beside_traffic(server: Running, prompt: str, body: dict[str, Any]) -> str:
    """The request's text while three other streams run."""
    stop = threading.Event()

    def noise(n: int) -> None:
        while not stop.is_set():
            complete(
                server,
                NOISE * n,
                {"temperature": 0.8, "n_predict": 4 + 6 * n, "cache_prompt": False},
            )

    with ThreadPoolExecutor(PARALLEL) as pool:
        others = [pool.submit(noise, n) for n in (1, 2, 3)]
        try:
            return str(complete(server, prompt, {**body, "cache_prompt": False})["content"])
        finally:
            stop.set()
            for f in others:
                f.result()


def measure(server: Running, tokens: int) -> list[Row]:
    rows = []
    for sampling, body in (
        ("seeded, temperature 1", {"temperature": 1.0, "seed": 5}),
        ("greedy", {"temperature": 0.0}),
    ):
        same_cached = same_beside = 0
        redecoded = []
        for prompt in PROMPTS:
            request = {"n_predict": tokens, **body}
            fresh = complete(server, prompt, {**request, "cache_prompt": False})
            cached = complete(server, prompt, {**request, "cache_prompt": True})
            same_cached += fresh["content"] == cached["content"]
            redecoded.append(cached["timings"]["prompt_n"])
            same_beside += fresh["content"] == beside_traffic(server, prompt, request)
        rows.append(
            Row(
                server.name,
                sampling,
                same_cached,
                same_beside,
                len(PROMPTS),
                statistics.median(redecoded),
            )
        )
    return rows


def table(rows: list[Row]) -> str:
    lines = [
        "| server | sampling | same text, fresh vs cached | same text, alone vs beside 3 "
        "streams | prompt tokens decoded again (median) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.server} | {r.sampling} | {r.cached}/{r.prompts} | {r.beside}/{r.prompts} "
            f"| {r.redecoded:g} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF file (default: the default model)")
    p.add_argument("--llama-server", help="llama-server binary to run beside ours")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--ctx", type=int, default=2048)
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        from llamarunner import default_model_path

        model = str(default_model_path())
    rows: list[Row] = []
    for flags in ((), ("--deterministic",)):
        with ours(
            model, PARALLEL, args.ctx, args.threads, extra=("--cache-ram", "0", *flags)
        ) as server:
            rows += measure(server, args.tokens)
    if args.llama_server:
        with llama_server(args.llama_server, model, PARALLEL, args.ctx, args.threads) as server:
            rows += measure(server, args.tokens)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
