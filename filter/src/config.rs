//! The filter's pluginConfig (JSON: the Wasm filter config's `configuration`; on the cluster in
//! the EnvoyFilter maas-filter).
//!
//! A config that does not parse or validate makes `on_configure` fail with an error naming the
//! field: a broken filter must not start and let traffic through.

use maas_types::PolicyDocument;
use serde::Deserialize;

/// Largest request body the filter buffers to read `model` / `max_tokens` (larger → 413).
pub const DEFAULT_MAX_REQUEST_BODY_BYTES: u64 = 1024 * 1024;

#[derive(Debug, Clone, PartialEq)]
pub struct PluginConfig {
    pub companion: CompanionConfig,
    pub poll_interval_ms: u64,
    pub cache: CacheConfig,
    pub limits: LimitsConfig,
    /// Extra request headers removed before forwarding (lower case).
    pub remove_headers: Vec<String>,
    pub management_path_prefix: String,
    pub failure_mode: FailureMode,
    pub max_request_body_bytes: u64,
    /// Hold a request's headers until its body has been read and decided. Only with Envoy's
    /// Wasm `allow_on_headers_stop_iteration: true`: without it Envoy never hands a held body
    /// over, which each worker finds out at its first held body (`request::probe_held_headers`)
    /// and then lets headers go on first. Off: headers go upstream once the caller is
    /// authorised and body-stage refusals reset that upstream request.
    pub pause_headers_for_body: bool,
    pub bootstrap_policy: Option<PolicyDocument>,
    pub usage: UsageConfig,
    /// The upstream mode (`upstream: true`): this instance is an upstream HTTP filter of a
    /// model's backends cluster and only sets the chosen backend's provider credential per
    /// attempt (`crate::upstream`); it never authenticates, meters or reads bodies, and polls
    /// only the policy and the credentials.
    pub upstream: bool,
}

/// `usage`: each worker's usage reports to the companion's ledger (`POST /internal/v1/usage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UsageConfig {
    pub enabled: bool,
    /// One report (at most 1024 records) per worker per interval.
    pub report_interval_ms: u64,
    /// Records a worker holds at most (open, in flight or kept for a resend): beyond, the
    /// oldest open ones are dropped (`maas_usage_records_dropped_total`).
    pub max_pending_records: usize,
}

impl Default for UsageConfig {
    fn default() -> Self {
        UsageConfig {
            enabled: true,
            report_interval_ms: 5000,
            max_pending_records: 10_000,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompanionConfig {
    /// Envoy cluster name of the companion's internal listener.
    pub cluster: String,
    /// `:authority` sent on callouts.
    pub authority: String,
    pub timeout_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    pub max_entries: u64,
    pub max_ttl_seconds: u64,
    pub negative_ttl_seconds: u64,
}

/// Counters (`limits.*`): subjects hash into `counter_slots` fixed shared-data keys.
#[derive(Debug, Clone, PartialEq)]
pub struct LimitsConfig {
    pub counter_slots: u64,
    pub global: GlobalConfig,
}

/// `limits.global`: limits that hold across gateway replicas (budget leases from the companion).
#[derive(Debug, Clone, PartialEq)]
pub struct GlobalConfig {
    pub enabled: bool,
    /// Each worker's batch of debts, releases and renewals, and the fallback probe.
    pub report_interval_ms: u64,
    /// Prefetch: a lease is sized by the replica's rate × this.
    pub lease_horizon_ms: u64,
    /// A subject unused this long hands its unused lease back.
    pub idle_release_ms: u64,
    pub on_unavailable: OnUnavailable,
    /// Local share of a limit in fallback (0 < f ≤ 1); `None`: 1 ÷ the replicas assumed.
    pub fallback_fraction: Option<f64>,
    /// The Gateway's replica count (with an autoscaler, its maximum): in fallback a replica
    /// assumes at least this many, whatever the last answer counted. `None` (and no
    /// `fallback_fraction`): no safe share is known, so a short lease in fallback is refused.
    pub replicas: Option<u32>,
    /// This replica's id; `None`: Envoy's `node.id`, else an id drawn at start.
    pub replica_id: Option<String>,
}

/// `limits.global.replicas` at most (a Gateway runs far fewer).
pub const MAX_GATEWAY_REPLICAS: u64 = 10_000;

impl Default for GlobalConfig {
    fn default() -> Self {
        GlobalConfig {
            enabled: true,
            report_interval_ms: 1000,
            lease_horizon_ms: 2000,
            idle_release_ms: 3000,
            on_unavailable: OnUnavailable::Fallback,
            fallback_fraction: None,
            replicas: None,
            replica_id: None,
        }
    }
}

/// `limits.global.onUnavailable`: what a replica does while the companion (or its store) cannot
/// be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnUnavailable {
    /// Admit within the local share of each limit.
    Fallback,
    /// 503 `limits_unavailable` for a request whose lease is short.
    Refuse,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FailureMode {
    /// Companion unreachable and nothing cached → 503. The only mode: the filter never fails open.
    Closed,
}

/// A refused config: the field (`companion.timeoutMs`) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.field.is_empty() || self.field == "." {
            write!(f, "pluginConfig: {}", self.message)
        } else {
            write!(f, "pluginConfig.{}: {}", self.field, self.message)
        }
    }
}

impl std::error::Error for ConfigError {}

fn err(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        message: message.into(),
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawConfig {
    companion: RawCompanion,
    poll_interval_ms: Option<u64>,
    #[serde(default)]
    cache: RawCache,
    #[serde(default)]
    limits: RawLimits,
    #[serde(default)]
    remove_headers: Vec<String>,
    management_path_prefix: Option<String>,
    failure_mode: Option<FailureMode>,
    max_request_body_bytes: Option<u64>,
    #[serde(default)]
    pause_headers_for_body: bool,
    bootstrap_policy: Option<serde_json::Value>,
    #[serde(default)]
    usage: RawUsage,
    #[serde(default)]
    upstream: bool,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawUsage {
    enabled: Option<bool>,
    report_interval_ms: Option<u64>,
    max_pending_records: Option<u64>,
}

fn usage_config(raw: RawUsage) -> Result<UsageConfig, ConfigError> {
    let d = UsageConfig::default();
    let max_pending = in_range(
        "usage.maxPendingRecords",
        raw.max_pending_records
            .unwrap_or(d.max_pending_records as u64),
        maas_types::usage::MAX_USAGE_RECORDS as u64,
        1_000_000,
    )?;
    Ok(UsageConfig {
        enabled: raw.enabled.unwrap_or(d.enabled),
        report_interval_ms: in_range(
            "usage.reportIntervalMs",
            raw.report_interval_ms.unwrap_or(d.report_interval_ms),
            100,
            3_600_000,
        )?,
        max_pending_records: usize::try_from(max_pending).unwrap_or(d.max_pending_records),
    })
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawCompanion {
    cluster: String,
    authority: Option<String>,
    timeout_ms: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawCache {
    max_entries: Option<u64>,
    max_ttl_seconds: Option<u64>,
    negative_ttl_seconds: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawLimits {
    counter_slots: Option<u64>,
    #[serde(default)]
    global: RawGlobal,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawGlobal {
    enabled: Option<bool>,
    report_interval_ms: Option<u64>,
    lease_horizon_ms: Option<u64>,
    idle_release_ms: Option<u64>,
    on_unavailable: Option<OnUnavailable>,
    fallback_fraction: Option<f64>,
    replicas: Option<u64>,
    replica_id: Option<String>,
}

fn global_config(raw: RawGlobal) -> Result<GlobalConfig, ConfigError> {
    let d = GlobalConfig::default();
    let fallback_fraction = match raw.fallback_fraction {
        Some(f) if !(f > 0.0 && f <= 1.0) => {
            return Err(err(
                "limits.global.fallbackFraction",
                format!("must be above 0 and at most 1, got {f}"),
            ));
        }
        f => f,
    };
    let replica_id = match raw.replica_id {
        Some(id)
            if id.is_empty()
                || id.len() > 256
                || id.bytes().any(|b| b.is_ascii_control() || b == b' ') =>
        {
            return Err(err(
                "limits.global.replicaId",
                "must be 1 to 256 bytes without spaces or control characters",
            ));
        }
        id => id,
    };
    let replicas = match raw.replicas {
        Some(n) => Some(
            u32::try_from(in_range(
                "limits.global.replicas",
                n,
                1,
                MAX_GATEWAY_REPLICAS,
            )?)
            .map_err(|_| err("limits.global.replicas", "out of range"))?,
        ),
        None => None,
    };
    Ok(GlobalConfig {
        enabled: raw.enabled.unwrap_or(d.enabled),
        report_interval_ms: in_range(
            "limits.global.reportIntervalMs",
            raw.report_interval_ms.unwrap_or(d.report_interval_ms),
            100,
            60_000,
        )?,
        lease_horizon_ms: in_range(
            "limits.global.leaseHorizonMs",
            raw.lease_horizon_ms.unwrap_or(d.lease_horizon_ms),
            100,
            3_600_000,
        )?,
        idle_release_ms: in_range(
            "limits.global.idleReleaseMs",
            raw.idle_release_ms.unwrap_or(d.idle_release_ms),
            100,
            3_600_000,
        )?,
        on_unavailable: raw.on_unavailable.unwrap_or(d.on_unavailable),
        fallback_fraction,
        replicas,
        replica_id,
    })
}

fn in_range(field: &str, value: u64, min: u64, max: u64) -> Result<u64, ConfigError> {
    if value < min || value > max {
        return Err(err(
            field,
            format!("must be between {min} and {max}, got {value}"),
        ));
    }
    Ok(value)
}

fn is_token_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// `companion`: the cluster (also the callouts' default `:authority`, so neither may hold
/// spaces or control characters), the authority, the timeout.
fn companion_config(raw: RawCompanion) -> Result<CompanionConfig, ConfigError> {
    let cluster = raw.cluster.trim().to_string();
    if cluster.is_empty() {
        return Err(err("companion.cluster", "must not be empty"));
    }
    if cluster.bytes().any(|b| b.is_ascii_control() || b == b' ') {
        return Err(err(
            "companion.cluster",
            "must not hold spaces or control characters",
        ));
    }
    let authority = match raw.authority {
        Some(a) if a.trim().is_empty() || a.bytes().any(|b| b.is_ascii_control() || b == b' ') => {
            return Err(err(
                "companion.authority",
                "must not be empty or hold spaces or control characters",
            ));
        }
        Some(a) => a,
        None => cluster.clone(),
    };
    let timeout_ms = in_range(
        "companion.timeoutMs",
        raw.timeout_ms.unwrap_or(1000),
        1,
        60_000,
    )?;
    Ok(CompanionConfig {
        cluster,
        authority,
        timeout_ms,
    })
}

fn cache_config(raw: &RawCache) -> Result<CacheConfig, ConfigError> {
    Ok(CacheConfig {
        max_entries: in_range(
            "cache.maxEntries",
            raw.max_entries.unwrap_or(100_000),
            1,
            10_000_000,
        )?,
        max_ttl_seconds: in_range(
            "cache.maxTtlSeconds",
            raw.max_ttl_seconds.unwrap_or(300),
            0,
            86_400,
        )?,
        negative_ttl_seconds: in_range(
            "cache.negativeTtlSeconds",
            raw.negative_ttl_seconds.unwrap_or(5),
            0,
            3_600,
        )?,
    })
}

/// `removeHeaders`: header names (lower-cased), never the ones framing the request.
fn remove_headers(names: &[String]) -> Result<Vec<String>, ConfigError> {
    let mut out = Vec::with_capacity(names.len());
    for (i, h) in names.iter().enumerate() {
        let field = format!("removeHeaders[{i}]");
        if h.is_empty() || !h.bytes().all(is_token_char) {
            return Err(err(field, format!("{h:?} is not a header name")));
        }
        let lower = h.to_ascii_lowercase();
        if matches!(
            lower.as_str(),
            "host" | "content-length" | "transfer-encoding"
        ) {
            return Err(err(field, format!("{lower} cannot be removed")));
        }
        out.push(lower);
    }
    Ok(out)
}

fn management_path_prefix(raw: Option<String>) -> Result<String, ConfigError> {
    let prefix = raw.unwrap_or_else(|| "/maas-api".to_string());
    if !prefix.starts_with('/')
        || prefix.len() < 2
        || prefix.ends_with('/')
        || !prefix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'/' | b'-' | b'_' | b'.'))
        || prefix.contains("//")
    {
        return Err(err(
            "managementPathPrefix",
            "must be an absolute path like /maas-api, without a trailing '/'",
        ));
    }
    Ok(prefix)
}

/// `bootstrapPolicy`: a policy document both sides accept; errors name the field under it.
fn bootstrap_policy(raw: Option<serde_json::Value>) -> Result<Option<PolicyDocument>, ConfigError> {
    match raw {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => PolicyDocument::from_value(v).map(Some).map_err(|e| {
            let field = if e.path.is_empty() || e.path == "." {
                "bootstrapPolicy".to_string()
            } else {
                format!("bootstrapPolicy.{}", e.path)
            };
            err(field, e.message)
        }),
    }
}

impl PluginConfig {
    /// Parses and validates pluginConfig JSON. The error names the field.
    pub fn parse(bytes: &[u8]) -> Result<PluginConfig, ConfigError> {
        let mut de = serde_json::Deserializer::from_slice(bytes);
        let raw: RawConfig = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let path = e.path().to_string();
            let path = if path == "." { String::new() } else { path };
            err(path, e.inner().to_string())
        })?;
        de.end().map_err(|e| err("", e.to_string()))?;

        let companion = companion_config(raw.companion)?;
        let poll_interval_ms = in_range(
            "pollIntervalMs",
            raw.poll_interval_ms.unwrap_or(2000),
            100,
            3_600_000,
        )?;
        let cache = cache_config(&raw.cache)?;
        let limits = LimitsConfig {
            counter_slots: in_range(
                "limits.counterSlots",
                raw.limits
                    .counter_slots
                    .unwrap_or(crate::limits::DEFAULT_COUNTER_SLOTS),
                1,
                10_000_000,
            )?,
            global: global_config(raw.limits.global)?,
        };
        let remove_headers = remove_headers(&raw.remove_headers)?;
        let management_path_prefix = management_path_prefix(raw.management_path_prefix)?;
        let max_request_body_bytes = in_range(
            "maxRequestBodyBytes",
            raw.max_request_body_bytes
                .unwrap_or(DEFAULT_MAX_REQUEST_BODY_BYTES),
            1024,
            64 * 1024 * 1024,
        )?;
        let bootstrap_policy = bootstrap_policy(raw.bootstrap_policy)?;
        Ok(PluginConfig {
            companion,
            poll_interval_ms,
            cache,
            limits,
            remove_headers,
            management_path_prefix,
            failure_mode: raw.failure_mode.unwrap_or(FailureMode::Closed),
            max_request_body_bytes,
            pause_headers_for_body: raw.pause_headers_for_body,
            bootstrap_policy,
            usage: usage_config(raw.usage)?,
            upstream: raw.upstream,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn parse(v: serde_json::Value) -> Result<PluginConfig, ConfigError> {
        PluginConfig::parse(v.to_string().as_bytes())
    }

    fn fails_at(v: serde_json::Value, field: &str) {
        match parse(v) {
            Ok(_) => panic!("expected an error at {field}"),
            Err(e) => assert_eq!(e.field, field, "{e}"),
        }
    }

    #[test]
    fn minimal_gets_defaults() {
        let c = parse(json!({"companion": {"cluster": "maas-companion"}})).unwrap();
        assert_eq!(c.companion.authority, "maas-companion");
        assert_eq!(c.companion.timeout_ms, 1000);
        assert_eq!(c.poll_interval_ms, 2000);
        assert_eq!(c.cache.max_entries, 100_000);
        assert_eq!(c.cache.max_ttl_seconds, 300);
        assert_eq!(c.cache.negative_ttl_seconds, 5);
        assert_eq!(c.limits.counter_slots, 65_536);
        assert_eq!(c.management_path_prefix, "/maas-api");
        assert_eq!(c.failure_mode, FailureMode::Closed);
        assert!(c.bootstrap_policy.is_none());
        assert!(!c.pause_headers_for_body);
        let c = parse(json!({"companion": {"cluster": "c"}, "pauseHeadersForBody": true})).unwrap();
        assert!(c.pause_headers_for_body);
        fails_at(
            json!({"companion": {"cluster": "c"}, "pauseHeadersForBody": "yes"}),
            "pauseHeadersForBody",
        );
        assert!(!c.upstream, "the downstream filter by default");
        let c = parse(json!({"companion": {"cluster": "c"}, "upstream": true})).unwrap();
        assert!(c.upstream);
        fails_at(
            json!({"companion": {"cluster": "c"}, "upstream": "yes"}),
            "upstream",
        );
    }

    #[test]
    fn full_contract_example_parses() {
        let c = parse(json!({
          "companion": {"cluster": "maas-companion", "authority": "maas-companion.maas-api.svc.cluster.local", "timeoutMs": 250},
          "pollIntervalMs": 500,
          "cache": {"maxEntries": 10, "maxTtlSeconds": 60, "negativeTtlSeconds": 1},
          "removeHeaders": ["Cookie"],
          "managementPathPrefix": "/api",
          "failureMode": "closed",
          "bootstrapPolicy": {"tiers": [{"name": "free", "level": 0, "groups": ["g"]}], "models": []}
        }))
        .unwrap();
        assert_eq!(c.remove_headers, vec!["cookie".to_string()]);
        assert_eq!(c.companion.timeout_ms, 250);
        assert_eq!(c.bootstrap_policy.unwrap().tiers[0].name, "free");
    }

    #[test]
    fn usage_reports_default_on_every_5_s_and_bad_fields_are_refused_by_name() {
        let c = parse(json!({"companion": {"cluster": "c"}})).unwrap();
        assert_eq!(c.usage, UsageConfig::default());
        assert!(c.usage.enabled);
        assert_eq!(c.usage.report_interval_ms, 5000);
        assert_eq!(c.usage.max_pending_records, 10_000);
        let c = parse(json!({"companion": {"cluster": "c"}, "usage": {
            "enabled": false, "reportIntervalMs": 250, "maxPendingRecords": 2048}}))
        .unwrap();
        assert_eq!(
            c.usage,
            UsageConfig {
                enabled: false,
                report_interval_ms: 250,
                max_pending_records: 2048
            }
        );
        let u = |v: serde_json::Value| json!({"companion": {"cluster": "c"}, "usage": v});
        fails_at(u(json!({"enabled": 1})), "usage.enabled");
        fails_at(u(json!({"reportIntervalMs": 99})), "usage.reportIntervalMs");
        fails_at(u(json!({"reportIntervalMs": -1})), "usage.reportIntervalMs");
        fails_at(
            u(json!({"reportIntervalMs": 3_600_001})),
            "usage.reportIntervalMs",
        );
        fails_at(
            u(json!({"maxPendingRecords": 1023})),
            "usage.maxPendingRecords",
        );
        fails_at(u(json!({"interval": 1})), "usage.interval");
        fails_at(u(json!(true)), "usage");
    }

    #[test]
    fn global_limits_default_on_and_parse() {
        let c = parse(json!({"companion": {"cluster": "c"}})).unwrap();
        assert_eq!(c.limits.global, GlobalConfig::default());
        assert!(c.limits.global.enabled);
        assert_eq!(c.limits.global.report_interval_ms, 1000);
        assert_eq!(c.limits.global.lease_horizon_ms, 2000);
        assert_eq!(c.limits.global.idle_release_ms, 3000);
        assert_eq!(c.limits.global.on_unavailable, OnUnavailable::Fallback);
        let c = parse(json!({"companion": {"cluster": "c"}, "limits": {"global": {
            "enabled": false, "reportIntervalMs": 250, "leaseHorizonMs": 5000,
            "idleReleaseMs": 10000, "onUnavailable": "refuse", "fallbackFraction": 0.5,
            "replicas": 3, "replicaId": "gw-1"}}}))
        .unwrap();
        let g = &c.limits.global;
        assert!(!g.enabled);
        assert_eq!(
            (g.report_interval_ms, g.lease_horizon_ms, g.idle_release_ms),
            (250, 5000, 10000)
        );
        assert_eq!(g.on_unavailable, OnUnavailable::Refuse);
        assert_eq!(g.fallback_fraction, Some(0.5));
        assert_eq!(g.replicas, Some(3));
        assert_eq!(g.replica_id.as_deref(), Some("gw-1"));
        assert_eq!(parse(to_json(&c)).unwrap(), c);
        // null is unset (the local stack's tests remove the count that way).
        let c = parse(json!({"companion": {"cluster": "c"}, "limits": {"global": {
            "replicas": null}}}))
        .unwrap();
        assert_eq!(c.limits.global.replicas, None);
    }

    #[test]
    fn every_bad_global_limits_field_is_refused_by_name() {
        let g =
            |v: serde_json::Value| json!({"companion": {"cluster": "c"}, "limits": {"global": v}});
        fails_at(g(json!({"enabled": "yes"})), "limits.global.enabled");
        fails_at(
            g(json!({"reportIntervalMs": 0})),
            "limits.global.reportIntervalMs",
        );
        fails_at(
            g(json!({"reportIntervalMs": 60_001})),
            "limits.global.reportIntervalMs",
        );
        fails_at(
            g(json!({"leaseHorizonMs": 99})),
            "limits.global.leaseHorizonMs",
        );
        fails_at(
            g(json!({"idleReleaseMs": 3_600_001})),
            "limits.global.idleReleaseMs",
        );
        fails_at(
            g(json!({"onUnavailable": "open"})),
            "limits.global.onUnavailable",
        );
        fails_at(
            g(json!({"fallbackFraction": 0})),
            "limits.global.fallbackFraction",
        );
        fails_at(
            g(json!({"fallbackFraction": 1.5})),
            "limits.global.fallbackFraction",
        );
        fails_at(
            g(json!({"fallbackFraction": -0.1})),
            "limits.global.fallbackFraction",
        );
        fails_at(
            g(json!({"fallbackFraction": "half"})),
            "limits.global.fallbackFraction",
        );
        for bad in [json!(0), json!(10_001), json!(-1), json!(1.5), json!("two")] {
            fails_at(g(json!({ "replicas": bad })), "limits.global.replicas");
        }
        fails_at(g(json!({"replicaId": ""})), "limits.global.replicaId");
        fails_at(g(json!({"replicaId": "a b"})), "limits.global.replicaId");
        fails_at(
            g(json!({"replicaId": "x".repeat(257)})),
            "limits.global.replicaId",
        );
        fails_at(g(json!({"leases": 1})), "limits.global.leases");
        fails_at(g(json!("on")), "limits.global");
    }

    #[test]
    fn errors_name_the_field() {
        fails_at(json!({}), "");
        fails_at(json!({"companion": {"cluster": ""}}), "companion.cluster");
        // Found by mutated_config_is_valid_or_refused_naming_a_field: the cluster is the default
        // authority, so it may not hold what an authority may not.
        fails_at(
            json!({"companion": {"cluster": "m aas"}}),
            "companion.cluster",
        );
        fails_at(
            json!({"companion": {"cluster": "c\u{1}", "authority": "a"}}),
            "companion.cluster",
        );
        fails_at(
            json!({"companion": {"cluster": "c", "timeoutMs": 0}}),
            "companion.timeoutMs",
        );
        fails_at(
            json!({"companion": {"cluster": "c", "timeoutMs": "fast"}}),
            "companion.timeoutMs",
        );
        fails_at(
            json!({"companion": {"cluster": "c"}, "pollIntervalMs": 5}),
            "pollIntervalMs",
        );
        fails_at(
            json!({"companion": {"cluster": "c"}, "cache": {"maxEntries": 0}}),
            "cache.maxEntries",
        );
        fails_at(
            json!({"companion": {"cluster": "c"}, "cache": {"ttl": 1}}),
            "cache.ttl",
        );
        fails_at(
            json!({"companion": {"cluster": "c"}, "limits": {"counterSlots": 0}}),
            "limits.counterSlots",
        );
        fails_at(
            json!({"companion": {"cluster": "c"}, "limits": {"counterSlots": 10_000_001}}),
            "limits.counterSlots",
        );
        fails_at(
            json!({"companion": {"cluster": "c"}, "limits": {"slots": 1}}),
            "limits.slots",
        );
        fails_at(
            json!({"companion": {"cluster": "c"}, "removeHeaders": ["ok", "bad header"]}),
            "removeHeaders[1]",
        );
        fails_at(
            json!({"companion": {"cluster": "c"}, "managementPathPrefix": "maas-api/"}),
            "managementPathPrefix",
        );
        fails_at(
            json!({"companion": {"cluster": "c"}, "failureMode": "open"}),
            "failureMode",
        );
        fails_at(
            json!({"companion": {"cluster": "c"}, "bootstrapPolicy": {"tiers": [{"name": "free", "level": 0, "groups": []}]}}),
            "bootstrapPolicy.tiers[0].groups",
        );
        fails_at(
            json!({"companion": {"cluster": "c"}, "bootstrapPolicy": {"tiers": [{"name": "free", "level": "x", "groups": ["g"]}]}}),
            "bootstrapPolicy.tiers[0].level",
        );
        fails_at(json!({"companion": {"cluster": "c"}, "extra": 1}), "extra");
        let e = PluginConfig::parse(b"{not json").unwrap_err();
        assert!(e.to_string().starts_with("pluginConfig"), "{e}");
        let e = PluginConfig::parse(b"{\"companion\":{\"cluster\":\"c\"}} x").unwrap_err();
        assert!(!e.message.is_empty());
    }

    /// The pluginConfig JSON that parses back to `c` (every field spelled out).
    fn to_json(c: &PluginConfig) -> serde_json::Value {
        let mut v = json!({
            "companion": {
                "cluster": c.companion.cluster,
                "authority": c.companion.authority,
                "timeoutMs": c.companion.timeout_ms,
            },
            "pollIntervalMs": c.poll_interval_ms,
            "cache": {
                "maxEntries": c.cache.max_entries,
                "maxTtlSeconds": c.cache.max_ttl_seconds,
                "negativeTtlSeconds": c.cache.negative_ttl_seconds,
            },
            "limits": {"counterSlots": c.limits.counter_slots, "global": {
                "enabled": c.limits.global.enabled,
                "reportIntervalMs": c.limits.global.report_interval_ms,
                "leaseHorizonMs": c.limits.global.lease_horizon_ms,
                "idleReleaseMs": c.limits.global.idle_release_ms,
                "onUnavailable": match c.limits.global.on_unavailable {
                    OnUnavailable::Fallback => "fallback",
                    OnUnavailable::Refuse => "refuse",
                },
                "fallbackFraction": c.limits.global.fallback_fraction,
                "replicas": c.limits.global.replicas,
                "replicaId": c.limits.global.replica_id,
            }},
            "removeHeaders": c.remove_headers,
            "managementPathPrefix": c.management_path_prefix,
            "failureMode": "closed",
            "maxRequestBodyBytes": c.max_request_body_bytes,
            "pauseHeadersForBody": c.pause_headers_for_body,
            "usage": {
                "enabled": c.usage.enabled,
                "reportIntervalMs": c.usage.report_interval_ms,
                "maxPendingRecords": c.usage.max_pending_records,
            },
        });
        if let Some(p) = &c.bootstrap_policy {
            v["bootstrapPolicy"] = serde_json::to_value(p).unwrap();
        }
        v
    }

    /// What every accepted config satisfies.
    fn assert_valid(c: &PluginConfig) {
        let a = &c.companion;
        assert!(
            !a.cluster.is_empty() && a.cluster.trim() == a.cluster,
            "{c:?}"
        );
        assert!(!a.authority.trim().is_empty(), "{c:?}");
        assert!(
            !a.authority
                .bytes()
                .any(|b| b.is_ascii_control() || b == b' '),
            "{c:?}"
        );
        assert!((1..=60_000).contains(&a.timeout_ms), "{c:?}");
        assert!((100..=3_600_000).contains(&c.poll_interval_ms), "{c:?}");
        assert!((1..=10_000_000).contains(&c.cache.max_entries), "{c:?}");
        assert!(c.cache.max_ttl_seconds <= 86_400, "{c:?}");
        assert!(c.cache.negative_ttl_seconds <= 3_600, "{c:?}");
        assert!((1..=10_000_000).contains(&c.limits.counter_slots), "{c:?}");
        assert!(
            (1024..=64 * 1024 * 1024).contains(&c.max_request_body_bytes),
            "{c:?}"
        );
        for h in &c.remove_headers {
            assert!(!h.is_empty() && h.bytes().all(is_token_char), "{c:?}");
            assert_eq!(*h, h.to_ascii_lowercase());
            assert!(!["host", "content-length", "transfer-encoding"].contains(&h.as_str()));
        }
        let p = &c.management_path_prefix;
        assert!(p.starts_with('/') && p.len() >= 2 && !p.ends_with('/') && !p.contains("//"));
        if let Some(policy) = &c.bootstrap_policy {
            policy.validate().unwrap();
        }
        // Accepted means stable: what it says parses back to the same config.
        assert_eq!(parse(to_json(c)).as_ref(), Ok(c));
    }

    /// A refusal names where: a field path, or (for the document as a whole) the JSON position or
    /// the missing field.
    fn assert_names_field(e: &ConfigError, input: &[u8]) {
        let text = e.to_string();
        let input = String::from_utf8_lossy(input);
        assert!(!e.message.is_empty(), "{input}");
        if e.field.is_empty() {
            assert!(text.starts_with("pluginConfig: "), "{text} for {input}");
            assert!(
                e.message.contains(" line ") || e.message.contains("field `"),
                "a whole-document error says where or which field: {text} for {input}"
            );
        } else {
            assert!(
                text.starts_with(&format!("pluginConfig.{}: ", e.field)),
                "{text} for {input}"
            );
        }
    }

    const SEEDS: &[&str] = &[
        r#"{"companion":{"cluster":"maas-companion"}}"#,
        r#"{"companion":{"cluster":"maas-companion","authority":"maas-companion.maas-api.svc.cluster.local","timeoutMs":250},"pollIntervalMs":500,"cache":{"maxEntries":10,"maxTtlSeconds":60,"negativeTtlSeconds":1},"limits":{"counterSlots":4096},"removeHeaders":["Cookie","x-debug"],"managementPathPrefix":"/api","failureMode":"closed","maxRequestBodyBytes":4096,"pauseHeadersForBody":true,"bootstrapPolicy":{"tiers":[{"name":"free","level":0,"groups":["g"],"limits":{"requests":[{"limit":5,"window":"1m"}],"tokens":[{"limit":100,"window":"1h"}]}}],"models":[{"name":"m","path":"/llm/m","tiers":["free"]}]}}"#,
    ];

    #[test]
    fn seeds_are_valid() {
        for s in SEEDS {
            assert_valid(&PluginConfig::parse(s.as_bytes()).unwrap());
        }
    }

    #[derive(Debug, Clone)]
    enum Mutation {
        Replace(usize, u8),
        Insert(usize, u8),
        Delete(usize),
    }

    fn json_byte() -> impl Strategy<Value = u8> {
        prop_oneof![
            any::<u8>(),
            prop::sample::select(b"{}[]\":,0123456789 -tfn/\\eE.".to_vec()),
        ]
    }

    fn mutation() -> impl Strategy<Value = Mutation> {
        prop_oneof![
            (any::<usize>(), json_byte()).prop_map(|(i, b)| Mutation::Replace(i, b)),
            (any::<usize>(), json_byte()).prop_map(|(i, b)| Mutation::Insert(i, b)),
            any::<usize>().prop_map(Mutation::Delete),
        ]
    }

    fn valid_config() -> impl Strategy<Value = PluginConfig> {
        (
            (
                "[a-z][a-z0-9_.-]{0,20}",
                proptest::option::of("[a-z0-9][a-z0-9.:-]{0,30}"),
                1u64..=60_000,
                100u64..=3_600_000,
            ),
            (1u64..=10_000_000, 0u64..=86_400, 0u64..=3_600, 1u64..=10_000_000),
            proptest::collection::vec("[a-zA-Z0-9!#$%&'*+.^_`|~-]{1,12}", 0..4),
            "(/[a-zA-Z0-9_.-]{1,8}){1,3}",
            (1024u64..=64 * 1024 * 1024, any::<bool>(), any::<bool>()),
        )
            .prop_filter_map(
                "removable headers only",
                |((cluster, authority, timeout_ms, poll), (entries, ttl, neg, slots), headers, prefix, (body, pause, policy))| {
                    let remove_headers: Vec<String> =
                        headers.iter().map(|h| h.to_ascii_lowercase()).collect();
                    if remove_headers
                        .iter()
                        .any(|h| ["host", "content-length", "transfer-encoding"].contains(&h.as_str()))
                    {
                        return None;
                    }
                    let bootstrap_policy = policy.then(|| {
                        maas_types::PolicyDocument::from_json(
                            br#"{"tiers":[{"name":"free","level":0,"groups":["g"],"limits":{"requests":[{"limit":5,"window":"1m"}]}}],"models":[{"name":"m","path":"/llm/m","tiers":["free"]}]}"#,
                        )
                        .unwrap()
                    });
                    Some(PluginConfig {
                        companion: CompanionConfig {
                            authority: authority.unwrap_or_else(|| cluster.clone()),
                            cluster,
                            timeout_ms,
                        },
                        poll_interval_ms: poll,
                        cache: CacheConfig {
                            max_entries: entries,
                            max_ttl_seconds: ttl,
                            negative_ttl_seconds: neg,
                        },
                        limits: LimitsConfig {
                            counter_slots: slots,
                            global: GlobalConfig::default(),
                        },
                        remove_headers,
                        management_path_prefix: prefix,
                        failure_mode: FailureMode::Closed,
                        max_request_body_bytes: body,
                        pause_headers_for_body: pause,
                        bootstrap_policy,
                        usage: UsageConfig::default(),
                        upstream: false,
                    })
                },
            )
    }

    proptest! {
        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(json_byte(), 0..300)) {
            if let Err(e) = PluginConfig::parse(&bytes) {
                assert_names_field(&e, &bytes);
            }
        }

        #[test]
        fn mutated_config_is_valid_or_refused_naming_a_field(
            seed in 0usize..SEEDS.len(),
            mutations in proptest::collection::vec(mutation(), 1..5),
        ) {
            let mut bytes = SEEDS[seed].as_bytes().to_vec();
            for m in mutations {
                match m {
                    Mutation::Replace(i, b) => {
                        let i = i % bytes.len().max(1);
                        if let Some(x) = bytes.get_mut(i) {
                            *x = b;
                        }
                    }
                    Mutation::Insert(i, b) => bytes.insert(i % (bytes.len() + 1), b),
                    Mutation::Delete(i) => {
                        if !bytes.is_empty() {
                            bytes.remove(i % bytes.len());
                        }
                    }
                }
            }
            match PluginConfig::parse(&bytes) {
                Ok(c) => assert_valid(&c),
                Err(e) => assert_names_field(&e, &bytes),
            }
        }

        #[test]
        fn valid_config_roundtrips(c in valid_config(), pretty in any::<bool>()) {
            let v = to_json(&c);
            let text = if pretty {
                serde_json::to_string_pretty(&v).unwrap()
            } else {
                v.to_string()
            };
            let parsed = PluginConfig::parse(text.as_bytes());
            prop_assert_eq!(parsed.as_ref(), Ok(&c));
            assert_valid(&c);
        }
    }
}
