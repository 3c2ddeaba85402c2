use super::*;
use crate::policy_source::translate::samples::{V0_2_1, V0_2_1_INFERENCE, resources};
use crate::policy_source::translate::translate;

const NOW: &str = "2026-12-03T10:00:00Z";
const LATER: &str = "2026-12-03T11:00:00Z";

fn all() -> Resources {
    resources(&format!("{V0_2_1}\n---\n{V0_2_1_INFERENCE}"))
}

fn runtime(entries: &[(&str, Option<bool>)]) -> Runtime {
    entries.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

fn status_of<'a>(writes: &'a [StatusWrite], kind: &str, name: &str) -> &'a Value {
    &writes
        .iter()
        .find(|w| w.resource.kind == kind && w.name == name)
        .unwrap_or_else(|| panic!("no status for {kind} {name}: {writes:#?}"))
        .status
}

fn condition<'a>(status: &'a Value, kind: &str) -> &'a Value {
    status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == kind)
        .unwrap_or_else(|| panic!("no {kind} in {status}"))
}

/// Each write applied to its object, as the API server would (the fields replaced).
fn apply(res: &mut Resources, writes: &[StatusWrite]) {
    for w in writes {
        let lists = [
            &mut res.model_refs,
            &mut res.subscriptions,
            &mut res.auth_policies,
            &mut res.external_models,
            &mut res.inference_models,
            &mut res.external_providers,
        ];
        for list in lists {
            for o in list.iter_mut() {
                let same_kind = o.types.as_ref().is_some_and(|t| {
                    t.kind == w.resource.kind && t.api_version == w.resource.api_version
                });
                if same_kind && ns_name(o) == (w.namespace.clone(), w.name.clone()) {
                    let status = o.data["status"].take();
                    let mut status = if status.is_object() {
                        status
                    } else {
                        json!({})
                    };
                    for (k, v) in w.status.as_object().unwrap() {
                        status[k] = v.clone();
                    }
                    o.data["status"] = status;
                }
            }
        }
    }
}

#[test]
fn the_reference_samples_get_the_controllers_phases_and_conditions() {
    let res = all();
    let t = translate(None, &res);
    let rt = runtime(&[
        ("llm/facebook-opt-125m-simulated", Some(true)),
        ("llm/premium-simulated-simulated-premium", Some(false)),
        ("llm/gpt-4o-mini", None),
    ]);
    let writes = desired(&res, &t, &rt, NOW);

    let free = status_of(&writes, "MaaSModelRef", "facebook-opt-125m-simulated");
    assert_eq!(free["phase"], "Ready", "{free}");
    assert_eq!(condition(free, "Ready")["status"], "True");
    assert_eq!(condition(free, "Ready")["reason"], "Reconciled");
    assert_eq!(
        condition(free, "GovernanceAttached")["reason"],
        "GovernancePaired"
    );
    assert_eq!(condition(free, "RuntimeReady")["reason"], "RuntimeHealthy");
    assert_eq!(condition(free, "Ready")["lastTransitionTime"], NOW);

    let premium = status_of(
        &writes,
        "MaaSModelRef",
        "premium-simulated-simulated-premium",
    );
    assert_eq!(premium["phase"], "Unhealthy", "{premium}");
    assert_eq!(condition(premium, "GovernanceAttached")["status"], "True");
    assert_eq!(condition(premium, "RuntimeReady")["status"], "False");
    assert_eq!(condition(premium, "Ready")["reason"], "BackendNotReady");

    let external = status_of(&writes, "MaaSModelRef", "gpt-4o-mini");
    assert_eq!(condition(external, "RuntimeReady")["status"], "Unknown");

    let sub = status_of(&writes, "MaaSSubscription", "simulator-subscription");
    assert_eq!(sub["phase"], "Active", "{sub}");
    assert_eq!(
        sub["modelRefStatuses"],
        json!([{"name": "facebook-opt-125m-simulated", "namespace": "llm", "ready": true,
                "reason": "Valid", "message": ""}])
    );
    let policy = status_of(&writes, "MaaSAuthPolicy", "simulator-access");
    assert_eq!(policy["phase"], "Active", "{policy}");
    assert_eq!(condition(policy, "Ready")["status"], "True");

    let em = writes
        .iter()
        .find(|w| {
            w.resource.kind == "ExternalModel" && w.resource.group == "inference.opendatahub.io"
        })
        .unwrap();
    assert_eq!(em.status["phase"], "Ready", "{:?}", em.status);
    let provider = status_of(&writes, "ExternalProvider", "openai");
    assert_eq!(provider["phase"], "Ready", "{provider}");
}

#[test]
fn a_written_status_is_not_written_again_and_keeps_its_transition_time() {
    let mut res = all();
    let t = translate(None, &res);
    let rt = runtime(&[("llm/facebook-opt-125m-simulated", Some(true))]);
    let writes = desired(&res, &t, &rt, NOW);
    assert!(writes.len() >= 8, "{writes:#?}");
    apply(&mut res, &writes);
    let again = desired(&res, &translate(None, &res), &rt, LATER);
    assert!(again.is_empty(), "written again: {again:#?}");

    // The server goes down: only that model's status changes; its untouched condition keeps
    // the first time, the changed ones get the new one.
    let down = runtime(&[("llm/facebook-opt-125m-simulated", Some(false))]);
    let changed = desired(&res, &translate(None, &res), &down, LATER);
    assert_eq!(changed.len(), 1, "{changed:#?}");
    let s = &changed[0].status;
    assert_eq!(s["phase"], "Unhealthy");
    assert_eq!(condition(s, "RuntimeReady")["lastTransitionTime"], LATER);
    assert_eq!(
        condition(s, "GovernanceAttached")["lastTransitionTime"],
        NOW
    );
}

#[test]
fn governance_lost_is_a_gap_and_never_paired_is_no_pairing() {
    let mut res = all();
    let rt = runtime(&[("llm/facebook-opt-125m-simulated", Some(true))]);
    let writes = desired(&res, &translate(None, &res), &rt, NOW);
    apply(&mut res, &writes);
    // The subscription and the access policy of the free model go away.
    res.subscriptions
        .retain(|s| s.metadata.name.as_deref() != Some("simulator-subscription"));
    res.auth_policies
        .retain(|s| s.metadata.name.as_deref() != Some("simulator-access"));
    let writes = desired(&res, &translate(None, &res), &rt, LATER);
    let free = status_of(&writes, "MaaSModelRef", "facebook-opt-125m-simulated");
    assert_eq!(free["phase"], "Pending", "{free}");
    assert_eq!(
        condition(free, "GovernanceAttached")["reason"],
        "GovernanceGap"
    );

    let fresh = all();
    let mut fresh_res = fresh;
    fresh_res
        .subscriptions
        .retain(|s| s.metadata.name.as_deref() != Some("simulator-subscription"));
    fresh_res
        .auth_policies
        .retain(|s| s.metadata.name.as_deref() != Some("simulator-access"));
    let writes = desired(&fresh_res, &translate(None, &fresh_res), &rt, NOW);
    let free = status_of(&writes, "MaaSModelRef", "facebook-opt-125m-simulated");
    assert_eq!(
        condition(free, "GovernanceAttached")["reason"],
        "NoPairingFound"
    );
}

#[test]
fn invalid_resources_are_invalid_or_failed_naming_the_field() {
    let mut res = all();
    res.model_refs[0].data["spec"]["modelRef"]["kind"] = json!("InferenceService");
    let name = res.model_refs[0].metadata.name.clone().unwrap();
    res.subscriptions[0].data["spec"]["priority"] = json!("high");
    let sub_name = res.subscriptions[0].metadata.name.clone().unwrap();
    let t = translate(None, &res);
    let writes = desired(&res, &t, &Runtime::new(), NOW);
    let m = status_of(&writes, "MaaSModelRef", &name);
    assert_eq!(m["phase"], "Invalid", "{m}");
    assert_eq!(condition(m, "Ready")["reason"], "InvalidSpec");
    assert!(
        condition(m, "Ready")["message"]
            .as_str()
            .unwrap()
            .starts_with("spec.modelRef.kind: "),
        "{m}"
    );
    let s = status_of(&writes, "MaaSSubscription", &sub_name);
    assert_eq!(s["phase"], "Failed", "{s}");
    assert!(
        condition(s, "Ready")["message"]
            .as_str()
            .unwrap()
            .starts_with("spec.priority: "),
        "{s}"
    );
}

#[test]
fn a_subscription_with_a_missing_model_is_degraded_and_names_it() {
    let mut res = all();
    let sub = res
        .subscriptions
        .iter_mut()
        .find(|s| s.metadata.name.as_deref() == Some("simulator-subscription"))
        .unwrap();
    let refs = sub.data["spec"]["modelRefs"].as_array_mut().unwrap();
    let mut extra = refs[0].clone();
    extra["name"] = json!("no-such-model");
    refs.push(extra);
    let t = translate(None, &res);
    let writes = desired(&res, &t, &Runtime::new(), NOW);
    let s = status_of(&writes, "MaaSSubscription", "simulator-subscription");
    assert_eq!(s["phase"], "Degraded", "{s}");
    assert_eq!(s["modelRefStatuses"][1]["reason"], "NotFound");
    assert_eq!(s["modelRefStatuses"][1]["ready"], false);
    assert_eq!(condition(s, "Ready")["reason"], "PartialFailure");
}

#[test]
fn a_model_whose_external_model_is_invalid_fails_with_the_cause() {
    let mut res = all();
    res.inference_models[0].data["spec"]["externalProviderRefs"][0]["apiFormat"] =
        json!("bedrock-converse");
    let t = translate(None, &res);
    let writes = desired(&res, &t, &Runtime::new(), NOW);
    let em = writes
        .iter()
        .find(|w| {
            w.resource.kind == "ExternalModel" && w.resource.group == "inference.opendatahub.io"
        })
        .unwrap();
    assert_eq!(em.status["phase"], "Failed", "{:?}", em.status);
    let m = status_of(&writes, "MaaSModelRef", "gpt-4o-mini");
    assert_eq!(m["phase"], "Failed", "{m}");
    let message = condition(m, "Ready")["message"].as_str().unwrap();
    assert!(
        message.contains("ExternalModel llm/gpt-4o-mini") && message.contains("apiFormat"),
        "{message}"
    );
    assert_eq!(
        status_of(&writes, "ExternalProvider", "openai")["phase"],
        "Pending"
    );
}

/// An ExternalProvider is Ready when a served ExternalModel sends it traffic: every weighted
/// binding of the model's API (routed backends), not one bound with weight 0.
#[test]
fn a_provider_bound_with_weight_0_is_pending_and_every_weighted_one_ready() {
    let mut res = all();
    let mut second = res.external_providers[0].clone();
    second.metadata.name = Some("openai-eu".into());
    second.data["spec"]["endpoint"] = json!("eu.api.openai.com");
    res.external_providers.push(second);
    let refs = &mut res.inference_models[0].data["spec"]["externalProviderRefs"];
    let mut binding = refs[0].clone();
    binding["ref"]["name"] = json!("openai-eu");
    binding["weight"] = json!(0);
    refs.as_array_mut().unwrap().push(binding);
    let t = translate(None, &res);
    assert!(t.invalid.is_empty(), "{:?}", t.invalid);
    let writes = desired(&res, &t, &Runtime::new(), NOW);
    assert_eq!(
        status_of(&writes, "ExternalProvider", "openai")["phase"],
        "Ready"
    );
    assert_eq!(
        status_of(&writes, "ExternalProvider", "openai-eu")["phase"],
        "Pending"
    );
    res.inference_models[0].data["spec"]["externalProviderRefs"][1]["weight"] = json!(2);
    let t = translate(None, &res);
    assert!(t.invalid.is_empty(), "{:?}", t.invalid);
    assert_eq!(t.document.model("gpt-4o-mini").unwrap().backends.len(), 2);
    let writes = desired(&res, &t, &Runtime::new(), NOW);
    for provider in ["openai", "openai-eu"] {
        assert_eq!(
            status_of(&writes, "ExternalProvider", provider)["phase"],
            "Ready",
            "{provider}"
        );
    }
}
