//! Which routed experts a streaming store holds: `presence.bin`, one fixed 16-byte record per
//! (MoE layer, expert), updated in place.
//!
//! A record is `[xxh3-64 of the expert's canonical record][check]`, little-endian, where `check`
//! binds the checksum to its slot. All zeros (a hole of the sparse file) means absent; a record
//! whose check does not match (a write torn by a crash, or a reader racing a writer) also reads
//! as absent. So a reader sees either the old state of a record (absent) or the new one (present,
//! with its checksum), never a half. The commit order that makes this safe is the writer's: the
//! expert's bytes are written and synced before [`Presence::mark`] writes its record and syncs
//! that.
//!
//! The fetcher that fills absent experts lives above this crate (it needs the network); the
//! engine reaches it through [`ExpertFetcher`].

use crate::os::FileAt;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::checksum::xxh3_64;

use crate::error::{StoreError, io_err};

/// `DFPRESv1`, then the number of MoE layers and experts per layer (u32 each), zero-padded.
const MAGIC: &[u8; 8] = b"DFPRESv1";
const HEADER: u64 = 64;
const RECORD: u64 = 16;

/// The presence map of one streaming store.
pub struct Presence {
    file: File,
    path: PathBuf,
    /// MoE layer ids, in the order of their slots.
    layers: Vec<usize>,
    experts: usize,
    /// Per slot: the record's checksum when present; `ABSENT` otherwise. (An expert whose
    /// xxh3 is exactly `ABSENT` would be refetched at each open: a 2^-64 chance.)
    sums: Vec<AtomicU64>,
}

const ABSENT: u64 = 0;

fn check_word(slot: u64, sum: u64) -> u64 {
    let mut b = [0u8; 24];
    b[..8].copy_from_slice(b"present!");
    b[8..16].copy_from_slice(&slot.to_le_bytes());
    b[16..].copy_from_slice(&sum.to_le_bytes());
    xxh3_64(&b)
}

impl Presence {
    /// Open the map at `path`, creating it (all absent) when it does not exist. An existing map
    /// must describe the same geometry.
    pub fn open_or_create(path: &Path, layers: &[usize], experts: usize) -> Result<Self, StoreError> {
        if !path.exists() {
            let tmp = path.with_extension("bin.tmp");
            let f = File::create(&tmp).map_err(io_err(&tmp))?;
            let mut h = [0u8; HEADER as usize];
            h[..8].copy_from_slice(MAGIC);
            h[8..12].copy_from_slice(&(layers.len() as u32).to_le_bytes());
            h[12..16].copy_from_slice(&(experts as u32).to_le_bytes());
            f.write_all_at(&h, 0).map_err(io_err(&tmp))?;
            f.set_len(HEADER + RECORD * (layers.len() * experts) as u64).map_err(io_err(&tmp))?;
            f.sync_all().map_err(io_err(&tmp))?;
            std::fs::rename(&tmp, path).map_err(io_err(path))?;
        }
        Self::open(path, layers, experts)
    }

    /// Open an existing map and load every record.
    pub fn open(path: &Path, layers: &[usize], experts: usize) -> Result<Self, StoreError> {
        let bad = |msg: String| StoreError::Store { path: path.to_path_buf(), msg };
        let file = OpenOptions::new().read(true).write(true).open(path).map_err(io_err(path))?;
        let slots = layers.len() * experts;
        let len = file.metadata().map_err(io_err(path))?.len();
        if len != HEADER + RECORD * slots as u64 {
            return Err(bad(format!(
                "presence map is {len} bytes; {slots} experts need {}",
                HEADER + RECORD * slots as u64
            )));
        }
        let mut bytes = vec![0u8; len as usize];
        file.read_exact_at(&mut bytes, 0).map_err(io_err(path))?;
        let word = |at: usize| u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]) as usize;
        if &bytes[..8] != MAGIC || word(8) != layers.len() || word(12) != experts {
            return Err(bad(format!(
                "presence map does not describe this store ({} MoE layers x {experts} experts)",
                layers.len()
            )));
        }
        let sums = (0..slots)
            .map(|s| {
                let at = (HEADER + RECORD * s as u64) as usize;
                AtomicU64::new(decode(s as u64, &bytes[at..at + RECORD as usize]))
            })
            .collect();
        Ok(Presence { file, path: path.to_path_buf(), layers: layers.to_vec(), experts, sums })
    }

    fn slot(&self, layer: usize, expert: usize) -> Option<usize> {
        let li = self.layers.iter().position(|&l| l == layer)?;
        (expert < self.experts).then_some(li * self.experts + expert)
    }

    /// The expert's checksum when this process knows it is present.
    pub fn get(&self, layer: usize, expert: usize) -> Option<u64> {
        let s = self.slot(layer, expert)?;
        let v = self.sums[s].load(Ordering::Acquire);
        (v != ABSENT).then_some(v)
    }

    /// Re-read one record from disk (another process may have fetched it since this one
    /// opened the map); produces its checksum when present.
    pub fn refresh(&self, layer: usize, expert: usize) -> Result<Option<u64>, StoreError> {
        let Some(s) = self.slot(layer, expert) else { return Ok(None) };
        let mut rec = [0u8; RECORD as usize];
        self.file.read_exact_at(&mut rec, HEADER + RECORD * s as u64).map_err(io_err(&self.path))?;
        let v = decode(s as u64, &rec);
        if v != ABSENT {
            self.sums[s].store(v, Ordering::Release);
        }
        Ok((v != ABSENT).then_some(v))
    }

    /// Mark (layer, expert) present with the checksum of its record, durably. The caller has
    /// already written and synced the expert's bytes.
    pub fn mark(&self, layer: usize, expert: usize, sum: u64) -> Result<(), StoreError> {
        let s = self.slot(layer, expert).ok_or_else(|| StoreError::Store {
            path: self.path.clone(),
            msg: format!("no routed expert {expert} in layer {layer}"),
        })?;
        let mut rec = [0u8; RECORD as usize];
        rec[..8].copy_from_slice(&sum.to_le_bytes());
        rec[8..].copy_from_slice(&check_word(s as u64, sum).to_le_bytes());
        self.file.write_all_at(&rec, HEADER + RECORD * s as u64).map_err(io_err(&self.path))?;
        self.file.sync_data().map_err(io_err(&self.path))?;
        self.sums[s].store(sum, Ordering::Release);
        Ok(())
    }

    /// Mark (layer, expert) absent again, durably (its bytes proved wrong; it will be fetched
    /// again).
    pub fn unmark(&self, layer: usize, expert: usize) -> Result<(), StoreError> {
        let Some(s) = self.slot(layer, expert) else { return Ok(()) };
        self.sums[s].store(ABSENT, Ordering::Release);
        self.file.write_all_at(&[0u8; RECORD as usize], HEADER + RECORD * s as u64).map_err(io_err(&self.path))?;
        self.file.sync_data().map_err(io_err(&self.path))
    }

    /// Experts present, of all.
    pub fn count(&self) -> (usize, usize) {
        (self.sums.iter().filter(|v| v.load(Ordering::Acquire) != ABSENT).count(), self.sums.len())
    }

    /// MoE layer ids, in slot order.
    pub fn layers(&self) -> &[usize] {
        &self.layers
    }

    pub fn experts_per_layer(&self) -> usize {
        self.experts
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn decode(slot: u64, rec: &[u8]) -> u64 {
    let sum = u64::from_le_bytes(rec[..8].try_into().unwrap_or([0; 8]));
    let check = u64::from_le_bytes(rec[8..16].try_into().unwrap_or([0; 8]));
    if sum != ABSENT && check == check_word(slot, sum) { sum } else { ABSENT }
}

/// Why a fetch failed, in words for the operator (never a local path).
pub type FetchError = Box<dyn std::error::Error + Send + Sync>;

/// Fills absent experts of a streaming store (from the network); implemented above this crate
/// and handed to the engine by the command that runs the model.
pub trait ExpertFetcher: Send + Sync + std::fmt::Debug {
    /// Make every listed expert of `layer` present (fetch, write, sync, verify, mark), all of
    /// them in parallel. Experts already present are skipped.
    fn fetch(&self, layer: usize, experts: &[usize]) -> Result<(), FetchError>;

    /// Experts `layer` will probably need soon: fetch the absent ones in the background if the
    /// fetcher can. A hint, never an error. Default: ignored.
    fn hint(&self, _layer: usize, _experts: &[usize]) {}

    /// Drop the hints not started and wait for the fetches in flight to land (the end of a run:
    /// its report then counts every fetch it caused). Default: nothing to wait for.
    fn settle(&self) {}

    /// What this fetcher has done so far (for logs and metrics).
    fn stats(&self) -> FetchStats;
}

/// Totals of a fetcher.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct FetchStats {
    /// Experts fetched and marked present.
    pub experts: u64,
    /// Of those, fetched ahead of demand from the engine's predictions.
    pub experts_ahead: u64,
    /// Body bytes received from the origin (failed attempts included).
    pub bytes_downloaded: u64,
    /// Bytes written into the store's shards.
    pub bytes_written: u64,
    /// Fetch calls that failed.
    pub failures: u64,
    /// Wall time spent fetching.
    pub seconds: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_survive_reopen_and_torn_records_read_absent() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("presence.bin");
        let m = Presence::open_or_create(&p, &[1, 2, 4], 8).unwrap();
        assert_eq!(m.count(), (0, 24));
        m.mark(2, 5, 0xdead_beef).unwrap();
        assert_eq!(m.get(2, 5), Some(0xdead_beef));
        assert_eq!(m.get(2, 4), None);
        assert_eq!(m.get(3, 0), None, "not a MoE layer");
        drop(m);
        let m = Presence::open_or_create(&p, &[1, 2, 4], 8).unwrap();
        assert_eq!(m.get(2, 5), Some(0xdead_beef));
        assert_eq!(m.count(), (1, 24));
        // A torn record: the checksum written, its check not.
        let f = OpenOptions::new().write(true).open(&p).unwrap();
        let slot = 8 + 6; // layer 2 is the second MoE layer; expert 6
        f.write_all_at(&7u64.to_le_bytes(), HEADER + RECORD * slot).unwrap();
        drop(f);
        let m = Presence::open(&p, &[1, 2, 4], 8).unwrap();
        assert_eq!(m.get(2, 6), None);
        assert_eq!(m.refresh(2, 6).unwrap(), None);
        assert!(Presence::open(&p, &[1, 2], 8).is_err(), "another geometry is refused");
    }

    #[test]
    fn another_handle_sees_a_mark_after_refresh() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("presence.bin");
        let a = Presence::open_or_create(&p, &[0], 4).unwrap();
        let b = Presence::open(&p, &[0], 4).unwrap();
        a.mark(0, 3, 42).unwrap();
        assert_eq!(b.get(0, 3), None);
        assert_eq!(b.refresh(0, 3).unwrap(), Some(42));
        assert_eq!(b.get(0, 3), Some(42));
        a.unmark(0, 3).unwrap();
        assert_eq!(a.get(0, 3), None);
        assert_eq!(Presence::open(&p, &[0], 4).unwrap().get(0, 3), None);
    }
}
