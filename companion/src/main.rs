//! `maas-companion`: parses the configuration, starts the service, stops on SIGTERM/SIGINT.

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
