//! The one narrow path by which routed-expert weights reach the model: (layer, expert) -> the
//! expert's canonical record bytes. What stands behind it (plain checked reads here, the
//! streaming cache of `stream::streaming`, an in-memory map in tests) changes without touching
//! model code.

use anyhow::Result;
use deltafin_store::Store;
use deltafin_store::manifest::ExpertPart;

use crate::fault::FaultStats;

/// The model announces each layer's chosen experts with [`begin`](ExpertSource::begin) as soon as
/// its router has picked them, may compute other work (shared experts) while reads are in
/// flight, then takes the records with [`drain`](ExpertSource::drain) in whatever order they
/// become available. Callers combine expert outputs in a fixed order, so results do not depend
/// on completion order.
pub trait ExpertSource {
    /// The experts `layer` needs now. Sources that read from disk start every missing read here.
    fn begin(&mut self, layer: usize, experts: &[usize]) -> Result<()>;

    /// Hand each announced expert's record to `f` as `(index into the begin() list, bytes)`:
    /// the six MXFP4 tensors back to back in the order of [`RecordLayout`].
    fn drain(&mut self, f: &mut dyn FnMut(usize, &[u8]) -> Result<()>) -> Result<()>;

    /// Experts `layer` will probably need soon: a low-priority hint. Default: ignored.
    fn prefetch(&mut self, _layer: usize, _experts: &[usize]) -> Result<()> {
        Ok(())
    }

    /// Bytes read from storage so far (for reporting).
    fn bytes_read(&self) -> u64;

    /// Return to a clean state after a failed step: reads in flight are waited for and their
    /// buffers freed, a half-served demand is dropped, and nothing unverified stays cached. The
    /// next [`begin`](ExpertSource::begin) starts afresh. Default: nothing to clean.
    fn reset(&mut self) {}

    /// Read faults counted so far (zero for sources that do not count them).
    fn faults(&self) -> FaultStats {
        FaultStats::default()
    }

    /// `layer` is about to serve a chunk so large that it will pick nearly every expert: a
    /// source that caches may start reading uncached experts into its free cache room now, while
    /// the layer's attention computes (a wrong guess costs one read). Default: nothing.
    fn read_ahead(&mut self, _layer: usize) {}

    /// Between steps, give up to `bytes` of cache memory back to the system for a while (a long
    /// prompt's chunk borrows it: one large chunk reads each expert once, where smaller chunks
    /// read most of them again each). Returns the bytes given up, in whole slots, which the
    /// source no longer uses until [`take_back`](ExpertSource::take_back). Default: none.
    fn lend(&mut self, _bytes: u64) -> u64 {
        0
    }

    /// The memory lent by [`lend`](ExpertSource::lend) is the cache's again (it fills as
    /// experts are read). Default: nothing lent.
    fn take_back(&mut self) {}
}

/// An expert source that tells `on_begin(layer, experts)` what each layer asked for and passes
/// everything through (a prompt's distinct experts, a batched step's union per layer).
pub struct Observed<'a, F: FnMut(usize, &[usize])> {
    pub inner: &'a mut dyn ExpertSource,
    pub on_begin: F,
}

impl<F: FnMut(usize, &[usize])> ExpertSource for Observed<'_, F> {
    fn begin(&mut self, layer: usize, experts: &[usize]) -> Result<()> {
        (self.on_begin)(layer, experts);
        self.inner.begin(layer, experts)
    }
    fn drain(&mut self, f: &mut dyn FnMut(usize, &[u8]) -> Result<()>) -> Result<()> {
        self.inner.drain(f)
    }
    fn prefetch(&mut self, layer: usize, experts: &[usize]) -> Result<()> {
        self.inner.prefetch(layer, experts)
    }
    fn bytes_read(&self) -> u64 {
        self.inner.bytes_read()
    }
    fn reset(&mut self) {
        self.inner.reset()
    }
    fn faults(&self) -> FaultStats {
        self.inner.faults()
    }
    fn read_ahead(&mut self, layer: usize) {
        self.inner.read_ahead(layer)
    }
    fn lend(&mut self, bytes: u64) -> u64 {
        self.inner.lend(bytes)
    }
    fn take_back(&mut self) {
        self.inner.take_back()
    }
}

/// Reads every record from the store with plain positioned reads, verifying its checksum; no
/// caching, no overlap. The simplest correct source, and the reference the streaming source is
/// tested against.
pub struct StoreExperts<'a> {
    store: &'a Store,
    bytes: u64,
    pending: Option<(usize, Vec<usize>)>,
    record: Vec<u8>,
}

impl<'a> StoreExperts<'a> {
    pub fn new(store: &'a Store) -> Self {
        StoreExperts { store, bytes: 0, pending: None, record: Vec::new() }
    }
}

impl ExpertSource for StoreExperts<'_> {
    fn begin(&mut self, layer: usize, experts: &[usize]) -> Result<()> {
        self.pending = Some((layer, experts.to_vec()));
        Ok(())
    }

    fn drain(&mut self, f: &mut dyn FnMut(usize, &[u8]) -> Result<()>) -> Result<()> {
        let Some((layer, experts)) = self.pending.take() else { anyhow::bail!("drain() without begin()") };
        for (i, &e) in experts.iter().enumerate() {
            self.store.experts.read(layer, e, &mut self.record)?;
            self.bytes += self.record.len() as u64;
            f(i, &self.record)?;
        }
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
        Ok(RecordLayout { parts: out, record_bytes: record_bytes as usize })
    }

    pub fn part<'r>(&self, record: &'r [u8], i: usize) -> &'r [u8] {
        let (o, l) = self.parts[i];
        &record[o..o + l]
    }
}
