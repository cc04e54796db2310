//! Layer 3, the AVX-512 lane math shared by the AVX-512 kernel modules ([`super::avx512`],
//! [`super::avx512_tile`]): `exp`, `tanh`, `sigmoid` and SiTU over 16 lanes. Imports nothing from
//! the crate; the oracles are `scalar`'s (libm) versions, which the tests compare against.

use std::arch::x86_64::*;

/// `exp` of 16 lanes: `x = k ln2 + r` with |r| <= ln2/2, a degree-6 polynomial for `e^r`
/// (relative error ~1e-7), and `scalef` for `2^k` (which also gives 0 for very negative `x`).
#[target_feature(enable = "avx512f")]
pub fn exp_ps(x: __m512) -> __m512 {
    // Clamp (NaN-preserving: `max` returns its second operand when either is NaN).
    let x = _mm512_max_ps(_mm512_set1_ps(-104.0), x);
    let k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)), 0x08);
    // r = x - k ln2, with ln2 split in two for precision.
    let r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693_145_75), x);
    let r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428_606_8e-6), r);
    let mut p = _mm512_set1_ps(1.0 / 720.0);
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    _mm512_scalef_ps(p, k)
}

/// `tanh` of 16 lanes: below |x| = 0.3 its odd Taylor series to x^15 (the first term left out
/// is below 1e-12 there), above `1 - 2 / (e^(2|x|) + 1)` with the sign put back (the
/// cancellation costs at most about 3e-7 relative at 0.3); large |x| give exactly +-1.
#[target_feature(enable = "avx512f")]
pub fn tanh_ps(x: __m512) -> __m512 {
    let ax = _mm512_abs_ps(x);
    let e = exp_ps(_mm512_add_ps(ax, ax));
    let one = _mm512_set1_ps(1.0);
    let big = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0), _mm512_add_ps(e, one)));
    // Sign of x onto the non-negative `big` (bitwise: 0x8000_0000 is the sign bit).
    let sign = _mm512_set1_epi32(i32::MIN);
    let big =
        _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(big), _mm512_and_si512(_mm512_castps_si512(x), sign)));
    let x2 = _mm512_mul_ps(x, x);
    let mut p = _mm512_set1_ps(-929_569.0 / 638_512_875.0);
    for c in [21_844.0 / 6_081_075.0, -1_382.0 / 155_925.0, 62.0 / 2_835.0, -17.0 / 315.0, 2.0 / 15.0, -1.0 / 3.0] {
        p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(c));
    }
    let small = _mm512_fmadd_ps(_mm512_mul_ps(x, x2), p, x);
    _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.3), _CMP_LT_OQ), big, small)
}

/// `sigmoid` of 16 lanes, `1 / (1 + e^-x)` (0 and 1 at the extremes, as the scalar one).
#[target_feature(enable = "avx512f")]
pub fn sigmoid_ps(x: __m512) -> __m512 {
    let one = _mm512_set1_ps(1.0);
    _mm512_div_ps(one, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x))))
}

/// SiTU, `beta*tanh(g/beta)*sigmoid(g) * lbeta*tanh(u/lbeta)`, 16 lanes at a time; the last
/// partial group runs masked, so every element gets the same lane arithmetic wherever it sits
/// (a product split differently gives the same bits). Shapes: gate, up, out `[n]`.
///
/// # Safety
/// AVX-512F must be available; the three slices have the same length (checked by the caller).
#[target_feature(enable = "avx512f")]
pub unsafe fn situ(gate: &[f32], up: &[f32], beta: f32, linear_beta: Option<f32>, out: &mut [f32]) {
    let n = out.len();
    let b = _mm512_set1_ps(beta);
    let lb = linear_beta.map(|v| _mm512_set1_ps(v));
    let mut i = 0;
    while i < n {
        let k = (n - i).min(16);
        let m: __mmask16 = if k == 16 { 0xFFFF } else { (1u16 << k) - 1 };
        // SAFETY: lanes i..i+k lie inside all three slices (same length n); masked lanes are
        // neither read nor written.
        let (g, u) =
            unsafe { (_mm512_maskz_loadu_ps(m, gate.as_ptr().add(i)), _mm512_maskz_loadu_ps(m, up.as_ptr().add(i))) };
        let a = _mm512_mul_ps(_mm512_mul_ps(b, tanh_ps(_mm512_div_ps(g, b))), sigmoid_ps(g));
        let x = match lb {
            Some(lb) => _mm512_mul_ps(lb, tanh_ps(_mm512_div_ps(u, lb))),
            None => u,
        };
        // SAFETY: as above.
        unsafe { _mm512_mask_storeu_ps(out.as_mut_ptr().add(i), m, _mm512_mul_ps(a, x)) };
        i += 16;
    }
}
