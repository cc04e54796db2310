//! The engine thread and admission to it.
//!
//! The model runs on its own thread (and the kernel thread pool it drives); the async runtime
//! only moves bytes. Jobs reach the thread through a FIFO channel; each job streams its updates
//! back through a bounded channel, whose closing (the HTTP side dropped it: client gone) cancels
//! the generation at the next token or prompt chunk. Admission counts running plus waiting jobs
//! against `1 + queue`; beyond that a request is refused with 429 before any work is done.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use deltafin_engine::chat::parse::OutputEvent;
use deltafin_engine::session::Session;
use deltafin_engine::textgen::{Sink, Summary, TextGenerator, TextRequest, TokenLogprob};
use deltafin_engine::tokenizer::Tokenizer;
use tokio::sync::mpsc;

use crate::metrics::Metrics;

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
    Failed(String),
}

pub struct Job {
    pub req: TextRequest,
    pub updates: mpsc::Sender<Update>,
    /// Holds the job's admission slot until the engine is done with it.
    pub slot: Slot,
}

/// Running plus waiting jobs, bounded.
pub struct Admission {
    limit: usize,
    admitted: AtomicUsize,
    pub running: AtomicBool,
}

impl Admission {
    pub fn new(queue: usize) -> Arc<Self> {
        Arc::new(Admission { limit: 1 + queue, admitted: AtomicUsize::new(0), running: AtomicBool::new(false) })
    }

    pub fn try_admit(self: &Arc<Self>) -> Option<Slot> {
        self.admitted
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < self.limit).then_some(n + 1))
            .ok()
            .map(|_| Slot(self.clone()))
    }

    /// Jobs admitted and not yet running.
    pub fn waiting(&self) -> usize {
        let n = self.admitted.load(Ordering::Acquire);
        n.saturating_sub(self.running.load(Ordering::Acquire) as usize)
    }
}

pub struct Slot(Arc<Admission>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.admitted.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Capacity of a job's update channel: a client that stops reading holds the engine after this
/// many tokens (back-pressure), and dropping the stream frees it.
pub const UPDATE_CHANNEL: usize = 64;

pub struct EngineHandle {
    pub jobs: std::sync::mpsc::Sender<Job>,
}

/// Start the engine thread. `open` loads the model on that thread; its error is returned here.
pub fn spawn(
    open: impl FnOnce() -> anyhow::Result<Session> + Send + 'static,
    tokenizer: Arc<Tokenizer>,
    admission: Arc<Admission>,
    metrics: Arc<Metrics>,
    step_delay: Duration,
) -> anyhow::Result<EngineHandle> {
    let (jobs_tx, jobs_rx) = std::sync::mpsc::channel::<Job>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<anyhow::Result<()>>();
    std::thread::Builder::new().name("deltafin-engine".into()).spawn(move || {
        let mut session = match open() {
            Ok(s) => {
                let _ = ready_tx.send(Ok(()));
                s
            }
            Err(e) => {
                let _ = ready_tx.send(Err(e));
                return;
            }
        };
        metrics.set_expert_stats(&session);
        while let Ok(job) = jobs_rx.recv() {
            run_job(&mut session, &tokenizer, &admission, &metrics, step_delay, job);
        }
    })?;
    ready_rx.recv().map_err(|_| anyhow::anyhow!("the engine thread died while loading the model"))??;
    Ok(EngineHandle { jobs: jobs_tx })
}

fn run_job(
    session: &mut Session,
    tokenizer: &Tokenizer,
    admission: &Admission,
    metrics: &Metrics,
    step_delay: Duration,
    job: Job,
) {
    let Job { req, updates, slot } = job;
    if updates.is_closed() {
        // The client left while waiting.
        metrics.cancelled.fetch_add(1, Ordering::Relaxed);
        drop(slot);
        return;
    }
    admission.running.store(true, Ordering::Release);
    let _ = updates.blocking_send(Update::Started);
    let generator = TextGenerator { model: &session.model, tokenizer, step_delay };
    let mut sink = ChannelSink { updates: &updates };
    let result =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| generator.run(&mut session.experts, &req, &mut sink)));
    let last = match result {
        Ok(Ok(summary)) => {
            metrics.record_generation(&summary);
            Update::Done(summary)
        }
        Ok(Err(e)) => {
            metrics.failed.fetch_add(1, Ordering::Relaxed);
            Update::Failed(format!("{e:#}"))
        }
        Err(_) => {
            // A bug, not an input error; the engine state of this request is discarded and the
            // server keeps serving.
            metrics.failed.fetch_add(1, Ordering::Relaxed);
            Update::Failed("internal error in the engine".into())
        }
    };
    metrics.set_expert_stats(session);
    // Free the slot before the last update, so a client that sends its next request as soon as
    // this one completes is never refused.
    admission.running.store(false, Ordering::Release);
    drop(slot);
    let _ = updates.blocking_send(last);
}

struct ChannelSink<'a> {
    updates: &'a mpsc::Sender<Update>,
}

impl Sink for ChannelSink<'_> {
    fn keep_going(&mut self) -> bool {
        !self.updates.is_closed()
    }

    fn token(&mut self, events: &[OutputEvent], logprob: Option<&TokenLogprob>) -> bool {
        self.updates.blocking_send(Update::Token { events: events.to_vec(), logprob: logprob.cloned() }).is_ok()
    }
}
