//! The upstream mode (issue 29, several backends per model): the same `.wasm` as an upstream
//! HTTP filter of a model's backends cluster (pluginConfig `upstream: true`). Envoy runs it once
//! per upstream attempt, after its load balancer chose the endpoint, so it sets the credential
//! of the backend that attempt goes to — never another backend's, never the client's (the
//! downstream filter removed that; this removes every provider credential header again, since
//! Envoy hands each attempt the same request headers, a previous attempt's changes included).
//!
//! It never authenticates or meters, and reads a body only for a backend with a served name of
//! its own ([`Attempt`]: the body's `model` written, `content-length` kept true on every
//! attempt of such a model). Per attempt: two property reads (the
//! cluster and the endpoint's `maas.backend`), four header writes (the credential headers and
//! `x-maas-endpoints` removed, the backend's own set), one read more for an Anthropic backend
//! (`anthropic-version`), the clock only for an access token with an expiry, and a `:path` read
//! and write for a model one of whose backends has a path scheme of its own (each attempt sets
//! its backend's path from the operation, whatever an earlier attempt sent: [`attempt_path`]).
//!
//! What it cannot decide — no policy yet, a cluster that is no model's backends cluster, an
//! endpoint that is none of the model's backends, a backend whose credential is missing or
//! expired — is answered locally with 503 and an OpenAI-style error: never forwarded without
//! its credential. Envoy 1.40 passes an upstream filter's local reply straight to the client
//! (the router does not retry it: checked), so the downstream filter keeps Envoy away from such
//! backends beforehand: [`crate::admission::backend_order`] lists only the backends that can
//! serve, which the cluster's `override_host` policy tries in order.

use crate::admission::{SecretMissing, provider_secret};
use crate::host::{Body, Headers, Host};
use crate::hygiene::{ANTHROPIC_VERSION, provider_headers};
use crate::operations::CLUSTER_PROPERTY;
use crate::response::{Deny, Refusal};
use crate::state::SharedWorker;
use maas_types::{
    CredentialsDocument, Model, PolicyDocument, Provider, ProviderAuth, ProviderKind,
    policy::Backend,
};
use proxy_wasm::types::Action;

/// The chosen endpoint's metadata `maas.backend` (the backend's name), as an upstream filter
/// reads it once the host is chosen (Envoy 1.40: empty in a downstream filter).
pub const BACKEND_PROPERTY: [&str; 5] = [
    "xds",
    "upstream_host_metadata",
    "filter_metadata",
    "maas",
    "backend",
];

/// Every header a provider credential travels in. The downstream filter removes the client's
/// `authorization` and `x-api-key`; `api-key` (Azure OpenAI's) is removed here.
pub const PROVIDER_CREDENTIAL_HEADERS: [&str; 3] = ["authorization", "x-api-key", "api-key"];

/// What one attempt sends besides the request as it is.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct AttemptPlan {
    /// The backend's credential header (none for a backend without a provider).
    pub set: Vec<(&'static str, String)>,
    /// An Anthropic backend: `anthropic-version` is set when the request carries none.
    pub anthropic_version: bool,
    /// The `:path` this attempt sends, for a model one of whose backends has a path scheme of
    /// its own (an Azure OpenAI deployment, Vertex AI's OpenAI-compatible endpoint): set on
    /// every attempt, since an earlier attempt's path stays in the shared headers.
    pub path: Option<String>,
    /// The body's `model` for a backend with a served name of its own
    /// ([`Backend::served_name`]). Each attempt's body is the router's own copy of the body the
    /// downstream filter let go (a retry never sees an earlier attempt's rewrite), so only such
    /// a backend's attempts rewrite it.
    pub model_name: Option<String>,
    /// Some backend of the model has a served name of its own, so the body's length may
    /// differ from one attempt to the next, while the attempts share one header map: every
    /// attempt frames its own body (`content-length`).
    pub body_varies: bool,
}

/// Decides an attempt: `cluster` is Envoy's `xds.cluster_name`, `backend` the chosen endpoint's
/// `maas.backend`. The model is the one whose `upstreamCluster` is this cluster (the
/// downstream filter's upstream check holds here too: a cluster the policy does not name as a
/// model's gets no credential), the backend one of its `backends` by name. `path` (the
/// request's `:path` as this attempt finds it) is asked only for a model with
/// [`paths_per_backend`].
pub fn plan_attempt(
    policy: Option<&PolicyDocument>,
    credentials: &CredentialsDocument,
    cluster: Option<&str>,
    backend: Option<&str>,
    now_s: impl FnOnce() -> u64,
    path: impl FnOnce() -> Option<String>,
) -> Result<AttemptPlan, Refusal> {
    let policy = policy.ok_or_else(Refusal::no_policy)?;
    let model = cluster
        .and_then(|c| {
            policy
                .models
                .iter()
                .find(|m| !m.backends.is_empty() && m.upstream_cluster.as_deref() == Some(c))
        })
        .ok_or_else(|| {
            Refusal::new(
                Deny::UpstreamMismatch,
                "this request reached a cluster that is no model's backends cluster; it was not forwarded",
            )
        })?;
    let chosen = backend
        .and_then(|name| model.backends.iter().find(|b| b.name == name))
        .ok_or_else(|| {
            Refusal::new(
                Deny::UpstreamMismatch,
                format!(
                    "the endpoint chosen for model {} is none of its backends; the request was not forwarded",
                    model.name
                ),
            )
        })?;
    let path = if paths_per_backend(model) {
        Some(attempt_path(model, chosen, path().as_deref())?)
    } else {
        None
    };
    let model_name = chosen.served_name.clone();
    let body_varies = model.backends.iter().any(|b| b.served_name.is_some());
    let Some(p) = &chosen.provider else {
        return Ok(AttemptPlan {
            path,
            model_name,
            body_varies,
            ..AttemptPlan::default()
        });
    };
    if p.auth == ProviderAuth::AwsSigV4 {
        // Refused by the policy's validation; never forwarded unsigned.
        return Err(Refusal::new(
            Deny::SigningUnavailable,
            format!(
                "backend {} of model {} needs a signature, which is not made per backend",
                chosen.name, model.name
            ),
        ));
    }
    let key = provider_secret(credentials, p, now_s).map_err(|why| {
        let what = match why {
            SecretMissing::None => "has no credential loaded",
            SecretMissing::Expired => "has an expired access token and no new one loaded",
        };
        Refusal::new(
            Deny::ProviderCredentialMissing,
            format!(
                "backend {} of model {} {what} yet; the request was not forwarded, retry shortly",
                chosen.name, model.name
            ),
        )
    })?;
    // `anthropic-version` is decided by the shell (it reads the request's own).
    let set = provider_headers(p, key, true);
    Ok(AttemptPlan {
        set,
        anthropic_version: p.kind == ProviderKind::Anthropic && !p.auth.is_token(),
        path,
        model_name,
        body_varies,
    })
}

/// Whether a backend with traffic has a path scheme of its own: then every attempt sets its
/// backend's `:path` (the others' the model's plain OpenAI path).
pub fn paths_per_backend(model: &Model) -> bool {
    model
        .backends
        .iter()
        .any(|b| b.weight > 0 && b.provider.as_ref().and_then(Provider::path).is_some())
}

/// The path of an attempt to `chosen`, from the operation the request's path ends with (the
/// downstream filter let through only operations every backend with a scheme serves, see
/// [`crate::provider::serves`]): the provider's own path, or the backend URL's base path then
/// `/v1/…`. A path that names none of them cannot be decided: 503, never forwarded.
fn attempt_path(model: &Model, chosen: &Backend, path: Option<&str>) -> Result<String, Refusal> {
    let operation = path
        .and_then(crate::provider::operation_of_path)
        .ok_or_else(|| {
            Refusal::new(
                Deny::UpstreamMismatch,
                format!(
                    "the operation of this request to model {} could not be told from its path; it was not forwarded",
                    model.name
                ),
            )
        })?;
    let model_id = chosen
        .served_name
        .as_deref()
        .or(model.served_name.as_deref())
        .unwrap_or(&model.name);
    match crate::provider::upstream_path(chosen.provider.as_ref(), model_id, operation, false)? {
        Some(own) => Ok(own),
        None => crate::provider::openai_path(base_path(chosen.backend.as_deref()), operation),
    }
}

/// The path of an `http(s)://authority[/base]` backend URL (`""` for none or `simulator`).
fn base_path(url: Option<&str>) -> &str {
    url.and_then(|u| u.split_once("://"))
        .and_then(|(_, rest)| rest.find('/').and_then(|i| rest.get(i..)))
        .unwrap_or("")
}

/// Answers an attempt locally (it goes nowhere): straight to the client, never retried.
fn refuse(host: &dyn Host, backend: Option<&str>, r: &Refusal) {
    log::warn!(
        "maas: upstream attempt (backend {}) refused: {}",
        backend.unwrap_or("-"),
        r.message
    );
    host.send_response(r.status, &r.response_headers(), &r.body());
}

/// One upstream attempt (the upstream mode's HTTP context). Its headers get the plan. For a
/// backend with a served name of its own the body is held to its end and its `model` written;
/// for every attempt of a model with such a backend, the headers are held too and
/// `content-length` follows this attempt's body (an earlier attempt's rewrite changed the
/// shared header). Nothing else reads a body here.
#[derive(Debug, Default)]
pub struct Attempt {
    /// The body is held to its end (its name written, its length set).
    holding: bool,
    /// The name to write into the body's `model` (none: the body keeps its bytes).
    rename: Option<String>,
    /// The request's declared `content-length`: a body whose declared bytes are all here is
    /// written without waiting for END_STREAM (as the downstream filter decides it).
    declared: Option<usize>,
    /// Body bytes buffered so far.
    buffered: usize,
}

impl Attempt {
    /// The attempt's request headers: the plan applied, or a local 503 when it cannot be
    /// decided. Held (paused) while a body rename is pending.
    pub fn on_request_headers(
        &mut self,
        host: &dyn Host,
        worker: &SharedWorker,
        end_of_stream: bool,
    ) -> Action {
        let cluster = host.property(&CLUSTER_PROPERTY);
        let backend = host.property(&BACKEND_PROPERTY);
        let (plan, hold_headers) = match worker.try_borrow() {
            Ok(w) => (
                plan_attempt(
                    w.policy.as_deref(),
                    &w.credentials,
                    cluster.as_deref(),
                    backend.as_deref(),
                    || host.now_ms() / 1000,
                    || host.header(Headers::Request, ":path"),
                ),
                w.config.as_ref().is_some_and(|c| c.pause_headers_for_body),
            ),
            Err(_) => (Err(Refusal::undecidable()), false),
        };
        let plan = match plan {
            Ok(plan) => plan,
            Err(r) => {
                refuse(host, backend.as_deref(), &r);
                return Action::Pause;
            }
        };
        for name in PROVIDER_CREDENTIAL_HEADERS {
            if !plan.set.iter().any(|(n, _)| *n == name) {
                host.set_header(Headers::Request, name, None);
            }
        }
        // Envoy chose with it already (and keeps the order for the retries).
        host.set_header(Headers::Request, maas_types::BACKEND_ORDER_HEADER, None);
        for (name, value) in &plan.set {
            host.set_header(Headers::Request, name, Some(value));
        }
        if let Some(path) = &plan.path {
            host.set_header(Headers::Request, ":path", Some(path));
        }
        if plan.anthropic_version && host.header(Headers::Request, "anthropic-version").is_none() {
            host.set_header(
                Headers::Request,
                "anthropic-version",
                Some(ANTHROPIC_VERSION),
            );
        }
        if end_of_stream || !plan.body_varies {
            return Action::Continue;
        }
        self.rename = plan.model_name;
        if hold_headers {
            // Envoy hands the body of held headers to the filter only with the Wasm filter's
            // allow_on_headers_stop_iteration, rendered with pauseHeadersForBody: the
            // content-length then follows this attempt's body.
            self.declared = host
                .header(Headers::Request, "content-length")
                .and_then(|v| v.trim().parse().ok());
            self.holding = true;
            return Action::Pause;
        }
        // Without it a pause would hold the body in Envoy too: the headers go first, framed by
        // chunks (or HTTP/2 frames) on every attempt, and a renamed body follows once written.
        host.set_header(Headers::Request, "content-length", None);
        self.holding = self.rename.is_some();
        Action::Continue
    }

    /// A body chunk: held until the body is whole.
    pub fn on_request_body(
        &mut self,
        host: &dyn Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        if !self.holding {
            return Action::Continue;
        }
        self.buffered = body_size;
        if end_of_stream || self.declared == Some(body_size) {
            return self.finish_body(host);
        }
        Action::Pause
    }

    /// Request trailers end the body (HTTP/2 without END_STREAM on the last DATA, HTTP/1.1
    /// chunked with trailers).
    pub fn on_request_trailers(&mut self, host: &dyn Host) -> Action {
        if !self.holding {
            return Action::Continue;
        }
        self.finish_body(host)
    }

    /// The whole body is here: its `model` becomes the backend's name (when it has one) and a
    /// declared `content-length` its length.
    fn finish_body(&mut self, host: &dyn Host) -> Action {
        self.holding = false;
        let length = match self.rename.take() {
            Some(name) => match self.write_model(host, &name) {
                Some(length) => length,
                None => return Action::Pause,
            },
            None => self.buffered,
        };
        if self.declared.is_some() {
            host.set_header(
                Headers::Request,
                "content-length",
                Some(&length.to_string()),
            );
        }
        Action::Continue
    }

    /// Writes `name` into the body's `model`: the new length, or `None` once refused (a body
    /// that is not a JSON object cannot carry it: 400, and this attempt goes nowhere).
    fn write_model(&self, host: &dyn Host, name: &str) -> Option<usize> {
        let mut body = crate::host::read_body(host, Body::Request, self.buffered);
        let refusal = if body.len() == self.buffered {
            match crate::request_body::set_string_member(&mut body, "model", name) {
                Ok(()) => None,
                Err(_) => Some(Refusal::new(
                    Deny::InvalidBody,
                    "this backend takes its own model name in the body's model, and this request's body is not a JSON object",
                )),
            }
        } else {
            Some(Refusal::internal(
                "the gateway could not read the request body; retry",
            ))
        };
        if let Some(r) = refusal {
            refuse(host, None, &r);
            return None;
        }
        host.set_body(Body::Request, self.buffered, &body);
        Some(body.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::backend_order;
    use crate::cooldown::Cooled;
    use crate::host::recording::{Call, RecordingHost};
    use crate::state::Worker;
    use serde_json::json;
    use std::cell::RefCell;
    use std::rc::Rc;

    const CLUSTER: &str = "xds.cluster_name";
    const BACKEND: &str = "xds.upstream_host_metadata.filter_metadata.maas.backend";

    fn policy() -> PolicyDocument {
        PolicyDocument::from_value(json!({
            "tiers": [{"name": "free", "level": 0, "groups": ["g"]}],
            "models": [
                {"name": "gpt-4o", "path": "/llm/gpt-4o", "tiers": ["free"],
                 "upstreamCluster": "gpt-backends",
                 "backends": [
                    {"name": "a", "backend": "http://127.0.0.1:9001",
                     "provider": {"type": "openai", "credentialRef": "key-a"}},
                    {"name": "b", "backend": "http://127.0.0.1:9002",
                     "provider": {"type": "azure-openai", "credentialRef": "key-b"}},
                    {"name": "entra", "backend": "http://127.0.0.1:9003", "weight": 0,
                     "provider": {"type": "azure-openai", "credentialRef": "app",
                                  "auth": "azureClientCredentials"}},
                    {"name": "local", "backend": "http://127.0.0.1:9004"},
                    {"name": "nokey", "backend": "http://127.0.0.1:9005",
                     "provider": {"type": "openai", "credentialRef": "key-missing"}}
                 ]},
                {"name": "claude", "path": "/llm/claude", "tiers": ["free"], "api": "anthropic",
                 "upstreamCluster": "claude-backends",
                 "backends": [
                    {"name": "a", "backend": "http://127.0.0.1:9011",
                     "provider": {"type": "anthropic", "credentialRef": "ant"}}
                 ]},
                {"name": "single", "path": "/llm/single", "tiers": ["free"],
                 "upstreamCluster": "single", "backend": "http://127.0.0.1:9020"},
                {"name": "paths", "path": "/llm/paths", "tiers": ["free"],
                 "servedName": "gpt-4o-2024",
                 "upstreamCluster": "paths-backends",
                 "backends": [
                    {"name": "plain", "backend": "http://127.0.0.1:9031/base/",
                     "provider": {"type": "openai", "credentialRef": "key-a"}},
                    {"name": "azure", "backend": "http://127.0.0.1:9032",
                     "provider": {"type": "azure-openai", "credentialRef": "key-b",
                                  "deployment": "dep-1", "apiVersion": "2025-01-01-preview"}},
                    {"name": "local", "backend": "http://127.0.0.1:9034"}
                 ]},
                {"name": "renamed", "path": "/llm/renamed", "tiers": ["free"],
                 "servedName": "gpt-4o-2024",
                 "upstreamCluster": "renamed-backends",
                 "backends": [
                    {"name": "renamed", "backend": "http://127.0.0.1:9035",
                     "servedName": "meta-llama/Llama-3.1-8B",
                     "provider": {"type": "openai", "credentialRef": "key-a"}},
                    {"name": "plain", "backend": "http://127.0.0.1:9036"}
                 ]}
            ]
        }))
        .unwrap()
    }

    fn credentials() -> CredentialsDocument {
        serde_json::from_value(json!({
            "credentials": {"key-a": "KA", "key-b": "KB", "app": "TOKEN", "ant": "KANT"},
            "expires_at": {"app": 1000}
        }))
        .unwrap()
    }

    fn plan(cluster: &str, backend: &str, now: u64) -> Result<AttemptPlan, Refusal> {
        plan_attempt(
            Some(&policy()),
            &credentials(),
            Some(cluster),
            Some(backend),
            || now,
            || Some("/v1/chat/completions".into()),
        )
    }

    #[test]
    fn each_backend_gets_its_own_credential() {
        let set = |b: &str| plan("gpt-backends", b, 10).unwrap().set;
        assert_eq!(set("a"), [("authorization", "Bearer KA".to_string())]);
        assert_eq!(set("b"), [("api-key", "KB".to_string())]);
        assert_eq!(
            set("entra"),
            [("authorization", "Bearer TOKEN".to_string())]
        );
        assert_eq!(set("local"), [], "a backend without a provider gets none");
        let claude = plan("claude-backends", "a", 10).unwrap();
        assert_eq!(claude.set, [("x-api-key", "KANT".to_string())]);
        assert!(claude.anthropic_version);
        assert!(!plan("gpt-backends", "a", 10).unwrap().anthropic_version);
    }

    #[test]
    fn what_cannot_be_decided_is_refused_with_a_503() {
        for (cluster, backend, deny) in [
            // A backend's credential missing, or its token expired.
            ("gpt-backends", "nokey", Deny::ProviderCredentialMissing),
            ("gpt-backends", "ghost", Deny::UpstreamMismatch),
            // A name of another model's backend, none, or a cluster that is no backends
            // cluster (a single-backend model's, or unknown).
            ("gpt-backends", "", Deny::UpstreamMismatch),
            ("single", "a", Deny::UpstreamMismatch),
            ("elsewhere", "a", Deny::UpstreamMismatch),
        ] {
            let r = plan(cluster, backend, 10).unwrap_err();
            assert_eq!((r.deny, r.status), (deny, 503), "{cluster} {backend}");
        }
        let r = plan("gpt-backends", "entra", 1001).unwrap_err();
        assert_eq!(r.deny, Deny::ProviderCredentialMissing);
        assert!(r.message.contains("expired"), "{}", r.message);
        assert!(plan("gpt-backends", "entra", 1000).is_ok(), "to the second");
        let r = plan_attempt(
            None,
            &credentials(),
            Some("gpt-backends"),
            Some("a"),
            || 0,
            || None,
        );
        assert_eq!(r.unwrap_err().deny, Deny::NoPolicy);
        for (cluster, backend) in [(None, Some("a")), (Some("gpt-backends"), None)] {
            let r = plan_attempt(
                Some(&policy()),
                &credentials(),
                cluster,
                backend,
                || 0,
                || None,
            );
            assert_eq!(r.unwrap_err().deny, Deny::UpstreamMismatch);
        }
    }

    fn worker() -> SharedWorker {
        let w = Worker {
            policy: Some(Rc::new(policy())),
            credentials: Rc::new(credentials()),
            ..Worker::default()
        };
        Rc::new(RefCell::new(w))
    }

    /// The attempt's cluster and the endpoint Envoy chose, as the properties give them.
    fn route_to(host: &RecordingHost, cluster: &str, backend: &str) {
        let mut properties = host.properties.borrow_mut();
        properties.insert(CLUSTER.into(), cluster.into());
        properties.insert(BACKEND.into(), backend.into());
    }

    fn attempt(host: &RecordingHost, w: &SharedWorker, cluster: &str, backend: &str) -> bool {
        route_to(host, cluster, backend);
        host.clear_calls();
        Attempt::default().on_request_headers(host, w, false) == Action::Continue
    }

    /// Two attempts of one request share its headers (Envoy's): the second backend gets its
    /// own credential and nothing of the first's, nor the client's `api-key`.
    #[test]
    fn an_attempt_removes_every_other_credential_and_sets_its_own() {
        let host = RecordingHost::new();
        let w = worker();
        host.set_map(
            Headers::Request,
            &[(":path", "/v1/chat/completions"), ("api-key", "client-own")],
        );
        assert!(attempt(&host, &w, "gpt-backends", "a"));
        assert_eq!(
            host.map_value(Headers::Request, "authorization").as_deref(),
            Some("Bearer KA")
        );
        assert_eq!(host.map_value(Headers::Request, "api-key"), None);
        assert!(attempt(&host, &w, "gpt-backends", "b"));
        assert_eq!(
            host.map_value(Headers::Request, "api-key").as_deref(),
            Some("KB")
        );
        assert_eq!(host.map_value(Headers::Request, "authorization"), None);
        assert!(attempt(&host, &w, "gpt-backends", "local"));
        for name in PROVIDER_CREDENTIAL_HEADERS {
            assert_eq!(host.map_value(Headers::Request, name), None, "{name}");
        }
        assert!(host.sent.borrow().is_empty());
    }

    #[test]
    fn a_missing_credential_answers_503_and_forwards_nothing() {
        let host = RecordingHost::new();
        let w = worker();
        host.set_map(Headers::Request, &[("authorization", "Bearer KA")]);
        assert!(!attempt(&host, &w, "gpt-backends", "nokey"));
        let sent = host.last_sent().unwrap();
        assert_eq!(sent.status, 503);
        assert_eq!(sent.code(), "provider_credential_missing");
        assert!(
            host.calls
                .borrow()
                .iter()
                .all(|c| !matches!(c, Call::SetHeader(..))),
            "the headers are not touched: the attempt goes nowhere"
        );
    }

    /// A model with a backend whose provider has its own path scheme: every attempt gets its
    /// backend's path from the operation the path ends with — whatever an earlier attempt made
    /// of it — and the client's query is not passed on. A model without one never reads the
    /// path.
    #[test]
    fn each_attempt_gets_its_backends_path_whatever_the_previous_one_sent() {
        let azure_chat =
            "/openai/deployments/dep-1/chat/completions?api-version=2025-01-01-preview";
        let plan_with = |backend: &str, path: Option<&str>| {
            plan_attempt(
                Some(&policy()),
                &credentials(),
                Some("paths-backends"),
                Some(backend),
                || 10,
                || path.map(str::to_string),
            )
        };
        for (backend, current, sent) in [
            (
                "plain",
                "/base/v1/chat/completions?x=1",
                "/base/v1/chat/completions",
            ),
            ("azure", "/base/v1/chat/completions?x=1", azure_chat),
            // Failing over from the Azure attempt, to a plain backend and to one with no base.
            ("plain", azure_chat, "/base/v1/chat/completions"),
            ("local", azure_chat, "/v1/chat/completions"),
            ("azure", azure_chat, azure_chat),
            (
                "azure",
                "/v1/embeddings",
                "/openai/deployments/dep-1/embeddings?api-version=2025-01-01-preview",
            ),
            (
                "plain",
                "/openai/deployments/dep-1/completions?api-version=2025-01-01-preview",
                "/base/v1/completions",
            ),
        ] {
            let plan = plan_with(backend, Some(current)).unwrap();
            assert_eq!(
                plan.path.as_deref(),
                Some(sent),
                "{backend} after {current}"
            );
        }
        assert_eq!(
            plan_with("azure", Some("/v1/chat/completions"))
                .unwrap()
                .set,
            [("api-key", "KB".to_string())]
        );
        // A path that names no operation a scheme serves cannot be decided.
        for current in [None, Some("/v1/responses"), Some("/v1/chat/completions/x")] {
            let r = plan_with("plain", current).unwrap_err();
            assert_eq!(
                (r.deny, r.status),
                (Deny::UpstreamMismatch, 503),
                "{current:?}"
            );
        }
        let asked = std::cell::Cell::new(false);
        let plan = plan_attempt(
            Some(&policy()),
            &credentials(),
            Some("gpt-backends"),
            Some("a"),
            || 10,
            || {
                asked.set(true);
                None
            },
        )
        .unwrap();
        assert_eq!((plan.path, asked.get()), (None, false));
    }

    /// Through the shell: two attempts of one request share its headers; the second sets its
    /// own path over the first's (one `:path` read and write more per attempt, for such a
    /// model only).
    #[test]
    fn a_failover_sends_the_next_backend_its_own_path() {
        let host = RecordingHost::new();
        let w = worker();
        host.set_map(
            Headers::Request,
            &[
                (":path", "/base/v1/chat/completions"),
                ("api-key", "client"),
            ],
        );
        assert!(attempt(&host, &w, "paths-backends", "azure"));
        assert_eq!(host.call_count(), 8, "{:?}", host.calls.borrow());
        assert_eq!(
            host.map_value(Headers::Request, ":path").as_deref(),
            Some("/openai/deployments/dep-1/chat/completions?api-version=2025-01-01-preview")
        );
        assert!(attempt(&host, &w, "paths-backends", "plain"));
        assert_eq!(
            host.map_value(Headers::Request, ":path").as_deref(),
            Some("/base/v1/chat/completions")
        );
        assert_eq!(
            host.map_value(Headers::Request, "authorization").as_deref(),
            Some("Bearer KA")
        );
        assert_eq!(host.map_value(Headers::Request, "api-key"), None);
    }

    /// A backend with a served name of its own: the attempt's headers and body are held to the
    /// body's end, its `model` becomes that name and `content-length` follows. Each attempt
    /// starts from the router's copy of the body the downstream filter let go, so a backend
    /// without a name of its own passes the body untouched (never read).
    #[test]
    fn a_backend_with_its_own_served_name_gets_it_in_the_body() {
        let host = RecordingHost::new();
        let w = worker_holding_headers(true);
        let sent = br#"{"model":"gpt-4o-2024","messages":[]}"#;
        let renamed = br#"{"model":"meta-llama/Llama-3.1-8B","messages":[]}"#;
        let headers = |length: Option<usize>| {
            let mut h = vec![(":path".to_string(), "/v1/chat/completions".to_string())];
            if let Some(n) = length {
                h.push(("content-length".to_string(), n.to_string()));
            }
            h
        };
        let attempt_of = |backend: &str, length: Option<usize>| {
            let h = headers(length);
            let pairs: Vec<(&str, &str)> =
                h.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
            host.set_map(Headers::Request, &pairs);
            host.set_buffer(Body::Request, sent);
            route_to(&host, "renamed-backends", backend);
            let mut a = Attempt::default();
            let on_headers = a.on_request_headers(&host, &w, false);
            (a, on_headers)
        };
        // Declared length: written when the declared bytes are all here, END_STREAM or not.
        let (mut a, on_headers) = attempt_of("renamed", Some(sent.len()));
        assert_eq!(on_headers, Action::Pause, "headers held for the body");
        assert_eq!(a.on_request_body(&host, 10, false), Action::Pause);
        assert_eq!(
            a.on_request_body(&host, sent.len(), false),
            Action::Continue
        );
        assert_eq!(host.buffer(Body::Request), renamed);
        assert_eq!(
            host.map_value(Headers::Request, "content-length")
                .as_deref(),
            Some(renamed.len().to_string().as_str())
        );
        assert_eq!(
            a.on_request_body(&host, 0, true),
            Action::Continue,
            "written once"
        );
        assert_eq!(host.buffer(Body::Request), renamed);
        // No declared length (HTTP/2, chunked): at END_STREAM, or at trailers; none set.
        let (mut a, _) = attempt_of("renamed", None);
        assert_eq!(a.on_request_body(&host, sent.len(), true), Action::Continue);
        assert_eq!(host.buffer(Body::Request), renamed);
        assert_eq!(host.map_value(Headers::Request, "content-length"), None);
        let (mut a, _) = attempt_of("renamed", None);
        assert_eq!(a.on_request_body(&host, sent.len(), false), Action::Pause);
        assert_eq!(a.on_request_trailers(&host), Action::Continue);
        assert_eq!(host.buffer(Body::Request), renamed);
        // The next attempt, to a backend without a name of its own, finds the first one's
        // content-length in the shared headers: its body is held, never read, and the length
        // is its own again (one host call).
        let (mut a, on_headers) = attempt_of("plain", Some(renamed.len()));
        assert_eq!(on_headers, Action::Pause);
        host.clear_calls();
        assert_eq!(a.on_request_body(&host, sent.len(), true), Action::Continue);
        assert_eq!(a.on_request_trailers(&host), Action::Continue);
        assert_eq!(host.call_count(), 1);
        assert_eq!(host.buffer(Body::Request), sent);
        assert_eq!(
            host.map_value(Headers::Request, "content-length")
                .as_deref(),
            Some(sent.len().to_string().as_str())
        );
        // A model none of whose backends renames: nothing held (the paths model).
        host.set_map(Headers::Request, &[(":path", "/v1/chat/completions")]);
        route_to(&host, "paths-backends", "local");
        let mut a = Attempt::default();
        assert_eq!(a.on_request_headers(&host, &w, false), Action::Continue);
        host.clear_calls();
        assert_eq!(a.on_request_body(&host, sent.len(), true), Action::Continue);
        assert_eq!(host.call_count(), 0);
        // A body that is not a JSON object cannot carry the name: 400, not forwarded.
        let (mut a, _) = attempt_of("renamed", None);
        host.set_buffer(Body::Request, b"not json");
        assert_eq!(a.on_request_body(&host, 8, true), Action::Pause);
        let refused = host.last_sent().unwrap();
        assert_eq!(
            (refused.status, refused.code().as_str()),
            (400, "invalid_body")
        );
        assert_eq!(host.buffer(Body::Request), b"not json");
        // A request without a body (headers end the stream): nothing to hold.
        let h = headers(None);
        let pairs: Vec<(&str, &str)> = h.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        host.set_map(Headers::Request, &pairs);
        assert_eq!(
            Attempt::default().on_request_headers(&host, &w, true),
            Action::Continue
        );
    }

    /// Without `pauseHeadersForBody` (and Envoy's allow_on_headers_stop_iteration) a held
    /// attempt's body would stay in Envoy: the headers go first without a `content-length`
    /// (the new body's length is not known yet), and only the body is held to its end.
    #[test]
    fn without_held_headers_the_renamed_body_follows_headers_sent_first() {
        let host = RecordingHost::new();
        let w = worker_holding_headers(false);
        let sent = br#"{"model":"x","messages":[]}"#;
        host.set_map(
            Headers::Request,
            &[
                (":path", "/v1/chat/completions"),
                ("content-length", &sent.len().to_string()),
            ],
        );
        host.set_buffer(Body::Request, sent);
        route_to(&host, "renamed-backends", "renamed");
        let mut a = Attempt::default();
        assert_eq!(a.on_request_headers(&host, &w, false), Action::Continue);
        assert_eq!(host.map_value(Headers::Request, "content-length"), None);
        // Every declared byte here, END_STREAM not yet: nothing declared any more, so held on.
        assert_eq!(a.on_request_body(&host, sent.len(), false), Action::Pause);
        assert_eq!(a.on_request_body(&host, sent.len(), true), Action::Continue);
        assert_eq!(
            host.buffer(Body::Request),
            br#"{"model":"meta-llama/Llama-3.1-8B","messages":[]}"#
        );
        assert_eq!(host.map_value(Headers::Request, "content-length"), None);
    }

    fn worker_holding_headers(hold: bool) -> SharedWorker {
        let w = worker();
        let cfg = crate::config::PluginConfig::parse(
            json!({"companion": {"cluster": "c"}, "upstream": true, "pauseHeadersForBody": hold})
                .to_string()
                .as_bytes(),
        )
        .unwrap();
        w.borrow_mut().config = Some(Rc::new(cfg));
        w
    }

    #[test]
    fn a_backends_served_name_is_checked_with_the_policy() {
        let mut doc = serde_json::to_value(policy()).unwrap();
        doc["models"][4]["backends"][0]["servedName"] = json!("bad\nname");
        let e = PolicyDocument::from_value(doc).unwrap_err();
        assert!(
            e.to_string().contains("models[4].backends[0].servedName"),
            "{e}"
        );
    }

    /// The order of the backends Envoy tries: only those that can serve, the first by weight.
    #[test]
    fn the_backend_order_leaves_out_backends_without_their_credential() {
        let p = policy();
        let gpt = &p.models[0];
        let creds = credentials();
        // a (weight 1), b (1), local (1) usable; entra has weight 0; nokey has no key.
        let firsts: Vec<String> = (0..3)
            .map(|d| {
                backend_order(gpt, &creds, &Cooled::default(), 10, || d)
                    .unwrap()
                    .unwrap()
            })
            .collect();
        assert_eq!(
            firsts,
            [
                "127.0.0.1:9001,127.0.0.1:9002,127.0.0.1:9004",
                "127.0.0.1:9002,127.0.0.1:9001,127.0.0.1:9004",
                "127.0.0.1:9004,127.0.0.1:9001,127.0.0.1:9002",
            ]
        );
        assert_eq!(
            backend_order(gpt, &creds, &Cooled::default(), 10, || 3)
                .unwrap()
                .unwrap(),
            firsts[0]
        );
        // Without any credential only the backend that needs none is left.
        let none = CredentialsDocument::default();
        assert_eq!(
            backend_order(gpt, &none, &Cooled::default(), 10, || 7)
                .unwrap()
                .as_deref(),
            Some("127.0.0.1:9004")
        );
        // No backend that can serve: refused before anything leaves.
        let claude = &p.models[1];
        let r = backend_order(claude, &none, &Cooled::default(), 10, || 0).unwrap_err();
        assert_eq!((r.deny, r.status), (Deny::ProviderCredentialMissing, 503));
        assert_eq!(
            backend_order(claude, &creds, &Cooled::default(), 10, || 0)
                .unwrap()
                .as_deref(),
            Some("127.0.0.1:9011")
        );
        // Nothing to steer: a model without provider backends, or names the header cannot
        // carry (Envoy's weighted round robin chooses).
        assert_eq!(
            backend_order(&p.models[2], &creds, &Cooled::default(), 10, || 0).unwrap(),
            None
        );
        let mut named = claude.clone();
        named.backends[0].backend = Some("https://api.anthropic.com".into());
        assert_eq!(
            backend_order(&named, &creds, &Cooled::default(), 10, || 0).unwrap(),
            None
        );
        // Weights: 3:1 draws pick the heavier three times in four.
        let mut heavy = claude.clone();
        heavy.backends[0].weight = 3;
        let mut second = heavy.backends[0].clone();
        second.name = "b".into();
        second.weight = 1;
        second.backend = Some("http://127.0.0.1:9012/base".into());
        heavy.backends.push(second);
        let heads: Vec<bool> = (0..4)
            .map(|d| {
                backend_order(&heavy, &creds, &Cooled::default(), 10, || d)
                    .unwrap()
                    .unwrap()
                    .starts_with("127.0.0.1:9011,")
            })
            .collect();
        assert_eq!(heads, [true, true, true, false]);
    }

    /// A backend cooling down is listed after every other one that can serve, drawn first only
    /// when all of them are cooling; once its cooldown is over it is drawn by weight again.
    #[test]
    fn a_cooling_backend_is_tried_after_every_other_one() {
        let p = policy();
        let gpt = &p.models[0];
        let creds = credentials();
        let rule = gpt.cooldown_rule().unwrap();
        assert_eq!((rule.failures, rule.seconds), (3, 30), "the default");
        let mut c = crate::cooldown::Cooldowns::default();
        for _ in 0..3 {
            c.record("127.0.0.1:9001", true, rule, &mut || 10);
        }
        let order = |c: &crate::cooldown::Cooldowns, now: u64, d: u64| {
            backend_order(gpt, &creds, &c.cooled(), now, || d)
                .unwrap()
                .unwrap()
        };
        assert_eq!(
            order(&c, 10, 0),
            "127.0.0.1:9002,127.0.0.1:9004,127.0.0.1:9001"
        );
        assert_eq!(
            order(&c, 39, 1),
            "127.0.0.1:9004,127.0.0.1:9002,127.0.0.1:9001"
        );
        assert_eq!(
            order(&c, 40, 0),
            "127.0.0.1:9001,127.0.0.1:9002,127.0.0.1:9004"
        );
        for e in ["127.0.0.1:9002", "127.0.0.1:9004"] {
            for _ in 0..3 {
                c.record(e, true, rule, &mut || 10);
            }
        }
        assert_eq!(
            order(&c, 10, 1),
            "127.0.0.1:9002,127.0.0.1:9001,127.0.0.1:9004",
            "all cooling: drawn by weight among all"
        );
        // `failures: 0` turns it off; a model without backends has none.
        let mut off = gpt.clone();
        off.cooldown = Some(maas_types::policy::Cooldown {
            failures: 0,
            duration: "30s".into(),
        });
        assert_eq!(off.cooldown_rule(), None);
        assert_eq!(p.models[2].cooldown_rule(), None);
    }

    /// The host-call budget of an attempt: 2 property reads + 4 header writes; the clock only
    /// for a credential with an expiry; `anthropic-version` read (and set when absent) for an
    /// Anthropic backend.
    #[test]
    fn host_calls_per_attempt() {
        let host = RecordingHost::new();
        host.now.set(10_000);
        let w = worker();
        host.set_map(Headers::Request, &[(":path", "/v1/chat/completions")]);
        for (cluster, backend, calls) in [
            ("gpt-backends", "a", 6),
            ("gpt-backends", "local", 6),
            ("gpt-backends", "entra", 7),
            ("claude-backends", "a", 8),
        ] {
            assert!(attempt(&host, &w, cluster, backend));
            assert_eq!(
                host.call_count(),
                calls,
                "{backend}: {:?}",
                host.calls.borrow()
            );
        }
        // With the client's own `anthropic-version`: read, kept.
        host.set_map(Headers::Request, &[("anthropic-version", "2023-01-01")]);
        assert!(attempt(&host, &w, "claude-backends", "a"));
        assert_eq!(host.call_count(), 7);
        assert_eq!(
            host.map_value(Headers::Request, "anthropic-version")
                .as_deref(),
            Some("2023-01-01")
        );
    }
}
