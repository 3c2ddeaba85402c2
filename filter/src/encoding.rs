//! Usage from compressed responses. The filter asks backends for `accept-encoding: identity`
//! (Envoy may compress towards the client); a backend that compresses anyway (gzip or deflate)
//! is decoded here for the usage scanners — the bytes forwarded are not changed — and, for an
//! answer the filter translates, into the bytes the translator reads ([`Decoder`]: the client
//! then gets the translation uncompressed). A fixed-size inflate buffer and a cap on the decoded
//! total bound what a compression bomb costs. Other codings cannot be read: the request settles
//! to its reservation.

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

enum Inflater<W: Write> {
    Gzip(GzDecoder<W>),
    Deflate(ZlibDecoder<W>),
}

impl<W: Write> Inflater<W> {
    /// `None` for codings that need no decoding or cannot be decoded.
    fn new(coding: Coding, sink: W) -> Option<Self> {
        match coding {
            Coding::Gzip => Some(Inflater::Gzip(GzDecoder::new(sink))),
            Coding::Deflate => Some(Inflater::Deflate(ZlibDecoder::new(sink))),
            Coding::Identity | Coding::Unreadable => None,
        }
    }

    fn write_all(&mut self, chunk: &[u8]) -> std::io::Result<()> {
        match self {
            Inflater::Gzip(d) => d.write_all(chunk),
            Inflater::Deflate(d) => d.write_all(chunk),
        }
    }

    /// Everything decoded so far to the sink (a stream's event is not held for the next chunk).
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Inflater::Gzip(d) => d.flush(),
            Inflater::Deflate(d) => d.flush(),
        }
    }

    fn try_finish(&mut self) -> std::io::Result<()> {
        match self {
            Inflater::Gzip(d) => d.try_finish(),
            Inflater::Deflate(d) => d.try_finish(),
        }
    }

    fn sink(&mut self) -> &mut W {
        match self {
            Inflater::Gzip(d) => d.get_mut(),
            Inflater::Deflate(d) => d.get_mut(),
        }
    }
}

/// What one compressed chunk may decode to for a translator, which holds it whole: real answers
/// decode to far less per chunk (Envoy hands over tens of KiB), a compression bomb is refused
/// before it fills the VM's memory.
pub const MAX_DECODED_CHUNK_BYTES: usize = 8 * 1024 * 1024;

/// Where a [`Decoder`] writes: the decoded bytes not yet taken (at most
/// [`MAX_DECODED_CHUNK_BYTES`]), up to [`MAX_DECODED_BYTES`] in all.
#[derive(Default)]
struct Collected {
    bytes: Vec<u8>,
    decoded: u64,
}

impl Write for Collected {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.decoded = self.decoded.saturating_add(buf.len() as u64);
        if self.decoded > MAX_DECODED_BYTES
            || self.bytes.len().saturating_add(buf.len()) > MAX_DECODED_CHUNK_BYTES
        {
            return Err(std::io::Error::other("decoded response too large"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A compressed body decoded chunk by chunk, for a translator that must read it.
pub struct Decoder {
    inflater: Inflater<Collected>,
    failed: bool,
}

impl std::fmt::Debug for Decoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decoder")
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

/// The body could not be decoded (corrupt, cut short, or past [`MAX_DECODED_BYTES`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Undecodable;

impl Decoder {
    /// `None` for codings that need no decoding or cannot be decoded.
    pub fn new(coding: Coding) -> Option<Self> {
        Some(Decoder {
            inflater: Inflater::new(coding, Collected::default())?,
            failed: false,
        })
    }

    /// The bytes a compressed chunk decodes to (`end`: the body's last chunk, which must end
    /// the compressed stream). Once it fails, it fails for every later chunk.
    pub fn feed(&mut self, chunk: &[u8], end: bool) -> Result<Vec<u8>, Undecodable> {
        if self.failed {
            return Err(Undecodable);
        }
        let mut r = self.inflater.write_all(chunk);
        if r.is_ok() {
            r = if end {
                self.inflater.try_finish()
            } else {
                self.inflater.flush()
            };
        }
        if r.is_err() {
            self.failed = true;
            self.inflater.sink().bytes = Vec::new();
            return Err(Undecodable);
        }
        Ok(std::mem::take(&mut self.inflater.sink().bytes))
    }
}

/// Reads usage from a compressed response body, chunk by chunk.
pub struct DecodingScanner {
    inflater: Inflater<Sink>,
    failed: bool,
}

impl DecodingScanner {
    /// `None` for codings that need no decoding or cannot be decoded.
    pub fn new(coding: Coding, scanner: Scanner) -> Option<Self> {
        let sink = Sink {
            scanner,
            decoded: 0,
        };
        Some(DecodingScanner {
            inflater: Inflater::new(coding, sink)?,
            failed: false,
        })
    }

    /// Feeds a compressed chunk. A corrupt stream stops the reading (usage then unreadable).
    pub fn feed(&mut self, chunk: &[u8]) {
        if self.failed {
            return;
        }
        if self.inflater.write_all(chunk).is_err() {
            self.failed = true;
        }
    }

    /// The usage seen and the content events of a stream (usage `None` when the body could not
    /// be decoded whole).
    pub fn finish(&mut self) -> (Option<Usage>, u64) {
        if !self.failed && self.inflater.try_finish().is_err() {
            self.failed = true;
        }
        let (usage, events) = self.inflater.sink().scanner.finish();
        if self.failed {
            (None, events)
        } else {
            (usage, events)
        }
    }

    /// Content events of a stream so far (for an aborted stream's estimate).
    pub fn content_events(&mut self) -> u64 {
        match &self.inflater.sink().scanner {
            Scanner::Json(_) => 0,
            Scanner::Sse(s) => s.content_events(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A translator's decoder: any chunking decodes to the body; a cut or corrupt body and a
    /// chunk that decodes past its cap (a bomb) fail, and keep failing.
    #[test]
    fn a_decoder_gives_the_bytes_of_each_chunk_and_refuses_bombs() {
        let z = gzip(JSON);
        for size in [1, 5, z.len()] {
            let mut d = Decoder::new(Coding::Gzip).unwrap();
            let chunks: Vec<&[u8]> = z.chunks(size).collect();
            let mut out = Vec::new();
            for (i, c) in chunks.iter().enumerate() {
                out.extend(d.feed(c, i + 1 == chunks.len()).unwrap());
            }
            assert_eq!(out, JSON, "{size}");
        }
        let mut d = Decoder::new(Coding::Gzip).unwrap();
        assert_eq!(d.feed(&z[..z.len() - 3], true), Err(Undecodable));
        assert_eq!(d.feed(b"", true), Err(Undecodable));
        let bomb = gzip(&vec![b'a'; 2 * MAX_DECODED_CHUNK_BYTES]);
        let mut d = Decoder::new(Coding::Gzip).unwrap();
        assert_eq!(d.feed(&bomb, false), Err(Undecodable));
        assert!(Decoder::new(Coding::Identity).is_none());
        assert!(Decoder::new(Coding::Unreadable).is_none());
        // A stream's event flushed by the provider comes out with its chunk, not a chunk later.
        let mut e = GzEncoder::new(Vec::new(), Compression::default());
        e.write_all(b"data: one\n\n").unwrap();
        e.flush().unwrap();
        let first = std::mem::take(e.get_mut());
        e.write_all(b"data: two\n\n").unwrap();
        let rest = e.finish().unwrap();
        let mut d = Decoder::new(Coding::Gzip).unwrap();
        assert_eq!(d.feed(&first, false).unwrap(), b"data: one\n\n");
        assert_eq!(d.feed(&rest, true).unwrap(), b"data: two\n\n");
    }
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
