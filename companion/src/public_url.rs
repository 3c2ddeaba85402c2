//! The Gateway's base URL as clients reach it (`--public-url`): the model urls of the
//! companion's `/v1/models` and of the policy it serves the filter (whose `GET /v1/models` answers
//! at the gateway) are built from it alone.

use maas_types::Model;
use std::sync::Arc;

/// The Gateway's base URL (`--public-url`, checked, no trailing `/`), under which a model's
/// `url` is its path. `None`: models are listed without `url`. Never taken from the request:
/// its `Host` (or `X-Forwarded-*`) is whatever the client sent, and a forged one would put
/// another host into every snippet built from the answer.
#[derive(Debug, Clone, Default)]
pub struct PublicUrl(pub Option<Arc<str>>);

impl PublicUrl {
    pub fn new(base: Option<String>) -> PublicUrl {
        PublicUrl(base.map(Arc::from))
    }

    pub(crate) fn model_url(&self, m: &Model) -> Option<String> {
        self.0.as_ref().map(|b| format!("{b}{}", m.path))
    }
}
