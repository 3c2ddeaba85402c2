//! Companion integration tests: real PostgreSQL (a fresh database per test), real HTTP.
//! Run with ./scripts/test.sh, or with MAAS_TEST_DATABASE_URL set.

mod api_keys;
mod authenticate;
mod binary;
mod helpers;
mod kubernetes;
mod oidc;
mod operations;
mod policy;
