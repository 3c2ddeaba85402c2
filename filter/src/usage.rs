//! Token usage in JSON responses (placeholder API; the real scanner replaces this).

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
}

#[derive(Debug, Default)]
pub struct JsonUsageScanner {}

impl JsonUsageScanner {
    pub fn new() -> Self {
        JsonUsageScanner {}
    }
    pub fn feed(&mut self, _chunk: &[u8]) {}
    pub fn finish(&mut self) -> Option<Usage> {
        None
    }
}
