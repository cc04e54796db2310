//! Spine layers that do not fit the memory budget are read from the spine file for every token
//! by a loader thread, ahead of the compute. A layer's image is read with O_DIRECT (where the
//! file system allows it) into one of two aligned buffers, in 4 MiB pieces kept in flight
//! together; each tensor's checksum is fed as the pieces land, so verifying costs the loader
//! only the last piece's hashing, never the engine thread. The model's tensors are views into
//! the image (no copy, no allocation per token): the buffer goes back to the loader when the
//! layer's last view is dropped, and the next layer's read starts at once. At most two layer
//! images exist: the one being computed and the one being read.
//!
//! The loader does not know the model: the caller gives it the function that turns a verified
//! layer image into the model's layer type.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Result, anyhow};
use deltafin_store::{ImageBytes, ImageVerifier, SpineImage, SpineTable, Store};

use crate::fault::{FaultDetail, FaultKind, SpineFault};

use super::activity::{DiskActivity, Watched};
use super::aligned::AlignedBuf;
use super::backend::make_backend;
use super::reader::{BackendKind, ReadBackend, ReadReq, open_files};

/// Decodes layer `l`'s verified image into the model's layer weights (runs on the loader
/// thread; the weights may keep views into the image).
pub type DecodeLayer<T> = Box<dyn Fn(&SpineImage<'_>, usize) -> Result<T> + Send>;

/// Layer images alive at once: the one being computed and the one being read.
pub const SPINE_BUFFERS: usize = 2;

/// Bytes per read of a layer image; the pieces of a layer are in flight together.
const PIECE: usize = 4 << 20;

/// Reads of one layer in the device's hands at once (beside the expert reads: a replay of a
/// run that streamed its spine keeps as many more in flight).
pub const PIECES_IN_FLIGHT: usize = 8;

/// A failed or corrupt layer read is read once more before the step fails.
const MAX_ATTEMPTS: u32 = 2;

/// What the loader counts, shared with the engine for reports.
#[derive(Debug, Default)]
pub struct SpineCounters {
    pub bytes_read: AtomicU64,
    /// Bytes hashed to verify images, and the nanoseconds spent hashing (on the loader thread).
    pub bytes_verified: AtomicU64,
    pub verify_ns: AtomicU64,
    /// Reads retried after an error or a checksum failure.
    pub retries: AtomicU64,
    /// Back-ends replaced after one failed (the layer being read failed its step).
    pub restarts: AtomicU64,
}

/// A decorator applied to every read back-end the loader builds (disk activity, fault injection
/// in tests): kept, so that a back-end built after a failure reads the same way.
pub type WrapBackend = Box<dyn Fn(Box<dyn ReadBackend>) -> Box<dyn ReadBackend> + Send>;

/// Builds the loader's read back-end (again, after a failure).
type MakeBackend = Box<dyn Fn() -> std::io::Result<Box<dyn ReadBackend>> + Send>;

/// Messages to the loader.
enum Msg {
    /// The engine needs layer `l` next (sent when the order changes: a sequence restarted or a
    /// step ended early).
    Want(usize),
    /// A layer's last view was dropped: its buffer is free.
    Back(AlignedBuf),
    Stop,
}

/// A layer image lent to the model; dropping it hands the buffer back to the loader.
struct Lease {
    buf: Option<AlignedBuf>,
    len: usize,
    back: Sender<Msg>,
}

impl ImageBytes for Lease {
    fn bytes(&self) -> &[u8] {
        self.buf.as_ref().map(|b| &b.as_slice()[..self.len]).unwrap_or(&[])
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            // When the loader has stopped, the buffer is simply freed.
            let _ = self.back.send(Msg::Back(b));
        }
    }
}

pub struct SpineStreamer<T> {
    inbox: Sender<Msg>,
    resp: Receiver<(usize, Result<T>)>,
    thread: Option<JoinHandle<()>>,
    /// Streamed layers in model order.
    layers: Vec<usize>,
    /// The layer the loader will send next, as far as this side knows.
    expected: Option<usize>,
    pub counters: Arc<SpineCounters>,
}

/// A layer being read: its buffer, which pieces have landed, and the verifier fed in order.
struct Reading {
    layer: usize,
    buf: AlignedBuf,
    lo: u64,
    len: usize,
    landed: Vec<bool>,
    /// Pieces landed in order from the start (the verifier has seen them).
    prefix: usize,
    verifier: ImageVerifier,
    error: Option<std::io::Error>,
    attempts: u32,
}

/// The loader thread's side.
struct Loader<T> {
    // Declared first so it is dropped first: it waits for reads in flight before the buffers
    // they write into are freed.
    backend: Box<dyn ReadBackend>,
    free: Vec<AlignedBuf>,
    reading: Option<Reading>,
    table: SpineTable,
    /// (layer, aligned byte range), streamed layers in model order.
    ranges: Vec<(usize, (u64, u64))>,
    /// Position in `ranges` of the next layer to read.
    next: usize,
    decode: DecodeLayer<T>,
    make_backend: MakeBackend,
    counters: Arc<SpineCounters>,
    done: Vec<(u64, std::io::Result<()>)>,
    /// Kept between layers so that reading one allocates nothing: the requests of a layer's
    /// pieces, and the landed map and verifier of the layer read last.
    reqs: Vec<ReadReq>,
    spare_landed: Vec<bool>,
    spare_verifier: ImageVerifier,
    inbox: Receiver<Msg>,
    back: Sender<Msg>,
    out: Sender<(usize, Result<T>)>,
}

impl<T> Loader<T> {
    fn position(&self, l: usize) -> Option<usize> {
        self.ranges.iter().position(|(x, _)| *x == l)
    }

    /// Handle one message; false on Stop.
    fn handle(&mut self, m: Msg) -> bool {
        match m {
            Msg::Back(b) => self.free.push(b),
            Msg::Want(l) => {
                if let Some(p) = self.position(l) {
                    self.next = p;
                    // A read of another layer in flight lands and is thrown away (`finish`).
                }
            }
            Msg::Stop => return false,
        }
        true
    }

    /// Start reading the next layer into a free buffer, if there is one.
    fn start(&mut self) {
        if self.reading.is_some() || self.ranges.is_empty() {
            return;
        }
        let Some(mut buf) = self.free.pop() else { return };
        let (layer, (lo, hi)) = self.ranges[self.next];
        self.next = (self.next + 1) % self.ranges.len();
        let len = (hi - lo) as usize;
        let pieces = len.div_ceil(PIECE);
        fill_requests(&mut self.reqs, &mut buf, lo, len);
        let mut landed = std::mem::take(&mut self.spare_landed);
        landed.clear();
        landed.resize(pieces, false);
        let mut verifier = std::mem::take(&mut self.spare_verifier);
        verifier.reset(&self.table, layer, lo);
        let mut r = Reading { layer, buf, lo, len, landed, prefix: 0, verifier, error: None, attempts: 1 };
        if let Err(e) = self.backend.submit(&self.reqs) {
            // Not taken (back-ends take all or nothing): report it as this layer's failure.
            r.error = Some(e);
            r.landed.iter_mut().for_each(|l| *l = true);
        }
        self.reading = Some(r);
    }

    /// Resubmit every piece of the layer being read (a retry).
    fn resubmit(&mut self) -> std::io::Result<()> {
        let Some(r) = self.reading.as_mut() else { return Ok(()) };
        fill_requests(&mut self.reqs, &mut r.buf, r.lo, r.len);
        r.landed.iter_mut().for_each(|l| *l = false);
        r.prefix = 0;
        r.error = None;
        r.verifier.reset(&self.table, r.layer, r.lo);
        self.counters.retries.fetch_add(1, Ordering::Relaxed);
        self.backend.submit(&self.reqs)
    }

    /// Wait for the pieces in flight; feed landed prefixes to the verifier. Returns when the
    /// layer being read has fully landed.
    fn pump(&mut self) -> Result<()> {
        loop {
            let Some(r) = self.reading.as_mut() else { return Ok(()) };
            if r.landed.iter().all(|&l| l) {
                return Ok(());
            }
            self.backend.wait(&mut self.done)?;
            let r = self.reading.as_mut().ok_or_else(|| anyhow!("spine read vanished"))?;
            for (tag, res) in self.done.drain(..) {
                let Some(slot) = r.landed.get_mut(tag as usize) else { continue };
                *slot = true;
                if let Err(e) = res {
                    r.error.get_or_insert(e);
                }
            }
            while r.prefix < r.landed.len() && r.landed[r.prefix] {
                r.prefix += 1;
            }
            if r.error.is_none() {
                let landed_to = r.lo + (r.prefix * PIECE).min(r.len) as u64;
                r.verifier.advance(&r.buf.as_slice()[..r.len], landed_to);
            }
            if self.backend.in_flight() == 0 && !r.landed.iter().all(|&l| l) {
                return Err(anyhow!("the spine read of layer {} was lost", r.layer));
            }
        }
    }

    /// The layer being read has landed: verify it, retry once if it failed, then decode it
    /// and send it to the engine (or throw it away if the engine wants another layer).
    fn finish(&mut self) -> Result<()> {
        let Some(mut r) = self.reading.take() else { return Ok(()) };
        let verified = match r.error.take() {
            Some(e) => Err(spine_fault(r.layer, FaultKind::Io, format!("{}: {e}", self.table.path().display()))),
            None => r
                .verifier
                .finish(&self.table, &r.buf.as_slice()[..r.len])
                .map_err(|e| spine_fault(r.layer, FaultKind::Checksum, e.to_string())),
        };
        self.counters.bytes_verified.fetch_add(r.verifier.bytes_hashed, Ordering::Relaxed);
        self.counters.verify_ns.fetch_add(r.verifier.hash_time.as_nanos() as u64, Ordering::Relaxed);
        if verified.is_err() && r.attempts < MAX_ATTEMPTS {
            r.attempts += 1;
            let layer = r.layer;
            self.reading = Some(r);
            match self.resubmit() {
                Ok(()) => return Ok(()),
                Err(e) => {
                    // Not taken: the buffer is free; the step fails with this layer.
                    if let Some(r) = self.reading.take() {
                        self.free.push(r.buf);
                    }
                    let e = spine_fault(
                        layer,
                        FaultKind::Io,
                        format!("re-reading from {}: {e}", self.table.path().display()),
                    );
                    let _ = self.out.send((layer, Err(e)));
                    return Ok(());
                }
            }
        }
        self.counters.bytes_read.fetch_add(r.len as u64 * u64::from(r.attempts), Ordering::Relaxed);
        let layer = r.layer;
        let result = match verified {
            Ok(()) => {
                let (lo, len) = (r.lo, r.len);
                let image: Arc<dyn ImageBytes> = Arc::new(Lease { buf: Some(r.buf), len, back: self.back.clone() });
                let img = SpineImage { table: &self.table, base: lo, image: &image, len, verified: true };
                (self.decode)(&img, layer)
                // `image` drops here; views in the decoded layer keep the buffer lent.
            }
            Err(e) => {
                self.free.push(r.buf);
                Err(e)
            }
        };
        (self.spare_landed, self.spare_verifier) = (r.landed, r.verifier);
        // The engine has hung up only when the streamer is being dropped.
        let _ = self.out.send((layer, result));
        Ok(())
    }

    /// The back-end failed (a wait that errs, a read that vanished): the layer being read fails
    /// its step, and a new back-end serves the next. Replacing the old one drops it, which lets
    /// its reads in flight land, so the buffer they wrote into is free again. False when no
    /// back-end can be built: the loader stops, and every later step says so.
    fn restart(&mut self, e: anyhow::Error) -> bool {
        let layer = self.reading.as_ref().map(|r| r.layer).unwrap_or(0);
        tracing::error!("spine loader: reading layer {layer} failed: {e:#}; starting a new back-end");
        let e = match e.downcast::<SpineFault>() {
            Ok(f) => anyhow::Error::new(f),
            Err(e) => spine_fault(layer, FaultKind::Io, format!("{}: {e:#}", self.table.path().display())),
        };
        let _ = self.out.send((layer, Err(e)));
        match (self.make_backend)() {
            Ok(b) => {
                self.backend = b;
                if let Some(r) = self.reading.take() {
                    self.free.push(r.buf);
                    (self.spare_landed, self.spare_verifier) = (r.landed, r.verifier);
                }
                self.counters.restarts.fetch_add(1, Ordering::Relaxed);
                true
            }
            Err(e) => {
                tracing::error!("spine loader stopped: no new read back-end: {e}");
                // The buffer of a lost read may still be written: leak it rather than reuse.
                if let Some(r) = self.reading.take() {
                    std::mem::forget(r.buf);
                }
                false
            }
        }
    }

    fn run(mut self) {
        let mut running = true;
        while running {
            // Take every message waiting; block for one only when there is nothing to read.
            loop {
                let m = if self.reading.is_none() && (self.free.is_empty() || self.ranges.is_empty()) {
                    match self.inbox.recv() {
                        Ok(m) => m,
                        Err(_) => {
                            running = false;
                            break;
                        }
                    }
                } else {
                    match self.inbox.try_recv() {
                        Ok(m) => m,
                        Err(_) => break,
                    }
                };
                if !self.handle(m) {
                    running = false;
                    break;
                }
            }
            if !running {
                break;
            }
            self.start();
            if self.reading.is_some() {
                let pumped = self.pump().and_then(|()| self.finish());
                if let Err(e) = pumped
                    && !self.restart(e)
                {
                    break;
                }
            }
        }
        // Let an outstanding read land before its buffer is freed.
        if self.reading.is_some() {
            let _ = self.pump();
        }
    }
}

fn spine_fault(layer: usize, kind: FaultKind, detail: String) -> anyhow::Error {
    anyhow::Error::new(SpineFault { layer, kind, detail: FaultDetail(detail) })
}

/// The requests for every piece of a layer image of `len` bytes at file offset `lo`, read into
/// `buf` (into `reqs`, which keeps its room from layer to layer).
fn fill_requests(reqs: &mut Vec<ReadReq>, buf: &mut AlignedBuf, lo: u64, len: usize) {
    let base = buf.as_mut_ptr();
    reqs.clear();
    reqs.extend((0..len.div_ceil(PIECE)).map(|i| {
        let off = i * PIECE;
        let n = PIECE.min(len - off);
        // SAFETY: `off + n <= len <= buf.len()`; the buffer is owned by the `Reading` until
        // every piece has been reported (`finish`, or the back-end's drop in `restart`).
        let buf = unsafe { base.add(off) };
        ReadReq { file: 0, offset: lo + off as u64, len: n, need: n, buf, tag: i as u64, urgent: true }
    }));
}

impl<T: Send + 'static> SpineStreamer<T> {
    /// Start the loader for `layers` of `store`'s spine; `backend` forces a reader back-end.
    pub fn start(
        store: &Store,
        layers: Vec<usize>,
        backend: Option<BackendKind>,
        activity: Option<Arc<DiskActivity>>,
        decode: DecodeLayer<T>,
    ) -> Result<Self> {
        Self::start_wrapped(store, layers, backend, activity, decode, Box::new(|b| b))
    }

    /// [`Self::start`], with every read back-end the loader builds passed through `wrap` (fault
    /// injection in tests).
    pub fn start_wrapped(
        store: &Store,
        layers: Vec<usize>,
        backend: Option<BackendKind>,
        activity: Option<Arc<DiskActivity>>,
        decode: DecodeLayer<T>,
        wrap: WrapBackend,
    ) -> Result<Self> {
        let table = store.spine_table(&layers);
        let ranges: Vec<(usize, (u64, u64))> = layers
            .iter()
            .map(|&l| table.layer_range(l).map(|r| (l, r)).ok_or_else(|| anyhow!("layer {l} has no spine tensors")))
            .collect::<Result<_>>()?;
        let max_len = ranges.iter().map(|(_, (a, b))| b - a).max().unwrap_or(4096) as usize;
        let path = table.path().to_path_buf();
        let (files, _direct) =
            open_files(std::slice::from_ref(&path), true).map_err(|e| anyhow!("opening {}: {e}", path.display()))?;
        let files = Arc::new(files);
        let remake: MakeBackend = Box::new(move || {
            let mut b = wrap(make_backend(files.clone(), backend, PIECES_IN_FLIGHT)?);
            if let Some(a) = &activity {
                b = Watched::wrap(b, a.clone(), std::slice::from_ref(&path));
            }
            Ok(b)
        });
        let backend = remake()?;
        let counters = Arc::new(SpineCounters::default());
        let (tx, inbox) = channel::<Msg>();
        let (out, resp) = channel();
        let loader = Loader {
            backend,
            free: (0..SPINE_BUFFERS).map(|_| AlignedBuf::new(max_len)).collect(),
            reading: None,
            table,
            ranges,
            next: 0,
            decode,
            make_backend: remake,
            counters: counters.clone(),
            done: Vec::new(),
            reqs: Vec::new(),
            spare_landed: Vec::new(),
            spare_verifier: ImageVerifier::default(),
            inbox,
            back: tx.clone(),
            out,
        };
        let thread = std::thread::Builder::new().name("spine-loader".into()).spawn(move || loader.run())?;
        Ok(SpineStreamer { inbox: tx, resp, thread: Some(thread), expected: layers.first().copied(), layers, counters })
    }

    /// Layer `l`'s weights (views into its image, lent until the layer is dropped).
    pub fn get(&mut self, l: usize) -> Result<T> {
        if self.expected != Some(l) {
            // The order changed (a step ended early, or a sequence restarted mid-way): layers
            // already read for the old order are thrown away as they arrive.
            self.inbox.send(Msg::Want(l)).map_err(|_| anyhow!("spine loader stopped"))?;
        }
        let pos = self.layers.iter().position(|&x| x == l).ok_or_else(|| anyhow!("layer {l} is not streamed"))?;
        self.expected = Some(self.layers[(pos + 1) % self.layers.len()]);
        loop {
            let (got, layer) = self.resp.recv().map_err(|_| anyhow!("spine loader stopped"))?;
            if got == l {
                return layer;
            }
            // Dropping it hands its buffer back.
        }
    }

    /// Seconds the loader spent verifying checksums, and bytes verified.
    pub fn verify_cost(&self) -> (Duration, u64) {
        let c = &self.counters;
        (Duration::from_nanos(c.verify_ns.load(Ordering::Relaxed)), c.bytes_verified.load(Ordering::Relaxed))
    }
}

impl<T> Drop for SpineStreamer<T> {
    fn drop(&mut self) {
        let _ = self.inbox.send(Msg::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
