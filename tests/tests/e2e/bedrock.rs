//! AWS Bedrock behind the OpenAI chat shape (issue 29), through real Envoy with the release
//! .wasm and the real companion, against a strict simulator that recomputes every SigV4
//! signature from the secret key (`maas_e2e::bedrock_sim`):
//! - the official OpenAI Python SDK calls the Bedrock model, not streamed (Converse) and
//!   streamed (ConverseStream event-stream frames, translated to OpenAI SSE); the ledger
//!   meters exactly the simulator's usage;
//! - the SDK calls a tool (not streamed, its result sent back, and streamed: the call's
//!   arguments joined from their deltas) and sends an image as a data: URL; Bedrock gets
//!   `toolConfig`, `toolUse`, `toolResult` and `image` blocks as it validates them, and the
//!   ledger meters its usage; an image by URL or a tool choice Converse cannot express is
//!   refused 400 `untranslatable_request` naming it, never sent;
//! - a model whose AWS credential is missing is refused 503 `signing_unavailable`, never sent;
//! - Bedrock never sees the client's credential nor the secret key, and the filter's credentials
//!   document holds only the derived signing key.

use maas_e2e::bedrock_sim::{self, BedrockSimConfig, BedrockSimHandle, USAGE_INPUT, USAGE_OUTPUT};
use maas_e2e::module_stack::{ModuleStack, Stoppable};
use maas_e2e::{Stack, StackOptions};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const IDENTITIES: &str = r#"
identities:
  - {token: alice-token, username: alice, groups: [system:authenticated]}
  - {token: sdk-token, username: sdk, groups: [system:authenticated]}
  - {token: stream-token, username: streamer, groups: [system:authenticated]}
  - {token: tools-token, username: toolsmith, groups: [system:authenticated]}
  - {token: gz-token, username: gz, groups: [system:authenticated]}
"#;

const ACCESS_KEY_ID: &str = "AKIAIOSFODNN7EXAMPLE";
const SECRET: &str = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY";
const SESSION_TOKEN: &str = "FQoGZXIvYXdzEXAMPLE-session-token";
const MODEL_ID: &str = "anthropic.claude-3-haiku-20240307-v1:0";

struct Env {
    sim: BedrockSimHandle,
    stack: Stack,
}

impl Stoppable for Env {
    fn stop(&self) {
        self.stack.shutdown();
    }
}

static ENV: ModuleStack<Env> = ModuleStack::new();

fn policy(sim: &BedrockSimHandle) -> String {
    let model = |name: &str, credential: &str| {
        json!({"name": name, "path": format!("/ext/{name}"), "tiers": ["free"],
               "servedName": MODEL_ID, "backend": sim.url(),
               "upstreamCluster": format!("ext-{name}"),
               "provider": {"type": "bedrock", "credentialRef": credential,
                            "auth": "awsSigV4", "region": "us-east-1"}})
    };
    json!({
        "tiers": [{"name": "free", "level": 0, "groups": ["system:authenticated"],
                   "limits": {"requests": [{"limit": 100000, "window": "1m"}],
                              "tokens": [{"limit": 1000000, "window": "1d"}]}}],
        "models": [model("haiku", "aws"), model("haiku-nokey", "aws-missing")]
    })
    .to_string()
}

/// The simulator on a runtime of its own (it outlives any one test's runtime), then the stack.
fn start() -> Result<Env, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("simulator runtime");
        runtime.block_on(async move {
            let sim = bedrock_sim::spawn(BedrockSimConfig {
                access_key_id: ACCESS_KEY_ID.into(),
                secret_access_key: SECRET.into(),
                session_token: Some(SESSION_TOKEN.into()),
                region: "us-east-1".into(),
                model_id: MODEL_ID.into(),
            })
            .await;
            let _ = tx.send(sim.map_err(|e| format!("{e:#}")));
            std::future::pending::<()>().await
        });
    });
    let sim = rx.recv().map_err(|e| e.to_string())??;
    let credentials = json!({"credentials": {"aws": {
        "aws-access-key-id": ACCESS_KEY_ID,
        "aws-secret-access-key": SECRET,
        "aws-session-token": SESSION_TOKEN,
    }}})
    .to_string();
    let mut options = StackOptions::default()
        .with_policy_yaml(&policy(&sim))
        .with_identities_yaml(IDENTITIES)
        .with_credentials_yaml(&credentials);
    options.poll_interval_ms = 500;
    options.plugin_config_extra = Some(json!({"usage": {"reportIntervalMs": 500}}));
    let stack = Stack::start(options).map_err(|e| format!("{e:#}"))?;
    Ok(Env { sim, stack })
}

async fn env() -> &'static Env {
    tokio::task::spawn_blocking(|| ENV.get_or_start(start))
        .await
        .expect("stack start task")
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

async fn post(stack: &Stack, token: &str, path: &str, body: Value) -> (u16, String) {
    let r = client()
        .post(format!("{}{path}", stack.gateway_url()))
        .header("authorization", format!("Bearer {token}"))
        .header("x-amz-security-token", "client-chosen-token")
        .json(&body)
        .send()
        .await
        .expect("gateway answers");
    let status = r.status().as_u16();
    (status, r.text().await.unwrap_or_default())
}

fn chat(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": "hi"}], "max_tokens": 8})
}

/// Ten answers in a row, each on a new connection (so on any Envoy worker): every worker has
/// polled the signing key.
async fn until_served(stack: &Stack) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut in_a_row = 0;
    while in_a_row < 10 {
        let (status, body) = post(
            stack,
            "alice-token",
            "/ext/haiku/v1/chat/completions",
            chat("haiku"),
        )
        .await;
        in_a_row = if status == 200 { in_a_row + 1 } else { 0 };
        if status != 200 {
            assert!(Instant::now() < deadline, "never served: {status} {body}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// `GET /maas-api/v1/usage?groupBy=model` for `token`: (requests, prompt, completion) of haiku.
async fn ledger(stack: &Stack, token: &str) -> (u64, u64, u64) {
    let r = client()
        .get(format!(
            "{}/maas-api/v1/usage?groupBy=model",
            stack.gateway_url()
        ))
        .header("authorization", format!("Bearer {token}"))
        .send()
        .await
        .expect("usage answers");
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.expect("JSON");
    v["data"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|row| row["model"] == "haiku")
        .map_or((0, 0, 0), |row| {
            (
                row["requests"].as_u64().unwrap_or(0),
                row["promptTokens"].as_u64().unwrap_or(0),
                row["completionTokens"].as_u64().unwrap_or(0),
            )
        })
}

async fn ledger_reaches(stack: &Stack, token: &str, want: (u64, u64, u64)) {
    let start = Instant::now();
    loop {
        let got = ledger(stack, token).await;
        if got == want {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "ledger of {token}: {got:?}, want {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_calls_bedrock_signed_and_metered_to_its_usage() {
    let Env { sim, stack } = env().await;
    until_served(stack).await;
    let base = sim.requests().len();
    let v = sdk(
        "clients.py",
        &[
            stack.gateway_url().as_str(),
            "sdk-token",
            "bedrock-sdk",
            "haiku",
        ],
    )
    .await;
    let m = &v["haiku"];
    let text = bedrock_sim::DELTAS.concat();
    assert_eq!(m["model"], "haiku", "{v}");
    assert_eq!(m["text"], text.as_str(), "{v}");
    assert_eq!(m["completion_tokens"], USAGE_OUTPUT, "{v}");
    assert_eq!(m["stream_text"], text.as_str(), "{v}");
    // The SDK's own requests (it sends `x-test-id`; other tests run beside it).
    let seen: Vec<_> = sim.requests()[base..]
        .iter()
        .filter(|r| r.header("x-test-id") == Some("bedrock-sdk"))
        .cloned()
        .collect();
    let paths: Vec<&str> = seen.iter().map(|r| r.path.as_str()).collect();
    let encoded = "/model/anthropic.claude-3-haiku-20240307-v1%3A0";
    assert_eq!(
        paths,
        [
            format!("{encoded}/converse"),
            format!("{encoded}/converse-stream")
        ],
        "{v}"
    );
    assert!(seen.iter().all(|r| r.status == 200), "{seen:?}");
    // Metered to what Bedrock said it used, streamed or not.
    ledger_reaches(stack, "sdk-token", (2, 2 * USAGE_INPUT, 2 * USAGE_OUTPUT)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_gets_chunks_the_providers_usage_and_done() {
    let Env { stack, .. } = env().await;
    until_served(stack).await;
    let mut body = chat("haiku");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (status, text) = post(
        stack,
        "stream-token",
        "/ext/haiku/v1/chat/completions",
        body,
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let (chunks, content) = stream_chunks(&text);
    assert_eq!(content, bedrock_sim::DELTAS.concat());
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["prompt_tokens"], USAGE_INPUT, "{text}");
    assert_eq!(usage["completion_tokens"], USAGE_OUTPUT, "{text}");
    assert!(
        chunks
            .iter()
            .any(|c| c["choices"][0]["finish_reason"] == "stop")
    );
    ledger_reaches(stack, "stream-token", (1, USAGE_INPUT, USAGE_OUTPUT)).await;
}

/// Bedrock gzipping its answer although the gateway asked for `identity`: decoded, then
/// translated (the client gets plain OpenAI chat, no `content-encoding`), streamed and not, and
/// metered to Bedrock's usage as an uncompressed answer is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gzipped_answer_is_decoded_then_translated_and_metered() {
    let Env { stack, sim } = env().await;
    until_served(stack).await;
    for stream in [false, true] {
        let mut body = chat("haiku");
        if stream {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        let r = client()
            .post(format!(
                "{}/ext/haiku/v1/chat/completions",
                stack.gateway_url()
            ))
            .header("authorization", "Bearer gz-token")
            .header("x-sim-compress", "always-gzip")
            .json(&body)
            .send()
            .await
            .expect("gateway answers");
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers().get("content-encoding"), None, "stream {stream}");
        let text = r.text().await.unwrap_or_default();
        let (content, usage) = if stream {
            let (chunks, content) = stream_chunks(&text);
            (content, chunks.last().map(|c| c["usage"].clone()))
        } else {
            let v: Value = serde_json::from_str(&text).expect("a JSON answer");
            assert_eq!(v["object"], "chat.completion", "{text}");
            let content = v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            (content, Some(v["usage"].clone()))
        };
        assert_eq!(content, bedrock_sim::DELTAS.concat(), "{text}");
        let usage = usage.expect("usage");
        assert_eq!(usage["prompt_tokens"], USAGE_INPUT, "{text}");
        assert_eq!(usage["completion_tokens"], USAGE_OUTPUT, "{text}");
    }
    let gzipped = sim
        .requests()
        .iter()
        .filter(|r| r.header("x-sim-compress") == Some("always-gzip") && r.status == 200)
        .count();
    assert_eq!(gzipped, 2, "Bedrock was asked to gzip both answers");
    ledger_reaches(stack, "gz-token", (2, 2 * USAGE_INPUT, 2 * USAGE_OUTPUT)).await;
}

/// An OpenAI stream's chunks (every event a `data:` one, ending in `[DONE]`) and the text of
/// their content deltas.
fn stream_chunks(text: &str) -> (Vec<Value>, String) {
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").expect("data events"))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{text}");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("JSON chunk"))
        .collect();
    let content = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    (chunks, content)
}

/// Runs `tests/sdk/<script>` with the official OpenAI SDK: its printed JSON.
async fn sdk(script: &str, args: &[&str]) -> Value {
    let python = std::env::var("MAAS_SDK_PYTHON").expect(
        "MAAS_SDK_PYTHON: a Python with tests/sdk/requirements.txt (scripts/lib/common.sh \
         ensure_sdk_clients sets it)",
    );
    let script = format!("{}/sdk/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = tokio::process::Command::new(python)
        .arg(script)
        .args(args)
        .output()
        .await
        .expect("the SDK script runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_calls_a_tool_streamed_and_not_and_sends_an_image() {
    use maas_e2e::bedrock_sim::{DELTAS, TOOL_PREAMBLE, TOOL_USE_ID};
    let Env { sim, stack } = env().await;
    until_served(stack).await;
    let base = sim.requests().len();
    let v = sdk(
        "bedrock_tools.py",
        &[
            stack.gateway_url().as_str(),
            "tools-token",
            "bedrock-tools",
            "haiku",
        ],
    )
    .await;
    let input = bedrock_sim::tool_input();
    // Not streamed: Bedrock's toolUse as the SDK's tool call.
    let call = &v["call"];
    assert_eq!(call["finish_reason"], "tool_calls", "{v}");
    assert_eq!(call["content"], TOOL_PREAMBLE, "{v}");
    assert_eq!(call["calls"], 1, "{v}");
    assert_eq!(call["id"], TOOL_USE_ID, "{v}");
    assert_eq!(call["type"], "function", "{v}");
    assert_eq!(call["name"], "get_weather", "{v}");
    assert_eq!(call["arguments"], input, "{v}");
    assert_eq!(call["completion_tokens"], USAGE_OUTPUT, "{v}");
    // The call sent back with its result: Bedrock answers.
    assert_eq!(
        v["answer"],
        json!({"finish_reason": "stop", "text": DELTAS.concat(), "tool_calls": false}),
        "{v}"
    );
    // Streamed: the call's id and name, then its arguments in Bedrock's three fragments.
    assert_eq!(
        v["stream"],
        json!({"text": TOOL_PREAMBLE, "finish_reason": "tool_calls", "calls": [
            {"index": 0, "id": TOOL_USE_ID, "name": "get_weather", "arguments": input,
             "deltas": 3}]}),
        "{v}"
    );
    assert_eq!(
        v["image"],
        json!({"text": DELTAS.concat(), "finish_reason": "stop"}),
        "{v}"
    );
    // What reached Bedrock (and passed its validation).
    let seen: Vec<_> = sim.requests()[base..]
        .iter()
        .filter(|r| r.header("x-test-id") == Some("bedrock-tools"))
        .cloned()
        .collect();
    assert_eq!(seen.len(), 4, "{seen:?}");
    assert!(seen.iter().all(|r| r.status == 200), "{seen:?}");
    assert!(seen[2].path.ends_with("/converse-stream"), "{seen:?}");
    let bodies: Vec<Value> = seen
        .iter()
        .map(|r| serde_json::from_slice(&r.body).expect("JSON"))
        .collect();
    assert_eq!(
        bodies[0]["toolConfig"],
        json!({"tools": [{"toolSpec": {"name": "get_weather",
            "description": "The weather of a city.",
            "inputSchema": {"json": {"type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"]}}}}],
            "toolChoice": {"auto": {}}}),
        "{}",
        bodies[0]
    );
    assert_eq!(
        bodies[1]["messages"],
        json!([
            {"role": "user", "content": [{"text": "What is the weather in Paris?"}]},
            {"role": "assistant", "content": [{"text": TOOL_PREAMBLE},
                {"toolUse": {"toolUseId": TOOL_USE_ID, "name": "get_weather", "input": input}}]},
            {"role": "user", "content": [{"toolResult": {"toolUseId": TOOL_USE_ID,
                "content": [{"text": "Sunny, 21 C"}]}}]}
        ]),
        "{}",
        bodies[1]
    );
    assert!(bodies[1]["toolConfig"].is_object());
    assert_eq!(
        bodies[2]["toolConfig"]["toolChoice"],
        json!({"tool": {"name": "get_weather"}})
    );
    let image = &bodies[3]["messages"][0]["content"][1]["image"];
    assert_eq!(image["format"], "png", "{}", bodies[3]);
    let png = bedrock_sim::base64_decode(image["source"]["bytes"].as_str().unwrap_or_default());
    assert!(png.is_some_and(|b| b.starts_with(b"\x89PNG")), "{image}");
    // Metered to what Bedrock said it used, each of the four.
    ledger_reaches(stack, "tools-token", (4, 4 * USAGE_INPUT, 4 * USAGE_OUTPUT)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_converse_cannot_take_is_refused_naming_it_never_sent() {
    let Env { sim, stack } = env().await;
    until_served(stack).await;
    let user = json!([{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]);
    let tools = json!([{"type": "function", "function": {"name": "get_weather"}}]);
    let hi = json!([{"role": "user", "content": "never-sent-tool-choice"}]);
    for (body, named) in [
        (
            json!({"model": "haiku", "messages": user}),
            "messages[0].content[1].image_url.url",
        ),
        (
            json!({"model": "haiku", "messages": hi, "tools": tools, "tool_choice": "none"}),
            "tool_choice \"none\"",
        ),
        (
            json!({"model": "haiku", "messages": hi, "tools": tools, "parallel_tool_calls": false}),
            "parallel_tool_calls",
        ),
    ] {
        let (status, text) =
            post(stack, "alice-token", "/ext/haiku/v1/chat/completions", body).await;
        assert_eq!(status, 400, "{text}");
        let v: Value = serde_json::from_str(&text).expect("JSON");
        assert_eq!(v["error"]["code"], "untranslatable_request", "{text}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(named), "{named}: {text}");
    }
    for r in sim.requests() {
        let body = String::from_utf8_lossy(&r.body);
        assert!(
            !body.contains("cat.png") && !body.contains("never-sent-tool-choice"),
            "{body}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_signing_key_the_request_is_refused_never_sent_unsigned() {
    let Env { sim, stack } = env().await;
    until_served(stack).await;
    let before = sim.requests().len();
    let (status, body) = post(
        stack,
        "alice-token",
        "/ext/haiku-nokey/v1/chat/completions",
        chat("haiku-nokey"),
    )
    .await;
    assert_eq!(status, 503, "{body}");
    let body: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(body["error"]["code"], "signing_unavailable", "{body}");
    assert_eq!(sim.requests().len(), before, "nothing reached Bedrock");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bedrock_never_sees_the_clients_credential_nor_the_secret_key() {
    let Env { sim, stack } = env().await;
    until_served(stack).await;
    let seen = sim.requests();
    assert!(!seen.is_empty());
    for r in &seen {
        assert_eq!(r.status, 200, "{r:?}");
        let auth = r.header("authorization").unwrap_or_default();
        assert!(
            auth.starts_with(&format!("AWS4-HMAC-SHA256 Credential={ACCESS_KEY_ID}/")),
            "{r:?}"
        );
        assert_eq!(
            r.header("x-amz-security-token"),
            Some(SESSION_TOKEN),
            "{r:?}"
        );
        let all = format!("{:?} {}", r.headers, String::from_utf8_lossy(&r.body));
        for never in [
            "alice-token",
            "sdk-token",
            "stream-token",
            "tools-token",
            SECRET,
            "client-chosen-token",
        ] {
            assert!(!all.contains(never), "Bedrock saw {never}: {all}");
        }
    }
    // The filter's document: the derived key of the day, never the secret key.
    let doc = stack
        .internal_client()
        .get(format!(
            "{}/internal/v1/credentials",
            stack.companion_internal_url()
        ))
        .send()
        .await
        .expect("companion answers")
        .text()
        .await
        .expect("body");
    assert!(!doc.contains(SECRET), "{doc}");
    let parsed: Value = serde_json::from_str(&doc).expect("JSON");
    let key = &parsed["sigv4"]["aws"][0];
    assert_eq!(key["service"], "bedrock", "{doc}");
    assert_eq!(key["signing_key"].as_str().map(str::len), Some(64), "{doc}");

    // The simulator is as strict as AWS: the last request replayed with another body (its hash
    // header kept, or made to match) is refused.
    let last = seen.last().cloned().unwrap();
    let replay = |body: Vec<u8>, hash: Option<String>| {
        let mut req = client().post(format!("{}{}", sim.url(), last.path));
        for (n, v) in &last.headers {
            if n == "content-length" {
                continue;
            }
            let v = match (n.as_str(), &hash) {
                ("x-amz-content-sha256", Some(h)) => h.clone(),
                _ => v.clone(),
            };
            req = req.header(n.as_str(), v);
        }
        req.body(body)
    };
    let r = replay(last.body.clone(), None).send().await.unwrap();
    assert_eq!(r.status(), 200, "the very request verifies");
    let mut tampered = last.body.clone();
    tampered.extend_from_slice(b" ");
    let r = replay(tampered.clone(), None).send().await.unwrap();
    assert_eq!(r.status(), 403);
    let hash = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(&tampered))
    };
    let r = replay(tampered, Some(hash)).send().await.unwrap();
    assert_eq!(r.status(), 403);
    let refused: Vec<String> = sim
        .requests()
        .iter()
        .filter_map(|r| r.refused.clone())
        .collect();
    assert_eq!(refused.len(), 2, "{refused:?}");
    assert!(refused[1].contains("signature"), "{refused:?}");
}
