//! The MXFP4 expert products on the GPU (`shaders/mxfp4.wgsl`): one token (`matvec`, bound by
//! memory: one read of the matrix) and a chunk of tokens (`matmat`, tiles decoded once into
//! workgroup memory and used by 64 tokens), the E2M1 values and E8M0 scales decoded in the
//! shader. Their oracle is `deltafin_kernels::scalar`'s `mxfp4_matvec`, token by token
//! (`tests/mxfp4.rs`).

use crate::product::{BoundProduct, Pipelines, Weights};
use crate::{Gpu, GpuError, GpuMxfp4, GpuVec};

/// The compiled products, made once per device.
pub struct Mxfp4Product(Pipelines);

impl Mxfp4Product {
    pub fn new(gpu: &Gpu) -> Self {
        Mxfp4Product(Pipelines::new(gpu, "mxfp4", include_str!("shaders/mxfp4.wgsl")))
    }

    /// Bind `out[t, r] = sum_c W[r, c] * xs[t, c]` for `n` tokens. Shapes: xs `[n, cols]`,
    /// out `[n, rows]`. One token takes the memory-bound kernel, more the tiled one.
    pub fn bind(&self, gpu: &Gpu, w: &GpuMxfp4, xs: &GpuVec, n: usize, out: &GpuVec) -> Result<BoundProduct, GpuError> {
        let weights = Weights {
            what: "an MXFP4 product",
            extra: [0; 4],
            data: &w.packed,
            scales: &w.scales,
            rows: w.rows,
            cols: w.cols,
            bytes: w.bytes(),
        };
        self.0.bind(gpu, weights, xs, n, out)
    }
}
