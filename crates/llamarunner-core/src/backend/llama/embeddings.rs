//! Embeddings: a context of their own, made at the first request, pooled by the model or
//! piece by piece here (`--pooling`: mean, the first token's, the last's, or every token's).

use std::num::NonZeroU32;

use llama_cpp_2::context::params::{LlamaContextParams, LlamaPoolingType};
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::token::LlamaToken;

use crate::backend::Embeddings;
use crate::config::Pooling;
use crate::protocol::{BackendError, Token};

use super::LlamaEngine;

/// How the embedding context is made.
pub(super) struct EmbedParams {
    pub(super) threads: i32,
    pub(super) flash_attn: llama_cpp_sys_2::llama_flash_attn_type,
    /// The model names its pooling type (an embedding model, often non-causal): its whole
    /// input is decoded in one batch and pooled by llama.cpp; otherwise (a generative model)
    /// the per-token outputs are pooled here, piece by piece.
    pub(super) pooled_by_model: bool,
    /// `--pooling`: the model's own (auto), or the one asked for.
    pub(super) pooling: Pooling,
}

impl EmbedParams {
    /// llama.cpp's pooling for an embedding model's context.
    fn model_pooling(&self) -> LlamaPoolingType {
        match self.pooling {
            Pooling::Auto => LlamaPoolingType::Unspecified,
            Pooling::Mean => LlamaPoolingType::Mean,
            Pooling::Cls => LlamaPoolingType::Cls,
            Pooling::Last => LlamaPoolingType::Last,
            Pooling::None => LlamaPoolingType::None,
        }
    }
}

impl Embeddings for LlamaEngine<'_> {
    fn embed_capacity(&self) -> usize {
        self.embed_cells
    }

    fn embed_piece(&self) -> usize {
        if self.embed_params.pooled_by_model {
            // Its pooling needs the whole input in one batch.
            self.embed_cells
        } else {
            self.embed_chunk()
        }
    }

    fn embed(
        &mut self,
        tokens: &[Token],
        start: usize,
        last: bool,
    ) -> Result<Option<Vec<f32>>, BackendError> {
        if self.embed_params.pooled_by_model {
            return self.embed_pooled(tokens).map(Some);
        }
        self.embed_in_pieces(tokens, start, last)
    }
}

impl<'m> LlamaEngine<'m> {
    /// Tokens per decode call when a generative model's embedding is computed in pieces:
    /// llama.cpp outputs logits for every token of an embedding batch, so the piece is sized
    /// to keep that buffer under `EMBED_LOGITS_BYTES`.
    fn embed_chunk(&self) -> usize {
        let per_token = usize::try_from(self.model.n_vocab()).unwrap_or(1).max(1) * 4;
        (EMBED_LOGITS_BYTES / per_token).clamp(1, self.embed_cells.max(1))
    }

    fn embedding_context(&mut self) -> Result<&mut LlamaContext<'m>, BackendError> {
        if self.embed_ctx.is_none() {
            let n = u32::try_from(self.embed_cells).unwrap_or(u32::MAX);
            // A model that names its pooling (an embedding model, often non-causal) needs the
            // whole input in one micro-batch: n_ubatch = n_batch = n_ctx. A generative model
            // is pooled here (`--pooling`), piece by piece through its causal KV cache, from
            // per-token embeddings (pooling none), so only a piece's logits are ever allocated.
            let (pooling, batch) = if self.embed_params.pooled_by_model {
                (self.embed_params.model_pooling(), n)
            } else {
                let chunk = u32::try_from(self.embed_chunk()).unwrap_or(n);
                (LlamaPoolingType::None, chunk)
            };
            let params = LlamaContextParams::default()
                .with_n_ctx(NonZeroU32::new(n))
                .with_n_batch(batch)
                .with_n_ubatch(batch)
                .with_n_seq_max(1)
                .with_n_threads(self.embed_params.threads)
                .with_n_threads_batch(self.embed_params.threads)
                .with_flash_attention_policy(self.embed_params.flash_attn)
                .with_embeddings(true)
                .with_pooling_type(pooling);
            let ctx = self.model.new_context(self.backend, params).map_err(|e| {
                BackendError::Decode(format!("cannot create the embedding context: {e}"))
            })?;
            tracing::info!(
                n_ctx = n,
                n_batch = batch,
                ?pooling,
                "embedding context created"
            );
            self.embed_ctx = Some(ctx);
        }
        self.embed_ctx
            .as_mut()
            .ok_or_else(|| BackendError::Decode("no embedding context".into()))
    }
}

impl LlamaEngine<'_> {
    /// One piece of a generative model's embedding, decoded `embed_chunk` tokens at a time,
    /// one piece per scheduler step, through its causal KV cache (the values llama.cpp's
    /// pooling gives over one batch, without its n_tokens × n_vocab logits buffer or a long
    /// stall of the other sequences), pooled as `--pooling` says: the mean of the per-token
    /// outputs (auto, mean), the first's (cls), the last's (last), or all of them in order
    /// (none).
    fn embed_in_pieces(
        &mut self,
        tokens: &[Token],
        start: usize,
        last: bool,
    ) -> Result<Option<Vec<f32>>, BackendError> {
        let pooling = self.embed_params.pooling;
        let mut sum = std::mem::take(&mut self.embed_sum);
        let ctx = self.embedding_context()?;
        if start == 0 {
            ctx.clear_kv_cache();
            sum.clear();
        }
        let result = decode_piece(ctx, tokens, start).and_then(|()| {
            for j in 0..tokens.len() {
                let row = ctx
                    .embeddings_ith(i32::try_from(j).unwrap_or(i32::MAX))
                    .map_err(|e| BackendError::Decode(e.to_string()))?;
                let row = row.iter().map(|&x| f64::from(x));
                match pooling {
                    Pooling::Auto | Pooling::Mean => {
                        if sum.is_empty() {
                            sum = vec![0.0; row.len()];
                        }
                        sum.iter_mut().zip(row).for_each(|(s, x)| *s += x);
                    }
                    Pooling::Cls if start + j == 0 => sum = row.collect(),
                    Pooling::Cls => {}
                    Pooling::Last => sum = row.collect(),
                    Pooling::None => sum.extend(row),
                }
            }
            Ok(())
        });
        if result.is_err() || last {
            ctx.clear_kv_cache();
        }
        result?;
        if !last {
            self.embed_sum = sum;
            return Ok(None);
        }
        let n = match pooling {
            Pooling::Auto | Pooling::Mean => (start + tokens.len()).max(1) as f64,
            _ => 1.0,
        };
        Ok(Some(sum.into_iter().map(|s| (s / n) as f32).collect()))
    }

    /// An embedding model's own pooling over the whole input in one batch. Its logits buffer
    /// (n_tokens × n_vocab floats) stays allocated with the context, so a context that needed
    /// more than `EMBED_LOGITS_BYTES` is freed after the request.
    fn embed_pooled(&mut self, tokens: &[Token]) -> Result<Vec<f32>, BackendError> {
        let n_vocab = usize::try_from(self.model.n_vocab()).unwrap_or(0);
        let unpooled = self.embed_params.pooling == Pooling::None;
        let ctx = self.embedding_context()?;
        ctx.clear_kv_cache();
        // `--pooling none`: every token's output, in order. Else the pooled embedding, or,
        // where there is none (the model's pooling type is none), the last token's.
        let result = decode_piece(ctx, tokens, 0).and_then(|()| {
            let row = |j: usize| {
                ctx.embeddings_ith(i32::try_from(j).unwrap_or(i32::MAX))
                    .map(<[f32]>::to_vec)
                    .map_err(|e| BackendError::Decode(e.to_string()))
            };
            if unpooled {
                let mut all = Vec::new();
                for j in 0..tokens.len() {
                    all.extend(row(j)?);
                }
                return Ok(all);
            }
            match ctx.embeddings_seq_ith(0) {
                Ok(v) => Ok(v.to_vec()),
                Err(_) => row(tokens.len().saturating_sub(1)),
            }
        });
        ctx.clear_kv_cache();
        if tokens.len().saturating_mul(n_vocab).saturating_mul(4) > EMBED_LOGITS_BYTES {
            tracing::debug!(
                tokens = tokens.len(),
                "embedding context freed (large logits buffer)"
            );
            self.embed_ctx = None;
        }
        result
    }
}

/// Most bytes of logits an embedding context may keep between requests.
pub(super) const EMBED_LOGITS_BYTES: usize = 32 << 20;

/// Decodes `tokens` as positions `start..` of sequence 0, every token an output.
pub(super) fn decode_piece(
    ctx: &mut LlamaContext<'_>,
    tokens: &[Token],
    start: usize,
) -> Result<(), BackendError> {
    let mut batch = LlamaBatch::new(tokens.len().max(1), 1);
    for (i, &t) in tokens.iter().enumerate() {
        let pos = i32::try_from(start + i).map_err(|e| BackendError::Decode(e.to_string()))?;
        batch
            .add(LlamaToken(t), pos, &[0], true)
            .map_err(|e| BackendError::Decode(e.to_string()))?;
    }
    ctx.decode(&mut batch)
        .map_err(|e| BackendError::Decode(e.to_string()))
}
