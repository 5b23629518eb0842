"""Prefix affinity on Ray Serve: cached-prefix hit rate of multi-turn conversations with
llamarunner's `PrefixAffinityRouter` against Ray Serve's default router (power of two
choices), on one local Ray cluster, the same replicas' settings and the same conversations.

    python -m benches.ray_affinity                      # default model, 2 replicas
    python -m benches.ray_affinity --conversations 16 --turns 4 --repeat 3
    python -m benches.ray_affinity --model M.gguf --replicas 3 --parallel 4

Conversations run interleaved turn by turn (every conversation's turn k before any turn
k+1), one request at a time, through the native API's ``messages``. A follow-up turn *hits*
when its ``prompt_cached_count`` covers the whole previous turn's prompt (it landed on the
replica, and the slot, holding it); "cached tokens" is the share of all follow-up prompt
tokens reused. Needs ``pip install '.[ray,default-model]'``.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import statistics
import time
from dataclasses import dataclass

import httpx


@dataclass
class Result:
    router: str
    follow_ups: int
    hits: int
    cached_tokens: int
    prompt_tokens: int
    seconds: float
    replicas_used: int


TOPICS = (
    "Rivers",
    "Volcanoes",
    "Bees",
    "Clocks",
    "Glaciers",
    "Lighthouses",
    "Comets",
    "Orchards",
    "Deserts",
    "Bridges",
    "Harbors",
    "Forests",
    "Engines",
    "Lanterns",
    "Markets",
    "Winters",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_conversations(url: str, n: int, turns: int, num_predict: int) -> Result:
    history = [
        [{"role": "user", "content": f"{TOPICS[i % len(TOPICS)]} #{i}: tell me more."}]
        for i in range(n)
    ]
    previous = [0] * n
    hits = follow_ups = cached = prompt = 0
    replicas: set[str] = set()
    start = time.perf_counter()
    with httpx.Client(timeout=300) as client:
        for turn in range(turns):
            for i in range(n):
                body = {
                    "messages": history[i],
                    "options": {"num_predict": num_predict, "temperature": 0, "seed": i},
                }
                r = client.post(f"{url}/completion", json=body)
                r.raise_for_status()
                lines = [json.loads(x) for x in r.text.split("\n") if x.strip()]
                *chunks, final = lines
                replicas.add(r.headers.get("x-llamarunner-replica", "?"))
                if turn > 0:
                    follow_ups += 1
                    hits += final["prompt_cached_count"] >= previous[i]
                    cached += final["prompt_cached_count"]
                    prompt += final["prompt_eval_count"]
                previous[i] = final["prompt_eval_count"]
                answer = "".join(c.get("content", "") for c in chunks)
                history[i] += [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": "Go on, and be specific."},
                ]
    return Result("", follow_ups, hits, cached, prompt, time.perf_counter() - start, len(replicas))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="GGUF model (default: the default model)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=4, help="slots per replica")
    ap.add_argument("--ctx-size", type=int, default=2048, help="tokens per slot")
    ap.add_argument("--threads", type=int, default=1, help="threads per replica")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--num-predict", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=1, help="runs per router (fresh replicas)")
    args = ap.parse_args()

    import ray
    from ray import serve

    from llamarunner.ray import build_app

    ray.init(
        address="local", include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    results: list[Result] = []
    try:
        for rep in range(args.repeat):
            for router in ("affinity", "pow2"):
                app = build_app(
                    args.model,
                    replicas=args.replicas,
                    routing=router,
                    parallel=args.parallel,
                    ctx_size=args.ctx_size,
                    threads=args.threads,
                    multiuser_cache=True,
                    ray_actor_options={"num_cpus": 0},
                )
                serve.run(app, name=f"bench-{router}-{rep}", route_prefix="/")
                r = run_conversations(url, args.conversations, args.turns, args.num_predict)
                r.router = router
                results.append(r)
                serve.delete(f"bench-{router}-{rep}")
    finally:
        serve.shutdown()
        ray.shutdown()

    print(
        f"\n{args.replicas} replicas x {args.parallel} slots of {args.ctx_size} tokens, "
        f"{args.threads} thread(s) each, --multiuser-cache; {args.conversations} conversations "
        f"x {args.turns} turns, interleaved, {args.num_predict} tokens per answer; "
        f"{args.repeat} run(s) per router\n"
    )
    print(
        "| router | follow-up turns | hits (cache covers previous turn) | hit rate | "
        "cached share of follow-up prompt tokens | replicas used | wall s |"
    )
    print("|---|---|---|---|---|---|---|")
    for router in ("affinity", "pow2"):
        rs = [r for r in results if r.router == router]
        f = sum(r.follow_ups for r in rs)
        h = sum(r.hits for r in rs)
        c = sum(r.cached_tokens for r in rs)
        p = sum(r.prompt_tokens for r in rs)
        name = "llamarunner affinity" if router == "affinity" else "Ray default (pow2)"
        print(
            f"| {name} | {f} | {h} | {h / f:.0%} | {c / p:.0%} | "
            f"{max(r.replicas_used for r in rs)} | "
            f"{statistics.median(r.seconds for r in rs):.1f} |"
        )


if __name__ == "__main__":
    main()
