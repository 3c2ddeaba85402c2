//! Server-sent events scanning (placeholder API; the real scanner replaces this).

use crate::usage::Usage;
use std::borrow::Cow;

#[derive(Debug, Default)]
pub struct SseScanner {}

impl SseScanner {
    pub fn new(_strip_usage_only_event: bool) -> Self {
        SseScanner {}
    }
    pub fn feed<'a>(&mut self, chunk: &'a [u8]) -> Cow<'a, [u8]> {
        Cow::Borrowed(chunk)
    }
    pub fn finish(&mut self) -> (Vec<u8>, Option<Usage>) {
        (Vec::new(), None)
    }
    pub fn usage(&self) -> Option<Usage> {
        None
    }
    pub fn content_events(&self) -> u64 {
        0
    }
}
