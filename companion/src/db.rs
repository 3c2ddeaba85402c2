//! PostgreSQL pool and migrations.
//!
//! The pool connects lazily with a short acquire timeout, so that while the database is down
//! requests answer 503 quickly instead of hanging, and the service starts anyway: migrations
//! are retried with backoff in the background until they succeed.

use crate::settings::DatabaseSettings;
use secrecy::ExposeSecret;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

pub fn pool(settings: &DatabaseSettings) -> Result<PgPool, String> {
    // The error of a bad URL could echo the password: say only that it does not parse.
    let options = PgConnectOptions::from_str(settings.url.expose_secret())
        .map_err(|_| "--database-url: not a valid PostgreSQL URL".to_string())?;
    Ok(PgPoolOptions::new()
        .max_connections(settings.max_connections)
        .acquire_timeout(settings.acquire_timeout)
        .connect_lazy_with(options))
}

/// A failed database call of a store (the keys, the usage ledger).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database not ready")]
    NotReady,
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
}

impl StoreError {
    /// True when the database cannot be reached now (503), false for a real error (500).
    pub fn is_unavailable(&self) -> bool {
        match self {
            StoreError::NotReady => true,
            StoreError::Database(e) => is_unavailable(e),
        }
    }
}

/// True for database errors that mean "cannot reach it now" (answer 503, not 500).
pub fn is_unavailable(e: &sqlx::Error) -> bool {
    matches!(
        e,
        sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::WorkerCrashed
    )
}

/// Set once migrations have been applied; until then the database is "not ready".
#[derive(Clone, Default)]
pub struct MigrationState(Arc<AtomicBool>);

impl MigrationState {
    pub fn is_done(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
    pub fn set_done(&self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Applies migrations, retrying with exponential backoff (capped at 5 s) for as long as it
/// takes; logs each failure.
pub async fn migrate_with_retry(pool: PgPool, state: MigrationState) {
    let mut delay = Duration::from_millis(200);
    loop {
        match MIGRATOR.run(&pool).await {
            Ok(()) => {
                state.set_done();
                tracing::info!("database migrations applied");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX), "migrations failed, retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// True when the database answers a trivial query.
pub async fn ping(pool: &PgPool) -> bool {
    sqlx::query("SELECT 1").execute(pool).await.is_ok()
}
