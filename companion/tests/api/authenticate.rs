use crate::helpers::spawn_app;
use serde_json::json;

#[tokio::test]
async fn api_keys_answer_with_subject_tier_and_ttl() {
    let app = spawn_app().await;
    let minted = app
        .mint("alice-token", json!({"name": "k", "expiresIn": "30s"}))
        .await;
    let key = minted["key"].as_str().unwrap();
    let r = app.authenticate(key).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let resp: maas_types::AuthenticateResponse = serde_json::from_value(r.body.clone()).unwrap();
    assert_eq!(resp.subject, "alice");
    assert_eq!(resp.tier, "free");
    assert_eq!(resp.groups, vec!["system:authenticated", "tier-free-users"]);
    assert_eq!(
        resp.key_id.as_deref(),
        Some(maas_types::apikey::parse(key).unwrap().key_id)
    );
    // Never cached past the key's expiry.
    assert!(resp.cache_ttl_seconds <= 30, "{}", resp.cache_ttl_seconds);
    let exp: chrono::DateTime<chrono::Utc> = minted["expiresAt"].as_str().unwrap().parse().unwrap();
    assert_eq!(resp.expires_at, Some(exp.timestamp()));
    let long = app.mint_named("alice-token", "long").await;
    let r = app.authenticate(long["key"].as_str().unwrap()).await;
    assert_eq!(r.body["cache_ttl_seconds"], 60);
}

#[tokio::test]
async fn refusals_say_why() {
    let app = spawn_app().await;
    let malformed = app.authenticate("sk-oai-short_abc").await;
    assert_eq!(malformed.status, 401);
    assert_eq!(malformed.message(), "invalid key format");
    assert_eq!(malformed.code(), "invalid_api_key");
    assert_eq!(malformed.body["error"]["type"], "authentication_error");

    let (_, unknown) = maas_types::apikey::format_key(&[1; 12], &[2; 32]);
    let r = app.authenticate(&unknown).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.message(), "key not found");

    // Right key id, wrong secret.
    let minted = app.mint_named("alice-token", "k").await;
    let key = minted["key"].as_str().unwrap();
    let mut forged = key[..key.len() - 1].to_string();
    forged.push(if key.ends_with('A') { 'B' } else { 'A' });
    let r = app.authenticate(&forged).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.message(), "key not found");

    sqlx::query("UPDATE api_keys SET expires_at = now() - interval '1 second'")
        .execute(&app.pool)
        .await
        .unwrap();
    let r = app.authenticate(key).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.message(), "key expired");

    let r = app.authenticate("random-string").await;
    assert_eq!(r.status, 401);
    assert_eq!(r.message(), "invalid token");
    let r = app.authenticate("  ").await;
    assert_eq!(r.status, 401);
    let r = app
        .internal_post("/internal/v1/authenticate", &json!({"nope": 1}))
        .await;
    assert_eq!(r.status, 400);

    assert!(
        app.metric("maas_authenticate_total{result=\"key_expired\"}")
            .await
            >= 1.0
    );
    assert!(
        app.metric("maas_authenticate_total{result=\"invalid_key_format\"}")
            .await
            >= 1.0
    );
}

#[tokio::test]
async fn tokens_resolve_the_highest_tier_and_no_tier_is_403() {
    let app = spawn_app().await;
    let r = app.authenticate("carol-token").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["subject"], "carol");
    assert_eq!(r.body["tier"], "enterprise");
    assert!(r.body.get("key_id").is_none());
    assert_eq!(r.body["cache_ttl_seconds"], 30);
    let r = app.authenticate("dave-token").await;
    assert_eq!(r.status, 403);
    assert_eq!(r.message(), "no tier");
    assert_eq!(r.code(), "no_tier");
    assert_eq!(r.body["error"]["type"], "permission_error");
}

#[tokio::test]
async fn keys_follow_the_current_policy() {
    let app = spawn_app().await;
    let bob = app.mint_named("bob-token", "k").await;
    let key = bob["key"].as_str().unwrap();
    assert_eq!(app.authenticate(key).await.body["tier"], "premium");
    // Premium no longer admits bob's group, and free no longer admits anyone bob is in.
    let policy = crate::helpers::local_policy()
        .replace("groups: [tier-premium-users]", "groups: [someone-else]")
        .replace(
            "groups: [system:authenticated, tier-free-users]",
            "groups: [tier-free-users]",
        );
    crate::helpers::write_atomic(&app.policy_path, &policy);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let r = app.authenticate(key).await;
        if r.status == 403 {
            assert_eq!(r.message(), "no tier");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "policy change not applied"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn database_down_is_503_and_the_service_recovers() {
    // A database that does not exist yet: the companion must start anyway, answer 503 where it
    // needs PostgreSQL, and become ready by itself once the database appears.
    let admin = crate::helpers::admin_url();
    let name = format!("maas_test_{}", uuid::Uuid::new_v4().simple());
    let url = crate::helpers::url_for_db(&admin, &name);
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.yaml");
    let ids = dir.path().join("ids.yaml");
    let creds = dir.path().join("creds.yaml");
    std::fs::write(&policy, crate::helpers::local_policy()).unwrap();
    std::fs::write(&ids, crate::helpers::IDENTITIES).unwrap();
    std::fs::write(&creds, "credentials: {}\n").unwrap();
    let config = crate::helpers::local_settings(&url, &policy, &ids, &creds);
    let started = std::time::Instant::now();
    let app = maas_companion::Application::build(config).await.unwrap();
    let public = format!("http://{}", app.public_addr());
    let internal = format!("https://{}", app.internal_addr());
    let http = crate::helpers::internal_pki().gateway_client();

    let health = http.get(format!("{public}/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let ready = http.get(format!("{public}/ready")).send().await.unwrap();
    assert_eq!(ready.status(), 503);
    let mint = http
        .post(format!("{public}/v1/api-keys"))
        .bearer_auth("alice-token")
        .json(&json!({"name": "k"}))
        .send()
        .await
        .unwrap();
    assert_eq!(mint.status(), 503);
    let body: serde_json::Value = mint.json().await.unwrap();
    assert!(body["error"]["message"].is_string());
    let (_, key) = maas_types::apikey::format_key(&[3; 12], &[4; 32]);
    let auth = http
        .post(format!("{internal}/internal/v1/authenticate"))
        .json(&json!({"credential": key}))
        .send()
        .await
        .unwrap();
    assert_eq!(auth.status(), 503);
    let policy = http
        .get(format!("{internal}/internal/v1/policy"))
        .send()
        .await
        .unwrap();
    assert_eq!(policy.status(), 503);
    // Generous bound: all of the above answered without hanging.
    assert!(started.elapsed() < std::time::Duration::from_secs(20));

    crate::helpers::create_named_database(&name).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let ready = http.get(format!("{public}/ready")).send().await.unwrap();
        if ready.status() == 200 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never became ready");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let mint = http
        .post(format!("{public}/v1/api-keys"))
        .bearer_auth("alice-token")
        .json(&json!({"name": "k"}))
        .send()
        .await
        .unwrap();
    assert_eq!(mint.status(), 201);
}

#[tokio::test]
async fn unreachable_postgres_answers_503_fast() {
    // Port 1 on localhost: nothing listens there.
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.yaml");
    let ids = dir.path().join("ids.yaml");
    let creds = dir.path().join("creds.yaml");
    std::fs::write(&policy, crate::helpers::local_policy()).unwrap();
    std::fs::write(&ids, crate::helpers::IDENTITIES).unwrap();
    std::fs::write(&creds, "credentials: {}\n").unwrap();
    let config = crate::helpers::local_settings(
        "postgres://postgres@127.0.0.1:1/none",
        &policy,
        &ids,
        &creds,
    );
    let app = maas_companion::Application::build(config).await.unwrap();
    let http = crate::helpers::internal_pki().gateway_client();
    let started = std::time::Instant::now();
    let r = http
        .get(format!("http://{}/ready", app.public_addr()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    let r = http
        .post(format!(
            "https://{}/internal/v1/authenticate",
            app.internal_addr()
        ))
        .json(&json!({"credential": "alice-token"}))
        .send()
        .await
        .unwrap();
    // Tokens do not need the database.
    assert_eq!(r.status(), 200);
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
}

/// Per-key limits at mint (issue 30): stored with the key, shown when it is fetched, handed to
/// the filter in the authenticate answer; bad limits are refused naming the field.
#[tokio::test]
async fn a_key_minted_with_limits_carries_them_to_the_filter() {
    let app = spawn_app().await;
    let limits = json!({"requests": [{"limit": 100, "window": "1d"}],
                        "tokens": [{"limit": 5000, "window": "1d"}]});
    let minted = app
        .mint("alice-token", json!({"name": "capped", "limits": limits}))
        .await;
    assert_eq!(minted["limits"], limits, "{minted}");
    let r = app.authenticate(minted["key"].as_str().unwrap()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let resp: maas_types::AuthenticateResponse = serde_json::from_value(r.body.clone()).unwrap();
    let got = resp.limits.expect("the key's limits");
    assert_eq!(got.requests.first().map(|l| l.limit), Some(100));
    assert_eq!(got.tokens.first().map(|l| l.limit), Some(5000));
    let fetched = app
        .public_get(
            &format!("/v1/api-keys/{}", minted["id"].as_str().unwrap()),
            Some("alice-token"),
        )
        .await;
    assert_eq!(fetched.body["limits"], limits, "{}", fetched.body);
    // A key without limits: none in the answer.
    let plain = app.mint_named("alice-token", "plain").await;
    let r = app.authenticate(plain["key"].as_str().unwrap()).await;
    assert!(r.body.get("limits").is_none(), "{}", r.body);

    for (bad, field) in [
        (json!({}), "at least one"),
        (
            json!({"requests": [{"limit": 0, "window": "1m"}]}),
            "limits.requests[0].limit",
        ),
        (
            json!({"tokens": [{"limit": 5, "window": "1m"}, {"limit": 6, "window": "1m"}]}),
            "limits.tokens",
        ),
        (
            json!({"requests": [{"limit": 1, "window": "1m"}], "nope": 1}),
            "nope",
        ),
    ] {
        let r = app
            .public_post(
                "/v1/api-keys",
                Some("alice-token"),
                &json!({"name": "bad", "limits": bad}),
            )
            .await;
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
        assert!(r.message().contains(field), "{bad}: {}", r.message());
    }
}
