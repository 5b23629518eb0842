"""What an image costs through a vision projector (``--mmproj``), beside text, and what the
prefix cache saves on a follow-up turn about the same image.

    python -m benches.vision                       # both fixtures, ours only
    python -m benches.vision --peer ~/.cache/llamarunner/peer/build/bin/llama-server

Fixtures (random weights: timing only, no meaning):

- ``tiny``: the tests' tiny text model (64-dim llama) with their tiny projector
  (``tests/tinyvision.py``: 28 px, 4 positions per image);
- ``gemma-270m + 224px``: the default model (Gemma 3 270M Q4_K_M) with a projector of the same
  LLaVA (``mlp``) layout written by the same writer at a realistic input size: 224 px images,
  patch 14, so 256 positions per image, a 256-wide 4-block ViT, output 640 (the model's
  embedding width).

For each fixture and server, ``--requests`` times each (a different prompt or image every
time, so nothing is reused unless the row says so): a text prompt as long as the image prompt
(prompt tokens/s), a prompt with one image, and the same image prompt again (the image cached).
"image ms" is the image prompt's time less its text tokens at the text rate: encoding plus
decoding the image's positions; "encode ms" is that less the positions at the text rate.
Times are the servers' own (``prompt_eval_duration`` for llamarunner, ``timings.prompt_ms``
for llama-server), medians over the requests.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import io
import json
import os
import random
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from benches.load import Running, llama_server, text
from benches.load import ours as load_ours

TESTS = Path(__file__).resolve().parent.parent / "tests"


def _tests_import() -> None:
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))


def write_projector(path: Path, n_embd: int, *, size: int, embd: int, layers: int) -> Path:
    """A random ``mlp`` projector from ``tests/tinyvision.py``'s writer, at another size: its
    layout constants are set for the call and put back."""
    _tests_import()
    import tinyvision

    saved = {
        k: getattr(tinyvision, k)
        for k in (
            "IMAGE_SIZE",
            "VISION_EMBD",
            "VISION_FF",
            "VISION_LAYERS",
            "PROJ_HIDDEN",
            "IMAGE_POSITIONS",
        )
    }
    try:
        tinyvision.IMAGE_SIZE = size
        tinyvision.VISION_EMBD = embd
        tinyvision.VISION_FF = 4 * embd
        tinyvision.VISION_LAYERS = layers
        tinyvision.PROJ_HIDDEN = n_embd
        tinyvision.IMAGE_POSITIONS = (size // tinyvision.PATCH_SIZE) ** 2
        return tinyvision.write_tiny_projector(path, n_embd=n_embd)
    finally:
        for k, v in saved.items():
            setattr(tinyvision, k, v)


def random_png(seed: int, size: int = 64) -> str:
    """A noisy RGB image (base64 PNG), different for every seed."""
    from PIL import Image

    rng = random.Random(seed)
    img = Image.frombytes(
        "RGB", (size, size), bytes(rng.randrange(256) for _ in range(size * size * 3))
    )
    out = io.BytesIO()
    img.save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode("ascii")


@contextmanager
def ours(model: str, mmproj: str, threads: int) -> Iterator[Running]:
    with load_ours(model, 1, 2048, threads, ("--mmproj", mmproj)) as r:
        yield dataclasses.replace(r, name="llamarunner")


@contextmanager
def peer(binary: str, model: str, mmproj: str, threads: int) -> Iterator[Running]:
    # llama-server draws a random image marker per process unless this pins it.
    os.environ["LLAMA_MEDIA_MARKER"] = "<__media__>"
    extra = ("--mmproj", mmproj, "--no-warmup")
    with llama_server(binary, model, 1, 2048, threads, extra) as r:
        yield dataclasses.replace(r, name="llama-server")


def prompt_ms(server: Running, prompt: str, image: str | None) -> tuple[float, int, int]:
    """(prompt ms, prompt positions, cached positions) of one request generating one token."""
    if server.name.startswith("llamarunner"):
        body: dict[str, Any] = {
            "prompt": prompt.replace("<__media__>", "[img-0]"),
            "options": {"num_predict": 1, "temperature": 0},
        }
        if image is not None:
            body["images"] = [{"id": 0, "data": image}]
        r = httpx.post(f"{server.url}/completion", json=body, timeout=600)
        r.raise_for_status()
        final = [line for line in r.text.splitlines() if line.strip()][-1]
        f = json.loads(final)
        return (
            f["prompt_eval_duration"] / 1e6,
            f["prompt_eval_count"],
            f.get("prompt_cached_count", 0),
        )
    content: Any = (
        prompt if image is None else {"prompt_string": prompt, "multimodal_data": [image]}
    )
    r = httpx.post(
        f"{server.url}/completion",
        json={
            "prompt": content,
            "n_predict": 1,
            "temperature": 0,
            "cache_prompt": True,
            # The tiny model's random bytes are not valid text for llama-server's answer.
            "grammar": 'root ::= "a"',
        },
        timeout=600,
    )
    r.raise_for_status()
    t = r.json()["timings"]
    cached = r.json().get("tokens_cached", 0)
    return t["prompt_ms"], t["prompt_n"], cached


def measure(server: Running, fixture: str, requests: int, positions: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    head = "Describe this picture in detail, please: <__media__> What is in it?"
    text_words = max(8, positions)  # about as many tokens as the image prompt
    texts, images, repeats = [], [], []
    for i in range(requests):
        t = text(rng, text_words)
        texts.append(prompt_ms(server, t, None))
        img = random_png(seed * 1000 + i)
        prompt = f"{i}: {head}"
        images.append(prompt_ms(server, prompt, img))
        repeats.append(prompt_ms(server, prompt, img))
    text_rate = statistics.median(n / ms for ms, n, _ in texts)  # tokens per ms
    img_ms = statistics.median(ms for ms, _, _ in images)
    img_n = statistics.median(n for _, n, _ in images)
    text_part = max(img_n - positions, 0)
    image_cost = img_ms - text_part / text_rate
    encode = image_cost - positions / text_rate
    again_ms = statistics.median(ms for ms, _, _ in repeats)
    again_cached = statistics.median(c for _, _, c in repeats)
    return [
        server.name,
        fixture,
        str(positions),
        f"{text_rate * 1000:.0f}",
        f"{img_ms:.1f}",
        f"{img_n / img_ms * 1000:.0f}",
        f"{image_cost:.1f}",
        f"{encode:.1f}",
        f"{again_ms:.1f} ({again_cached:.0f} cached)",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--peer", help="llama-server binary of the same llama.cpp, run side by side")
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=["tiny", "gemma"], help="one fixture")
    args = ap.parse_args(argv)
    _tests_import()
    from llamarunner import default_model_path

    import tinymodel
    import tinyvision

    header = [
        "server",
        "fixture",
        "image positions",
        "text prompt tok/s",
        "image prompt ms",
        "image prompt tok/s",
        "image ms (encode+decode)",
        "encode ms",
        "same image again ms",
    ]
    rows: list[list[str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        fixtures = []
        if args.only in (None, "tiny"):
            model = tinymodel.write_tiny_model(d / "tiny.gguf")
            fixtures.append(
                (
                    "tiny",
                    str(model),
                    str(tinyvision.write_tiny_projector(d / "tiny-mmproj.gguf")),
                    tinyvision.IMAGE_POSITIONS,
                )
            )
        if args.only in (None, "gemma"):
            proj = write_projector(d / "gemma-mmproj.gguf", 640, size=224, embd=256, layers=4)
            fixtures.append(
                ("gemma-270m + 224px", str(default_model_path()), str(proj), (224 // 14) ** 2)
            )
        for name, model_path, mmproj, positions in fixtures:
            with ours(model_path, mmproj, args.threads) as server:
                rows.append(measure(server, name, args.requests, positions, seed=1))
            if args.peer:
                with peer(args.peer, model_path, mmproj, args.threads) as server:
                    rows.append(measure(server, name, args.requests, positions, seed=1))
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
