//! Subscriptions through real Envoy with the release .wasm, the policy coming from the
//! reference's Kubernetes resources (issue 15): the companion runs with
//! `MAAS_POLICY_SOURCE=kubernetes` and `KUBECONFIG` pointing at the local API stand-in
//! (`maas_e2e::kube_standin`: HTTPS, list + watch with resource versions, Events), reached
//! through its real `kube` client. The resources are applied before the stack starts.
//!
//! Envoy's routes still come from a policy file (`StackOptions::envoy_policy`): it names the
//! same two simulator models at the paths the MaaSModelRefs translate to, and nothing else —
//! the companion's own policy file holds only a tier nobody is in, so every model, access rule
//! and subscription the filter enforces comes from the resources. The filter gets no bootstrap
//! policy (it would be the routes file's, without subscriptions): it decides only by what it
//! polls from the companion.

use crate::helpers::*;
use maas_e2e::kube_standin::KubeStandin;
use maas_e2e::module_stack::Stoppable;
use maas_e2e::{Stack, StackOptions};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// `--policy-namespace`: the reference's namespace for MaaSAuthPolicies and MaaSSubscriptions.
const NAMESPACE: &str = "models-as-a-service";

/// opendatahub-io/models-as-a-service `docs/samples/maas-system/free/maas/` and
/// `docs/samples/maas-system/premium/maas/` (as in companion/tests/api/resources.rs: the
/// MaaSModelRefs in the current shape — in the model's namespace, as
/// `maas-controller/api/maas/v1alpha1/maasmodelref_types.go` requires —, the MaaSAuthPolicies
/// in the subscription namespace, the MaaSSubscriptions verbatim). The two LLMInferenceServices
/// they name are served by the simulator under the same names (the reference's samples are
/// simulators too); the ExternalModel sample (gpt-4o) is left out: no upstream here.
const REFERENCE: &str = include_str!("../../fixtures/reference/maas-system-samples.yaml");

/// Ours, beside the samples: a second subscription on the free model for premium users (lower
/// priority, so not the default), and one per user for the watch test.
const OURS: &str = r#"
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSSubscription
metadata: {name: opt-large, namespace: models-as-a-service}
spec:
  owner: {groups: [{name: premium-user}]}
  priority: -1
  modelRefs:
    - {name: facebook-opt-125m-simulated, namespace: llm, tokenRateLimits: [{limit: 1000000, window: 1m}]}
---
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSSubscription
metadata: {name: dave-sub, namespace: models-as-a-service}
spec:
  owner: {users: [dave]}
  modelRefs:
    - {name: facebook-opt-125m-simulated, namespace: llm, tokenRateLimits: [{limit: 1000000, window: 1m}]}
"#;

/// Invalid (a week is no window of the reference): reported, left out.
const INVALID: &str = r#"
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSSubscription
metadata: {name: weekly, namespace: models-as-a-service}
spec:
  owner: {groups: [{name: system:authenticated}]}
  modelRefs:
    - {name: facebook-opt-125m-simulated, namespace: llm, tokenRateLimits: [{limit: 5, window: 1w}]}
"#;

/// The companion's base file: one tier no one is in (a policy needs a tier). No models.
const BASE: &str = r#"
tiers:
  - {name: nobody, level: 0, groups: ["maas-e2e/nobody"]}
"#;

/// Envoy's routes and the simulator's models: the paths the MaaSModelRefs translate to
/// (`/<namespace>/<spec.modelRef.name>`).
const ROUTES: &str = r#"
tiers:
  - {name: nobody, level: 0, groups: ["maas-e2e/nobody"]}
models:
  - {name: facebook-opt-125m-simulated, path: /llm/facebook-opt-125m-simulated, tiers: [nobody], backend: simulator}
  - {name: premium-simulated-simulated-premium, path: /llm/premium-simulated-simulated-premium, tiers: [nobody], backend: simulator}
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: alice-token, username: alice, groups: [system:authenticated, premium-user]}
  - {token: bob-token, username: bob, groups: [system:authenticated]}
  - {token: carol-token, username: carol, groups: [system:authenticated]}
  - {token: dave-token, username: dave, groups: [system:authenticated]}
  - {token: erin-token, username: erin, groups: [system:authenticated, premium-user]}
  - {token: probe-token, username: probe, groups: [system:authenticated]}
"#;

const FREE: &str = "/llm/facebook-opt-125m-simulated/v1/chat/completions";
const PREMIUM: &str = "/llm/premium-simulated-simulated-premium/v1/chat/completions";

/// The stand-in and the stack whose companion reads it (the stand-in runs in this process: it
/// serves on, idle, once the stack stopped).
struct Started(KubeStandin, Stack);

impl Stoppable for Started {
    fn stop(&self) {
        self.1.shutdown();
    }
}

fn started() -> &'static Started {
    static S: ModuleStack<Started> = ModuleStack::new();
    S.get_or_start(|| {
        std::thread::spawn(|| {
            let kube = KubeStandin::start(NAMESPACE).map_err(|e| format!("{e:#}"))?;
            for yaml in [REFERENCE, OURS, INVALID] {
                kube.apply_yaml(yaml).map_err(|e| format!("{e:#}"))?;
            }
            let mut options = StackOptions::default()
                .with_policy_yaml(BASE)
                .with_identities_yaml(IDENTITIES)
                .with_credentials_yaml("credentials: {}\n");
            options.envoy_policy = Some(ROUTES.to_string());
            // No bootstrap policy: the filter decides only by the companion's (the resources'),
            // never by the routes file, which holds no subscriptions.
            options.plugin_config_extra = Some(json!({"bootstrapPolicy": null}));
            options.companion_env = kube.companion_env();
            let stack = Stack::start(options).map_err(|e| format!("{e:#}"))?;
            filter_has_the_resources_policy(&stack)?;
            Ok(Started(kube, stack))
        })
        .join()
        .unwrap_or_else(|_| Err("stack start panicked".into()))
    })
}

/// Without a bootstrap policy the filter refuses (503) until its first poll: waits until a
/// caller whose only way in is a resource subscription is admitted, three times in a row.
fn filter_has_the_resources_policy(stack: &Stack) -> Result<(), String> {
    let http = reqwest::blocking::Client::new();
    let start = Instant::now();
    let mut in_a_row = 0;
    while in_a_row < 3 {
        if start.elapsed() > Duration::from_secs(15) {
            return Err("the filter never admitted the probe by the resources' policy".into());
        }
        let ok = http
            .post(format!("{}{FREE}", stack.gateway_url()))
            .header("authorization", bearer("probe-token"))
            .json(&json!({"model": "facebook-opt-125m-simulated", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}))
            .send()
            .is_ok_and(|r| r.status() == 200);
        in_a_row = if ok { in_a_row + 1 } else { 0 };
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

fn stack() -> &'static Stack {
    &started().1
}

fn kube() -> &'static KubeStandin {
    &started().0
}

/// A chat completion costing `1 + max_tokens` tokens (the simulator's count).
async fn call(
    path: &str,
    test_id: &str,
    cred: &str,
    extra: &[(&str, &str)],
    max_tokens: u32,
) -> Reply {
    let model = if path == FREE {
        "facebook-opt-125m-simulated"
    } else {
        "premium-simulated-simulated-premium"
    };
    let auth = bearer(cred);
    let mut headers = vec![("authorization", auth.as_str())];
    headers.extend_from_slice(extra);
    let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens});
    chat(stack(), path, test_id, &headers, body).await
}

async fn mint(token: &str, body: Value) -> (String, String) {
    let v = stack().mint_key(token, body).await.expect("minted");
    (
        v["key"].as_str().expect("key").to_string(),
        v["subscription"].as_str().unwrap_or_default().to_string(),
    )
}

/// Windows here are the reference's minute, fixed and aligned: a test spending a budget starts
/// with at least 25 s of its minute left, so it never straddles a window boundary.
async fn fresh_minute_margin() {
    let into = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs()
        % 60;
    if into > 35 {
        tokio::time::sleep(Duration::from_secs(61 - into)).await;
    }
}

/// Calls until refused; returns (calls admitted, the refusal).
async fn spend(path: &str, test_id: &str, key: &str) -> (u32, Reply) {
    let mut ok = 0;
    loop {
        let r = call(path, test_id, key, &[], 40).await;
        if r.status != 200 {
            return (ok, r);
        }
        ok += 1;
        assert!(ok < 20, "never limited");
    }
}

#[tokio::test]
async fn keys_are_held_to_their_resource_subscriptions_budget_and_another_subscriptions_key_still_works()
 {
    // bob is only system:authenticated: his default is the sample's simulator-subscription.
    let (bob_key, sub) = mint("bob-token", json!({"name": "default"})).await;
    assert_eq!(sub, "simulator-subscription");
    // alice (premium-user too): a key named for simulator-subscription, one for opt-large,
    // and her default (priority 0, the larger limit: premium-simulator-subscription).
    let (alice_small, sub) = mint(
        "alice-token",
        json!({"name": "small", "subscription": "simulator-subscription"}),
    )
    .await;
    assert_eq!(sub, "simulator-subscription");
    let (alice_large, sub) = mint(
        "alice-token",
        json!({"name": "large", "subscription": "models-as-a-service/opt-large"}),
    )
    .await;
    assert_eq!(sub, "opt-large");
    let (alice_default, sub) = mint("alice-token", json!({"name": "default"})).await;
    assert_eq!(sub, "premium-simulator-subscription");

    fresh_minute_margin().await;
    // 100 tokens a minute at 41 a call: two admitted, then 429 (a call is admitted only while
    // its max_tokens still fits in what is left).
    for (who, key) in [("bob", &bob_key), ("alice", &alice_small)] {
        let (ok, limited) = spend(FREE, "budget", key).await;
        let e = limited.error(429);
        assert_eq!(ok, 2, "{who}: admitted before the limit");
        assert!(
            e["message"]
                .as_str()
                .unwrap_or_default()
                .contains("simulator-subscription"),
            "{who}: {e}"
        );
        assert!(limited.header("retry-after").is_some(), "{who}");
    }
    // Per subscription: alice's opt-large key on the same model, and her default key on the
    // premium model, still work; the small key stays limited.
    let r = call(FREE, "budget", &alice_large, &[], 40).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = call(PREMIUM, "budget", &alice_default, &[], 40).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        call(FREE, "budget", &alice_small, &[], 40).await.status,
        429
    );
    // bob's key names no premium subscription: the premium model is not his.
    let e = call(PREMIUM, "budget", &bob_key, &[], 40).await.error(403);
    assert_eq!(e["code"], "model_not_in_subscription", "{e}");
}

#[tokio::test]
async fn a_token_caller_selects_a_resource_subscription_with_the_header() {
    // erin owns simulator-subscription and opt-large, both holding the free model.
    let e = call(FREE, "select", "erin-token", &[], 5).await.error(403);
    assert_eq!(e["code"], "multiple_subscriptions", "{e}");
    let r = call(
        FREE,
        "select",
        "erin-token",
        &[("x-maas-subscription", "opt-large")],
        5,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // Only premium-simulator-subscription holds the premium model: no header needed.
    let r = call(PREMIUM, "select", "erin-token", &[], 5).await;
    assert_eq!(r.status, 200, "{}", r.body);
    // The invalid resource was left out: naming it finds nothing.
    let e = call(
        FREE,
        "select",
        "erin-token",
        &[("x-maas-subscription", "weekly")],
        5,
    )
    .await
    .error(403);
    assert_eq!(e["code"], "not_found", "{e}");
    // bob has no premium subscription and no tier: refused.
    assert_eq!(
        call(PREMIUM, "select", "bob-token", &[], 5).await.status,
        403
    );
    // The backend saw the subscription the gateway selected.
    let seen: Vec<Vec<String>> = stack()
        .sim_requests_with_test_id("select")
        .iter()
        .map(|r| {
            r.headers
                .iter()
                .filter(|(k, _)| k.eq_ignore_ascii_case("x-maas-subscription"))
                .map(|(_, v)| v.clone())
                .collect()
        })
        .collect();
    assert_eq!(
        seen,
        vec![
            vec!["opt-large".to_string()],
            vec!["premium-simulator-subscription".to_string()]
        ]
    );
}

#[tokio::test]
async fn resource_subscriptions_are_listed_through_the_gateway() {
    let list = |token: &'static str| async move {
        let r = send(
            client()
                .get(format!(
                    "{}/maas-api/v1/subscriptions",
                    stack().gateway_url()
                ))
                .header("authorization", bearer(token)),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let names = |v: &Value| -> Vec<String> {
        let mut n: Vec<String> = v
            .as_array()
            .expect("an array")
            .iter()
            .map(|s| {
                s["subscription_id_header"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            })
            .collect();
        n.sort();
        n
    };
    let alice = list("alice-token").await;
    assert_eq!(
        names(&alice),
        [
            "opt-large",
            "premium-simulator-subscription",
            "simulator-subscription"
        ],
        "{alice}"
    );
    let sim = alice
        .as_array()
        .into_iter()
        .flatten()
        .find(|s| s["subscription_id_header"] == "simulator-subscription")
        .expect("listed");
    assert_eq!(
        sim["display_name"], "Simulator Subscription (Free)",
        "{sim}"
    );
    assert_eq!(
        sim["model_refs"],
        json!([{"name": "facebook-opt-125m-simulated", "namespace": "llm",
                "token_rate_limits": [{"limit": 100, "window": "1m"}]}])
    );
    let bob = list("bob-token").await;
    assert_eq!(names(&bob), ["simulator-subscription"], "{bob}");
    let dave = list("dave-token").await;
    assert_eq!(
        names(&dave),
        ["dave-sub", "simulator-subscription"],
        "{dave}"
    );
}

#[tokio::test]
async fn bulk_revoke_by_resource_subscription_is_refused_within_one_poll() {
    let (k1, sub) = mint("carol-token", json!({"name": "c1"})).await;
    assert_eq!(sub, "simulator-subscription");
    let (k2, _) = mint("carol-token", json!({"name": "c2"})).await;
    for k in [&k1, &k2] {
        assert_eq!(call(FREE, "revoke", k, &[], 5).await.status, 200);
    }
    let revoke = |body: Value| async move {
        send(
            client()
                .post(format!(
                    "{}/maas-api/v1/api-keys/bulk-revoke",
                    stack().gateway_url()
                ))
                .header("authorization", bearer("carol-token"))
                .json(&body),
        )
        .await
    };
    let r = revoke(json!({"subscription": "simulator-subscription", "dryRun": true})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["matchedCount"], 2, "{}", r.body);
    assert_eq!(r.json()["revokedCount"], 0, "{}", r.body);
    tokio::time::sleep(Duration::from_millis(700)).await;
    for k in [&k1, &k2] {
        assert_eq!(call(FREE, "revoke", k, &[], 5).await.status, 200, "dry run");
    }
    let r = revoke(json!({"subscription": "simulator-subscription"})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["revokedCount"], 2, "{}", r.body);
    // The filter polls every 500 ms: refused within one poll (and a margin).
    let refused = eventually(Duration::from_secs(3), || async {
        let mut all = true;
        for k in [&k1, &k2] {
            all &= call(FREE, "revoke-after", k, &[], 5).await.status == 401;
        }
        all
    })
    .await;
    assert!(refused.is_some(), "revoked keys still accepted after 3 s");
}

#[tokio::test]
#[allow(clippy::print_stderr, reason = "prints the measured figure")]
async fn a_subscription_limit_lowered_by_reapplying_it_takes_effect_at_the_gateway() {
    let (key, sub) = mint("dave-token", json!({"name": "w"})).await;
    assert_eq!(sub, "dave-sub");
    let r = call(FREE, "watch", &key, &[], 40).await;
    assert_eq!(r.status, 200, "{}", r.body);
    // `kubectl apply` of the same subscription with a limit one call fits but not two: a watch
    // MODIFIED. (Below one call, the gateway would answer 400 tokens_exceed_limit instead: with
    // the headers held for the body, admission sees the reservation before the full window.)
    let applied = Instant::now();
    let dave_sub = OURS.split("\n---\n").nth(1).expect("dave-sub");
    let lowered = dave_sub.replace("limit: 1000000", "limit: 60");
    assert_ne!(lowered, dave_sub);
    kube().apply_yaml(&lowered).expect("applied");
    // Each admitted call spends 41 tokens: once the filter has the new policy, the next call
    // in the window (or the one after, across a minute boundary) is a 429.
    let limited = eventually(Duration::from_secs(5), || async {
        call(FREE, "watch-after", &key, &[], 40).await.status == 429
    })
    .await;
    let took = applied.elapsed();
    eprintln!(
        "lowered limit enforced at the gateway {} ms after the apply",
        took.as_millis()
    );
    assert!(
        limited.is_some(),
        "the lowered limit was not enforced after 5 s"
    );
    // The listing follows too.
    let r = send(
        client()
            .get(format!(
                "{}/maas-api/v1/subscriptions",
                stack().gateway_url()
            ))
            .header("authorization", bearer("dave-token")),
    )
    .await;
    let dave = r.json();
    let limit = dave
        .as_array()
        .into_iter()
        .flatten()
        .find(|s| s["subscription_id_header"] == "dave-sub")
        .map(|s| s["model_refs"][0]["token_rate_limits"][0]["limit"].clone());
    assert_eq!(limit, Some(json!(60)), "{dave}");
}

#[tokio::test]
async fn an_invalid_resource_is_reported_by_an_event_and_the_rest_still_works() {
    let _ = stack();
    let weekly = |events: &[Value]| {
        events
            .iter()
            .filter(|e| {
                e["regarding"]["kind"] == "MaaSSubscription" && e["regarding"]["name"] == "weekly"
            })
            .count()
    };
    // The one applied before the start: one Warning Event, the field named.
    let events = kube().events();
    assert_eq!(weekly(&events), 1, "{events:?}");
    let e = events
        .iter()
        .find(|e| e["regarding"]["name"] == "weekly")
        .expect("the event");
    assert_eq!(e["reason"], "InvalidSpec", "{e}");
    assert_eq!(e["type"], "Warning", "{e}");
    assert!(
        e["note"]
            .as_str()
            .unwrap_or_default()
            .starts_with("spec.modelRefs[0].tokenRateLimits[0].window: "),
        "{e}"
    );
    // One more, applied while running: reported too, and the gateway keeps serving.
    kube()
        .apply_yaml(
            r#"
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSModelRef
metadata: {name: isvc, namespace: llm}
spec:
  modelRef: {kind: InferenceService, name: isvc}
"#,
        )
        .expect("applied");
    let reported = eventually(Duration::from_secs(5), || async {
        kube()
            .events()
            .iter()
            .any(|e| e["regarding"]["kind"] == "MaaSModelRef" && e["regarding"]["name"] == "isvc")
    })
    .await;
    assert!(
        reported.is_some(),
        "no Event for the invalid MaaSModelRef after 5 s"
    );
    let r = call(PREMIUM, "invalid", "alice-token", &[], 5).await;
    assert_eq!(r.status, 200, "{}", r.body);
    // Reported once per resource version: no second Event for `weekly` since.
    assert_eq!(weekly(&kube().events()), 1);
}
