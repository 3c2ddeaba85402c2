//! The `x-ratelimit-*` headers: the tightest request and token windows after a decision,
//! formatted as OpenAI sends them; and the early warning `x-maas-quota-warning` when a window
//! is past one of its tier's `warnAt` thresholds.

use super::counters::all_limits;
use super::slot::{Kind, Record, used_globally};
use maas_types::{RateLimitHeaders, Tier, Window};

/// The early warning's header.
pub(crate) const QUOTA_WARNING_HEADER: &str = "x-maas-quota-warning";

/// The fullest window past a threshold of its tier after a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Warning {
    /// The highest threshold (percent) the window is past.
    pub(crate) threshold: u8,
    /// Percent of the limit used (this request's count or reservation included), at most 100.
    pub(crate) percent: u64,
    pub(crate) kind: Kind,
    pub(crate) window: Window,
    pub(crate) reset_seconds: u64,
}

impl Warning {
    /// `threshold=80, used=85, kind=tokens, window=1d, reset=3600` (seconds).
    pub(crate) fn value(&self) -> String {
        format!(
            "threshold={}, used={}, kind={}, window={}, reset={}",
            self.threshold,
            self.percent,
            self.kind.as_str(),
            self.window,
            self.reset_seconds
        )
    }
}

/// Percent of `limit` that `used` is (a zero limit: 100), at most 100.
fn percent(used: u64, limit: u64) -> u64 {
    if limit == 0 {
        return 100;
    }
    (u128::from(used) * 100 / u128::from(limit)).min(100) as u64
}

/// State of one window after a decision, for the `x-ratelimit-*` headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WindowState {
    pub(crate) limit: u64,
    pub(crate) used: u64,
    pub(crate) reset_seconds: u64,
    /// The window's length (the IETF `RateLimit-Policy`'s `w`).
    pub(crate) window_seconds: u64,
}

impl WindowState {
    pub(crate) fn remaining(&self) -> u64 {
        self.limit.saturating_sub(self.used)
    }
}

/// The tightest request and token windows (least remaining), when the tiers have such limits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateHeaders {
    pub(crate) requests: Option<WindowState>,
    pub(crate) tokens: Option<WindowState>,
    /// The tightest money budget (nano-units), when one applies.
    pub(crate) cost: Option<WindowState>,
    /// The fullest window past a `warnAt` threshold of its tier, if any.
    pub(crate) warning: Option<Warning>,
}

impl RateHeaders {
    fn note(slot: &mut Option<WindowState>, w: WindowState) {
        match slot {
            Some(cur) if cur.remaining() <= w.remaining() => {}
            _ => *slot = Some(w),
        }
    }

    /// These headers and `other`'s (another set of counters the same request counted in: a
    /// scope's): the tightest window of each kind, the fullest warning.
    pub(crate) fn merged(mut self, other: &RateHeaders) -> Self {
        for (slot, w) in [
            (&mut self.requests, other.requests),
            (&mut self.tokens, other.tokens),
            (&mut self.cost, other.cost),
        ] {
            if let Some(w) = w {
                Self::note(slot, w);
            }
        }
        if let Some(w) = other.warning
            && self.warning.is_none_or(|cur| w.percent > cur.percent)
        {
            self.warning = Some(w);
        }
        self
    }

    pub(super) fn from_records(tiers: &[&Tier], records: &[Record], now: u64) -> Self {
        let mut h = RateHeaders::default();
        // Tier by tier: each limit's warning thresholds are its own tier's (no lookup by name).
        for tier in tiers {
            for (kind, l, _) in all_limits(std::slice::from_ref(tier)) {
                let w = WindowState {
                    limit: l.limit,
                    used: used_globally(records, kind, l.window, now),
                    reset_seconds: l.window.seconds_left(now),
                    window_seconds: l.window.seconds(),
                };
                match kind {
                    Kind::Requests => Self::note(&mut h.requests, w),
                    Kind::Tokens => Self::note(&mut h.tokens, w),
                    Kind::Cost => Self::note(&mut h.cost, w),
                }
                let pct = percent(w.used, w.limit);
                if let Some(&threshold) = tier.warn_at.iter().rev().find(|t| u64::from(**t) <= pct)
                    && h.warning.is_none_or(|cur| pct > cur.percent)
                {
                    h.warning = Some(Warning {
                        threshold,
                        percent: pct,
                        kind,
                        window: l.window,
                        reset_seconds: w.reset_seconds,
                    });
                }
            }
        }
        h
    }

    /// The rate-limit headers in `style`, each handed to `f`: OpenAI's six `x-ratelimit-*`
    /// (formatted on the stack: per request on every response, nothing allocated), the IETF
    /// `RateLimit` / `RateLimit-Policy` pair, or none; and the warning past a threshold.
    pub(crate) fn each(&self, style: RateLimitHeaders, mut f: impl FnMut(&'static str, &str)) {
        match style {
            RateLimitHeaders::Openai => {
                let [limit, remaining, reset] = REQUEST_RATE_HEADERS;
                if let Some(r) = self.requests {
                    f(limit, Short::decimal(r.limit).as_str());
                    f(remaining, Short::decimal(r.remaining()).as_str());
                    f(reset, Short::duration(r.reset_seconds).as_str());
                }
                let [limit, remaining, reset] = TOKEN_RATE_HEADERS;
                if let Some(t) = self.tokens {
                    f(limit, Short::decimal(t.limit).as_str());
                    f(remaining, Short::decimal(t.remaining()).as_str());
                    f(reset, Short::duration(t.reset_seconds).as_str());
                }
                // Money beside tokens, in the currency's units (only with a budget).
                let [limit, remaining, reset] = COST_RATE_HEADERS;
                if let Some(c) = self.cost {
                    f(limit, &maas_types::Money(c.limit).to_string());
                    f(remaining, &maas_types::Money(c.remaining()).to_string());
                    f(reset, Short::duration(c.reset_seconds).as_str());
                }
            }
            RateLimitHeaders::Ietf => {
                if let Some((policy, state)) = self.ietf() {
                    f(IETF_POLICY_HEADER, &policy);
                    f(IETF_STATE_HEADER, &state);
                }
            }
            RateLimitHeaders::None => {}
        }
        // Formatted only past a threshold (rare: most answers send no warning).
        if let Some(w) = self.warning {
            f(QUOTA_WARNING_HEADER, &w.value());
        }
    }

    /// `RateLimit-Policy` and `RateLimit` (structured-field lists, one member per window kind:
    /// `"requests";q=30;w=60` and `"requests";r=29;t=58`), when a window applies.
    fn ietf(&self) -> Option<(String, String)> {
        let windows = [("requests", self.requests), ("tokens", self.tokens)];
        let present = || windows.iter().filter_map(|(n, w)| w.map(|w| (*n, w)));
        // No window: no header.
        present().next()?;
        let join = |item: &dyn Fn(&str, WindowState) -> String| {
            present()
                .map(|(n, w)| item(n, w))
                .collect::<Vec<_>>()
                .join(", ")
        };
        Some((
            join(&|n, w| format!("\"{n}\";q={};w={}", w.limit, w.window_seconds)),
            join(&|n, w| format!("\"{n}\";r={};t={}", w.remaining(), w.reset_seconds)),
        ))
    }

    /// Whether [`Self::each`] in `style` hands over a header `name` (any case).
    pub(crate) fn sends(&self, style: RateLimitHeaders, name: &str) -> bool {
        let among = |names: &[&str]| names.iter().any(|n| n.eq_ignore_ascii_case(name));
        let windows = self.requests.is_some() || self.tokens.is_some();
        let limits = match style {
            RateLimitHeaders::Openai => {
                (self.requests.is_some() && among(&REQUEST_RATE_HEADERS))
                    || (self.tokens.is_some() && among(&TOKEN_RATE_HEADERS))
                    || (self.cost.is_some() && among(&COST_RATE_HEADERS))
            }
            RateLimitHeaders::Ietf => windows && among(&[IETF_POLICY_HEADER, IETF_STATE_HEADER]),
            RateLimitHeaders::None => false,
        };
        limits || (self.warning.is_some() && name.eq_ignore_ascii_case(QUOTA_WARNING_HEADER))
    }

    /// [`Self::each`] as owned pairs (a refusal's headers).
    pub(crate) fn headers(&self, style: RateLimitHeaders) -> Vec<(&'static str, String)> {
        let mut out = Vec::with_capacity(10);
        self.each(style, |name, value| out.push((name, value.to_string())));
        out
    }
}

/// The IETF pair (draft-ietf-httpapi-ratelimit-headers): the quota policies and the state.
pub(crate) const IETF_POLICY_HEADER: &str = "ratelimit-policy";
pub(crate) const IETF_STATE_HEADER: &str = "ratelimit";

/// The `x-ratelimit-*` names of request windows and of token windows (limit, remaining, reset).
const REQUEST_RATE_HEADERS: [&str; 3] = [
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
];
const TOKEN_RATE_HEADERS: [&str; 3] = [
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
];
/// Money budgets (ours, in the style of OpenAI's): amounts as decimals of the currency.
const COST_RATE_HEADERS: [&str; 3] = [
    "x-ratelimit-limit-cost",
    "x-ratelimit-remaining-cost",
    "x-ratelimit-reset-cost",
];

/// A short ASCII text on the stack: a number or a duration (without the formatting machinery,
/// which is slow inside the VM, and without allocating). Holds the longest duration of a u64.
pub(super) struct Short(arrayvec::ArrayString<32>);

impl Short {
    fn new() -> Self {
        Short(arrayvec::ArrayString::new())
    }

    /// `b` is ASCII (digits and unit letters); past 32 bytes nothing more is added.
    fn push(&mut self, b: u8) {
        let _ = self.0.try_push(char::from(b));
    }

    /// Appends `n` in decimal.
    fn push_decimal(&mut self, n: u64) {
        let mut digits = [0u8; 20];
        let mut at = digits.len();
        let mut n = n;
        loop {
            at -= 1;
            if let Some(d) = digits.get_mut(at) {
                *d = b'0' + (n % 10) as u8;
            }
            n /= 10;
            if n == 0 || at == 0 {
                break;
            }
        }
        for &d in digits.get(at..).unwrap_or_default() {
            self.push(d);
        }
    }

    pub(super) fn decimal(n: u64) -> Self {
        let mut out = Short::new();
        out.push_decimal(n);
        out
    }

    /// OpenAI-style duration: `59s`, `6m0s`, `1h2m3s`.
    pub(super) fn duration(seconds: u64) -> Self {
        let (h, m, s) = (seconds / 3600, (seconds % 3600) / 60, seconds % 60);
        let mut out = Short::new();
        if h > 0 {
            out.push_decimal(h);
            out.push(b'h');
        }
        if h > 0 || m > 0 {
            out.push_decimal(m);
            out.push(b'm');
        }
        out.push_decimal(s);
        out.push(b's');
        out
    }

    pub(super) fn as_str(&self) -> &str {
        self.0.as_str()
    }
}
