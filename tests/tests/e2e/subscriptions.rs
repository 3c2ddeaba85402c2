//! Subscriptions through real Envoy with the release .wasm (issue 15): a key bound at mint
//! (named or by default) is held to its subscription's token budget, per subscription; a token
//! caller selects with `X-MaaS-Subscription` (refused `multiple_subscriptions` without it when
//! two match); a subscription without the model is a 403; the backend sees the subscription the
//! gateway selected, never the client's header; the listings through the gateway; bulk revoke
//! by subscription (dry run, then for real) is refused by the gateway within one poll.
//!
//! Windows are a day long so that no test straddles a window boundary.

use crate::helpers::*;
use maas_e2e::Stack;
use serde_json::{Value, json};
use std::sync::OnceLock;
use std::time::Duration;

const POLICY: &str = r#"
tiers:
  - name: free
    level: 0
    groups: [system:authenticated]
    limits:
      tokens: [{limit: 1000000, window: 1d}]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [free]
    backend: simulator
  - name: sim-other
    path: /llm/sim-other
    tiers: [free]
    backend: simulator
subscriptions:
  - name: small
    description: A small budget on sim-model
    priority: 5
    owner: {groups: [team-a]}
    models:
      - name: sim-model
        tokenRateLimits: [{limit: 400, window: 1d}]
  - name: large
    priority: 1
    owner: {groups: [team-a]}
    models:
      - name: sim-model
        tokenRateLimits: [{limit: 1000000, window: 1d}]
      - name: sim-other
        tokenRateLimits: [{limit: 1000000, window: 1d}]
  - name: revokable
    owner: {users: [rev]}
    models:
      - name: sim-model
        tokenRateLimits: [{limit: 1000000, window: 1d}]
"#;

/// A subscription one test removes from the policy (appended to [`POLICY`] at start).
const DOOMED: &str = r#"
  - name: doomed
    owner: {users: [dora]}
    models:
      - name: sim-model
        tokenRateLimits: [{limit: 1000000, window: 1d}]
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: alice-token, username: alice, groups: [system:authenticated, team-a]}
  - {token: tess-token, username: tess, groups: [system:authenticated, team-a]}
  - {token: carol-token, username: carol, groups: [system:authenticated]}
  - {token: rev-token, username: rev, groups: [system:authenticated]}
  - {token: dora-token, username: dora, groups: [system:authenticated]}
"#;

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    static P: OnceLock<String> = OnceLock::new();
    let policy = P.get_or_init(|| format!("{POLICY}{DOOMED}"));
    let policy: &'static str = policy.as_str();
    stack_with(&S, policy, IDENTITIES, "credentials: {}\n")
}

const SIM: &str = "/llm/sim-model/v1/chat/completions";
const OTHER: &str = "/llm/sim-other/v1/chat/completions";

fn body(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40})
}

async fn mint(token: &str, body: Value) -> (String, String) {
    let v = stack().mint_key(token, body).await.expect("minted");
    (
        v["key"].as_str().expect("key").to_string(),
        v["subscription"].as_str().unwrap_or_default().to_string(),
    )
}

async fn call(path: &str, test_id: &str, cred: &str, extra: &[(&str, &str)]) -> Reply {
    let model = if path == OTHER {
        "sim-other"
    } else {
        "sim-model"
    };
    let auth = bearer(cred);
    let mut headers = vec![("authorization", auth.as_str())];
    headers.extend_from_slice(extra);
    chat(stack(), path, test_id, &headers, body(model)).await
}

/// The `x-maas-subscription` values the simulator received with this test id.
fn backend_subscription_headers(test_id: &str) -> Vec<Vec<String>> {
    stack()
        .sim_requests_with_test_id(test_id)
        .iter()
        .map(|r| {
            r.headers
                .iter()
                .filter(|(k, _)| k.eq_ignore_ascii_case("x-maas-subscription"))
                .map(|(_, v)| v.clone())
                .collect()
        })
        .collect()
}

#[tokio::test]
async fn a_key_is_held_to_its_subscriptions_budget_and_another_subscriptions_key_still_works() {
    // tess: default key (small, the highest priority) and a key named for large.
    let (small_key, sub) = mint("tess-token", json!({"name": "default"})).await;
    assert_eq!(sub, "small");
    let (large_key, sub) = mint(
        "tess-token",
        json!({"name": "big", "subscription": "large"}),
    )
    .await;
    assert_eq!(sub, "large");
    let mut ok = 0;
    let limited = loop {
        let r = call(SIM, "budget", &small_key, &[]).await;
        if r.status != 200 {
            break r;
        }
        ok += 1;
        assert!(ok < 40, "never limited by small's 400 tokens a day");
    };
    let e = limited.error(429);
    assert!(ok >= 1, "the budget admitted something first");
    assert!(
        e["message"].as_str().unwrap_or_default().contains("small"),
        "{e}"
    );
    assert!(limited.header("retry-after").is_some());
    // Budgets are per subscription: the same user's key of another subscription still works.
    let r = call(SIM, "budget", &large_key, &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    // And the small key stays limited.
    assert_eq!(call(SIM, "budget", &small_key, &[]).await.status, 429);
}

#[tokio::test]
async fn a_token_selects_with_the_header_and_two_matches_without_it_are_refused() {
    let e = call(SIM, "select", "alice-token", &[]).await.error(403);
    assert_eq!(e["code"], "multiple_subscriptions", "{e}");
    assert_eq!(e["type"], "permission_error", "{e}");
    assert!(
        e["message"]
            .as_str()
            .unwrap_or_default()
            .contains("X-MaaS-Subscription"),
        "{e}"
    );
    let r = call(
        SIM,
        "select",
        "alice-token",
        &[("x-maas-subscription", "large")],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // Only large holds sim-other: selected without the header.
    let r = call(OTHER, "select", "alice-token", &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    // A subscription the caller does not have, or that does not exist: one answer
    // (`naming_someone_elses_subscription_is_answered_as_one_that_does_not_exist`).
    let e = call(
        SIM,
        "select",
        "alice-token",
        &[("x-maas-subscription", "revokable")],
    )
    .await
    .error(403);
    assert_eq!(e["code"], "not_found", "{e}");
    let e = call(
        SIM,
        "select",
        "alice-token",
        &[("x-maas-subscription", "gold")],
    )
    .await
    .error(403);
    assert_eq!(e["code"], "not_found", "{e}");
    // The backend saw the selected subscription, once each.
    assert_eq!(
        backend_subscription_headers("select"),
        vec![vec!["large".to_string()], vec!["large".to_string()]]
    );
}

/// `X-MaaS-Subscription` naming another user's subscription and naming one that does not
/// exist get the same answer from the gateway, byte for byte (status, headers that could
/// differ, body): the header cannot be used to find out which subscriptions exist.
#[tokio::test]
async fn naming_someone_elses_subscription_is_answered_as_one_that_does_not_exist() {
    let others = call(
        SIM,
        "enumerate",
        "alice-token",
        &[("x-maas-subscription", "revokable")],
    )
    .await;
    let missing = call(
        SIM,
        "enumerate",
        "alice-token",
        &[("x-maas-subscription", "no-such-subscription")],
    )
    .await;
    // The same holds for a namespace-qualified name and a subscription without the model.
    let others_ns = call(
        SIM,
        "enumerate",
        "alice-token",
        &[("x-maas-subscription", "models-as-a-service/revokable")],
    )
    .await;
    for r in [&others, &missing, &others_ns] {
        let e = r.error(403);
        assert_eq!(e["code"], "not_found", "{e}");
        assert_eq!(e["message"], "requested subscription not found", "{e}");
    }
    assert_eq!(others.body, missing.body, "the bodies tell the cases apart");
    assert_eq!(others_ns.body, missing.body);
    for h in ["content-type", "content-length", "www-authenticate"] {
        assert_eq!(others.header(h), missing.header(h), "{h}");
    }
    // Header names alike too; `date` moves with the clock and `connection: close` with whether
    // Envoy had read the request body when the refusal went out (a race of each request, the
    // same for both cases: both are refused at the headers).
    let names = |r: &Reply| {
        let mut n: Vec<String> = r
            .headers
            .keys()
            .map(|k| k.as_str().to_string())
            .filter(|k| k != "date" && k != "connection")
            .collect();
        n.sort();
        n
    };
    assert_eq!(names(&others), names(&missing));
    eprintln!(
        "subscriptions figure: someone else's and a missing subscription: {} {} (identical)",
        others.status, others.body
    );
    assert!(
        stack().sim_requests_with_test_id("enumerate").is_empty(),
        "a refused request reached the backend"
    );
}

#[tokio::test]
async fn a_subscription_without_the_model_is_refused_403() {
    let (key, sub) = mint(
        "alice-token",
        json!({"name": "small-only", "subscription": "small"}),
    )
    .await;
    assert_eq!(sub, "small");
    let e = call(OTHER, "no-model", &key, &[]).await.error(403);
    assert_eq!(e["code"], "model_not_in_subscription", "{e}");
    let e = call(
        OTHER,
        "no-model",
        "alice-token",
        &[("x-maas-subscription", "small")],
    )
    .await
    .error(403);
    assert_eq!(e["code"], "model_not_in_subscription", "{e}");
    assert!(stack().sim_requests_with_test_id("no-model").is_empty());
}

#[tokio::test]
async fn the_clients_subscription_header_never_reaches_the_backend() {
    // A key bound to small asking for large: the gateway sends small.
    let (key, _) = mint(
        "alice-token",
        json!({"name": "hdr", "subscription": "small"}),
    )
    .await;
    let r = call(SIM, "hdr-key", &key, &[("x-maas-subscription", "large")]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        backend_subscription_headers("hdr-key"),
        vec![vec!["small".to_string()]]
    );
    // A tier key (carol has no subscription): the header is removed, none is set.
    let (tier_key, sub) = mint("carol-token", json!({"name": "tier"})).await;
    assert_eq!(sub, "");
    let r = call(
        SIM,
        "hdr-tier",
        &tier_key,
        &[("X-MaaS-Subscription", "large")],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        backend_subscription_headers("hdr-tier"),
        vec![Vec::<String>::new()]
    );
    // A token naming one (two values: the last non-empty wins): only the selected one goes on.
    let r = call(
        SIM,
        "hdr-token",
        "alice-token",
        &[
            ("x-maas-subscription", "small"),
            ("x-maas-subscription", "large"),
        ],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        backend_subscription_headers("hdr-token"),
        vec![vec!["large".to_string()]]
    );
}

#[tokio::test]
async fn subscriptions_are_listed_through_the_gateway() {
    let get = |path: &'static str, token: &'static str| async move {
        send(
            client()
                .get(format!("{}{path}", stack().gateway_url()))
                .header("authorization", bearer(token)),
        )
        .await
    };
    let r = get("/maas-api/v1/subscriptions", "alice-token").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let names: Vec<Value> = r
        .json()
        .as_array()
        .expect("an array")
        .iter()
        .map(|s| s["subscription_id_header"].clone())
        .collect();
    assert_eq!(names, vec![json!("large"), json!("small")], "{}", r.body);
    let r = get("/maas-api/v1/model/sim-other/subscriptions", "alice-token").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let subs = r.json();
    let names: Vec<&Value> = subs
        .as_array()
        .expect("an array")
        .iter()
        .map(|s| &s["subscription_id_header"])
        .collect();
    assert_eq!(names, vec![&json!("large")], "{}", r.body);
    let r = get("/maas-api/v1/subscriptions", "carol-token").await;
    assert_eq!(r.json(), json!([]), "{}", r.body);
}

#[tokio::test]
async fn bulk_revoke_by_subscription_dry_run_then_for_real_is_refused_within_one_poll() {
    let (k1, sub) = mint("rev-token", json!({"name": "r1"})).await;
    assert_eq!(sub, "revokable");
    let (k2, _) = mint("rev-token", json!({"name": "r2"})).await;
    for k in [&k1, &k2] {
        // Cached by the gateway: revocation must evict it.
        assert_eq!(call(SIM, "revoke", k, &[]).await.status, 200);
    }
    let revoke = |body: Value| async move {
        send(
            client()
                .post(format!(
                    "{}/maas-api/v1/api-keys/bulk-revoke",
                    stack().gateway_url()
                ))
                .header("authorization", bearer("rev-token"))
                .json(&body),
        )
        .await
    };
    let r = revoke(json!({"subscription": "revokable", "dryRun": true})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["matchedCount"], 2, "{}", r.body);
    assert_eq!(r.json()["revokedCount"], 0, "{}", r.body);
    tokio::time::sleep(Duration::from_millis(700)).await;
    for k in [&k1, &k2] {
        assert_eq!(call(SIM, "revoke", k, &[]).await.status, 200, "dry run");
    }
    let r = revoke(json!({"subscription": "revokable"})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["revokedCount"], 2, "{}", r.body);
    // The filter polls the policy every 500 ms: refused within one poll (and a margin).
    let refused = eventually(Duration::from_secs(3), || async {
        let mut all = true;
        for k in [&k1, &k2] {
            all &= call(SIM, "revoke-after", k, &[]).await.status == 401;
        }
        all
    })
    .await;
    assert!(refused.is_some(), "revoked keys still accepted after 3 s");
}

#[tokio::test]
async fn a_key_whose_subscription_leaves_the_policy_is_refused_invalid_subscription() {
    let (key, sub) = mint("dora-token", json!({"name": "d"})).await;
    assert_eq!(sub, "doomed");
    // Cached by the gateway as an allow bound to doomed.
    assert_eq!(call(SIM, "doomed", &key, &[]).await.status, 200);
    stack().replace_policy(POLICY).expect("policy written");
    let refused = eventually(Duration::from_secs(5), || async {
        call(SIM, "doomed-after", &key, &[]).await.status == 403
    })
    .await;
    assert!(
        refused.is_some(),
        "still accepted after the subscription left"
    );
    let e = call(SIM, "doomed-after", &key, &[]).await.error(403);
    assert_eq!(e["code"], "invalid_subscription", "{e}");
    assert_eq!(e["type"], "permission_error", "{e}");
}
