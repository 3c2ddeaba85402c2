//! Budget leases (global limits across gateway replicas), the worker's side: the replica id,
//! the fallback state all workers of this Envoy share, the subjects a worker admitted recently,
//! and each worker's batch of debts, releases and renewals (`POST /internal/v1/leases`).
//!
//! ```text
//!  request: lease short ──one callout (need, want)──▶ 200: grants added (CAS) ─▶ admit again
//!                 │                                    │ else (dispatch error, timeout, non-200)
//!                 │                                    ▼
//!                 │                              FALLBACK (shared `maas/g/state`): no callout,
//!                 │                              lease = max(granted, ⌊limit × share⌋),
//!                 │                              share = 1 ÷ at least `limits.global.replicas`
//!                 │                              ([`fallback_share`]; none configured: 503)
//!  every reportIntervalMs, per worker: claim (CAS) debt = count − granted, release of idle
//!  subjects, renewals → one batch (a `batchId`) ─▶ 200: grants added
//!                                                 │ else: fallback; the batch is kept, claims
//!                                                 ▼ and all, and re-sent VERBATIM (same id)
//!  outbox (per worker): one batch out at a time;  every reportIntervalMs until a 200 (it is the
//!  new claims only once it is answered           probe in fallback: debts go in it too)
//! ```
//!
//! **Exactly once.** The companion answers a repeated `batchId` with its first answer and
//! applies nothing again, so a batch that timed out but was applied late (Redis paused) is
//! counted once and its grants still reach this replica. A request's lease callout carries an
//! id too: when its answer never comes (timeout, error, or its stream was cancelled with the
//! callout), it joins the outbox and is re-sent the same way — the grants the companion may
//! have made are then added here (and released when idle) instead of stranded until the
//! window's end.
//!
//! **Rates outlive idleness.** A subject idle for `idleReleaseMs` is released and no longer
//! tracked, but its counters' recent rates ([`Meter`]) are remembered (at most
//! [`MAX_REMEMBERED`] subjects): when it comes back, its first lease is sized by the rate of
//! its last burst, not by the window's average, which its idle time dilutes (a daily window
//! used in bursts would otherwise pay a callout per subject and replica every few hundred
//! milliseconds until two reports have measured the new burst).
//!
//! The counters themselves (count, granted, others per window) are in `limits`.

use crate::config::{GlobalConfig, OnUnavailable, PluginConfig};
use crate::host::Host;
use crate::limits::{self, Claim, Grant, LeaseCounter, LeaseNeed, LeasePolicy, Meter};
use crate::store::{SharedStore, read_u64};
use maas_types::lease::{LEASES_PATH, LeaseItem, LeaseRequest, LeaseResponse, MAX_BATCH_ITEMS};
use std::hash::{BuildHasher, Hasher};

/// Shared-data key of the fallback state (one per Envoy: every worker reads it each tick).
pub const STATE_KEY: &str = "maas/g/state";
/// Shared-data key of a drawn replica id (the first worker's draw wins).
pub const REPLICA_KEY: &str = "maas/g/replica";

/// Subjects a worker tracks at most (beyond: the least recently reported idle ones go first).
pub const MAX_TRACKED: usize = 100_000;

/// Idle subjects whose rates a worker remembers at most (beyond: an arbitrary one is forgotten).
pub const MAX_REMEMBERED: usize = 10_000;

/// Unanswered lease callouts of request paths a worker keeps to re-send at most (beyond: their
/// grants, if any were made, stay taken until their window ends).
pub const MAX_ORPHANS: usize = 256;

/// The fallback state of this Envoy (shared data; each worker keeps its last view).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GlobalState {
    pub fallback: bool,
    /// When fallback was entered (ms).
    pub since_ms: u64,
    /// Active replicas as of the last answer (at least 1).
    pub replicas: u32,
}

impl Default for GlobalState {
    fn default() -> Self {
        GlobalState {
            fallback: false,
            since_ms: 0,
            replicas: 1,
        }
    }
}

impl GlobalState {
    fn encode(&self) -> Vec<u8> {
        let mut out = vec![1, u8::from(self.fallback)];
        out.extend_from_slice(&self.since_ms.to_le_bytes());
        out.extend_from_slice(&self.replicas.to_le_bytes());
        out
    }

    fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != 14 || b.first() != Some(&1) {
            return None;
        }
        let replicas = u32::from_le_bytes(b.get(10..14)?.try_into().ok()?);
        Some(GlobalState {
            fallback: *b.get(1)? == 1,
            since_ms: read_u64(b, 2)?,
            replicas: replicas.max(1),
        })
    }
}

/// A subject this worker admitted recently.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tracked {
    /// Its counter slot key.
    pub key: String,
    pub counters: Vec<LeaseCounter>,
    /// Each counter's recent rate (same order as `counters`), observed by the reports.
    pub meters: Vec<Meter>,
    /// Last admission (ms).
    pub last_ms: u64,
    /// Last time a batch looked at it (ms).
    pub reported_ms: u64,
}

impl Tracked {
    /// Tracked from now, with the rates remembered for the same counters (`remembered`).
    fn new(
        key: &str,
        counters: Vec<LeaseCounter>,
        now_ms: u64,
        remembered: Option<Remembered>,
    ) -> Self {
        let meters = match remembered {
            Some(r) if r.counters == counters => r.meters.into_iter().map(Meter::resumed).collect(),
            _ => vec![Meter::default(); counters.len()],
        };
        Tracked {
            key: key.to_string(),
            meters,
            counters,
            last_ms: now_ms,
            reported_ms: 0,
        }
    }

    /// What the recent rate of the counter (`kind`, `window`) uses over `horizon_ms` (0 when
    /// not tracked or not measured yet).
    pub fn recent(&self, kind: limits::Kind, window: u64, horizon_ms: u64) -> u64 {
        meter_of(&self.counters, &self.meters, kind, window)
            .map_or(0, |m| m.for_horizon(horizon_ms))
    }
}

/// The meter of the counter (`kind`, `window`) among `counters` (`meters` in the same order).
fn meter_of<'a>(
    counters: &[LeaseCounter],
    meters: &'a [Meter],
    kind: limits::Kind,
    window: u64,
) -> Option<&'a Meter> {
    counters
        .iter()
        .zip(meters)
        .find(|(c, _)| c.kind == kind && c.window == window)
        .map(|(_, m)| m)
}

/// The rates of a subject that was released for idleness (see the module).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Remembered {
    pub counters: Vec<LeaseCounter>,
    pub meters: Vec<Meter>,
}

/// What a batch claimed for one subject: (subject, counter slot key, claims in item order).
pub type Claimed = (String, String, Vec<Claim>);

/// A batch of the outbox: sent, and re-sent verbatim until a 200.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Its `batchId`.
    pub id: String,
    /// The request body, exactly as sent the first time.
    pub body: Vec<u8>,
    /// What it claimed (or, for a request's callout, asked), per subject, in item order.
    pub claims: Vec<Claimed>,
    /// The callout out for it; `None`: to send (again) at the next report.
    pub token: Option<u32>,
}

impl Batch {
    pub fn items(&self) -> usize {
        self.claims.iter().map(|(_, _, c)| c.len()).sum()
    }
}

/// One worker's lease state.
#[derive(Debug, Default)]
pub struct Leases {
    pub replica: String,
    pub state: GlobalState,
    pub tracked: crate::FastMap<String, Tracked>,
    /// Rates of the subjects dropped from `tracked` for idleness.
    pub remembered: crate::FastMap<String, Remembered>,
    /// Batches not answered with a 200 yet, oldest first; only the first is ever out.
    pub outbox: std::collections::VecDeque<Batch>,
    pub next_report_ms: u64,
    /// Drawn per worker at start: batch ids are `<nonce>-<seq>` (unique per replica, also
    /// across restarts with the same replica id).
    pub nonce: u64,
    pub seq: u64,
}

impl Leases {
    /// A fresh batch id.
    pub fn next_batch_id(&mut self) -> String {
        self.seq = self.seq.wrapping_add(1);
        format!("{:016x}-{}", self.nonce, self.seq)
    }

    /// The outbox's first batch when it is out as callout `token`: taken out of the outbox.
    pub fn take_answered(&mut self, token: u32) -> Option<Batch> {
        match self.outbox.front() {
            Some(b) if b.token == Some(token) => self.outbox.pop_front(),
            _ => None,
        }
    }

    /// A request's lease callout that got no answer: re-sent by the outbox (see the module).
    pub fn orphan(&mut self, batch: Batch) {
        let orphans = self.outbox.len();
        if orphans >= MAX_ORPHANS {
            log::debug!("maas: too many unanswered lease callouts; one is not re-sent");
            return;
        }
        self.outbox.push_back(Batch {
            token: None,
            ..batch
        });
    }

    /// Starts tracking `subject` unless it is (no admission noted: idle release runs as usual).
    pub fn track_quietly(
        &mut self,
        subject: &str,
        key: &str,
        counters: Vec<LeaseCounter>,
        now_ms: u64,
    ) {
        if self.tracked.contains_key(subject) || self.tracked.len() >= MAX_TRACKED {
            return;
        }
        self.start_tracking(subject, key, counters, now_ms);
    }

    /// Notes an admission of `subject` (in-VM only: no host call).
    pub fn track(
        &mut self,
        subject: &str,
        key: &str,
        counters: impl FnOnce() -> Vec<LeaseCounter>,
        now_ms: u64,
    ) {
        if let Some(t) = self.tracked.get_mut(subject) {
            t.last_ms = now_ms;
            return;
        }
        if self.tracked.len() >= MAX_TRACKED {
            // Full: the subject is still limited locally, its debts are reported once there is
            // room (the tick drops idle subjects).
            return;
        }
        let counters = counters();
        self.start_tracking(subject, key, counters, now_ms);
    }

    /// Tracks `subject` from now, with the rates it left behind when it was last dropped.
    fn start_tracking(
        &mut self,
        subject: &str,
        key: &str,
        counters: Vec<LeaseCounter>,
        now_ms: u64,
    ) {
        let remembered = self.remembered.remove(subject);
        self.tracked.insert(
            subject.to_string(),
            Tracked::new(key, counters, now_ms, remembered),
        );
    }

    /// What the recent rate of `subject`'s counter (`kind`, `window`) uses over `horizon_ms`:
    /// tracked, or remembered from before it idled (0 when neither).
    pub fn recent(&self, subject: &str, kind: limits::Kind, window: u64, horizon_ms: u64) -> u64 {
        if let Some(t) = self.tracked.get(subject) {
            return t.recent(kind, window, horizon_ms);
        }
        self.remembered
            .get(subject)
            .and_then(|r| meter_of(&r.counters, &r.meters, kind, window))
            .map_or(0, |m| m.resumed().for_horizon(horizon_ms))
    }

    /// Stops tracking an idle `subject`, remembering its rates.
    fn drop_idle(&mut self, subject: &str) {
        let Some(t) = self.tracked.remove(subject) else {
            return;
        };
        if self.remembered.len() >= MAX_REMEMBERED
            && let Some(old) = self.remembered.keys().next().cloned()
        {
            self.remembered.remove(&old);
        }
        self.remembered.insert(
            subject.to_string(),
            Remembered {
                counters: t.counters,
                meters: t.meters,
            },
        );
    }
}

/// How admission uses leases now (`None`: global limits off).
pub fn policy(cfg: &PluginConfig, state: &GlobalState) -> Option<LeasePolicy> {
    let g = &cfg.limits.global;
    if !g.enabled {
        return None;
    }
    let fallback_share = if state.fallback && g.on_unavailable == OnUnavailable::Fallback {
        fallback_share(g, state)
    } else {
        None
    };
    Some(LeasePolicy {
        fallback_share,
        horizon_ms: g.lease_horizon_ms,
        short_retry_s: short_retry_s(g),
    })
}

/// The share of each limit a replica in fallback admits on its own: `fallbackFraction`, else
/// 1 ÷ the replicas it must assume — `limits.global.replicas` (the Gateway's replica count) or
/// more when the last answer counted more. The companion's count alone is never trusted
/// below the configured one: it counts the replicas that called in its last 30 s, so it is 1
/// before any answer, it misses a replica without traffic, and the first replica to call after
/// a quiet spell longer than that sees only itself. `None` when neither is configured: the
/// replica cannot know how many others admit on their own, so a short lease is refused (503).
pub fn fallback_share(g: &GlobalConfig, state: &GlobalState) -> Option<f64> {
    if let Some(fraction) = g.fallback_fraction {
        return Some(fraction);
    }
    let assumed = g.replicas?.max(state.replicas).max(1);
    Some(1.0 / f64::from(assumed))
}

/// What a replica does in fallback under `g`, for the log at start (`true`: worth a warning).
pub fn fallback_rule(g: &GlobalConfig) -> (bool, String) {
    if g.on_unavailable == OnUnavailable::Refuse {
        return (
            false,
            "lease service not answering → 503 limits_unavailable beyond the leases held \
             (onUnavailable: refuse)"
                .into(),
        );
    }
    match (g.fallback_fraction, g.replicas) {
        (Some(f), _) => (
            false,
            format!(
                "lease service not answering → each limit × {f} on this replica (fallbackFraction)"
            ),
        ),
        (None, Some(n)) => (
            false,
            format!(
                "lease service not answering → each limit ÷ {n} on this replica, or ÷ more when \
                 the companion last counted more (limits.global.replicas)"
            ),
        ),
        (None, None) => (
            true,
            "limits.global.replicas is not set: while the lease service does not answer, \
             requests beyond the leases held are refused (503 limits_unavailable); set it to the \
             Gateway's replica count to admit within a local share instead"
                .into(),
        ),
    }
}

/// Retry-after of a 429 for a short lease while the limit is not reached globally: other
/// replicas hand back idle leases within idleReleaseMs + reportIntervalMs.
pub fn short_retry_s(g: &GlobalConfig) -> u64 {
    g.idle_release_ms
        .saturating_add(g.report_interval_ms)
        .div_ceil(1000)
        .max(1)
}

/// A request's needs as the claims of an outbox batch (nothing claimed: only asked).
pub fn asked(needs: &[LeaseNeed]) -> Vec<Claim> {
    needs
        .iter()
        .map(|n| Claim {
            kind: n.kind,
            window: n.window,
            start: n.start,
            limit: n.limit,
            debt: 0,
            release: 0,
            want: n.want,
        })
        .collect()
}

/// The counters an outbox batch's claims are about (to track a subject it brought grants for).
pub fn counters_of(claims: &[Claim]) -> Vec<LeaseCounter> {
    claims
        .iter()
        .map(|c| LeaseCounter {
            kind: c.kind,
            window: c.window,
            limit: c.limit,
        })
        .collect()
}

/// A request's lease items.
pub fn items_for(subject: &str, needs: &[LeaseNeed]) -> Vec<LeaseItem> {
    needs
        .iter()
        .map(|n| LeaseItem {
            subject: subject.to_string(),
            kind: n.kind.lease_kind(),
            window_seconds: n.window,
            window_start: n.start,
            limit: n.limit,
            need: n.need,
            want: n.want,
            debt: 0,
            release: 0,
        })
        .collect()
}

/// The body of one `POST /internal/v1/leases`.
pub fn encode(replica: &str, batch_id: &str, items: Vec<LeaseItem>) -> Result<Vec<u8>, String> {
    serde_json::to_vec(&LeaseRequest {
        replica: replica.to_string(),
        batch_id: Some(batch_id.to_string()),
        items,
    })
    .map_err(|e| e.to_string())
}

/// Dispatches one `POST /internal/v1/leases` with `body` ([`encode`]).
pub fn dispatch(host: &dyn Host, cfg: &PluginConfig, body: &[u8]) -> Result<u32, String> {
    host.dispatch(
        &cfg.companion.cluster,
        &[
            (":method", "POST"),
            (":path", LEASES_PATH),
            (":authority", cfg.companion.authority.as_str()),
            ("content-type", "application/json"),
        ],
        Some(body),
        cfg.companion.timeout_ms,
    )
}

/// The companion's answer for `items` items: `None` unless a 200 with one grant per item.
pub fn answer(status: Option<u32>, body: &[u8], items: usize) -> Option<LeaseResponse> {
    if status != Some(200) {
        return None;
    }
    let r: LeaseResponse = serde_json::from_slice(body).ok()?;
    (r.grants.len() == items).then_some(r)
}

/// Where Envoy's node id is read from, in this order.
pub const NODE_ID_PATHS: [&[&str]; 2] = [&["xds", "node", "id"], &["node", "id"]];

/// A random number, seeded by the OS's randomness (WASI random_get in Envoy).
pub fn draw(host: &dyn Host, context_id: u32) -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(host.now_ms());
    h.write_u32(context_id);
    h.finish()
}

/// The replica id: pluginConfig, else Envoy's `node.id`, else an id drawn at start (the first
/// worker's draw, through shared data).
pub fn replica_id(host: &dyn Host, cfg: &GlobalConfig, context_id: u32) -> String {
    if let Some(id) = &cfg.replica_id {
        return id.clone();
    }
    // Envoy's attribute is `xds.node` (a `config.core.v3.Node`); older Envoys had a top-level
    // `node`.
    for path in NODE_ID_PATHS {
        if let Some(id) = host.property(path).filter(|s| !s.is_empty()) {
            return id;
        }
    }
    let (value, cas) = host.get(REPLICA_KEY);
    if let Some(v) = value.filter(|v| !v.is_empty()) {
        return String::from_utf8_lossy(&v).into_owned();
    }
    let drawn = format!("maas-{:016x}", draw(host, context_id));
    let _ = host.set(REPLICA_KEY, drawn.as_bytes(), cas);
    // Whoever wrote first wins: read back what is there.
    host.get(REPLICA_KEY)
        .0
        .filter(|v| !v.is_empty())
        .map_or(drawn, |v| String::from_utf8_lossy(&v).into_owned())
}

/// The shared fallback state (default when never written or unreadable).
pub fn read_state(store: &dyn SharedStore) -> (GlobalState, Option<u32>) {
    let (value, cas) = store.get(STATE_KEY);
    (
        value
            .as_deref()
            .and_then(GlobalState::decode)
            .unwrap_or_default(),
        cas,
    )
}

/// Updates the shared state with `f` (CAS; a few attempts); the state now in shared data.
fn update_state(store: &dyn SharedStore, f: impl Fn(GlobalState) -> GlobalState) -> GlobalState {
    let mut last = GlobalState::default();
    for _ in 0..crate::cache::CAS_ATTEMPTS {
        let (cur, cas) = read_state(store);
        let next = f(cur);
        if next == cur {
            return cur;
        }
        last = next;
        if store.set(STATE_KEY, &next.encode(), cas).is_ok() {
            return next;
        }
    }
    last
}

/// What a worker does when its view of the state changes: one log line, the gauge.
fn adopt(host: &dyn Host, leases: &mut Leases, gauge: u32, st: GlobalState) {
    if st.fallback != leases.state.fallback {
        if st.fallback {
            log::warn!(
                "maas: lease service not answering: limits fall back to this replica's local \
                 share, or 503 beyond the leases held where no share is configured"
            );
        } else {
            log::info!("maas: lease service answering again: global limits restored");
        }
        if gauge != 0 {
            host.record_metric(gauge, u64::from(st.fallback));
        }
    }
    leases.state = st;
}

/// A callout failed: this Envoy enters fallback (if not already in it). True when this call
/// made the transition.
pub fn enter_fallback(host: &dyn Host, leases: &mut Leases, gauge: u32, now_ms: u64) -> bool {
    let (before, _) = read_state(host);
    let st = update_state(host, |s| GlobalState {
        fallback: true,
        since_ms: if s.fallback { s.since_ms } else { now_ms },
        replicas: s.replicas,
    });
    adopt(host, leases, gauge, st);
    !before.fallback && st.fallback
}

/// A 200: leave fallback (when `leave`) and remember the number of replicas.
pub fn answered(host: &dyn Host, leases: &mut Leases, gauge: u32, replicas: u32, leave: bool) {
    let replicas = replicas.max(1);
    if leases.state.replicas == replicas && (!leave || !leases.state.fallback) {
        return;
    }
    let st = update_state(host, |s| GlobalState {
        fallback: s.fallback && !leave,
        since_ms: s.since_ms,
        replicas,
    });
    adopt(host, leases, gauge, st);
}

/// Every tick: adopt the shared state (another worker may have entered or left fallback).
pub fn sync(host: &dyn Host, leases: &mut Leases, gauge: u32) {
    let (st, _) = read_state(host);
    adopt(host, leases, gauge, st);
}

/// The grants of a 200 answer for `claims` (same order as the items sent).
pub fn grants_of(claims: &[Claim], resp: &[maas_types::lease::LeaseGrant]) -> Vec<Grant> {
    claims
        .iter()
        .zip(resp)
        .map(|(c, g)| Grant {
            kind: c.kind,
            window: c.window,
            start: c.start,
            granted: g.granted,
            taken: g.taken,
        })
        .collect()
}

/// Builds this tick's batch: claims debts and releases of the tracked subjects (those looked at
/// least recently first), at most [`MAX_BATCH_ITEMS`] items; subjects idle with nothing left to
/// report are dropped. Returns the items and the claims (per subject, same order).
pub fn build_batch(
    host: &dyn Host,
    g: &GlobalConfig,
    leases: &mut Leases,
    now_ms: u64,
) -> (Vec<LeaseItem>, Vec<Claimed>) {
    let now_s = now_ms / 1000;
    let mut order: Vec<(u64, String)> = leases
        .tracked
        .iter()
        .map(|(s, t)| (t.reported_ms, s.clone()))
        .collect();
    order.sort_unstable();
    let mut items = Vec::new();
    let mut claimed = Vec::new();
    for (_, subject) in order {
        if items.len() >= MAX_BATCH_ITEMS {
            break;
        }
        let Some(t) = leases.tracked.get_mut(&subject) else {
            continue;
        };
        let idle = now_ms.saturating_sub(t.last_ms) >= g.idle_release_ms;
        let claims = limits::claim(
            host,
            &t.key,
            &subject,
            &t.counters,
            &mut t.meters,
            now_ms,
            idle,
            g.lease_horizon_ms,
        );
        t.reported_ms = now_ms;
        if claims.is_empty() {
            if idle {
                leases.drop_idle(&subject);
            }
            continue;
        }
        if items.len() + claims.len() > MAX_BATCH_ITEMS {
            // No room left in this batch: the next tick takes it.
            limits::unclaim(host, &t.key, &subject, &claims, now_s);
            break;
        }
        for c in &claims {
            items.push(LeaseItem {
                subject: subject.clone(),
                kind: c.kind.lease_kind(),
                window_seconds: c.window,
                window_start: c.start,
                limit: c.limit,
                need: 0,
                want: c.want,
                debt: c.debt,
                release: c.release,
            });
        }
        claimed.push((subject, t.key.clone(), claims));
    }
    (items, claimed)
}

/// Undoes every claim of a batch the companion refused (400: it will never be applied).
pub fn undo(host: &dyn Host, claims: &[Claimed], now_s: u64) {
    for (subject, key, c) in claims {
        limits::unclaim(host, key, subject, c, now_s);
    }
}

/// The counters of a request's tiers (for [`Leases::track`]).
pub fn counters(tiers: &[&maas_types::Tier]) -> Vec<LeaseCounter> {
    limits::tracked_counters(tiers)
}

/// Seconds to the end of the window of the first item whose limit is reached globally
/// (`taken ≥ limit` and nothing granted), if any.
pub fn exhausted_retry(needs: &[LeaseNeed], resp: &LeaseResponse, now_s: u64) -> Option<u64> {
    needs
        .iter()
        .zip(&resp.grants)
        .filter(|(n, g)| g.granted < n.need && g.taken >= n.limit)
        .map(|(n, _)| {
            n.start
                .saturating_add(n.window)
                .saturating_sub(now_s)
                .max(1)
        })
        .max()
}

/// A lease callout of this worker, for the requests of one subject waiting for it.
#[derive(Debug)]
pub struct Flight {
    pub subject: String,
    /// The subject's counter slot key.
    pub key: String,
    pub needs: Vec<crate::limits::LeaseNeed>,
    /// The context that dispatched it (a request, or the root context).
    pub carrier: u32,
    /// The requests waiting for it (context ids).
    pub members: Vec<u32>,
    /// Its `batchId` and body as sent (re-sent by the outbox when unanswered).
    pub id: String,
    pub body: Vec<u8>,
}

impl Flight {
    /// This flight as a batch of the outbox (its answer never came).
    pub fn orphan(&self) -> Batch {
        Batch {
            id: self.id.clone(),
            body: self.body.clone(),
            claims: vec![(self.subject.clone(), self.key.clone(), asked(&self.needs))],
            token: None,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing, clippy::unwrap_used)]
    use super::*;
    use crate::store::MemStore;

    #[test]
    fn state_roundtrips_and_garbage_reads_as_default() {
        let s = GlobalState {
            fallback: true,
            since_ms: 42,
            replicas: 3,
        };
        assert_eq!(GlobalState::decode(&s.encode()), Some(s));
        assert_eq!(GlobalState::decode(b"xx"), None);
        let store = MemStore::new();
        store.set(STATE_KEY, b"garbage", None).unwrap();
        assert_eq!(read_state(&store).0, GlobalState::default());
    }

    #[test]
    fn short_retry_is_idle_release_plus_report_interval_rounded_up() {
        let g = GlobalConfig {
            idle_release_ms: 3000,
            report_interval_ms: 1000,
            ..GlobalConfig::default()
        };
        assert_eq!(short_retry_s(&g), 4);
        let g = GlobalConfig {
            idle_release_ms: 100,
            report_interval_ms: 150,
            ..GlobalConfig::default()
        };
        assert_eq!(short_retry_s(&g), 1);
    }

    fn in_fallback(replicas: u32) -> GlobalState {
        GlobalState {
            fallback: true,
            since_ms: 1,
            replicas,
        }
    }

    fn with(replicas: Option<u32>, fraction: Option<f64>) -> GlobalConfig {
        GlobalConfig {
            replicas,
            fallback_fraction: fraction,
            ..GlobalConfig::default()
        }
    }

    #[test]
    fn before_any_answer_a_replica_assumes_the_configured_replica_count() {
        // Never answered (a fresh pod during an outage): the state's count is the default 1;
        // before, that made the share the whole limit on every replica.
        let never = read_state(&MemStore::new()).0;
        assert_eq!(never.replicas, 1);
        assert_eq!(
            fallback_share(&with(Some(2), None), &in_fallback(1)),
            Some(0.5)
        );
        assert_eq!(
            fallback_share(&with(Some(4), None), &in_fallback(1)),
            Some(0.25)
        );
    }

    #[test]
    fn an_answer_that_counted_fewer_replicas_than_configured_never_widens_the_share() {
        // After a quiet spell longer than the companion's replica TTL (30 s), the first replica
        // to call is the only one the companion counts: its fresh answer says 1.
        assert_eq!(
            fallback_share(&with(Some(3), None), &in_fallback(1)),
            Some(1.0 / 3.0)
        );
        // An answer that counted more (a rollout's surge, more pods than configured) narrows it.
        assert_eq!(
            fallback_share(&with(Some(2), None), &in_fallback(5)),
            Some(0.2)
        );
    }

    #[test]
    fn without_a_replica_count_or_fraction_there_is_no_share_to_fall_back_on() {
        for answered in [1, 2, 7] {
            assert_eq!(
                fallback_share(&with(None, None), &in_fallback(answered)),
                None
            );
        }
        // An explicit fraction is the operator's choice, whatever the counts.
        assert_eq!(
            fallback_share(&with(None, Some(0.3)), &in_fallback(1)),
            Some(0.3)
        );
        assert_eq!(
            fallback_share(&with(Some(4), Some(0.3)), &in_fallback(9)),
            Some(0.3)
        );
    }

    #[test]
    fn the_policy_uses_a_share_only_in_fallback_mode_while_in_fallback() {
        let cfg = |g: GlobalConfig| {
            let mut c = PluginConfig::parse(br#"{"companion":{"cluster":"c"}}"#).unwrap();
            c.limits.global = g;
            c
        };
        let share = |c: &PluginConfig, st: &GlobalState| policy(c, st).unwrap().fallback_share;
        let two = cfg(with(Some(2), None));
        assert_eq!(
            share(&two, &GlobalState::default()),
            None,
            "not in fallback"
        );
        assert_eq!(share(&two, &in_fallback(1)), Some(0.5));
        let refuse = cfg(GlobalConfig {
            on_unavailable: OnUnavailable::Refuse,
            ..with(Some(2), None)
        });
        assert_eq!(share(&refuse, &in_fallback(1)), None);
        assert_eq!(share(&cfg(with(None, None)), &in_fallback(1)), None);
        let off = cfg(GlobalConfig {
            enabled: false,
            ..with(Some(2), None)
        });
        assert!(policy(&off, &in_fallback(1)).is_none());
    }

    #[test]
    fn the_rule_logged_at_start_warns_only_without_a_share() {
        assert!(fallback_rule(&with(None, None)).0);
        assert!(
            fallback_rule(&with(None, None))
                .1
                .contains("limits.global.replicas")
        );
        assert!(!fallback_rule(&with(Some(2), None)).0);
        assert!(fallback_rule(&with(Some(2), None)).1.contains("÷ 2"));
        assert!(!fallback_rule(&with(None, Some(0.5))).0);
    }

    #[test]
    fn an_answer_must_be_a_200_with_one_grant_per_item() {
        let body = br#"{"replicas":2,"store":"memory","grants":[{"granted":5,"taken":9}]}"#;
        assert_eq!(answer(Some(200), body, 1).unwrap().replicas, 2);
        assert!(answer(Some(200), body, 2).is_none());
        assert!(answer(Some(503), body, 1).is_none());
        assert!(answer(None, body, 1).is_none());
        assert!(answer(Some(200), b"{}", 1).is_none());
    }
}
