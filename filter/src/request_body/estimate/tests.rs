use super::{is_binary_data_url, is_binary_media_type};
use crate::request_body::{PROMPT_BYTES_PER_TOKEN, inspect};
use proptest::prelude::*;
use serde_json::{Value, json};

fn estimate_of(body: &str) -> u64 {
    inspect(body.as_bytes())
        .unwrap_or_else(|e| panic!("{e}: {body}"))
        .prompt_tokens_estimate
}

fn estimate(body: &Value) -> u64 {
    estimate_of(&body.to_string())
}

/// A body's first bytes, for a failure's message.
fn short(body: &Value) -> String {
    body.to_string().chars().take(160).collect()
}

fn tokens(bytes: u64) -> u64 {
    bytes.div_ceil(PROMPT_BYTES_PER_TOKEN)
}

/// Every key, string and number of a value: what the estimate counts where nothing is media.
fn all_text(v: &Value) -> u64 {
    match v {
        Value::String(s) => s.len() as u64,
        Value::Number(_) => PROMPT_BYTES_PER_TOKEN,
        Value::Bool(_) | Value::Null => 0,
        Value::Array(items) => items.iter().map(all_text).sum(),
        Value::Object(o) => o.iter().map(|(k, v)| k.len() as u64 + all_text(v)).sum(),
    }
}

/// The rule as written in the module docs, over a parsed body (no duplicated keys): the oracle
/// the in-place walk must agree with.
mod reference {
    use super::all_text;
    use serde_json::{Map, Value};

    const READ: [&str; 8] = [
        "model",
        "stream",
        "max_tokens",
        "max_completion_tokens",
        "max_output_tokens",
        "stream_options",
        "n",
        "best_of",
    ];

    pub fn bytes(body: &Value) -> u64 {
        let Value::Object(top) = body else {
            panic!("not an object")
        };
        top.iter()
            .filter(|(k, _)| !READ.contains(&k.as_str()))
            .map(|(k, v)| match k.as_str() {
                "messages" | "input" => messages(v),
                _ => all_text(v),
            })
            .sum()
    }

    fn messages(v: &Value) -> u64 {
        match v {
            Value::Array(items) => items.iter().map(message).sum(),
            _ => all_text(v),
        }
    }

    fn message(v: &Value) -> u64 {
        match v {
            Value::Object(o) => o
                .iter()
                .map(|(k, v)| {
                    k.len() as u64
                        + match k.as_str() {
                            "content" | "output" => parts(v),
                            _ => all_text(v),
                        }
                })
                .sum(),
            _ => all_text(v),
        }
    }

    fn parts(v: &Value) -> u64 {
        match v {
            Value::Array(items) => items.iter().map(part).sum(),
            _ => all_text(v),
        }
    }

    fn part(v: &Value) -> u64 {
        match v {
            Value::Object(o) => {
                let all: u64 = o
                    .iter()
                    .map(|(k, v)| {
                        k.len() as u64
                            + match k.as_str() {
                                "content" => parts(v),
                                _ => all_text(v),
                            }
                    })
                    .sum();
                all - media(o)
            }
            _ => all_text(v),
        }
    }

    fn binary_type(t: &str) -> bool {
        let essence = t.split(';').next().unwrap().trim().to_ascii_lowercase();
        ["image/", "audio/", "video/"]
            .iter()
            .any(|p| essence.starts_with(p) && essence.len() > p.len())
            || essence == "application/pdf"
    }

    fn binary_url(v: Option<&Value>) -> u64 {
        match v.and_then(Value::as_str) {
            Some(s)
                if s.get(..5).is_some_and(|h| h.eq_ignore_ascii_case("data:"))
                    && s[5..].split_once(',').is_some_and(|(h, _)| binary_type(h)) =>
            {
                s.len() as u64
            }
            _ => 0,
        }
    }

    fn obj<'a>(o: &'a Map<String, Value>, key: &str) -> Option<&'a Map<String, Value>> {
        o.get(key).and_then(Value::as_object)
    }

    /// Part types that carry media, and the members that carry it.
    const MEDIA_TYPES: [&str; 9] = [
        "image_url",
        "audio_url",
        "video_url",
        "input_image",
        "file",
        "input_file",
        "input_audio",
        "image",
        "document",
    ];
    const MEDIA_MEMBERS: [&str; 7] = [
        "image_url",
        "audio_url",
        "video_url",
        "file",
        "file_data",
        "input_audio",
        "source",
    ];

    /// Content parts that declare a media type or carry a media member, nested ones too.
    pub fn media_parts(body: &Value) -> u64 {
        let Value::Object(top) = body else {
            panic!("not an object")
        };
        let list = |v: &Value, f: fn(&Value) -> u64| match v {
            Value::Array(items) => items.iter().map(f).sum(),
            _ => 0,
        };
        fn parts(v: &Value) -> u64 {
            match v {
                Value::Array(items) => items.iter().map(part_media).sum(),
                _ => 0,
            }
        }
        fn part_media(v: &Value) -> u64 {
            let Value::Object(o) = v else { return 0 };
            let declared = o
                .get("type")
                .and_then(Value::as_str)
                .is_some_and(|t| MEDIA_TYPES.contains(&t));
            let carried = MEDIA_MEMBERS.iter().any(|m| o.contains_key(*m));
            u64::from(declared || carried) + o.get("content").map_or(0, parts)
        }
        fn message_media(v: &Value) -> u64 {
            let Value::Object(o) = v else { return 0 };
            // An item shaped as a media part is one (its content's parts are counted apart).
            let own = o
                .get("type")
                .and_then(Value::as_str)
                .is_some_and(|t| MEDIA_TYPES.contains(&t))
                || MEDIA_MEMBERS.iter().any(|m| o.contains_key(*m));
            u64::from(own)
                + o.iter()
                    .filter(|(k, _)| *k == "content" || *k == "output")
                    .map(|(_, v)| parts(v))
                    .sum::<u64>()
        }
        top.iter()
            .filter(|(k, _)| !READ.contains(&k.as_str()))
            .map(|(k, v)| match k.as_str() {
                "messages" | "input" => list(v, message_media),
                _ => 0,
            })
            .sum()
    }

    /// Bytes of the payload a media part of its declared type carries as binary, else 0.
    fn media(o: &Map<String, Value>) -> u64 {
        let kind = o.get("type").and_then(Value::as_str).unwrap_or_default();
        let url_object = |key| obj(o, key).map_or(0, |u| binary_url(u.get("url")));
        match kind {
            "image_url" => url_object("image_url"),
            "audio_url" => url_object("audio_url"),
            "video_url" => url_object("video_url"),
            "input_image" => binary_url(o.get("image_url")),
            "file" => obj(o, "file").map_or(0, |f| binary_url(f.get("file_data"))),
            "input_file" => binary_url(o.get("file_data")),
            "input_audio" => obj(o, "input_audio").map_or(0, |a| {
                match (a.get("data"), a.get("format").and_then(Value::as_str)) {
                    (Some(Value::String(d)), Some(f))
                        if super::super::AUDIO_FORMATS.contains(&f) =>
                    {
                        d.len() as u64
                    }
                    _ => 0,
                }
            }),
            "image" | "document" => obj(o, "source").map_or(0, |s| {
                let base64 = s.get("type").and_then(Value::as_str) == Some("base64");
                let binary = s
                    .get("media_type")
                    .and_then(Value::as_str)
                    .is_some_and(binary_type);
                match s.get("data") {
                    Some(Value::String(d)) if base64 && binary => d.len() as u64,
                    _ => 0,
                }
            }),
            _ => 0,
        }
    }
}

#[test]
fn binary_media_types_and_data_urls() {
    for t in [
        "image/png",
        "IMAGE/JPEG",
        "audio/wav",
        "video/mp4",
        "application/pdf",
        "Application/PDF; x=1",
        " image/webp ",
    ] {
        assert!(is_binary_media_type(t), "{t}");
    }
    for t in [
        "",
        "image/",
        "text/plain",
        "text/csv",
        "application/json",
        "application/octet-stream",
        "imagex/png",
        "ímage/png",
    ] {
        assert!(!is_binary_media_type(t), "{t}");
    }
    for u in [
        "data:image/png;base64,AAAA",
        "DATA:Image/PNG;base64,AAAA",
        "data:application/pdf;base64,",
        "data:audio/wav,raw",
    ] {
        assert!(is_binary_data_url(u), "{u}");
    }
    for u in [
        "data:,hello",
        "data:;base64,aGk=",
        "data:text/plain;base64,aGk=",
        "data:image/png;base64",
        "https://example.com/a.png",
        "image/png;base64,AAAA",
        "data",
        "dätä:image/png,x",
    ] {
        assert!(!is_binary_data_url(u), "{u}");
    }
}

/// The issue's bodies: an Anthropic plain-text document of 60,000 words reserved 11 tokens (every
/// `data` was taken for media); 20,000 schema property names reserved 7 (keys were not counted).
#[test]
fn documents_and_schema_names_are_text() {
    let words = "word ".repeat(60_000);
    let doc = json!({"model": "c", "max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": words}},
        {"type": "text", "text": "summarise"}]}]});
    assert!(estimate(&doc) >= 75_000, "{}", estimate(&doc));

    let names: serde_json::Map<String, Value> = (0..20_000)
        .map(|i| (format!("p{i:05}"), json!({})))
        .collect();
    let names_bytes = 20_000 * 6;
    let schema = json!({"type": "object", "properties": names});
    for body in [
        json!({"messages": [], "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}),
        json!({"messages": [], "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}}),
        json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "o", "schema": schema}}}),
        json!({"messages": [], "tools": [{"name": "f", "input_schema": schema}]}),
    ] {
        assert!(
            estimate(&body) >= tokens(names_bytes),
            "{} for {}",
            estimate(&body),
            short(&body)
        );
    }
}

/// Each family's media parts, with payloads of 40,000 bytes: left out; the same payload declared
/// as text, or in a part of another type, counts.
#[test]
fn declared_binary_media_is_left_out_only_in_its_part() {
    let b64 = "QUJD".repeat(10_000);
    let url = format!("data:image/png;base64,{b64}");
    let pdf = format!("data:application/pdf;base64,{b64}");
    let media_parts = [
        json!({"type": "image_url", "image_url": {"url": url, "detail": "low"}}),
        json!({"type": "audio_url", "audio_url": {"url": format!("data:audio/wav;base64,{b64}")}}),
        json!({"type": "video_url", "video_url": {"url": format!("data:video/mp4;base64,{b64}")}}),
        json!({"type": "input_image", "image_url": url}),
        json!({"type": "file", "file": {"filename": "a.pdf", "file_data": pdf}}),
        json!({"type": "input_file", "filename": "a.pdf", "file_data": pdf}),
        json!({"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}}),
        json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}),
        json!({"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": b64}}),
    ];
    for p in &media_parts {
        // In a chat / Anthropic message, a Responses message item, a Responses function output
        // and an Anthropic tool result.
        for body in [
            json!({"messages": [{"role": "user", "content": [p]}]}),
            json!({"input": [{"type": "message", "role": "user", "content": [p]}]}),
            json!({"input": [{"type": "function_call_output", "call_id": "c", "output": [p]}]}),
            json!({"messages": [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t", "content": [p]}]}]}),
        ] {
            assert!(
                estimate(&body) < 100,
                "{} for {}",
                estimate(&body),
                short(&body)
            );
        }
    }
    // Declared as text, or not declared: counted.
    let text_declared = [
        json!({"type": "image_url", "image_url": {"url": format!("data:text/plain;base64,{b64}")}}),
        json!({"type": "image_url", "image_url": {"url": format!("data:,{b64}")}}),
        json!({"type": "input_image", "image_url": format!("https://example.com/{b64}")}),
        json!({"type": "input_audio", "input_audio": {"data": b64, "format": "txt"}}),
        json!({"type": "input_audio", "input_audio": {"data": b64}}),
        json!({"type": "image", "source": {"type": "base64", "media_type": "text/plain", "data": b64}}),
        json!({"type": "image", "source": {"type": "text", "media_type": "image/png", "data": b64}}),
        json!({"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": b64}}),
        json!({"type": "document", "source": {"type": "base64", "data": b64}}),
        json!({"type": "document", "source": {"type": "base64", "media_type": ["image/png"], "data": b64}}),
    ];
    // In a part of another type (the backend reads that part's text, or nothing of it): counted.
    let other_part = [
        json!({"type": "text", "text": "x", "image_url": {"url": url}}),
        json!({"type": "image_url", "input_audio": {"data": b64, "format": "wav"}}),
        json!({"type": "input_image", "image_url": {"url": url}}),
        json!({"type": "image_url", "image_url": url}),
        json!({"type": "file", "file_data": pdf}),
        json!({"type": "image", "image_url": {"url": url}}),
        json!({"type": "tool_use", "id": "t", "name": "f", "input": {"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": b64}}}),
        json!({"image_url": {"url": url}}),
        json!({"type": ["image_url"], "image_url": {"url": url}}),
    ];
    for p in text_declared.iter().chain(&other_part) {
        let body = json!({"messages": [{"role": "user", "content": [p]}]});
        assert!(
            estimate(&body) >= tokens(b64.len() as u64),
            "{} for {}",
            estimate(&body),
            short(&body)
        );
    }
}

/// Media shapes where no backend takes media — tool schemas, tool arguments, a response format,
/// metadata, any field not modelled, a message's own members — are text a template renders.
#[test]
fn media_shapes_outside_content_parts_are_text() {
    let b64 = "QUJD".repeat(10_000);
    let spoof = json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64},
                       "content": [{"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{b64}")}}]});
    for body in [
        json!({"tools": [spoof]}),
        json!({"response_format": spoof}),
        json!({"metadata": spoof}),
        json!({"x_unmodelled": [spoof]}),
        json!({"system": [spoof]}),
        json!({"prompt": [spoof]}),
        json!({"messages": spoof}),
        json!({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": spoof}}]}]}),
        json!({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "input": {"content": [spoof]}}]}]}),
        json!({"input": [{"type": "function_call", "arguments": spoof}]}),
    ] {
        let counted = all_text(&body)
            - body
                .as_object()
                .unwrap()
                .keys()
                .map(|k| k.len() as u64)
                .sum::<u64>();
        assert_eq!(estimate(&body), tokens(counted), "{}", short(&body));
    }
}

/// Every order of a part's members, and of its source's: a declaration after the payload decides
/// as one before it.
#[test]
fn member_order_does_not_matter() {
    fn permutations(items: &[&str]) -> Vec<Vec<String>> {
        if items.len() <= 1 {
            return vec![items.iter().map(|s| s.to_string()).collect()];
        }
        let mut out = Vec::new();
        for i in 0..items.len() {
            let mut rest = items.to_vec();
            let first = rest.remove(i);
            for mut p in permutations(&rest) {
                p.insert(0, first.to_string());
                out.push(p);
            }
        }
        out
    }
    let b64 = "QUJD".repeat(1000);
    let cases: [(&[&str], &[&str], bool); 4] = [
        (
            &[
                r#""type":"image""#,
                r#""source":{SOURCE}"#,
                r#""cache_control":null"#,
            ],
            &[
                r#""type":"base64""#,
                r#""media_type":"image/png""#,
                r#""data":"B64""#,
            ],
            true,
        ),
        (
            &[r#""type":"document""#, r#""source":{SOURCE}"#],
            &[
                r#""type":"text""#,
                r#""media_type":"text/plain""#,
                r#""data":"B64""#,
            ],
            false,
        ),
        (
            &[r#""type":"input_audio""#, r#""input_audio":{SOURCE}"#],
            &[r#""data":"B64""#, r#""format":"mp3""#],
            true,
        ),
        (
            &[r#""type":"image_url""#, r#""image_url":{SOURCE}"#],
            &[
                r#""url":"data:image/jpeg;base64,B64""#,
                r#""detail":"high""#,
            ],
            true,
        ),
    ];
    for (part, source, media) in cases {
        let mut seen = std::collections::BTreeSet::new();
        for p in permutations(part) {
            for s in permutations(source) {
                let source = s.join(",").replace("B64", &b64);
                let body = format!(
                    r#"{{"messages":[{{"role":"user","content":[{{{}}}]}}]}}"#,
                    p.join(",").replace("SOURCE", &source)
                );
                seen.insert(estimate_of(&body));
            }
        }
        assert_eq!(seen.len(), 1, "{part:?} {source:?}: {seen:?}");
        let e = seen.into_iter().next().unwrap();
        assert_eq!(e < 100, media, "{part:?}: {e}");
    }
}

/// A declaration given twice with different values, or two part types: a parser may read either
/// (Python keeps the last, others the first), so the payload counts.
#[test]
fn conflicting_declarations_count() {
    let b64 = "QUJD".repeat(1000);
    let min = tokens(b64.len() as u64);
    for part in [
        r#"{"type":"image","source":{"type":"base64","media_type":"image/png","media_type":"text/plain","data":"B64"}}"#,
        r#"{"type":"image","source":{"type":"text","type":"base64","media_type":"image/png","data":"B64"}}"#,
        r#"{"type":"text","type":"image_url","image_url":{"url":"data:image/png;base64,B64"}}"#,
        r#"{"type":"image_url","image_url":{"url":"data:image/png;base64,B64"},"type":"input_image"}"#,
        r#"{"type":"input_audio","input_audio":{"data":"B64","format":"wav","format":"text"}}"#,
        r#"{"type":"image_url","image_url":{"url":"data:image/png;base64,B64","url":"B64"}}"#,
    ] {
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":[{}]}}]}}"#,
            part.replace("B64", &b64)
        );
        assert!(estimate_of(&body) >= min, "{}: {part}", estimate_of(&body));
    }
    // The same declaration twice, or both Anthropic types (each takes `source`): still media.
    for part in [
        r#"{"type":"image","source":{"type":"base64","media_type":"image/png","media_type":"image/png","data":"B64"}}"#,
        r#"{"type":"image","type":"document","source":{"type":"base64","media_type":"application/pdf","data":"B64"}}"#,
        r#"{"type":"image_url","image_url":{"url":"data:image/png;base64,B64"},"image_url":{"url":"data:image/gif;base64,B64"}}"#,
    ] {
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":[{}]}}]}}"#,
            part.replace("B64", &b64)
        );
        assert!(estimate_of(&body) < 100, "{}: {part}", estimate_of(&body));
    }
    // Escaped keys and values are read decoded, as the backend reads them.
    let body = format!(
        r#"{{"messages":[{{"role":"user","content":[{{"typ\u0065":"imag\u0065","s\u006furce":{{"type":"base64","media_\u0074ype":"image/png","d\u0061ta":"{b64}"}}}}]}}]}}"#
    );
    assert!(estimate_of(&body) < 100, "{}", estimate_of(&body));
}

/// JSON made of the words the estimate tells apart, so that random bodies hit media parts,
/// declarations and their conflicts.
fn media_json() -> impl Strategy<Value = Value> {
    let strings = prop_oneof![
        Just("image_url"),
        Just("input_image"),
        Just("input_file"),
        Just("input_audio"),
        Just("image"),
        Just("document"),
        Just("file"),
        Just("text"),
        Just("base64"),
        Just("image/png"),
        Just("application/pdf"),
        Just("text/plain"),
        Just("wav"),
        Just("data:image/png;base64,QUJDRA=="),
        Just("DATA:Video/MP4,x"),
        Just("data:text/plain,hello"),
        Just("QUJDRA=="),
    ]
    .prop_map(str::to_string);
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        (0..100u64).prop_map(Value::from),
        prop_oneof![strings, ".{0,6}"].prop_map(Value::String),
    ];
    leaf.prop_recursive(5, 48, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::btree_map(
                "(type|content|output|image_url|audio_url|url|file|file_data|input_audio|source|data|media_type|format|text|[a-z]{1,2})",
                inner,
                0..5
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// The member that carries a payload `p` for a part type, declared by `format`, `source_type`
/// and `media_type` (a random member when `kind` takes no media).
fn carrier(
    kind: &str,
    p: &str,
    format: &str,
    source_type: &str,
    media_type: &str,
) -> (&'static str, Value) {
    match kind {
        "image_url" => ("image_url", json!({"url": p})),
        "audio_url" => ("audio_url", json!({"url": p})),
        "input_image" => ("image_url", json!(p)),
        "file" => ("file", json!({"file_data": p, "filename": "f"})),
        "input_file" => ("file_data", json!(p)),
        "input_audio" => ("input_audio", json!({"data": p, "format": format})),
        "image" | "document" => (
            "source",
            json!({"type": source_type, "media_type": media_type, "data": p}),
        ),
        _ => ("text", json!(p)),
    }
}

/// A part of a random type: usually with the member its type takes media in (declared binary or
/// not), sometimes with another type's, plus random members.
fn part() -> impl Strategy<Value = Value> {
    let kinds = [
        "image_url",
        "audio_url",
        "input_image",
        "file",
        "input_file",
        "input_audio",
        "image",
        "document",
        "text",
    ];
    let payload = prop_oneof![
        3 => Just("data:image/png;base64,QUJDRA==".to_string()),
        1 => Just("data:text/plain,QUJDRA==".to_string()),
        2 => Just("QUJDRA==".to_string()),
        1 => "[A-Za-z0-9+/]{0,12}",
    ];
    (
        proptest::sample::select(kinds.to_vec()),
        proptest::sample::select(kinds.to_vec()),
        any::<bool>(),
        payload,
        prop_oneof![3 => Just("wav"), 1 => Just("txt")],
        prop_oneof![3 => Just("base64"), 1 => Just("text")],
        prop_oneof![2 => Just("image/png"), 1 => Just("application/pdf"), 1 => Just("text/plain")],
        proptest::collection::btree_map(
            "(type|data|url|source|content|[a-z]{1,2})",
            media_json(),
            0..2,
        ),
    )
        .prop_map(
            |(kind, other_kind, own, p, format, source_type, media_type, extra)| {
                let mut o: serde_json::Map<String, Value> = extra.into_iter().collect();
                let (k, v) = carrier(
                    if own { kind } else { other_kind },
                    &p,
                    format,
                    source_type,
                    media_type,
                );
                o.insert(k.into(), v);
                o.insert("type".into(), json!(kind));
                Value::Object(o)
            },
        )
}

fn body() -> impl Strategy<Value = Value> {
    let content = prop_oneof![
        proptest::collection::vec(prop_oneof![part(), media_json()], 0..4).prop_map(Value::Array),
        media_json(),
    ];
    let message = (content, media_json())
        .prop_map(|(c, m)| json!({"role": "user", "content": c, "x": m}))
        .boxed();
    (
        proptest::collection::vec(message.clone(), 0..3),
        proptest::collection::vec(message, 0..2),
        media_json(),
        media_json(),
    )
        .prop_map(|(messages, input, tools, other)| {
            json!({"model": "m", "messages": messages, "input": input, "tools": tools, "other": other})
        })
}

/// The estimate before this rule (issue 26): string values only, keys never, every value of a
/// `url`, `image_url`, `data`, `file_data` or `b64_json` key left out wherever it was.
fn old_rule(body: &Value) -> u64 {
    fn text(v: &Value) -> u64 {
        match v {
            Value::String(s) => s.len() as u64,
            Value::Number(_) => PROMPT_BYTES_PER_TOKEN,
            Value::Array(items) => items.iter().map(text).sum(),
            Value::Object(o) => o
                .iter()
                .filter(|(k, _)| {
                    !["url", "image_url", "data", "file_data", "b64_json"].contains(&k.as_str())
                })
                .map(|(_, v)| text(v))
                .sum(),
            _ => 0,
        }
    }
    tokens(
        body.as_object()
            .unwrap()
            .iter()
            .filter(|(k, _)| k.as_str() != "model")
            .map(|(_, v)| text(v))
            .sum(),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// The in-place walk is the rule as written.
    #[test]
    fn estimate_is_the_written_rule(body in body()) {
        prop_assert_eq!(estimate(&body), tokens(reference::bytes(&body)), "{}", short(&body));
    }

    /// Media parts are counted as the rule says (and only in messages).
    #[test]
    fn media_parts_are_the_written_rule(body in body()) {
        let info = inspect(body.to_string().as_bytes()).unwrap();
        prop_assert_eq!(info.media_parts(), reference::media_parts(&body), "{}", short(&body));
    }

    /// Nothing the old rule counted is free now.
    #[test]
    fn estimate_never_below_the_old_rule(body in body()) {
        prop_assert!(estimate(&body) >= old_rule(&body), "{}", short(&body));
    }

    /// Outside `messages` / `input`, whatever shape it has, everything counts.
    #[test]
    fn everything_counts_outside_messages(v in prop_oneof![part(), media_json()]) {
        let body = json!({"tools": [v.clone()], "metadata": v});
        let counted = all_text(&body) - "tools".len() as u64 - "metadata".len() as u64;
        prop_assert_eq!(estimate(&body), tokens(counted));
        prop_assert_eq!(inspect(body.to_string().as_bytes()).unwrap().media_parts(), 0);
    }
}

/// The random bodies above reach what they are meant to test: media left out in some, payloads
/// held and then counted in others.
#[test]
fn random_bodies_hit_media_parts() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let strategy = body();
    let (mut left_out, mut counted) = (0, 0);
    for _ in 0..512 {
        let body = strategy.new_tree(&mut runner).unwrap().current();
        // Everything counted: all of it but the top-level keys and the model's name.
        let top = body.as_object().unwrap();
        let keys: u64 = top.keys().map(|k| k.len() as u64).sum();
        let text_only = tokens(all_text(&body) - keys - all_text(&top["model"]));
        let e = estimate(&body);
        if e < text_only {
            left_out += 1;
        } else if body.to_string().contains("data:image/png") {
            counted += 1;
        }
    }
    assert!(
        left_out >= 30 && counted >= 30,
        "{left_out} left out, {counted} counted"
    );
}

/// Every media part costs, whatever carries it: inline data, a URL the backend fetches, a file
/// id; nested in a tool result too. Text parts and media shapes outside messages do not.
#[test]
fn media_parts_count_inline_url_and_file_id_alike() {
    let parts = |content: Value| {
        inspect(
            json!({"messages": [{"role": "user", "content": content}]})
                .to_string()
                .as_bytes(),
        )
        .unwrap()
        .media_parts()
    };
    let png = format!("data:image/png;base64,{}", "A".repeat(400));
    assert_eq!(parts(json!("just text")), 0);
    assert_eq!(parts(json!([{"type": "text", "text": "hi"}])), 0);
    assert_eq!(
        parts(json!([{"type": "image_url", "image_url": {"url": png}}])),
        1
    );
    assert_eq!(
        parts(json!([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}])),
        1
    );
    assert_eq!(
        parts(json!([{"type": "file", "file": {"file_id": "file-abc"}}])),
        1
    );
    assert_eq!(
        parts(json!([{"type": "image", "source": {"type": "url", "url": "https://e.com/a.png"}}])),
        1
    );
    assert_eq!(
        parts(json!([{"type": "document", "source": {"type": "file", "file_id": "f"}}])),
        1
    );
    // A member without a media type (a lenient server reads it), and a media type without a
    // member (a server may fetch what another field names) each cost.
    assert_eq!(
        parts(json!([{"type": "text", "image_url": {"url": "https://e.com"}}])),
        1
    );
    assert_eq!(
        parts(json!([{"type": "input_image", "url": "https://e.com"}])),
        1
    );
    // Nested in a tool result, and several in one message.
    assert_eq!(
        parts(
            json!([{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
            {"type": "text", "text": "x"}
        ]}, {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}])
        ),
        2
    );
    // Responses input items' content; a media shape in a tool schema is text, not a part.
    let responses = json!({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://e.com/a.png"},
        {"type": "input_file", "file_id": "file-1"}]}],
        "tools": [{"type": "image_url", "image_url": {"url": "https://e.com"}}]});
    assert_eq!(
        inspect(responses.to_string().as_bytes())
            .unwrap()
            .media_parts(),
        2
    );
    // A bare media item in `input` (a lenient server takes it as a part) costs as one.
    let bare = json!({"input": [{"type": "input_image", "image_url": "https://e.com/a.png"},
        {"role": "user", "content": "what is it", "type": "message"}]});
    assert_eq!(
        inspect(bare.to_string().as_bytes()).unwrap().media_parts(),
        1
    );
}
