//! The companion's side: its Deployment (hardened, probes, resources, Secrets, policy file), its
//! Service ports, the internal API's mutual TLS, the public URL, replicas against the lease
//! store, RBAC, the reference's policy resources, the TLS backend objects and the policy document.

use super::context::{
    CLEANUP_CLIENT_NAME, CLEANUP_CLIENT_SECRET, COMPANION, COMPANION_INTERNAL_SECRET,
    COMPANION_PORTS, Context, GATEWAY_CLIENT_NAME, GATEWAY_NAME, GATEWAY_SDS_RBAC, INTERNAL_PORT,
    LeaseStore, METRICS_PORT, PUBLIC_PORT, Platform, REDIS, REDIS_SECRET, Tls,
};
use super::docs::{
    Docs, Verdict, at, ensure, env_map, is_true, list_at, list_or_empty, name_of, namespace_of,
    opt, opt_str, repr, repr_opt, repr_str, str_at, truthy,
};
use serde_json::{Map, Value, json};
use std::collections::BTreeSet;

/// The companion's pod spec and its first container.
fn companion_pod(docs: &Docs) -> Result<(&Value, &Value), String> {
    let deploy = docs.one("Deployment", COMPANION)?;
    let pod = at(deploy, "spec.template.spec")?;
    let container = at(pod, "containers.0")?;
    Ok((pod, container))
}

/// `mountPath` (without a trailing slash) → volume name.
fn mounts_of(container: &Value) -> Map<String, Value> {
    list_or_empty(container, "volumeMounts")
        .iter()
        .filter_map(|m| {
            let path = m.get("mountPath")?.as_str()?.trim_end_matches('/');
            Some((path.to_string(), m.get("name")?.clone()))
        })
        .collect()
}

/// The Secret behind the volume mounted at `directory`.
fn secret_behind<'a>(
    pod: &'a Value,
    mounts: &Map<String, Value>,
    directory: &str,
) -> Option<&'a Value> {
    let volume = mounts.get(directory)?.as_str()?;
    list_or_empty(pod, "volumes")
        .iter()
        .find(|v| opt_str(v, "name") == Some(volume))
        .and_then(|v| opt(v, "secret.secretName"))
}

/// Mutual TLS on the companion (files from its Secret, only the Gateway and the cleanup job
/// named), the Gateway's service account may fetch its key pair over SDS, the cleanup job
/// presents its own certificate.
pub fn internal_mtls(cx: &Context) -> Verdict {
    let (pod, c) = companion_pod(cx.docs)?;
    let env: Map<String, Value> = env_map(c)
        .into_iter()
        .map(|(k, e)| (k, e.get("value").cloned().unwrap_or(Value::Null)))
        .collect();
    let auth = env
        .get("MAAS_INTERNAL_AUTH")
        .cloned()
        .unwrap_or(json!("mtls"));
    ensure!(
        auth == json!("mtls"),
        "MAAS_INTERNAL_AUTH={}: the internal port would serve provider keys to anyone",
        auth.as_str().unwrap_or("None")
    );
    let mounts = mounts_of(c);
    for (var, expected_key) in [
        ("MAAS_INTERNAL_CLIENT_CA", "ca.crt"),
        ("MAAS_INTERNAL_TLS_CERT", "tls.crt"),
        ("MAAS_INTERNAL_TLS_KEY", "tls.key"),
    ] {
        let path = env.get(var).and_then(Value::as_str).unwrap_or("");
        ensure!(!path.is_empty(), "{var} is not set");
        let (directory, key) = path.rsplit_once('/').unwrap_or(("", path));
        ensure!(
            mounts.contains_key(directory),
            "{var}={path} is not in a mounted volume"
        );
        let secret = secret_behind(pod, &mounts, directory);
        ensure!(
            secret == Some(&json!(COMPANION_INTERNAL_SECRET)) && key == expected_key,
            "{var}={path} reads {}/{key}, expected {COMPANION_INTERNAL_SECRET}/{expected_key}",
            secret.and_then(Value::as_str).unwrap_or("None")
        );
    }
    let mut names: Vec<String> = env
        .get("MAAS_INTERNAL_CLIENT_NAMES")
        .and_then(Value::as_str)
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(String::from)
        .collect();
    let shown = repr(&json!(names));
    names.sort();
    let mut expected = vec![
        GATEWAY_CLIENT_NAME.to_string(),
        CLEANUP_CLIENT_NAME.to_string(),
    ];
    expected.sort();
    ensure!(
        names == expected,
        "MAAS_INTERNAL_CLIENT_NAMES {shown}, expected exactly the Gateway and the cleanup job"
    );
    gateway_sds_rbac(cx)?;
    cleanup_client(cx.docs)
}

/// istiod serves the Gateway its client key pair only if its service account may list Secrets
/// in the Gateway's namespace: exactly that, nothing more.
fn gateway_sds_rbac(cx: &Context) -> Verdict {
    let docs = cx.docs;
    let role = docs.one("Role", GATEWAY_SDS_RBAC)?;
    ensure!(
        namespace_of(role) == Some(cx.gateway_ns),
        "{}",
        repr_opt(role.get("metadata"))
    );
    let rules = at(role, "rules")?;
    ensure!(
        rules == &json!([{"apiGroups": [""], "resources": ["secrets"], "verbs": ["list"]}]),
        "{}",
        repr(rules)
    );
    let binding = docs.one("RoleBinding", GATEWAY_SDS_RBAC)?;
    let role_ref = at(binding, "roleRef")?;
    ensure!(
        role_ref
            == &json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": GATEWAY_SDS_RBAC}),
        "{}",
        repr(role_ref)
    );
    let subjects = at(binding, "subjects")?;
    ensure!(
        subjects
            == &json!([{"kind": "ServiceAccount", "name": cx.options.platform.gateway_service_account(), "namespace": cx.gateway_ns}]),
        "{}",
        repr(subjects)
    );
    Ok(())
}

/// The cleanup job presents its own certificate and checks the companion's.
fn cleanup_client(docs: &Docs) -> Verdict {
    let job = docs.one("CronJob", "maas-api-key-cleanup")?;
    let pod = at(job, "spec.jobTemplate.spec.template.spec")?;
    let c = at(pod, "containers.0")?;
    let words: Vec<&str> = list_or_empty(c, "command")
        .iter()
        .chain(list_or_empty(c, "args"))
        .filter_map(Value::as_str)
        .collect();
    let command = words.join(" ");
    ensure!(
        command.contains("https://") && !command.contains("http://"),
        "the cleanup job calls the internal port without TLS: {}",
        repr(&json!(command))
    );
    let mounts = mounts_of(c);
    let tokens: Vec<&str> = command.split_whitespace().collect();
    for (flag, key) in [
        ("--cacert", "ca.crt"),
        ("--cert", "tls.crt"),
        ("--key", "tls.key"),
    ] {
        let Some(file) = tokens.windows(2).find(|w| w[0] == flag).map(|w| w[1]) else {
            return Err(format!(
                "the cleanup job's curl has no {flag}: {}",
                repr(&json!(command))
            ));
        };
        let (directory, got_key) = file.rsplit_once('/').unwrap_or(("", file));
        ensure!(
            mounts.contains_key(directory),
            "the cleanup job's {flag} {file} is not mounted"
        );
        let secret = secret_behind(pod, &mounts, directory);
        ensure!(
            secret == Some(&json!(CLEANUP_CLIENT_SECRET)) && got_key == key,
            "the cleanup job's {flag} reads {}/{got_key}, expected {CLEANUP_CLIENT_SECRET}/{key}",
            secret.and_then(Value::as_str).unwrap_or("None")
        );
    }
    Ok(())
}

/// The Service: public, internal and metrics ports to the container ports of those names.
pub fn service_ports(cx: &Context) -> Verdict {
    let (_, c) = companion_pod(cx.docs)?;
    let mut container = Map::new();
    for p in list_at(c, "ports")? {
        container.insert(
            str_at(p, "name")?.to_string(),
            at(p, "containerPort")?.clone(),
        );
    }
    let expected: Map<String, Value> = COMPANION_PORTS
        .iter()
        .map(|(name, number)| ((*name).to_string(), json!(number)))
        .collect();
    ensure!(
        container == expected,
        "container ports {}, expected {}",
        repr(&Value::Object(container)),
        repr(&Value::Object(expected))
    );
    let ports = list_at(cx.svc, "spec.ports")?;
    let by_port = |number: u64| {
        ports
            .iter()
            .find(|p| opt(p, "port") == Some(&json!(number)))
    };
    for (name, number) in COMPANION_PORTS {
        let Some(port) = by_port(number) else {
            return Err(format!("the Service has no port {number} ({name})"));
        };
        let target = port.get("targetPort");
        ensure!(
            target == Some(&json!(name)) || target == Some(&json!(number)),
            "Service port {number} targets {}, expected {name}",
            target.map_or_else(
                || "None".to_string(),
                |t| t.to_string().trim_matches('"').to_string()
            )
        );
    }
    let metrics_name = by_port(METRICS_PORT).and_then(|p| p.get("name"));
    ensure!(
        metrics_name == Some(&json!("metrics")),
        "Service port {METRICS_PORT} named {}",
        repr_opt(metrics_name)
    );
    Ok(())
}

/// Hardened, probes, resources, the database Secret, the policy file from the ConfigMap.
pub fn deployment(cx: &Context) -> Verdict {
    let (pod, c) = companion_pod(cx.docs)?;
    ensure!(
        is_true(pod, "securityContext.runAsNonRoot"),
        "pod not runAsNonRoot"
    );
    hardened_container(c, "")?;
    let liveness = opt(c, "livenessProbe.httpGet.path");
    ensure!(
        liveness == Some(&json!("/health")),
        "liveness probe {}",
        repr_opt(liveness)
    );
    let readiness = opt(c, "readinessProbe.httpGet.path");
    ensure!(
        readiness == Some(&json!("/ready")),
        "readiness probe {}",
        repr_opt(readiness)
    );
    let env = env_map(c);
    deployment_env(&env)?;
    policy_file_mounted(cx.docs, pod, c, &env)?;
    let account = at(pod, "serviceAccountName")?;
    let expected = at(cx.docs.one("ServiceAccount", COMPANION)?, "metadata.name")?;
    ensure!(account == expected, "serviceAccountName {}", repr(account));
    let tls_env = env.contains_key("MAAS_TLS_CERT") && env.contains_key("MAAS_TLS_KEY");
    let schemes: BTreeSet<&str> = ["livenessProbe", "readinessProbe"]
        .iter()
        .map(|probe| opt_str(c, &format!("{probe}.httpGet.scheme")).unwrap_or("HTTP"))
        .collect();
    match cx.options.tls {
        Tls::On => ensure!(
            tls_env && schemes == BTreeSet::from(["HTTPS"]),
            "TLS on but the companion serves plain HTTP"
        ),
        Tls::Off => ensure!(
            !tls_env && schemes == BTreeSet::from(["HTTP"]),
            "TLS off but the companion is given a certificate"
        ),
        Tls::Any => {}
    }
    Ok(())
}

/// A container runs read-only, unprivileged, without capabilities, with requests and limits.
/// `who` prefixes the reasons ("dev Redis ").
pub fn hardened_container(c: &Value, who: &str) -> Verdict {
    ensure!(
        is_true(c, "securityContext.readOnlyRootFilesystem"),
        "{who}root filesystem writable"
    );
    ensure!(
        opt(c, "securityContext.allowPrivilegeEscalation") == Some(&json!(false)),
        "{who}privilege escalation allowed"
    );
    ensure!(
        opt(c, "securityContext.capabilities.drop") == Some(&json!(["ALL"])),
        "{who}capabilities not dropped"
    );
    for k in ["requests", "limits"] {
        let set = opt(c, &format!("resources.{k}"));
        let complete = ["cpu", "memory"]
            .iter()
            .all(|r| set.and_then(|s| s.get(*r)).is_some());
        ensure!(complete, "{who}resources.{k} incomplete");
    }
    Ok(())
}

fn secret_ref(env: &Map<String, Value>, var: &str) -> Result<Value, String> {
    let entry = env
        .get(var)
        .ok_or_else(|| format!("missing or malformed field: env {var}"))?;
    Ok(at(entry, "valueFrom.secretKeyRef")?.clone())
}

fn env_value<'a>(env: &'a Map<String, Value>, var: &str) -> Result<&'a str, String> {
    env.get(var)
        .and_then(|e| opt_str(e, "value"))
        .ok_or_else(|| format!("missing or malformed field: env {var} value"))
}

fn deployment_env(env: &Map<String, Value>) -> Verdict {
    let db = secret_ref(env, "DATABASE_URL")?;
    ensure!(
        db.get("name") == Some(&json!("maas-db-config"))
            && db.get("key") == Some(&json!("DB_CONNECTION_URL")),
        "{}",
        repr(&db)
    );
    // The lease store is optional: without the Secret the companion keeps leases in process.
    let redis = secret_ref(env, "MAAS_REDIS_URL")?;
    ensure!(
        redis.get("name") == Some(&json!(REDIS_SECRET)) && redis.get("key") == Some(&json!("url")),
        "{}",
        repr(&redis)
    );
    ensure!(
        redis.get("optional") == Some(&json!(true)),
        "MAAS_REDIS_URL from Secret {REDIS_SECRET} is not optional: no companion starts without Redis"
    );
    for var in ["MAAS_IDENTITY_PROVIDER", "MAAS_CREDENTIALS_SOURCE"] {
        let value = env_value(env, var)?;
        ensure!(value == "kubernetes", "{var} {value}, expected kubernetes");
    }
    for (var, port) in [
        ("MAAS_INTERNAL_ADDR", INTERNAL_PORT),
        ("MAAS_PUBLIC_ADDR", PUBLIC_PORT),
        ("MAAS_METRICS_ADDR", METRICS_PORT),
    ] {
        let value = env_value(env, var)?;
        ensure!(
            value.ends_with(&format!(":{port}")),
            "{var} {value}, expected port {port}"
        );
    }
    Ok(())
}

/// MAAS_POLICY_FILE lies under a volume mounted from a ConfigMap that has that key.
fn policy_file_mounted(docs: &Docs, pod: &Value, c: &Value, env: &Map<String, Value>) -> Verdict {
    let policy_file = env_value(env, "MAAS_POLICY_FILE")?;
    let mounted = list_or_empty(c, "volumeMounts").iter().find(|m| {
        opt_str(m, "mountPath")
            .is_some_and(|p| policy_file.starts_with(&format!("{}/", p.trim_end_matches('/'))))
    });
    let Some(mount) = mounted else {
        return Err(format!("{policy_file} is not under a mounted volume"));
    };
    let volume_name = str_at(mount, "name")?;
    let volume = list_or_empty(pod, "volumes")
        .iter()
        .find(|v| opt_str(v, "name") == Some(volume_name))
        .ok_or_else(|| format!("missing or malformed field: volume {volume_name}"))?;
    let cm_name = str_at(volume, "configMap.name")?;
    let cm = docs.one("ConfigMap", cm_name)?;
    let key = policy_file.rsplit('/').next().unwrap_or(policy_file);
    ensure!(
        opt(cm, "data").and_then(|d| d.get(key)).is_some(),
        "ConfigMap {cm_name} has no key {key}"
    );
    Ok(())
}

/// The companion names models under the Gateway's HTTPS hostname (MAAS_PUBLIC_URL).
pub fn public_url(cx: &Context) -> Verdict {
    let (_, c) = companion_pod(cx.docs)?;
    let env = env_map(c);
    let Some(entry) = env.get("MAAS_PUBLIC_URL") else {
        return Err(
            "MAAS_PUBLIC_URL is not set: GET /v1/models would list models without their url"
                .to_string(),
        );
    };
    let url = entry.get("value");
    let gw = cx.docs.one("Gateway", GATEWAY_NAME)?;
    let hosts: BTreeSet<String> = list_at(gw, "spec.listeners")?
        .iter()
        .filter(|l| opt_str(l, "protocol") == Some("HTTPS"))
        .map(|l| opt_str(l, "hostname").unwrap_or("None").to_string())
        .collect();
    ensure!(
        hosts.len() == 1,
        "the Gateway's HTTPS listeners name {}",
        repr(&json!(hosts))
    );
    let want = format!("https://{}", hosts.iter().next().map_or("", String::as_str));
    ensure!(
        url == Some(&json!(want)),
        "MAAS_PUBLIC_URL {}, expected {} (the Gateway's HTTPS hostname)",
        repr_opt(url),
        repr(&json!(want))
    );
    Ok(())
}

/// One budget: with the lease counters in process the companion runs one replica.
pub fn companion_replicas(cx: &Context) -> Verdict {
    let deploy = cx.docs.one("Deployment", COMPANION)?;
    let n = opt(deploy, "spec.replicas")
        .and_then(Value::as_u64)
        .unwrap_or(1);
    match cx.options.lease_store {
        LeaseStore::Memory => {
            ensure!(
                cx.docs.find("Deployment", Some(REDIS)).is_empty(),
                "a dev Redis rendered where the counters are in process"
            );
            ensure!(
                n == 1,
                "companion replicas {n} with the lease counters in process: each replica is a budget of its \
                 own ({n}x every limit); run one, or give it a Redis (--redis-url / --dev-redis)"
            );
        }
        LeaseStore::Redis => ensure!(n >= 1, "companion replicas {n}"),
        LeaseStore::Any => {}
    }
    Ok(())
}

/// tokenreviews and subjectaccessreviews create cluster-wide; Secrets/ConfigMaps read-only in
/// its namespace.
pub fn rbac(cx: &Context) -> Verdict {
    let cr = cx.docs.one("ClusterRole", "maas-companion-tokenreview")?;
    let rules = at(cr, "rules")?;
    ensure!(
        rules
            == &json!([
                {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
                {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]}
            ]),
        "{}",
        repr(rules)
    );
    let bound = cx.docs.all("ClusterRoleBinding").into_iter().any(|b| {
        opt_str(b, "roleRef.name") == Some("maas-companion-tokenreview")
            && list_or_empty(b, "subjects").iter().any(|s| {
                opt_str(s, "kind") == Some("ServiceAccount")
                    && opt_str(s, "name") == Some(COMPANION)
            })
    });
    ensure!(
        bound,
        "ClusterRole maas-companion-tokenreview is not bound to the companion's service account"
    );
    let role = cx.docs.one("Role", COMPANION)?;
    let mut resources = Vec::new();
    for rule in list_at(role, "rules")? {
        resources.extend(list_at(rule, "resources")?.iter().cloned());
        let mut verbs = list_at(rule, "verbs")?.to_vec();
        verbs.sort_by_key(|v| v.to_string());
        ensure!(
            verbs == [json!("get"), json!("list"), json!("watch")],
            "{}",
            repr(rule)
        );
    }
    resources.sort_by_key(|v| v.to_string());
    ensure!(
        resources == [json!("configmaps"), json!("secrets")],
        "{}",
        repr(&Value::Array(resources))
    );
    Ok(())
}

/// The reference's kinds (components/maas-resources) and the companion's plural for each.
const PLURALS: [(&str, &str); 4] = [
    ("maasmodelrefs", "MaaSModelRef"),
    ("externalmodels", "ExternalModel"),
    ("maasauthpolicies", "MaaSAuthPolicy"),
    ("maassubscriptions", "MaaSSubscription"),
];

/// With MAAS_POLICY_SOURCE=kubernetes the four CRDs, read-only access to them and Event
/// writing, provider-key Secrets `get` only and bound per namespace; none without.
/// The reference's admin rule (maas-api `sar_admin_checker.go`): may `create`
/// `maasauthpolicies.maas.opendatahub.io` in the subscription namespace.
pub const ADMIN_SAR_RESOURCE: &str = "maasauthpolicies.maas.opendatahub.io";
pub const ADMIN_SAR_VERB: &str = "create";

/// Admins by the reference's SubjectAccessReview out of the box: MAAS_ADMIN_SAR_NAMESPACE set
/// (a DNS label; the policy namespace when the policy comes from the reference's resources), the
/// resource and verb the reference's (or left to the companion's defaults, which are).
pub fn admin_sar(cx: &Context) -> Verdict {
    let (_, c) = companion_pod(cx.docs)?;
    let env = env_map(c);
    let value = |var: &str| env.get(var).and_then(|e| opt_str(e, "value"));
    let Some(namespace) = value("MAAS_ADMIN_SAR_NAMESPACE") else {
        return Err(
            "MAAS_ADMIN_SAR_NAMESPACE is not set: admins would be MAAS_ADMIN_GROUPS only, not the \
             reference's SubjectAccessReview rule"
                .to_string(),
        );
    };
    ensure!(
        maas_types::subscription::is_dns_label(namespace),
        "MAAS_ADMIN_SAR_NAMESPACE {} is not a namespace name",
        repr_str(namespace)
    );
    for (var, want) in [
        ("MAAS_ADMIN_SAR_RESOURCE", ADMIN_SAR_RESOURCE),
        ("MAAS_ADMIN_SAR_VERB", ADMIN_SAR_VERB),
    ] {
        if env.contains_key(var) {
            let got = value(var);
            ensure!(
                got == Some(want),
                "{var} {}, expected {want} (the reference's rule)",
                repr_opt(got.map(|g| json!(g)).as_ref())
            );
        }
    }
    if value("MAAS_POLICY_SOURCE") == Some("kubernetes") {
        let policy_ns = value("MAAS_POLICY_NAMESPACE");
        ensure!(
            policy_ns == Some(namespace),
            "MAAS_ADMIN_SAR_NAMESPACE {namespace} but the subscriptions are in MAAS_POLICY_NAMESPACE {}",
            repr_opt(policy_ns.map(|g| json!(g)).as_ref())
        );
    }
    Ok(())
}

pub fn policy_resources(cx: &Context) -> Verdict {
    let (_, c) = companion_pod(cx.docs)?;
    let env = env_map(c);
    let value = |var: &str| env.get(var).and_then(|e| e.get("value")).cloned();
    let crds = cx.docs.all("CustomResourceDefinition");
    if value("MAAS_POLICY_SOURCE") != Some(json!("kubernetes")) {
        ensure!(
            crds.is_empty()
                && cx
                    .docs
                    .find("ClusterRole", Some("maas-companion-resources"))
                    .is_empty()
                && cx
                    .docs
                    .find("ClusterRole", Some("maas-companion-provider-secrets"))
                    .is_empty(),
            "reference CRDs or their RBAC rendered without MAAS_POLICY_SOURCE=kubernetes"
        );
        return Ok(());
    }
    // ExternalModels' provider keys: `get` on Secrets, bound per model namespace only.
    let secrets = cx
        .docs
        .one("ClusterRole", "maas-companion-provider-secrets")?;
    let rules = at(secrets, "rules")?;
    ensure!(
        rules == &json!([{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]),
        "maas-companion-provider-secrets rules {}, expected get on secrets only",
        repr(rules)
    );
    let bound: Vec<&str> = cx
        .docs
        .all("ClusterRoleBinding")
        .into_iter()
        .filter(|d| opt_str(d, "roleRef.name") == Some("maas-companion-provider-secrets"))
        .filter_map(name_of)
        .collect();
    ensure!(
        bound.is_empty(),
        "maas-companion-provider-secrets bound cluster-wide by {}: every namespace's Secrets \
         readable (bind it per model namespace with a RoleBinding)",
        repr(&json!(bound))
    );
    ensure!(
        truthy(value("MAAS_POLICY_NAMESPACE").as_ref()),
        "MAAS_POLICY_NAMESPACE is not set"
    );
    resource_crds(&crds)?;
    let cr = cx.docs.one("ClusterRole", "maas-companion-resources")?;
    let plurals: Vec<&str> = PLURALS.iter().map(|(p, _)| *p).collect();
    let rules = at(cr, "rules")?;
    ensure!(
        rules
            == &json!([
                {"apiGroups": ["maas.opendatahub.io"], "resources": plurals, "verbs": ["get", "list", "watch"]},
                {"apiGroups": ["inference.opendatahub.io"], "resources": ["externalmodels", "externalproviders"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]}
            ]),
        "{}",
        repr(rules)
    );
    let crb = cx
        .docs
        .one("ClusterRoleBinding", "maas-companion-resources")?;
    let subjects: Vec<Value> = list_or_empty(crb, "subjects")
        .iter()
        .map(|s| s.get("name").cloned().unwrap_or(Value::Null))
        .collect();
    ensure!(
        opt_str(crb, "roleRef.name") == Some("maas-companion-resources")
            && subjects == [json!(COMPANION)],
        "{}",
        repr(crb)
    );
    Ok(())
}

/// With `MAAS_WRITE_STATUS=true` (components/maas-status): the policy from the resources, and
/// `patch` on their status subresource only (never the resources themselves), bound to the
/// companion; without it, no such ClusterRole.
pub fn status_writer(cx: &Context) -> Verdict {
    let (_, c) = companion_pod(cx.docs)?;
    let env = env_map(c);
    let value = |var: &str| env.get(var).and_then(|e| opt_str(e, "value"));
    let role = cx.docs.find("ClusterRole", Some("maas-companion-status"));
    if value("MAAS_WRITE_STATUS") != Some("true") {
        ensure!(
            role.is_empty(),
            "ClusterRole maas-companion-status rendered without MAAS_WRITE_STATUS=true: a right \
             nothing uses"
        );
        return Ok(());
    }
    ensure!(
        value("MAAS_POLICY_SOURCE") == Some("kubernetes"),
        "MAAS_WRITE_STATUS needs MAAS_POLICY_SOURCE=kubernetes (the companion refuses to start)"
    );
    let cr = cx.docs.one("ClusterRole", "maas-companion-status")?;
    let rules = at(cr, "rules")?;
    let maas: Vec<String> = PLURALS.iter().map(|(p, _)| format!("{p}/status")).collect();
    ensure!(
        rules
            == &json!([
                {"apiGroups": ["maas.opendatahub.io"], "resources": maas, "verbs": ["patch"]},
                {"apiGroups": ["inference.opendatahub.io"],
                 "resources": ["externalmodels/status", "externalproviders/status"], "verbs": ["patch"]}
            ]),
        "maas-companion-status rules {}, expected patch on the resources' status only",
        repr(rules)
    );
    let bound = cx.docs.all("ClusterRoleBinding").into_iter().any(|b| {
        opt_str(b, "roleRef.name") == Some("maas-companion-status")
            && list_or_empty(b, "subjects")
                .iter()
                .any(|s| s.get("name") == Some(&json!(COMPANION)))
    });
    ensure!(
        bound,
        "ClusterRole maas-companion-status is not bound to the companion: its status writes \
         would be refused (403)"
    );
    Ok(())
}

fn resource_crds(crds: &[&Value]) -> Verdict {
    let mut got = Map::new();
    for crd in crds {
        got.insert(
            str_at(crd, "spec.names.plural")?.to_string(),
            (*crd).clone(),
        );
    }
    let mut wanted: Vec<&str> = PLURALS.iter().map(|(p, _)| *p).collect();
    wanted.sort_unstable();
    let names: Vec<&str> = got.keys().map(String::as_str).collect();
    ensure!(
        names == wanted,
        "CRDs {}, expected {}",
        repr(&json!(names)),
        repr(&json!(wanted))
    );
    for (plural, kind) in PLURALS {
        let c = &got[plural];
        let name = str_at(c, "metadata.name")?;
        ensure!(name == format!("{plural}.maas.opendatahub.io"), "{name}");
        let group = opt_str(c, "spec.group").unwrap_or("None");
        let got_kind = opt_str(c, "spec.names.kind").unwrap_or("None");
        ensure!(
            group == "maas.opendatahub.io" && got_kind == kind,
            "{plural}: group {group}, kind {got_kind}"
        );
        let versions: Vec<Value> = list_at(c, "spec.versions")?
            .iter()
            .map(|v| v.get("name").cloned().unwrap_or(Value::Null))
            .collect();
        ensure!(
            versions == [json!("v1alpha1")],
            "{}",
            repr(&Value::Array(versions))
        );
    }
    Ok(())
}

/// The TLS backend's objects exist exactly when TLS is on.
/// Who issues the public port's certificate: OpenShift's service CA (the Service's annotation
/// names the Secret it fills), or on plain Kubernetes deploy.sh's private CA (the internal port's
/// Secret, mounted as the public port's; no annotation nobody would honour).
fn serving_certificate(cx: &Context) -> Verdict {
    let annotation = opt(cx.svc, "metadata.annotations")
        .and_then(|a| a.get("service.beta.openshift.io/serving-cert-secret-name"));
    let (want_annotation, want_secret) = match cx.options.platform {
        Platform::OpenShift => (Some(json!("maas-companion-tls")), "maas-companion-tls"),
        Platform::Kubernetes => (None, COMPANION_INTERNAL_SECRET),
    };
    ensure!(
        annotation.cloned() == want_annotation,
        "service CA annotation {}, expected {} on {}",
        repr_opt(annotation),
        repr_opt(want_annotation.as_ref()),
        cx.options.platform
    );
    let (pod, _) = companion_pod(cx.docs)?;
    let secret = list_or_empty(pod, "volumes")
        .iter()
        .find(|v| opt_str(v, "name") == Some("tls"))
        .and_then(|v| opt_str(v, "secret.secretName"));
    ensure!(
        secret == Some(want_secret),
        "the public port's certificate from Secret {}, expected {want_secret} on {}",
        repr_opt(secret.map(|s| json!(s)).as_ref()),
        cx.options.platform
    );
    Ok(())
}

pub fn tls_objects(cx: &Context) -> Verdict {
    let drs = cx.docs.find("DestinationRule", Some("maas-companion-tls"));
    match cx.options.tls {
        Tls::On => {
            ensure!(drs.len() == 1, "TLS on but no DestinationRule");
            let t = at(drs[0], "spec.trafficPolicy.tls")?;
            let host = at(drs[0], "spec.host")?;
            ensure!(host == &json!(cx.fqdn), "{}", repr(host));
            ensure!(
                opt_str(t, "mode") == Some("SIMPLE")
                    && opt_str(t, "credentialName") == Some("maas-companion-ca"),
                "{}",
                repr(t)
            );
            let sni = opt(t, "sni");
            ensure!(
                sni == Some(&json!(format!("{COMPANION}.{}.svc", cx.ns))),
                "{}",
                repr_opt(sni)
            );
            serving_certificate(cx)?;
        }
        Tls::Off => ensure!(
            drs.is_empty(),
            "TLS off but a TLS DestinationRule is rendered"
        ),
        Tls::Any => {}
    }
    Ok(())
}

/// The policy ConfigMap parses, its models name known tiers, external models their
/// upstreamCluster (backends with providers: the model's, or each routed backend's own).
pub fn policy_document(cx: &Context) -> Verdict {
    let cm = cx.docs.one("ConfigMap", "maas-policy")?;
    let text = at(cm, "data")?
        .get("policy.yaml")
        .and_then(Value::as_str)
        .ok_or("missing or malformed field: data.policy.yaml")?;
    let doc: Value =
        yaml_serde::from_str(text).map_err(|e| format!("policy.yaml is not YAML: {e}"))?;
    let tiers: BTreeSet<&str> = list_at(&doc, "tiers")?
        .iter()
        .filter_map(|t| opt_str(t, "name"))
        .collect();
    for m in list_or_empty(&doc, "models") {
        let name = opt_str(m, "name").unwrap_or("None");
        let known = list_at(m, "tiers")?
            .iter()
            .all(|t| t.as_str().is_some_and(|t| tiers.contains(t)));
        ensure!(known, "model {name} names unknown tiers");
        let path = str_at(m, "path")?;
        ensure!(
            !path.starts_with("/maas-api") && !path.starts_with("/internal"),
            "{path}"
        );
        if truthy(m.get("provider")) {
            ensure!(
                truthy(m.get("upstreamCluster")),
                "model {name} has a provider but no upstreamCluster"
            );
        }
        // Backends with providers: the model's cluster, or (routed backends) each one's own.
        let backends = list_or_empty(m, "backends");
        if backends.iter().any(|b| truthy(b.get("provider"))) {
            ensure!(
                truthy(m.get("upstreamCluster"))
                    || backends.iter().all(|b| truthy(b.get("upstreamCluster"))),
                "model {name} has backends with providers but no upstreamCluster (the model's, \
                 or each backend's own)"
            );
        }
    }
    Ok(())
}
