//! `maas-companion`: parses the configuration, starts the service, stops on SIGTERM/SIGINT.

// The companion's own lints (the workspace's are in the root Cargo.toml). A panic in a handler
// drops the connection and in a background task silently stops it: production code answers
// errors instead. Tests may unwrap (clippy.toml allows it in tests). Logs go through tracing to
// stderr; stdout is not an output channel of the service. No `as` casts that may truncate or
// wrap silently. The same list is at the root of the library and of the binary.
#![forbid(unsafe_code)]
#![warn(unused_qualifications)]
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout
)]
#![warn(
    clippy::print_stderr,
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss
)]

use clap::Parser;
use maas_companion::{Application, Cli, telemetry};
use std::process::ExitCode;

/// Stderr is where a failed start is reported (logging may not be set up yet).
#[allow(clippy::print_stderr)]
fn fail(code: ExitCode, message: std::fmt::Arguments<'_>) -> ExitCode {
    eprintln!("maas-companion: {message}");
    code
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // Logs, and the trace export when asked for, before anything logs.
    let telemetry = match cli
        .trace_settings()
        .and_then(|traces| telemetry::init(cli.log_format, &traces))
    {
        Ok(t) => t,
        Err(m) => {
            return fail(
                ExitCode::from(2),
                format_args!("invalid configuration: {m}"),
            );
        }
    };
    let settings = match cli.into_settings() {
        Ok(s) => s,
        Err(m) => {
            return fail(
                ExitCode::from(2),
                format_args!("invalid configuration: {m}"),
            );
        }
    };
    // Before anything is logged as listening: a SIGTERM from then on stops gracefully.
    let stop = maas_companion::shutdown_signal();
    let app = match Application::build(settings).await {
        Ok(app) => app,
        Err(e) => return fail(ExitCode::FAILURE, format_args!("cannot start: {e:#}")),
    };
    let result = app.run_until(stop).await;
    // The spans still buffered go out before the exit (the exporter blocks: off the runtime).
    if let Some(t) = telemetry {
        let _ = tokio::task::spawn_blocking(move || t.shutdown()).await;
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(ExitCode::FAILURE, format_args!("{e:#}")),
    }
}
