//! The filter's metrics. Envoy keeps wasm metrics in its `wasmcustom` namespace and its
//! Prometheus output (`/stats/prometheus`) prints them without a prefix. Labels travel in the
//! name, Istio's way: `tier=.=free;.;model=.=llama;.;maas_tokens_total` is the series
//! `maas_tokens_total{tier="free",model="llama"}` once Envoy's tag extraction knows the label
//! names ([`LABELS`]: the local stack's bootstrap `stats_tags`, the Gateway's `extraStatTags`).
//! No label name is a suffix of another, so Istio's unanchored `(<name>=\.=(.*?);\.;)` rules
//! never take one label for another.
//!
//! Cardinality is bounded: label values are policy names (models, tiers, subscriptions), the
//! fixed decisions, refusal codes and operations, and at most [`MAX_SERIES`] labelled series per
//! VM (after that, new series count under `model="other"`, `tier="other"`, `subscription="other"`).

use crate::host::{Host, MetricKind};
use crate::response::Decision;
use std::cell::RefCell;

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
/// Histogram values dropped because more than [`MAX_PENDING_RECORDS`] waited for one tick.
pub const RECORDS_DROPPED: &str = "maas_metric_records_dropped_total";

/// Every label name the filter's series carry: Envoy's tag extraction must know each (the
/// local bootstrap's `stats_tags` and the Gateway's `extraStatTags` list them; the manifest
/// checks read this list from here).
#[cfg(test)]
pub const LABELS: [&str; 7] = [
    "decision",
    "code",
    "model",
    "tier",
    "subscription",
    "token_type",
    "operation",
];

/// Labelled series per VM before new ones are counted as `other`.
pub const MAX_SERIES: usize = 512;
/// Histogram values kept between two ticks (a tick hands them over).
pub const MAX_PENDING_RECORDS: usize = 4096;

/// A labelled metric family: its name, kind and label names (values given in this order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Family {
    pub name: &'static str,
    pub kind: MetricKind,
    pub labels: &'static [&'static str],
}

/// Requests by decision (`allowed`, `rate_limited`, …), refusal code (`ok` when allowed) and model
/// (`none` before one is known).
pub const REQUESTS: Family = Family {
    name: "maas_requests_total",
    kind: MetricKind::Counter,
    labels: &["decision", "code", "model"],
};
/// Tokens as the response reported them, by type (`input`, `output`, `cached`), tier,
/// subscription (`none` for tier callers) and model.
pub const TOKENS: Family = Family {
    name: "maas_tokens_total",
    kind: MetricKind::Counter,
    labels: &["token_type", "tier", "subscription", "model"],
};
/// OpenTelemetry's `gen_ai.client.token.usage`: tokens per request by type (`input`, `output`).
pub const GEN_AI_TOKEN_USAGE: Family = Family {
    name: "gen_ai_client_token_usage",
    kind: MetricKind::Histogram,
    labels: &["token_type", "operation", "model"],
};
/// OpenTelemetry's `gen_ai.server.request.duration`, in milliseconds (Envoy's histograms take
/// integers): from the request's admission to the end of its response.
pub const GEN_AI_REQUEST_DURATION: Family = Family {
    name: "gen_ai_server_request_duration_ms",
    kind: MetricKind::Histogram,
    labels: &["operation", "model"],
};
/// OpenTelemetry's `gen_ai.server.time_to_first_token`, in milliseconds: from admission to the
/// first body bytes of a streamed (SSE) answer.
pub const GEN_AI_TIME_TO_FIRST_TOKEN: Family = Family {
    name: "gen_ai_server_time_to_first_token_ms",
    kind: MetricKind::Histogram,
    labels: &["operation", "model"],
};

/// A label value as one name segment: ASCII letters, digits, `-` and `_` (anything else `_`),
/// at most 64 characters; empty is `none`.
pub fn label_value(s: &str) -> String {
    if s.is_empty() {
        return "none".into();
    }
    s.chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The metric name that carries `values` as the family's labels (see the module doc).
pub fn series_name(family: &Family, values: &[&str]) -> String {
    let mut name = String::new();
    for (label, value) in family.labels.iter().zip(values) {
        name.push_str(label);
        name.push_str("=.=");
        name.push_str(&label_value(value));
        name.push_str(";.;");
    }
    name.push_str(family.name);
    name
}

/// Splits an Envoy stat name made by [`series_name`] (after `wasmcustom.`, as `/stats` prints it)
/// into the family name and its labels.
#[cfg(test)]
pub fn parse_series(stat: &str) -> (String, Vec<(String, String)>) {
    let mut rest = stat.strip_prefix("wasmcustom.").unwrap_or(stat);
    let mut labels = Vec::new();
    while let Some((pair, tail)) = rest.split_once(";.;") {
        let Some((k, v)) = pair.split_once("=.=") else {
            break;
        };
        labels.push((k.to_string(), v.to_string()));
        rest = tail;
    }
    (rest.to_string(), labels)
}

/// One labelled series of this VM: its family, the label values as given (compared without
/// allocating on every request) and its metric id.
#[derive(Debug)]
struct Series {
    family: &'static str,
    values: Vec<Box<str>>,
    id: u32,
}

/// Metric ids of this VM (names are shared: Envoy aggregates them across VMs), and what is not
/// handed to Envoy yet: counter increments and histogram values, handed over every tick, so a
/// request makes no metric host call (except defining a series the first time this VM sees it).
#[derive(Debug, Default)]
pub struct Metrics {
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
    pub records_dropped: u32,
    series: RefCell<Vec<Series>>,
    pending: RefCell<Vec<(u32, u64)>>,
    pending_records: RefCell<Vec<(u32, u64)>>,
    /// The token series of the last settled request's (tier, model, operation): most requests
    /// settle like the one before, and then make no series lookup at all.
    last_tokens: RefCell<Option<TokenSeries>>,
}

/// The five token series of one (tier, model, operation): `maas_tokens_total` input, output,
/// cached, then `gen_ai_client_token_usage` input, output; 0 = not looked up yet (a series is
/// only defined once it has something to count, as without the memo).
#[derive(Debug)]
struct TokenSeries {
    tier: Box<str>,
    model: Box<str>,
    operation: &'static str,
    ids: [u32; 5],
}

/// What a settled request reports to the token metrics.
#[derive(Debug, Clone, Copy)]
pub struct TokenReport<'a> {
    /// The tier the request ran on (`subscription:<S>` for a subscription's stand-in tier).
    pub tier: &'a str,
    pub model: &'a str,
    pub operation: &'static str,
    pub input: u64,
    pub output: u64,
    pub cached: u64,
}

impl Metrics {
    pub fn define_all(host: &dyn Host) -> Self {
        let c = |name: &str| host.define_metric(MetricKind::Counter, name);
        Metrics {
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
            records_dropped: c(RECORDS_DROPPED),
            series: RefCell::new(Vec::new()),
            pending: RefCell::new(Vec::new()),
            // Grows to what one tick holds at the busiest, then keeps its capacity.
            pending_records: RefCell::new(Vec::with_capacity(256)),
            last_tokens: RefCell::new(None),
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

    /// The id of `family`'s series with these label values, defined the first time (0 when the
    /// host refused it, or the worker is busy: then nothing is counted).
    fn series_id(&self, host: &dyn Host, family: &Family, values: &[&str]) -> u32 {
        let Ok(mut series) = self.series.try_borrow_mut() else {
            return 0;
        };
        let find = |series: &[Series], values: &[&str]| {
            series
                .iter()
                .find(|s| {
                    s.family == family.name
                        && s.values.len() == values.len()
                        && s.values.iter().zip(values).all(|(a, b)| **a == **b)
                })
                .map(|s| s.id)
        };
        if let Some(id) = find(&series, values) {
            return id;
        }
        // Past the bound, a new series of policy names counts under `other`.
        let capped: Vec<&str>;
        let values = if series.len() >= MAX_SERIES {
            capped = family
                .labels
                .iter()
                .zip(values)
                .map(|(label, v)| match *label {
                    "model" | "tier" | "subscription" => "other",
                    _ => v,
                })
                .collect();
            if let Some(id) = find(&series, &capped) {
                return id;
            }
            capped.as_slice()
        } else {
            values
        };
        let id = host.define_metric(family.kind, &series_name(family, values));
        series.push(Series {
            family: family.name,
            values: values.iter().map(|v| Box::from(*v)).collect(),
            id,
        });
        id
    }

    /// Counts `by` on a counter family's series.
    pub fn count(&self, host: &dyn Host, family: &Family, values: &[&str], by: u64) {
        if by > 0 {
            let id = self.series_id(host, family, values);
            self.inc(id, by);
        }
    }

    /// Records `value` in a histogram family's series (handed over at the next flush).
    pub fn record(&self, host: &dyn Host, family: &Family, values: &[&str], value: u64) {
        let id = self.series_id(host, family, values);
        self.record_id(id, value);
    }

    /// Records `value` in series `id` (0: nothing).
    fn record_id(&self, id: u32, value: u64) {
        if id == 0 {
            return;
        }
        let full = match self.pending_records.try_borrow_mut() {
            Ok(mut p) if p.len() < MAX_PENDING_RECORDS => {
                p.push((id, value));
                false
            }
            Ok(_) => true,
            Err(_) => false,
        };
        if full {
            self.inc(self.records_dropped, 1);
        }
    }

    /// One request's decision.
    pub fn decision(&self, host: &dyn Host, d: Decision, code: &str, model: &str) {
        self.count(host, &REQUESTS, &[d.as_str(), code, model], 1);
    }

    /// A settled request's tokens: the counters by tier/subscription and OpenTelemetry's
    /// per-request token usage histogram.
    pub fn tokens(&self, host: &dyn Host, r: &TokenReport<'_>) {
        let (tier, subscription) = match r.tier.strip_prefix("subscription:") {
            Some(s) => ("none", s),
            None => (r.tier, "none"),
        };
        let Ok(mut memo) = self.last_tokens.try_borrow_mut() else {
            return;
        };
        let same = memo.as_ref().is_some_and(|m| {
            *m.tier == *r.tier && *m.model == *r.model && m.operation == r.operation
        });
        if !same {
            *memo = Some(TokenSeries {
                tier: r.tier.into(),
                model: r.model.into(),
                operation: r.operation,
                ids: [0; 5],
            });
        }
        let Some(memo) = memo.as_mut() else {
            return;
        };
        let counted = [
            ("input", r.input),
            ("output", r.output),
            ("cached", r.cached),
        ];
        for ((kind, n), id) in counted.into_iter().zip(memo.ids.iter_mut()) {
            if n > 0 {
                if *id == 0 {
                    *id = self.series_id(host, &TOKENS, &[kind, tier, subscription, r.model]);
                }
                self.inc(*id, n);
            }
        }
        let recorded = [("input", r.input), ("output", r.output)];
        for ((kind, n), id) in recorded.into_iter().zip(memo.ids.iter_mut().skip(3)) {
            if *id == 0 {
                *id = self.series_id(host, &GEN_AI_TOKEN_USAGE, &[kind, r.operation, r.model]);
            }
            self.record_id(*id, n);
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
        if let Ok(mut p) = self.pending_records.try_borrow_mut() {
            for (id, value) in p.drain(..) {
                host.record_metric(id, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::recording::RecordingHost;

    #[test]
    fn a_series_name_carries_its_labels_as_envoy_extracts_them() {
        let name = series_name(
            &REQUESTS,
            &["rate_limited", "tokens_exceed_limit", "llama/3.1 8b"],
        );
        assert_eq!(
            name,
            "decision=.=rate_limited;.;code=.=tokens_exceed_limit;.;model=.=llama_3_1_8b;.;maas_requests_total"
        );
        let (family, labels) = parse_series(&format!("wasmcustom.{name}"));
        assert_eq!(family, "maas_requests_total");
        assert_eq!(labels.len(), 3);
        assert_eq!(
            labels.get(2).map(|(k, v)| (k.as_str(), v.as_str())),
            Some(("model", "llama_3_1_8b"))
        );
        // A value can never hold the separators (nor an empty value).
        assert_eq!(label_value("a=.=b;.;c"), "a___b___c");
        assert_eq!(label_value(""), "none");
        assert_eq!(label_value(&"x".repeat(100)).len(), 64);
    }

    #[test]
    fn no_label_name_is_a_suffix_of_another() {
        // Istio's extraStatTags rules are unanchored: `model=\.=` would also match inside
        // `request_model=.=`. Every family's labels are listed in LABELS too.
        for a in LABELS {
            for b in LABELS {
                assert!(a == b || !b.ends_with(a), "{a} is a suffix of {b}");
            }
        }
        for f in [
            REQUESTS,
            TOKENS,
            GEN_AI_TOKEN_USAGE,
            GEN_AI_REQUEST_DURATION,
            GEN_AI_TIME_TO_FIRST_TOKEN,
        ] {
            for l in f.labels {
                assert!(LABELS.contains(l), "{l} of {} not in LABELS", f.name);
            }
        }
    }

    #[test]
    fn a_series_is_defined_once_and_counted_at_the_flush() {
        let host = RecordingHost::new();
        let m = Metrics::define_all(&host);
        let defined = host.metric_names.borrow().len();
        for _ in 0..3 {
            m.decision(&host, Decision::Allowed, "ok", "sim");
        }
        m.decision(&host, Decision::RateLimited, "rate_limit_exceeded", "sim");
        assert_eq!(host.metric_names.borrow().len(), defined + 2);
        let allowed = series_name(&REQUESTS, &["allowed", "ok", "sim"]);
        assert_eq!(host.metric(&allowed), 0, "counted only at the flush");
        m.flush(&host);
        assert_eq!(host.metric(&allowed), 3);
    }

    /// The memo of the last (tier, model, operation): the same series counted again, another
    /// model's counted apart, a count that was zero defined once it is not.
    #[test]
    fn repeated_settlements_count_on_the_remembered_series() {
        let host = RecordingHost::new();
        let m = Metrics::define_all(&host);
        let report = |model, cached| TokenReport {
            tier: "free",
            model,
            operation: "chat",
            input: 3,
            output: 2,
            cached,
        };
        m.tokens(&host, &report("sim", 0));
        m.tokens(&host, &report("other-model", 0));
        m.tokens(&host, &report("sim", 0));
        m.tokens(&host, &report("sim", 1));
        m.flush(&host);
        let series = |kind, model| series_name(&TOKENS, &[kind, "free", "none", model]);
        assert_eq!(host.metric(&series("input", "sim")), 9);
        assert_eq!(host.metric(&series("output", "sim")), 6);
        assert_eq!(host.metric(&series("cached", "sim")), 1);
        assert_eq!(host.metric(&series("input", "other-model")), 3);
        assert!(
            !host
                .metric_names
                .borrow()
                .contains(&series("cached", "other-model"))
        );
        assert_eq!(host.recorded.borrow().len(), 8);
    }

    #[test]
    fn tokens_count_by_type_and_split_a_subscription_from_its_tier() {
        let host = RecordingHost::new();
        let m = Metrics::define_all(&host);
        let report = TokenReport {
            tier: "subscription:team-a",
            model: "sim",
            operation: "chat",
            input: 7,
            output: 5,
            cached: 0,
        };
        m.tokens(&host, &report);
        m.flush(&host);
        let input = series_name(&TOKENS, &["input", "none", "team-a", "sim"]);
        assert_eq!(host.metric(&input), 7);
        let output = series_name(&TOKENS, &["output", "none", "team-a", "sim"]);
        assert_eq!(host.metric(&output), 5);
        // A zero count defines nothing.
        let cached = series_name(&TOKENS, &["cached", "none", "team-a", "sim"]);
        assert!(!host.metric_names.borrow().contains(&cached));
        let recorded: Vec<u64> = host.recorded.borrow().iter().map(|(_, v)| *v).collect();
        assert_eq!(recorded, vec![7, 5]);
    }

    #[test]
    fn series_past_the_bound_count_as_other() {
        let host = RecordingHost::new();
        let m = Metrics::define_all(&host);
        for i in 0..MAX_SERIES {
            m.decision(&host, Decision::Allowed, "ok", &format!("m{i}"));
        }
        m.decision(&host, Decision::Allowed, "ok", "one-more");
        m.decision(&host, Decision::Allowed, "ok", "and-another");
        m.flush(&host);
        assert_eq!(
            host.metric(&series_name(&REQUESTS, &["allowed", "ok", "other"])),
            2
        );
        assert!(
            !host
                .metric_names
                .borrow()
                .iter()
                .any(|n| n.contains("one-more"))
        );
    }

    #[test]
    fn histogram_values_wait_for_the_tick_within_a_bound() {
        let host = RecordingHost::new();
        let m = Metrics::define_all(&host);
        for v in 0..(MAX_PENDING_RECORDS as u64 + 3) {
            m.record(&host, &GEN_AI_REQUEST_DURATION, &["chat", "sim"], v);
        }
        assert!(host.recorded.borrow().is_empty());
        m.flush(&host);
        assert_eq!(host.recorded.borrow().len(), MAX_PENDING_RECORDS);
        assert_eq!(host.metric(RECORDS_DROPPED), 3);
        m.flush(&host);
        assert_eq!(host.recorded.borrow().len(), MAX_PENDING_RECORDS);
    }
}
