//! A local stand-in for the Kubernetes API server, for a companion started with
//! `MAAS_POLICY_SOURCE=kubernetes`: HTTPS on 127.0.0.1 with a certificate from a throwaway CA,
//! list + watch (one JSON line per event, resumed from a `resourceVersion`) of the
//! `maas.opendatahub.io/v1alpha1` resources (`MaaSModelRef`, `ExternalModel` across namespaces;
//! `MaaSAuthPolicy`, `MaaSSubscription` in one) and the `inference.opendatahub.io/v1alpha1`
//! `ExternalModel` and `ExternalProvider` (kept by group and plural: both groups have
//! `externalmodels`), and `events.k8s.io/v1` Events recorded.
//! The companion reaches it through its real `kube` client, configured by the kubeconfig file
//! written here ([`KubeStandin::companion_env`]: `KUBECONFIG` and the policy source).
//!
//! The test changes the resources as `kubectl` would: [`KubeStandin::apply_yaml`] (create or
//! replace, a new resource version, a watch event) and [`KubeStandin::delete`].

use anyhow::{Context, Result, anyhow, bail};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

const MAAS: &str = "maas.opendatahub.io";
const INFERENCE: &str = "inference.opendatahub.io";
const VERSION: &str = "v1alpha1";

/// The `(group, plural)` of a served `apiVersion` and kind.
fn resource(api_version: &str, kind: &str) -> Result<(&'static str, &'static str)> {
    let group = api_version.split('/').next().unwrap_or_default();
    Ok(match (group, kind) {
        (MAAS, "MaaSModelRef") => (MAAS, "maasmodelrefs"),
        (MAAS, "ExternalModel") => (MAAS, "externalmodels"),
        (MAAS, "MaaSAuthPolicy") => (MAAS, "maasauthpolicies"),
        (MAAS, "MaaSSubscription") => (MAAS, "maassubscriptions"),
        (INFERENCE, "ExternalModel") => (INFERENCE, "externalmodels"),
        (INFERENCE, "ExternalProvider") => (INFERENCE, "externalproviders"),
        other => bail!("the stand-in does not serve {other:?}"),
    })
}

/// One change, as a watch replays it.
struct Change {
    version: u64,
    resource: (&'static str, &'static str),
    namespace: String,
    kind: &'static str,
    object: Value,
}

/// A served resource: (group, plural).
type Resource = (&'static str, &'static str);

#[derive(Default)]
struct Cluster {
    version: u64,
    /// ((group, plural), namespace, name) → object.
    objects: BTreeMap<(Resource, String, String), Value>,
    history: Vec<Change>,
    events: Vec<Value>,
}

#[derive(Default)]
struct Shared {
    cluster: Mutex<Cluster>,
    /// Wakes the open watches.
    changed: tokio::sync::Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Cluster> {
        self.cluster
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn record(&self, key: (Resource, String, String), change: Option<Value>) -> Result<()> {
        {
            let mut c = self.lock();
            c.version += 1;
            let version = c.version;
            let (kind, mut object) = match (change, c.objects.remove(&key)) {
                (Some(mut new), old) => {
                    let uid = old
                        .as_ref()
                        .map(|o| o["metadata"]["uid"].clone())
                        .unwrap_or_else(|| json!(format!("00000000-0000-4000-8000-{version:012}")));
                    new["metadata"]["uid"] = uid;
                    (if old.is_some() { "MODIFIED" } else { "ADDED" }, new)
                }
                (None, Some(old)) => ("DELETED", old),
                (None, None) => bail!("{}/{}/{}/{} does not exist", key.0.0, key.0.1, key.1, key.2),
            };
            object["metadata"]["resourceVersion"] = json!(version.to_string());
            if kind != "DELETED" {
                c.objects.insert(key.clone(), object.clone());
            }
            c.history.push(Change {
                version,
                resource: key.0,
                namespace: key.1,
                kind,
                object,
            });
        }
        self.changed.notify_waiters();
        Ok(())
    }
}

/// The running stand-in (serves until the process exits).
pub struct KubeStandin {
    shared: Arc<Shared>,
    kubeconfig: PathBuf,
    namespace: String,
    _dir: tempfile::TempDir,
}

#[derive(serde::Deserialize)]
struct ListQuery {
    #[serde(default)]
    watch: Option<bool>,
    #[serde(default, rename = "resourceVersion")]
    resource_version: Option<String>,
}

fn list_or_watch(
    shared: Arc<Shared>,
    group: &'static str,
    plural: String,
    namespace: Option<String>,
    q: ListQuery,
) -> Response {
    let in_scope = move |r: &Resource, ns: &str| {
        r.0 == group && r.1 == plural && namespace.as_deref().is_none_or(|n| n == ns)
    };
    if !q.watch.unwrap_or(false) {
        let c = shared.lock();
        let items: Vec<&Value> = c
            .objects
            .iter()
            .filter(|((p, ns, _), _)| in_scope(p, ns))
            .map(|(_, o)| o)
            .collect();
        return Json(json!({
            "apiVersion": format!("{group}/{VERSION}"),
            "kind": "List",
            "metadata": {"resourceVersion": c.version.to_string()},
            "items": items
        }))
        .into_response();
    }
    let from: u64 = q.resource_version.and_then(|v| v.parse().ok()).unwrap_or(0);
    let stream = futures_util::stream::unfold(
        (shared, from, in_scope),
        |(shared, mut seen, in_scope)| async move {
            loop {
                let waker = shared.clone();
                let notified = waker.changed.notified();
                let mut lines = String::new();
                {
                    let c = shared.lock();
                    for ch in c.history.iter().filter(|ch| ch.version > seen) {
                        if in_scope(&ch.resource, &ch.namespace) {
                            lines.push_str(
                                &json!({"type": ch.kind, "object": ch.object}).to_string(),
                            );
                            lines.push('\n');
                        }
                    }
                    seen = seen.max(c.version);
                }
                if !lines.is_empty() {
                    return Some((
                        Ok::<_, std::convert::Infallible>(bytes::Bytes::from(lines)),
                        (shared, seen, in_scope),
                    ));
                }
                notified.await;
            }
        },
    );
    (
        [("content-type", "application/json")],
        axum::body::Body::from_stream(stream),
    )
        .into_response()
}

async fn list_all(
    group: &'static str,
    State(shared): State<Arc<Shared>>,
    Path(plural): Path<String>,
    Query(q): Query<ListQuery>,
) -> Response {
    list_or_watch(shared, group, plural, None, q)
}

async fn list_namespaced(
    group: &'static str,
    State(shared): State<Arc<Shared>>,
    Path((namespace, plural)): Path<(String, String)>,
    Query(q): Query<ListQuery>,
) -> Response {
    list_or_watch(shared, group, plural, Some(namespace), q)
}

async fn create_event(
    State(shared): State<Arc<Shared>>,
    Json(event): Json<Value>,
) -> impl IntoResponse {
    shared.lock().events.push(event.clone());
    (StatusCode::CREATED, Json(event))
}

impl KubeStandin {
    /// Starts the stand-in on its own thread; `namespace` is the companion's
    /// `--policy-namespace` (that of the MaaSAuthPolicies and MaaSSubscriptions).
    pub fn start(namespace: &str) -> Result<KubeStandin> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_key = rcgen::KeyPair::generate()?;
        let ca_cert = ca_params.self_signed(&ca_key)?;
        let issuer = rcgen::Issuer::new(ca_params, ca_key);
        let leaf_key = rcgen::KeyPair::generate()?;
        let leaf = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])?
            .signed_by(&leaf_key, &issuer)?;

        let dir = tempfile::Builder::new().prefix("maas-kube-").tempdir()?;
        let ca_path = dir.path().join("ca.crt");
        std::fs::write(&ca_path, ca_cert.pem())?;
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: standin\n  cluster:\n    server: https://127.0.0.1:{port}\n    certificate-authority: {}\nusers:\n- name: companion\n  user:\n    token: standin-token\ncontexts:\n- name: standin\n  context:\n    cluster: standin\n    user: companion\n    namespace: {namespace}\ncurrent-context: standin\n",
                ca_path.display()
            ),
        )?;

        let shared = Arc::new(Shared::default());
        let mut router = Router::new();
        for group in [MAAS, INFERENCE] {
            router = router
                .route(
                    &format!("/apis/{group}/{VERSION}/{{plural}}"),
                    get(move |s, p, q| list_all(group, s, p, q)),
                )
                .route(
                    &format!("/apis/{group}/{VERSION}/namespaces/{{namespace}}/{{plural}}"),
                    get(move |s, p, q| list_namespaced(group, s, p, q)),
                );
        }
        let router = router
            .route(
                "/apis/events.k8s.io/v1/namespaces/{namespace}/events",
                post(create_event),
            )
            .with_state(shared.clone());
        let (cert_pem, key_pem) = (
            leaf.pem().into_bytes(),
            leaf_key.serialize_pem().into_bytes(),
        );
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<()>>();
        std::thread::Builder::new()
            .name("kube-standin".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.into()));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let served = async {
                        let tls =
                            axum_server::tls_rustls::RustlsConfig::from_pem(cert_pem, key_pem)
                                .await?;
                        listener.set_nonblocking(true)?;
                        anyhow::Ok(axum_server::from_tcp_rustls(listener, tls)?)
                    }
                    .await;
                    match served {
                        Ok(server) => {
                            let _ = ready_tx.send(Ok(()));
                            let _ = server.serve(router.into_make_service()).await;
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                        }
                    }
                });
            })?;
        ready_rx
            .recv()
            .map_err(|_| anyhow!("the stand-in's thread ended"))??;
        Ok(KubeStandin {
            shared,
            kubeconfig,
            namespace: namespace.to_string(),
            _dir: dir,
        })
    }

    /// The companion's environment: its kube client from the kubeconfig (as `kubectl`), its
    /// policy from the resources of [`Self::start`]'s namespace.
    pub fn companion_env(&self) -> Vec<(String, String)> {
        vec![
            (
                "KUBECONFIG".into(),
                self.kubeconfig.to_string_lossy().into_owned(),
            ),
            ("MAAS_POLICY_SOURCE".into(), "kubernetes".into()),
            ("MAAS_POLICY_NAMESPACE".into(), self.namespace.clone()),
        ]
    }

    /// Creates or replaces every object of `yaml` (documents separated by `---`).
    pub fn apply_yaml(&self, yaml: &str) -> Result<()> {
        for doc in yaml.split("\n---\n").filter(|d| !d.trim().is_empty()) {
            let object: Value = yaml_serde::from_str(doc).context("a resource is not YAML")?;
            let kind = object["kind"].as_str().context("kind")?;
            let ns = object["metadata"]["namespace"]
                .as_str()
                .context("metadata.namespace")?;
            let name = object["metadata"]["name"]
                .as_str()
                .context("metadata.name")?;
            let api_version = object["apiVersion"].as_str().context("apiVersion")?;
            let key = (
                resource(api_version, kind)?,
                ns.to_string(),
                name.to_string(),
            );
            self.shared.record(key, Some(object))?;
        }
        Ok(())
    }

    /// Deletes the object of `api_version` (e.g. `maas.opendatahub.io/v1alpha1`) and `kind`.
    pub fn delete(&self, api_version: &str, kind: &str, namespace: &str, name: &str) -> Result<()> {
        let key = (
            resource(api_version, kind)?,
            namespace.to_string(),
            name.to_string(),
        );
        self.shared.record(key, None)
    }

    /// The Events written so far (`events.k8s.io/v1` JSON).
    pub fn events(&self) -> Vec<Value> {
        self.shared.lock().events.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names the stand-in lists at `path` (over HTTPS, trusting its CA only).
    fn names_at(standin: &KubeStandin, path: &str) -> Vec<String> {
        let config = std::fs::read_to_string(&standin.kubeconfig).unwrap();
        let line = |key: &str| {
            config
                .lines()
                .find_map(|l| l.trim().strip_prefix(key))
                .unwrap()
                .trim()
                .to_string()
        };
        let ca = std::fs::read(line("certificate-authority:")).unwrap();
        let client = reqwest::blocking::Client::builder()
            .tls_built_in_root_certs(false)
            .add_root_certificate(reqwest::Certificate::from_pem(&ca).unwrap())
            .build()
            .unwrap();
        let list: Value = client
            .get(format!("{}{path}", line("server:")))
            .send()
            .unwrap()
            .json()
            .unwrap();
        list["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o["metadata"]["name"].as_str().unwrap().to_string())
            .collect()
    }

    /// Both groups have `externalmodels`: each group's list holds its own only.
    #[test]
    fn resources_are_kept_by_group_and_plural() {
        let standin = KubeStandin::start("models-as-a-service").unwrap();
        standin
            .apply_yaml(include_str!(
                "../fixtures/reference/external-model-gpt-4o.yaml"
            ))
            .unwrap();
        standin
            .apply_yaml(include_str!(
                "../fixtures/reference/v0.2.1/inference-external-model.yaml"
            ))
            .unwrap();
        assert_eq!(
            names_at(
                &standin,
                "/apis/maas.opendatahub.io/v1alpha1/externalmodels"
            ),
            ["gpt-4o"]
        );
        assert_eq!(
            names_at(
                &standin,
                "/apis/inference.opendatahub.io/v1alpha1/externalmodels"
            ),
            ["gpt-4o-mini"]
        );
        assert_eq!(
            names_at(
                &standin,
                "/apis/inference.opendatahub.io/v1alpha1/namespaces/llm/externalproviders"
            ),
            ["openai"]
        );
        standin
            .delete(
                "inference.opendatahub.io/v1alpha1",
                "ExternalModel",
                "llm",
                "gpt-4o-mini",
            )
            .unwrap();
        assert!(
            names_at(
                &standin,
                "/apis/inference.opendatahub.io/v1alpha1/externalmodels"
            )
            .is_empty()
        );
        assert_eq!(
            names_at(
                &standin,
                "/apis/maas.opendatahub.io/v1alpha1/externalmodels"
            ),
            ["gpt-4o"]
        );
    }
}
