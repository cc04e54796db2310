//! Greedy generation over a model and an expert source, with timing, optional router traces and
//! optional routing overrides (for cache studies on synthetic stores).

use std::time::Instant;

use anyhow::Result;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::experts::ExpertSource;
use crate::k3::{K3Model, K3State};
use crate::trace::{Trace, TraceWriter};

#[derive(Debug, Clone, Serialize)]
pub struct Timing {
    /// Seconds to process the prompt (token by token) and produce the first new token's logits.
    pub prompt_s: f64,
    /// Seconds per decode step, one entry per generated token after the first.
    pub decode_step_s: Vec<f64>,
    /// Expert bytes read during each decode step.
    pub decode_step_bytes: Vec<u64>,
    pub total_s: f64,
    pub expert_bytes_read: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Generation {
    pub prompt_tokens: Vec<u32>,
    pub tokens: Vec<u32>,
    /// Logits after the last prompt token `[vocab]`.
    #[serde(skip)]
    pub prompt_logits: Vec<f32>,
    pub timing: Timing,
    /// True when generation stopped at the end-of-sequence token.
    pub stopped_at_eos: bool,
}

pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Replaces the router's choice before each token (the `pinned` routing mechanism), to study
/// caches with realistic or tunable locality on stores whose random routers are uniform.
pub enum RoutingOverride {
    /// Replay a recorded trace, token by token (wrapping around).
    Trace { trace: Trace, next: usize },
    /// Each expert repeats one of the previous token's picks in its layer with probability
    /// `locality`, else is uniform among the rest.
    Synthetic { locality: f64, rng: SmallRng },
}

impl RoutingOverride {
    pub fn synthetic(locality: f64, seed: u64) -> Self {
        RoutingOverride::Synthetic { locality, rng: SmallRng::seed_from_u64(seed) }
    }

    fn apply(&mut self, model: &K3Model, st: &mut K3State) {
        let experts = model.config.num_experts;
        let k = model.config.num_experts_per_token;
        match self {
            RoutingOverride::Trace { trace, next } => {
                if trace.tokens.is_empty() {
                    return;
                }
                let t = &trace.tokens[*next % trace.tokens.len()];
                *next += 1;
                for tl in &t.layers {
                    if let Some(r) = st.routing.get_mut(tl.layer) {
                        r.experts = tl.experts.iter().copied().filter(|&e| e < experts).take(k).collect();
                        r.pinned = !r.experts.is_empty();
                    }
                }
            }
            RoutingOverride::Synthetic { locality, rng } => {
                for l in 0..model.layers.len() {
                    if !model.config.is_moe_layer(l) {
                        continue;
                    }
                    let prev = std::mem::take(&mut st.routing[l].experts);
                    let mut pick: Vec<usize> = Vec::with_capacity(k);
                    while pick.len() < k {
                        let e = if !prev.is_empty() && rng.random_bool(*locality) {
                            prev[rng.random_range(0..prev.len())]
                        } else {
                            rng.random_range(0..experts)
                        };
                        if !pick.contains(&e) {
                            pick.push(e);
                        }
                    }
                    st.routing[l].experts = pick;
                    st.routing[l].pinned = true;
                }
            }
        }
    }
}

/// Prompt tokens processed together, layer by layer.
pub const PROMPT_CHUNK: usize = 32;

/// Options for [`generate_greedy`] beyond the prompt.
#[derive(Default)]
pub struct GenerateHooks<'a> {
    pub trace: Option<&'a mut TraceWriter>,
    /// Sequence number written into the trace.
    pub seq: usize,
    pub routing: Option<&'a mut RoutingOverride>,
}

/// Greedy decode `max_tokens` tokens after `prompt`, stopping early at `eos` when given.
pub fn generate_greedy(
    model: &K3Model,
    experts: &mut dyn ExpertSource,
    prompt: &[u32],
    max_tokens: usize,
    eos: Option<u32>,
) -> Result<Generation> {
    generate_with(model, experts, prompt, max_tokens, eos, GenerateHooks::default())
}

pub fn generate_with(
    model: &K3Model,
    experts: &mut dyn ExpertSource,
    prompt: &[u32],
    max_tokens: usize,
    eos: Option<u32>,
    mut hooks: GenerateHooks<'_>,
) -> Result<Generation> {
    anyhow::ensure!(!prompt.is_empty(), "the prompt is empty");
    let start = Instant::now();
    let bytes0 = experts.bytes_read();
    let mut st = model.new_state();
    let mut logits = vec![0f32; model.config.vocab_size]; // [vocab]
    if hooks.trace.is_none() && hooks.routing.is_none() {
        // Layer by layer in chunks: each spine layer fetched and each distinct expert read once
        // per chunk (bit-identical to token by token; traces and routing overrides need the
        // per-token path).
        for chunk in prompt.chunks(PROMPT_CHUNK) {
            model.forward_chunk(&mut st, experts, chunk, &mut logits)?;
        }
    } else {
        for &t in prompt {
            step(model, experts, &mut st, t, &mut logits, &mut hooks)?;
        }
    }
    let prompt_logits = logits.clone();
    let prompt_s = start.elapsed().as_secs_f64();
    let mut tokens = Vec::with_capacity(max_tokens);
    let (mut steps, mut step_bytes) = (Vec::new(), Vec::new());
    let mut stopped_at_eos = false;
    while tokens.len() < max_tokens {
        let next = argmax(&logits);
        tokens.push(next);
        if Some(next) == eos {
            stopped_at_eos = true;
            break;
        }
        if tokens.len() == max_tokens {
            break;
        }
        let t0 = Instant::now();
        let b0 = experts.bytes_read();
        step(model, experts, &mut st, next, &mut logits, &mut hooks)?;
        steps.push(t0.elapsed().as_secs_f64());
        step_bytes.push(experts.bytes_read() - b0);
    }
    Ok(Generation {
        prompt_tokens: prompt.to_vec(),
        tokens,
        prompt_logits,
        timing: Timing {
            prompt_s,
            decode_step_s: steps,
            decode_step_bytes: step_bytes,
            total_s: start.elapsed().as_secs_f64(),
            expert_bytes_read: experts.bytes_read() - bytes0,
        },
        stopped_at_eos,
    })
}

/// One token through the model, with the routing override before and the trace after.
fn step(
    model: &K3Model,
    experts: &mut dyn ExpertSource,
    st: &mut K3State,
    token: u32,
    logits: &mut [f32],
    hooks: &mut GenerateHooks<'_>,
) -> Result<()> {
    if let Some(r) = hooks.routing.as_deref_mut() {
        r.apply(model, st);
    }
    let pos = st.position;
    model.forward(st, experts, token, logits)?;
    if let Some(t) = hooks.trace.as_deref_mut() {
        t.record(hooks.seq, pos, token, &st.routing)?;
    }
    Ok(())
}

/// Logits at every position of `tokens`, one row per token. Shape: `[len, vocab]`.
pub fn all_logits(model: &K3Model, experts: &mut dyn ExpertSource, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
    let mut st = model.new_state();
    let mut out = Vec::with_capacity(tokens.len());
    for &t in tokens {
        let mut logits = vec![0f32; model.config.vocab_size]; // [vocab]
        model.forward(&mut st, experts, t, &mut logits)?;
        out.push(logits);
    }
    Ok(out)
}
