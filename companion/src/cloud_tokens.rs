//! Short-lived access tokens from long-lived cloud credentials (issue 29), obtained and rotated
//! by the companion so the filter only ever holds the current token and its expiry.
//!
//! - Google (vertex, `auth: gcpServiceAccount`): a service-account key (the JSON a Secret's
//!   `service-account.json` holds) signs an RS256 JWT assertion (`iss` = the key's
//!   `client_email`, `aud` = its `token_uri`, `scope` = cloud-platform, one hour) exchanged at the
//!   key's `token_uri` with the OAuth 2.0 JWT bearer grant (RFC 7523) for an access token.
//! - Microsoft Entra (azure-openai, `auth: azureClientCredentials`): the client credentials grant
//!   at `{authority}/{tenant}/oauth2/v2.0/token` for the Cognitive Services scope (`authority`:
//!   `--azure-authority-url`).
//!
//! A token is reused until [`refresh_at`] (a fifth of its lifetime before expiry, at least five
//! minutes, at most half the lifetime), then replaced at the next request for it (the filter
//! polls the credentials every `pollIntervalMs`, so a replaced token reaches every worker long
//! before the old one expires). A failed exchange keeps serving the old token while it is valid.
//! A changed secret (a rotated key) is exchanged at once. The long-lived secrets and the tokens
//! are [`SecretString`]s: never logged.
//!
//! AWS (bedrock, `auth: awsSigV4`) has no token exchange: [`aws_sigv4`] derives the day's SigV4
//! signing key from the access key, and the filter signs each request with it.

pub mod aws_sigv4;
pub mod gcp_federation;

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::Mutex;

/// The OAuth scope of Google Cloud APIs (Vertex AI).
pub const GCP_SCOPE: &str = "https://www.googleapis.com/auth/cloud-platform";
/// RFC 7523's grant type.
pub const JWT_BEARER_GRANT: &str = "urn:ietf:params:oauth:grant-type:jwt-bearer";
/// The Entra scope of Azure OpenAI (Cognitive Services).
pub const AZURE_SCOPE: &str = "https://cognitiveservices.azure.com/.default";
/// How long a JWT assertion is valid (Google's maximum).
const ASSERTION_LIFETIME: Duration = Duration::from_secs(3600);
/// How long a token endpoint may take.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(10);

/// A long-lived cloud credential, as its Secret holds it.
#[derive(Debug)]
pub enum CloudSecret {
    Gcp(GcpServiceAccountKey),
    /// Workload identity federation ([`crate::cloud_tokens::gcp_federation`]): no key, the pod's token.
    GcpFederated(Box<gcp_federation::ExternalAccount>),
    Azure(AzureClientCredentials),
}

/// The fields of a Google service-account key file the exchange uses.
#[derive(Debug, Deserialize)]
pub struct GcpServiceAccountKey {
    #[serde(rename = "type")]
    kind: String,
    client_email: String,
    private_key: SecretString,
    #[serde(default)]
    private_key_id: Option<String>,
    token_uri: String,
}

impl GcpServiceAccountKey {
    /// Parses a key file (the Secret's `service-account.json`).
    pub fn parse(json: &str) -> Result<Self, TokenError> {
        let key: GcpServiceAccountKey = serde_json::from_str(json).map_err(|e| {
            // serde_json's message names the position, never the value.
            TokenError::Invalid(format!("service-account.json: {e}"))
        })?;
        if key.kind != "service_account" {
            return Err(TokenError::Invalid(format!(
                "service-account.json: type {:?}, expected \"service_account\"",
                key.kind
            )));
        }
        check_url("service-account.json token_uri", &key.token_uri)?;
        Ok(key)
    }
}

/// Microsoft Entra client credentials (the Secret's `tenant-id`, `client-id`, `client-secret`).
#[derive(Debug)]
pub struct AzureClientCredentials {
    pub tenant_id: String,
    pub client_id: String,
    pub client_secret: SecretString,
}

impl CloudSecret {
    /// What identifies this very secret (a rotated one is exchanged at once); a digest, so the
    /// cache holds no second copy of the secret.
    fn fingerprint(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        match self {
            CloudSecret::Gcp(k) => {
                for part in [
                    "gcp",
                    &k.client_email,
                    k.private_key.expose_secret(),
                    &k.token_uri,
                ] {
                    h.update(part.as_bytes());
                    h.update([0]);
                }
            }
            CloudSecret::GcpFederated(account) => {
                h.update(b"gcp-federated\0");
                h.update(account.digest());
            }
            CloudSecret::Azure(a) => {
                for part in [
                    "azure",
                    &a.tenant_id,
                    &a.client_id,
                    a.client_secret.expose_secret(),
                ] {
                    h.update(part.as_bytes());
                    h.update([0]);
                }
            }
        }
        h.finalize().into()
    }
}

/// Why no token could be had.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The secret is not usable as it is (malformed key, missing field).
    #[error("{0}")]
    Invalid(String),
    /// The first token is being obtained by another request.
    #[error("the access token is being obtained")]
    Pending,
    /// The token endpoint refused or could not be reached.
    #[error("token endpoint {endpoint}: {reason}")]
    Exchange { endpoint: String, reason: String },
}

/// A current access token and when it expires (unix seconds).
#[derive(Clone)]
pub struct AccessToken {
    pub value: SecretString,
    pub expires_at: u64,
}

struct Cached {
    fingerprint: [u8; 32],
    token: AccessToken,
    expires: SystemTime,
    refresh: SystemTime,
}

/// One credential's token and the lock its exchange runs under.
#[derive(Default)]
struct Slot {
    current: std::sync::Mutex<Option<Cached>>,
    exchange: Mutex<()>,
}

/// The tokens obtained so far, by `credentialRef`. Each credential is exchanged on its own:
/// one slow token endpoint delays no other provider's credential.
pub struct CloudTokens {
    http: reqwest::Client,
    azure_authority: String,
    gcp_federation: gcp_federation::GcpFederation,
    slots: std::sync::Mutex<HashMap<String, std::sync::Arc<Slot>>>,
}

/// When a token obtained at `obtained`, valid for `lifetime`, is replaced: a fifth of its
/// lifetime before it expires, at least five minutes before, but never before half of it
/// passed (an hour-long token: after 48 minutes; a 4-second one: after 2 seconds).
pub fn refresh_at(obtained: SystemTime, lifetime: Duration) -> SystemTime {
    let margin = (lifetime / 5).max(Duration::from_secs(300).min(lifetime / 2));
    obtained + lifetime.saturating_sub(margin)
}

/// A token goes into a header: visible ASCII only, not empty.
pub(crate) fn header_safe(token: &str) -> bool {
    !token.is_empty() && token.bytes().all(|b| b > b' ' && b < 0x7f)
}

fn check_url(what: &str, url: &str) -> Result<(), TokenError> {
    match reqwest::Url::parse(url) {
        Ok(u) if matches!(u.scheme(), "https" | "http") && u.host().is_some() => Ok(()),
        _ => Err(TokenError::Invalid(format!(
            "{what} must be an http(s) URL"
        ))),
    }
}

#[derive(Deserialize)]
struct TokenResponse {
    access_token: String,
    expires_in: u64,
}

#[derive(serde::Serialize)]
struct ScopeClaim<'a> {
    scope: &'a str,
}

/// The signed JWT assertion of a service-account key (RS256; `iss`, `aud` = `token_uri`,
/// `scope`, `iat`, `exp`).
pub fn gcp_assertion(key: &GcpServiceAccountKey) -> Result<String, TokenError> {
    use jwt_simple::prelude::*;
    let mut pair = RS256KeyPair::from_pem(key.private_key.expose_secret()).map_err(|_| {
        TokenError::Invalid("service-account.json: private_key is not an RSA private key".into())
    })?;
    if let Some(kid) = &key.private_key_id {
        pair = pair.with_key_id(kid);
    }
    let mut claims = Claims::with_custom_claims(
        ScopeClaim { scope: GCP_SCOPE },
        Duration::from_secs(ASSERTION_LIFETIME.as_secs()),
    )
    .with_issuer(&key.client_email)
    .with_audience(&key.token_uri);
    claims.invalid_before = None;
    pair.sign(claims)
        .map_err(|e| TokenError::Invalid(format!("signing the assertion: {e}")))
}

impl CloudTokens {
    pub fn new(azure_authority: &str) -> Result<Self, TokenError> {
        check_url("--azure-authority-url", azure_authority)?;
        let http = reqwest::Client::builder()
            .timeout(EXCHANGE_TIMEOUT)
            .build()
            .map_err(|e| TokenError::Invalid(format!("HTTP client: {e}")))?;
        Ok(CloudTokens {
            http,
            azure_authority: azure_authority.trim_end_matches('/').to_string(),
            gcp_federation: gcp_federation::GcpFederation::default(),
            slots: std::sync::Mutex::default(),
        })
    }

    /// Where workload identity federation may send and read tokens (`--gcp-*`).
    pub fn with_gcp_federation(
        mut self,
        federation: gcp_federation::GcpFederation,
    ) -> Result<Self, TokenError> {
        check_url("--gcp-sts-url", &federation.sts_url)?;
        check_url("--gcp-iam-credentials-url", &federation.iam_credentials_url)?;
        self.gcp_federation = federation;
        Ok(self)
    }

    /// The current token for `reference`: the cached one until its refresh time, else a new
    /// one. While another request exchanges it, the current token is served if still valid
    /// (else [`TokenError::Pending`]), never waited for; a failed exchange keeps serving the
    /// current token while it is valid.
    pub async fn token(
        &self,
        reference: &str,
        secret: &CloudSecret,
    ) -> Result<AccessToken, TokenError> {
        let fingerprint = secret.fingerprint();
        let slot = {
            let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            slots.entry(reference.to_string()).or_default().clone()
        };
        // The current token of this very secret, when still fresh (`fresh`) or only valid.
        let current = |fresh: bool| {
            let now = SystemTime::now();
            slot.current
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .filter(|c| c.fingerprint == fingerprint)
                .filter(|c| now < if fresh { c.refresh } else { c.expires })
                .map(|c| c.token.clone())
        };
        if let Some(t) = current(true) {
            return Ok(t);
        }
        let Ok(_exchanging) = slot.exchange.try_lock() else {
            return current(false).ok_or(TokenError::Pending);
        };
        // Another request may have just finished an exchange.
        if let Some(t) = current(true) {
            return Ok(t);
        }
        let now = SystemTime::now();
        match self.exchange(secret).await {
            Ok((value, lifetime)) => {
                let expires = now + lifetime;
                let token = AccessToken {
                    value: SecretString::from(value),
                    expires_at: expires
                        .duration_since(UNIX_EPOCH)
                        .map_or(0, |d| d.as_secs()),
                };
                tracing::info!(
                    credential = %reference,
                    lifetime_s = lifetime.as_secs(),
                    "obtained a provider access token"
                );
                *slot.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(Cached {
                    fingerprint,
                    token: token.clone(),
                    expires,
                    refresh: refresh_at(now, lifetime),
                });
                Ok(token)
            }
            Err(e) => match current(false) {
                Some(t) => {
                    tracing::warn!(credential = %reference, error = %e, "cannot refresh a provider access token; the current one is served until it expires");
                    Ok(t)
                }
                None => Err(e),
            },
        }
    }

    async fn exchange(&self, secret: &CloudSecret) -> Result<(String, Duration), TokenError> {
        let (endpoint, form): (String, Vec<(&str, String)>) = match secret {
            CloudSecret::GcpFederated(account) => {
                return gcp_federation::exchange(&self.http, account, &self.gcp_federation).await;
            }
            CloudSecret::Gcp(key) => (
                key.token_uri.clone(),
                vec![
                    ("grant_type", JWT_BEARER_GRANT.to_string()),
                    ("assertion", gcp_assertion(key)?),
                ],
            ),
            CloudSecret::Azure(a) => {
                if !a
                    .tenant_id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.'))
                    || a.tenant_id.is_empty()
                {
                    return Err(TokenError::Invalid(
                        "tenant-id must be a tenant id or domain (letters, digits, '-', '.')"
                            .into(),
                    ));
                }
                (
                    format!("{}/{}/oauth2/v2.0/token", self.azure_authority, a.tenant_id),
                    vec![
                        ("grant_type", "client_credentials".to_string()),
                        ("client_id", a.client_id.clone()),
                        ("client_secret", a.client_secret.expose_secret().to_string()),
                        ("scope", AZURE_SCOPE.to_string()),
                    ],
                )
            }
        };
        let failed = |reason: String| TokenError::Exchange {
            endpoint: endpoint.clone(),
            reason,
        };
        let response = self
            .http
            .post(&endpoint)
            .form(&form)
            .send()
            .await
            .map_err(|e| failed(e.without_url().to_string()))?;
        let status = response.status();
        let body = response
            .bytes()
            .await
            .map_err(|e| failed(e.without_url().to_string()))?;
        if !status.is_success() {
            // Token endpoints answer `{"error": …, "error_description": …}`: no secret in it.
            let text = String::from_utf8_lossy(&body);
            let text: String = text.chars().take(300).collect();
            return Err(failed(format!("{status}: {text}")));
        }
        let parsed: TokenResponse =
            serde_json::from_slice(&body).map_err(|e| failed(format!("unexpected answer: {e}")))?;
        if !header_safe(&parsed.access_token) {
            return Err(failed("the access token is not a header value".into()));
        }
        if parsed.expires_in == 0 {
            return Err(failed("the access token expires at once".into()));
        }
        Ok((parsed.access_token, Duration::from_secs(parsed.expires_in)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_replaced_well_before_they_expire() {
        let t0 = UNIX_EPOCH + Duration::from_secs(1_000_000);
        // An hour: at 48 minutes (a fifth before expiry, more than five minutes).
        assert_eq!(
            refresh_at(t0, Duration::from_secs(3600)),
            t0 + Duration::from_secs(2880)
        );
        // Ten minutes: five minutes before.
        assert_eq!(
            refresh_at(t0, Duration::from_secs(600)),
            t0 + Duration::from_secs(300)
        );
        // Four seconds: halfway.
        assert_eq!(
            refresh_at(t0, Duration::from_secs(4)),
            t0 + Duration::from_secs(2)
        );
        assert_eq!(refresh_at(t0, Duration::ZERO), t0);
    }

    fn key_json(pem: &str, token_uri: &str) -> String {
        serde_json::json!({
            "type": "service_account",
            "project_id": "proj-1",
            "private_key_id": "kid-1",
            "private_key": pem,
            "client_email": "gw@proj-1.iam.gserviceaccount.com",
            "token_uri": token_uri,
        })
        .to_string()
    }

    const PEM: &str = include_str!("../../tests/fixtures/test-gcp-service-account-key.pem");

    #[test]
    fn the_assertion_is_signed_by_the_key_for_its_token_uri() {
        use jwt_simple::prelude::*;
        let key =
            GcpServiceAccountKey::parse(&key_json(PEM, "https://oauth2.example/token")).unwrap();
        let jwt = gcp_assertion(&key).unwrap();
        let public = RS256KeyPair::from_pem(PEM).unwrap().public_key();
        let options = VerificationOptions {
            allowed_issuers: Some(HashSet::from_strings(&[
                "gw@proj-1.iam.gserviceaccount.com",
            ])),
            allowed_audiences: Some(HashSet::from_strings(&["https://oauth2.example/token"])),
            ..Default::default()
        };
        let claims = public
            .verify_token::<serde_json::Value>(&jwt, Some(options))
            .unwrap();
        assert_eq!(claims.custom["scope"], GCP_SCOPE);
        let lifetime = claims.expires_at.unwrap() - claims.issued_at.unwrap();
        assert_eq!(lifetime.as_secs(), 3600);
        let header = jwt.split('.').next().unwrap();
        let header: serde_json::Value = serde_json::from_slice(
            &base64::Engine::decode(&base64::engine::general_purpose::URL_SAFE_NO_PAD, header)
                .unwrap(),
        )
        .unwrap();
        assert_eq!(header["alg"], "RS256");
        assert_eq!(header["kid"], "kid-1");
        // A changed claim no longer verifies.
        let mut parts: Vec<&str> = jwt.split('.').collect();
        let forged = base64::Engine::encode(
            &base64::engine::general_purpose::URL_SAFE_NO_PAD,
            br#"{"iss":"x","aud":"https://oauth2.example/token","scope":"x"}"#,
        );
        parts[1] = &forged;
        assert!(
            public
                .verify_token::<serde_json::Value>(&parts.join("."), None)
                .is_err()
        );
    }

    #[test]
    fn bad_keys_are_refused_without_their_values() {
        for (json, why) in [
            ("{".to_string(), "service-account.json"),
            (
                key_json(PEM, "https://x/t").replace("service_account", "authorized_user"),
                "expected \"service_account\"",
            ),
            (key_json(PEM, "file:///etc/passwd"), "token_uri"),
        ] {
            let e = GcpServiceAccountKey::parse(&json).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
            assert!(!e.contains("PRIVATE KEY"), "{e}");
        }
        let key = GcpServiceAccountKey::parse(&key_json("not a pem", "https://x/t")).unwrap();
        assert!(gcp_assertion(&key).is_err());
        // Debug never shows the private key.
        assert!(!format!("{key:?}").contains("not a pem"));
    }

    /// A token endpoint speaking both grants: checks what it is sent, issues numbered tokens
    /// valid for `lifetime_s`, fails while `down`.
    struct Endpoint {
        url: String,
        issued: std::sync::Arc<std::sync::atomic::AtomicU32>,
        down: std::sync::Arc<std::sync::atomic::AtomicBool>,
        seen: std::sync::Arc<std::sync::Mutex<Vec<HashMap<String, String>>>>,
    }

    async fn endpoint(lifetime_s: u64) -> Endpoint {
        use axum::extract::{Form, State};
        use std::sync::atomic::Ordering;
        type Shared = (
            std::sync::Arc<std::sync::atomic::AtomicU32>,
            std::sync::Arc<std::sync::atomic::AtomicBool>,
            std::sync::Arc<std::sync::Mutex<Vec<HashMap<String, String>>>>,
            u64,
        );
        async fn token(
            State((issued, down, seen, lifetime_s)): State<Shared>,
            Form(form): Form<HashMap<String, String>>,
        ) -> axum::response::Response {
            use axum::response::IntoResponse;
            seen.lock().unwrap().push(form);
            if down.load(Ordering::SeqCst) {
                return (axum::http::StatusCode::SERVICE_UNAVAILABLE, "down").into_response();
            }
            let n = issued.fetch_add(1, Ordering::SeqCst) + 1;
            axum::Json(serde_json::json!({
                "access_token": format!("tok-{n}"), "token_type": "Bearer", "expires_in": lifetime_s
            }))
            .into_response()
        }
        let shared: Shared = (
            Default::default(),
            Default::default(),
            Default::default(),
            lifetime_s,
        );
        let app = axum::Router::new()
            .route("/gcp/token", axum::routing::post(token))
            .route("/{tenant}/oauth2/v2.0/token", axum::routing::post(token))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Endpoint {
            url,
            issued: shared.0,
            down: shared.1,
            seen: shared.2,
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_token_is_reused_then_replaced_before_expiry_and_kept_while_the_endpoint_is_down() {
        use std::sync::atomic::Ordering;
        let ep = endpoint(2).await;
        let tokens = CloudTokens::new(&ep.url).unwrap();
        let gcp = || {
            CloudSecret::Gcp(
                GcpServiceAccountKey::parse(&key_json(PEM, &format!("{}/gcp/token", ep.url)))
                    .unwrap(),
            )
        };
        let t1 = tokens.token("sa", &gcp()).await.unwrap();
        assert_eq!(t1.value.expose_secret(), "tok-1");
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        assert!(
            t1.expires_at > now && t1.expires_at <= now + 2,
            "{}",
            t1.expires_at
        );
        // The JWT bearer grant with a signed assertion.
        let form = ep.seen.lock().unwrap()[0].clone();
        assert_eq!(form["grant_type"], JWT_BEARER_GRANT);
        assert_eq!(form["assertion"].split('.').count(), 3);
        // Reused before its refresh time (half of 2 s).
        let again = tokens.token("sa", &gcp()).await.unwrap();
        assert_eq!(again.value.expose_secret(), "tok-1");
        assert_eq!(ep.issued.load(Ordering::SeqCst), 1);
        // After it: replaced.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let t2 = tokens.token("sa", &gcp()).await.unwrap();
        assert_eq!(t2.value.expose_secret(), "tok-2");
        // Refresh due, endpoint down: the current token while it is valid, then nothing.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        ep.down.store(true, Ordering::SeqCst);
        let kept = tokens.token("sa", &gcp()).await.unwrap();
        assert_eq!(kept.value.expose_secret(), "tok-2");
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert!(tokens.token("sa", &gcp()).await.is_err());
        ep.down.store(false, Ordering::SeqCst);
        assert_eq!(
            tokens
                .token("sa", &gcp())
                .await
                .unwrap()
                .value
                .expose_secret(),
            "tok-3"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn entra_gets_the_client_credentials_grant_and_a_rotated_secret_is_exchanged_at_once() {
        use std::sync::atomic::Ordering;
        let ep = endpoint(3600).await;
        let tokens = CloudTokens::new(&format!("{}/", ep.url)).unwrap();
        let azure = |secret: &str| {
            CloudSecret::Azure(AzureClientCredentials {
                tenant_id: "contoso.onmicrosoft.com".into(),
                client_id: "app-1".into(),
                client_secret: SecretString::from(secret),
            })
        };
        let t = tokens.token("az", &azure("s1")).await.unwrap();
        assert_eq!(t.value.expose_secret(), "tok-1");
        let form = ep.seen.lock().unwrap()[0].clone();
        assert_eq!(form["grant_type"], "client_credentials");
        assert_eq!(form["client_id"], "app-1");
        assert_eq!(form["client_secret"], "s1");
        assert_eq!(form["scope"], AZURE_SCOPE);
        assert_eq!(
            tokens
                .token("az", &azure("s1"))
                .await
                .unwrap()
                .value
                .expose_secret(),
            "tok-1"
        );
        // A rotated client secret: a new token now, not at the old one's refresh time.
        assert_eq!(
            tokens
                .token("az", &azure("s2"))
                .await
                .unwrap()
                .value
                .expose_secret(),
            "tok-2"
        );
        assert_eq!(ep.seen.lock().unwrap()[1]["client_secret"], "s2");
        assert_eq!(ep.issued.load(Ordering::SeqCst), 2);
        // A tenant that would change the URL's path is refused before any request.
        let bad = CloudSecret::Azure(AzureClientCredentials {
            tenant_id: "../x".into(),
            client_id: "app-1".into(),
            client_secret: SecretString::from("s"),
        });
        assert!(matches!(
            tokens.token("bad", &bad).await,
            Err(TokenError::Invalid(_))
        ));
        assert_eq!(ep.seen.lock().unwrap().len(), 2);
    }

    /// While one request exchanges a credential, another gets the current token at once (or,
    /// before the first, `Pending`), never waits for the token endpoint.
    #[tokio::test(flavor = "current_thread")]
    async fn a_slow_exchange_is_never_waited_for() {
        // A token endpoint that never answers.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
            }
        });
        let tokens = std::sync::Arc::new(CloudTokens::new(&url).unwrap());
        let secret = || {
            CloudSecret::Azure(AzureClientCredentials {
                tenant_id: "t".into(),
                client_id: "c".into(),
                client_secret: SecretString::from("s"),
            })
        };
        let slow = {
            let tokens = tokens.clone();
            tokio::spawn(async move { tokens.token("az", &secret()).await.is_ok() })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        let started = std::time::Instant::now();
        assert!(matches!(
            tokens.token("az", &secret()).await,
            Err(TokenError::Pending)
        ));
        assert!(started.elapsed() < Duration::from_millis(100));
        slow.abort();
    }
}
