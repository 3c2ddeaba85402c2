//! Observability as an operator runs it (issue 32): a real Prometheus (Debian's) scrapes the
//! local stack — the Gateway Envoy's `/stats/prometheus`, where the filter's labelled series
//! are, and the companion's `/metrics` — while users call models (JSON and streamed answers,
//! a subscription with a billing rate, refusals of every kind, a failing backend). Then every
//! panel of every shipped dashboard is evaluated the way Grafana would and must return data (no
//! panel that can never show anything), the shipped PrometheusRules load (promtool and
//! Prometheus's own evaluation, no rule in error), every metric an alert reads exists, and the
//! auth-failure alert fires on a burst of bad keys.

use crate::helpers::{ModuleStack, bearer, client, send};
use maas_e2e::manifest_checks::{dashboard_files, dashboard_queries};
use maas_e2e::prometheus::{self, Prometheus, alert_signal, grafana_to_promql};
use maas_e2e::stack::{Stack, StackOptions, free_ports};
use maas_e2e::tools::workspace_root;
use serde_json::{Value, json};
use std::path::Path;
use std::time::{Duration, Instant};

const POLICY: &str = r#"
tiers:
  - name: free
    level: 0
    groups: [g-free]
    limits:
      requests: [{limit: 100000, window: 1d}]
      tokens: [{limit: 100000000, window: 1d}]
  - name: tiny
    level: 1
    groups: [g-tiny]
    limits:
      requests: [{limit: 1, window: 1d}]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [free, tiny]
    backend: simulator
  - name: sim-other
    path: /llm/sim-other
    tiers: [free]
    backend: simulator
subscriptions:
  - name: team-a
    owner: {groups: [g-team-a]}
    models:
      - name: sim-model
        tokenRateLimits: [{limit: 100000000, window: 1d}]
        billingRate: {perToken: "0.000002"}
    tokenMetadata:
      organizationId: org-team-a
      costCenter: cc-1001
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: obs-free-token, username: obs-free-user, groups: [g-free]}
  - {token: obs-tiny-token, username: obs-tiny-user, groups: [g-tiny]}
  - {token: obs-team-token, username: obs-team-user, groups: [g-team-a]}
"#;

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    S.get_or_start(|| {
        std::thread::spawn(|| {
            let mut options = StackOptions::default()
                .with_policy_yaml(POLICY)
                .with_identities_yaml(IDENTITIES)
                .with_credentials_yaml("credentials: {}\n");
            options.plugin_config_extra = Some(json!({"usage": {"reportIntervalMs": 500}}));
            // Per-user usage series (pseudonyms), for the usage dashboard's top users.
            options
                .companion_env
                .push(("MAAS_USAGE_METRICS_PER_USER".into(), "true".into()));
            Stack::start(options).map_err(|e| format!("{e:#}"))
        })
        .join()
        .unwrap_or_else(|_| Err("stack start panicked".into()))
    })
}

/// Calls of every kind, in a loop for `run`: each round admits JSON and streamed answers (one
/// under a subscription with a billing rate), refuses bad keys (twice: the auth-failure share is
/// a third), a tier over its limit, a model outside the caller's tier, and meets a backend 500.
async fn traffic(stack: &Stack, run: Duration) {
    let gw = stack.gateway_url();
    let post = |path: &str, cred: &str, body: Value, extra: Option<(&str, &str)>| {
        let mut req = client()
            .post(format!("{gw}{path}"))
            .header("authorization", bearer(cred))
            .json(&body);
        if let Some((k, v)) = extra {
            req = req.header(k, v);
        }
        send(req)
    };
    let chat = |stream: bool| {
        json!({"model": "sim-model", "messages": [{"role": "user", "content": "observe me"}],
               "max_tokens": 16, "stream": stream})
    };
    let start = Instant::now();
    let mut statuses = std::collections::BTreeMap::<u16, u32>::new();
    while start.elapsed() < run {
        let replies = [
            post(
                "/llm/sim-model/v1/chat/completions",
                "obs-free-token",
                chat(false),
                None,
            )
            .await,
            post(
                "/v1/chat/completions",
                "obs-team-token",
                chat(true),
                Some(("x-maas-subscription", "team-a")),
            )
            .await,
            post(
                "/llm/sim-model/v1/chat/completions",
                "not-a-token",
                chat(false),
                None,
            )
            .await,
            post(
                "/llm/sim-model/v1/chat/completions",
                "also-not-a-token",
                chat(false),
                None,
            )
            .await,
            post(
                "/llm/sim-model/v1/chat/completions",
                "obs-tiny-token",
                chat(false),
                None,
            )
            .await,
            post(
                "/llm/sim-other/v1/chat/completions",
                "obs-tiny-token",
                chat(false),
                None,
            )
            .await,
            post(
                "/llm/sim-model/v1/chat/completions",
                "obs-free-token",
                chat(false),
                Some(("x-sim-fault", "status-500")),
            )
            .await,
            send(
                client()
                    .get(format!("{gw}/maas-api/v1/models"))
                    .header("authorization", bearer("obs-free-token")),
            )
            .await,
        ];
        for r in replies {
            *statuses.entry(r.status).or_default() += 1;
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    for want in [200, 401, 403, 429, 500] {
        assert!(
            statuses.contains_key(&want),
            "no {want} in the traffic: {statuses:?}"
        );
    }
}

async fn query(prom: &Prometheus, expr: &str) -> Result<Vec<Value>, String> {
    let answer: Value = client()
        .get(format!("{}/api/v1/query", prom.url))
        .query(&[("query", expr)])
        .send()
        .await
        .map_err(|e| e.to_string())?
        .json()
        .await
        .map_err(|e| e.to_string())?;
    prometheus::query_result(&answer)
}

/// Every dashboard query (panel targets and variables) as Prometheus runs it.
fn dashboard_exprs() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (key, text) in dashboard_files(&workspace_root()).expect("dashboards") {
        let dash: Value = serde_json::from_str(&text).expect("dashboard JSON");
        for (panel, expr) in dashboard_queries(&dash).expect("queries") {
            out.push((
                format!("{key}: {panel}"),
                grafana_to_promql(&expr, "30s", "10m"),
            ));
        }
    }
    assert!(out.len() >= 30, "only {} queries read", out.len());
    out
}

/// The queries of `exprs` that return no data (or an error) now.
async fn empty_queries(prom: &Prometheus, exprs: &[(String, String)]) -> Vec<String> {
    let mut empty = Vec::new();
    for (what, expr) in exprs {
        match query(prom, expr).await {
            Ok(result) if !result.is_empty() => {}
            Ok(_) => empty.push(format!("{what}: no data for {expr}")),
            Err(e) => empty.push(format!("{what}: {e} in {expr}")),
        }
    }
    empty
}

fn start_prometheus(stack: &Stack, dir: &Path) -> Prometheus {
    let rules = prometheus::shipped_rules(&workspace_root(), dir).expect("the shipped rules");
    let promtool = prometheus::promtool().expect("promtool");
    let checked = std::process::Command::new(promtool)
        .args(["check", "rules"])
        .arg(&rules)
        .output()
        .expect("promtool runs");
    assert!(
        checked.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    let jobs = prometheus::stack_jobs(&[stack.envoy_admin_url()], &[stack.companion_metrics_url()]);
    let port = free_ports(1).expect("a port")[0];
    Prometheus::start(
        &dir.join("prometheus"),
        port,
        &prometheus::config(&jobs, &[rules], "1s"),
    )
    .expect("prometheus starts")
}

#[tokio::test]
async fn every_panel_and_alert_reads_what_the_running_gateway_exports() {
    let stack = stack();
    let dir = tempfile::tempdir().expect("a temp dir");
    let prom = start_prometheus(stack, dir.path());
    traffic(stack, Duration::from_secs(12)).await;
    // Every target answers.
    let up = query(&prom, "up").await.expect("up");
    assert_eq!(up.len(), 2, "{up:?}");
    assert!(
        up.iter().all(|s| s["value"][1] == "1"),
        "a target is down: {up:?}\n{}",
        prom.log()
    );
    // Histograms reach Envoy's output at its stats flush, usage at the next report: poll.
    let exprs = dashboard_exprs();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut empty = empty_queries(&prom, &exprs).await;
    while !empty.is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_secs(2)).await;
        empty = empty_queries(&prom, &exprs).await;
    }
    assert!(
        empty.is_empty(),
        "{} dashboard queries show nothing:\n{}",
        empty.len(),
        empty.join("\n")
    );
    alerts_evaluate(&prom).await;
}

/// The rules Prometheus loaded: every one evaluates without error and reads metrics that
/// exist; the auth-failure alert is pending or firing after the traffic's bad keys.
async fn alerts_evaluate(prom: &Prometheus) {
    let rules: Value = client()
        .get(format!("{}/api/v1/rules", prom.url))
        .send()
        .await
        .expect("rules")
        .json()
        .await
        .expect("JSON");
    let all: Vec<Value> = rules["data"]["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
        .collect();
    assert!(all.len() >= 10, "{rules}");
    let metric = regex::Regex::new(r"\b(?:maas|gen_ai|envoy)_[a-z0-9_]+\b").expect("regex");
    let mut problems = Vec::new();
    for rule in &all {
        let name = rule["name"].as_str().unwrap_or_default();
        if rule["health"] != "ok" {
            problems.push(format!(
                "{name}: health {} {}",
                rule["health"], rule["lastError"]
            ));
        }
        let expr = rule["query"].as_str().unwrap_or_default();
        for m in metric.find_iter(expr) {
            let exists = query(prom, &format!("count({{__name__=\"{}\"}})", m.as_str())).await;
            if !exists.is_ok_and(|r| !r.is_empty()) {
                problems.push(format!("{name}: no series {}", m.as_str()));
            }
        }
        // The signal itself shows data, except where it selects failures by a regex
        // (`status=~"5.."`, `result=~"rejected|unreadable"`) that a healthy run never has.
        let signal = alert_signal(expr);
        if !signal.contains("=~") {
            match query(prom, &signal).await {
                Ok(r) if !r.is_empty() => {}
                other => problems.push(format!("{name}: signal {signal} gave {other:?}")),
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // A third of the traffic had bad keys: the alert's condition holds (pending: `for` 10m).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let alerts: Value = client()
            .get(format!("{}/api/v1/alerts", prom.url))
            .send()
            .await
            .expect("alerts")
            .json()
            .await
            .expect("JSON");
        let active: Vec<&str> = alerts["data"]["alerts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a["labels"]["alertname"].as_str())
            .collect();
        if active.contains(&"MaaSAuthFailureRateHigh") {
            // Nothing else is wrong with this healthy stack.
            let others: Vec<&&str> = active
                .iter()
                .filter(|a| **a != "MaaSAuthFailureRateHigh")
                .collect();
            assert!(others.is_empty(), "unexpected alerts: {others:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "MaaSAuthFailureRateHigh never pending: {alerts}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
