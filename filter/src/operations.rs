//! Which (method, path) pairs are forwarded to a model, and whether Envoy routed the request to
//! the model's own upstream.
//!
//! A model serves only an allow-list of operations: the policy's `operations` when given, else
//! the defaults of its API family (`openai`: chat/completions, completions, embeddings,
//! responses, models; `anthropic`: messages, models). Everything else under the model's prefix
//! (`/v1/files`, `/v1/fine_tuning/jobs`, vLLM's `/v1/load_lora_adapter`, `/metrics`, …) is a 404
//! that never reaches the backend, so the provider credential is only spent on what the gateway
//! meters. The path reaching this module is already checked by [`crate::path::classify`]
//! (absolute, no empty / dot / encoded segments, query stripped); matching is exact and
//! case-sensitive, segment by segment, `*` standing for one segment. The method must match
//! exactly (`HEAD` / `OPTIONS` only when listed).

use crate::response::{Deny, Refusal};
use maas_types::{ApiFamily, Model};

/// What a forwarded request does, for the decisions that depend on it (e.g. whether the body
/// may carry `stream_options`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// `POST /v1/chat/completions`
    ChatCompletions,
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/embeddings`
    Embeddings,
    /// `POST /v1/responses`
    Responses,
    /// `POST /v1/messages` (Anthropic)
    Messages,
    /// `POST /v1/messages/count_tokens` (Anthropic): generates nothing, so unmetered.
    CountTokens,
    /// `GET /v1/models`, `GET /v1/models/{id}` (discovery)
    Models,
    /// Any other operation the policy lists for the model.
    Custom,
}

impl Operation {
    /// The operation as metrics and traces name it (OpenTelemetry's `gen_ai.operation.name`
    /// where it has one: `chat`, `text_completion`, `embeddings`).
    pub fn metric_name(self) -> &'static str {
        match self {
            Operation::ChatCompletions | Operation::Messages => "chat",
            Operation::Completions => "text_completion",
            Operation::Embeddings => "embeddings",
            Operation::Responses => "responses",
            Operation::CountTokens => "count_tokens",
            Operation::Models => "models",
            Operation::Custom => "custom",
        }
    }

    /// Only OpenAI chat/completions and completions accept `stream_options.include_usage`.
    pub fn accepts_stream_options(self) -> bool {
        matches!(self, Operation::ChatCompletions | Operation::Completions)
    }

    /// The body field that caps what the operation generates, as the backend reads it: the
    /// field the gateway sets on a request that names no cap
    /// ([`maas_types::UncappedRequests::Inject`]). Chat sent to OpenAI or Azure OpenAI gets
    /// `max_completion_tokens` (their reasoning models refuse `max_tokens`); any other chat
    /// backend `max_tokens`, which every OpenAI-compatible server reads (vLLM and SGLang read
    /// `max_completion_tokens or max_tokens`). `None`: the operation generates nothing to cap,
    /// or its body is not an API the gateway models.
    pub fn cap_field(self, provider: Option<maas_types::ProviderKind>) -> Option<&'static str> {
        use maas_types::ProviderKind;
        match self {
            Operation::ChatCompletions => match provider {
                Some(ProviderKind::Openai | ProviderKind::AzureOpenai) => {
                    Some("max_completion_tokens")
                }
                _ => Some("max_tokens"),
            },
            Operation::Completions | Operation::Messages => Some("max_tokens"),
            Operation::Responses => Some("max_output_tokens"),
            Operation::Embeddings
            | Operation::CountTokens
            | Operation::Models
            | Operation::Custom => None,
        }
    }

    /// Model discovery: authenticated, never counted.
    pub fn is_discovery(self) -> bool {
        self == Operation::Models
    }

    /// Generates no tokens (Anthropic `count_tokens`): counted as a request in the request
    /// windows (as Anthropic rate-limits it by requests, not tokens), no token reserved or
    /// settled, its response not scanned for usage.
    pub fn is_unmetered(self) -> bool {
        self == Operation::CountTokens
    }
}

/// (method, path relative to the model prefix) pairs of an API family's defaults.
const OPENAI_DEFAULTS: &[(&str, &str)] = &[
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/*"),
];

/// An `anthropic` model also serves OpenAI chat clients, translated ([`translates`]).
const ANTHROPIC_DEFAULTS: &[(&str, &str)] = &[
    ("POST", "/v1/messages"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/messages/count_tokens"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/*"),
];

/// An OpenAI chat request to a model whose backend speaks Anthropic Messages (API family
/// `anthropic`): translated to `POST /v1/messages` and back ([`crate::translate`]).
pub fn translates(operation: Operation, model: &Model) -> bool {
    operation == Operation::ChatCompletions && model.api_family() == ApiFamily::Anthropic
}

/// An OpenAI chat request to a model of provider type `bedrock`: translated to Converse and
/// signed ([`crate::translate::converse`]).
pub fn converses(operation: Operation, model: &Model) -> bool {
    operation == Operation::ChatCompletions
        && model
            .provider
            .as_ref()
            .is_some_and(|p| p.kind == maas_types::ProviderKind::Bedrock)
}

/// An OpenAI chat request to Gemini on Vertex AI (provider `vertex`, `publisher: google`):
/// translated to `generateContent` ([`crate::translate::gemini`]).
pub fn generates_content(operation: Operation, model: &Model) -> bool {
    operation == Operation::ChatCompletions
        && model
            .provider
            .as_ref()
            .is_some_and(|p| p.publisher == Some(maas_types::VertexPublisher::Google))
}

/// The default operations of an API family.
pub fn defaults(api: ApiFamily) -> &'static [(&'static str, &'static str)] {
    match api {
        ApiFamily::Openai => OPENAI_DEFAULTS,
        ApiFamily::Anthropic => ANTHROPIC_DEFAULTS,
    }
}

/// `rest` (a path relative to the model prefix) matches `pattern` segment by segment; `*` is
/// one non-empty segment.
fn path_matches(pattern: &str, rest: &str) -> bool {
    // Without a wildcard a pattern matches only itself (segment by segment is equality).
    if pattern == rest {
        return true;
    }
    if !pattern.as_bytes().contains(&b'*') {
        return false;
    }
    let mut p = pattern.split('/');
    let mut r = rest.split('/');
    loop {
        match (p.next(), r.next()) {
            (None, None) => return true,
            (Some("*"), Some(seg)) if !seg.is_empty() => {}
            (Some(a), Some(b)) if a == b => {}
            _ => return false,
        }
    }
}

/// The kind of an allowed operation, from its method and relative path.
fn kind(method: &str, rest: &str) -> Operation {
    match (method, rest) {
        ("POST", "/v1/chat/completions") => Operation::ChatCompletions,
        ("POST", "/v1/completions") => Operation::Completions,
        ("POST", "/v1/embeddings") => Operation::Embeddings,
        ("POST", "/v1/responses") => Operation::Responses,
        ("POST", "/v1/messages") => Operation::Messages,
        ("POST", "/v1/messages/count_tokens") => Operation::CountTokens,
        ("GET", r) if path_matches("/v1/models", r) || path_matches("/v1/models/*", r) => {
            Operation::Models
        }
        _ => Operation::Custom,
    }
}

fn not_allowed(model: &Model) -> Refusal {
    Refusal::new(
        Deny::OperationNotAllowed,
        format!(
            "this method and path are not served for model {}",
            model.name
        ),
    )
}

/// The operation a request performs on `model`, or the 404 that refuses it. `path` is the
/// request path with its query stripped, as [`crate::path::classify`] returned it, and lies
/// under `model.path` (as `PolicyDocument::model_for_path` found it).
pub fn allowed(model: &Model, method: &str, path: &str) -> Result<Operation, Refusal> {
    let Some(rest) = path.strip_prefix(model.path.as_str()) else {
        return Err(not_allowed(model));
    };
    if !rest.starts_with('/') {
        // The model prefix itself, or not at a segment boundary.
        return Err(not_allowed(model));
    }
    allowed_rest(model, method, rest)
}

/// [`allowed`] for a path relative to the model's prefix (`/v1/chat/completions`): what the
/// one base URL asks of the model the body names.
pub fn allowed_rest(model: &Model, method: &str, rest: &str) -> Result<Operation, Refusal> {
    let listed = match &model.operations {
        Some(ops) => ops
            .iter()
            .any(|op| op.method == method && path_matches(&op.path, rest)),
        None => defaults(model.api_family())
            .iter()
            .any(|(m, p)| *m == method && path_matches(p, rest)),
    };
    if listed {
        Ok(kind(method, rest))
    } else {
        Err(not_allowed(model))
    }
}

/// What the one base URL (`{gateway}/v1/…`) serves: the model operations whose model the body
/// names, and the gateway's own list of the caller's models.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OneUrl<'p> {
    /// A model operation: its kind and its path, which is also its path relative to a model's
    /// prefix (what the model's `operations` allow-list is matched against).
    Model(Operation, &'static str),
    /// `GET /v1/models`: the models the caller may use.
    List,
    /// `GET /v1/models/{id}`: one of them (the id may hold `/`).
    Retrieve(&'p str),
}

/// The model operations of the one base URL: `POST` each (the body names the model).
const ONE_URL_OPERATIONS: [(&str, Operation); 6] = [
    ("/v1/chat/completions", Operation::ChatCompletions),
    ("/v1/completions", Operation::Completions),
    ("/v1/embeddings", Operation::Embeddings),
    ("/v1/responses", Operation::Responses),
    ("/v1/messages", Operation::Messages),
    ("/v1/messages/count_tokens", Operation::CountTokens),
];

/// The one base URL's discovery path.
const ONE_URL_MODELS: &str = "/v1/models";

/// What a request to the one base URL asks for: `None` when `path` (query stripped, as
/// [`crate::path::classify`] returned it) is none of its paths; a 404 `operation_not_allowed`
/// for one of its paths with another method (`GET /v1/chat/completions`). Matching is exact
/// and case-sensitive, as for a model's operations.
pub fn one_url<'p>(method: &str, path: &'p str) -> Option<Result<OneUrl<'p>, Refusal>> {
    let refuse = || {
        Refusal::new(
            Deny::OperationNotAllowed,
            format!("{method} is not served at {path}"),
        )
    };
    if let Some((p, op)) = ONE_URL_OPERATIONS.iter().find(|(p, _)| *p == path) {
        return Some(if method == "POST" {
            Ok(OneUrl::Model(*op, p))
        } else {
            Err(refuse())
        });
    }
    let id = match path.strip_prefix(ONE_URL_MODELS)? {
        "" => None,
        rest => Some(rest.strip_prefix('/').filter(|id| !id.is_empty())?),
    };
    Some(match (method, id) {
        ("GET", None) => Ok(OneUrl::List),
        ("GET", Some(id)) => Ok(OneUrl::Retrieve(id)),
        _ => Err(refuse()),
    })
}

/// Envoy property naming the cluster the route picked for the request.
pub const CLUSTER_PROPERTY: [&str; 2] = ["xds", "cluster_name"];

/// Whether the request goes to the model's own upstream. `routed_cluster` is called only when
/// the model names one (`upstreamCluster`) or has a provider; it returns Envoy's
/// `xds.cluster_name` for the request (`None`: unreadable). A provider model without an
/// `upstreamCluster`, an unreadable cluster or another cluster: 503 `upstream_mismatch`.
pub fn check_upstream(
    model: &Model,
    routed_cluster: impl FnOnce() -> Option<String>,
) -> Result<(), Refusal> {
    let expected = match (&model.upstream_cluster, &model.provider) {
        (Some(c), _) => c.as_str(),
        // Policy validation requires upstreamCluster with a provider; never inject blindly.
        (None, Some(_)) => return Err(mismatch(model)),
        (None, None) => return Ok(()),
    };
    match routed_cluster() {
        Some(actual) if actual == expected => Ok(()),
        _ => Err(mismatch(model)),
    }
}

fn mismatch(model: &Model) -> Refusal {
    Refusal::new(
        Deny::UpstreamMismatch,
        format!(
            "the gateway routed this request away from model {}'s upstream; it was not forwarded",
            model.name
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use maas_types::PolicyDocument;
    use serde_json::json;

    fn policy() -> PolicyDocument {
        PolicyDocument::from_value(json!({
            "tiers": [{"name": "free", "level": 0, "groups": ["g"]}],
            "models": [
                {"name": "local", "path": "/llm/local", "tiers": ["free"]},
                {"name": "gpt", "path": "/ext/gpt", "tiers": ["free"],
                 "provider": {"type": "openai", "credentialRef": "k"},
                 "upstreamCluster": "outbound|443||api.openai.com"},
                {"name": "claude", "path": "/ext/claude", "tiers": ["free"],
                 "provider": {"type": "anthropic", "credentialRef": "k2"},
                 "upstreamCluster": "outbound|443||api.anthropic.com"},
                {"name": "custom", "path": "/llm/custom", "tiers": ["free"],
                 "upstreamCluster": "outbound|8000||custom.llm.svc.cluster.local",
                 "operations": [
                     {"method": "POST", "path": "/v1/audio/transcriptions"},
                     {"method": "POST", "path": "/v1/chat/completions"},
                     {"method": "GET", "path": "/v1/jobs/*/status"}
                 ]}
            ]
        }))
        .unwrap()
    }

    fn model<'a>(p: &'a PolicyDocument, name: &str) -> &'a Model {
        p.model(name).unwrap()
    }

    fn check(p: &PolicyDocument, name: &str, method: &str, rest: &str) -> Result<Operation, u32> {
        let m = model(p, name);
        allowed(m, method, &format!("{}{rest}", m.path)).map_err(|r| {
            assert_eq!(r.code, "operation_not_allowed");
            r.status
        })
    }

    #[test]
    fn openai_defaults_allow_only_metered_operations() {
        let p = policy();
        for name in ["local", "gpt"] {
            assert_eq!(
                check(&p, name, "POST", "/v1/chat/completions"),
                Ok(Operation::ChatCompletions)
            );
            assert_eq!(
                check(&p, name, "POST", "/v1/completions"),
                Ok(Operation::Completions)
            );
            assert_eq!(
                check(&p, name, "POST", "/v1/embeddings"),
                Ok(Operation::Embeddings)
            );
            assert_eq!(
                check(&p, name, "POST", "/v1/responses"),
                Ok(Operation::Responses)
            );
            assert_eq!(check(&p, name, "GET", "/v1/models"), Ok(Operation::Models));
            assert_eq!(
                check(&p, name, "GET", "/v1/models/gpt-4o"),
                Ok(Operation::Models)
            );
            for (method, rest) in [
                ("GET", "/v1/files"),
                ("POST", "/v1/files"),
                ("DELETE", "/v1/files/file-abc"),
                ("POST", "/v1/fine_tuning/jobs"),
                ("POST", "/v1/batches"),
                ("POST", "/v1/messages"),
                ("POST", "/v1/load_lora_adapter"),
                ("POST", "/reset_prefix_cache"),
                ("POST", "/sleep"),
                ("POST", "/start_profile"),
                ("GET", "/metrics"),
                ("GET", "/v1/chat/completions"),
                ("HEAD", "/v1/models"),
                ("OPTIONS", "/v1/chat/completions"),
                ("post", "/v1/chat/completions"),
                ("POST", "/V1/chat/completions"),
                ("POST", "/v1/chat/completions/"),
                ("POST", "/v1/chat/completions/x"),
                ("POST", "/v1/chat"),
                ("DELETE", "/v1/models/gpt-4o"),
                ("GET", "/v1/models/a/b"),
                ("GET", "/v1/models/"),
                ("POST", "/v1/models"),
                ("GET", ""),
                ("GET", "/"),
            ] {
                assert_eq!(
                    check(&p, name, method, rest),
                    Err(404),
                    "{name} {method} {rest:?}"
                );
            }
        }
    }

    #[test]
    fn anthropic_defaults_are_messages_and_models() {
        let p = policy();
        assert_eq!(
            check(&p, "claude", "POST", "/v1/messages"),
            Ok(Operation::Messages)
        );
        assert_eq!(
            check(&p, "claude", "GET", "/v1/models"),
            Ok(Operation::Models)
        );
        assert_eq!(
            check(&p, "claude", "GET", "/v1/models/claude-x"),
            Ok(Operation::Models)
        );
        assert_eq!(
            check(&p, "claude", "POST", "/v1/messages/count_tokens"),
            Ok(Operation::CountTokens)
        );
        assert!(Operation::CountTokens.is_unmetered());
        assert!(!Operation::Messages.is_unmetered());
        // OpenAI chat clients too, translated to Messages.
        assert_eq!(
            check(&p, "claude", "POST", "/v1/chat/completions"),
            Ok(Operation::ChatCompletions)
        );
        let claude = p.models.iter().find(|m| m.name == "claude").unwrap();
        assert!(translates(Operation::ChatCompletions, claude));
        assert!(!translates(Operation::Messages, claude));
        let local = p.models.iter().find(|m| m.name == "local").unwrap();
        assert!(!translates(Operation::ChatCompletions, local));
        for (method, rest) in [
            ("POST", "/v1/completions"),
            ("POST", "/v1/messages/batches"),
            ("GET", "/v1/messages/count_tokens"),
            ("GET", "/v1/files"),
        ] {
            assert_eq!(
                check(&p, "claude", method, rest),
                Err(404),
                "{method} {rest}"
            );
        }
    }

    #[test]
    fn explicit_api_family_overrides_the_provider_default() {
        let mut p = policy();
        p.models[2].api = Some(ApiFamily::Openai);
        assert_eq!(
            check(&p, "claude", "POST", "/v1/chat/completions"),
            Ok(Operation::ChatCompletions)
        );
        assert_eq!(check(&p, "claude", "POST", "/v1/messages"), Err(404));
        p.models[0].api = Some(ApiFamily::Anthropic);
        assert_eq!(
            check(&p, "local", "POST", "/v1/messages"),
            Ok(Operation::Messages)
        );
    }

    #[test]
    fn policy_operations_replace_the_defaults() {
        let p = policy();
        assert_eq!(
            check(&p, "custom", "POST", "/v1/audio/transcriptions"),
            Ok(Operation::Custom)
        );
        assert_eq!(
            check(&p, "custom", "POST", "/v1/chat/completions"),
            Ok(Operation::ChatCompletions),
            "a listed well-known operation keeps its kind"
        );
        assert_eq!(
            check(&p, "custom", "GET", "/v1/jobs/j-1/status"),
            Ok(Operation::Custom)
        );
        for (method, rest) in [
            ("POST", "/v1/completions"),
            ("GET", "/v1/models"),
            ("GET", "/v1/jobs/status"),
            ("GET", "/v1/jobs/a/b/status"),
            ("GET", "/v1/jobs//status"),
        ] {
            assert_eq!(
                check(&p, "custom", method, rest),
                Err(404),
                "{method} {rest}"
            );
        }
    }

    #[test]
    fn the_one_base_url_serves_model_operations_and_the_model_list() {
        for (path, op) in ONE_URL_OPERATIONS {
            assert_eq!(one_url("POST", path), Some(Ok(OneUrl::Model(op, path))));
            for method in ["GET", "PUT", "post", "HEAD"] {
                let r = one_url(method, path).unwrap().unwrap_err();
                assert_eq!(
                    (r.status, r.code),
                    (404, "operation_not_allowed"),
                    "{method} {path}"
                );
            }
        }
        assert_eq!(one_url("GET", "/v1/models"), Some(Ok(OneUrl::List)));
        assert_eq!(
            one_url("GET", "/v1/models/publishers/llm/models/opt"),
            Some(Ok(OneUrl::Retrieve("publishers/llm/models/opt")))
        );
        assert_eq!(
            one_url("GET", "/v1/models/gpt-4o"),
            Some(Ok(OneUrl::Retrieve("gpt-4o")))
        );
        assert!(matches!(one_url("POST", "/v1/models"), Some(Err(_))));
        assert!(matches!(one_url("DELETE", "/v1/models/x"), Some(Err(_))));
        for other in [
            "/v1/models/",
            "/v1/modelsx",
            "/v1/chat/completions/",
            "/v1/chat",
            "/V1/chat/completions",
            "/v1/files",
            "/v1/messages/batches",
            "/llm/sim/v1/chat/completions",
            "/v1",
            "/",
        ] {
            assert_eq!(one_url("POST", other), None, "{other}");
            assert_eq!(one_url("GET", other), None, "{other}");
        }
        // A model operation at the one base URL is matched against the model's allow-list.
        let p = policy();
        assert_eq!(
            allowed_rest(model(&p, "gpt"), "POST", "/v1/chat/completions"),
            Ok(Operation::ChatCompletions)
        );
        // An anthropic model serves OpenAI chat clients too (translated).
        assert_eq!(
            allowed_rest(model(&p, "claude"), "POST", "/v1/chat/completions"),
            Ok(Operation::ChatCompletions)
        );
        assert_eq!(
            allowed_rest(model(&p, "claude"), "POST", "/v1/completions")
                .unwrap_err()
                .code,
            "operation_not_allowed"
        );
        assert_eq!(
            allowed_rest(model(&p, "claude"), "POST", "/v1/messages/count_tokens"),
            Ok(Operation::CountTokens)
        );
        assert!(allowed_rest(model(&p, "custom"), "POST", "/v1/completions").is_err());
    }

    #[test]
    fn a_path_outside_the_prefix_is_refused() {
        let p = policy();
        let m = model(&p, "gpt");
        assert!(allowed(m, "POST", "/ext/gptx/v1/chat/completions").is_err());
        assert!(allowed(m, "POST", "/other/v1/chat/completions").is_err());
    }

    #[test]
    fn only_completions_accept_stream_options() {
        let yes: Vec<_> = [
            Operation::ChatCompletions,
            Operation::Completions,
            Operation::Embeddings,
            Operation::Responses,
            Operation::Messages,
            Operation::Models,
            Operation::Custom,
        ]
        .into_iter()
        .filter(|o| o.accepts_stream_options())
        .collect();
        assert_eq!(
            yes,
            vec![Operation::ChatCompletions, Operation::Completions]
        );
        assert!(Operation::Models.is_discovery());
        assert!(!Operation::ChatCompletions.is_discovery());
    }

    #[test]
    fn provider_credential_goes_only_to_the_models_cluster() {
        let p = policy();
        let gpt = model(&p, "gpt");
        assert_eq!(
            check_upstream(gpt, || Some("outbound|443||api.openai.com".into())),
            Ok(())
        );
        for got in [
            Some("attacker"),
            Some("outbound|443||api.openai.com.evil"),
            Some(""),
            None,
        ] {
            let r = check_upstream(gpt, || got.map(str::to_string)).unwrap_err();
            assert_eq!((r.status, r.code), (503, "upstream_mismatch"), "{got:?}");
        }
        // On-cluster models: checked when named, not read otherwise.
        let custom = model(&p, "custom");
        assert!(check_upstream(custom, || Some("model-sim".into())).is_err());
        assert!(check_upstream(custom, || None).is_err());
        let local = model(&p, "local");
        assert_eq!(
            check_upstream(local, || panic!("must not read the property")),
            Ok(())
        );
        // A provider model that somehow lacks upstreamCluster is never forwarded.
        let mut unnamed = gpt.clone();
        unnamed.upstream_cluster = None;
        assert!(check_upstream(&unnamed, || Some("outbound|443||api.openai.com".into())).is_err());
    }

    proptest::proptest! {
        /// Whatever the path, only the listed (method, path) pairs pass.
        #[test]
        fn only_listed_pairs_pass(method in "[A-Z]{1,7}", rest in "(/[a-z0-9_*.]{0,12}){0,5}") {
            let p = policy();
            let m = model(&p, "gpt");
            if let Ok(op) = allowed(m, &method, &format!("{}{rest}", m.path)) {
                let listed = OPENAI_DEFAULTS.iter().any(|(dm, dp)| *dm == method && path_matches(dp, &rest));
                proptest::prop_assert!(listed, "{method} {rest} passed as {op:?}");
            }
        }

        /// The exact-match shortcut decides as the segment-by-segment comparison would.
        #[test]
        fn path_matching_is_the_segment_comparison(
            pattern in "(/(\\*|[ab]{0,2})){0,4}",
            rest in "(/[ab*]{0,2}){0,4}",
        ) {
            let by_segments = {
                let (mut p, mut r) = (pattern.split('/'), rest.split('/'));
                loop {
                    match (p.next(), r.next()) {
                        (None, None) => break true,
                        (Some("*"), Some(seg)) if !seg.is_empty() => {}
                        (Some(a), Some(b)) if a == b => {}
                        _ => break false,
                    }
                }
            };
            proptest::prop_assert_eq!(path_matches(&pattern, &rest), by_segments);
        }
    }
}
