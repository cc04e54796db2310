//! Finding and opening a GPU: which adapter, why none, and the device with the adapter's own
//! limits (the defaults of WebGPU cap a storage buffer at 128 MiB, less than one layer's experts).

use std::fmt;

use crate::GpuError;

/// Which adapters may be chosen.
#[derive(Clone, Debug, Default)]
pub struct GpuOptions {
    /// Accept a CPU-type adapter (Mesa's llvmpipe, WARP): right for testing the shaders, never
    /// chosen by default, since it computes on the cores the CPU path already uses.
    pub allow_software: bool,
    /// Only an adapter whose name contains this (case-insensitive), e.g. "H200" or "llvmpipe"; a
    /// CPU-type adapter named here is taken.
    pub name: Option<String>,
}

/// What a run reports about the adapter it used (`"adapter"` in JSON outputs).
#[derive(Clone, Debug)]
pub struct AdapterSummary {
    pub name: String,
    pub backend: String,
    pub device_type: String,
    pub driver: String,
}

impl fmt::Display for AdapterSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}, {}", self.name, self.backend, self.device_type)?;
        if !self.driver.is_empty() {
            write!(f, ", driver {}", self.driver)?;
        }
        write!(f, ")")
    }
}

fn summary(info: &wgpu::AdapterInfo) -> AdapterSummary {
    AdapterSummary {
        name: info.name.clone(),
        backend: format!("{:?}", info.backend),
        device_type: format!("{:?}", info.device_type),
        driver: [info.driver.as_str(), info.driver_info.as_str()]
            .iter()
            .filter(|s| !s.is_empty())
            .cloned()
            .collect::<Vec<_>>()
            .join(" "),
    }
}

/// Preference among adapter kinds: discrete first; a CPU-type adapter last, and only if allowed.
fn rank(t: wgpu::DeviceType) -> u8 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    }
}

/// An open GPU: device, queue and what it is. Clones share the device (the expert and spine
/// runners use one).
#[derive(Clone)]
pub struct Gpu {
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    pub(crate) limits: wgpu::Limits,
    adapter: AdapterSummary,
    /// Errors wgpu reported since the last wait (validation, out of memory): wgpu's default is
    /// to panic on them; here they become the error of the call that waits next.
    errors: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Gpu {
    /// Open the best adapter `opts` allows. The error names every adapter seen and why none was
    /// taken, so `--device gpu` on a machine without one says what to install or pass.
    pub fn open(opts: &GpuOptions) -> Result<Gpu, GpuError> {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle());
        let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
        let seen: Vec<AdapterSummary> = adapters.iter().map(|a| summary(&a.get_info())).collect();
        let wanted = opts.name.as_deref().map(str::to_lowercase);
        let chosen = adapters
            .into_iter()
            .filter(|a| {
                let info = a.get_info();
                // A CPU-type adapter only when allowed or asked for by name.
                let named = wanted.as_deref().is_some_and(|w| info.name.to_lowercase().contains(w));
                (wanted.is_none() || named)
                    && (opts.allow_software || named || info.device_type != wgpu::DeviceType::Cpu)
            })
            .min_by_key(|a| rank(a.get_info().device_type));
        let Some(adapter) = chosen else {
            return Err(GpuError::NoAdapter { seen, software_allowed: opts.allow_software, name: opts.name.clone() });
        };
        let info = summary(&adapter.get_info());
        // The adapter's own limits: storage buffers as large as the hardware allows (a layer's
        // routed experts are hundreds of MB), workgroup memory for the chunk kernel's tiles.
        let limits = adapter.limits();
        let desc = wgpu::DeviceDescriptor {
            label: Some("deltafin"),
            required_features: wgpu::Features::empty(),
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        };
        let (device, queue) = pollster::block_on(adapter.request_device(&desc))
            .map_err(|e| GpuError::Device { adapter: info.to_string(), why: e.to_string() })?;
        let errors = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = errors.clone();
        device.on_uncaptured_error(std::sync::Arc::new(move |e: wgpu::Error| {
            sink.lock().unwrap_or_else(|p| p.into_inner()).push(e.to_string());
        }));
        Ok(Gpu { device, queue, limits, adapter: info, errors })
    }

    pub fn adapter(&self) -> &AdapterSummary {
        &self.adapter
    }

    /// Whether this is a CPU-type adapter (llvmpipe): its timings say nothing about GPUs.
    pub fn is_software(&self) -> bool {
        self.adapter.device_type == format!("{:?}", wgpu::DeviceType::Cpu)
    }

    /// Whether the adapter's memory is the host's RAM (an integrated GPU, Apple's unified memory,
    /// or a CPU-type adapter): what it holds comes out of the same memory the host uses.
    pub fn shares_host_memory(&self) -> bool {
        let t = &self.adapter.device_type;
        *t == format!("{:?}", wgpu::DeviceType::IntegratedGpu) || *t == format!("{:?}", wgpu::DeviceType::Cpu)
    }

    /// The largest storage buffer one binding may hold, in bytes.
    pub fn max_binding(&self) -> u64 {
        self.limits.max_storage_buffer_binding_size.min(self.limits.max_buffer_size)
    }

    /// Compile WGSL source into a module.
    pub(crate) fn module(&self, label: &str, source: &str) -> wgpu::ShaderModule {
        self.device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(label),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        })
    }

    /// A compute pipeline for `entry` of `module`, with `layout` or the one derived from the
    /// entry point's bindings.
    pub(crate) fn pipeline(
        &self,
        module: &wgpu::ShaderModule,
        entry: &str,
        layout: Option<&wgpu::PipelineLayout>,
    ) -> wgpu::ComputePipeline {
        self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(entry),
            layout,
            module,
            entry_point: Some(entry),
            compilation_options: Default::default(),
            cache: None,
        })
    }

    /// Wait until everything submitted so far has finished; an error wgpu reported on the way
    /// is this call's.
    pub(crate) fn wait(&self) -> Result<(), GpuError> {
        self.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| GpuError::Lost(e.to_string()))?;
        let mut errors = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        if errors.is_empty() {
            return Ok(());
        }
        let all = std::mem::take(&mut *errors).join("; ");
        Err(GpuError::Rejected(all))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What wgpu reports (here: a write into a buffer that may not be written) is the error of
    /// the next wait, not a panic, and is reported once.
    #[test]
    fn wgpu_errors_are_errors_not_panics() {
        let Ok(g) = Gpu::open(&GpuOptions { allow_software: true, name: std::env::var("DELTAFIN_GPU_ADAPTER").ok() })
        else {
            assert!(
                std::env::var("DELTAFIN_REQUIRE_GPU").as_deref() != Ok("1"),
                "DELTAFIN_REQUIRE_GPU=1 but no GPU adapter opened"
            );
            println!("SKIPPED: no GPU adapter");
            return;
        };
        let b = g.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("read only"),
            size: 16,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        g.queue.write_buffer(&b, 0, &[0u8; 16]);
        match g.wait() {
            Err(GpuError::Rejected(m)) => assert!(m.contains("COPY_DST"), "{m}"),
            other => panic!("expected the write to be rejected, got {other:?}"),
        }
        assert!(g.wait().is_ok(), "an error is reported once");
    }
}
