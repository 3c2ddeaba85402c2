//! The policy from the reference's resources (`--policy-source kubernetes`): kube-runtime
//! watchers (list + watch, resumed and relisted with backoff) on `MaaSModelRef` and
//! `ExternalModel` in all namespaces and `MaaSAuthPolicy` and `MaaSSubscription` in
//! `--policy-namespace`, and on `inference.opendatahub.io` `ExternalModel` and
//! `ExternalProvider` in all namespaces, each feeding a reflector store. The two
//! `inference.opendatahub.io` kinds are optional: a cluster without their CRDs answers their
//! list 404, which counts as listed empty (the first policy does not wait for them); the list is
//! retried with the watcher's backoff, so CRDs installed later are read then. Every change (and every
//! `--policy-reload-interval-ms`, for the base file) rebuilds the document with
//! [`translate::translate`] over the base file (tiers, defaults; optional) and, when it differs,
//! replaces the policy in force: the filter gets it at its next poll of
//! `GET /internal/v1/policy` (same ETag path as the file policy).
//!
//! Invalid resources never take effect: they are left out of the document and reported once per
//! resource version — a Kubernetes Event (`type: Warning`, `reason: InvalidSpec`, the field in
//! the note) on the resource, a log line, and the gauge
//! `maas_companion_policy_resources_invalid{kind}`. `status` (phase, conditions) is written as
//! the reference's controller writes it only with `--write-status` ([`status`]), where the
//! companion is the controller; by default the reference's maas-controller owns it.

pub mod status;
pub mod translate;

use crate::metrics::{Metrics, ResultLabels};
use crate::policy::{PolicyHandle, parse_yaml};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use maas_types::PolicyDocument;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use translate::{Invalid, Resources};

pub const GROUP: &str = "maas.opendatahub.io";
pub const VERSION: &str = "v1alpha1";
/// The group of the reference's (v0.2.1) ExternalModel and ExternalProvider.
pub const INFERENCE_GROUP: &str = "inference.opendatahub.io";
pub const INFERENCE_VERSION: &str = "v1alpha1";
/// `reportingController` of the Events written on invalid resources.
pub const REPORTER: &str = "maas-companion";
pub const REASON_INVALID: &str = "InvalidSpec";

fn api_resource(kind: &str, plural: &str) -> ApiResource {
    group_resource(GROUP, VERSION, kind, plural)
}

fn group_resource(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: format!("{group}/{version}"),
        kind: kind.into(),
        plural: plural.into(),
    }
}

/// Whether a watcher error is the API server's 404 on the list: the kind's CRD is not installed.
fn crd_absent(e: &watcher::Error) -> bool {
    matches!(e, watcher::Error::InitialListFailed(kube::Error::Api(s)) if s.code == 404)
}

/// A watched kind: its store, and (for an optional kind) whether its last list answered 404.
struct Watched {
    store: Store<DynamicObject>,
    /// `true` while the kind's CRD is absent (its list answered 404).
    absent: tokio::sync::watch::Receiver<bool>,
}

impl Watched {
    /// Until the first listing, or (optional kinds) until the list answers 404.
    async fn listed(&self, optional: bool) {
        let mut absent = self.absent.clone();
        if optional {
            tokio::select! {
                _ = self.store.wait_until_ready() => {}
                _ = absent.wait_for(|a| *a) => {}
            }
        } else {
            let _ = self.store.wait_until_ready().await;
        }
    }
}

/// Starts a watcher + reflector; every event wakes the rebuild loop.
fn watch(
    client: &kube::Client,
    ar: ApiResource,
    namespace: Option<&str>,
    changed: Arc<Notify>,
) -> (Watched, tokio::task::JoinHandle<()>) {
    let api: kube::Api<DynamicObject> = match namespace {
        Some(ns) => kube::Api::namespaced_with(client.clone(), ns, &ar),
        None => kube::Api::all_with(client.clone(), &ar),
    };
    let writer = reflector::store::Writer::new(ar.clone());
    let reader = writer.as_reader();
    let stream =
        reflector::reflector(writer, watcher(api, watcher::Config::default())).default_backoff();
    let kind = format!("{}/{}", ar.api_version, ar.kind);
    let (absent_tx, absent) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(_) => {
                    absent_tx.send_if_modified(|a| std::mem::replace(a, false));
                    changed.notify_one();
                }
                // Logged once per absence, not at every retry.
                Err(e) if crd_absent(&e) => {
                    if absent_tx.send_if_modified(|a| !std::mem::replace(a, true)) {
                        tracing::info!(%kind, "no such resource on this cluster (CRD not installed): none read, the list is retried");
                    }
                }
                Err(e) => tracing::warn!(%kind, error = %e, "watching policy resources"),
            }
        }
    });
    (
        Watched {
            store: reader,
            absent,
        },
        task,
    )
}

fn objects(store: &Store<DynamicObject>) -> Vec<DynamicObject> {
    store.state().iter().map(|o| (**o).clone()).collect()
}

struct Stores {
    model_refs: Watched,
    external_models: Watched,
    auth_policies: Watched,
    subscriptions: Watched,
    /// `inference.opendatahub.io` (optional: their CRDs may be absent).
    inference_models: Watched,
    external_providers: Watched,
}

impl Stores {
    /// Starts a watcher per kind; every event wakes `changed`.
    fn start(
        client: &kube::Client,
        namespace: &str,
        changed: &Arc<Notify>,
    ) -> (Stores, Vec<tokio::task::JoinHandle<()>>) {
        let ns = Some(namespace);
        let (model_refs, t1) = watch(
            client,
            api_resource(translate::KIND_MODEL_REF, "maasmodelrefs"),
            None,
            changed.clone(),
        );
        let (external_models, t2) = watch(
            client,
            api_resource(translate::KIND_EXTERNAL_MODEL, "externalmodels"),
            None,
            changed.clone(),
        );
        let (auth_policies, t3) = watch(
            client,
            api_resource(translate::KIND_AUTH_POLICY, "maasauthpolicies"),
            ns,
            changed.clone(),
        );
        let (subscriptions, t4) = watch(
            client,
            api_resource(translate::KIND_SUBSCRIPTION, "maassubscriptions"),
            ns,
            changed.clone(),
        );
        let (inference_models, t5) = watch(
            client,
            group_resource(
                INFERENCE_GROUP,
                INFERENCE_VERSION,
                translate::KIND_EXTERNAL_MODEL,
                "externalmodels",
            ),
            None,
            changed.clone(),
        );
        let (external_providers, t6) = watch(
            client,
            group_resource(
                INFERENCE_GROUP,
                INFERENCE_VERSION,
                translate::KIND_EXTERNAL_PROVIDER,
                "externalproviders",
            ),
            None,
            changed.clone(),
        );
        let stores = Stores {
            model_refs,
            external_models,
            auth_policies,
            subscriptions,
            inference_models,
            external_providers,
        };
        (stores, vec![t1, t2, t3, t4, t5, t6])
    }

    fn resources(&self) -> Resources {
        Resources {
            model_refs: objects(&self.model_refs.store),
            external_models: objects(&self.external_models.store),
            auth_policies: objects(&self.auth_policies.store),
            subscriptions: objects(&self.subscriptions.store),
            inference_models: objects(&self.inference_models.store),
            external_providers: objects(&self.external_providers.store),
        }
    }

    /// Every kind listed; an optional kind whose CRD is absent counts as listed (empty).
    async fn ready(&self) {
        futures::join!(
            self.model_refs.listed(false),
            self.external_models.listed(false),
            self.auth_policies.listed(false),
            self.subscriptions.listed(false),
            self.inference_models.listed(true),
            self.external_providers.listed(true),
        );
    }
}

/// The resource an [`Invalid`] names, for the Event's `regarding`. ExternalModel is a kind of
/// both groups: the one of the object's `apiVersion`, else the first list holding that name.
/// Also the object's version for reporting it once: its `generation` (which a `status` write
/// leaves as it is), else its resource version.
fn reference(res: &Resources, inv: &Invalid) -> Option<(ObjectReference, Option<String>)> {
    use translate::Group::{Inference, Maas};
    let lists: Vec<(&Vec<DynamicObject>, translate::Group)> = match inv.kind {
        translate::KIND_MODEL_REF => vec![(&res.model_refs, Maas)],
        translate::KIND_EXTERNAL_MODEL => vec![
            (&res.external_models, Maas),
            (&res.inference_models, Inference),
        ],
        translate::KIND_EXTERNAL_PROVIDER => vec![(&res.external_providers, Inference)],
        translate::KIND_AUTH_POLICY => vec![(&res.auth_policies, Maas)],
        _ => vec![(&res.subscriptions, Maas)],
    };
    lists
        .into_iter()
        .filter(|(_, group)| inv.group.is_none_or(|g| g == *group))
        .find_map(|(list, group)| {
            let api_version = match group {
                Maas => format!("{GROUP}/{VERSION}"),
                Inference => format!("{INFERENCE_GROUP}/{INFERENCE_VERSION}"),
            };
            list.iter()
                .find(|o| {
                    o.metadata.namespace.as_deref() == Some(inv.namespace.as_str())
                        && o.metadata.name.as_deref() == Some(inv.name.as_str())
                })
                .map(|o| {
                    let reference = ObjectReference {
                        api_version: Some(api_version),
                        kind: Some(inv.kind.to_string()),
                        name: o.metadata.name.clone(),
                        namespace: o.metadata.namespace.clone(),
                        uid: o.metadata.uid.clone(),
                        resource_version: o.metadata.resource_version.clone(),
                        field_path: None,
                    };
                    let version = match o.metadata.generation {
                        Some(g) => Some(format!("generation {g}")),
                        None => o.metadata.resource_version.clone(),
                    };
                    (reference, version)
                })
        })
}

pub struct KubernetesPolicy {
    pub client: kube::Client,
    pub namespace: String,
    pub base_file: Option<PathBuf>,
    pub reload_interval: Duration,
    /// `--write-status`: the resources' `status` is written, the model servers' runtime
    /// readiness read by these probes.
    pub write_status: Option<crate::readiness::Readiness>,
}

/// The base document: the file's (validated), or none.
fn read_base(path: Option<&PathBuf>) -> Result<Option<PolicyDocument>, String> {
    match path {
        None => Ok(None),
        Some(p) => {
            let bytes =
                std::fs::read(p).map_err(|e| format!("policy file {}: {e}", p.display()))?;
            parse_yaml(&bytes)
                .map(Some)
                .map_err(|e| format!("policy file {}: {e}", p.display()))
        }
    }
}

/// The `policy_resources_invalid` gauge of each kind: how many of its resources are left out.
fn count_invalid(metrics: &Metrics, invalid: &[Invalid]) {
    for kind in [
        translate::KIND_MODEL_REF,
        translate::KIND_EXTERNAL_MODEL,
        translate::KIND_EXTERNAL_PROVIDER,
        translate::KIND_AUTH_POLICY,
        translate::KIND_SUBSCRIPTION,
    ] {
        let n = invalid.iter().filter(|i| i.kind == kind).count();
        metrics
            .policy_resources_invalid
            .get_or_create(&vec![("kind", kind.to_string())])
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}

/// Logs each invalid resource, and writes a Warning Event on it, once while it stays as it is
/// (the same generation, or resource version): the set reported now, for the next round.
async fn report_invalid(
    recorder: &Recorder,
    res: &Resources,
    invalid: &[Invalid],
    reported: &BTreeSet<(Invalid, Option<String>)>,
) -> BTreeSet<(Invalid, Option<String>)> {
    let mut now_reported = BTreeSet::new();
    for inv in invalid {
        let (reference, version) = reference(res, inv).unzip();
        let key = (inv.clone(), version.flatten());
        if !reported.contains(&key) {
            tracing::warn!(kind = inv.kind, namespace = %inv.namespace, name = %inv.name, field = %inv.field, message = %inv.message, "invalid policy resource left out");
            if let Some(r) = &reference {
                let event = Event {
                    type_: EventType::Warning,
                    reason: REASON_INVALID.into(),
                    note: Some(
                        format!("{}: {}", inv.field, inv.message)
                            .chars()
                            .take(1000)
                            .collect(),
                    ),
                    action: "TranslatePolicy".into(),
                    secondary: None,
                };
                if let Err(e) = recorder.publish(&event, r).await {
                    tracing::warn!(error = %e, "cannot write the InvalidSpec event");
                }
            }
        }
        now_reported.insert(key);
    }
    now_reported
}

impl KubernetesPolicy {
    /// The first document (before any resource is listed): the base file's, or an empty one.
    pub fn initial(&self) -> Result<PolicyDocument, String> {
        let base = read_base(self.base_file.as_ref())?;
        Ok(translate::translate(base.as_ref(), &Resources::default()).document)
    }

    /// Starts the watchers and the rebuild loop. The receiver resolves once the first listing
    /// of every kind (an absent optional kind counting as listed) has been translated and
    /// applied.
    pub fn spawn(
        self,
        policy: PolicyHandle,
        metrics: Arc<Metrics>,
    ) -> (
        Vec<tokio::task::JoinHandle<()>>,
        tokio::sync::oneshot::Receiver<()>,
    ) {
        let changed = Arc::new(Notify::new());
        let (stores, mut tasks) = Stores::start(&self.client, &self.namespace, &changed);
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let recorder = Recorder::new(
            self.client.clone(),
            Reporter {
                controller: REPORTER.into(),
                instance: std::env::var("POD_NAME").ok(),
            },
        );
        let main = tokio::spawn(async move {
            stores.ready().await;
            tracing::info!(namespace = %self.namespace, "policy resources listed");
            let mut ready_tx = Some(ready_tx);
            let mut reported: BTreeSet<(Invalid, Option<String>)> = BTreeSet::new();
            let mut noted: BTreeSet<String> = BTreeSet::new();
            let mut base = read_base(self.base_file.as_ref()).ok().flatten();
            let mut ticker = tokio::time::interval(self.reload_interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                match read_base(self.base_file.as_ref()) {
                    Ok(b) => base = b,
                    Err(e) => {
                        tracing::debug!(error = %e, "base policy file unreadable or invalid, keeping the previous one")
                    }
                }
                let res = stores.resources();
                let t = translate::translate(base.as_ref(), &res);
                if *policy.document() != t.document {
                    policy.replace(t.document.clone());
                    metrics
                        .policy_reloads
                        .get_or_create(&ResultLabels { result: "accepted" })
                        .inc();
                    tracing::info!(namespace = %self.namespace, "policy rebuilt from the resources");
                }
                count_invalid(&metrics, &t.invalid);
                reported = report_invalid(&recorder, &res, &t.invalid, &reported).await;
                if let Some(readiness) = &self.write_status {
                    let runtime = status::runtime(&t, readiness).await;
                    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
                    status::write(&self.client, status::desired(&res, &t, &runtime, &now)).await;
                }
                for note in t.notes {
                    if noted.insert(note.clone()) {
                        tracing::warn!(%note, "policy resource partly left out");
                    }
                }
                if let Some(tx) = ready_tx.take() {
                    let _ = tx.send(());
                }
                tokio::select! {
                    _ = changed.notified() => {
                        // Let a burst of events (a kubectl apply of several files) settle.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    _ = ticker.tick() => {}
                }
            }
        });
        tasks.push(main);
        (tasks, ready_rx)
    }
}
