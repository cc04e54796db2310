//! MXFP4 (OCP Microscaling) decode and matrix-vector product.
//!
//! Layout (compressed-tensors `mxfp4-pack-quantized`, as in Kimi K3): a `[rows, cols]` matrix is
//! stored as `packed: [rows, cols/2]` bytes, element `2j` in the LOW nibble of byte `j`, and
//! `scales: [rows, cols/32]` E8M0 bytes, one per block of 32 elements along a row.

use crate::cpu::Path;

/// E2M1 value of each nibble: sign bit 3, two exponent bits, one mantissa bit.
pub const E2M1_LUT: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// Elements per shared scale.
pub const BLOCK: usize = 32;

/// E8M0 scale byte to its value, 2^(e-127). 0xFF encodes NaN in the format; callers validate
/// scales when data enters the store, so here it simply decodes to NaN.
#[inline]
pub fn e8m0_to_f32(e: u8) -> f32 {
    if e == 0xFF {
        return f32::NAN;
    }
    // 2^(e-127) for e in 0..=254. e = 0 is 2^-127, a subnormal f32: build it from bits.
    if e == 0 { f32::from_bits(0x0040_0000) } else { f32::from_bits((e as u32) << 23) }
}

/// `out[r] = sum_c W[r, c] * x[c]` for an MXFP4 matrix. `cols` must be a multiple of 32.
///
/// Shapes: packed `[rows, cols/2]`, scales `[rows, cols/32]`, x `[cols]`, out `[rows]`.
/// Dispatches at run time to the fastest path the CPU has; the scalar path is the oracle.
pub fn mxfp4_matvec(packed: &[u8], scales: &[u8], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    mxfp4_matvec_on(Path::best(), packed, scales, rows, cols, x, out);
}

/// Run one specific implementation; returns false (doing nothing) when this CPU lacks it.
pub fn mxfp4_matvec_on(
    path: Path,
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    out: &mut [f32],
) -> bool {
    check_shapes(packed, scales, rows, cols, x, out);
    if !path.available() {
        return false;
    }
    match path {
        Path::Scalar => mxfp4_matvec_scalar(packed, scales, rows, cols, x, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX2 and FMA (checked above), and the shapes were checked.
        Path::Avx2 => unsafe { crate::mxfp4_avx2::mxfp4_matvec_avx2(packed, scales, rows, cols, x, out) },
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => with_deinterleaved(x, |xd| {
            // SAFETY: the CPU supports AVX-512F/BW (checked above), and the shapes were checked.
            unsafe { crate::avx512::mxfp4_matvec_avx512(packed, scales, rows, cols, xd, out) }
        }),
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON present (checked above), and the shapes were checked.
        Path::Neon => unsafe { crate::neon::mxfp4_matvec_neon(packed, scales, rows, cols, x, out) },
        // Paths of another architecture are never available (returned above).
        _ => mxfp4_matvec_scalar(packed, scales, rows, cols, x, out),
    }
    true
}

/// Run `f` on `x` deinterleaved per block into a per-thread scratch buffer (reused: no
/// allocation once warm).
#[cfg(target_arch = "x86_64")]
pub(crate) fn with_deinterleaved<R>(x: &[f32], f: impl FnOnce(&[f32]) -> R) -> R {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        s.resize(x.len(), 0.0);
        crate::avx512::deinterleave(x, &mut s);
        f(&s)
    })
}

fn check_shapes(packed: &[u8], scales: &[u8], rows: usize, cols: usize, x: &[f32], out: &[f32]) {
    assert!(cols.is_multiple_of(BLOCK), "MXFP4 rows must be whole blocks of 32");
    assert_eq!(packed.len(), rows * cols / 2);
    assert_eq!(scales.len(), rows * cols / BLOCK);
    assert_eq!(x.len(), cols);
    assert_eq!(out.len(), rows);
}

/// [`mxfp4_matvec`] with its rows split over the thread pool (bit-identical to it).
pub fn mxfp4_matvec_par(packed: &[u8], scales: &[u8], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    check_shapes(packed, scales, rows, cols, x, out);
    let (half, nb) = (cols / 2, cols / BLOCK);
    #[cfg(target_arch = "x86_64")]
    if Path::best() == Path::Avx512 {
        // Deinterleave once on this thread; every row chunk reads the same copy.
        return with_deinterleaved(x, |xd| {
            crate::par::par_rows(rows, cols, out, |r0, o| {
                let n = o.len();
                // SAFETY: AVX-512F/BW are present (Path::best) and the shapes were checked.
                unsafe {
                    crate::avx512::mxfp4_matvec_avx512(
                        &packed[r0 * half..(r0 + n) * half],
                        &scales[r0 * nb..(r0 + n) * nb],
                        n,
                        cols,
                        xd,
                        o,
                    )
                }
            })
        });
    }
    crate::par::par_rows(rows, cols, out, |r0, o| {
        let n = o.len();
        mxfp4_matvec(&packed[r0 * half..(r0 + n) * half], &scales[r0 * nb..(r0 + n) * nb], n, cols, x, o)
    });
}

/// The portable scalar path, and the oracle for the SIMD paths. Shapes as [`mxfp4_matvec`].
pub fn mxfp4_matvec_scalar(packed: &[u8], scales: &[u8], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    check_shapes(packed, scales, rows, cols, x, out);
    let half = cols / 2;
    let nblocks = cols / BLOCK;
    for (r, o) in out.iter_mut().enumerate() {
        *o = row_dot_scalar(&packed[r * half..(r + 1) * half], &scales[r * nblocks..(r + 1) * nblocks], x);
    }
}

/// One row's dot product, scalar. Shapes: prow `[cols/2]`, srow `[cols/32]`, x `[cols]`.
pub(crate) fn row_dot_scalar(prow: &[u8], srow: &[u8], x: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for (b, &s) in srow.iter().enumerate() {
        let pb = &prow[b * BLOCK / 2..(b + 1) * BLOCK / 2];
        let xb = &x[b * BLOCK..(b + 1) * BLOCK];
        // Two partial sums keep the dependency chain short; the block sum is then scaled once.
        let mut s0 = 0.0f32;
        let mut s1 = 0.0f32;
        for (j, &byte) in pb.iter().enumerate() {
            s0 += E2M1_LUT[(byte & 0x0F) as usize] * xb[2 * j];
            s1 += E2M1_LUT[(byte >> 4) as usize] * xb[2 * j + 1];
        }
        acc += (s0 + s1) * e8m0_to_f32(s);
    }
    acc
}

/// Decode one MXFP4 row to f32. Shapes: packed `[cols/2]`, scales `[cols/32]`, out `[cols]`.
pub fn mxfp4_decode_row(packed: &[u8], scales: &[u8], out: &mut [f32]) {
    assert_eq!(out.len(), packed.len() * 2);
    assert_eq!(out.len(), scales.len() * BLOCK);
    for (j, &byte) in packed.iter().enumerate() {
        let s = e8m0_to_f32(scales[2 * j / BLOCK]);
        out[2 * j] = E2M1_LUT[(byte & 0x0F) as usize] * s;
        out[2 * j + 1] = E2M1_LUT[(byte >> 4) as usize] * s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
                assert!(mxfp4_matvec_on(path, &packed, &scales, rows, cols, &x, &mut a));
                mxfp4_matvec_scalar(&packed, &scales, rows, cols, &x, &mut b);
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
    fn every_nibble_decodes_to_e2m1() {
        // Nibble n in the low half of byte 0 is element 0; in the high half it is element 1.
        let expect = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        for n in 0u8..16 {
            let mag = expect[(n & 7) as usize];
            let want = if n & 8 != 0 { -mag } else { mag };
            let mut packed = vec![0u8; 16];
            packed[0] = n | (n << 4);
            let mut out = vec![0f32; 32];
            mxfp4_decode_row(&packed, &[127], &mut out);
            assert_eq!(out[0], want, "nibble {n} low");
            assert_eq!(out[1], want, "nibble {n} high");
            assert!(out[2..].iter().all(|&v| v == 0.0));
        }
    }

    #[test]
    fn scale_edges() {
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(128), 2.0);
        assert_eq!(e8m0_to_f32(254), 2f32.powi(127));
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
        assert!(e8m0_to_f32(0) > 0.0);
        assert!(e8m0_to_f32(255).is_nan());
        for e in 1u8..=254 {
            assert_eq!(e8m0_to_f32(e), 2f32.powi(e as i32 - 127), "e = {e}");
        }
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
}
