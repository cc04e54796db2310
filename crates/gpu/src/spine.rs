//! The spine's products, MLA attention and KDA's recurrence of a prompt chunk on the GPU: each int8, bf16 or f32 matrix is uploaded
//! the first time a chunk needs it and stays for the run while a GPU memory budget has room
//! (past it, the matrix stays on the CPU); a chunk's inputs go up and its outputs come back with
//! one wait per product. Decode steps (one token) stay on the CPU: their products are
//! memory-bound there too, and a round trip per product would cost more than it saves.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use deltafin_kernels::format::{Dense, LatentRows};

use crate::attention::{ChunkAttention, MlaAttention};
use crate::dense::DenseProduct;
use crate::int8::Int8Product;
use crate::kda::KdaRecurrence;
use crate::{DenseValues, Gpu, GpuDense, GpuError, GpuInt8, GpuVec};

/// A spine matrix in GPU memory; its bytes go back to the budget when it is dropped.
pub struct GpuMatrix {
    m: Matrix,
    bytes: usize,
    used: Arc<AtomicUsize>,
}

enum Matrix {
    Int8(GpuInt8),
    Dense(GpuDense),
}

impl GpuMatrix {
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for GpuMatrix {
    fn drop(&mut self) {
        self.used.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Runs spine products of chunks on one GPU within a memory budget.
pub struct SpineRunner {
    gpu: Gpu,
    int8: Int8Product,
    dense: DenseProduct,
    mla: MlaAttention,
    budget: usize,
    used: Arc<AtomicUsize>,
    /// Inputs, outputs and the read-back buffer, grown to the largest product seen.
    work: Mutex<Option<Work>>,
    /// Nanoseconds callers spent in [`Self::upload`] and [`Self::product`] (transfers and
    /// waits included): what a prompt's phases report as their time on the GPU.
    busy_ns: AtomicU64,
    /// Tokens whose MLA attention ran here, summed over layers.
    mla_tokens: AtomicU64,
    /// Buffers for matrices past the budget, which pass through a product at a time.
    streamed: Mutex<crate::buffers::Streamed>,
    /// Bytes of such matrices sent so far.
    streamed_bytes: AtomicU64,
    /// Bytes of products' inputs sent so far.
    input_bytes: AtomicU64,
    /// KDA's recurrence, made on first use for the model's head size.
    kda: Mutex<Vec<Arc<KdaRecurrence>>>,
    /// Tokens whose KDA recurrence ran here, summed over layers.
    kda_tokens: AtomicU64,
}

struct Work {
    xs: GpuVec,
    out: GpuVec,
    staging: wgpu::Buffer,
    up: crate::buffers::Uploader,
}

impl std::fmt::Debug for SpineRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SpineRunner({} of {} bytes on {})", self.used(), self.budget, self.gpu.adapter())
    }
}

impl SpineRunner {
    /// Chunks of fewer tokens stay on the CPU: below this, a product's inputs and outputs cost
    /// the bus about what the GPU saves.
    pub const MIN_TOKENS: usize = 16;

    /// `budget`: bytes of spine matrices kept on the GPU at most.
    pub fn new(gpu: Gpu, budget: usize) -> Self {
        SpineRunner {
            int8: Int8Product::new(&gpu),
            dense: DenseProduct::new(&gpu),
            mla: MlaAttention::new(&gpu),
            gpu,
            budget,
            used: Arc::new(AtomicUsize::new(0)),
            work: Mutex::new(None),
            busy_ns: AtomicU64::new(0),
            mla_tokens: AtomicU64::new(0),
            streamed: Mutex::new(Default::default()),
            streamed_bytes: AtomicU64::new(0),
            input_bytes: AtomicU64::new(0),
            kda: Mutex::new(Vec::new()),
            kda_tokens: AtomicU64::new(0),
        }
    }

    /// A prompt chunk's absorbed-MLA attention over its sequence's cache, whose first `rows`
    /// rows go up now ([`MlaAttention::chunk`]); its calls ([`SpineAttention::attend`]) are
    /// counted in [`Self::busy_seconds`].
    pub fn mla_chunk<'a>(
        &'a self,
        cache: LatentRows<'_>,
        rows: usize,
        width: usize,
        kvl: usize,
    ) -> Result<SpineAttention<'a>, GpuError> {
        let start = std::time::Instant::now();
        let inner = self.mla.chunk(&self.gpu, cache, rows, width, kvl);
        self.count(start);
        Ok(SpineAttention { runner: self, inner: inner? })
    }

    /// KDA's recurrence over `t_n` tokens of a chunk for every head of a layer
    /// ([`KdaRecurrence::run`], whose shapes it takes: heads of `s.len() / heads` squared),
    /// counted in [`Self::busy_seconds`].
    #[allow(clippy::too_many_arguments)]
    pub fn kda_recur(
        &self,
        s: &mut [f32],
        q: &[f32],
        k: &[f32],
        g: &[f32],
        v: &[f32],
        beta: &[f32],
        heads: usize,
        t_n: usize,
        y: &mut [f32],
    ) -> Result<(), GpuError> {
        let start = std::time::Instant::now();
        let d = (s.len() / heads.max(1)).isqrt();
        let rec = {
            let mut made = self.kda.lock().unwrap_or_else(|p| p.into_inner());
            match made.iter().find(|r| r.head_dim() == d) {
                Some(r) => r.clone(),
                None => {
                    let r = Arc::new(KdaRecurrence::new(&self.gpu, d)?);
                    made.push(r.clone());
                    r
                }
            }
        };
        let r = rec.run(&self.gpu, s, q, k, g, v, beta, heads, t_n, y);
        self.count(start);
        if r.is_ok() {
            self.kda_tokens.fetch_add(t_n as u64, Ordering::Relaxed);
        }
        r
    }

    /// Tokens whose KDA recurrence ran on the GPU so far, summed over layers.
    pub fn kda_tokens(&self) -> u64 {
        self.kda_tokens.load(Ordering::Relaxed)
    }

    /// Tokens whose MLA attention ran on the GPU so far, summed over layers.
    pub fn mla_tokens(&self) -> u64 {
        self.mla_tokens.load(Ordering::Relaxed)
    }

    /// Seconds callers have spent uploading matrices, waiting for products and for attention so
    /// far.
    pub fn busy_seconds(&self) -> f64 {
        self.busy_ns.load(Ordering::Relaxed) as f64 * 1e-9
    }

    fn count(&self, since: std::time::Instant) {
        self.busy_ns.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Bytes of matrices on the GPU now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Upload a spine matrix (`[rows, cols]`, as the model holds it) if the budget has room for it (`Ok(None)` when it has not: the caller
    /// keeps computing it on the CPU).
    pub fn upload(&self, w: Dense<'_>, rows: usize, cols: usize) -> Result<Option<GpuMatrix>, GpuError> {
        let bytes = match w {
            Dense::F32(v) => v.len() * 4,
            Dense::Bf16(v) => v.len() * 2,
            Dense::Int8 { q, scales, .. } => q.len() + scales.len() * 4,
        };
        // Claimed before the upload, so two callers cannot both take the last room.
        let claimed = self
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| (u + bytes <= self.budget).then_some(u + bytes));
        if claimed.is_err() {
            return Ok(None);
        }
        let start = std::time::Instant::now();
        let m = match w {
            Dense::F32(v) => self.gpu.upload_dense(DenseValues::F32(v), rows, cols).map(Matrix::Dense),
            Dense::Bf16(v) => self.gpu.upload_dense(DenseValues::Bf16(v), rows, cols).map(Matrix::Dense),
            Dense::Int8 { q, scales, group } => self.gpu.upload_int8(q, scales, group, rows, cols).map(Matrix::Int8),
        };
        self.count(start);
        match m {
            Ok(m) => Ok(Some(GpuMatrix { m, bytes, used: self.used.clone() })),
            Err(e) => {
                self.used.fetch_sub(bytes, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// `out[t] = W xs[t]` for `n` tokens, waiting for the result. Shapes: xs `[n, cols]`, out
    /// `[n, rows]`.
    pub fn product(&self, m: &GpuMatrix, xs: &[f32], n: usize, out: &mut [f32]) -> Result<(), GpuError> {
        let start = std::time::Instant::now();
        let r = self.product_inner(&m.m, xs, n, out);
        self.count(start);
        r
    }

    /// `out[t] = W xs[t]` for a matrix the budget has no room for: its bytes go to the GPU for
    /// this product alone (into buffers kept for such matrices), which for a prompt chunk costs
    /// the bus far less than the product costs the CPU. Shapes: w `[rows, cols]`, xs `[n,
    /// cols]`, out `[n, rows]`.
    pub fn product_streamed(
        &self,
        w: Dense<'_>,
        rows: usize,
        cols: usize,
        xs: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        let start = std::time::Instant::now();
        let r = (|| {
            let mut streamed = self.streamed.lock().unwrap_or_else(|p| p.into_inner());
            let (m, bytes) = match w {
                Dense::F32(v) => {
                    (Matrix::Dense(self.gpu.write_dense(DenseValues::F32(v), rows, cols, &mut streamed)?), v.len() * 4)
                }
                Dense::Bf16(v) => {
                    (Matrix::Dense(self.gpu.write_dense(DenseValues::Bf16(v), rows, cols, &mut streamed)?), v.len() * 2)
                }
                Dense::Int8 { q, scales, group } => (
                    Matrix::Int8(self.gpu.write_int8(q, scales, group, rows, cols, &mut streamed)?),
                    q.len() + scales.len() * 4,
                ),
            };
            self.streamed_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
            // The streamed buffers stay locked until the product has read them.
            self.product_inner(&m, xs, n, out)
        })();
        self.count(start);
        r
    }

    /// Bytes of matrices past the budget sent to the GPU for single products so far.
    pub fn streamed_bytes(&self) -> u64 {
        self.streamed_bytes.load(Ordering::Relaxed)
    }

    fn product_inner(&self, m: &Matrix, xs: &[f32], n: usize, out: &mut [f32]) -> Result<(), GpuError> {
        self.products_inner(&[m], xs, n, &mut [out])
    }

    /// `outs[i][t] = W_i xs[t]` for several matrices of the same width on the same inputs: the
    /// inputs go up once, each product's outputs come back in turn. Shapes: xs `[n, cols]`,
    /// outs[i] `[n, rows_i]`.
    pub fn products(&self, ms: &[&GpuMatrix], xs: &[f32], n: usize, outs: &mut [&mut [f32]]) -> Result<(), GpuError> {
        let start = std::time::Instant::now();
        let inner: Vec<&Matrix> = ms.iter().map(|m| &m.m).collect();
        let r = self.products_inner(&inner, xs, n, outs);
        self.count(start);
        r
    }

    /// Bytes of inputs sent to the GPU for spine products so far.
    pub fn input_bytes(&self) -> u64 {
        self.input_bytes.load(Ordering::Relaxed)
    }

    fn products_inner(&self, ms: &[&Matrix], xs: &[f32], n: usize, outs: &mut [&mut [f32]]) -> Result<(), GpuError> {
        let shape = |m: &Matrix| match m {
            Matrix::Int8(w) => (w.rows, w.cols),
            Matrix::Dense(w) => (w.rows, w.cols),
        };
        let bad = ms.len() != outs.len()
            || ms.is_empty()
            || ms.iter().zip(outs.iter()).any(|(m, o)| {
                let (rows, cols) = shape(m);
                n == 0 || xs.len() != n * cols || o.len() != n * rows
            });
        if bad {
            let shapes: Vec<String> = ms.iter().map(|m| format!("{:?}", shape(m))).collect();
            let lens: Vec<usize> = outs.iter().map(|o| o.len()).collect();
            return Err(GpuError::Shape {
                what: "a spine product",
                why: format!("{} for {n} tokens: xs {}, outs {lens:?}", shapes.join(", "), xs.len()),
            });
        }
        let most = outs.iter().map(|o| o.len()).max().unwrap_or(0);
        let mut work = self.work.lock().unwrap_or_else(|p| p.into_inner());
        if work.as_ref().is_none_or(|w| w.xs.len < xs.len() || w.out.len < most) {
            let (nx, no) = match work.as_ref() {
                Some(w) => (w.xs.len.max(xs.len()), w.out.len.max(most)),
                None => (xs.len(), most),
            };
            *work = Some(Work {
                xs: self.gpu.zeros_f32(nx)?,
                out: self.gpu.zeros_f32(no)?,
                staging: self.gpu.staging(no),
                up: work.take().map(|w| w.up).unwrap_or_default(),
            });
        }
        let Some(w) = work.as_mut() else { unreachable!("made above") };
        w.up.write(&self.gpu, &[(&w.xs.buf, 0, bytemuck::cast_slice(xs))])?;
        self.input_bytes.fetch_add((xs.len() * 4) as u64, Ordering::Relaxed);
        let xv = GpuVec { buf: w.xs.buf.clone(), len: xs.len() };
        for (m, out) in ms.iter().zip(outs.iter_mut()) {
            let ov = GpuVec { buf: w.out.buf.clone(), len: out.len() };
            let bound = match m {
                Matrix::Int8(g) => self.int8.bind(&self.gpu, g, &xv, n, &ov)?,
                Matrix::Dense(g) => self.dense.bind(&self.gpu, g, &xv, n, &ov)?,
            };
            let mut enc =
                self.gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("spine") });
            {
                let mut pass =
                    enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
                bound.encode(&mut pass);
            }
            self.gpu.queue.submit([enc.finish()]);
            // Copies the outputs behind the product and waits for both.
            self.gpu.read_f32_into(&ov, &w.staging, out)?;
        }
        Ok(())
    }
}

/// A prompt chunk's MLA attention on the runner's GPU ([`SpineRunner::mla_chunk`]).
pub struct SpineAttention<'a> {
    runner: &'a SpineRunner,
    inner: ChunkAttention<'a>,
}

impl SpineAttention<'_> {
    /// [`ChunkAttention::attend`], whose shapes it takes, timed and its tokens counted.
    pub fn attend(
        &mut self,
        q: &[f32],
        heads: usize,
        t_n: usize,
        first: usize,
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        let start = std::time::Instant::now();
        let r = self.inner.attend(q, heads, t_n, first, out);
        self.runner.count(start);
        if r.is_ok() {
            self.runner.mla_tokens.fetch_add(t_n as u64, Ordering::Relaxed);
        }
        r
    }
}
