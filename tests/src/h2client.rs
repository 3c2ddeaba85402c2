//! Clients for tests that need control over how a request is framed on the wire.
//!
//! - HTTP/2 through the `h2` crate, over cleartext with prior knowledge (h2c) or over TLS with
//!   ALPN `h2`: headers, the body in chosen DATA frames, END_STREAM on the last DATA frame, on an
//!   empty DATA frame after it, or on trailers ([`End`]);
//! - HTTP/1.1 with a chunked body (one chunk per frame) and a trailer section, written by hand
//!   on a plain TCP stream (no client library sends request trailers on demand);
//! - a self-signed certificate for a test TLS listener ([`TestCert`]).
//!
//! Every request takes a [`FramedRequest`] and answers a [`Response`].

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a request may take before it counts as hung.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);

/// Where a request's END_STREAM goes (for HTTP/1.1 chunked: what follows the last chunk).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// On the last DATA frame (on the HEADERS frame when there is no body).
    LastData,
    /// On an empty DATA frame after the body.
    EmptyData,
    /// On a trailers HEADERS frame after the body (HTTP/1.1: a trailer section).
    Trailers(Vec<(String, String)>),
}

/// A request with its framing spelled out.
#[derive(Debug, Clone)]
pub struct FramedRequest {
    pub method: String,
    /// Path and query, sent as written.
    pub path: String,
    pub headers: Vec<(String, String)>,
    /// The body, one entry per DATA frame (HTTP/1.1: per chunk). Empty entries are sent as
    /// empty DATA frames over HTTP/2 and skipped over HTTP/1.1 (an empty chunk ends the body).
    pub frames: Vec<Bytes>,
    pub end: End,
    /// Pause between frames, so that the server sees them arrive apart.
    pub frame_delay: Duration,
}

impl FramedRequest {
    pub fn new(method: &str, path: &str) -> FramedRequest {
        FramedRequest {
            method: method.to_string(),
            path: path.to_string(),
            headers: Vec::new(),
            frames: Vec::new(),
            end: End::LastData,
            frame_delay: Duration::ZERO,
        }
    }

    /// A POST of `body` as JSON (`content-type: application/json`), in one frame.
    pub fn post_json(path: &str, body: &serde_json::Value) -> FramedRequest {
        FramedRequest::new("POST", path)
            .header("content-type", "application/json")
            .body(body.to_string())
    }

    pub fn header(mut self, name: &str, value: &str) -> FramedRequest {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    /// Replaces the body with `body` in one frame.
    pub fn body(mut self, body: impl Into<Bytes>) -> FramedRequest {
        self.frames = vec![body.into()];
        self
    }

    /// The whole body, frames joined.
    pub fn body_bytes(&self) -> Vec<u8> {
        self.frames.iter().flat_map(|f| f.iter().copied()).collect()
    }

    /// Re-splits the body into `n` frames whose sizes differ by at most one byte (fewer frames
    /// when the body is shorter than `n` bytes).
    pub fn split_into(mut self, n: usize) -> FramedRequest {
        let body = Bytes::from(self.body_bytes());
        let n = n.clamp(1, body.len().max(1));
        let (size, extra) = (body.len() / n, body.len() % n);
        let mut start = 0;
        self.frames = (0..n)
            .map(|i| {
                let len = size + usize::from(i < extra);
                let frame = body.slice(start..start + len);
                start += len;
                frame
            })
            .collect();
        self
    }

    /// Ends the stream with these trailers.
    pub fn trailers(mut self, trailers: &[(&str, &str)]) -> FramedRequest {
        self.end = End::Trailers(
            trailers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        self
    }

    pub fn end(mut self, end: End) -> FramedRequest {
        self.end = end;
        self
    }

    pub fn frame_delay(mut self, delay: Duration) -> FramedRequest {
        self.frame_delay = delay;
        self
    }
}

/// What came back.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub trailers: Option<HeaderMap>,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

fn header_map(pairs: &[(String, String)]) -> Result<HeaderMap> {
    let mut map = HeaderMap::new();
    for (k, v) in pairs {
        map.append(
            HeaderName::from_bytes(k.as_bytes()).with_context(|| format!("header name {k:?}"))?,
            HeaderValue::from_str(v).with_context(|| format!("header value {v:?}"))?,
        );
    }
    Ok(map)
}

/// How to reach a TLS listener: its name in the certificate and the certificate to trust.
#[derive(Debug, Clone)]
pub struct TlsTarget {
    pub server_name: String,
    pub root_der: Vec<u8>,
}

/// A client TLS connection to `addr` offering these ALPN protocols; answers the stream and the
/// protocol the server chose.
pub async fn connect_tls(
    addr: SocketAddr,
    target: &TlsTarget,
    alpn: &[&[u8]],
) -> Result<(tokio_rustls::client::TlsStream<TcpStream>, Option<Vec<u8>>)> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(rustls::pki_types::CertificateDer::from(
        target.root_der.clone(),
    ))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::try_from(target.server_name.clone())?;
    let tls = connector.connect(name, tcp).await?;
    let chosen = tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
    Ok((tls, chosen))
}

/// One HTTP/2 connection; requests on it run one after another or concurrently (clone it).
#[derive(Clone)]
pub struct H2Client {
    send: h2::client::SendRequest<Bytes>,
    scheme: &'static str,
    authority: String,
}

impl H2Client {
    /// Cleartext HTTP/2 with prior knowledge (h2c): the connection preface right away.
    pub async fn connect_h2c(addr: SocketAddr) -> Result<H2Client> {
        let tcp = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connect {addr}"))?;
        tcp.set_nodelay(true)?;
        Self::handshake(tcp, "http", addr.to_string()).await
    }

    /// HTTP/2 over TLS, negotiated with ALPN (fails unless the server chooses `h2`).
    pub async fn connect_tls(addr: SocketAddr, target: &TlsTarget) -> Result<H2Client> {
        let (tls, chosen) = connect_tls(addr, target, &[b"h2", b"http/1.1"]).await?;
        if chosen.as_deref() != Some(b"h2".as_slice()) {
            bail!(
                "the server chose ALPN {:?}, not h2",
                chosen.map(|c| String::from_utf8_lossy(&c).into_owned())
            );
        }
        Self::handshake(
            tls,
            "https",
            format!("{}:{}", target.server_name, addr.port()),
        )
        .await
    }

    async fn handshake<T>(io: T, scheme: &'static str, authority: String) -> Result<H2Client>
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (send, connection) = h2::client::handshake(io).await?;
        // The connection is driven by its own task; it ends when every handle is dropped.
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(H2Client {
            send,
            scheme,
            authority,
        })
    }

    /// Sends `req` framed as it says and reads the whole response (within [`REQUEST_TIMEOUT`]).
    pub async fn send(&self, req: &FramedRequest) -> Result<Response> {
        tokio::time::timeout(REQUEST_TIMEOUT, self.send_inner(req))
            .await
            .with_context(|| {
                format!(
                    "{} {} over HTTP/2: no complete response within {REQUEST_TIMEOUT:?}",
                    req.method, req.path
                )
            })?
    }

    async fn send_inner(&self, req: &FramedRequest) -> Result<Response> {
        let mut builder = http::Request::builder()
            .method(req.method.as_str())
            .uri(format!("{}://{}{}", self.scheme, self.authority, req.path));
        for (k, v) in &req.headers {
            builder = builder.header(k.as_str(), v.as_str());
        }
        let request = builder.body(())?;
        let mut send = self.send.clone().ready().await?;
        let headers_only = req.frames.is_empty() && req.end == End::LastData;
        let (response, mut stream) = send.send_request(request, headers_only)?;
        // A server may answer (and reset the stream) before the body is sent: a failed send
        // is kept, and only reported when no response comes either.
        let mut send_error = None;
        if !headers_only {
            for (i, frame) in req.frames.iter().enumerate() {
                let last = i + 1 == req.frames.len();
                if let Err(e) = stream.send_data(frame.clone(), last && req.end == End::LastData) {
                    send_error = Some(e);
                    break;
                }
                if !req.frame_delay.is_zero() && !last {
                    tokio::time::sleep(req.frame_delay).await;
                }
            }
            if send_error.is_none() {
                if !req.frame_delay.is_zero() && !req.frames.is_empty() {
                    tokio::time::sleep(req.frame_delay).await;
                }
                let ended = match &req.end {
                    End::LastData if req.frames.is_empty() => stream.send_data(Bytes::new(), true),
                    End::LastData => Ok(()),
                    End::EmptyData => stream.send_data(Bytes::new(), true),
                    End::Trailers(t) => stream.send_trailers(header_map(t)?),
                };
                send_error = ended.err();
            }
        }
        let response = match response.await {
            Ok(r) => r,
            Err(e) => {
                return Err(match send_error {
                    Some(s) => anyhow::anyhow!("{e} (sending the body: {s})"),
                    None => e.into(),
                });
            }
        };
        let (parts, mut body) = response.into_parts();
        let mut bytes = Vec::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk?;
            let _ = body.flow_control().release_capacity(chunk.len());
            bytes.extend_from_slice(&chunk);
        }
        let trailers = body.trailers().await?;
        Ok(Response {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body: bytes.into(),
            trailers,
        })
    }
}

/// One request on a new h2c connection.
pub async fn send_h2c(addr: SocketAddr, req: &FramedRequest) -> Result<Response> {
    H2Client::connect_h2c(addr).await?.send(req).await
}

/// One request on a new HTTP/2-over-TLS connection.
pub async fn send_h2_tls(
    addr: SocketAddr,
    target: &TlsTarget,
    req: &FramedRequest,
) -> Result<Response> {
    H2Client::connect_tls(addr, target).await?.send(req).await
}

/// Sends `req` as HTTP/1.1 with `transfer-encoding: chunked` (one chunk per non-empty frame,
/// then the trailer section of [`End::Trailers`]) on a new connection (`connection: close`),
/// and reads the whole response.
pub async fn send_http1_chunked(addr: SocketAddr, req: &FramedRequest) -> Result<Response> {
    tokio::time::timeout(REQUEST_TIMEOUT, http1_chunked_inner(addr, req))
        .await
        .with_context(|| {
            format!(
                "{} {} over HTTP/1.1: no complete response within {REQUEST_TIMEOUT:?}",
                req.method, req.path
            )
        })?
}

async fn http1_chunked_inner(addr: SocketAddr, req: &FramedRequest) -> Result<Response> {
    let mut tcp = TcpStream::connect(addr)
        .await
        .with_context(|| format!("connect {addr}"))?;
    tcp.set_nodelay(true)?;
    let mut head = format!(
        "{} {} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ntransfer-encoding: chunked\r\n",
        req.method, req.path
    );
    if let End::Trailers(t) = &req.end {
        let names: Vec<&str> = t.iter().map(|(k, _)| k.as_str()).collect();
        head.push_str(&format!("trailer: {}\r\n", names.join(", ")));
    }
    for (k, v) in &req.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    // As over HTTP/2, an early answer may close the connection while the body is written.
    let written: std::io::Result<()> = async {
        tcp.write_all(head.as_bytes()).await?;
        for frame in req.frames.iter().filter(|f| !f.is_empty()) {
            let mut chunk = format!("{:x}\r\n", frame.len()).into_bytes();
            chunk.extend_from_slice(frame);
            chunk.extend_from_slice(b"\r\n");
            tcp.write_all(&chunk).await?;
            tcp.flush().await?;
            if !req.frame_delay.is_zero() {
                tokio::time::sleep(req.frame_delay).await;
            }
        }
        let mut last = b"0\r\n".to_vec();
        if let End::Trailers(t) = &req.end {
            for (k, v) in t {
                last.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
            }
        }
        last.extend_from_slice(b"\r\n");
        tcp.write_all(&last).await?;
        tcp.flush().await
    }
    .await;
    let mut raw = Vec::new();
    let read = tcp.read_to_end(&mut raw).await;
    if raw.is_empty() {
        bail!("no response (write: {written:?}, read: {read:?})");
    }
    parse_http1_response(&raw)
}

/// Parses a complete HTTP/1.1 response (read until the server closed).
pub fn parse_http1_response(raw: &[u8]) -> Result<Response> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut parsed = httparse::Response::new(&mut headers);
    let head_len = match parsed.parse(raw)? {
        httparse::Status::Complete(n) => n,
        httparse::Status::Partial => bail!("incomplete response head"),
    };
    let status = parsed.code.context("no status")?;
    let mut map = HeaderMap::new();
    for h in parsed.headers.iter() {
        map.append(
            HeaderName::from_bytes(h.name.as_bytes())?,
            HeaderValue::from_bytes(h.value)?,
        );
    }
    let rest = raw.get(head_len..).unwrap_or_default();
    let chunked = map
        .get("transfer-encoding")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
    let (body, trailers) = if chunked {
        let (b, t) = decode_chunked(rest)?;
        (b, (!t.is_empty()).then_some(t))
    } else if let Some(len) = map
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
    {
        (
            rest.get(..len)
                .context("body shorter than content-length")?
                .to_vec(),
            None,
        )
    } else {
        (rest.to_vec(), None)
    };
    Ok(Response {
        status,
        headers: map,
        body: body.into(),
        trailers,
    })
}

/// Decodes a chunked body; answers the body and its trailers.
fn decode_chunked(mut data: &[u8]) -> Result<(Vec<u8>, HeaderMap)> {
    let mut body = Vec::new();
    loop {
        let line_end = data
            .windows(2)
            .position(|w| w == b"\r\n")
            .context("chunk size line without CRLF")?;
        let line = std::str::from_utf8(data.get(..line_end).unwrap_or_default())?;
        let size_hex = line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_hex, 16)
            .with_context(|| format!("chunk size {size_hex:?}"))?;
        data = data.get(line_end + 2..).unwrap_or_default();
        if size == 0 {
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut trailers = HeaderMap::new();
            if let httparse::Status::Complete((_, hs)) =
                httparse::parse_headers(data, &mut headers)?
            {
                for h in hs {
                    trailers.append(
                        HeaderName::from_bytes(h.name.as_bytes())?,
                        HeaderValue::from_bytes(h.value)?,
                    );
                }
            }
            return Ok((body, trailers));
        }
        body.extend_from_slice(data.get(..size).context("chunk shorter than its size")?);
        data = data.get(size + 2..).context("chunk without CRLF")?;
    }
}

/// A self-signed certificate for a test TLS listener.
pub struct TestCert {
    pub cert_pem: String,
    pub key_pem: String,
    pub cert_der: Vec<u8>,
}

impl TestCert {
    /// For these DNS names / IP addresses (e.g. `["localhost", "127.0.0.1"]`).
    pub fn generate(names: &[&str]) -> Result<TestCert> {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let certified = rcgen::generate_simple_self_signed(names)?;
        Ok(TestCert {
            cert_pem: certified.cert.pem(),
            key_pem: certified.signing_key.serialize_pem(),
            cert_der: certified.cert.der().to_vec(),
        })
    }

    /// How a client reaches a listener serving this certificate under `server_name`.
    pub fn target(&self, server_name: &str) -> TlsTarget {
        TlsTarget {
            server_name: server_name.to_string(),
            root_der: self.cert_der.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_into_keeps_the_body_and_makes_n_frames() {
        let r = FramedRequest::new("POST", "/")
            .body("abcdefghij")
            .split_into(4);
        assert_eq!(r.frames.len(), 4);
        assert_eq!(r.body_bytes(), b"abcdefghij");
        let r = FramedRequest::new("POST", "/").body("ab").split_into(10);
        assert_eq!(r.frames.len(), 2);
    }

    #[test]
    fn parses_chunked_responses_with_trailers() {
        let raw = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nx-a: 1\r\n\r\n3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\nx-t: 9\r\n\r\n";
        let r = parse_http1_response(raw).unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-a"), Some("1"));
        assert_eq!(&r.body[..], b"abcde");
        assert_eq!(r.trailers.unwrap()["x-t"], "9");
        let raw = b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 2\r\n\r\n{}extra";
        let r = parse_http1_response(raw).unwrap();
        assert_eq!((r.status, &r.body[..]), (401, &b"{}"[..]));
        assert!(
            parse_http1_response(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n")
                .is_err()
        );
    }
}
