//! Envoy bootstrap for the local stack, generated from the policy.
//!
//! One listener (the gateway) with the maas-filter wasm filter and the router. Routes:
//! `/maas-api/internal…` → direct 404 (the internal API is never routed), `/maas-api/…` → the
//! companion's public listener (prefix rewritten to `/`), each model's path prefix → a cluster
//! for its `backend` (prefix rewritten to `/`, or to the backend URL's path), anything else →
//! an OpenAI-style 404. A model's `upstreamCluster` is the name of its cluster (the filter
//! checks Envoy's `xds.cluster_name` against it before injecting a provider credential). The same config can be rendered without the filter (bare Envoy, for
//! benchmarks).
//!
//! Two settings make the gateway what the cluster's shipped objects make it (issue 26):
//! - the filter holds request headers until the body is decided (pluginConfig
//!   `pauseHeadersForBody` with the Wasm filter's `allow_on_headers_stop_iteration`), so a
//!   refusal decided on the body never opens an upstream request ([`continue_headers_before_body`]
//!   renders the older mode, where headers go on first);
//! - the connection manager refuses a request carrying a header whose name has an underscore
//!   (`headers_with_underscores_action: REJECT_REQUEST`, as Envoy's edge best practices say):
//!   CGI/WSGI backends read `x_maas_user` as `x-maas-user` ([`allow_underscore_headers`] takes
//!   it out, leaving the filter's own removal as the only wall).

use anyhow::{Result, bail};
use maas_types::PolicyDocument;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

/// Cluster the filter dispatches authenticate and policy calls to.
pub const COMPANION_INTERNAL_CLUSTER: &str = "maas-companion";
pub const COMPANION_PUBLIC_CLUSTER: &str = "maas-companion-public";
pub const SIMULATOR_CLUSTER: &str = "model-sim";
/// Long enough for slow streamed generations.
const MODEL_ROUTE_TIMEOUT: &str = "300s";

/// The label names of the filter's metrics (filter/src/metrics.rs `LABELS`; the Gateway's
/// `extraStatTags` list the same, a manifest check compares the three).
pub const FILTER_METRIC_LABELS: [&str; 7] = [
    "decision",
    "code",
    "model",
    "tier",
    "subscription",
    "token_type",
    "operation",
];

/// Envoy's tag extraction for the filter's labelled metrics, written as Istio writes an
/// `extraStatTags` entry: `<label>=.=<value>;.;` in a stat name becomes the label.
pub fn filter_stats_tags() -> Value {
    Value::Array(
        FILTER_METRIC_LABELS
            .iter()
            .map(|l| json!({"tag_name": l, "regex": format!("({l}=\\.=(.*?);\\.;)")}))
            .collect(),
    )
}

#[derive(Debug, Clone)]
pub struct WasmFilterOptions {
    pub wasm_path: PathBuf,
    /// How often the filter polls the companion's policy.
    pub poll_interval_ms: u64,
}

#[derive(Debug, Clone)]
pub struct EnvoyConfigInput<'a> {
    pub policy: &'a PolicyDocument,
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    pub companion_public: SocketAddr,
    pub companion_internal: SocketAddr,
    pub simulator: SocketAddr,
    /// `None` renders bare Envoy (no filter).
    pub filter: Option<WasmFilterOptions>,
    /// Mutual TLS to the companion's internal listener (`None`: plain HTTP, for a companion
    /// run with `--internal-auth none`).
    pub companion_tls: Option<CompanionTls>,
    /// Where Envoy writes the filter's usage events, one JSON line per request that has one
    /// (`None`: no usage-event access log).
    pub usage_events_path: Option<PathBuf>,
}

/// The usage-event line (docs/contracts.md "Usage events"): the filter's event (filter state
/// `wasm.maas_event`, JSON the filter wrote) and what Envoy knows of the request. Every other
/// field is quoted or numeric by construction, never client text: `%START_TIME%` (RFC 3339),
/// `%DURATION%` and `%RESPONSE_CODE%` (integers; 0 without a response), `%RESPONSE_FLAGS%`,
/// `%UPSTREAM_CLUSTER%` and `%UPSTREAM_HOST%` (configuration names, `ip:port`; `-` when none),
/// `%UPSTREAM_METADATA(maas:backend)%` (the backend's name of a model with several backends, a
/// policy-checked model id; `-` when none),
/// `%TRACE_ID%` (hex, or `-`). The deploy component (wasm-plugin-crs/components/usage-events)
/// and docs/deploy.md carry the same line.
pub const USAGE_EVENT_FORMAT: &str = concat!(
    r#"{"event":%FILTER_STATE(wasm.maas_event:PLAIN)%,"#,
    r#""start_time":"%START_TIME%","duration_ms":%DURATION%,"#,
    r#""status":%RESPONSE_CODE%,"response_flags":"%RESPONSE_FLAGS%","#,
    r#""backend":"%UPSTREAM_CLUSTER%","upstream_host":"%UPSTREAM_HOST%","#,
    r#""served_by":"%UPSTREAM_METADATA(maas:backend)%","#,
    r#""trace_id":"%TRACE_ID%"}"#,
    "\n"
);

/// The CEL filter that keeps a request's line only when the filter left it a usage event.
pub const USAGE_EVENT_FILTER: &str = "'wasm.maas_event' in filter_state";

/// The access log writing usage events to `path` (requests without one are not logged).
pub fn usage_events_access_log(path: &Path) -> Value {
    json!({
        "name": "envoy.access_loggers.file",
        "filter": {"extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                "expression": USAGE_EVENT_FILTER
            }
        }},
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": path.to_string_lossy(),
            "log_format": {"text_format_source": {"inline_string": USAGE_EVENT_FORMAT}}
        }
    })
}

/// What Envoy's companion cluster presents and checks: the gateway's client certificate, the
/// CA the companion's certificate must chain to, and the name it must carry (SNI and SAN), as
/// the cluster's EnvoyFilter does over SDS.
#[derive(Debug, Clone)]
pub struct CompanionTls {
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
    pub ca: PathBuf,
    pub server_name: String,
}

impl CompanionTls {
    /// The cluster's `transport_socket`.
    pub fn transport_socket(&self) -> Value {
        let mut context = json!({
            "validation_context": {
                "trusted_ca": {"filename": self.ca.to_string_lossy()},
                "match_typed_subject_alt_names": [
                    {"san_type": "DNS", "matcher": {"exact": self.server_name}}
                ]
            }
        });
        if let (Some(cert), Some(key)) = (&self.client_cert, &self.client_key) {
            context["tls_certificates"] = json!([{
                "certificate_chain": {"filename": cert.to_string_lossy()},
                "private_key": {"filename": key.to_string_lossy()}
            }]);
        }
        json!({
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "sni": self.server_name,
                "common_tls_context": context
            }
        })
    }
}

/// A model backend URL, parsed: `http://host:port[/base]` or `https://host[:port][/base]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendUrl {
    pub tls: bool,
    pub host: String,
    pub port: u16,
    /// Path prefix on the backend that replaces the model's prefix; "" for none.
    pub base_path: String,
}

impl BackendUrl {
    pub fn parse(url: &str) -> Result<BackendUrl> {
        let (tls, rest) = if let Some(r) = url.strip_prefix("http://") {
            (false, r)
        } else if let Some(r) = url.strip_prefix("https://") {
            (true, r)
        } else {
            bail!("backend {url:?}: expected `simulator`, http://host:port or https://host[:port]")
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => match p.parse::<u16>() {
                Ok(port) => (h, port),
                Err(_) => bail!("backend {url:?}: bad port {p:?}"),
            },
            _ => (authority, if tls { 443 } else { 80 }),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() || port == 0 {
            bail!("backend {url:?}: missing host or port");
        }
        if path.contains(['?', '#']) {
            bail!("backend {url:?}: no query or fragment allowed");
        }
        Ok(BackendUrl {
            tls,
            host: host.to_string(),
            port,
            base_path: path.trim_end_matches('/').to_string(),
        })
    }
}

fn endpoint_cluster(name: &str, host: &str, port: u16) -> Value {
    let is_ip = host.parse::<IpAddr>().is_ok();
    let mut c = json!({
        "name": name,
        "type": if is_ip { "STATIC" } else { "STRICT_DNS" },
        "connect_timeout": "5s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                "socket_address": {"address": host, "port_value": port}
            }}}]}]
        },
        // Envoy's defaults (1024) would throttle benchmarks before the filter does.
        "circuit_breakers": {"thresholds": [{
            "max_connections": 100000, "max_pending_requests": 100000,
            "max_requests": 100000, "max_retries": 3
        }]},
    });
    if !is_ip {
        c["dns_lookup_family"] = json!("V4_PREFERRED");
    }
    c
}

fn addr_cluster(name: &str, addr: SocketAddr) -> Value {
    endpoint_cluster(name, &addr.ip().to_string(), addr.port())
}

/// The cluster of a backend URL (TLS with SNI for https).
fn backend_cluster(name: &str, url: &BackendUrl) -> Value {
    let mut c = endpoint_cluster(name, &url.host, url.port);
    if url.tls {
        c["transport_socket"] = json!({
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "sni": url.host,
                "common_tls_context": {"validation_context": {
                    "trusted_ca": {"filename": "/etc/ssl/certs/ca-certificates.crt"}
                }}
            }
        });
    }
    c
}

/// Statuses after which an attempt fails over to another backend (before the first response
/// byte reached the client; Envoy never retries once it has sent the response on).
pub use maas_types::policy::FAILOVER_STATUSES;

/// The model's cooldown as Envoy's outlier detection (docs/design.md "Cooldown"): what cools a
/// backend when Envoy chooses the order (backends without providers, host names, or every
/// listed one tried). `failures` 5xx answers, connect failures, resets or timeouts in a row
/// eject it for `duration` (never longer: `max_ejection_time`), checked every second; every
/// backend may be ejected (Envoy then routes to all of them: its panic mode).
fn outlier_detection(rule: maas_types::policy::CooldownRule) -> Value {
    let duration = format!("{}s", rule.seconds);
    json!({
        "consecutive_5xx": rule.failures,
        "interval": "1s",
        "base_ejection_time": duration,
        "max_ejection_time": duration,
        "max_ejection_percent": 100,
        "enforcing_consecutive_gateway_failure": 0,
        "enforcing_success_rate": 0
    })
}

/// The cluster of a model's several backends (`backends`): one endpoint per backend with a
/// weight above 0, its `load_balancing_weight` the backend's weight (Envoy's weighted round
/// robin), named in the endpoint's metadata `maas.backend` (the usage event's `served_by`);
/// and the route to it: retries on another endpoint (`previous_hosts`) after a connect failure,
/// a reset, a per-try timeout (the backends' largest `timeout`, also the per-try idle bound) or
/// one of [`FAILOVER_STATUSES`]. Returns the cluster, the route action and the backends' base
/// path (the local stack serves only http backends sharing one base path per model).
fn backends_cluster(
    input: &EnvoyConfigInput<'_>,
    model: &maas_types::Model,
    name: &str,
) -> Result<(Value, Value, String)> {
    let mut endpoints = Vec::new();
    let mut base: Option<String> = None;
    let mut timeout_ms = 0u64;
    let mut total_weight = 0u32;
    let mut any_dns = false;
    for b in model.backends.iter().filter(|b| b.weight > 0) {
        let (host, port, path) = match b.backend.as_deref() {
            None | Some("simulator") => (
                input.simulator.ip().to_string(),
                input.simulator.port(),
                String::new(),
            ),
            Some(u) => {
                let url = BackendUrl::parse(u)?;
                if url.tls {
                    bail!(
                        "model {}: backend {}: the local stack serves several backends over http only",
                        model.name,
                        b.name
                    );
                }
                (url.host, url.port, url.base_path)
            }
        };
        match &base {
            Some(other) if *other != path => bail!(
                "model {}: backend {}: every backend of a model needs the same base path",
                model.name,
                b.name
            ),
            _ => base = Some(path),
        }
        any_dns |= host.parse::<IpAddr>().is_err();
        timeout_ms = timeout_ms.max(
            b.timeout_ms()
                .unwrap_or(maas_types::policy::DEFAULT_BACKEND_TIMEOUT_MS),
        );
        total_weight += b.weight;
        endpoints.push(json!({
            "endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}},
            "load_balancing_weight": b.weight,
            "metadata": {"filter_metadata": {"maas": {"backend": b.name}}}
        }));
    }
    let mut cluster = endpoint_cluster(name, "127.0.0.1", 1);
    cluster["load_assignment"]["endpoints"] = json!([{"lb_endpoints": endpoints}]);
    cluster["circuit_breakers"]["thresholds"][0]["max_retries"] = json!(100_000);
    if let Some(rule) = model.cooldown_rule() {
        cluster["outlier_detection"] = outlier_detection(rule);
    }
    if any_dns {
        cluster["type"] = json!("STRICT_DNS");
        cluster["dns_lookup_family"] = json!("V4_PREFERRED");
    }
    let per_try = format!("{}s", timeout_ms as f64 / 1000.0);
    // One try per backend (a single one is not tried again).
    let retries = endpoints.len().saturating_sub(1);
    // The stream-idle timeout: Envoy 1.40's per-try idle timeout stops once the answer started
    // (checked: a stream quiet for 2.5 s went on past a 1 s one), the route's does not. Before
    // the answer it must outlast every try (their timeouts and back-offs), which fail over.
    let tries = u64::try_from(retries + 1).unwrap_or(1);
    let idle = format!("{}s", (timeout_ms * tries + 1000) as f64 / 1000.0);
    let route = json!({
        "cluster": name,
        "timeout": MODEL_ROUTE_TIMEOUT,
        "idle_timeout": idle,
        "retry_policy": {
            "retry_on": "connect-failure,refused-stream,reset,retriable-status-codes",
            "retriable_status_codes": FAILOVER_STATUSES,
            "num_retries": retries,
            "per_try_timeout": per_try,
            "per_try_idle_timeout": per_try,
            "retry_host_predicate": [{
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}
            }],
            // Weighted round robin reaches every endpoint within the total weight's picks.
            "host_selection_retry_max_attempts": total_weight + 1,
            "retry_back_off": {"base_interval": "0.01s", "max_interval": "0.1s"}
        }
    });
    Ok((cluster, route, base.unwrap_or_default()))
}

/// The response header of a backends route naming the backend that answered
/// ([`maas_types::SERVED_BY_HEADER`]: the endpoint's metadata `maas.backend`), replacing any
/// copy the upstream sent: the filter records it in the usage ledger and removes it.
pub fn served_by_header() -> Value {
    json!([{"header": {"key": maas_types::SERVED_BY_HEADER,
                       "value": "%UPSTREAM_METADATA(maas:backend)%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}])
}

fn openai_404() -> Value {
    json!({
        "status": 404,
        "body": {"inline_string": json!({"error": {
            "message": "no model or API is served at this path",
            "type": "invalid_request_error", "param": null, "code": "not_found"
        }}).to_string()}
    })
}

fn json_content_type() -> Value {
    json!([{"header": {"key": "content-type", "value": "application/json"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}])
}

/// Two routes per prefix so `/p` and `/p/…` both match but `/pother` does not, and the
/// rewrite never produces a double slash.
fn prefix_routes(prefix: &str, rewrite_base: &str, route: &Value) -> [Value; 2] {
    let mut under = route.clone();
    under["prefix_rewrite"] = json!(format!("{rewrite_base}/"));
    let mut exact = route.clone();
    exact["prefix_rewrite"] = json!(if rewrite_base.is_empty() {
        "/"
    } else {
        rewrite_base
    });
    [
        json!({"match": {"prefix": format!("{prefix}/")}, "route": under}),
        json!({"match": {"path": prefix}, "route": exact}),
    ]
}

/// The one base URL's route for a model: `/v1/…` when the routing header names the model, to
/// the model's cluster, the path rewritten as the model's prefix route rewrites it (`/v1/…` →
/// `<backend base>/v1/…`). Without the header (the filter refused, or no filter) no such route
/// matches and the catch-all answers 404. The header has done its work once the route is
/// chosen: the backend does not get it.
fn one_url_route(model: &str, rewrite_base: &str, route: &Value) -> Value {
    let mut to = route.clone();
    to["prefix_rewrite"] = json!(format!("{rewrite_base}/v1/"));
    json!({
        "match": {
            "prefix": "/v1/",
            "headers": [{
                "name": maas_types::MODEL_ROUTING_HEADER,
                "string_match": {"exact": model}
            }]
        },
        "route": to,
        "request_headers_to_remove": [maas_types::MODEL_ROUTING_HEADER]
    })
}

/// A provider with its own path scheme (Azure deployments, Vertex's OpenAI endpoint): the
/// filter sends the provider's path (`/openai/deployments/…`) with the routing header, from
/// either URL form; this route takes any path carrying the header naming the model to its
/// cluster (the backend's base path before it). Vertex's path starts with `/v1/`, so its
/// one-base-URL route takes it first, to the same place.
fn provider_path_route(model: &str, rewrite_base: &str, route: &Value) -> Value {
    let mut to = route.clone();
    to["prefix_rewrite"] = json!(format!("{rewrite_base}/"));
    json!({
        "match": {
            "prefix": "/",
            "headers": [{
                "name": maas_types::MODEL_ROUTING_HEADER,
                "string_match": {"exact": model}
            }]
        },
        "route": to,
        "request_headers_to_remove": [maas_types::MODEL_ROUTING_HEADER]
    })
}

/// The pluginConfig the filter gets (docs/contracts.md).
pub fn plugin_config(input: &EnvoyConfigInput<'_>, poll_interval_ms: u64) -> Value {
    json!({
        "companion": {
            "cluster": COMPANION_INTERNAL_CLUSTER,
            "authority": input.companion_internal.to_string(),
            "timeoutMs": 2000
        },
        "pollIntervalMs": poll_interval_ms,
        "managementPathPrefix": "/maas-api",
        "failureMode": "closed",
        // With the Wasm filter's allow_on_headers_stop_iteration (below): headers wait for the
        // body decision.
        "pauseHeadersForBody": true,
        "bootstrapPolicy": input.policy,
    })
}

/// What Envoy's connection manager does with a request header whose name has an underscore:
/// refuse the request (HTTP/1: 400; HTTP/2: the stream is reset), as Envoy's edge best
/// practices and Istio's EDGE connection profile say. Nothing with such a name reaches the
/// filter or a backend.
pub const HEADERS_WITH_UNDERSCORES_ACTION: &str = "REJECT_REQUEST";

/// Deep-merges `extra` over `base` (objects merge key by key; anything else replaces).
pub fn merge_json(base: &mut Value, extra: &Value) {
    match (base, extra) {
        (Value::Object(b), Value::Object(e)) => {
            for (k, v) in e {
                merge_json(b.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (b, e) => *b = e.clone(),
    }
}

/// The wasm http filter inside a rendered bootstrap (JSON value), if it has one.
pub fn wasm_filter_mut(bootstrap: &mut Value) -> Option<&mut Value> {
    bootstrap
        .pointer_mut(
            "/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/http_filters",
        )
        .and_then(Value::as_array_mut)?
        .iter_mut()
        .find(|f| f["name"] == "envoy.filters.http.wasm")
}

/// Merges `extra` over the pluginConfig of the wasm filter in `bootstrap`. Fails when there is
/// no filter or its pluginConfig is not JSON.
pub fn merge_plugin_config(bootstrap: &mut Value, extra: &Value) -> Result<()> {
    let Some(wasm) = wasm_filter_mut(bootstrap) else {
        bail!("no wasm filter in the config to merge pluginConfig into");
    };
    let value = &mut wasm["typed_config"]["config"]["configuration"]["value"];
    let mut plugin: Value = serde_json::from_str(value.as_str().unwrap_or("{}"))?;
    merge_json(&mut plugin, extra);
    *value = Value::String(plugin.to_string());
    Ok(())
}

/// Holds request headers until the filter has read the body: the filter's
/// `pauseHeadersForBody` and Envoy's `allow_on_headers_stop_iteration`, which work together
/// (what [`render`] does already; for a bootstrap changed by [`continue_headers_before_body`]).
pub fn hold_headers_for_body(bootstrap: &mut Value) -> Result<()> {
    merge_plugin_config(bootstrap, &json!({"pauseHeadersForBody": true}))?;
    if let Some(wasm) = wasm_filter_mut(bootstrap) {
        wasm["typed_config"]["config"]["allow_on_headers_stop_iteration"] = json!(true);
    }
    Ok(())
}

/// The older mode (an Istio `WasmPlugin`, which cannot set the knob): headers go on once the
/// caller is authorised, before the filter reads the body; a refusal decided on the body resets
/// an upstream request that has started. Both settings off.
pub fn continue_headers_before_body(bootstrap: &mut Value) -> Result<()> {
    merge_plugin_config(bootstrap, &json!({"pauseHeadersForBody": false}))?;
    if let Some(wasm) = wasm_filter_mut(bootstrap)
        && let Some(config) = wasm["typed_config"]["config"].as_object_mut()
    {
        config.remove("allow_on_headers_stop_iteration");
    }
    Ok(())
}

/// Only the knob off, the filter still asked to hold: what an Envoy older than 1.35 (or a
/// control plane that drops the field) makes of the shipped configuration. The filter must find
/// out and let requests go on rather than hang (`maas_headers_hold_unsupported`).
pub fn drop_stop_iteration_knob(bootstrap: &mut Value) -> Result<()> {
    let Some(wasm) = wasm_filter_mut(bootstrap) else {
        bail!("no wasm filter in the config");
    };
    if let Some(config) = wasm["typed_config"]["config"].as_object_mut() {
        config.remove("allow_on_headers_stop_iteration");
    }
    Ok(())
}

/// Lets request headers with underscores through every connection manager (Envoy's default,
/// `ALLOW`): the gateway without its first wall against `x_maas_user`, to show the filter's own
/// removal holds alone.
pub fn allow_underscore_headers(bootstrap: &mut Value) -> Result<()> {
    let hcms = connection_managers_mut(bootstrap);
    if hcms.is_empty() {
        bail!("no HTTP connection manager in the config");
    }
    for hcm in hcms {
        if let Some(options) = hcm
            .get_mut("common_http_protocol_options")
            .and_then(Value::as_object_mut)
        {
            options.remove("headers_with_underscores_action");
        }
    }
    Ok(())
}

/// The HTTP connection managers of every listener in a rendered bootstrap.
fn connection_managers_mut(bootstrap: &mut Value) -> Vec<&mut Value> {
    let Some(listeners) = bootstrap
        .pointer_mut("/static_resources/listeners")
        .and_then(Value::as_array_mut)
    else {
        return Vec::new();
    };
    listeners
        .iter_mut()
        .filter_map(|l| l.pointer_mut("/filter_chains/0/filters/0/typed_config"))
        .collect()
}

/// The cluster of the OTLP/HTTP traces receiver ([`enable_tracing`]).
pub const TRACES_CLUSTER: &str = "otel-collector";

/// The request span's attributes the filter leaves in filter state (policy
/// `observability.traceAttributes`), as the tracer's custom tags read them.
pub const TRACE_ATTRIBUTES: [&str; 6] = [
    "gen_ai.request.model",
    "gen_ai.operation.name",
    "maas.user",
    "maas.decision",
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens",
];

/// The connection manager's `tracing`: Envoy's OpenTelemetry tracer exporting over OTLP/HTTP
/// through [`TRACES_CLUSTER`] to `url`, every request sampled, and a custom tag per
/// [`TRACE_ATTRIBUTES`] from the filter's filter state (`wasm.<name>`, the bytes as they are).
pub fn tracing_config(url: &str) -> Value {
    let tags: Vec<Value> = TRACE_ATTRIBUTES
        .iter()
        .map(|a| json!({"tag": a, "value": format!("%FILTER_STATE(wasm.{a}:PLAIN)%")}))
        .collect();
    json!({
        "random_sampling": {"value": 100},
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                "service_name": "maas-gateway",
                "http_service": {
                    "http_uri": {"uri": url, "cluster": TRACES_CLUSTER, "timeout": "5s"}
                }
            }
        },
        "custom_tags": tags
    })
}

/// Turns on Envoy's request spans (see [`tracing_config`]) in a rendered bootstrap, exported
/// to the OTLP/HTTP traces `url` (`http://host:port/path`), flushed every 200 ms.
pub fn enable_tracing(bootstrap: &mut Value, url: &str) -> Result<()> {
    let target = BackendUrl::parse(url)?;
    let Some(clusters) = bootstrap
        .pointer_mut("/static_resources/clusters")
        .and_then(Value::as_array_mut)
    else {
        bail!("no clusters in the config");
    };
    clusters.push(backend_cluster(TRACES_CLUSTER, &target));
    let hcms = connection_managers_mut(bootstrap);
    if hcms.is_empty() {
        bail!("no HTTP connection manager in the config");
    }
    for hcm in hcms {
        hcm["tracing"] = tracing_config(url);
    }
    // The tracer batches spans (5 s or 5 spans by default): tests wait less.
    bootstrap["layered_runtime"] = json!({"layers": [{"name": "tracing", "static_layer": {
        "tracing.opentelemetry.flush_interval_ms": 200,
        "tracing.opentelemetry.min_flush_spans": 1
    }}]});
    Ok(())
}

/// Lets the gateway's HTTP/1 codec keep request and response trailers
/// (`http_protocol_options.enable_trailers`): by default it drops them, so a chunked request's
/// trailers never reach the filter. HTTP/2 keeps trailers without this.
pub fn enable_http1_trailers(bootstrap: &mut Value) -> Result<()> {
    let hcms = connection_managers_mut(bootstrap);
    if hcms.is_empty() {
        bail!("no HTTP connection manager in the config");
    }
    for hcm in hcms {
        hcm["http_protocol_options"]["enable_trailers"] = json!(true);
    }
    Ok(())
}

/// Makes Envoy speak HTTP/2 (prior knowledge) to the cluster `name`: an upstream whose answers
/// can end in trailers.
pub fn upstream_http2(bootstrap: &mut Value, name: &str) -> Result<()> {
    let Some(cluster) = bootstrap
        .pointer_mut("/static_resources/clusters")
        .and_then(Value::as_array_mut)
        .and_then(|cs| cs.iter_mut().find(|c| c["name"] == name))
    else {
        bail!("no cluster {name:?} in the config");
    };
    cluster["typed_extension_protocol_options"] = json!({
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}
        }
    });
    Ok(())
}

/// Adds a TLS listener on `listen` with the first listener's HTTP connection manager (same
/// filter and routes), offering ALPN `h2` then `http/1.1`. Certificate and key are PEM files.
pub fn add_tls_listener(
    bootstrap: &mut Value,
    listen: SocketAddr,
    cert_pem: &std::path::Path,
    key_pem: &std::path::Path,
) -> Result<()> {
    let Some(listeners) = bootstrap
        .pointer_mut("/static_resources/listeners")
        .and_then(Value::as_array_mut)
    else {
        bail!("no listeners in the config");
    };
    let Some(first) = listeners.first() else {
        bail!("no listeners in the config");
    };
    let mut tls = first.clone();
    tls["name"] = json!(format!(
        "{}-tls",
        first["name"].as_str().unwrap_or("gateway")
    ));
    tls["address"] = json!({"socket_address": {
        "address": listen.ip().to_string(), "port_value": listen.port()
    }});
    tls["filter_chains"][0]["transport_socket"] = json!({
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "common_tls_context": {
                "alpn_protocols": ["h2", "http/1.1"],
                "tls_certificates": [{
                    "certificate_chain": {"filename": cert_pem.to_string_lossy()},
                    "private_key": {"filename": key_pem.to_string_lossy()}
                }]
            }
        }
    });
    listeners.push(tls);
    Ok(())
}

/// The gateway listener's routes inside a rendered bootstrap (first match wins).
pub fn routes_mut(bootstrap: &mut Value) -> Option<&mut Vec<Value>> {
    bootstrap
        .pointer_mut("/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/route_config/virtual_hosts/0/routes")
        .and_then(Value::as_array_mut)
}

/// Adds a plain cluster `name` reaching `addr` to a rendered bootstrap.
pub fn add_addr_cluster(bootstrap: &mut Value, name: &str, addr: SocketAddr) -> Result<()> {
    let Some(clusters) = bootstrap
        .pointer_mut("/static_resources/clusters")
        .and_then(Value::as_array_mut)
    else {
        bail!("no clusters in the config");
    };
    if clusters.iter().any(|c| c["name"] == name) {
        bail!("cluster {name:?} exists already");
    }
    clusters.push(addr_cluster(name, addr));
    Ok(())
}

/// Merges `extra` over the filter's pluginConfig inside a rendered bootstrap (e.g.
/// `{"removeHeaders":["cookie"],"cache":{"maxEntries":10}}`). Fails when there is no filter.
pub fn with_plugin_config_extra(rendered: &str, extra: &Value) -> Result<String> {
    let mut bootstrap: Value = serde_json::from_str(rendered)?;
    merge_plugin_config(&mut bootstrap, extra)?;
    Ok(serde_json::to_string_pretty(&bootstrap)?)
}

/// Envoy's `node.cluster` for every gateway replica.
pub const NODE_CLUSTER: &str = "maas-gateway";

/// Sets Envoy's node in a rendered bootstrap: `node.id` = `id` (the filter's default replica id
/// for global limits), `node.cluster` = [`NODE_CLUSTER`].
pub fn with_node_id(rendered: &str, id: &str) -> Result<String> {
    let mut bootstrap: Value = serde_json::from_str(rendered)?;
    let Some(obj) = bootstrap.as_object_mut() else {
        bail!("the bootstrap is not a JSON object");
    };
    obj.insert("node".into(), json!({"id": id, "cluster": NODE_CLUSTER}));
    Ok(serde_json::to_string_pretty(&bootstrap)?)
}

/// A rendered bootstrap with Envoy's request spans exported to `url` ([`enable_tracing`]).
pub fn with_tracing(rendered: &str, url: &str) -> Result<String> {
    let mut bootstrap: Value = serde_json::from_str(rendered)?;
    enable_tracing(&mut bootstrap, url)?;
    Ok(serde_json::to_string_pretty(&bootstrap)?)
}

/// Each model's routes (longest path first) and the clusters of their backends, appended.
fn model_routes(
    input: &EnvoyConfigInput<'_>,
    clusters: &mut Vec<Value>,
    routes: &mut Vec<Value>,
) -> Result<()> {
    // Longest prefix first, so a nested model path wins over its parent.
    let mut models: Vec<_> = input.policy.models.iter().collect();
    models.sort_by_key(|m| std::cmp::Reverse(m.path.len()));
    // Cluster name → the backend it reaches. A model's `upstreamCluster` names its cluster, so
    // that the filter can check Envoy routed the request there; other models use the
    // simulator's cluster or one `backend-N` per distinct URL.
    let mut named: BTreeMap<String, String> = BTreeMap::new();
    for reserved in [COMPANION_INTERNAL_CLUSTER, COMPANION_PUBLIC_CLUSTER] {
        named.insert(reserved.to_string(), "the companion".to_string());
    }
    named.insert(SIMULATOR_CLUSTER.to_string(), "simulator".to_string());
    let explicit: std::collections::BTreeSet<&str> = models
        .iter()
        .filter_map(|m| m.upstream_cluster.as_deref())
        .collect();
    let mut generated: BTreeMap<String, String> = BTreeMap::new();
    let mut one_url_routes = Vec::new();
    let mut provider_path_routes = Vec::new();
    for model in models {
        if model.routes_backends() {
            routed_backends(
                input,
                model,
                &mut named,
                clusters,
                routes,
                &mut one_url_routes,
            )?;
            continue;
        }
        if !model.backends.is_empty() {
            let sink = (
                &mut named,
                &mut *clusters,
                &mut *routes,
                &mut one_url_routes,
            );
            failover_backends(input, model, &explicit, sink)?;
            continue;
        }
        let backend = model.backend.as_deref().unwrap_or("simulator");
        let url = if backend == "simulator" {
            None
        } else {
            Some(BackendUrl::parse(backend)?)
        };
        let cluster = match (&model.upstream_cluster, &url) {
            (Some(name), _) => name.clone(),
            (None, None) => SIMULATOR_CLUSTER.to_string(),
            (None, Some(_)) => match generated.get(backend) {
                Some(n) => n.clone(),
                None => {
                    let n = (generated.len()..)
                        .map(|i| format!("backend-{i}"))
                        .find(|n| !explicit.contains(n.as_str()) && !named.contains_key(n))
                        .unwrap_or_default();
                    generated.insert(backend.to_string(), n.clone());
                    n
                }
            },
        };
        claim_cluster(
            input,
            &mut named,
            clusters,
            (&model.name, &cluster),
            (backend, url.as_ref()),
        )?;
        let (base, host_rewrite) = match &url {
            None => (String::new(), false),
            Some(url) => (url.base_path.clone(), url.host.parse::<IpAddr>().is_err()),
        };
        let mut route = json!({"cluster": cluster, "timeout": MODEL_ROUTE_TIMEOUT});
        if host_rewrite {
            // External servers route on their own host name.
            route["auto_host_rewrite"] = json!(true);
        }
        routes.extend(prefix_routes(&model.path, &base, &route));
        one_url_routes.push(one_url_route(&model.name, &base, &route));
        if model
            .provider
            .as_ref()
            .is_some_and(|p| p.path().is_some() || p.path.is_some())
        {
            provider_path_routes.push(provider_path_route(&model.name, &base, &route));
        }
    }
    // The one base URL: the filter names the model in the routing header (a client's own copy
    // is removed first), and Envoy chooses the route again once the filter changed the headers.
    routes.extend(one_url_routes);
    routes.extend(provider_path_routes);
    Ok(())
}

/// Cluster `cluster` reaching `backend` (its URL, or the simulator), for `model`: added the
/// first time, the same again is fine, another backend under that name is an error.
fn claim_cluster(
    input: &EnvoyConfigInput<'_>,
    named: &mut BTreeMap<String, String>,
    clusters: &mut Vec<Value>,
    (model, cluster): (&str, &str),
    (backend, url): (&str, Option<&BackendUrl>),
) -> Result<()> {
    match named.get(cluster) {
        Some(reaches) if reaches == backend => {}
        Some(reaches) => {
            bail!("model {model}: cluster {cluster:?} already reaches {reaches}, not {backend}")
        }
        None => {
            clusters.push(match url {
                None => addr_cluster(cluster, input.simulator),
                Some(url) => backend_cluster(cluster, url),
            });
            named.insert(cluster.to_string(), backend.to_string());
        }
    }
    Ok(())
}

/// A model's backends behind one cluster with failover (docs/design.md "Several backends per
/// model"): the cluster, its prefix routes and its one-base-URL route (`later`).
fn failover_backends(
    input: &EnvoyConfigInput<'_>,
    model: &maas_types::Model,
    explicit: &std::collections::BTreeSet<&str>,
    (named, clusters, routes, one_url_routes): (
        &mut BTreeMap<String, String>,
        &mut Vec<Value>,
        &mut Vec<Value>,
        &mut Vec<Value>,
    ),
) -> Result<()> {
    let cluster = match &model.upstream_cluster {
        Some(name) => name.clone(),
        None => (0..)
            .map(|i| format!("backends-{i}"))
            .find(|n| !explicit.contains(n.as_str()) && !named.contains_key(n))
            .unwrap_or_default(),
    };
    if named.contains_key(&cluster) {
        bail!("model {}: cluster {cluster:?} is used twice", model.name);
    }
    let (mut c, route, base) = backends_cluster(input, model, &cluster)?;
    if model.backends_need_upstream_filter() {
        add_upstream_filter(input, &mut c);
        c["load_balancing_policy"] = backend_order_policy();
    }
    clusters.push(c);
    named.insert(cluster, format!("the backends of {}", model.name));
    let mut own = prefix_routes(&model.path, &base, &route).to_vec();
    own.push(one_url_route(&model.name, &base, &route));
    for r in &mut own {
        r["response_headers_to_add"] = served_by_header();
    }
    one_url_routes.extend(own.pop());
    routes.extend(own);
    Ok(())
}

/// A model's routed backends (each names its own cluster; docs/design.md "Routed backends"):
/// a cluster per backend, and per backend the routes the filter's routing headers choose —
/// the model's prefix, the one base URL and any path (a provider's own: Azure deployments,
/// Bedrock's `/model/…`) when [`MODEL_ROUTING_HEADER`](maas_types::MODEL_ROUTING_HEADER) names
/// the model and [`BACKEND_ROUTING_HEADER`](maas_types::BACKEND_ROUTING_HEADER) the backend.
/// The model's plain prefix routes go to its first backend's cluster: the filter sets the
/// headers on every request it lets go, and Envoy chooses the route again.
fn routed_backends(
    input: &EnvoyConfigInput<'_>,
    model: &maas_types::Model,
    named: &mut BTreeMap<String, String>,
    clusters: &mut Vec<Value>,
    routes: &mut Vec<Value>,
    later: &mut Vec<Value>,
) -> Result<()> {
    let mut plain = Vec::new();
    for b in &model.backends {
        let cluster = b.upstream_cluster.clone().unwrap_or_default();
        // No URL (the cluster is the operator's): the stack's simulator, as for a model.
        let backend = b.backend.as_deref().unwrap_or("simulator");
        let url = (backend != "simulator")
            .then(|| BackendUrl::parse(backend))
            .transpose()?;
        claim_cluster(
            input,
            named,
            clusters,
            (&model.name, &cluster),
            (backend, url.as_ref()),
        )?;
        let base = url.as_ref().map_or(String::new(), |u| u.base_path.clone());
        // The backend's own timeout: to its answer's start (one try, no retry), then as the
        // longest quiet in its answer.
        let timeout_ms = b
            .timeout_ms()
            .unwrap_or(maas_types::policy::DEFAULT_BACKEND_TIMEOUT_MS);
        let per_try = format!("{}s", timeout_ms as f64 / 1000.0);
        let mut route = json!({
            "cluster": cluster,
            "timeout": MODEL_ROUTE_TIMEOUT,
            "idle_timeout": format!("{}s", (timeout_ms + 1000) as f64 / 1000.0),
            "retry_policy": {"num_retries": 0, "per_try_timeout": per_try,
                             "per_try_idle_timeout": per_try}
        });
        if url
            .as_ref()
            .is_some_and(|u| u.host.parse::<IpAddr>().is_err())
        {
            route["auto_host_rewrite"] = json!(true);
        }
        let headers = json!([
            {"name": maas_types::MODEL_ROUTING_HEADER, "string_match": {"exact": model.name}},
            {"name": maas_types::BACKEND_ROUTING_HEADER, "string_match": {"exact": b.name}}
        ]);
        let remove = json!([
            maas_types::MODEL_ROUTING_HEADER,
            maas_types::BACKEND_ROUTING_HEADER
        ]);
        for mut r in prefix_routes(&model.path, &base, &route) {
            r["match"]["headers"] = headers.clone();
            r["request_headers_to_remove"] = remove.clone();
            routes.push(r);
        }
        if plain.is_empty() {
            plain.extend(prefix_routes(&model.path, &base, &route));
        }
        for (prefix, rewrite) in [("/v1/", format!("{base}/v1/")), ("/", format!("{base}/"))] {
            let mut to = route.clone();
            to["prefix_rewrite"] = json!(rewrite);
            later.push(json!({
                "match": {"prefix": prefix, "headers": headers},
                "route": to,
                "request_headers_to_remove": remove
            }));
        }
    }
    routes.extend(plain);
    Ok(())
}

/// The MaaS filter in its upstream mode (pluginConfig `upstream: true`; docs/design.md
/// "Several backends per model"), for a backends cluster whose backends have providers: it
/// sets the chosen backend's credential per upstream attempt. Same module and VM as the
/// downstream filter. `None` for bare Envoy.
fn upstream_filter(input: &EnvoyConfigInput<'_>) -> Option<Value> {
    let filter = input.filter.as_ref()?;
    let mut config = plugin_config(input, filter.poll_interval_ms);
    config["upstream"] = json!(true);
    let mut wasm = wasm_filter("maas-filter-upstream", filter, &config);
    // As downstream: an attempt that rewrites the body holds its headers for it.
    if config["pauseHeadersForBody"] == json!(true) {
        wasm["typed_config"]["config"]["allow_on_headers_stop_iteration"] = json!(true);
    }
    Some(wasm)
}

/// `envoy.filters.http.wasm` running the MaaS module with `config` as its pluginConfig. Every
/// instance has the same `vm_id` and code, so the downstream and upstream filters share one VM
/// per worker.
fn wasm_filter(name: &str, filter: &WasmFilterOptions, config: &Value) -> Value {
    json!({
        "name": "envoy.filters.http.wasm",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": name,
                "root_id": "maas-filter",
                "fail_open": false,
                "vm_config": {
                    "vm_id": "maas-filter",
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": filter.wasm_path.to_string_lossy()}}
                },
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": config.to_string()
                }
            }
        }
    })
}

/// The load balancing of a backends cluster whose backends have providers: the endpoints the
/// filter lists in [`maas_types::BACKEND_ORDER_HEADER`] (those whose credential it holds, the
/// first by weight; a retry takes the next), else — none listed, or all tried — Envoy's
/// (weighted) round robin over the cluster.
fn backend_order_policy() -> Value {
    json!({"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": [{"header": maas_types::BACKEND_ORDER_HEADER}],
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.round_robin",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"}
            }}]}
        }
    }}]})
}

/// Gives `cluster` the MaaS filter in its upstream mode, then the upstream codec (nothing
/// for bare Envoy).
fn add_upstream_filter(input: &EnvoyConfigInput<'_>, cluster: &mut Value) {
    if let Some(filter) = upstream_filter(input) {
        cluster["typed_extension_protocol_options"] = json!({
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http_protocol_options": {}},
                "http_filters": [filter, {
                    "name": "envoy.filters.http.upstream_codec",
                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec"}
                }]
            }
        });
    }
}

/// The HTTP filters: the MaaS filter (when the stack has one), then the router.
fn http_filters(input: &EnvoyConfigInput<'_>) -> Vec<Value> {
    let mut http_filters = Vec::new();
    if let Some(filter) = &input.filter {
        let config = plugin_config(input, filter.poll_interval_ms);
        let mut wasm = wasm_filter("maas-filter", filter, &config);
        // With pluginConfig pauseHeadersForBody: Envoy hands the body of a request whose
        // headers the filter holds to the filter (Envoy 1.35+).
        wasm["typed_config"]["config"]["allow_on_headers_stop_iteration"] = json!(true);
        http_filters.push(wasm);
    }
    http_filters.push(json!({
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
    }));
    http_filters
}

/// Renders the Envoy bootstrap (JSON) for the stack.
pub fn render(input: &EnvoyConfigInput<'_>) -> Result<String> {
    let mut internal = addr_cluster(COMPANION_INTERNAL_CLUSTER, input.companion_internal);
    if let Some(tls) = &input.companion_tls {
        internal["transport_socket"] = tls.transport_socket();
    }
    let mut clusters = vec![
        internal,
        addr_cluster(COMPANION_PUBLIC_CLUSTER, input.companion_public),
        addr_cluster(SIMULATOR_CLUSTER, input.simulator),
    ];
    let mut routes = vec![
        json!({"match": {"path_separated_prefix": "/maas-api/internal"},
               "direct_response": openai_404(),
               "response_headers_to_add": json_content_type()}),
    ];
    routes.extend(prefix_routes(
        "/maas-api",
        "",
        &json!({"cluster": COMPANION_PUBLIC_CLUSTER, "timeout": "30s"}),
    ));
    model_routes(input, &mut clusters, &mut routes)?;
    routes.push(
        json!({"match": {"prefix": "/"}, "direct_response": openai_404(),
                       "response_headers_to_add": json_content_type()}),
    );

    let http_filters = http_filters(input);
    let access_log: Vec<Value> = input
        .usage_events_path
        .iter()
        .map(|p| usage_events_access_log(p))
        .collect();

    let bootstrap = json!({
        "admin": {"address": {"socket_address": {
            "address": input.admin.ip().to_string(), "port_value": input.admin.port()
        }}},
        "stats_config": {"stats_tags": filter_stats_tags()},
        "static_resources": {
            "listeners": [{
                "name": "gateway",
                "address": {"socket_address": {
                    "address": input.listen.ip().to_string(), "port_value": input.listen.port()
                }},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "gateway",
                        "codec_type": "AUTO",
                        "normalize_path": true,
                        "merge_slashes": true,
                        "path_with_escaped_slashes_action": "UNESCAPE_AND_FORWARD",
                        // Streams may idle between chunks; the route timeout bounds the whole call.
                        "stream_idle_timeout": "300s",
                        "request_timeout": "0s",
                        "common_http_protocol_options": {
                            "headers_with_underscores_action": HEADERS_WITH_UNDERSCORES_ACTION
                        },
                        "route_config": {
                            "name": "gateway",
                            "virtual_hosts": [{"name": "gateway", "domains": ["*"], "routes": routes}]
                        },
                        "http_filters": http_filters,
                        "access_log": access_log
                    }
                }]}]
            }],
            "clusters": clusters
        }
    });
    Ok(serde_json::to_string_pretty(&bootstrap)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> PolicyDocument {
        PolicyDocument::from_value(json!({
            "tiers": [{"name": "free", "level": 0, "groups": ["g"]}],
            "models": [
                {"name": "sim", "path": "/llm/sim", "tiers": ["free"], "backend": "simulator"},
                {"name": "nested", "path": "/llm/sim/nested", "tiers": ["free"], "backend": "http://127.0.0.1:9000"},
                {"name": "ext", "path": "/ext/gpt", "tiers": ["free"], "backend": "https://api.example.com/v1/"},
                {"name": "ext2", "path": "/ext/gpt2", "tiers": ["free"], "backend": "https://api.example.com/v1/"}
            ]
        }))
        .unwrap()
    }

    fn input(policy: &PolicyDocument, filter: bool) -> EnvoyConfigInput<'_> {
        let a = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
        EnvoyConfigInput {
            policy,
            listen: a(8080),
            admin: a(9901),
            companion_public: a(7001),
            companion_internal: a(7002),
            simulator: a(7003),
            filter: filter.then(|| WasmFilterOptions {
                wasm_path: "/x/maas_filter.wasm".into(),
                poll_interval_ms: 500,
            }),
            companion_tls: None,
            usage_events_path: None,
        }
    }

    /// The usage-event access log: rendered with a path only, filtered by the CEL expression,
    /// and its line is one JSON object whatever Envoy puts in each field (its `-` included).
    #[test]
    fn the_usage_event_log_is_rendered_with_a_path_and_its_line_is_json() {
        let p = policy();
        let hcm_of = |input: &EnvoyConfigInput<'_>| {
            let v: Value = serde_json::from_str(&render(input).unwrap()).unwrap();
            hcm(&v).clone()
        };
        assert_eq!(hcm_of(&input(&p, true))["access_log"], json!([]));
        let with = EnvoyConfigInput {
            usage_events_path: Some("/tmp/stack/usage-events.jsonl".into()),
            ..input(&p, true)
        };
        let log = hcm_of(&with)["access_log"][0].clone();
        assert_eq!(log["typed_config"]["path"], "/tmp/stack/usage-events.jsonl");
        assert_eq!(
            log["filter"]["extension_filter"]["typed_config"]["expression"],
            "'wasm.maas_event' in filter_state"
        );
        assert_eq!(
            log["typed_config"]["log_format"]["text_format_source"]["inline_string"],
            USAGE_EVENT_FORMAT
        );
        assert!(
            USAGE_EVENT_FORMAT.ends_with("}\n") && USAGE_EVENT_FORMAT.matches('\n').count() == 1
        );
        for (event, dash) in [(r#"{"model":"m\"x"}"#, "-"), ("{}", "x")] {
            let line = USAGE_EVENT_FORMAT
                .replace("%FILTER_STATE(wasm.maas_event:PLAIN)%", event)
                .replace("%START_TIME%", "2026-01-01T00:00:00.000Z")
                .replace("%DURATION%", "12")
                .replace("%RESPONSE_CODE%", "0")
                .replace("%RESPONSE_FLAGS%", dash)
                .replace("%UPSTREAM_CLUSTER%", dash)
                .replace("%UPSTREAM_HOST%", dash)
                .replace("%UPSTREAM_METADATA(maas:backend)%", dash)
                .replace("%TRACE_ID%", dash);
            assert!(!line.contains('%'), "every operator replaced: {line}");
            let v: Value = serde_json::from_str(line.trim_end()).unwrap();
            assert_eq!(v["event"], serde_json::from_str::<Value>(event).unwrap());
            assert_eq!(v["backend"], dash);
        }
    }

    fn routes(v: &Value) -> Vec<Value> {
        v.pointer("/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/route_config/virtual_hosts/0/routes")
            .and_then(Value::as_array)
            .cloned()
            .unwrap()
    }

    fn hcm(v: &Value) -> &Value {
        v.pointer("/static_resources/listeners/0/filter_chains/0/filters/0/typed_config")
            .unwrap()
    }

    #[test]
    fn routes_follow_the_policy() {
        let p = policy();
        let v: Value = serde_json::from_str(&render(&input(&p, true)).unwrap()).unwrap();
        let r = routes(&v);
        // internal first, then the public API, then models longest first, then the 404.
        assert_eq!(r[0]["match"]["path_separated_prefix"], "/maas-api/internal");
        assert_eq!(r[0]["direct_response"]["status"], 404);
        assert_eq!(r[1]["match"]["prefix"], "/maas-api/");
        assert_eq!(r[1]["route"]["prefix_rewrite"], "/");
        assert_eq!(r[1]["route"]["cluster"], COMPANION_PUBLIC_CLUSTER);
        assert_eq!(r[2]["match"]["path"], "/maas-api");
        let prefixes: Vec<&str> = r
            .iter()
            .filter_map(|x| x["match"]["prefix"].as_str())
            .collect();
        let nested = prefixes
            .iter()
            .position(|p| *p == "/llm/sim/nested/")
            .unwrap();
        let sim = prefixes.iter().position(|p| *p == "/llm/sim/").unwrap();
        assert!(nested < sim, "nested model must match first: {prefixes:?}");
        let sim_route = r
            .iter()
            .find(|x| x["match"]["prefix"] == "/llm/sim/")
            .unwrap();
        assert_eq!(sim_route["route"]["cluster"], SIMULATOR_CLUSTER);
        assert_eq!(sim_route["route"]["prefix_rewrite"], "/");
        assert_eq!(sim_route["route"]["timeout"], "300s");
        let ext = r
            .iter()
            .find(|x| x["match"]["prefix"] == "/ext/gpt/")
            .unwrap();
        assert_eq!(ext["route"]["prefix_rewrite"], "/v1/");
        assert_eq!(ext["route"]["auto_host_rewrite"], true);
        let last = r.last().unwrap();
        assert_eq!(last["match"]["prefix"], "/");
        assert_eq!(last["direct_response"]["status"], 404);
        let body: Value = serde_json::from_str(
            last["direct_response"]["body"]["inline_string"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(body["error"]["type"], "invalid_request_error");
    }

    #[test]
    fn clusters_one_per_backend_with_tls_for_https() {
        let p = policy();
        let v: Value = serde_json::from_str(&render(&input(&p, true)).unwrap()).unwrap();
        let clusters = v["static_resources"]["clusters"].as_array().unwrap();
        let names: Vec<&str> = clusters
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert_eq!(names.len(), 5, "{names:?}"); // companion x2, sim, 127.0.0.1:9000, api.example.com
        let ext = clusters
            .iter()
            .find(|c| c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]["address"] == "api.example.com")
            .unwrap();
        assert_eq!(ext["type"], "STRICT_DNS");
        assert_eq!(
            ext["transport_socket"]["typed_config"]["sni"],
            "api.example.com"
        );
        let companion = clusters
            .iter()
            .find(|c| c["name"] == COMPANION_INTERNAL_CLUSTER)
            .unwrap();
        assert_eq!(
            companion["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
                ["socket_address"]["port_value"],
            7002
        );
        assert!(companion["transport_socket"].is_null(), "plain without TLS");
    }

    /// With mutual TLS, the companion cluster (and only it) presents the gateway's certificate
    /// and checks the companion's against the CA and the name.
    #[test]
    fn the_companion_cluster_presents_the_gateways_certificate() {
        let p = policy();
        let mut inp = input(&p, true);
        inp.companion_tls = Some(CompanionTls {
            client_cert: Some("/pki/gw.crt".into()),
            client_key: Some("/pki/gw.key".into()),
            ca: "/pki/ca.crt".into(),
            server_name: "maas-companion.local".into(),
        });
        let v: Value = serde_json::from_str(&render(&inp).unwrap()).unwrap();
        let clusters = v["static_resources"]["clusters"].as_array().unwrap();
        let internal = clusters
            .iter()
            .find(|c| c["name"] == COMPANION_INTERNAL_CLUSTER)
            .unwrap();
        let tls = &internal["transport_socket"]["typed_config"];
        assert_eq!(tls["sni"], "maas-companion.local");
        let ctx = &tls["common_tls_context"];
        assert_eq!(
            ctx["tls_certificates"][0]["certificate_chain"]["filename"],
            "/pki/gw.crt"
        );
        assert_eq!(
            ctx["tls_certificates"][0]["private_key"]["filename"],
            "/pki/gw.key"
        );
        assert_eq!(
            ctx["validation_context"]["trusted_ca"]["filename"],
            "/pki/ca.crt"
        );
        assert_eq!(
            ctx["validation_context"]["match_typed_subject_alt_names"][0]["matcher"]["exact"],
            "maas-companion.local"
        );
        let public = clusters
            .iter()
            .find(|c| c["name"] == COMPANION_PUBLIC_CLUSTER)
            .unwrap();
        assert!(
            public["transport_socket"].is_null(),
            "the public listener is unchanged"
        );
    }

    #[test]
    fn filter_config_carries_policy_and_companion() {
        let p = policy();
        let v: Value = serde_json::from_str(&render(&input(&p, true)).unwrap()).unwrap();
        let h = hcm(&v);
        assert_eq!(h["normalize_path"], true);
        assert_eq!(h["merge_slashes"], true);
        let filters = h["http_filters"].as_array().unwrap();
        assert_eq!(filters.len(), 2);
        assert_eq!(filters[0]["name"], "envoy.filters.http.wasm");
        assert_eq!(filters[1]["name"], "envoy.filters.http.router");
        let wasm = &filters[0]["typed_config"]["config"];
        assert_eq!(wasm["vm_config"]["runtime"], "envoy.wasm.runtime.v8");
        assert_eq!(
            wasm["vm_config"]["code"]["local"]["filename"],
            "/x/maas_filter.wasm"
        );
        let plugin: Value =
            serde_json::from_str(wasm["configuration"]["value"].as_str().unwrap()).unwrap();
        // Headers held for the body by default: both halves, together.
        assert_eq!(plugin["pauseHeadersForBody"], true);
        assert_eq!(wasm["allow_on_headers_stop_iteration"], true);
        assert_eq!(
            h["common_http_protocol_options"]["headers_with_underscores_action"],
            "REJECT_REQUEST"
        );
        assert_eq!(plugin["companion"]["cluster"], COMPANION_INTERNAL_CLUSTER);
        assert_eq!(plugin["companion"]["authority"], "127.0.0.1:7002");
        assert_eq!(plugin["pollIntervalMs"], 500);
        let bootstrap = PolicyDocument::from_value(plugin["bootstrapPolicy"].clone()).unwrap();
        assert_eq!(bootstrap, p);
    }

    #[test]
    fn plugin_config_extra_merges_deeply() {
        let p = policy();
        let rendered = render(&input(&p, true)).unwrap();
        let merged = with_plugin_config_extra(
            &rendered,
            &json!({"removeHeaders": ["cookie"], "companion": {"timeoutMs": 50}}),
        )
        .unwrap();
        let v: Value = serde_json::from_str(&merged).unwrap();
        let plugin: Value = serde_json::from_str(
            hcm(&v)["http_filters"][0]["typed_config"]["config"]["configuration"]["value"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(plugin["removeHeaders"], json!(["cookie"]));
        assert_eq!(plugin["companion"]["timeoutMs"], 50);
        assert_eq!(
            plugin["companion"]["cluster"], COMPANION_INTERNAL_CLUSTER,
            "kept"
        );
        assert!(with_plugin_config_extra(&render(&input(&p, false)).unwrap(), &json!({})).is_err());
    }

    #[test]
    fn the_older_modes_can_be_rendered() {
        let p = policy();
        let plugin = |v: &Value| -> Value {
            serde_json::from_str(
                hcm(v)["http_filters"][0]["typed_config"]["config"]["configuration"]["value"]
                    .as_str()
                    .unwrap(),
            )
            .unwrap()
        };
        let knob = |v: &Value| {
            hcm(v)["http_filters"][0]["typed_config"]["config"]["allow_on_headers_stop_iteration"]
                .clone()
        };
        let rendered: Value = serde_json::from_str(&render(&input(&p, true)).unwrap()).unwrap();
        let mut v = rendered.clone();
        continue_headers_before_body(&mut v).unwrap();
        assert_eq!(plugin(&v)["pauseHeadersForBody"], false);
        assert!(knob(&v).is_null());
        hold_headers_for_body(&mut v).unwrap();
        assert_eq!(v, rendered, "back to the default");
        drop_stop_iteration_knob(&mut v).unwrap();
        assert_eq!(plugin(&v)["pauseHeadersForBody"], true);
        assert!(knob(&v).is_null());
        let mut v = rendered.clone();
        allow_underscore_headers(&mut v).unwrap();
        assert!(
            hcm(&v)["common_http_protocol_options"]["headers_with_underscores_action"].is_null()
        );
        assert!(allow_underscore_headers(&mut json!({})).is_err());
        assert!(drop_stop_iteration_knob(&mut json!({})).is_err());
    }

    #[test]
    fn trailers_and_tls_listener_options() {
        let p = policy();
        let mut v: Value = serde_json::from_str(&render(&input(&p, true)).unwrap()).unwrap();
        let tls_addr = SocketAddr::from(([127, 0, 0, 1], 8443));
        add_tls_listener(&mut v, tls_addr, "/c.pem".as_ref(), "/k.pem".as_ref()).unwrap();
        enable_http1_trailers(&mut v).unwrap();
        let listeners = v["static_resources"]["listeners"].as_array().unwrap();
        assert_eq!(listeners.len(), 2);
        for l in listeners {
            let hcm = &l["filter_chains"][0]["filters"][0]["typed_config"];
            assert_eq!(hcm["http_protocol_options"]["enable_trailers"], true);
            assert_eq!(hcm["http_filters"][0]["name"], "envoy.filters.http.wasm");
        }
        let tls = &listeners[1];
        assert_eq!(tls["address"]["socket_address"]["port_value"], 8443);
        let ctx =
            &tls["filter_chains"][0]["transport_socket"]["typed_config"]["common_tls_context"];
        assert_eq!(ctx["alpn_protocols"], json!(["h2", "http/1.1"]));
        assert_eq!(
            ctx["tls_certificates"][0]["private_key"]["filename"],
            "/k.pem"
        );
        assert!(listeners[0]["filter_chains"][0]["transport_socket"].is_null());
        assert!(enable_http1_trailers(&mut json!({})).is_err());
        assert!(add_tls_listener(&mut json!({}), tls_addr, "/c".as_ref(), "/k".as_ref()).is_err());
    }

    /// Routed backends: a cluster each, and each backend's routes chosen by both routing
    /// headers (the prefix before the model's plain prefix route, the one base URL, any path);
    /// the plain prefix route goes to the first backend's cluster.
    #[test]
    fn routed_backends_get_a_cluster_and_routes_by_both_headers_each() {
        let p = PolicyDocument::from_value(json!({
            "tiers": [{"name": "free", "level": 0, "groups": ["g"]}],
            "models": [
                {"name": "duo", "path": "/ext/duo", "tiers": ["free"], "backends": [
                    {"name": "a", "backend": "http://127.0.0.1:9000/base", "upstreamCluster": "c-a",
                     "provider": {"type": "openai", "credentialRef": "k"}},
                    {"name": "b", "backend": "http://127.0.0.1:9001", "upstreamCluster": "c-b",
                     "provider": {"type": "azure-openai", "credentialRef": "k", "deployment": "d"}}
                ]}
            ]
        }))
        .unwrap();
        let v: Value = serde_json::from_str(&render(&input(&p, true)).unwrap()).unwrap();
        let clusters: Vec<&str> = v["static_resources"]["clusters"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|c| c["name"].as_str())
            .collect();
        assert!(
            clusters.contains(&"c-a") && clusters.contains(&"c-b"),
            "{clusters:?}"
        );
        let r = routes(&v);
        let of = |backend: &str| -> Vec<&Value> {
            r.iter()
                .filter(|x| x["match"]["headers"][1]["string_match"]["exact"] == backend)
                .collect()
        };
        for (backend, cluster, base) in [("a", "c-a", "/base"), ("b", "c-b", "")] {
            let own = of(backend);
            let prefixes: Vec<String> = own
                .iter()
                .map(|x| {
                    x["match"]["prefix"]
                        .as_str()
                        .or(x["match"]["path"].as_str())
                        .unwrap()
                        .to_string()
                })
                .collect();
            assert_eq!(
                prefixes,
                ["/ext/duo/", "/ext/duo", "/v1/", "/"],
                "{backend}"
            );
            for x in &own {
                assert_eq!(x["route"]["cluster"], cluster);
                assert_eq!(x["match"]["headers"][0]["string_match"]["exact"], "duo");
                assert_eq!(
                    x["request_headers_to_remove"],
                    json!([
                        maas_types::MODEL_ROUTING_HEADER,
                        maas_types::BACKEND_ROUTING_HEADER
                    ])
                );
            }
            assert_eq!(own[2]["route"]["prefix_rewrite"], format!("{base}/v1/"));
        }
        // The plain prefix route (no header) after the routed ones, to the first backend.
        let plain = r
            .iter()
            .position(|x| x["match"]["prefix"] == "/ext/duo/" && x["match"]["headers"].is_null())
            .unwrap();
        assert_eq!(r[plain]["route"]["cluster"], "c-a");
        let routed_at = r.iter().position(|x| std::ptr::eq(x, of("b")[0])).unwrap();
        assert!(routed_at < plain);
    }

    #[test]
    fn a_rewritten_provider_path_is_routed_by_the_routing_header() {
        let p = PolicyDocument::from_value(json!({
            "tiers": [{"name": "free", "level": 0, "groups": ["g"]}],
            "models": [
                {"name": "az", "path": "/ext/az", "tiers": ["free"], "backend": "http://127.0.0.1:9000",
                 "provider": {"type": "azure-openai", "credentialRef": "k", "deployment": "d"},
                 "upstreamCluster": "ext-az"},
                {"name": "oai", "path": "/ext/oai", "tiers": ["free"], "backend": "http://127.0.0.1:9001",
                 "provider": {"type": "openai", "credentialRef": "k"}, "upstreamCluster": "ext-oai"}
            ]
        }))
        .unwrap();
        let v: Value = serde_json::from_str(&render(&input(&p, true)).unwrap()).unwrap();
        let r = routes(&v);
        let by_header: Vec<&Value> = r
            .iter()
            .filter(|x| x["match"]["prefix"] == "/" && !x["match"]["headers"].is_null())
            .collect();
        assert_eq!(by_header.len(), 1, "only the model whose path is rewritten");
        let route = by_header[0];
        assert_eq!(route["match"]["headers"][0]["string_match"]["exact"], "az");
        assert_eq!(route["route"]["cluster"], "ext-az");
        assert_eq!(route["route"]["prefix_rewrite"], "/");
        // After every /v1/ route, before the 404.
        let at = r.iter().position(|x| std::ptr::eq(x, route)).unwrap();
        assert!(r[..at].iter().any(|x| x["match"]["prefix"] == "/v1/"));
        assert!(r[at + 1..].iter().all(|x| x["match"]["headers"].is_null()));
    }

    #[test]
    fn several_backends_are_one_weighted_cluster_with_failover() {
        let p = PolicyDocument::from_value(json!({
            "tiers": [{"name": "free", "level": 0, "groups": ["g"]}],
            "models": [
                {"name": "duo", "path": "/llm/duo", "tiers": ["free"], "backends": [
                    {"name": "a", "backend": "http://127.0.0.1:9001/base", "weight": 80, "timeout": "2s"},
                    {"name": "b", "backend": "http://10.0.0.2:9002/base", "weight": 20, "timeout": "500ms"},
                    {"name": "off", "backend": "http://127.0.0.1:9003/base", "weight": 0}
                ]}
            ]
        }))
        .unwrap();
        let v: Value = serde_json::from_str(&render(&input(&p, true)).unwrap()).unwrap();
        let r = routes(&v);
        let route = r
            .iter()
            .find(|x| x["match"]["prefix"] == "/llm/duo/")
            .map(|x| x["route"].clone())
            .unwrap();
        assert_eq!(route["prefix_rewrite"], "/base/");
        let retry = &route["retry_policy"];
        assert_eq!(retry["num_retries"], 1, "two backends with traffic");
        assert_eq!(retry["per_try_timeout"], "2s", "the largest timeout");
        assert_eq!(retry["per_try_idle_timeout"], "2s");
        assert_eq!(route["idle_timeout"], "5s", "both tries and a second");
        assert_eq!(
            retry["retriable_status_codes"],
            json!([429, 500, 502, 503, 504])
        );
        assert_eq!(
            retry["retry_host_predicate"][0]["name"],
            "envoy.retry_host_predicates.previous_hosts"
        );
        assert_eq!(retry["host_selection_retry_max_attempts"], 101);
        let name = route["cluster"].as_str().unwrap();
        let cluster = v["static_resources"]["clusters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap();
        let eps = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
            .as_array()
            .unwrap();
        let got: Vec<(Value, Value, Value)> = eps
            .iter()
            .map(|e| {
                (
                    e["endpoint"]["address"]["socket_address"]["port_value"].clone(),
                    e["load_balancing_weight"].clone(),
                    e["metadata"]["filter_metadata"]["maas"]["backend"].clone(),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (json!(9001), json!(80), json!("a")),
                (json!(9002), json!(20), json!("b"))
            ],
            "weight 0 gets no traffic"
        );
        // The one base URL's route fails over alike.
        assert!(
            r.iter()
                .any(|x| x["match"]["prefix"] == "/v1/" && x["route"]["retry_policy"] == *retry)
        );
        // Each of the model's routes names the backend that answered (the upstream's own copy
        // replaced).
        let duo: Vec<&Value> = r.iter().filter(|x| x["route"]["cluster"] == name).collect();
        assert_eq!(duo.len(), 3, "{duo:#?}");
        for x in duo {
            let h = &x["response_headers_to_add"][0];
            assert_eq!(h["header"]["key"], maas_types::SERVED_BY_HEADER);
            assert_eq!(h["header"]["value"], "%UPSTREAM_METADATA(maas:backend)%");
            assert_eq!(h["append_action"], "OVERWRITE_IF_EXISTS_OR_ADD");
        }
        // The local stack serves one base path per model, over http.
        for other in ["http://127.0.0.1:9002/other", "https://example.com/base"] {
            let mut q = p.clone();
            q.models[0].backends[1].backend = Some(other.to_string());
            assert!(render(&input(&q, true)).is_err(), "{other}");
        }
        assert!(
            cluster["typed_extension_protocol_options"].is_null()
                && cluster["load_balancing_policy"].is_null(),
            "backends without providers: no upstream filter, Envoy's weighted round robin"
        );
    }

    /// Backends with providers: the cluster runs the filter in its upstream mode (same module
    /// and VM id as the downstream filter), then the upstream codec.
    #[test]
    fn provider_backends_get_the_upstream_filter() {
        let p = PolicyDocument::from_value(json!({
            "tiers": [{"name": "free", "level": 0, "groups": ["g"]}],
            "models": [
                {"name": "gpt", "path": "/llm/gpt", "tiers": ["free"], "upstreamCluster": "gpt-backends",
                 "backends": [
                    {"name": "a", "backend": "http://127.0.0.1:9001",
                     "provider": {"type": "openai", "credentialRef": "ka"}},
                    {"name": "b", "backend": "http://127.0.0.1:9002",
                     "provider": {"type": "openai", "credentialRef": "kb"}}
                ]}
            ]
        }))
        .unwrap();
        let v: Value = serde_json::from_str(&render(&input(&p, true)).unwrap()).unwrap();
        let cluster = v["static_resources"]["clusters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == "gpt-backends")
            .unwrap();
        let opts = &cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"];
        let filters = opts["http_filters"].as_array().unwrap();
        assert_eq!(filters.len(), 2);
        assert_eq!(filters[1]["name"], "envoy.filters.http.upstream_codec");
        let wasm = &filters[0]["typed_config"]["config"];
        let downstream = &hcm(&v)["http_filters"][0]["typed_config"]["config"];
        assert_eq!(wasm["vm_config"], downstream["vm_config"], "one VM");
        let config: Value =
            serde_json::from_str(wasm["configuration"]["value"].as_str().unwrap()).unwrap();
        assert_eq!(config["upstream"], true);
        // Envoy tries the endpoints the filter lists, in order.
        let lb = &cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"];
        assert_eq!(lb["name"], "envoy.load_balancing_policies.override_host");
        assert_eq!(
            lb["typed_config"]["override_host_sources"][0]["header"],
            maas_types::BACKEND_ORDER_HEADER
        );
        // The downstream filter is not in the upstream mode; bare Envoy has no upstream filter.
        let down: Value =
            serde_json::from_str(downstream["configuration"]["value"].as_str().unwrap()).unwrap();
        assert!(down.get("upstream").is_none());
        let bare: Value = serde_json::from_str(&render(&input(&p, false)).unwrap()).unwrap();
        assert!(
            bare["static_resources"]["clusters"]
                .as_array()
                .unwrap()
                .iter()
                .all(|c| c["typed_extension_protocol_options"].is_null())
        );
    }

    #[test]
    fn upstream_cluster_names_the_models_cluster() {
        let p = PolicyDocument::from_value(json!({
            "tiers": [{"name": "free", "level": 0, "groups": ["g"]}],
            "models": [
                {"name": "sim", "path": "/llm/sim", "tiers": ["free"]},
                {"name": "ext", "path": "/ext/gpt", "tiers": ["free"], "backend": "simulator",
                 "provider": {"type": "openai", "credentialRef": "k"}, "upstreamCluster": "backend-0"},
                {"name": "ext2", "path": "/ext/gpt2", "tiers": ["free"], "backend": "simulator",
                 "provider": {"type": "openai", "credentialRef": "k"}, "upstreamCluster": "backend-0"},
                {"name": "oai", "path": "/ext/oai", "tiers": ["free"], "backend": "https://api.openai.com/v1",
                 "provider": {"type": "openai", "credentialRef": "k"}, "upstreamCluster": "outbound|443||api.openai.com"},
                {"name": "url", "path": "/llm/url", "tiers": ["free"], "backend": "http://127.0.0.1:9000"}
            ]
        }))
        .unwrap();
        let v: Value = serde_json::from_str(&render(&input(&p, true)).unwrap()).unwrap();
        let r = routes(&v);
        let cluster_of = |prefix: &str| {
            r.iter()
                .find(|x| x["match"]["prefix"] == prefix)
                .map(|x| x["route"]["cluster"].as_str().unwrap().to_string())
                .unwrap()
        };
        assert_eq!(cluster_of("/ext/gpt/"), "backend-0");
        assert_eq!(cluster_of("/ext/gpt2/"), "backend-0", "one cluster, shared");
        assert_eq!(cluster_of("/ext/oai/"), "outbound|443||api.openai.com");
        assert_eq!(cluster_of("/llm/sim/"), SIMULATOR_CLUSTER);
        let generated = cluster_of("/llm/url/");
        assert_ne!(
            generated, "backend-0",
            "generated names avoid explicit ones"
        );
        let clusters = v["static_resources"]["clusters"].as_array().unwrap();
        let by_name = |n: &str| {
            clusters
                .iter()
                .filter(|c| c["name"] == n)
                .collect::<Vec<_>>()
        };
        assert_eq!(by_name("backend-0").len(), 1);
        assert_eq!(
            by_name("backend-0")[0]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
                ["address"]["socket_address"]["port_value"],
            7003,
            "a simulator model's named cluster reaches the simulator"
        );
        let oai = by_name("outbound|443||api.openai.com");
        assert_eq!(
            oai[0]["transport_socket"]["typed_config"]["sni"],
            "api.openai.com"
        );
        assert_eq!(by_name(&generated).len(), 1);

        // One name, two backends; or a companion cluster's name: refused.
        for (backend, name) in [
            ("http://127.0.0.1:9999", "backend-0"),
            ("simulator", COMPANION_INTERNAL_CLUSTER),
        ] {
            let mut doc = p.clone();
            doc.models[4].backend = Some(backend.to_string());
            doc.models[4].upstream_cluster = Some(name.to_string());
            assert!(render(&input(&doc, true)).is_err(), "{backend} {name}");
        }
    }

    #[test]
    fn routes_and_clusters_can_be_added_to_a_rendered_config() {
        let p = policy();
        let mut v: Value = serde_json::from_str(&render(&input(&p, true)).unwrap()).unwrap();
        let n = routes_mut(&mut v).unwrap().len();
        routes_mut(&mut v).unwrap().insert(
            0,
            json!({"match": {"prefix": "/x"}, "route": {"cluster": "extra"}}),
        );
        add_addr_cluster(&mut v, "extra", SocketAddr::from(([127, 0, 0, 1], 9))).unwrap();
        assert_eq!(routes(&v).len(), n + 1);
        assert_eq!(routes(&v)[0]["route"]["cluster"], "extra");
        assert!(add_addr_cluster(&mut v, "extra", SocketAddr::from(([127, 0, 0, 1], 9))).is_err());
    }

    #[test]
    fn node_id_is_set_and_the_rest_kept() {
        let p = policy();
        let rendered = render(&input(&p, true)).unwrap();
        let with = with_node_id(&rendered, "gateway-3").unwrap();
        let mut v: Value = serde_json::from_str(&with).unwrap();
        assert_eq!(v["node"]["id"], "gateway-3");
        assert_eq!(v["node"]["cluster"], NODE_CLUSTER);
        v.as_object_mut().unwrap().remove("node");
        assert_eq!(v, serde_json::from_str::<Value>(&rendered).unwrap());
    }

    #[test]
    fn tracing_exports_to_the_receiver_with_the_filters_attributes_as_tags() {
        let p = policy();
        let mut v: Value = serde_json::from_str(&render(&input(&p, true)).unwrap()).unwrap();
        enable_tracing(&mut v, "http://127.0.0.1:4318/v1/traces").unwrap();
        let t = &hcm(&v)["tracing"];
        assert_eq!(t["provider"]["name"], "envoy.tracers.opentelemetry");
        let uri = &t["provider"]["typed_config"]["http_service"]["http_uri"];
        assert_eq!(uri["uri"], "http://127.0.0.1:4318/v1/traces");
        assert_eq!(uri["cluster"], TRACES_CLUSTER);
        let tags = t["custom_tags"].as_array().unwrap();
        assert_eq!(tags.len(), TRACE_ATTRIBUTES.len());
        assert_eq!(tags[2]["tag"], "maas.user");
        assert_eq!(tags[2]["value"], "%FILTER_STATE(wasm.maas.user:PLAIN)%");
        let clusters = v["static_resources"]["clusters"].as_array().unwrap();
        assert!(clusters.iter().any(|c| c["name"] == TRACES_CLUSTER));
    }

    #[test]
    fn bare_envoy_has_only_the_router() {
        let p = policy();
        let v: Value = serde_json::from_str(&render(&input(&p, false)).unwrap()).unwrap();
        let filters = hcm(&v)["http_filters"].as_array().unwrap();
        assert_eq!(filters.len(), 1);
        assert_eq!(filters[0]["name"], "envoy.filters.http.router");
    }

    #[test]
    fn backend_urls() {
        assert_eq!(
            BackendUrl::parse("http://localhost:11434").unwrap(),
            BackendUrl {
                tls: false,
                host: "localhost".into(),
                port: 11434,
                base_path: String::new()
            }
        );
        assert_eq!(
            BackendUrl::parse("https://api.openai.com/v1").unwrap(),
            BackendUrl {
                tls: true,
                host: "api.openai.com".into(),
                port: 443,
                base_path: "/v1".into()
            }
        );
        assert_eq!(BackendUrl::parse("http://[::1]:8000").unwrap().host, "::1");
        assert!(BackendUrl::parse("ftp://x").is_err());
        assert!(BackendUrl::parse("http://x:notaport").is_err());
        assert!(BackendUrl::parse("http://:80").is_err());
    }
}
