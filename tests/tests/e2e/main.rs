//! End-to-end tests through real Envoy with the release .wasm, the real companion, PostgreSQL
//! (and Redis where replicas share limits): one test binary, one module per suite, so the
//! harness is linked once (as zero-to-production's `tests/api/main.rs`). Run one suite with
//! `cargo test -p maas-e2e --test e2e <module>::` (e.g. `filter_limits::`).
//!
//! Each module starts its own stack with its own policy and identities (see [`helpers`]), lazily,
//! the first time one of its tests asks for it.

mod helpers;

mod api_families;
mod backend_credentials;
mod backend_paths;
mod backends;
mod bedrock;
mod budget_fields;
mod cloud_providers;
mod credential_rotation;
mod enforcement_integrity;
mod filter_auth;
mod filter_config;
mod filter_limits;
mod filter_policy;
mod gateway_basics;
mod global_limits;
mod http2;
mod internal_auth;
mod istio_gateway;
mod local_command;
mod log_privacy;
mod models_ready;
mod money_budgets;
mod observability;
mod one_url;
mod output_caps;
mod pools;
mod quota_webhook;
mod rate_limit_headers;
mod reliability_faults;
mod reliability_policy;
mod scopes;
mod security_input;
mod security_leaks;
mod security_no_upstream;
mod security_non_utf8;
mod security_surface;
mod security_underscore_headers;
mod simulator;
mod soak;
mod stack_concurrent_start;
mod stack_control;
mod stack_parts;
mod subscriptions;
mod subscriptions_resources;
mod token_weights;
mod tracing;
mod translate_anthropic;
mod ui_browser;
mod usage_events;
mod usage_ledger;
