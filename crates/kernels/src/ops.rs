//! Small element-wise and reduction kernels used by every model: norms, softmax, activations.

/// RMSNorm: `out = x / sqrt(mean(x^2) + eps) * weight`. Shapes: x, weight, out `[n]`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), weight.len());
    assert_eq!(x.len(), out.len());
    let inv = inv_rms(x, eps);
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * inv * w;
    }
}

/// In-place RMSNorm. Shapes: x, weight `[n]`.
pub fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    assert_eq!(x.len(), weight.len());
    let inv = inv_rms(x, eps);
    for (v, &w) in x.iter_mut().zip(weight) {
        *v *= inv * w;
    }
}

/// `1 / sqrt(mean(x^2) + eps)`, accumulated in f64 so long rows keep their precision.
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    (1.0 / ((ss / x.len() as f64) + eps as f64).sqrt()) as f32
}

/// Numerically stable in-place softmax.
pub fn softmax_inplace(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// Softplus with the usual linear cut-over for large inputs.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// SiTU, Kimi K3's gated activation: `beta*tanh(g/beta)*sigmoid(g) * lbeta*tanh(u/lbeta)`.
/// Shapes: gate, up, out `[n]`. `linear_beta` None leaves `u` unbounded.
pub fn situ(gate: &[f32], up: &[f32], beta: f32, linear_beta: Option<f32>, out: &mut [f32]) {
    assert_eq!(gate.len(), up.len());
    assert_eq!(gate.len(), out.len());
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let a = beta * (g / beta).tanh() * sigmoid(g);
        let x = match linear_beta {
            Some(lb) => lb * (u / lb).tanh(),
            None => u,
        };
        *o = a * x;
    }
}

/// Dot product with f32 accumulation over several lanes.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for i in 0..chunks {
        for l in 0..8 {
            acc[l] += a[i * 8 + l] * b[i * 8 + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// `y += alpha * x`.
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    for (v, &u) in y.iter_mut().zip(x) {
        *v += alpha * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_sums_to_one_and_orders() {
        let mut x = vec![1.0, 2.0, 3.0, 1000.0];
        softmax_inplace(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[3] > 0.999);
    }

    #[test]
    fn rms_norm_unit() {
        let x = [3.0f32, 4.0];
        let mut out = [0.0f32; 2];
        rms_norm(&x, &[1.0, 2.0], 0.0, &mut out);
        let r = (12.5f32).sqrt();
        assert!((out[0] - 3.0 / r).abs() < 1e-6);
        assert!((out[1] - 8.0 / r).abs() < 1e-6);
    }

    #[test]
    fn situ_matches_formula() {
        let mut o = [0.0f32];
        situ(&[1.5], &[30.0], 4.0, Some(25.0), &mut o);
        let want = 4.0 * (1.5f32 / 4.0).tanh() * sigmoid(1.5) * 25.0 * (30.0f32 / 25.0).tanh();
        assert!((o[0] - want).abs() < 1e-5);
    }
}
