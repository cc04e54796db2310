//! Layer 3, the register-blocked AVX-512 products (x86_64, F + BW): a tile of `R` weight rows
//! against `N` inputs keeps `R x N` accumulators in registers, so each decoded weight block is
//! used `N` times and each input load `R` times. Every exact MXFP4 product on this path (one
//! input or a prompt chunk's) and the prompt chunk's int8 spine product run here. Imports only
//! `format` and `scalar`; the scalar twins are the oracles.
//!
//! Why tiles: a kernel that loads a 64-byte input vector for every FMA or two is bound by
//! those loads; on the Zen 5 this project measures on, tiles sharing each load among 3-4 rows
//! made a 1,000-token prompt 1.6x faster end to end (`deltafin bench --kernels`, prompt-chunk
//! rows, and BENCHMARKS.md section 9).
//!
//! Arithmetic, the same whatever the tile, so a chunked prompt is bit-identical to one token at
//! a time:
//! - MXFP4, per output: the block's decoded even and odd weights are multiplied by the block's
//!   scale (exact: a power of two times an E2M1 value), then `acc = fma(w_even, x_even, acc);
//!   acc = fma(w_odd, x_odd, acc)` over the blocks in order, one 16-lane accumulator, reduced at
//!   the end. Rows with a scale above 200 (where a lane could overflow and the oracle would not)
//!   take the scalar oracle.
//! - int8, per output: exactly [`super::avx512::int8_matvec`]'s: within each scale group, even
//!   16-weight chunks into one accumulator and odd ones into another, their sum times the
//!   group's scale added to the row's accumulator, reduced at the end.

// A tile's loops index several accumulator and weight arrays by the same row and input: the
// indices are the clearest form, and the loops unroll fully (R and N are constants).
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::avx512_math;
use super::staging::{HALF_SCALE, SAFE_SCALE, interleave_back, tile_dispatch, tile_rows};
use crate::format::{BLOCK, E2M1_LUT, Mxfp4};
use crate::scalar;

/// Inputs per MXFP4 tile when there are several; a chunk's inputs are split into balanced groups
/// of at most this many.
const MX_INPUTS: usize = 5;

/// Rows per MXFP4 tile: 3 with several inputs (15 accumulators, 6 decoded weights; 3 x 6 ran
/// out of registers and spilled accumulators inside the loop, and 2 x 6 and 3 x 4 measured
/// slower), 8 with one input (eight independent accumulator chains hide the FMA latency of a
/// single product).
const MX_ROWS_MULTI: usize = 3;
const MX_ROWS_SINGLE: usize = 8;

/// Rows of packed MXFP4 weights kept in the core's L2 cache while every input group passes.
const MX_ROW_BLOCK: usize = 48;

/// int8 tile: 4 rows x 3 inputs (24 group accumulators).
const I8_ROWS: usize = 4;
/// Rows of an int8 tile with one input: eight rows share each input load (the one-row kernel
/// loaded 64 bytes of input per 16 bytes of weights and read 9.3 GB/s of the 21.9 one core
/// streams on Zen 4, `bench --kernels`), with 24 of the 32 registers in the loop.
const I8_ROWS_SINGLE: usize = 8;
const I8_INPUTS: usize = 3;

/// `out[r * n + t] = W[r] . x[t]` for `rows` MXFP4 rows and `n` inputs, each input passed
/// through [`super::staging::deinterleave`]. With `n == 1` this is the mat-vec (`out` `[rows]`).
///
/// # Safety
/// AVX-512F/BW must be available. `cols` is a multiple of 32; packed `[rows, cols/2]`, scales
/// `[rows, cols/32]`, xd `[n, cols]`, out `[rows, n]` (checked here with `assert!`).
#[target_feature(enable = "avx512f,avx512bw")]
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
    // One pass over the scales (a vectorised max) spares every tile its own check.
    let all_safe = scales[..rows * cols / BLOCK].iter().fold(0u8, |m, &s| m.max(s)) <= SAFE_SCALE;
    let m = Mx { packed, scales, cols, xd, n, all_safe, out: out.as_mut_ptr() };
    for rb in (0..rows).step_by(MX_ROW_BLOCK) {
        let re = (rb + MX_ROW_BLOCK).min(rows);
        for g in 0..groups {
            // Balanced groups: 11 inputs run as 4 + 4 + 3, not 5 + 5 + 1.
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
    /// AVX-512F/BW available; the rows and inputs lie inside the product's shapes.
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn tile(&self, r: usize, m: usize, r0: usize, t0: usize) {
        // SAFETY: forwarded from the caller.
        unsafe {
            tile_dispatch!("MXFP4", self, r, m, r0, t0;
                (8, 1), (4, 1), (3, 1), (2, 1), (1, 1),
                (3, 2), (2, 2), (1, 2), (3, 3), (2, 3), (1, 3),
                (3, 4), (2, 4), (1, 4), (3, 5), (2, 5), (1, 5))
        }
    }

    /// # Safety
    /// As [`Self::tile`], with `R` rows and `N` inputs.
    #[target_feature(enable = "avx512f,avx512bw")]
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
        // Twice the E2M1 table (exact), so that one broadcast load of `HALF_SCALE` scales it: the
        // same bits as the table times the block's scale, without building the scale from its code.
        // SAFETY: E2M1_LUT holds exactly 16 f32.
        let lut = unsafe { _mm512_loadu_ps(E2M1_LUT.as_ptr()) };
        let lut = _mm512_add_ps(lut, lut);
        let p = self.packed.as_ptr();
        let s = self.scales.as_ptr();
        let x = self.xd.as_ptr();
        let mut acc = [[_mm512_setzero_ps(); N]; R];
        for b in 0..nb {
            if N == 1 && b % 4 == 0 {
                // One input: the product streams its rows from memory at the decoder's pace, and
                // the hardware prefetcher does not follow eight rows read 16 bytes at a time. Ask
                // for the next tile's line at this column while this tile decodes (one 64-byte
                // line per row every four blocks; past the matrix's end the hint is dropped).
                for k in 0..R {
                    let line = p.wrapping_add((r0 + R + k) * half + b * 16);
                    // A prefetch hint never faults, whatever the address.
                    _mm_prefetch::<_MM_HINT_T0>(line as *const i8);
                }
            }
            let mut we = [_mm512_setzero_ps(); R];
            let mut wo = [_mm512_setzero_ps(); R];
            for k in 0..R {
                // SAFETY: block b of row r0 + k: 16 packed bytes and one scale inside the matrix
                // (rows and cols checked by `mxfp4_rows`); unaligned load.
                let (bytes, sc) = unsafe {
                    (_mm_loadu_si128(p.add((r0 + k) * half + b * 16) as *const __m128i), *s.add((r0 + k) * nb + b))
                };
                let v = _mm512_cvtepu8_epi32(bytes);
                // The table times the block's scale (exact: a power of two), looked up twice. The
                // permutes read only each lane's low four bits: the low nibble needs no mask.
                // SAFETY: a code of at most SAFE_SCALE (checked above) indexes the 256-entry table.
                let half = unsafe { *HALF_SCALE.get_unchecked(sc as usize) };
                let lut_s = _mm512_mul_ps(lut, _mm512_set1_ps(half));
                we[k] = _mm512_permutexvar_ps(v, lut_s);
                wo[k] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut_s);
            }
            for j in 0..N {
                // SAFETY: block b of input t0 + j: 32 floats inside `xd`; unaligned loads.
                let (xe, xo) = unsafe {
                    let xb = x.add((t0 + j) * cols + b * BLOCK);
                    (_mm512_loadu_ps(xb), _mm512_loadu_ps(xb.add(16)))
                };
                for k in 0..R {
                    acc[k][j] = _mm512_fmadd_ps(we[k], xe, acc[k][j]);
                    acc[k][j] = _mm512_fmadd_ps(wo[k], xo, acc[k][j]);
                }
            }
        }
        for (k, acc_k) in acc.iter().enumerate() {
            for (j, a) in acc_k.iter().enumerate() {
                // SAFETY: row r0 + k, input t0 + j lie inside `out`.
                unsafe { *self.out.add((r0 + k) * n + t0 + j) = _mm512_reduce_add_ps(*a) };
            }
        }
    }
}

/// `out[t * stride + r] = (W xs[t])[r]` for int8 rows with one scale per `group` of each row,
/// `n` inputs: bit-identical per input to [`super::avx512::int8_matvec`].
///
/// # Safety
/// AVX-512F/BW must be available; `group` a non-zero multiple of 16 dividing `cols`; q
/// `[rows, cols]`, scales `[rows, cols/group]`, xs `[n, cols]`, `out.len() >= (n-1)*stride +
/// rows`, `stride >= rows` (checked here with `assert!`).
#[target_feature(enable = "avx512f,avx512bw")]
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
    assert!(group != 0 && group.is_multiple_of(16) && cols.is_multiple_of(group) && stride >= rows);
    assert!(q.len() >= rows * cols && scales.len() >= rows * (cols / group) && xs.len() >= n * cols);
    assert!(n == 0 || out.len() >= (n - 1) * stride + rows);
    let op = I8 { q, scales, group, cols, xs, stride, out: out.as_mut_ptr() };
    let mut t = 0;
    while t < n {
        let m = (n - t).min(I8_INPUTS);
        let mut r = 0;
        while r < rows {
            let k = tile_rows(rows - r, if n == 1 { I8_ROWS_SINGLE } else { I8_ROWS });
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
    /// AVX-512F/BW available; the rows and inputs lie inside the product's shapes.
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn tile(&self, r: usize, m: usize, r0: usize, t0: usize) {
        // SAFETY: forwarded from the caller.
        unsafe {
            tile_dispatch!("int8", self, r, m, r0, t0;
                (8, 1), (4, 1), (3, 1), (2, 1), (1, 1), (4, 2), (3, 2), (2, 2), (1, 2), (4, 3), (3, 3), (2, 3), (1, 3))
        }
    }

    /// # Safety
    /// As [`Self::tile`], with `R` rows and `N` inputs.
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn tile_rn<const R: usize, const N: usize>(&self, r0: usize, t0: usize) {
        let groups = self.cols / self.group;
        // The row accumulators live in memory (touched once per group): with them in registers
        // too, 4 x 3 tiles would need 36 and spill inside the hot loop.
        let mut acc = [[_mm512_setzero_ps(); N]; R];
        for g in 0..groups {
            // SAFETY: forwarded from the caller.
            unsafe { self.group_rn::<R, N>(r0, t0, g, &mut acc) };
        }
        for (k, acc_k) in acc.iter().enumerate() {
            for (j, a) in acc_k.iter().enumerate() {
                // SAFETY: input t0 + j, row r0 + k lie inside `out` (asserted by `int8_rows`).
                unsafe { *self.out.add((t0 + j) * self.stride + r0 + k) = _mm512_reduce_add_ps(*a) };
            }
        }
    }

    /// Scale group `g` of the tile, added to `acc`.
    ///
    /// # Safety
    /// As [`Self::tile_rn`], with `g < cols / group`.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline(never)]
    unsafe fn group_rn<const R: usize, const N: usize>(
        &self,
        r0: usize,
        t0: usize,
        g: usize,
        acc: &mut [[__m512; N]; R],
    ) {
        let (cols, group) = (self.cols, self.group);
        let (groups, chunks) = (cols / group, group / 16);
        let q = self.q.as_ptr();
        let x = self.xs.as_ptr();
        // Widen 16 int8 of row r0 + k at column c.
        let w_at = |k: usize, c: usize| {
            // SAFETY: 16 int8 inside row r0 + k (c + 16 <= cols); unaligned load.
            let v = unsafe { _mm_loadu_si128(q.add((r0 + k) * cols + c) as *const __m128i) };
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v))
        };
        // 16 f32 of input t0 + j at column c.
        // SAFETY: inside input t0 + j (c + 16 <= cols); unaligned load.
        let x_at = |j: usize, c: usize| unsafe { _mm512_loadu_ps(x.add((t0 + j) * cols + c)) };
        let mut ga0 = [[_mm512_setzero_ps(); N]; R];
        let mut ga1 = [[_mm512_setzero_ps(); N]; R];
        // One 16-weight chunk at column c into the accumulators `ga`.
        macro_rules! chunk {
            ($ga:ident, $c:expr) => {{
                let c = $c;
                let w: [__m512; R] = std::array::from_fn(|k| w_at(k, c));
                for j in 0..N {
                    let xv = x_at(j, c);
                    for k in 0..R {
                        $ga[k][j] = _mm512_fmadd_ps(w[k], xv, $ga[k][j]);
                    }
                }
            }};
        }
        // Even chunks into ga0, odd ones into ga1, as the one-input kernel alternates: whole
        // pairs without a branch (a conditional second half cost register copies in the loop),
        // then the odd chunk of an odd count.
        let base = g * group;
        for pair in 0..chunks / 2 {
            chunk!(ga0, base + pair * 32);
            chunk!(ga1, base + pair * 32 + 16);
        }
        if chunks % 2 == 1 {
            chunk!(ga0, base + (chunks - 1) * 16);
        }
        for k in 0..R {
            let s = _mm512_set1_ps(self.scales[(r0 + k) * groups + g]);
            for j in 0..N {
                acc[k][j] = _mm512_fmadd_ps(_mm512_add_ps(ga0[k][j], ga1[k][j]), s, acc[k][j]);
            }
        }
    }
}

/// Gate (w1) and up (w3) rows `r0..r0 + act.len() / n` against `n` inputs, then SiTU:
/// `act[i * n + t] = situ(w1[r0 + i] . x[t], w3[r0 + i] . x[t])`. The two products run as
/// [`mxfp4_rows`] into per-thread buffers (reused: no allocation once warm), so one input or a
/// prompt chunk's give the same bits per input.
///
/// # Safety
/// AVX-512F/BW must be available; `w1`/`w3` hold `[rows, latent]` MXFP4 with `latent` a multiple
/// of 32 and at least `r0 + act.len() / n` rows; `xd` is `[n, latent]`, each input passed through
/// [`super::staging::deinterleave`]; `act` is `[rows, n]`.
#[target_feature(enable = "avx512f,avx512bw")]
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
    // Per thread: a pool worker sizes them the first time it takes rows of an expert (its
    // warm-up), and a decode step's one input never needs more than a prompt chunk's did.
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
        // SAFETY: AVX-512F present (the caller's guarantee); g, u and act all hold rows x n.
        unsafe { avx512_math::situ(g, u, beta, linear_beta, act) };
    });
}
