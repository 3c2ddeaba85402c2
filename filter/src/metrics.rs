//! Metric names (Envoy shows them as `envoy_wasmcustom_<name with . → _>` in /stats/prometheus).

use crate::response::Decision;

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
