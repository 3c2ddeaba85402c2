#!/usr/bin/env node
// Cargo's runner for wasm32-wasip1 (.cargo/config.toml): runs a WASI preview1 module, e.g. a
// unit-test binary, under Node's built-in `node:wasi`, so the filter's and the shared types'
// tests run with 32-bit usize, the wasm allocator and the same serde paths as inside Envoy.
//
//   scripts/wasi-run.mjs <module.wasm> [args…]
//
// The module sees the given args (argv[0] = the module path), the whole environment and the
// filesystem from / (so tests can read fixtures by absolute path, e.g. via CARGO_MANIFEST_DIR)
// and the current directory; imports other than WASI are stubs that throw when called; the
// process exits with the module's exit code.
import { readFile } from "node:fs/promises";
import process from "node:process";
import { WASI } from "node:wasi";

const [modulePath, ...args] = process.argv.slice(2);
if (!modulePath) {
  process.stderr.write("usage: wasi-run.mjs <module.wasm> [args…]\n");
  process.exit(2);
}

// node:wasi prints an ExperimentalWarning on first use: noise in every test run.
process.removeAllListeners("warning");

const wasi = new WASI({
  version: "preview1",
  args: [modulePath, ...args],
  env: process.env,
  preopens: { "/": "/", ".": process.cwd() },
  returnOnExit: true,
});

let code;
try {
  const module = await WebAssembly.compile(await readFile(modulePath));
  const imports = wasi.getImportObject();
  // Host functions outside WASI (the filter links proxy-wasm's `env.proxy_*` imports): unit
  // tests never reach the host, so each is a stub that fails loudly if one is ever called.
  for (const { module: name, name: field, kind } of WebAssembly.Module.imports(module)) {
    if (kind !== "function" || name in imports && field in imports[name]) continue;
    imports[name] ??= {};
    imports[name][field] = () => {
      throw new Error(`host function ${name}.${field} called: not available under wasi-run`);
    };
  }
  const instance = await WebAssembly.instantiate(module, imports);
  // A test binary of the filter also exports the proxy-wasm `_initialize` (the plugin's entry
  // point for Envoy); WASI.start refuses a module exporting both, and the tests need only `_start`.
  const { _start, memory } = instance.exports;
  code = wasi.start({ exports: { _start, memory } });
} catch (e) {
  if (e instanceof WebAssembly.RuntimeError) {
    // wasm32 panics abort: the first failing test traps and ends the run, and its captured
    // message is lost with it.
    process.stderr.write(
      `wasi-run: ${modulePath} trapped (${e.message}): a test panicked (panic=abort on ` +
        `wasm32 stops the run there); rerun with \`-- --nocapture\` to see its message\n`,
    );
  } else {
    process.stderr.write(`wasi-run: ${modulePath}: ${e && e.stack ? e.stack : e}\n`);
  }
  code = 101;
}
process.exit(typeof code === "number" ? code : 0);
