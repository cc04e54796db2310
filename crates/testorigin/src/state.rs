//! What both listeners share: the repos with their branches and commits, the CDN's blobs, the
//! fault rules and the stats. Every lock is held only for a lookup or a counter bump.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::rate::Limiter;
use crate::snapshot::Snapshot;
use crate::{Fault, RepoSpec, Stats};

pub(crate) struct Repo {
    pub token: Option<String>,
    pub gated: bool,
    /// Branch name -> commit.
    pub branches: HashMap<String, String>,
    /// Commit -> its files. Old commits stay, as on the Hub: a client that pinned one can finish.
    pub commits: HashMap<String, Arc<Snapshot>>,
}

/// An LFS object on the CDN, by sha256.
#[derive(Clone)]
pub(crate) struct Blob {
    /// The file name it was first seen under, for fault matching and stats.
    pub name: String,
    pub path: PathBuf,
    pub size: u64,
}

pub(crate) struct Shared {
    /// The CDN's base URL, for the Hub's redirects.
    pub cdn: String,
    pub repos: Mutex<HashMap<String, Repo>>,
    pub blobs: Mutex<HashMap<String, Blob>>,
    pub faults: Mutex<Vec<Fault>>,
    pub stats: Arc<Mutex<Stats>>,
    pub limiter: Arc<Limiter>,
}

/// A poisoned lock only means a handler panicked mid-update of a counter or a map entry; the
/// data is still usable for a test server, so keep serving.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    pub(crate) fn new(cdn: String, specs: Vec<RepoSpec>) -> io::Result<Shared> {
        let shared = Shared {
            cdn,
            repos: Mutex::new(HashMap::new()),
            blobs: Mutex::new(HashMap::new()),
            faults: Mutex::new(Vec::new()),
            stats: Arc::new(Mutex::new(Stats::default())),
            limiter: Arc::new(Limiter::new()),
        };
        for spec in specs {
            let snapshot = shared.scan(&spec.dir)?;
            let commits: HashMap<_, _> =
                spec.branches.iter().map(|(_, commit)| (commit.clone(), snapshot.clone())).collect();
            let repo =
                Repo { token: spec.token, gated: spec.gated, branches: spec.branches.into_iter().collect(), commits };
            lock(&shared.repos).insert(spec.repo, repo);
        }
        Ok(shared)
    }

    /// Hashes a directory and registers its LFS objects with the CDN.
    pub(crate) fn scan(&self, dir: &Path) -> io::Result<Arc<Snapshot>> {
        let snapshot = Snapshot::scan(dir)?;
        let mut blobs = lock(&self.blobs);
        for (name, f) in &snapshot.files {
            if f.lfs_pointer_size.is_some() {
                blobs.entry(f.sha256.clone()).or_insert_with(|| Blob {
                    name: name.clone(),
                    path: f.path.clone(),
                    size: f.size,
                });
            }
        }
        Ok(Arc::new(snapshot))
    }

    pub(crate) fn stats(&self) -> MutexGuard<'_, Stats> {
        lock(&self.stats)
    }
}
