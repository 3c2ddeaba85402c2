//! Logs without personal data (issue 32): after a full run — keys minted, listed and revoked,
//! calls allowed, limited and refused, a bad key, the usage ledger written and read by an admin
//! and by the user — no log of the stack (companion, Envoy with the filter, PostgreSQL) names a
//! user in clear: the companion writes keyed pseudonyms (`u-` and 16 hex digits) unless an
//! operator turns clear names on, and the filter logs no subject at all. Usernames are chosen
//! so that no other text could contain them by chance.

use crate::helpers::{ModuleStack, bearer, client, send};
use maas_e2e::Stack;
use serde_json::json;
use std::time::{Duration, Instant};

const POLICY: &str = r#"
tiers:
  - name: free
    level: 0
    groups: [g-free]
    limits:
      requests: [{limit: 4, window: 1d}]
  - name: locked
    level: 1
    groups: [g-nobody]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [free]
    backend: simulator
  - name: sim-locked
    path: /llm/sim-locked
    tiers: [locked]
    backend: simulator
"#;

/// The users whose names must never reach a log.
const USERS: [&str; 2] = ["zorblax-quintessa", "admin-vexmorrow"];

const IDENTITIES: &str = r#"
identities:
  - {token: zorb-token, username: zorblax-quintessa, groups: [g-free]}
  - {token: vex-token, username: admin-vexmorrow, groups: [g-free, maas-admins]}
"#;

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    crate::helpers::stack_with_plugin_config(
        &S,
        POLICY,
        IDENTITIES,
        "credentials: {}\n",
        Some(json!({"usage": {"reportIntervalMs": 300}})),
    )
}

async fn full_run(stack: &Stack) {
    let gw = stack.gateway_url();
    let minted = stack
        .mint_key("zorb-token", json!({"name": "privacy-key"}))
        .await
        .expect("minted");
    let key = minted["key"].as_str().expect("a key").to_string();
    let id = minted["id"].as_str().expect("an id").to_string();
    let chat = json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]});
    let mut statuses = Vec::new();
    // Allowed until the tier's 4 requests are spent, then limited.
    for _ in 0..6 {
        let r = send(
            client()
                .post(format!("{gw}/llm/sim-model/v1/chat/completions"))
                .header("authorization", bearer(&key))
                .json(&chat),
        )
        .await;
        statuses.push(r.status);
    }
    // A model outside the tier, a bad key, a token whose user is unknown.
    for (path, cred) in [
        ("/llm/sim-locked/v1/chat/completions", key.as_str()),
        (
            "/llm/sim-model/v1/chat/completions",
            "sk-oai-not-a-real-key",
        ),
        ("/v1/chat/completions", "vex-token"),
    ] {
        let r = send(
            client()
                .post(format!("{gw}{path}"))
                .header("authorization", bearer(cred))
                .json(&chat),
        )
        .await;
        statuses.push(r.status);
    }
    for want in [200, 429, 403, 401] {
        assert!(statuses.contains(&want), "no {want}: {statuses:?}");
    }
    // The key API: list, search, revoke; the ledger as the user and as an admin.
    let searched = send(
        client()
            .post(format!("{gw}/maas-api/v1/api-keys/search"))
            .header("authorization", bearer("zorb-token"))
            .json(&json!({})),
    )
    .await;
    assert_eq!(searched.status, 200, "{}", searched.body);
    for (method, path, cred) in [
        ("GET", "/maas-api/v1/usage", "zorb-token"),
        ("GET", "/maas-api/v1/usage?user=*&groupBy=user", "vex-token"),
        ("GET", "/maas-api/v1/quota", "zorb-token"),
    ] {
        let r = send(
            client()
                .request(method.parse().expect("method"), format!("{gw}{path}"))
                .header("authorization", bearer(cred)),
        )
        .await;
        assert_eq!(r.status, 200, "{path}: {}", r.body);
    }
    let _ = send(
        client()
            .delete(format!("{gw}/maas-api/v1/api-keys/{id}"))
            .header("authorization", bearer("zorb-token")),
    )
    .await;
}

#[tokio::test]
async fn no_log_of_a_full_run_names_a_user_in_clear() {
    let stack = stack();
    full_run(stack).await;
    // The ledger shows the calls (the filter's reports went through the companion's logs).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = send(
            client()
                .get(format!(
                    "{}/maas-api/v1/usage?user=*&groupBy=user",
                    stack.gateway_url()
                ))
                .header("authorization", bearer("vex-token")),
        )
        .await;
        if r.body.contains("zorblax-quintessa") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the ledger never showed the calls: {}",
            r.body
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let logs = stack.log_paths();
    assert!(
        logs.len() >= 3,
        "companion, Envoy and PostgreSQL logs: {logs:?}"
    );
    let mut read = 0;
    let mut pseudonyms = 0;
    let pseudonym = regex::Regex::new(r"\bu-[0-9a-f]{16}\b").expect("regex");
    for path in &logs {
        let text = String::from_utf8_lossy(&std::fs::read(path).unwrap_or_default()).into_owned();
        read += text.len();
        for user in USERS {
            assert!(
                !text.contains(user),
                "{} names {user} in clear:\n{}",
                path.display(),
                text.lines()
                    .filter(|l| l.contains(user))
                    .take(5)
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
        pseudonyms += pseudonym.find_iter(&text).count();
    }
    assert!(
        read > 1000,
        "the logs hold almost nothing ({read} bytes): the test would prove nothing"
    );
    assert!(
        pseudonyms > 0,
        "no pseudonym in any log: the users are not logged at all here"
    );
}
