//! Realistic streams of every API family, their counts and the scanner's speed.

use super::*;

/// A realistic OpenAI stream: role chunk, `tokens` content chunks, finish chunk, usage chunk,
/// `[DONE]`; one event per chunk, as upstreams send them.
pub(super) fn openai_stream_chunks(tokens: usize) -> Vec<String> {
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
/// `cargo test -p maas-filter --release --lib sse::tests::streams::per_stream -- --ignored --nocapture`.
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
/// `cargo test -p maas-filter --release --lib sse::tests::streams::throughput -- --ignored --nocapture`.
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
pub(super) fn responses_stream(tokens: usize, terminal: &str) -> String {
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
            super::usage_cached(472 + 100 + 1000, 89, 472 + 100 + 1000 + 89, 1000),
            "cache tokens are prompt (the reads its cached part); the last message_delta wins"
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
