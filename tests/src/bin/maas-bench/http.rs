//! A small HTTP/1.1 client (keep-alive, Content-Length or chunked), for checks and memory fills.

use anyhow::{Context, Result, bail};
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

pub(crate) struct HttpConn {
    pub(crate) reader: BufReader<TcpStream>,
    pub(crate) addr: SocketAddr,
}

impl HttpConn {
    pub(crate) fn connect(addr: SocketAddr) -> Result<HttpConn> {
        let s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        s.set_nodelay(true)?;
        Ok(HttpConn {
            reader: BufReader::new(s),
            addr,
        })
    }

    pub(crate) fn post(
        &mut self,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(u16, Vec<u8>)> {
        let mut req = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            self.addr,
            body.len()
        );
        for (k, v) in headers {
            let _ = write!(req, "{k}: {v}\r\n");
        }
        req.push_str("\r\n");
        let s = self.reader.get_mut();
        s.write_all(req.as_bytes())?;
        s.write_all(body)?;
        self.read_response()
    }

    pub(crate) fn get(&mut self, path: &str) -> Result<(u16, Vec<u8>)> {
        let req = format!("GET {path} HTTP/1.1\r\nHost: {}\r\n\r\n", self.addr);
        self.reader.get_mut().write_all(req.as_bytes())?;
        self.read_response()
    }

    pub(crate) fn read_response(&mut self) -> Result<(u16, Vec<u8>)> {
        let mut line = String::new();
        self.reader.read_line(&mut line)?;
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("bad status line {line:?}"))?;
        let mut length: Option<usize> = None;
        let mut chunked = false;
        loop {
            line.clear();
            self.reader.read_line(&mut line)?;
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
                if k == "content-length" {
                    length = v.parse().ok();
                } else if k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked") {
                    chunked = true;
                }
            }
        }
        let mut body = Vec::new();
        if chunked {
            loop {
                line.clear();
                self.reader.read_line(&mut line)?;
                let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                    .with_context(|| format!("bad chunk size {line:?}"))?;
                if size == 0 {
                    line.clear();
                    self.reader.read_line(&mut line)?;
                    break;
                }
                let start = body.len();
                body.resize(start + size, 0);
                self.reader.read_exact(&mut body[start..])?;
                let mut crlf = [0u8; 2];
                self.reader.read_exact(&mut crlf)?;
            }
        } else if let Some(n) = length {
            body.resize(n, 0);
            self.reader.read_exact(&mut body)?;
        } else {
            self.reader.read_to_end(&mut body)?;
        }
        Ok((status, body))
    }
}

pub(crate) fn post_once(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<(u16, String)> {
    let (status, body) = HttpConn::connect(addr)?.post(path, headers, body)?;
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

pub(crate) fn get_text(addr: SocketAddr, path: &str) -> Result<String> {
    let (status, body) = HttpConn::connect(addr)?.get(path)?;
    let body = String::from_utf8_lossy(&body).into_owned();
    if status != 200 {
        bail!("GET {path} → {status}: {body}");
    }
    Ok(body)
}
