//! The engine thread and admission to it.
//!
//! The model runs on its own thread (and the kernel thread pool it drives); the async runtime
//! only moves bytes. Admission counts running plus waiting requests against `1 + queue` before
//! any work is done; beyond that a request is refused with 429. Admitted jobs reach the engine
//! through a FIFO channel and stream their updates back through an unbounded channel: a client
//! that stops reading costs at most one generation's updates in memory and never blocks the
//! engine. Dropping the receiving side (client gone) cancels a running generation at its next
//! token or prompt chunk, and frees a waiting one's place in the queue at once.
//!
//! A failed generation costs that request and nothing more: the client gets an error that names
//! no server path ([`ApiError::from_engine`]), and before the next job the expert source is
//! reset and the prefix snapshot dropped, so no half-finished read or state reaches the next
//! request.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::time::Duration;

use deltafin_engine::experts::ExpertSource;
use deltafin_engine::prefix_store::PrefixStore;
use deltafin_engine::session::Session;
use deltafin_text::chat::parse::OutputEvent;
use deltafin_text::textgen::{Finish, PrefixCache, Sink, Summary, TextGenerator, TextRequest, TokenLogprob};
use deltafin_text::tokenizer::Tokenizer;
use tokio::sync::mpsc;

use crate::error::{ApiError, storage_fault};
use crate::metrics::{Metrics, Outcome};

/// What a running job reports.
#[derive(Debug)]
pub enum Update {
    /// The engine took the job (it waited in the queue until now).
    Started,
    /// Output of one token.
    Token {
        events: Vec<OutputEvent>,
        logprob: Option<TokenLogprob>,
    },
    Done(Summary),
    /// The generation failed; the error is fit for the client (no server paths).
    Failed(ApiError),
}

/// Running plus waiting requests, bounded.
pub struct Admission {
    limit: usize,
    admitted: AtomicUsize,
    /// Any generation running.
    pub running: AtomicBool,
    /// Generations running (up to the batch size).
    running_count: AtomicUsize,
}

impl Admission {
    /// One generation at a time, `queue` more waiting.
    pub fn new(queue: usize) -> Arc<Self> {
        Admission::with_batch(1, queue)
    }

    /// `max_batch` generations at once (continuous batching), `queue` more waiting.
    pub fn with_batch(max_batch: usize, queue: usize) -> Arc<Self> {
        Arc::new(Admission {
            limit: max_batch.max(1) + queue,
            admitted: AtomicUsize::new(0),
            running: AtomicBool::new(false),
            running_count: AtomicUsize::new(0),
        })
    }

    /// Generations running now.
    pub fn running_count(&self) -> usize {
        self.running_count.load(Ordering::Acquire)
    }

    fn start_running(&self) {
        self.running_count.fetch_add(1, Ordering::AcqRel);
        self.running.store(true, Ordering::Release);
    }

    fn stop_running(&self) {
        let left = self.running_count.fetch_sub(1, Ordering::AcqRel).saturating_sub(1);
        self.running.store(left > 0, Ordering::Release);
    }

    /// A place for one request, or `None` when running + waiting is at the limit.
    pub fn try_admit(self: &Arc<Self>) -> Option<Admitted> {
        self.admitted
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < self.limit).then_some(n + 1))
            .ok()
            .map(|_| Admitted(Arc::new(Ticket { state: AtomicU8::new(QUEUED), admission: self.clone() })))
    }

    /// Requests admitted and not yet running.
    pub fn waiting(&self) -> usize {
        let n = self.admitted.load(Ordering::Acquire);
        n.saturating_sub(self.running_count())
    }
}

const QUEUED: u8 = 0;
const RUNNING: u8 = 1;
const FINISHED: u8 = 2;
const ABANDONED: u8 = 3;

/// One admitted request's place. Exactly one transition frees it: waiting -> abandoned (the
/// client side let go first) or running -> finished (the engine is done).
pub struct Ticket {
    state: AtomicU8,
    admission: Arc<Admission>,
}

impl Ticket {
    fn transition(&self, from: u8, to: u8) -> bool {
        self.state.compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    fn release(&self) {
        self.admission.admitted.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The client side's hold on a ticket: dropping it before the engine takes the job gives the
/// place back at once.
pub struct Admitted(Arc<Ticket>);

impl Drop for Admitted {
    fn drop(&mut self) {
        if self.0.transition(QUEUED, ABANDONED) {
            self.0.release();
        }
    }
}

/// What the request log says of a job besides its summary.
#[derive(Debug, Clone, Copy)]
pub struct RequestNote {
    /// Method and path, e.g. `POST /v1/chat/completions`.
    pub endpoint: &'static str,
    pub grant: crate::state::Grant,
}

impl RequestNote {
    pub fn new(endpoint: &'static str, grant: crate::state::Grant) -> Self {
        RequestNote { endpoint, grant }
    }
}

/// The request log's line for a finished generation: what a person running the server wants
/// to see per request (`DELTAFIN_LOG=deltafin::request=off` silences it).
fn log_request(note: &RequestNote, result: Result<&Summary, &ApiError>) {
    let clamp = match note.grant.clamped_from {
        Some(asked) => format!("; max_tokens {asked} clamped to {}", note.grant.tokens),
        None => String::new(),
    };
    match result {
        Ok(s) if s.finish == Finish::Cancelled => tracing::info!(
            target: "deltafin::request",
            "{} cancelled (the client left): prompt {} tokens ({} cached), {} generated{clamp}",
            note.endpoint,
            s.prompt_tokens,
            s.cached_prompt_tokens,
            s.completion_tokens,
        ),
        Ok(s) => {
            let after_first = s.completion_tokens.saturating_sub(1);
            let rate = if s.decode_s > 0.0 && after_first > 0 { after_first as f64 / s.decode_s } else { 0.0 };
            tracing::info!(
                target: "deltafin::request",
                "{} 200: prompt {} tokens ({} cached), {} generated, first token {:.2} s, {:.2} tokens/s, {:?}{clamp}",
                note.endpoint,
                s.prompt_tokens,
                s.cached_prompt_tokens,
                s.completion_tokens,
                s.ttft_s,
                rate,
                s.finish,
            )
        }
        Err(e) => tracing::warn!(
            target: "deltafin::request",
            "{} {}: {}{clamp}",
            note.endpoint,
            e.status.as_u16(),
            e.message
        ),
    }
}

pub struct Job {
    pub req: TextRequest,
    pub note: RequestNote,
    pub updates: mpsc::UnboundedSender<Update>,
    pub ticket: Arc<Ticket>,
}

/// A submitted job as the HTTP side holds it.
pub struct JobHandle {
    pub updates: mpsc::UnboundedReceiver<Update>,
    /// Dropped with the handle (client gone): frees a waiting job's place.
    _admitted: Admitted,
}

impl JobHandle {
    pub async fn recv(&mut self) -> Option<Update> {
        self.updates.recv().await
    }
}

pub struct EngineHandle {
    jobs: std::sync::mpsc::Sender<Job>,
}

impl EngineHandle {
    /// Queue a job; `None` if the engine thread is gone.
    pub fn submit(&self, admitted: Admitted, req: TextRequest, note: RequestNote) -> Option<JobHandle> {
        let (tx, rx) = mpsc::unbounded_channel();
        let ticket = admitted.0.clone();
        self.jobs.send(Job { req, note, updates: tx, ticket }).ok()?;
        Some(JobHandle { updates: rx, _admitted: admitted })
    }
}

/// Prompt states kept on disk: where, how many bytes, and the identity of the store's weights
/// (the run's numerics and experts per token are added to it when the model is open).
#[derive(Debug, Clone)]
pub struct StateStoreOptions {
    pub dir: std::path::PathBuf,
    pub budget: u64,
    pub identity: u64,
}

pub struct EngineOptions {
    /// Generations that share each model step (continuous batching); 1 runs one at a time.
    pub max_batch: usize,
    /// Keep the last prompt's state for reuse by a prompt that extends it.
    pub prefix_cache: bool,
    /// And on disk.
    pub state: Option<StateStoreOptions>,
    /// Test instrument: sleep after every model step.
    #[cfg(feature = "test-instruments")]
    pub step_delay: Duration,
    /// Test instrument: fail requests whose prompt holds a fault trigger.
    #[cfg(feature = "test-instruments")]
    pub inject_faults: bool,
    /// Test instrument: sleep before loading the model.
    #[cfg(feature = "test-instruments")]
    pub load_delay: Duration,
}

impl EngineOptions {
    /// The engine's sleep after every model step: zero unless a test asked for one.
    #[cfg(feature = "test-instruments")]
    fn step_delay(&self) -> Duration {
        self.step_delay
    }
    #[cfg(not(feature = "test-instruments"))]
    fn step_delay(&self) -> Duration {
        Duration::ZERO
    }
}

/// Start the engine thread. `open` loads the model on that thread; the returned receiver says
/// when it is open (or why it could not be), so that the caller can listen meanwhile. Jobs
/// submitted before then wait for it.
pub fn spawn(
    open: impl FnOnce() -> anyhow::Result<Session> + Send + 'static,
    tokenizer: Arc<Tokenizer>,
    admission: Arc<Admission>,
    metrics: Arc<Metrics>,
    opts: EngineOptions,
) -> anyhow::Result<(EngineHandle, tokio::sync::oneshot::Receiver<anyhow::Result<()>>)> {
    let (jobs_tx, jobs_rx) = std::sync::mpsc::channel::<Job>();
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<anyhow::Result<()>>();
    std::thread::Builder::new().name("deltafin-engine".into()).spawn(move || {
        #[cfg(feature = "test-instruments")]
        std::thread::sleep(opts.load_delay);
        let opened = open().and_then(|session| {
            let cache = match (&opts.state, opts.prefix_cache) {
                (Some(s), true) => Some(PrefixCache::with_disk(&session.model, open_state_store(s, &session)?)),
                (_, true) => Some(PrefixCache::new(&session.model)),
                (_, false) => None,
            };
            Ok((session, cache))
        });
        let (mut session, mut cache) = match opened {
            Ok(x) => x,
            Err(e) => {
                let _ = ready_tx.send(Err(e));
                return;
            }
        };
        metrics.set_expert_stats(&session);
        metrics.set_max_batch(opts.max_batch.max(1));
        let _ = ready_tx.send(Ok(()));
        if opts.max_batch > 1 {
            crate::batch_worker::run(&mut session, cache.as_mut(), &tokenizer, &admission, &metrics, &opts, &jobs_rx);
            return;
        }
        while let Ok(job) = jobs_rx.recv() {
            run_job(&mut session, cache.as_mut(), &tokenizer, &admission, &metrics, &opts, job);
        }
    })?;
    Ok((EngineHandle { jobs: jobs_tx }, ready_rx))
}

fn run_job(
    session: &mut Session,
    cache: Option<&mut PrefixCache>,
    tokenizer: &Tokenizer,
    admission: &Admission,
    metrics: &Metrics,
    opts: &EngineOptions,
    job: Job,
) {
    if !start_job(admission, metrics, &job) {
        return;
    }
    let Job { req, note, updates, ticket } = job;
    let generator = TextGenerator { model: &session.model, tokenizer, step_delay: opts.step_delay() };
    let mut sink = ChannelSink { updates: &updates };
    let mut cache = cache;
    #[cfg(feature = "test-instruments")]
    let injected = opts.inject_faults.then(|| crate::instruments::injected_fault(tokenizer, &req.prompt)).flatten();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        #[cfg(feature = "test-instruments")]
        if let Some(fault) = injected {
            let mut faulty = crate::instruments::FaultyExperts { inner: &mut session.experts, fault: Some(fault) };
            return generator.run_cached(&mut faulty, &req, &mut sink, cache.as_deref_mut());
        }
        generator.run_cached(&mut session.experts, &req, &mut sink, cache.as_deref_mut())
    }));
    let (last, outcome) = match result {
        Ok(Ok(summary)) => {
            metrics.record_generation(&summary);
            let outcome = if summary.finish == Finish::Cancelled { Outcome::Cancelled } else { Outcome::Completed };
            (Update::Done(summary), outcome)
        }
        Ok(Err(e)) => {
            // Routed experts or a streamed spine layer that storage would not give: what the
            // health rule counts.
            let outcome = match storage_fault(&e) {
                Some(f) => Outcome::ReadFault(f),
                None => Outcome::OtherFailure,
            };
            (Update::Failed(ApiError::from_engine(&e)), outcome)
        }
        Err(_) => {
            // A bug, not an input error: logged, and cleaned up like any failure below.
            tracing::error!("the engine panicked on a request; its state is discarded");
            (Update::Failed(ApiError::internal("internal error in the engine")), Outcome::OtherFailure)
        }
    };
    let failed = matches!(outcome, Outcome::ReadFault(_) | Outcome::OtherFailure);
    end_job(session, cache.as_deref(), admission, metrics, &note, &updates, &ticket, last, outcome);
    // The clean-up may wait for reads in flight on a failing drive: the client has its answer
    // already, and the next job, taken by this same thread, only starts after it.
    if failed {
        clean_up_after_failure(session, cache);
        // The reset is counted in the source's fault statistics.
        metrics.set_expert_stats(session);
    }
}

/// What every generation's end does, alone or in a batch: counters and health, the place freed,
/// the request logged, and the last update sent.
#[allow(clippy::too_many_arguments)]
pub(crate) fn end_job(
    session: &Session,
    cache: Option<&PrefixCache>,
    admission: &Admission,
    metrics: &Metrics,
    note: &RequestNote,
    updates: &mpsc::UnboundedSender<Update>,
    ticket: &Ticket,
    last: Update,
    outcome: Outcome,
) {
    if matches!(outcome, Outcome::ReadFault(_) | Outcome::OtherFailure) {
        metrics.failed.fetch_add(1, Ordering::Relaxed);
    }
    // Health and counters first: a client that reads them right after its answer sees them.
    metrics.record_outcome(outcome);
    metrics.set_expert_stats(session);
    if let Some(disk) = cache.and_then(|c| c.disk.as_ref()) {
        metrics.set_state_stats(disk.counters, disk.held());
    }
    // Free the place before the last update, so a client that sends its next request as soon as
    // this one completes is never refused.
    admission.stop_running();
    if ticket.transition(RUNNING, FINISHED) {
        ticket.release();
    }
    let last = match last {
        Update::Done(s) => {
            log_request(note, Ok(&s));
            Update::Done(s)
        }
        Update::Failed(mut e) => {
            log_request(note, Err(&e));
            e.logged = true;
            Update::Failed(e)
        }
        other => other,
    };
    let _ = updates.send(last);
}

/// Take a job off the queue: false when its client left while it waited (its place is free
/// already); else it is running, and its client is told.
pub(crate) fn start_job(admission: &Admission, metrics: &Metrics, job: &Job) -> bool {
    if !job.ticket.transition(QUEUED, RUNNING) {
        tracing::info!(target: "deltafin::request", "{}: cancelled while queued (the client left)", job.note.endpoint);
        metrics.cancelled.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return false;
    }
    admission.start_running();
    let _ = job.updates.send(Update::Started);
    true
}

/// Open the prompt-state store for this model, and say what it holds and may hold.
fn open_state_store(s: &StateStoreOptions, session: &Session) -> anyhow::Result<PrefixStore> {
    // Another numerics mode or experts-per-token gives other states from the same weights.
    let identity = deltafin_engine::prefix_store::identity(s.identity, &session.state_numerics(), &session.variant());
    let store = PrefixStore::open(&s.dir, s.budget, identity)
        .map_err(|e| anyhow::anyhow!("opening the prompt-state directory {}: {e}", s.dir.display()))?;
    eprintln!("  {}", store.describe());
    Ok(store)
}

/// After a failed generation, whatever it left half done must not reach the next request: the
/// expert source waits for its reads in flight and drops anything unverified
/// ([`ExpertSource::reset`]), and the prefix snapshot, possibly half written, is forgotten.
/// The next job starts from a clean source and a full prompt.
fn clean_up_after_failure(session: &mut Session, cache: Option<&mut PrefixCache>) {
    if let Some(c) = cache {
        c.clear();
    }
    // A panic in the reset itself must not take the engine thread down with it: the server
    // keeps serving, and the log says what happened.
    let reset = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ExpertSource::reset(&mut session.experts)));
    if reset.is_err() {
        tracing::error!("resetting the expert source after a failed request panicked");
    }
}

pub(crate) struct ChannelSink<'a> {
    pub updates: &'a mpsc::UnboundedSender<Update>,
}

impl Sink for ChannelSink<'_> {
    fn keep_going(&mut self) -> bool {
        !self.updates.is_closed()
    }

    fn token(&mut self, events: &[OutputEvent], logprob: Option<&TokenLogprob>) -> bool {
        self.updates.send(Update::Token { events: events.to_vec(), logprob: logprob.cloned() }).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_freed_exactly_once() {
        let a = Admission::new(1);
        let first = a.try_admit().unwrap();
        let second = a.try_admit().unwrap();
        assert!(a.try_admit().is_none());
        // A waiting request whose client leaves frees its place at once.
        drop(second);
        let third = a.try_admit().unwrap();
        // The engine took `first`: the client letting go does not free it; finishing does.
        let t = first.0.clone();
        assert!(t.transition(QUEUED, RUNNING));
        drop(first);
        assert!(a.try_admit().is_none());
        assert!(t.transition(RUNNING, FINISHED));
        t.release();
        let fourth = a.try_admit().unwrap();
        // A ticket abandoned while queued is skipped by the engine.
        let t3 = third.0.clone();
        drop(third);
        assert!(!t3.transition(QUEUED, RUNNING));
        drop(fourth);
        assert_eq!(a.admitted.load(Ordering::Acquire), 0);
    }
}
