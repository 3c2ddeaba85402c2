//! Issue 2 end-to-end basics, through real Envoy with the real filter, the real companion and
//! real PostgreSQL: a minted key works and never reaches the model; everything else is a 401.

use maas_e2e::Stack;
use serde_json::{Value, json};

fn chat_body() -> Value {
    json!({"model": "sim-model", "messages": [{"role": "user", "content": "hello gateway"}]})
}

/// Asserts an OpenAI-style error body: `{"error":{"message","type",…}}`.
fn assert_openai_error(body: &str) -> Value {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"));
    assert!(
        v["error"]["message"].is_string(),
        "no error.message: {body}"
    );
    assert!(v["error"]["type"].is_string(), "no error.type: {body}");
    v
}

async fn call_chat(stack: &Stack, test_id: &str, auth: Option<&str>) -> (u16, String) {
    let mut req = stack
        .client()
        .post(format!(
            "{}/llm/sim-model/v1/chat/completions",
            stack.gateway_url()
        ))
        .header("x-test-id", test_id)
        .json(&chat_body());
    if let Some(a) = auth {
        req = req.header("Authorization", a);
    }
    let resp = req.send().await.expect("gateway answers");
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap_or_default())
}

#[tokio::test]
async fn minted_key_calls_model_and_backend_sees_no_authorization() {
    let stack = Stack::shared();
    let minted = stack
        .mint_key("alice-token", json!({"name": "basics-key"}))
        .await
        .expect("alice can mint a key");
    let key = minted["key"].as_str().expect("key in mint response");
    assert!(key.starts_with("sk-oai-"), "unexpected key shape");

    let (status, body) = call_chat(stack, "basics-ok", Some(&format!("Bearer {key}"))).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["usage"]["prompt_tokens"], 2);

    let seen = stack.sim_requests_with_test_id("basics-ok");
    assert_eq!(seen.len(), 1, "the simulator got exactly one request");
    let req = &seen[0];
    assert_eq!(req.path, "/v1/chat/completions", "prefix rewritten to /");
    assert!(
        req.header("authorization").is_none(),
        "Authorization reached the model: {:?}",
        req.headers
    );
    assert!(
        !req.headers.iter().any(|(_, v)| v.contains(key)),
        "the key reached the model in some header"
    );
    assert!(
        !stack.logs_text().contains(key),
        "the plaintext key appears in a log"
    );
}

#[tokio::test]
async fn no_credential_is_401_openai_error() {
    let stack = Stack::shared();
    let (status, body) = call_chat(stack, "basics-none", None).await;
    assert_eq!(status, 401, "{body}");
    assert_openai_error(&body);
    assert!(stack.sim_requests_with_test_id("basics-none").is_empty());
}

#[tokio::test]
async fn unknown_well_formed_key_is_401() {
    let stack = Stack::shared();
    // Right shape (base62 key id of 12 bytes, secret of 32 bytes), never minted.
    let (_, key) = maas_types::apikey::format_key(&[7; 12], &[9; 32]);
    assert!(maas_types::apikey::parse(&key).is_ok());
    let (status, body) = call_chat(stack, "basics-unknown", Some(&format!("Bearer {key}"))).await;
    assert_eq!(status, 401, "{body}");
    assert_openai_error(&body);
    assert!(stack.sim_requests_with_test_id("basics-unknown").is_empty());
}

#[tokio::test]
async fn random_string_is_401() {
    let stack = Stack::shared();
    for cred in [
        "Bearer qwertyuiop-not-a-key",
        "Bearer sk-oai-short",
        "Basic YWxpY2U6eA==",
    ] {
        let (status, body) = call_chat(stack, "basics-random", Some(cred)).await;
        assert_eq!(status, 401, "{cred}: {body}");
        assert_openai_error(&body);
    }
    assert!(stack.sim_requests_with_test_id("basics-random").is_empty());
}

#[tokio::test]
async fn management_health_is_routed() {
    let stack = Stack::shared();
    let resp = stack
        .client()
        .get(format!("{}/maas-api/health", stack.gateway_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
}

#[tokio::test]
async fn internal_api_is_never_routed() {
    let stack = Stack::shared();
    for path in [
        "/maas-api/internal/v1/policy",
        "/maas-api//internal/v1/policy",
        "/maas-api/./internal/v1/policy",
        "/maas-api/x/../internal/v1/policy",
        "/maas-api/internal%2Fv1%2Fpolicy",
    ] {
        let resp = stack
            .client()
            .get(format!("{}{path}", stack.gateway_url()))
            .bearer_auth("carol-token")
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let body = resp.text().await.unwrap_or_default();
        assert_eq!(status, 404, "{path}: {body}");
        assert!(!body.contains("tiers"), "{path} leaked the policy: {body}");
    }
}

#[tokio::test]
async fn unknown_path_is_404() {
    let stack = Stack::shared();
    let resp = stack
        .client()
        .get(format!("{}/nothing/here", stack.gateway_url()))
        .bearer_auth("alice-token")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
}
