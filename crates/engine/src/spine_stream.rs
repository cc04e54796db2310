//! Spine layers that do not fit the memory budget are read from the spine file for every token
//! by a loader thread, one layer ahead of the compute: while layer `l` computes, layer `l+1`'s
//! image is decoded and layer `l+2`'s is already being read (O_DIRECT, one aligned read per
//! layer, two buffers).

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use anyhow::{Result, anyhow};
use deltafin_store::{SpineImage, Store};

use crate::experts::RecordLayout;
use crate::k3::{Layer, load_layer};
use crate::stream::aligned::AlignedBuf;

pub struct SpineStreamer {
    req: Option<Sender<usize>>,
    resp: Receiver<(usize, Result<Layer>)>,
    thread: Option<JoinHandle<()>>,
    /// Streamed layers in model order.
    layers: Vec<usize>,
    /// The layer the loader is working on or has ready, not yet taken.
    pending: Option<usize>,
    pub bytes_read: Arc<AtomicU64>,
    top_k: Arc<AtomicUsize>,
}

impl SpineStreamer {
    pub fn start(store: &Store, layers: Vec<usize>, layout: RecordLayout) -> Result<Self> {
        // The loader gets its own handle on the store so reads need no lock.
        let own = Store::open(&store.dir, None).or_else(|_| {
            // A store whose in-place experts moved was opened with --source; the spine does not
            // need the source, so reuse the same directory and ignore expert files.
            Store::open(&store.dir, Some(&store.dir))
        })?;
        let ranges: Vec<(usize, (u64, u64))> = layers
            .iter()
            .map(|&l| own.spine_layer_range(l).map(|r| (l, r)).ok_or_else(|| anyhow!("layer {l} has no spine tensors")))
            .collect::<Result<_>>()?;
        let max_len = ranges.iter().map(|(_, (a, b))| b - a).max().unwrap_or(4096) as usize;
        let (rtx, rrx) = channel::<usize>();
        let (dtx, drx) = channel();
        let bytes_read = Arc::new(AtomicU64::new(0));
        let top_k = Arc::new(AtomicUsize::new(store.manifest.config.num_experts_per_token));
        let (br, tk) = (bytes_read.clone(), top_k.clone());
        // Two stages so the drive never waits for decoding: a reader thread fills one of two
        // aligned buffers with a layer's image while the loader decodes the other.
        let path = own.spine_path();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .or_else(|_| std::fs::File::open(&path))
            .map_err(|e| anyhow!("opening {}: {e}", path.display()))?;
        let (read_tx, read_rx) = channel::<(usize, u64, usize, AlignedBuf)>();
        let (filled_tx, filled_rx) = channel::<(usize, AlignedBuf, std::io::Result<()>)>();
        let rpath = path.clone();
        let reader = std::thread::spawn(move || {
            while let Ok((l, off, len, mut buf)) = read_rx.recv() {
                let res = file.read_exact_at(&mut buf.as_mut_slice()[..len], off);
                if filled_tx.send((l, buf, res)).is_err() {
                    return;
                }
            }
            drop(rpath);
        });
        let thread = std::thread::spawn(move || {
            let range = |l: usize| ranges.iter().find(|(x, _)| *x == l).map(|(_, r)| *r);
            let order: Vec<usize> = ranges.iter().map(|(l, _)| *l).collect();
            let mut spare = Some(AlignedBuf::new(max_len));
            let mut first = Some(AlignedBuf::new(max_len));
            let mut in_flight: Option<usize> = None;
            // Start reading `l` into a free buffer.
            let start = |l: usize, buf: AlignedBuf, in_flight: &mut Option<usize>| -> bool {
                let Some((lo, hi)) = range(l) else { return false };
                *in_flight = Some(l);
                read_tx.send((l, lo, (hi - lo) as usize, buf)).is_ok()
            };
            while let Ok(l) = rrx.recv() {
                let result = (|| -> Result<Layer> {
                    let (lo, hi) = range(l).ok_or_else(|| anyhow!("layer {l} is not streamed"))?;
                    // Wait for a read of `l` (started ahead, or started now), discarding others.
                    if in_flight != Some(l) {
                        if in_flight.take().is_some() {
                            let (_, buf, _) = filled_rx.recv().map_err(|_| anyhow!("spine reader stopped"))?;
                            spare.get_or_insert(buf);
                        }
                        let buf = spare.take().or_else(|| first.take()).ok_or_else(|| anyhow!("no spine buffer"))?;
                        start(l, buf, &mut in_flight);
                    }
                    let (got, buf, res) = filled_rx.recv().map_err(|_| anyhow!("spine reader stopped"))?;
                    in_flight = None;
                    // Keep the drive busy: read the next streamed layer while this one decodes.
                    let pos = order.iter().position(|&x| x == got).unwrap_or(0);
                    let next = order[(pos + 1) % order.len()];
                    if next != got
                        && let Some(b) = spare.take().or_else(|| first.take())
                    {
                        start(next, b, &mut in_flight);
                    }
                    let decoded = (|| -> Result<Layer> {
                        res.map_err(|e| anyhow!("reading spine layer {got} from {}: {e}", path.display()))?;
                        let len = (hi - lo) as usize;
                        br.fetch_add(len as u64, Ordering::Relaxed);
                        let image = SpineImage { store: &own, base: lo, bytes: &buf.as_slice()[..len] };
                        let mut cfg = own.manifest.config.clone();
                        cfg.num_experts_per_token = tk.load(Ordering::Relaxed);
                        load_layer(&image, &cfg, got, &layout)
                    })();
                    spare.get_or_insert(buf);
                    decoded
                })();
                if dtx.send((l, result)).is_err() {
                    break;
                }
            }
            drop(read_tx);
            // Let an outstanding read finish before its buffer is freed.
            if in_flight.is_some() {
                let _ = filled_rx.recv();
            }
            let _ = reader.join();
        });
        Ok(SpineStreamer { req: Some(rtx), resp: drx, thread: Some(thread), layers, pending: None, bytes_read, top_k })
    }

    pub fn set_top_k(&self, k: usize) {
        self.top_k.store(k, Ordering::Relaxed);
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
    pub fn get(&mut self, l: usize) -> Result<Layer> {
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

impl Drop for SpineStreamer {
    fn drop(&mut self) {
        self.req = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
