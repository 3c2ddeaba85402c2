//! `maas-companion`: parses the configuration, starts the service, stops on SIGTERM/SIGINT.

use clap::Parser;
use maas_companion::config::LogFormat;
use maas_companion::{Application, Config};

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

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let config = Config::parse();
    init_logging(config.log_format);
    if let Err(message) = config.validate() {
        eprintln!("maas-companion: invalid configuration: {message}");
        return std::process::ExitCode::from(2);
    }
    let app = match Application::build(config).await {
        Ok(app) => app,
        Err(e) => {
            eprintln!("maas-companion: cannot start: {e:#}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match app.run_until_stopped().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("maas-companion: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
