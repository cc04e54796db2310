//! Small-batch matrix-matrix forms of the MXFP4 kernels, for prompt processing: when several
//! tokens of a prompt chunk use the same expert, each weight block is decoded once and applied to
//! every token's input, instead of once per token.
//!
//! Per input, the arithmetic and its order are exactly those of the single-input kernel on the
//! same path (`mxfp4_matvec`, `expert_mxfp4`), so a chunked prompt stays bit-identical to feeding
//! its tokens one at a time. Paths without a batched kernel loop over the inputs.
//!
//! Shapes: inputs `xs: [n, cols]` row-major, outputs `[n, rows]`.

use std::cell::RefCell;

#[cfg(any(target_arch = "x86_64", test))]
use crate::cpu::Path;
use crate::expert::{Mxfp4, expert_mxfp4};
use crate::mxfp4::{BLOCK, mxfp4_matvec_par};

/// Inputs decoded against one block in a single pass (register budget: two accumulators per
/// input in the fused gate/up kernel). Larger batches are processed in groups of this size.
pub const MAX_BATCH: usize = 8;

thread_local! {
    /// Deinterleaved inputs `[n, cols]`, the row-major staging output `[rows, n]`, and the
    /// expert's activation `[n, I]`: reused, so batched calls do not allocate once warm.
    static BUFS: RefCell<(Vec<f32>, Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

fn check(packed: &[u8], scales: &[u8], rows: usize, cols: usize, xs: &[f32], n: usize, out: &[f32]) {
    assert!(cols.is_multiple_of(BLOCK), "MXFP4 rows must be whole blocks of 32");
    assert_eq!(packed.len(), rows * cols / 2);
    assert_eq!(scales.len(), rows * cols / BLOCK);
    assert_eq!(xs.len(), n * cols);
    assert_eq!(out.len(), n * rows);
}

/// `out[t, r] = sum_c W[r, c] * xs[t, c]` for `t < n`, rows split over the thread pool.
pub fn mxfp4_matmat(packed: &[u8], scales: &[u8], rows: usize, cols: usize, xs: &[f32], n: usize, out: &mut [f32]) {
    check(packed, scales, rows, cols, xs, n, out);
    #[cfg(target_arch = "x86_64")]
    if Path::best() == Path::Avx512 && n > 1 {
        BUFS.with(|b| {
            let (xd, staged, _) = &mut *b.borrow_mut();
            deinterleave_all(xs, cols, xd);
            staged.resize(rows * n, 0.0); // [rows, n]
            let (xd, (half, nb)) = (&xd[..], (cols / 2, cols / BLOCK));
            crate::par::par_rows_wide(rows, cols * n, n, staged, |r0, o| {
                let m = o.len() / n;
                // SAFETY: AVX-512F/BW present (Path::best); shapes checked above.
                unsafe {
                    crate::avx512::mxfp4_rows_batch_avx512(
                        &packed[r0 * half..(r0 + m) * half],
                        &scales[r0 * nb..(r0 + m) * nb],
                        m,
                        cols,
                        xd,
                        n,
                        o,
                    )
                }
            });
            transpose_into(staged, rows, n, out);
        });
        return;
    }
    for t in 0..n {
        mxfp4_matvec_par(packed, scales, rows, cols, &xs[t * cols..(t + 1) * cols], &mut out[t * rows..(t + 1) * rows]);
    }
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
    check(w1.packed, w1.scales, inter, latent, xs, n, act);
    check(w3.packed, w3.scales, inter, latent, xs, n, act);
    assert_eq!(out.len(), n * latent);
    #[cfg(target_arch = "x86_64")]
    if Path::best() == Path::Avx512 && n > 1 {
        BUFS.with(|b| {
            let (xd, staged, _) = &mut *b.borrow_mut();
            deinterleave_all(xs, latent, xd);
            staged.resize(inter * n, 0.0); // [I, n]
            let xd = &xd[..];
            crate::par::par_rows_wide(inter, 2 * latent * n, n, staged, |r0, o| {
                // SAFETY: AVX-512F/BW present (Path::best); shapes checked above.
                unsafe { crate::avx512::gate_up_situ_batch_avx512(w1, w3, r0, latent, xd, n, beta, linear_beta, o) }
            });
            transpose_into(staged, inter, n, act);
        });
        mxfp4_matmat(w2.packed, w2.scales, latent, inter, act, n, out);
        return;
    }
    for t in 0..n {
        expert_mxfp4(
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

/// Each input row deinterleaved per block (see `avx512::deinterleave`). Shapes: xs, xd `[n, cols]`.
#[cfg(target_arch = "x86_64")]
fn deinterleave_all(xs: &[f32], cols: usize, xd: &mut Vec<f32>) {
    xd.resize(xs.len(), 0.0);
    for (x, d) in xs.chunks_exact(cols).zip(xd.chunks_exact_mut(cols)) {
        crate::avx512::deinterleave(x, d);
    }
}

/// `[rows, n]` into `[n, rows]`.
#[cfg(target_arch = "x86_64")]
fn transpose_into(staged: &[f32], rows: usize, n: usize, out: &mut [f32]) {
    for r in 0..rows {
        for t in 0..n {
            out[t * rows + r] = staged[r * n + t];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mxfp4::mxfp4_matvec;

    use crate::testdata::bytes;

    fn scales(n: usize, seed: u64) -> Vec<u8> {
        crate::testdata::scales(n, seed, 117, 8)
    }

    fn inputs(n: usize, cols: usize) -> Vec<f32> {
        (0..n * cols).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + (i % 3) as f32)).collect()
    }

    #[test]
    fn matmat_is_bit_identical_to_matvec_per_input() {
        // Batches below, at and above the group size, and a row with a huge scale (safe path).
        // The last shape is large enough to be split over the thread pool.
        for (rows, cols, n) in [(40, 64, 2), (33, 96, 8), (70, 128, 11), (5, 32, 3), (512, 1024, 9)] {
            let p = bytes(rows * cols / 2, 1);
            let mut s = scales(rows * cols / 32, 2);
            s[0] = 230;
            let xs = inputs(n, cols);
            let mut got = vec![0f32; n * rows];
            mxfp4_matmat(&p, &s, rows, cols, &xs, n, &mut got);
            for t in 0..n {
                let mut want = vec![0f32; rows];
                mxfp4_matvec(&p, &s, rows, cols, &xs[t * cols..(t + 1) * cols], &mut want);
                let same = want.iter().zip(&got[t * rows..(t + 1) * rows]).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "rows {rows} cols {cols} n {n} input {t}");
            }
        }
        if Path::best() != Path::Avx512 {
            println!("SKIPPED batched AVX-512 path: this CPU lacks it (the per-input loop was tested)");
        }
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
    }
}
