//! The responses `POST /v1/responses` keeps for `previous_response_id` and `GET
//! /v1/responses/{id}`: in memory, bounded by count, bytes and age, the oldest out first. A
//! response is kept with the conversation it ends (the messages of its input, earlier turns
//! included, and its own output as an assistant turn), so that a follow-up names only its new
//! input. Responses are kept as JSON text, so that the byte budget is the memory they take
//! (a parsed `Value` takes several times its text: 32 bytes per array item).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Most responses kept.
pub const MAX_RESPONSES: usize = 1024;
/// Most bytes of JSON kept (conversations and response objects together).
pub const MAX_BYTES: usize = 64 * 1024 * 1024;
/// How long a response is kept.
pub const MAX_AGE: Duration = Duration::from_secs(24 * 60 * 60);

/// One kept response.
#[derive(Clone, Debug)]
pub struct Stored {
    /// The conversation up to and including this response's output, as chat messages
    /// (without the request's `instructions`, which a follow-up does not inherit).
    pub messages: Vec<Value>,
    /// The response object, as it was answered.
    pub response: Value,
}

/// A kept response as JSON text: `messages` a JSON array.
#[derive(Debug)]
struct Kept {
    messages: Box<str>,
    response: Box<str>,
}

#[derive(Debug)]
struct Entry {
    /// Shared: a read copies no text under the lock, and parses it after.
    kept: std::sync::Arc<Kept>,
    at: Instant,
    bytes: usize,
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<String, Entry>,
    /// Ids, oldest first.
    order: VecDeque<String>,
    bytes: usize,
}

/// The store: a map under a lock (every operation is short: no JSON is written or parsed
/// under it).
#[derive(Debug)]
pub struct ResponseStore {
    inner: Mutex<Inner>,
    max_responses: usize,
    max_bytes: usize,
    max_age: Duration,
}

impl Default for ResponseStore {
    fn default() -> Self {
        Self::with_limits(MAX_RESPONSES, MAX_BYTES, MAX_AGE)
    }
}

impl Kept {
    fn of(stored: &Stored) -> Self {
        Kept {
            messages: serde_json::to_string(&stored.messages)
                .unwrap_or_else(|_| "[]".into())
                .into(),
            response: stored.response.to_string().into(),
        }
    }

    fn bytes(&self) -> usize {
        self.messages.len() + self.response.len()
    }

    /// Parsed back (the text was written from `Value`s, so it parses).
    fn stored(&self) -> Stored {
        let messages = match serde_json::from_str(&self.messages) {
            Ok(Value::Array(m)) => m,
            _ => Vec::new(),
        };
        Stored {
            messages,
            response: serde_json::from_str(&self.response).unwrap_or(Value::Null),
        }
    }
}

#[cfg(test)]
fn size(stored: &Stored) -> usize {
    Kept::of(stored).bytes()
}

impl ResponseStore {
    /// A store with these bounds.
    pub fn with_limits(max_responses: usize, max_bytes: usize, max_age: Duration) -> Self {
        Self {
            inner: Mutex::default(),
            max_responses,
            max_bytes,
            max_age,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `stored` under `id`; the oldest go to make room. One larger than the whole byte
    /// budget is not kept (false).
    pub fn put(&self, id: String, stored: Stored) -> bool {
        let kept = Kept::of(&stored);
        drop(stored);
        let bytes = kept.bytes();
        if bytes > self.max_bytes || self.max_responses == 0 {
            tracing::warn!(
                id,
                bytes,
                max_bytes = self.max_bytes,
                "a response too large for the response store is not kept: \
                 previous_response_id cannot continue it"
            );
            return false;
        }
        let mut inner = self.lock();
        Self::remove_locked(&mut inner, &id);
        while inner.order.len() >= self.max_responses || inner.bytes + bytes > self.max_bytes {
            let Some(oldest) = inner.order.pop_front() else {
                break;
            };
            if let Some(e) = inner.entries.remove(&oldest) {
                inner.bytes -= e.bytes;
            }
        }
        inner.bytes += bytes;
        inner.order.push_back(id.clone());
        inner.entries.insert(
            id,
            Entry {
                kept: std::sync::Arc::new(kept),
                at: Instant::now(),
                bytes,
            },
        );
        true
    }

    /// The response kept under `id`, unless it is older than the age limit.
    pub fn get(&self, id: &str) -> Option<Stored> {
        let kept = {
            let mut inner = self.lock();
            let expired = inner.entries.get(id)?.at.elapsed() > self.max_age;
            if expired {
                Self::remove_locked(&mut inner, id);
                return None;
            }
            inner.entries.get(id).map(|e| e.kept.clone())?
        };
        Some(kept.stored())
    }

    /// Forgets `id`; whether it was kept.
    pub fn remove(&self, id: &str) -> bool {
        Self::remove_locked(&mut self.lock(), id)
    }

    fn remove_locked(inner: &mut Inner, id: &str) -> bool {
        let Some(e) = inner.entries.remove(id) else {
            return false;
        };
        inner.bytes -= e.bytes;
        inner.order.retain(|x| x != id);
        true
    }

    /// Responses kept.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Nothing kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stored(text: &str) -> Stored {
        Stored {
            messages: vec![json!({"role": "user", "content": text})],
            response: json!({"id": text}),
        }
    }

    #[test]
    fn the_oldest_go_first_by_count() {
        let s = ResponseStore::with_limits(2, 1 << 20, MAX_AGE);
        for id in ["a", "b", "c"] {
            assert!(s.put(id.into(), stored(id)));
        }
        assert!(s.get("a").is_none());
        assert_eq!(s.get("c").unwrap().response, json!({"id": "c"}));
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn the_byte_budget_holds_and_a_response_larger_than_it_is_not_kept() {
        let one = size(&stored("x"));
        let s = ResponseStore::with_limits(100, one * 2, MAX_AGE);
        assert!(s.put("a".into(), stored("x")));
        assert!(s.put("b".into(), stored("y")));
        assert!(s.put("c".into(), stored("z")));
        assert_eq!(s.len(), 2);
        assert!(s.get("a").is_none());
        assert!(!s.put("big".into(), stored(&"w".repeat(one * 3))));
        assert!(s.get("big").is_none());
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn old_responses_expire_and_remove_forgets() {
        let s = ResponseStore::with_limits(10, 1 << 20, Duration::ZERO);
        s.put("a".into(), stored("a"));
        std::thread::sleep(Duration::from_millis(2));
        assert!(s.get("a").is_none());
        assert!(s.is_empty());
        let s = ResponseStore::default();
        s.put("a".into(), stored("a"));
        s.put("a".into(), stored("again"));
        assert_eq!(s.len(), 1);
        assert!(s.remove("a"));
        assert!(!s.remove("a"));
        assert!(s.is_empty());
    }
}
