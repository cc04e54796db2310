//! Layer 4, operation: approximate mode for MXFP4 products. Activations are quantised per
//! 32-element block to int8 ([`QuantizedX`]: scale = max|x| / 127), weights taken as the exact
//! integers 2·E2M1 in [-12, 12], block dot products in integer arithmetic, then one multiply by
//! both scales. Faster and not exact: every output that uses it is labelled approximate.
//!
//! Imports `format`, `cpu`, `par`, `scalar` and `isa`. Kernels: AVX-512 with VNNI (a capability
//! of [`Path::Avx512`]), else AVX2 (also on AVX-512 CPUs without VNNI); NEON with `sdot`
//! (FEAT_DotProd); else scalar.

use crate::cpu::Path;
#[cfg(target_arch = "x86_64")]
use crate::cpu::has_avx512_vnni;
pub use crate::format::QuantizedX;
use crate::format::{BLOCK, Mxfp4};
#[cfg(target_arch = "aarch64")]
use crate::isa::neon;
#[cfg(target_arch = "x86_64")]
use crate::isa::{avx2, avx512};
use crate::par::par_rows;
use crate::scalar;

/// The approximate product on the best path (AVX-512 VNNI, else AVX2, else scalar; the integer
/// sums are exact, so a SIMD path equals the scalar one up to the order of the final f32
/// accumulation). Shapes as `mxfp4_matvec`, with `xq` quantised from x `[cols]`.
pub fn mxfp4_matvec_q8(packed: &[u8], scales: &[u8], rows: usize, cols: usize, xq: &QuantizedX, out: &mut [f32]) {
    mxfp4_matvec_q8_on(Path::best(), packed, scales, rows, cols, xq, out);
}

/// [`mxfp4_matvec_q8`] on `path`: its VNNI kernel where [`Path::Avx512`] has VNNI, the AVX2
/// kernel on AVX-512 without it, scalar where this CPU lacks `path`.
pub fn mxfp4_matvec_q8_on(
    path: Path,
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    xq: &QuantizedX,
    out: &mut [f32],
) {
    assert!(cols.is_multiple_of(BLOCK));
    assert_eq!(packed.len(), rows * cols / 2);
    assert_eq!(scales.len(), rows * cols / BLOCK);
    assert_eq!(xq.q.len(), cols);
    assert_eq!(xq.scales.len(), cols / BLOCK);
    assert_eq!(out.len(), rows);
    match path.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F/BW (an available path) and VL/VNNI (the guard) present; shapes
        // asserted above.
        Path::Avx512 if has_avx512_vnni() => unsafe {
            avx512::mxfp4_matvec_q8_vnni(packed, scales, rows, cols, xq, out)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 present (an available path; AVX-512 implies it); shapes asserted above.
        Path::Avx512 | Path::Avx2 => unsafe { avx2::mxfp4_matvec_q8(packed, scales, rows, cols, xq, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON (an available path) and DotProd (the guard) present; shapes asserted above.
        Path::Neon if crate::cpu::has_neon_dotprod() => unsafe {
            neon::mxfp4_matvec_q8_dot(packed, scales, rows, cols, xq, out)
        },
        _ => scalar::mxfp4_matvec_q8(packed, scales, rows, cols, xq, out),
    }
}

/// Row-parallel [`mxfp4_matvec_q8`].
pub fn mxfp4_matvec_q8_par(packed: &[u8], scales: &[u8], rows: usize, cols: usize, xq: &QuantizedX, out: &mut [f32]) {
    mxfp4_matvec_q8_par_on(Path::best(), packed, scales, rows, cols, xq, out);
}

/// Row-parallel [`mxfp4_matvec_q8_on`].
pub fn mxfp4_matvec_q8_par_on(
    path: Path,
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    xq: &QuantizedX,
    out: &mut [f32],
) {
    let (half, nb) = (cols / 2, cols / BLOCK);
    par_rows(rows, cols, out, |r0, o| {
        let n = o.len();
        mxfp4_matvec_q8_on(path, &packed[r0 * half..(r0 + n) * half], &scales[r0 * nb..(r0 + n) * nb], n, cols, xq, o)
    });
}

/// The routed expert in approximate mode: `w2 · situ(w1 · x, w3 · x)` with int8 activations
/// (`xq` is the expert input quantised once per layer; `aq` is scratch for the SiTU output).
#[allow(clippy::too_many_arguments)]
pub fn expert_mxfp4_approx(
    w1: Mxfp4,
    w3: Mxfp4,
    w2: Mxfp4,
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
    expert_mxfp4_approx_on(Path::best(), w1, w3, w2, inter, latent, xq, beta, linear_beta, gate_up, act, aq, out);
}

/// [`expert_mxfp4_approx`] with its products on `path`.
#[allow(clippy::too_many_arguments)]
pub fn expert_mxfp4_approx_on(
    path: Path,
    w1: Mxfp4,
    w3: Mxfp4,
    w2: Mxfp4,
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
    mxfp4_matvec_q8_par_on(path, w1.packed, w1.scales, inter, latent, xq, gate_up);
    mxfp4_matvec_q8_par_on(path, w3.packed, w3.scales, inter, latent, xq, act);
    // act <- situ(gate, up), in place over the up values.
    for (a, &g) in act.iter_mut().zip(gate_up.iter()) {
        let mut o = [0f32];
        scalar::situ(&[g], &[*a], beta, linear_beta, &mut o);
        *a = o[0];
    }
    aq.quantize(act);
    mxfp4_matvec_q8_par_on(path, w2.packed, w2.scales, latent, inter, aq, out);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The paths to check: every available one (AVX-512 without VNNI runs the AVX2 kernel).
    fn paths() -> impl Iterator<Item = Path> {
        Path::ALL.into_iter().filter(|p| {
            if !p.available() {
                println!("SKIPPED approximate path {p:?}: this CPU lacks it");
            } else if *p == Path::Avx512 && !crate::cpu::has_avx512_vnni() {
                println!("NOTE approximate path Avx512 without VNNI: its AVX2 kernel is checked");
            } else if *p == Path::Neon {
                match crate::cpu::has_neon_dotprod() {
                    true => println!("approximate path Neon: the sdot kernel, checked bit for bit"),
                    false => println!("SKIPPED NEON sdot kernel: this CPU lacks DotProd (scalar checked)"),
                }
            }
            p.available()
        })
    }

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
        scalar::mxfp4_matvec_q8(&packed, &scales, rows, cols, &xq, &mut b);
        scalar::mxfp4_matvec(&packed, &scales, rows, cols, &x, &mut e);
        let scale = e.iter().fold(0f32, |m, v| m.max(v.abs()));
        for path in paths() {
            let mut a = vec![0f32; rows];
            mxfp4_matvec_q8_on(path, &packed, &scales, rows, cols, &xq, &mut a);
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
            scalar::mxfp4_matvec_q8(&packed, &scales, rows, cols, &xq, &mut want);
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for path in paths() {
                let mut got = vec![0f32; rows];
                mxfp4_matvec_q8_on(path, &packed, &scales, rows, cols, &xq, &mut got);
                for r in 0..rows {
                    assert!((got[r] - want[r]).abs() <= 1e-5 * scale, "{path:?} {rows}x{cols} row {r}");
                }
                // The sdot kernel accumulates in the oracle's order: the same bits.
                if path == Path::Neon && crate::cpu::has_neon_dotprod() {
                    assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "sdot {rows}x{cols}");
                }
            }
        }
    }
}
