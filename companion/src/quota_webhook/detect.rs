//! Which quota warnings a lease counter's global count gives: pure functions over the policy.
//!
//! A lease item names a counter (the user, or `subscription␟model␟user` for a subscription's
//! budget: [`maas_types::subscription::counter_subject`]), its kind, window and start, and the
//! limit the gateway checks it against; the store answers the counter's `taken` after the item —
//! the count `GET /v1/quota` shows as `used`. The limit is found again in the policy: under a
//! subscription its model's limits; else the first tier (policy order) with an enforced limit of
//! that kind, window and value (the tightest limit of the request's tiers, as the gateway
//! chose it). That limit's `warnAt` gives the thresholds; a shadow limit of the same kind and
//! window in the same tier or subscription model warns too (`shadow: true`). Every threshold at
//! or below the percentage used (`crate::usage::api::warning`, the `/v1/quota` arithmetic) is a
//! [`Crossing`]; which of them were already sent is for the caller to know.

use crate::usage::api::warning;
use maas_types::ScopeCounter;
use maas_types::lease::{LeaseItem, LeaseKind};
use maas_types::subscription::COUNTER_SEPARATOR;
use maas_types::{Limit, PolicyDocument, Window};
use sha2::{Digest, Sha256};

/// Whose limit it is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Scope {
    Tier(String),
    /// A subscription's budget on one model.
    Subscription {
        name: String,
        model: String,
    },
    /// A scope's (`scopes[].name`); `key_id`: a scope `per: key`'s counter of that API key.
    Named {
        name: String,
        key_id: Option<String>,
    },
}

impl Scope {
    /// `(scope, model)` as the unique key stores them: `tier:<name>` or
    /// `subscription:<name>`, and the model (`""` for a tier).
    pub fn columns(&self) -> (String, &str) {
        match self {
            Scope::Tier(name) => (format!("tier:{name}"), ""),
            Scope::Subscription { name, model } => (format!("subscription:{name}"), model),
            // A key's counter: its id in the model column (a scope has no model).
            Scope::Named { name, key_id } => {
                (format!("scope:{name}"), key_id.as_deref().unwrap_or(""))
            }
        }
    }
}

/// A threshold a window's count is at or past.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Crossing {
    /// The user's name (the event carries its keyed pseudonym, the key its SHA-256).
    pub user: String,
    pub scope: Scope,
    pub kind: LeaseKind,
    pub window: Window,
    /// Unix seconds.
    pub window_start: u64,
    pub limit: u64,
    pub used: u64,
    /// At most 100.
    pub percent_used: u64,
    pub threshold: u8,
    pub shadow: bool,
}

/// A crossing's identity: the columns of `quota_warnings_once` (migration 0007).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Key {
    /// Hex SHA-256 of the user's name.
    pub subject_sha256: String,
    pub scope: String,
    pub model: String,
    pub kind: &'static str,
    pub window_seconds: u64,
    pub window_start: u64,
    pub threshold: u8,
    pub shadow: bool,
}

impl Crossing {
    pub fn key(&self) -> Key {
        let (scope, model) = self.scope.columns();
        Key {
            subject_sha256: hex::encode(Sha256::digest(self.user.as_bytes())),
            model: model.to_string(),
            scope,
            kind: self.kind.as_str(),
            window_seconds: self.window.seconds(),
            window_start: self.window_start,
            threshold: self.threshold,
            shadow: self.shadow,
        }
    }

    /// When the window ends (Unix seconds).
    pub fn window_end(&self) -> u64 {
        self.window_start.saturating_add(self.window.seconds())
    }
}

/// The limits a counter is checked against.
struct Governing<'a> {
    user: &'a str,
    scope: Scope,
    enforced: u64,
    shadow: Option<u64>,
    warn_at: &'a [u8],
}

/// A scope's limits of `kind` (money budgets as limits in nano-units).
fn of_kind(
    requests: &[Limit],
    tokens: &[Limit],
    budgets: &[maas_types::Budget],
    kind: LeaseKind,
) -> Vec<Limit> {
    match kind {
        LeaseKind::Requests => requests.to_vec(),
        LeaseKind::Tokens => tokens.to_vec(),
        LeaseKind::Cost => budgets.iter().map(maas_types::Budget::as_limit).collect(),
    }
}

/// The shadow limit of `window` among `limits`.
fn shadow_of(limits: &[Limit], window: Window) -> Option<u64> {
    limits
        .iter()
        .find(|l| l.shadow && l.window == window)
        .map(|l| l.limit)
}

/// The scope, limits and thresholds of `item`'s counter under `policy`; `None` when the policy
/// no longer has them (a subscription, model or tier limit removed since the gateway asked).
fn governing<'a>(
    policy: &'a PolicyDocument,
    item: &'a LeaseItem,
    window: Window,
) -> Option<Governing<'a>> {
    if let Some((name, whose)) = maas_types::policy::scope::parse_counter_subject(&item.subject) {
        return scope_governing(policy, item, window, name, whose);
    }
    let mut parts = item.subject.splitn(3, COUNTER_SEPARATOR);
    let first = parts.next()?;
    match (parts.next(), parts.next()) {
        (Some(model), Some(user)) => {
            let sub = policy.subscription(first)?;
            let m = sub.model(model)?;
            let limits = of_kind(
                &m.request_rate_limits,
                &m.token_rate_limits,
                &m.budgets,
                item.kind,
            );
            limits
                .iter()
                .any(|l| !l.shadow && l.window == window)
                .then(|| Governing {
                    user,
                    scope: Scope::Subscription {
                        name: sub.name.clone(),
                        model: m.name.clone(),
                    },
                    enforced: item.limit,
                    shadow: shadow_of(&limits, window),
                    warn_at: &sub.warn_at,
                })
        }
        _ => {
            let tier_limits = |t: &maas_types::Tier| {
                of_kind(
                    &t.limits.requests,
                    &t.limits.tokens,
                    &t.limits.budgets,
                    item.kind,
                )
            };
            let tier = policy.tiers.iter().find(|t| {
                tier_limits(t)
                    .iter()
                    .any(|l| !l.shadow && l.window == window && l.limit == item.limit)
            })?;
            Some(Governing {
                user: &item.subject,
                scope: Scope::Tier(tier.name.clone()),
                enforced: item.limit,
                shadow: shadow_of(&tier_limits(tier), window),
                warn_at: &tier.warn_at,
            })
        }
    }
}

/// A scope's counter (`whose` in scope `name`): its limits and thresholds.
fn scope_governing<'a>(
    policy: &'a PolicyDocument,
    item: &LeaseItem,
    window: Window,
    name: &str,
    whose: ScopeCounter<'a>,
) -> Option<Governing<'a>> {
    if name == maas_types::policy::scope::KEY_SCOPE {
        // An API key's own limits (set at mint): not in the policy; the item carries the
        // limit the gateway enforced, and they warn at the default thresholds.
        let ScopeCounter::Key(id) = whose else {
            return None;
        };
        return Some(Governing {
            user: "",
            scope: Scope::Named {
                name: name.to_string(),
                key_id: Some(id.to_string()),
            },
            enforced: item.limit,
            shadow: None,
            warn_at: &maas_types::policy::DEFAULT_WARN_AT,
        });
    }
    let scope = policy.scope(name)?;
    let l = &scope.limits;
    let limits = of_kind(&l.requests, &l.tokens, &l.budgets, item.kind);
    let (user, key_id) = match whose {
        ScopeCounter::All => ("", None),
        ScopeCounter::User(user) => (user, None),
        ScopeCounter::Key(id) => ("", Some(id.to_string())),
    };
    limits
        .iter()
        .any(|l| !l.shadow && l.window == window)
        .then(|| Governing {
            user,
            scope: Scope::Named {
                name: scope.name.clone(),
                key_id,
            },
            enforced: item.limit,
            shadow: shadow_of(&limits, window),
            warn_at: &scope.warn_at,
        })
}

/// Every `warnAt` threshold `taken` is at or past in `item`'s window, for its enforced limit
/// and its shadow limit (a zero limit refuses everything: no budget to warn about).
pub fn crossings(policy: &PolicyDocument, item: &LeaseItem, taken: u64) -> Vec<Crossing> {
    let Ok(window) = Window::from_seconds(item.window_seconds) else {
        return Vec::new();
    };
    let Some(g) = governing(policy, item, window) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let limits = std::iter::once((g.enforced, false)).chain(g.shadow.map(|l| (l, true)));
    for (limit, shadow) in limits.filter(|(l, _)| *l > 0) {
        let (percent_used, passed) = warning(taken, limit, g.warn_at);
        if passed.is_none() {
            continue;
        }
        for &threshold in g.warn_at.iter().filter(|t| u64::from(**t) <= percent_used) {
            out.push(Crossing {
                user: g.user.to_string(),
                scope: g.scope.clone(),
                kind: item.kind,
                window,
                window_start: item.window_start,
                limit,
                used: taken,
                percent_used,
                threshold,
                shadow,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use maas_types::subscription::counter_subject;

    const POLICY: &str = r#"{"tiers":[
        {"name":"free","level":0,"groups":["all"],
         "limits":{"requests":[{"limit":10,"window":"1m"}],
                   "tokens":[{"limit":1000,"window":"1m"},{"limit":500,"window":"1m","shadow":true}]}},
        {"name":"gold","level":1,"groups":["gold"],"warnAt":[50],
         "limits":{"tokens":[{"limit":4000,"window":"1m"}]}}],
        "models":[{"name":"m","path":"/llm/m","tiers":["free"]}],
        "subscriptions":[{"name":"team","owner":{"groups":["t"]},"warnAt":[90],
          "models":[{"name":"m","tokenRateLimits":[{"limit":200,"window":"1h"}]}]}]}"#;

    fn policy() -> PolicyDocument {
        PolicyDocument::from_value(serde_json::from_str(POLICY).unwrap()).unwrap()
    }

    fn item(subject: &str, kind: LeaseKind, window_seconds: u64, limit: u64) -> LeaseItem {
        LeaseItem {
            subject: subject.into(),
            kind,
            window_seconds,
            window_start: 1_800_000_000 - 1_800_000_000 % window_seconds,
            limit,
            need: 1,
            want: 0,
            debt: 0,
            release: 0,
        }
    }

    fn thresholds(c: &[Crossing]) -> Vec<(u8, bool, u64)> {
        c.iter().map(|c| (c.threshold, c.shadow, c.limit)).collect()
    }

    #[test]
    fn every_threshold_passed_of_the_tier_whose_limit_it_is() {
        let p = policy();
        let tokens = item("alice", LeaseKind::Tokens, 60, 1000);
        // 400 of 1000: below 80 %, but 80 % of the shadow limit (500).
        assert_eq!(thresholds(&crossings(&p, &tokens, 400)), [(80, true, 500)]);
        let c = crossings(&p, &tokens, 960);
        assert_eq!(
            thresholds(&c),
            [
                (80, false, 1000),
                (95, false, 1000),
                (80, true, 500),
                (95, true, 500)
            ]
        );
        assert_eq!(c[0].scope, Scope::Tier("free".into()));
        assert_eq!((c[0].user.as_str(), c[0].percent_used), ("alice", 96));
        assert_eq!(c[0].window.to_string(), "1m");
        // Below every threshold: nothing.
        let requests = item("alice", LeaseKind::Requests, 60, 10);
        assert!(crossings(&p, &requests, 7).is_empty());
        assert_eq!(thresholds(&crossings(&p, &requests, 8)), [(80, false, 10)]);
        // Another tier's limit: its own thresholds.
        let gold = item("bob", LeaseKind::Tokens, 60, 4000);
        let c = crossings(&p, &gold, 2000);
        assert_eq!(thresholds(&c), [(50, false, 4000)]);
        assert_eq!(c[0].scope, Scope::Tier("gold".into()));
    }

    #[test]
    fn a_scope_counter_warns_with_the_scopes_thresholds_and_names_the_scope() {
        let mut v: serde_json::Value = serde_json::from_str(POLICY).unwrap();
        v["scopes"] = serde_json::json!([
            {"name": "org", "warnAt": [50], "limits": {"requests": [{"limit": 10, "window": "1m"}]}},
            {"name": "keys", "per": "key", "limits": {"requests": [{"limit": 10, "window": "1m"}]}}
        ]);
        let p = PolicyDocument::from_value(v).unwrap();
        let org = p.scope("org").unwrap().counter_subject("alice", None);
        let c = crossings(&p, &item(&org, LeaseKind::Requests, 60, 10), 5);
        assert_eq!(thresholds(&c), [(50, false, 10)]);
        assert_eq!(
            (&c[0].scope, c[0].user.as_str()),
            (
                &Scope::Named {
                    name: "org".into(),
                    key_id: None
                },
                ""
            ),
            "everyone's counter names no user"
        );
        let keys = p
            .scope("keys")
            .unwrap()
            .counter_subject("alice", Some("k1"));
        let c = crossings(&p, &item(&keys, LeaseKind::Requests, 60, 10), 8);
        assert_eq!(thresholds(&c), [(80, false, 10)], "the default warnAt");
        let body: serde_json::Value = serde_json::from_str(&crate::quota_webhook::event_body(
            &c[0],
            uuid::Uuid::nil(),
            chrono::Utc::now(),
        ))
        .unwrap();
        assert_eq!(
            body["scope"],
            serde_json::json!({"scope": "keys", "keyId": "k1"})
        );
        assert!(body.get("subject").is_none(), "{body}");
        // Each key's crossing is its own.
        let other = p
            .scope("keys")
            .unwrap()
            .counter_subject("alice", Some("k2"));
        let c2 = crossings(&p, &item(&other, LeaseKind::Requests, 60, 10), 8);
        assert_ne!(c[0].key(), c2[0].key());
        // A scope the policy no longer has: nothing.
        let gone = p
            .scope("org")
            .unwrap()
            .counter_subject("alice", None)
            .replace("org", "gone");
        assert!(crossings(&p, &item(&gone, LeaseKind::Requests, 60, 10), 10).is_empty());
        // An API key's own limits (set at mint, not in the policy): the limit the gateway
        // enforced, the default thresholds, the key named.
        let own = maas_types::Scope::of_key(
            serde_json::from_value(serde_json::json!({"tokens": [{"limit": 100, "window": "1h"}]}))
                .unwrap(),
        )
        .counter_subject("alice", Some("k9"));
        let c = crossings(&p, &item(&own, LeaseKind::Tokens, 3600, 100), 96);
        assert_eq!(thresholds(&c), [(80, false, 100), (95, false, 100)]);
        assert_eq!(
            c[0].scope,
            Scope::Named {
                name: "key".into(),
                key_id: Some("k9".into())
            }
        );
    }

    #[test]
    fn a_subscription_counter_warns_with_its_thresholds_and_names_its_model() {
        let p = policy();
        let sub = item(
            &counter_subject("carol", "team", "m"),
            LeaseKind::Tokens,
            3600,
            200,
        );
        assert!(crossings(&p, &sub, 179).is_empty());
        let c = crossings(&p, &sub, 180);
        assert_eq!(thresholds(&c), [(90, false, 200)]);
        assert_eq!(c[0].user, "carol");
        assert_eq!(
            c[0].scope,
            Scope::Subscription {
                name: "team".into(),
                model: "m".into()
            }
        );
        assert_eq!(c[0].key().scope, "subscription:team");
        assert_eq!(c[0].key().model, "m");
    }

    #[test]
    fn a_pooled_subscription_counter_warns_for_no_one_user() {
        let p = policy();
        let pool = item(
            &counter_subject("", "team", "m"),
            LeaseKind::Tokens,
            3600,
            200,
        );
        let c = crossings(&p, &pool, 180);
        assert_eq!(thresholds(&c), [(90, false, 200)]);
        assert_eq!(c[0].user, "");
        let body: serde_json::Value = serde_json::from_str(&super::super::event_body(
            &c[0],
            uuid::Uuid::nil(),
            chrono::Utc::now(),
        ))
        .unwrap();
        assert!(body.get("subject").is_none(), "{body}");
        assert_eq!(body["scope"]["pool"], true, "{body}");
        assert_eq!(body["scope"]["subscription"], "team", "{body}");
    }

    #[test]
    fn a_counter_the_policy_no_longer_limits_gives_nothing() {
        let p = policy();
        // No tier has a 1m token limit of 999; no such subscription or model; a zero window.
        assert!(crossings(&p, &item("a", LeaseKind::Tokens, 60, 999), 999).is_empty());
        let gone = counter_subject("a", "gone", "m");
        assert!(crossings(&p, &item(&gone, LeaseKind::Tokens, 3600, 200), 200).is_empty());
        let other = counter_subject("a", "team", "other");
        assert!(crossings(&p, &item(&other, LeaseKind::Tokens, 3600, 200), 200).is_empty());
        let mut zero = item("a", LeaseKind::Tokens, 60, 1000);
        zero.window_seconds = 0;
        assert!(crossings(&p, &zero, 1000).is_empty());
    }

    #[test]
    fn the_key_hashes_the_user_and_tells_thresholds_windows_and_shadows_apart() {
        let p = policy();
        let c = crossings(&p, &item("alice", LeaseKind::Tokens, 60, 1000), 960);
        let keys: std::collections::HashSet<Key> = c.iter().map(Crossing::key).collect();
        assert_eq!(keys.len(), 4);
        let k = c[0].key();
        assert!(!k.subject_sha256.contains("alice"));
        assert_eq!(k.subject_sha256.len(), 64);
        assert_eq!((k.scope.as_str(), k.model.as_str()), ("tier:free", ""));
        assert_eq!(c[0].window_end(), c[0].window_start + 60);
    }
}
