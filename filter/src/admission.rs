//! Where a request is decided: three pure functions, in order, over a borrowed snapshot of the
//! worker's state and the facts the request's callbacks read once. No host, no shared store, no
//! interior mutability: each returns a verdict the request state machine (`crate::request`)
//! applies — a refusal to answer, headers to change, counters to ask.
//!
//! 1. [`route`] (at the request headers): management or a model; its operation, the credential
//!    and whether the body is read (and the headers held for it). At the one base URL
//!    (`{gateway}/v1/chat/completions`…) the body names the model: [`route_body`] finds it
//!    once the body is read; `GET /v1/models` is answered from the policy ([`catalog`]).
//! 2. [`authorize`] (once the caller and the model are known): the subscription or tiers, whose
//!    counters, the provider credential and the upstream check, and the [`HeaderPlan`] of what
//!    the backend must not see and what it must (at the one base URL also the routing header
//!    [`ROUTING_HEADER`] Envoy chooses the model's route by).
//! 3. [`ask`] (once the body is known): the body's model, the tokens to reserve (weighted) and
//!    the output cap to set on a body that names none.

use crate::cache::CachedIdentity;
use crate::config::PluginConfig;
use crate::cooldown::Cooled;
use crate::credential::{self, Credential};
use crate::decide;
use crate::hygiene;
use crate::limits;
use crate::operations::{self, OneUrl, Operation};
use crate::path::{self, PathClass};
use crate::request_body::{BodyError, RequestInfo};
use crate::response::{Deny, Refusal};
use maas_types::{CredentialsDocument, Model, PolicyDocument, Tier, TokenWeights};
use smallvec::SmallVec;
use std::borrow::Cow;
use std::collections::HashSet;
use std::rc::Rc;

/// The client header that names a subscription (token callers); never forwarded as sent.
pub const SUBSCRIPTION_HEADER: &str = "x-maas-subscription";

/// The header the filter sets to the model's name at the one base URL: the gateway's routes
/// for the one base URL match it, and Envoy chooses the route again once the filter changed the
/// request headers. In the reserved namespace, so a client's copy is removed first and never
/// routes anything.
pub const ROUTING_HEADER: &str = maas_types::MODEL_ROUTING_HEADER;

/// What a decision reads of the worker's state, borrowed for one callback.
#[derive(Clone, Copy)]
pub struct Snapshot<'a> {
    pub cfg: &'a PluginConfig,
    pub policy: Option<&'a PolicyDocument>,
    pub credentials: &'a CredentialsDocument,
    pub revoked: &'a HashSet<String>,
    /// Backends cooling down on this worker (`crate::cooldown`).
    pub cooled: &'a Cooled,
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
    pub target: Target<'h>,
    pub operation: Operation,
    pub credential: Credential<'h>,
    pub body: BodyIntent,
}

/// Which model a request is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target<'h> {
    /// The model whose path prefix the path is under (its index in the policy decided with).
    Path(usize),
    /// The one base URL: the body's `model` names the model ([`route_body`]); the operation's
    /// path, which is also its path relative to a model prefix.
    Body(&'static str),
    /// `GET /v1/models` (`None`) or `GET /v1/models/{id}` at the one base URL: answered by the
    /// gateway from the policy once the caller is known ([`catalog`]).
    Catalog(Option<&'h str>),
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

/// The request headers: management path, or the model (the path's, or the one the body will
/// name at the one base URL), its allow-listed operation, the credential and the body's
/// handling. Everything refused here never reaches a backend.
pub fn route<'h>(f: &HeaderFacts<'h>, s: &Snapshot<'_>) -> Result<Route<'h>, RouteRefusal> {
    let model_path = match path::classify(f.path, &s.cfg.management_path_prefix) {
        Ok(PathClass::Model(p)) => p,
        Ok(PathClass::Management) => return Ok(Route::Management),
        Err(e) => return Err(RouteRefusal::Refused(e.into())),
    };
    let policy = s.policy.ok_or_else(Refusal::no_policy)?;
    let (target, operation) = match operations::one_url(f.method, model_path) {
        Some(Ok(OneUrl::Model(operation, rest))) => {
            // The body picks the route: the headers must wait for it (else they would leave
            // undecided, to no model's route).
            if !s.hold_headers {
                return Err(body_routing_unavailable().into());
            }
            if f.end_of_stream {
                return Err(no_model_named().into());
            }
            (Target::Body(rest), operation)
        }
        Some(Ok(OneUrl::List)) => (Target::Catalog(None), Operation::Models),
        Some(Ok(OneUrl::Retrieve(id))) => (Target::Catalog(Some(id)), Operation::Models),
        Some(Err(r)) => return Err(r.into()),
        None => path_model(policy, f.method, model_path)?,
    };
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
    // parse the body as JSON anyway); only custom operations may stream uploads unread. The
    // gateway's own list of models reads none.
    let read = !matches!(target, Target::Catalog(_))
        && (operation != Operation::Custom || hygiene::inspect_body(f.content_type));
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
        target,
        operation,
        credential,
        body,
    }))
}

/// The model a path prefix names and its allow-listed operation (404 otherwise).
fn path_model<'h>(
    policy: &PolicyDocument,
    method: &str,
    model_path: &str,
) -> Result<(Target<'h>, Operation), Refusal> {
    let model = policy
        .model_for_path(model_path)
        .ok_or_else(Refusal::model_not_found)?;
    let operation = operations::allowed(model, method, model_path)?;
    let model_idx = policy
        .models
        .iter()
        .position(|m| std::ptr::eq(m, model))
        .ok_or_else(Refusal::model_not_found)?;
    Ok((Target::Path(model_idx), operation))
}

/// 503: the one base URL without the headers held for the body.
pub fn body_routing_unavailable() -> Refusal {
    Refusal::new(
        Deny::BodyRoutingUnavailable,
        "this gateway cannot route by the body's model now (request headers are not held for \
         the body); call the model's own URL (<model path>/v1/...) instead",
    )
}

/// 404: the one base URL and no `model` in the body.
fn no_model_named() -> Refusal {
    Refusal::new(
        Deny::ModelNotFound,
        "the request names no model: set the body's \"model\" to an id of GET /v1/models",
    )
}

/// The one base URL, its body read: the model the body's `model` names (by name or alias) and
/// the operation it serves at `rest` (its allow-list). A body that is not JSON of the API's
/// shape is 400 `invalid_body`; no `model`, or one no model answers to, 404 `model_not_found`;
/// an operation the model does not serve 404 `operation_not_allowed`. Whether the caller may
/// use it is [`authorize`]'s.
pub fn route_body(
    policy: &PolicyDocument,
    body: &Result<RequestInfo, BodyError>,
    rest: &str,
) -> Result<(usize, Operation), Refusal> {
    let info = body.as_ref().map_err(Refusal::invalid_body)?;
    let id = info.model.as_deref().ok_or_else(no_model_named)?;
    let (idx, model) = policy.model_by_id(id).ok_or_else(|| unknown_model(id))?;
    // The one base URL serves only POST operations.
    let operation = operations::allowed_rest(model, "POST", rest)?;
    Ok((idx, operation))
}

/// 404 for an id no model answers to (OpenAI's words).
fn unknown_model(id: &str) -> Refusal {
    Refusal::new(
        Deny::ModelNotFound,
        format!("the model {id:?} does not exist or you do not have access to it"),
    )
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

/// A scope the request counts in besides its own counters ([`maas_types::Scope`]): its limits
/// as a tier and whose counters they are.
#[derive(Debug)]
pub struct ScopeRun {
    pub tier: Tier,
    pub counter_subject: String,
    pub counter_key: String,
}

/// The scopes of a request, and what admission reserved in each (settled with the request's
/// own reservation).
#[derive(Debug, Default)]
pub struct Scopes {
    pub runs: Vec<ScopeRun>,
    pub reserved: Vec<limits::Reservation>,
}

/// Who the caller is for the limits, once authorised.
#[derive(Debug)]
pub struct Authorized {
    pub subject: Rc<str>,
    /// Under a subscription its limits replace the tiers'.
    pub subscription: Option<Box<SubscriptionRun>>,
    /// The tier the request runs on and the subject's highest (one budget per person), as
    /// indices in the policy decided with; none under a subscription.
    pub tier_idx: Option<u32>,
    pub highest_tier_idx: Option<u32>,
    /// The counter slot, hashed once for the whole request.
    pub counter_key: SlotKey,
    /// The endpoints Envoy was told to try (`x-maas-endpoints`), for a model with a cooldown.
    /// A thin box: every request carries the field, few use it.
    pub tried_order: Option<Box<TriedOrder>>,
    /// The policy's scopes the request counts in too (none for most requests: no allocation).
    pub scopes: Option<Box<Scopes>>,
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
            None => policy.tiers.get(usize::try_from(self.tier_idx?).ok()?),
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
                    if let Some(t) = usize::try_from(i).ok().and_then(|i| policy.tiers.get(i)) {
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
    /// The API key's id when the credential is one (a key's subscription binds; a client
    /// header does not; a scope `per: key` counts per key).
    pub key_id: Option<&'a str>,
    /// `X-MaaS-Subscription` as sent (the last non-empty value).
    pub requested_subscription: Option<&'a str>,
    /// The client's header names (what to strip is decided on every spelling).
    pub header_names: &'a [&'h str],
    /// The subject's counter key from the worker's copy of the credential, when it had one.
    pub counter_key: Option<Rc<str>>,
    /// The request's clock (unix s): a provider access token past its expiry is never sent.
    pub now_s: u64,
    /// The body, read before authorisation (the one base URL), asked for a stream.
    pub stream: bool,
}

/// When the upstream check reads the cluster Envoy routed the request to.
#[derive(Clone, Copy)]
pub enum Upstream<'a> {
    /// Now: the route the request arrived on is the one that serves it (a path prefix). Reads
    /// Envoy's cluster name (only when the model names one).
    Now(&'a dyn Fn() -> Option<String>),
    /// The one base URL: Envoy chooses the route once the plan's [`ROUTING_HEADER`] is set and
    /// the request goes on; the filter sees that route's cluster only at the response, where the
    /// shell checks with [`check_routed`].
    AfterRouting,
}

/// The caller is known: subscription or tier (403s), the provider credential (503 when it is
/// not there yet), the upstream check (503 `upstream_mismatch`: a route the gateway did not
/// create never gets the provider key; see [`Upstream`]) and the header plan — at the one base
/// URL with the routing header naming the model. `backend`: the routed backend drawn for the
/// request ([`draw_backend`]), which then serves as the model's provider would, routed by the
/// routing headers.
pub fn authorize<'h>(
    s: &Snapshot<'_>,
    (model_idx, backend): (usize, Option<u16>),
    intent: BodyIntent,
    op: OperationTraits,
    caller: Caller<'_, 'h>,
    upstream: Upstream<'_>,
) -> Result<(Authorized, HeaderPlan<'h>), Refusal> {
    let policy = s.policy.ok_or_else(Refusal::no_policy)?;
    let model = policy
        .models
        .get(model_idx)
        .ok_or_else(Refusal::model_not_found)?;
    let identity = caller.identity;
    let selected = decide::subscription(
        policy,
        identity,
        caller.key_id.is_some(),
        caller.requested_subscription,
        model,
    )?;
    let subscription = match selected {
        Some(sub) => Some(Box::new(SubscriptionRun {
            name: sub.name.clone(),
            tier: sub.limits_tier(&model.name).ok_or_else(|| {
                Refusal::new(Deny::ModelNotInSubscription, "model not in subscription")
            })?,
            counter_subject: Rc::from(sub.counter_subject_of(&identity.subject, &model.name)),
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
            let index_of = |tier: &Tier| {
                policy
                    .tiers
                    .iter()
                    .position(|t| std::ptr::eq(t, tier))
                    .and_then(|i| u32::try_from(i).ok())
            };
            (index_of(tier), index_of(highest))
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
    let (model, backend_name) = served_as(s, (model_idx, backend), model, op, caller.now_s)?;
    let provider_key = provider_key(s.credentials, model, caller.now_s)?;
    let backend_order = backend_order(model, s.credentials, s.cooled, caller.now_s, draw)?;
    let tried_order = tried_order(model, backend_order.as_deref());
    crate::provider::every_backend_serves(model, op.operation)?;
    let upstream_path = upstream_path_of(model, op.operation, caller.stream)?;
    let routing = match upstream {
        // A drawn backend's route, or a rewritten path that matches no route of the model's
        // prefix: the routing headers have Envoy route it to its cluster (as at the one base
        // URL), checked at the response.
        Upstream::Now(_) if backend.is_some() => Some(model.name.as_str()),
        Upstream::Now(cluster) => {
            operations::check_upstream(model, cluster)?;
            upstream_path.is_some().then_some(model.name.as_str())
        }
        Upstream::AfterRouting => Some(model.name.as_str()),
    };
    let plan = header_plan(
        s.cfg,
        caller.header_names,
        PlanSets {
            provider_key,
            backend_order,
            upstream_path,
            subscription: subscription.as_deref().map(|sub| sub.name.as_str()),
            routing,
            backend: backend_name,
            unframe_body: matches!(intent, BodyIntent::Read { hold: false, .. }) && !op.discovery,
        },
    );
    Ok((
        Authorized {
            subject: caller.subject,
            subscription,
            tier_idx,
            highest_tier_idx,
            counter_key,
            tried_order,
            scopes: scopes(
                policy,
                model,
                selected,
                ScopeCaller {
                    subject: &identity.subject,
                    key_id: caller.key_id,
                    key_scope: identity.key_scope.as_deref(),
                },
                s.cfg.limits.counter_slots,
            ),
        },
        plan,
    ))
}

/// The model as the routed backend drawn for the request serves it (the backend's provider,
/// served name and cluster), and that backend's name; the model itself when it routes none.
/// None drawn for a model that routes backends (none could serve when the model became
/// known): refused, never sent as the model.
fn served_as<'p>(
    s: &Snapshot<'p>,
    (model_idx, backend): (usize, Option<u16>),
    model: &'p Model,
    op: OperationTraits,
    now_s: u64,
) -> Result<(&'p Model, Option<&'p str>), Refusal> {
    let policy = s.policy.ok_or_else(Refusal::no_policy)?;
    let Some(j) = backend else {
        if model.routes_backends() {
            return Err(
                draw_backend(policy, model_idx, s.credentials, op.operation, now_s, draw)
                    .err()
                    .unwrap_or_else(|| {
                        Refusal::new(
                            Deny::ProviderCredentialMissing,
                            format!(
                                "no backend of model {} could serve yet; retry shortly",
                                model.name
                            ),
                        )
                    }),
            );
        }
        return Ok((model, None));
    };
    let name = model.backends.get(usize::from(j)).map(|b| b.name.as_str());
    let variant = policy
        .backend_variant(model_idx, usize::from(j))
        .ok_or_else(Refusal::model_not_found)?;
    Ok((variant, name))
}

/// The provider's own path for the request, when its provider has one.
fn upstream_path_of(
    model: &Model,
    operation: Operation,
    stream: bool,
) -> Result<Option<String>, Refusal> {
    crate::provider::upstream_path(
        model.provider.as_ref(),
        model.served_name.as_deref().unwrap_or(&model.name),
        operation,
        stream,
    )
}

/// A model with routed backends (`maas_types::policy::Backend::upstream_cluster`): the backend
/// drawn for a request by weight among those that can serve it now — its credential loaded (an
/// access token not expired, a signing key for the day) and the operation on its provider's
/// path — as its index among the model's backends. Drawn once the model is known, before the
/// body is rewritten for it. `Ok(None)`: the model routes none. None can serve: the first
/// one's reason (503 `provider_credential_missing`, or the operation not served). No failover:
/// the reference's weighted random choice, made before anything is sent.
pub fn draw_backend(
    policy: &PolicyDocument,
    model_idx: usize,
    credentials: &CredentialsDocument,
    operation: Operation,
    now_s: u64,
    draw: impl FnOnce() -> u64,
) -> Result<Option<u16>, Refusal> {
    let Some(model) = policy.models.get(model_idx).filter(|m| m.routes_backends()) else {
        return Ok(None);
    };
    let serves = |v: &Model| {
        provider_key(credentials, v, now_s)?;
        crate::provider::has_path_for(v.provider.as_ref(), operation)
    };
    // (index, weight) of those that can serve; the first failure's reason.
    let mut usable: SmallVec<[(u16, u32); 4]> = SmallVec::new();
    let mut first_refusal = None;
    for (j, b) in model.backends.iter().enumerate() {
        let (Some(variant), Ok(j)) = (policy.backend_variant(model_idx, j), u16::try_from(j))
        else {
            continue;
        };
        if b.weight == 0 {
            continue;
        }
        match serves(variant) {
            Ok(()) => usable.push((j, b.weight)),
            Err(r) => {
                first_refusal.get_or_insert(r);
            }
        }
    }
    let total: u64 = usable.iter().map(|(_, w)| u64::from(*w)).sum();
    if total == 0 {
        return Err(first_refusal.unwrap_or_else(Refusal::model_not_found));
    }
    let mut at = draw() % total;
    for (j, w) in &usable {
        let w = u64::from(*w);
        if at < w {
            return Ok(Some(*j));
        }
        at -= w;
    }
    Err(Refusal::undecidable())
}

/// Who a request's scope counters are for: the subject, its API key and that key's own limits.
struct ScopeCaller<'a> {
    subject: &'a str,
    key_id: Option<&'a str>,
    key_scope: Option<&'a maas_types::Scope>,
}

/// The scopes a request for `model` under `subscription` counts in (the policy's, then the
/// API key's own limits), with their counters; none (no allocation) when it counts in none.
fn scopes(
    policy: &PolicyDocument,
    model: &Model,
    subscription: Option<&maas_types::Subscription>,
    caller: ScopeCaller<'_>,
    slots: u64,
) -> Option<Box<Scopes>> {
    // A key's own limits need its key id (its counter is per key); a token has neither.
    let key_scope = caller.key_scope.filter(|_| caller.key_id.is_some());
    if policy.scopes.is_empty() && key_scope.is_none() {
        return None;
    }
    let runs: Vec<ScopeRun> = policy
        .scopes_for(&model.name, subscription)
        .chain(key_scope)
        .map(|scope| {
            let counter_subject = scope.counter_subject(caller.subject, caller.key_id);
            ScopeRun {
                tier: scope.limits_tier(),
                counter_key: limits::counter_key(&counter_subject, slots),
                counter_subject,
            }
        })
        .collect();
    (!runs.is_empty()).then(|| {
        Box::new(Scopes {
            runs,
            reserved: Vec::new(),
        })
    })
}

/// The one base URL, at the response: the upstream check against the cluster that answered
/// (`cluster`; see [`Upstream`]). A mismatch: the answer is not passed on.
pub fn check_routed(
    model: &Model,
    cluster: impl FnOnce() -> Option<String>,
) -> Result<(), Refusal> {
    operations::check_upstream(model, cluster).map_err(|_| {
        Refusal::new(
            Deny::UpstreamMismatch,
            format!(
                "the gateway routed this request away from model {}'s upstream; its answer \
                 was not passed on",
                model.name
            ),
        )
    })
}

/// The model's provider credential, when it has a provider: not an access token past its
/// expiry (the companion replaces tokens long before; one still expired means the companion
/// could not, and the provider would refuse it anyway).
fn provider_key<'c, 'm>(
    credentials: &'c CredentialsDocument,
    model: &'m Model,
    now_s: u64,
) -> Result<Option<(&'m maas_types::Provider, &'c str)>, Refusal> {
    let Some(p) = &model.provider else {
        return Ok(None);
    };
    if p.auth == maas_types::ProviderAuth::AwsSigV4 {
        // Signed once the body is final; refused now when no key could sign it.
        return signing_key(credentials, model, now_s).map(|_| Some((p, "")));
    }
    match provider_secret(credentials, p, || now_s) {
        Ok(k) => Ok(Some((p, k))),
        Err(SecretMissing::Expired) => Err(Refusal::new(
            Deny::ProviderCredentialMissing,
            format!(
                "the provider access token for model {} has expired and no new one is loaded yet; retry shortly",
                model.name
            ),
        )),
        Err(SecretMissing::None) => Err(Refusal::new(
            Deny::ProviderCredentialMissing,
            format!("no credential for model {} yet; retry shortly", model.name),
        )),
    }
}

/// The downstream side, for a model whose backends have providers: the endpoints Envoy should
/// try, in order, as [`maas_types::BACKEND_ORDER_HEADER`]'s value — the backends with traffic
/// whose credential is loaded (or that need none), the first picked by weight with `draw`, the
/// others after it in the policy's order. So a backend without its credential is not chosen
/// while another can serve, and a retry goes to the next listed (Envoy's `override_host`
/// policy; checked with Envoy 1.40: the list holds for the retries although the upstream filter
/// removes the header). A backend cooling down (`crate::cooldown`) comes after every other one
/// and is drawn first only when all are cooling. `Ok(None)`: no backend has a provider (nothing
/// to steer), or none has an `http://ip:port` address the header can name (Envoy's weighted
/// round robin then chooses, as before). No backend that can serve: 503
/// `provider_credential_missing`.
pub fn backend_order(
    model: &maas_types::Model,
    credentials: &CredentialsDocument,
    cooled: &Cooled,
    now_s: u64,
    draw: impl FnOnce() -> u64,
) -> Result<Option<String>, Refusal> {
    if model.backends.iter().all(|b| b.provider.is_none()) {
        return Ok(None);
    }
    let servable = |b: &&maas_types::policy::Backend| {
        b.weight > 0
            && b.provider.as_ref().is_none_or(|p| {
                p.auth != maas_types::ProviderAuth::AwsSigV4
                    && provider_secret(credentials, p, || now_s).is_ok()
            })
    };
    if !model.backends.iter().any(|b| servable(&b)) {
        return Err(Refusal::new(
            Deny::ProviderCredentialMissing,
            format!(
                "no backend of model {} has its credential loaded yet; retry shortly",
                model.name
            ),
        ));
    }
    // (endpoint, weight, cooling)
    let usable: smallvec::SmallVec<[(&str, u32, bool); 8]> = model
        .backends
        .iter()
        .filter(servable)
        .filter_map(|b| {
            let endpoint = endpoint_of(b.backend.as_deref()?)?;
            Some((endpoint, b.weight, cooled.is_cooling(endpoint, now_s)))
        })
        .collect();
    // The first is drawn among those not cooling (all of them when every one is).
    let all_cooling = usable.iter().all(|(_, _, c)| *c);
    let drawn_from = |c: bool| all_cooling || !c;
    let total: u64 = usable
        .iter()
        .filter(|(_, _, c)| drawn_from(*c))
        .map(|(_, w, _)| u64::from(*w))
        .sum();
    if total == 0 {
        return Ok(None);
    }
    let mut at = draw() % total;
    let first = usable
        .iter()
        .position(|(_, w, c)| {
            if !drawn_from(*c) {
                return false;
            }
            let w = u64::from(*w);
            if at < w {
                true
            } else {
                at -= w;
                false
            }
        })
        .unwrap_or(0);
    let mut order = usable.get(first).map_or("", |(e, _, _)| *e).to_string();
    // Then the others not cooling, then those cooling: tried only after every other one.
    for cooling in [false, true] {
        for (i, (endpoint, _, c)) in usable.iter().enumerate() {
            if i != first && *c == cooling {
                order.push(',');
                order.push_str(endpoint);
            }
        }
    }
    Ok(Some(order))
}

/// The order kept to learn from the answer which backends failed (`crate::cooldown`), for a
/// model with a cooldown.
fn tried_order(model: &Model, order: Option<&str>) -> Option<Box<TriedOrder>> {
    let order = order?;
    Some(Box::new(TriedOrder {
        order: order.into(),
        rule: model.cooldown_rule()?,
    }))
}

/// The `x-maas-endpoints` value a request was sent with, and its model's cooldown then.
#[derive(Debug)]
pub struct TriedOrder {
    pub order: Box<str>,
    pub rule: maas_types::policy::CooldownRule,
}

/// `ip:port` of an `http(s)://ip[:port][/base]` backend URL (the address Envoy's endpoint has);
/// `None` for a host name or `simulator` (the header could not name it).
pub(crate) fn endpoint_of(url: &str) -> Option<&str> {
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))?;
    let authority = rest.split('/').next()?;
    authority
        .parse::<std::net::SocketAddr>()
        .is_ok()
        .then_some(authority)
}

/// A draw for [`backend_order`] (no host call: the standard library's per-thread random keys).
pub fn draw() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

/// Why a provider has no usable key or token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecretMissing {
    /// The companion served none (not polled yet, the Secret missing or unusable).
    None,
    /// An access token past its expiry.
    Expired,
}

/// A provider's key or current access token from the credentials document (not a SigV4
/// key: those sign, see [`signing_key`]). `now_s` is asked only for a credential with an
/// expiry.
pub fn provider_secret<'c>(
    credentials: &'c CredentialsDocument,
    p: &maas_types::Provider,
    now_s: impl FnOnce() -> u64,
) -> Result<&'c str, SecretMissing> {
    let key = credentials
        .credentials
        .get(&p.credential_ref)
        .ok_or(SecretMissing::None)?;
    // `expires_at` is the expiry rounded down to the second: a token is surely expired only
    // once the clock's second is past it.
    match credentials.expires_at.get(&p.credential_ref) {
        Some(&at) if at < now_s() => Err(SecretMissing::Expired),
        _ => Ok(key.as_str()),
    }
}

/// The SigV4 signing key of the model's provider for the day of `now_s` (`auth: awsSigV4`):
/// 503 `signing_unavailable` when the companion has served none (not polled yet, the Secret
/// missing or unusable) or it has expired. A request is never forwarded unsigned.
pub fn signing_key<'c>(
    credentials: &'c CredentialsDocument,
    model: &Model,
    now_s: u64,
) -> Result<&'c maas_types::SigV4Key, Refusal> {
    model
        .provider
        .as_ref()
        .and_then(|p| {
            let keys = credentials.sigv4.get(&p.credential_ref)?;
            crate::sigv4::key_for(keys, p.region.as_deref()?, now_s)
        })
        .ok_or_else(|| {
            Refusal::new(
                Deny::SigningUnavailable,
                format!(
                    "the gateway has no valid AWS signing key for model {} yet; retry shortly",
                    model.name
                ),
            )
        })
}

/// What a [`HeaderPlan`] sets besides hygiene.
struct PlanSets<'a> {
    provider_key: Option<(&'a maas_types::Provider, &'a str)>,
    /// The endpoints Envoy tries, for a model whose backends have providers.
    backend_order: Option<String>,
    /// The provider's own path for the request (`:path`), when it has one.
    upstream_path: Option<String>,
    /// The subscription the gateway selected.
    subscription: Option<&'a str>,
    /// The model's name, for [`ROUTING_HEADER`] (the one base URL).
    routing: Option<&'a str>,
    /// The routed backend drawn, for [`maas_types::BACKEND_ROUTING_HEADER`].
    backend: Option<&'a str>,
    /// The body may be rewritten after the headers left: no `content-length`.
    unframe_body: bool,
}

/// Hygiene: nothing the client sent reaches the backend as identity; usage asked uncompressed;
/// the provider credential; the subscription the gateway selected (as the reference's gateway
/// injects it), never the client's value; at the one base URL the routing header (the client's
/// own is removed with the reserved namespace); a body that may be rewritten after the headers
/// left is framed by the upstream codec (no `content-length`).
fn header_plan<'h>(cfg: &PluginConfig, names: &[&'h str], sets: PlanSets<'_>) -> HeaderPlan<'h> {
    let PlanSets {
        provider_key,
        backend_order,
        upstream_path,
        subscription,
        routing,
        backend,
        unframe_body,
    } = sets;
    let mut plan = HeaderPlan::default();
    let mut client_anthropic_version = false;
    let signed = provider_key.is_some_and(|(p, _)| p.kind == maas_types::ProviderKind::Bedrock);
    for name in names {
        if hygiene::strip_for_model(name, &cfg.remove_headers)
            || (signed && hygiene::is_aws_signing_header(name))
            || provider_key.is_some_and(|(p, _)| hygiene::strip_for_provider(name, p))
        {
            plan.remove.push(name);
        } else if name.eq_ignore_ascii_case("anthropic-version") {
            client_anthropic_version = true;
        }
    }
    // Usage is read from the response body: ask the backend for it uncompressed (Envoy may
    // compress towards the client). A backend that compresses anyway is decoded for reading.
    plan.set
        .push(("accept-encoding", Some(Cow::Borrowed("identity"))));
    if let Some((provider, key)) = provider_key {
        for (name, value) in hygiene::provider_headers(provider, key, client_anthropic_version) {
            plan.set.push((name, Some(Cow::Owned(value))));
        }
        if let Some(name) = hygiene::provider_removes(provider) {
            plan.set.push((name, None));
        }
    }
    if let Some(order) = backend_order {
        plan.set
            .push((maas_types::BACKEND_ORDER_HEADER, Some(Cow::Owned(order))));
    }
    if let Some(path) = upstream_path {
        plan.set.push((":path", Some(Cow::Owned(path))));
    }
    if let Some(name) = subscription {
        plan.set
            .push((SUBSCRIPTION_HEADER, Some(Cow::Owned(name.to_string()))));
    }
    if let Some(model) = routing {
        plan.set
            .push((ROUTING_HEADER, Some(Cow::Owned(model.to_string()))));
    }
    if let Some(name) = backend {
        plan.set.push((
            maas_types::BACKEND_ROUTING_HEADER,
            Some(Cow::Owned(name.to_string())),
        ));
    }
    if unframe_body {
        plan.set.push(("content-length", None));
    }
    plan
}

/// The name to give the body's `model` before it is forwarded: the model's `servedName`, when
/// the body names the model by another id (the backend knows only its own name). `None`: the
/// body is forwarded as sent (no `servedName`, the served name sent, or no `model` at all).
pub fn served_name<'m>(model: &'m Model, body: &Result<RequestInfo, BodyError>) -> Option<&'m str> {
    let served = model.served_name.as_deref()?;
    let sent = body.as_ref().ok()?.model.as_deref()?;
    (sent != served).then_some(served)
}

/// `GET /v1/models` (`id` none) or `GET /v1/models/{id}` at the one base URL, the caller known:
/// the OpenAI list of the models the caller may call — each model [`authorize`] would admit it
/// on (its tier's, its subscriptions'; one held by several of a token's subscriptions too,
/// usable with `X-MaaS-Subscription`) — ids as the body names them; or the one model `id`
/// names (by name or alias; 404 `model_not_found` when it is not among them). An API key whose
/// subscription is gone, or a subscription named that is not the caller's, is refused as the
/// model requests are (403).
pub fn catalog(
    policy: &PolicyDocument,
    identity: &CachedIdentity,
    api_key: bool,
    requested: Option<&str>,
    id: Option<&str>,
) -> Result<Vec<u8>, Refusal> {
    let (user, groups) = (identity.subject.as_str(), identity.groups.as_slice());
    if let Some(bound) = identity.subscription.as_deref() {
        maas_types::subscription::select(policy, user, groups, Some(bound), None).map_err(
            |_| {
                Refusal::new(
                    Deny::InvalidSubscription,
                    "the subscription of this API key no longer exists or no longer includes you",
                )
            },
        )?;
    } else if let Some(name) = requested.filter(|_| !api_key && !policy.subscriptions.is_empty()) {
        maas_types::subscription::select(policy, user, groups, Some(name), None)
            .map_err(|e| Refusal::new(Deny::from(e), e.message()))?;
    }
    let usable = |m: &Model| match decide::subscription(policy, identity, api_key, requested, m) {
        Ok(Some(_)) => true,
        Ok(None) => decide::authorize(policy, identity, m).is_ok(),
        Err(r) => r.deny == Deny::MultipleSubscriptions,
    };
    let entry = |m: &Model| {
        let mut entry = serde_json::json!({
            "id": m.name,
            "object": "model",
            "created": 0,
            "owned_by": m.owned_by.as_deref().unwrap_or("maas"),
        });
        // The model's own URL (its path prefix at the gateway), as the reference's `/v1/models`
        // gives it: its inference guide calls `.data[].url + "/v1/chat/completions"`.
        if let (Some(base), Some(fields)) = (&policy.public_url, entry.as_object_mut()) {
            fields.insert("url".into(), format!("{base}{}", m.path).into());
        }
        entry
    };
    let value = match id {
        None => serde_json::json!({
            "object": "list",
            "data": policy.models.iter().filter(|m| usable(m)).map(entry).collect::<Vec<_>>(),
        }),
        Some(id) => match policy.model_by_id(id) {
            Some((_, m)) if usable(m) => entry(m),
            _ => return Err(unknown_model(id)),
        },
    };
    serde_json::to_vec(&value).map_err(|e| Refusal::internal(e.to_string()))
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
    /// The prices money budgets charge (a subscription's override, else the model's); none:
    /// the request costs nothing.
    pub pricing: Option<maas_types::Pricing>,
}

impl Metering {
    /// What the limits reserve (weighted).
    pub fn reserve(&self) -> u64 {
        self.reserved.weighted(self.weights)
    }

    /// What money budgets reserve (nano-units): the prompt estimate at the input price and the
    /// whole completion budget at the output price.
    pub fn reserve_cost(&self) -> u64 {
        self.pricing
            .map_or(0, |p| p.reserve(self.reserved.input, self.reserved.output))
    }

    /// What `settled` raw tokens (of which `cached` input tokens from the prompt cache) cost.
    pub fn cost(&self, settled: decide::Tokens, cached: u64) -> u64 {
        self.pricing
            .map_or(0, |p| p.charge(settled.input, cached, settled.output))
    }
}

/// What the request's operation means for its body.
#[allow(clippy::struct_excessive_bools)] // independent facts of one operation
#[derive(Debug, Clone, Copy)]
pub struct OperationTraits {
    /// The operation itself (the provider's path for it).
    pub operation: Operation,
    /// Model discovery: authenticated, never counted.
    pub discovery: bool,
    /// Generates nothing (Anthropic `count_tokens`): a request, no tokens.
    pub unmetered: bool,
    /// The body field that caps the output (`Operation::cap_field`).
    pub cap_field: Option<&'static str>,
    /// The body may carry `stream_options` (OpenAI chat/completions and completions).
    pub accepts_stream_options: bool,
    /// OpenAI chat to a model whose backend speaks Anthropic Messages: the request and its
    /// answer are translated ([`crate::translate`]).
    pub translate: bool,
    /// OpenAI chat to an AWS Bedrock model: translated to Converse and signed with SigV4 once
    /// the body is final ([`crate::translate::converse`], [`crate::sigv4`]).
    pub converse: bool,
    /// OpenAI chat to Gemini on Vertex AI: translated to `generateContent` once the body is
    /// final ([`crate::translate::gemini`]).
    pub gemini: bool,
}

impl OperationTraits {
    pub fn of(operation: Operation, model: &Model) -> Self {
        let translate = crate::operations::translates(operation, model);
        let converse = crate::operations::converses(operation, model);
        let gemini = crate::operations::generates_content(operation, model);
        OperationTraits {
            operation,
            discovery: operation.is_discovery(),
            unmetered: operation.is_unmetered(),
            // Translated: the Messages body's own cap, which Anthropic requires.
            cap_field: if translate {
                Operation::Messages.cap_field(None)
            } else {
                operation.cap_field(model.provider.as_ref().map(|p| p.kind))
            },
            // Anthropic refuses `stream_options`; its streams carry their usage anyway (as
            // Bedrock's and Gemini's do).
            accepts_stream_options: operation.accepts_stream_options()
                && !translate
                && !converse
                && !gemini,
            translate,
            converse,
            gemini,
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
    body: Option<&Result<RequestInfo, BodyError>>,
    op: OperationTraits,
) -> Result<Option<Metering>, Refusal> {
    match body {
        Some(Ok(info)) => decide::check_body_model(info, model)?,
        Some(Err(e)) if !op.discovery => {
            return Err(Refusal::invalid_body(e));
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
    // A tool the provider runs has no bound before the answer: refused unless the model
    // settles such requests.
    if let Some(tool) = info.and_then(RequestInfo::hosted_tool)
        && model.hosted_tools == maas_types::policy::HostedTools::Refuse
    {
        return Err(Refusal::hosted_tool(tool, &model.name));
    }
    // Context the provider holds can only be reserved up to the model's context window.
    let costs = decide::PromptCosts::of(model);
    if let Some(field) = info.and_then(RequestInfo::stored_context)
        && costs.context_window.is_none()
    {
        return Err(Refusal::prompt_not_reservable(field, &model.name));
    }
    // A subscription's (or the tier's) prices replace the model's: the first tier counted
    // that names some.
    let pricing = windows
        .iter()
        .find_map(|t| t.pricing_of(&model.name))
        .or(model.pricing);
    Ok(Some(Metering {
        prompt_tokens_estimate: info.map_or(0, |i| decide::prompt_estimate(i, costs)),
        reserved: decide::reservation(info, tier, costs),
        weights,
        // Translated requests always get a cap (Bedrock's answer is then bounded by the
        // reservation too).
        cap: info.and_then(|i| {
            decide::injected_cap(
                i,
                op.cap_field,
                tier,
                op.translate || op.converse || op.gemini,
            )
        }),
        pricing,
    }))
}

#[cfg(test)]
mod tests;
