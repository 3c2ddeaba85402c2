//! Both images — the filter (REPO/maas-filter:TAG, for the EnvoyFilter maas-filter) and the
//! companion (REPO/maas-companion:TAG) — built and pushed, and both pinned references printed
//! last, ready for scripts/deploy.sh:
//!   MAAS_WASM_IMAGE=REPO/maas-filter@sha256:...
//!   MAAS_API_IMAGE=REPO/maas-companion@sha256:...

use crate::args::{Args, is_repository, is_tag};
use crate::log::Log;
use crate::workspace::Workspace;
use crate::{companion, wasm};

pub const LOG: Log = Log::new("build-images");

pub const USAGE: &str = "\
Usage: scripts/build-images.sh [options] REGISTRY/NAMESPACE TAG
       (or: cargo xtask images [options] REGISTRY/NAMESPACE TAG)

Builds the filter (wasm32-wasip1) and the companion (static, x86_64-unknown-linux-musl), pushes
REGISTRY/NAMESPACE/maas-filter:TAG and REGISTRY/NAMESPACE/maas-companion:TAG with skopeo, and
prints, last, two lines to paste (or eval) before scripts/deploy.sh:
  MAAS_WASM_IMAGE=REGISTRY/NAMESPACE/maas-filter@sha256:<digest>
  MAAS_API_IMAGE=REGISTRY/NAMESPACE/maas-companion@sha256:<digest>

Options (passed to both image builds):
  --no-build           pack the existing release builds without running cargo
  --tls-verify=false   talk plain HTTP / skip certificate checks (a local test registry)
  --authfile FILE      registry credentials (default: skopeo's)
  -h, --help           this help
";

/// The options both builds get, and the repository and tag.
#[derive(Debug)]
pub struct Options {
    pub common: Vec<String>,
    pub repo: String,
    pub tag: String,
}

/// Reads the options; `None` for --help.
pub fn parse(args: Vec<String>) -> Result<Option<Options>, String> {
    let mut common = Vec::new();
    let mut positional = Vec::new();
    let mut args = Args::new(args);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--no-build" | "--tls-verify=false" | "--tls-verify=true" => common.push(arg),
            "--authfile" => {
                let file = args.value("--authfile", "a file")?;
                common.extend([arg, file]);
            }
            "-h" | "--help" => return Ok(None),
            flag if flag.starts_with('-') => {
                return Err(format!("unknown option: {flag} (see --help)"));
            }
            _ => positional.push(arg),
        }
    }
    let [repo, tag] = <[String; 2]>::try_from(positional).map_err(|_| {
        "give REGISTRY/NAMESPACE and TAG, e.g. quay.io/me v0.1.0 (see --help)".to_string()
    })?;
    let repo = repo
        .trim_end_matches('/')
        .trim_start_matches("docker://")
        .to_string();
    if !is_tag(&tag) {
        return Err(format!("'{tag}' is not an image tag"));
    }
    if !is_repository(&repo) {
        return Err(format!(
            "'{repo}' is not REGISTRY/NAMESPACE (e.g. quay.io/me or 127.0.0.1:5000/maas)"
        ));
    }
    Ok(Some(Options { common, repo, tag }))
}

/// Builds and pushes both; returns the two lines to print.
pub fn run(o: &Options, ws: &Workspace) -> Result<String, String> {
    let with = |image: String| {
        let mut args = o.common.clone();
        args.push(image);
        args
    };
    let filter = wasm::parse(with(format!("{}/maas-filter:{}", o.repo, o.tag)))
        .and_then(|opts| wasm::run(opts.ok_or("no options")?, ws))
        .map_err(|why| {
            wasm::LOG.info(&why);
            "the filter image failed".to_string()
        })?;
    let api = companion::parse(with(format!("{}/maas-companion:{}", o.repo, o.tag)))
        .and_then(|opts| companion::run(opts.ok_or("no options")?, ws))
        .map_err(|why| {
            companion::LOG.info(&why);
            "the companion image failed".to_string()
        })?;
    if !filter.starts_with(&format!("{}/maas-filter@sha256:", o.repo)) {
        return Err(format!("unexpected filter reference '{filter}'"));
    }
    if !api.starts_with(&format!("{}/maas-companion@sha256:", o.repo)) {
        return Err(format!("unexpected companion reference '{api}'"));
    }
    Ok(format!("MAAS_WASM_IMAGE={filter}\nMAAS_API_IMAGE={api}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Result<Option<Options>, String> {
        parse(a.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn options_are_read_as_the_script_read_them() {
        assert!(
            args(&["quay.io/me"])
                .unwrap_err()
                .contains("give REGISTRY/NAMESPACE and TAG")
        );
        assert_eq!(
            args(&["quay.io/me", "v1/x"]).unwrap_err(),
            "'v1/x' is not an image tag"
        );
        assert_eq!(
            args(&["--fast", "quay.io/me", "v1"]).unwrap_err(),
            "unknown option: --fast (see --help)"
        );
        let o = args(&[
            "--no-build",
            "--authfile",
            "a.json",
            "docker://127.0.0.1:5000/maas/",
            "v1",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(o.repo, "127.0.0.1:5000/maas");
        assert_eq!(o.common, ["--no-build", "--authfile", "a.json"]);
    }
}
