"""Agent-loop benchmark: more conversations than slots, each with the same long system prompt
(tool descriptions), a history that grows by a tool result every turn, and short answers;
llamarunner beside llama.cpp's llama-server, both at their defaults, in one run.

    python -m benches.agent_loop --llama-server PATH
    python -m benches.agent_loop --llama-server PATH --conversations 12 --slots 4 --rounds 4
    python -m benches.agent_loop --ours-flag=--cache-ram=0   # ours without the prompt cache
    python -m benches.agent_loop --base-python /tmp/base-venv/bin/python --repeat 4
        # + ours from another environment (another build), as llamarunner@base

The shape (the issue's): ``--conversations`` (12) agent conversations over ``--slots`` (4)
slots, served by ``--clients`` (4) clients. Each round, every conversation takes one turn.
Client ``i`` runs the turns of conversations ``i``, ``i + clients``, ... one after another, and
the clients run at once. A turn is a streamed ``/v1/chat/completions`` request (greedy, at
most ``--max-tokens`` tokens, ``stream_options.include_usage``). Its messages are:

- the system prompt, ~1,100 tokens of tool descriptions shared by every conversation;
- the conversation's task;
- per earlier turn, the assistant's answer and a ~150-token tool result.

Per server and per kind of turn (the first turn, which shares only the system prompt with
others, and follow-ups, which continue their own conversation), the table reports: generated
tokens per second over the whole run, TTFT p50/p90, the share of prompt tokens that came from
the cache (``usage.prompt_tokens_details.cached_tokens``, which both servers report), and
peak RSS. With ``--repeat N`` the servers alternate N times and the table gives medians.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from benches.load import Running, llama_server, ours, peak_rss_mb

TOOLS = [
    ("search_files", "Search the repository for files whose path matches a glob pattern."),
    ("read_file", "Read a file of the repository, optionally a range of its lines."),
    ("write_file", "Write a file of the repository, replacing its contents."),
    ("run_tests", "Run the test suite, or the tests whose names match a pattern."),
    ("run_command", "Run a shell command in the repository and return its output."),
    ("open_issue", "Open an issue in the tracker with a title, a body and labels."),
    ("list_issues", "List the open issues of the tracker, newest first."),
    ("comment", "Add a comment to an issue or a pull request."),
    ("create_branch", "Create a git branch from the current commit."),
    ("commit", "Commit the staged changes with a message."),
    ("diff", "Show the diff of the working tree or between two commits."),
    ("fetch_url", "Fetch a web page and return its text."),
]

WORDS = [
    "module",
    "function",
    "parameter",
    "returns",
    "error",
    "value",
    "list",
    "string",
    "integer",
    "path",
    "file",
    "line",
    "test",
    "pattern",
    "result",
    "output",
    "input",
    "config",
    "default",
    "option",
    "server",
    "client",
    "request",
    "response",
    "cache",
    "token",
    "model",
    "slot",
    "batch",
    "thread",
    "queue",
    "timeout",
    "retry",
    "status",
    "message",
    "header",
    "body",
    "json",
]


def system_prompt() -> str:
    """~1,100 tokens: the agent's instructions and a JSON-ish description of each tool."""
    parts = [
        "You are a coding agent working in a software repository. You solve the user's task "
        "by calling tools, one call per turn, and you answer in one short sentence when done. "
        "Think about which tool gives the information you need before calling it. Never "
        "guess the contents of a file: read it. Keep your answers brief.\n\nTools:\n"
    ]
    for name, what in TOOLS:
        params = ", ".join(
            f'"{w}": {{"type": "string", "description": "the {w}"}}' for w in WORDS[:6]
        )
        parts.append(
            f'- {name}: {what} Parameters: {{"type": "object", "properties": {{{params}}}, '
            f'"required": ["{WORDS[0]}"]}}. It returns a JSON object with the fields '
            '"ok" (boolean), "output" (string) and "error" (string or null). Errors are '
            "reported in the error field, never raised.\n"
        )
    return "".join(parts)


def tool_result(rng: random.Random) -> str:
    """~150 tokens of tool output."""
    lines = [
        f"{rng.choice(WORDS)}/{rng.choice(WORDS)}.py:{rng.randint(1, 400)}: "
        + " ".join(rng.choice(WORDS) for _ in range(9))
        for _ in range(8)
    ]
    return 'Tool result: {"ok": true, "output": "' + "\\n".join(lines) + '", "error": null}'


@dataclass
class Turn:
    first: bool
    ttft: float
    tokens: int
    prompt: int
    cached: int


@dataclass
class Conversation:
    task: str
    rng: random.Random
    messages: list[dict[str, str]] = field(default_factory=list)


def take_turn(
    server: Running, model: str, system: str, conv: Conversation, max_tokens: int
) -> Turn:
    first = not conv.messages
    if first:
        conv.messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": conv.task},
        ]
    body: dict[str, Any] = {
        "model": model,
        "messages": conv.messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    text.append(piece)
    answer = "".join(text) or "(no answer)"
    conv.messages.append({"role": "assistant", "content": answer})
    conv.messages.append({"role": "user", "content": tool_result(conv.rng)})
    details = usage.get("prompt_tokens_details") or {}
    return Turn(
        first=first,
        ttft=ttft if ttft is not None else time.perf_counter() - start,
        tokens=int(usage.get("completion_tokens", len(text))),
        prompt=int(usage.get("prompt_tokens", 0)),
        cached=int(details.get("cached_tokens", 0)),
    )


@dataclass
class Result:
    server: str
    turns: list[Turn]
    seconds: float
    rss_mb: float


def run(server: Running, args: argparse.Namespace) -> Result:
    system = system_prompt()
    convs = [
        Conversation(
            task=f"Task {k}: find why the {WORDS[k % len(WORDS)]} tests fail and fix it.",
            rng=random.Random(k),
        )
        for k in range(args.conversations)
    ]
    # The served model's name (ours answers 404 for another).
    model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    turns: list[Turn] = []
    lock = threading.Lock()
    failures: list[BaseException] = []

    def client(i: int) -> None:
        try:
            for conv in convs[i :: args.clients]:
                t = take_turn(server, model, system, conv, args.max_tokens)
                with lock:
                    turns.append(t)
        except BaseException as e:  # reported after the round
            failures.append(e)

    start = time.perf_counter()
    for _ in range(args.rounds):
        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise RuntimeError(f"{server.name}: {failures[0]!r}")
    seconds = time.perf_counter() - start
    return Result(server.name, turns, seconds, peak_rss_mb(server.proc.pid))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def rows(r: Result) -> list[list[str]]:
    out = []
    tokens = sum(t.tokens for t in r.turns)
    for kind, first in (("first turns", True), ("follow-ups", False)):
        ts = [t for t in r.turns if t.first == first]
        ttft = [t.ttft * 1000 for t in ts]
        prompt = sum(t.prompt for t in ts)
        cached = sum(t.cached for t in ts)
        out.append(
            [
                r.server,
                kind,
                str(len(ts)),
                f"{tokens / r.seconds:.1f}",
                f"{pct(ttft, 0.5):.0f}",
                f"{pct(ttft, 0.9):.0f}",
                f"{prompt / max(1, len(ts)):.0f}",
                f"{100 * cached / max(1, prompt):.0f} %",
                f"{r.rss_mb:.0f}",
            ]
        )
    return out


HEADER = (
    "| server | turns | n | gen tok/s (run) | TTFT p50 ms | TTFT p90 ms | prompt tokens | "
    "cached | peak RSS MB |\n|---|---|---|---|---|---|---|---|---|"
)


def median_rows(results: list[Result]) -> list[list[str]]:
    """Per server and kind, each numeric column's median over the repeats."""
    table: dict[tuple[str, str], list[list[str]]] = {}
    for r in results:
        for row in rows(r):
            table.setdefault((row[0], row[1]), []).append(row)
    out = []
    for (server, kind), rs in table.items():
        med = [server, kind]
        for col in range(2, len(rs[0])):
            vals = [float(x[col].rstrip(" %")) for x in rs]
            suffix = " %" if rs[0][col].endswith("%") else ""
            m = statistics.median(vals)
            med.append(f"{m:.1f}{suffix}" if col == 3 else f"{m:.0f}{suffix}")
        out.append(med)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="GGUF model (default: the default model)")
    ap.add_argument("--llama-server", metavar="PATH", help="also run llama.cpp's llama-server")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=4096, help="context tokens per slot")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument(
        "--ours-flag", action="append", default=[], help="an extra flag for ours (repeatable)"
    )
    ap.add_argument(
        "--base-python",
        metavar="PATH",
        help="also run ours from the Python at PATH (another build), as llamarunner@base",
    )
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        from llamarunner.config import default_model_path

        model = str(default_model_path())
    results: list[Result] = []
    for k in range(args.repeat):
        servers = ["ours", "peer"] if args.llama_server else ["ours"]
        if args.base_python:
            servers.append("base")
        if k % 2:
            servers.reverse()
        for which in servers:
            if which in ("ours", "base"):
                cm = ours(
                    model,
                    args.slots,
                    args.ctx,
                    args.threads,
                    tuple(args.ours_flag),
                    "openai",
                    python=args.base_python if which == "base" else None,
                )
            else:
                cm = llama_server(args.llama_server, model, args.slots, args.ctx, args.threads)
            with cm as server:
                r = run(server, args)
                results.append(r)
                print(f"{r.server}: {len(r.turns)} turns in {r.seconds:.1f} s", file=sys.stderr)
    print(HEADER)
    for row in median_rows(results):
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
