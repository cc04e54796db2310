//! AVX2 + FMA MXFP4 matrix-vector product. The scalar `mxfp4_matvec_scalar` is its oracle.
//!
//! Eight elements at a time: the 4 packed bytes holding them are broadcast to all lanes and
//! shifted by 0, 4, ..., 28 bits, which puts nibble `i` (element `i`, low nibble first) in lane
//! `i`; the magnitude comes from an in-register table (`vpermps`) and the sign bit is moved to bit
//! 31 and XORed in. Each 32-element block is accumulated, then scaled once.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::mxfp4::{BLOCK, e8m0_to_f32};

/// # Safety
/// The CPU must support AVX2 and FMA (checked by the dispatcher). Shapes as in
/// [`super::mxfp4::mxfp4_matvec`], already validated by it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn mxfp4_matvec_avx2(packed: &[u8], scales: &[u8], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
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
            *o = super::mxfp4::row_dot_scalar(prow, srow, x);
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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}
