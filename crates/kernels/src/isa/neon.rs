//! Layer 3, every NEON kernel (aarch64): MXFP4, int8 and bf16 mat-vecs, the batched MXFP4 expert
//! product, the approximate product with `sdot`, RMSNorm and softmax. Imports only `format` and
//! `scalar`. Their oracles are the scalar twins; the tests run them under `qemu-aarch64` on x86
//! machines (`scripts/test-neon.sh`).
//!
//! MXFP4: a block's 16 packed bytes split into low and high nibbles, `tbl` maps each nibble to
//! the exact integer 2·E2M1 (a signed byte), `zip` restores element order, and the 32 weights
//! widen to f32 for four-lane FMAs against the input; the block sum is scaled once by half the
//! E8M0 scale (which undoes the factor 2 exactly).

use std::arch::aarch64::*;

use crate::format::{BLOCK, Dense, E2M1_X2_I8, e8m0_to_f32};
use crate::scalar;

/// Sixteen signed bytes as four f32 vectors, in order.
#[inline]
#[target_feature(enable = "neon")]
fn widen_i8x16(v: int8x16_t) -> [float32x4_t; 4] {
    let lo = vmovl_s8(vget_low_s8(v));
    let hi = vmovl_s8(vget_high_s8(v));
    [
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))),
        vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo))),
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))),
        vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi))),
    ]
}

/// A block's 16 packed bytes as its 16 even (low nibble) and 16 odd (high nibble) weights,
/// each the exact integer 2·E2M1 as a signed byte.
#[inline]
#[target_feature(enable = "neon")]
fn block_ints(bytes: uint8x16_t) -> (int8x16_t, int8x16_t) {
    // SAFETY: the table holds 16 bytes.
    let lut = unsafe { vld1q_s8(E2M1_X2_I8.as_ptr()) };
    let low4 = vdupq_n_u8(0x0F);
    (vqtbl1q_s8(lut, vandq_u8(bytes, low4)), vqtbl1q_s8(lut, vshrq_n_u8::<4>(bytes)))
}

/// A block's 32 weights in element order, as eight f32 vectors.
#[inline]
#[target_feature(enable = "neon")]
fn block_floats(bytes: uint8x16_t) -> [[float32x4_t; 4]; 2] {
    let (even, odd) = block_ints(bytes);
    [widen_i8x16(vzip1q_s8(even, odd)), widen_i8x16(vzip2q_s8(even, odd))]
}

/// MXFP4 mat-vec.
///
/// # Safety
/// NEON must be available (always on aarch64). Shapes as `mxfp4_matvec`, validated by the caller.
#[target_feature(enable = "neon")]
pub unsafe fn mxfp4_matvec(packed: &[u8], scales: &[u8], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    let (half, nb) = (cols / 2, cols / BLOCK);
    for (r, o) in out.iter_mut().enumerate().take(rows) {
        let prow = &packed[r * half..(r + 1) * half];
        let srow = &scales[r * nb..(r + 1) * nb];
        if srow.iter().any(|&s| s > 200) {
            // Huge scales could overflow a lane where the oracle's order does not: take its path.
            *o = scalar::row_dot(prow, srow, x);
            continue;
        }
        let mut acc = vdupq_n_f32(0.0);
        for (b, &s) in srow.iter().enumerate() {
            let xb = &x[b * BLOCK..(b + 1) * BLOCK];
            // SAFETY: 16 packed bytes in bounds.
            let bytes = unsafe { vld1q_u8(prow[b * 16..].as_ptr()) };
            let ws = block_floats(bytes);
            let mut blk = vdupq_n_f32(0.0);
            for (k, w) in ws.iter().flatten().enumerate() {
                // SAFETY: 4 floats of the block's 32 in bounds.
                blk = vfmaq_f32(blk, *w, unsafe { vld1q_f32(xb[4 * k..].as_ptr()) });
            }
            acc = vfmaq_f32(acc, blk, vdupq_n_f32(0.5 * e8m0_to_f32(s)));
        }
        *o = vaddvq_f32(acc);
    }
}

/// bf16 weights (raw bits) widened to f32 by a shift, 16 per step in four accumulators; only the
/// summation order (and FMA's single rounding) differs from [`scalar::bf16_matvec`].
///
/// # Safety
/// NEON must be available; `w.len() == rows * cols`, `x.len() == cols`, `out.len() == rows`.
#[target_feature(enable = "neon")]
pub unsafe fn bf16_matvec(w: &[u16], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    assert!(w.len() == rows * cols && x.len() == cols && out.len() == rows);
    let body = cols / 16 * 16;
    for (r, o) in out.iter_mut().enumerate() {
        let row = &w[r * cols..(r + 1) * cols];
        let mut acc = [vdupq_n_f32(0.0); 4];
        for (w16, x16) in row[..body].chunks_exact(16).zip(x[..body].chunks_exact(16)) {
            // SAFETY: 16 u16 and 16 f32 in bounds per chunk; unaligned loads.
            let (wl, wh) = unsafe { (vld1q_u16(w16.as_ptr()), vld1q_u16(w16.as_ptr().add(8))) };
            // bf16 is the high half of an f32: widen with a 16-bit shift (exact).
            let ws = [
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(wl))),
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_high_u16(wl))),
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(wh))),
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_high_u16(wh))),
            ];
            for (j, (a, wv)) in acc.iter_mut().zip(ws).enumerate() {
                // SAFETY: 4 f32 at 4j within the chunk of 16.
                let xv = unsafe { vld1q_f32(x16.as_ptr().add(4 * j)) };
                *a = vfmaq_f32(*a, wv, xv);
            }
        }
        let mut s = vaddvq_f32(vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3])));
        for (&b, &v) in row[body..].iter().zip(&x[body..]) {
            s += f32::from_bits((b as u32) << 16) * v;
        }
        *o = s;
    }
}

/// int8 weights with one scale per `group` (a multiple of 16) of each row.
///
/// # Safety
/// NEON must be available; shapes validated by the caller; `group % 16 == 0`.
#[target_feature(enable = "neon")]
pub unsafe fn int8_matvec(
    q: &[i8],
    scales: &[f32],
    group: usize,
    rows: usize,
    cols: usize,
    x: &[f32],
    out: &mut [f32],
) {
    let groups = cols / group;
    for (r, o) in out.iter_mut().enumerate().take(rows) {
        let row = &q[r * cols..(r + 1) * cols];
        let srow = &scales[r * groups..(r + 1) * groups];
        let mut acc = vdupq_n_f32(0.0);
        for (g, &s) in srow.iter().enumerate() {
            let mut ga = vdupq_n_f32(0.0);
            for (q16, x16) in row[g * group..(g + 1) * group].chunks_exact(16).zip(x[g * group..].chunks_exact(16)) {
                // SAFETY: 16 int8 in bounds.
                let w = widen_i8x16(unsafe { vld1q_s8(q16.as_ptr()) });
                for (k, wk) in w.iter().enumerate() {
                    // SAFETY: 4 floats of the chunk's 16 in bounds.
                    ga = vfmaq_f32(ga, *wk, unsafe { vld1q_f32(x16[4 * k..].as_ptr()) });
                }
            }
            acc = vfmaq_f32(acc, ga, vdupq_n_f32(s));
        }
        *o = vaddvq_f32(acc);
    }
}

/// Inputs whose accumulators [`mxfp4_rows_batch`] keeps at once.
const BATCH_GROUP: usize = 8;

/// MXFP4 rows against `n` inputs at once, each block decoded once for all of them. Output
/// `[rows, n]` (staged; the caller transposes). Per input the operations and their order are
/// exactly [`mxfp4_matvec`]'s, so every output is bit-identical to it.
///
/// # Safety
/// NEON must be available; shapes as `mxfp4_matmat` (xs `[n, cols]`), validated by the caller;
/// `out.len() == rows * n`.
#[target_feature(enable = "neon")]
pub unsafe fn mxfp4_rows_batch(
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    xs: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let (half, nb) = (cols / 2, cols / BLOCK);
    for r in 0..rows {
        let prow = &packed[r * half..(r + 1) * half];
        let srow = &scales[r * nb..(r + 1) * nb];
        let orow = &mut out[r * n..(r + 1) * n];
        if srow.iter().any(|&s| s > 200) {
            for (t, o) in orow.iter_mut().enumerate() {
                *o = scalar::row_dot(prow, srow, &xs[t * cols..(t + 1) * cols]);
            }
            continue;
        }
        // Inputs in groups of BATCH_GROUP, one accumulator each (in registers, no allocation);
        // a block is decoded once per group.
        for t0 in (0..n).step_by(BATCH_GROUP) {
            let g = (n - t0).min(BATCH_GROUP);
            let mut acc = [vdupq_n_f32(0.0); BATCH_GROUP];
            for (b, &s) in srow.iter().enumerate() {
                // SAFETY: 16 packed bytes in bounds.
                let bytes = unsafe { vld1q_u8(prow[b * 16..].as_ptr()) };
                let ws = block_floats(bytes);
                let sv = vdupq_n_f32(0.5 * e8m0_to_f32(s));
                for (t, a) in acc.iter_mut().enumerate().take(g) {
                    let x0 = (t0 + t) * cols + b * BLOCK;
                    let xb = &xs[x0..x0 + BLOCK];
                    let mut blk = vdupq_n_f32(0.0);
                    for (k, w) in ws.iter().flatten().enumerate() {
                        // SAFETY: 4 floats of the block's 32 in bounds.
                        blk = vfmaq_f32(blk, *w, unsafe { vld1q_f32(xb[4 * k..].as_ptr()) });
                    }
                    *a = vfmaq_f32(*a, blk, sv);
                }
            }
            for (o, a) in orow[t0..t0 + g].iter_mut().zip(&acc) {
                *o = vaddvq_f32(*a);
            }
        }
    }
}

/// `acc + a·b` by lanes of four bytes (`sdot`, FEAT_DotProd). std's `vdotq_s32` is not stable
/// yet, so this is the one instruction in inline assembly.
#[inline]
#[target_feature(enable = "neon,dotprod")]
fn sdot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: sdot reads two vector registers and accumulates into a third; it touches no
    // memory, and the CPU has DotProd (this function's callers are guarded by it).
    unsafe {
        std::arch::asm!(
            ".arch_extension dotprod",
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}

/// The approximate (int8 activation) MXFP4 product with `sdot` (FEAT_DotProd, on every Apple
/// M-series core): a block's 16 even and 16 odd weights (2·E2M1 as signed bytes) against its 16
/// even and 16 odd quantised activations in two four-way dot products; the block's integer sum
/// is exact, and the f32 accumulation runs in the scalar kernel's order, so the result is
/// bit-identical to `scalar::mxfp4_matvec_q8`.
///
/// # Safety
/// NEON and DotProd must be available; shapes as `scalar::mxfp4_matvec_q8`, validated by the
/// caller.
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn mxfp4_matvec_q8_dot(
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    xq: &crate::format::QuantizedX,
    out: &mut [f32],
) {
    let (half, nb) = (cols / 2, cols / BLOCK);
    for (r, o) in out.iter_mut().enumerate().take(rows) {
        let prow = &packed[r * half..(r + 1) * half];
        let srow = &scales[r * nb..(r + 1) * nb];
        let mut acc = 0f32;
        for b in 0..nb {
            let qb = &xq.q[b * BLOCK..(b + 1) * BLOCK];
            // SAFETY: 16 packed bytes and 2 x 16 quantised activations in bounds.
            let (bytes, qe, qo) =
                unsafe { (vld1q_u8(prow[b * 16..].as_ptr()), vld1q_s8(qb.as_ptr()), vld1q_s8(qb[16..].as_ptr())) };
            let (even, odd) = block_ints(bytes);
            let dot = vaddvq_s32(sdot(sdot(vdupq_n_s32(0), even, qe), odd, qo));
            acc += dot as f32 * (0.5 * e8m0_to_f32(srow[b]) * xq.scales[b]);
        }
        *o = acc;
    }
}

/// In-place RMSNorm, the sum of squares in f64 lanes (as the AVX-512 kernel; the scalar twin
/// sums in f64 too, in another order).
///
/// # Safety
/// NEON must be available; `x.len() == weight.len()`.
#[target_feature(enable = "neon")]
pub unsafe fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    let n = x.len();
    let (mut s0, mut s1) = (vdupq_n_f64(0.0), vdupq_n_f64(0.0));
    let mut i = 0;
    while i + 4 <= n {
        // SAFETY: 4 floats in bounds.
        let v = unsafe { vld1q_f32(x.as_ptr().add(i)) };
        let (lo, hi) = (vcvt_f64_f32(vget_low_f32(v)), vcvt_high_f64_f32(v));
        s0 = vfmaq_f64(s0, lo, lo);
        s1 = vfmaq_f64(s1, hi, hi);
        i += 4;
    }
    let mut ss = vaddvq_f64(vaddq_f64(s0, s1));
    for &v in &x[i..] {
        ss += v as f64 * v as f64;
    }
    let inv = (1.0 / ((ss / n as f64) + eps as f64).sqrt()) as f32;
    let invv = vdupq_n_f32(inv);
    let mut i = 0;
    while i + 4 <= n {
        // SAFETY: 4 floats of each slice in bounds.
        unsafe {
            let v = vld1q_f32(x.as_ptr().add(i));
            let w = vld1q_f32(weight.as_ptr().add(i));
            vst1q_f32(x.as_mut_ptr().add(i), vmulq_f32(v, vmulq_f32(invv, w)));
        }
        i += 4;
    }
    for (v, &w) in x[i..].iter_mut().zip(&weight[i..]) {
        *v *= inv * w;
    }
}

/// `exp` of 4 lanes: `2^k · p(r)` with `x = k ln2 + r`, ln2 split in two, `p` the Taylor
/// polynomial to degree 6 (as the AVX-512 kernel); `2^k` is built in two halves so that results
/// down to e^-104 come out as subnormals, and below that (including -inf: masked scores) 0.
#[inline]
#[target_feature(enable = "neon")]
fn exp_f32x4(x: float32x4_t) -> float32x4_t {
    let lo = vdupq_n_f32(-104.0);
    let zero_out = vcltq_f32(x, lo);
    let x = vminq_f32(vmaxq_f32(x, lo), vdupq_n_f32(88.0));
    let k = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(std::f32::consts::LOG2_E)));
    let r = vfmsq_f32(x, k, vdupq_n_f32(0.693_145_75));
    let r = vfmsq_f32(r, k, vdupq_n_f32(1.428_606_8e-6));
    let mut p = vdupq_n_f32(1.0 / 720.0);
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = vfmaq_f32(vdupq_n_f32(c), p, r);
    }
    let ki = vcvtq_s32_f32(k);
    let k1 = vshrq_n_s32::<1>(ki);
    let k2 = vsubq_s32(ki, k1);
    let pow2 = |e: int32x4_t| vreinterpretq_f32_s32(vshlq_n_s32::<23>(vaddq_s32(e, vdupq_n_s32(127))));
    let y = vmulq_f32(vmulq_f32(p, pow2(k1)), pow2(k2));
    vbslq_f32(zero_out, vdupq_n_f32(0.0), y)
}

/// In-place softmax with a vector `exp`; the sum is accumulated in lanes.
///
/// # Safety
/// NEON must be available.
#[target_feature(enable = "neon")]
pub unsafe fn softmax_inplace(x: &mut [f32]) {
    let n = x.len();
    let full = n / 4 * 4;
    let mut mv = vdupq_n_f32(f32::NEG_INFINITY);
    for i in (0..full).step_by(4) {
        // SAFETY: 4 floats in bounds.
        mv = vmaxq_f32(mv, unsafe { vld1q_f32(x.as_ptr().add(i)) });
    }
    let m = x[full..].iter().fold(vmaxvq_f32(mv), |m, &v| m.max(v));
    let mvec = vdupq_n_f32(m);
    let mut sum = vdupq_n_f32(0.0);
    for i in (0..full).step_by(4) {
        // SAFETY: 4 floats in bounds.
        unsafe {
            let e = exp_f32x4(vsubq_f32(vld1q_f32(x.as_ptr().add(i)), mvec));
            vst1q_f32(x.as_mut_ptr().add(i), e);
            sum = vaddq_f32(sum, e);
        }
    }
    let mut s = vaddvq_f32(sum);
    for v in &mut x[full..] {
        // The tail through the same vector exp, one lane used.
        let e = vgetq_lane_f32::<0>(exp_f32x4(vdupq_n_f32(*v - m)));
        *v = e;
        s += e;
    }
    let sv = vdupq_n_f32(s);
    for i in (0..full).step_by(4) {
        // SAFETY: 4 floats in bounds.
        unsafe { vst1q_f32(x.as_mut_ptr().add(i), vdivq_f32(vld1q_f32(x.as_ptr().add(i)), sv)) };
    }
    for v in &mut x[full..] {
        *v /= s;
    }
}

// ---- Transposed products and the one-pass MLA attention --------------------------------------

/// [`scalar::vecmat`] with NEON: tiles of 4 inputs x 16 columns (one input: 32 columns), weights
/// widened to f32 four at a time as `Dense::at` reads them, per output `acc = fma(x, w, acc)`
/// over the rows in order, the last columns through the scalar twin's loop: bit-identical to it.
///
/// # Safety
/// NEON must be available; `w` holds `rows x cols` (an int8 group is a multiple of 8), xs and
/// out hold `n` rows of their strides (checked by the caller).
#[target_feature(enable = "neon")]
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
    // SAFETY (every closure): `vecmat_tiles` asks only for rows < `rows` and 4 columns from a
    // column < cols - 3, inside the `rows x cols` the caller checked.
    match w {
        Dense::F32(v) => unsafe {
            vecmat_tiles(&w, rows, cols, xs, x_stride, n, out, out_stride, |r, c| {
                vld1q_f32(v.as_ptr().add(r * cols + c))
            })
        },
        Dense::Bf16(v) => unsafe {
            vecmat_tiles(&w, rows, cols, xs, x_stride, n, out, out_stride, |r, c| {
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(v.as_ptr().add(r * cols + c))))
            })
        },
        Dense::Int8 { q, scales, group } => unsafe {
            let g = cols / group;
            vecmat_tiles(&w, rows, cols, xs, x_stride, n, out, out_stride, |r, c| {
                let b = i32::from_le_bytes(*(q.as_ptr().add(r * cols + c) as *const [u8; 4]));
                let v8 = vreinterpret_s8_s32(vdup_n_s32(b));
                let f = vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(v8))));
                vmulq_n_f32(f, *scales.get_unchecked(r * g + c / group))
            })
        },
    }
}

/// The tiles of [`vecmat`] over a weight loader `w4(r, c)` (four weights of row `r` from column
/// `c`, as f32).
///
/// # Safety
/// As [`vecmat`]; `w4` must be valid for every row below `rows` and column below `cols - 3`.
#[inline]
#[target_feature(enable = "neon")]
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
    w4: impl Fn(usize, usize) -> float32x4_t,
) {
    let wide = if n == 1 { 32 } else { 16 };
    let simd_cols = cols / 4 * 4;
    let mut m0 = 0;
    while m0 < n {
        let mn = (n - m0).min(4);
        let mut c0 = 0;
        while c0 < simd_cols {
            let cw = (simd_cols - c0).min(wide);
            // SAFETY: inputs m0 .. m0+mn and columns c0 .. c0+cw are in bounds (cw a multiple of 4).
            unsafe {
                match (mn, cw / 4) {
                    (1, 8) => vecmat_tile::<1, 8>(rows, xs, x_stride, m0, c0, out, out_stride, &w4),
                    (4, 4) => vecmat_tile::<4, 4>(rows, xs, x_stride, m0, c0, out, out_stride, &w4),
                    (_, v) => {
                        for m in m0..m0 + mn {
                            for k in 0..v {
                                vecmat_tile::<1, 1>(rows, xs, x_stride, m, c0 + 4 * k, out, out_stride, &w4);
                            }
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

/// One tile: `M` inputs x `V` vectors of columns, `M x V` accumulators in registers.
///
/// # Safety
/// As [`vecmat_tiles`]; inputs `m0 .. m0+M` exist.
#[inline]
#[target_feature(enable = "neon")]
#[allow(clippy::too_many_arguments)]
unsafe fn vecmat_tile<const M: usize, const V: usize>(
    rows: usize,
    xs: &[f32],
    x_stride: usize,
    m0: usize,
    c0: usize,
    out: &mut [f32],
    out_stride: usize,
    w4: &impl Fn(usize, usize) -> float32x4_t,
) {
    let mut acc = [[vdupq_n_f32(0.0); V]; M];
    for r in 0..rows {
        let wv: [float32x4_t; V] = std::array::from_fn(|v| w4(r, c0 + 4 * v));
        for (m, a) in acc.iter_mut().enumerate() {
            let x = vdupq_n_f32(xs[(m0 + m) * x_stride + r]);
            for (a, w) in a.iter_mut().zip(wv) {
                *a = vfmaq_f32(*a, x, w);
            }
        }
    }
    for (m, a) in acc.iter().enumerate() {
        let o = &mut out[(m0 + m) * out_stride + c0..(m0 + m) * out_stride + c0 + 4 * V];
        for (v, a) in a.iter().enumerate() {
            // SAFETY: `o` holds 4 * V floats.
            unsafe { vst1q_f32(o.as_mut_ptr().add(4 * v), *a) };
        }
    }
}

/// The scores of one block of the one-pass MLA attention (`scalar::mla_block_scores`) with NEON:
/// per (query, row) one 4-lane accumulator over the width in order, reduced by `vaddvq_f32`, in
/// tiles of 4 queries x 4 rows (16 chains). A tile's missing queries or rows repeat its last one
/// and are not stored, so a pair's score does not depend on its neighbours.
///
/// # Safety
/// NEON must be available; `width` is a multiple of 4; q holds `nq` queries `q_stride` apart,
/// rows `nb` rows of `width`, s `nq` rows of `s_stride >= nb` (checked by the caller).
#[target_feature(enable = "neon")]
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
            let mut acc = [[vdupq_n_f32(0.0); 4]; 4];
            for c in (0..width).step_by(4) {
                // SAFETY: every pointer starts a row of at least `width` values; c + 4 <= width.
                unsafe {
                    let kv: [float32x4_t; 4] = std::array::from_fn(|b| vld1q_f32(rp[b].add(c)));
                    for (a, acc) in acc.iter_mut().enumerate() {
                        let qv = vld1q_f32(qp[a].add(c));
                        for (x, k) in acc.iter_mut().zip(kv) {
                            *x = vfmaq_f32(*x, qv, k);
                        }
                    }
                }
            }
            for (a, acc) in acc.iter().enumerate().take((nq - i0).min(4)) {
                for (b, x) in acc.iter().enumerate().take((nb - j0).min(4)) {
                    s[(i0 + a) * s_stride + j0 + b] = vaddvq_f32(*x);
                }
            }
        }
    }
}

/// `x[j] = exp(x[j] - shift)` with the 4-lane exp (the tail through a padded copy, so every
/// element gets the same lane arithmetic).
///
/// # Safety
/// NEON must be available.
#[target_feature(enable = "neon")]
pub unsafe fn exp_shifted(x: &mut [f32], shift: f32) {
    let sh = vdupq_n_f32(shift);
    let n4 = x.len() / 4 * 4;
    for i in (0..n4).step_by(4) {
        // SAFETY: 4 floats from `i`.
        unsafe {
            let p = x.as_mut_ptr().add(i);
            vst1q_f32(p, exp_f32x4(vsubq_f32(vld1q_f32(p), sh)));
        }
    }
    if n4 < x.len() {
        let rest = x.len() - n4;
        let mut t = [0f32; 4];
        t[..rest].copy_from_slice(&x[n4..]);
        // SAFETY: `t` holds 4 floats.
        unsafe { vst1q_f32(t.as_mut_ptr(), exp_f32x4(vsubq_f32(vld1q_f32(t.as_ptr()), sh))) };
        x[n4..].copy_from_slice(&t[..rest]);
    }
}

/// The read-out of one block (`scalar::mla_block_mix`, bit-identical to it) in tiles of 4
/// queries x 16 values (16 accumulators), each value `acc = out * alpha` then
/// `acc = fma(p_ij, row_j, acc)` over the rows in order.
///
/// # Safety
/// NEON must be available; `kvl` is a multiple of 4 and at most `width`; shapes as the scalar
/// twin's (checked by the caller).
#[target_feature(enable = "neon")]
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
        let dv = if kvl - d0 >= 16 { 4 } else { 1 };
        for i0 in (0..nq).step_by(4) {
            let qn = (nq - i0).min(4);
            // SAFETY: values d0 .. d0 + 4 dv <= kvl of rows < nb and of outputs i0 .. i0+qn. A
            // partial group of queries goes one query at a time (the same arithmetic).
            unsafe {
                match (qn, dv) {
                    (4, 4) => mix_tile::<4, 4>(p, p_stride, alpha, rows, nb, width, out, o_stride, i0, d0),
                    (4, _) => mix_tile::<4, 1>(p, p_stride, alpha, rows, nb, width, out, o_stride, i0, d0),
                    (_, 4) => (i0..i0 + qn)
                        .for_each(|i| mix_tile::<1, 4>(p, p_stride, alpha, rows, nb, width, out, o_stride, i, d0)),
                    _ => (i0..i0 + qn)
                        .for_each(|i| mix_tile::<1, 1>(p, p_stride, alpha, rows, nb, width, out, o_stride, i, d0)),
                }
            }
        }
        d0 += 4 * dv;
    }
}

/// `Q` queries from `i0` x `V` vectors of values from `d0`.
///
/// # Safety
/// As [`mla_block_mix`].
#[inline]
#[target_feature(enable = "neon")]
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
    let mut acc = [[vdupq_n_f32(0.0); V]; Q];
    for (a, acc) in acc.iter_mut().enumerate() {
        for (v, x) in acc.iter_mut().enumerate() {
            // SAFETY: output row i0 + a holds kvl >= d0 + 4 V values.
            *x = vmulq_n_f32(unsafe { vld1q_f32(out.as_ptr().add((i0 + a) * o_stride + d0 + 4 * v)) }, alpha[i0 + a]);
        }
    }
    for j in 0..nb {
        // SAFETY: row j holds width >= d0 + 4 V values.
        let rv: [float32x4_t; V] =
            std::array::from_fn(|v| unsafe { vld1q_f32(rows.as_ptr().add(j * width + d0 + 4 * v)) });
        for (a, acc) in acc.iter_mut().enumerate() {
            let pj = vdupq_n_f32(p[(i0 + a) * p_stride + j]);
            for (x, r) in acc.iter_mut().zip(rv) {
                *x = vfmaq_f32(*x, pj, r);
            }
        }
    }
    for (a, acc) in acc.iter().enumerate() {
        for (v, x) in acc.iter().enumerate() {
            // SAFETY: as the loads above.
            unsafe { vst1q_f32(out.as_mut_ptr().add((i0 + a) * o_stride + d0 + 4 * v), *x) };
        }
    }
}
