//! The GPU's two roofs (`shaders/roofline.wgsl`), measured in the run whose kernels they judge:
//! the rate at which it reads its own memory, and its f32 FMA rate. Each is the best of a few
//! timed submissions of many dispatches (the first, which compiles and warms, is not timed).

use std::time::Instant;

use crate::{Gpu, GpuError};

const SHADER: &str = include_str!("shaders/roofline.wgsl");
const TRIALS: usize = 4;
/// Invocations of the FMA probe, and workgroups of the read probe (each loops over its share).
const FMA_INVOCATIONS: u32 = 1 << 20;
const READ_GROUPS: u32 = 4096;

struct Probe {
    pipeline: wgpu::ComputePipeline,
    bind: wgpu::BindGroup,
    groups: u32,
}

fn probe(gpu: &Gpu, entry: &str, src_bytes: u64, count: u32, groups: u32) -> Probe {
    let d = &gpu.device;
    let pipeline = gpu.pipeline(&gpu.module("roofline", SHADER), entry, None);
    // The source is left as the driver gives it (zeroed by wgpu): reading is the point.
    let buf = |size: u64| {
        d.create_buffer(&wgpu::BufferDescriptor {
            label: Some("roofline"),
            size: size.max(16),
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        })
    };
    let src = buf(src_bytes);
    let sink = buf(u64::from(groups) * 256 * 4);
    let params = gpu.uniform(&[count, 0, 0, 0]);
    let layout = pipeline.get_bind_group_layout(0);
    // Every binding the entry point uses; the read probe's source is not used by the FMA probe
    // and is then absent from the derived layout.
    let mut entries = vec![
        wgpu::BindGroupEntry { binding: 1, resource: sink.as_entire_binding() },
        wgpu::BindGroupEntry { binding: 2, resource: params.as_entire_binding() },
    ];
    if entry == "read_all" {
        entries.insert(0, wgpu::BindGroupEntry { binding: 0, resource: src.as_entire_binding() });
    }
    let bind =
        d.create_bind_group(&wgpu::BindGroupDescriptor { label: Some(entry), layout: &layout, entries: &entries });
    Probe { pipeline, bind, groups }
}

/// Seconds per round of `record`: one untimed round (compiles, warms), one timed to size the
/// trials, then the best of `TRIALS` submissions of as many rounds as fill `secs / TRIALS` (one
/// submission of many rounds: the launch cost of each submission is spread thin).
pub fn time_rounds(gpu: &Gpu, secs: f64, mut record: impl FnMut(&mut wgpu::ComputePass<'_>)) -> Result<f64, GpuError> {
    gpu.run_passes(1, &mut record)?;
    let t0 = Instant::now();
    gpu.run_passes(1, &mut record)?;
    let one = t0.elapsed().as_secs_f64().max(1e-7);
    let reps = ((secs / TRIALS as f64 / one).ceil() as usize).clamp(1, 100_000);
    let mut best = one;
    for _ in 0..TRIALS {
        let t0 = Instant::now();
        gpu.run_passes(reps, &mut record)?;
        best = best.min(t0.elapsed().as_secs_f64() / reps as f64);
    }
    Ok(best)
}

/// GB/s at which the GPU reads a buffer of `bytes` (far larger than its caches for the figure
/// to be its memory's), best of a few trials over about `secs`.
pub fn read_bandwidth_gbps(gpu: &Gpu, bytes: u64, secs: f64) -> Result<f64, GpuError> {
    let bytes = bytes.min(gpu.max_binding()) / 16 * 16;
    let p = probe(gpu, "read_all", bytes, (bytes / 16) as u32, READ_GROUPS);
    let per = time_rounds(gpu, secs, |pass| {
        pass.set_pipeline(&p.pipeline);
        pass.set_bind_group(0, &p.bind, &[]);
        pass.dispatch_workgroups(p.groups, 1, 1);
    })?;
    Ok(bytes as f64 / per / 1e9)
}

/// The f32 FMA rate in GFLOP/s: `iters` iterations of 8 vec4 FMA chains on 2^20 invocations,
/// best of a few trials over about `secs`.
pub fn fma_peak_gflops(gpu: &Gpu, iters: u32, secs: f64) -> Result<f64, GpuError> {
    let groups = FMA_INVOCATIONS / 256;
    let p = probe(gpu, "fma_peak", 16, iters, groups);
    let per = time_rounds(gpu, secs, |pass| {
        pass.set_pipeline(&p.pipeline);
        pass.set_bind_group(0, &p.bind, &[]);
        pass.dispatch_workgroups(p.groups, 1, 1);
    })?;
    Ok(f64::from(FMA_INVOCATIONS) * f64::from(iters) * 8.0 * 4.0 * 2.0 / per / 1e9)
}

/// The host-GPU bus as the engine uses it, in GB/s, best of a few trials of `bytes`: up, a host
/// slice through the engine's kept upload buffer into a storage buffer until the GPU has it
/// (`buffers::Uploader`); back, a
/// storage buffer copied into a mapped read-back buffer and out into a host slice (what every
/// product's outputs take, `read_f32_into`).
pub fn bus_gbps(gpu: &Gpu, bytes: usize) -> Result<(f64, f64), GpuError> {
    let n = (bytes.min(gpu.max_binding() as usize) / 4).max(1);
    let host: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let v = gpu.zeros_f32(n)?;
    let staging = gpu.staging(n);
    let mut back = vec![0f32; n];
    let (mut up, mut down) = (f64::MAX, f64::MAX);
    let mut uploader = crate::buffers::Uploader::default();
    for _ in 0..TRIALS {
        let t0 = Instant::now();
        uploader.write(gpu, &[(&v.buf, 0, bytemuck::cast_slice(&host))])?;
        gpu.wait()?;
        up = up.min(t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        gpu.read_f32_into(&v, &staging, &mut back)?;
        down = down.min(t0.elapsed().as_secs_f64());
    }
    if back.iter().zip(&host).any(|(a, b)| a != b) {
        return Err(GpuError::Lost("the bus probe read back other values than it wrote".into()));
    }
    let b = (n * 4) as f64;
    Ok((b / up / 1e9, b / down / 1e9))
}
