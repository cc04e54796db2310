//! What every weight-times-activations product on the GPU shares: a shader with a one-token entry
//! point (`matvec`: a team of 32 invocations per 4 rows, 32 rows per workgroup) and a chunk entry
//! point (`matmat`: tiles of 128 rows x 64 tokens, `shaders/tiles.wgsl`, appended to each shader), the same five bindings (two weight buffers,
//! inputs, outputs, dimensions), the dispatch geometry and the work each call does.

use crate::{Gpu, GpuError, GpuVec};

/// Rows per workgroup of `matvec`; rows x tokens per workgroup of `matmat` (as in the shaders).
const MATVEC_ROWS: usize = 32;
const TILE_ROWS: usize = 128;
const TILE_TOKENS: usize = 32 * 2;
/// The most workgroups along one dimension of a dispatch (WebGPU's limit).
const MAX_GROUPS: usize = 65_535;

/// A product's two compiled entry points and their bind group layout, made once per device.
pub(crate) struct Pipelines {
    layout: wgpu::BindGroupLayout,
    matvec: wgpu::ComputePipeline,
    matmat: wgpu::ComputePipeline,
}

/// One product's arguments bound to its pipeline, ready to be encoded any number of times. A
/// chunk product bound for `n` tokens also runs any smaller chunk ([`Self::set_tokens`]).
pub struct BoundProduct {
    bind: wgpu::BindGroup,
    pipeline: wgpu::ComputePipeline,
    groups: (u32, u32),
    /// The shader's dimension words, and what they are made from.
    dims: wgpu::Buffer,
    shape: (usize, usize),
    extra: [u32; 4],
    /// Tokens bound for: the most [`Self::set_tokens`] may ask.
    capacity: usize,
    /// Work per dispatch: 2 FLOP per weight per token, and the matrix's stored bytes.
    pub flops: f64,
    pub weight_bytes: f64,
}

/// The weights as the shader reads them: two buffers, the matrix's shape, and the dimension
/// words after (rows, cols, n, groups along x) that its shader reads (`extra`).
pub(crate) struct Weights<'a> {
    /// What the product is, for errors ("an int8 product").
    pub what: &'static str,
    pub extra: [u32; 4],
    pub data: &'a wgpu::Buffer,
    pub scales: &'a wgpu::Buffer,
    pub rows: usize,
    pub cols: usize,
    pub bytes: usize,
}

fn entry(binding: u32, ty: wgpu::BufferBindingType) -> wgpu::BindGroupLayoutEntry {
    wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer { ty, has_dynamic_offset: false, min_binding_size: None },
        count: None,
    }
}

impl Pipelines {
    pub(crate) fn new(gpu: &Gpu, label: &str, source: &str) -> Self {
        let d = &gpu.device;
        let module = gpu.module(label, &format!("{source}\n{}", include_str!("shaders/tiles.wgsl")));
        let read = wgpu::BufferBindingType::Storage { read_only: true };
        let layout = d.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some(label),
            entries: &[
                entry(0, read),
                entry(1, read),
                entry(2, read),
                entry(3, wgpu::BufferBindingType::Storage { read_only: false }),
                entry(4, wgpu::BufferBindingType::Uniform),
            ],
        });
        let pl = d.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(label),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        Pipelines {
            matvec: gpu.pipeline(&module, "matvec", Some(&pl)),
            matmat: gpu.pipeline(&module, "matmat", Some(&pl)),
            layout,
        }
    }

    /// Bind `out[t, r] = sum_c W[r, c] * xs[t, c]` for `n` tokens. Shapes: xs `[n, cols]`,
    /// out `[n, rows]`.
    pub(crate) fn bind(
        &self,
        gpu: &Gpu,
        w: Weights<'_>,
        xs: &GpuVec,
        n: usize,
        out: &GpuVec,
    ) -> Result<BoundProduct, GpuError> {
        let what = w.what;
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
        let groups = dispatch(w.rows, n).map_err(|why| GpuError::Shape { what, why })?;
        let dims = gpu.uniform(&dims_words(w.rows, w.cols, n, groups, w.extra));
        let bind = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(what),
            layout: &self.layout,
            entries: &[
                wgpu::BindGroupEntry { binding: 0, resource: w.data.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 1, resource: w.scales.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 2, resource: xs.buf.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 3, resource: out.buf.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 4, resource: dims.as_entire_binding() },
            ],
        });
        Ok(BoundProduct {
            bind,
            pipeline: if n == 1 { self.matvec.clone() } else { self.matmat.clone() },
            groups,
            dims,
            shape: (w.rows, w.cols),
            extra: w.extra,
            capacity: n,
            flops: 2.0 * (w.rows * w.cols * n) as f64,
            weight_bytes: w.bytes as f64,
        })
    }
}

/// Workgroups along x and y for `rows` x `n` tokens: the one-token kernel's row groups (spilling
/// into y past WebGPU's 65,535 per dimension), or the chunk kernel's tiles.
fn dispatch(rows: usize, n: usize) -> Result<(u32, u32), String> {
    let groups = if n == 1 {
        let g = rows.div_ceil(MATVEC_ROWS);
        (g.min(MAX_GROUPS), g.div_ceil(MAX_GROUPS))
    } else {
        (rows.div_ceil(TILE_ROWS), n.div_ceil(TILE_TOKENS))
    };
    if groups.0 > MAX_GROUPS || groups.1 > MAX_GROUPS {
        return Err(format!("{rows} rows x {n} tokens is past one dispatch"));
    }
    Ok((groups.0 as u32, groups.1 as u32))
}

/// The dimension words the shaders read: rows, cols, tokens, groups along x, then the format's.
fn dims_words(rows: usize, cols: usize, n: usize, groups: (u32, u32), extra: [u32; 4]) -> [u32; 8] {
    let [e0, e1, e2, e3] = extra;
    [rows as u32, cols as u32, n as u32, groups.0, e0, e1, e2, e3]
}

impl BoundProduct {
    /// Make the next encodings compute `n` tokens, at most the `n` it was bound for, through the
    /// same kernel (one token, or a chunk): the dimensions are rewritten in the queue, ahead of
    /// whatever is submitted next. Shapes: the first `n` rows of xs and out.
    pub fn set_tokens(&mut self, gpu: &Gpu, n: usize) -> Result<(), GpuError> {
        if n == 0 || n > self.capacity || (n == 1) != (self.capacity == 1) {
            return Err(GpuError::Shape {
                what: "a bound product",
                why: format!("{n} tokens on a binding for {}", self.capacity),
            });
        }
        let (rows, cols) = self.shape;
        self.groups = dispatch(rows, n).map_err(|why| GpuError::Shape { what: "a bound product", why })?;
        let words = dims_words(rows, cols, n, self.groups, self.extra);
        gpu.queue.write_buffer(&self.dims, 0, bytemuck::cast_slice(&words));
        self.flops = 2.0 * (rows * cols * n) as f64;
        Ok(())
    }

    /// Record the product into a compute pass.
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>) {
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.bind, &[]);
        pass.dispatch_workgroups(self.groups.0, self.groups.1, 1);
    }

    /// Run the product now and wait for it.
    pub fn run(&self, gpu: &Gpu) -> Result<(), GpuError> {
        gpu.run_passes(1, |pass| self.encode(pass))
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
