//! Security e2e (issue 7): nothing leaks, no one gets in. For every way in (API key in
//! `Authorization`, in `x-api-key`, a static token) and every provider, the simulator's recorded
//! headers hold no user credential, no client `x-maas-*`, only the intended provider credential;
//! no key, token or provider credential appears in any log of Envoy, the companion or
//! PostgreSQL; revoked, expired and de-tiered keys are refused in time; other users' keys are
//! 404 and searching them 403; forged `x-maas-*` headers change nothing.

use crate::helpers::*;
use maas_e2e::Stack;
use serde_json::{Value, json};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

const POLICY_HEAD: &str = r#"
tiers:
  - name: free
    level: 0
    groups: [system:authenticated]
    limits:
      requests: [{limit: 100000, window: 1d}]
  - name: vip
    level: 5
"#;

const POLICY_TAIL: &str = r#"
    limits:
      requests: [{limit: 77777, window: 1d}]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [free, vip]
    backend: simulator
  - name: vip-model
    path: /llm/vip-model
    tiers: [vip]
    backend: simulator
  - name: gpt-ext
    path: /ext/openai
    tiers: [free]
    backend: simulator
    provider: {type: openai, credentialRef: openai-key}
    upstreamCluster: ext-openai
  - name: claude-ext
    path: /ext/anthropic
    tiers: [free]
    backend: simulator
    provider: {type: anthropic, credentialRef: anthropic-key}
    upstreamCluster: ext-anthropic
    api: openai  # the simulator speaks the OpenAI API
  - name: azure-ext
    path: /ext/azure
    tiers: [free]
    backend: simulator
    provider: {type: azure-openai, credentialRef: azure-key}
    upstreamCluster: ext-azure
  - name: vertex-ext
    path: /ext/vertex
    tiers: [free]
    backend: simulator
    provider: {type: vertex, credentialRef: vertex-key}
    upstreamCluster: ext-vertex
"#;

fn policy(vip_groups: &str) -> String {
    format!("{POLICY_HEAD}    groups: [{vip_groups}]{POLICY_TAIL}")
}

const IDENTITIES: &str = r#"
identities:
  - {token: tok-alice-5f2b9c, username: alice, groups: [system:authenticated]}
  - {token: tok-bob-71ad04, username: bob, groups: [system:authenticated]}
  - {token: tok-carol-c3e8aa, username: carol, groups: [system:authenticated, maas-admins]}
  - {token: tok-victor-9e1d27, username: victor, groups: [system:authenticated, g-vip]}
  - {token: tok-hana-40b7e1, username: hana, groups: [system:authenticated]}
"#;
const ALICE: &str = "tok-alice-5f2b9c";
const BOB: &str = "tok-bob-71ad04";
const CAROL: &str = "tok-carol-c3e8aa";
const VICTOR: &str = "tok-victor-9e1d27";
const HANA: &str = "tok-hana-40b7e1";

const CREDENTIALS: &str = r#"
credentials:
  openai-key: sk-prov-openai-8c1f
  anthropic-key: sk-prov-anthropic-2d9e
  azure-key: sk-prov-azure-77b3
  vertex-key: sk-prov-vertex-a4c0
"#;
const PROVIDER_SECRETS: &[&str] = &[
    "sk-prov-openai-8c1f",
    "sk-prov-anthropic-2d9e",
    "sk-prov-azure-77b3",
    "sk-prov-vertex-a4c0",
];

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    static P: OnceLock<String> = OnceLock::new();
    let p: &'static str = P.get_or_init(|| policy("g-vip"));
    stack_with(&S, p, IDENTITIES, CREDENTIALS)
}

/// Tests of this module that read its stack's global metrics take this so they do not count
/// each other (other modules have stacks of their own).
async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// Every user credential the tests of this module used (scanned for in the logs).
fn used() -> &'static Mutex<Vec<String>> {
    static U: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    U.get_or_init(|| {
        Mutex::new(
            [ALICE, BOB, CAROL, VICTOR, HANA]
                .iter()
                .map(|s| s.to_string())
                .collect(),
        )
    })
}

fn remember(key: &str) {
    used().lock().unwrap().push(key.to_string());
    // The secret part alone must not appear either.
    if let Some((_, secret)) = key.split_once('_') {
        used().lock().unwrap().push(secret.to_string());
    }
}

async fn mint(token: &str, body: Value) -> Value {
    let v = stack().mint_key(token, body).await.expect("mint");
    remember(v["key"].as_str().unwrap());
    v
}

fn body(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
}

/// Fails if any log line holds a credential used so far or a provider credential.
fn assert_logs_clean(stack: &Stack) {
    let logs = stack.logs_text();
    assert!(logs.len() > 1000, "the logs are suspiciously empty");
    let secrets: Vec<String> = used().lock().unwrap().clone();
    for s in secrets
        .iter()
        .map(String::as_str)
        .chain(PROVIDER_SECRETS.iter().copied())
    {
        if let Some(line) = logs.lines().find(|l| l.contains(s)) {
            panic!("a credential appears in a log: {line}");
        }
    }
}

/// (path prefix, model, the one credential header the backend must get and its value)
type ModelCase = (
    &'static str,
    &'static str,
    Option<(&'static str, &'static str)>,
);

#[tokio::test]
// One scenario read top to bottom (its steps share the stack state they build): over 100 lines.
#[allow(clippy::too_many_lines)]
async fn no_user_credential_reaches_any_backend_only_the_providers() {
    let _serial = serial().await;
    let stack = stack();
    let key = mint(ALICE, json!({"name": "leaks"})).await["key"]
        .as_str()
        .unwrap()
        .to_string();
    let auth_key = bearer(&key);
    let auth_token = bearer(ALICE);
    // Provider credentials arrive with the first poll: wait for them.
    let ready = eventually(Duration::from_secs(10), || async {
        chat(
            stack,
            "/ext/openai/v1/chat/completions",
            "lk-warm",
            &[("authorization", auth_token.as_str())],
            body("gpt-ext"),
        )
        .await
        .status
            == 200
    })
    .await;
    assert!(ready.is_some(), "provider credentials never arrived");

    let models: [ModelCase; 5] = [
        ("/llm/sim-model", "sim-model", None),
        (
            "/ext/openai",
            "gpt-ext",
            Some(("authorization", "Bearer sk-prov-openai-8c1f")),
        ),
        (
            "/ext/anthropic",
            "claude-ext",
            Some(("x-api-key", "sk-prov-anthropic-2d9e")),
        ),
        (
            "/ext/azure",
            "azure-ext",
            Some(("api-key", "sk-prov-azure-77b3")),
        ),
        (
            "/ext/vertex",
            "vertex-ext",
            Some(("authorization", "Bearer sk-prov-vertex-a4c0")),
        ),
    ];
    let ways: [(&str, (&str, &str)); 3] = [
        ("key-in-authorization", ("authorization", &auth_key)),
        ("key-in-x-api-key", ("x-api-key", &key)),
        ("static-token", ("authorization", &auth_token)),
    ];
    let mut checked = 0;
    for (path, model, provider) in models {
        for (way, cred) in ways {
            for stream in [false, true] {
                let id = format!("lk-{model}-{way}-{stream}");
                let mut b = body(model);
                b["stream"] = json!(stream);
                let r = chat(
                    stack,
                    &format!("{path}/v1/chat/completions"),
                    &id,
                    &[
                        cred,
                        ("x-maas-username", "carol"),
                        ("X-MAAS-GROUPS", "maas-admins"),
                        ("x-maas-tier", "vip"),
                        ("x-maas-key-id", "forged"),
                        ("cookie", "session=abc"),
                    ],
                    b,
                )
                .await;
                assert_eq!(r.status, 200, "{id}: {}", r.body);
                let seen = stack.sim_requests_with_test_id(&id);
                assert_eq!(seen.len(), 1, "{id}");
                let headers = &seen[0].headers;
                for (name, value) in headers {
                    let n = name.to_ascii_lowercase();
                    assert!(
                        !n.starts_with("x-maas-"),
                        "{id}: {name} reached the backend"
                    );
                    for secret in [key.as_str(), ALICE] {
                        assert!(!value.contains(secret), "{id}: user credential in {name}");
                    }
                    if let Some((_, secret)) = key.split_once('_') {
                        assert!(!value.contains(secret), "{id}: key secret in {name}");
                    }
                }
                // Exactly the intended credential header, once; no other credential header.
                let creds: Vec<(String, String)> = headers
                    .iter()
                    .filter(|(n, _)| {
                        [
                            "authorization",
                            "x-api-key",
                            "api-key",
                            "proxy-authorization",
                        ]
                        .contains(&n.to_ascii_lowercase().as_str())
                    })
                    .map(|(n, v)| (n.to_ascii_lowercase(), v.clone()))
                    .collect();
                let expected: Vec<(String, String)> = provider
                    .iter()
                    .map(|(n, v)| (n.to_string(), v.to_string()))
                    .collect();
                assert_eq!(creds, expected, "{id}: credential headers {headers:?}");
                // Another provider's credential never goes to this one.
                for other in PROVIDER_SECRETS {
                    if provider.is_some_and(|(_, v)| v.contains(other)) {
                        continue;
                    }
                    assert!(
                        !headers.iter().any(|(_, v)| v.contains(other)),
                        "{id}: {other} sent to the wrong backend"
                    );
                }
                // The response does not echo a credential either.
                assert!(
                    !r.body.contains(&key) && !r.body.contains("sk-prov-"),
                    "{id}"
                );
                checked += 1;
            }
        }
    }
    assert_logs_clean(stack);
    eprintln!(
        "{checked} backend requests checked: no user credential, no x-maas-*, only the provider's"
    );
}

async fn call(stack: &Stack, cred: &str, path: &str, model: &str, test_id: &str) -> Reply {
    chat(
        stack,
        &format!("{path}/v1/chat/completions"),
        test_id,
        &[("authorization", &bearer(cred))],
        body(model),
    )
    .await
}

/// Polls until `cred` is refused with `status` on `path`; returns how long that took.
async fn refused_within(
    stack: &Stack,
    cred: &str,
    path: &str,
    model: &str,
    status: u16,
    limit: Duration,
) -> Duration {
    let start = Instant::now();
    loop {
        let r = call(stack, cred, path, model, "lk-refuse").await;
        if r.status == status {
            r.error(status);
            return start.elapsed();
        }
        assert_eq!(r.status, 200, "unexpected answer: {}", r.body);
        assert!(
            start.elapsed() < limit,
            "still accepted after {:?} (limit {limit:?})",
            start.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn revoked_expired_and_detiered_keys_are_refused_in_time() {
    let _serial = serial().await;
    let stack = stack();
    // Poll interval 500 ms, companion reload 250 ms: one interval plus generous slack.
    let bound = Duration::from_millis(500 + 250 + 2500);

    // Revoked.
    let minted = mint(HANA, json!({"name": "to-revoke"})).await;
    let key = minted["key"].as_str().unwrap().to_string();
    let id = minted["id"].as_str().unwrap();
    for _ in 0..2 {
        let r = call(stack, &key, "/llm/sim-model", "sim-model", "lk-rev").await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let r = send(
        client()
            .delete(format!("{}/maas-api/v1/api-keys/{id}", stack.gateway_url()))
            .bearer_auth(HANA),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let revoked = refused_within(stack, &key, "/llm/sim-model", "sim-model", 401, bound).await;

    // Expired (expiresIn 1s): refused within a second plus a poll interval.
    let minted = mint(HANA, json!({"name": "short", "expiresIn": "1s"})).await;
    let short = minted["key"].as_str().unwrap().to_string();
    let first = call(stack, &short, "/llm/sim-model", "sim-model", "lk-exp").await;
    assert!(first.status == 200 || first.status == 401, "{}", first.body);
    let expired = refused_within(
        stack,
        &short,
        "/llm/sim-model",
        "sim-model",
        401,
        bound + Duration::from_secs(1),
    )
    .await;
    // And stays refused (a deliberate wait: nothing must change, no condition to poll for).
    tokio::time::sleep(Duration::from_millis(600)).await;
    call(stack, &short, "/llm/sim-model", "sim-model", "lk-exp")
        .await
        .error(401);

    // Removed from the tier's groups by a policy change: vip-model is refused.
    let vkey = mint(VICTOR, json!({"name": "vip"})).await["key"]
        .as_str()
        .unwrap()
        .to_string();
    let r = call(stack, &vkey, "/llm/vip-model", "vip-model", "lk-vip").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-ratelimit-limit-requests"), Some("77777"));
    stack.replace_policy(&policy("g-nobody")).unwrap();
    let detiered = refused_within(stack, &vkey, "/llm/vip-model", "vip-model", 403, bound).await;
    // The same key still works where the lower tier may go, with the lower tier's limits
    // (within the same bound: each of Envoy's workers polls on its own, so the one that
    // answered the 403 may not be the one that answers next).
    let lower = eventually(bound, || async {
        let r = call(stack, &vkey, "/llm/sim-model", "sim-model", "lk-vip").await;
        assert_eq!(r.status, 200, "{}", r.body);
        r.header("x-ratelimit-limit-requests") == Some("100000")
    })
    .await;
    assert!(lower.is_some(), "the lower tier's limits never applied");
    stack.replace_policy(&policy("g-vip")).unwrap();
    let back = eventually(Duration::from_secs(10), || async {
        call(stack, &vkey, "/llm/vip-model", "vip-model", "lk-vip")
            .await
            .status
            == 200
    })
    .await;
    assert!(
        back.is_some(),
        "restoring the group never let victor back in"
    );
    assert_logs_clean(stack);
    eprintln!(
        "refused after: revoked {revoked:?}, expired (1s key, after its first use) {expired:?}, removed from tier groups {detiered:?} (bound {bound:?})"
    );
}

#[tokio::test]
async fn other_users_keys_are_404_and_searching_them_403() {
    let _serial = serial().await;
    let stack = stack();
    let minted = mint(ALICE, json!({"name": "mine"})).await;
    let id = minted["id"].as_str().unwrap();
    let key = minted["key"].as_str().unwrap().to_string();
    let url = format!("{}/maas-api/v1/api-keys/{id}", stack.gateway_url());
    // The owner and an admin see it (so a 404 below is about ownership).
    for who in [ALICE, CAROL] {
        let r = send(client().get(&url).bearer_auth(who)).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(
            !r.body.contains(&key),
            "the plaintext key came back: {}",
            r.body
        );
    }
    // Another user: 404 on get and revoke, as for a key that does not exist.
    let r = send(client().get(&url).bearer_auth(BOB)).await;
    r.error(404);
    let r = send(client().delete(&url).bearer_auth(BOB)).await;
    r.error(404);
    // Bob with an API key of his own: the same.
    let bob_key = mint(BOB, json!({"name": "bobs"})).await["key"]
        .as_str()
        .unwrap()
        .to_string();
    send(client().get(&url).bearer_auth(&bob_key))
        .await
        .error(404);
    let r = send(client().delete(&url).bearer_auth(&bob_key)).await;
    assert!(
        r.status == 403 || r.status == 404,
        "{} {}",
        r.status,
        r.body
    );
    // Alice's key still works.
    let r = call(stack, &key, "/llm/sim-model", "sim-model", "lk-own").await;
    assert_eq!(r.status, 200, "{}", r.body);
    // Non-admin search for another user: 403; bulk revoke of another user: 403.
    let search = format!("{}/maas-api/v1/api-keys/search", stack.gateway_url());
    let r = send(
        client()
            .post(&search)
            .bearer_auth(BOB)
            .json(&json!({"filters": {"username": "alice"}})),
    )
    .await;
    r.error(403);
    let r = send(
        client()
            .post(format!(
                "{}/maas-api/v1/api-keys/bulk-revoke",
                stack.gateway_url()
            ))
            .bearer_auth(BOB)
            .json(&json!({"username": "alice"})),
    )
    .await;
    r.error(403);
    // Bob's own search lists none of alice's keys.
    let r = send(client().post(&search).bearer_auth(BOB).json(&json!({}))).await;
    assert_eq!(r.status, 200, "{}", r.body);
    for k in r.json()["data"].as_array().unwrap() {
        assert_eq!(k["username"], "bob", "{k}");
    }
    // The admin may search alice.
    let r = send(
        client()
            .post(&search)
            .bearer_auth(CAROL)
            .json(&json!({"filters": {"username": "alice"}})),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.json()["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["id"] == id)
    );
    let r = call(stack, &key, "/llm/sim-model", "sim-model", "lk-own").await;
    assert_eq!(
        r.status, 200,
        "alice's key was revoked by someone else: {}",
        r.body
    );
    assert_logs_clean(stack);
}

#[tokio::test]
async fn forged_maas_headers_change_nothing() {
    let _serial = serial().await;
    let stack = stack();
    let forged = [
        ("x-maas-username", "carol"),
        ("x-maas-user", "carol"),
        ("x-maas-groups", "maas-admins,g-vip"),
        ("x-maas-group", "maas-admins"),
        ("x-maas-tier", "vip"),
        ("x-maas-subject", "bob"),
        ("x-maas-admin", "true"),
    ];
    // Mint with forged headers: the key is alice's, on alice's tier.
    let mut req = client()
        .post(format!("{}/maas-api/v1/api-keys", stack.gateway_url()))
        .bearer_auth(ALICE)
        .json(&json!({"name": "forged"}));
    for (k, v) in forged {
        req = req.header(k, v);
    }
    let r = send(req).await;
    assert_eq!(r.status, 201, "{}", r.body);
    let minted = r.json();
    let key = minted["key"].as_str().unwrap().to_string();
    remember(&key);
    assert_eq!(minted["tier"], "free", "{minted}");
    let id = minted["id"].as_str().unwrap();
    let url = format!("{}/maas-api/v1/api-keys/{id}", stack.gateway_url());
    let mine = send(client().get(&url).bearer_auth(ALICE)).await;
    assert_eq!(mine.status, 200, "{}", mine.body);
    assert_eq!(mine.json()["username"], "alice");
    send(client().get(&url).bearer_auth(BOB)).await.error(404);
    // Forged admin headers do not let bob read alice's key or search her.
    let mut req = client().get(&url).bearer_auth(BOB);
    for (k, v) in forged {
        req = req.header(k, v);
    }
    send(req).await.error(404);

    // Inference: the tier, the model access and the budget stay alice's.
    let with_forged = |cred: String, path: &'static str, model: &'static str, id: &'static str| async move {
        let mut h: Vec<(&str, &str)> = forged.to_vec();
        let auth = bearer(&cred);
        h.push(("authorization", &auth));
        chat(
            stack,
            &format!("{path}/v1/chat/completions"),
            id,
            &h,
            body(model),
        )
        .await
    };
    let r = with_forged(key.clone(), "/llm/vip-model", "vip-model", "lk-forge").await;
    assert_eq!(r.error(403)["type"], "permission_error");
    let bob_before = call(stack, BOB, "/llm/sim-model", "sim-model", "lk-forge-bob").await;
    let bob_before: u64 = bob_before
        .header("x-ratelimit-remaining-requests")
        .unwrap()
        .parse()
        .unwrap();
    let a1 = with_forged(key.clone(), "/llm/sim-model", "sim-model", "lk-forge").await;
    let a2 = with_forged(key.clone(), "/llm/sim-model", "sim-model", "lk-forge").await;
    for a in [&a1, &a2] {
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(a.header("x-ratelimit-limit-requests"), Some("100000"));
    }
    let rem = |r: &Reply| -> u64 {
        r.header("x-ratelimit-remaining-requests")
            .unwrap()
            .parse()
            .unwrap()
    };
    assert_eq!(
        rem(&a1) - 1,
        rem(&a2),
        "alice's own budget counts her requests"
    );
    let bob_after = call(stack, BOB, "/llm/sim-model", "sim-model", "lk-forge-bob").await;
    assert_eq!(
        bob_after
            .header("x-ratelimit-remaining-requests")
            .unwrap()
            .parse::<u64>()
            .unwrap(),
        bob_before - 1,
        "requests forged as bob's were counted on bob's budget"
    );
    for seen in stack.sim_requests_with_test_id("lk-forge") {
        assert!(
            !seen
                .headers
                .iter()
                .any(|(n, _)| n.to_ascii_lowercase().starts_with("x-maas-")),
            "{:?}",
            seen.headers
        );
    }
    assert_logs_clean(stack);
}
