//! Layer 4, operation: the routed MXFP4 expert, `out = w2 · situ(w1 · x, w3 · x)`, for one input
//! or a small batch of inputs. Imports `format`, `cpu`, `par`, `scalar`, `isa` and, the one
//! operation module below it, `mxfp4` (the down product and the paths without AVX-512).
//!
//! On AVX-512 and AVX2 the gate (w1) and up (w3) products and then the down product run as
//! register tiles ([`crate::isa::avx512_tile`], [`crate::isa::avx2_tile`]), SiTU applied between
//! them; the batched form decodes each weight block once for a group of inputs and is, per input,
//! bit-identical to the single-input expert.
//!
//! Shapes: w1, w3 packed `[I, L/2]` + scales `[I, L/32]`; w2 packed `[L, I/2]` + scales
//! `[L, I/32]`; x `[L]`; out `[L]`; `act` is caller scratch of `[I]`. Batched: xs `[n, L]`, act
//! `[n, I]`, out `[n, L]`.

use std::cell::RefCell;

use crate::cpu::Path;
pub use crate::format::Mxfp4;
use crate::format::{BLOCK, check_matmat_shapes};
#[cfg(target_arch = "x86_64")]
use crate::isa::{avx2_tile, avx512_tile, staging};
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
use crate::mxfp4::mxfp4_matmat_on;
use crate::mxfp4::mxfp4_matvec_par_on;
#[cfg(target_arch = "x86_64")]
use crate::par::{par_rows, par_rows_wide};
use crate::scalar::situ;

/// The expert on the best path: register tiles with AVX-512 or AVX2, else [`expert_mxfp4_unfused`].
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
    expert_mxfp4_on(Path::best(), w1, w3, w2, inter, latent, x, beta, linear_beta, act, out);
}

/// [`expert_mxfp4`] on `path`: gate and up as register tiles with SiTU on AVX-512 and AVX2
/// ([`crate::isa::avx512_tile::gate_up_situ`], [`crate::isa::avx2_tile::gate_up_situ`]), else
/// [`expert_mxfp4_unfused_on`].
#[allow(clippy::too_many_arguments)]
pub fn expert_mxfp4_on(
    path: Path,
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
    match path.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        p @ (Path::Avx512 | Path::Avx2) => {
            staging::with_deinterleaved(x, |xd| {
                par_rows(inter, 2 * latent, act, |r0, a| {
                    // SAFETY: `p` is an available x86 tile path; shapes asserted above.
                    unsafe { x86_gate_up_situ(p, w1, w3, r0, latent, xd, 1, beta, linear_beta, a) }
                })
            });
            mxfp4_matvec_par_on(p, w2.packed, w2.scales, latent, inter, act, out);
        }
        p => expert_mxfp4_unfused_on(p, w1, w3, w2, inter, latent, x, beta, linear_beta, act, out),
    }
}

/// The same expert from three separate products and a separate SiTU on the best path: the
/// oracle of the AVX-512 expert, and the path without AVX-512.
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
    expert_mxfp4_unfused_on(Path::best(), w1, w3, w2, inter, latent, x, beta, linear_beta, act, out);
}

/// [`expert_mxfp4_unfused`] with its products on `path`.
#[allow(clippy::too_many_arguments)]
pub fn expert_mxfp4_unfused_on(
    path: Path,
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
    with_gate_up(inter, |g, u| {
        // g, u: [I]
        mxfp4_matvec_par_on(path, w1.packed, w1.scales, inter, latent, x, g);
        mxfp4_matvec_par_on(path, w3.packed, w3.scales, inter, latent, x, u);
        situ(g, u, beta, linear_beta, act);
    });
    mxfp4_matvec_par_on(path, w2.packed, w2.scales, latent, inter, act, out);
}

/// Run `f` on per-thread gate and up buffers of `len` values each, reused across calls: the
/// unfused expert is the production path on CPUs without AVX-512, and the decode loop must not
/// allocate.
fn with_gate_up(len: usize, f: impl FnOnce(&mut [f32], &mut [f32])) {
    thread_local! {
        static GU: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
    }
    GU.with(|gu| {
        let (g, u) = &mut *gu.borrow_mut();
        g.resize(len, 0.0);
        u.resize(len, 0.0);
        f(&mut g[..len], &mut u[..len]);
    });
}

/// [`expert_mxfp4`] for `n` inputs: `out[t] = w2 · situ(w1 · xs[t], w3 · xs[t])`.
/// Shapes: xs `[n, L]`, act (scratch) `[n, I]`, out `[n, L]`.
#[allow(clippy::too_many_arguments)]
pub fn expert_mxfp4_batch(
    w1: Mxfp4,
    w3: Mxfp4,
    w2: Mxfp4,
    inter: usize,
    latent: usize,
    xs: &[f32],
    n: usize,
    beta: f32,
    linear_beta: Option<f32>,
    act: &mut [f32],
    out: &mut [f32],
) {
    expert_mxfp4_batch_on(Path::best(), w1, w3, w2, inter, latent, xs, n, beta, linear_beta, act, out);
}

/// [`expert_mxfp4_batch`] on `path` (a loop over [`expert_mxfp4_on`] where `path` has no batched
/// kernel).
#[allow(clippy::too_many_arguments)]
pub fn expert_mxfp4_batch_on(
    path: Path,
    w1: Mxfp4,
    w3: Mxfp4,
    w2: Mxfp4,
    inter: usize,
    latent: usize,
    xs: &[f32],
    n: usize,
    beta: f32,
    linear_beta: Option<f32>,
    act: &mut [f32],
    out: &mut [f32],
) {
    check_matmat_shapes(w1.packed, w1.scales, inter, latent, xs, n, act);
    check_matmat_shapes(w3.packed, w3.scales, inter, latent, xs, n, act);
    assert_eq!(out.len(), n * latent);
    match path.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        p @ (Path::Avx512 | Path::Avx2) if n > 1 => {
            staging::with_batch_staging(xs, latent, inter, n, act, |xd, staged| {
                par_rows_wide(inter, 2 * latent * n, n, staged, |r0, o| {
                    // SAFETY: `p` is an available x86 tile path; shapes checked above.
                    unsafe { x86_gate_up_situ(p, w1, w3, r0, latent, xd, n, beta, linear_beta, o) }
                });
            });
            mxfp4_matmat_on(p, w2.packed, w2.scales, latent, inter, act, n, out);
        }
        // Gate and up for the whole batch with the batched NEON product, SiTU per input, then
        // the down product batched: per input the same operations as the one-input expert.
        #[cfg(target_arch = "aarch64")]
        Path::Neon if n > 1 => {
            with_gate_up(n * inter, |g, u| {
                // g, u: [n, I]
                mxfp4_matmat_on(Path::Neon, w1.packed, w1.scales, inter, latent, xs, n, g);
                mxfp4_matmat_on(Path::Neon, w3.packed, w3.scales, inter, latent, xs, n, u);
                for ((g, u), a) in g.chunks_exact(inter).zip(u.chunks_exact(inter)).zip(act.chunks_exact_mut(inter)) {
                    situ(g, u, beta, linear_beta, a);
                }
            });
            mxfp4_matmat_on(Path::Neon, w2.packed, w2.scales, latent, inter, act, n, out);
        }
        p => {
            for t in 0..n {
                expert_mxfp4_on(
                    p,
                    w1,
                    w3,
                    w2,
                    inter,
                    latent,
                    &xs[t * latent..(t + 1) * latent],
                    beta,
                    linear_beta,
                    &mut act[t * inter..(t + 1) * inter],
                    &mut out[t * latent..(t + 1) * latent],
                );
            }
        }
    }
}

/// The fused gate, up and SiTU of an x86 path ([`avx512_tile::gate_up_situ`] or
/// [`avx2_tile::gate_up_situ`]): `act [rows, n]`.
///
/// # Safety
/// `path` is [`Path::Avx512`] or [`Path::Avx2`] and available on this CPU; shapes as the
/// kernels' `# Safety` sections say.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn x86_gate_up_situ(
    path: Path,
    w1: Mxfp4,
    w3: Mxfp4,
    r0: usize,
    latent: usize,
    xd: &[f32],
    n: usize,
    beta: f32,
    linear_beta: Option<f32>,
    act: &mut [f32],
) {
    debug_assert!(matches!(path, Path::Avx512 | Path::Avx2) && path.available());
    // SAFETY: the caller's guarantee: the path's features are present and the shapes hold.
    unsafe {
        match path {
            Path::Avx512 => avx512_tile::gate_up_situ(w1, w3, r0, latent, xd, n, beta, linear_beta, act),
            _ => avx2_tile::gate_up_situ(w1, w3, r0, latent, xd, n, beta, linear_beta, act),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scalar;
    use crate::testdata::bytes;

    #[test]
    fn fused_matches_unfused() {
        let (inter, latent) = (96, 128);
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
        if !matches!(Path::best(), Path::Avx512 | Path::Avx2) {
            println!("SKIPPED fused x86 tile paths: this CPU lacks them (unfused path compared with itself)");
        }
    }

    fn scales(n: usize, seed: u64) -> Vec<u8> {
        crate::testdata::scales(n, seed, 117, 8)
    }

    fn inputs(n: usize, cols: usize) -> Vec<f32> {
        (0..n * cols).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + (i % 3) as f32)).collect()
    }

    #[test]
    fn expert_batch_is_bit_identical_to_single_experts() {
        let (inter, latent) = (96, 128);
        let (p1, p3, p2) = (bytes(inter * latent / 2, 3), bytes(inter * latent / 2, 4), bytes(latent * inter / 2, 5));
        let (mut s1, s3, s2) =
            (scales(inter * latent / 32, 6), scales(inter * latent / 32, 7), scales(latent * inter / 32, 8));
        // A huge scale in gate row 0 sends that row down the safe path in every kernel.
        s1[0] = 230;
        let w1 = Mxfp4 { packed: &p1, scales: &s1 };
        let w3 = Mxfp4 { packed: &p3, scales: &s3 };
        let w2 = Mxfp4 { packed: &p2, scales: &s2 };
        for n in [1, 2, 8, 9] {
            let xs = inputs(n, latent);
            let (mut act, mut out) = (vec![0f32; n * inter], vec![0f32; n * latent]);
            expert_mxfp4_batch(w1, w3, w2, inter, latent, &xs, n, 4.0, Some(25.0), &mut act, &mut out);
            for t in 0..n {
                let (mut a1, mut o1) = (vec![0f32; inter], vec![0f32; latent]);
                expert_mxfp4(
                    w1,
                    w3,
                    w2,
                    inter,
                    latent,
                    &xs[t * latent..(t + 1) * latent],
                    4.0,
                    Some(25.0),
                    &mut a1,
                    &mut o1,
                );
                assert!(
                    o1.iter().zip(&out[t * latent..(t + 1) * latent]).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "n {n} input {t}"
                );
            }
        }
        match Path::best() {
            Path::Avx512 | Path::Avx2 | Path::Neon => println!("batched expert on {:?} tested", Path::best()),
            _ => println!(
                "SKIPPED batched expert: this CPU has neither AVX-512 nor NEON (the per-input loop was tested)"
            ),
        }
    }

    /// The unfused expert on the scalar path is bit-identical to the scalar fused expert (the
    /// same row dot products and SiTU per element), and every path tracks it.
    #[test]
    fn every_path_matches_the_scalar_expert() {
        let (inter, latent) = (64, 96);
        let (p1, p3, p2) =
            (bytes(inter * latent / 2, 11), bytes(inter * latent / 2, 12), bytes(latent * inter / 2, 13));
        let (mut s1, s3, s2) =
            (scales(inter * latent / 32, 14), scales(inter * latent / 32, 15), scales(latent * inter / 32, 16));
        s1[0] = 230; // a row on the safe path
        let w1 = Mxfp4 { packed: &p1, scales: &s1 };
        let w3 = Mxfp4 { packed: &p3, scales: &s3 };
        let w2 = Mxfp4 { packed: &p2, scales: &s2 };
        let x = inputs(1, latent);
        let (mut act0, mut want) = (vec![0f32; inter], vec![0f32; latent]);
        scalar::expert_mxfp4(w1, w3, w2, inter, latent, &x, 4.0, Some(25.0), &mut act0, &mut want);
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        for path in Path::ALL {
            if !path.available() {
                println!("SKIPPED expert on {path:?}: this CPU lacks it");
                continue;
            }
            let (mut act, mut got) = (vec![0f32; inter], vec![0f32; latent]);
            expert_mxfp4_on(path, w1, w3, w2, inter, latent, &x, 4.0, Some(25.0), &mut act, &mut got);
            if path == Path::Scalar {
                assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "scalar path");
            }
            for (u, v) in got.iter().zip(&want) {
                assert!((u - v).abs() <= 1e-5 * scale, "{path:?}: {u} vs {v}");
            }
        }
    }
}
