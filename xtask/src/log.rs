//! What a task says on stderr, prefixed with the entry point's name (`build-wasm-image: …`),
//! as the scripts always have; stdout carries only the result.

pub struct Log {
    prefix: &'static str,
}

impl Log {
    pub const fn new(prefix: &'static str) -> Log {
        Log { prefix }
    }

    pub fn info(&self, message: &str) {
        eprintln!("{}: {message}", self.prefix);
    }
}
