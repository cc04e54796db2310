//! Layer 2, the portable scalar code: every kernel's reference twin (the oracle its SIMD paths are
//! tested against, and the path on CPUs without them), and the small math helpers both sides use
//! (`situ`, `sigmoid`, `dot`, ...). Imports only `format`.
//!
//! The `#[inline(always)]` bodies (dense mat-vecs, the attention steps) are written with
//! independent lane accumulators so the compiler vectorises them; `isa::avx2` compiles the same
//! bodies a second time with AVX2 enabled, which keeps their arithmetic and its order.

use std::hint::black_box;
use std::time::Instant;

use half::bf16;

use crate::format::{
    BLOCK, Dense, E2M1_LUT, E2M1_X2_I8, Mxfp4, QuantizedX, bf16_to_f32, check_matvec_shapes, e8m0_to_f32,
};

// ---- Element-wise helpers and reductions -------------------------------------------------------

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// Softplus with the usual linear cut-over for large inputs.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// SiTU, Kimi K3's gated activation: `beta*tanh(g/beta)*sigmoid(g) * lbeta*tanh(u/lbeta)`.
/// Shapes: gate, up, out `[n]`. `linear_beta` None leaves `u` unbounded.
pub fn situ(gate: &[f32], up: &[f32], beta: f32, linear_beta: Option<f32>, out: &mut [f32]) {
    assert_eq!(gate.len(), up.len());
    assert_eq!(gate.len(), out.len());
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let a = beta * (g / beta).tanh() * sigmoid(g);
        let x = match linear_beta {
            Some(lb) => lb * (u / lb).tanh(),
            None => u,
        };
        *o = a * x;
    }
}

/// Dot product with f32 accumulation over several lanes. Inlined, so that a caller compiled
/// for a wider ISA (`isa::avx2`'s instantiations) compiles it so too.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for i in 0..chunks {
        for l in 0..8 {
            acc[l] += a[i * 8 + l] * b[i * 8 + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// `y += alpha * x`.
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    for (v, &u) in y.iter_mut().zip(x) {
        *v += alpha * u;
    }
}

/// `1 / sqrt(mean(x^2) + eps)`, accumulated in f64 so long rows keep their precision.
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    (1.0 / ((ss / x.len() as f64) + eps as f64).sqrt()) as f32
}

/// In-place RMSNorm: `x = x / sqrt(mean(x^2) + eps) * weight`. Shapes: x, weight `[n]`.
pub fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    assert_eq!(x.len(), weight.len());
    let inv = inv_rms(x, eps);
    for (v, &w) in x.iter_mut().zip(weight) {
        *v *= inv * w;
    }
}

/// Out-of-place [`rms_norm_inplace`].
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), out.len());
    out.copy_from_slice(x);
    rms_norm_inplace(out, weight, eps);
}

/// Numerically stable in-place softmax.
pub fn softmax_inplace(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

// ---- MXFP4 ---------------------------------------------------------------------------------------

/// One MXFP4 row's dot product. Shapes: prow `[cols/2]`, srow `[cols/32]`, x `[cols]`.
pub fn row_dot(prow: &[u8], srow: &[u8], x: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for (b, &s) in srow.iter().enumerate() {
        let pb = &prow[b * BLOCK / 2..(b + 1) * BLOCK / 2];
        let xb = &x[b * BLOCK..(b + 1) * BLOCK];
        // Two partial sums keep the dependency chain short; the block sum is then scaled once.
        let mut s0 = 0.0f32;
        let mut s1 = 0.0f32;
        for (j, &byte) in pb.iter().enumerate() {
            s0 += E2M1_LUT[(byte & 0x0F) as usize] * xb[2 * j];
            s1 += E2M1_LUT[(byte >> 4) as usize] * xb[2 * j + 1];
        }
        acc += (s0 + s1) * e8m0_to_f32(s);
    }
    acc
}

/// `out[r] = sum_c W[r, c] * x[c]` for an MXFP4 matrix. `cols` must be a multiple of 32.
/// Shapes: packed `[rows, cols/2]`, scales `[rows, cols/32]`, x `[cols]`, out `[rows]`.
pub fn mxfp4_matvec(packed: &[u8], scales: &[u8], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    check_matvec_shapes(packed, scales, rows, cols, x, out);
    let half = cols / 2;
    let nblocks = cols / BLOCK;
    for (r, o) in out.iter_mut().enumerate() {
        *o = row_dot(&packed[r * half..(r + 1) * half], &scales[r * nblocks..(r + 1) * nblocks], x);
    }
}

/// Gate and up row `r` of an expert (`[rows, latent]` MXFP4 each), then SiTU: one element of the
/// expert's activation (the scalar expert's row).
pub fn gate_up_situ_row(w1: Mxfp4, w3: Mxfp4, r: usize, latent: usize, x: &[f32], beta: f32, lb: Option<f32>) -> f32 {
    let (half, nb) = (latent / 2, latent / BLOCK);
    let g = row_dot(&w1.packed[r * half..(r + 1) * half], &w1.scales[r * nb..(r + 1) * nb], x);
    let u = row_dot(&w3.packed[r * half..(r + 1) * half], &w3.scales[r * nb..(r + 1) * nb], x);
    let mut o = [0f32];
    situ(&[g], &[u], beta, lb, &mut o);
    o[0]
}

/// The fused routed expert `out = w2 · situ(w1 · x, w3 · x)`, row by row on one thread.
/// Shapes: w1, w3 packed `[I, L/2]` + scales `[I, L/32]`; w2 packed `[L, I/2]` + scales
/// `[L, I/32]`; x `[L]`; act (scratch) `[I]`; out `[L]`.
#[allow(clippy::too_many_arguments)]
pub fn expert_mxfp4(
    w1: Mxfp4,
    w3: Mxfp4,
    w2: Mxfp4,
    inter: usize,
    latent: usize,
    x: &[f32],
    beta: f32,
    linear_beta: Option<f32>,
    act: &mut [f32],
    out: &mut [f32],
) {
    check_matvec_shapes(w1.packed, w1.scales, inter, latent, x, act);
    check_matvec_shapes(w3.packed, w3.scales, inter, latent, x, act);
    for (r, a) in act.iter_mut().enumerate() {
        *a = gate_up_situ_row(w1, w3, r, latent, x, beta, linear_beta);
    }
    mxfp4_matvec(w2.packed, w2.scales, latent, inter, act, out);
}

/// The approximate (int8 activation) MXFP4 product. Shapes as [`mxfp4_matvec`], `xq` quantised
/// from `[cols]`.
pub fn mxfp4_matvec_q8(packed: &[u8], scales: &[u8], rows: usize, cols: usize, xq: &QuantizedX, out: &mut [f32]) {
    let (half, nb) = (cols / 2, cols / BLOCK);
    for (r, o) in out.iter_mut().enumerate().take(rows) {
        let mut acc = 0f32;
        for b in 0..nb {
            let pb = &packed[r * half + b * 16..r * half + b * 16 + 16];
            let qb = &xq.q[b * BLOCK..(b + 1) * BLOCK];
            let mut dot = 0i32;
            for (j, &byte) in pb.iter().enumerate() {
                dot += E2M1_X2_I8[(byte & 0xF) as usize] as i32 * qb[j] as i32;
                dot += E2M1_X2_I8[(byte >> 4) as usize] as i32 * qb[16 + j] as i32;
            }
            acc += dot as f32 * (0.5 * e8m0_to_f32(scales[r * nb + b]) * xq.scales[b]);
        }
        *o = acc;
    }
}

// ---- Dense mat-vecs (f32, bf16, int8 + scales) ---------------------------------------------------
//
// All take a row-major `[rows, cols]` weight and compute `out[r] = sum_c W[r, c] * x[c]` with f32
// accumulation.

const LANES: usize = 8;

#[inline(always)]
fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = w.len() / LANES;
    for i in 0..chunks {
        for l in 0..LANES {
            acc[l] += w[i * LANES + l] * x[i * LANES + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * LANES..w.len() {
        s += w[i] * x[i];
    }
    s
}

/// f32 weights. Shapes: w `[rows, cols]`, x `[cols]`, out `[rows]`.
#[inline(always)]
pub fn f32_matvec(w: &[f32], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    assert_eq!(w.len(), rows * cols);
    assert_eq!(x.len(), cols);
    assert_eq!(out.len(), rows);
    for (r, o) in out.iter_mut().enumerate() {
        *o = dot_f32(&w[r * cols..(r + 1) * cols], x);
    }
}

/// bf16 weights (raw u16 bits), widened exactly to f32. Shapes as [`f32_matvec`].
#[inline(always)]
pub fn bf16_matvec(w: &[u16], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    assert_eq!(w.len(), rows * cols);
    assert_eq!(x.len(), cols);
    assert_eq!(out.len(), rows);
    for (r, o) in out.iter_mut().enumerate() {
        let row = &w[r * cols..(r + 1) * cols];
        let mut acc = [0.0f32; LANES];
        let chunks = cols / LANES;
        for i in 0..chunks {
            for l in 0..LANES {
                acc[l] += bf16::from_bits(row[i * LANES + l]).to_f32() * x[i * LANES + l];
            }
        }
        let mut s: f32 = acc.iter().sum();
        for i in chunks * LANES..cols {
            s += bf16::from_bits(row[i]).to_f32() * x[i];
        }
        *o = s;
    }
}

/// int8 weights with one f32 scale per `group` consecutive elements of a row (`group == cols` is
/// per-row scaling). Shapes: q `[rows, cols]`, scales `[rows, cols/group]`, x `[cols]`, out `[rows]`.
#[inline(always)]
pub fn int8_matvec(q: &[i8], scales: &[f32], group: usize, rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    assert!(group > 0 && cols.is_multiple_of(group), "int8 group must divide the row");
    assert_eq!(q.len(), rows * cols);
    assert_eq!(scales.len(), rows * (cols / group));
    assert_eq!(x.len(), cols);
    assert_eq!(out.len(), rows);
    let groups = cols / group;
    for (r, o) in out.iter_mut().enumerate() {
        let row = &q[r * cols..(r + 1) * cols];
        let srow = &scales[r * groups..(r + 1) * groups];
        let mut total = 0.0f32;
        for (g, &s) in srow.iter().enumerate() {
            let qg = &row[g * group..(g + 1) * group];
            let xg = &x[g * group..(g + 1) * group];
            let mut acc = [0.0f32; LANES];
            let chunks = group / LANES;
            for i in 0..chunks {
                for l in 0..LANES {
                    acc[l] += qg[i * LANES + l] as f32 * xg[i * LANES + l];
                }
            }
            let mut sum: f32 = acc.iter().sum();
            for i in chunks * LANES..group {
                sum += qg[i] as f32 * xg[i];
            }
            total += sum * s;
        }
        *o = total;
    }
}

/// The sum of 16 lanes in the tree the SIMD integer tiles use: halves, then quarters, then
/// pairs (`(l0 + l8) + (l4 + l12)` and so on).
#[inline(always)]
pub fn lane_tree_sum(l: &[f32; 16]) -> f32 {
    let s8: [f32; 8] = std::array::from_fn(|i| l[i] + l[i + 8]);
    let s4: [f32; 4] = std::array::from_fn(|i| s8[i] + s8[i + 4]);
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    s2[0] + s2[1]
}

/// The integer spine product of approximate mode for one quantised input (the oracle of the
/// SIMD tiles, bit for bit): per scale group of the weights, per segment of the input, each of
/// the 16 lanes' exact integer dot product (lane `l` takes values `4l..4l+3` of every 64),
/// accumulated as `fa[l] = fma(dot_l, x_scale, fa[l])`; at the group's end the lanes summed
/// ([`lane_tree_sum`]) and `total += w_scale * sum`. Shapes: q `[rows, cols]`, scales `[rows,
/// cols/group]`, xq `[cols]`, xs `[cols/seg]`, out `[rows]`; `seg` divides `group`.
#[allow(clippy::too_many_arguments)]
pub fn int8_matvec_q8(
    q: &[i8],
    scales: &[f32],
    group: usize,
    rows: usize,
    cols: usize,
    xq: &[i8],
    xs: &[f32],
    seg: usize,
    out: &mut [f32],
) {
    use crate::format::{Q8_LANES, Q8_STEP};
    assert!(seg.is_multiple_of(Q8_STEP) && group.is_multiple_of(seg) && cols.is_multiple_of(group));
    assert!(q.len() >= rows * cols && scales.len() >= rows * (cols / group) && out.len() >= rows);
    assert!(xq.len() >= cols && xs.len() >= cols / seg);
    let groups = cols / group;
    for (r, o) in out.iter_mut().enumerate().take(rows) {
        let row = &q[r * cols..(r + 1) * cols];
        let mut total = 0f32;
        for g in 0..groups {
            let mut fa = [0f32; Q8_LANES];
            let first = g * group / seg;
            for (sg, &x_scale) in xs.iter().enumerate().take((g + 1) * group / seg).skip(first) {
                let mut ia = [0i32; Q8_LANES];
                for c in (sg * seg..(sg + 1) * seg).step_by(Q8_STEP) {
                    for (l, a) in ia.iter_mut().enumerate() {
                        for j in c + 4 * l..c + 4 * l + 4 {
                            *a += row[j] as i32 * xq[j] as i32;
                        }
                    }
                }
                for (f, &a) in fa.iter_mut().zip(&ia) {
                    *f = (a as f32).mul_add(x_scale, *f);
                }
            }
            total += scales[r * groups + g] * lane_tree_sum(&fa);
        }
        *o = total;
    }
}

/// The least block exponent of an MXFP4 row when every block lies within 3 of it (so `2·E2M1 x
/// 2^(e - base)` fits int8 exactly: at most 96) and none is 0 or 255; else `None`.
pub fn int8_row_base(scales: &[u8]) -> Option<u8> {
    let (lo, hi) = scales.iter().fold((u8::MAX, 0u8), |(lo, hi), &e| (lo.min(e), hi.max(e)));
    (!scales.is_empty() && lo >= 1 && hi <= 254 && hi - lo <= 3).then_some(lo)
}

/// The f32 scale of a row decoded at `base`: `2^(base - 127) / 2` (the int8 values are twice
/// E2M1's), exact for every base 1..=254.
pub fn int8_row_scale(base: u8) -> f32 {
    crate::format::e8m0_to_f32(base) * 0.5
}

/// An MXFP4 row as int8 for the integer products of approximate mode, exactly: each value's
/// 2·E2M1 shifted left by its block's exponent above the row's least ([`int8_row_base`]), so
/// `value = q * scale`; returns the scale, or `None` (out untouched) for a row that int8
/// cannot hold exactly. Shapes: packed `[cols/2]`, scales `[cols/32]`, out `[cols]`.
pub fn mxfp4_row_to_int8(packed: &[u8], scales: &[u8], out: &mut [i8]) -> Option<f32> {
    use crate::format::{BLOCK, E2M1_X2_I8};
    let base = int8_row_base(scales)?;
    for (j, &byte) in packed.iter().enumerate() {
        let shift = scales[2 * j / BLOCK] - base;
        out[2 * j] = E2M1_X2_I8[(byte & 0x0F) as usize] << shift;
        out[2 * j + 1] = E2M1_X2_I8[(byte >> 4) as usize] << shift;
    }
    Some(int8_row_scale(base))
}

// ---- Attention steps -----------------------------------------------------------------------------

/// One KDA (gated delta-rule) head step: `S <- S * g` (per key channel),
/// `delta = beta (v - S k)`, `S <- S + delta k^T`, `y = S q`.
/// Shapes: s `[Dv, Dk]`, q, k, g `[Dk]`, v, delta, y `[Dv]`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn kda_head_step(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    delta: &mut [f32],
    y: &mut [f32],
) {
    let d = k.len();
    for vi in 0..v.len() {
        let row = &mut s[vi * d..(vi + 1) * d];
        let mut mem = 0.0f32;
        for j in 0..d {
            row[j] *= g[j];
            mem += row[j] * k[j];
        }
        delta[vi] = (v[vi] - mem) * beta;
    }
    for vi in 0..v.len() {
        let row = &mut s[vi * d..(vi + 1) * d];
        let mut acc = 0.0f32;
        for j in 0..d {
            row[j] += k[j] * delta[vi];
            acc += row[j] * q[j];
        }
        y[vi] = acc;
    }
}

/// The scores of absorbed NoPE MLA: `score_t = scale (q_lat . c_t + q_pe . pe_t)`.
/// Shapes: q_lat `[L]`, q_pe `[R]`, latents `[T, L]`, k_pe `[T, R]`, scores `[T]`.
#[inline(always)]
pub fn mla_scores(q_lat: &[f32], q_pe: &[f32], latents: &[f32], k_pe: &[f32], scale: f32, scores: &mut [f32]) {
    let (kvl, rope) = (q_lat.len(), q_pe.len());
    for (t, s) in scores.iter_mut().enumerate() {
        let c = &latents[t * kvl..(t + 1) * kvl];
        let pe = &k_pe[t * rope..(t + 1) * rope];
        *s = scale * (dot(q_lat, c) + dot(q_pe, pe));
    }
}

/// The read-out of absorbed NoPE MLA: `o_lat = sum_t p_t c_t`.
/// Shapes: probabilities `[T]`, latents `[T, kvl]`, o_lat `[kvl]`.
#[inline(always)]
pub fn mla_mix(probabilities: &[f32], latents: &[f32], kvl: usize, o_lat: &mut [f32]) {
    o_lat.fill(0.0);
    for (t, &p) in probabilities.iter().enumerate() {
        for (o, &c) in o_lat.iter_mut().zip(&latents[t * kvl..(t + 1) * kvl]) {
            *o += p * c;
        }
    }
}

/// Absorbed NoPE MLA for one head: [`mla_scores`], softmax over the cached positions,
/// [`mla_mix`]. Shapes as those two, o_lat `[L]`.
#[allow(clippy::too_many_arguments)]
pub fn mla_head_attend(
    q_lat: &[f32],
    q_pe: &[f32],
    latents: &[f32],
    k_pe: &[f32],
    scale: f32,
    scores: &mut [f32],
    o_lat: &mut [f32],
) {
    mla_scores(q_lat, q_pe, latents, k_pe, scale, scores);
    softmax_inplace(scores);
    mla_mix(scores, latents, q_lat.len(), o_lat);
}

// ---- Transposed products and the one-pass MLA attention --------------------------------------

/// The transposed product `out[m] = x[m]^T W` for `n` inputs: `out[m * os + c] = sum_r x[m * xs + r]
/// W[r, c]`. Per output, `acc = fma(x[m, r], W[r, c], acc)` from `acc = 0` over the rows in
/// order, with `W[r, c]` as [`Dense::at`] reads it: every path keeps exactly this arithmetic
/// (element-wise fused multiply-adds vectorise without reordering), so all are bit-identical to
/// this twin. Shapes: w `[rows, cols]`, xs `[n, x_stride]` (first `rows` read), out
/// `[n, out_stride]` (first `cols` written).
#[allow(clippy::too_many_arguments)]
pub fn vecmat(
    w: Dense,
    rows: usize,
    cols: usize,
    xs: &[f32],
    x_stride: usize,
    n: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    for m in 0..n {
        let x = &xs[m * x_stride..m * x_stride + rows];
        let o = &mut out[m * out_stride..m * out_stride + cols];
        vecmat_cols(&w, cols, x, 0, o);
    }
}

/// Columns `c0 .. c0 + out.len()` of one input's transposed product (the remainder columns of the
/// SIMD paths run here). Shapes: x `[rows]`.
#[inline(always)]
pub fn vecmat_cols(w: &Dense, cols: usize, x: &[f32], c0: usize, out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        let mut acc = 0.0f32;
        for (r, &xr) in x.iter().enumerate() {
            acc = xr.mul_add(w.at(cols, r, c0 + j), acc);
        }
        *o = acc;
    }
}

/// Widen bf16 bits to f32 (exact). Shapes: src, dst `[n]`.
#[inline(always)]
pub fn widen_bf16(src: &[u16], dst: &mut [f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16_to_f32(s);
    }
}

/// The scores of one block of the one-pass MLA attention: `s[i * s_stride + j] = q_i . row_j`
/// for `nq` queries (`q_stride` apart) and `nb` rows of `width` values, each a plain dot product
/// ([`dot`]). The scalar path's kernel (the SIMD paths sum in their own lanes).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn mla_block_scores(
    q: &[f32],
    q_stride: usize,
    nq: usize,
    rows: &[f32],
    nb: usize,
    width: usize,
    s: &mut [f32],
    s_stride: usize,
) {
    for i in 0..nq {
        let qi = &q[i * q_stride..i * q_stride + width];
        for j in 0..nb {
            s[i * s_stride + j] = dot(qi, &rows[j * width..(j + 1) * width]);
        }
    }
}

/// `x[j] = exp(x[j] - shift)` (libm's exp: the scalar path's).
pub fn exp_shifted(x: &mut [f32], shift: f32) {
    for v in x.iter_mut() {
        *v = (*v - shift).exp();
    }
}

/// The read-out of one block: `out_i[d] = out_i[d] * alpha_i + sum_{j < nb} p[i, j] row_j[d]` for
/// `d < kvl`, per element a multiply then fused multiply-adds in row order (every path's
/// arithmetic). Shapes: p `[nq, p_stride]`, alpha `[nq]`, rows `[nb, width]`, out `[nq, o_stride]`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn mla_block_mix(
    p: &[f32],
    p_stride: usize,
    alpha: &[f32],
    rows: &[f32],
    nb: usize,
    width: usize,
    kvl: usize,
    out: &mut [f32],
    o_stride: usize,
) {
    // Rows outer, elements inner: each element's chain is the same (a multiply, then the rows
    // in order), and the inner loop runs over contiguous elements (vectorised where the caller
    // is compiled with FMA, as `isa::avx2::mla_block_mix_scalar` is).
    for (i, &a) in alpha.iter().enumerate() {
        let o = &mut out[i * o_stride..i * o_stride + kvl];
        o.iter_mut().for_each(|od| *od *= a);
        for j in 0..nb {
            let pj = p[i * p_stride + j];
            for (od, &r) in o.iter_mut().zip(&rows[j * width..j * width + kvl]) {
                *od = pj.mul_add(r, *od);
            }
        }
    }
}

// ---- Roofline probe ------------------------------------------------------------------------------

/// FLOPs done by one thread in `secs` of back-to-back scalar FMAs.
pub fn fma_loop(secs: f64) -> f64 {
    let t0 = Instant::now();
    let mut acc = [1.0f32; 16];
    let (a, b) = (black_box(0.999_999f32), black_box(1e-7f32));
    let mut iters = 0u64;
    while t0.elapsed().as_secs_f64() < secs {
        for _ in 0..1_000_000 {
            for v in acc.iter_mut() {
                *v = v.mul_add(a, b);
            }
        }
        iters += 1_000_000;
    }
    black_box(acc);
    iters as f64 * 16.0 * 2.0
}
