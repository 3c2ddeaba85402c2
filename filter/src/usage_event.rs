//! Per-request usage events (issue 32; contract: docs/contracts.md "Usage events").
//!
//! With the policy's `observability.usageEvents`, every request the usage ledger counts (see
//! [`crate::ledger`]: settled, refused after authentication, or both) leaves ONE JSON object in
//! its stream's filter state — `set_property(["maas_event"])`, which Envoy keeps as
//! `wasm.maas_event` — at its end: at settlement or at its refusal. An access log whose CEL
//! filter is `'wasm.maas_event' in filter_state` writes it beside what Envoy knows (start time,
//! duration, status, upstream cluster). The request counts in the event exactly what it counts in
//! the ledger (one place records both), so a run's events add up to the ledger: `requests` =
//! events with `forwarded`, `refused[code]` = events whose `decision` or `shadow` is `code`, and
//! the token sums alike.
//!
//! The event names the user by the companion's keyed pseudonym (the authenticate answer's
//! `pseudonym`; `null` when the companion sent none), never the subject's name; it never holds
//! the prompt, the answer, a key secret or a token. Off (the default), it costs no host call.

use crate::operations::Operation;
use maas_types::PolicyDocument;
use serde::Serialize;

/// The filter-state name the filter sets (Envoy: `wasm.maas_event`).
pub const PROPERTY: &str = "maas_event";

/// The `decision` of a request that was not refused.
pub const ALLOWED: &str = "allowed";

/// Raw (unweighted) tokens of a settled request, as the ledger counts them; `cached` is part of
/// `input`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tokens {
    pub input: u64,
    pub output: u64,
    pub cached: u64,
}

/// What the usage ledger counted for one request, gathered until its event is written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counted {
    /// The ledger's tier when it was resolved for the refusal alone (a refusal at
    /// authorisation); else the request's own.
    pub tier: Option<String>,
    /// Forwarded and settled with these tokens (the ledger's `requests` and token sums).
    pub settled: Option<Tokens>,
    /// Refused with this error code (the ledger's `refused`).
    pub refused: Option<&'static str>,
    /// A shadow limit would have refused it (`shadow_rate_limit_exceeded`, …).
    pub shadow: Option<&'static str>,
    /// The event was handed to Envoy (once per request).
    pub written: bool,
}

/// Who and what the request was about, borrowed for the event.
#[derive(Debug, Clone, Copy)]
pub struct About<'a> {
    /// The user's pseudonym (the authenticate answer's); never the subject's name.
    pub user: Option<&'a str>,
    /// The ledger's tier: the tier the request ran on, `subscription:<S>` under a subscription.
    pub tier: &'a str,
    pub model: &'a str,
    pub operation: Option<Operation>,
    /// The API key's id (its public half); `None` for a token.
    pub key_id: Option<&'a str>,
}

/// The event as written (field order is the contract's).
#[derive(Serialize)]
struct Event<'a> {
    user: Option<&'a str>,
    key_id: Option<&'a str>,
    subscription: Option<&'a str>,
    tier: &'a str,
    model: &'a str,
    operation: &'static str,
    forwarded: bool,
    decision: &'a str,
    shadow: Option<&'a str>,
    input_tokens: u64,
    output_tokens: u64,
    cached_tokens: u64,
    cost: String,
}

/// The operation's name in events (the API's endpoint).
pub fn operation_name(op: Option<Operation>) -> &'static str {
    match op {
        Some(Operation::ChatCompletions) => "chat.completions",
        Some(Operation::Completions) => "completions",
        Some(Operation::Embeddings) => "embeddings",
        Some(Operation::Responses) => "responses",
        Some(Operation::Messages) => "messages",
        Some(Operation::CountTokens) => "messages.count_tokens",
        Some(Operation::Models) => "models",
        Some(Operation::Custom) | None => "other",
    }
}

/// The subscription a ledger tier names (`subscription:<S>`).
pub fn subscription_of(tier: &str) -> Option<&str> {
    tier.strip_prefix("subscription:")
}

/// The per-token billing rate the ledger charges a request of `tier` on `model` with: the
/// subscription model's `billingRate.perToken`, else none (`"0"`).
pub fn rate<'p>(policy: &'p PolicyDocument, tier: &str, model: &str) -> Option<&'p str> {
    policy
        .subscription(subscription_of(tier)?)?
        .model(model)?
        .billing_rate
        .as_ref()
        .map(|b| b.per_token.as_str())
}

/// The prices of `model` for a request on `tier`: its subscription model's `pricing`, else the
/// tier's `prices` for it, else the model's own.
pub fn pricing(policy: &PolicyDocument, tier: &str, model: &str) -> Option<maas_types::Pricing> {
    subscription_of(tier)
        .and_then(|s| policy.subscription(s))
        .and_then(|s| s.model(model))
        .and_then(|m| m.pricing)
        .or_else(|| {
            policy
                .tiers
                .iter()
                .find(|t| t.name == tier)
                .and_then(|t| t.pricing_of(model))
        })
        .or_else(|| {
            policy
                .models
                .iter()
                .find(|m| m.name == model)
                .and_then(|m| m.pricing)
        })
}

/// `tokens × rate` exactly, as a decimal without trailing zeros (the ledger's `cost`, as
/// `/v1/usage` prints it): `"0"` without a rate or for a rate that is not a decimal.
pub fn cost(rate: Option<&str>, tokens: u64) -> String {
    let Some(rate) = rate.filter(|r| maas_types::policy::is_decimal(r)) else {
        return "0".into();
    };
    let (int, frac) = rate.split_once('.').unwrap_or((rate, ""));
    // The rate's digits as one integer (scaled by 10^frac), times `tokens`, digit by digit
    // from the last (no overflow: at most 40 digits by the policy's validation).
    let mut out: Vec<u8> = Vec::with_capacity(int.len() + frac.len() + 20);
    let mut carry: u128 = 0;
    for d in int.bytes().chain(frac.bytes()).rev() {
        let v = u128::from(d.saturating_sub(b'0')) * u128::from(tokens) + carry;
        out.push(b'0' + (v % 10) as u8);
        carry = v / 10;
    }
    while carry > 0 {
        out.push(b'0' + (carry % 10) as u8);
        carry /= 10;
    }
    // `out` holds the digits from the last; the last `frac.len()` of them are the fraction.
    let frac_digits: String = out
        .iter()
        .take(frac.len())
        .rev()
        .map(|d| char::from(*d))
        .collect();
    let int_digits: String = out
        .iter()
        .skip(frac.len())
        .rev()
        .map(|d| char::from(*d))
        .collect();
    let int_digits = match int_digits.trim_start_matches('0') {
        "" => "0",
        s => s,
    };
    match frac_digits.trim_end_matches('0') {
        "" => int_digits.to_string(),
        f => format!("{int_digits}.{f}"),
    }
}

/// The event's JSON for what the ledger counted (`None` when it counted nothing).
pub fn build(policy: &PolicyDocument, about: &About<'_>, counted: &Counted) -> Option<Vec<u8>> {
    if counted.settled.is_none() && counted.refused.is_none() {
        return None;
    }
    let tokens = counted.settled.unwrap_or_default();
    let billed = tokens.input.saturating_add(tokens.output);
    let event = Event {
        user: about.user,
        key_id: about.key_id,
        subscription: subscription_of(about.tier),
        tier: about.tier,
        model: about.model,
        operation: operation_name(about.operation),
        forwarded: counted.settled.is_some(),
        decision: counted.refused.unwrap_or(ALLOWED),
        shadow: counted.shadow,
        input_tokens: tokens.input,
        output_tokens: tokens.output,
        cached_tokens: tokens.cached,
        cost: match rate(policy, about.tier, about.model) {
            Some(flat) => cost(Some(flat), billed),
            // Priced per kind of token (money budgets charge the same): the ledger's rule.
            None => pricing(policy, about.tier, about.model).map_or_else(
                || "0".into(),
                |p| {
                    maas_types::Money(p.charge(tokens.input, tokens.cached, tokens.output))
                        .to_string()
                },
            ),
        },
    };
    serde_json::to_vec(&event).ok()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn policy() -> PolicyDocument {
        PolicyDocument::from_value(json!({
            "tiers": [{"name": "free", "level": 0, "groups": ["g"]}],
            "models": [{"name": "sim", "path": "/llm/sim", "tiers": ["free"]}],
            "subscriptions": [
                {"name": "team-a", "owner": {"groups": ["g"]}, "priority": 1,
                 "models": [{"name": "sim", "tokenRateLimits": [{"limit": 1000, "window": "1m"}],
                             "billingRate": {"perToken": "0.000002"}}]},
                {"name": "team-b", "owner": {"groups": ["g"]}, "priority": 2,
                 "models": [{"name": "sim", "tokenRateLimits": [{"limit": 1000, "window": "1m"}]}]}
            ]
        }))
        .unwrap()
    }

    fn about<'a>(model: &'a str, tier: &'a str) -> About<'a> {
        About {
            user: Some("u-0123456789abcdef"),
            tier,
            model,
            operation: Some(Operation::ChatCompletions),
            key_id: Some("kid123"),
        }
    }

    fn parsed(bytes: Option<Vec<u8>>) -> Value {
        serde_json::from_slice(&bytes.unwrap()).unwrap()
    }

    #[test]
    fn a_settled_request_reports_its_tokens_and_the_ledgers_cost() {
        let counted = Counted {
            settled: Some(Tokens {
                input: 12,
                output: 3,
                cached: 4,
            }),
            shadow: Some("shadow_rate_limit_exceeded"),
            ..Counted::default()
        };
        let v = parsed(build(
            &policy(),
            &about("sim", "subscription:team-a"),
            &counted,
        ));
        assert_eq!(
            v,
            json!({"user": "u-0123456789abcdef", "key_id": "kid123", "subscription": "team-a",
                   "tier": "subscription:team-a", "model": "sim", "operation": "chat.completions",
                   "forwarded": true, "decision": "allowed",
                   "shadow": "shadow_rate_limit_exceeded", "input_tokens": 12,
                   "output_tokens": 3, "cached_tokens": 4, "cost": "0.00003"})
        );
    }

    #[test]
    fn a_refusal_reports_its_code_and_nothing_counted_reports_nothing() {
        let counted = Counted {
            refused: Some("rate_limit_exceeded"),
            ..Counted::default()
        };
        let no_user = About {
            user: None,
            ..about("sim", "free")
        };
        let v = parsed(build(&policy(), &no_user, &counted));
        assert_eq!(v["decision"], "rate_limit_exceeded");
        assert_eq!(v["forwarded"], false);
        assert_eq!(v["user"], Value::Null);
        assert_eq!(v["subscription"], Value::Null);
        assert_eq!(
            (v["input_tokens"].as_u64(), v["cost"].as_str()),
            (Some(0), Some("0"))
        );
        assert_eq!(build(&policy(), &no_user, &Counted::default()), None);
        // Settled, then refused at the response (the upstream check): both, as the ledger.
        let both = Counted {
            settled: Some(Tokens {
                input: 5,
                output: 0,
                cached: 0,
            }),
            ..counted
        };
        let v = parsed(build(&policy(), &no_user, &both));
        assert_eq!(
            (v["forwarded"].as_bool(), v["input_tokens"].as_u64()),
            (Some(true), Some(5))
        );
        assert_eq!(v["decision"], "rate_limit_exceeded");
    }

    #[test]
    fn odd_names_are_escaped_and_the_line_stays_one_json_object() {
        let odd = "m\"o\\d\ne\u{1}l</script>\u{2028}é";
        let counted = Counted {
            settled: Some(Tokens::default()),
            ..Counted::default()
        };
        let odd_about = About {
            user: Some("u-\"x"),
            ..about(odd, "subscription:t\"e\nam")
        };
        let bytes = build(&policy(), &odd_about, &counted).unwrap();
        assert!(
            !bytes.contains(&b'\n'),
            "one line: {}",
            String::from_utf8_lossy(&bytes)
        );
        assert!(!bytes.iter().any(|b| *b < 0x20), "no control byte");
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["model"], odd);
        assert_eq!(v["subscription"], "t\"e\nam");
        assert_eq!(v["user"], "u-\"x");
        // Spliced into the access log's line, it is still one JSON value.
        let line = format!(
            "{{\"event\":{},\"status\":200}}",
            String::from_utf8_lossy(&bytes)
        );
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["event"]["model"], odd);
    }

    #[test]
    fn cost_is_exact_and_normalised() {
        assert_eq!(cost(Some("0.000002"), 15), "0.00003");
        assert_eq!(cost(Some("0.000002"), 0), "0");
        assert_eq!(cost(Some("2"), 21), "42");
        assert_eq!(cost(Some("1.5"), 3), "4.5");
        assert_eq!(cost(Some("0.10"), 10), "1");
        assert_eq!(cost(Some("007.25"), 4), "29");
        assert_eq!(cost(None, 100), "0");
        assert_eq!(cost(Some("-1"), 100), "0");
        assert_eq!(cost(Some("1e-6"), 100), "0");
        // The largest rate the policy accepts times the most tokens a count can hold.
        let big = format!("{}.{}", "9".repeat(20), "9".repeat(20));
        let c = cost(Some(&big), u64::MAX);
        assert_eq!(
            c,
            "1844674407370955161499999999999999999999.81553255926290448385"
        );
    }

    #[test]
    fn the_rate_is_the_subscription_models_and_none_for_tiers() {
        let p = policy();
        assert_eq!(rate(&p, "subscription:team-a", "sim"), Some("0.000002"));
        assert_eq!(rate(&p, "subscription:team-b", "sim"), None);
        assert_eq!(rate(&p, "subscription:gone", "sim"), None);
        assert_eq!(rate(&p, "free", "sim"), None);
        assert_eq!(rate(&p, "subscription:team-a", "other"), None);
        // Prices per kind of token where there is no flat rate: the subscription's, else the
        // model's.
        let priced = PolicyDocument::from_value(json!({
            "tiers": [{"name": "free", "level": 0, "groups": ["g"]}],
            "models": [{"name": "sim", "path": "/llm/sim", "tiers": ["free"],
                        "pricing": {"input": "0.000003", "output": "0.000015"}}],
            "subscriptions": [{"name": "own", "owner": {"groups": ["g"]},
                "models": [{"name": "sim", "tokenRateLimits": [{"limit": 9, "window": "1m"}],
                            "pricing": {"input": "0.000001", "output": "0.000004"}}]}]
        }))
        .unwrap();
        assert_eq!(
            pricing(&priced, "free", "sim").map(|p| p.output.nanos()),
            Some(15_000)
        );
        assert_eq!(
            pricing(&priced, "subscription:own", "sim").map(|p| p.output.nanos()),
            Some(4_000)
        );
        assert_eq!(pricing(&priced, "free", "other"), None);
    }

    #[test]
    fn every_operation_has_a_name() {
        for (op, name) in [
            (Some(Operation::ChatCompletions), "chat.completions"),
            (Some(Operation::Messages), "messages"),
            (Some(Operation::Embeddings), "embeddings"),
            (None, "other"),
        ] {
            assert_eq!(operation_name(op), name);
        }
    }
}
