//! One sequence's grammar on the engine thread. Sampling asks the guide about the token the
//! sampler picked from the unmasked logits first (one walk of that token's bytes through the
//! lexer, microseconds); only when it is not allowed does the guide compute the mask of allowed
//! tokens and the sampler pick again among those (llama-server samples the same way). Mask work
//! per token is bounded by llguidance's step fuel; a grammar that runs out of it ends its
//! sequence, never the engine.

use std::time::{Duration, Instant};

use llguidance::toktrie::{SimpleVob, TokEnv};
use llguidance::Matcher;

use super::trigger::Found;
use super::{Compiled, Grammar, Trigger};

/// Keep at most this much recent output for a lazy grammar's triggers (a literal trigger, or
/// the start of a call that began a few tokens ago, is far shorter).
const WATCH_KEEP: usize = 256;

/// A lazy grammar waiting for its trigger: the recent output, as bytes and as tokens.
struct Watch {
    triggers: Vec<Trigger>,
    text: Vec<u8>,
    /// Each recent token with where its bytes start in `text`.
    tokens: Vec<(u32, usize)>,
}

/// Counts of the guide's work, for logs and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GuideStats {
    /// Sampled tokens checked against the grammar.
    pub checks: u64,
    /// Masks computed (the sampled token was not allowed).
    pub masks: u64,
    /// Time spent computing masks.
    pub mask_time: Duration,
}

impl Drop for Guide {
    fn drop(&mut self) {
        let s = self.stats;
        super::stats::stats().sequence(s.checks, s.masks, s.mask_time);
        tracing::debug!(
            checks = s.checks,
            masks = s.masks,
            mask_ms = s.mask_time.as_secs_f64() * 1000.0,
            "grammar work of a finished sequence"
        );
    }
}

/// A sequence's grammar state.
pub struct Guide {
    matcher: Matcher,
    env: Option<TokEnv>,
    eog: std::sync::Arc<[u32]>,
    watch: Option<Watch>,
    /// A lazy grammar none of whose triggers can match any more: the output is free text.
    free: bool,
    ended: bool,
    /// What the guide has done so far.
    pub stats: GuideStats,
}

impl Guide {
    /// The guide of a request's grammar, if it has one. The validation layer compiles every
    /// grammar before the request is queued; one that reaches a backend uncompiled is an error.
    pub fn for_request(grammar: Option<&Grammar>) -> Result<Option<Self>, String> {
        grammar
            .map(|g| {
                g.compiled
                    .as_ref()
                    .map(|c| Self::new(c, &g.triggers))
                    .ok_or_else(|| "the grammar was not compiled".to_string())
            })
            .transpose()
    }

    /// A guide for one sequence, constraining from the first token or, with `triggers`, from
    /// the first trigger in the output.
    pub fn new(compiled: &Compiled, triggers: &[Trigger]) -> Self {
        let matcher = compiled.matcher.clone();
        let env = matcher.tok_env().ok();
        let eog = compiled.eog.clone();
        let watch = (!triggers.is_empty()).then(|| Watch {
            triggers: triggers.to_vec(),
            text: Vec::new(),
            tokens: Vec::new(),
        });
        Self {
            matcher,
            env,
            eog,
            watch,
            free: false,
            ended: false,
            stats: GuideStats::default(),
        }
    }

    /// The grammar allows nothing more (complete, at a dead end, or out of fuel): the
    /// sequence ends.
    pub fn ended(&self) -> bool {
        !self.free && (self.ended || self.matcher.is_stopped() || self.matcher.is_error())
    }

    /// Whether the grammar constrains the next token (false while a lazy grammar waits).
    pub fn constraining(&self) -> bool {
        self.watch.is_none() && !self.free
    }

    fn is_eog(&self, token: u32) -> bool {
        self.eog.contains(&token)
    }

    /// Whether `token` may come next. An end-of-generation token may when the grammar is
    /// complete.
    pub fn allows(&mut self, token: u32) -> bool {
        self.stats.checks += 1;
        if self.is_eog(token) {
            return self.matcher.is_accepting().unwrap_or(false);
        }
        self.matcher.validate_tokens(&[token]).is_ok_and(|n| n == 1)
    }

    /// The tokens that may come next (end-of-generation ones when the grammar is complete);
    /// `None` when none may (the grammar failed or ran out of fuel).
    pub fn mask(&mut self) -> Option<SimpleVob> {
        let start = Instant::now();
        let mask = self.matcher.compute_mask();
        self.stats.masks += 1;
        self.stats.mask_time += start.elapsed();
        let mut mask = match mask {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "the grammar failed; the sequence ends");
                self.ended = true;
                return None;
            }
        };
        let accepting = self.matcher.is_accepting().unwrap_or(false);
        for &t in self.eog.iter() {
            if (t as usize) < mask.len() {
                mask.set(t as usize, accepting);
            }
        }
        (!mask.is_zero()).then_some(mask)
    }

    /// Picks the next token: `pick(None)` picks from all tokens, `pick(Some(mask))` among the
    /// allowed ones only; it is called a second time only when the grammar refuses the first
    /// pick. `None` when the grammar allows nothing (the sequence ends). The caller then
    /// `accept`s the token.
    pub fn choose(
        &mut self,
        mut pick: impl FnMut(Option<&SimpleVob>) -> Option<u32>,
    ) -> Option<u32> {
        if self.ended() {
            return None;
        }
        if !self.constraining() {
            return pick(None);
        }
        if let Some(t) = pick(None) {
            if self.allows(t) {
                return Some(t);
            }
        }
        let mask = self.mask()?;
        let t = pick(Some(&mask)).filter(|&t| mask.is_allowed(t));
        if t.is_none() {
            // Every allowed token banned by the sampler too (`ignore_eos` with only an
            // end-of-generation token allowed): done.
            self.ended = true;
        }
        t
    }

    /// Takes the chosen token (`bytes`: its text, special tokens as their text, for the
    /// triggers of a lazy grammar).
    pub fn accept(&mut self, token: u32, bytes: &[u8]) {
        if self.free {
            return;
        }
        if self.watch.is_some() {
            self.observe(token, bytes);
            return;
        }
        if self.is_eog(token) {
            self.ended = true;
            return;
        }
        if let Err(e) = self.matcher.consume_token(token) {
            tracing::warn!(error = %e, "the grammar refused a token; the sequence ends");
            self.ended = true;
        }
    }

    /// A token of a lazy grammar's free text: starts the grammar when a trigger matched.
    fn observe(&mut self, token: u32, bytes: &[u8]) {
        let Some(w) = self.watch.as_mut() else {
            return;
        };
        w.tokens.push((token, w.text.len()));
        w.text.extend_from_slice(bytes);
        let mut start = None;
        w.triggers.retain(|t| match t.find(&w.text, bytes.len()) {
            Found::At(at) => {
                start = Some(start.map_or(at, |s: usize| s.min(at)));
                true
            }
            Found::NotYet => true,
            Found::Never => false,
        });
        let Some(at) = start else {
            if w.triggers.is_empty() {
                // No trigger can match any more: the rest is free text.
                self.watch = None;
                self.free = true;
            } else if w.text.len() > 4 * WATCH_KEEP {
                let cut = w.text.len() - WATCH_KEEP;
                w.text.drain(..cut);
                w.tokens.retain_mut(|(_, s)| {
                    if *s >= cut {
                        *s -= cut;
                        true
                    } else {
                        false
                    }
                });
            }
            return;
        };
        // The grammar takes the output from the trigger on: the token the match starts in
        // (its tail, tokenized again when the match starts inside it), then the later ones.
        let Watch { text, tokens, .. } = self.watch.take().expect("checked above");
        let first = tokens.iter().rposition(|&(_, s)| s <= at).unwrap_or(0);
        let mut feed = Vec::new();
        let (tok, s) = tokens[first];
        if s == at {
            feed.push(tok);
        } else {
            let end = tokens.get(first + 1).map_or(text.len(), |&(_, e)| e);
            if let Some(env) = &self.env {
                feed.extend(env.tokenize_bytes(&text[at..end]));
            }
        }
        feed.extend(tokens[first + 1..].iter().map(|&(t, _)| t));
        if let Err(e) = self.matcher.consume_tokens(&feed) {
            tracing::warn!(error = %e, "the output at the trigger does not fit the grammar");
            self.ended = true;
        }
    }
}
