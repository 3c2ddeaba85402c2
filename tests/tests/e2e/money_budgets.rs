//! Money budgets across gateway replicas (issue 30): two Envoys with the release .wasm, each
//! with its own companion, one Redis, one PostgreSQL. `sim-model` costs 0.0001 per input token
//! and 0.0002 per output token; the `paid` tier may spend 0.05 a day. A user's concurrent
//! requests on both replicas are held to that one budget in money — the worst case reserved at
//! admission, the real cost settled — the answers say what is left (`x-ratelimit-*-cost`), a
//! request that could cost more than the whole budget is refused up front, `/v1/quota` shows
//! the budget in exact decimals, and the ledger charges exactly what the budget counted.
//!
//! Prints `money figure:` lines (admitted cost against the budget, Redis's count after the idle
//! leases went back, the ledger's cost): the overshoot the lead reports.

use crate::helpers::{Reply, client, sim_chat_at, start_replicated};
use maas_e2e::Stack;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};

const POLICY: &str = r#"
tiers:
  - name: paid
    level: 1
    groups: [g-paid]
    limits:
      requests: [{limit: 100000, window: 1d}]
      budgets: [{amount: "0.05", window: 1d}]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [paid]
    backend: simulator
    pricing: {input: "0.0001", output: "0.0002"}
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: spender-token, username: spender, groups: [g-paid]}
  - {token: big-token, username: big, groups: [g-paid]}
"#;

const REPLICAS: usize = 2;
/// The budget in nano-units.
const BUDGET: u64 = 50_000_000;
/// Nano-units per input and per output token.
const INPUT_PRICE: u64 = 100_000;
const OUTPUT_PRICE: u64 = 200_000;
const MAX_TOKENS: u64 = 10;
/// What one request may reserve at most: a prompt estimate of at most 10 tokens, and its cap.
const RESERVATION: u64 = 10 * INPUT_PRICE + MAX_TOKENS * OUTPUT_PRICE;

async fn start_stack() -> Arc<Stack> {
    start_replicated(
        POLICY,
        IDENTITIES,
        REPLICAS,
        Some(json!({"usage": {"reportIntervalMs": 500}})),
    )
    .await
}

async fn chat_at(stack: &Stack, replica: usize, token: &str, max_tokens: u64) -> Reply {
    sim_chat_at(stack, replica, token, max_tokens).await
}

/// The cost of an answer by its usage, in nano-units.
fn cost_of(r: &Reply) -> u64 {
    let u = &r.json()["usage"];
    let n = |k: &str| {
        u[k].as_u64()
            .unwrap_or_else(|| panic!("no {k}: {}", r.body))
    };
    n("prompt_tokens") * INPUT_PRICE + n("completion_tokens") * OUTPUT_PRICE
}

/// Nano-units as the decimal the API writes.
fn decimal(nanos: u64) -> String {
    maas_types::Money(nanos).to_string()
}

/// One user's spending: what was admitted (by the answers' usage) and refused.
#[derive(Debug, Default)]
struct Spent {
    admitted: u64,
    requests: u64,
    refused: u64,
}

impl Spent {
    fn record(&mut self, r: &Reply) {
        match r.status {
            200 => {
                assert_eq!(r.header("x-ratelimit-limit-cost"), Some("0.05"));
                assert!(
                    r.header("x-ratelimit-remaining-cost").is_some(),
                    "{:?}",
                    r.headers
                );
                self.admitted += cost_of(r);
                self.requests += 1;
            }
            429 => {
                let e = r.error(429);
                assert!(
                    e["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("for cost")),
                    "{}",
                    r.body
                );
                self.refused += 1;
            }
            other => panic!("unexpected {other}: {}", r.body),
        }
    }
}

/// Six clients at once on both replicas until each is refused three times in a row, then one
/// alternating every 250 ms while a request's worth is left (up to 8 s: a replica's unused
/// lease goes back when it idles): what was spent in all, and under the six clients.
async fn spend_until_refused(stack: &Arc<Stack>) -> (Spent, u64) {
    let mut tasks = Vec::new();
    for client_no in 0..6 {
        let stack = Arc::clone(stack);
        tasks.push(tokio::spawn(async move {
            let mut spent = Spent::default();
            let mut refused_in_a_row = 0;
            let mut i = client_no;
            while refused_in_a_row < 3 {
                let r = chat_at(&stack, i % REPLICAS, "spender-token", MAX_TOKENS).await;
                spent.record(&r);
                refused_in_a_row = if r.status == 429 {
                    refused_in_a_row + 1
                } else {
                    0
                };
                i += 1;
                assert!(spent.requests < 200, "never refused: {spent:?}");
            }
            spent
        }));
    }
    let mut total = Spent::default();
    for t in tasks {
        let s = t.await.expect("client task");
        total.admitted += s.admitted;
        total.requests += s.requests;
        total.refused += s.refused;
    }
    let concurrent = total.admitted;
    let deadline = Instant::now() + Duration::from_secs(8);
    let mut i = 0;
    while BUDGET.saturating_sub(total.admitted) >= RESERVATION && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
        total.record(&chat_at(stack, i % REPLICAS, "spender-token", MAX_TOKENS).await);
        i += 1;
    }
    (total, concurrent)
}

/// The ledger charges the answers' usage at the same prices, exactly; `/v1/quota` shows the
/// budget in exact decimals beside its counts in nano-units.
async fn ledger_and_quota_agree(stack: &Stack, spent: u64) {
    // The ledger charges the same prices: exactly what the answers' usage cost.
    let want = decimal(spent);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let usage: Value = client()
            .get(format!(
                "{}/v1/usage?groupBy=model",
                stack.companion_public_url()
            ))
            .bearer_auth("spender-token")
            .send()
            .await
            .expect("companion answers")
            .json()
            .await
            .expect("JSON");
        let cost = usage["data"][0]["cost"].as_str().unwrap_or("").to_string();
        if cost == want {
            eprintln!("money figure: the ledger charged {cost}, the answers' usage cost {want}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "ledger {usage} never charged {want}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // `/v1/quota`: the budget in exact decimals beside the counts in nano-units.
    let quota: Value = client()
        .get(format!("{}/v1/quota", stack.companion_public_url()))
        .bearer_auth("spender-token")
        .send()
        .await
        .expect("companion answers")
        .json()
        .await
        .expect("JSON");
    let row = quota["data"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["kind"] == "cost"))
        .unwrap_or_else(|| panic!("no cost row: {quota}"));
    assert_eq!(row["limit"], BUDGET, "{row}");
    assert_eq!(row["amounts"]["limit"], "0.05", "{row}");
    assert_eq!(row["window"], "1d", "{row}");
    let used = row["used"].as_u64().expect("used");
    assert_eq!(row["amounts"]["used"], decimal(used), "{row}");
    assert!(used >= spent, "{row}");
}

/// Six clients at once on both replicas until each is refused three times in a row, then one
/// client alternating for a few seconds (a replica's unused lease goes back when it idles):
/// the budget is spent to within one request of its end, never past it by more than a
/// reservation per replica (a lease's debt), Redis counts what was spent once the idle leases
/// are back, and the ledger charges exactly the same.
#[tokio::test]
async fn one_money_budget_holds_across_replicas_under_concurrency_and_the_ledger_agrees() {
    let stack = start_stack().await;
    let (total, concurrent) = spend_until_refused(&stack).await;
    eprintln!(
        "money figure: {} requests admitted costing {} ({} under six concurrent clients) of a {} \
         budget across {REPLICAS} replicas, {} refused",
        total.requests,
        decimal(total.admitted),
        decimal(concurrent),
        decimal(BUDGET),
        total.refused
    );
    assert!(
        total.admitted <= BUDGET + REPLICAS as u64 * RESERVATION,
        "spent within the budget and one reservation per replica: {total:?}"
    );
    assert!(
        total.admitted + RESERVATION > BUDGET,
        "the budget was usable to within one request of its end: {total:?}"
    );
    // Once the idle leases are back (idleReleaseMs + reportIntervalMs), Redis counts what was
    // spent, within what leases still out may hold.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let taken: u64 = stack
        .redis_keys("maas:lease:v1:*:cost:86400:*")
        .unwrap_or_default()
        .iter()
        .filter_map(|k| stack.redis_command(&["GET", k]).ok()?.int())
        .map(|v| u64::try_from(v).unwrap_or(0))
        .sum();
    eprintln!(
        "money figure: Redis counts {} for {} spent (over by {})",
        decimal(taken),
        decimal(total.admitted),
        decimal(taken.saturating_sub(total.admitted))
    );
    assert!(
        taken >= total.admitted && taken - total.admitted <= REPLICAS as u64 * RESERVATION,
        "Redis {taken} vs spent {}",
        total.admitted
    );
    ledger_and_quota_agree(&stack, total.admitted).await;
    tokio::task::spawn_blocking(move || stack.shutdown())
        .await
        .expect("shutdown");
}

/// A request whose worst case alone is above the whole budget never reaches the model: 400
/// `cost_exceeds_limit` (here 0.0002 × 1000 output tokens = 0.2 > 0.05), nothing counted; a
/// smaller one then goes through.
#[tokio::test]
async fn a_request_that_could_cost_more_than_the_budget_is_refused_up_front() {
    let stack = start_stack().await;
    let r = chat_at(&stack, 0, "big-token", 1000).await;
    let e = r.error(400);
    assert_eq!(e["code"], "cost_exceeds_limit", "{}", r.body);
    assert!(
        e["message"]
            .as_str()
            .is_some_and(|m| m.contains("allows 0.05 per 1d")),
        "{}",
        r.body
    );
    let r = chat_at(&stack, 1, "big-token", MAX_TOKENS).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let remaining = r.header("x-ratelimit-remaining-cost").expect("remaining");
    let left = maas_types::Money::parse(remaining)
        .expect("a decimal")
        .nanos();
    assert!(
        left < BUDGET && left + RESERVATION >= BUDGET,
        "only this request's reservation taken: {remaining}"
    );
    tokio::task::spawn_blocking(move || stack.shutdown())
        .await
        .expect("shutdown");
}
