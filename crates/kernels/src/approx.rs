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

/// An approximate-mode implementation, for tests and benchmarks that pin one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Q8Path {
    Scalar,
    Avx2,
    Avx512Vnni,
}

impl Q8Path {
    pub const ALL: [Q8Path; 3] = [Q8Path::Scalar, Q8Path::Avx2, Q8Path::Avx512Vnni];

    pub fn available(self) -> bool {
        match self {
            Q8Path::Scalar => true,
            Q8Path::Avx2 => crate::cpu::has_avx2_fma(),
            Q8Path::Avx512Vnni => crate::cpu::has_avx512_vnni() && crate::cpu::has_avx2_fma(),
        }
    }

    pub fn best() -> Q8Path {
        [Q8Path::Avx512Vnni, Q8Path::Avx2].into_iter().find(|p| p.available()).unwrap_or(Q8Path::Scalar)
    }
}

/// Dispatched approximate product (AVX-512 VNNI, else AVX2, else scalar; the integer sums are
/// exact, so a SIMD path equals the scalar one up to the order of the final f32 accumulation).
pub fn mxfp4_matvec_q8(packed: &[u8], scales: &[u8], rows: usize, cols: usize, xq: &QuantizedX, out: &mut [f32]) {
    mxfp4_matvec_q8_on(Q8Path::best(), packed, scales, rows, cols, xq, out);
}

/// Run one implementation; returns false (doing nothing) when this CPU lacks it.
pub fn mxfp4_matvec_q8_on(
    path: Q8Path,
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    xq: &QuantizedX,
    out: &mut [f32],
) -> bool {
    assert!(cols.is_multiple_of(BLOCK));
    assert_eq!(packed.len(), rows * cols / 2);
    assert_eq!(scales.len(), rows * cols / BLOCK);
    assert_eq!(xq.q.len(), cols);
    assert_eq!(xq.scales.len(), cols / BLOCK);
    assert_eq!(out.len(), rows);
    if !path.available() {
        return false;
    }
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F/BW/VNNI present (checked above); shapes asserted above.
        Q8Path::Avx512Vnni => unsafe { mxfp4_matvec_q8_vnni(packed, scales, rows, cols, xq, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 present (checked above); shapes asserted above.
        Q8Path::Avx2 => unsafe { mxfp4_matvec_q8_avx2(packed, scales, rows, cols, xq, out) },
        _ => mxfp4_matvec_q8_scalar(packed, scales, rows, cols, xq, out),
    }
    true
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

/// Two blocks (64 weights) per step with AVX-512 VNNI: the 32 packed bytes widen to 64 nibbles
/// laid out as block A's even, A's odd, B's even, B's odd weights (the activations' layout),
/// `vpshufb` maps them to |2·E2M1| bytes, the weights' signs move onto the activations (masked
/// negation), and one `vpdpbusd` forms all 64 products summed in fours; lanes 0-7 hold block A
/// and 8-15 block B. Scales are decoded 16 blocks at a time (E8M0 is an f32 exponent field) and
/// multiplied with the activations' block scales; one permute picks a pair's two.
///
/// # Safety
/// AVX-512F/BW/VL/VNNI must be available; shapes validated by the caller.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn mxfp4_matvec_q8_vnni(
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    xq: &QuantizedX,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let (half, nb) = (cols / 2, cols / BLOCK);
    let mut mag = [0u8; 16];
    for (m, &w) in mag.iter_mut().zip(&E2M1_X2_I8) {
        *m = w.unsigned_abs();
    }
    // SAFETY: 16 bytes, broadcast to the four 128-bit lanes.
    let lut = unsafe { _mm512_broadcast_i32x4(_mm_loadu_si128(mag.as_ptr() as *const __m128i)) };
    let low4 = _mm512_set1_epi8(0x0F);
    let sign = _mm512_set1_epi8(0x08);
    let zero = _mm512_setzero_si512();
    let half_ps = _mm512_set1_ps(0.5);
    // Permute indices: pair k takes scale 2k in lanes 0-7 and 2k+1 in lanes 8-15.
    let pair_idx: [__m512i; 8] = std::array::from_fn(|k| {
        let (a, b) = (2 * k as i32, 2 * k as i32 + 1);
        _mm512_set_epi32(b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a)
    });
    'rows: for (r, o) in out.iter_mut().enumerate().take(rows) {
        let prow = &packed[r * half..(r + 1) * half];
        let srow = &scales[r * nb..(r + 1) * nb];
        let mut acc = _mm512_setzero_ps();
        for b0 in (0..nb).step_by(16) {
            let n = (nb - b0).min(16);
            let m16: __mmask16 = if n == 16 { 0xFFFF } else { (1u16 << n) - 1 };
            // SAFETY: masked loads touch only the `n` scale bytes and activation scales in bounds.
            let (sbytes, xs) = unsafe {
                (
                    _mm_maskz_loadu_epi8(m16, srow[b0..].as_ptr() as *const i8),
                    _mm512_maskz_loadu_ps(m16, xq.scales[b0..].as_ptr()),
                )
            };
            // E8M0 0 (2^-127, subnormal) and 255 (NaN) do not decode as an exponent field: such
            // rare rows take the scalar path, which handles them exactly.
            let odd = _mm_mask_cmpeq_epi8_mask(m16, sbytes, _mm_setzero_si128())
                | _mm_mask_cmpeq_epi8_mask(m16, sbytes, _mm_set1_epi8(-1));
            if odd != 0 {
                let mut one = [0f32];
                mxfp4_matvec_q8_scalar(prow, srow, 1, cols, xq, &mut one);
                *o = one[0];
                continue 'rows;
            }
            let wscale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(sbytes), 23));
            let sv = _mm512_mul_ps(_mm512_mul_ps(wscale, xs), half_ps);
            let mut b = b0;
            while b < b0 + n {
                // A pair of blocks, or the last block alone (its partner's bytes and scale zero).
                let pair = b + 1 < b0 + n;
                let (bytes, x) = if pair {
                    // SAFETY: 32 packed bytes and 64 activations in bounds; unaligned loads.
                    unsafe {
                        (
                            _mm256_loadu_si256(prow[b * 16..].as_ptr() as *const __m256i),
                            _mm512_loadu_si512(xq.q[b * BLOCK..].as_ptr() as *const _),
                        )
                    }
                } else {
                    // SAFETY: 16 packed bytes and 32 activations in bounds; the rest is zero.
                    unsafe {
                        (
                            _mm256_zextsi128_si256(_mm_loadu_si128(prow[b * 16..].as_ptr() as *const __m128i)),
                            _mm512_zextsi256_si512(_mm256_loadu_si256(xq.q[b * BLOCK..].as_ptr() as *const __m256i)),
                        )
                    }
                };
                // [lo(A), lo(B), hi(A), hi(B)] in 128-bit lanes, reordered to A lo, A hi, B lo, B hi.
                let wide = _mm512_inserti64x4(_mm512_castsi256_si512(bytes), _mm256_srli_epi16(bytes, 4), 1);
                let nib = _mm512_and_si512(_mm512_shuffle_i64x2(wide, wide, 0b11_01_10_00), low4);
                let w = _mm512_shuffle_epi8(lut, nib);
                let neg = _mm512_test_epi8_mask(nib, sign);
                let xs = _mm512_mask_sub_epi8(x, neg, zero, x);
                let dot = _mm512_dpbusd_epi32(zero, w, xs);
                // A lone last block's partner lane scale is the zero of the masked load.
                let scale = _mm512_permutexvar_ps(pair_idx[(b - b0) / 2], sv);
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
                b += 2;
            }
        }
        *o = _mm512_reduce_add_ps(acc);
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
        let (mut b, mut e) = (vec![0f32; rows], vec![0f32; rows]);
        mxfp4_matvec_q8_scalar(&packed, &scales, rows, cols, &xq, &mut b);
        mxfp4_matvec_scalar(&packed, &scales, rows, cols, &x, &mut e);
        let scale = e.iter().fold(0f32, |m, v| m.max(v.abs()));
        for path in Q8Path::ALL {
            let mut a = vec![0f32; rows];
            if !mxfp4_matvec_q8_on(path, &packed, &scales, rows, cols, &xq, &mut a) {
                println!("SKIPPED approximate path {path:?}: this CPU lacks it");
                continue;
            }
            for r in 0..rows {
                // Integer block sums are exact: SIMD and scalar differ only in f32 accumulation order.
                assert!((a[r] - b[r]).abs() <= 1e-5 * scale, "{path:?} row {r}: {} vs {}", a[r], b[r]);
                // int8 activations: within a few percent of the largest output.
                assert!((a[r] - e[r]).abs() <= 0.03 * scale, "{path:?} row {r}: approx {} exact {}", a[r], e[r]);
            }
        }
    }

    #[test]
    fn approximate_paths_agree_on_odd_block_counts_and_extremes() {
        // Odd block counts exercise the single-block tail; every nibble and the largest
        // activations (+-127 after quantisation) appear.
        // 17 and 33 blocks per row: more than one 16-block scale group, with a lone last block.
        for (rows, cols) in [(3, 32), (5, 96), (9, 224), (4, 32 * 17), (3, 32 * 33)] {
            let packed: Vec<u8> = (0..rows * cols / 2).map(|i| (i * 37 % 256) as u8).collect();
            let mut scales: Vec<u8> = (0..rows * cols / 32).map(|i| 100 + (i % 40) as u8).collect();
            // E8M0 0 (2^-127) takes the safe path in the SIMD kernels.
            scales[cols / 32] = 0;
            let x: Vec<f32> = (0..cols).map(|i| if i % 5 == 0 { -3.0 } else { (i as f32 * 0.7).sin() }).collect();
            let mut xq = QuantizedX::default();
            xq.quantize(&x);
            let mut want = vec![0f32; rows];
            mxfp4_matvec_q8_scalar(&packed, &scales, rows, cols, &xq, &mut want);
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for path in Q8Path::ALL {
                let mut got = vec![0f32; rows];
                if !mxfp4_matvec_q8_on(path, &packed, &scales, rows, cols, &xq, &mut got) {
                    println!("SKIPPED approximate path {path:?}: this CPU lacks it");
                    continue;
                }
                for r in 0..rows {
                    assert!((got[r] - want[r]).abs() <= 1e-5 * scale, "{path:?} {rows}x{cols} row {r}");
                }
            }
        }
    }
}
