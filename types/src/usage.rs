//! Usage reports: the filter → companion contract behind the usage ledger (`GET /v1/usage`) and
//! the chargeback metrics.
//!
//! Each filter worker adds up what it saw per (subject, key, tier, model, hour) and sends one
//! [`UsageReport`] per report interval to `POST /internal/v1/usage` ([`USAGE_PATH`], internal
//! listener only): at most [`MAX_USAGE_RECORDS`] records. The companion adds the records to its
//! hourly ledger rows. The answer is 200 [`UsageAccepted`]; 400 names the field at fault
//! ([`validate`], nothing applied: do not resend); 503 when the database cannot take the batch
//! (nothing applied: keep the batch and send it again, with the same `batchId`).
//!
//! **Idempotency.** `batchId` is unique per replica (e.g. worker id + a counter). The companion
//! records every applied `(replica, batchId)` for a day and ignores a batch it already applied
//! (answering 200 with `duplicate: true`), so a batch resent after a lost answer never counts
//! twice.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `POST` path of the usage report endpoint (internal listener only).
pub const USAGE_PATH: &str = "/internal/v1/usage";

/// Records one report may carry at most.
pub const MAX_USAGE_RECORDS: usize = 1024;

/// Longest replica id, batch id, subject, key id, tier and model name, in bytes.
pub const MAX_USAGE_ID_BYTES: usize = 1024;

/// Refusal reasons one record may carry at most.
pub const MAX_REFUSAL_REASONS: usize = 32;

/// Longest refusal reason (`[a-z0-9_]`), in bytes.
pub const MAX_REASON_BYTES: usize = 64;

/// Largest count a record may carry (exact in a JSON number, and summed in a 64-bit integer).
pub const MAX_USAGE_COUNT: u64 = (1 << 53) - 1;

/// The ledger's time unit: records are per hour.
pub const HOUR_SECONDS: u64 = 3600;

/// `POST /internal/v1/usage` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UsageReport {
    /// The reporting replica (the same id as in lease batches).
    pub replica: String,
    /// Unique per replica: a batch resent with the same id is applied once.
    pub batch_id: String,
    pub records: Vec<UsageRecord>,
}

/// What one worker saw of one (subject, key, tier, model) in one hour.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UsageRecord {
    /// The authenticated subject (the user name, as in the authenticate answer).
    pub subject: String,
    /// The API key's id (`AuthenticateResponse::key_id`); absent for a token caller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_id: Option<String>,
    /// The tier the request ran on.
    pub tier: String,
    /// The policy's model name.
    pub model: String,
    /// Unix seconds, a multiple of [`HOUR_SECONDS`]: the hour the requests ended in.
    pub hour_start: u64,
    /// Requests forwarded to the model (refused ones are in `refused`, not here).
    #[serde(default)]
    pub requests: u64,
    /// Requests the gateway refused after authentication, by the refusal's error code
    /// (`rate_limit_exceeded`, `tokens_exceed_limit`, …).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub refused: BTreeMap<String, u64>,
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub completion_tokens: u64,
    /// The part of `promptTokens` the provider served from its prompt cache (OpenAI
    /// `prompt_tokens_details.cached_tokens`, Responses `input_tokens_details.cached_tokens`,
    /// Anthropic `cache_read_input_tokens`). Optional: a filter that does not report it sends
    /// none (0), and 0 is left out.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cached_input_tokens: u64,
    /// The name of the model's backend that served these requests (one of its `backends`, as
    /// the route's [`crate::SERVED_BY_HEADER`] named it); absent for a model without backends,
    /// for refusals, and when the response named no backend of the model. A filter that sends
    /// it needs a companion that knows the field (records refuse unknown fields): upgrade the
    /// companion first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// 200 answer: how many records were applied (0 for a duplicate batch).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UsageAccepted {
    pub accepted: u64,
    /// The batch id had been applied before: nothing was added this time.
    #[serde(default)]
    pub duplicate: bool,
}

/// A refused report: the JSON field at fault (`records[3].hourStart`) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageInvalid {
    pub field: String,
    pub message: String,
}

fn invalid(field: String, why: impl std::fmt::Display) -> UsageInvalid {
    UsageInvalid {
        message: format!("{field}: {why}"),
        field,
    }
}

fn check_id(field: impl Fn() -> String, value: &str) -> Result<(), UsageInvalid> {
    if value.is_empty() {
        return Err(invalid(field(), "must not be empty"));
    }
    if value.len() > MAX_USAGE_ID_BYTES {
        return Err(invalid(
            field(),
            format_args!("must be at most {MAX_USAGE_ID_BYTES} bytes"),
        ));
    }
    if value.chars().any(char::is_control) {
        return Err(invalid(field(), "must not hold control characters"));
    }
    Ok(())
}

/// True for a refusal reason the ledger accepts: 1..=64 bytes of `[a-z0-9_]`.
pub fn is_reason(reason: &str) -> bool {
    !reason.is_empty()
        && reason.len() <= MAX_REASON_BYTES
        && reason
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// The rules of a report (no clock: the companion checks `hourStart` against its own).
pub fn validate(report: &UsageReport) -> Result<(), UsageInvalid> {
    check_id(|| "replica".into(), &report.replica)?;
    check_id(|| "batchId".into(), &report.batch_id)?;
    if report.records.len() > MAX_USAGE_RECORDS {
        return Err(invalid(
            "records".into(),
            format_args!("at most {MAX_USAGE_RECORDS} records per report"),
        ));
    }
    for (i, r) in report.records.iter().enumerate() {
        let at = |name: &str| format!("records[{i}].{name}");
        check_id(|| at("subject"), &r.subject)?;
        if let Some(key_id) = &r.key_id {
            check_id(|| at("keyId"), key_id)?;
        }
        check_id(|| at("tier"), &r.tier)?;
        check_id(|| at("model"), &r.model)?;
        if let Some(backend) = &r.backend {
            check_id(|| at("backend"), backend)?;
        }
        if !r.hour_start.is_multiple_of(HOUR_SECONDS) {
            return Err(invalid(
                at("hourStart"),
                format_args!("must be a multiple of {HOUR_SECONDS}"),
            ));
        }
        for (name, value) in [
            ("requests", r.requests),
            ("promptTokens", r.prompt_tokens),
            ("completionTokens", r.completion_tokens),
            ("cachedInputTokens", r.cached_input_tokens),
        ] {
            if value > MAX_USAGE_COUNT {
                return Err(invalid(
                    at(name),
                    format_args!("must be at most {MAX_USAGE_COUNT}"),
                ));
            }
        }
        if r.cached_input_tokens > r.prompt_tokens {
            return Err(invalid(
                at("cachedInputTokens"),
                "must not exceed promptTokens (cached input tokens are part of them)",
            ));
        }
        if r.refused.len() > MAX_REFUSAL_REASONS {
            return Err(invalid(
                at("refused"),
                format_args!("at most {MAX_REFUSAL_REASONS} reasons"),
            ));
        }
        for (reason, count) in &r.refused {
            if !is_reason(reason) {
                return Err(invalid(
                    at("refused"),
                    format_args!(
                        "reason {reason:?} must be 1..={MAX_REASON_BYTES} bytes of a-z, 0-9 and _"
                    ),
                ));
            }
            if *count > MAX_USAGE_COUNT {
                return Err(invalid(
                    format!("records[{i}].refused.{reason}"),
                    format_args!("must be at most {MAX_USAGE_COUNT}"),
                ));
            }
        }
    }
    Ok(())
}

/// Start of the hour that holds `now_unix` (a record's `hourStart`).
pub fn hour_start_of(now_unix: u64) -> u64 {
    now_unix - now_unix % HOUR_SECONDS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> UsageRecord {
        UsageRecord {
            subject: "alice".into(),
            key_id: Some("k1".into()),
            tier: "free".into(),
            model: "sim-model".into(),
            hour_start: 1_764_561_600,
            requests: 3,
            refused: BTreeMap::from([("rate_limit_exceeded".to_string(), 2)]),
            prompt_tokens: 10,
            completion_tokens: 20,
            cached_input_tokens: 4,
            backend: None,
        }
    }

    fn field_of(records: Vec<UsageRecord>) -> Option<String> {
        validate(&UsageReport {
            replica: "r1".into(),
            batch_id: "b1".into(),
            records,
        })
        .err()
        .map(|e| e.field)
    }

    #[test]
    fn the_report_is_camel_case_and_a_token_caller_has_no_key_id() {
        let mut r = record();
        r.key_id = None;
        let v = serde_json::to_value(UsageReport {
            replica: "r1".into(),
            batch_id: "b1".into(),
            records: vec![r],
        })
        .unwrap_or_default();
        assert_eq!(v["batchId"], "b1");
        assert_eq!(v["records"][0]["hourStart"], 1_764_561_600u64);
        assert_eq!(v["records"][0]["promptTokens"], 10);
        assert!(v["records"][0].get("keyId").is_none());
        let back: Result<UsageReport, _> = serde_json::from_value(v);
        assert!(back.is_ok());
        // Counts default to 0; unknown fields are refused.
        let minimal: Result<UsageRecord, _> =
            serde_json::from_str(r#"{"subject":"a","tier":"free","model":"m","hourStart":3600}"#);
        assert_eq!(minimal.map(|r| r.requests).ok(), Some(0));
        let unknown: Result<UsageRecord, _> = serde_json::from_str(
            r#"{"subject":"a","tier":"free","model":"m","hourStart":3600,"cost":1}"#,
        );
        assert!(unknown.is_err());
    }

    #[test]
    fn cached_input_tokens_are_optional_and_left_out_when_zero() {
        let v = serde_json::to_value(record()).unwrap_or_default();
        assert_eq!(v["cachedInputTokens"], 4);
        let mut r = record();
        r.cached_input_tokens = 0;
        let v = serde_json::to_value(r).unwrap_or_default();
        assert!(v.get("cachedInputTokens").is_none(), "{v}");
        // An older filter's record (no cachedInputTokens) is read as 0.
        let old: Result<UsageRecord, _> = serde_json::from_str(
            r#"{"subject":"a","tier":"free","model":"m","hourStart":3600,"promptTokens":5}"#,
        );
        assert_eq!(old.map(|r| r.cached_input_tokens).ok(), Some(0));
    }

    #[test]
    fn the_backend_is_optional_camel_case_and_left_out_when_none() {
        let v = serde_json::to_value(record()).unwrap_or_default();
        assert!(v.get("backend").is_none(), "{v}");
        let mut r = record();
        r.backend = Some("primary".into());
        let v = serde_json::to_value(&r).unwrap_or_default();
        assert_eq!(v["backend"], "primary");
        let back: Result<UsageRecord, _> = serde_json::from_value(v);
        assert_eq!(back.ok(), Some(r));
        // An older filter's record (no backend) names none.
        let old: Result<UsageRecord, _> =
            serde_json::from_str(r#"{"subject":"a","tier":"free","model":"m","hourStart":3600}"#);
        assert_eq!(old.map(|r| r.backend).ok(), Some(None));
    }

    #[test]
    fn a_bad_report_names_the_field() {
        assert_eq!(field_of(vec![record()]), None);
        assert_eq!(
            field_of(vec![record(); MAX_USAGE_RECORDS + 1]).as_deref(),
            Some("records")
        );
        assert_eq!(field_of(vec![record(); MAX_USAGE_RECORDS]), None);
        type Spoil = fn(&mut UsageRecord);
        let cases: [(Spoil, &str); 12] = [
            (|r| r.backend = Some(String::new()), "records[1].backend"),
            (
                |r| r.cached_input_tokens = r.prompt_tokens + 1,
                "records[1].cachedInputTokens",
            ),
            (
                |r| {
                    r.prompt_tokens = 1 << 53;
                    r.cached_input_tokens = 1 << 53;
                },
                "records[1].promptTokens",
            ),
            (|r| r.subject.clear(), "records[1].subject"),
            (|r| r.key_id = Some(String::new()), "records[1].keyId"),
            (|r| r.tier = "x".repeat(1025), "records[1].tier"),
            (|r| r.model = "a\nb".into(), "records[1].model"),
            (|r| r.hour_start = 1_764_561_601, "records[1].hourStart"),
            (|r| r.prompt_tokens = 1 << 53, "records[1].promptTokens"),
            (
                |r| {
                    r.refused.insert("Rate Limit".into(), 1);
                },
                "records[1].refused",
            ),
            (
                |r| {
                    r.refused.insert("x".into(), 1 << 53);
                },
                "records[1].refused.x",
            ),
            (
                |r| {
                    for i in 0..=MAX_REFUSAL_REASONS {
                        r.refused.insert(format!("r{i}"), 1);
                    }
                },
                "records[1].refused",
            ),
        ];
        for (spoil, field) in cases {
            let mut bad = record();
            spoil(&mut bad);
            assert_eq!(
                field_of(vec![record(), bad]).as_deref(),
                Some(field),
                "{field}"
            );
        }
        let no_batch = validate(&UsageReport {
            replica: "r1".into(),
            batch_id: String::new(),
            records: vec![],
        });
        assert_eq!(no_batch.err().map(|e| e.field).as_deref(), Some("batchId"));
    }

    #[test]
    fn hours_start_on_the_hour() {
        assert_eq!(hour_start_of(1_764_565_199), 1_764_561_600);
        assert_eq!(hour_start_of(1_764_561_600), 1_764_561_600);
    }
}
