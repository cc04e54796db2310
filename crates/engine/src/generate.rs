//! The one generation loop: the prompt in chunks, then one token at a time, with the caller's
//! [`Driver`] choosing each next token (greedy here, sampling and output parsing in the text
//! crate) and optional study hooks (router traces, routing overrides) around every token.

use std::collections::HashSet;
use std::time::Instant;

use anyhow::Result;
use serde::Serialize;

use crate::experts::{ExpertSource, Observed};
use crate::k3::{K3Model, K3State, RunConfig};
use crate::study::routing::RoutingOverride;
use crate::study::trace::TraceWriter;

/// What a caller of [`run`] decides along the way.
pub trait Driver {
    /// Polled before each prompt chunk and after each layer of it: false stops the run
    /// (cancellation; a chunk stopped part-way leaves the state to be discarded).
    fn keep_going(&mut self) -> bool {
        true
    }
    /// The whole prompt is in: the sequence's state and the logits after its last token.
    fn prompt_done(&mut self, _state: &K3State, _logits: &[f32]) {}
    /// A chunk of a prompt in several chunks went through, except the last (that is
    /// [`Self::prompt_done`]): `fed` tokens of the prompt given to the loop so far.
    fn chunk_done(&mut self, _state: &K3State, _logits: &[f32], _fed: usize) {}
    /// What processing the prompt took (called once, right after [`Self::prompt_done`]).
    fn prompt_stats(&mut self, _stats: &PromptStats) {}
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
    /// Called as the prompt goes through the model, after each layer of each chunk.
    pub progress: Option<&'a mut dyn FnMut(PromptProgress)>,
    /// Prompt states on disk (`generate --state-dir`): [`generate_with`] resumes from the
    /// longest stored prefix of the prompt and keeps the prompt's and the finished turn's state.
    pub states: Option<&'a mut crate::prefix_store::PrefixStore>,
    /// Start as if this many positions came before the prompt
    /// ([`K3Model::fill_context_synthetic`]): decode timed at a long context without its
    /// prompt (`bench --context-fill`). Not with `states`.
    pub context_fill: usize,
}

/// How far the prompt is: `layers_done` of `layers_total` (a layer of a chunk counts once per
/// token in the chunk), so a single large chunk still moves.
#[derive(Debug, Clone, Copy)]
pub struct PromptProgress {
    pub tokens_total: usize,
    pub layers_done: u64,
    pub layers_total: u64,
}

/// What processing the prompt took: the figures a time-to-first-token floor is made of.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PromptStats {
    pub tokens: usize,
    /// Tokens per chunk, and chunks.
    pub chunk: usize,
    pub chunks: usize,
    /// Routed-expert bytes read while the prompt was processed.
    pub expert_bytes_read: u64,
    /// Distinct (layer, expert) records the prompt's tokens chose: read at least once each,
    /// whatever the chunking.
    pub distinct_experts: usize,
    /// Streamed spine bytes read while the prompt was processed.
    pub spine_bytes_read: u64,
    /// Expert cache memory the prompt borrowed for its larger chunks (given back before the
    /// first new token).
    pub borrowed_bytes: u64,
    /// Seconds of the prompt in attention and in the feed-forward blocks ([`crate::k3::PhaseTimes`]);
    /// the rest went to embedding, norms, the head and waits for streamed spine layers.
    pub attention_s: f64,
    /// The MLA layers' part of `attention_s`.
    pub mla_attention_s: f64,
    /// The part of `attention_s` in the GPU's spine products (uploads, transfers and waits
    /// included; `--device gpu`).
    pub attention_gpu_s: f64,
    pub ffn_s: f64,
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
    let (mut chunk, borrow) = prompt_chunking(model.run(), prompt.len(), hooks.per_token());
    let (bytes0, spine0) = (experts.bytes_read(), model.spine_bytes_read());
    let phases0 = model.phases.seconds();
    let mut borrowed = 0;
    let fed = {
        // Gives the memory back when the prompt is through, on every way out of it (an error,
        // a cancellation, a panic that a server catches): the next request has the whole cache.
        let lent = LentCache { experts: &mut *experts, bufs: &mut *st, active: borrow > 0 };
        if borrow > 0 {
            borrowed = lent.experts.lend(borrow);
            if borrowed < borrow {
                // Part of the cache could not be lent: chunks as large as what was.
                let base = model.run().prefill_chunk.max(1);
                let per = model.run().prompt_borrowing.map_or(1, |b| b.token_bytes.max(1));
                chunk = balanced_chunk(prompt.len(), base + (borrowed / per) as usize);
            }
            tracing::debug!(
                "prompt of {} tokens in chunks of {chunk}, on {borrowed} bytes borrowed from the expert cache",
                prompt.len()
            );
        }
        feed_prompt(model, &mut *lent.experts, &mut *lent.bufs, logits, prompt, chunk, hooks, driver)
    };
    let Some(seen) = fed? else { return Ok(Ended::Cancelled) };
    driver.prompt_done(st, logits);
    let phases = model.phases.seconds() - phases0;
    driver.prompt_stats(&PromptStats {
        tokens: prompt.len(),
        chunk,
        chunks: prompt.len().div_ceil(chunk),
        expert_bytes_read: experts.bytes_read() - bytes0,
        distinct_experts: seen,
        spine_bytes_read: model.spine_bytes_read() - spine0,
        borrowed_bytes: borrowed,
        attention_s: phases.attention,
        mla_attention_s: phases.mla,
        attention_gpu_s: phases.attention_gpu,
        ffn_s: phases.ffn,
    });
    while let Some(token) = driver.next(logits)? {
        step(model, experts, st, &[token], logits, &mut hooks.routing, &mut hooks.trace, hooks.seq, &mut |_| true)?;
        driver.after_step(experts.bytes_read());
    }
    Ok(Ended::Done)
}

/// What holds a prompt chunk's activations: a sequence's state alone, a batch's buffers in the
/// batcher (`batch.rs`).
pub(crate) trait ChunkBuffers {
    /// Free the chunk's buffers (the next token allocates its own small ones again).
    fn release(&mut self);
}

impl ChunkBuffers for K3State {
    fn release(&mut self) {
        self.release_chunk_buffers();
    }
}

/// The expert cache's memory lent to a long prompt's chunk, given back when this is dropped:
/// the chunk's buffers leave the process, then the cache may fill again. A guard, so that an
/// error or a panic inside the prompt cannot leave the cache lent for good. The one mechanism
/// for a prompt alone (`run`) and for a batch's step (`batch::Batcher::step_while`).
pub(crate) struct LentCache<'a, B: ChunkBuffers> {
    pub experts: &'a mut dyn ExpertSource,
    pub bufs: &'a mut B,
    /// Whether the cache was lent (and so goes back).
    pub active: bool,
}

impl<B: ChunkBuffers> Drop for LentCache<'_, B> {
    fn drop(&mut self) {
        if self.active {
            self.bufs.release();
            crate::os::memory::return_free_heap();
            self.experts.take_back();
        }
    }
}

/// Prompt chunks for a prompt of `len` tokens, and the memory to borrow for them: chunks of the
/// plan's size, or, for a longer prompt the plan lets borrow, as few chunks as the borrowed
/// memory allows, of equal size (the same reads as unequal ones, less memory).
fn prompt_chunking(run: &RunConfig, len: usize, per_token: bool) -> (usize, u64) {
    let base = run.prefill_chunk.max(1);
    match run.prompt_borrowing {
        _ if per_token => (1, 0),
        Some(b) if len > base => {
            let chunk = balanced_chunk(len, b.max_chunk.max(base));
            (chunk, chunk.saturating_sub(base) as u64 * b.token_bytes)
        }
        _ => (base, 0),
    }
}

/// The equal chunk size for `len` tokens in as few chunks of at most `max` as possible.
pub(crate) fn balanced_chunk(len: usize, max: usize) -> usize {
    let chunks = len.div_ceil(max.max(1)).max(1);
    len.div_ceil(chunks).max(1)
}

/// The prompt through the model in chunks of `chunk`: the number of distinct (layer, expert)
/// records it chose, or `None` when the driver stopped it.
#[allow(clippy::too_many_arguments)]
fn feed_prompt(
    model: &K3Model,
    experts: &mut dyn ExpertSource,
    st: &mut K3State,
    logits: &mut [f32],
    prompt: &[u32],
    chunk: usize,
    hooks: &mut GenerateHooks<'_>,
    driver: &mut dyn Driver,
) -> Result<Option<usize>> {
    // The prompt's distinct (layer, expert) records.
    let mut seen = HashSet::new();
    let mut distinct =
        Observed { inner: experts, on_begin: |l: usize, e: &[usize]| seen.extend(e.iter().map(|&e| (l, e))) };
    let layers = model.layers.len() as u64;
    let mut progress =
        PromptProgress { tokens_total: prompt.len(), layers_done: 0, layers_total: layers * prompt.len() as u64 };
    let mut fed = 0;
    for tokens in prompt.chunks(chunk) {
        if !driver.keep_going() {
            return Ok(None);
        }
        if fed > 0 {
            driver.chunk_done(st, logits, fed);
        }
        fed += tokens.len();
        let before = progress.layers_done;
        let progress_hook = &mut hooks.progress;
        let mut on_layer = |l: usize| {
            if let Some(p) = progress_hook.as_deref_mut() {
                progress.layers_done = before + (l as u64 + 1) * tokens.len() as u64;
                p(progress);
            }
            // A large chunk can take minutes: a cancellation is honoured between layers.
            driver.keep_going()
        };
        let (routing, trace) = (&mut hooks.routing, &mut hooks.trace);
        if !step(model, &mut distinct, st, tokens, logits, routing, trace, hooks.seq, &mut on_layer)? {
            return Ok(None);
        }
        progress.layers_done = before + layers * tokens.len() as u64;
        driver.after_step(distinct.bytes_read());
    }
    Ok(Some(seen.len()))
}

/// One chunk through the model; per token, the routing override before and the trace after;
/// `on_layer` after each layer. False: `on_layer` stopped the chunk part-way.
#[allow(clippy::too_many_arguments)]
fn step(
    model: &K3Model,
    experts: &mut dyn ExpertSource,
    st: &mut K3State,
    tokens: &[u32],
    logits: &mut [f32],
    routing: &mut Option<&mut RoutingOverride>,
    trace: &mut Option<&mut TraceWriter>,
    seq: usize,
    on_layer: &mut dyn FnMut(usize) -> bool,
) -> Result<bool> {
    if let Some(r) = routing.as_deref_mut() {
        r.apply(model, st);
    }
    let pos = st.position;
    if !model.forward_chunk_with(st, experts, tokens, logits, on_layer)? {
        return Ok(false);
    }
    if let Some(t) = trace.as_deref_mut() {
        t.record(seq, pos, tokens[0], &st.routing)?;
    }
    Ok(true)
}

#[derive(Debug, Clone, Serialize)]
pub struct Timing {
    /// Seconds to process the prompt and produce the first new token's logits.
    pub prompt_s: f64,
    /// Seconds per decode step, one entry per generated token after the first.
    pub decode_step_s: Vec<f64>,
    /// Expert bytes read during each decode step.
    pub decode_step_bytes: Vec<u64>,
    /// Seconds of each decode step during which no read of the run was in flight (experts or
    /// streamed spine): the drive idled. Empty when the source reports no activity.
    pub decode_step_disk_idle_s: Vec<f64>,
    pub total_s: f64,
    pub expert_bytes_read: u64,
    /// What the prompt took (bytes, distinct experts, chunks).
    pub prompt: PromptStats,
}

#[derive(Debug, Clone, Serialize)]
pub struct Generation {
    pub prompt_tokens: Vec<u32>,
    /// Prompt tokens taken from a stored state instead of computed.
    pub cached_prompt_tokens: usize,
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
struct Greedy<'a> {
    /// Where the prompt's state is kept, and the whole prompt (the model sees only what was not
    /// resumed).
    states: Option<(&'a mut crate::prefix_store::PrefixStore, &'a [u32], usize)>,
    start: Instant,
    max_tokens: usize,
    eos: Option<u32>,
    tokens: Vec<u32>,
    prompt_logits: Vec<f32>,
    prompt_s: f64,
    stopped_at_eos: bool,
    /// When the step in progress started, the byte count then, and the disk's idle time then.
    step_start: Option<(Instant, u64, f64)>,
    activity: Option<std::sync::Arc<crate::stream::activity::DiskActivity>>,
    step_idle: Vec<f64>,
    last_bytes: u64,
    steps: Vec<f64>,
    step_bytes: Vec<u64>,
    prompt_stats: PromptStats,
}

impl Greedy<'_> {
    fn idle_s(&self) -> f64 {
        self.activity.as_ref().map(|a| a.idle().as_secs_f64()).unwrap_or(0.0)
    }
}

impl Driver for Greedy<'_> {
    fn prompt_stats(&mut self, stats: &PromptStats) {
        self.prompt_stats = stats.clone();
    }

    fn prompt_done(&mut self, state: &K3State, logits: &[f32]) {
        self.prompt_logits = logits.to_vec();
        self.prompt_s = self.start.elapsed().as_secs_f64();
        if let Some((store, prompt, _)) = self.states.as_mut()
            && let Err(e) = store.save(prompt, state, logits)
        {
            tracing::warn!("keeping the prompt's state on disk failed: {e}");
        }
    }

    fn chunk_done(&mut self, state: &K3State, logits: &[f32], fed: usize) {
        if let Some((store, prompt, resumed)) = self.states.as_mut()
            && let Some(done) = prompt.get(..*resumed + fed)
            && let Err(e) = store.save(done, state, logits)
        {
            tracing::warn!("keeping a prompt chunk's state on disk failed: {e}");
        }
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
        crate::stream::verify::measure::step_begins(self.steps.len());
        self.step_start = Some((Instant::now(), self.last_bytes, self.idle_s()));
        Ok(Some(next))
    }

    fn after_step(&mut self, expert_bytes_read: u64) {
        if let Some((t0, b0, idle0)) = self.step_start.take() {
            self.steps.push(t0.elapsed().as_secs_f64());
            self.step_bytes.push(expert_bytes_read - b0);
            if self.activity.is_some() {
                self.step_idle.push(self.idle_s() - idle0);
            }
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
    let mut st = model.new_state();
    if hooks.context_fill > 0 {
        anyhow::ensure!(hooks.states.is_none(), "a synthetic context fill cannot meet stored prompt states");
        model.fill_context_synthetic(&mut st, hooks.context_fill)?;
    }
    let bytes0 = experts.bytes_read();
    let start = Instant::now();
    let mut logits = vec![0f32; model.config.vocab_size]; // [vocab]
    let mut states = hooks.states.take();
    let resumed = match states.as_deref_mut() {
        // At least one prompt token is computed: its logits are the first sample's.
        Some(s) => s.restore_longest(prompt, prompt.len() - 1, &mut st, &mut logits).unwrap_or_else(|| {
            st = model.new_state();
            0
        }),
        None => 0,
    };
    let mut greedy = Greedy {
        states: states.map(|s| (s, prompt, resumed)),
        start,
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
        prompt_stats: PromptStats::default(),
        activity: model.run().disk_activity.clone(),
        step_idle: Vec::new(),
    };
    run(model, experts, &mut st, &mut logits, &prompt[resumed..], &mut hooks, &mut greedy)?;
    // The finished turn's state: the prompt and every generated token fed back.
    if let Some((store, _, _)) = greedy.states.as_mut() {
        let mut turn = prompt.to_vec();
        turn.extend_from_slice(&greedy.tokens);
        turn.truncate(st.position);
        if turn.len() == st.position
            && turn.len() > prompt.len()
            && let Err(e) = store.save(&turn, &st, &logits)
        {
            tracing::warn!("keeping the turn's state on disk failed: {e}");
        }
    }
    Ok(Generation {
        cached_prompt_tokens: resumed,
        prompt_tokens: prompt.to_vec(),
        tokens: greedy.tokens,
        prompt_logits: greedy.prompt_logits,
        timing: Timing {
            prompt_s: greedy.prompt_s,
            decode_step_s: greedy.steps,
            decode_step_bytes: greedy.step_bytes,
            decode_step_disk_idle_s: greedy.step_idle,
            total_s: greedy.start.elapsed().as_secs_f64(),
            expert_bytes_read: experts.bytes_read() - bytes0,
            prompt: greedy.prompt_stats,
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
