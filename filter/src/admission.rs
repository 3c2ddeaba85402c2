//! Where a request is decided: three pure functions, in order, over a borrowed snapshot of the
//! worker's state and the facts the request's callbacks read once. No host, no shared store, no
//! interior mutability: each returns a verdict the request state machine (`crate::request`)
//! applies — a refusal to answer, headers to change, counters to ask.
//!
//! 1. [`route`] (at the request headers): management or a model; its operation, the credential
//!    and whether the body is read (and the headers held for it).
//! 2. [`authorize`] (once the caller is known): the subscription or tiers, whose counters, the
//!    provider credential and the upstream check, and the [`HeaderPlan`] of what the backend
//!    must not see and what it must.
//! 3. [`ask`] (once the body is known): the body's model, the tokens to reserve (weighted) and
//!    the output cap to set on a body that names none.

use crate::cache::CachedIdentity;
use crate::config::PluginConfig;
use crate::credential::{self, Credential};
use crate::decide;
use crate::hygiene;
use crate::limits;
use crate::operations::{self, Operation};
use crate::path::{self, PathClass};
use crate::request_body::RequestInfo;
use crate::response::{Deny, Refusal};
use maas_types::subscription::counter_subject;
use maas_types::{CredentialsDocument, Model, PolicyDocument, Tier, TokenWeights};
use smallvec::SmallVec;
use std::borrow::Cow;
use std::collections::HashSet;
use std::rc::Rc;

/// The client header that names a subscription (token callers); never forwarded as sent.
pub const SUBSCRIPTION_HEADER: &str = "x-maas-subscription";

/// What a decision reads of the worker's state, borrowed for one callback.
#[derive(Clone, Copy)]
pub struct Snapshot<'a> {
    pub cfg: &'a PluginConfig,
    pub policy: Option<&'a PolicyDocument>,
    pub credentials: &'a CredentialsDocument,
    pub revoked: &'a HashSet<String>,
    /// The request headers may wait for the body: `pauseHeadersForBody`, unless this worker
    /// found that Envoy never hands a held body over.
    pub hold_headers: bool,
}

/// The request headers as read once (values borrowed from the header map).
#[derive(Debug, Clone, Copy, Default)]
pub struct HeaderFacts<'h> {
    pub path: &'h str,
    pub method: &'h str,
    pub authorization: Option<&'h str>,
    pub x_api_key: Option<&'h str>,
    pub content_type: Option<&'h str>,
    /// The first `content-length` and how many there were.
    pub content_length: (Option<&'h str>, usize),
    pub transfer_encoding: Option<&'h str>,
    /// END_STREAM came with the headers (no body).
    pub end_of_stream: bool,
}

/// What [`route`] decided.
#[derive(Debug)]
pub enum Route<'h> {
    /// A management path: the companion authenticates it; only the reserved namespace goes.
    Management,
    Model(ModelRoute<'h>),
}

/// A request for a model.
#[derive(Debug)]
pub struct ModelRoute<'h> {
    pub model_idx: usize,
    pub operation: Operation,
    pub credential: Credential<'h>,
    pub body: BodyIntent,
}

/// Whether the body is read before the request is decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyIntent {
    /// No body, or one streamed through unread (uploads of custom operations).
    Unread,
    /// Buffered to its end; `hold`: the headers wait for it; `declared`: its one plain
    /// `content-length` (it is whole when that many bytes are there).
    Read { hold: bool, declared: Option<usize> },
}

/// Why [`route`] refused.
#[derive(Debug)]
pub enum RouteRefusal {
    Refused(Refusal),
    /// An API key revoked recently: refused, and its cache entry goes (`cache_key`).
    Revoked {
        cache_key: String,
    },
}

impl From<Refusal> for RouteRefusal {
    fn from(r: Refusal) -> Self {
        RouteRefusal::Refused(r)
    }
}

/// The request headers: management path, or the model, its allow-listed operation, the
/// credential and the body's handling. Everything refused here never reaches a backend.
pub fn route<'h>(f: &HeaderFacts<'h>, s: &Snapshot<'_>) -> Result<Route<'h>, RouteRefusal> {
    let model_path = match path::classify(f.path, &s.cfg.management_path_prefix) {
        Ok(PathClass::Model(p)) => p,
        Ok(PathClass::Management) => return Ok(Route::Management),
        Err(e) => return Err(RouteRefusal::Refused(e.into())),
    };
    let policy = s.policy.ok_or_else(Refusal::no_policy)?;
    let model = policy
        .model_for_path(model_path)
        .ok_or_else(Refusal::model_not_found)?;
    // Only the model's allow-listed (method, path) pairs go on (404 otherwise).
    let operation = operations::allowed(model, f.method, model_path)?;
    let model_idx = policy
        .models
        .iter()
        .position(|m| std::ptr::eq(m, model))
        .ok_or_else(Refusal::model_not_found)?;
    let credential = credential::extract(f.authorization, f.x_api_key)
        .map_err(|e| RouteRefusal::Refused(e.into()))?;
    if let Some(key_id) = credential.key_id()
        && s.revoked.contains(key_id)
    {
        return Err(RouteRefusal::Revoked {
            cache_key: credential::api_key_cache_key(key_id),
        });
    }
    // The metered JSON APIs are read whatever content-type the client claims (a backend may
    // parse the body as JSON anyway); only custom operations may stream uploads unread.
    let read = operation != Operation::Custom || hygiene::inspect_body(f.content_type);
    let body = if f.end_of_stream || !read {
        BodyIntent::Unread
    } else {
        BodyIntent::Read {
            hold: s.hold_headers,
            declared: match (f.content_length, f.transfer_encoding) {
                ((Some(value), 1), None) => declared_length(value),
                _ => None,
            },
        }
    };
    Ok(Route::Model(ModelRoute {
        model_idx,
        operation,
        credential,
        body,
    }))
}

/// The body length a request declares in its only `content-length` (the caller counts them):
/// plain ASCII digits that fit; else none (the body is then held to its end).
pub(crate) fn declared_length(value: &str) -> Option<usize> {
    let digits =
        !value.is_empty() && value.len() <= 12 && value.bytes().all(|b| b.is_ascii_digit());
    if !digits {
        return None;
    }
    value.parse().ok()
}

/// A counter slot's shared-data key: the worker's copy of the credential shares its own (no
/// copy per request); one hashed for this request (under a subscription) is owned.
#[derive(Debug, Clone)]
pub enum SlotKey {
    Shared(Rc<str>),
    Own(String),
}

impl std::ops::Deref for SlotKey {
    type Target = str;

    fn deref(&self) -> &str {
        match self {
            SlotKey::Shared(k) => k,
            SlotKey::Own(k) => k,
        }
    }
}

/// The subscription a request runs under: its name, its limits on the model as a tier, and
/// whose counters they are (per subject, subscription and model).
#[derive(Debug)]
pub struct SubscriptionRun {
    pub name: String,
    pub tier: Tier,
    pub counter_subject: Rc<str>,
}

/// Who the caller is for the limits, once authorised.
#[derive(Debug)]
pub struct Authorized {
    pub subject: Rc<str>,
    /// Under a subscription its limits replace the tiers'.
    pub subscription: Option<Box<SubscriptionRun>>,
    /// The tier the request runs on and the subject's highest (one budget per person), as
    /// indices in the policy decided with; none under a subscription.
    pub tier_idx: Option<usize>,
    pub highest_tier_idx: Option<usize>,
    /// The counter slot, hashed once for the whole request.
    pub counter_key: SlotKey,
}

impl Authorized {
    /// Whose counters the request counts in: the subscription's counter subject, else the
    /// subject's own.
    pub fn limits_subject(&self) -> &str {
        match &self.subscription {
            Some(s) => &s.counter_subject,
            None => &self.subject,
        }
    }

    /// The tier the request runs on (a subscription's stand-in tier).
    pub fn tier<'p>(&'p self, policy: &'p PolicyDocument) -> Option<&'p Tier> {
        match &self.subscription {
            Some(s) => Some(&s.tier),
            None => policy.tiers.get(self.tier_idx?),
        }
    }

    /// The windows that apply: the subscription's, else the tier's and the subject's highest
    /// tier's (the limits count a tier listed twice once). No allocation.
    pub fn windows<'p>(&'p self, policy: &'p PolicyDocument) -> SmallVec<[&'p Tier; 2]> {
        let mut out = SmallVec::new();
        match &self.subscription {
            Some(s) => out.push(&s.tier),
            None => {
                for i in [self.tier_idx, self.highest_tier_idx].into_iter().flatten() {
                    if let Some(t) = policy.tiers.get(i) {
                        out.push(t);
                    }
                }
            }
        }
        out
    }
}

/// Headers to change before the request leaves: names to remove (as the client spelt them) and
/// values to set (`None`: removed). Applied in order: removals, then sets.
#[derive(Debug, Default)]
pub struct HeaderPlan<'h> {
    pub remove: SmallVec<[&'h str; 8]>,
    pub set: SmallVec<[HeaderSet; 4]>,
}

/// A header to set (`None`: removed): its name and value.
pub type HeaderSet = (&'static str, Option<Cow<'static, str>>);

/// What [`authorize`] reads besides the snapshot.
pub struct Caller<'a, 'h> {
    pub identity: &'a CachedIdentity,
    /// The subject (shared with the worker's copy of the credential: no copy per request).
    pub subject: Rc<str>,
    /// The credential is an API key (a key's subscription binds; a client header does not).
    pub api_key: bool,
    /// `X-MaaS-Subscription` as sent (the last non-empty value).
    pub requested_subscription: Option<&'a str>,
    /// The client's header names (what to strip is decided on every spelling).
    pub header_names: &'a [&'h str],
    /// The subject's counter key from the worker's copy of the credential, when it had one.
    pub counter_key: Option<Rc<str>>,
}

/// The caller is known: subscription or tier (403s), the provider credential (503 when it is
/// not there yet), the upstream check (503 `upstream_mismatch`: a route the gateway did not
/// create never gets the provider key; `cluster` reads Envoy's cluster name, only when the
/// model names one) and the header plan.
pub fn authorize<'h>(
    s: &Snapshot<'_>,
    model_idx: usize,
    intent: BodyIntent,
    op: OperationTraits,
    caller: Caller<'_, 'h>,
    cluster: &dyn Fn() -> Option<String>,
) -> Result<(Authorized, HeaderPlan<'h>), Refusal> {
    let policy = s.policy.ok_or_else(Refusal::no_policy)?;
    let model = policy
        .models
        .get(model_idx)
        .ok_or_else(Refusal::model_not_found)?;
    let identity = caller.identity;
    let subscription = match decide::subscription(
        policy,
        identity,
        caller.api_key,
        caller.requested_subscription,
        model,
    )? {
        Some(sub) => Some(Box::new(SubscriptionRun {
            name: sub.name.clone(),
            tier: sub.limits_tier(&model.name).ok_or_else(|| {
                Refusal::new(Deny::ModelNotInSubscription, "model not in subscription")
            })?,
            counter_subject: Rc::from(counter_subject(&identity.subject, &sub.name, &model.name)),
        })),
        None => None,
    };
    let (tier_idx, highest_tier_idx) = match &subscription {
        Some(_) => (None, None),
        None => {
            let tier = decide::authorize(policy, identity, model)?;
            // One budget per person: the subject's own highest tier's windows apply to every
            // request, a pinned (lower) tier's too.
            let highest = policy.resolve_tier(&identity.groups, None).unwrap_or(tier);
            (
                policy.tiers.iter().position(|t| std::ptr::eq(t, tier)),
                policy.tiers.iter().position(|t| std::ptr::eq(t, highest)),
            )
        }
    };
    // The subject's own slot key may come from the worker's copy of the credential.
    let counter_key = match (&subscription, caller.counter_key) {
        (None, Some(k)) => SlotKey::Shared(k),
        (Some(sub), _) => SlotKey::Own(limits::counter_key(
            &sub.counter_subject,
            s.cfg.limits.counter_slots,
        )),
        (None, None) => SlotKey::Own(limits::counter_key(
            &identity.subject,
            s.cfg.limits.counter_slots,
        )),
    };
    let provider_key = provider_key(s.credentials, model)?;
    operations::check_upstream(model, cluster)?;
    let plan = header_plan(
        s.cfg,
        caller.header_names,
        provider_key,
        subscription.as_deref().map(|sub| sub.name.as_str()),
        matches!(intent, BodyIntent::Read { hold: false, .. }) && !op.discovery,
    );
    Ok((
        Authorized {
            subject: caller.subject,
            subscription,
            tier_idx,
            highest_tier_idx,
            counter_key,
        },
        plan,
    ))
}

/// The model's provider credential, when it has a provider.
fn provider_key<'c>(
    credentials: &'c CredentialsDocument,
    model: &Model,
) -> Result<Option<(maas_types::ProviderKind, &'c str)>, Refusal> {
    let Some(p) = &model.provider else {
        return Ok(None);
    };
    match credentials.credentials.get(&p.credential_ref) {
        Some(k) => Ok(Some((p.kind, k.as_str()))),
        None => Err(Refusal::new(
            Deny::ProviderCredentialMissing,
            format!("no credential for model {} yet; retry shortly", model.name),
        )),
    }
}

/// Hygiene: nothing the client sent reaches the backend as identity; usage asked uncompressed;
/// the provider credential; the subscription the gateway selected (as the reference's gateway
/// injects it), never the client's value; a body that may be rewritten after the headers left
/// is framed by the upstream codec (no `content-length`).
fn header_plan<'h>(
    cfg: &PluginConfig,
    names: &[&'h str],
    provider_key: Option<(maas_types::ProviderKind, &str)>,
    subscription: Option<&str>,
    unframe_body: bool,
) -> HeaderPlan<'h> {
    let mut plan = HeaderPlan::default();
    let mut client_anthropic_version = false;
    for name in names {
        if hygiene::strip_for_model(name, &cfg.remove_headers) {
            plan.remove.push(name);
        } else if name.eq_ignore_ascii_case("anthropic-version") {
            client_anthropic_version = true;
        }
    }
    // Usage is read from the response body: ask the backend for it uncompressed (Envoy may
    // compress towards the client). A backend that compresses anyway is decoded for reading.
    plan.set
        .push(("accept-encoding", Some(Cow::Borrowed("identity"))));
    if let Some((kind, key)) = provider_key {
        for (name, value) in hygiene::provider_headers(kind, key, client_anthropic_version) {
            plan.set.push((name, Some(Cow::Owned(value))));
        }
    }
    if let Some(name) = subscription {
        plan.set
            .push((SUBSCRIPTION_HEADER, Some(Cow::Owned(name.to_string()))));
    }
    if unframe_body {
        plan.set.push(("content-length", None));
    }
    plan
}

/// What [`ask`] decided: the tokens to reserve and what the response settles against.
#[derive(Debug, Clone, Copy, Default)]
pub struct Metering {
    /// The prompt estimate reserved (settles an aborted stream).
    pub prompt_tokens_estimate: u64,
    /// Raw tokens reserved: input (the prompt estimate) and output (the completion budget).
    pub reserved: decide::Tokens,
    /// The weights that turn raw tokens into the limits' unit.
    pub weights: TokenWeights,
    /// The cap to set on a body that names none (its API field and the completion budget).
    pub cap: Option<(&'static str, u64)>,
}

impl Metering {
    /// What the limits reserve (weighted).
    pub fn reserve(&self) -> u64 {
        self.reserved.weighted(self.weights)
    }
}

/// What the request's operation means for its body.
#[derive(Debug, Clone, Copy)]
pub struct OperationTraits {
    /// Model discovery: authenticated, never counted.
    pub discovery: bool,
    /// Generates nothing (Anthropic `count_tokens`): a request, no tokens.
    pub unmetered: bool,
    /// The body field that caps the output (`Operation::cap_field`).
    pub cap_field: Option<&'static str>,
    /// The body may carry `stream_options` (OpenAI chat/completions and completions).
    pub accepts_stream_options: bool,
}

impl OperationTraits {
    pub fn of(operation: Operation, model: &Model) -> Self {
        OperationTraits {
            discovery: operation.is_discovery(),
            unmetered: operation.is_unmetered(),
            cap_field: operation.cap_field(model.provider.as_ref().map(|p| p.kind)),
            accepts_stream_options: operation.accepts_stream_options(),
        }
    }
}

/// The body is known (or there is none): its model must be the route's (400 `model_mismatch`;
/// an unreadable body is 400 `invalid_body` unless the request is discovery), then the tokens
/// to reserve against `windows` (the first is the tier the request runs on). `None`: discovery,
/// which counts nothing.
pub fn ask(
    model: &Model,
    windows: &[&Tier],
    body: Option<&Result<RequestInfo, String>>,
    op: OperationTraits,
) -> Result<Option<Metering>, Refusal> {
    match body {
        Some(Ok(info)) => decide::check_body_model(info, model)?,
        Some(Err(e)) if !op.discovery => {
            return Err(Refusal::new(Deny::InvalidBody, e.as_str()));
        }
        _ => {}
    }
    if op.discovery {
        return Ok(None);
    }
    let tier = windows.first().copied().ok_or_else(Refusal::no_policy)?;
    let info = match body {
        Some(Ok(info)) => Some(info),
        _ => None,
    };
    // Tokens in the limits' unit: input and output weighted (the larger weights of the tiers
    // whose windows apply). An unmetered operation reserves none.
    let weights = decide::weights(windows);
    if op.unmetered {
        return Ok(Some(Metering {
            weights,
            ..Metering::default()
        }));
    }
    Ok(Some(Metering {
        prompt_tokens_estimate: info.map_or(0, |i| i.prompt_tokens_estimate),
        reserved: decide::reservation(info, tier),
        weights,
        cap: info.and_then(|i| decide::injected_cap(i, op.cap_field, tier)),
    }))
}

#[cfg(test)]
mod tests;
