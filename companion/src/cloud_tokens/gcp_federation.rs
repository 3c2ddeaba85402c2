//! Google workload identity federation (issue 29): a Vertex model's access tokens without a
//! long-lived service-account key. The Secret holds Google's credential configuration file
//! (`credential-config.json`, `"type": "external_account"`, as `gcloud iam
//! workload-identity-pools create-cred-config` writes it); the companion reads its own
//! projected Kubernetes service-account token from the file the configuration names, exchanges
//! it at Google's Security Token Service (RFC 8693 token exchange) for a federated token, and,
//! when the configuration names a service account to impersonate, exchanges that at the IAM
//! Credentials API (`generateAccessToken`) for the service account's access token. The tokens
//! are rotated as the key-based ones are ([`crate::cloud_tokens`]).
//!
//! What a Secret author may make the companion do is bounded by flags, not by the Secret: the
//! pod's token goes only to `--gcp-sts-url`, the federated token only to
//! `--gcp-iam-credentials-url`, and the token file is read only under
//! `--gcp-subject-token-dir` (a Secret naming `/etc/…` or another STS is refused, naming the
//! field), so writing a Secret cannot turn the companion into a file reader or a token sender
//! to a host of the author's choosing.

use super::{GCP_SCOPE, TokenError, header_safe};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// RFC 8693's grant type.
pub const TOKEN_EXCHANGE_GRANT: &str = "urn:ietf:params:oauth:grant-type:token-exchange";
/// What the STS is asked for.
pub const ACCESS_TOKEN_TYPE: &str = "urn:ietf:params:oauth:token-type:access_token";
/// The subject token types a Kubernetes service-account token can be.
const SUBJECT_TOKEN_TYPES: [&str; 2] = [
    "urn:ietf:params:oauth:token-type:jwt",
    "urn:ietf:params:oauth:token-type:id_token",
];
/// The largest token file read (a projected token is about 1 KiB).
const MAX_SUBJECT_TOKEN_BYTES: u64 = 64 * 1024;
/// Google's default and maximum impersonated token lifetime without an org policy change.
const DEFAULT_LIFETIME_S: u64 = 3600;
const MAX_LIFETIME_S: u64 = 43_200;

/// Where federation may send tokens and read the pod's token (`--gcp-*` flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GcpFederation {
    /// The only STS token endpoint a configuration may name (`token_url`).
    pub sts_url: String,
    /// The IAM Credentials API base a configuration's impersonation URL must be under.
    pub iam_credentials_url: String,
    /// The directory the subject token file must be in.
    pub subject_token_dir: PathBuf,
}

impl Default for GcpFederation {
    fn default() -> Self {
        GcpFederation {
            sts_url: "https://sts.googleapis.com/v1/token".into(),
            iam_credentials_url: "https://iamcredentials.googleapis.com".into(),
            subject_token_dir: PathBuf::from("/var/run/secrets/tokens"),
        }
    }
}

/// The fields of Google's `external_account` credential configuration the exchange uses
/// (others, such as `universe_domain` or `quota_project_id`, are ignored).
#[derive(Debug, Deserialize)]
pub struct ExternalAccount {
    #[serde(rename = "type")]
    kind: String,
    audience: String,
    subject_token_type: String,
    token_url: String,
    #[serde(default)]
    service_account_impersonation_url: Option<String>,
    #[serde(default)]
    service_account_impersonation: Option<Impersonation>,
    credential_source: CredentialSource,
    #[serde(skip)]
    digest: [u8; 32],
}

#[derive(Debug, Deserialize)]
struct Impersonation {
    #[serde(default)]
    token_lifetime_seconds: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct CredentialSource {
    #[serde(default)]
    file: Option<String>,
    #[serde(default)]
    url: Option<serde_json::Value>,
    #[serde(default)]
    executable: Option<serde_json::Value>,
    #[serde(default)]
    environment_id: Option<serde_json::Value>,
    #[serde(default)]
    format: Option<SourceFormat>,
}

#[derive(Debug, Deserialize)]
struct SourceFormat {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    subject_token_field_name: Option<String>,
}

const FILE: &str = "credential-config.json";

fn invalid(why: impl std::fmt::Display) -> TokenError {
    TokenError::Invalid(format!("{FILE}: {why}"))
}

impl ExternalAccount {
    /// Parses a credential configuration (the Secret's `credential-config.json`): its shape
    /// only; where it may send and read is checked against the flags at each exchange.
    pub fn parse(json: &str) -> Result<Self, TokenError> {
        // serde_json's message names the position, never the value.
        let mut account: ExternalAccount = serde_json::from_str(json).map_err(invalid)?;
        if account.kind != "external_account" {
            return Err(invalid(format_args!(
                "type {:?}, expected \"external_account\" (a service-account key goes in service-account.json)",
                account.kind
            )));
        }
        if !SUBJECT_TOKEN_TYPES.contains(&account.subject_token_type.as_str()) {
            return Err(invalid(
                "subject_token_type must be urn:ietf:params:oauth:token-type:jwt or …:id_token (a Kubernetes service-account token)",
            ));
        }
        if !account.audience.starts_with("//iam.googleapis.com/") {
            return Err(invalid(
                "audience must be a workload identity pool provider (//iam.googleapis.com/…)",
            ));
        }
        let source = &account.credential_source;
        for (field, set) in [
            ("url", source.url.is_some()),
            ("executable", source.executable.is_some()),
            ("environment_id", source.environment_id.is_some()),
        ] {
            if set {
                return Err(invalid(format_args!(
                    "credential_source.{field} is not supported: only credential_source.file (a projected service-account token)"
                )));
            }
        }
        if source.file.as_deref().is_none_or(str::is_empty) {
            return Err(invalid("credential_source.file is required"));
        }
        match &source.format {
            None => {}
            Some(f) if f.kind == "text" => {}
            Some(f) if f.kind == "json" && f.subject_token_field_name.is_some() => {}
            Some(_) => {
                return Err(invalid(
                    "credential_source.format.type must be text, or json with subject_token_field_name",
                ));
            }
        }
        if let Some(s) = account
            .service_account_impersonation
            .as_ref()
            .and_then(|i| i.token_lifetime_seconds)
            && !(600..=MAX_LIFETIME_S).contains(&s)
        {
            return Err(invalid(
                "service_account_impersonation.token_lifetime_seconds must be from 600 to 43200",
            ));
        }
        account.digest = Sha256::digest(json.as_bytes()).into();
        Ok(account)
    }

    /// What identifies this configuration (a changed one is exchanged at once).
    pub fn digest(&self) -> [u8; 32] {
        self.digest
    }
}

/// The service account an impersonation URL names, when it is the IAM Credentials API's
/// `generateAccessToken` under `base` for one service account.
fn impersonated_account<'a>(url: &'a str, base: &str) -> Option<&'a str> {
    let rest = url
        .strip_prefix(base.trim_end_matches('/'))?
        .strip_prefix("/v1/projects/-/serviceAccounts/")?;
    let email = rest.strip_suffix(":generateAccessToken")?;
    let safe = !email.is_empty()
        && email.contains('@')
        && email
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'@' | b'.' | b'-' | b'_'));
    safe.then_some(email)
}

/// The subject token: the file under `dir` (after symlinks: kubelet's projected volumes are
/// symlinks inside their directory), at most 64 KiB, read again at every exchange because
/// kubelet rotates it.
fn subject_token(account: &ExternalAccount, dir: &Path) -> Result<String, TokenError> {
    let source = &account.credential_source;
    let named = source.file.as_deref().unwrap_or_default();
    let outside = || {
        invalid(format_args!(
            "credential_source.file must be a file under {} (--gcp-subject-token-dir)",
            dir.display()
        ))
    };
    let dir = dir.canonicalize().map_err(|_| outside())?;
    let path = Path::new(named)
        .canonicalize()
        .map_err(|e| invalid(format_args!("credential_source.file: {e}")))?;
    if !path.starts_with(&dir) {
        return Err(outside());
    }
    let meta = std::fs::metadata(&path)
        .map_err(|e| invalid(format_args!("credential_source.file: {e}")))?;
    if !meta.is_file() || meta.len() > MAX_SUBJECT_TOKEN_BYTES {
        return Err(invalid(
            "credential_source.file must be a regular file of at most 64 KiB",
        ));
    }
    let text = std::fs::read_to_string(&path)
        .map_err(|e| invalid(format_args!("credential_source.file: {e}")))?;
    let token = match &source.format {
        Some(f) if f.kind == "json" => {
            let field = f.subject_token_field_name.as_deref().unwrap_or_default();
            serde_json::from_str::<serde_json::Value>(&text)
                .ok()
                .and_then(|v| v.get(field).and_then(|t| t.as_str()).map(str::to_string))
                .ok_or_else(|| {
                    invalid("credential_source.file is not JSON with the subject_token_field_name")
                })?
        }
        _ => text.trim().to_string(),
    };
    if token.is_empty() {
        return Err(invalid("credential_source.file is empty"));
    }
    Ok(token)
}

#[derive(Deserialize)]
struct StsAnswer {
    access_token: String,
    #[serde(default)]
    expires_in: Option<u64>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ImpersonationAnswer {
    access_token: String,
    expire_time: String,
}

/// POSTs and reads a JSON answer; a refusal's body (Google's `{"error": …}`, no secret in it)
/// is cut to 300 characters into the error.
async fn post_json<T: serde::de::DeserializeOwned>(
    request: reqwest::RequestBuilder,
    endpoint: &str,
) -> Result<T, TokenError> {
    let failed = |reason: String| TokenError::Exchange {
        endpoint: endpoint.to_string(),
        reason,
    };
    let response = request
        .send()
        .await
        .map_err(|e| failed(e.without_url().to_string()))?;
    let status = response.status();
    let body = response
        .bytes()
        .await
        .map_err(|e| failed(e.without_url().to_string()))?;
    if !status.is_success() {
        let text: String = String::from_utf8_lossy(&body).chars().take(300).collect();
        return Err(failed(format!("{status}: {text}")));
    }
    serde_json::from_slice(&body).map_err(|e| failed(format!("unexpected answer: {e}")))
}

/// One exchange: the pod's token at the STS, then, when configured, the impersonation. The
/// access token and its lifetime.
pub async fn exchange(
    http: &reqwest::Client,
    account: &ExternalAccount,
    federation: &GcpFederation,
) -> Result<(String, Duration), TokenError> {
    if account.token_url.trim_end_matches('/') != federation.sts_url.trim_end_matches('/') {
        return Err(invalid(format_args!(
            "token_url must be {} (--gcp-sts-url): the pod's token is sent to no other endpoint",
            federation.sts_url
        )));
    }
    let impersonate = match &account.service_account_impersonation_url {
        None => None,
        Some(url) => match impersonated_account(url, &federation.iam_credentials_url) {
            Some(_) => Some(url.as_str()),
            None => {
                return Err(invalid(format_args!(
                    "service_account_impersonation_url must be {}/v1/projects/-/serviceAccounts/<email>:generateAccessToken (--gcp-iam-credentials-url)",
                    federation.iam_credentials_url.trim_end_matches('/')
                )));
            }
        },
    };
    let subject = subject_token(account, &federation.subject_token_dir)?;
    let sts: StsAnswer = post_json(
        http.post(&federation.sts_url).form(&[
            ("grant_type", TOKEN_EXCHANGE_GRANT),
            ("audience", account.audience.as_str()),
            ("scope", GCP_SCOPE),
            ("requested_token_type", ACCESS_TOKEN_TYPE),
            ("subject_token", subject.as_str()),
            ("subject_token_type", account.subject_token_type.as_str()),
        ]),
        &federation.sts_url,
    )
    .await?;
    let sts_failed = |reason: &str| TokenError::Exchange {
        endpoint: federation.sts_url.clone(),
        reason: reason.to_string(),
    };
    if !header_safe(&sts.access_token) {
        return Err(sts_failed("the federated token is not a header value"));
    }
    let Some(url) = impersonate else {
        // The federated token itself (direct resource access granted to the pool's principal).
        let lifetime = sts
            .expires_in
            .filter(|s| *s > 0)
            .ok_or_else(|| sts_failed("no expires_in"))?;
        return Ok((sts.access_token, Duration::from_secs(lifetime)));
    };
    let lifetime = account
        .service_account_impersonation
        .as_ref()
        .and_then(|i| i.token_lifetime_seconds)
        .unwrap_or(DEFAULT_LIFETIME_S);
    let asked_at = chrono::Utc::now();
    let answer: ImpersonationAnswer = post_json(
        http.post(url)
            .bearer_auth(&sts.access_token)
            .json(&serde_json::json!({"scope": [GCP_SCOPE], "lifetime": format!("{lifetime}s")})),
        url,
    )
    .await?;
    let failed = |reason: &str| TokenError::Exchange {
        endpoint: url.to_string(),
        reason: reason.to_string(),
    };
    if !header_safe(&answer.access_token) {
        return Err(failed("the access token is not a header value"));
    }
    let expires = chrono::DateTime::parse_from_rfc3339(&answer.expire_time)
        .map_err(|_| failed("expireTime is not an RFC 3339 time"))?;
    let left = (expires.with_timezone(&chrono::Utc) - asked_at)
        .to_std()
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| failed("the access token has expired already"))?;
    Ok((answer.access_token, left))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(file: &str, sts: &str, impersonation: Option<&str>) -> String {
        let mut v = serde_json::json!({
            "universe_domain": "googleapis.com",
            "type": "external_account",
            "audience": "//iam.googleapis.com/projects/123/locations/global/workloadIdentityPools/ocp/providers/ocp",
            "subject_token_type": "urn:ietf:params:oauth:token-type:jwt",
            "token_url": sts,
            "credential_source": {"file": file, "format": {"type": "text"}},
        });
        if let Some(url) = impersonation {
            v["service_account_impersonation_url"] = url.into();
        }
        v.to_string()
    }

    #[test]
    fn only_a_file_sourced_kubernetes_token_configuration_parses() {
        let ok = config(
            "/var/run/secrets/tokens/gcp/token",
            "https://sts.googleapis.com/v1/token",
            None,
        );
        assert!(ExternalAccount::parse(&ok).is_ok());
        let mut v: serde_json::Value = serde_json::from_str(&ok).unwrap();
        let refused = |v: &serde_json::Value, needle: &str| {
            let e = ExternalAccount::parse(&v.to_string())
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{e}");
            assert!(e.starts_with("credential-config.json: "), "{e}");
        };
        let mut key = v.clone();
        key["type"] = "service_account".into();
        refused(&key, "expected \"external_account\"");
        let mut saml = v.clone();
        saml["subject_token_type"] = "urn:ietf:params:oauth:token-type:saml2".into();
        refused(&saml, "subject_token_type");
        let mut url = v.clone();
        url["credential_source"]["url"] = "http://169.254.169.254/token".into();
        refused(&url, "credential_source.url is not supported");
        let mut exe = v.clone();
        exe["credential_source"] = serde_json::json!({"executable": {"command": "/bin/sh"}});
        refused(&exe, "credential_source.executable is not supported");
        let mut aud = v.clone();
        aud["audience"] = "https://evil.example".into();
        refused(&aud, "audience");
        let mut life = v.clone();
        life["service_account_impersonation"] = serde_json::json!({"token_lifetime_seconds": 60});
        refused(&life, "token_lifetime_seconds");
        v["credential_source"]["format"] = serde_json::json!({"type": "json"});
        refused(&v, "subject_token_field_name");
    }

    #[test]
    fn the_impersonation_url_names_one_service_account_under_the_configured_api() {
        let base = "https://iamcredentials.googleapis.com";
        assert_eq!(
            impersonated_account(
                "https://iamcredentials.googleapis.com/v1/projects/-/serviceAccounts/vx@p-1.iam.gserviceaccount.com:generateAccessToken",
                base
            ),
            Some("vx@p-1.iam.gserviceaccount.com")
        );
        for bad in [
            "https://evil.example/v1/projects/-/serviceAccounts/a@b.c:generateAccessToken",
            "https://iamcredentials.googleapis.com.evil.example/v1/projects/-/serviceAccounts/a@b.c:generateAccessToken",
            "https://iamcredentials.googleapis.com/v1/projects/-/serviceAccounts/a@b.c:signJwt",
            "https://iamcredentials.googleapis.com/v1/projects/-/serviceAccounts/a/../b@c:generateAccessToken",
            "https://iamcredentials.googleapis.com/v1/projects/-/serviceAccounts/:generateAccessToken",
        ] {
            assert_eq!(impersonated_account(bad, base), None, "{bad}");
        }
    }

    #[test]
    fn the_token_file_is_read_only_under_the_subject_token_dir() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("tokens");
        std::fs::create_dir_all(dir.join("..2026_12_03")).unwrap();
        std::fs::write(dir.join("..2026_12_03/token"), "pod-token-1\n").unwrap();
        // kubelet's layout: token -> ..data/token, ..data -> ..<timestamp>.
        std::os::unix::fs::symlink("..2026_12_03", dir.join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/token", dir.join("token")).unwrap();
        std::fs::write(root.path().join("secret"), "not yours").unwrap();
        let account = |file: &Path| {
            ExternalAccount::parse(&config(file.to_str().unwrap(), "https://sts", None)).unwrap()
        };
        assert_eq!(
            subject_token(&account(&dir.join("token")), &dir).unwrap(),
            "pod-token-1"
        );
        for outside in [
            root.path().join("secret"),
            dir.join("../secret"),
            PathBuf::from("/etc/hostname"),
        ] {
            let e = subject_token(&account(&outside), &dir)
                .unwrap_err()
                .to_string();
            assert!(e.contains("--gcp-subject-token-dir"), "{outside:?}: {e}");
        }
        // A link inside the directory that leads out of it is outside too.
        std::os::unix::fs::symlink(root.path().join("secret"), dir.join("escape")).unwrap();
        let e = subject_token(&account(&dir.join("escape")), &dir)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--gcp-subject-token-dir"), "{e}");
        std::fs::write(dir.join("big"), vec![b'a'; 70_000]).unwrap();
        let e = subject_token(&account(&dir.join("big")), &dir)
            .unwrap_err()
            .to_string();
        assert!(e.contains("64 KiB"), "{e}");
        std::fs::write(dir.join("token.json"), r#"{"id_token": "pod-token-2"}"#).unwrap();
        let mut json: serde_json::Value = serde_json::from_str(&config(
            dir.join("token.json").to_str().unwrap(),
            "https://sts",
            None,
        ))
        .unwrap();
        json["credential_source"]["format"] =
            serde_json::json!({"type": "json", "subject_token_field_name": "id_token"});
        let a = ExternalAccount::parse(&json.to_string()).unwrap();
        assert_eq!(subject_token(&a, &dir).unwrap(), "pod-token-2");
    }

    /// A configuration naming another STS or another impersonation API is refused before
    /// anything is read or sent (the endpoints here do not exist: a request would fail
    /// differently).
    #[tokio::test(flavor = "current_thread")]
    async fn tokens_go_only_to_the_configured_endpoints() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), "pod-token").unwrap();
        let federation = GcpFederation {
            sts_url: "http://127.0.0.1:9/sts".into(),
            iam_credentials_url: "http://127.0.0.1:9/iam".into(),
            subject_token_dir: dir.path().to_path_buf(),
        };
        let file = dir.path().join("token");
        let http = reqwest::Client::new();
        let other_sts = ExternalAccount::parse(&config(
            file.to_str().unwrap(),
            "https://attacker.example/token",
            None,
        ))
        .unwrap();
        let e = exchange(&http, &other_sts, &federation)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("token_url must be http://127.0.0.1:9/sts (--gcp-sts-url)"),
            "{e}"
        );
        let other_iam = ExternalAccount::parse(&config(
            file.to_str().unwrap(),
            "http://127.0.0.1:9/sts/",
            Some(
                "https://attacker.example/v1/projects/-/serviceAccounts/a@b.c:generateAccessToken",
            ),
        ))
        .unwrap();
        let e = exchange(&http, &other_iam, &federation)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("service_account_impersonation_url must be http://127.0.0.1:9/iam/v1/projects/-/serviceAccounts/<email>:generateAccessToken"), "{e}");
        // The allowed endpoints: the exchange is tried (and fails to connect).
        let ok = ExternalAccount::parse(&config(
            file.to_str().unwrap(),
            "http://127.0.0.1:9/sts",
            Some("http://127.0.0.1:9/iam/v1/projects/-/serviceAccounts/a@b.c:generateAccessToken"),
        ))
        .unwrap();
        let e = exchange(&http, &ok, &federation).await.unwrap_err();
        assert!(matches!(e, TokenError::Exchange { .. }), "{e}");
    }
}
