//! Debounced `last_used_at`: never a write per request.
//!
//! Each use only records `key → time` in memory (a map, so a hot key is one entry however
//! many requests it serves); a background task writes all pending entries in ONE statement
//! every flush interval. So a key is written at most once per interval, and 256 concurrent
//! requests on one key cannot pile up row locks (the reference's pitfall `290712cd`).

use crate::metrics::Metrics;
use chrono::{DateTime, Utc};
use sqlx::PgPool;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
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

    fn take(&self) -> HashMap<Uuid, DateTime<Utc>> {
        match self.pending.lock() {
            Ok(mut p) => std::mem::take(&mut *p),
            Err(_) => HashMap::new(),
        }
    }

    /// Writes the pending entries; on failure they are put back for the next flush.
    pub async fn flush(&self, pool: &PgPool, metrics: &Metrics) {
        let batch = self.take();
        if batch.is_empty() {
            return;
        }
        let (ids, times): (Vec<Uuid>, Vec<DateTime<Utc>>) =
            batch.iter().map(|(k, v)| (*k, *v)).unzip();
        let result = sqlx::query(
            "UPDATE api_keys AS k SET last_used_at = u.at \
             FROM unnest($1::uuid[], $2::timestamptz[]) AS u(id, at) \
             WHERE k.id = u.id AND (k.last_used_at IS NULL OR k.last_used_at < u.at)",
        )
        .bind(&ids)
        .bind(&times)
        .execute(pool)
        .await;
        match result {
            Ok(done) => {
                metrics.last_used_rows_written.inc_by(done.rows_affected());
            }
            Err(e) => {
                tracing::warn!(error = %e, keys = ids.len(), "last_used_at flush failed, will retry");
                for (id, at) in batch {
                    self.record(id, at);
                }
            }
        }
    }

    pub fn spawn_flusher(
        &self,
        pool: PgPool,
        interval: Duration,
        metrics: Arc<Metrics>,
    ) -> tokio::task::JoinHandle<()> {
        let recorder = self.clone();
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker.tick().await;
            loop {
                ticker.tick().await;
                recorder.flush(&pool, &metrics).await;
            }
        })
    }
}
