//! The model simulator over real HTTP: token rule, streaming, faults, the request record.

use futures_util::StreamExt;
use maas_e2e::sim::{self, SimConfig, SimHandle};
use serde_json::{Value, json};
use std::io::Write;
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
                served_only: false,
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
        .get(format!("{}/v1/audio/speech", sim().url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = client()
        .get(format!("{}/v1/embeddings", sim().url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
}

/// `(event name, data JSON)` of every event of a named-event SSE body (Anthropic, Responses).
fn named_events(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let mut name = String::new();
            let mut data = String::new();
            for line in e.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = n.to_string();
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data = d.to_string();
                }
            }
            let v: Value = serde_json::from_str(&data).unwrap_or_else(|e| panic!("{e}: {data}"));
            (name, v)
        })
        .collect()
}

async fn post(path: &str, headers: &[(&str, &str)], body: Value) -> reqwest::Response {
    let mut req = client().post(format!("{}{path}", sim().url())).json(&body);
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    req.send().await.unwrap()
}

#[tokio::test]
async fn chat_and_completions_refuse_unknown_fields_like_openai() {
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"model": "sim-model", "messages": [], "input": "x"}),
        ),
        (
            "/v1/completions",
            json!({"model": "sim-model", "prompt": "x", "max_output_tokens": 3}),
        ),
    ] {
        let r = post(path, &[], body.clone()).await;
        assert_eq!(r.status(), 400, "{path}");
        let v: Value = r.json().await.unwrap();
        let unknown = body
            .as_object()
            .unwrap()
            .keys()
            .find(|k| !["model", "messages", "prompt"].contains(&k.as_str()))
            .unwrap()
            .clone();
        assert_eq!(
            v["error"]["message"],
            format!("Unrecognized request argument supplied: {unknown}")
        );
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    // Every OpenAI field is accepted, stream_options included.
    let r = post(
        "/v1/chat/completions",
        &[],
        json!({"model": "sim-model", "messages": [], "stream": true, "stream_options": {"include_usage": true},
               "temperature": 0.5, "top_p": 1, "n": 1, "stop": null, "user": "u", "seed": 1,
               "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
               "max_completion_tokens": 2, "logprobs": false, "store": false, "metadata": {}}),
    )
    .await;
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn responses_api_non_streamed_shape_and_usage() {
    let r = post(
        "/llm/sim-model/v1/responses",
        &[],
        json!({"model": "sim-model", "input": [{"role": "user", "content": "one two three"}],
               "instructions": "be brief", "max_output_tokens": 4, "store": false}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "completed");
    assert_eq!(v["instructions"], "be brief");
    assert_eq!(v["max_output_tokens"], 4);
    assert_eq!(v["output"][0]["type"], "message");
    assert_eq!(v["output"][0]["content"][0]["type"], "output_text");
    assert_eq!(v["output"][0]["content"][0]["text"], "tok0 tok1 tok2 tok3");
    assert_eq!(v["usage"]["input_tokens"], 5);
    assert_eq!(v["usage"]["output_tokens"], 4);
    assert_eq!(v["usage"]["total_tokens"], 9);
    assert_eq!(v["usage"]["input_tokens_details"]["cached_tokens"], 0);
}

#[tokio::test]
async fn responses_api_stream_events_and_usage_in_completed() {
    let body = post(
        "/v1/responses",
        &[],
        json!({"model": "sim-model", "input": "hi there", "max_output_tokens": 3, "stream": true}),
    )
    .await
    .text()
    .await
    .unwrap();
    let events = named_events(&body);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ],
        "{body}"
    );
    for (i, (name, data)) in events.iter().enumerate() {
        assert_eq!(data["type"], name.as_str());
        assert_eq!(data["sequence_number"], i);
    }
    assert_eq!(events[0].1["response"]["usage"], Value::Null);
    let text: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, "tok0 tok1 tok2");
    let completed = &events.last().unwrap().1["response"];
    assert_eq!(completed["status"], "completed");
    assert_eq!(
        completed["usage"]["input_tokens"], 2,
        "{}",
        completed["usage"]
    );
    assert_eq!(completed["usage"]["output_tokens"], 3);
    assert_eq!(completed["usage"]["total_tokens"], 5);
    assert!(!body.contains("[DONE]"));
}

#[tokio::test]
async fn responses_api_refuses_include_usage_and_unknown_fields() {
    for (body, param) in [
        (
            json!({"model": "sim-model", "input": "x", "stream": true, "stream_options": {"include_usage": true}}),
            "stream_options.include_usage",
        ),
        (
            json!({"model": "sim-model", "input": "x", "max_tokens": 5}),
            "max_tokens",
        ),
        (json!({"model": "sim-model", "messages": []}), "messages"),
    ] {
        let r = post("/v1/responses", &[], body).await;
        assert_eq!(r.status(), 400);
        let v: Value = r.json().await.unwrap();
        assert_eq!(
            v["error"]["message"],
            format!("Unknown parameter: '{param}'.")
        );
        assert_eq!(v["error"]["param"], param);
        assert_eq!(v["error"]["code"], "unknown_parameter");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    // The Responses API's own stream option is accepted.
    let r = post(
        "/v1/responses",
        &[],
        json!({"model": "sim-model", "input": "x", "stream": true, "stream_options": {"include_obfuscation": false}}),
    )
    .await;
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn anthropic_messages_non_streamed_shape_and_usage() {
    let r = post(
        "/v1/messages",
        &[("anthropic-version", "2023-06-01")],
        json!({"model": "sim-model", "max_tokens": 3, "system": "be brief",
               "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert_eq!(
        v["content"],
        json!([{"type": "text", "text": "tok0 tok1 tok2"}])
    );
    assert_eq!(v["stop_reason"], "end_turn");
    assert_eq!(v["usage"]["input_tokens"], 4);
    assert_eq!(v["usage"]["output_tokens"], 3);
    assert_eq!(v["usage"]["cache_read_input_tokens"], 0);
    assert!(v["usage"].get("total_tokens").is_none());
}

#[tokio::test]
async fn anthropic_messages_stream_events() {
    let body = post(
        "/v1/messages",
        &[],
        json!({"model": "sim-model", "max_tokens": 2, "stream": true,
               "messages": [{"role": "user", "content": "a b c"}]}),
    )
    .await
    .text()
    .await
    .unwrap();
    let events = named_events(&body);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ],
        "{body}"
    );
    for (name, data) in &events {
        assert_eq!(data["type"], name.as_str());
    }
    let start = &events[0].1["message"]["usage"];
    assert_eq!(
        (
            start["input_tokens"].as_u64(),
            start["output_tokens"].as_u64()
        ),
        (Some(3), Some(1))
    );
    assert_eq!(
        events[3].1["delta"],
        json!({"type": "text_delta", "text": "tok0"})
    );
    assert_eq!(events[4].1["delta"]["text"], " tok1");
    assert_eq!(events[6].1["usage"], json!({"output_tokens": 2}));
    assert_eq!(events[6].1["delta"]["stop_reason"], "end_turn");
}

#[tokio::test]
async fn anthropic_messages_refuse_extra_inputs_like_anthropic() {
    let r = post(
        "/v1/messages",
        &[],
        json!({"model": "sim-model", "max_tokens": 2, "stream": true,
               "stream_options": {"include_usage": true}, "messages": []}),
    )
    .await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "error");
    assert_eq!(
        v["error"],
        json!({"type": "invalid_request_error", "message": "stream_options: Extra inputs are not permitted"})
    );
    let r = post(
        "/v1/messages",
        &[],
        json!({"model": "sim-model", "messages": []}),
    )
    .await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["message"], "max_tokens: Field required");
}

#[tokio::test]
async fn embeddings_usage_has_prompt_and_total_only() {
    let r = post(
        "/v1/embeddings",
        &[],
        json!({"model": "sim-model", "input": ["one two", "three"], "dimensions": 4}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"].as_array().unwrap().len(), 2);
    assert_eq!(v["data"][1]["index"], 1);
    assert_eq!(v["data"][0]["embedding"].as_array().unwrap().len(), 4);
    assert_eq!(v["usage"], json!({"prompt_tokens": 3, "total_tokens": 3}));
    let r = post(
        "/v1/embeddings",
        &[],
        json!({"model": "sim-model", "input": "x", "stream": true}),
    )
    .await;
    assert_eq!(r.status(), 400, "embeddings have no stream field");
}

fn gunzip(bytes: &[u8]) -> Vec<u8> {
    let mut d = flate2::write::GzDecoder::new(Vec::new());
    d.write_all(bytes).unwrap();
    d.finish().unwrap()
}

#[tokio::test]
async fn gzip_only_when_asked_and_accepted() {
    let body = json!({"model": "sim-model", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]});
    let plain = post("/v1/chat/completions", &[], body.clone()).await;
    assert!(plain.headers().get("content-encoding").is_none());
    let plain: Value = plain.json().await.unwrap();
    for (headers, gzipped) in [
        (
            vec![("x-sim-compress", "gzip"), ("accept-encoding", "gzip, br")],
            true,
        ),
        (vec![("x-sim-compress", "gzip")], false),
        (
            vec![
                ("x-sim-compress", "gzip"),
                ("accept-encoding", "gzip;q=0, identity"),
            ],
            false,
        ),
        (vec![("accept-encoding", "gzip")], false),
        (vec![("x-sim-compress", "always-gzip")], true),
        (
            vec![
                ("x-sim-compress", "always-gzip"),
                ("accept-encoding", "identity"),
            ],
            true,
        ),
    ] {
        let r = post("/v1/chat/completions", &headers, body.clone()).await;
        assert_eq!(r.status(), 200);
        let enc = r
            .headers()
            .get("content-encoding")
            .map(|v| v.to_str().unwrap().to_string());
        let bytes = r.bytes().await.unwrap();
        if gzipped {
            assert_eq!(enc.as_deref(), Some("gzip"), "{headers:?}");
            let v: Value = serde_json::from_slice(&gunzip(&bytes)).unwrap();
            assert_eq!(v["usage"], plain["usage"], "{headers:?}");
            assert_eq!(v["choices"], plain["choices"]);
        } else {
            assert_eq!(enc, None, "{headers:?}");
            let v: Value = serde_json::from_slice(&bytes).unwrap();
            assert_eq!(v["usage"], plain["usage"]);
        }
    }
    // Errors are compressed too (a misbehaving backend compresses everything).
    let r = post(
        "/v1/messages",
        &[("x-sim-compress", "always-gzip")],
        json!({"model": "sim-model", "messages": []}),
    )
    .await;
    assert_eq!(r.status(), 400);
    assert_eq!(r.headers()["content-encoding"], "gzip");
    let v: Value = serde_json::from_slice(&gunzip(&r.bytes().await.unwrap())).unwrap();
    assert_eq!(v["type"], "error");
}

#[tokio::test]
async fn gzip_stream_is_flushed_per_event() {
    // 300 ms between events: the first event must be readable long before the stream ends.
    let r = post(
        "/v1/messages",
        &[("x-sim-compress", "always-gzip"), ("x-sim-chunk-delay-ms", "300")],
        json!({"model": "sim-model", "max_tokens": 3, "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-encoding"], "gzip");
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let started = Instant::now();
    let mut stream = r.bytes_stream();
    let mut decoder = flate2::write::GzDecoder::new(Vec::new());
    let mut first_event_at = None;
    let mut all = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        all.extend_from_slice(&chunk);
        decoder.write_all(&chunk).unwrap();
        decoder.flush().unwrap();
        if first_event_at.is_none() && String::from_utf8_lossy(decoder.get_ref()).contains("\n\n") {
            first_event_at = Some(started.elapsed());
        }
    }
    let total = started.elapsed();
    let first = first_event_at.expect("no event decoded");
    assert!(
        first < Duration::from_millis(250) && total >= Duration::from_millis(1500),
        "first event after {first:?}, stream took {total:?}"
    );
    let text = String::from_utf8(gunzip(&all)).unwrap();
    let events = named_events(&text);
    assert_eq!(events.first().unwrap().0, "message_start");
    assert_eq!(events.last().unwrap().0, "message_stop");
    assert_eq!(
        events
            .iter()
            .filter(|(n, _)| n == "content_block_delta")
            .count(),
        3
    );
}

#[tokio::test]
async fn faults_apply_to_every_family() {
    let body = post(
        "/v1/messages",
        &[("x-sim-fault", "no-usage")],
        json!({"model": "sim-model", "max_tokens": 2, "stream": true, "messages": []}),
    )
    .await
    .text()
    .await
    .unwrap();
    assert!(
        !body.contains("usage") && body.contains("message_stop"),
        "{body}"
    );
    let v: Value = post(
        "/v1/responses",
        &[("x-sim-fault", "no-usage")],
        json!({"model": "sim-model", "input": "x"}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(v["usage"], Value::Null);
    let r = post(
        "/v1/responses",
        &[("x-sim-fault", "drop-mid-stream")],
        json!({"model": "sim-model", "input": "x", "stream": true}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert!(r.text().await.is_err());
}
