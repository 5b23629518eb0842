//! Samplers: the request's llama.cpp chain (with the shortlist of `backend/shortlist.rs`)
//! and its grammar's guide, and log-probabilities. A step's sequences are sampled in parallel
//! on the engine's sampling pool (`--sampling-threads`): each reads only its own rows of
//! logits, so the tokens are those of sampling them one after another.

use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::data::LlamaTokenData;
use llama_cpp_2::token::data_array::LlamaTokenDataArray;
use llama_cpp_2::token::logit_bias::LlamaLogitBias;
use llama_cpp_2::token::LlamaToken;

use rayon::prelude::*;
use std::collections::VecDeque;

use crate::backend::{Pick, Sampling, SlotSampling, Text};
use crate::protocol::params::SamplingParams;
use crate::protocol::{BackendError, Token, TokenLogprob, TopLogprob};

use super::text::{ends_generation, piece_bytes, text_bytes};
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
    /// With `post_sampling_probs`: how many survivors of the chain each pick keeps, and the
    /// picks' distributions not yet reported, oldest first.
    kept: Option<(usize, VecDeque<Survivors>)>,
    /// How many of a position's best raw logits the chain needs (its shortlist's `k + m`),
    /// when that is all it needs, so that the device can cut them (`--backend-sampling`,
    /// `device_cut.rs`): a shortlist without a penalty window, no bias but bans, no
    /// log-probabilities.
    device_cut: Option<usize>,
}

/// What the chain left at one pick: the selected token's probability and the most probable
/// survivors (token, probability), best first, none of them zero.
struct Survivors {
    selected: f32,
    top: Vec<(LlamaToken, f32)>,
}

impl Survivors {
    /// The chain's candidates after it ran (`data`, with `selected`), as probabilities: the
    /// shares its final stage computed (`dist` normalizes over the survivors), or, where it
    /// computed none (greedy), all of it on the selected token.
    fn of(data: &[LlamaTokenData], selected: Option<usize>, keep: usize) -> Self {
        let total: f64 = data.iter().map(|d| f64::from(d.p().max(0.0))).sum();
        let share = |d: &LlamaTokenData, i: usize| -> f32 {
            if total > 0.0 {
                (f64::from(d.p().max(0.0)) / total) as f32
            } else if Some(i) == selected {
                1.0
            } else {
                0.0
            }
        };
        let mut top: Vec<(LlamaToken, f32)> = data
            .iter()
            .enumerate()
            .map(|(i, d)| (d.id(), share(d, i)))
            .filter(|&(_, p)| p > 0.0)
            .collect();
        // Best first, ties by id; only the kept ones are sorted (a chain without a top-k
        // leaves the whole vocabulary).
        let order = |a: &(LlamaToken, f32), b: &(LlamaToken, f32)| {
            b.1.total_cmp(&a.1).then(a.0 .0.cmp(&b.0 .0))
        };
        if keep == 0 {
            top.clear();
        } else if keep < top.len() {
            top.select_nth_unstable_by(keep - 1, order);
            top.truncate(keep);
        }
        top.sort_by(order);
        let selected = selected
            .and_then(|i| data.get(i).map(|d| share(d, i)))
            .unwrap_or(0.0);
        Self { selected, top }
    }
}

thread_local! {
    /// The candidates' buffer of this thread's samples: one per thread, not per sequence (a
    /// 262,144-token vocabulary is 3 MiB of candidates; 64 sequences' buffers would fall out of
    /// the caches each step, where one per thread stays in them).
    static SCRATCH: std::cell::RefCell<Vec<LlamaTokenData>> = const { std::cell::RefCell::new(Vec::new()) };
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
        // Only the chain's shortlist, with nothing but bans before its cut and no
        // log-probability (which reads every logit) asked for: then the shortlist's tokens are
        // the `k + m` best by raw logit, which the device cuts (at least as many; the bans
        // among them are dropped by the chain, leaving at least `k`).
        let device_cut = shortlist
            .as_ref()
            .and_then(crate::backend::shortlist::Shortlist::len_without_window)
            .filter(|_| !penalize && p.logprobs.is_none())
            .filter(|_| biases.iter().all(|b| b.bias() == f32::NEG_INFINITY));
        // Kept only where each pick's are reported (and so taken off the queue).
        let kept = p
            .logprobs
            .filter(|_| p.post_sampling_probs)
            .map(|top| (top, VecDeque::new()));
        Ok(ChainSampler {
            chain,
            guide,
            shortlist,
            kept,
            device_cut,
        })
    }

    fn bind_sampler(&mut self, seq: i32, use_: SlotSampling<'_, ChainSampler>) {
        use super::device_cut::Need;
        if let Some(cuts) = self.cuts.as_mut() {
            let need = match use_ {
                SlotSampling::Idle => Need::Idle,
                SlotSampling::Whole => Need::Whole,
                SlotSampling::Sampler(s) => s.device_cut.map_or(Need::Whole, Need::Cut),
            };
            cuts.bind(seq, need);
        }
    }

    fn sample(&mut self, sampler: &mut ChainSampler, index: usize) -> Option<Token> {
        let row = self.row(i32::try_from(index).unwrap_or(i32::MAX));
        let model = self.model;
        pick(sampler, row, &|t| piece_bytes(model, t, true))
    }

    fn sample_many(&mut self, picks: &mut [Pick<'_, ChainSampler>]) {
        // The logits are read here, on the engine thread (llama.cpp waits for the decode on
        // the first read); the pool's threads get plain rows and the (thread-safe) model.
        let rows: Vec<Vec<Row<'_>>> = picks
            .iter()
            .map(|one| {
                (0..=one.draft.len())
                    .map(|j| self.row(i32::try_from(one.at + j).unwrap_or(i32::MAX)))
                    .collect()
            })
            .collect();
        let model = self.model;
        sample_rows(
            self.sampling_pool.as_ref(),
            picks,
            &rows,
            &|t| piece_bytes(model, t, true),
            &|t| (text_bytes(model, t), ends_generation(model, t)),
        );
    }

    fn logprobs(&self, index: usize, token: Token, top: usize, asked: &[Token]) -> TokenLogprob {
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
            asked: asked.iter().map(|&t| entry(t)).collect(),
        }
    }

    fn post_sampling_logprobs(
        &self,
        sampler: &mut ChainSampler,
        token: Token,
        top: usize,
    ) -> Option<TokenLogprob> {
        let survivors = sampler.kept.as_mut()?.1.pop_front()?;
        let entry = |t: Token, p: f32| TopLogprob {
            token: t,
            bytes: self.token_bytes(t),
            logprob: p.ln(),
        };
        Some(TokenLogprob {
            sampled: entry(token, survivors.selected),
            top: survivors
                .top
                .iter()
                .take(top)
                .map(|&(t, p)| entry(t.0, p))
                .collect(),
            asked: Vec::new(),
        })
    }
}

/// A token's bytes, for a grammar's guide (any thread may ask).
type PieceBytes<'a> = &'a (dyn Fn(LlamaToken) -> Vec<u8> + Sync);
/// A token's text as `Text::token_bytes` and `Text::is_eog` give it, for `Pick::give_text`
/// (any thread may ask).
type TokenText<'a> = &'a (dyn Fn(Token) -> (Vec<u8>, bool) + Sync);

/// What a position's sampler reads: every token's logit, in id order, or the candidates the
/// device cut (`--backend-sampling`: ids and raw logits, in the device's order).
#[derive(Clone, Copy, Debug)]
pub(super) enum Row<'a> {
    Whole(&'a [f32]),
    Cut(&'a [i32], &'a [f32]),
}

impl Default for Row<'_> {
    fn default() -> Self {
        Self::Whole(&[])
    }
}

/// The (token, logit) pairs of a device's cut (`ids`, `logits`, in the device's order), in id
/// order as the shortlist lists them.
fn cut_candidates(ids: &[i32], logits: &[f32]) -> Vec<(u32, f32)> {
    let mut listed: Vec<(u32, f32)> = ids
        .iter()
        .zip(logits)
        .filter_map(|(&t, &l)| Some((u32::try_from(t).ok()?, l)))
        .collect();
    listed.sort_unstable_by_key(|&(t, _)| t);
    listed.dedup_by_key(|c| c.0);
    listed
}

/// Runs each pick on its rows of logits (`rows[i][j]`: pick `i`'s position `at + j`), on the
/// pool when there is one and more than one pick, else in turn on this thread: the same
/// tokens either way, each sampler reading only its own rows.
fn sample_rows(
    pool: Option<&rayon::ThreadPool>,
    picks: &mut [Pick<'_, ChainSampler>],
    rows: &[Vec<Row<'_>>],
    bytes: PieceBytes<'_>,
    text: TokenText<'_>,
) {
    let one = |(p, rows): (&mut Pick<'_, ChainSampler>, &Vec<Row<'_>>)| {
        let at = p.at;
        p.run(|sampler, index| {
            let row = rows.get(index - at).copied().unwrap_or_default();
            pick(sampler, row, bytes)
        });
        p.give_text(text);
    };
    match pool {
        Some(pool) if picks.len() > 1 => {
            pool.install(|| picks.par_iter_mut().zip(rows).for_each(one));
        }
        _ => picks.iter_mut().zip(rows).for_each(one),
    }
}

/// Samples (and accepts) a request's next token from one row of logits (`n_vocab` of them, or
/// the candidates the device cut for a sampler that wants that): what `Sampling::sample` does,
/// on any thread (it reads nothing of the context). `None` when the grammar allows nothing
/// more, or the chain selected nothing.
fn pick(sampler: &mut ChainSampler, row: Row<'_>, bytes: PieceBytes<'_>) -> Option<Token> {
    let ChainSampler {
        chain,
        guide,
        shortlist,
        kept,
        ..
    } = sampler;
    let keep = kept.as_ref().map(|k| k.0);
    let mut survivors = None;
    // A cut row's sampler has no guide (a cut needs a shortlist, which a guide rules out).
    let (guide, logits) = match (guide.as_mut(), row) {
        (Some(guide), Row::Whole(logits)) => (guide, logits),
        (_, row) => {
            let token = match (row, shortlist.as_mut()) {
                // The device's cut holds the shortlist's best tokens and more (not the bans
                // it lacks, which the chain would drop): the chain's own top-k keeps the same
                // `k` of them, in id order as on the shortlist, and so picks the same token.
                (Row::Cut(ids, cut), list) => {
                    let listed = cut_candidates(ids, cut).into_iter();
                    let token = apply_chain(chain, listed, keep, &mut survivors)?.id();
                    if let Some(list) = list {
                        list.accept(token.0);
                    }
                    token
                }
                // What llama_sampler_sample does, on the shortlist instead of every token.
                (Row::Whole(logits), Some(list)) => {
                    let listed = list
                        .candidates(logits)
                        .into_iter()
                        .filter_map(|t| Some((t, *logits.get(usize::try_from(t).ok()?)?)));
                    let token = apply_chain(chain, listed, keep, &mut survivors)?.id();
                    list.accept(token.0);
                    token
                }
                // llama_sampler_sample itself: every token's logit, in id order.
                (Row::Whole(logits), None) => apply_chain(
                    chain,
                    (0u32..).zip(logits.iter().copied()),
                    keep,
                    &mut survivors,
                )?
                .id(),
            };
            chain.accept(token);
            if let (Some((_, queue)), Some(s)) = (kept.as_mut(), survivors) {
                queue.push_back(s);
            }
            return Some(token.0);
        }
    };
    // The chain picks from all logits; only when the guide refuses that pick does it pick
    // again among the tokens the grammar allows (the distribution is the masked one's:
    // a refused pick is redrawn). The chain and the guide are each told the choice once.
    let choose = |mask: Option<&llguidance::toktrie::SimpleVob>| {
        let allowed = (0u32..).zip(logits.iter().copied());
        let picked = match mask {
            None => apply_chain(chain, allowed, keep, &mut survivors),
            Some(m) => apply_chain(
                chain,
                allowed.filter(|&(t, _)| m.is_allowed(t)),
                keep,
                &mut survivors,
            ),
        };
        // A pick the chain banned (`ignore_eos` bans end-of-generation tokens) is none.
        picked
            .filter(|d| d.logit().is_finite())
            .and_then(|d| u32::try_from(d.id().0).ok())
    };
    let token = guide.choose(choose)?;
    let token = LlamaToken(i32::try_from(token).ok()?);
    chain.accept(token);
    guide.accept(token.0 as u32, &bytes(token));
    // The distribution of the chain's last run (the masked one, when the first pick was
    // refused).
    if let (Some((_, queue)), Some(s)) = (kept.as_mut(), survivors) {
        queue.push_back(s);
    }
    Some(token.0)
}

/// Runs `chain` on the `candidates` (token, logit) as `llama_sampler_sample` runs it on every
/// token's logit, without accepting the pick: the entry it selected, None when there were no
/// candidates or it selected none. The candidates are laid out in this thread's buffer. With
/// `keep` (`post_sampling_probs`), `survivors` gets what the chain left: the selected token's
/// probability and the `keep` most probable candidates'.
fn apply_chain(
    chain: &mut LlamaSampler,
    candidates: impl Iterator<Item = (u32, f32)>,
    keep: Option<usize>,
    survivors: &mut Option<Survivors>,
) -> Option<LlamaTokenData> {
    SCRATCH.with(|scratch| {
        let mut data = std::mem::take(&mut *scratch.borrow_mut());
        data.clear();
        data.extend(candidates.filter_map(|(t, logit)| {
            Some(LlamaTokenData::new(
                LlamaToken(i32::try_from(t).ok()?),
                logit,
                0.0,
            ))
        }));
        if data.is_empty() {
            *scratch.borrow_mut() = data;
            return None;
        }
        let mut array = LlamaTokenDataArray::new(data, false);
        array.apply_sampler(chain);
        let picked = array.selected.and_then(|i| array.data.get(i)).copied();
        if let Some(keep) = keep {
            *survivors = Some(Survivors::of(&array.data, array.selected, keep));
        }
        *scratch.borrow_mut() = array.data;
        picked
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};

    /// A request's chain as `new_sampler` builds it for a few common settings, without a
    /// model: 0 OpenAI's defaults (top-k 40, temperature 1), 1 the whole vocabulary
    /// (temperature 1), 2 Ollama's (penalties, top-k 40, top-p 0.9, temperature 0.8),
    /// 3 greedy, 4 min-p and top-p without top-k.
    fn chain(kind: u8, n_vocab: i32, seed: u32) -> ChainSampler {
        use crate::backend::shortlist::Shortlist;
        let (stages, shortlist) = match kind {
            0 => (
                vec![
                    LlamaSampler::top_k(40),
                    LlamaSampler::temp(1.0),
                    LlamaSampler::dist(seed),
                ],
                Shortlist::new(40, &[], None),
            ),
            1 => (
                vec![LlamaSampler::temp(1.0), LlamaSampler::dist(seed)],
                None,
            ),
            2 => (
                vec![
                    LlamaSampler::penalties(n_vocab, 64, 1.1, 0.0, 0.0),
                    LlamaSampler::top_k(40),
                    LlamaSampler::top_p(0.9, 1),
                    LlamaSampler::temp(0.8),
                    LlamaSampler::dist(seed),
                ],
                Shortlist::new(40, &[], Some(64)),
            ),
            3 => (vec![LlamaSampler::greedy()], Shortlist::new(1, &[], None)),
            _ => (
                vec![
                    LlamaSampler::min_p(0.02, 1),
                    LlamaSampler::top_p(0.95, 1),
                    LlamaSampler::temp(0.7),
                    LlamaSampler::dist(seed),
                ],
                None,
            ),
        };
        ChainSampler {
            chain: LlamaSampler::chain_simple(stages),
            guide: None,
            shortlist,
            kept: None,
            device_cut: None,
        }
    }

    /// Tokens kind 5's chain bans (as `ignore_eos` bans the end-of-generation tokens).
    const BANS: [i32; 3] = [5, 17, 99];

    /// A chain whose first cut the device may make (`device_cut`): 0 OpenAI's defaults,
    /// 3 greedy, 5 bans then top-k 40, top-p 0.9, temperature 0.8.
    fn cut_chain(kind: u8, n_vocab: i32, seed: u32) -> ChainSampler {
        use crate::backend::shortlist::Shortlist;
        let mut sampler = if kind == 5 {
            let bans: Vec<LlamaLogitBias> = BANS
                .iter()
                .map(|&t| LlamaLogitBias::new(LlamaToken(t), f32::NEG_INFINITY))
                .collect();
            ChainSampler {
                chain: LlamaSampler::chain_simple([
                    LlamaSampler::logit_bias(n_vocab, &bans),
                    LlamaSampler::top_k(40),
                    LlamaSampler::top_p(0.9, 1),
                    LlamaSampler::temp(0.8),
                    LlamaSampler::dist(seed),
                ]),
                guide: None,
                shortlist: Shortlist::new(40, &BANS, None),
                kept: None,
                device_cut: None,
            }
        } else {
            chain(kind, n_vocab, seed)
        };
        sampler.device_cut = sampler
            .shortlist
            .as_ref()
            .and_then(Shortlist::len_without_window);
        sampler
    }

    /// The device's cut of `row`, its `k` best: their ids and logits, in an order of the
    /// device's (here shuffled).
    fn device_cut(rng: &mut rand::rngs::StdRng, row: &[f32], k: usize) -> (Vec<i32>, Vec<f32>) {
        let mut ids: Vec<usize> = (0..row.len()).collect();
        ids.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        ids.truncate(k);
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.random_range(0..=i));
        }
        (
            ids.iter().map(|&i| i32::try_from(i).unwrap()).collect(),
            ids.iter().map(|&i| row[i]).collect(),
        )
    }

    /// Logits with a few likely tokens and a long tail.
    fn row(rng: &mut rand::rngs::StdRng, n_vocab: usize) -> Vec<f32> {
        (0..n_vocab)
            .map(|_| {
                let u: f32 = rng.random_range(0.0..1.0);
                8.0 * u * u * u + rng.random_range(-0.5..0.5)
            })
            .collect()
    }

    fn argmax(row: &[f32]) -> Token {
        (0..row.len())
            .max_by(|&a, &b| row[a].total_cmp(&row[b]))
            .and_then(|i| Token::try_from(i).ok())
            .unwrap_or(0)
    }

    /// With `post_sampling_probs`, each pick keeps the chain's survivors as shares of one:
    /// top-k 40 leaves at most 40, summing to 1 with the sampled token among them; greedy puts
    /// all of it on its pick; the picks are reported once each, in order.
    #[test]
    fn post_sampling_probabilities_are_the_chains_survivors() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let bytes = |_: LlamaToken| Vec::new();
        for kind in [0u8, 2, 3, 4] {
            let mut sampler = chain(kind, 500, 11);
            sampler.kept = Some((50, VecDeque::new()));
            let mut picked = Vec::new();
            for _ in 0..3 {
                let logits = row(&mut rng, 500);
                picked.push(pick(&mut sampler, Row::Whole(&logits), &bytes).unwrap());
            }
            let queue = &sampler.kept.as_ref().unwrap().1;
            assert_eq!(queue.len(), 3);
            for (s, &token) in queue.iter().zip(&picked) {
                let sum: f32 = s.top.iter().map(|&(_, p)| p).sum();
                assert!(
                    s.top.iter().all(|&(_, p)| p > 0.0 && p <= 1.0),
                    "kind {kind}"
                );
                assert!(s.top.windows(2).all(|w| w[0].1 >= w[1].1), "kind {kind}");
                assert!(s.selected > 0.0, "kind {kind}");
                // Kind 4 (min-p, top-p) may leave more survivors than are kept.
                let listed = s.top.iter().any(|&(t, _)| t.0 == token);
                assert!(listed || kind == 4, "kind {kind}");
                match kind {
                    3 => assert_eq!(s.top, vec![(LlamaToken(token), 1.0)]),
                    0 | 2 => {
                        assert!(
                            s.top.len() <= 40 && (sum - 1.0).abs() < 1e-4,
                            "{kind} {sum}"
                        );
                    }
                    _ => assert!(sum <= 1.0 + 1e-4, "{kind} {sum}"),
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Over several steps, a pool samples every sequence as sampling them one after
        /// another does: the same tokens, drafts accepted as far, the samplers' states (seeds,
        /// penalty windows) moving alike.
        #[test]
        fn a_pool_samples_what_one_thread_does(
            seed in any::<u64>(),
            kinds in prop::collection::vec(0u8..5, 2..12),
            threads in 2usize..5,
            n_vocab in 200usize..3000,
            steps in 1usize..5,
        ) {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let vocab = i32::try_from(n_vocab).unwrap();
            let make = || -> Vec<ChainSampler> {
                kinds
                    .iter()
                    .enumerate()
                    .map(|(i, &k)| chain(k, vocab, 7 + i as u32))
                    .collect()
            };
            let (mut alone, mut pooled) = (make(), make());
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let span = tracing::Span::none();
            let bytes = |_: LlamaToken| Vec::new();
            for _ in 0..steps {
                // Each sequence's rows (its next token and up to 3 drafted positions); a
                // greedy sequence's draft follows its rows' best tokens for a while.
                let rows: Vec<Vec<Vec<f32>>> = kinds
                    .iter()
                    .map(|_| (0..rng.random_range(1..=4)).map(|_| row(&mut rng, n_vocab)).collect())
                    .collect();
                let drafts: Vec<Vec<Token>> = rows
                    .iter()
                    .map(|r| {
                        let agree = rng.random_range(0..r.len());
                        (1..r.len())
                            .map(|j| if j <= agree { argmax(&r[j - 1]) } else { rng.random_range(0..vocab) })
                            .collect()
                    })
                    .collect();
                let views: Vec<Vec<Row<'_>>> = rows
                    .iter()
                    .map(|r| r.iter().map(|l| Row::Whole(l)).collect())
                    .collect();
                let run = |samplers: &mut [ChainSampler], pool: Option<&rayon::ThreadPool>| {
                    // What each pick handed its text (`give_text`), on whichever thread.
                    let mut given: Vec<Vec<(Token, Vec<u8>, bool)>> = vec![Vec::new(); samplers.len()];
                    let mut picks: Vec<Pick<'_, ChainSampler>> = samplers
                        .iter_mut()
                        .zip(&drafts)
                        .zip(given.iter_mut())
                        .map(|((sampler, draft), seen)| {
                            let text: crate::backend::PickedText<'_> =
                                Box::new(move |t, b: &[u8], eog| seen.push((t, b.to_vec(), eog)));
                            Pick { sampler, at: 0, draft, span: &span, tokens: Vec::new(), text: Some(text) }
                        })
                        .collect();
                    sample_rows(pool, &mut picks, &views, &bytes, &|t| (t.to_le_bytes().to_vec(), t % 7 == 0));
                    let tokens = picks.into_iter().map(|p| p.tokens).collect::<Vec<_>>();
                    (tokens, given)
                };
                let (one, one_given) = run(&mut alone, None);
                let (many, many_given) = run(&mut pooled, Some(&pool));
                prop_assert_eq!(&one, &many);
                // Every pick sampled at least its next token, and handed that one alone to its
                // text, with the bytes and end of generation the backend says.
                prop_assert!(one.iter().all(|t| !t.is_empty() && t[0].is_some()));
                prop_assert_eq!(&one_given, &many_given);
                for (tokens, given) in one.iter().zip(&one_given) {
                    let t = tokens[0].unwrap_or(-1);
                    prop_assert_eq!(given, &vec![(t, t.to_le_bytes().to_vec(), t % 7 == 0)]);
                }
            }
        }

        /// A sampler that wants its first cut made on the device (`--backend-sampling`) picks
        /// from the device's candidates (as many as the shortlist holds, or the wider cut every
        /// chain gets, in whatever order they come) what it picks from the whole row: the same
        /// tokens over several steps, and the same survivors reported.
        #[test]
        fn a_device_cut_picks_what_the_whole_row_does(
            seed in any::<u64>(),
            kind in prop::sample::select(vec![0u8, 3, 5]),
            n_vocab in 200usize..3000,
            steps in 1usize..8,
            banned_high in any::<bool>(),
            wide in any::<bool>(),
        ) {
            let vocab = i32::try_from(n_vocab).unwrap();
            let (mut whole, mut cut) = (cut_chain(kind, vocab, 9), cut_chain(kind, vocab, 9));
            whole.kept = Some((20, VecDeque::new()));
            cut.kept = Some((20, VecDeque::new()));
            // The shortlist's size (k and the bans), or a wider cut (a slot's chain may be).
            let listed = cut.device_cut.unwrap();
            prop_assert_eq!(listed, if kind == 5 { 43 } else if kind == 3 { 1 } else { 40 });
            let k = if wide { crate::backend::shortlist::MAX_SHORTLIST } else { listed };
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let bytes = |_: LlamaToken| Vec::new();
            for _ in 0..steps {
                let mut logits = row(&mut rng, n_vocab);
                if banned_high {
                    // The banned tokens among the best: the device's cut holds them, and the
                    // chain drops them.
                    // Apart, not equal: equal logits may come out of two sorts in either
                    // order, on the host as between the host and the device.
                    for &t in &BANS {
                        logits[usize::try_from(t).unwrap()] = 20.0 + t as f32 / 100.0;
                    }
                }
                let (ids, cut_logits) = device_cut(&mut rng, &logits, k);
                let a = pick(&mut whole, Row::Whole(&logits), &bytes);
                let b = pick(&mut cut, Row::Cut(&ids, &cut_logits), &bytes);
                prop_assert!(a.is_some());
                prop_assert_eq!(a, b);
                if kind == 5 {
                    prop_assert!(!BANS.contains(&a.unwrap()));
                }
            }
            let survivors = |s: &ChainSampler| -> Vec<(f32, Vec<(i32, f32)>)> {
                s.kept.as_ref().unwrap().1.iter()
                    .map(|v| (v.selected, v.top.iter().map(|&(t, p)| (t.0, p)).collect()))
                    .collect()
            };
            prop_assert_eq!(survivors(&whole), survivors(&cut));
        }
    }
}
