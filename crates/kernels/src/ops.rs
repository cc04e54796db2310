//! Small element-wise and reduction kernels used by every model: norms, softmax, activations.

/// RMSNorm: `out = x / sqrt(mean(x^2) + eps) * weight`. Shapes: x, weight, out `[n]`.
/// AVX-512 when the CPU has it; [`rms_norm_scalar`] is the oracle.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), weight.len());
    assert_eq!(x.len(), out.len());
    out.copy_from_slice(x);
    rms_norm_inplace(out, weight, eps);
}

/// In-place RMSNorm. Shapes: x, weight `[n]`.
pub fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    assert_eq!(x.len(), weight.len());
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::Path::best() == crate::cpu::Path::Avx512 {
        // SAFETY: AVX-512F is present (Path::best); lengths asserted above.
        unsafe { crate::avx512::rms_norm_inplace_avx512(x, weight, eps) };
        return;
    }
    rms_norm_inplace_scalar(x, weight, eps);
}

/// The portable RMSNorm: the oracle of the SIMD one.
pub fn rms_norm_inplace_scalar(x: &mut [f32], weight: &[f32], eps: f32) {
    assert_eq!(x.len(), weight.len());
    let inv = inv_rms(x, eps);
    for (v, &w) in x.iter_mut().zip(weight) {
        *v *= inv * w;
    }
}

/// Out-of-place [`rms_norm_inplace_scalar`].
pub fn rms_norm_scalar(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), out.len());
    out.copy_from_slice(x);
    rms_norm_inplace_scalar(out, weight, eps);
}

/// `1 / sqrt(mean(x^2) + eps)`, accumulated in f64 so long rows keep their precision.
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    (1.0 / ((ss / x.len() as f64) + eps as f64).sqrt()) as f32
}

/// Numerically stable in-place softmax. AVX-512 (a polynomial `exp`) when the CPU has it;
/// [`softmax_inplace_scalar`] is the oracle.
pub fn softmax_inplace(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::Path::best() == crate::cpu::Path::Avx512 {
        // SAFETY: AVX-512F is present (Path::best).
        unsafe { crate::avx512::softmax_inplace_avx512(x) };
        return;
    }
    softmax_inplace_scalar(x);
}

/// The portable softmax: the oracle of the SIMD one.
pub fn softmax_inplace_scalar(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// Softplus with the usual linear cut-over for large inputs.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// SiTU, Kimi K3's gated activation: `beta*tanh(g/beta)*sigmoid(g) * lbeta*tanh(u/lbeta)`.
/// Shapes: gate, up, out `[n]`. `linear_beta` None leaves `u` unbounded.
pub fn situ(gate: &[f32], up: &[f32], beta: f32, linear_beta: Option<f32>, out: &mut [f32]) {
    assert_eq!(gate.len(), up.len());
    assert_eq!(gate.len(), out.len());
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let a = beta * (g / beta).tanh() * sigmoid(g);
        let x = match linear_beta {
            Some(lb) => lb * (u / lb).tanh(),
            None => u,
        };
        *o = a * x;
    }
}

/// Dot product with f32 accumulation over several lanes.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for i in 0..chunks {
        for l in 0..8 {
            acc[l] += a[i * 8 + l] * b[i * 8 + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// `y += alpha * x`.
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    for (v, &u) in y.iter_mut().zip(x) {
        *v += alpha * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_sums_to_one_and_orders() {
        let mut x = vec![1.0, 2.0, 3.0, 1000.0];
        softmax_inplace(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[3] > 0.999);
    }

    #[test]
    fn rms_norm_unit() {
        let x = [3.0f32, 4.0];
        let mut out = [0.0f32; 2];
        rms_norm(&x, &[1.0, 2.0], 0.0, &mut out);
        let r = (12.5f32).sqrt();
        assert!((out[0] - 3.0 / r).abs() < 1e-6);
        assert!((out[1] - 8.0 / r).abs() < 1e-6);
    }

    #[test]
    fn simd_reductions_match_their_oracles() {
        // Lengths with and without a 16-lane tail, wide and tiny magnitudes, -inf entries
        // (masked attention scores) and a single element.
        for n in [1usize, 7, 16, 33, 896, 4096, 7168] {
            let x: Vec<f32> =
                (0..n).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * if i % 3 == 0 { 1e-3 } else { 0.02 }).collect();
            let w: Vec<f32> = (0..n).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect();
            let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
            rms_norm(&x, &w, 1e-6, &mut a);
            rms_norm_scalar(&x, &w, 1e-6, &mut b);
            let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(a.iter().zip(&b).all(|(p, q)| (p - q).abs() <= 1e-6 * scale), "rms_norm n={n}");
            for spread in [1.0f32, 30.0] {
                let mut s: Vec<f32> = x.iter().map(|v| v * spread).collect();
                if n > 4 {
                    s[3] = f32::NEG_INFINITY;
                }
                let mut t = s.clone();
                softmax_inplace(&mut s);
                softmax_inplace_scalar(&mut t);
                for (i, (p, q)) in s.iter().zip(&t).enumerate() {
                    assert!(
                        (p - q).abs() <= 1e-5 * q.max(1e-30) + 1e-12,
                        "softmax n={n} spread {spread} [{i}]: {p} vs {q}"
                    );
                }
                assert!((s.iter().sum::<f32>() - 1.0).abs() < 1e-4);
            }
        }
        if crate::cpu::Path::best() != crate::cpu::Path::Avx512 {
            println!("SKIPPED AVX-512 reductions: this CPU lacks them (the oracle was compared with itself)");
        }
    }

    #[test]
    fn situ_matches_formula() {
        let mut o = [0.0f32];
        situ(&[1.5], &[30.0], 4.0, Some(25.0), &mut o);
        let want = 4.0 * (1.5f32 / 4.0).tanh() * sigmoid(1.5) * 25.0 * (30.0f32 / 25.0).tanh();
        assert!((o[0] - want).abs() < 1e-5);
    }
}
