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
use maas_companion::settings::LogFormat;
use maas_companion::{Application, Cli};
use std::process::ExitCode;

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "info,sqlx=warn".into());
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
}

/// Stderr is where a failed start is reported (logging may not be set up yet).
#[allow(clippy::print_stderr)]
fn fail(code: ExitCode, message: std::fmt::Arguments<'_>) -> ExitCode {
    eprintln!("maas-companion: {message}");
    code
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
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
    match app.run_until(stop).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(ExitCode::FAILURE, format_args!("{e:#}")),
    }
}
