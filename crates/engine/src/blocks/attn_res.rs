//! Block attention residuals (Kimi K3): each sub-layer reads a softmax-weighted mix of the stored
//! block outputs and the running partial sum, instead of a plain residual stream.
//!
//! The weights come from a learned vector `w_eff = norm_weight * proj_weight` dotted with each
//! RMS-normalised candidate; everything is per position, so the blocks live only for one token.

use deltafin_kernels::ops::{dot, inv_rms, softmax_inplace};

/// The stored block outputs of one position, with their cached `1/rms`.
pub struct ResidualBlocks {
    /// Each `[hidden]`; only the first `len` are live (the rest keep their memory for reuse).
    raw: Vec<Vec<f32>>,
    len: usize,
    /// `[len]`.
    inv_rms: Vec<f32>,
    /// `[len + 1]` mixing logits, reused.
    logits: Vec<f32>,
    pub eps: f32,
}

impl ResidualBlocks {
    pub fn new(eps: f32) -> Self {
        ResidualBlocks { raw: Vec::new(), len: 0, inv_rms: Vec::new(), logits: Vec::new(), eps }
    }

    /// Forget the blocks of the previous token, keeping their memory.
    pub fn clear(&mut self) {
        self.len = 0;
        self.inv_rms.clear();
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes held (live blocks and the memory kept for reuse), for the memory plan's check.
    pub fn bytes(&self) -> usize {
        4 * (self.raw.iter().map(Vec::capacity).sum::<usize>() + self.inv_rms.capacity() + self.logits.capacity())
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn push(&mut self, x: &[f32]) {
        self.inv_rms.push(inv_rms(x, self.eps));
        if self.len < self.raw.len() {
            let slot = &mut self.raw[self.len];
            slot.clear();
            slot.extend_from_slice(x);
        } else {
            self.raw.push(x.to_vec());
        }
        self.len += 1;
    }

    /// Mix the blocks with `partial`. With no blocks yet the mix is `partial` itself.
    /// Shapes: partial, w_eff, out `[hidden]`.
    pub fn mix(&mut self, partial: &[f32], w_eff: &[f32], out: &mut [f32]) {
        if self.len == 0 {
            out.copy_from_slice(partial);
            return;
        }
        let raw = &self.raw[..self.len];
        self.logits.clear();
        self.logits.extend(raw.iter().zip(&self.inv_rms).map(|(r, &n)| dot(r, w_eff) * n));
        self.logits.push(dot(partial, w_eff) * inv_rms(partial, self.eps));
        softmax_inplace(&mut self.logits);
        let last = self.logits[self.len];
        for (o, &p) in out.iter_mut().zip(partial) {
            *o = last * p;
        }
        for (r, &p) in raw.iter().zip(&self.logits) {
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
