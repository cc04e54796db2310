//! Layer 3, the register-blocked AVX2 + FMA products (x86_64): the exact MXFP4 products (one
//! input and a few) and the int8 spine product for CPUs without AVX-512; from
//! [`avx2_gemm::MIN_INPUTS`] inputs on, they hand over to the cache-blocked [`avx2_gemm`]. A tile of
//! `R` weight rows against `N` inputs keeps `R x N` accumulators in registers, so each decoded
//! weight vector is used `N` times and each input load `R` times. Imports only `format`,
//! `scalar`, `staging`, `avx2`, `avx2_math` and `avx2_gemm`; the scalar twins are the oracles.
//!
//! Why: the scalar twins compiled with AVX2 (what this path ran before) convert and accumulate
//! one chain of eight lanes at a time, bound by the FMA latency and a horizontal sum per scale
//! group; on the 2-core Zen 3 this project measures on, the int8 product read 2.4 GB/s of the
//! 14.5 GB/s one core can stream and a prompt chunk's product reached 3% of the FMA peak
//! (`deltafin bench --kernels`; BENCHMARKS.md section 4).
//!
//! Arithmetic, the same whatever the tile, so a chunked prompt is bit-identical to one token at
//! a time:
//! - MXFP4, per output: each 32-element block in order decodes to its weights already multiplied
//!   by the block's scale (exact: [`decode_block`]), then `acc = fma(w, x, acc)` for its even
//!   elements 0-7, 8-15 and odd elements 0-7, 8-15 against the deinterleaved input
//!   ([`super::staging::deinterleave`]), one 8-lane accumulator, reduced at the end. Rows with a
//!   scale above [`SAFE_SCALE`] take the scalar oracle.
//! - int8, per output: within each scale group, `ga = fma(w, x, ga)` over 8-weight chunks in
//!   order into one 8-lane accumulator, then `acc = fma(ga, scale, acc)`, reduced at the end.

// A tile's loops index several accumulator and weight arrays by the same row and input: the
// indices are the clearest form, and the loops unroll fully (R and N are constants).
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::avx2::hsum;
use super::avx2_gemm;
use super::avx2_math;
use super::staging::{HALF_SCALE, SAFE_SCALE, interleave_back, tile_dispatch, tile_rows};
use crate::format::{BLOCK, E2M1_X2_I8, Mxfp4};
use crate::scalar;

/// Inputs per MXFP4 tile when there are several; a chunk's inputs are split into balanced groups
/// of at most this many.
const MX_INPUTS: usize = 4;

/// Rows per MXFP4 tile: 2 with several inputs (8 accumulators, 4 decoded weights and 2 inputs
/// fill the 16 registers), 4 with one input (decoding, not the FMA latency, bounds a single
/// product: four chains are enough).
const MX_ROWS_MULTI: usize = 2;
const MX_ROWS_SINGLE: usize = 4;

/// Rows of packed MXFP4 weights kept in the core's L2 cache while every input group passes.
const MX_ROW_BLOCK: usize = 48;

/// int8 tiles: 8 rows x 1 input (eight chains hide the FMA latency), 4 rows x 3 inputs with
/// several.
const I8_ROWS_SINGLE: usize = 8;
const I8_ROWS_MULTI: usize = 4;
const I8_INPUTS: usize = 3;

/// `out[r * n + t] = W[r] . x[t]` for `rows` MXFP4 rows and `n` inputs, each input passed
/// through [`super::staging::deinterleave`]. With `n == 1` this is the mat-vec (`out` `[rows]`).
///
/// # Safety
/// AVX2 and FMA must be available. `cols` is a multiple of 32; packed `[rows, cols/2]`, scales
/// `[rows, cols/32]`, xd `[n, cols]`, out `[rows, n]` (checked here with `assert!`).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn mxfp4_rows(
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    xd: &[f32],
    n: usize,
    out: &mut [f32],
) {
    assert!(cols.is_multiple_of(BLOCK) && n > 0);
    assert!(packed.len() >= rows * cols / 2 && scales.len() >= rows * cols / BLOCK);
    assert!(xd.len() >= n * cols && out.len() >= rows * n);
    let groups = n.div_ceil(MX_INPUTS);
    let step = if n == 1 { MX_ROWS_SINGLE } else { MX_ROWS_MULTI };
    let all_safe = scales[..rows * cols / BLOCK].iter().fold(0u8, |m, &s| m.max(s)) <= SAFE_SCALE;
    if all_safe && n >= avx2_gemm::MIN_INPUTS {
        // SAFETY: AVX2 and FMA available (this function's contract); shapes asserted above and
        // every scale at most SAFE_SCALE.
        return unsafe { avx2_gemm::mxfp4_rows(packed, scales, rows, cols, xd, n, out) };
    }
    let m = Mx { packed, scales, cols, xd, n, all_safe, out: out.as_mut_ptr() };
    for rb in (0..rows).step_by(MX_ROW_BLOCK) {
        let re = (rb + MX_ROW_BLOCK).min(rows);
        for g in 0..groups {
            let (t0, t1) = (g * n / groups, (g + 1) * n / groups);
            let mut r = rb;
            while r < re {
                let k = tile_rows(re - r, step);
                // SAFETY: rows r..r+k and inputs t0..t1 lie inside the shapes asserted above.
                unsafe { m.tile(k, t1 - t0, r, t0) };
                r += k;
            }
        }
    }
}

/// One MXFP4 product's operands; `out` is `[rows, n]`.
struct Mx<'a> {
    packed: &'a [u8],
    scales: &'a [u8],
    cols: usize,
    xd: &'a [f32],
    n: usize,
    /// No scale of the product's rows is above [`SAFE_SCALE`].
    all_safe: bool,
    out: *mut f32,
}

impl Mx<'_> {
    /// Rows `r0..r0+r` against inputs `t0..t0+m`.
    ///
    /// # Safety
    /// AVX2 and FMA available; the rows and inputs lie inside the product's shapes.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile(&self, r: usize, m: usize, r0: usize, t0: usize) {
        // SAFETY: forwarded from the caller.
        unsafe {
            tile_dispatch!("MXFP4", self, r, m, r0, t0;
                (8, 1), (4, 1), (3, 1), (2, 1), (1, 1),
                (2, 2), (1, 2), (2, 3), (1, 3), (2, 4), (1, 4))
        }
    }

    /// # Safety
    /// As [`Self::tile`], with `R` rows and `N` inputs.
    #[target_feature(enable = "avx2,fma")]
    #[inline(never)]
    unsafe fn tile_rn<const R: usize, const N: usize>(&self, r0: usize, t0: usize) {
        let (cols, n) = (self.cols, self.n);
        let (half, nb) = (cols / 2, cols / BLOCK);
        let row_scales = |k: usize| &self.scales[(r0 + k) * nb..(r0 + k + 1) * nb];
        if !self.all_safe && (0..R).any(|k| row_scales(k).iter().any(|&s| s > SAFE_SCALE)) {
            for k in 0..R {
                if row_scales(k).iter().any(|&s| s > SAFE_SCALE) {
                    let prow = &self.packed[(r0 + k) * half..(r0 + k + 1) * half];
                    for j in 0..N {
                        let x = interleave_back(&self.xd[(t0 + j) * cols..(t0 + j + 1) * cols]);
                        // SAFETY: row r0 + k, input t0 + j lie inside `out` (the caller's shapes).
                        unsafe { *self.out.add((r0 + k) * n + t0 + j) = scalar::row_dot(prow, row_scales(k), &x) };
                    }
                } else {
                    // SAFETY: one safe row of this tile.
                    unsafe { self.tile_rn::<1, N>(r0 + k, t0) };
                }
            }
            return;
        }
        // SAFETY: the table holds 16 bytes; unaligned load.
        let lut = unsafe { _mm_loadu_si128(E2M1_X2_I8.as_ptr() as *const __m128i) };
        let p = self.packed.as_ptr();
        let s = self.scales.as_ptr();
        let x = self.xd.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        for b in 0..nb {
            // Block b of input t0 + j: 32 floats inside `xd`; unaligned loads.
            // SAFETY: as said.
            let x_at = |j: usize, i: usize| unsafe { _mm256_loadu_ps(x.add((t0 + j) * cols + b * BLOCK + i * 8)) };
            // Row r0 + k's block: the even weights 0-7, 8-15, then the odd weights 0-7, 8-15.
            let w_at = |k: usize| {
                // SAFETY: block b of row r0 + k: 16 packed bytes and one scale inside the matrix
                // (rows and cols checked by `mxfp4_rows`); unaligned load.
                let (bytes, sc) = unsafe {
                    (_mm_loadu_si128(p.add((r0 + k) * half + b * 16) as *const __m128i), *s.add((r0 + k) * nb + b))
                };
                decode_block(lut, bytes, sc)
            };
            if N == 1 {
                // One input: its block once, then each row decoded and used at once (4 live
                // weight registers instead of 4R).
                let xv: [__m256; 4] = std::array::from_fn(|i| x_at(0, i));
                for k in 0..R {
                    let w = w_at(k);
                    for i in 0..4 {
                        acc[k][0] = _mm256_fmadd_ps(w[i], xv[i], acc[k][0]);
                    }
                }
            } else {
                let w: [[__m256; 4]; R] = std::array::from_fn(w_at);
                for j in 0..N {
                    let xv: [__m256; 4] = std::array::from_fn(|i| x_at(j, i));
                    for k in 0..R {
                        for i in 0..4 {
                            acc[k][j] = _mm256_fmadd_ps(w[k][i], xv[i], acc[k][j]);
                        }
                    }
                }
            }
        }
        for (k, acc_k) in acc.iter().enumerate() {
            for (j, a) in acc_k.iter().enumerate() {
                // SAFETY: row r0 + k, input t0 + j lie inside `out`; AVX2 is enabled here.
                unsafe { *self.out.add((r0 + k) * n + t0 + j) = hsum(*a) };
            }
        }
    }
}

/// One block's 16 packed bytes decoded to its 32 weights times the block's scale `e` (at most
/// [`SAFE_SCALE`]): even elements 0-7 and 8-15 (low nibbles), then odd elements 0-7 and 8-15
/// (high nibbles), the order of the deinterleaved input. `pshufb` maps each nibble to twice its
/// E2M1 value as a signed byte; widened to f32 and multiplied by half the scale, exactly (small
/// integers times a power of two).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn decode_block(lut: __m128i, bytes: __m128i, e: u8) -> [__m256; 4] {
    let low4 = _mm_set1_epi8(0x0F);
    let even = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, low4));
    let odd = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
    let half_scale = _mm256_set1_ps(HALF_SCALE[e as usize]);
    let widen = |v: __m128i| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), half_scale);
    [widen(even), widen(_mm_srli_si128(even, 8)), widen(odd), widen(_mm_srli_si128(odd, 8))]
}

/// Gate (w1) and up (w3) rows `r0..r0 + act.len() / n` against `n` inputs, then SiTU:
/// `act[i * n + t] = situ(w1[r0 + i] . x[t], w3[r0 + i] . x[t])`. The two products run as
/// [`mxfp4_rows`] into per-thread buffers (reused: no allocation once warm), and SiTU is
/// [`avx2_math::situ`]'s per element, so one input or a prompt chunk's give the same bits per
/// input.
///
/// # Safety
/// AVX2 and FMA must be available; `w1`/`w3` hold `[rows, latent]` MXFP4 with `latent` a
/// multiple of 32 and at least `r0 + act.len() / n` rows; `xd` is `[n, latent]`, each input
/// passed through [`super::staging::deinterleave`]; `act` is `[rows, n]`.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn gate_up_situ(
    w1: Mxfp4,
    w3: Mxfp4,
    r0: usize,
    latent: usize,
    xd: &[f32],
    n: usize,
    beta: f32,
    linear_beta: Option<f32>,
    act: &mut [f32],
) {
    thread_local! {
        static GU: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
    }
    assert!(n > 0);
    let rows = act.len() / n;
    let (half, nb) = (latent / 2, latent / BLOCK);
    GU.with(|gu| {
        let (g, u) = &mut *gu.borrow_mut();
        g.resize(rows * n, 0.0); // [rows, n]
        u.resize(rows * n, 0.0); // [rows, n]
        for (w, out) in [(w1, &mut *g), (w3, &mut *u)] {
            let (p, s) = (&w.packed[r0 * half..(r0 + rows) * half], &w.scales[r0 * nb..(r0 + rows) * nb]);
            // SAFETY: forwarded from the caller; the slices hold exactly these rows.
            unsafe { mxfp4_rows(p, s, rows, latent, xd, n, out) };
        }
        // SAFETY: AVX2 and FMA available (this function's contract); g, u and act all hold rows x n.
        unsafe { avx2_math::situ(g, u, beta, linear_beta, act) };
    });
}

/// `out[t * stride + r] = (W xs[t])[r]` for int8 rows with one scale per `group` of each row,
/// `n` inputs; with `n == 1` the one-input product. The same bits per input whatever `n`.
///
/// # Safety
/// AVX2 and FMA must be available; `group` a non-zero multiple of 8 dividing `cols`; q
/// `[rows, cols]`, scales `[rows, cols/group]`, xs `[n, cols]`, `out.len() >= (n-1)*stride +
/// rows`, `stride >= rows` (checked here with `assert!`).
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn int8_rows(
    q: &[i8],
    scales: &[f32],
    group: usize,
    rows: usize,
    cols: usize,
    xs: &[f32],
    n: usize,
    out: &mut [f32],
    stride: usize,
) {
    assert!(group != 0 && group.is_multiple_of(8) && cols.is_multiple_of(group) && stride >= rows);
    assert!(q.len() >= rows * cols && scales.len() >= rows * (cols / group) && xs.len() >= n * cols);
    assert!(n == 0 || out.len() >= (n - 1) * stride + rows);
    if n >= avx2_gemm::MIN_INPUTS {
        // SAFETY: AVX2 and FMA available (this function's contract); shapes asserted above.
        return unsafe { avx2_gemm::int8_rows(q, scales, group, rows, cols, xs, n, out, stride) };
    }
    let op = I8 { q, scales, group, cols, xs, stride, out: out.as_mut_ptr() };
    let step = if n == 1 { I8_ROWS_SINGLE } else { I8_ROWS_MULTI };
    let mut t = 0;
    while t < n {
        let m = (n - t).min(I8_INPUTS);
        let mut r = 0;
        while r < rows {
            let k = tile_rows(rows - r, step);
            // SAFETY: rows r..r+k and inputs t..t+m lie inside the shapes asserted above.
            unsafe { op.tile(k, m, r, t) };
            r += k;
        }
        t += m;
    }
}

/// One int8 product's operands; `out[t * stride + r]`.
struct I8<'a> {
    q: &'a [i8],
    scales: &'a [f32],
    group: usize,
    cols: usize,
    xs: &'a [f32],
    stride: usize,
    out: *mut f32,
}

impl I8<'_> {
    /// Rows `r0..r0+r` against inputs `t0..t0+m`.
    ///
    /// # Safety
    /// AVX2 and FMA available; the rows and inputs lie inside the product's shapes.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile(&self, r: usize, m: usize, r0: usize, t0: usize) {
        // SAFETY: forwarded from the caller.
        unsafe {
            tile_dispatch!("int8", self, r, m, r0, t0;
                (8, 1), (4, 1), (3, 1), (2, 1), (1, 1),
                (4, 2), (3, 2), (2, 2), (1, 2), (4, 3), (3, 3), (2, 3), (1, 3))
        }
    }

    /// # Safety
    /// As [`Self::tile`], with `R` rows and `N` inputs.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile_rn<const R: usize, const N: usize>(&self, r0: usize, t0: usize) {
        let groups = self.cols / self.group;
        // The row accumulators live in memory (touched once per group), the group's in registers.
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        for g in 0..groups {
            // SAFETY: forwarded from the caller.
            unsafe { self.group_rn::<R, N>(r0, t0, g, &mut acc) };
        }
        for (k, acc_k) in acc.iter().enumerate() {
            for (j, a) in acc_k.iter().enumerate() {
                // SAFETY: input t0 + j, row r0 + k lie inside `out` (asserted by `int8_rows`);
                // AVX2 is enabled here.
                unsafe { *self.out.add((t0 + j) * self.stride + r0 + k) = hsum(*a) };
            }
        }
    }

    /// Scale group `g` of the tile, added to `acc`.
    ///
    /// # Safety
    /// As [`Self::tile_rn`], with `g < cols / group`.
    #[target_feature(enable = "avx2,fma")]
    #[inline(never)]
    unsafe fn group_rn<const R: usize, const N: usize>(
        &self,
        r0: usize,
        t0: usize,
        g: usize,
        acc: &mut [[__m256; N]; R],
    ) {
        let (cols, group) = (self.cols, self.group);
        let groups = cols / group;
        let q = self.q.as_ptr();
        let x = self.xs.as_ptr();
        let mut ga = [[_mm256_setzero_ps(); N]; R];
        for c in (g * group..(g + 1) * group).step_by(8) {
            let w: [__m256; R] = std::array::from_fn(|k| {
                // SAFETY: 8 int8 inside row r0 + k (c + 8 <= cols); unaligned load.
                let v = unsafe { _mm_loadl_epi64(q.add((r0 + k) * cols + c) as *const __m128i) };
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
            });
            for j in 0..N {
                // SAFETY: 8 f32 inside input t0 + j (c + 8 <= cols); unaligned load.
                let xv = unsafe { _mm256_loadu_ps(x.add((t0 + j) * cols + c)) };
                for k in 0..R {
                    ga[k][j] = _mm256_fmadd_ps(w[k], xv, ga[k][j]);
                }
            }
        }
        for k in 0..R {
            let s = _mm256_set1_ps(self.scales[(r0 + k) * groups + g]);
            for j in 0..N {
                acc[k][j] = _mm256_fmadd_ps(ga[k][j], s, acc[k][j]);
            }
        }
    }
}
