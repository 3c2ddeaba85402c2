//! pluginConfig parser: never panics; an accepted config satisfies every documented bound; a
//! refusal names the field (or, for the document as a whole, the JSON position or missing field).
#![no_main]

use libfuzzer_sys::fuzz_target;
use maas_filter::config::PluginConfig;

fuzz_target!(|data: &[u8]| {
    match PluginConfig::parse(data) {
        Ok(c) => {
            let a = &c.companion;
            assert!(!a.cluster.is_empty() && a.cluster.trim() == a.cluster);
            assert!(!a.authority.trim().is_empty());
            assert!(!a.authority.bytes().any(|b| b.is_ascii_control() || b == b' '));
            assert!((1..=60_000).contains(&a.timeout_ms));
            assert!((100..=3_600_000).contains(&c.poll_interval_ms));
            assert!((1..=10_000_000).contains(&c.cache.max_entries));
            assert!(c.cache.max_ttl_seconds <= 86_400);
            assert!(c.cache.negative_ttl_seconds <= 3_600);
            assert!((1024..=64 * 1024 * 1024).contains(&c.max_request_body_bytes));
            for h in &c.remove_headers {
                assert!(!h.is_empty() && *h == h.to_ascii_lowercase());
                assert!(!["host", "content-length", "transfer-encoding"].contains(&h.as_str()));
            }
            let p = &c.management_path_prefix;
            assert!(p.starts_with('/') && p.len() >= 2 && !p.ends_with('/') && !p.contains("//"));
            if let Some(policy) = &c.bootstrap_policy {
                assert!(policy.validate().is_ok());
            }
            assert_eq!(PluginConfig::parse(data).ok(), Some(c), "deterministic");
        }
        Err(e) => {
            let text = e.to_string();
            assert!(!e.message.is_empty());
            if e.field.is_empty() {
                assert!(text.starts_with("pluginConfig: "), "{text}");
                assert!(
                    e.message.contains(" line ") || e.message.contains("field `"),
                    "{text}"
                );
            } else {
                assert!(text.starts_with(&format!("pluginConfig.{}: ", e.field)), "{text}");
            }
        }
    }
});
