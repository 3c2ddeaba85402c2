//! The rules of a new key: its lifetime (`expiresIn`), name, description and labels. Pure
//! functions.

use serde_json::Value;
use std::collections::BTreeMap;
use std::time::Duration;

/// Ephemeral keys live at most this long.
pub const EPHEMERAL_MAX: Duration = Duration::from_secs(3600);
pub const NAME_MAX_CHARS: usize = 128;
pub const DESCRIPTION_MAX_CHARS: usize = 1024;
/// A key carries at most this many labels.
pub const LABELS_MAX: usize = 16;
/// Label keys: 1 to 63 of `A-Z a-z 0-9 . _ - /`, starting with a letter or digit.
pub const LABEL_KEY_MAX_CHARS: usize = 63;
/// Label values: at most this many characters, no control characters.
pub const LABEL_VALUE_MAX_CHARS: usize = 256;

/// A request field that breaks a rule; `param` names it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct InvalidField {
    pub message: String,
    pub param: &'static str,
}

pub fn invalid(message: impl Into<String>, param: &'static str) -> InvalidField {
    InvalidField {
        message: message.into(),
        param,
    }
}

// ---------------------------------------------------------------------------------------------
// expiresIn
// ---------------------------------------------------------------------------------------------

/// Parses a duration like `30d`, `1.5d`, `1h`, `2h30m`, `90s`, `500ms` (Go durations plus `d`).
/// Zero and negative durations are refused, as are unitless strings other than `0`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s.is_empty() || s == "0" {
        return Err("expiration must be positive".into());
    }
    if s.starts_with('-') {
        return Err("expiration must be positive".into());
    }
    let s = s.strip_prefix('+').unwrap_or(s);
    let bytes = s.as_bytes();
    let mut i = 0;
    let mut total = 0f64;
    while i < bytes.len() {
        let start = i;
        while i < bytes.len() && (bytes[i].is_ascii_digit() || bytes[i] == b'.') {
            i += 1;
        }
        let number = &s[start..i];
        if number.is_empty() || number == "." || number.matches('.').count() > 1 {
            return Err(format!(
                "invalid duration {s:?}: expected e.g. 30d, 1h, 2h30m"
            ));
        }
        let value: f64 = number
            .parse()
            .map_err(|_| format!("invalid duration {s:?}: expected e.g. 30d, 1h, 2h30m"))?;
        let unit_start = i;
        while i < bytes.len() && !(bytes[i].is_ascii_digit() || bytes[i] == b'.') {
            i += 1;
        }
        let seconds_per_unit = match &s[unit_start..i] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            "d" => 86_400.0,
            "" => {
                return Err(format!(
                    "invalid duration {s:?}: missing unit (s, m, h or d)"
                ));
            }
            other => {
                return Err(format!(
                    "invalid duration {s:?}: unknown unit {other:?} (use s, m, h or d)"
                ));
            }
        };
        total += value * seconds_per_unit;
    }
    seconds_to_duration(total)
}

fn seconds_to_duration(total: f64) -> Result<Duration, String> {
    if !total.is_finite() {
        return Err("expiration is too large".into());
    }
    if total <= 0.0 {
        return Err("expiration must be positive".into());
    }
    // Anything beyond ~31 years is over every configurable maximum anyway.
    Ok(Duration::from_secs_f64(total.min(1e9)))
}

/// `expiresIn` as sent: a duration string or a number of seconds.
pub fn parse_expires_in(v: &Value) -> Result<Duration, String> {
    match v {
        Value::String(s) => parse_duration(s),
        Value::Number(n) => seconds_to_duration(n.as_f64().unwrap_or(f64::NAN)),
        _ => Err("expiresIn must be a duration string like \"30d\" or a number of seconds".into()),
    }
}

fn describe(v: &Value) -> String {
    match v {
        Value::String(s) => s.trim().to_string(),
        other => format!("{other}s"),
    }
}

/// The lifetime a new key gets: the request's `expiresIn` checked against the maximum.
pub fn lifetime(
    expires_in: Option<&Value>,
    ephemeral: bool,
    max_days: u32,
) -> Result<Duration, InvalidField> {
    let max = Duration::from_secs(u64::from(max_days) * 86_400);
    let Some(v) = expires_in.filter(|v| !v.is_null()) else {
        return Ok(if ephemeral { EPHEMERAL_MAX } else { max });
    };
    let d = parse_expires_in(v).map_err(|m| invalid(m, "expiresIn"))?;
    if ephemeral && d > EPHEMERAL_MAX {
        return Err(invalid(
            format!(
                "ephemeral key expiration ({}) cannot exceed 1 hour",
                describe(v)
            ),
            "expiresIn",
        ));
    }
    if d > max {
        return Err(invalid(
            format!(
                "requested expiration ({}) exceeds maximum allowed ({max_days} days)",
                describe(v)
            ),
            "expiresIn",
        ));
    }
    Ok(d)
}

pub fn check_name(name: &str) -> Result<String, InvalidField> {
    let name = name.trim();
    if name.is_empty() {
        return Err(invalid("name is required for non-ephemeral keys", "name"));
    }
    if name.chars().count() > NAME_MAX_CHARS {
        return Err(invalid(
            format!("name must be at most {NAME_MAX_CHARS} characters"),
            "name",
        ));
    }
    if name.chars().any(char::is_control) {
        return Err(invalid("name must not contain control characters", "name"));
    }
    Ok(name.to_string())
}

pub fn check_description(d: Option<String>) -> Result<Option<String>, InvalidField> {
    let Some(d) = d else { return Ok(None) };
    if d.chars().count() > DESCRIPTION_MAX_CHARS {
        return Err(invalid(
            format!("description must be at most {DESCRIPTION_MAX_CHARS} characters"),
            "description",
        ));
    }
    if d.chars().any(|c| c.is_control() && c != '\n' && c != '\t') {
        return Err(invalid(
            "description must not contain control characters",
            "description",
        ));
    }
    Ok(Some(d))
}

fn label_key_ok(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= LABEL_KEY_MAX_CHARS
        && k.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && k.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'/'))
}

/// Checks a key's labels (`labels` at mint, `filters.labelsContain` in search; `param` names
/// the field) and answers them as JSON object text.
pub fn check_labels(
    labels: &BTreeMap<String, String>,
    param: &'static str,
) -> Result<String, InvalidField> {
    if labels.len() > LABELS_MAX {
        return Err(invalid(
            format!("{param}: at most {LABELS_MAX} labels"),
            param,
        ));
    }
    for (k, v) in labels {
        if !label_key_ok(k) {
            return Err(invalid(
                format!(
                    "{param}: label key {k:?} must be 1 to {LABEL_KEY_MAX_CHARS} of letters, digits, '.', '_', '-', '/', starting with a letter or digit"
                ),
                param,
            ));
        }
        if v.chars().count() > LABEL_VALUE_MAX_CHARS || v.chars().any(char::is_control) {
            return Err(invalid(
                format!(
                    "{param}: the value of label {k:?} must be at most {LABEL_VALUE_MAX_CHARS} characters without control characters"
                ),
                param,
            ));
        }
    }
    Ok(serde_json::to_string(labels).unwrap_or_else(|_| "{}".to_string()))
}

/// Windows a key's own limits may have per kind (requests, tokens, budgets): each is a counter
/// every request of the key updates.
pub const KEY_LIMIT_WINDOWS_MAX: usize = 4;

/// Checks a key's own limits (`limits` at mint) as a scope's are checked, with at most
/// [`KEY_LIMIT_WINDOWS_MAX`] windows per kind, and answers them as JSON text.
pub fn check_key_limits(limits: &maas_types::Limits) -> Result<String, InvalidField> {
    for (kind, n) in [
        ("requests", limits.requests.len()),
        ("tokens", limits.tokens.len()),
        ("budgets", limits.budgets.len()),
    ] {
        if n > KEY_LIMIT_WINDOWS_MAX {
            return Err(invalid(
                format!("limits.{kind}: at most {KEY_LIMIT_WINDOWS_MAX} windows"),
                "limits",
            ));
        }
    }
    maas_types::policy::scope::check_scope_limits("limits", limits)
        .map_err(|e| invalid(e.to_string(), "limits"))?;
    serde_json::to_string(limits).map_err(|e| invalid(e.to_string(), "limits"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn durations() {
        assert_eq!(
            parse_duration("30d").unwrap(),
            Duration::from_secs(30 * 86_400)
        );
        assert_eq!(
            parse_duration("1.5d").unwrap(),
            Duration::from_secs(129_600)
        );
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration("2h30m").unwrap(), Duration::from_secs(9000));
        assert_eq!(parse_duration(" 90s ").unwrap(), Duration::from_secs(90));
        assert_eq!(
            parse_duration("1500ms").unwrap(),
            Duration::from_millis(1500)
        );
        for bad in [
            "", "0", "-1h", "1", "h", "1x", "1..5h", "1h-5m", ".h", "0s", "0d",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should be refused");
        }
        assert_eq!(
            parse_expires_in(&json!(3600)).unwrap(),
            Duration::from_secs(3600)
        );
        assert!(parse_expires_in(&json!(0)).is_err());
        assert!(parse_expires_in(&json!(-5)).is_err());
        assert!(parse_expires_in(&json!(true)).is_err());
    }

    #[test]
    fn lifetime_rules() {
        assert_eq!(
            lifetime(None, false, 90).unwrap(),
            Duration::from_secs(90 * 86_400)
        );
        assert_eq!(lifetime(None, true, 90).unwrap(), EPHEMERAL_MAX);
        assert_eq!(
            lifetime(Some(&Value::Null), false, 30).unwrap(),
            Duration::from_secs(30 * 86_400)
        );
        let over = lifetime(Some(&json!("91d")), false, 90).unwrap_err();
        assert!(over.to_string().contains("exceeds maximum"), "{over}");
        let eph = lifetime(Some(&json!("2h")), true, 90).unwrap_err();
        assert!(eph.to_string().contains("cannot exceed 1 hour"), "{eph}");
        assert!(lifetime(Some(&json!("")), false, 90).is_err());
        assert_eq!(
            lifetime(Some(&json!("30m")), true, 90).unwrap(),
            Duration::from_secs(1800)
        );
    }

    #[test]
    fn names() {
        assert_eq!(check_name("  k1 ").unwrap(), "k1");
        assert!(check_name("   ").is_err());
        assert!(check_name("a\u{7}b").is_err());
        assert!(check_name(&"x".repeat(129)).is_err());
        assert!(check_name(&"é".repeat(128)).is_ok());
    }

    #[test]
    fn labels_are_bounded_and_answered_as_json() {
        let map = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert_eq!(
            check_labels(&map(&[("team", "a"), ("app.io/env", "dev")]), "labels").unwrap(),
            r#"{"app.io/env":"dev","team":"a"}"#
        );
        assert_eq!(check_labels(&map(&[]), "labels").unwrap(), "{}");
        let many: BTreeMap<String, String> = (0..17)
            .map(|i| (format!("k{i}"), "v".to_string()))
            .collect();
        assert!(check_labels(&many, "labels").is_err());
        let sixteen: BTreeMap<String, String> = (0..16)
            .map(|i| (format!("k{i}"), "v".to_string()))
            .collect();
        assert!(check_labels(&sixteen, "labels").is_ok());
        for bad_key in ["", "-x", "a b", "é", &"k".repeat(64)] {
            assert!(
                check_labels(&map(&[(bad_key, "v")]), "labels").is_err(),
                "{bad_key:?}"
            );
        }
        assert!(check_labels(&map(&[("k", &"v".repeat(257))]), "labels").is_err());
        assert!(check_labels(&map(&[("k", "a\u{1}")]), "labels").is_err());
        let e = check_labels(&map(&[("k", "a\n")]), "filters.labelsContain").unwrap_err();
        assert_eq!(e.param, "filters.labelsContain");
    }

    proptest! {
        #[test]
        fn parse_never_panics(s in ".{0,40}") {
            let _ = parse_duration(&s);
        }

        #[test]
        fn composed_durations_add_up(d in 0u64..400, h in 0u64..24, m in 0u64..60, s in 0u64..60) {
            prop_assume!(d + h + m + s > 0);
            let text = format!("{d}d{h}h{m}m{s}s");
            let got = parse_duration(&text).unwrap();
            prop_assert_eq!(got.as_secs(), d * 86_400 + h * 3600 + m * 60 + s);
        }

        #[test]
        fn seconds_number_equals_s_suffix(n in 1u64..10_000_000) {
            prop_assert_eq!(parse_expires_in(&json!(n)).unwrap(), parse_duration(&format!("{n}s")).unwrap());
        }
    }
}
