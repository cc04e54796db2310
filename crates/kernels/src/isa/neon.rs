//! Layer 3, every NEON kernel (aarch64): MXFP4 and int8 mat-vecs. Imports only `format` and
//! `scalar`. Their oracles are the scalar twins; the tests run them under `qemu-aarch64` on x86
//! machines (`scripts/test-neon.sh`).
//!
//! MXFP4: a block's 16 packed bytes split into low and high nibbles, `tbl` maps each nibble to
//! the exact integer 2·E2M1 (a signed byte), `zip` restores element order, and the 32 weights
//! widen to f32 for four-lane FMAs against the input; the block sum is scaled once by half the
//! E8M0 scale (which undoes the factor 2 exactly).

use std::arch::aarch64::*;

use crate::format::{BLOCK, E2M1_X2_I8, e8m0_to_f32};
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

/// MXFP4 mat-vec.
///
/// # Safety
/// NEON must be available (always on aarch64). Shapes as `mxfp4_matvec`, validated by the caller.
#[target_feature(enable = "neon")]
pub unsafe fn mxfp4_matvec(packed: &[u8], scales: &[u8], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    let (half, nb) = (cols / 2, cols / BLOCK);
    // SAFETY: the table holds 16 bytes.
    let lut = unsafe { vld1q_s8(E2M1_X2_I8.as_ptr()) };
    let low4 = vdupq_n_u8(0x0F);
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
            let even = vqtbl1q_s8(lut, vandq_u8(bytes, low4));
            let odd = vqtbl1q_s8(lut, vshrq_n_u8::<4>(bytes));
            let ws = [widen_i8x16(vzip1q_s8(even, odd)), widen_i8x16(vzip2q_s8(even, odd))];
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
