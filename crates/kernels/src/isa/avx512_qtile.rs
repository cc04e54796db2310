//! Layer 3, the integer register tiles of approximate mode (x86_64, AVX-512F/BW + VNNI): a
//! prompt chunk's int8 spine products with int8 activations. One `vpdpbusd` does 64
//! multiply-adds where an f32 FMA does 16, so a product bound by the FMA units runs up to four
//! times faster; the inputs lose what int8 loses ([`crate::format::QuantizedRows`]), the
//! weights nothing. Imports only `format` and `scalar`; [`scalar::int8_matvec_q8`] is the
//! oracle, bit for bit.
//!
//! Arithmetic per output (the oracle's): per weight scale group, per input segment, 16 int32
//! lane accumulators start at the segment's offsets (which cancel the weights' `+ 128`) and
//! take `vpdpbusd(w + 128, x)` over the segment's 64-value steps, so each lane holds its exact
//! integer dot product; then `fa = fma(f32(lane), x_scale, fa)`. At the group's end the lanes
//! are summed in a fixed tree and `total += w_scale * sum`.

// A tile's loops index several accumulator arrays by the same row and input: the indices are
// the clearest form, and the loops unroll fully (R and N are constants).
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::staging::{tile_dispatch, tile_rows};
use crate::format::{Q8_LANES, Q8_STEP, QuantizedRows};

/// Rows x inputs of a tile: 12 int32 and 12 f32 accumulators, 4 weight vectors and an input
/// in the 32 registers.
const ROWS: usize = 4;
const INPUTS: usize = 3;

/// `out[j * ts + r * rs] = (W x[t0 + j])[r]` for inputs `t0..t0+n` of `xq` and `rows` int8
/// rows with one scale per `group` values (`(ts, rs)` is `(rows, 1)` for `[n, rows]` outputs,
/// `(1, n)` for `[rows, n]`).
///
/// # Safety
/// AVX-512F/BW/VNNI must be available. `xq.seg` divides `group`, `group` divides `cols ==
/// xq.cols`; q `[rows, cols]`, scales `[rows, cols/group]`, `out` holds every `(j, r)` position
/// (checked here with `assert!`).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn int8_rows_q8(
    q: &[i8],
    scales: &[f32],
    group: usize,
    rows: usize,
    cols: usize,
    xq: &QuantizedRows,
    t0: usize,
    n: usize,
    out: &mut [f32],
    (ts, rs): (usize, usize),
) {
    let seg = xq.seg;
    assert!(seg > 0 && seg.is_multiple_of(Q8_STEP) && group.is_multiple_of(seg) && cols.is_multiple_of(group));
    assert!(xq.cols == cols && t0 + n <= xq.n);
    assert!(q.len() >= rows * cols && scales.len() >= rows * (cols / group));
    assert!(xq.q.len() >= xq.n * cols && xq.scales.len() >= xq.n * (cols / seg));
    assert!(xq.offsets.len() >= xq.n * (cols / seg) * Q8_LANES);
    assert!(n == 0 || rows == 0 || out.len() > (n - 1) * ts + (rows - 1) * rs);
    let op = Q8 { q, scales, group, cols, xq, t0, ts, rs, out: out.as_mut_ptr() };
    let mut t = 0;
    while t < n {
        let m = (n - t).min(INPUTS);
        let mut r = 0;
        while r < rows {
            let k = tile_rows(rows - r, ROWS);
            // SAFETY: rows r..r+k and inputs t..t+m lie inside the shapes asserted above.
            unsafe { op.tile(k, m, r, t) };
            r += k;
        }
        t += m;
    }
}

/// One product's operands; `out[j * ts + r * rs]` for input `t0 + j`.
struct Q8<'a> {
    q: &'a [i8],
    scales: &'a [f32],
    group: usize,
    cols: usize,
    xq: &'a QuantizedRows,
    t0: usize,
    ts: usize,
    rs: usize,
    out: *mut f32,
}

/// [`scalar::lane_tree_sum`] of a register.
#[target_feature(enable = "avx512f")]
#[inline]
fn tree_sum(v: __m512) -> f32 {
    // Halves, then quarters, then pairs: the oracle's order.
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    let h = _mm256_add_ps(lo, hi);
    let q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    let p = _mm_add_ps(q, _mm_movehl_ps(q, q));
    _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)))
}

impl Q8<'_> {
    /// Rows `r0..r0+r` against inputs `t0..t0+m` (relative to `self.t0`).
    ///
    /// # Safety
    /// AVX-512F/BW/VNNI available; the rows and inputs lie inside the product's shapes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn tile(&self, r: usize, m: usize, r0: usize, t0: usize) {
        // SAFETY: forwarded from the caller.
        unsafe {
            tile_dispatch!("int8 x q8", self, r, m, r0, t0;
                (4, 3), (3, 3), (2, 3), (1, 3), (4, 2), (3, 2), (2, 2), (1, 2), (4, 1), (3, 1), (2, 1), (1, 1))
        }
    }

    /// # Safety
    /// As [`Self::tile`], with `R` rows and `N` inputs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[inline(never)]
    unsafe fn tile_rn<const R: usize, const N: usize>(&self, r0: usize, t0: usize) {
        let (cols, group, seg) = (self.cols, self.group, self.xq.seg);
        let (groups, segs) = (cols / group, cols / seg);
        let q = self.q.as_ptr();
        let t = self.t0 + t0;
        let xq = self.xq.q.as_ptr();
        let xs = self.xq.scales.as_ptr();
        let off = self.xq.offsets.as_ptr();
        let flip = _mm512_set1_epi8(-128);
        let mut total = [[0f32; N]; R];
        for g in 0..groups {
            let mut fa = [[_mm512_setzero_ps(); N]; R];
            for sg in g * group / seg..(g + 1) * group / seg {
                // SAFETY: segment sg of inputs t..t+N: 16 offsets each, inside `offsets`.
                let start: [__m512i; N] = std::array::from_fn(|j| unsafe {
                    _mm512_loadu_si512(off.add(((t + j) * segs + sg) * Q8_LANES) as *const _)
                });
                let mut ia = [start; R];
                for c in (sg * seg..(sg + 1) * seg).step_by(Q8_STEP) {
                    // SAFETY: 64 int8 of row r0 + k at column c (c + 64 <= cols); unaligned.
                    let w: [__m512i; R] = std::array::from_fn(|k| unsafe {
                        _mm512_xor_si512(_mm512_loadu_si512(q.add((r0 + k) * cols + c) as *const _), flip)
                    });
                    for j in 0..N {
                        // SAFETY: 64 int8 of input t + j at column c; unaligned.
                        let xv = unsafe { _mm512_loadu_si512(xq.add((t + j) * cols + c) as *const _) };
                        for k in 0..R {
                            ia[k][j] = _mm512_dpbusd_epi32(ia[k][j], w[k], xv);
                        }
                    }
                }
                for j in 0..N {
                    // SAFETY: the scale of segment sg of input t + j.
                    let s = _mm512_set1_ps(unsafe { *xs.add((t + j) * segs + sg) });
                    for k in 0..R {
                        fa[k][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[k][j]), s, fa[k][j]);
                    }
                }
            }
            for k in 0..R {
                let ws = self.scales[(r0 + k) * groups + g];
                for j in 0..N {
                    total[k][j] += ws * tree_sum(fa[k][j]);
                }
            }
        }
        for k in 0..R {
            for j in 0..N {
                // SAFETY: input t0 + j, row r0 + k lie inside `out` (asserted by `int8_rows_q8`).
                unsafe { *self.out.add((t0 + j) * self.ts + (r0 + k) * self.rs) = total[k][j] };
            }
        }
    }
}

/// [`scalar::mxfp4_row_to_int8`] for `rows` rows: `q` `[rows, cols]`, `row_scales` `[rows]`
/// (NaN for a row that is not exact in int8, its `q` row then unspecified). Per 32-value block:
/// the nibbles looked up in the 2·E2M1 table shifted by the block's exponent above the row's
/// least (`pshufb`), interleaved back into column order.
///
/// # Safety
/// AVX-512BW must be available; packed `[rows, cols/2]`, scales `[rows, cols/32]` (checked).
#[target_feature(enable = "avx512f,avx512bw")]
pub unsafe fn mxfp4_rows_to_int8(
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    q: &mut [i8],
    row_scales: &mut [f32],
) {
    use crate::format::{BLOCK, E2M1_X2_I8};
    assert!(cols.is_multiple_of(BLOCK) && packed.len() >= rows * cols / 2 && scales.len() >= rows * cols / BLOCK);
    assert!(q.len() >= rows * cols && row_scales.len() >= rows);
    let nb = cols / BLOCK;
    // SAFETY (all loads below): 16-byte tables and packed blocks inside the asserted shapes.
    let tables: [__m128i; 4] = std::array::from_fn(|s| {
        let t: [i8; 16] = std::array::from_fn(|i| E2M1_X2_I8[i] << s);
        unsafe { _mm_loadu_si128(t.as_ptr() as *const __m128i) }
    });
    let low4 = _mm_set1_epi8(0x0F);
    for r in 0..rows {
        let srow = &scales[r * nb..(r + 1) * nb];
        let Some(base) = super::super::scalar::int8_row_base(srow) else {
            row_scales[r] = f32::NAN;
            continue;
        };
        row_scales[r] = super::super::scalar::int8_row_scale(base);
        for (b, &e) in srow.iter().enumerate() {
            let t = tables[(e - base) as usize];
            // SAFETY: block b of row r: 16 packed bytes in, 32 int8 out, inside the shapes.
            unsafe {
                let p = _mm_loadu_si128(packed.as_ptr().add(r * cols / 2 + b * 16) as *const __m128i);
                let lo = _mm_shuffle_epi8(t, _mm_and_si128(p, low4));
                let hi = _mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(p, 4), low4));
                let dst = q.as_mut_ptr().add(r * cols + b * BLOCK);
                _mm_storeu_si128(dst as *mut __m128i, _mm_unpacklo_epi8(lo, hi));
                _mm_storeu_si128(dst.add(16) as *mut __m128i, _mm_unpackhi_epi8(lo, hi));
            }
        }
    }
}
