//! Limit window parser: never panics; what it accepts prints back to a value that parses the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use maas_types::Window;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    if let Ok(w) = Window::parse(s) {
        assert!(w.seconds() > 0);
        let again = Window::parse(&w.to_string()).expect("display parses");
        assert_eq!(again.seconds(), w.seconds());
    }
});
