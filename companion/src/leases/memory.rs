//! The lease counters in this process, when no Redis is configured: the same rules as the Redis
//! script, one lock per batch (so a batch is atomic), expired counters swept as batches come.
//! One companion only: a second one would keep its own counters, and a restart forgets them
//! (each gateway replica still caps a subject at the limit locally).

use super::batch::{Applied, Batch, CounterId, expires_at_ms};
use maas_types::lease::{
    BATCH_MEMORY_SECONDS, LeaseGrant, LeaseKind, REPLICA_TTL_SECONDS, apply_item,
};
use std::collections::HashMap;
use std::sync::Mutex;

/// Sweep expired counters at most this often.
const SWEEP_EVERY_MS: u64 = 1000;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct CounterKey {
    subject: String,
    kind: LeaseKind,
    window_seconds: u64,
    window_start: u64,
}

#[derive(Debug, Clone, Copy)]
struct Counter {
    taken: u64,
    expires_at_ms: u64,
}

#[derive(Default)]
struct Inner {
    counters: HashMap<CounterKey, Counter>,
    /// Replica id → last call (Unix ms).
    replicas: HashMap<String, u64>,
    /// (replica, batch id) → (forgotten at, Unix ms; the answer given).
    batches: HashMap<(String, String), (u64, Applied)>,
    last_sweep_ms: u64,
}

#[derive(Default)]
pub struct MemoryStore {
    inner: Mutex<Inner>,
}

impl MemoryStore {
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    /// Applies a checked batch at `now_ms` (a batch id seen in the last
    /// [`BATCH_MEMORY_SECONDS`]: its first answer again, nothing applied).
    pub fn apply(&self, batch: &Batch<'_>, now_ms: u64) -> Applied {
        let (replica, items) = (batch.replica, batch.items);
        // A poisoned lock only means another batch panicked midway: every counter is still a
        // plain number, so carry on with it.
        let mut inner = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let inner = &mut *inner;
        if now_ms.saturating_sub(inner.last_sweep_ms) >= SWEEP_EVERY_MS {
            inner.counters.retain(|_, c| c.expires_at_ms > now_ms);
            inner.batches.retain(|_, (until, _)| *until > now_ms);
            inner.last_sweep_ms = now_ms;
        }
        inner.replicas.insert(replica.to_string(), now_ms);
        let batch_key = batch.id.map(|id| (replica.to_string(), id.to_string()));
        if let Some((until, applied)) = batch_key.as_ref().and_then(|k| inner.batches.get(k))
            && *until > now_ms
        {
            return applied.clone();
        }
        let oldest = now_ms.saturating_sub(REPLICA_TTL_SECONDS * 1000);
        inner.replicas.retain(|_, seen| *seen >= oldest);
        let replicas = u32::try_from(inner.replicas.len())
            .unwrap_or(u32::MAX)
            .max(1);
        let grants = items
            .iter()
            .map(|item| {
                let key = CounterKey {
                    subject: item.subject.clone(),
                    kind: item.kind,
                    window_seconds: item.window_seconds,
                    window_start: item.window_start,
                };
                let expires_at_ms = expires_at_ms(item);
                let counter = inner.counters.entry(key).or_insert(Counter {
                    taken: 0,
                    expires_at_ms,
                });
                if counter.expires_at_ms <= now_ms {
                    // Expired but not swept yet: a fresh window.
                    counter.taken = 0;
                }
                let (taken, granted) = apply_item(counter.taken, item, replicas);
                *counter = Counter {
                    taken,
                    expires_at_ms,
                };
                LeaseGrant { granted, taken }
            })
            .collect();
        let applied = Applied { replicas, grants };
        if let Some(k) = batch_key {
            let until = now_ms.saturating_add(BATCH_MEMORY_SECONDS * 1000);
            inner.batches.insert(k, (until, applied.clone()));
        }
        applied
    }

    /// A counter's `taken` at `now_ms` (0 when absent or expired).
    pub fn taken(&self, counter: &CounterId<'_>, now_ms: u64) -> u64 {
        let inner = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let key = CounterKey {
            subject: counter.subject.to_string(),
            kind: counter.kind,
            window_seconds: counter.window_seconds,
            window_start: counter.window_start,
        };
        inner
            .counters
            .get(&key)
            .filter(|c| c.expires_at_ms > now_ms)
            .map_or(0, |c| c.taken)
    }

    #[cfg(test)]
    fn counters(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .counters
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use maas_types::lease::LeaseItem;

    /// A batch without an id.
    fn plain<'a>(replica: &'a str, items: &'a [LeaseItem]) -> Batch<'a> {
        Batch {
            replica,
            id: None,
            items,
        }
    }

    #[test]
    fn a_repeated_batch_id_is_answered_again_without_applying_it() {
        let s = MemoryStore::new();
        let items = [item("u", 960, 10, 0)];
        let once = Batch {
            replica: "r1",
            id: Some("b1"),
            items: &items,
        };
        let first = s.apply(&once, 1_000_000);
        assert_eq!(s.apply(&once, 1_000_500), first, "the same answer");
        let read = |now| {
            s.taken(
                &CounterId {
                    subject: "u",
                    kind: LeaseKind::Tokens,
                    window_seconds: 60,
                    window_start: 960,
                },
                now,
            )
        };
        assert_eq!(read(1_000_500), 10, "applied once");
        // The same id from another replica is another batch.
        s.apply(
            &Batch {
                replica: "r2",
                ..once
            },
            1_000_600,
        );
        assert_eq!(read(1_000_600), 20);
        // Forgotten after BATCH_MEMORY_SECONDS (the counter lives on here: window far ahead).
        let later = 1_000_000 + BATCH_MEMORY_SECONDS * 1000 + SWEEP_EVERY_MS;
        let s2 = MemoryStore::new();
        let far = [item("v", 1_000_020, 10, 0)];
        let b = Batch {
            replica: "r1",
            id: Some("b1"),
            items: &far,
        };
        s2.apply(&b, 1_000_000);
        let again = s2.apply(&b, later);
        assert_eq!(again.grants[0].taken, 20, "applied again once forgotten");
    }

    fn item(subject: &str, window_start: u64, need: u64, want: u64) -> LeaseItem {
        LeaseItem {
            subject: subject.into(),
            kind: LeaseKind::Tokens,
            window_seconds: 60,
            window_start,
            limit: 100,
            need,
            want,
            debt: 0,
            release: 0,
        }
    }

    #[test]
    fn replicas_seen_in_the_last_30_s_share_what_is_left() {
        let s = MemoryStore::new();
        let now = 1_000_000;
        let a = s.apply(&plain("r1", &[item("u", 960, 0, 1000)]), now);
        assert_eq!((a.replicas, a.grants[0].granted), (1, 100));
        let s = MemoryStore::new();
        s.apply(&plain("r1", &[]), now);
        s.apply(&plain("r2", &[]), now + 1);
        let b = s.apply(&plain("r3", &[item("u", 960, 0, 1000)]), now + 2);
        assert_eq!((b.replicas, b.grants[0].granted), (3, 33));
        // r1 and r2 went quiet 30 s ago: r3 is alone.
        let c = s.apply(&plain("r3", &[]), now + 30_002);
        assert_eq!(c.replicas, 1);
    }

    #[test]
    fn counters_are_per_window_and_swept_after_it() {
        let s = MemoryStore::new();
        let start = 1_000_000;
        s.apply(&plain("r1", &[item("u", 960, 100, 0)]), start);
        let next = s.apply(&plain("r1", &[item("u", 1020, 10, 0)]), start + 1);
        assert_eq!(
            next.grants[0],
            LeaseGrant {
                granted: 10,
                taken: 10
            }
        );
        assert_eq!(s.counters(), 2);
        // `taken` reads a window's counter; an expired one reads 0.
        let read = |window_start, now_ms| {
            let id = CounterId {
                subject: "u",
                kind: LeaseKind::Tokens,
                window_seconds: 60,
                window_start,
            };
            s.taken(&id, now_ms)
        };
        assert_eq!((read(960, start), read(1020, start)), (100, 10));
        assert_eq!((read(1080, start), read(960, 1_080_000)), (0, 0));
        // Window 960 ends at 1020 s; kept 60 s more, then swept.
        s.apply(&plain("r1", &[]), 1_080_000 + SWEEP_EVERY_MS);
        assert_eq!(s.counters(), 1);
    }
}
