//! `deltafin plan`'s answer to "how fast, and how much disk": per budget and drive rate, the
//! seconds per token of decode and the time to first token of a prompt, each the larger of the
//! drive's time for the bytes it must read and (when a compute rate is known) the processor's
//! time for the FLOPs it must do. These are floors in the sense of BENCHMARKS.md (a run cannot
//! beat them; measured runs land 1.0-2.1x above them on the machines measured), labelled as
//! estimates wherever they are printed.

use deltafin_engine::plan::{Plan, decode_work, prompt_flops};
use deltafin_store::manifest::Manifest;
use serde_json::{Value, json};

#[derive(Debug, Clone)]
pub struct Estimate {
    pub disk_gbps: f64,
    /// Decode at the run's context, cold cache, uniform routing.
    pub s_per_token: f64,
    pub decode_disk_s: f64,
    pub decode_compute_s: Option<f64>,
    pub prompt_tokens: usize,
    pub ttft_s: f64,
    pub ttft_chunks: usize,
    pub ttft_disk_s: f64,
    pub ttft_compute_s: Option<f64>,
    /// What bounds each figure: "drive" or "compute".
    pub decode_bound: &'static str,
    pub ttft_bound: &'static str,
}

impl Estimate {
    pub fn to_json(&self) -> Value {
        json!({
            "disk_gbps": self.disk_gbps, "s_per_token": self.s_per_token, "decode_disk_s": self.decode_disk_s,
            "decode_compute_s": self.decode_compute_s, "decode_bound": self.decode_bound,
            "prompt_tokens": self.prompt_tokens, "ttft_s": self.ttft_s, "ttft_chunks": self.ttft_chunks,
            "ttft_disk_s": self.ttft_disk_s, "ttft_compute_s": self.ttft_compute_s, "ttft_bound": self.ttft_bound,
        })
    }
}

impl DiskNeed {
    pub fn to_json(&self) -> Value {
        json!({
            "spine_bytes": self.spine_bytes, "expert_bytes": self.expert_bytes,
            "full_bytes": self.full_bytes, "stream_start_bytes": self.stream_start_bytes,
        })
    }
}

/// Expected distinct experts a chunk of `tokens` picks in one layer at uniform routing.
pub fn distinct_experts(experts: usize, k: usize, tokens: usize) -> f64 {
    let e = experts as f64;
    e * (1.0 - (1.0 - k as f64 / e).powf(tokens as f64))
}

/// The estimate for one plan at one drive rate; `gflops`: the sustained compute rate, if known.
pub fn estimate(m: &Manifest, plan: &Plan, disk_gbps: f64, prompt: usize, gflops: Option<f64>) -> Estimate {
    let rate = disk_gbps * 1e9;
    let k = plan.experts_per_token;
    let per_token = (plan.spine_bytes_per_token + plan.expected_expert_bytes_per_token) as f64;
    let decode_disk_s = per_token / rate;
    let work = decode_work(m, k, plan.context_tokens, plan.latent_cache.bytes());
    let decode_compute_s = gflops.map(|g| work.flops / (g * 1e9));
    // The prompt: as many chunks as the plan allows (borrowing the cache where it can), each
    // reading the streamed spine once and every distinct expert its tokens pick.
    let chunk = plan.prefill_chunk_lent.max(plan.prefill_chunk).max(1);
    let chunks = prompt.div_ceil(chunk).max(1);
    let per_chunk = prompt.div_ceil(chunks);
    let chunk_bytes = plan.spine_bytes_per_token as f64
        + plan.moe_layers as f64 * distinct_experts(plan.experts_per_layer, k, per_chunk) * plan.record_bytes as f64;
    let ttft_disk_s = chunks as f64 * chunk_bytes / rate;
    let ttft_compute_s = gflops.map(|g| prompt_flops(m, k, 0, prompt, chunks).0 / (g * 1e9));
    let bound = |disk: f64, compute: Option<f64>| match compute {
        Some(c) if c > disk => (c, "compute"),
        _ => (disk, "drive"),
    };
    let (s_per_token, decode_bound) = bound(decode_disk_s, decode_compute_s);
    let (ttft_s, ttft_bound) = bound(ttft_disk_s, ttft_compute_s);
    Estimate {
        disk_gbps,
        s_per_token,
        decode_disk_s,
        decode_compute_s,
        prompt_tokens: prompt,
        ttft_s,
        ttft_chunks: chunks,
        ttft_disk_s,
        ttft_compute_s,
        decode_bound,
        ttft_bound,
    }
}

/// Disk a store of this model needs.
#[derive(Debug, Clone)]
pub struct DiskNeed {
    pub spine_bytes: u64,
    pub expert_bytes: u64,
    /// `install` (full): spine and every expert.
    pub full_bytes: u64,
    /// `install --mode stream` at its start: the spine; experts are added as they are used.
    pub stream_start_bytes: u64,
}

pub fn disk_need(m: &Manifest) -> DiskNeed {
    let experts: u64 = m.experts.layers.iter().map(|l| l.experts.len() as u64).sum();
    let expert_bytes = experts * m.experts.record_bytes;
    DiskNeed {
        spine_bytes: m.spine.bytes,
        expert_bytes,
        full_bytes: m.spine.bytes + expert_bytes,
        stream_start_bytes: m.spine.bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_experts_saturate() {
        assert!((distinct_experts(896, 16, 1) - 16.0).abs() < 1e-9);
        assert!(distinct_experts(896, 16, 10_000) > 895.9);
        // 1,600 picks among 896: 896 (1 - (1 - 16/896)^100) = 748.2.
        let a = distinct_experts(896, 16, 100);
        assert!((a - 748.166).abs() < 0.01, "{a}");
    }
}
