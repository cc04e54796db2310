//! Layer 4, operation: the per-head attention steps of the two attention kinds, apart from model
//! code. Imports `cpu`, `scalar` and `isa`.
//!
//! - KDA: one gated delta-rule update of a head's state `S [Dv, Dk]` and its read-out.
//! - MLA (absorbed, NoPE): scores of a query against every cached position, softmax, and the
//!   weighted sum of cached latents.
//!
//! Both keep the reference summation order; the AVX2 instantiations of the scalar bodies
//! vectorise the element-wise work and are bit-identical to them (tested). MLA's softmax is the
//! path's own: AVX-512's on AVX-512, NEON's on NEON, scalar otherwise.

use crate::cpu::Path;
#[cfg(target_arch = "aarch64")]
use crate::isa::neon;
#[cfg(target_arch = "x86_64")]
use crate::isa::{avx2, avx512};
use crate::scalar;

/// `S <- S * g` (per key channel), `delta = beta (v - S k)`, `S <- S + delta k^T`, `y = S q`.
/// Shapes: s `[Dv, Dk]`, q, k, g `[Dk]`, v, delta, y `[Dv]`.
#[allow(clippy::too_many_arguments)]
pub fn kda_head_step(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    delta: &mut [f32],
    y: &mut [f32],
) {
    kda_head_step_on(Path::best(), s, q, k, v, g, beta, delta, y);
}

/// [`kda_head_step`] on `path`: AVX-512's kernel (lane-parallel sums), the AVX2 instantiation of
/// the scalar step on AVX2, else scalar.
#[allow(clippy::too_many_arguments)]
pub fn kda_head_step_on(
    path: Path,
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    delta: &mut [f32],
    y: &mut [f32],
) {
    let (dk, dv) = (k.len(), v.len());
    assert!(s.len() == dv * dk && q.len() == dk && g.len() == dk && delta.len() == dv && y.len() == dv);
    match path.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F present (an available path); shapes asserted above.
        Path::Avx512 => unsafe { avx512::kda_head_step(s, q, k, v, g, beta, delta, y) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and FMA present (an available path).
        Path::Avx2 => unsafe { avx2::kda_head_step(s, q, k, v, g, beta, delta, y) },
        _ => scalar::kda_head_step(s, q, k, v, g, beta, delta, y),
    }
}

/// Absorbed NoPE MLA for one head: `score_t = scale (q_lat . c_t + q_pe . pe_t)`, softmax over
/// the cached positions, `o_lat = sum_t p_t c_t`.
/// Shapes: q_lat `[L]`, q_pe `[R]`, latents `[T, L]`, k_pe `[T, R]`, scores `[T]`, o_lat `[L]`.
pub fn mla_head_attend(
    q_lat: &[f32],
    q_pe: &[f32],
    latents: &[f32],
    k_pe: &[f32],
    scale: f32,
    scores: &mut [f32],
    o_lat: &mut [f32],
) {
    mla_head_attend_on(Path::best(), q_lat, q_pe, latents, k_pe, scale, scores, o_lat);
}

/// [`mla_head_attend`] on `path`: the AVX2 instantiations of scores and read-out on AVX2 and
/// AVX-512, with AVX-512's softmax on AVX-512; NEON's softmax between the portable scores and
/// read-out on NEON; all scalar otherwise.
#[allow(clippy::too_many_arguments)]
pub fn mla_head_attend_on(
    path: Path,
    q_lat: &[f32],
    q_pe: &[f32],
    latents: &[f32],
    k_pe: &[f32],
    scale: f32,
    scores: &mut [f32],
    o_lat: &mut [f32],
) {
    match path.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F, AVX2 and FMA present (an available AVX-512 path implies AVX2 + FMA).
        Path::Avx512 => unsafe {
            avx2::mla_scores(q_lat, q_pe, latents, k_pe, scale, scores);
            avx512::softmax_inplace(scores);
            avx2::mla_mix(scores, latents, q_lat.len(), o_lat);
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and FMA present (an available path).
        Path::Avx2 => unsafe {
            avx2::mla_scores(q_lat, q_pe, latents, k_pe, scale, scores);
            scalar::softmax_inplace(scores);
            avx2::mla_mix(scores, latents, q_lat.len(), o_lat);
        },
        #[cfg(target_arch = "aarch64")]
        Path::Neon => {
            scalar::mla_scores(q_lat, q_pe, latents, k_pe, scale, scores);
            // SAFETY: NEON present (an available path).
            unsafe { neon::softmax_inplace(scores) };
            scalar::mla_mix(scores, latents, q_lat.len(), o_lat);
        }
        _ => scalar::mla_head_attend(q_lat, q_pe, latents, k_pe, scale, scores, o_lat),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vals(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 2000) as f32 / 1000.0 - 1.0)
            .collect()
    }

    #[test]
    fn dispatched_steps_equal_the_portable_ones() {
        if !crate::cpu::has_avx2_fma() {
            println!("SKIPPED: this CPU has no AVX2+FMA path to test");
        }
        let d = 37; // not a multiple of the vector width
        let (q, k, v) = (vals(d, 1), vals(d, 2), vals(d, 3));
        let g: Vec<f32> = vals(d, 4).iter().map(|x| 0.5 + 0.4 * x).collect();
        let mut s1 = vals(d * d, 5);
        let mut s2 = s1.clone();
        let (mut dl1, mut dl2, mut y1, mut y2) = (vec![0f32; d], vec![0f32; d], vec![0f32; d], vec![0f32; d]);
        // The AVX2 instantiation is the scalar step compiled for AVX2: the same bits.
        kda_head_step_on(Path::Avx2, &mut s1, &q, &k, &v, &g, 0.7, &mut dl1, &mut y1);
        scalar::kda_head_step(&mut s2, &q, &k, &v, &g, 0.7, &mut dl2, &mut y2);
        assert!(s1.iter().zip(&s2).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(y1.iter().zip(&y2).all(|(a, b)| a.to_bits() == b.to_bits()));
        // AVX-512 sums in lanes: close to the scalar step over several steps (the state carries
        // the differences on), on widths below, at and off the vector width.
        for d in [5, 16, 37, 128] {
            let (q, k, v) = (vals(d, 11), vals(d, 12), vals(d, 13));
            let g: Vec<f32> = vals(d, 14).iter().map(|x| 0.5 + 0.4 * x).collect();
            let (mut sa, mut sb) = (vals(d * d, 15), vals(d * d, 15));
            let (mut da, mut db, mut ya, mut yb) = (vec![0f32; d], vec![0f32; d], vec![0f32; d], vec![0f32; d]);
            for _ in 0..4 {
                kda_head_step_on(Path::Avx512, &mut sa, &q, &k, &v, &g, 0.7, &mut da, &mut ya);
                scalar::kda_head_step(&mut sb, &q, &k, &v, &g, 0.7, &mut db, &mut yb);
            }
            let scale = yb.iter().chain(&sb).fold(0f32, |m, x| m.max(x.abs()));
            for (a, b) in ya.iter().chain(&sa).zip(yb.iter().chain(&sb)) {
                assert!((a - b).abs() <= 1e-5 * scale, "d {d}: {a} vs {b}");
            }
        }
        if !Path::Avx512.available() {
            println!("SKIPPED AVX-512 KDA step: this CPU lacks it (the scalar step was compared with itself)");
        }

        let (l, r, t) = (33, 5, 9);
        let (ql, qp, lat, pe) = (vals(l, 6), vals(r, 7), vals(t * l, 8), vals(t * r, 9));
        let (mut sc1, mut sc2, mut o1, mut o2) = (vec![0f32; t], vec![0f32; t], vec![0f32; l], vec![0f32; l]);
        // The default path against the portable scores and read-out around the same softmax.
        mla_head_attend(&ql, &qp, &lat, &pe, 0.3, &mut sc1, &mut o1);
        scalar::mla_scores(&ql, &qp, &lat, &pe, 0.3, &mut sc2);
        crate::ops::softmax_inplace(&mut sc2);
        scalar::mla_mix(&sc2, &lat, l, &mut o2);
        assert!(o1.iter().zip(&o2).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!((sc1.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        // The AVX2 path (AVX2 instantiations, scalar softmax) against the scalar twin.
        mla_head_attend_on(Path::Avx2, &ql, &qp, &lat, &pe, 0.3, &mut sc1, &mut o1);
        scalar::mla_head_attend(&ql, &qp, &lat, &pe, 0.3, &mut sc2, &mut o2);
        assert!(o1.iter().zip(&o2).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(sc1.iter().zip(&sc2).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}
