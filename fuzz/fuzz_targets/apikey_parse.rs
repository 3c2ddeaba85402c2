//! API key format parser: never panics; what it accepts has the documented shape.
#![no_main]

use libfuzzer_sys::fuzz_target;
use maas_types::apikey;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    if let Ok(parts) = apikey::parse(s) {
        assert!(s.starts_with(apikey::KEY_PREFIX));
        assert_eq!(s.len(), apikey::KEY_LEN);
        assert_eq!(parts.key_id.len(), apikey::KEY_ID_LEN);
        assert_eq!(parts.secret.len(), apikey::SECRET_LEN);
        assert!(apikey::is_key_id(parts.key_id));
        let _ = apikey::hash(parts);
    }
});
