//! Where a checkpoint is fetched from, and the pinned list of its files.
//!
//! Two kinds of origin speak the same ranged GETs:
//! - `hub`: the Hugging Face Hub (or anything with its API and URL layout: a mirror endpoint set
//!   through `HF_ENDPOINT`). The file list, sizes and sha256 come from
//!   `/api/models/{repo}/revision/{rev}`; the commit is pinned from `X-Repo-Commit`, and every
//!   file is then fetched at `/{repo}/resolve/{commit}/{file}`, so a branch that moves during
//!   the install cannot mix two revisions.
//! - `mirror`: a plain HTTP directory holding a snapshot's files (an nginx `root`, an
//!   S3-compatible bucket): `{url}/{file}`. The file list comes from the checkpoint's own index;
//!   sizes from `Range: bytes=0-0`; sha256 from a `SHA256SUMS` file beside them when there is
//!   one (`sha256sum * > SHA256SUMS`).

use std::collections::BTreeMap;

use anyhow::{Context, Result, bail};
use deltafin_store::manifest::{OriginFile, OriginInfo};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::http::Http;

pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Files a mirror is asked for beside the index and its shards (absent ones are skipped).
const MIRROR_EXTRAS: [&str; 6] = [
    "config.json",
    "generation_config.json",
    "tiktoken.model",
    "tokenizer_config.json",
    "tokenization_kimi.py",
    "encoding_k3.py",
];
/// Small JSON answers (the API, an index) are refused beyond this.
const SMALL_CAP: u64 = 256 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OriginKind {
    Hub,
    Mirror,
}

impl OriginKind {
    pub fn name(self) -> &'static str {
        match self {
            OriginKind::Hub => "hub",
            OriginKind::Mirror => "mirror",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "hub" => Ok(OriginKind::Hub),
            "mirror" => Ok(OriginKind::Mirror),
            _ => bail!("unknown origin kind '{s}' (hub or mirror)"),
        }
    }
}

/// An origin and a repository on it.
#[derive(Debug, Clone)]
pub struct Remote {
    pub kind: OriginKind,
    /// Without a trailing slash.
    pub endpoint: String,
    pub repo: String,
}

impl Remote {
    pub fn new(kind: OriginKind, endpoint: &str, repo: &str) -> Result<Self> {
        let ok = |s: &str| {
            !s.is_empty() && s != "." && s != ".." && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        match repo.split_once('/') {
            Some((org, name)) if ok(org) && ok(name) => {}
            _ => bail!("'{repo}' is not a repository name of the form org/name"),
        }
        Ok(Remote { kind, endpoint: endpoint.trim_end_matches('/').to_string(), repo: repo.to_string() })
    }

    /// Where `file` of `commit` is read.
    pub fn file_url(&self, commit: &str, file: &str) -> String {
        match self.kind {
            OriginKind::Hub => format!("{}/{}/resolve/{commit}/{file}", self.endpoint, self.repo),
            OriginKind::Mirror => format!("{}/{file}", self.endpoint),
        }
    }
}

#[derive(Deserialize)]
struct ApiInfo {
    sha: Option<String>,
    #[serde(default)]
    siblings: Vec<ApiSibling>,
}

#[derive(Deserialize)]
struct ApiSibling {
    rfilename: String,
    size: Option<u64>,
    #[serde(rename = "blobId")]
    blob_id: Option<String>,
    lfs: Option<ApiLfs>,
}

#[derive(Deserialize)]
struct ApiLfs {
    sha256: String,
    size: u64,
}

/// A file name from an origin must be a plain name inside the snapshot: it becomes a path.
fn safe_name(n: &str) -> bool {
    !n.is_empty()
        && !n.starts_with('/')
        && !n.contains('\\')
        && n.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
}

fn is_hex(s: &str, n: usize) -> bool {
    s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Pin `revision` of the repository: its commit and its files, sizes and hashes.
pub fn resolve(http: &Http, remote: &Remote, revision: &str) -> Result<OriginInfo> {
    let (files, index, sums) = match remote.kind {
        OriginKind::Hub => return resolve_hub(http, remote, revision),
        OriginKind::Mirror => mirror_files(http, remote)?,
    };
    // A mirror has no commits: the snapshot is named by what identifies its content (the
    // index, the published sums, and every file's size and validator), so a changed mirror is a
    // new snapshot; and each response must carry the validator pinned here, so a file that
    // changes during an install is refused rather than mixed in.
    let mut h = Sha256::new();
    h.update(&index);
    h.update(&sums);
    for f in &files {
        h.update(format!("{}\0{}\0{}\n", f.name, f.size, f.validator.as_deref().unwrap_or("")).as_bytes());
    }
    let commit = hex(&h.finalize())[..40].to_string();
    Ok(OriginInfo {
        kind: remote.kind.name().into(),
        endpoint: remote.endpoint.clone(),
        repo: remote.repo.clone(),
        revision: revision.into(),
        commit,
        files,
    })
}

fn resolve_hub(http: &Http, remote: &Remote, revision: &str) -> Result<OriginInfo> {
    if !revision.chars().all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c)) || revision.contains("..") {
        bail!("'{revision}' is not a revision name");
    }
    let rev_enc = revision.replace('/', "%2F");
    let url = format!("{}/api/models/{}/revision/{rev_enc}?blobs=true", remote.endpoint, remote.repo);
    let (body, headers) = http.get_small(&url, &format!("{}@{revision} (file list)", remote.repo), SMALL_CAP)?;
    let info: ApiInfo = serde_json::from_slice(&body).context("the Hub's file list is not the JSON it should be")?;
    let commit = headers
        .get("x-repo-commit")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or(info.sha)
        .context("the Hub named no commit for this revision (no X-Repo-Commit)")?;
    if !is_hex(&commit, 40) {
        bail!("the Hub's commit id '{commit}' is not 40 hex digits");
    }
    let mut files = Vec::new();
    for s in info.siblings {
        if !safe_name(&s.rfilename) {
            bail!("the Hub lists a file named '{}', which is not a plain relative name", s.rfilename);
        }
        let (size, sha256) = match s.lfs {
            Some(l) if is_hex(&l.sha256, 64) => (l.size, Some(l.sha256.to_ascii_lowercase())),
            Some(_) => bail!("the Hub's sha256 of {} is not 64 hex digits", s.rfilename),
            None => (s.size.with_context(|| format!("the Hub gave no size for {}", s.rfilename))?, None),
        };
        let blob = s.blob_id.filter(|b| b.bytes().all(|c| c.is_ascii_alphanumeric()) && !b.is_empty());
        files.push(OriginFile { name: s.rfilename, size, sha256, blob, validator: None });
    }
    Ok(OriginInfo {
        kind: remote.kind.name().into(),
        endpoint: remote.endpoint.clone(),
        repo: remote.repo.clone(),
        revision: revision.into(),
        commit: commit.to_ascii_lowercase(),
        files,
    })
}

/// A mirror's files (the index, the shards it names, and the usual small files it has), its
/// index and its SHA256SUMS (empty when it has none).
fn mirror_files(http: &Http, remote: &Remote) -> Result<(Vec<OriginFile>, Vec<u8>, Vec<u8>)> {
    let (index, _) = http.get_small(&remote.file_url("", INDEX_FILE), INDEX_FILE, SMALL_CAP)?;
    let shards = shard_names(&index)?;
    let raw_sums = match http.get_small(&remote.file_url("", "SHA256SUMS"), "SHA256SUMS", SMALL_CAP) {
        Ok((b, _)) => b,
        Err(e) if e.to_string().contains("404") => Vec::new(),
        Err(e) => return Err(e),
    };
    let sums = parse_sums(&String::from_utf8_lossy(&raw_sums));
    let mut names: Vec<String> = vec![INDEX_FILE.into()];
    names.extend(shards);
    let mut files = Vec::new();
    for n in MIRROR_EXTRAS.iter().map(|s| s.to_string()).chain(names) {
        let url = remote.file_url("", &n);
        let (size, validator) = match http.size_of(&url, &n) {
            Ok(s) => s,
            Err(e) if MIRROR_EXTRAS.contains(&n.as_str()) && e.to_string().contains("404") => continue,
            Err(e) => return Err(e),
        };
        let sha256 = sums.get(&n).cloned();
        files.push(OriginFile { name: n, size, sha256, blob: None, validator });
    }
    Ok((files, index, raw_sums))
}

/// The shard files an index names, sorted.
pub fn shard_names(index: &[u8]) -> Result<Vec<String>> {
    let v: serde_json::Value = serde_json::from_slice(index).context("model.safetensors.index.json is not JSON")?;
    let wm = v.get("weight_map").and_then(|w| w.as_object()).context("the index has no weight_map")?;
    let mut names: Vec<String> = Vec::new();
    for f in wm.values() {
        let f = f.as_str().context("the index's weight_map names a non-string file")?;
        if !safe_name(f) || f.contains('/') {
            bail!("the index names a shard '{f}' outside the snapshot");
        }
        if !names.iter().any(|n| n == f) {
            names.push(f.to_string());
        }
    }
    names.sort();
    Ok(names)
}

/// `sha256sum` output: `<64 hex>  <name>` (or ` *<name>`) per line.
fn parse_sums(text: &str) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    for line in text.lines() {
        if let Some((h, n)) = line.split_once(char::is_whitespace) {
            let n = n.trim_start().trim_start_matches('*');
            if is_hex(h, 64) && safe_name(n) {
                m.insert(n.to_string(), h.to_ascii_lowercase());
            }
        }
    }
    m
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_sums() {
        assert!(safe_name("a/b.json") && !safe_name("../x") && !safe_name("/etc") && !safe_name("a//b"));
        let s = parse_sums(&format!("{}  model.safetensors\n{} *b.json\nnonsense\n", "A".repeat(64), "b".repeat(64)));
        assert_eq!(s.get("model.safetensors").map(String::as_str), Some(&*"a".repeat(64)));
        assert!(s.contains_key("b.json"));
        assert!(Remote::new(OriginKind::Hub, "http://x/", "org/../x").is_err());
        let r = Remote::new(OriginKind::Hub, "http://x/", "org/name").unwrap();
        assert_eq!(r.file_url("c0ffee", "config.json"), "http://x/org/name/resolve/c0ffee/config.json");
        let idx = br#"{"weight_map": {"a": "s2.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}}"#;
        assert_eq!(shard_names(idx).unwrap(), vec!["s1.safetensors", "s2.safetensors"]);
        assert!(shard_names(br#"{"weight_map": {"a": "../x"}}"#).is_err());
    }
}
