//! Request body: never panics; a body that inspects fine gets include_usage = true and keeps the
//! other fields.
#![no_main]

use libfuzzer_sys::fuzz_target;
use maas_filter::request_body::{RequestInfo, inspect, with_include_usage};

fuzz_target!(|data: &[u8]| {
    let before = inspect(data);
    let spliced = with_include_usage(data);
    match (before, spliced) {
        (Ok(info), Ok(out)) => {
            let after = inspect(&out).expect("spliced body inspects");
            assert_eq!(after, RequestInfo { include_usage: true, ..info });
        }
        (Err(_), Err(_)) => {}
        (b, s) => panic!("inspect {b:?} but with_include_usage {s:?}"),
    }
});
