"""``llamarunner cluster`` end to end on the default model: two replicas on a local Ray cluster
that the command starts, every dialect through its endpoint, conversations kept on the replica
holding them, and SIGTERM removing it all."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from helpers import parse_ndjson, replicas_of

try:
    import ray  # noqa: F401
except ImportError:
    if os.environ.get("LLAMARUNNER_TESTS_REQUIRE_RAY", "") not in ("", "0"):
        raise
    pytest.skip("Ray Serve is not installed (pip install '.[ray]')", allow_module_level=True)

from llamarunner.ray import REPLICA_HEADER


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.real_model
@pytest.mark.timeout(600)
def test_cluster_serves_the_default_model_from_two_replicas(
    default_model: Path, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "cluster.log"
    cmd = [sys.executable, "-m", "llamarunner", "cluster", "--replicas", "2", "--port", str(port)]
    cmd += ["--parallel", "4", "--ctx-size", "1024", "--threads", "1", "--multiuser-cache"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while "llamarunner: ready on" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        question = "Q: What is the capital of France?\nA:"
        r = httpx.post(
            f"{url}/completion",
            json={"prompt": question, "options": {"num_predict": 8, "temperature": 0}},
            timeout=120,
        )
        assert r.status_code == 200
        text = "".join(line.get("content", "") for line in parse_ndjson(r.text))
        assert "Paris" in text
        # Every replica that answered (the router spreads new prompts by load, then by how
        # many prefixes each replica already holds).
        replicas = {r.headers[REPLICA_HEADER]}

        import ollama
        import openai

        # Few-shot, as tests/test_dialects_real.py: the 270M model then answers in kind.
        messages = [
            {"role": "user", "content": "What is the capital of Italy?"},
            {"role": "assistant", "content": "The capital of Italy is Rome."},
            {"role": "user", "content": "What is the capital of France?"},
        ]
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        model = oa.models.list().data[0].id
        chat = oa.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=16,
            temperature=0,
        )
        assert "Paris" in (chat.choices[0].message.content or "")
        parts = list(
            ollama.Client(host=url).chat(
                model=model,
                messages=messages,
                stream=True,
                options={"num_predict": 16, "temperature": 0},
            )
        )
        assert parts[-1].done and "Paris" in "".join(p.message.content or "" for p in parts)

        # Four conversations, two turns each, interleaved: every second turn reuses the first
        # (4 slots per replica hold its conversations and the questions above).
        topics = ["rivers", "volcanoes", "bees", "clocks"]
        # (Openings that differ: prompts sharing half their text count as one prefix.)
        history = {t: [{"role": "user", "content": f"{t.title()}: tell me more."}] for t in topics}
        first: dict[str, tuple[int, str]] = {}
        for turn in range(2):
            for t in topics:
                body = {"messages": history[t], "options": {"num_predict": 12, "temperature": 0}}
                r = httpx.post(f"{url}/completion", json=body, timeout=120)
                assert r.status_code == 200
                *chunks, final = parse_ndjson(r.text)
                history[t] += [
                    {"role": "assistant", "content": "".join(c["content"] for c in chunks)},
                    {"role": "user", "content": "And more?"},
                ]
                replicas.add(r.headers[REPLICA_HEADER])
                if turn == 0:
                    first[t] = (final["prompt_eval_count"], r.headers[REPLICA_HEADER])
                else:
                    assert r.headers[REPLICA_HEADER] == first[t][1]
                    assert final["prompt_cached_count"] >= first[t][0], (t, final, first[t])
        # Both replicas serve. The requests above are sequential, so which replicas took them
        # hangs on timing (gauges up to a stats period old; Ray's queue-length probe, whose
        # deadline a loaded machine can miss, moves a request to the next rank): a CI run had
        # one replica take them all. So the replicas are counted by /health (keyless: power of
        # two choices) until both answered, and each is then asked, pinned, for the answer.
        replicas |= replicas_of(url)
        assert len(replicas) == 2, replicas
        for name in replicas:
            r = httpx.post(
                f"{url}/completion",
                json={"prompt": question, "options": {"num_predict": 8, "temperature": 0}},
                headers={REPLICA_HEADER: name},
                timeout=120,
            )
            assert r.status_code == 200 and r.headers[REPLICA_HEADER] == name
            assert "Paris" in "".join(line.get("content", "") for line in parse_ndjson(r.text))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, log.read_text()[-3000:]
    assert "llamarunner: shutting down" in log.read_text()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=5)
