//! Layer 4, operation: the small element-wise and reduction kernels every model uses (norms,
//! softmax, activations). Imports `cpu`, `scalar` and `isa`.
//!
//! RMSNorm and softmax have AVX-512 and NEON kernels, SiTU an AVX-512 one; they come as
//! `op_on(path, ..)` + `op(..)`. The
//! other activations and small reductions have one (scalar) implementation, shared with the SIMD
//! kernels, and are re-exported here from `scalar`.

use crate::cpu::Path;
#[cfg(target_arch = "aarch64")]
use crate::isa::neon;
#[cfg(target_arch = "x86_64")]
use crate::isa::{avx2_math, avx512, avx512_math};
use crate::scalar;
pub use crate::scalar::{axpy, dot, inv_rms, sigmoid, silu, softplus};

/// SiTU, Kimi K3's gated activation: `beta*tanh(g/beta)*sigmoid(g) * lbeta*tanh(u/lbeta)`.
/// AVX-512 or AVX2 lane math when the CPU has it (the same bits for an element wherever it sits
/// in the slice); `scalar::situ` (libm) is the oracle. Shapes: gate, up, out `[n]`.
pub fn situ(gate: &[f32], up: &[f32], beta: f32, linear_beta: Option<f32>, out: &mut [f32]) {
    situ_on(Path::best(), gate, up, beta, linear_beta, out);
}

/// [`situ`] on `path` (scalar where `path` has no kernel).
pub fn situ_on(path: Path, gate: &[f32], up: &[f32], beta: f32, linear_beta: Option<f32>, out: &mut [f32]) {
    assert!(gate.len() == out.len() && up.len() == out.len());
    match path.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F is present (an available path); lengths asserted above.
        Path::Avx512 => unsafe { avx512_math::situ(gate, up, beta, linear_beta, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and FMA are present (an available path); lengths asserted above.
        Path::Avx2 => unsafe { avx2_math::situ(gate, up, beta, linear_beta, out) },
        _ => scalar::situ(gate, up, beta, linear_beta, out),
    }
}

/// RMSNorm: `out = x / sqrt(mean(x^2) + eps) * weight`. Shapes: x, weight, out `[n]`.
/// AVX-512 when the CPU has it; `scalar::rms_norm` is the oracle.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    rms_norm_on(Path::best(), x, weight, eps, out);
}

/// [`rms_norm`] on `path` (scalar where `path` has no kernel).
pub fn rms_norm_on(path: Path, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), weight.len());
    assert_eq!(x.len(), out.len());
    out.copy_from_slice(x);
    rms_norm_inplace_on(path, out, weight, eps);
}

/// In-place RMSNorm. Shapes: x, weight `[n]`.
pub fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    rms_norm_inplace_on(Path::best(), x, weight, eps);
}

/// [`rms_norm_inplace`] on `path` (scalar where `path` has no kernel).
pub fn rms_norm_inplace_on(path: Path, x: &mut [f32], weight: &[f32], eps: f32) {
    assert_eq!(x.len(), weight.len());
    match path.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F is present (an available path); lengths asserted above.
        Path::Avx512 => unsafe { avx512::rms_norm_inplace(x, weight, eps) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON is present (an available path); lengths asserted above.
        Path::Neon => unsafe { neon::rms_norm_inplace(x, weight, eps) },
        _ => scalar::rms_norm_inplace(x, weight, eps),
    }
}

/// Numerically stable in-place softmax. AVX-512 (a polynomial `exp`) when the CPU has it;
/// `scalar::softmax_inplace` is the oracle.
pub fn softmax_inplace(x: &mut [f32]) {
    softmax_inplace_on(Path::best(), x);
}

/// [`softmax_inplace`] on `path` (scalar where `path` has no kernel).
pub fn softmax_inplace_on(path: Path, x: &mut [f32]) {
    match path.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F is present (an available path).
        Path::Avx512 => unsafe { avx512::softmax_inplace(x) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON is present (an available path).
        Path::Neon => unsafe { neon::softmax_inplace(x) },
        _ => scalar::softmax_inplace(x),
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
            scalar::rms_norm(&x, &w, 1e-6, &mut b);
            let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(a.iter().zip(&b).all(|(p, q)| (p - q).abs() <= 1e-6 * scale), "rms_norm n={n}");
            for spread in [1.0f32, 30.0] {
                let mut s: Vec<f32> = x.iter().map(|v| v * spread).collect();
                if n > 4 {
                    s[3] = f32::NEG_INFINITY;
                }
                let mut t = s.clone();
                softmax_inplace(&mut s);
                scalar::softmax_inplace(&mut t);
                for (i, (p, q)) in s.iter().zip(&t).enumerate() {
                    assert!(
                        (p - q).abs() <= 1e-5 * q.max(1e-30) + 1e-12,
                        "softmax n={n} spread {spread} [{i}]: {p} vs {q}"
                    );
                }
                assert!((s.iter().sum::<f32>() - 1.0).abs() < 1e-4);
            }
        }
        match crate::cpu::Path::best() {
            Path::Avx512 | Path::Neon => println!("reductions: {:?} against the scalar oracle", Path::best()),
            _ => println!(
                "SKIPPED SIMD reductions: this CPU has neither AVX-512 nor NEON (the oracle was compared with itself)"
            ),
        }
    }

    /// The AVX-512 SiTU (polynomial `exp` and `tanh`) against libm's, over gate and up values from
    /// tiny to saturating, both signs, with and without the linear bound, on lengths with a
    /// partial last group; and an element's bits do not depend on where it sits in the slice.
    #[test]
    fn situ_paths_agree() {
        if !Path::Avx512.available() {
            println!("SKIPPED AVX-512 SiTU: this CPU lacks it");
            return;
        }
        let vals: Vec<f32> = (0..997)
            .map(|i| {
                let m = [1e-6f32, 1e-3, 0.05, 0.29, 0.31, 1.0, 3.0, 12.0, 40.0, 120.0][i % 10];
                m * if i % 3 == 0 { -1.0 } else { 1.0 } * (1.0 + (i as f32 * 0.37).sin() * 0.5)
            })
            .collect();
        let up: Vec<f32> = vals.iter().rev().map(|v| v * 2.5).collect();
        for lb in [Some(25.0), None] {
            for n in [1, 15, 16, 17, 997] {
                let (g, u) = (&vals[..n], &up[..n]);
                let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
                situ_on(Path::Avx512, g, u, 4.0, lb, &mut a);
                scalar::situ(g, u, 4.0, lb, &mut b);
                for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                    assert!((x - y).abs() <= 2e-6 * y.abs() + 1e-30, "n {n} [{i}] g {} u {}: {x} vs {y}", g[i], u[i]);
                }
                // The same elements from an offset sub-slice give the same bits.
                if n > 3 {
                    let mut c = vec![0f32; n - 3];
                    situ_on(Path::Avx512, &g[3..], &u[3..], 4.0, lb, &mut c);
                    assert!(
                        c.iter().zip(&a[3..]).all(|(p, q)| p.to_bits() == q.to_bits()),
                        "n {n}: position changed bits"
                    );
                }
            }
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
