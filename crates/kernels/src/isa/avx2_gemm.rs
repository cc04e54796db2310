//! Layer 3, the cache-blocked AVX2 + FMA products of a prompt chunk (x86_64): MXFP4 and int8
//! weights against many inputs, for CPUs without AVX-512. Imports only `format`, `staging` and
//! `avx2`; [`super::avx2_tile`]'s kernels (one input) give the bits these must give, and the
//! tests hold them to it.
//!
//! Why: [`super::avx2_tile`]'s tiles decode each weight for every group of three or four inputs,
//! and its int8 product streams the whole matrix from memory once per such group: on the 2-core
//! Zen 3 this project measures on, a 1,000-token prompt spent 82% of its time in those two
//! kernels at 0.29-0.37 of the FMA roof (`deltafin bench --kernels`, perf). Here the work is
//! blocked the way a GEMM is:
//! - inputs in blocks of [`NB`], so the matrix comes from memory once per block;
//! - rows in blocks of [`RB`] and columns in blocks of `kc` (at most [`KC_MAX`]): a column block of
//!   the input block (`NB x kc` floats, 32 KiB) stays near (L1, L2) while every row tile of the row block
//!   passes;
//! - each row tile's `TR x kc` weights are decoded to f32 once per input block into a small
//!   buffer, then used by every input tile (`TR x TN` accumulators: 12 of the 16 registers);
//! - every output's running accumulator (an 8-lane vector) waits in a per-thread state buffer
//!   between column blocks.
//!
//! Arithmetic per output, the same as the one-input kernels' (so a chunked prompt is bit-identical
//! to one token at a time): the accumulator starts at zero and takes `fma(w, x, acc)` over the
//! 8-column chunks in order; MXFP4's weights are decoded already times the block's scale (exact)
//! in the deinterleaved order of the staged input; int8's chunk accumulator of one scale group is
//! folded as `acc = fma(ga, scale, acc)` at the group's end; the result is [`hsum`] of the lanes.
//! Keeping an accumulator in memory between column blocks stores and reloads its exact bits.

// A tile's loops index several accumulator and weight arrays by the same row and input: the
// indices are the clearest form, and the loops unroll fully (R and N are constants).
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::avx2::hsum;
use super::staging::{HALF_SCALE, SAFE_SCALE};
use crate::format::{BLOCK, E2M1_X2_I8};

/// Below this many inputs the register tiles of [`super::avx2_tile`] run: blocking pays for its
/// decode buffer and state traffic only when a decoded tile serves several input tiles.
pub const MIN_INPUTS: usize = 8;

/// Inputs per block: the matrix is read from memory once per block (`2 x NB` FLOPs per int8
/// weight byte, far above the machine's FLOPs per byte of memory bandwidth).
const NB: usize = 32;
/// Rows per block: the state of `RB x NB` outputs (48 KiB per state) stays in L2.
const RB: usize = 48;
/// The widest column block; a product's own divides its columns (and its scale groups).
const KC_MAX: usize = 256;
/// Rows and inputs of a register tile: 12 accumulators, 3 weight vectors and 1 input vector.
const TR: usize = 3;
const TN: usize = 4;
/// f32 lanes of a state vector.
const LANES: usize = 8;

/// Per-thread buffers, reused (no allocation once warm): the decoded row tile `[TR, kc]`, the
/// chunk accumulators `[RB, NB, 8]`, (int8) the folded accumulators `[RB, NB, 8]`, and the input
/// block packed by column block, `[cols / kc, nn, kc]`: rows of the input are a whole row apart
/// in `xs`, often a multiple of 4 KiB, so sixteen of them would fall into one set of the L1
/// cache; packed, a column block's inputs are one contiguous 32 KiB.
struct Buffers {
    wbuf: Lines,
    ga: Lines,
    acc: Lines,
    xp: Lines,
}

thread_local! {
    static BUFFERS: RefCell<Buffers> = const {
        RefCell::new(Buffers { wbuf: Lines(Vec::new()), ga: Lines(Vec::new()), acc: Lines(Vec::new()), xp: Lines(Vec::new()) })
    };
}

/// One cache line of floats.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// Floats on cache-line boundaries: the kernels' 32-byte loads never straddle two lines (a
/// `Vec<f32>` is only 16-byte aligned, and every other load would).
struct Lines(Vec<Line>);

impl Lines {
    /// The first `len` floats, grown (zeroed) when shorter.
    fn floats(&mut self, len: usize) -> &mut [f32] {
        let lines = len.div_ceil(16);
        if self.0.len() < lines {
            self.0.resize(lines, Line([0.0; 16]));
        }
        // SAFETY: `Line` is `repr(C)` over 16 f32 with no padding (64 bytes, align 64), so the
        // vector's `lines * 16 >= len` floats are initialised, contiguous and exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr() as *mut f32, len) }
    }
}

/// What a weight format gives the blocked product.
trait Weights {
    /// Columns per scale group whose chunk accumulator is folded with the row's scale at the
    /// group's end (int8), or `None` (MXFP4: the scale is inside the decoded weights).
    fn group(&self) -> Option<usize>;
    /// Row `r`'s scale of group `g` (only with [`Self::group`]).
    fn scale(&self, r: usize, g: usize) -> f32;
    /// Rows `r0..r0 + r`, columns `k0..k0 + kc` decoded exactly to f32: `dst[i * kc + c]`.
    ///
    /// # Safety
    /// AVX2 and FMA available; the rows and columns lie inside the matrix; `dst` holds `r * kc`.
    unsafe fn decode(&self, r0: usize, r: usize, k0: usize, kc: usize, dst: *mut f32);
    /// Ask for rows `r0..r0 + r`, columns `k0..k0 + kc` to be brought into L2 (a hint).
    fn prefetch(&self, r0: usize, r: usize, k0: usize, kc: usize);
}

/// Hint the lines of `span` bytes from `p` into L2 (no fault on any address: a hint).
#[inline(always)]
fn prefetch_l2(p: *const u8, span: usize) {
    let mut o = 0;
    while o < span {
        // SAFETY: a prefetch never faults and changes no architectural state; `wrapping_add` keeps
        // the address arithmetic defined.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(o) as *const i8) };
        o += 64;
    }
}

/// MXFP4 `[rows, cols]`: packed `[rows, cols/2]`, scales `[rows, cols/32]`, every scale at most
/// [`SAFE_SCALE`].
struct Mx<'a> {
    packed: &'a [u8],
    scales: &'a [u8],
    cols: usize,
}

impl Weights for Mx<'_> {
    fn group(&self) -> Option<usize> {
        None
    }

    fn scale(&self, _: usize, _: usize) -> f32 {
        1.0
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn decode(&self, r0: usize, r: usize, k0: usize, kc: usize, dst: *mut f32) {
        let (half, nb) = (self.cols / 2, self.cols / BLOCK);
        // SAFETY: the table holds 16 bytes; unaligned load.
        let lut = unsafe { _mm_loadu_si128(E2M1_X2_I8.as_ptr() as *const __m128i) };
        let low4 = _mm_set1_epi8(0x0F);
        for i in 0..r {
            for b in 0..kc / BLOCK {
                let blk = k0 / BLOCK + b;
                // SAFETY: block `blk` of row r0 + i: 16 packed bytes and one scale inside the
                // matrix (the caller's shapes); unaligned load.
                let (bytes, e) = unsafe {
                    (
                        _mm_loadu_si128(self.packed.as_ptr().add((r0 + i) * half + blk * 16) as *const __m128i),
                        *self.scales.get_unchecked((r0 + i) * nb + blk),
                    )
                };
                // The weights times the block's scale (`pshufb` gives twice the E2M1 value, times
                // half the scale: small integers times a power of two, exact), even elements 0-7,
                // 8-15, then odd 0-7, 8-15: the deinterleaved input's order.
                let even = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, low4));
                let odd = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
                let half_scale = _mm256_set1_ps(HALF_SCALE[e as usize]);
                let widen = |v: __m128i| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), half_scale);
                let w = [widen(even), widen(_mm_srli_si128(even, 8)), widen(odd), widen(_mm_srli_si128(odd, 8))];
                for (v, wv) in w.iter().enumerate() {
                    // SAFETY: element i * kc + b * 32 + v * 8 .. + 8 lies inside `dst`.
                    unsafe { _mm256_storeu_ps(dst.add(i * kc + b * BLOCK + v * LANES), *wv) };
                }
            }
        }
    }

    fn prefetch(&self, r0: usize, r: usize, k0: usize, kc: usize) {
        let (half, nb) = (self.cols / 2, self.cols / BLOCK);
        for i in r0..r0 + r {
            prefetch_l2(self.packed.as_ptr().wrapping_add(i * half + k0 / 2), kc / 2);
            prefetch_l2(self.scales.as_ptr().wrapping_add(i * nb + k0 / BLOCK), kc / BLOCK);
        }
    }
}

/// int8 `[rows, cols]` with one scale per `group` columns of each row.
struct I8<'a> {
    q: &'a [i8],
    scales: &'a [f32],
    group: usize,
    cols: usize,
}

impl Weights for I8<'_> {
    fn group(&self) -> Option<usize> {
        Some(self.group)
    }

    fn scale(&self, r: usize, g: usize) -> f32 {
        self.scales[r * (self.cols / self.group) + g]
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn decode(&self, r0: usize, r: usize, k0: usize, kc: usize, dst: *mut f32) {
        for i in 0..r {
            for c in (0..kc).step_by(LANES) {
                // SAFETY: 8 int8 inside row r0 + i (k0 + c + 8 <= cols) and 8 floats inside `dst`;
                // unaligned load and store.
                unsafe {
                    let v = _mm_loadl_epi64(self.q.as_ptr().add((r0 + i) * self.cols + k0 + c) as *const __m128i);
                    _mm256_storeu_ps(dst.add(i * kc + c), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
                }
            }
        }
    }

    fn prefetch(&self, r0: usize, r: usize, k0: usize, kc: usize) {
        for i in r0..r0 + r {
            prefetch_l2(self.q.as_ptr().wrapping_add(i * self.cols + k0) as *const u8, kc);
        }
    }
}

/// The widest column block, at most [`KC_MAX`], that is a multiple of `unit` and divides `span`
/// (`unit` divides `span`).
fn column_block(span: usize, unit: usize) -> usize {
    (1..=KC_MAX / unit).rev().map(|m| m * unit).find(|&kc| span.is_multiple_of(kc)).unwrap_or(unit)
}

/// `out[r * n + t] = W[r] . xd[t]` for MXFP4 rows against `n` inputs, each passed through
/// [`super::staging::deinterleave`]; per output the bits of [`super::avx2_tile::mxfp4_rows`].
///
/// # Safety
/// AVX2 and FMA must be available. `cols` is a multiple of 32; packed `[rows, cols/2]`, scales
/// `[rows, cols/32]` (each at most [`SAFE_SCALE`]), xd `[n, cols]`, out `[rows, n]` (checked here
/// with `assert!`).
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
    assert!(cols.is_multiple_of(BLOCK) && cols > 0);
    assert!(packed.len() >= rows * cols / 2 && scales.len() >= rows * cols / BLOCK);
    assert!(scales[..rows * cols / BLOCK].iter().all(|&s| s <= SAFE_SCALE));
    assert!(xd.len() >= n * cols && out.len() >= rows * n);
    let w = Mx { packed, scales, cols };
    // SAFETY: AVX2 and FMA available (the caller's contract); shapes asserted above.
    unsafe { gemm(&w, rows, cols, column_block(cols, BLOCK), xd, n, out.as_mut_ptr(), n, 1) };
}

/// `out[t * stride + r] = W[r] . xs[t]` for int8 rows with one scale per `group` of each row,
/// `n` inputs; per output the bits of [`super::avx2_tile::int8_rows`].
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
    assert!(group != 0 && group.is_multiple_of(LANES) && cols.is_multiple_of(group) && stride >= rows);
    assert!(q.len() >= rows * cols && scales.len() >= rows * (cols / group) && xs.len() >= n * cols);
    assert!(n == 0 || out.len() >= (n - 1) * stride + rows);
    // A column block lies inside one scale group, or is one (its chunk accumulator is folded at
    // the block's end). Per-row scales (the converter's default) give full-width blocks.
    let kc = if group > KC_MAX { column_block(group, LANES) } else { group };
    let w = I8 { q, scales, group, cols };
    // SAFETY: AVX2 and FMA available (the caller's contract); shapes asserted above.
    unsafe { gemm(&w, rows, cols, kc, xs, n, out.as_mut_ptr(), 1, stride) };
}

/// The blocked product: output (row r, input t) at `out[r * row_step + t * input_step]`.
///
/// # Safety
/// AVX2 and FMA available; `kc` a multiple of 8 dividing `cols` (and, for a grouped format,
/// dividing its group); `xs` holds `[n, cols]`; every output index lies
/// inside `out`'s allocation.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm<W: Weights>(
    w: &W,
    rows: usize,
    cols: usize,
    kc: usize,
    xs: &[f32],
    n: usize,
    out: *mut f32,
    row_step: usize,
    input_step: usize,
) {
    if rows == 0 || n == 0 {
        return;
    }
    BUFFERS.with(|b| {
        let b = &mut *b.borrow_mut();
        debug_assert!(kc <= KC_MAX && kc.is_multiple_of(LANES) && cols.is_multiple_of(kc));
        let Buffers { wbuf, ga, acc, xp } = b;
        let wbuf = wbuf.floats(TR * kc); // [TR, kc]
        let ga = ga.floats(RB * NB * LANES); // [RB, NB, 8]
        let acc = acc.floats(RB * NB * LANES); // [RB, NB, 8]
        let xp = xp.floats(NB * cols); // [cols / kc, nn, kc]
        // Input blocks of at most NB, as even as can be (36 inputs: 18 + 18, not 32 + 4).
        let blocks = n.div_ceil(NB);
        for blk in 0..blocks {
            let (n0, nn) = (blk * n / blocks, (blk + 1) * n / blocks - blk * n / blocks);
            for kb in 0..cols / kc {
                for j in 0..nn {
                    let src = &xs[(n0 + j) * cols + kb * kc..(n0 + j) * cols + (kb + 1) * kc];
                    xp[(kb * nn + j) * kc..(kb * nn + j + 1) * kc].copy_from_slice(src);
                }
            }
            let x = xp.as_ptr();
            // Input tiles of at most TN, as even as can be (9 inputs: 3 + 3 + 3).
            let tiles = nn.div_ceil(TN);
            // Tile t covers inputs bounds[t]..bounds[t + 1] (computed once: no division per tile).
            let mut bounds = [0usize; NB / 2 + 1];
            for (t, b) in bounds.iter_mut().enumerate().take(tiles + 1) {
                *b = t * nn / tiles;
            }
            for r0 in (0..rows).step_by(RB) {
                let rr = RB.min(rows - r0);
                ga.fill(0.0);
                if w.group().is_some() {
                    acc.fill(0.0);
                }
                for k0 in (0..cols).step_by(kc) {
                    let mut i = 0;
                    while i < rr {
                        let r = TR.min(rr - i);
                        // SAFETY: rows r0 + i .. + r and columns k0 .. k0 + kc lie inside the
                        // matrix; the buffer holds TR x kc floats.
                        unsafe { w.decode(r0 + i, r, k0, kc, wbuf.as_mut_ptr()) };
                        // The weights read walk 48 rows a column block at a time, which the
                        // hardware prefetchers do not follow: hint this tile's next column block
                        // (or the next row block's first), needed 16 tiles from now.
                        if k0 + kc < cols {
                            w.prefetch(r0 + i, r, k0 + kc, kc);
                        } else if r0 + RB + i + r <= rows {
                            w.prefetch(r0 + RB + i, r, 0, kc);
                        }
                        for tt in 0..tiles {
                            let (j, m) = (bounds[tt], bounds[tt + 1] - bounds[tt]);
                            // SAFETY: packed inputs j .. j + m of column block k0 / kc lie inside
                            // `xp`; the state of rows i.., inputs j.. lies inside `ga`.
                            unsafe {
                                tile(
                                    r,
                                    m,
                                    wbuf.as_ptr(),
                                    x.add((k0 / kc * nn + j) * kc),
                                    kc,
                                    kc,
                                    ga.as_mut_ptr().add((i * NB + j) * LANES),
                                )
                            };
                        }
                        i += r;
                    }
                    // A scale group ends with this column block: fold its chunk accumulators.
                    if let Some(group) = w.group()
                        && (k0 + kc).is_multiple_of(group)
                    {
                        let g = (k0 + kc) / group - 1;
                        for i in 0..rr {
                            let s = _mm256_set1_ps(w.scale(r0 + i, g));
                            for j in 0..nn {
                                let at = (i * NB + j) * LANES;
                                // SAFETY: element `at` .. + 8 lies inside both state buffers.
                                unsafe {
                                    let g = _mm256_loadu_ps(ga.as_ptr().add(at));
                                    let a = _mm256_loadu_ps(acc.as_ptr().add(at));
                                    _mm256_storeu_ps(acc.as_mut_ptr().add(at), _mm256_fmadd_ps(g, s, a));
                                    _mm256_storeu_ps(ga.as_mut_ptr().add(at), _mm256_setzero_ps());
                                }
                            }
                        }
                    }
                }
                let fin = if w.group().is_some() { &*acc } else { &*ga };
                let put = |i: usize, j: usize| {
                    // SAFETY: the state element lies inside `fin`; output (r0 + i, n0 + j) lies
                    // inside `out` (the caller's contract).
                    unsafe {
                        *out.add((r0 + i) * row_step + (n0 + j) * input_step) =
                            hsum(_mm256_loadu_ps(fin.as_ptr().add((i * NB + j) * LANES)))
                    }
                };
                // Along the output's contiguous axis (a row apart is a whole cache line or more).
                if row_step == 1 {
                    (0..nn).for_each(|j| (0..rr).for_each(|i| put(i, j)));
                } else {
                    (0..rr).for_each(|i| (0..nn).for_each(|j| put(i, j)));
                }
            }
        }
    });
}

/// `r` rows x `m` inputs of a column block onto their state.
///
/// # Safety
/// As [`tile_rn`], with `r <= TR` and `m <= TN`.
#[target_feature(enable = "avx2,fma")]
unsafe fn tile(r: usize, m: usize, w: *const f32, x: *const f32, xstride: usize, kc: usize, st: *mut f32) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match (r, m) {
            (3, 4) => tile_rn::<3, 4>(w, x, xstride, kc, st),
            (3, 3) => tile_rn::<3, 3>(w, x, xstride, kc, st),
            (3, 2) => tile_rn::<3, 2>(w, x, xstride, kc, st),
            (3, 1) => tile_rn::<3, 1>(w, x, xstride, kc, st),
            (2, 4) => tile_rn::<2, 4>(w, x, xstride, kc, st),
            (2, 3) => tile_rn::<2, 3>(w, x, xstride, kc, st),
            (2, 2) => tile_rn::<2, 2>(w, x, xstride, kc, st),
            (2, 1) => tile_rn::<2, 1>(w, x, xstride, kc, st),
            (1, 4) => tile_rn::<1, 4>(w, x, xstride, kc, st),
            (1, 3) => tile_rn::<1, 3>(w, x, xstride, kc, st),
            (1, 2) => tile_rn::<1, 2>(w, x, xstride, kc, st),
            (1, 1) => tile_rn::<1, 1>(w, x, xstride, kc, st),
            _ => unreachable!("no tile of {r} rows x {m} inputs"),
        }
    }
}

/// `R` decoded rows `w [R, kc]` against `N` inputs (input j's column block at `x + j * xstride`),
/// each output's 8-lane accumulator loaded from and stored back to `st + (i * NB + j) * 8`.
///
/// # Safety
/// AVX2 and FMA available; `kc` a multiple of 8; the pointers cover those elements.
#[target_feature(enable = "avx2,fma")]
#[inline(never)]
unsafe fn tile_rn<const R: usize, const N: usize>(
    w: *const f32,
    x: *const f32,
    xstride: usize,
    kc: usize,
    st: *mut f32,
) {
    // SAFETY (every load and store below): inside the spans the caller guarantees; unaligned.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        for i in 0..R {
            for j in 0..N {
                acc[i][j] = _mm256_loadu_ps(st.add((i * NB + j) * LANES));
            }
        }
        let mut c = 0;
        while c < kc {
            let wv: [__m256; R] = std::array::from_fn(|i| _mm256_loadu_ps(w.add(i * kc + c)));
            for j in 0..N {
                let xv = _mm256_loadu_ps(x.add(j * xstride + c));
                for i in 0..R {
                    acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
                }
            }
            c += LANES;
        }
        for i in 0..R {
            for j in 0..N {
                _mm256_storeu_ps(st.add((i * NB + j) * LANES), acc[i][j]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::has_avx2_fma;
    use crate::isa::avx2_tile;
    use crate::isa::staging::deinterleave;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|f| f.to_bits()).collect()
    }

    /// Per output exactly the one-input tile kernel's bits, on shapes that cross every block:
    /// rows past RB and off the 3-row tile, inputs past NB and off the 4-input tile, several
    /// column blocks, and int8 groups below, at and above the column block.
    #[test]
    fn blocked_products_give_the_one_input_kernels_bits() {
        if !has_avx2_fma() {
            println!("SKIPPED: this CPU has no AVX2+FMA");
            return;
        }
        for &(rows, cols, n) in &[(1, 32, 1), (5, 64, 3), (50, 96, 17), (100, 1024, 21), (49, 7168 / 8, 33)] {
            let packed: Vec<u8> = (0..rows * cols / 2).map(|i| (i * 7919 % 251) as u8).collect();
            let scales: Vec<u8> = (0..rows * cols / BLOCK).map(|i| 110 + (i * 31 % 17) as u8).collect();
            let x: Vec<f32> = (0..n * cols).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 1.3).collect();
            let mut xd = vec![0f32; n * cols];
            for (a, d) in x.chunks_exact(cols).zip(xd.chunks_exact_mut(cols)) {
                deinterleave(a, d);
            }
            let mut got = vec![f32::NAN; rows * n];
            // SAFETY: AVX2 + FMA present (checked); shapes as documented, scales <= SAFE_SCALE.
            unsafe { mxfp4_rows(&packed, &scales, rows, cols, &xd, n, &mut got) };
            for t in 0..n {
                let mut one = vec![0f32; rows];
                // SAFETY: as above.
                unsafe {
                    avx2_tile::mxfp4_rows(&packed, &scales, rows, cols, &xd[t * cols..(t + 1) * cols], 1, &mut one)
                };
                let col: Vec<f32> = (0..rows).map(|r| got[r * n + t]).collect();
                assert_eq!(bits(&col), bits(&one), "MXFP4 {rows}x{cols} input {t} of {n}");
            }
        }
        for &(rows, cols, group, n) in &[
            (4, 64, 8, 9),
            (50, 1024, 64, 17),
            (7, 768, 256, 5),
            (51, 1536, 512, 20),
            (49, 7168 / 4, 7168 / 4, 33),
            (3, 600, 120, 4),
        ] {
            let q: Vec<i8> = (0..rows * cols).map(|i| ((i * 7919 % 255) as i32 - 127) as i8).collect();
            let s: Vec<f32> = (0..rows * cols / group).map(|i| 0.01 + i as f32 * 0.001).collect();
            let xs: Vec<f32> = (0..n * cols).map(|i| (i as f32 * 0.37).sin()).collect();
            let stride = rows + 3;
            let mut got = vec![f32::NAN; n * stride];
            // SAFETY: AVX2 + FMA present (checked); shapes as documented.
            unsafe { int8_rows(&q, &s, group, rows, cols, &xs, n, &mut got, stride) };
            for t in 0..n {
                let mut one = vec![0f32; rows];
                // SAFETY: as above.
                unsafe {
                    avx2_tile::int8_rows(&q, &s, group, rows, cols, &xs[t * cols..(t + 1) * cols], 1, &mut one, rows)
                };
                assert_eq!(
                    bits(&got[t * stride..t * stride + rows]),
                    bits(&one),
                    "int8 {rows}x{cols}/{group} input {t} of {n}"
                );
                assert!(
                    got[t * stride + rows..(t + 1) * stride].iter().all(|v| v.is_nan()),
                    "past row {rows}: untouched"
                );
            }
        }
    }

    #[test]
    fn column_blocks_divide_their_span() {
        assert_eq!(column_block(7168, 32), 256);
        assert_eq!(column_block(3072, 32), 256);
        assert_eq!(column_block(96, 32), 96);
        assert_eq!(column_block(7168, 8), 256);
        assert_eq!(column_block(600, 120), 120);
        assert_eq!(column_block(1000, 8), 200);
    }
}
