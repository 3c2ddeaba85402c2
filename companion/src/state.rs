//! The application state, in one place: one [`AppState`] made of substates. Handlers and
//! extractors take only the substate they use (`State<KeyStore>`, `State<PolicyHandle>`, …),
//! through the [`FromRef`] impls below, so no capability module depends on this one.

use crate::authenticate::Authenticator;
use crate::credentials::CredentialsSource;
use crate::keys::store::KeyStore;
use crate::leases::Leases;
use crate::metrics::Metrics;
use crate::policy::PolicyHandle;
use crate::public_url::PublicUrl;
use crate::readiness::Readiness;
use crate::settings::KeySettings;
use crate::usage::Usage;
use axum::extract::FromRef;
use std::sync::Arc;

#[derive(Clone)]
pub struct AppState {
    pub keys: KeyStore,
    pub key_settings: KeySettings,
    pub policy: PolicyHandle,
    pub auth: Authenticator,
    pub credentials: Arc<CredentialsSource>,
    pub metrics: Arc<Metrics>,
    pub leases: Leases,
    pub usage: Usage,
    pub public_url: PublicUrl,
    pub readiness: Readiness,
}

macro_rules! substate {
    ($field:ident: $ty:ty) => {
        impl FromRef<AppState> for $ty {
            fn from_ref(state: &AppState) -> $ty {
                state.$field.clone()
            }
        }
    };
}

substate!(keys: KeyStore);
substate!(key_settings: KeySettings);
substate!(policy: PolicyHandle);
substate!(auth: Authenticator);
substate!(credentials: Arc<CredentialsSource>);
substate!(metrics: Arc<Metrics>);
substate!(leases: Leases);
substate!(usage: Usage);
substate!(public_url: PublicUrl);
substate!(readiness: Readiness);
