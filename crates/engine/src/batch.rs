//! Continuous batching: up to `max_batch` sequences share every model step. Sequences join and
//! leave between steps; a joining sequence's prompt goes through in chunks that ride in the same
//! steps as the running sequences' decode tokens, so a long prompt delays the others by one
//! chunk's compute per step instead of freezing them for the whole prompt. Each step is one
//! [`K3Model::forward_batch`]: every spine layer fetched once, the union of the step's experts
//! read once and applied to every token that chose it, the head run once.
//!
//! Per sequence the logits are those of the same sequence alone, bit for bit (the step's
//! arithmetic is per token; `tests/batched_step.rs`).

use std::collections::VecDeque;
use std::time::Instant;

use anyhow::Result;
use serde::Serialize;

use crate::experts::{ExpertSource, Observed};
use crate::fault::{FetchFault, ReadFault};
use crate::generate::{LentCache, balanced_chunk};
use crate::k3::{BatchBuffers, K3Model, K3State, SeqStep};

/// A sequence's handle in a [`Batcher`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct SeqId(pub u64);

/// One sequence in the batch: its state, what of its prompt is still to feed, and the token it
/// feeds next once the prompt is in.
struct Member {
    id: SeqId,
    state: K3State,
    prompt: Vec<u32>,
    fed: usize,
    next: Option<u32>,
    /// `[vocab]` the logits after its last fed token.
    logits: Vec<f32>,
    /// A recomputed sequence's token to feed once its tokens are in, without asking.
    pending: Option<u32>,
    /// A prompt chunk ends here (tokens of `prompt`), so that the state after them can be kept.
    stop: Option<usize>,
}

/// What one step did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StepReport {
    /// Sequences in the step, and of them those that fed a prompt chunk.
    pub sequences: usize,
    pub prompt_sequences: usize,
    /// Tokens fed: prompt tokens, and decode tokens (one per decoding sequence).
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    pub seconds: f64,
    /// Seconds of the step with no read of the run in flight (experts or streamed spine): the
    /// drive idled. Zero when the model reports no disk activity.
    pub disk_idle_s: f64,
    /// Routed-expert bytes and streamed spine bytes read during the step.
    pub expert_bytes: u64,
    pub spine_bytes: u64,
    /// Distinct experts the step read per MoE layer, summed over its MoE layers (the union of
    /// its tokens' picks), and the MoE layers that ran.
    pub distinct_experts: usize,
    pub moe_layers: usize,
    /// Sequences whose prompt reached the point [`Batcher::stop_at`] set.
    pub stopped: Vec<SeqId>,
    /// Sequences that fed a chunk of the prompt they joined with and are still inside it (not
    /// those computed again by [`Batcher::rejoin`]), with how many of its tokens are now in: the
    /// state after a prompt chunk, which a prompt-state store keeps.
    pub chunked: Vec<(SeqId, usize)>,
    /// Sequences let go between the layers of the step ([`Batcher::step_while`]): they left the
    /// batch, their states part-way.
    pub dropped: Vec<SeqId>,
    /// Expert cache memory a long prompt's chunk borrowed for the step (given back at its end):
    /// only in a step where no sequence decodes.
    pub borrowed_bytes: u64,
}

impl Member {
    /// Where the prompt's next chunk ends at the latest: a stop the caller set, or its end.
    fn prompt_end(&self) -> usize {
        self.stop.filter(|&s| s > self.fed).unwrap_or(self.prompt.len())
    }
}

/// What a caller says of a sequence after a step that ended its prompt or decoded a token.
pub enum Next {
    /// Feed this token next.
    Token(u32),
    /// The sequence is done: it leaves the batch.
    Leave,
}

/// The continuous-batching scheduler over one model and one expert source.
pub struct Batcher<'m> {
    model: &'m K3Model,
    bufs: BatchBuffers,
    running: Vec<Member>,
    waiting: VecDeque<Member>,
    max_batch: usize,
    /// Prompt tokens at most in one step (the plan's chunk: the activations it reserves).
    chunk: usize,
    next_id: u64,
}

impl<'m> Batcher<'m> {
    /// At most `max_batch` sequences per step (at least 1); prompts go through in steps of at
    /// most the model's planned prompt chunk.
    pub fn new(model: &'m K3Model, max_batch: usize) -> Self {
        Batcher {
            model,
            bufs: BatchBuffers::default(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            max_batch: max_batch.max(1),
            chunk: model.run().prefill_chunk.max(1),
            next_id: 0,
        }
    }

    /// Queue a sequence with this prompt; it joins at the next step with room.
    pub fn join(&mut self, prompt: Vec<u32>) -> Result<SeqId> {
        anyhow::ensure!(!prompt.is_empty(), "the prompt is empty");
        let vocab = self.model.config.vocab_size;
        self.join_from(self.model.new_state(), vec![0f32; vocab], prompt)
    }

    /// Queue a sequence that resumes from a stored state (a prompt state kept on disk or in
    /// memory: a shared system prompt, an earlier turn): `state` holds the tokens before
    /// `rest`, `logits` `[vocab]` are those after its last token. An empty `rest` asks for the
    /// sequence's next token from `logits` at its first step, before the step computes.
    pub fn join_from(&mut self, state: K3State, logits: Vec<f32>, rest: Vec<u32>) -> Result<SeqId> {
        let vocab = self.model.config.vocab_size;
        anyhow::ensure!(logits.len() == vocab, "{} logits for a vocabulary of {vocab}", logits.len());
        anyhow::ensure!(!state.is_part_way(), "the state was left part-way by a failed step");
        anyhow::ensure!(!rest.is_empty() || state.position > 0, "nothing to resume from and nothing to feed");
        if let Some(&t) = rest.iter().find(|&&t| t as usize >= vocab) {
            anyhow::bail!("token id {t} is outside the vocabulary (size {vocab})");
        }
        let id = SeqId(self.next_id);
        self.next_id += 1;
        self.waiting.push_back(Member {
            id,
            state,
            prompt: rest,
            fed: 0,
            next: None,
            logits,
            pending: None,
            stop: None,
        });
        Ok(id)
    }

    /// Queue a sequence to be computed again from its tokens (after a failed step left its
    /// state part-way): `tokens` are all it had fed, `next` the token it was about to feed,
    /// which it feeds once they are in, without asking. Its state then is bit for bit what
    /// it was before the failed step (a prompt's arithmetic does not depend on its chunks).
    pub fn rejoin(&mut self, tokens: Vec<u32>, next: u32) -> Result<SeqId> {
        let vocab = self.model.config.vocab_size;
        anyhow::ensure!((next as usize) < vocab, "token id {next} is outside the vocabulary (size {vocab})");
        let id = self.join(tokens)?;
        if let Some(m) = self.waiting.back_mut() {
            m.pending = Some(next);
        }
        Ok(id)
    }

    /// End a prompt chunk of a queued or running sequence after `at` tokens of the prompt it
    /// was given (a shared start, whose state is worth keeping): the step that reaches it lists
    /// the sequence in [`StepReport::stopped`], and [`Self::seq`] then gives its state.
    pub fn stop_at(&mut self, id: SeqId, at: usize) {
        if let Some(m) = self.running.iter_mut().chain(self.waiting.iter_mut()).find(|m| m.id == id)
            && at > m.fed
            && at < m.prompt.len()
        {
            m.stop = Some(at);
        }
    }

    /// Take a sequence out (a cancelled request), wherever it is.
    pub fn leave(&mut self, id: SeqId) {
        self.running.retain(|m| m.id != id);
        self.waiting.retain(|m| m.id != id);
    }

    /// Sequences running, and waiting for room.
    pub fn len(&self) -> (usize, usize) {
        (self.running.len(), self.waiting.len())
    }

    pub fn is_empty(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// One step: waiting sequences join while there is room, then every running sequence feeds
    /// its next token or its next prompt chunk (prompt chunks share the step's prompt-token
    /// allowance in joining order; a sequence whose turn has not come waits a step). After the
    /// step `after(id, logits)` is asked, for each sequence whose prompt is now in or that
    /// decoded, what it feeds next. A failed step fails every sequence in it: they are taken
    /// out (their states are part-way), the expert source is reset, and [`StepError`] names
    /// them and those the error is theirs (for a routed expert's read fault, the sequences that
    /// chose it); the sequences that were waiting stay queued.
    pub fn step(
        &mut self,
        experts: &mut dyn ExpertSource,
        after: &mut dyn FnMut(SeqId, &K3State, &[f32]) -> Next,
    ) -> std::result::Result<StepReport, StepError> {
        self.step_while(experts, after, &mut |_| true)
    }

    /// [`Self::step`], asking `keep(id)` of the step's sequences between its layers: once none
    /// of them is to be kept (their clients all left), the step stops there, as a prompt alone
    /// stops between the layers of a chunk, and they leave the batch (their states part-way),
    /// listed in [`StepReport::dropped`].
    pub fn step_while(
        &mut self,
        experts: &mut dyn ExpertSource,
        after: &mut dyn FnMut(SeqId, &K3State, &[f32]) -> Next,
        keep: &mut dyn FnMut(SeqId) -> bool,
    ) -> std::result::Result<StepReport, StepError> {
        while self.running.len() < self.max_batch
            && let Some(m) = self.waiting.pop_front()
        {
            self.running.push(m);
        }
        // A sequence resumed from a whole stored prompt feeds the token its logits give.
        let mut leaving = Vec::new();
        for m in self.running.iter_mut().filter(|m| m.fed >= m.prompt.len() && m.next.is_none()) {
            match after(m.id, &m.state, &m.logits) {
                Next::Token(t) => m.next = Some(t),
                Next::Leave => leaving.push(m.id),
            }
        }
        self.running.retain(|m| !leaving.contains(&m.id));
        // While no sequence decodes, a long prompt borrows the expert cache for larger chunks,
        // as it does alone (`generate::run`): fewer chunks, each re-reading the streamed spine
        // and most experts once. A decoding sequence beside it keeps the plan's chunk, so that
        // its pauses stay one chunk's compute long.
        let mut lent = LentCache { experts: &mut *experts, bufs: &mut self.bufs, active: false };
        let mut allowance = self.chunk;
        let mut borrowed = 0;
        let decoding = self.running.iter().any(|m| m.fed >= m.prompt.len() && m.next.is_some());
        if let Some(b) = self.model.run().prompt_borrowing
            && !decoding
        {
            let left: usize = self.running.iter().map(|m| m.prompt_end() - m.fed.min(m.prompt_end())).sum();
            if left > self.chunk {
                let chunk = balanced_chunk(left, b.max_chunk.max(self.chunk));
                let borrow = (chunk - self.chunk) as u64 * b.token_bytes;
                lent.active = true;
                borrowed = lent.experts.lend(borrow);
                allowance = if borrowed < borrow {
                    // Part of the cache could not be lent: chunks as large as what was.
                    balanced_chunk(left, self.chunk + (borrowed / b.token_bytes.max(1)) as usize)
                } else {
                    chunk
                };
            }
        }
        // What each running sequence feeds: (index, prompt range or the next token).
        let mut feeds: Vec<(usize, usize, usize)> = Vec::with_capacity(self.running.len());
        for (i, m) in self.running.iter().enumerate() {
            if m.fed < m.prompt.len() {
                let n = (m.prompt_end() - m.fed).min(allowance);
                if n > 0 {
                    feeds.push((i, m.fed, m.fed + n));
                    allowance -= n;
                }
            } else if m.next.is_some() {
                feeds.push((i, 0, 0));
            }
        }
        let mut report = StepReport { borrowed_bytes: borrowed, ..StepReport::default() };
        if feeds.is_empty() {
            return Ok(report);
        }
        let activity = self.model.run().disk_activity.clone();
        let idle = || activity.as_ref().map_or(0.0, |a| a.idle().as_secs_f64());
        let (bytes0, spine0, idle0, t0) =
            (lent.experts.bytes_read(), self.model.spine_bytes_read(), idle(), Instant::now());
        let (mut distinct, mut layers) = (0, 0);
        let mut counter = Observed {
            inner: &mut *lent.experts,
            on_begin: |_: usize, e: &[usize]| {
                distinct += e.len();
                layers += 1;
            },
        };
        let ids: Vec<SeqId> = feeds.iter().map(|&(i, _, _)| self.running[i].id).collect();
        let result = {
            // Disjoint borrows of the running members, in feed order.
            let mut members: Vec<&mut Member> = Vec::with_capacity(feeds.len());
            let mut rest: &mut [Member] = &mut self.running;
            let mut base = 0;
            for &(i, _, _) in &feeds {
                let (_, tail) = std::mem::take(&mut rest).split_at_mut(i - base);
                let (m, tail) = tail.split_first_mut().expect("feed index within the running members");
                members.push(m);
                rest = tail;
                base = i + 1;
            }
            let mut steps: Vec<SeqStep<'_>> = members
                .into_iter()
                .zip(&feeds)
                .map(|(m, &(_, a, b))| {
                    let tokens: &[u32] = if b > a {
                        &m.prompt[a..b]
                    } else {
                        std::slice::from_ref(m.next.as_ref().expect("decoding members have a token"))
                    };
                    SeqStep { state: &mut m.state, tokens, logits: &mut m.logits }
                })
                .collect();
            let mut on_layer = |_: usize| ids.iter().any(|&id| keep(id));
            self.model.forward_batch_with(&mut steps, &mut counter, &mut *lent.bufs, &mut on_layer)
        };
        // The borrowed memory goes back before anything else (on a panic, the guard's drop).
        drop(lent);
        report.distinct_experts = distinct;
        report.moe_layers = layers;
        let completed = match result {
            Ok(completed) => completed,
            Err(e) => return Err(self.fail_step(experts, e, &feeds)),
        };
        report.seconds = t0.elapsed().as_secs_f64();
        report.disk_idle_s = idle() - idle0;
        report.expert_bytes = experts.bytes_read() - bytes0;
        report.spine_bytes = self.model.spine_bytes_read() - spine0;
        if !completed {
            // Stopped between layers: every sequence of the step was let go (no sequence counts
            // as served by the step).
            report.dropped = feeds.iter().map(|&(i, _, _)| self.running[i].id).collect();
            self.running.retain(|m| !report.dropped.contains(&m.id));
            return Ok(report);
        }
        report.sequences = feeds.len();
        leaving.clear();
        for &(i, a, b) in &feeds {
            let m = &mut self.running[i];
            if b > a {
                report.prompt_sequences += 1;
                report.prompt_tokens += b - a;
                m.fed = b;
                if m.stop == Some(b) {
                    m.stop = None;
                    report.stopped.push(m.id);
                }
                if m.fed < m.prompt.len() {
                    if m.pending.is_none() {
                        report.chunked.push((m.id, m.fed));
                    }
                    continue;
                }
                if let Some(t) = m.pending.take() {
                    m.next = Some(t);
                    continue;
                }
            } else {
                report.decode_tokens += 1;
            }
            match after(m.id, &m.state, &m.logits) {
                Next::Token(t) => m.next = Some(t),
                Next::Leave => leaving.push(m.id),
            }
        }
        self.running.retain(|m| !leaving.contains(&m.id));
        Ok(report)
    }

    /// A failed step: the source reset (no half-served read or unverified record reaches the
    /// next step), its sequences out of the batch, and which of them the error is theirs.
    fn fail_step(
        &mut self,
        experts: &mut dyn ExpertSource,
        e: anyhow::Error,
        feeds: &[(usize, usize, usize)],
    ) -> StepError {
        experts.reset();
        let spans: Vec<(SeqId, usize)> =
            feeds.iter().map(|&(i, a, b)| (self.running[i].id, if b > a { b - a } else { 1 })).collect();
        let failed: Vec<SeqId> = spans.iter().map(|&(id, _)| id).collect();
        let blamed = blame(&e, &self.bufs, &spans).unwrap_or_else(|| failed.clone());
        self.running.retain(|m| !failed.contains(&m.id));
        StepError { error: e, failed, blamed }
    }

    /// A running sequence's state (for prompt states on disk and tests).
    pub fn state(&self, id: SeqId) -> Option<&K3State> {
        self.seq(id).map(|(s, _)| s)
    }

    /// A running sequence's state and the logits `[vocab]` after its last fed token.
    pub fn seq(&self, id: SeqId) -> Option<(&K3State, &[f32])> {
        self.running.iter().find(|m| m.id == id).map(|m| (&m.state, m.logits.as_slice()))
    }
}

/// A step that failed, and the sequences it failed (taken out of the batch).
#[derive(Debug)]
pub struct StepError {
    pub error: anyhow::Error,
    pub failed: Vec<SeqId>,
    /// Those of `failed` that the error is theirs: for a routed expert that could not be read
    /// (or fetched, in a streaming store), the sequences with a token that chose it; for anything else (a spine layer, which every
    /// sequence reads, or an error with no record), all of them. The others may be computed
    /// again from their tokens ([`Batcher::rejoin`]) and go on as if nothing happened.
    pub blamed: Vec<SeqId>,
}

/// The sequences whose tokens chose an expert a [`ReadFault`] (a record that could not be read)
/// or a [`FetchFault`] (records a streaming store could not fetch) names, at the layer whose
/// routing the step's buffers hold; `None` when the error is no such fault (or no token chose
/// one, which would mean the fault is not where the routing says: then nobody is cleared).
/// `spans`: each sequence of the step in feed order with its number of tokens.
fn blame(e: &anyhow::Error, bufs: &BatchBuffers, spans: &[(SeqId, usize)]) -> Option<Vec<SeqId>> {
    let (layer, experts): (usize, &[usize]) = e.chain().find_map(|c| {
        if let Some(f) = c.downcast_ref::<ReadFault>() {
            Some((f.layer, std::slice::from_ref(&f.expert)))
        } else {
            c.downcast_ref::<FetchFault>().map(|f| (f.layer, f.experts.as_slice()))
        }
    })?;
    if bufs.routed_layer != Some(layer) {
        return None;
    }
    let mut blamed = Vec::new();
    let mut t0 = 0;
    for &(id, n) in spans {
        let routes = bufs.routing.get(t0..t0 + n)?;
        if routes.iter().any(|r| r.experts.iter().any(|e| experts.contains(e))) {
            blamed.push(id);
        }
        t0 += n;
    }
    (!blamed.is_empty()).then_some(blamed)
}

impl std::fmt::Display for StepError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#}", self.error)
    }
}
