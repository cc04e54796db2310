//! Layer 3, the AVX-512 kernels of the one-pass MLA attention (`attention::mla_attend_on`): a
//! block's scores and its read-out. Imports only `scalar` and the AVX-512 lane math; the oracles
//! are `scalar`'s (the read-out bit for bit, the scores and exp within rounding, since they sum
//! and round in 16 lanes).

// The tiles index accumulator arrays by query and row: the indices are the clearest form, and the
// loops unroll fully (the tile sizes are constants).
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::avx512_math::exp_ps;

/// The scores of one block ([`crate::scalar::mla_block_scores`]): per (query, row) one 16-lane
/// accumulator over the width in order, reduced by `_mm512_reduce_add_ps`, in tiles of 4 queries
/// x 4 rows (16 chains). A tile's missing queries or rows repeat its last one and are not stored,
/// so a pair's score does not depend on its neighbours.
///
/// # Safety
/// AVX-512F must be available; `width` is a multiple of 16; q holds `nq` queries `q_stride`
/// apart, rows `nb` rows of `width`, s `nq` rows of `s_stride >= nb` (checked by the caller).
#[target_feature(enable = "avx512f")]
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
        for i0 in (0..nq).step_by(4) {
            let qp: [*const f32; 4] = std::array::from_fn(|a| q[(i0 + a).min(nq - 1) * q_stride..].as_ptr());
            let mut acc = [[_mm512_setzero_ps(); 4]; 4];
            for c in (0..width).step_by(16) {
                // SAFETY: every pointer starts a row of at least `width` values; c + 16 <= width.
                unsafe {
                    let kv: [__m512; 4] = std::array::from_fn(|b| _mm512_loadu_ps(rp[b].add(c)));
                    for a in 0..4 {
                        let qv = _mm512_loadu_ps(qp[a].add(c));
                        for b in 0..4 {
                            acc[a][b] = _mm512_fmadd_ps(qv, kv[b], acc[a][b]);
                        }
                    }
                }
            }
            for a in 0..(nq - i0).min(4) {
                for b in 0..(nb - j0).min(4) {
                    s[(i0 + a) * s_stride + j0 + b] = _mm512_reduce_add_ps(acc[a][b]);
                }
            }
        }
    }
}

/// `x[j] = exp(x[j] - shift)` with `avx512_math::exp_ps`, the last partial group masked (every
/// element gets the same lane arithmetic).
///
/// # Safety
/// AVX-512F must be available.
#[target_feature(enable = "avx512f")]
pub unsafe fn exp_shifted(x: &mut [f32], shift: f32) {
    let sh = _mm512_set1_ps(shift);
    let n = x.len();
    for i in (0..n).step_by(16) {
        let mask: __mmask16 = if n - i >= 16 { 0xFFFF } else { ((1u32 << (n - i)) - 1) as __mmask16 };
        // SAFETY: the masked load and store touch only elements below n.
        unsafe {
            let p = x.as_mut_ptr().add(i);
            let v = _mm512_maskz_loadu_ps(mask, p);
            _mm512_mask_storeu_ps(p, mask, exp_ps(_mm512_sub_ps(v, sh)));
        }
    }
}

/// The read-out of one block ([`crate::scalar::mla_block_mix`], bit-identical to it) in tiles of
/// 6 queries x 64 values (24 accumulators), each value `acc = out * alpha` then
/// `acc = fma(p_ij, row_j, acc)` over the rows in order.
///
/// # Safety
/// AVX-512F must be available; `kvl` is a multiple of 16 and at most `width`; shapes as the
/// scalar twin's (checked by the caller).
#[target_feature(enable = "avx512f")]
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
        let dv = if kvl - d0 >= 64 { 4 } else { 1 };
        for i0 in (0..nq).step_by(6) {
            let qn = (nq - i0).min(6);
            // SAFETY: values d0 .. d0 + 16 dv <= kvl of rows < nb and of outputs i0 .. i0+qn. A
            // partial group of queries goes one query at a time (the same arithmetic).
            unsafe {
                match (qn, dv) {
                    (6, 4) => mix_tile::<6, 4>(p, p_stride, alpha, rows, nb, width, out, o_stride, i0, d0),
                    (6, _) => mix_tile::<6, 1>(p, p_stride, alpha, rows, nb, width, out, o_stride, i0, d0),
                    (_, 4) => (i0..i0 + qn)
                        .for_each(|i| mix_tile::<1, 4>(p, p_stride, alpha, rows, nb, width, out, o_stride, i, d0)),
                    _ => (i0..i0 + qn)
                        .for_each(|i| mix_tile::<1, 1>(p, p_stride, alpha, rows, nb, width, out, o_stride, i, d0)),
                }
            }
        }
        d0 += 16 * dv;
    }
}

/// `Q` queries from `i0` x `V` vectors of values from `d0`.
///
/// # Safety
/// As [`mla_block_mix`].
#[inline]
#[target_feature(enable = "avx512f")]
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
    let mut acc = [[_mm512_setzero_ps(); V]; Q];
    for a in 0..Q {
        let al = _mm512_set1_ps(alpha[i0 + a]);
        for v in 0..V {
            // SAFETY: output row i0 + a holds kvl >= d0 + 16 V values.
            acc[a][v] =
                _mm512_mul_ps(unsafe { _mm512_loadu_ps(out.as_ptr().add((i0 + a) * o_stride + d0 + 16 * v)) }, al);
        }
    }
    for j in 0..nb {
        // SAFETY: row j holds width >= d0 + 16 V values.
        let rv: [__m512; V] =
            std::array::from_fn(|v| unsafe { _mm512_loadu_ps(rows.as_ptr().add(j * width + d0 + 16 * v)) });
        for a in 0..Q {
            let pj = _mm512_set1_ps(p[(i0 + a) * p_stride + j]);
            for v in 0..V {
                acc[a][v] = _mm512_fmadd_ps(pj, rv[v], acc[a][v]);
            }
        }
    }
    for a in 0..Q {
        for v in 0..V {
            // SAFETY: as the loads above.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add((i0 + a) * o_stride + d0 + 16 * v), acc[a][v]) };
        }
    }
}
