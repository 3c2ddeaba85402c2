//! The policy's `rateLimitHeaders: ietf` (issue 31): answers carry the IETF pair
//! `RateLimit-Policy` / `RateLimit` (draft-ietf-httpapi-ratelimit-headers) in place of OpenAI's
//! six `x-ratelimit-*`, through real Envoy with the release .wasm; a provider's own headers of
//! either kind never reach the client.

use crate::helpers::*;
use maas_e2e::Stack;
use serde_json::json;

const POLICY: &str = r#"
rateLimitHeaders: ietf
tiers:
  - name: ietf
    level: 0
    groups: [system:authenticated]
    limits:
      requests: [{limit: 3, window: 1d}]
      tokens: [{limit: 100000, window: 1d}]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [ietf]
    backend: simulator
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: ietf-token, username: ietf, groups: [system:authenticated]}
"#;

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    stack_with(&S, POLICY, IDENTITIES, "credentials: {}\n")
}

const CHAT: &str = "/llm/sim-model/v1/chat/completions";

#[tokio::test]
async fn answers_carry_the_ietf_pair_and_no_openai_headers() {
    let stack = stack();
    let h = [
        ("authorization", "Bearer ietf-token"),
        // The provider's own limits (x-ratelimit-*, RateLimit) come back from the simulator.
        ("x-sim-ratelimit-headers", "1"),
    ];
    let body = json!({"model": "sim-model", "max_tokens": 5,
                      "messages": [{"role": "user", "content": "hi"}]});
    for remaining in [2, 1, 0] {
        let r = chat(stack, CHAT, "ietf-ok", &h, body.clone()).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(
            r.header("ratelimit-policy"),
            Some("\"requests\";q=3;w=86400, \"tokens\";q=100000;w=86400"),
            "{:?}",
            r.headers
        );
        let state: Vec<&str> = r
            .headers
            .get_all("ratelimit")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        assert_eq!(state.len(), 1, "the gateway's only: {state:?}");
        assert!(
            state[0].starts_with(&format!("\"requests\";r={remaining};t=")),
            "{state:?}"
        );
        let openai: Vec<&str> = r
            .headers
            .keys()
            .map(|k| k.as_str())
            .filter(|k| k.starts_with("x-ratelimit-"))
            .collect();
        assert!(openai.is_empty(), "{openai:?}");
    }
    // The refusal carries the pair too.
    let r = chat(stack, CHAT, "ietf-429", &h, body).await;
    r.error(429);
    assert!(
        r.header("ratelimit")
            .is_some_and(|v| v.starts_with("\"requests\";r=0;t=")),
        "{:?}",
        r.headers
    );
    assert_eq!(r.header("x-ratelimit-remaining-requests"), None);
    assert!(stack.sim_requests_with_test_id("ietf-429").is_empty());
}
