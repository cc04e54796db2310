//! The engine thread with continuous batching (`serve --max-batch N`, N > 1): up to N
//! generations share every model step through [`Batcher`] (each spine layer fetched once, the
//! union of their experts read once). Jobs join between steps while there is room; the rest
//! wait in the admission queue as with one at a time. Each generation is the same [`Turn`] as
//! alone (sampling, parsing, stop strings, log-probabilities), so its tokens are those it would
//! get alone, bit for bit.
//!
//! A client that leaves takes its sequence out before the next step. A failed step fails the
//! generations it blames and recomputes the others from their tokens (bit-identical, the
//! prompt path's chunk invariance): a routed expert's read fault is blamed on the sequences
//! whose tokens chose that expert, a spine layer's on every sequence in the step; an injected
//! test fault only on the request that carries its trigger. A panic fails every generation in
//! the batch and starts a new one; the expert source is reset and the prefix snapshot dropped as
//! after any failure.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, TryRecvError};

use deltafin_engine::batch::{Batcher, Next, SeqId, StepError};
use deltafin_engine::experts::ExpertSource;
use deltafin_engine::session::Session;
use deltafin_text::textgen::{Finish, PrefixCache, TextRequest, Turn};
use deltafin_text::tokenizer::Tokenizer;
use tokio::sync::mpsc;

use crate::error::{ApiError, storage_fault};
use crate::metrics::{Metrics, Outcome};
use crate::worker::{Admission, ChannelSink, EngineOptions, Job, RequestNote, Ticket, Update, end_job, start_job};

/// A generation in the batch.
struct Active<'t> {
    turn: Turn<'t>,
    req: TextRequest,
    note: RequestNote,
    updates: mpsc::UnboundedSender<Update>,
    ticket: std::sync::Arc<Ticket>,
    /// Its prompt is in (its state was kept for a next prompt that extends it).
    prompt_done: bool,
    /// Tokens of its prompt before those its batch member feeds (from a stored state).
    prompt_offset: usize,
    /// Its turn ended in the last step.
    ended: bool,
    /// Test instrument: the fault its prompt asks for, injected at its first step.
    #[cfg(feature = "test-instruments")]
    injected: Option<crate::instruments::Injected>,
}

impl Active<'_> {
    /// The generation's end: counters and health, its place freed, its log line, its last
    /// update.
    fn end(
        self,
        session: &Session,
        cache: Option<&PrefixCache>,
        admission: &Admission,
        metrics: &Metrics,
        last: Update,
        outcome: Outcome,
    ) {
        end_job(session, cache, admission, metrics, &self.note, &self.updates, &self.ticket, last, outcome);
    }
}

/// Serve jobs until the queue's sender is gone.
pub(crate) fn run(
    session: &mut Session,
    mut cache: Option<&mut PrefixCache>,
    tokenizer: &Tokenizer,
    admission: &Admission,
    metrics: &Metrics,
    opts: &EngineOptions,
    jobs: &Receiver<Job>,
) {
    let max_batch = opts.max_batch.max(1);
    let mut active: HashMap<SeqId, Active<'_>> = HashMap::new();
    // A batch for the life of the thread; a new one after a panic.
    let mut batcher = Batcher::new(&session.model, max_batch);
    loop {
        // Jobs join while there is room; with nothing running, wait for one.
        while active.len() < max_batch {
            let job = if active.is_empty() {
                match jobs.recv() {
                    Ok(j) => j,
                    Err(_) => return,
                }
            } else {
                match jobs.try_recv() {
                    Ok(j) => j,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            };
            if !start_job(admission, metrics, &job) {
                continue;
            }
            admit(session, cache.as_deref_mut(), tokenizer, &mut batcher, &mut active, admission, metrics, job, opts);
        }
        // Clients that left: out before the step.
        let gone: Vec<SeqId> = active.iter().filter(|(_, a)| a.updates.is_closed()).map(|(&id, _)| id).collect();
        for id in gone {
            batcher.leave(id);
            if let Some(mut a) = active.remove(&id) {
                let summary = a.turn.cancelled();
                metrics.record_generation(&summary);
                a.end(session, cache.as_deref(), admission, metrics, Update::Done(summary), Outcome::Cancelled);
            }
        }
        if batcher.is_empty() {
            continue;
        }
        #[cfg(feature = "test-instruments")]
        let injected = active.iter_mut().find_map(|(&id, a)| a.injected.take().map(|f| (id, f)));
        // Between the layers of the step: whether a client is still there (a step whose
        // clients all left stops at the next layer, as a prompt alone does).
        let listening: Vec<(SeqId, mpsc::UnboundedSender<Update>)> =
            active.iter().map(|(&id, a)| (id, a.updates.clone())).collect();
        let mut keep = |id: SeqId| listening.iter().any(|(i, u)| *i == id && !u.is_closed());
        let result = {
            let experts = &mut session.experts;
            let cache = &mut cache;
            let active = &mut active;
            let mut after = |id: SeqId, state: &deltafin_engine::k3::K3State, logits: &[f32]| -> Next {
                let Some(a) = active.get_mut(&id) else { return Next::Leave };
                if !a.prompt_done {
                    a.prompt_done = true;
                    if let Some(c) = cache.as_deref_mut() {
                        c.keep_prompt(&a.req.prompt, state, logits);
                    }
                }
                let mut sink = ChannelSink { updates: &a.updates };
                match a.turn.next(logits, &mut sink) {
                    Some(t) => Next::Token(t),
                    None => {
                        a.ended = true;
                        if a.turn.finish_reason() != Finish::Cancelled
                            && let Some(c) = cache.as_deref_mut()
                        {
                            c.keep_turn(&a.req.prompt, a.turn.fed(), state, logits);
                        }
                        Next::Leave
                    }
                }
            };
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                #[cfg(feature = "test-instruments")]
                if let Some((_, fault)) = injected {
                    let mut faulty = crate::instruments::FaultyExperts { inner: &mut *experts, fault: Some(fault) };
                    return batcher.step_while(&mut faulty, &mut after, &mut keep);
                }
                batcher.step_while(experts, &mut after, &mut keep)
            }))
        };
        match result {
            Ok(Ok(report)) => {
                if report.sequences > 0 {
                    metrics.record_step(report.sequences);
                }
                // States kept for other requests: a prompt chunk's (with states on disk, as
                // alone; at most one a step, so that several prompts chunking at once do not make
                // the running streams wait for one state write after another) and the shared
                // starts reached. A panic while keeping one loses the kept states, not the engine.
                let kept = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let chunk = report.chunked.iter().find(|(id, _)| !report.stopped.contains(id));
                    if let Some(&(id, fed)) = chunk
                        && let (Some(a), Some((state, logits)), Some(disk)) =
                            (active.get(&id), batcher.seq(id), cache.as_deref_mut().and_then(|c| c.disk.as_mut()))
                        && let Some(done) = a.req.prompt.get(..a.prompt_offset + fed)
                        && let Err(e) = disk.save(done, state, logits)
                    {
                        tracing::warn!("keeping a prompt chunk's state on disk failed: {e}");
                    }
                    for id in &report.stopped {
                        if let (Some(a), Some((state, logits)), Some(c)) =
                            (active.get(id), batcher.seq(*id), cache.as_deref_mut())
                            && let Some(p) = a.req.shared_prefix
                        {
                            c.keep_shared(&session.model, &a.req.prompt[..p], state, logits);
                        }
                    }
                }));
                if kept.is_err() {
                    tracing::error!("keeping a prompt state panicked; the kept states are dropped");
                    if let Some(c) = cache.as_deref_mut() {
                        c.clear();
                    }
                }
                // The step never asked for experts: the injected fault waits for the next.
                #[cfg(feature = "test-instruments")]
                rearm(&mut active, injected);
            }
            Ok(Err(StepError { error, failed, blamed })) => {
                // A routed expert's read fault is blamed on the sequences that chose the expert,
                // anything else of a shared step (a spine layer's fault) on every sequence in it.
                // The test instrument's fault is its request's alone, when that request was in
                // the step; a step without it is only recomputed, and the fault waits for it.
                #[cfg(feature = "test-instruments")]
                let blamed: Vec<SeqId> = match injected {
                    Some((id, f)) if format!("{error:#}").contains(crate::instruments::INJECTED_PATH) => {
                        if failed.contains(&id) {
                            vec![id]
                        } else {
                            rearm(&mut active, Some((id, f)));
                            Vec::new()
                        }
                    }
                    _ => {
                        rearm(&mut active, injected);
                        blamed
                    }
                };
                for id in failed {
                    if blamed.contains(&id) {
                        fail(session, cache.as_deref(), admission, metrics, &mut active, id, &error);
                    } else {
                        recompute(session, cache.as_deref(), &mut batcher, &mut active, admission, metrics, id);
                    }
                }
                // The batcher reset the expert source; the prefix snapshot may be half written.
                if let Some(c) = cache.as_deref_mut() {
                    c.clear();
                }
                metrics.set_expert_stats(session);
            }
            Err(_) => {
                tracing::error!("the engine panicked on a batch step; its generations are discarded");
                let ids: Vec<SeqId> = active.keys().copied().collect();
                let e = anyhow::anyhow!("internal error in the engine");
                for id in ids {
                    if let Some(a) = active.remove(&id) {
                        a.end(
                            session,
                            cache.as_deref(),
                            admission,
                            metrics,
                            Update::Failed(ApiError::internal(format!("{e}"))),
                            Outcome::OtherFailure,
                        );
                    }
                }
                batcher = Batcher::new(&session.model, max_batch);
                if let Some(c) = cache.as_deref_mut() {
                    c.clear();
                }
                // A panic in the reset itself must not take the engine thread down with it.
                let experts = &mut session.experts;
                let reset = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ExpertSource::reset(experts)));
                if reset.is_err() {
                    tracing::error!("resetting the expert source after a failed step panicked");
                }
                metrics.set_expert_stats(session);
            }
        }
        // Generations whose turn ended in the step (or before it computed, from a whole stored
        // prompt): their last output and summary.
        let ended: Vec<SeqId> = active.iter().filter(|(_, a)| a.ended).map(|(&id, _)| id).collect();
        for id in ended {
            let Some(mut a) = active.remove(&id) else { continue };
            let mut sink = ChannelSink { updates: &a.updates };
            let finished = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a.turn.finish(&mut sink)));
            let (last, outcome) = match finished {
                Ok(summary) => {
                    metrics.record_generation(&summary);
                    let outcome =
                        if summary.finish == Finish::Cancelled { Outcome::Cancelled } else { Outcome::Completed };
                    (Update::Done(summary), outcome)
                }
                Err(_) => {
                    tracing::error!("finishing a generation's output panicked");
                    (Update::Failed(ApiError::internal("internal error in the engine")), Outcome::OtherFailure)
                }
            };
            a.end(session, cache.as_deref(), admission, metrics, last, outcome);
        }
        #[cfg(feature = "test-instruments")]
        if !opts.step_delay.is_zero() {
            std::thread::sleep(opts.step_delay);
        }
    }
}

/// Test instrument: an injected fault that did not reach its request goes back to it.
#[cfg(feature = "test-instruments")]
fn rearm(active: &mut HashMap<SeqId, Active<'_>>, injected: Option<(SeqId, crate::instruments::Injected)>) {
    if let Some((id, f)) = injected
        && let Some(a) = active.get_mut(&id)
    {
        a.injected = Some(f);
    }
}

/// A started job into the batch: from the longest stored state of its prompt when prompt
/// states are kept, else from its first token.
#[allow(clippy::too_many_arguments)]
fn admit<'t>(
    session: &Session,
    cache: Option<&mut PrefixCache>,
    tokenizer: &'t Tokenizer,
    batcher: &mut Batcher<'_>,
    active: &mut HashMap<SeqId, Active<'t>>,
    admission: &Admission,
    metrics: &Metrics,
    job: Job,
    #[allow(unused_variables)] opts: &EngineOptions,
) {
    let Job { req, note, updates, ticket } = job;
    let model = &session.model;
    let mut state = model.new_state();
    let mut logits = vec![0f32; model.config.vocab_size]; // [vocab]
    // With a prefix cache, a shared start's state is kept (on disk, or in its memory slot).
    let cache_on = cache.is_some();
    // A stored state that cannot be read fails this request alone, as in the solo path.
    let resumed = match cache {
        Some(c) if !req.prompt.is_empty() => {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                c.resume(model, &req.prompt, &mut state, &mut logits)
            })) {
                Ok(n) => n,
                Err(_) => {
                    tracing::error!("resuming a prompt state panicked; the request fails and the snapshot is dropped");
                    c.clear();
                    let last = Update::Failed(ApiError::internal("internal error in the engine"));
                    end_job(session, None, admission, metrics, &note, &updates, &ticket, last, Outcome::OtherFailure);
                    return;
                }
            }
        }
        _ => 0,
    };
    let joined = if resumed > 0 {
        batcher.join_from(state, logits, req.prompt[resumed..].to_vec())
    } else {
        batcher.join(req.prompt.clone())
    };
    match joined {
        Ok(id) => {
            // A shared start not stored yet: its chunk ends there, and its state is kept.
            if let Some(p) = req.shared_prefix
                && cache_on
                && p > resumed
            {
                batcher.stop_at(id, p - resumed);
            }
            #[cfg(feature = "test-instruments")]
            let injected =
                opts.inject_faults.then(|| crate::instruments::injected_fault(tokenizer, &req.prompt)).flatten();
            active.insert(
                id,
                Active {
                    turn: Turn::new(tokenizer, &req, resumed),
                    prompt_done: resumed == req.prompt.len(),
                    prompt_offset: resumed,
                    req,
                    note,
                    updates,
                    ticket,
                    ended: false,
                    #[cfg(feature = "test-instruments")]
                    injected,
                },
            );
        }
        Err(e) => end_job(
            session,
            None,
            admission,
            metrics,
            &note,
            &updates,
            &ticket,
            Update::Failed(ApiError::from_engine(&e)),
            Outcome::OtherFailure,
        ),
    }
}

/// A generation the failed step blamed: its client gets the error.
fn fail(
    session: &Session,
    cache: Option<&PrefixCache>,
    admission: &Admission,
    metrics: &Metrics,
    active: &mut HashMap<SeqId, Active<'_>>,
    id: SeqId,
    error: &anyhow::Error,
) {
    let Some(a) = active.remove(&id) else { return };
    // Routed experts or a streamed spine layer that storage would not give: what the health
    // rule counts.
    let outcome = match storage_fault(error) {
        Some(f) => Outcome::ReadFault(f),
        None => Outcome::OtherFailure,
    };
    a.end(session, cache, admission, metrics, Update::Failed(ApiError::from_engine(error)), outcome);
}

/// A generation the failed step did not blame: computed again from its prompt and the tokens
/// it had fed, then it goes on with the token it was about to feed.
fn recompute(
    session: &Session,
    cache: Option<&PrefixCache>,
    batcher: &mut Batcher<'_>,
    active: &mut HashMap<SeqId, Active<'_>>,
    admission: &Admission,
    metrics: &Metrics,
    id: SeqId,
) {
    let Some(mut a) = active.remove(&id) else { return };
    let rejoined = match a.turn.fed().split_last() {
        Some((&next, before)) => batcher.rejoin([a.req.prompt.as_slice(), before].concat(), next),
        // Still in its prompt: from the start (its first token is sampled as before).
        None => {
            a.prompt_done = false;
            a.prompt_offset = 0;
            a.turn.set_cached_prompt_tokens(0);
            batcher.join(a.req.prompt.clone())
        }
    };
    match rejoined {
        Ok(new_id) => {
            // From the start: its shared start, if any, is kept on the way as when it joined.
            if let (Some(p), Some(_), 0) = (a.req.shared_prefix, cache, a.turn.fed().len())
                && p < a.req.prompt.len()
            {
                batcher.stop_at(new_id, p);
            }
            tracing::info!(target: "deltafin::request", "{}: recomputed after a failed step it did not cause", a.note.endpoint);
            active.insert(new_id, a);
        }
        Err(e) => {
            a.end(session, cache, admission, metrics, Update::Failed(ApiError::from_engine(&e)), Outcome::OtherFailure)
        }
    }
}
