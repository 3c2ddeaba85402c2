use super::event::find_byte;
use super::*;
use proptest::prelude::*;

mod streams;
use streams::{
    ANTHROPIC, ANTHROPIC_TOOLS_CACHE, RESPONSES, openai_stream_chunks, responses_stream,
};

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
    usage_cached(p, c, t, 0)
}

fn usage_cached(p: u64, c: u64, t: u64, cached: u64) -> Option<Usage> {
    Some(Usage {
        prompt_tokens: p,
        completion_tokens: c,
        total_tokens: t,
        cached_input_tokens: cached,
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

#[test]
fn splice_copies_only_what_changed() {
    // Untouched chunk, nothing held: no replacement (the host keeps its chunk, no call).
    assert_eq!(splice(Cow::Borrowed(b"data: x\n\n"), b""), None);
    // Held tail at the end of the stream is appended to the chunk.
    assert_eq!(
        splice(Cow::Borrowed(b"a"), b"b").as_deref(),
        Some(&b"ab"[..])
    );
    // A rewritten chunk (event stripped) replaces the host's, held tail after it.
    assert_eq!(
        splice(Cow::Owned(b"x".to_vec()), b"").as_deref(),
        Some(&b"x"[..])
    );
    assert_eq!(
        splice(Cow::Owned(b"x".to_vec()), b"y").as_deref(),
        Some(&b"xy"[..])
    );
}
