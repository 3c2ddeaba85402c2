//! Token usage in responses of every supported API family (OpenAI chat/completions/embeddings,
//! OpenAI Responses, Anthropic Messages).
//!
//! [`JsonUsageScanner`] finds the top-level `usage` object of a non-streamed JSON response while the
//! body passes through, chunk by chunk, with bounded memory: a byte-level state machine that tracks
//! nesting depth and strings, remembers the current top-level key (at most [`KEY_CAP`] bytes) and
//! copies only the value of a top-level `usage` key (at most [`USAGE_CAP`] bytes).
//!
//! Every family puts the usage of a non-streamed response in a top-level `usage` object; only the
//! names of its counts differ ([`UsageCounts`]). [`parse_usage`] turns a `usage` value into a
//! [`Usage`]; the SSE scanner uses the same tolerant deserializer ([`UsageCounts`], [`UsageField`]).

use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};
use smallvec::SmallVec;
use std::fmt;

/// Token counts of one response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
    /// The part of `prompt_tokens` served from the provider's prompt cache (OpenAI
    /// `prompt_tokens_details.cached_tokens` / Responses `input_tokens_details.cached_tokens`,
    /// Anthropic `cache_read_input_tokens`); never more than `prompt_tokens`.
    pub cached_input_tokens: u64,
}

/// Longest top-level key remembered (longer keys cannot be `usage`, even escaped).
pub const KEY_CAP: usize = 64;
/// Longest `usage` value kept; a longer one is ignored (real ones are a few hundred bytes).
pub const USAGE_CAP: usize = 16 * 1024;
/// Top-level keys up to this size are kept inline (`system_fingerprint` is 18).
const KEY_INLINE: usize = 32;
/// A `usage` value up to this size is kept inline (a plain OpenAI one is ~60 bytes, one with
/// its details ~230: then one allocation); the scanner stays small enough to sit unboxed next
/// to the SSE scanner.
const USAGE_INLINE: usize = 192;

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
#[allow(clippy::struct_excessive_bools)] // parser flags on the response hot path
#[derive(Debug)]
pub struct JsonUsageScanner {
    top: Top,
    /// Nesting depth inside the top-level value (1 = directly inside the top-level object).
    depth: u32,
    in_string: bool,
    escape: bool,
    /// Inline up to [`KEY_INLINE`] bytes (every key of a real response): no allocation per key.
    key: SmallVec<[u8; KEY_INLINE]>,
    key_overflow: bool,
    /// Copying the value of a top-level `usage` key.
    capture: bool,
    /// Inline up to [`USAGE_INLINE`] bytes (a usual `usage`): no allocation per response.
    captured: SmallVec<[u8; USAGE_INLINE]>,
    capture_overflow: bool,
    /// Counts of the last well-formed `usage` (one that states a count).
    counts: Option<UsageCounts>,
    /// Also look one level down, in the objects of top-level `response` and `message` keys (the
    /// Responses and Anthropic stream events), see [`Self::with_nested_usage`].
    nested_keys: bool,
    /// Scanning the value of a top-level `response`/`message` key for its own `usage`.
    nested: Option<Box<JsonUsageScanner>>,
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
            key: SmallVec::new(),
            key_overflow: false,
            capture: false,
            captured: SmallVec::new(),
            capture_overflow: false,
            counts: None,
            nested_keys: false,
            nested: None,
        }
    }

    /// A scanner that also finds `response.usage` and `message.usage` (one level down, under a
    /// top-level `response` or `message` object): for a stream event too large to be parsed
    /// whole (a Responses `response.completed` repeats the whole output). Memory stays bounded
    /// (twice [`KEY_CAP`] + [`USAGE_CAP`]).
    pub fn with_nested_usage() -> Self {
        JsonUsageScanner {
            nested_keys: true,
            ..Self::new()
        }
    }

    /// Bytes currently buffered (key and captured `usage` value); bounded.
    pub fn buffered_bytes(&self) -> usize {
        let nested = self.nested.as_ref().map_or(0, |n| n.buffered_bytes());
        self.key
            .len()
            .saturating_add(self.captured.len())
            .saturating_add(nested)
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
                    self.sink(rest.get(..n).unwrap_or_default());
                    i = i.saturating_add(n);
                }
                Top::InValue => {
                    // Fast path through numbers, literals and whitespace.
                    let n = rest
                        .iter()
                        .position(|&b| matches!(b, b'"' | b'{' | b'}' | b'[' | b']' | b','))
                        .unwrap_or(rest.len());
                    match rest.get(n) {
                        // A byte inside the value: sunk with the run before it, in one piece.
                        Some(&b) if !self.ends_value(b) => {
                            self.sink(rest.get(..=n).unwrap_or_default());
                            self.value_structure(b);
                        }
                        Some(&b) => {
                            self.sink(rest.get(..n).unwrap_or_default());
                            self.value_byte(b);
                        }
                        None => self.sink(rest),
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

    /// Bytes of the current top-level value: kept when it is `usage`, scanned when it is a
    /// nested `response`/`message`, else ignored.
    fn sink(&mut self, bytes: &[u8]) {
        if self.capture {
            self.capture_bytes(bytes);
        } else if let Some(n) = self.nested.as_mut() {
            n.feed(bytes);
        }
    }

    fn capture_bytes(&mut self, bytes: &[u8]) {
        if self.capture_overflow {
            return;
        }
        if self.captured.len().saturating_add(bytes.len()) > USAGE_CAP {
            self.capture_overflow = true;
            self.captured = SmallVec::new();
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
                    if !self.capture
                        && self.nested_keys
                        && !self.key_overflow
                        && (self.key.as_slice() == b"response" || self.key.as_slice() == b"message")
                    {
                        self.nested = Some(Box::new(JsonUsageScanner::new()));
                    }
                } else if b == b'}' {
                    self.top = Top::Done;
                }
            }
            Top::InValue => self.value_byte(b),
            Top::Done => {}
        }
    }

    /// Whether `b`, outside strings, ends the top-level value (a `,` between top-level keys or
    /// the top-level object's closing bracket) rather than belonging to it.
    fn ends_value(&self, b: u8) -> bool {
        match b {
            b'}' | b']' => self.depth <= 1,
            b',' => self.depth == 1,
            _ => false,
        }
    }

    /// A byte of a top-level value, outside strings.
    fn value_byte(&mut self, b: u8) {
        match b {
            b'}' | b']' if self.depth <= 1 => {
                // Closes the top-level object.
                self.end_value();
                self.top = Top::Done;
            }
            b',' if self.depth == 1 => {
                self.end_value();
                self.top = Top::ExpectKey;
            }
            _ => {
                self.sink(&[b]);
                self.value_structure(b);
            }
        }
    }

    /// What a byte inside a top-level value (outside strings, already sunk) changes: a string
    /// starts, or the nesting deepens or closes.
    fn value_structure(&mut self, b: u8) {
        match b {
            b'"' => self.in_string = true,
            b'{' | b'[' => self.depth = self.depth.saturating_add(1),
            b'}' | b']' => self.depth = self.depth.saturating_sub(1),
            _ => {}
        }
    }

    fn end_value(&mut self) {
        if self.capture {
            self.capture = false;
            if !self.capture_overflow
                && let Ok(c) = serde_json::from_slice::<UsageCounts>(&self.captured)
                && c.usage().is_some()
            {
                self.counts = Some(c);
            }
            self.captured.clear();
        }
        if let Some(mut n) = self.nested.take()
            && let Some(c) = n.finish_counts()
        {
            self.counts = Some(c);
        }
    }

    fn key_is_usage(&self) -> bool {
        if self.key_overflow {
            return false;
        }
        if self.key.as_slice() == b"usage" {
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
        self.finish_counts().and_then(|c| c.usage())
    }

    /// End of body: the counts of the last well-formed `usage`, as stated (to merge with the
    /// counts of other stream events).
    pub fn finish_counts(&mut self) -> Option<UsageCounts> {
        if let Some(n) = self.nested.as_mut()
            && let Some(c) = n.finish_counts()
        {
            // A truncated body whose nested object already had its usage.
            self.counts = Some(c);
        }
        self.counts
    }
}

/// Parses a `usage` value of any supported API family into a [`Usage`] (see [`UsageCounts`]).
/// `null`, non-objects and objects without any count give `None`.
pub fn parse_usage(bytes: &[u8]) -> Option<Usage> {
    serde_json::from_slice::<UsageCounts>(bytes).ok()?.usage()
}

/// The token counts one `usage` object states, each field as given (absent, `null` or not a
/// count: `None`). The names of every supported API family:
///
/// - OpenAI chat/completions/embeddings: `prompt_tokens`, `completion_tokens`, `total_tokens`
///   (embeddings: no `completion_tokens`);
/// - OpenAI Responses: `input_tokens`, `output_tokens`, `total_tokens` (cached input is part of
///   `input_tokens`, only detailed in the nested `input_tokens_details`);
/// - Anthropic Messages: `input_tokens`, `output_tokens`, `cache_creation_input_tokens`,
///   `cache_read_input_tokens` (cache tokens are *not* part of `input_tokens`: they are added to
///   the prompt).
///
/// A stream may state usage in several events (Anthropic: `message_start` has the input,
/// `message_delta` the cumulative output): [`UsageCounts::merge`] combines them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UsageCounts {
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub total_tokens: Option<u64>,
    pub input_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    pub cache_creation_input_tokens: Option<u64>,
    pub cache_read_input_tokens: Option<u64>,
    /// `cached_tokens` of `prompt_tokens_details` (OpenAI) or `input_tokens_details`
    /// (Responses): part of the prompt / input count already.
    pub cached_tokens: Option<u64>,
}

impl UsageCounts {
    /// No count at all.
    pub fn is_empty(&self) -> bool {
        self.prompt_tokens.is_none()
            && self.completion_tokens.is_none()
            && self.total_tokens.is_none()
            && self.input_tokens.is_none()
            && self.output_tokens.is_none()
            && self.cache_creation_input_tokens.is_none()
            && self.cache_read_input_tokens.is_none()
            && self.cached_tokens.is_none()
    }

    /// Folds in the counts of a later event: every count it states replaces the earlier one
    /// (counts in streams are cumulative, the last one wins). An event without any count changes
    /// nothing; `total_tokens` is always the later event's (dropped when it states none, so a stale
    /// total never outlives the counts it summed).
    pub fn merge(&mut self, later: &UsageCounts) {
        if later.is_empty() {
            return;
        }
        fn take(slot: &mut Option<u64>, later: Option<u64>) {
            if later.is_some() {
                *slot = later;
            }
        }
        take(&mut self.prompt_tokens, later.prompt_tokens);
        take(&mut self.completion_tokens, later.completion_tokens);
        take(&mut self.input_tokens, later.input_tokens);
        take(&mut self.output_tokens, later.output_tokens);
        take(
            &mut self.cache_creation_input_tokens,
            later.cache_creation_input_tokens,
        );
        take(
            &mut self.cache_read_input_tokens,
            later.cache_read_input_tokens,
        );
        take(&mut self.cached_tokens, later.cached_tokens);
        self.total_tokens = later.total_tokens;
    }

    /// The usage these counts give: prompt = `prompt_tokens`, else `input_tokens` + the cache
    /// counts; completion = `completion_tokens`, else `output_tokens`; total = `total_tokens`,
    /// else prompt + completion. `None` without any count.
    pub fn usage(&self) -> Option<Usage> {
        let input_parts = [
            self.input_tokens,
            self.cache_creation_input_tokens,
            self.cache_read_input_tokens,
        ];
        let input = input_parts
            .iter()
            .flatten()
            .copied()
            .reduce(u64::saturating_add);
        let prompt = self.prompt_tokens.or(input);
        let completion = self.completion_tokens.or(self.output_tokens);
        if prompt.is_none() && completion.is_none() && self.total_tokens.is_none() {
            return None;
        }
        let prompt_tokens = prompt.unwrap_or(0);
        let completion_tokens = completion.unwrap_or(0);
        let total_tokens = self
            .total_tokens
            .unwrap_or(prompt_tokens.saturating_add(completion_tokens));
        // OpenAI names: the details' cached count; Anthropic names: the cache reads.
        let cached = if self.prompt_tokens.is_some() {
            self.cached_tokens.or(self.cache_read_input_tokens)
        } else {
            self.cache_read_input_tokens.or(self.cached_tokens)
        };
        Some(Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens,
            cached_input_tokens: cached.unwrap_or(0).min(prompt_tokens),
        })
    }
}

/// A tolerant `usage` value: never fails on a well-formed JSON value; `None` when it carries no
/// token count. Names as in [`UsageCounts`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UsageField(pub Option<Usage>);

impl<'de> Deserialize<'de> for UsageField {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        UsageCounts::deserialize(d).map(|c| UsageField(c.usage()))
    }
}

impl<'de> Deserialize<'de> for UsageCounts {
    /// Never fails on a well-formed JSON value: anything but an object is empty counts.
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
    CacheCreationInputTokens,
    CacheReadInputTokens,
    PromptTokensDetails,
    InputTokensDetails,
    #[serde(other)]
    Other,
}

struct UsageVisitor;

impl<'de> Visitor<'de> for UsageVisitor {
    type Value = UsageCounts;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a usage object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<UsageCounts, A::Error> {
        let mut c = UsageCounts::default();
        while let Some(key) = map.next_key::<UsageKey>()? {
            let slot = match key {
                UsageKey::PromptTokens => &mut c.prompt_tokens,
                UsageKey::CompletionTokens => &mut c.completion_tokens,
                UsageKey::TotalTokens => &mut c.total_tokens,
                UsageKey::InputTokens => &mut c.input_tokens,
                UsageKey::OutputTokens => &mut c.output_tokens,
                UsageKey::CacheCreationInputTokens => &mut c.cache_creation_input_tokens,
                UsageKey::CacheReadInputTokens => &mut c.cache_read_input_tokens,
                UsageKey::PromptTokensDetails | UsageKey::InputTokensDetails => {
                    if let Some(n) = map.next_value::<CachedDetails>()?.0 {
                        c.cached_tokens = Some(n);
                    }
                    continue;
                }
                UsageKey::Other => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            *slot = map.next_value::<TokenCount>()?.0;
        }
        Ok(c)
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<UsageCounts, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(UsageCounts::default())
    }

    fn visit_unit<E: de::Error>(self) -> Result<UsageCounts, E> {
        Ok(UsageCounts::default())
    }
    fn visit_none<E: de::Error>(self) -> Result<UsageCounts, E> {
        Ok(UsageCounts::default())
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<UsageCounts, E> {
        Ok(UsageCounts::default())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<UsageCounts, E> {
        Ok(UsageCounts::default())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<UsageCounts, E> {
        Ok(UsageCounts::default())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<UsageCounts, E> {
        Ok(UsageCounts::default())
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<UsageCounts, E> {
        Ok(UsageCounts::default())
    }
}

/// The `cached_tokens` count of a `prompt_tokens_details` / `input_tokens_details` object;
/// `None` for anything else (never fails on a well-formed JSON value).
struct CachedDetails(Option<u64>);

impl<'de> Deserialize<'de> for CachedDetails {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(CachedDetailsVisitor)
    }
}

struct CachedDetailsVisitor;

impl<'de> Visitor<'de> for CachedDetailsVisitor {
    type Value = CachedDetails;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a token details object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<CachedDetails, A::Error> {
        let mut cached = None;
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if key == "cached_tokens" {
                cached = map.next_value::<TokenCount>()?.0;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(CachedDetails(cached))
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<CachedDetails, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(CachedDetails(None))
    }
    fn visit_unit<E: de::Error>(self) -> Result<CachedDetails, E> {
        Ok(CachedDetails(None))
    }
    fn visit_none<E: de::Error>(self) -> Result<CachedDetails, E> {
        Ok(CachedDetails(None))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<CachedDetails, E> {
        Ok(CachedDetails(None))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<CachedDetails, E> {
        Ok(CachedDetails(None))
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<CachedDetails, E> {
        Ok(CachedDetails(None))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<CachedDetails, E> {
        Ok(CachedDetails(None))
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<CachedDetails, E> {
        Ok(CachedDetails(None))
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
mod tests;
