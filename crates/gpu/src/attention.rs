//! Absorbed-MLA attention of a prompt chunk on the GPU (`shaders/mla.wgsl`): every head of every
//! token over the shared latent cache, causally, with an online softmax. Its oracle is the CPU's
//! `deltafin_kernels::attention::mla_attend_chunk` (`tests/attention.rs`).
//!
//! A chunk uploads the cache rows it sees once ([`MlaAttention::chunk`]: the cache is the
//! sequence's own, `MlaState`, which the CPU keeps); each call then uploads a few dozen tokens'
//! absorbed queries and reads their latent outputs back, so the buffers stay small whatever the
//! prompt.

use std::sync::Mutex;

use deltafin_kernels::format::LatentRows;

use crate::{Gpu, GpuError, GpuVec};

/// Heads per workgroup; the widest row and latent the shader holds (as in `mla.wgsl`).
const HEADS_PER_GROUP: usize = 16;
const MAX_WIDTH: usize = 576;
const MAX_KVL: usize = 512;
/// The most workgroups along one dimension of a dispatch (WebGPU's limit).
const MAX_GROUPS: usize = 65_535;

/// The attention's two pipelines (f32 and bf16 caches) and its buffers, grown to the largest
/// call seen.
pub struct MlaAttention {
    f32_cache: wgpu::ComputePipeline,
    bf16_cache: wgpu::ComputePipeline,
    work: Mutex<Option<Work>>,
}

struct Work {
    /// `[heads, s, width]` f32.
    q: GpuVec,
    /// The cache's rows, as bytes (f32 or bf16).
    cache: GpuVec,
    /// `[heads, s, kvl]` f32.
    out: GpuVec,
    staging: wgpu::Buffer,
    up: crate::buffers::Uploader,
}

const F32_ROWS: &str = "
@group(0) @binding(1) var<storage, read> cache: array<vec4<f32>>; // [positions, width]
fn cache_quad(p: u32, k: u32) -> vec4<f32> {
    return cache[p * (dims.width / 4u) + k];
}
";

// bf16 bits two to a word, the lower position in the low half (little-endian u16s).
const BF16_ROWS: &str = "
@group(0) @binding(1) var<storage, read> cache: array<u32>; // [positions, width / 2]
fn cache_quad(p: u32, k: u32) -> vec4<f32> {
    let i = p * (dims.width / 2u) + 2u * k;
    let a = cache[i];
    let b = cache[i + 1u];
    return vec4<f32>(bitcast<f32>(a << 16u), bitcast<f32>(a & 0xffff0000u), bitcast<f32>(b << 16u),
                     bitcast<f32>(b & 0xffff0000u));
}
";

impl MlaAttention {
    pub fn new(gpu: &Gpu) -> Self {
        let kernel = include_str!("shaders/mla.wgsl");
        let f32_module = gpu.module("mla f32", &format!("{kernel}\n{F32_ROWS}"));
        let bf16_module = gpu.module("mla bf16", &format!("{kernel}\n{BF16_ROWS}"));
        MlaAttention {
            f32_cache: gpu.pipeline(&f32_module, "attend", None),
            bf16_cache: gpu.pipeline(&bf16_module, "attend", None),
            work: Mutex::new(None),
        }
    }

    /// Whether the shader takes rows of `width` values whose first `kvl` are the latent (K3:
    /// 576 and 512); the caller computes other shapes on the CPU.
    pub fn supports(width: usize, kvl: usize) -> bool {
        width.is_multiple_of(4) && kvl.is_multiple_of(4) && width <= MAX_WIDTH && kvl <= MAX_KVL && kvl <= width
    }

    /// Token `i` of the chunk attends over cached positions `0 ..= first + i` (the chunk's own
    /// rows already in the cache): `s_t = q . c_t`, softmax, `o = sum_t p_t c_t[..kvl]`. Waits
    /// for the result. Shapes: q `[heads, t_n, width]` (absorbed and pre-scaled), cache `[>=
    /// first + t_n, width]`, out `[heads, t_n, kvl]` (head-major, as the value absorption
    /// takes it). One call of [`Self::chunk`]'s.
    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &self,
        gpu: &Gpu,
        q: &[f32],
        heads: usize,
        t_n: usize,
        first: usize,
        cache: LatentRows<'_>,
        width: usize,
        kvl: usize,
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        self.chunk(gpu, cache, first + t_n, width, kvl)?.attend(q, heads, t_n, first, out)
    }

    /// The first `rows` rows of a sequence's cache uploaded once, for the calls of one prompt
    /// chunk ([`ChunkAttention::attend`]), which hold this attention's buffers until dropped.
    pub fn chunk<'a>(
        &'a self,
        gpu: &'a Gpu,
        cache: LatentRows<'_>,
        rows: usize,
        width: usize,
        kvl: usize,
    ) -> Result<ChunkAttention<'a>, GpuError> {
        let what = "an MLA attention";
        if !Self::supports(width, kvl) {
            return Err(GpuError::Shape { what, why: format!("rows of {width} with a latent of {kvl}") });
        }
        let (bytes, values): (&[u8], usize) = match cache {
            LatentRows::F32(c) => (bytemuck::cast_slice(c.get(..rows * width).unwrap_or(c)), c.len()),
            LatentRows::Bf16(c) => (bytemuck::cast_slice(c.get(..rows * width).unwrap_or(c)), c.len()),
        };
        if rows == 0 || values < rows * width {
            return Err(GpuError::Shape { what, why: format!("a cache of {values} values for {rows} rows") });
        }
        let mut work = self.work.lock().unwrap_or_else(|p| p.into_inner());
        let w = match work.as_mut() {
            Some(w) => w,
            None => work.insert(Work {
                q: gpu.zeros_f32(1)?,
                cache: gpu.zeros_f32(1)?,
                out: gpu.zeros_f32(1)?,
                staging: gpu.staging(1),
                up: Default::default(),
            }),
        };
        let words = bytes.len() / 4;
        if w.cache.len < words {
            w.cache = gpu.zeros_f32(words.max(2 * w.cache.len))?;
        }
        w.up.write(gpu, &[(&w.cache.buf, 0, bytes)])?;
        let pipeline = match cache {
            LatentRows::F32(_) => &self.f32_cache,
            LatentRows::Bf16(_) => &self.bf16_cache,
        };
        Ok(ChunkAttention { gpu, pipeline, work, rows, width, kvl })
    }
}

/// A prompt chunk's attention on the GPU with its sequence's cache rows uploaded
/// ([`MlaAttention::chunk`]).
pub struct ChunkAttention<'a> {
    gpu: &'a Gpu,
    pipeline: &'a wgpu::ComputePipeline,
    work: std::sync::MutexGuard<'a, Option<Work>>,
    rows: usize,
    width: usize,
    kvl: usize,
}

impl ChunkAttention<'_> {
    /// [`MlaAttention::attend`] for `t_n` tokens from position `first` over the uploaded rows
    /// (`first + t_n` at most). Shapes: q `[heads, t_n, width]`, out `[heads, t_n, kvl]`.
    pub fn attend(
        &mut self,
        q: &[f32],
        heads: usize,
        t_n: usize,
        first: usize,
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        let (gpu, width, kvl) = (self.gpu, self.width, self.kvl);
        if heads == 0
            || t_n == 0
            || t_n > MAX_GROUPS
            || first + t_n > self.rows
            || q.len() != heads * t_n * width
            || out.len() != heads * t_n * kvl
        {
            return Err(GpuError::Shape {
                what: "an MLA attention",
                why: format!(
                    "{heads} heads x {t_n} tokens from {first} over {} rows: q {}, out {}",
                    self.rows,
                    q.len(),
                    out.len()
                ),
            });
        }
        let Some(w) = self.work.as_mut() else { unreachable!("made by MlaAttention::chunk") };
        if w.q.len < q.len() {
            w.q = gpu.zeros_f32(q.len().max(2 * w.q.len))?;
        }
        if w.out.len < out.len() {
            w.out = gpu.zeros_f32(out.len().max(2 * w.out.len))?;
            w.staging = gpu.staging(w.out.len);
        }
        w.up.write(gpu, &[(&w.q.buf, 0, bytemuck::cast_slice(q))])?;
        let dims = gpu.uniform(&[heads as u32, t_n as u32, first as u32, width as u32, kvl as u32, 0, 0, 0]);
        let bind = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("mla attention"),
            layout: &self.pipeline.get_bind_group_layout(0),
            entries: &[
                wgpu::BindGroupEntry { binding: 0, resource: w.q.buf.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 1, resource: w.cache.buf.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 2, resource: w.out.buf.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 3, resource: dims.as_entire_binding() },
            ],
        });
        let mut enc = gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("mla") });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
            pass.set_pipeline(self.pipeline);
            pass.set_bind_group(0, &bind, &[]);
            pass.dispatch_workgroups(heads.div_ceil(HEADS_PER_GROUP) as u32, t_n as u32, 1);
        }
        gpu.queue.submit([enc.finish()]);
        let ov = GpuVec { buf: w.out.buf.clone(), len: out.len() };
        gpu.read_f32_into(&ov, &w.staging, out)
    }
}
