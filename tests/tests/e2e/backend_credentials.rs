//! Several backends per model with a provider credential each (issue 29), through real Envoy
//! with the release .wasm: the filter's upstream mode, an upstream HTTP filter of the model's
//! backends cluster, sets the chosen backend's credential per upstream attempt. Each backend is
//! a simulator that requires its own key (any other → 401): weighted traffic reaches both and
//! each saw only its own key, never the other's, never the client's; a backend answering 503
//! fails over to the other and the client gets one clean 200, counted once, the ledger naming
//! the backend that served; a backend whose credential is missing is not chosen (the filter
//! lists the backends that can serve in `x-maas-endpoints`, Envoy's `override_host` tries them
//! in order) and never receives a request; a model none of whose backends has its credential
//! is refused before anything leaves.

use crate::helpers::*;
use maas_e2e::Stack;
use maas_e2e::sim::{self, RecordedRequest, SimConfig, SimHandle};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const IDENTITIES: &str = r#"
identities:
  - {token: alice-token, username: alice, groups: [g-free]}
  - {token: bob-token, username: bob, groups: [g-free]}
"#;

const KEY_A: &str = "sk-provider-a";
const KEY_B: &str = "sk-provider-b";
/// A key the client sends in Azure's header: it must reach no backend.
const CLIENT_API_KEY: &str = "client-sent-api-key";

/// The simulators: `spread-a`/`spread-b` (50/50), `fail-a` (answers 503)/`fail-b`,
/// `nokey-a` (its credential is missing)/`nokey-b`, `none-a`/`none-b` (both credentials
/// missing), `cool-a`/`recool-a` (answer 503) with `cool-b`/`recool-b` for cooldowns. The `a`s
/// take KEY_A as OpenAI's
/// `Authorization: Bearer`, the `b`s KEY_B as Azure OpenAI's `api-key`.
fn sims() -> &'static BTreeMap<&'static str, SimHandle> {
    static SIMS: OnceLock<BTreeMap<&'static str, SimHandle>> = OnceLock::new();
    SIMS.get_or_init(|| {
        let names = [
            "spread-a", "spread-b", "fail-a", "fail-b", "nokey-a", "nokey-b", "none-a", "none-b",
            "cool-a", "cool-b", "recool-a", "recool-b", "rstall-a", "rok-b", "pathed-a",
        ];
        let out: BTreeMap<_, _> = names
            .into_iter()
            .map(|n| {
                let s = sim::spawn("127.0.0.1:0".parse().unwrap(), SimConfig::default())
                    .expect("a simulator starts");
                if n.ends_with("-a") {
                    s.require_key("authorization", &format!("Bearer {KEY_A}"));
                } else {
                    s.require_key("api-key", KEY_B);
                }
                (n, s)
            })
            .collect();
        out["fail-a"].set_fault("status-503");
        out["cool-a"].set_fault("status-503");
        out["recool-a"].set_fault("status-503");
        out["rstall-a"].set_fault("stall");
        out
    })
}

fn url(name: &str) -> String {
    sims()[name].url()
}

/// Chat completions simulator `name` received.
fn chats(name: &str) -> Vec<RecordedRequest> {
    sims()[name]
        .requests()
        .into_iter()
        .filter(|r| r.path.ends_with("/chat/completions"))
        .collect()
}

/// A model whose backends `a` (OpenAI, credential `a_ref`) and `b` (Azure OpenAI, `b_ref`)
/// are these simulators, 50/50.
fn model(name: &str, a: &str, a_ref: &str, b: &str, b_ref: &str) -> Value {
    json!({"name": name, "path": format!("/llm/{name}"), "tiers": ["free"],
    "upstreamCluster": format!("{name}-backends"),
    "backends": [
        {"name": "a", "backend": url(a), "weight": 50, "timeout": "30s",
         "provider": {"type": "openai", "credentialRef": a_ref}},
        {"name": "b", "backend": url(b), "weight": 50, "timeout": "30s",
         "provider": {"type": "azure-openai", "credentialRef": b_ref}}
    ]})
}

/// `model` with a cooldown.
fn cooling(mut model: Value, failures: u32, duration: &str) -> Value {
    model["cooldown"] = json!({"failures": failures, "duration": duration});
    model
}

fn policy() -> &'static str {
    static POLICY: OnceLock<String> = OnceLock::new();
    POLICY.get_or_init(|| {
        json!({
            "observability": {"usageEvents": true},
            "tiers": [{"name": "free", "level": 0, "groups": ["g-free"],
                       "limits": {"requests": [{"limit": 100000, "window": "1d"}]}}],
            "models": [
                model("spread", "spread-a", "key-a", "spread-b", "key-b"),
                // Each request fails over: no cooldown moves `a` last.
                cooling(model("fail", "fail-a", "key-a", "fail-b", "key-b"), 0, "30s"),
                cooling(model("cooling", "cool-a", "key-a", "cool-b", "key-b"), 2, "30s"),
                cooling(model("recool", "recool-a", "key-a", "recool-b", "key-b"), 1, "1s"),
                // `key-missing` and `key-gone` are in no credentials file.
                model("nokey", "nokey-a", "key-missing", "nokey-b", "key-b"),
                model("nokeys", "none-a", "key-missing", "none-b", "key-gone"),
                // A provider with a chat path of its own (the reference's binding `path`).
                json!({"name": "pathed", "path": "/llm/pathed", "tiers": ["free"],
                    "backend": url("pathed-a"), "upstreamCluster": "pathed",
                    "provider": {"type": "openai", "credentialRef": "key-a",
                                 "path": "/gateway/v1/chat/completions"}}),
                // Routed backends (each its own cluster, drawn per request, no failover):
                // `a` stalls and has a 1 s timeout of its own, `b` answers.
                json!({"name": "routed", "path": "/llm/routed", "tiers": ["free"], "api": "openai",
                    "backends": [
                        {"name": "a", "backend": url("rstall-a"), "upstreamCluster": "routed-a",
                         "timeout": "1s",
                         "provider": {"type": "openai", "credentialRef": "key-a"}},
                        {"name": "b", "backend": url("rok-b"), "upstreamCluster": "routed-b",
                         "provider": {"type": "azure-openai", "credentialRef": "key-b"}}
                    ]}),
            ]
        })
        .to_string()
    })
}

fn credentials() -> &'static str {
    static CREDENTIALS: OnceLock<String> = OnceLock::new();
    CREDENTIALS.get_or_init(|| json!({"credentials": {"key-a": KEY_A, "key-b": KEY_B}}).to_string())
}

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    S.get_or_start(|| {
        start_stack(
            policy(),
            IDENTITIES,
            credentials(),
            Some(json!({"usage": {"reportIntervalMs": 300}})),
        )
    })
}

/// A chat completion for `model` as alice, who also sends an `api-key` of her own.
async fn call(stack: &Stack, model: &str) -> Reply {
    call_as(stack, "alice-token", model).await
}

/// As [`call`], as the caller of this token.
async fn call_as(stack: &Stack, token: &str, model: &str) -> Reply {
    chat(
        stack,
        &format!("/llm/{model}/v1/chat/completions"),
        "backend_credentials",
        &[
            ("authorization", &bearer(token)),
            ("api-key", CLIENT_API_KEY),
        ],
        json!({"model": model, "max_tokens": 3,
               "messages": [{"role": "user", "content": "one two three four"}]}),
    )
    .await
}

/// Waits until every Envoy worker's filters hold the credentials (each polls on its own; the
/// upstream filter too): ten answers in a row from `model`, each on a new connection. Returns
/// the calls it made and how many were answered 200.
async fn until_served(stack: &Stack, model: &str) -> (usize, usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let (mut calls, mut ok) = (0, 0);
    let mut in_a_row = 0;
    while in_a_row < 10 {
        let r = call(stack, model).await;
        calls += 1;
        ok += usize::from(r.status == 200);
        in_a_row = if r.status == 200 { in_a_row + 1 } else { 0 };
        assert!(
            Instant::now() < deadline,
            "{model} never served: {} {}",
            r.status,
            r.body
        );
        if r.status != 200 {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    (calls, ok)
}

/// Every request a simulator saw carried exactly its own credential: the `a`s KEY_A as
/// `Authorization` and no `api-key`, the `b`s KEY_B as `api-key` and no `Authorization`;
/// never `x-api-key`, never the client's token or `api-key`.
fn only_own_key(name: &str, seen: &[RecordedRequest]) {
    for r in seen {
        let all = |h: &str| -> Vec<&str> {
            r.headers
                .iter()
                .filter(|(n, _)| n.eq_ignore_ascii_case(h))
                .map(|(_, v)| v.as_str())
                .collect()
        };
        let (auth, api_key) = (all("authorization"), all("api-key"));
        if name.ends_with("-a") {
            assert_eq!(auth, [format!("Bearer {KEY_A}")], "{name}: {:?}", r.headers);
            assert!(api_key.is_empty(), "{name}: {:?}", r.headers);
        } else {
            assert_eq!(api_key, [KEY_B], "{name}: {:?}", r.headers);
            assert!(auth.is_empty(), "{name}: {:?}", r.headers);
        }
        assert!(all("x-api-key").is_empty(), "{name}: {:?}", r.headers);
        for (_, v) in &r.headers {
            assert!(
                !v.contains("alice-token") && !v.contains(CLIENT_API_KEY),
                "{name} received a client credential: {:?}",
                r.headers
            );
        }
    }
}

#[tokio::test]
async fn each_backend_receives_only_its_own_credential() {
    let s = stack();
    until_served(s, "spread").await;
    let (a0, b0) = (chats("spread-a").len(), chats("spread-b").len());
    for _ in 0..40 {
        let r = call(s, "spread").await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["object"], "chat.completion", "{}", r.body);
    }
    let (a, b) = (chats("spread-a"), chats("spread-b"));
    let (na, nb) = (a.len() - a0, b.len() - b0);
    eprintln!("backend_credentials: 50/50 weights gave {na}/{nb}");
    assert_eq!(na + nb, 40, "each request reached one backend once");
    assert!(na >= 8 && nb >= 8, "both backends serve: {na}/{nb}");
    // Every request either received, the warm-up's included.
    only_own_key("spread-a", &a);
    only_own_key("spread-b", &b);
}

#[tokio::test]
async fn a_503_backend_fails_over_to_the_other_with_its_own_key() {
    let s = stack();
    let (warm_calls, warm_ok) = until_served(s, "fail").await;
    let tried = chats("fail-a").len();
    // Bob's calls only: his ledger rows are these requests' alone.
    let n = 10;
    for _ in 0..n {
        let r = call_as(s, "bob-token", "fail").await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["object"], "chat.completion", "{}", r.body);
    }
    let (a, b) = (chats("fail-a"), chats("fail-b"));
    assert_eq!(
        b.len(),
        warm_ok + n,
        "every request answered 200 was served by b"
    );
    assert!(a.len() > tried, "the failing backend was tried");
    // `a` got KEY_A on its attempts; each retry to `b` carried KEY_B and nothing of KEY_A.
    only_own_key("fail-a", &a);
    only_own_key("fail-b", &b);
    // Counted once each: one usage event per call, every answered one served by `b`.
    let events = events_of(s, "fail", warm_calls + n).await;
    let answered: Vec<&Value> = events.iter().filter(|e| e["status"] == 200).collect();
    assert_eq!(answered.len(), warm_ok + n, "{events:?}");
    assert!(
        answered.iter().all(|e| e["served_by"] == "b"),
        "{answered:?}"
    );
    // The ledger counts Bob's requests against the backend that served.
    assert_eq!(
        ledger_by_backend(s, "bob-token", "fail", n).await,
        BTreeMap::from([("b".to_string(), n)])
    );
}

/// A provider backend that keeps failing is tried last for its cooldown (the filter's order:
/// Envoy's outlier detection does not move a listed endpoint): each worker tries it at most
/// `failures` times, then every request goes straight to the other — none fails over, none
/// fails.
#[tokio::test]
async fn a_provider_backend_that_keeps_failing_is_tried_last_for_its_cooldown() {
    let s = stack();
    until_served(s, "cooling").await;
    let n = 30;
    for _ in 0..n {
        let r = call(s, "cooling").await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let tried = chats("cool-a").len();
    eprintln!("backend_credentials::cooldown: the failing backend was tried {tried} times");
    // 2 failures in a row on each of the stack's 2 workers; without a cooldown it is drawn
    // first for about every other request (about 20 of these).
    assert!((1..=4).contains(&tried), "tried {tried} times");
    only_own_key("cool-a", &chats("cool-a"));
    only_own_key("cool-b", &chats("cool-b"));
}

/// Once its cooldown is over, a backend is drawn again: one failure then cools it once more
/// (its probation), and an answer from it would clear it.
#[tokio::test]
async fn a_cooled_backend_is_tried_again_once_its_cooldown_is_over() {
    let s = stack();
    until_served(s, "recool").await;
    let before = chats("recool-a").len();
    assert!(
        before > 0,
        "warming up drew the failing backend at least once"
    );
    // 1 s cooldowns: a request every 1.2 s draws it first half the time.
    let mut again = false;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let r = call(s, "recool").await;
        assert_eq!(r.status, 200, "{}", r.body);
        if chats("recool-a").len() > before {
            again = true;
            break;
        }
    }
    assert!(
        again,
        "the backend was never tried again after its cooldown"
    );
}

#[tokio::test]
async fn a_backend_without_its_credential_is_not_chosen_and_never_receives_a_request() {
    let s = stack();
    until_served(s, "nokey").await;
    for _ in 0..20 {
        let r = call(s, "nokey").await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    // At the one base URL alike (Envoy chooses the route again, then the backend).
    for _ in 0..10 {
        let r = chat(
            s,
            "/v1/chat/completions",
            "backend_credentials",
            &[("authorization", &bearer("alice-token"))],
            json!({"model": "nokey", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert!(
        chats("nokey-a").is_empty(),
        "the backend without a credential received requests"
    );
    only_own_key("nokey-b", &chats("nokey-b"));
}

#[tokio::test]
async fn a_model_none_of_whose_backends_has_its_credential_is_refused_before_any() {
    let s = stack();
    for _ in 0..5 {
        let e = call(s, "nokeys").await.error(503);
        assert_eq!(e["code"], "provider_credential_missing", "{e}");
    }
    assert!(chats("none-a").is_empty() && chats("none-b").is_empty());
}

/// `ready` in the companion's model list: provider backends are probed without their key, so
/// a 401 says they are up (as for a model with one provider). Before, a model whose backends
/// all had providers was never ready.
#[tokio::test]
async fn a_model_of_provider_backends_is_listed_ready() {
    let s = stack();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = send(
            client()
                .get(format!("{}/maas-api/v1/models", s.gateway_url()))
                .bearer_auth("alice-token"),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        let body = r.json();
        let spread = body["data"]
            .as_array()
            .and_then(|d| d.iter().find(|m| m["id"] == "spread"))
            .cloned()
            .unwrap_or_else(|| panic!("no spread in {body}"));
        if spread["ready"] == true {
            return;
        }
        assert!(Instant::now() < deadline, "spread never ready: {spread}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Routed backends each keep their own timeout (their own routes): a request drawn to the
/// stalling backend ends after its 1 s (504, not failed over: routed backends have none), one
/// drawn to the other is answered; each backend saw only its own key.
#[tokio::test]
async fn a_routed_backend_keeps_its_own_timeout() {
    let s = stack();
    // Served once: both credentials are loaded (they come with the same document).
    let deadline = Instant::now() + Duration::from_secs(30);
    while call(s, "routed").await.status != 200 {
        assert!(Instant::now() < deadline, "routed never served");
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let (a0, b0) = (chats("rstall-a").len(), chats("rok-b").len());
    let mut statuses = BTreeMap::new();
    for _ in 0..16 {
        let started = Instant::now();
        let r = call(s, "routed").await;
        let took = started.elapsed();
        match r.status {
            200 => assert_eq!(r.json()["object"], "chat.completion", "{}", r.body),
            504 => assert!(
                took >= Duration::from_millis(900) && took < Duration::from_secs(10),
                "cut after {took:?}, not at the backend's 1 s"
            ),
            other => panic!("{other}: {}", r.body),
        }
        *statuses.entry(r.status).or_insert(0) += 1;
    }
    let (a, b) = (chats("rstall-a"), chats("rok-b"));
    eprintln!("backend_credentials::routed: {statuses:?}");
    // 1:1 over 16 draws: each backend reached (one kind of answer alone: 1 in 32,768).
    assert_eq!(statuses.get(&504), Some(&(a.len() - a0)), "{statuses:?}");
    assert_eq!(statuses.get(&200), Some(&(b.len() - b0)), "{statuses:?}");
    only_own_key("rstall-a", &a);
    only_own_key("rok-b", &b);
}

/// A provider's own chat path (the reference's binding `path`): chat at the model's prefix and
/// at the one base URL reaches the provider at exactly that path, with its key.
#[tokio::test]
async fn a_providers_own_chat_path_is_where_chat_goes_at_both_urls() {
    let s = stack();
    let deadline = Instant::now() + Duration::from_secs(30);
    while call(s, "pathed").await.status != 200 {
        assert!(Instant::now() < deadline, "pathed never served");
    }
    let before = chats("pathed-a").len();
    let r = chat(
        s,
        "/v1/chat/completions",
        "backend_credentials",
        &[("authorization", &bearer("alice-token"))],
        json!({"model": "pathed", "max_tokens": 3,
               "messages": [{"role": "user", "content": "one two"}]}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(call(s, "pathed").await.status, 200);
    // Chat only (the companion's readiness probes GET /v1/models meanwhile).
    let seen = chats("pathed-a");
    let paths: Vec<&str> = seen[before..].iter().map(|r| r.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/gateway/v1/chat/completions",
            "/gateway/v1/chat/completions"
        ]
    );
    only_own_key("pathed-a", &seen);
}
