//! A record's check: assemble it from the windows it was read through (moving in-place ranges
//! into canonical order) and compare its xxh3 with the manifest's (or, in a streaming store, the
//! presence map's). Run on the I/O thread (`stream::io_thread`) the moment a record's last range
//! lands, while the engine computes the records already verified; the engine uses a record only
//! after its result comes back.

use std::collections::HashMap;
use std::sync::Arc;

use deltafin_store::checksum::xxh3_64;
use deltafin_store::manifest::ExpertLocation;
use deltafin_store::presence::Presence;

use super::geometry;

/// Verification's cost, measured step against step (feature `measure-verify` only; without it
/// nothing here exists but a `false`).
pub mod measure {
    #[cfg(feature = "measure-verify")]
    static SKIP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

    /// Whether this step's records go unhashed.
    #[inline]
    pub fn skipping() -> bool {
        #[cfg(feature = "measure-verify")]
        return SKIP.load(std::sync::atomic::Ordering::Relaxed);
        #[cfg(not(feature = "measure-verify"))]
        false
    }

    /// Decode step `step` (0-based) begins: with `DELTAFIN_MEASURE_VERIFY` set, odd steps skip
    /// the hash.
    #[cfg_attr(not(feature = "measure-verify"), allow(unused_variables))]
    pub fn step_begins(step: usize) {
        #[cfg(feature = "measure-verify")]
        {
            static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            let on = *ON.get_or_init(|| std::env::var_os("DELTAFIN_MEASURE_VERIFY").is_some());
            SKIP.store(on && step % 2 == 1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// What a record's checksum check needs to know about the store.
#[derive(Clone)]
pub struct RecordCheck {
    pub locs: Arc<HashMap<usize, Vec<ExpertLocation>>>,
    pub presence: Option<Arc<Presence>>,
    pub record_bytes: usize,
}

impl RecordCheck {
    /// Move each range's bytes to their place in the canonical record and check the checksum.
    /// Returns where the record starts in the buffer.
    pub fn check(&self, key: (usize, usize), b: &mut [u8]) -> Result<usize, String> {
        let loc = self.locs.get(&key.0).and_then(|v| v.get(key.1)).ok_or("no such record in the manifest")?;
        let start = geometry::assemble(loc, b);
        let rec = b.get(start..start + self.record_bytes).ok_or("the record does not fit its buffer")?;
        let expected = match &self.presence {
            None => loc.xxh3,
            Some(p) => p.get(key.0, key.1).ok_or("the record is not present in this streaming store")?,
        };
        let actual = if measure::skipping() { expected } else { xxh3_64(rec) };
        if actual != expected {
            return Err(format!("checksum mismatch (stored {expected:016x}, read {actual:016x})"));
        }
        Ok(start)
    }
}
