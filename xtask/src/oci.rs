//! A one-layer OCI image layout: blobs stored under their digest, the manifest (config + one
//! tar+gzip layer), the layout's index naming it, an optional copy of the layout, and the push
//! with skopeo (the registry must store exactly the built digest).
//!
//! The manifest and index are written field by field, in the order and spacing the images have
//! always had, so an unchanged config and layer keep their manifest digest.

use crate::gzip;
use crate::log::Log;
use crate::tools;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// `sha256:<hex>` of some bytes.
pub fn digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// A built image: its blobs (config, layer, manifest) and what names them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    /// The layout's `org.opencontainers.image.ref.name` (maas-filter, maas-companion).
    pub ref_name: String,
    pub config: Vec<u8>,
    pub layer: Vec<u8>,
    pub manifest: Vec<u8>,
    pub index: Vec<u8>,
}

/// The uncompressed layer's digest (the config's `rootfs.diff_ids` entry) and the gzip layer.
pub fn layer(tar: &[u8]) -> Result<(String, Vec<u8>), String> {
    Ok((digest(tar), gzip::compress(tar)?))
}

impl Image {
    /// Assembles the manifest and index around a config and a gzip layer. `layer_annotations`
    /// is the layer descriptor's `annotations` object (already JSON), or none.
    pub fn new(
        ref_name: &str,
        config: Vec<u8>,
        layer: Vec<u8>,
        layer_annotations: Option<&str>,
    ) -> Image {
        let annotations = layer_annotations
            .map(|a| format!(",\"annotations\":{a}"))
            .unwrap_or_default();
        let manifest = format!(
            "{{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\
             \"config\":{{\"mediaType\":\"application/vnd.oci.image.config.v1+json\",\"digest\":\"{}\",\"size\":{}}},\
             \"layers\":[{{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar+gzip\",\"digest\":\"{}\",\"size\":{}{annotations}}}]}}",
            digest(&config),
            config.len(),
            digest(&layer),
            layer.len()
        )
        .into_bytes();
        let index = format!(
            "{{\"schemaVersion\":2,\"manifests\":[{{\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\
             \"digest\":\"{}\",\"size\":{},\"annotations\":{{\"org.opencontainers.image.ref.name\":\"{ref_name}\"}}}}]}}",
            digest(&manifest),
            manifest.len()
        )
        .into_bytes();
        Image {
            ref_name: ref_name.to_string(),
            config,
            layer,
            manifest,
            index,
        }
    }

    /// The digest the image is pinned by (its manifest's).
    pub fn digest(&self) -> String {
        digest(&self.manifest)
    }

    /// Writes the OCI image layout into `dir` (which must exist).
    pub fn write_layout(&self, dir: &Path) -> Result<(), String> {
        let blobs = dir.join("blobs/sha256");
        std::fs::create_dir_all(&blobs).map_err(|e| format!("{}: {e}", blobs.display()))?;
        for blob in [&self.config, &self.layer, &self.manifest] {
            let name = digest(blob).trim_start_matches("sha256:").to_string();
            write(&blobs.join(name), blob)?;
        }
        write(
            &dir.join("oci-layout"),
            b"{\"imageLayoutVersion\":\"1.0.0\"}",
        )?;
        write(&dir.join("index.json"), &self.index)
    }
}

fn write(path: &Path, bytes: &[u8]) -> Result<(), String> {
    std::fs::write(path, bytes).map_err(|e| format!("writing {}: {e}", path.display()))
}

/// Where and how to publish an image.
pub struct Publish {
    /// Also keep the layout here (replaced).
    pub oci_dir: Option<PathBuf>,
    /// Push to this reference (REGISTRY/REPOSITORY:TAG), or only print the digest.
    pub push: Option<String>,
    pub tls_verify: bool,
    pub authfile: Option<PathBuf>,
    /// Printed before the pinned reference after a push.
    pub hint: String,
}

/// Writes the layout, keeps a copy when asked, pushes when asked; returns the pinned
/// reference (`IMAGE@sha256:…`), or the digest without a push.
pub fn publish(image: &Image, how: &Publish, log: &Log) -> Result<String, String> {
    let work = tempfile::tempdir().map_err(|e| format!("a temporary directory: {e}"))?;
    let layout = work.path().join("layout");
    image.write_layout(&layout)?;
    let digest = image.digest();
    log.info(&format!("image manifest {digest}"));
    if let Some(dir) = &how.oci_dir {
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(|e| format!("removing {}: {e}", dir.display()))?;
        }
        image.write_layout(dir)?;
        log.info(&format!(
            "OCI layout in {} (reference oci:{}:{})",
            dir.display(),
            dir.display(),
            image.ref_name
        ));
    }
    let Some(target) = &how.push else {
        return Ok(digest);
    };
    let digest_file = work.path().join("pushed-digest");
    let mut args = vec![
        "copy".to_string(),
        "--quiet".to_string(),
        "--preserve-digests".to_string(),
        "--digestfile".to_string(),
        digest_file.display().to_string(),
        format!("--dest-tls-verify={}", how.tls_verify),
    ];
    if let Some(authfile) = &how.authfile {
        args.push("--dest-authfile".to_string());
        args.push(authfile.display().to_string());
    }
    args.push(format!("oci:{}:{}", layout.display(), image.ref_name));
    args.push(format!("docker://{target}"));
    log.info(&format!("pushing docker://{target}"));
    tools::run_to_stderr("skopeo", &args, None, &[])
        .map_err(|_| format!("pushing to {target} failed"))?;
    let pushed = std::fs::read_to_string(&digest_file).unwrap_or_default();
    if pushed.trim() != digest {
        return Err(format!(
            "the registry stored {}, not the built {digest}",
            pushed.trim()
        ));
    }
    let repository = target.rsplit_once(':').map_or(target.as_str(), |(r, _)| r);
    let pinned = format!("{repository}@{digest}");
    log.info(&format!("pushed; {}{pinned}", how.hint));
    Ok(pinned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn image(layer: &[u8]) -> Image {
        let (diff_id, gz) = super::layer(layer).unwrap();
        let config = format!("{{\"rootfs\":{{\"diff_ids\":[\"{diff_id}\"]}}}}").into_bytes();
        Image::new(
            "maas-filter",
            config,
            gz,
            Some(r#"{"org.opencontainers.image.title":"plugin.wasm"}"#),
        )
    }

    #[test]
    fn the_manifest_names_its_blobs_by_digest_and_size() {
        let img = image(b"some tar bytes");
        let m: Value = serde_json::from_slice(&img.manifest).unwrap();
        assert_eq!(m["config"]["digest"], digest(&img.config));
        assert_eq!(m["config"]["size"], img.config.len());
        assert_eq!(m["layers"][0]["digest"], digest(&img.layer));
        assert_eq!(m["layers"][0]["size"], img.layer.len());
        assert_eq!(
            m["layers"][0]["annotations"]["org.opencontainers.image.title"],
            "plugin.wasm"
        );
        let index: Value = serde_json::from_slice(&img.index).unwrap();
        assert_eq!(index["manifests"][0]["digest"], img.digest());
        assert_eq!(index["manifests"][0]["size"], img.manifest.len());
        assert_eq!(
            index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"],
            "maas-filter"
        );
    }

    /// The manifest's bytes as the images have always had them (a config and a layer of known
    /// digests give a known manifest digest).
    #[test]
    fn the_manifest_bytes_keep_their_shape() {
        let img = Image::new("x", b"{}".to_vec(), b"layer".to_vec(), None);
        let expected = format!(
            "{{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"config\":{{\"mediaType\":\"application/vnd.oci.image.config.v1+json\",\"digest\":\"{}\",\"size\":2}},\"layers\":[{{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar+gzip\",\"digest\":\"{}\",\"size\":5}}]}}",
            digest(b"{}"),
            digest(b"layer")
        );
        assert_eq!(String::from_utf8(img.manifest).unwrap(), expected);
    }

    #[test]
    fn two_builds_are_equal_and_other_content_differs() {
        assert_eq!(image(b"tar"), image(b"tar"));
        assert_ne!(image(b"tar").digest(), image(b"tar2").digest());
    }

    #[test]
    fn the_layout_holds_every_blob_under_its_digest() {
        let img = image(b"tar");
        let dir = tempfile::tempdir().unwrap();
        img.write_layout(dir.path()).unwrap();
        for blob in [&img.config, &img.layer, &img.manifest] {
            let name = digest(blob).replace("sha256:", "");
            assert_eq!(
                &std::fs::read(dir.path().join("blobs/sha256").join(name)).unwrap(),
                blob
            );
        }
        assert_eq!(
            std::fs::read(dir.path().join("index.json")).unwrap(),
            img.index
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("oci-layout")).unwrap(),
            r#"{"imageLayoutVersion":"1.0.0"}"#
        );
    }
}
