//! Embedding requests on the engine thread: served one at a time, one piece per turn of the
//! loop between decode steps (so generating streams keep flowing), on the backend's own
//! embedding context.

use std::collections::VecDeque;

use crate::backend::{Embeddings, Text};
use crate::kv;
use crate::protocol::{
    EmbedRequest, Embedding, EngineError, EngineErrorKind, EngineObserver, Token,
};

/// An embedding input in progress.
struct EmbedJob {
    request: EmbedRequest,
    tokens: Vec<Token>,
    /// Tokens decoded so far.
    done: usize,
    truncated: bool,
}

/// The embedding requests waiting, and the one being decoded.
#[derive(Default)]
pub struct EmbedQueue {
    waiting: VecDeque<EmbedRequest>,
    current: Option<EmbedJob>,
}

impl EmbedQueue {
    /// A request joins the queue.
    pub fn push(&mut self, request: EmbedRequest) {
        self.waiting.push_back(request);
    }

    /// Nothing to embed.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.current.is_none()
    }

    /// Decodes the next piece of the oldest request (starting it if none is in progress), and
    /// answers it once its last piece is decoded.
    pub fn step(&mut self, backend: &mut (impl Embeddings + Text), observer: &dyn EngineObserver) {
        if self.current.is_none() {
            let Some(request) = self.waiting.pop_front() else {
                return;
            };
            if request.reply.is_closed() {
                return;
            }
            match embed_tokens(backend, &request) {
                Ok((tokens, truncated)) => {
                    self.current = Some(EmbedJob {
                        request,
                        tokens,
                        done: 0,
                        truncated,
                    });
                }
                Err(e) => {
                    let _ = request.reply.send(Err(e));
                    return;
                }
            }
        }
        let Some(mut job) = self.current.take() else {
            return;
        };
        if job.request.reply.is_closed() {
            return; // the client left: the rest of its input is not decoded
        }
        let end = (job.done + backend.embed_piece().max(1)).min(job.tokens.len());
        let last = end == job.tokens.len();
        let result = backend.embed(&job.tokens[job.done..end], job.done, last);
        if result.is_ok() {
            observer.decoded(1);
        }
        match result {
            Ok(None) => {
                job.done = end;
                self.current = Some(job);
            }
            Ok(Some(vector)) => {
                observer.embedded(job.tokens.len());
                let _ = job.request.reply.send(Ok(Embedding {
                    vector,
                    prompt_eval_count: job.tokens.len(),
                    truncated: job.truncated,
                }));
            }
            Err(e) => {
                let err = EngineError::new(EngineErrorKind::Internal, e.to_string());
                let _ = job.request.reply.send(Err(err));
            }
        }
    }

    /// Answers every request, the one in progress included, with `err`.
    pub fn fail_all(&mut self, err: &EngineError) {
        if let Some(job) = self.current.take() {
            let _ = job.request.reply.send(Err(err.clone()));
        }
        for r in self.waiting.drain(..) {
            let _ = r.reply.send(Err(err.clone()));
        }
    }
}

/// An embedding request's tokens (tokenizing its text if the HTTP side did not), fitted into
/// the embedding context; and whether they were cut.
fn embed_tokens(
    backend: &(impl Embeddings + Text),
    request: &EmbedRequest,
) -> Result<(Vec<Token>, bool), EngineError> {
    let mut tokens = crate::sched::input_tokens(backend, &request.content, "content")?;
    let cut = kv::fit_input(&mut tokens, request.truncate, backend.embed_capacity())
        .map_err(crate::sched::too_long)?;
    Ok((tokens, cut))
}
