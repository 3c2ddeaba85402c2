//! Admission: one request counted in every request window of its tiers and its tokens reserved
//! in every token window — one read and one CAS write of the subject's slot — or refused without
//! counting; and the read-only precheck that refuses what is already certain before the body.

use super::counters::{
    LeaseCounters, all_limits, distinct, has_windows, lease_counters, shadow_limits, windows,
};
use super::grants::{LeaseNeed, LeasePolicy, prefetch};
use super::headers::RateHeaders;
use super::settle::{Reservation, Settled, apply_folded};
use super::slot::{
    self, Edit, InlineStr, Kind, Record, Records, SlotError, SlotRead, current, read_slot, used,
};
use crate::response::{Deny, Refusal};
use crate::store::SharedStore;
use maas_types::{Tier, Window};

/// Reserved when neither the request nor the tier names a max_tokens.
pub(crate) const FALLBACK_RESERVATION: u64 = 256;

/// What a shadow limit would have refused (the request went on).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Shadowed {
    /// The refusal's code: `rate_limit_exceeded` or `tokens_exceed_limit`.
    pub(crate) code: &'static str,
    pub(crate) kind: Kind,
    pub(crate) window: Window,
    pub(crate) tier: String,
}

// `Allowed` is the common case and moves once: boxing it would allocate on every admitted
// request (the allocation budget counts them).
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Admission {
    Allowed {
        reservation: Reservation,
        headers: RateHeaders,
        /// A shadow limit would have refused this request.
        shadowed: Option<Shadowed>,
    },
    /// A window is full: 429, nothing counted.
    Limited {
        kind: Kind,
        /// Seconds to the end of the (latest) blocking window.
        retry_after: u64,
        /// The tier whose limit blocks (the latest blocking window's).
        tier: String,
        headers: RateHeaders,
    },
    /// The reservation exceeds the limit of a token window (or, `kind` cost, a money budget's
    /// whole amount): it can never fit. 400, nothing counted.
    TooLarge {
        kind: Kind,
        requested: u64,
        limit: u64,
        window: Window,
        tier: String,
    },
    /// The counters cannot be updated (slot full of live subjects, unreadable, or persistent
    /// contention): 503, nothing counted.
    Unavailable { reason: &'static str },
    /// Global limits: the replica's lease of a counter is short (the limit is not reached):
    /// nothing counted; ask the companion for `items`, apply the grants, admit again.
    NeedsLease {
        items: Vec<LeaseNeed>,
        /// The first short counter's kind and tier (for a 429 when the lease stays short).
        kind: Kind,
        tier: String,
        headers: RateHeaders,
    },
}

impl Admission {
    /// A short lease split into what to ask for and the 429 to answer if it does not come
    /// (the same admission without its items); any other admission as it is, with nothing to
    /// ask for.
    pub(crate) fn split_lease(self) -> (Option<Vec<LeaseNeed>>, Admission) {
        match self {
            Admission::NeedsLease {
                items,
                kind,
                tier,
                headers,
            } => (
                Some(items),
                Admission::NeedsLease {
                    items: Vec::new(),
                    kind,
                    tier,
                    headers,
                },
            ),
            other => (None, other),
        }
    }

    /// The refusal to answer with; `None` for an allowed request.
    pub(crate) fn into_refusal(self, style: maas_types::RateLimitHeaders) -> Option<Refusal> {
        match self {
            Admission::Allowed { .. } => None,
            Admission::Limited {
                kind,
                retry_after,
                tier,
                headers,
            } => {
                let mut h: Vec<(String, String)> = headers
                    .headers(style)
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v))
                    .collect();
                h.push(("retry-after".to_string(), retry_after.to_string()));
                Some(Refusal::rate_limited(
                    format!(
                        "rate limit reached for {} on {}: retry in {retry_after}s",
                        kind.as_str(),
                        limit_owner(&tier)
                    ),
                    h,
                ))
            }
            Admission::TooLarge {
                kind: Kind::Cost,
                requested,
                limit,
                window,
                tier,
            } => Some(Refusal::new(
                Deny::CostExceedsLimit,
                format!(
                    "this request may cost up to {} (prompt estimate × input price + max_tokens × \
                     output price) but {} allows {} per {window}; lower max_tokens or \
                     shorten the prompt",
                    maas_types::Money(requested),
                    limit_owner(&tier),
                    maas_types::Money(limit)
                ),
            )),
            Admission::TooLarge {
                requested,
                limit,
                window,
                tier,
                ..
            } => Some(Refusal::new(
                Deny::TokensExceedLimit,
                format!(
                    "this request reserves {requested} tokens (prompt estimate, media parts at the \
                     model's mediaTokens each, + max_tokens) but {} allows {limit} per \
                     {window}; lower max_tokens, shorten the prompt or send fewer media parts",
                    limit_owner(&tier)
                ),
            )),
            Admission::Unavailable { reason } => Some(Refusal::new(
                Deny::LimitsUnavailable,
                format!("rate limit counters are unavailable ({reason}); retry shortly"),
            )),
            // A short lease that is not asked for (the caller's choice) refuses like a window
            // that is full for a moment.
            Admission::NeedsLease {
                kind,
                tier,
                headers,
                ..
            } => Admission::Limited {
                kind,
                retry_after: 1,
                tier,
                headers,
            }
            .into_refusal(style),
        }
    }
}

/// Whose limit a refusal names: `scope <name>` for a scope's ([`maas_types::Scope`]), else
/// `tier <name>` (a subscription's is the tier `subscription:<name>`).
fn limit_owner(tier: &str) -> String {
    match tier.strip_prefix("scope:") {
        Some(maas_types::policy::scope::KEY_SCOPE) => "this API key's own limits".to_string(),
        Some(scope) => format!("scope {scope}"),
        None => format!("tier {tier}"),
    }
}

/// Tokens to reserve: the request's cap (`None`: the body has none), else the tier default, else a
/// fallback.
pub(crate) fn reservation_for(max_tokens: Option<u64>, tier: &Tier) -> u64 {
    max_tokens
        .or(tier.default_max_tokens)
        .unwrap_or(FALLBACK_RESERVATION)
        .max(1)
}

fn slot_error(e: SlotError) -> Admission {
    Admission::Unavailable {
        reason: match e {
            SlotError::Unreadable => "unreadable counter slot",
            SlotError::Full => "counter slot full",
            // Persistent contention: refuse rather than count wrong.
            SlotError::Contended => "contention",
        },
    }
}

/// One request to admit.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ask<'a> {
    /// The subject's counter slot ([`super::counter_key`]).
    pub(crate) key: &'a str,
    /// The tier the request runs on first, then the subject's highest tier (repeats are
    /// ignored).
    pub(crate) tiers: &'a [&'a Tier],
    pub(crate) subject: &'a str,
    pub(crate) reserve: u64,
    /// Money reserved in every cost window (nano-units): the worst case at the model's prices.
    pub(crate) reserve_cost: u64,
    /// Unix seconds.
    pub(crate) now: u64,
    /// Settlements of this subject this worker folded and did not write yet
    /// ([`crate::folds`]): applied to the slot as read, and written with the admission.
    pub(crate) settled: &'a [Settled],
}

impl Ask<'_> {
    /// What admitting this request adds to a counter of `kind`.
    fn add(&self, kind: Kind) -> u64 {
        match kind {
            Kind::Requests => 1,
            Kind::Tokens => self.reserve,
            Kind::Cost => self.reserve_cost,
        }
    }

    /// The reservation of this request in the token and cost windows of `counters` (each
    /// window as of now).
    fn reservation(&self, counters: &[(Kind, Window)]) -> Reservation {
        Reservation {
            subject: InlineStr::new(self.subject),
            key: InlineStr::new(self.key),
            reserved: self.reserve,
            reserved_cost: self.reserve_cost,
            windows: counters
                .iter()
                .filter(|(k, _)| *k != Kind::Requests)
                .map(|(k, w)| (*k, w.seconds(), w.start_of(self.now)))
                .collect(),
        }
    }
}

/// Admits one request (`ask`): counts it in every request window and reserves `ask.reserve`
/// tokens in every token window — one read and one CAS write of its slot — or refuses without
/// counting. `read`: the precheck's read of the slot, to start from (read again if the slot
/// changed since). `lease`: global limits (`None` = off), every counter must then fit in this
/// replica's lease too.
pub(crate) fn admit_leased(
    store: &dyn SharedStore,
    ask: &Ask,
    read: Option<SlotRead>,
    lease: Option<&LeasePolicy>,
) -> Admission {
    let tiers = distinct(ask.tiers);
    let counters = windows(&tiers);
    if counters.is_empty() {
        return Admission::Allowed {
            reservation: ask.reservation(&[]),
            headers: RateHeaders::default(),
            shadowed: None,
        };
    }
    if let Some(refusal) = too_large(&tiers, ask) {
        return refusal;
    }
    let shadow_too_large = shadow_too_large(&tiers, ask);
    let leased = lease.map(|_| lease_counters(&tiers)).unwrap_or_default();
    let admitted = slot::update(store, ask.key, ask.subject, ask.now, read, |records| {
        // This worker's folded settlements count as written (and are, with this admission).
        for f in ask.settled {
            apply_folded(records, f, ask.now);
        }
        if let Some(refusal) = limited(&tiers, records, ask.now, |kind| ask.add(kind)) {
            return Edit::Keep(refusal);
        }
        // Global limits: every counter must fit in this replica's lease too.
        if let Some(policy) = lease
            && let Some(refusal) = short_lease(policy, &leased, &tiers, records, ask)
        {
            return Edit::Keep(refusal);
        }
        let shadowed = shadow_too_large
            .clone()
            .or_else(|| shadow_limited(&tiers, records, ask));
        *records = counted(records, &counters, ask);
        Edit::Write(Admission::Allowed {
            reservation: ask.reservation(&counters),
            headers: RateHeaders::from_records(&tiers, records, ask.now),
            shadowed,
        })
    });
    admitted.unwrap_or_else(slot_error)
}

/// Takes back an admission of `ask` that counted (a scope after it refused the request): the
/// request and its reservation leave every window they went into, while that window is the
/// current one — one read and one CAS write of the slot, as admission. Best effort as a
/// settlement: a slot that cannot be written leaves them counted (never fewer than admitted).
pub(crate) fn unadmit(store: &dyn SharedStore, ask: &Ask) {
    let tiers = distinct(ask.tiers);
    let counters = windows(&tiers);
    if counters.is_empty() {
        return;
    }
    let _ = slot::update(store, ask.key, ask.subject, ask.now, None, |records| {
        let mut changed = false;
        for &(kind, window) in &counters {
            let start = window.start_of(ask.now);
            if let Some(r) = records
                .iter_mut()
                .find(|r| r.kind == kind.code() && r.window == window.seconds() && r.start == start)
            {
                r.count = r.count.saturating_sub(ask.add(kind));
                changed = true;
            }
        }
        Edit::write_if(changed, ())
    });
}

/// A reservation above a token window's limit (or a cost above a budget's amount) can never
/// fit: refused without counting (the tightest such window named; tokens first).
fn too_large(tiers: &[&Tier], ask: &Ask) -> Option<Admission> {
    let (kind, l, tier) = [Kind::Tokens, Kind::Cost].into_iter().find_map(|kind| {
        all_limits(tiers)
            .filter(|(k, l, _)| *k == kind && ask.add(kind) > l.limit)
            .min_by_key(|(_, l, _)| l.limit)
    })?;
    Some(Admission::TooLarge {
        kind,
        requested: ask.add(kind),
        limit: l.limit,
        window: l.window,
        tier: tier.to_string(),
    })
}

/// A shadow token limit below the reservation (or shadow budget below its cost): what
/// `too_large` would refuse.
fn shadow_too_large(tiers: &[&Tier], ask: &Ask) -> Option<Shadowed> {
    shadow_limits(tiers)
        .filter(|(k, l, _)| *k != Kind::Requests && ask.add(*k) > l.limit)
        .min_by_key(|(k, l, _)| (*k == Kind::Cost, l.limit))
        .map(|(kind, l, tier)| Shadowed {
            code: if kind == Kind::Cost {
                "cost_exceeds_limit"
            } else {
                "tokens_exceed_limit"
            },
            kind,
            window: l.window,
            tier: tier.to_string(),
        })
}

/// A shadow limit of `tiers` that `records` leave no room in for `ask`: what `limited` would
/// refuse.
fn shadow_limited(tiers: &[&Tier], records: &[Record], ask: &Ask) -> Option<Shadowed> {
    shadow_limits(tiers)
        .find(|(kind, l, _)| {
            used(records, *kind, l.window, ask.now).saturating_add(ask.add(*kind)) > l.limit
        })
        .map(|(kind, l, tier)| Shadowed {
            code: "rate_limit_exceeded",
            kind,
            window: l.window,
            tier: tier.to_string(),
        })
}

/// The 429 of a window of `tiers` that `records` leave no room in for `add(kind)` more (the
/// window that blocks longest named), if any.
fn limited(
    tiers: &[&Tier],
    records: &[Record],
    now: u64,
    add: impl Fn(Kind) -> u64,
) -> Option<Admission> {
    let mut blocked: Option<(Kind, u64, &str)> = None;
    for (kind, l, tier) in all_limits(tiers) {
        if used(records, kind, l.window, now).saturating_add(add(kind)) > l.limit {
            let retry = l.window.seconds_left(now);
            if blocked.is_none_or(|(_, r, _)| retry > r) {
                blocked = Some((kind, retry, tier));
            }
        }
    }
    let (kind, retry_after, tier) = blocked?;
    Some(Admission::Limited {
        kind,
        retry_after,
        tier: tier.to_string(),
        headers: RateHeaders::from_records(tiers, records, now),
    })
}

/// Global limits: the refusal when a counter of `leased` would not fit in this replica's lease
/// after `ask` — [`Admission::NeedsLease`] naming what to ask for, or in fallback a 429 with the
/// policy's short retry — and none when every counter fits.
fn short_lease(
    policy: &LeasePolicy,
    leased: &LeaseCounters,
    tiers: &[&Tier],
    records: &[Record],
    ask: &Ask,
) -> Option<Admission> {
    let now = ask.now;
    let mut items: Vec<LeaseNeed> = Vec::new();
    // The counter the 429 names if the lease stays short: the one nearest its limit across the
    // replicas (what this request and the others' leases hold, per unit of the limit), not the
    // first short one — a busy subject's request lease may run short while it is its budget
    // that is spent, and the refusal must say which.
    let mut nearest: Option<(Kind, &str, u64, u128)> = None;
    for &(kind, window, limit, tier) in leased {
        let rec = current(records, kind, window, now);
        let count = rec.map_or(0, |r| r.count);
        let granted = rec.map_or(0, |r| r.granted);
        let others = rec.map_or(0, |r| r.others);
        let after = count.saturating_add(ask.add(kind));
        if after <= policy.lease(granted, limit, others) {
            continue;
        }
        let start = window.start_of(now);
        let need = after.saturating_sub(granted);
        let since = rec.map_or(0, |r| r.since);
        let since = if since > 0 { since } else { now };
        items.push(LeaseNeed {
            kind,
            window: window.seconds(),
            start,
            limit,
            need,
            want: prefetch(
                after,
                now.saturating_sub(since),
                policy.horizon_ms,
                need,
                limit,
            ),
        });
        let fill = u128::from(after.saturating_add(others)) * 1_000_000 / u128::from(limit.max(1));
        if nearest.is_none_or(|(.., f)| fill > f) {
            nearest = Some((kind, tier, window.seconds_left(now), fill));
        }
    }
    let (kind, tier, left, _) = nearest?;
    let headers = RateHeaders::from_records(tiers, records, now);
    if policy.fallback_share.is_some() {
        return Some(Admission::Limited {
            kind,
            retry_after: policy.short_retry_s.clamp(1, left.max(1)),
            tier: tier.to_string(),
            headers,
        });
    }
    Some(Admission::NeedsLease {
        items,
        kind,
        tier: tier.to_string(),
        headers,
    })
}

/// `records` with `ask` counted in every counter of `counters` (in the window current at its
/// time: a record of an older window starts again, its lease with it); other records kept.
fn counted(records: &[Record], counters: &[(Kind, Window)], ask: &Ask) -> Records {
    let now = ask.now;
    let mut next: Records = records
        .iter()
        .filter(|r| {
            !counters
                .iter()
                .any(|(k, w)| r.kind == k.code() && r.window == w.seconds())
        })
        .copied()
        .collect();
    for &(kind, window) in counters {
        let (granted, others, since) = current(records, kind, window, now)
            .map_or((0, 0, 0), |r| (r.granted, r.others, r.since));
        next.push(Record {
            kind: kind.code(),
            window: window.seconds(),
            start: window.start_of(now),
            count: used(records, kind, window, now).saturating_add(ask.add(kind)),
            granted,
            others,
            since: if since > 0 { since } else { now },
        });
    }
    next
}

/// Refusal that is certain before the body is read: a request window already full, or a token
/// window with no token left, in any of `tiers`, with this worker's folded settlements of the
/// subject (`settled`) counted as written. Read-only (one shared-data read): admission decides
/// for real later, and may start from the slot as read (none when the slot was never written:
/// its first write cannot be a CAS, so it must not start from an old read).
pub(crate) fn precheck_folded(
    store: &dyn SharedStore,
    key: &str,
    tiers: &[&Tier],
    subject: &str,
    now: u64,
    settled: &[Settled],
) -> (Option<Admission>, Option<SlotRead>) {
    if !has_windows(tiers) {
        return (None, None);
    }
    let tiers = distinct(tiers);
    let (value, cas) = store.get(key);
    // An unreadable slot is admission's to refuse.
    let Ok(mut view) = read_slot(value.as_deref(), subject) else {
        return (None, None);
    };
    for f in settled {
        apply_folded(&mut view.mine, f, now);
    }
    let refusal = limited(&tiers, &view.mine, now, |_| 1);
    (refusal, SlotRead::new(key, value, cas))
}
