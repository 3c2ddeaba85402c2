//! Who may call the internal listener: mutual TLS.
//!
//! The internal listener serves every provider key (`/internal/v1/credentials`), writes usage
//! rows and releases lease counters for any subject, so reaching the port must not be enough:
//! the caller proves who it is with a client certificate that chains to the configured CA
//! bundle (`--internal-client-ca`) and, when names are configured (`--internal-client-names`),
//! carries one of them as a subject alternative name (a URI such as a SPIFFE id, or a DNS
//! name). A caller without one never gets an HTTP exchange: its handshake fails. The
//! NetworkPolicy stays in front as the second wall.
//!
//! Only certificates (public) are ever named in errors and logs; the private key file's
//! contents never are.

use crate::settings::{ClientName, InternalMtls};
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{
    CertificateError, DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig,
    SignatureScheme,
};
use std::path::Path;
use std::sync::Arc;

/// A setting of the internal listener's TLS that cannot be used; the message names the flag.
#[derive(Debug, thiserror::Error)]
#[error("{flag} {path}: {why}")]
pub struct InternalTlsError {
    flag: &'static str,
    path: String,
    why: String,
}

impl InternalTlsError {
    fn new(flag: &'static str, path: &Path, why: impl Into<String>) -> Self {
        InternalTlsError {
            flag,
            path: path.display().to_string(),
            why: why.into(),
        }
    }
}

/// Every certificate of a PEM file (a CA bundle or a chain), at least one.
fn certificates(
    flag: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, InternalTlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
        .map_err(|e| InternalTlsError::new(flag, path, pem_error(&e)))?;
    if certs.is_empty() {
        return Err(InternalTlsError::new(
            flag,
            path,
            "no PEM CERTIFICATE in it",
        ));
    }
    Ok(certs)
}

/// Why a PEM file could not be read; for the key file, nothing of its contents.
fn pem_error(e: &pem::Error) -> String {
    match e {
        pem::Error::Io(io) => format!("cannot read it ({io})"),
        pem::Error::NoItemsFound => "nothing of the expected kind in it".to_string(),
        _ => "not valid PEM".to_string(),
    }
}

/// The internal listener's rustls configuration: its certificate, and a verifier that requires
/// a client certificate from the CA bundle (and one of the names, when configured).
pub fn server_config(settings: &InternalMtls) -> Result<ServerConfig, InternalTlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let ca_flag = "--internal-client-ca";
    let mut roots = RootCertStore::empty();
    for cert in certificates(ca_flag, &settings.client_ca)? {
        roots.add(cert).map_err(|e| {
            InternalTlsError::new(
                ca_flag,
                &settings.client_ca,
                format!("not a usable CA certificate: {e}"),
            )
        })?;
    }
    let webpki = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| InternalTlsError::new(ca_flag, &settings.client_ca, e.to_string()))?;
    let verifier: Arc<dyn ClientCertVerifier> = if settings.client_names.is_empty() {
        webpki
    } else {
        Arc::new(NamedClients {
            inner: webpki,
            allowed: settings.client_names.clone(),
        })
    };

    let (cert_flag, key_flag) = settings.server_flags;
    let chain = certificates(cert_flag, &settings.server.cert)?;
    let key = PrivateKeyDer::from_pem_file(&settings.server.key).map_err(|e| {
        let why = match e {
            pem::Error::NoItemsFound => "no PEM private key in it".to_string(),
            other => pem_error(&other),
        };
        InternalTlsError::new(key_flag, &settings.server.key, why)
    })?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| InternalTlsError::new(cert_flag, &settings.server.cert, e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| {
            InternalTlsError::new(
                cert_flag,
                &settings.server.cert,
                format!("unusable with {key_flag}: {e}"),
            )
        })?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

/// The subject alternative names (URI and DNS) of a certificate; `None` when it does not parse.
fn subject_alt_names(cert: &CertificateDer<'_>) -> Option<Vec<ClientName>> {
    use x509_parser::extensions::GeneralName;
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    let Some(san) = parsed.subject_alternative_name().ok()? else {
        return Some(Vec::new());
    };
    Some(
        san.value
            .general_names
            .iter()
            .filter_map(|name| match name {
                GeneralName::URI(uri) => Some(ClientName::Uri((*uri).to_string())),
                GeneralName::DNSName(dns) => Some(ClientName::Dns(dns.to_ascii_lowercase())),
                _ => None,
            })
            .collect(),
    )
}

/// Whether a certificate names one of `allowed` (a caller is admitted by any of its names).
pub fn names_an_allowed_client(cert: &CertificateDer<'_>, allowed: &[ClientName]) -> bool {
    subject_alt_names(cert).is_some_and(|names| names.iter().any(|n| allowed.contains(n)))
}

/// The CA check first, then the names: a certificate from the CA that names no allowed caller
/// is refused like one from another CA.
#[derive(Debug)]
struct NamedClients {
    inner: Arc<dyn ClientCertVerifier>,
    allowed: Vec<ClientName>,
}

impl ClientCertVerifier for NamedClients {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        if names_an_allowed_client(end_entity, &self.allowed) {
            return Ok(verified);
        }
        let presented: Vec<String> = subject_alt_names(end_entity)
            .unwrap_or_default()
            .iter()
            .map(ToString::to_string)
            .collect();
        tracing::warn!(
            ?presented,
            "internal listener: a client certificate from the CA names no allowed caller (--internal-client-names)"
        );
        Err(rustls::Error::InvalidCertificate(
            CertificateError::ApplicationVerificationFailure,
        ))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert_with(sans: Vec<rcgen::SanType>) -> CertificateDer<'static> {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = sans;
        let key = rcgen::KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().clone()
    }

    fn uri(u: &str) -> rcgen::SanType {
        rcgen::SanType::URI(rcgen::string::Ia5String::try_from(u).unwrap())
    }

    fn dns(d: &str) -> rcgen::SanType {
        rcgen::SanType::DnsName(rcgen::string::Ia5String::try_from(d).unwrap())
    }

    #[test]
    fn a_caller_is_admitted_by_any_of_its_names_uris_exactly_dns_names_in_any_case() {
        let gateway = "spiffe://cluster.local/ns/openshift-ingress/sa/gw";
        let allowed = [
            ClientName::Uri(gateway.into()),
            ClientName::Dns("cleanup.maas.internal".into()),
        ];
        let admitted = |sans| names_an_allowed_client(&cert_with(sans), &allowed);
        assert!(admitted(vec![dns("other.example"), uri(gateway)]));
        assert!(admitted(vec![dns("Cleanup.MAAS.internal")]));
        assert!(
            !admitted(vec![uri(&gateway.to_uppercase())]),
            "URIs exactly"
        );
        assert!(!admitted(vec![uri(&format!("{gateway}/x"))]), "no prefixes");
        assert!(!admitted(vec![dns("gw")]));
        assert!(!admitted(vec![uri(
            "spiffe://cluster.local/ns/openshift-ingress/sa"
        )]));
        assert!(!admitted(vec![]), "a certificate without names");
        // A URI SAN is not a DNS name, whatever it spells.
        assert!(!names_an_allowed_client(
            &cert_with(vec![uri("cleanup.maas.internal")]),
            &allowed
        ));
        assert!(
            !names_an_allowed_client(&CertificateDer::from(vec![0u8; 16]), &allowed),
            "a certificate that does not parse names nobody"
        );
    }
}
