//! A strict simulator of AWS Bedrock's runtime Converse API (issue 29), checking SigV4 as AWS
//! does, written independently of the filter's signer:
//!
//! - only `POST /model/<model id, URI-encoded>/converse` and `…/converse-stream` for its one
//!   model (else 404 `UnknownOperationException`), `Host: bedrock-runtime.<region>.amazonaws.com`;
//! - `Authorization: AWS4-HMAC-SHA256 Credential=<key id>/<date>/<region>/bedrock/aws4_request,
//!   SignedHeaders=…, Signature=…` recomputed from the secret it knows: the canonical request
//!   from the headers as received (those named signed), the canonical URI with each segment of
//!   the received path URI-encoded again (AWS's rule for every service but S3), the payload hash
//!   from `x-amz-content-sha256`, which must be there and equal the SHA-256 of the body received;
//!   `x-amz-date` within 5 minutes of now and of the scope's date; `host`, `x-amz-date`,
//!   `x-amz-content-sha256` (and `x-amz-security-token`, which must be its session token, when it
//!   has one) signed. Any mismatch: 403 `{"message": …}` with `x-amzn-ErrorType`, as AWS answers;
//! - a Converse body: `messages` (user first), `system`, `inferenceConfig` with only the fields
//!   Converse knows (else 400 `ValidationException`);
//! - answers `converse` with JSON and `converse-stream` with real event-stream messages (CRCs),
//!   each message written in several small pieces; usage [`USAGE_INPUT`] / [`USAGE_OUTPUT`].
//!
//! Every request is recorded with all its headers and body, to assert what reached AWS.

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use hmac::{Hmac, Mac};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub const USAGE_INPUT: u64 = 13;
pub const USAGE_OUTPUT: u64 = 4;
/// The answer's text, streamed as these deltas.
pub const DELTAS: [&str; 4] = ["Hello", " from", " Bed", "rock"];

#[derive(Debug, Clone)]
pub struct BedrockSimConfig {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
    pub region: String,
    pub model_id: String,
}

/// One request the simulator received.
#[derive(Debug, Clone)]
pub struct BedrockRequest {
    /// As received (still URI-encoded).
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub status: u16,
    /// Why it was refused.
    pub refused: Option<String>,
}

impl BedrockRequest {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

struct Sim {
    config: BedrockSimConfig,
    recorded: Mutex<Vec<BedrockRequest>>,
}

#[derive(Clone)]
pub struct BedrockSimHandle {
    sim: Arc<Sim>,
    pub addr: SocketAddr,
}

impl BedrockSimHandle {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
    pub fn requests(&self) -> Vec<BedrockRequest> {
        self.sim.recorded.lock().unwrap().clone()
    }
}

/// Starts the simulator on a free port of 127.0.0.1, on the current tokio runtime.
pub async fn spawn(config: BedrockSimConfig) -> anyhow::Result<BedrockSimHandle> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let sim = Arc::new(Sim {
        config,
        recorded: Mutex::default(),
    });
    let app = Router::new().fallback(handle).with_state(sim.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(BedrockSimHandle { sim, addr })
}

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    let mut m = Hmac::<Sha256>::new_from_slice(key).expect("any key length");
    m.update(data);
    m.finalize().into_bytes().to_vec()
}

/// RFC 3986 unreserved kept, everything else `%XY`.
pub fn aws_uri_encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

fn aws_error(status: StatusCode, kind: &str, message: &str) -> Response {
    (
        status,
        [
            ("x-amzn-errortype", kind),
            ("content-type", "application/json"),
        ],
        axum::Json(json!({"message": message})),
    )
        .into_response()
}

async fn handle(
    State(sim): State<Arc<Sim>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path().to_string();
    let recorded_headers: Vec<(String, String)> = headers
        .iter()
        .map(|(n, v)| {
            (
                n.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let outcome = check(&sim.config, &method, &uri, &headers, &body);
    let (status, refused, response) = match outcome {
        Err((status, kind, why)) => (status, Some(why.clone()), aws_error(status, kind, &why)),
        Ok(stream) => (StatusCode::OK, None, answer(stream)),
    };
    sim.recorded.lock().unwrap().push(BedrockRequest {
        path,
        headers: recorded_headers,
        body: body.to_vec(),
        status: status.as_u16(),
        refused,
    });
    response
}

type Refused = (StatusCode, &'static str, String);

/// The request as AWS checks it: `Ok(stream)` when it may be answered.
fn check(
    c: &BedrockSimConfig,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<bool, Refused> {
    let base = format!("/model/{}/", aws_uri_encode(&c.model_id));
    let stream = match uri.path().strip_prefix(&base) {
        Some("converse") => false,
        Some("converse-stream") => true,
        _ => {
            return Err((
                StatusCode::NOT_FOUND,
                "UnknownOperationException",
                format!("no such operation or model at {}", uri.path()),
            ));
        }
    };
    if method != Method::POST {
        return Err((
            StatusCode::NOT_FOUND,
            "UnknownOperationException",
            "POST only".into(),
        ));
    }
    verify_signature(c, uri, headers, body)?;
    check_body(body)?;
    Ok(stream)
}

fn denied(why: impl Into<String>) -> Refused {
    (StatusCode::FORBIDDEN, "AccessDeniedException", why.into())
}

fn verify_signature(
    c: &BedrockSimConfig,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(), Refused> {
    let get = |n: &str| headers.get(n).and_then(|v| v.to_str().ok());
    let host = format!("bedrock-runtime.{}.amazonaws.com", c.region);
    if get("host") != Some(host.as_str()) {
        return Err(denied(format!(
            "host must be {host}, got {:?}",
            get("host")
        )));
    }
    let auth = get("authorization").ok_or_else(|| denied("missing Authorization"))?;
    let rest = auth
        .strip_prefix("AWS4-HMAC-SHA256 ")
        .ok_or_else(|| denied("not AWS4-HMAC-SHA256"))?;
    let mut credential = None;
    let mut signed = None;
    let mut signature = None;
    for part in rest.split(", ") {
        match part.split_once('=') {
            Some(("Credential", v)) => credential = Some(v),
            Some(("SignedHeaders", v)) => signed = Some(v),
            Some(("Signature", v)) => signature = Some(v),
            _ => return Err(denied(format!("malformed Authorization part {part:?}"))),
        }
    }
    let (Some(credential), Some(signed), Some(signature)) = (credential, signed, signature) else {
        return Err(denied(
            "Authorization lacks Credential, SignedHeaders or Signature",
        ));
    };
    let scope: Vec<&str> = credential.splitn(5, '/').collect();
    let [key_id, date, region, service, terminal] = scope[..] else {
        return Err(denied("malformed credential scope"));
    };
    if key_id != c.access_key_id {
        return Err(denied(
            "The security token included in the request is invalid.",
        ));
    }
    if region != c.region || service != "bedrock" || terminal != "aws4_request" {
        return Err(denied(format!("wrong credential scope {credential}")));
    }
    check_date(get("x-amz-date"), date)?;
    let payload_hash =
        get("x-amz-content-sha256").ok_or_else(|| denied("missing x-amz-content-sha256"))?;
    if payload_hash != hex::encode(Sha256::digest(body)) {
        return Err(denied(
            "x-amz-content-sha256 is not the SHA-256 of the body",
        ));
    }
    let names: Vec<&str> = signed.split(';').collect();
    for required in ["host", "x-amz-date", "x-amz-content-sha256"] {
        if !names.contains(&required) {
            return Err(denied(format!("{required} must be signed")));
        }
    }
    match (&c.session_token, get("x-amz-security-token")) {
        (Some(want), Some(got)) if want == got && names.contains(&"x-amz-security-token") => {}
        (None, None) => {}
        _ => return Err(denied("wrong or unsigned x-amz-security-token")),
    }
    let expected = expected_signature(c, uri, headers, &names, payload_hash, date)?;
    if expected != signature {
        return Err(denied(
            "The request signature we calculated does not match the signature you provided.",
        ));
    }
    Ok(())
}

/// `x-amz-date` is there, within 5 minutes of now, on the scope's date.
fn check_date(amz_date: Option<&str>, scope_date: &str) -> Result<(), Refused> {
    let amz_date = amz_date.ok_or_else(|| denied("missing x-amz-date"))?;
    let t = chrono::NaiveDateTime::parse_from_str(amz_date, "%Y%m%dT%H%M%SZ")
        .map_err(|_| denied("malformed x-amz-date"))?
        .and_utc();
    if amz_date.get(..8) != Some(scope_date) {
        return Err(denied("the credential scope's date is not x-amz-date's"));
    }
    let skew = (t.timestamp() - i64::try_from(unix_now()).unwrap_or(0)).abs();
    if skew > 300 {
        return Err(denied("Signature expired or not yet valid (x-amz-date)"));
    }
    Ok(())
}

fn expected_signature(
    c: &BedrockSimConfig,
    uri: &Uri,
    headers: &HeaderMap,
    names: &[&str],
    payload_hash: &str,
    date: &str,
) -> Result<String, Refused> {
    let canonical_uri: String = uri
        .path()
        .split('/')
        .map(aws_uri_encode)
        .collect::<Vec<_>>()
        .join("/");
    let mut query: Vec<(String, String)> = uri
        .query()
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (aws_uri_encode(k), aws_uri_encode(v))
        })
        .collect();
    query.sort();
    let query = query
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join("&");
    let mut canonical_headers = String::new();
    for name in names {
        let values: Vec<&str> = headers
            .get_all(*name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        if values.is_empty() {
            return Err(denied(format!("signed header {name} is missing")));
        }
        let value = values
            .iter()
            .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect::<Vec<_>>()
            .join(",");
        canonical_headers.push_str(&format!("{name}:{value}\n"));
    }
    let canonical = format!(
        "POST\n{canonical_uri}\n{query}\n{canonical_headers}\n{}\n{payload_hash}",
        names.join(";")
    );
    let amz_date = headers
        .get("x-amz-date")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let scope = format!("{date}/{}/bedrock/aws4_request", c.region);
    let string_to_sign = format!(
        "AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{}",
        hex::encode(Sha256::digest(canonical.as_bytes()))
    );
    let k = hmac(
        format!("AWS4{}", c.secret_access_key).as_bytes(),
        date.as_bytes(),
    );
    let k = hmac(&k, c.region.as_bytes());
    let k = hmac(&k, b"bedrock");
    let k = hmac(&k, b"aws4_request");
    Ok(hex::encode(hmac(&k, string_to_sign.as_bytes())))
}

/// A Converse body as Bedrock validates it.
fn check_body(body: &[u8]) -> Result<(), Refused> {
    let invalid = |why: &str| {
        (
            StatusCode::BAD_REQUEST,
            "ValidationException",
            why.to_string(),
        )
    };
    let v: Value = serde_json::from_slice(body).map_err(|_| invalid("malformed JSON"))?;
    let o = v.as_object().ok_or_else(|| invalid("not an object"))?;
    for k in o.keys() {
        if !matches!(
            k.as_str(),
            "messages" | "system" | "inferenceConfig" | "additionalModelRequestFields"
        ) {
            return Err(invalid(&format!("extraneous key [{k}] is not permitted")));
        }
    }
    let messages = v["messages"]
        .as_array()
        .filter(|m| !m.is_empty())
        .ok_or_else(|| invalid("messages is required"))?;
    if messages[0]["role"] != "user" {
        return Err(invalid("A conversation must start with a user message."));
    }
    for m in messages {
        let ok = matches!(m["role"].as_str(), Some("user" | "assistant"))
            && m["content"]
                .as_array()
                .is_some_and(|c| c.iter().all(|b| b["text"].is_string()));
        if !ok {
            return Err(invalid("each message needs a role and text content blocks"));
        }
    }
    if let Some(cfg) = o.get("inferenceConfig").and_then(Value::as_object) {
        for k in cfg.keys() {
            if !matches!(
                k.as_str(),
                "maxTokens" | "temperature" | "topP" | "stopSequences"
            ) {
                return Err(invalid(&format!("inferenceConfig.{k} is not permitted")));
            }
        }
    }
    Ok(())
}

fn usage() -> Value {
    json!({"inputTokens": USAGE_INPUT, "outputTokens": USAGE_OUTPUT,
           "totalTokens": USAGE_INPUT + USAGE_OUTPUT})
}

fn answer(stream: bool) -> Response {
    if !stream {
        let text: String = DELTAS.concat();
        return axum::Json(json!({
            "output": {"message": {"role": "assistant", "content": [{"text": text}]}},
            "stopReason": "end_turn",
            "usage": usage(),
            "metrics": {"latencyMs": 12},
        }))
        .into_response();
    }
    let mut messages = vec![event("messageStart", &json!({"role": "assistant"}))];
    messages.push(event(
        "contentBlockStart",
        &json!({"contentBlockIndex": 0, "start": {}}),
    ));
    for d in DELTAS {
        messages.push(event(
            "contentBlockDelta",
            &json!({"contentBlockIndex": 0, "delta": {"text": d}}),
        ));
    }
    messages.push(event("contentBlockStop", &json!({"contentBlockIndex": 0})));
    messages.push(event("messageStop", &json!({"stopReason": "end_turn"})));
    messages.push(event(
        "metadata",
        &json!({"usage": usage(), "metrics": {"latencyMs": 12}}),
    ));
    // Each message in three pieces, so frames reach the gateway split.
    let pieces: Vec<Bytes> = messages
        .iter()
        .flat_map(|m| {
            let a = m.len() / 3;
            let b = 2 * m.len() / 3;
            [
                Bytes::copy_from_slice(&m[..a]),
                Bytes::copy_from_slice(&m[a..b]),
                Bytes::copy_from_slice(&m[b..]),
            ]
        })
        .collect();
    let body = futures_util::stream::unfold(pieces.into_iter(), |mut it| async move {
        let piece = it.next()?;
        tokio::time::sleep(Duration::from_millis(2)).await;
        Some((Ok::<_, std::io::Error>(piece), it))
    });
    (
        [("content-type", "application/vnd.amazon.eventstream")],
        axum::body::Body::from_stream(body),
    )
        .into_response()
}

fn crc(bytes: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(bytes);
    h.finalize()
}

/// One event-stream message of `:event-type` `kind`, as AWS writes it.
pub fn event(kind: &str, payload: &Value) -> Vec<u8> {
    let payload = serde_json::to_vec(payload).unwrap();
    let mut headers = Vec::new();
    for (name, value) in [
        (":event-type", kind),
        (":content-type", "application/json"),
        (":message-type", "event"),
    ] {
        headers.push(name.len() as u8);
        headers.extend_from_slice(name.as_bytes());
        headers.push(7);
        headers.extend_from_slice(&(value.len() as u16).to_be_bytes());
        headers.extend_from_slice(value.as_bytes());
    }
    let total = 16 + headers.len() + payload.len();
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&(total as u32).to_be_bytes());
    out.extend_from_slice(&(headers.len() as u32).to_be_bytes());
    let prelude = crc(&out);
    out.extend_from_slice(&prelude.to_be_bytes());
    out.extend_from_slice(&headers);
    out.extend_from_slice(&payload);
    let message = crc(&out);
    out.extend_from_slice(&message.to_be_bytes());
    out
}
