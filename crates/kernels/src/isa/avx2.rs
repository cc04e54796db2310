//! Layer 3, every AVX2 + FMA kernel (x86_64). Imports only `format` and `scalar`.
//!
//! Two kinds: hand-written kernels (MXFP4, approximate-mode MXFP4, the roofline's FMA probe), and
//! instantiations of the portable `#[inline(always)]` bodies in `scalar` compiled with AVX2
//! enabled (dense mat-vecs, attention steps): the same operations in the same order, vectorised
//! by the compiler, so bit-identical to their scalar twins (tested).
//!
//! Every function here is `unsafe`: the caller (an operation module's `op_on`) must have checked
//! that the CPU supports AVX2 and FMA.

use std::arch::x86_64::*;

use crate::format::{BLOCK, Dense, E2M1_X2_I8, QuantizedX, e8m0_to_f32};
use crate::scalar;

use super::avx2_math::exp_ps;

// ---- Instantiations of the portable bodies ---------------------------------------------------

/// [`scalar::f32_matvec`] compiled with AVX2 + FMA.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn f32_matvec(w: &[f32], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    scalar::f32_matvec(w, rows, cols, x, out)
}

/// [`scalar::bf16_matvec`] compiled with AVX2 + FMA.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn bf16_matvec(w: &[u16], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    scalar::bf16_matvec(w, rows, cols, x, out)
}

/// [`scalar::int8_matvec`] compiled with AVX2 + FMA.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn int8_matvec(
    q: &[i8],
    scales: &[f32],
    group: usize,
    rows: usize,
    cols: usize,
    x: &[f32],
    out: &mut [f32],
) {
    scalar::int8_matvec(q, scales, group, rows, cols, x, out)
}

/// [`scalar::kda_head_step`] compiled with AVX2 + FMA.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn kda_head_step(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    delta: &mut [f32],
    y: &mut [f32],
) {
    scalar::kda_head_step(s, q, k, v, g, beta, delta, y)
}

/// [`scalar::mla_block_scores`] compiled with AVX2 + FMA (any width; the same bits).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn mla_block_scores_scalar(
    q: &[f32],
    q_stride: usize,
    nq: usize,
    rows: &[f32],
    nb: usize,
    width: usize,
    s: &mut [f32],
    s_stride: usize,
) {
    scalar::mla_block_scores(q, q_stride, nq, rows, nb, width, s, s_stride)
}

/// [`scalar::mla_block_mix`] compiled with AVX2 + FMA (any width; its fused multiply-adds in
/// hardware, the same bits as libm's `fmaf`).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn mla_block_mix_scalar(
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
    scalar::mla_block_mix(p, p_stride, alpha, rows, nb, width, kvl, out, o_stride)
}

/// [`scalar::mla_scores`] compiled with AVX2 + FMA.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn mla_scores(q_lat: &[f32], q_pe: &[f32], latents: &[f32], k_pe: &[f32], scale: f32, scores: &mut [f32]) {
    scalar::mla_scores(q_lat, q_pe, latents, k_pe, scale, scores)
}

/// [`scalar::mla_mix`] compiled with AVX2 + FMA.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn mla_mix(probabilities: &[f32], latents: &[f32], kvl: usize, o_lat: &mut [f32]) {
    scalar::mla_mix(probabilities, latents, kvl, o_lat)
}

// ---- Hand-written kernels ------------------------------------------------------------------------

/// The sum of the eight lanes of `v` (pairwise: high half plus low, then within the half).
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// The approximate (int8 activation) MXFP4 product, one block at a time: 16 packed bytes give 16
/// even (low nibble) and 16 odd (high nibble) weights; `pshufb` maps nibbles to 2·E2M1 bytes, and
/// `maddubs` + `madd` form the block's integer dot product with the sign moved onto the
/// activations.
///
/// # Safety
/// AVX2 must be available; shapes validated by the caller (as [`scalar::mxfp4_matvec_q8`]).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn mxfp4_matvec_q8(
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    xq: &QuantizedX,
    out: &mut [f32],
) {
    let (half, nb) = (cols / 2, cols / BLOCK);
    // SAFETY: the table holds 16 bytes; duplicated into both 128-bit lanes.
    let lut = unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(E2M1_X2_I8.as_ptr() as *const __m128i)) };
    let low4 = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    for (r, o) in out.iter_mut().enumerate().take(rows) {
        let prow = &packed[r * half..(r + 1) * half];
        let srow = &scales[r * nb..(r + 1) * nb];
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            let pb = &prow[b * 16..b * 16 + 16];
            let qb = &xq.q[b * BLOCK..(b + 1) * BLOCK];
            // SAFETY: 16 packed bytes and 32 quantised activations; unaligned loads.
            let (bytes, xv) = unsafe {
                (_mm_loadu_si128(pb.as_ptr() as *const __m128i), _mm256_loadu_si256(qb.as_ptr() as *const __m256i))
            };
            // Low nibbles in lane 0, high nibbles in lane 1: the even then odd weights, matching
            // the activations' layout.
            let both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
            let w = _mm256_shuffle_epi8(lut, _mm256_and_si256(both, low4));
            let prod = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w)), ones);
            let scale = 0.5 * e8m0_to_f32(srow[b]) * xq.scales[b];
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(prod), _mm256_set1_ps(scale), acc);
        }
        let lo = _mm256_castps256_ps128(acc);
        let hi = _mm256_extractf128_ps(acc, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        *o = _mm_cvtss_f32(s);
    }
}

// ---- Transposed products and the one-pass MLA attention --------------------------------------

/// [`scalar::vecmat`] with AVX2 + FMA: tiles of 6 inputs x 16 columns (one input: 64 columns, so
/// eight accumulator chains hide the FMA latency), weights widened to f32 eight at a time as
/// [`Dense::at`] reads them, per output `acc = fma(x, w, acc)` over the rows in order, the last
/// columns through the scalar twin's loop: bit-identical to it.
///
/// # Safety
/// AVX2 and FMA must be available; `w` holds `rows x cols` (and an int8 group is a multiple of
/// 8), xs and out hold `n` rows of their strides (checked by the caller).
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn vecmat(
    w: Dense,
    rows: usize,
    cols: usize,
    xs: &[f32],
    x_stride: usize,
    n: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    // SAFETY (every closure): `vecmat_tiles` asks only for rows < `rows` and 8 columns from a
    // column < cols - 7, inside the `rows x cols` the caller checked.
    match w {
        Dense::F32(v) => unsafe {
            vecmat_tiles(&w, rows, cols, xs, x_stride, n, out, out_stride, |r, c| {
                _mm256_loadu_ps(v.as_ptr().add(r * cols + c))
            })
        },
        Dense::Bf16(v) => unsafe {
            vecmat_tiles(&w, rows, cols, xs, x_stride, n, out, out_stride, |r, c| {
                widen_bf16x8(v.as_ptr().add(r * cols + c))
            })
        },
        Dense::Int8 { q, scales, group } => unsafe {
            let g = cols / group;
            vecmat_tiles(&w, rows, cols, xs, x_stride, n, out, out_stride, |r, c| {
                let b = _mm_loadl_epi64(q.as_ptr().add(r * cols + c) as *const __m128i);
                let f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                _mm256_mul_ps(f, _mm256_set1_ps(*scales.get_unchecked(r * g + c / group)))
            })
        },
    }
}

/// Eight bf16 values at `p` widened to f32 (exact: each moves up 16 bits).
///
/// # Safety
/// AVX2 must be available and `p` valid for 8 reads.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn widen_bf16x8(p: *const u16) -> __m256 {
    // SAFETY: the caller guarantees 8 readable values.
    let h = unsafe { _mm_loadu_si128(p as *const __m128i) };
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
}

/// The tiles of [`vecmat`] over a weight loader `w8(r, c)` (eight weights of row `r` from column
/// `c`, as f32).
///
/// # Safety
/// As [`vecmat`]; `w8` must be valid for every row below `rows` and column below `cols - 7`.
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn vecmat_tiles(
    w: &Dense,
    rows: usize,
    cols: usize,
    xs: &[f32],
    x_stride: usize,
    n: usize,
    out: &mut [f32],
    out_stride: usize,
    w8: impl Fn(usize, usize) -> __m256,
) {
    let wide = if n == 1 { 64 } else { 16 };
    let simd_cols = cols / 8 * 8;
    let mut m0 = 0;
    while m0 < n {
        let mn = (n - m0).min(6);
        let mut c0 = 0;
        while c0 < simd_cols {
            let cw = (simd_cols - c0).min(wide);
            // SAFETY: inputs m0 .. m0+mn and columns c0 .. c0+cw are in bounds (cw a multiple of 8).
            unsafe {
                match (mn, cw / 8) {
                    (1, 8) => vecmat_tile::<1, 8>(rows, xs, x_stride, m0, c0, out, out_stride, &w8),
                    (_, 2) => vecmat_rows::<2>(mn, rows, xs, x_stride, m0, c0, out, out_stride, &w8),
                    (_, v) => {
                        for k in 0..v {
                            vecmat_rows::<1>(mn, rows, xs, x_stride, m0, c0 + 8 * k, out, out_stride, &w8);
                        }
                    }
                }
            }
            c0 += cw;
        }
        for m in m0..m0 + mn {
            let x = &xs[m * x_stride..m * x_stride + rows];
            scalar::vecmat_cols(w, cols, x, simd_cols, &mut out[m * out_stride + simd_cols..m * out_stride + cols]);
        }
        m0 += mn;
    }
}

/// `mn` (1 to 6) inputs against `V` vectors of columns from `c0`.
///
/// # Safety
/// As [`vecmat_tiles`].
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn vecmat_rows<const V: usize>(
    mn: usize,
    rows: usize,
    xs: &[f32],
    x_stride: usize,
    m0: usize,
    c0: usize,
    out: &mut [f32],
    out_stride: usize,
    w8: &impl Fn(usize, usize) -> __m256,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match mn {
            1 => vecmat_tile::<1, V>(rows, xs, x_stride, m0, c0, out, out_stride, w8),
            2 => vecmat_tile::<2, V>(rows, xs, x_stride, m0, c0, out, out_stride, w8),
            3 => vecmat_tile::<3, V>(rows, xs, x_stride, m0, c0, out, out_stride, w8),
            4 => vecmat_tile::<4, V>(rows, xs, x_stride, m0, c0, out, out_stride, w8),
            5 => vecmat_tile::<5, V>(rows, xs, x_stride, m0, c0, out, out_stride, w8),
            _ => vecmat_tile::<6, V>(rows, xs, x_stride, m0, c0, out, out_stride, w8),
        }
    }
}

/// One tile: `M` inputs x `V` vectors of columns, `M x V` accumulators in registers.
///
/// # Safety
/// As [`vecmat_tiles`]; inputs `m0 .. m0+M` exist.
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn vecmat_tile<const M: usize, const V: usize>(
    rows: usize,
    xs: &[f32],
    x_stride: usize,
    m0: usize,
    c0: usize,
    out: &mut [f32],
    out_stride: usize,
    w8: &impl Fn(usize, usize) -> __m256,
) {
    let mut acc = [[_mm256_setzero_ps(); V]; M];
    for r in 0..rows {
        let wv: [__m256; V] = std::array::from_fn(|v| w8(r, c0 + 8 * v));
        for (m, a) in acc.iter_mut().enumerate() {
            let x = _mm256_set1_ps(xs[(m0 + m) * x_stride + r]);
            for (a, w) in a.iter_mut().zip(wv) {
                *a = _mm256_fmadd_ps(x, w, *a);
            }
        }
    }
    for (m, a) in acc.iter().enumerate() {
        let o = &mut out[(m0 + m) * out_stride + c0..(m0 + m) * out_stride + c0 + 8 * V];
        for (v, a) in a.iter().enumerate() {
            // SAFETY: `o` holds 8 * V floats.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(8 * v), *a) };
        }
    }
}

/// Widen bf16 bits to f32, eight at a time (exact, as [`scalar::widen_bf16`]).
///
/// # Safety
/// AVX2 must be available; `dst` is at least as long as `src`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn widen_bf16(src: &[u16], dst: &mut [f32]) {
    let n8 = src.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        // SAFETY: 8 values from `i` in both slices.
        unsafe { _mm256_storeu_ps(dst.as_mut_ptr().add(i), widen_bf16x8(src.as_ptr().add(i))) };
    }
    scalar::widen_bf16(&src[n8..], &mut dst[n8..src.len()]);
}

/// The scores of one block of the one-pass MLA attention ([`scalar::mla_block_scores`]) with
/// AVX2: per (query, row) one 8-lane accumulator over the width in order, reduced by [`hsum`],
/// in tiles of 2 queries x 4 rows (eight independent chains). A tile's missing queries or rows
/// repeat its last one and are not stored, so a pair's score does not depend on its neighbours.
///
/// # Safety
/// AVX2 and FMA must be available; `width` is a multiple of 8; q holds `nq` queries `q_stride`
/// apart, rows `nb` rows of `width`, s `nq` rows of `s_stride >= nb` (checked by the caller).
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn mla_block_scores(
    q: &[f32],
    q_stride: usize,
    nq: usize,
    rows: &[f32],
    nb: usize,
    width: usize,
    s: &mut [f32],
    s_stride: usize,
) {
    for j0 in (0..nb).step_by(4) {
        let rp: [*const f32; 4] = std::array::from_fn(|b| rows[(j0 + b).min(nb - 1) * width..].as_ptr());
        for i0 in (0..nq).step_by(2) {
            let qp: [*const f32; 2] = std::array::from_fn(|a| q[(i0 + a).min(nq - 1) * q_stride..].as_ptr());
            let mut acc = [[_mm256_setzero_ps(); 4]; 2];
            for c in (0..width).step_by(8) {
                // SAFETY: every pointer starts a row of at least `width` values; c + 8 <= width.
                unsafe {
                    let kv: [__m256; 4] = std::array::from_fn(|b| _mm256_loadu_ps(rp[b].add(c)));
                    for a in 0..2 {
                        let qv = _mm256_loadu_ps(qp[a].add(c));
                        for b in 0..4 {
                            acc[a][b] = _mm256_fmadd_ps(qv, kv[b], acc[a][b]);
                        }
                    }
                }
            }
            for a in 0..(nq - i0).min(2) {
                for b in 0..(nb - j0).min(4) {
                    // SAFETY: AVX2 is enabled in this function.
                    s[(i0 + a) * s_stride + j0 + b] = unsafe { hsum(acc[a][b]) };
                }
            }
        }
    }
}

/// `x[j] = exp(x[j] - shift)` with [`exp_ps`] (0 below -87) (the last partial group through a padded copy, so
/// every element gets the same lane arithmetic).
///
/// # Safety
/// AVX2 and FMA must be available.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn exp_shifted(x: &mut [f32], shift: f32) {
    let sh = _mm256_set1_ps(shift);
    let n8 = x.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        // SAFETY: 8 floats from `i`.
        unsafe {
            let p = x.as_mut_ptr().add(i);
            _mm256_storeu_ps(p, exp_ps(_mm256_sub_ps(_mm256_loadu_ps(p), sh)));
        }
    }
    if n8 < x.len() {
        let mut t = [0f32; 8];
        t[..x.len() - n8].copy_from_slice(&x[n8..]);
        // SAFETY: `t` holds 8 floats.
        unsafe { _mm256_storeu_ps(t.as_mut_ptr(), exp_ps(_mm256_sub_ps(_mm256_loadu_ps(t.as_ptr()), sh))) };
        let rest = x.len() - n8;
        x[n8..].copy_from_slice(&t[..rest]);
    }
}

/// The read-out of one block ([`scalar::mla_block_mix`], bit-identical to it) in tiles of 6
/// queries x 16 values (12 accumulators), each value `acc = out * alpha` then
/// `acc = fma(p_ij, row_j, acc)` over the rows in order.
///
/// # Safety
/// AVX2 and FMA must be available; `kvl` is a multiple of 8 and at most `width`; shapes as the
/// scalar twin's (checked by the caller).
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn mla_block_mix(
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
    let nq = alpha.len();
    let mut d0 = 0;
    while d0 < kvl {
        let dv = if kvl - d0 >= 16 { 2 } else { 1 };
        for i0 in (0..nq).step_by(6) {
            let qn = (nq - i0).min(6);
            // SAFETY: values d0 .. d0 + 8 dv <= kvl of rows < nb and of outputs i0 .. i0+qn. A
            // partial group of queries goes one query at a time (the same arithmetic).
            unsafe {
                match (qn, dv) {
                    (6, 2) => mix_tile::<6, 2>(p, p_stride, alpha, rows, nb, width, out, o_stride, i0, d0),
                    (6, _) => mix_tile::<6, 1>(p, p_stride, alpha, rows, nb, width, out, o_stride, i0, d0),
                    (_, 2) => (i0..i0 + qn)
                        .for_each(|i| mix_tile::<1, 2>(p, p_stride, alpha, rows, nb, width, out, o_stride, i, d0)),
                    _ => (i0..i0 + qn)
                        .for_each(|i| mix_tile::<1, 1>(p, p_stride, alpha, rows, nb, width, out, o_stride, i, d0)),
                }
            }
        }
        d0 += 8 * dv;
    }
}

/// `Q` queries from `i0` x `V` vectors of values from `d0`.
///
/// # Safety
/// As [`mla_block_mix`].
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn mix_tile<const Q: usize, const V: usize>(
    p: &[f32],
    p_stride: usize,
    alpha: &[f32],
    rows: &[f32],
    nb: usize,
    width: usize,
    out: &mut [f32],
    o_stride: usize,
    i0: usize,
    d0: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); V]; Q];
    for (a, acc) in acc.iter_mut().enumerate() {
        let al = _mm256_set1_ps(alpha[i0 + a]);
        for (v, x) in acc.iter_mut().enumerate() {
            // SAFETY: output row i0 + a holds kvl >= d0 + 8 V values.
            *x = _mm256_mul_ps(unsafe { _mm256_loadu_ps(out.as_ptr().add((i0 + a) * o_stride + d0 + 8 * v)) }, al);
        }
    }
    for j in 0..nb {
        // SAFETY: row j holds width >= d0 + 8 V values.
        let rv: [__m256; V] =
            std::array::from_fn(|v| unsafe { _mm256_loadu_ps(rows.as_ptr().add(j * width + d0 + 8 * v)) });
        for (a, acc) in acc.iter_mut().enumerate() {
            let pj = _mm256_set1_ps(p[(i0 + a) * p_stride + j]);
            for v in 0..V {
                acc[v] = _mm256_fmadd_ps(pj, rv[v], acc[v]);
            }
        }
    }
    for (a, acc) in acc.iter().enumerate() {
        for (v, x) in acc.iter().enumerate() {
            // SAFETY: as the loads above.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add((i0 + a) * o_stride + d0 + 8 * v), *x) };
        }
    }
}

/// FLOPs done by one thread in `secs` of back-to-back AVX2 FMAs (the roofline's compute roof).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn fma_loop(secs: f64) -> f64 {
    super::fma_loop_body!(secs, _mm256_set1_ps, _mm256_fmadd_ps, 8)
}
