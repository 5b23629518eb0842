"""Profile a server under a parallel load with perf (cpu-clock sampling): ours by default, or
llama.cpp's llama-server with the same slots, context and threads, to compare where each
spends its time.

    python -m benches.profile && perf report -i /tmp/perf.data --no-children --sort symbol
    python -m benches.profile --parallel 4 --llama-server PATH --out /tmp/perf-peer.data
"""

from __future__ import annotations

import argparse
import random
import subprocess
import threading
import time

from benches import load
from llamarunner import default_model_path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--parallel", type=int, default=8, help="slots and clients")
    ap.add_argument("--llama-server", metavar="PATH", help="profile llama-server instead")
    ap.add_argument("--seconds", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=64, help="generated per request")
    ap.add_argument("--out", default="/tmp/perf.data")
    args = ap.parse_args(argv)
    m = str(default_model_path())
    plan = load.Plan(m, 2, 3, random.Random(3))
    n = args.parallel
    server = (
        load.llama_server(args.llama_server, m, n, 2048, 2)
        if args.llama_server
        else load.ours(m, n, 2048, 2, dialect="openai")
    )
    with server as srv:
        prompts = load.distinct(plan, n, 178)
        t = threading.Thread(target=lambda: load.run_clients(srv, prompts, args.max_tokens))
        t.start()
        time.sleep(1)
        subprocess.run(
            [
                *("perf", "record", "-F", "499", "-e", "cpu-clock", "-g", "-o", args.out),
                *("-p", str(srv.proc.pid), "--", "sleep", str(args.seconds)),
            ],
            capture_output=True,
            check=False,
        )
        t.join()


if __name__ == "__main__":
    main()
