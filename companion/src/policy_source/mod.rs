//! The policy from the reference's resources (`--policy-source kubernetes`): kube-runtime
//! watchers (list + watch, resumed and relisted with backoff) on `MaaSModelRef` and
//! `ExternalModel` in all namespaces and `MaaSAuthPolicy` and `MaaSSubscription` in
//! `--policy-namespace`, each feeding a reflector store. Every change (and every
//! `--policy-reload-interval-ms`, for the base file) rebuilds the document with
//! [`translate::translate`] over the base file (tiers, defaults; optional) and, when it differs,
//! replaces the policy in force: the filter gets it at its next poll of
//! `GET /internal/v1/policy` (same ETag path as the file policy).
//!
//! Invalid resources never take effect: they are left out of the document and reported once per
//! resource version — a Kubernetes Event (`type: Warning`, `reason: InvalidSpec`, the field in
//! the note) on the resource, a log line, and the gauge
//! `maas_companion_policy_resources_invalid{kind}`. Status conditions are not written: the
//! reference's controller owns `status` of these resources.

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
/// `reportingController` of the Events written on invalid resources.
pub const REPORTER: &str = "maas-companion";
pub const REASON_INVALID: &str = "InvalidSpec";

fn api_resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: GROUP.into(),
        version: VERSION.into(),
        api_version: format!("{GROUP}/{VERSION}"),
        kind: kind.into(),
        plural: plural.into(),
    }
}

/// Starts a watcher + reflector; every event wakes the rebuild loop.
fn watch(
    client: &kube::Client,
    ar: ApiResource,
    namespace: Option<&str>,
    changed: Arc<Notify>,
) -> (Store<DynamicObject>, tokio::task::JoinHandle<()>) {
    let api: kube::Api<DynamicObject> = match namespace {
        Some(ns) => kube::Api::namespaced_with(client.clone(), ns, &ar),
        None => kube::Api::all_with(client.clone(), &ar),
    };
    let writer = reflector::store::Writer::new(ar.clone());
    let reader = writer.as_reader();
    let stream =
        reflector::reflector(writer, watcher(api, watcher::Config::default())).default_backoff();
    let kind = ar.kind.clone();
    let task = tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(_) => changed.notify_one(),
                Err(e) => tracing::warn!(%kind, error = %e, "watching policy resources"),
            }
        }
    });
    (reader, task)
}

fn objects(store: &Store<DynamicObject>) -> Vec<DynamicObject> {
    store.state().iter().map(|o| (**o).clone()).collect()
}

struct Stores {
    model_refs: Store<DynamicObject>,
    external_models: Store<DynamicObject>,
    auth_policies: Store<DynamicObject>,
    subscriptions: Store<DynamicObject>,
}

impl Stores {
    fn resources(&self) -> Resources {
        Resources {
            model_refs: objects(&self.model_refs),
            external_models: objects(&self.external_models),
            auth_policies: objects(&self.auth_policies),
            subscriptions: objects(&self.subscriptions),
        }
    }

    async fn ready(&self) {
        let _ = futures::join!(
            self.model_refs.wait_until_ready(),
            self.external_models.wait_until_ready(),
            self.auth_policies.wait_until_ready(),
            self.subscriptions.wait_until_ready(),
        );
    }
}

/// The resource an [`Invalid`] names, for the Event's `regarding`.
fn reference(res: &Resources, inv: &Invalid) -> Option<ObjectReference> {
    let list = match inv.kind {
        translate::KIND_MODEL_REF => &res.model_refs,
        translate::KIND_EXTERNAL_MODEL => &res.external_models,
        translate::KIND_AUTH_POLICY => &res.auth_policies,
        _ => &res.subscriptions,
    };
    list.iter()
        .find(|o| {
            o.metadata.namespace.as_deref() == Some(inv.namespace.as_str())
                && o.metadata.name.as_deref() == Some(inv.name.as_str())
        })
        .map(|o| ObjectReference {
            api_version: Some(format!("{GROUP}/{VERSION}")),
            kind: Some(inv.kind.to_string()),
            name: o.metadata.name.clone(),
            namespace: o.metadata.namespace.clone(),
            uid: o.metadata.uid.clone(),
            resource_version: o.metadata.resource_version.clone(),
            field_path: None,
        })
}

pub struct KubernetesPolicy {
    pub client: kube::Client,
    pub namespace: String,
    pub base_file: Option<PathBuf>,
    pub reload_interval: Duration,
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
/// (the same resource version): the set reported now, for the next round.
async fn report_invalid(
    recorder: &Recorder,
    res: &Resources,
    invalid: &[Invalid],
    reported: &BTreeSet<(Invalid, Option<String>)>,
) -> BTreeSet<(Invalid, Option<String>)> {
    let mut now_reported = BTreeSet::new();
    for inv in invalid {
        let reference = reference(res, inv);
        let key = (
            inv.clone(),
            reference.as_ref().and_then(|r| r.resource_version.clone()),
        );
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
    /// of all four kinds has been translated and applied.
    pub fn spawn(
        self,
        policy: PolicyHandle,
        metrics: Arc<Metrics>,
    ) -> (
        Vec<tokio::task::JoinHandle<()>>,
        tokio::sync::oneshot::Receiver<()>,
    ) {
        let changed = Arc::new(Notify::new());
        let ns = Some(self.namespace.as_str());
        let (model_refs, t1) = watch(
            &self.client,
            api_resource(translate::KIND_MODEL_REF, "maasmodelrefs"),
            None,
            changed.clone(),
        );
        let (external_models, t2) = watch(
            &self.client,
            api_resource(translate::KIND_EXTERNAL_MODEL, "externalmodels"),
            None,
            changed.clone(),
        );
        let (auth_policies, t3) = watch(
            &self.client,
            api_resource(translate::KIND_AUTH_POLICY, "maasauthpolicies"),
            ns,
            changed.clone(),
        );
        let (subscriptions, t4) = watch(
            &self.client,
            api_resource(translate::KIND_SUBSCRIPTION, "maassubscriptions"),
            ns,
            changed.clone(),
        );
        let stores = Stores {
            model_refs,
            external_models,
            auth_policies,
            subscriptions,
        };
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
                    policy.replace(t.document);
                    metrics
                        .policy_reloads
                        .get_or_create(&ResultLabels { result: "accepted" })
                        .inc();
                    tracing::info!(namespace = %self.namespace, "policy rebuilt from the resources");
                }
                count_invalid(&metrics, &t.invalid);
                reported = report_invalid(&recorder, &res, &t.invalid, &reported).await;
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
        (vec![t1, t2, t3, t4, main], ready_rx)
    }
}
