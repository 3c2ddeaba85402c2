use super::*;

#[test]
fn envoys_instructions_are_read_from_a_callgrind_dump_and_rendered_by_part() {
    let dump = "version: 1\ncreator: callgrind-3.19.0\npid: 7\ncmd: envoy\npart: 2\n\nevents: Ir\nsummary: 135467197\n\nfn=x\n0 5\ntotals: 135467197\n";
    assert_eq!(callgrind_total(dump), Some(135_467_197));
    assert_eq!(callgrind_total("events: Ir\n"), None);
    let dir = std::env::temp_dir().join(format!("maas-bench-cg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("callgrind-envoy.out");
    for n in [1, 2, 10] {
        std::fs::write(dir.join(format!("callgrind-envoy.out.{n}")), dump).unwrap();
    }
    std::fs::write(dir.join("callgrind-envoy.out.x"), dump).unwrap();
    assert_eq!(newest_dump(&out).map(|(n, _)| n), Some(10));
    std::fs::remove_dir_all(&dir).unwrap();
    let row = |variant: &str, per_request: f64| EnvoyInstructionRow {
        variant: variant.into(),
        per_request,
        requests: 500,
        idle_per_s: 1000.0,
    };
    let text = render_envoy_instructions(&[
        row("envoy", 180_000.0),
        row("envoy-stream", 230_000.0),
        row("wasm-noop", 220_000.0),
        row("wasm-floor", 320_000.0),
        row("filter-cached", 350_000.0),
        row("filter-stream", 600_000.0),
        row("filter-cached:old", 360_000.0),
        row("filter-stream:old", 640_000.0),
    ]);
    assert!(
        text.contains("| filter-stream:old | 640000 | +410000 (2.78×) |"),
        "{text}"
    );
    assert!(
        text.contains("build `old` (`filter-stream`) | -40000 |"),
        "{text}"
    );
    assert!(
        text.contains("build `old` (`filter-cached`) | -10000 |"),
        "{text}"
    );
    assert!(
        text.contains("| wasm-noop | 220000 | +40000 (1.22×) | 500 | 1000 |"),
        "{text}"
    );
    assert!(
        text.contains("| filter-stream | 600000 | +370000 (2.61×) |"),
        "{text}"
    );
    assert!(
        text.contains("(`wasm-floor` − `wasm-noop`) | +100000 |"),
        "{text}"
    );
    assert!(
        text.contains("(`filter-cached` − `wasm-floor`) | +30000 |"),
        "{text}"
    );
    assert!(
        text.contains("(`filter-cached` − `wasm-noop`) | +130000 |"),
        "{text}"
    );
}

#[test]
fn the_instruction_count_is_read_from_its_file_and_rendered() {
    let dir = std::env::temp_dir().join(format!("maas-bench-ins-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("ins.json");
    std::fs::write(&file, r#"{"cached_json": 33648}"#).unwrap();
    let json_only = FilterInstructions {
        cached_json: Some(33648),
        ..FilterInstructions::default()
    };
    assert_eq!(read_instructions(Some(&file)), Some(json_only));
    let text = render_instructions(Some(json_only));
    assert!(text.contains("**33648 instructions**"), "{text}");
    assert!(!text.contains("per cached stream"), "{text}");
    std::fs::write(&file, r#"{"cached_json": 30000, "cached_stream": 96000}"#).unwrap();
    let both = read_instructions(Some(&file));
    assert_eq!(
        both,
        Some(FilterInstructions {
            cached_json: Some(30000),
            cached_stream: Some(96000),
            ..FilterInstructions::default()
        })
    );
    let text = render_instructions(both);
    assert!(
        text.contains("**96000 instructions** per cached stream"),
        "{text}"
    );
    assert!(text.contains("+1000 per chunk"), "{text}");
    assert!(!text.contains("translated"), "{text}");
    std::fs::write(
        &file,
        r#"{"cached_json": 30000, "translated_stream": 177000, "messages_stream": 100000}"#,
    )
    .unwrap();
    let text = render_instructions(read_instructions(Some(&file)));
    assert!(
        text.contains("**177000 instructions** per translated stream"),
        "{text}"
    );
    assert!(text.contains("**100000**"), "{text}");
    assert!(
        text.contains("+77000 per stream, +1100 per event"),
        "{text}"
    );
    std::fs::write(&file, r#"{"gemini_stream": 480000}"#).unwrap();
    let text = render_instructions(read_instructions(Some(&file)));
    assert!(
        text.contains("**480000 instructions** per translated 64-token Gemini stream"),
        "{text}"
    );
    std::fs::write(
        &file,
        r#"{"cached_json": 30000, "bedrock_signed_json": 190000, "bedrock_signed_stream": 530000}"#,
    )
    .unwrap();
    let text = render_instructions(read_instructions(Some(&file)));
    assert!(
        text.contains("**190000 instructions** per signed Bedrock JSON request (+160000 over a cached JSON request)"),
        "{text}"
    );
    assert!(
        text.contains("**530000** per signed 64-token ConverseStream"),
        "{text}"
    );
    std::fs::write(&file, "not json").unwrap();
    assert_eq!(read_instructions(Some(&file)), None);
    assert_eq!(read_instructions(Some(&dir.join("missing.json"))), None);
    assert_eq!(read_instructions(None), None);
    assert!(render_instructions(None).contains("Not counted"));
    let _ = std::fs::remove_dir_all(&dir);
}
