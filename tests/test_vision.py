"""Images through a vision projector (``--mmproj``), end to end in the three dialects.

The server runs the tiny text model with the tiny projector of `tinyvision` (random weights:
the answers are arbitrary bytes; what is checked is that images are taken, counted, cached and
refused as the API says). One image is ``IMAGE_POSITIONS`` positions of the context.

- native ``POST /completion``: ``images: [{"id": N, "data": base64}]``, ``[img-N]`` tags in
  the prompt;
- OpenAI ``/v1/chat/completions``: ``image_url`` content parts with ``data:`` URLs;
- Ollama ``/api/generate`` (``images``) and ``/api/chat`` (a message's ``images``).

Every bad image is a 400 (native/OpenAI type or code ``invalid_image``, Ollama
``{"error": str}``) that leaves no slot busy; a server without a projector answers
``images_not_supported``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from llamarunner import ModelLoadError, Server

from helpers import assert_all_busy, complete, run_together, wait_idle
from tinymodel import write_tiny_model
from tinyvision import IMAGE_POSITIONS, b64, data_url, image_bytes, write_tiny_projector

MODEL = "tiny"
RED = image_bytes(colour=(220, 20, 40))
GREEN = image_bytes(colour=(20, 200, 60))
BLUE = image_bytes(colour=(10, 40, 230))
GREEDY = {"temperature": 0, "num_predict": 2}
# Bodies of 20 MiB images must reach the image check, not the body-size limit.
MAX_BODY = 64 * 1024 * 1024


@pytest.fixture(scope="module")
def projector(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_projector(tmp_path_factory.mktemp("vision") / "tiny-mmproj.gguf")


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory: pytest.TempPathFactory, projector: Path) -> Iterator[Server]:
    """The tiny model with the tiny projector, 2 slots of 512 tokens, alias "tiny"."""
    model = write_tiny_model(tmp_path_factory.mktemp("vision-model") / "tiny-model.gguf")
    with Server(
        str(model),
        port=0,
        parallel=2,
        ctx_size=512,
        threads=2,
        alias=MODEL,
        mmproj=str(projector),
        max_body=MAX_BODY,
    ) as srv:
        yield srv


# ---- request helpers ----


def native(url: str, prompt: str, *images: bytes, **options: Any) -> dict[str, Any]:
    """A native completion with ``images`` as ids 0, 1, ...; returns the final message."""
    body = {"images": [{"id": i, "data": b64(img)} for i, img in enumerate(images)]}
    _, final = complete(url, prompt, body, **{**GREEDY, **options})
    return final


def native_error(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    r = httpx.post(f"{url}/completion", json={"options": GREEDY, **body}, timeout=120)
    return r.status_code, r.json()


def chat_parts(text: str, *urls: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return parts


def openai_chat(url: str, content: Any, **extra: Any) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 2,
        "temperature": 0,
        **extra,
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def ollama_generate(url: str, prompt: str, images: list[Any], **extra: Any) -> httpx.Response:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "images": images,
        "stream": False,
        "options": GREEDY,
        **extra,
    }
    return httpx.post(f"{url}/api/generate", json=body, timeout=120)


def ollama_chat(url: str, content: str, images: list[Any]) -> httpx.Response:
    message = {"role": "user", "content": content, "images": images}
    body = {"model": MODEL, "messages": [message], "stream": False, "options": GREEDY}
    return httpx.post(f"{url}/api/chat", json=body, timeout=120)


def ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text[:500]
    return dict(r.json())


def prompt_tokens(url: str, text: str) -> int:
    """Tokens of ``text`` at the start of a prompt (BOS included)."""
    r = httpx.post(f"{url}/tokenize", json={"content": text, "add_special": True}, timeout=10)
    return len(r.json()["tokens"])


# ---- images are taken and counted ----


def test_native_images_count_their_positions(vision_server: Server) -> None:
    url = vision_server.url
    text = native(url, "hello world")
    one = native(url, "hello[img-0] world", RED)
    two = native(url, "hello[img-0][img-1] world", RED, GREEN)
    for final in (one, two):
        assert final["done"] and final["eval_count"] == 2, final
    # Two adjacent images against one: the same text, one image's positions more.
    assert two["prompt_eval_count"] - one["prompt_eval_count"] == IMAGE_POSITIONS, (one, two)
    assert one["prompt_eval_count"] >= text["prompt_eval_count"] + IMAGE_POSITIONS, (text, one)
    # Ids need not start at 0 nor follow the order of the tags.
    body = {
        "prompt": "hello[img-7][img-2] world",
        "images": [{"id": 2, "data": b64(GREEN)}, {"id": 7, "data": b64(RED)}],
    }
    _, again = complete(url, body.pop("prompt"), body, **GREEDY)
    assert again["prompt_eval_count"] == two["prompt_eval_count"], (two, again)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP"])
def test_every_format_is_an_image_of_the_same_size(vision_server: Server, fmt: str) -> None:
    url = vision_server.url
    png = native(url, "a[img-0] b", RED)
    other = native(url, "a[img-0] b", image_bytes(fmt, colour=(220, 20, 40)))
    assert other["prompt_eval_count"] == png["prompt_eval_count"], (png, other)


@pytest.mark.parametrize("size", [(1, 1), (1, 200), (200, 1), (4096, 4096)])
def test_extreme_shapes_are_images_of_the_same_size(
    vision_server: Server, size: tuple[int, int]
) -> None:
    """The projector resizes (and pads) every image to its own square input."""
    url = vision_server.url
    png = native(url, "a[img-0] b", RED)
    other = native(url, "a[img-0] b", image_bytes(size=size))
    assert other["prompt_eval_count"] == png["prompt_eval_count"], (png, other)


@pytest.mark.parametrize(
    "prompt", ["[img-0]", "hello [img-0]", "[img-0][img-1]"], ids=["only", "last", "two-only"]
)
def test_an_image_may_end_or_be_the_whole_prompt(vision_server: Server, prompt: str) -> None:
    """The text after the last image gives the logits; without any, the engine must still
    produce some (llama.cpp's own server fails an assert on this)."""
    images = (RED, GREEN)[: prompt.count("[img-")]
    final = native(vision_server.url, prompt, *images)
    assert final["done"] and final["eval_count"] == 2, final
    wait_idle(vision_server.url)


def test_openai_image_url_parts(vision_server: Server) -> None:
    url = vision_server.url
    text = ok(openai_chat(url, chat_parts("hello")))
    one = ok(openai_chat(url, chat_parts("hello", data_url(RED))))
    two = ok(openai_chat(url, chat_parts("hello", data_url(RED), data_url(GREEN))))
    assert isinstance(one["choices"][0]["message"]["content"], str)
    assert one["usage"]["completion_tokens"] == 2
    t0, t1, t2 = (r["usage"]["prompt_tokens"] for r in (text, one, two))
    assert t1 >= t0 + IMAGE_POSITIONS, (t0, t1)
    # A second image part costs its positions (and at most a separator between the parts).
    assert IMAGE_POSITIONS <= t2 - t1 <= IMAGE_POSITIONS + 4, (t1, t2)
    # Image-only content, and a media type that does not match the bytes (clients get it
    # wrong; the content decides).
    ok(openai_chat(url, [{"type": "image_url", "image_url": {"url": data_url(BLUE)}}]))
    ok(openai_chat(url, chat_parts("x", data_url(image_bytes("GIF"), "image/jpeg"))))
    # Streamed, the usage counts the image too.
    r = openai_chat(
        url,
        chat_parts("hello", data_url(RED)),
        stream=True,
        stream_options={"include_usage": True},
    )
    payloads = [line[5:].strip() for line in r.text.split("\n") if line.startswith("data:")]
    assert r.status_code == 200 and payloads[-1] == "[DONE]", r.text[-300:]
    assert json.loads(payloads[-2])["usage"]["prompt_tokens"] == t1, payloads[-2]


def test_ollama_generate_and_chat_take_images(vision_server: Server) -> None:
    url = vision_server.url
    g0 = ok(ollama_generate(url, "hello", []))
    g1 = ok(ollama_generate(url, "hello", [b64(RED)]))
    g2 = ok(ollama_generate(url, "hello", [b64(RED), b64(GREEN)]))
    assert g1["done"] and isinstance(g1["response"], str)
    assert g1["prompt_eval_count"] >= g0["prompt_eval_count"] + IMAGE_POSITIONS, (g0, g1)
    # Images without [img] tags go before the text, side by side.
    assert g2["prompt_eval_count"] - g1["prompt_eval_count"] == IMAGE_POSITIONS, (g1, g2)
    # Raw prompts with [img-N] tags name the images by index.
    raw = ok(ollama_generate(url, "a[img-1] b[img-0]", [b64(RED), b64(GREEN)], raw=True))
    assert raw["done"], raw
    c0 = ok(ollama_chat(url, "hello", []))
    c1 = ok(ollama_chat(url, "hello", [b64(RED)]))
    assert c1["message"]["role"] == "assistant"
    assert c1["prompt_eval_count"] >= c0["prompt_eval_count"] + IMAGE_POSITIONS, (c0, c1)
    # A prompt that is only an image.
    assert ok(ollama_generate(url, "", [b64(BLUE)]))["done"]


# ---- the prompt cache ----


def test_a_follow_up_with_the_same_image_reuses_its_cache(vision_server: Server) -> None:
    url = vision_server.url
    before_image = prompt_tokens(url, "what is")
    first = native(url, "what is[img-0] this picture", RED)
    follow = native(url, "what is[img-0] this picture? and now", RED)
    # The text before it, the image and the text after it come from the cache.
    assert follow["prompt_cached_count"] >= before_image + IMAGE_POSITIONS, (first, follow)
    assert follow["prompt_cached_count"] >= first["prompt_eval_count"] - 1, (first, follow)
    # The same pixels sent as lossless WebP are the same image.
    webp = native(url, "what is[img-0] this picture? and now", image_bytes("WEBP", (220, 20, 40)))
    assert webp["prompt_cached_count"] >= before_image + IMAGE_POSITIONS, webp
    # Another image at the same place: only the text before it can be reused.
    other = native(url, "what is[img-0] this picture? and now", BLUE)
    assert other["prompt_cached_count"] <= before_image, other
    assert other["prompt_eval_count"] == follow["prompt_eval_count"], (follow, other)


def test_openai_conversation_with_an_image_is_cached(vision_server: Server) -> None:
    url = vision_server.url
    turn = {"role": "user", "content": chat_parts("describe", data_url(GREEN))}
    ok(openai_chat(url, turn["content"]))
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "temperature": 0,
        "messages": [
            turn,
            {"role": "assistant", "content": "a picture"},
            {"role": "user", "content": "and more?"},
        ],
    }
    again = ok(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120))
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= IMAGE_POSITIONS + prompt_tokens(url, "describe"), again["usage"]
    body["messages"][0] = {"role": "user", "content": chat_parts("describe", data_url(BLUE))}
    other = ok(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120))
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] < cached, other["usage"]


# ---- refusals ----


def test_a_tag_naming_no_image_is_invalid_image(vision_server: Server) -> None:
    url = vision_server.url
    status, err = native_error(
        url, {"prompt": "hello [img-3]", "images": [{"id": 0, "data": b64(RED)}]}
    )
    assert status == 400 and err["error"]["type"] == "invalid_image", err
    assert "3" in err["error"]["message"], err
    for images in (
        [{"id": "zero", "data": b64(RED)}],
        [{"id": 0, "data": 12}],
        [{"id": 0}],
        [{"id": 0, "data": b64(RED)}, {"id": 0, "data": b64(GREEN)}],
    ):
        status, err = native_error(url, {"prompt": "hello [img-0]", "images": images})
        assert status == 400 and err["error"]["type"] in ("invalid_image", "invalid_request"), (
            images,
            err,
        )
    wait_idle(url)


def test_remote_image_urls_are_refused(vision_server: Server) -> None:
    url = vision_server.url
    for remote in ("http://example.com/cat.png", "https://example.com/cat.png", "file:///etc/x"):
        r = openai_chat(url, chat_parts("look", remote))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_image" and "data:" in err["message"], err
    wait_idle(url)


def bad_images() -> dict[str, list[str]]:
    """Named bad `images` lists (base64 strings)."""
    png = image_bytes()
    bomb = bytearray(png)
    bomb[16:24] = (100_000).to_bytes(4, "big") * 2  # IHDR width and height (CRC now wrong)
    return {
        "corrupt": [b64(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)],
        "truncated": [b64(png[: len(png) // 2])],
        "not-an-image": [b64(b"hello, world")],
        "bmp": [b64(image_bytes("BMP"))],
        "not-base64": ["this is not base64!"],
        "empty": [""],
        "bomb": [b64(bytes(bomb))],
        "too-many": [b64(RED)] * 17,
        # One side more than 200 times the other (requests/images.rs MAX_ASPECT_RATIO).
        "thin": [b64(image_bytes(size=(1, 201)))],
    }


BAD = bad_images()
OVERSIZE = b64(RED + bytes(20 * 1024 * 1024))


@pytest.mark.parametrize("case", [*sorted(BAD), "oversize"])
def test_bad_images_are_400s_that_leave_the_server_idle(vision_server: Server, case: str) -> None:
    url = vision_server.url
    images = [OVERSIZE] if case == "oversize" else BAD[case]
    tags = "".join(f"[img-{i}]" for i in range(len(images)))
    status, err = native_error(
        url,
        {"prompt": f"hello {tags}", "images": [{"id": i, "data": d} for i, d in enumerate(images)]},
    )
    assert status == 400 and err["error"]["type"] == "invalid_image", (case, err)
    r = openai_chat(url, chat_parts("hello", *(f"data:image/png;base64,{d}" for d in images)))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_image", (case, r.text)
    for r in (ollama_generate(url, "hello", images), ollama_chat(url, "hello", images)):
        assert r.status_code == 400, (case, r.text[:300])
        assert isinstance(r.json()["error"], str) and r.json()["error"], r.text[:300]
    wait_idle(url)
    assert native(url, "hello[img-0]", RED)["done"]


def test_wrong_image_field_types_are_400s(vision_server: Server) -> None:
    url = vision_server.url
    for images in (["not", 5], [None], "abc", {"0": "x"}, [[b64(RED)]]):
        r = ollama_generate(url, "hello", images)  # type: ignore[arg-type]
        assert r.status_code == 400, (images, r.text[:300])
    for part in (
        {"type": "image_url"},
        {"type": "image_url", "image_url": 5},
        {"type": "image_url", "image_url": {"url": 5}},
        {"type": "image_url", "image_url": {}},
    ):
        r = openai_chat(url, [{"type": "text", "text": "x"}, part])
        assert r.status_code == 400, (part, r.text[:300])
    wait_idle(url)


def test_a_long_prompt_with_an_image_is_truncated_or_refused(vision_server: Server) -> None:
    url = vision_server.url
    prompt = "hello [img-0] " + "the cat " * 300
    status, err = native_error(
        url,
        {"prompt": prompt, "images": [{"id": 0, "data": b64(RED)}], "truncate": False},
    )
    assert status == 400 and err["error"]["type"] == "context_length_exceeded", err
    r = httpx.post(
        f"{url}/completion",
        json={"prompt": prompt, "images": [{"id": 0, "data": b64(RED)}], "options": GREEDY},
        timeout=120,
    )
    assert r.status_code in (200, 400), r.text[:300]
    if r.status_code == 200:
        final = r.text.strip().split("\n")[-1]
        assert '"done":true' in final.replace(" ", "") and "error" not in final, final
    wait_idle(url)


def test_a_server_without_a_projector_refuses_images(tiny_server: Server) -> None:
    url = tiny_server.url
    status, err = native_error(
        url, {"prompt": "hello [img-0]", "images": [{"id": 0, "data": b64(RED)}]}
    )
    assert status == 400 and err["error"]["type"] == "images_not_supported", err
    r = openai_chat(url, chat_parts("hello", data_url(RED)))
    assert r.status_code == 400 and r.json()["error"]["code"] == "images_not_supported", r.text
    for r in (ollama_generate(url, "hello", [b64(RED)]), ollama_chat(url, "hello", [b64(RED)])):
        assert r.status_code == 400 and "mmproj" in r.json()["error"], r.text
    # Without images, [img-N] is plain text, as it always was.
    _, final = complete(url, "hello [img-0]", **GREEDY)
    assert final["done"]
    wait_idle(url)


@pytest.mark.parametrize("kind", ["missing", "not-gguf", "truncated", "text-model", "mismatched"])
def test_a_bad_projector_fails_the_load(tmp_path: Path, projector: Path, kind: str) -> None:
    """A projector that cannot be used fails the load with a reason naming it, as a bad model
    does (llama.cpp's own server exits on each of these); requests meanwhile get a 500."""
    model = write_tiny_model(tmp_path / "tiny-model.gguf")
    bad = tmp_path / "bad-mmproj.gguf"
    if kind == "not-gguf":
        bad.write_bytes(b"not a projector" * 20)
    elif kind == "truncated":
        bad.write_bytes(projector.read_bytes()[:100_000])
    elif kind == "text-model":
        bad = model
    elif kind == "mismatched":
        write_tiny_projector(bad, n_embd=32)  # the text model's embeddings are 64 wide
    if kind in ("missing", "not-gguf"):
        # Checked before anything starts.
        with pytest.raises(ModelLoadError, match="projector"):
            Server(str(model), port=0, threads=2, mmproj=str(bad)).start()
        return
    srv = Server(str(model), port=0, threads=2, mmproj=str(bad)).start()
    try:
        with pytest.raises(ModelLoadError, match="projector"):
            srv.wait_ready(timeout=60)
        r = httpx.post(f"{srv.url}/completion", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 500 and r.json()["error"]["type"] == "model_load_failed"
    finally:
        srv.stop()


# ---- several at once, and the official clients ----


def test_requests_with_and_without_images_run_side_by_side(vision_server: Server) -> None:
    url = vision_server.url
    long = {"temperature": 0, "num_predict": 256, "ignore_eos": True}
    bodies = [
        {"prompt": "look[img-0] here", "images": [{"id": 0, "data": b64(RED)}], "options": long},
        {"prompt": "just some text", "options": long},
    ]
    results, slots = run_together(url, bodies)
    assert_all_busy(slots, 2)
    assert all(final["eval_count"] == 256 for _, final in results), results

    def one(i: int) -> int:
        if i % 3 == 0:
            return native(url, f"picture {i}[img-0] of", (RED, BLUE)[i % 2])["eval_count"]
        if i % 3 == 1:
            usage = ok(openai_chat(url, chat_parts(f"text {i}", data_url(GREEN))))["usage"]
            return int(usage["completion_tokens"])
        return int(native(url, f"no image {i}")["eval_count"])

    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(one, range(9))) == [2] * 9
    wait_idle(url)


def test_the_official_clients_send_images(vision_server: Server, tmp_path: Path) -> None:
    with openai.OpenAI(
        base_url=f"{vision_server.url}/v1", api_key="unused", max_retries=0
    ) as client:
        r = client.chat.completions.create(
            model=MODEL,
            max_tokens=3,
            temperature=0,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": data_url(RED)}},
                    ],
                }
            ],
        )
        assert isinstance(r.choices[0].message.content, str)
        assert r.usage is not None and r.usage.prompt_tokens > IMAGE_POSITIONS
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=MODEL,
                max_tokens=3,
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "https://x/y"}}],
                    }
                ],
            )
        assert e.value.code == "invalid_image"
    client_o = ollama.Client(host=vision_server.url)
    path = tmp_path / "red.png"
    path.write_bytes(RED)
    g = client_o.generate(model=MODEL, prompt="what is this?", images=[RED], options=GREEDY)
    assert g.done and g.prompt_eval_count is not None and g.prompt_eval_count > IMAGE_POSITIONS
    c = client_o.chat(
        model=MODEL,
        messages=[{"role": "user", "content": "and this?", "images": [path]}],
        options=GREEDY,
    )
    assert c.message.role == "assistant" and c.done
    with pytest.raises(ollama.ResponseError) as oe:
        client_o.generate(model=MODEL, prompt="x", images=[b"not an image"], options=GREEDY)
    assert oe.value.status_code == 400
    wait_idle(vision_server.url)
