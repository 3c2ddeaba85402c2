use crate::helpers::{spawn_app, spawn_app_with};
use maas_companion::settings::TlsFiles;

/// The public API, as the contract lists it: each route must be routed and documented in
/// `/openapi.json`, and nothing else may be documented.
const PUBLIC_ROUTES: &[(&str, &[&str])] = &[
    ("/v1/api-keys", &["post"]),
    ("/v1/api-keys/search", &["post"]),
    ("/v1/api-keys/bulk-revoke", &["post"]),
    ("/v1/api-keys/config", &["get"]),
    ("/v1/api-keys/{id}", &["get", "delete"]),
    ("/v1/models", &["get"]),
    ("/v1/tiers", &["get"]),
    ("/v1/subscriptions", &["get"]),
    ("/v1/model/{id}/subscriptions", &["get"]),
    ("/v1/usage", &["get"]),
    ("/v1/quota", &["get"]),
    ("/health", &["get"]),
    ("/ready", &["get"]),
    ("/openapi.json", &["get"]),
];
use serde_json::json;

#[tokio::test]
async fn health_ready_metrics() {
    let app = spawn_app().await;
    let r = app.public_get("/health", None).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["status"], "healthy");
    let r = app.public_get("/ready", None).await;
    assert_eq!(r.status, 200);
    let r = app.internal_get("/ready").await;
    assert_eq!(r.status, 200);
    app.mint_named("alice-token", "k").await;
    let text = app.scrape().await;
    assert!(text.contains("maas_api_keys_minted_total 1"), "{text}");
    assert!(text.contains(
        "maas_http_requests_total{listener=\"public\",route=\"/v1/api-keys\",method=\"POST\",status=\"201\"} 1"
    ));
    assert!(text.contains("maas_http_request_duration_seconds_bucket"));
}

/// The `maas_http_requests_total` series (label sets, without values) of a scrape.
async fn request_series(app: &crate::helpers::TestApp) -> Vec<String> {
    let text = app.scrape().await;
    let mut series: Vec<String> = text
        .lines()
        .filter(|l| l.starts_with("maas_http_requests_total{"))
        .filter_map(|l| l.rsplit_once(' ').map(|(labels, _)| labels.to_string()))
        .collect();
    series.sort();
    series
}

#[tokio::test]
async fn metrics_are_served_on_the_metrics_listener_only() {
    let app = spawn_app().await;
    // The public listener is what the Gateway routes `/maas-api/*` to, without authentication.
    let r = app.public_get("/metrics", None).await;
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(r.body["error"]["type"], "invalid_request_error");
    let r = app.public_get("/metrics", Some("carol-token")).await;
    assert_eq!(r.status, 404, "not even for an admin: {}", r.body);
    // The internal listener serves the provider credentials: Prometheus must not need it.
    let r = app.internal_get("/metrics").await;
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(r.body["error"]["type"], "invalid_request_error");

    let r = app
        .http
        .get(format!("{}/metrics", app.metrics))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/openmetrics-text")
    );
    // One registry for the process: the other listeners' requests show here.
    let text = r.text().await.unwrap();
    for listener in ["public", "internal"] {
        let series = format!(
            r#"maas_http_requests_total{{listener="{listener}",route="unmatched",method="GET",status="404"}}"#
        );
        assert!(text.contains(&series), "{series} missing: {text}");
    }
}

#[tokio::test]
async fn the_metrics_listener_serves_nothing_but_metrics_and_health() {
    let app = spawn_app().await;
    let get = |path: &str| app.http.get(format!("{}{path}", app.metrics));
    let r = get("/health").send().await.unwrap();
    assert_eq!(r.status(), 200);

    // Whoever may scrape must not read the provider keys, nor validate credentials.
    let r = get("/internal/v1/credentials").send().await.unwrap();
    assert_eq!(r.status(), 404);
    let body = r.text().await.unwrap();
    assert!(!body.contains("sk-local-openai"), "{body}");
    assert!(body.contains("invalid_request_error"), "{body}");
    let r = app
        .http
        .post(format!("{}/internal/v1/authenticate", app.metrics))
        .json(&json!({"credential": "alice-token"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    for path in [
        "/internal/v1/policy",
        "/internal/v1/api-keys/cleanup",
        "/v1/api-keys/config",
        "/v1/models",
        "/openapi.json",
        "/ready",
    ] {
        let r = get(path).bearer_auth("carol-token").send().await.unwrap();
        assert_eq!(r.status(), 404, "{path} on the metrics listener");
    }
    // The same credentials are served on the internal listener (the 404s above are not a broken
    // credentials source).
    let r = app.internal_get("/internal/v1/credentials").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.to_string().contains("sk-local-openai"), "{}", r.body);
}

#[tokio::test]
async fn clients_cannot_create_metric_series() {
    let app = spawn_app().await;
    let send = |method: &str, base: &str, path: String| {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let request = app.http.request(method, format!("{base}{path}"));
        async move { request.send().await.unwrap().status().as_u16() }
    };
    // Scrape once so that the scrape's own series exists before the comparison.
    request_series(&app).await;
    send("XRANDOMA", &app.public, "/health".into()).await;
    send("XRANDOMA", &app.internal, "/internal/v1/policy".into()).await;
    send(
        "XRANDOMA",
        &app.public,
        format!("/nope-{}", uuid::Uuid::new_v4()),
    )
    .await;
    let before = request_series(&app).await;

    // Other random methods, on the same routes and on other raw paths: no new series.
    for i in 0..20 {
        let id = uuid::Uuid::new_v4();
        send(&format!("XRANDOM{i}B"), &app.public, "/health".into()).await;
        send(
            &format!("XRANDOM{i}B"),
            &app.internal,
            "/internal/v1/policy".into(),
        )
        .await;
        send(&format!("XRANDOM{i}B"), &app.public, format!("/nope-{id}")).await;
        send(
            &format!("XRANDOM{i}B"),
            &app.public,
            format!("/health/{id}"),
        )
        .await;
    }
    let after = request_series(&app).await;
    assert_eq!(
        before, after,
        "client-chosen methods or paths created series"
    );
    let text = after.join("\n");
    assert!(!text.contains("XRANDOM"), "{text}");
    assert!(!text.contains("/nope-"), "{text}");
    assert!(text.contains(r#"route="/health",method="other""#), "{text}");
    assert!(
        text.contains(r#"route="unmatched",method="other""#),
        "{text}"
    );

    // The route label is the route template, never the raw path.
    let id = uuid::Uuid::new_v4();
    let r = app
        .public_get(&format!("/v1/api-keys/{id}"), Some("alice-token"))
        .await;
    assert_eq!(r.status, 404);
    let text = request_series(&app).await.join("\n");
    assert!(!text.contains(&id.to_string()), "{text}");
    assert!(
        text.contains(r#"route="/v1/api-keys/{id}",method="GET",status="404""#),
        "{text}"
    );
}

#[tokio::test]
async fn every_public_route_is_routed_and_in_openapi() {
    let app = spawn_app().await;
    let doc = app.public_get("/openapi.json", None).await;
    assert_eq!(doc.status, 200);
    let paths = doc.body["paths"].as_object().unwrap();
    let mut documented: Vec<(String, String)> = paths
        .iter()
        .flat_map(|(p, ops)| {
            ops.as_object()
                .unwrap()
                .keys()
                .map(move |m| (p.clone(), m.clone()))
        })
        .collect();
    let mut routed: Vec<(String, String)> = PUBLIC_ROUTES
        .iter()
        .flat_map(|(path, methods)| methods.iter().map(|m| (path.to_string(), m.to_string())))
        .collect();
    documented.sort();
    routed.sort();
    assert_eq!(documented, routed, "openapi.json and the public API differ");

    // Each listed route exists on the public listener (not the fallback, not 405)…
    for (path, method) in routed {
        let url = format!(
            "{}{}",
            app.public,
            path.replace("{id}", &uuid::Uuid::new_v4().to_string())
        );
        let req = match method.as_str() {
            "get" => app.http.get(url),
            "post" => app.http.post(url).json(&json!({})),
            "delete" => app.http.delete(url),
            other => panic!("unexpected method {other}"),
        };
        let r = req.bearer_auth("carol-token").send().await.unwrap();
        let status = r.status().as_u16();
        let body = r.text().await.unwrap();
        assert_ne!(status, 405, "{method} {path}");
        assert!(
            !body.contains("no such endpoint"),
            "{method} {path} is not routed"
        );
    }
    // …and no listed path serves a method that is not listed (any other method is a 405).
    for (path, methods) in PUBLIC_ROUTES {
        let url = format!("{}{}", app.public, path.replace("{id}", "x"));
        for method in ["get", "post", "delete"] {
            if methods.contains(&method) {
                continue;
            }
            let req = match method {
                "get" => app.http.get(&url),
                "post" => app.http.post(&url).json(&json!({})),
                _ => app.http.delete(&url),
            };
            let status = req.send().await.unwrap().status().as_u16();
            assert_eq!(status, 405, "{method} {path}");
        }
    }
}

#[tokio::test]
async fn listeners_are_separate_and_errors_are_json() {
    let app = spawn_app().await;
    // Public routes are not on the internal listener.
    let r = app
        .internal_post("/v1/api-keys", &json!({"name": "k"}))
        .await;
    assert_eq!(r.status, 404);
    let r = app.public_get("/internal/v1/authenticate", None).await;
    assert_eq!(r.status, 404);
    let r = app.public_get("/nope", None).await;
    assert_eq!(r.status, 404);
    assert_eq!(r.body["error"]["type"], "invalid_request_error");
    let r = app
        .public_get("/v1/api-keys/search", Some("alice-token"))
        .await;
    assert_eq!(r.status, 405);
    assert_eq!(r.body["error"]["code"], "method_not_allowed");
}

/// `GET /v1/models` with a forged `Host` (and `X-Forwarded-*`): the model URLs are the
/// configured public URL's, or absent without one; the forged host appears nowhere.
#[tokio::test]
async fn a_forged_host_never_reaches_the_model_urls() {
    let forged = |app: &crate::helpers::TestApp| {
        app.http
            .get(format!("{}/v1/models", app.public))
            .bearer_auth("bob-token")
            .header("host", "evil.example.net")
            .header("x-forwarded-proto", "https")
            .header("x-forwarded-host", "evil.example.net")
            .header("forwarded", "host=evil.example.net;proto=https")
            .send()
    };
    let configured = spawn_app_with(|s| {
        s.listeners.public_url = Some("https://maas.apps.example.com".into());
    })
    .await;
    let r = forged(&configured).await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(!text.contains("evil"), "{text}");
    let body: serde_json::Value = serde_json::from_str(&text).unwrap();
    let urls: Vec<&str> = body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["url"].as_str().unwrap())
        .collect();
    assert_eq!(
        urls,
        [
            "https://maas.apps.example.com/llm/sim-model",
            "https://maas.apps.example.com/llm/sim-premium"
        ]
    );

    let unconfigured = spawn_app().await;
    let r = forged(&unconfigured).await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(!text.contains("evil"), "{text}");
    let body: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["data"].as_array().unwrap().len(), 2, "{body}");
    assert!(
        body["data"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m.get("url").is_none()),
        "{body}"
    );
}

#[tokio::test]
async fn models_follow_the_callers_tier() {
    let app = spawn_app().await;
    let ids = |r: &crate::helpers::Reply| -> Vec<String> {
        r.body["data"]
            .as_array()
            .expect("data is an array")
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect()
    };
    let r = app.public_get("/v1/models", Some("alice-token")).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["cache-control"], "no-store");
    assert_eq!(r.body["object"], "list");
    assert_eq!(ids(&r), ["sim-model"]);
    let m = &r.body["data"][0];
    assert_eq!(m["object"], "model");
    assert_eq!(m["owned_by"], "llm");
    // `backend: simulator` without --simulator-url: not probed, so not known to be up.
    assert_eq!(m["ready"], false);
    assert_eq!(m["kind"], "llmisvc");
    assert!(m["created"].as_i64().unwrap() > 0);
    // No --public-url: no url (never one made from the request's Host).
    assert!(m.get("url").is_none(), "{m}");

    let r = app.public_get("/v1/models", Some("bob-token")).await;
    assert_eq!(ids(&r), ["sim-model", "sim-premium"]);
    // A key pinned to free lists free's models even for bob.
    let pinned = app
        .mint("bob-token", json!({"name": "k", "tier": "free"}))
        .await;
    let r = app
        .public_get("/v1/models", Some(pinned["key"].as_str().unwrap()))
        .await;
    assert_eq!(ids(&r), ["sim-model"]);
    // No tier: an empty list, never null.
    let r = app.public_get("/v1/models", Some("dave-token")).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["data"], json!([]));
    let r = app.public_get("/v1/models", None).await;
    assert_eq!(r.status, 401);

    let r = app.public_get("/v1/tiers", Some("bob-token")).await;
    assert_eq!(r.status, 200);
    let tiers = r.body["data"].as_array().unwrap();
    assert_eq!(tiers.len(), 3);
    let premium = tiers.iter().find(|t| t["name"] == "premium").unwrap();
    assert_eq!(premium["current"], true);
    assert_eq!(premium["qualified"], true);
    assert_eq!(premium["limits"]["requests"][0]["window"], "1m");
    let enterprise = tiers.iter().find(|t| t["name"] == "enterprise").unwrap();
    assert_eq!(enterprise["qualified"], false);
}

/// `--tls-cert` serves the public and metrics listeners, and the internal one too when its
/// callers are not checked (`--internal-auth none`; with mTLS it has its own: see
/// `internal_auth.rs`).
#[tokio::test]
async fn tls_on_every_listener() {
    let dir = tempfile::tempdir().unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let cert_path = dir.path().join("tls.crt");
    let key_path = dir.path().join("tls.key");
    std::fs::write(&cert_path, cert.cert.pem()).unwrap();
    std::fs::write(&key_path, cert.signing_key.serialize_pem()).unwrap();
    let app = spawn_app_with(|c| {
        c.listeners.tls = Some(TlsFiles {
            cert: cert_path.clone(),
            key: key_path.clone(),
        });
        c.listeners.internal_auth = maas_companion::settings::InternalAuth::None;
    })
    .await;
    let http = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(cert.cert.pem().as_bytes()).unwrap())
        .build()
        .unwrap();
    for addr in [
        app.app.public_addr(),
        app.app.internal_addr(),
        app.app.metrics_addr(),
    ] {
        let r = http
            .get(format!("https://localhost:{}/health", addr.port()))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        // Plain HTTP is not served.
        assert!(
            reqwest::get(format!("http://127.0.0.1:{}/health", addr.port()))
                .await
                .map(|r| !r.status().is_success())
                .unwrap_or(true)
        );
    }
}

#[tokio::test]
async fn graceful_shutdown_flushes_last_used() {
    let test_app =
        spawn_app_with(|c| c.keys.last_used_flush_interval = std::time::Duration::from_secs(3600))
            .await;
    let minted = test_app.mint_named("alice-token", "k").await;
    assert_eq!(
        test_app
            .authenticate(minted["key"].as_str().unwrap())
            .await
            .status,
        200
    );
    let crate::helpers::TestApp {
        app, pool, public, ..
    } = test_app;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(app.run_until(async {
        let _ = stopped.await;
    }));
    stop.send(()).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(15), running)
        .await
        .expect("shut down in time")
        .unwrap()
        .unwrap();
    let last_used: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT last_used_at FROM api_keys")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(
        last_used.is_some(),
        "pending last_used_at not flushed at shutdown"
    );
    assert!(reqwest::get(format!("{public}/health")).await.is_err());
}
