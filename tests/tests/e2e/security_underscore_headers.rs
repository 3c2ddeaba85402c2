//! Security e2e (issue 26 item 5): no spelling of the gateway's identity or credential headers
//! reaches a backend. CGI, WSGI and PHP servers read `x_maas_user`, `X_MAAS_USER` and
//! `x-maas-user` alike (`HTTP_X_MAAS_USER`), so every spelling that normalises to a reserved name
//! (`_` as `-`, any case) must go.
//!
//! Two walls, each shown alone:
//! - the gateway's connection manager refuses any request carrying a header whose name has an
//!   underscore (`headers_with_underscores_action: REJECT_REQUEST`, as the stack renders it and
//!   the cluster's EnvoyFilter maas-gateway-connection-manager sets it): HTTP/1.1 → 400 from
//!   Envoy, HTTP/2 → the stream is reset; the simulator receives nothing;
//! - without that setting (an Envoy of its own beside the stack, Envoy's default ALLOW), the
//!   filter removes every such spelling itself: the request is answered 200 and the simulator
//!   receives none of them.
//!
//! Both over HTTP/1.1 (header names written as given, upper case included) and HTTP/2 (h2c;
//! HTTP/2 names are lower case by definition).

use crate::helpers::*;
use maas_e2e::Stack;
use maas_e2e::extra_envoy::ExtraEnvoy;
use maas_e2e::h2client::{self, FramedRequest};
use serde_json::json;
use std::net::SocketAddr;

const POLICY: &str = r#"
tiers:
  - name: free
    level: 0
    groups: [system:authenticated]
    limits:
      requests: [{limit: 100000, window: 1d}]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [free]
    backend: simulator
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: alice-token, username: alice, groups: [system:authenticated]}
"#;

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    stack_with(&S, POLICY, IDENTITIES, "credentials: {}\n")
}

const CHAT: &str = "/llm/sim-model/v1/chat/completions";

/// Spellings of the reserved namespace and of the credential headers that a CGI/WSGI backend
/// reads as `HTTP_X_MAAS_*` / `HTTP_X_API_KEY`.
const SPELLINGS: [&str; 6] = [
    "x_maas_user",
    "X_MAAS_USER",
    "x-maas_groups",
    "X_Maas-Subscription",
    "x_maas_subject",
    "x_api_key",
];

fn body() -> serde_json::Value {
    json!({"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
}

/// The spelling's header in a normalised form (`_` as `-`, lower case).
fn normalised(name: &str) -> String {
    name.to_ascii_lowercase().replace('_', "-")
}

/// HTTP/1.1, header names as written; the status.
fn http1(addr: SocketAddr, header: &str, test_id: &str) -> u16 {
    raw_json_request(
        addr,
        "POST",
        CHAT,
        &[
            ("authorization", "Bearer alice-token"),
            ("x-test-id", test_id),
            (header, "admin"),
        ],
        &body().to_string(),
    )
    .unwrap_or_else(|e| panic!("{header}: {e}"))
}

/// HTTP/2 (h2c); the status, or the error of a reset stream.
async fn http2(addr: SocketAddr, header: &str, test_id: &str) -> Result<u16, String> {
    let req = FramedRequest::post_json(CHAT, &body())
        .header("authorization", "Bearer alice-token")
        .header("x-test-id", test_id)
        .header(&header.to_ascii_lowercase(), "admin");
    h2client::send_h2c(addr, &req)
        .await
        .map(|r| r.status)
        .map_err(|e| format!("{e:#}"))
}

/// Names of the headers the simulator received for `test_id` that a backend would read as a
/// reserved or credential header.
fn forged_at_backend(stack: &Stack, test_id: &str) -> Vec<String> {
    stack
        .sim_requests_with_test_id(test_id)
        .iter()
        .flat_map(|r| r.headers.iter())
        .map(|(k, _)| normalised(k))
        .filter(|k| k.starts_with("x-maas-") || k == "x-api-key")
        .collect()
}

async fn admin_counter(admin: &str, name: &str) -> u64 {
    let text = send(client().get(format!("{admin}/stats?filter={name}")))
        .await
        .body;
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn the_gateway_refuses_underscore_spellings_over_http1_and_http2() {
    let stack = stack();
    let addr = stack.gateway_addr();
    let admin = stack.envoy_admin_url();
    // The same request without the header goes through: the refusals below are the header's.
    assert_eq!(
        http1(addr, "x-request-tag", "us-control-1"),
        200,
        "a request without an underscore header"
    );
    assert_eq!(http2(addr, "x-request-tag", "us-control-2").await, Ok(200));
    let h1_before = admin_counter(
        &admin,
        "http1.requests_rejected_with_underscores_in_headers",
    )
    .await;
    let h2_before = admin_counter(
        &admin,
        "http2.requests_rejected_with_underscores_in_headers",
    )
    .await;
    let mut wrong = Vec::new();
    for (i, header) in SPELLINGS.iter().enumerate() {
        let id = format!("us-reject-h1-{i}");
        let status = http1(addr, header, &id);
        if status != 400 {
            wrong.push(format!("HTTP/1.1 {header}: {status}, expected 400"));
        }
        if !stack.sim_requests_with_test_id(&id).is_empty() {
            wrong.push(format!(
                "HTTP/1.1 {header}: the backend received the request"
            ));
        }
        let id = format!("us-reject-h2-{i}");
        match http2(addr, header, &id).await {
            // Envoy resets the stream (RST_STREAM INTERNAL_ERROR, as h2 reports it).
            Err(e) if e.contains("stream error received") => {}
            other => wrong.push(format!(
                "HTTP/2 {header}: {other:?}, expected a reset stream"
            )),
        }
        if !stack.sim_requests_with_test_id(&id).is_empty() {
            wrong.push(format!("HTTP/2 {header}: the backend received the request"));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    let n = SPELLINGS.len() as u64;
    assert_eq!(
        admin_counter(
            &admin,
            "http1.requests_rejected_with_underscores_in_headers"
        )
        .await,
        h1_before + n
    );
    assert_eq!(
        admin_counter(
            &admin,
            "http2.requests_rejected_with_underscores_in_headers"
        )
        .await,
        h2_before + n
    );
}

/// The filter alone: an Envoy beside the stack without the connection manager's setting lets
/// the spellings in, and the filter removes every one before the backend.
#[tokio::test]
async fn without_the_gateway_setting_the_filter_removes_every_spelling() {
    let stack = stack();
    let envoy = ExtraEnvoy::beside(stack, "allow-underscores", false, |v, _| {
        maas_e2e::envoy_config::allow_underscore_headers(v)
    })
    .unwrap_or_else(|e| panic!("the second Envoy did not start: {e:#}"));
    let addr = envoy.ports.listen;
    let mut wrong = Vec::new();
    for (i, header) in SPELLINGS.iter().enumerate() {
        let id = format!("us-allow-h1-{i}");
        let status = http1(addr, header, &id);
        if status != 200 {
            wrong.push(format!("HTTP/1.1 {header}: {status}, expected 200"));
        }
        let id2 = format!("us-allow-h2-{i}");
        match http2(addr, header, &id2).await {
            Ok(200) => {}
            other => wrong.push(format!("HTTP/2 {header}: {other:?}, expected 200")),
        }
        for (wire, id) in [("HTTP/1.1", &id), ("HTTP/2", &id2)] {
            if stack.sim_requests_with_test_id(id).len() != 1 {
                wrong.push(format!("{wire} {header}: not forwarded once"));
            }
            let forged = forged_at_backend(stack, id);
            if !forged.is_empty() {
                wrong.push(format!("{wire} {header}: the backend received {forged:?}"));
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    // Envoy let them through to the filter: the setting really is off there.
    assert_eq!(
        admin_counter(
            &envoy.admin_url(),
            "http1.requests_rejected_with_underscores_in_headers"
        )
        .await,
        0
    );
    drop(envoy);
}
