//! Reliability e2e (issue 7): bad configuration is refused and nothing passes unfiltered —
//! invalid policy files (the old policy stays in force in the companion and in the filter; a
//! metric and a log line say so; a valid change applies live), and Envoy given a broken
//! pluginConfig (the filter refuses to load, the log names the field, no request reaches the
//! backend).

use crate::helpers::*;
use anyhow::Context;
use maas_e2e::envoy_config::{self, EnvoyConfigInput, WasmFilterOptions};
use maas_e2e::extra_envoy::{ExtraEnvoy, ExtraEnvoyOptions, Ready};
use maas_e2e::sim::{self, SimConfig};
use maas_e2e::stack::free_ports;
use maas_e2e::{Stack, tools};
use maas_types::PolicyDocument;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

/// The policy in force; `{LIMIT}` is the free tier's request limit.
const POLICY_TEMPLATE: &str = r#"
tiers:
  - name: free
    level: 0
    groups: [system:authenticated]
    limits:
      requests: [{limit: {LIMIT}, window: 1d}]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [free]
    backend: simulator
"#;

fn policy(limit: u64) -> String {
    POLICY_TEMPLATE.replace("{LIMIT}", &limit.to_string())
}

const IDENTITIES: &str = r#"
identities:
  - {token: alice-token, username: alice, groups: [system:authenticated]}
"#;

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    static P: OnceLock<String> = OnceLock::new();
    let p: &'static str = P.get_or_init(|| policy(1000));
    stack_with(&S, p, IDENTITIES, "credentials: {}\n")
}

const CHAT: &str = "/llm/sim-model/v1/chat/completions";

/// Invalid policies, each with the free tier's limit changed to 7 (so accepting one would show).
fn invalid_policies() -> Vec<(&'static str, String)> {
    let p7 = policy(7);
    vec![
        ("bad YAML", format!("{p7}\n  - name: [unclosed\n")),
        (
            "unknown tier in a model",
            p7.replace("tiers: [free]", "tiers: [free, ghost]"),
        ),
        ("negative limit", policy(7).replace("limit: 7", "limit: -5")),
        ("window 0m", p7.replace("window: 1d", "window: 0m")),
    ]
}

async fn companion_policy(stack: &Stack) -> (String, Value) {
    let r = send(stack.internal_client().get(format!(
        "{}/internal/v1/policy",
        stack.companion_internal_url()
    )))
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let etag = r.header("etag").expect("policy has an ETag").to_string();
    (etag, r.json())
}

/// The companion's `maas_policy_reload…{result="rejected"}` counter.
async fn rejected_reloads(stack: &Stack) -> u64 {
    let text = send(client().get(format!("{}/metrics", stack.companion_metrics_url())))
        .await
        .body;
    text.lines()
        .filter(|l| l.starts_with("maas_policy_reload") && l.contains("rejected"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

async fn limit_in_force(stack: &Stack) -> Option<String> {
    let body = json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
    let r = chat(
        stack,
        CHAT,
        "pol",
        &[("authorization", "Bearer alice-token")],
        body,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.header("x-ratelimit-limit-requests").map(str::to_string)
}

#[tokio::test]
async fn invalid_policies_are_refused_and_the_old_one_stays_in_force() {
    let stack = stack();
    assert_eq!(limit_in_force(stack).await.as_deref(), Some("1000"));
    let (etag, doc) = companion_policy(stack).await;
    assert_eq!(doc["tiers"][0]["limits"]["requests"][0]["limit"], 1000);
    let filter_updates = metric(stack, "maas_policy_updates").await;

    for (what, yaml) in invalid_policies() {
        let rejected_before = rejected_reloads(stack).await;
        let warnings_before = stack.logs_text().matches("new policy rejected").count();
        stack.replace_policy(&yaml).unwrap();
        let noticed = eventually(Duration::from_secs(10), || async {
            rejected_reloads(stack).await > rejected_before
        })
        .await;
        assert!(noticed.is_some(), "{what}: no rejected-reload metric");
        let log = stack.logs_text();
        assert!(
            log.matches("new policy rejected").count() > warnings_before,
            "{what}: no log line says the policy was rejected"
        );
        // The companion still serves the old document, unchanged.
        let (etag_now, doc_now) = companion_policy(stack).await;
        assert_eq!(etag_now, etag, "{what}: the served policy changed");
        assert_eq!(doc_now, doc, "{what}");
        // And the filter keeps enforcing it a few poll intervals later (a deliberate wait:
        // nothing must change, so there is no condition to poll for).
        tokio::time::sleep(Duration::from_millis(1200)).await;
        assert_eq!(
            limit_in_force(stack).await.as_deref(),
            Some("1000"),
            "{what}: the filter enforces something else"
        );
    }
    assert_eq!(
        metric(stack, "maas_policy_updates").await,
        filter_updates,
        "the filter took a new policy while only invalid ones were written"
    );
    // The rejection log line names what is wrong with the window.
    assert!(
        stack
            .logs_text()
            .lines()
            .any(|l| l.contains("new policy rejected") && l.contains("window")),
        "no rejection line names the window"
    );

    // A valid change applies live, in the companion and in the filter.
    stack.replace_policy(&policy(500)).unwrap();
    let took = eventually(Duration::from_secs(10), || async {
        limit_in_force(stack).await.as_deref() == Some("500")
    })
    .await
    .expect("a valid policy change never reached the filter");
    let (etag_now, doc_now) = companion_policy(stack).await;
    assert_ne!(etag_now, etag);
    assert_eq!(doc_now["tiers"][0]["limits"]["requests"][0]["limit"], 500);
    assert!(
        eventually(Duration::from_secs(5), || async {
            metric_now(stack, "maas_policy_updates").await > filter_updates
        })
        .await
        .is_some(),
        "maas_policy_updates did not count the valid change"
    );
    eprintln!("4 invalid policies refused; a valid change applied after {took:?}");
}

/// Envoy's bootstrap for a gateway whose filter gets `plugin_config` (as JSON text).
fn render_with_plugin_config(
    policy: &PolicyDocument,
    listen: SocketAddr,
    admin: SocketAddr,
    simulator: SocketAddr,
    plugin_config: &str,
) -> anyhow::Result<Value> {
    let local = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
    // No companion: nothing has to listen there.
    let nowhere = free_ports(2)?;
    let rendered = envoy_config::render(&EnvoyConfigInput {
        policy,
        listen,
        admin,
        companion_public: local(nowhere[0]),
        companion_internal: local(nowhere[1]),
        simulator,
        filter: Some(WasmFilterOptions {
            wasm_path: tools::wasm_file()?,
            poll_interval_ms: 500,
        }),
        companion_tls: None,
        usage_events_path: None,
    })?;
    let mut v: Value = serde_json::from_str(&rendered)?;
    let wasm = maas_e2e::envoy_config::wasm_filter_mut(&mut v).context("the wasm filter")?;
    wasm["typed_config"]["config"]["configuration"]["value"] = json!(plugin_config);
    Ok(v)
}

#[test]
fn broken_plugin_config_never_lets_a_request_through() {
    let policy: PolicyDocument = {
        let v: Value = yaml_serde::from_str(&policy(1000)).unwrap();
        PolicyDocument::from_value(v).unwrap()
    };
    let sim = sim::spawn(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        SimConfig {
            chunk_delay: Duration::ZERO,
            models: vec!["sim-model".into()],
            served_only: false,
        },
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    // (broken pluginConfig, a word the error must contain)
    let cases = [
        (
            r#"{"companion": {"cluster": "maas-companion"}, "pollIntervalMs": "fast"}"#,
            "pollIntervalMs",
        ),
        (
            r#"{"companion": {"cluster": "maas-companion"}, "cache": {"maxEntriez": 5}}"#,
            "maxEntriez",
        ),
        (r#"{"companion": {}}"#, "cluster"),
        (
            r#"{"companion": {"cluster": "maas-companion"}, "failureMode": "sometimes"}"#,
            "failureMode",
        ),
        (r#"not json at all"#, "pluginConfig"),
    ];
    let mut outcomes = Vec::new();
    for (i, (plugin_config, field)) in cases.iter().enumerate() {
        // Envoy either exits (the listener cannot be built) or comes up; wait for one of them.
        let options = ExtraEnvoyOptions {
            ready_timeout: Duration::from_secs(30),
            ..ExtraEnvoyOptions::new(&format!("case-{i}"), dir.path(), Ready::AdminOrExit)
        };
        let mut envoy = ExtraEnvoy::start(&options, |ports| {
            render_with_plugin_config(
                &policy,
                ports.listen,
                ports.admin,
                sim.addr(),
                plugin_config,
            )
        })
        .unwrap_or_else(|e| panic!("case {i}: Envoy neither exited nor became ready: {e:#}"));
        let exited = envoy.exited();
        let listen = envoy.ports.listen;
        // Whatever Envoy did, a request with a credential must never reach the backend.
        let mut statuses = Vec::new();
        for _ in 0..5 {
            let status = send_raw_chat(listen);
            if let Some(s) = status {
                assert_ne!(s, 200, "case {i}: a request passed with a broken filter");
            }
            statuses.push(status);
        }
        let log = envoy.log();
        let line = log
            .lines()
            .find(|l| l.contains("invalid configuration") && l.contains(field))
            .unwrap_or("");
        assert!(
            !line.is_empty(),
            "case {i}: the log does not name {field:?}:\n{}",
            tail(&log)
        );
        outcomes.push(format!(
            "case {i} ({field}): envoy {} → requests {statuses:?}; log: {}",
            match exited {
                Some(s) => format!("exited ({s})"),
                None => "up".to_string(),
            },
            line.chars().take(240).collect::<String>()
        ));
        envoy.process.stop(Duration::from_secs(5));
    }
    assert!(
        sim.requests().is_empty(),
        "the backend got requests through a broken filter: {:?}",
        sim.requests()
    );
    for o in &outcomes {
        eprintln!("{o}");
    }
}

fn tail(s: &str) -> &str {
    let start = s.len().saturating_sub(4000);
    let mut start = start;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// A chat request with a plausible credential; `None` when nothing answers.
fn send_raw_chat(listen: SocketAddr) -> Option<u16> {
    let body = r#"{"model":"sim-model","messages":[{"role":"user","content":"hi"}]}"#;
    let headers = [("authorization", "Bearer alice-token")];
    raw_json_request(listen, "POST", CHAT, &headers, body)
        .ok()
        .filter(|&s| s != 0)
}
