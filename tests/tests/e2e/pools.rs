//! A subscription's pool across gateway replicas (issue 30): two Envoys with the release .wasm,
//! each with its own companion, one Redis, one PostgreSQL. Subscription `team` has `pool: true`:
//! its 30 requests a day on `sim-model` are one budget for all its users. Three users calling
//! at once on both replicas are held to those 30 together — never more, and the whole pool is
//! usable — `/v1/quota` shows each of them the pool's count, and a 429 names the subscription.
//! Subscription `solo` (no pool) keeps the reference's rule: each user has their own budget.
//!
//! Prints a `pool figure:` line (requests admitted against the pool's limit): the overshoot the
//! lead reports.

use crate::helpers::{
    Reply, admit_the_rest, admitted_per_user, quota_of, sim_chat_at, start_replicated,
    subscription_key,
};
use maas_e2e::Stack;
use serde_json::Value;
use std::sync::Arc;

const POLICY: &str = r#"
tiers:
  - name: free
    level: 0
    groups: [system:authenticated]
    limits:
      tokens: [{limit: 1000000, window: 1d}]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [free]
    backend: simulator
subscriptions:
  - name: team
    pool: true
    owner: {groups: [team]}
    models:
      - name: sim-model
        tokenRateLimits: [{limit: 1000000, window: 1d}]
        requestRateLimits: [{limit: 30, window: 1d}]
  - name: solo
    owner: {groups: [team]}
    models:
      - name: sim-model
        tokenRateLimits: [{limit: 1000000, window: 1d}]
        requestRateLimits: [{limit: 4, window: 1d}]
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: alice-token, username: alice, groups: [system:authenticated, team]}
  - {token: bob-token, username: bob, groups: [system:authenticated, team]}
  - {token: carol-token, username: carol, groups: [system:authenticated, team]}
"#;

const USERS: [&str; 3] = ["alice-token", "bob-token", "carol-token"];
const REPLICAS: usize = 2;
const POOL: u64 = 30;

async fn start_stack() -> Arc<Stack> {
    start_replicated(POLICY, IDENTITIES, REPLICAS, None).await
}

/// A key of `token`'s user bound to `subscription`.
async fn key_for(stack: &Stack, token: &str, subscription: &str) -> String {
    subscription_key(stack, token, subscription, &format!("{subscription}-key")).await
}

async fn chat_at(stack: &Stack, replica: usize, key: &str) -> Reply {
    sim_chat_at(stack, replica, key, 8).await
}

/// Whether `r` was admitted; a refusal must be the subscription's request limit.
fn admitted(r: &Reply, subscription: &str) -> bool {
    match r.status {
        200 => true,
        429 => {
            let e = r.error(429);
            let m = e["message"].as_str().unwrap_or_default();
            assert!(
                m.contains("for requests") && m.contains(&format!("subscription:{subscription}")),
                "{}",
                r.body
            );
            false
        }
        other => panic!("unexpected {other}: {}", r.body),
    }
}

/// The `/v1/quota` requests row of a key bound to a subscription.
async fn quota_requests(stack: &Stack, key: &str) -> Value {
    let quota = quota_of(stack, key).await;
    quota["data"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["kind"] == "requests"))
        .cloned()
        .unwrap_or_else(|| panic!("no requests row: {quota}"))
}

/// Three users at once on both replicas spend one pool: together exactly its 30 requests (none
/// over, the whole pool usable once a replica's idle lease went back), each of them served
/// some, and each sees the pool's count in `/v1/quota`.
#[tokio::test]
async fn three_users_share_one_pool_across_replicas_and_never_exceed_it() {
    let stack = start_stack().await;
    let mut keys = Vec::new();
    for token in USERS {
        keys.push(key_for(&stack, token, "team").await);
    }
    let mut tasks = Vec::new();
    for (n, key) in keys.iter().cycle().take(6).enumerate() {
        let (stack, key) = (Arc::clone(&stack), key.clone());
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut refused_in_a_row, mut i) = (0u64, 0, n);
            while refused_in_a_row < 3 {
                if admitted(&chat_at(&stack, i % REPLICAS, &key).await, "team") {
                    ok += 1;
                    refused_in_a_row = 0;
                } else {
                    refused_in_a_row += 1;
                }
                i += 1;
                assert!(ok <= POOL, "a client alone was admitted {ok} > {POOL}");
            }
            (n % USERS.len(), ok)
        }));
    }
    let per_user = admitted_per_user(tasks).await;
    let concurrent: u64 = per_user.iter().sum();
    assert!(concurrent <= POOL, "admitted {concurrent} > pool {POOL}");
    // What a replica leased and did not use goes back when it idles: the rest of the pool is
    // then usable from either replica.
    let total = admit_the_rest(&stack, REPLICAS, &keys, concurrent, POOL, |r| {
        admitted(r, "team")
    })
    .await;
    eprintln!(
        "pool figure: 3 users on {REPLICAS} replicas admitted {total} of a pool of {POOL} \
         ({concurrent} while all six clients ran; per user {per_user:?}; over by {})",
        total.saturating_sub(POOL)
    );
    assert_eq!(total, POOL, "the pool is neither exceeded nor lost");
    assert!(
        per_user.iter().all(|n| *n > 0),
        "every user was served from the pool: {per_user:?}"
    );
    // Full now: every user is refused on either replica.
    for (n, key) in keys.iter().enumerate() {
        assert!(!admitted(&chat_at(&stack, n % REPLICAS, key).await, "team"));
    }
    for key in &keys {
        let row = quota_requests(&stack, key).await;
        assert_eq!(row["limit"], POOL, "{row}");
        assert_eq!(row["used"], POOL, "each user sees the pool's count: {row}");
        assert_eq!(row["remaining"], 0, "{row}");
        assert_eq!(row["pool"], true, "{row}");
    }
    tokio::task::spawn_blocking(move || stack.shutdown())
        .await
        .expect("shutdown");
}

/// Without `pool` each user has their own budget (the reference's rule): alice spending all of
/// hers leaves bob's whole (one replica: this is about whose counter, not about leases); and a
/// pooled subscription's quota is not the unpooled one's.
#[tokio::test]
async fn without_a_pool_each_user_keeps_their_own_budget() {
    let stack = start_stack().await;
    let alice = key_for(&stack, "alice-token", "solo").await;
    let bob = key_for(&stack, "bob-token", "solo").await;
    let mut alice_ok = 0;
    for _ in 0..6 {
        if admitted(&chat_at(&stack, 0, &alice).await, "solo") {
            alice_ok += 1;
        }
    }
    assert_eq!(alice_ok, 4, "alice's own 4 requests");
    let mut bob_ok = 0;
    for _ in 0..6 {
        if admitted(&chat_at(&stack, 0, &bob).await, "solo") {
            bob_ok += 1;
        }
    }
    assert_eq!(bob_ok, 4, "bob's budget is his own");
    let solo = quota_requests(&stack, &alice).await;
    assert_eq!(solo["used"], 4, "{solo}");
    assert!(solo.get("pool").is_none(), "{solo}");
    let carol_team = key_for(&stack, "carol-token", "team").await;
    assert_eq!(quota_requests(&stack, &carol_team).await["used"], 0);
    tokio::task::spawn_blocking(move || stack.shutdown())
        .await
        .expect("shutdown");
}
