//! Provider key rotation (issue 12): replacing a provider credential at its source (on a cluster
//! the Secret the companion reads; here the companion's credentials file, replaced atomically the
//! way a Secret update lands) is live within one filter poll, with no request failing or being
//! sent without a key while it happens, and the old key never used again once the new one is.
//! Through real Envoy with the release .wasm, the real companion and PostgreSQL, at the
//! production poll interval (the shipped pluginConfig's `pollIntervalMs: 2000`).

use maas_e2e::{Stack, StackOptions};
use serde_json::json;
use std::time::{Duration, Instant};

const POLL_INTERVAL_MS: u64 = 2000;

const POLICY: &str = r#"
tiers:
  - name: free
    level: 0
    groups: [system:authenticated]
    limits:
      requests: [{limit: 100000, window: 1m}]
models:
  - name: gpt-ext
    path: /ext/openai
    tiers: [free]
    backend: simulator
    provider: {type: openai, credentialRef: openai-key}
    upstreamCluster: ext-openai
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: alice-token, username: alice, groups: [system:authenticated]}
"#;

fn credentials(key: &str) -> String {
    format!("credentials:\n  openai-key: {key}\n")
}

/// Sends one chat request tagged `id`; returns the status and the Authorization header the
/// backend received (None when the request did not reach it).
async fn call(
    client: &reqwest::Client,
    stack: &Stack,
    key: &str,
    id: &str,
) -> (u16, Option<String>) {
    let status = client
        .post(format!("{}/ext/openai/v1/chat/completions", stack.gateway_url()))
        .header("x-test-id", id)
        .header("authorization", format!("Bearer {key}"))
        .json(&json!({"model": "gpt-ext", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
        .send()
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0);
    let seen = stack.sim_requests_with_test_id(id);
    let auth = seen
        .first()
        .and_then(|r| r.header("authorization").map(str::to_string));
    (status, auth)
}

#[tokio::test]
async fn a_rotated_provider_key_is_live_within_one_poll_without_failed_requests() {
    let mut options = StackOptions::default()
        .with_policy_yaml(POLICY)
        .with_identities_yaml(IDENTITIES)
        .with_credentials_yaml(&credentials("sk-prov-old"));
    options.poll_interval_ms = POLL_INTERVAL_MS;
    let stack = tokio::task::spawn_blocking(move || Stack::start(options))
        .await
        .expect("stack start task")
        .expect("stack starts");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client");
    let key = stack
        .mint_key_plain("alice-token", "rotation")
        .await
        .expect("mint");

    // The first poll brings the old key.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut n = 0;
    loop {
        n += 1;
        let (status, auth) = call(&client, &stack, &key, &format!("warmup-{n}")).await;
        if status == 200 {
            assert_eq!(auth.as_deref(), Some("Bearer sk-prov-old"));
            break;
        }
        assert!(Instant::now() < deadline, "provider key never arrived");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Rotate: write the new file beside the old one and rename it over (atomic, like a Secret
    // volume's symlink swap; the companion re-reads its source on every poll it answers).
    let path = stack.credentials_path().to_path_buf();
    let staged = path.with_extension("new");
    std::fs::write(&staged, credentials("sk-prov-new")).expect("write the new credentials");
    let rotated_at = Instant::now();
    std::fs::rename(&staged, &path).expect("replace the credentials");

    let mut live_after = None;
    let mut i = 0;
    while rotated_at.elapsed() < Duration::from_millis(3 * POLL_INTERVAL_MS) {
        i += 1;
        let (status, auth) = call(&client, &stack, &key, &format!("rotate-{i}")).await;
        assert_eq!(
            status,
            200,
            "request {i} failed during the rotation ({:?} after it)",
            rotated_at.elapsed()
        );
        match auth.as_deref() {
            Some("Bearer sk-prov-new") => {
                live_after.get_or_insert(rotated_at.elapsed());
            }
            Some("Bearer sk-prov-old") => assert!(
                live_after.is_none(),
                "request {i} went out with the old key after the new one was live"
            ),
            other => panic!("request {i} reached the backend with {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let live_after = live_after.expect("the new key never went out");
    // One poll interval, plus the time one poll takes and one request's round trip.
    let bound = Duration::from_millis(POLL_INTERVAL_MS + 500);
    assert!(
        live_after <= bound,
        "the new key went live {live_after:?} after the rotation, more than one poll ({bound:?})"
    );
    eprintln!(
        "provider key rotation live after {live_after:?} (poll interval {POLL_INTERVAL_MS} ms)"
    );
}
