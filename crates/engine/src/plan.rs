//! The memory plan: one number, the budget, decides how many expert cache slots fit after the
//! spine, the sequence state and the I/O buffers. Spine matrices are used by every token, so they
//! get memory before any cache slot.

use anyhow::{Result, bail};
use deltafin_store::{AttnKind, Manifest, SpineDtype};
use serde::Serialize;

use crate::blocks::mla::LatentDtype;
pub use crate::os::budget::CgroupMemory;
use crate::stream::geometry;

/// Process overhead we do not plan in detail (binary, allocator, per-token scratch, tokenizer).
pub const FIXED_OVERHEAD: u64 = 96 << 20;

/// Images of a streamed spine layer alive at once: the one being computed (the model's tensors
/// are views into it) and the one being read (see `stream::spine`).
pub const STREAM_LAYER_COPIES: u64 = crate::stream::spine::SPINE_BUFFERS as u64;

#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub budget_bytes: u64,
    /// Where the budget came from (`--memory-budget`, MemAvailable or a cgroup limit), so a
    /// plan that looks small can be traced to the limit that made it so.
    pub budget_source: String,
    /// Spine kept in memory (embeddings, head, resident layers).
    pub spine_bytes: u64,
    pub spine_resident_layers: usize,
    pub spine_streamed_layers: usize,
    /// Memory for streaming the other layers (the layer image computed on, the one being read,
    /// and each streamed layer's vectors and structures, kept by the loader between reads).
    pub spine_stream_buffer_bytes: u64,
    /// Spine bytes read from disk per token (the streamed layers).
    pub spine_bytes_per_token: u64,
    /// All the sequence states reserved (`state_copies` of them).
    pub state_bytes: u64,
    pub context_tokens: usize,
    /// How the MLA latent cache stores its values (bf16 or f32).
    pub latent_cache: LatentDtype,
    /// Sequence states reserved: the live one, a server's prefix snapshot, the state store's
    /// buffer.
    pub state_copies: usize,
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
    /// Prompt tokens processed together (each streamed spine layer and each distinct expert is
    /// read once per chunk), and the memory reserved for that chunk's activations.
    pub prefill_chunk: usize,
    pub prefill_bytes: u64,
    /// Where the chunk size came from (`--prefill-chunk`, or the budget).
    pub prefill_chunk_source: String,
    /// The largest chunk a long prompt may run by borrowing the expert cache's memory for as
    /// long as the prompt takes (equal to `prefill_chunk` when nothing can be borrowed: the
    /// chunk was forced, or every expert is cached), and the activation bytes of one prompt
    /// token that the borrowing is counted in.
    pub prefill_chunk_lent: usize,
    pub prefill_token_bytes: u64,
    /// Expert bytes read per token if routing were uniform and independent across tokens:
    /// `moe_layers * k * record * (1 - slots/experts)`. Real routing has locality; the trace
    /// tools measure it.
    pub expected_expert_bytes_per_token: u64,
}

/// Bytes of one expert buffer: the aligned windows of a record's ranges, back to back.
pub fn slot_bytes(m: &Manifest) -> u64 {
    geometry::slot_bytes(m.experts.layers.iter().flat_map(|l| &l.experts)) as u64
}

/// What the state line of a plan says when it reserves more than the live state.
fn copies_note(copies: usize) -> String {
    if copies > 1 { format!(" (x{copies}: the live state and its snapshots in memory)") } else { String::new() }
}

/// Recurrent state of every KDA layer plus the MLA latent cache for `context` tokens, at
/// `latent_bytes` per cached value (2 for bf16, 4 for f32).
pub fn state_bytes(m: &Manifest, context: usize, latent_bytes: usize) -> u64 {
    let c = &m.config;
    let lac = &c.linear_attn_config;
    let p = lac.num_heads * lac.head_dim;
    (0..c.num_hidden_layers)
        .map(|l| match c.attn_kind(l) {
            AttnKind::Kda => {
                (lac.num_heads * lac.head_dim * lac.head_dim + 3 * (lac.short_conv_kernel_size - 1) * p) * 4
            }
            AttnKind::Mla => context.saturating_mul((c.kv_lora_rank + c.qk_rope_head_dim) * latent_bytes),
        })
        .fold(0u64, |a, b| a.saturating_add(b as u64))
}

/// Bytes of a streamed layer the spine loader keeps between reads, beyond its image: a layer is
/// decoded once and kept, its matrices views into the image and its vectors (norms, conv taps,
/// biases) f32 copies, plus its names and block structures.
pub fn kept_layer_bytes(m: &Manifest) -> Vec<u64> {
    const STRUCTURES: u64 = 16 << 10;
    let mut per = vec![STRUCTURES; m.config.num_hidden_layers];
    for t in &m.spine.tensors {
        let elems: usize = t.shape.iter().product();
        let vector = t.shape.len() <= 1 || t.shape[..t.shape.len() - 1].iter().all(|&d| d == 1);
        if let Some(l) = t.layer.filter(|&l| l < per.len() && vector) {
            per[l] += 4 * elems as u64;
        }
    }
    per
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

/// Activation bytes one prompt token holds while its chunk goes through a layer: the block
/// attention residuals `[T, blocks, H]`, the int8 copy of the latent input (approximate mode)
/// and the routing, plus the chunk's share of the scratch pool. The pool hands a phase's
/// requests the smallest buffer that fits and grows the largest otherwise, so across phases it
/// ends up holding, for each rank of buffer size, the largest buffer of that rank in any phase:
/// the sum of the element-wise maxima of the phases' sorted buffer lists, not the largest
/// phase. Every phase holds the running sums, normed inputs and sub-layer outputs `[T, H]` x 3;
/// on top (per token, in floats):
/// - KDA: q, k, v before the conv, decay logits, gate and output `[P]` x 6, the decay's
///   low-rank input and its gate's `[D]` x 2, beta `[heads]`;
/// - MLA: queries `[heads, nope + rope]`, their low-rank input `[q_lora]`, latents
///   `[kv_lora + rope]`, the output and its gate `[heads, v]` x 2;
/// - a dense MLP: gate, up and activations `[I_dense]` x 3;
/// - latent MoE, while the shared experts run: router logits `[E]`, their output `[H]`, and
///   their gate, up and activations `[I_shared]` x 3;
/// - latent MoE, while the routed experts run: router logits `[E]`, the shared output `[H]`, the
///   latent inputs `[LAT]`, each routed expert's output `[k, LAT]`, the weighted sum `[LAT]`,
///   and one expert's batch, sized for the whole chunk: inputs and outputs `[LAT]` x 2 and
///   activations `[I]`.
///
/// Per-token scratch of the recurrences does not grow with the chunk and is in
/// [`FIXED_OVERHEAD`]. A test holds the pool of a real chunk to this figure.
pub fn prefill_token_bytes(m: &Manifest, experts_per_token: usize) -> u64 {
    let c = &m.config;
    let lac = &c.linear_attn_config;
    let (h, lat, i, k) = (c.hidden_size, c.expert_input_dim(), c.moe_intermediate_size, experts_per_token);
    let blocks = c.attn_res_block_size.map(|b| c.num_hidden_layers.div_ceil(b.max(1)) + 1).unwrap_or(0);
    let (p, d, kh) = (lac.num_heads * lac.head_dim, lac.head_dim, lac.num_heads);
    let heads = c.num_attention_heads;
    let shared = i * c.num_shared_experts;
    let kda = [p, p, p, p, p, p, d, d, kh];
    let mla = [
        heads * (c.qk_nope_head_dim + c.qk_rope_head_dim),
        c.q_lora_rank.unwrap_or(0),
        c.kv_lora_rank + c.qk_rope_head_dim,
        heads * c.v_head_dim,
        heads * c.v_head_dim,
    ];
    let dense = [c.intermediate_size; 3];
    let moe_shared = [c.num_experts, h, shared, shared, shared];
    let moe_routed = [c.num_experts, h, lat, k * lat, lat, lat, lat, i];
    // Only the kinds of layer the model has.
    let layers = 0..c.num_hidden_layers;
    let has = |f: &dyn Fn(usize) -> bool| layers.clone().any(f);
    let moe = has(&|l| c.is_moe_layer(l));
    let phases: Vec<&[usize]> = [
        (has(&|l| c.attn_kind(l) == AttnKind::Kda), &kda[..]),
        (has(&|l| c.attn_kind(l) == AttnKind::Mla), &mla[..]),
        (has(&|l| !c.is_moe_layer(l)), &dense[..]),
        (moe, &moe_shared[..]),
        (moe, &moe_routed[..]),
    ]
    .into_iter()
    .filter(|(present, _)| *present)
    .map(|(_, bufs)| bufs)
    .collect();
    let pool = 3 * h + pooled_floats(&phases);
    (4 * (pool + blocks * h) + lat + 3 * 8 * k) as u64
}

/// Floats a scratch pool holds after serving `phases` (each a list of buffer sizes alive at
/// once): for each rank of size, the largest buffer of that rank in any phase.
fn pooled_floats(phases: &[&[usize]]) -> usize {
    let sorted: Vec<Vec<usize>> = phases
        .iter()
        .map(|b| {
            let mut v = b.to_vec();
            v.sort_unstable_by(|a, b| b.cmp(a));
            v
        })
        .collect();
    let ranks = sorted.iter().map(Vec::len).max().unwrap_or(0);
    (0..ranks).map(|r| sorted.iter().filter_map(|v| v.get(r)).copied().max().unwrap_or(0)).sum()
}

/// Attention's cost per token of one model, apart from the matrices: the MLA layers' work per
/// cached position (scores over the latent and rope channels, values over the latent, all heads,
/// in the absorbed form) and the KDA layers' per-token state update. One place for the prompt
/// and decode floors.
struct AttentionCost {
    /// FLOPs per (token, attended position), summed over the MLA layers.
    mla_per_position: f64,
    /// FLOPs per token, summed over the KDA layers.
    kda_per_token: f64,
    /// Cached values per position, summed over the MLA layers (`kv_lora + rope` each).
    mla_values_per_position: f64,
}

fn attention_cost(c: &deltafin_store::K3Config) -> AttentionCost {
    let lac = &c.linear_attn_config;
    let (mut mla, mut kda) = (0.0, 0.0);
    for l in 0..c.num_hidden_layers {
        match c.attn_kind(l) {
            AttnKind::Mla => mla += 1.0,
            AttnKind::Kda => kda += 1.0,
        }
    }
    let width = (c.kv_lora_rank + c.qk_rope_head_dim) as f64;
    AttentionCost {
        // Per head: a dot over the width for the score, an axpy over the latent for the value.
        mla_per_position: mla * c.num_attention_heads as f64 * 2.0 * (width + c.kv_lora_rank as f64),
        kda_per_token: kda * (lac.num_heads * lac.head_dim * lac.head_dim) as f64 * 8.0,
        mla_values_per_position: mla * width,
    }
}

/// FLOPs of every layer matrix of the spine and the `k` routed experts of every MoE layer for
/// one token (the embedding is a row lookup; the head is apart).
fn matrix_flops_per_token(m: &Manifest, experts_per_token: usize) -> f64 {
    let c = &m.config;
    let layer_matrices: f64 = m
        .spine
        .tensors
        .iter()
        .filter(|t| t.layer.is_some() && t.shape.len() == 2)
        .map(|t| (t.shape[0] * t.shape[1]) as f64)
        .sum();
    let moe_layers = m.experts.layers.len() as f64;
    let expert = 3.0 * (c.moe_intermediate_size * c.expert_input_dim()) as f64;
    2.0 * (layer_matrices + moe_layers * experts_per_token as f64 * expert)
}

/// Floating-point operations (a multiply-add is two) to process a prompt of `tokens` tokens
/// after `context` cached positions, in `chunks` chunks: every layer matrix of the spine once per
/// token (the embedding is a row lookup; the head runs once per chunk, on its last token), the
/// routed experts (`k` per token per MoE layer, three MXFP4 matrices each), MLA's attention over
/// the positions before each token (scores and values in the absorbed latent form) and KDA's
/// per-head state update. The compute side of a time-to-first-token floor. Returns (all, the
/// attention's share).
pub fn prompt_flops(
    m: &Manifest,
    experts_per_token: usize,
    context: usize,
    tokens: usize,
    chunks: usize,
) -> (f64, f64) {
    let c = &m.config;
    let a = attention_cost(c);
    let (t, ctx) = (tokens as f64, context as f64);
    // Σ_{p=1..T} (context + p) positions attended to.
    let attended = t * ctx + t * (t + 1.0) / 2.0;
    let attention = a.mla_per_position * attended + a.kda_per_token * t;
    let head = chunks as f64 * 2.0 * (c.vocab_size * c.hidden_size) as f64;
    (matrix_flops_per_token(m, experts_per_token) * t + attention + head, attention)
}

/// The share of [`prompt_flops`] that approximate mode may run in integers (`--approx` on a CPU
/// with the integer kernels, prompt chunks of 16 tokens or more): every int8 layer matrix whose
/// rows are a multiple of 64 wide and the routed experts (widths multiples of 64), per token.
/// An upper bound (the router, `o_proj` and the MLPs' `down_proj` stay exact), so a floor that
/// puts this share at the integer roof is one the run cannot beat.
pub fn prompt_integer_flops(m: &Manifest, experts_per_token: usize, tokens: usize) -> f64 {
    let c = &m.config;
    let layer_matrices: f64 = m
        .spine
        .tensors
        .iter()
        .filter(|t| t.layer.is_some() && t.shape.len() == 2 && t.dtype == SpineDtype::Int8)
        .filter(|t| t.shape[1].is_multiple_of(64))
        .map(|t| (t.shape[0] * t.shape[1]) as f64)
        .sum();
    let widths = [c.moe_intermediate_size, c.expert_input_dim()];
    let expert = if widths.iter().all(|w| w.is_multiple_of(64)) {
        m.experts.layers.len() as f64 * experts_per_token as f64 * 3.0 * (widths[0] * widths[1]) as f64
    } else {
        0.0
    };
    2.0 * (layer_matrices + expert) * tokens as f64
}

/// What one decode step at a context of `context` positions computes and touches in memory:
/// the compute and memory sides of a decode floor (the disk side is the bytes it reads).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct DecodeWork {
    /// Every FLOP of the step: matrices, routed experts, head and attention.
    pub flops: f64,
    /// The attention's share of `flops`.
    pub attention_flops: f64,
    /// Bytes the step must read from memory at least once: every layer matrix of the spine, the
    /// head, the `k` routed expert records of every MoE layer and the MLA latent cache.
    pub bytes_touched: u64,
    /// The latent cache's share of `bytes_touched`: `kv_bytes` of every MLA layer at `context`.
    pub kv_bytes: u64,
}

pub fn decode_work(m: &Manifest, experts_per_token: usize, context: usize, latent_bytes: usize) -> DecodeWork {
    let c = &m.config;
    let (flops, attention_flops) = prompt_flops(m, experts_per_token, context, 1, 1);
    let a = attention_cost(c);
    let kv_bytes = (a.mla_values_per_position * (context + 1) as f64) as u64 * latent_bytes as u64;
    let (per_layer, _) = spine_layer_bytes(m);
    let head: u64 = m.spine.tensors.iter().filter(|t| t.name == "lm_head.weight").map(|t| t.len + t.scales_len).sum();
    let experts = m.experts.layers.len() as u64 * experts_per_token as u64 * m.experts.record_bytes;
    DecodeWork {
        flops,
        attention_flops,
        bytes_touched: per_layer.iter().sum::<u64>() + head + experts + kv_bytes,
        kv_bytes,
    }
}

/// Share of the memory beyond the minimum (embeddings, head, two streamed layer images, state,
/// I/O buffers) that prompt chunks take; resident spine layers and the expert cache share the
/// rest. On Kimi K3 at 24 GiB this is about 1.8 GiB (`deltafin plan --preset kimi-k3`), for
/// three resident layers fewer (1.6 GiB more read per token).
const PREFILL_SHARE_PERCENT: u64 = 10;

/// The prompt chunk: `forced` (`--prefill-chunk`), else as many tokens as fit in
/// [`PREFILL_SHARE_PERCENT`] of `avail`, at least one, at most `context` (a longer prompt goes
/// in several chunks).
fn choose_prefill_chunk(avail: u64, per_token: u64, context: usize, forced: Option<usize>) -> (usize, String) {
    if let Some(n) = forced {
        return (n.max(1), "--prefill-chunk".into());
    }
    let share = avail / 100 * PREFILL_SHARE_PERCENT;
    let n = (share / per_token.max(1)).clamp(1, context.max(1) as u64) as usize;
    let why = if n == context.max(1) { "the context length" } else { "the memory budget" };
    (n, format!("sized from {why}"))
}

/// What a plan is asked to fit besides the store's own sizes.
#[derive(Debug, Clone)]
pub struct PlanRequest {
    /// Context length the MLA cache is reserved for.
    pub context: usize,
    pub experts_per_token: usize,
    /// Expert read buffers beyond the cache.
    pub io_buffers: usize,
    /// `--resident-spine-layers`.
    pub resident_layers: Option<usize>,
    /// Sequence states kept at once: the live one, a server's prefix snapshot, and the state
    /// store's buffer (`--state-dir`) each count one.
    pub state_copies: usize,
    /// `--prefill-chunk`.
    pub prefill_chunk: Option<usize>,
    /// How the MLA latent cache stores its values.
    pub latent_cache: LatentDtype,
}

/// The MLA attention's working set (absorbed queries and latent outputs of a few tokens at a
/// time, whatever the chunk: `blocks::mla::Mla::working_bytes`), when the model has MLA layers.
pub fn mla_working_bytes(m: &Manifest) -> u64 {
    let c = &m.config;
    if !(0..c.num_hidden_layers).any(|l| c.attn_kind(l) == AttnKind::Mla) {
        return 0;
    }
    crate::blocks::mla::Mla::working_bytes(c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.v_head_dim)
        as u64
}

/// How many leading decoder layers keep their spine in memory, and the memory the streamed rest
/// needs (two layer images: the one computed on, the one being read; and each streamed layer
/// as the loader keeps it between reads, `kept`).
fn choose_resident(
    per: &[u64],
    kept: &[u64],
    other: u64,
    rest: u64,
    budget: u64,
    forced: Option<usize>,
) -> Option<(usize, u64)> {
    let n = per.len();
    let cost = |r: usize| {
        let streamed_max = per[r..].iter().copied().max().unwrap_or(0);
        let reserve = if r < n { STREAM_LAYER_COPIES * streamed_max + kept[r..].iter().sum::<u64>() } else { 0 };
        (other + per[..r].iter().sum::<u64>() + reserve + rest, reserve)
    };
    if let Some(r) = forced {
        let r = r.min(n);
        return Some((r, cost(r).1));
    }
    (0..=n).rev().find(|&r| cost(r).0 <= budget).map(|r| (r, cost(r).1))
}

/// The memory plan for `req` under `budget`, or why it cannot be made. A budget too small for the
/// requested context says the longest context it holds.
pub fn make_plan(m: &Manifest, budget: &Budget, req: &PlanRequest) -> Result<Plan> {
    match try_plan(m, budget, req) {
        Ok(p) => Ok(p),
        Err(Shortfall::Chunk(why)) => bail!("{why}"),
        Err(Shortfall::Budget(why)) => {
            let longest = longest_context(m, budget, req);
            let hint = if longest == 0 {
                "; not even one token of context fits: the budget is below what the model needs without any state"
                    .to_string()
            } else if longest < req.context {
                format!(
                    "; this budget holds a context of at most {longest} tokens (use --context {longest} or less, or a larger budget)"
                )
            } else {
                String::new()
            };
            bail!("{why}{hint}")
        }
    }
}

/// The longest context (up to the model's `max_position_embeddings`) whose state fits beside
/// the minimum of everything else under `budget`, with `req`'s other settings (a forced prompt
/// chunk left to the plan); 0 when not even one token fits.
pub fn longest_context(m: &Manifest, budget: &Budget, req: &PlanRequest) -> usize {
    let fits = |context: usize| {
        let r = PlanRequest { context, prefill_chunk: None, ..req.clone() };
        try_plan(m, budget, &r).is_ok()
    };
    let max = m.config.max_position_embeddings.max(1);
    if !fits(1) {
        return 0;
    }
    if fits(max) {
        return max;
    }
    // fits(lo), !fits(hi): the state grows with the context, so the answer is where it stops.
    let (mut lo, mut hi) = (1, max);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) { lo = mid } else { hi = mid }
    }
    lo
}

/// The share of the budget (in percent) the sequence states of an automatically sized
/// continuous batch may take: the spine and the expert cache keep the rest.
pub const BATCH_STATE_SHARE_PERCENT: u64 = 12;

/// The most sequences a continuous batch may carry under `budget`, at most `cap` and never
/// below 1: each keeps a state of its own at the full context, beside the `req.state_copies - 1`
/// others the run keeps (a server's prefix snapshot, the state store's buffer); the batch's
/// states together take at most [`BATCH_STATE_SHARE_PERCENT`] of the budget, and the plan
/// must still fit. Also returns one sequence's state in bytes.
pub fn batch_size(m: &Manifest, budget: &Budget, req: &PlanRequest, cap: usize) -> (usize, u64) {
    let one = state_bytes(m, req.context, req.latent_cache.bytes());
    let others = req.state_copies.saturating_sub(1);
    let share = budget.bytes / 100 * BATCH_STATE_SHARE_PERCENT;
    let fits = |n: usize| {
        let r = PlanRequest { state_copies: n + others, ..req.clone() };
        one.saturating_mul(n as u64) <= share && try_plan(m, budget, &r).is_ok()
    };
    ((2..=cap.max(1)).rev().find(|&n| fits(n)).unwrap_or(1), one)
}

/// Why no plan fits.
enum Shortfall {
    /// A forced prompt chunk does not fit.
    Chunk(String),
    /// The budget is below the minimum.
    Budget(String),
}

fn try_plan(m: &Manifest, budget: &Budget, req: &PlanRequest) -> Result<Plan, Shortfall> {
    let PlanRequest {
        context,
        experts_per_token,
        io_buffers,
        resident_layers,
        state_copies,
        prefill_chunk,
        latent_cache,
    } = req.clone();
    let (budget, budget_source) = (budget.bytes, budget.source.clone());
    // The live sequence state, plus any snapshot kept for prefix reuse.
    let state = state_bytes(m, context, latent_cache.bytes()).saturating_mul(state_copies.max(1) as u64);
    let snapshot_note = copies_note(state_copies);
    let slot = slot_bytes(m);
    let io = io_buffers as u64 * slot;
    let (per_layer_spine, other_spine) = spine_layer_bytes(m);
    let moe_layers = m.experts.layers.len();
    let experts = m.config.num_experts;
    // Prompt chunks get their memory before resident spine layers: one more chunk of a long
    // prompt re-reads every streamed layer and most experts (tens of GB on K3), while one
    // resident layer less costs one layer's bytes per token.
    let kept = kept_layer_bytes(m);
    let stream_minimum =
        STREAM_LAYER_COPIES * per_layer_spine.iter().copied().max().unwrap_or(0) + kept.iter().sum::<u64>();
    let minimum = other_spine + stream_minimum;
    let per_token = prefill_token_bytes(m, experts_per_token);
    // What no plan can do without: the process' own overhead and MLA's attention working set.
    let overhead = FIXED_OVERHEAD + mla_working_bytes(m);
    let beyond_minimum = budget.saturating_sub((minimum + io + overhead).saturating_add(state));
    let (mut chunk, mut chunk_source) = choose_prefill_chunk(beyond_minimum, per_token, context, prefill_chunk);
    let prefill = per_token.saturating_mul(chunk as u64);
    let rest = state.saturating_add(io + overhead + prefill);
    let (resident, stream_reserve) =
        choose_resident(&per_layer_spine, &kept, other_spine, rest, budget, resident_layers)
            .unwrap_or((0, u64::MAX / 4));
    let streamed_bytes: u64 = per_layer_spine[resident..].iter().sum();
    let spine = other_spine + per_layer_spine[..resident].iter().sum::<u64>();
    let fixed = spine.saturating_add(stream_reserve).saturating_add(rest);
    if prefill_chunk.is_some() && budget < fixed {
        return Err(Shortfall::Chunk(format!(
            "--prefill-chunk {chunk} needs {} of activations ({} per token), but the memory budget {} leaves {} after the spine, state and buffers; use a smaller chunk or a larger budget",
            human(prefill),
            human(per_token),
            human(budget),
            human(beyond_minimum)
        )));
    }
    if budget < fixed {
        return Err(Shortfall::Budget(format!(
            "memory budget {} ({budget_source}) is below the minimum {} (embeddings and head {}, streamed spine layers {}, state {} for {context} tokens{snapshot_note}, I/O buffers {}, overhead {})",
            human(budget),
            human(minimum.saturating_add(rest)),
            human(other_spine),
            human(stream_minimum),
            human(state),
            human(io),
            human(overhead)
        )));
    }
    let free = budget - fixed;
    let slots_total = free.checked_div(slot).unwrap_or(0);
    let per_layer = (slots_total as usize).checked_div(moe_layers).unwrap_or(0).min(experts);
    let mut prefill = prefill;
    if prefill_chunk.is_none() && per_layer == experts {
        // Everything is resident and cached: what is left goes to longer prompt chunks.
        let left = free - slot * (per_layer * moe_layers) as u64;
        let more = (left / per_token.max(1)).min(context.saturating_sub(chunk) as u64) as usize;
        if more > 0 {
            chunk += more;
            prefill += more as u64 * per_token;
            if chunk == context.max(1) {
                chunk_source = "sized from the context length".into();
            }
        }
    }
    let cache_bytes = per_layer as u64 * moe_layers as u64 * slot;
    // A chunk more of a long prompt re-reads every streamed layer and most experts, while the
    // cache saves little during a prompt (a large chunk picks nearly every expert): a prompt
    // borrows the cache's memory for larger chunks and gives it back before decoding. Not when
    // every expert is cached (nothing would be read again), nor for a forced chunk.
    let chunk_lent = if prefill_chunk.is_none() && per_layer < experts {
        let more = (cache_bytes / per_token.max(1)).min(context.saturating_sub(chunk) as u64) as usize;
        chunk + more
    } else {
        chunk
    };
    let miss = if experts == 0 { 0.0 } else { 1.0 - per_layer as f64 / experts as f64 };
    let record = m.experts.record_bytes;
    Ok(Plan {
        budget_bytes: budget,
        budget_source,
        spine_bytes: spine,
        spine_resident_layers: resident,
        spine_streamed_layers: per_layer_spine.len() - resident,
        spine_stream_buffer_bytes: if resident < per_layer_spine.len() { stream_reserve } else { 0 },
        spine_bytes_per_token: streamed_bytes,
        state_bytes: state,
        context_tokens: context,
        latent_cache,
        state_copies: state_copies.max(1),
        io_buffers,
        io_buffer_bytes: io,
        slot_bytes: slot,
        record_bytes: record,
        moe_layers,
        experts_per_layer: experts,
        experts_per_token,
        cache_slots_per_layer: per_layer,
        cache_bytes,
        overhead_bytes: overhead,
        prefill_chunk: chunk,
        prefill_bytes: prefill,
        prefill_chunk_source: chunk_source,
        prefill_chunk_lent: chunk_lent,
        prefill_token_bytes: per_token,
        expected_expert_bytes_per_token: (moe_layers as f64 * experts_per_token as f64 * record as f64 * miss) as u64,
    })
}

impl Plan {
    pub fn describe(&self) -> String {
        format!(
            "memory plan (budget {}: {}):\n  spine            {} ({} layers resident, {} streamed: {} read per token, {} for their images and kept layers)\n  state + KV       {} ({} tokens of context, {} latent cache{})\n  I/O buffers      {} ({} x {})\n  expert cache     {} ({} slots per layer x {} MoE layers, of {} experts)\n  prompt chunks    {} ({} tokens per chunk, {}{})\n  overhead         {}\n  expected expert reads per token at uniform routing: {} ({} experts x {} layers x {} x {:.1}% miss)",
            human(self.budget_bytes),
            self.budget_source,
            human(self.spine_bytes),
            self.spine_resident_layers,
            self.spine_streamed_layers,
            human(self.spine_bytes_per_token),
            human(self.spine_stream_buffer_bytes),
            human(self.state_bytes),
            self.context_tokens,
            self.latent_cache.name(),
            copies_note(self.state_copies),
            human(self.io_buffer_bytes),
            self.io_buffers,
            human(self.slot_bytes),
            human(self.cache_bytes),
            self.cache_slots_per_layer,
            self.moe_layers,
            self.experts_per_layer,
            human(self.prefill_bytes),
            self.prefill_chunk,
            self.prefill_chunk_source,
            if self.prefill_chunk_lent > self.prefill_chunk {
                format!("; a longer prompt borrows the expert cache for chunks of up to {}", self.prefill_chunk_lent)
            } else {
                String::new()
            },
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

pub use crate::units::human;

/// A memory budget and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budget {
    pub bytes: u64,
    /// E.g. `--memory-budget`, `85% of MemAvailable (...)`, `85% of cgroup v2 memory.max ...`.
    pub source: String,
}

impl Budget {
    /// A budget the user gave.
    pub fn given(bytes: u64) -> Self {
        Budget { bytes, source: "--memory-budget".into() }
    }
}

/// Share of the memory found free that the default budget takes: the rest is slack for what
/// the plan does not model (allocator fragmentation, the kernel's own use, other processes
/// starting later).
const DEFAULT_SHARE_PERCENT: u64 = 85;

/// Budget when the system tells nothing (an unknown platform, or /proc hidden).
const FALLBACK_BUDGET: u64 = 8 << 30;

/// The default budget: 85% of the memory this process may still use, as the platform tells it
/// (`os::budget`: on Linux the smaller of MemAvailable and the headroom under the cgroup's
/// limit; on a Mac the free memory less a reserve for the system and GPU; on Windows the
/// available physical memory).
pub fn default_budget() -> Budget {
    let free = crate::os::budget::free_memory();
    budget_from(free.host, free.cgroup.as_ref())
}

/// The default budget from what was found: 85% of the smaller of MemAvailable and the cgroup
/// headroom. Both count: a cgroup limit can be larger than what the host has free, and the host
/// can have far more free than the container may use.
///
/// The headroom is the limit less what is charged now (not the limit alone), because other
/// processes of the container hold part of it; this process' own use at start (the binary and
/// the tokenizer, before the model loads) is small and the plan's fixed overhead covers it.
pub fn budget_from(host: Option<(u64, String)>, cgroup: Option<&CgroupMemory>) -> Budget {
    let share = |b: u64| b / 100 * DEFAULT_SHARE_PERCENT;
    let host = host.map(|(a, what)| (share(a), format!("{DEFAULT_SHARE_PERCENT}% of {what} ({})", human(a))));
    let group = cgroup.map(|c| {
        let in_use = match c.in_use {
            Some(u) => format!("{} in use, page cache aside", human(u)),
            None => "usage unknown".into(),
        };
        let source = format!(
            "{DEFAULT_SHARE_PERCENT}% of the headroom under cgroup v{} {} of {} ({} limit, {in_use})",
            c.version,
            c.limit_file(),
            c.group,
            human(c.limit),
        );
        (share(c.headroom()), source)
    });
    let (bytes, source) = match (host, group) {
        (Some(h), Some(g)) => {
            if g.0 <= h.0 {
                g
            } else {
                h
            }
        }
        (Some(x), None) | (None, Some(x)) => x,
        (None, None) => (FALLBACK_BUDGET, format!("{} (the system told no free memory)", human(FALLBACK_BUDGET))),
    };
    Budget { bytes, source }
}

pub use crate::os::memory::peak_rss_bytes;

#[cfg(test)]
mod tests {
    use super::*;

    /// A prompt token reserves what stays alive through the chunk plus its layers' largest
    /// phase: on the K3 release the dense first layer's MLP; without it, the MoE, which is
    /// larger than the batched KDA projections.
    #[test]
    fn a_prompt_token_reserves_its_largest_phase() {
        let mut c = deltafin_store::synth::k3_release_config();
        let throughout = 4 * (3 + 93usize.div_ceil(12) + 1) * c.hidden_size;
        let with_dense = prefill_token_bytes(&deltafin_store::synth::paper_manifest(&c), 16) as usize;
        assert!(with_dense >= throughout + 4 * 3 * c.intermediate_size, "{with_dense}");
        c.first_k_dense_replace = 0;
        let moe_only = prefill_token_bytes(&deltafin_store::synth::paper_manifest(&c), 16) as usize;
        let kda = 4 * 6 * c.linear_attn_config.num_heads * c.linear_attn_config.head_dim;
        let moe = 4 * (c.hidden_size + c.expert_input_dim() * 19);
        assert!(moe_only < with_dense && moe_only >= throughout + moe.max(kda), "{moe_only}");
    }

    #[test]
    fn prefill_chunks_take_a_share_of_what_is_beyond_the_minimum() {
        // 10% of 1000 bytes at 10 per token.
        assert_eq!(choose_prefill_chunk(1000, 10, 4096, None).0, 10);
        // Never more than the context, never fewer than one token.
        assert_eq!(choose_prefill_chunk(1 << 40, 10, 4096, None).0, 4096);
        assert_eq!(choose_prefill_chunk(0, 10, 4096, None).0, 1);
        assert_eq!(choose_prefill_chunk(1000, 10, 4096, Some(3)), (3, "--prefill-chunk".into()));
    }

    #[test]
    fn spine_gets_memory_before_cache_and_streams_what_does_not_fit() {
        let per = [100; 8];
        let none = [0; 8];
        // Everything fits (50 + 800 + 10): all resident, no streaming buffers.
        assert_eq!(choose_resident(&per, &none, 50, 10, 860, None), Some((8, 0)));
        // 50 + 10 + 2*100 (stream reserve: two layer images) + r*100 <= 700 -> r = 4.
        assert_eq!(choose_resident(&per, &none, 50, 10, 700, None), Some((4, 200)));
        // Not even the streaming reserve fits.
        assert_eq!(choose_resident(&per, &none, 50, 10, 250, None), None);
        assert_eq!(choose_resident(&per, &none, 50, 10, 10_000, Some(1)), Some((1, 200)));
        // The loader keeps each streamed layer (5 each): with r = 4, 2*100 + 4*5 reserved, so
        // 50 + 10 + 220 + 400 = 680 fits 700 and r = 5 (60 + 215 + 500 = 775) does not.
        assert_eq!(choose_resident(&per, &[5; 8], 50, 10, 700, None), Some((4, 220)));
        assert_eq!(choose_resident(&per, &[5; 8], 50, 10, 675, None), Some((3, 225)));
    }

    const GIB: u64 = 1 << 30;

    #[test]
    fn default_budget_takes_the_tighter_of_host_and_cgroup() {
        let cg = CgroupMemory { version: 2, group: "/c".into(), limit: 4 * GIB, in_use: Some(GIB) };
        // The container is tighter than the host.
        let b = budget_from(Some((20 * GIB, "MemAvailable".into())), Some(&cg));
        assert_eq!(b.bytes, 3 * GIB / 100 * 85);
        assert!(
            b.source.starts_with("85% of the headroom under cgroup v2 memory.max of /c (4.00 GiB limit"),
            "{}",
            b.source
        );
        // The host is tighter than the container.
        let b = budget_from(Some((2 * GIB, "MemAvailable".into())), Some(&cg));
        assert_eq!(b, Budget { bytes: 2 * GIB / 100 * 85, source: "85% of MemAvailable (2.00 GiB)".into() });
        // No cgroup limit; nothing at all.
        assert_eq!(budget_from(Some((2 * GIB, "MemAvailable".into())), None).bytes, 2 * GIB / 100 * 85);
        let v1 = CgroupMemory { version: 1, group: "/".into(), limit: GIB, in_use: None };
        let b = budget_from(None, Some(&v1));
        assert_eq!(b.bytes, GIB / 100 * 85);
        assert!(b.source.contains("cgroup v1 memory.limit_in_bytes"), "{}", b.source);
        assert_eq!(budget_from(None, None).bytes, FALLBACK_BUDGET);
        // A group already over its limit leaves nothing, and the plan refuses to start.
        let full = CgroupMemory { version: 2, group: "/c".into(), limit: GIB, in_use: Some(2 * GIB) };
        assert_eq!(budget_from(Some((20 * GIB, "MemAvailable".into())), Some(&full)).bytes, 0);
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
