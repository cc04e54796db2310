//! Multi-head latent attention without positional encoding (K3's NoPE MLA), with an optional
//! sigmoid output gate.
//!
//! Decode caches only the compressed latent (`kv_lora`, RMS-normed) and the `rope` channels of
//! each position; the key and value projections are absorbed into the query and the output:
//! `score = scale * (q_nope^T W_k c + q_pe^T k_pe)` is computed as `(W_k^T q_nope) . c`, and the
//! value `W_v (sum_t p_t c_t)`. K3 projects and caches the 64 "rope" channels but never rotates
//! them.

use anyhow::Result;
use deltafin_kernels::attention::mla_head_attend;
use deltafin_kernels::ops::{rms_norm_inplace, sigmoid};
use deltafin_store::{K3Config, SpineSource};

use crate::scratch::Scratch;
use crate::weights::{Linear, load_vec};

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

/// Per-sequence cache of one MLA layer.
#[derive(Default)]
pub struct MlaState {
    /// `[t, kv_lora]`.
    pub latents: Vec<f32>,
    /// `[t, rope]`.
    pub k_pe: Vec<f32>,
    pub len: usize,
    /// Values per token of `latents` and of `k_pe` (the model's widths: what a restored
    /// snapshot is checked against).
    pub kv_lora: usize,
    pub rope: usize,
}

impl MlaState {
    /// A cache with room for `tokens` positions reserved up front, so decoding within that
    /// context never reallocates.
    pub fn with_capacity(tokens: usize, kv_lora: usize, rope: usize) -> Self {
        MlaState {
            latents: Vec::with_capacity(tokens * kv_lora),
            k_pe: Vec::with_capacity(tokens * rope),
            len: 0,
            kv_lora,
            rope,
        }
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

    /// `t_n` tokens in order, causally: the chunk's projections at once (each matrix read once
    /// per share of tokens), every token's latent appended to the cache, then each head's
    /// absorbed attention for every token, token `t` over the positions up to its own (the
    /// head's rows of `kv_b` stay in cache across the chunk), then the output projection of
    /// the chunk. Per token the arithmetic is exactly the single-token step's. Shapes: xs, outs
    /// `[T, hidden]` (xs already normed).
    pub fn forward_chunk(&self, st: &mut MlaState, xs: &[f32], t_n: usize, outs: &mut [f32], sc: &mut Scratch) {
        let (nh, nope, rope, vd, kvl) = (self.heads, self.nope, self.rope, self.v_dim, self.kv_lora);
        let qd = nope + rope;
        let mut q = sc.take(t_n * nh * qd); // [T, heads, nope + rope]
        match &self.q {
            QProj::LowRank { a, norm, b } => {
                let r = a.rows;
                let mut t = sc.take(t_n * r); // [T, q_lora]
                a.forward_batch(xs, t_n, &mut t);
                for i in 0..t_n {
                    rms_norm_inplace(&mut t[i * r..(i + 1) * r], norm, LORA_NORM_EPS);
                }
                b.forward_batch(&t, t_n, &mut q);
                sc.give(t);
            }
            QProj::Full(p) => p.forward_batch(xs, t_n, &mut q),
        }
        let w = kvl + rope;
        let mut ckv = sc.take(t_n * w); // [T, kv_lora + rope]
        self.kv_a.forward_batch(xs, t_n, &mut ckv);
        let first = st.len; // positions already cached before this chunk
        for i in 0..t_n {
            let c = &mut ckv[i * w..(i + 1) * w];
            rms_norm_inplace(&mut c[..kvl], &self.kv_a_norm, LORA_NORM_EPS);
            st.latents.extend_from_slice(&c[..kvl]);
            st.k_pe.extend_from_slice(&c[kvl..]);
            st.len += 1;
        }

        let scale = (qd as f32).powf(-0.5);
        let mut attn = sc.take(t_n * nh * vd); // [T, heads, v]
        let mut q_lat = sc.take(kvl); // [kv_lora]
        let mut scores = sc.take(st.len); // [t]
        let mut o_lat = sc.take(kvl); // [kv_lora]
        for h in 0..nh {
            let krow = h * (nope + vd);
            for i in 0..t_n {
                let qh = &q[(i * nh + h) * qd..(i * nh + h + 1) * qd];
                // Absorb the key projection: q_lat = W_k^T q_nope.
                q_lat.fill(0.0);
                for (n, &qn) in qh[..nope].iter().enumerate() {
                    self.kv_b.axpy_row(krow + n, qn, &mut q_lat);
                }
                // Causal: token i sees the cached positions and the chunk's up to itself.
                let len = first + i + 1;
                let (lat, pe) = (&st.latents[..len * kvl], &st.k_pe[..len * rope]);
                mla_head_attend(&q_lat, &qh[nope..], lat, pe, scale, &mut scores[..len], &mut o_lat);
                // Absorb the value projection: out_h = W_v o_lat.
                let dst = &mut attn[(i * nh + h) * vd..(i * nh + h + 1) * vd];
                self.kv_b.forward_rows(krow + nope, vd, &o_lat, dst);
            }
        }
        if let Some(g) = &self.gate {
            let mut gv = sc.take(t_n * nh * vd); // [T, heads * v]
            g.forward_batch(xs, t_n, &mut gv);
            for (a, &gg) in attn.iter_mut().zip(&gv) {
                *a *= sigmoid(gg);
            }
            sc.give(gv);
        }
        self.o_proj.forward_batch(&attn, t_n, outs);
        for buf in [q, ckv, attn, q_lat, scores, o_lat] {
            sc.give(buf);
        }
    }
}
