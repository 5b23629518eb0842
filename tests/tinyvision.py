"""A tiny random-weight vision projector GGUF (an "mmproj") for end-to-end image tests.

It pairs with the tiny text model of `tinymodel` (its projection output is that model's
embedding size, N_EMBD = 64) and is what llama.cpp's ``mtmd`` / ``clip`` loader reads for
LLaVA-1.5 style models: a CLIP ViT encoder plus the ``mlp`` projector. That projector type
needs the fewest tensors and the plainest preprocessing of the ones the loader accepts
(``tools/mtmd/clip.cpp``: ``load_hparams``, ``load_tensors``; graph ``models/llava.cpp``):

* preprocessing (``mtmd_image_preprocessor_fixed_size``, as there are no grid pinpoints): the
  RGB image is padded to a square with the colour (122, 116, 104) and resized to
  IMAGE_SIZE x IMAGE_SIZE, then normalised per channel with IMAGE_MEAN / IMAGE_STD;
* encoder: a PATCH_SIZE x PATCH_SIZE convolution turns it into (IMAGE_SIZE / PATCH_SIZE)^2
  patch vectors of VISION_EMBD dims, plus learned position embeddings; then VISION_LAYERS
  pre-norm transformer blocks (LayerNorm, attention, LayerNorm, GELU-quick FFN). LLaVA takes
  the output of the second-to-last block, so only VISION_LAYERS - 1 blocks run;
* projector: ``mm.0`` (VISION_EMBD -> PROJ_HIDDEN), GELU, ``mm.2`` (PROJ_HIDDEN -> N_EMBD):
  one text-model embedding per patch. There is no class token and the ``mlp`` projector adds
  no begin/end-of-image text, so an image is exactly IMAGE_POSITIONS positions of the text
  model's context (``clip_n_output_tokens`` for PROJECTOR_TYPE_MLP: the patch count).

Metadata keys (``clip.*``; ``vision`` is the modality prefix of the per-modality keys):

===========================================  =================================================
``general.architecture`` = ``clip``          what GGUFWriter records; the loader ignores it
``clip.projector_type`` = ``mlp``            selects the LLaVA graph and preprocessing
``clip.has_vision_encoder`` = true           the file has a vision tower (no audio one)
``clip.use_gelu`` = false                    the encoder FFN uses GELU-quick (the default)
``clip.vision.image_size``                   the square side the image is resized to (px)
``clip.vision.patch_size``                   the convolution's kernel and stride (px)
``clip.vision.embedding_length``             the encoder width (VISION_EMBD)
``clip.vision.feed_forward_length``          the encoder FFN width
``clip.vision.block_count``                  encoder blocks (VISION_LAYERS)
``clip.vision.attention.head_count``         attention heads of the encoder
``clip.vision.attention.layer_norm_epsilon`` LayerNorm epsilon
``clip.vision.projection_dim``               the output width (N_EMBD); required, not checked
``clip.vision.image_mean`` / ``image_std``   per-channel normalisation (CLIP's OpenAI values)
===========================================  =================================================

Tensors (numpy shapes, i.e. ggml's ``ne`` reversed; all f32):

* ``v.patch_embd.weight`` (VISION_EMBD, 3, PATCH_SIZE, PATCH_SIZE), ``v.patch_embd.bias``
  (VISION_EMBD,): the patch convolution;
* ``v.position_embd.weight`` (IMAGE_POSITIONS, VISION_EMBD): one learned vector per patch;
* per block ``v.blk.{i}.``: ``ln1`` / ``ln2`` ``.weight`` and ``.bias`` (VISION_EMBD,);
  ``attn_q`` / ``attn_k`` / ``attn_v`` / ``attn_out`` ``.weight`` (VISION_EMBD, VISION_EMBD)
  and ``.bias``; ``ffn_up.weight`` (VISION_FF, VISION_EMBD), ``ffn_down.weight``
  (VISION_EMBD, VISION_FF) and their biases;
* ``mm.0.weight`` (PROJ_HIDDEN, VISION_EMBD), ``mm.0.bias``; ``mm.2.weight``
  (N_EMBD, PROJ_HIDDEN), ``mm.2.bias``: the projector (``mm.2.weight``'s output width is what
  mtmd compares with the text model's embedding size).

The weights are random (seeded), so the text model's answer after an image is arbitrary
bytes, as it is after text; what tests can rely on is the position count and that equal
images give equal embeddings (the same seed and pixels give the same prompt cache).

`image_bytes`, `b64` and `data_url` make the test images the requests carry.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter
from PIL import Image

from tinymodel import N_EMBD, write_gguf

PROJECTOR_TYPE = "mlp"
IMAGE_SIZE = 28
PATCH_SIZE = 14
VISION_EMBD = 32
VISION_HEADS = 4
VISION_FF = 64
VISION_LAYERS = 2
PROJ_HIDDEN = 64
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)

# Text-model positions one image takes: one per patch (see the module docstring); checked
# against llama.cpp's own llama-server, whose prompt token count grows by exactly this much.
IMAGE_POSITIONS = (IMAGE_SIZE // PATCH_SIZE) ** 2


def projector_tensors(*, seed: int = 0, n_embd: int = N_EMBD) -> dict[str, np.ndarray]:
    """The projector's tensors by GGUF name, the same for the same arguments; ``n_embd`` is
    the output width (another value than the text model's makes a mismatched pair)."""
    rng = np.random.default_rng(seed)

    def rand(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    tensors = {
        "v.patch_embd.weight": rand(VISION_EMBD, 3, PATCH_SIZE, PATCH_SIZE),
        "v.patch_embd.bias": rand(VISION_EMBD),
        "v.position_embd.weight": rand(IMAGE_POSITIONS, VISION_EMBD),
    }
    for i in range(VISION_LAYERS):
        p = f"v.blk.{i}"
        for norm in ("ln1", "ln2"):
            tensors[f"{p}.{norm}.weight"] = ones(VISION_EMBD)
            tensors[f"{p}.{norm}.bias"] = rand(VISION_EMBD)
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensors[f"{p}.{proj}.weight"] = rand(VISION_EMBD, VISION_EMBD)
            tensors[f"{p}.{proj}.bias"] = rand(VISION_EMBD)
        tensors[f"{p}.ffn_up.weight"] = rand(VISION_FF, VISION_EMBD)
        tensors[f"{p}.ffn_up.bias"] = rand(VISION_FF)
        tensors[f"{p}.ffn_down.weight"] = rand(VISION_EMBD, VISION_FF)
        tensors[f"{p}.ffn_down.bias"] = rand(VISION_EMBD)
    tensors["mm.0.weight"] = rand(PROJ_HIDDEN, VISION_EMBD)
    tensors["mm.0.bias"] = rand(PROJ_HIDDEN)
    tensors["mm.2.weight"] = rand(n_embd, PROJ_HIDDEN, scale=0.5)
    tensors["mm.2.bias"] = rand(n_embd)
    return tensors


def write_tiny_projector(path: Path, *, seed: int = 0, n_embd: int = N_EMBD) -> Path:
    """Writes the tiny projector to ``path`` (about 170 KB) and returns ``path``; ``n_embd``
    as in `projector_tensors`."""
    w = GGUFWriter(str(path), "clip")
    w.add_name("tiny-test-projector")
    w.add_file_type(0)  # all f32
    w.add_string("clip.projector_type", PROJECTOR_TYPE)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", False)
    w.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    w.add_uint32("clip.vision.patch_size", PATCH_SIZE)
    w.add_uint32("clip.vision.embedding_length", VISION_EMBD)
    w.add_uint32("clip.vision.feed_forward_length", VISION_FF)
    w.add_uint32("clip.vision.block_count", VISION_LAYERS)
    w.add_uint32("clip.vision.attention.head_count", VISION_HEADS)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_uint32("clip.vision.projection_dim", n_embd)
    w.add_array("clip.vision.image_mean", list(IMAGE_MEAN))
    w.add_array("clip.vision.image_std", list(IMAGE_STD))
    return write_gguf(w, path, projector_tensors(seed=seed, n_embd=n_embd))


# ---- test images ----


def image_bytes(
    fmt: str = "PNG", colour: tuple[int, int, int] = (200, 30, 60), size: tuple[int, int] = (40, 30)
) -> bytes:
    """A one-colour image file in ``fmt`` (a Pillow format name: PNG, JPEG, GIF, WEBP, BMP).
    WebP is lossless, so equal colours give equal pixels in PNG and WebP."""
    out = io.BytesIO()
    options: dict[str, Any] = {"lossless": True} if fmt == "WEBP" else {}
    Image.new("RGB", size, colour).save(out, format=fmt, **options)
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{b64(data)}"
