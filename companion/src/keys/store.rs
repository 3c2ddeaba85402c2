//! The one place with SQL on `api_keys`: insert, fetch, revoke, search, bulk revoke, cleanup,
//! lookup by hash, the recent revocations, and the batched `last_used_at` write.
//!
//! Keys are stored only as hashes (`maas_types::apikey::hash`). Every method first checks that
//! migrations have been applied ([`StoreError::NotReady`] otherwise).

use crate::db::{self, MigrationState};
use crate::keys::last_used::LastUsedRecorder;
use crate::metrics::Metrics;
use chrono::{DateTime, Utc};
use sqlx::{PgPool, Postgres, QueryBuilder};
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

/// How long a revoked key stays in the served revocation list (longer than any cache TTL).
pub const REVOCATION_LIST_WINDOW_HOURS: i32 = 24;

pub use crate::db::StoreError;

/// A key's row (never the key itself).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct KeyRow {
    pub id: Uuid,
    pub key_id: String,
    pub username: String,
    pub name: String,
    pub description: Option<String>,
    pub tier: Option<String>,
    pub user_groups: Vec<String>,
    pub status: String,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub last_used_at: Option<DateTime<Utc>>,
    pub revoked_at: Option<DateTime<Utc>>,
    pub ephemeral: bool,
    pub subscription: Option<String>,
    /// The labels as JSON text (`{"k":"v"}`).
    pub labels: String,
    /// The key's own limits as JSON text ([`maas_types::Limits`]), if it was minted with any.
    pub limits: Option<String>,
}

const KEY_COLUMNS: &str = "id, key_id, username, name, description, tier, user_groups, status, \
                           created_at, expires_at, last_used_at, revoked_at, ephemeral, \
                           subscription, labels::text AS labels, limits::text AS limits";

/// What a key is checked with when it is used.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct KeyCheck {
    pub id: Uuid,
    pub key_id: String,
    pub username: String,
    pub user_groups: Vec<String>,
    pub tier: Option<String>,
    pub subscription: Option<String>,
    pub status: String,
    pub expires_at: DateTime<Utc>,
    /// The key's own limits as JSON text, if any.
    pub limits: Option<String>,
}

/// A key to insert.
pub struct NewKey<'a> {
    pub id: Uuid,
    pub key_id: &'a str,
    pub hash: &'a str,
    pub username: &'a str,
    pub name: &'a str,
    pub description: Option<&'a str>,
    pub pinned_tier: Option<&'a str>,
    pub subscription: Option<&'a str>,
    /// JSON object text.
    pub labels: &'a str,
    pub groups: &'a [String],
    /// The key's own limits as JSON text, if any.
    pub limits: Option<&'a str>,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub ephemeral: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyStatus {
    Active,
    Revoked,
    Expired,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SortColumn {
    CreatedAt,
    ExpiresAt,
    LastUsedAt,
    Name,
}

/// A checked search.
pub struct SearchQuery {
    /// `None`: every user's keys (admins only).
    pub username: Option<String>,
    pub subscription: Option<String>,
    /// JSON object text: every pair must be among the key's labels.
    pub labels_contain: Option<String>,
    pub include_ephemeral: bool,
    /// Empty: any status.
    pub statuses: Vec<KeyStatus>,
    pub sort: SortColumn,
    pub descending: bool,
    /// At least 1.
    pub limit: i64,
    pub offset: i64,
}

#[derive(Clone)]
pub struct KeyStore {
    pool: PgPool,
    migrations: MigrationState,
    last_used: LastUsedRecorder,
}

impl KeyStore {
    pub fn new(pool: PgPool, migrations: MigrationState) -> KeyStore {
        KeyStore {
            pool,
            migrations,
            last_used: LastUsedRecorder::default(),
        }
    }

    fn ready(&self) -> Result<&PgPool, StoreError> {
        if self.migrations.is_done() {
            Ok(&self.pool)
        } else {
            Err(StoreError::NotReady)
        }
    }

    /// Migrations applied and PostgreSQL answers.
    pub async fn is_ready(&self) -> bool {
        self.migrations.is_done() && db::ping(&self.pool).await
    }

    /// Inserts a key in one statement; answers the stored (created_at, expires_at).
    #[tracing::instrument(name = "db.query", skip_all, fields(otel.kind = "client", db.system.name = "postgresql", db.operation.name = "keys.insert"))]
    pub async fn insert(
        &self,
        key: &NewKey<'_>,
    ) -> Result<(DateTime<Utc>, DateTime<Utc>), StoreError> {
        Ok(sqlx::query_as(
            "INSERT INTO api_keys (id, key_id, key_hash, username, name, description, tier, \
             user_groups, status, created_at, expires_at, ephemeral, subscription, labels, limits) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'active', $9, $10, $11, $12, $13::jsonb, \
             $14::jsonb) \
             RETURNING created_at, expires_at",
        )
        .bind(key.id)
        .bind(key.key_id)
        .bind(key.hash)
        .bind(key.username)
        .bind(key.name)
        .bind(key.description)
        .bind(key.pinned_tier)
        .bind(key.groups)
        .bind(key.created_at)
        .bind(key.expires_at)
        .bind(key.ephemeral)
        .bind(key.subscription)
        .bind(key.labels)
        .bind(key.limits)
        .fetch_one(self.ready()?)
        .await?)
    }

    #[tracing::instrument(name = "db.query", skip_all, fields(otel.kind = "client", db.system.name = "postgresql", db.operation.name = "keys.find"))]
    pub async fn find(&self, id: Uuid) -> Result<Option<KeyRow>, StoreError> {
        Ok(
            sqlx::query_as(&format!("SELECT {KEY_COLUMNS} FROM api_keys WHERE id = $1"))
                .bind(id)
                .fetch_optional(self.ready()?)
                .await?,
        )
    }

    /// Revokes an active key of `owner` (any owner's when `any_owner`); `None` when there is
    /// no such active key.
    #[tracing::instrument(name = "db.query", skip_all, fields(otel.kind = "client", db.system.name = "postgresql", db.operation.name = "keys.revoke"))]
    pub async fn revoke(
        &self,
        id: Uuid,
        any_owner: bool,
        owner: &str,
    ) -> Result<Option<KeyRow>, StoreError> {
        Ok(sqlx::query_as(&format!(
            "UPDATE api_keys SET status = 'revoked', revoked_at = now() \
             WHERE id = $1 AND status = 'active' AND ($2 OR username = $3) RETURNING {KEY_COLUMNS}"
        ))
        .bind(id)
        .bind(any_owner)
        .bind(owner)
        .fetch_optional(self.ready()?)
        .await?)
    }

    /// Up to `limit + 1` rows, so that the caller can tell whether there are more.
    #[tracing::instrument(name = "db.query", skip_all, fields(otel.kind = "client", db.system.name = "postgresql", db.operation.name = "keys.search"))]
    pub async fn search(&self, query: &SearchQuery) -> Result<Vec<KeyRow>, StoreError> {
        let pool = self.ready()?;
        let mut q: QueryBuilder<Postgres> =
            QueryBuilder::new(format!("SELECT {KEY_COLUMNS} FROM api_keys WHERE TRUE"));
        if let Some(u) = &query.username {
            q.push(" AND username = ").push_bind(u.clone());
        }
        if let Some(sub) = &query.subscription {
            q.push(" AND subscription = ").push_bind(sub.clone());
        }
        if let Some(labels) = &query.labels_contain {
            q.push(" AND labels @> ")
                .push_bind(labels.clone())
                .push("::jsonb");
        }
        if !query.include_ephemeral {
            q.push(" AND NOT ephemeral");
        }
        if !query.statuses.is_empty() {
            let clauses: Vec<&str> = query
                .statuses
                .iter()
                .map(|s| match s {
                    KeyStatus::Active => "(status = 'active' AND expires_at > now())",
                    KeyStatus::Expired => "(status = 'active' AND expires_at <= now())",
                    KeyStatus::Revoked => "(status = 'revoked')",
                })
                .collect();
            q.push(format!(" AND ({})", clauses.join(" OR ")));
        }
        let column = match query.sort {
            SortColumn::CreatedAt => "created_at",
            SortColumn::ExpiresAt => "expires_at",
            SortColumn::LastUsedAt => "last_used_at",
            SortColumn::Name => "name",
        };
        let order = if query.descending { "DESC" } else { "ASC" };
        // Only last_used_at can be NULL; "NULLS LAST" on the others would stop PostgreSQL from
        // reading the (username, created_at DESC, id DESC) index in order.
        let nulls = if query.sort == SortColumn::LastUsedAt {
            " NULLS LAST"
        } else {
            ""
        };
        q.push(format!(
            " ORDER BY {column} {order}{nulls}, id {order} LIMIT "
        ));
        q.push_bind(query.limit.saturating_add(1));
        q.push(" OFFSET ").push_bind(query.offset);
        Ok(q.build_query_as().fetch_all(pool).await?)
    }

    /// Revokes every active key (ephemeral ones too) of `owner` and/or bound to `subscription`
    /// (at least one is given by the caller); with `dry_run` only counts them. Answers how many.
    #[tracing::instrument(name = "db.query", skip_all, fields(otel.kind = "client", db.system.name = "postgresql", db.operation.name = "keys.revoke_all"))]
    pub async fn revoke_all(
        &self,
        owner: Option<&str>,
        subscription: Option<&str>,
        dry_run: bool,
    ) -> Result<u64, StoreError> {
        let pool = self.ready()?;
        let mut q: QueryBuilder<Postgres> = QueryBuilder::new(if dry_run {
            "SELECT count(*) FROM api_keys WHERE status = 'active'"
        } else {
            "UPDATE api_keys SET status = 'revoked', revoked_at = now() WHERE status = 'active'"
        });
        if let Some(u) = owner {
            q.push(" AND username = ").push_bind(u.to_string());
        }
        if let Some(s) = subscription {
            q.push(" AND subscription = ").push_bind(s.to_string());
        }
        if dry_run {
            let n: i64 = q.build_query_scalar().fetch_one(pool).await?;
            Ok(u64::try_from(n).unwrap_or(0))
        } else {
            Ok(q.build().execute(pool).await?.rows_affected())
        }
    }

    /// Deletes ephemeral keys that expired more than 30 minutes ago; answers how many.
    #[tracing::instrument(name = "db.query", skip_all, fields(otel.kind = "client", db.system.name = "postgresql", db.operation.name = "keys.delete_expired_ephemeral"))]
    pub async fn delete_expired_ephemeral(&self) -> Result<u64, StoreError> {
        let done = sqlx::query(
            "DELETE FROM api_keys WHERE ephemeral AND expires_at < now() - interval '30 minutes'",
        )
        .execute(self.ready()?)
        .await?;
        Ok(done.rows_affected())
    }

    /// The key with this hash, if any (status and expiry are the caller's to judge).
    #[tracing::instrument(name = "db.query", skip_all, fields(otel.kind = "client", db.system.name = "postgresql", db.operation.name = "keys.find_by_hash"))]
    pub async fn find_by_hash(&self, hash: &str) -> Result<Option<KeyCheck>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT id, key_id, username, user_groups, tier, subscription, status, expires_at, \
             limits::text AS limits FROM api_keys WHERE key_hash = $1",
        )
        .bind(hash)
        .fetch_optional(self.ready()?)
        .await?)
    }

    /// Remembers a use of the key, written by the next [`KeyStore::flush_last_used`].
    pub fn record_use(&self, id: Uuid, at: DateTime<Utc>) {
        self.last_used.record(id, at);
    }

    /// Key ids revoked in the last 24 hours.
    #[tracing::instrument(name = "db.query", skip_all, fields(otel.kind = "client", db.system.name = "postgresql", db.operation.name = "keys.recently_revoked"))]
    pub async fn recently_revoked(&self) -> Result<Vec<String>, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT key_id FROM api_keys WHERE revoked_at > now() - make_interval(hours => $1) ORDER BY key_id",
        )
        .bind(REVOCATION_LIST_WINDOW_HOURS)
        .fetch_all(self.ready()?)
        .await?)
    }

    /// Writes the pending `last_used_at` entries in one statement; on failure they are put back
    /// for the next flush.
    pub async fn flush_last_used(&self, metrics: &Metrics) {
        let batch = self.last_used.take();
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
        .execute(&self.pool)
        .await;
        match result {
            Ok(done) => {
                metrics.last_used_rows_written.inc_by(done.rows_affected());
            }
            Err(e) => {
                tracing::warn!(error = %e, keys = ids.len(), "last_used_at flush failed, will retry");
                for (id, at) in batch {
                    self.last_used.record(id, at);
                }
            }
        }
    }

    /// Flushes `last_used_at` every `interval`.
    pub fn spawn_flusher(
        &self,
        interval: Duration,
        metrics: Arc<Metrics>,
    ) -> tokio::task::JoinHandle<()> {
        let store = self.clone();
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker.tick().await;
            loop {
                ticker.tick().await;
                store.flush_last_used(&metrics).await;
            }
        })
    }
}
