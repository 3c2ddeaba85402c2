//! Usage from compressed responses. The filter asks backends for `accept-encoding: identity`
//! (Envoy may compress towards the client); a backend that compresses anyway (gzip or deflate)
//! is decoded here for the usage scanners only — the bytes forwarded are never changed — with a
//! fixed-size inflate buffer and a cap on the decoded total, so a compression bomb costs bounded
//! memory and time. Other codings cannot be read: the request settles to its reservation.

use crate::sse::SseScanner;
use crate::usage::{JsonUsageScanner, Usage};
use flate2::write::{GzDecoder, ZlibDecoder};
use std::io::Write;

/// Decoded bytes read for usage at most; past it the usage counts as unreadable.
pub const MAX_DECODED_BYTES: u64 = 64 * 1024 * 1024;

/// A response's `content-encoding`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    Identity,
    Gzip,
    Deflate,
    /// br, zstd, several codings, anything else: the usage cannot be read.
    Unreadable,
}

/// The coding named by a `content-encoding` header value (absent, empty or `identity`: none).
pub fn coding(header: Option<&str>) -> Coding {
    let Some(v) = header else {
        return Coding::Identity;
    };
    let v = v.trim();
    if v.is_empty() || v.eq_ignore_ascii_case("identity") {
        Coding::Identity
    } else if v.eq_ignore_ascii_case("gzip") || v.eq_ignore_ascii_case("x-gzip") {
        Coding::Gzip
    } else if v.eq_ignore_ascii_case("deflate") {
        Coding::Deflate
    } else {
        Coding::Unreadable
    }
}

/// A usage scanner fed with decoded bytes.
pub enum Scanner {
    Json(JsonUsageScanner),
    /// Never strips: compressed bytes are forwarded as they came.
    Sse(SseScanner),
}

impl Scanner {
    fn feed(&mut self, bytes: &[u8]) {
        match self {
            Scanner::Json(s) => s.feed(bytes),
            Scanner::Sse(s) => {
                let _ = s.feed(bytes);
            }
        }
    }

    fn finish(&mut self) -> (Option<Usage>, u64) {
        match self {
            Scanner::Json(s) => (s.finish(), 0),
            Scanner::Sse(s) => {
                let _ = s.finish();
                (s.usage(), s.content_events())
            }
        }
    }
}

/// Where the inflater writes: the scanner, up to [`MAX_DECODED_BYTES`].
pub struct Sink {
    scanner: Scanner,
    decoded: u64,
}

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.decoded = self.decoded.saturating_add(buf.len() as u64);
        if self.decoded > MAX_DECODED_BYTES {
            return Err(std::io::Error::other("decoded response too large to read"));
        }
        self.scanner.feed(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

enum Inflater {
    Gzip(GzDecoder<Sink>),
    Deflate(ZlibDecoder<Sink>),
}

/// Reads usage from a compressed response body, chunk by chunk.
pub struct DecodingScanner {
    inflater: Inflater,
    failed: bool,
}

impl DecodingScanner {
    /// `None` for codings that need no decoding or cannot be decoded.
    pub fn new(coding: Coding, scanner: Scanner) -> Option<Self> {
        let sink = Sink {
            scanner,
            decoded: 0,
        };
        let inflater = match coding {
            Coding::Gzip => Inflater::Gzip(GzDecoder::new(sink)),
            Coding::Deflate => Inflater::Deflate(ZlibDecoder::new(sink)),
            Coding::Identity | Coding::Unreadable => return None,
        };
        Some(DecodingScanner {
            inflater,
            failed: false,
        })
    }

    /// Feeds a compressed chunk. A corrupt stream stops the reading (usage then unreadable).
    pub fn feed(&mut self, chunk: &[u8]) {
        if self.failed {
            return;
        }
        let r = match &mut self.inflater {
            Inflater::Gzip(d) => d.write_all(chunk),
            Inflater::Deflate(d) => d.write_all(chunk),
        };
        if r.is_err() {
            self.failed = true;
        }
    }

    /// The usage seen and the content events of a stream (usage `None` when the body could not
    /// be decoded whole).
    pub fn finish(&mut self) -> (Option<Usage>, u64) {
        if !self.failed {
            let r = match &mut self.inflater {
                Inflater::Gzip(d) => d.try_finish(),
                Inflater::Deflate(d) => d.try_finish(),
            };
            if r.is_err() {
                self.failed = true;
            }
        }
        let sink = match &mut self.inflater {
            Inflater::Gzip(d) => d.get_mut(),
            Inflater::Deflate(d) => d.get_mut(),
        };
        let (usage, events) = sink.scanner.finish();
        if self.failed {
            (None, events)
        } else {
            (usage, events)
        }
    }

    /// Content events of a stream so far (for an aborted stream's estimate).
    pub fn content_events(&mut self) -> u64 {
        let sink = match &mut self.inflater {
            Inflater::Gzip(d) => d.get_mut(),
            Inflater::Deflate(d) => d.get_mut(),
        };
        match &sink.scanner {
            Scanner::Json(_) => 0,
            Scanner::Sse(s) => s.content_events(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::Compression;
    use flate2::write::{GzEncoder, ZlibEncoder};

    fn gzip(b: &[u8]) -> Vec<u8> {
        let mut e = GzEncoder::new(Vec::new(), Compression::default());
        e.write_all(b).unwrap();
        e.finish().unwrap()
    }

    const JSON: &[u8] = br#"{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":10,"completion_tokens":50000,"total_tokens":50010}}"#;

    #[test]
    fn codings() {
        assert_eq!(coding(None), Coding::Identity);
        assert_eq!(coding(Some(" identity ")), Coding::Identity);
        assert_eq!(coding(Some("GZIP")), Coding::Gzip);
        assert_eq!(coding(Some("x-gzip")), Coding::Gzip);
        assert_eq!(coding(Some("deflate")), Coding::Deflate);
        assert_eq!(coding(Some("br")), Coding::Unreadable);
        assert_eq!(coding(Some("gzip, br")), Coding::Unreadable);
    }

    #[test]
    fn gzip_json_usage_is_read_in_any_chunking() {
        let z = gzip(JSON);
        for size in [1, 3, 17, z.len()] {
            let mut d =
                DecodingScanner::new(Coding::Gzip, Scanner::Json(JsonUsageScanner::new())).unwrap();
            for c in z.chunks(size) {
                d.feed(c);
            }
            let (u, _) = d.finish();
            assert_eq!(u.map(|u| u.total_tokens), Some(50_010), "chunks of {size}");
        }
    }

    #[test]
    fn deflate_sse_usage_is_read() {
        let sse = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":3,\"total_tokens\":5}}\n\ndata: [DONE]\n\n";
        let mut e = ZlibEncoder::new(Vec::new(), Compression::default());
        e.write_all(sse).unwrap();
        let z = e.finish().unwrap();
        let mut d =
            DecodingScanner::new(Coding::Deflate, Scanner::Sse(SseScanner::new(false))).unwrap();
        for c in z.chunks(7) {
            d.feed(c);
        }
        let (u, events) = d.finish();
        assert_eq!(u.map(|u| u.total_tokens), Some(5));
        assert_eq!(events, 1);
    }

    #[test]
    fn corrupt_or_truncated_bodies_are_unreadable_not_zero() {
        let mut z = gzip(JSON);
        z.truncate(z.len() / 2);
        let mut d =
            DecodingScanner::new(Coding::Gzip, Scanner::Json(JsonUsageScanner::new())).unwrap();
        d.feed(&z);
        assert_eq!(d.finish().0, None);
        let mut d =
            DecodingScanner::new(Coding::Gzip, Scanner::Json(JsonUsageScanner::new())).unwrap();
        d.feed(b"not gzip at all");
        assert_eq!(d.finish().0, None);
    }

    #[test]
    fn a_compression_bomb_stops_at_the_cap() {
        // 1 GiB of zeros compresses to ~1 MiB; feed a prefix big enough to pass the cap.
        let mut e = GzEncoder::new(Vec::new(), Compression::best());
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..80 {
            e.write_all(&zeros).unwrap();
        }
        let z = e.finish().unwrap();
        let mut d =
            DecodingScanner::new(Coding::Gzip, Scanner::Json(JsonUsageScanner::new())).unwrap();
        d.feed(&z);
        assert!(d.failed);
        assert_eq!(d.finish().0, None);
        assert!(
            DecodingScanner::new(Coding::Unreadable, Scanner::Json(JsonUsageScanner::new()))
                .is_none()
        );
    }
}
