//! Samplers: the request's llama.cpp chain (with the shortlist of `backend/shortlist.rs`)
//! and its grammar's guide, and log-probabilities.

use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::data::LlamaTokenData;
use llama_cpp_2::token::data_array::LlamaTokenDataArray;
use llama_cpp_2::token::logit_bias::LlamaLogitBias;
use llama_cpp_2::token::LlamaToken;

use crate::backend::{Sampling, Text};
use crate::protocol::params::SamplingParams;
use crate::protocol::{BackendError, Token, TokenLogprob, TopLogprob};

use super::text::piece_bytes;
use super::LlamaEngine;

/// A request's samplers: the chain (penalties, truncation, temperature, selection) and the
/// grammar's guide (`constrain::Guide`), which checks the chain's pick and masks only when
/// the pick is not allowed.
pub struct ChainSampler {
    chain: LlamaSampler,
    guide: Option<crate::constrain::Guide>,
    /// The tokens the chain is handed instead of the whole vocabulary, when its first cut is
    /// a top-k or greedy (`backend/shortlist.rs`).
    shortlist: Option<crate::backend::shortlist::Shortlist>,
}

impl Sampling for LlamaEngine<'_> {
    type Sampler = ChainSampler;

    fn new_sampler(
        &self,
        p: &SamplingParams,
        history: &[Token],
    ) -> Result<ChainSampler, BackendError> {
        let n_vocab = self.model.n_vocab();
        let mut stages = Vec::new();
        let mut biases = Vec::with_capacity(p.logit_bias.len());
        for &(token, bias) in &p.logit_bias {
            // llama.cpp indexes its logits by token id without a bounds check.
            if !(0..n_vocab).contains(&token) {
                return Err(BackendError::Sampler(format!(
                    "logit_bias: token {token} is not in the vocabulary (0..{n_vocab})"
                )));
            }
            biases.push(LlamaLogitBias::new(LlamaToken(token), bias));
        }
        if p.ignore_eos {
            biases.extend_from_slice(&self.eog_bans);
        }
        if !biases.is_empty() {
            stages.push(LlamaSampler::logit_bias(n_vocab, &biases));
        }
        let penalize = p.repeat_last_n != 0
            && (p.repeat_penalty != 1.0 || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0);
        let last_n = if p.repeat_last_n < 0 {
            i32::try_from(self.slot_ctx).unwrap_or(i32::MAX)
        } else {
            p.repeat_last_n
        };
        if penalize {
            stages.push(LlamaSampler::penalties(
                n_vocab,
                last_n,
                p.repeat_penalty,
                p.frequency_penalty,
                p.presence_penalty,
            ));
        }
        let extra = &p.samplers;
        // DRY acts on greedy requests too, as the penalties do (llama-server's order:
        // penalties, DRY, then the truncations and the temperature).
        let dry_window = if extra.dry() {
            let window = extra
                .dry_penalty_last_n
                .clamp(0, i32::try_from(self.slot_ctx).unwrap_or(i32::MAX));
            stages.push(LlamaSampler::dry(
                self.model,
                extra.dry_multiplier,
                extra.dry_base,
                extra.dry_allowed_length,
                window,
                // NUL-free: `requests::validate` refuses breakers with one (this panics on one).
                extra.dry_sequence_breakers.iter().map(String::as_bytes),
            ));
            window
        } else {
            0
        };
        let seed = p.effective_seed();
        if p.greedy() {
            stages.push(LlamaSampler::greedy());
        } else if p.mirostat == 1 {
            stages.push(LlamaSampler::temp(p.temperature));
            stages.push(LlamaSampler::mirostat(
                n_vocab,
                seed,
                p.mirostat_tau,
                p.mirostat_eta,
                100,
            ));
        } else if p.mirostat == 2 {
            stages.push(LlamaSampler::temp(p.temperature));
            stages.push(LlamaSampler::mirostat_v2(
                seed,
                p.mirostat_tau,
                p.mirostat_eta,
            ));
        } else {
            if extra.top_n_sigma > 0.0 {
                stages.push(LlamaSampler::top_n_sigma(extra.top_n_sigma));
            }
            if p.top_k > 0 {
                stages.push(LlamaSampler::top_k(p.top_k));
            }
            if p.typical_p < 1.0 {
                stages.push(LlamaSampler::typical(p.typical_p, 1));
            }
            if p.top_p < 1.0 {
                stages.push(LlamaSampler::top_p(p.top_p, 1));
            }
            if p.min_p > 0.0 {
                stages.push(LlamaSampler::min_p(p.min_p, 1));
            }
            if extra.xtc_probability > 0.0 {
                stages.push(LlamaSampler::xtc(
                    extra.xtc_probability,
                    extra.xtc_threshold,
                    1,
                    seed,
                ));
            }
            if extra.dynatemp_range > 0.0 {
                stages.push(LlamaSampler::temp_ext(
                    p.temperature,
                    extra.dynatemp_range,
                    extra.dynatemp_exponent,
                ));
            } else {
                stages.push(LlamaSampler::temp(p.temperature));
            }
            stages.push(LlamaSampler::dist(seed));
        }
        let guide = crate::constrain::Guide::for_request(p.grammar.as_ref())
            .map_err(BackendError::Sampler)?;
        // The chain's first cut, when the stages before it change only known tokens (biases
        // and the penalty window; DRY may change any token of the history, top-n-sigma and
        // mirostat read them all): it then sees a shortlist instead of every token. A guide
        // picks from what the grammar allows, which a shortlist cannot know.
        let cut = if p.greedy() {
            Some(1)
        } else if p.mirostat == 0 && extra.top_n_sigma <= 0.0 {
            usize::try_from(p.top_k).ok().filter(|&k| k > 0)
        } else {
            None
        };
        let shortlist = match cut {
            Some(k) if guide.is_none() && dry_window == 0 => {
                let biased: Vec<i32> = biases.iter().map(|b| b.token().0).collect();
                let window = penalize.then(|| usize::try_from(last_n).unwrap_or(usize::MAX));
                crate::backend::shortlist::Shortlist::new(k, &biased, window)
            }
            _ => None,
        };
        let mut chain = LlamaSampler::chain_simple(stages);
        let mut shortlist = shortlist;
        if penalize || dry_window > 0 {
            // The prompt seeds the penalty and DRY windows, as in llama.cpp's common sampler
            // (and the shortlist's copy of the penalty window; it has none with DRY).
            let last_n = if penalize {
                last_n.max(dry_window)
            } else {
                dry_window
            };
            let window = usize::try_from(last_n).unwrap_or(0).min(history.len());
            let seed = &history[history.len() - window..];
            chain.accept_many(seed.iter().map(|&t| LlamaToken(t)));
            if let Some(list) = shortlist.as_mut() {
                seed.iter().for_each(|&t| list.accept(t));
            }
        }
        Ok(ChainSampler {
            chain,
            guide,
            shortlist,
        })
    }

    fn sample(&mut self, sampler: &mut ChainSampler, index: usize) -> Option<Token> {
        let index = i32::try_from(index).unwrap_or(i32::MAX);
        let Some(guide) = sampler.guide.as_mut() else {
            if let Some(list) = sampler.shortlist.as_mut() {
                // What llama_sampler_sample does, on the shortlist instead of every token.
                let logits = self.logits_ith(index);
                let listed = list
                    .candidates(logits)
                    .into_iter()
                    .filter_map(|t| Some((t, *logits.get(usize::try_from(t).ok()?)?)));
                let token = apply_chain(&mut sampler.chain, listed)?.id();
                sampler.chain.accept(token);
                list.accept(token.0);
                return Some(token.0);
            }
            // `sample` also accepts the token into the chain (penalty history); no second accept.
            return Some(sampler.chain.sample(&self.ctx, index).0);
        };
        // The chain picks from all logits; only when the guide refuses that pick does it pick
        // again among the tokens the grammar allows (the distribution is the masked one's:
        // a refused pick is redrawn). The chain and the guide are each told the choice once.
        let logits = self.logits_ith(index);
        let chain = &mut sampler.chain;
        let pick = |mask: Option<&llguidance::toktrie::SimpleVob>| {
            let allowed = (0u32..).zip(logits.iter().copied());
            let picked = match mask {
                None => apply_chain(chain, allowed),
                Some(m) => apply_chain(chain, allowed.filter(|&(t, _)| m.is_allowed(t))),
            };
            // A pick the chain banned (`ignore_eos` bans end-of-generation tokens) is none.
            picked
                .filter(|d| d.logit().is_finite())
                .and_then(|d| u32::try_from(d.id().0).ok())
        };
        let token = guide.choose(pick)?;
        let token = LlamaToken(i32::try_from(token).ok()?);
        sampler.chain.accept(token);
        guide.accept(token.0 as u32, &piece_bytes(self.model, token, true));
        Some(token.0)
    }

    fn logprobs(&self, index: usize, token: Token, top: usize) -> TokenLogprob {
        let logits = self.logits_ith(i32::try_from(index).unwrap_or(i32::MAX));
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
        let log_norm = max + sum.ln() as f32;
        let entry = |t: Token| TopLogprob {
            token: t,
            bytes: self.token_bytes(t),
            logprob: usize::try_from(t)
                .ok()
                .and_then(|i| logits.get(i))
                .map_or(f32::NEG_INFINITY, |&l| l - log_norm),
        };
        // The index list over the whole vocabulary is only made when alternatives are asked
        // for (`logprobs: true` alone needs just the sampled token's).
        let mut best: Vec<usize> = if top == 0 {
            Vec::new()
        } else {
            (0..logits.len()).collect()
        };
        let top = top.min(best.len());
        if top > 0 && top < best.len() {
            best.select_nth_unstable_by(top - 1, |&a, &b| logits[b].total_cmp(&logits[a]));
        }
        best.truncate(top);
        best.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        TokenLogprob {
            sampled: entry(token),
            top: best
                .into_iter()
                .filter_map(|i| Token::try_from(i).ok())
                .map(entry)
                .collect(),
        }
    }
}

/// Runs `chain` on the `candidates` (token, logit) as `llama_sampler_sample` runs it on every
/// token's logit, without accepting the pick: the entry it selected, None when there were no
/// candidates or it selected none.
pub(super) fn apply_chain(
    chain: &mut LlamaSampler,
    candidates: impl Iterator<Item = (u32, f32)>,
) -> Option<LlamaTokenData> {
    let data: Vec<LlamaTokenData> = candidates
        .filter_map(|(t, logit)| {
            Some(LlamaTokenData::new(
                LlamaToken(i32::try_from(t).ok()?),
                logit,
                0.0,
            ))
        })
        .collect();
    if data.is_empty() {
        return None;
    }
    let mut array = LlamaTokenDataArray::new(data, false);
    array.apply_sampler(chain);
    array.selected.and_then(|i| array.data.get(i)).copied()
}
