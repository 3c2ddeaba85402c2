//! `maas-local`: the whole gateway on this machine (PostgreSQL, companion, model simulator,
//! Envoy with the filter; with `--replicas N`, N Envoys each with its own companion, sharing a
//! Redis for global limits). Started by ./scripts/run-local.sh; Ctrl-C stops everything.

use clap::Parser;
use maas_e2e::{ConfigSource, Stack, StackOptions, prometheus, tools};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
#[command(
    about = "Run the MaaS gateway locally: PostgreSQL, companion, model simulator and Envoy with the filter"
)]
struct Args {
    /// Policy file (tiers, models and their backends). Default: config/local/policy.yaml.
    #[arg(long)]
    policy: Option<PathBuf>,
    /// Static identities file (tokens standing in for OpenShift users). Default: config/local/identities.yaml.
    #[arg(long)]
    identities: Option<PathBuf>,
    /// Provider credentials file for external models. Default: config/local/credentials.yaml.
    #[arg(long)]
    credentials: Option<PathBuf>,
    /// Gateway port (replica i of --replicas takes port + i when free, else a free port).
    #[arg(long, env = "MAAS_GATEWAY_PORT", default_value_t = 8080)]
    port: u16,
    /// Gateway replicas: N Envoys, each with its own companion, sharing one Redis so that limits
    /// hold across them (1 = no Redis).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16))]
    replicas: u16,
    /// Gateway listen address (0.0.0.0 to reach it from other machines).
    #[arg(long, env = "MAAS_GATEWAY_HOST", default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    /// Envoy worker threads.
    #[arg(long, default_value_t = 2)]
    concurrency: u32,
    /// Keep the stack's directory (logs, data) after exit.
    #[arg(long)]
    keep: bool,
    /// Also start Prometheus (port 9090 when free), scraping every Envoy and companion with the
    /// shipped alert rules loaded; the dashboards' queries run against it.
    #[arg(long)]
    observability: bool,
}

fn source(path: Option<PathBuf>) -> ConfigSource {
    path.map(ConfigSource::File).unwrap_or_default()
}

fn main() {
    if let Err(e) = run() {
        eprintln!("maas-local: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    let options = StackOptions {
        policy: source(args.policy),
        identities: source(args.identities),
        credentials: source(args.credentials),
        gateway_port: Some(args.port),
        gateway_host: args.host,
        envoy_concurrency: args.concurrency,
        poll_interval_ms: 1000,
        policy_reload_interval_ms: 1000,
        keep_dir: args.keep || StackOptions::default().keep_dir,
        replicas: usize::from(args.replicas),
        ..StackOptions::default()
    };
    if args.replicas > 1 {
        eprintln!(
            "maas-local: starting PostgreSQL, Redis, model simulator and {} replicas (companion + Envoy each) …",
            args.replicas
        );
    } else {
        eprintln!("maas-local: starting PostgreSQL, companion, model simulator and Envoy …");
    }
    let stack = Stack::start(options)?;
    let prometheus = if args.observability {
        Some(start_prometheus(&stack)?)
    } else {
        None
    };
    print_next_steps(&stack, prometheus.as_ref());

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let outcome = runtime.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut sigint = signal(SignalKind::interrupt())?;
        let mut sigterm = signal(SignalKind::terminate())?;
        // The terminal closed: stop as cleanly as for Ctrl-C.
        let mut sighup = signal(SignalKind::hangup())?;
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = sigint.recv() => return Ok::<_, anyhow::Error>(()),
                _ = sigterm.recv() => return Ok(()),
                _ = sighup.recv() => return Ok(()),
                _ = tick.tick() => stack.check_alive()?,
            }
        }
    });
    eprintln!("maas-local: stopping …");
    drop(prometheus);
    stack.shutdown();
    eprintln!("maas-local: stopped");
    outcome
}

/// Prometheus beside the stack: every replica's Envoy admin and companion metrics, every
/// second, the shipped alert rules loaded; its data in the stack's directory.
fn start_prometheus(stack: &Stack) -> anyhow::Result<prometheus::Prometheus> {
    eprintln!("maas-local: starting Prometheus …");
    let replicas = stack.gateway_urls().len();
    let admins: Vec<String> = (0..replicas).map(|i| stack.envoy_admin_url_of(i)).collect();
    let metrics: Vec<String> = (0..replicas)
        .map(|i| stack.companion_metrics_url_of(i))
        .collect();
    let dir = stack.dir().join("prometheus");
    let rules = prometheus::shipped_rules(&tools::workspace_root(), &dir)?;
    let jobs = prometheus::stack_jobs(&admins, &metrics);
    let port = if std::net::TcpListener::bind(("127.0.0.1", 9090)).is_ok() {
        9090
    } else {
        maas_e2e::stack::free_ports(1)?
            .first()
            .copied()
            .ok_or_else(|| anyhow::anyhow!("no free port"))?
    };
    prometheus::Prometheus::start(&dir, port, &prometheus::config(&jobs, &[rules], "5s"))
}

fn print_observability(stack: &Stack, p: &prometheus::Prometheus) {
    println!("Prometheus: {} (alerts: {}/alerts)", p.url, p.url);
    println!(
        "  scrapes {} Envoy admin(s) /stats/prometheus and companion /metrics every 5 s",
        stack.gateway_urls().len()
    );
    println!(
        "  dashboards to import in Grafana: {}",
        tools::workspace_root()
            .join("wasm-plugin-crs/base/companion/dashboards")
            .display()
    );
    println!(
        "  try: curl -s '{}/api/v1/query?query=sum%20by%20(decision)%20(maas_requests_total)'",
        p.url
    );
}

/// Where the companion's internal API is, and that only the gateway's certificate gets in.
fn print_internal_api(stack: &Stack) {
    let url = stack.companion_internal_url();
    let Some(pki) = stack.internal_pki() else {
        println!("Internal API: {url} (no caller authentication)");
        return;
    };
    println!(
        r#"Internal API: {url}
  (the filter's only: mutual TLS, callers need the gateway's client certificate; without it, refused)
  curl --cacert {ca} {url}/internal/v1/credentials        # refused: no certificate
  curl --cacert {ca} --cert {cert} --key {key} {url}/internal/v1/credentials"#,
        ca = pki.ca_file.display(),
        cert = pki.gateway_cert.display(),
        key = pki.gateway_key.display(),
    );
}

fn print_next_steps(stack: &Stack, prometheus: Option<&prometheus::Prometheus>) {
    let gw = stack.gateway_url();
    let root = tools::workspace_root();
    let urls = stack.gateway_urls();
    println!("READY {}", urls.join(" "));
    if let Some(p) = prometheus {
        print_observability(stack, p);
    }
    // The companion (it inherits the environment) serves the web UI from MAAS_UI_DIR, which
    // ./scripts/run-local.sh sets to the ui/dist it builds.
    if std::env::var_os("MAAS_UI_DIR").is_some_and(|d| !d.is_empty()) {
        println!("UI {gw}/maas-api/ui/");
    }
    // The one base URL first (every model, the body's "model" picks it), then each model's own.
    println!("OpenAI base URL: {gw}/v1");
    println!("Path-prefix URLs (one per model):");
    for (name, path) in stack.routed_models() {
        println!("  {gw}{path}/v1  ({name})");
    }
    if urls.len() > 1 {
        println!(
            "\n{} gateway replicas: {} (each with its own companion; limits are global through Redis {}).",
            urls.len(),
            urls.join(", "),
            stack.redis_url().unwrap_or_else(|| "(none)".into())
        );
    }
    print_internal_api(stack);
    println!(
        r#"
The gateway, the companion's public API (under /maas-api) and the models share {gw}.

1. Mint an API key as alice (free tier; bob-token = premium, carol-token = enterprise + admin):
   export GATEWAY={gw}
   KEY=$(curl -s -H 'Authorization: Bearer alice-token' -H 'Content-Type: application/json' \
     -d '{{"name":"my-first-key"}}' $GATEWAY/maas-api/v1/api-keys | sed -n 's/.*"key":"\([^"]*\)".*/\1/p')

2. Call a model with the key at the one base URL (the body's "model" picks it):
   curl -s -H "Authorization: Bearer $KEY" -H 'Content-Type: application/json' \
     -d '{{"model":"sim-model","messages":[{{"role":"user","content":"Hello there"}}]}}' \
     $GATEWAY/v1/chat/completions
   (or at the model's own path prefix: $GATEWAY/llm/sim-model/v1/chat/completions)

3. List the models your tier may use (OpenAI's list; the companion's, with details):
   curl -s -H "Authorization: Bearer $KEY" $GATEWAY/v1/models
   curl -s -H "Authorization: Bearer $KEY" $GATEWAY/maas-api/v1/models

OpenAI SDK: OpenAI(base_url="$GATEWAY/v1", api_key=KEY); Anthropic SDK: Anthropic(base_url="$GATEWAY", api_key=KEY).

Stream: add "stream":true,"stream_options":{{"include_usage":true}} to the body of step 2.
Policy: {policy} (edits are reloaded; new model routes need a restart)
Usage events: {events} (one JSON line per request with the policy's observability: {{usageEvents: true}})
Identities: {identities}
Logs: {dir}
Root: {root}
Ctrl-C stops everything."#,
        policy = stack.policy_path().display(),
        identities = stack.identities_path().display(),
        events = stack.usage_events_path().display(),
        dir = stack.dir().display(),
        root = root.display(),
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
}
