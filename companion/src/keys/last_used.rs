//! Debounced `last_used_at`: never a write per request.
//!
//! Each use only records `key → time` in memory (a map, so a hot key is one entry however
//! many requests it serves); the key store writes all pending entries in ONE statement every
//! flush interval ([`crate::keys::store::KeyStore::flush_last_used`]). So a key is written at
//! most once per interval, and 256 concurrent requests on one key cannot pile up row locks
//! (the reference's pitfall `290712cd`).

use chrono::{DateTime, Utc};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use uuid::Uuid;

#[derive(Clone, Default)]
pub struct LastUsedRecorder {
    pending: Arc<Mutex<HashMap<Uuid, DateTime<Utc>>>>,
}

impl LastUsedRecorder {
    pub fn record(&self, id: Uuid, at: DateTime<Utc>) {
        if let Ok(mut pending) = self.pending.lock() {
            pending
                .entry(id)
                .and_modify(|t| *t = (*t).max(at))
                .or_insert(at);
        }
    }

    /// Everything pending, leaving nothing behind.
    pub fn take(&self) -> HashMap<Uuid, DateTime<Utc>> {
        match self.pending.lock() {
            Ok(mut p) => std::mem::take(&mut *p),
            Err(_) => HashMap::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hot_key_is_one_entry_with_its_latest_use() {
        let r = LastUsedRecorder::default();
        let id = Uuid::new_v4();
        let t0 = Utc::now();
        let t1 = t0 + chrono::Duration::seconds(5);
        r.record(id, t1);
        r.record(id, t0);
        let batch = r.take();
        assert_eq!(batch.len(), 1);
        assert_eq!(batch.get(&id), Some(&t1));
        assert!(r.take().is_empty());
    }
}
