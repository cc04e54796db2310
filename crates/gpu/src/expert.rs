//! A routed expert on the GPU, `out = w2 · situ(w1 · x, w3 · x)`, for one token or a chunk: the
//! gate and up products ([`Mxfp4Product`]), SiTU element-wise (`shaders/situ.wgsl`) and the down
//! product, recorded as four dispatches of one pass (wgpu orders them: each reads what the one
//! before wrote). Its oracle is `deltafin_kernels::scalar::expert_mxfp4`, token by token
//! (`tests/expert.rs`).

use crate::mxfp4::Mxfp4Product;
use crate::product::BoundProduct;
use crate::{Gpu, GpuError, GpuMxfp4, GpuVec};

/// An expert's three MXFP4 matrices on the GPU. Shapes: w1, w3 `[inter, latent]`, w2
/// `[latent, inter]`.
pub struct GpuExpert {
    pub w1: GpuMxfp4,
    pub w3: GpuMxfp4,
    pub w2: GpuMxfp4,
}

impl GpuExpert {
    /// Upload an expert given as its three host matrices `(packed, scales)`.
    pub fn upload(
        gpu: &Gpu,
        w1: (&[u8], &[u8]),
        w3: (&[u8], &[u8]),
        w2: (&[u8], &[u8]),
        inter: usize,
        latent: usize,
    ) -> Result<Self, GpuError> {
        Ok(GpuExpert {
            w1: gpu.upload_mxfp4(w1.0, w1.1, inter, latent)?,
            w3: gpu.upload_mxfp4(w3.0, w3.1, inter, latent)?,
            w2: gpu.upload_mxfp4(w2.0, w2.1, latent, inter)?,
        })
    }

    pub fn bytes(&self) -> usize {
        self.w1.bytes() + self.w3.bytes() + self.w2.bytes()
    }
}

/// SiTU's two constants: `beta` bounds the gate, `linear_beta` (if any) the up projection.
#[derive(Clone, Copy, Debug)]
pub struct Situ {
    pub beta: f32,
    pub linear_beta: Option<f32>,
}

/// The compiled expert (its products and SiTU), made once per device.
pub struct ExpertProgram {
    products: Mxfp4Product,
    situ: wgpu::ComputePipeline,
}

/// One expert bound to its inputs and to the buffers of its intermediates and output.
/// Shapes: xs `[n, latent]`; gate, up, act `[n, inter]`; out `[n, latent]`.
pub struct BoundExpert {
    gate: BoundProduct,
    up: BoundProduct,
    down: BoundProduct,
    situ: wgpu::BindGroup,
    situ_groups: (u32, u32),
    pub out: GpuVec,
    /// Work per call: FLOPs of the three products, and the expert's stored bytes.
    pub flops: f64,
    pub weight_bytes: f64,
    _intermediates: [GpuVec; 3],
}

impl ExpertProgram {
    pub fn new(gpu: &Gpu) -> Self {
        let module = gpu.device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("situ"),
            source: wgpu::ShaderSource::Wgsl(include_str!("shaders/situ.wgsl").into()),
        });
        let situ = gpu.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("situ"),
            layout: None,
            module: &module,
            entry_point: Some("situ"),
            compilation_options: Default::default(),
            cache: None,
        });
        ExpertProgram { products: Mxfp4Product::new(gpu), situ }
    }

    /// Bind `e` to `n` tokens of input `xs` (`[n, latent]`), with buffers for what it makes.
    pub fn bind(&self, gpu: &Gpu, e: &GpuExpert, xs: &GpuVec, n: usize, situ: Situ) -> Result<BoundExpert, GpuError> {
        let (inter, latent) = (e.w1.rows, e.w1.cols);
        if e.w3.rows != inter || e.w3.cols != latent || e.w2.rows != latent || e.w2.cols != inter {
            return Err(GpuError::Shape {
                what: "an expert",
                why: format!(
                    "w1 {inter} x {latent}, w3 {} x {}, w2 {} x {}: w3 must match w1 and w2 be its transpose's shape",
                    e.w3.rows, e.w3.cols, e.w2.rows, e.w2.cols
                ),
            });
        }
        let gate = gpu.zeros_f32(n * inter)?;
        let up = gpu.zeros_f32(n * inter)?;
        let act = gpu.zeros_f32(n * inter)?;
        let out = gpu.zeros_f32(n * latent)?;
        let g = self.products.bind(gpu, &e.w1, xs, n, &gate)?;
        let u = self.products.bind(gpu, &e.w3, xs, n, &up)?;
        let d = self.products.bind(gpu, &e.w2, &act, n, &out)?;
        let len = n * inter;
        let (bounded, lb) = match situ.linear_beta {
            Some(lb) => (1u32, lb),
            None => (0, 1.0),
        };
        let params = gpu.uniform(&[len as u32, bounded, situ.beta.to_bits(), lb.to_bits()]);
        let bind = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("situ"),
            layout: &self.situ.get_bind_group_layout(0),
            entries: &[
                wgpu::BindGroupEntry { binding: 0, resource: gate.buf.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 1, resource: up.buf.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 2, resource: act.buf.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 3, resource: params.as_entire_binding() },
            ],
        });
        let groups = len.div_ceil(256);
        let situ_groups = (groups.min(65_535) as u32, groups.div_ceil(65_535) as u32);
        Ok(BoundExpert {
            flops: g.flops + u.flops + d.flops,
            weight_bytes: e.bytes() as f64,
            gate: g,
            up: u,
            down: d,
            situ: bind,
            situ_groups,
            out,
            _intermediates: [gate, up, act],
        })
    }

    /// Record the expert's four dispatches into a compute pass.
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>, b: &BoundExpert) {
        self.products.encode(pass, &b.gate);
        self.products.encode(pass, &b.up);
        pass.set_pipeline(&self.situ);
        pass.set_bind_group(0, &b.situ, &[]);
        pass.dispatch_workgroups(b.situ_groups.0, b.situ_groups.1, 1);
        self.products.encode(pass, &b.down);
    }

    /// Run the expert now and wait for it.
    pub fn run(&self, gpu: &Gpu, b: &BoundExpert) -> Result<(), GpuError> {
        gpu.run_passes(1, |pass| self.encode(pass, b))
    }
}
