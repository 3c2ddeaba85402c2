//! JSON usage scanner: never panics, same answer whatever the chunking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use maas_filter::usage::{JsonUsageScanner, KEY_CAP, USAGE_CAP};

fuzz_target!(|data: &[u8]| {
    let Some((&ctl, body)) = data.split_first() else { return };
    let mut whole = JsonUsageScanner::new();
    whole.feed(body);
    let mut split = JsonUsageScanner::new();
    for c in body.chunks(usize::from(ctl) + 1) {
        split.feed(c);
        assert!(split.buffered_bytes() <= KEY_CAP + USAGE_CAP);
    }
    assert_eq!(whole.finish(), split.finish());
});
