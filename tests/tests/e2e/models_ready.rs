//! `ready` in `GET /maas-api/v1/models` on the local stack: the companion probes the
//! simulator the stack started (`--simulator-url`), so a simulator model is ready while the
//! simulator listens and not ready once it is stopped, and ready again when it is back.

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

/// `ready` of `sim-model` in alice's listing through the gateway.
async fn sim_model_ready(stack: &Stack) -> bool {
    let r = stack
        .client()
        .get(format!("{}/maas-api/v1/models", stack.gateway_url()))
        .bearer_auth("alice-token")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    let model = body["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == "sim-model")
        .cloned()
        .unwrap_or_else(|| panic!("no sim-model in {body}"));
    model["ready"]
        .as_bool()
        .unwrap_or_else(|| panic!("no ready in {model}"))
}

/// Polls until `sim-model`'s `ready` is `want` (the probe answer is cached for the TTL).
async fn wait_ready(stack: &Stack, want: bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if sim_model_ready(stack).await == want {
            return;
        }
        assert!(Instant::now() < deadline, "sim-model never ready: {want}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulator_model_is_ready_while_the_simulator_runs() {
    let stack = tokio::task::spawn_blocking(|| {
        let mut options = StackOptions::default().with_policy_yaml(POLICY);
        options
            .companion_env
            .push(("MAAS_MODEL_READY_TTL_MS".into(), "200".into()));
        Stack::start(options)
    })
    .await
    .unwrap()
    .expect("own stack starts");

    // The first listing probes the running simulator.
    assert!(
        sim_model_ready(&stack).await,
        "simulator up, sim-model not ready"
    );

    let sim = stack.sim().clone();
    tokio::task::spawn_blocking(move || sim.stop())
        .await
        .unwrap();
    wait_ready(&stack, false).await;

    stack.sim().start().expect("simulator listens again");
    wait_ready(&stack, true).await;
}
