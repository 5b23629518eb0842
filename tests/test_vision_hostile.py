"""Hostile images on the routes that take them (property-based, hypothesis).

A server with the tiny projector (`tinyvision`) gets random image payloads: random bytes,
valid PNG/JPEG/GIF/WebP files with random mutations (bytes changed, cut, junk inserted, header
fields at extremes), random base64 text, ``data:`` URLs with random media types, remote URLs;
in random request shapes: ``images`` lists of random values on ``/api/generate``,
``/api/chat`` and native ``/completion`` (with random ``[img-N]`` tags), random content parts
on ``/v1/chat/completions``. Every answer must be a 200 that ends properly or a 400 in the
dialect's error shape: never a 5xx, a hang (``test_hostile.REQUEST_TIMEOUT``) or a crash.
After each route's run the server has no busy slot and still answers an image request.

The server runs in a subprocess (``llamarunner serve``, watched: see `helpers.WatchedServer`)
so that a crash in the projector fails a test instead of killing pytest.

``LLAMARUNNER_HOSTILE_EXAMPLES`` sets the examples per route (default 120, as test_hostile).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_hostile import HSETTINGS, MODEL, REQUEST_TIMEOUT, assert_good, exchange

from helpers import WatchedServer, wait_idle
from tinymodel import write_tiny_model
from tinyvision import b64, image_bytes, write_tiny_projector

pytestmark = pytest.mark.timeout(900)

VALID_FILES = [
    image_bytes(fmt, colour=(40 * i, 255 - 40 * i, 90), size=(8 + 5 * i, 9))
    for i, fmt in enumerate(["PNG", "JPEG", "GIF", "WEBP"])
]
B64_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="
MEDIA_TYPES = st.sampled_from(
    ["image/png", "image/jpeg", "image/gif", "image/webp", "IMAGE/PNG", "text/plain", "", "image/"]
)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid image file with a few random mutations."""
    data = bytearray(draw(st.sampled_from(VALID_FILES)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["set", "cut", "insert", "extreme"]))
        at = draw(st.integers(0, len(data) - 1)) if data else 0
        if op == "set" and data:
            data[at] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[at:]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=40))
        elif data:
            # A header field (sizes, depths, counts) at 0 or all ones.
            at = draw(st.integers(0, min(len(data), 40) - 1))
            data[at] = draw(st.sampled_from([0, 0xFF]))
    return bytes(data)


FILES = st.one_of(st.sampled_from(VALID_FILES), mutated(), st.binary(max_size=200))
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64),
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
BASE64_TEXT = st.one_of(
    FILES.map(b64),
    FILES.map(b64).map(lambda s: "\n".join(s[i : i + 60] for i in range(0, len(s), 60))),
    st.text(alphabet=B64_ALPHABET + " \n\t-_:;,.%", max_size=120),
    st.text(max_size=40),
    st.builds(lambda m, f: f"data:{m};base64,{b64(f)}", MEDIA_TYPES, FILES),
)
URLS = st.one_of(
    st.builds(lambda m, f: f"data:{m};base64,{b64(f)}", MEDIA_TYPES, FILES),
    st.builds(lambda f: f"data:image/png,{b64(f)}", FILES),
    st.sampled_from(
        [
            "http://127.0.0.1:1/x.png",
            "https://example.com/cat.jpg",
            "file:///etc/passwd",
            "data:",
            "data:image/png;base64,",
            "",
        ]
    ),
    st.text(max_size=60),
)


def image_list(item: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    """Mostly a few images, sometimes more than a request may carry."""
    return st.one_of(
        st.lists(item, max_size=4),
        st.lists(item, min_size=15, max_size=18),
    )


PROMPT_PIECES = st.one_of(
    st.sampled_from(["hello", " the cat", "[img]", "[img-0]", "[img-1]", "[img-", "]", " "]),
    st.integers(-3, 20).map(lambda n: f"[img-{n}]"),
    st.sampled_from(["[img-99999999999999999999]", "[img--1]", "[img-1a]"]),
    st.text(max_size=8),
)
PROMPTS = st.lists(PROMPT_PIECES, max_size=6).map("".join)
OPTIONS = st.fixed_dictionaries({"num_predict": st.integers(0, 3), "temperature": st.just(0)})


@st.composite
def native_bodies(draw: st.DrawFn) -> dict[str, Any]:
    entry = st.one_of(
        st.fixed_dictionaries({"id": st.integers(-2, 20), "data": BASE64_TEXT}),
        st.fixed_dictionaries({"id": JUNK, "data": st.one_of(BASE64_TEXT, JUNK)}),
        JUNK,
    )
    body: dict[str, Any] = {"prompt": draw(PROMPTS), "options": draw(OPTIONS)}
    images = draw(st.one_of(image_list(entry), JUNK))
    if images is not None:
        body["images"] = images
    return body


@st.composite
def generate_bodies(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": draw(PROMPTS),
        "images": draw(st.one_of(image_list(st.one_of(BASE64_TEXT, JUNK)), JUNK)),
        "raw": draw(st.booleans()),
        "stream": draw(st.booleans()),
        "options": draw(OPTIONS),
    }


@st.composite
def ollama_chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    messages = draw(
        st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "assistant", "system"]),
                    "content": PROMPTS,
                    "images": st.one_of(image_list(BASE64_TEXT), JUNK),
                }
            ),
            min_size=1,
            max_size=3,
        )
    )
    return {
        "model": MODEL,
        "messages": messages,
        "stream": draw(st.booleans()),
        "options": draw(OPTIONS),
    }


CONTENT_PARTS = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": PROMPTS}),
    st.fixed_dictionaries(
        {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": URLS})}
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("image_url"),
            "image_url": st.fixed_dictionaries(
                {"url": st.one_of(URLS, JUNK), "detail": st.one_of(st.text(max_size=5), JUNK)}
            ),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["image_url", "image", "input_image", "text", ""]), "x": JUNK}
    ),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.one_of(URLS, JUNK)}),
    JUNK,
)


@st.composite
def openai_bodies(draw: st.DrawFn) -> dict[str, Any]:
    content = draw(st.one_of(st.lists(CONTENT_PARTS, max_size=5), image_list(CONTENT_PARTS)))
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": draw(st.integers(1, 3)),
        "temperature": 0,
        "stream": draw(st.booleans()),
    }


ROUTES = {
    "/completion": native_bodies(),
    "/api/generate": generate_bodies(),
    "/api/chat": ollama_chat_bodies(),
    "/v1/chat/completions": openai_bodies(),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WatchedServer]:
    d = tmp_path_factory.mktemp("vision-hostile")
    model = write_tiny_model(d / "tiny-model.gguf")
    projector = write_tiny_projector(d / "tiny-mmproj.gguf")
    flags = ("--parallel", "2", "--ctx-size", "256", "--alias", MODEL, "--mmproj", str(projector))
    srv = WatchedServer(model, d, *flags)
    yield srv
    srv.stop()


def still_serves_images(srv: WatchedServer) -> None:
    wait_idle(srv.url)
    body = {
        "prompt": "a[img-0] b",
        "images": [{"id": 0, "data": b64(VALID_FILES[0])}],
        "options": {"num_predict": 2, "temperature": 0},
    }
    r = httpx.post(f"{srv.url}/completion", json=body, timeout=REQUEST_TIMEOUT)
    assert r.status_code == 200, r.text[:300]
    assert '"done":true' in r.text.replace(" ", ""), r.text[-300:]


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_hostile_images(server: WatchedServer, path: str) -> None:
    assert server.alive(), server.describe()
    statuses: dict[int, int] = {}
    with httpx.Client() as client:

        @HSETTINGS
        @given(request=ROUTES[path])
        def one(request: dict[str, Any]) -> None:
            body = json.dumps(request).encode()
            reply = exchange(client, server, "POST", path, body)
            statuses[reply.status] = statuses.get(reply.status, 0) + 1
            assert reply.status in (200, 400), (reply.status, reply.body[:300])
            assert_good(path, body, reply)

        one()
    print(f"{path}: {dict(sorted(statuses.items()))}")
    # The generator reached both outcomes: valid images were served, bad ones refused.
    assert statuses.get(200) and statuses.get(400), statuses
    still_serves_images(server)


def test_tag_heavy_messages_are_refused_before_placement(server: WatchedServer) -> None:
    """Image tags are counted before anything is placed or copied: a native prompt naming one
    image by more tags than a request may place, and an Ollama message with more images than
    a request may have (and a text of 10,000 ``[img]`` tags), are 400s."""
    image = b64(VALID_FILES[0])
    for path, body in [
        (
            "/completion",
            {"prompt": "[img-0]" * 17, "images": [{"id": 0, "data": image}]},
        ),
        (
            "/api/chat",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "[img]" * 10_000, "images": [""] * 17}],
            },
        ),
    ]:
        r = httpx.post(f"{server.url}{path}", json=body, timeout=REQUEST_TIMEOUT)
        assert r.status_code == 400, r.text[:300]
        assert "at most 16 images" in r.text, r.text[:300]
    still_serves_images(server)
