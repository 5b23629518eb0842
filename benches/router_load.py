"""Loading a model on demand: how long the first request for a model that is not loaded waits
for its first token, through our many-model router (``llamarunner serve --models-dir``) and
llama.cpp's router (``llama-server --models-dir``), in one run, one table.

    python -m benches.router_load --llama-server PATH/bin/llama-server --rounds 5
    python -m benches.router_load --rounds 3          # ours only

Both routers serve a directory holding only the model (a symlink), with the same slots,
context per slot and threads, and start each model in a process of its own. Each round, for
each router in turn: the model is unloaded (``POST /models/unload``, waiting until ``GET
/models`` says so), then one streamed ``/v1/completions`` request names it; its time to the
first token is the load plus the first prompt's decode. A second request right after it gives
the same with the model loaded, so the difference is what loading costs.

Ours keeps the decode step's measured cost on disk (``LLAMARUNNER_CACHE_DIR``); the bench
points it at an empty directory, so our first load pays that measurement (about 35 decodes)
as a first start on a machine would, and the later loads read it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .load import _process, free_port

PROMPT = "The history of the river town begins with"


@dataclass
class Router:
    name: str
    url: str
    model: str = ""
    cold: list[float] = field(default_factory=list)  # TTFT of the request that loads, s
    warm: list[float] = field(default_factory=list)  # TTFT of the next request, s


@contextmanager
def started(cmd: list[str], name: str, port: int) -> Iterator[Router]:
    with _process(cmd, name, port, "openai") as running:
        models = httpx.get(running.url + "/models", timeout=10).json()["data"]
        yield Router(name, running.url, models[0]["id"])


def status(r: Router) -> str:
    for m in httpx.get(r.url + "/models", timeout=10).json()["data"]:
        if m["id"] == r.model:
            return str(m["status"]["value"])
    raise RuntimeError(f"{r.name} no longer lists {r.model}")


def unload(r: Router) -> None:
    if status(r) != "unloaded":
        httpx.post(r.url + "/models/unload", json={"model": r.model}, timeout=60)
    deadline = time.monotonic() + 60
    while status(r) != "unloaded":
        if time.monotonic() > deadline:
            raise RuntimeError(f"{r.name} did not unload {r.model}")
        time.sleep(0.1)
    time.sleep(1.0)  # the engine process's memory is given back before the next load


def ttft(r: Router, max_tokens: int = 8) -> float:
    body = {
        "model": r.model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    with httpx.stream("POST", r.url + "/v1/completions", json=body, timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"text":"' in line and '"text":""' not in line:
                return time.perf_counter() - start
    raise RuntimeError(f"{r.name}: no token in the answer")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="GGUF model (default: the default model)")
    ap.add_argument("--llama-server", help="also llama.cpp's router: its llama-server binary")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--ctx-size", type=int, default=4096, help="context per slot")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    model = args.model
    if model is None:
        from llamarunner.config import ServerConfig

        model = ServerConfig().with_model_resolved().model
    assert model is not None
    models_dir = tempfile.TemporaryDirectory(prefix="bench-router-load-")
    cache_dir = tempfile.TemporaryDirectory(prefix="bench-router-load-cache-")
    (Path(models_dir.name) / Path(model).name).symlink_to(Path(model).resolve())
    if args.llama_server:
        version = subprocess.run(
            [args.llama_server, "--version"], capture_output=True, text=True, check=False
        )
        print(f"llama-server --version: {(version.stdout + version.stderr).strip()}\n")
    # Read by our engine processes (`_process` passes the environment on).
    os.environ["LLAMARUNNER_CACHE_DIR"] = cache_dir.name
    p_ours, p_peer = free_port(), free_port()
    ours_cmd = [
        sys.executable,
        "-m",
        "llamarunner",
        "serve",
        "--models-dir",
        models_dir.name,
        "--keep-alive",
        "-1",
        "--port",
        str(p_ours),
        "--parallel",
        str(args.parallel),
        "--ctx-size",
        str(args.ctx_size),
        "--threads",
        str(args.threads),
    ]
    peer_cmd = [
        args.llama_server,
        "--models-dir",
        models_dir.name,
        "--models-max",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        str(p_peer),
        "--parallel",
        str(args.parallel),
        "--ctx-size",
        str(args.ctx_size * args.parallel),  # llama-server divides it between its slots
        "--threads",
        str(args.threads),
        "--threads-batch",
        str(args.threads),
    ]
    with ExitStack() as stack:
        routers = [stack.enter_context(started(ours_cmd, "llamarunner router", p_ours))]
        if args.llama_server:
            routers.append(stack.enter_context(started(peer_cmd, "llama-server router", p_peer)))
        for n in range(args.rounds):
            # Alternating which goes first, so neither always follows the other's load.
            for r in routers if n % 2 == 0 else routers[::-1]:
                unload(r)
                r.cold.append(ttft(r))
                r.warm.append(ttft(r))
            print(
                f"round {n + 1}: "
                + ", ".join(
                    f"{r.name} {r.cold[-1] * 1000:.0f} ms (then {r.warm[-1] * 1000:.0f})"
                    for r in routers
                ),
                flush=True,
            )
        for r in routers:
            unload(r)
    models_dir.cleanup()
    cache_dir.cleanup()

    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1000:.0f}" if values else "-"

    print("\n| router | first load ms | later loads: median ms | range ms | loaded: TTFT ms |")
    print("|---|---|---|---|---|")
    for r in routers:
        later = r.cold[1:]
        span = f"{min(later) * 1000:.0f}-{max(later) * 1000:.0f}" if later else "-"
        print(f"| {r.name} | {r.cold[0] * 1000:.0f} | {ms(later)} | {span} | {ms(r.warm)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
