//! Multi-head latent attention without positional encoding (K3's NoPE MLA), with an optional
//! sigmoid output gate.
//!
//! Decode caches only the compressed latent (`kv_lora`, RMS-normed) and the `rope` channels of
//! each position; the key and value projections are absorbed into the query and the output:
//! `score = scale * (q_nope^T W_k c + q_pe^T k_pe)` is computed as `(W_k^T q_nope) . c`, and the
//! value `W_v (sum_t p_t c_t)`. K3 projects and caches the 64 "rope" channels but never rotates
//! them.
//!
//! Absorbed, all heads attend over one shared cache (multi-query attention), so a chunk's
//! attention is matrix work: the key absorption of every head and token at once (a transposed
//! product against each head's key rows of `kv_b`), one pass over the cache per token for all
//! its heads (`kernels::attention::mla_attend_chunk`), and the value absorption as a batched
//! product over each head's value rows; the heads run on the thread pool (with `--device gpu`
//! a prompt chunk's attention runs on the GPU, `deltafin_gpu::attention`). The cache holds the
//! latent and rope channels of each position together, in bf16 (the default) or f32.

use anyhow::Result;
use deltafin_kernels::attention::{LatentRows, mla_attend_chunk, mla_attend_scratch};
use deltafin_kernels::format::f32_to_bf16;
use deltafin_kernels::matvec::vecmat;
use deltafin_kernels::ops::{rms_norm_inplace, sigmoid};
use deltafin_kernels::par::PAR_MIN_WEIGHTS;
use deltafin_store::{K3Config, SpineSource};
use rayon::prelude::*;

use deltafin_gpu::attention::MlaAttention;
use deltafin_gpu::spine::SpineRunner;

use crate::scratch::Scratch;
use crate::weights::{Linear, load_vec};

/// Tokens of a chunk whose absorbed queries and latent outputs are held at once (the attention's
/// working set is this many tokens, whatever the chunk: the memory plan counts it once,
/// [`Mla::working_bytes`]).
pub const ATTENTION_TOKENS: usize = 32;

/// Tokens per call when the GPU takes the attention of a prompt chunk (`--device gpu`): more
/// than the CPU's, so that a call fills the GPU (16 heads of a token per workgroup: 384
/// workgroups on K3) and its round trip is shared by more work.
pub const GPU_ATTENTION_TOKENS: usize = 64;

/// A chunk of at least this many tokens does its element-wise work (the query's scale, the
/// output gate, the heads' outputs put in token order) on the thread pool.
const PARALLEL_ROWS_TOKENS: usize = 64;

/// How the latent cache stores its values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LatentDtype {
    /// bf16, accumulated in f32: half the memory and the bandwidth of f32 (the default).
    Bf16,
    /// f32: what an f32 spine's exactness studies compare against.
    F32,
}

impl LatentDtype {
    pub fn bytes(self) -> usize {
        match self {
            LatentDtype::Bf16 => 2,
            LatentDtype::F32 => 4,
        }
    }

    /// The default for a spine stored as `spine`: f32 with an f32 spine (exactness studies; the
    /// reference keeps an f32 model's cache in f32), else bf16.
    pub fn auto(spine: deltafin_store::manifest::SpineDtype) -> Self {
        if spine == deltafin_store::manifest::SpineDtype::F32 { LatentDtype::F32 } else { LatentDtype::Bf16 }
    }

    pub fn name(self) -> &'static str {
        match self {
            LatentDtype::Bf16 => "bf16",
            LatentDtype::F32 => "f32",
        }
    }
}

impl std::str::FromStr for LatentDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "bf16" => Ok(LatentDtype::Bf16),
            "f32" => Ok(LatentDtype::F32),
            o => Err(format!("unknown latent cache dtype '{o}' (bf16 or f32)")),
        }
    }
}

/// The reference's q_a/kv_a layer norms use a fixed eps, not the model's rms_norm_eps.
const LORA_NORM_EPS: f32 = 1e-6;

pub enum QProj {
    /// `q_b (norm (q_a x))`.
    LowRank {
        a: Linear,
        norm: Vec<f32>,
        b: Linear,
    },
    Full(Linear),
}

pub struct Mla {
    pub heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub v_dim: usize,
    pub kv_lora: usize,
    pub q: QProj,
    /// `[kv_lora + rope, H]`.
    pub kv_a: Linear,
    /// `[kv_lora]`.
    pub kv_a_norm: Vec<f32>,
    /// `[heads * (nope + v), kv_lora]`: per head, `nope` key rows then `v` value rows.
    pub kv_b: Linear,
    pub gate: Option<Linear>,
    pub o_proj: Linear,
}

/// The cached rows `[t, kv_lora + rope]` of one MLA layer: per position the normed latent, then
/// the rope channels.
pub enum LatentCache {
    F32(Vec<f32>),
    /// bf16 bits.
    Bf16(Vec<u16>),
}

/// Per-sequence cache of one MLA layer.
pub struct MlaState {
    pub cache: LatentCache,
    pub len: usize,
    /// Values per position of the latent and of the rope channels (the model's widths: what a
    /// restored snapshot is checked against).
    pub kv_lora: usize,
    pub rope: usize,
}

impl MlaState {
    /// A cache with room for `tokens` positions reserved up front, so decoding within that
    /// context never reallocates.
    pub fn with_capacity(tokens: usize, kv_lora: usize, rope: usize, dtype: LatentDtype) -> Self {
        let n = tokens * (kv_lora + rope);
        let cache = match dtype {
            LatentDtype::F32 => LatentCache::F32(Vec::with_capacity(n)),
            LatentDtype::Bf16 => LatentCache::Bf16(Vec::with_capacity(n)),
        };
        MlaState { cache, len: 0, kv_lora, rope }
    }

    /// Values per cached position.
    pub fn width(&self) -> usize {
        self.kv_lora + self.rope
    }

    pub fn dtype(&self) -> LatentDtype {
        match self.cache {
            LatentCache::F32(_) => LatentDtype::F32,
            LatentCache::Bf16(_) => LatentDtype::Bf16,
        }
    }

    /// Append one position's row (rounded to the cache's dtype). Shape: row `[kv_lora + rope]`.
    pub fn push(&mut self, row: &[f32]) {
        debug_assert_eq!(row.len(), self.width());
        match &mut self.cache {
            LatentCache::F32(v) => v.extend_from_slice(row),
            LatentCache::Bf16(v) => v.extend(row.iter().map(|&x| f32_to_bf16(x))),
        }
        self.len += 1;
    }

    /// Append `tokens` positions of deterministic pseudo-random values in [-1, 1) (the scale of a
    /// normed latent and of rotated rope channels), for timing attention at a context without
    /// computing the prompt that would have made it (`bench --context-fill`).
    pub fn push_synthetic(&mut self, tokens: usize, seed: u64) {
        let mut x = seed | 1;
        let mut row = vec![0f32; self.width()]; // [kv_lora + rope]
        for _ in 0..tokens {
            for v in row.iter_mut() {
                // xorshift64*: cheap, deterministic, and good enough to make scores differ.
                x ^= x >> 12;
                x ^= x << 25;
                x ^= x >> 27;
                let r = x.wrapping_mul(0x2545_F491_4F6C_DD1D);
                *v = (r >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            }
            self.push(&row);
        }
    }

    /// The cached rows, for the attention kernel.
    pub fn rows(&self) -> LatentRows<'_> {
        match &self.cache {
            LatentCache::F32(v) => LatentRows::F32(v),
            LatentCache::Bf16(v) => LatentRows::Bf16(v),
        }
    }

    /// Make this cache hold `other`'s positions (no reallocation within the reserved context).
    /// Both must have the same dtype.
    pub fn copy_from(&mut self, other: &MlaState) {
        match (&mut self.cache, &other.cache) {
            (LatentCache::F32(a), LatentCache::F32(b)) => {
                a.clear();
                a.extend_from_slice(b);
            }
            (LatentCache::Bf16(a), LatentCache::Bf16(b)) => {
                a.clear();
                a.extend_from_slice(b);
            }
            _ => panic!("latent caches of different dtypes"),
        }
        self.len = other.len;
    }
}

impl Mla {
    pub fn load(store: &dyn SpineSource, prefix: &str, c: &K3Config) -> Result<Self> {
        let h = c.hidden_size;
        let nh = c.num_attention_heads;
        let (nope, rope, vd, kvl) = (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank);
        let lin = |n: &str, r, cols| Linear::load_shaped(store, &format!("{prefix}{n}.weight"), r, cols);
        let q = match c.q_lora_rank {
            Some(r) => QProj::LowRank {
                a: lin("q_a_proj", r, h)?,
                norm: load_vec(store, &format!("{prefix}q_a_layernorm.weight"), r)?,
                b: lin("q_b_proj", nh * (nope + rope), r)?,
            },
            None => QProj::Full(lin("q_proj", nh * (nope + rope), h)?),
        };
        Ok(Mla {
            heads: nh,
            nope,
            rope,
            v_dim: vd,
            kv_lora: kvl,
            q,
            kv_a: lin("kv_a_proj_with_mqa", kvl + rope, h)?,
            kv_a_norm: load_vec(store, &format!("{prefix}kv_a_layernorm.weight"), kvl)?,
            kv_b: lin("kv_b_proj", nh * (nope + vd), kvl)?,
            gate: if c.mla_use_output_gate { Some(lin("g_proj", nh * vd, h)?) } else { None },
            o_proj: lin("o_proj", h, nh * vd)?,
        })
    }

    /// One token. Shapes: x `[hidden]` (already normed), out `[hidden]`.
    pub fn forward(&self, st: &mut MlaState, x: &[f32], out: &mut [f32], sc: &mut Scratch) {
        self.forward_chunk(st, x, 1, out, sc)
    }

    /// Bytes of the attention's working set for a chunk (absorbed queries `[heads, width]`, latent
    /// outputs `[heads, kv_lora]` x 2, value-absorbed outputs `[heads, v]` and the attention
    /// kernel's scratch, for [`ATTENTION_TOKENS`] tokens, or [`GPU_ATTENTION_TOKENS`] where the
    /// GPU attends, whichever is larger), held besides the chunk's per-token buffers.
    pub fn working_bytes(heads: usize, kv_lora: usize, rope: usize, v_dim: usize) -> usize {
        let width = kv_lora + rope;
        // The larger of the CPU's and the GPU's groups of tokens (the GPU's falls back to the
        // CPU's kernel on a failure, with the same buffers).
        [ATTENTION_TOKENS, GPU_ATTENTION_TOKENS]
            .iter()
            .map(|&n| {
                let kernel = mla_attend_scratch(heads, n, width).max(mla_attend_scratch(heads, 1, width));
                4 * (n * heads * (width + 2 * kv_lora + v_dim) + kernel)
            })
            .max()
            .unwrap_or(0)
    }

    /// `t_n` tokens in order, causally: the chunk's projections at once (each matrix read once
    /// per share of tokens), every token's latent row appended to the cache, then the
    /// attention of up to [`ATTENTION_TOKENS`] tokens at a time (key absorption, one pass over
    /// the cache per token for all heads, value absorption; heads and tokens on the thread
    /// pool; the attention on the GPU, [`GPU_ATTENTION_TOKENS`] at a time, when the chunk's
    /// spine products go there), then the output projection of the chunk. Per token the arithmetic does not depend
    /// on the chunk or the thread count. Shapes: xs, outs `[T, hidden]` (xs already normed).
    pub fn forward_chunk(&self, st: &mut MlaState, xs: &[f32], t_n: usize, outs: &mut [f32], sc: &mut Scratch) {
        let (nh, nope, rope, vd, kvl) = (self.heads, self.nope, self.rope, self.v_dim, self.kv_lora);
        let qd = nope + rope;
        let width = kvl + rope;
        let mut q = sc.take(t_n * nh * qd); // [T, heads, nope + rope]
        let mut ckv = sc.take(t_n * width); // [T, kv_lora + rope]
        match &self.q {
            QProj::LowRank { a, norm, b } => {
                let r = a.rows;
                let mut t = sc.take(t_n * r); // [T, q_lora]
                // Both projections of the normed input at once (on the GPU, it goes up once).
                Linear::forward_batch_shared(&[a, &self.kv_a], xs, t_n, &mut [&mut t, &mut ckv]);
                for i in 0..t_n {
                    rms_norm_inplace(&mut t[i * r..(i + 1) * r], norm, LORA_NORM_EPS);
                }
                b.forward_batch(&t, t_n, &mut q);
                sc.give(t);
            }
            QProj::Full(p) => Linear::forward_batch_shared(&[p, &self.kv_a], xs, t_n, &mut [&mut q, &mut ckv]),
        }
        // The softmax scale goes into the query (nope and rope parts) before the absorption.
        let scale = (qd as f32).powf(-0.5);
        // (A long chunk's element-wise work on the thread pool, in rows of a token.)
        let wide = t_n >= PARALLEL_ROWS_TOKENS;
        if wide {
            q.par_chunks_mut(nh * qd).for_each(|row| row.iter_mut().for_each(|v| *v *= scale));
        } else {
            q.iter_mut().for_each(|v| *v *= scale);
        }
        let first = st.len; // positions cached before this chunk
        for c in ckv.chunks_exact_mut(width) {
            rms_norm_inplace(&mut c[..kvl], &self.kv_a_norm, LORA_NORM_EPS);
            st.push(c);
        }

        // A prompt chunk whose spine products go to the GPU sends its attention there too, the
        // cache's rows uploaded once for the chunk.
        let runner = crate::chunk_spine::current()
            .filter(|_| t_n >= SpineRunner::MIN_TOKENS && MlaAttention::supports(width, kvl));
        let mut gpu = runner.as_deref().and_then(|g| {
            g.mla_chunk(st.rows(), first + t_n, width, kvl)
                .inspect_err(|e| tracing::warn!("MLA attention on the GPU failed, computed on the CPU instead: {e}"))
                .ok()
        });
        let sub = t_n.min(if gpu.is_some() { GPU_ATTENTION_TOKENS } else { ATTENTION_TOKENS });
        let mut attn = sc.take(t_n * nh * vd); // [T, heads, v]
        let mut q_cat = sc.take(nh * sub * width); // [heads, S, kv_lora + rope] absorbed queries
        let mut o_lat = sc.take(sub * nh * kvl); // [S, heads, kv_lora] latent outputs
        let mut o_head = sc.take(if sub > 1 { nh * sub * kvl } else { 0 }); // [heads, S, kv_lora]
        let mut o_v = sc.take(nh * sub * vd); // [heads, S, v]
        // The attention kernel's scratch (blocks of cached rows, scores, softmax state per item).
        let mut att_sc = sc.take(mla_attend_scratch(nh, sub, width).max(mla_attend_scratch(nh, 1, width)));
        for s0 in (0..t_n).step_by(sub) {
            let sn = sub.min(t_n - s0);
            let q_cat = &mut q_cat[..nh * sn * width];
            // Key absorption, every head: q_lat = W_k^T q_nope (a transposed product against the
            // head's key rows), then the rope part beside it.
            let absorb_keys = |h: usize, qc: &mut [f32]| {
                let qh = &q[(s0 * nh + h) * qd..];
                vecmat(self.kv_b.dense_rows(h * (nope + vd), nope), nope, kvl, qh, nh * qd, sn, qc, width);
                for i in 0..sn {
                    let pe = &qh[i * nh * qd + nope..i * nh * qd + qd];
                    qc[i * width + kvl..(i + 1) * width].copy_from_slice(pe);
                }
            };
            // The heads share the thread pool when the products are large enough to gain.
            let parallel = sn * nh * nope * kvl >= PAR_MIN_WEIGHTS;
            if parallel {
                q_cat.par_chunks_mut(sn * width).enumerate().for_each(|(h, qc)| absorb_keys(h, qc));
            } else {
                q_cat.chunks_mut(sn * width).enumerate().for_each(|(h, qc)| absorb_keys(h, qc));
            }
            // Each head's latent outputs side by side, from the GPU, or from the CPU's kernel
            // (token-major) rearranged (a single token's already are).
            let on_gpu = gpu.as_mut().is_some_and(|g| {
                g.attend(q_cat, nh, sn, first + s0, &mut o_head[..nh * sn * kvl])
                    .inspect_err(|e| {
                        tracing::warn!("MLA attention on the GPU failed, computed on the CPU instead: {e}")
                    })
                    .is_ok()
            });
            if !on_gpu {
                gpu = None;
            }
            let o_lat = &mut o_lat[..sn * nh * kvl];
            if !on_gpu {
                mla_attend_chunk(q_cat, nh, sn, first + s0, st.rows(), width, kvl, o_lat, &mut att_sc);
            }
            let o_head: &[f32] = if on_gpu {
                &o_head[..nh * sn * kvl]
            } else if sn == 1 {
                o_lat
            } else {
                let oh = &mut o_head[..nh * sn * kvl];
                for (i, row) in o_lat.chunks_exact(nh * kvl).enumerate() {
                    for h in 0..nh {
                        oh[(h * sn + i) * kvl..(h * sn + i + 1) * kvl].copy_from_slice(&row[h * kvl..(h + 1) * kvl]);
                    }
                }
                oh
            };
            // Value absorption, every head: out_h = W_v o_lat (the head's value rows).
            let o_v = &mut o_v[..nh * sn * vd];
            let absorb_values = |h: usize, ov: &mut [f32]| {
                let o = &o_head[h * sn * kvl..(h + 1) * sn * kvl];
                self.kv_b.rows_batch_serial(h * (nope + vd) + nope, vd, o, sn, ov);
            };
            if parallel {
                o_v.par_chunks_mut(sn * vd).enumerate().for_each(|(h, ov)| absorb_values(h, ov));
            } else {
                o_v.chunks_mut(sn * vd).enumerate().for_each(|(h, ov)| absorb_values(h, ov));
            }
            let put = |(i, row): (usize, &mut [f32])| {
                for (h, dst) in row.chunks_mut(vd).enumerate() {
                    dst.copy_from_slice(&o_v[(h * sn + i) * vd..(h * sn + i + 1) * vd]);
                }
            };
            let rows = &mut attn[s0 * nh * vd..(s0 + sn) * nh * vd];
            if wide {
                rows.par_chunks_mut(nh * vd).enumerate().for_each(put);
            } else {
                rows.chunks_mut(nh * vd).enumerate().for_each(put);
            }
        }
        if let Some(g) = &self.gate {
            let mut gv = sc.take(t_n * nh * vd); // [T, heads * v]
            g.forward_batch(xs, t_n, &mut gv);
            let gate = |(a, g): (&mut [f32], &[f32])| a.iter_mut().zip(g).for_each(|(a, &g)| *a *= sigmoid(g));
            if wide {
                attn.par_chunks_mut(nh * vd).zip(gv.par_chunks(nh * vd)).for_each(gate);
            } else {
                attn.chunks_mut(nh * vd).zip(gv.chunks(nh * vd)).for_each(gate);
            }
            sc.give(gv);
        }
        self.o_proj.forward_batch_exact_inputs(&attn, t_n, outs);
        for buf in [q, ckv, attn, q_cat, o_lat, o_head, o_v, att_sc] {
            sc.give(buf);
        }
    }
}
