//! No import cycles among the companion's modules.
//!
//! Builds the module graph from the sources: one node per module (`src/a.rs` and
//! `src/a/mod.rs` are `a`, `src/a/b.rs` is `a::b`, `src/lib.rs` is the crate root), one edge
//! per `crate::…` path a module names (in `use` lines, grouped `use crate::{…}` included, and
//! inline paths), to the longest module prefix of the path. Comments and string literals are
//! skipped; `mod` declarations are not imports. Then it looks for a cycle.

// A test crate: a failed unwrap or panic is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Graph = BTreeMap<String, BTreeSet<String>>;

/// The source without comments, string and char literals (replaced by spaces).
fn code_only(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let at = |i: usize, s: &str| b.get(i..i + s.len()) == Some(s.as_bytes());
    while i < b.len() {
        if at(i, "//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if at(i, "/*") {
            let mut depth = 0;
            while i < b.len() {
                if at(i, "/*") {
                    depth += 1;
                    i += 2;
                } else if at(i, "*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if b[i] == b'r'
            && (at(i + 1, "\"") || at(i + 1, "#"))
            && !b
                .get(i.wrapping_sub(1))
                .is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_')
        {
            let mut j = i + 1;
            let mut hashes = 0;
            while at(j, "#") {
                hashes += 1;
                j += 1;
            }
            if !at(j, "\"") {
                out.push(b[i]);
                i += 1;
                continue;
            }
            let close = format!("\"{}", "#".repeat(hashes));
            j += 1;
            while j < b.len() && !at(j, &close) {
                j += 1;
            }
            i = j + close.len();
            out.push(b' ');
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push(b' ');
        } else if b[i] == b'\'' {
            // A char literal ('x', '\n', '\u{..}'), else a lifetime.
            if at(i + 1, "\\") {
                let mut j = i + 2;
                while j < b.len() && b[j] != b'\'' {
                    j += 1;
                }
                i = j + 1;
                out.push(b' ');
            } else if let Some(len) = src[i + 1..].chars().next().map(char::len_utf8)
                && at(i + 1 + len, "'")
            {
                i += len + 2;
                out.push(b' ');
            } else {
                out.push(b[i]);
                i += 1;
            }
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn skip_ws(s: &[u8], i: &mut usize) {
    while *i < s.len() && s[*i].is_ascii_whitespace() {
        *i += 1;
    }
}

/// Parses a use tree (or an inline path) after `crate::`, pushing every full path.
fn use_tree(s: &[u8], i: &mut usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
    skip_ws(s, i);
    if s.get(*i) == Some(&b'{') {
        *i += 1;
        loop {
            skip_ws(s, i);
            match s.get(*i) {
                None => return,
                Some(b'}') => {
                    *i += 1;
                    return;
                }
                Some(b',') => *i += 1,
                Some(_) => {
                    let before = *i;
                    use_tree(s, i, prefix.clone(), out);
                    if *i == before {
                        *i += 1;
                    }
                }
            }
        }
    }
    let start = *i;
    while *i < s.len() && (s[*i].is_ascii_alphanumeric() || s[*i] == b'_' || s[*i] == b'*') {
        *i += 1;
    }
    let ident = String::from_utf8_lossy(&s[start..*i]).into_owned();
    if ident.is_empty() || ident == "*" || ident == "self" {
        out.push(prefix);
        return;
    }
    let mut path = prefix;
    path.push(ident);
    if s.get(*i..*i + 2) == Some(b"::") {
        *i += 2;
        use_tree(s, i, path, out);
    } else {
        out.push(path);
    }
}

/// Every `crate::…` path named in the code.
fn crate_paths(code: &str) -> Vec<Vec<String>> {
    let s = code.as_bytes();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(pos) = code[from..].find("crate::") {
        let start = from + pos;
        from = start + "crate::".len();
        let glued = start > 0 && (s[start - 1].is_ascii_alphanumeric() || s[start - 1] == b'_');
        if glued {
            continue;
        }
        let mut i = from;
        use_tree(s, &mut i, Vec::new(), &mut out);
    }
    out
}

fn module_name(rel: &Path) -> String {
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let file = parts.pop().unwrap_or_default();
    match file.trim_end_matches(".rs") {
        "mod" => {}
        "lib" if parts.is_empty() => return "crate".into(),
        stem => parts.push(stem.to_string()),
    }
    parts.join("::")
}

/// The graph of `(module, source)` pairs.
fn graph(sources: &[(String, String)]) -> Graph {
    let modules: BTreeSet<&str> = sources.iter().map(|(m, _)| m.as_str()).collect();
    let mut g = Graph::new();
    for (module, src) in sources {
        let edges = g.entry(module.clone()).or_default();
        for path in crate_paths(&code_only(src)) {
            let target = (1..=path.len())
                .rev()
                .map(|n| path[..n].join("::"))
                .find(|p| modules.contains(p.as_str()))
                .unwrap_or_else(|| "crate".into());
            if target != *module {
                edges.insert(target);
            }
        }
    }
    g
}

/// A cycle, as the modules along it, if there is one.
fn find_cycle(g: &Graph) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        g: &Graph,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_string(), 1);
        stack.push(n.to_string());
        for m in g.get(n).into_iter().flatten() {
            match state.get(m).copied().unwrap_or(0) {
                1 => {
                    let from = stack.iter().position(|s| s == m).unwrap_or(0);
                    let mut cycle = stack[from..].to_vec();
                    cycle.push(m.clone());
                    return Some(cycle);
                }
                0 => {
                    if let Some(c) = visit(m, g, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in g.keys() {
        if state.get(n).copied().unwrap_or(0) == 0
            && let Some(c) = visit(n, g, &mut state, &mut Vec::new())
        {
            return Some(c);
        }
    }
    None
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn sources(src: &Path) -> Vec<(String, String)> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files
        .into_iter()
        // The binary is its own crate: it reaches the library as `maas_companion::`.
        .filter(|f| f.strip_prefix(src).unwrap() != Path::new("main.rs"))
        .map(|f| {
            let name = module_name(f.strip_prefix(src).unwrap());
            (name, std::fs::read_to_string(&f).unwrap())
        })
        .collect()
}

#[test]
fn companion_modules_import_each_other_without_cycles() {
    // MAAS_MODULE_GRAPH_SRC: check another tree (e.g. an older checkout) the same way.
    let src = std::env::var_os("MAAS_MODULE_GRAPH_SRC")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let g = graph(&sources(&src));
    let edges: usize = g.values().map(BTreeSet::len).sum();
    // The graph is really read: a known edge is there.
    assert!(edges > 20, "only {edges} edges found: {g:#?}");
    if let Some(cycle) = find_cycle(&g) {
        panic!("import cycle: {}", cycle.join(" -> "));
    }
}

#[test]
fn a_cycle_through_a_grouped_use_is_found() {
    let g = graph(&[
        ("a".into(), "use crate::{b::{self, X}, c};\n".into()),
        ("b".into(), "fn f() { crate::c::g() }\n".into()),
        (
            "c".into(),
            "// use crate::a;\nconst S: &str = \"crate::a\";\nuse crate::a::Y as Z;\n".into(),
        ),
        ("d".into(), "use maas_crate::a;\n".into()),
    ]);
    assert_eq!(g["a"], BTreeSet::from(["b".to_string(), "c".to_string()]));
    assert_eq!(g["c"], BTreeSet::from(["a".to_string()]));
    assert!(g["d"].is_empty());
    let cycle = find_cycle(&g).expect("a -> c -> a");
    assert_eq!(cycle.first(), cycle.last());
    let acyclic = graph(&[
        ("a".into(), "use crate::b::X;\n".into()),
        ("a::x".into(), "use crate::a::Y;\n".into()),
        ("b".into(), String::new()),
    ]);
    assert_eq!(acyclic["a::x"], BTreeSet::from(["a".to_string()]));
    assert_eq!(find_cycle(&acyclic), None);
}

#[test]
fn file_paths_name_modules() {
    assert_eq!(module_name(Path::new("lib.rs")), "crate");
    assert_eq!(module_name(Path::new("keys/mod.rs")), "keys");
    assert_eq!(module_name(Path::new("keys/store.rs")), "keys::store");
    assert_eq!(module_name(Path::new("policy.rs")), "policy");
}
