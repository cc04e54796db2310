//! What a GPU's memory holds for a run (`--gpu-memory`), one computation for the session that
//! makes the GPU's runners, the start-up lines and `deltafin plan`: the spine's matrices first
//! (what every prompt chunk uses), up to the spine's size; in what they leave, routed experts
//! cached on the GPU, up to the model's count; and what that leaves to cross the bus (the spine
//! past the share, once per prompt chunk; the chosen experts the cache does not hold, per decode
//! token at uniform routing). Where the GPU shares the host's memory (integrated GPUs, Apple's
//! unified memory, CPU-type adapters), the share comes out of the host's budget instead
//! ([`host_budget`]).

use anyhow::Result;
use serde::Serialize;

use crate::plan::{Budget, Plan};
use crate::units::human;

/// Bytes of GPU memory when `--gpu-memory` is not given: what a GPU with 12 GB or more has room
/// for beside the experts' slots and a chunk's buffers (wgpu does not say how much memory an
/// adapter has).
pub const DEFAULT_GPU_MEMORY: u64 = 8 << 30;

/// How a GPU share splits, and what crosses the bus.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct GpuSplit {
    /// The whole share (`--gpu-memory`).
    pub total: u64,
    /// Spine matrices kept on the GPU at most.
    pub spine_kept: u64,
    /// Spine bytes past that, sent for each prompt chunk's products.
    pub spine_sent_per_chunk: u64,
    /// Routed experts cached on the GPU.
    pub experts_cached: usize,
    /// Routed experts of the model.
    pub experts_all: usize,
    /// Expert bytes crossing the bus per decode token at uniform routing (the chosen experts
    /// the cache does not hold).
    pub bus_bytes_per_token: u64,
}

impl GpuSplit {
    /// `total` bytes of GPU memory for a model whose spine's matrices take `spine` bytes, under
    /// `plan` (its experts' count, size and top-k).
    pub fn new(total: u64, spine: u64, plan: &Plan) -> Self {
        let spine_kept = total.min(spine);
        let experts_all = plan.moe_layers * plan.experts_per_layer;
        let experts_cached = (((total - spine_kept) / plan.record_bytes.max(1)) as usize).min(experts_all);
        let missed = 1.0 - experts_cached as f64 / experts_all.max(1) as f64;
        let per_token = (plan.experts_per_token * plan.moe_layers) as f64 * plan.record_bytes as f64 * missed;
        GpuSplit {
            total,
            spine_kept,
            spine_sent_per_chunk: spine - spine_kept,
            experts_cached,
            experts_all,
            bus_bytes_per_token: per_token as u64,
        }
    }

    /// One line on what sits where and what crosses the bus.
    pub fn describe(&self) -> String {
        format!(
            "GPU memory {}: spine matrices {} kept (prompt chunks send the other {} per chunk), {} of {} routed experts cached; over the bus per decode token at uniform routing: {} of experts ({:.0}% of the chosen ones not held on the GPU)",
            human(self.total),
            human(self.spine_kept),
            human(self.spine_sent_per_chunk),
            self.experts_cached,
            self.experts_all,
            human(self.bus_bytes_per_token),
            100.0 * (1.0 - self.experts_cached as f64 / self.experts_all.max(1) as f64)
        )
    }
}

/// Bytes of GPU memory for a run: `--gpu-memory`, else [`DEFAULT_GPU_MEMORY`], or a quarter of
/// the host's budget where the GPU shares the host's memory (whichever is smaller).
pub fn gpu_memory_for(given: Option<u64>, budget: u64, shared: bool) -> u64 {
    match given {
        Some(b) => b,
        None if shared => DEFAULT_GPU_MEMORY.min(budget / 4),
        None => DEFAULT_GPU_MEMORY,
    }
}

/// The host's budget less what a GPU sharing its memory holds; an error when nothing would be
/// left.
pub fn host_budget(budget: Budget, gpu: u64) -> Result<Budget> {
    anyhow::ensure!(
        gpu < budget.bytes,
        "--gpu-memory {} is all of the memory budget {} ({}): this GPU shares the host's memory, so what it holds comes out of that budget; give it less",
        human(gpu),
        human(budget.bytes),
        budget.source
    );
    Ok(Budget {
        bytes: budget.bytes - gpu,
        source: format!("{}, less the GPU's {} in the same memory", budget.source, human(gpu)),
    })
}
