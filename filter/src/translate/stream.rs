//! Anthropic Messages SSE events → OpenAI `chat.completion.chunk` events, event by event.
//!
//! Only the incomplete trailing line and the data of an event not complete yet are carried from
//! one chunk to the next (bounded by [`EVENT_CAP`]); every complete event is translated and
//! handed on at once, so the client sees each token as the provider sends it:
//! - `message_start` → a chunk with `delta: {role: "assistant", content: ""}`;
//! - `content_block_start` of a `tool_use` → a `tool_calls` delta with its id and name;
//! - `content_block_delta`: `text_delta` → a `content` delta, `input_json_delta` → the tool
//!   call's `arguments` delta (thinking deltas are never asked for, and skipped);
//! - `message_delta` → a chunk with an empty delta and the `finish_reason`;
//! - `message_stop` → the usage chunk (`choices: []`) when the client asked
//!   `stream_options.include_usage`, then `data: [DONE]`;
//! - `error` → `data: {"error": …}` (OpenAI's in-stream error), and the stream ends there;
//! - `ping`, `content_block_stop` and unknown events → nothing.

use super::{finish_reason, openai_error, openai_usage};
use crate::usage::UsageCounts;
use serde_json::{Value, json};

/// Largest event (its data plus the current line) carried between chunks; a longer one ends the
/// translation with an error event (real events are a few hundred bytes).
pub const EVENT_CAP: usize = 1024 * 1024;

/// Translates one Messages stream.
#[allow(clippy::struct_excessive_bools)] // parser flags on the stream path
#[derive(Debug)]
pub struct StreamTranslator {
    include_usage: bool,
    created: u64,
    /// The current line, not terminated yet.
    line: Vec<u8>,
    /// A CR ended the last chunk's last line: an LF starting the next chunk belongs to it.
    after_cr: bool,
    /// `data` of the current event, lines joined by `\n`.
    data: Vec<u8>,
    has_data: bool,
    /// Every chunk's bytes up to its delta (`data: {"id":…,"choices":[{"index":0,"delta":`),
    /// written once at `message_start`.
    prefix: Vec<u8>,
    /// The usage chunk's `id`, `object`, `created` and `model` members.
    head: Value,
    /// Content block index → tool call index, for the tool_use blocks seen.
    tools: Vec<(u64, usize)>,
    counts: UsageCounts,
    /// `[DONE]` (or an error) was sent: nothing more is translated.
    done: bool,
}

impl StreamTranslator {
    pub fn new(include_usage: bool, created: u64) -> Self {
        StreamTranslator {
            include_usage,
            created,
            line: Vec::new(),
            after_cr: false,
            data: Vec::new(),
            has_data: false,
            prefix: Vec::new(),
            head: Value::Null,
            tools: Vec::new(),
            counts: UsageCounts::default(),
            done: false,
        }
    }

    /// Bytes carried to the next chunk (an incomplete event).
    pub fn carried(&self) -> usize {
        self.line.len() + self.data.len()
    }

    /// Translates one chunk of the Messages stream: what the client gets for it now.
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<u8> {
        // A chunk's events come out about as long as they went in.
        let mut out = Vec::with_capacity(chunk.len().saturating_mul(2));
        let mut rest = chunk;
        if self.after_cr {
            self.after_cr = false;
            if let Some(tail) = rest.strip_prefix(b"\n") {
                rest = tail;
            }
        }
        while !self.done {
            let Some(at) = memchr::memchr2(b'\n', b'\r', rest) else {
                self.line.extend_from_slice(rest);
                break;
            };
            let (line, tail) = rest.split_at(at);
            self.line.extend_from_slice(line);
            // `tail` starts with the terminator.
            let crlf = tail.starts_with(b"\r\n");
            let lone_cr_at_end = tail == b"\r";
            rest = tail.get(if crlf { 2 } else { 1 }..).unwrap_or_default();
            if lone_cr_at_end {
                self.after_cr = true;
            }
            self.end_line(&mut out);
        }
        if !self.done && self.carried() > EVENT_CAP {
            self.fail(
                &mut out,
                "the provider sent an event too large to translate",
            );
        }
        out
    }

    /// One line ended (in `self.line`).
    fn end_line(&mut self, out: &mut Vec<u8>) {
        let line = std::mem::take(&mut self.line);
        if line.is_empty() {
            // The buffers are kept for the next line and event (no allocation per event).
            self.line = line;
            if self.has_data {
                let mut data = std::mem::take(&mut self.data);
                self.has_data = false;
                self.event(&data, out);
                // A large event's buffer is not kept for the stream's life.
                if data.capacity() <= 64 * 1024 {
                    data.clear();
                    self.data = data;
                }
            }
            return;
        }
        if let Some(value) = line.strip_prefix(b"data:") {
            let value = value.strip_prefix(b" ").unwrap_or(value);
            if self.has_data {
                self.data.push(b'\n');
            }
            self.data.extend_from_slice(value);
            self.has_data = true;
        }
        // `event:` repeats the data's `type`; comments and other fields carry nothing.
        self.line = line;
        self.line.clear();
    }

    /// One complete event's data.
    fn event(&mut self, data: &[u8], out: &mut Vec<u8>) {
        if self.text_delta(data, out) {
            return;
        }
        let Ok(event) = serde_json::from_slice::<Value>(data) else {
            self.fail(out, "the provider sent an event that is not JSON");
            return;
        };
        match event.get("type").and_then(Value::as_str) {
            Some("message_start") => {
                self.start(&event, out);
            }
            Some("content_block_start") => {
                let block = event.get("content_block");
                if block.and_then(|b| b.get("type")).and_then(Value::as_str) == Some("tool_use") {
                    let index = event.get("index").and_then(Value::as_u64).unwrap_or(0);
                    let tool = self.tools.len();
                    self.tools.push((index, tool));
                    let field = |k: &str| block.and_then(|b| b.get(k)).cloned();
                    self.chunk(
                        out,
                        json!({"tool_calls": [{"index": tool, "id": field("id"), "type": "function",
                            "function": {"name": field("name"), "arguments": ""}}]}),
                        Value::Null,
                    );
                }
            }
            Some("content_block_delta") => {
                let delta = event.get("delta");
                let field = |k: &str| delta.and_then(|d| d.get(k)).and_then(Value::as_str);
                match field("type") {
                    Some("text_delta") => {
                        let text = field("text").unwrap_or_default();
                        self.chunk(out, json!({"content": text}), Value::Null);
                    }
                    Some("input_json_delta") => {
                        let index = event.get("index").and_then(Value::as_u64).unwrap_or(0);
                        if let Some(&(_, tool)) = self.tools.iter().find(|(i, _)| *i == index) {
                            let part = field("partial_json").unwrap_or_default();
                            self.chunk(
                                out,
                                json!({"tool_calls": [{"index": tool, "function": {"arguments": part}}]}),
                                Value::Null,
                            );
                        }
                    }
                    _ => {}
                }
            }
            Some("message_delta") => {
                self.merge_usage(event.get("usage"));
                let stop = event
                    .get("delta")
                    .and_then(|d| d.get("stop_reason"))
                    .and_then(Value::as_str);
                self.chunk(out, json!({}), finish_reason(stop));
            }
            Some("message_stop") => {
                if self.include_usage {
                    let mut usage = self.head.clone();
                    if let Some(o) = usage.as_object_mut() {
                        o.insert("choices".into(), json!([]));
                        o.insert("usage".into(), openai_usage(&self.counts));
                    }
                    write_event(out, &usage);
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
                self.done = true;
            }
            Some("error") => {
                if let Some(e) = openai_error(&event) {
                    write_event(out, &e);
                }
                self.done = true;
            }
            _ => {}
        }
    }

    /// The hot path: a text delta (one per token) read as borrowed strings and written after
    /// the prefix, with no JSON tree. `false`: not one (the general path reads it).
    fn text_delta(&self, data: &[u8], out: &mut Vec<u8>) -> bool {
        if !self.prefix.is_empty()
            && let Ok(TextDelta {
                kind: "content_block_delta",
                delta:
                    Delta {
                        kind: "text_delta",
                        text: Some(text),
                    },
            }) = serde_json::from_slice::<TextDelta<'_>>(data)
        {
            out.extend_from_slice(&self.prefix);
            out.extend_from_slice(b"{\"content\":");
            let _ = serde_json::to_writer(&mut *out, &text);
            out.push(b'}');
            out.extend_from_slice(CHUNK_TAIL);
            return true;
        }
        false
    }

    /// `message_start`: the chunks' prefix, the usage so far, and the role chunk.
    fn start(&mut self, event: &Value, out: &mut Vec<u8>) {
        let message = event.get("message");
        let field = |k: &str| message.and_then(|m| m.get(k));
        let id = format!(
            "chatcmpl-{}",
            field("id").and_then(Value::as_str).unwrap_or_default()
        );
        let model = field("model").cloned().unwrap_or(Value::Null);
        let mut prefix = b"data: {\"id\":".to_vec();
        let _ = serde_json::to_writer(&mut prefix, &id);
        prefix.extend_from_slice(b",\"object\":\"chat.completion.chunk\",\"created\":");
        prefix.extend_from_slice(self.created.to_string().as_bytes());
        prefix.extend_from_slice(b",\"model\":");
        let _ = serde_json::to_writer(&mut prefix, &model);
        prefix.extend_from_slice(b",\"choices\":[{\"index\":0,\"delta\":");
        self.prefix = prefix;
        self.head = json!({"id": id, "object": "chat.completion.chunk",
                           "created": self.created, "model": model});
        self.merge_usage(field("usage"));
        self.chunk(
            out,
            json!({"role": "assistant", "content": ""}),
            Value::Null,
        );
    }

    fn merge_usage(&mut self, usage: Option<&Value>) {
        if let Some(counts) = usage.and_then(|u| UsageCounts::deserialize(u).ok()) {
            self.counts.merge(&counts);
        }
    }

    /// A chunk with this delta and finish reason (none before `message_start` named the
    /// message: such an event is not one of a Messages stream).
    fn chunk(&self, out: &mut Vec<u8>, delta: Value, finish: Value) {
        if self.prefix.is_empty() {
            return;
        }
        out.extend_from_slice(&self.prefix);
        let _ = serde_json::to_writer(&mut *out, &delta);
        if finish.is_null() {
            out.extend_from_slice(CHUNK_TAIL);
        } else {
            out.extend_from_slice(b",\"logprobs\":null,\"finish_reason\":");
            let _ = serde_json::to_writer(&mut *out, &finish);
            out.extend_from_slice(b"}]}\n\n");
        }
    }

    /// Ends the translation with an error event (the provider's stream cannot be followed).
    fn fail(&mut self, out: &mut Vec<u8>, message: &str) {
        log::warn!("maas: translated stream: {message}");
        write_event(
            out,
            &json!({"error": {"message": message, "type": "upstream_error", "param": null,
                              "code": "untranslatable_response"}}),
        );
        self.done = true;
        self.line = Vec::new();
        self.data = Vec::new();
    }
}

use serde::Deserialize;

/// What follows the delta of a chunk that does not finish.
const CHUNK_TAIL: &[u8] = b",\"logprobs\":null,\"finish_reason\":null}]}\n\n";

/// A `content_block_delta` read for its text only (borrowed: a text with escapes fails to
/// borrow and is read through the general path).
#[derive(Deserialize)]
struct TextDelta<'a> {
    #[serde(rename = "type", borrow)]
    kind: &'a str,
    #[serde(borrow)]
    delta: Delta<'a>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(rename = "type", borrow)]
    kind: &'a str,
    #[serde(borrow, default)]
    text: Option<&'a str>,
}

fn write_event(out: &mut Vec<u8>, v: &Value) {
    out.extend_from_slice(b"data: ");
    // Writing a Value into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, v);
    out.extend_from_slice(b"\n\n");
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A stream as Anthropic sends it: text, a tool call, usage in start and delta.
    fn anthropic_stream(eol: &str) -> String {
        let events = [
            json!({"type": "message_start", "message": {"id": "msg_1", "type": "message",
                "role": "assistant", "model": "claude-x", "content": [], "stop_reason": null,
                "usage": {"input_tokens": 10, "cache_creation_input_tokens": 0,
                          "cache_read_input_tokens": 2, "output_tokens": 1}}}),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            json!({"type": "ping"}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "lo ✓"}}),
            json!({"type": "content_block_stop", "index": 0}),
            json!({"type": "content_block_start", "index": 1, "content_block":
                {"type": "tool_use", "id": "toolu_1", "name": "get", "input": {}}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"q\":"}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "\"a\"}"}}),
            json!({"type": "content_block_stop", "index": 1}),
            json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null},
                   "usage": {"output_tokens": 5}}),
            json!({"type": "message_stop"}),
        ];
        events
            .iter()
            .map(|e| {
                let t = e["type"].as_str().unwrap();
                format!("event: {t}{eol}data: {e}{eol}{eol}")
            })
            .collect()
    }

    fn events_of(out: &[u8]) -> Vec<Value> {
        let text = std::str::from_utf8(out).unwrap();
        text.split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let data = e.strip_prefix("data: ").unwrap();
                if data == "[DONE]" {
                    json!("[DONE]")
                } else {
                    serde_json::from_str(data).unwrap()
                }
            })
            .collect()
    }

    #[test]
    fn a_stream_becomes_chunks_then_done() {
        let mut t = StreamTranslator::new(true, 7);
        let out = t.feed(anthropic_stream("\n").as_bytes());
        let events = events_of(&out);
        let deltas: Vec<&Value> = events
            .iter()
            .filter_map(|e| e.get("choices")?.get(0)?.get("delta"))
            .collect();
        assert_eq!(
            deltas,
            [
                &json!({"role": "assistant", "content": ""}),
                &json!({"content": "Hel"}),
                &json!({"content": "lo ✓"}),
                &json!({"tool_calls": [{"index": 0, "id": "toolu_1", "type": "function",
                    "function": {"name": "get", "arguments": ""}}]}),
                &json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"q\":"}}]}),
                &json!({"tool_calls": [{"index": 0, "function": {"arguments": "\"a\"}"}}]}),
                &json!({}),
            ]
        );
        let first = &events[0];
        assert_eq!(first["id"], "chatcmpl-msg_1");
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["model"], "claude-x");
        assert_eq!(first["created"], 7);
        let n = events.len();
        assert_eq!(events[n - 3]["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(events[n - 2]["choices"], json!([]));
        assert_eq!(
            events[n - 2]["usage"],
            json!({"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17,
                   "prompt_tokens_details": {"cached_tokens": 2}})
        );
        assert_eq!(events[n - 1], json!("[DONE]"));
        assert_eq!(t.carried(), 0);
    }

    #[test]
    fn text_with_escapes_takes_the_general_path_and_is_the_same() {
        let mut t = StreamTranslator::new(false, 0);
        let start = r#"{"type":"message_start","message":{"id":"m","model":"c","usage":{}}}"#;
        let escaped = r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a \"q\"\n\u00e9"}}"#;
        let plain = r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"plain"}}"#;
        let out =
            t.feed(format!("data: {start}\n\ndata: {escaped}\n\ndata: {plain}\n\n").as_bytes());
        let events = events_of(&out);
        assert_eq!(
            events[1]["choices"][0]["delta"],
            json!({"content": "a \"q\"\né"})
        );
        assert_eq!(
            events[2]["choices"][0]["delta"],
            json!({"content": "plain"})
        );
        // Both paths write the same chunk around the delta.
        let strip = |v: &Value| {
            let mut v = v.clone();
            v["choices"][0]["delta"] = Value::Null;
            v
        };
        assert_eq!(strip(&events[1]), strip(&events[2]));
        assert_eq!(events[1]["choices"][0]["finish_reason"], Value::Null);
    }

    #[test]
    fn without_include_usage_no_usage_chunk() {
        let mut t = StreamTranslator::new(false, 0);
        let events = events_of(&t.feed(anthropic_stream("\n").as_bytes()));
        assert!(events.iter().all(|e| e.get("usage").is_none()));
        assert_eq!(events.last().unwrap(), &json!("[DONE]"));
    }

    #[test]
    fn an_error_event_becomes_an_openai_error_and_ends_the_stream() {
        let mut t = StreamTranslator::new(false, 0);
        let out = t.feed(
            b"event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        );
        assert_eq!(
            events_of(&out),
            [
                json!({"error": {"message": "Overloaded", "type": "overloaded_error", "param": null, "code": null}})
            ]
        );
    }

    #[test]
    fn an_incomplete_event_is_carried_not_translated() {
        let mut t = StreamTranslator::new(false, 0);
        let s = anthropic_stream("\n");
        let cut = s.find("Hel").unwrap();
        let first = t.feed(&s.as_bytes()[..cut]);
        // message_start and the block start are complete; the delta is carried.
        assert_eq!(events_of(&first).len(), 1);
        assert!(t.carried() > 0 && t.carried() < 200);
        let second = t.feed(&s.as_bytes()[cut..]);
        assert!(events_of(&second).len() > 1);
    }

    #[test]
    fn an_oversized_event_fails_the_stream_bounded() {
        let mut t = StreamTranslator::new(false, 0);
        let big = vec![b'x'; EVENT_CAP + 10];
        let mut out = t.feed(b"data: ");
        out.extend(t.feed(&big));
        assert_eq!(t.carried(), 0);
        assert_eq!(
            events_of(&out)[0]["error"]["code"],
            "untranslatable_response"
        );
        assert!(t.feed(b"\n\n").is_empty());
    }

    proptest! {
        /// Wherever the chunk boundaries fall (and whatever line ends the provider uses), the
        /// translated stream is the same as for the stream in one piece.
        #[test]
        fn chunk_boundaries_anywhere_give_the_same_stream(
            cuts in proptest::collection::vec(0usize..4000, 0..40),
            eol in proptest::sample::select(vec!["\n", "\r\n", "\r"]),
        ) {
            let s = anthropic_stream(eol);
            let bytes = s.as_bytes();
            let whole = StreamTranslator::new(true, 3).feed(bytes);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
            cuts.sort_unstable();
            let mut t = StreamTranslator::new(true, 3);
            let mut pieces = Vec::new();
            let mut from = 0;
            for c in cuts.into_iter().chain([bytes.len()]) {
                pieces.extend(t.feed(&bytes[from..c]));
                from = c;
            }
            prop_assert_eq!(&pieces, &whole);
            let last = events_of(&whole).pop();
            prop_assert_eq!(last, Some(json!("[DONE]")));
        }
    }
}
