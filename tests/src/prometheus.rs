//! A throwaway Prometheus (Debian's `prometheus`) that scrapes the local stack: Envoy's admin
//! `/stats/prometheus` (the filter's series) and the companion's `/metrics`, every second, with
//! rule files loaded (the shipped PrometheusRules' groups). Tests query it over its HTTP API the
//! way Grafana does. 127.0.0.1 on a free port, its data in the given directory, supervised so it
//! dies with the test.
//!
//! Binary: `MAAS_PROMETHEUS`, else `prometheus` on the PATH (`MAAS_PROMTOOL`/`promtool` for
//! [`promtool`]).

use crate::process::ManagedProcess;
use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// A program from `var`, else `name` on the PATH.
fn program(var: &str, name: &str) -> Result<PathBuf> {
    if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
        let p = PathBuf::from(v);
        if p.is_file() {
            return Ok(p);
        }
        bail!("{var}={} does not exist", p.display());
    }
    std::env::var_os("PATH")
        .and_then(|path| {
            std::env::split_paths(&path)
                .map(|d| d.join(name))
                .find(|p| p.is_file())
        })
        .with_context(|| {
            format!(
                "{name} not found (set {var} or `apt-get install prometheus`: ./scripts/test.sh and ./scripts/run-local.sh --observability do)"
            )
        })
}

/// promtool, for `check rules`.
pub fn promtool() -> Result<PathBuf> {
    program("MAAS_PROMTOOL", "promtool")
}

/// A scrape job: its name, target `host:port` and metrics path.
#[derive(Debug, Clone)]
pub struct ScrapeJob {
    pub name: String,
    pub target: String,
    pub path: String,
}

/// The scrape jobs of a stack: each Envoy's admin (`maas-gateway`) and each companion's
/// metrics listener (`maas-companion`), as the shipped PodMonitor and ServiceMonitor scrape
/// them on a cluster.
pub fn stack_jobs(
    envoy_admin_urls: &[String],
    companion_metrics_urls: &[String],
) -> Vec<ScrapeJob> {
    let host = |url: &str| {
        url.trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string()
    };
    let mut jobs: Vec<ScrapeJob> = envoy_admin_urls
        .iter()
        .map(|u| ScrapeJob {
            name: "maas-gateway".into(),
            target: host(u),
            path: "/stats/prometheus".into(),
        })
        .collect();
    jobs.extend(companion_metrics_urls.iter().map(|u| ScrapeJob {
        name: "maas-companion".into(),
        target: host(u),
        path: "/metrics".into(),
    }));
    jobs
}

/// `prometheus.yml` for the jobs (one target list per job and path) and rule files.
pub fn config(jobs: &[ScrapeJob], rule_files: &[PathBuf], scrape_interval: &str) -> String {
    let mut groups: Vec<(String, String, Vec<String>)> = Vec::new();
    for j in jobs {
        match groups
            .iter_mut()
            .find(|(n, p, _)| *n == j.name && *p == j.path)
        {
            Some((_, _, targets)) => targets.push(j.target.clone()),
            None => groups.push((j.name.clone(), j.path.clone(), vec![j.target.clone()])),
        }
    }
    let mut out = format!(
        "global:\n  scrape_interval: {scrape_interval}\n  evaluation_interval: {scrape_interval}\n"
    );
    if !rule_files.is_empty() {
        out.push_str("rule_files:\n");
        for f in rule_files {
            out.push_str(&format!("  - {:?}\n", f.display().to_string()));
        }
    }
    out.push_str("scrape_configs:\n");
    for (name, path, targets) in groups {
        out.push_str(&format!(
            "  - job_name: {name:?}\n    metrics_path: {path:?}\n    static_configs:\n      - targets: {}\n",
            serde_json::to_string(&targets).unwrap_or_default()
        ));
    }
    out
}

/// The shipped PrometheusRules' groups (gateway and companion) written as one rules file under
/// `dir`, as Prometheus and promtool read it.
pub fn shipped_rules(repo_root: &Path, dir: &Path) -> Result<PathBuf> {
    let mut groups = Vec::new();
    for file in [
        "wasm-plugin-crs/base/gateway/monitoring.yaml",
        "wasm-plugin-crs/base/companion/monitoring.yaml",
    ] {
        let path = repo_root.join(file);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        for doc in yaml_serde::Deserializer::from_str(&text) {
            let doc: Value = serde::Deserialize::deserialize(doc)
                .with_context(|| format!("{} is not YAML", path.display()))?;
            if doc["kind"] == "PrometheusRule"
                && let Some(g) = doc["spec"]["groups"].as_array()
            {
                groups.extend(g.iter().cloned());
            }
        }
    }
    if groups.is_empty() {
        bail!("no PrometheusRule groups in the shipped monitoring.yaml files");
    }
    std::fs::create_dir_all(dir)?;
    let path = dir.join("rules.yml");
    // JSON is YAML.
    std::fs::write(&path, serde_json::json!({"groups": groups}).to_string())?;
    Ok(path)
}

pub struct Prometheus {
    process: ManagedProcess,
    pub url: String,
}

impl Prometheus {
    /// Starts Prometheus on `port` with `config_text`, its data and log under `dir`.
    pub fn start(dir: &Path, port: u16, config_text: &str) -> Result<Prometheus> {
        let bin = program("MAAS_PROMETHEUS", "prometheus")?;
        std::fs::create_dir_all(dir)?;
        let config_path = dir.join("prometheus.yml");
        std::fs::write(&config_path, config_text)?;
        let mut cmd = Command::new(bin);
        cmd.arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--web.enable-lifecycle")
            .arg("--storage.tsdb.retention.time=1d");
        let mut process = ManagedProcess::spawn(
            "prometheus",
            cmd,
            &dir.join("prometheus.log"),
            libc::SIGTERM,
            libc::SIGKILL,
        )?;
        let url = format!("http://127.0.0.1:{port}");
        let ready = format!("127.0.0.1:{port}");
        process.wait_ready(Duration::from_secs(60), Duration::from_millis(100), || {
            http_get(&ready, "/-/ready").is_some_and(|(status, _)| status == 200)
        })?;
        Ok(Prometheus { process, url })
    }

    /// Stops it (SIGTERM, then SIGKILL).
    pub fn stop(&mut self) {
        self.process.stop(Duration::from_secs(5));
    }

    pub fn log(&self) -> String {
        self.process.log_tail(4000)
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A plain HTTP/1.0 GET on loopback (no client dependency in the harness's start path):
/// (status, body).
fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}

/// The `data.result` of an instant query answer (`status: success`), else why not.
pub fn query_result(answer: &Value) -> Result<Vec<Value>, String> {
    if answer["status"] != "success" {
        return Err(format!("{}: {}", answer["errorType"], answer["error"]));
    }
    match &answer["data"]["result"] {
        Value::Array(items) => Ok(items.clone()),
        // A scalar or string result: one value.
        Value::Null => Ok(Vec::new()),
        other => Ok(vec![other.clone()]),
    }
}

/// A Grafana panel query as Prometheus can run it: Grafana's variables replaced by what a
/// dashboard shows by default (`$__rate_interval` a window covering several scrapes, `$__range`
/// the whole run, a multi-value variable "All": `.*`).
pub fn grafana_to_promql(expr: &str, rate_window: &str, range: &str) -> String {
    let mut out = expr
        .replace("$__rate_interval", rate_window)
        .replace("${__rate_interval}", rate_window)
        .replace("$__range", range)
        .replace("${__range}", range)
        .replace("$__interval", rate_window);
    // Any other `$name` / `${name}` is a dashboard variable: all values.
    let re = regex::Regex::new(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?").expect("a valid regex");
    out = re.replace_all(&out, ".*").into_owned();
    out
}

/// An alert's signal: its expression without the final comparison with a number (`… > 0.05`,
/// `… == 0`) and without an outer `absent(…)`, so that a healthy run shows the series the alert
/// watches (the alert itself fires only when something is wrong).
pub fn alert_signal(expr: &str) -> String {
    let e = expr.trim();
    let re = regex::Regex::new(r"(?s)^(.*?)\s*(?:>=|<=|==|!=|>|<)\s*-?[0-9.eE+-]+\s*$")
        .expect("a valid regex");
    let e = re
        .captures(e)
        .and_then(|c| c.get(1))
        .map_or(e, |m| m.as_str())
        .trim();
    match e.strip_prefix("absent(").and_then(|r| r.strip_suffix(')')) {
        Some(inner) => alert_signal(inner),
        None => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grafana_variables_become_promql() {
        assert_eq!(
            grafana_to_promql(
                r#"sum by (tier) (rate(x{tier=~"$tier",model=~"${model}"}[$__rate_interval])) + increase(y[$__range])"#,
                "30s",
                "10m"
            ),
            r#"sum by (tier) (rate(x{tier=~".*",model=~".*"}[30s])) + increase(y[10m])"#
        );
    }

    #[test]
    fn an_alerts_signal_drops_its_threshold() {
        assert_eq!(
            alert_signal("max by (pod) (maas_lease_fallback) > 0"),
            "max by (pod) (maas_lease_fallback)"
        );
        assert_eq!(
            alert_signal("maas_companion_lease_store_up == 0"),
            "maas_companion_lease_store_up"
        );
        assert_eq!(
            alert_signal("absent(up{job=\"maas-companion\"} == 1)"),
            "up{job=\"maas-companion\"}"
        );
        assert_eq!(
            alert_signal("sum(rate(a[5m]))\n  / clamp_min(sum(rate(b[5m])), 1e-9) > 0.01\n"),
            "sum(rate(a[5m]))\n  / clamp_min(sum(rate(b[5m])), 1e-9)"
        );
        assert_eq!(alert_signal("increase(x[10m]) > 0"), "increase(x[10m])");
    }

    #[test]
    fn the_config_groups_targets_by_job() {
        let jobs = stack_jobs(
            &["http://127.0.0.1:1/".into(), "http://127.0.0.1:2".into()],
            &["http://127.0.0.1:3".into()],
        );
        let c = config(&jobs, &[PathBuf::from("/r/a.yml")], "1s");
        assert!(c.contains("job_name: \"maas-gateway\"\n    metrics_path: \"/stats/prometheus\"\n    static_configs:\n      - targets: [\"127.0.0.1:1\",\"127.0.0.1:2\"]"), "{c}");
        assert!(c.contains("job_name: \"maas-companion\""), "{c}");
        assert!(c.contains("rule_files:\n  - \"/r/a.yml\""), "{c}");
    }
}
