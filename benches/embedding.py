"""What one long embedding costs the server: its memory, and the streams generating beside it.

    python -m benches.embedding                    # default model, a 4,096-token input
    python -m benches.embedding --model M.gguf --words 300 --threads 2

Starts ``llamarunner serve`` (one slot), starts a greedy stream, then embeds a long input
(truncated to the slot) while the stream runs. Prints one table row: the input's tokens, the
embedding's seconds, the server's RSS before, at its peak (sampled every 5 ms) and after, and
the stream's tokens and longest gap during the embedding beside its median gap before it.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import httpx

from benches.load import free_port


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="GGUF file (default: the default model)")
    ap.add_argument("--words", type=int, default=1300, help="words in the input (~3 tokens each)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    import subprocess

    port = free_port()
    cmd = [sys.executable, "-m", "llamarunner", "serve", "--port", str(port)]
    cmd += ["--threads", str(args.threads)] + ([args.model] if args.model else [])
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the server did not get ready")
            time.sleep(0.1)
        httpx.post(f"{url}/embedding", json={"content": "warm up"}, timeout=60).raise_for_status()
        before = rss_mb(proc.pid)
        peak = before
        stop = threading.Event()

        def watch() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, rss_mb(proc.pid))
                time.sleep(0.005)

        stamps: list[float] = []

        def generate() -> None:
            body = {
                "prompt": "Once upon a time",
                "options": {"num_predict": 400, "ignore_eos": True, "temperature": 0},
            }
            with httpx.stream("POST", f"{url}/completion", json=body, timeout=600) as r:
                for line in r.iter_lines():
                    if line.strip():
                        stamps.append(time.monotonic())

        watcher = threading.Thread(target=watch)
        stream = threading.Thread(target=generate)
        watcher.start()
        stream.start()
        time.sleep(2)
        text = " ".join(f"word{i}" for i in range(args.words))
        t0 = time.monotonic()
        r = httpx.post(f"{url}/embedding", json={"content": text, "truncate": True}, timeout=900)
        t1 = time.monotonic()
        r.raise_for_status()
        stream.join()
        stop.set()
        watcher.join()
        after = rss_mb(proc.pid)
        pairs = list(zip(stamps, stamps[1:]))
        during = [b - a for a, b in pairs if t0 <= b <= t1]
        before_gaps = sorted(b - a for a, b in pairs if b < t0)
        median = before_gaps[len(before_gaps) // 2] if before_gaps else 0.0
        print(
            "| tokens | seconds | RSS before MB | RSS peak MB | RSS after MB "
            "| stream tokens during | max gap during ms | median gap before ms |"
        )
        print("|---|---|---|---|---|---|---|---|")
        print(
            f"| {r.json()['prompt_eval_count']} | {t1 - t0:.1f} | {before:.0f} | {peak:.0f} "
            f"| {after:.0f} | {len(during)} | {max(during, default=0) * 1000:.0f} "
            f"| {median * 1000:.0f} |"
        )
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
