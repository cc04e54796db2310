//! Dense matrix-vector products over the spine's storage formats (f32, bf16, int8 + scales).
//!
//! All take a row-major `[rows, cols]` weight and compute `out[r] = sum_c W[r, c] * x[c]` with f32
//! accumulation. Several independent accumulators let the compiler vectorise the inner loop.

use half::bf16;

const LANES: usize = 8;

#[inline]
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
pub fn f32_matvec(w: &[f32], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    assert_eq!(w.len(), rows * cols);
    assert_eq!(x.len(), cols);
    assert_eq!(out.len(), rows);
    for (r, o) in out.iter_mut().enumerate() {
        *o = dot_f32(&w[r * cols..(r + 1) * cols], x);
    }
}

/// bf16 weights (raw u16 bits), widened exactly to f32. Shapes as [`f32_matvec`].
pub fn bf16_matvec(w: &[u16], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
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
pub fn int8_matvec(
    q: &[i8],
    scales: &[f32],
    group: usize,
    rows: usize,
    cols: usize,
    x: &[f32],
    out: &mut [f32],
) {
    assert!(
        group > 0 && cols.is_multiple_of(group),
        "int8 group must divide the row"
    );
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

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(w: &[f32], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
        (0..rows)
            .map(|r| (0..cols).map(|c| w[r * cols + c] * x[c]).sum())
            .collect()
    }

    #[test]
    fn formats_agree_with_naive() {
        let (rows, cols) = (5, 67); // a tail that is not a multiple of the lane count
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 4.0)
            .collect();
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
