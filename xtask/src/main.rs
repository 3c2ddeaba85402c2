//! MaaS Gateway's build tasks (`cargo xtask TASK …`; scripts/build-*.sh are their entry points):
//!
//! - `wasm-image`: the filter's OCI image (plugin.wasm, what Istio's agent fetches);
//! - `companion-image`: the companion's (static binary, CA bundle, non-root user, web UI);
//! - `images`: both, pushed, printing MAAS_WASM_IMAGE=… and MAAS_API_IMAGE=… for deploy.sh.
//!
//! Images are assembled byte for byte without a container engine (a tar in GNU tar's exact
//! bytes with fixed owners, modes and mtimes; gzip without name or time; canonical JSON), so the
//! same inputs give the same digest on any machine; skopeo pushes them.

mod args;
mod companion;
mod elf;
mod gzip;
mod images;
mod json;
mod log;
mod oci;
mod tools;
mod ustar;
mod wasm;
mod workspace;

use std::process::ExitCode;
use workspace::Workspace;

const USAGE: &str = "\
Usage: cargo xtask TASK [options]

Tasks:
  wasm-image       the filter's OCI image (scripts/build-wasm-image.sh)
  companion-image  the companion's OCI image (scripts/build-companion-image.sh)
  images           both, pushed (scripts/build-images.sh)

`cargo xtask TASK --help` for a task's options.
";

/// Prints a task's result (stdout) or its refusal (stderr, prefixed) and sets the exit code.
fn finish(log: &log::Log, result: Result<Option<String>, String>, usage: &str) -> ExitCode {
    match result {
        Ok(Some(out)) => {
            println!("{out}");
            ExitCode::SUCCESS
        }
        Ok(None) => {
            print!("{usage}");
            ExitCode::SUCCESS
        }
        Err(why) => {
            log.info(&why);
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let task = if args.is_empty() {
        String::new()
    } else {
        args.remove(0)
    };
    let ws = Workspace::here();
    match task.as_str() {
        "wasm-image" => finish(
            &wasm::LOG,
            wasm::parse(args).and_then(|o| o.map(|o| wasm::run(o, &ws)).transpose()),
            wasm::USAGE,
        ),
        "companion-image" => finish(
            &companion::LOG,
            companion::parse(args).and_then(|o| o.map(|o| companion::run(o, &ws)).transpose()),
            companion::USAGE,
        ),
        "images" => finish(
            &images::LOG,
            images::parse(args).and_then(|o| o.map(|o| images::run(&o, &ws)).transpose()),
            images::USAGE,
        ),
        "" | "-h" | "--help" | "help" => {
            print!("{USAGE}");
            ExitCode::SUCCESS
        }
        other => {
            eprint!("xtask: unknown task '{other}'\n\n{USAGE}");
            ExitCode::FAILURE
        }
    }
}

// No import cycles among the build tasks' modules (the checker: `lints/module_graph.rs`).
#[cfg(test)]
#[path = "../../lints/module_graph.rs"]
mod module_graph;

#[cfg(test)]
#[test]
fn xtask_modules_import_each_other_without_cycles() {
    module_graph::assert_no_cycle(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &[],
        ("oci", "gzip"),
    );
}
