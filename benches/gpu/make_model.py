"""Random-weight GGUF models of real shapes, with the standard library alone (the GPU machine
has no network, and maybe no numpy): what a GPU benchmark decodes costs the same whatever the
weights hold.

    python benches/gpu/make_model.py header TEMPLATE.gguf HEADER.bin
        # here: the template's metadata and tensor list (the default model's: 6.5 MB, most of
        # it the 262,144-token vocabulary), without its weights
    python benches/gpu/make_model.py like HEADER.bin OUT.gguf
        # there: a model of exactly the template's shape and tensor types, random weights
    python benches/gpu/make_model.py llama HEADER.bin OUT.gguf --type q4_k|q8_0
        # there: an 8B llama-shaped model (32 layers, 4096 wide, 14336 FFN, 32/8 heads) with
        # the template's tokenizer and chat template

Random bytes are valid quantized blocks once each block's scales are set to a small finite
half-precision value (a random f16 may be NaN or infinite); F32 and F16 tensors get small
values. Only the block types of llama.cpp's common quantizations are known here (F32, F16,
Q8_0, Q5_0, Q4_0, Q4_K, Q5_K, Q6_K); a template with another type is refused.
"""

from __future__ import annotations

import argparse
import os
import random
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

GGUF_MAGIC = b"GGUF"
ALIGNMENT = 32

# ggml type id: (name, elements per block, bytes per block, offsets of f16 scales in a block).
TYPES: dict[int, tuple[str, int, int, tuple[int, ...]]] = {
    0: ("F32", 1, 4, ()),
    1: ("F16", 1, 2, ()),
    2: ("Q4_0", 32, 18, (0,)),
    6: ("Q5_0", 32, 22, (0,)),
    8: ("Q8_0", 32, 34, (0,)),
    12: ("Q4_K", 256, 144, (0, 2)),
    13: ("Q5_K", 256, 176, (0, 2)),
    14: ("Q6_K", 256, 210, (208,)),
}
BY_NAME = {v[0].lower(): k for k, v in TYPES.items()}

# GGUF metadata value types.
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALAR = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?"}
SCALAR.update({U64: "Q", I64: "q", F64: "d"})


@dataclass
class Tensor:
    name: str
    dims: list[int]
    type: int

    @property
    def n_bytes(self) -> int:
        _, per_block, block_bytes, _ = TYPES[self.type]
        n = 1
        for d in self.dims:
            n *= d
        if n % per_block:
            raise ValueError(f"{self.name}: {n} elements is not a whole number of blocks")
        return n // per_block * block_bytes


class Reader:
    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def take(self, fmt: str) -> int | float | bool:
        size = struct.calcsize("<" + fmt)
        value: int | float | bool = struct.unpack("<" + fmt, self.f.read(size))[0]
        return value

    def string(self) -> bytes:
        n = int(self.take("Q"))
        return self.f.read(n)

    def value_bytes(self, kind: int) -> bytes:
        """The raw bytes of one value of `kind` (as written, to copy it)."""
        if kind in SCALAR:
            return self.f.read(struct.calcsize("<" + SCALAR[kind]))
        if kind == STRING:
            s = self.string()
            return struct.pack("<Q", len(s)) + s
        if kind == ARRAY:
            item = int(self.take("I"))
            n = int(self.take("Q"))
            if item in SCALAR:
                body = self.f.read(n * struct.calcsize("<" + SCALAR[item]))
            else:
                body = b"".join(self.value_bytes(item) for _ in range(n))
            return struct.pack("<IQ", item, n) + body
        raise ValueError(f"unknown GGUF value type {kind}")


def read_header(f: BinaryIO) -> tuple[list[tuple[bytes, int, bytes]], list[Tensor]]:
    """The metadata (key, type, raw value) and the tensors of a GGUF file, left at the end of
    its tensor list."""
    if f.read(4) != GGUF_MAGIC:
        raise ValueError("not a GGUF file")
    r = Reader(f)
    version = r.take("I")
    if version != 3:
        raise ValueError(f"GGUF version {version}; this reads version 3")
    n_tensors, n_kv = int(r.take("Q")), int(r.take("Q"))
    kvs = []
    for _ in range(n_kv):
        key = r.string()
        kind = int(r.take("I"))
        kvs.append((key, kind, r.value_bytes(kind)))
    tensors = []
    for _ in range(n_tensors):
        name = r.string().decode()
        dims = [int(r.take("Q")) for _ in range(int(r.take("I")))]
        kind = int(r.take("I"))
        r.take("Q")  # its offset: recomputed when written
        if kind not in TYPES:
            raise ValueError(f"{name}: ggml type {kind} is not one this writes")
        tensors.append(Tensor(name, dims, kind))
    return kvs, tensors


def kv_string(key: str, value: str) -> tuple[bytes, int, bytes]:
    v = value.encode()
    return key.encode(), STRING, struct.pack("<Q", len(v)) + v


def kv_scalar(key: str, kind: int, value: float) -> tuple[bytes, int, bytes]:
    return key.encode(), kind, struct.pack("<" + SCALAR[kind], value)


def fill(tensor: Tensor, rng: random.Random) -> bytes:
    """Random weights of `tensor`: random bytes with every f16 scale set to a small value."""
    name, _, block_bytes, scales = TYPES[tensor.type]
    n = tensor.n_bytes
    if name == "F32":
        count = n // 4
        if tensor.name.endswith("norm.weight"):
            return struct.pack(f"<{count}f", *([1.0] * count))
        return struct.pack(f"<{count}f", *(rng.uniform(-0.05, 0.05) for _ in range(count)))
    # 4 MiB of random bytes, repeated (randbytes takes at most 2**31 bits at once; what the
    # weights repeat does not change what a decode costs).
    chunk = rng.randbytes(min(n, 4 << 20))
    data = bytearray(chunk * (n // len(chunk)) + chunk[: n % len(chunk)])
    if name == "F16":
        # Each value's high byte: sign, exponent 0b01010 or 0b01011 (|x| around 0.03-0.06).
        data[1::2] = bytes((b & 0x83) | 0x28 for b in data[1::2])
        return bytes(data)
    blocks = n // block_bytes
    # 0x1400: 2^-10, a scale that keeps products of random quants in range.
    for off in scales:
        data[off::block_bytes] = b"\x00" * blocks
        data[off + 1 :: block_bytes] = b"\x14" * blocks
    return bytes(data)


def write(
    path: Path, kvs: list[tuple[bytes, int, bytes]], tensors: list[Tensor], seed: int
) -> None:
    rng = random.Random(seed)
    with open(path, "wb") as f:
        f.write(GGUF_MAGIC + struct.pack("<IQQ", 3, len(tensors), len(kvs)))
        for key, kind, raw in kvs:
            f.write(struct.pack("<Q", len(key)) + key + struct.pack("<I", kind) + raw)
        offset = 0
        for t in tensors:
            name = t.name.encode()
            f.write(struct.pack("<Q", len(name)) + name + struct.pack("<I", len(t.dims)))
            f.write(struct.pack(f"<{len(t.dims)}Q", *t.dims) + struct.pack("<IQ", t.type, offset))
            offset += -(-t.n_bytes // ALIGNMENT) * ALIGNMENT
        f.write(b"\x00" * (-f.tell() % ALIGNMENT))
        for t in tensors:
            data = fill(t, rng)
            f.write(data + b"\x00" * (-len(data) % ALIGNMENT))


def llama_8b(
    template: list[tuple[bytes, int, bytes]], kind: int, layers: int = 32
) -> tuple[list[tuple[bytes, int, bytes]], list[Tensor]]:
    """Llama 3 8B's shape (with the template's vocabulary), every matrix of type `kind`."""
    tokenizer = [kv for kv in template if kv[0].startswith(b"tokenizer.")]
    n_vocab = next(
        struct.unpack("<Q", raw[4:12])[0]
        for key, _, raw in tokenizer
        if key == b"tokenizer.ggml.tokens"
    )
    width, ffn, heads, kv_heads = 4096, 14336, 32, 8
    kvs = [
        kv_string("general.architecture", "llama"),
        kv_string("general.name", "random llama 8B"),
        kv_scalar("llama.block_count", U32, layers),
        kv_scalar("llama.context_length", U32, 8192),
        kv_scalar("llama.embedding_length", U32, width),
        kv_scalar("llama.feed_forward_length", U32, ffn),
        kv_scalar("llama.attention.head_count", U32, heads),
        kv_scalar("llama.attention.head_count_kv", U32, kv_heads),
        kv_scalar("llama.rope.freq_base", F32, 500000.0),
        kv_scalar("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
        kv_scalar("llama.vocab_size", U32, n_vocab),
        kv_scalar("general.file_type", U32, {8: 7, 12: 15}.get(kind, 0)),
        *tokenizer,
    ]
    kv_width = width // heads * kv_heads
    tensors = [Tensor("token_embd.weight", [width, n_vocab], kind)]
    for i in range(layers):
        b = f"blk.{i}."
        tensors += [
            Tensor(b + "attn_norm.weight", [width], 0),
            Tensor(b + "attn_q.weight", [width, width], kind),
            Tensor(b + "attn_k.weight", [width, kv_width], kind),
            Tensor(b + "attn_v.weight", [width, kv_width], kind),
            Tensor(b + "attn_output.weight", [width, width], kind),
            Tensor(b + "ffn_norm.weight", [width], 0),
            Tensor(b + "ffn_gate.weight", [width, ffn], kind),
            Tensor(b + "ffn_up.weight", [width, ffn], kind),
            Tensor(b + "ffn_down.weight", [ffn, width], kind),
        ]
    tensors += [
        Tensor("output_norm.weight", [width], 0),
        Tensor("output.weight", [width, n_vocab], kind),
    ]
    return kvs, tensors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("header", help="the template's metadata and tensor list")
    h.add_argument("template")
    h.add_argument("out")
    like = sub.add_parser("like", help="random weights of the header's shape")
    like.add_argument("header")
    like.add_argument("out")
    ll = sub.add_parser("llama", help="an 8B llama-shaped model with the header's tokenizer")
    ll.add_argument("header")
    ll.add_argument("out")
    ll.add_argument("--type", choices=["q4_k", "q8_0"], default="q4_k")
    ll.add_argument("--layers", type=int, default=32, help="fewer for a dry run")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if args.cmd == "header":
        with open(args.template, "rb") as f:
            read_header(f)
            end = f.tell()
            f.seek(0)
            Path(args.out).write_bytes(f.read(end))
        print(f"{args.out}: {end:,} bytes", file=sys.stderr)
        return 0
    with open(args.header, "rb") as f:
        kvs, tensors = read_header(f)
    for key, _, raw in kvs:
        if key == b"general.alignment" and struct.unpack("<I", raw[:4])[0] != ALIGNMENT:
            raise SystemExit(f"the template's alignment is not {ALIGNMENT}")
    if args.cmd == "llama":
        kvs, tensors = llama_8b(kvs, BY_NAME[args.type], args.layers)
    out = Path(args.out)
    write(out, kvs, tensors, args.seed)
    print(f"{out}: {os.path.getsize(out) / 2**30:.2f} GiB, {len(tensors)} tensors", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
