//! `GET /v1/quota` for an API key bound to a subscription (issue 15): the subscription's windows
//! per model, read from the counters the gateways enforce against — the lease counters of
//! `maas_types::subscription::counter_subject(user, subscription, model)` — not the owner's tier
//! counters. The companion in-process over a fresh PostgreSQL database
//! (`MAAS_TEST_DATABASE_URL`, as the other companion tests).

use crate::helpers::{self, IDENTITIES, TestApp, local_settings, spawn_with_config};
use maas_types::lease::LEASES_PATH;
use maas_types::subscription::counter_subject;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::Duration;

fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

async fn spawn_with_subscriptions() -> TestApp {
    let database_url = helpers::create_database().await;
    let dir = tempfile::tempdir().unwrap();
    let policy_path = dir.path().join("policy.yaml");
    let identities = dir.path().join("identities.yaml");
    let credentials = dir.path().join("credentials.yaml");
    let policy =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/local/policy-subscriptions.yaml");
    std::fs::copy(policy, &policy_path).unwrap();
    std::fs::write(&identities, IDENTITIES).unwrap();
    std::fs::write(&credentials, "credentials: {}\n").unwrap();
    let config = local_settings(&database_url, &policy_path, &identities, &credentials);
    spawn_with_config(config, dir, policy_path, database_url, Default::default()).await
}

/// (model, kind, window, limit, used) of each row.
fn rows(body: &Value) -> Vec<(Value, Value, Value, Value, Value)> {
    body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["model"].clone(),
                r["kind"].clone(),
                r["window"].clone(),
                r["limit"].clone(),
                r["used"].clone(),
            )
        })
        .collect()
}

#[tokio::test]
async fn quota_of_a_subscription_key_reads_its_subscription_counters_per_model() {
    let app = spawn_with_subscriptions().await;
    // Room in the minute: the lease writes and the quota reads fall in one window.
    if 60 - now() % 60 < 10 {
        tokio::time::sleep(Duration::from_secs(11)).await;
    }
    let start = now() - now() % 60;
    let team_a = counter_subject("alice", "team-a", "sim-model");
    let r = app
        .internal_post(
            LEASES_PATH,
            &json!({"replica": "gw-1", "items": [
                // Under team-a on sim-model, as a gateway counts a bound key's requests.
                {"subject": team_a, "kind": "tokens", "windowSeconds": 60, "windowStart": start,
                 "limit": 5000, "debt": 700},
                {"subject": team_a, "kind": "requests", "windowSeconds": 60, "windowStart": start,
                 "limit": 60, "need": 3},
                // Alice's own (tier) counter: not the subscription's.
                {"subject": "alice", "kind": "tokens", "windowSeconds": 60, "windowStart": start,
                 "limit": 2000, "debt": 50},
            ]}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);

    // Alice's default subscription is team-a.
    let minted = app.mint("alice-token", json!({"name": "q"})).await;
    assert_eq!(minted["subscription"], "team-a", "{minted}");
    let key = minted["key"].as_str().unwrap();
    let q = app.public_get("/v1/quota", Some(key)).await;
    assert_eq!(q.status, 200, "{}", q.body);
    assert_eq!(q.body["subscription"], "team-a", "{}", q.body);
    assert_eq!(q.body["tier"], "subscription:team-a", "{}", q.body);
    assert_eq!(
        rows(&q.body),
        vec![
            (
                json!("sim-model"),
                json!("requests"),
                json!("1m"),
                json!(60),
                json!(3)
            ),
            (
                json!("sim-model"),
                json!("tokens"),
                json!("1m"),
                json!(5000),
                json!(700)
            ),
            (
                json!("sim-model"),
                json!("tokens"),
                json!("1d"),
                json!(200000),
                json!(0)
            ),
        ],
        "{}",
        q.body
    );

    // Her token (no subscription) still reads her tier counters.
    let own = app.public_get("/v1/quota", Some("alice-token")).await;
    assert_eq!(own.status, 200, "{}", own.body);
    assert_eq!(own.body["tier"], "free");
    assert!(own.body.get("subscription").is_none(), "{}", own.body);
    let tokens_1m = own.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["kind"] == "tokens" && r["window"] == "1m")
        .unwrap()
        .clone();
    assert_eq!(tokens_1m["used"], 50, "{}", own.body);
    assert!(tokens_1m.get("model").is_none(), "{tokens_1m}");
}
