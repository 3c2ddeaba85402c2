//! Every rendered object validates against `tests/fixtures/schemas/<group>_<version>_<Kind>`
//! (JSON Schema 2020-12 written as YAML; the core group is `core`). A kind without a schema
//! fails: a new kind needs its schema first.

use super::docs::{Docs, name_of};
use super::report::Report;
use jsonschema::{Draft, Registry, Validator};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;

/// Where the schemas are registered: their `$id`s and `$ref`s are relative to it.
const BASE: &str = "file:///schemas/";

/// The schema file of an apiVersion and kind.
pub fn schema_file_name(api_version: &str, kind: &str) -> String {
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    let group = if group.is_empty() { "core" } else { group };
    format!("{group}_{version}_{kind}.schema.yaml")
}

/// The schemas of a directory, by file name.
pub struct Schemas {
    files: BTreeMap<String, Value>,
}

impl Schemas {
    /// Reads every `*.schema.yaml` of `dir`.
    pub fn load(dir: &Path) -> Result<Schemas, String> {
        let entries =
            std::fs::read_dir(dir).map_err(|e| format!("reading {}: {e}", dir.display()))?;
        let mut files = BTreeMap::new();
        for entry in entries {
            let path = entry.map_err(|e| e.to_string())?.path();
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if !name.ends_with(".schema.yaml") {
                continue;
            }
            let text = std::fs::read_to_string(&path)
                .map_err(|e| format!("reading {}: {e}", path.display()))?;
            let value: Value =
                yaml_serde::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
            files.insert(name.to_string(), value);
        }
        Ok(Schemas { files })
    }

    fn registry(&self) -> Result<Registry<'_>, String> {
        let mut builder = Registry::new();
        for (name, schema) in &self.files {
            builder = builder
                .add(format!("{BASE}{name}"), schema)
                .map_err(|e| format!("schema {name}: {e}"))?;
        }
        builder.prepare().map_err(|e| format!("schemas: {e}"))
    }

    fn validator(&self, registry: &Registry<'_>, name: &str) -> Result<Validator, String> {
        jsonschema::options()
            .with_draft(Draft::Draft202012)
            .with_registry(registry)
            .with_base_uri(BASE)
            .should_validate_formats(false)
            .build(&json!({"$ref": format!("{BASE}{name}")}))
            .map_err(|e| format!("schema {name}: {e}"))
    }

    /// One result per object: `schema <Kind>/<name>`.
    pub fn check(&self, docs: &Docs, report: &mut Report) {
        let registry = match self.registry() {
            Ok(r) => r,
            Err(why) => return report.record("schemas load", Err(why)),
        };
        let mut validators: BTreeMap<String, Result<Validator, String>> = BTreeMap::new();
        for doc in &docs.0 {
            let kind = doc.get("kind").and_then(Value::as_str).unwrap_or("None");
            let ident = format!("{kind}/{}", name_of(doc).unwrap_or("None"));
            let api_version = doc.get("apiVersion").and_then(Value::as_str).unwrap_or("");
            let name = schema_file_name(api_version, kind);
            if !self.files.contains_key(&name) {
                report.record(
                    &format!("schema {ident}"),
                    Err(format!("no schema {name} for {api_version} {kind}")),
                );
                continue;
            }
            let validator = validators
                .entry(name.clone())
                .or_insert_with(|| self.validator(&registry, &name));
            let verdict = match validator {
                Ok(v) => errors_of(v, doc),
                Err(why) => Err(why.clone()),
            };
            report.record(&format!("schema {ident}"), verdict);
        }
    }
}

/// The first five errors (by path), each `path: message`.
fn errors_of(validator: &Validator, doc: &Value) -> Result<(), String> {
    let mut errors: Vec<(String, String)> = validator
        .iter_errors(doc)
        .map(|e| {
            let path = e.instance_path().to_string();
            let dotted = path.trim_start_matches('/').replace('/', ".");
            let dotted = if dotted.is_empty() {
                "(root)".to_string()
            } else {
                dotted
            };
            let message: String = e.to_string().chars().take(160).collect();
            (dotted, message)
        })
        .collect();
    if errors.is_empty() {
        return Ok(());
    }
    errors.sort();
    let shown: Vec<String> = errors
        .iter()
        .take(5)
        .map(|(path, message)| format!("{path}: {message}"))
        .collect();
    Err(shown.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_follow_group_version_kind() {
        assert_eq!(
            schema_file_name("apps/v1", "Deployment"),
            "apps_v1_Deployment.schema.yaml"
        );
        assert_eq!(schema_file_name("v1", "Pod"), "core_v1_Pod.schema.yaml");
    }
}
