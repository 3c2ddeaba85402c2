//! API keys: the store (all SQL on `api_keys`), the rules of a key's lifetime and name, the
//! debounced `last_used_at`, and the public key-management API.

pub mod api;
pub mod last_used;
pub mod rules;
pub mod store;
