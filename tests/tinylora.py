"""Random LoRA adapters in llama.cpp's GGUF form, for the tiny model and for any GGUF model.

llama.cpp (``src/llama-adapter.cpp``) requires of an adapter file: ``general.type`` =
``adapter``, ``general.architecture`` = the base model's, ``adapter.type`` = ``lora``, and
``adapter.lora.alpha``; then, for each adapted base tensor ``W`` (GGML shape ``[in, out]``,
numpy ``(out, in)``), ``<name>.lora_a`` of numpy shape ``(rank, in)`` and ``<name>.lora_b`` of
``(out, rank)``. At scale ``s`` the model computes with ``W + s * alpha / rank * B @ A``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter

from tinymodel import model_tensors, write_gguf

Pairs = dict[str, tuple[np.ndarray, np.ndarray]]


def write_adapter(path: Path, arch: str, pairs: Pairs, alpha: float) -> Path:
    """Writes the adapter ``pairs`` for a model of ``arch`` in llama.cpp's GGUF form: for each
    base tensor ``name`` (numpy shape (out, in)), ``(a, b)`` of shapes (rank, in) and (out,
    rank). llama.cpp adds ``alpha / rank * b @ a`` (times the adapter's scale) to the tensor."""
    w = GGUFWriter(str(path), arch)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    tensors = {}
    for name, (a, b) in pairs.items():
        tensors[f"{name}.lora_a"] = a.astype(np.float32)
        tensors[f"{name}.lora_b"] = b.astype(np.float32)
    return write_gguf(w, path, tensors)


def random_pairs(
    shapes: dict[str, tuple[int, int]], rank: int, seed: int, size: float = 0.5
) -> Pairs:
    """Random (A, B) for base tensors of numpy shapes ``(out, in)``; entries of A and B are
    normal with deviation ``size``."""
    rng = np.random.default_rng(seed)
    return {
        name: (
            (rng.standard_normal((rank, inp)) * size).astype(np.float32),
            (rng.standard_normal((out, rank)) * size).astype(np.float32),
        )
        for name, (out, inp) in shapes.items()
    }


def tiny_adapter(path: Path, names: list[str], seed: int, rank: int = 4) -> tuple[Path, Pairs]:
    """A random adapter for the tiny model (``tinymodel``) on the base tensors ``names``, with
    alpha = rank (so its update is ``scale * B @ A``); returns the file and its pairs."""
    base = model_tensors()
    pairs = random_pairs({n: base[n].shape for n in names}, rank, seed)
    return write_adapter(path, "llama", pairs, float(rank)), pairs


def merged_tensors(adapters: list[tuple[Pairs, float]], rank: int = 4) -> dict[str, np.ndarray]:
    """The tiny model's tensors with adapters merged in at their scales (alpha = rank): what
    llama.cpp must compute with those adapters applied."""
    tensors = dict(model_tensors())
    for pairs, scale in adapters:
        for name, (a, b) in pairs.items():
            tensors[name] = (tensors[name] + scale * (b @ a)).astype(np.float32)
    return tensors


def adapter_for_model(
    model: Path, path: Path, seed: int, rank: int = 8, layers: int | None = None
) -> Path:
    """A random adapter for any GGUF model, shaped from its tensors (read with ``gguf``): the
    attention query and value projections of its first ``layers`` blocks (all by default).
    Small entries, so the model is changed but not turned into noise."""
    reader = GGUFReader(str(model))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    shapes: dict[str, tuple[int, int]] = {}
    for t in reader.tensors:
        if not t.name.endswith((".attn_q.weight", ".attn_v.weight")):
            continue
        block = int(t.name.split(".")[1])
        if layers is not None and block >= layers:
            continue
        inp, out = (int(d) for d in t.shape[:2])  # GGML order: [in, out]
        shapes[t.name] = (out, inp)
    assert shapes, f"{model} has no attention projections to adapt"
    pairs = random_pairs(shapes, rank, seed, size=0.05)
    return write_adapter(path, arch, pairs, float(rank))
