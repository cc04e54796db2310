//! Block attention residuals (Kimi K3): each sub-layer reads a softmax-weighted mix of the stored
//! block outputs and the running partial sum, instead of a plain residual stream.
//!
//! The weights come from a learned vector `w_eff = norm_weight * proj_weight` dotted with each
//! RMS-normalised candidate; everything is per position, so the blocks live only for one token.

use deltafin_kernels::ops::{dot, inv_rms, softmax_inplace};

/// The stored block outputs of one position, with their cached `1/rms`.
pub struct ResidualBlocks {
    /// Each `[hidden]`.
    pub raw: Vec<Vec<f32>>,
    pub inv_rms: Vec<f32>,
    pub eps: f32,
}

impl ResidualBlocks {
    pub fn new(eps: f32) -> Self {
        ResidualBlocks { raw: Vec::new(), inv_rms: Vec::new(), eps }
    }

    pub fn clear(&mut self) {
        self.raw.clear();
        self.inv_rms.clear();
    }

    pub fn push(&mut self, x: &[f32]) {
        self.inv_rms.push(inv_rms(x, self.eps));
        self.raw.push(x.to_vec());
    }

    /// Mix the blocks with `partial`. With no blocks yet the mix is `partial` itself.
    /// Shapes: partial, w_eff, out `[hidden]`.
    pub fn mix(&self, partial: &[f32], w_eff: &[f32], out: &mut [f32]) {
        if self.raw.is_empty() {
            out.copy_from_slice(partial);
            return;
        }
        let mut logits: Vec<f32> = self.raw.iter().zip(&self.inv_rms).map(|(r, &n)| dot(r, w_eff) * n).collect(); // [blocks + 1]
        logits.push(dot(partial, w_eff) * inv_rms(partial, self.eps));
        softmax_inplace(&mut logits);
        let last = logits[self.raw.len()];
        for (i, o) in out.iter_mut().enumerate() {
            *o = last * partial[i];
        }
        for (r, &p) in self.raw.iter().zip(&logits) {
            for (o, &v) in out.iter_mut().zip(r) {
                *o += p * v;
            }
        }
    }
}

/// `w_eff = norm_weight * proj_weight`. Shapes: both `[hidden]`.
pub fn effective_weight(norm: &[f32], proj: &[f32]) -> Vec<f32> {
    norm.iter().zip(proj).map(|(a, b)| a * b).collect()
}
