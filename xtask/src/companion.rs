//! The companion's image, without a container engine — the equivalent of `FROM scratch` + the
//! static binary + /etc/passwd + a CA bundle + the web UI:
//!
//! - /usr/local/bin/maas-companion (0755): static, x86_64-unknown-linux-musl;
//! - /etc/passwd and /etc/group with the non-root user maas (65532);
//! - /etc/ssl/certs/ca-certificates.crt (Debian's ca-certificates: the Kubernetes API, OIDC
//!   issuers and PostgreSQL over TLS);
//! - /usr/share/maas-companion/ui (the web UI, ui/ built with `npm ci && npm run build`; the
//!   config sets MAAS_UI_DIR to it, so the companion serves it at /ui/);
//! - /tmp (1777). No shell, no libc: nothing else.
//!
//! The same binary, CA bundle and UI always give the same digest.

use crate::args::{Args, Destination};
use crate::elf;
use crate::json;
use crate::log::Log;
use crate::oci::{self, Image, Publish};
use crate::tools;
use crate::ustar::{self, Tree};
use crate::workspace::Workspace;
use serde_json::json;
use std::path::{Path, PathBuf};

pub const LOG: Log = Log::new("build-companion-image");
const TARGET: &str = "x86_64-unknown-linux-musl";
const UID_GID: u32 = 65532;
const UI_IN_IMAGE: &str = "usr/share/maas-companion/ui";
const CA_DEFAULT: &str = "/etc/ssl/certs/ca-certificates.crt";

pub const USAGE: &str = "\
Usage: scripts/build-companion-image.sh [options] REGISTRY/REPOSITORY[:TAG]
       (or: cargo xtask companion-image [options] REGISTRY/REPOSITORY[:TAG])

Builds target/x86_64-unknown-linux-musl/release/maas-companion (cargo, static) and the web UI
(ui/: npm ci && npm run build, needs Node.js 18+ and npm), packs them with a CA bundle and a
non-root /etc/passwd into a one-layer OCI image and pushes it with skopeo. The
last line printed is the pinned reference REGISTRY/REPOSITORY@sha256:<digest>; put it in
MAAS_API_IMAGE for scripts/deploy.sh.

Installs what the build needs when it is missing and it may (root with apt-get): the rustup
target x86_64-unknown-linux-musl, musl-tools (ring's C code), ca-certificates.

Options:
  --binary FILE        pack FILE (a static x86_64 ELF) instead of building the companion
  --no-build           pack the existing musl release build without running cargo
  --ui-dir DIR         pack DIR (a built web UI with index.html) instead of building ui/
  --ca-bundle FILE     CA bundle for /etc/ssl/certs/ca-certificates.crt (default: Debian's)
  --oci-dir DIR        also keep the OCI image layout in DIR
  --no-push            build the image (and print its digest) without pushing it
  --tls-verify=false   talk plain HTTP / skip certificate checks (a local test registry)
  --authfile FILE      registry credentials (default: skopeo's)
  -h, --help           this help
";

/// What to build and where it goes.
#[derive(Debug, Default)]
pub struct Options {
    pub binary: Option<PathBuf>,
    pub ui_dir: Option<PathBuf>,
    pub build: bool,
    pub ca_bundle: PathBuf,
    /// Where the image goes.
    pub dest: Destination,
}

/// Reads the options; `None` for --help.
pub fn parse(args: Vec<String>) -> Result<Option<Options>, String> {
    let mut o = Options {
        build: true,
        ca_bundle: PathBuf::from(CA_DEFAULT),
        ..Options::default()
    };
    let mut args = Args::new(args);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--binary" => {
                o.binary = Some(args.value("--binary", "a file")?.into());
                o.build = false;
            }
            "--no-build" => o.build = false,
            "--ca-bundle" => o.ca_bundle = args.value("--ca-bundle", "a file")?.into(),
            "--ui-dir" => o.ui_dir = Some(args.value("--ui-dir", "a directory")?.into()),
            "-h" | "--help" => return Ok(None),
            other if o.dest.read(other, &mut args)? => {}
            flag => return Err(format!("unknown option: {flag} (see --help)")),
        }
    }
    o.dest
        .finish(&["docker://"], "quay.io/me/maas-companion:v0.1.0")?;
    Ok(Some(o))
}

/// A directory (`None`) or a file's bytes, by path relative to the web UI's directory.
type UiEntry = (String, Option<Vec<u8>>);

/// What goes into the image.
pub struct Contents {
    pub binary: Vec<u8>,
    pub ca_bundle: Vec<u8>,
    /// The web UI's directories (`None`) and files, by path relative to its directory.
    pub ui: Vec<UiEntry>,
    /// The labels' version, source and revision.
    pub version: String,
    pub repository: String,
    pub revision: Option<String>,
}

/// The layer's tree: modes set explicitly (the builder's umask does not matter).
fn rootfs(c: &Contents) -> Result<Tree, String> {
    let mut t = Tree::default();
    t.file(
        "etc/passwd",
        0o644,
        format!(
            "root:x:0:0:root:/:/sbin/nologin\nmaas:x:{UID_GID}:{UID_GID}:maas-companion:/:/sbin/nologin\n"
        )
        .into_bytes(),
    )?;
    t.file(
        "etc/group",
        0o644,
        format!("root:x:0:\nmaas:x:{UID_GID}:\n").into_bytes(),
    )?;
    t.file(
        "etc/ssl/certs/ca-certificates.crt",
        0o644,
        c.ca_bundle.clone(),
    )?;
    t.dir("tmp", 0o1777)?;
    t.file("usr/local/bin/maas-companion", 0o755, c.binary.clone())?;
    t.dir(UI_IN_IMAGE, 0o755)?;
    for (path, data) in &c.ui {
        let path = format!("{UI_IN_IMAGE}/{path}");
        match data {
            Some(data) => t.file(&path, 0o644, data.clone())?,
            None => t.dir(&path, 0o755)?,
        }
    }
    Ok(t)
}

/// The image config (canonical JSON: sorted keys, no spaces).
fn config(c: &Contents, diff_id: &str) -> String {
    let mut labels = json!({
        "org.opencontainers.image.title": "maas-companion",
        "org.opencontainers.image.description":
            "MaaS Gateway companion: API keys in PostgreSQL, identity, policy and provider credentials",
        "org.opencontainers.image.licenses": "Apache-2.0",
        "org.opencontainers.image.version": c.version,
        "org.opencontainers.image.source": c.repository,
    });
    if let Some(revision) = &c.revision {
        labels["org.opencontainers.image.revision"] = json!(revision);
    }
    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {
            "User": format!("{UID_GID}:{UID_GID}"),
            "Entrypoint": ["/usr/local/bin/maas-companion"],
            "Env": [
                "PATH=/usr/local/bin",
                "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt",
                format!("MAAS_UI_DIR=/{UI_IN_IMAGE}"),
            ],
            "WorkingDir": "/",
            "ExposedPorts": {"8080/tcp": {}, "8081/tcp": {}, "9090/tcp": {}},
            "Labels": labels,
        },
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "scripts/build-companion-image.sh"}],
    });
    json::canonical(&config)
}

/// The image of these contents.
pub fn image(c: &Contents) -> Result<Image, String> {
    let tar = ustar::archive(&rootfs(c)?.entries())?;
    let (diff_id, layer) = oci::layer(&tar)?;
    Ok(Image::new(
        "maas-companion",
        config(c, &diff_id).into_bytes(),
        layer,
        None,
    ))
}

/// Every directory (`None`) and regular file under `dir`, by relative path (symbolic links and
/// other kinds refused).
fn read_tree(dir: &Path) -> Result<Vec<UiEntry>, String> {
    let mut out = Vec::new();
    let mut pending = vec![PathBuf::new()];
    while let Some(relative) = pending.pop() {
        let here = dir.join(&relative);
        let entries = std::fs::read_dir(&here).map_err(|e| format!("{}: {e}", here.display()))?;
        for entry in entries {
            let entry = entry.map_err(|e| format!("{}: {e}", here.display()))?;
            let path = relative.join(entry.file_name());
            let kind = entry
                .file_type()
                .map_err(|e| format!("{}: {e}", path.display()))?;
            let name = path
                .to_str()
                .ok_or_else(|| format!("{}: not a UTF-8 name", path.display()))?
                .to_string();
            if kind.is_dir() {
                out.push((name, None));
                pending.push(path);
            } else if kind.is_file() {
                let data = std::fs::read(entry.path()).map_err(|e| format!("{name}: {e}"))?;
                out.push((name, Some(data)));
            } else {
                return Err(format!(
                    "{} in the web UI is not a file or a directory",
                    dir.join(&path).display()
                ));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The CA bundle: Debian's (installed when missing and we may) or the one given.
fn ca_bundle(path: &Path) -> Result<Vec<u8>, String> {
    let missing = std::fs::metadata(path).map_or(true, |m| m.len() == 0);
    if path == Path::new(CA_DEFAULT) && missing {
        if !tools::is_root() || tools::which("apt-get").is_none() {
            return Err(format!(
                "no CA bundle at {}: install ca-certificates",
                path.display()
            ));
        }
        tools::apt_install("ca-certificates", &LOG)?;
    }
    let data = std::fs::read(path).unwrap_or_default();
    if data.is_empty() {
        return Err(format!("no CA bundle at {}", path.display()));
    }
    if !String::from_utf8_lossy(&data).contains("BEGIN CERTIFICATE") {
        return Err(format!("{} holds no PEM certificate", path.display()));
    }
    Ok(data)
}

/// The static musl build. Reproducible: the paths of this checkout and of cargo's registry are
/// remapped, so the binary does not depend on where it was built (strip and panic = abort come
/// from the release profile). RUSTFLAGS applies to the musl target only (build scripts and proc
/// macros are host builds), so the target directory's native builds are untouched.
fn build_binary(ws: &Workspace) -> Result<(), String> {
    if tools::which("cargo").is_none() && std::env::var_os("CARGO").is_none() {
        return Err("cargo is required (rustup.rs)".to_string());
    }
    if tools::which("rustup").is_some() {
        let installed = std::process::Command::new("rustup")
            .args(["target", "list", "--installed"])
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .any(|l| l.trim() == TARGET)
            })
            .unwrap_or(false);
        if !installed {
            LOG.info(&format!("adding the rust target {TARGET} (rustup)"));
            tools::run_to_stderr("rustup", &["target", "add", TARGET], None, &[])
                .map_err(|_| format!("rustup target add {TARGET} failed"))?;
        }
    }
    tools::apt_tool("musl-gcc", "musl-tools", &LOG)?;
    let cargo_home = std::env::var("CARGO_HOME")
        .unwrap_or_else(|_| format!("{}/.cargo", std::env::var("HOME").unwrap_or_default()));
    let rustflags = format!(
        "--remap-path-prefix={}=/build --remap-path-prefix={cargo_home}=/cargo",
        ws.root().display()
    );
    LOG.info(&format!(
        "building the companion: cargo build -p maas-companion --release --target {TARGET}"
    ));
    ws.cargo(
        &[
            "build",
            "-p",
            "maas-companion",
            "--release",
            "--target",
            TARGET,
        ],
        &[
            ("CARGO_ENCODED_RUSTFLAGS", None),
            ("CC_x86_64_unknown_linux_musl", Some("musl-gcc")),
            ("RUSTFLAGS", Some(&rustflags)),
        ],
    )
    .map_err(|_| "cargo build failed".to_string())
}

/// ui/ built into `out` (ui/dist is left alone).
fn build_ui(ws: &Workspace, out: &Path) -> Result<(), String> {
    if tools::which("npm").is_none() {
        return Err(
            "npm is required to build the web UI (apt-get install nodejs npm), or give a built one with --ui-dir DIR"
                .to_string(),
        );
    }
    LOG.info("building the web UI: npm ci && npm run build (ui/)");
    let ui = ws.root().join("ui");
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let lock = modified(&ui.join("package-lock.json"));
    let installed = modified(&ui.join("node_modules/.package-lock.json"));
    if !ui.join("node_modules").is_dir() || lock > installed {
        tools::run_to_stderr(
            "npm",
            &["ci", "--no-audit", "--no-fund", "--loglevel=error"],
            Some(&ui),
            &[],
        )
        .map_err(|_| "npm ci in ui/ failed".to_string())?;
    }
    let out = out.display().to_string();
    tools::run_to_stderr(
        "npm",
        &["run", "build", "--silent", "--", "--outDir", &out],
        Some(&ui),
        &[],
    )
    .map_err(|_| "building the web UI failed (cd ui && npm run build)".to_string())
}

/// Builds (unless told not to), packs and publishes; returns the pinned reference or digest.
pub fn run(o: Options, ws: &Workspace) -> Result<String, String> {
    if o.dest.push {
        tools::apt_tool("skopeo", "skopeo", &LOG)?;
    }
    let ca_bundle = ca_bundle(&o.ca_bundle)?;
    if o.build {
        build_binary(ws)?;
    }
    let path = o
        .binary
        .unwrap_or_else(|| ws.target_dir().join(TARGET).join("release/maas-companion"));
    let binary = std::fs::read(&path).unwrap_or_default();
    if binary.is_empty() {
        return Err(format!("no companion binary at {}", path.display()));
    }
    elf::static_x86_64(&binary).map_err(|why| {
        format!(
            "{} is not a static x86_64 ELF executable ({why})",
            path.display()
        )
    })?;
    let work = tempfile::tempdir().map_err(|e| format!("a temporary directory: {e}"))?;
    let ui_dir = match o.ui_dir {
        Some(dir) => dir,
        None => {
            let out = work.path().join("ui");
            build_ui(ws, &out)?;
            out
        }
    };
    if !ui_dir.join("index.html").is_file() {
        return Err(format!(
            "no index.html in the web UI {} (build it: cd ui && npm ci && npm run build)",
            ui_dir.display()
        ));
    }
    let contents = Contents {
        ca_bundle,
        ui: read_tree(&ui_dir)?,
        version: ws
            .manifest_value("version")
            .unwrap_or_else(|| "0.0.0".to_string()),
        repository: ws.manifest_value("repository").unwrap_or_default(),
        revision: ws.revision(),
        binary,
    };
    let image = image(&contents)?;
    LOG.info(&format!(
        "maas-companion {} bytes, {}",
        contents.binary.len(),
        oci::digest(&contents.binary).replace(':', " ")
    ));
    let publish = Publish {
        oci_dir: o.dest.oci_dir,
        push: o.dest.image.filter(|_| o.dest.push),
        tls_verify: o.dest.tls_verify,
        authfile: o.dest.authfile,
        hint: "deploy it with MAAS_API_IMAGE=".to_string(),
    };
    oci::publish(&image, &publish, &LOG)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn contents() -> Contents {
        Contents {
            binary: vec![b'x'; 3000],
            ca_bundle: b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n".to_vec(),
            ui: vec![
                (".hidden".into(), Some(b"dot\n".to_vec())),
                ("assets".into(), None),
                ("assets/index-Ab.css".into(), Some(b"b\n".to_vec())),
                (
                    "assets/index-AbC_1.js".into(),
                    Some(b"console.log(1)\n".to_vec()),
                ),
                (
                    format!("assets/{}.js", "n".repeat(90)),
                    Some(b"long\n".to_vec()),
                ),
                (
                    "index.html".into(),
                    Some(b"<html><div id=\"root\"></div></html>\n".to_vec()),
                ),
            ],
            version: "0.1.0".into(),
            repository: "https://github.com/maas-gateway/maas-gateway".into(),
            revision: Some("0123abc".into()),
        }
    }

    /// The layer is GNU tar's for the same tree (ustar's companion test builds that tree by
    /// hand; here it comes from the contents), so the diff_id did not change with the move.
    #[test]
    fn the_layer_is_gnu_tars_for_the_same_tree() {
        let img = image(&contents()).unwrap();
        let config: Value = serde_json::from_slice(&img.config).unwrap();
        assert_eq!(
            config["rootfs"]["diff_ids"][0],
            "sha256:4200e9cb719238dcddeaf5077ac7acf4704518d5c15ca047a543b2f873a19472"
        );
    }

    /// The config's bytes are what the Python writer (json.dumps, sorted keys, no spaces) wrote
    /// for the same inputs (here with a fixed diff_id).
    #[test]
    fn the_config_is_byte_for_byte_the_former_one() {
        let expected = r#"{"architecture":"amd64","config":{"Entrypoint":["/usr/local/bin/maas-companion"],"Env":["PATH=/usr/local/bin","SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt","MAAS_UI_DIR=/usr/share/maas-companion/ui"],"ExposedPorts":{"8080/tcp":{},"8081/tcp":{},"9090/tcp":{}},"Labels":{"org.opencontainers.image.description":"MaaS Gateway companion: API keys in PostgreSQL, identity, policy and provider credentials","org.opencontainers.image.licenses":"Apache-2.0","org.opencontainers.image.revision":"0123abc","org.opencontainers.image.source":"https://github.com/maas-gateway/maas-gateway","org.opencontainers.image.title":"maas-companion","org.opencontainers.image.version":"0.1.0"},"User":"65532:65532","WorkingDir":"/"},"created":"1970-01-01T00:00:00Z","history":[{"created":"1970-01-01T00:00:00Z","created_by":"scripts/build-companion-image.sh"}],"os":"linux","rootfs":{"diff_ids":["sha256:abababababababababababababababababababababababababababababababab"],"type":"layers"}}"#;
        assert_eq!(
            config(&contents(), &format!("sha256:{}", "ab".repeat(32))),
            expected
        );
        let mut without = contents();
        without.revision = None;
        assert!(!config(&without, "sha256:x").contains("revision"));
    }

    #[test]
    fn two_builds_agree_and_another_binary_differs() {
        let a = image(&contents()).unwrap();
        assert_eq!(a, image(&contents()).unwrap());
        let mut other = contents();
        other.binary.push(b'x');
        assert_ne!(a.digest(), image(&other).unwrap().digest());
    }

    #[test]
    fn the_ui_tree_is_read_with_relative_paths_and_links_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("assets")).unwrap();
        std::fs::write(dir.path().join("index.html"), "i").unwrap();
        std::fs::write(dir.path().join("assets/a.js"), "a").unwrap();
        let tree = read_tree(dir.path()).unwrap();
        assert_eq!(
            tree,
            vec![
                ("assets".to_string(), None),
                ("assets/a.js".to_string(), Some(b"a".to_vec())),
                ("index.html".to_string(), Some(b"i".to_vec()))
            ]
        );
        std::os::unix::fs::symlink("index.html", dir.path().join("link")).unwrap();
        assert!(
            read_tree(dir.path())
                .unwrap_err()
                .contains("not a file or a directory")
        );
    }

    #[test]
    fn options_are_read_as_the_script_read_them() {
        let args = |a: &[&str]| parse(a.iter().map(|s| s.to_string()).collect());
        assert!(
            args(&["--no-build", &format!("r.io/m/c@sha256:{}", "a".repeat(64))])
                .unwrap_err()
                .contains("is not REGISTRY/REPOSITORY[:TAG]")
        );
        let o = args(&["--binary", "b", "--ui-dir", "u", "--no-push"])
            .unwrap()
            .unwrap();
        assert!(!o.build && !o.dest.push);
        assert_eq!(o.ca_bundle, PathBuf::from(CA_DEFAULT));
        assert_eq!(
            args(&["--ca-bundle"]).unwrap_err(),
            "--ca-bundle needs a file"
        );
    }
}
