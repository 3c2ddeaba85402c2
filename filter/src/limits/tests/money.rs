//! Money budgets (issue 30): a third counter kind in nano-units, reserved at admission with the
//! request's worst-case cost, settled to the real cost, refused when full (429) or when one
//! request could never fit (400 `cost_exceeds_limit`), reported beside tokens.

use super::*;

const NOW: u64 = 6_000_010;
/// A cent in nano-units.
const CENT: u64 = 10_000_000;

/// A tier with a 10-cent budget a minute (and a shadow 1-cent one a day when `shadow`).
fn budgeted(shadow: bool) -> Tier {
    let mut budgets = vec![json!({"amount": "0.10", "window": "1m"})];
    if shadow {
        budgets.push(json!({"amount": "0.01", "window": "1d", "shadow": true}));
    }
    PolicyDocument::from_value(json!({
        "tiers": [{"name": "paid", "level": 0, "groups": ["g"],
          "limits": {"requests": [{"limit": 100, "window": "1m"}], "budgets": budgets}}]
    }))
    .unwrap()
    .tiers[0]
        .clone()
}

fn admit_cost(s: &dyn SharedStore, t: &Tier, cost: u64, now: u64) -> Admission {
    let key = counter_key("alice", SLOTS);
    let tiers = [t];
    let ask = Ask {
        reserve_cost: cost,
        ..ask(&key, &tiers, "alice", 10, now)
    };
    admit_leased(s, &ask, None, None)
}

fn cost_used(s: &dyn SharedStore, now: u64) -> u64 {
    let key = counter_key("alice", SLOTS);
    lease_state(s, &key, "alice", Kind::Cost, 60, now).0
}

#[test]
fn the_worst_case_cost_is_reserved_then_settled_to_the_real_cost() {
    let s = MemStore::new();
    let t = budgeted(false);
    // Three requests that may cost 4 cents each: the third would pass 10 cents.
    let (r1, h1) = allowed(admit_cost(&s, &t, 4 * CENT, NOW));
    let cost = h1.cost.expect("the budget's window in the headers");
    assert_eq!((cost.limit, cost.used), (10 * CENT, 4 * CENT));
    let (_r2, _) = allowed(admit_cost(&s, &t, 4 * CENT, NOW));
    match admit_cost(&s, &t, 4 * CENT, NOW) {
        Admission::Limited { kind, tier, .. } => {
            assert_eq!(kind, Kind::Cost);
            assert_eq!(tier, "paid");
        }
        other => panic!("expected a 429 on the budget, got {other:?}"),
    }
    assert_eq!(cost_used(&s, NOW), 8 * CENT, "a refusal counts nothing");
    // The first cost 1 cent in the end: 3 cents back, and the third fits.
    settle(
        &s,
        &r1,
        Used {
            tokens: 10,
            cost: CENT,
        },
        NOW + 1,
    );
    assert_eq!(cost_used(&s, NOW + 1), 5 * CENT);
    let (_, h3) = allowed(admit_cost(&s, &t, 4 * CENT, NOW + 1));
    assert_eq!(h3.cost.map(|c| c.remaining()), Some(CENT));
    // Tokens and money settle each in its own unit.
    let headers = h3.headers(RateLimitHeaders::Openai);
    let get = |n: &str| {
        headers
            .iter()
            .find(|(k, _)| *k == n)
            .map(|(_, v)| v.as_str())
    };
    assert_eq!(get("x-ratelimit-limit-cost"), Some("0.1"));
    assert_eq!(get("x-ratelimit-remaining-cost"), Some("0.01"));
    assert_eq!(get("x-ratelimit-reset-cost"), Some("49s"));
    assert_eq!(get("x-ratelimit-limit-requests"), Some("100"));
    assert!(get("x-ratelimit-limit-tokens").is_none(), "no token window");
}

#[test]
fn a_request_that_could_cost_more_than_the_whole_budget_is_refused_up_front() {
    let s = MemStore::new();
    let t = budgeted(false);
    let refusal = admit_cost(&s, &t, 10 * CENT + 1, NOW)
        .into_refusal(RateLimitHeaders::Openai)
        .expect("refused");
    assert_eq!(refusal.deny, crate::response::Deny::CostExceedsLimit);
    assert!(
        refusal.message.contains("may cost up to 0.100000001")
            && refusal.message.contains("allows 0.1 per 1m"),
        "{}",
        refusal.message
    );
    assert_eq!(cost_used(&s, NOW), 0);
    // Exactly the budget fits.
    allowed(admit_cost(&s, &t, 10 * CENT, NOW));
}

#[test]
fn a_shadow_budget_counts_and_never_refuses() {
    let s = MemStore::new();
    let t = budgeted(true);
    let (_, _) = allowed(admit_cost(&s, &t, 0, NOW));
    // 2 cents: above the shadow cent a day, within the enforced 10 cents a minute.
    match admit_cost(&s, &t, 2 * CENT, NOW) {
        Admission::Allowed { shadowed, .. } => {
            let sh = shadowed.expect("the shadow budget would refuse");
            assert_eq!((sh.kind, sh.code), (Kind::Cost, "cost_exceeds_limit"));
        }
        other => panic!("expected allowed, got {other:?}"),
    }
    let (_, h) = allowed(admit_cost(&s, &t, CENT / 2, NOW));
    assert_eq!(
        h.cost.map(|c| c.limit),
        Some(10 * CENT),
        "shadow budgets are not in headers"
    );
}

#[test]
fn policies_without_budgets_reserve_and_report_no_money() {
    let s = MemStore::new();
    let t = tier();
    let key = counter_key("alice", SLOTS);
    let tiers = [&t];
    let ask = Ask {
        reserve_cost: 123,
        ..ask(&key, &tiers, "alice", 10, NOW)
    };
    let (r, h) = allowed(admit_leased(&s, &ask, None, None));
    assert!(h.cost.is_none());
    assert!(
        r.windows.iter().all(|(k, _, _)| *k == Kind::Tokens),
        "{r:?}"
    );
}
