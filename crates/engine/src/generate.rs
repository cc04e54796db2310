//! The one generation loop: the prompt in chunks, then one token at a time, with the caller's
//! [`Driver`] choosing each next token (greedy here, sampling and output parsing in the text
//! crate) and optional study hooks (router traces, routing overrides) around every token.

use std::time::Instant;

use anyhow::Result;
use serde::Serialize;

use crate::experts::ExpertSource;
use crate::k3::{K3Model, K3State};
use crate::study::routing::RoutingOverride;
use crate::study::trace::TraceWriter;

/// Prompt tokens processed together, layer by layer.
pub const PROMPT_CHUNK: usize = 32;

/// What a caller of [`run`] decides along the way.
pub trait Driver {
    /// Polled before each prompt chunk: false stops the run (cancellation).
    fn keep_going(&mut self) -> bool {
        true
    }
    /// The whole prompt is in: the sequence's state and the logits after its last token.
    fn prompt_done(&mut self, _state: &K3State, _logits: &[f32]) {}
    /// The next token from the logits `[vocab]`: `Some` feeds it to the model and goes on,
    /// `None` ends the run (the driver knows why).
    fn next(&mut self, logits: &[f32]) -> Result<Option<u32>>;
    /// After each model step (a prompt chunk or a token), with the expert source's byte count.
    fn after_step(&mut self, _expert_bytes_read: u64) {}
}

/// How a [`run`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The driver ended it.
    Done,
    /// The driver stopped it during the prompt.
    Cancelled,
}

/// Study hooks around every token. With either set, the prompt goes one token at a time too
/// (a trace records, and an override pins, per token).
#[derive(Default)]
pub struct GenerateHooks<'a> {
    pub trace: Option<&'a mut TraceWriter>,
    /// Sequence number written into the trace.
    pub seq: usize,
    pub routing: Option<&'a mut RoutingOverride>,
}

impl GenerateHooks<'_> {
    fn per_token(&self) -> bool {
        self.trace.is_some() || self.routing.is_some()
    }
}

/// Feed `prompt` to the sequence `st` (which may already hold a prefix), then the tokens the
/// driver picks. `logits` `[vocab]` holds the logits after the last token fed.
pub fn run(
    model: &K3Model,
    experts: &mut dyn ExpertSource,
    st: &mut K3State,
    logits: &mut [f32],
    prompt: &[u32],
    hooks: &mut GenerateHooks<'_>,
    driver: &mut dyn Driver,
) -> Result<Ended> {
    let chunk = if hooks.per_token() { 1 } else { PROMPT_CHUNK };
    for tokens in prompt.chunks(chunk) {
        if !driver.keep_going() {
            return Ok(Ended::Cancelled);
        }
        step(model, experts, st, tokens, logits, hooks)?;
        driver.after_step(experts.bytes_read());
    }
    driver.prompt_done(st, logits);
    while let Some(token) = driver.next(logits)? {
        step(model, experts, st, &[token], logits, hooks)?;
        driver.after_step(experts.bytes_read());
    }
    Ok(Ended::Done)
}

/// One chunk through the model; per token, the routing override before and the trace after.
fn step(
    model: &K3Model,
    experts: &mut dyn ExpertSource,
    st: &mut K3State,
    tokens: &[u32],
    logits: &mut [f32],
    hooks: &mut GenerateHooks<'_>,
) -> Result<()> {
    if let Some(r) = hooks.routing.as_deref_mut() {
        r.apply(model, st);
    }
    let pos = st.position;
    model.forward_chunk(st, experts, tokens, logits)?;
    if let Some(t) = hooks.trace.as_deref_mut() {
        t.record(hooks.seq, pos, tokens[0], &st.routing)?;
    }
    Ok(())
}

#[derive(Debug, Clone, Serialize)]
pub struct Timing {
    /// Seconds to process the prompt and produce the first new token's logits.
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

/// Greedy decoding with per-step timing.
struct Greedy {
    start: Instant,
    max_tokens: usize,
    eos: Option<u32>,
    tokens: Vec<u32>,
    prompt_logits: Vec<f32>,
    prompt_s: f64,
    stopped_at_eos: bool,
    /// When the step in progress started, and the byte count then.
    step_start: Option<(Instant, u64)>,
    last_bytes: u64,
    steps: Vec<f64>,
    step_bytes: Vec<u64>,
}

impl Driver for Greedy {
    fn prompt_done(&mut self, _state: &K3State, logits: &[f32]) {
        self.prompt_logits = logits.to_vec();
        self.prompt_s = self.start.elapsed().as_secs_f64();
    }

    fn next(&mut self, logits: &[f32]) -> Result<Option<u32>> {
        if self.tokens.len() >= self.max_tokens {
            return Ok(None);
        }
        let next = argmax(logits);
        self.tokens.push(next);
        if Some(next) == self.eos {
            self.stopped_at_eos = true;
            return Ok(None);
        }
        if self.tokens.len() == self.max_tokens {
            return Ok(None);
        }
        self.step_start = Some((Instant::now(), self.last_bytes));
        Ok(Some(next))
    }

    fn after_step(&mut self, expert_bytes_read: u64) {
        if let Some((t0, b0)) = self.step_start.take() {
            self.steps.push(t0.elapsed().as_secs_f64());
            self.step_bytes.push(expert_bytes_read - b0);
        }
        self.last_bytes = expert_bytes_read;
    }
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

/// [`generate_greedy`] with study hooks.
pub fn generate_with(
    model: &K3Model,
    experts: &mut dyn ExpertSource,
    prompt: &[u32],
    max_tokens: usize,
    eos: Option<u32>,
    mut hooks: GenerateHooks<'_>,
) -> Result<Generation> {
    anyhow::ensure!(!prompt.is_empty(), "the prompt is empty");
    let bytes0 = experts.bytes_read();
    let mut greedy = Greedy {
        start: Instant::now(),
        max_tokens,
        eos,
        tokens: Vec::with_capacity(max_tokens),
        prompt_logits: Vec::new(),
        prompt_s: 0.0,
        stopped_at_eos: false,
        step_start: None,
        last_bytes: bytes0,
        steps: Vec::new(),
        step_bytes: Vec::new(),
    };
    let mut st = model.new_state();
    let mut logits = vec![0f32; model.config.vocab_size]; // [vocab]
    run(model, experts, &mut st, &mut logits, prompt, &mut hooks, &mut greedy)?;
    Ok(Generation {
        prompt_tokens: prompt.to_vec(),
        tokens: greedy.tokens,
        prompt_logits: greedy.prompt_logits,
        timing: Timing {
            prompt_s: greedy.prompt_s,
            decode_step_s: greedy.steps,
            decode_step_bytes: greedy.step_bytes,
            total_s: greedy.start.elapsed().as_secs_f64(),
            expert_bytes_read: experts.bytes_read() - bytes0,
        },
        stopped_at_eos: greedy.stopped_at_eos,
    })
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
