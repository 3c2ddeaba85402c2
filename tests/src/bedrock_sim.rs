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
//! - a Converse body: `messages` (user first, roles alternating; `text`, `image` — png, jpeg,
//!   gif or webp, its `bytes` base64 of an image of that format —, `toolUse` in assistant and
//!   `toolResult` in user messages, each tool use answered by a result in the next message),
//!   `system`, `inferenceConfig` with only the fields Converse knows, `toolConfig` (`tools` of
//!   `toolSpec {name, description?, inputSchema {json}}`, `toolChoice` one of `auto`, `any`,
//!   `tool {name}` of a given tool), required whenever a message holds `toolUse` or
//!   `toolResult` (else 400 `ValidationException`, AWS's words where known);
//! - answers `converse` with JSON and `converse-stream` with real event-stream messages (CRCs),
//!   each message written in several small pieces; usage [`USAGE_INPUT`] / [`USAGE_OUTPUT`].
//!   Given tools, and unless the last message brings tool results, the answer is
//!   [`TOOL_PREAMBLE`] then a call ([`TOOL_USE_ID`], input [`tool_input`]) to the tool
//!   `toolChoice` names, else the first, stopping with `tool_use`. A request header
//!   `x-sim-compress: always-gzip` (not AWS's: a misbehaving upstream) gzips the answer
//!   whatever `accept-encoding` said, frame by frame.
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
/// The text before a tool call.
pub const TOOL_PREAMBLE: &str = "Let me check.";
/// The id of the tool call answered.
pub const TOOL_USE_ID: &str = "tooluse_sim0000000000000001";

/// The input of the tool call answered (streamed in three fragments).
pub fn tool_input() -> Value {
    json!({"city": "Paris", "days": 2})
}

/// What the simulator answers a valid request with.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Reply {
    Text,
    /// A call to this tool.
    ToolUse(String),
}

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
        Ok((stream, reply)) => {
            let answer = answer(stream, &reply);
            let gzip = headers
                .get("x-sim-compress")
                .is_some_and(|v| v.as_bytes() == b"always-gzip");
            let answer = if gzip {
                crate::sim::gzip_response(answer)
            } else {
                answer
            };
            (StatusCode::OK, None, answer)
        }
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

/// The request as AWS checks it: `Ok((stream, reply))` when it may be answered.
fn check(
    c: &BedrockSimConfig,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(bool, Reply), Refused> {
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
    let reply = check_body(body)?;
    Ok((stream, reply))
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

fn invalid(why: impl Into<String>) -> Refused {
    (StatusCode::BAD_REQUEST, "ValidationException", why.into())
}

/// A Converse body as Bedrock validates it, and what to answer it.
fn check_body(body: &[u8]) -> Result<Reply, Refused> {
    let v: Value = serde_json::from_slice(body).map_err(|_| invalid("malformed JSON"))?;
    let o = v.as_object().ok_or_else(|| invalid("not an object"))?;
    for k in o.keys() {
        if !matches!(
            k.as_str(),
            "messages"
                | "system"
                | "inferenceConfig"
                | "additionalModelRequestFields"
                | "toolConfig"
        ) {
            return Err(invalid(format!("extraneous key [{k}] is not permitted")));
        }
    }
    let (tools, forced) = match o.get("toolConfig") {
        Some(c) => check_tool_config(c)?,
        None => (Vec::new(), None),
    };
    let messages = v["messages"]
        .as_array()
        .filter(|m| !m.is_empty())
        .ok_or_else(|| invalid("messages is required"))?;
    check_messages(messages, !tools.is_empty())?;
    if let Some(cfg) = o.get("inferenceConfig").and_then(Value::as_object) {
        for k in cfg.keys() {
            if !matches!(
                k.as_str(),
                "maxTokens" | "temperature" | "topP" | "stopSequences"
            ) {
                return Err(invalid(format!("inferenceConfig.{k} is not permitted")));
            }
        }
    }
    let results_last = messages
        .last()
        .and_then(|m| m["content"].as_array())
        .is_some_and(|c| c.iter().any(|b| b.get("toolResult").is_some()));
    Ok(match (forced, tools.first()) {
        _ if results_last => Reply::Text,
        (Some(name), _) => Reply::ToolUse(name),
        (None, Some(first)) => Reply::ToolUse(first.clone()),
        (None, None) => Reply::Text,
    })
}

/// `toolConfig`: the tools' names, and the one `toolChoice` forces.
fn check_tool_config(c: &Value) -> Result<(Vec<String>, Option<String>), Refused> {
    let o = c
        .as_object()
        .ok_or_else(|| invalid("toolConfig must be an object"))?;
    if let Some(k) = o
        .keys()
        .find(|k| !matches!(k.as_str(), "tools" | "toolChoice"))
    {
        return Err(invalid(format!(
            "extraneous key [toolConfig.{k}] is not permitted"
        )));
    }
    let tools = o
        .get("tools")
        .and_then(Value::as_array)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| invalid("toolConfig.tools must hold at least 1 tool"))?;
    let mut names = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        let spec = t
            .as_object()
            .filter(|t| t.len() == 1)
            .and_then(|t| t.get("toolSpec"))
            .and_then(Value::as_object)
            .ok_or_else(|| invalid(format!("toolConfig.tools.{i} must be a toolSpec")))?;
        let name = spec.get("name").and_then(Value::as_str).unwrap_or_default();
        let name_ok = (1..=64).contains(&name.len())
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !name_ok || names.iter().any(|n| n == name) {
            return Err(invalid(format!(
                "toolConfig.tools.{i}.toolSpec.name {name:?} must match [a-zA-Z0-9_-]{{1,64}} and be unique"
            )));
        }
        for (k, v) in spec {
            let ok = match k.as_str() {
                "name" => true,
                "description" => v.as_str().is_some_and(|d| !d.is_empty()),
                "inputSchema" => {
                    v.as_object().is_some_and(|s| s.len() == 1) && v["json"].is_object()
                }
                _ => false,
            };
            if !ok {
                return Err(invalid(format!(
                    "toolConfig.tools.{i}.toolSpec.{k} is invalid"
                )));
            }
        }
        if spec.get("inputSchema").is_none() {
            return Err(invalid(format!(
                "toolConfig.tools.{i}.toolSpec.inputSchema is required"
            )));
        }
        names.push(name.to_string());
    }
    let forced = match o.get("toolChoice") {
        None => None,
        Some(choice) => check_tool_choice(choice, &names)?,
    };
    Ok((names, forced))
}

/// `toolChoice`: exactly one of `auto {}`, `any {}`, `tool {name}` of a given tool; the tool
/// it forces.
fn check_tool_choice(choice: &Value, names: &[String]) -> Result<Option<String>, Refused> {
    let wrong = || invalid("toolChoice must be {auto:{}}, {any:{}} or {tool:{name}}");
    let (kind, v) = choice
        .as_object()
        .filter(|c| c.len() == 1)
        .and_then(|c| c.iter().next())
        .ok_or_else(wrong)?;
    match (kind.as_str(), v) {
        ("auto" | "any", Value::Object(e)) if e.is_empty() => Ok(None),
        ("tool", t) if t.as_object().is_some_and(|t| t.len() == 1) => {
            let name = t["name"].as_str().unwrap_or_default();
            if !names.iter().any(|n| n == name) {
                return Err(invalid(format!(
                    "toolChoice.tool.name {name:?} is not one of the tools"
                )));
            }
            Ok(Some(name.to_string()))
        }
        _ => Err(wrong()),
    }
}

/// The conversation: user first, roles alternating, every block valid, every tool use of an
/// assistant message answered by exactly its results in the next message.
fn check_messages(messages: &[Value], has_tools: bool) -> Result<(), Refused> {
    if messages[0]["role"] != "user" {
        return Err(invalid(
            "A conversation must start with a user message. Try again with a conversation that starts with a user message.",
        ));
    }
    let mut asked: Vec<String> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let role = match m["role"].as_str() {
            Some(r @ ("user" | "assistant")) => r,
            _ => {
                return Err(invalid(format!(
                    "messages.{i}.role must be user or assistant"
                )));
            }
        };
        if i > 0 && messages[i - 1]["role"] == m["role"] {
            return Err(invalid(
                "A conversation must alternate between user and assistant roles. Make sure the conversation alternates between user and assistant roles and try again.",
            ));
        }
        let content = m["content"]
            .as_array()
            .filter(|c| !c.is_empty())
            .ok_or_else(|| invalid(format!("messages.{i}.content must hold content blocks")))?;
        let mut ids = Vec::new();
        for (j, b) in content.iter().enumerate() {
            if let Some(id) = check_block(b, role, &format!("messages.{i}.content.{j}"))? {
                if !has_tools {
                    return Err(invalid(
                        "The toolConfig field must be defined when using toolUse and toolResult content blocks.",
                    ));
                }
                ids.push(id);
            }
        }
        if role == "user" {
            if ids.len() > asked.len() {
                return Err(invalid(format!(
                    "The number of toolResult blocks at messages.{i}.content exceeds the number of toolUse blocks of previous turn."
                )));
            }
            let missing: Vec<&String> = asked.iter().filter(|id| !ids.contains(id)).collect();
            if !missing.is_empty() {
                return Err(invalid(format!(
                    "Expected toolResult blocks at messages.{i}.content for the following Ids: {missing:?}"
                )));
            }
            asked.clear();
        } else {
            asked = ids;
        }
    }
    Ok(())
}

/// One content block of a `role` message: `Some(id)` of a toolUse / toolResult.
fn check_block(b: &Value, role: &str, at: &str) -> Result<Option<String>, Refused> {
    let (k, v) = b
        .as_object()
        .filter(|o| o.len() == 1)
        .and_then(|o| o.iter().next())
        .ok_or_else(|| invalid(format!("{at} must hold exactly one content member")))?;
    let id = || {
        v["toolUseId"]
            .as_str()
            .filter(|id| !id.is_empty())
            .map(str::to_string)
            .ok_or_else(|| invalid(format!("{at}.{k}.toolUseId is required")))
    };
    match (k.as_str(), role) {
        ("text", _) if v.is_string() => Ok(None),
        ("image", _) => check_image(v, &format!("{at}.image")).map(|()| None),
        ("toolUse", "assistant") => {
            let fields = v.as_object().map_or(0, serde_json::Map::len);
            if fields != 3 || !v["name"].is_string() || !v["input"].is_object() {
                return Err(invalid(format!(
                    "{at}.toolUse needs toolUseId, name and an input object"
                )));
            }
            id().map(Some)
        }
        ("toolResult", "user") => {
            let content = v["content"]
                .as_array()
                .filter(|c| !c.is_empty())
                .ok_or_else(|| invalid(format!("{at}.toolResult.content is required")))?;
            for (n, c) in content.iter().enumerate() {
                let one = c
                    .as_object()
                    .filter(|o| o.len() == 1)
                    .and_then(|o| o.iter().next())
                    .map(|(k, v)| (k.as_str(), v));
                let ok = match one {
                    Some(("text", t)) => t.is_string(),
                    Some(("json", _)) => true,
                    Some(("image", i)) => check_image(i, at).is_ok(),
                    _ => false,
                };
                if !ok {
                    return Err(invalid(format!("{at}.toolResult.content.{n} is invalid")));
                }
            }
            if let Some(k) = v.as_object().and_then(|o| {
                o.keys()
                    .find(|k| !matches!(k.as_str(), "toolUseId" | "content" | "status"))
            }) {
                return Err(invalid(format!("extraneous key [{at}.toolResult.{k}]")));
            }
            if !matches!(
                v.get("status").and_then(Value::as_str),
                None | Some("success" | "error")
            ) {
                return Err(invalid(format!("{at}.toolResult.status is invalid")));
            }
            id().map(Some)
        }
        _ => Err(invalid(format!(
            "{at}: [{k}] is not a valid content block of a {role} message"
        ))),
    }
}

/// An `image` block: a format Converse takes, and base64 bytes of an image of that format.
fn check_image(v: &Value, at: &str) -> Result<(), Refused> {
    let well_formed = v.as_object().is_some_and(|o| o.len() == 2)
        && v["source"].as_object().is_some_and(|s| s.len() == 1);
    let format = v["format"].as_str().unwrap_or_default();
    let magic: &[u8] = match format {
        "png" => b"\x89PNG",
        "jpeg" => b"\xff\xd8\xff",
        "gif" => b"GIF8",
        "webp" => b"RIFF",
        _ => {
            return Err(invalid(format!(
                "{at}.format must be png, jpeg, gif or webp"
            )));
        }
    };
    let bytes = v["source"]["bytes"]
        .as_str()
        .filter(|_| well_formed)
        .and_then(base64_decode)
        .filter(|b| !b.is_empty())
        .ok_or_else(|| invalid(format!("{at}.source.bytes must be base64 image bytes")))?;
    let webp_ok = format != "webp" || bytes.get(8..12) == Some(&b"WEBP"[..]);
    if !bytes.starts_with(magic) || !webp_ok {
        return Err(invalid(format!("{at}: the image is not a {format} image")));
    }
    Ok(())
}

/// Standard base64 with padding, as AWS's JSON protocol carries blobs; `None`: not that.
pub fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let s = s.as_bytes();
    if !s.len().is_multiple_of(4) {
        return None;
    }
    let value = |c: u8| -> Option<u32> {
        Some(u32::from(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        }))
    };
    let quads = s.len() / 4;
    let mut out = Vec::with_capacity(quads * 3);
    for (n, quad) in s.chunks(4).enumerate() {
        let pad = quad.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && n + 1 != quads) {
            return None;
        }
        let mut acc = 0u32;
        for &c in &quad[..4 - pad] {
            acc = (acc << 6) | value(c)?;
        }
        acc <<= 6 * pad as u32;
        out.extend_from_slice(&acc.to_be_bytes()[1..4 - pad]);
    }
    Some(out)
}

fn usage() -> Value {
    json!({"inputTokens": USAGE_INPUT, "outputTokens": USAGE_OUTPUT,
           "totalTokens": USAGE_INPUT + USAGE_OUTPUT})
}

fn answer(stream: bool, reply: &Reply) -> Response {
    if !stream {
        let (content, stop) = match reply {
            Reply::Text => (json!([{"text": DELTAS.concat()}]), "end_turn"),
            Reply::ToolUse(name) => (
                json!([{"text": TOOL_PREAMBLE},
                       {"toolUse": {"toolUseId": TOOL_USE_ID, "name": name, "input": tool_input()}}]),
                "tool_use",
            ),
        };
        return axum::Json(json!({
            "output": {"message": {"role": "assistant", "content": content}},
            "stopReason": stop,
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
    let text: &[&str] = match reply {
        Reply::Text => &DELTAS[..],
        Reply::ToolUse(_) => &[TOOL_PREAMBLE],
    };
    for d in text {
        messages.push(event(
            "contentBlockDelta",
            &json!({"contentBlockIndex": 0, "delta": {"text": d}}),
        ));
    }
    messages.push(event("contentBlockStop", &json!({"contentBlockIndex": 0})));
    let stop = match reply {
        Reply::Text => "end_turn",
        Reply::ToolUse(name) => {
            messages.extend(tool_use_events(name));
            "tool_use"
        }
    };
    messages.push(event("messageStop", &json!({"stopReason": stop})));
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

/// A tool call streamed as Bedrock streams it: in its own block (after the text's), its input
/// JSON in three fragments.
fn tool_use_events(name: &str) -> Vec<Vec<u8>> {
    let mut messages = vec![event(
        "contentBlockStart",
        &json!({"contentBlockIndex": 1,
                "start": {"toolUse": {"toolUseId": TOOL_USE_ID, "name": name}}}),
    )];
    let input = tool_input().to_string();
    let (a, b) = (input.len() / 3, 2 * input.len() / 3);
    for part in [&input[..a], &input[a..b], &input[b..]] {
        messages.push(event(
            "contentBlockDelta",
            &json!({"contentBlockIndex": 1, "delta": {"toolUse": {"input": part}}}),
        ));
    }
    messages.push(event("contentBlockStop", &json!({"contentBlockIndex": 1})));
    messages
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

#[cfg(test)]
mod tests {
    use super::*;

    const PNG: &str = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";

    fn body(v: &Value) -> Result<Reply, String> {
        check_body(v.to_string().as_bytes()).map_err(|(_, _, why)| why)
    }

    fn tools() -> Value {
        json!({"tools": [
            {"toolSpec": {"name": "get_weather", "description": "Weather.",
                "inputSchema": {"json": {"type": "object"}}}},
            {"toolSpec": {"name": "now", "inputSchema": {"json": {"type": "object"}}}}]})
    }

    #[test]
    fn base64_is_decoded_as_aws_carries_blobs() {
        assert_eq!(base64_decode("aGk="), Some(b"hi".to_vec()));
        assert_eq!(base64_decode("aGkh"), Some(b"hi!".to_vec()));
        assert_eq!(base64_decode("aA=="), Some(b"h".to_vec()));
        for bad in ["aGk", "a=Gk", "aGk*", "aA==aGkh", "a==="] {
            assert_eq!(base64_decode(bad), None, "{bad}");
        }
        assert!(base64_decode(PNG).unwrap().starts_with(b"\x89PNG"));
    }

    #[test]
    fn a_tool_conversation_is_valid_and_answered_with_a_call_until_results_come() {
        let user = json!({"role": "user", "content": [{"text": "weather?"},
            {"image": {"format": "png", "source": {"bytes": PNG}}}]});
        assert_eq!(
            body(&json!({"messages": [user], "toolConfig": tools()})),
            Ok(Reply::ToolUse("get_weather".into()))
        );
        let mut forced = tools();
        forced["toolChoice"] = json!({"tool": {"name": "now"}});
        assert_eq!(
            body(&json!({"messages": [user], "toolConfig": forced})),
            Ok(Reply::ToolUse("now".into()))
        );
        let turn = json!({"messages": [user,
            {"role": "assistant", "content": [{"text": "Let me see."},
                {"toolUse": {"toolUseId": "t1", "name": "get_weather", "input": {}}}]},
            {"role": "user", "content": [
                {"toolResult": {"toolUseId": "t1", "content": [{"text": "sunny"}]}},
                {"text": "thanks"}]}],
            "toolConfig": tools()});
        assert_eq!(body(&turn), Ok(Reply::Text));
        assert_eq!(body(&json!({"messages": [user]})), Ok(Reply::Text));
    }

    #[test]
    fn what_aws_refuses_the_simulator_refuses() {
        let user = |content: Value| json!({"role": "user", "content": content});
        let call = json!({"role": "assistant", "content": [
            {"toolUse": {"toolUseId": "t1", "name": "get_weather", "input": {}}}]});
        let result =
            |id: &str| user(json!([{"toolResult": {"toolUseId": id, "content": [{"text": "r"}]}}]));
        for (v, why) in [
            (
                json!({"messages": [user(json!([{"text": "a"}])), user(json!([{"text": "b"}]))]}),
                "alternate",
            ),
            (
                json!({"messages": [user(json!([{"text": "a"}])), call, result("t1")]}),
                "toolConfig field must be defined",
            ),
            (
                json!({"messages": [user(json!([{"text": "a"}])), call, user(json!([{"text": "b"}]))],
                       "toolConfig": tools()}),
                "Expected toolResult blocks",
            ),
            (
                json!({"messages": [user(json!([{"text": "a"}])), call, result("t2")],
                       "toolConfig": tools()}),
                "Expected toolResult blocks",
            ),
            (
                json!({"messages": [user(json!([{"image": {"format": "png", "source": {"bytes": "not base64!"}}}]))]}),
                "base64",
            ),
            (
                json!({"messages": [user(json!([{"image": {"format": "jpeg", "source": {"bytes": PNG}}}]))]}),
                "not a jpeg image",
            ),
            (
                json!({"messages": [user(json!([{"image": {"format": "bmp", "source": {"bytes": PNG}}}]))]}),
                "format",
            ),
            (
                json!({"messages": [user(json!([{"toolUse": {"toolUseId": "t", "name": "x", "input": {}}}]))],
                       "toolConfig": tools()}),
                "not a valid content block of a user message",
            ),
            (
                json!({"messages": [user(json!([{"text": "a"}]))],
                       "toolConfig": {"tools": [{"toolSpec": {"name": "a b", "inputSchema": {"json": {}}}}]}}),
                "toolSpec.name",
            ),
            (
                json!({"messages": [user(json!([{"text": "a"}]))],
                       "toolConfig": {"tools": [{"toolSpec": {"name": "a", "description": "",
                           "inputSchema": {"json": {}}}}]}}),
                "description",
            ),
            (
                json!({"messages": [user(json!([{"text": "a"}]))],
                       "toolConfig": {"tools": [{"toolSpec": {"name": "a", "inputSchema": {"json": {}}}}],
                                      "toolChoice": {"none": {}}}}),
                "toolChoice",
            ),
            (
                json!({"messages": [user(json!([{"text": "a"}]))], "toolConfig": {"tools": []}}),
                "at least 1 tool",
            ),
        ] {
            let e = body(&v).unwrap_err();
            assert!(e.contains(why), "{v}: {e}");
        }
    }
}
