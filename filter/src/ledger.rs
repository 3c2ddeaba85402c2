//! Usage reports to the companion's ledger (issue 16; contract: `maas_types::usage`).
//!
//! Each worker adds up, in the VM (no host call per request), what it forwarded and refused per
//! (subject, key id, tier, model, backend, hour) into open records (`backend`: the model's
//! backend that served, for a model with several; so the counts per backend are exact); the root context's tick sends one
//! `POST /internal/v1/usage` per `usage.reportIntervalMs` with at most
//! [`MAX_USAGE_RECORDS`] of them (the oldest first; more go at the next tick).
//!
//! ```text
//!  settle / refuse ──▶ open records (in the VM) ──every reportIntervalMs──▶ batch {batchId}
//!                            ▲                                                │
//!                            │ new records keep accumulating    200 ──▶ done (more open: next tick)
//!                            │                                  400 ──▶ dropped (counted), never resent
//!                            └──────── kept verbatim ◀─────── 503 / other / timeout / dispatch error:
//!                                      (same bytes, same batchId, resent every interval until a 200)
//! ```
//!
//! The companion ignores a `(replica, batchId)` it applied already, so a batch whose answer was
//! lost counts once. `batchId` = `<replica>/<worker>/<sequence>` (`worker`: drawn at start, so a
//! restarted Envoy with the same `node.id` never reuses an id). Memory is bounded: at most
//! `usage.maxPendingRecords` records per worker (open + in flight or kept); beyond, the oldest open
//! record is dropped and counted in `maas_usage_records_dropped_total` (one log line per minute).
//!
//! What a record counts:
//! - `requests`: requests forwarded to a model and settled (discovery, which counts nothing in
//!   the limits, is not counted);
//! - `promptTokens` / `completionTokens`: the usage the response carried; without one, the
//!   settled amount (what the limits were charged: the reservation when no response or no
//!   readable usage came, content events + the prompt estimate for an aborted stream, 0 for an
//!   upstream error) with the prompt estimate as prompt tokens and the rest as completion —
//!   raw tokens, never the weighted amount the limits count (tier / subscription `tokenWeights`);
//! - `cachedInputTokens`: the part of `promptTokens` the response said was served from the
//!   provider's prompt cache (0 without usage);
//! - `refused`: refusals after authentication (the subject and its tier known), by the
//!   refusal's error code (`rate_limit_exceeded`, `tokens_exceed_limit`, `model_mismatch`, …).
//!
//! The hour is the worker's clock of its last tick (≤ 200 ms old: no clock read per request).

use crate::config::{PluginConfig, UsageConfig};
use crate::host::Host;
use crate::metrics::Metrics;
use maas_types::usage::{
    MAX_REFUSAL_REASONS, MAX_USAGE_COUNT, MAX_USAGE_ID_BYTES, MAX_USAGE_RECORDS, USAGE_PATH,
    UsageRecord, UsageReport, hour_start_of, is_reason,
};
use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};

/// One minute between two "records dropped" log lines of a worker.
const DROP_LOG_INTERVAL_MS: u64 = 60_000;

/// What a record is about.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct RecordKey {
    pub subject: String,
    pub key_id: Option<String>,
    pub tier: String,
    pub model: String,
    /// The model's backend that served (`None`: a model without backends, or none named).
    pub backend: Option<String>,
    pub hour_start: u64,
}

/// A [`RecordKey`] borrowed: a request finds its open record without copying the key (only a
/// new record owns one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct KeyRef<'a> {
    subject: &'a str,
    key_id: Option<&'a str>,
    tier: &'a str,
    model: &'a str,
    backend: Option<&'a str>,
    hour_start: u64,
}

/// A record key, owned or borrowed: what the open records are looked up by.
trait AsKeyRef {
    fn key_ref(&self) -> KeyRef<'_>;
}

impl AsKeyRef for RecordKey {
    fn key_ref(&self) -> KeyRef<'_> {
        KeyRef {
            subject: &self.subject,
            key_id: self.key_id.as_deref(),
            tier: &self.tier,
            model: &self.model,
            backend: self.backend.as_deref(),
            hour_start: self.hour_start,
        }
    }
}

impl AsKeyRef for KeyRef<'_> {
    fn key_ref(&self) -> KeyRef<'_> {
        *self
    }
}

// Owned and borrowed keys hash and compare as their `KeyRef`, so the map's `Borrow` holds.
impl std::hash::Hash for RecordKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.key_ref().hash(state);
    }
}

impl std::hash::Hash for dyn AsKeyRef + '_ {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.key_ref().hash(state);
    }
}

impl PartialEq for dyn AsKeyRef + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.key_ref() == other.key_ref()
    }
}

impl Eq for dyn AsKeyRef + '_ {}

impl<'a> std::borrow::Borrow<dyn AsKeyRef + 'a> for RecordKey {
    fn borrow(&self) -> &(dyn AsKeyRef + 'a) {
        self
    }
}

/// What happened to one request, as the ledger counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event<'a> {
    /// Forwarded and settled with these (raw) tokens; `cached` is part of `prompt`.
    Settled {
        prompt: u64,
        completion: u64,
        cached: u64,
    },
    /// Refused after authentication, with this error code.
    Refused(&'a str),
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    pub requests: u64,
    pub refused: BTreeMap<String, u64>,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_input_tokens: u64,
}

/// A batch sent or kept for a resend: its exact bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub batch_id: String,
    pub body: Vec<u8>,
    pub records: usize,
    /// The callout carrying it (`None`: waiting for the next interval).
    pub token: Option<u32>,
    /// A record names its serving backend (a companion older than that field refuses it).
    pub with_backends: bool,
}

/// One worker's usage ledger.
#[derive(Debug, Default)]
pub struct Ledger {
    pub enabled: bool,
    pub config: UsageConfig,
    pub replica: String,
    /// This worker's id in batch ids (drawn at configure).
    pub worker: String,
    /// The worker's clock as of its last tick (unix s).
    pub now_s: u64,
    /// Open records, and their order of creation (the oldest go first: sent, or dropped).
    open: crate::FastMap<RecordKey, Counts>,
    order: BTreeMap<u64, RecordKey>,
    next_seq: u64,
    /// Batch sequence number.
    next_batch: u64,
    /// The batch in flight, or failed and kept verbatim.
    pub batch: Option<Batch>,
    pub next_report_ms: u64,
    /// Records dropped and not yet counted in the metric.
    pub dropped_unflushed: u64,
    /// Records dropped since start.
    pub dropped_total: u64,
    last_drop_log_ms: Option<u64>,
    /// Until then (unix s) records leave out their backend: the companion refused a batch that
    /// named one (it predates the field), and is asked again after [`BACKENDS_RETRY_S`].
    backends_off_until_s: u64,
}

/// How long records leave out their backend after a companion refused one.
pub const BACKENDS_RETRY_S: u64 = 3600;

impl Ledger {
    /// Sets the ledger up (at configure): on or off, the replica id and this worker's id.
    pub fn configure(&mut self, cfg: &UsageConfig, replica: String, worker: String, now_ms: u64) {
        self.enabled = cfg.enabled;
        self.config = *cfg;
        self.replica = replica;
        self.worker = worker;
        self.now_s = now_ms / 1000;
        // The first report goes one interval after start.
        self.next_report_ms = now_ms.saturating_add(cfg.report_interval_ms);
    }

    /// Open records (not in a batch yet).
    pub fn open_len(&self) -> usize {
        self.open.len()
    }

    /// Counts of an open record.
    pub fn open_counts(&self, key: &RecordKey) -> Option<&Counts> {
        self.open.get(key)
    }

    /// Records held: open plus the batch in flight or kept.
    pub fn pending(&self) -> usize {
        self.open.len() + self.batch.as_ref().map_or(0, |b| b.records)
    }

    /// Adds one request's outcome (in the VM only). Ids the companion would refuse (empty,
    /// too long, control characters) are not recorded: a whole batch refused for one record
    /// would lose every other record in it.
    pub fn add(
        &mut self,
        subject: &str,
        key_id: Option<&str>,
        tier: &str,
        model: &str,
        event: Event<'_>,
    ) {
        self.add_served(subject, key_id, tier, model, None, event);
    }

    /// [`Self::add`] for a request one of the model's backends served (`backend`: its name).
    pub fn add_served(
        &mut self,
        subject: &str,
        key_id: Option<&str>,
        tier: &str,
        model: &str,
        backend: Option<&str>,
        event: Event<'_>,
    ) {
        if !self.enabled
            || ![subject, tier, model]
                .into_iter()
                .chain(key_id)
                .chain(backend)
                .all(valid_id)
        {
            return;
        }
        let key = KeyRef {
            subject,
            key_id,
            tier,
            model,
            backend,
            hour_start: hour_start_of(self.now_s),
        };
        if let Some(c) = self.open.get_mut(&key as &dyn AsKeyRef) {
            Self::count(c, event);
            return;
        }
        self.make_room();
        let owned = RecordKey {
            subject: subject.to_string(),
            key_id: key_id.map(str::to_string),
            tier: tier.to_string(),
            model: model.to_string(),
            backend: backend.map(str::to_string),
            hour_start: key.hour_start,
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        self.order.insert(seq, owned.clone());
        Self::count(self.open.entry(owned).or_default(), event);
    }

    /// Counts one request's outcome in its record.
    fn count(c: &mut Counts, event: Event<'_>) {
        match event {
            Event::Settled {
                prompt,
                completion,
                cached,
            } => {
                c.requests = add_capped(c.requests, 1);
                c.prompt_tokens = add_capped(c.prompt_tokens, prompt);
                c.completion_tokens = add_capped(c.completion_tokens, completion);
                // Part of the prompt: never more than it (the contract refuses that).
                c.cached_input_tokens =
                    add_capped(c.cached_input_tokens, cached.min(prompt)).min(c.prompt_tokens);
            }
            Event::Refused(reason) => {
                if !is_reason(reason) {
                    return;
                }
                if let Some(n) = c.refused.get_mut(reason) {
                    *n = add_capped(*n, 1);
                } else if c.refused.len() < MAX_REFUSAL_REASONS {
                    c.refused.insert(reason.to_string(), 1);
                }
            }
        }
    }

    /// Drops the oldest open records until one more fits.
    fn make_room(&mut self) {
        let max = self.config.max_pending_records.max(MAX_USAGE_RECORDS);
        while self.pending() >= max {
            let Some((_, key)) = self.order.pop_first() else {
                return;
            };
            self.open.remove(&key);
            self.dropped_unflushed += 1;
            self.dropped_total += 1;
        }
    }

    /// A log line about dropped records, at most once a minute (`now_ms`: the tick's clock).
    pub fn drop_log(&mut self, now_ms: u64) -> Option<String> {
        if self.dropped_total == 0 {
            return None;
        }
        if let Some(last) = self.last_drop_log_ms
            && now_ms.saturating_sub(last) < DROP_LOG_INTERVAL_MS
        {
            return None;
        }
        self.last_drop_log_ms = Some(now_ms);
        Some(format!(
            "maas: usage records dropped (ledger not answering or full): {} since start",
            self.dropped_total
        ))
    }

    /// The next batch to send now (`None`: nothing due): the kept one verbatim, else up to
    /// [`MAX_USAGE_RECORDS`] of the oldest open records.
    pub fn due(&mut self, now_ms: u64) -> Option<&Batch> {
        self.now_s = now_ms / 1000;
        if !self.enabled || now_ms < self.next_report_ms {
            return None;
        }
        if self.batch.as_ref().is_some_and(|b| b.token.is_some()) {
            // In flight: its answer (or timeout) comes first.
            return None;
        }
        self.next_report_ms = now_ms.saturating_add(self.config.report_interval_ms);
        if self.batch.is_none() {
            self.batch = self.take_batch();
        }
        self.batch.as_ref()
    }

    fn take_batch(&mut self) -> Option<Batch> {
        if self.open.is_empty() {
            return None;
        }
        let mut records = Vec::with_capacity(self.open.len().min(MAX_USAGE_RECORDS));
        while records.len() < MAX_USAGE_RECORDS {
            let Some((_, key)) = self.order.pop_first() else {
                break;
            };
            let Some(c) = self.open.remove(&key) else {
                continue;
            };
            records.push(UsageRecord {
                subject: key.subject,
                key_id: key.key_id,
                tier: key.tier,
                model: key.model,
                hour_start: key.hour_start,
                requests: c.requests,
                refused: c.refused,
                prompt_tokens: c.prompt_tokens,
                completion_tokens: c.completion_tokens,
                cached_input_tokens: c.cached_input_tokens,
                backend: key.backend,
            });
        }
        if self.now_s < self.backends_off_until_s {
            records = without_backends(records);
        }
        let seq = self.next_batch;
        self.next_batch += 1;
        let batch_id = batch_id(&self.replica, &self.worker, seq);
        let report = UsageReport {
            replica: self.replica.clone(),
            batch_id: batch_id.clone(),
            records,
        };
        let n = report.records.len();
        let with_backends = report.records.iter().any(|r| r.backend.is_some());
        match serde_json::to_vec(&report) {
            Ok(body) => Some(Batch {
                batch_id,
                body,
                records: n,
                token: None,
                with_backends,
            }),
            Err(e) => {
                log::error!("maas: usage batch not serialisable, {n} records dropped: {e}");
                self.dropped_unflushed += n as u64;
                self.dropped_total += n as u64;
                None
            }
        }
    }

    /// The batch went out on callout `token`.
    pub fn sent(&mut self, token: u32) {
        if let Some(b) = &mut self.batch {
            b.token = Some(token);
        }
    }

    /// The batch could not be dispatched: kept for the next interval.
    pub fn not_sent(&mut self) {
        if let Some(b) = &mut self.batch {
            b.token = None;
        }
    }

    /// Is `token` this ledger's batch?
    pub fn is_batch(&self, token: u32) -> bool {
        self.batch.as_ref().and_then(|b| b.token) == Some(token)
    }

    /// The companion's answer to the batch (`None`: no answer, a timeout or reset).
    /// 200: done (and when a full batch went and more records are open, the next one goes at
    /// the next tick); 400: dropped and counted (the contract: do not resend); anything else:
    /// kept verbatim for the next interval.
    pub fn answered(&mut self, status: Option<u32>, now_ms: u64) -> Outcome {
        let Some(batch) = self.batch.take() else {
            return Outcome::Unknown;
        };
        match status {
            Some(200) => {
                if batch.records >= MAX_USAGE_RECORDS && !self.open.is_empty() {
                    self.next_report_ms = now_ms;
                }
                Outcome::Applied
            }
            Some(400) if batch.with_backends => {
                // Refused whole, nothing applied: resent at once without backends (the same
                // batch id), and records leave them out for a while.
                self.now_s = now_ms / 1000;
                self.backends_off_until_s = self.now_s.saturating_add(BACKENDS_RETRY_S);
                match batch_without_backends(&batch) {
                    Some(b) => {
                        let id = b.batch_id.clone();
                        self.batch = Some(b);
                        self.next_report_ms = now_ms;
                        Outcome::ResentWithoutBackends(id)
                    }
                    None => {
                        self.dropped_unflushed += batch.records as u64;
                        self.dropped_total += batch.records as u64;
                        Outcome::Refused(batch.batch_id)
                    }
                }
            }
            Some(400) => {
                self.dropped_unflushed += batch.records as u64;
                self.dropped_total += batch.records as u64;
                Outcome::Refused(batch.batch_id)
            }
            _ => {
                self.batch = Some(Batch {
                    token: None,
                    ..batch
                });
                Outcome::Kept
            }
        }
    }
}

/// What became of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Applied,
    /// 400: the companion will never take it (logged; its records counted as dropped).
    Refused(String),
    /// Kept for a resend.
    Kept,
    /// 400 to a batch naming backends (a companion older than the field): resent without them.
    ResentWithoutBackends(String),
    /// Not this ledger's batch.
    Unknown,
}

/// The same records without their backend, those that then share a key added into one (the
/// companion takes a key once per batch).
fn without_backends(records: Vec<UsageRecord>) -> Vec<UsageRecord> {
    let mut merged: Vec<UsageRecord> = Vec::with_capacity(records.len());
    for mut r in records {
        r.backend = None;
        let same = merged.iter_mut().find(|m| {
            (&m.subject, &m.key_id, &m.tier, &m.model, m.hour_start)
                == (&r.subject, &r.key_id, &r.tier, &r.model, r.hour_start)
        });
        match same {
            Some(m) => {
                m.requests = add_capped(m.requests, r.requests);
                m.prompt_tokens = add_capped(m.prompt_tokens, r.prompt_tokens);
                m.completion_tokens = add_capped(m.completion_tokens, r.completion_tokens);
                m.cached_input_tokens = add_capped(m.cached_input_tokens, r.cached_input_tokens);
                for (reason, n) in r.refused {
                    // As when counting: reasons beyond the bound are not recorded.
                    if let Some(c) = m.refused.get_mut(&reason) {
                        *c = add_capped(*c, n);
                    } else if m.refused.len() < MAX_REFUSAL_REASONS {
                        m.refused.insert(reason, n);
                    }
                }
            }
            None => merged.push(r),
        }
    }
    merged
}

/// `batch` re-formed without backends (`None`: its body does not read back, never expected).
fn batch_without_backends(batch: &Batch) -> Option<Batch> {
    let mut report: UsageReport = serde_json::from_slice(&batch.body).ok()?;
    report.records = without_backends(report.records);
    let body = serde_json::to_vec(&report).ok()?;
    Some(Batch {
        batch_id: batch.batch_id.clone(),
        body,
        records: report.records.len(),
        token: None,
        with_backends: false,
    })
}

fn add_capped(a: u64, b: u64) -> u64 {
    a.saturating_add(b).min(MAX_USAGE_COUNT)
}

fn valid_id(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_USAGE_ID_BYTES && !s.chars().any(char::is_control)
}

/// `<replica>/<worker>/<seq>`; without the replica when that would be too long (the companion
/// keys batch ids by replica anyway).
pub fn batch_id(replica: &str, worker: &str, seq: u64) -> String {
    let full = format!("{replica}/{worker}/{seq}");
    if full.len() <= MAX_USAGE_ID_BYTES {
        full
    } else {
        format!("{worker}/{seq}")
    }
}

/// A worker id for batch ids: random (WASI `random_get` in Envoy), mixed with the clock and the
/// root context id.
pub fn draw_worker_id(now_ms: u64, context_id: u32) -> String {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(now_ms);
    h.write_u32(context_id);
    format!("w{:012x}", h.finish() & 0xffff_ffff_ffff)
}

/// The replica id of reports: the lease batches' (global limits on), else
/// `limits.global.replicaId`, else Envoy's `node.id`, else `maas-<worker>` (no shared data
/// written: the companion keys batch ids by replica, and the worker id is in them anyway).
pub fn replica(host: &dyn Host, cfg: &PluginConfig, lease_replica: &str, worker: &str) -> String {
    if !lease_replica.is_empty() {
        return lease_replica.to_string();
    }
    if let Some(id) = &cfg.limits.global.replica_id {
        return id.clone();
    }
    host.property(&["node", "id"])
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| format!("maas-{worker}"))
}

/// Dispatches the batch's bytes to `POST /internal/v1/usage`.
pub fn dispatch(host: &dyn Host, cfg: &PluginConfig, body: &[u8]) -> Result<u32, String> {
    host.dispatch(
        &cfg.companion.cluster,
        &[
            (":method", "POST"),
            (":path", USAGE_PATH),
            (":authority", cfg.companion.authority.as_str()),
            ("content-type", "application/json"),
        ],
        Some(body),
        cfg.companion.timeout_ms,
    )
}

/// The root context's tick: the "dropped" log line and counter, and the batch due (kept
/// verbatim after a failure, else the oldest open records), dispatched from the root context
/// (never cancelled with a request's stream).
pub fn tick(host: &dyn Host, ledger: &mut Ledger, metrics: &Metrics, cfg: &PluginConfig, now: u64) {
    if let Some(line) = ledger.drop_log(now) {
        log::warn!("{line}");
    }
    let dropped = std::mem::take(&mut ledger.dropped_unflushed);
    metrics.inc(metrics.usage_dropped, dropped);
    let Some(body) = ledger.due(now).map(|b| b.body.clone()) else {
        return;
    };
    match dispatch(host, cfg, &body) {
        Ok(token) => ledger.sent(token),
        Err(e) => {
            log::debug!("maas: cannot send the usage report (kept for the next one): {e}");
            ledger.not_sent();
        }
    }
}

/// The companion's answer to this worker's usage report (on the root context).
pub fn on_answer(host: &dyn Host, ledger: &mut Ledger, metrics: &Metrics, status: Option<u32>) {
    let now = host.now_ms();
    match ledger.answered(status, now) {
        Outcome::Refused(id) => {
            log::error!("maas: usage report {id} refused by the companion (status 400); dropped");
        }
        Outcome::Kept => {
            log::debug!("maas: usage report failed (status {status:?}); kept for a resend");
        }
        Outcome::ResentWithoutBackends(id) => {
            log::warn!(
                "maas: usage report {id} refused by the companion (status 400) while naming serving backends; resent without them (upgrade the companion)"
            );
        }
        Outcome::Applied | Outcome::Unknown => {}
    }
    let dropped = std::mem::take(&mut ledger.dropped_unflushed);
    metrics.inc(metrics.usage_dropped, dropped);
}

#[cfg(test)]
mod tests;
