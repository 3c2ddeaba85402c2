//! Companion integration tests: real PostgreSQL (a fresh database per test), real HTTP.
//! Run with ./scripts/test.sh, or with MAAS_TEST_DATABASE_URL set.

// A test crate: a failed unwrap or panic is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod api_keys;
mod authenticate;
mod binary;
mod helpers;
mod internal_auth;
mod kubernetes;
mod leases;
mod models;
mod oidc;
mod operations;
mod policy;
mod quota_webhook;
mod resources;
mod subscription_quota;
mod subscriptions;
mod usage;
