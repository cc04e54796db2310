//! KDA's gated delta-rule recurrence over a prompt chunk on the GPU: every head's state walks
//! the chunk's tokens in order (`S <- S * g` per key channel, `delta = beta (v - S k)`,
//! `S <- S + delta k^T`, `y = S q`). Its oracle is `deltafin_kernels::scalar::kda_head_step`
//! (`tests/kda.rs`).
//!
//! One workgroup per head, one invocation per row of the state: a row's update needs only its
//! own values and the token's k, g and q (the same for every row), which the workgroup stages
//! in its memory 16 tokens at a time, so the tokens go by with a barrier per 16. The row stays
//! in registers for the whole chunk as named vec4s, which the shader spells out for the model's
//! head size (generated here: an array indexed by a variable would go to local memory).

use std::sync::Mutex;

use crate::{Gpu, GpuError, GpuVec};

/// Head sizes the shader takes: whole vec4s, a row of at most 128 values in registers.
const MAX_HEAD_DIM: usize = 128;
/// The most workgroups along one dimension of a dispatch (WebGPU's limit).
const MAX_GROUPS: usize = 65_535;

/// The recurrence for one head size, and its buffers (grown to the largest chunk seen).
pub struct KdaRecurrence {
    pipeline: wgpu::ComputePipeline,
    d: usize,
    work: Mutex<Option<Work>>,
}

struct Work {
    /// `[4, T, P]`: q, k, g, v.
    xs: GpuVec,
    /// `[T, heads]`.
    beta: GpuVec,
    /// `[heads, D, D]`.
    state: GpuVec,
    /// `[T, P]`.
    y: GpuVec,
    staging: wgpu::Buffer,
    up: crate::buffers::Uploader,
}

/// Tokens whose q, k and decays a workgroup stages in its memory at once (`[TB, 3, D]`: 24 KiB
/// at K3's head of 128), loaded by all its invocations together.
const TB: usize = 16;

/// The shader for head size `d`: row `r` of head `h`'s state in `s0 .. s{d/4-1}`; each block
/// of [`TB`] tokens' q, k and decays staged in workgroup memory (every invocation reads all of
/// them: from there, not from global memory, at each token); the row's two dot products summed
/// in four chains (`j % 4`) so that they do not wait on one add after another.
fn shader(d: usize) -> String {
    let d4 = d / 4;
    let mut load = String::new();
    let mut decay = String::new();
    let mut update = String::new();
    let mut store = String::new();
    for j in 0..d4 {
        let c = j % 4;
        load.push_str(&format!("    var s{j} = state[sb + {j}u];\n"));
        decay.push_str(&format!("            s{j} *= sh[gb + {j}u];\n            m{c} += dot(s{j}, sh[kb + {j}u]);\n"));
        update.push_str(&format!(
            "            s{j} += sh[kb + {j}u] * delta;\n            a{c} += dot(s{j}, sh[qb + {j}u]);\n"
        ));
        store.push_str(&format!("    state[sb + {j}u] = s{j};\n"));
    }
    format!(
        "struct Dims {{ heads: u32, t: u32, p: u32, _pad: u32 }}
@group(0) @binding(0) var<storage, read> xs: array<vec4<f32>>; // [4, T, P / 4]: q, k, g, v
@group(0) @binding(1) var<storage, read> beta: array<f32>; // [T, heads]
@group(0) @binding(2) var<storage, read_write> state: array<vec4<f32>>; // [heads, D, D / 4]
@group(0) @binding(3) var<storage, read_write> y: array<f32>; // [T, P]
@group(0) @binding(4) var<uniform> dims: Dims;

var<workgroup> sh: array<vec4<f32>, {staged}>; // [TB, 3, D / 4]: each token's q, k, decays

@compute @workgroup_size({d})
fn recur(@builtin(local_invocation_index) r: u32, @builtin(workgroup_id) wg: vec3<u32>) {{
    let h = wg.x;
    let p4 = dims.p / 4u;
    let plane = dims.t * p4; // vec4s of one of q, k, g, v
    let sb = (h * {d}u + r) * {d4}u;
{load}    for (var t0 = 0u; t0 < dims.t; t0 += {tb}u) {{
        let nt = min({tb}u, dims.t - t0);
        for (var i = r; i < nt * {three_d4}u; i += {d}u) {{
            let tt = i / {three_d4}u;
            let which = (i % {three_d4}u) / {d4}u; // 0 q, 1 k, 2 decays: their planes in xs
            let j = i % {d4}u;
            sh[i] = xs[which * plane + (t0 + tt) * p4 + h * {d4}u + j];
        }}
        workgroupBarrier();
        for (var tt = 0u; tt < nt; tt++) {{
            let t = t0 + tt;
            let qb = tt * {three_d4}u;
            let kb = qb + {d4}u;
            let gb = qb + {two_d4}u;
            let vq = xs[3u * plane + t * p4 + h * {d4}u + r / 4u];
            let v = vq[r % 4u];
            var m0 = 0.0;
            var m1 = 0.0;
            var m2 = 0.0;
            var m3 = 0.0;
{decay}            let delta = (v - ((m0 + m1) + (m2 + m3))) * beta[t * dims.heads + h];
            var a0 = 0.0;
            var a1 = 0.0;
            var a2 = 0.0;
            var a3 = 0.0;
{update}            y[t * dims.p + h * {d}u + r] = (a0 + a1) + (a2 + a3);
        }}
        workgroupBarrier();
    }}
{store}}}
",
        staged = TB * 3 * d4,
        tb = TB,
        three_d4 = 3 * d4,
        two_d4 = 2 * d4,
    )
}

impl KdaRecurrence {
    /// Whether the shader takes heads of `d` values.
    pub fn supports(d: usize) -> bool {
        d > 0 && d.is_multiple_of(4) && d <= MAX_HEAD_DIM
    }

    pub fn new(gpu: &Gpu, d: usize) -> Result<Self, GpuError> {
        if !Self::supports(d) {
            return Err(GpuError::Shape { what: "a KDA recurrence", why: format!("heads of {d} values") });
        }
        let module = gpu.module("kda", &shader(d));
        Ok(KdaRecurrence { pipeline: gpu.pipeline(&module, "recur", None), d, work: Mutex::new(None) })
    }

    /// The head size this recurrence was made for.
    pub fn head_dim(&self) -> usize {
        self.d
    }

    /// Walk `t_n` tokens through every head's state, in order, and wait. Shapes: s `[heads, D,
    /// D]` (rows are values, columns keys; updated in place, only when the whole call
    /// succeeded), q, k (normalised), g (decays), v, y `[T, heads, D]`; beta `[T, heads]`.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        gpu: &Gpu,
        s: &mut [f32],
        q: &[f32],
        k: &[f32],
        g: &[f32],
        v: &[f32],
        beta: &[f32],
        heads: usize,
        t_n: usize,
        y: &mut [f32],
    ) -> Result<(), GpuError> {
        let d = self.d;
        let p = heads * d;
        let n = t_n * p;
        let shapes_ok = [q.len(), k.len(), g.len(), v.len(), y.len()].iter().all(|&l| l == n)
            && beta.len() == t_n * heads
            && s.len() == heads * d * d;
        if heads == 0 || t_n == 0 || heads > MAX_GROUPS || !shapes_ok {
            return Err(GpuError::Shape {
                what: "a KDA recurrence",
                why: format!(
                    "{heads} heads of {d} x {t_n} tokens: q {} k {} g {} v {} y {} beta {} state {}",
                    q.len(),
                    k.len(),
                    g.len(),
                    v.len(),
                    y.len(),
                    beta.len(),
                    s.len()
                ),
            });
        }
        let mut work = self.work.lock().unwrap_or_else(|p| p.into_inner());
        if work.as_ref().is_none_or(|w| w.xs.len < 4 * n || w.beta.len < beta.len() || w.state.len != s.len()) {
            let (nx, nb) = match work.as_ref() {
                Some(w) => (w.xs.len.max(4 * n), w.beta.len.max(beta.len())),
                None => (4 * n, beta.len()),
            };
            *work = Some(Work {
                xs: gpu.zeros_f32(nx)?,
                beta: gpu.zeros_f32(nb)?,
                state: gpu.zeros_f32(s.len())?,
                y: gpu.zeros_f32(nx / 4)?,
                staging: gpu.staging((nx / 4).max(s.len())),
                up: work.take().map(|w| w.up).unwrap_or_default(),
            });
        }
        let Some(w) = work.as_mut() else { unreachable!("made above") };
        let plane = (n * 4) as u64;
        w.up.write(
            gpu,
            &[
                (&w.xs.buf, 0, bytemuck::cast_slice(q)),
                (&w.xs.buf, plane, bytemuck::cast_slice(k)),
                (&w.xs.buf, 2 * plane, bytemuck::cast_slice(g)),
                (&w.xs.buf, 3 * plane, bytemuck::cast_slice(v)),
                (&w.beta.buf, 0, bytemuck::cast_slice(beta)),
                (&w.state.buf, 0, bytemuck::cast_slice(s)),
            ],
        )?;
        let dims = gpu.uniform(&[heads as u32, t_n as u32, p as u32, 0]);
        let bind = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("kda recurrence"),
            layout: &self.pipeline.get_bind_group_layout(0),
            entries: &[
                wgpu::BindGroupEntry { binding: 0, resource: w.xs.buf.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 1, resource: w.beta.buf.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 2, resource: w.state.buf.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 3, resource: w.y.buf.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 4, resource: dims.as_entire_binding() },
            ],
        });
        let mut enc = gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("kda") });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
            pass.set_pipeline(&self.pipeline);
            pass.set_bind_group(0, &bind, &[]);
            pass.dispatch_workgroups(heads as u32, 1, 1);
        }
        gpu.queue.submit([enc.finish()]);
        // Outputs first, then the state: the caller's state changes only once both are here.
        gpu.read_f32_into(&GpuVec { buf: w.y.buf.clone(), len: n }, &w.staging, y)?;
        gpu.read_f32_into(&GpuVec { buf: w.state.buf.clone(), len: s.len() }, &w.staging, s)
    }
}
