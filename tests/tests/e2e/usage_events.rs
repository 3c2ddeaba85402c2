//! Per-request usage events (issue 32) through real Envoy with the release .wasm: with the
//! policy's `observability.usageEvents`, each request the usage ledger counts leaves one JSON
//! line in the access log Envoy writes (the stack's `usage_events_path()`): a JSON answer, an SSE
//! stream, an embeddings call, an Anthropic Messages call, an OpenAI chat translated to Messages,
//! a client that leaves mid-stream (settled in the filter's `on_log`, before Envoy's access log),
//! refusals (429 over a limit, 403 for a model the tier may not use, 400 for too large a
//! reservation), requests past a shadow limit, prompt-cache tokens the provider reported, and a
//! subscription with a billing rate. Every line parses; the events add up
//! exactly to the ledger as `GET /maas-api/v1/usage` shows it (requests, tokens, cached tokens,
//! refusals by code, cost), user by user; the user is the companion's keyed pseudonym; no line
//! holds a prompt, an API key or a username. With the switch off, the file stays empty.

use crate::helpers::*;
use maas_e2e::{Stack, StackOptions};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const TIERS_AND_MODELS: &str = r#"
tiers:
  - name: roomy
    level: 0
    groups: [g-roomy]
    limits:
      requests: [{limit: 100, window: 1d}, {limit: 3, window: 1d, shadow: true}]
      tokens: [{limit: 100000, window: 1d}]
    defaultMaxTokens: 50
  - name: tiny
    level: 1
    groups: [g-tiny]
    limits:
      requests: [{limit: 1, window: 1d}]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [roomy, tiny]
    backend: simulator
  - name: sim-claude
    path: /llm/sim-claude
    tiers: [roomy]
    backend: simulator
    api: anthropic
  - name: sim-locked
    path: /llm/sim-locked
    tiers: [tiny]
    backend: simulator
subscriptions:
  - name: billed
    owner: {users: [billy-billed]}
    models:
      - name: sim-model
        tokenRateLimits: [{limit: 100000, window: 1d}]
        billingRate: {perToken: "0.000002"}
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: evelyn-token, username: evelyn-events, groups: [g-roomy]}
  - {token: timothy-token, username: timothy-tiny, groups: [g-tiny]}
  - {token: billy-token, username: billy-billed, groups: [g-roomy]}
  - {token: olive-token, username: olive-off, groups: [g-roomy]}
"#;

/// Every prompt carries it: no event line may.
const MARKER: &str = "zebra-quartz-marker";

/// The companion's pseudonym key (a test key: 32 bytes and more).
const PSEUDONYM_KEY: &[u8] = b"usage-events-e2e-pseudonym-key-0123456789";

const REPORT_INTERVAL_MS: u64 = 500;
/// How long the ledger and the events file may take: a report interval, a tick, the insert;
/// Envoy's access-log flush; room for a loaded machine.
const DEADLINE: Duration = Duration::from_secs(30);

const CHAT: &str = "/llm/sim-model/v1/chat/completions";
const EMBEDDINGS: &str = "/llm/sim-model/v1/embeddings";
const MESSAGES: &str = "/llm/sim-claude/v1/messages";
const TRANSLATED: &str = "/llm/sim-claude/v1/chat/completions";
const LOCKED: &str = "/llm/sim-locked/v1/chat/completions";

fn key_file() -> &'static tempfile::TempPath {
    static F: OnceLock<tempfile::TempPath> = OnceLock::new();
    F.get_or_init(|| {
        let f = tempfile::NamedTempFile::new().expect("a temp file");
        std::fs::write(f.path(), PSEUDONYM_KEY).expect("the key written");
        f.into_temp_path()
    })
}

fn start(policy: String) -> Result<Stack, String> {
    let key = key_file().to_path_buf();
    std::thread::spawn(move || {
        let mut options = StackOptions::default()
            .with_policy_yaml(&policy)
            .with_identities_yaml(IDENTITIES)
            .with_credentials_yaml("credentials: {}\n");
        options.plugin_config_extra =
            Some(json!({"usage": {"reportIntervalMs": REPORT_INTERVAL_MS}}));
        options.companion_env.push((
            "MAAS_LOG_PSEUDONYM_KEY_FILE".into(),
            key.display().to_string(),
        ));
        Stack::start(options).map_err(|e| format!("{e:#}"))
    })
    .join()
    .unwrap_or_else(|_| Err("stack start panicked".into()))
}

/// Usage events on.
fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    S.get_or_start(|| {
        start(format!(
            "observability: {{usageEvents: true}}\n{TIERS_AND_MODELS}"
        ))
    })
}

/// The same policy without the switch.
fn stack_off() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    S.get_or_start(|| start(TIERS_AND_MODELS.to_string()))
}

/// The companion's pseudonym of `name`: `u-` and the first 8 bytes of HMAC-SHA256 in hex.
fn pseudonym(name: &str) -> String {
    use hmac::{Hmac, Mac};
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(PSEUDONYM_KEY).unwrap();
    mac.update(name.as_bytes());
    let digest = mac.finalize().into_bytes();
    let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("u-{hex}")
}

fn body(model: &str, extra: Value) -> Value {
    let mut b = json!({"model": model, "max_tokens": 5,
                       "messages": [{"role": "user", "content": format!("{MARKER} one two three")}]});
    for (k, v) in extra.as_object().cloned().unwrap_or_default() {
        b[k] = v;
    }
    b
}

async fn post(stack: &Stack, path: &str, cred: &str, extra: &[(&str, &str)], body: Value) -> Reply {
    let mut headers = vec![("authorization", bearer(cred))];
    headers.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
    let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    chat(stack, path, "usage-events", &h, body).await
}

/// A stream the client leaves after its first chunk (the simulator paces it).
async fn leave_mid_stream(stack: &Stack, cred: &str) {
    let mut resp = client()
        .post(format!("{}{CHAT}", stack.gateway_url()))
        .header("authorization", bearer(cred))
        .header("x-sim-chunk-delay-ms", "200")
        .json(&body(
            "sim-model",
            json!({"stream": true, "max_tokens": 40}),
        ))
        .send()
        .await
        .expect("gateway answers");
    assert_eq!(resp.status(), 200);
    let first = resp.chunk().await.expect("a first chunk");
    assert!(first.is_some_and(|c| !c.is_empty()));
    drop(resp);
}

/// The events file's lines, once it has `n` (each must be one JSON object).
async fn event_lines(stack: &Stack, n: usize) -> Vec<Value> {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(stack.usage_events_path()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        if lines.len() >= n {
            assert_eq!(lines.len(), n, "one line per counted request:\n{text}");
            assert!(
                !text.contains(MARKER),
                "a prompt in the usage events:\n{text}"
            );
            for name in ["evelyn-events", "timothy-tiny", "billy-billed"] {
                assert!(!text.contains(name), "{name} in clear:\n{text}");
            }
            return lines
                .iter()
                .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
                .collect();
        }
        assert!(
            start.elapsed() < DEADLINE,
            "{} of {n} usage events after {DEADLINE:?}:\n{text}",
            lines.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Per model: requests, prompt, completion, cached, refused by code, cost (in 10⁻²⁰ units).
type Sums = BTreeMap<String, (u64, u64, u64, u64, BTreeMap<String, u64>, u128)>;

/// A decimal (`"0.00003"`) in 10⁻²⁰ units, exactly.
fn decimal(s: &str) -> u128 {
    let (int, frac) = s.split_once('.').unwrap_or((s, ""));
    assert!(frac.len() <= 20, "{s}");
    let scaled = format!("{int}{frac:0<20}");
    scaled
        .parse()
        .unwrap_or_else(|_| panic!("not a decimal: {s}"))
}

/// What `user`'s events add up to, per model.
fn sums_of(events: &[Value], user: &str) -> Sums {
    let mut out = Sums::new();
    for e in events
        .iter()
        .map(|l| &l["event"])
        .filter(|e| e["user"] == user)
    {
        let s = out
            .entry(e["model"].as_str().unwrap().to_string())
            .or_default();
        s.0 += u64::from(e["forwarded"] == true);
        s.1 += e["input_tokens"].as_u64().unwrap();
        s.2 += e["output_tokens"].as_u64().unwrap();
        s.3 += e["cached_tokens"].as_u64().unwrap();
        for code in [&e["decision"], &e["shadow"]] {
            if let Some(code) = code.as_str().filter(|c| *c != "allowed") {
                *s.4.entry(code.to_string()).or_default() += 1;
            }
        }
        s.5 += decimal(e["cost"].as_str().unwrap());
    }
    out
}

/// `GET /v1/usage?groupBy=model` of `cred`, as [`Sums`].
async fn ledger_of(stack: &Stack, cred: &str) -> Sums {
    let r = send(
        client()
            .get(format!(
                "{}/maas-api/v1/usage?groupBy=model",
                stack.gateway_url()
            ))
            .header("authorization", bearer(cred)),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let n = |row: &Value, k: &str| row[k].as_u64().unwrap_or(0);
    v["data"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|row| {
            let refused = serde_json::from_value(row["refused"].clone()).unwrap_or_default();
            (
                row["model"].as_str().unwrap_or_default().to_string(),
                (
                    n(row, "requests"),
                    n(row, "promptTokens"),
                    n(row, "completionTokens"),
                    n(row, "cachedInputTokens"),
                    refused,
                    decimal(row["cost"].as_str().unwrap_or("0")),
                ),
            )
        })
        .collect()
}

/// Waits until the ledger shows exactly `want` for `cred`.
async fn ledger_shows(stack: &Stack, cred: &str, want: &Sums) {
    let start = Instant::now();
    loop {
        let last = ledger_of(stack, cred).await;
        if &last == want {
            return;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "the ledger never showed the events' sums for {cred}:\nevents {want:?}\nledger {last:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// evelyn's calls: every API family and the refusals that reach the ledger; the API key's.
async fn evelyn_calls(s: &Stack, key: &str) {
    // The provider says 2 of the prompt's tokens came from its prompt cache.
    let cached = [("x-sim-cached-tokens", "2")];
    let r = post(s, CHAT, key, &cached, body("sim-model", json!({}))).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        2
    );
    let stream = body("sim-model", json!({"stream": true}));
    let r = post(s, CHAT, "evelyn-token", &[], stream).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("data: [DONE]"), "{}", r.body);
    let embed = json!({"model": "sim-model", "input": [format!("{MARKER} a b"), "c d e"]});
    let r = post(s, EMBEDDINGS, "evelyn-token", &[], embed).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = post(
        s,
        MESSAGES,
        "evelyn-token",
        &[],
        body("sim-claude", json!({})),
    )
    .await;
    assert_eq!(r.json()["type"], "message", "{}", r.body);
    let r = post(
        s,
        TRANSLATED,
        "evelyn-token",
        &[],
        body("sim-claude", json!({})),
    )
    .await;
    assert_eq!(r.json()["object"], "chat.completion", "{}", r.body);
    leave_mid_stream(s, "evelyn-token").await;
    let r = post(
        s,
        LOCKED,
        "evelyn-token",
        &[],
        body("sim-locked", json!({})),
    )
    .await;
    r.error(403);
    let huge = body("sim-model", json!({"max_tokens": 200_000}));
    let r = post(s, CHAT, "evelyn-token", &[], huge).await;
    assert_eq!(r.error(400)["code"], "tokens_exceed_limit");
}

#[tokio::test]
async fn every_counted_request_has_one_event_and_they_add_up_to_the_ledger() {
    let s = stack();
    let minted = s
        .mint_key("evelyn-token", json!({"name": "events-key"}))
        .await
        .unwrap();
    let key = minted["key"].as_str().unwrap().to_string();
    let key_id = key
        .strip_prefix("sk-oai-")
        .and_then(|k| k.split_once('_'))
        .map(|(id, _)| id.to_string())
        .unwrap();
    evelyn_calls(s, &key).await;
    // timothy: one a day; the second is refused 429.
    let r = post(s, CHAT, "timothy-token", &[], body("sim-model", json!({}))).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = post(s, CHAT, "timothy-token", &[], body("sim-model", json!({}))).await;
    assert_eq!(r.error(429)["code"], "rate_limit_exceeded");
    // billy: under a subscription with a billing rate.
    let sub = [("x-maas-subscription", "billed")];
    for _ in 0..2 {
        let r = post(s, CHAT, "billy-token", &sub, body("sim-model", json!({}))).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    // Not authenticated: no subject, nothing counted, no event.
    let r = post(s, CHAT, "no-such-token", &[], body("sim-model", json!({}))).await;
    assert_eq!(r.status, 401);

    let lines = event_lines(s, 8 + 2 + 2).await;
    let users = [
        ("evelyn-token", "evelyn-events"),
        ("timothy-token", "timothy-tiny"),
        ("billy-token", "billy-billed"),
    ];
    for (cred, name) in users {
        let sums = sums_of(&lines, &pseudonym(name));
        assert!(!sums.is_empty(), "no event names {name}'s pseudonym");
        ledger_shows(s, cred, &sums).await;
    }
    assert!(
        lines.iter().all(|l| users
            .iter()
            .any(|(_, n)| l["event"]["user"] == pseudonym(n))),
        "every event names one of the users by pseudonym"
    );
    check_lines(&lines, &key, &key_id);
}

/// What Envoy adds to each line, and what the filter's event says of particular requests.
fn check_lines(lines: &[Value], key: &str, key_id: &str) {
    for l in lines {
        let text = l.to_string();
        let secret = key.split_once('_').map(|(_, s)| s).unwrap();
        assert!(!text.contains(key) && !text.contains(secret), "{text}");
        assert!(l["duration_ms"].is_u64() && l["status"].is_u64(), "{text}");
        assert!(l["start_time"].as_str().unwrap().ends_with('Z'), "{text}");
        // The route's cluster, even for a refusal; a host only when the request reached it.
        assert_eq!(l["backend"], "model-sim", "{text}");
        let forwarded = l["event"]["forwarded"] == true;
        assert_eq!(l["upstream_host"] != "-", forwarded, "{text}");
    }
    let with_key: Vec<&Value> = lines
        .iter()
        .filter(|l| l["event"]["key_id"] == key_id)
        .collect();
    assert_eq!(with_key.len(), 1, "the API key's one call");
    assert_eq!(with_key[0]["event"]["cached_tokens"], 2);
    // evelyn's fourth request on and past the shadow limit of 3: counted, not refused.
    assert!(
        lines
            .iter()
            .any(|l| l["event"]["shadow"] == "shadow_rate_limit_exceeded" && l["status"] == 200),
        "a shadow refusal: {lines:#?}"
    );
    let by = |decision: &str| {
        lines
            .iter()
            .find(|l| l["event"]["decision"] == decision)
            .unwrap_or_else(|| panic!("no {decision} event"))
    };
    assert_eq!(by("rate_limit_exceeded")["status"], 429);
    assert_eq!(by("rate_limit_exceeded")["event"]["tier"], "tiny");
    assert_eq!(by("tokens_exceed_limit")["status"], 400);
    let ops: Vec<&str> = lines
        .iter()
        .filter_map(|l| l["event"]["operation"].as_str())
        .collect();
    for op in ["chat.completions", "embeddings", "messages"] {
        assert!(ops.contains(&op), "{op} in {ops:?}");
    }
    let billed: Vec<&Value> = lines
        .iter()
        .filter(|l| l["event"]["subscription"] == "billed")
        .collect();
    assert_eq!(billed.len(), 2);
    for l in billed {
        assert_eq!(l["event"]["tier"], "subscription:billed");
        assert_ne!(l["event"]["cost"], "0", "{l}");
    }
    // The client that left: settled (forwarded, tokens) although its stream never ended.
    assert!(
        lines.iter().any(|l| l["event"]["forwarded"] == true
            && l["status"] == 200
            && l["response_flags"]
                .as_str()
                .is_some_and(|f| f.contains("DC"))),
        "the client that left mid-stream has its event: {lines:#?}"
    );
}

#[tokio::test]
async fn without_the_switch_the_events_file_stays_empty() {
    let s = stack_off();
    let r = post(s, CHAT, "olive-token", &[], body("sim-model", json!({}))).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = post(s, LOCKED, "olive-token", &[], body("sim-locked", json!({}))).await;
    r.error(403);
    // Both counted in the ledger (reported after the requests ended and were logged)…
    let start = Instant::now();
    loop {
        let sums = ledger_of(s, "olive-token").await;
        let counted: u64 = sums.values().map(|v| v.0 + v.4.values().sum::<u64>()).sum();
        if counted == 2 {
            break;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "the ledger never showed 2: {sums:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // …and no event.
    let text = std::fs::read_to_string(s.usage_events_path()).unwrap_or_default();
    assert_eq!(text, "", "no usage event with the switch off");
}
