//! The filter's pluginConfig (the WasmPlugin's `spec.pluginConfig`, JSON).
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
    /// Extra request headers removed before forwarding (lower case).
    pub remove_headers: Vec<String>,
    pub management_path_prefix: String,
    pub failure_mode: FailureMode,
    pub max_request_body_bytes: u64,
    pub bootstrap_policy: Option<PolicyDocument>,
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
    remove_headers: Vec<String>,
    management_path_prefix: Option<String>,
    failure_mode: Option<FailureMode>,
    max_request_body_bytes: Option<u64>,
    bootstrap_policy: Option<serde_json::Value>,
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

        let cluster = raw.companion.cluster.trim().to_string();
        if cluster.is_empty() {
            return Err(err("companion.cluster", "must not be empty"));
        }
        let authority = match raw.companion.authority {
            Some(a)
                if a.trim().is_empty() || a.bytes().any(|b| b.is_ascii_control() || b == b' ') =>
            {
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
            raw.companion.timeout_ms.unwrap_or(1000),
            1,
            60_000,
        )?;
        let poll_interval_ms = in_range(
            "pollIntervalMs",
            raw.poll_interval_ms.unwrap_or(2000),
            100,
            3_600_000,
        )?;
        let cache = CacheConfig {
            max_entries: in_range(
                "cache.maxEntries",
                raw.cache.max_entries.unwrap_or(100_000),
                1,
                10_000_000,
            )?,
            max_ttl_seconds: in_range(
                "cache.maxTtlSeconds",
                raw.cache.max_ttl_seconds.unwrap_or(300),
                0,
                86_400,
            )?,
            negative_ttl_seconds: in_range(
                "cache.negativeTtlSeconds",
                raw.cache.negative_ttl_seconds.unwrap_or(5),
                0,
                3_600,
            )?,
        };
        let mut remove_headers = Vec::with_capacity(raw.remove_headers.len());
        for (i, h) in raw.remove_headers.iter().enumerate() {
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
            remove_headers.push(lower);
        }
        let management_path_prefix = raw
            .management_path_prefix
            .unwrap_or_else(|| "/maas-api".to_string());
        if !management_path_prefix.starts_with('/')
            || management_path_prefix.len() < 2
            || management_path_prefix.ends_with('/')
            || !management_path_prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'/' | b'-' | b'_' | b'.'))
            || management_path_prefix.contains("//")
        {
            return Err(err(
                "managementPathPrefix",
                "must be an absolute path like /maas-api, without a trailing '/'",
            ));
        }
        let max_request_body_bytes = in_range(
            "maxRequestBodyBytes",
            raw.max_request_body_bytes
                .unwrap_or(DEFAULT_MAX_REQUEST_BODY_BYTES),
            1024,
            64 * 1024 * 1024,
        )?;
        let bootstrap_policy = match raw.bootstrap_policy {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => Some(PolicyDocument::from_value(v).map_err(|e| {
                let field = if e.path.is_empty() || e.path == "." {
                    "bootstrapPolicy".to_string()
                } else {
                    format!("bootstrapPolicy.{}", e.path)
                };
                err(field, e.message)
            })?),
        };
        Ok(PluginConfig {
            companion: CompanionConfig {
                cluster,
                authority,
                timeout_ms,
            },
            poll_interval_ms,
            cache,
            remove_headers,
            management_path_prefix,
            failure_mode: raw.failure_mode.unwrap_or(FailureMode::Closed),
            max_request_body_bytes,
            bootstrap_policy,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
        assert_eq!(c.management_path_prefix, "/maas-api");
        assert_eq!(c.failure_mode, FailureMode::Closed);
        assert!(c.bootstrap_policy.is_none());
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
    fn errors_name_the_field() {
        fails_at(json!({}), "");
        fails_at(json!({"companion": {"cluster": ""}}), "companion.cluster");
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
}
