"""Reranking: ``POST /v1/rerank`` (and llama-server's aliases) on tiny generated Qwen3
rerankers (rank pooling, a ``yes``/``no`` head), with and without a rerank template, and by
the tiny generative model's judgement. Each score is checked against a numpy forward pass of
the same weights over the pair's tokens (the judgement's prompt)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from gguf import PoolingType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamarunner import Client, Server

from helpers import token_ids
from tinymodel import (
    RERANK_SEP,
    hidden_states,
    model_tensors,
    rerank_score,
    reranker_tensors,
    write_reranker_model,
    write_tiny_model,
)

QUERY = "cat"
DOCS = ["the cat", "a dog", "hello world", "the cat and the dog", "of"]
TEMPLATE = "<s>query:{query}<x0>document:{document}"
# llama.cpp computes in float32 with an f16 KV cache; the numpy pass in float64.
TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rerank")


@pytest.fixture(scope="module")
def reranker(model_dir: Path) -> Iterator[Server]:
    """No template: ``<s> query </s> <x0> document </s>``."""
    model = write_reranker_model(model_dir / "reranker.gguf")
    with Server(str(model), port=0, parallel=1, ctx_size=256, threads=2) as srv:
        yield srv


@pytest.fixture(scope="module")
def templated(model_dir: Path) -> Iterator[Server]:
    model = write_reranker_model(model_dir / "templated.gguf", template=TEMPLATE)
    with Server(str(model), port=0, parallel=1, ctx_size=256, threads=2) as srv:
        yield srv


def rerank(url: str, path: str = "/v1/rerank", **body: Any) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def test_scores_are_the_models_and_results_come_best_first(reranker: Server) -> None:
    r = rerank(reranker.url, model="reranker", query=QUERY, documents=DOCS)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "reranker"
    results = body["results"]
    assert sorted(x["index"] for x in results) == list(range(len(DOCS)))
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)
    tensors = reranker_tensors()
    query = token_ids(reranker.url, QUERY)
    want_tokens = 0
    for x in results:
        pair = [1, *query, 2, RERANK_SEP, *token_ids(reranker.url, DOCS[x["index"]]), 2]
        want_tokens += len(pair)
        assert x["relevance_score"] == pytest.approx(rerank_score(pair, tensors), abs=TOLERANCE)
        assert "document" not in x
    assert body["usage"] == {"prompt_tokens": want_tokens, "total_tokens": want_tokens}
    # The scores differ: a broken head (or the same hidden state for every pair) would not.
    assert len({round(s, 4) for s in scores}) > 1


def test_a_template_lays_out_the_pair(templated: Server) -> None:
    r = rerank(templated.url, query=QUERY, documents=DOCS[:3])
    assert r.status_code == 200, r.text
    tensors = reranker_tensors()
    for x in r.json()["results"]:
        text = TEMPLATE.replace("{query}", QUERY).replace("{document}", DOCS[x["index"]])
        # The template's control tokens are parsed; nothing is added.
        pair = token_ids(templated.url, text)
        assert pair[0] == 1 and RERANK_SEP in pair
        assert x["relevance_score"] == pytest.approx(rerank_score(pair, tensors), abs=TOLERANCE)


def test_a_score_does_not_depend_on_the_other_documents(reranker: Server) -> None:
    alone = rerank(reranker.url, query=QUERY, documents=[DOCS[3]]).json()["results"][0]
    among = rerank(reranker.url, query=QUERY, documents=DOCS).json()["results"]
    same = next(x for x in among if x["index"] == 3)
    assert same["relevance_score"] == pytest.approx(alone["relevance_score"], abs=1e-6)


def test_top_n_echo_and_every_alias_and_shape(reranker: Server) -> None:
    full = rerank(reranker.url, query=QUERY, documents=DOCS).json()["results"]
    for path in ("/v1/rerank", "/rerank", "/reranking", "/v1/reranking"):
        r = rerank(reranker.url, path, query=QUERY, documents=DOCS, top_n=2)
        assert r.status_code == 200, (path, r.text)
        assert r.json()["results"] == full[:2], path
    # Jina's objects and return_documents.
    r = rerank(
        reranker.url,
        query=QUERY,
        documents=[{"text": d} for d in DOCS],
        return_documents=True,
    )
    assert r.status_code == 200, r.text
    for x in r.json()["results"]:
        assert x["document"] == {"text": DOCS[x["index"]]}
    # TEI's shape: `texts` in, a bare array of index and score out.
    r = rerank(reranker.url, query=QUERY, texts=DOCS, return_text=True)
    assert r.status_code == 200, r.text
    tei = r.json()
    assert [x["index"] for x in tei] == [x["index"] for x in full]
    for x, y in zip(tei, full):
        assert x["score"] == pytest.approx(y["relevance_score"], abs=1e-6)
        assert x["text"] == DOCS[x["index"]]


def test_the_client_ranks(reranker: Server) -> None:
    with Client(reranker.url) as client:
        ranked = client.rerank(QUERY, DOCS, top_n=3)
    full = rerank(reranker.url, query=QUERY, documents=DOCS).json()["results"]
    assert [i for i, _ in ranked] == [x["index"] for x in full[:3]]
    assert [s for _, s in ranked] == pytest.approx([x["relevance_score"] for x in full[:3]])


def test_embeddings_of_a_reranker_are_refused(reranker: Server) -> None:
    r = httpx.post(f"{reranker.url}/v1/embeddings", json={"input": "cat"}, timeout=30)
    assert r.status_code == 400, r.text
    assert "reranker" in r.json()["error"]["message"]
    r = httpx.post(f"{reranker.url}/embedding", json={"content": "cat"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text


# What a generative model is asked (`requests/rerank.rs`: Qwen3-Reranker's prompt).
JUDGE_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".'
)
JUDGE_INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"


def judge_score(server: Server, query: str, document: str) -> float:
    """What the tiny generative model's judgement of ``document`` should score: asked through
    its chat template whether the document meets the query, its probability of yes against no
    at the answer, from a numpy forward pass of its weights. Its tokenizer opens all text with
    the bytes of SentencePiece's space marker, so the answers' first telling tokens are the
    bytes y, Y and n, N."""
    messages = [
        {"role": "system", "content": JUDGE_SYSTEM},
        {
            "role": "user",
            "content": f"<Instruct>: {JUDGE_INSTRUCT}\n<Query>: {query}\n<Document>: {document}",
        },
    ]
    body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}
    prompt = httpx.post(f"{server.url}/apply-template", json=body, timeout=30).json()["prompt"]
    tokens = token_ids(server.url, prompt, add_special=True)
    tensors = model_tensors()
    h = hidden_states(tokens, tensors)[-1]
    logits = tensors["output.weight"].astype(np.float64) @ h
    p = np.exp(logits - logits.max())
    yes = p[3 + ord("y")] + p[3 + ord("Y")]
    no = p[3 + ord("n")] + p[3 + ord("N")]
    return float(yes / (yes + no))


def test_a_generative_model_reranks_by_its_yes_against_its_no(tiny_server: Server) -> None:
    """A model that is no reranker (nor an embedding model) judges each document: its score
    is the model's probability of answering yes rather than no, best first, under every
    path and in both shapes."""
    r = rerank(tiny_server.url, query=QUERY, documents=DOCS)
    assert r.status_code == 200, r.text
    body = r.json()
    results = body["results"]
    assert sorted(x["index"] for x in results) == list(range(len(DOCS)))
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)
    for x in results:
        expected = judge_score(tiny_server, QUERY, DOCS[x["index"]])
        assert x["relevance_score"] == pytest.approx(expected, abs=TOLERANCE), x
    assert body["usage"]["prompt_tokens"] > sum(len(d) for d in DOCS)
    r = rerank(tiny_server.url, "/rerank", query=QUERY, texts=DOCS, top_n=2)
    assert r.status_code == 200, r.text
    assert [x["index"] for x in r.json()] == [x["index"] for x in results[:2]]
    # Too long for a slot: refused (a judgement has no end to cut), with llama-server's type.
    r = rerank(tiny_server.url, query=QUERY, documents=["the cat " * 400], truncate=True)
    assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error"


def test_a_reranker_under_another_pooling_is_refused(model_dir: Path) -> None:
    """``--pooling`` replaces a reranker's rank pooling, which its scores need: a 400."""
    model = model_dir / "reranker.gguf"
    if not model.exists():
        write_reranker_model(model)
    with Server(str(model), port=0, parallel=1, ctx_size=256, threads=2, pooling="mean") as srv:
        r = rerank(srv.url, query=QUERY, documents=DOCS)
        assert r.status_code == 400 and "--pooling" in r.json()["error"]["message"], r.text


def test_an_embedding_model_cannot_rerank(model_dir: Path) -> None:
    """A GGUF that names its pooling (an embedding model) neither pools by rank nor answers
    questions: a clear 400."""
    model = write_tiny_model(model_dir / "embedder.gguf", pooling=PoolingType.MEAN)
    with Server(str(model), port=0, parallel=1, ctx_size=256, threads=2) as srv:
        r = rerank(srv.url, query=QUERY, documents=DOCS)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "embedding model" in error["message"]
        assert error["type"] == "invalid_request_error"  # OpenAI's shape under /v1/
        r = rerank(srv.url, "/rerank", query=QUERY, documents=DOCS)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"documents": DOCS}, 400, "query"),
        ({"query": QUERY}, 400, "documents"),
        ({"query": QUERY, "documents": []}, 400, "non-empty"),
        ({"query": QUERY, "documents": DOCS, "texts": DOCS}, 400, "not both"),
        ({"query": QUERY, "documents": DOCS, "top_n": 0}, 400, "top_n"),
        ({"query": QUERY, "documents": DOCS, "top_n": -3}, 400, "top_n"),
        ({"query": 5, "documents": DOCS}, 400, "query"),
        ({"query": QUERY, "documents": [1, 2]}, 400, "documents"),
        ({"query": QUERY, "documents": ["x" * 4000]}, 400, "context"),
        ({"query": QUERY, "documents": ["ok"] * 2049}, 400, "2048"),
    ],
)
def test_bad_requests_are_clear_errors(
    reranker: Server, body: dict[str, Any], status: int, says: str
) -> None:
    r = rerank(reranker.url, **body)
    assert r.status_code == status, r.text
    assert says in r.json()["error"]["message"], r.text


def test_truncate_cuts_a_long_pair_instead(reranker: Server) -> None:
    long = "ab" * 200  # 400 byte tokens: past the 256-token slot
    r = rerank(reranker.url, query=QUERY, documents=[long, "of"])
    assert r.status_code == 400 and "context" in r.json()["error"]["message"], r.text
    r = rerank(reranker.url, query=QUERY, documents=[long, "of"], truncate=True)
    assert r.status_code == 200, r.text
    short = rerank(reranker.url, query=QUERY, documents=["of"]).json()["usage"]["prompt_tokens"]
    # The long pair is cut to the 256-token slot; the short one is whole.
    assert r.json()["usage"]["prompt_tokens"] == 256 + short


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    body=st.dictionaries(
        st.sampled_from(
            ["query", "documents", "texts", "top_n", "return_documents", "truncate", "model"]
        ),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-(2**63), 2**63),
            st.floats(allow_nan=False, allow_infinity=False),
            st.text(max_size=40),
            st.lists(st.one_of(st.text(max_size=30), st.integers()), max_size=5),
            st.lists(st.fixed_dictionaries({"text": st.text(max_size=20)}), max_size=3),
        ),
    )
)
def test_hostile_bodies_never_crash(reranker: Server, body: dict[str, Any]) -> None:
    r = httpx.post(f"{reranker.url}/v1/rerank", json=body, timeout=60)
    assert r.status_code in (200, 400, 404, 422), (r.status_code, r.text, body)
    assert httpx.get(f"{reranker.url}/health", timeout=10).status_code == 200


def test_the_router_routes_rerank_by_model(
    model_dir: Path, reranker: Server, tmp_path: Path
) -> None:
    """Through a server of many models: the reranker named by ``model`` answers with the scores
    it gives when served alone; a generative model named there judges."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "ranker.gguf").write_bytes((model_dir / "reranker.gguf").read_bytes())
    write_tiny_model(models / "writer.gguf")
    direct = rerank(reranker.url, query=QUERY, documents=DOCS).json()["results"]
    with Server(models_dir=models, port=0, ctx_size=1024, parallel=1) as srv:
        r = rerank(srv.url, model="ranker", query=QUERY, documents=DOCS)
        assert r.status_code == 200, r.text
        routed = r.json()["results"]
        assert [x["index"] for x in routed] == [x["index"] for x in direct]
        for x, y in zip(routed, direct):
            assert x["relevance_score"] == pytest.approx(y["relevance_score"], abs=1e-6)
        with srv.client() as client:
            assert client.rerank(QUERY, DOCS, top_n=1, model="ranker")[0][0] == direct[0]["index"]
        r = rerank(srv.url, model="writer", query=QUERY, documents=DOCS)
        assert r.status_code == 200 and len(r.json()["results"]) == len(DOCS), r.text
        r = rerank(srv.url, model="nobody", query=QUERY, documents=DOCS)
        assert r.status_code == 404, r.text
