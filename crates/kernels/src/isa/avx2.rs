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

use crate::format::{BLOCK, E2M1_X2_I8, QuantizedX, e8m0_to_f32};
use crate::scalar;

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

/// MXFP4 mat-vec: eight elements at a time, the 4 packed bytes holding them broadcast to all
/// lanes and shifted by 0, 4, ..., 28 bits, which puts nibble `i` (element `i`, low nibble first)
/// in lane `i`; the magnitude comes from an in-register table (`vpermps`) and the sign bit is
/// moved to bit 31 and XORed in. Each 32-element block is accumulated, then scaled once.
///
/// # Safety
/// The CPU must support AVX2 and FMA. Shapes as [`scalar::mxfp4_matvec`], validated by the
/// caller.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn mxfp4_matvec(packed: &[u8], scales: &[u8], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    let half = cols / 2;
    let nblocks = cols / BLOCK;
    let lut = _mm256_setr_ps(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0);
    let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    let low3 = _mm256_set1_epi32(7);
    let sign = _mm256_set1_epi32(i32::MIN);
    for (r, o) in out.iter_mut().enumerate().take(rows) {
        let prow = &packed[r * half..(r + 1) * half];
        let srow = &scales[r * nblocks..(r + 1) * nblocks];
        // Scales beyond 2^73 (never seen in real weights) could overflow a lane's partial sum
        // where the scalar order would not: such rows take the scalar path.
        if srow.iter().any(|&s| s > 200) {
            *o = scalar::row_dot(prow, srow, x);
            continue;
        }
        let mut acc = _mm256_setzero_ps();
        for (b, &s) in srow.iter().enumerate() {
            let pb = &prow[b * 16..b * 16 + 16];
            let xb = &x[b * BLOCK..(b + 1) * BLOCK];
            let mut blk0 = _mm256_setzero_ps();
            let mut blk1 = _mm256_setzero_ps();
            for q in 0..4 {
                let word = u32::from_le_bytes([pb[q * 4], pb[q * 4 + 1], pb[q * 4 + 2], pb[q * 4 + 3]]);
                let nib = _mm256_srlv_epi32(_mm256_set1_epi32(word as i32), shifts);
                let mag = _mm256_permutevar8x32_ps(lut, _mm256_and_si256(nib, low3));
                let sgn = _mm256_and_si256(_mm256_slli_epi32(nib, 28), sign);
                let w = _mm256_xor_ps(mag, _mm256_castsi256_ps(sgn));
                let xq = &xb[q * 8..q * 8 + 8];
                // SAFETY: `xq` holds exactly 8 floats; the load is unaligned.
                let xv = unsafe { _mm256_loadu_ps(xq.as_ptr()) };
                if q % 2 == 0 {
                    blk0 = _mm256_fmadd_ps(w, xv, blk0);
                } else {
                    blk1 = _mm256_fmadd_ps(w, xv, blk1);
                }
            }
            acc = _mm256_fmadd_ps(_mm256_add_ps(blk0, blk1), _mm256_set1_ps(e8m0_to_f32(s)), acc);
        }
        // SAFETY: AVX2 is enabled in this function.
        *o = unsafe { hsum(acc) };
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: __m256) -> f32 {
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

/// FLOPs done by one thread in `secs` of back-to-back AVX2 FMAs (the roofline's compute roof).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn fma_loop(secs: f64) -> f64 {
    super::fma_loop_body!(secs, _mm256_set1_ps, _mm256_fmadd_ps, 8)
}
