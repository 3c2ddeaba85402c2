//! No import cycles among a crate's modules: the checker every crate's module-graph test
//! includes (`#[path = "../../lints/module_graph.rs"] mod module_graph;`), so one reading of
//! "imports" holds for the filter, the shared types, the companion and the e2e harness.
//!
//! Builds the module graph from the sources: one node per module (`src/a.rs` and
//! `src/a/mod.rs` are `a`, `src/a/b.rs` is `a::b`, `src/lib.rs` is the crate root `crate`, an
//! inline `mod m { … }` in `a` is `a::m`), one edge per path a module names (in `use` lines,
//! grouped `use …::{…}` included, and inline paths) to the longest module prefix of the path.
//! A path counts when it starts with `crate::`, `super::` (chained or not), `self::`, or with
//! the name of one of the module's own submodules (`store::Row` in `keys` names `keys::store`).
//! Comments and string literals are skipped; `mod` declarations are not imports. An edge from a
//! module to itself is no edge. Then it looks for cycles: an edge between a module and its own
//! ancestor or descendant is not a cycle's edge (a module and the modules inside it are one piece:
//! a type's impl split across files, a folder's facade), and what test modules (`tests` and
//! inside them) name is left out (a fixture may use any layer); every strongly connected
//! component of more than one module in what remains is reported with one concrete cycle
//! through it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module → the modules it names.
pub type Graph = BTreeMap<String, BTreeSet<String>>;

/// The source without comments, string and char literals (each replaced by a space).
pub fn code_only(src: &str) -> String {
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
            i = skip_block_comment(b, i);
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

/// The index just past the (nested) block comment starting at `i`.
fn skip_block_comment(b: &[u8], mut i: usize) -> usize {
    let at = |i: usize, s: &str| b.get(i..i + s.len()) == Some(s.as_bytes());
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
    i
}

fn skip_ws(s: &[u8], i: &mut usize) {
    while *i < s.len() && s[*i].is_ascii_whitespace() {
        *i += 1;
    }
}

fn is_ident_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// The identifier at `i` (empty if none), advancing past it.
fn ident<'a>(s: &'a [u8], i: &mut usize) -> &'a str {
    let start = *i;
    while *i < s.len() && is_ident_byte(s[*i]) {
        *i += 1;
    }
    std::str::from_utf8(&s[start..*i]).unwrap_or_default()
}

/// Parses a use tree (or an inline path) at `i`, pushing every full path, `prefix` first.
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
    let name = ident(s, i);
    if name.is_empty() || name == "self" {
        out.push(prefix);
        return;
    }
    let mut path = prefix;
    path.push(name.to_string());
    if s.get(*i..*i + 2) == Some(b"::") {
        *i += 2;
        use_tree(s, i, path, out);
    } else {
        out.push(path);
    }
}

/// `a::b` as segments; the crate root is no segment.
fn segments(module: &str) -> Vec<String> {
    if module == "crate" {
        Vec::new()
    } else {
        module.split("::").map(str::to_string).collect()
    }
}

fn joined(segments: &[String]) -> String {
    if segments.is_empty() {
        "crate".into()
    } else {
        segments.join("::")
    }
}

/// Every path one file names, as `(the module naming it, the absolute path named)`: the
/// module is the file's own or an inline module in it. `inline` collects the inline modules.
fn named_paths(
    file_module: &str,
    code: &str,
    modules: &BTreeSet<String>,
    inline: &mut BTreeSet<String>,
) -> Vec<(String, Vec<String>)> {
    let s = code.as_bytes();
    let mut out = Vec::new();
    // The inline modules open at `i`, with the brace depth just inside each.
    let mut scope: Vec<(String, usize)> = Vec::new();
    let mut depth = 0;
    let mut i = 0;
    while i < s.len() {
        match s[i] {
            b'{' => {
                depth += 1;
                i += 1;
                continue;
            }
            b'}' => {
                if scope.last().is_some_and(|(_, d)| *d == depth) {
                    scope.pop();
                }
                depth -= 1;
                i += 1;
                continue;
            }
            c if !is_ident_byte(c) => {
                i += 1;
                continue;
            }
            _ => {}
        }
        let glued = i > 0 && (is_ident_byte(s[i - 1]) || s[i - 1] == b':' || s[i - 1] == b'.');
        let start = i;
        let word = ident(s, &mut i);
        if glued {
            continue;
        }
        let mut here = segments(file_module);
        here.extend(scope.iter().map(|(m, _)| m.clone()));
        if word == "mod" {
            let mut j = i;
            skip_ws(s, &mut j);
            let name = ident(s, &mut j).to_string();
            skip_ws(s, &mut j);
            if !name.is_empty() && s.get(j) == Some(&b'{') {
                let mut path = here.clone();
                path.push(name.clone());
                inline.insert(joined(&path));
                scope.push((name, depth + 1));
                depth += 1;
                i = j + 1;
            }
            continue;
        }
        if s.get(i..i + 2) != Some(b"::") {
            continue;
        }
        let mut base = match word {
            "crate" => Vec::new(),
            "self" => here.clone(),
            "super" => here[..here.len().saturating_sub(1)].to_vec(),
            child => {
                let mut path = here.clone();
                path.push(child.to_string());
                if !modules.contains(&joined(&path)) {
                    continue;
                }
                here.clone()
            }
        };
        // `super::super::…` and `self::super::…` climb further.
        let mut j = if matches!(word, "crate" | "self" | "super") {
            i + 2
        } else {
            start
        };
        while s.get(j..j + 7) == Some(b"super::") {
            base.pop();
            j += 7;
        }
        let mut paths = Vec::new();
        use_tree(s, &mut j, base, &mut paths);
        i = j.max(i);
        let from = joined(&here);
        out.extend(paths.into_iter().map(|p| (from.clone(), p)));
    }
    out
}

/// The module name of a file at `rel` under `src/`.
pub fn module_name(rel: &Path) -> String {
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let file = parts.pop().unwrap_or_default();
    match file.trim_end_matches(".rs") {
        "mod" => {}
        "lib" | "main" if parts.is_empty() => return "crate".into(),
        stem => parts.push(stem.to_string()),
    }
    parts.join("::")
}

/// The graph of `(module, source)` pairs.
pub fn graph(sources: &[(String, String)]) -> Graph {
    let codes: Vec<(&str, String)> = sources
        .iter()
        .map(|(m, src)| (m.as_str(), code_only(src)))
        .collect();
    // Inline modules are found while reading; one pass to learn them, one to resolve.
    let mut modules: BTreeSet<String> = sources.iter().map(|(m, _)| m.clone()).collect();
    let mut inline = BTreeSet::new();
    for (module, code) in &codes {
        named_paths(module, code, &modules, &mut inline);
    }
    modules.extend(inline.iter().cloned());
    let mut g: Graph = modules
        .iter()
        .map(|m| (m.clone(), BTreeSet::new()))
        .collect();
    for (module, code) in &codes {
        for (from, path) in named_paths(module, code, &modules, &mut inline) {
            let target = (0..=path.len())
                .rev()
                .map(|n| joined(&path[..n]))
                .find(|p| modules.contains(p))
                .unwrap_or_else(|| "crate".into());
            if target != from {
                g.entry(from).or_default().insert(target);
            }
        }
    }
    g
}

/// The strongly connected components of more than one module (Tarjan), each sorted.
pub fn tangles(g: &Graph) -> Vec<Vec<String>> {
    struct Walk<'g> {
        g: &'g Graph,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on_stack: BTreeSet<&'g str>,
        found: Vec<Vec<String>>,
    }
    impl<'g> Walk<'g> {
        fn visit(&mut self, n: &'g str) {
            let i = self.index.len();
            self.index.insert(n, i);
            self.low.insert(n, i);
            self.stack.push(n);
            self.on_stack.insert(n);
            for m in self.g.get(n).into_iter().flatten() {
                if !self.index.contains_key(m.as_str()) {
                    self.visit(m);
                    let low = self.low[n].min(self.low[m.as_str()]);
                    self.low.insert(n, low);
                } else if self.on_stack.contains(m.as_str()) {
                    let low = self.low[n].min(self.index[m.as_str()]);
                    self.low.insert(n, low);
                }
            }
            if self.low[n] == self.index[n] {
                let mut component = Vec::new();
                while let Some(m) = self.stack.pop() {
                    self.on_stack.remove(m);
                    component.push(m.to_string());
                    if m == n {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.found.push(component);
                }
            }
        }
    }
    let mut walk = Walk {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for n in g.keys() {
        if !walk.index.contains_key(n.as_str()) {
            walk.visit(n);
        }
    }
    walk.found.sort();
    walk.found
}

/// A shortest cycle through `start` inside `within`, as the modules along it (first = last).
pub fn cycle_through(g: &Graph, start: &str, within: &BTreeSet<&str>) -> Option<Vec<String>> {
    let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(n) = queue.pop_front() {
        for m in g.get(n).into_iter().flatten().map(String::as_str) {
            if !within.contains(m) {
                continue;
            }
            if m == start {
                let mut path = vec![start.to_string(), n.to_string()];
                let mut at = n;
                while at != start {
                    at = came_from[at];
                    path.push(at.to_string());
                }
                path.reverse();
                path.dedup();
                if path.len() == 1 {
                    path.push(start.to_string());
                }
                return Some(path);
            }
            if m != start && !came_from.contains_key(m) {
                came_from.insert(m, n);
                queue.push_back(m);
            }
        }
    }
    None
}

/// `inner` is `outer` or inside it.
fn within(inner: &str, outer: &str) -> bool {
    outer == "crate"
        || inner == outer
        || inner
            .strip_prefix(outer)
            .is_some_and(|rest| rest.starts_with("::"))
}

/// A test module (`tests`, or inside one): its fixtures may use any layer, so what it names is
/// not the layering of the code it tests.
fn is_test_module(module: &str) -> bool {
    module.split("::").any(|s| s == "tests")
}

/// The graph cycles are looked for in (see the module doc): edges between a module and its own
/// ancestor or descendant dropped, and those of test modules.
pub fn unit_graph(g: &Graph) -> Graph {
    g.iter()
        .map(|(from, targets)| {
            let kept = if is_test_module(from) {
                BTreeSet::new()
            } else {
                targets
                    .iter()
                    .filter(|to| !within(from, to) && !within(to, from))
                    .cloned()
                    .collect()
            };
            (from.clone(), kept)
        })
        .collect()
}

/// Every tangle with one cycle through it, one line each (empty: no cycle).
pub fn cycle_report(g: &Graph) -> Vec<String> {
    let g = &unit_graph(g);
    tangles(g)
        .iter()
        .map(|component| {
            let within: BTreeSet<&str> = component.iter().map(String::as_str).collect();
            let cycle = cycle_through(g, &component[0], &within).unwrap_or_default();
            format!(
                "{} (modules in the tangle: {})",
                cycle.join(" -> "),
                component.join(", ")
            )
        })
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| {
            entry
                .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
                .path()
        })
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `(module, source)` for every `.rs` file under `src`, but those under the relative paths in
/// `other_crates` (a binary is its own crate: it reaches the library by the crate's name).
pub fn sources(src: &Path, other_crates: &[&str]) -> Vec<(String, String)> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files
        .into_iter()
        .filter_map(|f| {
            let rel = f.strip_prefix(src).ok()?.to_path_buf();
            if other_crates.iter().any(|o| rel.starts_with(o)) {
                return None;
            }
            let text =
                std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            Some((module_name(&rel), text))
        })
        .collect()
}

/// Checks the crate whose sources are under `src` (`MAAS_MODULE_GRAPH_SRC`, if set, reads
/// another tree instead, e.g. an older checkout): first that the graph was really read (it holds
/// `known_edge`), then that it has no cycle. Prints every cycle found, then panics naming them.
pub fn assert_no_cycle(src: &Path, other_crates: &[&str], known_edge: (&str, &str)) {
    let src =
        std::env::var_os("MAAS_MODULE_GRAPH_SRC").map_or_else(|| src.to_path_buf(), PathBuf::from);
    let g = graph(&sources(&src, other_crates));
    let (from, to) = known_edge;
    assert!(
        g.get(from).is_some_and(|e| e.contains(to)),
        "the edge {from} -> {to} is not in the graph of {}: {g:#?}",
        src.display()
    );
    let report = cycle_report(&g);
    for line in &report {
        eprintln!("import cycle: {line}");
    }
    assert!(
        report.is_empty(),
        "{} import cycle(s) among the modules of {}:\n{}",
        report.len(),
        src.display(),
        report.join("\n")
    );
}

#[cfg(test)]
mod checker_tests {
    use super::*;

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
        let report = cycle_report(&g);
        assert_eq!(report.len(), 1, "{report:?}");
        assert!(report[0].starts_with("a -> c -> a "), "{report:?}");
        let acyclic = graph(&[
            ("a".into(), "use crate::b::X;\n".into()),
            ("a::x".into(), "use crate::a::Y;\n".into()),
            ("b".into(), String::new()),
        ]);
        assert_eq!(acyclic["a::x"], BTreeSet::from(["a".to_string()]));
        assert!(cycle_report(&acyclic).is_empty());
    }

    #[test]
    fn super_self_and_submodule_paths_are_imports() {
        let g = graph(&[
            (
                "crate".into(),
                "mod keys;\nfn f() { keys::api::g() }\n".into(),
            ),
            (
                "keys".into(),
                "mod api;\nmod store;\npub use store::{Row, self};\n".into(),
            ),
            (
                "keys::api".into(),
                "use super::store::Row;\nuse super::super::db;\nfn f() { self::g(); }\n".into(),
            ),
            (
                "keys::store".into(),
                "fn f() -> super::Key { todo!() }\n".into(),
            ),
            (
                "db".into(),
                "fn f() { let store = 1; store::x(); }\n".into(),
            ),
        ]);
        assert_eq!(g["crate"], BTreeSet::from(["keys::api".to_string()]));
        assert_eq!(g["keys"], BTreeSet::from(["keys::store".to_string()]));
        assert_eq!(
            g["keys::api"],
            BTreeSet::from(["db".to_string(), "keys::store".to_string()])
        );
        // keys <-> keys::store: one unit (a module and its submodule), no cycle.
        assert_eq!(g["keys::store"], BTreeSet::from(["keys".to_string()]));
        assert!(
            g["db"].is_empty(),
            "no submodule `store` in db: {:?}",
            g["db"]
        );
        assert!(cycle_report(&g).is_empty(), "{:?}", cycle_report(&g));
    }

    #[test]
    fn siblings_inside_a_module_make_cycles_parents_and_tests_do_not() {
        let g = graph(&[
            ("x".into(), "mod p;\nmod q;\nmod tests;\nuse p::A;\n".into()),
            ("x::p".into(), "use super::q::A;\nuse super::B;\n".into()),
            ("x::q".into(), "use super::p::B;\n".into()),
            ("x::tests".into(), "use crate::y::F;\n".into()),
            ("y".into(), "use crate::x::B;\n".into()),
        ]);
        let report = cycle_report(&g);
        // x::p <-> x::q is a cycle; x <-> x::p (a module and its own) is not, nor is
        // y -> x -> x::tests -> y (a test fixture may use any layer).
        assert_eq!(report.len(), 1, "{report:?}");
        assert!(report[0].starts_with("x::p -> x::q -> x::p "), "{report:?}");
    }

    #[test]
    fn inline_modules_are_their_own_modules() {
        let g = graph(&[
            (
                "policy".into(),
                "fn f() {}\n#[cfg(test)]\nmod tests {\n    use super::*;\n    use crate::subscription::S;\n    mod props { use super::super::f; }\n}\nfn g() { samples::h() }\nmod samples { pub fn h() {} }\n"
                    .into(),
            ),
            ("subscription".into(), "use crate::policy::f;\n".into()),
        ]);
        // A test module naming another module makes no cycle through the module it tests.
        assert_eq!(
            g["policy::tests"],
            BTreeSet::from(["policy".to_string(), "subscription".to_string()])
        );
        assert_eq!(
            g["policy::tests::props"],
            BTreeSet::from(["policy".to_string()])
        );
        assert_eq!(g["policy"], BTreeSet::from(["policy::samples".to_string()]));
        assert!(g["policy::samples"].is_empty());
        assert_eq!(g["subscription"], BTreeSet::from(["policy".to_string()]));
        assert!(cycle_report(&g).is_empty(), "{:?}", cycle_report(&g));
    }

    #[test]
    fn file_paths_name_modules() {
        assert_eq!(module_name(Path::new("lib.rs")), "crate");
        assert_eq!(module_name(Path::new("keys/mod.rs")), "keys");
        assert_eq!(module_name(Path::new("keys/store.rs")), "keys::store");
        assert_eq!(module_name(Path::new("policy.rs")), "policy");
    }
}
