//! Subscriptions (issue 15): key binding at mint, labels, search, bulk revoke, the listings,
//! the authenticate answer. The policy is config/local/policy-subscriptions.yaml plus a
//! subscription owned by dave alone (dave qualifies for no tier).

use crate::helpers::{
    IDENTITIES, TestApp, local_settings, spawn_app, spawn_with_config, write_atomic,
};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const ANTI_ENUMERATION: &str = "Unable to resolve a subscription for this API key";

const DAVE_ONLY: &str = "
  - name: dave-only
    owner: {users: [dave]}
    models:
      - name: sim-model
        tokenRateLimits: [{limit: 10, window: 1m}]
";

fn subscriptions_policy() -> String {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/local/policy-subscriptions.yaml");
    let mut yaml = std::fs::read_to_string(path).unwrap();
    yaml.push_str(DAVE_ONLY);
    yaml
}

pub(crate) async fn spawn_with_subscriptions() -> TestApp {
    spawn_with_subscriptions_and(|_| {}).await
}

/// The same, its settings adjusted first.
pub(crate) async fn spawn_with_subscriptions_and(
    adjust: impl FnOnce(&mut maas_companion::Settings),
) -> TestApp {
    let database_url = crate::helpers::create_database().await;
    let dir = tempfile::tempdir().unwrap();
    let policy_path = dir.path().join("policy.yaml");
    let identities = dir.path().join("identities.yaml");
    let credentials = dir.path().join("credentials.yaml");
    std::fs::write(&policy_path, subscriptions_policy()).unwrap();
    std::fs::write(&identities, IDENTITIES).unwrap();
    std::fs::write(&credentials, "credentials: {}\n").unwrap();
    let mut config = local_settings(&database_url, &policy_path, &identities, &credentials);
    adjust(&mut config);
    spawn_with_config(config, dir, policy_path, database_url, Default::default()).await
}

fn key(body: &Value) -> &str {
    body["key"].as_str().unwrap()
}

#[tokio::test]
async fn mint_binds_the_named_or_the_default_subscription() {
    let app = spawn_with_subscriptions().await;
    // Alice (group tier-free-users) has team-a only: it is her default.
    let a = app.mint("alice-token", json!({"name": "a"})).await;
    assert_eq!(a["subscription"], "team-a", "{a}");
    assert_eq!(a["tier"], "free");
    // Bob (user-owned premium-sub, priority 5) — by default, by name, by namespace/name.
    let b = app.mint("bob-token", json!({"name": "b"})).await;
    assert_eq!(b["subscription"], "premium-sub", "{b}");
    let b = app
        .mint(
            "bob-token",
            json!({"name": "b2", "subscription": " models-as-a-service/premium-sub "}),
        )
        .await;
    assert_eq!(b["subscription"], "premium-sub", "{b}");
    // Carol has none: her key follows the tiers, as before.
    let c = app.mint("carol-token", json!({"name": "c"})).await;
    assert!(c.get("subscription").is_none(), "{c}");
    assert_eq!(c["tier"], "enterprise");
    // A pinned tier binds no subscription; naming both is refused.
    let pinned = app
        .mint("alice-token", json!({"name": "p", "tier": "free"}))
        .await;
    assert!(pinned.get("subscription").is_none(), "{pinned}");
    let both = app
        .public_post(
            "/v1/api-keys",
            Some("alice-token"),
            &json!({"name": "x", "tier": "free", "subscription": "team-a"}),
        )
        .await;
    assert_eq!(both.status, 400, "{}", both.body);
    assert_eq!(both.body["error"]["param"], "subscription");
    // Dave qualifies for no tier, but has dave-only: a key bound to it needs no tier.
    let d = app.mint("dave-token", json!({"name": "d"})).await;
    assert_eq!(d["subscription"], "dave-only", "{d}");
    assert!(d.get("tier").is_none(), "{d}");

    // The key view shows it.
    let id = a["id"].as_str().unwrap();
    let got = app
        .public_get(&format!("/v1/api-keys/{id}"), Some("alice-token"))
        .await;
    assert_eq!(got.body["subscription"], "team-a", "{}", got.body);
    assert_eq!(got.body["labels"], json!({}));
}

#[tokio::test]
async fn mint_refuses_a_subscription_it_cannot_use_with_one_message() {
    let app = spawn_with_subscriptions().await;
    let mut bodies = Vec::new();
    for (token, sub) in [
        ("alice-token", "premium-sub"),            // exists, not hers
        ("alice-token", "no-such-sub"),            // does not exist
        ("alice-token", "other-namespace/team-a"), // hers, wrong namespace
        ("carol-token", "team-a"),                 // carol has none at all
    ] {
        let r = app
            .public_post(
                "/v1/api-keys",
                Some(token),
                &json!({"name": "k", "subscription": sub}),
            )
            .await;
        assert_eq!(r.status, 400, "{token} {sub}: {}", r.body);
        assert_eq!(r.message(), ANTI_ENUMERATION);
        assert_eq!(r.code(), "invalid_subscription");
        bodies.push(r.body);
    }
    assert!(
        bodies.windows(2).all(|w| w[0] == w[1]),
        "the bodies must not tell the cases apart: {bodies:?}"
    );
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM api_keys")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(n, 0, "nothing minted");
}

#[tokio::test]
async fn a_tier_only_policy_binds_no_subscription() {
    let app = spawn_app().await;
    let a = app.mint("alice-token", json!({"name": "a"})).await;
    assert!(a.get("subscription").is_none(), "{a}");
    assert_eq!(a["tier"], "free");
    let r = app.authenticate(key(&a)).await;
    assert_eq!(r.status, 200);
    assert!(r.body.get("subscription").is_none(), "{}", r.body);
    let r = app
        .public_post(
            "/v1/api-keys",
            Some("alice-token"),
            &json!({"name": "k", "subscription": "team-a"}),
        )
        .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.message(), ANTI_ENUMERATION);
    let r = app
        .public_get("/v1/subscriptions", Some("alice-token"))
        .await;
    assert_eq!(r.body, json!([]));
}

#[tokio::test]
async fn labels_are_stored_shown_and_searched() {
    let app = spawn_with_subscriptions().await;
    let k1 = app
        .mint(
            "alice-token",
            json!({"name": "k1", "labels": {"team": "a", "env": "dev"}}),
        )
        .await;
    assert_eq!(k1["labels"], json!({"team": "a", "env": "dev"}));
    app.mint(
        "alice-token",
        json!({"name": "k2", "labels": {"team": "a"}}),
    )
    .await;
    app.mint("alice-token", json!({"name": "k3", "tier": "free"}))
        .await;
    let names = |r: &crate::helpers::Reply| -> Vec<String> {
        let mut n: Vec<String> = r.body["data"]
            .as_array()
            .unwrap_or_else(|| panic!("{}", r.body))
            .iter()
            .map(|k| k["name"].as_str().unwrap().to_string())
            .collect();
        n.sort();
        n
    };
    let search = |filters: Value| {
        let app = &app;
        async move {
            app.public_post(
                "/v1/api-keys/search",
                Some("alice-token"),
                &json!({"filters": filters}),
            )
            .await
        }
    };
    assert_eq!(
        names(&search(json!({"labelsContain": {"team": "a"}})).await),
        ["k1", "k2"]
    );
    assert_eq!(
        names(&search(json!({"labelsContain": {"team": "a", "env": "dev"}})).await),
        ["k1"]
    );
    assert!(names(&search(json!({"labelsContain": {"team": "b"}})).await).is_empty());
    assert_eq!(
        names(&search(json!({"subscription": "team-a"})).await),
        ["k1", "k2"]
    );
    assert!(names(&search(json!({"subscription": "premium-sub"})).await).is_empty());
    assert_eq!(names(&search(json!({})).await), ["k1", "k2", "k3"]);
    let found = search(json!({"labelsContain": {"env": "dev"}})).await;
    assert_eq!(
        found.body["data"][0]["labels"],
        json!({"team": "a", "env": "dev"})
    );
    assert_eq!(found.body["data"][0]["subscription"], "team-a");

    // Bounds.
    let many: serde_json::Map<String, Value> =
        (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
    for (labels, what) in [
        (Value::Object(many), "17 labels"),
        (json!({"bad key": "v"}), "a key with a space"),
        (json!({"k": "x".repeat(257)}), "a long value"),
    ] {
        let r = app
            .public_post(
                "/v1/api-keys",
                Some("alice-token"),
                &json!({"name": "k", "labels": labels}),
            )
            .await;
        assert_eq!(r.status, 400, "{what}: {}", r.body);
        assert_eq!(r.body["error"]["param"], "labels", "{what}");
    }
    let r = search(json!({"labelsContain": {"bad key": "v"}})).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.body["error"]["param"], "filters.labelsContain");
}

#[tokio::test]
async fn bulk_revoke_by_subscription_with_and_without_dry_run() {
    let app = spawn_with_subscriptions().await;
    let a1 = app.mint("alice-token", json!({"name": "a1"})).await;
    let a2 = app.mint("alice-token", json!({"name": "a2"})).await;
    let a_tier = app
        .mint("alice-token", json!({"name": "a3", "tier": "free"}))
        .await;
    let b1 = app.mint("bob-token", json!({"name": "b1"})).await;
    let revoke = |token: &'static str, body: Value| {
        let app = &app;
        async move {
            app.public_post("/v1/api-keys/bulk-revoke", Some(token), &body)
                .await
        }
    };

    // Dry run: counted, nothing revoked.
    let r = revoke(
        "alice-token",
        json!({"subscription": "team-a", "dryRun": true}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["matchedCount"], 2);
    assert_eq!(r.body["revokedCount"], 0);
    assert_eq!(r.body["dryRun"], true);
    for k in [&a1, &a2, &a_tier] {
        assert_eq!(app.authenticate(key(k)).await.status, 200);
    }

    // A non-admin: never another user's keys, dry run or not.
    for body in [
        json!({"username": "bob", "subscription": "premium-sub"}),
        json!({"username": "bob", "subscription": "premium-sub", "dryRun": true}),
    ] {
        let r = revoke("alice-token", body).await;
        assert_eq!(r.status, 403, "{}", r.body);
        assert_eq!(
            r.message(),
            "Access denied: you can only bulk revoke your own API keys"
        );
    }
    // …and without a username, only their own keys of the subscription (none here).
    let r = revoke("alice-token", json!({"subscription": "premium-sub"})).await;
    assert_eq!(r.body["revokedCount"], 0, "{}", r.body);
    assert_eq!(app.authenticate(key(&b1)).await.status, 200);
    // Neither username nor subscription.
    let r = revoke("alice-token", json!({"dryRun": true})).await;
    assert_eq!(r.status, 400, "{}", r.body);

    // For real: the subscription's keys go, the tier key stays.
    let r = revoke("alice-token", json!({"subscription": "team-a"})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["revokedCount"], 2);
    assert_eq!(
        r.body["message"],
        "Successfully revoked 2 active API key(s) for user alice in subscription team-a"
    );
    assert_eq!(app.authenticate(key(&a1)).await.status, 401);
    assert_eq!(app.authenticate(key(&a2)).await.status, 401);
    assert_eq!(app.authenticate(key(&a_tier)).await.status, 200);

    // An admin: every user's keys of a subscription.
    let r = revoke(
        "carol-token",
        json!({"subscription": "premium-sub", "dryRun": true}),
    )
    .await;
    assert_eq!(r.body["matchedCount"], 1, "{}", r.body);
    assert_eq!(app.authenticate(key(&b1)).await.status, 200);
    let r = revoke("carol-token", json!({"subscription": "premium-sub"})).await;
    assert_eq!(r.body["revokedCount"], 1, "{}", r.body);
    assert_eq!(app.authenticate(key(&b1)).await.status, 401);
}

#[tokio::test]
async fn subscriptions_are_listed_in_the_references_shape() {
    let app = spawn_with_subscriptions().await;
    let r = app
        .public_get("/v1/subscriptions", Some("alice-token"))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.body,
        json!([{
            "subscription_id_header": "team-a",
            "subscription_description": "Alice's team on the simulator",
            "display_name": "Team A",
            "priority": 1,
            "model_refs": [{
                "name": "sim-model",
                "namespace": "llm",
                "token_rate_limits": [{"limit": 5000, "window": "1m"}, {"limit": 200000, "window": "1d"}],
                "request_rate_limits": [{"limit": 60, "window": "1m"}],
                "billing_rate": {"per_token": "0.000002"}
            }],
            "organization_id": "org-team-a",
            "cost_center": "cc-1001",
            "labels": {"team": "a"}
        }])
    );
    // Description falls back to the display name; sorted by name.
    let r = app.public_get("/v1/subscriptions", Some("bob-token")).await;
    let subs = r.body.as_array().unwrap();
    assert_eq!(subs.len(), 1);
    assert_eq!(subs[0]["subscription_id_header"], "premium-sub");
    assert_eq!(subs[0]["subscription_description"], "Premium");
    assert_eq!(subs[0]["priority"], 5);
    assert!(subs[0].get("labels").is_none());
    let r = app
        .public_get("/v1/subscriptions", Some("carol-token"))
        .await;
    assert_eq!(r.body, json!([]));
    let r = app.public_get("/v1/subscriptions", None).await;
    assert_eq!(r.status, 401);

    // By model.
    let ids = |r: &crate::helpers::Reply| -> Vec<String> {
        r.body
            .as_array()
            .unwrap_or_else(|| panic!("{}", r.body))
            .iter()
            .map(|s| s["subscription_id_header"].as_str().unwrap().to_string())
            .collect()
    };
    let r = app
        .public_get("/v1/model/sim-premium/subscriptions", Some("bob-token"))
        .await;
    assert_eq!(ids(&r), ["premium-sub"]);
    let r = app
        .public_get("/v1/model/sim-premium/subscriptions", Some("alice-token"))
        .await;
    assert!(ids(&r).is_empty());
    let r = app
        .public_get("/v1/model/sim-model/subscriptions", Some("alice-token"))
        .await;
    assert_eq!(ids(&r), ["team-a"]);
    let r = app
        .public_get("/v1/model/no-such-model/subscriptions", Some("bob-token"))
        .await;
    assert!(ids(&r).is_empty());

    // An API key sees its owner's.
    let a = app.mint("alice-token", json!({"name": "a"})).await;
    let r = app.public_get("/v1/subscriptions", Some(key(&a))).await;
    assert_eq!(ids(&r), ["team-a"]);
}

#[tokio::test]
async fn the_authenticate_answer_carries_the_subscription_and_follows_the_policy() {
    let app = spawn_with_subscriptions().await;
    let a = app.mint("alice-token", json!({"name": "a"})).await;
    let c = app.mint("carol-token", json!({"name": "c"})).await;
    let d = app.mint("dave-token", json!({"name": "d"})).await;
    let r = app.authenticate(key(&a)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["subscription"], "team-a");
    assert_eq!(r.body["tier"], "free");
    // It still parses as the shared contract.
    let parsed: maas_types::AuthenticateResponse = serde_json::from_value(r.body).unwrap();
    assert_eq!(parsed.subscription.as_deref(), Some("team-a"));
    let r = app.authenticate(key(&c)).await;
    assert!(r.body.get("subscription").is_none(), "{}", r.body);
    assert_eq!(r.body["tier"], "enterprise");
    let r = app.authenticate(key(&d)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["subscription"], "dave-only");
    assert_eq!(r.body["tier"], "", "dave qualifies for no tier");

    // /v1/models of a bound key lists its subscription's models (dave's tier would list none).
    let r = app.public_get("/v1/models", Some(key(&d))).await;
    let models: Vec<&str> = r.body["data"]
        .as_array()
        .unwrap_or_else(|| panic!("{}", r.body))
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(models, ["sim-model"]);

    // team-a removed from the policy: alice's key is refused, carol's is not affected.
    let without_team_a = subscriptions_policy().replace("  - name: team-a", "  - name: team-z");
    write_atomic(&app.policy_path, &without_team_a);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = app.authenticate(key(&a)).await;
        if r.status == 403 {
            assert_eq!(r.code(), "invalid_subscription", "{}", r.body);
            assert_eq!(r.message(), "requested subscription not found");
            assert_eq!(r.body["error"]["type"], "permission_error");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "policy change not applied: {}",
            r.body
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let r = app.public_get("/v1/models", Some(key(&a))).await;
    assert_eq!(r.status, 403, "{}", r.body);
    assert_eq!(app.authenticate(key(&c)).await.status, 200);
}

/// A key's subscription that is gone and one that no longer lists the key's owner are refused
/// alike, at authentication and on `/v1/models`: the same status, code and message, byte for
/// byte, so the answer does not tell whether the subscription still exists.
#[tokio::test]
async fn a_keys_subscription_gone_or_no_longer_its_owners_is_refused_alike() {
    let app = spawn_with_subscriptions().await;
    let alice = app.mint("alice-token", json!({"name": "a"})).await;
    let dave = app.mint("dave-token", json!({"name": "d"})).await;
    assert_eq!(alice["subscription"], "team-a");
    assert_eq!(dave["subscription"], "dave-only");
    // team-a leaves the policy; dave-only stays but is erin's now.
    let changed = subscriptions_policy()
        .replace("  - name: team-a", "  - name: team-z")
        .replace("owner: {users: [dave]}", "owner: {users: [erin]}");
    write_atomic(&app.policy_path, &changed);
    let deadline = Instant::now() + Duration::from_secs(10);
    let (gone, not_his) = loop {
        let gone = app.authenticate(key(&alice)).await;
        let not_his = app.authenticate(key(&dave)).await;
        if gone.status == 403 && not_his.status == 403 {
            break (gone, not_his);
        }
        assert!(
            Instant::now() < deadline,
            "policy change not applied: {} / {}",
            gone.body,
            not_his.body
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(gone.code(), "invalid_subscription", "{}", gone.body);
    assert_eq!(gone.message(), "requested subscription not found");
    assert_eq!(
        not_his.body, gone.body,
        "authenticate tells the cases apart"
    );
    let gone = app.public_get("/v1/models", Some(key(&alice))).await;
    let not_his = app.public_get("/v1/models", Some(key(&dave))).await;
    assert_eq!((gone.status, not_his.status), (403, 403), "{}", gone.body);
    assert_eq!(not_his.body, gone.body, "/v1/models tells the cases apart");
}
