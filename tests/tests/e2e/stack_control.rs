//! The harness's controls on a stack of its own: policy replacement reaches the companion,
//! the companion and PostgreSQL stop and start again with their data kept.

use maas_e2e::{Stack, StackOptions};
use serde_json::Value;
use std::time::{Duration, Instant};

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

async fn status_of(req: reqwest::RequestBuilder) -> Option<u16> {
    req.send().await.ok().map(|r| r.status().as_u16())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controls_work_on_a_stack_of_its_own() {
    let stack = tokio::task::spawn_blocking(|| {
        Stack::start(StackOptions::default().with_policy_yaml(POLICY))
    })
    .await
    .unwrap()
    .expect("own stack starts");
    let client = stack.client();
    let internal = stack.internal_client();

    // The policy given in the options is what the companion serves.
    let policy_url = format!("{}/internal/v1/policy", stack.companion_internal_url());
    let served: Value = internal
        .get(&policy_url)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(served["tiers"].as_array().unwrap().len(), 1);

    // replace_policy: the companion reloads the file.
    stack
        .replace_policy(&format!(
            "{POLICY}\n  - name: second\n    path: /llm/second\n    tiers: [free]\n"
        ))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let served: Value = internal
            .get(&policy_url)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if served["models"].as_array().unwrap().len() == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "new policy not served: {served}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let key = stack
        .mint_key_plain("alice-token", "before-restart")
        .await
        .unwrap();

    // Companion down: its public API through the gateway is unavailable; back up: data kept.
    stack.stop_companion();
    let health = format!("{}/maas-api/health", stack.gateway_url());
    assert_ne!(status_of(client.get(&health)).await, Some(200));
    let s = &stack;
    tokio::task::block_in_place(|| s.start_companion()).unwrap();
    assert_eq!(status_of(client.get(&health)).await, Some(200));
    let auth = |cred: &str| {
        internal
            .post(format!(
                "{}/internal/v1/authenticate",
                stack.companion_internal_url()
            ))
            .json(&serde_json::json!({"credential": cred}))
    };
    assert_eq!(
        status_of(auth(&key)).await,
        Some(200),
        "key minted before the restart"
    );

    // PostgreSQL down: minting fails; back up: it works and old keys still authenticate.
    stack.stop_postgres();
    assert!(
        stack
            .mint_key_plain("alice-token", "db-down")
            .await
            .is_err()
    );
    tokio::task::block_in_place(|| s.start_postgres()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while stack.mint_key_plain("alice-token", "db-up").await.is_err() {
        assert!(
            Instant::now() < deadline,
            "minting never recovered after PostgreSQL restart"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(status_of(auth(&key)).await, Some(200));

    let dir = stack.dir().to_path_buf();
    let logs = stack.log_paths();
    assert!(
        logs.iter().all(|p| p.starts_with(&dir) && p.exists()),
        "{logs:?}"
    );
    assert!(
        !stack.logs_text().contains(&key),
        "the plaintext key appears in a log"
    );
    stack.check_alive().unwrap();
    drop(stack);
    assert!(!dir.exists(), "stack dir removed on drop");
}
