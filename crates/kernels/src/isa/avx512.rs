//! Layer 3, the AVX-512 kernels (x86_64) that are not tiles: F + BW for the one-input int8
//! product, F for the bf16 product, RMSNorm, softmax and the input staging of the MXFP4 tiles; F + BW + VL + VNNI for the
//! approximate-mode product. The register-blocked exact MXFP4 products and the prompt chunk's
//! int8 product are in [`super::avx512_tile`]. Imports only `format` and `scalar`. Their oracles
//! are the scalar twins.
//!
//! MXFP4: a block's 16 packed bytes widen to 16 lanes; the low nibbles are the block's even
//! elements and the high nibbles its odd elements, and one `vpermps` against the 16-entry E2M1
//! table decodes sign and magnitude at once. The input vector is split into even and odd halves
//! once per product ([`deinterleave`], [`with_deinterleaved`], [`with_batch_staging`]), so each
//! block costs two table look-ups and, per input, two FMAs.
//!
//! Every kernel here is `unsafe`: the caller (an operation module's `op_on`) must have checked
//! that the CPU supports the features named in its `# Safety` section.

use std::arch::x86_64::*;

use super::avx512_math::exp_ps;
use crate::format::{BLOCK, E2M1_X2_I8, QuantizedX};
use crate::scalar;

/// int8 weights with one scale per `group` (a multiple of 16) of each row, one row at a time:
/// the arithmetic per output that [`super::avx512_tile::int8_rows`] keeps, which runs it in tiles
/// of rows; kept as that kernel's bit-for-bit oracle.
///
/// # Safety
/// AVX-512F/BW must be available; shapes validated by the caller; `group % 16 == 0`.
#[cfg(test)]
#[target_feature(enable = "avx512f,avx512bw")]
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
        let mut acc = _mm512_setzero_ps();
        for (g, &s) in srow.iter().enumerate() {
            let mut ga0 = _mm512_setzero_ps();
            let mut ga1 = _mm512_setzero_ps();
            let qg = &row[g * group..(g + 1) * group];
            let xg = &x[g * group..(g + 1) * group];
            for (i, (q16, x16)) in qg.chunks_exact(16).zip(xg.chunks_exact(16)).enumerate() {
                // SAFETY: 16 int8 and 16 f32 per chunk; unaligned loads.
                let (qv, xv) =
                    unsafe { (_mm_loadu_si128(q16.as_ptr() as *const __m128i), _mm512_loadu_ps(x16.as_ptr())) };
                let w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(qv));
                if i % 2 == 0 {
                    ga0 = _mm512_fmadd_ps(w, xv, ga0);
                } else {
                    ga1 = _mm512_fmadd_ps(w, xv, ga1);
                }
            }
            acc = _mm512_fmadd_ps(_mm512_add_ps(ga0, ga1), _mm512_set1_ps(s), acc);
        }
        *o = _mm512_reduce_add_ps(acc);
    }
}

/// bf16 weights (raw bits) widened to f32 by a shift, 32 per step in two accumulators; only the
/// summation order (and FMA's single rounding) differs from [`scalar::bf16_matvec`].
///
/// # Safety
/// AVX-512F must be available; `w.len() == rows * cols`, `x.len() == cols`, `out.len() == rows`.
#[target_feature(enable = "avx512f")]
pub unsafe fn bf16_matvec(w: &[u16], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    assert!(w.len() == rows * cols && x.len() == cols && out.len() == rows);
    let body = cols / 32 * 32;
    for (r, o) in out.iter_mut().enumerate() {
        let row = &w[r * cols..(r + 1) * cols];
        let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        for (w32, x32) in row[..body].chunks_exact(32).zip(x[..body].chunks_exact(32)) {
            // SAFETY: 32 u16 and 32 f32 in bounds per chunk; unaligned loads.
            let (wl, wh, xl, xh) = unsafe {
                (
                    _mm256_loadu_si256(w32.as_ptr() as *const __m256i),
                    _mm256_loadu_si256(w32.as_ptr().add(16) as *const __m256i),
                    _mm512_loadu_ps(x32.as_ptr()),
                    _mm512_loadu_ps(x32.as_ptr().add(16)),
                )
            };
            // bf16 is the high half of an f32: widen to 32 bits and shift into place (exact).
            let fl = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(wl), 16));
            let fh = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(wh), 16));
            a0 = _mm512_fmadd_ps(fl, xl, a0);
            a1 = _mm512_fmadd_ps(fh, xh, a1);
        }
        let mut s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
        for (&b, &v) in row[body..].iter().zip(&x[body..]) {
            s += f32::from_bits((b as u32) << 16) * v;
        }
        *o = s;
    }
}

/// RMSNorm with the sum of squares in f64 lanes (as the scalar oracle keeps f64); only the
/// summation order differs from it.
///
/// # Safety
/// AVX-512F must be available; `x.len() == weight.len()`.
#[target_feature(enable = "avx512f")]
pub unsafe fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    let n = x.len();
    let (mut s0, mut s1) = (_mm512_setzero_pd(), _mm512_setzero_pd());
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: 16 floats in bounds; unaligned load.
        let v = unsafe { _mm512_loadu_ps(x.as_ptr().add(i)) };
        let lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
        let hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
        s0 = _mm512_fmadd_pd(lo, lo, s0);
        s1 = _mm512_fmadd_pd(hi, hi, s1);
        i += 16;
    }
    let mut ss = _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
    for &v in &x[i..] {
        ss += v as f64 * v as f64;
    }
    let inv = (1.0 / ((ss / n as f64) + eps as f64).sqrt()) as f32;
    let invv = _mm512_set1_ps(inv);
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: 16 floats of each slice in bounds; unaligned loads and store.
        unsafe {
            let v = _mm512_loadu_ps(x.as_ptr().add(i));
            let w = _mm512_loadu_ps(weight.as_ptr().add(i));
            _mm512_storeu_ps(x.as_mut_ptr().add(i), _mm512_mul_ps(v, _mm512_mul_ps(invv, w)));
        }
        i += 16;
    }
    for (v, &w) in x[i..].iter_mut().zip(&weight[i..]) {
        *v *= inv * w;
    }
}

/// Softmax with a vector `exp`; the sum is accumulated in lanes.
///
/// # Safety
/// AVX-512F must be available.
#[target_feature(enable = "avx512f")]
pub unsafe fn softmax_inplace(x: &mut [f32]) {
    let n = x.len();
    let full = n / 16 * 16;
    let tail: __mmask16 = ((1u32 << (n - full)) - 1) as __mmask16;
    let mut mv = _mm512_set1_ps(f32::NEG_INFINITY);
    for i in (0..full).step_by(16) {
        // SAFETY: 16 floats in bounds.
        mv = _mm512_max_ps(mv, unsafe { _mm512_loadu_ps(x.as_ptr().add(i)) });
    }
    // SAFETY: the masked load touches only the tail's elements.
    let t = unsafe { _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), tail, x.as_ptr().add(full)) };
    let m = _mm512_reduce_max_ps(_mm512_max_ps(mv, t));
    let mvec = _mm512_set1_ps(m);
    let mut sum = _mm512_setzero_ps();
    for i in (0..full).step_by(16) {
        // SAFETY: 16 floats in bounds.
        unsafe {
            let e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(x.as_ptr().add(i)), mvec));
            _mm512_storeu_ps(x.as_mut_ptr().add(i), e);
            sum = _mm512_add_ps(sum, e);
        }
    }
    if tail != 0 {
        // SAFETY: masked load and store touch only the tail's elements.
        unsafe {
            let v = _mm512_maskz_loadu_ps(tail, x.as_ptr().add(full));
            let e = _mm512_maskz_mov_ps(tail, exp_ps(_mm512_sub_ps(v, mvec)));
            _mm512_mask_storeu_ps(x.as_mut_ptr().add(full), tail, e);
            sum = _mm512_add_ps(sum, e);
        }
    }
    let s = _mm512_set1_ps(_mm512_reduce_add_ps(sum));
    for i in (0..full).step_by(16) {
        // SAFETY: 16 floats in bounds.
        unsafe { _mm512_storeu_ps(x.as_mut_ptr().add(i), _mm512_div_ps(_mm512_loadu_ps(x.as_ptr().add(i)), s)) };
    }
    if tail != 0 {
        // SAFETY: masked load and store touch only the tail's elements.
        unsafe {
            let v = _mm512_maskz_loadu_ps(tail, x.as_ptr().add(full));
            _mm512_mask_storeu_ps(x.as_mut_ptr().add(full), tail, _mm512_div_ps(v, s));
        }
    }
}

/// The approximate (int8 activation) MXFP4 product, two blocks (64 weights) per step with
/// AVX-512 VNNI (a capability within the AVX-512 path: `cpu::has_avx512_vnni`): the 32 packed
/// bytes widen to 64 nibbles laid out as block A's even, A's odd, B's even, B's odd weights (the
/// activations' layout), `vpshufb` maps them to |2·E2M1| bytes, the weights' signs move onto the
/// activations (masked negation), and one `vpdpbusd` forms all 64 products summed in fours; lanes
/// 0-7 hold block A and 8-15 block B. Scales are decoded 16 blocks at a time (E8M0 is an f32
/// exponent field) and multiplied with the activations' block scales; one permute picks a pair's
/// two.
///
/// # Safety
/// AVX-512F/BW/VL/VNNI must be available; shapes validated by the caller.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn mxfp4_matvec_q8_vnni(
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    xq: &QuantizedX,
    out: &mut [f32],
) {
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
                scalar::mxfp4_matvec_q8(prow, srow, 1, cols, xq, &mut one);
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

/// Integer operations (a multiply-add is two) done by one thread in `secs` of back-to-back
/// `vpdpbusd` (64 int8 multiply-adds each) on twelve independent chains: the roof of the
/// integer spine products of approximate mode.
///
/// # Safety
/// The CPU must support AVX-512F and AVX-512 VNNI.
#[target_feature(enable = "avx512f,avx512vnni")]
pub unsafe fn vnni_loop(secs: f64) -> f64 {
    let t0 = std::time::Instant::now();
    let a = _mm512_set1_epi8(std::hint::black_box(3));
    let b = _mm512_set1_epi8(std::hint::black_box(-5));
    let mut acc = [_mm512_setzero_si512(); 12];
    let mut iters = 0u64;
    while t0.elapsed().as_secs_f64() < secs {
        for _ in 0..100_000 {
            for v in acc.iter_mut() {
                *v = _mm512_dpbusd_epi32(*v, a, b);
            }
        }
        iters += 100_000;
    }
    std::hint::black_box(acc);
    iters as f64 * 12.0 * 64.0 * 2.0
}

/// FLOPs done by one thread in `secs` of back-to-back 512-bit FMAs: the compute roof of the
/// AVX-512 kernels. On cores whose AVX-512 units are as wide as the registers (Zen 5, Intel
/// server cores with two FMA units) this is twice the AVX2 loop's rate; on cores that split
/// 512-bit operations in halves (Zen 4) it equals it.
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub unsafe fn fma_loop(secs: f64) -> f64 {
    super::fma_loop_body!(secs, _mm512_set1_ps, _mm512_fmadd_ps, 16)
}

/// The KDA delta-rule step of one head (`scalar::kda_head_step`'s updates: `S <- S * g`,
/// `delta = beta (v - S k)`, `S <- S + delta k^T`, `y = S q`) with each row's dot products
/// accumulated in 16 lanes and reduced once, where the scalar twin adds one product at a time:
/// a 128-wide row is 8 dependent FMAs here against 128 there. The state update is fused
/// (`S + k delta` rounds once). Rows whose width is not a multiple of 16 end with a masked group.
///
/// # Safety
/// AVX-512F must be available; s `[Dv, Dk]`, q, k, g `[Dk]`, v, delta, y `[Dv]` (checked by the
/// caller).
#[target_feature(enable = "avx512f")]
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
    let d = k.len();
    let groups = d.div_ceil(16);
    let mask = |c: usize| -> __mmask16 {
        let left = d - c * 16;
        if left >= 16 { 0xFFFF } else { (1u16 << left) - 1 }
    };
    // SAFETY (every access below): group c covers lanes c*16.. of a row of d, masked past d;
    // rows vi < v.len() lie inside s (v.len() * d elements, checked by the caller).
    let at = |p: *const f32, c: usize, m: __mmask16| unsafe { _mm512_maskz_loadu_ps(m, p.add(c * 16)) };
    for vi in 0..v.len() {
        let row = unsafe { s.as_mut_ptr().add(vi * d) };
        let mut acc = _mm512_setzero_ps();
        for c in 0..groups {
            let m = mask(c);
            let r = _mm512_mul_ps(at(row, c, m), at(g.as_ptr(), c, m));
            unsafe { _mm512_mask_storeu_ps(row.add(c * 16), m, r) };
            acc = _mm512_fmadd_ps(r, at(k.as_ptr(), c, m), acc);
        }
        delta[vi] = (v[vi] - _mm512_reduce_add_ps(acc)) * beta;
    }
    for (vi, yv) in y.iter_mut().enumerate().take(v.len()) {
        let row = unsafe { s.as_mut_ptr().add(vi * d) };
        let dv = _mm512_set1_ps(delta[vi]);
        let mut acc = _mm512_setzero_ps();
        for c in 0..groups {
            let m = mask(c);
            let r = _mm512_fmadd_ps(at(k.as_ptr(), c, m), dv, at(row, c, m));
            unsafe { _mm512_mask_storeu_ps(row.add(c * 16), m, r) };
            acc = _mm512_fmadd_ps(r, at(q.as_ptr(), c, m), acc);
        }
        *yv = _mm512_reduce_add_ps(acc);
    }
}
