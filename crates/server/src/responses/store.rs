//! Responses kept for `previous_response_id`, `GET` and `DELETE /v1/responses/{id}`: in memory,
//! bounded in bytes, the oldest dropped first. What makes a continued response cheap is the
//! engine's prefix state, not this store: the store only remembers the conversation so that
//! the client need not resend it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use deltafin_text::chat::Message;
use serde_json::Value;

/// Bytes of stored responses (their conversations and response objects), at most.
pub const STORE_BYTES: usize = 64 << 20;

/// One stored response.
#[derive(Clone)]
pub struct Stored {
    /// The response object as it was returned.
    pub response: Arc<Value>,
    /// The conversation it continued plus its output, for a response that continues it.
    pub history: Arc<Vec<Message>>,
    bytes: usize,
}

impl Stored {
    pub fn new(response: Value, history: Vec<Message>) -> Self {
        let text: usize = history
            .iter()
            .map(|m| {
                m.content.iter().map(String::len).sum::<usize>()
                    + m.reasoning.as_ref().map_or(0, String::len)
                    + m.tool_calls.iter().map(|c| c.arguments.len() + c.name.len() + c.id.len()).sum::<usize>()
                    + 64
            })
            .sum();
        let bytes = text + response.to_string().len();
        Stored { response: Arc::new(response), history: Arc::new(history), bytes }
    }
}

#[derive(Default)]
struct Inner {
    map: HashMap<String, Stored>,
    order: VecDeque<String>,
    bytes: usize,
}

#[derive(Default)]
pub struct ResponseStore {
    inner: Mutex<Inner>,
}

impl ResponseStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keep `s` under `id`; a response larger than the whole store is not kept.
    pub fn put(&self, id: String, s: Stored) {
        if s.bytes > STORE_BYTES {
            return;
        }
        let mut g = self.lock();
        while g.bytes + s.bytes > STORE_BYTES {
            let Some(old) = g.order.pop_front() else { break };
            if let Some(o) = g.map.remove(&old) {
                g.bytes -= o.bytes;
            }
        }
        g.bytes += s.bytes;
        g.order.push_back(id.clone());
        if let Some(o) = g.map.insert(id, s) {
            g.bytes -= o.bytes;
        }
    }

    /// The stored response: its parts are shared, so the lock is held for a count, not a copy.
    pub fn get(&self, id: &str) -> Option<Stored> {
        self.lock().map.get(id).cloned()
    }

    pub fn delete(&self, id: &str) -> bool {
        let mut g = self.lock();
        match g.map.remove(id) {
            Some(o) => {
                g.bytes -= o.bytes;
                g.order.retain(|k| k != id);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_text::chat::Role;

    #[test]
    fn the_oldest_go_first_and_the_bytes_stay_bounded() {
        let s = ResponseStore::default();
        let big = "x".repeat(STORE_BYTES / 3);
        for i in 0..5 {
            s.put(format!("r{i}"), Stored::new(Value::Null, vec![Message::new(Role::User, big.clone())]));
        }
        assert!(s.get("r0").is_none() && s.get("r1").is_none() && s.get("r2").is_none());
        assert!(s.get("r3").is_some() && s.get("r4").is_some());
        assert!(s.lock().bytes <= STORE_BYTES);
        assert!(s.delete("r4") && !s.delete("r4"));
        assert_eq!(s.lock().order.len(), 1);
    }
}
