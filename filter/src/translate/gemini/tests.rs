use super::*;
use crate::encoding::Coding;
use std::io::Write;

fn translated(body: Value) -> Value {
    let (out, _) = request(&serde_json::to_vec(&body).unwrap()).unwrap();
    serde_json::from_slice(&out).unwrap()
}

fn refused(body: Value) -> String {
    request(&serde_json::to_vec(&body).unwrap()).unwrap_err().0
}

#[test]
fn a_chat_body_becomes_generate_content() {
    let (out, ask) = request(
        &serde_json::to_vec(&json!({
            "model": "gemini", "stream": true, "stream_options": {"include_usage": true},
            "max_tokens": 50, "max_completion_tokens": 80, "temperature": 0.2, "top_p": 0.9,
            "stop": "END", "seed": 7, "presence_penalty": 0.5, "n": 1, "frequency_penalty": 0,
            "response_format": {"type": "json_object"},
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "developer", "content": [{"type": "text", "text": "in JSON"}]},
                {"role": "user", "content": "hi", "name": "ann"},
                {"role": "user", "content": [
                    {"type": "text", "text": "and this"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}
                ]},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "more"}
            ]
        }))
        .unwrap(),
    )
    .unwrap();
    assert_eq!(
        ask,
        ClientAsk {
            stream: true,
            include_usage: true
        }
    );
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        v,
        json!({
            "contents": [
                {"role": "user", "parts": [
                    {"text": "hi"}, {"text": "and this"},
                    {"inlineData": {"mimeType": "image/png", "data": "iVBO"}}
                ]},
                {"role": "model", "parts": [{"text": "hello"}]},
                {"role": "user", "parts": [{"text": "more"}]}
            ],
            "systemInstruction": {"parts": [{"text": "be brief"}, {"text": "in JSON"}]},
            "generationConfig": {
                "maxOutputTokens": 80, "temperature": 0.2, "topP": 0.9,
                "stopSequences": ["END"], "seed": 7, "presencePenalty": 0.5,
                "responseMimeType": "application/json"
            }
        })
    );
    // A JSON schema the answer must follow: Gemini's responseJsonSchema.
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}},
                        "required": ["n"]});
    let v = translated(
        json!({"model": "g", "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "count", "strict": false, "schema": schema}}}),
    );
    assert_eq!(
        v["generationConfig"],
        json!({"responseMimeType": "application/json", "responseJsonSchema": schema})
    );
    // No cap, no options: just the contents.
    assert_eq!(
        translated(json!({"model": "g", "messages": [{"role": "user", "content": "x"}]})),
        json!({"contents": [{"role": "user", "parts": [{"text": "x"}]}]})
    );
}

#[test]
fn what_has_no_faithful_translation_is_refused_by_name() {
    let user = json!([{"role": "user", "content": "x"}]);
    for (field, value, names) in [
        (
            "tools",
            json!({"type": "function"}),
            "tools must be an array",
        ),
        (
            "tools",
            json!([{"type": "custom", "custom": {"name": "f"}}]),
            "tools[0]",
        ),
        (
            "tools",
            json!([{"type": "function", "function": {"name": "f", "strict": true}}]),
            "tools[0].function.strict",
        ),
        (
            "tool_choice",
            json!("required"),
            "tool_choice requires tools",
        ),
        ("parallel_tool_calls", json!("no"), "parallel_tool_calls"),
        ("n", json!(2), "n"),
        ("logprobs", json!(true), "logprobs"),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "x"}}),
            "json_schema.schema is required",
        ),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"schema": {}, "strict": true}}),
            "json_schema.strict",
        ),
        (
            "response_format",
            json!({"type": "grammar"}),
            "response_format",
        ),
        ("max_tokens", json!(-1), "max_tokens"),
        ("temperature", json!("hot"), "temperature"),
        ("seed", json!(1.5), "seed"),
        ("stream", json!("yes"), "stream"),
        (
            "stream_options",
            json!({"other": true}),
            "stream_options.other",
        ),
        ("user", json!("u-1"), "user"),
        ("stop", json!([1]), "stop"),
    ] {
        let mut body = json!({"model": "g", "messages": user.clone()});
        body[field] = value;
        let why = refused(body);
        assert!(why.contains(names), "{field}: {why}");
    }
    assert!(refused(json!({"model": "g"})).contains("messages is required"));
    let tools = json!([{"type": "function", "function": {"name": "f"}}]);
    for (field, value, names) in [
        ("parallel_tool_calls", json!(false), "parallel_tool_calls"),
        (
            "tool_choice",
            json!({"type": "function", "function": {"name": "g"}}),
            "\"g\"",
        ),
        ("tool_choice", json!("sometimes"), "tool_choice"),
    ] {
        let mut body = json!({"model": "g", "messages": user.clone(), "tools": tools.clone()});
        body[field] = value;
        let why = refused(body);
        assert!(why.contains(names), "{field}: {why}");
    }
    assert!(request(b"[]").is_err() && request(b"{").is_err());
}

#[test]
fn messages_without_a_faithful_translation_are_refused_by_name() {
    for (messages, names) in [
        (
            json!([{"role": "tool", "content": "r", "tool_call_id": "c"}]),
            "answers no tool call",
        ),
        (
            json!([{"role": "tool", "content": "r"}]),
            "messages[0].tool_call_id is required",
        ),
        (
            json!([{"role": "assistant", "content": null, "tool_calls": [{"id": "c",
            "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]),
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            json!([{"role": "assistant", "content": null, "tool_calls": [{"id": "c"}]}]),
            "messages[0].tool_calls[0]",
        ),
        (
            json!([{"role": "user", "content": "x", "tool_calls": []}]),
            "messages[0].tool_calls",
        ),
        (
            json!([{"role": "function", "content": "r"}]),
            "messages[0].role",
        ),
        (
            json!([{"role": "system", "content": "only"}]),
            "a user message",
        ),
        (
            json!([{"role": "user", "content": [{"type": "input_audio"}]}]),
            "messages[0].content[0]",
        ),
        (
            json!([{"role": "user", "content": [{"type": "image_url",
            "image_url": {"url": "https://example.com/cat.png"}}]}]),
            "data:image",
        ),
        (
            json!([{"role": "user", "content": [{"type": "image_url",
            "image_url": {"url": "data:image/gif;base64,R0lG"}}]}]),
            "image/gif",
        ),
        (
            json!([{"role": "user", "content": [{"type": "image_url",
            "image_url": {"url": "data:image/png;base64,x", "detail": "high"}}]}]),
            "detail",
        ),
        (
            json!([{"role": "assistant", "content": [{"type": "image_url",
            "image_url": {"url": "data:image/png;base64,x"}}]}]),
            "image_url",
        ),
        (
            json!([{"role": "user", "content": 5}]),
            "messages[0].content",
        ),
        (json!("x"), "messages must be an array"),
    ] {
        let why = refused(json!({"model": "g", "messages": messages}));
        assert!(why.contains(names), "{names}: {why}");
    }
}

/// Tools, a forced function, an assistant's calls and their results (JSON and text).
#[test]
fn tools_calls_and_results_become_declarations_and_function_parts() {
    let v = translated(json!({
        "model": "g", "parallel_tool_calls": true,
        "tools": [
            {"type": "function", "function": {"name": "weather", "description": "today's",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"], "additionalProperties": false},
             "strict": false}},
            {"type": "function", "function": {"name": "time"}}
        ],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "messages": [
            {"role": "user", "content": "weather and time in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "weather", "arguments": "{\"city\":\"Paris\"}"}},
                {"id": "c2", "type": "function", "function": {"name": "time", "arguments": "{}"}}
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": "{\"sky\":\"clear\"}"},
            {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "noon"}]},
            {"role": "assistant", "content": "Clear, noon."}
        ]
    }));
    assert_eq!(
        v,
        json!({
            "contents": [
                {"role": "user", "parts": [{"text": "weather and time in Paris?"}]},
                {"role": "model", "parts": [
                    {"functionCall": {"name": "weather", "args": {"city": "Paris"}}},
                    {"functionCall": {"name": "time", "args": {}}}
                ]},
                {"role": "user", "parts": [
                    {"functionResponse": {"name": "weather", "response": {"sky": "clear"}}},
                    {"functionResponse": {"name": "time", "response": {"content": "noon"}}}
                ]},
                {"role": "model", "parts": [{"text": "Clear, noon."}]}
            ],
            "tools": [{"functionDeclarations": [
                {"name": "weather", "description": "today's", "parametersJsonSchema":
                    {"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"], "additionalProperties": false}},
                {"name": "time"}
            ]}],
            "toolConfig": {"functionCallingConfig": {"mode": "ANY",
                                                      "allowedFunctionNames": ["weather"]}}
        })
    );
    for (choice, mode) in [("auto", "AUTO"), ("none", "NONE"), ("required", "ANY")] {
        let v = translated(json!({"model": "g", "tool_choice": choice,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "messages": [{"role": "user", "content": "x"}]}));
        assert_eq!(v["toolConfig"]["functionCallingConfig"]["mode"], mode);
    }
    // Without tools, auto and none ask nothing.
    let v = translated(json!({"model": "g", "tool_choice": "none",
        "messages": [{"role": "user", "content": "x"}]}));
    assert!(
        v.get("toolConfig").is_none() && v.get("tools").is_none(),
        "{v}"
    );
}

#[test]
fn function_calls_come_back_as_tool_calls() {
    let body = json!({
        "candidates": [{"content": {"role": "model", "parts": [
            {"functionCall": {"name": "weather", "args": {"city": "Paris"}}},
            {"functionCall": {"id": "g-2", "name": "time", "args": {}}}
        ]}, "finishReason": "STOP"}],
        "usageMetadata": {"promptTokenCount": 5, "candidatesTokenCount": 4, "totalTokenCount": 9}
    });
    let (out, _) = completion(&serde_json::to_vec(&body).unwrap(), "gem", 7).unwrap();
    let v: Value = serde_json::from_slice(&out).unwrap();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["content"], Value::Null);
    assert_eq!(
        choice["message"]["tool_calls"],
        json!([
            {"id": "call_7_0", "type": "function",
             "function": {"name": "weather", "arguments": "{\"city\":\"Paris\"}"}},
            {"id": "g-2", "type": "function", "function": {"name": "time", "arguments": "{}"}}
        ])
    );
    // Streamed: one delta per call, whole, indexed across events; the turn ends on them.
    let mut a = stream_answer(false);
    let mut input = Vec::new();
    for e in [
        json!({"candidates": [{"content": {"parts": [
            {"functionCall": {"name": "weather", "args": {"city": "Paris"}}}]}}]}),
        json!({"candidates": [{"content": {"parts": [
            {"functionCall": {"name": "time", "args": {}}}]}, "finishReason": "STOP"}],
               "usageMetadata": {"promptTokenCount": 5, "candidatesTokenCount": 4}}),
    ] {
        input.extend_from_slice(format!("data: {e}\r\n\r\n").as_bytes());
    }
    let got = events(&a.feed(&input, true));
    let calls: Vec<&Value> = got
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["tool_calls"].get(0))
        .collect();
    assert_eq!(calls.len(), 2, "{got:?}");
    assert_eq!(
        (calls[0]["index"].clone(), calls[0]["id"].clone()),
        (json!(0), json!("call_9_0"))
    );
    assert_eq!(calls[0]["function"]["arguments"], "{\"city\":\"Paris\"}");
    assert_eq!(
        (calls[1]["index"].clone(), calls[1]["id"].clone()),
        (json!(1), json!("call_9_1"))
    );
    let finish: Vec<&Value> = got
        .iter()
        .map(|e| &e["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, [&json!("tool_calls")]);
    assert_eq!(a.content_events(), 2);
}

#[test]
fn an_answer_becomes_a_chat_completion_with_the_usage_google_bills() {
    let body = json!({
        "candidates": [{"content": {"role": "model", "parts": [
            {"text": "thinking…", "thought": true}, {"text": "tok0 "}, {"text": "tok1"}
        ]}, "finishReason": "MAX_TOKENS"}],
        "usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 2,
                          "thoughtsTokenCount": 5, "cachedContentTokenCount": 4,
                          "totalTokenCount": 17},
        "modelVersion": "gemini-2.5-flash"
    });
    let (out, usage) = completion(&serde_json::to_vec(&body).unwrap(), "gem", 42).unwrap();
    assert_eq!(
        usage,
        Some(Usage {
            prompt_tokens: 10,
            completion_tokens: 7,
            total_tokens: 17,
            cached_input_tokens: 4
        })
    );
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        v,
        json!({
            "id": "chatcmpl-gemini-42", "object": "chat.completion", "created": 42, "model": "gem",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "tok0 tok1",
                         "refusal": null}, "logprobs": null, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17,
                      "prompt_tokens_details": {"cached_tokens": 4}}
        })
    );
    // A blocked prompt: no candidate, filtered; its prompt still counted.
    let blocked = json!({"promptFeedback": {"blockReason": "SAFETY"},
                         "usageMetadata": {"promptTokenCount": 6, "totalTokenCount": 6}});
    let (out, usage) = completion(&serde_json::to_vec(&blocked).unwrap(), "gem", 1).unwrap();
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "content_filter");
    assert_eq!(v["choices"][0]["message"]["content"], "");
    assert_eq!(
        usage.map(|u| (u.prompt_tokens, u.completion_tokens)),
        Some((6, 0))
    );
    // A Google error, alone or in a list: an OpenAI error with its message and status.
    for err in [
        json!({"error": {"code": 429, "message": "Resource exhausted", "status": "RESOURCE_EXHAUSTED"}}),
        json!([{"error": {"code": 429, "message": "Resource exhausted", "status": "RESOURCE_EXHAUSTED"}}]),
    ] {
        let (out, usage) = completion(&serde_json::to_vec(&err).unwrap(), "gem", 1).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["error"]["message"], "Resource exhausted");
        assert_eq!(v["error"]["code"], "RESOURCE_EXHAUSTED");
        assert_eq!(usage, None);
    }
    assert!(completion(b"<html>", "gem", 1).is_none());
    assert!(completion(b"{\"other\":1}", "gem", 1).is_none());
}

#[test]
fn finish_reasons_and_usage_map() {
    assert_eq!(finish_reason(Some("STOP")), json!("stop"));
    assert_eq!(finish_reason(Some("MAX_TOKENS")), json!("length"));
    assert_eq!(finish_reason(Some("SAFETY")), json!("content_filter"));
    assert_eq!(finish_reason(Some("RECITATION")), json!("content_filter"));
    assert_eq!(finish_reason(Some("OTHER")), json!("stop"));
    assert_eq!(finish_reason(None), Value::Null);
    assert_eq!(usage_of(&json!({"totalTokenCount": 3})), None);
    let u = usage_of(&json!({"promptTokenCount": 4, "toolUsePromptTokenCount": 2,
                             "candidatesTokenCount": 3, "cachedContentTokenCount": 9}))
    .unwrap();
    assert_eq!(
        (
            u.prompt_tokens,
            u.completion_tokens,
            u.total_tokens,
            u.cached_input_tokens
        ),
        (6, 3, 9, 6)
    );
}

/// A Gemini stream as Vertex sends it with `alt=sse` (CRLF between events), usage in the last.
fn stream_bytes() -> Vec<u8> {
    let events = [
        json!({"candidates": [{"content": {"role": "model", "parts": [{"text": "tok0 "}]}}],
               "usageMetadata": {"promptTokenCount": 3, "totalTokenCount": 3}}),
        json!({"candidates": [{"content": {"role": "model", "parts": [{"text": "tok1"}]},
                               "finishReason": "STOP"}],
               "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 2,
                                 "totalTokenCount": 5}}),
    ];
    let mut out = Vec::new();
    for e in events {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(&serde_json::to_vec(&e).unwrap());
        out.extend_from_slice(b"\r\n\r\n");
    }
    out
}

fn stream_answer(include_usage: bool) -> Answer {
    Answer::new(
        "text/event-stream",
        Coding::Identity,
        ClientAsk {
            stream: true,
            include_usage,
        },
        "gem",
        9,
    )
}

/// The data of each translated event.
fn events(out: &[u8]) -> Vec<Value> {
    String::from_utf8(out.to_vec())
        .unwrap()
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let data = e.strip_prefix("data: ").unwrap();
            if data == "[DONE]" {
                json!("[DONE]")
            } else {
                serde_json::from_str(data).unwrap()
            }
        })
        .collect()
}

#[test]
fn a_stream_is_translated_event_by_event_in_any_chunking() {
    let bytes = stream_bytes();
    let mut whole = stream_answer(true);
    let expected = whole.feed(&bytes, true);
    let got = events(&expected);
    let deltas: Vec<&Value> = got.iter().map(|e| &e["choices"][0]["delta"]).collect();
    assert_eq!(deltas[0], &json!({"role": "assistant", "content": ""}));
    assert_eq!(deltas[1], &json!({"content": "tok0 "}));
    assert_eq!(deltas[2], &json!({"content": "tok1"}));
    assert_eq!(got[3]["choices"][0]["finish_reason"], "stop");
    assert_eq!(got[4]["choices"], json!([]));
    assert_eq!(got[4]["usage"]["completion_tokens"], 2);
    assert_eq!(got[5], json!("[DONE]"));
    assert_eq!(got.len(), 6);
    assert_eq!(got[1]["object"], "chat.completion.chunk");
    assert_eq!(got[1]["model"], "gem");
    assert_eq!(whole.usage().map(|u| u.total_tokens), Some(5));
    assert_eq!(whole.content_events(), 2);
    // Every split into two chunks gives the same bytes, and nothing before an event ends.
    for at in 0..bytes.len() {
        let mut a = stream_answer(true);
        let mut out = a.feed(&bytes[..at], false);
        out.extend(a.feed(&bytes[at..], true));
        assert_eq!(out, expected, "split at {at}");
        assert_eq!(a.usage(), whole.usage());
    }
    // Without include_usage: no usage chunk, still [DONE].
    let mut plain = stream_answer(false);
    let got = events(&plain.feed(&bytes, true));
    assert_eq!(got.len(), 5);
    assert_eq!(got[4], json!("[DONE]"));
    assert_eq!(plain.usage().map(|u| u.prompt_tokens), Some(3));
}

#[test]
fn a_stream_error_or_garbage_ends_the_stream_with_an_openai_error() {
    let mut a = stream_answer(true);
    let out = a.feed(
        b"data: {\"error\":{\"code\":503,\"message\":\"overloaded\",\"status\":\"UNAVAILABLE\"}}\n\n\
          data: {\"candidates\":[]}\n\n",
        false,
    );
    let got = events(&out);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0]["error"]["code"], "UNAVAILABLE");
    assert!(
        a.feed(b"data: {}\n\n", true).is_empty(),
        "nothing after the end"
    );
    let mut b = stream_answer(false);
    let got = events(&b.feed(b"data: not json\n\n", false));
    assert_eq!(got[0]["error"]["code"], "untranslatable_response");
    // An event that never ends: bounded.
    let mut c = stream_answer(false);
    let big = vec![b'x'; EVENT_CAP + 1];
    let mut out = c.feed(b"data: ", false);
    out.extend(c.feed(&big, false));
    let got = events(&out);
    assert_eq!(
        got.last().unwrap()["error"]["code"],
        "untranslatable_response"
    );
}

#[test]
fn a_json_answer_is_kept_to_its_end_and_other_answers_pass() {
    let mut a = Answer::new(
        "application/json; charset=UTF-8",
        Coding::Identity,
        ClientAsk::default(),
        "gem",
        3,
    );
    assert!(!a.is_stream());
    let body = serde_json::to_vec(&json!({
        "candidates": [{"content": {"parts": [{"text": "ok"}]}, "finishReason": "STOP"}],
        "usageMetadata": {"promptTokenCount": 1, "candidatesTokenCount": 1, "totalTokenCount": 2}
    }))
    .unwrap();
    let (head, tail) = body.split_at(10);
    assert!(a.feed(head, false).is_empty());
    let v: Value = serde_json::from_slice(&a.feed(tail, true)).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "ok");
    assert_eq!(a.usage().map(|u| u.total_tokens), Some(2));
    let mut page = Answer::new(
        "text/html",
        Coding::Identity,
        ClientAsk::default(),
        "gem",
        3,
    );
    assert_eq!(page.feed(b"<html>", true), b"<html>");
    // Gzipped although identity was asked for: decoded, translated, usage read; the client
    // gets it uncompressed. A compressed page that is not the API's passes as it came.
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(&body).unwrap();
    let gz = e.finish().unwrap();
    let mut a = Answer::new(
        "application/json",
        Coding::Gzip,
        ClientAsk::default(),
        "gem",
        3,
    );
    assert!(a.drops_encoding());
    let (head, tail) = gz.split_at(7);
    assert!(a.feed(head, false).is_empty());
    let v: Value = serde_json::from_slice(&a.feed(tail, true)).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "ok");
    assert_eq!(a.usage().map(|u| u.total_tokens), Some(2));
    let mut bad = Answer::new(
        "application/json",
        Coding::Gzip,
        ClientAsk::default(),
        "gem",
        3,
    );
    let v: Value = serde_json::from_slice(&bad.feed(b"\x1f\x8b", true)).unwrap();
    assert_eq!(v["error"]["code"], "untranslatable_response");
    let mut page = Answer::new("text/html", Coding::Gzip, ClientAsk::default(), "gem", 3);
    assert!(!page.drops_encoding());
    assert_eq!(page.feed(b"\x1f\x8b", true), b"\x1f\x8b");
}
