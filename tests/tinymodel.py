"""Tiny random-weight GGUF models for end-to-end tests (a few hundred KB, load instantly).

Architecture ``llama``: 64-dim, 2 layers, 4 heads / 2 KV heads, FF 128, an SPM vocabulary of
``<unk> <s> </s>``, the 256 byte tokens and a few ``▁word`` pieces; BOS 1, EOS 2; f32 weights.
Random weights emit arbitrary bytes, which exercises the UTF-8 handling.

``always_eos=True`` builds a model whose greedy choice is always EOS: every layer's output
projections are zero, so the final hidden state is the token embedding, all embeddings are the
same positive vector, and only EOS's output row is non-zero (and aligned with it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter, TokenType

N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 128
HEAD_DIM = N_EMBD // N_HEAD
WORDS = ["▁the", "▁a", "▁hello", "▁world", "▁cat", "▁dog", "▁is", "▁and", "▁of", "▁to"]


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(TokenType.BYTE)
    for w in WORDS:
        tokens.append(w)
        types.append(TokenType.NORMAL)
    scores = [0.0] * 3 + [0.0] * 256 + [-float(i + 1) for i in range(len(WORDS))]
    return tokens, scores, [int(t) for t in types]


def write_tiny_model(
    path: Path,
    *,
    seed: int = 0,
    always_eos: bool = False,
    context_length: int = 65536,
    chat_template: str | None = None,
) -> Path:
    rng = np.random.default_rng(seed)
    tokens, scores, types = vocabulary()
    n_vocab = len(tokens)

    def rand(*shape: int, scale: float = 0.5) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny-test-llama")
    w.add_context_length(context_length)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
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
    if chat_template is not None:
        w.add_chat_template(chat_template)

    if always_eos:
        embd = np.abs(rand(n_vocab, N_EMBD)[:1]).repeat(n_vocab, axis=0) + 0.1
        output = np.zeros((n_vocab, N_EMBD), dtype=np.float32)
        output[2] = embd[0]
    else:
        embd = rand(n_vocab, N_EMBD)
        output = rand(n_vocab, N_EMBD, scale=2.0)
    w.add_tensor("token_embd.weight", embd)
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    w.add_tensor("output.weight", output)
    for i in range(N_LAYER):
        zero_out = always_eos
        p = f"blk.{i}"
        w.add_tensor(f"{p}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"{p}.attn_q.weight", rand(N_EMBD, N_EMBD))
        w.add_tensor(f"{p}.attn_k.weight", rand(N_HEAD_KV * HEAD_DIM, N_EMBD))
        w.add_tensor(f"{p}.attn_v.weight", rand(N_HEAD_KV * HEAD_DIM, N_EMBD))
        attn_out = rand(N_EMBD, N_EMBD)
        w.add_tensor(f"{p}.attn_output.weight", attn_out * 0 if zero_out else attn_out)
        w.add_tensor(f"{p}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"{p}.ffn_gate.weight", rand(N_FF, N_EMBD))
        w.add_tensor(f"{p}.ffn_up.weight", rand(N_FF, N_EMBD))
        down = rand(N_EMBD, N_FF)
        w.add_tensor(f"{p}.ffn_down.weight", down * 0 if zero_out else down)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
