//! The physical limit our expert reads chase: raw O_DIRECT read bandwidth of the drive at the
//! expert record size and queue depth, measured on the store's own files with the same back-end.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Result, bail};
use deltafin_store::Store;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::aligned::{AlignedBuf, DIRECT_ALIGN};
use super::backend::make_backend;
use super::geometry::Window;
use super::reader::{BackendKind, ReadReq, open_files};

#[derive(Debug, Clone, Serialize)]
pub struct ProbeResult {
    pub gbps: f64,
    pub bytes: u64,
    pub seconds: f64,
    pub reads: usize,
    pub read_bytes: u64,
    pub queue_depth: usize,
    pub backend: BackendKind,
    pub o_direct: bool,
    pub batched: bool,
}

/// Read `reads` randomly chosen expert records (their aligned windows, first range only),
/// `queue_depth` in flight, and report the rate. With `batched`, reads go in groups of
/// `queue_depth` and each group is waited for whole before the next is issued: the shape of a
/// decode step's demand reads for one layer when nothing predicts the next layer.
pub fn raw_read_bandwidth(
    store: &Store,
    backend: Option<BackendKind>,
    queue_depth: usize,
    reads: usize,
    seed: u64,
    batched: bool,
) -> Result<ProbeResult> {
    let ex = &store.manifest.experts;
    let targets: Vec<[u64; 3]> = ex.layers.iter().flat_map(|l| l.experts.iter().map(|e| e.ranges[0])).collect();
    if targets.is_empty() {
        bail!("the store has no routed experts to read");
    }
    let max_w = targets.iter().map(|r| Window::of(r).len).max().unwrap_or(DIRECT_ALIGN);
    let qd = queue_depth.max(1);
    // Declared before the back-end so they are dropped after it: its drop waits for the reads
    // still in flight into them (an early return on a failed read must not free them first).
    let mut bufs: Vec<AlignedBuf> = (0..qd).map(|_| AlignedBuf::new(max_w)).collect();
    let (files, o_direct) = open_files(store.experts.paths(), true)?;
    let mut be = make_backend(Arc::new(files), backend, queue_depth)?;
    let mut free: Vec<usize> = (0..qd).collect();
    let mut rng = SmallRng::seed_from_u64(seed);
    let (mut issued, mut completed, mut bytes) = (0usize, 0usize, 0u64);
    let mut done = Vec::new();
    let t0 = Instant::now();
    while completed < reads {
        let may_issue = !batched || free.len() == qd;
        while may_issue
            && issued < reads
            && let Some(b) = free.pop()
        {
            let r = targets[rng.random_range(0..targets.len())];
            let w = Window::of(&r);
            let req = ReadReq {
                file: w.file,
                offset: w.offset,
                len: w.len,
                need: w.need,
                buf: bufs[b].as_mut_ptr(),
                tag: b as u64,
                urgent: true,
            };
            be.submit(&[req])?;
            bytes += w.len as u64;
            issued += 1;
        }
        done.clear();
        be.wait(&mut done)?;
        for (tag, res) in done.drain(..) {
            res?;
            free.push(tag as usize);
            completed += 1;
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    Ok(ProbeResult {
        gbps: bytes as f64 / seconds / 1e9,
        bytes,
        seconds,
        reads,
        read_bytes: max_w as u64,
        queue_depth: qd,
        backend: be.kind(),
        o_direct,
        batched,
    })
}
