"""Constrained decoding beside llama.cpp's llama-server, in one run: JSON schemas through
``response_format`` (a small object, a realistic nested schema, a 3,000-value enum), one GBNF
grammar through ``grammar``, and the same prompt unconstrained, at 1 and 4 clients.

    python -m benches.structured --llama-server PATH [--model M.gguf] [--requests 3]
        [--clients 1,4,8] [--ours old=/path/to/an/unpacked/older/wheel] [--compiles 50]
    python -m benches.structured --compiles 50     # the compile-time table alone

Both servers get the same slots, context per slot, threads and chat requests (each renders
the model's template), greedy, streamed with usage. Reported per row: aggregate generated
tokens/s over the wall time, median time to first token (which includes compiling the grammar:
the constrained row's TTFT minus the unconstrained row's is the compile time), and for ours the
ratio to llama-server and to our own unconstrained speed.

Then, for our server alone, the compile time of each schema and grammar (``--compiles N``
requests of one token each, one at a time): p50 and p99 from the server's
``llamarunner:grammar_compile_seconds`` histogram (interpolated within its buckets, as
Prometheus's ``histogram_quantile`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benches.load import Running, llama_server, ours

COUNTRIES = [f"Country{i:03d}" for i in range(150)]
SCHEMAS: dict[str, dict[str, Any]] = {
    "small object": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "people": {
                "type": "array",
                "minItems": 1,
                "maxItems": 4,
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 40},
                        "age": {"type": "integer", "minimum": 0, "maximum": 120},
                        "country": {"enum": COUNTRIES},
                        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"},
                        "address": {
                            "type": "object",
                            "properties": {
                                "city": {"type": "string", "maxLength": 30},
                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                            },
                            "required": ["city", "zip"],
                        },
                    },
                    "required": ["name", "age", "country", "email", "address"],
                },
            }
        },
        "required": ["people"],
    },
    "enum 3000": {
        "type": "object",
        "properties": {
            "code": {"enum": [f"item-{i}" for i in range(3000)]},
            "note": {"type": "string", "maxLength": 200},
        },
        "required": ["code", "note"],
    },
}
GBNF = 'root ::= item{1,8}\nitem ::= "- " [a-zA-Z ,]{1,60} "\\n"'
PROMPT = "List some people with their name, age, country, email and address, as JSON."


def request(
    server: Running, kind: str, max_tokens: int, drafts: bool = True
) -> tuple[float, float, int]:
    """One streamed chat request: (seconds to first token, seconds in all, tokens). Without
    `drafts`, our server is asked not to draft (llama-server drafts only when told to)."""
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if not drafts:
        body["speculative"] = False
    if kind == "gbnf":
        body["grammar"] = GBNF
    elif kind != "plain":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": SCHEMAS[kind]},
        }
    started = time.monotonic()
    first = None
    tokens = 0
    pieces = 0
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{server.name} {kind}: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for c in chunk.get("choices") or []:
                if (c.get("delta") or {}).get("content"):
                    pieces += 1
                    if first is None:
                        first = time.monotonic() - started
            if chunk.get("usage"):
                tokens = chunk["usage"].get("completion_tokens", tokens)
    return first or 0.0, time.monotonic() - started, tokens or pieces


def run(
    server: Running, kind: str, clients: int, requests: int, max_tokens: int, drafts: bool
) -> dict[str, float]:
    results: list[tuple[float, float, int]] = []
    lock = threading.Lock()

    def client() -> None:
        for _ in range(requests):
            r = request(server, kind, max_tokens, drafts)
            with lock:
                results.append(r)

    request(
        server, kind, 8, drafts
    )  # warm up (and compile once: the cache is not what is measured)
    started = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    return {
        "tok_s": sum(r[2] for r in results) / wall,
        "ttft_ms": statistics.median(r[0] for r in results) * 1000,
        "tokens": statistics.mean(r[2] for r in results),
    }


COMPILE_HISTOGRAM = "llamarunner:grammar_compile_seconds"


def compile_buckets(server: Running) -> list[tuple[float, float]]:
    """Our server's compile-time histogram: (upper bound, cumulative count) per bucket."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return sorted(
        (float(s.labels["le"]), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == COMPILE_HISTOGRAM + "_bucket"
    )


def quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """`histogram_quantile`: the bucket holding the q-th observation, interpolated linearly."""
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            inside = count - below
            return lower + (upper - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = upper, count
    return lower


def compile_times(server: Running, kind: str, n: int) -> tuple[float, float]:
    """p50 and p99 compile time (ms) of `kind` over `n` one-token requests."""
    before = compile_buckets(server)
    for _ in range(n):
        request(server, kind, 1)
    after = compile_buckets(server)
    diff = [(le, a - b) for (le, a), (_, b) in zip(after, before)]
    if not diff or diff[-1][1] < n:
        raise RuntimeError(f"{kind}: {diff[-1][1] if diff else 0} compiles counted, not {n}")
    return quantile(0.5, diff) * 1000, quantile(0.99, diff) * 1000


@contextmanager
def pythonpath(path: str | None) -> Iterator[None]:
    """Starts our server from another build of the package (a wheel unpacked at `path`)."""
    old = os.environ.get("PYTHONPATH")
    if path is not None:
        os.environ["PYTHONPATH"] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--llama-server",
        default=None,
        help="llama-server to run beside ours; without it only the compile-time table is made",
    )
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--clients", default="1,4")
    p.add_argument(
        "--no-drafts",
        action="store_true",
        help="ask our server not to draft (its prompt-lookup drafts copy the prompt, which the "
        "plain rows' output often does: the unconstrained baseline then measures drafting)",
    )
    p.add_argument("--kinds", default="plain,small object,nested,enum 3000,gbnf")
    p.add_argument(
        "--peer-flag",
        action="append",
        default=[],
        help="an extra llama-server flag (repeatable), e.g. --peer-flag=--no-repack",
    )
    p.add_argument(
        "--ours",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="also run our server from the package unpacked at PATH (another build), as LABEL",
    )
    p.add_argument(
        "--compiles",
        type=int,
        default=50,
        help="one-token requests per schema and grammar for the compile-time table (0: none)",
    )
    a = p.parse_args()
    model = a.model
    if model is None:
        from llamarunner import default_model_path

        model = str(default_model_path())
    kinds = a.kinds.split(",")
    counts = [int(c) for c in a.clients.split(",")]
    builds: list[tuple[str, str | None]] = [("llamarunner", None)]
    builds += [(spec.split("=", 1)[0], spec.split("=", 1)[1]) for spec in a.ours]
    labels = [label for label, _ in builds] + ["llama-server"]
    rows: dict[tuple[str, str, int], dict[str, float]] = {}
    if a.llama_server is None:
        counts = []
    for clients in counts:
        for label in labels:
            path = dict(builds).get(label)
            if label == "llama-server":
                start = llama_server(a.llama_server, model, 4, a.ctx, a.threads, tuple(a.peer_flag))
            else:
                start = ours(model, 4, a.ctx, a.threads, ("--alias", "m"), dialect="openai")
            with pythonpath(path), start as server:
                for kind in kinds:
                    try:
                        rows[(label, kind, clients)] = run(
                            server, kind, clients, a.requests, a.max_tokens, not a.no_drafts
                        )
                    except Exception as e:
                        print(f"{label} {kind} x{clients}: {e}")
    if counts:
        table(rows, labels, kinds, counts)
    constrained = [k for k in kinds if k != "plain"]
    if a.compiles <= 0 or not constrained:
        return
    with ours(model, 4, a.ctx, a.threads, ("--alias", "m"), dialect="openai") as server:
        times = {kind: compile_times(server, kind, a.compiles) for kind in constrained}
    print(f"\n| compile ({a.compiles} requests, llamarunner) | p50 ms | p99 ms |")
    print("|---|---|---|")
    for kind, (p50, p99) in times.items():
        print(f"| {kind} | {p50:.2f} | {p99:.2f} |")


def table(
    rows: dict[tuple[str, str, int], dict[str, float]],
    labels: list[str],
    kinds: list[str],
    counts: list[int],
) -> None:
    """The throughput table: one row per scenario and client count."""
    head = " | ".join(f"{label} tok/s" for label in labels)
    ratios = " | ".join(f"ours / {label}" for label in labels[1:])
    print(
        f"\n| scenario | clients | {head} | {ratios} | ours / ours unconstrained "
        f"| TTFT ms {' / '.join(labels)} | tokens/request {' / '.join(labels)} |"
    )
    print("|---" * (4 + 2 * len(labels)) + "|")
    for clients in counts:
        for kind in kinds:
            got = [rows.get((label, kind, clients)) for label in labels]
            ours_row = got[0]
            plain = rows.get(("llamarunner", "plain", clients))

            def cell(r: dict[str, float] | None, k: str, fmt: str = "{:.1f}") -> str:
                return fmt.format(r[k]) if r else "failed"

            vs = " | ".join(
                f"{ours_row['tok_s'] / r['tok_s']:.2f}x" if ours_row and r else "-" for r in got[1:]
            )
            own = f"{ours_row['tok_s'] / plain['tok_s']:.2f}x" if ours_row and plain else "-"
            print(
                f"| {kind} | {clients} | {' | '.join(cell(r, 'tok_s') for r in got)} | {vs} "
                f"| {own} | {' / '.join(cell(r, 'ttft_ms', '{:.0f}') for r in got)} "
                f"| {' / '.join(cell(r, 'tokens', '{:.0f}') for r in got)} |"
            )


if __name__ == "__main__":
    main()
