//! The one place with SQL on quota warnings and the webhook outbox (migration 0007).
//!
//! - [`WebhookStore::record`]: the warning's row, inserted ON CONFLICT DO NOTHING, and its
//!   outbox row only when that insert happened — one statement, so a crossing is queued once
//!   whichever companions race on it, and again never after a restart;
//! - [`WebhookStore::bound`]: the oldest undelivered events beyond the bound, dropped;
//! - [`WebhookStore::claim`]: due rows, locked with FOR UPDATE SKIP LOCKED and pushed past the
//!   attempt's timeout in the same statement (the claim: another companion skips them);
//! - [`WebhookStore::retry_later`], [`WebhookStore::finish`]: an attempt's outcome.

use super::detect::Key;
use crate::db::MigrationState;
pub use crate::db::StoreError;
use chrono::{DateTime, Utc};
use sqlx::{PgPool, Row};
use std::time::Duration;
use uuid::Uuid;

/// How an event left the outbox (`quota_warnings.delivery`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Final {
    Delivered,
    Dead,
}

impl Final {
    fn as_str(self) -> &'static str {
        match self {
            Final::Delivered => "delivered",
            Final::Dead => "dead",
        }
    }
}

/// A row claimed for one attempt.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub id: Uuid,
    pub body: String,
    /// Attempts made, this one included.
    pub attempts: u32,
}

#[derive(Clone)]
pub struct WebhookStore {
    pool: PgPool,
    migrations: MigrationState,
}

fn at(unix: u64) -> DateTime<Utc> {
    DateTime::from_timestamp(i64::try_from(unix).unwrap_or(i64::MAX), 0).unwrap_or_default()
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn count(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl WebhookStore {
    pub fn new(pool: PgPool, migrations: MigrationState) -> WebhookStore {
        WebhookStore { pool, migrations }
    }

    fn ready(&self) -> Result<(), StoreError> {
        if self.migrations.is_done() {
            Ok(())
        } else {
            Err(StoreError::NotReady)
        }
    }

    /// Records the crossing `key` (window ending at `window_end`) and queues `body` as event
    /// `id`: true when this call recorded it, false when it was recorded before.
    pub async fn record(
        &self,
        key: &Key,
        window_end: u64,
        id: Uuid,
        body: &str,
    ) -> Result<bool, StoreError> {
        self.ready()?;
        let queued = sqlx::query(
            "WITH warned AS (
                 INSERT INTO quota_warnings
                     (id, subject_sha256, scope, model, kind, window_seconds, window_start,
                      threshold, shadow, window_end)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
                 ON CONFLICT DO NOTHING
                 RETURNING id
             )
             INSERT INTO quota_webhook_outbox (id, body)
             SELECT id, $11 FROM warned",
        )
        .bind(id)
        .bind(&key.subject_sha256)
        .bind(&key.scope)
        .bind(&key.model)
        .bind(key.kind)
        .bind(count(key.window_seconds))
        .bind(at(key.window_start))
        .bind(i16::from(key.threshold))
        .bind(key.shadow)
        .bind(at(window_end))
        .bind(body)
        .execute(&self.pool)
        .await?;
        Ok(queued.rows_affected() == 1)
    }

    /// Drops the oldest undelivered events beyond the newest `max_pending` (their warning
    /// marked `dropped`): how many this call dropped.
    pub async fn bound(&self, max_pending: u32) -> Result<u64, StoreError> {
        self.ready()?;
        let dropped = sqlx::query(
            "WITH dropped AS (
                 DELETE FROM quota_webhook_outbox
                 WHERE id IN (
                     SELECT id FROM quota_webhook_outbox
                     ORDER BY created_at DESC, id DESC
                     OFFSET $1
                     FOR UPDATE SKIP LOCKED
                 )
                 RETURNING id
             )
             UPDATE quota_warnings SET delivery = 'dropped'
             WHERE id IN (SELECT id FROM dropped)",
        )
        .bind(i64::from(max_pending))
        .execute(&self.pool)
        .await?;
        Ok(dropped.rows_affected())
    }

    /// Up to `max` due rows, oldest due first, claimed for `hold` (their next attempt is pushed
    /// that far: past the attempt's timeout) with the attempt counted.
    pub async fn claim(&self, max: u32, hold: Duration) -> Result<Vec<Claimed>, StoreError> {
        self.ready()?;
        let rows = sqlx::query(
            "UPDATE quota_webhook_outbox o
             SET attempts = o.attempts + 1,
                 next_attempt_at = now() + $2::float8 * INTERVAL '1 millisecond'
             FROM (
                 SELECT id FROM quota_webhook_outbox
                 WHERE next_attempt_at <= now()
                 ORDER BY next_attempt_at, created_at
                 LIMIT $1
                 FOR UPDATE SKIP LOCKED
             ) due
             WHERE o.id = due.id
             RETURNING o.id, o.body, o.attempts",
        )
        .bind(i64::from(max))
        .bind(millis(hold))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(Claimed {
                    id: r.try_get("id")?,
                    body: r.try_get("body")?,
                    attempts: u32::try_from(r.try_get::<i32, _>("attempts")?).unwrap_or(0),
                })
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()
            .map_err(StoreError::from)
    }

    /// The next attempt of `id` in `delay`.
    pub async fn retry_later(
        &self,
        id: Uuid,
        delay: Duration,
        error: &str,
    ) -> Result<(), StoreError> {
        self.ready()?;
        sqlx::query(
            "UPDATE quota_webhook_outbox
             SET next_attempt_at = now() + $2::float8 * INTERVAL '1 millisecond', last_error = $3
             WHERE id = $1",
        )
        .bind(id)
        .bind(millis(delay))
        .bind(error)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// `id` leaves the outbox as `how`, after `attempts` (the last error, if any, kept).
    pub async fn finish(
        &self,
        id: Uuid,
        how: Final,
        attempts: u32,
        error: Option<&str>,
    ) -> Result<(), StoreError> {
        self.ready()?;
        sqlx::query(
            "WITH gone AS (DELETE FROM quota_webhook_outbox WHERE id = $1 RETURNING id)
             UPDATE quota_warnings SET delivery = $2, attempts = $3, last_error = $4
             WHERE id = $1",
        )
        .bind(id)
        .bind(how.as_str())
        .bind(i32::try_from(attempts).unwrap_or(i32::MAX))
        .bind(error)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Events not delivered yet (every companion's).
    pub async fn pending(&self) -> Result<i64, StoreError> {
        self.ready()?;
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM quota_webhook_outbox")
            .fetch_one(&self.pool)
            .await?;
        Ok(n)
    }

    /// Forgets warnings whose window ended more than a day ago (no count of theirs is leased
    /// any more): how many.
    pub async fn prune(&self) -> Result<u64, StoreError> {
        self.ready()?;
        let done = sqlx::query(
            "DELETE FROM quota_warnings
             WHERE window_end < now() - INTERVAL '1 day'
               AND id NOT IN (SELECT id FROM quota_webhook_outbox)",
        )
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }
}
