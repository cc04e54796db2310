//! Layer 4, operation: dense matrix-vector products over the spine's storage formats (f32, bf16,
//! int8 + scales). Imports `cpu`, `scalar` and `isa`.
//!
//! All take a row-major `[rows, cols]` weight and compute `out[r] = sum_c W[r, c] * x[c]` with f32
//! accumulation. The scalar twins are written with independent lane accumulators; `isa::avx2`
//! compiles them again with AVX2 enabled (bit-identical), which AVX2 and AVX-512 CPUs run. int8
//! has its own AVX-512 and NEON kernels for scale groups that are a multiple of 16.

use crate::cpu::Path;
use crate::format::Dense;
#[cfg(target_arch = "aarch64")]
use crate::isa::neon;
#[cfg(target_arch = "x86_64")]
use crate::isa::{avx2, avx2_tile, avx512, avx512_tile};
use crate::scalar;

/// f32 weights on the best path. Shapes: w `[rows, cols]`, x `[cols]`, out `[rows]`.
pub fn f32_matvec(w: &[f32], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    f32_matvec_on(Path::best(), w, rows, cols, x, out);
}

/// [`f32_matvec`] on `path` (the AVX2 instantiation on AVX2 and AVX-512, else scalar).
pub fn f32_matvec_on(path: Path, w: &[f32], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    match path.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and FMA present (an available path; AVX-512 implies them).
        Path::Avx512 | Path::Avx2 => unsafe { avx2::f32_matvec(w, rows, cols, x, out) },
        _ => scalar::f32_matvec(w, rows, cols, x, out),
    }
}

/// bf16 weights (raw u16 bits), widened exactly to f32, on the best path. Shapes as
/// [`f32_matvec`].
pub fn bf16_matvec(w: &[u16], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    bf16_matvec_on(Path::best(), w, rows, cols, x, out);
}

/// [`bf16_matvec`] on `path`: AVX-512 and NEON kernels (the bf16-to-f32 widening is a shift);
/// the AVX2 instantiation of the scalar twin on AVX2; else scalar.
pub fn bf16_matvec_on(path: Path, w: &[u16], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    assert!(w.len() == rows * cols && x.len() == cols && out.len() == rows, "bf16 matvec shapes");
    match path.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F present (an available path); shapes checked above.
        Path::Avx512 => unsafe { avx512::bf16_matvec(w, rows, cols, x, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and FMA present (an available path).
        Path::Avx2 => unsafe { avx2::bf16_matvec(w, rows, cols, x, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON present (an available path); shapes checked above.
        Path::Neon => unsafe { neon::bf16_matvec(w, rows, cols, x, out) },
        _ => scalar::bf16_matvec(w, rows, cols, x, out),
    }
}

/// int8 weights with one f32 scale per `group` consecutive elements of a row (`group == cols` is
/// per-row scaling), on the best path. Shapes: q `[rows, cols]`, scales `[rows, cols/group]`,
/// x `[cols]`, out `[rows]`.
pub fn int8_matvec(q: &[i8], scales: &[f32], group: usize, rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    int8_matvec_on(Path::best(), q, scales, group, rows, cols, x, out);
}

/// [`int8_matvec`] on `path`. The AVX-512 and NEON kernels need a scale group that is a multiple
/// of 16 and the AVX2 tiles one of 8; for other groups x86 falls back to the AVX2 instantiation of
/// the scalar twin and NEON to scalar.
#[allow(clippy::too_many_arguments)]
pub fn int8_matvec_on(
    path: Path,
    q: &[i8],
    scales: &[f32],
    group: usize,
    rows: usize,
    cols: usize,
    x: &[f32],
    out: &mut [f32],
) {
    match path.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 if group != 0 && group.is_multiple_of(16) => {
            check_int8(q, scales, group, rows, cols, x, out);
            // SAFETY: AVX-512F/BW present (an available path); shapes and group checked. The
            // tiles of eight rows give the one-row kernel's bits (its oracle in the tests).
            unsafe { avx512_tile::int8_rows(q, scales, group, rows, cols, x, 1, out, rows) }
        }
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 | Path::Avx2 if group != 0 && group.is_multiple_of(8) => {
            check_int8(q, scales, group, rows, cols, x, out);
            // SAFETY: AVX2 and FMA present (an available path; AVX-512 implies them); shapes and
            // group checked.
            unsafe { avx2_tile::int8_rows(q, scales, group, rows, cols, x, 1, out, rows) }
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and FMA present (an available path; AVX-512 implies them).
        Path::Avx512 | Path::Avx2 => unsafe { avx2::int8_matvec(q, scales, group, rows, cols, x, out) },
        #[cfg(target_arch = "aarch64")]
        Path::Neon if group != 0 && group.is_multiple_of(16) => {
            check_int8(q, scales, group, rows, cols, x, out);
            // SAFETY: NEON present (an available path); shapes and group checked.
            unsafe { neon::int8_matvec(q, scales, group, rows, cols, x, out) }
        }
        _ => scalar::int8_matvec(q, scales, group, rows, cols, x, out),
    }
}

/// [`int8_matvec`] for `n` inputs `xs` `[n, cols]`: `out[j * stride + r] = (W xs[j])[r]`. On
/// AVX-512 (group a multiple of 16) tiles of four rows and three inputs share each widened
/// weight chunk and each input load ([`avx512_tile::int8_rows`]), on AVX2 (group a multiple of
/// 8) likewise ([`avx2_tile::int8_rows`]); other paths run [`int8_matvec_on`] per input. Per
/// input bit-identical to [`int8_matvec_on`] on the same path.
#[allow(clippy::too_many_arguments)]
pub fn int8_matvec_multi_on(
    path: Path,
    q: &[i8],
    scales: &[f32],
    group: usize,
    rows: usize,
    cols: usize,
    xs: &[f32],
    n: usize,
    out: &mut [f32],
    stride: usize,
) {
    assert!(xs.len() >= n * cols && stride >= rows);
    assert!(n == 0 || out.len() >= (n - 1) * stride + rows);
    // Inputs the tiled kernel took (all of them, or none).
    let tiled = {
        #[cfg(target_arch = "x86_64")]
        if n == 0 {
            0
        } else if path.or_scalar() == Path::Avx512 && group != 0 && group.is_multiple_of(16) {
            check_int8(q, scales, group, rows, cols, &xs[..cols], &out[..rows]);
            // SAFETY: AVX-512F/BW present (an available path); shapes, group and the output span
            // checked above (and again by the kernel).
            unsafe { avx512_tile::int8_rows(q, scales, group, rows, cols, xs, n, out, stride) };
            n
        } else if matches!(path.or_scalar(), Path::Avx512 | Path::Avx2) && group != 0 && group.is_multiple_of(8) {
            check_int8(q, scales, group, rows, cols, &xs[..cols], &out[..rows]);
            // SAFETY: AVX2 and FMA present (an available path; AVX-512 implies them); shapes,
            // group and the output span checked above (and again by the kernel).
            unsafe { avx2_tile::int8_rows(q, scales, group, rows, cols, xs, n, out, stride) };
            n
        } else {
            0
        }
        #[cfg(not(target_arch = "x86_64"))]
        0
    };
    for j in tiled..n {
        int8_matvec_on(
            path,
            q,
            scales,
            group,
            rows,
            cols,
            &xs[j * cols..(j + 1) * cols],
            &mut out[j * stride..j * stride + rows],
        );
    }
}

/// [`int8_matvec_multi_on`] on the best path.
#[allow(clippy::too_many_arguments)]
pub fn int8_matvec_multi(
    q: &[i8],
    scales: &[f32],
    group: usize,
    rows: usize,
    cols: usize,
    xs: &[f32],
    n: usize,
    out: &mut [f32],
    stride: usize,
) {
    int8_matvec_multi_on(Path::best(), q, scales, group, rows, cols, xs, n, out, stride);
}

/// `outs[t] = W xs[t]` for a prompt chunk of `n` inputs, the inputs split over the thread pool:
/// a block of rows small enough to stay in the core's L2 cache (about 128 KiB of weights) is
/// applied to every input of a thread's share before the next block is read, so the matrix
/// comes from memory once per share instead of once per input. Per input bit-identical to
/// [`int8_matvec`]. Shapes: q `[rows, cols]`, scales `[rows, cols/group]`, xs `[n, cols]`, outs
/// `[n, rows]`.
#[allow(clippy::too_many_arguments)]
pub fn int8_matmat(
    q: &[i8],
    scales: &[f32],
    group: usize,
    rows: usize,
    cols: usize,
    xs: &[f32],
    n: usize,
    outs: &mut [f32],
) {
    assert!(group != 0 && cols.is_multiple_of(group));
    assert!(q.len() >= rows * cols && scales.len() >= rows * (cols / group));
    assert!(xs.len() >= n * cols && outs.len() == n * rows);
    if rows == 0 || n == 0 {
        return;
    }
    let g = cols / group;
    // About 128 KiB of weights, rounded up to a multiple of four rows (the AVX-512 tile's
    // height) where a row is shorter than 32 KiB; AVX2's blocked product takes all rows at once
    // (it blocks rows, columns and inputs itself).
    let blocked = {
        #[cfg(target_arch = "x86_64")]
        {
            Path::best() == Path::Avx2
                && group.is_multiple_of(8)
                && crate::par::input_share(rows, cols, n) >= crate::isa::avx2_gemm::MIN_INPUTS
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    };
    let block = if blocked { rows } else { ((128 << 10) / cols.max(1)).next_multiple_of(4) };
    crate::par::by_input_shares(rows, cols, n, block, outs, |t0, n_tok, r0, m, o| {
        let (qb, sb) = (&q[r0 * cols..(r0 + m) * cols], &scales[r0 * g..(r0 + m) * g]);
        int8_matvec_multi(qb, sb, group, m, cols, &xs[t0 * cols..(t0 + n_tok) * cols], n_tok, o, rows);
    });
}

/// The transposed product `out[m] = xs[m]^T W` for `n` inputs on the best path (MLA's key
/// absorption: every head's query against its key rows). Per output `acc = fma(x, w, acc)` over
/// the rows in order from zero, on every path, so all paths and every way of splitting the inputs
/// give the same bits (see [`scalar::vecmat`]). Shapes: w `[rows, cols]`, xs `[n, x_stride]`
/// (first `rows` read), out `[n, out_stride]` (first `cols` written).
#[allow(clippy::too_many_arguments)]
pub fn vecmat(
    w: Dense,
    rows: usize,
    cols: usize,
    xs: &[f32],
    x_stride: usize,
    n: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    vecmat_on(Path::best(), w, rows, cols, xs, x_stride, n, out, out_stride);
}

/// [`vecmat`] on `path`: AVX2's tiles on AVX2 and AVX-512 (an int8 scale group not a multiple of
/// 8 runs scalar), NEON's on NEON, else the scalar twin.
#[allow(clippy::too_many_arguments)]
pub fn vecmat_on(
    path: Path,
    w: Dense,
    rows: usize,
    cols: usize,
    xs: &[f32],
    x_stride: usize,
    n: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    assert!(w.holds(rows, cols), "vecmat weight shape");
    assert!(x_stride >= rows && out_stride >= cols);
    if n == 0 {
        return;
    }
    assert!(xs.len() >= (n - 1) * x_stride + rows && out.len() >= (n - 1) * out_stride + cols);
    let grouped8 = match w {
        Dense::Int8 { group, .. } => group.is_multiple_of(8),
        _ => true,
    };
    match path.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and FMA present (an available path; AVX-512 implies them); shapes and
        // the int8 group checked above.
        Path::Avx512 | Path::Avx2 if grouped8 => unsafe {
            avx2::vecmat(w, rows, cols, xs, x_stride, n, out, out_stride)
        },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON present (an available path); shapes and the int8 group checked above.
        Path::Neon if grouped8 => unsafe { neon::vecmat(w, rows, cols, xs, x_stride, n, out, out_stride) },
        _ => scalar::vecmat(w, rows, cols, xs, x_stride, n, out, out_stride),
    }
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn check_int8(q: &[i8], scales: &[f32], group: usize, rows: usize, cols: usize, x: &[f32], out: &[f32]) {
    assert!(group > 0 && cols.is_multiple_of(group), "int8 group must divide the row");
    assert_eq!(q.len(), rows * cols);
    assert_eq!(scales.len(), rows * (cols / group));
    assert_eq!(x.len(), cols);
    assert_eq!(out.len(), rows);
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;

    fn naive(w: &[f32], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
        (0..rows).map(|r| (0..cols).map(|c| w[r * cols + c] * x[c]).sum()).collect()
    }

    /// Several inputs at once give, input by input, exactly the one-input kernel's result on
    /// every available path (AVX-512's tiles of 4 rows x 3 inputs and all their remainders
    /// included), on odd row counts, groups (an odd number of chunks per group too) and input counts.
    #[test]
    fn int8_multi_input_is_bit_identical_to_one_input() {
        for path in [Path::Avx512, Path::Avx2, Path::Neon, Path::Scalar] {
            if !path.available() {
                println!("SKIPPED: path {path:?} not available on this CPU");
                continue;
            }
            for &(rows, cols, group) in
                &[(1, 16, 16), (3, 64, 32), (7, 96, 48), (5, 160, 160), (4, 40, 8), (13, 48, 24)]
            {
                let q: Vec<i8> = (0..rows * cols).map(|i| ((i * 7919 % 255) as i32 - 127) as i8).collect();
                let s: Vec<f32> = (0..rows * cols / group).map(|i| 0.01 + i as f32 * 0.001).collect();
                for n in [1, 2, 3, 4, 5, 6, 7, 9, 13] {
                    let xs: Vec<f32> = (0..n * cols).map(|i| (i as f32 * 0.37).sin()).collect();
                    let stride = rows + 2;
                    let mut multi = vec![f32::NAN; n * stride];
                    int8_matvec_multi_on(path, &q, &s, group, rows, cols, &xs, n, &mut multi, stride);
                    for j in 0..n {
                        let mut one = vec![0f32; rows];
                        int8_matvec_on(path, &q, &s, group, rows, cols, &xs[j * cols..(j + 1) * cols], &mut one);
                        let got = &multi[j * stride..j * stride + rows];
                        assert!(
                            one.iter().zip(got).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{path:?} {rows}x{cols}/{group} input {j} of {n}: {one:?} vs {got:?}"
                        );
                    }
                }
            }
        }
    }

    /// AVX-512's one-input int8 product runs as tiles of eight rows (and 4, 3, 2, 1 for the rest);
    /// per output it gives exactly the one-row kernel's bits, which stays as its oracle.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn int8_avx512_row_tiles_match_the_one_row_kernel() {
        if !Path::Avx512.available() {
            println!("SKIPPED: path Avx512 not available on this CPU");
            return;
        }
        for rows in [1, 2, 5, 8, 9, 12, 17, 19, 31] {
            for &(cols, group) in &[(16, 16), (96, 48), (160, 160), (7168 / 8, 112)] {
                let q: Vec<i8> = (0..rows * cols).map(|i| ((i * 7919 % 255) as i32 - 127) as i8).collect();
                let s: Vec<f32> = (0..rows * cols / group).map(|i| 0.01 + i as f32 * 0.001).collect();
                let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
                let (mut want, mut got) = (vec![0f32; rows], vec![f32::NAN; rows]);
                // SAFETY: AVX-512 present (checked above); shapes as the kernel wants, group % 16 == 0.
                unsafe { crate::isa::avx512::int8_matvec(&q, &s, group, rows, cols, &x, &mut want) };
                int8_matvec_on(Path::Avx512, &q, &s, group, rows, cols, &x, &mut got);
                assert!(
                    want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{rows}x{cols}/{group}: {want:?} vs {got:?}"
                );
            }
        }
    }

    /// A prompt chunk's product on a pool of three threads, with inputs that split unevenly
    /// (7 = 3 + 3 + 1) and rows that end in a partial cache block (90 = 32 + 32 + 26), gives per
    /// input exactly the one-input kernel's bits.
    #[test]
    fn int8_matmat_is_bit_identical_per_input_on_three_threads() {
        let (rows, cols, group, n) = (90, 4096, 512, 7);
        assert!(rows * cols >= crate::par::PAR_MIN_WEIGHTS, "large enough to run in parallel");
        let q: Vec<i8> = (0..rows * cols).map(|i| ((i * 7919 % 255) as i32 - 127) as i8).collect();
        let s: Vec<f32> = (0..rows * cols / group).map(|i| 0.01 + i as f32 * 0.001).collect();
        let xs: Vec<f32> = (0..n * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut got = vec![f32::NAN; n * rows];
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        pool.install(|| int8_matmat(&q, &s, group, rows, cols, &xs, n, &mut got));
        for j in 0..n {
            let mut one = vec![0f32; rows];
            int8_matvec(&q, &s, group, rows, cols, &xs[j * cols..(j + 1) * cols], &mut one);
            let same = one.iter().zip(&got[j * rows..(j + 1) * rows]).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "input {j} of {n}");
        }
    }

    /// The dispatched (vectorised) instantiations against the scalar ones, on odd shapes.
    #[test]
    fn dispatched_paths_match_scalar() {
        if !crate::cpu::has_avx2_fma() {
            println!("SKIPPED: this CPU has no AVX2+FMA path to test");
            return;
        }
        for &(rows, cols) in &[(1, 1), (3, 7), (9, 64), (5, 1000)] {
            let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 997) as f32 - 498.0) / 331.0).collect();
            let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.77).sin()).collect();
            let (mut a, mut b) = (vec![0f32; rows], vec![0f32; rows]);
            f32_matvec(&w, rows, cols, &x, &mut a);
            scalar::f32_matvec(&w, rows, cols, &x, &mut b);
            assert_eq!(a, b, "same lane order, same result");
            let wb: Vec<u16> = w.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
            bf16_matvec_on(Path::Avx2, &wb, rows, cols, &x, &mut a);
            scalar::bf16_matvec(&wb, rows, cols, &x, &mut b);
            assert_eq!(a, b);
            let q: Vec<i8> = w.iter().map(|&v| (v * 80.0).clamp(-127.0, 127.0) as i8).collect();
            let s = vec![0.0125f32; rows];
            if !cols.is_multiple_of(8) {
                // Groups the AVX2 tiles do not take run the instantiation (tiles: `int8_simd_matches_oracle`).
                int8_matvec_on(Path::Avx2, &q, &s, cols, rows, cols, &x, &mut a);
                scalar::int8_matvec(&q, &s, cols, rows, cols, &x, &mut b);
                assert_eq!(a, b);
            }
        }
    }

    /// The AVX-512, AVX2 and NEON int8 kernels against the scalar oracle (different summation
    /// order: bounded by a few ulps of the sum of |w x|), per-row and grouped scales, extreme
    /// values.
    #[test]
    fn int8_simd_matches_oracle() {
        for path in [Path::Avx512, Path::Avx2, Path::Neon] {
            if path.available() {
                int8_path_matches_oracle(path);
            } else {
                println!("SKIPPED {path:?}: this CPU lacks it");
            }
        }
    }

    /// The AVX-512 and NEON bf16 kernels against the scalar twin (another summation order and
    /// FMA: a few ulps of the sum of |w x|) on weights and inputs of order one, on shapes with
    /// and without a tail; then the widening alone, exact, on special values (signed zero, the
    /// smallest subnormal, the largest finite) in the vector body and in the tail.
    #[test]
    fn bf16_simd_matches_oracle() {
        for path in [Path::Avx512, Path::Neon] {
            if !path.available() {
                println!("SKIPPED {path:?}: this CPU lacks it");
                continue;
            }
            for &(rows, cols) in &[(1, 1), (3, 7), (4, 32), (5, 33), (7, 256), (3, 7168), (2, 1000)] {
                let w: Vec<u16> = (0..rows * cols)
                    .map(|i| bf16::from_f32(((i * 7919 % 997) as f32 - 498.0) / 331.0).to_bits())
                    .collect();
                let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.77).sin()).collect();
                let (mut a, mut b) = (vec![0f32; rows], vec![0f32; rows]);
                bf16_matvec_on(path, &w, rows, cols, &x, &mut a);
                scalar::bf16_matvec(&w, rows, cols, &x, &mut b);
                for r in 0..rows {
                    let mag: f64 =
                        (0..cols).map(|c| (bf16::from_bits(w[r * cols + c]).to_f64() * x[c] as f64).abs()).sum();
                    let err = (a[r] - b[r]).abs() as f64;
                    assert!(err <= 1e-5 * mag, "{path:?} {rows}x{cols} row {r}: {} vs {}", a[r], b[r]);
                }
            }
            for bits in [0x0000u16, 0x8000, 0x0001, 0x807f, 0x3f80, 0xbf80, 0x7f7f, 0xff7f, 0x4049] {
                let w = vec![bits; 40];
                // One input at 1 picks one weight: index 3 is in the 32- (or 16-) wide body, 37 in
                // the tail. The accumulators start at +0, so -0 comes out as +0 (0 + -0 = +0).
                for one in [3, 37] {
                    let mut x = vec![0.0f32; 40];
                    x[one] = 1.0;
                    let mut o = [f32::NAN];
                    bf16_matvec_on(path, &w, 1, 40, &x, &mut o);
                    let want = 0.0f32 + bf16::from_bits(bits).to_f32();
                    assert_eq!(o[0].to_bits(), want.to_bits(), "{path:?} {bits:#x} at {one}");
                }
            }
        }
    }

    fn int8_path_matches_oracle(path: Path) {
        for &(rows, cols, group) in
            &[(3, 16, 16), (7, 64, 32), (5, 7168, 7168), (9, 1024, 64), (17, 48, 24), (11, 40, 8)]
        {
            let q: Vec<i8> = (0..rows * cols)
                .map(|i| match i % 11 {
                    0 => 127,
                    1 => -127,
                    _ => ((i * 37) % 255) as i8,
                })
                .collect();
            let s: Vec<f32> = (0..rows * cols / group).map(|i| 1e-3 * (1 + i % 5) as f32).collect();
            let x: Vec<f32> = (0..cols).map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0).collect();
            let (mut a, mut b) = (vec![0f32; rows], vec![0f32; rows]);
            int8_matvec_on(path, &q, &s, group, rows, cols, &x, &mut a);
            scalar::int8_matvec(&q, &s, group, rows, cols, &x, &mut b);
            for r in 0..rows {
                let mag: f64 = (0..cols)
                    .map(|c| (q[r * cols + c] as f64 * s[(r * cols + c) / group] as f64 * x[c] as f64).abs())
                    .sum();
                assert!(
                    ((a[r] - b[r]).abs() as f64) <= 1e-5 * mag,
                    "{rows}x{cols}/{group} row {r}: {} vs {}",
                    a[r],
                    b[r]
                );
            }
        }
        // A group that is not a multiple of 16 (AVX-512, NEON) or 8 (AVX2) is not given to the
        // kernel (which would skip the group's last elements): it falls back and is exact.
        let (q, s, x) = (vec![1i8; 24], vec![1.0f32; 2], vec![1.0f32; 24]);
        let mut o = [0.0];
        int8_matvec_on(path, &q, &s, 12, 1, 24, &x, &mut o);
        assert_eq!(o, [24.0]);
    }

    #[test]
    fn formats_agree_with_naive() {
        let (rows, cols) = (5, 67); // a tail that is not a multiple of the lane count
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7 % 13) as f32 - 6.0) / 4.0).collect();
        let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.1).cos()).collect();
        let want = naive(&w, rows, cols, &x);
        let mut out = vec![0f32; rows];
        f32_matvec(&w, rows, cols, &x, &mut out);
        for (a, b) in out.iter().zip(&want) {
            assert!((a - b).abs() < 1e-4);
        }
        // These weights are exact in bf16 (few mantissa bits), so bf16 must agree too.
        let wb: Vec<u16> = w.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        bf16_matvec(&wb, rows, cols, &x, &mut out);
        for (a, b) in out.iter().zip(&want) {
            assert!((a - b).abs() < 1e-4);
        }
        // int8 with scale 0.25 represents w exactly.
        let q: Vec<i8> = w.iter().map(|&v| (v * 4.0) as i8).collect();
        let s = vec![0.25f32; rows];
        int8_matvec(&q, &s, cols, rows, cols, &x, &mut out);
        for (a, b) in out.iter().zip(&want) {
            assert!((a - b).abs() < 1e-4);
        }
    }

    /// The transposed product gives the scalar twin's bits on every available path, for every
    /// storage dtype (int8 per row, in groups of 8 and 32, and in groups of 5 that SIMD paths
    /// hand to the scalar twin), on column counts with and without a remainder, one to thirteen
    /// inputs, and strided inputs and outputs.
    #[test]
    fn vecmat_is_bit_identical_to_its_scalar_twin_on_every_path() {
        let mut tested = 0;
        for path in Path::ALL {
            if !path.available() {
                println!("SKIPPED: path {path:?} not available on this CPU");
                continue;
            }
            tested += 1;
            for &(rows, cols) in &[(128, 512), (7, 100), (3, 40), (1, 8)] {
                let wf: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 997) as f32 - 498.0) / 331.0).collect();
                let wb: Vec<u16> = wf.iter().map(|&v| crate::format::f32_to_bf16(v)).collect();
                let q: Vec<i8> = (0..rows * cols).map(|i| ((i * 7919 % 255) as i32 - 127) as i8).collect();
                let scales = |group: usize| -> Vec<f32> {
                    (0..rows * cols / group).map(|i| 0.01 + (i % 17) as f32 * 0.003).collect()
                };
                let groups: Vec<usize> = [cols, 8, 32, 5].into_iter().filter(|g| cols.is_multiple_of(*g)).collect();
                let s_all: Vec<(usize, Vec<f32>)> = groups.iter().map(|&g| (g, scales(g))).collect();
                let mut ws = vec![Dense::F32(&wf), Dense::Bf16(&wb)];
                ws.extend(s_all.iter().map(|(g, s)| Dense::Int8 { q: &q, scales: s, group: *g }));
                for w in ws {
                    for n in [1, 2, 5, 6, 7, 13] {
                        let (xst, ost) = (rows + 3, cols + 5);
                        let xs: Vec<f32> = (0..n * xst).map(|i| (i as f32 * 0.37).sin()).collect();
                        let mut got = vec![f32::NAN; n * ost];
                        let mut want = vec![f32::NAN; n * ost];
                        vecmat_on(path, w, rows, cols, &xs, xst, n, &mut got, ost);
                        scalar::vecmat(w, rows, cols, &xs, xst, n, &mut want, ost);
                        assert!(
                            got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{path:?} {rows}x{cols} n {n}"
                        );
                        // And it is the product it claims to be.
                        let naive: f32 = (0..rows).map(|r| xs[r] * w.at(cols, r, cols - 1)).sum();
                        assert!((want[cols - 1] - naive).abs() <= 1e-3 * (1.0 + naive.abs()));
                    }
                }
            }
        }
        assert!(tested >= 1);
    }
}
