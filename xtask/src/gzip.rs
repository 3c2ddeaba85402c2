//! The layer's compression: gzip at the best level with no file name and mtime 0 (like
//! `gzip -9 -n`), so the compressed bytes depend only on the tar's bytes and on the deflate
//! implementation pinned in Cargo.lock (miniz_oxide), not on the machine's gzip.

use flate2::{Compression, GzBuilder};
use std::io::Write;

/// The gzip member of `data`: header `1f 8b 08 00 00000000 02 03` (no name, mtime 0, best
/// compression, Unix), deflate, CRC-32 and size.
pub fn compress(data: &[u8]) -> Result<Vec<u8>, String> {
    let mut encoder = GzBuilder::new()
        .mtime(0)
        .operating_system(3)
        .write(Vec::new(), Compression::best());
    encoder.write_all(data).map_err(|e| format!("gzip: {e}"))?;
    encoder.finish().map_err(|e| format!("gzip: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::read::GzDecoder;
    use sha2::{Digest, Sha256};
    use std::io::Read;

    fn sample() -> Vec<u8> {
        (0..200_000u32)
            .map(|i| (i % 251) as u8 ^ (i / 7) as u8)
            .collect()
    }

    #[test]
    fn round_trips_with_a_fixed_header() {
        let data = sample();
        let gz = compress(&data).unwrap();
        assert_eq!(gz[..10], [0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 2, 3]);
        let mut back = Vec::new();
        GzDecoder::new(&gz[..]).read_to_end(&mut back).unwrap();
        assert_eq!(back, data);
        assert!(gz.len() < data.len());
    }

    #[test]
    fn the_same_bytes_compress_the_same() {
        assert_eq!(compress(&sample()).unwrap(), compress(&sample()).unwrap());
    }

    /// The compressed bytes of a fixed input. If a dependency update (flate2, miniz_oxide)
    /// changes how it compresses, this fails: every image digest changes with it, so that
    /// update must say so (docs/deploy.md, "Images").
    #[test]
    fn the_deflate_output_is_pinned() {
        let digest = hex::encode(Sha256::digest(compress(&sample()).unwrap()));
        assert_eq!(digest, PINNED);
    }

    const PINNED: &str = "d7afc6ded80efaff80b65e3fda406c62f8cb52b22da2246df3e5398390b65225";
}
