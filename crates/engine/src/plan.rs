//! The memory plan: one number, the budget, decides how many expert cache slots fit after the
//! spine, the sequence state and the I/O buffers. Spine matrices are used by every token, so they
//! get memory before any cache slot.

use anyhow::{Result, bail};
use deltafin_store::{AttnKind, Manifest};
use serde::Serialize;

use crate::stream::aligned::{align_down, align_up};

/// Process overhead we do not plan in detail (binary, allocator, per-token scratch, tokenizer).
pub const FIXED_OVERHEAD: u64 = 96 << 20;

#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub budget_bytes: u64,
    pub spine_bytes: u64,
    pub state_bytes: u64,
    pub context_tokens: usize,
    pub io_buffers: usize,
    pub io_buffer_bytes: u64,
    pub slot_bytes: u64,
    pub record_bytes: u64,
    pub moe_layers: usize,
    pub experts_per_layer: usize,
    pub experts_per_token: usize,
    pub cache_slots_per_layer: usize,
    pub cache_bytes: u64,
    pub overhead_bytes: u64,
    /// Expert bytes read per token if routing were uniform and independent across tokens:
    /// `moe_layers * k * record * (1 - slots/experts)`. Real routing has locality; the trace
    /// tools measure it.
    pub expected_expert_bytes_per_token: u64,
}

/// Bytes of one expert buffer: the aligned windows of a record's ranges, back to back.
pub fn slot_bytes(m: &Manifest) -> u64 {
    m.experts
        .layers
        .iter()
        .flat_map(|l| &l.experts)
        .map(|e| e.ranges.iter().map(|r| align_up(r[1] + r[2]) - align_down(r[1])).sum::<u64>())
        .max()
        .unwrap_or(4096)
}

/// RAM the spine takes once loaded (tensors keep their stored dtype).
pub fn spine_ram_bytes(m: &Manifest) -> u64 {
    m.spine.tensors.iter().map(|t| t.len + t.scales_len).sum()
}

/// Recurrent state of every KDA layer plus the MLA latent cache for `context` tokens.
pub fn state_bytes(m: &Manifest, context: usize) -> u64 {
    let c = &m.config;
    let lac = &c.linear_attn_config;
    let p = lac.num_heads * lac.head_dim;
    (0..c.num_hidden_layers)
        .map(|l| match c.attn_kind(l) {
            AttnKind::Kda => {
                (lac.num_heads * lac.head_dim * lac.head_dim + 3 * (lac.short_conv_kernel_size - 1) * p) * 4
            }
            AttnKind::Mla => context * (c.kv_lora_rank + c.qk_rope_head_dim) * 4,
        })
        .sum::<usize>() as u64
}

pub fn make_plan(
    m: &Manifest,
    budget: u64,
    context: usize,
    experts_per_token: usize,
    io_buffers: usize,
) -> Result<Plan> {
    let spine = spine_ram_bytes(m);
    let state = state_bytes(m, context);
    let slot = slot_bytes(m);
    let io = io_buffers as u64 * slot;
    let fixed = spine + state + io + FIXED_OVERHEAD;
    let moe_layers = m.experts.layers.len();
    let experts = m.config.num_experts;
    if budget < fixed {
        bail!(
            "memory budget {} is below the minimum {} (spine {}, state {} for {context} tokens, I/O buffers {}, overhead {}); \
             streaming the spine itself is not implemented yet",
            human(budget),
            human(fixed),
            human(spine),
            human(state),
            human(io),
            human(FIXED_OVERHEAD)
        );
    }
    let slots_total = (budget - fixed).checked_div(slot).unwrap_or(0);
    let per_layer = (slots_total as usize).checked_div(moe_layers).unwrap_or(0).min(experts);
    let miss = if experts == 0 { 0.0 } else { 1.0 - per_layer as f64 / experts as f64 };
    let record = m.experts.record_bytes;
    Ok(Plan {
        budget_bytes: budget,
        spine_bytes: spine,
        state_bytes: state,
        context_tokens: context,
        io_buffers,
        io_buffer_bytes: io,
        slot_bytes: slot,
        record_bytes: record,
        moe_layers,
        experts_per_layer: experts,
        experts_per_token,
        cache_slots_per_layer: per_layer,
        cache_bytes: per_layer as u64 * moe_layers as u64 * slot,
        overhead_bytes: FIXED_OVERHEAD,
        expected_expert_bytes_per_token: (moe_layers as f64 * experts_per_token as f64 * record as f64 * miss) as u64,
    })
}

impl Plan {
    pub fn describe(&self) -> String {
        format!(
            "memory plan (budget {}):\n  spine            {}\n  state + KV       {} ({} tokens of context)\n  I/O buffers      {} ({} x {})\n  expert cache     {} ({} slots per layer x {} MoE layers, of {} experts)\n  overhead         {}\n  expected expert reads per token at uniform routing: {} ({} experts x {} layers x {} x {:.1}% miss)",
            human(self.budget_bytes),
            human(self.spine_bytes),
            human(self.state_bytes),
            self.context_tokens,
            human(self.io_buffer_bytes),
            self.io_buffers,
            human(self.slot_bytes),
            human(self.cache_bytes),
            self.cache_slots_per_layer,
            self.moe_layers,
            self.experts_per_layer,
            human(self.overhead_bytes),
            human(self.expected_expert_bytes_per_token),
            self.experts_per_token,
            self.moe_layers,
            human(self.record_bytes),
            100.0 * (1.0 - self.cache_slots_per_layer as f64 / self.experts_per_layer.max(1) as f64),
        )
    }
}

/// `1.5G`, `512M`, `24GiB`, `1000000` -> bytes (binary units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num.trim().parse().map_err(|_| format!("'{s}' is not a size (try 24G or 512M)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        u => return Err(format!("unknown size unit '{u}' in '{s}'")),
    };
    if !v.is_finite() || v < 0.0 {
        return Err(format!("'{s}' is not a size"));
    }
    Ok((v * mult as f64) as u64)
}

pub fn human(b: u64) -> String {
    let b = b as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else if b >= (1u64 << 20) as f64 {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{b} B")
    }
}

/// The default budget: 85% of the memory the kernel reports available.
pub fn default_budget() -> u64 {
    let avail = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| {
        t.lines()
            .find(|l| l.starts_with("MemAvailable:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
    });
    avail.map(|kb| kb * 1024 / 100 * 85).unwrap_or(8 << 30)
}

/// Peak resident set size of this process so far (VmHWM), in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    let t = std::fs::read_to_string("/proc/self/status").ok()?;
    let l = t.lines().find(|l| l.starts_with("VmHWM:"))?;
    l.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("24G"), Ok(24 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5g"), Ok(3 << 29));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("-1G").is_err());
        assert!(parse_size("3Q").is_err());
    }
}
