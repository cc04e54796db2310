//! Spine weights as the model uses them: matrices behind one `Linear` type whatever their storage
//! dtype, vectors as plain f32.

use anyhow::{Context, Result, bail};
use deltafin_gpu::spine::SpineRunner;
use deltafin_kernels as k;
use deltafin_store::{LoadedTensor, SpineData, SpineSource};
use half::bf16;

/// A `[rows, cols]` weight used as `out = W x`.
pub struct Linear {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    data: SpineData,
    /// Where a prompt chunk's product runs on the GPU, settled the first time one does.
    gpu: std::sync::OnceLock<OnGpu>,
}

/// A matrix's place for prompt chunks with `--device gpu`.
#[derive(Default)]
enum OnGpu {
    /// Kept in GPU memory (within the spine's share of `--gpu-memory`).
    Resident(Box<deltafin_gpu::spine::GpuMatrix>),
    /// Past that share: sent for each product (a chunk's product costs the CPU far more than
    /// the matrix costs the bus).
    Streamed,
    /// The GPU refused it (logged): on the CPU.
    #[default]
    Cpu,
}

impl Linear {
    pub fn from_tensor(t: LoadedTensor) -> Result<Self> {
        if t.shape.len() != 2 {
            bail!("spine tensor '{}' has shape {:?}, expected a matrix", t.name, t.shape);
        }
        Ok(Linear { name: t.name, rows: t.shape[0], cols: t.shape[1], data: t.data, gpu: Default::default() })
    }

    pub fn load(store: &dyn SpineSource, name: &str) -> Result<Self> {
        Self::from_tensor(store.load_spine(name)?)
    }

    /// Load and check the shape the model expects.
    pub fn load_shaped(store: &dyn SpineSource, name: &str, rows: usize, cols: usize) -> Result<Self> {
        let l = Self::load(store, name)?;
        if (l.rows, l.cols) != (rows, cols) {
            bail!("spine tensor '{name}' is [{}, {}], the config implies [{rows}, {cols}]", l.rows, l.cols);
        }
        Ok(l)
    }

    /// Whether the weights are a view into a streamed layer's image (no copy was made).
    pub fn borrows_image(&self) -> bool {
        match &self.data {
            SpineData::F32(w) => w.is_view(),
            SpineData::Bf16(w) => w.is_view(),
            SpineData::Int8 { q, scales, .. } => q.is_view() && scales.is_view(),
        }
    }

    /// Point the views of a streamed layer's matrix at `to` ([`SpineData::rebind`]).
    pub fn rebind(&mut self, to: &std::sync::Arc<dyn deltafin_store::ImageBytes>) {
        self.data.rebind(to);
    }

    /// `out = W x`. Shapes: x `[cols]`, out `[rows]`.
    pub fn forward(&self, x: &[f32], out: &mut [f32]) {
        self.forward_rows(0, self.rows, x, out);
    }

    /// `outs[t] = W xs[t]` for `t_n` tokens (a prompt chunk), bit-identical per token to
    /// [`Self::forward`]. What changes is the loop order: a block of rows small enough to stay in
    /// the core's cache is applied to every token of a thread's share before the next block is
    /// read, so the matrix comes from memory once per share instead of once per token; int8
    /// weights go through register tiles that give, per token, the one-token kernel's bits
    /// ([`k::int8_matmat`]), the others through the same serial kernel per token. Shapes: xs
    /// `[T, cols]`, outs `[T, rows]`.
    pub fn forward_batch(&self, xs: &[f32], t_n: usize, outs: &mut [f32]) {
        let (rows, cols) = (self.rows, self.cols);
        assert!(xs.len() >= t_n * cols && outs.len() == t_n * rows);
        if t_n == 1 {
            return self.forward(&xs[..cols], outs);
        }
        if t_n >= SpineRunner::MIN_TOKENS
            && let Some(g) = crate::chunk_spine::current()
            && self.forward_batch_gpu(&g, &xs[..t_n * cols], t_n, outs)
        {
            return;
        }
        if let SpineData::Int8 { q, scales, group } = &self.data {
            let xs = &xs[..t_n * cols];
            // --approx: a chunk's inputs in int8, the product in integers where the CPU has the
            // kernel (k::approx::int8_matmat_q8 declines otherwise).
            if crate::chunk_spine::integer() && k::approx::int8_matmat_q8(q, scales, *group, rows, cols, xs, t_n, outs)
            {
                return;
            }
            return k::int8_matmat(q, scales, *group, rows, cols, xs, t_n, outs);
        }
        let esize = if matches!(self.data, SpineData::F32(_)) { 4 } else { 2 };
        // About 128 KiB of weights per block: resident in L2 while the share's tokens go by.
        let block = ((128 << 10) / (cols * esize).max(1)).clamp(1, rows.max(1));
        deltafin_kernels::par::par_rows_wide(t_n, rows * cols, rows, outs, |t0, o| {
            let n_tok = o.len() / rows.max(1);
            for r0 in (0..rows).step_by(block) {
                let n = block.min(rows - r0);
                for j in 0..n_tok {
                    let x = &xs[(t0 + j) * cols..(t0 + j + 1) * cols];
                    self.rows_serial(r0, x, &mut o[j * rows + r0..j * rows + r0 + n]);
                }
            }
        });
    }

    /// [`Self::forward_batch`] for a matrix whose inputs are an attention output or a SiTU
    /// output (`o_proj`, an MLP's `down_proj`): those carry outlier channels that int8
    /// activations blur, so approximate mode keeps these products exact. On the trained demo
    /// model, at the end of prompt chunks (`tools/demo/chunk_fidelity.py`), they made up most of
    /// the integer chunks' KL against exact mode.
    pub fn forward_batch_exact_inputs(&self, xs: &[f32], t_n: usize, outs: &mut [f32]) {
        let _exact = crate::chunk_spine::exact_here();
        self.forward_batch(xs, t_n, outs);
    }

    /// [`Self::forward_batch`] on the GPU: the matrix uploaded on first use and kept while the
    /// spine's share of GPU memory has room, else sent for each product; false (the caller
    /// computes on the CPU) when the GPU refused it or failed, which is logged: the result is
    /// the same either way, to f32 rounding. Shapes: xs `[T, cols]`, outs `[T, rows]`.
    fn forward_batch_gpu(&self, g: &SpineRunner, xs: &[f32], t_n: usize, outs: &mut [f32]) -> bool {
        let r = match self.placement(g) {
            OnGpu::Resident(m) => g.product(m, xs, t_n, outs),
            OnGpu::Streamed => g.product_streamed(self.dense_rows(0, self.rows), self.rows, self.cols, xs, t_n, outs),
            OnGpu::Cpu => return false,
        };
        match r {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("{} on the GPU failed, computed on the CPU instead: {e}", self.name);
                false
            }
        }
    }

    /// Where this matrix's chunk products run on the GPU, settled (and uploaded) on first use.
    fn placement(&self, g: &SpineRunner) -> &OnGpu {
        self.gpu.get_or_init(|| match g.upload(self.dense_rows(0, self.rows), self.rows, self.cols) {
            Ok(Some(m)) => OnGpu::Resident(Box::new(m)),
            Ok(None) => OnGpu::Streamed,
            Err(e) => {
                tracing::warn!("{} stays on the CPU: {e}", self.name);
                OnGpu::Cpu
            }
        })
    }

    /// [`Self::forward_batch`] of several matrices on the same inputs (a layer's projections of
    /// one normed input): where a prompt chunk's products go to the GPU and every matrix is kept
    /// there, the inputs cross the bus once for all of them. Shapes: xs `[T, cols]`, outs[i]
    /// `[T, rows_i]`.
    pub fn forward_batch_shared(mats: &[&Linear], xs: &[f32], t_n: usize, outs: &mut [&mut [f32]]) {
        assert_eq!(mats.len(), outs.len());
        if let Some(first) = mats.first()
            && t_n >= SpineRunner::MIN_TOKENS
            && mats.iter().all(|m| m.cols == first.cols)
            && let Some(g) = crate::chunk_spine::current()
        {
            let kept: Option<Vec<&deltafin_gpu::spine::GpuMatrix>> = mats
                .iter()
                .map(|m| match m.placement(&g) {
                    OnGpu::Resident(b) => Some(&**b),
                    _ => None,
                })
                .collect();
            if let Some(kept) = kept {
                match g.products(&kept, &xs[..t_n * first.cols], t_n, outs) {
                    Ok(()) => return,
                    Err(e) => tracing::warn!(
                        "{} and the matrices beside it on the GPU failed, computed one by one: {e}",
                        first.name
                    ),
                }
            }
        }
        for (m, o) in mats.iter().zip(outs.iter_mut()) {
            m.forward_batch(xs, t_n, o);
        }
    }

    /// Rows `r0 .. r0+n` of `W x`. Shapes: x `[cols]`, out `[n]`.
    pub fn forward_rows(&self, r0: usize, n: usize, x: &[f32], out: &mut [f32]) {
        assert_eq!(out.len(), n);
        // Rows split over the thread pool; each chunk runs the same kernel, so the result does
        // not depend on the thread count.
        deltafin_kernels::par::par_rows(n, self.cols, out, |c0, o| self.rows_serial(r0 + c0, x, o));
    }

    fn rows_serial(&self, r0: usize, x: &[f32], out: &mut [f32]) {
        let (c, n) = (self.cols, out.len());
        let span = r0 * c..(r0 + n) * c;
        match &self.data {
            SpineData::F32(w) => k::f32_matvec(&w[span], n, c, x, out),
            SpineData::Bf16(w) => k::bf16_matvec(&w[span], n, c, x, out),
            SpineData::Int8 { q, scales, group } => {
                let g = c / group;
                k::int8_matvec(&q[span], &scales[r0 * g..(r0 + n) * g], *group, n, c, x, out)
            }
        }
    }

    /// Rows `r0 .. r0+n` as a kernel view (MLA's key rows of one head, for the transposed
    /// product).
    pub fn dense_rows(&self, r0: usize, n: usize) -> k::format::Dense<'_> {
        let (c, span) = (self.cols, r0 * self.cols..(r0 + n) * self.cols);
        match &self.data {
            SpineData::F32(w) => k::format::Dense::F32(&w[span]),
            SpineData::Bf16(w) => k::format::Dense::Bf16(&w[span]),
            SpineData::Int8 { q, scales, group } => {
                let g = c / group;
                k::format::Dense::Int8 { q: &q[span], scales: &scales[r0 * g..(r0 + n) * g], group: *group }
            }
        }
    }

    /// Rows `r0 .. r0+n` of `W x` for `t_n` inputs on the calling thread (MLA's value rows of one
    /// head, while the heads share the pool), per input bit-identical to [`Self::forward_rows`]
    /// of those rows. Shapes: xs `[T, cols]`, outs `[T, n]`.
    pub fn rows_batch_serial(&self, r0: usize, n: usize, xs: &[f32], t_n: usize, outs: &mut [f32]) {
        let c = self.cols;
        assert!(xs.len() >= t_n * c && outs.len() >= t_n * n);
        if let SpineData::Int8 { q, scales, group } = &self.data
            && t_n > 1
        {
            let g = c / group;
            let (qs, ss) = (&q[r0 * c..(r0 + n) * c], &scales[r0 * g..(r0 + n) * g]);
            return k::int8_matvec_multi(qs, ss, *group, n, c, &xs[..t_n * c], t_n, &mut outs[..t_n * n], n);
        }
        for t in 0..t_n {
            self.rows_serial(r0, &xs[t * c..(t + 1) * c], &mut outs[t * n..(t + 1) * n]);
        }
    }

    /// `out += alpha * W[r, :]`: row `r` scaled into `out` (the embedding lookup).
    pub fn axpy_row(&self, r: usize, alpha: f32, out: &mut [f32]) {
        let c = self.cols;
        match &self.data {
            SpineData::F32(w) => k::ops::axpy(alpha, &w[r * c..(r + 1) * c], out),
            SpineData::Bf16(w) => {
                for (o, &b) in out.iter_mut().zip(&w[r * c..(r + 1) * c]) {
                    *o += alpha * bf16::from_bits(b).to_f32();
                }
            }
            SpineData::Int8 { q, scales, group } => {
                let g = c / group;
                for (j, (o, &v)) in out.iter_mut().zip(&q[r * c..(r + 1) * c]).enumerate() {
                    *o += alpha * scales[r * g + j / group] * v as f32;
                }
            }
        }
    }

    /// Row `r` as f32 (the embedding lookup). Shape: out `[cols]`.
    pub fn row(&self, r: usize, out: &mut [f32]) {
        out.fill(0.0);
        self.axpy_row(r, 1.0, out);
    }
}

/// A vector spine tensor as f32, with its element count checked.
pub fn load_vec(store: &dyn SpineSource, name: &str, len: usize) -> Result<Vec<f32>> {
    let t = store.load_spine(name)?;
    let v = t.to_f32();
    if v.len() != len {
        bail!("spine tensor '{name}' has {} elements, the config implies {len}", v.len());
    }
    Ok(v)
}

/// The first `len` elements of a vector tensor (K3 stores `A_log` head_dim long, `num_heads` real).
pub fn load_vec_prefix(store: &dyn SpineSource, name: &str, len: usize) -> Result<Vec<f32>> {
    let v = store.load_spine(name).with_context(|| format!("loading '{name}'"))?.to_f32();
    if v.len() < len {
        bail!("spine tensor '{name}' has {} elements, the config needs at least {len}", v.len());
    }
    Ok(v[..len].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_store::quant::{dequantize_int8, quantize_int8};

    /// Large products run row-parallel; they must equal the serial kernel bit for bit.
    #[test]
    fn parallel_forward_is_bit_identical() {
        let (rows, cols) = (1000, 700);
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1).collect();
        let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.11).sin()).collect();
        let (q, s) = quantize_int8(&w, cols, cols);
        let m = Linear {
            name: "q".into(),
            rows,
            cols,
            data: SpineData::Int8 { q: q.into(), scales: s.into(), group: cols },
            gpu: Default::default(),
        };
        let (mut a, mut b) = (vec![0f32; 900], vec![0f32; 900]);
        m.forward_rows(50, 900, &x, &mut a);
        m.rows_serial(50, &x, &mut b);
        assert!(a.iter().zip(&b).all(|(u, v)| u.to_bits() == v.to_bits()));
    }

    /// A batch of tokens gives, token by token, exactly what one token at a time gives, for
    /// every storage dtype, with blocks of rows that do not divide the matrix.
    #[test]
    fn batched_forward_is_bit_identical_to_one_token_at_a_time() {
        let rows = 301;
        // Per-row and group-wise int8 scales a multiple of 16 wide (the four-token kernel's
        // case), and an odd group with f32 and bf16 (the one-token kernels').
        let int8 = |cols: usize, group: usize| {
            let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1).collect();
            let (q, s) = quantize_int8(&w, cols, group);
            Linear {
                name: format!("q{group}"),
                rows,
                cols,
                data: SpineData::Int8 { q: q.into(), scales: s.into(), group },
                gpu: Default::default(),
            }
        };
        for m in [int8(512, 512), int8(512, 32)] {
            check_batches(&m);
        }
        let cols = 515;
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1).collect();
        let (q, s) = quantize_int8(&w, cols, 5);
        let mats = [
            Linear {
                name: "q".into(),
                rows,
                cols,
                data: SpineData::Int8 { q: q.into(), scales: s.into(), group: 5 },
                gpu: Default::default(),
            },
            Linear { name: "f".into(), rows, cols, data: SpineData::F32(w.clone().into()), gpu: Default::default() },
            Linear {
                name: "b".into(),
                rows,
                cols,
                data: SpineData::Bf16(w.iter().map(|&v| bf16::from_f32(v).to_bits()).collect::<Vec<_>>().into()),
                gpu: Default::default(),
            },
        ];
        for m in &mats {
            check_batches(m);
        }
    }

    fn check_batches(m: &Linear) {
        let (rows, cols) = (m.rows, m.cols);
        for t_n in [1, 2, 7, 40] {
            let xs: Vec<f32> = (0..t_n * cols).map(|i| (i as f32 * 0.013).sin()).collect();
            let mut batch = vec![0f32; t_n * rows];
            m.forward_batch(&xs, t_n, &mut batch);
            for t in 0..t_n {
                let mut one = vec![0f32; rows];
                m.forward(&xs[t * cols..(t + 1) * cols], &mut one);
                let got = &batch[t * rows..(t + 1) * rows];
                assert!(one.iter().zip(got).all(|(a, b)| a.to_bits() == b.to_bits()), "{} token {t}/{t_n}", m.name);
            }
        }
    }

    /// Every storage dtype must give the same products as its dequantised f32 matrix, including
    /// on row sub-ranges and transposed row accumulation (both used by MLA's absorbed heads).
    #[test]
    fn storage_dtypes_agree_on_row_ranges() {
        let (rows, cols) = (12, 64);
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.3).collect();
        let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.21).sin()).collect();
        let (q, s) = quantize_int8(&w, cols, 32);
        let deq = dequantize_int8(&q, &s, 32);
        let int8 = Linear {
            name: "q".into(),
            rows,
            cols,
            data: SpineData::Int8 { q: q.into(), scales: s.into(), group: 32 },
            gpu: Default::default(),
        };
        let f32m = Linear { name: "f".into(), rows, cols, data: SpineData::F32(deq.into()), gpu: Default::default() };
        let bf16m = Linear {
            name: "b".into(),
            rows,
            cols,
            data: SpineData::Bf16(w.iter().map(|&v| bf16::from_f32(v).to_bits()).collect::<Vec<_>>().into()),
            gpu: Default::default(),
        };
        let (mut a, mut b) = (vec![0f32; 5], vec![0f32; 5]);
        int8.forward_rows(4, 5, &x, &mut a);
        f32m.forward_rows(4, 5, &x, &mut b);
        for (u, v) in a.iter().zip(&b) {
            assert!((u - v).abs() < 1e-5, "{u} vs {v}");
        }
        let (mut a, mut b, mut c) = (vec![0f32; cols], vec![0f32; cols], vec![0f32; cols]);
        int8.axpy_row(7, 0.5, &mut a);
        f32m.axpy_row(7, 0.5, &mut b);
        bf16m.axpy_row(7, 0.5, &mut c);
        for j in 0..cols {
            assert!((a[j] - b[j]).abs() < 1e-6);
            assert!((c[j] - 0.5 * w[7 * cols + j]).abs() < 0.5 * w[7 * cols + j].abs() / 128.0 + 1e-7);
        }
    }
}
