//! Providers with their own path scheme (issue 29): the OpenAI path the client calls, at the
//! model's prefix or at the one base URL, leaves as the provider's (`:path`), with the routing
//! header that routes it to the model's cluster, the client's query string dropped, and the
//! access token of a cloud credential as a bearer token.

use super::*;

fn provider_policy() -> Value {
    let mut p = policy();
    p["tiers"][0]["limits"] = json!({"requests": [{"limit": 1000, "window": "1m"}],
                                     "tokens": [{"limit": 1000000, "window": "1m"}]});
    p["models"] = json!([
        {"name": "az", "path": "/ext/az", "tiers": ["free"],
         "provider": {"type": "azure-openai", "credentialRef": "k", "deployment": "gpt-4o-prod",
                      "apiVersion": "2024-10-21"},
         "upstreamCluster": "ext-az"},
        {"name": "az-entra", "path": "/ext/az-entra", "tiers": ["free"],
         "provider": {"type": "azure-openai", "credentialRef": "k", "deployment": "d",
                      "auth": "azureClientCredentials"},
         "upstreamCluster": "ext-az-entra"},
        {"name": "oai", "path": "/ext/oai", "tiers": ["free"],
         "provider": {"type": "openai", "credentialRef": "k"},
         "upstreamCluster": "ext-az"},
        {"name": "vx", "path": "/ext/vx", "tiers": ["free"],
         "provider": {"type": "vertex", "credentialRef": "k", "auth": "gcpServiceAccount",
                      "project": "proj-1", "location": "us-central1"},
         "upstreamCluster": "ext-vx"},
        {"name": "claude-vx", "path": "/ext/claude-vx", "tiers": ["free"],
         "servedName": "claude-sonnet-4@20250514",
         "provider": {"type": "vertex", "credentialRef": "k", "auth": "gcpServiceAccount",
                      "project": "proj-1", "location": "us-central1", "publisher": "anthropic"},
         "upstreamCluster": "ext-claude-vx"},
        {"name": "gw", "path": "/ext/gw", "tiers": ["free"],
         "provider": {"type": "openai", "credentialRef": "k", "path": "/gateway/v1/chat/completions"},
         "upstreamCluster": "ext-gw"},
        {"name": "claude-gw", "path": "/ext/claude-gw", "tiers": ["free"],
         "provider": {"type": "anthropic", "credentialRef": "k", "path": "/gateway/v1/messages"},
         "upstreamCluster": "ext-claude-gw"},
        {"name": "duo", "path": "/ext/duo", "tiers": ["free"], "upstreamCluster": "duo-backends",
         "backends": [
            {"name": "plain", "backend": "http://127.0.0.1:9031",
             "provider": {"type": "openai", "credentialRef": "k"}},
            {"name": "vx", "backend": "http://127.0.0.1:9032",
             "provider": {"type": "vertex", "credentialRef": "k", "auth": "gcpServiceAccount",
                          "project": "proj-1", "location": "us-central1"}}
         ]}
    ]);
    p
}

fn fx() -> Fx {
    let fx = Fx::with(json!({"pauseHeadersForBody": true, "bootstrapPolicy": provider_policy()}));
    fx.cache(&key(2), allow_alice());
    fx
}

fn request(path: &str) -> Vec<(&'static str, String)> {
    vec![
        (":method", "POST".into()),
        (":path", path.into()),
        ("authorization", format!("Bearer {}", key(2))),
        ("content-type", "application/json".into()),
        ("api-key", "client-sent".into()),
    ]
}

/// Sends `path` with a body naming `model`; the request goes on. Returns what left.
fn forwarded(fx: &Fx, path: &str, model: &str, cluster: &str) -> (Option<String>, Option<String>) {
    fx.host
        .properties
        .borrow_mut()
        .insert("xds.cluster_name".into(), cluster.into());
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&request(path)), false);
    let body = format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}]}}"#);
    let a = fx.body(id, &h, body.as_bytes(), true);
    assert_eq!(a, Action::Continue, "{path}: {:?}", fx.sent_to(id));
    (
        fx.host.map_value(Headers::Request, ":path"),
        fx.host.map_value(Headers::Request, "x-maas-model"),
    )
}

#[test]
fn azure_gets_its_deployment_path_at_both_urls() {
    let fx = fx();
    for path in [
        "/ext/az/v1/chat/completions?api-version=1999-01-01&x=1",
        "/v1/chat/completions",
    ] {
        let (sent, routing) = forwarded(&fx, path, "az", "ext-az");
        assert_eq!(
            sent.as_deref(),
            Some("/openai/deployments/gpt-4o-prod/chat/completions?api-version=2024-10-21"),
            "{path}"
        );
        assert_eq!(routing.as_deref(), Some("az"), "{path}");
        // The provider key in Azure's header, the client's own replaced.
        assert_eq!(
            fx.host.map_value(Headers::Request, "api-key").as_deref(),
            Some("sk-provider")
        );
        assert_eq!(fx.host.map_value(Headers::Request, "authorization"), None);
    }
    let (sent, _) = forwarded(&fx, "/ext/az/v1/embeddings", "az", "ext-az");
    assert_eq!(
        sent.as_deref(),
        Some("/openai/deployments/gpt-4o-prod/embeddings?api-version=2024-10-21")
    );
}

#[test]
fn vertex_gets_its_project_path_and_a_bearer_token() {
    let fx = fx();
    for path in ["/ext/vx/v1/chat/completions", "/v1/chat/completions"] {
        let (sent, routing) = forwarded(&fx, path, "vx", "ext-vx");
        assert_eq!(
            sent.as_deref(),
            Some("/v1/projects/proj-1/locations/us-central1/endpoints/openapi/chat/completions"),
            "{path}"
        );
        assert_eq!(routing.as_deref(), Some("vx"));
        assert_eq!(
            fx.host
                .map_value(Headers::Request, "authorization")
                .as_deref(),
            Some("Bearer sk-provider")
        );
    }
}

#[test]
fn an_operation_the_provider_has_no_path_for_is_refused_404() {
    let fx = fx();
    fx.host
        .properties
        .borrow_mut()
        .insert("xds.cluster_name".into(), "ext-vx".into());
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&request("/ext/vx/v1/embeddings")), false);
    fx.body(id, &h, br#"{"model":"vx","input":"hi"}"#, true);
    let s = fx.sent_to(id).expect("refused");
    assert_eq!(
        (s.status, s.code().as_str()),
        (404, "operation_not_allowed")
    );
}

/// A model with several backends serves only what each backend with a path scheme of its own
/// serves (Vertex's OpenAI-compatible endpoint: chat only); the path of what it serves is left
/// to the upstream filter, per attempt.
#[test]
fn several_backends_serve_what_each_backends_path_scheme_serves() {
    let fx = fx();
    let (sent, _) = forwarded(&fx, "/ext/duo/v1/chat/completions", "duo", "duo-backends");
    assert_eq!(sent.as_deref(), Some("/ext/duo/v1/chat/completions"));
    assert!(
        fx.host
            .map_value(Headers::Request, maas_types::BACKEND_ORDER_HEADER)
            .is_some()
    );
    for path in ["/ext/duo/v1/embeddings", "/v1/embeddings"] {
        let (id, h) = fx.http();
        fx.headers(id, &h, &refs(&request(path)), false);
        fx.body(id, &h, br#"{"model":"duo","input":"hi"}"#, true);
        let s = fx.sent_to(id).expect("refused");
        assert_eq!(
            (s.status, s.code().as_str()),
            (404, "operation_not_allowed"),
            "{path}"
        );
    }
}

#[test]
fn an_entra_token_goes_as_bearer_and_the_clients_api_key_never_beside_it() {
    let fx = fx();
    let (sent, _) = forwarded(
        &fx,
        "/ext/az-entra/v1/chat/completions",
        "az-entra",
        "ext-az-entra",
    );
    assert_eq!(
        sent.as_deref(),
        Some("/openai/deployments/d/chat/completions?api-version=2024-10-21")
    );
    assert_eq!(
        fx.host
            .map_value(Headers::Request, "authorization")
            .as_deref(),
        Some("Bearer sk-provider")
    );
    assert_eq!(fx.host.map_value(Headers::Request, "api-key"), None);
}

#[test]
fn an_expired_access_token_is_never_sent() {
    let fx = fx();
    let doc = |expires_at: u64| {
        Rc::new(CredentialsDocument {
            credentials: [("k".to_string(), "tok".to_string())].into(),
            expires_at: [("k".to_string(), expires_at)].into(),
            ..Default::default()
        })
    };
    fx.root.worker.borrow_mut().credentials = doc(u64::MAX);
    forwarded(&fx, "/ext/vx/v1/chat/completions", "vx", "ext-vx");
    assert_eq!(
        fx.host
            .map_value(Headers::Request, "authorization")
            .as_deref(),
        Some("Bearer tok")
    );
    // Expired the second before the clock's: refused (the second itself is not refused, the
    // companion rounds the expiry down).
    let now = fx.host.now.get() / 1000;
    fx.root.worker.borrow_mut().credentials = doc(now);
    forwarded(&fx, "/ext/vx/v1/chat/completions", "vx", "ext-vx");
    fx.root.worker.borrow_mut().credentials = doc(now - 1);
    let (id, h) = fx.http();
    fx.headers(
        id,
        &h,
        &refs(&request("/ext/vx/v1/chat/completions")),
        false,
    );
    fx.body(id, &h, br#"{"model":"vx","messages":[]}"#, true);
    let s = fx.sent_to(id).expect("refused");
    assert_eq!(
        (s.status, s.code().as_str()),
        (503, "provider_credential_missing")
    );
}

/// At the model's prefix the rewritten path is routed again by Envoy: the cluster that answers
/// is checked at the response too (as at the one base URL).
#[test]
fn a_rewritten_path_is_checked_again_at_the_response() {
    for (cluster, passes) in [("ext-az", true), ("someone-else", false)] {
        let fx = fx();
        fx.host
            .properties
            .borrow_mut()
            .insert("xds.cluster_name".into(), "ext-az".into());
        let (id, h) = fx.http();
        fx.headers(
            id,
            &h,
            &refs(&request("/ext/az/v1/chat/completions")),
            false,
        );
        let a = fx.body(id, &h, br#"{"model":"az","messages":[]}"#, true);
        assert_eq!(a, Action::Continue);
        fx.host
            .properties
            .borrow_mut()
            .insert("xds.cluster_name".into(), cluster.into());
        fx.host.enter(id);
        fx.host.set_map(
            Headers::Response,
            &[(":status", "200"), ("content-type", "application/json")],
        );
        let a = h.on_response_headers(&fx.host);
        if passes {
            assert_eq!(a, Action::Continue);
            assert!(fx.sent_to(id).is_none());
        } else {
            assert_eq!(a, Action::Pause);
            let s = fx.sent_to(id).unwrap();
            assert_eq!((s.status, s.code().as_str()), (503, "upstream_mismatch"));
        }
    }
}

/// What a provider path costs in host calls: a request to a provider with a path scheme makes
/// exactly two more header writes (`:path`, the routing header) and one more property read (the
/// cluster at the response) than the same request to a provider without one; requests to other
/// models pay nothing (`respond::host_calls_per_request_stay_within_budget` is unchanged).
#[test]
fn a_provider_path_costs_two_header_writes_and_one_property_read() {
    use crate::host::recording::Call;
    let fx = fx();
    let calls = |path: &str, model: &str| {
        forwarded(&fx, path, model, "ext-az"); // warm: this worker's copy of the credential
        fx.host
            .properties
            .borrow_mut()
            .insert("xds.cluster_name".into(), "ext-az".into());
        let (id, h) = fx.http();
        fx.host.clear_calls();
        // Without a client `api-key` (removed for one provider, replaced for the other).
        let mut sent = request(path);
        sent.retain(|(n, _)| *n != "api-key");
        fx.headers(id, &h, &refs(&sent), false);
        let body = format!(r#"{{"model":"{model}","messages":[]}}"#);
        fx.body(id, &h, body.as_bytes(), true);
        fx.host.enter(id);
        fx.host.set_map(
            Headers::Response,
            &[(":status", "200"), ("content-type", "application/json")],
        );
        h.on_response_headers(&fx.host);
        let calls = fx.host.calls.borrow().clone();
        let count = |f: &dyn Fn(&Call) -> bool| calls.iter().filter(|c| f(c)).count();
        (
            calls.len(),
            count(&|c| matches!(c, Call::SetHeader(Headers::Request, _, _))),
            count(&|c| matches!(c, Call::Property(_))),
        )
    };
    let (plain, plain_sets, plain_props) = calls("/ext/oai/v1/chat/completions", "oai");
    let (az, az_sets, az_props) = calls("/ext/az/v1/chat/completions", "az");
    eprintln!("provider without a path scheme: {plain} calls; azure deployment path: {az} calls");
    assert_eq!(az_sets, plain_sets + 2);
    assert_eq!(az_props, plain_props + 1);
    assert_eq!(az, plain + 3);
}

const CLAUDE_ON_VERTEX: &str = "/v1/projects/proj-1/locations/us-central1/publishers/anthropic/models/claude-sonnet-4@20250514";

/// Claude on Vertex AI: an OpenAI chat client (translated) and an Anthropic client, at the
/// model's prefix and at the one base URL, reach Vertex's rawPredict (streamRawPredict for a
/// stream) with a Messages body that names no model and carries Vertex's `anthropic_version`,
/// and a bearer token; no `anthropic-version` header.
#[test]
fn claude_on_vertex_gets_its_publisher_path_by_stream_and_its_body() {
    let fx = fx();
    fx.host
        .properties
        .borrow_mut()
        .insert("xds.cluster_name".into(), "ext-claude-vx".into());
    let cases = [
        ("/ext/claude-vx/v1/chat/completions", false),
        ("/ext/claude-vx/v1/chat/completions", true),
        ("/v1/chat/completions", true),
        ("/ext/claude-vx/v1/messages", true),
        ("/v1/messages", false),
    ];
    for (path, stream) in cases {
        let (id, h) = fx.http();
        fx.headers(id, &h, &refs(&request(path)), false);
        let body = json!({"model": "claude-vx", "max_tokens": 20, "stream": stream,
                          "messages": [{"role": "user", "content": "hi"}]});
        let a = fx.body(id, &h, body.to_string().as_bytes(), true);
        assert_eq!(a, Action::Continue, "{path}: {:?}", fx.sent_to(id));
        let method = if stream {
            "streamRawPredict"
        } else {
            "rawPredict"
        };
        assert_eq!(
            fx.host.map_value(Headers::Request, ":path"),
            Some(format!("{CLAUDE_ON_VERTEX}:{method}")),
            "{path} stream={stream}"
        );
        assert_eq!(
            fx.host.map_value(Headers::Request, "anthropic-version"),
            None
        );
        assert_eq!(
            fx.host
                .map_value(Headers::Request, "authorization")
                .as_deref(),
            Some("Bearer sk-provider")
        );
        let sent: Value = serde_json::from_slice(&fx.host.buffer(Body::Request)).unwrap();
        assert!(sent.get("model").is_none(), "{path}: {sent}");
        assert_eq!(sent["anthropic_version"], "vertex-2023-10-16", "{path}");
        assert_eq!(sent["max_tokens"], 20, "{path}");
        assert_eq!(sent["messages"][0]["content"], "hi", "{path}");
    }
    // count_tokens has no path here: refused, never sent elsewhere.
    let (id, h) = fx.http();
    fx.headers(
        id,
        &h,
        &refs(&request("/ext/claude-vx/v1/messages/count_tokens")),
        false,
    );
    fx.body(id, &h, br#"{"model":"claude-vx","messages":[]}"#, true);
    let s = fx.sent_to(id).expect("refused");
    assert_eq!(
        (s.status, s.code().as_str()),
        (404, "operation_not_allowed")
    );
}

/// Without the headers held for the body, a stream's path cannot be chosen: refused, never
/// sent to the non-stream method.
#[test]
fn claude_on_vertex_refuses_a_stream_it_cannot_route() {
    let fx = Fx::with(json!({"pauseHeadersForBody": false, "bootstrapPolicy": provider_policy()}));
    fx.cache(&key(2), allow_alice());
    fx.host
        .properties
        .borrow_mut()
        .insert("xds.cluster_name".into(), "ext-claude-vx".into());
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&request("/ext/claude-vx/v1/messages")), false);
    fx.body(
        id,
        &h,
        br#"{"model":"claude-vx","max_tokens":5,"stream":true,"messages":[]}"#,
        true,
    );
    let s = fx.sent_to(id).expect("refused");
    assert_eq!(s.status, 503, "{:?}", s);
}

/// A provider's own chat path (the reference's binding `path`): chat at both URL forms leaves
/// at that path with the routing header (Envoy routes it again; checked at the response), an
/// OpenAI chat request translated to Messages too (with Anthropic's version, not at
/// `/v1/messages`); another operation keeps the path as sent.
#[test]
fn a_providers_own_chat_path_replaces_the_chat_path_only() {
    let fx = fx();
    for path in ["/ext/gw/v1/chat/completions", "/v1/chat/completions"] {
        let (sent, routing) = forwarded(&fx, path, "gw", "ext-gw");
        assert_eq!(
            sent.as_deref(),
            Some("/gateway/v1/chat/completions"),
            "{path}"
        );
        assert_eq!(routing.as_deref(), Some("gw"), "{path}");
    }
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&request("/ext/gw/v1/embeddings")), false);
    fx.body(id, &h, br#"{"model":"gw","input":"hi"}"#, true);
    assert!(fx.sent_to(id).is_none(), "{:?}", fx.sent_to(id));
    assert_eq!(
        fx.host.map_value(Headers::Request, ":path").as_deref(),
        Some("/ext/gw/v1/embeddings")
    );
    for path in ["/ext/claude-gw/v1/chat/completions", "/v1/chat/completions"] {
        let (sent, routing) = forwarded(&fx, path, "claude-gw", "ext-claude-gw");
        assert_eq!(sent.as_deref(), Some("/gateway/v1/messages"), "{path}");
        assert_eq!(routing.as_deref(), Some("claude-gw"));
        assert!(
            fx.host
                .map_value(Headers::Request, "anthropic-version")
                .is_some()
        );
    }
    // Routed again: an answer from another cluster is not passed on.
    fx.host
        .properties
        .borrow_mut()
        .insert("xds.cluster_name".into(), "ext-gw".into());
    let (id, h) = fx.http();
    fx.headers(
        id,
        &h,
        &refs(&request("/ext/gw/v1/chat/completions")),
        false,
    );
    fx.body(id, &h, br#"{"model":"gw","messages":[]}"#, true);
    assert!(fx.sent_to(id).is_none(), "{:?}", fx.sent_to(id));
    fx.host
        .properties
        .borrow_mut()
        .insert("xds.cluster_name".into(), "elsewhere".into());
    fx.host.enter(id);
    fx.host.set_map(
        Headers::Response,
        &[(":status", "200"), ("content-type", "application/json")],
    );
    assert_eq!(h.on_response_headers(&fx.host), Action::Pause);
    assert_eq!(
        fx.sent_to(id).map(|s| s.code()).as_deref(),
        Some("upstream_mismatch")
    );
}
