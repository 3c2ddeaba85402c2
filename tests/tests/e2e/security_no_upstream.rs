//! Security e2e (issues 7 and 26 item 11): a refused request never reaches the backend.
//!
//! The stack's default (as the cluster's shipped objects configure the Gateway): the filter's
//! `pauseHeadersForBody` with Envoy's `allow_on_headers_stop_iteration`, so a refusal never even
//! starts an upstream request: Envoy's counter for the model cluster (`upstream_rq_total`) does
//! not move for 401, 403, 400 or 429.
//! The older mode — what an Istio `WasmPlugin` gives, since it cannot set the knob — on a second
//! Envoy: headers go on before the filter reads the body, so a refusal decided on the body (400
//! bad body or model mismatch, 429 token budget) may start an upstream request that the filter
//! then resets: the backend must never receive it complete (the simulator records only complete
//! requests), and refusals decided on the headers still start nothing. On a stack of its own so
//! that no other test moves the counter.

use crate::helpers::*;
use maas_e2e::Stack;
use maas_e2e::extra_envoy::ExtraEnvoy;
use serde_json::{Value, json};
use std::time::Duration;

const POLICY: &str = r#"
tiers:
  - name: free
    level: 0
    groups: [system:authenticated]
    limits:
      requests: [{limit: 2, window: 366d}]
  - name: tokens
    level: 1
    groups: [g-tokens]
    limits:
      tokens: [{limit: 50, window: 366d}]
  - name: premium
    level: 2
    groups: [g-premium]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [free, tokens]
    backend: simulator
  - name: sim-premium
    path: /llm/sim-premium
    tiers: [premium]
    backend: simulator
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: alice-token, username: alice, groups: [system:authenticated]}
  - {token: tina-token, username: tina, groups: [system:authenticated, g-tokens]}
  - {token: alice2-token, username: alice2, groups: [system:authenticated]}
  - {token: tina2-token, username: tina2, groups: [system:authenticated, g-tokens]}
"#;

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    stack_with(&S, POLICY, IDENTITIES, "credentials: {}\n")
}

const CHAT: &str = "/llm/sim-model/v1/chat/completions";

async fn started(admin: &str) -> u64 {
    let text = send(client().get(format!(
        "{admin}/stats?filter=cluster.model-sim.upstream_rq_total"
    )))
    .await
    .body;
    text.lines()
        .find_map(|l| l.strip_prefix("cluster.model-sim.upstream_rq_total: "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn refused_requests_never_start_upstream() {
    let stack = stack();
    check_refusals(
        stack,
        &stack.gateway_url(),
        &stack.envoy_admin_url(),
        "",
        true,
    )
    .await;
}

/// The same through a second Envoy on the same companion and simulator in the older mode
/// (pluginConfig `pauseHeadersForBody` off, no `allow_on_headers_stop_iteration`): headers go on
/// before the body is read.
#[tokio::test]
async fn with_headers_going_on_before_the_body_refused_requests_never_reach_the_backend() {
    let stack = stack();
    let envoy = second_envoy(stack);
    // Users of its own (alice2, tina2): the other test spends alice's and tina's budgets.
    check_refusals(stack, &envoy.gateway_url(), &envoy.admin_url(), "2", false).await;
    drop(envoy);
}

/// Starts another Envoy from the stack's bootstrap in the older mode (stopped on drop).
fn second_envoy(stack: &Stack) -> ExtraEnvoy {
    ExtraEnvoy::beside(stack, "second", false, |v, _| {
        maas_e2e::envoy_config::continue_headers_before_body(v)
    })
    .unwrap_or_else(|e| panic!("the second Envoy did not start: {e:#}"))
}

/// `headers_held`: the mode where no refusal may start an upstream request; else body-stage
/// refusals (400, 429) may start one that is reset before the backend has the whole request.
async fn check_refusals(
    stack: &Stack,
    gateway: &str,
    admin: &str,
    suffix: &str,
    headers_held: bool,
) {
    let alice = format!("Bearer alice{suffix}-token");
    let tina = format!("Bearer tina{suffix}-token");
    let ok = json!({"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]});
    let post = |path: &str, auth: &str, body: &Value, test_id: &str| {
        let mut r = client()
            .post(format!("{gateway}{path}"))
            .header("x-test-id", test_id.to_string())
            .json(body);
        if !auth.is_empty() {
            r = r.header("authorization", auth.to_string());
        }
        r
    };
    // Sanity: an allowed request moves the counter by exactly one.
    let before = started(admin).await;
    let r = send(post(CHAT, &alice, &ok, &format!("nu-sanity{suffix}"))).await;
    assert_eq!(r.status, 200, "{}", r.body);
    eventually(Duration::from_secs(5), || async {
        started(admin).await > before
    })
    .await;
    assert_eq!(started(admin).await, before + 1);

    let tokens = json!({"model": "sim-model", "max_tokens": 40, "messages": [{"role": "user", "content": "x"}]});
    let cases: Vec<(&str, &str, &str, Value, u16)> = vec![
        ("no credential", CHAT, "", ok.clone(), 401),
        ("unknown token", CHAT, "Bearer nobody", ok.clone(), 401),
        (
            "tier not allowed",
            "/llm/sim-premium/v1/chat/completions",
            &alice,
            json!({"model": "sim-premium"}),
            403,
        ),
        (
            "model mismatch",
            CHAT,
            &alice,
            json!({"model": "sim-premium"}),
            400,
        ),
        ("body not an object", CHAT, &alice, json!([1]), 400),
        ("token budget", CHAT, &tina, tokens.clone(), 200),
        ("token budget exceeded", CHAT, &tina, tokens.clone(), 429),
        ("request limit", CHAT, &alice, ok.clone(), 200),
        ("request limit exceeded", CHAT, &alice, ok.clone(), 429),
    ];
    let mut moved = Vec::new();
    for (i, (what, path, auth, body, status)) in cases.into_iter().enumerate() {
        let test_id = format!("nu-refused{suffix}-{i}");
        let before = started(admin).await;
        let r = send(post(path, auth, &body, &test_id)).await;
        assert_eq!(r.status, status, "{what}: {}", r.body);
        if status == 200 {
            eventually(Duration::from_secs(5), || async {
                started(admin).await > before
            })
            .await;
        } else {
            // A refusal must move nothing: a deliberate wait gives a late upstream request
            // time to show (there is no condition to poll for).
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let delta = started(admin).await - before;
        let received = stack.sim_requests_with_test_id(&test_id).len();
        let expected = u64::from(status == 200);
        if received != usize::from(status == 200) {
            moved.push(format!(
                "{what} ({status}): the backend received {received} requests"
            ));
        }
        let body_stage = matches!(status, 400 | 429);
        let acceptable = delta == expected || (!headers_held && body_stage && delta <= 1);
        if !acceptable {
            moved.push(format!(
                "{what} ({status}): {delta} upstream requests started"
            ));
        }
    }
    assert!(
        moved.is_empty(),
        "refused requests reached the backend: {moved:#?}"
    );
}
