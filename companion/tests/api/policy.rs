use crate::helpers::{local_policy, spawn_app};
use std::time::{Duration, Instant};

#[tokio::test]
async fn policy_is_served_with_etag_and_304() {
    let app = spawn_app().await;
    let r = app.internal_get("/internal/v1/policy").await;
    assert_eq!(r.status, 200);
    let doc = maas_types::PolicyDocument::from_value(r.body.clone()).expect("valid policy");
    assert_eq!(doc.tiers.len(), 3);
    assert!(doc.revoked_key_ids.is_empty());
    let etag = r.headers["etag"].to_str().unwrap().to_string();
    assert!(etag.starts_with('"') && etag.ends_with('"'));
    let again = app
        .http
        .get(format!("{}/internal/v1/policy", app.internal))
        .header("if-none-match", &etag)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 304);
    assert!(again.bytes().await.unwrap().is_empty());
    // Not on the public listener.
    let r = app.public_get("/internal/v1/policy", None).await;
    assert_eq!(r.status, 404);
    assert_eq!(r.body["error"]["type"], "invalid_request_error");
}

async fn wait_for_tier_names(app: &crate::helpers::TestApp, expected: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = app.internal_get("/internal/v1/policy").await;
        let names: Vec<&str> = r.body["tiers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap())
            .collect();
        if names == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "tiers are {names:?}, want {expected:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn policy_reloads_and_rejects_invalid_versions() {
    let app = spawn_app().await;
    let before = app.internal_get("/internal/v1/policy").await;
    let renamed = local_policy()
        .replace("name: enterprise", "name: gold")
        .replace("tiers: [premium, enterprise]", "tiers: [premium, gold]")
        .replace(
            "tiers: [free, premium, enterprise]",
            "tiers: [free, premium, gold]",
        );
    crate::helpers::write_atomic(&app.policy_path, &renamed);
    wait_for_tier_names(&app, &["free", "premium", "gold"]).await;
    let after = app.internal_get("/internal/v1/policy").await;
    assert_ne!(before.headers["etag"], after.headers["etag"]);
    assert_eq!(
        app.metric("maas_policy_reload_total{result=\"accepted\"}")
            .await,
        1.0
    );

    // A broken window: rejected, the previous version stays.
    crate::helpers::write_atomic(
        &app.policy_path,
        &renamed.replace("window: 1m", "window: 0m"),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while app
        .metric("maas_policy_reload_total{result=\"rejected\"}")
        .await
        < 1.0
    {
        assert!(Instant::now() < deadline, "invalid policy not reported");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Also not YAML at all.
    crate::helpers::write_atomic(&app.policy_path, "tiers: [unclosed");
    let deadline = Instant::now() + Duration::from_secs(10);
    while app
        .metric("maas_policy_reload_total{result=\"rejected\"}")
        .await
        < 2.0
    {
        assert!(Instant::now() < deadline, "unparsable policy not reported");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    wait_for_tier_names(&app, &["free", "premium", "gold"]).await;
    let r = app.authenticate("carol-token").await;
    assert_eq!(r.body["tier"], "gold");
}

#[tokio::test]
async fn credentials_come_from_the_file_with_etag() {
    let app = spawn_app().await;
    let r = app.internal_get("/internal/v1/credentials").await;
    assert_eq!(r.status, 200);
    let doc: maas_types::CredentialsDocument = serde_json::from_value(r.body.clone()).unwrap();
    assert_eq!(doc.credentials["openai-key"], "sk-local-openai");
    assert!(r.headers.contains_key("etag"));
    let r = app.public_get("/internal/v1/credentials", None).await;
    assert_eq!(r.status, 404);
}
