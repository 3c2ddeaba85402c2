use super::event::find_byte;
use super::*;
use proptest::prelude::*;

/// OpenAI chat completion stream with `stream_options.include_usage` (usage in its own chunk).
pub(crate) const OPENAI: &str = concat!(
    "data: {\"id\":\"chatcmpl-AbC\",\"object\":\"chat.completion.chunk\",\"created\":1732000000,\"model\":\"gpt-4o-mini-2024-07-18\",\"system_fingerprint\":\"fp_0ba0d124f1\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\",\"refusal\":null},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n",
    "data: {\"id\":\"chatcmpl-AbC\",\"object\":\"chat.completion.chunk\",\"created\":1732000000,\"model\":\"gpt-4o-mini-2024-07-18\",\"system_fingerprint\":\"fp_0ba0d124f1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n",
    "data: {\"id\":\"chatcmpl-AbC\",\"object\":\"chat.completion.chunk\",\"created\":1732000000,\"model\":\"gpt-4o-mini-2024-07-18\",\"system_fingerprint\":\"fp_0ba0d124f1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" \\\"usage\\\": {}\\n\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n",
    "data: {\"id\":\"chatcmpl-AbC\",\"object\":\"chat.completion.chunk\",\"created\":1732000000,\"model\":\"gpt-4o-mini-2024-07-18\",\"system_fingerprint\":\"fp_0ba0d124f1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"world\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n",
    "data: {\"id\":\"chatcmpl-AbC\",\"object\":\"chat.completion.chunk\",\"created\":1732000000,\"model\":\"gpt-4o-mini-2024-07-18\",\"system_fingerprint\":\"fp_0ba0d124f1\",\"choices\":[{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
    "data: {\"id\":\"chatcmpl-AbC\",\"object\":\"chat.completion.chunk\",\"created\":1732000000,\"model\":\"gpt-4o-mini-2024-07-18\",\"system_fingerprint\":\"fp_0ba0d124f1\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":3,\"total_tokens\":15,\"prompt_tokens_details\":{\"cached_tokens\":0,\"audio_tokens\":0},\"completion_tokens_details\":{\"reasoning_tokens\":0,\"audio_tokens\":0,\"accepted_prediction_tokens\":0,\"rejected_prediction_tokens\":0}}}\n\n",
    "data: [DONE]\n\n",
);

/// The OpenAI stream without the usage-only event: what a client that did not ask gets.
fn openai_stripped() -> String {
    OPENAI
        .split_inclusive("\n\n")
        .filter(|e| !e.contains("\"choices\":[],"))
        .collect()
}

/// vLLM stream: completions API, `continuous_usage_stats`-like usage in the last content chunk.
pub(crate) const VLLM_LAST_CHUNK: &str = concat!(
    "data: {\"id\":\"cmpl-9f2\",\"object\":\"text_completion\",\"created\":1732000001,\"model\":\"meta-llama/Llama-3.1-8B-Instruct\",\"choices\":[{\"index\":0,\"text\":\" The\",\"logprobs\":null,\"finish_reason\":null,\"stop_reason\":null}],\"usage\":null}\n\n",
    "data: {\"id\":\"cmpl-9f2\",\"object\":\"text_completion\",\"created\":1732000001,\"model\":\"meta-llama/Llama-3.1-8B-Instruct\",\"choices\":[{\"index\":0,\"text\":\" sky\",\"logprobs\":null,\"finish_reason\":null,\"stop_reason\":null}],\"usage\":null}\n\n",
    "data: {\"id\":\"cmpl-9f2\",\"object\":\"text_completion\",\"created\":1732000001,\"model\":\"meta-llama/Llama-3.1-8B-Instruct\",\"choices\":[{\"index\":0,\"text\":\" is\",\"logprobs\":null,\"finish_reason\":\"length\",\"stop_reason\":null}],\"usage\":{\"prompt_tokens\":7,\"total_tokens\":10,\"completion_tokens\":3}}\n\n",
    "data: [DONE]\n\n",
);

fn crlf(s: &str) -> String {
    s.replace('\n', "\r\n")
}

fn cr(s: &str) -> String {
    s.replace('\n', "\r")
}

/// Multi-line data, comments, `event:`/`id:` fields, keep-alives, no `[DONE]`.
pub(crate) const MULTILINE: &str = concat!(
    ": keep-alive\n\n",
    "id: 1\nevent: message\ndata: {\"choices\":[{\"index\":0,\n",
    "data: \"delta\":{\"content\":\"Hi\"}}],\n",
    ": a comment in the middle\n",
    "data: \"usage\":null}\n\n",
    "retry: 1000\n\n",
    "data:{\"choices\":[],\n",
    "data:\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1}}\n\n",
);

fn feed_all(strip: bool, parts: &[&[u8]]) -> (Vec<u8>, Option<Usage>, u64, SseScanner) {
    let mut s = SseScanner::new(strip);
    let mut out = Vec::new();
    for p in parts {
        let o = s.feed(p);
        if !strip {
            assert_eq!(&*o, *p, "observe mode forwards the chunk unchanged");
            assert!(matches!(o, Cow::Borrowed(_)));
        }
        out.extend_from_slice(&o);
    }
    let (rest, usage) = s.finish();
    out.extend_from_slice(&rest);
    let ce = s.content_events();
    (out, usage, ce, s)
}

fn usage(p: u64, c: u64, t: u64) -> Option<Usage> {
    Some(Usage {
        prompt_tokens: p,
        completion_tokens: c,
        total_tokens: t,
    })
}

#[test]
fn openai_usage_in_own_chunk() {
    let (out, u, ce, s) = feed_all(false, &[OPENAI.as_bytes()]);
    assert_eq!(out, OPENAI.as_bytes());
    assert_eq!(u, usage(12, 3, 15));
    assert_eq!(ce, 3, "empty role delta and finish chunk are not content");
    assert!(s.done());
    assert_eq!(s.events(), 7);
}

#[test]
fn openai_strip_removes_only_usage_event() {
    let (out, u, ce, s) = feed_all(true, &[OPENAI.as_bytes()]);
    assert_eq!(String::from_utf8(out).unwrap(), openai_stripped());
    assert_eq!(u, usage(12, 3, 15));
    assert_eq!(ce, 3);
    assert_eq!(s.stripped_events(), 1);
}

#[test]
fn strip_returns_borrowed_when_chunk_ends_on_event_boundary() {
    let mut s = SseScanner::new(true);
    let first = OPENAI.split_inclusive("\n\n").next().unwrap();
    assert!(matches!(s.feed(first.as_bytes()), Cow::Borrowed(b) if b == first.as_bytes()));
    // A partial event is held back and released with the rest of it.
    let (a, b) = first.split_at(20);
    assert!(matches!(s.feed(a.as_bytes()), Cow::Owned(v) if v.is_empty()));
    assert!(s.buffered_bytes() >= 20);
    assert!(matches!(s.feed(b.as_bytes()), Cow::Owned(v) if v == first.as_bytes()));
    // A chunk holding one whole event and the start of the next: the tail is held back.
    let two = &OPENAI.as_bytes()[..first.len() + 10];
    assert!(matches!(s.feed(two), Cow::Owned(v) if v == first.as_bytes()));
}

#[test]
fn vllm_usage_in_last_content_chunk() {
    for strip in [false, true] {
        let (out, u, ce, _) = feed_all(strip, &[VLLM_LAST_CHUNK.as_bytes()]);
        assert_eq!(
            out,
            VLLM_LAST_CHUNK.as_bytes(),
            "nothing stripped: choices not empty"
        );
        assert_eq!(u, usage(7, 3, 10));
        assert_eq!(ce, 3);
    }
}

#[test]
fn crlf_and_cr_line_endings() {
    for (s, stripped) in [
        (crlf(OPENAI), crlf(&openai_stripped())),
        (cr(OPENAI), cr(&openai_stripped())),
    ] {
        let (out, u, ce, _) = feed_all(false, &[s.as_bytes()]);
        assert_eq!(out, s.as_bytes());
        assert_eq!(u, usage(12, 3, 15));
        assert_eq!(ce, 3);
        let (out, u, _, sc) = feed_all(true, &[s.as_bytes()]);
        assert_eq!(u, usage(12, 3, 15));
        assert_eq!(sc.stripped_events(), 1);
        assert_eq!(String::from_utf8(out).unwrap(), stripped);
    }
}

#[test]
fn crlf_split_between_cr_and_lf_of_stripped_event() {
    let s = crlf(OPENAI);
    let usage_end = s.find("data: [DONE]").unwrap();
    // Split between the CR and the LF that end the usage-only event.
    let (a, b) = s.as_bytes().split_at(usage_end - 1);
    let (out, u, _, _) = feed_all(true, &[a, b]);
    assert_eq!(u, usage(12, 3, 15));
    assert_eq!(String::from_utf8(out).unwrap(), crlf(&openai_stripped()));
}

#[test]
fn multiline_data_comments_fields_no_done() {
    let (out, u, ce, s) = feed_all(false, &[MULTILINE.as_bytes()]);
    assert_eq!(out, MULTILINE.as_bytes());
    assert_eq!(u, usage(5, 1, 6), "total computed from prompt + completion");
    assert_eq!(ce, 1);
    assert!(!s.done());
    let (out, _, _, s) = feed_all(true, &[MULTILINE.as_bytes()]);
    assert_eq!(s.stripped_events(), 1);
    let kept = MULTILINE.split("data:{\"choices\":[],").next().unwrap();
    assert_eq!(String::from_utf8(out).unwrap(), kept);
}

#[test]
fn no_usage_counts_content_events() {
    let s: String = OPENAI
        .split_inclusive("\n\n")
        .filter(|e| !e.contains("\"choices\":[],"))
        .collect();
    let (out, u, ce, _) = feed_all(true, &[s.as_bytes()]);
    assert_eq!(out, s.as_bytes());
    assert_eq!(u, None);
    assert_eq!(ce, 3);
}

#[test]
fn unterminated_last_event_is_read_and_forwarded() {
    let s = "data: {\"choices\":[],\"usage\":{\"total_tokens\":9}}";
    let (out, u, _, _) = feed_all(true, &[s.as_bytes()]);
    assert_eq!(out, s.as_bytes(), "an incomplete event is never stripped");
    assert_eq!(u, usage(0, 0, 9), "only total given");
}

#[test]
fn usage_only_event_needs_empty_choices_array() {
    for ev in [
        "data: {\"usage\":{\"total_tokens\":9}}\n\n",
        "data: {\"choices\":null,\"usage\":{\"total_tokens\":9}}\n\n",
        "data: {\"choices\":[],\"usage\":null}\n\n",
        "data: {\"choices\":[],\"usage\":{}}\n\n",
    ] {
        let (out, _, _, s) = feed_all(true, &[ev.as_bytes()]);
        assert_eq!(out, ev.as_bytes(), "{ev}");
        assert_eq!(s.stripped_events(), 0);
    }
}

#[test]
fn oversized_event_is_forwarded_not_held() {
    let big = format!(
        "data: {{\"choices\":[],\"pad\":\"{}\",\"usage\":{{\"total_tokens\":1}}}}\n\n",
        "x".repeat(EVENT_CAP + 10)
    );
    let mut s = SseScanner::new(true);
    let mut out = Vec::new();
    for c in big.as_bytes().chunks(1000) {
        out.extend_from_slice(&s.feed(c));
        assert!(s.buffered_bytes() <= LINE_CAP + DATA_CAP + EVENT_CAP);
    }
    out.extend_from_slice(&s.finish().0);
    assert_eq!(out, big.as_bytes());
    // The same whole: same bytes.
    let (whole, _, _, _) = feed_all(true, &[big.as_bytes()]);
    assert_eq!(whole, big.as_bytes());
}

#[test]
fn overlong_line_spoils_only_its_event() {
    let long = format!(
        "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":4,\"completion_tokens\":1}},\"pad\":\"{}\"}}\n\n",
        "y".repeat(LINE_CAP)
    );
    let stream = format!("{long}data: {{\"choices\":[{{\"text\":\"a\"}}]}}\n\n");
    for strip in [false, true] {
        let whole = feed_all(strip, &[stream.as_bytes()]);
        let parts: Vec<&[u8]> = stream.as_bytes().chunks(4096).collect();
        let split = feed_all(strip, &parts);
        assert_eq!(whole.0, stream.as_bytes(), "nothing stripped");
        assert_eq!(
            whole.1,
            usage(4, 1 + 1, 4 + 1 + 1),
            "the overlong event's usage is found by the spill scan; the content after it counts one more"
        );
        assert_eq!(whole.2, 1, "the next event is read");
        assert_eq!((split.0, split.1, split.2), (whole.0, whole.1, whole.2));
        assert!(split.3.max_buffered_bytes() <= DATA_CAP + EVENT_CAP + 4096);
    }
}

#[test]
fn memory_does_not_grow_with_stream_length() {
    let mut s = SseScanner::new(true);
    let bytes = OPENAI.as_bytes();
    for _ in 0..2000 {
        for c in bytes.chunks(37) {
            let _ = s.feed(c);
        }
    }
    // At most one partial line, one event's data and one held event, each shorter than an event.
    let longest_event = OPENAI.split_inclusive("\n\n").map(str::len).max().unwrap();
    assert!(
        s.max_buffered_bytes() <= 3 * longest_event,
        "{}",
        s.max_buffered_bytes()
    );
    assert!(s.data.capacity() <= 4 * 1024 && s.held.capacity() <= 2 * longest_event);
}

#[test]
fn content_detection() {
    let cases: &[(&str, bool)] = &[
        (r#"{"choices":[{"delta":{"content":"a"}}]}"#, true),
        (r#"{"choices":[{"delta":{"content":""}}]}"#, false),
        (
            r#"{"choices":[{"delta":{"content":null,"tool_calls":[]}}]}"#,
            false,
        ),
        (
            r#"{"choices":[{"delta":{"role":"assistant"}},{"text":"x"}]}"#,
            true,
        ),
        (r#"{"choices":[{"text":""}]}"#, false),
        (r#"{"choices":[{"delta":{"content":"\u00e9"}}]}"#, true),
        (
            r#"{"choices":[{"delta":"weird"}],"usage":{"prompt_tokens":1}}"#,
            false,
        ),
    ];
    for (json, expected) in cases {
        let ev = parse_event(json.as_bytes()).unwrap();
        assert_eq!(ev.content, *expected, "{json}");
    }
    let ev =
        parse_event(br#"{"choices":[{"delta":"weird"}],"usage":{"prompt_tokens":1}}"#).unwrap();
    assert_eq!(ev.usage, usage(1, 0, 1));
    assert_eq!(parse_event(b"[1,2]"), None);
    assert_eq!(parse_event(b"{\"choices\":[}"), None);
}

/// The fast summary agrees with the full parse on what the scanner uses: usage, content and
/// whether the event would be stripped.
fn assert_summary_agrees(data: &[u8]) {
    let full = parse_event(data);
    let fast = summarize_event(data);
    let text = String::from_utf8_lossy(data);
    let key = |e: Option<EventSummary>| {
        e.map(|e| {
            (
                e.usage,
                e.content,
                e.usage.is_some() && e.choices == Some(0),
            )
        })
    };
    assert_eq!(key(fast), key(full), "{text}");
}

#[test]
fn fast_summary_agrees_with_parse_on_recorded_shapes() {
    let chunks = openai_stream_chunks(3);
    for stream in [
        OPENAI,
        VLLM_LAST_CHUNK,
        &crlf(MULTILINE),
        &chunks.concat(),
        ANTHROPIC,
        ANTHROPIC_TOOLS_CACHE,
        RESPONSES,
        &responses_stream(3, "response.completed"),
    ] {
        for event in stream.split("\n\n") {
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            let data = data.join("\n");
            if !data.is_empty() && data != "[DONE]" {
                assert_summary_agrees(data.as_bytes());
            }
        }
    }
    for json in [
        r#"{"choices":[{"delta":{"content":"a"}}]}"#,
        r#"{"choices":[{"delta":{"content":""}}]}"#,
        r#"{"choices":[{"delta":{"content":null,"tool_calls":[]}}]}"#,
        r#"{"choices":[{"delta":{"role":"assistant"}},{"text":"x"}]}"#,
        r#"{"choices":[{"text":""}]}"#,
        r#"{"choices":[{"delta":{"content":"\u00e9"}}]}"#,
        r#"{"choices":[{"delta":{"content":"\"usage\":{\"total_tokens\":5}"}}]}"#,
        r#"{"choices":[{"delta":{"content":"\\"}}],"usage":null}"#,
        r#"{"choices":[{"delta":{"content":[{"type":"text","text":"a"}]}}]}"#,
        r#"{"choices":[{"delta":{"content":[]}}]}"#,
        r#"{"choices":[{"delta":{"content":{}}}]}"#,
        r#"{"choices":[{"delta":{"content":"x"},"logprobs":{"content":[{"token":"x"}]}}]}"#,
        r#"{"choices":[{"delta":"weird"}],"usage":{"prompt_tokens":1}}"#,
        r#"{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}"#,
        r#"{"choices":[],"usage":{}}"#,
        r#"{"choices":[],"usage":[1]}"#,
        r#"{"choices" : [ ] , "usage" : { "total_tokens" : 4 } }"#,
        "{\"choices\":[],\n\"usage\"\t:\r{\"total_tokens\":4}}",
        r#"{"choices":[{"delta":{"reasoning_content":"think"}}]}"#,
        r#"{"usage":{"total_tokens":9},"choices":[{"text":"a"}]}"#,
        "[1,2]",
        "",
        "  ",
    ] {
        assert_summary_agrees(json.as_bytes());
    }
    // Where the estimate is allowed to differ: malformed JSON still counts its content.
    let broken = br#"{"choices":[{"delta":{"content":"a"}}]"#;
    assert_eq!(parse_event(broken), None);
    assert_eq!(summarize_event(broken).map(|e| e.content), Some(true));
}

/// JSON strings that look like the keys and values the fast path looks for.
fn tricky_text() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![
            Just("\"usage\":{\"total_tokens\":7}".to_string()),
            Just("\"content\":\"".to_string()),
            Just("\"choices\":[]".to_string()),
            Just("\\".to_string()),
            Just("\"".to_string()),
            Just(":".to_string()),
            Just("usage".to_string()),
            Just("text".to_string()),
            "[a-z é\n\t{}:\\[\\]\"\\\\]{0,6}",
        ],
        0..5,
    )
    .prop_map(|v| v.concat())
}

fn usage_value() -> impl Strategy<Value = Option<serde_json::Value>> {
    prop_oneof![
        Just(None),
        Just(Some(serde_json::Value::Null)),
        Just(Some(serde_json::json!({}))),
        (0u64..1000, 0u64..1000).prop_map(|(p, c)| Some(
            serde_json::json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c})
        )),
        (0u64..1000).prop_map(|t| Some(serde_json::json!({"total_tokens": t}))),
        Just(Some(serde_json::json!("usage"))),
    ]
}

fn content_value() -> impl Strategy<Value = Option<serde_json::Value>> {
    prop_oneof![
        Just(None),
        Just(Some(serde_json::Value::Null)),
        Just(Some(serde_json::json!(""))),
        tricky_text().prop_map(|t| Some(serde_json::json!(t))),
        tricky_text().prop_map(|t| Some(serde_json::json!([{"type": "text", "text": t}]))),
        Just(Some(serde_json::json!([]))),
    ]
}

/// One choice of a chat (`delta`) or completions (`text`) chunk.
fn choice() -> impl Strategy<Value = serde_json::Value> {
    (
        any::<bool>(),
        content_value(),
        proptest::option::of(tricky_text()),
        any::<bool>(),
        proptest::option::of(tricky_text()),
    )
        .prop_map(|(chat, content, reasoning, logprobs, finish)| {
            let mut c = serde_json::json!({"index": 0, "finish_reason": finish});
            c["logprobs"] = if logprobs {
                serde_json::json!({"content": [{"token": "x", "logprob": -0.5}]})
            } else {
                serde_json::Value::Null
            };
            if chat {
                let mut delta = serde_json::json!({});
                if let Some(v) = content {
                    delta["content"] = v;
                }
                if let Some(r) = reasoning {
                    delta["reasoning_content"] = serde_json::json!(r);
                }
                c["delta"] = delta;
            } else if let Some(v) = content {
                c["text"] = v;
            }
            c
        })
}

proptest! {
    #[test]
    fn fast_summary_agrees_with_parse_on_chunk_shapes(
        choices in proptest::collection::vec(choice(), 0..3),
        usage in usage_value(),
        id in tricky_text(),
        pretty in any::<bool>(),
    ) {
        let mut ev = serde_json::json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": 1732000000,
            "model": "m",
            "choices": choices,
        });
        if let Some(u) = usage {
            ev["usage"] = u;
        }
        let data = if pretty {
            serde_json::to_vec_pretty(&ev).unwrap()
        } else {
            serde_json::to_vec(&ev).unwrap()
        };
        assert_summary_agrees(&data);
    }

    #[test]
    fn find_either_finds_the_first(
        hay in proptest::collection::vec(prop_oneof![Just(b'\n'), Just(b'\r'), Just(b':'), any::<u8>()], 0..80),
        from in 0usize..80,
    ) {
        let hay = &hay[from.min(hay.len())..];
        let naive = hay.iter().position(|&b| b == b'\n' || b == b'\r');
        prop_assert_eq!(find_either(hay, b'\n', b'\r'), naive);
        prop_assert_eq!(find_byte(hay, b':'), hay.iter().position(|&b| b == b':'));
    }
}

/// Splits `data` at the given sorted points.
fn split_at_points(data: &[u8], mut points: Vec<usize>) -> Vec<&[u8]> {
    points.sort_unstable();
    points.dedup();
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

fn streams() -> Vec<String> {
    let mut v = Vec::new();
    for s in [
        OPENAI,
        VLLM_LAST_CHUNK,
        MULTILINE,
        ANTHROPIC,
        ANTHROPIC_TOOLS_CACHE,
        RESPONSES,
    ] {
        v.push(s.to_string());
        v.push(crlf(s));
        v.push(cr(s));
    }
    v.push(openai_stripped());
    v
}

#[test]
fn every_split_point_gives_same_result() {
    for stream in streams() {
        let bytes = stream.as_bytes();
        for strip in [false, true] {
            let whole = feed_all(strip, &[bytes]);
            for i in 0..=bytes.len() {
                let (a, b) = bytes.split_at(i);
                let split = feed_all(strip, &[a, b]);
                assert_eq!(split.0, whole.0, "strip={strip} split at {i}");
                assert_eq!(split.1, whole.1, "strip={strip} split at {i}");
                assert_eq!(split.2, whole.2, "strip={strip} split at {i}");
            }
        }
    }
}

#[test]
fn byte_by_byte_gives_same_result() {
    for stream in streams() {
        let bytes = stream.as_bytes();
        for strip in [false, true] {
            let whole = feed_all(strip, &[bytes]);
            let parts: Vec<&[u8]> = bytes.chunks(1).collect();
            let split = feed_all(strip, &parts);
            assert_eq!((split.0, split.1, split.2), (whole.0, whole.1, whole.2));
        }
    }
}

proptest! {
    #[test]
    fn random_multi_splits_same_result(
        which in 0usize..19,
        points in proptest::collection::vec(0usize..4000, 0..20),
        strip in any::<bool>(),
    ) {
        let all = streams();
        let stream = &all[which % all.len()];
        let bytes = stream.as_bytes();
        let whole = feed_all(strip, &[bytes]);
        let split = feed_all(strip, &split_at_points(bytes, points));
        prop_assert_eq!(split.0, whole.0);
        prop_assert_eq!(split.1, whole.1);
        prop_assert_eq!(split.2, whole.2);
    }

    #[test]
    fn garbage_never_panics_and_split_invariant(
        data in proptest::collection::vec(
            prop_oneof![
                any::<u8>(),
                Just(b'\n'), Just(b'\r'), Just(b':'), Just(b'{'), Just(b'}'),
                Just(b'"'), Just(b'['), Just(b']'),
            ],
            0..600,
        ),
        points in proptest::collection::vec(0usize..600, 0..10),
        strip in any::<bool>(),
    ) {
        let whole = feed_all(strip, &[&data]);
        let split = feed_all(strip, &split_at_points(&data, points));
        prop_assert_eq!(&split.0, &whole.0);
        prop_assert_eq!(split.1, whole.1);
        prop_assert_eq!(split.2, whole.2);
        if !strip {
            prop_assert_eq!(&whole.0, &data);
        }
    }

    #[test]
    fn event_soup_split_invariant(
        events in proptest::collection::vec(
            prop_oneof![
                Just("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":3}}\n\n".to_string()),
                Just("data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n".to_string()),
                Just(": ping\n\n".to_string()),
                Just("\n".to_string()),
                Just("\r\n".to_string()),
                Just("\r".to_string()),
                Just("data: [DONE]\n\n".to_string()),
                Just("data: {\"choices\":[],\r\ndata: \"usage\":{\"total_tokens\":4}}\r\n\r\n".to_string()),
                Just("data: {\"choices\":[],\rdata: \"usage\":{\"total_tokens\":5}}\r\r".to_string()),
                "[a-z:{}\\[\\] \"\r\n]{0,12}",
            ],
            0..30,
        ),
        points in proptest::collection::vec(0usize..2000, 0..12),
    ) {
        let stream: String = events.concat();
        let bytes = stream.as_bytes();
        for strip in [false, true] {
            let whole = feed_all(strip, &[bytes]);
            let split = feed_all(strip, &split_at_points(bytes, points.clone()));
            prop_assert_eq!(&split.0, &whole.0);
            prop_assert_eq!(split.1, whole.1);
            prop_assert_eq!(split.2, whole.2);
        }
    }
}

/// A realistic OpenAI stream: role chunk, `tokens` content chunks, finish chunk, usage chunk,
/// `[DONE]`; one event per chunk, as upstreams send them.
fn openai_stream_chunks(tokens: usize) -> Vec<String> {
    let head = "data: {\"id\":\"chatcmpl-AbC\",\"object\":\"chat.completion.chunk\",\"created\":1732000000,\"model\":\"gpt-4o-mini-2024-07-18\",\"system_fingerprint\":\"fp_0ba0d124f1\",\"choices\":[{\"index\":0,\"delta\":";
    let tail = ",\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n";
    let mut v = vec![format!(
        "{head}{{\"role\":\"assistant\",\"content\":\"\",\"refusal\":null}}{tail}"
    )];
    for i in 0..tokens {
        v.push(format!("{head}{{\"content\":\" tok{i}\"}}{tail}"));
    }
    v.push(format!(
        "{head}{{}},\"logprobs\":null,\"finish_reason\":\"stop\"}}],\"usage\":null}}\n\n"
    ));
    v.push(OPENAI.split_inclusive("\n\n").nth(5).unwrap().to_string());
    v.push("data: [DONE]\n\n".to_string());
    v
}

#[test]
fn realistic_stream_counts() {
    let chunks = openai_stream_chunks(62);
    let parts: Vec<&[u8]> = chunks.iter().map(|c| c.as_bytes()).collect();
    for strip in [false, true] {
        let (out, u, ce, s) = feed_all(strip, &parts);
        assert_eq!(u, usage(12, 3, 15));
        assert_eq!(ce, 62);
        assert_eq!(s.stripped_events(), u64::from(strip));
        assert_eq!(
            out.len() + usize::from(strip) * parts[64].len(),
            chunks.concat().len()
        );
    }
}

/// Time per realistic stream (65 chunks + `[DONE]`, one event per chunk); run with
/// `cargo test -p maas-filter --release --lib sse::tests::per_stream -- --ignored --nocapture`.
#[test]
#[ignore]
fn per_stream() {
    let chunks = openai_stream_chunks(62);
    // Best of 15 rounds of 2,000 streams, alternating modes: the machine may be shared.
    let n = 2_000u32;
    let mut best = [f64::MAX; 2];
    let mut total = 0u64;
    for _ in 0..15 {
        for strip in [false, true] {
            let start = std::time::Instant::now();
            for _ in 0..n {
                let mut s = SseScanner::new(strip);
                for c in &chunks {
                    total += s.feed(std::hint::black_box(c.as_bytes())).len() as u64;
                }
                let (_, u) = s.finish();
                total += u.map_or(0, |u| u.total_tokens) + s.content_events();
            }
            let per = start.elapsed().as_secs_f64() / f64::from(n);
            let b = &mut best[usize::from(strip)];
            *b = b.min(per);
        }
    }
    std::hint::black_box(total);
    for strip in [false, true] {
        let per = best[usize::from(strip)];
        println!(
            "sse per stream strip={strip}: {:.2} µs per {}-chunk stream ({:.0} ns per event), best of 15",
            per * 1e6,
            chunks.len(),
            per * 1e9 / chunks.len() as f64,
        );
    }
}

/// Throughput and memory figures; run with
/// `cargo test -p maas-filter --release --lib sse::tests::throughput -- --ignored --nocapture`.
#[test]
#[ignore]
fn throughput() {
    let mut stream = Vec::new();
    while stream.len() < 32 * 1024 * 1024 {
        stream.extend_from_slice(OPENAI.as_bytes());
    }
    for (strip, chunk) in [
        (false, 256),
        (false, 4096),
        (false, 65536),
        (true, 256),
        (true, 4096),
    ] {
        let mut s = SseScanner::new(strip);
        let start = std::time::Instant::now();
        let mut forwarded = 0usize;
        for c in stream.chunks(chunk) {
            forwarded += s.feed(c).len();
        }
        let el = start.elapsed().as_secs_f64();
        println!(
            "sse strip={strip} chunk={chunk}: {:.0} MB/s, {:.0} events/s, max buffered {} B, forwarded {} B, usage {:?}",
            stream.len() as f64 / el / 1e6,
            s.events() as f64 / el,
            s.max_buffered_bytes(),
            forwarded,
            s.usage(),
        );
        std::hint::black_box(forwarded);
    }
}

/// Anthropic Messages stream (`POST /v1/messages`, `stream: true`), as documented: input tokens
/// in `message_start`, cumulative output tokens in `message_delta`, a `ping`.
pub(crate) const ANTHROPIC: &str = concat!(
    "event: message_start\n",
    "data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"claude-sonnet-4-20250514\",\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":25,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":0,\"output_tokens\":1,\"service_tier\":\"standard\"}}}\n\n",
    "event: content_block_start\n",
    "data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
    "event: ping\n",
    "data: {\"type\": \"ping\"}\n\n",
    "event: content_block_delta\n",
    "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\n\n",
    "event: content_block_delta\n",
    "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\" \\\"usage\\\":{\\\"output_tokens\\\":99}\"}}\n\n",
    "event: content_block_delta\n",
    "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"!\"}}\n\n",
    "event: content_block_stop\n",
    "data: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
    "event: message_delta\n",
    "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":15}}\n\n",
    "event: message_stop\n",
    "data: {\"type\":\"message_stop\"}\n\n",
);

/// Anthropic stream with prompt caching, extended thinking and a tool call (`thinking_delta`,
/// `signature_delta`, `input_json_delta`), two `message_delta` events (the last one wins).
pub(crate) const ANTHROPIC_TOOLS_CACHE: &str = concat!(
    "event: message_start\n",
    "data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_014p7gG3wDgGV9EUtLvnow3U\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"claude-sonnet-4-20250514\",\"stop_sequence\":null,\"usage\":{\"input_tokens\":472,\"cache_creation_input_tokens\":100,\"cache_read_input_tokens\":1000,\"output_tokens\":2},\"content\":[],\"stop_reason\":null}}\n\n",
    "event: content_block_start\n",
    "data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"thinking\",\"thinking\":\"\",\"signature\":\"\"}}\n\n",
    "event: content_block_delta\n",
    "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"thinking_delta\",\"thinking\":\"Let me think.\"}}\n\n",
    "event: content_block_delta\n",
    "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"signature_delta\",\"signature\":\"EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds\"}}\n\n",
    "event: content_block_stop\n",
    "data: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
    "event: content_block_start\n",
    "data: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_01T1x1fJ34qAmk2tNTrN7Up6\",\"name\":\"get_weather\",\"input\":{}}}\n\n",
    "event: content_block_delta\n",
    "data: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"\"}}\n\n",
    "event: content_block_delta\n",
    "data: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"location\\\": \\\"San Fra\"}}\n\n",
    "event: content_block_delta\n",
    "data: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"ncisco, CA\\\"}\"}}\n\n",
    "event: content_block_stop\n",
    "data: {\"type\":\"content_block_stop\",\"index\":1}\n\n",
    "event: message_delta\n",
    "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":null,\"stop_sequence\":null},\"usage\":{\"output_tokens\":40}}\n\n",
    "event: message_delta\n",
    "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"tool_use\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":89}}\n\n",
    "event: message_stop\n",
    "data: {\"type\":\"message_stop\"}\n\n",
);

/// OpenAI Responses stream (`POST /v1/responses`, `stream: true`): `response.created` and
/// `response.in_progress` with `usage: null`, `tokens` text deltas, the `…done` events that repeat
/// the whole text, and `response.completed` (or `terminal`, e.g. `response.incomplete`) with the
/// usage nested in `response`.
fn responses_stream(tokens: usize, terminal: &str) -> String {
    let response = |status: &str, output: &str, usage: &str| {
        format!(
            "{{\"id\":\"resp_67c9fdcecf488190bdd9a0409de3a1ec07b8b0ad4e5eb654\",\"object\":\"response\",\"created_at\":1741290958,\"status\":\"{status}\",\"error\":null,\"incomplete_details\":null,\"instructions\":\"You are a helpful assistant.\",\"max_output_tokens\":null,\"model\":\"gpt-4.1-2025-04-14\",\"output\":[{output}],\"parallel_tool_calls\":true,\"previous_response_id\":null,\"reasoning\":{{\"effort\":null,\"summary\":null}},\"store\":true,\"temperature\":1.0,\"text\":{{\"format\":{{\"type\":\"text\"}}}},\"tool_choice\":\"auto\",\"tools\":[],\"top_p\":1.0,\"truncation\":\"disabled\",\"usage\":{usage},\"user\":null,\"metadata\":{{}}}}"
        )
    };
    let item = "msg_67c9fdcf37fc8190ba82116e33fb28c507b8b0ad4e5eb654";
    let text: Vec<String> = (0..tokens).map(|i| format!(" tok{i}")).collect();
    let full = text.concat();
    let message = format!(
        "{{\"id\":\"{item}\",\"type\":\"message\",\"status\":\"completed\",\"role\":\"assistant\",\"content\":[{{\"type\":\"output_text\",\"text\":\"{full}\",\"annotations\":[]}}]}}"
    );
    let mut seq = 0;
    let mut ev = |name: &str, body: String| {
        let e = format!(
            "event: {name}\ndata: {{\"type\":\"{name}\",\"sequence_number\":{seq},{body}}}\n\n"
        );
        seq += 1;
        e
    };
    let mut out = String::new();
    out += &ev(
        "response.created",
        format!("\"response\":{}", response("in_progress", "", "null")),
    );
    out += &ev(
        "response.in_progress",
        format!("\"response\":{}", response("in_progress", "", "null")),
    );
    out += &ev(
        "response.output_item.added",
        format!(
            "\"output_index\":0,\"item\":{{\"id\":\"{item}\",\"type\":\"message\",\"status\":\"in_progress\",\"role\":\"assistant\",\"content\":[]}}"
        ),
    );
    out += &ev(
        "response.content_part.added",
        format!(
            "\"item_id\":\"{item}\",\"output_index\":0,\"content_index\":0,\"part\":{{\"type\":\"output_text\",\"text\":\"\",\"annotations\":[]}}"
        ),
    );
    for t in &text {
        out += &ev(
            "response.output_text.delta",
            format!(
                "\"item_id\":\"{item}\",\"output_index\":0,\"content_index\":0,\"delta\":\"{t}\""
            ),
        );
    }
    out += &ev(
        "response.output_text.done",
        format!(
            "\"item_id\":\"{item}\",\"output_index\":0,\"content_index\":0,\"text\":\"{full}\""
        ),
    );
    out += &ev(
        "response.content_part.done",
        format!(
            "\"item_id\":\"{item}\",\"output_index\":0,\"content_index\":0,\"part\":{{\"type\":\"output_text\",\"text\":\"{full}\",\"annotations\":[]}}"
        ),
    );
    out += &ev(
        "response.output_item.done",
        format!("\"output_index\":0,\"item\":{message}"),
    );
    let usage = format!(
        "{{\"input_tokens\":37,\"input_tokens_details\":{{\"cached_tokens\":0}},\"output_tokens\":{tokens},\"output_tokens_details\":{{\"reasoning_tokens\":0}},\"total_tokens\":{}}}",
        37 + tokens
    );
    let status = if terminal == "response.incomplete" {
        "incomplete"
    } else {
        "completed"
    };
    out += &ev(
        terminal,
        format!("\"response\":{}", response(status, &message, &usage)),
    );
    out
}

/// A recorded-shape Responses stream (3 text deltas); a `const` so it joins [`streams`].
pub(crate) const RESPONSES: &str = concat!(
    "event: response.created\n",
    "data: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"created_at\":1741290958,\"status\":\"in_progress\",\"model\":\"gpt-4.1-2025-04-14\",\"output\":[],\"usage\":null}}\n\n",
    "event: response.output_text.delta\n",
    "data: {\"type\":\"response.output_text.delta\",\"sequence_number\":1,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":\"Hi\"}\n\n",
    "event: response.output_text.delta\n",
    "data: {\"type\":\"response.output_text.delta\",\"sequence_number\":2,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":\" \\\"usage\\\": {\\\"total_tokens\\\": 1}\"}\n\n",
    "event: response.output_text.delta\n",
    "data: {\"type\":\"response.output_text.delta\",\"sequence_number\":3,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":\"\"}\n\n",
    "event: response.output_text.done\n",
    "data: {\"type\":\"response.output_text.done\",\"sequence_number\":4,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"text\":\"Hi \\\"usage\\\": {\\\"total_tokens\\\": 1}\"}\n\n",
    "event: response.completed\n",
    "data: {\"type\":\"response.completed\",\"sequence_number\":5,\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"created_at\":1741290958,\"status\":\"completed\",\"model\":\"gpt-4.1-2025-04-14\",\"output\":[{\"type\":\"message\",\"id\":\"msg_1\",\"status\":\"completed\",\"role\":\"assistant\",\"content\":[{\"type\":\"output_text\",\"text\":\"Hi \\\"usage\\\": {\\\"total_tokens\\\": 1}\",\"annotations\":[]}]}],\"usage\":{\"input_tokens\":37,\"input_tokens_details\":{\"cached_tokens\":0},\"output_tokens\":11,\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":48}}}\n\n",
);

#[test]
fn anthropic_stream_input_from_message_start_output_from_message_delta() {
    for strip in [false, true] {
        let (out, u, ce, s) = feed_all(strip, &[ANTHROPIC.as_bytes()]);
        assert_eq!(out, ANTHROPIC.as_bytes(), "strip={strip}: nothing stripped");
        assert_eq!(u, usage(25, 15, 40));
        assert_eq!(ce, 3, "three text deltas");
        assert_eq!(s.stripped_events(), 0);
        assert!(!s.done());
    }
}

#[test]
fn anthropic_stream_cache_tokens_thinking_and_tool_deltas() {
    for strip in [false, true] {
        let (out, u, ce, s) = feed_all(strip, &[ANTHROPIC_TOOLS_CACHE.as_bytes()]);
        assert_eq!(out, ANTHROPIC_TOOLS_CACHE.as_bytes());
        assert_eq!(
            u,
            usage(472 + 100 + 1000, 89, 472 + 100 + 1000 + 89),
            "cache tokens are prompt; the last message_delta wins"
        );
        assert_eq!(
            ce, 3,
            "thinking and two non-empty partial_json deltas; not the signature nor the empty one"
        );
        assert_eq!(s.stripped_events(), 0);
    }
}

#[test]
fn anthropic_stream_cut_before_message_delta_counts_what_streamed() {
    // The client went away after two text deltas: message_start's input is exact, its
    // output_tokens (1) is not final, so each content event after it counts one more.
    let cut = ANTHROPIC.find("event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"!\"").unwrap();
    let (_, u, ce, _) = feed_all(false, &[&ANTHROPIC.as_bytes()[..cut]]);
    assert_eq!(ce, 2);
    assert_eq!(u, usage(25, 1 + 2, 25 + 1 + 2));
    // Cut right after message_start: the prompt is still known.
    let first = ANTHROPIC.split_inclusive("\n\n").next().unwrap();
    let (_, u, ce, _) = feed_all(false, &[first.as_bytes()]);
    assert_eq!((u, ce), (usage(25, 1, 26), 0));
}

#[test]
fn responses_stream_usage_from_response_completed() {
    for strip in [false, true] {
        let (out, u, ce, s) = feed_all(strip, &[RESPONSES.as_bytes()]);
        assert_eq!(out, RESPONSES.as_bytes(), "strip={strip}: nothing stripped");
        assert_eq!(u, usage(37, 11, 48), "created's usage:null ignored");
        assert_eq!(
            ce, 2,
            "non-empty deltas only; the done events repeat the text"
        );
        assert_eq!(s.stripped_events(), 0);
    }
    for terminal in ["response.completed", "response.incomplete"] {
        let stream = responses_stream(40, terminal);
        let (out, u, ce, _) = feed_all(true, &[stream.as_bytes()]);
        assert_eq!(out, stream.as_bytes());
        assert_eq!(u, usage(37, 40, 77), "{terminal}");
        assert_eq!(ce, 40);
    }
}

#[test]
fn responses_stream_cut_before_completed_has_no_usage_but_content() {
    let stream = responses_stream(5, "response.completed");
    let cut = stream.find("event: response.output_text.done").unwrap();
    let (_, u, ce, _) = feed_all(false, &[&stream.as_bytes()[..cut]]);
    assert_eq!((u, ce), (None, 5));
}

#[test]
fn openai_usage_covers_content_before_it() {
    // vLLM's usage rides on the last content chunk: that chunk is covered by its own count.
    let (_, u, ce, _) = feed_all(false, &[VLLM_LAST_CHUNK.as_bytes()]);
    assert_eq!((u, ce), (usage(7, 3, 10), 3));
}

#[test]
fn message_and_response_usage_are_read_but_never_stripped() {
    for ev in [
        "data: {\"choices\":[],\"message\":{\"usage\":{\"input_tokens\":3}}}\n\n",
        "data: {\"choices\":[],\"response\":{\"usage\":{\"input_tokens\":3}}}\n\n",
        "data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":3}}\n\n",
    ] {
        let (out, u, _, s) = feed_all(true, &[ev.as_bytes()]);
        assert_eq!(out, ev.as_bytes(), "{ev}");
        assert_eq!(s.stripped_events(), 0);
        assert_eq!(u.map(|u| u.total_tokens), Some(3));
    }
}

/// One stream of `family` (0 OpenAI chat, 1 Anthropic, 2 Responses) with `n` content deltas of
/// arbitrary text, its usage and its content-event count.
fn family_stream(
    family: usize,
    texts: &[String],
    prompt: u64,
    pad: usize,
) -> (String, Option<Usage>, u64) {
    let pad = "p".repeat(pad);
    let n = texts.len() as u64;
    let nonempty = texts.iter().filter(|t| !t.is_empty()).count() as u64;
    let mut out = String::new();
    match family {
        0 => {
            for t in texts {
                let c = serde_json::json!({"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":t},"finish_reason":null}],"usage":null});
                out += &format!("data: {c}\n\n");
            }
            let u = serde_json::json!({"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":prompt,"completion_tokens":n,"total_tokens":prompt + n}});
            out += &format!("data: {u}\n\ndata: [DONE]\n\n");
        }
        1 => {
            let start = serde_json::json!({"type":"message_start","message":{"id":"m","type":"message","role":"assistant","content":[],"model":pad,"usage":{"input_tokens":prompt,"cache_read_input_tokens":0,"output_tokens":1}}});
            out += &format!("event: message_start\ndata: {start}\n\n");
            for t in texts {
                let d = serde_json::json!({"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":t}});
                out += &format!("event: content_block_delta\ndata: {d}\n\n");
            }
            let d = serde_json::json!({"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":n}});
            out += &format!(
                "event: message_delta\ndata: {d}\n\nevent: message_stop\ndata: {{\"type\":\"message_stop\"}}\n\n"
            );
        }
        _ => {
            out += "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"usage\":null}}\n\n";
            for t in texts {
                let d = serde_json::json!({"type":"response.output_text.delta","item_id":"i","output_index":0,"content_index":0,"delta":t});
                out += &format!("event: response.output_text.delta\ndata: {d}\n\n");
            }
            let c = serde_json::json!({"type":"response.completed","response":{"status":"completed","instructions":pad,"output":[{"content":[{"type":"output_text","text":texts.concat()}]}],"usage":{"input_tokens":prompt,"output_tokens":n,"total_tokens":prompt + n}}});
            out += &format!("event: response.completed\ndata: {c}\n\n");
        }
    }
    (out, usage(prompt, n, prompt + n), nonempty)
}

proptest! {
    #[test]
    fn every_family_exact_usage_whatever_the_chunking(
        family in 0usize..3,
        texts in proptest::collection::vec(tricky_text(), 0..12),
        prompt in 0u64..100_000,
        points in proptest::collection::vec(0usize..6000, 0..16),
        line_ending in 0usize..3,
        big in proptest::option::weighted(0.2, (LINE_CAP - 100)..(LINE_CAP + 100)),
    ) {
        // `big`: the event with the input usage is about LINE_CAP long (Responses and Anthropic):
        // parsed whole or scanned as it passes, the same counts.
        let pad = if family == 0 { 0 } else { big.unwrap_or(0) };
        let (stream, expected, nonempty) = family_stream(family, &texts, prompt, pad);
        let scale = stream.len() / 6000 + 1;
        let points: Vec<usize> = points.iter().map(|p| p * scale).collect();
        let stream = match line_ending { 0 => stream, 1 => crlf(&stream), _ => cr(&stream) };
        let bytes = stream.as_bytes();
        for strip in [false, true] {
            let (out, u, ce, s) = feed_all(strip, &split_at_points(bytes, points.clone()));
            if family == 0 && strip {
                prop_assert_eq!(s.stripped_events(), 1);
            } else {
                prop_assert_eq!(&out, &bytes.to_vec(), "only the OpenAI usage chunk is ever stripped");
                prop_assert_eq!(s.stripped_events(), 0);
            }
            prop_assert_eq!(u, expected);
            prop_assert_eq!(ce, nonempty);
        }
    }
}

/// A Responses `response.completed` larger than [`LINE_CAP`] / [`DATA_CAP`] (it repeats the whole
/// output): too large to parse whole, its usage is still found by the spill scan, whatever the
/// chunking, with memory bounded.
#[test]
fn responses_completed_larger_than_the_caps_still_gives_usage() {
    let stream = responses_stream(12_000, "response.completed");
    let completed = stream.split_inclusive("\n\n").last().unwrap().to_string();
    assert!(completed.len() > LINE_CAP, "{}", completed.len());
    for strip in [false, true] {
        let whole = feed_all(strip, &[stream.as_bytes()]);
        assert_eq!(whole.0, stream.as_bytes());
        assert_eq!(whole.1, usage(37, 12_000, 12_037));
        assert_eq!(whole.2, 12_000);
        for size in [1usize, 7, 4096, 65_536] {
            let parts: Vec<&[u8]> = stream.as_bytes().chunks(size).collect();
            let split = feed_all(strip, &parts);
            assert_eq!(split.1, whole.1, "chunks of {size}");
            assert_eq!(split.2, whole.2);
            assert_eq!(split.0, whole.0);
            assert!(
                split.3.max_buffered_bytes() <= LINE_CAP + DATA_CAP + EVENT_CAP,
                "{}",
                split.3.max_buffered_bytes()
            );
        }
    }
}

/// The same over many `data:` lines (each shorter than [`LINE_CAP`], together more than
/// [`DATA_CAP`]), and an Anthropic `message_start` so padded: found, merged as usual.
#[test]
fn multi_line_data_larger_than_data_cap_still_gives_usage() {
    let pad = "p".repeat(1000);
    let mut lines = vec![format!(
        "{{\"type\":\"response.completed\",\"response\":{{\"status\":\"completed\","
    )];
    for i in 0..100 {
        lines.push(format!("\"instructions{i}\":\"{pad}\","));
    }
    lines.push(
        "\"usage\":{\"input_tokens\":5000,\"output_tokens\":7,\"total_tokens\":5007}}}".into(),
    );
    let data: String = lines.iter().map(|l| format!("data: {l}\n")).collect();
    assert!(data.len() > DATA_CAP);
    let stream = format!("event: response.completed\n{data}\n");
    let start = format!(
        "event: message_start\ndata: {{\"type\":\"message_start\",\"message\":{{\"id\":\"m\",\"content\":[],\"system\":\"{}\",\"usage\":{{\"input_tokens\":9,\"output_tokens\":1}}}}}}\n\n",
        "s".repeat(DATA_CAP)
    );
    let anthropic = format!(
        "{start}event: message_delta\ndata: {{\"type\":\"message_delta\",\"usage\":{{\"output_tokens\":3}}}}\n\n"
    );
    for (s, expected) in [(stream, usage(5000, 7, 5007)), (anthropic, usage(9, 3, 12))] {
        for strip in [false, true] {
            let whole = feed_all(strip, &[s.as_bytes()]);
            assert_eq!(whole.0, s.as_bytes());
            assert_eq!(whole.1, expected);
            let parts: Vec<&[u8]> = s.as_bytes().chunks(333).collect();
            assert_eq!(feed_all(strip, &parts).1, expected);
        }
    }
}

/// Only `usage`, `response.usage` and `message.usage` count in a spilled event.
#[test]
fn spill_scan_ignores_usage_elsewhere() {
    let big = "q".repeat(LINE_CAP);
    for (data, expected) in [
        (
            format!("{{\"pad\":\"{big}\",\"item\":{{\"usage\":{{\"total_tokens\":5}}}}}}"),
            None,
        ),
        (
            format!(
                "{{\"response\":{{\"output\":[{{\"usage\":{{\"total_tokens\":5}}}}],\"pad\":\"{big}\"}}}}"
            ),
            None,
        ),
        (
            format!(
                "{{\"response\":{{\"response\":{{\"usage\":{{\"total_tokens\":5}}}}}},\"pad\":\"{big}\"}}"
            ),
            None,
        ),
        (
            format!("{{\"pad\":\"{big}\",\"usage\":{{\"total_tokens\":5}}}}"),
            usage(0, 0, 5),
        ),
    ] {
        let s = format!("data: {data}\n\n");
        let (_, u, _, _) = feed_all(false, &[s.as_bytes()]);
        assert_eq!(u, expected, "{}", &data[..80.min(data.len())]);
    }
}
