//! No import cycles among the filter's modules (the checker: `lints/module_graph.rs`).

#[path = "../../lints/module_graph.rs"]
mod module_graph;

use std::path::Path;

#[test]
fn filter_modules_import_each_other_without_cycles() {
    module_graph::assert_no_cycle(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &[],
        ("host::recording", "host"),
    );
}
