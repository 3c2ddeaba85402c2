//! Metric names (Envoy shows them as `envoy_wasmcustom_<name with . → _>` in /stats/prometheus).

use crate::host::{Host, MetricKind};
use crate::response::Decision;
use std::cell::RefCell;

pub fn request_metric(d: Decision) -> String {
    format!("maas_requests_{}", d.as_str())
}

pub const CACHE_HIT: &str = "maas_auth_cache_hit";
pub const CACHE_MISS: &str = "maas_auth_cache_miss";
pub const CALLOUT_LATENCY_MS: &str = "maas_auth_callout_latency_ms";
pub const CALLOUT_FAILED: &str = "maas_auth_callout_failed";
pub const CALLOUTS: &str = "maas_auth_callouts";
pub const POLICY_UPDATES: &str = "maas_policy_updates";
pub const POLICY_REJECTED: &str = "maas_policy_rejected";
pub const MALFORMED_UPSTREAM: &str = "maas_upstream_body_unreadable";
/// Lease callouts (a request's and the worker's batches).
pub const LEASE_CALLOUTS: &str = "maas_lease_callouts_total";
pub const LEASE_FALLBACK_ENTERED: &str = "maas_lease_fallback_entered_total";
/// Gauge: 1 while this replica is in fallback (lease service not answering).
pub const LEASE_FALLBACK: &str = "maas_lease_fallback";
/// Gauge: 1 once a worker found that Envoy does not hand the body of a request whose headers
/// the filter holds (`pauseHeadersForBody` without Envoy's `allow_on_headers_stop_iteration`):
/// that worker's headers go on before the body again.
pub const HEADERS_HOLD_UNSUPPORTED: &str = "maas_headers_hold_unsupported";
/// Usage records a worker dropped (its bound reached, or a report the companion refused).
pub const USAGE_RECORDS_DROPPED: &str = "maas_usage_records_dropped_total";
/// Requests a shadow limit would have refused (they went on).
pub const SHADOW_REFUSALS: &str = "maas_shadow_refusals_total";

/// Keeps a name usable as one Envoy stat segment.
pub fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Token counter for a tier and model: `maas_tokens_<prompt|completion>.tier.<tier>.model.<model>`.
pub fn token_metric(kind: &str, tier: &str, model: &str) -> String {
    format!(
        "maas_tokens_{kind}.tier.{}.model.{}",
        sanitize(tier),
        sanitize(model)
    )
}

/// Metric ids of this VM (names are shared: Envoy aggregates them across VMs), and the counter
/// increments not yet handed to Envoy: flushed every tick, so a request costs no metric host
/// calls (counters lag by at most one tick).
#[derive(Debug, Default)]
pub struct Metrics {
    pub decisions: Vec<u32>,
    pub cache_hit: u32,
    pub cache_miss: u32,
    pub callout_latency: u32,
    pub callout_failed: u32,
    pub callouts: u32,
    pub policy_updates: u32,
    pub policy_rejected: u32,
    pub malformed_upstream: u32,
    pub lease_callouts: u32,
    pub lease_fallback_entered: u32,
    /// Gauge.
    pub lease_fallback: u32,
    /// Usage records dropped (ledger bound, or a batch the companion refused).
    pub usage_dropped: u32,
    /// Gauge: Envoy does not hand a held request's body over (see [`HeldHeaders`]).
    pub hold_unsupported: u32,
    /// Would-be refusals of shadow limits.
    pub shadow_refusals: u32,
    /// (tier, model, prompt id, completion id), defined on first use.
    tokens: Vec<(String, String, u32, u32)>,
    pending: RefCell<Vec<(u32, u64)>>,
}

impl Metrics {
    pub fn define_all(host: &dyn Host) -> Self {
        let c = |name: &str| host.define_metric(MetricKind::Counter, name);
        Metrics {
            decisions: Decision::ALL
                .iter()
                .map(|d| c(&request_metric(*d)))
                .collect(),
            cache_hit: c(CACHE_HIT),
            cache_miss: c(CACHE_MISS),
            callout_latency: host.define_metric(MetricKind::Histogram, CALLOUT_LATENCY_MS),
            callout_failed: c(CALLOUT_FAILED),
            callouts: c(CALLOUTS),
            policy_updates: c(POLICY_UPDATES),
            policy_rejected: c(POLICY_REJECTED),
            malformed_upstream: c(MALFORMED_UPSTREAM),
            lease_callouts: c(LEASE_CALLOUTS),
            lease_fallback_entered: c(LEASE_FALLBACK_ENTERED),
            lease_fallback: host.define_metric(MetricKind::Gauge, LEASE_FALLBACK),
            usage_dropped: c(USAGE_RECORDS_DROPPED),
            hold_unsupported: host.define_metric(MetricKind::Gauge, HEADERS_HOLD_UNSUPPORTED),
            shadow_refusals: c(SHADOW_REFUSALS),
            tokens: Vec::new(),
            pending: RefCell::new(Vec::new()),
        }
    }

    /// Counts `by` on metric `id` (handed to the host at the next flush).
    pub fn inc(&self, id: u32, by: u64) {
        if id == 0 || by == 0 {
            return;
        }
        if let Ok(mut p) = self.pending.try_borrow_mut() {
            match p.iter_mut().find(|(i, _)| *i == id) {
                Some((_, n)) => *n = n.saturating_add(by),
                None => p.push((id, by)),
            }
        }
    }

    pub fn decision(&self, d: Decision) {
        if let Some(id) = self.decisions.get(d.index()) {
            self.inc(*id, 1);
        }
    }

    pub fn flush(&self, host: &dyn Host) {
        if let Ok(mut p) = self.pending.try_borrow_mut() {
            for (id, n) in p.iter_mut() {
                if *n > 0 {
                    host.increment_metric(*id, i64::try_from(*n).unwrap_or(i64::MAX));
                    *n = 0;
                }
            }
        }
    }

    pub fn tokens(
        &mut self,
        host: &dyn Host,
        tier: &str,
        model: &str,
        prompt: u64,
        completion: u64,
    ) {
        let found = self
            .tokens
            .iter()
            .find(|(t, m, _, _)| t == tier && m == model)
            .map(|(_, _, p, c)| (*p, *c));
        let (p, c) = match found {
            Some(ids) => ids,
            None => {
                let p =
                    host.define_metric(MetricKind::Counter, &token_metric("prompt", tier, model));
                let c = host.define_metric(
                    MetricKind::Counter,
                    &token_metric("completion", tier, model),
                );
                self.tokens
                    .push((tier.to_string(), model.to_string(), p, c));
                (p, c)
            }
        };
        self.inc(p, prompt);
        self.inc(c, completion);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(
            request_metric(Decision::RateLimited),
            "maas_requests_rate_limited"
        );
        assert_eq!(
            token_metric("prompt", "free", "llama/3.1 8b"),
            "maas_tokens_prompt.tier.free.model.llama_3_1_8b"
        );
    }
}
