//! Spine layers that do not fit the memory budget are read from the spine file for every token
//! by a loader thread, ahead of the compute. A layer's image is read with O_DIRECT (where the
//! file system allows it) into one of two aligned buffers, in 4 MiB pieces kept in flight
//! together; each tensor's checksum is fed as the pieces land, so verifying costs the loader
//! only the last piece's hashing, never the engine thread. The model's tensors are views into
//! the image (no copy). At most two layer images exist: the one being computed and the one
//! being read.
//!
//! No allocation per token: a layer is decoded from its image once, on its first read; when the
//! engine is done with it ([`Lent`] dropped) it comes back to the loader, which points its views
//! at an empty image (so the buffer is free for the next read) and keeps it; the layer's next
//! read points the kept layer's views at the new image instead of decoding again (the same
//! offsets, bytes that passed the same checksums). A kept layer whose views do not all let go
//! of the old image is thrown away and decoded afresh next time.
//!
//! The loader does not know the model: the caller gives it the function that turns a verified
//! layer image into the model's layer type, which says how its views are re-pointed
//! ([`ImageViews`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, SyncSender, channel, sync_channel};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Result, anyhow};
use deltafin_store::{ImageBytes, ImageVerifier, SpineImage, SpineTable, Store, empty_image};

use crate::fault::{FaultDetail, FaultKind, SpineFault};

use super::activity::{DiskActivity, Watched};
use super::aligned::AlignedBuf;
use super::backend::make_backend;
use super::reader::{BackendKind, ReadBackend, ReadReq, open_files};

/// Decodes layer `l`'s verified image into the model's layer weights (runs on the loader
/// thread; the weights may keep views into the image).
pub type DecodeLayer<T> = Box<dyn Fn(&SpineImage<'_>, usize) -> Result<T> + Send>;

/// A decoded layer that the loader can keep between reads of its layer.
pub trait ImageViews {
    /// Point every view into the layer's image at `image`: an image of the same layer read
    /// again (the same offsets, bytes that passed the same checksums), or
    /// [`deltafin_store::empty_image`] while the layer is kept unused. Allocates nothing.
    fn rebind(&mut self, image: &Arc<dyn ImageBytes>);
}

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
    /// Layers decoded from their image (the first read of each, or after a failure to keep
    /// one), and layers served by pointing a kept layer at its new image.
    pub decoded: AtomicU64,
    pub rebound: AtomicU64,
}

/// A decorator applied to every read back-end the loader builds (disk activity, fault injection
/// in tests): kept, so that a back-end built after a failure reads the same way.
pub type WrapBackend = Box<dyn Fn(Box<dyn ReadBackend>) -> Box<dyn ReadBackend> + Send>;

/// Builds the loader's read back-end (again, after a failure).
type MakeBackend = Box<dyn Fn() -> std::io::Result<Box<dyn ReadBackend>> + Send>;

/// Messages to the loader.
enum Msg<T> {
    /// The engine needs layer `l` next (sent when the order changes: a sequence restarted or a
    /// step ended early).
    Want(usize),
    /// The engine is done with layer `l`, decoded from image buffer `b` ([`Lent`] dropped).
    Done {
        layer: usize,
        buf: usize,
        weights: T,
    },
    Stop,
}

/// One of the loader's image buffers: shared with the views of the layer decoded from it, and
/// written by the loader only while nothing else holds it (`Arc::get_mut`).
struct Image {
    buf: AlignedBuf,
    /// Bytes of the layer it holds.
    len: usize,
}

impl ImageBytes for Image {
    fn bytes(&self) -> &[u8] {
        &self.buf.as_slice()[..self.len]
    }
}

/// A decoded layer lent to the engine; dropping it (on every path, a panic's unwinding
/// included) hands it back to the loader, which keeps it for the layer's next read.
pub struct Lent<T> {
    layer: usize,
    buf: usize,
    /// `Some` until dropped.
    weights: Option<T>,
    back: Sender<Msg<T>>,
}

impl<T> std::ops::Deref for Lent<T> {
    type Target = T;
    fn deref(&self) -> &T {
        match &self.weights {
            Some(w) => w,
            None => unreachable!("a lent layer's weights are taken only when it is dropped"),
        }
    }
}

impl<T> Drop for Lent<T> {
    fn drop(&mut self) {
        if let Some(weights) = self.weights.take() {
            // When the loader has stopped, the weights (and their image) are simply freed.
            let _ = self.back.send(Msg::Done { layer: self.layer, buf: self.buf, weights });
        }
    }
}

/// What the loader sends the engine: a layer, the buffer its image is in, the weights.
type Response<T> = (usize, usize, Result<T>);

pub struct SpineStreamer<T> {
    inbox: Sender<Msg<T>>,
    resp: Receiver<Response<T>>,
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
    /// Index of its buffer in [`Loader::images`].
    buf: usize,
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
    /// The image buffers, and which of them are free (neither read into nor lent).
    images: Vec<Arc<Image>>,
    free: Vec<usize>,
    reading: Option<Reading>,
    table: SpineTable,
    /// (layer, aligned byte range), streamed layers in model order.
    ranges: Vec<(usize, (u64, u64))>,
    /// Position in `ranges` of the next layer to read.
    next: usize,
    decode: DecodeLayer<T>,
    /// Each streamed layer (in `ranges` order) decoded on an earlier read, kept with its views
    /// pointed at `empty` (room for `SPINE_BUFFERS` each, reserved at start).
    kept: Vec<Vec<T>>,
    empty: Arc<dyn ImageBytes>,
    make_backend: MakeBackend,
    counters: Arc<SpineCounters>,
    done: Vec<(u64, std::io::Result<()>)>,
    /// Kept between layers so that reading one allocates nothing: the requests of a layer's
    /// pieces, and the landed map and verifier of the layer read last.
    reqs: Vec<ReadReq>,
    spare_landed: Vec<bool>,
    spare_verifier: ImageVerifier,
    inbox: Receiver<Msg<T>>,
    /// Bounded, so that sending allocates nothing (an unbounded channel allocates a block per
    /// 31 messages).
    out: SyncSender<Response<T>>,
}

impl<T: ImageViews> Loader<T> {
    fn position(&self, l: usize) -> Option<usize> {
        self.ranges.iter().position(|(x, _)| *x == l)
    }

    /// Buffers that nothing holds any more (a layer dropped without coming back, a decode that
    /// kept no view) are free again.
    fn reclaim(&mut self) {
        let reading = self.reading.as_ref().map(|r| r.buf);
        for b in 0..self.images.len() {
            if Some(b) != reading && !self.free.contains(&b) && Arc::strong_count(&self.images[b]) == 1 {
                self.free.push(b);
            }
        }
    }

    /// Handle one message; false on Stop.
    fn handle(&mut self, m: Msg<T>) -> bool {
        match m {
            Msg::Done { layer, buf, mut weights } => {
                weights.rebind(&self.empty);
                let whole = self.images.get(buf).is_some_and(|i| Arc::strong_count(i) == 1);
                match self.position(layer) {
                    // Every view let go of the image: keep the layer for its next read (as many
                    // copies as buffers: one streamed layer is read into each).
                    Some(p) if whole && self.kept[p].len() < SPINE_BUFFERS => self.kept[p].push(weights),
                    // A view still holds the image: decode afresh next time.
                    _ => {
                        tracing::debug!("spine loader: layer {layer} kept a view of its image; not kept");
                        drop(weights);
                    }
                }
                self.reclaim();
            }
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
        let Some(buf) = self.free.pop() else { return };
        let (layer, (lo, hi)) = self.ranges[self.next];
        let len = (hi - lo) as usize;
        let Some(image) = Arc::get_mut(&mut self.images[buf]) else {
            // Still held (cannot happen: free buffers are held by nothing); wait for it.
            return;
        };
        self.next = (self.next + 1) % self.ranges.len();
        image.len = len;
        let pieces = len.div_ceil(PIECE);
        fill_requests(&mut self.reqs, &mut image.buf, lo, len);
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
        let Some(image) = Arc::get_mut(&mut self.images[r.buf]) else {
            return Err(std::io::Error::other("the spine image being read is held elsewhere"));
        };
        fill_requests(&mut self.reqs, &mut image.buf, r.lo, r.len);
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
                r.verifier.advance(&self.images[r.buf].buf.as_slice()[..r.len], landed_to);
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
                .finish(&self.table, &self.images[r.buf].buf.as_slice()[..r.len])
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
                    let mut buf = 0;
                    if let Some(r) = self.reading.take() {
                        self.free.push(r.buf);
                        buf = r.buf;
                    }
                    let e = spine_fault(
                        layer,
                        FaultKind::Io,
                        format!("re-reading from {}: {e}", self.table.path().display()),
                    );
                    let _ = self.out.send((layer, buf, Err(e)));
                    return Ok(());
                }
            }
        }
        self.counters.bytes_read.fetch_add(r.len as u64 * u64::from(r.attempts), Ordering::Relaxed);
        let (layer, buf) = (r.layer, r.buf);
        let result = match verified {
            Ok(()) => {
                let image: Arc<dyn ImageBytes> = self.images[buf].clone();
                match self.position(layer).and_then(|p| self.kept[p].pop()) {
                    // Read before: the kept layer looks at the new image.
                    Some(mut weights) => {
                        weights.rebind(&image);
                        self.counters.rebound.fetch_add(1, Ordering::Relaxed);
                        Ok(weights)
                    }
                    None => {
                        let img =
                            SpineImage { table: &self.table, base: r.lo, image: &image, len: r.len, verified: true };
                        self.counters.decoded.fetch_add(1, Ordering::Relaxed);
                        (self.decode)(&img, layer)
                    }
                }
                // `image` drops here; views in the layer keep the buffer lent.
            }
            Err(e) => Err(e),
        };
        (self.spare_landed, self.spare_verifier) = (r.landed, r.verifier);
        // The buffer is free again once nothing holds it (a failed read or decode: at once).
        self.reclaim();
        // The engine has hung up only when the streamer is being dropped.
        let _ = self.out.send((layer, buf, result));
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
        let buf = self.reading.as_ref().map(|r| r.buf).unwrap_or(0);
        let _ = self.out.send((layer, buf, Err(e)));
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
                // The buffer of a lost read may still be written: leak it rather than free it.
                if let Some(r) = self.reading.take() {
                    std::mem::forget(self.images[r.buf].clone());
                }
                false
            }
        }
    }

    fn run(mut self) {
        let mut running = true;
        while running {
            self.reclaim();
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

impl<T: ImageViews + Send + 'static> SpineStreamer<T> {
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
        let (tx, inbox) = channel::<Msg<T>>();
        // Room for a layer per buffer and the failures between them; a full channel holds the
        // loader back until the engine asks for the next layer.
        let (out, resp) = sync_channel(2 * SPINE_BUFFERS + 2);
        let kept = ranges.iter().map(|_| Vec::with_capacity(SPINE_BUFFERS)).collect();
        let loader = Loader {
            backend,
            images: (0..SPINE_BUFFERS).map(|_| Arc::new(Image { buf: AlignedBuf::new(max_len), len: 0 })).collect(),
            free: (0..SPINE_BUFFERS).collect(),
            reading: None,
            table,
            ranges,
            next: 0,
            decode,
            kept,
            empty: empty_image(),
            make_backend: remake,
            counters: counters.clone(),
            done: Vec::new(),
            reqs: Vec::new(),
            spare_landed: Vec::new(),
            spare_verifier: ImageVerifier::default(),
            inbox,
            out,
        };
        let thread = std::thread::Builder::new().name("spine-loader".into()).spawn(move || loader.run())?;
        Ok(SpineStreamer { inbox: tx, resp, thread: Some(thread), expected: layers.first().copied(), layers, counters })
    }

    /// Layer `l`'s weights (views into its image), lent until dropped.
    pub fn get(&mut self, l: usize) -> Result<Lent<T>> {
        if self.expected != Some(l) {
            // The order changed (a step ended early, or a sequence restarted mid-way): layers
            // already read for the old order are thrown away as they arrive.
            self.inbox.send(Msg::Want(l)).map_err(|_| anyhow!("spine loader stopped"))?;
        }
        let pos = self.layers.iter().position(|&x| x == l).ok_or_else(|| anyhow!("layer {l} is not streamed"))?;
        self.expected = Some(self.layers[(pos + 1) % self.layers.len()]);
        loop {
            let (got, buf, layer) = self.resp.recv().map_err(|_| anyhow!("spine loader stopped"))?;
            let lent = layer.map(|w| Lent { layer: got, buf, weights: Some(w), back: self.inbox.clone() });
            if got == l {
                return lent;
            }
            // Dropping it hands it back.
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
        // A loader waiting for room in the full response channel sees it closed.
        drop(std::mem::replace(&mut self.resp, sync_channel(0).1));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
