//! Spine layers that do not fit the memory budget are read from the spine file for every token
//! by a loader thread, one layer ahead of the compute: while layer `l` computes, layer `l+1`'s
//! image is decoded and layer `l+2`'s is already being read. The reads go through the same
//! back-ends as expert reads (io_uring or the pread pool, O_DIRECT where the file system
//! allows it), one aligned read per layer into one of two aligned buffers.
//!
//! The loader does not know the model: the caller gives it the function that decodes a layer
//! image into the model's layer type.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use anyhow::{Result, anyhow};
use deltafin_store::{SpineImage, SpineTable, Store};

use super::aligned::AlignedBuf;
use super::reader::{BackendKind, ReadBackend, ReadReq, make_backend, open_files};

/// Decodes layer `l`'s image into the model's layer weights (runs on the loader thread).
pub type DecodeLayer<T> = Box<dyn Fn(&SpineImage<'_>, usize) -> Result<T> + Send>;

pub struct SpineStreamer<T> {
    req: Option<Sender<usize>>,
    resp: Receiver<(usize, Result<T>)>,
    thread: Option<JoinHandle<()>>,
    /// Streamed layers in model order.
    layers: Vec<usize>,
    /// The layer the loader is working on or has ready, not yet taken.
    pending: Option<usize>,
    pub bytes_read: Arc<AtomicU64>,
}

/// The loader thread's side: the reader, its two buffers, and the layer ranges.
struct Loader<T> {
    // Declared first so it is dropped first: it waits for reads in flight before the buffers
    // they write into are freed.
    backend: Box<dyn ReadBackend>,
    bufs: [AlignedBuf; 2],
    /// Buffers not being read into.
    spare: Vec<usize>,
    /// The layer being read and its buffer.
    in_flight: Option<(usize, usize)>,
    table: SpineTable,
    /// (layer, aligned byte range), streamed layers in model order.
    ranges: Vec<(usize, (u64, u64))>,
    decode: DecodeLayer<T>,
    bytes_read: Arc<AtomicU64>,
    done: Vec<(u64, std::io::Result<()>)>,
}

impl<T> Loader<T> {
    fn range(&self, l: usize) -> Result<(u64, u64)> {
        self.ranges.iter().find(|(x, _)| *x == l).map(|(_, r)| *r).ok_or_else(|| anyhow!("layer {l} is not streamed"))
    }

    /// Start reading layer `l` into a spare buffer.
    fn start(&mut self, l: usize) -> Result<()> {
        let (lo, hi) = self.range(l)?;
        let b = self.spare.pop().ok_or_else(|| anyhow!("no spine buffer free"))?;
        let len = (hi - lo) as usize;
        let req = ReadReq {
            file: 0,
            offset: lo,
            len,
            need: len,
            buf: self.bufs[b].as_mut_ptr(),
            tag: l as u64,
            urgent: true,
        };
        if let Err(e) = self.backend.submit(&[req]) {
            // Not taken (back-ends take all or nothing): the buffer is free again.
            self.spare.push(b);
            return Err(e.into());
        }
        self.in_flight = Some((l, b));
        Ok(())
    }

    /// Wait for the read in flight; returns its layer, buffer and result.
    fn finish(&mut self) -> Result<(usize, usize, std::io::Result<()>)> {
        let (l, b) = self.in_flight.take().ok_or_else(|| anyhow!("no spine read in flight"))?;
        loop {
            self.backend.wait(&mut self.done)?;
            if let Some(i) = self.done.iter().position(|(tag, _)| *tag == l as u64) {
                let (_, res) = self.done.swap_remove(i);
                return Ok((l, b, res));
            }
            anyhow::ensure!(self.backend.in_flight() > 0, "the spine read of layer {l} was lost");
        }
    }

    /// Layer `l`, decoded; the next streamed layer's read is started before decoding.
    fn load(&mut self, l: usize) -> Result<T> {
        if self.in_flight.is_some_and(|(x, _)| x != l) {
            // A read we will not use (a sequence restarted): let it land, keep its buffer.
            let (_, b, _) = self.finish()?;
            self.spare.push(b);
        }
        if self.in_flight.is_none() {
            self.start(l)?;
        }
        let (got, b, res) = self.finish()?;
        // Keep the drive busy: read the next streamed layer while this one decodes.
        let pos = self.ranges.iter().position(|(x, _)| *x == got).unwrap_or(0);
        let next = self.ranges[(pos + 1) % self.ranges.len()].0;
        if next != got
            && let Err(e) = self.start(next)
        {
            // Only the read ahead is lost: the next load starts its own read.
            tracing::warn!("spine read ahead of layer {next} not started: {e:#}");
        }
        let decoded = (|| -> Result<T> {
            res.map_err(|e| anyhow!("reading spine layer {got} from {}: {e}", self.table.path().display()))?;
            let (lo, hi) = self.range(got)?;
            let len = (hi - lo) as usize;
            self.bytes_read.fetch_add(len as u64, Ordering::Relaxed);
            let image = SpineImage { table: &self.table, base: lo, bytes: &self.bufs[b].as_slice()[..len] };
            (self.decode)(&image, got)
        })();
        self.spare.push(b);
        decoded
    }
}

impl<T: Send + 'static> SpineStreamer<T> {
    /// Start the loader for `layers` of `store`'s spine; `backend` forces a reader back-end.
    pub fn start(
        store: &Store,
        layers: Vec<usize>,
        backend: Option<BackendKind>,
        decode: DecodeLayer<T>,
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
        let backend = make_backend(Arc::new(files), backend, 2)?;
        let bytes_read = Arc::new(AtomicU64::new(0));
        let mut loader = Loader {
            backend,
            bufs: [AlignedBuf::new(max_len), AlignedBuf::new(max_len)],
            spare: vec![1, 0],
            in_flight: None,
            table,
            ranges,
            decode,
            bytes_read: bytes_read.clone(),
            done: Vec::new(),
        };
        let (rtx, rrx) = channel::<usize>();
        let (dtx, drx) = channel();
        let thread = std::thread::Builder::new().name("spine-loader".into()).spawn(move || {
            while let Ok(l) = rrx.recv() {
                if dtx.send((l, loader.load(l))).is_err() {
                    break;
                }
            }
            // Let an outstanding read land before its buffer is freed.
            if loader.in_flight.is_some() {
                let _ = loader.finish();
            }
        })?;
        Ok(SpineStreamer { req: Some(rtx), resp: drx, thread: Some(thread), layers, pending: None, bytes_read })
    }

    fn request(&mut self, l: usize) -> Result<()> {
        self.req
            .as_ref()
            .ok_or_else(|| anyhow!("spine loader stopped"))?
            .send(l)
            .map_err(|_| anyhow!("spine loader stopped"))?;
        self.pending = Some(l);
        Ok(())
    }

    /// Layer `l`'s weights; starts loading the next streamed layer before returning.
    pub fn get(&mut self, l: usize) -> Result<T> {
        if self.pending != Some(l) {
            // Drain a load we will not use (a sequence restarted), then ask for this one.
            if self.pending.take().is_some() {
                let _ = self.resp.recv();
            }
            self.request(l)?;
        }
        let (got, layer) = self.resp.recv().map_err(|_| anyhow!("spine loader stopped"))?;
        self.pending = None;
        if got != l {
            return Err(anyhow!("spine loader returned layer {got} for {l}"));
        }
        let layer = layer?;
        let pos = self.layers.iter().position(|&x| x == l).unwrap_or(0);
        let next = self.layers[(pos + 1) % self.layers.len()];
        self.request(next)?;
        Ok(layer)
    }
}

impl<T> Drop for SpineStreamer<T> {
    fn drop(&mut self) {
        self.req = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
