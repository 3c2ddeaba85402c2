//! Scopes (issue 30): limits that count a group of requests together, beside the tier or
//! subscription a request runs on. A request counts in its own counters (its tier's or its
//! subscription's, as before) *and* in the counters of every scope it matches; the strictest
//! binds, and a refusal names the scope. What they express:
//!
//! - an organisation above its subscriptions (`match.organization`: every subscription whose
//!   `tokenMetadata.organizationId` it is, one counter for all their users);
//! - a model's capacity across all users (`match.models`, `per: all`);
//! - a user's own limit inside a pooled subscription (`match.subscriptions`, `per: user`);
//! - limits per API key (`per: key`: each key its own counters; a caller without a key counts
//!   per user).
//!
//! A policy without `scopes` behaves exactly as before.
//!
//! An API key may also carry its own limits, set when it is minted (`limits` in the mint
//! request): they count as one more scope, [`KEY_SCOPE`] per key ([`Scope::of_key`]), beside the
//! policy's — whatever the policy says, a key never outspends what it was minted with.

use super::{
    Limits, PolicyDocument, PolicyError, Subscription, Tier, TokenWeights, UncappedRequests,
    check_budgets, check_label_name, check_limits, check_text, check_warn_at, default_warn_at, err,
    is_default_warn_at,
};
use crate::subscription::COUNTER_SEPARATOR;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// Scopes a document holds at most (each matching request is counted in each it matches).
pub const MAX_SCOPES: usize = 32;

/// Scopes one request is counted in at most (the document is refused if a request could match
/// more: each one is a counter update per request).
pub const MAX_SCOPES_PER_REQUEST: usize = 4;

/// The scope an API key's own limits (set at mint) count under, one counter per key; no
/// policy scope may take the name.
pub const KEY_SCOPE: &str = "key";

/// A scope: which requests it counts ([`ScopeMatch`]), whose counter each request counts in
/// ([`ScopePer`]) and the limits of that counter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Scope {
    /// Unique among scopes; a DNS label (named in refusals as `scope:<name>`).
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    /// Which requests count in the scope: all of the given conditions hold (none given: every
    /// request of the gateway).
    #[serde(
        default,
        rename = "match",
        skip_serializing_if = "ScopeMatch::is_empty"
    )]
    pub matches: ScopeMatch,
    /// One counter for all matching requests (default), one per user, or one per API key.
    #[serde(default, skip_serializing_if = "ScopePer::is_default")]
    pub per: ScopePer,
    /// Requests, tokens and money per window, as a tier's (at least one).
    pub limits: Limits,
    /// As a tier's `warnAt`: past these percentages of a window's limit an answer carries
    /// `x-maas-quota-warning` and the quota webhook is told (default 80 and 95; `[]`: none).
    #[serde(
        default = "default_warn_at",
        skip_serializing_if = "is_default_warn_at"
    )]
    pub warn_at: Vec<u8>,
}

/// Which requests a scope counts; every condition given must hold.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ScopeMatch {
    /// Requests under a subscription whose `tokenMetadata.organizationId` is this (a request on
    /// a tier, under no subscription, has no organisation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub organization: Option<String>,
    /// Requests under one of these subscriptions (names).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subscriptions: Vec<String>,
    /// Requests for one of these models (names).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
}

impl ScopeMatch {
    pub fn is_empty(&self) -> bool {
        *self == ScopeMatch::default()
    }
}

/// Whose counter a matching request counts in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ScopePer {
    /// One counter for every matching request.
    #[default]
    All,
    /// One per user (subject).
    User,
    /// One per API key; a caller with a token, not a key, counts per user.
    Key,
}

impl ScopePer {
    pub fn is_default(&self) -> bool {
        *self == ScopePer::All
    }
}

/// The name refusals and metrics give a scope's limits: `scope:<name>`.
pub fn scope_tier_name(scope: &str) -> String {
    format!("scope:{scope}")
}

impl Scope {
    /// An API key's own limits as a scope: [`KEY_SCOPE`], every request of the key, one
    /// counter per key, the default warnings.
    pub fn of_key(limits: Limits) -> Scope {
        Scope {
            name: KEY_SCOPE.to_string(),
            display_name: Some("this API key's own limits".to_string()),
            matches: ScopeMatch::default(),
            per: ScopePer::Key,
            limits,
            warn_at: default_warn_at(),
        }
    }

    /// The request for `model` under `subscription` (none: on a tier) counts in this scope.
    pub fn applies(&self, model: &str, subscription: Option<&Subscription>) -> bool {
        let m = &self.matches;
        (m.models.is_empty() || m.models.iter().any(|x| x == model))
            && (m.subscriptions.is_empty()
                || subscription.is_some_and(|s| m.subscriptions.contains(&s.name)))
            && m.organization.as_ref().is_none_or(|org| {
                subscription
                    .and_then(|s| s.token_metadata.organization_id.as_ref())
                    .is_some_and(|o| o == org)
            })
    }

    /// The counter a request of `user` (with API key `key_id`, if any) counts in:
    /// `␟scope␟<name>␟` then nothing (per all), `u:<user>` or `k:<key id>`. It starts with the
    /// separator, which no subject, subscription or model name holds, so it is never a tier
    /// subject's or a subscription's counter; the gateway's counters, the leases and
    /// `/v1/quota` all use this one function.
    pub fn counter_subject(&self, user: &str, key_id: Option<&str>) -> String {
        let mut out = String::with_capacity(8 + self.name.len() + user.len() + 2);
        out.push(COUNTER_SEPARATOR);
        out.push_str("scope");
        out.push(COUNTER_SEPARATOR);
        out.push_str(&self.name);
        out.push(COUNTER_SEPARATOR);
        match (self.per, key_id) {
            (ScopePer::All, _) => {}
            (ScopePer::Key, Some(k)) => {
                out.push_str("k:");
                out.push_str(k);
            }
            (ScopePer::User | ScopePer::Key, _) => {
                out.push_str("u:");
                out.push_str(user);
            }
        }
        out
    }

    /// The scope's limits as a tier (named [`scope_tier_name`], no groups, its `warnAt`), so the
    /// gateway's tier-based counters apply them unchanged.
    pub fn limits_tier(&self) -> Tier {
        Tier {
            name: scope_tier_name(&self.name),
            display_name: self.display_name.clone(),
            description: None,
            level: 0,
            groups: Vec::new(),
            limits: self.limits.clone(),
            default_max_tokens: None,
            uncapped_requests: UncappedRequests::default(),
            token_weights: TokenWeights::default(),
            warn_at: self.warn_at.clone(),
            prices: Default::default(),
            pricing: None,
        }
    }
}

/// Whose counter a scope counter subject ([`Scope::counter_subject`]) is: every matching
/// request's, a user's or an API key's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScopeCounter<'a> {
    All,
    User(&'a str),
    Key(&'a str),
}

/// The scope's name and whose counter `subject` is, when it is a scope's counter subject.
pub fn parse_counter_subject(subject: &str) -> Option<(&str, ScopeCounter<'_>)> {
    let rest = subject
        .strip_prefix(COUNTER_SEPARATOR)?
        .strip_prefix("scope")?
        .strip_prefix(COUNTER_SEPARATOR)?;
    let (name, whose) = rest.split_once(COUNTER_SEPARATOR)?;
    let whose = if whose.is_empty() {
        ScopeCounter::All
    } else if let Some(user) = whose.strip_prefix("u:") {
        ScopeCounter::User(user)
    } else {
        ScopeCounter::Key(whose.strip_prefix("k:")?)
    };
    Some((name, whose))
}

impl PolicyDocument {
    /// The scope named `name`.
    pub fn scope(&self, name: &str) -> Option<&Scope> {
        self.scopes.iter().find(|s| s.name == name)
    }

    /// The scopes a request for `model` under `subscription` counts in, in document order.
    pub fn scopes_for<'a>(
        &'a self,
        model: &'a str,
        subscription: Option<&'a Subscription>,
    ) -> impl Iterator<Item = &'a Scope> + 'a {
        self.scopes
            .iter()
            .filter(move |s| s.applies(model, subscription))
    }
}

/// Names unique, references known, limits sane, and no request counted in more than
/// [`MAX_SCOPES_PER_REQUEST`] scopes.
pub(super) fn validate_scopes(doc: &PolicyDocument) -> Result<(), PolicyError> {
    if doc.scopes.len() > MAX_SCOPES {
        return Err(err("scopes", format!("at most {MAX_SCOPES} scopes")));
    }
    let mut names = BTreeSet::new();
    for (i, s) in doc.scopes.iter().enumerate() {
        let at = format!("scopes[{i}]");
        check_label_name(format!("{at}.name"), &s.name)?;
        if s.name == KEY_SCOPE {
            return Err(err(
                format!("{at}.name"),
                format!("{KEY_SCOPE:?} is reserved for the limits API keys are minted with"),
            ));
        }
        if !names.insert(s.name.as_str()) {
            return Err(err(
                format!("{at}.name"),
                format!("scope {:?} is defined twice", s.name),
            ));
        }
        if let Some(d) = &s.display_name {
            check_text(format!("{at}.displayName"), d, false)?;
        }
        if let Some(o) = &s.matches.organization {
            check_text(format!("{at}.match.organization"), o, false)?;
        }
        for (j, sub) in s.matches.subscriptions.iter().enumerate() {
            if !doc.subscriptions.iter().any(|x| &x.name == sub) {
                return Err(err(
                    format!("{at}.match.subscriptions[{j}]"),
                    format!("unknown subscription {sub:?}"),
                ));
            }
        }
        for (j, model) in s.matches.models.iter().enumerate() {
            if doc.model(model).is_none() {
                return Err(err(
                    format!("{at}.match.models[{j}]"),
                    format!("unknown model {model:?}"),
                ));
            }
        }
        check_scope_limits(&format!("{at}.limits"), &s.limits)?;
        check_warn_at(&format!("{at}.warnAt"), &s.warn_at)?;
    }
    check_scopes_per_request(doc)
}

/// A scope's (or a key's own) limits: at least one, each valid; `at` names them in the error.
pub fn check_scope_limits(at: &str, l: &Limits) -> Result<(), PolicyError> {
    if l.requests.is_empty() && l.tokens.is_empty() && l.budgets.is_empty() {
        return Err(err(
            at,
            "at least one request, token or budget limit is required",
        ));
    }
    check_limits(&format!("{at}.requests"), &l.requests, None)?;
    check_limits(&format!("{at}.tokens"), &l.tokens, None)?;
    check_budgets(&format!("{at}.budgets"), &l.budgets)
}

/// No request matches more than [`MAX_SCOPES_PER_REQUEST`] scopes: every (model, subscription
/// or none) pair is tried.
fn check_scopes_per_request(doc: &PolicyDocument) -> Result<(), PolicyError> {
    if doc.scopes.len() <= MAX_SCOPES_PER_REQUEST {
        return Ok(());
    }
    let subscriptions = std::iter::once(None).chain(doc.subscriptions.iter().map(Some));
    for sub in subscriptions {
        for m in &doc.models {
            let n = doc.scopes_for(&m.name, sub).count();
            if n > MAX_SCOPES_PER_REQUEST {
                return Err(err(
                    "scopes",
                    format!(
                        "a request for model {:?}{} would count in {n} scopes; at most \
                         {MAX_SCOPES_PER_REQUEST}",
                        m.name,
                        sub.map(|s| format!(" under subscription {:?}", s.name))
                            .unwrap_or_default()
                    ),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(scopes: &str) -> Result<PolicyDocument, PolicyError> {
        let json = format!(
            r#"{{
              "tiers": [{{"name": "free", "level": 0, "groups": ["all"]}}],
              "models": [
                {{"name": "m1", "path": "/m1", "tiers": ["free"]}},
                {{"name": "m2", "path": "/m2", "tiers": ["free"]}}
              ],
              "subscriptions": [
                {{"name": "team-a", "owner": {{"users": ["alice"]}},
                  "tokenMetadata": {{"organizationId": "acme"}},
                  "models": [{{"name": "m1", "tokenRateLimits": [{{"limit": 100, "window": "1m"}}]}}]}},
                {{"name": "team-b", "owner": {{"users": ["bob"]}},
                  "models": [{{"name": "m1", "tokenRateLimits": [{{"limit": 100, "window": "1m"}}]}}]}}
              ],
              "scopes": {scopes}
            }}"#
        );
        PolicyDocument::from_json(json.as_bytes())
    }

    const ORG: &str = r#"[{"name": "acme", "match": {"organization": "acme"},
        "limits": {"tokens": [{"limit": 150, "window": "1m"}]}}]"#;

    #[test]
    fn an_organisation_scope_counts_its_subscriptions_only() {
        let d = doc(ORG).unwrap();
        let a = d.subscriptions.iter().find(|s| s.name == "team-a");
        let b = d.subscriptions.iter().find(|s| s.name == "team-b");
        assert_eq!(d.scopes_for("m1", a).count(), 1);
        assert_eq!(d.scopes_for("m1", b).count(), 0);
        assert_eq!(
            d.scopes_for("m1", None).count(),
            0,
            "a tier request has no org"
        );
    }

    #[test]
    fn a_model_scope_counts_every_request_for_the_model() {
        let d = doc(r#"[{"name": "m1-capacity", "match": {"models": ["m1"]},
                 "limits": {"requests": [{"limit": 5, "window": "1s"}]}}]"#)
        .unwrap();
        let a = d.subscriptions.first();
        assert_eq!(d.scopes_for("m1", a).count(), 1);
        assert_eq!(d.scopes_for("m1", None).count(), 1);
        assert_eq!(d.scopes_for("m2", None).count(), 0);
    }

    #[test]
    fn counter_subjects_are_per_all_user_or_key_and_never_a_subscriptions() {
        let mut s = doc(ORG).unwrap().scopes.remove(0);
        assert_eq!(
            s.counter_subject("alice", Some("k1")),
            "\u{1f}scope\u{1f}acme\u{1f}"
        );
        s.per = ScopePer::User;
        assert_eq!(
            s.counter_subject("alice", Some("k1")),
            "\u{1f}scope\u{1f}acme\u{1f}u:alice"
        );
        s.per = ScopePer::Key;
        assert_eq!(
            s.counter_subject("alice", Some("k1")),
            "\u{1f}scope\u{1f}acme\u{1f}k:k1"
        );
        assert_eq!(
            s.counter_subject("alice", None),
            "\u{1f}scope\u{1f}acme\u{1f}u:alice",
            "a token caller counts per user"
        );
        for (per, whose) in [
            (ScopePer::All, ScopeCounter::All),
            (ScopePer::User, ScopeCounter::User("alice")),
            (ScopePer::Key, ScopeCounter::Key("k1")),
        ] {
            s.per = per;
            let subject = s.counter_subject("alice", Some("k1"));
            assert_eq!(parse_counter_subject(&subject), Some(("acme", whose)));
        }
        assert_eq!(
            parse_counter_subject(&crate::subscription::counter_subject("a", "b", "c")),
            None
        );
        assert_eq!(parse_counter_subject("alice"), None);
        // A subscription's counter subject starts with its name (a DNS label).
        assert_ne!(
            crate::subscription::counter_subject("alice", "scope", "acme"),
            s.counter_subject("alice", None)
        );
    }

    #[test]
    fn bad_scopes_are_refused_naming_the_field() {
        let cases = [
            (
                r#"[{"name": "Bad_Name", "limits": {"requests": [{"limit": 1, "window": "1m"}]}}]"#,
                "scopes[0].name",
            ),
            (r#"[{"name": "a", "limits": {}}]"#, "scopes[0].limits"),
            (
                r#"[{"name": "a", "match": {"models": ["nope"]}, "limits": {"requests": [{"limit": 1, "window": "1m"}]}}]"#,
                "scopes[0].match.models[0]",
            ),
            (
                r#"[{"name": "a", "match": {"subscriptions": ["nope"]}, "limits": {"requests": [{"limit": 1, "window": "1m"}]}}]"#,
                "scopes[0].match.subscriptions[0]",
            ),
            (
                r#"[{"name": "a", "limits": {"tokens": [{"limit": 0, "window": "1m"}]}}]"#,
                "scopes[0].limits.tokens[0].limit",
            ),
            (
                r#"[{"name": "a", "limits": {"requests": [{"limit": 1, "window": "1m"}]}},
                 {"name": "a", "limits": {"requests": [{"limit": 1, "window": "1m"}]}}]"#,
                "scopes[1].name",
            ),
            (
                r#"[{"name": "a", "per": "team", "limits": {"requests": [{"limit": 1, "window": "1m"}]}}]"#,
                "scopes[0].per",
            ),
            (
                r#"[{"name": "key", "limits": {"requests": [{"limit": 1, "window": "1m"}]}}]"#,
                "scopes[0].name",
            ),
        ];
        for (scopes, path) in cases {
            let e = doc(scopes).unwrap_err();
            assert!(e.path.starts_with(path), "{scopes}: {e}");
        }
    }

    #[test]
    fn a_request_counted_in_too_many_scopes_is_refused() {
        let one = |i: usize| {
            format!(
                r#"{{"name": "s{i}", "limits": {{"requests": [{{"limit": 1, "window": "1m"}}]}}}}"#
            )
        };
        let four: Vec<String> = (0..MAX_SCOPES_PER_REQUEST).map(one).collect();
        assert!(doc(&format!("[{}]", four.join(","))).is_ok());
        let five: Vec<String> = (0..=MAX_SCOPES_PER_REQUEST).map(one).collect();
        let e = doc(&format!("[{}]", five.join(","))).unwrap_err();
        assert_eq!(e.path, "scopes", "{e}");
    }
}
