//! The filter's image: the release .wasm as `plugin.wasm` at the root of one layer — the
//! equivalent of `FROM scratch` + `COPY plugin.wasm /`, the shape Istio's agent fetches for a
//! Wasm module (a WasmPlugin's url, or the oci:// uri of the EnvoyFilter maas-filter's extension
//! config). The same .wasm always gives the same digest, on any machine.

use crate::args::{Args, Destination};
use crate::log::Log;
use crate::oci::{self, Image, Publish};
use crate::tools;
use crate::ustar::{self, Entry};
use crate::workspace::Workspace;
use std::path::PathBuf;

pub const LOG: Log = Log::new("build-wasm-image");

pub const USAGE: &str = "\
Usage: scripts/build-wasm-image.sh [options] REGISTRY/REPOSITORY[:TAG]
       (or: cargo xtask wasm-image [options] REGISTRY/REPOSITORY[:TAG])

Builds target/wasm32-wasip1/release/maas_filter.wasm (cargo), packs it as plugin.wasm in a
one-layer OCI image and pushes it with skopeo. The last line printed is the pinned reference
REGISTRY/REPOSITORY@sha256:<digest>; put it in MAAS_WASM_IMAGE for scripts/deploy.sh.

Options:
  --wasm FILE          pack FILE instead of building the filter
  --no-build           pack the existing release build without running cargo
  --oci-dir DIR        also keep the OCI image layout in DIR
  --no-push            build the image (and print its digest) without pushing it
  --tls-verify=false   talk plain HTTP / skip certificate checks (a local test registry)
  --authfile FILE      registry credentials (default: skopeo's, e.g. ${XDG_RUNTIME_DIR}/containers/auth.json)
  -h, --help           this help
";

/// What to build and where it goes.
#[derive(Debug, Default)]
pub struct Options {
    pub wasm: Option<PathBuf>,
    pub build: bool,
    /// Where the image goes.
    pub dest: Destination,
}

/// Reads the options; `None` for --help.
pub fn parse(args: Vec<String>) -> Result<Option<Options>, String> {
    let mut o = Options {
        build: true,
        ..Options::default()
    };
    let mut args = Args::new(args);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--wasm" => {
                o.wasm = Some(args.value("--wasm", "a file")?.into());
                o.build = false;
            }
            "--no-build" => o.build = false,
            "-h" | "--help" => return Ok(None),
            other if o.dest.read(other, &mut args)? => {}
            flag => return Err(format!("unknown option: {flag} (see --help)")),
        }
    }
    o.dest
        .finish(&["oci://", "docker://"], "quay.io/me/maas-filter:v0.1.0")?;
    Ok(Some(o))
}

/// The image of a module: its layer (plugin.wasm, 0644, root-owned, mtime 0) and config.
pub fn image(wasm: &[u8]) -> Result<Image, String> {
    let tar = ustar::archive(&[Entry::File {
        path: "plugin.wasm".to_string(),
        mode: 0o644,
        data: wasm.to_vec(),
    }])?;
    let (diff_id, layer) = oci::layer(&tar)?;
    let config = format!(
        "{{\"architecture\":\"wasm\",\"os\":\"wasip1\",\"config\":{{}},\"rootfs\":{{\"type\":\"layers\",\"diff_ids\":[\"{diff_id}\"]}}}}"
    );
    Ok(Image::new(
        "maas-filter",
        config.into_bytes(),
        layer,
        Some(r#"{"org.opencontainers.image.title":"plugin.wasm"}"#),
    ))
}

/// Builds (unless told not to), packs and publishes; returns the pinned reference or digest.
pub fn run(o: Options, ws: &Workspace) -> Result<String, String> {
    if o.dest.push && tools::which("skopeo").is_none() {
        return Err("skopeo is required to push (apt-get install skopeo)".to_string());
    }
    if o.build {
        LOG.info(
            "building the filter: cargo build -p maas-filter --release --target wasm32-wasip1",
        );
        ws.cargo(
            &[
                "build",
                "-p",
                "maas-filter",
                "--release",
                "--target",
                "wasm32-wasip1",
            ],
            &[],
        )
        .map_err(|_| "cargo build failed".to_string())?;
    }
    let path = o.wasm.unwrap_or_else(|| {
        ws.target_dir()
            .join("wasm32-wasip1/release/maas_filter.wasm")
    });
    let wasm = std::fs::read(&path).unwrap_or_default();
    if wasm.is_empty() {
        return Err(format!("no wasm module at {}", path.display()));
    }
    if !wasm.starts_with(b"\0asm") {
        return Err(format!("{} is not a WebAssembly module", path.display()));
    }
    let image = image(&wasm)?;
    LOG.info(&format!(
        "plugin.wasm {} bytes, {}",
        wasm.len(),
        oci::digest(&wasm).replace(':', " ")
    ));
    let publish = Publish {
        oci_dir: o.dest.oci_dir,
        push: o.dest.image.filter(|_| o.dest.push),
        tls_verify: o.dest.tls_verify,
        authfile: o.dest.authfile,
        hint: "pin it in EnvoyFilter maas-filter (deploy.sh MAAS_WASM_IMAGE): uri: oci://"
            .to_string(),
    };
    oci::publish(&image, &publish, &LOG)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn the_image_is_one_plugin_wasm_layer_with_a_wasm_config() {
        let img = image(b"\0asm\x01\0\0\0").unwrap();
        let config: Value = serde_json::from_slice(&img.config).unwrap();
        assert_eq!(config["architecture"], "wasm");
        assert_eq!(config["os"], "wasip1");
        // GNU tar's layer for this module (see ustar's tests): its digest is the diff_id.
        assert_eq!(
            config["rootfs"]["diff_ids"][0],
            "sha256:b87b1877ccc535f2aef59394dd5c37d12ca975ae49f372591e359c4926ea5937"
        );
        let manifest: Value = serde_json::from_slice(&img.manifest).unwrap();
        assert_eq!(manifest["layers"].as_array().unwrap().len(), 1);
        assert_eq!(img.ref_name, "maas-filter");
    }

    #[test]
    fn the_same_module_gives_the_same_digest_another_another() {
        let a = image(b"\0asm\x01\0\0\0").unwrap();
        assert_eq!(a.digest(), image(b"\0asm\x01\0\0\0").unwrap().digest());
        assert_ne!(a.digest(), image(b"\0asm\x01\0\0\0\0").unwrap().digest());
    }

    #[test]
    fn options_are_read_as_the_script_read_them() {
        let args = |a: &[&str]| parse(a.iter().map(|s| s.to_string()).collect());
        assert_eq!(
            args(&["--fast", "r/x"]).unwrap_err(),
            "unknown option: --fast (see --help)"
        );
        assert_eq!(args(&["--wasm"]).unwrap_err(), "--wasm needs a file");
        assert!(
            args(&["--no-build"])
                .unwrap_err()
                .contains("give the image to push")
        );
        let o = args(&["--wasm", "x.wasm", "--no-push"]).unwrap().unwrap();
        assert!(!o.build && !o.dest.push && o.dest.image.is_none());
        let o = args(&["oci://quay.io/me/f"]).unwrap().unwrap();
        assert_eq!(o.dest.image.as_deref(), Some("quay.io/me/f:latest"));
        assert!(args(&["--help"]).unwrap().is_none());
        assert!(
            args(&["a/b", "c/d"])
                .unwrap_err()
                .contains("one image reference only")
        );
    }
}
