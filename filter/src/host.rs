//! The host seam: everything the filter asks of Envoy, as one small trait. The proxy-wasm
//! adapter (`glue`, wasm32 only) implements it with `proxy_wasm::hostcalls`; native tests use
//! [`recording::RecordingHost`], which records every call. The request's state machine
//! (`request`) and the worker's polling (`worker`) are plain code over this trait.
//!
//! Shared data (the auth cache and the counters) is the [`SharedStore`] supertrait. Logging goes
//! through the `log` facade (backed by the proxy-wasm SDK in Envoy), not through the host.

use crate::store::SharedStore;

/// A header map.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Headers {
    Request,
    Response,
    /// The response's trailers (inside their callback).
    ResponseTrailers,
    /// The answer to a dispatched HTTP call (inside its response callback).
    CallResponse,
}

/// A host buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Body {
    Request,
    Response,
    /// The answer to a dispatched HTTP call (inside its response callback).
    CallResponse,
    PluginConfiguration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Histogram,
    /// Set with [`Host::record_metric`].
    Gauge,
}

/// What the filter needs from Envoy. Every method is infallible from the caller's side: a host
/// error reads as "nothing" (no value, empty buffer, metric id 0), and the decisions over it fail
/// closed.
pub trait Host: SharedStore {
    /// Every header of `map`, in one buffer (empty when the host's answer is malformed).
    fn headers(&self, map: Headers) -> HeaderMap;
    /// One header value (U+FFFD for invalid bytes).
    fn header(&self, map: Headers, name: &str) -> Option<String>;
    /// Sets (`Some`) or removes (`None`) a header.
    fn set_header(&self, map: Headers, name: &str, value: Option<&str>);
    /// Adds a header value (beside any of the same name: only for a name known to be absent,
    /// where it does what `set_header` does without Envoy looking for the name first).
    fn add_header(&self, map: Headers, name: &str, value: &str);
    /// The first `size` bytes of a buffer (`usize::MAX`: all of it).
    fn body(&self, buf: Body, size: usize) -> Vec<u8>;
    /// Replaces the first `size` bytes of a buffer with `value`.
    fn set_body(&self, buf: Body, size: usize, value: &[u8]);
    /// Dispatches an HTTP call; the token identifies its answer.
    fn dispatch(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout_ms: u64,
    ) -> Result<u32, String>;
    /// Answers the effective context's request locally.
    fn send_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]);
    /// Resumes the effective context's paused request.
    fn resume_request(&self);
    /// Makes `context_id` the effective context (false when it is gone).
    fn set_effective_context(&self, context_id: u32) -> bool;
    /// Wall clock, milliseconds since the Unix epoch (0 when unreadable).
    fn now_ms(&self) -> u64;
    /// Defines a metric (0 when refused: increments of id 0 are dropped).
    fn define_metric(&self, kind: MetricKind, name: &str) -> u32;
    fn increment_metric(&self, id: u32, by: i64);
    fn record_metric(&self, id: u32, value: u64);
    /// A property of the stream (`["xds", "cluster_name"]`), as UTF-8 (U+FFFD for invalid bytes).
    fn property(&self, path: &[&str]) -> Option<String>;
    /// A numeric property of the stream (`["request", "total_size"]`: Envoy hands an int64 over
    /// as 8 little-endian bytes); `None` when absent, malformed or negative.
    fn property_u64(&self, path: &[&str]) -> Option<u64>;
    /// Sets a property of the stream: Envoy keeps `["name"]` in the stream's filter state as
    /// `wasm.name` (an access log reads it with `%FILTER_STATE(wasm.name:PLAIN)%`).
    fn set_property(&self, path: &[&str], value: &[u8]);
}

/// An int64 property as Envoy serialises it (8 little-endian bytes), when not negative.
pub fn property_u64_from(bytes: &[u8]) -> Option<u64> {
    let b: [u8; 8] = bytes.try_into().ok()?;
    u64::try_from(i64::from_le_bytes(b)).ok()
}

/// A header map as the host hands it over (the proxy-wasm map wire format), read in place: one
/// buffer for the whole map, not a `String` and a `Vec` per header. The layout, all little
/// endian: a u32 pair count; per pair a u32 name length and a u32 value length; then each name
/// and each value, each followed by a NUL byte.
///
/// The whole layout is checked once, when the map is made: lengths in bounds and names UTF-8
/// (Envoy's header names are tokens), else the map reads as empty (and the decisions over an
/// empty map fail closed: no `:path`, no credential). A value that is not UTF-8 reads with U+FFFD
/// for its invalid bytes, never a trap (the map is then rebuilt once, in that rare case only).
///
/// Kept as text: the length table is blanked once the pairs' places are noted, so the host's
/// buffer (NUL-separated names and values) is one UTF-8 check and then one `String`, and every
/// name and value is a slice of it — no check per header read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderMap {
    /// The host's bytes as text (the length table blanked); empty when they were malformed.
    text: String,
    /// Where each pair's name and value are in `text`, in the host's order.
    spans: smallvec::SmallVec<[Span; SPANS_INLINE]>,
}

/// A pair's name and value in [`HeaderMap::text`]: `[name start, name end, value start, value
/// end)` (u32: a header map larger than 4 GiB is no map).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Span([u32; 4]);

/// Pairs held without an allocation (a request's or response's usual headers).
const SPANS_INLINE: usize = 16;

/// Bytes of the pair count, and of each pair's two lengths.
const COUNT_BYTES: usize = 4;
const PAIR_BYTES: usize = 8;

fn read_u32(bytes: &[u8], at: usize) -> Option<usize> {
    let b: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
    usize::try_from(u32::from_le_bytes(b)).ok()
}

/// Walks the wire format: each pair's name and value bytes, ending early at the first
/// inconsistency (a length out of bounds).
struct Pairs<'a> {
    wire: &'a [u8],
    /// Pairs left to read.
    left: usize,
    /// Where the next pair's two lengths are.
    table: usize,
    /// Where the next pair's name starts.
    data: usize,
}

impl<'a> Pairs<'a> {
    /// `None` when the pair count does not fit; no bytes at all is the empty map.
    fn new(wire: &'a [u8]) -> Option<Self> {
        let left = if wire.is_empty() {
            0
        } else {
            read_u32(wire, 0)?
        };
        let data = left.checked_mul(PAIR_BYTES)?.checked_add(COUNT_BYTES)?;
        (wire.is_empty() || data <= wire.len()).then_some(Pairs {
            wire,
            left,
            table: COUNT_BYTES,
            data,
        })
    }

    fn pair(&self) -> Option<(&'a [u8], &'a [u8], usize)> {
        let name_len = read_u32(self.wire, self.table)?;
        let value_len = read_u32(self.wire, self.table.checked_add(4)?)?;
        let name_end = self.data.checked_add(name_len)?;
        // Each name and value is followed by a NUL.
        let value_at = name_end.checked_add(1)?;
        let value_end = value_at.checked_add(value_len)?;
        let next = value_end.checked_add(1)?;
        if next > self.wire.len() {
            return None;
        }
        let name = self.wire.get(self.data..name_end)?;
        let value = self.wire.get(value_at..value_end)?;
        Some((name, value, next))
    }
}

impl<'a> Iterator for Pairs<'a> {
    type Item = (&'a [u8], &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        let Some((name, value, next)) = self.pair() else {
            self.left = 0;
            return None;
        };
        self.left -= 1;
        self.table = self.table.saturating_add(PAIR_BYTES);
        self.data = next;
        Some((name, value))
    }
}

impl HeaderMap {
    /// The map in `wire` (the host's answer); empty when malformed.
    pub fn from_wire(mut wire: Vec<u8>) -> Self {
        let Some(pairs) = Pairs::new(&wire) else {
            return HeaderMap::default();
        };
        let (declared, data_at) = (pairs.left, pairs.data);
        let mut spans = smallvec::SmallVec::<[Span; SPANS_INLINE]>::new();
        let mut at = data_at;
        for (name, value) in pairs {
            // Each name and value is followed by a NUL (checked by `Pairs`).
            let name_end = at.saturating_add(name.len());
            let value_at = name_end.saturating_add(1);
            let value_end = value_at.saturating_add(value.len());
            let (Ok(a), Ok(b), Ok(c), Ok(d)) = (
                u32::try_from(at),
                u32::try_from(name_end),
                u32::try_from(value_at),
                u32::try_from(value_end),
            ) else {
                return HeaderMap::default();
            };
            spans.push(Span([a, b, c, d]));
            at = value_end.saturating_add(1);
        }
        if spans.len() != declared {
            return HeaderMap::default();
        }
        // The table's lengths are not text; the pairs' places are noted: blank it.
        if let Some(table) = wire.get_mut(..data_at) {
            table.fill(b' ');
        }
        match String::from_utf8(wire) {
            Ok(text) => HeaderMap { text, spans },
            Err(e) => Self::lossy(&e.into_bytes(), &spans),
        }
    }

    /// A map whose bytes are not all UTF-8: names must be (else empty), values read lossily.
    fn lossy(bytes: &[u8], spans: &[Span]) -> Self {
        let mut m = HeaderMap::default();
        for &Span([a, b, c, d]) in spans {
            let (Some(name), Some(value)) = (
                bytes.get(a as usize..b as usize),
                bytes.get(c as usize..d as usize),
            ) else {
                return HeaderMap::default();
            };
            let Ok(name) = std::str::from_utf8(name) else {
                return HeaderMap::default();
            };
            let value = String::from_utf8_lossy(value);
            let at = m.text.len();
            m.text.push_str(name);
            m.text.push('\0');
            let value_at = m.text.len();
            m.text.push_str(&value);
            m.text.push('\0');
            let (Ok(a), Ok(b), Ok(c), Ok(d)) = (
                u32::try_from(at),
                u32::try_from(at.saturating_add(name.len())),
                u32::try_from(value_at),
                u32::try_from(value_at.saturating_add(value.len())),
            ) else {
                return HeaderMap::default();
            };
            m.spans.push(Span([a, b, c, d]));
        }
        m
    }

    /// Every (name, value), in the host's order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.spans.iter().map(|&Span([a, b, c, d])| {
            (
                self.text.get(a as usize..b as usize).unwrap_or_default(),
                self.text.get(c as usize..d as usize).unwrap_or_default(),
            )
        })
    }

    /// Every name, in the host's order (values not looked at).
    /// Bytes of every name and value, as Envoy's `HeaderMap::byteSize()` counts them (the
    /// headers' share of the `request.total_size` property).
    pub fn byte_size(&self) -> usize {
        self.spans
            .iter()
            .map(|&Span([a, b, c, d])| {
                (b.saturating_sub(a) as usize).saturating_add(d.saturating_sub(c) as usize)
            })
            .sum()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.spans
            .iter()
            .map(|&Span([a, b, _, _])| self.text.get(a as usize..b as usize).unwrap_or_default())
    }

    /// The first value of header `name` (any case).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.get_all(name).next()
    }

    /// The first value of each of `names` (any case), in one pass over the map.
    /// (Not [`Self::get_each_counted`]: a name found is not compared again, which the counting
    /// one must do.)
    pub fn get_each<const N: usize>(&self, names: [&str; N]) -> [Option<&str>; N] {
        let mut found = [None; N];
        for (k, v) in self.iter() {
            for (name, slot) in names.iter().zip(found.iter_mut()) {
                if slot.is_none() && k.eq_ignore_ascii_case(name) {
                    *slot = Some(v);
                }
            }
        }
        found
    }

    /// The first value of each of `names` (any case) and how many times each occurs, in one
    /// pass over the map.
    pub fn get_each_counted<const N: usize>(&self, names: [&str; N]) -> [(Option<&str>, usize); N] {
        let mut found: [(Option<&str>, usize); N] = [(None, 0); N];
        for (k, v) in self.iter() {
            for (name, slot) in names.iter().zip(found.iter_mut()) {
                if k.eq_ignore_ascii_case(name) {
                    if slot.0.is_none() {
                        slot.0 = Some(v);
                    }
                    slot.1 = slot.1.saturating_add(1);
                }
            }
        }
        found
    }

    /// Every value of header `name` (any case), in order.
    pub fn get_all<'a>(&'a self, name: &str) -> impl Iterator<Item = &'a str> {
        self.iter()
            .filter(move |(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v)
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }
}

/// The wire format of `pairs` (as the host serializes a map). A length beyond u32 is written as
/// u32::MAX, which no buffer holds: the map then reads as empty.
pub fn encode<'a>(pairs: impl Iterator<Item = (&'a [u8], &'a [u8])> + Clone) -> Vec<u8> {
    let len32 = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
    let (count, bytes) = pairs.clone().fold((0usize, 0usize), |(c, b), (k, v)| {
        (c + 1, b + PAIR_BYTES + k.len() + v.len() + 2)
    });
    let mut out = Vec::with_capacity(COUNT_BYTES + bytes);
    out.extend_from_slice(&len32(count));
    for (k, v) in pairs.clone() {
        out.extend_from_slice(&len32(k.len()));
        out.extend_from_slice(&len32(v.len()));
    }
    for (k, v) in pairs {
        out.extend_from_slice(k);
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

/// The first `size` bytes of a buffer, without a host call when there are none.
pub fn read_body(host: &dyn Host, buf: Body, size: usize) -> Vec<u8> {
    if size == 0 {
        return Vec::new();
    }
    host.body(buf, size)
}

/// Bytes as text: invalid UTF-8 becomes U+FFFD.
pub fn lossy(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

#[cfg(test)]
pub mod recording;

#[cfg(test)]
mod tests {
    use super::*;

    fn wire(pairs: &[(&str, &[u8])]) -> Vec<u8> {
        encode(pairs.iter().map(|(k, v)| (k.as_bytes(), *v)))
    }

    fn pairs(m: &HeaderMap) -> Vec<(String, String)> {
        m.iter().map(|(k, v)| (k.into(), v.into())).collect()
    }

    #[test]
    fn a_map_reads_back_as_written_in_order_and_by_name_in_any_case() {
        let bytes = wire(&[
            (":path", b"/v1/chat"),
            ("Authorization", b"Bearer x"),
            ("x-maas-subscription", b"a"),
            ("empty", b""),
            ("X-MaaS-Subscription", b"b"),
        ]);
        // The exact layout Envoy writes: count, lengths, then NUL-terminated names and values.
        assert_eq!(
            bytes.get(..12),
            Some(&[5, 0, 0, 0, 5, 0, 0, 0, 8, 0, 0, 0][..])
        );
        assert_eq!(bytes.get(44..51), Some(&b":path\0/"[..]));
        let m = HeaderMap::from_wire(bytes);
        assert_eq!(pairs(&m).len(), 5);
        assert_eq!(m.iter().nth(3), Some(("empty", "")));
        assert_eq!(m.get(":path"), Some("/v1/chat"));
        assert_eq!(m.get("authorization"), Some("Bearer x"));
        assert_eq!(m.get("AUTHORIZATION"), Some("Bearer x"));
        assert_eq!(m.get("x-api-key"), None);
        assert_eq!(
            m.get_each([":path", "x-api-key", "x-maas-subscription", "AUTHORIZATION"]),
            [Some("/v1/chat"), None, Some("a"), Some("Bearer x")]
        );
        assert_eq!(
            m.get_all("x-maas-subscription").collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert_eq!(
            m.get_each_counted(["X-MAAS-SUBSCRIPTION", "x-api-key", ":path"]),
            [(Some("a"), 2), (None, 0), (Some("/v1/chat"), 1)]
        );
        assert!(!m.is_empty());
        // Envoy's byteSize(): every name and value (5+8, 13+8, 19+1, 5+0, 19+1).
        assert_eq!(m.byte_size(), 79);
        assert_eq!(HeaderMap::default().byte_size(), 0);
        assert_eq!(property_u64_from(&79i64.to_le_bytes()), Some(79));
        assert_eq!(property_u64_from(&(-1i64).to_le_bytes()), None);
        assert_eq!(property_u64_from(b"79"), None);
    }

    #[test]
    fn no_headers_and_no_bytes_are_the_empty_map() {
        for bytes in [vec![], vec![0, 0, 0, 0]] {
            let m = HeaderMap::from_wire(bytes);
            assert!(m.is_empty());
            assert_eq!(m.get(":path"), None);
        }
    }

    #[test]
    fn a_value_that_is_not_utf8_reads_with_replacement_characters() {
        let m = HeaderMap::from_wire(wire(&[
            ("a", b"ok"),
            ("authorization", b"Bearer \xff\xfe"),
            ("b", b"x\xc3"),
        ]));
        assert_eq!(m.get("a"), Some("ok"));
        assert_eq!(m.get("authorization"), Some("Bearer \u{fffd}\u{fffd}"));
        assert_eq!(m.get("b"), Some("x\u{fffd}"));
        assert_eq!(pairs(&m).len(), 3);
    }

    #[test]
    fn a_malformed_map_reads_as_empty() {
        let good = wire(&[(":path", b"/v1/chat"), ("authorization", b"Bearer x")]);
        assert_eq!(pairs(&HeaderMap::from_wire(good.clone())).len(), 2);
        // Every truncation: a length points past the end (or the count does not fit).
        for cut in 1..good.len() {
            let m = HeaderMap::from_wire(good.get(..cut).unwrap().to_vec());
            assert!(m.is_empty(), "cut at {cut}");
        }
        let with = |at: usize, value: u32| {
            let mut b = good.clone();
            b.splice(at..at + 4, value.to_le_bytes());
            HeaderMap::from_wire(b)
        };
        // A count larger than the pairs written, one too large for any buffer.
        assert!(with(0, 3).is_empty());
        assert!(with(0, u32::MAX).is_empty());
        // A name or value length past the end, or overflowing.
        assert!(with(4, 1000).is_empty());
        assert!(with(8, u32::MAX).is_empty());
        assert!(with(16, 100).is_empty());
        // A length that leaves no room for the NUL terminator.
        assert!(with(16, 9).is_empty());
        // A name that is not UTF-8 (Envoy's names are tokens): the whole map is refused.
        assert!(HeaderMap::from_wire(wire(&[(":path", b"/"), ("x", b"y")])).get("x") == Some("y"));
        let mut bad_name = wire(&[(":path", b"/"), ("x", b"y")]);
        let at = bad_name.len() - 4;
        bad_name[at] = 0xff;
        assert!(HeaderMap::from_wire(bad_name).is_empty());
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_read_without_panicking(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..128)) {
            let m = HeaderMap::from_wire(bytes);
            for (k, v) in m.iter() {
                let _ = (k.len(), v.len());
            }
            let _ = m.get(":path");
        }

        #[test]
        fn any_count_with_valid_lengths_reads_without_panicking(
            count in proptest::num::u32::ANY,
            tail in proptest::collection::vec(proptest::num::u8::ANY, 0..64),
        ) {
            let mut bytes = count.to_le_bytes().to_vec();
            bytes.extend(tail);
            let _ = HeaderMap::from_wire(bytes).iter().count();
        }

        #[test]
        fn every_map_round_trips(pairs_in in proptest::collection::vec(("[a-zA-Z:-]{1,12}", proptest::collection::vec(proptest::num::u8::ANY, 0..24)), 0..12)) {
            let list: Vec<(&str, &[u8])> = pairs_in.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect();
            let m = HeaderMap::from_wire(wire(&list));
            let read = pairs(&m);
            proptest::prop_assert_eq!(read.len(), list.len());
            for ((k, v), (rk, rv)) in list.iter().zip(&read) {
                proptest::prop_assert_eq!(k, rk);
                proptest::prop_assert_eq!(&String::from_utf8_lossy(v), rv);
            }
        }
    }
}
