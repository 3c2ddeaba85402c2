//! Prometheus metrics, served as text on `GET /metrics` of the metrics listener only
//! (`--metrics-addr`): the public listener is reachable through the Gateway without
//! authentication, and the internal one serves the provider credentials.
//!
//! Every label value comes from a fixed set, never from the client: the route is the matched
//! route template (`/v1/api-keys/{id}`, or `unmatched`), the method one of the standard methods
//! or `other`, the status a number the server chose. A client sending random methods or paths
//! cannot create new series.

use axum::extract::{MatchedPath, Request, State};
use axum::http::Method;
use axum::http::header::CONTENT_TYPE;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HttpLabels {
    pub listener: &'static str,
    pub route: String,
    pub method: &'static str,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub listener: &'static str,
    pub route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 0.5 ms … ~8 s.
    Histogram::new(exponential_buckets(0.0005, 2.0, 15))
}

pub struct Metrics {
    registry: Registry,
    pub http_requests: Family<HttpLabels, Counter>,
    pub http_duration: HistogramFamily<RouteLabels>,
    pub keys_minted: Counter,
    pub validations: Family<ResultLabels, Counter>,
    pub validation_duration: HistogramFamily<ResultLabels>,
    pub policy_reloads: Family<ResultLabels, Counter>,
    /// Reference resources (`--policy-source kubernetes`) left out as invalid, by `kind`.
    pub policy_resources_invalid: Family<Vec<(&'static str, String)>, Gauge>,
    pub last_used_rows_written: Counter,
    pub token_cache_hits: Counter,
    /// Connections to the internal listener whose TLS handshake failed: no client certificate,
    /// one from another CA or naming no allowed caller, or not TLS at all.
    pub internal_handshakes_failed: Counter,
    pub leases: LeaseMetrics,
    pub usage: UsageMetrics,
}

/// Labels of the usage series: `tier`, `model`, then `direction` or `reason` where they apply,
/// then `user` only with `--usage-metrics-per-user` (capped: see `crate::usage`).
pub type UsageLabels = Vec<(&'static str, String)>;

/// The chargeback series fed by the gateways' usage reports (`maas_companion_usage_*`), and
/// the ledger's own health.
#[derive(Default)]
pub struct UsageMetrics {
    /// `{tier, model, direction="prompt"|"completion"[, user]}`.
    pub tokens: Family<UsageLabels, Counter>,
    /// Requests forwarded to a model: `{tier, model[, user]}`.
    pub requests: Family<UsageLabels, Counter>,
    /// Requests the gateway refused: `{tier, model, reason[, user]}`.
    pub refused: Family<UsageLabels, Counter>,
    /// Spend (tokens × the model's `billingRate.perToken`, in the rate's currency):
    /// `{tier, model, organization, cost_center}` (`none` outside subscriptions or without
    /// `tokenMetadata`). A float for dashboards; the ledger keeps the exact decimal.
    pub cost: Family<UsageLabels, Counter<f64, std::sync::atomic::AtomicU64>>,
    /// Report batches by result (`applied`, `duplicate`, `invalid`, `unavailable`, `error`).
    pub reports: Family<ResultLabels, Counter>,
    /// Hourly ledger rows rolled up into daily rows.
    pub rolled_up_rows: Counter,
    /// 1 while the last ledger write (report or rollup) reached PostgreSQL, else 0.
    pub database_up: Gauge,
}

impl UsageMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "maas_companion_usage_tokens",
            "Tokens reported by the gateways, by tier, model and direction (prompt, completion)",
            self.tokens.clone(),
        );
        registry.register(
            "maas_companion_usage_requests",
            "Requests forwarded to a model, reported by the gateways, by tier and model",
            self.requests.clone(),
        );
        registry.register(
            "maas_companion_usage_refused",
            "Requests the gateways refused, by tier, model and reason (the refusal's error code)",
            self.refused.clone(),
        );
        registry.register(
            "maas_companion_usage_cost",
            "Spend reported by the gateways (tokens times the model's billingRate.perToken), by tier, model, organization and cost centre",
            self.cost.clone(),
        );
        registry.register(
            "maas_companion_usage_reports",
            "Usage report batches by result (applied, duplicate, invalid, unavailable, error)",
            self.reports.clone(),
        );
        registry.register(
            "maas_companion_usage_rolled_up_rows",
            "Hourly usage rows rolled up into daily rows",
            self.rolled_up_rows.clone(),
        );
        registry.register(
            "maas_companion_database_up",
            "1 while the last usage ledger write (report or rollup) reached PostgreSQL, else 0",
            self.database_up.clone(),
        );
    }
}

/// The budget-lease endpoint's series (`maas_companion_lease_*`, `…_redis_round_trips_total`).
#[derive(Default)]
pub struct LeaseMetrics {
    pub batches: Counter,
    pub items: Counter,
    /// Items whose need could not be met (granted 0 with need > 0).
    pub grants_denied: Counter,
    /// Batches answered 503 because the store could not be reached or failed.
    pub store_errors: Counter,
    /// Every call to Redis (a batch, a readiness ping, a script load).
    pub redis_round_trips: Counter,
    /// 1 while the last contact with the store succeeded, else 0.
    pub store_up: Gauge,
}

impl LeaseMetrics {
    fn register(&self, registry: &mut Registry) {
        let series: [(&str, &str, &Counter); 5] = [
            (
                "maas_companion_lease_batches",
                "Lease batches applied",
                &self.batches,
            ),
            (
                "maas_companion_lease_items",
                "Lease items applied",
                &self.items,
            ),
            (
                "maas_companion_lease_grants_denied",
                "Lease items whose need could not be met",
                &self.grants_denied,
            ),
            (
                "maas_companion_lease_store_errors",
                "Lease batches refused because the store was unreachable or failed",
                &self.store_errors,
            ),
            (
                "maas_companion_redis_round_trips",
                "Calls to Redis (lease batches, readiness pings, script loads)",
                &self.redis_round_trips,
            ),
        ];
        for (name, help, counter) in series {
            registry.register(name, help, counter.clone());
        }
        registry.register(
            "maas_companion_lease_store_up",
            "1 while the lease store answered its last call, else 0",
            self.store_up.clone(),
        );
    }
}

impl Metrics {
    pub fn new() -> Arc<Metrics> {
        let mut registry = Registry::default();
        let http_requests = Family::<HttpLabels, Counter>::default();
        registry.register(
            "maas_http_requests",
            "HTTP requests by listener, route, method and status",
            http_requests.clone(),
        );
        let http_duration: HistogramFamily<RouteLabels> =
            Family::new_with_constructor(latency_histogram);
        registry.register(
            "maas_http_request_duration_seconds",
            "HTTP request latency by listener and route",
            http_duration.clone(),
        );
        let keys_minted = Counter::default();
        registry.register(
            "maas_api_keys_minted",
            "API keys minted",
            keys_minted.clone(),
        );
        let validations = Family::<ResultLabels, Counter>::default();
        registry.register(
            "maas_authenticate",
            "Credential validations for the filter by result",
            validations.clone(),
        );
        let validation_duration: HistogramFamily<ResultLabels> =
            Family::new_with_constructor(latency_histogram);
        registry.register(
            "maas_authenticate_duration_seconds",
            "Credential validation latency by result",
            validation_duration.clone(),
        );
        let policy_resources_invalid = Family::<Vec<(&'static str, String)>, Gauge>::default();
        registry.register(
            "maas_companion_policy_resources_invalid",
            "Reference resources (--policy-source kubernetes) left out of the policy as invalid, by kind",
            policy_resources_invalid.clone(),
        );
        let policy_reloads = Family::<ResultLabels, Counter>::default();
        // Every result exists from the start (at 0): an alert on `rejected` reads a series that
        // is there before the first failure, and a dashboard shows 0, not "no data".
        for result in ["accepted", "rejected", "unreadable"] {
            let _ = policy_reloads.get_or_create(&ResultLabels { result });
        }
        registry.register(
            "maas_policy_reload",
            "Policy file reloads by result (accepted, rejected, unreadable)",
            policy_reloads.clone(),
        );
        let last_used_rows_written = Counter::default();
        registry.register(
            "maas_last_used_rows_written",
            "Rows written by the debounced last_used_at flush",
            last_used_rows_written.clone(),
        );
        let token_cache_hits = Counter::default();
        registry.register(
            "maas_token_cache_hits",
            "Token checks answered from the cache",
            token_cache_hits.clone(),
        );
        let internal_handshakes_failed = Counter::default();
        registry.register(
            "maas_companion_internal_handshakes_failed",
            "Connections to the internal listener refused at the TLS handshake (no valid client certificate)",
            internal_handshakes_failed.clone(),
        );
        let leases = LeaseMetrics::default();
        leases.register(&mut registry);
        let usage = UsageMetrics::default();
        usage.register(&mut registry);
        Arc::new(Metrics {
            registry,
            http_requests,
            http_duration,
            keys_minted,
            validations,
            validation_duration,
            policy_reloads,
            policy_resources_invalid,
            last_used_rows_written,
            token_cache_hits,
            internal_handshakes_failed,
            leases,
            usage,
        })
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }

    pub fn record_validation(&self, result: &'static str, started: Instant) {
        let labels = ResultLabels { result };
        self.validations.get_or_create(&labels).inc();
        self.validation_duration
            .get_or_create(&labels)
            .observe(started.elapsed().as_secs_f64());
    }
}

/// `GET /metrics`.
pub async fn serve(State(metrics): State<Arc<Metrics>>) -> Response {
    (
        [(
            CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        metrics.encode(),
    )
        .into_response()
}

/// The `method` label: a standard method's name, else `other` (methods are client strings).
pub fn method_label(method: &Method) -> &'static str {
    const KNOWN: [(Method, &str); 9] = [
        (Method::GET, "GET"),
        (Method::HEAD, "HEAD"),
        (Method::POST, "POST"),
        (Method::PUT, "PUT"),
        (Method::DELETE, "DELETE"),
        (Method::PATCH, "PATCH"),
        (Method::OPTIONS, "OPTIONS"),
        (Method::CONNECT, "CONNECT"),
        (Method::TRACE, "TRACE"),
    ];
    KNOWN
        .iter()
        .find(|(m, _)| m == method)
        .map_or("other", |(_, label)| label)
}

/// Middleware counting requests and latency by matched route template.
pub async fn track(
    State((metrics, listener)): State<(Arc<Metrics>, &'static str)>,
    req: Request,
    next: Next,
) -> Response {
    let started = Instant::now();
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".to_string());
    let method = method_label(req.method());
    let resp = next.run(req).await;
    metrics
        .http_requests
        .get_or_create(&HttpLabels {
            listener,
            route: route.clone(),
            method,
            status: resp.status().as_u16(),
        })
        .inc();
    metrics
        .http_duration
        .get_or_create(&RouteLabels { listener, route })
        .observe(started.elapsed().as_secs_f64());
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_label_is_a_standard_method_or_other() {
        assert_eq!(method_label(&Method::GET), "GET");
        assert_eq!(method_label(&Method::DELETE), "DELETE");
        assert_eq!(method_label(&Method::TRACE), "TRACE");
        for random in ["XRANDOM", "get", "G3T", "PROPFIND"] {
            let m = Method::from_bytes(random.as_bytes()).unwrap();
            assert_eq!(method_label(&m), "other", "{random}");
        }
    }
}
