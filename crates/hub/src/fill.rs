//! The fill log of one partially downloaded file: which byte ranges are on disk, durably.
//!
//! An append-only file of 32-byte entries `[start, len, xxh3 of the bytes, check]`
//! (little-endian u64s; `check` binds the other three). The commit order is: the range's bytes
//! are written into the file and synced, then its entry is appended and synced. So after a
//! kill -9 at any moment every entry names bytes that are on disk; a piece whose entry did not
//! make it is downloaded again (only that piece). A torn last entry fails its check and is
//! dropped, and the file is cut back to whole entries before anything is appended.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context, Result};
use deltafin_store::checksum::xxh3_64;

use crate::ranges::{Range, covers, normalize};

const ENTRY: usize = 32;

pub struct FillLog {
    path: PathBuf,
    inner: Mutex<Inner>,
}

struct Inner {
    file: File,
    /// Normalized ranges on disk.
    have: Vec<Range>,
}

fn check(start: u64, len: u64, sum: u64) -> u64 {
    let mut b = [0u8; 28];
    b[..4].copy_from_slice(b"fill");
    b[4..12].copy_from_slice(&start.to_le_bytes());
    b[12..20].copy_from_slice(&len.to_le_bytes());
    b[20..].copy_from_slice(&sum.to_le_bytes());
    xxh3_64(&b)
}

impl FillLog {
    /// Open (or create) the log at `path`.
    pub fn open(path: &Path) -> Result<Self> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).with_context(|| format!("reading {}", path.display()))?;
        let whole = bytes.len() / ENTRY * ENTRY;
        if whole != bytes.len() {
            // A torn append: cut it off so later entries stay aligned.
            file.set_len(whole as u64).with_context(|| format!("truncating {}", path.display()))?;
        }
        let mut have = Vec::new();
        for e in bytes[..whole].chunks_exact(ENTRY) {
            let w = |i: usize| u64::from_le_bytes(e[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
            let (start, len, sum, chk) = (w(0), w(1), w(2), w(3));
            if chk == check(start, len, sum)
                && let Some(end) = start.checked_add(len)
            {
                have.push((start, end));
            }
        }
        Ok(FillLog { path: path.to_path_buf(), inner: Mutex::new(Inner { file, have: normalize(have) }) })
    }

    /// Record `[start, start + bytes.len())` as on disk. The caller has written and synced
    /// those bytes; the entry is synced before this returns.
    pub fn add(&self, start: u64, bytes: &[u8]) -> Result<()> {
        let len = bytes.len() as u64;
        let sum = xxh3_64(bytes);
        let mut e = [0u8; ENTRY];
        e[..8].copy_from_slice(&start.to_le_bytes());
        e[8..16].copy_from_slice(&len.to_le_bytes());
        e[16..24].copy_from_slice(&sum.to_le_bytes());
        e[24..].copy_from_slice(&check(start, len, sum).to_le_bytes());
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.file.write_all(&e).with_context(|| format!("appending to {}", self.path.display()))?;
        g.file.sync_data().with_context(|| format!("syncing {}", self.path.display()))?;
        let mut have = std::mem::take(&mut g.have);
        have.push((start, start + len));
        g.have = normalize(have);
        Ok(())
    }

    /// The ranges on disk, normalized.
    pub fn have(&self) -> Vec<Range> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).have.clone()
    }

    pub fn covers(&self, r: Range) -> bool {
        covers(&self.inner.lock().unwrap_or_else(|p| p.into_inner()).have, r)
    }

    /// Forget every range (the file failed verification: its bytes will be fetched again).
    pub fn clear(&self) -> Result<()> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.file.set_len(0).with_context(|| format!("clearing {}", self.path.display()))?;
        g.file.sync_all().with_context(|| format!("syncing {}", self.path.display()))?;
        g.have.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_survive_reopen_and_a_torn_tail_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.fill");
        let log = FillLog::open(&p).unwrap();
        log.add(0, &[1; 10]).unwrap();
        log.add(10, &[2; 5]).unwrap();
        log.add(100, &[3; 5]).unwrap();
        drop(log);
        // A torn append: half an entry.
        let mut f = OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(&[9u8; 17]).unwrap();
        drop(f);
        let log = FillLog::open(&p).unwrap();
        assert_eq!(log.have(), vec![(0, 15), (100, 105)]);
        assert!(log.covers((3, 15)) && !log.covers((14, 16)));
        log.add(15, &[4; 85]).unwrap();
        drop(log);
        let log = FillLog::open(&p).unwrap();
        assert_eq!(log.have(), vec![(0, 105)], "the entry after the torn one is aligned and kept");
        // A corrupted entry reads as absent.
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[5] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        let log = FillLog::open(&p).unwrap();
        assert!(!log.covers((0, 10)));
        log.clear().unwrap();
        assert!(log.have().is_empty());
    }
}
