//! Weighted token limits (tier / subscription `tokenWeights`), cached input tokens in the ledger
//! and the unmetered Anthropic `count_tokens` through the request's life.

use super::*;
use crate::ledger::RecordKey;
use maas_types::usage::hour_start_of;

/// The test policy with the free tier's output tokens weighing 4, and an Anthropic model.
fn weighted_policy() -> Value {
    let mut p = policy();
    p["tiers"][0]["tokenWeights"] = json!({"output": 4});
    p["models"].as_array_mut().unwrap().push(
        json!({"name": "claude", "path": "/llm/claude", "tiers": ["free"], "api": "anthropic"}),
    );
    p
}

fn fx_weighted() -> Fx {
    Fx::with(json!({"bootstrapPolicy": weighted_policy()}))
}

/// alice's request on `path` with `body`, answered `(content type, body)` when admitted; the
/// refusal when refused.
fn call(fx: &Fx, path: &str, body: &[u8], answer: (&str, &[u8])) -> Option<Sent> {
    fx.cache(&key(2), allow_alice());
    let (id, h) = fx.http();
    let mut headers = chat(&key(2));
    for (k, v) in &mut headers {
        if *k == ":path" {
            *v = path.to_string();
        }
    }
    fx.headers(id, &h, &refs(&headers), false);
    if fx.sent_to(id).is_none() {
        fx.body(id, &h, body, true);
    }
    if let Some(s) = fx.sent_to(id) {
        return Some(s);
    }
    assert!(fx.phase(&h).starts_with("Forwarding"), "{}", fx.phase(&h));
    fx.host.enter(id);
    fx.host.set_map(
        Headers::Response,
        &[(":status", "200"), ("content-type", answer.0)],
    );
    h.on_response_headers(&fx.host);
    fx.host.set_buffer(Body::Response, answer.1);
    h.on_response_body(&fx.host, answer.1.len(), true);
    fx.host.enter(id);
    h.on_log(&fx.host);
    h.on_done(&fx.host);
    None
}

fn ledger_counts(fx: &Fx, model: &str) -> crate::ledger::Counts {
    let key_id = credential::extract(None, Some(&key(2)))
        .unwrap()
        .cache_identity()
        .key_id()
        .map(str::to_string);
    let w = fx.root.worker.borrow();
    w.ledger
        .open_counts(&RecordKey {
            subject: "alice".into(),
            key_id,
            tier: "free".into(),
            model: model.into(),
            backend: None,
            hour_start: hour_start_of(fx.host.now.get() / 1000),
        })
        .cloned()
        .unwrap_or_default()
}

const USAGE_10_20: &[u8] = br#"{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":20,"total_tokens":30,"prompt_tokens_details":{"cached_tokens":6}}}"#;

#[test]
fn a_weighted_tier_reserves_and_settles_weighted_tokens_and_the_ledger_keeps_them_raw() {
    let fx = fx_weighted();
    fx.cache(&key(2), allow_alice());
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    fx.body(id, &h, BODY, true);
    // The prompt estimate (5 tokens: "role", "user", "content", "hi") weighs 1, max_tokens 50
    // weighs 4 each.
    let reserved = fx.tokens_used("alice");
    assert_eq!(reserved, 5 + 50 * 4);
    fx.host.enter(id);
    fx.host.set_map(
        Headers::Response,
        &[(":status", "200"), ("content-type", "application/json")],
    );
    h.on_response_headers(&fx.host);
    assert_eq!(
        fx.host
            .map_value(Headers::Response, "x-ratelimit-remaining-tokens")
            .as_deref(),
        Some("795")
    );
    fx.host.set_buffer(Body::Response, USAGE_10_20);
    h.on_response_body(&fx.host, USAGE_10_20.len(), true);
    // 10 prompt + 20 completion × 4.
    assert_eq!(fx.tokens_used("alice"), 90);
    let c = ledger_counts(&fx, "sim");
    assert_eq!(
        (
            c.requests,
            c.prompt_tokens,
            c.completion_tokens,
            c.cached_input_tokens
        ),
        (1, 10, 20, 6)
    );
    // The metrics keep raw tokens too.
    fx.flush();
    assert_eq!(
        fx.host.metric(&crate::metrics::series_name(
            &crate::metrics::TOKENS,
            &["output", "free", "none", "sim"]
        )),
        20
    );
}

#[test]
fn the_budget_is_exhausted_in_weighted_tokens() {
    // 1000 weighted tokens a minute; each request settles to 90 (and reserves 205): the
    // requests window (3) is lifted so that only tokens bind.
    let mut p = weighted_policy();
    p["tiers"][0]["limits"]["requests"][0]["limit"] = json!(100);
    let fx = Fx::with(json!({"bootstrapPolicy": p}));
    let mut admitted = 0u64;
    let refusal = loop {
        match call(&fx, CHAT, BODY, ("application/json", USAGE_10_20)) {
            None => admitted += 1,
            Some(s) => break s,
        }
        assert!(admitted < 20, "never limited");
    };
    // 90 × 9 = 810, and 810 + 205 > 1000: the tenth is refused (unweighted it would be 30 each).
    assert_eq!(admitted, 9);
    assert_eq!(refusal.status, 429);
    // Once the worker's folded refunds are written (its tick), the slot says the same.
    fx.write_folds();
    assert_eq!(fx.tokens_used("alice"), 810);
}

#[test]
fn a_reservation_above_a_window_only_when_weighted_is_tokens_exceed_limit() {
    let fx = fx_weighted();
    // 5 + 300 × 4 = 1205 > 1000 (unweighted 305 would fit).
    let body = br#"{"model":"sim","messages":[{"role":"user","content":"hi"}],"max_tokens":300}"#;
    let s = call(&fx, CHAT, body, ("application/json", USAGE_10_20)).unwrap();
    assert_eq!((s.status, s.code().as_str()), (400, "tokens_exceed_limit"));
    assert_eq!(fx.tokens_used("alice"), 0);
    // Without weights the same request fits.
    let plain = Fx::new();
    assert_eq!(
        call(&plain, CHAT, body, ("application/json", USAGE_10_20)),
        None
    );
}

#[test]
fn count_tokens_is_forwarded_as_a_request_with_no_tokens() {
    let fx = fx_weighted();
    let body = br#"{"model":"claude","messages":[{"role":"user","content":"hello there, how many tokens?"}]}"#;
    let answer: &[u8] = br#"{"input_tokens":14}"#;
    assert_eq!(
        call(
            &fx,
            "/llm/claude/v1/messages/count_tokens",
            body,
            ("application/json", answer)
        ),
        None
    );
    // Nothing reserved, nothing settled, no "no usage" warning counted.
    assert_eq!(fx.tokens_used("alice"), 0);
    fx.flush();
    assert_eq!(fx.host.metric(crate::metrics::MALFORMED_UPSTREAM), 0);
    // One request in the ledger, no tokens.
    let c = ledger_counts(&fx, "claude");
    assert_eq!(
        (c.requests, c.prompt_tokens, c.completion_tokens),
        (1, 0, 0)
    );
    // It counts in the request windows: 3 a minute.
    for _ in 0..2 {
        assert_eq!(
            call(
                &fx,
                "/llm/claude/v1/messages/count_tokens",
                body,
                ("application/json", answer)
            ),
            None
        );
    }
    let s = call(
        &fx,
        "/llm/claude/v1/messages/count_tokens",
        body,
        ("application/json", answer),
    )
    .unwrap();
    assert_eq!(s.status, 429);
    assert_eq!(fx.tokens_used("alice"), 0);
}

#[test]
fn a_subscription_models_weights_apply_to_its_own_windows() {
    let mut p = policy();
    p["subscriptions"] = json!([
        {"name": "team-a", "priority": 1, "owner": {"groups": ["team-a"]},
         "models": [{"name": "sim", "tokenRateLimits": [{"limit": 5000, "window": "1m"}],
                     "tokenWeights": {"input": 2, "output": 3}}]}
    ]);
    let fx = Fx::with(json!({"bootstrapPolicy": p}));
    fx.cache(
        &key(2),
        CachedAnswer::Allow(CachedIdentity {
            subject: "alice".into(),
            groups: vec!["team-a".into()],
            pinned_tier: None,
            subscription: Some("team-a".into()),
            pseudonym: None,
            key_scope: None,
        }),
    );
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    fx.body(id, &h, BODY, true);
    let used = || {
        let policy = fx.root.worker.borrow().policy.clone().unwrap();
        let tier = policy
            .subscription("team-a")
            .unwrap()
            .limits_tier("sim")
            .unwrap();
        limits::token_state(
            &fx.host.store,
            &[&tier],
            &maas_types::subscription::counter_subject("alice", "team-a", "sim"),
            fx.host.now.get() / 1000,
            limits::DEFAULT_COUNTER_SLOTS,
        )
        .map_or(0, |s| s.used)
    };
    // Prompt estimate 5 × 2 + max_tokens 50 × 3.
    assert_eq!(used(), 5 * 2 + 50 * 3);
    fx.host.enter(id);
    fx.host.set_map(
        Headers::Response,
        &[(":status", "200"), ("content-type", "application/json")],
    );
    h.on_response_headers(&fx.host);
    fx.host.set_buffer(Body::Response, USAGE_10_20);
    h.on_response_body(&fx.host, USAGE_10_20.len(), true);
    assert_eq!(used(), 10 * 2 + 20 * 3);
    // The tier's own windows are untouched.
    assert_eq!(fx.tokens_used("alice"), 0);
}

/// The test policy with prices on `sim` ($2.50 / $10 / $1.25 per million input / output /
/// cached input tokens) and a 1-cent budget a minute on the free tier (requests and tokens
/// lifted: only money binds).
fn priced_policy() -> Value {
    let mut p = policy();
    p["models"][0]["pricing"] =
        json!({"input": "0.0000025", "output": "0.00001", "cachedInput": "0.00000125"});
    p["tiers"][0]["limits"]["requests"][0]["limit"] = json!(100);
    p["tiers"][0]["limits"]["tokens"][0]["limit"] = json!(100_000);
    p["tiers"][0]["limits"]["budgets"] = json!([{"amount": "0.01", "window": "1m"}]);
    p
}

fn cost_used(fx: &Fx) -> u64 {
    let key = limits::counter_key("alice", limits::DEFAULT_COUNTER_SLOTS);
    limits::lease_state(
        &fx.host.store,
        &key,
        "alice",
        limits::Kind::Cost,
        60,
        fx.host.now.get() / 1000,
    )
    .0
}

#[test]
fn a_money_budget_reserves_the_worst_case_cost_and_settles_the_real_one() {
    let fx = Fx::with(json!({"bootstrapPolicy": priced_policy()}));
    fx.cache(&key(2), allow_alice());
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    fx.body(id, &h, BODY, true);
    // 5 prompt tokens at 2,500 nano + max_tokens 50 at 10,000 nano.
    assert_eq!(cost_used(&fx), 5 * 2_500 + 50 * 10_000);
    fx.host.enter(id);
    fx.host.set_map(
        Headers::Response,
        &[(":status", "200"), ("content-type", "application/json")],
    );
    h.on_response_headers(&fx.host);
    assert_eq!(
        fx.host
            .map_value(Headers::Response, "x-ratelimit-remaining-cost")
            .as_deref(),
        Some("0.0094875")
    );
    fx.host.set_buffer(Body::Response, USAGE_10_20);
    h.on_response_body(&fx.host, USAGE_10_20.len(), true);
    // 4 uncached + 6 cached input tokens and 20 output tokens at their prices.
    fx.write_folds();
    assert_eq!(cost_used(&fx), 4 * 2_500 + 6 * 1_250 + 20 * 10_000);
}

#[test]
fn the_money_budget_refuses_once_spent_and_a_request_that_could_never_fit_up_front() {
    let fx = Fx::with(json!({"bootstrapPolicy": priced_policy()}));
    // Each settles to 217,500 nano and reserves 512,500: 1 cent a minute.
    let mut admitted = 0u64;
    let refusal = loop {
        match call(&fx, CHAT, BODY, ("application/json", USAGE_10_20)) {
            None => admitted += 1,
            Some(s) => break s,
        }
        assert!(admitted < 100, "never limited");
    };
    // 217,500 × 44 = 9,570,000, and + 512,500 > 10,000,000: the 45th is refused (the 44th
    // fitted: 9,352,500 + 512,500).
    assert_eq!(admitted, 44);
    assert_eq!(refusal.status, 429);
    let body = String::from_utf8_lossy(&refusal.body).to_string();
    assert!(body.contains("rate limit reached for cost"), "{body}");
    // A cap whose worst case alone is above a cent: 400, nothing counted.
    let fx = Fx::with(json!({"bootstrapPolicy": priced_policy()}));
    let body = br#"{"model":"sim","messages":[{"role":"user","content":"hi"}],"max_tokens":1000}"#;
    let s = call(&fx, CHAT, body, ("application/json", USAGE_10_20)).unwrap();
    assert_eq!((s.status, s.code().as_str()), (400, "cost_exceeds_limit"));
    assert_eq!(cost_used(&fx), 0);
}

#[test]
fn a_subscriptions_prices_replace_the_models_and_no_budget_costs_nothing() {
    // Without a budget, prices change nothing: no cost window, no cost header.
    let mut p = policy();
    p["models"][0]["pricing"] = json!({"input": "1", "output": "1"});
    let fx = Fx::with(json!({"bootstrapPolicy": p}));
    assert_eq!(
        call(&fx, CHAT, BODY, ("application/json", USAGE_10_20)),
        None
    );
    assert_eq!(cost_used(&fx), 0);
    // A subscription's own prices and budget.
    let doc = maas_types::PolicyDocument::from_value(json!({
        "tiers": [{"name": "free", "level": 0, "groups": ["g"]}],
        "models": [{"name": "sim", "path": "/llm/sim", "tiers": ["free"],
                    "pricing": {"input": "1", "output": "1"}}],
        "subscriptions": [{"name": "team-a", "owner": {"groups": ["g"]},
            "models": [{"name": "sim", "tokenRateLimits": [{"limit": 1000, "window": "1m"}],
                        "budgets": [{"amount": "5", "window": "1d"}],
                        "pricing": {"input": "0.000001", "output": "0.000002"}}]}]
    }))
    .unwrap();
    let tier = doc.subscriptions[0].limits_tier("sim").unwrap();
    let op = crate::admission::OperationTraits::of(
        crate::operations::Operation::ChatCompletions,
        &doc.models[0],
    );
    let info = crate::request_body::inspect(BODY);
    let m = crate::admission::ask(&doc.models[0], &[&tier], Some(&info), op)
        .unwrap()
        .unwrap();
    assert_eq!(m.reserve_cost(), 5 * 1_000 + 50 * 2_000);
    // A tier's prices for the model replace the model's on that tier.
    let mut p = priced_policy();
    p["tiers"][0]["prices"] = json!({"sim": {"input": "0.000001", "output": "0.000002"}});
    let fx = Fx::with(json!({"bootstrapPolicy": p}));
    assert_eq!(
        call(&fx, CHAT, BODY, ("application/json", USAGE_10_20)),
        None
    );
    fx.write_folds();
    assert_eq!(cost_used(&fx), 10 * 1_000 + 20 * 2_000);
}
