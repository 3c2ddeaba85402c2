use crate::helpers::{spawn_app, spawn_app_with};
use chrono::{DateTime, Utc};
use serde_json::{Value, json};

fn ts(v: &Value) -> DateTime<Utc> {
    v.as_str().unwrap().parse().unwrap()
}

#[tokio::test]
async fn mint_returns_201_and_the_key_only_once_stored_as_hash_only() {
    let app = spawn_app().await;
    let body = app
        .mint(
            "alice-token",
            json!({"name": "  laptop ", "description": "for tests"}),
        )
        .await;
    let key = body["key"].as_str().unwrap();
    let parts = maas_types::apikey::parse(key).expect("well-formed key");
    assert_eq!(
        body["keyPrefix"],
        maas_types::apikey::display_prefix(parts.key_id)
    );
    assert_eq!(body["name"], "laptop");
    assert_eq!(body["description"], "for tests");
    assert_eq!(body["tier"], "free");
    assert_eq!(body["ephemeral"], false);
    let created = ts(&body["createdAt"]);
    let expires = ts(&body["expiresAt"]);
    assert_eq!((expires - created).num_days(), 90, "default is the maximum");

    // Never shown again: not in GET, not in search.
    let id = body["id"].as_str().unwrap();
    let got = app
        .public_get(&format!("/v1/api-keys/{id}"), Some("alice-token"))
        .await;
    assert_eq!(got.status, 200);
    assert!(got.body.get("key").is_none());
    assert!(!got.body.to_string().contains(parts.secret));
    assert_eq!(got.body["status"], "active");
    assert_eq!(got.body["username"], "alice");
    let found = app
        .public_post("/v1/api-keys/search", Some("alice-token"), &json!({}))
        .await;
    assert!(!found.body.to_string().contains(parts.secret));

    // The table holds the hash, never the plaintext or the secret half.
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT key_hash, row_to_json(api_keys)::text FROM api_keys")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].0, maas_types::apikey::hash(parts));
    assert!(
        !rows[0].1.contains(parts.secret),
        "secret stored: {}",
        rows[0].1
    );
    assert!(!rows[0].1.contains(key));
}

#[tokio::test]
async fn mint_validates_name_and_body() {
    let app = spawn_app().await;
    let cases = [
        (json!({}), "name is required"),
        (json!({"name": "   "}), "name is required"),
        (json!({"name": "x".repeat(129)}), "at most 128"),
        (json!({"name": "bad\u{1}name"}), "control characters"),
        (json!({"name": 5}), "name"),
    ];
    for (body, expected) in cases {
        let r = app
            .public_post("/v1/api-keys", Some("alice-token"), &body)
            .await;
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert!(r.message().contains(expected), "{body}: {}", r.body);
        assert_eq!(r.body["error"]["type"], "invalid_request_error");
    }
    // Not JSON at all.
    let r = app
        .http
        .post(format!("{}/v1/api-keys", app.public))
        .bearer_auth("alice-token")
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["error"]["type"], "invalid_request_error");
    // Over 1 MiB.
    let big = json!({"name": "k", "description": "x".repeat(1024 * 1024 + 10)});
    let r = app
        .public_post("/v1/api-keys", Some("alice-token"), &big)
        .await;
    assert_eq!(r.status, 413, "{}", r.body);
    assert_eq!(r.code(), "body_too_large");
}

#[tokio::test]
async fn expiry_rules() {
    let app = spawn_app_with(|c| c.keys.max_expiration_days = 30).await;
    for bad in [
        json!(""),
        json!("0"),
        json!(0),
        json!(-5),
        json!("-1h"),
        json!("abc"),
        json!("1"),
    ] {
        let r = app
            .public_post(
                "/v1/api-keys",
                Some("alice-token"),
                &json!({"name": "k", "expiresIn": bad}),
            )
            .await;
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
        assert_eq!(r.body["error"]["param"], "expiresIn");
    }
    let r = app
        .public_post(
            "/v1/api-keys",
            Some("alice-token"),
            &json!({"name": "k", "expiresIn": "31d"}),
        )
        .await;
    assert_eq!(r.status, 400);
    assert!(r.message().contains("exceeds maximum"), "{}", r.body);
    assert!(r.message().contains("30 days"), "{}", r.body);

    for (input, seconds) in [
        (json!("30d"), 30 * 86_400),
        (json!("1.5d"), 129_600),
        (json!("1h"), 3600),
        (json!("2h30m"), 9000),
        (json!(7200), 7200),
    ] {
        let b = app
            .mint("alice-token", json!({"name": "k", "expiresIn": input}))
            .await;
        let got = (ts(&b["expiresAt"]) - ts(&b["createdAt"])).num_seconds();
        assert!((got - seconds).abs() <= 1, "{input}: {got} != {seconds}");
    }
    let b = app.mint("alice-token", json!({"name": "k"})).await;
    assert_eq!(
        (ts(&b["expiresAt"]) - ts(&b["createdAt"])).num_days(),
        30,
        "omitted = the configured maximum"
    );

    // Ephemeral: default 1 h, never more, name optional.
    let b = app.mint("alice-token", json!({"ephemeral": true})).await;
    assert!(b["name"].as_str().unwrap().starts_with("ephemeral-"));
    assert_eq!(b["ephemeral"], true);
    assert_eq!(
        (ts(&b["expiresAt"]) - ts(&b["createdAt"])).num_seconds(),
        3600
    );
    let r = app
        .public_post(
            "/v1/api-keys",
            Some("alice-token"),
            &json!({"ephemeral": true, "expiresIn": "2h"}),
        )
        .await;
    assert_eq!(r.status, 400);
    assert!(r.message().contains("cannot exceed 1 hour"), "{}", r.body);

    let cfg = app
        .public_get("/v1/api-keys/config", Some("alice-token"))
        .await;
    assert_eq!(cfg.status, 200);
    assert_eq!(cfg.body["maxExpirationDays"], 30);
    assert_eq!(cfg.body["max_expiration_days"], 30);
    assert_eq!(cfg.body["ephemeralMaxExpirationSeconds"], 3600);
}

#[tokio::test]
async fn tier_pinning_and_no_enumeration() {
    let app = spawn_app().await;
    let not_allowed = app
        .public_post(
            "/v1/api-keys",
            Some("alice-token"),
            &json!({"name": "k", "tier": "premium"}),
        )
        .await;
    let unknown = app
        .public_post(
            "/v1/api-keys",
            Some("alice-token"),
            &json!({"name": "k", "tier": "gold"}),
        )
        .await;
    assert_eq!(not_allowed.status, 400);
    assert_eq!(not_allowed.code(), "invalid_tier");
    assert_eq!(
        not_allowed.body, unknown.body,
        "same answer: no enumeration"
    );

    // Bob (premium) may pin a key to free, which he also qualifies for.
    let pinned = app
        .mint("bob-token", json!({"name": "cheap", "tier": "free"}))
        .await;
    assert_eq!(pinned["tier"], "free");
    let auth = app.authenticate(pinned["key"].as_str().unwrap()).await;
    assert_eq!(auth.status, 200);
    assert_eq!(auth.body["tier"], "free");
    assert_eq!(auth.body["tier_pinned"], true);
    let unpinned = app.mint_named("bob-token", "main").await;
    assert_eq!(unpinned["tier"], "premium");
    let auth = app.authenticate(unpinned["key"].as_str().unwrap()).await;
    assert_eq!(auth.body["tier"], "premium");
    assert_eq!(auth.body["tier_pinned"], false);

    // Groups are snapshotted with the key.
    let groups: Vec<String> =
        sqlx::query_scalar("SELECT user_groups FROM api_keys WHERE name = 'main'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(groups, vec!["system:authenticated", "tier-premium-users"]);

    // Dave qualifies for no tier.
    let r = app
        .public_post("/v1/api-keys", Some("dave-token"), &json!({"name": "k"}))
        .await;
    assert_eq!(r.status, 403);
    assert_eq!(r.code(), "no_tier");
}

#[tokio::test]
async fn only_cluster_identities_mint_and_api_keys_may_read() {
    let app = spawn_app().await;
    let r = app
        .public_post("/v1/api-keys", None, &json!({"name": "k"}))
        .await;
    assert_eq!(r.status, 401);
    assert_eq!(r.body["error"]["type"], "authentication_error");
    let r = app
        .public_post("/v1/api-keys", Some("wrong-token"), &json!({"name": "k"}))
        .await;
    assert_eq!(r.status, 401);
    // Forged identity headers are not identity.
    let r = app
        .http
        .post(format!("{}/v1/api-keys", app.public))
        .header("x-maas-username", "carol")
        .header("x-maas-group", "[\"maas-admins\"]")
        .json(&json!({"name": "k"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);

    let minted = app.mint_named("alice-token", "k1").await;
    let key = minted["key"].as_str().unwrap();
    let id = minted["id"].as_str().unwrap();
    let r = app
        .public_post("/v1/api-keys", Some(key), &json!({"name": "k2"}))
        .await;
    assert_eq!(r.status, 403, "{}", r.body);
    assert_eq!(r.body["error"]["type"], "permission_error");
    let r = app
        .public_delete(&format!("/v1/api-keys/{id}"), Some(key))
        .await;
    assert_eq!(r.status, 403);
    // Reading works with the key.
    let r = app
        .public_get(&format!("/v1/api-keys/{id}"), Some(key))
        .await;
    assert_eq!(r.status, 200);
    let r = app
        .public_post("/v1/api-keys/search", Some(key), &json!({}))
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["data"].as_array().unwrap().len(), 1);
    let r = app.public_get("/v1/models", Some(key)).await;
    assert_eq!(r.status, 200);
    // Also through x-api-key.
    let r = app
        .http
        .get(format!("{}/v1/models", app.public))
        .header("x-api-key", key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // A malformed key is refused with the reason.
    let r = app.public_get("/v1/models", Some("sk-oai-broken")).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.message(), "invalid key format");
}

#[tokio::test]
async fn other_users_keys_are_404_unless_admin() {
    let app = spawn_app().await;
    let alice_key = app.mint_named("alice-token", "mine").await;
    let id = alice_key["id"].as_str().unwrap();
    let path = format!("/v1/api-keys/{id}");
    let r = app.public_get(&path, Some("bob-token")).await;
    assert_eq!(r.status, 404);
    assert_eq!(r.message(), "API key not found");
    let r = app.public_delete(&path, Some("bob-token")).await;
    assert_eq!(r.status, 404);
    // Still active after bob's attempt.
    let r = app.public_get(&path, Some("alice-token")).await;
    assert_eq!(r.body["status"], "active");
    // Carol is an admin.
    let r = app.public_get(&path, Some("carol-token")).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["username"], "alice");
    let r = app.public_delete(&path, Some("carol-token")).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["status"], "revoked");
    // Unknown and malformed ids.
    let r = app
        .public_get(
            &format!("/v1/api-keys/{}", uuid::Uuid::new_v4()),
            Some("alice-token"),
        )
        .await;
    assert_eq!(r.status, 404);
    let r = app
        .public_get("/v1/api-keys/not-a-uuid", Some("alice-token"))
        .await;
    assert_eq!(r.status, 404);
}

#[tokio::test]
async fn revoke_is_one_way_and_reaches_the_filter() {
    let app = spawn_app().await;
    let minted = app.mint_named("alice-token", "k").await;
    let id = minted["id"].as_str().unwrap();
    let key = minted["key"].as_str().unwrap();
    let key_id = maas_types::apikey::parse(key).unwrap().key_id.to_string();
    let before = app.internal_get("/internal/v1/policy").await;
    assert!(!before.body.to_string().contains(&key_id));

    let r = app
        .public_delete(&format!("/v1/api-keys/{id}"), Some("alice-token"))
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["status"], "revoked");
    assert!(r.body.get("key").is_none());
    let again = app
        .public_delete(&format!("/v1/api-keys/{id}"), Some("alice-token"))
        .await;
    assert_eq!(again.status, 404);

    let auth = app.authenticate(key).await;
    assert_eq!(auth.status, 401);
    assert_eq!(auth.message(), "key revoked");
    let after = app.internal_get("/internal/v1/policy").await;
    let revoked: Vec<String> = serde_json::from_value(after.body["revokedKeyIds"].clone()).unwrap();
    assert_eq!(revoked, vec![key_id]);
    assert_ne!(before.headers["etag"], after.headers["etag"]);
}

#[tokio::test]
async fn search_filters_sort_and_pagination() {
    let app = spawn_app().await;
    for name in ["c", "a", "b"] {
        app.mint_named("alice-token", name).await;
    }
    let revoked = app.mint_named("alice-token", "revoked-one").await;
    app.public_delete(
        &format!("/v1/api-keys/{}", revoked["id"].as_str().unwrap()),
        Some("alice-token"),
    )
    .await;
    let expired = app.mint_named("alice-token", "expired-one").await;
    sqlx::query("UPDATE api_keys SET expires_at = now() - interval '1 minute' WHERE id = $1::uuid")
        .bind(expired["id"].as_str().unwrap())
        .execute(&app.pool)
        .await
        .unwrap();
    app.mint("alice-token", json!({"ephemeral": true})).await;
    app.mint_named("bob-token", "bobs").await;

    let names = |r: &crate::helpers::Reply| -> Vec<String> {
        r.body["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k["name"].as_str().unwrap().to_string())
            .collect()
    };
    let search = |body: Value| {
        let app = &app;
        async move {
            app.public_post("/v1/api-keys/search", Some("alice-token"), &body)
                .await
        }
    };

    // Default: own keys, no ephemeral, created_at desc.
    let r = search(json!({})).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["object"], "list");
    assert_eq!(names(&r), ["expired-one", "revoked-one", "b", "a", "c"]);
    assert_eq!(r.body["has_more"], false);

    let r = search(json!({"sort": {"by": "name", "order": "asc"}})).await;
    assert_eq!(names(&r), ["a", "b", "c", "expired-one", "revoked-one"]);

    let r = search(
        json!({"sort": {"by": "name", "order": "asc"}, "pagination": {"limit": 2, "offset": 1}}),
    )
    .await;
    assert_eq!(names(&r), ["b", "c"]);
    assert_eq!(r.body["has_more"], true);
    let r = search(
        json!({"sort": {"by": "name", "order": "asc"}, "pagination": {"limit": 2, "offset": 4}}),
    )
    .await;
    assert_eq!(names(&r), ["revoked-one"]);
    assert_eq!(r.body["has_more"], false);

    let r = search(json!({"filters": {"status": ["expired"]}})).await;
    assert_eq!(names(&r), ["expired-one"]);
    assert_eq!(r.body["data"][0]["status"], "expired");
    let r = search(json!({"filters": {"status": ["revoked"]}})).await;
    assert_eq!(names(&r), ["revoked-one"]);
    let r =
        search(json!({"filters": {"status": ["active"]}, "sort": {"by": "name", "order": "asc"}}))
            .await;
    assert_eq!(names(&r), ["a", "b", "c"]);
    let r = search(json!({"filters": {"includeEphemeral": true, "status": ["active"]}})).await;
    assert_eq!(r.body["data"].as_array().unwrap().len(), 4);

    // Validation names the field.
    for (body, param) in [
        (json!({"filters": {"status": ["gone"]}}), "filters.status"),
        (json!({"sort": {"by": "key_hash"}}), "sort.by"),
        (json!({"sort": {"order": "up"}}), "sort.order"),
        (json!({"pagination": {"limit": 0}}), "pagination.limit"),
        (json!({"pagination": {"offset": -1}}), "pagination.offset"),
    ] {
        let r = search(body.clone()).await;
        assert_eq!(r.status, 400, "{body}");
        assert_eq!(r.body["error"]["param"], param, "{}", r.body);
        assert!(r.message().contains(param), "{}", r.body);
    }
    // Limit over the maximum is capped, not refused.
    let r = search(json!({"pagination": {"limit": 1000}})).await;
    assert_eq!(r.status, 200);

    // Non-admins only see their own; asking for another user is 403.
    let r = search(json!({"filters": {"username": "bob"}})).await;
    assert_eq!(r.status, 403);
    assert_eq!(
        r.message(),
        "non-admin users can only search their own API keys"
    );
    // Admins see everyone, or one user.
    let r = app
        .public_post("/v1/api-keys/search", Some("carol-token"), &json!({}))
        .await;
    assert_eq!(r.body["data"].as_array().unwrap().len(), 6);
    let r = app
        .public_post(
            "/v1/api-keys/search",
            Some("carol-token"),
            &json!({"filters": {"username": "bob"}}),
        )
        .await;
    assert_eq!(names(&r), ["bobs"]);
}

#[tokio::test]
async fn bulk_revoke_own_or_as_admin() {
    let app = spawn_app().await;
    app.mint_named("alice-token", "a1").await;
    let a2 = app.mint_named("alice-token", "a2").await;
    let b1 = app.mint_named("bob-token", "b1").await;

    let r = app
        .public_post(
            "/v1/api-keys/bulk-revoke",
            Some("bob-token"),
            &json!({"username": "alice"}),
        )
        .await;
    assert_eq!(r.status, 403);
    assert_eq!(
        r.message(),
        "Access denied: you can only bulk revoke your own API keys"
    );
    let r = app
        .public_post("/v1/api-keys/bulk-revoke", Some("bob-token"), &json!({}))
        .await;
    assert_eq!(r.status, 400);

    let r = app
        .public_post(
            "/v1/api-keys/bulk-revoke",
            Some("alice-token"),
            &json!({"username": "alice"}),
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["revokedCount"], 2);
    assert_eq!(
        r.body["message"],
        "Successfully revoked 2 active API key(s) for user alice"
    );
    assert_eq!(
        app.authenticate(a2["key"].as_str().unwrap()).await.status,
        401
    );
    assert_eq!(
        app.authenticate(b1["key"].as_str().unwrap()).await.status,
        200
    );

    let r = app
        .public_post(
            "/v1/api-keys/bulk-revoke",
            Some("carol-token"),
            &json!({"username": "bob"}),
        )
        .await;
    assert_eq!(r.body["revokedCount"], 1);
    assert_eq!(
        app.authenticate(b1["key"].as_str().unwrap()).await.status,
        401
    );
}

#[tokio::test]
async fn cleanup_deletes_ephemeral_keys_30_minutes_after_expiry() {
    let app = spawn_app().await;
    let old = app.mint("alice-token", json!({"ephemeral": true})).await;
    let recent = app.mint("alice-token", json!({"ephemeral": true})).await;
    let regular = app.mint_named("alice-token", "regular").await;
    for (id, minutes) in [(&old, 31), (&recent, 29), (&regular, 120)] {
        sqlx::query("UPDATE api_keys SET expires_at = now() - make_interval(mins => $2) WHERE id = $1::uuid")
            .bind(id["id"].as_str().unwrap())
            .bind(minutes)
            .execute(&app.pool)
            .await
            .unwrap();
    }
    let r = app
        .internal_post("/internal/v1/api-keys/cleanup", &json!({}))
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["deletedCount"], 1);
    let left: Vec<String> = sqlx::query_scalar("SELECT id::text FROM api_keys ORDER BY name")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(left.len(), 2);
    assert!(!left.contains(&old["id"].as_str().unwrap().to_string()));
    // Not reachable from the public listener.
    let r = app
        .public_post("/internal/v1/api-keys/cleanup", None, &json!({}))
        .await;
    assert_eq!(r.status, 404);
}

#[tokio::test]
async fn last_used_at_is_debounced() {
    let app = spawn_app_with(|c| {
        c.keys.last_used_flush_interval = std::time::Duration::from_millis(1000);
        // 256 requests share 10 connections: on a slow machine the queue may be long.
        c.database.acquire_timeout = std::time::Duration::from_secs(30);
    })
    .await;
    let minted = app.mint_named("alice-token", "hot").await;
    let key = minted["key"].as_str().unwrap().to_string();
    let started = std::time::Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..256 {
        let http = app.http.clone();
        let url = format!("{}/internal/v1/authenticate", app.internal);
        let key = key.clone();
        tasks.push(tokio::spawn(async move {
            http.post(url)
                .json(&json!({"credential": key}))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    // Wait for at least one flush.
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    let elapsed = started.elapsed().as_secs_f64();
    let written = app.metric("maas_last_used_rows_written_total").await;
    assert!(written >= 1.0, "last_used_at never written");
    // One write per key per interval at most, not one per request.
    assert!(
        written <= elapsed.ceil() + 1.0,
        "{written} writes in {elapsed:.1}s for 256 requests"
    );
    let last_used: Option<DateTime<Utc>> =
        sqlx::query_scalar("SELECT last_used_at FROM api_keys WHERE id = $1::uuid")
            .bind(minted["id"].as_str().unwrap())
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert!(last_used.unwrap() >= ts(&minted["createdAt"]));
    let got = app
        .public_get(
            &format!("/v1/api-keys/{}", minted["id"].as_str().unwrap()),
            Some("alice-token"),
        )
        .await;
    assert!(got.body["lastUsedAt"].is_string());
}
