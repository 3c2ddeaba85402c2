//! MaaS Gateway companion: API keys in PostgreSQL, identity, policy, provider credentials.
//!
//! Modules by capability, with no import cycles among them (a test checks:
//! `tests/module_graph.rs`): `settings` (configuration, parsed once), `http` (shared HTTP
//! plumbing), `db`, `metrics`, `keys` (store, rules, API), `policy`, `policy_source` (the policy from the reference's Kubernetes resources), `credentials`, `identity`,
//! `authenticate`, `caller`, `internal_tls` (who may call the internal listener: mutual TLS), `models`, `openapi`, `ui` (the web UI's files), `leases` (budget leases), `usage` (the usage ledger, `/v1/usage`, `/v1/quota`), `pseudonym` (users as keyed pseudonyms in the logs and spans), `telemetry` (logs, OTLP trace export, the HTTP span), `quota_webhook` (quota warnings to a webhook); `state` assembles
//! the substates, `routes` the routers, `startup` the listeners. Only the settings and the application are public.

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

mod authenticate;
mod caller;
mod cloud_tokens;
mod credentials;
mod db;
mod http;
mod identity;
mod internal_tls;
mod keys;
mod leases;
mod metrics;
mod models;
mod openapi;
mod policy;
mod policy_source;
pub mod pseudonym;
mod public_url;
mod quota_webhook;
mod readiness;
mod routes;
pub mod settings;
pub mod startup;
mod state;
pub mod telemetry;
mod ui;
mod usage;

pub use settings::{Cli, Settings};
pub use startup::{Application, Overrides, shutdown_signal};
