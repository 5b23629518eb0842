"""What the many-model router's hop costs a request: the same cheap requests, one client, sent
to the model served directly (``llamarunner serve MODEL``) and through the router
(``llamarunner serve --models-dir DIR`` with the model in DIR), alternating in blocks, in one
run, one table.

    python -m benches.router_hop                 # the default model
    python -m benches.router_hop --model M.gguf --blocks 4 --per-block 20

Requests whose own work is small (``/tokenize``, a one-token ``/v1/completions`` of a cached
prompt, and the same streamed) leave the hop's cost visible: the front reads the body for
its ``model``, takes the model's lease and opens a loopback connection to the model's engine
process. Each kind is sent over a kept-alive connection (as an SDK client sends) and over a
new connection per request (as curl does). Both servers stay up for the whole run and take
turns block by block (the order alternating), so drift favours neither.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import ExitStack
from typing import Any

import httpx

from .load import Running, ours

KINDS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("tokenize", "/tokenize", {"content": "Hello there"}),
    (
        "completion, 1 token",
        "/v1/completions",
        {"prompt": "Hello there", "max_tokens": 1, "temperature": 0},
    ),
    (
        "completion, 1 token, streamed",
        "/v1/completions",
        {"prompt": "Hello there", "max_tokens": 1, "temperature": 0, "stream": True},
    ),
)


def timed(client: httpx.Client, url: str, body: dict[str, Any], n: int) -> list[float]:
    """Seconds for each of `n` requests, from sending to the whole answer read."""
    out: list[float] = []
    for _ in range(n):
        start = time.perf_counter()
        r = client.post(url, json=body)
        r.raise_for_status()
        out.append(time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="GGUF model (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=6, help="blocks per server, per kind")
    ap.add_argument("--per-block", type=int, default=50, help="requests per block")
    args = ap.parse_args(argv)
    model = args.model
    if not model:
        from llamarunner import default_model_path

        model = str(default_model_path())
    rows = [
        "| request | connection | direct p50 ms | router p50 ms | router - direct p50 ms "
        "| direct mean ms | router mean ms |",
        "|---|---|---|---|---|---|---|",
    ]
    with ExitStack() as stack:
        direct: Running = stack.enter_context(ours(model, 1, 2048, args.threads, (), "openai"))
        router: Running = stack.enter_context(
            ours(model, 1, 2048, args.threads, (), "openai", router=True)
        )
        name = router.model  # both servers answer to the file's stem
        for label, path, body in KINDS:
            for keep_alive in (True, False):
                limits = httpx.Limits(max_keepalive_connections=None if keep_alive else 0)
                times: dict[str, list[float]] = {"direct": [], "router": []}
                for block in range(args.blocks):
                    order = [("direct", direct), ("router", router)]
                    for who, srv in order if block % 2 == 0 else order[::-1]:
                        with httpx.Client(limits=limits, timeout=60) as client:
                            url = srv.url + path
                            times[who] += timed(
                                client, url, {**body, "model": name}, args.per_block
                            )
                d, r = (statistics.median(times[k]) * 1000 for k in ("direct", "router"))
                dm, rm = (statistics.mean(times[k]) * 1000 for k in ("direct", "router"))
                conn = "kept alive" if keep_alive else "new per request"
                rows.append(
                    f"| {label} | {conn} | {d:.2f} | {r:.2f} | {r - d:+.2f} | {dm:.2f} | {rm:.2f} |"
                )
                print(rows[-1], file=sys.stderr, flush=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
