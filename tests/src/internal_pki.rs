//! The local stack's PKI for the companion's internal listener (mutual TLS), generated at start
//! as `scripts/deploy.sh` generates the cluster's: a private CA, the listener's certificate
//! (for [`COMPANION_SERVER_NAME`] and 127.0.0.1) and the gateway's client certificate (URI SAN
//! [`GATEWAY_CLIENT_NAME`]), which every Envoy of the stack presents on the companion cluster.
//! The companion admits only that name from that CA; the keys stay in the stack's directory
//! (mode 0600).

use anyhow::{Context, Result};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// The gateway's identity on the internal listener (the same name the cluster deploy issues).
pub const GATEWAY_CLIENT_NAME: &str = "spiffe://maas.internal/gateway";
/// The name the companion's internal certificate carries and Envoy checks (SNI and SAN).
pub const COMPANION_SERVER_NAME: &str = "maas-companion.local";

/// A CA and the issuer that signs with it.
pub struct Ca {
    pub pem: String,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

impl Ca {
    pub fn new(name: &str) -> Result<Ca> {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let key = rcgen::KeyPair::generate()?;
        let pem = params.self_signed(&key)?.pem();
        Ok(Ca {
            pem,
            issuer: rcgen::Issuer::new(params, key),
        })
    }

    /// A certificate and key (PEM) for `sans` (`scheme://…` as URIs, addresses as IPs, the rest
    /// as DNS names), for a client or a server.
    pub fn issue(&self, sans: &[&str], client: bool) -> Result<(String, String)> {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        params.subject_alt_names = sans
            .iter()
            .map(|san| -> Result<rcgen::SanType> {
                Ok(if san.contains("://") {
                    rcgen::SanType::URI(rcgen::string::Ia5String::try_from(*san)?)
                } else if let Ok(ip) = san.parse() {
                    rcgen::SanType::IpAddress(ip)
                } else {
                    rcgen::SanType::DnsName(rcgen::string::Ia5String::try_from(*san)?)
                })
            })
            .collect::<Result<_>>()?;
        params.extended_key_usages = vec![if client {
            rcgen::ExtendedKeyUsagePurpose::ClientAuth
        } else {
            rcgen::ExtendedKeyUsagePurpose::ServerAuth
        }];
        let key = rcgen::KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// A client certificate and key for `sans` as one PEM (a reqwest identity).
    pub fn client_identity(&self, sans: &[&str]) -> Result<String> {
        let (cert, key) = self.issue(sans, true)?;
        Ok(format!("{cert}{key}"))
    }
}

/// The files of the internal listener's mutual TLS.
pub struct InternalPki {
    pub ca: Ca,
    /// The CA certificate: the companion's `--internal-client-ca`, Envoy's trusted CA.
    pub ca_file: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub gateway_cert: PathBuf,
    pub gateway_key: PathBuf,
}

fn write(dir: &Path, name: &str, text: &str, mode: u32) -> Result<PathBuf> {
    let path = dir.join(name);
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))?;
    Ok(path)
}

impl InternalPki {
    /// Generates the CA and both certificates into `dir` (created).
    pub fn generate(dir: &Path) -> Result<InternalPki> {
        std::fs::create_dir_all(dir)?;
        let ca = Ca::new("maas-internal local CA")?;
        let (server_cert, server_key) =
            ca.issue(&[COMPANION_SERVER_NAME, "127.0.0.1", "localhost"], false)?;
        let (gateway_cert, gateway_key) = ca.issue(&[GATEWAY_CLIENT_NAME], true)?;
        Ok(InternalPki {
            ca_file: write(dir, "ca.crt", &ca.pem, 0o644)?,
            server_cert: write(dir, "companion-internal.crt", &server_cert, 0o644)?,
            server_key: write(dir, "companion-internal.key", &server_key, 0o600)?,
            gateway_cert: write(dir, "gateway-client.crt", &gateway_cert, 0o644)?,
            gateway_key: write(dir, "gateway-client.key", &gateway_key, 0o600)?,
            ca,
        })
    }

    /// The companion's flags: mutual TLS, the gateway the one allowed caller.
    pub fn companion_args(&self) -> Vec<String> {
        vec![
            format!("--internal-client-ca={}", self.ca_file.display()),
            format!("--internal-tls-cert={}", self.server_cert.display()),
            format!("--internal-tls-key={}", self.server_key.display()),
            format!("--internal-client-names={GATEWAY_CLIENT_NAME}"),
        ]
    }

    /// What Envoy's companion cluster presents and checks.
    pub fn envoy_tls(&self) -> crate::envoy_config::CompanionTls {
        crate::envoy_config::CompanionTls {
            client_cert: Some(self.gateway_cert.clone()),
            client_key: Some(self.gateway_key.clone()),
            ca: self.ca_file.clone(),
            server_name: COMPANION_SERVER_NAME.to_string(),
        }
    }

    /// A client trusting the CA, presenting `identity` (PEM certificate and key) if any.
    pub fn client(&self, identity: Option<&str>) -> Result<reqwest::Client> {
        let mut b = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .timeout(std::time::Duration::from_secs(60))
            .add_root_certificate(reqwest::Certificate::from_pem(self.ca.pem.as_bytes())?);
        if let Some(identity) = identity {
            b = b.identity(reqwest::Identity::from_pem(identity.as_bytes())?);
        }
        Ok(b.build()?)
    }

    /// The gateway's client (its certificate): what the stack's Envoys present.
    pub fn gateway_client(&self) -> Result<reqwest::Client> {
        let identity = format!(
            "{}{}",
            std::fs::read_to_string(&self.gateway_cert)?,
            std::fs::read_to_string(&self.gateway_key)?
        );
        self.client(Some(&identity))
    }
}
