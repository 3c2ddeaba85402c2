//! Filter e2e (issue 4): pluginConfig options through real Envoy with the release .wasm —
//! extra headers removed, the request body cap, the bounded cache and its negative TTL.

use crate::helpers::*;
use maas_e2e::Stack;
use serde_json::json;

const POLICY: &str = r#"
tiers:
  - name: free
    level: 0
    groups: [system:authenticated]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [free]
    backend: simulator
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: t1-token, username: t1, groups: [system:authenticated]}
  - {token: t2-token, username: t2, groups: [system:authenticated]}
  - {token: t3-token, username: t3, groups: [system:authenticated]}
"#;

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    stack_with_plugin_config(
        &S,
        POLICY,
        IDENTITIES,
        "credentials: {}\n",
        Some(json!({
            "removeHeaders": ["cookie", "x-debug-user"],
            "maxRequestBodyBytes": 4096,
            "cache": {"maxEntries": 2, "negativeTtlSeconds": 0}
        })),
    )
}

/// Tests of this module that read its stack's global metrics take this so they do not count
/// each other (other modules have stacks of their own).
async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

const CHAT: &str = "/llm/sim-model/v1/chat/completions";

fn body(words: usize) -> serde_json::Value {
    json!({"model": "sim-model", "max_tokens": 2, "messages": [{"role": "user", "content": "w ".repeat(words)}]})
}

#[tokio::test]
async fn configured_headers_are_removed() {
    let _serial = serial().await;
    let stack = stack();
    let r = chat(
        stack,
        CHAT,
        "cfg-headers",
        &[
            ("authorization", "Bearer t1-token"),
            ("cookie", "session=secret"),
            ("X-Debug-User", "root"),
            ("x-kept", "yes"),
        ],
        body(2),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let seen = stack.sim_requests_with_test_id("cfg-headers");
    assert_eq!(seen.len(), 1);
    assert!(seen[0].header("cookie").is_none(), "{:?}", seen[0].headers);
    assert!(
        seen[0].header("x-debug-user").is_none(),
        "{:?}",
        seen[0].headers
    );
    assert_eq!(seen[0].header("x-kept"), Some("yes"));
}

#[tokio::test]
async fn body_cap_from_config() {
    let _serial = serial().await;
    let stack = stack();
    let r = chat(
        stack,
        CHAT,
        "cfg-small",
        &[("authorization", "Bearer t1-token")],
        body(100),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = chat(
        stack,
        CHAT,
        "cfg-big",
        &[("authorization", "Bearer t1-token")],
        body(3000),
    )
    .await;
    let e = r.error(413);
    assert_eq!(e["code"], "request_too_large");
    assert!(
        stack.sim_requests_with_test_id("cfg-big").is_empty(),
        "an over-size body reached the model"
    );
}

#[tokio::test]
async fn cache_is_bounded_oldest_first_and_negative_ttl_zero_caches_nothing() {
    let _serial = serial().await;
    let stack = stack();
    let call = |t: &'static str| async move {
        let r = chat(
            self::stack(),
            CHAT,
            "cfg-cache",
            &[("authorization", &bearer(t))],
            body(1),
        )
        .await;
        r.status
    };
    // Fill both slots (t1 may be cached already by another test: use it first either way).
    assert_eq!(call("t1-token").await, 200);
    assert_eq!(call("t2-token").await, 200);
    let base = companion_validations(stack).await;
    assert_eq!(call("t1-token").await, 200);
    assert_eq!(call("t2-token").await, 200);
    assert_eq!(
        companion_validations(stack).await,
        base,
        "both should be cached"
    );
    // A third credential takes the oldest slot (t1's)...
    assert_eq!(call("t3-token").await, 200);
    assert_eq!(companion_validations(stack).await, base + 1);
    // ... so t2 is still cached and t1 is asked for again.
    assert_eq!(call("t2-token").await, 200);
    assert_eq!(companion_validations(stack).await, base + 1);
    assert_eq!(call("t1-token").await, 200);
    assert_eq!(companion_validations(stack).await, base + 2);
    // negativeTtlSeconds 0: refusals are not cached.
    assert_eq!(call("nobody-token").await, 401);
    assert_eq!(call("nobody-token").await, 401);
    assert_eq!(companion_validations(stack).await, base + 4);
}

/// Sum of `upstream_rq_total` over the model clusters of an Envoy (not the companion's).
async fn model_upstream_requests(admin: &str) -> u64 {
    let text = send(client().get(format!("{admin}/stats?filter=upstream_rq_total")))
        .await
        .body;
    text.lines()
        .filter(|l| l.starts_with("cluster.") && !l.starts_with("cluster.maas-companion"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::test]
async fn pause_headers_for_body_never_starts_refused_upstream_requests() {
    let _serial = serial().await;
    let stack = stack();
    // The stack's Envoy config, with Envoy's allow_on_headers_stop_iteration and the filter's
    // pauseHeadersForBody, on fresh ports, in front of the same companion and simulator.
    let text = std::fs::read_to_string(stack.envoy_config_path()).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&text).unwrap();
    maas_e2e::envoy_config::hold_headers_for_body(&mut config).unwrap();
    let listener = &mut config["static_resources"]["listeners"][0];
    let free = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    let (port, admin_port) = (free(), free());
    listener["address"]["socket_address"]["port_value"] = json!(port);
    config["admin"]["address"]["socket_address"]["port_value"] = json!(admin_port);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("envoy-hold.json");
    std::fs::write(&path, config.to_string()).unwrap();
    let log = std::fs::File::create(dir.path().join("envoy-hold.log")).unwrap();
    let mut envoy = tokio::process::Command::new(maas_e2e::tools::envoy_bin().unwrap())
        .arg("-c")
        .arg(&path)
        .args([
            "--disable-hot-restart",
            "--concurrency",
            "1",
            "-l",
            "warning",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let admin = format!("http://127.0.0.1:{admin_port}");
    let gateway = format!("http://127.0.0.1:{port}");
    let ready = eventually(std::time::Duration::from_secs(60), || async {
        client()
            .get(format!("{admin}/ready"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;
    assert!(ready.is_some(), "the second Envoy never became ready");

    let post = |id: &'static str, body: serde_json::Value| {
        let gateway = gateway.clone();
        async move {
            send(
                client()
                    .post(format!("{gateway}{CHAT}"))
                    .header("authorization", "Bearer t2-token")
                    .header("x-test-id", id)
                    .json(&body),
            )
            .await
        }
    };
    // Allowed requests flow, the body intact with an exact content-length.
    let r = post("hold-ok", body(3)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let stream = json!({"model": "sim-model", "stream": true, "max_tokens": 2,
                        "messages": [{"role": "user", "content": "hi"}]});
    let r = post("hold-stream", stream).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let seen = stack.sim_requests_with_test_id("hold-stream");
    assert_eq!(seen.len(), 1);
    let sent: serde_json::Value = serde_json::from_str(&seen[0].body).unwrap();
    assert_eq!(sent["stream_options"]["include_usage"], true);
    assert_eq!(
        seen[0].header("content-length"),
        Some(seen[0].body.len().to_string().as_str()),
        "content-length must match the rewritten body: {:?}",
        seen[0].headers
    );

    // Body-stage refusals: no upstream request at all.
    let before = model_upstream_requests(&admin).await;
    let r = post("hold-mismatch", json!({"model": "other", "messages": []})).await;
    assert_eq!(r.error(400)["code"], "model_mismatch");
    let r = post("hold-big", body(3000)).await;
    r.error(413);
    let r = send(
        client()
            .post(format!("{gateway}{CHAT}"))
            .header("authorization", "Bearer t2-token")
            .header("content-type", "application/json")
            .body("[1,2]"),
    )
    .await;
    r.error(400);
    assert_eq!(
        model_upstream_requests(&admin).await,
        before,
        "a refused request started an upstream request"
    );
    let _ = envoy.kill().await;
}
