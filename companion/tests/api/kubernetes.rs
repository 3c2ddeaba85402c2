//! The Kubernetes paths (TokenReview identity, Secret credentials) through the real `kube`
//! client, against a small local HTTPS stand-in for the API server that speaks the real
//! `authentication.k8s.io/v1` TokenReview and `v1` Secret JSON, and (for the policy from the
//! reference's resources, `resources.rs`) list + watch of `maas.opendatahub.io/v1alpha1` and
//! `inference.opendatahub.io/v1alpha1` resources (kept by group and plural: both groups have
//! `externalmodels`) with resource versions, and `events.k8s.io/v1` Event creation. A cluster
//! without the `inference.opendatahub.io` CRDs ([`Calls::without_inference_crds`]) answers their
//! paths 404 as the API server does.

use crate::helpers::{IDENTITIES, create_database, local_policy, spawn_with_config};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, patch, post};
use axum::{Json, Router};
use maas_companion::settings::{
    AdminSarSettings, CredentialsSettings, IdentityProvider, OidcSettings,
};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The `maas.opendatahub.io` resources held by the stand-in: objects, and every change with its
/// resource version (what a watch from a version replays), plus the Events written.
#[derive(Default)]
pub(crate) struct Cluster {
    version: u64,
    /// (group/plural, namespace, name) → object.
    objects: std::collections::BTreeMap<(String, String, String), Value>,
    /// (resource version, group/plural, namespace, ADDED|MODIFIED|DELETED, object).
    history: Vec<(u64, String, String, &'static str, Value)>,
    pub events: Vec<Value>,
    /// The object after each `status` patch, in order.
    pub status_patches: Vec<Value>,
}

#[derive(Default)]
pub(crate) struct Calls {
    token_reviews: AtomicUsize,
    secret_gets: AtomicUsize,
    access_reviews: AtomicUsize,
    /// The `api-key` of Secret `maas/openai-key` once rotated (else `sk-from-secret`).
    rotated_key: std::sync::Mutex<Option<String>>,
    /// Secret reads answer 500 (an API server in trouble).
    fail_secrets: std::sync::atomic::AtomicBool,
    /// `spec.audiences` of the last TokenReview.
    requested_audiences: std::sync::Mutex<Value>,
    pub cluster: std::sync::Mutex<Cluster>,
    /// Wakes the open watches when the cluster changes.
    changed: tokio::sync::Notify,
    /// The `inference.opendatahub.io` CRDs are not installed: their paths answer 404.
    pub inference_crds_absent: std::sync::atomic::AtomicBool,
    /// List requests of `inference.opendatahub.io` resources answered (any status).
    pub inference_lists: AtomicUsize,
}

const MAAS: &str = "maas.opendatahub.io";
const INFERENCE: &str = "inference.opendatahub.io";

/// `<group>/<plural>` of an object's `apiVersion` and `kind`: the key of the stand-in's store.
fn resource_of(api_version: &str, kind: &str) -> String {
    let group = api_version.split('/').next().unwrap_or_default();
    let plural = match (group, kind) {
        (MAAS, "MaaSModelRef") => "maasmodelrefs",
        (MAAS | INFERENCE, "ExternalModel") => "externalmodels",
        (INFERENCE, "ExternalProvider") => "externalproviders",
        (MAAS, "MaaSAuthPolicy") => "maasauthpolicies",
        (MAAS, "MaaSSubscription") => "maassubscriptions",
        other => panic!("the stand-in does not serve {other:?}"),
    };
    format!("{group}/{plural}")
}

/// The group of a kind for [`Calls::delete`] (ExternalModel: `maas.opendatahub.io`'s).
fn group_of(kind: &str) -> &'static str {
    match kind {
        "ExternalProvider" => INFERENCE,
        _ => MAAS,
    }
}

impl Calls {
    /// A cluster without the `inference.opendatahub.io` CRDs.
    pub(crate) fn without_inference_crds() -> Calls {
        let calls = Calls::default();
        calls.inference_crds_absent.store(true, Ordering::SeqCst);
        calls
    }

    /// Creates or replaces an object (as `kubectl apply`): new resource version, a watch event.
    pub(crate) fn apply(&self, mut object: Value) {
        let plural = resource_of(
            object["apiVersion"].as_str().unwrap(),
            object["kind"].as_str().unwrap(),
        );
        let ns = object["metadata"]["namespace"]
            .as_str()
            .unwrap()
            .to_string();
        let name = object["metadata"]["name"].as_str().unwrap().to_string();
        {
            let mut c = self.cluster.lock().unwrap();
            c.version += 1;
            let version = c.version;
            let key = (plural.clone(), ns.clone(), name.clone());
            let uid = match c.objects.get(&key) {
                Some(old) => old["metadata"]["uid"].clone(),
                None => json!(uuid::Uuid::new_v4().to_string()),
            };
            object["metadata"]["uid"] = uid;
            // The status subresource: an update leaves `status` as it is (a test may still
            // set one, as the controller would have) and bumps `generation` when `spec`
            // changes.
            let generation = match c.objects.get(&key) {
                Some(old) => {
                    if object.get("status").is_none() && old.get("status").is_some() {
                        object["status"] = old["status"].clone();
                    }
                    let g = old["metadata"]["generation"].as_i64().unwrap_or(1);
                    if old.get("spec") == object.get("spec") {
                        g
                    } else {
                        g + 1
                    }
                }
                None => 1,
            };
            object["metadata"]["generation"] = json!(generation);
            object["metadata"]["resourceVersion"] = json!(version.to_string());
            let kind = if c.objects.contains_key(&key) {
                "MODIFIED"
            } else {
                "ADDED"
            };
            c.objects.insert(key, object.clone());
            c.history.push((version, plural, ns, kind, object));
        }
        self.changed.notify_waiters();
    }

    /// The stored object, `resource` as `<group>/<plural>`.
    pub(crate) fn object(&self, resource: &str, ns: &str, name: &str) -> Option<Value> {
        let c = self.cluster.lock().unwrap();
        c.objects
            .get(&(resource.to_string(), ns.to_string(), name.to_string()))
            .cloned()
    }

    /// Applies every YAML document of `text`.
    pub(crate) fn apply_yaml(&self, text: &str) {
        for doc in text.split("\n---\n").filter(|d| !d.trim().is_empty()) {
            self.apply(yaml_serde::from_str(doc).unwrap());
        }
    }

    pub(crate) fn delete(&self, kind: &str, ns: &str, name: &str) {
        let plural = resource_of(group_of(kind), kind);
        {
            let mut c = self.cluster.lock().unwrap();
            let key = (plural.clone(), ns.to_string(), name.to_string());
            let mut object = c.objects.remove(&key).expect("deleting an existing object");
            c.version += 1;
            let version = c.version;
            object["metadata"]["resourceVersion"] = json!(version.to_string());
            c.history
                .push((version, plural, ns.to_string(), "DELETED", object));
        }
        self.changed.notify_waiters();
    }
}

/// The query of a list or watch request.
#[derive(serde::Deserialize)]
struct ListQuery {
    #[serde(default)]
    watch: Option<bool>,
    #[serde(default, rename = "resourceVersion")]
    resource_version: Option<String>,
}

async fn list_all(
    group: &'static str,
    State(calls): State<Arc<Calls>>,
    Path(plural): Path<String>,
    axum::extract::Query(q): axum::extract::Query<ListQuery>,
) -> axum::response::Response {
    list_or_watch(calls, group, plural, None, q).await
}

async fn list_namespaced(
    group: &'static str,
    State(calls): State<Arc<Calls>>,
    Path((namespace, plural)): Path<(String, String)>,
    axum::extract::Query(q): axum::extract::Query<ListQuery>,
) -> axum::response::Response {
    list_or_watch(calls, group, plural, Some(namespace), q).await
}

/// A list (items + the current resource version), or a watch: the changes after the given
/// version, then each new one as it happens, one JSON line per event (as the API server
/// streams them).
async fn list_or_watch(
    calls: Arc<Calls>,
    group: &'static str,
    plural: String,
    namespace: Option<String>,
    q: ListQuery,
) -> axum::response::Response {
    if group == INFERENCE {
        calls.inference_lists.fetch_add(1, Ordering::SeqCst);
        if calls.inference_crds_absent.load(Ordering::SeqCst) {
            // What the API server answers for a group it does not serve: plain text.
            return (
                StatusCode::NOT_FOUND,
                [("content-type", "text/plain; charset=utf-8")],
                "404 page not found\n",
            )
                .into_response();
        }
    }
    let plural = format!("{group}/{plural}");
    let in_scope =
        move |p: &str, ns: &str| p == plural && namespace.as_deref().is_none_or(|n| n == ns);
    let watching = q.watch.unwrap_or(false);
    let c = calls.cluster.lock().unwrap();
    if !watching {
        let items: Vec<Value> = c
            .objects
            .iter()
            .filter(|((p, ns, _), _)| in_scope(p, ns))
            .map(|(_, o)| o.clone())
            .collect();
        let version = c.version.to_string();
        let kind = items
            .first()
            .and_then(|o| o["kind"].as_str())
            .map(|k| format!("{k}List"))
            .unwrap_or_else(|| "List".into());
        return Json(json!({
            "apiVersion": format!("{group}/v1alpha1"),
            "kind": kind,
            "metadata": {"resourceVersion": version},
            "items": items
        }))
        .into_response();
    }
    drop(c);
    let from: u64 = q
        .resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let stream = futures::stream::unfold(
        (calls, from, in_scope),
        |(calls, mut seen, in_scope)| async move {
            loop {
                let waker = calls.clone();
                let notified = waker.changed.notified();
                let lines: String = {
                    let c = calls.cluster.lock().unwrap();
                    let mut out = String::new();
                    for (v, p, ns, kind, object) in &c.history {
                        if *v > seen && in_scope(p, ns) {
                            out.push_str(&json!({"type": kind, "object": object}).to_string());
                            out.push('\n');
                        }
                    }
                    seen = c.version.max(seen);
                    out
                };
                if !lines.is_empty() {
                    return Some((
                        Ok::<_, std::convert::Infallible>(axum::body::Bytes::from(lines)),
                        (calls, seen, in_scope),
                    ));
                }
                notified.await;
            }
        },
    );
    axum::response::Response::builder()
        .header("content-type", "application/json")
        .body(axum::body::Body::from_stream(stream))
        .unwrap()
}

/// `PATCH .../{plural}/{name}/status` with a JSON merge patch (RFC 7386) of `status` only, as
/// the API server applies it for a resource with the status subresource: a new resource
/// version and a watch event, `generation` unchanged.
async fn patch_status(
    group: &'static str,
    State(calls): State<Arc<Calls>>,
    Path((namespace, plural, name)): Path<(String, String, String)>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> axum::response::Response {
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if content_type != "application/merge-patch+json" {
        return (StatusCode::UNSUPPORTED_MEDIA_TYPE, content_type.to_string()).into_response();
    }
    let Ok(patch) = serde_json::from_slice::<Value>(&body) else {
        return (StatusCode::BAD_REQUEST, "not JSON").into_response();
    };
    let key = (format!("{group}/{plural}"), namespace.clone(), name);
    let object = {
        let mut c = calls.cluster.lock().unwrap();
        let Some(mut object) = c.objects.get(&key).cloned() else {
            return (StatusCode::NOT_FOUND, "not found").into_response();
        };
        // Only `status` is patched through this subresource.
        if let Some(status) = patch.get("status") {
            let mut current = object.get("status").cloned().unwrap_or(json!({}));
            merge_patch(&mut current, status);
            object["status"] = current;
        }
        c.version += 1;
        let version = c.version;
        object["metadata"]["resourceVersion"] = json!(version.to_string());
        c.objects.insert(key.clone(), object.clone());
        c.history
            .push((version, key.0, namespace, "MODIFIED", object.clone()));
        c.status_patches.push(object.clone());
        object
    };
    calls.changed.notify_waiters();
    Json(object).into_response()
}

/// RFC 7386: objects merge key by key, `null` removes, anything else replaces.
fn merge_patch(target: &mut Value, patch: &Value) {
    match (target.as_object_mut(), patch.as_object()) {
        (Some(t), Some(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        _ => {
            *target = match patch.as_object() {
                Some(_) => {
                    let mut fresh = json!({});
                    merge_patch(&mut fresh, patch);
                    fresh
                }
                None => patch.clone(),
            }
        }
    }
}

async fn create_event(
    State(calls): State<Arc<Calls>>,
    Path(_namespace): Path<String>,
    Json(event): Json<Value>,
) -> impl IntoResponse {
    assert_eq!(event["apiVersion"], "events.k8s.io/v1");
    assert_eq!(event["kind"], "Event");
    calls.cluster.lock().unwrap().events.push(event.clone());
    (StatusCode::CREATED, Json(event))
}

/// Only the `builder` service account may create MaaSAuthPolicies in `maas` (admin by SAR).
async fn subject_access_review(
    State(calls): State<Arc<Calls>>,
    Json(review): Json<Value>,
) -> impl IntoResponse {
    calls.access_reviews.fetch_add(1, Ordering::SeqCst);
    assert_eq!(review["apiVersion"], "authorization.k8s.io/v1");
    assert_eq!(review["kind"], "SubjectAccessReview");
    let attrs = &review["spec"]["resourceAttributes"];
    let allowed = review["spec"]["user"] == "system:serviceaccount:team-a:builder"
        && attrs["namespace"] == "maas"
        && attrs["group"] == "maas.opendatahub.io"
        && attrs["resource"] == "maasauthpolicies"
        && attrs["verb"] == "create";
    let mut answer = review.clone();
    answer["metadata"] = json!({"creationTimestamp": null});
    answer["status"] = if allowed {
        json!({"allowed": true, "reason": "RBAC: allowed by ClusterRoleBinding \"maas-admins\""})
    } else {
        json!({"allowed": false})
    };
    (StatusCode::CREATED, Json(answer))
}

async fn token_review(
    State(calls): State<Arc<Calls>>,
    Json(review): Json<Value>,
) -> impl IntoResponse {
    calls.token_reviews.fetch_add(1, Ordering::SeqCst);
    assert_eq!(review["apiVersion"], "authentication.k8s.io/v1");
    assert_eq!(review["kind"], "TokenReview");
    let requested = review["spec"]["audiences"].clone();
    *calls.requested_audiences.lock().unwrap() = requested.clone();
    let token = review["spec"]["token"].as_str().unwrap_or_default();
    let status = match token {
        // A token for the audience `maas`, answered as the API server does: with audiences
        // asked, the intersection (and not authenticated when it is empty).
        "kube-maas-audience" => {
            let token_audiences = ["maas"];
            let granted: Vec<&str> = match requested.as_array() {
                Some(asked) => asked
                    .iter()
                    .filter_map(Value::as_str)
                    .filter(|a| token_audiences.contains(a))
                    .collect(),
                None => token_audiences.to_vec(),
            };
            if granted.is_empty() {
                json!({"authenticated": false, "user": {}, "error": "token audiences [\"maas\"] is invalid for the target audiences"})
            } else {
                json!({
                    "authenticated": true,
                    "user": {"username": "system:serviceaccount:team-a:runner", "groups": ["system:authenticated", "tier-premium-users"]},
                    "audiences": granted
                })
            }
        }
        // "kube-good" below stands for an authenticator that ignores the audiences asked: its
        // answer always names the API server's own audience.
        t if t.starts_with("eyJ") || t == "kube-good" => json!({
            "authenticated": true,
            "user": {
                "username": "system:serviceaccount:team-a:builder",
                "uid": "8c0a6f5e-0000-4000-8000-000000000001",
                "groups": ["system:serviceaccounts", "system:serviceaccounts:team-a", "system:authenticated", "tier-premium-users"]
            },
            "audiences": ["https://kubernetes.default.svc"]
        }),
        "kube-other" => json!({
            "authenticated": true,
            "user": {"username": "dev", "groups": ["system:authenticated"]}
        }),
        "kube-admin" => json!({
            "authenticated": true,
            "user": {"username": "kube:admin", "groups": ["system:authenticated", "maas-admins"]}
        }),
        "kube-boom" => {
            return (
                StatusCode::INTERNAL_SERVER_ERROR,
                Json(
                    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                            "message": "etcd unavailable", "reason": "InternalError", "code": 500}),
                ),
            );
        }
        _ => {
            json!({"authenticated": false, "user": {}, "error": "[invalid bearer token, token lookup failed]"})
        }
    };
    let mut answer = review.clone();
    answer["metadata"] = json!({"creationTimestamp": null});
    answer["status"] = status;
    (StatusCode::CREATED, Json(answer))
}

async fn get_secret(
    State(calls): State<Arc<Calls>>,
    Path((namespace, name)): Path<(String, String)>,
) -> impl IntoResponse {
    calls.secret_gets.fetch_add(1, Ordering::SeqCst);
    if calls.fail_secrets.load(Ordering::SeqCst) {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(
                json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                        "message": "etcd unavailable", "reason": "InternalError", "code": 500}),
            ),
        );
    }
    // A namespace whose Secrets the companion's ServiceAccount may not read (no RoleBinding).
    if namespace == "locked" {
        return (
            StatusCode::FORBIDDEN,
            Json(
                json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                        "message": format!("secrets \"{name}\" is forbidden: User \"system:serviceaccount:maas:maas-companion\" cannot get resource \"secrets\" in API group \"\" in the namespace \"{namespace}\""),
                        "reason": "Forbidden", "details": {"name": name, "kind": "secrets"}, "code": 403}),
            ),
        );
    }
    // Entra client credentials (auth: azureClientCredentials).
    if (namespace.as_str(), name.as_str()) == ("maas", "entra-app") {
        use base64::Engine;
        let b64 = |v: &str| base64::engine::general_purpose::STANDARD.encode(v);
        return (
            StatusCode::OK,
            Json(json!({
                "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": name, "namespace": namespace},
                "data": {"tenant-id": b64("contoso"), "client-id": b64("app-1"),
                         "client-secret": b64(ENTRA_SECRET)}
            })),
        );
    }
    // The platform's provider key (the companion's namespace) and a tenant's (llm), under the
    // same Secret name.
    let fixed = match (namespace.as_str(), name.as_str()) {
        ("maas", "openai-api-key") => Some("sk-platform-key".to_string()),
        ("llm", "openai-api-key") => Some("sk-llm-tenant-key".to_string()),
        ("maas", "openai-key") => Some(
            calls
                .rotated_key
                .lock()
                .unwrap()
                .clone()
                .unwrap_or_else(|| "sk-from-secret".into()),
        ),
        _ => None,
    };
    if let Some(key) = fixed {
        use base64::Engine;
        return (
            StatusCode::OK,
            Json(json!({
                "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": name, "namespace": namespace},
                "data": {"api-key": base64::engine::general_purpose::STANDARD.encode(key)}
            })),
        );
    }
    (
        StatusCode::NOT_FOUND,
        Json(
            json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": format!("secrets \"{name}\" not found"), "reason": "NotFound",
                    "details": {"name": name, "kind": "secrets"}, "code": 404}),
        ),
    )
}

/// Starts the stand-in on 127.0.0.1 with a certificate from a throwaway CA; returns a kube
/// client that trusts that CA only.
pub(crate) async fn start_api_server(calls: Arc<Calls>) -> kube::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&leaf_key, &issuer)
        .unwrap();

    let router = Router::new()
        .route(
            "/apis/authentication.k8s.io/v1/tokenreviews",
            post(token_review),
        )
        .route(
            "/api/v1/namespaces/{namespace}/secrets/{name}",
            get(get_secret),
        )
        .route(
            "/apis/authorization.k8s.io/v1/subjectaccessreviews",
            post(subject_access_review),
        )
        .route(
            "/apis/maas.opendatahub.io/v1alpha1/{plural}",
            get(|s, p, q| list_all(MAAS, s, p, q)),
        )
        .route(
            "/apis/maas.opendatahub.io/v1alpha1/namespaces/{namespace}/{plural}",
            get(|s, p, q| list_namespaced(MAAS, s, p, q)),
        )
        .route(
            "/apis/inference.opendatahub.io/v1alpha1/{plural}",
            get(|s, p, q| list_all(INFERENCE, s, p, q)),
        )
        .route(
            "/apis/inference.opendatahub.io/v1alpha1/namespaces/{namespace}/{plural}",
            get(|s, p, q| list_namespaced(INFERENCE, s, p, q)),
        )
        .route(
            "/apis/maas.opendatahub.io/v1alpha1/namespaces/{namespace}/{plural}/{name}/status",
            patch(|s, p, h, b| patch_status(MAAS, s, p, h, b)),
        )
        .route(
            "/apis/inference.opendatahub.io/v1alpha1/namespaces/{namespace}/{plural}/{name}/status",
            patch(|s, p, h, b| patch_status(INFERENCE, s, p, h, b)),
        )
        .route(
            "/apis/events.k8s.io/v1/namespaces/{namespace}/events",
            post(create_event),
        )
        .with_state(calls);
    let tls = axum_server::tls_rustls::RustlsConfig::from_pem(
        leaf.pem().into_bytes(),
        leaf_key.serialize_pem().into_bytes(),
    )
    .await
    .unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = axum_server::from_tcp_rustls(listener, tls).unwrap();
    tokio::spawn(server.serve(router.into_make_service()));

    let mut config = kube::Config::new(format!("https://127.0.0.1:{port}").parse().unwrap());
    config.root_cert = Some(vec![ca_cert.der().to_vec()]);
    config.default_namespace = "maas".into();
    kube::Client::try_from(config).unwrap()
}

pub(crate) async fn spawn_kube_app(
    calls: Arc<Calls>,
    adjust: impl FnOnce(&mut maas_companion::Settings),
) -> crate::helpers::TestApp {
    let client = start_api_server(calls).await;
    let database_url = create_database().await;
    let dir = tempfile::tempdir().unwrap();
    let policy_path = dir.path().join("policy.yaml");
    let ids = dir.path().join("ids.yaml");
    let policy = format!(
        "{}  - name: gpt-4o\n    path: /ext/gpt-4o\n    tiers: [premium]\n    provider:\n      type: openai\n      credentialRef: openai-key\n    upstreamCluster: outbound|443||api.openai.com\n  - name: claude\n    path: /ext/claude\n    tiers: [premium]\n    provider:\n      type: anthropic\n      credentialRef: missing-secret\n    upstreamCluster: outbound|443||api.anthropic.com\n",
        local_policy()
    );
    std::fs::write(&policy_path, policy).unwrap();
    std::fs::write(&ids, IDENTITIES).unwrap();
    let mut config = crate::helpers::local_settings(&database_url, &policy_path, &ids, &ids);
    config.identity.provider = IdentityProvider::Kubernetes {
        audiences: Vec::new(),
        oidc: None,
    };
    config.credentials = CredentialsSettings::Kubernetes { namespace: None };
    config.identity.token_negative_cache_ttl = std::time::Duration::from_secs(1);
    adjust(&mut config);
    spawn_with_config(
        config,
        dir,
        policy_path,
        database_url,
        maas_companion::Overrides {
            kube_client: Some(client),
        },
    )
    .await
}

#[tokio::test]
async fn token_review_identities_mint_and_authenticate_with_caching() {
    let calls = Arc::new(Calls::default());
    let app = spawn_kube_app(calls.clone(), |_| {}).await;

    let r = app.authenticate("kube-good").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["subject"], "system:serviceaccount:team-a:builder");
    assert_eq!(r.body["tier"], "premium");
    assert_eq!(calls.token_reviews.load(Ordering::SeqCst), 1);
    // Cached: no second TokenReview.
    let r = app.authenticate("kube-good").await;
    assert_eq!(r.status, 200);
    assert_eq!(calls.token_reviews.load(Ordering::SeqCst), 1);

    // Refused token: 401, cached for the (shorter) negative TTL.
    let r = app.authenticate("kube-bad").await;
    assert_eq!(r.status, 401);
    assert_eq!(r.message(), "invalid token");
    app.authenticate("kube-bad").await;
    assert_eq!(calls.token_reviews.load(Ordering::SeqCst), 2);
    tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
    app.authenticate("kube-bad").await;
    assert_eq!(
        calls.token_reviews.load(Ordering::SeqCst),
        3,
        "negative entry expired"
    );

    // API server failing: 503 (fail closed) and not cached.
    let r = app.authenticate("kube-boom").await;
    assert_eq!(r.status, 503, "{}", r.body);
    let r = app.authenticate("kube-boom").await;
    assert_eq!(r.status, 503);
    assert_eq!(calls.token_reviews.load(Ordering::SeqCst), 5);

    // A JWT-shaped token (as service account tokens are) is never cached past its `exp`.
    use base64::Engine;
    let exp = chrono::Utc::now().timestamp() + 5;
    let b64 = |v: Value| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string());
    let jwt = format!(
        "{}.{}.c2ln",
        b64(json!({"alg": "RS256"})),
        b64(json!({"exp": exp, "sub": "builder"}))
    );
    let r = app.authenticate(&jwt).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["expires_at"], exp);
    assert!(r.body["cache_ttl_seconds"].as_u64().unwrap() <= 5);
    assert_eq!(calls.token_reviews.load(Ordering::SeqCst), 6);

    // The public API takes the same identities: mint with a token, admin from its groups.
    let minted = app.mint("kube-good", json!({"name": "ci"})).await;
    assert_eq!(minted["tier"], "premium");
    let r = app
        .public_post("/v1/api-keys", Some("alice-token"), &json!({"name": "k"}))
        .await;
    assert_eq!(r.status, 401, "static tokens are not accepted here");
    let r = app
        .public_get(
            &format!("/v1/api-keys/{}", minted["id"].as_str().unwrap()),
            Some("kube-admin"),
        )
        .await;
    assert_eq!(r.status, 200);
}

#[tokio::test]
async fn provider_credentials_come_from_secrets() {
    let calls = Arc::new(Calls::default());
    let app = spawn_kube_app(calls.clone(), |_| {}).await;
    let r = app.internal_get("/internal/v1/credentials").await;
    assert_eq!(r.status, 200, "{}", r.body);
    // The missing Secret is left out (and logged), the present one is served.
    assert_eq!(
        r.body,
        json!({"credentials": {"openai-key": "sk-from-secret"}})
    );
    assert_eq!(calls.secret_gets.load(Ordering::SeqCst), 2);
    // Cached briefly (500 ms): no new reads.
    let read_at = std::time::Instant::now();
    let again = app.internal_get("/internal/v1/credentials").await;
    assert_eq!(again.headers["etag"], r.headers["etag"]);
    if read_at.elapsed() < std::time::Duration::from_millis(500) {
        assert_eq!(calls.secret_gets.load(Ordering::SeqCst), 2);
    }
    // An unchanged set costs the poller nothing: 304 to its If-None-Match.
    let unchanged = app
        .http
        .get(format!("{}/internal/v1/credentials", app.internal))
        .header("if-none-match", r.headers["etag"].to_str().unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(unchanged.status(), 304);
    assert_eq!(unchanged.text().await.unwrap(), "");
}

/// The client secret of the stand-in's Secret `maas/entra-app`.
const ENTRA_SECRET: &str = "entra-secret-value";

/// `auth: azureClientCredentials`: the Secret's `tenant-id`, `client-id` and `client-secret`
/// are exchanged at Entra (`--azure-authority-url`, here a stand-in checking the grant) and the
/// filter gets the access token and its expiry, never the secret.
#[tokio::test]
async fn entra_client_credentials_from_a_secret_become_an_access_token() {
    use axum::extract::Form;
    use std::collections::HashMap;
    async fn token(
        Path(tenant): Path<String>,
        Form(form): Form<HashMap<String, String>>,
    ) -> axum::response::Response {
        let ok = tenant == "contoso"
            && form.get("grant_type").map(String::as_str) == Some("client_credentials")
            && form.get("client_id").map(String::as_str) == Some("app-1")
            && form.get("client_secret").map(String::as_str) == Some(ENTRA_SECRET)
            && form.get("scope").map(String::as_str)
                == Some("https://cognitiveservices.azure.com/.default");
        if !ok {
            return (
                StatusCode::UNAUTHORIZED,
                Json(json!({"error": "invalid_client"})),
            )
                .into_response();
        }
        Json(json!({"access_token": "entra-access-token", "token_type": "Bearer", "expires_in": 3600}))
            .into_response()
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let authority = format!("http://{}", listener.local_addr().unwrap());
    let entra =
        axum::Router::new().route("/{tenant}/oauth2/v2.0/token", axum::routing::post(token));
    tokio::spawn(async move { axum::serve(listener, entra).await });

    let calls = Arc::new(Calls::default());
    let app = spawn_kube_app(calls.clone(), |c| c.azure_authority_url = authority).await;
    let policy = std::fs::read_to_string(&app.policy_path).unwrap();
    std::fs::write(
        &app.policy_path,
        format!(
            "{policy}  - name: az\n    path: /ext/az\n    tiers: [premium]\n    provider: {{type: azure-openai, credentialRef: entra-app, auth: azureClientCredentials, deployment: gpt-4o}}\n    upstreamCluster: outbound|443||contoso.openai.azure.com\n"
        ),
    )
    .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let body = loop {
        let r = app.internal_get("/internal/v1/credentials").await;
        assert_eq!(r.status, 200, "{}", r.body);
        if r.body["credentials"].get("entra-app").is_some() {
            break r.body;
        }
        assert!(std::time::Instant::now() < deadline, "{}", r.body);
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert_eq!(body["credentials"]["entra-app"], "entra-access-token");
    let now = chrono::Utc::now().timestamp() as u64;
    let expires = body["expires_at"]["entra-app"].as_u64().unwrap();
    assert!(expires > now + 3500 && expires <= now + 3600, "{body}");
    // The static key is still served as it is, with no expiry.
    assert_eq!(body["credentials"]["openai-key"], "sk-from-secret");
    assert!(body["expires_at"].get("openai-key").is_none());
    assert!(!body.to_string().contains(ENTRA_SECRET));
}

/// The filter's default `pollIntervalMs`.
const POLL_INTERVAL: std::time::Duration = std::time::Duration::from_secs(2);

#[tokio::test]
#[allow(clippy::print_stderr, reason = "prints the measured figure")]
async fn rotated_secret_is_served_within_one_poll_interval() {
    let calls = Arc::new(Calls::default());
    let app = spawn_kube_app(calls.clone(), |_| {}).await;
    let first = app.internal_get("/internal/v1/credentials").await;
    assert_eq!(first.body["credentials"]["openai-key"], "sk-from-secret");

    // Rotate the Secret, then poll as a (fast) filter would until the new key shows.
    *calls.rotated_key.lock().unwrap() = Some("sk-rotated".into());
    let rotated_at = std::time::Instant::now();
    let live_after = loop {
        let r = app.internal_get("/internal/v1/credentials").await;
        assert_eq!(r.status, 200, "{}", r.body);
        if r.body["credentials"]["openai-key"] == "sk-rotated" {
            assert_ne!(r.headers["etag"], first.headers["etag"]);
            break rotated_at.elapsed();
        }
        assert!(
            rotated_at.elapsed() < std::time::Duration::from_secs(15),
            "the rotated key never showed"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    eprintln!(
        "rotated key served {} ms after the Secret changed",
        live_after.as_millis()
    );
    assert!(
        live_after < POLL_INTERVAL,
        "rotated key served only after {live_after:?}, more than one poll interval"
    );
}

/// Eight pollers asking every 10 ms for 2 s; returns (requests answered `status`, elapsed).
async fn poll_hard(
    app: &Arc<crate::helpers::TestApp>,
    status: u16,
) -> (usize, std::time::Duration) {
    let started = std::time::Instant::now();
    let window = std::time::Duration::from_secs(2);
    let mut pollers = Vec::new();
    for _ in 0..8 {
        let app = app.clone();
        pollers.push(tokio::spawn(async move {
            let mut served = 0;
            while started.elapsed() < window {
                let r = app.internal_get("/internal/v1/credentials").await;
                assert_eq!(r.status, status, "{}", r.body);
                served += 1;
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            served
        }));
    }
    let mut served = 0;
    for p in pollers {
        served += p.await.unwrap();
    }
    (served, started.elapsed())
}

/// However many pollers ask, the companion reads each Secret at most once per cache TTL (500 ms):
/// 2 GETs per second per Secret per replica (here 2 Secrets), when reads succeed and when they fail.
#[tokio::test]
#[allow(clippy::print_stderr, reason = "prints the measured figure")]
async fn secret_reads_stay_bounded_under_many_pollers() {
    let calls = Arc::new(Calls::default());
    let app = Arc::new(spawn_kube_app(calls.clone(), |_| {}).await);
    let at_most = |elapsed: std::time::Duration| 2 * elapsed.as_millis().div_ceil(500) as usize;

    let (served, elapsed) = poll_hard(&app, 200).await;
    let gets = calls.secret_gets.swap(0, Ordering::SeqCst);
    eprintln!("{served} credential requests in {elapsed:?} cost {gets} Secret GETs");
    assert!(served > 50, "the pollers ran ({served} requests)");
    assert!(
        gets <= at_most(elapsed),
        "{gets} Secret GETs in {elapsed:?}"
    );

    // A failing API server is not asked again at every poll either (and the answer is 503).
    calls.fail_secrets.store(true, Ordering::SeqCst);
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    calls.secret_gets.store(0, Ordering::SeqCst);
    let (served, elapsed) = poll_hard(&app, 503).await;
    let gets = calls.secret_gets.load(Ordering::SeqCst);
    eprintln!("{served} failing credential requests in {elapsed:?} cost {gets} Secret GETs");
    assert!(served > 50, "the pollers ran ({served} requests)");
    // The read stops at the first failing Secret: one GET per window.
    assert!(
        gets <= at_most(elapsed) / 2,
        "{gets} Secret GETs in {elapsed:?}"
    );
}

#[tokio::test]
async fn admin_by_subject_access_review() {
    let calls = Arc::new(Calls::default());
    let app = spawn_kube_app(calls.clone(), |c| {
        c.identity.admin_sar = Some(AdminSarSettings {
            namespace: "maas".into(),
            resource: "maasauthpolicies.maas.opendatahub.io".into(),
            verb: "create".into(),
        });
    })
    .await;
    let dev_key = app.mint("kube-other", json!({"name": "dev-key"})).await;
    let builder_key = app.mint("kube-good", json!({"name": "builder-key"})).await;
    let dev_path = format!("/v1/api-keys/{}", dev_key["id"].as_str().unwrap());
    let builder_path = format!("/v1/api-keys/{}", builder_key["id"].as_str().unwrap());

    // The builder is admin by SAR (not by group): sees dev's key.
    let r = app.public_get(&dev_path, Some("kube-good")).await;
    assert_eq!(r.status, 200, "{}", r.body);
    // Dev is not: the builder's key is 404 to them.
    let r = app.public_get(&builder_path, Some("kube-other")).await;
    assert_eq!(r.status, 404);
    // Allowed answers are cached: no new review for the builder.
    let before = calls.access_reviews.load(Ordering::SeqCst);
    let r = app.public_get(&dev_path, Some("kube-good")).await;
    assert_eq!(r.status, 200);
    assert_eq!(calls.access_reviews.load(Ordering::SeqCst), before);
    // Group admins need no review at all.
    let before = calls.access_reviews.load(Ordering::SeqCst);
    let r = app.public_get(&dev_path, Some("kube-admin")).await;
    assert_eq!(r.status, 200);
    assert_eq!(calls.access_reviews.load(Ordering::SeqCst), before);
}

#[tokio::test]
async fn oidc_jwts_next_to_token_review() {
    use jwt_simple::prelude::{Duration, ES256KeyPair};
    let key = ES256KeyPair::generate().with_key_id("k1");
    let jwks_url = crate::oidc::start_jwks(&key).await;
    let calls = Arc::new(Calls::default());
    let app = spawn_kube_app(calls.clone(), |c| {
        c.identity.provider = IdentityProvider::Kubernetes {
            audiences: Vec::new(),
            oidc: Some(OidcSettings {
                issuer: crate::oidc::ISSUER.into(),
                audience: crate::oidc::AUDIENCE.into(),
                jwks_url,
                groups_claim: "groups".into(),
            }),
        };
    })
    .await;
    let jwt = crate::oidc::token(
        &key,
        crate::oidc::ISSUER,
        crate::oidc::AUDIENCE,
        Duration::from_hours(1),
    );
    let r = app.authenticate(&jwt).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["subject"], "olivia");
    assert_eq!(
        calls.token_reviews.load(Ordering::SeqCst),
        0,
        "verified locally"
    );
    // A JWT from the issuer but signed by someone else is refused, not sent to TokenReview.
    let forged = crate::oidc::token(
        &ES256KeyPair::generate().with_key_id("k1"),
        crate::oidc::ISSUER,
        crate::oidc::AUDIENCE,
        Duration::from_hours(1),
    );
    assert_eq!(app.authenticate(&forged).await.status, 401);
    assert_eq!(calls.token_reviews.load(Ordering::SeqCst), 0);
    // Other tokens still go to TokenReview.
    assert_eq!(app.authenticate("kube-good").await.status, 200);
    assert_eq!(calls.token_reviews.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn token_review_answers_must_grant_the_configured_audiences() {
    let calls = Arc::new(Calls::default());
    let app = spawn_kube_app(calls.clone(), |c| {
        c.identity.provider = IdentityProvider::Kubernetes {
            audiences: vec!["maas".into()],
            oidc: None,
        };
    })
    .await;
    // Granted (the answer's audiences intersect what was asked): accepted.
    let r = app.authenticate("kube-maas-audience").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["subject"], "system:serviceaccount:team-a:runner");
    assert_eq!(*calls.requested_audiences.lock().unwrap(), json!(["maas"]));
    // authenticated:true, but for another audience: refused.
    let r = app.authenticate("kube-good").await;
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(r.message(), "invalid token");
    // authenticated:true without status.audiences although audiences were asked: refused.
    let r = app.authenticate("kube-other").await;
    assert_eq!(r.status, 401, "{}", r.body);
    // The public API refuses the same way.
    let r = app
        .public_post("/v1/api-keys", Some("kube-good"), &json!({"name": "k"}))
        .await;
    assert_eq!(r.status, 401, "{}", r.body);
    app.mint("kube-maas-audience", json!({"name": "runner"}))
        .await;
}
