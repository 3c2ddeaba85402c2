//! LiteLLM proxy in front of the same simulator (`--litellm`).

use crate::envoy::{free_ports, local};
use crate::http::post_once;
use crate::streams::json_body;
use crate::{LITELLM_MASTER_KEY, MODEL};
use anyhow::{Result, bail};
use maas_e2e::process::ManagedProcess;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

pub(crate) fn start_litellm(
    root: &Path,
    dir: &Path,
    sim: SocketAddr,
) -> Result<(ManagedProcess, SocketAddr)> {
    let bin = root.join(".local/bench-venv/bin/litellm");
    if !bin.is_file() {
        bail!(
            "{} missing: ./scripts/bench.sh --peers installs it",
            bin.display()
        );
    }
    let [port] = free_ports::<1>()?;
    let config = dir.join("litellm.yaml");
    std::fs::write(
        &config,
        format!(
            "model_list:\n  - model_name: {MODEL}\n    litellm_params:\n      model: openai/{MODEL}\n      api_base: http://{sim}/v1\n      api_key: sk-sim\ngeneral_settings:\n  master_key: {LITELLM_MASTER_KEY}\nlitellm_settings:\n  telemetry: false\n"
        ),
    )?;
    let mut cmd = Command::new("taskset");
    cmd.args(["-c", "0"])
        .arg(&bin)
        .arg("--config")
        .arg(&config)
        .args([
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--num_workers",
            "1",
        ])
        .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        .env("LITELLM_LOG", "ERROR")
        .env("LITELLM_TELEMETRY", "False")
        .env("DISABLE_SCHEMA_UPDATE", "True");
    let mut p = ManagedProcess::spawn(
        "litellm",
        cmd,
        &dir.join("litellm.log"),
        libc::SIGTERM,
        libc::SIGKILL,
    )?;
    let addr = local(port);
    let deadline = Instant::now() + Duration::from_secs(180);
    let body = json_body(16);
    loop {
        let auth = format!("Bearer {LITELLM_MASTER_KEY}");
        if let Ok((200, _)) = post_once(
            addr,
            "/v1/chat/completions",
            &[("Authorization", &auth)],
            body.as_bytes(),
        ) {
            break;
        }
        if let Some(status) = p.exited() {
            bail!("litellm exited ({status}):\n{}", p.log_tail(3000));
        }
        if Instant::now() > deadline {
            bail!("litellm not answering after 180 s:\n{}", p.log_tail(3000));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    Ok((p, addr))
}
