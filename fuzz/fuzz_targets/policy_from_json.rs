//! Policy document parser and validation: never panics on any input.
#![no_main]

use libfuzzer_sys::fuzz_target;
use maas_types::PolicyDocument;

fuzz_target!(|data: &[u8]| {
    let _ = PolicyDocument::from_json(data);
});
