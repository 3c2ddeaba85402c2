//! A tar archive in exactly the bytes GNU tar writes with `--format=ustar --sort=name
//! --owner=0 --group=0 --numeric-owner --mtime='1970-01-01 00:00:00Z'`: owners 0/0, no user or
//! group names, mtime 0, no pax records (no atime/ctime), octal fields zero-padded as GNU pads
//! them, the archive closed by two zero blocks and padded to a 10 KiB record. Nothing in it
//! depends on who built it, when, where or with which umask.
//!
//! Hand-written rather than the `tar` crate: the layer's digest is what the image is pinned by,
//! and it must equal GNU tar's byte for byte (the crate writes the checksum field and the
//! device numbers differently and does not pad to the record).

use std::collections::BTreeMap;

const BLOCK: usize = 512;
/// GNU tar's default record: 20 blocks.
const RECORD: usize = 20 * BLOCK;
const NAME_LEN: usize = 100;
const PREFIX_LEN: usize = 155;

/// One archive member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// A directory (its name gets a trailing `/`).
    Dir { path: String, mode: u32 },
    /// A regular file.
    File {
        path: String,
        mode: u32,
        data: Vec<u8>,
    },
}

impl Entry {
    fn path(&self) -> &str {
        match self {
            Entry::Dir { path, .. } | Entry::File { path, .. } => path,
        }
    }
}

/// A directory tree in memory: members by their path components, so that walking it yields
/// GNU tar's `--sort=name` order (each directory, then its members sorted bytewise).
#[derive(Debug, Default, Clone)]
pub struct Tree {
    children: BTreeMap<String, Node>,
}

#[derive(Debug, Clone)]
enum Node {
    Dir { mode: u32, tree: Tree },
    File { mode: u32, data: Vec<u8> },
}

impl Tree {
    /// Adds a directory (and any missing parents, with `mode`); an existing one keeps its
    /// members and takes `mode`.
    pub fn dir(&mut self, path: &str, mode: u32) -> Result<(), String> {
        let (tree, name) = self.parent_of(path, mode)?;
        match tree.children.get_mut(name) {
            Some(Node::Dir { mode: m, .. }) => *m = mode,
            Some(Node::File { .. }) => return Err(format!("{path} is a file, not a directory")),
            None => {
                tree.children.insert(
                    name.to_string(),
                    Node::Dir {
                        mode,
                        tree: Tree::default(),
                    },
                );
            }
        }
        Ok(())
    }

    /// Adds a file; its missing parent directories get mode 0755.
    pub fn file(&mut self, path: &str, mode: u32, data: Vec<u8>) -> Result<(), String> {
        let (tree, name) = self.parent_of(path, 0o755)?;
        if tree.children.contains_key(name) {
            return Err(format!("{path} is added twice"));
        }
        tree.children
            .insert(name.to_string(), Node::File { mode, data });
        Ok(())
    }

    /// The directory holding `path` (created as needed) and the last component.
    fn parent_of<'a>(&mut self, path: &'a str, mode: u32) -> Result<(&mut Tree, &'a str), String> {
        let parts: Vec<&str> = path.split('/').collect();
        if parts
            .iter()
            .any(|p| p.is_empty() || *p == "." || *p == "..")
        {
            return Err(format!("'{path}' is not a relative path without . or .."));
        }
        let (name, dirs) = parts
            .split_last()
            .ok_or_else(|| "an empty path".to_string())?;
        let mut tree = self;
        for dir in dirs {
            let node = tree
                .children
                .entry((*dir).to_string())
                .or_insert_with(|| Node::Dir {
                    mode,
                    tree: Tree::default(),
                });
            tree = match node {
                Node::Dir { tree, .. } => tree,
                Node::File { .. } => return Err(format!("{dir} in {path} is a file")),
            };
        }
        Ok((tree, name))
    }

    /// The members in archive order.
    pub fn entries(&self) -> Vec<Entry> {
        let mut out = Vec::new();
        self.walk("", &mut out);
        out
    }

    fn walk(&self, prefix: &str, out: &mut Vec<Entry>) {
        for (name, node) in &self.children {
            let path = format!("{prefix}{name}");
            match node {
                Node::Dir { mode, tree } => {
                    out.push(Entry::Dir {
                        path: path.clone(),
                        mode: *mode,
                    });
                    tree.walk(&format!("{path}/"), out);
                }
                Node::File { mode, data } => out.push(Entry::File {
                    path,
                    mode: *mode,
                    data: data.clone(),
                }),
            }
        }
    }
}

/// `value` in octal, zero-padded to `digits`, then a NUL: GNU tar's numeric fields.
fn octal(field: &mut [u8], value: u64, digits: usize) -> Result<(), String> {
    let text = format!("{value:0digits$o}");
    if text.len() != digits {
        return Err(format!(
            "{value} does not fit a tar field of {digits} octal digits"
        ));
    }
    field
        .get_mut(..digits)
        .ok_or("a tar field too short")?
        .copy_from_slice(text.as_bytes());
    Ok(())
}

/// Where GNU tar splits a name longer than the name field: at the last `/` that leaves at most
/// 155 bytes of prefix and at most 100 of name (`split_long_name` in GNU tar's create.c).
fn split_long_name(name: &str) -> Result<(&str, &str), String> {
    let bytes = name.as_bytes();
    let mut limit = bytes.len();
    if limit > PREFIX_LEN + 1 {
        limit = PREFIX_LEN + 1;
    } else if bytes.last() == Some(&b'/') {
        limit -= 1;
    }
    let split = (1..limit).rev().find(|&i| bytes.get(i) == Some(&b'/'));
    match split {
        Some(i) if bytes.len() - i - 1 <= NAME_LEN && bytes.len() - i - 1 > 0 => {
            Ok((&name[..i], &name[i + 1..]))
        }
        _ => Err(format!("{name}: file name is too long (cannot be split)")),
    }
}

fn header(entry: &Entry) -> Result<[u8; BLOCK], String> {
    let mut h = [0u8; BLOCK];
    let (name, mode, size, kind) = match entry {
        Entry::Dir { path, mode } => (format!("{path}/"), *mode, 0u64, b'5'),
        Entry::File { path, mode, data } => (path.clone(), *mode, data.len() as u64, b'0'),
    };
    let (prefix, short) = if name.len() > NAME_LEN {
        split_long_name(&name)?
    } else {
        ("", name.as_str())
    };
    h[..short.len()].copy_from_slice(short.as_bytes());
    octal(&mut h[100..108], u64::from(mode & 0o7777), 7)?;
    octal(&mut h[108..116], 0, 7)?; // uid
    octal(&mut h[116..124], 0, 7)?; // gid
    octal(&mut h[124..136], size, 11)?;
    octal(&mut h[136..148], 0, 11)?; // mtime: 1970-01-01
    h[156] = kind;
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    octal(&mut h[329..337], 0, 7)?; // devmajor
    octal(&mut h[337..345], 0, 7)?; // devminor
    h[345..345 + prefix.len()].copy_from_slice(prefix.as_bytes());
    // The checksum counts its own field as spaces; written as 6 octal digits, NUL, space.
    h[148..156].copy_from_slice(b"        ");
    let sum: u64 = h.iter().map(|b| u64::from(*b)).sum();
    octal(&mut h[148..154], sum, 6)?;
    h[154] = 0;
    h[155] = b' ';
    Ok(h)
}

/// The archive of `entries`, in the order given.
pub fn archive(entries: &[Entry]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    for entry in entries {
        if entry.path().is_empty() {
            return Err("a tar member without a name".to_string());
        }
        out.extend_from_slice(&header(entry)?);
        if let Entry::File { data, .. } = entry {
            out.extend_from_slice(data);
            out.resize(out.len().div_ceil(BLOCK) * BLOCK, 0);
        }
    }
    out.resize(out.len() + 2 * BLOCK, 0);
    out.resize(out.len().div_ceil(RECORD) * RECORD, 0);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    fn sha256(bytes: &[u8]) -> String {
        hex::encode(Sha256::digest(bytes))
    }

    /// GNU tar 1.34's bytes for the filter's layer of the 8-byte module `\0asm\1\0\0\0`:
    /// `tar --format=ustar --sort=name --owner=0 --group=0 --numeric-owner --mode=0644
    /// --mtime='1970-01-01 00:00:00Z' -cf - plugin.wasm`.
    const GNU_WASM_LAYER: &str = "b87b1877ccc535f2aef59394dd5c37d12ca975ae49f372591e359c4926ea5937";

    /// GNU tar 1.34's bytes for a small companion tree (`companion_like_tree` below, the same
    /// flags without --mode, directories 0755, /tmp 1777, files 0644, the binary 0755), with a
    /// 128-byte name that goes into the prefix field.
    const GNU_COMPANION_LAYER: &str =
        "4200e9cb719238dcddeaf5077ac7acf4704518d5c15ca047a543b2f873a19472";

    fn companion_like_tree() -> Tree {
        let mut t = Tree::default();
        let ui = "usr/share/maas-companion/ui";
        t.file(
            "etc/passwd",
            0o644,
            b"root:x:0:0:root:/:/sbin/nologin\nmaas:x:65532:65532:maas-companion:/:/sbin/nologin\n"
                .to_vec(),
        )
        .unwrap();
        t.file("etc/group", 0o644, b"root:x:0:\nmaas:x:65532:\n".to_vec())
            .unwrap();
        t.file(
            "etc/ssl/certs/ca-certificates.crt",
            0o644,
            b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n".to_vec(),
        )
        .unwrap();
        t.dir("tmp", 0o1777).unwrap();
        t.file("usr/local/bin/maas-companion", 0o755, vec![b'x'; 3000])
            .unwrap();
        t.file(
            &format!("{ui}/index.html"),
            0o644,
            b"<html><div id=\"root\"></div></html>\n".to_vec(),
        )
        .unwrap();
        t.file(
            &format!("{ui}/assets/index-AbC_1.js"),
            0o644,
            b"console.log(1)\n".to_vec(),
        )
        .unwrap();
        t.file(&format!("{ui}/assets/index-Ab.css"), 0o644, b"b\n".to_vec())
            .unwrap();
        t.file(
            &format!("{ui}/assets/{}.js", "n".repeat(90)),
            0o644,
            b"long\n".to_vec(),
        )
        .unwrap();
        t.file(&format!("{ui}/.hidden"), 0o644, b"dot\n".to_vec())
            .unwrap();
        t
    }

    #[test]
    fn the_filter_layer_is_gnu_tars_bytes() {
        let entries = [Entry::File {
            path: "plugin.wasm".into(),
            mode: 0o644,
            data: b"\0asm\x01\0\0\0".to_vec(),
        }];
        let bytes = archive(&entries).unwrap();
        assert_eq!(bytes.len(), RECORD);
        assert_eq!(sha256(&bytes), GNU_WASM_LAYER);
    }

    #[test]
    fn a_companion_tree_is_gnu_tars_bytes_in_gnu_tars_order() {
        let entries = companion_like_tree().entries();
        let names: Vec<&str> = entries.iter().map(Entry::path).collect();
        assert_eq!(
            &names[..8],
            [
                "etc",
                "etc/group",
                "etc/passwd",
                "etc/ssl",
                "etc/ssl/certs",
                "etc/ssl/certs/ca-certificates.crt",
                "tmp",
                "usr"
            ]
        );
        let bytes = archive(&entries).unwrap();
        assert_eq!(sha256(&bytes), GNU_COMPANION_LAYER);
    }

    #[test]
    fn the_same_tree_gives_the_same_bytes_and_another_other_bytes() {
        let a = archive(&companion_like_tree().entries()).unwrap();
        assert_eq!(a, archive(&companion_like_tree().entries()).unwrap());
        let mut other = companion_like_tree();
        other.file("etc/hosts", 0o644, b"x".to_vec()).unwrap();
        assert_ne!(a, archive(&other.entries()).unwrap());
    }

    #[test]
    fn headers_hold_gnu_fields() {
        let h = header(&Entry::Dir {
            path: "tmp".into(),
            mode: 0o1777,
        })
        .unwrap();
        assert_eq!(&h[..5], b"tmp/\0");
        assert_eq!(&h[100..108], b"0001777\0");
        assert_eq!(&h[124..136], b"00000000000\0");
        assert_eq!(h[156], b'5');
        assert_eq!(&h[257..265], b"ustar\x0000");
        assert_eq!(&h[329..345], b"0000000\x000000000\0");
        assert_eq!(h[154..156], [0, b' ']);
    }

    #[test]
    fn names_too_long_to_split_are_refused() {
        let long = format!("{}/x", "d".repeat(200));
        assert!(split_long_name(&long).is_err());
        let name_too_long = format!("a/{}", "n".repeat(101));
        assert!(split_long_name(&name_too_long).is_err());
        assert_eq!(
            split_long_name(&format!("a/b/{}", "n".repeat(99))).unwrap(),
            ("a/b", "n".repeat(99).as_str())
        );
    }

    #[test]
    fn paths_must_be_plain_relative() {
        let mut t = Tree::default();
        assert!(t.file("/etc/x", 0o644, vec![]).is_err());
        assert!(t.file("a/../b", 0o644, vec![]).is_err());
        t.file("a/b", 0o644, vec![]).unwrap();
        assert!(t.file("a/b", 0o644, vec![]).is_err());
        assert!(t.file("a/b/c", 0o644, vec![]).is_err());
    }
}
