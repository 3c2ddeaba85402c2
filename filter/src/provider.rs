//! Where a provider's request goes: the provider's own path for the OpenAI-shaped operation the
//! client called (Azure OpenAI deployments, Vertex AI's OpenAI-compatible endpoint, a Vertex AI
//! partner model's own endpoint), from the model's policy. A plain function over plain data; the request state machine sets the result
//! as `:path` (with the routing header, so Envoy routes the rewritten path to the model's
//! cluster, see [`crate::admission::authorize`]).
//!
//! The client's query string is not passed on: the provider's path carries only what the
//! gateway decided (Azure's `api-version`), so a client cannot pick another API version or add
//! parameters the gateway does not meter.

use crate::operations::Operation;
use crate::response::{Deny, Refusal};
use maas_types::{Provider, ProviderPath, VertexPublisher};

/// The path to send instead of the client's, when the model's provider has its own path scheme
/// (`None`: the path goes as the client sent it). An operation the provider's scheme has no
/// path for is refused (404 `operation_not_allowed`), never forwarded to a path the provider
/// would answer otherwise. `model_id`: the model's id at the provider (its served name, else its
/// name); `stream`: the body asked for a stream (a partner model streams at another method).
/// Bedrock's path names the model id too.
pub fn upstream_path(
    provider: Option<&Provider>,
    model_id: &str,
    operation: Operation,
    stream: bool,
) -> Result<Option<String>, Refusal> {
    if let Some(fixed) = own_path(provider, operation) {
        return Ok(Some(fixed.to_string()));
    }
    let Some(scheme) = provider.and_then(Provider::path) else {
        return Ok(None);
    };
    match scheme {
        ProviderPath::AzureDeployment {
            deployment,
            api_version,
        } => {
            let op = openai_segments(operation)?;
            Ok(Some(format!(
                "/openai/deployments/{deployment}/{op}?api-version={api_version}"
            )))
        }
        ProviderPath::VertexOpenapi { project, location } => {
            serves(&scheme, operation)?;
            Ok(Some(format!(
                "/v1/projects/{project}/locations/{location}/endpoints/openapi/chat/completions"
            )))
        }
        ProviderPath::VertexPublisher {
            project,
            location,
            publisher,
        } => {
            serves(&scheme, operation)?;
            // Anthropic: chat is translated to Messages first (the model's API family is
            // Anthropic). Google: chat is translated to generateContent; its stream is SSE
            // only with `alt=sse` (else one JSON array).
            let method = match (publisher, stream) {
                (VertexPublisher::Anthropic, false) => "rawPredict",
                (VertexPublisher::Anthropic, true) => "streamRawPredict",
                (VertexPublisher::Google, false) => "generateContent",
                (VertexPublisher::Google, true) => "streamGenerateContent?alt=sse",
            };
            Ok(Some(format!(
                "/v1/projects/{project}/locations/{location}/publishers/{}/models/{model_id}:{method}",
                publisher.as_str()
            )))
        }
        // The non-streamed path until the body says (`bedrock_path` at forwarding).
        ProviderPath::Bedrock { .. } => match operation {
            Operation::ChatCompletions => Ok(Some(bedrock_path(model_id, false))),
            _ => Err(not_served("chat/completions")),
        },
    }
}

/// The provider's own chat path (the reference's binding `path`), for chat and Messages.
fn own_path(provider: Option<&Provider>, operation: Operation) -> Option<&str> {
    matches!(operation, Operation::ChatCompletions | Operation::Messages)
        .then(|| provider?.path.as_deref())
        .flatten()
}

/// Whether the provider has a path for `operation` ([`upstream_path`] would give one, or the
/// path goes as sent), without building it.
pub fn has_path_for(provider: Option<&Provider>, operation: Operation) -> Result<(), Refusal> {
    if own_path(provider, operation).is_some() {
        return Ok(());
    }
    provider
        .and_then(Provider::path)
        .map_or(Ok(()), |scheme| serves(&scheme, operation))
}

/// Refuses (404 `operation_not_allowed`) an operation the provider's path scheme has no path
/// for, as [`upstream_path`] does, without building the path: a model with several backends
/// serves only what each of its backends with such a scheme serves.
pub fn serves(scheme: &ProviderPath<'_>, operation: Operation) -> Result<(), Refusal> {
    match scheme {
        ProviderPath::AzureDeployment { .. } => openai_segments(operation).map(|_| ()),
        ProviderPath::VertexOpenapi { .. } | ProviderPath::Bedrock { .. } => match operation {
            Operation::ChatCompletions => Ok(()),
            _ => Err(not_served("chat/completions")),
        },
        ProviderPath::VertexPublisher {
            publisher: VertexPublisher::Anthropic,
            ..
        } => match operation {
            Operation::Messages | Operation::ChatCompletions => Ok(()),
            _ => Err(not_served("messages and chat/completions")),
        },
        ProviderPath::VertexPublisher {
            publisher: VertexPublisher::Google,
            ..
        } => match operation {
            Operation::ChatCompletions => Ok(()),
            _ => Err(not_served("chat/completions")),
        },
    }
}

/// A model with several backends serves what each of its backends with traffic and a path
/// scheme of its own serves (the upstream filter sets each attempt's path, see
/// [`crate::upstream::plan_attempt`]): so no attempt meets a backend without a path for it.
pub fn every_backend_serves(
    model: &maas_types::Model,
    operation: Operation,
) -> Result<(), Refusal> {
    model
        .backends
        .iter()
        .filter(|b| b.weight > 0)
        .filter_map(|b| b.provider.as_ref()?.path())
        .try_for_each(|scheme| serves(&scheme, operation))
}

/// The path of an OpenAI operation after `/v1/` (and after an Azure deployment), for the
/// operations a provider path scheme can serve.
fn openai_segments(operation: Operation) -> Result<&'static str, Refusal> {
    match operation {
        Operation::ChatCompletions => Ok("chat/completions"),
        Operation::Completions => Ok("completions"),
        Operation::Embeddings => Ok("embeddings"),
        _ => Err(not_served("chat/completions, completions and embeddings")),
    }
}

/// The operation an upstream path ends with, the query aside (`…/chat/completions`,
/// `…/completions`, `…/embeddings`): what an upstream attempt reads from a path an earlier
/// attempt may have rewritten to its own backend's scheme. `None`: none of them.
pub fn operation_of_path(path: &str) -> Option<Operation> {
    let path = path.split_once('?').map_or(path, |(p, _)| p);
    if path.ends_with("/chat/completions") {
        Some(Operation::ChatCompletions)
    } else if path.ends_with("/completions") {
        Some(Operation::Completions)
    } else if path.ends_with("/embeddings") {
        Some(Operation::Embeddings)
    } else {
        None
    }
}

/// The path of an OpenAI operation at a backend without a path scheme of its own: its base
/// path (the backend URL's path) then `/v1/…`, as the model's route rewrites the client's
/// path; the client's query is not passed on (as to a provider with its own scheme).
pub fn openai_path(base: &str, operation: Operation) -> Result<String, Refusal> {
    let op = openai_segments(operation)?;
    Ok(format!("{}/v1/{op}", base.trim_end_matches('/')))
}

/// Whether the model's upstream path depends on the body's `stream` (known only once the body
/// is read: the headers must wait for it).
pub fn path_follows_stream(provider: Option<&Provider>) -> bool {
    matches!(
        provider.and_then(Provider::path),
        Some(ProviderPath::VertexPublisher { .. })
    )
}

/// Bedrock's Converse path of a model id (URI-encoded once: `:` as `%3A`, `/` of an ARN as
/// `%2F`), `converse-stream` when the client asked for a stream.
pub fn bedrock_path(model_id: &str, stream: bool) -> String {
    let op = if stream {
        "converse-stream"
    } else {
        "converse"
    };
    format!("/model/{}/{op}", crate::sigv4::uri_encode(model_id, false))
}

/// Bedrock's host of a region.
pub fn bedrock_host(region: &str) -> String {
    format!("bedrock-runtime.{region}.amazonaws.com")
}

fn not_served(served: &str) -> Refusal {
    Refusal::new(
        Deny::OperationNotAllowed,
        format!("this operation is not served for this model: its provider serves {served}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use maas_types::{ProviderAuth, ProviderKind};

    fn azure(deployment: Option<&str>, api_version: Option<&str>) -> Provider {
        Provider {
            deployment: deployment.map(str::to_string),
            api_version: api_version.map(str::to_string),
            ..Provider::api_key(ProviderKind::AzureOpenai, "k".into())
        }
    }

    fn vertex() -> Provider {
        Provider {
            auth: ProviderAuth::GcpServiceAccount,
            project: Some("proj-1".into()),
            location: Some("us-central1".into()),
            ..Provider::api_key(ProviderKind::Vertex, "sa".into())
        }
    }

    #[test]
    fn azure_deployments_get_their_path_and_api_version() {
        let p = azure(Some("gpt-4o"), None);
        for (op, path) in [
            (
                Operation::ChatCompletions,
                "/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21",
            ),
            (
                Operation::Completions,
                "/openai/deployments/gpt-4o/completions?api-version=2024-10-21",
            ),
            (
                Operation::Embeddings,
                "/openai/deployments/gpt-4o/embeddings?api-version=2024-10-21",
            ),
        ] {
            assert_eq!(
                upstream_path(Some(&p), "m", op, false).unwrap().as_deref(),
                Some(path)
            );
        }
        let p = azure(Some("d"), Some("2025-01-01-preview"));
        assert_eq!(
            upstream_path(Some(&p), "m", Operation::ChatCompletions, false)
                .unwrap()
                .as_deref(),
            Some("/openai/deployments/d/chat/completions?api-version=2025-01-01-preview")
        );
        for op in [Operation::Responses, Operation::Models, Operation::Custom] {
            let r = upstream_path(Some(&p), "m", op, false).unwrap_err();
            assert_eq!(r.deny, Deny::OperationNotAllowed, "{op:?}");
        }
    }

    #[test]
    fn vertex_gets_its_project_and_location_path() {
        assert_eq!(
            upstream_path(Some(&vertex()), "m", Operation::ChatCompletions, false)
                .unwrap()
                .as_deref(),
            Some("/v1/projects/proj-1/locations/us-central1/endpoints/openapi/chat/completions")
        );
        for op in [
            Operation::Embeddings,
            Operation::Completions,
            Operation::Models,
        ] {
            assert!(
                upstream_path(Some(&vertex()), "m", op, false).is_err(),
                "{op:?}"
            );
        }
    }

    #[test]
    fn bedrock_gets_the_converse_path_of_its_model_id() {
        let p = Provider {
            auth: ProviderAuth::AwsSigV4,
            region: Some("us-east-1".into()),
            ..Provider::api_key(ProviderKind::Bedrock, "aws".into())
        };
        assert_eq!(
            upstream_path(
                Some(&p),
                "anthropic.claude-3-haiku-20240307-v1:0",
                Operation::ChatCompletions,
                false
            )
            .unwrap()
            .as_deref(),
            Some("/model/anthropic.claude-3-haiku-20240307-v1%3A0/converse")
        );
        assert_eq!(
            bedrock_path("a/b:1", true),
            "/model/a%2Fb%3A1/converse-stream"
        );
        assert_eq!(
            bedrock_host("eu-west-1"),
            "bedrock-runtime.eu-west-1.amazonaws.com"
        );
        for op in [
            Operation::Embeddings,
            Operation::Completions,
            Operation::Models,
        ] {
            assert!(upstream_path(Some(&p), "m", op, false).is_err(), "{op:?}");
        }
    }

    #[test]
    fn a_vertex_partner_model_gets_its_publisher_path_by_stream() {
        let claude = Provider {
            publisher: Some(maas_types::VertexPublisher::Anthropic),
            ..vertex()
        };
        let base = "/v1/projects/proj-1/locations/us-central1/publishers/anthropic/models/claude-sonnet-4@20250514";
        for op in [Operation::Messages, Operation::ChatCompletions] {
            for (stream, method) in [(false, "rawPredict"), (true, "streamRawPredict")] {
                assert_eq!(
                    upstream_path(Some(&claude), "claude-sonnet-4@20250514", op, stream)
                        .unwrap()
                        .as_deref(),
                    Some(format!("{base}:{method}").as_str()),
                    "{op:?}"
                );
            }
        }
        for op in [
            Operation::CountTokens,
            Operation::Embeddings,
            Operation::Responses,
            Operation::Custom,
        ] {
            let r = upstream_path(Some(&claude), "c", op, false).unwrap_err();
            assert_eq!(r.deny, Deny::OperationNotAllowed, "{op:?}");
        }
        assert!(path_follows_stream(Some(&claude)));
        assert!(!path_follows_stream(Some(&vertex())));
        assert!(!path_follows_stream(None));
    }

    #[test]
    fn without_a_path_scheme_the_path_goes_as_sent() {
        assert_eq!(
            upstream_path(None, "m", Operation::ChatCompletions, false).unwrap(),
            None
        );
        // Azure without a deployment, Vertex without project/location, OpenAI: as before.
        let plain = [
            azure(None, None),
            Provider::api_key(ProviderKind::Vertex, "k".into()),
            Provider::api_key(ProviderKind::Openai, "k".into()),
        ];
        for p in &plain {
            for op in [
                Operation::ChatCompletions,
                Operation::Models,
                Operation::Custom,
            ] {
                assert_eq!(upstream_path(Some(p), "m", op, true).unwrap(), None);
            }
        }
    }
}
