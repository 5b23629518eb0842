//! llama.cpp's log, captured around a call so that a failed load can say why.

/// Runs a llama.cpp call that may fail; its error says why in llama.cpp's words (the ERROR
/// lines it logged meanwhile, joined) when it logged any, else it is the call's own error
/// (llama-cpp-2 often says only "null reference").
pub(super) fn llama_result<T, E: std::fmt::Display>(
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, String> {
    let (out, errors) = with_llama_errors(f);
    out.map_err(|e| {
        if errors.is_empty() {
            e.to_string()
        } else {
            errors.join("; ")
        }
    })
}

/// Runs `f` and returns, besides its result, the ERROR messages llama.cpp logged meanwhile on
/// this thread, so that a failed model load can say why. Every event still reaches the
/// process's subscriber as usual.
fn with_llama_errors<T>(f: impl FnOnce() -> T) -> (T, Vec<String>) {
    use std::sync::{Arc, Mutex};
    use tracing::span::{Attributes, Id, Record};
    use tracing::subscriber::Interest;
    use tracing::{Event, Level, Metadata};

    struct Tee {
        inner: tracing::Dispatch,
        errors: Arc<Mutex<Vec<String>>>,
    }
    impl tracing::Subscriber for Tee {
        fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
            self.inner.register_callsite(metadata);
            Interest::sometimes()
        }
        fn enabled(&self, metadata: &Metadata<'_>) -> bool {
            *metadata.level() == Level::ERROR || self.inner.enabled(metadata)
        }
        fn new_span(&self, span: &Attributes<'_>) -> Id {
            self.inner.new_span(span)
        }
        fn record(&self, span: &Id, values: &Record<'_>) {
            self.inner.record(span, values);
        }
        fn record_follows_from(&self, span: &Id, follows: &Id) {
            self.inner.record_follows_from(span, follows);
        }
        fn event(&self, event: &Event<'_>) {
            if *event.metadata().level() == Level::ERROR {
                let mut message = Message(String::new());
                event.record(&mut message);
                if !message.0.is_empty() {
                    if let Ok(mut errors) = self.errors.lock() {
                        errors.push(message.0);
                    }
                }
            }
            if self.inner.enabled(event.metadata()) {
                self.inner.event(event);
            }
        }
        fn enter(&self, span: &Id) {
            self.inner.enter(span);
        }
        fn exit(&self, span: &Id) {
            self.inner.exit(span);
        }
        fn clone_span(&self, id: &Id) -> Id {
            self.inner.clone_span(id)
        }
        fn try_close(&self, id: Id) -> bool {
            self.inner.try_close(id)
        }
    }

    let errors = Arc::new(Mutex::new(Vec::new()));
    let tee = Tee {
        inner: tracing::dispatcher::get_default(Clone::clone),
        errors: errors.clone(),
    };
    let out = tracing::subscriber::with_default(tee, f);
    let errors = errors.lock().map(|e| e.clone()).unwrap_or_default();
    (out, errors)
}

/// What llama.cpp logs when a state does not fit the buffer it was given
/// (`state_seq_get_data` in llama-context.cpp: "error saving state: unexpectedly reached end of
/// buffer"), which `state_read.rs` expects and handles.
const SHORT_BUFFER: &str = "unexpectedly reached end of buffer";

/// Runs `f`, a llama.cpp call whose short-buffer failure the caller handles (a state read into a
/// buffer that may prove too small, then read again), without passing llama.cpp's ERROR line
/// for that on to the process's subscriber: it would report a failure that did not happen.
/// Every other event passes, other ERROR lines among them (a GPU error found when the call
/// synchronizes is logged just before llama.cpp aborts). The filtering subscriber is made once
/// per thread and forwards each callsite's interest as the process's subscriber decides it, so
/// it changes what is logged or checked nowhere else (making a subscriber per call would
/// rebuild every callsite's interest).
pub(super) fn without_short_buffer_error<T>(f: impl FnOnce() -> T) -> T {
    thread_local! {
        static QUIET: tracing::Dispatch = tracing::Dispatch::new(ShortBufferDropped {
            inner: tracing::dispatcher::get_default(Clone::clone),
            max_level: tracing::level_filters::LevelFilter::current(),
        });
    }
    QUIET.with(|quiet| tracing::dispatcher::with_default(quiet, f))
}

/// A subscriber that passes everything to `inner` but llama.cpp's short-buffer ERROR line.
struct ShortBufferDropped {
    inner: tracing::Dispatch,
    /// The most verbose level enabled when it was made (no hint would let every level past
    /// the macros' static check).
    max_level: tracing::level_filters::LevelFilter,
}

/// An event's `message` field, trimmed (llama-cpp-2 puts llama.cpp's text there, with its
/// newline).
struct Message(String);

impl tracing::field::Visit for Message {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "message" {
            self.0 = value.trim().to_string();
        }
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" && self.0.is_empty() {
            self.0 = format!("{value:?}").trim().to_string();
        }
    }
}

impl tracing::Subscriber for ShortBufferDropped {
    fn register_callsite(
        &self,
        metadata: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        self.inner.register_callsite(metadata)
    }
    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(self.max_level)
    }
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        self.inner.enabled(metadata)
    }
    fn new_span(&self, span: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        self.inner.new_span(span)
    }
    fn record(&self, span: &tracing::span::Id, values: &tracing::span::Record<'_>) {
        self.inner.record(span, values);
    }
    fn record_follows_from(&self, span: &tracing::span::Id, follows: &tracing::span::Id) {
        self.inner.record_follows_from(span, follows);
    }
    fn event(&self, event: &tracing::Event<'_>) {
        if *event.metadata().level() == tracing::Level::ERROR {
            let mut message = Message(String::new());
            event.record(&mut message);
            if message.0.contains(SHORT_BUFFER) {
                return;
            }
        }
        self.inner.event(event);
    }
    fn enter(&self, span: &tracing::span::Id) {
        self.inner.enter(span);
    }
    fn exit(&self, span: &tracing::span::Id) {
        self.inner.exit(span);
    }
    fn clone_span(&self, id: &tracing::span::Id) -> tracing::span::Id {
        self.inner.clone_span(id)
    }
    fn try_close(&self, id: tracing::span::Id) -> bool {
        self.inner.try_close(id)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::without_short_buffer_error;

    /// A subscriber that keeps every event's level and message.
    struct Kept(Arc<Mutex<Vec<(tracing::Level, String)>>>);

    impl tracing::Subscriber for Kept {
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, event: &tracing::Event<'_>) {
            let mut message = super::Message(String::new());
            event.record(&mut message);
            if let Ok(mut kept) = self.0.lock() {
                kept.push((*event.metadata().level(), message.0));
            }
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }

    #[test]
    fn only_the_short_buffer_error_is_kept_out_of_the_log() {
        let kept = Arc::new(Mutex::new(Vec::new()));
        // On a thread of its own: the filter takes the thread's subscriber at its first use.
        let sink = kept.clone();
        std::thread::spawn(move || {
            tracing::subscriber::with_default(Kept(sink), || {
                without_short_buffer_error(|| {
                    tracing::error!("state_seq_get_data: error saving state: unexpectedly reached end of buffer");
                    tracing::error!("CUDA error: an illegal memory access was encountered");
                    tracing::warn!("a warning");
                });
                tracing::error!("after: unexpectedly reached end of buffer");
            });
        })
        .join()
        .ok();
        let kept = kept.lock().map(|k| k.clone()).unwrap_or_default();
        let messages: Vec<&str> = kept.iter().map(|(_, m)| m.as_str()).collect();
        assert_eq!(
            messages,
            [
                "CUDA error: an illegal memory access was encountered",
                "a warning",
                "after: unexpectedly reached end of buffer"
            ]
        );
    }
}
