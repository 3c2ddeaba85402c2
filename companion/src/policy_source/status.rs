//! `status` of the reference's resources, written as the reference's controller writes it, when
//! the companion is the controller (`--write-status`; off by default: where the reference's
//! maas-controller runs, it owns `status`).
//!
//! What is written, per kind (phases, condition types and reasons as the reference's
//! `maas-controller` sets them, `maasmodelref_controller.go` and the CRDs' status schemas):
//! - MaaSModelRef: `phase` Ready | Pending | Unhealthy | Failed | Invalid and the conditions
//!   `GovernanceAttached` (in a subscription or a tier of the policy, i.e. some MaaSAuthPolicy
//!   admits its owners), `RuntimeReady` (the model server's readiness probe, the same one as
//!   `ready` in `/v1/models`; `Unknown` when there is nothing to probe) and `Ready` (both).
//! - MaaSSubscription: `phase` Active | Degraded | Failed, `modelRefStatuses[]` (Valid,
//!   NotFound, NoPairingFound) and `Ready`.
//! - MaaSAuthPolicy: `phase` Active | Degraded | Failed and `Ready` (its model references found).
//! - ExternalModel (both groups), ExternalProvider: `phase` Ready | Pending | Failed and `Ready`.
//!
//! Only these fields are patched (a JSON merge patch of `/status`): others, such as a
//! MaaSModelRef's `endpoint`, are left as they are. A status is written only when it differs
//! from the object's (a condition keeps its `lastTransitionTime` while its status stays), so
//! the watch event a write causes finds nothing to write, and N replicas computing the same
//! status write it once.

use super::translate::{
    Group, Invalid, KIND_AUTH_POLICY, KIND_EXTERNAL_MODEL, KIND_EXTERNAL_PROVIDER, KIND_MODEL_REF,
    KIND_SUBSCRIPTION, Resources, SUBSCRIPTION_ONLY_TIER, Translation, served_bindings,
};
use kube::api::{ApiResource, DynamicObject};
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;

/// One status to write: the resource, the object and the fields of `status` to set.
#[derive(Debug, Clone, PartialEq)]
pub struct StatusWrite {
    pub resource: ApiResource,
    pub namespace: String,
    pub name: String,
    pub status: Value,
}

/// What the companion knows of a model server, by MaaSModelRef `namespace/name`: up, down, or
/// nothing to probe (`None`).
pub type Runtime = BTreeMap<String, Option<bool>>;

/// One condition as computed, before its `lastTransitionTime`.
struct Cond {
    kind: &'static str,
    /// "True", "False" or "Unknown".
    status: &'static str,
    reason: &'static str,
    message: String,
}

fn truth(b: bool) -> &'static str {
    if b { "True" } else { "False" }
}

/// The conditions as `status.conditions`, each keeping the previous `lastTransitionTime` while
/// its status is unchanged.
fn conditions(o: &DynamicObject, list: Vec<Cond>, now: &str) -> Value {
    let previous = o
        .data
        .get("status")
        .and_then(|s| s.get("conditions"))
        .and_then(Value::as_array);
    let generation = o.metadata.generation;
    Value::Array(
        list.into_iter()
            .map(|c| {
                let since = previous
                    .and_then(|p| {
                        p.iter().find(|x| {
                            x.get("type").and_then(Value::as_str) == Some(c.kind)
                                && x.get("status").and_then(Value::as_str) == Some(c.status)
                        })
                    })
                    .and_then(|x| x.get("lastTransitionTime"))
                    .and_then(Value::as_str)
                    .unwrap_or(now);
                let mut m = Map::new();
                m.insert("type".into(), json!(c.kind));
                m.insert("status".into(), json!(c.status));
                m.insert("reason".into(), json!(c.reason));
                // The schema's bound (metav1.Condition message, 32768).
                m.insert(
                    "message".into(),
                    json!(c.message.chars().take(32768).collect::<String>()),
                );
                m.insert("lastTransitionTime".into(), json!(since));
                if let Some(g) = generation {
                    m.insert("observedGeneration".into(), json!(g));
                }
                Value::Object(m)
            })
            .collect(),
    )
}

/// `Ready` for the kinds with one condition: True ("Reconciled") or False with `reason`.
fn ready(ok: bool, reason: &'static str, message: String) -> Cond {
    Cond {
        kind: "Ready",
        status: truth(ok),
        reason: if ok { "Reconciled" } else { reason },
        message,
    }
}

fn ns_name(o: &DynamicObject) -> (String, String) {
    (
        o.metadata.namespace.clone().unwrap_or_default(),
        o.metadata.name.clone().unwrap_or_default(),
    )
}

fn group_of(o: &DynamicObject) -> Group {
    match &o.types {
        Some(t) if t.api_version.starts_with("inference.opendatahub.io/") => Group::Inference,
        _ => Group::Maas,
    }
}

/// The first invalid entry naming this object.
fn invalid_of<'a>(t: &'a Translation, kind: &str, o: &DynamicObject) -> Option<&'a Invalid> {
    let (ns, name) = ns_name(o);
    let group = group_of(o);
    t.invalid.iter().find(|i| {
        i.kind == kind && i.namespace == ns && i.name == name && i.group.is_none_or(|g| g == group)
    })
}

fn why(i: &Invalid) -> String {
    format!("{}: {}", i.field, i.message)
}

/// `spec.modelRefs[]` as `(namespace, name)`; a reference without a namespace is in `default_ns`.
fn model_refs(o: &DynamicObject, default_ns: &str) -> Vec<(String, String)> {
    o.data
        .get("spec")
        .and_then(|s| s.get("modelRefs"))
        .and_then(Value::as_array)
        .map(|refs| {
            refs.iter()
                .filter_map(|r| {
                    let name = r.get("name").and_then(Value::as_str)?;
                    let ns = r
                        .get("namespace")
                        .and_then(Value::as_str)
                        .unwrap_or(default_ns);
                    Some((ns.to_string(), name.to_string()))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The model of the policy a MaaSModelRef became, if any.
fn served_model<'a>(t: &'a Translation, ns: &str, name: &str) -> Option<&'a maas_types::Model> {
    let owned = format!("{ns}/{name}");
    t.document
        .models
        .iter()
        .find(|m| m.name == name && m.owned_by.as_deref() == Some(owned.as_str()))
}

fn model_ref_status(o: &DynamicObject, t: &Translation, runtime: &Runtime, now: &str) -> Value {
    let (ns, name) = ns_name(o);
    let previous_governed = o
        .data
        .get("status")
        .and_then(|s| s.get("conditions"))
        .and_then(Value::as_array)
        .is_some_and(|c| {
            c.iter().any(|x| {
                x.get("type").and_then(Value::as_str) == Some("GovernanceAttached")
                    && x.get("status").and_then(Value::as_str) == Some("True")
            })
        });
    let (phase, conds) = if let Some(i) = invalid_of(t, KIND_MODEL_REF, o) {
        let unknown = |kind| Cond {
            kind,
            status: "Unknown",
            reason: "InvalidSpec",
            message: "the resource is invalid".into(),
        };
        (
            "Invalid",
            vec![
                ready(false, "InvalidSpec", why(i)),
                unknown("GovernanceAttached"),
                unknown("RuntimeReady"),
            ],
        )
    } else if let Some(model) = served_model(t, &ns, &name) {
        let up = runtime.get(&format!("{ns}/{name}")).copied().flatten();
        served_model_status(t, model, up, previous_governed)
    } else {
        // Left out because what it names is invalid (an ExternalModel, its provider).
        let target = o
            .data
            .get("spec")
            .and_then(|s| s.get("modelRef"))
            .and_then(|r| r.get("name"))
            .and_then(Value::as_str)
            .unwrap_or_default();
        let cause = t
            .invalid
            .iter()
            .find(|i| {
                i.namespace == ns
                    && ((i.kind == KIND_EXTERNAL_MODEL && i.name == target)
                        || i.kind == KIND_EXTERNAL_PROVIDER)
            })
            .map(|i| format!("{} {}/{}: {}", i.kind, i.namespace, i.name, why(i)))
            .unwrap_or_else(|| "left out of the policy".into());
        (
            "Failed",
            vec![ready(false, "ReconcileFailed", cause.clone()), {
                Cond {
                    kind: "RuntimeReady",
                    status: "False",
                    reason: "BackendNotReady",
                    message: cause,
                }
            }],
        )
    };
    json!({"phase": phase, "conditions": conditions(o, conds, now)})
}

/// A MaaSModelRef that is in the policy: governance from the policy, runtime from its probe.
fn served_model_status(
    t: &Translation,
    model: &maas_types::Model,
    up: Option<bool>,
    previous_governed: bool,
) -> (&'static str, Vec<Cond>) {
    let governed = model.tiers.iter().any(|t| t != SUBSCRIPTION_ONLY_TIER)
        || t.document
            .subscriptions
            .iter()
            .any(|s| s.models.iter().any(|m| m.name == model.name));
    let governance = match (governed, previous_governed) {
        (true, _) => Cond {
            kind: "GovernanceAttached",
            status: "True",
            reason: "GovernancePaired",
            message: "Active governance pairing found".into(),
        },
        (false, true) => Cond {
            kind: "GovernanceAttached",
            status: "False",
            reason: "GovernanceGap",
            message: "Governance pairing lost".into(),
        },
        (false, false) => Cond {
            kind: "GovernanceAttached",
            status: "False",
            reason: "NoPairingFound",
            message: "No active subscription and auth policy pairing found".into(),
        },
    };
    let runtime_cond = match up {
        Some(true) => Cond {
            kind: "RuntimeReady",
            status: "True",
            reason: "RuntimeHealthy",
            message: "Backend is healthy".into(),
        },
        Some(false) => Cond {
            kind: "RuntimeReady",
            status: "False",
            reason: "RuntimeHealthFailure",
            message: "Backend is not ready: its readiness probe failed".into(),
        },
        None => Cond {
            kind: "RuntimeReady",
            status: "Unknown",
            reason: "NoProbeTarget",
            message: "no backend URL to probe (status.endpoint or spec.endpointOverride)".into(),
        },
    };
    let (phase, message) = match (governed, up) {
        (true, Some(true)) => ("Ready", "Governed and runtime-healthy"),
        (true, Some(false)) => ("Unhealthy", "Governed but backend is not ready"),
        (true, None) => ("Pending", "Governed; backend readiness unknown"),
        (false, Some(true)) => ("Pending", "Awaiting governance pairing"),
        (false, _) => (
            "Pending",
            "Awaiting governance pairing and backend readiness",
        ),
    };
    let overall = Cond {
        kind: "Ready",
        status: truth(phase == "Ready"),
        reason: if phase == "Ready" {
            "Reconciled"
        } else {
            "BackendNotReady"
        },
        message: message.into(),
    };
    (phase, vec![overall, governance, runtime_cond])
}

fn subscription_status(o: &DynamicObject, t: &Translation, now: &str) -> Value {
    let (ns, name) = ns_name(o);
    if let Some(i) = invalid_of(t, KIND_SUBSCRIPTION, o) {
        return json!({
            "phase": "Failed",
            "conditions": conditions(o, vec![ready(false, "InvalidSpec", why(i))], now),
        });
    }
    let served = t
        .document
        .subscriptions
        .iter()
        .find(|s| s.name == name && s.namespace.as_deref() == Some(ns.as_str()));
    let refs = model_refs(o, &ns);
    let statuses: Vec<Value> = refs
        .iter()
        .map(|(mns, mname)| {
            let (ok, reason, message) = if served_model(t, mns, mname).is_none() {
                (
                    false,
                    "NotFound",
                    format!("MaaSModelRef {mns}/{mname} is not in the policy"),
                )
            } else if served.is_some_and(|s| s.models.iter().any(|m| &m.name == mname)) {
                (true, "Valid", String::new())
            } else {
                (
                    false,
                    "NoPairingFound",
                    "no MaaSAuthPolicy admits every owner of the subscription to this model"
                        .to_string(),
                )
            };
            json!({"name": mname, "namespace": mns, "ready": ok, "reason": reason,
                   "message": message.chars().take(1024).collect::<String>()})
        })
        .collect();
    let ok = statuses
        .iter()
        .filter(|s| s["ready"] == json!(true))
        .count();
    let (phase, cond) = if ok == refs.len() && ok > 0 {
        (
            "Active",
            ready(true, "", "every model reference is valid".into()),
        )
    } else if ok > 0 {
        (
            "Degraded",
            ready(
                false,
                "PartialFailure",
                format!("{ok} of {} model references are valid", refs.len()),
            ),
        )
    } else {
        (
            "Failed",
            ready(
                false,
                "ReconcileFailed",
                "no model reference is valid".into(),
            ),
        )
    };
    json!({"phase": phase, "modelRefStatuses": statuses, "conditions": conditions(o, vec![cond], now)})
}

fn auth_policy_status(o: &DynamicObject, t: &Translation, now: &str) -> Value {
    if let Some(i) = invalid_of(t, KIND_AUTH_POLICY, o) {
        return json!({
            "phase": "Failed",
            "conditions": conditions(o, vec![ready(false, "InvalidSpec", why(i))], now),
        });
    }
    let (ns, _) = ns_name(o);
    let refs = model_refs(o, &ns);
    let missing: Vec<String> = refs
        .iter()
        .filter(|(mns, mname)| served_model(t, mns, mname).is_none())
        .map(|(mns, mname)| format!("{mns}/{mname}"))
        .collect();
    let (phase, cond) = if missing.is_empty() {
        (
            "Active",
            ready(true, "", "every model reference is in the policy".into()),
        )
    } else if missing.len() < refs.len() {
        (
            "Degraded",
            ready(
                false,
                "PartialFailure",
                format!("not in the policy: {}", missing.join(", ")),
            ),
        )
    } else {
        (
            "Failed",
            ready(
                false,
                "NotFound",
                format!("not in the policy: {}", missing.join(", ")),
            ),
        )
    };
    json!({"phase": phase, "conditions": conditions(o, vec![cond], now)})
}

/// An ExternalModel: Failed when invalid, Ready when a served MaaSModelRef names it, else
/// Pending.
fn external_model_status(o: &DynamicObject, res: &Resources, t: &Translation, now: &str) -> Value {
    if let Some(i) = invalid_of(t, KIND_EXTERNAL_MODEL, o) {
        return json!({
            "phase": "Failed",
            "conditions": conditions(o, vec![ready(false, "InvalidSpec", why(i))], now),
        });
    }
    let (ns, name) = ns_name(o);
    // A MaaSModelRef reads the inference.opendatahub.io ExternalModel of a name when both exist.
    let shadowed = group_of(o) == Group::Maas
        && res
            .inference_models
            .iter()
            .any(|e| ns_name(e) == (ns.clone(), name.clone()));
    let used = !shadowed && names_served_external(res, t, &ns, &name);
    let (phase, cond) = if used {
        (
            "Ready",
            ready(true, "", "served through its MaaSModelRef".into()),
        )
    } else if shadowed {
        (
            "Pending",
            ready(
                false,
                "Shadowed",
                "an inference.opendatahub.io ExternalModel of the same name is used instead".into(),
            ),
        )
    } else {
        (
            "Pending",
            ready(
                false,
                "NoModelRef",
                "no MaaSModelRef in the policy names this ExternalModel".into(),
            ),
        )
    };
    json!({"phase": phase, "conditions": conditions(o, vec![cond], now)})
}

/// Whether a MaaSModelRef of `ns` that is in the policy names ExternalModel `name`.
fn names_served_external(res: &Resources, t: &Translation, ns: &str, name: &str) -> bool {
    res.model_refs.iter().any(|r| {
        let (rns, rname) = ns_name(r);
        let target = r.data.get("spec").and_then(|s| s.get("modelRef"));
        rns == ns
            && target.and_then(|x| x.get("kind")).and_then(Value::as_str) == Some("ExternalModel")
            && target.and_then(|x| x.get("name")).and_then(Value::as_str) == Some(name)
            && served_model(t, &rns, &rname).is_some()
    })
}

/// An ExternalProvider: Failed when invalid, Ready when a served ExternalModel sends traffic to
/// it (a binding of weight above 0 that is served: [`served_bindings`]), else Pending.
fn external_provider_status(
    o: &DynamicObject,
    res: &Resources,
    t: &Translation,
    now: &str,
) -> Value {
    if let Some(i) = invalid_of(t, KIND_EXTERNAL_PROVIDER, o) {
        return json!({
            "phase": "Failed",
            "conditions": conditions(o, vec![ready(false, "InvalidSpec", why(i))], now),
        });
    }
    let (ns, name) = ns_name(o);
    let used = res.inference_models.iter().any(|em| {
        let (ens, ename) = ns_name(em);
        ens == ns
            && names_served_external(res, t, &ens, &ename)
            && em
                .data
                .get("spec")
                .and_then(|s| s.get("externalProviderRefs"))
                .and_then(Value::as_array)
                .is_some_and(|refs| {
                    // Only the bindings that carry traffic (a weight above 0, the model's API).
                    served_bindings(refs).into_iter().any(|i| {
                        refs[i]
                            .get("ref")
                            .and_then(|r| r.get("name"))
                            .and_then(Value::as_str)
                            == Some(name.as_str())
                    })
                })
    });
    let cond = if used {
        ready(true, "", "used by a served ExternalModel".into())
    } else {
        ready(
            false,
            "NoModelRef",
            "no served ExternalModel binds this provider".into(),
        )
    };
    let phase = if used { "Ready" } else { "Pending" };
    json!({"phase": phase, "conditions": conditions(o, vec![cond], now)})
}

/// Whether `status` holds every field of `desired` as it is.
fn holds(o: &DynamicObject, desired: &Value) -> bool {
    let current = o.data.get("status");
    desired.as_object().is_some_and(|d| {
        d.iter()
            .all(|(k, v)| current.and_then(|c| c.get(k)) == Some(v))
    })
}

/// Every status that differs from what the resources hold, for the translation `t` of `res`
/// and what is known of the model servers; `now` (RFC 3339) stamps conditions that changed.
pub fn desired(res: &Resources, t: &Translation, runtime: &Runtime, now: &str) -> Vec<StatusWrite> {
    use super::{GROUP, INFERENCE_GROUP, INFERENCE_VERSION, VERSION, group_resource};
    let maas = |kind: &str, plural: &str| group_resource(GROUP, VERSION, kind, plural);
    let inference =
        |kind: &str, plural: &str| group_resource(INFERENCE_GROUP, INFERENCE_VERSION, kind, plural);
    let mut out = Vec::new();
    let mut push = |resource: ApiResource, o: &DynamicObject, status: Value| {
        if !holds(o, &status) {
            let (namespace, name) = ns_name(o);
            out.push(StatusWrite {
                resource,
                namespace,
                name,
                status,
            });
        }
    };
    for o in &res.model_refs {
        push(
            maas(KIND_MODEL_REF, "maasmodelrefs"),
            o,
            model_ref_status(o, t, runtime, now),
        );
    }
    for o in &res.subscriptions {
        push(
            maas(KIND_SUBSCRIPTION, "maassubscriptions"),
            o,
            subscription_status(o, t, now),
        );
    }
    for o in &res.auth_policies {
        push(
            maas(KIND_AUTH_POLICY, "maasauthpolicies"),
            o,
            auth_policy_status(o, t, now),
        );
    }
    for o in &res.external_models {
        push(
            maas(KIND_EXTERNAL_MODEL, "externalmodels"),
            o,
            external_model_status(o, res, t, now),
        );
    }
    for o in &res.inference_models {
        push(
            inference(KIND_EXTERNAL_MODEL, "externalmodels"),
            o,
            external_model_status(o, res, t, now),
        );
    }
    for o in &res.external_providers {
        push(
            inference(KIND_EXTERNAL_PROVIDER, "externalproviders"),
            o,
            external_provider_status(o, res, t, now),
        );
    }
    out
}

/// What is known of each MaaSModelRef's server: its readiness probe (cached), or `None` when
/// it has nothing to probe.
pub async fn runtime(t: &Translation, readiness: &crate::readiness::Readiness) -> Runtime {
    let models: Vec<&maas_types::Model> = t
        .document
        .models
        .iter()
        .filter(|m| m.owned_by.is_some())
        .collect();
    let up = readiness.ready(&models).await;
    models
        .iter()
        .zip(up)
        .filter_map(|(m, up)| {
            let known = readiness.probe_url(m).map(|_| up);
            m.owned_by.clone().map(|o| (o, known))
        })
        .collect()
}

/// Writes each status (a merge patch of `/status`); a failure is logged and retried at the
/// next round (the object still differs).
pub async fn write(client: &kube::Client, writes: Vec<StatusWrite>) {
    use kube::api::{Patch, PatchParams};
    for w in writes {
        let api: kube::Api<DynamicObject> =
            kube::Api::namespaced_with(client.clone(), &w.namespace, &w.resource);
        let patch = json!({"status": w.status});
        match api
            .patch_status(&w.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {
                tracing::debug!(kind = %w.resource.kind, namespace = %w.namespace, name = %w.name, phase = %w.status["phase"], "status written")
            }
            Err(e) => {
                tracing::warn!(kind = %w.resource.kind, namespace = %w.namespace, name = %w.name, error = %e, "cannot write the status")
            }
        }
    }
}

#[cfg(test)]
mod tests;
