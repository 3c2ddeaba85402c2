//! Only the gateway may use the companion's internal API (issue 26, item 6), on the local stack
//! as on a cluster: the companion's internal listener requires a client certificate from the
//! stack's private CA naming the gateway, which the stack's Envoy presents on its companion
//! cluster. Through the real Envoy everything works (authentication, the policy and provider
//! credential polls, usage reports); a caller that reaches the internal port without that
//! certificate gets no answer and no provider key; an Envoy whose companion cluster presents no
//! certificate fails closed.

use crate::helpers::*;
use maas_e2e::Stack;
use maas_e2e::extra_envoy::ExtraEnvoy;
use maas_e2e::internal_pki::{Ca, GATEWAY_CLIENT_NAME};
use serde_json::{Value, json};
use std::time::Duration;

const PROVIDER_KEY: &str = "sk-prov-internal-auth-4711";

const POLICY: &str = r#"
tiers:
  - name: free
    level: 0
    groups: [system:authenticated]
    limits:
      requests: [{limit: 100000, window: 1m}]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [free]
    backend: simulator
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

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    stack_with(
        &S,
        POLICY,
        IDENTITIES,
        "credentials:\n  openai-key: sk-prov-internal-auth-4711\n",
    )
}

/// Every internal route with a body it accepts.
fn internal_routes() -> Vec<(reqwest::Method, &'static str, Option<Value>)> {
    let hour = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        / 3600
        * 3600;
    vec![
        (
            reqwest::Method::POST,
            "/internal/v1/authenticate",
            Some(json!({"credential": "alice-token"})),
        ),
        (reqwest::Method::GET, "/internal/v1/policy", None),
        (reqwest::Method::GET, "/internal/v1/credentials", None),
        (reqwest::Method::POST, "/internal/v1/api-keys/cleanup", None),
        (
            reqwest::Method::POST,
            maas_types::lease::LEASES_PATH,
            Some(json!({"replica": "intruder", "items": [{
                "subject": "user:alice", "kind": "requests", "windowSeconds": 60,
                "windowStart": hour, "limit": 100000, "need": 0, "want": 0, "debt": 0,
                "release": 100000
            }]})),
        ),
        (
            reqwest::Method::POST,
            maas_types::usage::USAGE_PATH,
            Some(
                json!({"replica": "intruder", "batchId": "forged", "records": [{
                    "subject": "user:alice", "tier": "free", "model": "sim-model",
                    "hourStart": hour, "requests": 1000000, "promptTokens": 1, "completionTokens": 1
                }]}),
            ),
        ),
    ]
}

/// The answer of one internal call, or why there was none.
async fn call(
    http: &reqwest::Client,
    base: &str,
    method: &reqwest::Method,
    path: &str,
    body: &Option<Value>,
) -> Result<(u16, String), String> {
    let mut request = http
        .request(method.clone(), format!("{base}{path}"))
        .timeout(Duration::from_secs(10));
    if let Some(body) = body {
        request = request.json(body);
    }
    let resp = request.send().await.map_err(|e| format!("{e:?}"))?;
    let status = resp.status().as_u16();
    let text = resp.text().await.map_err(|e| format!("{e:?}"))?;
    Ok((status, text))
}

#[tokio::test]
async fn through_the_gateway_everything_works_over_mutual_tls() {
    let stack = stack();
    // The stack's Envoy presents the gateway's certificate on its companion cluster.
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(stack.envoy_config_path()).unwrap()).unwrap();
    let cluster = config["static_resources"]["clusters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == maas_e2e::envoy_config::COMPANION_INTERNAL_CLUSTER)
        .unwrap();
    let tls = &cluster["transport_socket"]["typed_config"]["common_tls_context"];
    assert!(
        tls["tls_certificates"][0]["certificate_chain"]["filename"].is_string(),
        "{cluster}"
    );

    // Authentication (a callout), the credentials poll (the provider key reaches the backend),
    // and the usage reports all go over it.
    let key = stack.mint_key_plain("alice-token", "mtls").await.unwrap();
    let r = send(
        client()
            .post(format!(
                "{}/ext/openai/v1/chat/completions",
                stack.gateway_url()
            ))
            .header("x-test-id", "mtls-ext")
            .bearer_auth(&key)
            .json(&json!({"model": "gpt-ext", "max_tokens": 2,
                          "messages": [{"role": "user", "content": "hi"}]})),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let seen = stack.sim_requests_with_test_id("mtls-ext");
    assert_eq!(
        seen.first().and_then(|s| s.header("authorization")),
        Some(format!("Bearer {PROVIDER_KEY}").as_str()),
        "the provider key the filter fetched over mutual TLS"
    );
    let usage = eventually(Duration::from_secs(20), || async {
        let r = send(
            client()
                .get(format!("{}/maas-api/v1/usage", stack.gateway_url()))
                .bearer_auth("alice-token"),
        )
        .await;
        r.status == 200 && r.body.contains("gpt-ext")
    })
    .await;
    assert!(
        usage.is_some(),
        "the filter's usage report reached the ledger"
    );
}

#[tokio::test]
async fn a_caller_without_the_gateways_certificate_gets_no_answer_and_no_provider_key() {
    let stack = stack();
    let pki = stack.internal_pki().expect("mutual TLS is the default");
    let internal = stack.companion_internal_url();
    assert!(internal.starts_with("https://"), "{internal}");
    let plain_url = internal.replacen("https://", "http://", 1);
    let other_ca = Ca::new("someone else's CA").unwrap();
    let callers: Vec<(&str, reqwest::Client, &str)> = vec![
        ("plain HTTP", client(), &plain_url),
        (
            "TLS without a certificate",
            pki.client(None).unwrap(),
            &internal,
        ),
        (
            "the gateway's name from another CA",
            pki.client(Some(
                &other_ca.client_identity(&[GATEWAY_CLIENT_NAME]).unwrap(),
            ))
            .unwrap(),
            &internal,
        ),
        (
            "the stack's CA, another name",
            pki.client(Some(
                &pki.ca
                    .client_identity(&["spiffe://maas.internal/tenant-workload"])
                    .unwrap(),
            ))
            .unwrap(),
            &internal,
        ),
    ];
    for (who, http, base) in &callers {
        for (method, path, body) in internal_routes() {
            if let Ok((status, text)) = call(http, base, &method, path, &body).await {
                panic!(
                    "{who}: {method} {path} answered {status}{}",
                    if text.contains(PROVIDER_KEY) {
                        " WITH THE PROVIDER KEY"
                    } else {
                        ""
                    }
                );
            }
        }
    }
    // The same request with the gateway's certificate: the key (so the refusals above are the
    // certificate's doing, not an unreachable port).
    let (status, text) = call(
        &stack.internal_client(),
        &internal,
        &reqwest::Method::GET,
        "/internal/v1/credentials",
        &None,
    )
    .await
    .unwrap();
    assert_eq!(status, 200);
    assert!(text.contains(PROVIDER_KEY));
    // The forged usage report and lease release were never applied.
    let r = send(
        client()
            .get(format!("{}/maas-api/v1/usage", stack.gateway_url()))
            .bearer_auth("alice-token"),
    )
    .await;
    assert!(!r.body.contains("1000000"), "{}", r.body);
    // Refusals are logged (no secret in any log).
    let logs = stack.logs_text();
    assert!(
        logs.contains("internal listener: connection refused at the TLS handshake"),
        "no refusal logged"
    );
    assert!(!logs.contains(PROVIDER_KEY), "the provider key is in a log");
}

#[tokio::test]
async fn an_envoy_that_presents_no_certificate_gets_nothing_and_fails_closed() {
    let stack = stack();
    let envoy = ExtraEnvoy::beside(stack, "no-client-cert", false, |v, _| {
        let clusters = v["static_resources"]["clusters"].as_array_mut().unwrap();
        let internal = clusters
            .iter_mut()
            .find(|c| c["name"] == maas_e2e::envoy_config::COMPANION_INTERNAL_CLUSTER)
            .unwrap();
        let ctx = &mut internal["transport_socket"]["typed_config"]["common_tls_context"];
        ctx.as_object_mut().unwrap().remove("tls_certificates");
        Ok(())
    })
    .unwrap_or_else(|e| panic!("the Envoy without a certificate did not start: {e:#}"));
    let key = stack
        .mint_key_plain("alice-token", "no-cert")
        .await
        .unwrap();
    let r = send(
        client()
            .post(format!(
                "{}/ext/openai/v1/chat/completions",
                envoy.gateway_url()
            ))
            .header("x-test-id", "no-client-cert")
            .bearer_auth(&key)
            .json(&json!({"model": "gpt-ext", "max_tokens": 2,
                          "messages": [{"role": "user", "content": "hi"}]})),
    )
    .await;
    let error = r.error(503);
    assert_eq!(error["type"], "service_unavailable", "{}", r.body);
    assert!(
        stack.sim_requests_with_test_id("no-client-cert").is_empty(),
        "the request reached the backend"
    );
}
