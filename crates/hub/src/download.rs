//! The range scheduler: pieces of files fetched by parallel ranged GETs, each written in place,
//! synced, and only then entered in its file's fill log, so a killed download resumes where it
//! stopped and never trusts a piece it did not finish.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result};
use deltafin_store::manifest::OriginFile;

use crate::fill::FillLog;
use crate::http::{Expect, Http};
use crate::ranges::Range;
use deltafin_store::progress::Progress;

/// One file being filled.
pub struct Target {
    pub name: String,
    pub url: String,
    pub size: u64,
    pub sha256: Option<String>,
    pub validator: Option<String>,
    pub path: PathBuf,
    pub file: File,
    pub log: FillLog,
}

impl Target {
    /// Open (creating, sparse, at its full size) the partial file of `f` at `path`, and its fill
    /// log.
    pub fn open(f: &OriginFile, url: String, path: &Path, log: &Path) -> Result<Self> {
        let size = f.size;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        let len = file.metadata().with_context(|| format!("reading {}", path.display()))?.len();
        if len != size {
            // Holes cost no disk: the file takes space only where ranges are written.
            file.set_len(size).with_context(|| format!("sizing {}", path.display()))?;
        }
        Ok(Target {
            name: f.name.clone(),
            url,
            size,
            sha256: f.sha256.clone(),
            validator: f.validator.clone(),
            path: path.to_path_buf(),
            file,
            log: FillLog::open(log)?,
        })
    }

    pub fn expect(&self) -> Expect<'_> {
        Expect {
            name: &self.name,
            size: self.size,
            sha256: self.sha256.as_deref(),
            validator: self.validator.as_deref(),
        }
    }

    /// Fetch `[s, e)`, write it in place, sync it, then log it. Produces the bytes written.
    pub fn fetch_piece(&self, http: &Http, (s, e): Range) -> Result<u64> {
        let bytes = http.get_range(&self.url, s, e, &self.expect())?;
        write_synced(&self.file, &self.path, &bytes, s)?;
        self.log.add(s, &bytes)?;
        Ok(bytes.len() as u64)
    }
}

/// Write `bytes` at `at` and sync them. A full disk says so plainly: the piece is not logged,
/// so the store stays as it was and a rerun after freeing space continues.
pub fn write_synced(file: &File, path: &Path, bytes: &[u8], at: u64) -> Result<()> {
    let w = deltafin_store::os::FileAt::write_all_at(file, bytes, at).and_then(|()| file.sync_data());
    w.map_err(|e| {
        if e.raw_os_error() == Some(28) {
            anyhow::anyhow!(
                "the disk is full while writing {} ({} bytes at {at}); nothing unwritten was recorded: free space and rerun the same command to continue",
                path.display(),
                bytes.len()
            )
        } else {
            anyhow::Error::new(e).context(format!("writing {}", path.display()))
        }
    })
}

/// Fetch every `(target, range)` piece with `workers` parallel requests. The first error stops
/// the others after their current piece and is returned; what finished stays logged.
pub fn run(
    http: &Http,
    targets: &[Target],
    pieces: Vec<(usize, Range)>,
    workers: usize,
    progress: &Progress,
) -> Result<u64> {
    let queue = Mutex::new(pieces.into_iter().collect::<VecDeque<_>>());
    let stop = AtomicBool::new(false);
    let first_err: Mutex<Option<anyhow::Error>> = Mutex::new(None);
    let written = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..workers.max(1) {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let next = queue.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
                    let Some((t, r)) = next else { break };
                    let Some(target) = targets.get(t) else { break };
                    match target.fetch_piece(http, r) {
                        Ok(n) => {
                            written.fetch_add(n, Ordering::Relaxed);
                            progress.inc(n);
                        }
                        Err(e) => {
                            stop.store(true, Ordering::Relaxed);
                            first_err.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                        }
                    }
                }
            });
        }
    });
    match first_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(written.into_inner()),
    }
}
