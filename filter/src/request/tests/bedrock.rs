//! OpenAI chat to an AWS Bedrock model through the state machine: the request leaves as a
//! Converse body at Bedrock's path and host, signed with the day's key for exactly the body
//! sent; without a key it is refused (503 `signing_unavailable`), never sent unsigned; the
//! answer (JSON or event stream) comes back as OpenAI chat, settled to Bedrock's usage.

use super::cost;
use super::*;
use crate::sigv4;
use crate::translate::eventstream::encode;
use maas_types::SigV4Key;

const SECRET: &str = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY";
const MODEL_ID: &str = "anthropic.claude-3-haiku-20240307-v1:0";
/// The recording host's clock: 2023-11-14T22:13:20Z.
const NOW_S: u64 = 1_700_000_000;
const END_OF_DAY: u64 = 1_700_006_400;

fn derive(date: &str) -> String {
    let k = sigv4::hmac(format!("AWS4{SECRET}").as_bytes(), date.as_bytes());
    let k = sigv4::hmac(&k, b"us-east-1");
    let k = sigv4::hmac(&k, b"bedrock");
    hex::encode(sigv4::hmac(&k, b"aws4_request"))
}

fn key(date: &str, expires_at: u64) -> SigV4Key {
    SigV4Key {
        access_key_id: "AKIDEXAMPLE".into(),
        date: date.into(),
        region: "us-east-1".into(),
        service: "bedrock".into(),
        signing_key: derive(date),
        session_token: Some("session-token-1".into()),
        expires_at,
    }
}

fn fx(keys: Vec<SigV4Key>) -> Fx {
    fx_with(keys, json!({}))
}

fn fx_with(keys: Vec<SigV4Key>, extra: Value) -> Fx {
    let mut p = policy();
    p["models"].as_array_mut().unwrap().push(json!({
        "name": "haiku", "path": "/ext/haiku", "tiers": ["free"], "servedName": MODEL_ID,
        "provider": {"type": "bedrock", "credentialRef": "aws", "auth": "awsSigV4",
                     "region": "us-east-1"},
        "upstreamCluster": "ext-haiku"}));
    let mut cfg = json!({"pauseHeadersForBody": true, "bootstrapPolicy": p});
    for (k, v) in extra.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    let fx = Fx::with(cfg);
    fx.cache(&key_of(2), allow_alice());
    fx.root.worker.borrow_mut().credentials = Rc::new(CredentialsDocument {
        sigv4: [("aws".to_string(), keys)].into(),
        ..Default::default()
    });
    fx.host
        .properties
        .borrow_mut()
        .insert("xds.cluster_name".into(), "ext-haiku".into());
    fx
}

fn key_of(n: u8) -> String {
    super::key(n)
}

fn send(fx: &Fx, body: &[u8]) -> (u32, Http) {
    let (id, h) = fx.http();
    let headers = vec![
        (":method", "POST".to_string()),
        (":path", "/ext/haiku/v1/chat/completions".to_string()),
        (":authority", "gateway.example".to_string()),
        ("authorization", format!("Bearer {}", key_of(2))),
        ("content-type", "application/json".to_string()),
        ("x-amz-security-token", "client-token".to_string()),
        ("X_Amz_Date", "20000101T000000Z".to_string()),
    ];
    fx.headers(id, &h, &refs(&headers), false);
    fx.body(id, &h, body, true);
    (id, h)
}

const CHAT_BODY: &[u8] = br#"{"model":"haiku","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}]}"#;

#[test]
fn the_request_leaves_as_converse_signed_for_exactly_its_body() {
    let fx = fx(vec![key("20231114", END_OF_DAY)]);
    let (_, h) = send(&fx, CHAT_BODY);
    assert!(fx.phase(&h).starts_with("Forwarding"), "{}", fx.phase(&h));
    let req = |n| fx.host.map_value(Headers::Request, n);
    assert_eq!(
        req(":path").as_deref(),
        Some("/model/anthropic.claude-3-haiku-20240307-v1%3A0/converse")
    );
    assert_eq!(
        req(":authority").as_deref(),
        Some("bedrock-runtime.us-east-1.amazonaws.com")
    );
    // The client's x-amz-* never beside the gateway's.
    assert_eq!(req("x_amz_date"), None);
    assert_eq!(
        req("x-amz-security-token").as_deref(),
        Some("session-token-1")
    );
    let body = fx.host.buffer(Body::Request);
    let sent: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        sent,
        json!({"system": [{"text": "be brief"}],
               "messages": [{"role": "user", "content": [{"text": "hi"}]}],
               "inferenceConfig": {"maxTokens": 100}})
    );
    assert_eq!(req("content-length"), Some(body.len().to_string()));
    assert_eq!(req("x-amz-content-sha256"), Some(sigv4::sha256_hex(&body)));
    assert_eq!(req("x-amz-date").as_deref(), Some("20231114T221320Z"));
    // AWS's verification, from the secret and what was sent.
    let signed_headers = [
        ("content-type", req("content-type").unwrap()),
        ("host", req(":authority").unwrap()),
        ("x-amz-content-sha256", req("x-amz-content-sha256").unwrap()),
        ("x-amz-date", req("x-amz-date").unwrap()),
        ("x-amz-security-token", req("x-amz-security-token").unwrap()),
    ];
    let refs: Vec<(&str, &str)> = signed_headers
        .iter()
        .map(|(n, v)| (*n, v.as_str()))
        .collect();
    let (canonical, signed) = sigv4::canonical_request(
        "POST",
        &req(":path").unwrap(),
        "",
        &refs,
        &sigv4::sha256_hex(&body),
    );
    let scope = sigv4::scope("20231114", "us-east-1", "bedrock");
    let signature = sigv4::signature(
        &hex::decode(derive("20231114")).unwrap(),
        &sigv4::string_to_sign("20231114T221320Z", &scope, &canonical),
    );
    assert_eq!(
        req("authorization"),
        Some(sigv4::authorization(
            "AKIDEXAMPLE",
            &scope,
            &signed,
            &signature
        ))
    );
}

#[test]
fn a_stream_goes_to_converse_stream() {
    let fx = fx(vec![key("20231114", END_OF_DAY)]);
    send(
        &fx,
        br#"{"model":"haiku","stream":true,"max_tokens":5,"messages":[{"role":"user","content":"hi"}]}"#,
    );
    assert_eq!(
        fx.host.map_value(Headers::Request, ":path").as_deref(),
        Some("/model/anthropic.claude-3-haiku-20240307-v1%3A0/converse-stream")
    );
    let sent: Value = serde_json::from_slice(&fx.host.buffer(Body::Request)).unwrap();
    assert_eq!(sent["inferenceConfig"]["maxTokens"], 5);
}

#[test]
fn without_a_valid_key_of_the_day_it_is_refused_never_sent_unsigned() {
    for keys in [
        vec![],
        vec![key("20231113", NOW_S - 1)],
        // Today's date but already past its expiry.
        vec![key("20231114", NOW_S)],
        vec![SigV4Key {
            region: "eu-west-1".into(),
            ..key("20231114", END_OF_DAY)
        }],
    ] {
        let fx = fx(keys);
        let (id, h) = fx.http();
        let headers = vec![
            (":method", "POST".to_string()),
            (":path", "/ext/haiku/v1/chat/completions".to_string()),
            ("authorization", format!("Bearer {}", key_of(2))),
            ("content-type", "application/json".to_string()),
        ];
        fx.headers(id, &h, &refs(&headers), false);
        let s = fx.sent_to(id).expect("refused at the headers");
        assert_eq!((s.status, s.code().as_str()), (503, "signing_unavailable"));
        assert_eq!(fx.tokens_used("alice"), 0);
    }
}

#[test]
fn a_json_answer_is_translated_and_settled_to_bedrocks_usage() {
    let fx = fx(vec![key("20231114", END_OF_DAY)]);
    let (id, h) = send(&fx, CHAT_BODY);
    let body = br#"{"output":{"message":{"role":"assistant","content":[{"text":"hello"}]}},"stopReason":"end_turn","usage":{"inputTokens":11,"outputTokens":7,"totalTokens":18}}"#;
    let out = fx.pass_answer(id, &h, "application/json", &[&body[..30], &body[30..]]);
    let out: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(out["choices"][0]["message"]["content"], "hello");
    assert_eq!(out["model"], "haiku");
    assert_eq!(out["usage"]["total_tokens"], 18);
    h.on_log(&fx.host);
    assert_eq!(fx.tokens_used("alice"), 18);
}

#[test]
fn an_event_stream_is_translated_frame_by_frame_and_settled_to_its_metadata() {
    let fx = fx(vec![key("20231114", END_OF_DAY)]);
    let (id, h) = send(
        &fx,
        br#"{"model":"haiku","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}"#,
    );
    let ev = |kind: &str, p: &str| {
        encode(
            &[(":event-type", kind), (":message-type", "event")],
            p.as_bytes(),
        )
    };
    let bytes = [
        ev("messageStart", r#"{"role":"assistant"}"#),
        ev(
            "contentBlockDelta",
            r#"{"delta":{"text":"hel"},"contentBlockIndex":0}"#,
        ),
        ev(
            "contentBlockDelta",
            r#"{"delta":{"text":"lo"},"contentBlockIndex":0}"#,
        ),
        ev("contentBlockStop", r#"{"contentBlockIndex":0}"#),
        ev("messageStop", r#"{"stopReason":"end_turn"}"#),
        ev(
            "metadata",
            r#"{"usage":{"inputTokens":9,"outputTokens":2,"totalTokens":11}}"#,
        ),
    ]
    .concat();
    let chunks: Vec<&[u8]> = bytes.chunks(23).collect();
    let out = fx.pass_answer(id, &h, "application/vnd.amazon.eventstream", &chunks);
    assert_eq!(
        fx.host
            .map_value(Headers::Response, "content-type")
            .as_deref(),
        Some("text/event-stream")
    );
    assert_eq!(fx.host.map_value(Headers::Response, "content-length"), None);
    let text = String::from_utf8(out).unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"));
    let usage: Value =
        serde_json::from_str(events[events.len() - 2].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(usage["usage"]["prompt_tokens"], 9);
    h.on_log(&fx.host);
    assert_eq!(fx.tokens_used("alice"), 11);
}

/// A tool call, through the whole filter: the tools leave as `toolConfig` in the signed body,
/// and the streamed `toolUse` comes back as `tool_calls` deltas, settled to Bedrock's usage.
#[test]
fn a_tool_call_leaves_as_tool_config_and_streams_back_as_tool_call_deltas() {
    let fx = fx(vec![key("20231114", END_OF_DAY)]);
    let (id, h) = send(
        &fx,
        br#"{"model":"haiku","stream":true,"tool_choice":"auto","tools":[{"type":"function","function":{"name":"get","parameters":{"type":"object"}}}],"messages":[{"role":"user","content":"hi"}]}"#,
    );
    assert!(fx.phase(&h).starts_with("Forwarding"), "{}", fx.phase(&h));
    let body = fx.host.buffer(Body::Request);
    let sent: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        sent["toolConfig"],
        json!({"tools": [{"toolSpec": {"name": "get", "inputSchema": {"json": {"type": "object"}}}}],
               "toolChoice": {"auto": {}}})
    );
    assert_eq!(
        fx.host.map_value(Headers::Request, "x-amz-content-sha256"),
        Some(sigv4::sha256_hex(&body))
    );
    let ev = |kind: &str, p: &str| {
        encode(
            &[(":event-type", kind), (":message-type", "event")],
            p.as_bytes(),
        )
    };
    let bytes = [
        ev("messageStart", r#"{"role":"assistant"}"#),
        ev(
            "contentBlockStart",
            r#"{"contentBlockIndex":0,"start":{"toolUse":{"toolUseId":"tooluse_a","name":"get"}}}"#,
        ),
        ev(
            "contentBlockDelta",
            r#"{"contentBlockIndex":0,"delta":{"toolUse":{"input":"{\"q\":"}}}"#,
        ),
        ev(
            "contentBlockDelta",
            r#"{"contentBlockIndex":0,"delta":{"toolUse":{"input":"1}"}}}"#,
        ),
        ev("contentBlockStop", r#"{"contentBlockIndex":0}"#),
        ev("messageStop", r#"{"stopReason":"tool_use"}"#),
        ev(
            "metadata",
            r#"{"usage":{"inputTokens":40,"outputTokens":6,"totalTokens":46}}"#,
        ),
    ]
    .concat();
    let chunks: Vec<&[u8]> = bytes.chunks(17).collect();
    let out = fx.pass_answer(id, &h, "application/vnd.amazon.eventstream", &chunks);
    let text = String::from_utf8(out).unwrap();
    let chunks: Vec<Value> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter_map(|e| serde_json::from_str(e).ok())
        .collect();
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
        .collect();
    assert_eq!(calls.len(), 3, "{text}");
    assert_eq!(calls[0][0]["id"], "tooluse_a");
    assert_eq!(calls[0][0]["function"]["name"], "get");
    let arguments: String = calls
        .iter()
        .filter_map(|c| c[0]["function"]["arguments"].as_str())
        .collect();
    assert_eq!(arguments, r#"{"q":1}"#);
    assert!(
        chunks
            .iter()
            .any(|c| c["choices"][0]["finish_reason"] == "tool_calls")
    );
    assert!(text.ends_with("data: [DONE]\n\n"));
    h.on_log(&fx.host);
    assert_eq!(fx.tokens_used("alice"), 46);
}

/// The body read while the caller is being authenticated (a cache miss): translated and signed
/// once, when the answer decides — whether its end came before the answer or after.
#[test]
fn a_body_read_while_authenticating_is_translated_once() {
    const BODY: &[u8] = br#"{"model":"haiku","stream":true,"max_tokens":8,"messages":[{"role":"user","content":"hi"}]}"#;
    for end_before_answer in [true, false] {
        let fx = fx(vec![key("20231114", END_OF_DAY)]);
        let (id, h) = fx.http();
        let headers = vec![
            (":method", "POST".to_string()),
            (":path", "/ext/haiku/v1/chat/completions".to_string()),
            ("authorization", format!("Bearer {}", key_of(3))),
            ("content-type", "application/json".to_string()),
            ("content-length", BODY.len().to_string()),
        ];
        fx.headers(id, &h, &refs(&headers), false);
        fx.body(id, &h, BODY, end_before_answer);
        assert!(fx.phase(&h).contains("Authenticating"), "{}", fx.phase(&h));
        fx.answer(id, &h, Some(200), &super::alice());
        if !end_before_answer {
            fx.body(id, &h, BODY, true);
        }
        assert!(
            fx.phase(&h).starts_with("Forwarding"),
            "{:?} {}",
            fx.sent_to(id),
            fx.phase(&h)
        );
        let sent: Value = serde_json::from_slice(&fx.host.buffer(Body::Request)).unwrap();
        assert_eq!(sent["inferenceConfig"]["maxTokens"], 8);
        assert_eq!(
            fx.host.map_value(Headers::Request, ":path").as_deref(),
            Some("/model/anthropic.claude-3-haiku-20240307-v1%3A0/converse-stream")
        );
    }
}

/// Global limits: a request decided again after its lease round is translated and signed
/// again from the OpenAI body it kept, never translated twice.
#[test]
fn a_request_decided_again_after_a_lease_round_is_signed_once_more_from_its_openai_body() {
    use maas_types::lease::{LEASES_PATH, LeaseRequest};
    let fx = fx_with(
        vec![key("20231114", END_OF_DAY)],
        json!({"limits": {"global": {"replicaId": "gw-a", "replicas": 1}}}),
    );
    let (id, h) = send(&fx, CHAT_BODY);
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
        "{:?} {}",
        fx.sent_to(id),
        fx.phase(&h)
    );
    let body = fx.host.buffer(Body::Request);
    let sent: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(sent["inferenceConfig"]["maxTokens"], 100, "{sent}");
    assert!(sent.get("max_tokens").is_none(), "{sent}");
    assert_eq!(
        fx.host.map_value(Headers::Request, "x-amz-content-sha256"),
        Some(sigv4::sha256_hex(&body))
    );
}

/// A fixture whose budget no cost run exhausts, with the Bedrock model and today's key.
fn cost_fixture() -> Fx {
    let fx = fx(vec![key("20231114", END_OF_DAY)]);
    let mut p = policy();
    p["tiers"][0]["limits"] = json!({});
    p["models"].as_array_mut().unwrap().push(json!({
        "name": "haiku", "path": "/ext/haiku", "tiers": ["free"], "servedName": MODEL_ID,
        "provider": {"type": "bedrock", "credentialRef": "aws", "auth": "awsSigV4",
                     "region": "us-east-1"},
        "upstreamCluster": "ext-haiku"}));
    let doc: maas_types::PolicyDocument = serde_json::from_value(p).unwrap();
    fx.root.worker.borrow_mut().policy = Some(Rc::new(doc));
    fx
}

const COST_JSON: &[u8] = br#"{"model":"haiku","max_tokens":64,"messages":[{"role":"user","content":"Say something short about benchmarks please"}]}"#;
const COST_STREAM: &[u8] = br#"{"model":"haiku","max_tokens":64,"stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Say something short about benchmarks please"}]}"#;

/// A Converse answer of 64 tokens.
fn converse_json() -> Vec<Vec<u8>> {
    let text: String = (0..64).map(|i| format!(" tok{i}")).collect();
    vec![
        json!({
            "output": {"message": {"role": "assistant", "content": [{"text": text}]}},
            "stopReason": "max_tokens",
            "usage": {"inputTokens": 11, "outputTokens": 64, "totalTokens": 75},
            "metrics": {"latencyMs": 1}
        })
        .to_string()
        .into_bytes(),
    ]
}

/// A ConverseStream of 64 text deltas, one event-stream message a chunk.
fn converse_frames() -> Vec<Vec<u8>> {
    let ev = |kind: &str, p: Value| {
        encode(
            &[
                (":event-type", kind),
                (":content-type", "application/json"),
                (":message-type", "event"),
            ],
            p.to_string().as_bytes(),
        )
    };
    let mut frames = vec![
        ev("messageStart", json!({"role": "assistant"})),
        ev(
            "contentBlockStart",
            json!({"contentBlockIndex": 0, "start": {}}),
        ),
    ];
    for i in 0..64 {
        frames.push(ev(
            "contentBlockDelta",
            json!({"contentBlockIndex": 0, "delta": {"text": format!(" tok{i}")}}),
        ));
    }
    frames.push(ev("contentBlockStop", json!({"contentBlockIndex": 0})));
    frames.push(ev("messageStop", json!({"stopReason": "max_tokens"})));
    frames.push(ev(
        "metadata",
        json!({"usage": {"inputTokens": 11, "outputTokens": 64, "totalTokens": 75}, "metrics": {"latencyMs": 1}}),
    ));
    frames
}

/// `n` requests with `body` answered by `chunks` of `content_type`, each through
/// [`signed_request_callbacks`]; the µs per request.
fn cost(body: &[u8], content_type: &str, chunks: &[Vec<u8>]) -> f64 {
    let fx = cost_fixture();
    let headers = vec![
        (":method", "POST".to_string()),
        (":path", "/ext/haiku/v1/chat/completions".to_string()),
        ("authorization", format!("Bearer {}", key_of(2))),
        ("content-type", "application/json".to_string()),
    ];
    let resp = [(":status", "200"), ("content-type", content_type)];
    cost::run(
        &fx,
        &refs(&headers),
        body,
        &resp,
        None,
        cost::rounds(2000),
        |fx, id| {
            signed_request_callbacks(fx, id, body.len(), chunks);
        },
    )
}

/// One signed request's life in the filter (translated, signed, its answer translated back).
/// Not inlined: valgrind counts instructions from its entry (`--toggle-collect`).
#[inline(never)]
fn signed_request_callbacks(fx: &Fx, id: u32, body_len: usize, chunks: &[Vec<u8>]) {
    cost::request_life(fx, id, body_len, chunks);
}

/// Not a test: the filter's work per signed Bedrock JSON request (translated to Converse, SigV4
/// signed, a 64-token answer translated back). `./scripts`-style: count with valgrind.
#[test]
#[ignore]
fn native_cost_of_a_signed_json_request() {
    let us = cost(COST_JSON, "application/json", &converse_json());
    eprintln!("{us:.1} µs per signed Bedrock JSON request");
}

/// Not a test: the filter's work per signed 64-token ConverseStream translated to OpenAI SSE.
#[test]
#[ignore]
fn native_cost_of_a_converse_stream() {
    let us = cost(
        COST_STREAM,
        "application/vnd.amazon.eventstream",
        &converse_frames(),
    );
    eprintln!("{us:.1} µs per signed, translated 64-token Bedrock stream");
}

/// The cost harness's requests are what they claim: signed, answered, translated, settled.
#[test]
fn the_native_cost_requests_are_signed_and_translated() {
    for (body, ct, chunks, tail) in [
        (
            COST_JSON,
            "application/json",
            converse_json(),
            "\"total_tokens\":75",
        ),
        (
            COST_STREAM,
            "application/vnd.amazon.eventstream",
            converse_frames(),
            "data: [DONE]\n\n",
        ),
    ] {
        let fx = cost_fixture();
        let (id, h) = send(&fx, body);
        assert!(fx.phase(&h).starts_with("Forwarding"), "{}", fx.phase(&h));
        assert!(
            fx.host
                .map_value(Headers::Request, "authorization")
                .unwrap()
                .starts_with("AWS4-HMAC-SHA256")
        );
        let refs: Vec<&[u8]> = chunks.iter().map(Vec::as_slice).collect();
        let out = String::from_utf8(fx.pass_answer(id, &h, ct, &refs)).unwrap();
        assert!(out.contains(tail), "{out}");
        assert!(out.contains("\"prompt_tokens\":11"), "{out}");
        h.on_log(&fx.host);
    }
}

#[test]
fn what_converse_cannot_say_is_refused_before_anything_is_counted() {
    let fx = fx(vec![key("20231114", END_OF_DAY)]);
    let (id, h) = send(
        &fx,
        br#"{"model":"haiku","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://example.com/a.png"}}]}]}"#,
    );
    assert_eq!(fx.phase(&h), "Refused");
    let s = fx.sent_to(id).unwrap();
    assert_eq!(
        (s.status, s.code().as_str()),
        (400, "untranslatable_request")
    );
    assert_eq!(fx.tokens_used("alice"), 0);
}

#[test]
fn a_body_the_gateway_does_not_read_is_refused_not_sent_unsigned() {
    let fx = fx(vec![key("20231114", END_OF_DAY)]);
    let (id, h) = fx.http();
    let headers = vec![
        (":method", "POST".to_string()),
        (":path", "/ext/haiku/v1/chat/completions".to_string()),
        ("authorization", format!("Bearer {}", key_of(2))),
        (
            "content-type",
            "multipart/form-data; boundary=x".to_string(),
        ),
    ];
    fx.headers(id, &h, &refs(&headers), false);
    fx.body(id, &h, b"--x--", true);
    let s = fx.sent_to(id).expect("refused");
    // A chat body is always read: one that is not JSON is refused as such.
    assert_eq!((s.status, s.code().as_str()), (400, "invalid_body"));
    assert_eq!(fx.phase(&h), "Refused");
}

/// A routed backend on Bedrock (one of a model's backends with its own cluster, drawn per
/// request): the drawn request is translated and signed exactly as a Bedrock model's, and
/// routed by the backend header; its answer comes back as OpenAI chat. The other backend,
/// without its credential, is never drawn.
#[test]
fn a_routed_bedrock_backend_is_translated_and_signed_as_a_bedrock_model() {
    let mut p = policy();
    p["models"].as_array_mut().unwrap().push(json!({
    "name": "split", "path": "/ext/split", "tiers": ["free"], "api": "openai",
    "backends": [
        {"name": "oai", "upstreamCluster": "ext-oai", "weight": 100,
         "provider": {"type": "openai", "credentialRef": "missing"}},
        {"name": "bedrock", "upstreamCluster": "ext-bedrock", "servedName": MODEL_ID,
         "provider": {"type": "bedrock", "credentialRef": "aws", "auth": "awsSigV4",
                      "region": "us-east-1"}}
    ]}));
    let fx = Fx::with(json!({"pauseHeadersForBody": true, "bootstrapPolicy": p}));
    fx.cache(&key_of(2), allow_alice());
    fx.root.worker.borrow_mut().credentials = Rc::new(CredentialsDocument {
        sigv4: [("aws".to_string(), vec![key("20231114", END_OF_DAY)])].into(),
        ..Default::default()
    });
    for path in ["/ext/split/v1/chat/completions", "/v1/chat/completions"] {
        let (id, h) = fx.http();
        let headers = vec![
            (":method", "POST".to_string()),
            (":path", path.to_string()),
            ("authorization", format!("Bearer {}", key_of(2))),
            ("content-type", "application/json".to_string()),
        ];
        fx.headers(id, &h, &refs(&headers), false);
        fx.body(
            id,
            &h,
            br#"{"model":"split","messages":[{"role":"user","content":"hi"}]}"#,
            true,
        );
        assert!(fx.sent_to(id).is_none(), "{:?}", fx.sent_to(id));
        let req = |n| fx.host.map_value(Headers::Request, n);
        assert_eq!(req("x-maas-backend").as_deref(), Some("bedrock"), "{path}");
        assert_eq!(req("x-maas-model").as_deref(), Some("split"));
        assert_eq!(
            req(":path").as_deref(),
            Some("/model/anthropic.claude-3-haiku-20240307-v1%3A0/converse")
        );
        assert!(
            req("authorization").is_some_and(|a| a.starts_with("AWS4-HMAC-SHA256 ")),
            "{:?}",
            req("authorization")
        );
        let sent: Value = serde_json::from_slice(&fx.host.buffer(Body::Request)).unwrap();
        assert!(
            sent.get("messages").is_some() && sent.get("model").is_none(),
            "{sent}"
        );
        // The answer from the backend's own cluster, translated back.
        fx.host
            .properties
            .borrow_mut()
            .insert("xds.cluster_name".into(), "ext-bedrock".into());
        let answer = br#"{"output":{"message":{"role":"assistant","content":[{"text":"hello"}]}},"stopReason":"end_turn","usage":{"inputTokens":5,"outputTokens":2,"totalTokens":7}}"#;
        let out = fx.pass_answer(id, &h, "application/json", &[answer]);
        let out: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(out["choices"][0]["message"]["content"], "hello", "{out}");
        assert_eq!(out["usage"]["completion_tokens"], 2);
    }
}
