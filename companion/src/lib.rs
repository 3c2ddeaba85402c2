//! MaaS Gateway companion: API keys in PostgreSQL, identity, policy, provider credentials.
//!
//! Modules by capability; `startup` wires them into two listeners (public and internal).

pub mod api_keys;
pub mod authenticate;
pub mod config;
pub mod credentials;
pub mod db;
pub mod http_error;
pub mod identity;
pub mod last_used;
pub mod metrics;
pub mod models;
pub mod oidc;
pub mod openapi;
pub mod policy;
pub mod startup;

pub use config::Config;
pub use startup::Application;
