//! The dense spine products on the GPU (`shaders/dense.wgsl`): bf16 (`--spine bf16`) and f32
//! weights, one token and a chunk, on the tiles the quantised products share. Their oracles are
//! `deltafin_kernels::scalar::{bf16_matvec, f32_matvec}`, token by token (`tests/dense.rs`).

use crate::product::{BoundProduct, Pipelines, Weights};
use crate::{Gpu, GpuDense, GpuError, GpuVec};

/// The compiled products, made once per device.
pub struct DenseProduct {
    pipelines: Pipelines,
    /// What the unused scale binding points at.
    no_scales: wgpu::Buffer,
}

impl DenseProduct {
    pub fn new(gpu: &Gpu) -> Self {
        let no_scales = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("no scales"),
            size: 16,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        DenseProduct { pipelines: Pipelines::new(gpu, "dense", include_str!("shaders/dense.wgsl")), no_scales }
    }

    /// Bind `out[t, r] = sum_c W[r, c] * xs[t, c]` for `n` tokens. Shapes: xs `[n, cols]`,
    /// out `[n, rows]`.
    pub fn bind(&self, gpu: &Gpu, w: &GpuDense, xs: &GpuVec, n: usize, out: &GpuVec) -> Result<BoundProduct, GpuError> {
        let format = u32::from(w.width == 2);
        let weights = Weights {
            what: "a dense product",
            extra: [format, 0, 0, 0],
            data: &w.w,
            scales: &self.no_scales,
            rows: w.rows,
            cols: w.cols,
            bytes: w.bytes(),
        };
        self.pipelines.bind(gpu, weights, xs, n, out)
    }
}
