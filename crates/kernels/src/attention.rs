//! The per-head attention steps of the two attention kinds, apart from model code.
//!
//! - KDA: one gated delta-rule update of a head's state `S [Dv, Dk]` and its read-out.
//! - MLA (absorbed, NoPE): scores of a query against every cached position, softmax, and the
//!   weighted sum of cached latents.
//!
//! Both keep the reference summation order; the AVX2 instantiation vectorises the element-wise
//! work and is bit-identical to the portable one (tested).

use crate::dispatch::dispatch;
use crate::ops::{dot, softmax_inplace};

/// `S <- S * g` (per key channel), `delta = beta (v - S k)`, `S <- S + delta k^T`, `y = S q`.
/// Shapes: s `[Dv, Dk]`, q, k, g `[Dk]`, v, delta, y `[Dv]`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn kda_body(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: f32, delta: &mut [f32], y: &mut [f32]) {
    let d = k.len();
    for vi in 0..v.len() {
        let row = &mut s[vi * d..(vi + 1) * d];
        let mut mem = 0.0f32;
        for j in 0..d {
            row[j] *= g[j];
            mem += row[j] * k[j];
        }
        delta[vi] = (v[vi] - mem) * beta;
    }
    for vi in 0..v.len() {
        let row = &mut s[vi * d..(vi + 1) * d];
        let mut acc = 0.0f32;
        for j in 0..d {
            row[j] += k[j] * delta[vi];
            acc += row[j] * q[j];
        }
        y[vi] = acc;
    }
}

dispatch!(kda_head_step, kda_head_step_scalar, kda_avx2, kda_body, (s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: f32, delta: &mut [f32], y: &mut [f32]));

/// Absorbed NoPE MLA for one head: `score_t = scale (q_lat . c_t + q_pe . pe_t)`, softmax over
/// the cached positions, `o_lat = sum_t p_t c_t`.
/// Shapes: q_lat `[L]`, q_pe `[R]`, latents `[T, L]`, k_pe `[T, R]`, scores `[T]`, o_lat `[L]`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn mla_body(
    q_lat: &[f32],
    q_pe: &[f32],
    latents: &[f32],
    k_pe: &[f32],
    scale: f32,
    scores: &mut [f32],
    o_lat: &mut [f32],
) {
    let (kvl, rope) = (q_lat.len(), q_pe.len());
    for (t, s) in scores.iter_mut().enumerate() {
        let c = &latents[t * kvl..(t + 1) * kvl];
        let pe = &k_pe[t * rope..(t + 1) * rope];
        *s = scale * (dot(q_lat, c) + dot(q_pe, pe));
    }
    softmax_inplace(scores);
    o_lat.fill(0.0);
    for (t, &p) in scores.iter().enumerate() {
        for (o, &c) in o_lat.iter_mut().zip(&latents[t * kvl..(t + 1) * kvl]) {
            *o += p * c;
        }
    }
}

dispatch!(mla_head_attend, mla_head_attend_scalar, mla_avx2, mla_body, (q_lat: &[f32], q_pe: &[f32], latents: &[f32], k_pe: &[f32], scale: f32, scores: &mut [f32], o_lat: &mut [f32]));

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
        kda_head_step(&mut s1, &q, &k, &v, &g, 0.7, &mut dl1, &mut y1);
        kda_head_step_scalar(&mut s2, &q, &k, &v, &g, 0.7, &mut dl2, &mut y2);
        assert!(s1.iter().zip(&s2).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(y1.iter().zip(&y2).all(|(a, b)| a.to_bits() == b.to_bits()));

        let (l, r, t) = (33, 5, 9);
        let (ql, qp, lat, pe) = (vals(l, 6), vals(r, 7), vals(t * l, 8), vals(t * r, 9));
        let (mut sc1, mut sc2, mut o1, mut o2) = (vec![0f32; t], vec![0f32; t], vec![0f32; l], vec![0f32; l]);
        mla_head_attend(&ql, &qp, &lat, &pe, 0.3, &mut sc1, &mut o1);
        mla_head_attend_scalar(&ql, &qp, &lat, &pe, 0.3, &mut sc2, &mut o2);
        assert!(o1.iter().zip(&o2).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!((sc1.iter().sum::<f32>() - 1.0).abs() < 1e-5);
    }
}
