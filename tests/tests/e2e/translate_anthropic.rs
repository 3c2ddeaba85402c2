//! An OpenAI chat client reaching a model whose backend speaks Anthropic Messages (issue 29,
//! translation), through real Envoy with the release .wasm and the strict simulator (which
//! refuses a Messages body Anthropic would refuse: no `max_tokens`, unknown fields, a `system`
//! role in `messages`…): `POST /v1/chat/completions` at the model's path and at the one base URL,
//! streamed and not, answers valid OpenAI chat; the backend gets `POST …/v1/messages` with
//! `anthropic-version`; the ledger and the token window charge exactly what a direct Messages
//! call of the same usage charges; the official OpenAI SDK calls it, streamed and not.
//!
//! Windows are a day long so that no test straddles a window boundary.

use crate::helpers::*;
use maas_e2e::Stack;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const POLICY: &str = r#"
tiers:
  - name: tr
    level: 1
    groups: [g-tr]
    limits:
      tokens: [{limit: 100000, window: 1d}]
    defaultMaxTokens: 6
    uncappedRequests: reserve
models:
  - name: sim-claude
    path: /llm/sim-claude
    tiers: [tr]
    backend: simulator
    api: anthropic
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: plain-token, username: plain, groups: [g-tr]}
  - {token: stream-token, username: streamer, groups: [g-tr]}
  - {token: one-url-token, username: oneurl, groups: [g-tr]}
  - {token: refused-token, username: refused, groups: [g-tr]}
  - {token: translated-token, username: translated, groups: [g-tr]}
  - {token: direct-token, username: direct, groups: [g-tr]}
  - {token: sdk-token, username: sdk, groups: [g-tr]}
  - {token: gz-token, username: gz, groups: [g-tr]}
  - {token: gz-twin-token, username: gztwin, groups: [g-tr]}
"#;

const REPORT_INTERVAL_MS: u64 = 500;

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    stack_with_plugin_config(
        &S,
        POLICY,
        IDENTITIES,
        "credentials: {}\n",
        Some(json!({"usage": {"reportIntervalMs": REPORT_INTERVAL_MS}})),
    )
}

const CHAT: &str = "/llm/sim-claude/v1/chat/completions";
const MESSAGES: &str = "/llm/sim-claude/v1/messages";

async fn post(path: &str, token: &str, id: &str, body: Value) -> Reply {
    chat(
        stack(),
        path,
        id,
        &[("authorization", &bearer(token))],
        body,
    )
    .await
}

/// What the simulator received for `id` (exactly one request).
fn upstream(id: &str) -> maas_e2e::sim::RecordedRequest {
    let seen = stack().sim_requests_with_test_id(id);
    assert_eq!(
        seen.len(),
        1,
        "{id} reached the backend {} times",
        seen.len()
    );
    seen.into_iter().next().unwrap()
}

/// The `data:` payloads of an OpenAI stream.
fn data_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not an OpenAI data event: {e:?} in {body}"))
                .to_string()
        })
        .collect()
}

/// The text of an OpenAI stream's content deltas, its finish reason and its usage chunk.
fn read_stream(body: &str) -> (String, Option<String>, Option<Value>) {
    let events = data_events(body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
    let mut text = String::new();
    let mut finish = None;
    let mut usage = None;
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}"));
        assert_eq!(v["object"], "chat.completion.chunk", "{e}");
        assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"), "{e}");
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(c);
        }
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
        if v["usage"].is_object() {
            assert_eq!(
                v["choices"],
                json!([]),
                "the usage chunk has no choices: {e}"
            );
            usage = Some(v["usage"].clone());
        }
    }
    (text, finish, usage)
}

/// 3 prompt words + 2 system words = 5 input tokens (the simulator's rule); 4 output tokens.
fn chat_body(extra: Value) -> Value {
    let mut body = json!({"model": "sim-claude", "max_tokens": 4, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there friend"},
    ]});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

#[tokio::test]
async fn openai_chat_to_an_anthropic_model_answers_a_chat_completion() {
    let r = post(CHAT, "plain-token", "tr-plain", chat_body(json!({}))).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.header("content-type").unwrap().contains("json"));
    let v = r.json();
    assert_eq!(v["object"], "chat.completion", "{}", r.body);
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], "tok0 tok1 tok2 tok3");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );
    // The backend got Messages: its path, its version, a body the strict simulator accepted.
    let up = upstream("tr-plain");
    assert_eq!(up.path, "/v1/messages");
    assert_eq!(up.header("anthropic-version"), Some("2023-06-01"));
    assert_eq!(
        serde_json::from_str::<Value>(&up.body).unwrap(),
        json!({"model": "sim-claude", "max_tokens": 4,
               "system": [{"type": "text", "text": "be brief"}],
               "messages": [{"role": "user", "content": "hello there friend"}]})
    );
}

#[tokio::test]
async fn a_streamed_openai_chat_gets_chunks_usage_and_done() {
    let r = post(
        CHAT,
        "stream-token",
        "tr-stream",
        chat_body(json!({"stream": true, "stream_options": {"include_usage": true}})),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.header("content-type")
            .unwrap()
            .starts_with("text/event-stream")
    );
    assert_eq!(r.header("content-length"), None);
    let (text, finish, usage) = read_stream(&r.body);
    assert_eq!(text, "tok0 tok1 tok2 tok3");
    assert_eq!(finish.as_deref(), Some("stop"));
    assert_eq!(
        usage,
        Some(
            json!({"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
                    "prompt_tokens_details": {"cached_tokens": 0}})
        )
    );
    let up: Value = serde_json::from_str(&upstream("tr-stream").body).unwrap();
    assert_eq!(up["stream"], true);
    assert!(up.get("stream_options").is_none(), "Anthropic refuses it");

    // Without include_usage: no usage chunk.
    let r = post(
        CHAT,
        "stream-token",
        "tr-stream-no-usage",
        chat_body(json!({"stream": true})),
    )
    .await;
    let (text, _, usage) = read_stream(&r.body);
    assert_eq!(text, "tok0 tok1 tok2 tok3");
    assert_eq!(usage, None);
}

#[tokio::test]
async fn the_one_base_url_translates_too_and_an_uncapped_request_gets_the_cap_reserved() {
    // The tier forwards other uncapped requests as sent (`reserve`); Anthropic requires
    // max_tokens: the translated request gets the one reserved (defaultMaxTokens 6).
    let mut body = chat_body(json!({"stream": true}));
    body.as_object_mut().unwrap().remove("max_tokens");
    let r = post("/v1/chat/completions", "one-url-token", "tr-one-url", body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let (text, finish, _) = read_stream(&r.body);
    assert_eq!(text, "tok0 tok1 tok2 tok3 tok4 tok5");
    assert_eq!(finish.as_deref(), Some("stop"));
    let up = upstream("tr-one-url");
    assert_eq!(up.path, "/v1/messages");
    assert_eq!(
        serde_json::from_str::<Value>(&up.body).unwrap()["max_tokens"],
        6
    );
}

#[tokio::test]
async fn what_cannot_be_translated_is_refused_and_never_reaches_the_backend() {
    for (id, extra) in [
        ("tr-refused-n", json!({"n": 2})),
        ("tr-refused-logprobs", json!({"logprobs": true})),
        (
            "tr-refused-audio",
            json!({"messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}]}]}),
        ),
    ] {
        let r = post(CHAT, "refused-token", id, chat_body(extra)).await;
        let e = r.error(400);
        assert_eq!(e["code"], "untranslatable_request", "{}", r.body);
        assert!(stack().sim_requests_with_test_id(id).is_empty(), "{id}");
    }
}

#[tokio::test]
async fn an_anthropic_error_reaches_the_client_as_an_openai_error() {
    for (id, stream) in [("tr-error-json", false), ("tr-error-stream", true)] {
        let r = chat(
            stack(),
            CHAT,
            id,
            &[
                ("authorization", &bearer("refused-token")),
                ("x-sim-fault", "status-500"),
            ],
            chat_body(json!({"stream": stream})),
        )
        .await;
        assert_eq!(r.status, 500, "{}", r.body);
        assert_eq!(
            r.json(),
            json!({"error": {"message": "simulated failure", "type": "api_error",
                             "param": null, "code": null}}),
            "{id}"
        );
        assert_eq!(upstream(id).path, "/v1/messages");
    }
}

/// `GET /maas-api/v1/usage?groupBy=model` for `token`: (requests, prompt, completion) of
/// sim-claude.
async fn ledger(token: &str) -> (u64, u64, u64) {
    let r = send(
        client()
            .get(format!(
                "{}/maas-api/v1/usage?groupBy=model",
                stack().gateway_url()
            ))
            .header("authorization", bearer(token)),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["data"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|row| row["model"] == "sim-claude")
        .map_or((0, 0, 0), |row| {
            (
                row["requests"].as_u64().unwrap_or(0),
                row["promptTokens"].as_u64().unwrap_or(0),
                row["completionTokens"].as_u64().unwrap_or(0),
            )
        })
}

/// A direct Messages call of 1 input and 1 output token: the window's remaining tokens after
/// its own reservation.
async fn remaining(token: &str, id: &str) -> u64 {
    let r = post(
        MESSAGES,
        token,
        id,
        json!({"model": "sim-claude", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.header("x-ratelimit-remaining-tokens")
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test]
async fn budgets_and_ledger_are_those_of_a_direct_anthropic_call() {
    // The same work, translated and direct: not streamed, then streamed.
    let translated = [chat_body(json!({})), chat_body(json!({"stream": true}))];
    let direct = [
        json!({"model": "sim-claude", "max_tokens": 4, "system": "be brief",
               "messages": [{"role": "user", "content": "hello there friend"}]}),
        json!({"model": "sim-claude", "max_tokens": 4, "system": "be brief", "stream": true,
               "messages": [{"role": "user", "content": "hello there friend"}]}),
    ];
    for (i, (t, d)) in translated.into_iter().zip(direct).enumerate() {
        let r = post(CHAT, "translated-token", &format!("tr-same-t{i}"), t).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let r = post(MESSAGES, "direct-token", &format!("tr-same-d{i}"), d).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let t = remaining("translated-token", "tr-same-t-probe").await;
    let d = remaining("direct-token", "tr-same-d-probe").await;
    assert_eq!(t, d, "the token window charged the same");
    // Two calls of 9 tokens, then the probe's own reservation (its prompt estimate + 1).
    let probe_reservation = (100_000 - t)
        .checked_sub(2 * 9)
        .expect("both calls charged");
    assert!((2..20).contains(&probe_reservation), "{probe_reservation}");
    // The ledger: 3 requests each (two calls and the probe), the provider's usage.
    let want = (3, 5 + 5 + 1, 4 + 4 + 1);
    let start = Instant::now();
    loop {
        let (lt, ld) = (
            ledger("translated-token").await,
            ledger("direct-token").await,
        );
        if lt == want && ld == want {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "ledger: translated {lt:?}, direct {ld:?}, want {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A provider that compresses its answer although the gateway asked for `identity` (the
/// simulator's `x-sim-compress: always-gzip`): the gateway decodes it (bounded) and translates
/// it; the client gets plain OpenAI chat without `content-encoding`, streamed and not, and the
/// budget is charged what the same uncompressed calls are charged.
#[tokio::test]
async fn a_provider_compressing_anyway_is_decoded_then_translated() {
    let bodies = [
        chat_body(json!({})),
        chat_body(json!({"stream": true, "stream_options": {"include_usage": true}})),
    ];
    for (i, body) in bodies.into_iter().enumerate() {
        let id = format!("tr-gz-{i}");
        let r = chat(
            stack(),
            CHAT,
            &id,
            &[
                ("authorization", &bearer("gz-token")),
                ("x-sim-compress", "always-gzip"),
            ],
            body.clone(),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("content-encoding"), None, "{id}");
        let usage = if i == 0 {
            let v = r.json();
            assert_eq!(v["object"], "chat.completion", "{}", r.body);
            assert_eq!(v["choices"][0]["message"]["content"], "tok0 tok1 tok2 tok3");
            Some(v["usage"].clone())
        } else {
            let (text, finish, usage) = read_stream(&r.body);
            assert_eq!(text, "tok0 tok1 tok2 tok3");
            assert_eq!(finish.as_deref(), Some("stop"));
            usage
        };
        assert_eq!(
            usage.map(|u| u["total_tokens"].clone()),
            Some(json!(9)),
            "{id}"
        );
        let r = post(CHAT, "gz-twin-token", &format!("tr-gz-twin-{i}"), body).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let gz = remaining("gz-token", "tr-gz-probe").await;
    let twin = remaining("gz-twin-token", "tr-gz-twin-probe").await;
    assert_eq!(gz, twin, "the token window charged the same");
    assert!(100_000 - gz >= 2 * 9, "both calls charged: {gz}");
}

/// The official OpenAI SDK (tests/sdk/clients.py, `MAAS_SDK_PYTHON`) with
/// `base_url = {gateway}/v1` calls the Anthropic model, not streamed and streamed.
#[tokio::test]
async fn the_official_openai_sdk_calls_an_anthropic_model() {
    let stack = stack();
    let python = std::env::var("MAAS_SDK_PYTHON").expect(
        "MAAS_SDK_PYTHON: a Python with tests/sdk/requirements.txt (scripts/lib/common.sh \
         ensure_sdk_clients sets it)",
    );
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/sdk/clients.py");
    let out = tokio::process::Command::new(python)
        .arg(script)
        .args([
            stack.gateway_url().as_str(),
            "sdk-token",
            "tr-sdk",
            "sim-claude",
        ])
        .output()
        .await
        .expect("the SDK script runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let m = &v["sim-claude"];
    assert_eq!(m["model"], "sim-claude", "{v}");
    assert_eq!(m["text"], "tok0 tok1 tok2", "{v}");
    assert_eq!(m["completion_tokens"], 3, "{v}");
    assert_eq!(m["stream_text"], "tok0 tok1 tok2", "{v}");
    let paths: Vec<String> = stack
        .sim_requests_with_test_id("tr-sdk")
        .into_iter()
        .map(|r| r.path)
        .collect();
    assert_eq!(paths, ["/v1/messages", "/v1/messages"], "{v}");
}
