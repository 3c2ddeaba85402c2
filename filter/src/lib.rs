//! MaaS Gateway filter.

pub mod request_body;
pub mod sse;
pub mod usage;
