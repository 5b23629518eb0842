//! The fake backend's sampling: its sampler (a seed and a grammar), its picks, which follow
//! the fake model's next token (`FakeBackend::next_token`), and its log-probabilities.

use super::{FakeBackend, FakeText, BOS, EOS};
use crate::backend::{Sampling, Text};
use crate::protocol::params::SamplingParams;
use crate::protocol::{BackendError, TextModel, Token, TokenLogprob, TopLogprob};

/// The fake's sampler: the seed, which shifts the output, and the request's grammar. Under a
/// grammar the fake's own pick is kept when the grammar allows it; otherwise the first allowed
/// token in an order that the same pick decides.
pub struct FakeSampler {
    offset: u64,
    guide: Option<crate::constrain::Guide>,
}

impl std::fmt::Debug for FakeSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeSampler")
            .field("offset", &self.offset)
            .field("guide", &self.guide.is_some())
            .finish()
    }
}

impl Sampling for FakeBackend {
    type Sampler = FakeSampler;

    fn new_sampler(
        &self,
        params: &SamplingParams,
        _history: &[Token],
    ) -> Result<FakeSampler, BackendError> {
        if let Some((token, _)) = params
            .logit_bias
            .iter()
            .find(|(t, _)| !(0..=BOS).contains(t))
        {
            return Err(BackendError::Sampler(format!(
                "logit_bias: token {token} is not in the vocabulary (0..{})",
                BOS + 1
            )));
        }
        let offset = if params.greedy() {
            0
        } else {
            u64::from(params.effective_seed())
        };
        let guide = crate::constrain::Guide::for_request(params.grammar.as_ref())
            .map_err(BackendError::Sampler)?;
        Ok(FakeSampler { offset, guide })
    }

    fn sample(&mut self, sampler: &mut FakeSampler, index: usize) -> Option<Token> {
        let (seq, pos) = *self
            .outputs
            .get(&index)
            .expect("sampled a batch index without logits (scheduler bug)");
        let history = &self.kv[&seq][..=pos];
        let own = if self.config.eos_at.is_some_and(|n| history.len() >= n) {
            EOS
        } else {
            let context = match self.config.markov {
                Some(n) => &history[history.len().saturating_sub(n)..],
                None => history,
            };
            Self::next_token(context, sampler.offset)
        };
        let Some(guide) = sampler.guide.as_mut() else {
            return Some(own);
        };
        // The logits' order, in the fake: its own pick, then EOS, then the bytes from the pick
        // on (printable ones first).
        let order = |mask: &llguidance::toktrie::SimpleVob| {
            let start = own.clamp(0, 255) as usize;
            std::iter::once(own)
                .chain(std::iter::once(EOS))
                .chain((0..256).map(|i| ((start + i) % 256) as Token))
                .filter(|&t| (32..127).contains(&t) || t == EOS || t == own)
                .chain((0..256).map(|i| ((start + i) % 256) as Token))
                .find(|&t| mask.is_allowed(t as u32))
        };
        let token = guide.choose(|mask| match mask {
            None => Some(own as u32),
            Some(m) => order(m).map(|t| t as u32),
        })?;
        guide.accept(token, &FakeText.piece(token as Token));
        Some(token as Token)
    }

    /// The step's picks in reverse order: the scheduler must not depend on the order a
    /// backend samples its sequences in (a pool samples them all at once).
    fn sample_many(&mut self, picks: &mut [crate::backend::Pick<'_, FakeSampler>]) {
        for pick in picks.iter_mut().rev() {
            pick.run(|sampler, index| self.sample(sampler, index));
            if !self.config.text_on_engine {
                pick.give_text(|t| (self.token_bytes(t), self.is_eog(t)));
            }
        }
    }

    fn logprobs(&self, index: usize, token: Token, top: usize, asked: &[Token]) -> TokenLogprob {
        assert!(
            self.outputs.contains_key(&index),
            "log-probabilities of batch index {index}, which has no logits (scheduler bug)"
        );
        // The sampled token is the likeliest (-0.1); then the other letters in order.
        let entry = |token: Token, logprob: f32| TopLogprob {
            token,
            bytes: self.token_bytes(token),
            logprob,
        };
        let mut alternatives = vec![entry(token, -0.1)];
        alternatives.extend(
            (b'a' as Token..=b'z' as Token)
                .filter(|&t| t != token)
                .enumerate()
                .map(|(i, t)| entry(t, -1.0 - i as f32)),
        );
        alternatives.truncate(top);
        // An asked token's: the sampled one's, else the letters' by their place, else -20.
        let asked = asked
            .iter()
            .map(|&t| {
                let logprob = if t == token {
                    -0.1
                } else {
                    (b'a' as Token..=b'z' as Token)
                        .filter(|&l| l != token)
                        .position(|l| l == t)
                        .map_or(-20.0, |i| -1.0 - i as f32)
                };
                entry(t, logprob)
            })
            .collect();
        TokenLogprob {
            sampled: entry(token, -0.1),
            top: alternatives,
            asked,
        }
    }

    /// The fake's picks are certain: the sampled token holds all the probability.
    fn post_sampling_logprobs(
        &self,
        _sampler: &mut FakeSampler,
        token: Token,
        top: usize,
    ) -> Option<TokenLogprob> {
        let sampled = TopLogprob {
            token,
            bytes: self.token_bytes(token),
            logprob: 0.0,
        };
        let top = if top > 0 {
            vec![sampled.clone()]
        } else {
            Vec::new()
        };
        Some(TokenLogprob {
            sampled,
            top,
            asked: Vec::new(),
        })
    }
}
