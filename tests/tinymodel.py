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
from gguf import GGUFWriter, PoolingType, TokenType

N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 128
HEAD_DIM = N_EMBD // N_HEAD
WORDS = ["▁the", "▁a", "▁hello", "▁world", "▁cat", "▁dog", "▁is", "▁and", "▁of", "▁to"]


FIRST_EXTRA_TOKEN = 3 + 256 + len(WORDS)
FIM_TOKENS = ("pre", "suf", "mid", "rep", "sep")


def vocabulary(extra_tokens: int = 0) -> tuple[list[str], list[float], list[int]]:
    """The tokens, scores and types; ``extra_tokens`` control tokens ``<x0>``, ``<x1>``, ...
    at the end (never produced by tokenizing text) make a large vocabulary."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(TokenType.BYTE)
    for w in WORDS:
        tokens.append(w)
        types.append(TokenType.NORMAL)
    scores = [0.0] * 3 + [0.0] * 256 + [-float(i + 1) for i in range(len(WORDS))]
    tokens += [f"<x{i}>" for i in range(extra_tokens)]
    types += [TokenType.CONTROL] * extra_tokens
    scores += [0.0] * extra_tokens
    return tokens, scores, [int(t) for t in types]


def byte_tokens(text: str) -> list[int]:
    """The token ids the tiny model's tokenizer gives ``text`` when no vocabulary piece
    applies (text without spaces, not starting with "a"): BOS, the three bytes of the "\u2581"
    that SentencePiece prefixes, then one byte token per byte."""
    assert " " not in text and not text.startswith("a"), text
    return [1] + [3 + b for b in ("\u2581" + text).encode()]


def model_tensors(
    *,
    seed: int = 0,
    always_eos: bool = False,
    extra_tokens: int = 0,
    heads: tuple[int, int] = (N_HEAD, N_HEAD_KV),
) -> dict[str, np.ndarray]:
    """The tiny model's tensors by GGUF name (numpy shapes: (out, in) for matrices), the same
    for the same arguments. ``heads``: query and key/value heads (the head size is N_EMBD
    divided by the first)."""
    rng = np.random.default_rng(seed)
    n_head_kv_dims = heads[1] * (N_EMBD // heads[0])
    n_vocab = len(vocabulary(extra_tokens)[0])

    def rand(*shape: int, scale: float = 0.5) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    if always_eos:
        embd = np.abs(rand(n_vocab, N_EMBD)[:1]).repeat(n_vocab, axis=0) + 0.1
        output = np.zeros((n_vocab, N_EMBD), dtype=np.float32)
        output[2] = embd[0]
    else:
        embd = rand(n_vocab, N_EMBD)
        output = rand(n_vocab, N_EMBD, scale=2.0)
    tensors = {
        "token_embd.weight": embd,
        "output_norm.weight": np.ones(N_EMBD, dtype=np.float32),
        "output.weight": output,
    }
    for i in range(N_LAYER):
        zero_out = always_eos
        p = f"blk.{i}"
        tensors[f"{p}.attn_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        tensors[f"{p}.attn_q.weight"] = rand(N_EMBD, N_EMBD)
        tensors[f"{p}.attn_k.weight"] = rand(n_head_kv_dims, N_EMBD)
        tensors[f"{p}.attn_v.weight"] = rand(n_head_kv_dims, N_EMBD)
        attn_out = rand(N_EMBD, N_EMBD)
        tensors[f"{p}.attn_output.weight"] = attn_out * 0 if zero_out else attn_out
        tensors[f"{p}.ffn_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        tensors[f"{p}.ffn_gate.weight"] = rand(N_FF, N_EMBD)
        tensors[f"{p}.ffn_up.weight"] = rand(N_FF, N_EMBD)
        down = rand(N_EMBD, N_FF)
        tensors[f"{p}.ffn_down.weight"] = down * 0 if zero_out else down
    return tensors


def write_tiny_model(
    path: Path,
    *,
    seed: int = 0,
    always_eos: bool = False,
    context_length: int = 65536,
    chat_template: str | None = None,
    tensors: dict[str, np.ndarray] | None = None,
    extra_tokens: int = 0,
    heads: tuple[int, int] = (N_HEAD, N_HEAD_KV),
    fim: tuple[str, ...] = (),
    split_max_tensors: int = 0,
    pooling: PoolingType | None = None,
) -> Path:
    """Writes the tiny model (in files of ``split_max_tensors`` tensors each, named
    ``STEM-00001-of-0000N.gguf``, when not 0); ``tensors`` replaces the tensors of
    `model_tensors` (to write a model with merged LoRA weights, say); ``heads`` as there
    (quantized KV caches need a head size that is a multiple of 32: ``heads=(2, 1)``).
    ``fim`` names fill-in-the-middle tokens of `FIM_TOKENS` ("pre", "suf", "mid", "rep",
    "sep") for the first extra tokens to be: a code model's vocabulary (``<x0>`` is the
    first named, and so on). ``pooling`` names a pooling type: an embedding model's GGUF."""
    extra_tokens = max(extra_tokens, len(fim))
    w = GGUFWriter(str(path), "llama", split_max_tensors=split_max_tensors)
    w.add_name("tiny-test-llama")
    add_llama_hparams(w, context_length=context_length, heads=heads)
    add_vocabulary(w, extra_tokens)
    for i, name in enumerate(fim):
        w.add_uint32(f"tokenizer.ggml.fim_{name}_token_id", FIRST_EXTRA_TOKEN + i)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    if pooling is not None:
        w.add_pooling_type(pooling)
    if tensors is None:
        tensors = model_tensors(
            seed=seed, always_eos=always_eos, extra_tokens=extra_tokens, heads=heads
        )
    return write_gguf(w, path, tensors)


def add_llama_hparams(
    w: GGUFWriter, *, context_length: int, heads: tuple[int, int] = (N_HEAD, N_HEAD_KV)
) -> None:
    """The tiny llama's hyperparameters (f32 weights), under the writer's architecture."""
    w.add_context_length(context_length)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(heads[0])
    w.add_head_count_kv(heads[1])
    w.add_rope_dimension_count(N_EMBD // heads[0])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(0)  # all f32


def add_vocabulary(w: GGUFWriter, extra_tokens: int = 0, *, add_eos: bool = False) -> None:
    """The SPM vocabulary of `vocabulary`, BOS 1 (added), EOS 2 (added when ``add_eos``),
    UNK 0."""
    tokens, scores, types = vocabulary(extra_tokens)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(add_eos)


def write_gguf(w: GGUFWriter, path: Path, tensors: dict[str, np.ndarray]) -> Path:
    """Adds `tensors`, writes the file and closes it; returns `path`."""
    for name, data in tensors.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_cycle_model(path: Path, text: str) -> Path:
    """A model whose greedy continuation of any prompt that ends in a token outside ``text``
    is the bytes of ``text`` over and over, one byte token at a time (``text``'s bytes must
    all differ). The layers add nothing (zero output projections), so the logits depend on the
    last token only: its embedding is a basis vector and the output row of the byte that
    follows it is that vector."""
    return _successor_model(path, text, then_eos=False)


def write_chain_model(path: Path, text: str) -> Path:
    """A model whose greedy continuation of any prompt that ends in a token outside ``text``
    is the bytes of ``text``, one byte token at a time, then EOS (``text``'s bytes must all
    differ): as `write_cycle_model`, but the last byte is followed by EOS instead of the
    first. The chosen token's logit is far above every other's, so nothing machine-dependent
    can change the text or where it ends."""
    return _successor_model(path, text, then_eos=True)


def _successor_model(path: Path, text: str, then_eos: bool) -> Path:
    """`text`'s byte tokens, each followed by the next; the last by EOS (`then_eos`) or by the
    first byte again."""
    chain = [3 + b for b in text.encode()]
    assert len(set(chain)) == len(chain) < N_EMBD, text
    after_last = 2 if then_eos else chain[0]
    tensors = model_tensors()
    n_vocab = tensors["token_embd.weight"].shape[0]
    eye = np.eye(N_EMBD, dtype=np.float32)
    embd = np.tile(eye[N_EMBD - 1], (n_vocab, 1))  # every other token: the last basis vector
    output = np.zeros((n_vocab, N_EMBD), dtype=np.float32)
    output[chain[0]] = eye[N_EMBD - 1] * 10  # ... is followed by the first byte
    for i, token in enumerate(chain):
        embd[token] = eye[i]
        output[chain[i + 1] if i + 1 < len(chain) else after_last] += eye[i] * 10
    tensors["token_embd.weight"] = embd
    tensors["output.weight"] = output
    for i in range(N_LAYER):
        for name in ("attn_output", "ffn_down"):
            tensors[f"blk.{i}.{name}.weight"] = np.zeros_like(tensors[f"blk.{i}.{name}.weight"])
    return write_tiny_model(path, tensors=tensors)


def hidden_states(
    tokens: list[int],
    tensors: dict[str, np.ndarray],
    *,
    f16_cache: bool = True,
    qwen3: bool = False,
) -> np.ndarray:
    """The tiny model's forward pass in numpy (float64), all tokens in one piece: the final
    normalized hidden state of every token (n_tokens x N_EMBD), what llama.cpp returns as
    per-token embeddings. Llama: RMS norm, RoPE on adjacent pairs (llama.cpp's normal mode),
    grouped-query causal attention, SwiGLU. ``f16_cache`` rounds keys and values to float16
    as llama.cpp's default KV cache stores them (with flash attention, the rest of its
    arithmetic is float32: the results then agree to about 1e-5). ``qwen3``: Qwen3's layers
    instead (each head's query and key RMS-normalized before RoPE, NeoX RoPE on the halves)."""
    t = {k: v.astype(np.float64) for k, v in tensors.items()}
    n = len(tokens)

    def rms(x: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5)

    pos = np.arange(n, dtype=np.float64)[:, None]
    inv_freq = 10000.0 ** (-np.arange(0, HEAD_DIM, 2, dtype=np.float64) / HEAD_DIM)
    angle = pos * inv_freq[None, :]  # (n, HEAD_DIM / 2)
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]

    def rope(x: np.ndarray) -> np.ndarray:  # (n, heads, HEAD_DIM)
        out = np.empty_like(x)
        if qwen3:  # NeoX: the first half of each head rotates with the second
            half = HEAD_DIM // 2
            lo, hi = x[..., :half], x[..., half:]
            out[..., :half] = lo * cos - hi * sin
            out[..., half:] = lo * sin + hi * cos
            return out
        even, odd = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    mask = np.triu(np.full((n, n), -np.inf), k=1)
    x = t["token_embd.weight"][tokens]
    for i in range(N_LAYER):
        p = f"blk.{i}"
        h = rms(x) * t[f"{p}.attn_norm.weight"]
        q = (h @ t[f"{p}.attn_q.weight"].T).reshape(n, N_HEAD, HEAD_DIM)
        k = (h @ t[f"{p}.attn_k.weight"].T).reshape(n, N_HEAD_KV, HEAD_DIM)
        if qwen3:
            q = rms(q) * t[f"{p}.attn_q_norm.weight"]
            k = rms(k) * t[f"{p}.attn_k_norm.weight"]
        q, k = rope(q), rope(k)
        v = (h @ t[f"{p}.attn_v.weight"].T).reshape(n, N_HEAD_KV, HEAD_DIM)
        if f16_cache:
            k = k.astype(np.float16).astype(np.float64)
            v = v.astype(np.float16).astype(np.float64)
        heads = []
        for head in range(N_HEAD):
            kv = head // (N_HEAD // N_HEAD_KV)
            scores = q[:, head] @ k[:, kv].T / np.sqrt(HEAD_DIM) + mask
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            weights /= weights.sum(axis=1, keepdims=True)
            heads.append(weights @ v[:, kv])
        x = x + np.concatenate(heads, axis=1) @ t[f"{p}.attn_output.weight"].T
        h = rms(x) * t[f"{p}.ffn_norm.weight"]
        gate = h @ t[f"{p}.ffn_gate.weight"].T
        up = h @ t[f"{p}.ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ t[f"{p}.ffn_down.weight"].T
    return rms(x) * t["output_norm.weight"]


SPARK2_5 = "spark2_5"
# Layer 0 attends within the window, layer 1 to everything (spark2_5 always builds llama.cpp's
# interleaved-window KV cache; the pattern is required).
SPARK_SWA_PATTERN = [True, False]
SPARK_SLIDING_WINDOW = 256


def write_spark2_5_model(path: Path, *, seed: int = 0) -> Path:
    """A tiny random-weight ``spark2_5`` model (an architecture new in the llama.cpp of
    llama-cpp-sys-2 0.1.161): the tiny llama's hyperparameters, vocabulary and tensors, plus
    one tensor per layer, ``attn_gate`` (n_embd x n_head), a sigmoid gate on each head's
    attention output. spark2_5 also needs a sliding window and a per-layer window pattern; it
    uses NeoX RoPE and a GELU feed-forward."""
    assert len(SPARK_SWA_PATTERN) == N_LAYER
    tensors = model_tensors(seed=seed)
    rng = np.random.default_rng(seed + 1)
    for i in range(N_LAYER):
        # numpy (out, in): one gate per head, from the layer's normalized input.
        gate = (rng.standard_normal((N_HEAD, N_EMBD)) * 0.5).astype(np.float32)
        tensors[f"blk.{i}.attn_gate.weight"] = gate
    w = GGUFWriter(str(path), SPARK2_5)
    w.add_name("tiny-test-spark2_5")
    add_llama_hparams(w, context_length=4096)
    w.add_sliding_window(SPARK_SLIDING_WINDOW)
    w.add_sliding_window_pattern(SPARK_SWA_PATTERN)
    add_vocabulary(w)
    return write_gguf(w, path, tensors)


# A reranker: Qwen3's layers with a two-label head (``yes``, ``no``) as Qwen3-Reranker's GGUFs
# have, rank pooling: llama.cpp scores a query-document pair with the softmax of the head over
# the last token's final hidden state, and the relevance is its first value (P(yes)).
RERANK_LABELS = ["yes", "no"]
# The separator a reranker without a template puts between query and document (<x0>).
RERANK_SEP = FIRST_EXTRA_TOKEN


def reranker_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """The tiny reranker's tensors: the tiny model's, per-head query and key norms, and the
    head ``cls.output`` (numpy (labels, N_EMBD))."""
    tensors = model_tensors(seed=seed, extra_tokens=1)
    rng = np.random.default_rng(seed + 7)
    for i in range(N_LAYER):
        for name in ("attn_q_norm", "attn_k_norm"):
            weight = 1.0 + 0.2 * rng.standard_normal(HEAD_DIM)
            tensors[f"blk.{i}.{name}.weight"] = weight.astype(np.float32)
    head = rng.standard_normal((len(RERANK_LABELS), N_EMBD)) * 0.5
    tensors["cls.output.weight"] = head.astype(np.float32)
    return tensors


def write_reranker_model(path: Path, *, template: str | None = None, seed: int = 0) -> Path:
    """A tiny random-weight Qwen3 reranker (rank pooling, `reranker_tensors`). With
    ``template`` (a ``tokenizer.chat_template.rerank`` holding ``{query}`` and ``{document}``)
    pairs are laid out by it; without, as ``<s> query </s> <x0> document </s>`` (BOS, EOS and
    the separator each added by the vocabulary)."""
    w = GGUFWriter(str(path), "qwen3")
    w.add_name("tiny-test-reranker")
    add_llama_hparams(w, context_length=4096)
    w.add_pooling_type(PoolingType.RANK)
    w.add_classifier_output_labels(RERANK_LABELS)
    add_vocabulary(w, extra_tokens=1, add_eos=template is None)
    if template is None:
        w.add_sep_token_id(RERANK_SEP)
        w.add_add_sep_token(True)
    else:
        w.add_string("tokenizer.chat_template.rerank", template)
    return write_gguf(w, path, reranker_tensors(seed))


def rerank_score(tokens: list[int], tensors: dict[str, np.ndarray]) -> float:
    """What llama.cpp's rank pooling gives the tiny reranker for ``tokens``: P(yes) from the
    head over the last token's hidden state."""
    h = hidden_states(tokens, tensors, qwen3=True)[-1]
    logits = tensors["cls.output.weight"].astype(np.float64) @ h
    p = np.exp(logits - logits.max())
    return float(p[0] / p.sum())


def write_mamba_model(path: Path, *, seed: int = 0) -> Path:
    """A tiny Mamba (a recurrent model: its state cannot drop the last positions) of the tiny
    llama's vocabulary, f32, random weights."""
    rng = np.random.default_rng(seed)
    d_inner, d_state, d_conv, dt_rank = 2 * N_EMBD, 8, 4, 8
    n_vocab = len(vocabulary()[0])

    def rand(*shape: int, scale: float = 0.3) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = GGUFWriter(str(path), "mamba")
    w.add_name("tiny-test-mamba")
    w.add_context_length(4096)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)
    add_vocabulary(w)
    tensors = {
        "token_embd.weight": rand(n_vocab, N_EMBD),
        "output_norm.weight": np.ones(N_EMBD, dtype=np.float32),
        "output.weight": rand(n_vocab, N_EMBD, scale=2.0),
    }
    for i in range(N_LAYER):
        p = f"blk.{i}"
        tensors[f"{p}.attn_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        tensors[f"{p}.ssm_in.weight"] = rand(2 * d_inner, N_EMBD)
        tensors[f"{p}.ssm_conv1d.weight"] = rand(d_inner, d_conv)
        tensors[f"{p}.ssm_conv1d.bias"] = rand(d_inner)
        tensors[f"{p}.ssm_x.weight"] = rand(dt_rank + 2 * d_state, d_inner)
        tensors[f"{p}.ssm_dt.weight"] = rand(d_inner, dt_rank)
        tensors[f"{p}.ssm_dt.bias"] = rand(d_inner)
        tensors[f"{p}.ssm_a"] = -np.abs(rand(d_inner, d_state)) - 0.1
        tensors[f"{p}.ssm_d"] = np.ones(d_inner, dtype=np.float32)
        tensors[f"{p}.ssm_out.weight"] = rand(N_EMBD, d_inner)
    return write_gguf(w, path, tensors)
