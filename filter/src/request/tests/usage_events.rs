//! Usage events in a request's life (policy `observability.usageEvents`): one event per request
//! the usage ledger counts, at its settlement or refusal, adding up to the ledger's record.

use super::*;
use crate::ledger::{Counts, RecordKey};
use maas_types::usage::hour_start_of;

const JSON: &[u8] =
    br#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12,"prompt_tokens_details":{"cached_tokens":3}}}"#;

const PSEUDONYM: &str = "u-00112233aabbccdd";

/// The fixture's policy with usage events on, the free tier's request limit 4 a minute and a
/// shadow limit of 2.
fn events_fx() -> Fx {
    let mut p = policy();
    p["observability"] = json!({"usageEvents": true});
    p["tiers"][0]["limits"]["requests"] = json!([
        {"limit": 4, "window": "1m"},
        {"limit": 2, "window": "1m", "shadow": true}
    ]);
    Fx::with(json!({"bootstrapPolicy": p}))
}

fn alice_with_pseudonym() -> CachedAnswer {
    CachedAnswer::Allow(CachedIdentity {
        subject: "alice".into(),
        groups: vec!["system:authenticated".into()],
        pinned_tier: None,
        subscription: None,
        pseudonym: Some(PSEUDONYM.into()),
        key_scope: None,
    })
}

/// A cached request of alice at `path` with `body`; the response `(status, content type, body)`
/// if admitted; `cut`: the client leaves after the response headers (settled in `on_log`).
fn request(
    fx: &Fx,
    path: &str,
    body: &[u8],
    response: Option<(&str, &str, &[u8])>,
    cut: bool,
) -> u32 {
    fx.cache(&key(2), alice_with_pseudonym());
    let (id, h) = fx.http();
    let mut headers = chat(&key(2));
    headers[1].1 = path.to_string();
    fx.headers(id, &h, &refs(&headers), false);
    if fx.sent_to(id).is_none() {
        fx.body(id, &h, body, true);
    }
    if let Some((status, ct, bytes)) = response
        && fx.sent_to(id).is_none()
    {
        fx.host.enter(id);
        fx.host.set_map(
            Headers::Response,
            &[(":status", status), ("content-type", ct)],
        );
        h.on_response_headers(&fx.host);
        if !cut {
            fx.host.set_buffer(Body::Response, bytes);
            h.on_response_body(&fx.host, bytes.len(), true);
        }
    }
    fx.host.enter(id);
    h.on_log(&fx.host);
    h.on_done(&fx.host);
    id
}

/// The events written, by context (each must be alone on its context).
fn events(fx: &Fx) -> Vec<(u32, Value)> {
    let set = fx.host.set_properties.borrow();
    let mut out: Vec<(u32, Value)> = set
        .iter()
        .map(|(ctx, name, value)| {
            assert_eq!(name, "maas_event");
            (*ctx, serde_json::from_slice(value).unwrap())
        })
        .collect();
    out.sort_by_key(|(ctx, _)| *ctx);
    let mut contexts: Vec<u32> = out.iter().map(|(c, _)| *c).collect();
    contexts.dedup();
    assert_eq!(contexts.len(), out.len(), "one event per request: {out:?}");
    out
}

/// What the events add up to, as the ledger counts it.
fn add_up<'a>(events: impl Iterator<Item = &'a Value>) -> Counts {
    let mut c = Counts::default();
    for e in events {
        if e["forwarded"] == true {
            c.requests += 1;
        }
        c.prompt_tokens += e["input_tokens"].as_u64().unwrap();
        c.completion_tokens += e["output_tokens"].as_u64().unwrap();
        c.cached_input_tokens += e["cached_tokens"].as_u64().unwrap();
        for code in [&e["decision"], &e["shadow"]] {
            if let Some(code) = code.as_str().filter(|c| *c != "allowed") {
                *c.refused.entry(code.to_string()).or_default() += 1;
            }
        }
    }
    c
}

fn record(fx: &Fx, tier: &str, model: &str) -> Counts {
    let key_id = credential::extract(None, Some(&key(2)))
        .unwrap()
        .cache_identity()
        .key_id()
        .unwrap()
        .to_string();
    let key = RecordKey {
        subject: "alice".into(),
        key_id: Some(key_id),
        tier: tier.into(),
        model: model.into(),
        backend: None,
        hour_start: hour_start_of(fx.host.now.get() / 1000),
    };
    let w = fx.root.worker.borrow();
    w.ledger.open_counts(&key).cloned().unwrap_or_default()
}

#[test]
fn the_events_of_a_run_add_up_to_the_ledger_request_by_request() {
    let fx = events_fx();
    let ok = Some(("200", "application/json", JSON));
    // Served (the third and fourth past the shadow limit of 2), one without usage (the
    // reservation), one the client left after the response headers (settled in on_log).
    let served = request(&fx, CHAT, BODY, ok, false);
    request(
        &fx,
        CHAT,
        BODY,
        Some(("200", "application/json", b"{}")),
        false,
    );
    request(&fx, CHAT, BODY, ok, false);
    let cut = request(&fx, CHAT, BODY, ok, true);
    // Refused: too large a reservation (400), the body naming another model (400), past the
    // limit of 4 (429), and a model the free tier may not use (403, at authorisation).
    request(
        &fx,
        CHAT,
        br#"{"model":"sim","messages":[],"max_tokens":5000}"#,
        None,
        false,
    );
    request(&fx, CHAT, br#"{"model":"big","messages":[]}"#, None, false);
    let limited = request(&fx, CHAT, BODY, ok, false);
    assert_eq!(fx.sent_to(limited).unwrap().status, 429);
    let forbidden = request(&fx, "/llm/big/v1/chat/completions", BODY, ok, false);
    assert_eq!(fx.sent_to(forbidden).unwrap().status, 403);
    // Not authenticated: not in the ledger, no event.
    let (id, h) = fx.http();
    fx.headers(id, &h, &[(":method", "POST"), (":path", CHAT)], true);
    h.on_log(&fx.host);

    let events = events(&fx);
    assert_eq!(events.len(), 8, "{events:#?}");
    let of = |model: &str| {
        add_up(
            events
                .iter()
                .map(|(_, e)| e)
                .filter(move |e| e["model"] == model),
        )
    };
    assert_eq!(of("sim"), record(&fx, "free", "sim"));
    assert_eq!(of("big"), record(&fx, "free", "big"));
    assert_eq!(of("sim").requests, 4);
    assert_eq!(of("big").refused.len(), 1, "{:?}", of("big"));
    let by_ctx = |ctx: u32| &events.iter().find(|(c, _)| *c == ctx).unwrap().1;
    assert_eq!(
        by_ctx(served),
        &json!({"user": PSEUDONYM, "key_id": record_key_id(), "subscription": null,
                "tier": "free", "model": "sim", "operation": "chat.completions",
                "forwarded": true, "decision": "allowed", "shadow": null,
                "input_tokens": 5, "output_tokens": 7, "cached_tokens": 3, "cost": "0"})
    );
    // The client left: the reservation stands (status 0 seen as no response read).
    assert_eq!(by_ctx(cut)["forwarded"], true);
    assert!(by_ctx(cut)["output_tokens"].as_u64().unwrap() > 0);
    assert_eq!(by_ctx(cut)["shadow"], "shadow_rate_limit_exceeded");
    assert_eq!(by_ctx(limited)["decision"], "rate_limit_exceeded");
    assert_eq!(by_ctx(limited)["forwarded"], false);
    // Never the subject's name, the key or its secret.
    for (_, e) in &events {
        let text = e.to_string();
        assert!(!text.contains("alice") && !text.contains(&key(2)), "{text}");
    }
}

fn record_key_id() -> String {
    credential::extract(None, Some(&key(2)))
        .unwrap()
        .cache_identity()
        .key_id()
        .unwrap()
        .to_string()
}

#[test]
fn without_the_policys_switch_no_event_is_written() {
    let fx = Fx::new();
    request(
        &fx,
        CHAT,
        BODY,
        Some(("200", "application/json", JSON)),
        false,
    );
    request(&fx, CHAT, br#"{"model":"big","messages":[]}"#, None, false);
    assert!(fx.host.set_properties.borrow().is_empty());
    assert_eq!(record(&fx, "free", "sim").requests, 1);
}

/// The one base URL: the upstream check at the response refuses an answer from another
/// cluster after settling what was reserved. The ledger counts both; one event says both.
#[test]
fn a_request_settled_then_refused_writes_one_event_saying_both() {
    let mut p = policy();
    p["observability"] = json!({"usageEvents": true});
    let fx = Fx::with(json!({"pauseHeadersForBody": true, "bootstrapPolicy": p}));
    fx.cache(&key(2), alice_with_pseudonym());
    let (id, h) = fx.http();
    let mut headers = chat(&key(2));
    headers[1].1 = "/v1/chat/completions".into();
    headers.retain(|(k, _)| *k != "content-length");
    assert_eq!(fx.headers(id, &h, &refs(&headers), false), Action::Pause);
    let body = br#"{"model":"gpt","messages":[],"max_tokens":5}"#;
    assert_eq!(fx.body(id, &h, body, true), Action::Continue);
    fx.host
        .properties
        .borrow_mut()
        .insert("xds.cluster_name".into(), "elsewhere".into());
    fx.host.enter(id);
    fx.host.set_map(
        Headers::Response,
        &[(":status", "200"), ("content-type", "application/json")],
    );
    assert_eq!(h.on_response_headers(&fx.host), Action::Pause);
    assert_eq!(fx.sent_to(id).unwrap().code(), "upstream_mismatch");
    h.on_log(&fx.host);
    h.on_done(&fx.host);
    let events = events(&fx);
    assert_eq!(events.len(), 1, "{events:?}");
    let e = &events[0].1;
    assert_eq!(
        (e["forwarded"].as_bool(), e["decision"].as_str()),
        (Some(true), Some("upstream_mismatch"))
    );
    // The reservation (no prompt: the cap of 5).
    assert_eq!(e["output_tokens"], 5, "the reservation: {e}");
    assert_eq!(add_up([e].into_iter()), record(&fx, "free", "gpt"));
}
