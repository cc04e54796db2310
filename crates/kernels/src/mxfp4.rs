//! Layer 4, operation: MXFP4 matrix-vector and small-batch matrix-matrix products. Imports
//! `format`, `cpu`, `par`, `scalar` and `isa`.
//!
//! Each product comes as `op_on(path, ..)` (run `path`'s kernel; the scalar one where this CPU
//! lacks `path` or `path` has none) and `op(..)` = `op_on(Path::best(), ..)`. Layout and shapes:
//! [`crate::format`]. The batched forms (prompt processing) decode each weight block once and apply
//! it to every input; per input, the arithmetic and its order are exactly those of the single-input
//! kernel on the same path, so a chunked prompt stays bit-identical to feeding its tokens one at a
//! time. Paths without a batched kernel loop over the inputs.

use crate::cpu::Path;
use crate::format::{BLOCK, check_matmat_shapes, check_matvec_shapes};
#[cfg(target_arch = "aarch64")]
use crate::isa::neon;
#[cfg(target_arch = "x86_64")]
use crate::isa::{avx2_tile, avx512_tile, staging};
use crate::par::par_rows;
#[cfg(target_arch = "x86_64")]
use crate::par::par_rows_wide;
use crate::scalar;

/// `out[r] = sum_c W[r, c] * x[c]` for an MXFP4 matrix. `cols` must be a multiple of 32.
///
/// Shapes: packed `[rows, cols/2]`, scales `[rows, cols/32]`, x `[cols]`, out `[rows]`.
/// Runs the fastest path the CPU has; `scalar::mxfp4_matvec` is the oracle.
pub fn mxfp4_matvec(packed: &[u8], scales: &[u8], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    mxfp4_matvec_on(Path::best(), packed, scales, rows, cols, x, out);
}

/// [`mxfp4_matvec`] on `path` (scalar where this CPU lacks it).
pub fn mxfp4_matvec_on(path: Path, packed: &[u8], scales: &[u8], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    check_matvec_shapes(packed, scales, rows, cols, x, out);
    match path.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        p @ (Path::Avx512 | Path::Avx2) => staging::with_deinterleaved(x, |xd| {
            // SAFETY: `p` is an available x86 tile path, and the shapes were checked.
            unsafe { x86_rows(p, packed, scales, rows, cols, xd, 1, out) }
        }),
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON present (an available path), and the shapes were checked.
        Path::Neon => unsafe { neon::mxfp4_matvec(packed, scales, rows, cols, x, out) },
        _ => scalar::mxfp4_matvec(packed, scales, rows, cols, x, out),
    }
}

/// [`mxfp4_matvec`] with its rows split over the thread pool (bit-identical to it).
pub fn mxfp4_matvec_par(packed: &[u8], scales: &[u8], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    mxfp4_matvec_par_on(Path::best(), packed, scales, rows, cols, x, out);
}

/// [`mxfp4_matvec_par`] on `path` (bit-identical to [`mxfp4_matvec_on`] on the same path).
pub fn mxfp4_matvec_par_on(
    path: Path,
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    out: &mut [f32],
) {
    check_matvec_shapes(packed, scales, rows, cols, x, out);
    let (half, nb) = (cols / 2, cols / BLOCK);
    match path.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        // Deinterleave once on this thread; every row chunk reads the same copy.
        p @ (Path::Avx512 | Path::Avx2) => staging::with_deinterleaved(x, |xd| {
            par_rows(rows, cols, out, |r0, o| {
                let n = o.len();
                // SAFETY: `p` is an available x86 tile path, and the shapes were checked.
                unsafe {
                    x86_rows(p, &packed[r0 * half..(r0 + n) * half], &scales[r0 * nb..(r0 + n) * nb], n, cols, xd, 1, o)
                }
            })
        }),
        p => par_rows(rows, cols, out, |r0, o| {
            let n = o.len();
            mxfp4_matvec_on(p, &packed[r0 * half..(r0 + n) * half], &scales[r0 * nb..(r0 + n) * nb], n, cols, x, o)
        }),
    }
}

/// `out[t, r] = sum_c W[r, c] * xs[t, c]` for `t < n`, rows split over the thread pool.
/// Shapes: xs `[n, cols]` row-major, out `[n, rows]`; per input bit-identical to
/// [`mxfp4_matvec`].
pub fn mxfp4_matmat(packed: &[u8], scales: &[u8], rows: usize, cols: usize, xs: &[f32], n: usize, out: &mut [f32]) {
    mxfp4_matmat_on(Path::best(), packed, scales, rows, cols, xs, n, out);
}

/// [`mxfp4_matmat`] on `path` (a loop over [`mxfp4_matvec_par_on`] where `path` has no batched
/// kernel).
#[allow(clippy::too_many_arguments)]
pub fn mxfp4_matmat_on(
    path: Path,
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    xs: &[f32],
    n: usize,
    out: &mut [f32],
) {
    check_matmat_shapes(packed, scales, rows, cols, xs, n, out);
    match path.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        p @ (Path::Avx512 | Path::Avx2) if n > 1 => {
            staging::with_batch_staging(xs, cols, rows, n, out, |xd, staged| {
                let (half, nb) = (cols / 2, cols / BLOCK);
                par_rows_wide(rows, cols * n, n, staged, |r0, o| {
                    let m = o.len() / n;
                    // SAFETY: `p` is an available x86 tile path; shapes checked above.
                    unsafe {
                        x86_rows(
                            p,
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
            })
        }
        #[cfg(target_arch = "aarch64")]
        Path::Neon if n > 1 => crate::par::with_staged_rows(rows, n, out, |staged| {
            let (half, nb) = (cols / 2, cols / BLOCK);
            crate::par::par_rows_wide(rows, cols * n, n, staged, |r0, o| {
                let m = o.len() / n;
                // SAFETY: NEON present (an available path); shapes checked above.
                unsafe {
                    neon::mxfp4_rows_batch(
                        &packed[r0 * half..(r0 + m) * half],
                        &scales[r0 * nb..(r0 + m) * nb],
                        m,
                        cols,
                        xs,
                        n,
                        o,
                    )
                }
            });
        }),
        p => {
            for t in 0..n {
                let (x, o) = (&xs[t * cols..(t + 1) * cols], &mut out[t * rows..(t + 1) * rows]);
                mxfp4_matvec_par_on(p, packed, scales, rows, cols, x, o);
            }
        }
    }
}

/// The MXFP4 tile kernel of an x86 path over deinterleaved inputs: `out [rows, n]`.
///
/// # Safety
/// `path` is [`Path::Avx512`] or [`Path::Avx2`] and available on this CPU; shapes as
/// [`avx512_tile::mxfp4_rows`] (which both kernels assert).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn x86_rows(
    path: Path,
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    xd: &[f32],
    n: usize,
    out: &mut [f32],
) {
    debug_assert!(matches!(path, Path::Avx512 | Path::Avx2) && path.available());
    // SAFETY: the caller's guarantee: the path's features are present.
    unsafe {
        match path {
            Path::Avx512 => avx512_tile::mxfp4_rows(packed, scales, rows, cols, xd, n, out),
            _ => avx2_tile::mxfp4_rows(packed, scales, rows, cols, xd, n, out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::mxfp4_decode_row;
    use crate::testdata::bytes;

    /// Every path the CPU has against the scalar oracle: random shapes, all nibbles, scale edges.
    #[test]
    fn simd_matches_scalar_oracle() {
        for path in [Path::Avx2, Path::Avx512, Path::Neon] {
            if path.available() {
                simd_path_matches_oracle(path);
                println!("{path:?}: checked against the scalar oracle");
            } else {
                println!("SKIPPED {path:?}: this CPU lacks it");
            }
        }
    }

    fn simd_path_matches_oracle(path: Path) {
        let mut seed = 0x1234_5678_u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for &(rows, cols) in &[(1, 32), (3, 64), (17, 96), (64, 3584), (5, 3072)] {
            let packed: Vec<u8> = (0..rows * cols / 2).map(|_| next() as u8).collect();
            for scale_range in [(120u8, 8u8), (0, 3), (250, 5)] {
                let scales: Vec<u8> =
                    (0..rows * cols / 32).map(|_| scale_range.0 + (next() % scale_range.1 as u64) as u8).collect();
                let x: Vec<f32> = (0..cols).map(|_| ((next() % 2001) as f32 - 1000.0) / 1000.0).collect();
                let (mut a, mut b) = (vec![0f32; rows], vec![0f32; rows]);
                mxfp4_matvec_on(path, &packed, &scales, rows, cols, &x, &mut a);
                scalar::mxfp4_matvec(&packed, &scales, rows, cols, &x, &mut b);
                for (r, (u, v)) in a.iter().zip(&b).enumerate() {
                    // Reordered f32 sums differ by at most a few ulps of the sum of |w x|.
                    let mut row = vec![0f32; cols];
                    mxfp4_decode_row(
                        &packed[r * cols / 2..(r + 1) * cols / 2],
                        &scales[r * cols / 32..(r + 1) * cols / 32],
                        &mut row,
                    );
                    let mag: f64 = row.iter().zip(&x).map(|(w, x)| (*w as f64 * *x as f64).abs()).sum();
                    let same = u == v || (u.is_nan() && v.is_nan());
                    assert!(
                        same || ((u - v).abs() as f64) <= 1e-5 * mag,
                        "{rows}x{cols} row {r}: {u} vs {v} (sum |wx| {mag})"
                    );
                }
            }
        }
    }

    /// Row-parallel and serial products are bit-identical (same kernel per row).
    #[test]
    fn parallel_rows_match_serial_bit_for_bit() {
        let (rows, cols) = (700, 1024); // above the parallel threshold, uneven chunks
        let packed: Vec<u8> = (0..rows * cols / 2).map(|i| (i * 131 + 7) as u8).collect();
        let scales: Vec<u8> = (0..rows * cols / 32).map(|i| 118 + (i % 7) as u8).collect();
        let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.013).cos()).collect();
        let (mut a, mut b) = (vec![0f32; rows], vec![0f32; rows]);
        mxfp4_matvec_par(&packed, &scales, rows, cols, &x, &mut a);
        mxfp4_matvec(&packed, &scales, rows, cols, &x, &mut b);
        assert!(a.iter().zip(&b).all(|(u, v)| u.to_bits() == v.to_bits()));
    }

    #[test]
    fn matvec_matches_decoded_rows() {
        let rows = 3;
        let cols = 64;
        let packed: Vec<u8> = (0..rows * cols / 2).map(|i| (i * 37 + 11) as u8).collect();
        let scales: Vec<u8> = (0..rows * cols / 32).map(|i| 120 + (i as u8 % 9)).collect();
        let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut out = vec![0f32; rows];
        mxfp4_matvec(&packed, &scales, rows, cols, &x, &mut out);
        for r in 0..rows {
            let mut row = vec![0f32; cols];
            mxfp4_decode_row(&packed[r * 32..(r + 1) * 32], &scales[r * 2..(r + 1) * 2], &mut row);
            let want: f64 = row.iter().zip(&x).map(|(&w, &v)| w as f64 * v as f64).sum();
            assert!((out[r] as f64 - want).abs() < 1e-4 * want.abs().max(1.0));
        }
    }

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
        // Row counts past the 48-row cache block and off the 3- and 8-row tiles; input counts that
        // split into unequal groups (14 = 5 + 5 + 4, 17 = 5 + 4 + 4 + 4); 51 rows end the one-input
        // path with its 3-row tile (48 + 3).
        for (rows, cols, n) in [
            (40, 64, 2),
            (33, 96, 8),
            (70, 128, 11),
            (5, 32, 3),
            (512, 1024, 9),
            (50, 64, 14),
            (101, 32, 17),
            (51, 64, 6),
        ] {
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
        match Path::best() {
            Path::Avx512 | Path::Avx2 | Path::Neon => println!("batched {:?} kernel tested", Path::best()),
            _ => println!("SKIPPED batched kernels: this CPU has no SIMD path (the per-input loop was tested)"),
        }
    }

    /// A path this CPU lacks runs the scalar kernel: `op_on` never executes an unsupported
    /// instruction set.
    #[test]
    fn unavailable_paths_run_the_scalar_kernel() {
        let (rows, cols, n) = (9, 96, 3);
        let (p, s, xs) = (bytes(rows * cols / 2, 21), scales(rows * cols / 32, 22), inputs(n, cols));
        let mut want = vec![0f32; n * rows];
        for t in 0..n {
            scalar::mxfp4_matvec(
                &p,
                &s,
                rows,
                cols,
                &xs[t * cols..(t + 1) * cols],
                &mut want[t * rows..(t + 1) * rows],
            );
        }
        for path in Path::ALL.into_iter().filter(|p| !p.available()) {
            let (mut a, mut b, mut c) = (vec![0f32; rows], vec![0f32; rows], vec![0f32; n * rows]);
            mxfp4_matvec_on(path, &p, &s, rows, cols, &xs[..cols], &mut a);
            mxfp4_matvec_par_on(path, &p, &s, rows, cols, &xs[..cols], &mut b);
            mxfp4_matmat_on(path, &p, &s, rows, cols, &xs, n, &mut c);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&want[..rows]), "{path:?}");
            assert_eq!(bits(&b), bits(&want[..rows]), "{path:?}");
            assert_eq!(bits(&c), bits(&want), "{path:?}");
            println!("{path:?}: this CPU lacks it, the scalar kernel ran");
        }
    }
}
