//! The one narrow path by which routed-expert weights reach the model: (layer, expert) -> the
//! expert's canonical record bytes. What stands behind it (plain reads today, a streaming cache
//! next) can change without touching model code.

use anyhow::Result;
use deltafin_store::Store;
use deltafin_store::manifest::ExpertPart;

pub trait ExpertSource {
    /// Fill `out` with the record of (layer, expert): the six MXFP4 tensors back to back in the
    /// order of [`RecordLayout`].
    fn load(&mut self, layer: usize, expert: usize, out: &mut Vec<u8>) -> Result<()>;

    /// Bytes read from storage so far (for reporting).
    fn bytes_read(&self) -> u64;
}

/// Reads every record from the store, verifying its checksum; no caching.
pub struct StoreExperts<'a> {
    store: &'a Store,
    bytes: u64,
}

impl<'a> StoreExperts<'a> {
    pub fn new(store: &'a Store) -> Self {
        StoreExperts { store, bytes: 0 }
    }
}

impl ExpertSource for StoreExperts<'_> {
    fn load(&mut self, layer: usize, expert: usize, out: &mut Vec<u8>) -> Result<()> {
        self.store.experts.read(layer, expert, out)?;
        self.bytes += out.len() as u64;
        Ok(())
    }

    fn bytes_read(&self) -> u64 {
        self.bytes
    }
}

/// Where each of the six tensors sits inside a record.
#[derive(Debug, Clone)]
pub struct RecordLayout {
    /// (offset, len) of w1 packed, w1 scales, w2 packed, w2 scales, w3 packed, w3 scales.
    pub parts: [(usize, usize); 6],
    pub record_bytes: usize,
}

impl RecordLayout {
    pub fn from_manifest(parts: &[ExpertPart], record_bytes: u64) -> Result<Self> {
        let names = [
            "w1.weight_packed",
            "w1.weight_scale",
            "w2.weight_packed",
            "w2.weight_scale",
            "w3.weight_packed",
            "w3.weight_scale",
        ];
        let mut out = [(0usize, 0usize); 6];
        for (i, n) in names.iter().enumerate() {
            let p = parts
                .iter()
                .find(|p| p.name == *n)
                .ok_or_else(|| anyhow::anyhow!("store's expert record has no part '{n}'"))?;
            if p.offset + p.len > record_bytes {
                anyhow::bail!("expert record part '{n}' lies outside the record");
            }
            out[i] = (p.offset as usize, p.len as usize);
        }
        Ok(RecordLayout {
            parts: out,
            record_bytes: record_bytes as usize,
        })
    }

    pub fn part<'r>(&self, record: &'r [u8], i: usize) -> &'r [u8] {
        let (o, l) = self.parts[i];
        &record[o..o + l]
    }
}
