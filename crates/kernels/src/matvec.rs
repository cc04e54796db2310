//! Dense matrix-vector products over the spine's storage formats (f32, bf16, int8 + scales).
//!
//! All take a row-major `[rows, cols]` weight and compute `out[r] = sum_c W[r, c] * x[c]` with f32
//! accumulation. Several independent accumulators let the compiler vectorise the inner loop.

use half::bf16;

use crate::cpu::Path;

const LANES: usize = 8;

#[inline(always)]
fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = w.len() / LANES;
    for i in 0..chunks {
        for l in 0..LANES {
            acc[l] += w[i * LANES + l] * x[i * LANES + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * LANES..w.len() {
        s += w[i] * x[i];
    }
    s
}

/// Shapes: w `[rows, cols]`, x `[cols]`, out `[rows]`.
#[inline(always)]
fn f32_body(w: &[f32], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    assert_eq!(w.len(), rows * cols);
    assert_eq!(x.len(), cols);
    assert_eq!(out.len(), rows);
    for (r, o) in out.iter_mut().enumerate() {
        *o = dot_f32(&w[r * cols..(r + 1) * cols], x);
    }
}

/// bf16 weights (raw u16 bits), widened exactly to f32. Shapes as [`f32_matvec`].
#[inline(always)]
fn bf16_body(w: &[u16], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    assert_eq!(w.len(), rows * cols);
    assert_eq!(x.len(), cols);
    assert_eq!(out.len(), rows);
    for (r, o) in out.iter_mut().enumerate() {
        let row = &w[r * cols..(r + 1) * cols];
        let mut acc = [0.0f32; LANES];
        let chunks = cols / LANES;
        for i in 0..chunks {
            for l in 0..LANES {
                acc[l] += bf16::from_bits(row[i * LANES + l]).to_f32() * x[i * LANES + l];
            }
        }
        let mut s: f32 = acc.iter().sum();
        for i in chunks * LANES..cols {
            s += bf16::from_bits(row[i]).to_f32() * x[i];
        }
        *o = s;
    }
}

/// int8 weights with one f32 scale per `group` consecutive elements of a row (`group == cols` is
/// per-row scaling). Shapes: q `[rows, cols]`, scales `[rows, cols/group]`, x `[cols]`, out `[rows]`.
#[inline(always)]
fn int8_body(q: &[i8], scales: &[f32], group: usize, rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    assert!(group > 0 && cols.is_multiple_of(group), "int8 group must divide the row");
    assert_eq!(q.len(), rows * cols);
    assert_eq!(scales.len(), rows * (cols / group));
    assert_eq!(x.len(), cols);
    assert_eq!(out.len(), rows);
    let groups = cols / group;
    for (r, o) in out.iter_mut().enumerate() {
        let row = &q[r * cols..(r + 1) * cols];
        let srow = &scales[r * groups..(r + 1) * groups];
        let mut total = 0.0f32;
        for (g, &s) in srow.iter().enumerate() {
            let qg = &row[g * group..(g + 1) * group];
            let xg = &x[g * group..(g + 1) * group];
            let mut acc = [0.0f32; LANES];
            let chunks = group / LANES;
            for i in 0..chunks {
                for l in 0..LANES {
                    acc[l] += qg[i * LANES + l] as f32 * xg[i * LANES + l];
                }
            }
            let mut sum: f32 = acc.iter().sum();
            for i in chunks * LANES..group {
                sum += qg[i] as f32 * xg[i];
            }
            total += sum * s;
        }
        *o = total;
    }
}

// The bodies above are written with independent lane accumulators so the compiler vectorises
// them; each public entry point compiles the same body a second time with AVX2 enabled and
// picks it at run time. The plain instantiation is the scalar oracle.
use crate::dispatch::dispatch;

dispatch!(f32_matvec, f32_matvec_scalar, f32_avx2, f32_body, (w: &[f32], rows: usize, cols: usize, x: &[f32], out: &mut [f32]));
dispatch!(bf16_matvec, bf16_matvec_scalar, bf16_avx2, bf16_body, (w: &[u16], rows: usize, cols: usize, x: &[f32], out: &mut [f32]));
dispatch!(int8_matvec_avx2_or_scalar, int8_matvec_scalar, int8_avx2, int8_body, (q: &[i8], scales: &[f32], group: usize, rows: usize, cols: usize, x: &[f32], out: &mut [f32]));

/// int8 mat-vec, run-time dispatched: AVX-512 when the CPU has it and the scale group is a
/// multiple of 16, else the AVX2 instantiation, else scalar.
pub fn int8_matvec(q: &[i8], scales: &[f32], group: usize, rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    if !int8_matvec_on(Path::Avx512, q, scales, group, rows, cols, x, out)
        && !int8_matvec_on(Path::Neon, q, scales, group, rows, cols, x, out)
    {
        int8_matvec_avx2_or_scalar(q, scales, group, rows, cols, x, out)
    }
}

/// Run one specific implementation; false (doing nothing) when the CPU or the shape rules it out.
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
) -> bool {
    if !path.available() {
        return false;
    }
    match path {
        Path::Scalar => int8_matvec_scalar(q, scales, group, rows, cols, x, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2+FMA present (checked above).
        Path::Avx2 => unsafe { int8_avx2(q, scales, group, rows, cols, x, out) },
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => {
            if group == 0 || !group.is_multiple_of(16) {
                return false;
            }
            check_int8(q, scales, group, rows, cols, x, out);
            // SAFETY: AVX-512F/BW present (checked above); shapes and group checked.
            unsafe { crate::avx512::int8_matvec_avx512(q, scales, group, rows, cols, x, out) }
        }
        #[cfg(target_arch = "aarch64")]
        Path::Neon => {
            if group == 0 || !group.is_multiple_of(16) {
                return false;
            }
            check_int8(q, scales, group, rows, cols, x, out);
            // SAFETY: NEON present (checked above); shapes and group checked.
            unsafe { crate::neon::int8_matvec_neon(q, scales, group, rows, cols, x, out) }
        }
        // Paths of another architecture are never available (returned above).
        _ => return false,
    }
    true
}

fn check_int8(q: &[i8], scales: &[f32], group: usize, rows: usize, cols: usize, x: &[f32], out: &[f32]) {
    assert!(group > 0 && cols.is_multiple_of(group), "int8 group must divide the row");
    assert_eq!(q.len(), rows * cols);
    assert_eq!(scales.len(), rows * (cols / group));
    assert_eq!(x.len(), cols);
    assert_eq!(out.len(), rows);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(w: &[f32], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
        (0..rows).map(|r| (0..cols).map(|c| w[r * cols + c] * x[c]).sum()).collect()
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
            f32_matvec_scalar(&w, rows, cols, &x, &mut b);
            assert_eq!(a, b, "same lane order, same result");
            let wb: Vec<u16> = w.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
            bf16_matvec(&wb, rows, cols, &x, &mut a);
            bf16_matvec_scalar(&wb, rows, cols, &x, &mut b);
            assert_eq!(a, b);
            let q: Vec<i8> = w.iter().map(|&v| (v * 80.0).clamp(-127.0, 127.0) as i8).collect();
            let s = vec![0.0125f32; rows];
            int8_matvec_avx2_or_scalar(&q, &s, cols, rows, cols, &x, &mut a);
            int8_matvec_scalar(&q, &s, cols, rows, cols, &x, &mut b);
            assert_eq!(a, b);
        }
    }

    /// The AVX-512 and NEON int8 kernels against the scalar oracle (different summation order:
    /// bounded by a few ulps of the sum of |w x|), per-row and grouped scales, extreme values.
    #[test]
    fn int8_simd_matches_oracle() {
        for path in [Path::Avx512, Path::Neon] {
            if path.available() {
                int8_path_matches_oracle(path);
            } else {
                println!("SKIPPED {path:?}: this CPU lacks it");
            }
        }
    }

    fn int8_path_matches_oracle(path: Path) {
        for &(rows, cols, group) in &[(3, 16, 16), (7, 64, 32), (5, 7168, 7168), (9, 1024, 64)] {
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
            assert!(int8_matvec_on(path, &q, &s, group, rows, cols, &x, &mut a));
            int8_matvec_scalar(&q, &s, group, rows, cols, &x, &mut b);
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
        // A group that is not a multiple of 16 is refused, not mis-computed.
        let (q, s, x) = (vec![1i8; 24], vec![1.0f32; 2], vec![1.0f32; 24]);
        assert!(!int8_matvec_on(path, &q, &s, 12, 1, 24, &x, &mut [0.0]));
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
}
