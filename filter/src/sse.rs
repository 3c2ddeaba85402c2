//! Server-sent events (`text/event-stream`) scanning of streamed completions.
//!
//! [`SseScanner`] follows the WHATWG event-stream rules (lines end with LF, CRLF or CR; an event ends
//! at a blank line; `data:` lines of one event are joined with `\n`; lines starting with `:` are
//! comments) and, for every event, reads just what the gateway needs from its JSON data: the
//! token counts, whether `choices` is empty, whether the event carries a non-empty content delta.
//! Only events that may carry usage (a `usage` key with an object value) are JSON-parsed; the
//! others (every content chunk) are read by a cheap byte scan ([`summarize_event`]).
//!
//! The usage of every supported API family is found, whatever the request asked:
//! - OpenAI chat/completions: a top-level `usage` (the usage-only chunk `choices: []` when
//!   `stream_options.include_usage` was set, or vLLM's last content chunk);
//! - OpenAI Responses: `response.usage` of `response.completed` (also `response.incomplete` and
//!   `response.failed`); content events are `response.*.delta` with a non-empty `delta`;
//! - Anthropic Messages: `message.usage` of `message_start` (input and cache tokens, output 1),
//!   then the cumulative `usage.output_tokens` of `message_delta` (the last one wins); content
//!   events are `content_block_delta`.
//!
//! Counts are merged across events field by field ([`UsageCounts::merge`]). Only the OpenAI
//! usage-only chunk (a top-level `usage` with `choices: []`) is ever stripped, and only in strip
//! mode (when the gateway itself asked for usage).
//!
//! Memory per stream is bounded and does not grow with the stream: the partial line carried across
//! chunks ([`LINE_CAP`]), the current event's data ([`DATA_CAP`]) and, only when stripping, the raw
//! bytes of the current incomplete event ([`EVENT_CAP`]). The buffers are reused from event to event.
//! An event with a longer line or more data (a Responses `response.completed` repeats the whole
//! output, instructions and tools) is not parsed whole: its data is scanned as it passes
//! ([`JsonUsageScanner::with_nested_usage`], bounded) for `usage`, `response.usage` and
//! `message.usage` only, and it is never stripped.
//!
//! Every decision depends on the bytes only, never on where the chunks were split: feeding a stream
//! in any number of pieces forwards the same bytes and finds the same usage as feeding it whole.

mod event;

pub use event::{EventSummary, parse_event, summarize_event};

use crate::usage::{JsonUsageScanner, Usage, UsageCounts};
use event::find_either;
use std::borrow::Cow;

/// Longest line (without its terminator) read; a longer line spoils its event (only scanned for
/// usage, never stripped).
pub const LINE_CAP: usize = 64 * 1024;
/// Most data bytes kept for one event; an event with more is only scanned for usage, never stripped.
pub const DATA_CAP: usize = 64 * 1024;
/// First capacity of the event data buffer (a chat chunk is a few hundred bytes).
const DATA_START: usize = 512;
/// Largest event (raw bytes) that may be held back to be stripped; a larger one is forwarded.
pub const EVENT_CAP: usize = 64 * 1024;

/// What happens to the LF that may follow a CR which ended an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AfterCr {
    /// The last byte was not a CR line terminator.
    No,
    /// A CR ended a line inside an event: a following LF is part of the event.
    InEvent,
    /// A CR ended an event that was forwarded: a following LF is forwarded too.
    Forwarded,
    /// A CR ended an event that was stripped: a following LF is stripped too.
    Stripped,
}

/// Scanner for one `text/event-stream` response body.
#[allow(clippy::struct_excessive_bools)] // parser flags on the stream hot path (measured in V8; see tests/bench/notes.md)
#[derive(Debug)]
pub struct SseScanner {
    strip: bool,
    /// Partial line carried over from the previous chunk.
    line: Vec<u8>,
    /// Length of the current line so far (it may exceed what `line` keeps).
    line_len: usize,
    after_cr: AfterCr,
    /// `data` of the current event, each line followed by `\n`.
    data: Vec<u8>,
    has_data: bool,
    /// The current event has a line or data too large to read.
    spoiled: bool,
    /// The data of a spoiled event, scanned as it passes for its usage (a Responses
    /// `response.completed` repeats the whole output and can exceed [`DATA_CAP`]); bounded.
    spill: Option<Box<JsonUsageScanner>>,
    /// The current (overlong) line is a `data` line whose value goes to `spill`.
    spill_line: bool,
    /// Raw bytes of the current event so far.
    event_len: usize,
    /// Strip mode: raw bytes of the current event held back from earlier chunks.
    held: Vec<u8>,
    /// Strip mode: the current event grew beyond [`EVENT_CAP`] and is forwarded as it comes.
    passthrough: bool,
    done: bool,
    /// Every count seen so far, merged event by event.
    counts: UsageCounts,
    content_events: u64,
    /// Content events since the last event that stated a completion count (not covered by it).
    content_since_usage: u64,
    events: u64,
    stripped_events: u64,
    max_buffered: usize,
}

impl SseScanner {
    pub fn new(strip_usage_only_event: bool) -> Self {
        SseScanner {
            strip: strip_usage_only_event,
            line: Vec::new(),
            line_len: 0,
            after_cr: AfterCr::No,
            data: Vec::new(),
            has_data: false,
            spoiled: false,
            spill: None,
            spill_line: false,
            event_len: 0,
            held: Vec::new(),
            passthrough: false,
            done: false,
            counts: UsageCounts::default(),
            content_events: 0,
            content_since_usage: 0,
            events: 0,
            stripped_events: 0,
            max_buffered: 0,
        }
    }

    /// Feeds one chunk of a text/event-stream body; returns what to forward now.
    ///
    /// When not stripping, it is always exactly `chunk` (borrowed) and scanning only observes.
    /// The result is `Cow::Borrowed` exactly when it is the whole chunk unchanged; `Cow::Owned`
    /// (possibly empty) means the chunk must be replaced by it.
    /// When stripping, the usage-only event (`choices: []` with `usage`) is removed; the bytes of the
    /// current incomplete event are held back (at most [`EVENT_CAP`]) until it completes.
    pub fn feed<'a>(&mut self, chunk: &'a [u8]) -> Cow<'a, [u8]> {
        let mut out = Out::new(chunk);
        // Start (in `chunk`) of the bytes of the current event not yet forwarded or held.
        let mut event_from = 0usize;
        let mut pos = 0usize;
        while pos < chunk.len() {
            let Some(rest) = chunk.get(pos..) else { break };
            if self.after_cr != AfterCr::No {
                let after = std::mem::replace(&mut self.after_cr, AfterCr::No);
                if rest.first() == Some(&b'\n') {
                    match after {
                        AfterCr::InEvent => self.event_len = self.event_len.saturating_add(1),
                        AfterCr::Forwarded => out.forward(pos, pos.saturating_add(1)),
                        AfterCr::Stripped | AfterCr::No => {}
                    }
                    pos = pos.saturating_add(1);
                    if after != AfterCr::InEvent {
                        event_from = pos;
                    }
                    continue;
                }
            }
            let Some(n) = find_either(rest, b'\n', b'\r') else {
                // Partial line: keep it for the next chunk.
                self.event_len = self.event_len.saturating_add(rest.len());
                self.partial_line(rest);
                break;
            };
            let Some(&term) = rest.get(n) else { break };
            let line_end = pos.saturating_add(n);
            let next = line_end.saturating_add(1);
            // Bytes of this line incl. its terminator (the LF of a CRLF is counted when seen).
            self.event_len = self.event_len.saturating_add(n).saturating_add(1);
            let ends_event = if self.line.is_empty() && self.line_len == 0 {
                self.line_len = n;
                let line = rest.get(..n).unwrap_or_default();
                self.process_line(line)
            } else {
                self.partial_line(rest.get(..n).unwrap_or_default());
                let line = std::mem::take(&mut self.line);
                let ends = self.process_line(&line);
                self.line = line;
                self.line.clear();
                ends
            };
            self.line_len = 0;
            pos = next;
            if ends_event {
                let strip = self.dispatch();
                if self.strip {
                    if strip {
                        self.held.clear();
                    } else {
                        if !self.held.is_empty() {
                            out.forward_bytes(&self.held);
                            self.held.clear();
                        }
                        out.forward(event_from, next);
                    }
                } else {
                    out.forward(event_from, next);
                }
                self.passthrough = false;
                self.event_len = 0;
                event_from = next;
                self.after_cr = match (term, strip) {
                    (b'\r', true) => AfterCr::Stripped,
                    (b'\r', false) => AfterCr::Forwarded,
                    _ => AfterCr::No,
                };
            } else if term == b'\r' {
                self.after_cr = AfterCr::InEvent;
            }
        }
        // The rest of the chunk belongs to the current, incomplete event.
        let tail = chunk.get(event_from..).unwrap_or_default();
        if !self.strip {
            out.forward(event_from, chunk.len());
        } else if !tail.is_empty() {
            if self.passthrough {
                out.forward(event_from, chunk.len());
            } else if self.held.len().saturating_add(tail.len()) > EVENT_CAP {
                // Too large to hold: give up stripping this event and forward it as it comes.
                out.forward_bytes(&self.held);
                self.held = Vec::new();
                out.forward(event_from, chunk.len());
                self.passthrough = true;
            } else {
                self.held.extend_from_slice(tail);
            }
        }
        self.note_buffered();
        out.finish()
    }

    /// End of stream: bytes still held (to forward now) and the usage seen, if any.
    ///
    /// An unterminated last event is read for usage too (but always forwarded).
    pub fn finish(&mut self) -> (Vec<u8>, Option<Usage>) {
        if self.line_len > 0 || !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.process_line(&line);
            self.line_len = 0;
        }
        if self.has_data {
            self.dispatch();
        }
        self.after_cr = AfterCr::No;
        self.passthrough = false;
        self.event_len = 0;
        (std::mem::take(&mut self.held), self.usage())
    }

    /// The usage seen so far: the counts of every event merged (the last one winning), plus one
    /// completion token per content event that came after the last stated completion count.
    ///
    /// A complete stream states its final count last (OpenAI's usage chunk, Anthropic's
    /// `message_delta`, Responses' `response.completed`), so nothing is added; a stream cut after
    /// Anthropic's `message_start` (input tokens, `output_tokens: 1`) is counted its exact prompt
    /// and at least what it streamed.
    pub fn usage(&self) -> Option<Usage> {
        let mut u = self.counts.usage()?;
        u.completion_tokens = u.completion_tokens.saturating_add(self.content_since_usage);
        u.total_tokens = u.total_tokens.saturating_add(self.content_since_usage);
        Some(u)
    }

    /// Number of events carrying a non-empty content delta (`choices[].delta.content` or
    /// `choices[].text`; Anthropic `content_block_delta`; Responses `response.*.delta`), to
    /// estimate completion tokens when usage never arrives. Exact for the chunk shapes of these
    /// APIs, an estimate otherwise (see [`summarize_event`]).
    pub fn content_events(&self) -> u64 {
        self.content_events
    }

    /// Whether `data: [DONE]` was seen.
    pub fn done(&self) -> bool {
        self.done
    }

    /// Events dispatched (events with data) so far.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// Usage-only events removed so far (strip mode).
    pub fn stripped_events(&self) -> u64 {
        self.stripped_events
    }

    /// Bytes buffered right now (partial line, event data, held event, usage scan of a spoiled
    /// event).
    pub fn buffered_bytes(&self) -> usize {
        let spill = self.spill.as_ref().map_or(0, |s| s.buffered_bytes());
        self.line
            .len()
            .saturating_add(self.data.len())
            .saturating_add(self.held.len())
            .saturating_add(spill)
    }

    /// Largest [`Self::buffered_bytes`] seen at the end of a `feed`.
    pub fn max_buffered_bytes(&self) -> usize {
        self.max_buffered
    }

    fn note_buffered(&mut self) {
        self.max_buffered = self.max_buffered.max(self.buffered_bytes());
    }

    /// Appends the start of a line that continues in the next chunk.
    fn partial_line(&mut self, part: &[u8]) {
        let before = self.line_len;
        self.line_len = self.line_len.saturating_add(part.len());
        if self.spill_line {
            self.spill_bytes(part);
        } else if before <= LINE_CAP && self.line_len > LINE_CAP {
            self.spill_overlong_line(part);
        }
        if self.line_len > LINE_CAP {
            // Keep only enough to know the field name; the line itself is unreadable.
            if self.line.len() > 8 {
                self.line.truncate(8);
                self.line.shrink_to_fit();
            } else if self.line.len() < 8 {
                let room = 8usize.saturating_sub(self.line.len());
                self.line
                    .extend_from_slice(part.get(..room.min(part.len())).unwrap_or_default());
            }
        } else {
            self.line.extend_from_slice(part);
        }
    }

    /// The line being read (`self.line` then `part`) just grew past [`LINE_CAP`]: when it is a
    /// `data` line, its value so far goes to the spill scan, and the rest of it as it comes.
    fn spill_overlong_line(&mut self, part: &[u8]) {
        let kept = self.line.len();
        let byte = |i: usize| {
            self.line
                .get(i)
                .or_else(|| part.get(i.saturating_sub(kept)))
                .copied()
        };
        let is_data = (0..5usize).all(|i| byte(i) == b"data:".get(i).copied());
        if !is_data {
            return;
        }
        let value_from = if byte(5) == Some(b' ') { 6 } else { 5 };
        self.start_spill();
        let line = std::mem::take(&mut self.line);
        self.spill_bytes(line.get(value_from..).unwrap_or_default());
        self.line = line;
        self.spill_bytes(
            part.get(value_from.saturating_sub(kept)..)
                .unwrap_or_default(),
        );
        self.spill_line = true;
    }

    /// Starts scanning the current event's data as it passes (with what was kept so far).
    fn start_spill(&mut self) {
        if self.spill.is_none() {
            let mut scan = Box::new(JsonUsageScanner::with_nested_usage());
            scan.feed(&self.data);
            self.spill = Some(scan);
            self.data.clear();
        }
    }

    fn spill_bytes(&mut self, bytes: &[u8]) {
        if let Some(s) = self.spill.as_mut() {
            s.feed(bytes);
        }
    }

    /// Processes one complete line (without terminator); `true` when it is blank (end of event).
    fn process_line(&mut self, line: &[u8]) -> bool {
        let overlong = self.line_len > LINE_CAP;
        if line.is_empty() && !overlong {
            return true;
        }
        if line.first() == Some(&b':') {
            return false; // comment
        }
        let (name, value) = match line.iter().position(|&b| b == b':') {
            Some(c) => {
                let name = line.get(..c).unwrap_or_default();
                let mut value = line.get(c.saturating_add(1)..).unwrap_or_default();
                if let Some(v) = value.strip_prefix(b" ") {
                    value = v;
                }
                (name, value)
            }
            None => (line, &[][..]),
        };
        if name != b"data" {
            return false;
        }
        self.has_data = true;
        if self.spill_line {
            // The value went to the spill scan as it came (see `partial_line`).
            self.spill_line = false;
            self.spill_bytes(b"\n");
            self.spoiled = true;
            return false;
        }
        if overlong
            || self.spoiled
            || self
                .data
                .len()
                .saturating_add(value.len())
                .saturating_add(1)
                > DATA_CAP
        {
            // Too large to parse whole: scan it for usage as it passes.
            self.spoiled = true;
            self.start_spill();
            self.spill_bytes(value);
            self.spill_bytes(b"\n");
            return false;
        }
        if self.data.capacity() == 0 {
            // Sized once for the stream's usual events (kept from event to event).
            self.data
                .reserve(value.len().saturating_add(1).max(DATA_START));
        }
        self.data.extend_from_slice(value);
        self.data.push(b'\n');
        false
    }

    /// End of an event: reads its data; returns whether to strip it.
    fn dispatch(&mut self) -> bool {
        let mut strip = false;
        if self.has_data && !self.spoiled {
            self.events = self.events.saturating_add(1);
            let data = self.data.strip_suffix(b"\n").unwrap_or(&self.data);
            if data == b"[DONE]" {
                self.done = true;
            } else if let Some(ev) = summarize_event(data) {
                self.counts.merge(&ev.counts);
                if ev.content {
                    self.content_events = self.content_events.saturating_add(1);
                }
                if ev.counts.completion_tokens.is_some() || ev.counts.output_tokens.is_some() {
                    // This count covers every content event so far, its own included.
                    self.content_since_usage = 0;
                } else if ev.content {
                    self.content_since_usage = self.content_since_usage.saturating_add(1);
                }
                strip = self.strip
                    && ev.usage.is_some()
                    && ev.choices == Some(0)
                    && !self.passthrough
                    && self.event_len <= EVENT_CAP;
            }
        }
        if let Some(mut spill) = self.spill.take()
            && let Some(counts) = spill.finish_counts()
        {
            self.counts.merge(&counts);
            if counts.completion_tokens.is_some() || counts.output_tokens.is_some() {
                self.content_since_usage = 0;
            }
        }
        self.spill_line = false;
        if strip {
            self.stripped_events = self.stripped_events.saturating_add(1);
        }
        self.data.clear();
        if self.data.capacity() > 4 * 1024 {
            self.data = Vec::new();
        }
        self.has_data = false;
        self.spoiled = false;
        strip
    }
}

/// Output of one `feed`: borrowed from the chunk as long as it is a prefix of it.
struct Out<'a> {
    chunk: &'a [u8],
    borrowed_end: usize,
    owned: Option<Vec<u8>>,
}

impl<'a> Out<'a> {
    fn new(chunk: &'a [u8]) -> Self {
        Out {
            chunk,
            borrowed_end: 0,
            owned: None,
        }
    }

    fn owned(&mut self) -> &mut Vec<u8> {
        let (chunk, end) = (self.chunk, self.borrowed_end);
        self.owned
            .get_or_insert_with(|| chunk.get(..end).unwrap_or_default().to_vec())
    }

    /// Forwards `chunk[from..to]`.
    fn forward(&mut self, from: usize, to: usize) {
        if to <= from {
            return;
        }
        if self.owned.is_none() && from == self.borrowed_end {
            self.borrowed_end = to;
            return;
        }
        let bytes = self.chunk.get(from..to).unwrap_or_default();
        self.owned().extend_from_slice(bytes);
    }

    /// Forwards bytes held from earlier chunks.
    fn forward_bytes(&mut self, bytes: &[u8]) {
        if !bytes.is_empty() {
            self.owned().extend_from_slice(bytes);
        }
    }

    /// `Cow::Borrowed` only when the output is the whole chunk unchanged, so a caller can tell
    /// "forward as is" from "replace the body chunk" by the variant alone.
    fn finish(self) -> Cow<'a, [u8]> {
        match self.owned {
            Some(v) => Cow::Owned(v),
            None if self.borrowed_end >= self.chunk.len() => Cow::Borrowed(self.chunk),
            None => Cow::Owned(
                self.chunk
                    .get(..self.borrowed_end)
                    .unwrap_or_default()
                    .to_vec(),
            ),
        }
    }
}

/// What replaces a response chunk after scanning: `forward` (what the scanner returned for it)
/// followed by `held` (what the scanner still held at the end of the stream). `None` when the
/// chunk the host already has goes on untouched (nothing stripped, nothing held): no copy and no
/// host call.
pub fn splice(forward: Cow<'_, [u8]>, held: &[u8]) -> Option<Vec<u8>> {
    match forward {
        Cow::Owned(mut out) => {
            out.extend_from_slice(held);
            Some(out)
        }
        Cow::Borrowed(b) if !held.is_empty() => {
            let mut out = Vec::with_capacity(b.len() + held.len());
            out.extend_from_slice(b);
            out.extend_from_slice(held);
            Some(out)
        }
        Cow::Borrowed(_) => None,
    }
}

#[cfg(test)]
mod tests;
