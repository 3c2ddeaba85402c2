//! Token usage in OpenAI-style responses.
//!
//! [`JsonUsageScanner`] finds the top-level `usage` object of a non-streamed JSON response while the
//! body passes through, chunk by chunk, with bounded memory: a byte-level state machine that tracks
//! nesting depth and strings, remembers the current top-level key (at most [`KEY_CAP`] bytes) and
//! copies only the value of a top-level `usage` key (at most [`USAGE_CAP`] bytes).
//!
//! [`parse_usage`] turns a `usage` value into a [`Usage`]; the SSE scanner uses the same tolerant
//! deserializer ([`UsageField`]).

use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};
use std::fmt;

/// Token counts of one response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
}

/// Longest top-level key remembered (longer keys cannot be `usage`, even escaped).
pub const KEY_CAP: usize = 64;
/// Longest `usage` value kept; a longer one is ignored (real ones are a few hundred bytes).
pub const USAGE_CAP: usize = 16 * 1024;

/// Where the scanner is, relative to the top-level object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Top {
    /// Before the first non-whitespace byte.
    Start,
    /// Inside the top-level object, waiting for a key (after `{` or `,`).
    ExpectKey,
    /// Reading a top-level key string.
    InKey,
    /// After a key, waiting for `:`.
    ExpectColon,
    /// Reading a top-level value (any depth); `capture` says whether it is `usage`.
    InValue,
    /// The top-level value ended or is not an object: nothing more to learn.
    Done,
}

/// Incremental scan of a JSON (non-streamed) response body for its top-level `usage` object.
///
/// Memory is bounded by [`KEY_CAP`] + [`USAGE_CAP`] whatever the body's size; chunks are never
/// held back (the scanner only observes). The last well-formed top-level `usage` wins.
#[derive(Debug)]
pub struct JsonUsageScanner {
    top: Top,
    /// Nesting depth inside the top-level value (1 = directly inside the top-level object).
    depth: u32,
    in_string: bool,
    escape: bool,
    key: Vec<u8>,
    key_overflow: bool,
    /// Copying the value of a top-level `usage` key.
    capture: bool,
    captured: Vec<u8>,
    capture_overflow: bool,
    usage: Option<Usage>,
}

impl Default for JsonUsageScanner {
    fn default() -> Self {
        Self::new()
    }
}

impl JsonUsageScanner {
    pub fn new() -> Self {
        JsonUsageScanner {
            top: Top::Start,
            depth: 0,
            in_string: false,
            escape: false,
            key: Vec::new(),
            key_overflow: false,
            capture: false,
            captured: Vec::new(),
            capture_overflow: false,
            usage: None,
        }
    }

    /// Bytes currently buffered (key and captured `usage` value); bounded.
    pub fn buffered_bytes(&self) -> usize {
        self.key.len().saturating_add(self.captured.len())
    }

    /// Scans one chunk of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        let mut i = 0usize;
        while i < chunk.len() {
            let Some(rest) = chunk.get(i..) else { break };
            match self.top {
                Top::Done => return,
                Top::InValue if self.in_string => {
                    // Fast path through string contents: jump to the next quote or backslash.
                    let n = self.string_run(rest);
                    if self.capture {
                        self.capture_bytes(rest.get(..n).unwrap_or_default());
                    }
                    i = i.saturating_add(n);
                }
                Top::InValue => {
                    // Fast path through numbers, literals and whitespace.
                    let n = rest
                        .iter()
                        .position(|&b| matches!(b, b'"' | b'{' | b'}' | b'[' | b']' | b','))
                        .unwrap_or(rest.len());
                    if self.capture {
                        self.capture_bytes(rest.get(..n).unwrap_or_default());
                    }
                    if let Some(&b) = rest.get(n) {
                        self.value_byte(b);
                    }
                    i = i.saturating_add(n).saturating_add(1);
                }
                Top::InKey if !self.escape => {
                    let n = rest
                        .iter()
                        .position(|&b| b == b'"' || b == b'\\')
                        .unwrap_or(rest.len());
                    self.key_bytes(rest.get(..n).unwrap_or_default());
                    if let Some(&b) = rest.get(n) {
                        if b == b'"' {
                            self.top = Top::ExpectColon;
                        } else {
                            self.escape = true;
                            self.key_bytes(&[b]);
                        }
                        i = i.saturating_add(n).saturating_add(1);
                    } else {
                        i = chunk.len();
                    }
                }
                _ => {
                    let Some(&b) = rest.first() else { break };
                    self.byte(b);
                    i = i.saturating_add(1);
                }
            }
        }
    }

    /// Inside a string of a value: consumes up to and including the next unescaped quote or the
    /// byte after a backslash; returns how many bytes it consumed.
    fn string_run(&mut self, rest: &[u8]) -> usize {
        if self.escape {
            self.escape = false;
            return 1.min(rest.len());
        }
        match rest.iter().position(|&b| b == b'"' || b == b'\\') {
            Some(p) => {
                if rest.get(p) == Some(&b'"') {
                    self.in_string = false;
                } else {
                    self.escape = true;
                }
                p.saturating_add(1)
            }
            None => rest.len(),
        }
    }

    fn key_bytes(&mut self, bytes: &[u8]) {
        if self.key_overflow {
            return;
        }
        if self.key.len().saturating_add(bytes.len()) > KEY_CAP {
            self.key_overflow = true;
            self.key.clear();
        } else {
            self.key.extend_from_slice(bytes);
        }
    }

    fn capture_bytes(&mut self, bytes: &[u8]) {
        if self.capture_overflow {
            return;
        }
        if self.captured.len().saturating_add(bytes.len()) > USAGE_CAP {
            self.capture_overflow = true;
            self.captured = Vec::new();
        } else {
            self.captured.extend_from_slice(bytes);
        }
    }

    fn byte(&mut self, b: u8) {
        match self.top {
            Top::Start => match b {
                b' ' | b'\t' | b'\n' | b'\r' => {}
                b'{' => {
                    self.top = Top::ExpectKey;
                    self.depth = 1;
                }
                _ => self.top = Top::Done,
            },
            Top::ExpectKey => match b {
                b'"' => {
                    self.top = Top::InKey;
                    self.key.clear();
                    self.key_overflow = false;
                    self.escape = false;
                }
                b'}' => self.top = Top::Done,
                _ => {} // whitespace, or garbage we tolerate
            },
            Top::InKey => {
                // Only reached right after a backslash (see `feed`).
                self.escape = false;
                self.key_bytes(&[b]);
            }
            Top::ExpectColon => {
                if b == b':' {
                    self.top = Top::InValue;
                    self.capture = self.key_is_usage();
                    self.captured.clear();
                    self.capture_overflow = false;
                } else if b == b'}' {
                    self.top = Top::Done;
                }
            }
            Top::InValue => self.value_byte(b),
            Top::Done => {}
        }
    }

    /// A byte of a top-level value, outside strings.
    fn value_byte(&mut self, b: u8) {
        match b {
            b'"' => self.in_string = true,
            b'{' | b'[' => self.depth = self.depth.saturating_add(1),
            b'}' | b']' if self.depth > 1 => self.depth = self.depth.saturating_sub(1),
            b'}' | b']' => {
                // Closes the top-level object.
                self.end_value();
                self.top = Top::Done;
                return;
            }
            b',' if self.depth == 1 => {
                self.end_value();
                self.top = Top::ExpectKey;
                return;
            }
            _ => {}
        }
        if self.capture {
            self.capture_bytes(&[b]);
        }
    }

    fn end_value(&mut self) {
        if self.capture {
            self.capture = false;
            if !self.capture_overflow
                && let Some(u) = parse_usage(&self.captured)
            {
                self.usage = Some(u);
            }
            self.captured.clear();
        }
    }

    fn key_is_usage(&self) -> bool {
        if self.key_overflow {
            return false;
        }
        if self.key == b"usage" {
            return true;
        }
        if !self.key.contains(&b'\\') {
            return false;
        }
        // An escaped key such as "\u0075sage": decode it.
        let mut quoted = Vec::with_capacity(self.key.len().saturating_add(2));
        quoted.push(b'"');
        quoted.extend_from_slice(&self.key);
        quoted.push(b'"');
        matches!(serde_json::from_slice::<String>(&quoted), Ok(k) if k == "usage")
    }

    /// End of body: the usage found, if any.
    pub fn finish(&mut self) -> Option<Usage> {
        self.usage
    }
}

/// Parses a `usage` value (`{"prompt_tokens":…,"completion_tokens":…,"total_tokens":…}`).
/// `null`, non-objects and objects without any count give `None`.
pub fn parse_usage(bytes: &[u8]) -> Option<Usage> {
    serde_json::from_slice::<UsageField>(bytes).ok()?.0
}

/// A tolerant `usage` value: never fails on a well-formed JSON value; `None` when it carries no
/// token count. Accepts OpenAI names (`prompt_tokens`, `completion_tokens`, `total_tokens`) and, as a
/// fallback, Anthropic names (`input_tokens`, `output_tokens`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UsageField(pub Option<Usage>);

impl<'de> Deserialize<'de> for UsageField {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(UsageVisitor)
    }
}

#[derive(serde::Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum UsageKey {
    PromptTokens,
    CompletionTokens,
    TotalTokens,
    InputTokens,
    OutputTokens,
    #[serde(other)]
    Other,
}

struct UsageVisitor;

impl<'de> Visitor<'de> for UsageVisitor {
    type Value = UsageField;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a usage object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<UsageField, A::Error> {
        let (mut prompt, mut completion, mut total, mut input, mut output) =
            (None, None, None, None, None);
        while let Some(key) = map.next_key::<UsageKey>()? {
            let slot = match key {
                UsageKey::PromptTokens => &mut prompt,
                UsageKey::CompletionTokens => &mut completion,
                UsageKey::TotalTokens => &mut total,
                UsageKey::InputTokens => &mut input,
                UsageKey::OutputTokens => &mut output,
                UsageKey::Other => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            *slot = map.next_value::<TokenCount>()?.0;
        }
        let prompt = prompt.or(input);
        let completion = completion.or(output);
        if prompt.is_none() && completion.is_none() && total.is_none() {
            return Ok(UsageField(None));
        }
        let prompt_tokens = prompt.unwrap_or(0);
        let completion_tokens = completion.unwrap_or(0);
        let total_tokens = total.unwrap_or(prompt_tokens.saturating_add(completion_tokens));
        Ok(UsageField(Some(Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens,
        })))
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<UsageField, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(UsageField(None))
    }

    fn visit_unit<E: de::Error>(self) -> Result<UsageField, E> {
        Ok(UsageField(None))
    }
    fn visit_none<E: de::Error>(self) -> Result<UsageField, E> {
        Ok(UsageField(None))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<UsageField, E> {
        Ok(UsageField(None))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<UsageField, E> {
        Ok(UsageField(None))
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<UsageField, E> {
        Ok(UsageField(None))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<UsageField, E> {
        Ok(UsageField(None))
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<UsageField, E> {
        Ok(UsageField(None))
    }
}

/// A token count: a non-negative integer (or an integral float); anything else is `None`.
struct TokenCount(Option<u64>);

impl<'de> Deserialize<'de> for TokenCount {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(TokenCountVisitor)
    }
}

struct TokenCountVisitor;

impl<'de> Visitor<'de> for TokenCountVisitor {
    type Value = TokenCount;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a token count")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<TokenCount, E> {
        Ok(TokenCount(Some(v)))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<TokenCount, E> {
        Ok(TokenCount(u64::try_from(v).ok()))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<TokenCount, E> {
        // 2^64 as f64; larger values do not fit.
        const LIMIT: f64 = 18_446_744_073_709_551_616.0;
        if v.is_finite() && v >= 0.0 && v.fract() == 0.0 && v < LIMIT {
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            return Ok(TokenCount(Some(v as u64)));
        }
        Ok(TokenCount(None))
    }
    fn visit_unit<E: de::Error>(self) -> Result<TokenCount, E> {
        Ok(TokenCount(None))
    }
    fn visit_none<E: de::Error>(self) -> Result<TokenCount, E> {
        Ok(TokenCount(None))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<TokenCount, E> {
        Ok(TokenCount(None))
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<TokenCount, E> {
        Ok(TokenCount(None))
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<TokenCount, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(TokenCount(None))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TokenCount, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(TokenCount(None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// An OpenAI chat completion (non-streamed), usage at the end.
    const OPENAI: &str = r#"{
  "id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
  "object": "chat.completion",
  "created": 1741570283,
  "model": "gpt-4o-2024-08-06",
  "choices": [
    {
      "index": 0,
      "message": {
        "role": "assistant",
        "content": "The \"usage\": {\"total_tokens\": 999} text is not usage. {[",
        "refusal": null,
        "annotations": []
      },
      "logprobs": null,
      "finish_reason": "stop"
    }
  ],
  "usage": {
    "prompt_tokens": 1117,
    "completion_tokens": 46,
    "total_tokens": 1163,
    "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
  },
  "service_tier": "default",
  "system_fingerprint": "fp_fc9f1d7035"
}"#;

    /// vLLM completion: usage first-ish, nested objects with `usage` keys elsewhere.
    const VLLM: &str = r#"{"id":"cmpl-1","object":"text_completion","usage":{"prompt_tokens":7,"completion_tokens":3},"model":"m","choices":[{"index":0,"text":"a b c","usage":{"total_tokens":1},"logprobs":null}],"meta":{"usage":{"prompt_tokens":100}}}"#;

    fn scan(parts: &[&[u8]]) -> Option<Usage> {
        let mut s = JsonUsageScanner::new();
        for p in parts {
            s.feed(p);
        }
        s.finish()
    }

    fn u(p: u64, c: u64, t: u64) -> Option<Usage> {
        Some(Usage {
            prompt_tokens: p,
            completion_tokens: c,
            total_tokens: t,
        })
    }

    #[test]
    fn openai_body() {
        assert_eq!(scan(&[OPENAI.as_bytes()]), u(1117, 46, 1163));
    }

    #[test]
    fn vllm_body_nested_usage_ignored_total_computed() {
        assert_eq!(scan(&[VLLM.as_bytes()]), u(7, 3, 10));
    }

    #[test]
    fn only_total() {
        assert_eq!(scan(&[br#"{"usage":{"total_tokens":42}}"#]), u(0, 0, 42));
    }

    #[test]
    fn anthropic_names() {
        let body = br#"{"type":"message","usage":{"input_tokens":10,"output_tokens":5,"cache_read_input_tokens":0}}"#;
        assert_eq!(scan(&[body]), u(10, 5, 15));
    }

    #[test]
    fn escaped_key() {
        assert_eq!(scan(&[br#"{"\u0075sage":{"total_tokens":3}}"#]), u(0, 0, 3));
        assert_eq!(scan(&[br#"{"us\"age":{"total_tokens":3}}"#]), None);
    }

    #[test]
    fn no_or_bad_usage() {
        for body in [
            &br#"{"usage":null}"#[..],
            br#"{"usage":{}}"#,
            br#"{"usage":"12"}"#,
            br#"{"usage":{"total_tokens":-1}}"#,
            br#"{"x":{"usage":{"total_tokens":3}}}"#,
            br#"[{"usage":{"total_tokens":3}}]"#,
            br#""usage""#,
            br#"{"a":"usage","b":{"total_tokens":3}}"#,
            br#"{"usage":{"total_tokens":3"#,
            b"",
            b"not json",
        ] {
            assert_eq!(scan(&[body]), None, "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn usage_parsed_before_body_ends() {
        // The value is complete at the `,`: a truncated body still reports it.
        assert_eq!(
            scan(&[br#"{"usage":{"total_tokens":3},"choices":[{"tr"#]),
            u(0, 0, 3)
        );
    }

    #[test]
    fn float_counts() {
        assert_eq!(
            scan(&[br#"{"usage":{"prompt_tokens":2.0,"completion_tokens":1e1}}"#]),
            u(2, 10, 12)
        );
        assert_eq!(scan(&[br#"{"usage":{"prompt_tokens":2.5}}"#]), None);
    }

    #[test]
    fn memory_bounded() {
        let mut s = JsonUsageScanner::new();
        s.feed(b"{\"choices\":[");
        let item = br#"{"text":"usage usage \"usage\"","usage":{"total_tokens":1}},"#;
        let mut max = 0;
        for _ in 0..100_000 {
            s.feed(item);
            max = max.max(s.buffered_bytes());
        }
        s.feed(br#"{}],"usage":{"total_tokens":7}}"#);
        assert_eq!(s.finish(), u(0, 0, 7));
        assert!(max <= KEY_CAP + USAGE_CAP, "{max}");
        assert_eq!(max, "choices".len());
        let mut s = JsonUsageScanner::new();
        s.feed(b"{\"usage\":{\"pad\":\"");
        for _ in 0..10_000 {
            s.feed(b"xxxxxxxxxx");
            assert!(s.buffered_bytes() <= KEY_CAP + USAGE_CAP);
        }
        s.feed(b"\",\"total_tokens\":1}}");
        assert_eq!(s.finish(), None, "an oversized usage value is ignored");
    }

    fn split_at_points(data: &[u8], mut points: Vec<usize>) -> Vec<&[u8]> {
        points.sort_unstable();
        let mut parts = Vec::new();
        let mut last = 0;
        for p in points {
            let p = p.min(data.len());
            parts.push(&data[last..p]);
            last = p;
        }
        parts.push(&data[last..]);
        parts
    }

    #[test]
    fn every_split_point() {
        for body in [OPENAI, VLLM] {
            let whole = scan(&[body.as_bytes()]);
            assert!(whole.is_some());
            for i in 0..=body.len() {
                let (a, b) = body.as_bytes().split_at(i);
                assert_eq!(scan(&[a, b]), whole, "split at {i}");
            }
            let bytes: Vec<&[u8]> = body.as_bytes().chunks(1).collect();
            assert_eq!(scan(&bytes), whole);
        }
    }

    /// A JSON value without any top-level `usage` meaning (keys never equal "usage" at depth 1).
    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::Value;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<u32>().prop_map(Value::from),
            "[a-z\"\\\\{}\\[\\]:, ]{0,10}".prop_map(Value::String),
            Just(Value::String("usage".into())),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map("(usage|[a-z]{1,5})", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn usage_anywhere_at_top_level(
            before in proptest::collection::btree_map("[a-t]{1,6}", json_value(), 0..4),
            after in proptest::collection::btree_map("[v-z]{1,6}", json_value(), 0..4),
            p in any::<u32>(), c in any::<u32>(),
            points in proptest::collection::vec(0usize..3000, 0..8),
            pretty in any::<bool>(),
        ) {
            let mut obj = serde_json::Map::new();
            for (k, v) in before { obj.insert(k, v); }
            obj.insert("usage".into(), serde_json::json!({"prompt_tokens": p, "completion_tokens": c, "x": {"usage": 1}}));
            for (k, v) in after { obj.insert(k, v); }
            let v = serde_json::Value::Object(obj);
            let body = if pretty { serde_json::to_vec_pretty(&v).unwrap() } else { serde_json::to_vec(&v).unwrap() };
            let expected = u(u64::from(p), u64::from(c), u64::from(p) + u64::from(c));
            prop_assert_eq!(scan(&[&body]), expected);
            prop_assert_eq!(scan(&split_at_points(&body, points)), expected);
        }

        #[test]
        fn nested_usage_keys_ignored(
            v in proptest::collection::btree_map("[a-t]{1,6}", json_value(), 0..6),
            points in proptest::collection::vec(0usize..3000, 0..8),
        ) {
            let body = serde_json::to_vec(&v).unwrap();
            prop_assert_eq!(scan(&[&body]), None);
            prop_assert_eq!(scan(&split_at_points(&body, points)), None);
        }

        #[test]
        fn garbage_never_panics(
            data in proptest::collection::vec(
                prop_oneof![any::<u8>(), Just(b'{'), Just(b'}'), Just(b'"'), Just(b'\\'), Just(b':'), Just(b',')],
                0..400,
            ),
            points in proptest::collection::vec(0usize..400, 0..8),
        ) {
            let whole = scan(&[&data]);
            prop_assert_eq!(scan(&split_at_points(&data, points)), whole);
        }
    }

    /// `cargo test -p maas-filter --release --lib usage::tests::throughput -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn throughput() {
        let mut body = b"{\"choices\":[".to_vec();
        let item = br#"{"index":0,"message":{"role":"assistant","content":"Lorem ipsum dolor sit amet, \"consectetur\" adipiscing elit, sed do eiusmod tempor incididunt ut labore et dolore magna aliqua."},"logprobs":null,"finish_reason":"stop"},"#;
        while body.len() < 32 * 1024 * 1024 {
            body.extend_from_slice(item);
        }
        body.extend_from_slice(
            br#"{}],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}"#,
        );
        for chunk in [4096, 65536] {
            let start = std::time::Instant::now();
            let mut s = JsonUsageScanner::new();
            let mut max = 0;
            for c in body.chunks(chunk) {
                s.feed(c);
                max = max.max(s.buffered_bytes());
            }
            let r = s.finish();
            let el = start.elapsed().as_secs_f64();
            println!(
                "json usage chunk={chunk}: {:.0} MB/s, max buffered {max} B, usage {r:?}",
                body.len() as f64 / el / 1e6
            );
        }
    }
}
