//! The one base URL (`POST /v1/chat/completions`… with the model in the body; `GET /v1/models`):
//! the headers wait for the body, whose `model` names the model (by name or alias); the routing
//! header is set (a client's own copy never counts); the served name is given to the body; the
//! upstream check runs at the response; refusals never let the request go.

use super::*;

/// The test policy with aliases and a served name on `sim`.
fn aliased_policy() -> Value {
    let mut p = policy();
    p["models"][0]["aliases"] = json!(["publishers/llm/models/sim", "s"]);
    p["models"][0]["servedName"] = json!("org/sim-served");
    p
}

fn held() -> Fx {
    let fx = Fx::with(json!({"pauseHeadersForBody": true, "bootstrapPolicy": aliased_policy()}));
    fx.cache(&key(2), allow_alice());
    fx
}

fn one_url(path: &str, key: &str) -> Vec<(&'static str, String)> {
    vec![
        (":method", "POST".to_string()),
        (":path", path.to_string()),
        (":authority", "gw".to_string()),
        ("authorization", format!("Bearer {key}")),
        ("content-type", "application/json".to_string()),
        // The client's own routing header, naming a model it may not use.
        ("x-maas-model", "big".to_string()),
    ]
}

/// A request to the one base URL with `body`: its action at the body.
fn send_body(fx: &Fx, path: &str, body: &[u8]) -> (u32, Http, Action) {
    let (id, h) = fx.http();
    assert_eq!(
        fx.headers(id, &h, &refs(&one_url(path, &key(2))), false),
        Action::Pause,
        "the headers wait for the body"
    );
    assert_eq!(fx.phase(&h), "AwaitingModel");
    let a = fx.body(id, &h, body, true);
    (id, h, a)
}

fn routing(fx: &Fx) -> Option<String> {
    fx.host.map_value(Headers::Request, "x-maas-model")
}

#[test]
fn the_body_names_the_model_and_the_routing_header_is_set() {
    let fx = held();
    let body = br#"{"model":"s","messages":[{"role":"user","content":"hi"}],"max_tokens":5}"#;
    let (id, h, a) = send_body(&fx, "/v1/chat/completions", body);
    // The body callback lets the held headers go with it.
    assert_eq!(a, Action::Continue, "{:?}", fx.sent_to(id));
    assert!(fx.phase(&h).starts_with("Forwarding"));
    assert_eq!(
        routing(&fx).as_deref(),
        Some("sim"),
        "the body's, not the client's"
    );
    assert_eq!(fx.host.map_value(Headers::Request, "authorization"), None);
    // The backend gets its served name.
    let sent: Value = serde_json::from_slice(&fx.host.buffer(Body::Request)).unwrap();
    assert_eq!(sent["model"], "org/sim-served");
    assert_eq!(sent["max_tokens"], 5);
    // The reservation is the model's, as at its path prefix.
    assert!(fx.tokens_used("alice") > 5);
}

#[test]
fn the_served_name_is_given_at_the_path_prefix_too() {
    let fx = held();
    let (id, h) = fx.http();
    let mut headers = one_url(CHAT, &key(2));
    headers.retain(|(k, _)| *k != "x-maas-model");
    fx.headers(id, &h, &refs(&headers), false);
    let body = br#"{"model":"publishers/llm/models/sim","messages":[],"max_tokens":5}"#;
    assert_eq!(fx.body(id, &h, body, true), Action::Continue);
    let sent: Value = serde_json::from_slice(&fx.host.buffer(Body::Request)).unwrap();
    assert_eq!(sent["model"], "org/sim-served");
    assert_eq!(routing(&fx), None, "a path prefix routes by its path");
}

#[test]
fn refusals_at_the_body_never_let_the_request_go() {
    let cases: [(&[u8], u32, &str); 6] = [
        (br#"{"messages":[]}"#, 404, "model_not_found"),
        (br#"{"model":"nope","messages":[]}"#, 404, "model_not_found"),
        (
            br#"{"model":"org/sim-served","messages":[]}"#,
            404,
            "model_not_found",
        ),
        (
            br#"{"model":"big","messages":[]}"#,
            403,
            "model_not_allowed",
        ),
        (br#"{"model":"sim","model":"big"}"#, 400, "invalid_body"),
        (b"model=sim", 400, "invalid_body"),
    ];
    for (body, status, code) in cases {
        let fx = held();
        let (id, h, a) = send_body(&fx, "/v1/chat/completions", body);
        let what = String::from_utf8_lossy(body);
        assert_eq!(a, Action::Pause, "{what}");
        assert!(!fx.resumed(id), "{what}");
        assert_eq!(fx.phase(&h), "Refused", "{what}");
        let s = fx.sent_to(id).unwrap();
        assert_eq!((s.status, s.code().as_str()), (status, code), "{what}");
    }
    // An operation the model does not serve (Anthropic Messages for an OpenAI model).
    let fx = held();
    let (id, _, a) = send_body(&fx, "/v1/messages", br#"{"model":"sim","max_tokens":1}"#);
    assert_eq!(a, Action::Pause);
    assert_eq!(fx.sent_to(id).unwrap().code(), "operation_not_allowed");
}

#[test]
fn without_held_headers_the_one_url_is_refused_at_the_headers() {
    let fx = Fx::with(json!({"bootstrapPolicy": aliased_policy()}));
    fx.cache(&key(2), allow_alice());
    let (id, h) = fx.http();
    let a = fx.headers(
        id,
        &h,
        &refs(&one_url("/v1/chat/completions", &key(2))),
        false,
    );
    assert_eq!(a, Action::Pause);
    let s = fx.sent_to(id).unwrap();
    assert_eq!(
        (s.status, s.code().as_str()),
        (503, "body_routing_unavailable")
    );
    assert_eq!(fx.dispatches(), 0);
}

/// A provider model at the one base URL: its credential goes on the request, and the cluster
/// that answered is checked at the response (Envoy re-chooses the route only once the request
/// goes on): another cluster's answer never reaches the client.
#[test]
fn the_upstream_check_runs_at_the_response() {
    let body = br#"{"model":"gpt","messages":[],"max_tokens":5}"#;
    for (cluster, passes) in [
        (Some("outbound|443||api.openai.com"), true),
        (Some("elsewhere"), false),
        (None, false),
    ] {
        let fx = held();
        let (id, h, a) = send_body(&fx, "/v1/chat/completions", body);
        assert_eq!(a, Action::Continue, "{:?}", fx.sent_to(id));
        assert_eq!(routing(&fx).as_deref(), Some("gpt"));
        assert_eq!(
            fx.host
                .map_value(Headers::Request, "authorization")
                .as_deref(),
            Some("Bearer sk-provider")
        );
        if let Some(c) = cluster {
            fx.host
                .properties
                .borrow_mut()
                .insert("xds.cluster_name".into(), c.into());
        }
        fx.host.enter(id);
        fx.host.set_map(
            Headers::Response,
            &[(":status", "200"), ("content-type", "application/json")],
        );
        let a = h.on_response_headers(&fx.host);
        if passes {
            assert_eq!(a, Action::Continue);
            assert!(fx.sent_to(id).is_none());
        } else {
            assert_eq!(a, Action::Pause, "{cluster:?}");
            let s = fx.sent_to(id).unwrap();
            assert_eq!((s.status, s.code().as_str()), (503, "upstream_mismatch"));
        }
    }
}

#[test]
fn the_gateway_answers_the_list_of_the_callers_models() {
    let fx = held();
    let (id, h) = fx.http();
    let headers = [
        (":method", "GET"),
        (":path", "/v1/models"),
        ("authorization", &*format!("Bearer {}", key(2))),
    ];
    assert_eq!(fx.headers(id, &h, &headers, true), Action::Pause);
    let s = fx.sent_to(id).unwrap();
    assert_eq!(s.status, 200);
    let v: Value = serde_json::from_slice(&s.body).unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["sim", "gpt"], "alice's tier: not the premium model");
    let (id, h) = fx.http();
    let headers = [
        (":method", "GET"),
        (":path", "/v1/models/publishers/llm/models/sim"),
        ("authorization", &*format!("Bearer {}", key(2))),
    ];
    fx.headers(id, &h, &headers, true);
    let s = fx.sent_to(id).unwrap();
    assert_eq!(s.status, 200);
    assert_eq!(
        serde_json::from_slice::<Value>(&s.body).unwrap()["id"],
        "sim"
    );
}

/// A credential no cache holds: the body may come before or after the companion's answer;
/// either way the request goes on once both are known, to the body's model.
#[test]
fn the_callout_and_the_body_in_either_order() {
    let body = br#"{"model":"sim","messages":[],"max_tokens":5}"#;
    for body_first in [true, false] {
        let fx =
            Fx::with(json!({"pauseHeadersForBody": true, "bootstrapPolicy": aliased_policy()}));
        let (id, h) = fx.http();
        let headers = one_url("/v1/chat/completions", &key(2));
        assert_eq!(fx.headers(id, &h, &refs(&headers), false), Action::Pause);
        assert_eq!(fx.dispatches(), 1);
        if body_first {
            assert_eq!(fx.body(id, &h, body, true), Action::Pause);
            fx.answer(id, &h, Some(200), &alice());
            assert!(fx.resumed(id), "body first: the answer lets it go");
        } else {
            fx.answer(id, &h, Some(200), &alice());
            assert_eq!(fx.phase(&h), "AwaitingModel");
            assert_eq!(fx.body(id, &h, body, true), Action::Continue);
        }
        assert!(fx.phase(&h).starts_with("Forwarding"), "{}", fx.phase(&h));
        assert_eq!(routing(&fx).as_deref(), Some("sim"));
        assert!(fx.sent_to(id).is_none());
    }
}
