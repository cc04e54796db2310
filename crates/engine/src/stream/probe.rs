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
    read_rate(store.experts.paths(), &targets, backend, queue_depth, reads, seed, batched)
}

/// Read `reads` of `targets` (`[file, offset, len]`, their aligned windows) at random from
/// `paths`, `queue_depth` in flight, and report the rate.
fn read_rate(
    paths: &[std::path::PathBuf],
    targets: &[[u64; 3]],
    backend: Option<BackendKind>,
    queue_depth: usize,
    reads: usize,
    seed: u64,
    batched: bool,
) -> Result<ProbeResult> {
    let max_w = targets.iter().map(|r| Window::of(r).len).max().unwrap_or(DIRECT_ALIGN);
    let qd = queue_depth.max(1);
    // Declared before the back-end so they are dropped after it: its drop waits for the reads
    // still in flight into them (an early return on a failed read must not free them first).
    let mut bufs: Vec<AlignedBuf> = (0..qd).map(|_| AlignedBuf::new(max_w)).collect();
    let (files, o_direct) = open_files(paths, true)?;
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

/// The raw O_DIRECT read rate of the drive under `dir` at `record_bytes` per read (Kimi K3's
/// expert record is 17,547,264 bytes), depth `queue_depth`: a scratch file of `records`
/// records is written and synced, read `reads` times at random, and deleted. For `deltafin plan
/// --measure`, before there is a store. `progress` is told what is happening.
pub fn scratch_read_bandwidth(
    dir: &std::path::Path,
    record_bytes: u64,
    records: u64,
    reads: usize,
    queue_depth: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<ProbeResult> {
    use std::io::Write as _;
    let path = dir.join(format!(".deltafin-probe-{}", std::process::id()));
    // Removed however this ends.
    struct Remove(std::path::PathBuf);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _remove = Remove(path.clone());
    let stride = record_bytes.div_ceil(DIRECT_ALIGN as u64) * DIRECT_ALIGN as u64;
    let total = stride * records;
    progress(&format!("writing a {:.1} GB probe file in {}", total as f64 / 1e9, dir.display()));
    {
        let mut f = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(&path)?);
        // Not zeros: some drives and file systems short-cut them.
        let mut rng = SmallRng::seed_from_u64(7);
        let mut block = vec![0u8; 8 << 20];
        let mut left = total;
        while left > 0 {
            rng.fill(&mut block[..]);
            let n = left.min(block.len() as u64) as usize;
            f.write_all(&block[..n])?;
            left -= n as u64;
        }
        f.flush()?;
        f.get_ref().sync_all()?;
    }
    progress(&format!("reading {reads} random records of {record_bytes} bytes with O_DIRECT, {queue_depth} in flight"));
    let targets: Vec<[u64; 3]> = (0..records).map(|i| [0, i * stride, record_bytes]).collect();
    read_rate(std::slice::from_ref(&path), &targets, None, queue_depth, reads, 1, false)
}
