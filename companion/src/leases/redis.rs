//! The lease counters in Redis: one Lua script ([`SCRIPT`], run by EVALSHA, loaded on NOSCRIPT)
//! per batch, so a batch is one round trip and atomic, whatever the number of companions.
//!
//! A single Redis (or a Sentinel-managed primary); not Redis Cluster: the script touches keys
//! of many hash slots. Each call is bounded by the configured timeout (default 500 ms) so a
//! dead Redis answers 503 fast; the [`ConnectionManager`] reconnects by itself after I/O errors,
//! lazily (the companion starts, and authenticates, without Redis), and is replaced after any
//! other failure (a refused password, a handshake error) so that nothing sticks.

use super::batch::{Applied, Batch, CounterId, StoreError, expires_at_ms};
use crate::settings::RedisSettings;
use maas_types::lease::{BATCH_MEMORY_SECONDS, LeaseGrant, LeaseItem, REPLICA_TTL_SECONDS};
use prometheus_client::metrics::counter::Counter;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, RedisFuture, Value};
use secrecy::ExposeSecret;
use sha2::{Digest, Sha256};
use std::sync::Mutex;
use std::time::Duration;

/// The batch script (see its header for KEYS and ARGV).
pub const SCRIPT: &str = include_str!("script.lua");

/// The ZSET of replica ids by last call.
pub const REPLICAS_KEY: &str = "maas:lease:v1:replicas";

/// Where the answer of batch `id` of `replica` is remembered (the replica hashed: ids are only
/// unique per replica).
pub fn batch_key(replica: &str, id: &str) -> String {
    format!(
        "maas:lease:v1:batch:{}:{id}",
        hex::encode(Sha256::digest(replica.as_bytes()))
    )
}

/// The KEYS[2] of a batch without an id (never read nor written by the script).
const NO_BATCH_KEY: &str = "maas:lease:v1:batch:-";

/// An item's counter key: the subject hashed (no user name in Redis, fixed length).
pub fn counter_key(item: &LeaseItem) -> String {
    counter_key_of(&CounterId {
        subject: &item.subject,
        kind: item.kind,
        window_seconds: item.window_seconds,
        window_start: item.window_start,
    })
}

/// A counter's key from its identity.
pub fn counter_key_of(c: &CounterId<'_>) -> String {
    format!(
        "maas:lease:v1:{}:{}:{}:{}",
        hex::encode(Sha256::digest(c.subject.as_bytes())),
        c.kind.as_str(),
        c.window_seconds,
        c.window_start
    )
}

pub struct RedisStore {
    client: redis::Client,
    config: ConnectionManagerConfig,
    conn: Mutex<ConnectionManager>,
    script: redis::Script,
    timeout: Duration,
    round_trips: Counter,
    endpoint: String,
}

/// The connection, counting every command sent (`maas_companion_redis_round_trips_total`).
struct Counted {
    conn: ConnectionManager,
    round_trips: Counter,
}

impl ConnectionLike for Counted {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        self.round_trips.inc();
        self.conn.req_packed_command(cmd)
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        self.round_trips.inc();
        self.conn.req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.conn.get_db()
    }
}

/// Nothing reached Redis: safe to send again at once (over a fresh connection).
fn not_sent(e: &redis::RedisError) -> bool {
    e.is_connection_refusal() || e.is_connection_dropped()
}

impl RedisStore {
    /// A store that connects on first use (never fails on an unreachable Redis).
    pub fn new(settings: &RedisSettings, round_trips: Counter) -> Result<RedisStore, String> {
        let client = redis::Client::open(settings.url.expose_secret())
            .map_err(|_| "--redis-url (MAAS_REDIS_URL) does not parse".to_string())?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(settings.timeout))
            .set_response_timeout(Some(settings.timeout))
            .set_number_of_retries(0)
            .set_min_delay(Duration::from_millis(10))
            .set_max_delay(Duration::from_millis(200));
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
            .map_err(|e| format!("Redis client for {}: {e}", settings.endpoint))?;
        Ok(RedisStore {
            client,
            config,
            conn: Mutex::new(conn),
            script: redis::Script::new(SCRIPT),
            timeout: settings.timeout,
            round_trips,
            endpoint: settings.endpoint.clone(),
        })
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn counted(&self) -> Counted {
        let conn = self
            .conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        Counted {
            conn,
            round_trips: self.round_trips.clone(),
        }
    }

    /// After a failure the manager does not recover from by itself (anything but I/O: a
    /// refused password, a handshake error), the next call starts from a fresh connection.
    fn after_error(&self, e: &redis::RedisError) {
        if e.is_io_error() {
            return;
        }
        match ConnectionManager::new_lazy_with_config(self.client.clone(), self.config.clone()) {
            Ok(fresh) => {
                *self
                    .conn
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = fresh;
            }
            Err(e) => tracing::warn!(redis = %self.endpoint, error = %e, "Redis client"),
        }
    }

    /// `PING`, within the timeout.
    pub async fn ping(&self) -> bool {
        let mut conn = self.counted();
        let cmd = redis::cmd("PING");
        let attempt = async {
            match cmd.query_async::<String>(&mut conn).await {
                Err(e) if not_sent(&e) => cmd.query_async::<String>(&mut conn).await,
                other => other,
            }
        };
        match tokio::time::timeout(self.timeout, attempt).await {
            Ok(Ok(_)) => true,
            Ok(Err(e)) => {
                self.after_error(&e);
                false
            }
            Err(_) => false,
        }
    }

    /// `GET` of one counter, within the timeout (absent: 0; Redis expires it after its window).
    pub async fn taken(&self, counter: &CounterId<'_>) -> Result<u64, StoreError> {
        let mut conn = self.counted();
        let mut cmd = redis::cmd("GET");
        cmd.arg(counter_key_of(counter));
        let attempt = async {
            match cmd.query_async::<Option<u64>>(&mut conn).await {
                Err(e) if not_sent(&e) => cmd.query_async::<Option<u64>>(&mut conn).await,
                other => other,
            }
        };
        match tokio::time::timeout(self.timeout, attempt).await {
            Ok(Ok(taken)) => Ok(taken.unwrap_or(0)),
            Ok(Err(e)) => {
                self.after_error(&e);
                Err(StoreError(format!("Redis {}: {e}", self.endpoint)))
            }
            Err(_) => Err(StoreError(format!(
                "Redis {}: no answer within {} ms",
                self.endpoint,
                self.timeout.as_millis()
            ))),
        }
    }

    /// Runs the batch script once (a second time only when the first never reached Redis).
    pub async fn apply(&self, batch: &Batch<'_>, now_ms: u64) -> Result<Applied, StoreError> {
        let (replica, items) = (batch.replica, batch.items);
        let mut invocation = self.script.prepare_invoke();
        invocation.key(REPLICAS_KEY);
        match batch.id {
            Some(id) => invocation.key(batch_key(replica, id)),
            None => invocation.key(NO_BATCH_KEY),
        };
        for item in items {
            invocation.key(counter_key(item));
        }
        invocation
            .arg(now_ms)
            .arg(replica)
            .arg(REPLICA_TTL_SECONDS * 1000)
            .arg(if batch.id.is_some() {
                BATCH_MEMORY_SECONDS * 1000
            } else {
                0
            });
        for item in items {
            invocation
                .arg(item.limit)
                .arg(item.need)
                .arg(item.want)
                .arg(item.debt)
                .arg(item.release)
                .arg(expires_at_ms(item));
        }
        let mut conn = self.counted();
        let attempt = async {
            match invocation.invoke_async::<Vec<u64>>(&mut conn).await {
                Err(e) if not_sent(&e) => invocation.invoke_async::<Vec<u64>>(&mut conn).await,
                other => other,
            }
        };
        let reply = match tokio::time::timeout(self.timeout, attempt).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(e)) => {
                self.after_error(&e);
                return Err(StoreError(format!("Redis {}: {e}", self.endpoint)));
            }
            Err(_) => {
                return Err(StoreError(format!(
                    "Redis {}: no answer within {} ms",
                    self.endpoint,
                    self.timeout.as_millis()
                )));
            }
        };
        parse_reply(&reply, items.len())
            .ok_or_else(|| StoreError(format!("Redis {}: unexpected script reply", self.endpoint)))
    }
}

/// `{replicas, granted_1, taken_1, …}` → the answer (None when the shape is wrong).
fn parse_reply(reply: &[u64], items: usize) -> Option<Applied> {
    let (replicas, pairs) = reply.split_first()?;
    if pairs.len() != items.checked_mul(2)? {
        return None;
    }
    let grants = pairs
        .chunks_exact(2)
        .map(|p| match p {
            [granted, taken] => Some(LeaseGrant {
                granted: *granted,
                taken: *taken,
            }),
            _ => None,
        })
        .collect::<Option<Vec<_>>>()?;
    Some(Applied {
        replicas: u32::try_from(*replicas).unwrap_or(u32::MAX).max(1),
        grants,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use maas_types::LeaseKind;

    #[test]
    fn the_counter_key_hides_the_subject_and_names_the_window() {
        let item = LeaseItem {
            subject: "user:alice".into(),
            kind: LeaseKind::Tokens,
            window_seconds: 60,
            window_start: 1_700_000_040,
            limit: 1,
            need: 0,
            want: 0,
            debt: 0,
            release: 0,
        };
        let key = counter_key(&item);
        assert_eq!(
            key,
            format!(
                "maas:lease:v1:{}:tokens:60:1700000040",
                hex::encode(Sha256::digest(b"user:alice"))
            )
        );
        assert!(!key.contains("alice"));
    }

    #[test]
    fn a_reply_of_the_wrong_shape_is_refused() {
        assert_eq!(parse_reply(&[], 0), None);
        assert_eq!(parse_reply(&[2, 5], 1), None);
        let ok = parse_reply(&[0, 5, 7], 1).unwrap();
        assert_eq!(ok.replicas, 1);
        assert_eq!(
            ok.grants,
            vec![LeaseGrant {
                granted: 5,
                taken: 7
            }]
        );
    }
}
