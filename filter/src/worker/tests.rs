#![allow(clippy::indexing_slicing, clippy::panic, clippy::unwrap_used)]
//! The root context's logic natively: configuration, polling, policy swaps, metrics.

use super::*;
use crate::cache::{self, CachedAnswer, CachedIdentity};
use crate::host::recording::RecordingHost;
use serde_json::json;

fn configured(extra: serde_json::Value) -> (RecordingHost, Root) {
    // Global limits (leases) only where a test turns them on.
    let mut cfg = json!({"companion": {"cluster": "maas-companion"}, "pollIntervalMs": 5000,
                         "limits": {"global": {"enabled": false}}});
    for (k, v) in extra.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    let host = RecordingHost::new();
    host.set_buffer(Body::PluginConfiguration, cfg.to_string().as_bytes());
    let mut root = Root::new(1);
    assert!(root.configure(&host));
    (host, root)
}

fn policy(revoked: &[&str]) -> Vec<u8> {
    json!({"tiers": [{"name": "free", "level": 0, "groups": ["g"]}],
           "models": [{"name": "sim", "path": "/llm/sim", "tiers": ["free"]}],
           "revokedKeyIds": revoked})
    .to_string()
    .into_bytes()
}

fn answer(host: &RecordingHost, root: &mut Root, token: u32, status: u32, etag: &str, body: &[u8]) {
    host.set_map(
        Headers::CallResponse,
        &[(":status", &status.to_string()), ("etag", etag)],
    );
    host.set_buffer(Body::CallResponse, body);
    root.on_call_response(host, token, body.len());
}

#[test]
fn an_invalid_configuration_does_not_start_the_filter() {
    let host = RecordingHost::new();
    host.set_buffer(Body::PluginConfiguration, b"{\"companion\":{}}");
    let mut root = Root::new(1);
    assert!(!root.configure(&host));
    assert!(root.worker.borrow().config.is_none());
    assert!(host.dispatched.borrow().is_empty());
}

#[test]
fn configuration_polls_policy_and_credentials_at_once_and_retries_quickly() {
    let (host, mut root) = configured(json!({}));
    let paths: Vec<String> = host
        .dispatched
        .borrow()
        .iter()
        .map(|d| d.headers[1].1.clone())
        .collect();
    assert_eq!(paths, [POLICY_PATH, CREDENTIALS_PATH]);
    // No answer yet: the next poll comes within 500 ms, not the poll interval.
    answer(&host, &mut root, 1, 503, "", b"");
    answer(&host, &mut root, 2, 503, "", b"");
    host.now.set(host.now.get() + 500);
    root.tick(&host);
    assert_eq!(host.dispatched.borrow().len(), 4);
    // Once the policy answered, polls carry If-None-Match and follow the interval.
    answer(&host, &mut root, 3, 200, "\"p1\"", &policy(&[]));
    answer(&host, &mut root, 4, 304, "", b"");
    host.now.set(host.now.get() + 500);
    root.tick(&host);
    assert_eq!(host.dispatched.borrow().len(), 6);
    assert!(
        host.dispatched.borrow()[4]
            .headers
            .contains(&("if-none-match".into(), "\"p1\"".into()))
    );
    answer(&host, &mut root, 5, 304, "", b"");
    answer(&host, &mut root, 6, 304, "", b"");
    host.now.set(host.now.get() + 4999);
    root.tick(&host);
    assert_eq!(host.dispatched.borrow().len(), 6);
    host.now.set(host.now.get() + 1);
    root.tick(&host);
    assert_eq!(host.dispatched.borrow().len(), 8);
}

#[test]
fn a_polled_policy_replaces_the_bootstrap_one_and_evicts_newly_revoked_keys() {
    let (host, mut root) = configured(
        json!({"bootstrapPolicy": serde_json::from_slice::<serde_json::Value>(&policy(&[])).unwrap()}),
    );
    assert!(root.worker.borrow().policy.is_some());
    let key_id = "abcdefghijklmnopq";
    let max = root
        .worker
        .borrow()
        .config
        .as_ref()
        .unwrap()
        .cache
        .max_entries;
    let ck = credential::api_key_cache_key(key_id);
    cache::insert(
        &host.store,
        &ck,
        &[7; 32],
        &CachedAnswer::Allow(CachedIdentity {
            subject: "s".into(),
            groups: vec![],
            pinned_tier: None,
            subscription: None,
            pseudonym: None,
            key_scope: None,
        }),
        60,
        host.now.get() / 1000,
        max,
    );
    assert_eq!(host.store.len(), 1);
    answer(&host, &mut root, 1, 200, "\"p2\"", &policy(&[key_id]));
    let w = root.worker.borrow();
    assert!(w.revoked.contains(key_id));
    assert_eq!(w.policy_etag.as_deref(), Some("\"p2\""));
    assert_eq!(host.store.len(), 0, "evicted");
    w.metrics.flush(&host);
    assert_eq!(host.metric(crate::metrics::POLICY_UPDATES), 1);
}

#[test]
fn an_invalid_policy_is_rejected_and_the_current_one_kept() {
    let (host, mut root) = configured(json!({}));
    answer(&host, &mut root, 1, 200, "\"p1\"", &policy(&[]));
    let before = root.worker.borrow().policy.clone().unwrap();
    answer(&host, &mut root, 3, 200, "\"bad\"", b"{\"tiers\": 5}");
    // Token 3 is not a poll of ours: ignored. Poll again and answer badly.
    root.policy_call = Some(9);
    answer(&host, &mut root, 9, 200, "\"bad\"", b"{\"tiers\": 5}");
    let w = root.worker.borrow();
    assert!(Rc::ptr_eq(w.policy.as_ref().unwrap(), &before));
    assert_eq!(w.policy_etag.as_deref(), Some("\"bad\""));
    w.metrics.flush(&host);
    assert_eq!(host.metric(crate::metrics::POLICY_REJECTED), 1);
}

#[test]
fn provider_credentials_are_swapped_on_a_valid_document_only() {
    let (host, mut root) = configured(json!({}));
    answer(
        &host,
        &mut root,
        2,
        200,
        "\"c1\"",
        b"{\"credentials\": {\"k\": \"v\"}}",
    );
    assert_eq!(root.worker.borrow().credentials.credentials["k"], "v");
    root.credentials_call = Some(7);
    answer(&host, &mut root, 7, 200, "\"c2\"", b"[]");
    let w = root.worker.borrow();
    assert_eq!(w.credentials.credentials["k"], "v");
    assert_eq!(w.credentials_etag.as_deref(), Some("\"c1\""));
}

#[test]
fn counters_are_handed_to_the_host_once_per_tick() {
    let (host, mut root) = configured(json!({}));
    {
        let w = root.worker.borrow();
        w.metrics.inc(w.metrics.cache_hit, 1);
        w.metrics.inc(w.metrics.cache_hit, 2);
        w.metrics.inc(0, 5);
    }
    assert_eq!(
        host.metric(crate::metrics::CACHE_HIT),
        0,
        "not before the tick"
    );
    root.tick(&host);
    assert_eq!(host.metric(crate::metrics::CACHE_HIT), 3);
    host.clear_calls();
    root.tick(&host);
    assert!(
        !host
            .calls
            .borrow()
            .iter()
            .any(|c| matches!(c, crate::host::recording::Call::IncrementMetric(..))),
        "nothing pending: no call"
    );
}

#[test]
fn a_newly_revoked_key_leaves_the_workers_copy() {
    let (host, mut root) = configured(
        json!({"bootstrapPolicy": serde_json::from_slice::<serde_json::Value>(&policy(&[])).unwrap()}),
    );
    let allow = crate::cache::Caller::new(CachedIdentity {
        subject: "s".into(),
        groups: vec![],
        pinned_tier: None,
        subscription: None,
        pseudonym: None,
        key_scope: None,
    });
    let now = host.now.get() / 1000;
    let copy = |key_id: &str, verifier: u8| credential::CacheIdentity {
        cache_key: credential::api_key_cache_key(key_id),
        verifier: [verifier; 32],
    };
    let (revoked, kept) = (copy("abcdefghijklmnopq", 7), copy("bbcdefghijklmnopq", 8));
    {
        let mut w = root.worker.borrow_mut();
        let (rk, kk) = (w.local_cache.key("revoked"), w.local_cache.key("kept"));
        w.local_cache
            .put((rk, &revoked), &allow, String::new, now + 60, 5, now);
        w.local_cache
            .put((kk, &kept), &allow, String::new, now + 60, 5, now);
        assert_eq!(w.local_cache.len(), 2);
    }
    answer(
        &host,
        &mut root,
        1,
        200,
        "\"p2\"",
        &policy(&["abcdefghijklmnopq"]),
    );
    let w = root.worker.borrow();
    assert!(
        w.local_cache
            .get(w.local_cache.key("revoked"), now)
            .is_none()
    );
    assert!(w.local_cache.get(w.local_cache.key("kept"), now).is_some());
}

mod leases;
