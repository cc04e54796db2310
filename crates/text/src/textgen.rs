//! One text generation as an API serves it: sampling, stop strings, the model's end-of-message
//! token, output parsing into reasoning / answer / tool calls, log-probabilities, and
//! cancellation, reported token by token to a [`Sink`].
//!
//! Both wire formats the server speaks (OpenAI, Anthropic) and every streaming mode run through
//! this one loop; they differ only in how they print what the sink receives.

use std::time::{Duration, Instant};

use anyhow::Result;

use crate::chat::parse::{Markers, OutputEvent, OutputParser};
use crate::sample::{Sampler, SamplingParams, logprobs};
use crate::tokenizer::{Tokenizer, Utf8Decoder};
use deltafin_engine::experts::ExpertSource;
use deltafin_engine::generate::{self, Driver, Ended, GenerateHooks};
use deltafin_engine::k3::{K3Model, K3State};
use deltafin_engine::prefix_store::PrefixStore;

#[derive(Debug, Clone)]
pub struct TextRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation ends before the first of these strings in the answer text.
    pub stop: Vec<String>,
    /// Report log-probabilities with this many alternatives per token.
    pub logprobs: Option<usize>,
    /// Split the output into reasoning, answer and tool calls (chat); raw text otherwise.
    pub parse_chat: bool,
    /// The prompt opened the reasoning channel (K3 thinking mode): output starts as reasoning.
    pub reasoning_open: bool,
    /// Keep generating past the end-of-message token (benchmarks; vLLM's `ignore_eos`).
    pub ignore_eos: bool,
    /// Test instrument: these tokens replace the sampled ones, one per step (the model still
    /// runs every step); generation ends when they run out.
    pub forced: Option<Vec<u32>>,
    /// Leading prompt tokens other requests are likely to share (a chat's tools and system
    /// messages): with prompt states on disk, the state right after them is kept, so that a
    /// request with the same start and another question resumes from it.
    pub shared_prefix: Option<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// The model ended its turn, or a stop string matched.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The turn ended with tool calls.
    ToolCalls,
    /// The sink asked to stop (client gone).
    Cancelled,
}

/// Log-probabilities of one generated token.
#[derive(Debug, Clone)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    /// (id, logprob), most likely first.
    pub top: Vec<(u32, f32)>,
}

#[derive(Debug, Clone)]
pub struct Summary {
    pub finish: Finish,
    pub prompt_tokens: usize,
    /// Leading prompt tokens whose state came from the prefix snapshot instead of the model.
    pub cached_prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Seconds from start to the first generated token.
    pub ttft_s: f64,
    /// Seconds of decoding after the first token.
    pub decode_s: f64,
    /// A stop string ended generation (which one).
    pub stop_string: Option<String>,
}

/// Receives a generation as it happens.
pub trait Sink {
    /// Polled between prompt chunks and between tokens: false cancels.
    fn keep_going(&mut self) -> bool;
    /// Parsed output produced by one token (maybe none: text held for a stop-string check, or a
    /// marker in progress) and the token's log-probabilities when asked for. False cancels.
    fn token(&mut self, events: &[OutputEvent], logprob: Option<&TokenLogprob>) -> bool;
}

/// Holds back the tail of the answer text that could still become a stop string.
struct StopMatcher {
    stops: Vec<String>,
    held: String,
    longest: usize,
}

impl StopMatcher {
    fn new(stops: &[String]) -> Self {
        let stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        let longest = stops.iter().map(|s| s.len()).max().unwrap_or(0);
        StopMatcher { stops, held: String::new(), longest }
    }

    /// Add answer text; returns the text now safe to release and the stop string if one matched
    /// (the text returned then ends just before it).
    fn push(&mut self, text: &str) -> (String, Option<String>) {
        if self.stops.is_empty() {
            return (text.to_string(), None);
        }
        self.held.push_str(text);
        let hit = self.stops.iter().filter_map(|s| self.held.find(s.as_str()).map(|p| (p, s))).min_by_key(|h| h.0);
        if let Some((pos, s)) = hit {
            let s = s.clone();
            let out = self.held[..pos].to_string();
            self.held.clear();
            return (out, Some(s));
        }
        let mut keep_from = self.held.len().saturating_sub(self.longest - 1);
        while !self.held.is_char_boundary(keep_from) {
            keep_from -= 1;
        }
        let out = self.held[..keep_from].to_string();
        self.held.drain(..keep_from);
        (out, None)
    }

    fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// The state after the last prompt, kept so that a next prompt extending it (a chat's next
/// turn resends the whole history) only runs its new tokens; and, with a store on disk
/// ([`PrefixStore`]), the states after every prompt and every finished turn of many
/// conversations, across restarts. Reuse is exact: a prompt processed in pieces gives
/// bit-identical logits and state to processing it whole.
pub struct PrefixCache {
    last: Slot,
    /// Without a store on disk: the state after the last shared prompt start (tools and system
    /// messages, [`TextRequest::shared_prefix`]), so that the requests of one agent or
    /// application start from it whatever their own messages. Made on first use.
    shared: Option<Slot>,
    /// Snapshots on disk, when the server keeps them (`--state-dir`).
    pub disk: Option<PrefixStore>,
}

/// One state kept in memory: the tokens it is the state after (empty: nothing kept).
struct Slot {
    tokens: Vec<u32>,
    state: K3State,
    /// Logits after the last kept token `[vocab]`.
    logits: Vec<f32>,
}

impl Slot {
    fn new(model_state: K3State, vocab: usize) -> Self {
        Slot { tokens: Vec::new(), state: model_state, logits: vec![0f32; vocab] }
    }

    fn keep(&mut self, tokens: &[u32], state: &K3State, logits: &[f32]) {
        // Tokens last: a slot whose copy did not finish never claims these tokens.
        self.tokens.clear();
        self.state.copy_sequence_from(state);
        self.logits.copy_from_slice(logits);
        self.tokens.extend_from_slice(tokens);
    }

    /// How many tokens of `prompt` this slot covers (0 if it is not a start of it).
    fn covers(&self, prompt: &[u32]) -> usize {
        if !self.tokens.is_empty() && prompt.starts_with(&self.tokens) { self.tokens.len() } else { 0 }
    }
}

impl PrefixCache {
    pub fn new(model: &K3Model) -> Self {
        PrefixCache { last: Slot::new(model.new_state(), model.config.vocab_size), shared: None, disk: None }
    }

    /// With prompt states kept on disk too (shared starts among them).
    pub fn with_disk(model: &K3Model, disk: PrefixStore) -> Self {
        PrefixCache { disk: Some(disk), ..PrefixCache::new(model) }
    }

    /// Forget the snapshots in memory (after a failure that may have left one half written).
    pub fn clear(&mut self) {
        self.last.tokens.clear();
        if let Some(s) = self.shared.as_mut() {
            s.tokens.clear();
        }
    }
}

/// Runs [`TextRequest`]s on one model. `step_delay` is a test throttle slept after every model
/// step (prompt chunk or token), to hold the engine busy deterministically.
pub struct TextGenerator<'a> {
    pub model: &'a K3Model,
    pub tokenizer: &'a Tokenizer,
    pub step_delay: Duration,
}

impl TextGenerator<'_> {
    pub fn run(&self, experts: &mut dyn ExpertSource, req: &TextRequest, sink: &mut dyn Sink) -> Result<Summary> {
        self.run_cached(experts, req, sink, None)
    }

    /// [`Self::run`], resuming from `cache` when the prompt extends the cached one, and leaving
    /// this prompt's state in it.
    pub fn run_cached(
        &self,
        experts: &mut dyn ExpertSource,
        req: &TextRequest,
        sink: &mut dyn Sink,
        mut cache: Option<&mut PrefixCache>,
    ) -> Result<Summary> {
        anyhow::ensure!(!req.prompt.is_empty(), "the prompt is empty");
        let model = self.model;
        let mut st = model.new_state();
        let mut logits = vec![0f32; model.config.vocab_size]; // [vocab]
        let resume = cache.as_deref_mut().map_or(0, |c| c.resume(model, &req.prompt, &mut st, &mut logits));
        let started = Turn::new(self.tokenizer, req, resume);
        // The shared start first, in a run of its own that keeps its state (on disk, or in the
        // cache's memory slot for it).
        let mut resume = resume;
        if let (Some(p), Some(c)) = (req.shared_prefix, cache.as_deref_mut())
            && resume < p
            && p < req.prompt.len()
        {
            let mut head =
                SharedHead { model, prompt: &req.prompt[..p], sink: &mut *sink, cache: c, step_delay: self.step_delay };
            let ended = generate::run(
                model,
                experts,
                &mut st,
                &mut logits,
                &req.prompt[resume..p],
                &mut GenerateHooks::default(),
                &mut head,
            )?;
            if ended == Ended::Cancelled {
                let mut t = started;
                return Ok(t.cancelled());
            }
            resume = p;
        }
        let mut turn = TextTurn {
            turn: started,
            req,
            sink,
            // Kept even when the whole prompt was resumed: the finished turn is stored too.
            cache,
            resumed: resume,
            step_delay: self.step_delay,
        };
        let ended = generate::run(
            model,
            experts,
            &mut st,
            &mut logits,
            &req.prompt[resume..],
            &mut GenerateHooks::default(),
            &mut turn,
        )?;
        if ended == Ended::Cancelled {
            return Ok(turn.turn.cancelled());
        }
        // The finished turn's state: the prompt and every token fed back (all generated tokens
        // but the last), for the next turn of this conversation.
        if let Some(c) = turn.cache.as_deref_mut() {
            c.keep_turn(&req.prompt, turn.turn.fed(), &st, &logits);
        }
        Ok(turn.turn.finish(turn.sink))
    }
}

/// One request's generation as the loop's [`Driver`]: the [`Turn`], reported to the sink, with
/// the prompt states kept on the way.
struct TextTurn<'a> {
    turn: Turn<'a>,
    req: &'a TextRequest,
    sink: &'a mut dyn Sink,
    /// Where this prompt's state is left for the next request (when it ran new tokens).
    cache: Option<&'a mut PrefixCache>,
    /// Prompt tokens taken from a stored state (the loop sees the rest).
    resumed: usize,
    step_delay: Duration,
}

impl Driver for TextTurn<'_> {
    fn keep_going(&mut self) -> bool {
        self.sink.keep_going()
    }

    fn chunk_done(&mut self, state: &K3State, logits: &[f32], fed: usize) {
        if let Some(disk) = self.cache.as_deref_mut().and_then(|c| c.disk.as_mut())
            && let Some(done) = self.req.prompt.get(..self.resumed + fed)
            && let Err(e) = disk.save(done, state, logits)
        {
            tracing::warn!("keeping a prompt chunk's state on disk failed: {e}");
        }
    }

    fn prompt_done(&mut self, state: &K3State, logits: &[f32]) {
        if let Some(c) = self.cache.as_deref_mut() {
            c.keep_prompt(&self.req.prompt, state, logits);
        }
    }

    fn next(&mut self, logits: &[f32]) -> Result<Option<u32>> {
        Ok(self.turn.next(logits, self.sink))
    }

    fn after_step(&mut self, _expert_bytes_read: u64) {
        // A test throttle that holds the engine busy deterministically.
        if !self.step_delay.is_zero() {
            std::thread::sleep(self.step_delay);
        }
    }
}

/// The run of a request's shared start ([`TextRequest::shared_prefix`]): its state is kept (on
/// disk, or in memory), and the run ends there (the rest of the prompt follows in the request's
/// own run).
struct SharedHead<'a> {
    model: &'a K3Model,
    prompt: &'a [u32],
    sink: &'a mut dyn Sink,
    cache: &'a mut PrefixCache,
    step_delay: Duration,
}

impl Driver for SharedHead<'_> {
    fn keep_going(&mut self) -> bool {
        self.sink.keep_going()
    }

    fn prompt_done(&mut self, state: &K3State, logits: &[f32]) {
        self.cache.keep_shared(self.model, self.prompt, state, logits);
    }

    fn next(&mut self, _logits: &[f32]) -> Result<Option<u32>> {
        Ok(None)
    }

    fn after_step(&mut self, _expert_bytes_read: u64) {
        if !self.step_delay.is_zero() {
            std::thread::sleep(self.step_delay);
        }
    }
}

impl PrefixCache {
    /// The state after a shared prompt start, on disk when states are kept there.
    pub fn keep_shared(&mut self, model: &K3Model, prefix: &[u32], state: &K3State, logits: &[f32]) {
        match self.disk.as_mut() {
            Some(disk) => {
                if let Err(e) = disk.save(prefix, state, logits) {
                    tracing::warn!("keeping the shared prompt start's state on disk failed: {e}");
                }
            }
            None => {
                let slot = self.shared.get_or_insert_with(|| Slot::new(model.new_state(), model.config.vocab_size));
                slot.keep(prefix, state, logits);
            }
        }
    }

    /// This prompt's state, in memory for a next prompt that extends it, and on disk when
    /// states are kept there.
    pub fn keep_prompt(&mut self, prompt: &[u32], state: &K3State, logits: &[f32]) {
        self.last.keep(prompt, state, logits);
        if let Some(disk) = self.disk.as_mut()
            && let Err(e) = disk.save(prompt, state, logits)
        {
            tracing::warn!("keeping the prompt's state on disk failed: {e}");
        }
    }

    /// The longest stored start of `prompt` (in memory, else on disk, leaving at least one token
    /// to compute when it comes from disk): how many tokens it covers, with its state copied
    /// into `state` and its logits into `logits`. Zero leaves `state` fresh.
    pub fn resume(&mut self, model: &K3Model, prompt: &[u32], state: &mut K3State, logits: &mut [f32]) -> usize {
        // The longer of the two memory slots that starts the prompt.
        let (last, shared) = (self.last.covers(prompt), self.shared.as_ref().map_or(0, |s| s.covers(prompt)));
        let slot = if shared > last { self.shared.as_ref() } else { (last > 0).then_some(&self.last) };
        if let Some(slot) = slot {
            state.copy_sequence_from(&slot.state);
            logits.copy_from_slice(&slot.logits);
            return slot.tokens.len();
        }
        if let Some(disk) = self.disk.as_mut() {
            // At least one token is left to compute: its logits are the first sample's.
            match disk.restore_longest(prompt, prompt.len().saturating_sub(1), state, logits) {
                Some(n) => return n,
                // A refused snapshot may have been half restored.
                None => *state = model.new_state(),
            }
        }
        0
    }

    /// A finished turn's state (its prompt and every token fed back), on disk for the next turn
    /// of its conversation.
    pub fn keep_turn(&mut self, prompt: &[u32], fed: &[u32], state: &K3State, logits: &[f32]) {
        if let Some(disk) = self.disk.as_mut()
            && !fed.is_empty()
            && prompt.len() + fed.len() == state.position
        {
            let mut tokens = prompt.to_vec();
            tokens.extend_from_slice(fed);
            if let Err(e) = disk.save(&tokens, state, logits) {
                tracing::warn!("keeping the turn's state on disk failed: {e}");
            }
        }
    }
}

/// One request's turn, however the model is driven (alone by [`generate::run`], or in a batch
/// step by step): samples (or takes the forced tokens), parses, holds text back for stop
/// strings, and reports each token to a [`Sink`].
pub struct Turn<'a> {
    tokenizer: &'a Tokenizer,
    max_tokens: usize,
    ignore_eos: bool,
    logprobs: Option<usize>,
    forced: Option<Vec<u32>>,
    /// Generated tokens fed back into the model, in order.
    fed: Vec<u32>,
    start: Instant,
    summary: Summary,
    markers: Option<Markers>,
    parser: Option<OutputParser>,
    raw_text: Utf8Decoder,
    stop: StopMatcher,
    sampler: Sampler,
    parsed: Vec<OutputEvent>,
    events: Vec<OutputEvent>,
    saw_tool_call: bool,
    decode_start: Option<Instant>,
}

impl<'a> Turn<'a> {
    /// `resumed` prompt tokens came from a stored state (reported as cached).
    pub fn new(tokenizer: &'a Tokenizer, req: &TextRequest, resumed: usize) -> Self {
        let markers = if req.parse_chat { Markers::from_tokenizer(tokenizer) } else { None };
        Turn {
            tokenizer,
            max_tokens: req.max_tokens,
            ignore_eos: req.ignore_eos,
            logprobs: req.logprobs,
            forced: req.forced.clone(),
            fed: Vec::new(),
            start: Instant::now(),
            summary: Summary {
                finish: Finish::Length,
                prompt_tokens: req.prompt.len(),
                cached_prompt_tokens: resumed,
                completion_tokens: 0,
                ttft_s: 0.0,
                decode_s: 0.0,
                stop_string: None,
            },
            markers,
            parser: markers.map(|m| OutputParser::new(m, req.reasoning_open)),
            raw_text: Utf8Decoder::default(),
            stop: StopMatcher::new(&req.stop),
            sampler: Sampler::new(req.sampling.clone()),
            parsed: Vec::new(),
            events: Vec::new(),
            saw_tool_call: false,
            decode_start: None,
        }
    }

    /// How the turn ends (so far: `Length` until it ends otherwise).
    pub fn finish_reason(&self) -> Finish {
        self.summary.finish
    }

    /// Prompt tokens reported as taken from a stored state: a turn whose prompt is computed
    /// again from its start (after a failed step) took none.
    pub fn set_cached_prompt_tokens(&mut self, n: usize) {
        self.summary.cached_prompt_tokens = n;
    }

    /// Generated tokens fed back into the model so far.
    pub fn fed(&self) -> &[u32] {
        &self.fed
    }

    /// The next token from the logits `[vocab]`, reported to the sink: `Some` feeds it back,
    /// `None` ends the turn (finish with [`Self::finish`]).
    pub fn next(&mut self, logits: &[f32], sink: &mut dyn Sink) -> Option<u32> {
        let vocab = logits.len();
        let summary = &mut self.summary;
        if summary.completion_tokens >= self.max_tokens {
            return self.end(Finish::Length);
        }
        if !sink.keep_going() {
            return self.end(Finish::Cancelled);
        }
        let token = match &self.forced {
            Some(f) => match f.get(summary.completion_tokens) {
                Some(&t) => t,
                None => return self.end(Finish::Stop),
            },
            None => self.sampler.sample(logits),
        };
        if summary.completion_tokens == 0 {
            summary.ttft_s = self.start.elapsed().as_secs_f64();
            self.decode_start = Some(Instant::now());
        }
        summary.completion_tokens += 1;
        if Some(token) == self.tokenizer.eos_id && !self.ignore_eos {
            return self.end(Finish::Stop);
        }
        let lp = self.logprobs.filter(|_| (token as usize) < vocab).map(|n| {
            let l = logprobs(logits, token, n);
            TokenLogprob { id: token, logprob: l.logprob, top: l.top }
        });
        // Parse, then pass answer text through the stop-string check.
        self.parsed.clear();
        let bytes = self.tokenizer.token_bytes(token);
        match self.parser.as_mut() {
            Some(p) => {
                let markup = self.markers.is_some_and(|m| [m.open, m.close, m.sep].contains(&token));
                // Special tokens that are not markup (`[EOS]`, `[EOT]`, media tokens, the end of
                // message when ignored) are never answer text in a chat.
                let bytes = if !markup && self.tokenizer.is_special(token) { &[] } else { bytes };
                p.push(token, bytes, &mut self.parsed)
            }
            None => {
                let text = self.raw_text.push(bytes);
                if !text.is_empty() {
                    self.parsed.push(OutputEvent::Content(text));
                }
            }
        }
        let stopped = filter_stops(&mut self.stop, &self.parsed, &mut self.events, &mut self.summary);
        self.saw_tool_call |= self.events.iter().any(|e| matches!(e, OutputEvent::ToolCallBegin { .. }));
        if !sink.token(&self.events, lp.as_ref()) {
            return self.end(Finish::Cancelled);
        }
        if stopped {
            return self.end(Finish::Stop);
        }
        if self.summary.completion_tokens >= self.max_tokens {
            return self.end(Finish::Length);
        }
        self.fed.push(token);
        Some(token)
    }

    fn end(&mut self, finish: Finish) -> Option<u32> {
        self.summary.finish = finish;
        None
    }

    /// The turn stopped before its end (the client left, or its prompt was cancelled).
    pub fn cancelled(&mut self) -> Summary {
        self.summary.finish = Finish::Cancelled;
        self.summary.decode_s = self.decode_start.map(|t| t.elapsed().as_secs_f64()).unwrap_or(0.0);
        self.summary.clone()
    }

    /// Release what the parser and the stop check still hold, and settle the finish reason.
    pub fn finish(&mut self, sink: &mut dyn Sink) -> Summary {
        let summary = &mut self.summary;
        if summary.finish != Finish::Cancelled {
            let (events, parsed) = (&mut self.events, &mut self.parsed);
            events.clear();
            parsed.clear();
            match self.parser.as_mut() {
                Some(p) => p.finish(parsed),
                None => {
                    let rest = self.raw_text.flush();
                    if !rest.is_empty() {
                        parsed.push(OutputEvent::Content(rest));
                    }
                }
            }
            if summary.stop_string.is_none() && filter_stops(&mut self.stop, parsed, events, summary) {
                summary.finish = Finish::Stop;
            }
            if summary.stop_string.is_none() {
                let rest = self.stop.flush();
                if !rest.is_empty() {
                    events.push(OutputEvent::Content(rest));
                }
            }
            self.saw_tool_call |= events.iter().any(|e| matches!(e, OutputEvent::ToolCallBegin { .. }));
            if !events.is_empty() {
                sink.token(events, None);
            }
            if summary.finish == Finish::Stop && self.saw_tool_call && summary.stop_string.is_none() {
                summary.finish = Finish::ToolCalls;
            }
        }
        summary.decode_s = self.decode_start.map(|t| t.elapsed().as_secs_f64()).unwrap_or(0.0);
        self.summary.clone()
    }
}

/// Moves `parsed` into `events`, holding back answer text for the stop check. Returns true
/// when a stop string matched (later events are dropped).
fn filter_stops(
    stop: &mut StopMatcher,
    parsed: &[OutputEvent],
    events: &mut Vec<OutputEvent>,
    summary: &mut Summary,
) -> bool {
    events.clear();
    for ev in parsed {
        match ev {
            OutputEvent::Content(text) => {
                let (out, hit) = stop.push(text);
                if !out.is_empty() {
                    events.push(OutputEvent::Content(out));
                }
                if let Some(s) = hit {
                    summary.stop_string = Some(s);
                    return true;
                }
            }
            other => {
                // Answer text held back before a call or more reasoning is released first:
                // a stop string cannot span other output.
                let held = stop.flush();
                if !held.is_empty() {
                    events.push(OutputEvent::Content(held));
                }
                events.push(other.clone());
            }
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_matcher_finds_strings_across_pieces() {
        let mut m = StopMatcher::new(&["END".into(), "\n\n".into()]);
        let mut out = String::new();
        for piece in ["Hello E", "N", "x wor", "ld E", "ND after"] {
            let (o, hit) = m.push(piece);
            out.push_str(&o);
            if hit.is_some() {
                assert_eq!(hit.as_deref(), Some("END"));
                break;
            }
        }
        assert_eq!(out, "Hello ENx world ");
        let mut m = StopMatcher::new(&["é!".into()]);
        let (o, hit) = m.push("caf");
        assert_eq!((o.as_str(), hit), ("c", None));
        let (o, hit) = m.push("é");
        assert_eq!((o.as_str(), hit), ("af", None));
        assert_eq!(m.flush(), "é");
        let mut m = StopMatcher::new(&[]);
        assert_eq!(m.push("abc").0, "abc");
    }
}
