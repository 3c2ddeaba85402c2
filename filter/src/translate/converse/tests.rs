use super::super::eventstream::encode;
use super::*;
use crate::encoding::Coding;
use std::io::Write;

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
            json!({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 2}}),
            "logit_bias",
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
            json!({"messages": [{"role": "function", "content": "x"}]}),
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
    let mut a = Answer::new(
        "application/json",
        Coding::Identity,
        ClientAsk::default(),
        "claude",
        9,
    );
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
    let mut a = Answer::new(
        "application/json",
        Coding::Identity,
        ClientAsk::default(),
        "c",
        9,
    );
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
        let mut a = Answer::new(EVENTSTREAM, Coding::Identity, ask, "claude", 3);
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
    let mut a = Answer::new(EVENTSTREAM, Coding::Identity, ClientAsk::default(), "c", 3);
    let ev = events(&a.feed(&bytes, true));
    assert_eq!(ev.len(), 5);
    assert_eq!(a.usage().unwrap().prompt_tokens, 7);
}

#[test]
fn a_corrupt_stream_or_an_exception_ends_in_an_error_event() {
    let mut bytes = stream();
    let n = bytes.len();
    bytes[n - 10] ^= 0xff;
    let mut a = Answer::new(EVENTSTREAM, Coding::Identity, ClientAsk::default(), "c", 3);
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
    let mut a = Answer::new(EVENTSTREAM, Coding::Identity, ClientAsk::default(), "c", 3);
    let ev = events(&a.feed(&exception, false));
    let v: Value = serde_json::from_str(&ev[0]).unwrap();
    assert_eq!(v["error"]["message"], "slow down");
    assert_eq!(v["error"]["code"], "throttlingException");
}

fn refused(v: Value) -> String {
    request(&serde_json::to_vec(&v).unwrap()).unwrap_err().0
}

#[test]
fn tools_tool_calls_tool_results_and_images_become_converse_blocks() {
    let (out, _) = req(json!({
        "model": "claude", "tool_choice": "required", "parallel_tool_calls": true,
        "tools": [
            {"type": "function", "function": {"name": "get", "description": "Gets.",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                "strict": false}},
            {"type": "function", "function": {"name": "now", "description": ""}}
        ],
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "auto"}},
                {"type": "image_url", "image_url": {"url": "data:image/webp;base64,UklGRg=="}}
            ]},
            {"role": "assistant", "content": null, "refusal": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"q\":\"a\"}"}},
                {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}}
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": "r1"},
            {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "r2"}]},
            {"role": "user", "content": "thanks"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "c3", "type": "function", "function": {"name": "get", "arguments": "{}"}}
            ]},
            {"role": "tool", "tool_call_id": "c3", "content": "r3"}
        ]
    }));
    assert_eq!(
        out,
        json!({
            "system": [{"text": "be brief"}],
            "messages": [
                {"role": "user", "content": [
                    {"text": "what is this?"},
                    {"image": {"format": "png", "source": {"bytes": "iVBORw0KGgo="}}},
                    {"image": {"format": "webp", "source": {"bytes": "UklGRg=="}}}
                ]},
                {"role": "assistant", "content": [
                    {"toolUse": {"toolUseId": "c1", "name": "get", "input": {"q": "a"}}},
                    {"toolUse": {"toolUseId": "c2", "name": "now", "input": {}}}
                ]},
                // The run of tool messages and the user message after it: one user message.
                {"role": "user", "content": [
                    {"toolResult": {"toolUseId": "c1", "content": [{"text": "r1"}]}},
                    {"toolResult": {"toolUseId": "c2", "content": [{"text": "r2"}]}},
                    {"text": "thanks"}
                ]},
                {"role": "assistant", "content": [
                    {"text": "Let me look."},
                    {"toolUse": {"toolUseId": "c3", "name": "get", "input": {}}}
                ]},
                {"role": "user", "content": [
                    {"toolResult": {"toolUseId": "c3", "content": [{"text": "r3"}]}}
                ]}
            ],
            "toolConfig": {
                "tools": [
                    {"toolSpec": {"name": "get", "description": "Gets.", "inputSchema": {"json":
                        {"type": "object", "properties": {"q": {"type": "string"}}}}}},
                    {"toolSpec": {"name": "now", "inputSchema": {"json":
                        {"type": "object", "properties": {}}}}}
                ],
                "toolChoice": {"any": {}}
            }
        })
    );
}

#[test]
fn tool_choice_becomes_converse_tool_choice_or_is_refused_where_converse_has_none() {
    let user = json!([{"role": "user", "content": "x"}]);
    let tools = json!([{"type": "function", "function": {"name": "get"}}]);
    let with = |extra: Value| {
        let mut body = json!({"messages": user, "tools": tools});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    for (choice, want) in [
        (json!("auto"), Some(json!({"auto": {}}))),
        (json!("required"), Some(json!({"any": {}}))),
        (
            json!({"type": "function", "function": {"name": "get"}}),
            Some(json!({"tool": {"name": "get"}})),
        ),
        (Value::Null, None),
    ] {
        let (out, _) = req(with(json!({"tool_choice": choice})));
        assert_eq!(
            out["toolConfig"].get("toolChoice"),
            want.as_ref(),
            "{choice}"
        );
    }
    // No tools: `auto`, `none` and one call at a time ask nothing; no toolConfig is sent.
    for extra in [
        json!({"tool_choice": "none"}),
        json!({"tool_choice": "auto", "tools": []}),
        json!({"parallel_tool_calls": false, "tools": null}),
    ] {
        let mut body = json!({"messages": user});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (out, _) = req(body);
        assert!(out.get("toolConfig").is_none(), "{extra}: {out}");
    }
    for (body, named) in [
        (with(json!({"tool_choice": "none"})), "tool_choice \"none\""),
        (
            with(json!({"parallel_tool_calls": false})),
            "parallel_tool_calls",
        ),
        (with(json!({"tool_choice": "sometimes"})), "sometimes"),
        (
            json!({"messages": user, "tool_choice": "required"}),
            "tool_choice requires tools",
        ),
        (
            with(json!({"tools": [{"type": "custom", "custom": {"name": "x"}}]})),
            "tools[0]: only function tools",
        ),
        (
            with(
                json!({"tools": [{"type": "function", "function": {"name": "x", "strict": true}}]}),
            ),
            "tools[0].function.strict",
        ),
        (
            with(json!({"tools": [{"type": "function", "function": {"description": "x"}}]})),
            "tools[0].function.name",
        ),
    ] {
        let e = refused(body.clone());
        assert!(e.contains(named), "{body}: {e}");
    }
}

#[test]
fn tool_messages_and_images_converse_cannot_take_are_refused_by_name() {
    let image = |url: &str, detail: Value| {
        json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url, "detail": detail}}]}]})
    };
    let call = |arguments: &str| {
        json!({"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "f", "arguments": arguments}}]})
    };
    let tools = json!([{"type": "function", "function": {"name": "f"}}]);
    for (body, named) in [
        (
            image("https://example.com/a.png", Value::Null),
            "messages[0].content[0].image_url.url: AWS Bedrock Converse takes an image's bytes",
        ),
        (
            image("data:image/tiff;base64,AA==", Value::Null),
            "image/tiff",
        ),
        (
            image("data:image/png,rawbytes", Value::Null),
            "must be base64",
        ),
        (
            image("data:image/png;base64,AA==", json!("high")),
            "messages[0].content[0].image_url.detail",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}),
            "input_audio",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]}),
            "messages[1].content[0]: only text parts",
        ),
        (
            json!({"tools": tools, "messages": [{"role": "user", "content": "x"}, call("[1]")]}),
            "messages[1].tool_calls[0].function.arguments must be a JSON object",
        ),
        (
            json!({"tools": tools, "messages": [{"role": "user", "content": "x"}, call("{")]}),
            "arguments must be a JSON object",
        ),
        (
            json!({"tools": tools, "messages": [{"role": "user", "content": "x"},
                {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]}),
            "messages[1].tool_calls[0] must be a function call",
        ),
        (
            json!({"tools": tools, "messages": [{"role": "tool", "content": "r"}]}),
            "messages[0].tool_call_id is required",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}, call("{}"),
                {"role": "tool", "tool_call_id": "c", "content": "r"}]}),
            "tools are required",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]}),
            "messages[0].audio",
        ),
    ] {
        let e = refused(body.clone());
        assert!(e.contains(named), "{body}: {e}");
    }
}

#[test]
fn a_converse_tool_use_answer_becomes_tool_calls() {
    let body = json!({
        "output": {"message": {"role": "assistant", "content": [
            {"text": "Let me look."},
            {"toolUse": {"toolUseId": "tooluse_1", "name": "get", "input": {"q": "a"}}},
            {"toolUse": {"toolUseId": "tooluse_2", "name": "now", "input": {}}}
        ]}},
        "stopReason": "tool_use",
        "usage": {"inputTokens": 30, "outputTokens": 9, "totalTokens": 39}
    });
    let mut a = Answer::new(
        "application/json",
        Coding::Identity,
        ClientAsk::default(),
        "claude",
        9,
    );
    let out: Value = serde_json::from_slice(&a.feed(body.to_string().as_bytes(), true)).unwrap();
    let choice = &out["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["content"], "Let me look.");
    assert_eq!(
        choice["message"]["tool_calls"],
        json!([
            {"id": "tooluse_1", "type": "function", "function": {"name": "get", "arguments": "{\"q\":\"a\"}"}},
            {"id": "tooluse_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}
        ])
    );
    assert_eq!(a.usage().unwrap().prompt_tokens, 30);
    // Tool calls alone: the content is null, as OpenAI answers them.
    let body = json!({
        "output": {"message": {"role": "assistant", "content": [
            {"toolUse": {"toolUseId": "t", "name": "get", "input": {}}}]}},
        "stopReason": "tool_use",
        "usage": {"inputTokens": 3, "outputTokens": 2}
    });
    let mut a = Answer::new(
        "application/json",
        Coding::Identity,
        ClientAsk::default(),
        "claude",
        9,
    );
    let out: Value = serde_json::from_slice(&a.feed(body.to_string().as_bytes(), true)).unwrap();
    assert_eq!(out["choices"][0]["message"]["content"], Value::Null);
    assert_eq!(
        out["choices"][0]["message"]["tool_calls"][0]["id"],
        json!("t")
    );
}

fn tool_stream() -> Vec<u8> {
    let tool_delta = |index: u64, input: &str| {
        event(
            "contentBlockDelta",
            json!({"contentBlockIndex": index, "delta": {"toolUse": {"input": input}}}),
        )
    };
    [
        event("messageStart", json!({"role": "assistant"})),
        event("contentBlockDelta", json!({"contentBlockIndex": 0, "delta": {"text": "Let me"}})),
        event("contentBlockStop", json!({"contentBlockIndex": 0})),
        event(
            "contentBlockStart",
            json!({"contentBlockIndex": 1, "start": {"toolUse": {"toolUseId": "tooluse_1", "name": "get"}}}),
        ),
        tool_delta(1, "{\"q\": \"P"),
        tool_delta(1, "aris\"}"),
        event("contentBlockStop", json!({"contentBlockIndex": 1})),
        event(
            "contentBlockStart",
            json!({"contentBlockIndex": 2, "start": {"toolUse": {"toolUseId": "tooluse_2", "name": "now"}}}),
        ),
        tool_delta(2, "{}"),
        event("contentBlockStop", json!({"contentBlockIndex": 2})),
        event("messageStop", json!({"stopReason": "tool_use"})),
        event(
            "metadata",
            json!({"usage": {"inputTokens": 20, "outputTokens": 11, "totalTokens": 31}}),
        ),
    ]
    .concat()
}

#[test]
fn a_converse_tool_use_stream_becomes_tool_call_deltas_whatever_its_split() {
    let bytes = tool_stream();
    for step in [1, 5, 33, 100, bytes.len()] {
        let mut a = Answer::new(
            EVENTSTREAM,
            Coding::Identity,
            ClientAsk::default(),
            "claude",
            3,
        );
        let mut out = Vec::new();
        let chunks: Vec<&[u8]> = bytes.chunks(step).collect();
        for (i, c) in chunks.iter().enumerate() {
            let got = a.feed(c, i + 1 == chunks.len());
            // Never buffered: each complete frame's chunk goes out with the piece ending it.
            out.extend(got);
            assert!(a.pending() < 200, "only the trailing message is carried");
        }
        let ev = events(&out);
        assert_eq!(ev.last().map(String::as_str), Some("[DONE]"), "{step}");
        let v: Vec<Value> = ev[..ev.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        let deltas: Vec<&Value> = v.iter().map(|c| &c["choices"][0]["delta"]).collect();
        assert_eq!(deltas[1]["content"], "Let me", "{step}");
        assert_eq!(
            *deltas[2],
            json!({"tool_calls": [{"index": 0, "id": "tooluse_1", "type": "function",
                "function": {"name": "get", "arguments": ""}}]})
        );
        assert_eq!(
            *deltas[3],
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"q\": \"P"}}]})
        );
        assert_eq!(
            *deltas[4],
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "aris\"}"}}]})
        );
        assert_eq!(deltas[5]["tool_calls"][0]["index"], 1);
        assert_eq!(deltas[5]["tool_calls"][0]["id"], "tooluse_2");
        assert_eq!(
            *deltas[6],
            json!({"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]})
        );
        assert_eq!(v[7]["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(v.len(), 8, "{step}: {ev:?}");
        // The arguments joined are the input Bedrock streamed.
        let joined: String = deltas
            .iter()
            .filter(|d| d["tool_calls"][0]["index"] == 0)
            .filter_map(|d| d["tool_calls"][0]["function"]["arguments"].as_str())
            .collect();
        assert_eq!(
            serde_json::from_str::<Value>(&joined).unwrap(),
            json!({"q": "Paris"})
        );
        assert_eq!(a.usage().unwrap().completion_tokens, 11);
        assert_eq!(a.content_events(), 4);
    }
}

#[test]
fn each_frame_is_translated_as_it_arrives() {
    // The tool call's start goes out with the frame that carries it, before the rest arrives.
    let mut a = Answer::new(
        EVENTSTREAM,
        Coding::Identity,
        ClientAsk::default(),
        "claude",
        3,
    );
    let start = event(
        "contentBlockStart",
        json!({"contentBlockIndex": 0, "start": {"toolUse": {"toolUseId": "t", "name": "get"}}}),
    );
    let ev = events(&a.feed(&start, false));
    assert_eq!(ev.len(), 2, "the role chunk, then the call: {ev:?}");
    let call: Value = serde_json::from_str(&ev[1]).unwrap();
    assert_eq!(
        call["choices"][0]["delta"]["tool_calls"][0]["function"]["name"],
        "get"
    );
    // A fragment of a block that never started as a tool call is nobody's: skipped.
    let stray = event(
        "contentBlockDelta",
        json!({"contentBlockIndex": 5, "delta": {"toolUse": {"input": "{}"}}}),
    );
    assert!(a.feed(&stray, false).is_empty());
}

fn gzip(b: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(b).unwrap();
    e.finish().unwrap()
}

/// A provider that gzips its answer although the gateway asked for identity: the event stream
/// is decoded chunk by chunk, whatever the split, translated, and its usage read; the client
/// gets it uncompressed. A corrupt or cut compressed stream, or a coding the gateway cannot
/// decode, ends in an error event (usage unknown: the request settles to its reservation).
#[test]
fn a_gzipped_converse_stream_is_decoded_then_translated() {
    let gz = gzip(&stream());
    let ask = ClientAsk {
        stream: true,
        include_usage: true,
    };
    for step in [1, 9, gz.len()] {
        let mut a = Answer::new(EVENTSTREAM, Coding::Gzip, ask, "claude", 3);
        assert!(a.is_stream() && a.drops_encoding());
        let mut out = Vec::new();
        let chunks: Vec<&[u8]> = gz.chunks(step).collect();
        for (i, c) in chunks.iter().enumerate() {
            out.extend(a.feed(c, i + 1 == chunks.len()));
        }
        let ev = events(&out);
        assert_eq!(ev.len(), 6, "{step}: {ev:?}");
        assert_eq!(ev[5], "[DONE]");
        assert_eq!(a.usage().unwrap().completion_tokens, 2);
    }
    let cut = &gz[..gz.len() - 4];
    let mut a = Answer::new(EVENTSTREAM, Coding::Gzip, ask, "claude", 3);
    let ev = events(&a.feed(cut, true));
    let last: Value = serde_json::from_str(ev.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "untranslatable_response");
    assert_eq!(a.usage(), None);
    let mut a = Answer::new(EVENTSTREAM, Coding::Unreadable, ask, "claude", 3);
    assert!(a.is_stream() && a.drops_encoding());
    assert!(a.feed(b"\x28\xb5\x2f\xfd", false).is_empty());
    let ev = events(&a.feed(b"", true));
    let only: Value = serde_json::from_str(&ev[0]).unwrap();
    assert_eq!(only["error"]["code"], "untranslatable_response");
    // A gzipped JSON answer likewise.
    let body = serde_json::to_vec(&json!({
        "output": {"message": {"role": "assistant", "content": [{"text": "hi"}]}},
        "stopReason": "end_turn",
        "usage": {"inputTokens": 3, "outputTokens": 1, "totalTokens": 4}
    }))
    .unwrap();
    let mut a = Answer::new(
        "application/json",
        Coding::Gzip,
        ClientAsk::default(),
        "c",
        9,
    );
    let v: Value = serde_json::from_slice(&a.feed(&gzip(&body), true)).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "hi");
    assert_eq!(a.usage().map(|u| u.total_tokens), Some(4));
}
