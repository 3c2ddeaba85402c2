//! Scopes through the request's life (issue 30): a request counts in its own counters and in
//! every scope it matches; the strictest binds, the refusal names the scope, and a refusal
//! anywhere leaves nothing counted anywhere; each scope is settled with the request.

use super::lease::{grants, lease_calls};
use super::*;
use crate::limits::Kind;
use maas_types::lease::LeaseRequest;

const SIM: &str = "/llm/sim/v1/chat/completions";
const ORG: &str = "\u{1f}scope\u{1f}acme\u{1f}";

/// The test policy plus two subscriptions of organisation acme (team-a: alice, team-c:
/// carol; 5 requests a minute each) and `scopes`.
fn policy_with(scopes: Value) -> Value {
    let mut p = policy();
    let sub = |name: &str, user: &str| {
        json!({"name": name, "owner": {"users": [user]},
               "tokenMetadata": {"organizationId": "acme"},
               "models": [{"name": "sim", "tokenRateLimits": [{"limit": 100000, "window": "1m"}],
                           "requestRateLimits": [{"limit": 5, "window": "1m"}]}]})
    };
    p["subscriptions"] = json!([sub("team-a", "alice"), sub("team-c", "carol")]);
    p["scopes"] = scopes;
    p
}

fn allow(subject: &str, subscription: &str) -> CachedAnswer {
    CachedAnswer::Allow(CachedIdentity {
        subject: subject.into(),
        groups: vec![],
        pinned_tier: None,
        subscription: Some(subscription.into()),
        pseudonym: None,
        key_scope: None,
    })
}

/// An API key whose key id differs per `n`.
fn key_n(n: u8) -> String {
    maas_types::apikey::format_key(&[n; 12], &[n; 32]).1
}

fn fx(scopes: Value, extra: Value) -> Fx {
    fx_of(policy_with(scopes), extra)
}

fn fx_of(policy: Value, extra: Value) -> Fx {
    let mut cfg = json!({"bootstrapPolicy": policy});
    for (k, v) in extra.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    let fx = Fx::with(cfg);
    fx.cache(&key_n(1), allow("alice", "team-a"));
    fx.cache(&key_n(2), allow("alice", "team-a"));
    fx.cache(&key_n(3), allow("carol", "team-c"));
    fx
}

/// A whole chat request with `credential` (max_tokens 50): the response sent (refused) or
/// `None` (forwarded), and the request.
fn call(fx: &Fx, credential: &str) -> (Option<Sent>, u32, Http) {
    let mut h = chat(credential);
    for (k, v) in &mut h {
        if *k == ":path" {
            *v = SIM.to_string();
        }
    }
    let (id, http) = fx.http();
    let body = br#"{"model":"sim","messages":[{"role":"user","content":"hi"}],"max_tokens":50}"#;
    if fx.headers(id, &http, &refs(&h), false) == Action::Continue {
        fx.body(id, &http, body, true);
    }
    let sent = if fx.phase(&http).starts_with("Forwarding") || fx.phase(&http) == "Leasing" {
        None
    } else {
        Some(
            fx.sent_to(id)
                .unwrap_or_else(|| panic!("no response in phase {}", fx.phase(&http))),
        )
    };
    (sent, id, http)
}

/// (count) of `subject`'s counter of `kind` per minute now.
fn count(fx: &Fx, subject: &str, kind: Kind) -> u64 {
    limits::lease_state(
        &fx.host.store,
        &limits::counter_key(subject, limits::DEFAULT_COUNTER_SLOTS),
        subject,
        kind,
        60,
        fx.host.now.get() / 1000,
    )
    .0
}

fn own(user: &str, sub: &str) -> String {
    maas_types::subscription::counter_subject(user, sub, "sim")
}

const ORG_3_REQUESTS: &str = r#"[{"name": "acme", "match": {"organization": "acme"},
    "limits": {"requests": [{"limit": 3, "window": "1m"}]}}]"#;

#[test]
fn an_organisations_limit_binds_across_its_users_and_names_the_scope() {
    let fx = fx(serde_json::from_str(ORG_3_REQUESTS).unwrap(), json!({}));
    assert!(call(&fx, &key_n(1)).0.is_none());
    assert!(call(&fx, &key_n(3)).0.is_none());
    assert!(call(&fx, &key_n(1)).0.is_none());
    assert_eq!(count(&fx, ORG, Kind::Requests), 3);
    // carol has 4 of her own 5 left, but the organisation's 3 are spent.
    let sent = call(&fx, &key_n(3)).0.expect("refused");
    assert_eq!(sent.status, 429);
    let body = String::from_utf8_lossy(&sent.body);
    assert!(body.contains("scope acme"), "{body}");
    assert!(body.contains("rate_limit_exceeded"), "{body}");
    // Nothing counted anywhere for the refused request.
    assert_eq!(count(&fx, ORG, Kind::Requests), 3);
    assert_eq!(count(&fx, &own("carol", "team-c"), Kind::Requests), 1);
}

#[test]
fn a_request_its_own_limit_refuses_is_taken_back_out_of_its_scopes() {
    let scopes = json!([{"name": "acme", "match": {"organization": "acme"},
        "limits": {"requests": [{"limit": 100, "window": "1m"}],
                   "tokens": [{"limit": 100000, "window": "1m"}]}}]);
    let mut p = policy_with(scopes);
    // alice's subscription: 150 tokens a minute (each request reserves its 50 and the prompt).
    p["subscriptions"][0]["models"][0]["tokenRateLimits"] = json!([{"limit": 150, "window": "1m"}]);
    let fx = fx_of(p, json!({}));
    for _ in 0..2 {
        assert!(call(&fx, &key_n(1)).0.is_none());
    }
    let tokens = count(&fx, ORG, Kind::Tokens);
    assert!(tokens > 100);
    // The third does not fit alice's own tokens (decided at admission, after the scope
    // counted it)...
    let sent = call(&fx, &key_n(1)).0.expect("refused");
    assert_eq!(sent.status, 429);
    assert!(String::from_utf8_lossy(&sent.body).contains("subscription:team-a"));
    // ... and is taken back out of the organisation.
    assert_eq!(count(&fx, ORG, Kind::Requests), 2);
    assert_eq!(count(&fx, ORG, Kind::Tokens), tokens);
}

#[test]
fn a_scope_per_key_counts_each_key_of_a_user_apart() {
    let scopes = json!([{"name": "per-key", "per": "key",
        "limits": {"requests": [{"limit": 2, "window": "1m"}]}}]);
    let fx = fx(scopes, json!({}));
    assert!(call(&fx, &key_n(1)).0.is_none());
    assert!(call(&fx, &key_n(1)).0.is_none());
    let sent = call(&fx, &key_n(1)).0.expect("the key's 2 are spent");
    assert!(String::from_utf8_lossy(&sent.body).contains("scope per-key"));
    // alice's other key has its own 2.
    assert!(call(&fx, &key_n(2)).0.is_none());
    assert_eq!(count(&fx, &own("alice", "team-a"), Kind::Requests), 3);
}

#[test]
fn a_too_large_request_for_a_scope_is_400_naming_it() {
    let scopes = json!([{"name": "small", "match": {"models": ["sim"]},
        "limits": {"tokens": [{"limit": 20, "window": "1m"}]}}]);
    let fx = fx(scopes, json!({}));
    let sent = call(&fx, &key_n(1)).0.expect("refused");
    assert_eq!(sent.status, 400);
    let body = String::from_utf8_lossy(&sent.body);
    assert!(
        body.contains("tokens_exceed_limit") && body.contains("scope small"),
        "{body}"
    );
    assert_eq!(count(&fx, &own("alice", "team-a"), Kind::Requests), 0);
}

#[test]
fn a_scopes_reservation_settles_to_the_usage() {
    let scopes = json!([{"name": "acme", "match": {"organization": "acme"},
        "limits": {"tokens": [{"limit": 100000, "window": "1m"}]}}]);
    let fx = fx(scopes, json!({}));
    let (sent, id, h) = call(&fx, &key_n(1));
    assert!(sent.is_none());
    assert!(count(&fx, ORG, Kind::Tokens) > 50, "reserved the cap");
    fx.host.enter(id);
    fx.host.set_map(
        Headers::Response,
        &[(":status", "200"), ("content-type", "application/json")],
    );
    assert_eq!(h.on_response_headers(&fx.host), Action::Continue);
    let json = br#"{"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#;
    fx.host.set_buffer(Body::Response, json);
    h.on_response_body(&fx.host, json.len(), true);
    assert!(fx.phase(&h).starts_with("Settled"));
    assert_eq!(count(&fx, ORG, Kind::Tokens), 12);
    // Once: the end of the stream changes nothing.
    h.on_done(&fx.host);
    assert_eq!(count(&fx, ORG, Kind::Tokens), 12);
}

#[test]
fn a_shadow_scope_refuses_nothing_and_counts_its_would_be_refusals() {
    let scopes = json!([{"name": "trial", "limits": {"requests": [{"limit": 1, "window": "1m", "shadow": true}]}}]);
    let fx = fx(scopes, json!({}));
    for _ in 0..3 {
        assert!(call(&fx, &key_n(1)).0.is_none());
    }
    fx.flush();
    assert_eq!(fx.host.metric("maas_shadow_refusals_total"), 2);
}

#[test]
fn with_global_limits_a_scope_leases_its_own_counter_and_nothing_counts_while_it_waits() {
    let mut fx = fx(
        serde_json::from_str(ORG_3_REQUESTS).unwrap(),
        json!({"limits": {"global": {"replicaId": "gw-a", "replicas": 1}}}),
    );
    let (sent, id, h) = call(&fx, &key_n(1));
    assert!(sent.is_none());
    assert_eq!(fx.phase(&h), "Leasing");
    // The scope is asked first: its subject, its limit.
    let d = lease_calls(&fx).pop().expect("a lease callout");
    let req: LeaseRequest = serde_json::from_slice(d.body.as_deref().unwrap()).unwrap();
    assert!(req.items.iter().all(|i| i.subject == ORG), "{req:?}");
    assert_eq!(req.items.first().map(|i| i.limit), Some(3));
    assert_eq!(count(&fx, &own("alice", "team-a"), Kind::Requests), 0);
    fx.answer(id, &h, Some(200), &grants(&req, |i| (i.want, i.want)));
    // Then its own counters' lease (the root's next flight), with the scope's count taken
    // back meanwhile.
    assert_eq!(fx.phase(&h), "Leasing");
    assert_eq!(count(&fx, ORG, Kind::Requests), 0);
    fx.host.now.set(fx.host.now.get() + crate::worker::TICK_MS);
    fx.root.tick(&fx.host);
    let d = lease_calls(&fx).pop().expect("a second lease callout");
    let req: LeaseRequest = serde_json::from_slice(d.body.as_deref().unwrap()).unwrap();
    assert!(
        req.items
            .iter()
            .all(|i| i.subject == own("alice", "team-a")),
        "{req:?}"
    );
    let answer = grants(&req, |i| (i.want, i.want));
    fx.host.enter(fx.root.id);
    fx.host
        .set_map(Headers::CallResponse, &[(":status", "200")]);
    fx.host.set_buffer(Body::CallResponse, &answer);
    fx.root.on_call_response(&fx.host, d.token, answer.len());
    assert!(fx.resumed(id));
    assert!(fx.phase(&h).starts_with("Forwarding"), "{}", fx.phase(&h));
    assert_eq!(count(&fx, ORG, Kind::Requests), 1);
    assert_eq!(count(&fx, &own("alice", "team-a"), Kind::Requests), 1);
}

/// The response headers of forwarded request `id`.
fn respond(fx: &Fx, id: u32, h: &Http) {
    fx.host.enter(id);
    fx.host.set_map(
        Headers::Response,
        &[(":status", "200"), ("content-type", "application/json")],
    );
    assert_eq!(h.on_response_headers(&fx.host), Action::Continue);
}

#[test]
fn the_rate_limit_headers_say_the_tightest_window_of_the_request_and_its_scopes() {
    let fx = fx(serde_json::from_str(ORG_3_REQUESTS).unwrap(), json!({}));
    let (_, id, h) = call(&fx, &key_n(1));
    respond(&fx, id, &h);
    // The organisation's 3 bind before alice's own 5.
    assert_eq!(
        fx.host
            .map_value(Headers::Response, "x-ratelimit-limit-requests")
            .as_deref(),
        Some("3")
    );
    assert_eq!(
        fx.host
            .map_value(Headers::Response, "x-ratelimit-remaining-requests")
            .as_deref(),
        Some("2")
    );
    assert!(
        fx.host
            .map_value(Headers::Response, limits::QUOTA_WARNING_HEADER)
            .is_none()
    );
    call(&fx, &key_n(3));
    let (_, id, h) = call(&fx, &key_n(1));
    respond(&fx, id, &h);
    // 3 of 3: past the scope's 95 % (its default warnAt), though alice used 2 of her 5.
    let warning = fx
        .host
        .map_value(Headers::Response, limits::QUOTA_WARNING_HEADER)
        .unwrap_or_default();
    assert!(
        warning.starts_with("threshold=95, used=100, kind=requests"),
        "{warning}"
    );
}

#[test]
fn a_later_scope_refusing_takes_the_request_back_out_of_the_earlier_ones() {
    let scopes = json!([
        {"name": "wide", "limits": {"requests": [{"limit": 100, "window": "1m"}]}},
        {"name": "narrow", "match": {"subscriptions": ["team-a"]},
         "limits": {"requests": [{"limit": 1, "window": "1m"}]}}
    ]);
    let fx = fx(scopes, json!({}));
    let wide = "\u{1f}scope\u{1f}wide\u{1f}";
    assert!(call(&fx, &key_n(1)).0.is_none());
    assert_eq!(count(&fx, wide, Kind::Requests), 1);
    let sent = call(&fx, &key_n(1)).0.expect("narrow's 1 is spent");
    assert!(String::from_utf8_lossy(&sent.body).contains("scope narrow"));
    assert_eq!(
        count(&fx, wide, Kind::Requests),
        1,
        "taken back out of wide"
    );
    // carol (team-c) is in wide only.
    assert!(call(&fx, &key_n(3)).0.is_none());
    assert_eq!(count(&fx, wide, Kind::Requests), 2);
}

/// An API key's own limits (set at mint, in the authenticate answer): one counter per key,
/// binding below the subscription's, named in the refusal; the owner's other key is not held.
#[test]
fn a_keys_own_limits_bind_per_key_and_are_named() {
    let fx = fx(json!([]), json!({}));
    let limited = CachedAnswer::Allow(CachedIdentity {
        key_scope: Some(Box::new(maas_types::Scope::of_key(
            serde_json::from_value(json!({"requests": [{"limit": 2, "window": "1m"}]})).unwrap(),
        ))),
        ..match allow("alice", "team-a") {
            CachedAnswer::Allow(id) => id,
            CachedAnswer::Deny { .. } => unreachable!(),
        }
    });
    fx.cache(&key_n(1), limited);
    let key1 = maas_types::apikey::parse(&key_n(1))
        .unwrap()
        .key_id
        .to_string();
    let subject = format!("\u{1f}scope\u{1f}key\u{1f}k:{key1}");
    assert!(call(&fx, &key_n(1)).0.is_none());
    assert!(call(&fx, &key_n(1)).0.is_none());
    assert_eq!(count(&fx, &subject, Kind::Requests), 2);
    let sent = call(&fx, &key_n(1)).0.expect("refused");
    assert_eq!(sent.status, 429);
    let body = String::from_utf8_lossy(&sent.body);
    assert!(body.contains("this API key's own limits"), "{body}");
    // Nothing counted for the refusal; alice's subscription has 3 of its 5 left for key 2.
    assert_eq!(count(&fx, &subject, Kind::Requests), 2);
    assert_eq!(count(&fx, &own("alice", "team-a"), Kind::Requests), 2);
    for _ in 0..3 {
        assert!(call(&fx, &key_n(2)).0.is_none());
    }
    assert_eq!(call(&fx, &key_n(2)).0.expect("refused").status, 429);
}

/// A key's limits survive the shared cache: encoded with the entry, decoded the same.
#[test]
fn a_keys_own_limits_round_trip_through_the_shared_cache() {
    let limits: maas_types::Limits = serde_json::from_value(json!({
        "tokens": [{"limit": 1000, "window": "1d"}],
        "budgets": [{"amount": "2.50", "window": "30d"}]}))
    .unwrap();
    let id = CachedIdentity {
        key_scope: Some(Box::new(maas_types::Scope::of_key(limits))),
        ..match allow("alice", "team-a") {
            CachedAnswer::Allow(id) => id,
            CachedAnswer::Deny { .. } => unreachable!(),
        }
    };
    let answer = CachedAnswer::Allow(id);
    let bytes = crate::cache::encode(&answer, &[1; 16], &[2; 32], 99);
    let entry = crate::cache::decode(&bytes).expect("decodes");
    assert_eq!(entry.answer, answer);
    // A truncated entry (the limits cut) is a miss, never a key without its limits.
    assert!(crate::cache::decode(bytes.get(..bytes.len() - 3).unwrap()).is_none());
}

/// A key minted with a money budget: the worst-case cost is reserved in the key's own
/// counter; a request whose worst case exceeds it is a 400 naming the key's limits.
#[test]
fn a_keys_own_money_budget_is_reserved_and_a_too_costly_request_names_it() {
    let mut p = policy_with(json!([]));
    p["models"][0]["pricing"] = json!({"input": "0.0000025", "output": "0.00001"});
    let fx = fx_of(p, json!({}));
    let with_budget = |amount: &str| {
        CachedAnswer::Allow(CachedIdentity {
            key_scope: Some(Box::new(maas_types::Scope::of_key(
                serde_json::from_value(json!({"budgets": [{"amount": amount, "window": "1d"}]}))
                    .unwrap(),
            ))),
            ..match allow("alice", "team-a") {
                CachedAnswer::Allow(id) => id,
                CachedAnswer::Deny { .. } => unreachable!(),
            }
        })
    };
    fx.cache(&key_n(1), with_budget("1"));
    fx.cache(&key_n(2), with_budget("0.0001"));
    assert!(call(&fx, &key_n(1)).0.is_none());
    let key1 = maas_types::apikey::parse(&key_n(1))
        .unwrap()
        .key_id
        .to_string();
    let subject = format!("\u{1f}scope\u{1f}key\u{1f}k:{key1}");
    let reserved = limits::lease_state(
        &fx.host.store,
        &limits::counter_key(&subject, limits::DEFAULT_COUNTER_SLOTS),
        &subject,
        Kind::Cost,
        86_400,
        fx.host.now.get() / 1000,
    )
    .0;
    // At least max_tokens 50 at 10,000 nano each.
    assert!(reserved >= 500_000, "{reserved}");
    let sent = call(&fx, &key_n(2)).0.expect("refused");
    assert_eq!(sent.status, 400);
    let body = String::from_utf8_lossy(&sent.body);
    assert!(body.contains("this API key's own limits"), "{body}");
}
