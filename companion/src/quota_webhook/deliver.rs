//! One delivery attempt: the signed POST, what its answer means, and when to try again.
//!
//! Headers: `content-type: application/json`, `x-maas-webhook-id` (the event's id, the same at
//! every attempt: receivers deduplicate on it), `x-maas-webhook-timestamp` (Unix seconds of
//! this attempt) and `x-maas-webhook-signature: v1=<hex HMAC-SHA256(secret, "<timestamp>.<body>")>`.
//! A 2xx is delivered. A timeout, a connection error, 408, 429 or a 5xx is tried again (after
//! the backoff, or the answer's `Retry-After` when longer); anything else (a 3xx — redirects are
//! not followed —, another 4xx) is not: the receiver refused the event.

use chrono::{DateTime, Utc};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::time::Duration;

pub const ID_HEADER: &str = "x-maas-webhook-id";
pub const TIMESTAMP_HEADER: &str = "x-maas-webhook-timestamp";
pub const SIGNATURE_HEADER: &str = "x-maas-webhook-signature";

/// `v1=` and the hex HMAC-SHA256 of `"<timestamp>.<body>"` under `secret`.
pub fn signature(secret: &[u8], timestamp: i64, body: &str) -> String {
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret) else {
        return String::new();
    };
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body.as_bytes());
    format!("v1={}", hex::encode(mac.finalize().into_bytes()))
}

/// What an attempt came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Delivered,
    /// Worth another attempt; the receiver's `Retry-After`, if it gave one.
    Retry {
        error: String,
        retry_after: Option<Duration>,
    },
    /// Refused for good.
    Refused {
        error: String,
    },
}

/// The outcome of an answer with `status` (and its `Retry-After`, read at `now`).
pub fn classify(status: u16, retry_after_header: Option<&str>, now: DateTime<Utc>) -> Outcome {
    match status {
        200..=299 => Outcome::Delivered,
        408 | 429 | 500..=599 => Outcome::Retry {
            error: format!("HTTP {status}"),
            retry_after: retry_after_header.and_then(|v| retry_after(v, now)),
        },
        _ => Outcome::Refused {
            error: format!("HTTP {status} (not retried)"),
        },
    }
}

/// A `Retry-After` value: delay seconds or an HTTP date (past dates: no delay).
pub fn retry_after(value: &str, now: DateTime<Utc>) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = DateTime::parse_from_rfc2822(value).ok()?.to_utc();
    Some((at - now).to_std().unwrap_or(Duration::ZERO))
}

/// The delay after the `attempts`-th failed attempt: `base × 2^(attempts−1)`, at most `max`,
/// then jittered down to between half and all of it (`jitter` in 0..=1: the fraction kept
/// above half), so many events failing together do not come back together.
pub fn backoff(attempts: u32, base: Duration, max: Duration, jitter: f64) -> Duration {
    let doublings = attempts.saturating_sub(1).min(32);
    let full = base.saturating_mul(1u32 << doublings.min(31)).min(max);
    let jitter = jitter.clamp(0.0, 1.0);
    full.mul_f64(0.5 + 0.5 * jitter)
}

/// The delay before the next attempt: the backoff, or the receiver's `Retry-After` when longer
/// (at most `retry_after_cap`).
pub fn next_delay(backoff: Duration, retry_after: Option<Duration>, cap: Duration) -> Duration {
    retry_after.map_or(backoff, |r| backoff.max(r.min(cap)))
}

/// One signed POST of `body` (the event `id`).
pub async fn attempt(
    client: &reqwest::Client,
    url: &str,
    secret: &[u8],
    id: &str,
    body: &str,
) -> Outcome {
    let now = Utc::now();
    let timestamp = now.timestamp();
    let sent = client
        .post(url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .header(ID_HEADER, id)
        .header(TIMESTAMP_HEADER, timestamp.to_string())
        .header(SIGNATURE_HEADER, signature(secret, timestamp, body))
        .body(body.to_string())
        .send()
        .await;
    match sent {
        Ok(answer) => {
            let retry = answer
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            classify(answer.status().as_u16(), retry.as_deref(), Utc::now())
        }
        Err(e) => Outcome::Retry {
            // Without the URL (it may hold a token).
            error: if e.is_timeout() {
                "timeout".to_string()
            } else if e.is_connect() {
                "connection failed".to_string()
            } else {
                "request failed".to_string()
            },
            retry_after: None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_the_hmac_of_timestamp_dot_body() {
        // HMAC-SHA256("key", "1700000000.{}") computed independently (openssl dgst -hmac).
        let s = signature(b"key", 1_700_000_000, "{}");
        assert!(s.starts_with("v1=") && s.len() == 3 + 64, "{s}");
        assert_eq!(
            s,
            "v1=9d713ed406bb7076d4123f0dc2c39d2df5c654ed4b0cd56b52c8b4c940bd63ae"
        );
        assert_ne!(s, signature(b"other", 1_700_000_000, "{}"));
        assert_ne!(s, signature(b"key", 1_700_000_001, "{}"));
        assert_ne!(s, signature(b"key", 1_700_000_000, "{ }"));
    }

    #[test]
    fn timeouts_408_429_and_5xx_are_retried_other_answers_are_not() {
        let now = Utc::now();
        assert_eq!(classify(200, None, now), Outcome::Delivered);
        assert_eq!(classify(204, None, now), Outcome::Delivered);
        for retried in [408, 429, 500, 502, 503, 599] {
            assert!(
                matches!(classify(retried, None, now), Outcome::Retry { .. }),
                "{retried}"
            );
        }
        for refused in [301, 302, 400, 401, 403, 404, 410, 422] {
            assert!(
                matches!(classify(refused, None, now), Outcome::Refused { .. }),
                "{refused}"
            );
        }
        assert_eq!(
            classify(429, Some("7"), now),
            Outcome::Retry {
                error: "HTTP 429".into(),
                retry_after: Some(Duration::from_secs(7))
            }
        );
    }

    #[test]
    fn retry_after_is_seconds_or_an_http_date() {
        let now = DateTime::parse_from_rfc3339("2026-12-03T10:00:00Z")
            .unwrap()
            .to_utc();
        assert_eq!(retry_after("120", now), Some(Duration::from_secs(120)));
        assert_eq!(
            retry_after("Thu, 03 Dec 2026 10:01:30 GMT", now),
            Some(Duration::from_secs(90))
        );
        assert_eq!(
            retry_after("Thu, 03 Dec 2026 09:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(retry_after("soon", now), None);
        assert_eq!(retry_after("-1", now), None);
    }

    #[test]
    fn backoff_doubles_to_its_cap_jittered_between_half_and_all() {
        let base = Duration::from_secs(5);
        let max = Duration::from_secs(900);
        assert_eq!(backoff(1, base, max, 1.0), Duration::from_secs(5));
        assert_eq!(backoff(2, base, max, 1.0), Duration::from_secs(10));
        assert_eq!(backoff(4, base, max, 1.0), Duration::from_secs(40));
        assert_eq!(backoff(4, base, max, 0.0), Duration::from_secs(20));
        assert_eq!(backoff(20, base, max, 1.0), max);
        assert_eq!(backoff(u32::MAX, base, max, 1.0), max);
        assert_eq!(backoff(0, base, max, 1.0), base);
        // A longer Retry-After wins, up to its cap; a shorter one does not shorten the backoff.
        let cap = Duration::from_secs(3600);
        let b = Duration::from_secs(10);
        assert_eq!(next_delay(b, None, cap), b);
        assert_eq!(next_delay(b, Some(Duration::from_secs(2)), cap), b);
        assert_eq!(
            next_delay(b, Some(Duration::from_secs(60)), cap),
            Duration::from_secs(60)
        );
        assert_eq!(next_delay(b, Some(Duration::from_secs(86_400)), cap), cap);
    }
}
