//! Layer 3, the AVX2 + FMA lane math of the AVX2 kernels ([`super::avx2_tile`], [`super::avx2`]'s
//! attention, `ops`): `exp`,
//! `tanh`, `sigmoid` and SiTU over 8 lanes, the same polynomials as [`super::avx512_math`]'s.
//! Imports nothing from the crate; the oracles are `scalar`'s (libm) versions, which the tests
//! compare against.
//!
//! Why: SiTU ran libm's `tanhf` (which calls `expm1f`) twice per element, one element at a time:
//! 5% of a 1,000-token prompt on `k3-real4` on an AVX2 machine (`perf record`, after the prompt
//! products were blocked as a GEMM), and every routed expert's activation in decode.

use std::arch::x86_64::*;

/// `exp` of 8 lanes: `x = k ln2 + r` with |r| <= ln2/2, a degree-6 polynomial for `e^r`
/// (relative error ~1e-7), and `2^k` built in the exponent field. Above 88 `x` is clamped (`2^k`
/// stays a normal float); below -87 (under the smallest normal f32) the result is 0, so
/// `exp(-inf) = 0` (attention's softmax relies on it; SiTU's `sigmoid` and `tanh` come out
/// exactly 0, 1 or -1 there either way); NaN stays NaN.
#[target_feature(enable = "avx2,fma")]
pub fn exp_ps(x: __m256) -> __m256 {
    let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.0));
    // `max`/`min` return their second operand when either is NaN: NaN passes through.
    let x = _mm256_min_ps(_mm256_set1_ps(88.0), _mm256_max_ps(_mm256_set1_ps(-87.0), x));
    let k = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    // r = x - k ln2, with ln2 split in two for precision.
    let r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693_145_75), x);
    let r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.428_606_8e-6), r);
    let mut p = _mm256_set1_ps(1.0 / 720.0);
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    // 2^k for k in [-126, 127]: the exponent field k + 127.
    let two_k =
        _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127))));
    _mm256_andnot_ps(tiny, _mm256_mul_ps(p, two_k))
}

/// `tanh` of 8 lanes: below |x| = 0.3 its odd Taylor series to x^15, above `1 - 2 / (e^(2|x|) +
/// 1)` with the sign put back; large |x| give exactly +-1 (as [`super::avx512_math::tanh_ps`]).
#[target_feature(enable = "avx2,fma")]
pub fn tanh_ps(x: __m256) -> __m256 {
    let sign = _mm256_set1_ps(-0.0);
    let ax = _mm256_andnot_ps(sign, x);
    let e = exp_ps(_mm256_add_ps(ax, ax));
    let one = _mm256_set1_ps(1.0);
    let big = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0), _mm256_add_ps(e, one)));
    let big = _mm256_or_ps(big, _mm256_and_ps(x, sign));
    let x2 = _mm256_mul_ps(x, x);
    let mut p = _mm256_set1_ps(-929_569.0 / 638_512_875.0);
    for c in [21_844.0 / 6_081_075.0, -1_382.0 / 155_925.0, 62.0 / 2_835.0, -17.0 / 315.0, 2.0 / 15.0, -1.0 / 3.0] {
        p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(c));
    }
    let small = _mm256_fmadd_ps(_mm256_mul_ps(x, x2), p, x);
    _mm256_blendv_ps(big, small, _mm256_cmp_ps::<_CMP_LT_OQ>(ax, _mm256_set1_ps(0.3)))
}

/// `sigmoid` of 8 lanes, `1 / (1 + e^-x)`.
#[target_feature(enable = "avx2,fma")]
pub fn sigmoid_ps(x: __m256) -> __m256 {
    let one = _mm256_set1_ps(1.0);
    _mm256_div_ps(one, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x))))
}

/// SiTU, `beta*tanh(g/beta)*sigmoid(g) * lbeta*tanh(u/lbeta)`, 8 lanes at a time; the last
/// partial group goes through a zero-padded copy, so every element gets the same lane arithmetic
/// wherever it sits (a product split differently gives the same bits). Shapes: gate, up, out
/// `[n]`.
///
/// # Safety
/// AVX2 and FMA must be available; the three slices have the same length (checked here).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn situ(gate: &[f32], up: &[f32], beta: f32, linear_beta: Option<f32>, out: &mut [f32]) {
    assert!(gate.len() == out.len() && up.len() == out.len());
    let b = _mm256_set1_ps(beta);
    let lb = linear_beta.map(|v| _mm256_set1_ps(v));
    let lanes = |g: __m256, u: __m256| {
        let a = _mm256_mul_ps(_mm256_mul_ps(b, tanh_ps(_mm256_div_ps(g, b))), sigmoid_ps(g));
        let x = match lb {
            Some(lb) => _mm256_mul_ps(lb, tanh_ps(_mm256_div_ps(u, lb))),
            None => u,
        };
        _mm256_mul_ps(a, x)
    };
    let whole = out.len() / 8 * 8;
    for ((o, g), u) in out[..whole].chunks_exact_mut(8).zip(gate.chunks_exact(8)).zip(up.chunks_exact(8)) {
        // SAFETY: each chunk holds 8 floats; unaligned loads and store.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), lanes(_mm256_loadu_ps(g.as_ptr()), _mm256_loadu_ps(u.as_ptr()))) };
    }
    let k = out.len() - whole;
    if k > 0 {
        let (mut g, mut u, mut o) = ([0f32; 8], [0f32; 8], [0f32; 8]);
        g[..k].copy_from_slice(&gate[whole..]);
        u[..k].copy_from_slice(&up[whole..]);
        // SAFETY: the arrays hold 8 floats; unaligned loads and store.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), lanes(_mm256_loadu_ps(g.as_ptr()), _mm256_loadu_ps(u.as_ptr()))) };
        out[whole..].copy_from_slice(&o[..k]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::has_avx2_fma;
    use crate::scalar;

    fn inputs(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7919 + seed) % 2001) as f32 / 1000.0 - 1.0) * [0.01, 0.5, 3.0, 40.0, 200.0][i % 5])
            .collect()
    }

    /// Within 1e-5 of libm's SiTU (relative to the larger of the result and 1), over small,
    /// moderate and saturating gates and ups, with and without the linear bound.
    #[test]
    fn situ_matches_the_scalar_oracle() {
        if !has_avx2_fma() {
            println!("SKIPPED: this CPU has no AVX2+FMA");
            return;
        }
        let (g, u) = (inputs(1003, 1), inputs(1003, 7));
        for lb in [Some(25.0), None] {
            let (mut want, mut got) = (vec![0f32; g.len()], vec![0f32; g.len()]);
            scalar::situ(&g, &u, 4.0, lb, &mut want);
            // SAFETY: AVX2 + FMA present (checked); equal lengths.
            unsafe { situ(&g, &u, 4.0, lb, &mut got) };
            for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "{i}: g {} u {}: {a} vs {b}", g[i], u[i]);
            }
        }
        // NaN in, NaN out (no lane hides it).
        let mut o = [0f32; 3];
        // SAFETY: as above.
        unsafe { situ(&[f32::NAN, 1.0, 2.0], &[1.0, f32::NAN, 2.0], 4.0, Some(25.0), &mut o) };
        assert!(o[0].is_nan() && o[1].is_nan() && !o[2].is_nan());
    }

    /// An element's bits do not depend on where it sits: the whole slice, one element at a time,
    /// and a split off the 8-lane grid agree.
    #[test]
    fn an_elements_bits_do_not_depend_on_its_place() {
        if !has_avx2_fma() {
            println!("SKIPPED: this CPU has no AVX2+FMA");
            return;
        }
        let (g, u) = (inputs(29, 3), inputs(29, 11));
        let mut whole = vec![0f32; 29];
        // SAFETY: AVX2 + FMA present (checked); equal lengths.
        unsafe { situ(&g, &u, 4.0, Some(25.0), &mut whole) };
        for i in 0..29 {
            let mut one = [0f32; 1];
            // SAFETY: as above.
            unsafe { situ(&g[i..i + 1], &u[i..i + 1], 4.0, Some(25.0), &mut one) };
            assert_eq!(one[0].to_bits(), whole[i].to_bits(), "element {i}");
        }
        let mut split = [0f32; 29];
        let (a, b) = split.split_at_mut(5);
        // SAFETY: as above.
        unsafe {
            situ(&g[..5], &u[..5], 4.0, Some(25.0), a);
            situ(&g[5..], &u[5..], 4.0, Some(25.0), b);
        }
        assert_eq!(
            split.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            whole.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }

    /// `exp` within 2e-7 relative of libm from -87 to 88, exactly 0 below -87 (down to -inf: the
    /// softmax's masked positions), NaN through.
    #[test]
    fn exp_is_libms_and_zero_below_the_normal_range() {
        if !has_avx2_fma() {
            println!("SKIPPED: this CPU has no AVX2+FMA");
            return;
        }
        let exp8 = |v: [f32; 8]| {
            let mut o = [0f32; 8];
            // SAFETY: AVX2 + FMA present (checked); 8 floats each.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), exp_ps(_mm256_loadu_ps(v.as_ptr()))) };
            o
        };
        for i in 0..=1750 {
            let x = -87.0 + i as f32 * 0.1;
            let got = exp8([x; 8])[0];
            let want = x.exp();
            assert!((got - want).abs() <= 2e-7 * want, "exp({x}) = {got}, libm {want}");
        }
        let o = exp8([-87.01, -88.0, -100.0, -1e30, f32::NEG_INFINITY, f32::NAN, 0.0, 1.0]);
        assert_eq!(&o[..5], &[0.0; 5]);
        assert!(o[5].is_nan());
        assert_eq!(o[6], 1.0);
    }
}
