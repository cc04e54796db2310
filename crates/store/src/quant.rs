//! int8 quantisation of spine matrices: symmetric, one f32 scale per group of a row.
//!
//! `group == cols` is per-row scaling. The scale is `max|w| / 127` so the largest weight of each
//! group maps to ±127 exactly; an all-zero group gets scale 0 and dequantises to zeros.

/// Quantise `rows` rows of `w` (`[rows, cols]`). Returns `(q [rows, cols], scales [rows, cols/group])`.
pub fn quantize_int8(w: &[f32], cols: usize, group: usize) -> (Vec<i8>, Vec<f32>) {
    assert!(group > 0 && cols.is_multiple_of(group));
    assert_eq!(w.len() % cols, 0);
    let mut q = Vec::with_capacity(w.len());
    let mut scales = Vec::with_capacity(w.len() / group);
    for g in w.chunks_exact(group) {
        let amax = g.iter().fold(0.0f32, |m, &v| m.max(v.abs()));
        let scale = amax / 127.0;
        scales.push(scale);
        if scale == 0.0 {
            q.extend(std::iter::repeat_n(0i8, group));
        } else {
            let inv = 1.0 / scale;
            q.extend(g.iter().map(|&v| (v * inv).round().clamp(-127.0, 127.0) as i8));
        }
    }
    (q, scales)
}

pub fn dequantize_int8(q: &[i8], scales: &[f32], group: usize) -> Vec<f32> {
    q.chunks_exact(group).zip(scales).flat_map(|(g, &s)| g.iter().map(move |&v| v as f32 * s)).collect()
}

/// The group size actually used for a row of `cols`: the requested one when it divides the row,
/// else per-row (so odd widths still convert).
pub fn effective_group(cols: usize, requested: usize) -> usize {
    if requested == 0 || !cols.is_multiple_of(requested) { cols } else { requested }
}

/// The first E8M0 scale byte that is 0xFF (NaN), if any: a corrupt MXFP4 scale.
pub fn nan_scale(scales: &[u8]) -> Option<usize> {
    scales.iter().position(|&b| b == 0xFF)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn roundtrip_error_is_within_half_a_step() {
        let w: Vec<f32> = (0..256).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
        for group in [32, 64, 128] {
            let (q, s) = quantize_int8(&w, 128, group);
            let d = dequantize_int8(&q, &s, group);
            for (i, (a, b)) in w.iter().zip(&d).enumerate() {
                let step = s[i / group];
                assert!((a - b).abs() <= 0.5 * step + 1e-7, "group {group} i {i}");
            }
        }
    }

    #[test]
    fn zero_group_and_extremes() {
        let mut w = vec![0.0f32; 64];
        w[40] = -3.0;
        w[41] = 3.0;
        let (q, s) = quantize_int8(&w, 64, 32);
        assert_eq!(s[0], 0.0);
        assert!(q[..32].iter().all(|&v| v == 0));
        assert_eq!(q[40], -127);
        assert_eq!(q[41], 127);
        assert_eq!(dequantize_int8(&q, &s, 32)[41], 3.0);
    }

    proptest! {
        #[test]
        fn prop_roundtrip(w in proptest::collection::vec(-100.0f32..100.0, 64)) {
            let (q, s) = quantize_int8(&w, 64, 64);
            let d = dequantize_int8(&q, &s, 64);
            for (a, b) in w.iter().zip(&d) {
                prop_assert!((a - b).abs() <= 0.5 * s[0] * 1.0001 + 1e-6);
            }
        }
    }
}
