"""An architecture that llama.cpp learned after llama-cpp-sys-2 0.1.154 loads and generates.

``spark2_5`` (new in the llama.cpp of llama-cpp-sys-2 0.1.161, ``src/models/spark2-5.cpp``) is
the llama tensor set plus one tensor per layer: ``attn_gate`` (n_embd x n_head), a sigmoid gate
on each head's attention output. It also needs a sliding window and a per-layer window pattern
(``<arch>.attention.sliding_window``, ``<arch>.attention.sliding_window_pattern``), uses NeoX
RoPE and a GELU feed-forward. The tiny model here is the tiny llama's weights (tinymodel.py) with
random gates. The llama.cpp of 0.1.154 refuses the file ("unknown model architecture:
'spark2_5'"), so this test fails there at the model load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import httpx
import numpy as np
from gguf import GGUFWriter

from llamarunner import Server

from helpers import complete
from tinymodel import N_EMBD, N_FF, N_HEAD, N_HEAD_KV, N_LAYER, model_tensors, vocabulary

ARCH = "spark2_5"
# Layer 0 attends within the window, layer 1 to everything (spark2_5 always builds llama.cpp's
# interleaved-window KV cache; the pattern is required).
SWA_PATTERN = [True, False]
SLIDING_WINDOW = 256


def write_spark2_5_model(path: Path, *, seed: int = 0) -> Path:
    """A tiny random-weight ``spark2_5`` model: the tiny llama's hyperparameters, vocabulary
    and tensors, plus each layer's attention gate."""
    assert len(SWA_PATTERN) == N_LAYER
    tokens, scores, types = vocabulary()
    tensors = model_tensors(seed=seed)
    rng = np.random.default_rng(seed + 1)
    for i in range(N_LAYER):
        # numpy (out, in): one gate per head, from the layer's normalized input.
        gate = (rng.standard_normal((N_HEAD, N_EMBD)) * 0.5).astype(np.float32)
        tensors[f"blk.{i}.attn_gate.weight"] = gate
    w = GGUFWriter(str(path), ARCH)
    w.add_name("tiny-test-spark2_5")
    w.add_context_length(4096)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_sliding_window(SLIDING_WINDOW)
    w.add_sliding_window_pattern(SWA_PATTERN)
    w.add_file_type(0)  # all f32
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    for name, data in tensors.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_spark2_5_loads_and_completes(tmp_path: Path, start_server: Callable[..., Server]) -> None:
    model = write_spark2_5_model(tmp_path / "tiny-spark2_5.gguf")
    srv = start_server(model, parallel=1, ctx_size=512)
    props = httpx.get(f"{srv.url}/props", timeout=30)
    assert props.status_code == 200, props.text
    model_props = props.json()["model"]
    assert model_props["architecture"] == ARCH
    assert model_props["n_layer"] == N_LAYER
    # `complete` streams /completion and checks its status is 200 and that it ends without error.
    text, final = complete(srv.url, "hello world", num_predict=8, temperature=0, ignore_eos=True)
    assert isinstance(text, str)
    assert (final["done_reason"], final["eval_count"]) == ("length", 8), final
    assert final["prompt_eval_count"] >= 3  # BOS + tokens of "hello world"
