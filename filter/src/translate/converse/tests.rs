use super::super::eventstream::encode;
use super::*;

fn req(v: Value) -> (Value, ClientAsk) {
    let (b, ask) = request(&serde_json::to_vec(&v).unwrap()).unwrap();
    (serde_json::from_slice(&b).unwrap(), ask)
}

#[test]
fn a_chat_request_becomes_a_converse_request() {
    let (out, ask) = req(json!({
        "model": "claude", "stream": true, "stream_options": {"include_usage": true},
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "user", "content": [{"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "hello"},
            {"role": "developer", "content": "no lists"},
            {"role": "user", "content": "and?"}
        ],
        "max_tokens": 50, "max_completion_tokens": 40, "temperature": 0.5, "top_p": 0.9,
        "stop": "END", "n": 1
    }));
    assert_eq!(
        ask,
        ClientAsk {
            stream: true,
            include_usage: true
        }
    );
    assert_eq!(
        out,
        json!({
            "system": [{"text": "be brief"}, {"text": "no lists"}],
            "messages": [
                {"role": "user", "content": [{"text": "hi"}, {"text": "there"}]},
                {"role": "assistant", "content": [{"text": "hello"}]},
                {"role": "user", "content": [{"text": "and?"}]}
            ],
            "inferenceConfig": {"maxTokens": 50, "temperature": 0.5, "topP": 0.9,
                                "stopSequences": ["END"]}
        })
    );
}

#[test]
fn what_converse_cannot_say_is_refused_by_name() {
    for (body, what) in [
        (
            json!({"messages": [{"role": "user", "content": "x"}], "tools": []}),
            "tools",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "n": 2}),
            "n",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            "messages[0].content[0]",
        ),
        (
            json!({"messages": [{"role": "tool", "content": "x"}]}),
            "messages[0].role",
        ),
        (
            json!({"messages": [{"role": "system", "content": "x"}]}),
            "user message",
        ),
        (json!({"model": "m"}), "messages is required"),
        (json!({"messages": [], "max_tokens": -1}), "max_tokens"),
    ] {
        let e = request(&serde_json::to_vec(&body).unwrap()).unwrap_err();
        assert!(e.0.contains(what), "{body}: {}", e.0);
    }
    assert!(request(b"[1]").is_err());
}

#[test]
fn a_converse_answer_becomes_a_chat_completion_with_its_usage() {
    let body = json!({
        "output": {"message": {"role": "assistant", "content": [{"text": "Hel"}, {"text": "lo"}]}},
        "stopReason": "max_tokens",
        "usage": {"inputTokens": 12, "outputTokens": 5, "totalTokens": 17},
        "metrics": {"latencyMs": 10}
    })
    .to_string();
    let mut a = Answer::new("application/json", true, ClientAsk::default(), "claude", 9);
    assert!(!a.is_stream());
    let (head, tail) = body.as_bytes().split_at(10);
    assert!(a.feed(head, false).is_empty());
    let out: Value = serde_json::from_slice(&a.feed(tail, true)).unwrap();
    assert_eq!(out["object"], "chat.completion");
    assert_eq!(out["model"], "claude");
    assert_eq!(out["choices"][0]["message"]["content"], "Hello");
    assert_eq!(out["choices"][0]["finish_reason"], "length");
    assert_eq!(out["usage"]["prompt_tokens"], 12);
    assert_eq!(out["usage"]["completion_tokens"], 5);
    assert_eq!(
        a.usage(),
        Some(Usage {
            prompt_tokens: 12,
            completion_tokens: 5,
            total_tokens: 17,
            cached_input_tokens: 0
        })
    );
    // A Bedrock error: an OpenAI error, no usage.
    let mut a = Answer::new("application/json", true, ClientAsk::default(), "c", 9);
    let out: Value =
        serde_json::from_slice(&a.feed(br#"{"message":"The security token is invalid"}"#, true))
            .unwrap();
    assert_eq!(out["error"]["message"], "The security token is invalid");
    assert_eq!(a.usage(), None);
}

fn event(kind: &str, payload: Value) -> Vec<u8> {
    encode(
        &[
            (":event-type", kind),
            (":content-type", "application/json"),
            (":message-type", "event"),
        ],
        payload.to_string().as_bytes(),
    )
}

fn stream() -> Vec<u8> {
    [
        event("messageStart", json!({"role": "assistant"})),
        event("contentBlockDelta", json!({"contentBlockIndex": 0, "delta": {"text": "Hel"}})),
        event("contentBlockDelta", json!({"contentBlockIndex": 0, "delta": {"text": "lo"}})),
        event("contentBlockStop", json!({"contentBlockIndex": 0})),
        event("messageStop", json!({"stopReason": "end_turn"})),
        event(
            "metadata",
            json!({"usage": {"inputTokens": 7, "outputTokens": 2, "totalTokens": 9}, "metrics": {"latencyMs": 1}}),
        ),
    ]
    .concat()
}

/// The SSE events of a translated stream (`data:` values).
fn events(out: &[u8]) -> Vec<String> {
    String::from_utf8(out.to_vec())
        .unwrap()
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").unwrap().to_string())
        .collect()
}

#[test]
fn a_converse_stream_becomes_chunks_usage_and_done_whatever_its_split() {
    let bytes = stream();
    let ask = ClientAsk {
        stream: true,
        include_usage: true,
    };
    for step in [1, 7, 50, bytes.len()] {
        let mut a = Answer::new(EVENTSTREAM, true, ask, "claude", 3);
        assert!(a.is_stream());
        let mut out = Vec::new();
        let chunks: Vec<&[u8]> = bytes.chunks(step).collect();
        for (i, c) in chunks.iter().enumerate() {
            out.extend(a.feed(c, i + 1 == chunks.len()));
            assert!(a.pending() < 200, "only the trailing message is carried");
        }
        let ev = events(&out);
        assert_eq!(ev.len(), 6, "{step}: {ev:?}");
        let v: Vec<Value> = ev[..5]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        assert_eq!(v[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(v[1]["choices"][0]["delta"]["content"], "Hel");
        assert_eq!(v[2]["choices"][0]["delta"]["content"], "lo");
        assert_eq!(v[3]["choices"][0]["finish_reason"], "stop");
        assert_eq!(v[4]["choices"], json!([]));
        assert_eq!(v[4]["usage"]["prompt_tokens"], 7);
        assert_eq!(v[0]["object"], "chat.completion.chunk");
        assert_eq!(ev[5], "[DONE]");
        assert_eq!(a.usage().unwrap().completion_tokens, 2);
        assert_eq!(a.content_events(), 2);
    }
    // Without include_usage: no usage chunk, metering still has it.
    let mut a = Answer::new(EVENTSTREAM, true, ClientAsk::default(), "c", 3);
    let ev = events(&a.feed(&bytes, true));
    assert_eq!(ev.len(), 5);
    assert_eq!(a.usage().unwrap().prompt_tokens, 7);
}

#[test]
fn a_corrupt_stream_or_an_exception_ends_in_an_error_event() {
    let mut bytes = stream();
    let n = bytes.len();
    bytes[n - 10] ^= 0xff;
    let mut a = Answer::new(EVENTSTREAM, true, ClientAsk::default(), "c", 3);
    let ev = events(&a.feed(&bytes, false));
    let last: Value = serde_json::from_str(ev.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "untranslatable_response");
    assert!(a.feed(b"more", true).is_empty(), "nothing after the error");
    assert_eq!(a.usage(), None);

    let exception = encode(
        &[
            (":exception-type", "throttlingException"),
            (":content-type", "application/json"),
            (":message-type", "exception"),
        ],
        br#"{"message":"slow down"}"#,
    );
    let mut a = Answer::new(EVENTSTREAM, true, ClientAsk::default(), "c", 3);
    let ev = events(&a.feed(&exception, false));
    let v: Value = serde_json::from_str(&ev[0]).unwrap();
    assert_eq!(v["error"]["message"], "slow down");
    assert_eq!(v["error"]["code"], "throttlingException");
}
