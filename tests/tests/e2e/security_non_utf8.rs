//! Security e2e (issue 7): request headers whose values are not UTF-8 (a credential, another
//! header) get a 4xx and never pass — and the filter survives them: later requests on every
//! worker still work. On a stack of its own, since a trap in the filter takes a worker down.

use crate::helpers::*;
use maas_e2e::Stack;
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
const BODY: &str =
    r#"{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#;

/// One raw request on a new connection; the status and body.
fn raw(addr: SocketAddr, test_id: &str, header: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut req = format!(
        "POST {CHAT} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\nx-test-id: {test_id}\r\nContent-Length: {}\r\nConnection: close\r\n",
        BODY.len()
    )
    .into_bytes();
    req.extend_from_slice(header);
    req.extend_from_slice(b"\r\n\r\n");
    req.extend_from_slice(BODY.as_bytes());
    s.write_all(&req).unwrap();
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status: {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

#[test]
fn non_utf8_header_values_are_refused_and_the_filter_survives() {
    let stack = stack();
    let addr = stack.gateway_addr();
    let cases: [(&str, &[u8]); 4] = [
        (
            "non-UTF-8 bearer token",
            b"Authorization: Bearer \xff\xfe\xfd",
        ),
        ("non-UTF-8 x-api-key", b"x-api-key: sk-oai-\xc3\x28"),
        ("latin-1 token", b"Authorization: Bearer alic\xe9-token"),
        (
            "non-UTF-8 other header",
            b"Authorization: Bearer alice-token\r\nx-note: caf\xe9",
        ),
    ];
    for (i, (what, header)) in cases.iter().enumerate() {
        let id = format!("nu-{i}");
        let (status, body) = raw(addr, &id, header);
        if i < 3 {
            assert!((400..500).contains(&status), "{what}: {status} {body}");
            assert!(
                stack.sim_requests_with_test_id(&id).is_empty(),
                "{what}: reached the model"
            );
        } else {
            // A valid credential with an odd unrelated header: refused or passed, never 5xx.
            assert!(status < 500, "{what}: {status} {body}");
        }
    }
    // Every worker still serves (Envoy runs 2; new connections spread over them).
    for n in 0..20 {
        let (status, body) = raw(addr, "nu-after", b"Authorization: Bearer alice-token");
        assert_eq!(status, 200, "request {n} after the bad headers: {body}");
    }
    stack.check_alive().unwrap();
}
