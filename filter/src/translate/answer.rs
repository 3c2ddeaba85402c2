//! A translated request's answer as it passes, chunk by chunk: what the client gets for each
//! chunk of the provider's answer.

use super::chunks::{Decoding, KeptJson, is_json, is_type, unreadable_answer};
use super::request::ClientAsk;
use super::stream::StreamTranslator;
use crate::encoding::Coding;

#[derive(Debug)]
enum Mode {
    /// A JSON answer (a message or an error): kept whole, translated at its end.
    Json(KeptJson),
    /// An event stream: translated event by event.
    Sse(Box<StreamTranslator>),
    /// A body the gateway cannot read (compressed with a coding it cannot decode although
    /// identity was asked for, or corrupt): replaced by an OpenAI error at its end.
    Unreadable { sse: bool },
    /// Neither JSON nor a stream (an Envoy error page…): passed as it is.
    Passthrough,
}

/// One translated answer.
#[derive(Debug)]
pub struct Answer {
    mode: Mode,
    created: u64,
    /// A gzip or deflate answer (identity was asked for): decoded before it is translated.
    decoding: Decoding,
}

impl Answer {
    /// `content_type` and `coding` of the provider's answer; `created`: now, in seconds (the
    /// OpenAI `created`).
    pub fn new(content_type: &str, coding: Coding, ask: ClientAsk, created: u64) -> Self {
        let sse = is_type(content_type, "text/event-stream");
        let json = is_json(content_type);
        let decoding = Decoding::new(coding, sse || json);
        let mode = if decoding.unreadable() {
            Mode::Unreadable { sse }
        } else if sse {
            Mode::Sse(Box::new(StreamTranslator::new(ask.include_usage, created)))
        } else if json {
            Mode::Json(KeptJson::default())
        } else {
            Mode::Passthrough
        };
        Answer {
            mode,
            created,
            decoding,
        }
    }

    /// Whether the answer's `content-encoding` must go (its body is replaced by plain bytes).
    pub fn drops_encoding(&self) -> bool {
        self.decoding.drops_encoding()
    }

    /// Bytes kept for later chunks.
    pub fn pending(&self) -> usize {
        match &self.mode {
            Mode::Json(kept) => kept.kept(),
            Mode::Sse(t) => t.carried(),
            Mode::Unreadable { .. } | Mode::Passthrough => 0,
        }
    }

    /// One chunk of the provider's answer (`end`: its last): what the client gets now.
    pub fn feed(&mut self, chunk: &[u8], end: bool) -> Vec<u8> {
        let Some(chunk) = self.decoding.decode(chunk, end) else {
            let sse = matches!(self.mode, Mode::Sse(_) | Mode::Unreadable { sse: true });
            self.mode = Mode::Unreadable { sse };
            return unreadable_answer(sse, end);
        };
        let chunk = chunk.as_ref();
        match &mut self.mode {
            Mode::Passthrough => chunk.to_vec(),
            Mode::Sse(t) => t.feed(chunk),
            Mode::Unreadable { sse } => unreadable_answer(*sse, end),
            Mode::Json(kept) => {
                let kept = match kept.feed(chunk, end) {
                    None => return Vec::new(),
                    Some(Err(error)) => return error,
                    Some(Ok(kept)) => kept,
                };
                // Neither a message nor an Anthropic error: passed as it came.
                super::response::translate(&kept, self.created).unwrap_or(kept)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn a_json_answer_is_kept_until_its_end_then_translated() {
        let mut a = Answer::new(
            "application/json",
            Coding::Identity,
            ClientAsk::default(),
            1,
        );
        let body = br#"{"id":"m","type":"message","model":"c","content":[{"type":"text","text":"hi"}],"stop_reason":"end_turn","usage":{"input_tokens":1,"output_tokens":2}}"#;
        let (head, tail) = body.split_at(20);
        assert!(a.feed(head, false).is_empty());
        assert_eq!(a.pending(), 20);
        let out: Value = serde_json::from_slice(&a.feed(tail, true)).unwrap();
        assert_eq!(out["choices"][0]["message"]["content"], "hi");
        assert_eq!(out["usage"]["total_tokens"], 3);
    }

    /// Compressed although identity was asked for: gzip and deflate are decoded then
    /// translated (the client gets plain bytes); another coding, or a corrupt body, becomes an
    /// error at its end.
    #[test]
    fn a_compressed_answer_is_decoded_or_becomes_an_error() {
        use std::io::Write;
        let body = br#"{"id":"m","type":"message","model":"c","content":[{"type":"text","text":"hi"}],"stop_reason":"end_turn","usage":{"input_tokens":1,"output_tokens":2}}"#;
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::fast());
        z.write_all(body).unwrap();
        let z = z.finish().unwrap();
        let mut a = Answer::new("application/json", Coding::Deflate, ClientAsk::default(), 1);
        assert!(a.drops_encoding());
        let (head, tail) = z.split_at(5);
        assert!(a.feed(head, false).is_empty());
        let out: Value = serde_json::from_slice(&a.feed(tail, true)).unwrap();
        assert_eq!(out["choices"][0]["message"]["content"], "hi");
        let mut a = Answer::new("application/json", Coding::Gzip, ClientAsk::default(), 1);
        assert!(a.feed(b"\x1f\x8b", false).is_empty());
        let out: Value = serde_json::from_slice(&a.feed(b"", true)).unwrap();
        assert_eq!(out["error"]["code"], "untranslatable_response");
        let sse = ClientAsk {
            stream: true,
            include_usage: false,
        };
        let mut a = Answer::new("text/event-stream", Coding::Unreadable, sse, 1);
        assert!(a.drops_encoding());
        assert!(a.feed(b"\x28\xb5", false).is_empty());
        let out = String::from_utf8(a.feed(b"", true)).unwrap();
        assert!(
            out.starts_with("data: {") && out.contains("untranslatable_response"),
            "{out}"
        );
    }

    #[test]
    fn other_bodies_pass() {
        let mut a = Answer::new("text/plain", Coding::Identity, ClientAsk::default(), 1);
        assert_eq!(
            a.feed(b"upstream connect error", true),
            b"upstream connect error"
        );
        let mut j = Answer::new(
            "application/json",
            Coding::Identity,
            ClientAsk::default(),
            1,
        );
        assert_eq!(j.feed(b"[1]", true), b"[1]");
    }
}
