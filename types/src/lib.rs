//! Types and rules shared by `maas-filter` (wasm) and `maas-companion` (native).
//!
//! Everything that crosses the filter/companion boundary is defined here once: the policy
//! document and its validation, tier resolution, subscription selection, the authenticate
//! contract, the credentials document, the budget-lease contract, the usage-report contract, the API key format and its hash, which credential a request carries (one
//! extraction rule), and the OpenAI-style error body and error types.
//! The crate is `no I/O`, no clock: callers pass the time in.

// Compiled into the filter, where a panic traps the VM (clippy.toml allows these in tests).
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod apikey;
pub mod auth;
pub mod credential;
pub mod error_body;
pub mod lease;
pub mod money;
pub mod policy;
pub mod subscription;
pub mod usage;
pub mod window;

pub use apikey::{ApiKeyParts, KeyFormatError};
pub use auth::{AuthenticateRequest, AuthenticateResponse, CredentialsDocument, SigV4Key};
pub use credential::{Credential, CredentialError};
pub use error_body::{ErrorBody, ErrorDetail, ErrorKind};
pub use lease::{LeaseGrant, LeaseItem, LeaseKind, LeaseRequest, LeaseResponse};
pub use money::{Budget, Money, Pricing};
pub use policy::{
    ApiFamily, BACKEND_ORDER_HEADER, BACKEND_ROUTING_HEADER, Limit, Limits, MODEL_ROUTING_HEADER,
    Model, ModelDetails, ONE_BASE_PATH, Observability, OperationSpec, PolicyDocument, PolicyError,
    Provider, ProviderAuth, ProviderKind, ProviderPath, RateLimitHeaders, SERVED_BY_HEADER, Scope,
    ScopeCounter, ScopePer, Tier, TokenWeights, UncappedRequests, VERTEX_ANTHROPIC_VERSION,
    VertexPublisher,
};
pub use subscription::{SelectError, Subscription};
pub use usage::{UsageAccepted, UsageRecord, UsageReport};
pub use window::Window;
