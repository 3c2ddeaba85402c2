//! The model simulator over real HTTP: token rule, streaming, faults, the request record.

use maas_e2e::sim::{self, SimConfig, SimHandle};
use serde_json::{Value, json};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn sim() -> &'static SimHandle {
    static SIM: OnceLock<SimHandle> = OnceLock::new();
    SIM.get_or_init(|| {
        sim::spawn(
            "127.0.0.1:0".parse().unwrap(),
            SimConfig {
                chunk_delay: Duration::ZERO,
                models: vec!["sim-model".into(), "other".into()],
            },
        )
        .expect("simulator starts")
    })
}

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

/// Parses an SSE body into its `data:` payloads.
fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

#[tokio::test]
async fn chat_completion_follows_the_token_rule() {
    let resp = client()
        .post(format!("{}/llm/sim-model/v1/chat/completions", sim().url()))
        .header("x-test-id", "chat-rule")
        .json(&json!({"model": "sim-model", "max_tokens": 5,
                      "messages": [{"role": "user", "content": "one two three"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "sim-model");
    assert_eq!(
        v["choices"][0]["message"]["content"],
        "tok0 tok1 tok2 tok3 tok4"
    );
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8})
    );
}

#[tokio::test]
async fn completions_and_header_override() {
    let resp = client()
        .post(format!("{}/v1/completions", sim().url()))
        .header("x-sim-completion-tokens", "2")
        .json(&json!({"model": "sim-model", "prompt": "a b c d", "max_tokens": 50}))
        .send()
        .await
        .unwrap();
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "tok0 tok1");
    assert_eq!(v["usage"]["prompt_tokens"], 4);
    assert_eq!(v["usage"]["completion_tokens"], 2);
}

#[tokio::test]
async fn models_lists_configured_ids() {
    let v: Value = client()
        .get(format!("{}/any/prefix/v1/models", sim().url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["sim-model", "other"]);
}

#[tokio::test]
async fn stream_with_usage_chunk_and_done() {
    let body = client()
        .post(format!("{}/v1/chat/completions", sim().url()))
        .json(
            &json!({"model": "sim-model", "max_tokens": 3, "stream": true,
                      "stream_options": {"include_usage": true},
                      "messages": [{"role": "user", "content": "hi there"}]}),
        )
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let data = sse_data(&body);
    assert_eq!(data.len(), 3 + 1 + 1 + 1, "{body}");
    let text: String = data[..3]
        .iter()
        .map(|d| {
            serde_json::from_str::<Value>(d).unwrap()["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(text, "tok0 tok1 tok2");
    let finish: Value = serde_json::from_str(&data[3]).unwrap();
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    let usage: Value = serde_json::from_str(&data[4]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["total_tokens"], 5);
    assert_eq!(data[5], "[DONE]");
}

#[tokio::test]
async fn stream_without_include_usage_has_no_usage() {
    let body = client()
        .post(format!("{}/v1/chat/completions", sim().url()))
        .json(&json!({"model": "sim-model", "max_tokens": 2, "stream": true, "messages": []}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!body.contains("\"usage\""), "{body}");
    assert!(body.ends_with("data: [DONE]\n\n"));
}

#[tokio::test]
async fn chunk_delay_spaces_the_chunks() {
    let started = Instant::now();
    let body = client()
        .post(format!("{}/v1/chat/completions", sim().url()))
        .header("x-sim-chunk-delay-ms", "50")
        .json(&json!({"model": "sim-model", "max_tokens": 4, "stream": true, "messages": []}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    // 4 tokens + finish + [DONE] = 6 events, 5 delays of 50 ms.
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(sse_data(&body).len(), 6);
}

#[tokio::test]
async fn faults() {
    let url = format!("{}/v1/chat/completions", sim().url());
    let req = |fault: &str, stream: bool| {
        client()
            .post(&url)
            .header("x-sim-fault", fault)
            .json(
                &json!({"model": "sim-model", "max_tokens": 4, "stream": stream,
                          "stream_options": {"include_usage": true}, "messages": []}),
            )
            .send()
    };
    let r = req("status-500", false).await.unwrap();
    assert_eq!(r.status(), 500);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["type"],
        "server_error"
    );
    let r = req("not-json", false).await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(serde_json::from_str::<Value>(&r.text().await.unwrap()).is_err());
    let v: Value = req("no-usage", false).await.unwrap().json().await.unwrap();
    assert!(v.get("usage").is_none());
    let body = req("no-usage", true).await.unwrap().text().await.unwrap();
    assert!(!body.contains("usage") && body.contains("[DONE]"));
    let body = req("no-done", true).await.unwrap().text().await.unwrap();
    assert!(body.contains("\"usage\"") && !body.contains("[DONE]"));
    // The connection is cut: the body read fails.
    let r = req("drop-mid-stream", true).await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.is_err());
}

#[tokio::test]
async fn records_exact_headers_and_clears() {
    let id = "record-headers";
    client()
        .post(format!(
            "{}/llm/sim-model/v1/chat/completions?x=1",
            sim().url()
        ))
        .header("x-test-id", id)
        .header("Authorization", "Bearer should-be-visible")
        .header("x-multi", "a")
        .json(&json!({"model": "sim-model", "messages": []}))
        .send()
        .await
        .unwrap();
    let all: Vec<Value> = client()
        .get(format!("{}/_sim/requests", sim().url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mine: Vec<&Value> = all
        .iter()
        .filter(|r| {
            r["headers"]
                .as_array()
                .unwrap()
                .iter()
                .any(|h| h[0] == "x-test-id" && h[1] == id)
        })
        .collect();
    assert_eq!(mine.len(), 1);
    assert_eq!(mine[0]["method"], "POST");
    assert_eq!(mine[0]["path"], "/llm/sim-model/v1/chat/completions?x=1");
    assert!(
        mine[0]["headers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|h| h[0] == "authorization" && h[1] == "Bearer should-be-visible")
    );
    assert!(mine[0]["body"].as_str().unwrap().contains("sim-model"));
    // In-process view agrees.
    let rec = sim()
        .requests()
        .into_iter()
        .find(|r| r.header("x-test-id") == Some(id))
        .unwrap();
    assert_eq!(rec.header("X-Multi"), Some("a"));
}

#[test]
fn delete_clears_the_record() {
    // Its own simulator, so clearing does not disturb the other tests.
    let own = sim::spawn("127.0.0.1:0".parse().unwrap(), SimConfig::default()).unwrap();
    let client = reqwest::blocking::Client::new();
    client
        .get(format!("{}/v1/models", own.url()))
        .send()
        .unwrap();
    assert_eq!(own.requests().len(), 1);
    let r = client
        .delete(format!("{}/_sim/requests", own.url()))
        .send()
        .unwrap();
    assert_eq!(r.status(), 204);
    assert!(own.requests().is_empty());
}

#[tokio::test]
async fn bad_requests() {
    let r = client()
        .post(format!("{}/v1/chat/completions", sim().url()))
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = client()
        .get(format!("{}/v1/embeddings", sim().url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
}
