//! SSE scanner: never panics, output independent of where the stream is split, observe mode
//! forwards every byte unchanged, strip mode only ever removes whole bytes ranges (output is a
//! subsequence of the input) and memory stays bounded.
#![no_main]

use libfuzzer_sys::fuzz_target;
use maas_filter::sse::{DATA_CAP, EVENT_CAP, LINE_CAP, SseScanner};

fn run(strip: bool, parts: &[&[u8]]) -> (Vec<u8>, Option<maas_filter::usage::Usage>, u64) {
    let mut s = SseScanner::new(strip);
    let mut out = Vec::new();
    for p in parts {
        let o = s.feed(p);
        if !strip {
            assert_eq!(&*o, *p);
        }
        out.extend_from_slice(&o);
        assert!(s.buffered_bytes() <= LINE_CAP + DATA_CAP + EVENT_CAP);
    }
    let (rest, usage) = s.finish();
    out.extend_from_slice(&rest);
    (out, usage, s.content_events())
}

fuzz_target!(|data: &[u8]| {
    let Some((&ctl, stream)) = data.split_first() else { return };
    let strip = ctl & 1 == 1;
    // Split points derived from the control byte: a few chunk sizes.
    let step = usize::from(ctl >> 1) + 1;
    let parts: Vec<&[u8]> = stream.chunks(step).collect();
    let whole = run(strip, &[stream]);
    let split = run(strip, &parts);
    assert_eq!(whole, split);
    if strip {
        // Output is a subsequence of the input.
        let mut it = stream.iter();
        assert!(whole.0.iter().all(|b| it.any(|x| x == b)));
    } else {
        assert_eq!(whole.0, stream);
    }
});
