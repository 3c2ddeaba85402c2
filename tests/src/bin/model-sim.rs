//! Standalone OpenAI-compatible model simulator (see docs/contracts.md "Model simulator").

use clap::Parser;
use maas_e2e::sim::{self, SimConfig};
use std::time::Duration;

#[derive(Parser)]
#[command(about = "OpenAI-compatible model simulator with deterministic token counts")]
struct Args {
    /// Address to listen on.
    #[arg(long, env = "MODEL_SIM_ADDR", default_value = "127.0.0.1:8000")]
    addr: std::net::SocketAddr,
    /// Delay between stream chunks (a request's `x-sim-chunk-delay-ms` overrides it).
    #[arg(long, default_value_t = 0)]
    chunk_delay_ms: u64,
    /// Model ids listed by GET …/v1/models (comma separated).
    #[arg(long, value_delimiter = ',', default_value = "sim-model")]
    models: Vec<String>,
    /// Serve only these models (as vLLM's --served-model-name): another body `model` is a 404.
    #[arg(long)]
    served_only: bool,
    /// The fault of every request without `x-sim-fault` (a backend that is down, to try a
    /// model's failover: `status-503`, `status-429`, `stall`, …; default none).
    #[arg(long, default_value = "")]
    fault: String,
    /// Tokio worker threads (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = args.threads {
        builder.worker_threads(n);
    }
    let runtime = builder.enable_all().build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.addr).await?;
        eprintln!("model-sim listening on {}", listener.local_addr()?);
        let config = SimConfig {
            chunk_delay: Duration::from_millis(args.chunk_delay_ms),
            models: args.models,
            served_only: args.served_only,
        };
        tokio::select! {
            r = sim::serve_with_fault(listener, config, &args.fault) => r?,
            _ = tokio::signal::ctrl_c() => {}
        }
        Ok(())
    })
}
