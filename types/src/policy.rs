//! The policy document: tiers, models, subscriptions ([`crate::subscription`]) and the recent
//! revocations.
//!
//! The companion loads it from YAML (the ConfigMap) and serves it as JSON on
//! `GET /internal/v1/policy`; the filter polls it and also accepts one in its pluginConfig as a
//! bootstrap. Both sides parse with [`PolicyDocument::from_json`] / [`PolicyDocument::from_value`]
//! and [`PolicyDocument::validate`], so they accept and refuse the same documents, and errors
//! name the field (`tiers[1].limits.tokens[0].window: ...`).

use crate::window::Window;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

pub mod scope;
pub use scope::{Scope, ScopeCounter, ScopeMatch, ScopePer};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PolicyDocument {
    pub tiers: Vec<Tier>,
    #[serde(default)]
    pub models: Vec<Model>,
    /// Subscriptions (owner, per-model token limits, priority). Left out of the served JSON when
    /// empty, so a tier-only document is served exactly as before.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subscriptions: Vec<Subscription>,
    /// Key ids (the `key_id` half of `sk-oai-{key_id}_{secret}`) revoked recently, kept longer
    /// than any cache TTL, so every cache evicts them within one poll interval.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub revoked_key_ids: Vec<String>,
    /// The gateway's base URL as clients reach it (the companion's `--public-url`), set by the
    /// companion when it serves the document: the filter's `GET /v1/models` gives each model its
    /// `url` from it (the reference's clients read `.data[].url`), never from the `Host` a
    /// client sends. Left out when unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_url: Option<String>,
    /// Which rate-limit headers answers carry (default `openai`). Left out when default.
    #[serde(default, skip_serializing_if = "RateLimitHeaders::is_default")]
    pub rate_limit_headers: RateLimitHeaders,
    /// What the gateway reports beside enforcing (default: nothing). Left out when default.
    #[serde(default, skip_serializing_if = "Observability::is_default")]
    pub observability: Observability,
    /// Limits over groups of requests beside each request's own (issue 30; [`scope`]). Left
    /// out when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scopes: Vec<Scope>,
    /// Each model's routed backends as models of their own ([`Model::routes_backends`]), by
    /// model index; empty when no model routes its backends. Not part of the document: built
    /// when it is read ([`from_deserializer`]), so a request resolves its drawn backend
    /// without a copy.
    #[serde(skip)]
    pub backend_variants: Vec<Vec<Model>>,
}

/// What the gateway reports beside enforcing (issue 32); every switch defaults to off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Observability {
    /// One usage event per request the usage ledger counts: the filter leaves it in the
    /// stream's filter state (`wasm.maas_event`) for an access log to write
    /// (docs/contracts.md "Usage events").
    #[serde(default)]
    pub usage_events: bool,
    /// The gateway's request span gets the request's attributes (model, operation, user
    /// pseudonym, decision, tokens): the filter leaves each in the stream's filter state
    /// (`wasm.<attribute>`) for the tracer's custom tags (docs/contracts.md "Trace attributes").
    #[serde(default)]
    pub trace_attributes: bool,
}

impl Observability {
    pub fn is_default(&self) -> bool {
        *self == Observability::default()
    }
}

/// The rate-limit headers of answers: OpenAI's six `x-ratelimit-*`, the IETF pair
/// `RateLimit` / `RateLimit-Policy` (draft-ietf-httpapi-ratelimit-headers), or none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum RateLimitHeaders {
    #[default]
    Openai,
    Ietf,
    None,
}

impl RateLimitHeaders {
    pub fn is_default(&self) -> bool {
        *self == RateLimitHeaders::Openai
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Tier {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Higher wins when a user's groups match several tiers.
    pub level: i64,
    /// Members of any of these groups qualify for the tier.
    pub groups: Vec<String>,
    #[serde(default)]
    pub limits: Limits,
    /// Tokens reserved for a request that names no `max_tokens` (settled to the real usage later);
    /// with [`UncappedRequests::Inject`] also the cap the backend is given for such a request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_max_tokens: Option<u64>,
    /// What happens to a request that names no output cap (see [`UncappedRequests`]).
    #[serde(default, skip_serializing_if = "UncappedRequests::is_default")]
    pub uncapped_requests: UncappedRequests,
    /// How input and output tokens count against the tier's token windows (default 1 and 1).
    #[serde(default, skip_serializing_if = "TokenWeights::is_default")]
    pub token_weights: TokenWeights,
    /// Early warnings: the percentages of a window's limit past which an answer carries
    /// `x-maas-quota-warning` (default 80 and 95; `[]`: none).
    #[serde(
        default = "default_warn_at",
        skip_serializing_if = "is_default_warn_at"
    )]
    pub warn_at: Vec<u8>,
    /// Prices that replace models' for requests on this tier, by model name (what money
    /// budgets and the ledger charge).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub prices: BTreeMap<String, crate::money::Pricing>,
    /// Prices that replace the model's for requests counted against this tier: only a
    /// subscription's model sets them ([`crate::Subscription::limits_tier`]); not in documents.
    #[serde(skip)]
    pub pricing: Option<crate::money::Pricing>,
}

impl Tier {
    /// The prices this tier charges for `model`, when it replaces the model's own.
    pub fn pricing_of(&self, model: &str) -> Option<crate::money::Pricing> {
        self.pricing.or_else(|| self.prices.get(model).copied())
    }
}

/// The default warning thresholds: 80 % and 95 % of a window's limit.
pub const DEFAULT_WARN_AT: [u8; 2] = [80, 95];

pub fn default_warn_at() -> Vec<u8> {
    DEFAULT_WARN_AT.to_vec()
}

fn is_default_warn_at(v: &[u8]) -> bool {
    v == DEFAULT_WARN_AT
}

/// At most this many warning thresholds per tier or subscription.
pub const MAX_WARN_AT: usize = 8;

/// Thresholds: each 1 to 100, strictly increasing, at most [`MAX_WARN_AT`].
fn check_warn_at(at: &str, v: &[u8]) -> Result<(), PolicyError> {
    if v.len() > MAX_WARN_AT {
        return Err(err(at, format!("at most {MAX_WARN_AT} thresholds")));
    }
    for (i, t) in v.iter().enumerate() {
        if !(1..=100).contains(t) {
            return Err(err(
                format!("{at}[{i}]"),
                "must be a percentage from 1 to 100",
            ));
        }
        if i > 0 && v.get(i - 1).is_some_and(|prev| prev >= t) {
            return Err(err(format!("{at}[{i}]"), "thresholds must increase"));
        }
    }
    Ok(())
}

/// What the gateway does with a generating request whose body names no output cap (no
/// `max_tokens`, `max_completion_tokens` or `max_output_tokens`, or only `0`/`null`): servers
/// such as vLLM then generate up to the model's context length, far beyond any reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum UncappedRequests {
    /// The API family's own cap field is set to the reservation (`defaultMaxTokens`, else the
    /// gateway's fallback) before the request is forwarded, so the backend stops there: the
    /// output is bounded by what was reserved.
    #[default]
    Inject,
    /// The body is forwarded as sent and `defaultMaxTokens` is only reserved; the usage the
    /// response reports is settled (debt above the reservation), so one request may overshoot
    /// a window by its whole generation.
    Reserve,
}

impl UncappedRequests {
    pub fn is_default(&self) -> bool {
        *self == UncappedRequests::default()
    }
}

/// What the gateway does with a request naming a tool the provider runs itself inside the
/// request (web search, file search, code execution, remote MCP…): it reads content and may
/// take turns the body does not show, so nothing bounds its cost before the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum HostedTools {
    /// Refused (400 `hosted_tool_not_allowed`, naming the tool): nothing is spent that was not
    /// reserved.
    #[default]
    Refuse,
    /// Forwarded: reserved like any request and settled to the usage the provider reports, so
    /// one request may overshoot a window by all its tool turns read.
    Settle,
}

impl HostedTools {
    pub fn is_default(&self) -> bool {
        *self == HostedTools::default()
    }
}

/// Largest token weight.
pub const MAX_TOKEN_WEIGHT: u32 = 1000;

/// Weights of input and output tokens in token limits (positive integers up to
/// [`MAX_TOKEN_WEIGHT`], default 1 each): a request costs `input × input tokens + output × output
/// tokens` "weighted tokens" in every token window it counts against. Input tokens include cached
/// ones (OpenAI `prompt_tokens`; Anthropic `input_tokens` + cache creation + cache read).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TokenWeights {
    #[serde(default = "one")]
    pub input: u32,
    #[serde(default = "one")]
    pub output: u32,
}

fn one() -> u32 {
    1
}

impl Default for TokenWeights {
    fn default() -> Self {
        TokenWeights {
            input: 1,
            output: 1,
        }
    }
}

impl TokenWeights {
    pub fn is_default(&self) -> bool {
        *self == TokenWeights::default()
    }

    /// `input × input_tokens + output × output_tokens` (saturating).
    pub fn weigh(&self, input_tokens: u64, output_tokens: u64) -> u64 {
        input_tokens
            .saturating_mul(u64::from(self.input))
            .saturating_add(output_tokens.saturating_mul(u64::from(self.output)))
    }

    /// The larger weight of each kind (a request counted against several tiers' windows is
    /// weighed by the stricter of their weights).
    pub fn max(self, other: TokenWeights) -> TokenWeights {
        TokenWeights {
            input: self.input.max(other.input),
            output: self.output.max(other.output),
        }
    }
}

/// Checks a `tokenWeights` object (`path` names it).
pub fn check_token_weights(path: &str, w: &TokenWeights) -> Result<(), PolicyError> {
    for (field, v) in [("input", w.input), ("output", w.output)] {
        if v == 0 || v > MAX_TOKEN_WEIGHT {
            return Err(err(
                format!("{path}.{field}"),
                format!("must be an integer from 1 to {MAX_TOKEN_WEIGHT}"),
            ));
        }
    }
    Ok(())
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Limits {
    /// Requests per window; several windows may apply at once (e.g. per minute and per day).
    #[serde(default)]
    pub requests: Vec<Limit>,
    /// Tokens (prompt + completion) per window.
    #[serde(default)]
    pub tokens: Vec<Limit>,
    /// Money per window (issue 30): what the models' `pricing` charges for the tokens,
    /// reserved at admission (worst case) and settled to the real usage.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub budgets: Vec<crate::money::Budget>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Limit {
    pub limit: u64,
    pub window: Window,
    /// A shadow limit is counted and evaluated but never refuses: a request it would refuse
    /// goes on, and the would-be refusal is counted (metric, usage ledger), so a tighter limit
    /// can be tried on live traffic first. Not in `x-ratelimit-*`, warnings or `/v1/quota`.
    #[serde(default, skip_serializing_if = "is_false")]
    pub shadow: bool,
}

pub(crate) fn is_false(b: &bool) -> bool {
    !*b
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Model {
    /// The model id clients send in the body's `model` field and see in `/v1/models`.
    pub name: String,
    /// Other ids clients may send for the model (in the body's `model`, at either URL form):
    /// unique across every model's name and aliases.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// The model name the backend expects in the body's `model` (vLLM's served model name, an
    /// ExternalModel's `targetModel`): the gateway rewrites the body's `model` to it when the
    /// client sent another id. Default: the body is forwarded with the id the client sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_name: Option<String>,
    /// Path prefix the model is served under, e.g. `/llm/sim-model` (KServe: `/<namespace>/<name>`).
    pub path: String,
    /// Tiers allowed to call the model.
    pub tiers: Vec<String>,
    /// Where the model runs. Used by the local stack to generate Envoy clusters
    /// (`simulator` = the built-in model simulator, or an `http://host:port` URL) and shown as
    /// `url` in `/v1/models`; the filter does not route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// Several backends instead of one `backend`/`provider` (issue 29): requests are spread by
    /// weight and fail over to another backend on a connect failure, a reset, a 429 or a 5xx
    /// before the first response byte (see docs/design.md "Several backends per model").
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub backends: Vec<Backend>,
    /// How long a backend that keeps failing is tried last (LiteLLM's cooldowns, Envoy's outlier
    /// ejection), for a model with `backends`. Default [`DEFAULT_COOLDOWN_FAILURES`] in
    /// [`DEFAULT_COOLDOWN_DURATION`]; `failures: 0` turns
    /// it off (docs/design.md "Cooldown").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cooldown: Option<Cooldown>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owned_by: Option<String>,
    /// Set for external providers: the filter injects the provider's credential.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<Provider>,
    /// API family of the model's endpoints, which picks the default `operations`:
    /// `openai` (chat/completions, completions, embeddings, responses, models) or `anthropic`
    /// (messages, models, and OpenAI chat/completions translated to messages by the filter).
    /// Default: `anthropic` for an anthropic provider, else `openai`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api: Option<ApiFamily>,
    /// The only (method, path) pairs forwarded to the model, replacing the API family's
    /// defaults. Paths are relative to the model's `path`; `*` stands for one segment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operations: Option<Vec<OperationSpec>>,
    /// The Envoy cluster the gateway routes this model to (e.g. `outbound|443||api.openai.com`
    /// under Istio). The filter forwards a request only when Envoy picked this cluster for it,
    /// so a route the gateway did not create never receives the provider credential.
    /// Required with `provider`; checked when given for on-cluster models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_cluster: Option<String>,
    /// What `/v1/models` tells clients about the model (the reference's `modelDetails`); the
    /// filter does not read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub details: Option<ModelDetails>,
    /// Prices per token, what money budgets charge (a subscription's model may override them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pricing: Option<crate::money::Pricing>,
    /// Ours: prompt tokens reserved at admission for each content part that carries media (an
    /// image, audio, video or document, inline or by URL or file id), whose cost is not in its
    /// bytes. Default [`DEFAULT_MEDIA_TOKENS`]; set it to the most one part costs on this model
    /// (e.g. a Qwen2.5-VL image at vLLM's default `max_pixels`: 16,384). `0`: media parts are
    /// reserved nothing (settled from the usage only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_tokens: Option<u64>,
    /// Ours: requests naming a tool the provider runs itself (`web_search`, `file_search`,
    /// `code_interpreter`, `mcp`, Anthropic server tools, `web_search_options`, `mcp_servers`):
    /// `refuse` (default) or `settle`.
    #[serde(default, skip_serializing_if = "HostedTools::is_default")]
    pub hosted_tools: HostedTools,
}

/// Prompt tokens reserved per media part when a model sets no `mediaTokens`: above what one
/// image costs at the hosted providers (Anthropic about 1,600 after its resize, OpenAI's and
/// Gemini's tiles fewer) and a PDF page at Anthropic (1,500–3,000 with its page image).
pub const DEFAULT_MEDIA_TOKENS: u64 = 4096;

/// A backend that fails `failures` attempts in a row is cooled down for `duration`: tried after
/// every other backend that can serve (the filter's order) or ejected (Envoy's outlier detection
/// for backends without providers). One more failure after its cooldown cools it again; one
/// success clears it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Cooldown {
    /// Failed attempts in a row (a connect failure, a reset, a timeout, 429 or 5xx); 0: never.
    pub failures: u32,
    /// How long it lasts (`30s`, `2m`).
    #[serde(default = "default_cooldown_duration")]
    pub duration: String,
}

fn default_cooldown_duration() -> String {
    DEFAULT_COOLDOWN_DURATION.to_string()
}

/// [`Cooldown::failures`] when a model with backends names no cooldown.
pub const DEFAULT_COOLDOWN_FAILURES: u32 = 3;
/// [`Cooldown::duration`] when a model names none.
pub const DEFAULT_COOLDOWN_DURATION: &str = "30s";

/// Statuses after which an attempt fails over to another backend (the route's retriable
/// statuses; before the first response byte reached the client), and count against its cooldown.
pub const FAILOVER_STATUSES: [u16; 5] = [429, 500, 502, 503, 504];

/// A model's cooldown as numbers: failures in a row, and seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CooldownRule {
    pub failures: u32,
    pub seconds: u64,
}

/// One of a model's several backends ([`Model::backends`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Backend {
    /// Unique within the model: what usage events name as the backend that served.
    pub name: String,
    /// Where it runs, as a model's `backend`: `simulator` or an `http://host:port` URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// An external provider with its own credential: set per upstream attempt, for the backend
    /// Envoy picked, by the filter's upstream mode (docs/design.md "Several backends per
    /// model"). Only providers that speak the model's API and take a key or an access token in
    /// a header, with the path as sent (no Bedrock, no provider path); the model then needs an
    /// `upstreamCluster`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<Provider>,
    /// The model name this backend expects in the body's `model` (the reference's per-binding
    /// `targetModel`), when it is not the model's [`Model::served_name`]: each upstream attempt
    /// to this backend gets it, written by the upstream filter (docs/design.md "Several backends
    /// per model"). Default: the model's served name, else what the client sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_name: Option<String>,
    /// Relative share of the model's requests, 0..=100 (the reference's `weight`; 0: no traffic).
    #[serde(default = "default_backend_weight")]
    pub weight: u32,
    /// How long an attempt on this backend may take to start answering (e.g. `30s`, `500ms`)
    /// before the request fails over (a routed backend's request: ends, 504), and how long an
    /// answer may then stay quiet. Default [`DEFAULT_BACKEND_TIMEOUT_MS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<String>,
    /// The backend's own Envoy cluster (e.g. `outbound|443||api.openai.com` under Istio): a
    /// *routed* backend. When a model's backends name their clusters (all of them, or none), the
    /// downstream filter draws one per request by weight among those that can serve and has
    /// Envoy route the request there by [`MODEL_ROUTING_HEADER`] and [`BACKEND_ROUTING_HEADER`]
    /// (one HTTPRoute rule per backend: the reference's weighted `externalProviderRefs`). No
    /// failover; everything a single provider gets applies per request (credential, path,
    /// translation, signing), and the answer must come from that cluster (docs/design.md
    /// "Routed backends").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_cluster: Option<String>,
}

/// The reference's default weight.
fn default_backend_weight() -> u32 {
    1
}

/// A backend's default [`Backend::timeout`], in milliseconds.
/// (the local stack's route timeout: a backend may take as long to answer as a single one).
pub const DEFAULT_BACKEND_TIMEOUT_MS: u64 = 300_000;

impl Model {
    /// The cooldown of the model's backends (`None`: no backends, routed backends, or
    /// `failures: 0`; its duration is checked with the policy).
    pub fn cooldown_rule(&self) -> Option<CooldownRule> {
        if self.backends.is_empty() || self.routes_backends() {
            return None;
        }
        let (failures, duration) = match &self.cooldown {
            Some(c) => (c.failures, c.duration.as_str()),
            None => (DEFAULT_COOLDOWN_FAILURES, DEFAULT_COOLDOWN_DURATION),
        };
        (failures > 0).then_some(CooldownRule {
            failures,
            seconds: parse_duration_ms(duration)?.div_ceil(1000),
        })
    }

    /// Whether the model's backends cluster runs the filter's upstream mode: some backend has
    /// a provider (its credential and path are set per attempt) or a served name of its own
    /// (written into each of its attempts' bodies). Never for routed backends (no such cluster).
    pub fn backends_need_upstream_filter(&self) -> bool {
        !self.routes_backends()
            && self
                .backends
                .iter()
                .any(|b| b.provider.is_some() || b.served_name.is_some())
    }

    /// Whether the model's backends are routed ([`Backend::upstream_cluster`]): the downstream
    /// filter draws one per request and Envoy routes to its own cluster.
    pub fn routes_backends(&self) -> bool {
        self.backends
            .first()
            .is_some_and(|b| b.upstream_cluster.is_some())
    }

    /// The model as its routed backend `b` serves it: the backend's provider, served name,
    /// URL and cluster; the model's name, aliases, path, tiers, operations and everything the
    /// limits and the ledger read. Built once per policy ([`PolicyDocument::backend_variant`]).
    fn routed_variant(&self, b: &Backend) -> Model {
        Model {
            backend: b.backend.clone(),
            backends: Vec::new(),
            cooldown: None,
            provider: b.provider.clone(),
            served_name: b.served_name.clone().or_else(|| self.served_name.clone()),
            upstream_cluster: b.upstream_cluster.clone(),
            ..self.clone()
        }
    }
}

impl Backend {
    /// [`Backend::timeout`] in milliseconds (`None`: not a duration).
    pub fn timeout_ms(&self) -> Option<u64> {
        match &self.timeout {
            None => Some(DEFAULT_BACKEND_TIMEOUT_MS),
            Some(t) => parse_duration_ms(t),
        }
    }
}

/// `500ms`, `30s`, `5m` as milliseconds; `None` for anything else (or zero).
pub fn parse_duration_ms(s: &str) -> Option<u64> {
    let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit())?);
    let n: u64 = digits.parse().ok()?;
    let ms = match unit {
        "ms" => n,
        "s" => n.checked_mul(1000)?,
        "m" => n.checked_mul(60_000)?,
        _ => return None,
    };
    (ms > 0).then_some(ms)
}

/// A model's cooldown (with backends that are not routed) and, for routed backends, no
/// `upstreamCluster` of the model's own.
fn check_cooldown(i: usize, m: &Model, routed: bool) -> Result<(), PolicyError> {
    if routed && m.cooldown.is_some() {
        return Err(err(
            format!("models[{i}].cooldown"),
            "not for routed backends (each backend its own upstreamCluster): the filter draws one per request with no failover, and no cooldown is kept for them",
        ));
    }
    if routed && m.upstream_cluster.is_some() {
        return Err(err(
            format!("models[{i}].upstreamCluster"),
            "not with routed backends: each backend names its own upstreamCluster",
        ));
    }
    if let Some(c) = &m.cooldown {
        if c.failures > 100 {
            return Err(err(
                format!("models[{i}].cooldown.failures"),
                "must be 0 (off) to 100",
            ));
        }
        match parse_duration_ms(&c.duration) {
            Some(ms) if (1000..=3_600_000).contains(&ms) => {}
            _ => {
                return Err(err(
                    format!("models[{i}].cooldown.duration"),
                    "must be a duration from 1s to 1h, such as 30s or 5m",
                ));
            }
        }
    }
    Ok(())
}

/// Backends: one of `backend`/`provider` or `backends`; names unique; weights 0..=100 with one
/// above 0; durations readable; providers as [`check_backend_provider`] allows.
fn check_backends(i: usize, m: &Model) -> Result<(), PolicyError> {
    if m.backends.is_empty() {
        if m.cooldown.is_some() {
            return Err(err(
                format!("models[{i}].cooldown"),
                "only for a model with backends",
            ));
        }
        return Ok(());
    }
    let routed = m.routes_backends();
    check_cooldown(i, m, routed)?;
    for (field, given) in [
        ("backend", m.backend.is_some()),
        ("provider", m.provider.is_some()),
    ] {
        if given {
            return Err(err(
                format!("models[{i}].{field}"),
                "a model has either backend/provider or backends, not both",
            ));
        }
    }
    let mut names = BTreeSet::new();
    for (j, b) in m.backends.iter().enumerate() {
        let at = format!("models[{i}].backends[{j}]");
        // It goes into the usage-event line unquoted: no character that needs escaping.
        if b.name.is_empty()
            || b.name.len() > 63
            || !b
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        {
            return Err(err(
                format!("{at}.name"),
                "must be 1 to 63 letters, digits, '.', '_' or '-'",
            ));
        }
        if !names.insert(b.name.as_str()) {
            return Err(err(
                format!("{at}.name"),
                format!("backend {:?} is named twice", b.name),
            ));
        }
        if b.upstream_cluster.is_some() != routed {
            return Err(err(
                format!("{at}.upstreamCluster"),
                "either every backend of a model names its own cluster (routed backends) or none does",
            ));
        }
        if let Some(served) = &b.served_name {
            check_model_id(format!("{at}.servedName"), served)?;
        }
        if routed {
            check_routed_backend(&at, m, b)?;
        } else if let Some(p) = &b.provider {
            check_backend_provider(&format!("{at}.provider"), m, p)?;
        }
        match b.backend.as_deref() {
            // A routed backend's cluster is the operator's: its URL only builds a local one.
            None if routed => {}
            None => return Err(err(format!("{at}.backend"), "required")),
            Some(u)
                if u == "simulator" || u.starts_with("http://") || u.starts_with("https://") => {}
            Some(_) => {
                return Err(err(
                    format!("{at}.backend"),
                    "must be simulator or an http(s):// URL",
                ));
            }
        }
        if b.weight > 100 {
            return Err(err(format!("{at}.weight"), "must be 0 to 100"));
        }
        if b.timeout_ms().is_none() {
            return Err(err(
                format!("{at}.timeout"),
                "must be a positive duration such as 500ms, 30s or 5m",
            ));
        }
    }
    if m.backends.iter().all(|b| b.weight == 0) {
        return Err(err(
            format!("models[{i}].backends"),
            "at least one backend needs a weight above 0",
        ));
    }
    if m.backends_need_upstream_filter() && m.upstream_cluster.is_none() {
        return Err(err(
            format!("models[{i}].upstreamCluster"),
            "required for a model whose backends have providers or a servedName of their own: the Envoy cluster of its backends, the only one whose upstream filter gives them their credentials and names",
        ));
    }
    Ok(())
}

/// A routed backend: its cluster named, and its provider checked as a model's own (it gets
/// everything a single provider does) in the model's API family. Its `timeout` is its own
/// routes' (the local stack's; an HTTPRoute rule's `timeouts`).
fn check_routed_backend(at: &str, m: &Model, b: &Backend) -> Result<(), PolicyError> {
    if let Some(c) = &b.upstream_cluster {
        check_name(format!("{at}.upstreamCluster"), c)?;
    }
    let variant = m.routed_variant(b);
    if let Some(p) = &variant.provider {
        // The served name is the backend's own, else the model's.
        let (i, _) = at.split_once(".backends").unwrap_or((at, ""));
        let served = match (&b.served_name, &m.served_name) {
            (Some(_), _) => format!("{at}.servedName"),
            (None, Some(_)) => format!("{i}.servedName"),
            (None, None) => format!("{i}.name"),
        };
        let paths = ProviderAt {
            provider: format!("{at}.provider"),
            served,
            api: format!("{i}.api"),
        };
        check_model_provider(&paths, &variant, p)?;
        // What the provider speaks without the model's `api`: Anthropic's Messages for
        // Anthropic and Claude on Vertex AI, else the OpenAI shape (Bedrock and Gemini are
        // translated from it).
        let speaks = Model {
            api: None,
            ..variant.clone()
        }
        .api_family();
        if speaks != m.api_family() {
            return Err(err(
                format!("{at}.provider"),
                format!(
                    "this provider speaks the {} API and the model's api is {}: every routed backend speaks the model's API",
                    speaks.as_str(),
                    m.api_family().as_str()
                ),
            ));
        }
    }
    Ok(())
}

/// Where a model's provider check names what it refuses: the provider, the model's id at the
/// publisher (its served name, else its name) and the model's API family.
struct ProviderAt {
    provider: String,
    served: String,
    api: String,
}

/// A model's provider, beside the model's other fields: its credential and fields, a publisher
/// model's id (one segment of the provider's path), and Gemini's API family.
fn check_model_provider(at: &ProviderAt, m: &Model, p: &Provider) -> Result<(), PolicyError> {
    check_credential_ref(format!("{}.credentialRef", at.provider), p)?;
    check_provider_fields(&at.provider, p)?;
    if p.publisher.is_some() {
        check_publisher_model(
            at.served.clone(),
            m.served_name.as_deref().unwrap_or(&m.name),
        )?;
    }
    if p.publisher == Some(VertexPublisher::Google) && m.api_family() != ApiFamily::Openai {
        return Err(err(
            at.api.clone(),
            "must be openai for Gemini on Vertex AI (publisher google): OpenAI chat is translated to generateContent",
        ));
    }
    Ok(())
}

/// A provider as one of several backends (issue 29): the gateway's upstream filter sets the
/// chosen backend's credential and path per upstream attempt, after Envoy picked the backend,
/// so only what needs nothing but headers is served there — the model's API family without
/// translation, a key or an access token in a header, the path as the client sent it or the
/// provider's own (an azure-openai deployment with its `apiVersion`, Vertex AI's
/// OpenAI-compatible endpoint of a project and location).
fn check_backend_provider(at: &str, m: &Model, p: &Provider) -> Result<(), PolicyError> {
    check_credential_ref(format!("{at}.credentialRef"), p)?;
    check_provider_fields(at, p)?;
    if p.path.is_some() {
        return Err(err(
            format!("{at}.path"),
            "not for a backend Envoy chooses (failover backends): its path is set per attempt from its provider's path scheme; routed backends (each its own upstreamCluster) take one",
        ));
    }
    if p.auth == ProviderAuth::AwsSigV4 || p.kind == ProviderKind::Bedrock {
        return Err(err(
            at.to_string(),
            "AWS Bedrock is not served as one of several backends: its requests are translated and signed (SigV4) over the body for one backend at admission, before Envoy picks the backend",
        ));
    }
    if p.publisher.is_some() {
        return Err(err(
            at.to_string(),
            "a vertex publisher model (Anthropic Messages at rawPredict) is not served as one of several backends: its requests are translated for one backend at admission, before Envoy picks the backend",
        ));
    }
    let family = if p.kind == ProviderKind::Anthropic {
        ApiFamily::Anthropic
    } else {
        ApiFamily::Openai
    };
    if family != m.api_family() {
        return Err(err(
            at.to_string(),
            format!(
                "this provider speaks the {} API and the model's api is {}: every backend of a model speaks the model's API (nothing is translated per backend)",
                family.as_str(),
                m.api_family().as_str()
            ),
        ));
    }
    Ok(())
}

/// A provider's `credentialRef`: a Secret name, or `namespace/name`.
fn check_credential_ref(at: String, p: &Provider) -> Result<(), PolicyError> {
    check_name(at.clone(), &p.credential_ref)?;
    if let (Some(ns), name) = p.secret()
        && (!is_dns_label(ns) || name.is_empty() || name.contains('/'))
    {
        return Err(err(
            at,
            "must be a Secret name, or namespace/name with a DNS-label namespace",
        ));
    }
    Ok(())
}

/// A model's catalogue entry, as the reference's `modelDetails` (from a MaaSModelRef's
/// annotations `openshift.io/display-name`, `openshift.io/description`,
/// `opendatahub.io/genai-use-case`, `opendatahub.io/context-window`,
/// `opendatahub.io/model-capabilities`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ModelDetails {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// e.g. `chat`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub genai_use_case: Option<String>,
    /// Tokens, as the reference writes it (a string: `"8192"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_window: Option<String>,
    /// e.g. `["text-generation", "chat"]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub capabilities: Vec<String>,
}

impl ModelDetails {
    /// Nothing to tell: left out of the listing.
    pub fn is_empty(&self) -> bool {
        *self == ModelDetails::default()
    }
}

/// Checks a model's details: text fields not blank, bounded, no control characters; the
/// context window a positive number of tokens.
fn check_model_details(at: &str, d: &ModelDetails) -> Result<(), PolicyError> {
    for (field, v) in [
        ("displayName", &d.display_name),
        ("description", &d.description),
        ("genaiUseCase", &d.genai_use_case),
    ] {
        if let Some(v) = v {
            check_text(format!("{at}.{field}"), v, false)?;
        }
    }
    if let Some(w) = &d.context_window
        && !w.parse::<u64>().is_ok_and(|n| n > 0)
    {
        return Err(err(
            format!("{at}.contextWindow"),
            "must be a positive number of tokens, e.g. \"8192\"",
        ));
    }
    for (i, c) in d.capabilities.iter().enumerate() {
        check_text(format!("{at}.capabilities[{i}]"), c, false)?;
    }
    Ok(())
}

/// Which API a model speaks (its default operations).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ApiFamily {
    Openai,
    Anthropic,
}

impl ApiFamily {
    pub fn as_str(&self) -> &'static str {
        match self {
            ApiFamily::Openai => "openai",
            ApiFamily::Anthropic => "anthropic",
        }
    }
}

/// One allowed operation: an HTTP method and a path relative to the model's prefix
/// (`/v1/chat/completions`; `*` = exactly one segment, e.g. `/v1/models/*`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OperationSpec {
    pub method: String,
    pub path: String,
}

impl Model {
    /// The context window in tokens (`details.contextWindow`, checked a positive integer),
    /// when declared.
    pub fn context_window_tokens(&self) -> Option<u64> {
        self.details
            .as_ref()?
            .context_window
            .as_deref()?
            .trim()
            .parse()
            .ok()
    }

    /// Prompt tokens reserved per media part ([`Model::media_tokens`]).
    pub fn media_tokens(&self) -> u64 {
        self.media_tokens.unwrap_or(DEFAULT_MEDIA_TOKENS)
    }

    /// Whether clients may name the model `id` (its name or one of its aliases; exact, case
    /// sensitive).
    pub fn answers_to(&self, id: &str) -> bool {
        self.name == id || self.aliases.iter().any(|a| a == id)
    }

    /// Every provider the model names: its own, or its backends'.
    pub fn providers(&self) -> impl Iterator<Item = &Provider> {
        self.provider
            .iter()
            .chain(self.backends.iter().filter_map(|b| b.provider.as_ref()))
    }

    /// The API family: `api` when given, else from the provider type.
    pub fn api_family(&self) -> ApiFamily {
        match (self.api, &self.provider) {
            (Some(api), _) => api,
            (None, Some(p)) if p.kind == ProviderKind::Anthropic => ApiFamily::Anthropic,
            (None, Some(p)) if p.publisher == Some(VertexPublisher::Anthropic) => {
                ApiFamily::Anthropic
            }
            _ => ApiFamily::Openai,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Provider {
    #[serde(rename = "type")]
    pub kind: ProviderKind,
    /// The Secret (key `api-key`) holding the provider credential: `name` (in the companion's
    /// credentials namespace; the local stack: an entry of its credentials file) or
    /// `namespace/name` (models from the reference's ExternalModels: always their own
    /// namespace's). The filter looks the credential up by this string as it is.
    pub credential_ref: String,
    /// How the gateway authenticates to the provider (default `apiKey`): `apiKey` (the Secret's
    /// `api-key`, sent as the provider's key header), `gcpServiceAccount` (vertex: the Secret's
    /// `service-account.json`, a Google service-account key the companion exchanges for
    /// short-lived OAuth access tokens), `azureClientCredentials` (azure-openai: the Secret's
    /// `tenant-id`, `client-id` and `client-secret`, exchanged at Microsoft Entra for access
    /// tokens). The filter only ever gets the key or the current access token.
    #[serde(default, skip_serializing_if = "ProviderAuth::is_api_key")]
    pub auth: ProviderAuth,
    /// azure-openai: the deployment requests go to. When set, the gateway rewrites the
    /// OpenAI-shaped path the client calls (`/v1/chat/completions`, `/v1/completions`,
    /// `/v1/embeddings`) to `/openai/deployments/{deployment}/…?api-version={apiVersion}`; when
    /// left out the path goes as the client sent it (the backend URL then names the deployment).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deployment: Option<String>,
    /// azure-openai with a `deployment`: the `api-version` query parameter
    /// (default [`AZURE_DEFAULT_API_VERSION`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    /// vertex: the Google Cloud project. With `location`, the gateway rewrites
    /// `/v1/chat/completions` to Vertex AI's OpenAI-compatible endpoint
    /// `/v1/projects/{project}/locations/{location}/endpoints/openapi/chat/completions`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
    /// vertex: the region (e.g. `us-central1`, or `global`); required with `project`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<String>,
    /// vertex, with project and location: the model is a model of this publisher, called at
    /// its own endpoint in its own API (`anthropic`: Claude on Vertex AI, Anthropic Messages at
    /// `…/publishers/anthropic/models/{model}:rawPredict` or `:streamRawPredict`; `google`:
    /// Gemini at `…/publishers/google/models/{model}:generateContent` or
    /// `:streamGenerateContent?alt=sse`, OpenAI chat translated; the model's `servedName` else
    /// its name in the path). The model's API family follows (anthropic; openai for google).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publisher: Option<VertexPublisher>,
    /// bedrock: the AWS region (e.g. `us-east-1`), required. Requests go to
    /// `bedrock-runtime.{region}.amazonaws.com` at `/model/{modelId}/converse[-stream]`, signed
    /// with SigV4 for this region and the service `bedrock`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    /// The path the provider serves the model's chat at (e.g. `/openai/v1/chat/completions`,
    /// `/gateway/v1/messages`): OpenAI chat completions for a model of api openai, Anthropic
    /// Messages for api anthropic (an OpenAI chat request translated to Messages too) — what
    /// the reference's binding `path` sets. Replaces the provider's path scheme for them; other
    /// operations keep theirs. Not for bedrock or a vertex publisher (their path is signed or
    /// chosen by stream), nor for a backend Envoy chooses (failover backends).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

/// A Vertex AI partner-model publisher the gateway speaks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VertexPublisher {
    /// Anthropic's Claude models: Anthropic Messages, `anthropic_version` in the body.
    Anthropic,
    /// Google's Gemini models, in Vertex AI's own API: `generateContent`, and
    /// `streamGenerateContent?alt=sse` for a stream; an OpenAI chat client's requests and
    /// answers are translated.
    Google,
}

impl VertexPublisher {
    pub fn as_str(&self) -> &'static str {
        match self {
            VertexPublisher::Anthropic => "anthropic",
            VertexPublisher::Google => "google",
        }
    }
}

/// The `anthropic_version` Vertex AI requires in the body of Claude requests.
pub const VERTEX_ANTHROPIC_VERSION: &str = "vertex-2023-10-16";

/// The `api-version` an Azure OpenAI deployment is called with when the policy names none
/// (the latest generally available data-plane inference version).
pub const AZURE_DEFAULT_API_VERSION: &str = "2024-10-21";

/// How the gateway authenticates to a provider ([`Provider::auth`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ProviderAuth {
    /// A static key from the Secret's `api-key`.
    #[default]
    ApiKey,
    /// A Google service-account key → short-lived OAuth access tokens (vertex).
    GcpServiceAccount,
    /// Microsoft Entra client credentials → short-lived access tokens (azure-openai).
    AzureClientCredentials,
    /// An AWS access key → a SigV4 signing key derived per UTC day (bedrock); the filter signs
    /// each request with it.
    #[serde(rename = "awsSigV4")]
    AwsSigV4,
}

impl ProviderAuth {
    pub fn is_api_key(&self) -> bool {
        *self == ProviderAuth::ApiKey
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            ProviderAuth::ApiKey => "apiKey",
            ProviderAuth::GcpServiceAccount => "gcpServiceAccount",
            ProviderAuth::AzureClientCredentials => "azureClientCredentials",
            ProviderAuth::AwsSigV4 => "awsSigV4",
        }
    }

    /// The credential is a short-lived bearer token (sent as `Authorization: Bearer`).
    pub fn is_token(&self) -> bool {
        matches!(
            self,
            ProviderAuth::GcpServiceAccount | ProviderAuth::AzureClientCredentials
        )
    }
}

/// Where a provider's requests go instead of the OpenAI path the client called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProviderPath<'a> {
    /// `/openai/deployments/{deployment}/…?api-version={api_version}`
    AzureDeployment {
        deployment: &'a str,
        api_version: &'a str,
    },
    /// `/v1/projects/{project}/locations/{location}/endpoints/openapi/…`
    VertexOpenapi { project: &'a str, location: &'a str },
    /// `/v1/projects/{project}/locations/{location}/publishers/{publisher}/models/{model}:…`
    VertexPublisher {
        project: &'a str,
        location: &'a str,
        publisher: VertexPublisher,
    },
    /// `/model/{modelId}/converse[-stream]` at `bedrock-runtime.{region}.amazonaws.com`.
    Bedrock { region: &'a str },
}

impl Provider {
    /// A provider called with a static key, at the path the client sent.
    pub fn api_key(kind: ProviderKind, credential_ref: String) -> Provider {
        Provider {
            kind,
            credential_ref,
            auth: ProviderAuth::ApiKey,
            deployment: None,
            api_version: None,
            project: None,
            location: None,
            publisher: None,
            region: None,
            path: None,
        }
    }

    /// The provider's own path scheme, when the policy gives one (else the path goes as sent).
    pub fn path(&self) -> Option<ProviderPath<'_>> {
        match (self.kind, &self.deployment, &self.project, &self.location) {
            (ProviderKind::AzureOpenai, Some(deployment), _, _) => {
                Some(ProviderPath::AzureDeployment {
                    deployment,
                    api_version: self
                        .api_version
                        .as_deref()
                        .unwrap_or(AZURE_DEFAULT_API_VERSION),
                })
            }
            (ProviderKind::Vertex, _, Some(project), Some(location)) => {
                Some(match self.publisher {
                    Some(publisher) => ProviderPath::VertexPublisher {
                        project,
                        location,
                        publisher,
                    },
                    None => ProviderPath::VertexOpenapi { project, location },
                })
            }
            (ProviderKind::Bedrock, ..) => self
                .region
                .as_deref()
                .map(|region| ProviderPath::Bedrock { region }),
            _ => None,
        }
    }
}

impl Provider {
    /// The credential's Secret: `(namespace, name)`, the namespace `None` for a bare name.
    pub fn secret(&self) -> (Option<&str>, &str) {
        split_credential_ref(&self.credential_ref)
    }
}

/// `namespace/name` → `(Some(namespace), name)`; `name` → `(None, name)`.
pub fn split_credential_ref(r: &str) -> (Option<&str>, &str) {
    match r.split_once('/') {
        Some((ns, name)) => (Some(ns), name),
        None => (None, r),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProviderKind {
    Openai,
    Anthropic,
    AzureOpenai,
    Vertex,
    /// AWS Bedrock (the Converse API), behind the OpenAI chat shape.
    Bedrock,
}

impl ProviderKind {
    pub fn as_str(&self) -> &'static str {
        match self {
            ProviderKind::Openai => "openai",
            ProviderKind::Anthropic => "anthropic",
            ProviderKind::AzureOpenai => "azure-openai",
            ProviderKind::Vertex => "vertex",
            ProviderKind::Bedrock => "bedrock",
        }
    }
}

/// A path segment the gateway puts in a provider's path (deployment, project, location,
/// api-version): letters, digits, `.`, `_`, `-`, at most 64 — nothing a URL would read as
/// structure (`/`, `?`, `#`, `%`, `..`).
fn check_path_segment(at: String, v: &str) -> Result<(), PolicyError> {
    let ok = !v.is_empty()
        && v.len() <= 64
        && v != "."
        && v != ".."
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(err(
            at,
            "must be 1 to 64 letters, digits, '.', '_' or '-' (it becomes one segment of the provider's path)",
        ))
    }
}

/// A partner model's id in a Vertex AI path (`claude-sonnet-4@20250514`): a path segment that
/// may also hold `@` (Vertex's version separator), and no `:` (the method's separator).
fn check_publisher_model(at: String, v: &str) -> Result<(), PolicyError> {
    let ok = !v.is_empty()
        && v.len() <= 128
        && v != "."
        && v != ".."
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'@'));
    if ok {
        Ok(())
    } else {
        Err(err(
            at,
            "must be 1 to 128 letters, digits, '.', '_', '-' or '@' for a vertex publisher model (it becomes one segment of the provider's path; set servedName to the publisher's model id)",
        ))
    }
}

/// A provider's path fields and auth belong to its type, and come in the sets they are used in.
/// A provider's own chat path ([`Provider::path`]): absolute, at most 512 bytes of visible
/// ASCII (a query allowed), no placeholder left (`{`, `}`), no fragment, no dot segment; not
/// where the path is signed or chosen by stream.
fn check_provider_path(at: &str, p: &Provider, path: &str) -> Result<(), PolicyError> {
    if p.kind == ProviderKind::Bedrock || p.publisher.is_some() {
        return Err(err(
            at.to_string(),
            "not for bedrock or a vertex publisher: their path is signed or chosen by stream",
        ));
    }
    let (route, _query) = path.split_once('?').unwrap_or((path, ""));
    let ok = path.starts_with('/')
        && path.len() <= 512
        && path
            .bytes()
            .all(|b| (0x21..=0x7e).contains(&b) && !b"{}#".contains(&b))
        && !route.split('/').any(|seg| seg == "." || seg == "..");
    if !ok {
        return Err(err(
            at.to_string(),
            "must be an absolute path of at most 512 visible ASCII characters (a query allowed), with no placeholder, fragment or dot segment",
        ));
    }
    Ok(())
}

fn check_provider_fields(at: &str, p: &Provider) -> Result<(), PolicyError> {
    let only_for = |field: &str, kind: &str| {
        err(
            format!("{at}.{field}"),
            format!("only for a provider of type {kind}"),
        )
    };
    let azure = p.kind == ProviderKind::AzureOpenai;
    let vertex = p.kind == ProviderKind::Vertex;
    let bedrock = p.kind == ProviderKind::Bedrock;
    for (field, value, allowed, kind) in [
        ("deployment", &p.deployment, azure, "azure-openai"),
        ("apiVersion", &p.api_version, azure, "azure-openai"),
        ("project", &p.project, vertex, "vertex"),
        ("location", &p.location, vertex, "vertex"),
        ("region", &p.region, bedrock, "bedrock"),
    ] {
        if let Some(v) = value {
            if !allowed {
                return Err(only_for(field, kind));
            }
            check_path_segment(format!("{at}.{field}"), v)?;
        }
    }
    if p.api_version.is_some() && p.deployment.is_none() {
        return Err(err(
            format!("{at}.apiVersion"),
            "needs a deployment (the api-version is sent with the deployment's path)",
        ));
    }
    if p.publisher.is_some() {
        if !vertex {
            return Err(only_for("publisher", "vertex"));
        }
        if p.project.is_none() {
            return Err(err(
                format!("{at}.project"),
                "required with publisher: the partner model's path names the project and location",
            ));
        }
    }
    if let Some(path) = &p.path {
        check_provider_path(&format!("{at}.path"), p, path)?;
    }
    if p.project.is_some() != p.location.is_some() {
        let missing = if p.project.is_none() {
            "project"
        } else {
            "location"
        };
        return Err(err(
            format!("{at}.{missing}"),
            "required: vertex's path needs both project and location",
        ));
    }
    if bedrock {
        if p.auth != ProviderAuth::AwsSigV4 {
            return Err(err(
                format!("{at}.auth"),
                "must be awsSigV4: bedrock requests are signed with SigV4",
            ));
        }
        match &p.region {
            None => {
                return Err(err(
                    format!("{at}.region"),
                    "required: the AWS region bedrock requests go to and are signed for",
                ));
            }
            Some(r) if !is_aws_region(r) => {
                return Err(err(
                    format!("{at}.region"),
                    "must be an AWS region: lower-case letters, digits and '-' (e.g. us-east-1)",
                ));
            }
            Some(_) => {}
        }
    }
    match p.auth {
        ProviderAuth::GcpServiceAccount if !vertex => Err(only_for("auth", "vertex")),
        ProviderAuth::AzureClientCredentials if !azure => Err(only_for("auth", "azure-openai")),
        ProviderAuth::AwsSigV4 if !bedrock => Err(only_for("auth", "bedrock")),
        _ => Ok(()),
    }
}

/// An AWS region name as it goes into a host name and a SigV4 scope: `us-east-1`,
/// `us-gov-west-1`, `ap-southeast-2` — lower-case letters, digits and inner `-`.
pub fn is_aws_region(r: &str) -> bool {
    (2..=32).contains(&r.len())
        && r.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !r.starts_with('-')
        && !r.ends_with('-')
        && r.contains('-')
}

/// A refused document: where (`path`, e.g. `tiers[0].limits.tokens[1].window`) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError {
    pub path: String,
    pub message: String,
}

impl std::fmt::Display for PolicyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.path.is_empty() || self.path == "." {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

impl std::error::Error for PolicyError {}

fn err(path: impl Into<String>, message: impl Into<String>) -> PolicyError {
    PolicyError {
        path: path.into(),
        message: message.into(),
    }
}

/// Deserializes with the failing field's path in the error.
pub fn from_deserializer<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<PolicyDocument, PolicyError>
where
    D::Error: std::fmt::Display,
{
    let doc: PolicyDocument = serde_path_to_error::deserialize(d).map_err(|e| {
        let path = e.path().to_string();
        err(path, e.inner().to_string())
    })?;
    doc.validate()?;
    let mut doc = doc;
    doc.build_backend_variants();
    Ok(doc)
}

const MAX_NAME_LEN: usize = 253;

fn check_name(path: String, name: &str) -> Result<(), PolicyError> {
    if name.trim().is_empty() {
        return Err(err(path, "must not be empty"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(err(
            path,
            format!("must be at most {MAX_NAME_LEN} characters"),
        ));
    }
    if name.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(err(
            path,
            "must not contain whitespace or control characters",
        ));
    }
    Ok(())
}

fn check_limits(path: &str, limits: &[Limit], max: Option<u64>) -> Result<(), PolicyError> {
    let mut windows = BTreeSet::new();
    for (i, l) in limits.iter().enumerate() {
        if l.limit == 0 {
            return Err(err(format!("{path}[{i}].limit"), "must be at least 1"));
        }
        if let Some(max) = max
            && l.limit > max
        {
            return Err(err(
                format!("{path}[{i}].limit"),
                format!("must be at most {max}"),
            ));
        }
        // One enforced and one shadow limit per window at most (a shadow one tries a new value).
        if !windows.insert((l.window, l.shadow)) {
            return Err(err(
                format!("{path}[{i}].window"),
                format!(
                    "window {} is listed twice{}",
                    l.window,
                    if l.shadow { " as a shadow limit" } else { "" }
                ),
            ));
        }
    }
    Ok(())
}

/// Money budgets (at `path`): each more than 0, one enforced and one shadow per window.
fn check_budgets(path: &str, budgets: &[crate::money::Budget]) -> Result<(), PolicyError> {
    for (i, b) in budgets.iter().enumerate() {
        if b.amount.nanos() == 0 {
            return Err(err(format!("{path}[{i}].amount"), "must be more than 0"));
        }
    }
    let limits: Vec<Limit> = budgets.iter().map(crate::money::Budget::as_limit).collect();
    check_limits(path, &limits, None)
}

/// Checks a model id (a name, an alias or a served name): what a JSON body's `model` can carry
/// and a header can hold — not blank, no control characters, at most [`MAX_NAME_LEN`] bytes.
fn check_model_id(path: String, id: &str) -> Result<(), PolicyError> {
    if id.trim().is_empty() || id.chars().any(|c| c.is_control()) {
        return Err(err(path, "must not be empty or hold control characters"));
    }
    if id.len() > MAX_NAME_LEN {
        return Err(err(path, format!("must be at most {MAX_NAME_LEN} bytes")));
    }
    Ok(())
}

/// The served base URL: `http(s)://` and a host, no trailing `/`, no whitespace, control
/// character, query or fragment (what the companion's `--public-url` check lets through).
fn check_public_url(url: &str) -> Result<(), PolicyError> {
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"));
    let ok = rest.is_some_and(|r| !r.is_empty() && !r.starts_with('/'))
        && url.len() <= 2048
        && !url.ends_with('/')
        && !url
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '?' || c == '#');
    if ok {
        Ok(())
    } else {
        Err(err(
            "publicUrl",
            "must be an http:// or https:// base URL with a host, without a trailing /, query or fragment",
        ))
    }
}

/// Every model's name and aliases name one model only: a body's `model` finds one model.
fn check_model_ids_unique(models: &[Model]) -> Result<(), PolicyError> {
    let names: BTreeSet<&str> = models.iter().map(|m| m.name.as_str()).collect();
    let mut aliases: std::collections::BTreeMap<&str, &str> = std::collections::BTreeMap::new();
    for (i, m) in models.iter().enumerate() {
        for (j, alias) in m.aliases.iter().enumerate() {
            let taken = if names.contains(alias.as_str()) {
                Some(format!("{alias:?} is already the name of a model"))
            } else {
                aliases
                    .insert(alias.as_str(), m.name.as_str())
                    .map(|other| format!("{alias:?} is already an alias of model {other:?}"))
            };
            if let Some(message) = taken {
                return Err(err(format!("models[{i}].aliases[{j}]"), message));
            }
        }
    }
    Ok(())
}

/// The path prefix of the one base URL (`/v1/chat/completions`, `/v1/messages`, `/v1/models`…):
/// no model path may lie under it.
pub const ONE_BASE_PATH: &str = "/v1";

/// The request header the gateway's filter sets to the model's name at the one base URL, and
/// that the gateway's routes for it match (the local Envoy's, the cluster's HTTPRoutes): in the
/// reserved `x-maas-*` namespace, so a client's own copy is removed and never routes anything.
pub const MODEL_ROUTING_HEADER: &str = "x-maas-model";

/// The response header a model's route adds for a model with [`Model::backends`]: the name of
/// the backend that answered (Envoy's `%UPSTREAM_METADATA(maas:backend)%`, the endpoint's
/// metadata), replacing any copy the upstream sent. The filter reads it for the usage ledger
/// (only a name among the model's backends) and removes it before the client.
pub const SERVED_BY_HEADER: &str = "x-maas-served-by";

/// The request header the gateway's filter sets, beside [`MODEL_ROUTING_HEADER`], to the name
/// of the routed backend ([`Backend::upstream_cluster`]) it drew for the request: the gateway's
/// route for that backend matches both. Reserved like the other: a client's copy is removed.
pub const BACKEND_ROUTING_HEADER: &str = "x-maas-backend";

/// Request header the filter sets for a model whose backends have providers: the endpoints
/// (`ip:port`) of the backends whose credential it holds, in the order Envoy should try them
/// (the backends cluster's `envoy.load_balancing_policies.override_host` reads it; a retry takes
/// the next). The upstream filter removes it before the backend.
pub const BACKEND_ORDER_HEADER: &str = "x-maas-endpoints";

/// Checks a model path prefix: absolute, normalized, no trailing slash, no encoded or dot segments.
fn check_model_path(path: String, p: &str) -> Result<(), PolicyError> {
    if !p.starts_with('/') || p.len() < 2 {
        return Err(err(
            path,
            "must start with '/' and name at least one segment, e.g. /llm/my-model",
        ));
    }
    if p.ends_with('/') {
        return Err(err(path, "must not end with '/'"));
    }
    for seg in p[1..].split('/') {
        if seg.is_empty() || seg == "." || seg == ".." {
            return Err(err(path, "must not contain empty, '.' or '..' segments"));
        }
        if !seg
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        {
            return Err(err(
                path,
                "segments may use only letters, digits, '-', '_' and '.'",
            ));
        }
    }
    let lower = p.to_ascii_lowercase();
    if lower == ONE_BASE_PATH || lower.starts_with("/v1/") {
        return Err(err(
            path,
            "must not be /v1 or under it: the gateway's one base URL serves /v1/… for every model",
        ));
    }
    if lower == "/maas-api"
        || lower.starts_with("/maas-api/")
        || lower == "/internal"
        || lower.starts_with("/internal/")
    {
        return Err(err(path, "must not be under /maas-api or /internal"));
    }
    Ok(())
}

/// Checks an operation: an upper-case method token and a relative path of clean segments
/// (`*` alone = any one segment).
fn check_operation(path: &str, op: &OperationSpec) -> Result<(), PolicyError> {
    if op.method.is_empty()
        || op.method.len() > 32
        || !op.method.bytes().all(|b| b.is_ascii_uppercase())
    {
        return Err(err(
            format!("{path}.method"),
            "must be an upper-case HTTP method, e.g. POST",
        ));
    }
    let p = op.path.as_str();
    if !p.starts_with('/') || p.len() < 2 || p.ends_with('/') {
        return Err(err(
            format!("{path}.path"),
            "must start with '/', not end with '/', and name at least one segment, e.g. /v1/chat/completions",
        ));
    }
    if p.len() > 512 {
        return Err(err(
            format!("{path}.path"),
            "must be at most 512 characters",
        ));
    }
    for seg in p[1..].split('/') {
        if seg == "*" {
            continue;
        }
        if seg.is_empty() || seg == "." || seg == ".." {
            return Err(err(
                format!("{path}.path"),
                "must not contain empty, '.' or '..' segments",
            ));
        }
        if !seg
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
        {
            return Err(err(
                format!("{path}.path"),
                "segments may use only letters, digits, '-', '_', '.', ':' or be '*'",
            ));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Subscriptions: their schema and validation, part of the document's (the decisions over them,
// selection and counters, are `crate::subscription`, above this module)
// ---------------------------------------------------------------------------------------------

/// Longest subscription name and namespace (a DNS label).
pub const MAX_DNS_LABEL_LEN: usize = 63;
/// Largest token limit of a subscription (the reference's CRD bound).
pub const MAX_TOKEN_LIMIT: u64 = 1_000_000_000;
/// Longest display name, description or label value of a subscription.
const MAX_TEXT_LEN: usize = 1024;
/// Most `tokenMetadata.labels` of a subscription.
const MAX_LABELS: usize = 64;

/// A subscription (the reference's `MaaSSubscription`): who may use which models with which
/// token budgets; selection is in [`crate::subscription`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Subscription {
    /// Unique in the document; `[a-z0-9-]`, at most 63, starts and ends with a letter or digit.
    pub name: String,
    /// Default [`crate::subscription::DEFAULT_NAMESPACE`]; only used to match `namespace/name` requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Higher wins when a key is minted without naming a subscription.
    #[serde(default)]
    pub priority: i32,
    pub owner: Owner,
    pub models: Vec<SubscriptionModel>,
    #[serde(default, skip_serializing_if = "TokenMetadata::is_empty")]
    pub token_metadata: TokenMetadata,
    /// As a tier's `defaultMaxTokens`, for requests under this subscription.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_max_tokens: Option<u64>,
    /// As a tier's `uncappedRequests`, for requests under this subscription.
    #[serde(default, skip_serializing_if = "UncappedRequests::is_default")]
    pub uncapped_requests: UncappedRequests,
    /// As a tier's `warnAt`, for the windows of this subscription.
    #[serde(
        default = "default_warn_at",
        skip_serializing_if = "is_default_warn_at"
    )]
    pub warn_at: Vec<u8>,
    /// Ours (issue 30): the limits and budgets of each model are one pool shared by every user
    /// of the subscription; by default each user has their own, as the reference counts them.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pool: bool,
}

/// Who has the subscription: any listed user, or any member of a listed group.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Owner {
    #[serde(default)]
    pub groups: Vec<String>,
    #[serde(default)]
    pub users: Vec<String>,
}

/// A model of a subscription and its limits (per subject, per subscription, per model).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SubscriptionModel {
    /// A `models[].name` of the document.
    pub name: String,
    /// At least one (as the reference's CRD requires: no silent default).
    pub token_rate_limits: Vec<Limit>,
    /// Ours (the reference meters tokens only); optional.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub request_rate_limits: Vec<Limit>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub billing_rate: Option<BillingRate>,
    /// Ours: how input and output tokens count against `tokenRateLimits` (default 1 and 1).
    #[serde(default, skip_serializing_if = "TokenWeights::is_default")]
    pub token_weights: TokenWeights,
    /// Ours (issue 30): money per window for each user of the subscription on this model.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub budgets: Vec<crate::money::Budget>,
    /// Ours: prices that replace the model's `pricing` under this subscription.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pricing: Option<crate::money::Pricing>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BillingRate {
    /// A non-negative decimal string, e.g. `"0.000002"` (kept as text: no float rounding).
    pub per_token: String,
}

/// Attribution carried with the usage of the subscription.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TokenMetadata {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub organization_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_center: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

impl TokenMetadata {
    pub fn is_empty(&self) -> bool {
        self.organization_id.is_none() && self.cost_center.is_none() && self.labels.is_empty()
    }
}

/// `[a-z0-9-]`, 1..=63, starting and ending with a letter or digit (a DNS label).
pub fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_DNS_LABEL_LEN
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b.first().is_some_and(u8::is_ascii_alphanumeric)
        && b.last().is_some_and(u8::is_ascii_alphanumeric)
}

fn check_label_name(path: String, s: &str) -> Result<(), PolicyError> {
    if is_dns_label(s) {
        Ok(())
    } else {
        Err(err(
            path,
            format!(
                "must be 1 to {MAX_DNS_LABEL_LEN} of a-z, 0-9 and '-', starting and ending with a letter or digit"
            ),
        ))
    }
}

fn check_text(path: String, s: &str, blank_ok: bool) -> Result<(), PolicyError> {
    if !blank_ok && s.trim().is_empty() {
        return Err(err(path, "must not be blank when given"));
    }
    if s.chars().count() > MAX_TEXT_LEN {
        return Err(err(
            path,
            format!("must be at most {MAX_TEXT_LEN} characters"),
        ));
    }
    if s.chars().any(|c| c.is_control() && c != '\n' && c != '\t') {
        return Err(err(path, "must not contain control characters"));
    }
    Ok(())
}

fn check_subject(path: String, s: &str) -> Result<(), PolicyError> {
    if s.trim().is_empty()
        || s.len() > 253
        || s.chars().any(|c| c.is_control() || c.is_whitespace())
    {
        return Err(err(
            path,
            "must be 1 to 253 characters without whitespace or control characters",
        ));
    }
    Ok(())
}

/// A non-negative decimal: digits, optionally `.` and digits.
pub fn is_decimal(s: &str) -> bool {
    let (int, frac) = match s.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (s, None),
    };
    !int.is_empty()
        && int.len() <= 20
        && int.bytes().all(|b| b.is_ascii_digit())
        && frac
            .is_none_or(|f| !f.is_empty() && f.len() <= 20 && f.bytes().all(|b| b.is_ascii_digit()))
}

/// Checks `subscriptions` against the rest of the document (called by
/// [`PolicyDocument::validate`]).
fn validate_subscriptions(doc: &PolicyDocument) -> Result<(), PolicyError> {
    let mut names = BTreeSet::new();
    for (i, s) in doc.subscriptions.iter().enumerate() {
        let at = format!("subscriptions[{i}]");
        check_label_name(format!("{at}.name"), &s.name)?;
        if !names.insert(s.name.as_str()) {
            return Err(err(
                format!("{at}.name"),
                format!("subscription {:?} is defined twice", s.name),
            ));
        }
        if let Some(ns) = &s.namespace {
            check_label_name(format!("{at}.namespace"), ns)?;
        }
        if let Some(d) = &s.display_name {
            check_text(format!("{at}.displayName"), d, false)?;
        }
        if let Some(d) = &s.description {
            check_text(format!("{at}.description"), d, true)?;
        }
        check_warn_at(&format!("{at}.warnAt"), &s.warn_at)?;
        if s.owner.groups.is_empty() && s.owner.users.is_empty() {
            return Err(err(
                format!("{at}.owner"),
                "at least one group or user is required",
            ));
        }
        for (g, group) in s.owner.groups.iter().enumerate() {
            check_subject(format!("{at}.owner.groups[{g}]"), group)?;
        }
        for (u, user) in s.owner.users.iter().enumerate() {
            check_subject(format!("{at}.owner.users[{u}]"), user)?;
        }
        if s.models.is_empty() {
            return Err(err(
                format!("{at}.models"),
                "at least one model is required",
            ));
        }
        let mut models = BTreeSet::new();
        for (m, model) in s.models.iter().enumerate() {
            let mat = format!("{at}.models[{m}]");
            if doc.model(&model.name).is_none() {
                return Err(err(
                    format!("{mat}.name"),
                    format!("unknown model {:?}", model.name),
                ));
            }
            if !models.insert(model.name.as_str()) {
                return Err(err(
                    format!("{mat}.name"),
                    format!("model {:?} is listed twice", model.name),
                ));
            }
            if model.token_rate_limits.is_empty() {
                return Err(err(
                    format!("{mat}.tokenRateLimits"),
                    "at least one token limit is required",
                ));
            }
            check_limits(
                &format!("{mat}.tokenRateLimits"),
                &model.token_rate_limits,
                Some(MAX_TOKEN_LIMIT),
            )?;
            check_limits(
                &format!("{mat}.requestRateLimits"),
                &model.request_rate_limits,
                None,
            )?;
            check_token_weights(&format!("{mat}.tokenWeights"), &model.token_weights)?;
            check_budgets(&format!("{mat}.budgets"), &model.budgets)?;
            if let Some(rate) = &model.billing_rate
                && !is_decimal(&rate.per_token)
            {
                return Err(err(
                    format!("{mat}.billingRate.perToken"),
                    "must be a non-negative decimal string, e.g. \"0.000002\"",
                ));
            }
        }
        if s.default_max_tokens == Some(0) {
            return Err(err(format!("{at}.defaultMaxTokens"), "must be at least 1"));
        }
        check_token_metadata(&at, &s.token_metadata)?;
    }
    Ok(())
}

/// A subscription's `tokenMetadata` (at `at`): texts, at most [`MAX_LABELS`] labels.
fn check_token_metadata(at: &str, meta: &TokenMetadata) -> Result<(), PolicyError> {
    if let Some(o) = &meta.organization_id {
        check_text(format!("{at}.tokenMetadata.organizationId"), o, false)?;
    }
    if let Some(c) = &meta.cost_center {
        check_text(format!("{at}.tokenMetadata.costCenter"), c, false)?;
    }
    if meta.labels.len() > MAX_LABELS {
        return Err(err(
            format!("{at}.tokenMetadata.labels"),
            format!("at most {MAX_LABELS} labels"),
        ));
    }
    for (k, v) in &meta.labels {
        check_subject(format!("{at}.tokenMetadata.labels.{k}"), k)?;
        check_text(format!("{at}.tokenMetadata.labels.{k}"), v, true)?;
    }
    Ok(())
}

impl PolicyDocument {
    /// Parses JSON and validates; the error names the field.
    pub fn from_json(bytes: &[u8]) -> Result<Self, PolicyError> {
        let mut de = serde_json::Deserializer::from_slice(bytes);
        let doc = from_deserializer(&mut de)?;
        de.end().map_err(|e| err("", e.to_string()))?;
        Ok(doc)
    }

    /// Parses an already-decoded JSON value (e.g. pluginConfig's `bootstrapPolicy`) and validates.
    pub fn from_value(value: serde_json::Value) -> Result<Self, PolicyError> {
        from_deserializer(value)
    }

    /// Checks what serde cannot: references, uniqueness, non-empty names, sane paths and limits.
    pub fn validate(&self) -> Result<(), PolicyError> {
        let tier_names = self.validate_tiers()?;
        self.validate_models(&tier_names)?;
        check_model_ids_unique(&self.models)?;
        validate_subscriptions(self)?;
        scope::validate_scopes(self)?;
        for (i, id) in self.revoked_key_ids.iter().enumerate() {
            if !crate::apikey::is_key_id(id) {
                return Err(err(format!("revokedKeyIds[{i}]"), "not a key id"));
            }
        }
        if let Some(url) = &self.public_url {
            check_public_url(url)?;
        }
        Ok(())
    }

    /// At least one tier, each named once, with sane groups, limits and weights: their names.
    fn validate_tiers(&self) -> Result<BTreeSet<&str>, PolicyError> {
        if self.tiers.is_empty() {
            return Err(err("tiers", "at least one tier is required"));
        }
        let mut tier_names = BTreeSet::new();
        for (i, t) in self.tiers.iter().enumerate() {
            check_name(format!("tiers[{i}].name"), &t.name)?;
            if !tier_names.insert(t.name.as_str()) {
                return Err(err(
                    format!("tiers[{i}].name"),
                    format!("tier {:?} is defined twice", t.name),
                ));
            }
            if let Some(d) = &t.display_name
                && d.trim().is_empty()
            {
                return Err(err(
                    format!("tiers[{i}].displayName"),
                    "must not be blank when given",
                ));
            }
            if t.groups.is_empty() {
                return Err(err(
                    format!("tiers[{i}].groups"),
                    "at least one group is required",
                ));
            }
            for (g, group) in t.groups.iter().enumerate() {
                check_name(format!("tiers[{i}].groups[{g}]"), group)?;
            }
            check_limits(
                &format!("tiers[{i}].limits.requests"),
                &t.limits.requests,
                None,
            )?;
            check_limits(&format!("tiers[{i}].limits.tokens"), &t.limits.tokens, None)?;
            check_budgets(&format!("tiers[{i}].limits.budgets"), &t.limits.budgets)?;
            for name in t.prices.keys() {
                if !self.models.iter().any(|m| &m.name == name) {
                    return Err(err(
                        format!("tiers[{i}].prices.{name}"),
                        "not a model of the document",
                    ));
                }
            }
            if t.default_max_tokens == Some(0) {
                return Err(err(
                    format!("tiers[{i}].defaultMaxTokens"),
                    "must be at least 1",
                ));
            }
            check_token_weights(&format!("tiers[{i}].tokenWeights"), &t.token_weights)?;
            check_warn_at(&format!("tiers[{i}].warnAt"), &t.warn_at)?;
        }
        Ok(tier_names)
    }

    /// Each model named and routed once, on known tiers, with its provider, cluster and
    /// operations checked.
    fn validate_models(&self, tier_names: &BTreeSet<&str>) -> Result<(), PolicyError> {
        let mut model_names = BTreeSet::new();
        let mut model_paths = BTreeSet::new();
        for (i, m) in self.models.iter().enumerate() {
            check_model_id(format!("models[{i}].name"), &m.name)?;
            if !model_names.insert(m.name.as_str()) {
                return Err(err(
                    format!("models[{i}].name"),
                    format!("model {:?} is defined twice", m.name),
                ));
            }
            for (j, alias) in m.aliases.iter().enumerate() {
                check_model_id(format!("models[{i}].aliases[{j}]"), alias)?;
            }
            if let Some(served) = &m.served_name {
                check_model_id(format!("models[{i}].servedName"), served)?;
            }
            if let Some(d) = &m.details {
                check_model_details(&format!("models[{i}].details"), d)?;
            }
            check_model_path(format!("models[{i}].path"), &m.path)?;
            if !model_paths.insert(m.path.to_ascii_lowercase()) {
                return Err(err(
                    format!("models[{i}].path"),
                    format!("path {:?} is used twice", m.path),
                ));
            }
            if m.tiers.is_empty() {
                return Err(err(
                    format!("models[{i}].tiers"),
                    "at least one tier is required",
                ));
            }
            for (j, t) in m.tiers.iter().enumerate() {
                if !tier_names.contains(t.as_str()) {
                    return Err(err(
                        format!("models[{i}].tiers[{j}]"),
                        format!("unknown tier {t:?}"),
                    ));
                }
            }
            check_backends(i, m)?;
            if let Some(p) = &m.provider {
                let served = if m.served_name.is_some() {
                    "servedName"
                } else {
                    "name"
                };
                let paths = ProviderAt {
                    provider: format!("models[{i}].provider"),
                    served: format!("models[{i}].{served}"),
                    api: format!("models[{i}].api"),
                };
                check_model_provider(&paths, m, p)?;
                if m.upstream_cluster.is_none() {
                    return Err(err(
                        format!("models[{i}].upstreamCluster"),
                        "required for a model with a provider: the Envoy cluster the gateway routes it to (e.g. outbound|443||api.openai.com), so the provider credential goes nowhere else",
                    ));
                }
            }
            if let Some(c) = &m.upstream_cluster {
                check_name(format!("models[{i}].upstreamCluster"), c)?;
            }
            if let Some(ops) = &m.operations {
                if ops.is_empty() {
                    return Err(err(
                        format!("models[{i}].operations"),
                        "must list at least one operation (leave it out for the API family's defaults)",
                    ));
                }
                let mut seen = BTreeSet::new();
                for (j, op) in ops.iter().enumerate() {
                    let at = format!("models[{i}].operations[{j}]");
                    check_operation(&at, op)?;
                    if !seen.insert((op.method.as_str(), op.path.as_str())) {
                        return Err(err(
                            at,
                            format!("{} {} is listed twice", op.method, op.path),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// What is valid but probably a mistake, one line each, for the loader to log: two
    /// subscriptions with the same priority sharing an owner group or user (a key minted without
    /// naming one then depends on the tie-breaks).
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (i, a) in self.subscriptions.iter().enumerate() {
            for (j, b) in self.subscriptions.iter().enumerate().skip(i + 1) {
                if a.priority != b.priority {
                    continue;
                }
                let shared = a
                    .owner
                    .groups
                    .iter()
                    .find(|g| b.owner.groups.contains(g))
                    .map(|g| format!("group {g:?}"))
                    .or_else(|| {
                        a.owner
                            .users
                            .iter()
                            .find(|u| b.owner.users.contains(u))
                            .map(|u| format!("user {u:?}"))
                    });
                if let Some(shared) = shared {
                    out.push(format!(
                        "subscriptions[{i}] ({}) and subscriptions[{j}] ({}) share owner {shared} and priority {}: a key minted without naming a subscription takes the one with the larger token limit, then the first by name",
                        a.name, b.name, a.priority
                    ));
                }
            }
        }
        out
    }

    pub fn subscription(&self, name: &str) -> Option<&Subscription> {
        self.subscriptions.iter().find(|s| s.name == name)
    }

    pub fn tier(&self, name: &str) -> Option<&Tier> {
        self.tiers.iter().find(|t| t.name == name)
    }

    pub fn model(&self, name: &str) -> Option<&Model> {
        self.models.iter().find(|m| m.name == name)
    }

    /// The model clients name `id` (its name or an alias) and its index.
    /// The model at `model_idx` as its routed backend `backend` serves it (`None`: no such
    /// routed backend).
    pub fn backend_variant(&self, model_idx: usize, backend: usize) -> Option<&Model> {
        self.backend_variants.get(model_idx)?.get(backend)
    }

    /// Fills [`PolicyDocument::backend_variants`] (left empty when no model routes backends).
    pub fn build_backend_variants(&mut self) {
        self.backend_variants = if self.models.iter().any(Model::routes_backends) {
            self.models
                .iter()
                .map(|m| {
                    if m.routes_backends() {
                        m.backends.iter().map(|b| m.routed_variant(b)).collect()
                    } else {
                        Vec::new()
                    }
                })
                .collect()
        } else {
            Vec::new()
        };
    }

    pub fn model_by_id(&self, id: &str) -> Option<(usize, &Model)> {
        self.models
            .iter()
            .enumerate()
            .find(|(_, m)| m.answers_to(id))
    }

    /// The tier a subject gets: the pinned tier when it still qualifies, else the highest-level
    /// tier whose groups intersect the subject's. `None`: no tier (the caller refuses).
    pub fn resolve_tier(&self, groups: &[String], pinned: Option<&str>) -> Option<&Tier> {
        let qualifies = |t: &Tier| t.groups.iter().any(|g| groups.iter().any(|ug| ug == g));
        match pinned {
            Some(name) => self.tier(name).filter(|t| qualifies(t)),
            None => self
                .tiers
                .iter()
                .filter(|t| qualifies(t))
                .max_by(|a, b| a.level.cmp(&b.level).then_with(|| b.name.cmp(&a.name))),
        }
    }

    /// Tiers a subject qualifies for (what it may pin a key to).
    pub fn qualifying_tiers<'a>(
        &'a self,
        groups: &'a [String],
    ) -> impl Iterator<Item = &'a Tier> + 'a {
        self.tiers
            .iter()
            .filter(move |t| t.groups.iter().any(|g| groups.iter().any(|ug| ug == g)))
    }

    /// The model whose path prefix holds `path` (at a segment boundary), longest prefix first.
    /// `path` is compared as sent, case-sensitively; the query string must be stripped already.
    pub fn model_for_path(&self, path: &str) -> Option<&Model> {
        self.models
            .iter()
            .filter(|m| {
                path.strip_prefix(m.path.as_str())
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
            })
            .max_by_key(|m| m.path.len())
    }

    /// Models a tier may call.
    pub fn models_for_tier<'a>(&'a self, tier: &'a str) -> impl Iterator<Item = &'a Model> + 'a {
        self.models
            .iter()
            .filter(move |m| m.tiers.iter().any(|t| t == tier))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample() -> serde_json::Value {
        json!({
            "tiers": [
                {"name": "free", "level": 0, "groups": ["system:authenticated"],
                 "limits": {"requests": [{"limit": 5, "window": "1m"}], "tokens": [{"limit": 100, "window": "1m"}, {"limit": 1000, "window": "1d"}]}},
                {"name": "premium", "level": 1, "groups": ["premium-users"], "defaultMaxTokens": 64}
            ],
            "models": [
                {"name": "sim", "path": "/llm/sim", "tiers": ["free", "premium"]},
                {"name": "gpt", "path": "/ext/gpt", "tiers": ["premium"], "provider": {"type": "azure-openai", "credentialRef": "azure-key"}, "upstreamCluster": "outbound|443||example.openai.azure.com"}
            ]
        })
    }

    fn fails_at(v: serde_json::Value, path: &str) {
        match PolicyDocument::from_value(v) {
            Ok(_) => panic!("expected an error at {path}"),
            Err(e) => assert_eq!(e.path, path, "{e}"),
        }
    }

    #[test]
    fn backends_are_checked_with_the_field_named() {
        let mut v = sample();
        v["models"][0]["backends"] = json!([
            {"name": "a", "backend": "http://127.0.0.1:9001", "weight": 80, "timeout": "2s"},
            {"name": "b", "backend": "simulator", "weight": 20},
            {"name": "standby", "backend": "http://127.0.0.1:9002", "weight": 0, "timeout": "500ms"}
        ]);
        let doc = PolicyDocument::from_value(v.clone()).unwrap();
        let b = &doc.models[0].backends;
        assert_eq!((b[0].weight, b[0].timeout_ms()), (80, Some(2000)));
        assert_eq!((b[1].weight, b[1].timeout_ms()), (20, Some(300_000)));
        assert_eq!(b[2].timeout_ms(), Some(500));
        assert_eq!(
            PolicyDocument::from_value(serde_json::to_value(&doc).unwrap()).unwrap(),
            doc
        );
        // Weight defaults to the reference's 1.
        let mut w = v.clone();
        w["models"][0]["backends"][1]
            .as_object_mut()
            .unwrap()
            .remove("weight");
        let doc = PolicyDocument::from_value(w).unwrap();
        assert_eq!(doc.models[0].backends[1].weight, 1);

        let bad = |path: &str, edit: &dyn Fn(&mut serde_json::Value)| {
            let mut w = v.clone();
            edit(&mut w);
            fails_at(w, path);
        };
        bad("models[0].backend", &|w| {
            w["models"][0]["backend"] = json!("simulator")
        });
        bad("models[0].provider", &|w| {
            w["models"][0]["provider"] = json!({"type": "openai", "credentialRef": "k"});
        });
        bad("models[0].backends[1].name", &|w| {
            w["models"][0]["backends"][1]["name"] = json!("a")
        });
        for name in ["", "a\"b", "a b", "a/b"] {
            bad("models[0].backends[1].name", &|w| {
                w["models"][0]["backends"][1]["name"] = json!(name);
            });
        }
        bad("models[0].backends[0].weight", &|w| {
            w["models"][0]["backends"][0]["weight"] = json!(101)
        });
        bad("models[0].backends", &|w| {
            for j in 0..3 {
                w["models"][0]["backends"][j]["weight"] = json!(0);
            }
        });
        for t in ["", "30", "0s", "1h", "s", "-1s", "1.5s"] {
            bad("models[0].backends[0].timeout", &|w| {
                w["models"][0]["backends"][0]["timeout"] = json!(t);
            });
        }
        bad("models[0].backends[2].backend", &|w| {
            w["models"][0]["backends"][2]
                .as_object_mut()
                .unwrap()
                .remove("backend");
        });
        bad("models[0].backends[2].backend", &|w| {
            w["models"][0]["backends"][2]["backend"] = json!("tcp://x:1");
        });
        // Cooldown: on by default for backends; its fields checked by name.
        let doc = PolicyDocument::from_value(v.clone()).unwrap();
        let rule = doc.models[0].cooldown_rule().unwrap();
        assert_eq!((rule.failures, rule.seconds), (3, 30));
        let mut c = v.clone();
        c["models"][0]["cooldown"] = json!({"failures": 5, "duration": "2m"});
        let rule = PolicyDocument::from_value(c).unwrap().models[0]
            .cooldown_rule()
            .unwrap();
        assert_eq!((rule.failures, rule.seconds), (5, 120));
        let mut c = v.clone();
        c["models"][0]["cooldown"] = json!({"failures": 0});
        assert_eq!(
            PolicyDocument::from_value(c).unwrap().models[0].cooldown_rule(),
            None,
            "off"
        );
        bad("models[0].cooldown.failures", &|w| {
            w["models"][0]["cooldown"] = json!({"failures": 101});
        });
        for d in ["500ms", "2h", "x", ""] {
            bad("models[0].cooldown.duration", &|w| {
                w["models"][0]["cooldown"] = json!({"failures": 3, "duration": d});
            });
        }
        bad("models[0].cooldown.for", &|w| {
            w["models"][0]["cooldown"] = json!({"failures": 3, "for": "30s"});
        });
        bad("models[0].cooldown", &|w| {
            w["models"][0].as_object_mut().unwrap().remove("backends");
            w["models"][0]["backend"] = json!("simulator");
            w["models"][0]["cooldown"] = json!({"failures": 3});
        });
    }

    /// Providers in backends: a header credential, the model's API, the path as sent, and the
    /// model's upstreamCluster.
    /// A provider's own chat path: absolute, visible ASCII, a query allowed, nothing left of a
    /// placeholder; not for bedrock, a vertex publisher or a failover backend.
    #[test]
    fn a_providers_own_path_is_checked_with_the_field_named() {
        let mut v = sample();
        v["models"][0]["provider"] = json!({"type": "openai", "credentialRef": "k",
                                            "path": "/gateway/v1/chat/completions?x=1"});
        v["models"][0]["upstreamCluster"] = json!("ext");
        let doc = PolicyDocument::from_value(v.clone()).unwrap();
        assert_eq!(
            doc.models[0].provider.as_ref().unwrap().path.as_deref(),
            Some("/gateway/v1/chat/completions?x=1")
        );
        for bad in [
            "v1/chat",
            "/a b",
            "/{deployment}/x",
            "/a#b",
            "/a/../b",
            "/\u{e9}",
        ] {
            let mut w = v.clone();
            w["models"][0]["provider"]["path"] = json!(bad);
            fails_at(w, "models[0].provider.path");
        }
        let mut w = v.clone();
        w["models"][0]["provider"] = json!({"type": "bedrock", "credentialRef": "aws",
            "auth": "awsSigV4", "region": "us-east-1", "path": "/x"});
        fails_at(w, "models[0].provider.path");
        let mut w = v.clone();
        w["models"][0].as_object_mut().unwrap().remove("provider");
        w["models"][0].as_object_mut().unwrap().remove("backend");
        w["models"][0]["upstreamCluster"] = json!("backends");
        w["models"][0]["backends"] = json!([
            {"name": "a", "backend": "http://127.0.0.1:9001",
             "provider": {"type": "openai", "credentialRef": "k", "path": "/x/chat/completions"}}
        ]);
        fails_at(w, "models[0].backends[0].provider.path");
    }

    /// Routed backends (each its own cluster): every backend names one, the model none; no
    /// timeout or cooldown; any provider a model may have, in the model's API family; each
    /// backend a model of its own for the filter (its provider, served name and cluster).
    #[test]
    fn routed_backends_name_their_clusters_and_become_models_of_their_own() {
        let mut v = sample();
        v["models"][0].as_object_mut().unwrap().remove("backend");
        v["models"][0]["api"] = json!("openai");
        v["models"][0]["backends"] = json!([
            {"name": "oai", "upstreamCluster": "outbound|443||api.openai.com", "weight": 3,
             "servedName": "gpt-4o", "provider": {"type": "openai", "credentialRef": "ns/k"}},
            {"name": "bedrock", "upstreamCluster": "outbound|443||bedrock-runtime.us-east-1.amazonaws.com",
             "servedName": "anthropic.claude-3-haiku-20240307-v1:0",
             "provider": {"type": "bedrock", "credentialRef": "ns/aws", "auth": "awsSigV4",
                          "region": "us-east-1"}}
        ]);
        let doc = PolicyDocument::from_value(v.clone()).unwrap();
        let m = &doc.models[0];
        assert!(m.routes_backends());
        assert_eq!(m.cooldown_rule(), None);
        assert!(!m.backends_need_upstream_filter());
        let bedrock = doc.backend_variant(0, 1).unwrap();
        assert_eq!(
            (bedrock.name.as_str(), bedrock.upstream_cluster.as_deref()),
            (
                m.name.as_str(),
                Some("outbound|443||bedrock-runtime.us-east-1.amazonaws.com")
            )
        );
        assert_eq!(
            bedrock.provider.as_ref().map(|p| p.kind),
            Some(ProviderKind::Bedrock)
        );
        assert!(bedrock.backends.is_empty());
        assert_eq!(
            doc.backend_variant(0, 0).unwrap().served_name.as_deref(),
            Some("gpt-4o")
        );
        assert_eq!(doc.backend_variant(0, 2), None);
        assert_eq!(doc.backend_variant(1, 0), None);
        // Round trip: the variants are not part of the document, built again when read.
        let again = PolicyDocument::from_value(serde_json::to_value(&doc).unwrap()).unwrap();
        assert_eq!(again, doc);

        let bad = |path: &str, edit: &dyn Fn(&mut serde_json::Value)| {
            let mut w = v.clone();
            edit(&mut w);
            fails_at(w, path);
        };
        bad("models[0].backends[1].upstreamCluster", &|w| {
            w["models"][0]["backends"][1]
                .as_object_mut()
                .unwrap()
                .remove("upstreamCluster");
        });
        bad("models[0].upstreamCluster", &|w| {
            w["models"][0]["upstreamCluster"] = json!("all");
        });
        bad("models[0].cooldown", &|w| {
            w["models"][0]["cooldown"] = json!({"failures": 2});
        });
        bad("models[0].backends[0].timeout", &|w| {
            w["models"][0]["backends"][0]["timeout"] = json!("5");
        });
        bad("models[0].backends[0].upstreamCluster", &|w| {
            w["models"][0]["backends"][0]["upstreamCluster"] = json!("");
        });
        bad("models[0].backends[1].provider", &|w| {
            w["models"][0]["backends"][1]["provider"] =
                json!({"type": "anthropic", "credentialRef": "k"});
        });
        bad("models[0].backends[1].provider.region", &|w| {
            w["models"][0]["backends"][1]["provider"]["region"] = json!("mars");
        });
        bad("models[0].backends[0].provider.credentialRef", &|w| {
            w["models"][0]["backends"][0]["provider"]["credentialRef"] = json!("a/b/c");
        });
    }

    #[test]
    fn provider_backends_take_a_header_credential_in_the_models_api() {
        let mut v = sample();
        v["models"][0]["backends"] = json!([
            {"name": "a", "backend": "http://127.0.0.1:9001", "weight": 80, "timeout": "2s"},
            {"name": "b", "backend": "simulator", "weight": 20},
            {"name": "standby", "backend": "http://127.0.0.1:9002", "weight": 0, "timeout": "500ms"}
        ]);
        let with = |edit: &dyn Fn(&mut serde_json::Value)| {
            let mut w = v.clone();
            w["models"][0]["upstreamCluster"] = json!("gpt-backends");
            w["models"][0]["backends"][0]["provider"] =
                json!({"type": "openai", "credentialRef": "key-a"});
            w["models"][0]["backends"][1]["provider"] =
                json!({"type": "azure-openai", "credentialRef": "ns-1/key-b"});
            edit(&mut w);
            w
        };
        let doc = PolicyDocument::from_value(with(&|_| {})).unwrap();
        let refs: Vec<&str> = doc.models[0]
            .providers()
            .map(|p| p.credential_ref.as_str())
            .collect();
        assert_eq!(refs, ["key-a", "ns-1/key-b"]);
        for auth in [
            json!({"type": "azure-openai", "credentialRef": "app", "auth": "azureClientCredentials"}),
            json!({"type": "vertex", "credentialRef": "sa", "auth": "gcpServiceAccount"}),
            // Providers with their own paths: set per attempt by the upstream filter.
            json!({"type": "azure-openai", "credentialRef": "k", "deployment": "gpt-4o",
                   "apiVersion": "2025-01-01-preview"}),
            json!({"type": "vertex", "credentialRef": "sa", "auth": "gcpServiceAccount",
                   "project": "p", "location": "us-central1"}),
        ] {
            PolicyDocument::from_value(with(&|w| {
                w["models"][0]["backends"][2]["provider"] = auth.clone();
            }))
            .unwrap();
        }
        // Anthropic backends in a model whose api is anthropic.
        PolicyDocument::from_value(with(&|w| {
            w["models"][0]["api"] = json!("anthropic");
            for j in 0..2 {
                w["models"][0]["backends"][j]["provider"] =
                    json!({"type": "anthropic", "credentialRef": "k"});
            }
        }))
        .unwrap();
        for (at, edit) in [
            (
                "models[0].upstreamCluster",
                &(|w: &mut serde_json::Value| {
                    w["models"][0]
                        .as_object_mut()
                        .unwrap()
                        .remove("upstreamCluster");
                }) as &dyn Fn(&mut serde_json::Value),
            ),
            ("models[0].backends[1].provider", &|w| {
                w["models"][0]["backends"][1]["provider"] = json!({"type": "bedrock",
                    "credentialRef": "aws", "auth": "awsSigV4", "region": "us-east-1"});
            }),
            ("models[0].backends[1].provider", &|w| {
                w["models"][0]["backends"][1]["provider"] = json!({"type": "vertex",
                    "credentialRef": "sa", "auth": "gcpServiceAccount",
                    "project": "p", "location": "us-central1", "publisher": "anthropic"});
            }),
            // Anthropic Messages in an OpenAI model would need translation per backend.
            ("models[0].backends[1].provider", &|w| {
                w["models"][0]["backends"][1]["provider"] =
                    json!({"type": "anthropic", "credentialRef": "k"});
            }),
            ("models[0].backends[0].provider", &|w| {
                w["models"][0]["api"] = json!("anthropic");
            }),
            ("models[0].backends[1].provider.credentialRef", &|w| {
                w["models"][0]["backends"][1]["provider"]["credentialRef"] = json!("a/b/c");
            }),
            ("models[0].backends[1].provider.auth", &|w| {
                w["models"][0]["backends"][1]["provider"]["auth"] = json!("gcpServiceAccount");
            }),
        ] {
            fails_at(with(edit), at);
        }
    }

    #[test]
    fn accepts_sample_and_roundtrips() {
        let doc = PolicyDocument::from_value(sample()).unwrap();
        let json = serde_json::to_vec(&doc).unwrap();
        assert_eq!(PolicyDocument::from_json(&json).unwrap(), doc);
        assert_eq!(
            doc.models[1].provider.as_ref().unwrap().kind,
            ProviderKind::AzureOpenai
        );
    }

    #[test]
    fn errors_name_the_field() {
        let mut v = sample();
        v["tiers"][0]["limits"]["tokens"][1]["window"] = json!("0m");
        fails_at(v, "tiers[0].limits.tokens[1].window");
        let mut v = sample();
        v["tiers"][0]["limits"]["requests"][0]["limit"] = json!(-5);
        fails_at(v, "tiers[0].limits.requests[0].limit");
        let mut v = sample();
        v["models"][0]["tiers"][1] = json!("gold");
        fails_at(v, "models[0].tiers[1]");
        let mut v = sample();
        v["models"][1]["provider"]["type"] = json!("sagemaker");
        fails_at(v, "models[1].provider.type");
        let mut v = sample();
        v["tiers"][1]["name"] = json!("free");
        fails_at(v, "tiers[1].name");
        let mut v = sample();
        v["models"][0]["path"] = json!("/llm/../x");
        fails_at(v, "models[0].path");
        let mut v = sample();
        v["models"][0]["path"] = json!("/maas-api/x");
        fails_at(v, "models[0].path");
        let mut v = sample();
        v["tiers"][0]["colour"] = json!("red");
        fails_at(v, "tiers[0].colour");
    }

    #[test]
    fn observability_is_off_by_default_left_out_and_checked_by_field() {
        let doc = PolicyDocument::from_value(sample()).unwrap();
        assert!(!doc.observability.usage_events);
        let served = serde_json::to_value(&doc).unwrap();
        assert!(served.get("observability").is_none(), "{served}");
        let mut v = sample();
        v["observability"] = json!({"usageEvents": true});
        let doc = PolicyDocument::from_value(v).unwrap();
        assert!(doc.observability.usage_events);
        let served = serde_json::to_value(&doc).unwrap();
        assert_eq!(served["observability"]["usageEvents"], true);
        assert_eq!(PolicyDocument::from_value(served).unwrap(), doc);
        let mut v = sample();
        v["observability"] = json!({"usageEvents": "yes"});
        fails_at(v, "observability.usageEvents");
        let mut v = sample();
        v["observability"] = json!({"usageEvent": true});
        fails_at(v, "observability.usageEvent");
    }

    #[test]
    fn trace_attributes_are_off_by_default_and_checked() {
        let doc = PolicyDocument::from_value(sample()).unwrap();
        assert!(!doc.observability.trace_attributes);
        let mut v = sample();
        v["observability"] = json!({"traceAttributes": true});
        let doc = PolicyDocument::from_value(v).unwrap();
        assert!(doc.observability.trace_attributes);
        assert!(!doc.observability.usage_events);
        let served = serde_json::to_value(&doc).unwrap();
        assert_eq!(served["observability"]["traceAttributes"], true);
        assert_eq!(PolicyDocument::from_value(served).unwrap(), doc);
        let mut v = sample();
        v["observability"] = json!({"traceAttributes": 1});
        fails_at(v, "observability.traceAttributes");
    }

    #[test]
    fn token_weights_default_to_one_and_are_validated_by_field() {
        let doc = PolicyDocument::from_value(sample()).unwrap();
        assert_eq!(doc.tiers[0].token_weights, TokenWeights::default());
        // Left out of the served document when default: a tier-only policy is served as before.
        let served = serde_json::to_value(&doc).unwrap();
        assert!(served["tiers"][0].get("tokenWeights").is_none());
        let mut v = sample();
        v["tiers"][0]["tokenWeights"] = json!({"output": 4});
        let doc = PolicyDocument::from_value(v).unwrap();
        assert_eq!(
            doc.tiers[0].token_weights,
            TokenWeights {
                input: 1,
                output: 4
            }
        );
        assert_eq!(doc.tiers[0].token_weights.weigh(10, 20), 90);
        let served = serde_json::to_value(&doc).unwrap();
        assert_eq!(
            served["tiers"][0]["tokenWeights"],
            json!({"input": 1, "output": 4})
        );
        for (weights, field) in [
            (json!({"input": 0}), "tiers[1].tokenWeights.input"),
            (json!({"output": 1001}), "tiers[1].tokenWeights.output"),
        ] {
            let mut v = sample();
            v["tiers"][1]["tokenWeights"] = weights;
            fails_at(v, field);
        }
        for (weights, field) in [
            (json!({"input": -1}), "tiers[1].tokenWeights.input"),
            (json!({"input": 1.5}), "tiers[1].tokenWeights.input"),
            (json!({"inputs": 2}), "tiers[1].tokenWeights.inputs"),
        ] {
            let mut v = sample();
            v["tiers"][1]["tokenWeights"] = weights;
            fails_at(v, field);
        }
    }

    #[test]
    fn warning_thresholds_default_to_80_and_95_and_are_validated() {
        let doc = PolicyDocument::from_value(sample()).unwrap();
        assert_eq!(doc.tiers[0].warn_at, [80, 95]);
        let served = serde_json::to_value(&doc).unwrap();
        assert!(served["tiers"][0].get("warnAt").is_none());
        let mut v = sample();
        v["tiers"][0]["warnAt"] = json!([]);
        let doc = PolicyDocument::from_value(v).unwrap();
        assert!(doc.tiers[0].warn_at.is_empty());
        assert_eq!(
            serde_json::to_value(&doc).unwrap()["tiers"][0]["warnAt"],
            json!([])
        );
        for (warn_at, field) in [
            (json!([0]), "tiers[1].warnAt[0]"),
            (json!([50, 101]), "tiers[1].warnAt[1]"),
            (json!([90, 80]), "tiers[1].warnAt[1]"),
            (json!([80, 80]), "tiers[1].warnAt[1]"),
            (
                json!([10, 20, 30, 40, 50, 60, 70, 80, 90]),
                "tiers[1].warnAt",
            ),
            (json!([300]), "tiers[1].warnAt[0]"),
            (json!(["80"]), "tiers[1].warnAt[0]"),
        ] {
            let mut v = sample();
            v["tiers"][1]["warnAt"] = warn_at;
            fails_at(v, field);
        }
    }

    #[test]
    fn one_enforced_and_one_shadow_limit_per_window() {
        let mut v = sample();
        v["tiers"][0]["limits"]["tokens"] = json!([
            {"limit": 100, "window": "1d"},
            {"limit": 50, "window": "1d", "shadow": true}
        ]);
        let doc = PolicyDocument::from_value(v.clone()).unwrap();
        assert!(doc.tiers[0].limits.tokens[1].shadow);
        let served = serde_json::to_value(&doc).unwrap();
        assert!(
            served["tiers"][0]["limits"]["tokens"][0]
                .get("shadow")
                .is_none()
        );
        assert_eq!(served["tiers"][0]["limits"]["tokens"][1]["shadow"], true);
        v["tiers"][0]["limits"]["tokens"] = json!([
            {"limit": 50, "window": "1d", "shadow": true},
            {"limit": 60, "window": "1d", "shadow": true}
        ]);
        fails_at(v, "tiers[0].limits.tokens[1].window");
    }

    #[test]
    fn weights_weigh_and_combine() {
        let w = TokenWeights {
            input: 2,
            output: 4,
        };
        assert_eq!(w.weigh(3, 5), 26);
        assert_eq!(w.weigh(u64::MAX, 1), u64::MAX);
        let other = TokenWeights {
            input: 3,
            output: 1,
        };
        assert_eq!(
            w.max(other),
            TokenWeights {
                input: 3,
                output: 4
            }
        );
    }

    #[test]
    fn bedrock_needs_aws_sigv4_and_a_region() {
        // awsSigV4 and a region, both required; neither belongs to another type.
        let mut w = sample();
        w["models"][1]["provider"] = json!({"type": "bedrock", "credentialRef": "aws",
            "auth": "awsSigV4", "region": "us-east-1"});
        let doc = PolicyDocument::from_value(w.clone()).unwrap();
        let p = doc.models[1].provider.as_ref().unwrap();
        assert_eq!(p.kind, ProviderKind::Bedrock);
        assert_eq!(p.auth, ProviderAuth::AwsSigV4);
        assert!(!p.auth.is_token());
        assert_eq!(
            p.path(),
            Some(ProviderPath::Bedrock {
                region: "us-east-1"
            })
        );
        let back = serde_json::to_value(&doc).unwrap();
        assert_eq!(back["models"][1]["provider"]["auth"], "awsSigV4");
        assert_eq!(back["models"][1]["provider"]["region"], "us-east-1");
        for bad in [
            json!("US-EAST-1"),
            json!("east"),
            json!("-us-east-1"),
            json!("us_east_1"),
        ] {
            let mut x = w.clone();
            x["models"][1]["provider"]["region"] = bad;
            fails_at(x, "models[1].provider.region");
        }
        let mut x = w.clone();
        x["models"][1]["provider"]
            .as_object_mut()
            .unwrap()
            .remove("region");
        fails_at(x, "models[1].provider.region");
        let mut x = w.clone();
        x["models"][1]["provider"]
            .as_object_mut()
            .unwrap()
            .remove("auth");
        fails_at(x, "models[1].provider.auth");
        let mut x = w.clone();
        x["models"][1]["provider"]["project"] = json!("p");
        fails_at(x, "models[1].provider.project");
        let mut x = sample();
        x["models"][1]["provider"]["auth"] = json!("awsSigV4");
        fails_at(x, "models[1].provider.auth");
        let mut x = sample();
        x["models"][1]["provider"]["region"] = json!("us-east-1");
        fails_at(x, "models[1].provider.region");
    }

    #[test]
    fn provider_paths_and_auth_are_checked_with_the_field_named() {
        // Azure: a deployment, the api-version defaulted.
        let mut v = sample();
        v["models"][1]["provider"]["deployment"] = json!("gpt-4o-prod");
        let doc = PolicyDocument::from_value(v.clone()).unwrap();
        let p = doc.models[1].provider.as_ref().unwrap();
        assert_eq!(
            p.path(),
            Some(ProviderPath::AzureDeployment {
                deployment: "gpt-4o-prod",
                api_version: AZURE_DEFAULT_API_VERSION
            })
        );
        assert_eq!(p.auth, ProviderAuth::ApiKey);
        v["models"][1]["provider"]["apiVersion"] = json!("2025-01-01-preview");
        v["models"][1]["provider"]["auth"] = json!("azureClientCredentials");
        let doc = PolicyDocument::from_value(v.clone()).unwrap();
        let p = doc.models[1].provider.as_ref().unwrap();
        assert_eq!(p.auth, ProviderAuth::AzureClientCredentials);
        assert!(matches!(
            p.path(),
            Some(ProviderPath::AzureDeployment {
                api_version: "2025-01-01-preview",
                ..
            })
        ));
        // Written back the same (the companion serves what it parsed).
        let back = serde_json::to_value(&doc).unwrap();
        assert_eq!(
            back["models"][1]["provider"]["apiVersion"],
            "2025-01-01-preview"
        );
        assert_eq!(
            back["models"][1]["provider"]["auth"],
            "azureClientCredentials"
        );
        for (field, bad) in [
            ("deployment", json!("a/b")),
            ("deployment", json!("..")),
            ("deployment", json!("")),
            ("deployment", json!("x?api-version=1")),
            ("apiVersion", json!("2024-10-21&x=1")),
            ("deployment", json!("d".repeat(65))),
        ] {
            let mut v = v.clone();
            v["models"][1]["provider"][field] = bad;
            fails_at(v, &format!("models[1].provider.{field}"));
        }
        // Fields of another provider type, an apiVersion without deployment, a half Vertex path,
        // an auth of another provider.
        let mut w = sample();
        w["models"][1]["provider"]["project"] = json!("p");
        fails_at(w, "models[1].provider.project");
        let mut w = sample();
        w["models"][1]["provider"]["apiVersion"] = json!("2024-10-21");
        fails_at(w, "models[1].provider.apiVersion");
        let mut w = sample();
        w["models"][1]["provider"]["auth"] = json!("gcpServiceAccount");
        fails_at(w, "models[1].provider.auth");
        let mut w = sample();
        w["models"][1]["provider"]["auth"] = json!("oauth2");
        fails_at(w, "models[1].provider.auth");
        // Vertex: project and location together.
        let mut w = sample();
        w["models"][1]["provider"] = json!({"type": "vertex", "credentialRef": "gcp-sa",
            "auth": "gcpServiceAccount", "project": "my-proj"});
        fails_at(w.clone(), "models[1].provider.location");
        w["models"][1]["provider"]["location"] = json!("us-central1");
        let doc = PolicyDocument::from_value(w.clone()).unwrap();
        assert_eq!(
            doc.models[1].provider.as_ref().unwrap().path(),
            Some(ProviderPath::VertexOpenapi {
                project: "my-proj",
                location: "us-central1"
            })
        );
        w["models"][1]["provider"]["deployment"] = json!("d");
        fails_at(w, "models[1].provider.deployment");
        // Without the path fields the path goes as sent (as before).
        let doc = PolicyDocument::from_value(sample()).unwrap();
        assert_eq!(doc.models[1].provider.as_ref().unwrap().path(), None);
    }

    #[test]
    fn claude_on_vertex_is_checked_with_the_field_named() {
        let mut w = sample();
        w["models"][1]["provider"] = json!({"type": "vertex", "credentialRef": "gcp-sa",
            "auth": "gcpServiceAccount", "project": "my-proj", "location": "us-central1"});
        // Claude on Vertex: the publisher's path, the Anthropic API family, the model id a
        // path segment (Vertex's `@version` allowed).
        let mut claude = w.clone();
        claude["models"][1]["provider"]["publisher"] = json!("anthropic");
        claude["models"][1]["servedName"] = json!("claude-sonnet-4@20250514");
        let doc = PolicyDocument::from_value(claude.clone()).unwrap();
        assert_eq!(
            doc.models[1].provider.as_ref().unwrap().path(),
            Some(ProviderPath::VertexPublisher {
                project: "my-proj",
                location: "us-central1",
                publisher: VertexPublisher::Anthropic
            })
        );
        assert_eq!(doc.models[1].api_family(), ApiFamily::Anthropic);
        claude["models"][1]["servedName"] = json!("claude/../x");
        fails_at(claude.clone(), "models[1].servedName");
        claude["models"][1]["servedName"] = json!("c:rawPredict");
        fails_at(claude.clone(), "models[1].servedName");
        claude["models"][1]["provider"]["publisher"] = json!("mistralai");
        fails_at(claude.clone(), "models[1].provider.publisher");
        // Gemini in Vertex AI's own API: the OpenAI family (a chat client's requests are
        // translated); only its chat operation.
        let mut gemini = claude.clone();
        gemini["models"][1]["provider"]["publisher"] = json!("google");
        gemini["models"][1]["servedName"] = json!("gemini-2.5-flash");
        let doc = PolicyDocument::from_value(gemini.clone()).unwrap();
        assert_eq!(doc.models[1].api_family(), ApiFamily::Openai);
        gemini["models"][1]["api"] = json!("anthropic");
        fails_at(gemini, "models[1].api");
        let mut no_path = claude.clone();
        no_path["models"][1]["provider"]["publisher"] = json!("anthropic");
        no_path["models"][1]["servedName"] = json!("c");
        no_path["models"][1]["provider"]
            .as_object_mut()
            .unwrap()
            .retain(|k, _| k != "project" && k != "location");
        fails_at(no_path, "models[1].provider.project");
        let mut not_vertex = sample();
        not_vertex["models"][1]["provider"]["publisher"] = json!("anthropic");
        fails_at(not_vertex, "models[1].provider.publisher");
    }

    #[test]
    fn provider_models_must_name_their_upstream_cluster() {
        let mut v = sample();
        v["models"][1]
            .as_object_mut()
            .unwrap()
            .remove("upstreamCluster");
        let e = PolicyDocument::from_value(v).unwrap_err();
        assert_eq!(e.path, "models[1].upstreamCluster");
        assert!(e.message.contains("required"), "{e}");
        // Optional for on-cluster models, checked when given.
        let mut v = sample();
        v["models"][0]["upstreamCluster"] = json!("outbound|8000||sim.llm.svc.cluster.local");
        assert!(PolicyDocument::from_value(v).is_ok());
        for bad in ["", " ", "a b", "x\ny"] {
            let mut v = sample();
            v["models"][0]["upstreamCluster"] = json!(bad);
            fails_at(v, "models[0].upstreamCluster");
        }
    }

    #[test]
    fn a_credential_ref_is_a_secret_name_or_namespace_slash_name() {
        for (good, secret) in [
            ("azure-key", (None, "azure-key")),
            ("llm/azure-key", (Some("llm"), "azure-key")),
        ] {
            let mut v = sample();
            v["models"][1]["provider"]["credentialRef"] = json!(good);
            let doc = PolicyDocument::from_value(v).unwrap();
            let p = doc.models[1].provider.as_ref().unwrap();
            assert_eq!(p.secret(), secret, "{good}");
        }
        for bad in ["/azure-key", "llm/", "Tenant_X/key", "a/b/c", " "] {
            let mut v = sample();
            v["models"][1]["provider"]["credentialRef"] = json!(bad);
            fails_at(v, "models[1].provider.credentialRef");
        }
    }

    #[test]
    fn api_family_defaults_from_the_provider() {
        let mut v = sample();
        v["models"][1]["provider"]["type"] = json!("anthropic");
        let doc = PolicyDocument::from_value(v.clone()).unwrap();
        assert_eq!(doc.models[0].api_family(), ApiFamily::Openai, "no provider");
        assert_eq!(doc.models[1].api_family(), ApiFamily::Anthropic);
        v["models"][1]["api"] = json!("openai");
        let doc = PolicyDocument::from_value(v.clone()).unwrap();
        assert_eq!(
            doc.models[1].api_family(),
            ApiFamily::Openai,
            "explicit wins"
        );
        v["models"][1]["provider"]["type"] = json!("vertex");
        v["models"][1]["api"] = json!("anthropic");
        let doc = PolicyDocument::from_value(v.clone()).unwrap();
        assert_eq!(doc.models[1].api_family(), ApiFamily::Anthropic);
        v["models"][1]["api"] = json!("gemini");
        fails_at(v, "models[1].api");
    }

    #[test]
    fn operations_are_validated() {
        let with_ops = |ops: serde_json::Value| {
            let mut v = sample();
            v["models"][0]["operations"] = ops;
            v
        };
        let ok = with_ops(json!([
            {"method": "POST", "path": "/v1/chat/completions"},
            {"method": "GET", "path": "/v1/models/*"},
            {"method": "POST", "path": "/v1beta/models/gemini-pro:generateContent"}
        ]));
        let doc = PolicyDocument::from_value(ok).unwrap();
        assert_eq!(doc.models[0].operations.as_ref().unwrap().len(), 3);
        fails_at(with_ops(json!([])), "models[0].operations");
        for (op, field) in [
            (json!({"method": "post", "path": "/v1/x"}), "method"),
            (json!({"method": "", "path": "/v1/x"}), "method"),
            (json!({"method": "PO ST", "path": "/v1/x"}), "method"),
            (json!({"method": "POST", "path": "v1/x"}), "path"),
            (json!({"method": "POST", "path": "/"}), "path"),
            (json!({"method": "POST", "path": "/v1/x/"}), "path"),
            (json!({"method": "POST", "path": "/v1//x"}), "path"),
            (json!({"method": "POST", "path": "/v1/../files"}), "path"),
            (json!({"method": "POST", "path": "/v1/x?y=1"}), "path"),
            (json!({"method": "POST", "path": "/v1/x%2Fy"}), "path"),
            (json!({"method": "POST", "path": "/v1/x*"}), "path"),
        ] {
            fails_at(
                with_ops(json!([op])),
                &format!("models[0].operations[0].{field}"),
            );
        }
        fails_at(
            with_ops(
                json!([{"method": "POST", "path": "/v1/x"}, {"method": "POST", "path": "/v1/x"}]),
            ),
            "models[0].operations[1]",
        );
        fails_at(
            with_ops(json!([{"method": "POST", "path": "/v1/x", "extra": 1}])),
            "models[0].operations[0].extra",
        );
    }

    #[test]
    fn tier_resolution() {
        let doc = PolicyDocument::from_value(sample()).unwrap();
        let both = vec![
            "system:authenticated".to_string(),
            "premium-users".to_string(),
        ];
        let free_only = vec!["system:authenticated".to_string()];
        assert_eq!(doc.resolve_tier(&both, None).unwrap().name, "premium");
        assert_eq!(doc.resolve_tier(&both, Some("free")).unwrap().name, "free");
        assert_eq!(doc.resolve_tier(&free_only, None).unwrap().name, "free");
        assert!(doc.resolve_tier(&free_only, Some("premium")).is_none());
        assert!(doc.resolve_tier(&[], None).is_none());
        assert!(doc.resolve_tier(&both, Some("gold")).is_none());
    }

    #[test]
    fn path_matching_is_by_segment() {
        let doc = PolicyDocument::from_value(sample()).unwrap();
        assert_eq!(
            doc.model_for_path("/llm/sim/v1/chat/completions")
                .unwrap()
                .name,
            "sim"
        );
        assert_eq!(doc.model_for_path("/llm/sim").unwrap().name, "sim");
        assert!(doc.model_for_path("/llm/simulator/v1/models").is_none());
        assert!(doc.model_for_path("/LLM/sim/v1/models").is_none());
        assert!(doc.model_for_path("/other").is_none());
    }

    /// `details` (the listing's `modelDetails`) round-trips, is left out when absent, and its
    /// fields are checked: no blank text, a positive context window.
    #[test]
    fn model_details_are_checked_and_optional() {
        let mut v = sample();
        v["models"][0]["details"] = json!({"displayName": "Sim", "description": "A simulator",
            "genaiUseCase": "chat", "contextWindow": "8192", "capabilities": ["chat"]});
        let doc = PolicyDocument::from_value(v.clone()).unwrap();
        let d = doc.models[0].details.as_ref().unwrap();
        assert_eq!(d.context_window.as_deref(), Some("8192"));
        assert_eq!(d.capabilities, ["chat"]);
        let json = serde_json::to_value(&doc).unwrap();
        assert_eq!(json["models"][0]["details"]["displayName"], "Sim");
        assert!(json["models"][1].get("details").is_none());
        for (field, bad) in [
            ("displayName", json!(" ")),
            ("contextWindow", json!("lots")),
            ("contextWindow", json!("0")),
            ("capabilities", json!(["a\u{7}"])),
        ] {
            let mut w = v.clone();
            w["models"][0]["details"][field] = bad;
            let e = PolicyDocument::from_value(w).unwrap_err();
            assert!(
                e.path.starts_with(&format!("models[0].details.{field}")),
                "{e}"
            );
        }
        let mut w = v;
        w["models"][0]["details"]["colour"] = json!("red");
        assert!(
            PolicyDocument::from_value(w).is_err(),
            "unknown fields are refused"
        );
    }

    /// A body's `model` finds one model by its name or an alias; every id names one model, and
    /// none is blank, holds a control character or is too long; `servedName` likewise.
    #[test]
    fn model_ids_are_names_and_aliases_each_naming_one_model() {
        let mut v = sample();
        v["models"][0]["aliases"] = json!(["publishers/llm/models/sim", "sim-latest"]);
        v["models"][0]["servedName"] = json!("facebook/opt-125m");
        let doc = PolicyDocument::from_value(v.clone()).unwrap();
        for id in ["sim", "publishers/llm/models/sim", "sim-latest"] {
            assert_eq!(
                doc.model_by_id(id).map(|(i, m)| (i, &*m.name)),
                Some((0, "sim"))
            );
        }
        assert_eq!(doc.model_by_id("gpt").map(|(i, _)| i), Some(1));
        for id in ["SIM", "facebook/opt-125m", "", "sim "] {
            assert!(doc.model_by_id(id).is_none(), "{id:?}");
        }
        let json = serde_json::to_value(&doc).unwrap();
        assert_eq!(json["models"][0]["servedName"], "facebook/opt-125m");
        assert!(
            json["models"][1].get("aliases").is_none(),
            "left out when empty: documents without aliases are served as before"
        );

        let mut twice = v.clone();
        twice["models"][1]["aliases"] = json!(["sim-latest"]);
        let e = PolicyDocument::from_value(twice).unwrap_err();
        assert_eq!(e.path, "models[1].aliases[0]");
        assert!(e.message.contains("alias of model \"sim\""), "{e}");
        let mut a_name = v.clone();
        a_name["models"][1]["aliases"] = json!(["sim"]);
        fails_at(a_name, "models[1].aliases[0]");
        let mut own_name = v.clone();
        own_name["models"][0]["aliases"] = json!(["sim"]);
        fails_at(own_name, "models[0].aliases[0]");
        let mut name_is_alias = v.clone();
        name_is_alias["models"][1]["name"] = json!("sim-latest");
        fails_at(name_is_alias, "models[0].aliases[1]");
        for bad in [
            json!(""),
            json!(" "),
            json!("a\u{7}b"),
            json!("x".repeat(254)),
        ] {
            let mut w = v.clone();
            w["models"][0]["aliases"] = json!([bad.clone()]);
            fails_at(w, "models[0].aliases[0]");
            let mut w = v.clone();
            w["models"][0]["servedName"] = bad;
            fails_at(w, "models[0].servedName");
        }
    }

    /// The served base URL the filter's model list builds urls from: checked like `--public-url`.
    #[test]
    fn the_public_url_is_an_http_base() {
        for good in [
            "https://maas.apps.example.com",
            "http://127.0.0.1:8080",
            "https://gw/x",
        ] {
            let mut v = sample();
            v["publicUrl"] = json!(good);
            let doc = PolicyDocument::from_value(v).unwrap();
            assert_eq!(doc.public_url.as_deref(), Some(good));
        }
        for bad in [
            "",
            "maas.example.com",
            "ftp://x",
            "https://",
            "https:///x",
            "https://x/",
            "https://x?a=1",
            "https://x#f",
            "https://x y",
            "https://x\u{7}",
        ] {
            let mut v = sample();
            v["publicUrl"] = json!(bad);
            fails_at(v, "publicUrl");
        }
        assert!(
            serde_json::to_value(PolicyDocument::from_value(sample()).unwrap())
                .unwrap()
                .get("publicUrl")
                .is_none(),
            "left out when unknown"
        );
    }

    /// The one base URL owns `/v1`: a model path there would take its requests.
    #[test]
    fn no_model_path_lies_under_the_one_base_url() {
        for path in ["/v1", "/v1/chat", "/V1/x", "/v1/models"] {
            let mut v = sample();
            v["models"][0]["path"] = json!(path);
            fails_at(v, "models[0].path");
        }
        let mut v = sample();
        v["models"][0]["path"] = json!("/v1x/sim");
        PolicyDocument::from_value(v).unwrap();
    }

    mod props {
        use super::super::*;
        use proptest::prelude::*;

        fn window() -> impl Strategy<Value = String> {
            (1u64..300, prop::sample::select(vec!["s", "m", "h", "d"]))
                .prop_map(|(n, u)| format!("{n}{u}"))
        }

        fn tier(i: usize) -> impl Strategy<Value = serde_json::Value> {
            (0i64..5, prop::collection::vec((1u64..1_000_000, window()), 0..3)).prop_map(move |(level, lims)| {
                let mut seen = std::collections::BTreeSet::new();
                let tokens: Vec<_> = lims
                    .into_iter()
                    .filter(|(_, w)| seen.insert(Window::parse(w).unwrap()))
                    .map(|(l, w)| serde_json::json!({"limit": l, "window": w}))
                    .collect();
                serde_json::json!({"name": format!("t{i}"), "level": level, "groups": [format!("g{i}")],
                                   "limits": {"tokens": tokens}})
            })
        }

        fn policy() -> impl Strategy<Value = serde_json::Value> {
            (tier(0), tier(1), 0usize..4).prop_map(|(a, b, models_len)| {
                let models: Vec<_> = (0..models_len)
                    .map(|m| serde_json::json!({"name": format!("m{m}"), "path": format!("/ns/m{m}"), "tiers": ["t0"]}))
                    .collect();
                let mut v = serde_json::json!({"tiers": [a, b], "models": models});
                if models_len > 0 {
                    v["subscriptions"] = serde_json::json!([{"name": "s0", "priority": 1,
                        "owner": {"groups": ["g0"], "users": ["u"]},
                        "models": [{"name": "m0", "tokenRateLimits": [{"limit": 5, "window": "1m"}],
                                    "billingRate": {"perToken": "0.5"}}],
                        "tokenMetadata": {"labels": {"k": "v"}}}]);
                }
                v
            })
        }

        proptest! {
            #[test]
            fn valid_documents_roundtrip(v in policy()) {
                let doc = PolicyDocument::from_value(v).unwrap();
                let bytes = serde_json::to_vec(&doc).unwrap();
                prop_assert_eq!(PolicyDocument::from_json(&bytes).unwrap(), doc);
            }

            /// Any byte flip of a valid document is either accepted (and then valid) or refused with a message.
            #[test]
            fn mutated_documents_never_panic(v in policy(), at in any::<prop::sample::Index>(), byte in any::<u8>()) {
                let mut bytes = serde_json::to_vec(&v).unwrap();
                let i = at.index(bytes.len());
                bytes[i] = byte;
                match PolicyDocument::from_json(&bytes) {
                    Ok(doc) => prop_assert!(doc.validate().is_ok()),
                    Err(e) => prop_assert!(!e.message.is_empty()),
                }
            }

            #[test]
            fn garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
                let _ = PolicyDocument::from_json(&bytes);
            }
        }
    }
}
