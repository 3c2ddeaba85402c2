//! A request that names no output cap is given the one it reserves (`uncappedRequests`).

use super::*;

fn hit(fx: &Fx) {
    fx.cache(&key(2), allow_alice());
}

const UNCAPPED: &[u8] = br#"{"model":"sim","messages":[{"role":"user","content":"hi"}]}"#;
const UNCAPPED_STREAM: &[u8] =
    br#"{"model":"sim","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;

fn body_writes(fx: &Fx) -> usize {
    fx.host
        .calls
        .borrow()
        .iter()
        .filter(|c| matches!(c, Call::SetBody(Body::Request)))
        .count()
}

fn sent(fx: &Fx) -> Value {
    serde_json::from_slice(&fx.host.buffer(Body::Request)).unwrap()
}

/// A chat request with `body` on an authorised (cached) caller, forwarded.
fn forwarded(fx: &Fx, headers: &[(&str, &str)], body: &[u8]) {
    hit(fx);
    let (id, h) = fx.http();
    fx.headers(id, &h, headers, false);
    assert_eq!(fx.body(id, &h, body, true), Action::Continue);
    assert!(fx.phase(&h).starts_with("Forwarding"), "{}", fx.phase(&h));
}

#[test]
fn an_uncapped_request_is_given_the_cap_it_reserves() {
    let fx = Fx::new();
    forwarded(&fx, &refs(&chat(&key(2))), UNCAPPED);
    // The free tier's defaultMaxTokens (100): reserved and set, in one write.
    assert_eq!(sent(&fx)["max_tokens"], 100);
    assert_eq!(body_writes(&fx), 1);
    let prompt = request_body::inspect(UNCAPPED)
        .unwrap()
        .prompt_tokens_estimate;
    assert_eq!(fx.tokens_used("alice"), prompt + 100);
}

#[test]
fn an_uncapped_stream_gets_its_cap_and_include_usage_in_one_write() {
    let fx = Fx::new();
    forwarded(&fx, &refs(&chat(&key(2))), UNCAPPED_STREAM);
    let body = sent(&fx);
    assert_eq!(body["max_tokens"], 100);
    assert_eq!(body["stream_options"]["include_usage"], true);
    assert_eq!(body_writes(&fx), 1);
}

#[test]
fn a_capped_request_is_forwarded_as_sent() {
    let fx = Fx::new();
    forwarded(&fx, &refs(&chat(&key(2))), BODY);
    assert_eq!(fx.host.buffer(Body::Request), BODY);
    assert_eq!(body_writes(&fx), 0);
}

#[test]
fn a_tier_that_reserves_only_forwards_an_uncapped_request_as_sent() {
    let mut p = policy();
    p["tiers"][0]["uncappedRequests"] = json!("reserve");
    let fx = Fx::with(json!({ "bootstrapPolicy": p }));
    forwarded(&fx, &refs(&chat(&key(2))), UNCAPPED);
    assert_eq!(fx.host.buffer(Body::Request), UNCAPPED);
    assert_eq!(body_writes(&fx), 0);
}

#[test]
fn each_api_family_gets_its_own_cap_field() {
    let fx = Fx::new();
    fx.host.properties.borrow_mut().insert(
        "xds.cluster_name".into(),
        "outbound|443||api.openai.com".into(),
    );
    let path = |p: &str| {
        let mut h = chat(&key(2));
        h[1].1 = p.to_string();
        h
    };
    for (p, field) in [
        ("/llm/sim/v1/completions", "max_tokens"),
        ("/llm/sim/v1/responses", "max_output_tokens"),
        // OpenAI's own chat refuses `max_tokens` for its reasoning models.
        ("/ext/gpt/v1/chat/completions", "max_completion_tokens"),
    ] {
        let body: &[u8] = if p.ends_with("completions") && !p.contains("chat") {
            br#"{"model":"sim","prompt":"hi"}"#
        } else if p.starts_with("/ext/gpt") {
            br#"{"model":"gpt","messages":[]}"#
        } else {
            br#"{"model":"sim","input":"hi"}"#
        };
        forwarded(&fx, &refs(&path(p)), body);
        let sent = sent(&fx);
        assert_eq!(sent[field], 100, "{p}: {sent}");
        assert_eq!(
            sent.as_object().unwrap().len(),
            3,
            "{p}: only the cap added: {sent}"
        );
    }
}

#[test]
fn embeddings_are_not_capped() {
    let fx = Fx::new();
    let mut h = chat(&key(2));
    h[1].1 = "/llm/sim/v1/embeddings".into();
    let body = br#"{"model":"sim","input":"hi"}"#;
    forwarded(&fx, &refs(&h), body);
    assert_eq!(fx.host.buffer(Body::Request), body);
}

#[test]
fn a_body_read_while_authenticating_gets_its_cap_when_the_answer_comes() {
    let fx = Fx::with(json!({"pauseHeadersForBody": true}));
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    assert_eq!(fx.body(id, &h, UNCAPPED, true), Action::Pause);
    assert!(fx.phase(&h).contains("Authenticating"));
    assert_eq!(body_writes(&fx), 0, "the tier is not known yet");
    fx.answer(id, &h, Some(200), &alice());
    assert!(fx.resumed(id));
    assert!(fx.phase(&h).starts_with("Forwarding"));
    let body = fx.host.buffer(Body::Request);
    assert_eq!(
        serde_json::from_slice::<Value>(&body).unwrap()["max_tokens"],
        100
    );
    // Held headers carry the new length.
    assert_eq!(
        fx.host
            .map_value(Headers::Request, "content-length")
            .as_deref(),
        Some(body.len().to_string().as_str())
    );
}

#[test]
fn a_refused_uncapped_request_writes_nothing() {
    let mut p = policy();
    // The cap it would be given is larger than the window: refused, nothing written.
    p["tiers"][0]["defaultMaxTokens"] = json!(5000);
    let fx = Fx::with(json!({ "bootstrapPolicy": p }));
    hit(&fx);
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    assert_eq!(fx.body(id, &h, UNCAPPED, true), Action::Pause);
    assert_eq!(fx.sent_to(id).unwrap().code(), "tokens_exceed_limit");
    assert_eq!(body_writes(&fx), 0);
}
