//! The lease store: a development Redis (components/redis-dev) only when asked, single,
//! hardened, unpersisted, password-protected and reachable from the companion only.

use super::companion::hardened_container;
use super::context::{COMPANION, Context, DEV_ONLY_LABEL, REDIS, REDIS_SECRET};
use super::docs::{
    Verdict, at, ensure, env_map, is_true, labels_match, list_or_empty, name_of, opt, opt_str,
    repr, repr_opt, string_map, truthy,
};
use serde_json::{Value, json};

pub fn dev_redis(cx: &Context) -> Verdict {
    let redis = cx.docs.find("Deployment", Some(REDIS));
    if let Some(expected) = cx.options.dev_redis {
        ensure!(
            redis.is_empty() != expected,
            "development Redis rendered: {}, expected {}",
            repr(&json!(!redis.is_empty())),
            repr(&json!(expected))
        );
    }
    let Some(d) = redis.first().copied() else {
        ensure!(
            cx.docs.find("Service", Some(REDIS)).is_empty(),
            "a Service maas-redis without the dev Redis"
        );
        return Ok(());
    };
    let related = cx
        .docs
        .find("Service", Some(REDIS))
        .into_iter()
        .chain(cx.docs.find("NetworkPolicy", Some(REDIS)));
    for obj in std::iter::once(d).chain(related) {
        ensure!(
            opt(obj, "metadata.labels").and_then(|l| l.get(DEV_ONLY_LABEL)) == Some(&json!("true")),
            "{} {REDIS} is not labelled {DEV_ONLY_LABEL}=true",
            opt_str(obj, "kind").unwrap_or("None")
        );
    }
    let replicas = opt(d, "spec.replicas");
    ensure!(
        replicas == Some(&json!(1)),
        "dev Redis replicas {}, expected 1",
        repr_opt(replicas)
    );
    let pod = at(d, "spec.template.spec")?;
    ensure!(
        is_true(pod, "securityContext.runAsNonRoot"),
        "dev Redis pod not runAsNonRoot"
    );
    let c = at(pod, "containers.0")?;
    hardened_container(c, "dev Redis ")?;
    ensure!(
        truthy(c.get("readinessProbe")),
        "dev Redis has no readiness probe"
    );
    for v in list_or_empty(pod, "volumes") {
        ensure!(
            v.get("persistentVolumeClaim").is_none(),
            "dev Redis volume {} is persistent",
            opt_str(v, "name").unwrap_or("None")
        );
    }
    let words: Vec<&str> = list_or_empty(c, "command")
        .iter()
        .chain(list_or_empty(c, "args"))
        .filter_map(Value::as_str)
        .collect();
    let command = words.join(" ");
    ensure!(
        command.contains("--save ''") && command.contains("--appendonly no"),
        "dev Redis persists its data (expected --save '' --appendonly no): {}",
        repr(&json!(command))
    );
    ensure!(
        command.contains("requirepass") && command.contains("$REDIS_PASSWORD"),
        "dev Redis runs without a password"
    );
    let env = env_map(c);
    let password = env
        .get("REDIS_PASSWORD")
        .and_then(|e| opt(e, "valueFrom.secretKeyRef"))
        .ok_or("missing or malformed field: env REDIS_PASSWORD valueFrom.secretKeyRef")?;
    ensure!(
        password.get("name") == Some(&json!(REDIS_SECRET))
            && password.get("key") == Some(&json!("password")),
        "{}",
        repr(password)
    );
    reachable_from_companion_only(cx, d)
}

fn reachable_from_companion_only(cx: &Context, d: &Value) -> Verdict {
    let svc = cx.docs.one("Service", REDIS)?;
    let selector = opt(svc, "spec.selector");
    ensure!(
        selector == Some(&json!({"app.kubernetes.io/name": REDIS})),
        "{}",
        repr_opt(selector)
    );
    let ports: Vec<Value> = list_or_empty(svc, "spec.ports")
        .iter()
        .map(|p| p.get("port").cloned().unwrap_or(Value::Null))
        .collect();
    ensure!(
        ports == [json!(6379)],
        "{}",
        repr_opt(opt(svc, "spec.ports"))
    );
    let pod_labels = opt(d, "spec.template.metadata.labels");
    let policies: Vec<&Value> = cx
        .docs
        .all("NetworkPolicy")
        .into_iter()
        .filter(|p| labels_match(opt(p, "spec.podSelector"), pod_labels))
        .collect();
    ensure!(
        !policies.is_empty(),
        "no NetworkPolicy guards the dev Redis"
    );
    let companion = string_map(&[("app.kubernetes.io/name", COMPANION)]);
    for p in policies {
        let name = name_of(p).unwrap_or("None");
        for rule in list_or_empty(p, "spec.ingress") {
            let peers = list_or_empty(rule, "from");
            ensure!(!peers.is_empty(), "{name} opens the dev Redis to everyone");
            for peer in peers {
                let only_pods = peer
                    .as_object()
                    .is_some_and(|o| o.len() == 1 && o.contains_key("podSelector"));
                ensure!(
                    only_pods && opt(peer, "podSelector.matchLabels") == Some(&companion),
                    "{name} admits {} to the dev Redis",
                    repr(peer)
                );
            }
        }
    }
    Ok(())
}
