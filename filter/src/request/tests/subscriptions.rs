//! Subscriptions through the request's life (issue 15): selection (bound key, token with and
//! without `X-MaaS-Subscription`), the refusals, the header toward the backend, and the
//! subscription's own budgets per (subject, subscription, model).

use super::*;
use maas_types::subscription::counter_subject;

/// The test policy plus team-a (group team-a: sim, 300 tokens a minute, 5 requests) and
/// premium-sub (user bob: sim and big).
fn policy_with_subscriptions() -> Value {
    let mut p = policy();
    p["subscriptions"] = json!([
        {"name": "team-a", "priority": 1, "owner": {"groups": ["team-a"]},
         "models": [{"name": "sim", "tokenRateLimits": [{"limit": 300, "window": "1m"}],
                     "requestRateLimits": [{"limit": 5, "window": "1m"}]}]},
        {"name": "premium-sub", "priority": 5, "owner": {"users": ["bob"]},
         "models": [{"name": "sim", "tokenRateLimits": [{"limit": 5000, "window": "1m"}]},
                    {"name": "big", "tokenRateLimits": [{"limit": 5000, "window": "1m"}]}]}
    ]);
    p
}

fn fx() -> Fx {
    Fx::with(json!({"bootstrapPolicy": policy_with_subscriptions()}))
}

fn allow(subject: &str, groups: &[&str], subscription: Option<&str>) -> CachedAnswer {
    CachedAnswer::Allow(CachedIdentity {
        subject: subject.into(),
        groups: groups.iter().map(|g| g.to_string()).collect(),
        pinned_tier: None,
        subscription: subscription.map(str::to_string),
        pseudonym: None,
        key_scope: None,
    })
}

/// A whole chat request on `path` with `credential` and extra headers; the response sent
/// (refused) or `None` (forwarded).
fn call(fx: &Fx, credential: &str, path: &str, extra: &[(&'static str, &str)]) -> Option<Sent> {
    let mut h = chat(credential);
    for (k, v) in &mut h {
        if *k == ":path" {
            *v = path.to_string();
        }
    }
    for (k, v) in extra {
        h.push((k, v.to_string()));
    }
    let (id, http) = fx.http();
    let model = if path.starts_with("/llm/big") {
        "big"
    } else {
        "sim"
    };
    let body = format!(
        r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":50}}"#
    );
    if fx.headers(id, &http, &refs(&h), false) == Action::Continue {
        fx.body(id, &http, body.as_bytes(), true);
    }
    if fx.phase(&http).starts_with("Forwarding") {
        None
    } else {
        Some(
            fx.sent_to(id)
                .unwrap_or_else(|| panic!("no response in phase {}", fx.phase(&http))),
        )
    }
}

fn subscription_tokens(fx: &Fx, subject: &str, sub: &str, model: &str) -> u64 {
    let policy = fx.root.worker.borrow().policy.clone().unwrap();
    let tier = policy
        .subscription(sub)
        .unwrap()
        .limits_tier(model)
        .unwrap();
    limits::token_state(
        &fx.host.store,
        &[&tier],
        &counter_subject(subject, sub, model),
        fx.host.now.get() / 1000,
        limits::DEFAULT_COUNTER_SLOTS,
    )
    .map_or(0, |s| s.used)
}

/// An API key whose key id differs per `n` (the fixture's `key` shares one key id).
fn key_n(n: u8) -> String {
    maas_types::apikey::format_key(&[n; 12], &[n; 32]).1
}

const SIM: &str = "/llm/sim/v1/chat/completions";
const BIG: &str = "/llm/big/v1/chat/completions";

#[test]
fn a_bound_key_runs_under_its_subscription_and_the_backend_sees_only_the_gateways_header() {
    let fx = fx();
    fx.cache(&key(2), allow("alice", &["team-a"], Some("team-a")));
    let (id, h) = fx.http();
    let mut headers = chat(&key(2));
    headers.push(("x-maas-subscription", "premium-sub".into()));
    assert_eq!(fx.headers(id, &h, &refs(&headers), false), Action::Continue);
    // The client's value is removed and the selected subscription set.
    assert_eq!(
        fx.host
            .map_value(Headers::Request, "x-maas-subscription")
            .as_deref(),
        Some("team-a")
    );
    assert_eq!(fx.body(id, &h, BODY, true), Action::Continue);
    assert!(fx.phase(&h).starts_with("Forwarding"), "{}", fx.phase(&h));
    // Counted under (alice, team-a, sim), not in alice's own tier counters.
    assert!(subscription_tokens(&fx, "alice", "team-a", "sim") > 0);
    assert_eq!(fx.tokens_used("alice"), 0);
}

#[test]
fn a_subscriptions_budget_is_its_own_per_subscription_and_model() {
    // Both keys are alice's: one bound to team-a, one to premium-sub (alice listed there too).
    let mut p = policy_with_subscriptions();
    p["subscriptions"][1]["owner"]["users"] = json!(["bob", "alice"]);
    let fx = Fx::with(json!({"bootstrapPolicy": p}));
    fx.cache(&key(2), allow("alice", &["team-a"], Some("team-a")));
    fx.cache(&key_n(3), allow("alice", &["team-a"], Some("premium-sub")));
    // team-a: 300 tokens a minute, each request reserves the prompt estimate + 50.
    let mut admitted = 0;
    let refusal = loop {
        match call(&fx, &key(2), SIM, &[]) {
            None => admitted += 1,
            Some(s) => break s,
        }
        assert!(admitted < 10, "never limited");
    };
    assert!(admitted >= 1);
    assert_eq!(
        refusal.status,
        429,
        "{}",
        String::from_utf8_lossy(&refusal.body)
    );
    assert!(
        String::from_utf8_lossy(&refusal.body).contains("subscription:team-a"),
        "{}",
        String::from_utf8_lossy(&refusal.body)
    );
    // The same user's key under another subscription has its own budget.
    assert_eq!(call(&fx, &key_n(3), SIM, &[]), None);
    // And alice's own tier budget is untouched.
    assert_eq!(fx.tokens_used("alice"), 0);
}

#[test]
fn a_subscriptions_request_windows_apply() {
    // A token of team-a's: 5 requests a minute (the tier allows 3, but does not apply); the
    // token window is lifted so that only the request window binds.
    let mut p = policy_with_subscriptions();
    p["subscriptions"][0]["models"][0]["tokenRateLimits"][0]["limit"] = json!(100_000);
    let fx = Fx::with(json!({"bootstrapPolicy": p}));
    fx.cache("alice-token", allow("alice", &["team-a"], None));
    for n in 0..5 {
        assert_eq!(call(&fx, "alice-token", SIM, &[]), None, "request {n}");
    }
    let s = call(&fx, "alice-token", SIM, &[]).unwrap();
    assert_eq!(s.status, 429);
}

#[test]
fn a_token_names_its_subscription_or_gets_multiple_subscriptions() {
    let fx = fx();
    // bob has premium-sub (user) and team-a (group): both hold sim.
    fx.cache(
        "bob-token",
        allow("bob", &["system:authenticated", "team-a"], None),
    );
    let s = call(&fx, "bob-token", SIM, &[]).unwrap();
    assert_eq!(
        (s.status, s.code().as_str()),
        (403, "multiple_subscriptions")
    );
    assert!(String::from_utf8_lossy(&s.body).contains("X-MaaS-Subscription"));
    assert!(String::from_utf8_lossy(&s.body).contains("permission_error"));
    // Named (the last non-empty value wins).
    assert_eq!(
        call(
            &fx,
            "bob-token",
            SIM,
            &[
                ("x-maas-subscription", "gold"),
                ("x-maas-subscription", "premium-sub")
            ]
        ),
        None
    );
    assert!(subscription_tokens(&fx, "bob", "premium-sub", "sim") > 0);
    // Only premium-sub holds big: selected without the header.
    assert_eq!(call(&fx, "bob-token", BIG, &[]), None);
    // Refusals of a named one.
    let s = call(&fx, "bob-token", BIG, &[("x-maas-subscription", "team-a")]).unwrap();
    assert_eq!(
        (s.status, s.code().as_str()),
        (403, "model_not_in_subscription")
    );
    let unknown = call(&fx, "bob-token", SIM, &[("x-maas-subscription", "gold")]).unwrap();
    assert_eq!(
        (unknown.status, unknown.code().as_str()),
        (403, "not_found")
    );
    // Someone else's subscription: the very same answer, byte for byte.
    fx.cache(
        "alice-token",
        allow("alice", &["system:authenticated", "team-a"], None),
    );
    let others = call(
        &fx,
        "alice-token",
        SIM,
        &[("x-maas-subscription", "premium-sub")],
    )
    .unwrap();
    let unknown_to_alice =
        call(&fx, "alice-token", SIM, &[("x-maas-subscription", "gold")]).unwrap();
    assert_eq!((others.status, others.code().as_str()), (403, "not_found"));
    assert_eq!(others.body, unknown_to_alice.body);
    assert_eq!(others.body, unknown.body);
}

#[test]
fn a_token_without_a_subscription_for_the_model_follows_the_tiers() {
    let fx = fx();
    fx.cache(
        "carol-token",
        allow("carol", &["system:authenticated"], None),
    );
    let (id, h) = fx.http();
    let mut headers = chat("carol-token");
    headers.push(("x-maas-subscription", " ".into()));
    assert_eq!(fx.headers(id, &h, &refs(&headers), false), Action::Continue);
    assert_eq!(
        fx.host.map_value(Headers::Request, "x-maas-subscription"),
        None
    );
    assert_eq!(fx.body(id, &h, BODY, true), Action::Continue);
    assert!(fx.tokens_used("carol") > 0, "counted in her tier");
}

#[test]
fn a_key_whose_subscription_left_the_policy_is_refused_invalid_subscription() {
    let fx = fx();
    fx.cache(&key(2), allow("alice", &["team-a"], Some("old-sub")));
    let s = call(&fx, &key(2), SIM, &[]).unwrap();
    assert_eq!((s.status, s.code().as_str()), (403, "invalid_subscription"));
    // Bound to team-a but asking for big (not in team-a).
    fx.cache(&key_n(3), allow("alice", &["team-a"], Some("team-a")));
    let s = call(&fx, &key_n(3), BIG, &[]).unwrap();
    assert_eq!(
        (s.status, s.code().as_str()),
        (403, "model_not_in_subscription")
    );
}

#[test]
fn a_tier_only_policy_strips_the_header_and_ignores_it() {
    let fx = Fx::new();
    fx.cache(&key(2), allow_alice());
    let (id, h) = fx.http();
    let mut headers = chat(&key(2));
    headers.push(("x-maas-subscription", "anything".into()));
    assert_eq!(fx.headers(id, &h, &refs(&headers), false), Action::Continue);
    assert_eq!(
        fx.host.map_value(Headers::Request, "x-maas-subscription"),
        None
    );
    assert_eq!(fx.body(id, &h, BODY, true), Action::Continue);
    assert!(fx.phase(&h).starts_with("Forwarding"));
    assert!(fx.tokens_used("alice") > 0);
}

#[test]
fn a_refusal_under_a_subscription_is_in_the_ledger_under_its_stand_in_tier() {
    let fx = fx();
    fx.cache(&key(2), allow("alice", &["team-a"], Some("team-a")));
    let refusal = loop {
        if let Some(s) = call(&fx, &key(2), SIM, &[]) {
            break s;
        }
    };
    assert_eq!(refusal.status, 429);
    let key_id = credential::extract(None, Some(&key(2)))
        .unwrap()
        .cache_identity()
        .key_id()
        .map(str::to_string);
    let record = crate::ledger::RecordKey {
        subject: "alice".into(),
        key_id,
        tier: "subscription:team-a".into(),
        model: "sim".into(),
        backend: None,
        hour_start: maas_types::usage::hour_start_of(fx.host.now.get() / 1000),
    };
    let w = fx.root.worker.borrow();
    let counts = w.ledger.open_counts(&record).expect("no ledger record");
    assert_eq!(
        counts.refused.get("rate_limit_exceeded").copied(),
        Some(1),
        "{counts:?}"
    );
}
