//! `--policy-source kubernetes`: the reference's own example resources, served by the local
//! Kubernetes stand-in (`kubernetes.rs`: list + watch with resource versions, Events), become
//! the policy the filter polls, follow watch updates, and leave invalid resources out.

use crate::kubernetes::{Calls, spawn_kube_app};
use maas_companion::settings::PolicySource;
use maas_types::PolicyDocument;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// opendatahub-io/models-as-a-service `docs/samples/maas-system/free/maas/` (maas-model.yaml in
/// the current shape — the MaaSModelRef in the model's namespace, as
/// `maas-controller/api/maas/v1alpha1/maasmodelref_types.go` requires; maas-auth-policy.yaml with
/// the policy in the subscription namespace; maas-subscription.yaml verbatim),
/// `docs/samples/maas-system/premium/maas/` (likewise) and
/// `docs/content/install/external-model-setup.md` steps 4 and 5 (gpt-4o).
const REFERENCE: &str = concat!(
    include_str!("../../../tests/fixtures/reference/maas-system-samples.yaml"),
    "\n---\n",
    include_str!("../../../tests/fixtures/reference/external-model-gpt-4o.yaml")
);

/// A subscription in another namespace than `--policy-namespace`: never read.
const ELSEWHERE: &str = r#"
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSSubscription
metadata: {name: elsewhere, namespace: opendatahub}
spec:
  owner: {groups: [{name: system:authenticated}]}
  modelRefs: [{name: gpt-4o, namespace: llm, tokenRateLimits: [{limit: 1, window: 1m}]}]
"#;

/// What the reference resources translate to (no base file: no tiers but the member-less
/// `subscription-only` one).
fn expected() -> PolicyDocument {
    PolicyDocument::from_json(
        json!({
            "tiers": [{
                "name": "subscription-only",
                "displayName": "Subscriptions only",
                "description": "Models opened by MaaSAuthPolicies to no tier: reachable through subscriptions only",
                "level": -1,
                "groups": ["maas.opendatahub.io/subscription-only"]
            }],
            "models": [
                {"name": "facebook-opt-125m-simulated", "path": "/llm/facebook-opt-125m-simulated",
                 "tiers": ["subscription-only"], "ownedBy": "llm/facebook-opt-125m-simulated"},
                {"name": "gpt-4o", "path": "/llm/gpt-4o", "tiers": ["subscription-only"],
                 "backend": "https://api.openai.com", "ownedBy": "llm/gpt-4o",
                 "provider": {"type": "openai", "credentialRef": "llm/openai-api-key"},
                 "upstreamCluster": "outbound|443||api.openai.com"},
                {"name": "premium-simulated-simulated-premium", "path": "/llm/premium-simulated-simulated-premium",
                 "tiers": ["subscription-only"], "ownedBy": "llm/premium-simulated-simulated-premium"}
            ],
            "subscriptions": [
                {"name": "gpt-4o-subscription", "namespace": "models-as-a-service",
                 "owner": {"groups": ["system:authenticated"]},
                 "models": [{"name": "gpt-4o", "tokenRateLimits": [{"limit": 100000, "window": "1h"}]}]},
                {"name": "premium-simulator-subscription", "namespace": "models-as-a-service",
                 "owner": {"groups": ["premium-user"]},
                 "models": [{"name": "premium-simulated-simulated-premium", "tokenRateLimits": [{"limit": 1000, "window": "1m"}]}]},
                {"name": "simulator-subscription", "namespace": "models-as-a-service",
                 "displayName": "Simulator Subscription (Free)",
                 "description": "Free-tier subscription with 100 tokens/min rate limit",
                 "owner": {"groups": ["system:authenticated"]},
                 "models": [{"name": "facebook-opt-125m-simulated", "tokenRateLimits": [{"limit": 100, "window": "1m"}]}]}
            ]
        })
        .to_string()
        .as_bytes(),
    )
    .unwrap()
}

/// The companion reading the resources of the stand-in (no base policy file).
async fn spawn_with_resources(calls: Arc<Calls>) -> crate::helpers::TestApp {
    spawn_kube_app(calls, |s| {
        s.policy.source = PolicySource::Kubernetes {
            namespace: "models-as-a-service".into(),
        };
        s.policy.file = None;
    })
    .await
}

async fn served(app: &crate::helpers::TestApp) -> PolicyDocument {
    let r = app.internal_get("/internal/v1/policy").await;
    assert_eq!(r.status, 200, "{}", r.body);
    PolicyDocument::from_json(r.body.to_string().as_bytes()).unwrap()
}

/// Polls the served policy until `check` holds; returns how long it took (panics after 5 s).
async fn until(
    app: &crate::helpers::TestApp,
    what: &str,
    check: impl Fn(&PolicyDocument) -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        if check(&served(app).await) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{what}: not served after 5 s: {:?}",
            served(app).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The companion's policy reload interval in these tests (`--policy-reload-interval-ms=200`).
const ONE_RELOAD: Duration = Duration::from_millis(200);

#[tokio::test]
async fn the_reference_resources_translate_into_the_served_policy() {
    let calls = Arc::new(Calls::default());
    calls.apply_yaml(REFERENCE);
    calls.apply_yaml(ELSEWHERE);
    let app = spawn_with_resources(calls.clone()).await;
    // Served from the first answer: the start waits for the first listing.
    assert_eq!(served(&app).await, expected());
    // Nothing was invalid: no Event, the gauge at 0.
    assert!(calls.cluster.lock().unwrap().events.is_empty());
    assert_eq!(
        app.metric("maas_companion_policy_resources_invalid{kind=\"MaaSSubscription\"}")
            .await,
        0.0
    );
}

#[tokio::test]
async fn watch_updates_reach_the_served_policy_within_one_reload() {
    let calls = Arc::new(Calls::default());
    calls.apply_yaml(REFERENCE);
    let app = spawn_with_resources(calls.clone()).await;
    assert_eq!(served(&app).await, expected());

    // A new subscription.
    calls.apply_yaml(
        r#"
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSSubscription
metadata: {name: team-b, namespace: models-as-a-service}
spec:
  owner: {users: [dev], groups: []}
  priority: 5
  modelRefs: [{name: gpt-4o, namespace: llm, tokenRateLimits: [{limit: 10, window: 1m}, {limit: 500, window: 1d}]}]
  tokenMetadata: {costCenter: cc-42}
"#,
    );
    let took = until(&app, "new subscription", |d| {
        d.subscription("team-b").is_some_and(|s| {
            s.priority == 5
                && s.owner.users == ["dev"]
                && s.models[0].token_rate_limits.len() == 2
                && s.token_metadata.cost_center.as_deref() == Some("cc-42")
        })
    })
    .await;
    assert!(took <= ONE_RELOAD, "new subscription took {took:?}");

    // A changed limit.
    calls.apply_yaml(&REFERENCE.replace("limit: 100\n", "limit: 250\n"));
    let took = until(&app, "changed limit", |d| {
        d.subscription("simulator-subscription")
            .is_some_and(|s| s.models[0].token_rate_limits[0].limit == 250)
    })
    .await;
    assert!(took <= ONE_RELOAD, "changed limit took {took:?}");

    // A deleted model: gone, and so is the subscription that held only it.
    calls.delete("MaaSModelRef", "llm", "premium-simulated-simulated-premium");
    let took = until(&app, "deleted model", |d| {
        d.model("premium-simulated-simulated-premium").is_none()
            && d.subscription("premium-simulator-subscription").is_none()
    })
    .await;
    assert!(took <= ONE_RELOAD, "deleted model took {took:?}");
    // The rest stays.
    let d = served(&app).await;
    assert!(d.model("gpt-4o").is_some() && d.subscription("gpt-4o-subscription").is_some());
}

const INVALID: &str = r#"
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSSubscription
metadata: {name: weekly, namespace: models-as-a-service}
spec:
  owner: {groups: [{name: system:authenticated}]}
  modelRefs:
    - {name: gpt-4o, namespace: llm, tokenRateLimits: [{limit: 5, window: 1w}]}
---
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSModelRef
metadata: {name: isvc, namespace: llm}
spec:
  modelRef: {kind: InferenceService, name: isvc}
"#;

#[tokio::test]
async fn an_invalid_resource_is_reported_and_left_out_while_the_others_apply() {
    let calls = Arc::new(Calls::default());
    calls.apply_yaml(REFERENCE);
    calls.apply_yaml(INVALID);
    let app = spawn_with_resources(calls.clone()).await;
    // Exactly the valid resources' policy.
    assert_eq!(served(&app).await, expected());
    // One Warning Event per invalid resource, reason InvalidSpec, the field named.
    let events = calls.cluster.lock().unwrap().events.clone();
    let mut seen: Vec<(String, String, String)> = events
        .iter()
        .map(|e| {
            assert_eq!(e["reason"], "InvalidSpec", "{e}");
            assert_eq!(e["type"], "Warning", "{e}");
            assert_eq!(e["reportingController"], "maas-companion", "{e}");
            (
                e["regarding"]["kind"].as_str().unwrap().to_string(),
                e["regarding"]["name"].as_str().unwrap().to_string(),
                e["note"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    seen.sort();
    assert_eq!(seen.len(), 2, "{events:?}");
    assert_eq!(
        (seen[0].0.as_str(), seen[0].1.as_str()),
        ("MaaSModelRef", "isvc")
    );
    assert!(
        seen[0].2.starts_with("spec.modelRef.kind: "),
        "{}",
        seen[0].2
    );
    assert_eq!(
        (seen[1].0.as_str(), seen[1].1.as_str()),
        ("MaaSSubscription", "weekly")
    );
    assert!(
        seen[1]
            .2
            .starts_with("spec.modelRefs[0].tokenRateLimits[0].window: "),
        "{}",
        seen[1].2
    );
    assert_eq!(
        app.metric("maas_companion_policy_resources_invalid{kind=\"MaaSSubscription\"}")
            .await,
        1.0
    );
    assert_eq!(
        app.metric("maas_companion_policy_resources_invalid{kind=\"MaaSModelRef\"}")
            .await,
        1.0
    );

    // Fixed: it applies, the gauge goes back to 0, no new Event (the MaaSModelRef, unchanged,
    // is not reported again: once per resource version).
    let subscription = INVALID.split("\n---\n").next().unwrap();
    calls.apply_yaml(&subscription.replace("window: 1w", "window: 7d"));
    until(&app, "fixed subscription", |d| {
        d.subscription("weekly").is_some()
    })
    .await;
    let start = Instant::now();
    while app
        .metric("maas_companion_policy_resources_invalid{kind=\"MaaSSubscription\"}")
        .await
        != 0.0
    {
        assert!(start.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(calls.cluster.lock().unwrap().events.len(), 2);
}

#[tokio::test]
async fn the_key_api_works_from_resource_defined_subscriptions() {
    let calls = Arc::new(Calls::default());
    calls.apply_yaml(REFERENCE);
    let app = spawn_with_resources(calls.clone()).await;
    // `kube-other` is `dev`, groups [system:authenticated] (TokenReview of the stand-in).
    let r = app
        .public_get("/v1/subscriptions", Some("kube-other"))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let names: Vec<&str> = r
        .body
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["subscription_id_header"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["gpt-4o-subscription", "simulator-subscription"]);
    let sim = &r.body.as_array().unwrap()[1];
    assert_eq!(sim["display_name"], "Simulator Subscription (Free)");
    assert_eq!(
        sim["model_refs"],
        json!([{"name": "facebook-opt-125m-simulated", "namespace": "llm",
                "token_rate_limits": [{"limit": 100, "window": "1m"}]}])
    );

    // Mint bound to a named resource subscription, and one the caller does not own.
    let key = app
        .mint(
            "kube-other",
            json!({"name": "k", "subscription": "models-as-a-service/simulator-subscription"}),
        )
        .await;
    assert_eq!(key["subscription"], "simulator-subscription", "{key}");
    let refused = app
        .public_post(
            "/v1/api-keys",
            Some("kube-other"),
            &json!({"name": "p", "subscription": "premium-simulator-subscription"}),
        )
        .await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert_eq!(refused.code(), "invalid_subscription");
    // The key authenticates with its subscription.
    let auth = app.authenticate(key["key"].as_str().unwrap()).await;
    assert_eq!(auth.status, 200, "{}", auth.body);
    assert_eq!(
        auth.body["subscription"], "simulator-subscription",
        "{}",
        auth.body
    );
    let _: Value = auth.body;
}

/// Tenant resources reaching for a provider key of another namespace: by a
/// `credentialRef.namespace`, by a namespace in the Secret's name, by a MaaSModelRef naming
/// another namespace's ExternalModel. And one in a namespace whose Secrets the companion may not
/// read (no RoleBinding there: 403).
const BORROWING: &str = r#"
apiVersion: maas.opendatahub.io/v1alpha1
kind: ExternalModel
metadata: {name: by-field, namespace: tenant-b}
spec: {provider: openai, endpoint: api.openai.com, targetModel: gpt-4o, credentialRef: {name: openai-api-key, namespace: maas}}
---
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSModelRef
metadata: {name: by-field, namespace: tenant-b}
spec: {modelRef: {kind: ExternalModel, name: by-field}}
---
apiVersion: maas.opendatahub.io/v1alpha1
kind: ExternalModel
metadata: {name: by-name, namespace: tenant-b}
spec: {provider: openai, endpoint: api.openai.com, targetModel: gpt-4o, credentialRef: {name: maas/openai-api-key}}
---
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSModelRef
metadata: {name: by-name, namespace: tenant-b}
spec: {modelRef: {kind: ExternalModel, name: by-name}}
---
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSModelRef
metadata: {name: by-model, namespace: tenant-b}
spec: {modelRef: {kind: ExternalModel, name: gpt-4o, namespace: llm}}
---
apiVersion: maas.opendatahub.io/v1alpha1
kind: ExternalModel
metadata: {name: sealed, namespace: locked}
spec: {provider: openai, endpoint: api.openai.com, targetModel: gpt-4o, credentialRef: {name: openai-api-key}}
---
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSModelRef
metadata: {name: sealed, namespace: locked}
spec: {modelRef: {kind: ExternalModel, name: sealed}}
"#;

/// With `--policy-source kubernetes` an ExternalModel's credentialRef is a Secret of the
/// ExternalModel's own namespace: the reference's gpt-4o (namespace llm) gets llm's
/// `openai-api-key`, never the Secret of the same name in the companion's namespace (the
/// platform's key); a reference across namespaces is reported invalid and resolves nothing.
#[tokio::test]
async fn an_external_model_gets_its_own_namespaces_secret_never_the_platforms() {
    let calls = Arc::new(Calls::default());
    calls.apply_yaml(REFERENCE);
    let app = spawn_with_resources(calls.clone()).await;
    let creds = app.internal_get("/internal/v1/credentials").await;
    assert_eq!(creds.status, 200, "{}", creds.body);
    assert_eq!(
        creds.body,
        json!({"credentials": {"llm/openai-api-key": "sk-llm-tenant-key"}})
    );

    calls.apply_yaml(BORROWING);
    until(&app, "the locked namespace's model", |d| {
        d.model("sealed").is_some()
    })
    .await;
    let d = served(&app).await;
    for left_out in ["by-field", "by-name", "by-model"] {
        assert!(d.model(left_out).is_none(), "{left_out} is in the policy");
    }
    let mut invalid: Vec<(String, String, String)> = calls
        .cluster
        .lock()
        .unwrap()
        .events
        .iter()
        .map(|e| {
            let note = e["note"].as_str().unwrap_or_default();
            (
                e["regarding"]["kind"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                e["regarding"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                note.split(": ").next().unwrap_or_default().to_string(),
            )
        })
        .collect();
    invalid.sort();
    assert_eq!(
        invalid,
        [
            (
                "ExternalModel".to_string(),
                "by-field".to_string(),
                "spec.credentialRef.namespace".to_string()
            ),
            (
                "ExternalModel".to_string(),
                "by-name".to_string(),
                "spec.credentialRef.name".to_string()
            ),
            (
                "MaaSModelRef".to_string(),
                "by-model".to_string(),
                "spec.modelRef.namespace".to_string()
            ),
        ]
    );
    // Nothing borrowed; the Secret the companion may not read (403) is left out alone: the
    // others are still served (not a 503 for everyone).
    let creds = app.internal_get("/internal/v1/credentials").await;
    assert_eq!(creds.status, 200, "{}", creds.body);
    assert_eq!(
        creds.body,
        json!({"credentials": {"llm/openai-api-key": "sk-llm-tenant-key"}})
    );
    assert!(!creds.body.to_string().contains("sk-platform-key"));
}

/// An `inference.opendatahub.io` ExternalModel and ExternalProvider written to the v0.2.1 CRDs
/// (the release ships no sample for them), with the MaaSModelRef naming the ExternalModel.
const INFERENCE_EXTERNAL: &str =
    include_str!("../../../tests/fixtures/reference/v0.2.1/inference-external-model.yaml");

/// Polls `check` for up to `within` (the watcher's list retry backs off from 0.8 s).
async fn until_within(
    app: &crate::helpers::TestApp,
    within: Duration,
    what: &str,
    check: impl Fn(&PolicyDocument) -> bool,
) {
    let start = Instant::now();
    while !check(&served(app).await) {
        assert!(
            start.elapsed() < within,
            "{what}: not served after {within:?}: {:?}",
            served(app).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `inference.opendatahub.io` kinds are watched: an ExternalModel + ExternalProvider (and
/// the provider's Secret, `llm/openai-api-key`) applied to a running cluster are served — the
/// provider's endpoint, the body's model rewritten to `targetModel`, the provider's key.
#[tokio::test]
async fn an_inference_external_model_and_its_provider_are_watched_and_served() {
    let calls = Arc::new(Calls::default());
    let app = spawn_with_resources(calls.clone()).await;
    assert!(served(&app).await.model("gpt-4o-mini").is_none());
    calls.apply_yaml(INFERENCE_EXTERNAL);
    until(&app, "the inference ExternalModel", |d| {
        d.model("gpt-4o-mini").is_some()
    })
    .await;
    let d = served(&app).await;
    let m = d.model("gpt-4o-mini").unwrap();
    let p = m.provider.as_ref().unwrap();
    assert_eq!(p.secret(), (Some("llm"), "openai-api-key"));
    assert_eq!(
        m.upstream_cluster.as_deref(),
        Some("outbound|443||api.openai.com")
    );
    assert_eq!(m.served_name.as_deref(), Some("gpt-4o-mini-2024-07-18"));
    assert_eq!(m.aliases, ["openai/gpt-4o-mini"]);
    // The provider's Secret is what the filter gets as the model's key.
    let creds = app.internal_get("/internal/v1/credentials").await;
    assert_eq!(creds.status, 200, "{}", creds.body);
    assert_eq!(
        creds.body,
        json!({"credentials": {"llm/openai-api-key": "sk-llm-tenant-key"}})
    );

    // The provider switched to an auth the gateway cannot serve: the model leaves, and the
    // Event names the ExternalProvider of the inference group (not a maas ExternalModel).
    calls.apply_yaml(&INFERENCE_EXTERNAL.replace("type: apikey", "type: sigv4"));
    until(&app, "the model left out", |d| {
        d.model("gpt-4o-mini").is_none()
    })
    .await;
    let events = calls.cluster.lock().unwrap().events.clone();
    let regarding: Vec<&Value> = events.iter().map(|e| &e["regarding"]).collect();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(regarding[0]["kind"], "ExternalProvider");
    assert_eq!(
        regarding[0]["apiVersion"],
        "inference.opendatahub.io/v1alpha1"
    );
    assert_eq!(regarding[0]["name"], "openai");
    assert!(
        events[0]["note"]
            .as_str()
            .unwrap()
            .starts_with("spec.auth.type: "),
        "{events:?}"
    );
}

/// A cluster without the `inference.opendatahub.io` CRDs (their lists answer 404) still gets
/// its first policy from the `maas.opendatahub.io` resources, at once; the CRDs installed later
/// are read (the list is retried).
#[tokio::test]
async fn a_cluster_without_the_inference_crds_gets_its_first_policy() {
    let calls = Arc::new(Calls::without_inference_crds());
    calls.apply_yaml(REFERENCE);
    let app = tokio::time::timeout(Duration::from_secs(20), spawn_with_resources(calls.clone()))
        .await
        .expect("the companion starts without the inference CRDs");
    assert_eq!(served(&app).await, expected());
    // The companion did ask for both inference kinds.
    assert!(
        calls
            .inference_lists
            .load(std::sync::atomic::Ordering::SeqCst)
            >= 2,
        "the inference kinds were never listed"
    );
    // The CRDs arrive with resources: read at the next retry of the list.
    calls
        .inference_crds_absent
        .store(false, std::sync::atomic::Ordering::SeqCst);
    calls.apply_yaml(INFERENCE_EXTERNAL);
    until_within(
        &app,
        Duration::from_secs(20),
        "the CRDs installed later",
        |d| d.model("gpt-4o-mini").is_some(),
    )
    .await;
}

/// The reference's samples at v0.2.1, unchanged: opendatahub-io/models-as-a-service 4ce31a32
/// `docs/samples/maas-system/free/maas/{maas-model,maas-auth-policy,maas-subscription}.yaml`
/// and `docs/samples/maas-system/premium/maas/` (copied to tests/fixtures/reference/v0.2.1/).
const V0_2_1_SAMPLES: &str = concat!(
    include_str!("../../../tests/fixtures/reference/v0.2.1/maas-system-free.yaml"),
    "\n---\n",
    include_str!("../../../tests/fixtures/reference/v0.2.1/maas-system-premium.yaml")
);

/// The v0.2.1 samples (and an inference ExternalModel) loaded into the stand-in drive the
/// companion's real policy source: the served policy has their models with the annotations'
/// details, their subscriptions with names, priorities and limits; the status KServe's
/// controller writes (`resolvedModelAlias`) becomes the model's alias and served name; a
/// caller's `/v1/models` lists its subscription's model in the reference's shape.
#[tokio::test]
async fn the_v0_2_1_samples_drive_the_served_policy() {
    let calls = Arc::new(Calls::default());
    calls.apply_yaml(V0_2_1_SAMPLES);
    calls.apply_yaml(INFERENCE_EXTERNAL);
    let app = spawn_with_resources(calls.clone()).await;
    let d = served(&app).await;
    assert!(calls.cluster.lock().unwrap().events.is_empty());

    let mut names: Vec<&str> = d.models.iter().map(|m| m.name.as_str()).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "facebook-opt-125m-simulated",
            "gpt-4o-mini",
            "premium-simulated-simulated-premium"
        ]
    );
    let free = d.model("facebook-opt-125m-simulated").unwrap();
    assert_eq!(free.path, "/llm/facebook-opt-125m-simulated");
    assert_eq!(free.tiers, ["subscription-only"]);
    let details = free.details.as_ref().unwrap();
    assert_eq!(
        details.display_name.as_deref(),
        Some("Facebook OPT 125M (Simulated)")
    );
    assert_eq!(
        details.description.as_deref(),
        Some("A simulated OPT-125M model for free-tier testing")
    );
    assert!(free.aliases.is_empty() && free.served_name.is_none());
    let premium = d.model("premium-simulated-simulated-premium").unwrap();
    assert_eq!(
        premium.details.as_ref().unwrap().display_name.as_deref(),
        Some("Premium Simulator")
    );

    let subs: Vec<(&str, i32, Value)> = d
        .subscriptions
        .iter()
        .map(|s| {
            (
                s.name.as_str(),
                s.priority,
                serde_json::to_value(&s.models).unwrap(),
            )
        })
        .collect();
    assert_eq!(
        subs,
        [
            (
                "premium-simulator-subscription",
                20,
                json!([{"name": "premium-simulated-simulated-premium",
                        "tokenRateLimits": [{"limit": 1000, "window": "1m"}]}])
            ),
            (
                "simulator-subscription",
                10,
                json!([{"name": "facebook-opt-125m-simulated",
                        "tokenRateLimits": [{"limit": 100, "window": "1m"}]}])
            ),
        ]
    );
    let free_sub = d.subscription("simulator-subscription").unwrap();
    assert_eq!(
        free_sub.display_name.as_deref(),
        Some("Simulator Subscription (Free)")
    );
    let gpt = d.model("gpt-4o-mini").unwrap();
    assert_eq!(gpt.aliases, ["openai/gpt-4o-mini"]);
    assert_eq!(gpt.served_name.as_deref(), Some("gpt-4o-mini-2024-07-18"));

    // The status the reference's controller mirrors from KServe: the reference's model id.
    let with_status = include_str!(
        "../../../tests/fixtures/reference/v0.2.1/maas-system-free.yaml"
    )
    .split("\n---\n")
    .next()
    .unwrap()
    .to_string()
        + "\nstatus:\n  phase: Ready\n  resolvedModelAlias: publishers/llm/models/facebook/opt-125m\n";
    calls.apply_yaml(&with_status);
    until(&app, "the resolved model alias", |d| {
        d.model("facebook-opt-125m-simulated")
            .is_some_and(|m| !m.aliases.is_empty())
    })
    .await;
    let d = served(&app).await;
    let free = d.model("facebook-opt-125m-simulated").unwrap();
    assert_eq!(free.aliases, ["publishers/llm/models/facebook/opt-125m"]);
    assert_eq!(free.served_name.as_deref(), Some("facebook/opt-125m"));

    assert_free_listing_in_the_references_shape(&app).await;
}

/// Any authenticated caller has the v0.2.1 free subscription: its model, in the reference's
/// shape (alias, details, the subscription by name).
async fn assert_free_listing_in_the_references_shape(app: &crate::helpers::TestApp) {
    let r = app.public_get("/v1/models", Some("kube-other")).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let listed: Vec<&Value> = r.body["data"].as_array().unwrap().iter().collect();
    assert_eq!(listed.len(), 1, "{}", r.body);
    let m = listed[0];
    assert_eq!(m["id"], "facebook-opt-125m-simulated", "{m}");
    assert_eq!(
        m["aliases"],
        json!(["publishers/llm/models/facebook/opt-125m"])
    );
    assert_eq!(
        m["modelDetails"]["displayName"],
        "Facebook OPT 125M (Simulated)"
    );
    assert_eq!(
        m["subscriptions"],
        json!([{"name": "simulator-subscription",
                "displayName": "Simulator Subscription (Free)",
                "description": "Free-tier subscription with 100 tokens/min rate limit"}])
    );
}

/// Polls the stand-in's object until `check` holds on it (panics after 5 s).
async fn until_object(
    calls: &Calls,
    resource: &str,
    ns: &str,
    name: &str,
    check: impl Fn(&Value) -> bool,
) -> Value {
    let start = Instant::now();
    loop {
        let o = calls.object(resource, ns, name).unwrap_or(Value::Null);
        if check(&o) {
            return o;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{resource} {ns}/{name}: not as expected after 5 s: {o:#}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn condition<'a>(o: &'a Value, kind: &str) -> &'a Value {
    o["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == kind))
        .unwrap_or(&Value::Null)
}

/// `--write-status`: the companion, as the reference's controller, writes each resource's
/// `status` (through the status subresource, a merge patch) from the policy it built and the
/// model servers' readiness; it follows a server going down and an invalid spec, writes
/// nothing while nothing changes, and reports an invalid resource's Event once although its
/// status write gives it a new resource version.
#[tokio::test]
async fn as_the_controller_the_companion_writes_the_resources_status() {
    let calls = Arc::new(Calls::default());
    calls.apply_yaml(V0_2_1_SAMPLES);
    calls.apply_yaml(INFERENCE_EXTERNAL);
    let sim = crate::models::Backend::new().await;
    let sim_url = sim.url();
    let app = spawn_kube_app(calls.clone(), |s| {
        s.policy.source = PolicySource::Kubernetes {
            namespace: "models-as-a-service".into(),
        };
        s.policy.file = None;
        s.policy.write_status = true;
        s.model_probe.simulator_url = Some(sim_url);
        s.model_probe.ttl = Duration::from_millis(50);
        s.model_probe.timeout = Duration::from_millis(500);
    })
    .await;
    let refs = "maas.opendatahub.io/maasmodelrefs";
    let free = until_object(&calls, refs, "llm", "facebook-opt-125m-simulated", |o| {
        o["status"]["phase"] == "Ready"
    })
    .await;
    assert_eq!(
        condition(&free, "Ready")["reason"],
        "Reconciled",
        "{free:#}"
    );
    assert_eq!(condition(&free, "GovernanceAttached")["status"], "True");
    assert_eq!(condition(&free, "RuntimeReady")["reason"], "RuntimeHealthy");
    assert_eq!(condition(&free, "Ready")["observedGeneration"], 1);
    // What the reference's controller mirrored from KServe is left as it is.
    let sub = until_object(
        &calls,
        "maas.opendatahub.io/maassubscriptions",
        "models-as-a-service",
        "simulator-subscription",
        |o| o["status"]["phase"] == "Active",
    )
    .await;
    assert_eq!(sub["status"]["modelRefStatuses"][0]["reason"], "Valid");
    until_object(
        &calls,
        "maas.opendatahub.io/maasauthpolicies",
        "models-as-a-service",
        "simulator-access",
        |o| o["status"]["phase"] == "Active",
    )
    .await;
    until_object(
        &calls,
        "inference.opendatahub.io/externalmodels",
        "llm",
        "gpt-4o-mini",
        |o| o["status"]["phase"] == "Ready",
    )
    .await;
    until_object(
        &calls,
        "inference.opendatahub.io/externalproviders",
        "llm",
        "openai",
        |o| o["status"]["phase"] == "Ready",
    )
    .await;

    // Nothing changes: nothing is written (the watch events of its own writes included).
    tokio::time::sleep(ONE_RELOAD * 3).await;
    let settled = calls.cluster.lock().unwrap().status_patches.len();
    tokio::time::sleep(ONE_RELOAD * 4).await;
    let later = calls.cluster.lock().unwrap().status_patches.len();
    assert_eq!(later, settled, "status written while nothing changed");

    // The model server fails its probe: Unhealthy, governance untouched.
    sim.status.store(503, std::sync::atomic::Ordering::SeqCst);
    let down = until_object(&calls, refs, "llm", "facebook-opt-125m-simulated", |o| {
        o["status"]["phase"] == "Unhealthy"
    })
    .await;
    assert_eq!(
        condition(&down, "RuntimeReady")["reason"],
        "RuntimeHealthFailure"
    );
    assert_eq!(
        condition(&down, "GovernanceAttached")["lastTransitionTime"],
        condition(&free, "GovernanceAttached")["lastTransitionTime"]
    );

    an_invalid_spec_is_written_with_its_event_once(&calls).await;
    drop(app);
}

/// The free model's spec made invalid: status Invalid naming the field, at the new generation;
/// one Event (the status write's new resource version reports nothing again); its subscription
/// Failed.
async fn an_invalid_spec_is_written_with_its_event_once(calls: &Calls) {
    let refs = "maas.opendatahub.io/maasmodelrefs";
    let mut bad: Value =
        yaml_serde::from_str(V0_2_1_SAMPLES.split("\n---\n").next().unwrap()).unwrap();
    bad["spec"]["modelRef"]["kind"] = json!("InferenceService");
    calls.apply(bad);
    let invalid = until_object(calls, refs, "llm", "facebook-opt-125m-simulated", |o| {
        o["status"]["phase"] == "Invalid"
    })
    .await;
    assert!(
        condition(&invalid, "Ready")["message"]
            .as_str()
            .unwrap()
            .starts_with("spec.modelRef.kind: "),
        "{invalid:#}"
    );
    assert_eq!(condition(&invalid, "Ready")["observedGeneration"], 2);
    tokio::time::sleep(ONE_RELOAD * 3).await;
    let events = calls.cluster.lock().unwrap().events.len();
    assert_eq!(events, 1, "{:#?}", calls.cluster.lock().unwrap().events);
    // The subscription of that model lost it.
    until_object(
        calls,
        "maas.opendatahub.io/maassubscriptions",
        "models-as-a-service",
        "simulator-subscription",
        |o| o["status"]["phase"] == "Failed",
    )
    .await;
}

/// Without `--write-status` (the default) no status is written: the reference's controller
/// owns it.
#[tokio::test]
async fn by_default_no_status_is_written() {
    let calls = Arc::new(Calls::default());
    calls.apply_yaml(V0_2_1_SAMPLES);
    let app = spawn_with_resources(calls.clone()).await;
    until(&app, "the samples", |d| d.models.len() == 2).await;
    tokio::time::sleep(ONE_RELOAD * 3).await;
    assert!(calls.cluster.lock().unwrap().status_patches.is_empty());
}
