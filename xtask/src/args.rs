//! The entry points' options, read as the scripts always read them (their messages are what
//! scripts and people match on), and the image references they accept.

use regex::Regex;
use std::path::PathBuf;
use std::sync::LazyLock;

/// REGISTRY/REPOSITORY[:TAG] (no digest: the digest is what the build computes).
static IMAGE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)+(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$",
    )
    .expect("a valid regex")
});
/// REGISTRY/NAMESPACE.
static REPOSITORY: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)+$")
        .expect("a valid regex")
});
static TAG: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$").expect("a valid regex"));

/// The remaining arguments, read one at a time.
pub struct Args {
    rest: std::vec::IntoIter<String>,
}

impl Args {
    pub fn new(args: Vec<String>) -> Args {
        Args {
            rest: args.into_iter(),
        }
    }

    /// The value after `flag`: `--flag VALUE`, where VALUE may not be another option.
    pub fn value(&mut self, flag: &str, what: &str) -> Result<String, String> {
        match self.rest.next() {
            Some(v) if !v.starts_with("--") => Ok(v),
            _ => Err(format!("{flag} needs {what}")),
        }
    }
}

impl Iterator for Args {
    type Item = String;

    fn next(&mut self) -> Option<String> {
        self.rest.next()
    }
}

/// Where an image task's image goes: the options every image task reads alike.
#[derive(Debug)]
pub struct Destination {
    pub oci_dir: Option<PathBuf>,
    pub push: bool,
    pub tls_verify: bool,
    pub authfile: Option<PathBuf>,
    pub image: Option<String>,
}

impl Default for Destination {
    fn default() -> Destination {
        Destination {
            oci_dir: None,
            push: true,
            tls_verify: true,
            authfile: None,
            image: None,
        }
    }
}

impl Destination {
    /// Takes `arg` (and its value) when it is one of these options or the image reference;
    /// `false`: another option, the task's own (or unknown).
    pub fn read(&mut self, arg: &str, args: &mut Args) -> Result<bool, String> {
        match arg {
            "--oci-dir" => self.oci_dir = Some(args.value("--oci-dir", "a directory")?.into()),
            "--no-push" => self.push = false,
            "--tls-verify=false" => self.tls_verify = false,
            "--tls-verify=true" => self.tls_verify = true,
            "--authfile" => self.authfile = Some(args.value("--authfile", "a file")?.into()),
            flag if flag.starts_with('-') => return Ok(false),
            image => {
                if let Some(first) = &self.image {
                    return Err(format!(
                        "one image reference only (got '{first}' and '{image}')"
                    ));
                }
                self.image = Some(image.to_string());
            }
        }
        Ok(true)
    }

    /// Once every argument is read: the image without the `schemes` it may be written with,
    /// required when pushing (`example` shows one), checked and tagged.
    pub fn finish(&mut self, schemes: &[&str], example: &str) -> Result<(), String> {
        self.image = self.image.take().map(|i| {
            schemes
                .iter()
                .fold(i.as_str(), |rest, scheme| rest.trim_start_matches(scheme))
                .to_string()
        });
        if self.push && self.image.is_none() {
            return Err(format!(
                "give the image to push, e.g. {example} (see --help)"
            ));
        }
        self.image = self.image.as_deref().map(image_reference).transpose()?;
        Ok(())
    }
}

/// Checks an image reference and gives it a tag (`latest`) when it has none.
pub fn image_reference(image: &str) -> Result<String, String> {
    if !IMAGE.is_match(image) {
        return Err(format!(
            "'{image}' is not REGISTRY/REPOSITORY[:TAG] (no digest: the digest is what this script computes)"
        ));
    }
    let last = image.rsplit('/').next().unwrap_or(image);
    Ok(if last.contains(':') {
        image.to_string()
    } else {
        format!("{image}:latest")
    })
}

pub fn is_repository(repo: &str) -> bool {
    REPOSITORY.is_match(repo)
}

pub fn is_tag(tag: &str) -> bool {
    TAG.is_match(tag)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_get_a_tag_and_digests_are_refused() {
        assert_eq!(
            image_reference("127.0.0.1:5000/maas/maas-filter").unwrap(),
            "127.0.0.1:5000/maas/maas-filter:latest"
        );
        assert_eq!(
            image_reference("quay.io/me/x:v1").unwrap(),
            "quay.io/me/x:v1"
        );
        let digest = format!("quay.io/me/x@sha256:{}", "a".repeat(64));
        assert!(
            image_reference(&digest)
                .unwrap_err()
                .contains("is not REGISTRY/REPOSITORY[:TAG]")
        );
        assert!(image_reference("quay.io").is_err());
        assert!(image_reference("Quay.io/me/x").is_err());
    }

    #[test]
    fn repositories_and_tags() {
        assert!(is_repository("127.0.0.1:5000/maas"));
        assert!(is_repository("quay.io/me"));
        assert!(!is_repository("quay.io/me/x:v1"));
        assert!(is_tag("v0.1.0"));
        assert!(!is_tag("v1/x"));
        assert!(!is_tag(".x"));
    }

    #[test]
    fn a_flag_needs_a_value_that_is_not_a_flag() {
        let mut a = Args::new(vec!["--no-push".into()]);
        assert_eq!(
            a.value("--wasm", "a file").unwrap_err(),
            "--wasm needs a file"
        );
        let mut b = Args::new(vec![]);
        assert!(b.value("--wasm", "a file").is_err());
        let mut c = Args::new(vec!["x.wasm".into()]);
        assert_eq!(c.value("--wasm", "a file").unwrap(), "x.wasm");
    }
}
