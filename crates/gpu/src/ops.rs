//! Row-wise operations on the GPU (`shaders/ops.wgsl`): RMSNorm and softmax over `[n, dim]`,
//! one workgroup per row. Their oracles are `deltafin_kernels::scalar::{rms_norm,
//! softmax_inplace}` (`tests/ops.rs`).

use crate::{Gpu, GpuError, GpuVec};

const MAX_GROUPS: usize = 65_535;

/// The compiled operations, made once per device.
pub struct RowOps {
    rms_norm: wgpu::ComputePipeline,
    softmax: wgpu::ComputePipeline,
}

/// One operation bound to its buffers.
pub struct BoundOp {
    bind: wgpu::BindGroup,
    softmax: bool,
    groups: (u32, u32),
}

impl RowOps {
    pub fn new(gpu: &Gpu) -> Self {
        let module = gpu.module("ops", include_str!("shaders/ops.wgsl"));
        RowOps { rms_norm: gpu.pipeline(&module, "rms_norm", None), softmax: gpu.pipeline(&module, "softmax", None) }
    }

    /// `out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight` for each row. Shapes: x, out
    /// `[n, dim]`, weight `[dim]`.
    pub fn bind_rms_norm(
        &self,
        gpu: &Gpu,
        x: &GpuVec,
        weight: &GpuVec,
        eps: f32,
        out: &GpuVec,
    ) -> Result<BoundOp, GpuError> {
        self.bind(gpu, x, Some(weight), weight.len(), eps, out)
    }

    /// `out[t] = softmax(x[t])` for each row of `dim` values. Shapes: x, out `[n, dim]`.
    pub fn bind_softmax(&self, gpu: &Gpu, x: &GpuVec, dim: usize, out: &GpuVec) -> Result<BoundOp, GpuError> {
        self.bind(gpu, x, None, dim, 0.0, out)
    }

    /// RMSNorm with its weight, softmax without.
    fn bind(
        &self,
        gpu: &Gpu,
        x: &GpuVec,
        weight: Option<&GpuVec>,
        dim: usize,
        eps: f32,
        out: &GpuVec,
    ) -> Result<BoundOp, GpuError> {
        let softmax = weight.is_none();
        if dim == 0 || !x.len().is_multiple_of(dim) || out.len() != x.len() {
            return Err(GpuError::Shape {
                what: if softmax { "a softmax" } else { "an RMSNorm" },
                why: format!("rows of {dim} over {} values into {}", x.len(), out.len()),
            });
        }
        let rows = x.len() / dim;
        let groups = (rows.clamp(1, MAX_GROUPS), rows.div_ceil(MAX_GROUPS).max(1));
        let params = gpu.uniform(&[dim as u32, rows as u32, groups.0 as u32, eps.to_bits()]);
        let pipeline = if softmax { &self.softmax } else { &self.rms_norm };
        let mut entries = vec![
            wgpu::BindGroupEntry { binding: 0, resource: x.buf.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 2, resource: out.buf.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 3, resource: params.as_entire_binding() },
        ];
        // The layout is derived from the entry point: softmax does not use the weight.
        if let Some(w) = weight {
            entries.insert(1, wgpu::BindGroupEntry { binding: 1, resource: w.buf.as_entire_binding() });
        }
        let bind = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("row op"),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        });
        Ok(BoundOp { bind, softmax, groups: (groups.0 as u32, groups.1 as u32) })
    }

    /// Record one operation into a compute pass.
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>, op: &BoundOp) {
        pass.set_pipeline(if op.softmax { &self.softmax } else { &self.rms_norm });
        pass.set_bind_group(0, &op.bind, &[]);
        pass.dispatch_workgroups(op.groups.0, op.groups.1, 1);
    }

    /// Run one operation now and wait for it.
    pub fn run(&self, gpu: &Gpu, op: &BoundOp) -> Result<(), GpuError> {
        gpu.run_passes(1, |pass| self.encode(pass, op))
    }
}
