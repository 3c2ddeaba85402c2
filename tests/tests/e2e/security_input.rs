//! Security e2e (issue 7): bad input is refused — oversized headers and bodies, invalid JSON,
//! non-UTF-8, duplicate `Authorization`, other schemes, tokens with spaces or control characters
//! (4xx, a JSON error when the filter answers, never 5xx, never a pass: the simulator sees
//! nothing), and path tricks that must not reach the internal API or a model the caller's tier
//! may not use. Requests are written byte for byte on a raw socket, so no client library
//! normalises or refuses them first.

use crate::helpers::*;
use maas_e2e::Stack;
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

const POLICY: &str = r#"
tiers:
  - name: free
    level: 0
    groups: [system:authenticated]
    limits:
      requests: [{limit: 100000, window: 1d}]
  - name: premium
    level: 1
    groups: [tier-premium-users]
    limits:
      requests: [{limit: 100000, window: 1d}]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [free, premium]
    backend: simulator
  - name: sim-premium
    path: /llm/sim-premium
    tiers: [premium]
    backend: simulator
  - name: gpt-ext
    path: /ext/openai
    tiers: [premium]
    backend: simulator
    provider: {type: openai, credentialRef: openai-key}
    upstreamCluster: ext-openai
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: alice-token, username: alice, groups: [system:authenticated]}
  - {token: bob-token, username: bob, groups: [system:authenticated, tier-premium-users]}
"#;

const CREDENTIALS: &str = "credentials:\n  openai-key: sk-prov-secret-openai\n";

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    stack_with(&S, POLICY, IDENTITIES, CREDENTIALS)
}

const CHAT: &str = "/llm/sim-model/v1/chat/completions";
const BODY: &str =
    r#"{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#;

struct Raw {
    status: u16,
    content_type: String,
    body: String,
}

/// Sends `head` (request line and headers, each ending in CRLF, without the blank line) and
/// `body` as bytes; a Content-Length is added when `body` is non-empty and `head` has none.
fn raw(addr: SocketAddr, head: &[u8], body: &[u8]) -> Raw {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut req = head.to_vec();
    let lower = String::from_utf8_lossy(head).to_ascii_lowercase();
    if !body.is_empty() && !lower.contains("content-length:") {
        req.extend_from_slice(format!("Content-Length: {}\r\n", body.len()).as_bytes());
    }
    req.extend_from_slice(b"Connection: close\r\n\r\n");
    req.extend_from_slice(body);
    // Envoy may answer (and close) before reading an oversized request: ignore write errors.
    let _ = s.write_all(&req);
    let buf = read_response(&mut s);
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in answer: {text:?}"));
    let header = |name: &str| {
        head.lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim().to_string())
    };
    let body = if header("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    Raw {
        status,
        content_type: header("content-type").unwrap_or_default(),
        body,
    }
}

/// Reads one response: up to its Content-Length or last chunk (Envoy delays closing the
/// connection by a second after a local reply, so reading to EOF would wait for nothing).
fn read_response(s: &mut TcpStream) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    loop {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return buf,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
        let body_len = buf.len() - end - 4;
        let length = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok());
        match length {
            Some(n) if body_len >= n => return buf,
            Some(_) => {}
            None if head.contains("transfer-encoding: chunked") && buf.ends_with(b"0\r\n\r\n") => {
                return buf;
            }
            None => {}
        }
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

fn head(method: &str, path: &str, test_id: &str, headers: &[&[u8]]) -> Vec<u8> {
    let mut h = format!(
        "{method} {path} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\nx-test-id: {test_id}\r\n"
    )
    .into_bytes();
    for line in headers {
        h.extend_from_slice(line);
        h.extend_from_slice(b"\r\n");
    }
    h
}

/// A refusal: 4xx, never 5xx; a JSON error unless Envoy's codec refused the bytes before any
/// filter ran (then Envoy's plain-text local reply). Returns whether it was JSON.
fn assert_refused(what: &str, r: &Raw) -> bool {
    assert!(
        (400..500).contains(&r.status),
        "{what}: expected a 4xx, got {} {}",
        r.status,
        r.body
    );
    let json = serde_json::from_str::<Value>(&r.body)
        .ok()
        .filter(|v| v["error"]["message"].is_string() && v["error"]["type"].is_string());
    if r.content_type.starts_with("application/json") {
        assert!(
            json.is_some(),
            "{what}: JSON content type but not an error body: {}",
            r.body
        );
    }
    json.is_some()
}

#[test]
// One scenario read top to bottom (its steps share the stack state they build): over 100 lines.
#[allow(clippy::too_many_lines)]
fn bad_requests_get_4xx_never_5xx_never_a_pass() {
    let stack = stack();
    let addr = stack.gateway_addr();
    let key = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(stack.mint_key_plain("alice-token", "bad-input"))
        .unwrap();
    let auth = format!("Authorization: Bearer {key}");
    let auth = auth.as_bytes();
    // Sanity: the same request, well formed, passes.
    let ok = raw(
        addr,
        &head("POST", CHAT, "bi-sanity", &[auth]),
        BODY.as_bytes(),
    );
    assert_eq!(ok.status, 200, "{}", ok.body);

    let big_header = format!("x-big: {}", "a".repeat(100 * 1024));
    let many_headers: Vec<String> = (0..200)
        .map(|i| format!("x-h{i}: {}", "b".repeat(400)))
        .collect();
    let mut many: Vec<&[u8]> = many_headers.iter().map(|h| h.as_bytes()).collect();
    many.push(auth);
    let big_body = format!(
        r#"{{"model":"sim-model","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "w ".repeat(1024 * 1024)
    );
    let long_token = format!("Authorization: Bearer {}", "t".repeat(20 * 1024));
    let cases: Vec<(&str, Vec<u8>, Vec<u8>)> = vec![
        (
            "oversized header",
            head("POST", CHAT, "bi-1", &[auth, big_header.as_bytes()]),
            BODY.into(),
        ),
        (
            "many large headers",
            head("POST", CHAT, "bi-2", &many),
            BODY.into(),
        ),
        (
            "oversized body",
            head("POST", CHAT, "bi-3", &[auth]),
            big_body.into_bytes(),
        ),
        (
            "invalid JSON body",
            head("POST", CHAT, "bi-4", &[auth]),
            br#"{"model": "sim-model", "messages": ["#.to_vec(),
        ),
        (
            "JSON not an object",
            head("POST", CHAT, "bi-5", &[auth]),
            b"[1,2,3]".to_vec(),
        ),
        (
            "non-UTF-8 body",
            head("POST", CHAT, "bi-6", &[auth]),
            b"{\"model\":\"sim-\xff\xfemodel\"}".to_vec(),
        ),
        // Non-UTF-8 header values: tests/tests/e2e/security_non_utf8.rs (a stack of its own).
        (
            "x-api-key, key prefix, bad chars",
            head("POST", CHAT, "bi-7", &[b"x-api-key: sk-oai-!!"]),
            BODY.into(),
        ),
        (
            "x-api-key empty",
            head("POST", CHAT, "bi-8", &[b"x-api-key: "]),
            BODY.into(),
        ),
        (
            "duplicate Authorization (same)",
            head("POST", CHAT, "bi-9", &[auth, auth]),
            BODY.into(),
        ),
        (
            "duplicate Authorization (other)",
            head(
                "POST",
                CHAT,
                "bi-10",
                &[auth, b"Authorization: Bearer alice-token"],
            ),
            BODY.into(),
        ),
        (
            "Basic scheme",
            head(
                "POST",
                CHAT,
                "bi-11",
                &[b"Authorization: Basic YWxpY2U6YWxpY2UtdG9rZW4="],
            ),
            BODY.into(),
        ),
        (
            "Digest scheme",
            head(
                "POST",
                CHAT,
                "bi-12",
                &[b"Authorization: Digest username=\"alice\""],
            ),
            BODY.into(),
        ),
        (
            "bare token, no scheme",
            head("POST", CHAT, "bi-13", &[b"Authorization: alice-token"]),
            BODY.into(),
        ),
        (
            "Bearer with no token",
            head("POST", CHAT, "bi-14", &[b"Authorization: Bearer"]),
            BODY.into(),
        ),
        (
            "token with a space",
            head(
                "POST",
                CHAT,
                "bi-15",
                &[b"Authorization: Bearer alice -token"],
            ),
            BODY.into(),
        ),
        (
            "token with a tab",
            head(
                "POST",
                CHAT,
                "bi-16",
                &[b"Authorization: Bearer alice\t-token"],
            ),
            BODY.into(),
        ),
        (
            "token with a control char",
            head(
                "POST",
                CHAT,
                "bi-17",
                &[b"Authorization: Bearer alice\x01-token"],
            ),
            BODY.into(),
        ),
        (
            "token with NUL",
            head(
                "POST",
                CHAT,
                "bi-18",
                &[b"Authorization: Bearer alice\x00-token"],
            ),
            BODY.into(),
        ),
        (
            "x-api-key with a space",
            head("POST", CHAT, "bi-19", &[b"x-api-key: sk-oai-abc def"]),
            BODY.into(),
        ),
        (
            "key prefix, wrong shape",
            head(
                "POST",
                CHAT,
                "bi-20",
                &[b"Authorization: Bearer sk-oai-AAAAAAAAAAAAAAAAA_short"],
            ),
            BODY.into(),
        ),
        (
            "very long token",
            head("POST", CHAT, "bi-21", &[long_token.as_bytes()]),
            BODY.into(),
        ),
        (
            "no credential",
            head("POST", CHAT, "bi-22", &[]),
            BODY.into(),
        ),
        (
            "body names another model",
            head("POST", CHAT, "bi-23", &[auth]),
            br#"{"model":"sim-premium"}"#.to_vec(),
        ),
        (
            "negative max_tokens",
            head("POST", CHAT, "bi-24", &[auth]),
            br#"{"model":"sim-model","max_tokens":-5}"#.to_vec(),
        ),
        (
            "huge max_tokens",
            head("POST", CHAT, "bi-25", &[auth]),
            br#"{"model":"sim-model","max_tokens":1e300}"#.to_vec(),
        ),
        (
            "model not a string",
            head("POST", CHAT, "bi-26", &[auth]),
            br#"{"model":["sim-model"]}"#.to_vec(),
        ),
        (
            "duplicate model keys",
            head("POST", CHAT, "bi-27", &[auth]),
            br#"{"model":"sim-model","model":"sim-premium"}"#.to_vec(),
        ),
    ];
    let mut summary = Vec::new();
    for (i, (what, h, body)) in cases.iter().enumerate() {
        let r = raw(addr, h, body);
        let json = assert_refused(what, &r);
        summary.push(format!(
            "{what}: {}{}",
            r.status,
            if json { " json" } else { " (envoy)" }
        ));
        let id = format!("bi-{}", i + 1);
        assert!(
            stack.sim_requests_with_test_id(&id).is_empty(),
            "{what}: the request reached the model"
        );
    }
    // Nothing reached the model, by any id.
    let leaked: Vec<_> = stack
        .sim_requests()
        .into_iter()
        .filter(|r| {
            r.header("x-test-id")
                .is_some_and(|t| t.starts_with("bi-") && t != "bi-sanity")
        })
        .collect();
    assert!(leaked.is_empty(), "{leaked:?}");
    // The filter keeps working after all of that.
    let ok = raw(
        addr,
        &head("POST", CHAT, "bi-sanity", &[auth]),
        BODY.as_bytes(),
    );
    assert_eq!(ok.status, 200, "{}", ok.body);
    stack.check_alive().unwrap();
    for s in &summary {
        eprintln!("{s}");
    }
}

#[test]
// One scenario read top to bottom (its steps share the stack state they build): over 100 lines.
#[allow(clippy::too_many_lines)]
fn path_tricks_reach_neither_the_internal_api_nor_a_forbidden_model() {
    let stack = stack();
    let addr = stack.gateway_addr();
    let internal = [
        "/maas-api/internal/v1/policy",
        "/maas-api/internal/v1/credentials",
        "/maas-api//internal/v1/credentials",
        "/maas-api/%2Finternal/v1/credentials",
        "/maas-api/internal%2Fv1%2Fcredentials",
        "/maas-api%2Finternal/v1/credentials",
        "/maas-api/v1/../internal/v1/credentials",
        "/maas-api/v1/%2E%2E/internal/v1/credentials",
        "/maas-api/./internal/v1/credentials",
        "/maas-api/INTERNAL/v1/credentials",
        "/maas-api/Internal/v1/policy",
        "/MAAS-API/internal/v1/credentials",
        "/maas-api/internal;/v1/credentials",
        "/maas-api/internal/v1/credentials;",
        "/maas-api/internal/v1/credentials?x=1",
        "/llm/sim-model/../../maas-api/internal/v1/credentials",
        "/llm/sim-model/%2E%2E/%2E%2E/maas-api/internal/v1/credentials",
        "/internal/v1/credentials",
        "//internal/v1/credentials",
        "/maas-api/..%2Finternal/v1/credentials",
        "/maas-api\\internal\\v1\\credentials",
    ];
    let mut summary = Vec::new();
    for (method, body) in [
        ("GET", &b""[..]),
        ("POST", &br#"{"credential":"alice-token"}"#[..]),
    ] {
        for path in internal {
            let r = raw(
                addr,
                &head(
                    method,
                    path,
                    "pt-int",
                    &[b"Authorization: Bearer bob-token"],
                ),
                body,
            );
            assert!(
                (400..500).contains(&r.status),
                "{method} {path}: {} {}",
                r.status,
                r.body
            );
            for secret in [
                "sk-prov-secret-openai",
                "revokedKeyIds",
                "\"subject\"",
                "\"tiers\"",
            ] {
                assert!(
                    !r.body.contains(secret),
                    "{method} {path} reached the internal API: {}",
                    r.body
                );
            }
            summary.push(format!("{method} {path}: {}", r.status));
        }
    }
    // alice (free) must not get to sim-premium (premium only) by any spelling, nor to the
    // premium external model.
    let premium = [
        "/llm/sim-premium/v1/chat/completions",
        "/llm/sim-model/../sim-premium/v1/chat/completions",
        "/llm/sim-model/%2E%2E/sim-premium/v1/chat/completions",
        "/llm/sim-model%2F..%2Fsim-premium/v1/chat/completions",
        "/llm//sim-premium/v1/chat/completions",
        "/llm/sim-premium;/v1/chat/completions",
        "/llm/sim-premium/v1/chat/completions;",
        "/llm/sim-model;/../sim-premium/v1/chat/completions",
        "/LLM/SIM-PREMIUM/v1/chat/completions",
        "/llm/Sim-Premium/v1/chat/completions",
        "/llm/sim-model/v1/../../sim-premium/v1/chat/completions",
        "/ext/openai/v1/chat/completions",
        "/llm/sim-model/../../ext/openai/v1/chat/completions",
        "/llm/sim-model/%2e%2e/%2e%2e/ext/openai/v1/chat/completions",
    ];
    for (n, path) in premium.iter().enumerate() {
        for model in ["sim-premium", "sim-model", "gpt-ext"] {
            let id = format!("pt-prem-{n}-{model}");
            let body = format!(
                r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":1}}"#
            );
            let r = raw(
                addr,
                &head("POST", path, &id, &[b"Authorization: Bearer alice-token"]),
                body.as_bytes(),
            );
            assert!(
                (400..500).contains(&r.status),
                "{path} ({model}) as free alice: {} {}",
                r.status,
                r.body
            );
            assert!(
                stack.sim_requests_with_test_id(&id).is_empty(),
                "{path} ({model}) reached a model"
            );
        }
        summary.push(format!("POST {path} as free: refused"));
    }
    // The premium model works for a premium user (the paths above would have reached it).
    let r = raw(
        addr,
        &head(
            "POST",
            "/llm/sim-premium/v1/chat/completions",
            "pt-bob",
            &[b"Authorization: Bearer bob-token"],
        ),
        br#"{"model":"sim-premium","messages":[{"role":"user","content":"hi"}],"max_tokens":1}"#,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    stack.check_alive().unwrap();
    eprintln!("{} path tricks refused", summary.len());
}
