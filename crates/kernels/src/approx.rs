//! Approximate mode for MXFP4 products: activations quantised per 32-element block to int8
//! (scale = max|x| / 127), weights taken as the exact integers 2·E2M1 in [-12, 12], block dot
//! products in integer arithmetic, then one multiply by both scales. Faster and not exact:
//! every output that uses it is labelled approximate.

use crate::mxfp4::{BLOCK, e8m0_to_f32};

/// 2·E2M1 for each nibble: exact small integers.
pub const E2M1_X2_I8: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Input quantised per block, in the layout the kernels read: per block, the 16 even elements
/// then the 16 odd ones (matching low and high nibbles).
#[derive(Default)]
pub struct QuantizedX {
    pub q: Vec<i8>,
    /// One per block: `max|x| / 127` (0 for an all-zero block).
    pub scales: Vec<f32>,
}

impl QuantizedX {
    pub fn quantize(&mut self, x: &[f32]) {
        assert!(x.len().is_multiple_of(BLOCK));
        self.q.clear();
        self.scales.clear();
        for xb in x.chunks_exact(BLOCK) {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let s = amax / 127.0;
            let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
            self.scales.push(s);
            let qv = |v: f32| (v * inv).round().clamp(-127.0, 127.0) as i8;
            self.q.extend((0..BLOCK / 2).map(|j| qv(xb[2 * j])));
            self.q.extend((0..BLOCK / 2).map(|j| qv(xb[2 * j + 1])));
        }
    }
}

/// Scalar oracle of the approximate product. Shapes as `mxfp4_matvec`.
pub fn mxfp4_matvec_q8_scalar(
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    xq: &QuantizedX,
    out: &mut [f32],
) {
    let (half, nb) = (cols / 2, cols / BLOCK);
    for (r, o) in out.iter_mut().enumerate().take(rows) {
        let mut acc = 0f32;
        for b in 0..nb {
            let pb = &packed[r * half + b * 16..r * half + b * 16 + 16];
            let qb = &xq.q[b * BLOCK..(b + 1) * BLOCK];
            let mut dot = 0i32;
            for (j, &byte) in pb.iter().enumerate() {
                dot += E2M1_X2_I8[(byte & 0xF) as usize] as i32 * qb[j] as i32;
                dot += E2M1_X2_I8[(byte >> 4) as usize] as i32 * qb[16 + j] as i32;
            }
            acc += dot as f32 * (0.5 * e8m0_to_f32(scales[r * nb + b]) * xq.scales[b]);
        }
        *o = acc;
    }
}

/// Dispatched approximate product (AVX2 when available; the integer sums are exact, so the SIMD
/// path equals the scalar one up to the order of the final f32 accumulation).
pub fn mxfp4_matvec_q8(packed: &[u8], scales: &[u8], rows: usize, cols: usize, xq: &QuantizedX, out: &mut [f32]) {
    assert!(cols.is_multiple_of(BLOCK));
    assert_eq!(packed.len(), rows * cols / 2);
    assert_eq!(scales.len(), rows * cols / BLOCK);
    assert_eq!(xq.q.len(), cols);
    assert_eq!(out.len(), rows);
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx2_fma() {
        // SAFETY: AVX2 present; shapes asserted above.
        unsafe { mxfp4_matvec_q8_avx2(packed, scales, rows, cols, xq, out) };
        return;
    }
    mxfp4_matvec_q8_scalar(packed, scales, rows, cols, xq, out)
}

/// Row-parallel [`mxfp4_matvec_q8`].
pub fn mxfp4_matvec_q8_par(packed: &[u8], scales: &[u8], rows: usize, cols: usize, xq: &QuantizedX, out: &mut [f32]) {
    let (half, nb) = (cols / 2, cols / BLOCK);
    crate::par::par_rows(rows, cols, out, |r0, o| {
        let n = o.len();
        mxfp4_matvec_q8(&packed[r0 * half..(r0 + n) * half], &scales[r0 * nb..(r0 + n) * nb], n, cols, xq, o)
    });
}

/// One block at a time: 16 packed bytes give 16 even (low nibble) and 16 odd (high nibble)
/// weights; `pshufb` maps nibbles to 2·E2M1 bytes, and `maddubs` + `madd` form the block's
/// integer dot product with the sign moved onto the activations.
///
/// # Safety
/// AVX2 must be available; shapes validated by the caller.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn mxfp4_matvec_q8_avx2(
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    xq: &QuantizedX,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
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

/// The routed expert in approximate mode: `w2 · situ(w1 · x, w3 · x)` with int8 activations
/// (`xq` is the expert input quantised once per layer; `aq` is scratch for the SiTU output).
#[allow(clippy::too_many_arguments)]
pub fn expert_mxfp4_approx(
    w1: crate::expert::Mxfp4,
    w3: crate::expert::Mxfp4,
    w2: crate::expert::Mxfp4,
    inter: usize,
    latent: usize,
    xq: &QuantizedX,
    beta: f32,
    linear_beta: Option<f32>,
    gate_up: &mut [f32],
    act: &mut [f32],
    aq: &mut QuantizedX,
    out: &mut [f32],
) {
    assert_eq!(gate_up.len(), inter);
    mxfp4_matvec_q8_par(w1.packed, w1.scales, inter, latent, xq, gate_up);
    mxfp4_matvec_q8_par(w3.packed, w3.scales, inter, latent, xq, act);
    // act <- situ(gate, up), in place over the up values.
    for (a, &g) in act.iter_mut().zip(gate_up.iter()) {
        let mut o = [0f32];
        crate::ops::situ(&[g], &[*a], beta, linear_beta, &mut o);
        *a = o[0];
    }
    aq.quantize(act);
    mxfp4_matvec_q8_par(w2.packed, w2.scales, latent, inter, aq, out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mxfp4::mxfp4_matvec_scalar;

    #[test]
    fn approximate_product_tracks_exact_and_simd_matches_oracle() {
        let (rows, cols) = (37, 512);
        let mut s = 0x9e37_79b9_u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let packed: Vec<u8> = (0..rows * cols / 2).map(|_| next() as u8).collect();
        let scales: Vec<u8> = (0..rows * cols / 32).map(|_| 118 + (next() % 8) as u8).collect();
        let x: Vec<f32> = (0..cols).map(|_| ((next() % 20001) as f32 - 10000.0) / 5000.0).collect();
        let mut xq = QuantizedX::default();
        xq.quantize(&x);
        let (mut a, mut b, mut e) = (vec![0f32; rows], vec![0f32; rows], vec![0f32; rows]);
        mxfp4_matvec_q8(&packed, &scales, rows, cols, &xq, &mut a);
        mxfp4_matvec_q8_scalar(&packed, &scales, rows, cols, &xq, &mut b);
        mxfp4_matvec_scalar(&packed, &scales, rows, cols, &x, &mut e);
        let scale = e.iter().fold(0f32, |m, v| m.max(v.abs()));
        for r in 0..rows {
            // Integer block sums are exact: SIMD and scalar differ only in f32 accumulation order.
            assert!((a[r] - b[r]).abs() <= 1e-5 * scale, "row {r}: {} vs {}", a[r], b[r]);
            // int8 activations: within a few percent of the largest output.
            assert!((a[r] - e[r]).abs() <= 0.03 * scale, "row {r}: approx {} exact {}", a[r], e[r]);
        }
        if !crate::cpu::has_avx2_fma() {
            println!("SKIPPED AVX2 approximate path: this CPU lacks it");
        }
    }
}
