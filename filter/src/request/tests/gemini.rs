//! OpenAI chat to Gemini on Vertex AI through the state machine: the request leaves as a
//! `generateContent` body at the publisher's path (`streamGenerateContent?alt=sse` for a stream)
//! with the bearer token; what cannot be translated is refused before anything is counted; the
//! answer (JSON or SSE) comes back as OpenAI chat, settled to Gemini's `usageMetadata`.

use super::cost;
use super::*;

const GEMINI: &str =
    "/v1/projects/proj-1/locations/us-central1/publishers/google/models/gemini-2.5-flash";

fn fx_with(extra: Value) -> Fx {
    let mut p = policy();
    p["tiers"][0]["limits"] = json!({"requests": [{"limit": 1000, "window": "1m"}],
                                     "tokens": [{"limit": 1000000, "window": "1m"}]});
    p["models"].as_array_mut().unwrap().push(json!({
        "name": "gem", "path": "/ext/gem", "tiers": ["free"], "servedName": "gemini-2.5-flash",
        "provider": {"type": "vertex", "credentialRef": "gcp", "auth": "gcpServiceAccount",
                     "project": "proj-1", "location": "us-central1", "publisher": "google"},
        "upstreamCluster": "ext-gem"}));
    let mut cfg = json!({"pauseHeadersForBody": true, "bootstrapPolicy": p});
    for (k, v) in extra.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    let fx = Fx::with(cfg);
    fx.cache(&key(2), allow_alice());
    fx.root.worker.borrow_mut().credentials = Rc::new(CredentialsDocument {
        credentials: [("gcp".to_string(), "ya29.token".to_string())].into(),
        ..Default::default()
    });
    fx.host
        .properties
        .borrow_mut()
        .insert("xds.cluster_name".into(), "ext-gem".into());
    fx
}

fn send(fx: &Fx, path: &str, body: &Value) -> (u32, Http) {
    let (id, h) = fx.http();
    let headers = vec![
        (":method", "POST".to_string()),
        (":path", path.to_string()),
        ("authorization", format!("Bearer {}", key(2))),
        ("content-type", "application/json".to_string()),
    ];
    fx.headers(id, &h, &refs(&headers), false);
    fx.body(id, &h, body.to_string().as_bytes(), true);
    (id, h)
}

#[test]
fn the_request_leaves_as_generate_content_at_the_method_of_its_stream() {
    let fx = fx_with(json!({}));
    for (path, stream) in [
        ("/ext/gem/v1/chat/completions", false),
        ("/ext/gem/v1/chat/completions?x=1", true),
        ("/v1/chat/completions", true),
        ("/v1/chat/completions", false),
    ] {
        let body = json!({"model": "gem", "max_tokens": 20, "stream": stream,
                          "messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "hi"}]});
        let (id, h) = send(&fx, path, &body);
        assert!(
            fx.phase(&h).starts_with("Forwarding"),
            "{path}: {:?}",
            fx.sent_to(id)
        );
        let method = if stream {
            "streamGenerateContent?alt=sse"
        } else {
            "generateContent"
        };
        assert_eq!(
            fx.host.map_value(Headers::Request, ":path"),
            Some(format!("{GEMINI}:{method}")),
            "{path}"
        );
        assert_eq!(
            fx.host
                .map_value(Headers::Request, "authorization")
                .as_deref(),
            Some("Bearer ya29.token")
        );
        let sent: Value = serde_json::from_slice(&fx.host.buffer(Body::Request)).unwrap();
        assert_eq!(
            sent,
            json!({"contents": [{"role": "user", "parts": [{"text": "hi"}]}],
                   "systemInstruction": {"parts": [{"text": "be brief"}]},
                   "generationConfig": {"maxOutputTokens": 20}}),
            "{path}"
        );
    }
    // No cap named: the one reserved is sent (the tier's default reservation).
    let (_, h) = send(
        &fx,
        "/v1/chat/completions",
        &json!({"model": "gem", "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert!(fx.phase(&h).starts_with("Forwarding"));
    let sent: Value = serde_json::from_slice(&fx.host.buffer(Body::Request)).unwrap();
    assert!(
        sent["generationConfig"]["maxOutputTokens"].as_u64() > Some(0),
        "{sent}"
    );
    // Gemini serves chat only here.
    let (id, _) = send(
        &fx,
        "/ext/gem/v1/embeddings",
        &json!({"model": "gem", "input": "hi"}),
    );
    let s = fx.sent_to(id).expect("refused");
    assert_eq!(
        (s.status, s.code().as_str()),
        (404, "operation_not_allowed")
    );
}

#[test]
fn what_gemini_cannot_say_is_refused_before_anything_is_counted() {
    let fx = fx_with(json!({}));
    let (id, _) = send(
        &fx,
        "/v1/chat/completions",
        &json!({"model": "gem", "max_tokens": 5, "logprobs": true,
                "messages": [{"role": "user", "content": "hi"}]}),
    );
    let s = fx.sent_to(id).expect("refused");
    assert_eq!(
        (s.status, s.code().as_str()),
        (400, "untranslatable_request")
    );
    assert!(
        String::from_utf8_lossy(&s.body).contains("logprobs"),
        "{s:?}"
    );
    assert_eq!(fx.tokens_used("alice"), 0);
}

#[test]
fn a_json_answer_is_translated_and_settled_to_its_usage_metadata() {
    let fx = fx_with(json!({}));
    let (id, h) = send(
        &fx,
        "/ext/gem/v1/chat/completions",
        &json!({"model": "gem", "max_tokens": 20,
                "messages": [{"role": "user", "content": "hi"}]}),
    );
    let body = br#"{"candidates":[{"content":{"role":"model","parts":[{"text":"hello"}]},"finishReason":"STOP"}],"usageMetadata":{"promptTokenCount":11,"candidatesTokenCount":4,"thoughtsTokenCount":3,"totalTokenCount":18}}"#;
    let out = fx.pass_answer(
        id,
        &h,
        "application/json; charset=UTF-8",
        &[&body[..40], &body[40..]],
    );
    let out: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(out["choices"][0]["message"]["content"], "hello");
    assert_eq!(out["choices"][0]["finish_reason"], "stop");
    assert_eq!(out["model"], "gem");
    assert_eq!(out["usage"]["completion_tokens"], 7);
    h.on_log(&fx.host);
    assert_eq!(fx.tokens_used("alice"), 18);
}

#[test]
fn an_sse_stream_is_translated_event_by_event_and_settled_to_its_last_usage() {
    let fx = fx_with(json!({}));
    let (id, h) = send(
        &fx,
        "/v1/chat/completions",
        &json!({"model": "gem", "max_tokens": 20, "stream": true,
                "stream_options": {"include_usage": true},
                "messages": [{"role": "user", "content": "hi"}]}),
    );
    let bytes = concat!(
        "data: {\"candidates\":[{\"content\":{\"role\":\"model\",\"parts\":[{\"text\":\"hel\"}]}}],",
        "\"usageMetadata\":{\"promptTokenCount\":9,\"totalTokenCount\":9}}\r\n\r\n",
        "data: {\"candidates\":[{\"content\":{\"role\":\"model\",\"parts\":[{\"text\":\"lo\"}]},",
        "\"finishReason\":\"STOP\"}],\"usageMetadata\":{\"promptTokenCount\":9,",
        "\"candidatesTokenCount\":2,\"totalTokenCount\":11}}\r\n\r\n"
    )
    .as_bytes();
    let chunks: Vec<&[u8]> = bytes.chunks(17).collect();
    let out = fx.pass_answer(id, &h, "text/event-stream", &chunks);
    assert_eq!(fx.host.map_value(Headers::Response, "content-length"), None);
    let text = String::from_utf8(out).unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"), "{text}");
    let content: String = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e.strip_prefix("data: ")?).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(content, "hello");
    let usage: Value =
        serde_json::from_str(events[events.len() - 2].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(usage["usage"]["total_tokens"], 11);
    h.on_log(&fx.host);
    assert_eq!(fx.tokens_used("alice"), 11);
}

/// A request decided again after a lease round is translated again from the OpenAI body it
/// kept (with the cap admission set), never from its own translation.
#[test]
fn a_request_decided_again_after_a_lease_round_is_translated_from_its_openai_body() {
    use maas_types::lease::{LEASES_PATH, LeaseRequest};
    let fx = fx_with(json!({"limits": {"global": {"replicaId": "gw-a", "replicas": 1}}}));
    let (id, h) = send(
        &fx,
        "/v1/chat/completions",
        &json!({"model": "gem", "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(fx.phase(&h), "Leasing");
    let d = fx
        .host
        .dispatched
        .borrow()
        .iter()
        .rfind(|d| d.headers.iter().any(|(_, v)| v == LEASES_PATH))
        .cloned()
        .expect("a lease callout");
    let req: LeaseRequest = serde_json::from_slice(d.body.as_deref().unwrap()).unwrap();
    let grants: Vec<Value> = req
        .items
        .iter()
        .map(|i| json!({"granted": i.want, "taken": i.want}))
        .collect();
    let answer = json!({"replicas": 1, "store": "memory", "grants": grants}).to_string();
    fx.answer(id, &h, Some(200), answer.as_bytes());
    assert!(
        fx.phase(&h).starts_with("Forwarding"),
        "{:?}",
        fx.sent_to(id)
    );
    let sent: Value = serde_json::from_slice(&fx.host.buffer(Body::Request)).unwrap();
    assert_eq!(sent["contents"][0]["parts"][0]["text"], "hi", "{sent}");
    assert!(
        sent["generationConfig"]["maxOutputTokens"].as_u64() > Some(0),
        "{sent}"
    );
    assert!(
        sent.get("messages").is_none() && sent.get("max_tokens").is_none(),
        "{sent}"
    );
}

const COST_STREAM: &[u8] = br#"{"model":"gem","max_tokens":64,"stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Say something short about benchmarks please"}]}"#;

/// A Gemini SSE stream of 64 text events (the last with its finish reason), usage in the last
/// as Vertex sends it, one event a chunk.
fn gemini_events() -> Vec<Vec<u8>> {
    (0..64)
        .map(|i| {
            let mut e = json!({"candidates": [{"content": {"role": "model",
                                                         "parts": [{"text": format!(" tok{i}")}]}}],
                               "usageMetadata": {"promptTokenCount": 11, "totalTokenCount": 11},
                               "modelVersion": "gemini-2.5-flash"});
            if i == 63 {
                e["candidates"][0]["finishReason"] = json!("MAX_TOKENS");
                e["usageMetadata"] = json!({"promptTokenCount": 11, "candidatesTokenCount": 64,
                                            "totalTokenCount": 75});
            }
            format!("data: {e}\r\n\r\n").into_bytes()
        })
        .collect()
}

fn cost_fixture() -> Fx {
    let fx = fx_with(json!({}));
    let mut p = policy();
    p["tiers"][0]["limits"] = json!({});
    p["models"].as_array_mut().unwrap().push(json!({
        "name": "gem", "path": "/ext/gem", "tiers": ["free"], "servedName": "gemini-2.5-flash",
        "provider": {"type": "vertex", "credentialRef": "gcp", "auth": "gcpServiceAccount",
                     "project": "proj-1", "location": "us-central1", "publisher": "google"},
        "upstreamCluster": "ext-gem"}));
    let doc: maas_types::PolicyDocument = serde_json::from_value(p).unwrap();
    fx.root.worker.borrow_mut().policy = Some(Rc::new(doc));
    fx
}

/// One translated stream's life in the filter (the request translated to generateContent,
/// its SSE answer back to OpenAI chunks). Not inlined: valgrind counts from its entry.
#[inline(never)]
fn gemini_stream_callbacks(fx: &Fx, id: u32, body_len: usize, chunks: &[Vec<u8>]) {
    cost::request_life(fx, id, body_len, chunks);
}

/// Not a test: the filter's work per translated 64-token Gemini stream (`MAAS_NATIVE_COST_N`
/// streams; `./scripts/bench.sh` counts its instructions with valgrind).
#[test]
#[ignore]
fn native_cost_of_a_gemini_stream() {
    let fx = cost_fixture();
    let chunks = gemini_events();
    let headers = vec![
        (":method", "POST".to_string()),
        (":path", "/ext/gem/v1/chat/completions".to_string()),
        ("authorization", format!("Bearer {}", key(2))),
        ("content-type", "application/json".to_string()),
    ];
    let resp = [(":status", "200"), ("content-type", "text/event-stream")];
    let n = cost::rounds(2000);
    let us = cost::run(
        &fx,
        &refs(&headers),
        COST_STREAM,
        &resp,
        None,
        n,
        |fx, id| {
            gemini_stream_callbacks(fx, id, COST_STREAM.len(), &chunks);
        },
    );
    eprintln!("{us:.1} µs per translated 64-token Gemini stream");
}

/// The cost harness's stream is what it claims: translated to chunks, settled to its usage.
#[test]
fn the_native_cost_stream_is_translated_and_settled() {
    let fx = cost_fixture();
    let (id, h) = send(
        &fx,
        "/ext/gem/v1/chat/completions",
        &serde_json::from_slice(COST_STREAM).unwrap(),
    );
    assert!(
        fx.phase(&h).starts_with("Forwarding"),
        "{:?}",
        fx.sent_to(id)
    );
    let chunks = gemini_events();
    let parts: Vec<&[u8]> = chunks.iter().map(Vec::as_slice).collect();
    let out = String::from_utf8(fx.pass_answer(id, &h, "text/event-stream", &parts)).unwrap();
    assert!(out.ends_with("data: [DONE]\n\n"), "{out}");
    assert!(out.contains("\"total_tokens\":75"), "{out}");
    assert_eq!(out.matches("\"content\":\" tok").count(), 64);
}
