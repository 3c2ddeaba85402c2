#![allow(clippy::indexing_slicing, clippy::panic, clippy::unwrap_used)]
//! The request's life, natively: every transition driven through the [`Http`] handle with a
//! [`RecordingHost`] playing Envoy for one worker.

use super::*;
use crate::authenticate::AUTHENTICATE_PATH;
use crate::cache::{CachedAnswer, CachedIdentity};
use crate::credential;
use crate::host::Body;
use crate::host::recording::{Call, RecordingHost, Sent};
use crate::request_body;
use crate::worker::Root;
use maas_types::CredentialsDocument;
use serde_json::{Value, json};

mod bedrock;
mod body;
mod cap;
mod cost;
mod gemini;
mod lease;
mod ledger;
mod observe;
mod one_url;
mod provider_paths;
mod respond;
mod routed;
mod scopes;
mod subscriptions;
mod translate;
mod usage_events;
mod weights;

pub(super) const COMPANION: &str = "maas-companion";
pub(super) const CHAT: &str = "/llm/sim/v1/chat/completions";

pub(super) fn policy() -> Value {
    json!({
        "tiers": [
            {"name": "free", "level": 0, "groups": ["system:authenticated"], "defaultMaxTokens": 100,
             "limits": {"requests": [{"limit": 3, "window": "1m"}],
                        "tokens": [{"limit": 1000, "window": "1m"}]}},
            {"name": "premium", "level": 1, "groups": ["premium"]}
        ],
        "models": [
            {"name": "sim", "path": "/llm/sim", "tiers": ["free", "premium"]},
            {"name": "big", "path": "/llm/big", "tiers": ["premium"]},
            {"name": "gpt", "path": "/ext/gpt", "tiers": ["free"],
             "provider": {"type": "openai", "credentialRef": "k"},
             "upstreamCluster": "outbound|443||api.openai.com"}
        ],
        "revokedKeyIds": []
    })
}

/// One worker (root context configured with `extra` merged into pluginConfig) and its host.
pub(super) struct Fx {
    pub host: RecordingHost,
    pub root: Root,
    next_id: std::cell::Cell<u32>,
}

impl Fx {
    pub fn new() -> Self {
        Self::with(json!({}))
    }

    pub fn with(extra: Value) -> Self {
        // Global limits (leases) only where a test turns them on (`Fx::global`).
        let mut cfg = json!({
            "companion": {"cluster": COMPANION},
            "bootstrapPolicy": policy(),
            "limits": {"global": {"enabled": false}},
        });
        for (k, v) in extra.as_object().unwrap() {
            cfg[k] = v.clone();
        }
        let host = RecordingHost::new();
        host.set_buffer(Body::PluginConfiguration, cfg.to_string().as_bytes());
        let mut root = Root::new(1);
        assert!(root.configure(&host));
        root.worker.borrow_mut().credentials = Rc::new(CredentialsDocument {
            credentials: [("k".to_string(), "sk-provider".to_string())].into(),
            ..Default::default()
        });
        host.dispatched.borrow_mut().clear();
        host.clear_calls();
        Fx {
            host,
            root,
            next_id: std::cell::Cell::new(10),
        }
    }

    pub fn http(&self) -> (u32, Http) {
        let id = self.context_id();
        (id, self.root.http(id))
    }

    /// A fresh context id (for a context made by the caller).
    pub fn context_id(&self) -> u32 {
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        id
    }

    /// Request headers arrive on context `id`.
    pub fn headers(&self, id: u32, h: &Http, headers: &[(&str, &str)], eos: bool) -> Action {
        self.host.enter(id);
        self.host.set_map(Headers::Request, headers);
        h.on_request_headers(&self.host, eos)
    }

    /// A whole request body arrives in one chunk ending the stream.
    pub fn body(&self, id: u32, h: &Http, body: &[u8], eos: bool) -> Action {
        self.host.enter(id);
        self.host.set_buffer(Body::Request, body);
        h.on_request_body(&self.host, body.len(), eos)
    }

    /// The companion answers the callout of context `id` (`status` None: no answer, a timeout).
    pub fn answer(&self, id: u32, h: &Http, status: Option<u32>, body: &[u8]) {
        self.host.enter(id);
        match status {
            Some(s) => self
                .host
                .set_map(Headers::CallResponse, &[(":status", &s.to_string())]),
            None => self.host.set_map(Headers::CallResponse, &[]),
        }
        self.host.set_buffer(Body::CallResponse, body);
        // The latest callout's token (Envoy hands the token of the call answered).
        let token = self.host.dispatched.borrow().last().map_or(0, |d| d.token);
        h.on_call_response(&self.host, token, body.len());
    }

    /// Hands the pending counters to the host (as a tick does).
    pub fn flush(&self) {
        self.root.worker.borrow().metrics.flush(&self.host);
    }

    /// Writes the refunds this worker folded (as its tick does, `crate::folds`).
    pub fn write_folds(&self) {
        let now = self.host.now.get() / 1000;
        self.root.worker.borrow_mut().folds.tick(&self.host, now);
    }

    pub fn sent_to(&self, id: u32) -> Option<Sent> {
        self.host
            .sent
            .borrow()
            .iter()
            .rev()
            .find(|s| s.context == id)
            .cloned()
    }

    pub fn dispatches(&self) -> usize {
        self.host
            .dispatched
            .borrow()
            .iter()
            .filter(|d| d.headers.iter().any(|(_, v)| v == AUTHENTICATE_PATH))
            .count()
    }

    pub fn resumed(&self, id: u32) -> bool {
        self.host.resumed.borrow().contains(&id)
    }

    pub fn phase(&self, h: &Http) -> String {
        format!("{:?}", h.0.borrow().phase())
    }

    /// A 200 answer of `content_type` passes in `chunks`: what the client got.
    pub fn pass_answer(&self, id: u32, h: &Http, content_type: &str, chunks: &[&[u8]]) -> Vec<u8> {
        self.host.enter(id);
        self.host.set_map(
            Headers::Response,
            &[
                (":status", "200"),
                ("content-type", content_type),
                ("content-length", "999"),
            ],
        );
        h.on_response_headers(&self.host);
        let mut out = Vec::new();
        for (i, c) in chunks.iter().enumerate() {
            self.host.set_buffer(Body::Response, c);
            h.on_response_body(&self.host, c.len(), i + 1 == chunks.len());
            out.extend(self.host.buffer(Body::Response));
        }
        out
    }

    /// Tokens counted for `subject` in the free tier's window.
    pub fn tokens_used(&self, subject: &str) -> u64 {
        let policy = self.root.worker.borrow().policy.clone().unwrap();
        limits::token_state(
            &self.host.store,
            &[&policy.tiers[0]],
            subject,
            self.host.now.get() / 1000,
            limits::DEFAULT_COUNTER_SLOTS,
        )
        .map_or(0, |s| s.used)
    }

    /// Puts an answer for `key` in the shared cache, as another worker would.
    pub fn cache(&self, key: &str, answer: CachedAnswer) {
        let id = credential::extract(None, Some(key))
            .unwrap()
            .cache_identity();
        cache::insert(
            &self.host.store,
            &id.cache_key,
            &id.verifier,
            &answer,
            60,
            self.host.now.get() / 1000,
            crate::config::PluginConfig::parse(
                json!({"companion": {"cluster": "c"}})
                    .to_string()
                    .as_bytes(),
            )
            .unwrap()
            .cache
            .max_entries,
        );
    }
}

pub(super) fn key(secret: u8) -> String {
    maas_types::apikey::format_key(&[1u8; 12], &[secret; 32]).1
}

pub(super) fn alice() -> Vec<u8> {
    json!({"subject": "alice", "groups": ["system:authenticated"], "tier": "free",
           "cache_ttl_seconds": 60})
    .to_string()
    .into_bytes()
}

pub(super) fn allow_alice() -> CachedAnswer {
    CachedAnswer::Allow(CachedIdentity {
        subject: "alice".into(),
        groups: vec!["system:authenticated".into()],
        pinned_tier: None,
        subscription: None,
        pseudonym: None,
        key_scope: None,
    })
}

/// Headers of a chat request with a JSON body carrying `key`.
pub(super) fn chat(key: &str) -> Vec<(&'static str, String)> {
    vec![
        (":method", "POST".to_string()),
        (":path", CHAT.to_string()),
        (":authority", "gw".to_string()),
        ("authorization", format!("Bearer {key}")),
        ("content-type", "application/json".to_string()),
        ("content-length", "60".to_string()),
        ("x-maas-subject", "forged".to_string()),
    ]
}

pub(super) fn refs<'a>(h: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    h.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

pub(super) const BODY: &[u8] =
    br#"{"model":"sim","messages":[{"role":"user","content":"hi"}],"max_tokens":50}"#;

#[test]
fn cache_hit_authorises_without_a_callout_and_cleans_the_headers() {
    let fx = Fx::new();
    fx.cache(&key(2), allow_alice());
    let (id, h) = fx.http();
    let a = fx.headers(id, &h, &refs(&chat(&key(2))), false);
    // Default mode: headers go on once authorised so that the body arrives.
    assert_eq!(a, Action::Continue);
    assert_eq!(fx.dispatches(), 0);
    assert!(
        fx.phase(&h)
            .starts_with("BodyBuffering { headers_held: false }")
    );
    let req = |n| fx.host.map_value(Headers::Request, n);
    assert_eq!(req("authorization"), None);
    assert_eq!(req("x-maas-subject"), None);
    assert_eq!(req("content-length"), None);
    assert_eq!(req("accept-encoding").as_deref(), Some("identity"));
    assert_eq!(fx.body(id, &h, BODY, true), Action::Continue);
    assert!(fx.phase(&h).starts_with("Forwarding"));
    assert!(fx.host.sent.borrow().is_empty());
}

/// The headers are read as one buffer; one the filter cannot read is an empty map, and a
/// request without a path or a credential is refused, never passed on.
#[test]
fn headers_the_filter_cannot_read_are_refused() {
    let fx = Fx::new();
    fx.cache(&key(2), allow_alice());
    fx.host.truncated_maps.borrow_mut().push(Headers::Request);
    let (id, h) = fx.http();
    assert_eq!(
        fx.headers(id, &h, &refs(&chat(&key(2))), false),
        Action::Pause
    );
    assert_eq!(fx.phase(&h), "Refused");
    assert_eq!(fx.host.last_sent().unwrap().status, 400);
    fx.host.truncated_maps.borrow_mut().clear();
    // No path at all.
    let (id, h) = fx.http();
    let mut no_path = chat(&key(2));
    no_path.retain(|(k, _)| *k != ":path");
    assert_eq!(fx.headers(id, &h, &refs(&no_path), false), Action::Pause);
    assert_eq!(fx.phase(&h), "Refused");
    assert_eq!(fx.host.last_sent().unwrap().status, 400);
    assert_eq!(fx.dispatches(), 0);
}

#[test]
fn miss_dispatches_one_callout_and_an_allow_resumes_and_is_cached() {
    let fx = Fx::new();
    let (id, h) = fx.http();
    assert_eq!(
        fx.headers(id, &h, &refs(&chat(&key(2))), false),
        Action::Pause
    );
    assert!(fx.phase(&h).contains("OwnCallout"));
    let d = fx.host.dispatched.borrow()[0].clone();
    assert_eq!(d.cluster, COMPANION);
    let sent: Value = serde_json::from_slice(d.body.as_deref().unwrap()).unwrap();
    assert_eq!(sent["credential"], key(2));
    fx.answer(id, &h, Some(200), &alice());
    assert!(fx.resumed(id), "the paused headers go on");
    assert!(fx.phase(&h).starts_with("BodyBuffering"));
    // Cleaned from the headers read before the callout (kept in the request meanwhile).
    let req = |n| fx.host.map_value(Headers::Request, n);
    assert_eq!(req("authorization"), None);
    assert_eq!(req("x-maas-subject"), None);
    assert_eq!(req("accept-encoding").as_deref(), Some("identity"));
    assert_eq!(fx.body(id, &h, BODY, true), Action::Continue);
    assert!(!fx.host.recorded.borrow().is_empty(), "callout latency");
    // The next request of the same credential hits the cache.
    let (id2, h2) = fx.http();
    assert_eq!(
        fx.headers(id2, &h2, &refs(&chat(&key(2))), false),
        Action::Continue
    );
    assert_eq!(fx.dispatches(), 1);
}

fn refused_by_companion(status: Option<u32>, body: &[u8]) -> (Fx, Sent) {
    let fx = Fx::new();
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    fx.answer(id, &h, status, body);
    assert!(!fx.resumed(id), "a refused request is never resumed");
    assert!(fx.phase(&h).starts_with("Refused"));
    let s = fx.sent_to(id).unwrap();
    (fx, s)
}

fn second_request_dispatches(fx: &Fx) -> bool {
    let before = fx.dispatches();
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    fx.dispatches() > before
}

#[test]
fn callout_401_refuses_and_caches_the_denial() {
    let body = json!({"error": {"message": "unknown key", "type": "authentication_error"}});
    let (fx, s) = refused_by_companion(Some(401), body.to_string().as_bytes());
    assert_eq!(s.status, 401);
    assert_eq!(s.header("www-authenticate"), Some("Bearer"));
    assert!(String::from_utf8_lossy(&s.body).contains("unknown key"));
    assert!(!second_request_dispatches(&fx), "negative answer cached");
    assert_eq!(fx.sent_to(11).unwrap().status, 401);
}

#[test]
fn callout_403_refuses_with_no_tier() {
    let (_, s) = refused_by_companion(Some(403), b"{}");
    assert_eq!((s.status, s.code().as_str()), (403, "no_tier"));
}

#[test]
fn callout_5xx_refuses_503_and_is_not_cached() {
    let (fx, s) = refused_by_companion(Some(503), b"");
    assert_eq!((s.status, s.code().as_str()), (503, "auth_unavailable"));
    fx.flush();
    assert_eq!(fx.host.metric(crate::metrics::CALLOUT_FAILED), 1);
    assert!(second_request_dispatches(&fx));
}

#[test]
fn callout_timeout_without_response_refuses_503() {
    let (fx, s) = refused_by_companion(None, b"");
    assert_eq!((s.status, s.code().as_str()), (503, "auth_unavailable"));
    assert!(second_request_dispatches(&fx));
}

#[test]
fn callout_failure_takes_what_another_worker_cached_meanwhile() {
    let fx = Fx::new();
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    fx.cache(&key(2), allow_alice());
    fx.answer(id, &h, Some(503), b"");
    assert!(fx.resumed(id));
    assert!(fx.host.sent.borrow().is_empty());
}

#[test]
fn unreadable_callout_answer_refuses_503() {
    let (fx, s) = refused_by_companion(Some(200), b"{not json");
    assert_eq!((s.status, s.code().as_str()), (503, "auth_unavailable"));
    assert!(second_request_dispatches(&fx), "nothing cached");
}

#[test]
fn dispatch_failure_refuses_503() {
    let fx = Fx::new();
    fx.host.dispatch_fails.set(true);
    let (id, h) = fx.http();
    assert_eq!(
        fx.headers(id, &h, &refs(&chat(&key(2))), false),
        Action::Pause
    );
    let s = fx.sent_to(id).unwrap();
    assert_eq!((s.status, s.code().as_str()), (503, "auth_unavailable"));
    assert!(fx.root.worker.borrow().waiting.is_empty());
}

#[test]
fn waiters_of_the_same_credential_share_one_callout_and_are_woken_with_its_answer() {
    let fx = Fx::new();
    let (a, ha) = fx.http();
    let (b, hb) = fx.http();
    let (c, hc) = fx.http();
    fx.headers(a, &ha, &refs(&chat(&key(2))), false);
    assert_eq!(
        fx.headers(b, &hb, &refs(&chat(&key(2))), false),
        Action::Pause
    );
    assert_eq!(
        fx.headers(c, &hc, &refs(&chat(&key(2))), false),
        Action::Pause
    );
    assert_eq!(fx.dispatches(), 1);
    assert!(fx.phase(&hb).contains("OtherRequest"));
    fx.answer(a, &ha, Some(200), &alice());
    for id in [a, b, c] {
        assert!(fx.resumed(id), "context {id} resumed");
    }
    assert!(fx.phase(&hc).starts_with("BodyBuffering"));
    assert!(fx.root.worker.borrow().waiting.is_empty());
    // The effective context is given back to the request that made the callout.
    assert_eq!(fx.host.effective.get(), a);
}

#[test]
fn a_wrong_secret_with_the_same_key_id_never_shares_the_owners_callout() {
    let fx = Fx::new();
    let (a, ha) = fx.http();
    let (b, hb) = fx.http();
    fx.headers(a, &ha, &refs(&chat(&key(2))), false);
    fx.headers(b, &hb, &refs(&chat(&key(3))), false);
    assert_eq!(fx.dispatches(), 2, "each secret asks for itself");
    assert!(fx.phase(&hb).contains("OwnCallout"));
    fx.answer(a, &ha, Some(200), &alice());
    assert!(fx.resumed(a));
    assert!(
        !fx.resumed(b),
        "the owner's answer never reaches the wrong secret"
    );
    fx.answer(b, &hb, Some(401), b"{}");
    assert_eq!(fx.sent_to(b).unwrap().status, 401);
}

#[test]
fn a_waiter_holding_another_credential_is_interrupted_not_answered() {
    // Defence in depth: a list entry whose credential differs gets 503, never the answer.
    let fx = Fx::new();
    let (a, ha) = fx.http();
    let (b, hb) = fx.http();
    fx.headers(a, &ha, &refs(&chat(&key(2))), false);
    fx.headers(b, &hb, &refs(&chat(&key(3))), false);
    let flight = credential::extract(None, Some(&key(2)))
        .unwrap()
        .cache_identity()
        .flight_key();
    fx.root
        .worker
        .borrow_mut()
        .waiting
        .get_mut(&flight)
        .unwrap()
        .push(b);
    fx.answer(a, &ha, Some(200), &alice());
    let s = fx.sent_to(b).unwrap();
    assert_eq!((s.status, s.code().as_str()), (503, "auth_interrupted"));
}

#[test]
fn the_request_that_made_the_callout_going_away_interrupts_its_waiters() {
    let fx = Fx::new();
    let (a, ha) = fx.http();
    let (b, hb) = fx.http();
    fx.headers(a, &ha, &refs(&chat(&key(2))), false);
    fx.headers(b, &hb, &refs(&chat(&key(2))), false);
    fx.host.enter(a);
    assert!(ha.on_done(&fx.host));
    let s = fx.sent_to(b).unwrap();
    assert_eq!((s.status, s.code().as_str()), (503, "auth_interrupted"));
    assert!(fx.root.worker.borrow().waiting.is_empty());
    // A new request for the credential makes a new callout.
    assert!(second_request_dispatches(&fx));
}

#[test]
fn a_waiter_going_away_leaves_the_list() {
    let fx = Fx::new();
    let (a, ha) = fx.http();
    let (b, hb) = fx.http();
    fx.headers(a, &ha, &refs(&chat(&key(2))), false);
    fx.headers(b, &hb, &refs(&chat(&key(2))), false);
    fx.host.enter(b);
    hb.on_done(&fx.host);
    let w = fx.root.worker.borrow();
    assert_eq!(w.waiting.values().map(Vec::len).sum::<usize>(), 0);
}

#[test]
fn a_waiter_whose_context_is_gone_is_skipped() {
    let fx = Fx::new();
    let (a, ha) = fx.http();
    let (b, hb) = fx.http();
    fx.headers(a, &ha, &refs(&chat(&key(2))), false);
    fx.headers(b, &hb, &refs(&chat(&key(2))), false);
    fx.host.gone.borrow_mut().push(b);
    fx.answer(a, &ha, Some(200), &alice());
    assert!(fx.resumed(a));
    assert!(!fx.resumed(b));
    assert!(fx.phase(&hb).contains("Authenticating"));
}

#[test]
fn policy_changing_while_authenticating_is_decided_with_the_new_policy() {
    let fx = Fx::new();
    let (a, ha) = fx.http();
    fx.headers(a, &ha, &refs(&chat(&key(2))), false);
    // The model is now premium-only: alice (free) is refused with the new policy.
    let mut p = policy();
    p["models"][0]["tiers"] = json!(["premium"]);
    fx.root.worker.borrow_mut().policy = Some(Rc::new(PolicyDocument::from_value(p).unwrap()));
    fx.answer(a, &ha, Some(200), &alice());
    let s = fx.sent_to(a).unwrap();
    assert_eq!((s.status, s.code().as_str()), (403, "model_not_allowed"));
    // And a model removed meanwhile is not found.
    let (b, hb) = fx.http();
    fx.headers(b, &hb, &refs(&chat(&key(3))), false);
    let mut p = policy();
    p["models"][0]["path"] = json!("/llm/other");
    p["models"][0]["name"] = json!("other");
    fx.root.worker.borrow_mut().policy = Some(Rc::new(PolicyDocument::from_value(p).unwrap()));
    fx.answer(b, &hb, Some(200), &alice());
    assert_eq!(fx.sent_to(b).unwrap().status, 404);
}

#[test]
fn a_revoked_key_is_refused_401_and_its_cache_entry_evicted() {
    let fx = Fx::new();
    fx.cache(&key(2), allow_alice());
    let key_id = credential::extract(None, Some(&key(2)))
        .unwrap()
        .cache_identity()
        .key_id()
        .unwrap()
        .to_string();
    std::rc::Rc::make_mut(&mut fx.root.worker.borrow_mut().revoked).insert(key_id);
    let (id, h) = fx.http();
    assert_eq!(
        fx.headers(id, &h, &refs(&chat(&key(2))), false),
        Action::Pause
    );
    let s = fx.sent_to(id).unwrap();
    assert_eq!(s.status, 401);
    assert!(String::from_utf8_lossy(&s.body).contains("key revoked"));
    assert_eq!(fx.host.store.len(), 0, "evicted");
    assert_eq!(fx.dispatches(), 0);
}

#[test]
fn a_cached_denial_refuses_without_a_callout() {
    let fx = Fx::new();
    fx.cache(
        &key(2),
        CachedAnswer::Deny {
            status: 401,
            message: "expired".into(),
        },
    );
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    assert_eq!(fx.sent_to(id).unwrap().status, 401);
    assert_eq!(fx.dispatches(), 0);
}

/// Issue 10 item 3, natively: a callback that finds the request's state busy (re-entered)
/// refuses with 500 and pauses; it never lets the request through.
#[test]
fn busy_state_refuses_every_request_callback() {
    let fx = Fx::new();
    let (id, h) = fx.http();
    fx.host.enter(id);
    fx.host.set_map(Headers::Request, &refs(&chat(&key(2))));
    let _busy = h.0.borrow_mut();
    for action in [
        h.on_request_headers(&fx.host, false),
        h.on_request_body(&fx.host, 10, true),
        h.on_request_trailers(&fx.host),
    ] {
        assert_eq!(action, Action::Pause);
        let s = fx.host.last_sent().unwrap();
        assert_eq!((s.status, s.code().as_str()), (500, "gateway_internal"));
    }
    assert_eq!(fx.host.sent.borrow().len(), 3);
    assert_eq!(fx.dispatches(), 0);
    // The response side lets the response pass (nothing left to protect).
    assert_eq!(h.on_response_headers(&fx.host), Action::Continue);
}

#[test]
fn without_configuration_every_request_is_refused() {
    let host = RecordingHost::new();
    let root = Root::new(1);
    let h = root.http(5);
    host.enter(5);
    host.set_map(Headers::Request, &refs(&chat(&key(2))));
    assert_eq!(h.on_request_headers(&host, false), Action::Pause);
    assert_eq!(host.last_sent().unwrap().code(), "not_configured");
    // A body reaching an unconfigured request is refused too, never passed.
    let mut r = Request::new(6, root.worker.clone(), Registry::default());
    r.body.start(false, None);
    r.phase = Phase::BodyBuffering {
        headers_held: false,
        slot_read: None,
    };
    assert_eq!(r.on_body(&host, 3, true), Action::Pause);
    assert_eq!(host.last_sent().unwrap().status, 503);
}

#[test]
fn management_paths_pass_without_the_reserved_headers() {
    let fx = Fx::new();
    let (id, h) = fx.http();
    let a = fx.headers(
        id,
        &h,
        &[
            (":method", "POST"),
            (":path", "/maas-api/v1/keys"),
            ("authorization", "Bearer t"),
            ("x-maas-subject", "forged"),
        ],
        false,
    );
    assert_eq!(a, Action::Continue);
    assert!(fx.phase(&h).starts_with("PassedThrough"));
    assert_eq!(fx.host.map_value(Headers::Request, "x-maas-subject"), None);
    assert!(
        fx.host
            .map_value(Headers::Request, "authorization")
            .is_some()
    );
    assert_eq!(fx.dispatches(), 0);
    // Its body is not touched.
    assert_eq!(fx.body(id, &h, b"{}", true), Action::Continue);
}

/// Issue 26 item 5: every spelling a CGI/WSGI backend reads as the gateway's identity header
/// (`HTTP_X_MAAS_USER`) or a credential is removed, on model and management paths alike.
#[test]
fn underscore_spellings_of_reserved_and_credential_headers_are_removed() {
    let spellings = [
        "x_maas_user",
        "X_MAAS_USER",
        "x-maas_groups",
        "x_maas_subscription",
        "x_api_key",
        "X_API-KEY",
    ];
    let fx = Fx::new();
    fx.cache(&key(2), allow_alice());
    let (id, h) = fx.http();
    let mut headers = chat(&key(2));
    headers.extend(spellings.iter().map(|n| (*n, "forged".to_string())));
    headers.push(("x_request_id", "kept".to_string()));
    assert_eq!(fx.headers(id, &h, &refs(&headers), false), Action::Continue);
    for name in spellings {
        assert_eq!(
            fx.host.map_value(Headers::Request, name),
            None,
            "model path: {name}"
        );
    }
    assert_eq!(
        fx.host
            .map_value(Headers::Request, "x_request_id")
            .as_deref(),
        Some("kept")
    );

    let (id, h) = fx.http();
    let mut headers = vec![
        (":method", "GET"),
        (":path", "/maas-api/v1/models"),
        ("authorization", "Bearer t"),
        ("x-api-key", "k"),
    ];
    headers.extend(spellings.iter().map(|n| (*n, "forged")));
    assert_eq!(fx.headers(id, &h, &headers, true), Action::Continue);
    assert!(fx.phase(&h).starts_with("PassedThrough"));
    for name in spellings {
        assert_eq!(
            fx.host.map_value(Headers::Request, name),
            None,
            "management path: {name}"
        );
    }
    // The companion authenticates management requests itself: their credential stays.
    for name in ["authorization", "x-api-key"] {
        assert!(
            fx.host.map_value(Headers::Request, name).is_some(),
            "{name}"
        );
    }
}

#[test]
fn calls_are_recorded_in_order() {
    let fx = Fx::new();
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    let calls = fx.host.calls.borrow();
    assert_eq!(calls[0], Call::Headers(Headers::Request));
    assert!(calls.iter().any(|c| matches!(c, Call::Dispatch(_))));
}

/// Reads of the shared cache's slots (`maas/c/<n>`) since the calls were last cleared.
fn cache_reads(fx: &Fx) -> usize {
    fx.host
        .calls
        .borrow()
        .iter()
        .filter(|c| matches!(c, Call::SharedGet(k) if k.starts_with("maas/c/")))
        .count()
}

/// A cached caller's request on a fresh context; the status it was refused with (0: allowed).
fn cached_request(fx: &Fx, key: &str) -> u32 {
    let (id, h) = fx.http();
    fx.host.clear_calls();
    fx.headers(id, &h, &refs(&chat(key)), false);
    fx.sent_to(id).map_or(0, |s| s.status)
}

#[test]
fn a_worker_answers_from_its_own_copy_without_reading_the_shared_cache() {
    let fx = Fx::new();
    fx.cache(&key(2), allow_alice());
    assert_eq!(cached_request(&fx, &key(2)), 0);
    assert_eq!(cache_reads(&fx), 1, "the first request reads shared data");
    assert_eq!(cached_request(&fx, &key(2)), 0);
    assert_eq!(cache_reads(&fx), 0, "the second one does not");
    assert_eq!(fx.dispatches(), 0);
}

#[test]
fn a_wrong_secret_never_gets_the_owners_copy() {
    let fx = Fx::new();
    fx.cache(&key(2), allow_alice());
    assert_eq!(cached_request(&fx, &key(2)), 0);
    // Same key id, another secret: not served from the owner's copy, asks the companion.
    let (id, h) = fx.http();
    assert_eq!(
        fx.headers(id, &h, &refs(&chat(&key(3))), false),
        Action::Pause
    );
    assert!(fx.phase(&h).contains("OwnCallout"));
    assert_eq!(fx.dispatches(), 1);
}

#[test]
fn what_changes_in_shared_data_is_seen_within_one_poll_interval() {
    let fx = Fx::with(json!({"pollIntervalMs": 2000}));
    fx.cache(&key(2), allow_alice());
    assert_eq!(cached_request(&fx, &key(2)), 0);
    // Another worker caches a refusal for the very same credential.
    fx.cache(
        &key(2),
        CachedAnswer::Deny {
            status: 401,
            message: "key deleted".into(),
        },
    );
    fx.host.now.set(fx.host.now.get() + 1000);
    assert_eq!(cached_request(&fx, &key(2)), 0, "within the poll interval");
    fx.host.now.set(fx.host.now.get() + 1000);
    assert_eq!(cached_request(&fx, &key(2)), 401, "one poll interval later");
}

#[test]
fn the_workers_copy_expires_with_the_shared_entry() {
    let fx = Fx::with(json!({"pollIntervalMs": 60000}));
    let id = credential::extract(None, Some(&key(2)))
        .unwrap()
        .cache_identity();
    let now_s = fx.host.now.get() / 1000;
    cache::insert(
        &fx.host.store,
        &id.cache_key,
        &id.verifier,
        &allow_alice(),
        5,
        now_s,
        fx.root
            .worker
            .borrow()
            .config
            .as_ref()
            .unwrap()
            .cache
            .max_entries,
    );
    assert_eq!(cached_request(&fx, &key(2)), 0);
    fx.host.now.set(fx.host.now.get() + 5000);
    let (rid, h) = fx.http();
    assert_eq!(
        fx.headers(rid, &h, &refs(&chat(&key(2))), false),
        Action::Pause
    );
    assert_eq!(
        fx.dispatches(),
        1,
        "expired with the shared entry: asks again"
    );
}

#[test]
fn a_revoked_key_is_refused_even_with_a_workers_copy() {
    let fx = Fx::new();
    fx.cache(&key(2), allow_alice());
    assert_eq!(cached_request(&fx, &key(2)), 0);
    let key_id = credential::extract(None, Some(&key(2)))
        .unwrap()
        .cache_identity()
        .key_id()
        .unwrap()
        .to_string();
    std::rc::Rc::make_mut(&mut fx.root.worker.borrow_mut().revoked).insert(key_id);
    assert_eq!(cached_request(&fx, &key(2)), 401);
}
