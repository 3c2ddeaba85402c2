//! No import cycles among the companion's modules (the checker: `lints/module_graph.rs`).

#[path = "../../lints/module_graph.rs"]
mod module_graph;

use std::path::Path;

#[test]
fn companion_modules_import_each_other_without_cycles() {
    module_graph::assert_no_cycle(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        // The binary is its own crate: it reaches the library as `maas_companion::`.
        &["main.rs"],
        ("keys::api", "keys::store"),
    );
}

/// No upward arrows from persistence: the stores name no HTTP module (`http`, `routes`,
/// `caller`, a capability's `api`) and no axum; a capability's error maps a store's failure to
/// HTTP beside itself (through `http::database_failure`).
#[test]
fn persistence_names_no_http() {
    let src = std::env::var_os("MAAS_MODULE_GRAPH_SRC").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        std::path::PathBuf::from,
    );
    let sources = module_graph::sources(&src, &["main.rs"]);
    let g = module_graph::graph(&sources);
    let stores = [
        "db",
        "keys::store",
        "usage::store",
        "leases::batch",
        "leases::memory",
        "leases::redis",
    ];
    for store in stores {
        let (_, text) = sources
            .iter()
            .find(|(m, _)| m == store)
            .unwrap_or_else(|| panic!("no module {store} in {}", src.display()));
        let up: Vec<&String> = g[store]
            .iter()
            .filter(|m| ["http", "routes", "caller"].contains(&m.as_str()) || m.ends_with("::api"))
            .collect();
        assert!(up.is_empty(), "{store} names {up:?}");
        assert!(
            !module_graph::code_only(text).contains("axum"),
            "{store} names axum"
        );
    }
}
