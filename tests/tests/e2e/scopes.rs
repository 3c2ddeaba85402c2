//! Scopes that nest (issue 30): two Envoys with the release .wasm, each with its own companion,
//! one Redis, one PostgreSQL. A request counts in its own counters (its subscription's, per
//! user, as the reference counts them) and in every scope of the policy it matches; the
//! strictest binds and a refusal names it.
//!
//! - Organisation `acme` above its subscriptions: team-a (alice, bob) and team-b (carol) have
//!   100 requests a day per user each, the organisation 20 for all of them together, held
//!   across both replicas; team-x (dave, another organisation) is not in it.
//! - A user's own limit inside a pool: subscription `shared` pools 12 requests a day, scope
//!   `shared-per-user` gives each user at most 5 of them.
//! - Limits per API key: scope `per-key` gives each key under `keyed` 3 requests a day.
//!
//! - Chargeback: the ledger's usage through the gateway by organisation, cost centre and
//!   subscription, in JSON and CSV, for an admin.
//!
//! Prints a `scope figure:` line (requests admitted against the organisation's limit): the
//! overshoot the lead reports.

use crate::helpers::{
    Reply, SIM_CHAT as CHAT, admit_the_rest, admitted_per_user, client, quota_of, sim_chat_at,
    start_replicated, subscription_key,
};
use maas_e2e::Stack;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    pricing: {input: "0.000001", output: "0.000002"}
subscriptions:
  - name: team-a
    owner: {groups: [team-a]}
    tokenMetadata: {organizationId: acme, costCenter: cc-a}
    models:
      - {name: sim-model, tokenRateLimits: [{limit: 1000000, window: 1d}], requestRateLimits: [{limit: 100, window: 1d}]}
  - name: team-b
    owner: {groups: [team-b]}
    tokenMetadata: {organizationId: acme, costCenter: cc-b}
    models:
      - {name: sim-model, tokenRateLimits: [{limit: 1000000, window: 1d}], requestRateLimits: [{limit: 100, window: 1d}]}
  - name: team-x
    owner: {groups: [team-x]}
    tokenMetadata: {organizationId: other}
    models:
      - {name: sim-model, tokenRateLimits: [{limit: 1000000, window: 1d}], requestRateLimits: [{limit: 100, window: 1d}]}
  - name: shared
    pool: true
    owner: {groups: [team-a, team-b]}
    models:
      - {name: sim-model, tokenRateLimits: [{limit: 1000000, window: 1d}], requestRateLimits: [{limit: 12, window: 1d}]}
  - name: keyed
    owner: {groups: [team-a]}
    models:
      - {name: sim-model, tokenRateLimits: [{limit: 1000000, window: 1d}], requestRateLimits: [{limit: 100, window: 1d}]}
scopes:
  - name: acme
    match: {organization: acme}
    limits:
      requests: [{limit: 20, window: 1d}]
  - name: shared-per-user
    match: {subscriptions: [shared]}
    per: user
    limits:
      requests: [{limit: 5, window: 1d}]
  - name: per-key
    match: {subscriptions: [keyed]}
    per: key
    limits:
      requests: [{limit: 3, window: 1d}]
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: alice-token, username: alice, groups: [system:authenticated, team-a]}
  - {token: bob-token, username: bob, groups: [system:authenticated, team-a]}
  - {token: carol-token, username: carol, groups: [system:authenticated, team-b]}
  - {token: dave-token, username: dave, groups: [system:authenticated, team-x]}
  - {token: root-token, username: root, groups: [system:authenticated, maas-admins]}
"#;

const REPLICAS: usize = 2;
const ORG: u64 = 20;

async fn start_stack() -> Arc<Stack> {
    start_replicated(POLICY, IDENTITIES, REPLICAS, None).await
}

async fn key_for(stack: &Stack, token: &str, subscription: &str, name: &str) -> String {
    subscription_key(stack, token, subscription, name).await
}

async fn chat_at(stack: &Stack, replica: usize, key: &str) -> Reply {
    sim_chat_at(stack, replica, key, 8).await
}

/// Whether `r` was admitted; a refusal must be a request limit of `owner` (`scope acme`,
/// `subscription:shared`, …), as its OpenAI-style error says.
fn admitted(r: &Reply, owner: &str) -> bool {
    match r.status {
        200 => true,
        429 => {
            let e = r.error(429);
            let m = e["message"].as_str().unwrap_or_default();
            assert!(
                m.contains("for requests") && m.contains(owner),
                "expected a refusal by {owner}: {}",
                r.body
            );
            assert_eq!(e["code"], "rate_limit_exceeded", "{}", r.body);
            false
        }
        other => panic!("unexpected {other}: {}", r.body),
    }
}

/// Admitted of `n` calls with `key` on `replica` (refusals checked to name `owner`).
async fn admitted_of(stack: &Stack, replica: usize, key: &str, n: usize, owner: &str) -> u64 {
    let mut ok = 0;
    for _ in 0..n {
        if admitted(&chat_at(stack, replica, key).await, owner) {
            ok += 1;
        }
    }
    ok
}

async fn quota(stack: &Stack, key: &str) -> Value {
    quota_of(stack, key).await
}

/// `/v1/quota` once `settled` holds of it, or after 15 s: it counts a lease a replica holds as
/// used until the replica gives it back (idle: about 4 s).
async fn quota_once_idle(stack: &Stack, key: &str, settled: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let q = quota(stack, key).await;
        if settled(&q) || Instant::now() > deadline {
            return q;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The caller's own requests row (not a scope's).
fn own_requests(quota: &Value) -> Value {
    quota["data"]
        .as_array()
        .and_then(|rows| {
            rows.iter()
                .find(|r| r["kind"] == "requests" && r.get("scope").is_none())
        })
        .cloned()
        .unwrap_or_default()
}

fn scope_row<'a>(quota: &'a Value, scope: &str) -> &'a Value {
    quota["data"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["scope"] == scope))
        .unwrap_or_else(|| panic!("no row of scope {scope}: {quota}"))
}

/// Three users of two subscriptions of one organisation, six clients on both replicas at
/// once: together exactly the organisation's 20 requests (none over, all of it usable once the
/// replicas' idle leases went back), though each user's own limit is 100; a user of another
/// organisation is not held by it; `/v1/quota` shows the scope's row.
#[tokio::test]
async fn an_organisations_limit_holds_across_its_subscriptions_and_replicas() {
    let stack = start_stack().await;
    let keys = [
        key_for(&stack, "alice-token", "team-a", "a").await,
        key_for(&stack, "bob-token", "team-a", "b").await,
        key_for(&stack, "carol-token", "team-b", "c").await,
    ];
    let mut tasks = Vec::new();
    for (n, key) in keys.iter().cycle().take(6).enumerate() {
        let (stack, key) = (Arc::clone(&stack), key.clone());
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut refused_in_a_row, mut i) = (0u64, 0, n);
            while refused_in_a_row < 3 {
                if admitted(&chat_at(&stack, i % REPLICAS, &key).await, "scope acme") {
                    ok += 1;
                    refused_in_a_row = 0;
                } else {
                    refused_in_a_row += 1;
                }
                i += 1;
                assert!(ok <= ORG, "a client alone was admitted {ok} > {ORG}");
            }
            (n % 3, ok)
        }));
    }
    let per_user = admitted_per_user(tasks).await;
    let concurrent: u64 = per_user.iter().sum();
    assert!(concurrent <= ORG, "admitted {concurrent} > {ORG}");
    let total = admit_the_rest(&stack, REPLICAS, &keys, concurrent, ORG, |r| {
        admitted(r, "scope acme")
    })
    .await;
    eprintln!(
        "scope figure: organisation acme, 3 users of 2 subscriptions on {REPLICAS} replicas \
         admitted {total} of {ORG} ({concurrent} while all six clients ran; per user \
         {per_user:?}; over by {})",
        total.saturating_sub(ORG)
    );
    assert_eq!(
        total, ORG,
        "the organisation's limit is neither exceeded nor lost"
    );
    for (n, key) in keys.iter().enumerate() {
        assert!(!admitted(
            &chat_at(&stack, n % REPLICAS, key).await,
            "scope acme"
        ));
    }
    // Another organisation's user is not counted in acme.
    let dave = key_for(&stack, "dave-token", "team-x", "d").await;
    assert_eq!(admitted_of(&stack, 1, &dave, 3, "-").await, 3);
    let q = quota(&stack, keys.first().expect("alice's key")).await;
    let row = scope_row(&q, "acme");
    assert_eq!(
        (&row["kind"], &row["limit"], &row["used"], &row["remaining"]),
        (&json!("requests"), &json!(ORG), &json!(ORG), &json!(0)),
        "{row}"
    );
    // alice's own subscription counted only what she was admitted (once the replicas gave
    // back the idle leases of her counter, which /v1/quota counts as used until then).
    let q = quota_once_idle(&stack, keys.first().expect("alice's key"), |q| {
        own_requests(q)["used"].as_u64().unwrap_or(u64::MAX) < ORG
    })
    .await;
    let own = own_requests(&q);
    assert!(own["used"].as_u64().unwrap_or(0) < ORG, "{own}");
    assert!(
        quota(&stack, &dave).await["data"]
            .as_array()
            .is_some_and(|rows| rows.iter().all(|r| r.get("scope").is_none())),
        "dave's requests count in no scope"
    );
    tokio::task::spawn_blocking(move || stack.shutdown())
        .await
        .expect("shutdown");
}

/// A user's own limit inside a pool (the strictest binds: the user's 5 first, then the pool's
/// 12), and each API key its own limit under a subscription with a per-key scope; refusals
/// name what refused, and nothing refused is counted anywhere. One replica: this is about
/// whose counters (the leases across replicas are the test above's).
#[tokio::test]
async fn a_users_limit_inside_a_pool_and_limits_per_key_bind_first() {
    let stack = start_stack().await;
    let alice = key_for(&stack, "alice-token", "shared", "alice-shared").await;
    let bob = key_for(&stack, "bob-token", "shared", "bob-shared").await;
    let carol = key_for(&stack, "carol-token", "shared", "carol-shared").await;
    assert_eq!(
        admitted_of(&stack, 0, &alice, 7, "scope shared-per-user").await,
        5,
        "alice's own 5 of the pool"
    );
    assert_eq!(
        admitted_of(&stack, 0, &bob, 7, "scope shared-per-user").await,
        5
    );
    // 10 of the pool's 12 are spent: carol gets 2, then the pool refuses her.
    assert_eq!(
        admitted_of(&stack, 0, &carol, 4, "subscription:shared").await,
        2
    );
    let q = quota_once_idle(&stack, &carol, |q| {
        scope_row(q, "shared-per-user")["used"] == 2
    })
    .await;
    let row = scope_row(&q, "shared-per-user");
    assert_eq!(
        row["used"], 2,
        "carol's own count, refusals not counted: {row}"
    );
    let pool = q["data"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["pool"] == true))
        .cloned()
        .unwrap_or_default();
    assert_eq!(pool["used"], 12, "{q}");

    let first = key_for(&stack, "alice-token", "keyed", "first").await;
    let second = key_for(&stack, "alice-token", "keyed", "second").await;
    assert_eq!(admitted_of(&stack, 0, &first, 5, "scope per-key").await, 3);
    assert_eq!(
        admitted_of(&stack, 0, &second, 5, "scope per-key").await,
        3,
        "each key has its own 3"
    );
    let q = quota_once_idle(&stack, &second, |q| own_requests(q)["used"] == 6).await;
    assert_eq!(scope_row(&q, "per-key")["used"], 3, "{q}");
    let own = own_requests(&q);
    assert_eq!(
        own["used"], 6,
        "alice's own count under keyed: both keys: {q}"
    );
    tokio::task::spawn_blocking(move || stack.shutdown())
        .await
        .expect("shutdown");
}

/// An API key minted with limits of its own (per-key limits at mint): four clients with that
/// key on both replicas at once get exactly its 6 requests a day, though its subscription
/// allows 100; refusals name the key's limits; the owner's other key is not held by them;
/// `/v1/quota` shows the key's row.
#[tokio::test]
async fn a_key_minted_with_its_own_limits_is_held_to_them_across_replicas() {
    const OWN: u64 = 6;
    let stack = start_stack().await;
    let minted = stack
        .mint_key(
            "dave-token",
            json!({"name": "capped", "subscription": "team-x",
                   "limits": {"requests": [{"limit": OWN, "window": "1d"}]}}),
        )
        .await
        .expect("minted");
    assert_eq!(minted["limits"]["requests"][0]["limit"], OWN, "{minted}");
    let capped = minted["key"].as_str().expect("key").to_string();
    let owner = "this API key's own limits";
    let mut tasks = Vec::new();
    for n in 0..4 {
        let (stack, key) = (Arc::clone(&stack), capped.clone());
        tasks.push(tokio::spawn(async move {
            let mut ok = 0u64;
            for i in 0..4 {
                if admitted(&chat_at(&stack, (n + i) % REPLICAS, &key).await, owner) {
                    ok += 1;
                }
            }
            ok
        }));
    }
    let mut concurrent = 0;
    for t in tasks {
        concurrent += t.await.expect("client task");
    }
    assert!(concurrent <= OWN, "admitted {concurrent} > {OWN}");
    // What the replicas still hold as idle leases goes back within seconds: all of it usable.
    let mut total = concurrent;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut i = 0;
    while total < OWN && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if admitted(&chat_at(&stack, i % REPLICAS, &capped).await, owner) {
            total += 1;
        }
        i += 1;
    }
    eprintln!(
        "scope figure: a key minted with {OWN} requests a day, 4 clients on {REPLICAS} replicas \
         admitted {total} ({concurrent} while they ran; over by {})",
        total.saturating_sub(OWN)
    );
    assert_eq!(
        total, OWN,
        "the key's own limit is neither exceeded nor lost"
    );
    assert!(!admitted(&chat_at(&stack, 1, &capped).await, owner));
    // dave's other key, without limits of its own, is not held by them.
    let other = key_for(&stack, "dave-token", "team-x", "plain").await;
    assert_eq!(admitted_of(&stack, 0, &other, 3, "-").await, 3);
    let q = quota_once_idle(&stack, &capped, |q| scope_row(q, "key")["used"] == OWN).await;
    let row = scope_row(&q, "key");
    assert_eq!(
        (&row["kind"], &row["limit"], &row["used"]),
        (&json!("requests"), &json!(OWN), &json!(OWN)),
        "{row}"
    );
    tokio::task::spawn_blocking(move || stack.shutdown())
        .await
        .expect("shutdown");
}

/// `GET /v1/usage?user=*&groupBy=<by>` as the admin: `group → (requests, prompt, completion,
/// cost)`.
async fn usage_by(
    stack: &Stack,
    by: &str,
) -> std::collections::BTreeMap<String, (u64, u64, u64, String)> {
    let v: Value = client()
        .get(format!(
            "{}/v1/usage?user=*&groupBy={by}",
            stack.companion_public_url()
        ))
        .bearer_auth("root-token")
        .send()
        .await
        .expect("usage")
        .json()
        .await
        .expect("usage json");
    v["data"]
        .as_array()
        .map(|rows| {
            rows.iter()
                .map(|r| {
                    (
                        r[by].as_str().unwrap_or("?").to_string(),
                        (
                            r["requests"].as_u64().unwrap_or(0),
                            r["promptTokens"].as_u64().unwrap_or(0),
                            r["completionTokens"].as_u64().unwrap_or(0),
                            r["cost"].as_str().unwrap_or("").to_string(),
                        ),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Chargeback through the gateway: requests of three subscriptions (two of organisation acme
/// with cost centres cc-a and cc-b, one of another without) on both replicas reach the ledger
/// labelled; the admin's usage by organisation, cost centre and subscription counts each
/// request once, charges each row its tokens at the model's prices exactly, and the CSV says
/// the same.
#[tokio::test]
async fn usage_through_the_gateway_is_charged_back_by_organisation_cost_centre_and_subscription() {
    let stack = start_stack().await;
    let alice = key_for(&stack, "alice-token", "team-a", "a").await;
    let carol = key_for(&stack, "carol-token", "team-b", "c").await;
    let dave = key_for(&stack, "dave-token", "team-x", "d").await;
    for (key, n) in [(&alice, 3), (&carol, 2), (&dave, 4)] {
        for i in 0..n {
            assert_eq!(chat_at(&stack, i % REPLICAS, key).await.status, 200);
        }
    }
    let want_requests = |rows: &std::collections::BTreeMap<String, (u64, u64, u64, String)>| {
        rows.iter()
            .map(|(k, v)| (k.clone(), v.0))
            .collect::<Vec<_>>()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let by_org = loop {
        let rows = usage_by(&stack, "organization").await;
        if want_requests(&rows) == [("acme".to_string(), 5), ("other".to_string(), 4)] {
            break rows;
        }
        assert!(
            Instant::now() < deadline,
            "the ledger never counted 5 and 4: {rows:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    // Each row's cost is its own tokens at the model's prices (1 and 2 micro-units a token).
    for (org, (_, prompt, completion, cost)) in &by_org {
        assert!(*completion > 0, "{org}: {by_org:?}");
        assert_eq!(
            *cost,
            maas_types::Money(prompt * 1_000 + completion * 2_000).to_string(),
            "{org}"
        );
    }
    let by_cc = usage_by(&stack, "costCenter").await;
    assert_eq!(
        want_requests(&by_cc),
        [
            (String::new(), 4),
            ("cc-a".to_string(), 3),
            ("cc-b".to_string(), 2)
        ]
    );
    let by_sub = usage_by(&stack, "subscription").await;
    assert_eq!(
        want_requests(&by_sub),
        [
            ("team-a".to_string(), 3),
            ("team-b".to_string(), 2),
            ("team-x".to_string(), 4)
        ]
    );
    let acme = by_org.get("acme").cloned().unwrap_or_default();
    let csv = client()
        .get(format!(
            "{}/v1/usage?user=*&groupBy=organization",
            stack.companion_public_url()
        ))
        .bearer_auth("root-token")
        .header("accept", "text/csv")
        .send()
        .await
        .expect("csv");
    assert_eq!(csv.status(), 200);
    let text = csv.text().await.expect("csv text");
    assert_eq!(
        text.lines().next(),
        Some(
            "organization,requests,refused,promptTokens,completionTokens,totalTokens,cachedInputTokens,cost"
        )
    );
    let line = format!(
        "acme,5,,{},{},{},0,{}",
        acme.1,
        acme.2,
        acme.1 + acme.2,
        acme.3
    );
    assert!(text.lines().any(|l| l == line), "{line} not in {text}");
    // A user is not an admin: their own usage only, whatever they ask.
    let own: Value = client()
        .get(format!(
            "{}/v1/usage?groupBy=organization",
            stack.companion_public_url()
        ))
        .bearer_auth(&dave)
        .send()
        .await
        .expect("usage")
        .json()
        .await
        .expect("json");
    assert_eq!(own["data"].as_array().map(Vec::len), Some(1), "{own}");
    assert_eq!(own["data"][0]["organization"], "other", "{own}");
    tokio::task::spawn_blocking(move || stack.shutdown())
        .await
        .expect("shutdown");
}

/// The caller's own row of `kind` (not a scope's) and the key scope's, as (used, used).
fn own_and_key(quota: &Value, kind: &str) -> (Option<u64>, Option<u64>) {
    let rows = quota["data"].as_array().cloned().unwrap_or_default();
    let used = |key_scope: bool| {
        rows.iter()
            .find(|r| {
                r["kind"] == kind
                    && if key_scope {
                        r["scope"] == "key"
                    } else {
                        r.get("scope").is_none()
                    }
            })
            .and_then(|r| r["used"].as_u64())
    };
    (used(false), used(true))
}

/// A key's own counter is settled exactly as its owner's subscription counter is — plain
/// answers, a stream read to its end, and a stream the client left after its first chunk (the
/// abandoned work charged to both alike) — over both replicas.
#[tokio::test]
async fn a_keys_own_counter_is_settled_as_its_owners_streams_and_disconnects_included() {
    let stack = start_stack().await;
    let minted = stack
        .mint_key(
            "dave-token",
            json!({"name": "metered", "subscription": "team-x",
                   "limits": {"requests": [{"limit": 50, "window": "1d"}],
                              "tokens": [{"limit": 900000, "window": "1d"}]}}),
        )
        .await
        .expect("minted");
    let key = minted["key"].as_str().expect("key").to_string();
    for replica in 0..REPLICAS {
        assert_eq!(chat_at(&stack, replica, &key).await.status, 200);
    }
    let streamed = |replica: usize, delay_ms: u64| {
        client()
            .post(format!("{}{CHAT}", stack.gateway_url_of(replica)))
            .bearer_auth(&key)
            .header("x-sim-chunk-delay-ms", delay_ms.to_string())
            .json(
                &json!({"model": "sim-model", "max_tokens": 40, "stream": true,
                          "stream_options": {"include_usage": true},
                          "messages": [{"role": "user", "content": "tell me more"}]}),
            )
            .send()
    };
    let whole = streamed(1, 0).await.expect("stream");
    assert_eq!(whole.status(), 200);
    let text = whole.text().await.expect("stream body");
    assert!(text.contains("[DONE]"), "{text}");
    // Left after the first chunk: the client goes away mid-stream.
    let mut left = streamed(0, 300).await.expect("stream");
    assert_eq!(left.status(), 200);
    assert!(left.chunk().await.expect("a chunk").is_some());
    drop(left);
    let q = quota_once_idle(&stack, &key, |q| {
        let (own, mine) = own_and_key(q, "tokens");
        own.is_some() && own == mine && own_and_key(q, "requests") == (Some(4), Some(4))
    })
    .await;
    let (own_tokens, key_tokens) = own_and_key(&q, "tokens");
    assert!(own_tokens.unwrap_or(0) > 0, "{q}");
    assert_eq!(own_tokens, key_tokens, "{q}");
    assert_eq!(own_and_key(&q, "requests"), (Some(4), Some(4)), "{q}");
    eprintln!(
        "scope figure: a key's own counter and its subscription's after 2 answers, a stream and \
         a stream left mid-way: tokens {own_tokens:?} and {key_tokens:?}"
    );
    tokio::task::spawn_blocking(move || stack.shutdown())
        .await
        .expect("shutdown");
}
