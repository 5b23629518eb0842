"""Speculative decoding benchmark: llamarunner without drafts, with prompt-lookup drafts and
with a draft model, side by side with llama.cpp's llama-server without speculation, with its
n-gram speculation and with the same draft model, in one run.

    python -m benches.speculative --llama-server PATH
    python -m benches.speculative --llama-server PATH --clients 1,4 --requests 2 \\
        --scenarios passage,edit,code,free,sampled --configs plain,ngram,model,peer-ngram

The draft model is, unless ``--draft-model`` names one, the default model cut to its first
``--draft-blocks`` (12) of 18 blocks (``benches/truncated_draft.py``; written to a cache
directory): the only draft of Gemma 3 270M's vocabulary at hand.

Scenarios (chat requests, greedy, the same prompts for every server):
  passage  repeat a ~300-word passage word for word (the output copies the input)
  edit     the passage with one word replaced throughout (the output copies it, lightly edited)
  code     a Python function with a renamed identifier (code repeats its identifiers)
  free     a story on a topic, greedy (a model this small soon repeats itself: many drafts)
  sampled  the same stories sampled (temperature 0.8, fixed seeds): text that repeats less;
           ours is asked for drafts (`speculative: true`; sampled requests do not draft by
           default), llama-server drafts for every request
  hot      the stories at temperature 1.5 (fixed seeds): text that hardly repeats, so drafts
           are mostly rejected (the case where drafting must cost nothing)

Each request is a non-streamed ``/v1/chat/completions`` (both servers count the tokens in
``usage``; streamed chunks carry several tokens when drafts are accepted). Throughput is the
generated tokens of all requests over the wall time of the scenario (prompts included);
clients run closed loops. The acceptance rate is accepted / drafted tokens, as each server
reports them (ours: ``usage.completion_tokens_details``; llama-server: ``timings.draft_n`` and
``draft_n_accepted``).

With ``--rounds N`` every configuration's server runs at once and each row is measured N
times, interleaved with the others (the order rotated each round); the table gives each row's
median round and the range. On shared cores a single run of a row varies by ±15 %.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benches.load import Running, llama_server, ours

PASSAGE = (
    "The river town woke slowly on market days. Before dawn the fishermen pulled their boats "
    "onto the gravel below the old stone bridge, and the gulls came down to argue over what "
    "was left in the nets. The baker opened his shutters at six, and the smell of bread "
    "drifted along the narrow street to the square, where the first carts were already "
    "arriving from the farms in the valley. By seven the schoolteacher had walked the long "
    "way round to avoid the mud by the mill, greeting the blacksmith, the widow who sold "
    "honey, and the two brothers who mended nets under the chestnut tree. By nine the market "
    "square was full of voices: farmers selling apples, cheese and eggs, a tinker mending "
    "pots, a woman with a basket of herbs from the hills, and children chasing a dog that "
    "had stolen a loaf from the baker's cart. The mayor stood on the steps of the town hall "
    "and watched it all with his hands behind his back, as his father had done before him. "
    "At noon the church bell rang, the stalls closed one by one, and the square emptied as "
    "quickly as it had filled. In the afternoon the river was quiet again, the boats lay on "
    "the gravel in a row, and only the gulls and the old ferryman remained, waiting, as "
    "always, for the evening tide to turn and carry the day's last light down to the sea. "
    "Nobody in the town could remember a market day that had ended any other way, and "
    "nobody wanted one to."
)

CODE = '''def summarize_orders(orders, customer_index, minimum_total):
    """Totals per customer of the orders at or above a minimum."""
    totals = {}
    for order in orders:
        if order.total < minimum_total:
            continue
        customer = customer_index.get(order.customer_id)
        if customer is None:
            continue
        totals.setdefault(customer.name, 0)
        totals[customer.name] += order.total
    ranked = sorted(totals.items(), key=lambda item: item[1], reverse=True)
    for name, total in ranked:
        print(f"{name}: {total:.2f}")
    return ranked
'''

TOPICS = ["a lighthouse keeper", "a lost compass", "a winter orchard", "a night train", "a clock"]


def prompts(scenario: str, n: int, round_: int = 0) -> list[str]:
    """`n` prompts of a scenario (a few variants), each opening with its round and index, so that
    no request is a cached replay of an earlier one (llama-server keeps earlier prompts' caches
    in host memory and restores them; a round that reused them would skip its prefill)."""
    return [f"(Request {round_}.{i}) {p}" for i, p in enumerate(variants(scenario, n))]


def variants(scenario: str, n: int) -> list[str]:
    out = []
    for i in range(n):
        towns = ["river", "harbour", "mountain", "forest", "valley town", "island"]
        passage = PASSAGE.replace("river town", towns[i % len(towns)] + " town")
        if scenario == "passage":
            out.append(f"Repeat the following text exactly, word for word.\n\n{passage}")
        elif scenario == "edit":
            out.append(
                'Rewrite the following text, replacing the word "market" with '
                f'"fair" everywhere; change nothing else.\n\n{passage}'
            )
        elif scenario == "code":
            names = ["orders", "purchases", "invoices", "sales", "bookings", "tickets"]
            code = CODE.replace("customer_index", f"index_{i}")
            out.append(
                "Rename the variable `orders` to `"
                + names[i % len(names)]
                + "` in this Python function and return the whole function.\n\n"
                + f"```python\n{code}```"
            )
        elif scenario in ("free", "sampled", "hot"):
            out.append(f"Write a long story about {TOPICS[i % len(TOPICS)]}.")
        else:
            raise ValueError(f"unknown scenario {scenario}")
    return out


@dataclass
class Result:
    server: str
    scenario: str
    clients: int
    tokens: int
    seconds: float
    drafted: int
    accepted: int
    texts: list[str]


def complete(
    url: str,
    prompt: str,
    max_tokens: int,
    extra: dict[str, Any],
    seed: int | None = None,
    temperature: float = 0.8,
) -> dict[str, Any]:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0 if seed is None else temperature,
        **({} if seed is None else {"seed": seed}),
        **extra,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=900)
    r.raise_for_status()
    return dict(r.json())


def measure(
    srv: Running,
    scenario: str,
    clients: int,
    requests: int,
    max_tokens: int,
    extra: dict[str, Any],
    round_: int = 0,
) -> Result:
    work = prompts(scenario, clients * requests, round_)
    answers: list[dict[str, Any]] = [{} for _ in work]

    def client(i: int) -> None:
        for j in range(requests):
            k = i * requests + j
            seed = 100 + k if scenario in ("sampled", "hot") else None
            temperature = 1.5 if scenario == "hot" else 0.8
            answers[k] = complete(srv.url, work[k], max_tokens, extra, seed, temperature)

    # One request first so that both servers start warm (page cache, first-use allocations).
    complete(srv.url, "Say hello.", 8, extra)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    drafted = accepted = 0
    for a in answers:
        details = a.get("usage", {}).get("completion_tokens_details") or {}
        timings = a.get("timings") or {}
        acc = int(details.get("accepted_prediction_tokens", timings.get("draft_n_accepted", 0)))
        rej = details.get("rejected_prediction_tokens")
        drafted += acc + int(rej) if rej is not None else int(timings.get("draft_n", 0))
        accepted += acc
    return Result(
        srv.name,
        scenario,
        clients,
        sum(int(a["usage"]["completion_tokens"]) for a in answers),
        seconds,
        drafted,
        accepted,
        [a["choices"][0]["message"]["content"] for a in answers],
    )


PLAIN = "llamarunner, no drafts"


@dataclass
class Config:
    """One server configuration of the table."""

    label: str
    kind: str  # "ours" or "llama-server"
    args: tuple[str, ...]
    extra: dict[str, Any]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="GGUF model (default: the default model)")
    ap.add_argument("--llama-server", metavar="PATH", help="llama.cpp's llama-server binary")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", default="1,4", help="client counts, comma separated")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every row this many times, interleaved; the table gives the median",
    )
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--scenarios", default="passage,edit,code,free,sampled")
    ap.add_argument(
        "--peer-spec",
        default="--spec-type ngram-simple",
        help="llama-server's speculation flags (default: its n-gram lookup, its defaults)",
    )
    ap.add_argument(
        "--draft-model",
        help="draft model for ours (--draft-model) and llama-server (-md); default: the default "
        "model cut to its first --draft-blocks blocks (benches/truncated_draft.py)",
    )
    ap.add_argument("--draft-blocks", type=int, default=12)
    ap.add_argument(
        "--configs",
        default="plain,ngram,model,peer,peer-ngram,peer-model",
        help="rows to run: plain (ours, no drafts), ngram (ours, lookup drafts, adaptive), "
        "always (ours, lookup drafts, --draft-always), model (ours, --draft-model), "
        "model-always, peer (llama-server), peer-ngram (its --peer-spec), peer-model (its -md)",
    )
    args = ap.parse_args(argv)
    model = args.model
    if not model:
        from llamarunner import default_model_path

        model = str(default_model_path())
    wanted = args.configs.split(",")
    draft = args.draft_model
    if not draft and any(c.endswith("model") or c == "model-always" for c in wanted):
        from benches.truncated_draft import draft_for

        draft = str(draft_for(Path(model), args.draft_blocks))
    spec = {"speculative": True}
    table = {
        "plain": Config(PLAIN, "ours", ("--draft-max", "0"), {}),
        "ngram": Config("llamarunner, n-gram", "ours", (), spec),
        "always": Config("llamarunner, n-gram, --draft-always", "ours", ("--draft-always",), spec),
        "model": Config("llamarunner, draft model", "ours", ("--draft-model", str(draft)), spec),
        "model-always": Config(
            "llamarunner, draft model, --draft-always",
            "ours",
            ("--draft-model", str(draft), "--draft-always"),
            spec,
        ),
    }
    if args.llama_server:
        table |= {
            "peer": Config("llama-server", "llama-server", (), {}),
            "peer-ngram": Config(
                "llama-server " + args.peer_spec, "llama-server", tuple(args.peer_spec.split()), {}
            ),
            "peer-model": Config(
                "llama-server -md (draft model)",
                "llama-server",
                ("-md", str(draft), "--spec-type", "draft-simple"),
                {},
            ),
        }
    configs = [table[c] for c in wanted if c in table]
    if draft:
        print(f"draft model: {draft}\n")
    if args.llama_server:
        version = subprocess.run(
            [args.llama_server, "--version"], capture_output=True, text=True, check=False
        )
        print(f"llama-server --version: {(version.stdout + version.stderr).strip()}\n")
    results: list[Result] = []
    ctx = 2048
    for clients in [int(c) for c in args.clients.split(",")]:
        # Every configuration's server runs at once (idle ones cost memory only), and each
        # round measures each scenario on each of them in turn, the order rotated from round to
        # round: drift in the machine's speed (other tenants of shared cores) spreads over all
        # rows instead of landing on one.
        with ExitStack() as stack:
            servers = []
            for cfg in configs:
                if cfg.kind == "ours":
                    server = ours(model, clients, ctx, args.threads, cfg.args, "openai")
                else:
                    server = llama_server(
                        args.llama_server, model, clients, ctx, args.threads, cfg.args
                    )
                servers.append((cfg, stack.enter_context(server)))
            for round_ in range(args.rounds):
                turn = servers[round_ % len(servers) :] + servers[: round_ % len(servers)]
                for scenario in args.scenarios.split(","):
                    for cfg, srv in turn:
                        r = measure(
                            srv,
                            scenario,
                            clients,
                            args.requests,
                            args.max_tokens,
                            cfg.extra,
                            round_,
                        )
                        r.server = cfg.label
                        results.append(r)
                        print(
                            f"round {round_ + 1} | {cfg.label} | {scenario} | {clients} | "
                            f"{r.tokens / r.seconds:.1f} tok/s",
                            file=sys.stderr,
                            flush=True,
                        )
    print(report(results))
    return 0


@dataclass
class Row:
    """One configuration on one scenario, over every round."""

    server: str
    scenario: str
    clients: int
    rounds: list[Result]

    @property
    def rates(self) -> list[float]:
        return sorted(r.tokens / r.seconds for r in self.rounds)

    @property
    def rate(self) -> float:
        """The median round's tokens per second."""
        return statistics.median(self.rates)


def rows(results: list[Result]) -> list[Row]:
    out: dict[tuple[str, str, int], Row] = {}
    for r in results:
        key = (r.server, r.scenario, r.clients)
        out.setdefault(key, Row(r.server, r.scenario, r.clients, [])).rounds.append(r)
    return list(out.values())


def report(results: list[Result]) -> str:
    table = rows(results)
    base = {(r.scenario, r.clients): r for r in table if r.server == PLAIN}
    peer = {
        (r.scenario, r.clients): r
        for r in table
        if r.server.startswith("llama-server ") and "ngram" in r.server
    }
    lines = [
        "| scenario | clients | server | rounds | tokens | gen tok/s (median) | range "
        "| vs ours without drafts | vs llama-server n-gram | drafted | accepted | acceptance "
        "| same text as ours without drafts |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(table, key=lambda r: (r.clients, r.scenario)):
        key = (r.scenario, r.clients)
        b, p = base.get(key), peer.get(key)
        vs_base = f"{r.rate / b.rate:.2f}" if b else "-"
        vs_peer = f"{r.rate / p.rate:.2f}" if p else "-"
        tokens = sum(x.tokens for x in r.rounds)
        drafted = sum(x.drafted for x in r.rounds)
        accepted = sum(x.accepted for x in r.rounds)
        acc = f"{accepted / drafted:.0%}" if drafted else "-"
        # Round by round against the same round without drafts.
        same = (
            ("yes" if all(x.texts == y.texts for x, y in zip(r.rounds, b.rounds)) else "no")
            if b
            else "-"
        )
        spread = f"{r.rates[0]:.1f}-{r.rates[-1]:.1f}"
        lines.append(
            f"| {r.scenario} | {r.clients} | {r.server} | {len(r.rounds)} | {tokens} | "
            f"{r.rate:.1f} | {spread} | {vs_base} | {vs_peer} | {drafted} | {accepted} | {acc} | "
            f"{same} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
