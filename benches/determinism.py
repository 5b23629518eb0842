"""Does the same request give the same text once its prompt is cached? (issue #44)

For each prompt, the same ``/completion`` request is sent twice to an otherwise idle server:
first with ``cache_prompt: false`` (the whole prompt decoded afresh), then with
``cache_prompt: true`` (the prompt found in the slot: only what the server chooses to decode
again is decoded). The table counts the prompts whose two texts are equal, for seeded sampling
(temperature 1, one seed) and greedy decoding, and the median number of prompt tokens the
second request decoded (``timings.prompt_n``), for ours and, given ``--llama-server``,
llama.cpp's server on the same model, threads and context in the same run.

    python -m benches.determinism [--model GGUF] [--llama-server PATH] [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
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


@dataclass
class Row:
    server: str
    sampling: str
    same: int
    prompts: int
    redecoded: float


def complete(server: Running, prompt: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{server.url}/completion", json={"prompt": prompt, **body}, timeout=600)
    r.raise_for_status()
    answer: dict[str, Any] = r.json()
    return answer


def measure(server: Running, tokens: int) -> list[Row]:
    rows = []
    for sampling, body in (
        ("seeded, temperature 1", {"temperature": 1.0, "seed": 5}),
        ("greedy", {"temperature": 0.0}),
    ):
        same = 0
        redecoded = []
        for prompt in PROMPTS:
            request = {"n_predict": tokens, **body}
            fresh = complete(server, prompt, {**request, "cache_prompt": False})
            cached = complete(server, prompt, {**request, "cache_prompt": True})
            same += fresh["content"] == cached["content"]
            redecoded.append(cached["timings"]["prompt_n"])
        rows.append(Row(server.name, sampling, same, len(PROMPTS), statistics.median(redecoded)))
    return rows


def table(rows: list[Row]) -> str:
    lines = [
        "| server | sampling | same text, fresh vs cached | prompt tokens decoded again (median) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.server} | {r.sampling} | {r.same}/{r.prompts} | {r.redecoded:g} |")
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
    with ours(model, 1, args.ctx, args.threads, extra=("--cache-ram", "0")) as server:
        rows += measure(server, args.tokens)
    if args.llama_server:
        with llama_server(args.llama_server, model, 1, args.ctx, args.threads) as server:
            rows += measure(server, args.tokens)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
