//! Greedy generation over a model and an expert source, with timing.

use std::time::Instant;

use anyhow::Result;
use serde::Serialize;

use crate::experts::ExpertSource;
use crate::k3::K3Model;

#[derive(Debug, Clone, Serialize)]
pub struct Timing {
    /// Seconds to process the prompt (token by token) and produce the first new token's logits.
    pub prompt_s: f64,
    /// Seconds per decode step, one entry per generated token after the first.
    pub decode_step_s: Vec<f64>,
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

/// Greedy decode `max_tokens` tokens after `prompt`, stopping early at `eos` when given.
pub fn generate_greedy(
    model: &K3Model,
    experts: &mut dyn ExpertSource,
    prompt: &[u32],
    max_tokens: usize,
    eos: Option<u32>,
) -> Result<Generation> {
    anyhow::ensure!(!prompt.is_empty(), "the prompt is empty");
    let start = Instant::now();
    let bytes0 = experts.bytes_read();
    let mut st = model.new_state();
    let mut logits = vec![0f32; model.config.vocab_size]; // [vocab]
    for &t in prompt {
        model.forward(&mut st, experts, t, &mut logits)?;
    }
    let prompt_logits = logits.clone();
    let prompt_s = start.elapsed().as_secs_f64();
    let mut tokens = Vec::with_capacity(max_tokens);
    let mut steps = Vec::new();
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
        model.forward(&mut st, experts, next, &mut logits)?;
        steps.push(t0.elapsed().as_secs_f64());
    }
    Ok(Generation {
        prompt_tokens: prompt.to_vec(),
        tokens,
        prompt_logits,
        timing: Timing {
            prompt_s,
            decode_step_s: steps,
            total_s: start.elapsed().as_secs_f64(),
            expert_bytes_read: experts.bytes_read() - bytes0,
        },
        stopped_at_eos,
    })
}

/// Logits at every position of `tokens`, one row per token. Shape: `[len, vocab]`.
pub fn all_logits(
    model: &K3Model,
    experts: &mut dyn ExpertSource,
    tokens: &[u32],
) -> Result<Vec<Vec<f32>>> {
    let mut st = model.new_state();
    let mut out = Vec::with_capacity(tokens.len());
    for &t in tokens {
        let mut logits = vec![0f32; model.config.vocab_size]; // [vocab]
        model.forward(&mut st, experts, t, &mut logits)?;
        out.push(logits);
    }
    Ok(out)
}
