//! Where an installed store keeps what it fetched.
//!
//! ```text
//! STORE/
//!   manifest.json spine.bin tokenizer files   the Deltafin store (written by convert)
//!   presence.bin                              stream mode: which experts are on disk
//!   checkpoint/<file>                         the checkpoint as the store reads it: one link per
//!                                             file, to its partial or its finished blob
//!   hub/models--ORG--NAME/                    a Hugging Face cache (HF_HUB_CACHE=STORE/hub):
//!     blobs/<sha256 or blob id>               finished, verified files only
//!     blobs/<id>.deltafin-partial             files still being filled (sparse)
//!     snapshots/<commit>/<file> -> ../../blobs/<id>
//!     refs/<revision>                         the commit
//!   .deltafin/origin.json                     the pinned origin (a rerun resumes it)
//!   .deltafin/fill/<file>.fill                which ranges of a partial file are on disk
//!   .deltafin/sums/<file>.json                expert checksums of a verified shard
//! ```
//! A partial blob never has a name a Hub client would take for a finished one: huggingface_hub
//! links any `blobs/<etag>` it finds, so only verified files get that name.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use deltafin_store::manifest::{OriginFile, OriginInfo};

pub const PARTIAL_SUFFIX: &str = ".deltafin-partial";

pub struct Layout {
    pub store: PathBuf,
    /// `STORE/hub/models--ORG--NAME`.
    pub repo_dir: PathBuf,
}

/// The Hub cache's folder name of a repository.
pub fn repo_folder(repo: &str) -> String {
    format!("models--{}", repo.replace('/', "--"))
}

/// The name a file's blob has in a Hub cache: its sha256 (LFS), else its git blob id; a
/// mirror's file without a published hash gets a name derived from its name and size.
pub fn blob_id(f: &OriginFile) -> String {
    if let Some(s) = &f.sha256 {
        return s.clone();
    }
    if let Some(b) = &f.blob {
        return b.clone();
    }
    use sha2::Digest;
    let d = sha2::Sha256::digest(format!("{}\0{}", f.name, f.size));
    format!("unverified-{}", &crate::remote::hex(&d)[..40])
}

impl Layout {
    pub fn new(store: &Path, repo: &str) -> Self {
        Layout { store: store.to_path_buf(), repo_dir: store.join("hub").join(repo_folder(repo)) }
    }

    pub fn hub_cache(&self) -> PathBuf {
        self.store.join("hub")
    }

    pub fn state_dir(&self) -> PathBuf {
        self.store.join(".deltafin")
    }

    pub fn origin_file(&self) -> PathBuf {
        self.state_dir().join("origin.json")
    }

    pub fn fill_log(&self, file: &str) -> PathBuf {
        self.state_dir().join("fill").join(format!("{file}.fill"))
    }

    pub fn sums_file(&self, file: &str) -> PathBuf {
        self.state_dir().join("sums").join(format!("{file}.json"))
    }

    pub fn checkpoint_dir(&self) -> PathBuf {
        self.store.join("checkpoint")
    }

    pub fn blob(&self, f: &OriginFile) -> PathBuf {
        self.repo_dir.join("blobs").join(blob_id(f))
    }

    pub fn partial(&self, f: &OriginFile) -> PathBuf {
        self.repo_dir.join("blobs").join(format!("{}{PARTIAL_SUFFIX}", blob_id(f)))
    }

    pub fn snapshot_dir(&self, commit: &str) -> PathBuf {
        self.repo_dir.join("snapshots").join(commit)
    }

    /// Whether `f` is finished (its verified blob exists with its size).
    pub fn is_finished(&self, f: &OriginFile) -> bool {
        std::fs::metadata(self.blob(f)).is_ok_and(|m| m.len() == f.size)
    }

    pub fn create_dirs(&self, commit: &str) -> Result<()> {
        for d in [
            self.repo_dir.join("blobs"),
            self.snapshot_dir(commit),
            self.repo_dir.join("refs"),
            self.checkpoint_dir(),
            self.state_dir().join("fill"),
            self.state_dir().join("sums"),
        ] {
            std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
        }
        Ok(())
    }

    /// Point `checkpoint/<file>` at the file's partial blob (while it is filled).
    pub fn link_partial(&self, f: &OriginFile) -> Result<()> {
        let target = Path::new("..").join("hub").join(repo_folder_of(&self.repo_dir)).join("blobs");
        replace_link(&target.join(format!("{}{PARTIAL_SUFFIX}", blob_id(f))), &self.checkpoint_dir().join(&f.name))
    }

    /// A verified file becomes a Hub cache entry: its partial is renamed to its blob name (a
    /// rename, so a reader holding it open keeps reading the same bytes), and the snapshot and
    /// the checkpoint view link to the blob.
    pub fn publish(&self, info: &OriginInfo, f: &OriginFile) -> Result<()> {
        let (partial, blob) = (self.partial(f), self.blob(f));
        if partial.exists() {
            std::fs::rename(&partial, &blob).with_context(|| format!("renaming {}", partial.display()))?;
        }
        let depth = f.name.matches('/').count();
        let mut up = PathBuf::new();
        for _ in 0..depth + 2 {
            up.push("..");
        }
        let snap_link = self.snapshot_dir(&info.commit).join(&f.name);
        if let Some(p) = snap_link.parent() {
            std::fs::create_dir_all(p).with_context(|| format!("creating {}", p.display()))?;
        }
        replace_link(&up.join("blobs").join(blob_id(f)), &snap_link)?;
        // The checkpoint view holds what the store reads: top-level files only (a repository's
        // `figures/` and the like live in the snapshot alone).
        if !f.name.contains('/') {
            let target = Path::new("..").join("hub").join(repo_folder_of(&self.repo_dir)).join("blobs");
            replace_link(&target.join(blob_id(f)), &self.checkpoint_dir().join(&f.name))?;
        }
        let refs = self.repo_dir.join("refs").join(&info.revision);
        if info.revision != info.commit && !info.revision.contains('/') {
            std::fs::write(&refs, &info.commit).with_context(|| format!("writing {}", refs.display()))?;
        }
        Ok(())
    }
}

fn repo_folder_of(repo_dir: &Path) -> String {
    repo_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// Make `at` a symbolic link to `target`, replacing what is there atomically (a new link,
/// then a rename over the old one).
pub fn replace_link(target: &Path, at: &Path) -> Result<()> {
    let tmp = at.with_extension("deltafin-link-tmp");
    let _ = std::fs::remove_file(&tmp);
    symlink(target, &tmp).with_context(|| format!("linking {}", tmp.display()))?;
    std::fs::rename(&tmp, at).with_context(|| format!("renaming {}", at.display()))?;
    Ok(())
}

#[cfg(unix)]
fn symlink(target: &Path, at: &Path) -> std::io::Result<()> {
    std::os::unix::fs::symlink(target, at)
}

#[cfg(windows)]
fn symlink(target: &Path, at: &Path) -> std::io::Result<()> {
    std::os::windows::fs::symlink_file(target, at)
}

/// The Hub cache directories this machine may already hold a snapshot in, in the order
/// huggingface_hub itself looks: `HF_HUB_CACHE`, `HF_HOME/hub`, `~/.cache/huggingface/hub`.
pub fn hub_caches() -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(p) = std::env::var_os("HF_HUB_CACHE") {
        v.push(PathBuf::from(p));
    }
    if let Some(p) = std::env::var_os("HF_HOME") {
        v.push(PathBuf::from(p).join("hub"));
    }
    if let Some(h) = std::env::var_os("HOME") {
        v.push(PathBuf::from(h).join(".cache").join("huggingface").join("hub"));
    }
    v
}

/// A complete snapshot of `info` in a local Hub cache: every file present with its size, and
/// every LFS file linked to the blob named by its sha256 (a Hub client verified it when it
/// downloaded it, and names blobs by hash).
pub fn find_cached_snapshot(info: &OriginInfo, caches: &[PathBuf]) -> Option<PathBuf> {
    caches.iter().find_map(|c| {
        let snap = c.join(repo_folder(&info.repo)).join("snapshots").join(&info.commit);
        let complete = info.files.iter().all(|f| {
            let p = snap.join(&f.name);
            let size_ok = std::fs::metadata(&p).is_ok_and(|m| m.len() == f.size);
            let hash_ok = match (&f.sha256, std::fs::read_link(&p)) {
                (Some(sha), Ok(t)) => t.file_name().is_some_and(|n| n.to_string_lossy() == *sha),
                _ => true,
            };
            size_ok && hash_ok
        });
        (complete && !info.files.is_empty()).then_some(snap)
    })
}
