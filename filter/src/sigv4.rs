//! AWS Signature Version 4 for the requests the gateway sends to AWS Bedrock, as plain functions.
//!
//! The filter never holds the AWS secret access key: the companion derives the day's signing key
//! (`kSigning`, see [`maas_types::SigV4Key`]) and the filter signs each request with it:
//! - the canonical request: method, canonical URI, canonical query, the signed headers
//!   (`content-type`, `host`, `x-amz-content-sha256`, `x-amz-date`, and `x-amz-security-token`
//!   for temporary credentials; names lower case, sorted), their names, and the hex SHA-256 of the
//!   exact body sent;
//! - the canonical URI of a service other than S3: the path as sent (its segments already
//!   URI-encoded once, e.g. a Bedrock model id's `:` as `%3A`) with each segment URI-encoded
//!   again (`%253A`), AWS's rule for every service but S3;
//! - the string to sign (`AWS4-HMAC-SHA256`, the timestamp, the scope
//!   `date/region/service/aws4_request`, the canonical request's hash) and its HMAC-SHA256 with
//!   the signing key.

use hmac::{Hmac, Mac};
use maas_types::SigV4Key;
use sha2::{Digest, Sha256};

pub const ALGORITHM: &str = "AWS4-HMAC-SHA256";

type HmacSha256 = Hmac<Sha256>;

/// HMAC-SHA256 of `data` with `key` (any key length is accepted).
pub fn hmac(key: &[u8], data: &[u8]) -> [u8; 32] {
    match HmacSha256::new_from_slice(key) {
        Ok(mut m) => {
            m.update(data);
            m.finalize().into_bytes().into()
        }
        // HMAC takes keys of any length: never reached.
        Err(_) => [0; 32],
    }
}

/// Hex SHA-256 (the payload hash, the canonical request's hash).
pub fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// `(yyyymmdd, yyyymmddThhmmssZ)` of a unix time (UTC).
pub fn timestamps(unix_s: u64) -> (String, String) {
    let days = unix_s / 86_400;
    let secs = unix_s % 86_400;
    let (y, m, d) = civil_from_days(days);
    let date = format!("{y:04}{m:02}{d:02}");
    let stamp = format!(
        "{date}T{:02}{:02}{:02}Z",
        secs / 3600,
        (secs / 60) % 60,
        secs % 60
    );
    (date, stamp)
}

/// The UTC calendar date of a day count since 1970-01-01 (H. Hinnant's algorithm).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    (y, m, d)
}

/// AWS's URI encoding: every byte but the unreserved `A-Z a-z 0-9 - . _ ~` as `%XY` (upper-case
/// hex); `/` kept when `keep_slash`.
pub fn uri_encode(s: &str, keep_slash: bool) -> String {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric()
            || matches!(b, b'-' | b'.' | b'_' | b'~')
            || (keep_slash && b == b'/')
        {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(char::from(
                HEX.get(usize::from(b >> 4)).copied().unwrap_or(b'0'),
            ));
            out.push(char::from(
                HEX.get(usize::from(b & 15)).copied().unwrap_or(b'0'),
            ));
        }
    }
    out
}

/// The canonical URI of a non-S3 service: each segment of the path as sent, URI-encoded (again).
pub fn canonical_uri(path: &str) -> String {
    if path.is_empty() {
        return "/".to_string();
    }
    path.split('/')
        .map(|segment| uri_encode(segment, false))
        .collect::<Vec<_>>()
        .join("/")
}

/// The canonical query: `name=value` pairs URI-encoded, sorted by name then value, joined by `&`.
pub fn canonical_query(query: &str) -> String {
    let mut pairs: Vec<(String, String)> = query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (uri_encode(k, false), uri_encode(v, false))
        })
        .collect();
    pairs.sort();
    pairs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join("&")
}

/// The canonical request and its signed header names (`a;b;c`). `headers`: (name, value) of
/// every signed header, any case and order; values trimmed, inner spaces collapsed.
pub fn canonical_request(
    method: &str,
    path: &str,
    query: &str,
    headers: &[(&str, &str)],
    payload_hash: &str,
) -> (String, String) {
    let mut h: Vec<(String, String)> = headers
        .iter()
        .map(|(n, v)| {
            (
                n.to_ascii_lowercase(),
                v.split_whitespace().collect::<Vec<_>>().join(" "),
            )
        })
        .collect();
    h.sort();
    let signed = h
        .iter()
        .map(|(n, _)| n.as_str())
        .collect::<Vec<_>>()
        .join(";");
    let mut out = format!(
        "{method}\n{}\n{}\n",
        canonical_uri(path),
        canonical_query(query)
    );
    for (n, v) in &h {
        out.push_str(n);
        out.push(':');
        out.push_str(v);
        out.push('\n');
    }
    out.push('\n');
    out.push_str(&signed);
    out.push('\n');
    out.push_str(payload_hash);
    (out, signed)
}

/// The credential scope: `date/region/service/aws4_request`.
pub fn scope(date: &str, region: &str, service: &str) -> String {
    format!("{date}/{region}/{service}/aws4_request")
}

/// The string to sign of a canonical request.
pub fn string_to_sign(amz_date: &str, scope: &str, canonical_request: &str) -> String {
    format!(
        "{ALGORITHM}\n{amz_date}\n{scope}\n{}",
        sha256_hex(canonical_request.as_bytes())
    )
}

/// The hex signature of a string to sign with a derived signing key.
pub fn signature(signing_key: &[u8], string_to_sign: &str) -> String {
    hex::encode(hmac(signing_key, string_to_sign.as_bytes()))
}

/// The `Authorization` header value.
pub fn authorization(access_key_id: &str, scope: &str, signed: &str, signature: &str) -> String {
    format!(
        "{ALGORITHM} Credential={access_key_id}/{scope}, SignedHeaders={signed}, Signature={signature}"
    )
}

/// The signing key of the day of `now_s` for `region` among `keys` (the companion serves
/// today's, and tomorrow's near midnight), when still valid at `now_s`.
pub fn key_for<'k>(keys: &'k [SigV4Key], region: &str, now_s: u64) -> Option<&'k SigV4Key> {
    let (date, _) = timestamps(now_s);
    keys.iter().find(|k| {
        k.date == date && k.region == region && now_s < k.expires_at && k.signing_key.len() == 64
    })
}

/// The headers that sign one request (to set on it, replacing any value): `host`,
/// `x-amz-date`, `x-amz-content-sha256`, `x-amz-security-token` (temporary credentials) and
/// `authorization`. `content_type` is signed too.
pub struct SignInput<'a> {
    pub method: &'a str,
    pub host: &'a str,
    /// As sent (segments URI-encoded once).
    pub path: &'a str,
    pub query: &'a str,
    pub content_type: &'a str,
    pub body: &'a [u8],
    pub now_s: u64,
}

/// Signs a request with `key`; `None` when the key is not usable (not hex).
pub fn sign(key: &SigV4Key, input: &SignInput<'_>) -> Option<Vec<(&'static str, String)>> {
    let signing_key = hex::decode(&key.signing_key).ok()?;
    let (_, amz_date) = timestamps(input.now_s);
    let payload_hash = sha256_hex(input.body);
    let mut headers: Vec<(&str, &str)> = vec![
        ("content-type", input.content_type),
        ("host", input.host),
        ("x-amz-content-sha256", &payload_hash),
        ("x-amz-date", &amz_date),
    ];
    if let Some(t) = &key.session_token {
        headers.push(("x-amz-security-token", t));
    }
    let (canonical, signed) = canonical_request(
        input.method,
        input.path,
        input.query,
        &headers,
        &payload_hash,
    );
    let scope = scope(&key.date, &key.region, &key.service);
    let sts = string_to_sign(&amz_date, &scope, &canonical);
    let sig = signature(&signing_key, &sts);
    let mut out = vec![
        ("x-amz-date", amz_date.clone()),
        ("x-amz-content-sha256", payload_hash.clone()),
    ];
    if let Some(t) = &key.session_token {
        out.push(("x-amz-security-token", t.clone()));
    }
    out.push((
        "authorization",
        authorization(&key.access_key_id, &scope, &signed, &sig),
    ));
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY";

    /// AWS's derivation (the companion's; here only to check the filter against AWS's vectors).
    fn derive(secret: &str, date: &str, region: &str, service: &str) -> [u8; 32] {
        let k_date = hmac(format!("AWS4{secret}").as_bytes(), date.as_bytes());
        let k_region = hmac(&k_date, region.as_bytes());
        let k_service = hmac(&k_region, service.as_bytes());
        hmac(&k_service, b"aws4_request")
    }

    /// AWS's documented signing-key example (IAM, us-east-1, 2015-08-30).
    #[test]
    fn the_documented_signing_key_is_derived() {
        assert_eq!(
            hex::encode(derive(SECRET, "20150830", "us-east-1", "iam")),
            "c4afb1cc5771d871763a393e44b703571b55cc28424d1a5e86da6ed3c154a4b9"
        );
    }

    /// The AWS SigV4 test suite's `get-vanilla`.
    #[test]
    fn get_vanilla_of_the_aws_test_suite() {
        let empty = sha256_hex(b"");
        let (canonical, signed) = canonical_request(
            "GET",
            "/",
            "",
            &[
                ("Host", "example.amazonaws.com"),
                ("X-Amz-Date", "20150830T123600Z"),
            ],
            &empty,
        );
        assert_eq!(
            canonical,
            "GET\n/\n\nhost:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\nhost;x-amz-date\ne3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        let scope = scope("20150830", "us-east-1", "service");
        let sts = string_to_sign("20150830T123600Z", &scope, &canonical);
        assert_eq!(
            sts,
            "AWS4-HMAC-SHA256\n20150830T123600Z\n20150830/us-east-1/service/aws4_request\nbb579772317eb040ac9ed261061d46c1f17a8133879d6129b6e1c25292927e63"
        );
        let key = derive(SECRET, "20150830", "us-east-1", "service");
        let sig = signature(&key, &sts);
        assert_eq!(
            sig,
            "5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31"
        );
        assert_eq!(
            authorization("AKIDEXAMPLE", &scope, &signed, &sig),
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, SignedHeaders=host;x-amz-date, Signature=5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31"
        );
    }

    #[test]
    fn paths_queries_and_dates_are_canonical() {
        // A Bedrock model id's `:` goes as `%3A` and is encoded again in the canonical URI.
        assert_eq!(
            canonical_uri("/model/anthropic.claude-3-haiku-20240307-v1%3A0/converse"),
            "/model/anthropic.claude-3-haiku-20240307-v1%253A0/converse"
        );
        assert_eq!(canonical_uri(""), "/");
        assert_eq!(uri_encode("a b/c~", true), "a%20b/c~");
        assert_eq!(uri_encode("a b/c~", false), "a%20b%2Fc~");
        assert_eq!(canonical_query("b=2&a=x y&a=1&"), "a=1&a=x%20y&b=2");
        assert_eq!(
            timestamps(1_440_938_160),
            ("20150830".to_string(), "20150830T123600Z".to_string())
        );
        assert_eq!(timestamps(0).1, "19700101T000000Z");
        // A leap day and the end of a year.
        assert_eq!(timestamps(951_782_400).0, "20000229");
        assert_eq!(timestamps(1_767_225_599).1, "20251231T235959Z");
    }

    fn key(date: &str, expires_at: u64, token: Option<&str>) -> SigV4Key {
        SigV4Key {
            access_key_id: "AKIDEXAMPLE".into(),
            date: date.into(),
            region: "us-east-1".into(),
            service: "bedrock".into(),
            signing_key: hex::encode(derive(SECRET, date, "us-east-1", "bedrock")),
            session_token: token.map(str::to_string),
            expires_at,
        }
    }

    #[test]
    fn the_key_of_the_day_signs_and_no_other() {
        let now = 1_440_938_160; // 2015-08-30T12:36:00Z
        let end = 1_440_979_200; // 2015-08-31T00:00:00Z
        let keys = [
            key("20150829", now - 45_360, None),
            key("20150830", end, None),
        ];
        assert_eq!(key_for(&keys, "us-east-1", now).unwrap().date, "20150830");
        assert!(key_for(&keys, "eu-west-1", now).is_none(), "another region");
        assert!(key_for(&keys[..1], "us-east-1", now).is_none());
        assert!(
            key_for(&keys, "us-east-1", end).is_none(),
            "expired at the day's end"
        );
        let mut bad = key("20150830", end, None);
        bad.signing_key = "zz".into();
        assert!(key_for(&[bad], "us-east-1", now).is_none());
    }

    #[test]
    fn a_signed_request_verifies_as_aws_recomputes_it() {
        let now = 1_440_938_160;
        let body = br#"{"messages":[]}"#;
        let k = key("20150830", now + 3600, Some("session/token+1"));
        let input = SignInput {
            method: "POST",
            host: "bedrock-runtime.us-east-1.amazonaws.com",
            path: "/model/m%3A0/converse",
            query: "",
            content_type: "application/json",
            body,
            now_s: now,
        };
        let headers = sign(&k, &input).unwrap();
        let get = |n: &str| {
            headers
                .iter()
                .find(|(h, _)| *h == n)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(get("x-amz-date"), Some("20150830T123600Z"));
        assert_eq!(get("x-amz-content-sha256"), Some(sha256_hex(body).as_str()));
        assert_eq!(get("x-amz-security-token"), Some("session/token+1"));
        // What AWS does: from the secret, the headers as received, the body as received.
        let (canonical, signed) = canonical_request(
            "POST",
            "/model/m%3A0/converse",
            "",
            &[
                ("content-type", "application/json"),
                ("host", "bedrock-runtime.us-east-1.amazonaws.com"),
                ("x-amz-content-sha256", &sha256_hex(body)),
                ("x-amz-date", "20150830T123600Z"),
                ("x-amz-security-token", "session/token+1"),
            ],
            &sha256_hex(body),
        );
        assert_eq!(
            signed,
            "content-type;host;x-amz-content-sha256;x-amz-date;x-amz-security-token"
        );
        let scope = scope("20150830", "us-east-1", "bedrock");
        let expected = signature(
            &derive(SECRET, "20150830", "us-east-1", "bedrock"),
            &string_to_sign("20150830T123600Z", &scope, &canonical),
        );
        assert_eq!(
            get("authorization"),
            Some(authorization("AKIDEXAMPLE", &scope, &signed, &expected).as_str())
        );
        // Another body signs differently.
        let other = sign(
            &k,
            &SignInput {
                body: b"{}",
                ..input
            },
        )
        .unwrap();
        assert_ne!(other, headers);
    }
}
