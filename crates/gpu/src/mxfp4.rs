//! The MXFP4 expert products on the GPU (`shaders/mxfp4.wgsl`): one token (`matvec`, bound by
//! memory: one read of the matrix) and a chunk of tokens (`matmat`, tiles decoded once into
//! workgroup memory and used by 32 tokens). Their oracle is `deltafin_kernels::scalar`'s
//! `mxfp4_matvec`, token by token (`tests/mxfp4.rs`).

use crate::{Gpu, GpuError, GpuMxfp4, GpuVec};

const SHADER: &str = include_str!("shaders/mxfp4.wgsl");
/// Rows per workgroup of `matvec`; rows x tokens per workgroup of `matmat` (as in the shader).
const MATVEC_ROWS: usize = 8;
const TILE_ROWS: usize = 64;
const TILE_TOKENS: usize = 32;
/// The most workgroups along one dimension of a dispatch (WebGPU's limit).
const MAX_GROUPS: usize = 65_535;

/// The compiled products, made once per device.
pub struct Mxfp4Product {
    layout: wgpu::BindGroupLayout,
    matvec: wgpu::ComputePipeline,
    matmat: wgpu::ComputePipeline,
}

/// One product's arguments bound, ready to be encoded any number of times.
pub struct BoundProduct {
    bind: wgpu::BindGroup,
    one_token: bool,
    groups: (u32, u32),
    /// Work per dispatch: 2 FLOP per weight per token, and the matrix's stored bytes.
    pub flops: f64,
    pub weight_bytes: f64,
}

fn storage_entry(binding: u32, read_only: bool) -> wgpu::BindGroupLayoutEntry {
    wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Storage { read_only },
            has_dynamic_offset: false,
            min_binding_size: None,
        },
        count: None,
    }
}

impl Mxfp4Product {
    pub fn new(gpu: &Gpu) -> Self {
        let d = &gpu.device;
        let module = d.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("mxfp4"),
            source: wgpu::ShaderSource::Wgsl(SHADER.into()),
        });
        let layout = d.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("mxfp4"),
            entries: &[
                storage_entry(0, true),
                storage_entry(1, true),
                storage_entry(2, true),
                storage_entry(3, false),
                wgpu::BindGroupLayoutEntry {
                    binding: 4,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Uniform,
                        has_dynamic_offset: false,
                        min_binding_size: None,
                    },
                    count: None,
                },
            ],
        });
        let pl = d.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some("mxfp4"),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        let pipeline = |entry: &str| {
            d.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: Some(&pl),
                module: &module,
                entry_point: Some(entry),
                compilation_options: Default::default(),
                cache: None,
            })
        };
        Mxfp4Product { matvec: pipeline("matvec"), matmat: pipeline("matmat"), layout }
    }

    /// Bind `out[t, r] = sum_c W[r, c] * xs[t, c]` for `n` tokens. Shapes: xs `[n, cols]`,
    /// out `[n, rows]`. One token takes the memory-bound kernel, more the tiled one.
    pub fn bind(&self, gpu: &Gpu, w: &GpuMxfp4, xs: &GpuVec, n: usize, out: &GpuVec) -> Result<BoundProduct, GpuError> {
        let what = "an MXFP4 product";
        if n == 0 || xs.len() != n * w.cols || out.len() != n * w.rows {
            return Err(GpuError::Shape {
                what,
                why: format!(
                    "{} x {} against {n} tokens needs xs of {} and out of {}, got {} and {}",
                    w.rows,
                    w.cols,
                    n * w.cols,
                    n * w.rows,
                    xs.len(),
                    out.len()
                ),
            });
        }
        let one_token = n == 1;
        let groups = if one_token {
            let g = w.rows.div_ceil(MATVEC_ROWS);
            (g.min(MAX_GROUPS), g.div_ceil(MAX_GROUPS))
        } else {
            (w.rows.div_ceil(TILE_ROWS), n.div_ceil(TILE_TOKENS))
        };
        if groups.0 > MAX_GROUPS || groups.1 > MAX_GROUPS {
            return Err(GpuError::Shape { what, why: format!("{} rows x {n} tokens is past one dispatch", w.rows) });
        }
        let dims = gpu.uniform(&[w.rows as u32, w.cols as u32, n as u32, groups.0 as u32]);
        let bind = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("mxfp4"),
            layout: &self.layout,
            entries: &[
                wgpu::BindGroupEntry { binding: 0, resource: w.packed.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 1, resource: w.scales.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 2, resource: xs.buf.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 3, resource: out.buf.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 4, resource: dims.as_entire_binding() },
            ],
        });
        Ok(BoundProduct {
            bind,
            one_token,
            groups: (groups.0 as u32, groups.1 as u32),
            flops: 2.0 * (w.rows * w.cols * n) as f64,
            weight_bytes: w.bytes() as f64,
        })
    }

    /// Record one product into a compute pass.
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>, p: &BoundProduct) {
        pass.set_pipeline(if p.one_token { &self.matvec } else { &self.matmat });
        pass.set_bind_group(0, &p.bind, &[]);
        pass.dispatch_workgroups(p.groups.0, p.groups.1, 1);
    }

    /// Run one product now and wait for it.
    pub fn run(&self, gpu: &Gpu, p: &BoundProduct) -> Result<(), GpuError> {
        gpu.run_passes(1, |pass| self.encode(pass, p))
    }
}

impl Gpu {
    /// Record `reps` rounds of `record` in one compute pass, submit, and wait.
    pub fn run_passes(&self, reps: usize, mut record: impl FnMut(&mut wgpu::ComputePass<'_>)) -> Result<(), GpuError> {
        let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("passes") });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
            for _ in 0..reps {
                record(&mut pass);
            }
        }
        self.queue.submit([enc.finish()]);
        self.wait()
    }
}
