//! The quota-warning webhook (issue 30, `--quota-webhook-url`): one signed event per window per
//! `warnAt` threshold, across companions and restarts, sent from an outbox in PostgreSQL with
//! retries; never on a request's path.
//!
//! ```text
//! lease batch applied ──▶ Detector (LeaseObserver; in memory, no I/O) ──try_send──▶ channel (bounded)
//!                                                                               │
//!         recorder task: INSERT quota_warnings ON CONFLICT DO NOTHING ◀─────────┘
//!                        + outbox row when inserted; the pending bound
//!                                       │ notify
//!         sender task:   claim due rows (FOR UPDATE SKIP LOCKED) ─▶ signed POST ─▶ delivered / retry / dead
//! ```
//!
//! - [`detect`]: which thresholds a counter's global count is past (pure);
//! - [`store`]: the SQL;
//! - [`deliver`]: one attempt, its signature, its outcome, the backoff.
//!
//! Detection is level-triggered: every batch that finds a counter past a threshold offers it
//! until this companion knows it recorded (a full channel or a failed insert only delays it).

pub mod deliver;
pub mod detect;
pub mod store;

use crate::leases::LeaseObserver;
use crate::metrics::Metrics;
use crate::policy::PolicyHandle;
use crate::settings::{MAX_RETRY_AFTER, QuotaWebhookSettings};
use chrono::{DateTime, SecondsFormat, Utc};
use detect::{Crossing, Key, Scope};
use maas_types::lease::{LeaseGrant, LeaseItem};
use secrecy::ExposeSecret;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use store::{Claimed, Final, WebhookStore};
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;
use uuid::Uuid;

/// Crossings waiting for the recorder at most; beyond, offered again by a later batch.
const CHANNEL: usize = 1024;
/// Crossings the recorder takes at once.
const RECORD_BATCH: usize = 64;
/// Recorded crossings this companion remembers (to offer them no more); beyond, forgotten
/// (the database still refuses them twice).
const REMEMBERED: usize = 65_536;
/// Rows one companion sends at once.
const SEND_BATCH: u32 = 16;
/// A claim outlives its attempt's timeout by this much.
const CLAIM_MARGIN: Duration = Duration::from_secs(30);
/// How often ended windows' warnings are forgotten.
const PRUNE_INTERVAL: Duration = Duration::from_secs(3600);

/// The event (docs/contracts.md "Quota-warning webhook").
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct QuotaWarningEvent {
    #[serde(rename = "type")]
    pub event_type: &'static str,
    pub id: String,
    pub created_at: String,
    /// The user's keyed pseudonym (`crate::pseudonym::subject`); none for a subscription's
    /// pool, which is everyone's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    pub scope: EventScope,
    pub kind: &'static str,
    pub window: String,
    pub window_start: String,
    pub limit: u64,
    pub used: u64,
    pub percent_used: u64,
    pub threshold: u8,
    pub shadow: bool,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EventScope {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subscription: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The subscription's limits are one pool for all its users (`subscriptions[].pool`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub pool: bool,
    /// A scope's limit (`scopes[].name`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scope: Option<String>,
    /// A scope `per: key`: the API key's public id whose counter it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_id: Option<String>,
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// The event's JSON for crossing `c` recorded as `id` at `now`.
pub fn event_body(c: &Crossing, id: Uuid, now: DateTime<Utc>) -> String {
    let scope = match &c.scope {
        Scope::Tier(name) => EventScope {
            tier: Some(name.clone()),
            subscription: None,
            model: None,
            pool: false,
            scope: None,
            key_id: None,
        },
        Scope::Named { name, key_id } => EventScope {
            tier: None,
            subscription: None,
            model: None,
            pool: false,
            scope: Some(name.clone()),
            key_id: key_id.clone(),
        },
        Scope::Subscription { name, model } => EventScope {
            tier: None,
            subscription: Some(name.clone()),
            model: Some(model.clone()),
            // A pool's counter names no user (`Subscription::counter_subject_of`).
            pool: c.user.is_empty(),
            scope: None,
            key_id: None,
        },
    };
    let event = QuotaWarningEvent {
        event_type: "quota.warning",
        id: id.to_string(),
        created_at: rfc3339(now),
        subject: (!c.user.is_empty()).then(|| crate::pseudonym::subject(&c.user)),
        scope,
        kind: c.kind.as_str(),
        window: c.window.to_string(),
        window_start: rfc3339(
            DateTime::from_timestamp(i64::try_from(c.window_start).unwrap_or(i64::MAX), 0)
                .unwrap_or_default(),
        ),
        limit: c.limit,
        used: c.used,
        percent_used: c.percent_used,
        threshold: c.threshold,
        shadow: c.shadow,
    };
    serde_json::to_string(&event).unwrap_or_default()
}

/// The crossings this companion knows are recorded, with their window's end (bounded).
#[derive(Default)]
struct Remembered(Mutex<HashMap<Key, u64>>);

impl Remembered {
    fn contains(&self, key: &Key) -> bool {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains_key(key)
    }

    fn insert(&self, key: Key, window_end: u64, now: u64) {
        let mut map = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if map.len() >= REMEMBERED {
            map.retain(|_, end| *end > now);
            if map.len() >= REMEMBERED {
                map.clear();
            }
        }
        map.insert(key, window_end);
    }
}

/// The lease observer: finds crossings in an applied batch and hands the new ones over.
struct Detector {
    policy: PolicyHandle,
    remembered: Arc<Remembered>,
    crossings: mpsc::Sender<Crossing>,
}

impl LeaseObserver for Detector {
    fn applied(&self, items: &[LeaseItem], grants: &[LeaseGrant]) {
        let policy = self.policy.document();
        for (item, grant) in items.iter().zip(grants) {
            for c in detect::crossings(&policy, item, grant.taken) {
                if self.remembered.contains(&c.key()) {
                    continue;
                }
                // Full: the next batch of this counter offers it again.
                if self.crossings.try_send(c).is_err() {
                    return;
                }
            }
        }
    }
}

/// What the background tasks share.
struct Worker {
    store: WebhookStore,
    settings: QuotaWebhookSettings,
    metrics: Arc<Metrics>,
    remembered: Arc<Remembered>,
    wake: Notify,
    client: reqwest::Client,
    /// Whether the last database call failed (a failure is logged once, not at every poll).
    failing: std::sync::atomic::AtomicBool,
}

fn unix_now() -> u64 {
    u64::try_from(Utc::now().timestamp()).unwrap_or(0)
}

impl Worker {
    /// Logs a database failure once per outage.
    fn database(&self, outcome: Result<(), store::StoreError>, what: &str) {
        use std::sync::atomic::Ordering;
        match outcome {
            Ok(()) => {
                if self.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!("quota webhook: the database answers again");
                }
            }
            Err(e) => {
                if !self.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e, "quota webhook: {what} failed; retried");
                }
            }
        }
    }

    /// Records one crossing: true when this call queued its event.
    async fn record(&self, c: &Crossing) -> bool {
        let key = c.key();
        if self.remembered.contains(&key) {
            return false;
        }
        let id = Uuid::new_v4();
        let body = event_body(c, id, Utc::now());
        match self.store.record(&key, c.window_end(), id, &body).await {
            Ok(queued) => {
                self.database(Ok(()), "recording a warning");
                self.remembered.insert(key, c.window_end(), unix_now());
                if queued {
                    tracing::info!(
                        event = %id,
                        user = %crate::pseudonym::user(&c.user),
                        threshold = c.threshold,
                        kind = c.kind.as_str(),
                        window = %c.window,
                        shadow = c.shadow,
                        "quota warning queued for the webhook"
                    );
                }
                queued
            }
            Err(e) => {
                self.database(Err(e), "recording a warning");
                false
            }
        }
    }

    /// Takes crossings as they come, records them, keeps the outbox within its bound.
    async fn run_recorder(self: Arc<Self>, mut crossings: mpsc::Receiver<Crossing>) {
        while let Some(first) = crossings.recv().await {
            let mut batch = vec![first];
            while batch.len() < RECORD_BATCH {
                match crossings.try_recv() {
                    Ok(c) => batch.push(c),
                    Err(_) => break,
                }
            }
            let mut queued = 0u32;
            for c in &batch {
                queued += u32::from(self.record(c).await);
            }
            if queued > 0 {
                self.keep_bound().await;
                self.wake.notify_one();
            }
        }
    }

    /// Drops the oldest undelivered events beyond `max_pending`. A row being claimed at that
    /// moment is skipped (locked): the sender calls this again while the outbox is over.
    async fn keep_bound(&self) {
        match self.store.bound(self.settings.max_pending).await {
            Ok(dropped) => {
                if dropped > 0 {
                    tracing::warn!(
                        dropped,
                        max_pending = self.settings.max_pending,
                        "quota webhook: oldest undelivered events dropped (pending bound)"
                    );
                }
                self.metrics.quota_webhook.count("dropped", dropped);
            }
            Err(e) => self.database(Err(e), "bounding the outbox"),
        }
    }

    /// One attempt of a claimed row, and its outcome written back.
    async fn send(&self, row: Claimed) {
        let id = row.id.to_string();
        let outcome = deliver::attempt(
            &self.client,
            self.settings.url.expose_secret(),
            self.settings.secret.expose_secret(),
            &id,
            &row.body,
        )
        .await;
        // Counted once the outcome is written: what the metric says is in the database.
        let (result, written) = match outcome {
            deliver::Outcome::Delivered => (
                "delivered",
                self.store
                    .finish(row.id, Final::Delivered, row.attempts, None)
                    .await,
            ),
            deliver::Outcome::Retry { error, retry_after }
                if row.attempts < self.settings.max_attempts =>
            {
                let backoff = deliver::backoff(
                    row.attempts,
                    self.settings.retry_base,
                    self.settings.retry_max,
                    rand::random::<f64>(),
                );
                let delay = deliver::next_delay(backoff, retry_after, MAX_RETRY_AFTER);
                tracing::debug!(event = %id, attempts = row.attempts, %error, "quota webhook attempt failed; retried");
                (
                    "retried",
                    self.store.retry_later(row.id, delay, &error).await,
                )
            }
            deliver::Outcome::Retry { error, .. } | deliver::Outcome::Refused { error } => {
                tracing::warn!(event = %id, attempts = row.attempts, %error, endpoint = %self.settings.endpoint, "quota webhook event dead: not delivered");
                (
                    "dead",
                    self.store
                        .finish(row.id, Final::Dead, row.attempts, Some(&error))
                        .await,
                )
            }
        };
        self.metrics.quota_webhook.count(result, 1);
        // Unwritten, the claim runs out and the event is sent again (same id).
        self.database(written, "writing a delivery's outcome");
    }

    /// Sends due rows (several at once) until none is due, then waits for the recorder or the
    /// poll interval; updates the pending gauge; forgets ended windows now and then.
    async fn run_sender(self: Arc<Self>) {
        let hold = self.settings.timeout.saturating_add(CLAIM_MARGIN);
        let mut pruned = Instant::now();
        loop {
            match self.store.pending().await {
                Ok(n) => {
                    self.metrics.quota_webhook.pending.set(n);
                    if n > i64::from(self.settings.max_pending) {
                        self.keep_bound().await;
                    }
                }
                Err(e) => self.database(Err(e), "counting the outbox"),
            }
            if pruned.elapsed() >= PRUNE_INTERVAL {
                pruned = Instant::now();
                let done = self.store.prune().await.map(|_| ());
                self.database(done, "pruning old warnings");
            }
            match self.store.claim(SEND_BATCH, hold).await {
                Ok(rows) if !rows.is_empty() => {
                    futures::future::join_all(rows.into_iter().map(|r| self.send(r))).await;
                    continue;
                }
                Ok(_) => {}
                Err(e) => self.database(Err(e), "claiming due events"),
            }
            tokio::select! {
                () = self.wake.notified() => {}
                () = tokio::time::sleep(self.settings.poll_interval) => {}
            }
        }
    }
}

/// What [`start`] gives: the lease observer and the tasks.
pub type Started = (Arc<dyn LeaseObserver>, Vec<JoinHandle<()>>);

/// Turns the webhook on: the lease observer to give the leases, and the recorder and sender
/// tasks. The client follows no redirect and gives up on an attempt after the timeout.
pub fn start(
    settings: &QuotaWebhookSettings,
    store: WebhookStore,
    policy: PolicyHandle,
    metrics: Arc<Metrics>,
) -> anyhow::Result<Started> {
    let client = reqwest::Client::builder()
        .timeout(settings.timeout)
        .connect_timeout(settings.timeout)
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("maas-companion/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| anyhow::anyhow!("quota webhook client: {e}"))?;
    if settings.endpoint.starts_with("http://")
        && !["127.0.0.1", "[::1]", "localhost"]
            .iter()
            .any(|h| settings.endpoint.starts_with(&format!("http://{h}:")))
    {
        tracing::warn!(endpoint = %settings.endpoint, "quota webhook over plain HTTP: events travel unencrypted (signed, not secret) unless a mesh encrypts them");
    }
    tracing::info!(endpoint = %settings.endpoint, max_attempts = settings.max_attempts, max_pending = settings.max_pending, "quota webhook on");
    let remembered = Arc::new(Remembered::default());
    let (tx, rx) = mpsc::channel(CHANNEL);
    let worker = Arc::new(Worker {
        store,
        settings: settings.clone(),
        metrics,
        remembered: remembered.clone(),
        wake: Notify::new(),
        client,
        failing: std::sync::atomic::AtomicBool::new(false),
    });
    let tasks = vec![
        tokio::spawn(worker.clone().run_recorder(rx)),
        tokio::spawn(worker.run_sender()),
    ];
    let detector = Detector {
        policy,
        remembered,
        crossings: tx,
    };
    Ok((Arc::new(detector), tasks))
}

#[cfg(test)]
mod tests {
    use super::*;
    use maas_types::Window;
    use maas_types::lease::LeaseKind;

    #[test]
    fn the_event_names_the_pseudonym_and_its_scope_never_the_user() {
        let c = Crossing {
            user: "alice".into(),
            scope: Scope::Subscription {
                name: "team".into(),
                model: "m".into(),
            },
            kind: LeaseKind::Tokens,
            window: Window::parse("1h").unwrap(),
            window_start: 1_800_000_000,
            limit: 200,
            used: 170,
            percent_used: 85,
            threshold: 80,
            shadow: false,
        };
        let id = Uuid::new_v4();
        let now = DateTime::parse_from_rfc3339("2027-01-15T08:30:05.123Z")
            .unwrap()
            .to_utc();
        let body = event_body(&c, id, now);
        assert!(!body.contains("alice"), "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "type": "quota.warning", "id": id.to_string(), "createdAt": "2027-01-15T08:30:05Z",
                "subject": crate::pseudonym::subject("alice"),
                "scope": {"subscription": "team", "model": "m"},
                "kind": "tokens", "window": "1h", "windowStart": "2027-01-15T08:00:00Z",
                "limit": 200, "used": 170, "percentUsed": 85, "threshold": 80, "shadow": false
            })
        );
        let tier = Crossing {
            scope: Scope::Tier("free".into()),
            ..c
        };
        let v: serde_json::Value = serde_json::from_str(&event_body(&tier, id, now)).unwrap();
        assert_eq!(v["scope"], serde_json::json!({"tier": "free"}));
    }

    #[test]
    fn remembered_crossings_are_bounded() {
        let r = Remembered::default();
        let key = |i: u64| Key {
            subject_sha256: i.to_string(),
            scope: "tier:free".into(),
            model: String::new(),
            kind: "tokens",
            window_seconds: 60,
            window_start: 0,
            threshold: 80,
            shadow: false,
        };
        for i in 0..REMEMBERED as u64 {
            r.insert(key(i), 60, 0);
        }
        assert!(r.contains(&key(0)));
        // Full of live windows: forgotten, then the new one kept.
        r.insert(key(u64::MAX), 60, 0);
        assert!(!r.contains(&key(0)) && r.contains(&key(u64::MAX)));
        assert_eq!(r.0.lock().unwrap().len(), 1);
    }
}
