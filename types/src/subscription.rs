//! Subscriptions: who may use which models with which token budgets (the reference's
//! `MaaSSubscription`), beside the tiers of the policy document.
//!
//! How they combine with tiers: a tier is a subscription that every member of its groups has,
//! with `level` as its priority; they are kept apart in the document so a tier-only policy
//! behaves exactly as before. An API key bound to a subscription (at mint: named, or
//! [`default_for_mint`]) is limited by that subscription's per-model limits; a key bound to none
//! (no subscription the owner may use, or a tier pinned at mint) and a token caller that names
//! no subscription use the tiers as before. A token caller may name one with
//! `X-MaaS-Subscription` ([`requested_from_header`]), checked with [`select`].
//!
//! Every function here is pure: the document, the caller's name and groups in; a decision out.

use crate::policy::{Limits, PolicyDocument, Tier};

// The schema and its validation are the document's (`crate::policy`, below this module): named
// here too, where they always were.
pub use crate::policy::{
    BillingRate, MAX_DNS_LABEL_LEN as MAX_NAME_LEN, MAX_TOKEN_LIMIT, Owner, Subscription,
    SubscriptionModel, TokenMetadata, is_dns_label,
};

/// The namespace of a subscription that names none (the reference's default
/// `MAAS_SUBSCRIPTION_NAMESPACE`): `models-as-a-service/<name>` selects it.
pub const DEFAULT_NAMESPACE: &str = "models-as-a-service";

impl Subscription {
    pub fn namespace(&self) -> &str {
        self.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE)
    }

    /// The user is listed, or one of the groups is.
    pub fn has_access(&self, user: &str, groups: &[String]) -> bool {
        self.owner.users.iter().any(|u| u == user)
            || self
                .owner
                .groups
                .iter()
                .any(|g| groups.iter().any(|ug| ug.trim() == g))
    }

    pub fn model(&self, name: &str) -> Option<&SubscriptionModel> {
        self.models.iter().find(|m| m.name == name)
    }

    pub fn includes_model(&self, name: &str) -> bool {
        self.model(name).is_some()
    }

    /// The largest token limit over its models and windows (the mint tie-break).
    pub fn max_token_limit(&self) -> u64 {
        self.models
            .iter()
            .flat_map(|m| m.token_rate_limits.iter().map(|l| l.limit))
            .max()
            .unwrap_or(0)
    }
}

// ---------------------------------------------------------------------------------------------
// Selection
// ---------------------------------------------------------------------------------------------

/// Why no subscription was selected; [`SelectError::code`] is the reference's error code.
///
/// There is no "access denied": a subscription that exists but is not the caller's is
/// [`SelectError::NotFound`], word for word as one that does not exist, so that naming
/// subscriptions (in `X-MaaS-Subscription`, at mint) cannot tell which exist (the reference
/// closed the same enumeration, FIND-009).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelectError {
    /// None was requested and the caller has none (containing the model).
    NoSubscription,
    /// The requested one does not exist, or is not the caller's (neither listed nor in a
    /// listed group): one answer for both.
    NotFound,
    /// None was requested and the caller has several containing the model.
    MultipleSubscriptions,
    /// The requested one does not include the model.
    ModelNotInSubscription,
}

impl SelectError {
    pub const ALL: [SelectError; 4] = [
        SelectError::NoSubscription,
        SelectError::NotFound,
        SelectError::MultipleSubscriptions,
        SelectError::ModelNotInSubscription,
    ];

    /// What a companion before the merged answer said of a subscription not the caller's.
    pub const FORMER_ACCESS_DENIED_MESSAGE: &'static str =
        "access denied to requested subscription";

    /// The error whose [`SelectError::message`] this is (the companion's authenticate refusal of
    /// a key whose subscription no longer resolves carries only the message). An older
    /// companion's access-denied message (a rolling upgrade) is [`SelectError::NotFound`].
    pub fn from_message(message: &str) -> Option<SelectError> {
        if message == Self::FORMER_ACCESS_DENIED_MESSAGE {
            return Some(SelectError::NotFound);
        }
        Self::ALL.into_iter().find(|e| e.message() == message)
    }

    pub fn code(&self) -> &'static str {
        match self {
            SelectError::NoSubscription | SelectError::NotFound => "not_found",
            SelectError::MultipleSubscriptions => "multiple_subscriptions",
            SelectError::ModelNotInSubscription => "model_not_in_subscription",
        }
    }

    /// The reference's messages (they name nothing the caller did not send).
    pub fn message(&self) -> &'static str {
        match self {
            SelectError::NoSubscription => "no matching subscription found for user",
            SelectError::NotFound => "requested subscription not found",
            SelectError::MultipleSubscriptions => {
                "user has access to multiple subscriptions, must specify subscription using X-MaaS-Subscription header"
            }
            SelectError::ModelNotInSubscription => {
                "requested subscription does not include the requested model"
            }
        }
    }
}

impl std::fmt::Display for SelectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for SelectError {}

/// Mint order: priority descending, then the largest token limit descending, then name ascending.
fn mint_order(a: &Subscription, b: &Subscription) -> std::cmp::Ordering {
    b.priority
        .cmp(&a.priority)
        .then_with(|| b.max_token_limit().cmp(&a.max_token_limit()))
        .then_with(|| a.name.cmp(&b.name))
}

/// The subscriptions the caller has, sorted by name.
pub fn accessible<'a>(
    doc: &'a PolicyDocument,
    user: &str,
    groups: &[String],
) -> Vec<&'a Subscription> {
    let mut subs: Vec<&Subscription> = doc
        .subscriptions
        .iter()
        .filter(|s| s.has_access(user, groups))
        .collect();
    subs.sort_by(|a, b| a.name.cmp(&b.name));
    subs
}

/// The subscription a key minted without naming one is bound to: the caller's highest
/// priority, tie → largest token limit, tie → name ascending. `None`: the caller has none (the
/// key then follows the tiers).
pub fn default_for_mint<'a>(
    doc: &'a PolicyDocument,
    user: &str,
    groups: &[String],
) -> Option<&'a Subscription> {
    doc.subscriptions
        .iter()
        .filter(|s| s.has_access(user, groups))
        .min_by(|a, b| mint_order(a, b))
}

/// The subscription with this name (`name`, or `namespace/name` matched exactly).
pub fn find<'a>(doc: &'a PolicyDocument, requested: &str) -> Option<&'a Subscription> {
    match requested.split_once('/') {
        Some((ns, name)) => doc
            .subscriptions
            .iter()
            .find(|s| s.name == name && s.namespace() == ns),
        None => doc.subscriptions.iter().find(|s| s.name == requested),
    }
}

/// The reference's selection. `requested` (bare `name` or `namespace/name`; blank = none):
/// it must exist and the caller must have it (else [`SelectError::NotFound`], one answer for
/// both), and it must include `model` when one is given.
/// Nothing requested: the caller's subscriptions that include `model` (all of them when `None`);
/// exactly one is selected, none → [`SelectError::NoSubscription`], several →
/// [`SelectError::MultipleSubscriptions`].
pub fn select<'a>(
    doc: &'a PolicyDocument,
    user: &str,
    groups: &[String],
    requested: Option<&str>,
    model: Option<&str>,
) -> Result<&'a Subscription, SelectError> {
    let includes = |s: &Subscription| model.is_none_or(|m| s.includes_model(m));
    match requested.map(str::trim).filter(|r| !r.is_empty()) {
        Some(r) => {
            // Not the caller's: the same answer as none of that name, so that it says
            // nothing of what exists.
            let sub = find(doc, r)
                .filter(|s| s.has_access(user, groups))
                .ok_or(SelectError::NotFound)?;
            if !includes(sub) {
                return Err(SelectError::ModelNotInSubscription);
            }
            Ok(sub)
        }
        None => {
            let mut found = doc
                .subscriptions
                .iter()
                .filter(|s| s.has_access(user, groups) && includes(s));
            match (found.next(), found.next()) {
                (Some(one), None) => Ok(one),
                (None, _) => Err(SelectError::NoSubscription),
                (Some(_), Some(_)) => Err(SelectError::MultipleSubscriptions),
            }
        }
    }
}

/// The subscription a request names in `X-MaaS-Subscription`: the last non-empty value (a
/// gateway may append its own value to the client's; values may also arrive comma-joined).
pub fn requested_from_header<'a>(values: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    values
        .into_iter()
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .last()
}

// ---------------------------------------------------------------------------------------------
// Limits
// ---------------------------------------------------------------------------------------------

/// Separates the parts of a [`counter_subject`]: a control character, which neither a
/// subscription name (a DNS label) nor a model name (no control characters) may hold, so the
/// parts are never ambiguous.
pub const COUNTER_SEPARATOR: char = '\u{1f}';

/// The counter subject of `subject`'s requests on `model` under `subscription`: a subscription's
/// budgets are per (subject, subscription, model), as the reference counts them. The gateway's
/// counters, its budget leases and the companion's `/v1/quota` all use this one function, so
/// they name the same counter. Subscription and model come first (neither holds the separator),
/// the subject last.
pub fn counter_subject(subject: &str, subscription: &str, model: &str) -> String {
    let mut out = String::with_capacity(subscription.len() + model.len() + subject.len() + 2);
    out.push_str(subscription);
    out.push(COUNTER_SEPARATOR);
    out.push_str(model);
    out.push(COUNTER_SEPARATOR);
    out.push_str(subject);
    out
}

impl Subscription {
    /// The counter `subject`'s requests on `model` count in under this subscription: their
    /// own, or the subscription's pool ([`counter_subject`] with an empty subject, which no
    /// caller has).
    pub fn counter_subject_of(&self, subject: &str, model: &str) -> String {
        counter_subject(if self.pool { "" } else { subject }, &self.name, model)
    }
}

/// The name of the tier that stands for a subscription's limits ([`Subscription::limits_tier`]):
/// `subscription:<name>` (shown in 429 messages and metric labels).
pub fn limits_tier_name(subscription: &str) -> String {
    format!("subscription:{subscription}")
}

impl Subscription {
    /// This subscription's limits on `model` as a tier (named [`limits_tier_name`], level =
    /// priority, no groups), so the gateway's tier-based limits apply them unchanged: its
    /// `tokenRateLimits` as token windows and `requestRateLimits` as request windows. `None`:
    /// the subscription does not include the model.
    pub fn limits_tier(&self, model: &str) -> Option<Tier> {
        let m = self.model(model)?;
        Some(Tier {
            name: limits_tier_name(&self.name),
            display_name: self.display_name.clone(),
            description: None,
            level: i64::from(self.priority),
            groups: Vec::new(),
            limits: Limits {
                requests: m.request_rate_limits.clone(),
                tokens: m.token_rate_limits.clone(),
                budgets: m.budgets.clone(),
            },
            default_max_tokens: self.default_max_tokens,
            uncapped_requests: self.uncapped_requests,
            token_weights: m.token_weights,
            warn_at: self.warn_at.clone(),
            prices: Default::default(),
            pricing: m.pricing,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::TokenWeights;
    use serde_json::{Value, json};

    fn sample() -> Value {
        json!({
            "tiers": [{"name": "free", "level": 0, "groups": ["system:authenticated"]}],
            "models": [
                {"name": "sim", "path": "/llm/sim", "tiers": ["free"]},
                {"name": "big", "path": "/llm/big", "tiers": ["free"]}
            ],
            "subscriptions": [
                {"name": "team-a", "displayName": "Team A", "priority": 1,
                 "owner": {"groups": ["team-a"]},
                 "models": [{"name": "sim", "tokenRateLimits": [{"limit": 1000, "window": "1m"}]}],
                 "tokenMetadata": {"organizationId": "org-1", "costCenter": "cc-7", "labels": {"env": "dev"}}},
                {"name": "premium-sub", "namespace": "tenant-x", "priority": 5,
                 "owner": {"users": ["bob"]},
                 "models": [
                    {"name": "sim", "tokenRateLimits": [{"limit": 5000, "window": "1m"}, {"limit": 100000, "window": "1d"}],
                     "requestRateLimits": [{"limit": 60, "window": "1m"}], "billingRate": {"perToken": "0.000002"}},
                    {"name": "big", "tokenRateLimits": [{"limit": 2000, "window": "1h"}]}
                 ]}
            ]
        })
    }

    fn doc(v: Value) -> PolicyDocument {
        PolicyDocument::from_value(v).unwrap()
    }

    fn fails_at(v: Value, path: &str) {
        match PolicyDocument::from_value(v) {
            Ok(_) => panic!("expected an error at {path}"),
            Err(e) => assert_eq!(e.path, path, "{e}"),
        }
    }

    fn groups(g: &[&str]) -> Vec<String> {
        g.iter().map(|s| s.to_string()).collect()
    }

    fn sub(name: &str, priority: i32, owner_group: &str, limit: u64) -> Value {
        json!({"name": name, "priority": priority, "owner": {"groups": [owner_group]},
               "models": [{"name": "sim", "tokenRateLimits": [{"limit": limit, "window": "1m"}]}]})
    }

    fn with_subs(subs: Vec<Value>) -> PolicyDocument {
        let mut v = sample();
        v["subscriptions"] = Value::Array(subs);
        doc(v)
    }

    #[test]
    fn a_document_with_subscriptions_parses_and_roundtrips() {
        let d = doc(sample());
        assert_eq!(d.subscriptions.len(), 2);
        assert_eq!(d.subscriptions[0].namespace(), DEFAULT_NAMESPACE);
        assert_eq!(d.subscriptions[1].namespace(), "tenant-x");
        assert_eq!(d.subscriptions[0].priority, 1);
        assert_eq!(d.subscriptions[1].max_token_limit(), 100_000);
        let bytes = serde_json::to_vec(&d).unwrap();
        assert_eq!(PolicyDocument::from_json(&bytes).unwrap(), d);
    }

    #[test]
    fn a_tier_only_document_serializes_without_subscriptions() {
        let mut v = sample();
        v.as_object_mut().unwrap().remove("subscriptions");
        let d = doc(v);
        let json = serde_json::to_value(&d).unwrap();
        assert!(json.get("subscriptions").is_none(), "{json}");
    }

    #[test]
    fn priority_defaults_to_zero() {
        let mut v = sample();
        v["subscriptions"][0]
            .as_object_mut()
            .unwrap()
            .remove("priority");
        assert_eq!(doc(v).subscriptions[0].priority, 0);
    }

    type Mutation = Box<dyn Fn(&mut Value)>;

    /// A mutation of [`sample`] and the field its error names: the subscription's own fields.
    fn subscription_field_cases() -> Vec<(&'static str, Mutation)> {
        vec![
            (
                "subscriptions[1].name",
                Box::new(|v| v["subscriptions"][1]["name"] = json!("team-a")),
            ),
            (
                "subscriptions[0].name",
                Box::new(|v| v["subscriptions"][0]["name"] = json!("Team-A")),
            ),
            (
                "subscriptions[0].name",
                Box::new(|v| v["subscriptions"][0]["name"] = json!("a_b")),
            ),
            (
                "subscriptions[0].name",
                Box::new(|v| v["subscriptions"][0]["name"] = json!("-ab")),
            ),
            (
                "subscriptions[0].name",
                Box::new(|v| v["subscriptions"][0]["name"] = json!("x".repeat(64))),
            ),
            (
                "subscriptions[0].name",
                Box::new(|v| v["subscriptions"][0]["name"] = json!("")),
            ),
            (
                "subscriptions[1].namespace",
                Box::new(|v| v["subscriptions"][1]["namespace"] = json!("Tenant")),
            ),
            (
                "subscriptions[0].displayName",
                Box::new(|v| v["subscriptions"][0]["displayName"] = json!("  ")),
            ),
            (
                "subscriptions[0].owner",
                Box::new(|v| v["subscriptions"][0]["owner"] = json!({"groups": [], "users": []})),
            ),
            (
                "subscriptions[0].owner.groups[0]",
                Box::new(|v| v["subscriptions"][0]["owner"]["groups"][0] = json!("a b")),
            ),
            (
                "subscriptions[1].owner.users[0]",
                Box::new(|v| v["subscriptions"][1]["owner"]["users"][0] = json!("")),
            ),
            (
                "subscriptions[0].models",
                Box::new(|v| v["subscriptions"][0]["models"] = json!([])),
            ),
        ]
    }

    /// As [`subscription_field_cases`]: its models' fields, priority, token metadata.
    fn model_field_cases() -> Vec<(&'static str, Mutation)> {
        vec![
            (
                "subscriptions[0].models[0].name",
                Box::new(|v| v["subscriptions"][0]["models"][0]["name"] = json!("nope")),
            ),
            (
                "subscriptions[1].models[1].name",
                Box::new(|v| v["subscriptions"][1]["models"][1]["name"] = json!("sim")),
            ),
            (
                "subscriptions[0].models[0].tokenRateLimits",
                Box::new(|v| v["subscriptions"][0]["models"][0]["tokenRateLimits"] = json!([])),
            ),
            (
                "subscriptions[0].models[0]",
                Box::new(|v| {
                    v["subscriptions"][0]["models"][0]
                        .as_object_mut()
                        .unwrap()
                        .remove("tokenRateLimits");
                }),
            ),
            (
                "subscriptions[1].models[0].tokenRateLimits[0].limit",
                Box::new(|v| {
                    v["subscriptions"][1]["models"][0]["tokenRateLimits"][0]["limit"] = json!(0)
                }),
            ),
            (
                "subscriptions[1].models[0].tokenRateLimits[0].limit",
                Box::new(|v| {
                    v["subscriptions"][1]["models"][0]["tokenRateLimits"][0]["limit"] =
                        json!(1_000_000_001u64)
                }),
            ),
            (
                "subscriptions[1].models[0].tokenRateLimits[1].window",
                Box::new(|v| {
                    v["subscriptions"][1]["models"][0]["tokenRateLimits"][1]["window"] = json!("0m")
                }),
            ),
            (
                "subscriptions[1].models[0].tokenRateLimits[1].window",
                Box::new(|v| {
                    v["subscriptions"][1]["models"][0]["tokenRateLimits"][1]["window"] = json!("1m")
                }),
            ),
            (
                "subscriptions[1].models[0].requestRateLimits[0].limit",
                Box::new(|v| {
                    v["subscriptions"][1]["models"][0]["requestRateLimits"][0]["limit"] = json!(0)
                }),
            ),
            (
                "subscriptions[1].models[0].billingRate.perToken",
                Box::new(|v| {
                    v["subscriptions"][1]["models"][0]["billingRate"]["perToken"] = json!("-1")
                }),
            ),
            (
                "subscriptions[1].models[0].billingRate.perToken",
                Box::new(|v| {
                    v["subscriptions"][1]["models"][0]["billingRate"]["perToken"] = json!("1e-6")
                }),
            ),
            (
                "subscriptions[0].tokenMetadata.costCenter",
                Box::new(|v| v["subscriptions"][0]["tokenMetadata"]["costCenter"] = json!("")),
            ),
            (
                "subscriptions[0].tokenMetadata.colour",
                Box::new(|v| v["subscriptions"][0]["tokenMetadata"]["colour"] = json!("red")),
            ),
            (
                "subscriptions[0].priority",
                Box::new(|v| v["subscriptions"][0]["priority"] = json!(3_000_000_000u64)),
            ),
            (
                "subscriptions[0].extra",
                Box::new(|v| v["subscriptions"][0]["extra"] = json!(1)),
            ),
        ]
    }

    #[test]
    fn validation_errors_name_the_field() {
        let cases = subscription_field_cases()
            .into_iter()
            .chain(model_field_cases());
        for (path, mutate) in cases {
            let mut v = sample();
            mutate(&mut v);
            fails_at(v, path);
        }
        // Accepted edge values.
        let mut v = sample();
        v["subscriptions"][0]["name"] = json!("a".repeat(63));
        v["subscriptions"][1]["models"][0]["tokenRateLimits"][0]["limit"] = json!(MAX_TOKEN_LIMIT);
        v["subscriptions"][1]["models"][0]["billingRate"]["perToken"] = json!("12");
        v["subscriptions"][0]["priority"] = json!(-3);
        assert!(PolicyDocument::from_value(v).is_ok());
    }

    #[test]
    fn duplicate_priorities_with_a_shared_owner_are_a_warning_not_an_error() {
        let d = with_subs(vec![
            sub("a", 1, "g", 10),
            sub("b", 1, "g", 20),
            sub("c", 1, "h", 10),
        ]);
        let w = d.warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("subscriptions[0] (a)") && w[0].contains("subscriptions[1] (b)"),
            "{}",
            w[0]
        );
        assert!(w[0].contains("group \"g\""), "{}", w[0]);
        assert!(doc(sample()).warnings().is_empty());
    }

    #[test]
    fn access_is_by_user_or_group() {
        let d = doc(sample());
        let names = |u: &str, g: &[&str]| -> Vec<String> {
            accessible(&d, u, &groups(g))
                .iter()
                .map(|s| s.name.clone())
                .collect()
        };
        assert_eq!(names("alice", &["team-a"]), ["team-a"]);
        assert_eq!(names("bob", &["other"]), ["premium-sub"]);
        assert_eq!(
            names("bob", &["team-a"]),
            ["premium-sub", "team-a"],
            "sorted by name"
        );
        assert!(names("eve", &["other"]).is_empty());
        // A group named like the user does not grant a user-owned subscription.
        assert!(names("eve", &["bob"]).is_empty());
    }

    #[test]
    fn default_for_mint_takes_priority_then_largest_limit_then_name() {
        let d = with_subs(vec![sub("low", 0, "g", 999_999), sub("high", 2, "g", 1)]);
        assert_eq!(
            default_for_mint(&d, "u", &groups(&["g"])).unwrap().name,
            "high"
        );
        let d = with_subs(vec![sub("small", 1, "g", 10), sub("large", 1, "g", 20)]);
        assert_eq!(
            default_for_mint(&d, "u", &groups(&["g"])).unwrap().name,
            "large"
        );
        let d = with_subs(vec![sub("zeta", 1, "g", 10), sub("alpha", 1, "g", 10)]);
        assert_eq!(
            default_for_mint(&d, "u", &groups(&["g"])).unwrap().name,
            "alpha"
        );
        // Only the caller's own.
        let d = with_subs(vec![sub("theirs", 9, "other", 10), sub("mine", 0, "g", 10)]);
        assert_eq!(
            default_for_mint(&d, "u", &groups(&["g"])).unwrap().name,
            "mine"
        );
        assert!(default_for_mint(&d, "u", &groups(&["none"])).is_none());
    }

    #[test]
    fn select_named_checks_existence_access_and_model() {
        let d = doc(sample());
        let bob = groups(&["x"]);
        let alice = groups(&["team-a"]);
        assert_eq!(
            select(&d, "bob", &bob, Some("premium-sub"), Some("big"))
                .unwrap()
                .name,
            "premium-sub"
        );
        assert_eq!(
            select(&d, "bob", &bob, Some(" tenant-x/premium-sub "), None)
                .unwrap()
                .name,
            "premium-sub"
        );
        assert_eq!(
            select(
                &d,
                "alice",
                &alice,
                Some("models-as-a-service/team-a"),
                Some("sim")
            )
            .unwrap()
            .name,
            "team-a"
        );
        assert_eq!(
            select(&d, "bob", &bob, Some("other-ns/premium-sub"), None),
            Err(SelectError::NotFound)
        );
        assert_eq!(
            select(&d, "bob", &bob, Some("gold"), None),
            Err(SelectError::NotFound)
        );
        // Someone else's subscription is answered as one that does not exist (whatever the
        // model), so naming subscriptions tells nothing of which exist.
        assert_eq!(
            select(&d, "bob", &bob, Some("team-a"), None),
            Err(SelectError::NotFound)
        );
        assert_eq!(
            select(&d, "bob", &bob, Some("team-a"), Some("big")),
            Err(SelectError::NotFound)
        );
        assert_eq!(
            select(&d, "alice", &alice, Some("team-a"), Some("big")),
            Err(SelectError::ModelNotInSubscription)
        );
        // Blank is "none requested".
        assert_eq!(
            select(&d, "alice", &alice, Some("  "), Some("sim"))
                .unwrap()
                .name,
            "team-a"
        );
    }

    #[test]
    fn select_without_a_request_needs_exactly_one_match() {
        let d = doc(sample());
        let both = groups(&["team-a"]);
        assert_eq!(
            select(&d, "bob", &both, None, Some("big")).unwrap().name,
            "premium-sub",
            "only one has the model"
        );
        assert_eq!(
            select(&d, "bob", &both, None, Some("sim")),
            Err(SelectError::MultipleSubscriptions)
        );
        assert_eq!(
            select(&d, "bob", &both, None, None),
            Err(SelectError::MultipleSubscriptions)
        );
        assert_eq!(
            select(&d, "alice", &both, None, Some("big")),
            Err(SelectError::NoSubscription)
        );
        assert_eq!(
            select(&d, "eve", &[], None, None),
            Err(SelectError::NoSubscription)
        );
    }

    #[test]
    fn error_codes_are_the_references() {
        assert_eq!(SelectError::NoSubscription.code(), "not_found");
        assert_eq!(SelectError::NotFound.code(), "not_found");
        // One code and message for a subscription that does not exist and one not the caller's.
        assert_eq!(
            (
                SelectError::NotFound.code(),
                SelectError::NotFound.message()
            ),
            ("not_found", "requested subscription not found")
        );
        assert!(SelectError::ALL.iter().all(|e| e.code() != "access_denied"));
        assert_eq!(
            SelectError::from_message("access denied to requested subscription"),
            Some(SelectError::NotFound),
            "an older companion's refusal is still recognised"
        );
        assert_eq!(
            SelectError::MultipleSubscriptions.code(),
            "multiple_subscriptions"
        );
        assert_eq!(
            SelectError::ModelNotInSubscription.code(),
            "model_not_in_subscription"
        );
        assert!(
            SelectError::MultipleSubscriptions
                .message()
                .contains("X-MaaS-Subscription")
        );
    }

    #[test]
    fn counter_subjects_are_distinct_per_subscription_model_and_subject() {
        let a = counter_subject("alice", "team-a", "sim");
        assert_eq!(a, "team-a\u{1f}sim\u{1f}alice");
        assert_ne!(a, counter_subject("alice", "team-a", "big"));
        assert_ne!(a, counter_subject("alice", "premium-sub", "sim"));
        assert_ne!(a, counter_subject("bob", "team-a", "sim"));
        assert_ne!(a, "alice", "never a plain subject's counter");
        // A model name with the characters a readable separator would use stays unambiguous.
        assert_ne!(
            counter_subject("c/d", "s", "b"),
            counter_subject("d", "s", "b/c")
        );
    }

    #[test]
    fn a_pooled_subscription_counts_every_user_in_one_counter() {
        let mut d = doc(sample());
        let plain = d.subscription("premium-sub").unwrap().clone();
        assert_eq!(
            plain.counter_subject_of("alice", "sim"),
            counter_subject("alice", "premium-sub", "sim")
        );
        assert_ne!(
            plain.counter_subject_of("alice", "sim"),
            plain.counter_subject_of("bob", "sim")
        );
        let sub = d
            .subscriptions
            .iter_mut()
            .find(|s| s.name == "premium-sub")
            .unwrap();
        sub.pool = true;
        let pooled = sub.clone();
        assert_eq!(
            pooled.counter_subject_of("alice", "sim"),
            pooled.counter_subject_of("bob", "sim")
        );
        assert_ne!(
            pooled.counter_subject_of("alice", "sim"),
            pooled.counter_subject_of("alice", "big"),
            "one pool per model"
        );
        // Written and read back; absent when false.
        let v = serde_json::to_value(&d).unwrap();
        assert!(
            v["subscriptions"]
                .as_array()
                .unwrap()
                .iter()
                .any(|s| s["pool"] == true)
        );
        assert!(
            v["subscriptions"]
                .as_array()
                .unwrap()
                .iter()
                .any(|s| s.get("pool").is_none())
        );
        assert_eq!(PolicyDocument::from_value(v).unwrap(), d);
    }

    #[test]
    fn a_subscription_model_becomes_a_tier_with_its_windows() {
        let d = doc(sample());
        let premium = d.subscription("premium-sub").unwrap();
        let t = premium.limits_tier("sim").unwrap();
        assert_eq!(t.name, "subscription:premium-sub");
        assert_eq!(t.level, 5);
        assert!(t.groups.is_empty());
        assert_eq!(
            t.limits.tokens.iter().map(|l| l.limit).collect::<Vec<_>>(),
            [5000, 100_000]
        );
        assert_eq!(
            t.limits
                .requests
                .iter()
                .map(|l| l.limit)
                .collect::<Vec<_>>(),
            [60]
        );
        let big = premium.limits_tier("big").unwrap();
        assert_eq!(big.limits.tokens.len(), 1);
        assert!(big.limits.requests.is_empty());
        assert!(
            d.subscription("team-a")
                .unwrap()
                .limits_tier("big")
                .is_none()
        );
    }

    #[test]
    fn a_subscription_models_token_weights_go_into_its_tier_and_are_validated() {
        let mut v = sample();
        v["subscriptions"][1]["models"][0]["tokenWeights"] = json!({"input": 2, "output": 4});
        let d = doc(v.clone());
        let premium = d.subscription("premium-sub").unwrap();
        let sim = premium.limits_tier("sim").unwrap();
        assert_eq!(
            sim.token_weights,
            TokenWeights {
                input: 2,
                output: 4
            }
        );
        // Per model: the other model keeps the default.
        assert!(
            premium
                .limits_tier("big")
                .unwrap()
                .token_weights
                .is_default()
        );
        let bytes = serde_json::to_vec(&d).unwrap();
        assert_eq!(PolicyDocument::from_json(&bytes).unwrap(), d);
        let mut bad = v.clone();
        bad["subscriptions"][1]["models"][0]["tokenWeights"] = json!({"output": 0});
        fails_at(bad, "subscriptions[1].models[0].tokenWeights.output");
        let mut bad = v;
        bad["subscriptions"][1]["models"][1]["tokenWeights"] = json!({"input": 5000});
        fails_at(bad, "subscriptions[1].models[1].tokenWeights.input");
    }

    #[test]
    fn the_last_non_empty_header_value_wins() {
        assert_eq!(requested_from_header(["a", "b"]), Some("b"));
        assert_eq!(requested_from_header(["a", " "]), Some("a"));
        assert_eq!(requested_from_header(["a, b ,"]), Some("b"));
        assert_eq!(requested_from_header(["", ","]), None);
        assert_eq!(requested_from_header([]), None);
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        fn subs() -> impl Strategy<Value = Vec<(i32, u64, u8)>> {
            prop::collection::vec((-2i32..3, 1u64..5, 0u8..3), 0..6)
        }

        fn build(specs: &[(i32, u64, u8)]) -> PolicyDocument {
            with_subs(
                specs
                    .iter()
                    .enumerate()
                    .map(|(i, (p, l, g))| sub(&format!("s{i}"), *p, &format!("g{g}"), *l))
                    .collect(),
            )
        }

        proptest! {
            /// The default is accessible and no accessible subscription beats it in the mint order.
            #[test]
            fn default_for_mint_is_the_best_accessible(specs in subs(), g in 0u8..3) {
                let d = build(&specs);
                let gs = vec![format!("g{g}")];
                let all = accessible(&d, "u", &gs);
                match default_for_mint(&d, "u", &gs) {
                    None => prop_assert!(all.is_empty()),
                    Some(best) => {
                        prop_assert!(best.has_access("u", &gs));
                        for s in all {
                            prop_assert!(mint_order(best, s) != std::cmp::Ordering::Greater);
                        }
                    }
                }
            }

            /// Selecting by name succeeds exactly for accessible subscriptions, and selecting
            /// without a name succeeds exactly when one is accessible.
            #[test]
            fn select_agrees_with_accessible(specs in subs(), g in 0u8..3, pick in 0usize..6) {
                let d = build(&specs);
                let gs = vec![format!("g{g}")];
                let all = accessible(&d, "u", &gs);
                let name = format!("s{pick}");
                let by_name = select(&d, "u", &gs, Some(&name), Some("sim"));
                prop_assert_eq!(by_name.is_ok(), all.iter().any(|s| s.name == name));
                if pick >= specs.len() {
                    prop_assert_eq!(by_name, Err(SelectError::NotFound));
                }
                let auto = select(&d, "u", &gs, None, None);
                match all.len() {
                    0 => prop_assert_eq!(auto, Err(SelectError::NoSubscription)),
                    1 => prop_assert_eq!(auto.map(|s| s.name.clone()), Ok(all[0].name.clone())),
                    _ => prop_assert_eq!(auto, Err(SelectError::MultipleSubscriptions)),
                }
            }
        }
    }
}
