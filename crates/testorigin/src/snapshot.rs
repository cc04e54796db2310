//! One commit's files: a flat directory, hashed once so that every request can answer with
//! sizes, ETags and LFS object ids without reading the files again.

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// A file of a commit as the Hub describes it.
#[derive(Debug, Clone)]
pub(crate) struct FileEntry {
    pub path: PathBuf,
    pub size: u64,
    pub sha256: String,
    /// The git blob id of what the repo stores: the file itself, or its LFS pointer.
    pub blob_id: String,
    /// `Some(pointer size)` for LFS files, which the Hub redirects to its CDN.
    pub lfs_pointer_size: Option<u64>,
}

#[derive(Debug)]
pub(crate) struct Snapshot {
    pub files: BTreeMap<String, FileEntry>,
}

impl Snapshot {
    /// Hashes every regular file of `dir` and of its folders one level down (a repository's
    /// `figures/`, say), named `folder/file` as the Hub names them.
    pub(crate) fn scan(dir: &Path) -> io::Result<Snapshot> {
        let mut files = BTreeMap::new();
        scan_into(dir, "", &mut files, 1)?;
        Ok(Snapshot { files })
    }
}

/// The pointer file git-lfs commits in place of the object (its length is `pointerSize`).
fn lfs_pointer(sha256: &str, size: u64) -> String {
    format!("version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n")
}

/// Git's blob id, as the Hub reports it: sha1 of `blob <len>\0` and the content (a client may
/// verify a small file against it).
fn git_blob_id(content: &[u8]) -> String {
    use sha1::Digest as _;
    let mut h = sha1::Sha1::new();
    h.update(format!("blob {}\0", content.len()).as_bytes());
    h.update(content);
    hex(&h.finalize())
}

/// Size and sha256 of a file, read in 1 MiB pieces (bench checkpoints are gigabytes).
fn hash_file(path: &Path) -> io::Result<(u64, String)> {
    let mut file = fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        size += n as u64;
    }
    Ok((size, hex(&h.finalize())))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// sha256 of a string, hex: used for repeatable fake commit ids.
pub(crate) fn sha256_hex(s: &str) -> String {
    hex(&Sha256::digest(s.as_bytes()))
}

/// Add the files of `dir` to `files`, names prefixed with `prefix`; folders `depth` levels down.
fn scan_into(dir: &Path, prefix: &str, files: &mut BTreeMap<String, FileEntry>, depth: usize) -> io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        let Ok(name) = entry.file_name().into_string() else {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{path:?}: not UTF-8")));
        };
        // `fs::metadata` follows symlinks, so a directory of links to a big checkpoint works.
        let meta = fs::metadata(&path)?;
        if meta.is_dir() {
            if depth > 0 {
                scan_into(&path, &format!("{prefix}{name}/"), files, depth - 1)?;
            }
            continue;
        }
        if !meta.is_file() {
            continue;
        }
        let (size, sha256) = hash_file(&path)?;
        // Like the Hub's default .gitattributes for our fixtures: weights go through LFS.
        let lfs = name.ends_with(".safetensors");
        let (blob_id, lfs_pointer_size) = if lfs {
            let pointer = lfs_pointer(&sha256, size);
            (git_blob_id(pointer.as_bytes()), Some(pointer.len() as u64))
        } else {
            (git_blob_id(&fs::read(&path)?), None)
        };
        files.insert(format!("{prefix}{name}"), FileEntry { path, size, sha256, blob_id, lfs_pointer_size });
    }
    Ok(())
}
