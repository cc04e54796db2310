//! The memory plan: one number, the budget, decides how many expert cache slots fit after the
//! spine, the sequence state and the I/O buffers. Spine matrices are used by every token, so they
//! get memory before any cache slot.

use anyhow::{Result, bail};
use deltafin_store::{AttnKind, Manifest};
use serde::Serialize;

use crate::stream::geometry;

/// Process overhead we do not plan in detail (binary, allocator, per-token scratch, tokenizer).
pub const FIXED_OVERHEAD: u64 = 96 << 20;

/// Copies of a streamed spine layer alive at once (see `choose_resident`).
pub const STREAM_LAYER_COPIES: u64 = 4;

#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub budget_bytes: u64,
    /// Spine kept in memory (embeddings, head, resident layers).
    pub spine_bytes: u64,
    pub spine_resident_layers: usize,
    pub spine_streamed_layers: usize,
    /// Memory for streaming the other layers (read buffer + layer in use + layer loading).
    pub spine_stream_buffer_bytes: u64,
    /// Spine bytes read from disk per token (the streamed layers).
    pub spine_bytes_per_token: u64,
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
    geometry::slot_bytes(m.experts.layers.iter().flat_map(|l| &l.experts)) as u64
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

/// Spine bytes of each decoder layer, and of everything outside the layers (embeddings, final
/// norm, head).
pub fn spine_layer_bytes(m: &Manifest) -> (Vec<u64>, u64) {
    let mut per = vec![0u64; m.config.num_hidden_layers];
    let mut other = 0;
    for t in &m.spine.tensors {
        match t.layer {
            Some(l) if l < per.len() => per[l] += t.len + t.scales_len,
            _ => other += t.len + t.scales_len,
        }
    }
    (per, other)
}

/// How many leading decoder layers keep their spine in memory, and the memory the streamed rest
/// needs (two aligned read buffers, the decoded layer in use and the one decoded ahead).
fn choose_resident(per: &[u64], other: u64, rest: u64, budget: u64, forced: Option<usize>) -> Option<(usize, u64)> {
    let n = per.len();
    let cost = |r: usize| {
        let streamed_max = per[r..].iter().copied().max().unwrap_or(0);
        let reserve = if r < n { STREAM_LAYER_COPIES * streamed_max } else { 0 };
        (other + per[..r].iter().sum::<u64>() + reserve + rest, reserve)
    };
    if let Some(r) = forced {
        let r = r.min(n);
        return Some((r, cost(r).1));
    }
    (0..=n).rev().find(|&r| cost(r).0 <= budget).map(|r| (r, cost(r).1))
}

pub fn make_plan(
    m: &Manifest,
    budget: u64,
    context: usize,
    experts_per_token: usize,
    io_buffers: usize,
    resident_layers: Option<usize>,
    state_copies: usize,
) -> Result<Plan> {
    // The live sequence state, plus any snapshot kept for prefix reuse.
    let state = state_bytes(m, context) * state_copies.max(1) as u64;
    let snapshot_note =
        if state_copies > 1 { " (live state and prefix snapshot; serve --no-prefix-cache halves it)" } else { "" };
    let slot = slot_bytes(m);
    let io = io_buffers as u64 * slot;
    let (per_layer_spine, other_spine) = spine_layer_bytes(m);
    let rest = state + io + FIXED_OVERHEAD;
    let (resident, stream_reserve) =
        choose_resident(&per_layer_spine, other_spine, rest, budget, resident_layers).unwrap_or((0, u64::MAX / 4));
    let streamed_bytes: u64 = per_layer_spine[resident..].iter().sum();
    let spine = other_spine + per_layer_spine[..resident].iter().sum::<u64>();
    let fixed = spine.saturating_add(stream_reserve) + rest;
    let moe_layers = m.experts.layers.len();
    let experts = m.config.num_experts;
    if budget < fixed {
        bail!(
            "memory budget {} is below the minimum {} (embeddings and head {}, streamed spine layers {}, state {} for {context} tokens{snapshot_note}, I/O buffers {}, overhead {})",
            human(budget),
            human(other_spine + STREAM_LAYER_COPIES * per_layer_spine.iter().copied().max().unwrap_or(0) + rest),
            human(other_spine),
            human(STREAM_LAYER_COPIES * per_layer_spine.iter().copied().max().unwrap_or(0)),
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
        spine_resident_layers: resident,
        spine_streamed_layers: per_layer_spine.len() - resident,
        spine_stream_buffer_bytes: if resident < per_layer_spine.len() { stream_reserve } else { 0 },
        spine_bytes_per_token: streamed_bytes,
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
            "memory plan (budget {}):\n  spine            {} ({} layers resident, {} streamed: {} read per token, {} of buffers)\n  state + KV       {} ({} tokens of context)\n  I/O buffers      {} ({} x {})\n  expert cache     {} ({} slots per layer x {} MoE layers, of {} experts)\n  overhead         {}\n  expected expert reads per token at uniform routing: {} ({} experts x {} layers x {} x {:.1}% miss)",
            human(self.budget_bytes),
            human(self.spine_bytes),
            self.spine_resident_layers,
            self.spine_streamed_layers,
            human(self.spine_bytes_per_token),
            human(self.spine_stream_buffer_bytes),
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
    fn spine_gets_memory_before_cache_and_streams_what_does_not_fit() {
        let per = [100; 8];
        // Everything fits (50 + 800 + 10): all resident, no streaming buffers.
        assert_eq!(choose_resident(&per, 50, 10, 860, None), Some((8, 0)));
        // 50 + 10 + 4*100 (stream reserve) + r*100 <= 700 -> r = 2.
        assert_eq!(choose_resident(&per, 50, 10, 700, None), Some((2, 400)));
        // Not even the streaming reserve fits.
        assert_eq!(choose_resident(&per, 50, 10, 400, None), None);
        assert_eq!(choose_resident(&per, 50, 10, 10_000, Some(1)), Some((1, 400)));
    }

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
