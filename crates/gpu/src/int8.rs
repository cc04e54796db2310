//! The int8 spine products on the GPU (`shaders/int8.wgsl`): int8 weights with one f32 scale per
//! group of a row (per-row scaling: the group is the row), for one token and for a chunk. Their
//! oracle is `deltafin_kernels::scalar`'s `int8_matvec`, token by token (`tests/int8.rs`).

use crate::product::{BoundProduct, Pipelines, Weights};
use crate::{Gpu, GpuError, GpuInt8, GpuVec};

/// The compiled products, made once per device.
pub struct Int8Product(Pipelines);

impl Int8Product {
    pub fn new(gpu: &Gpu) -> Self {
        Int8Product(Pipelines::new(gpu, "int8", include_str!("shaders/int8.wgsl")))
    }

    /// Bind `out[t, r] = sum_c W[r, c] * xs[t, c]` for `n` tokens. Shapes: xs `[n, cols]`,
    /// out `[n, rows]`.
    pub fn bind(&self, gpu: &Gpu, w: &GpuInt8, xs: &GpuVec, n: usize, out: &GpuVec) -> Result<BoundProduct, GpuError> {
        let weights = Weights {
            what: "an int8 product",
            extra: [w.group as u32, 0, 0, 0],
            data: &w.q,
            scales: &w.scales,
            rows: w.rows,
            cols: w.cols,
            bytes: w.bytes(),
        };
        self.0.bind(gpu, weights, xs, n, out)
    }
}
