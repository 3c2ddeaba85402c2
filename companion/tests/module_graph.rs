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
