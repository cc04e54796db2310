//! The fused routed-expert kernel: `out = w2 · situ(w1 · x, w3 · x)` for one MXFP4 expert record,
//! with the gate (w1) and up (w3) rows computed in the same pass over the input (one load of each
//! input block serves both), SiTU applied as each row pair finishes, then the down product.
//!
//! Shapes: w1, w3 packed `[I, L/2]` + scales `[I, L/32]`; w2 packed `[L, I/2]` + scales
//! `[L, I/32]`; x `[L]`; out `[L]`; `act` is caller scratch of `[I]`.

#[cfg(any(target_arch = "x86_64", test))]
use crate::cpu::Path;
use crate::mxfp4::{BLOCK, mxfp4_matvec_par, row_dot_scalar};
use crate::ops::situ;

/// One MXFP4 matrix: packed nibbles and E8M0 scales.
#[derive(Clone, Copy)]
pub struct Mxfp4<'a> {
    pub packed: &'a [u8],
    pub scales: &'a [u8],
}

#[allow(clippy::too_many_arguments)]
pub fn expert_mxfp4(
    w1: Mxfp4,
    w3: Mxfp4,
    w2: Mxfp4,
    inter: usize,
    latent: usize,
    x: &[f32],
    beta: f32,
    linear_beta: Option<f32>,
    act: &mut [f32],
    out: &mut [f32],
) {
    assert!(latent.is_multiple_of(BLOCK) && inter.is_multiple_of(BLOCK));
    assert_eq!(w1.packed.len(), inter * latent / 2);
    assert_eq!(w3.packed.len(), inter * latent / 2);
    assert_eq!(w1.scales.len(), inter * latent / BLOCK);
    assert_eq!(w3.scales.len(), inter * latent / BLOCK);
    assert_eq!(x.len(), latent);
    assert_eq!(act.len(), inter);
    assert_eq!(out.len(), latent);
    #[cfg(target_arch = "x86_64")]
    if Path::best() == Path::Avx512 {
        crate::mxfp4::with_deinterleaved(x, |xd| {
            crate::par::par_rows(inter, 2 * latent, act, |r0, a| {
                // SAFETY: AVX-512F/BW present (Path::best); shapes asserted above.
                unsafe { crate::avx512::gate_up_situ_avx512(w1, w3, r0, latent, xd, beta, linear_beta, a) }
            })
        });
        mxfp4_matvec_par(w2.packed, w2.scales, latent, inter, act, out);
        return;
    }
    expert_mxfp4_unfused(w1, w3, w2, inter, latent, x, beta, linear_beta, act, out);
}

/// The same expert from separate products: the oracle, and the path without AVX-512.
#[allow(clippy::too_many_arguments)]
pub fn expert_mxfp4_unfused(
    w1: Mxfp4,
    w3: Mxfp4,
    w2: Mxfp4,
    inter: usize,
    latent: usize,
    x: &[f32],
    beta: f32,
    linear_beta: Option<f32>,
    act: &mut [f32],
    out: &mut [f32],
) {
    // Gate and up products in per-thread buffers reused across calls: this is the production
    // path on CPUs without AVX-512, and the decode loop must not allocate.
    thread_local! {
        static GU: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    }
    GU.with(|gu| {
        let (g, u) = &mut *gu.borrow_mut();
        g.resize(inter, 0.0); // [I]
        u.resize(inter, 0.0); // [I]
        mxfp4_matvec_par(w1.packed, w1.scales, inter, latent, x, g);
        mxfp4_matvec_par(w3.packed, w3.scales, inter, latent, x, u);
        situ(g, u, beta, linear_beta, act);
    });
    mxfp4_matvec_par(w2.packed, w2.scales, latent, inter, act, out);
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
/// Scalar gate/up/SiTU rows `r0..r0+a.len()` (for rows whose scales need the safe path).
pub(crate) fn gate_up_situ_row_scalar(
    w1: Mxfp4,
    w3: Mxfp4,
    r: usize,
    latent: usize,
    x: &[f32],
    beta: f32,
    lb: Option<f32>,
) -> f32 {
    let (half, nb) = (latent / 2, latent / BLOCK);
    let g = row_dot_scalar(&w1.packed[r * half..(r + 1) * half], &w1.scales[r * nb..(r + 1) * nb], x);
    let u = row_dot_scalar(&w3.packed[r * half..(r + 1) * half], &w3.scales[r * nb..(r + 1) * nb], x);
    let mut o = [0f32];
    situ(&[g], &[u], beta, lb, &mut o);
    o[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_matches_unfused() {
        let (inter, latent) = (96, 128);
        use crate::testdata::bytes;
        let scales = |n: usize, seed: u64| crate::testdata::scales(n, seed, 119, 4);
        let (p1, p3, p2) = (bytes(inter * latent / 2, 1), bytes(inter * latent / 2, 2), bytes(latent * inter / 2, 3));
        let (s1, s3, s2) =
            (scales(inter * latent / 32, 4), scales(inter * latent / 32, 5), scales(latent * inter / 32, 6));
        let x: Vec<f32> = (0..latent).map(|i| (i as f32 * 0.37).sin()).collect();
        let w1 = Mxfp4 { packed: &p1, scales: &s1 };
        let w3 = Mxfp4 { packed: &p3, scales: &s3 };
        let w2 = Mxfp4 { packed: &p2, scales: &s2 };
        let (mut act, mut a) = (vec![0f32; inter], vec![0f32; latent]);
        let (mut act2, mut b) = (vec![0f32; inter], vec![0f32; latent]);
        expert_mxfp4(w1, w3, w2, inter, latent, &x, 4.0, Some(25.0), &mut act, &mut a);
        expert_mxfp4_unfused(w1, w3, w2, inter, latent, &x, 4.0, Some(25.0), &mut act2, &mut b);
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (u, v) in a.iter().zip(&b) {
            assert!((u - v).abs() <= 1e-5 * scale, "{u} vs {v}");
        }
        if Path::best() != Path::Avx512 {
            println!("SKIPPED fused AVX-512 path: this CPU lacks it (unfused path compared with itself)");
        }
    }
}
