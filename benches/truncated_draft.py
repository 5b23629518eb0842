"""A draft model for the default model, made by cutting it short: the first ``k`` of its
transformer blocks, with the same embeddings, output norm and vocabulary (so it passes the
vocabulary check of ``--draft-model``). There is no smaller Gemma 3 with Gemma 3 270M's
vocabulary; this is the cheapest stand-in. Written to a cache directory, never committed.

    python -m benches.truncated_draft [--blocks K] [--model PATH] [--out PATH]

Prints the path written. The file is rewritten only when missing. Measured on greedy text
(``--draft-always``, 100 tokens): cut after 3, 6 or 9 blocks its drafts were never accepted;
after 12, about 60 % of them; after 14, about 55-60 %. Note what it can and cannot show: with
a 262,144-token vocabulary the output projection (640 x 262,144) is most of the cost of a
270M model's token, and a truncated copy keeps all of it, so each drafted token costs a good
part of a full token; and a model cut after k of 18 blocks predicts the full model's next
token only where the text is easy.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import gguf


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llamarunner" / "bench-models"


def truncate(src: Path, dst: Path, blocks: int) -> Path:
    """Writes ``src`` with only its first ``blocks`` transformer blocks to ``dst``."""
    reader = gguf.GGUFReader(str(src))
    arch_field = reader.fields[gguf.Keys.General.ARCHITECTURE]
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
    count_key = f"{arch}.block_count"
    total = int(reader.fields[count_key].contents())
    if not 1 <= blocks <= total:
        raise SystemExit(f"--blocks must be between 1 and {total}")
    tmp = dst.with_suffix(".part")
    writer = gguf.GGUFWriter(str(tmp), arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value = field.contents()
        if field.name == count_key:
            value = blocks
        elif field.name == gguf.Keys.General.NAME:
            value = f"{value} (first {blocks} of {total} blocks, a draft model)"
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)

    def kept(name: str) -> bool:
        if not name.startswith("blk."):
            return True
        return int(name.split(".")[1]) < blocks

    tensors = [t for t in reader.tensors if kept(t.name)]
    for t in tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    tmp.replace(dst)
    return dst


def draft_for(model: Path, blocks: int, out: Path | None = None) -> Path:
    """The truncated draft of ``model`` (made if missing)."""
    dst = out or cache_dir() / f"{model.stem}-first{blocks}.gguf"
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        truncate(model, dst, blocks)
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="GGUF model (default: the default model)")
    ap.add_argument("--blocks", type=int, default=12, help="blocks kept (default 12 of 18)")
    ap.add_argument("--out", help="where to write (default: a cache directory)")
    args = ap.parse_args(argv)
    model = args.model
    if not model:
        from llamarunner import default_model_path

        model = str(default_model_path())
    print(draft_for(Path(model), args.blocks, Path(args.out) if args.out else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
