//! MaaS Gateway filter: authentication, credential hygiene, provider credentials and per-tier
//! request and token limits, as a Proxy-WASM HTTP filter for Envoy.
//!
//! The decisions are plain functions over plain data (native unit tests); `glue` is the thin
//! proxy-wasm layer (compiled for wasm32 only). See README.md for the module map.

pub mod cache;
pub mod config;
pub mod credential;
pub mod decide;
pub mod encoding;
pub mod hygiene;
pub mod limits;
pub mod metrics;
pub mod operations;
pub mod path;
pub mod request_body;
pub mod response;
pub mod sse;
pub mod store;
pub mod usage;

#[cfg(target_arch = "wasm32")]
mod glue;
