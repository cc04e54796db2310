//! A routed expert on the GPU, `out = w2 · situ(w1 · x, w3 · x)`, for one token or a chunk: the
//! gate and up products ([`Mxfp4Product`]), SiTU element-wise (`shaders/situ.wgsl`) and the down
//! product, recorded as four dispatches of one pass (wgpu orders them: each reads what the one
//! before wrote). Its oracle is `deltafin_kernels::scalar::expert_mxfp4`, token by token
//! (`tests/expert.rs`).

use crate::mxfp4::Mxfp4Product;
use crate::product::BoundProduct;
use crate::{Gpu, GpuError, GpuMxfp4, GpuVec};

/// An expert's three MXFP4 matrices on the GPU. Shapes: w1, w3 `[inter, latent]`, w2
/// `[latent, inter]`.
pub struct GpuExpert {
    pub w1: GpuMxfp4,
    pub w3: GpuMxfp4,
    pub w2: GpuMxfp4,
}

impl GpuExpert {
    /// Upload an expert given as its three host matrices `(packed, scales)`.
    pub fn upload(
        gpu: &Gpu,
        w1: (&[u8], &[u8]),
        w3: (&[u8], &[u8]),
        w2: (&[u8], &[u8]),
        inter: usize,
        latent: usize,
    ) -> Result<Self, GpuError> {
        Ok(GpuExpert {
            w1: gpu.upload_mxfp4(w1.0, w1.1, inter, latent)?,
            w3: gpu.upload_mxfp4(w3.0, w3.1, inter, latent)?,
            w2: gpu.upload_mxfp4(w2.0, w2.1, latent, inter)?,
        })
    }

    pub fn bytes(&self) -> usize {
        self.w1.bytes() + self.w3.bytes() + self.w2.bytes()
    }

    /// An expert's buffers, written later.
    fn empty(gpu: &Gpu, inter: usize, latent: usize) -> Result<Self, GpuError> {
        Ok(GpuExpert {
            w1: gpu.empty_mxfp4(inter, latent)?,
            w3: gpu.empty_mxfp4(inter, latent)?,
            w2: gpu.empty_mxfp4(latent, inter)?,
        })
    }

    /// Record copies of every buffer of `self` into `to` (same shapes), in queue order.
    fn copy_into(&self, enc: &mut wgpu::CommandEncoder, to: &GpuExpert) {
        for (a, b) in [(&self.w1, &to.w1), (&self.w3, &to.w3), (&self.w2, &to.w2)] {
            enc.copy_buffer_to_buffer(&a.packed, 0, &b.packed, 0, a.packed.size());
            enc.copy_buffer_to_buffer(&a.scales, 0, &b.scales, 0, a.scales.size());
        }
    }
}

/// SiTU's two constants: `beta` bounds the gate, `linear_beta` (if any) the up projection.
#[derive(Clone, Copy, Debug)]
pub struct Situ {
    pub beta: f32,
    pub linear_beta: Option<f32>,
}

/// The compiled expert (its products and SiTU), made once per device.
pub struct ExpertProgram {
    products: Mxfp4Product,
    situ: wgpu::ComputePipeline,
}

/// One expert bound to its inputs and to the buffers of its intermediates and output, for up to
/// the `n` tokens it was bound for ([`BoundExpert::set_tokens`]). Shapes: xs `[n, latent]`;
/// gate, up, act `[n, inter]`; out `[n, latent]`.
pub struct BoundExpert {
    gate: BoundProduct,
    up: BoundProduct,
    down: BoundProduct,
    situ: wgpu::BindGroup,
    situ_params: wgpu::Buffer,
    situ_groups: (u32, u32),
    inter: usize,
    pub out: GpuVec,
    /// Work per call: FLOPs of the three products, and the expert's stored bytes.
    pub flops: f64,
    pub weight_bytes: f64,
    _intermediates: [GpuVec; 3],
}

impl ExpertProgram {
    pub fn new(gpu: &Gpu) -> Self {
        let situ = gpu.pipeline(&gpu.module("situ", include_str!("shaders/situ.wgsl")), "situ", None);
        ExpertProgram { products: Mxfp4Product::new(gpu), situ }
    }

    /// Bind `e` to `n` tokens of input `xs` (`[n, latent]`), with buffers for what it makes.
    pub fn bind(&self, gpu: &Gpu, e: &GpuExpert, xs: &GpuVec, n: usize, situ: Situ) -> Result<BoundExpert, GpuError> {
        let (inter, latent) = (e.w1.rows, e.w1.cols);
        if e.w3.rows != inter || e.w3.cols != latent || e.w2.rows != latent || e.w2.cols != inter {
            return Err(GpuError::Shape {
                what: "an expert",
                why: format!(
                    "w1 {inter} x {latent}, w3 {} x {}, w2 {} x {}: w3 must match w1 and w2 be its transpose's shape",
                    e.w3.rows, e.w3.cols, e.w2.rows, e.w2.cols
                ),
            });
        }
        let gate = gpu.zeros_f32(n * inter)?;
        let up = gpu.zeros_f32(n * inter)?;
        let act = gpu.zeros_f32(n * inter)?;
        let out = gpu.zeros_f32(n * latent)?;
        let g = self.products.bind(gpu, &e.w1, xs, n, &gate)?;
        let u = self.products.bind(gpu, &e.w3, xs, n, &up)?;
        let d = self.products.bind(gpu, &e.w2, &act, n, &out)?;
        let len = n * inter;
        let (bounded, lb) = match situ.linear_beta {
            Some(lb) => (1u32, lb),
            None => (0, 1.0),
        };
        let params = gpu.uniform(&[len as u32, bounded, situ.beta.to_bits(), lb.to_bits()]);
        let bind = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("situ"),
            layout: &self.situ.get_bind_group_layout(0),
            entries: &[
                wgpu::BindGroupEntry { binding: 0, resource: gate.buf.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 1, resource: up.buf.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 2, resource: act.buf.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 3, resource: params.as_entire_binding() },
            ],
        });
        Ok(BoundExpert {
            flops: g.flops + u.flops + d.flops,
            weight_bytes: e.bytes() as f64,
            gate: g,
            up: u,
            down: d,
            situ: bind,
            situ_params: params,
            situ_groups: situ_groups(len),
            inter,
            out,
            _intermediates: [gate, up, act],
        })
    }

    /// Record the expert's four dispatches into a compute pass.
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>, b: &BoundExpert) {
        b.gate.encode(pass);
        b.up.encode(pass);
        pass.set_pipeline(&self.situ);
        pass.set_bind_group(0, &b.situ, &[]);
        pass.dispatch_workgroups(b.situ_groups.0, b.situ_groups.1, 1);
        b.down.encode(pass);
    }

    /// Run the expert now and wait for it.
    pub fn run(&self, gpu: &Gpu, b: &BoundExpert) -> Result<(), GpuError> {
        gpu.run_passes(1, |pass| self.encode(pass, b))
    }
}

/// Workgroups of SiTU over `len` values (256 per group, spilling into y past 65,535).
fn situ_groups(len: usize) -> (u32, u32) {
    let groups = len.div_ceil(256);
    (groups.min(65_535) as u32, groups.div_ceil(65_535) as u32)
}

impl BoundExpert {
    /// Make the next encodings compute the first `n` tokens, at most the number it was bound
    /// for (one token only on a one-token binding, as its products' kernels differ).
    pub fn set_tokens(&mut self, gpu: &Gpu, n: usize) -> Result<(), GpuError> {
        self.gate.set_tokens(gpu, n)?;
        self.up.set_tokens(gpu, n)?;
        self.down.set_tokens(gpu, n)?;
        let len = (n * self.inter) as u32;
        gpu.queue.write_buffer(&self.situ_params, 0, &len.to_le_bytes());
        self.situ_groups = situ_groups(n * self.inter);
        self.flops = self.gate.flops + self.up.flops + self.down.flops;
        Ok(())
    }
}

/// Computes routed experts on the GPU for the model as the expert source delivers their
/// records, without a round trip per expert: each record's six parts are written into one of
/// [`SLOTS`] slots of buffers kept for the run (grown only when a chunk has more tokens than any
/// before), its dispatches and the copy of its outputs into the slot's read-back buffer are
/// submitted at once, and the engine goes back to the disk while the GPU computes. The outputs
/// come back together at [`ExpertRunner::finish`] (one wait per layer), or when every slot is
/// taken. Used through `&self` from the engine thread; the lock keeps one caller on the slots.
pub struct ExpertRunner {
    gpu: Gpu,
    program: ExpertProgram,
    inter: usize,
    latent: usize,
    situ: Situ,
    queue: std::sync::Mutex<Queue>,
}

/// Experts kept in GPU memory between uses, keyed by (layer, expert): a record the engine hands
/// over again is copied into its slot on the GPU instead of crossing the bus. The least recently
/// used entry makes room; an entry copied into a slot earlier in a round can be overwritten
/// later in it, since the queue runs the copies in order.
#[derive(Default)]
struct ExpertCache {
    capacity: usize,
    entries: std::collections::HashMap<(usize, usize), usize>,
    /// Each entry's buffers, key and last use.
    store: Vec<(GpuExpert, (usize, usize), u64)>,
    tick: u64,
    hits: u64,
    misses: u64,
}

/// Experts in flight at once: a decode step's layer (top-k = 16 in Kimi K3) fits in one round.
pub const SLOTS: usize = 16;

impl std::fmt::Debug for ExpertRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ExpertRunner({} x {} on {})", self.inter, self.latent, self.gpu.adapter())
    }
}

/// The buffers of one expert on the GPU: its matrices, and the bindings that run them for one
/// token and for a chunk.
struct Slot {
    expert: GpuExpert,
    one: Option<Work>,
    many: Option<Work>,
}

/// Inputs for up to `tokens` tokens, the expert bound to them (with its intermediates and
/// outputs), and the buffer its outputs are read back through (`[tokens, latent]` f32). A chunk's
/// binding grows (at least doubling) when a chunk has more tokens for the expert than it holds,
/// and serves every smaller one: a long prompt's experts, each with its own number of tokens, do
/// not each make buffers.
struct Work {
    tokens: usize,
    xs: GpuVec,
    bound: BoundExpert,
    staging: wgpu::Buffer,
}

/// The slots, and the experts submitted since the last [`ExpertRunner::finish`]: for each, the
/// caller's tag and its slot's binding for `n` tokens (slot i holds the i-th pending expert).
#[derive(Default)]
struct Queue {
    slots: Vec<Slot>,
    pending: Vec<(usize, usize)>,
    cache: ExpertCache,
}

impl ExpertRunner {
    /// For experts of `inter` x `latent` (the MXFP4 shapes of the model's records) with the
    /// model's SiTU constants.
    pub fn new(gpu: Gpu, inter: usize, latent: usize, situ: Situ) -> Result<Self, GpuError> {
        if inter == 0 || latent == 0 || !inter.is_multiple_of(32) || !latent.is_multiple_of(32) {
            return Err(GpuError::Shape {
                what: "an expert",
                why: format!("{inter} x {latent}: both multiples of 32"),
            });
        }
        let program = ExpertProgram::new(&gpu);
        Ok(ExpertRunner { gpu, program, inter, latent, situ, queue: std::sync::Mutex::new(Queue::default()) })
    }

    /// Keep up to `experts` experts in GPU memory between uses (0, the default: none).
    pub fn with_cache(self, experts: usize) -> Self {
        self.queue.lock().unwrap_or_else(|p| p.into_inner()).cache.capacity = experts;
        self
    }

    /// The GPU's expert cache: (capacity in experts, entries, hits, misses) so far.
    pub fn cache_stats(&self) -> (usize, usize, u64, u64) {
        let q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        (q.cache.capacity, q.cache.store.len(), q.cache.hits, q.cache.misses)
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The expert shape this runner takes: (inter, latent).
    pub fn shape(&self) -> (usize, usize) {
        (self.inter, self.latent)
    }

    /// `out[t] = w2 · situ(w1 · xs[t], w3 · xs[t])` for `n` tokens, now: [`Self::enqueue`] and
    /// [`Self::finish`] for one expert. Shapes as there; out `[n, latent]`.
    pub fn run(
        &self,
        w1: (&[u8], &[u8]),
        w3: (&[u8], &[u8]),
        w2: (&[u8], &[u8]),
        xs: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        if out.len() != n * self.latent {
            return Err(GpuError::Shape {
                what: "an expert's tokens",
                why: format!("{n} tokens of {}: out {}", self.latent, out.len()),
            });
        }
        let mut put = |_: usize, o: &[f32]| out.copy_from_slice(o);
        self.enqueue(None, w1, w3, w2, xs, n, 0, &mut put)?;
        self.finish(&mut put)
    }

    /// Submit `out[t] = w2 · situ(w1 · xs[t], w3 · xs[t])` for `n` tokens without waiting for
    /// it; its outputs (`[n, latent]`) reach `deliver(tag, ..)` at the next [`Self::finish`], or
    /// during this call when every slot was taken (the experts in flight are finished first).
    /// Shapes: each matrix as its `(packed, scales)` bytes (w1, w3 `[inter, latent]`, w2
    /// `[latent, inter]`), xs `[n, latent]`. `key` (layer, expert) names the record for the GPU's
    /// expert cache ([`Self::with_cache`]): a key it holds is computed from the cached copy and
    /// the bytes passed are not read, so one key must always name the same record.
    #[allow(clippy::too_many_arguments)]
    pub fn enqueue(
        &self,
        key: Option<(usize, usize)>,
        w1: (&[u8], &[u8]),
        w3: (&[u8], &[u8]),
        w2: (&[u8], &[u8]),
        xs: &[f32],
        n: usize,
        tag: usize,
        deliver: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<(), GpuError> {
        let (inter, latent) = (self.inter, self.latent);
        let (big, small) = (inter * latent / 2, inter * latent / 32);
        for (name, (p, s)) in [("w1", w1), ("w3", w3), ("w2", w2)] {
            if p.len() != big || s.len() != small {
                return Err(GpuError::Shape {
                    what: "an expert record",
                    why: format!("{name}: {} packed and {} scale bytes for {inter} x {latent}", p.len(), s.len()),
                });
            }
        }
        if n == 0 || xs.len() != n * latent {
            return Err(GpuError::Shape {
                what: "an expert's tokens",
                why: format!("{n} tokens of {latent}: xs {}", xs.len()),
            });
        }
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if q.pending.len() == SLOTS {
            self.finish_locked(&mut q, deliver)?;
        }
        let i = q.pending.len();
        if q.slots.len() == i {
            let expert = GpuExpert::empty(&self.gpu, inter, latent)?;
            q.slots.push(Slot { expert, one: None, many: None });
        }
        let Queue { slots, cache, .. } = &mut *q;
        let Slot { expert, one, many } = &mut slots[i];
        let work = if n == 1 { one } else { many };
        if work.as_ref().is_none_or(|w| w.tokens < n) {
            // Never in flight: slot i holds the i-th pending expert, and i is not pending yet.
            let tokens = if n == 1 { 1 } else { n.max(work.as_ref().map_or(0, |w| 2 * w.tokens)) };
            let xs = self.gpu.zeros_f32(tokens * latent)?;
            let bound = self.program.bind(&self.gpu, expert, &xs, tokens, self.situ)?;
            *work = Some(Work { tokens, xs, bound, staging: self.gpu.staging(tokens * latent) });
        }
        let Some(w) = work.as_mut() else { unreachable!("made above") };
        w.bound.set_tokens(&self.gpu, n)?;
        // Nothing fails from here to the submission: a key the cache takes on is always written.
        let mut enc = self.gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("expert") });
        let cached = self.cache_lookup(cache, key, expert, &mut enc)?;
        let wq = &self.gpu.queue;
        if !cached {
            for (m, (p, s)) in [(&expert.w1, w1), (&expert.w3, w3), (&expert.w2, w2)] {
                write_padded(wq, &m.packed, p);
                write_padded(wq, &m.scales, s);
            }
        }
        write_padded(wq, &w.xs.buf, bytemuck::cast_slice(xs));
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
            self.program.encode(&mut pass, &w.bound);
        }
        enc.copy_buffer_to_buffer(&w.bound.out.buf, 0, &w.staging, 0, (n * latent * 4) as u64);
        wq.submit([enc.finish()]);
        q.pending.push((tag, n));
        Ok(())
    }

    /// The cache's part of one expert's submission, recorded into `enc` ahead of its dispatches:
    /// a held key is copied into the slot (true: its bytes need not be written); a new key is
    /// copied from the slot (where the queue writes its bytes before `enc` runs) into a free or
    /// the least recently used entry.
    fn cache_lookup(
        &self,
        cache: &mut ExpertCache,
        key: Option<(usize, usize)>,
        slot: &GpuExpert,
        enc: &mut wgpu::CommandEncoder,
    ) -> Result<bool, GpuError> {
        let Some(key) = key.filter(|_| cache.capacity > 0) else { return Ok(false) };
        cache.tick += 1;
        if let Some(&e) = cache.entries.get(&key) {
            cache.store[e].2 = cache.tick;
            cache.hits += 1;
            cache.store[e].0.copy_into(enc, slot);
            return Ok(true);
        }
        cache.misses += 1;
        let e = if cache.store.len() < cache.capacity {
            cache.store.push((GpuExpert::empty(&self.gpu, self.inter, self.latent)?, key, 0));
            cache.store.len() - 1
        } else {
            let Some((e, _)) = cache.store.iter().enumerate().min_by_key(|(_, (_, _, used))| *used) else {
                return Ok(false);
            };
            let old = cache.store[e].1;
            cache.entries.remove(&old);
            e
        };
        cache.store[e].1 = key;
        cache.store[e].2 = cache.tick;
        cache.entries.insert(key, e);
        // The copy reads the slot after the queue has written the record into it (writes go
        // first in the submission that runs `enc`).
        slot.copy_into(enc, &cache.store[e].0);
        Ok(false)
    }

    /// Wait for every expert submitted since the last call and hand each one's outputs
    /// (`[n, latent]`) to `deliver(tag, ..)`, in the order they were submitted.
    pub fn finish(&self, deliver: &mut dyn FnMut(usize, &[f32])) -> Result<(), GpuError> {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        self.finish_locked(&mut q, deliver)
    }

    /// On an error the slots are dropped (a buffer may be left mapped): the next expert makes
    /// fresh ones.
    fn finish_locked(&self, q: &mut Queue, deliver: &mut dyn FnMut(usize, &[f32])) -> Result<(), GpuError> {
        let r = self.collect(q, deliver);
        if r.is_err() {
            // What failed may have been a cached expert's copy too.
            q.slots.clear();
            q.cache.entries.clear();
            q.cache.store.clear();
        }
        r
    }

    fn collect(&self, q: &mut Queue, deliver: &mut dyn FnMut(usize, &[f32])) -> Result<(), GpuError> {
        let pending = std::mem::take(&mut q.pending);
        if pending.is_empty() {
            return Ok(());
        }
        let staging = |i: usize, n: usize| -> Result<&wgpu::Buffer, GpuError> {
            let slot = &q.slots[i];
            match if n == 1 { &slot.one } else { &slot.many } {
                Some(w) => Ok(&w.staging),
                None => Err(GpuError::Lost("an expert in flight lost its binding".into())),
            }
        };
        let (tx, rx) = std::sync::mpsc::channel();
        for (i, &(_, n)) in pending.iter().enumerate() {
            let tx = tx.clone();
            staging(i, n)?.slice(..(n * self.latent * 4) as u64).map_async(wgpu::MapMode::Read, move |r| {
                let _ = tx.send(r);
            });
        }
        drop(tx);
        self.gpu.wait()?;
        for _ in 0..pending.len() {
            match rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(GpuError::Lost(format!("mapping an expert's outputs for reading: {e}"))),
                Err(_) => return Err(GpuError::Lost("an expert's outputs were never mapped".into())),
            }
        }
        for (i, &(tag, n)) in pending.iter().enumerate() {
            let s = staging(i, n)?;
            let slice = s.slice(..(n * self.latent * 4) as u64);
            let data = slice.get_mapped_range().map_err(|e| GpuError::Lost(format!("reading a result: {e}")))?;
            let values = bytemuck::try_cast_slice(&data)
                .map_err(|e| GpuError::Lost(format!("an expert's outputs as f32: {e}")))?;
            deliver(tag, values);
            drop(data);
            s.unmap();
        }
        Ok(())
    }
}

/// Write `bytes` at the start of `buf`, the last partial word padded with zeros (the queue
/// copies whole words).
fn write_padded(q: &wgpu::Queue, buf: &wgpu::Buffer, bytes: &[u8]) {
    let whole = bytes.len() / 4 * 4;
    if whole > 0 {
        q.write_buffer(buf, 0, &bytes[..whole]);
    }
    if whole < bytes.len() {
        let mut tail = [0u8; 4];
        tail[..bytes.len() - whole].copy_from_slice(&bytes[whole..]);
        q.write_buffer(buf, whole as u64, &tail);
    }
}
