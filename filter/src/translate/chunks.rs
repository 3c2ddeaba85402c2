//! What every translation of a provider's own API into OpenAI chat writes alike (Bedrock
//! Converse, Gemini, Anthropic Messages): the kept JSON answer, the chunks of a stream, the
//! usage object, the errors.

use super::request::ClientAsk;
use crate::usage::Usage;
use serde_json::{Value, json};

/// Largest non-streamed answer kept to be translated at its end (real ones are kilobytes); a
/// larger one is answered with an error (the provider's bytes are not passed untranslated).
pub const JSON_CAP: usize = 16 * 1024 * 1024;

/// A non-streamed answer kept whole, to be translated at its end.
#[derive(Debug, Default)]
pub struct KeptJson {
    kept: Vec<u8>,
    too_large: bool,
}

impl KeptJson {
    /// Bytes kept so far.
    pub fn kept(&self) -> usize {
        self.kept.len()
    }

    /// Keeps `chunk`. At the answer's `end`: `Some(Ok(whole answer))`, or `Some(Err(error))`
    /// when it grew past [`JSON_CAP`] (the OpenAI error to answer instead); before: `None`.
    pub fn feed(&mut self, chunk: &[u8], end: bool) -> Option<Result<Vec<u8>, Vec<u8>>> {
        if !self.too_large {
            if self.kept.len().saturating_add(chunk.len()) > JSON_CAP {
                self.too_large = true;
                self.kept = Vec::new();
            } else {
                self.kept.extend_from_slice(chunk);
            }
        }
        if !end {
            return None;
        }
        if self.too_large {
            return Some(Err(untranslatable(
                "the provider's answer is too large to translate",
            )));
        }
        Some(Ok(std::mem::take(&mut self.kept)))
    }
}

/// Does `content_type` start with `prefix` (any case)?
pub fn is_type(content_type: &str, prefix: &str) -> bool {
    content_type
        .get(..prefix.len())
        .is_some_and(|t| t.eq_ignore_ascii_case(prefix))
}

/// Does `content_type` name JSON (`application/json`, `…+json`, any case)?
pub fn is_json(content_type: &str) -> bool {
    content_type
        .as_bytes()
        .windows(4)
        .any(|w| w.eq_ignore_ascii_case(b"json"))
}

/// An OpenAI error body of type `upstream_error`.
pub fn error_body(message: &str, code: Option<&str>) -> Value {
    json!({"error": {"message": message, "type": "upstream_error", "param": null, "code": code}})
}

/// The error answered in place of a provider answer that cannot be translated.
pub fn untranslatable(message: &str) -> Vec<u8> {
    serde_json::to_vec(&error_body(message, Some("untranslatable_response"))).unwrap_or_default()
}

/// What a client gets of a provider answer the gateway cannot read: nothing until its end, then
/// an `untranslatable_response` error (an event of its stream when `sse`).
pub fn unreadable_answer(sse: bool, end: bool) -> Vec<u8> {
    if !end {
        return Vec::new();
    }
    let message = "the provider compressed its answer although the gateway asked for none, in a coding the gateway cannot decode (or corrupt); it cannot be translated";
    if sse {
        let mut out = Vec::new();
        sse_error(&mut out, message, Some("untranslatable_response"));
        out
    } else {
        untranslatable(message)
    }
}

/// A translated answer's content coding: read as it came (identity), decoded chunk by chunk
/// (gzip, deflate: the client gets the translation uncompressed), or not readable at all.
#[derive(Debug)]
pub enum Decoding {
    Identity,
    Decoded(Box<crate::encoding::Decoder>),
    Unreadable,
}

impl Decoding {
    /// `translated`: the answer is one the translator reads (JSON or a stream); any other
    /// passes as it came, compressed or not.
    pub fn new(coding: crate::encoding::Coding, translated: bool) -> Self {
        use crate::encoding::{Coding, Decoder};
        match coding {
            Coding::Identity => Decoding::Identity,
            _ if !translated => Decoding::Identity,
            Coding::Unreadable => Decoding::Unreadable,
            Coding::Gzip | Coding::Deflate => Decoder::new(coding)
                .map_or(Decoding::Unreadable, |d| Decoding::Decoded(Box::new(d))),
        }
    }

    pub fn unreadable(&self) -> bool {
        matches!(self, Decoding::Unreadable)
    }

    /// The client gets plain bytes in place of the coded ones.
    pub fn drops_encoding(&self) -> bool {
        !matches!(self, Decoding::Identity)
    }

    /// A chunk as the translator reads it: as it came, or decoded; `None` once the answer
    /// cannot be decoded (it is then [`Decoding::Unreadable`]).
    pub fn decode<'a>(&mut self, chunk: &'a [u8], end: bool) -> Option<std::borrow::Cow<'a, [u8]>> {
        let decoded = match self {
            Decoding::Identity => return Some(std::borrow::Cow::Borrowed(chunk)),
            Decoding::Unreadable => return None,
            Decoding::Decoded(d) => d.feed(chunk, end),
        };
        if decoded.is_err() {
            *self = Decoding::Unreadable;
        }
        decoded.ok().map(std::borrow::Cow::Owned)
    }
}

/// OpenAI's in-stream error event.
pub fn sse_error(out: &mut Vec<u8>, message: &str, code: Option<&str>) {
    out.extend_from_slice(b"data: ");
    let _ = serde_json::to_writer(&mut *out, &error_body(message, code));
    out.extend_from_slice(b"\n\n");
}

/// OpenAI `usage` of metered counts.
pub fn openai_usage(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_input_tokens},
    })
}

/// What every chunk of a translated stream names: its id (`<id_prefix><created>`), `created`
/// and `model`.
pub struct Head<'a> {
    pub id_prefix: &'static str,
    pub model: &'a str,
    pub created: u64,
}

impl Head<'_> {
    /// A content chunk, written straight (the stream's hot path: one per token).
    pub fn content(&self, out: &mut Vec<u8>, text: &str) {
        let created = self.created.to_string();
        out.extend_from_slice(b"data: {\"id\":\"");
        out.extend_from_slice(self.id_prefix.as_bytes());
        out.extend_from_slice(created.as_bytes());
        out.extend_from_slice(b"\",\"object\":\"chat.completion.chunk\",\"created\":");
        out.extend_from_slice(created.as_bytes());
        out.extend_from_slice(b",\"model\":");
        let _ = serde_json::to_writer(&mut *out, self.model);
        out.extend_from_slice(b",\"choices\":[{\"index\":0,\"delta\":{\"content\":");
        let _ = serde_json::to_writer(&mut *out, text);
        out.extend_from_slice(b"},\"logprobs\":null,\"finish_reason\":null}]}\n\n");
    }

    /// A chunk of `choices` (and `usage`).
    pub fn chunk(&self, out: &mut Vec<u8>, choices: Value, usage: Option<Value>) {
        let mut c = json!({
            "id": format!("{}{}", self.id_prefix, self.created),
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let (Some(u), Some(o)) = (usage, c.as_object_mut()) {
            o.insert("usage".into(), u);
        }
        out.extend_from_slice(b"data: ");
        let _ = serde_json::to_writer(&mut *out, &c);
        out.extend_from_slice(b"\n\n");
    }

    /// A chunk of one choice's `delta` and `finish_reason`.
    pub fn delta(&self, out: &mut Vec<u8>, delta: Value, finish: Value) {
        self.chunk(
            out,
            json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]),
            None,
        );
    }
}

/// What a translated stream showed so far: the latest usage the provider sent, and the
/// content deltas (≈ completion tokens when no usage came).
#[derive(Debug, Default, Clone, Copy)]
pub struct Seen {
    pub usage: Option<Usage>,
    pub deltas: u64,
}

/// A provider's own API, translated into OpenAI chat as its answer passes ([`Translated`]).
pub trait Api {
    /// A stream's translation state.
    type Stream: std::fmt::Debug;
    /// The content type of the API's streams.
    const STREAM_TYPE: &'static str;
    /// The prefix of the translated answer's `id`.
    const ID_PREFIX: &'static str;
    /// A new stream's state.
    fn stream(ask: ClientAsk) -> Self::Stream;
    /// A non-streamed answer → `chat.completion` (and its usage); `None`: not the API's.
    fn completion(body: &[u8], model: &str, created: u64) -> Option<(Vec<u8>, Option<Usage>)>;
    /// One chunk of a stream (`end`: its last): what the client gets now; `seen` gathers what
    /// it showed.
    fn feed_stream(
        s: &mut Self::Stream,
        head: &Head<'_>,
        chunk: &[u8],
        end: bool,
        seen: &mut Seen,
    ) -> Vec<u8>;
    /// Bytes a stream carries to its next chunk.
    fn carried(s: &Self::Stream) -> usize;
}

#[derive(Debug)]
enum Mode<S> {
    Json(KeptJson),
    Stream(Box<S>),
    /// An answer the gateway cannot read (its coding, or corrupt): an error at its end (an
    /// event of an OpenAI stream when `stream`).
    Unreadable {
        stream: bool,
    },
    /// Neither (an Envoy error page…): passed as it came.
    Passthrough,
}

/// One answer in a provider's own API as it passes, translated for an OpenAI chat client.
#[derive(Debug)]
pub struct Translated<A: Api> {
    mode: Mode<A::Stream>,
    model: String,
    created: u64,
    seen: Seen,
    decoding: Decoding,
}

impl<A: Api> Translated<A> {
    /// `content_type` and `coding` of the provider's answer; `model`: the name the client gets;
    /// `created`: now (seconds).
    pub fn new(
        content_type: &str,
        coding: crate::encoding::Coding,
        ask: ClientAsk,
        model: &str,
        created: u64,
    ) -> Self {
        let stream = is_type(content_type, A::STREAM_TYPE);
        let decoding = Decoding::new(coding, stream || is_json(content_type));
        let mode = if decoding.unreadable() {
            Mode::Unreadable { stream }
        } else if stream {
            Mode::Stream(Box::new(A::stream(ask)))
        } else if is_json(content_type) {
            Mode::Json(KeptJson::default())
        } else {
            Mode::Passthrough
        };
        Translated {
            mode,
            model: model.to_string(),
            created,
            seen: Seen::default(),
            decoding,
        }
    }

    /// The client gets an event stream (the content type to announce).
    pub fn is_stream(&self) -> bool {
        matches!(
            self.mode,
            Mode::Stream(_) | Mode::Unreadable { stream: true }
        )
    }

    /// Whether the answer's `content-encoding` must go (the client gets plain bytes).
    pub fn drops_encoding(&self) -> bool {
        self.decoding.drops_encoding()
    }

    /// The usage the provider sent.
    pub fn usage(&self) -> Option<Usage> {
        self.seen.usage
    }

    /// Content deltas of a stream (≈ completion tokens when no usage came).
    pub fn content_events(&self) -> u64 {
        self.seen.deltas
    }

    /// Bytes kept for later chunks.
    pub fn pending(&self) -> usize {
        match &self.mode {
            Mode::Json(kept) => kept.kept(),
            Mode::Stream(s) => A::carried(s),
            Mode::Unreadable { .. } | Mode::Passthrough => 0,
        }
    }

    /// One chunk of the provider's answer (`end`: its last): what the client gets now.
    pub fn feed(&mut self, chunk: &[u8], end: bool) -> Vec<u8> {
        let Some(chunk) = self.decoding.decode(chunk, end) else {
            let stream = self.is_stream();
            self.mode = Mode::Unreadable { stream };
            return unreadable_answer(stream, end);
        };
        let chunk = chunk.as_ref();
        match &mut self.mode {
            Mode::Passthrough => chunk.to_vec(),
            Mode::Unreadable { stream } => unreadable_answer(*stream, end),
            Mode::Json(kept) => {
                let kept = match kept.feed(chunk, end) {
                    None => return Vec::new(),
                    Some(Err(error)) => return error,
                    Some(Ok(kept)) => kept,
                };
                match A::completion(&kept, &self.model, self.created) {
                    Some((out, usage)) => {
                        self.seen.usage = usage;
                        out
                    }
                    None => kept,
                }
            }
            Mode::Stream(s) => {
                let head = Head {
                    id_prefix: A::ID_PREFIX,
                    model: &self.model,
                    created: self.created,
                };
                A::feed_stream(s, &head, chunk, end, &mut self.seen)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_json_answer_is_kept_to_its_end_and_bounded() {
        let mut k = KeptJson::default();
        assert_eq!(k.feed(b"{\"a\":", false), None);
        assert_eq!(k.kept(), 5);
        assert_eq!(k.feed(b"1}", true), Some(Ok(b"{\"a\":1}".to_vec())));
        let mut big = KeptJson::default();
        assert_eq!(big.feed(&vec![b' '; JSON_CAP + 1], false), None);
        assert_eq!(big.kept(), 0, "nothing kept past the cap");
        let Some(Err(e)) = big.feed(b"}", true) else {
            panic!("too large")
        };
        let v: Value = serde_json::from_slice(&e).unwrap();
        assert_eq!(v["error"]["code"], "untranslatable_response");
    }

    #[test]
    fn a_content_chunk_is_the_chunk_json_would_write() {
        let head = Head {
            id_prefix: "chatcmpl-x-",
            model: "m\"1",
            created: 7,
        };
        let (mut fast, mut slow) = (Vec::new(), Vec::new());
        head.content(&mut fast, "a \"b\"\n");
        head.delta(&mut slow, json!({"content": "a \"b\"\n"}), Value::Null);
        let parse = |b: &[u8]| -> Value {
            serde_json::from_slice(b.strip_prefix(b"data: ").unwrap().trim_ascii_end()).unwrap()
        };
        assert_eq!(parse(&fast), parse(&slow));
        assert!(is_type(
            "Text/Event-Stream; charset=utf-8",
            "text/event-stream"
        ));
        assert!(is_json("application/problem+JSON") && !is_json("text/plain"));
    }
}
