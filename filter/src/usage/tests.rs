use super::*;
use proptest::prelude::*;

/// An OpenAI chat completion (non-streamed), usage at the end.
const OPENAI: &str = r#"{
  "id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
  "object": "chat.completion",
  "created": 1741570283,
  "model": "gpt-4o-2024-08-06",
  "choices": [
    {
      "index": 0,
      "message": {
        "role": "assistant",
        "content": "The \"usage\": {\"total_tokens\": 999} text is not usage. {[",
        "refusal": null,
        "annotations": []
      },
      "logprobs": null,
      "finish_reason": "stop"
    }
  ],
  "usage": {
    "prompt_tokens": 1117,
    "completion_tokens": 46,
    "total_tokens": 1163,
    "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
  },
  "service_tier": "default",
  "system_fingerprint": "fp_fc9f1d7035"
}"#;

/// vLLM completion: usage first-ish, nested objects with `usage` keys elsewhere.
const VLLM: &str = r#"{"id":"cmpl-1","object":"text_completion","usage":{"prompt_tokens":7,"completion_tokens":3},"model":"m","choices":[{"index":0,"text":"a b c","usage":{"total_tokens":1},"logprobs":null}],"meta":{"usage":{"prompt_tokens":100}}}"#;

fn scan(parts: &[&[u8]]) -> Option<Usage> {
    let mut s = JsonUsageScanner::new();
    for p in parts {
        s.feed(p);
    }
    s.finish()
}

fn u(p: u64, c: u64, t: u64) -> Option<Usage> {
    uc(p, c, t, 0)
}

/// With cached input tokens.
fn uc(p: u64, c: u64, t: u64, cached: u64) -> Option<Usage> {
    Some(Usage {
        prompt_tokens: p,
        completion_tokens: c,
        total_tokens: t,
        cached_input_tokens: cached,
    })
}

#[test]
fn openai_body() {
    assert_eq!(scan(&[OPENAI.as_bytes()]), u(1117, 46, 1163));
}

#[test]
fn vllm_body_nested_usage_ignored_total_computed() {
    assert_eq!(scan(&[VLLM.as_bytes()]), u(7, 3, 10));
}

#[test]
fn only_total() {
    assert_eq!(scan(&[br#"{"usage":{"total_tokens":42}}"#]), u(0, 0, 42));
}

#[test]
fn anthropic_names() {
    let body = br#"{"type":"message","usage":{"input_tokens":10,"output_tokens":5,"cache_read_input_tokens":0}}"#;
    assert_eq!(scan(&[body]), u(10, 5, 15));
}

/// OpenAI Responses API (`POST /v1/responses`), non-streamed: `input_tokens`/`output_tokens`,
/// cached tokens only in the nested details (already part of `input_tokens`).
const RESPONSES: &str = r#"{
  "id": "resp_67ccd2bed1ec8190b14f964abc0542670bb6a6b452d3795b",
  "object": "response",
  "created_at": 1741476542,
  "status": "completed",
  "error": null,
  "incomplete_details": null,
  "instructions": null,
  "max_output_tokens": null,
  "model": "gpt-4.1-2025-04-14",
  "output": [
    {
      "type": "message",
      "id": "msg_67ccd2bf17f0819081ff3bb2cf6508e60bb6a6b452d3795b",
      "status": "completed",
      "role": "assistant",
      "content": [
        {"type": "output_text", "text": "In a peaceful grove \"usage\": {\"input_tokens\": 9}", "annotations": []}
      ]
    }
  ],
  "parallel_tool_calls": true,
  "previous_response_id": null,
  "reasoning": {"effort": null, "summary": null},
  "store": true,
  "temperature": 1.0,
  "text": {"format": {"type": "text"}},
  "tool_choice": "auto",
  "tools": [],
  "top_p": 1.0,
  "truncation": "disabled",
  "usage": {
    "input_tokens": 36,
    "input_tokens_details": {"cached_tokens": 30},
    "output_tokens": 87,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 123
  },
  "user": null,
  "metadata": {}
}"#;

/// Anthropic Messages (`POST /v1/messages`), non-streamed, with prompt caching: cache tokens are
/// not part of `input_tokens`.
const ANTHROPIC: &str = r#"{
  "id": "msg_013Zva2CMHLNnXjNJJKqJ2EF",
  "type": "message",
  "role": "assistant",
  "model": "claude-sonnet-4-20250514",
  "content": [{"type": "text", "text": "Hi! My name is Claude. {\"usage\":1}"}],
  "stop_reason": "end_turn",
  "stop_sequence": null,
  "usage": {
    "input_tokens": 21,
    "cache_creation_input_tokens": 188086,
    "cache_read_input_tokens": 12,
    "cache_creation": {"ephemeral_5m_input_tokens": 188086, "ephemeral_1h_input_tokens": 0},
    "output_tokens": 393,
    "service_tier": "standard"
  }
}"#;

/// OpenAI embeddings: no completion.
const EMBEDDINGS: &str = r#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.0023064255,-0.009327292,-0.0028842222]}],"model":"text-embedding-3-small","usage":{"prompt_tokens":8,"total_tokens":8}}"#;

#[test]
fn responses_api_body() {
    assert_eq!(scan(&[RESPONSES.as_bytes()]), uc(36, 87, 123, 30));
}

#[test]
fn anthropic_body_counts_cache_tokens_as_prompt() {
    assert_eq!(
        scan(&[ANTHROPIC.as_bytes()]),
        uc(21 + 188_086 + 12, 393, 21 + 188_086 + 12 + 393, 12)
    );
}

#[test]
fn embeddings_body_has_no_completion() {
    assert_eq!(scan(&[EMBEDDINGS.as_bytes()]), u(8, 0, 8));
}

#[test]
fn openai_names_win_over_anthropic_names() {
    // A gateway that reports both (OpenAI counts already include the cache) is not double counted.
    let body = br#"{"usage":{"prompt_tokens":10,"completion_tokens":2,"total_tokens":12,"cache_read_input_tokens":8,"input_tokens":99}}"#;
    assert_eq!(scan(&[body]), uc(10, 2, 12, 8));
    // The details' count wins over Anthropic's cache reads under OpenAI names.
    let body = br#"{"usage":{"prompt_tokens":10,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":3},"cache_read_input_tokens":8}}"#;
    assert_eq!(scan(&[body]), uc(10, 2, 12, 3));
}

#[test]
fn cached_input_tokens_of_every_family() {
    // OpenAI chat/completions: prompt_tokens_details.cached_tokens (part of prompt_tokens).
    let body = br#"{"usage":{"prompt_tokens":100,"completion_tokens":5,"total_tokens":105,"prompt_tokens_details":{"cached_tokens":64,"audio_tokens":0}}}"#;
    assert_eq!(scan(&[body]), uc(100, 5, 105, 64));
    // Responses: input_tokens_details.cached_tokens.
    let body = br#"{"usage":{"input_tokens":40,"input_tokens_details":{"cached_tokens":32},"output_tokens":2,"total_tokens":42}}"#;
    assert_eq!(scan(&[body]), uc(40, 2, 42, 32));
    // Anthropic: cache_read_input_tokens (added to the prompt, and the cached part of it).
    let body = br#"{"usage":{"input_tokens":3,"cache_creation_input_tokens":10,"cache_read_input_tokens":20,"output_tokens":4}}"#;
    assert_eq!(scan(&[body]), uc(33, 4, 37, 20));
    // Details that are not objects, or a cached count that is not a count: none; never more
    // than the prompt.
    let body =
        br#"{"usage":{"prompt_tokens":10,"completion_tokens":1,"prompt_tokens_details":null}}"#;
    assert_eq!(scan(&[body]), uc(10, 1, 11, 0));
    let body = br#"{"usage":{"prompt_tokens":10,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":"x"}}}"#;
    assert_eq!(scan(&[body]), uc(10, 1, 11, 0));
    let body = br#"{"usage":{"prompt_tokens":10,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":50}}}"#;
    assert_eq!(scan(&[body]), uc(10, 1, 11, 10));
}

#[test]
fn merge_keeps_input_and_takes_the_last_output() {
    let start = UsageCounts {
        input_tokens: Some(25),
        cache_read_input_tokens: Some(5),
        output_tokens: Some(1),
        ..UsageCounts::default()
    };
    let mut c = UsageCounts::default();
    c.merge(&start);
    assert_eq!(c.usage(), uc(30, 1, 31, 5));
    c.merge(&UsageCounts::default());
    assert_eq!(
        c.usage(),
        uc(30, 1, 31, 5),
        "an event without counts changes nothing"
    );
    c.merge(&UsageCounts {
        output_tokens: Some(15),
        ..UsageCounts::default()
    });
    assert_eq!(c.usage(), uc(30, 15, 45, 5));
    // A later total replaces the computed one; a still later event without total drops it.
    c.merge(&UsageCounts {
        total_tokens: Some(50),
        ..UsageCounts::default()
    });
    assert_eq!(c.usage(), uc(30, 15, 50, 5));
    c.merge(&UsageCounts {
        output_tokens: Some(20),
        ..UsageCounts::default()
    });
    assert_eq!(c.usage(), uc(30, 20, 50, 5));
}

#[test]
fn usage_counts_tolerate_any_value() {
    for v in [
        "null",
        "1",
        "\"x\"",
        "[1]",
        "true",
        "{}",
        r#"{"input_tokens":"3"}"#,
    ] {
        let c: UsageCounts = serde_json::from_str(v).unwrap();
        assert!(c.is_empty(), "{v}");
        assert_eq!(c.usage(), None, "{v}");
    }
}

#[test]
fn nested_usage_only_when_asked_and_one_level_down() {
    let body = br#"{"type":"response.completed","response":{"id":"r","output":[{"usage":{"total_tokens":1}}],"usage":{"input_tokens":3,"output_tokens":4,"total_tokens":7}},"x":{"usage":{"total_tokens":2}}}"#;
    assert_eq!(scan(&[body]), None, "plain JSON bodies: top level only");
    let nested = |parts: &[&[u8]]| {
        let mut s = JsonUsageScanner::with_nested_usage();
        for p in parts {
            s.feed(p);
        }
        s.finish_counts()
    };
    let expected = Some(UsageCounts {
        input_tokens: Some(3),
        output_tokens: Some(4),
        total_tokens: Some(7),
        ..UsageCounts::default()
    });
    assert_eq!(nested(&[body]), expected);
    for i in 0..=body.len() {
        let (a, b) = body.split_at(i);
        assert_eq!(nested(&[a, b]), expected, "split at {i}");
    }
    let start = br#"{"type":"message_start","message":{"content":[],"usage":{"input_tokens":9,"output_tokens":1}}}"#;
    assert_eq!(nested(&[start]).and_then(|c| c.input_tokens), Some(9));
    for other in [
        &br#"{"response":{"response":{"usage":{"total_tokens":1}}}}"#[..],
        br#"{"item":{"usage":{"total_tokens":1}}}"#,
        br#"{"response":[{"usage":{"total_tokens":1}}]}"#,
        br#"{"response":null,"message":"usage"}"#,
    ] {
        assert_eq!(nested(&[other]), None, "{}", String::from_utf8_lossy(other));
    }
}

#[test]
fn escaped_key() {
    assert_eq!(scan(&[br#"{"\u0075sage":{"total_tokens":3}}"#]), u(0, 0, 3));
    assert_eq!(scan(&[br#"{"us\"age":{"total_tokens":3}}"#]), None);
}

#[test]
fn no_or_bad_usage() {
    for body in [
        &br#"{"usage":null}"#[..],
        br#"{"usage":{}}"#,
        br#"{"usage":"12"}"#,
        br#"{"usage":{"total_tokens":-1}}"#,
        br#"{"x":{"usage":{"total_tokens":3}}}"#,
        br#"[{"usage":{"total_tokens":3}}]"#,
        br#""usage""#,
        br#"{"a":"usage","b":{"total_tokens":3}}"#,
        br#"{"usage":{"total_tokens":3"#,
        b"",
        b"not json",
    ] {
        assert_eq!(scan(&[body]), None, "{}", String::from_utf8_lossy(body));
    }
}

#[test]
fn usage_parsed_before_body_ends() {
    // The value is complete at the `,`: a truncated body still reports it.
    assert_eq!(
        scan(&[br#"{"usage":{"total_tokens":3},"choices":[{"tr"#]),
        u(0, 0, 3)
    );
}

#[test]
fn float_counts() {
    assert_eq!(
        scan(&[br#"{"usage":{"prompt_tokens":2.0,"completion_tokens":1e1}}"#]),
        u(2, 10, 12)
    );
    assert_eq!(scan(&[br#"{"usage":{"prompt_tokens":2.5}}"#]), None);
}

#[test]
fn memory_bounded() {
    let mut s = JsonUsageScanner::new();
    s.feed(b"{\"choices\":[");
    let item = br#"{"text":"usage usage \"usage\"","usage":{"total_tokens":1}},"#;
    let mut max = 0;
    for _ in 0..100_000 {
        s.feed(item);
        max = max.max(s.buffered_bytes());
    }
    s.feed(br#"{}],"usage":{"total_tokens":7}}"#);
    assert_eq!(s.finish(), u(0, 0, 7));
    assert!(max <= KEY_CAP + USAGE_CAP, "{max}");
    assert_eq!(max, "choices".len());
    let mut s = JsonUsageScanner::new();
    s.feed(b"{\"usage\":{\"pad\":\"");
    for _ in 0..10_000 {
        s.feed(b"xxxxxxxxxx");
        assert!(s.buffered_bytes() <= KEY_CAP + USAGE_CAP);
    }
    s.feed(b"\",\"total_tokens\":1}}");
    assert_eq!(s.finish(), None, "an oversized usage value is ignored");
}

fn split_at_points(data: &[u8], mut points: Vec<usize>) -> Vec<&[u8]> {
    points.sort_unstable();
    let mut parts = Vec::new();
    let mut last = 0;
    for p in points {
        let p = p.min(data.len());
        parts.push(&data[last..p]);
        last = p;
    }
    parts.push(&data[last..]);
    parts
}

#[test]
fn every_split_point() {
    for body in [OPENAI, VLLM, RESPONSES, ANTHROPIC, EMBEDDINGS] {
        let whole = scan(&[body.as_bytes()]);
        assert!(whole.is_some());
        for i in 0..=body.len() {
            let (a, b) = body.as_bytes().split_at(i);
            assert_eq!(scan(&[a, b]), whole, "split at {i}");
        }
        let bytes: Vec<&[u8]> = body.as_bytes().chunks(1).collect();
        assert_eq!(scan(&bytes), whole);
    }
}

/// A JSON value without any top-level `usage` meaning (keys never equal "usage" at depth 1).
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value;
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<u32>().prop_map(Value::from),
        "[a-z\"\\\\{}\\[\\]:, ]{0,10}".prop_map(Value::String),
        Just(Value::String("usage".into())),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::btree_map("(usage|[a-z]{1,5})", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #[test]
    fn usage_anywhere_at_top_level(
        before in proptest::collection::btree_map("[a-t]{1,6}", json_value(), 0..4),
        after in proptest::collection::btree_map("[v-z]{1,6}", json_value(), 0..4),
        p in any::<u32>(), c in any::<u32>(),
        points in proptest::collection::vec(0usize..3000, 0..8),
        pretty in any::<bool>(),
    ) {
        let mut obj = serde_json::Map::new();
        for (k, v) in before { obj.insert(k, v); }
        obj.insert("usage".into(), serde_json::json!({"prompt_tokens": p, "completion_tokens": c, "x": {"usage": 1}}));
        for (k, v) in after { obj.insert(k, v); }
        let v = serde_json::Value::Object(obj);
        let body = if pretty { serde_json::to_vec_pretty(&v).unwrap() } else { serde_json::to_vec(&v).unwrap() };
        let expected = u(u64::from(p), u64::from(c), u64::from(p) + u64::from(c));
        prop_assert_eq!(scan(&[&body]), expected);
        prop_assert_eq!(scan(&split_at_points(&body, points)), expected);
    }

    #[test]
    fn every_family_usage_anywhere_split_anywhere(
        family in 0usize..4,
        before in proptest::collection::btree_map("[a-t]{1,6}", json_value(), 0..4),
        after in proptest::collection::btree_map("[v-z]{1,6}", json_value(), 0..4),
        a in 0u32..1_000_000, b in 0u32..1_000_000, c in 0u32..1_000, d in 0u32..1_000,
        points in proptest::collection::vec(0usize..3000, 0..8),
        pretty in any::<bool>(),
    ) {
        let (a, b, c, d) = (u64::from(a), u64::from(b), u64::from(c), u64::from(d));
        let (usage, expected) = match family {
            0 => (serde_json::json!({"prompt_tokens": a, "completion_tokens": b, "total_tokens": a + b}), u(a, b, a + b)),
            1 => (serde_json::json!({"input_tokens": a, "input_tokens_details": {"cached_tokens": c}, "output_tokens": b, "output_tokens_details": {"reasoning_tokens": d}, "total_tokens": a + b}), uc(a, b, a + b, c.min(a))),
            2 => (serde_json::json!({"input_tokens": a, "cache_creation_input_tokens": c, "cache_read_input_tokens": d, "output_tokens": b, "service_tier": "standard"}), uc(a + c + d, b, a + b + c + d, d)),
            _ => (serde_json::json!({"prompt_tokens": a, "total_tokens": a}), u(a, 0, a)),
        };
        let mut obj = serde_json::Map::new();
        for (k, v) in before { obj.insert(k, v); }
        obj.insert("usage".into(), usage);
        for (k, v) in after { obj.insert(k, v); }
        let v = serde_json::Value::Object(obj);
        let body = if pretty { serde_json::to_vec_pretty(&v).unwrap() } else { serde_json::to_vec(&v).unwrap() };
        prop_assert_eq!(scan(&[&body]), expected);
        prop_assert_eq!(scan(&split_at_points(&body, points)), expected);
    }

    #[test]
    fn nested_usage_keys_ignored(
        v in proptest::collection::btree_map("[a-t]{1,6}", json_value(), 0..6),
        points in proptest::collection::vec(0usize..3000, 0..8),
    ) {
        let body = serde_json::to_vec(&v).unwrap();
        prop_assert_eq!(scan(&[&body]), None);
        prop_assert_eq!(scan(&split_at_points(&body, points)), None);
    }

    #[test]
    fn garbage_never_panics(
        data in proptest::collection::vec(
            prop_oneof![any::<u8>(), Just(b'{'), Just(b'}'), Just(b'"'), Just(b'\\'), Just(b':'), Just(b',')],
            0..400,
        ),
        points in proptest::collection::vec(0usize..400, 0..8),
    ) {
        let whole = scan(&[&data]);
        prop_assert_eq!(scan(&split_at_points(&data, points)), whole);
    }
}

/// `cargo test -p maas-filter --release --lib usage::tests::throughput -- --ignored --nocapture`
#[test]
#[ignore]
fn throughput() {
    let mut body = b"{\"choices\":[".to_vec();
    let item = br#"{"index":0,"message":{"role":"assistant","content":"Lorem ipsum dolor sit amet, \"consectetur\" adipiscing elit, sed do eiusmod tempor incididunt ut labore et dolore magna aliqua."},"logprobs":null,"finish_reason":"stop"},"#;
    while body.len() < 32 * 1024 * 1024 {
        body.extend_from_slice(item);
    }
    body.extend_from_slice(
        br#"{}],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}"#,
    );
    for chunk in [4096, 65536] {
        let start = std::time::Instant::now();
        let mut s = JsonUsageScanner::new();
        let mut max = 0;
        for c in body.chunks(chunk) {
            s.feed(c);
            max = max.max(s.buffered_bytes());
        }
        let r = s.finish();
        let el = start.elapsed().as_secs_f64();
        println!(
            "json usage chunk={chunk}: {:.0} MB/s, max buffered {max} B, usage {r:?}",
            body.len() as f64 / el / 1e6
        );
    }
}
