//! The reference's resources (group `maas.opendatahub.io/v1alpha1`) translated into our
//! [`PolicyDocument`]: a pure function over plain data, so every rule is unit-tested here.
//!
//! - `MaaSModelRef` (any namespace) → a model named after the MaaSModelRef, `ownedBy`
//!   `<namespace>/<name>`, path `/<namespace>/<spec.modelRef.name>` (KServe's and the reference's
//!   HTTPRoute prefix), `backend` = `status.endpoint` when set. Kind `ExternalModel`: the
//!   ExternalModel of that name in the same namespace gives `provider` (`type` = `spec.provider`,
//!   `credentialRef` = `<its namespace>/<spec.credentialRef.name>`: a Secret of its own
//!   namespace only) and `upstreamCluster`
//!   `outbound|<port>||<spec.endpoint>` (Istio's ServiceEntry cluster; port from the annotation
//!   `maas.opendatahub.io/port`, default 443). An `inference.opendatahub.io` ExternalModel of
//!   that name is read first: one served provider binding gives the model's `provider`, several
//!   give routed backends, one per binding ([`inference_external`], [`model_of`]).
//! - `MaaSAuthPolicy` (policy namespace) = **access**: who may use which models.
//! - `MaaSSubscription` (policy namespace) = **quota**: a subscription (owner, priority,
//!   per-model `tokenRateLimits`, `billingRate`, `tokenMetadata`; display name and description
//!   from the `openshift.io/display-name` / `openshift.io/description` annotations).
//!
//! How access and quota combine (as the reference: a request needs both a MaaSAuthPolicy that
//! admits the caller on the model and a subscription of the caller holding the model):
//! a subscription keeps a model only when the MaaSAuthPolicies naming that model admit **every**
//! owner of the subscription (the same group or user, or the group `system:authenticated`);
//! otherwise the model is left out of that subscription (a note is logged), since our document
//! cannot express "owner AND subject" for a subset of owners — refusing is the safe side.
//! Tiers of the base document are given a resource model the same way: a tier is listed in
//! `models[].tiers` only when the model's MaaSAuthPolicies admit all the tier's groups. A model
//! that no tier may use gets [`SUBSCRIPTION_ONLY_TIER`], a tier with no members, so it is
//! reachable through subscriptions only (the reference's behaviour: no subscription, no access).
//!
//! Invalid resources (a field that does not translate, or a document the shared validation
//! refuses once the resource is added) are left out and returned in [`Translation::invalid`]
//! with the field named; every other resource still applies.

use kube::api::DynamicObject;
use maas_types::policy::{
    ApiFamily, Backend, Limit, Model, ModelDetails, Provider, ProviderAuth, ProviderKind, Tier,
    VertexPublisher,
};
use maas_types::subscription::{
    BillingRate, Owner, Subscription, SubscriptionModel, TokenMetadata,
};
use maas_types::{PolicyDocument, PolicyError, Window};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};

/// The tier given to resource models that no tier of the base document may use: no member
/// can have its group, so such a model is reachable through subscriptions only.
pub const SUBSCRIPTION_ONLY_TIER: &str = "subscription-only";
/// The group of [`SUBSCRIPTION_ONLY_TIER`].
pub const SUBSCRIPTION_ONLY_GROUP: &str = "maas.opendatahub.io/subscription-only";
/// The group every authenticated subject has: a MaaSAuthPolicy naming it admits everyone.
pub const ALL_AUTHENTICATED: &str = "system:authenticated";

pub const KIND_MODEL_REF: &str = "MaaSModelRef";
pub const KIND_EXTERNAL_MODEL: &str = "ExternalModel";
pub const KIND_EXTERNAL_PROVIDER: &str = "ExternalProvider";
pub const KIND_AUTH_POLICY: &str = "MaaSAuthPolicy";
pub const KIND_SUBSCRIPTION: &str = "MaaSSubscription";
/// A MaaSSubscription annotated `"true"` shares its limits and budgets among all its users
/// (the policy's `subscriptions[].pool`).
pub const POOL_ANNOTATION: &str = "maas-gateway.io/pool";

/// The resources as listed (any order; translated sorted by namespace and name).
#[derive(Debug, Clone, Default)]
pub struct Resources {
    pub model_refs: Vec<DynamicObject>,
    /// `maas.opendatahub.io` ExternalModels (the older shape: `provider`, `endpoint`,
    /// `targetModel`, `credentialRef`).
    pub external_models: Vec<DynamicObject>,
    /// `inference.opendatahub.io` ExternalModels (v0.2.1: `modelName`, `externalProviderRefs`);
    /// a MaaSModelRef's ExternalModel is looked up here first, as the reference does.
    pub inference_models: Vec<DynamicObject>,
    /// `inference.opendatahub.io` ExternalProviders (`provider`, `endpoint`, `auth`).
    pub external_providers: Vec<DynamicObject>,
    pub auth_policies: Vec<DynamicObject>,
    pub subscriptions: Vec<DynamicObject>,
}

/// A resource left out: which, the field at fault (`spec.modelRefs[0].tokenRateLimits[0].window`)
/// and why.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Invalid {
    pub kind: &'static str,
    /// The resource's group when the object carried its `apiVersion` (ExternalModel is a kind
    /// of two groups).
    pub group: Option<Group>,
    pub namespace: String,
    pub name: String,
    pub field: String,
    pub message: String,
}

/// The API group of a resource: `maas.opendatahub.io` or `inference.opendatahub.io`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Group {
    Maas,
    Inference,
}

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}/{}: {}: {}",
            self.kind, self.namespace, self.name, self.field, self.message
        )
    }
}

#[derive(Debug, Clone)]
pub struct Translation {
    /// Valid (the shared validation passed).
    pub document: PolicyDocument,
    pub invalid: Vec<Invalid>,
    /// Valid but with a part left out (a model reference that resolves to nothing, a model the
    /// access policies do not open to every owner): logged, not reported as invalid.
    pub notes: Vec<String>,
}

fn ns_name(o: &DynamicObject) -> (String, String) {
    (
        o.metadata.namespace.clone().unwrap_or_default(),
        o.metadata.name.clone().unwrap_or_default(),
    )
}

fn sorted(list: &[DynamicObject]) -> Vec<&DynamicObject> {
    let mut v: Vec<&DynamicObject> = list.iter().collect();
    v.sort_by_key(|o| ns_name(o));
    v
}

fn annotation<'a>(o: &'a DynamicObject, key: &str) -> Option<&'a str> {
    o.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
        .filter(|s| !s.trim().is_empty())
}

fn bad(
    kind: &'static str,
    o: &DynamicObject,
    field: impl Into<String>,
    message: impl Into<String>,
) -> Invalid {
    let (namespace, name) = ns_name(o);
    Invalid {
        kind,
        group: o.types.as_ref().map(|t| {
            if t.api_version.starts_with("inference.opendatahub.io/") {
                Group::Inference
            } else {
                Group::Maas
            }
        }),
        namespace,
        name,
        field: field.into(),
        message: message.into(),
    }
}

fn str_at<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str).filter(|s| !s.is_empty())
}

/// `groups: [{name}]`, `users: [string]` (owner of a subscription, subjects of a policy).
fn subjects(v: &Value, at: &str) -> Result<Owner, (String, String)> {
    let mut owner = Owner::default();
    if let Some(groups) = v.get("groups").filter(|g| !g.is_null()) {
        let list = groups
            .as_array()
            .ok_or_else(|| (format!("{at}.groups"), "must be a list".to_string()))?;
        for (i, g) in list.iter().enumerate() {
            let name = str_at(g, "name").ok_or_else(|| {
                (
                    format!("{at}.groups[{i}].name"),
                    "required: a group name".to_string(),
                )
            })?;
            owner.groups.push(name.to_string());
        }
    }
    if let Some(users) = v.get("users").filter(|u| !u.is_null()) {
        let list = users
            .as_array()
            .ok_or_else(|| (format!("{at}.users"), "must be a list".to_string()))?;
        for (i, u) in list.iter().enumerate() {
            let name = u.as_str().filter(|s| !s.is_empty()).ok_or_else(|| {
                (
                    format!("{at}.users[{i}]"),
                    "must be a non-empty user name".to_string(),
                )
            })?;
            owner.users.push(name.to_string());
        }
    }
    if owner.groups.is_empty() && owner.users.is_empty() {
        return Err((
            at.to_string(),
            "at least one group or user must be specified".to_string(),
        ));
    }
    Ok(owner)
}

/// The union of the MaaSAuthPolicies naming one model.
#[derive(Debug, Default, Clone)]
struct Access {
    groups: BTreeSet<String>,
    users: BTreeSet<String>,
}

impl Access {
    fn everyone(&self) -> bool {
        self.groups.contains(ALL_AUTHENTICATED)
    }
    /// Every member of every listed group, and every listed user, is admitted.
    fn admits_all(&self, groups: &[String], users: &[String]) -> bool {
        self.everyone()
            || (groups.iter().all(|g| self.groups.contains(g))
                && users.iter().all(|u| self.users.contains(u)))
    }
}

/// `(namespace, name)` of each model a policy admits, with the subjects; invalid policies out.
fn access_map(
    policies: &[DynamicObject],
    invalid: &mut Vec<Invalid>,
) -> BTreeMap<(String, String), Access> {
    let mut map: BTreeMap<(String, String), Access> = BTreeMap::new();
    for p in sorted(policies) {
        let spec = p.data.get("spec").cloned().unwrap_or(Value::Null);
        let parsed = (|| {
            let refs = spec
                .get("modelRefs")
                .and_then(Value::as_array)
                .filter(|r| !r.is_empty())
                .ok_or_else(|| {
                    (
                        "spec.modelRefs".to_string(),
                        "at least one model reference {name, namespace} is required".to_string(),
                    )
                })?;
            let mut models = Vec::new();
            for (i, r) in refs.iter().enumerate() {
                let name = str_at(r, "name").ok_or_else(|| {
                    (
                        format!("spec.modelRefs[{i}].name"),
                        "required: the MaaSModelRef name".to_string(),
                    )
                })?;
                let namespace = str_at(r, "namespace").ok_or_else(|| {
                    (
                        format!("spec.modelRefs[{i}].namespace"),
                        "required: the MaaSModelRef namespace".to_string(),
                    )
                })?;
                models.push((namespace.to_string(), name.to_string()));
            }
            let who = subjects(
                spec.get("subjects").unwrap_or(&Value::Null),
                "spec.subjects",
            )?;
            Ok::<_, (String, String)>((models, who))
        })();
        match parsed {
            Ok((models, who)) => {
                for m in models {
                    let a = map.entry(m).or_default();
                    a.groups.extend(who.groups.iter().cloned());
                    a.users.extend(who.users.iter().cloned());
                }
            }
            Err((field, message)) => invalid.push(bad(KIND_AUTH_POLICY, p, field, message)),
        }
    }
    map
}

fn provider_kind(s: &str) -> Option<ProviderKind> {
    match s {
        "openai" => Some(ProviderKind::Openai),
        "anthropic" => Some(ProviderKind::Anthropic),
        "azure-openai" => Some(ProviderKind::AzureOpenai),
        "vertex" => Some(ProviderKind::Vertex),
        "bedrock" => Some(ProviderKind::Bedrock),
        _ => None,
    }
}

/// A Kubernetes object name (a DNS-1123 subdomain, as a Secret's): lower-case letters, digits,
/// `-` and `.`, at most 253, starting and ending with a letter or digit.
fn is_object_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 253
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-' || *c == b'.')
        && b.first().is_some_and(u8::is_ascii_alphanumeric)
        && b.last().is_some_and(u8::is_ascii_alphanumeric)
}

/// The provider key Secret of an ExternalModel, as the policy's `credentialRef`:
/// `<its namespace>/<spec.credentialRef.name>`. An ExternalModel may use only Secrets of its
/// own namespace (a tenant's model must not borrow the platform's key): a
/// `credentialRef.namespace` naming another namespace, or a name that is not a Secret name
/// (`other-ns/key`), is invalid and resolves nothing.
fn external_model_secret(ext: &DynamicObject, spec: &Value) -> Result<String, Invalid> {
    let (namespace, _) = ns_name(ext);
    let reference = spec.get("credentialRef");
    let name = reference.and_then(|c| str_at(c, "name")).ok_or_else(|| {
        bad(
            KIND_EXTERNAL_MODEL,
            ext,
            "spec.credentialRef.name",
            "required",
        )
    })?;
    if let Some(other) = reference.and_then(|c| c.get("namespace"))
        && other.as_str() != Some(namespace.as_str())
    {
        return Err(bad(
            KIND_EXTERNAL_MODEL,
            ext,
            "spec.credentialRef.namespace",
            format!(
                "{other}: a Secret of another namespace cannot be used: only Secrets in the ExternalModel's namespace ({namespace})"
            ),
        ));
    }
    if !is_object_name(name) {
        return Err(bad(
            KIND_EXTERNAL_MODEL,
            ext,
            "spec.credentialRef.name",
            format!(
                "{name:?} is not a Secret name: the Secret must be in the ExternalModel's namespace ({namespace}), named without a namespace"
            ),
        ));
    }
    Ok(format!("{namespace}/{name}"))
}

/// The ExternalModel a MaaSModelRef names: its provider (kind and credential), the Envoy
/// cluster of its endpoint, and the endpoint.
fn external_model(
    r: &DynamicObject,
    externals: &BTreeMap<(String, String), &DynamicObject>,
    target_ns: &str,
    target: &str,
) -> Result<(Provider, String, String), Invalid> {
    let ext = externals
        .get(&(target_ns.to_string(), target.to_string()))
        .ok_or_else(|| {
            bad(
                KIND_MODEL_REF,
                r,
                "spec.modelRef.name",
                format!("no ExternalModel {target_ns}/{target}"),
            )
        })?;
    let es = ext.data.get("spec").cloned().unwrap_or(Value::Null);
    let provider = str_at(&es, "provider")
        .ok_or_else(|| bad(KIND_EXTERNAL_MODEL, ext, "spec.provider", "required"))?;
    let kind = provider_kind(provider).ok_or_else(|| {
        bad(
            KIND_EXTERNAL_MODEL,
            ext,
            "spec.provider",
            format!("{provider:?} is not supported (openai, anthropic, azure-openai, vertex)"),
        )
    })?;
    let endpoint = str_at(&es, "endpoint")
        .ok_or_else(|| bad(KIND_EXTERNAL_MODEL, ext, "spec.endpoint", "required"))?;
    let credential = external_model_secret(ext, &es)?;
    let port = match annotation(ext, "maas.opendatahub.io/port") {
        None => 443,
        Some(p) => p
            .trim()
            .parse::<u16>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| {
                bad(
                    KIND_EXTERNAL_MODEL,
                    ext,
                    "metadata.annotations[maas.opendatahub.io/port]",
                    "must be a port number",
                )
            })?,
    };
    let provider = Provider::api_key(kind, credential);
    Ok((
        provider,
        format!("outbound|{port}||{endpoint}"),
        endpoint.to_string(),
    ))
}

/// `modelDetails` from a MaaSModelRef's annotations (the reference's keys); `None` when none.
fn details_of(r: &DynamicObject) -> Option<ModelDetails> {
    let text = |k| annotation(r, k).map(str::to_string);
    let d = ModelDetails {
        display_name: text("openshift.io/display-name"),
        description: text("openshift.io/description"),
        genai_use_case: text("opendatahub.io/genai-use-case"),
        context_window: text("opendatahub.io/context-window").map(|w| w.trim().to_string()),
        // A JSON list of strings, as the reference reads it; anything else is left out.
        capabilities: annotation(r, "opendatahub.io/model-capabilities")
            .and_then(|c| serde_json::from_str::<Vec<String>>(c).ok())
            .unwrap_or_default(),
    };
    (!d.is_empty()).then_some(d)
}

/// The model id KServe gives an LLMInferenceService (`status.resolvedModelAlias`, mirrored by
/// the reference's controller: `publishers/<ns>/models/<spec.model.name>`), and the name the
/// server serves (`<spec.model.name>`, what vLLM expects in the body).
fn resolved_alias(r: &DynamicObject) -> Option<(String, Option<String>)> {
    let alias = r
        .data
        .get("status")
        .and_then(|s| str_at(s, "resolvedModelAlias"))?;
    let served = alias
        .strip_prefix("publishers/")
        .and_then(|rest| rest.split_once("/models/"))
        .map(|(_, served)| served.to_string())
        .filter(|s| !s.is_empty());
    Some((alias.to_string(), served))
}

/// A provider binding's `weight` (the reference's default 1; 0: no traffic).
fn binding_weight(binding: &Value) -> u64 {
    binding.get("weight").and_then(Value::as_u64).unwrap_or(1)
}

/// The indices in `spec.externalProviderRefs` of the bindings an ExternalModel's traffic goes
/// to: those with a weight above 0 whose `apiFormat` is the first such binding's (the others
/// are left out: every backend of a model speaks the model's API). For a valid ExternalModel
/// these are its model's backends, in order ([`inference_external`]).
pub(crate) fn served_bindings(refs: &[Value]) -> Vec<usize> {
    let weighted = || {
        refs.iter()
            .enumerate()
            .filter(|(_, r)| binding_weight(r) > 0)
    };
    let Some((_, first)) = weighted().next() else {
        return Vec::new();
    };
    let format = str_at(first, "apiFormat");
    weighted()
        .filter(|(_, r)| str_at(r, "apiFormat") == format)
        .map(|(i, _)| i)
        .collect()
}

/// The Secret of a binding's credential (the binding's `auth`, else its provider's) and how it
/// is used: `apikey` and `simple` a static key; `oauth2` the provider's cloud credential
/// (vertex: a Google service account, azure-openai: Entra client credentials), exchanged by
/// the companion for access tokens; `sigv4` for bedrock (an AWS access key the companion derives
/// daily SigV4 signing keys from).
fn binding_secret(
    em: &DynamicObject,
    provider: &DynamicObject,
    binding: &Value,
    at: &str,
    kind: ProviderKind,
) -> Result<(String, ProviderAuth), Invalid> {
    let ps = provider.data.get("spec").cloned().unwrap_or(Value::Null);
    // The binding's auth overrides the provider's.
    let (auth, auth_at, auth_of) = match binding.get("auth").filter(|a| !a.is_null()) {
        Some(a) => (a.clone(), format!("{at}.auth"), em),
        None => (
            ps.get("auth").cloned().unwrap_or(Value::Null),
            "spec.auth".to_string(),
            provider,
        ),
    };
    let auth_kind = if std::ptr::eq(auth_of, em) {
        KIND_EXTERNAL_MODEL
    } else {
        KIND_EXTERNAL_PROVIDER
    };
    let provider_auth = match (str_at(&auth, "type"), kind) {
        (Some("apikey" | "simple"), _) => ProviderAuth::ApiKey,
        (Some("oauth2"), ProviderKind::Vertex) => ProviderAuth::GcpServiceAccount,
        (Some("oauth2"), ProviderKind::AzureOpenai) => ProviderAuth::AzureClientCredentials,
        (Some("sigv4"), ProviderKind::Bedrock) => ProviderAuth::AwsSigV4,
        (Some(other), _) => {
            return Err(bad(
                auth_kind,
                auth_of,
                format!("{auth_at}.type"),
                format!(
                    "{other:?} is not supported for provider {}: apikey and simple (a static key) are served, oauth2 for vertex (a service-account key) and azure-openai (Entra client credentials), and sigv4 for bedrock (an AWS access key); the model is not served",
                    kind.as_str()
                ),
            ));
        }
        (None, _) => {
            return Err(bad(
                auth_kind,
                auth_of,
                format!("{auth_at}.type"),
                "required",
            ));
        }
    };
    let secret = auth
        .get("secretRef")
        .and_then(|r| str_at(r, "name"))
        .filter(|n| is_object_name(n))
        .ok_or_else(|| {
            bad(
                auth_kind,
                auth_of,
                format!("{auth_at}.secretRef.name"),
                "required: a Secret name (the Secret is in the provider's namespace)",
            )
        })?;
    Ok((secret.to_string(), provider_auth))
}

/// The provider's path fields from its `config` (the reference's example: Vertex
/// `{"project": …, "location": …}`; Azure OpenAI `deployment`, `apiVersion`): the binding's
/// `config` (`at`: where the binding is) overrides the ExternalProvider's key by key, as the
/// CRD says. Checked with the policy, where a bad value names `provider.…`.
fn provider_config(
    em: &DynamicObject,
    source: &DynamicObject,
    ps: &Value,
    binding: &Value,
    at: &str,
    provider: &mut Provider,
) -> Result<(), Invalid> {
    let of_binding = |k: &str| binding.get("config").and_then(|c| str_at(c, k));
    let of_provider = |k: &str| ps.get("config").and_then(|c| str_at(c, k));
    // The first of `keys` the binding sets, else the first the provider sets.
    let get = |keys: &[&str]| {
        keys.iter()
            .find_map(|k| of_binding(k))
            .or_else(|| keys.iter().find_map(|k| of_provider(k)))
            .map(str::to_string)
    };
    match provider.kind {
        ProviderKind::AzureOpenai => {
            provider.deployment = get(&["deployment"]);
            provider.api_version = get(&["apiVersion", "api-version"]);
        }
        ProviderKind::Vertex => {
            provider.project = get(&["project"]);
            provider.location = get(&["location"]);
            // Not in the reference's examples: a model of a publisher in its own API
            // (`google`: Gemini's generateContent, `anthropic`: Claude's rawPredict).
            provider.publisher = match get(&["publisher"]).as_deref() {
                None => None,
                Some("google") => Some(VertexPublisher::Google),
                Some("anthropic") => Some(VertexPublisher::Anthropic),
                Some(other) => {
                    let why = format!("{other:?} is not supported (google or anthropic)");
                    return Err(if of_binding("publisher").is_some() {
                        bad(
                            KIND_EXTERNAL_MODEL,
                            em,
                            format!("{at}.config.publisher"),
                            why,
                        )
                    } else {
                        bad(KIND_EXTERNAL_PROVIDER, source, "spec.config.publisher", why)
                    });
                }
            };
        }
        ProviderKind::Bedrock => provider.region = get(&["region"]),
        ProviderKind::Openai | ProviderKind::Anthropic => {}
    }
    Ok(())
}

/// One provider binding of an `inference.opendatahub.io` ExternalModel, as served.
struct InferenceBinding {
    /// Its index in `spec.externalProviderRefs`.
    index: usize,
    /// `ref.name`: the ExternalProvider's name.
    provider_name: String,
    provider: Provider,
    upstream_cluster: String,
    endpoint: String,
    /// `targetModel`: what the provider expects in the body.
    served_name: String,
    /// `apiFormat`.
    api: ApiFamily,
    weight: u32,
}

/// What an `inference.opendatahub.io` ExternalModel gives its MaaSModelRef's model.
struct InferenceExternal {
    /// The bindings served ([`served_bindings`]): at least one, all speaking the first's API.
    bindings: Vec<InferenceBinding>,
    /// `spec.modelName`, else the ExternalModel's name: what clients send.
    client_name: String,
}

/// `apiFormat` as the model's API family.
fn api_format(format: &str) -> Option<ApiFamily> {
    match format {
        "openai-chat" => Some(ApiFamily::Openai),
        "messages" => Some(ApiFamily::Anthropic),
        _ => None,
    }
}

/// An `inference.opendatahub.io` ExternalModel and its ExternalProviders (same namespace).
/// Every binding with a weight above 0 is read (any invalid one makes the ExternalModel
/// invalid); those whose `apiFormat` differs from the first's are left out with a note, and
/// the rest are served: one as the model's provider, several as routed backends the filter
/// draws from by weight (see [`model_of`]). `auth.type` `apikey` and `simple` are served (the
/// Secret's `api-key`, of the provider's namespace), `oauth2` for vertex and azure-openai,
/// `sigv4` for bedrock (see [`binding_secret`]).
fn inference_external(
    em: &DynamicObject,
    providers: &BTreeMap<(String, String), &DynamicObject>,
    notes: &mut Vec<String>,
) -> Result<InferenceExternal, Invalid> {
    let (namespace, name) = ns_name(em);
    let spec = em.data.get("spec").cloned().unwrap_or(Value::Null);
    let refs = spec
        .get("externalProviderRefs")
        .and_then(Value::as_array)
        .filter(|r| !r.is_empty())
        .ok_or_else(|| {
            bad(
                KIND_EXTERNAL_MODEL,
                em,
                "spec.externalProviderRefs",
                "at least one provider binding is required",
            )
        })?;
    let mut weighted = Vec::new();
    for (i, binding) in refs.iter().enumerate() {
        if binding_weight(binding) > 0 {
            weighted.push(inference_binding(em, providers, i, binding)?);
        }
    }
    let Some(first) = weighted.first() else {
        return Err(bad(
            KIND_EXTERNAL_MODEL,
            em,
            "spec.externalProviderRefs",
            "every binding has weight 0: no traffic may go anywhere",
        ));
    };
    let (api, first_at) = (first.api, first.index);
    let format_of = |i: usize| str_at(&refs[i], "apiFormat").unwrap_or("");
    let mut bindings = Vec::new();
    for b in weighted {
        if b.api == api {
            bindings.push(b);
        } else {
            notes.push(format!(
                "ExternalModel {namespace}/{name}: spec.externalProviderRefs[{}] left out: its apiFormat {} is not the model's {} (spec.externalProviderRefs[{first_at}], the first with a weight): every provider binding of a model serves the same API",
                b.index,
                format_of(b.index),
                format_of(first_at),
            ));
        }
    }
    Ok(InferenceExternal {
        bindings,
        client_name: str_at(&spec, "modelName").unwrap_or(&name).to_string(),
    })
}

/// Binding `i` of an ExternalModel: its ExternalProvider (same namespace), credential,
/// `config`, `apiFormat`, `targetModel` and weight.
fn inference_binding(
    em: &DynamicObject,
    providers: &BTreeMap<(String, String), &DynamicObject>,
    i: usize,
    binding: &Value,
) -> Result<InferenceBinding, Invalid> {
    let (namespace, _) = ns_name(em);
    let at = format!("spec.externalProviderRefs[{i}]");
    let provider_name = binding
        .get("ref")
        .and_then(|r| str_at(r, "name"))
        .ok_or_else(|| {
            bad(
                KIND_EXTERNAL_MODEL,
                em,
                format!("{at}.ref.name"),
                "required",
            )
        })?;
    let provider = providers
        .get(&(namespace.clone(), provider_name.to_string()))
        .ok_or_else(|| {
            bad(
                KIND_EXTERNAL_MODEL,
                em,
                format!("{at}.ref.name"),
                format!("no ExternalProvider {namespace}/{provider_name}"),
            )
        })?;
    let ps = provider.data.get("spec").cloned().unwrap_or(Value::Null);
    let kind_name = str_at(&ps, "provider").ok_or_else(|| {
        bad(
            KIND_EXTERNAL_PROVIDER,
            provider,
            "spec.provider",
            "required",
        )
    })?;
    let kind = provider_kind(kind_name).ok_or_else(|| {
        bad(
            KIND_EXTERNAL_PROVIDER,
            provider,
            "spec.provider",
            format!("{kind_name:?} is not supported (openai, anthropic, azure-openai, vertex)"),
        )
    })?;
    let endpoint = str_at(&ps, "endpoint").ok_or_else(|| {
        bad(
            KIND_EXTERNAL_PROVIDER,
            provider,
            "spec.endpoint",
            "required",
        )
    })?;
    let (secret, auth) = binding_secret(em, provider, binding, &at, kind)?;
    let format = str_at(binding, "apiFormat");
    let api = format.and_then(api_format).ok_or_else(|| {
        let why = format.map_or("required".to_string(), |f| {
            format!("{f:?} is not supported: openai-chat or messages")
        });
        bad(KIND_EXTERNAL_MODEL, em, format!("{at}.apiFormat"), why)
    })?;
    let target = str_at(binding, "targetModel").ok_or_else(|| {
        bad(
            KIND_EXTERNAL_MODEL,
            em,
            format!("{at}.targetModel"),
            "required",
        )
    })?;
    let weight = u32::try_from(binding_weight(binding))
        .ok()
        .filter(|w| *w <= 100)
        .ok_or_else(|| {
            bad(
                KIND_EXTERNAL_MODEL,
                em,
                format!("{at}.weight"),
                "must be 0 to 100",
            )
        })?;
    let mut p = Provider::api_key(kind, format!("{namespace}/{secret}"));
    p.auth = auth;
    provider_config(em, provider, &ps, binding, &at, &mut p)?;
    p.path = binding_path(&ps, binding, api, &p)
        .map_err(|why| bad(KIND_EXTERNAL_MODEL, em, format!("{at}.path"), why))?;
    Ok(InferenceBinding {
        index: i,
        provider_name: provider_name.to_string(),
        provider: p,
        upstream_cluster: format!("outbound|443||{endpoint}"),
        endpoint: endpoint.to_string(),
        served_name: target.to_string(),
        api,
        weight,
    })
}

/// A binding's `path` (the reference sets the outgoing `:path` to it), its `{key}` placeholders
/// resolved from the config (the binding's keys over the ExternalProvider's), as the provider's
/// chat path ([`Provider::path`]). `None` for the API's own path (`/v1/chat/completions`,
/// `/v1/messages`: the path as sent reaches it) and for bedrock or a vertex publisher, whose
/// paths the gateway signs or chooses by stream; a provider with a path scheme of its own
/// (an Azure deployment, a Vertex project) keeps it when the binding names only the API's
/// path. An unknown placeholder, or braces that do not pair: the reason.
fn binding_path(
    ps: &Value,
    binding: &Value,
    api: ApiFamily,
    p: &Provider,
) -> Result<Option<String>, String> {
    let Some(template) = str_at(binding, "path") else {
        return Ok(None);
    };
    let config = |k: &str| {
        binding
            .get("config")
            .and_then(|c| str_at(c, k))
            .or_else(|| ps.get("config").and_then(|c| str_at(c, k)))
    };
    let mut path = String::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let (before, after) = rest.split_at(open);
        let close = after
            .find('}')
            .ok_or_else(|| format!("{template:?}: a '{{' without its '}}'"))?;
        let key = after.get(1..close).unwrap_or_default();
        let value = config(key).ok_or_else(|| {
            format!("{template:?}: no config key {key:?} (the binding's config or its ExternalProvider's)")
        })?;
        path.push_str(before);
        path.push_str(value);
        rest = after.get(close + 1..).unwrap_or_default();
    }
    if rest.contains('}') {
        return Err(format!("{template:?}: a '}}' without its '{{'"));
    }
    path.push_str(rest);
    let own = match api {
        ApiFamily::Openai => "/v1/chat/completions",
        ApiFamily::Anthropic => "/v1/messages",
    };
    let signed_or_streamed = p.kind == ProviderKind::Bedrock || p.publisher.is_some();
    Ok((path != own && !signed_or_streamed).then_some(path))
}

/// The longest backend name ([`Backend::name`]).
const BACKEND_NAME_MAX: usize = 63;

/// Each served binding's backend name: its ExternalProvider's name when no other served
/// binding names that provider and it fits; else `<name>-<index in externalProviderRefs>`
/// (the name cut to fit), with `-<n>` added in the unlikely case that is taken too.
fn backend_names(bindings: &[InferenceBinding]) -> Vec<String> {
    let shared = |b: &InferenceBinding| {
        bindings
            .iter()
            .filter(|o| o.provider_name == b.provider_name)
            .count()
            > 1
    };
    let own = |b: &InferenceBinding| !shared(b) && b.provider_name.len() <= BACKEND_NAME_MAX;
    let mut taken: BTreeSet<String> = bindings
        .iter()
        .filter(|b| own(b))
        .map(|b| b.provider_name.clone())
        .collect();
    bindings
        .iter()
        .map(|b| {
            if own(b) {
                return b.provider_name.clone();
            }
            let cut = |suffix: &str| {
                let keep = BACKEND_NAME_MAX.saturating_sub(suffix.len());
                let mut base = b.provider_name.get(..keep).unwrap_or(&b.provider_name);
                base = base.trim_end_matches(['-', '.']);
                format!("{base}{suffix}")
            };
            let mut name = cut(&format!("-{}", b.index));
            let mut n = 1;
            while !taken.insert(name.clone()) {
                name = cut(&format!("-{}-{n}", b.index));
                n += 1;
            }
            name
        })
        .collect()
}

/// Objects by `(namespace, name)`.
fn by_name(list: &[DynamicObject]) -> BTreeMap<(String, String), &DynamicObject> {
    list.iter().map(|e| (ns_name(e), e)).collect()
}

/// The ExternalModels and ExternalProviders by `(namespace, name)`.
struct Externals<'a> {
    legacy: BTreeMap<(String, String), &'a DynamicObject>,
    inference: BTreeMap<(String, String), &'a DynamicObject>,
    providers: BTreeMap<(String, String), &'a DynamicObject>,
}

/// A MaaSModelRef's endpoint: its status's, else `spec.endpointOverride`.
fn endpoint_of(r: &DynamicObject, spec: &Value) -> Option<String> {
    r.data
        .get("status")
        .and_then(|s| str_at(s, "endpoint"))
        .or_else(|| str_at(spec, "endpointOverride"))
        .map(str::to_string)
}

/// Another id clients may send, when it differs from the model's name.
fn add_alias(model: &mut Model, id: &str) {
    if id != model.name && !model.aliases.iter().any(|a| a == id) {
        model.aliases.push(id.to_string());
    }
}

/// `model` served by an `inference.opendatahub.io` ExternalModel: its one served binding as
/// the model's provider, or several as routed backends. Returns each backend's index in
/// `spec.externalProviderRefs` (none for one binding).
fn serve_inference_external(model: &mut Model, ext: InferenceExternal) -> Vec<usize> {
    add_alias(model, &ext.client_name);
    // Every served binding speaks the first's API; set, so each backend is checked in it.
    model.api = ext.bindings.first().map(|b| b.api);
    if let [one] = ext.bindings.as_slice() {
        model.provider = Some(one.provider.clone());
        model.upstream_cluster = Some(one.upstream_cluster.clone());
        if model.backend.is_none() {
            model.backend = Some(format!("https://{}", one.endpoint));
        }
        model.served_name = Some(one.served_name.clone());
        return Vec::new();
    }
    // Routed backends: the filter draws one per request by weight, and Envoy routes it to
    // that binding's provider (the reference's weighted random selection across its provider
    // refs). A model with backends has no `backend` of its own.
    model.backend = None;
    let indices = ext.bindings.iter().map(|b| b.index).collect();
    model.backends = backend_names(&ext.bindings)
        .into_iter()
        .zip(ext.bindings)
        .map(|(name, b)| Backend {
            name,
            backend: Some(format!("https://{}", b.endpoint)),
            provider: Some(b.provider),
            served_name: Some(b.served_name),
            weight: b.weight,
            timeout: None,
            upstream_cluster: Some(b.upstream_cluster),
        })
        .collect();
    indices
}

/// One MaaSModelRef as a model (tiers filled in by the caller), with the index in the
/// ExternalModel's `spec.externalProviderRefs` of each of its backends (routed backends; else
/// none).
fn model_of(
    r: &DynamicObject,
    externals: &Externals<'_>,
    notes: &mut Vec<String>,
) -> Result<(Model, Vec<usize>), Invalid> {
    let (namespace, name) = ns_name(r);
    let spec = r.data.get("spec").cloned().unwrap_or(Value::Null);
    let model_ref = spec.get("modelRef").cloned().unwrap_or(Value::Null);
    let kind = str_at(&model_ref, "kind").ok_or_else(|| {
        bad(
            KIND_MODEL_REF,
            r,
            "spec.modelRef.kind",
            "required: LLMInferenceService or ExternalModel",
        )
    })?;
    let target = str_at(&model_ref, "name")
        .ok_or_else(|| bad(KIND_MODEL_REF, r, "spec.modelRef.name", "required"))?;
    // The reference's older samples name the model's namespace here; the current shape has the
    // MaaSModelRef in the model's namespace.
    let target_ns = str_at(&model_ref, "namespace").unwrap_or(&namespace);
    if kind == "ExternalModel" && target_ns != namespace {
        // An ExternalModel carries its namespace's provider key: a MaaSModelRef elsewhere
        // would serve that key to models it names.
        return Err(bad(
            KIND_MODEL_REF,
            r,
            "spec.modelRef.namespace",
            format!(
                "an ExternalModel of another namespace ({target_ns}) cannot be used: only one in the MaaSModelRef's own namespace ({namespace})"
            ),
        ));
    }
    let mut model = Model {
        name: name.clone(),
        aliases: Vec::new(),
        served_name: None,
        details: details_of(r),
        path: format!("/{target_ns}/{target}"),
        tiers: Vec::new(),
        backend: endpoint_of(r, &spec),
        backends: Vec::new(),
        cooldown: None,
        owned_by: Some(format!("{namespace}/{name}")),
        provider: None,
        api: None,
        operations: None,
        upstream_cluster: None,
        pricing: None,
        media_tokens: None,
        hosted_tools: maas_types::policy::HostedTools::default(),
    };
    let mut bindings = Vec::new();
    match kind {
        "LLMInferenceService" => {
            if let Some((id, served)) = resolved_alias(r) {
                add_alias(&mut model, &id);
                model.served_name = served;
            }
        }
        "ExternalModel" => {
            let key = (target_ns.to_string(), target.to_string());
            if let Some(em) = externals.inference.get(&key) {
                let ext = inference_external(em, &externals.providers, notes)?;
                bindings = serve_inference_external(&mut model, ext);
            } else {
                let (provider, upstream_cluster, endpoint) =
                    external_model(r, &externals.legacy, target_ns, target)?;
                model.provider = Some(provider);
                model.upstream_cluster = Some(upstream_cluster);
                if model.backend.is_none() {
                    model.backend = Some(format!("https://{endpoint}"));
                }
                // The reference lists the ExternalModel's name as the id; the provider gets
                // its targetModel.
                add_alias(&mut model, target);
                let target_model = externals
                    .legacy
                    .get(&key)
                    .and_then(|e| e.data.get("spec"))
                    .and_then(|s| str_at(s, "targetModel"));
                // Needed only when a client's id may differ from it.
                model.served_name = target_model
                    .filter(|t| *t != model.name || !model.aliases.is_empty())
                    .map(str::to_string);
            }
        }
        other => {
            return Err(bad(
                KIND_MODEL_REF,
                r,
                "spec.modelRef.kind",
                format!("{other:?} is not supported: LLMInferenceService or ExternalModel"),
            ));
        }
    }
    Ok((model, bindings))
}

/// A model-level validation error's field, on the resource (`bindings`: the
/// `spec.externalProviderRefs` index of each of the model's backends).
fn model_field(e: &PolicyError, bindings: &[usize]) -> String {
    let rest = e.path.split_once("].").map(|(_, r)| r).unwrap_or("");
    if let Some((j, _)) = rest
        .strip_prefix("backends[")
        .and_then(|b| b.split_once(']'))
    {
        return match j.parse::<usize>().ok().and_then(|j| bindings.get(j)) {
            Some(i) => format!("spec.externalProviderRefs[{i}] (ExternalModel)"),
            None => "spec.externalProviderRefs (ExternalModel)".into(),
        };
    }
    match rest.split('.').next().unwrap_or("") {
        "backends" => "spec.externalProviderRefs (ExternalModel)".into(),
        "name" | "path" => "metadata.name".into(),
        "aliases" => "status.resolvedModelAlias (or the ExternalModel's modelName)".into(),
        "servedName" => "the served model name (targetModel, or status.resolvedModelAlias)".into(),
        "details" => "metadata.annotations".into(),
        "provider" => "spec.credentialRef.name (ExternalModel)".into(),
        "upstreamCluster" => "spec.endpoint (ExternalModel)".into(),
        _ => "spec".into(),
    }
}

/// A subscription-level validation error's field, on the resource (`index` maps our model
/// positions back to `spec.modelRefs`).
fn subscription_field(e: &PolicyError, index: &[usize]) -> String {
    let rest = e.path.split_once("].").map(|(_, r)| r).unwrap_or("");
    if let Some((i, tail)) = rest.strip_prefix("models[").and_then(|m| m.split_once(']')) {
        let orig = i
            .parse::<usize>()
            .ok()
            .and_then(|i| index.get(i).copied())
            .map(|i| i.to_string())
            .unwrap_or_else(|| i.to_string());
        return format!("spec.modelRefs[{orig}]{tail}");
    }
    match rest {
        "name" => "metadata.name".into(),
        "namespace" => "metadata.namespace".into(),
        "displayName" => "metadata.annotations[openshift.io/display-name]".into(),
        "description" => "metadata.annotations[openshift.io/description]".into(),
        r if r.starts_with("owner.groups[") => format!("spec.{r}.name"),
        "" => "spec".into(),
        r => format!("spec.{r}"),
    }
}

fn limits(v: Option<&Value>, at: &str) -> Result<Vec<Limit>, (String, String)> {
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(v) => v
            .as_array()
            .ok_or_else(|| (at.to_string(), "must be a list".to_string()))?,
    };
    let mut out = Vec::new();
    for (i, l) in list.iter().enumerate() {
        let limit = l.get("limit").and_then(Value::as_u64).ok_or_else(|| {
            (
                format!("{at}[{i}].limit"),
                "must be a positive integer".to_string(),
            )
        })?;
        let window = l
            .get("window")
            .and_then(Value::as_str)
            .ok_or_else(|| (format!("{at}[{i}].window"), "required, e.g. 1m".to_string()))?;
        let window = Window::parse(window).map_err(|e| (format!("{at}[{i}].window"), e))?;
        out.push(Limit {
            limit,
            window,
            shadow: false,
        });
    }
    Ok(out)
}

/// A subscription's model reference as written.
struct ModelRef<'a> {
    /// The MaaSModelRef's name and namespace.
    name: &'a str,
    namespace: &'a str,
    /// At least one.
    token_rate_limits: Vec<Limit>,
    billing_rate: Option<BillingRate>,
}

/// Reads a subscription's model reference (`at`: where it is, for errors).
fn model_ref<'a>(r: &'a Value, at: &str) -> Result<ModelRef<'a>, (String, String)> {
    let mname = str_at(r, "name").ok_or_else(|| {
        (
            format!("{at}.name"),
            "required: the MaaSModelRef name".to_string(),
        )
    })?;
    let mns = str_at(r, "namespace").ok_or_else(|| {
        (
            format!("{at}.namespace"),
            "required: the MaaSModelRef namespace".to_string(),
        )
    })?;
    let token_rate_limits = limits(r.get("tokenRateLimits"), &format!("{at}.tokenRateLimits"))?;
    if token_rate_limits.is_empty() {
        return Err((
            format!("{at}.tokenRateLimits"),
            "at least one token limit is required".to_string(),
        ));
    }
    let billing_rate = match r.get("billingRate") {
        None | Some(Value::Null) => None,
        Some(b) => Some(BillingRate {
            per_token: str_at(b, "perToken")
                .ok_or_else(|| {
                    (
                        format!("{at}.billingRate.perToken"),
                        "required: a decimal string".to_string(),
                    )
                })?
                .to_string(),
        }),
    };
    Ok(ModelRef {
        name: mname,
        namespace: mns,
        token_rate_limits,
        billing_rate,
    })
}

/// One MaaSSubscription, its models resolved and filtered by access; the second value maps
/// each kept model to its index in `spec.modelRefs`.
fn subscription_of(
    s: &DynamicObject,
    doc: &PolicyDocument,
    access: &BTreeMap<(String, String), Access>,
    notes: &mut Vec<String>,
) -> Result<(Subscription, Vec<usize>), (String, String)> {
    let (namespace, name) = ns_name(s);
    let spec = s.data.get("spec").cloned().unwrap_or(Value::Null);
    let owner = subjects(spec.get("owner").unwrap_or(&Value::Null), "spec.owner")?;
    let priority = match spec.get("priority") {
        None | Some(Value::Null) => 0,
        Some(p) => p
            .as_i64()
            .and_then(|p| i32::try_from(p).ok())
            .ok_or_else(|| {
                (
                    "spec.priority".to_string(),
                    "must be a 32-bit integer".to_string(),
                )
            })?,
    };
    let refs = spec
        .get("modelRefs")
        .and_then(Value::as_array)
        .filter(|r| !r.is_empty())
        .ok_or_else(|| {
            (
                "spec.modelRefs".to_string(),
                "at least one model reference is required".to_string(),
            )
        })?;
    let mut models = Vec::new();
    let mut index = Vec::new();
    for (i, r) in refs.iter().enumerate() {
        let at = format!("spec.modelRefs[{i}]");
        let ModelRef {
            name: mname,
            namespace: mns,
            token_rate_limits,
            billing_rate,
        } = model_ref(r, &at)?;
        let owned = format!("{mns}/{mname}");
        if !doc
            .models
            .iter()
            .any(|m| m.name == mname && m.owned_by.as_deref() == Some(owned.as_str()))
        {
            notes.push(format!(
                "MaaSSubscription {namespace}/{name}: {at} names MaaSModelRef {owned}, which is not in the policy: left out"
            ));
            continue;
        }
        let admitted = access
            .get(&(mns.to_string(), mname.to_string()))
            .is_some_and(|a| a.admits_all(&owner.groups, &owner.users));
        if !admitted {
            notes.push(format!(
                "MaaSSubscription {namespace}/{name}: model {owned} left out: no MaaSAuthPolicy admits every owner of the subscription"
            ));
            continue;
        }
        models.push(SubscriptionModel {
            name: mname.to_string(),
            token_rate_limits,
            request_rate_limits: Vec::new(),
            billing_rate,
            token_weights: Default::default(),
            budgets: Vec::new(),
            pricing: None,
        });
        index.push(i);
    }
    let meta = spec.get("tokenMetadata").cloned().unwrap_or(Value::Null);
    let mut labels = BTreeMap::new();
    if let Some(l) = meta.get("labels").and_then(Value::as_object) {
        for (k, v) in l {
            let v = v.as_str().ok_or_else(|| {
                (
                    format!("spec.tokenMetadata.labels.{k}"),
                    "must be a string".to_string(),
                )
            })?;
            labels.insert(k.clone(), v.to_string());
        }
    }
    Ok((
        Subscription {
            name,
            namespace: Some(namespace),
            display_name: annotation(s, "openshift.io/display-name").map(str::to_string),
            description: annotation(s, "openshift.io/description").map(str::to_string),
            priority,
            owner,
            models,
            token_metadata: TokenMetadata {
                organization_id: str_at(&meta, "organizationId").map(str::to_string),
                cost_center: str_at(&meta, "costCenter").map(str::to_string),
                labels,
            },
            default_max_tokens: None,
            uncapped_requests: Default::default(),
            warn_at: maas_types::policy::default_warn_at(),
            // Ours: the reference's CRD has no pool; an annotation opts a subscription in.
            pool: annotation(s, POOL_ANNOTATION) == Some("true"),
        },
        index,
    ))
}

/// Base document (tiers, defaults, models and subscriptions of the file, if any) plus the
/// resources. `base` must be valid; `None` = no file (no tiers: subscriptions only).
pub fn translate(base: Option<&PolicyDocument>, res: &Resources) -> Translation {
    let mut invalid = Vec::new();
    let mut notes = Vec::new();
    let mut doc = base.cloned().unwrap_or(PolicyDocument {
        tiers: Vec::new(),
        models: Vec::new(),
        subscriptions: Vec::new(),
        revoked_key_ids: Vec::new(),
        public_url: None,
        rate_limit_headers: Default::default(),
        observability: Default::default(),
        scopes: Vec::new(),
        backend_variants: Vec::new(),
    });
    let only_tier = Tier {
        name: SUBSCRIPTION_ONLY_TIER.into(),
        display_name: Some("Subscriptions only".into()),
        description: Some(
            "Models opened by MaaSAuthPolicies to no tier: reachable through subscriptions only"
                .into(),
        ),
        level: -1,
        groups: vec![SUBSCRIPTION_ONLY_GROUP.into()],
        limits: Default::default(),
        default_max_tokens: None,
        uncapped_requests: Default::default(),
        token_weights: Default::default(),
        warn_at: maas_types::policy::default_warn_at(),
        prices: Default::default(),
        pricing: None,
    };
    if doc.tiers.is_empty() {
        doc.tiers.push(only_tier.clone());
    }
    let access = access_map(&res.auth_policies, &mut invalid);
    let externals = Externals {
        legacy: by_name(&res.external_models),
        inference: by_name(&res.inference_models),
        providers: by_name(&res.external_providers),
    };

    for r in sorted(&res.model_refs) {
        let (mut model, bindings) = match model_of(r, &externals, &mut notes) {
            Ok(m) => m,
            Err(e) => {
                invalid.push(e);
                continue;
            }
        };
        let key = ns_name(r);
        let a = access.get(&key).cloned().unwrap_or_default();
        model.tiers = doc
            .tiers
            .iter()
            .filter(|t| t.name != SUBSCRIPTION_ONLY_TIER && a.admits_all(&t.groups, &[]))
            .map(|t| t.name.clone())
            .collect();
        if model.tiers.is_empty() {
            if doc.tier(SUBSCRIPTION_ONLY_TIER).is_none() {
                doc.tiers.push(only_tier.clone());
            }
            model.tiers.push(SUBSCRIPTION_ONLY_TIER.into());
        }
        doc.models.push(model);
        if let Err(e) = doc.validate() {
            doc.models.pop();
            let field = model_field(&e, &bindings);
            // The provider's fields belong to the ExternalModel; the rest to the MaaSModelRef.
            invalid.push(bad(KIND_MODEL_REF, r, field, e.to_string()));
        }
    }

    for s in sorted(&res.subscriptions) {
        match subscription_of(s, &doc, &access, &mut notes) {
            Err((field, message)) => invalid.push(bad(KIND_SUBSCRIPTION, s, field, message)),
            Ok((sub, _)) if sub.models.is_empty() => {
                let (ns, name) = ns_name(s);
                notes.push(format!(
                    "MaaSSubscription {ns}/{name}: no model left: not in the policy"
                ));
            }
            Ok((sub, index)) => {
                doc.subscriptions.push(sub);
                if let Err(e) = doc.validate() {
                    doc.subscriptions.pop();
                    invalid.push(bad(
                        KIND_SUBSCRIPTION,
                        s,
                        subscription_field(&e, &index),
                        e.message.clone(),
                    ));
                }
            }
        }
    }
    invalid.sort();
    // As reading the document builds them: each routed backend as the model it serves.
    doc.build_backend_variants();
    Translation {
        document: doc,
        invalid,
        notes,
    }
}

/// The reference's own example resources, shared by the unit tests here and the stand-in tests
/// (`tests/api/resources.rs` keeps its own copy: it cannot see this module).
#[cfg(test)]
pub(crate) mod samples {
    /// opendatahub-io/models-as-a-service `docs/samples/maas-system/free/maas/`
    /// (maas-model.yaml in the current shape — the MaaSModelRef in the model's namespace,
    /// `maasmodelref_types.go` — maas-auth-policy.yaml with the policy in the subscription
    /// namespace, maas-subscription.yaml verbatim), `docs/samples/maas-system/premium/maas/`
    /// (likewise) and `docs/content/install/external-model-setup.md` steps 4 and 5 (gpt-4o).
    pub const REFERENCE: &str = concat!(
        include_str!("../../../tests/fixtures/reference/maas-system-samples.yaml"),
        "\n---\n",
        include_str!("../../../tests/fixtures/reference/external-model-gpt-4o.yaml")
    );

    /// The YAML documents of `text` as objects.
    /// The reference's v0.2.1 samples, unchanged: `docs/samples/maas-system/{free,premium}/maas/`
    /// (copies in `tests/fixtures/reference/v0.2.1/`, each naming its source).
    pub const V0_2_1: &str = concat!(
        include_str!("../../../tests/fixtures/reference/v0.2.1/maas-system-free.yaml"),
        "\n---\n",
        include_str!("../../../tests/fixtures/reference/v0.2.1/maas-system-premium.yaml")
    );

    /// An `inference.opendatahub.io` ExternalModel + ExternalProvider written to the v0.2.1
    /// CRDs (the release has no sample of them).
    pub const V0_2_1_INFERENCE: &str =
        include_str!("../../../tests/fixtures/reference/v0.2.1/inference-external-model.yaml");

    pub fn objects(text: &str) -> Vec<kube::api::DynamicObject> {
        text.split("\n---\n")
            .filter(|d| !d.trim().is_empty())
            .map(|d| yaml_serde::from_str(d).unwrap())
            .collect()
    }

    pub fn resources(text: &str) -> super::Resources {
        let mut r = super::Resources::default();
        for o in objects(text) {
            let kind = o.types.as_ref().map(|t| t.kind.clone()).unwrap_or_default();
            let inference = o
                .types
                .as_ref()
                .is_some_and(|t| t.api_version.starts_with("inference.opendatahub.io/"));
            match kind.as_str() {
                "MaaSModelRef" => r.model_refs.push(o),
                "ExternalModel" if inference => r.inference_models.push(o),
                "ExternalProvider" => r.external_providers.push(o),
                "ExternalModel" => r.external_models.push(o),
                "MaaSAuthPolicy" => r.auth_policies.push(o),
                "MaaSSubscription" => r.subscriptions.push(o),
                other => panic!("unexpected kind {other}"),
            }
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::samples::{REFERENCE, resources};
    use super::*;

    /// What a translation found invalid: (kind, name, field).
    fn invalid_of(t: &Translation) -> Vec<(&str, &str, &str)> {
        t.invalid
            .iter()
            .map(|i| (i.kind, i.name.as_str(), i.field.as_str()))
            .collect()
    }

    fn expected_reference_document() -> PolicyDocument {
        PolicyDocument::from_json(
            serde_json::json!({
                "tiers": [{
                    "name": "subscription-only",
                    "displayName": "Subscriptions only",
                    "description": "Models opened by MaaSAuthPolicies to no tier: reachable through subscriptions only",
                    "level": -1,
                    "groups": ["maas.opendatahub.io/subscription-only"]
                }],
                "models": [
                    {"name": "facebook-opt-125m-simulated", "path": "/llm/facebook-opt-125m-simulated",
                     "tiers": ["subscription-only"], "ownedBy": "llm/facebook-opt-125m-simulated"},
                    {"name": "gpt-4o", "path": "/llm/gpt-4o", "tiers": ["subscription-only"],
                     "backend": "https://api.openai.com", "ownedBy": "llm/gpt-4o",
                     "provider": {"type": "openai", "credentialRef": "llm/openai-api-key"},
                     "upstreamCluster": "outbound|443||api.openai.com"},
                    {"name": "premium-simulated-simulated-premium", "path": "/llm/premium-simulated-simulated-premium",
                     "tiers": ["subscription-only"], "ownedBy": "llm/premium-simulated-simulated-premium"}
                ],
                "subscriptions": [
                    {"name": "gpt-4o-subscription", "namespace": "models-as-a-service", "priority": 0,
                     "owner": {"groups": ["system:authenticated"], "users": []},
                     "models": [{"name": "gpt-4o", "tokenRateLimits": [{"limit": 100000, "window": "1h"}]}]},
                    {"name": "premium-simulator-subscription", "namespace": "models-as-a-service", "priority": 0,
                     "owner": {"groups": ["premium-user"], "users": []},
                     "models": [{"name": "premium-simulated-simulated-premium", "tokenRateLimits": [{"limit": 1000, "window": "1m"}]}]},
                    {"name": "simulator-subscription", "namespace": "models-as-a-service",
                     "displayName": "Simulator Subscription (Free)",
                     "description": "Free-tier subscription with 100 tokens/min rate limit", "priority": 0,
                     "owner": {"groups": ["system:authenticated"], "users": []},
                     "models": [{"name": "facebook-opt-125m-simulated", "tokenRateLimits": [{"limit": 100, "window": "1m"}]}]}
                ]
            })
            .to_string()
            .as_bytes(),
        )
        .unwrap()
    }

    #[test]
    fn the_reference_samples_translate_into_the_expected_document() {
        let t = translate(None, &resources(REFERENCE));
        assert!(t.invalid.is_empty(), "{:?}", t.invalid);
        assert!(t.notes.is_empty(), "{:?}", t.notes);
        assert_eq!(t.document, expected_reference_document());
        // Access and quota both hold: the premium subscription's owner may use its model.
        let doc = &t.document;
        let groups = vec!["premium-user".to_string()];
        let sub = maas_types::subscription::select(
            doc,
            "someone",
            &groups,
            Some("premium-simulator-subscription"),
            Some("premium-simulated-simulated-premium"),
        )
        .unwrap();
        assert_eq!(sub.name, "premium-simulator-subscription");
        // Nobody qualifies for a tier: no subscription, no model (the reference's behaviour).
        assert!(
            doc.resolve_tier(&["system:authenticated".into()], None)
                .is_none()
        );
    }

    #[test]
    fn base_tiers_are_opened_only_where_the_auth_policies_admit_all_their_groups() {
        let base = crate::policy::parse_yaml(
            b"tiers:\n  - {name: free, level: 0, groups: [system:authenticated]}\n  - {name: premium, level: 1, groups: [premium-user]}\n",
        )
        .unwrap();
        let t = translate(Some(&base), &resources(REFERENCE));
        assert!(t.invalid.is_empty(), "{:?}", t.invalid);
        let doc = &t.document;
        // system:authenticated admits every tier.
        assert_eq!(
            doc.model("facebook-opt-125m-simulated").unwrap().tiers,
            ["free", "premium"]
        );
        // premium-user admits the premium tier only.
        assert_eq!(
            doc.model("premium-simulated-simulated-premium")
                .unwrap()
                .tiers,
            ["premium"]
        );
        // Every model has a base tier: no subscription-only tier is added.
        assert!(doc.tier(SUBSCRIPTION_ONLY_TIER).is_none());
    }

    #[test]
    fn a_subscription_keeps_only_models_whose_auth_policies_admit_every_owner() {
        // The free subscription's owner (everyone) is wider than the premium model's policy.
        let extra = r#"
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSSubscription
metadata: {name: wide, namespace: models-as-a-service}
spec:
  owner: {groups: [{name: system:authenticated}]}
  modelRefs:
    - {name: facebook-opt-125m-simulated, namespace: llm, tokenRateLimits: [{limit: 5, window: 1m}]}
    - {name: premium-simulated-simulated-premium, namespace: llm, tokenRateLimits: [{limit: 5, window: 1m}]}
    - {name: not-there, namespace: llm, tokenRateLimits: [{limit: 5, window: 1m}]}
"#;
        let t = translate(None, &resources(&format!("{REFERENCE}\n---\n{extra}")));
        let wide = t.document.subscription("wide").unwrap();
        let names: Vec<&str> = wide.models.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["facebook-opt-125m-simulated"]);
        assert_eq!(t.notes.len(), 2, "{:?}", t.notes);
        assert!(t.invalid.is_empty());
    }

    #[test]
    fn a_subscription_annotated_as_a_pool_shares_its_limits() {
        let pooled = r#"
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSSubscription
metadata:
  name: shared
  namespace: models-as-a-service
  annotations: {maas-gateway.io/pool: "true"}
spec:
  owner: {groups: [{name: system:authenticated}]}
  modelRefs:
    - {name: facebook-opt-125m-simulated, namespace: llm, tokenRateLimits: [{limit: 5, window: 1m}]}
"#;
        let t = translate(None, &resources(&format!("{REFERENCE}\n---\n{pooled}")));
        assert!(t.invalid.is_empty(), "{:?}", t.invalid);
        assert!(t.document.subscription("shared").unwrap().pool);
        assert!(
            !t.document
                .subscription("simulator-subscription")
                .unwrap()
                .pool
        );
    }

    #[test]
    fn invalid_resources_are_left_out_with_the_field_named_and_the_rest_applies() {
        let bad = r#"
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSSubscription
metadata: {name: bad-window, namespace: models-as-a-service}
spec:
  owner: {groups: [{name: system:authenticated}]}
  modelRefs:
    - {name: facebook-opt-125m-simulated, namespace: llm, tokenRateLimits: [{limit: 5, window: 1w}]}
---
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSSubscription
metadata: {name: too-much, namespace: models-as-a-service}
spec:
  owner: {groups: [{name: system:authenticated}]}
  modelRefs:
    - {name: facebook-opt-125m-simulated, namespace: llm, tokenRateLimits: [{limit: 5000000000, window: 1m}]}
---
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSAuthPolicy
metadata: {name: nobody, namespace: models-as-a-service}
spec:
  modelRefs: [{name: gpt-4o, namespace: llm}]
  subjects: {groups: [], users: []}
---
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSModelRef
metadata: {name: odd, namespace: llm}
spec:
  modelRef: {kind: InferenceService, name: odd}
---
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSModelRef
metadata: {name: bedrock, namespace: llm}
spec:
  modelRef: {kind: ExternalModel, name: bedrock}
---
apiVersion: maas.opendatahub.io/v1alpha1
kind: ExternalModel
metadata: {name: bedrock, namespace: llm}
spec: {provider: bedrock-openai, endpoint: bedrock-mantle.us-east-2.api.aws, targetModel: x, credentialRef: {name: k}}
"#;
        let t = translate(None, &resources(&format!("{REFERENCE}\n---\n{bad}")));
        let found = invalid_of(&t);
        assert_eq!(
            found,
            [
                ("ExternalModel", "bedrock", "spec.provider"),
                ("MaaSAuthPolicy", "nobody", "spec.subjects"),
                ("MaaSModelRef", "odd", "spec.modelRef.kind"),
                (
                    "MaaSSubscription",
                    "bad-window",
                    "spec.modelRefs[0].tokenRateLimits[0].window"
                ),
                (
                    "MaaSSubscription",
                    "too-much",
                    "spec.modelRefs[0].tokenRateLimits[0].limit"
                ),
            ]
        );
        // The valid resources still apply, exactly as without the invalid ones.
        assert_eq!(t.document, expected_reference_document());
    }

    #[test]
    fn an_external_model_uses_only_secrets_of_its_own_namespace() {
        // The reference's gpt-4o (namespace llm) names Secret openai-api-key: llm's.
        let t = translate(None, &resources(REFERENCE));
        let gpt = t.document.model("gpt-4o").unwrap();
        assert_eq!(
            gpt.provider.as_ref().unwrap().secret(),
            (Some("llm"), "openai-api-key")
        );
        // A tenant's ExternalModels reaching for another namespace's Secret, and a tenant's
        // MaaSModelRef reaching for another namespace's ExternalModel: invalid, left out.
        let borrowing = r#"
apiVersion: maas.opendatahub.io/v1alpha1
kind: ExternalModel
metadata: {name: by-field, namespace: tenant-b}
spec: {provider: openai, endpoint: api.openai.com, targetModel: gpt-4o, credentialRef: {name: openai-api-key, namespace: opendatahub}}
---
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSModelRef
metadata: {name: by-field, namespace: tenant-b}
spec: {modelRef: {kind: ExternalModel, name: by-field}}
---
apiVersion: maas.opendatahub.io/v1alpha1
kind: ExternalModel
metadata: {name: by-name, namespace: tenant-b}
spec: {provider: openai, endpoint: api.openai.com, targetModel: gpt-4o, credentialRef: {name: opendatahub/openai-api-key}}
---
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSModelRef
metadata: {name: by-name, namespace: tenant-b}
spec: {modelRef: {kind: ExternalModel, name: by-name}}
---
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSModelRef
metadata: {name: by-model, namespace: tenant-b}
spec: {modelRef: {kind: ExternalModel, name: gpt-4o, namespace: llm}}
---
apiVersion: maas.opendatahub.io/v1alpha1
kind: ExternalModel
metadata: {name: own, namespace: tenant-b}
spec: {provider: anthropic, endpoint: api.anthropic.com, targetModel: claude, credentialRef: {name: anthropic-key, namespace: tenant-b}}
---
apiVersion: maas.opendatahub.io/v1alpha1
kind: MaaSModelRef
metadata: {name: own, namespace: tenant-b}
spec: {modelRef: {kind: ExternalModel, name: own}}
"#;
        let t = translate(None, &resources(&format!("{REFERENCE}\n---\n{borrowing}")));
        let found = invalid_of(&t);
        assert_eq!(
            found,
            [
                ("ExternalModel", "by-field", "spec.credentialRef.namespace"),
                ("ExternalModel", "by-name", "spec.credentialRef.name"),
                ("MaaSModelRef", "by-model", "spec.modelRef.namespace"),
            ]
        );
        for left_out in ["by-field", "by-name", "by-model"] {
            assert!(t.document.model(left_out).is_none(), "{left_out}");
        }
        // Naming its own namespace is fine; every Secret named is its model's namespace's.
        let own = t.document.model("own").unwrap();
        assert_eq!(
            own.provider.as_ref().unwrap().secret(),
            (Some("tenant-b"), "anthropic-key")
        );
        for m in &t.document.models {
            if let Some(p) = &m.provider {
                let model_ns = m.owned_by.as_deref().and_then(|o| o.split('/').next());
                assert_eq!(p.secret().0, model_ns, "{}", m.name);
            }
        }
    }

    #[test]
    fn a_model_ref_clashing_with_a_base_model_path_is_left_out() {
        let base = crate::policy::parse_yaml(
            b"tiers:\n  - {name: free, level: 0, groups: [system:authenticated]}\nmodels:\n  - {name: sim, path: /llm/gpt-4o, tiers: [free]}\n",
        )
        .unwrap();
        let t = translate(Some(&base), &resources(REFERENCE));
        assert_eq!(t.invalid.len(), 1, "{:?}", t.invalid);
        assert_eq!(t.invalid[0].name, "gpt-4o");
        assert_eq!(t.invalid[0].field, "metadata.name");
        assert!(t.document.model("gpt-4o").is_none());
        assert!(t.document.subscription("gpt-4o-subscription").is_none());
        assert!(t.document.model("sim").is_some());
    }

    /// The v0.2.1 samples (`docs/samples/maas-system/{free,premium}/maas/`, unchanged): their
    /// annotations become `details`, their subscriptions keep their priorities and names.
    #[test]
    fn the_v0_2_1_samples_translate_with_details() {
        use super::samples::V0_2_1;
        let t = translate(None, &resources(V0_2_1));
        assert!(t.invalid.is_empty(), "{:?}", t.invalid);
        assert!(t.notes.is_empty(), "{:?}", t.notes);
        let doc = &t.document;
        let free = doc.model("facebook-opt-125m-simulated").unwrap();
        assert_eq!(free.path, "/llm/facebook-opt-125m-simulated");
        let d = free.details.as_ref().unwrap();
        assert_eq!(
            d.display_name.as_deref(),
            Some("Facebook OPT 125M (Simulated)")
        );
        assert_eq!(
            d.description.as_deref(),
            Some("A simulated OPT-125M model for free-tier testing")
        );
        // No status yet: no alias, the body goes to the server as the client sent it.
        assert!(free.aliases.is_empty());
        assert!(free.served_name.is_none());
        let sub = doc.subscription("simulator-subscription").unwrap();
        assert_eq!(sub.priority, 10);
        assert_eq!(
            sub.display_name.as_deref(),
            Some("Simulator Subscription (Free)")
        );
        assert_eq!(
            doc.subscription("premium-simulator-subscription")
                .unwrap()
                .priority,
            20
        );
        assert_eq!(
            doc.model("premium-simulated-simulated-premium")
                .unwrap()
                .details
                .as_ref()
                .unwrap()
                .display_name
                .as_deref(),
            Some("Premium Simulator")
        );
    }

    /// The reference's id for an on-cluster model (`status.resolvedModelAlias`,
    /// `publishers/<ns>/models/<served name>`) is an alias, and the served name is what the
    /// body is rewritten to: the sample's MaaSModelRef serving `facebook/opt-125m` satisfies
    /// both the client and vLLM.
    #[test]
    fn the_resolved_model_alias_is_an_alias_and_names_the_served_model() {
        use super::samples::V0_2_1;
        let with_status = V0_2_1.replacen(
            "    name: facebook-opt-125m-simulated\n---",
            "    name: facebook-opt-125m-simulated\nstatus:\n  phase: Ready\n  resolvedModelAlias: publishers/llm/models/facebook/opt-125m\n---",
            1,
        );
        assert_ne!(with_status, V0_2_1);
        let t = translate(None, &resources(&with_status));
        assert!(t.invalid.is_empty(), "{:?}", t.invalid);
        let m = t.document.model("facebook-opt-125m-simulated").unwrap();
        assert_eq!(m.aliases, ["publishers/llm/models/facebook/opt-125m"]);
        assert_eq!(m.served_name.as_deref(), Some("facebook/opt-125m"));
        assert_eq!(
            t.document
                .model_by_id("publishers/llm/models/facebook/opt-125m")
                .map(|(_, m)| m.name.as_str()),
            Some("facebook-opt-125m-simulated")
        );
    }

    /// An `inference.opendatahub.io` ExternalModel: its provider's endpoint and key (`apikey`),
    /// `apiFormat`, `targetModel` as the served name and `modelName` as an alias.
    #[test]
    fn an_inference_external_model_is_served_through_its_provider() {
        use super::samples::V0_2_1_INFERENCE;
        let t = translate(None, &resources(V0_2_1_INFERENCE));
        assert!(t.invalid.is_empty(), "{:?}", t.invalid);
        let m = t.document.model("gpt-4o-mini").unwrap();
        let p = m.provider.as_ref().unwrap();
        assert_eq!(p.kind, ProviderKind::Openai);
        assert_eq!(p.secret(), (Some("llm"), "openai-api-key"));
        assert_eq!(
            m.upstream_cluster.as_deref(),
            Some("outbound|443||api.openai.com")
        );
        assert_eq!(m.backend.as_deref(), Some("https://api.openai.com"));
        assert_eq!(m.api, Some(ApiFamily::Openai));
        assert_eq!(m.served_name.as_deref(), Some("gpt-4o-mini-2024-07-18"));
        assert_eq!(m.aliases, ["openai/gpt-4o-mini"]);
        let d = m.details.as_ref().unwrap();
        assert_eq!(d.context_window.as_deref(), Some("128000"));
        assert_eq!(d.capabilities, ["text-generation", "chat"]);
    }

    /// `oauth2` on a vertex provider is its service account, on azure-openai Entra client
    /// credentials; the provider's `config` gives the path fields.
    #[test]
    fn oauth2_providers_get_their_cloud_credential_and_config() {
        use super::samples::V0_2_1_INFERENCE;
        let vertex = V0_2_1_INFERENCE
            .replace("type: apikey", "type: oauth2")
            .replace(
                "provider: openai",
                "provider: vertex\n  config: {project: proj-1, location: us-central1}",
            );
        let t = translate(None, &resources(&vertex));
        assert!(t.invalid.is_empty(), "{:?}", t.invalid);
        let p = t
            .document
            .model("gpt-4o-mini")
            .unwrap()
            .provider
            .clone()
            .unwrap();
        assert_eq!(p.auth, ProviderAuth::GcpServiceAccount);
        assert_eq!(
            (p.project.as_deref(), p.location.as_deref()),
            (Some("proj-1"), Some("us-central1"))
        );
        assert_eq!(p.publisher, None);
        // Gemini in Vertex's own API: `config.publisher: google`; an unknown publisher is
        // refused by name.
        let gemini = vertex.replace(
            "location: us-central1}",
            "location: us-central1, publisher: google}",
        );
        let t = translate(None, &resources(&gemini));
        assert!(t.invalid.is_empty(), "{:?}", t.invalid);
        let m = t.document.model("gpt-4o-mini").unwrap();
        assert_eq!(
            m.provider.as_ref().unwrap().publisher,
            Some(VertexPublisher::Google)
        );
        let unknown = vertex.replace(
            "location: us-central1}",
            "location: us-central1, publisher: mistralai}",
        );
        let t = translate(None, &resources(&unknown));
        assert!(
            format!("{:?}", t.invalid).contains("spec.config.publisher"),
            "{:?}",
            t.invalid
        );
        // The binding's config overrides the provider's: its publisher too, refused by name.
        let by_binding = vertex.replace(
            "      weight: 1\n",
            "      weight: 1\n      config: {publisher: mistralai}\n",
        );
        assert_ne!(by_binding, vertex);
        let t = translate(None, &resources(&by_binding));
        let found = invalid_of(&t);
        assert_eq!(
            found,
            [(
                "ExternalModel",
                "gpt-4o-mini",
                "spec.externalProviderRefs[0].config.publisher"
            )]
        );
        let azure = V0_2_1_INFERENCE
            .replace("type: apikey", "type: oauth2")
            .replace("provider: openai", "provider: azure-openai\n  config: {deployment: gpt-4o-prod, apiVersion: 2024-06-01}");
        let t = translate(None, &resources(&azure));
        assert!(t.invalid.is_empty(), "{:?}", t.invalid);
        let p = t
            .document
            .model("gpt-4o-mini")
            .unwrap()
            .provider
            .clone()
            .unwrap();
        assert_eq!(p.auth, ProviderAuth::AzureClientCredentials);
        assert_eq!(p.deployment.as_deref(), Some("gpt-4o-prod"));
        assert_eq!(p.api_version.as_deref(), Some("2024-06-01"));
        let bedrock = V0_2_1_INFERENCE
            .replace("type: apikey", "type: sigv4")
            .replace(
                "provider: openai",
                "provider: bedrock\n  config: {region: eu-west-1}",
            );
        let t = translate(None, &resources(&bedrock));
        assert!(t.invalid.is_empty(), "{:?}", t.invalid);
        let p = t
            .document
            .model("gpt-4o-mini")
            .unwrap()
            .provider
            .clone()
            .unwrap();
        assert_eq!(p.kind, ProviderKind::Bedrock);
        assert_eq!(p.auth, ProviderAuth::AwsSigV4);
        assert_eq!(p.region.as_deref(), Some("eu-west-1"));
    }

    /// `sigv4` and `oauth2` on a provider type they do not apply to are refused by name (the model
    /// is not served); a binding of weight 0 carries no traffic; a weighted binding of another
    /// API than the first weighted one's is left out, noted.
    #[test]
    fn unsupported_provider_auth_is_reported_and_weights_pick_the_served_bindings() {
        use super::samples::V0_2_1_INFERENCE;
        for auth in ["sigv4", "oauth2"] {
            let text = V0_2_1_INFERENCE.replace("type: apikey", &format!("type: {auth}"));
            let t = translate(None, &resources(&text));
            assert!(t.document.model("gpt-4o-mini").is_none());
            let found = invalid_of(&t);
            assert_eq!(
                found,
                [("ExternalProvider", "openai", "spec.auth.type")],
                "{auth}"
            );
            assert!(
                t.invalid[0].message.contains("not supported"),
                "{}",
                t.invalid[0]
            );
        }
        let two = V0_2_1_INFERENCE.replace(
            "      weight: 1\n",
            "      weight: 0\n    - ref: {name: openai}\n      apiFormat: messages\n      path: /v1/messages\n      targetModel: second\n      weight: 3\n    - ref: {name: openai}\n      apiFormat: openai-chat\n      path: /v1/chat/completions\n      targetModel: third\n",
        );
        let t = translate(None, &resources(&two));
        assert!(t.invalid.is_empty(), "{:?}", t.invalid);
        let m = t.document.model("gpt-4o-mini").unwrap();
        // [1] is the first weighted binding: the model's API; [2] speaks another, left out,
        // so one binding is served, as the model's provider.
        assert_eq!(m.served_name.as_deref(), Some("second"));
        assert_eq!(m.api, Some(ApiFamily::Anthropic));
        assert!(m.backends.is_empty());
        assert_eq!(t.notes.len(), 1, "{:?}", t.notes);
        assert!(
            t.notes[0].contains("externalProviderRefs[2] left out")
                && t.notes[0].contains("openai-chat")
                && t.notes[0].contains("messages"),
            "{:?}",
            t.notes
        );
    }

    /// Two more ExternalProviders beside the sample's `openai` (llm): `azure` (azure-openai,
    /// with its deployment and apiVersion) and `anthropic`.
    const MORE_PROVIDERS: &str = r#"
apiVersion: inference.opendatahub.io/v1alpha1
kind: ExternalProvider
metadata: {name: azure, namespace: llm}
spec:
  provider: azure-openai
  endpoint: my-resource.openai.azure.com
  auth: {type: apikey, secretRef: {name: azure-key}}
  config: {deployment: gpt-4o-prod, apiVersion: 2024-06-01}
---
apiVersion: inference.opendatahub.io/v1alpha1
kind: ExternalProvider
metadata: {name: anthropic, namespace: llm}
spec:
  provider: anthropic
  endpoint: api.anthropic.com
  auth: {type: apikey, secretRef: {name: anthropic-key}}
"#;

    /// The v0.2.1 inference sample with `bindings` (YAML list items, indented four spaces) as
    /// its ExternalModel's `externalProviderRefs`, and [`MORE_PROVIDERS`].
    fn with_bindings(bindings: &str) -> Resources {
        use super::samples::V0_2_1_INFERENCE;
        let sample = "  externalProviderRefs:\n    - ref:\n        name: openai\n      apiFormat: openai-chat\n      path: /v1/chat/completions\n      targetModel: gpt-4o-mini-2024-07-18\n      weight: 1\n";
        assert!(V0_2_1_INFERENCE.contains(sample));
        let text =
            V0_2_1_INFERENCE.replace(sample, &format!("  externalProviderRefs:\n{bindings}"));
        resources(&format!("{text}\n---\n{MORE_PROVIDERS}"))
    }

    /// A binding's `path` is the provider's chat path, its placeholders from the config (the
    /// binding's over the provider's); the API's own path changes nothing; an unknown
    /// placeholder makes the ExternalModel invalid, naming the binding's path.
    #[test]
    fn a_bindings_path_is_the_providers_chat_path_with_its_placeholders_resolved() {
        let provider_of = |bindings: &str| {
            let t = translate(None, &with_bindings(bindings));
            assert!(t.invalid.is_empty(), "{:?}", t.invalid);
            assert_validates(&t.document);
            t.document
                .model("gpt-4o-mini")
                .unwrap()
                .provider
                .clone()
                .unwrap()
        };
        let p = provider_of(
            "    - {ref: {name: openai}, apiFormat: openai-chat, path: '/{tenant}/v1/chat/completions', targetModel: x, config: {tenant: acme}}\n",
        );
        assert_eq!(p.path.as_deref(), Some("/acme/v1/chat/completions"));
        let p = provider_of(
            "    - {ref: {name: openai}, apiFormat: openai-chat, path: /v1/chat/completions, targetModel: x}\n",
        );
        assert_eq!(p.path, None);
        let t = translate(
            None,
            &with_bindings(
                "    - {ref: {name: openai}, apiFormat: openai-chat, path: '/{nope}/chat', targetModel: x}\n",
            ),
        );
        assert!(t.document.model("gpt-4o-mini").is_none());
        assert_eq!(
            invalid_of(&t),
            [(
                "ExternalModel",
                "gpt-4o-mini",
                "spec.externalProviderRefs[0].path"
            )]
        );
    }

    /// The document as the filter reads it (JSON, validated, routed variants built): the same.
    fn assert_validates(doc: &PolicyDocument) {
        let read = PolicyDocument::from_value(serde_json::to_value(doc).unwrap())
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&read, doc);
    }

    /// Several bindings with a weight: one model whose routed backends are the bindings (each its
    /// provider, credential, cluster, targetModel and weight; the reference's weighted random
    /// selection), the model's API set from their apiFormat; a binding of weight 0 left out.
    #[test]
    fn several_weighted_bindings_become_routed_backends() {
        let res = with_bindings(
            "    - {ref: {name: openai}, apiFormat: openai-chat, path: /v1/chat/completions, targetModel: gpt-4o-mini-2024-07-18, weight: 3}\n    - {ref: {name: anthropic}, apiFormat: openai-chat, path: /v1/chat/completions, targetModel: unused, weight: 0}\n    - {ref: {name: azure}, apiFormat: openai-chat, path: /v1/chat/completions, targetModel: gpt-4o-mini}\n",
        );
        let t = translate(None, &res);
        assert!(t.invalid.is_empty(), "{:?}", t.invalid);
        assert!(t.notes.is_empty(), "{:?}", t.notes);
        assert_validates(&t.document);
        let m = t.document.model("gpt-4o-mini").unwrap();
        assert!(m.routes_backends());
        assert_eq!(
            (&m.provider, &m.upstream_cluster, &m.served_name, &m.backend),
            (&None, &None, &None, &None)
        );
        assert_eq!(m.api, Some(ApiFamily::Openai));
        assert_eq!(m.cooldown, None);
        assert_eq!(m.aliases, ["openai/gpt-4o-mini"]);
        let mut azure = Provider::api_key(ProviderKind::AzureOpenai, "llm/azure-key".into());
        azure.deployment = Some("gpt-4o-prod".into());
        azure.api_version = Some("2024-06-01".into());
        assert_eq!(
            m.backends,
            [
                Backend {
                    name: "openai".into(),
                    backend: Some("https://api.openai.com".into()),
                    provider: Some(Provider::api_key(
                        ProviderKind::Openai,
                        "llm/openai-api-key".into()
                    )),
                    served_name: Some("gpt-4o-mini-2024-07-18".into()),
                    weight: 3,
                    timeout: None,
                    upstream_cluster: Some("outbound|443||api.openai.com".into()),
                },
                Backend {
                    name: "azure".into(),
                    backend: Some("https://my-resource.openai.azure.com".into()),
                    provider: Some(azure),
                    served_name: Some("gpt-4o-mini".into()),
                    weight: 1,
                    timeout: None,
                    upstream_cluster: Some("outbound|443||my-resource.openai.azure.com".into()),
                },
            ]
        );
        // Each backend's credential is the filter's to load; the status's list agrees.
        let refs: Vec<&str> = m.providers().map(|p| p.credential_ref.as_str()).collect();
        assert_eq!(refs, ["llm/openai-api-key", "llm/azure-key"]);
        let spec_refs = res.inference_models[0].data["spec"]["externalProviderRefs"]
            .as_array()
            .unwrap()
            .clone();
        assert_eq!(served_bindings(&spec_refs), [0, 2]);
        // Each routed backend as the model it serves.
        let (i, _) = t.document.model_by_id("gpt-4o-mini").unwrap();
        let azure = t.document.backend_variant(i, 1).unwrap();
        assert_eq!(azure.served_name.as_deref(), Some("gpt-4o-mini"));
        assert_eq!(
            azure.upstream_cluster.as_deref(),
            Some("outbound|443||my-resource.openai.azure.com")
        );
        // Every weighted binding is read: an invalid one makes the ExternalModel invalid.
        let res = with_bindings(
            "    - {ref: {name: openai}, apiFormat: openai-chat, path: /v1/chat/completions, targetModel: gpt-4o-mini-2024-07-18}\n    - {ref: {name: azure}, apiFormat: openai-chat, path: /v1/chat/completions}\n    - {ref: {name: nowhere}, apiFormat: openai-chat, path: /v1/chat/completions, targetModel: x, weight: 0}\n",
        );
        let t = translate(None, &res);
        assert!(t.document.model("gpt-4o-mini").is_none());
        let found = invalid_of(&t);
        assert_eq!(
            found,
            [(
                "ExternalModel",
                "gpt-4o-mini",
                "spec.externalProviderRefs[1].targetModel"
            )]
        );
    }

    /// A binding's own `auth` and `config` replace its provider's for that binding only; its
    /// `config` is merged over the provider's key by key (one binding too). A value the policy
    /// refuses names the binding.
    #[test]
    fn a_bindings_auth_and_config_override_its_providers_for_that_binding_only() {
        let res = with_bindings(
            "    - {ref: {name: azure}, apiFormat: openai-chat, path: /v1/chat/completions, targetModel: gpt-4o-mini, auth: {type: oauth2, secretRef: {name: entra}}, config: {deployment: gpt-4o-eu}}\n    - {ref: {name: azure}, apiFormat: openai-chat, path: /v1/chat/completions, targetModel: gpt-4o-mini}\n",
        );
        let t = translate(None, &res);
        assert!(t.invalid.is_empty(), "{:?}", t.invalid);
        assert_validates(&t.document);
        let m = t.document.model("gpt-4o-mini").unwrap();
        let providers: Vec<_> = m
            .backends
            .iter()
            .map(|b| b.provider.clone().unwrap())
            .collect();
        let (own, plain) = (&providers[0], &providers[1]);
        assert_eq!(
            (own.credential_ref.as_str(), own.auth),
            ("llm/entra", ProviderAuth::AzureClientCredentials)
        );
        assert_eq!(
            (own.deployment.as_deref(), own.api_version.as_deref()),
            (Some("gpt-4o-eu"), Some("2024-06-01"))
        );
        assert_eq!(
            (plain.credential_ref.as_str(), plain.auth),
            ("llm/azure-key", ProviderAuth::ApiKey)
        );
        assert_eq!(
            (plain.deployment.as_deref(), plain.api_version.as_deref()),
            (Some("gpt-4o-prod"), Some("2024-06-01"))
        );
        // One binding: its config still wins over the provider's (`api-version` beside the
        // provider's `apiVersion` too).
        let res = with_bindings(
            "    - {ref: {name: azure}, apiFormat: openai-chat, path: /v1/chat/completions, targetModel: gpt-4o-mini, config: {api-version: 2025-01-01}}\n",
        );
        let t = translate(None, &res);
        assert!(t.invalid.is_empty(), "{:?}", t.invalid);
        let p = t
            .document
            .model("gpt-4o-mini")
            .unwrap()
            .provider
            .clone()
            .unwrap();
        assert_eq!(
            (p.deployment.as_deref(), p.api_version.as_deref()),
            (Some("gpt-4o-prod"), Some("2025-01-01"))
        );
        // A binding's config the policy refuses names that binding, on the MaaSModelRef.
        let res = with_bindings(
            "    - {ref: {name: openai}, apiFormat: openai-chat, path: /v1/chat/completions, targetModel: gpt-4o-mini-2024-07-18}\n    - {ref: {name: azure}, apiFormat: openai-chat, path: /v1/chat/completions, targetModel: gpt-4o-mini, config: {deployment: a/b}}\n",
        );
        let t = translate(None, &res);
        assert!(t.document.model("gpt-4o-mini").is_none());
        let found = invalid_of(&t);
        assert_eq!(
            found,
            [(
                "MaaSModelRef",
                "gpt-4o-mini",
                "spec.externalProviderRefs[1] (ExternalModel)"
            )]
        );
        assert!(
            t.invalid[0].message.contains("deployment"),
            "{}",
            t.invalid[0]
        );
    }

    /// A weighted binding whose apiFormat is not the first weighted binding's is left out with
    /// a note naming it; the others are served.
    #[test]
    fn a_binding_of_another_api_format_is_left_out_with_a_note() {
        let res = with_bindings(
            "    - {ref: {name: openai}, apiFormat: openai-chat, path: /v1/chat/completions, targetModel: gpt-4o-mini-2024-07-18}\n    - {ref: {name: anthropic}, apiFormat: messages, path: /v1/messages, targetModel: claude-sonnet-4-5}\n    - {ref: {name: azure}, apiFormat: openai-chat, path: /v1/chat/completions, targetModel: gpt-4o-mini, weight: 2}\n",
        );
        let t = translate(None, &res);
        assert!(t.invalid.is_empty(), "{:?}", t.invalid);
        assert_validates(&t.document);
        let m = t.document.model("gpt-4o-mini").unwrap();
        assert_eq!(m.api, Some(ApiFamily::Openai));
        let names: Vec<(&str, u32)> = m
            .backends
            .iter()
            .map(|b| (b.name.as_str(), b.weight))
            .collect();
        assert_eq!(names, [("openai", 1), ("azure", 2)]);
        assert_eq!(t.notes.len(), 1, "{:?}", t.notes);
        assert!(
            t.notes[0].contains("ExternalModel llm/gpt-4o-mini")
                && t.notes[0].contains("externalProviderRefs[1] left out")
                && t.notes[0].contains("messages")
                && t.notes[0].contains("externalProviderRefs[0]"),
            "{:?}",
            t.notes
        );
        let spec_refs = res.inference_models[0].data["spec"]["externalProviderRefs"]
            .as_array()
            .unwrap()
            .clone();
        assert_eq!(served_bindings(&spec_refs), [0, 2]);
    }

    /// Two bindings of one provider (e.g. two of its models): distinct backend names,
    /// `<provider>-<index>`, each its own targetModel, the same cluster.
    #[test]
    fn bindings_of_one_provider_get_distinct_backend_names() {
        let res = with_bindings(
            "    - {ref: {name: openai}, apiFormat: openai-chat, path: /v1/chat/completions, targetModel: gpt-4o-mini-2024-07-18}\n    - {ref: {name: azure}, apiFormat: openai-chat, path: /v1/chat/completions, targetModel: gpt-4o-mini}\n    - {ref: {name: openai}, apiFormat: openai-chat, path: /v1/chat/completions, targetModel: gpt-4o-mini}\n",
        );
        let t = translate(None, &res);
        assert!(t.invalid.is_empty(), "{:?}", t.invalid);
        assert_validates(&t.document);
        let m = t.document.model("gpt-4o-mini").unwrap();
        let backends: Vec<(&str, &str, &str)> = m
            .backends
            .iter()
            .map(|b| {
                (
                    b.name.as_str(),
                    b.served_name.as_deref().unwrap(),
                    b.upstream_cluster.as_deref().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            backends,
            [
                (
                    "openai-0",
                    "gpt-4o-mini-2024-07-18",
                    "outbound|443||api.openai.com"
                ),
                (
                    "azure",
                    "gpt-4o-mini",
                    "outbound|443||my-resource.openai.azure.com"
                ),
                ("openai-2", "gpt-4o-mini", "outbound|443||api.openai.com"),
            ]
        );
    }

    /// Backend names stay unique and within 63 characters whatever the providers are named.
    #[test]
    fn backend_names_are_unique_and_short_enough() {
        let binding = |index: usize, name: &str| InferenceBinding {
            index,
            provider_name: name.into(),
            provider: Provider::api_key(ProviderKind::Openai, "llm/k".into()),
            upstream_cluster: String::new(),
            endpoint: String::new(),
            served_name: String::new(),
            api: ApiFamily::Openai,
            weight: 1,
        };
        let long = "p".repeat(70);
        let names = backend_names(&[
            binding(0, "a"),
            binding(1, "a"),
            binding(2, "a-1"),
            binding(3, &long),
            binding(4, &long),
        ]);
        assert_eq!(
            names[..3],
            ["a-0".to_string(), "a-1-1".into(), "a-1".into()]
        );
        assert_eq!(names[3], format!("{}-3", "p".repeat(61)));
        assert_eq!(names[4], format!("{}-4", "p".repeat(61)));
        assert!(names.iter().all(|n| n.len() <= 63));
        let unique: BTreeSet<&String> = names.iter().collect();
        assert_eq!(unique.len(), names.len());
    }
}
