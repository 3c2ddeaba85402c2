//! The rendered objects and the small vocabulary the checks read them with: required fields
//! (`at`, `path`: a missing one is a failed check that names it), optional ones (`opt`), and
//! `repr`, which prints a value as the checks' messages always have (`None`, `'a'`, `['x']`).

use serde::Deserialize;
use serde_json::Value;

/// Returns early from a check with a formatted reason when the condition does not hold.
macro_rules! ensure {
    ($cond:expr, $($why:tt)+) => {
        if !$cond {
            return Err(format!($($why)+));
        }
    };
}
pub(crate) use ensure;

/// What a check returns: `Err(why)` when it fails.
pub type Verdict = Result<(), String>;

/// The objects of one render, in order (empty YAML documents dropped).
#[derive(Debug, Clone, Default)]
pub struct Docs(pub Vec<Value>);

impl Docs {
    /// Parses a multi-document YAML stream (what `kubectl kustomize` prints).
    pub fn parse(text: &str) -> Result<Docs, String> {
        let mut docs = Vec::new();
        for document in yaml_serde::Deserializer::from_str(text) {
            let value = Value::deserialize(document).map_err(|e| format!("not YAML: {e}"))?;
            if !value.is_null() {
                docs.push(value);
            }
        }
        Ok(Docs(docs))
    }

    /// Objects of a kind, optionally of a name.
    pub fn find(&self, kind: &str, name: Option<&str>) -> Vec<&Value> {
        self.0
            .iter()
            .filter(|d| d.get("kind").and_then(Value::as_str) == Some(kind))
            .filter(|d| name.is_none_or(|n| name_of(d) == Some(n)))
            .collect()
    }

    /// Every object of a kind.
    pub fn all(&self, kind: &str) -> Vec<&Value> {
        self.find(kind, None)
    }

    /// The one object of that kind and name; anything else fails the check.
    pub fn one(&self, kind: &str, name: &str) -> Result<&Value, String> {
        let found = self.find(kind, Some(name));
        match found.as_slice() {
            [one] => Ok(one),
            _ => Err(format!(
                "expected exactly one {kind} {name}, found {}",
                found.len()
            )),
        }
    }

    /// The mutable object of that kind and name (the tests' broken copies).
    pub fn get_mut(&mut self, kind: &str, name: &str) -> Option<&mut Value> {
        self.0.iter_mut().find(|d| {
            d.get("kind").and_then(Value::as_str) == Some(kind) && name_of(d) == Some(name)
        })
    }
}

/// `metadata.name`, when there is one.
pub fn name_of(doc: &Value) -> Option<&str> {
    doc.get("metadata")?.get("name")?.as_str()
}

/// `metadata.namespace`, when there is one.
pub fn namespace_of(doc: &Value) -> Option<&str> {
    doc.get("metadata")?.get("namespace")?.as_str()
}

/// The value at a dotted path (`spec.rules.0.ports`: numbers index arrays), if every step exists.
pub fn opt<'a>(value: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(value, |v, step| match v {
        Value::Array(items) => items.get(step.parse::<usize>().ok()?),
        Value::Object(map) => map.get(step),
        _ => None,
    })
}

/// The value at a dotted path, or a failed check naming the path.
pub fn at<'a>(value: &'a Value, path: &str) -> Result<&'a Value, String> {
    opt(value, path).ok_or_else(|| format!("missing or malformed field: {path}"))
}

/// The string at a dotted path, or a failed check naming the path.
pub fn str_at<'a>(value: &'a Value, path: &str) -> Result<&'a str, String> {
    at(value, path)?
        .as_str()
        .ok_or_else(|| format!("missing or malformed field: {path} (not a string)"))
}

/// The list at a dotted path, or a failed check naming the path.
pub fn list_at<'a>(value: &'a Value, path: &str) -> Result<&'a [Value], String> {
    at(value, path)?
        .as_array()
        .map(Vec::as_slice)
        .ok_or_else(|| format!("missing or malformed field: {path} (not a list)"))
}

/// The list at a dotted path, or no items when it is absent.
pub fn list_or_empty<'a>(value: &'a Value, path: &str) -> &'a [Value] {
    opt(value, path)
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

/// The string at a dotted path, if it is one.
pub fn opt_str<'a>(value: &'a Value, path: &str) -> Option<&'a str> {
    opt(value, path).and_then(Value::as_str)
}

/// True when the path holds the boolean `true` (YAML `true`; a string "true" is not).
pub fn is_true(value: &Value, path: &str) -> bool {
    opt(value, path) == Some(&Value::Bool(true))
}

/// Python's truthiness: absent, null, false, 0, "" and empty lists or maps are false.
pub fn truthy(value: Option<&Value>) -> bool {
    match value {
        None | Some(Value::Null | Value::Bool(false)) => false,
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(Value::Bool(true)) => true,
    }
}

/// A selector's matchLabels all present with the same values in `labels`.
pub fn labels_match(selector: Option<&Value>, labels: Option<&Value>) -> bool {
    let Some(wanted) = selector
        .and_then(|s| s.get("matchLabels"))
        .and_then(Value::as_object)
    else {
        return true;
    };
    wanted
        .iter()
        .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
}

/// A JSON object from `(key, value)` pairs of strings.
pub fn string_map(pairs: &[(&str, &str)]) -> Value {
    Value::Object(
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_string(), Value::String((*v).to_string())))
            .collect(),
    )
}

/// The container env as `name → entry`.
pub fn env_map(container: &Value) -> serde_json::Map<String, Value> {
    list_or_empty(container, "env")
        .iter()
        .filter_map(|e| Some((e.get("name")?.as_str()?.to_string(), e.clone())))
        .collect()
}

/// A value as the checks print it, in Python's literal syntax (their messages were first written
/// by a Python checker and operators grep for them): `None`, `True`, `'text'`, `['a', 'b']`,
/// `{'k': 1}`.
pub fn repr(value: &Value) -> String {
    match value {
        Value::Null => "None".to_string(),
        Value::Bool(true) => "True".to_string(),
        Value::Bool(false) => "False".to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => repr_str(s),
        Value::Array(items) => {
            let inner: Vec<String> = items.iter().map(repr).collect();
            format!("[{}]", inner.join(", "))
        }
        Value::Object(map) => {
            let inner: Vec<String> = map
                .iter()
                .map(|(k, v)| format!("{}: {}", repr_str(k), repr(v)))
                .collect();
            format!("{{{}}}", inner.join(", "))
        }
    }
}

/// `repr` of a value that may be absent (absent prints as `None`).
pub fn repr_opt(value: Option<&Value>) -> String {
    value.map_or_else(|| "None".to_string(), repr)
}

/// A string literal: single quotes unless the text holds one and no double quote.
pub fn repr_str(text: &str) -> String {
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(text.len() + 2);
    out.push(quote);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn repr_prints_python_literals() {
        assert_eq!(repr(&json!(null)), "None");
        assert_eq!(repr(&json!(["ALLOW"])), "['ALLOW']");
        assert_eq!(repr(&json!(["get", "list"])), "['get', 'list']");
        assert_eq!(repr(&json!({"a": true, "b": 3})), "{'a': True, 'b': 3}");
        assert_eq!(repr_str("it's"), "\"it's\"");
        assert_eq!(repr_opt(None), "None");
    }

    #[test]
    fn paths_index_objects_and_lists() {
        let v = json!({"spec": {"rules": [{"ports": [8081]}]}});
        assert_eq!(opt(&v, "spec.rules.0.ports.0"), Some(&json!(8081)));
        assert_eq!(opt(&v, "spec.rules.1"), None);
        assert_eq!(
            at(&v, "spec.nope").unwrap_err(),
            "missing or malformed field: spec.nope"
        );
    }

    #[test]
    fn parse_drops_empty_documents() {
        let docs = Docs::parse("---\na: 1\n---\n---\nkind: X\nmetadata: {name: y}\n").unwrap();
        assert_eq!(docs.0.len(), 2);
        assert!(docs.one("X", "y").is_ok());
        assert_eq!(
            docs.one("X", "z").unwrap_err(),
            "expected exactly one X z, found 0"
        );
    }

    #[test]
    fn selectors_match_labels() {
        let sel = json!({"matchLabels": {"app": "a"}});
        assert!(labels_match(
            Some(&sel),
            Some(&json!({"app": "a", "x": "y"}))
        ));
        assert!(!labels_match(Some(&sel), Some(&json!({"app": "b"}))));
        assert!(labels_match(None, None));
    }
}
