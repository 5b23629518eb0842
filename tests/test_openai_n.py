"""OpenAI's ``n`` > 1: several choices of one prompt, decoded once and forked, through the
official ``openai`` client, on the tiny model (2 slots: a third choice waits for one)."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from llamarunner import Server

from helpers import metric, wait_idle

MODEL = "tiny"
# The tiny model is random: ignore_eos makes token counts exact.
EXACT = {"ignore_eos": True}
# A prompt longer than the 32 tokens from which a fork pays (prefix sharing).
LONG_PROMPT = " ".join(["the cat is a dog and the world of hello"] * 3)


@pytest.fixture(scope="module")
def client(tiny_server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_three_choices_each_with_its_index_and_seed(client: openai.OpenAI) -> None:
    def ask() -> Any:
        return client.completions.create(
            model=MODEL,
            prompt="the world of",
            n=3,
            max_tokens=8,
            temperature=1.0,
            seed=11,
            extra_body=EXACT,
        )

    r = ask()
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) > 1, texts  # seed + i: the choices differ
    assert r.usage is not None
    assert r.usage.completion_tokens == 24
    # The same seeded request gives the same three choices.
    assert [c.text for c in ask().choices] == texts
    # Choice i is the request with n = 1 and seed + i.
    for i, text in enumerate(texts):
        one = client.completions.create(
            model=MODEL,
            prompt="the world of",
            max_tokens=8,
            temperature=1.0,
            seed=11 + i,
            extra_body=EXACT,
        )
        assert one.choices[0].text == text, i
        assert one.usage is not None and one.usage.prompt_tokens == r.usage.prompt_tokens


def test_greedy_choices_are_the_same(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello there"}],
        n=2,
        max_tokens=6,
        temperature=0,
        extra_body=EXACT,
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content
    assert all(c.finish_reason == "length" for c in r.choices)


def test_a_stream_interleaves_the_choices_and_ends_once(client: openai.OpenAI) -> None:
    body = {
        "model": MODEL,
        "prompt": "the world of",
        "n": 3,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 5,
    }
    whole = client.completions.create(**body, extra_body=EXACT)  # type: ignore[call-overload]
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, list[str]] = defaultdict(list)
    usages = []
    stream = client.completions.create(
        **body,  # type: ignore[call-overload]
        stream=True,
        stream_options={"include_usage": True},
        extra_body=EXACT,
    )
    for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes[c.index].append(c.finish_reason)
    assert sorted(texts) == [0, 1, 2]
    assert [texts[i] for i in range(3)] == [c.text for c in whole.choices]
    assert {i: f for i, f in finishes.items()} == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert len(usages) == 1 and usages[0].completion_tokens == 24


def test_a_chat_stream_with_a_role_delta_per_choice(tiny_server: Server) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "n": 2,
        "max_tokens": 5,
        "stream": True,
        "seed": 3,
        **EXACT,
    }
    roles: dict[int, int] = defaultdict(int)
    done = 0
    with httpx.stream("POST", f"{tiny_server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done += 1
                continue
            assert done == 0, "a chunk after [DONE]"
            for c in json.loads(data)["choices"]:
                if c["delta"].get("role") == "assistant":
                    roles[c["index"]] += 1
    assert dict(roles) == {0: 1, 1: 1}
    assert done == 1


def test_the_prompt_is_decoded_once_and_forked(tiny_server: Server, client: openai.OpenAI) -> None:
    wait_idle(tiny_server.url)
    # A prompt no slot holds yet.
    prompt = "dog " + LONG_PROMPT
    before = metric(tiny_server.url, "prompt_tokens_cached_total")
    r = client.completions.create(
        model=MODEL, prompt=prompt, n=2, max_tokens=4, temperature=0.5, extra_body=EXACT
    )
    cached = metric(tiny_server.url, "prompt_tokens_cached_total") - before
    assert r.usage is not None
    # The second choice forked (nearly) all of the first's prompt.
    assert cached >= r.usage.prompt_tokens - 2, (cached, r.usage.prompt_tokens)


def test_drafting_choices_match_the_plain_ones(tiny_server: Server) -> None:
    def ask(speculative: bool) -> list[str]:
        r = httpx.post(
            f"{tiny_server.url}/v1/completions",
            json={
                "prompt": LONG_PROMPT,
                "n": 2,
                "max_tokens": 16,
                "temperature": 0,
                "speculative": speculative,
                **EXACT,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return [c["text"] for c in r.json()["choices"]]

    assert ask(True) == ask(False)


@pytest.mark.parametrize("n", [0, 9, -1])
def test_n_out_of_range_is_a_400(client: openai.OpenAI, n: int) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="a", n=n, max_tokens=2)
