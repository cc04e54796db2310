//! Expert records are verified off the engine thread: when a record's reads have landed, its
//! buffer goes to a verifier thread that assembles the record (moving in-place ranges into
//! canonical order) and checks its xxh3, while the engine computes the records already
//! verified. The engine uses a record only after its result comes back.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use deltafin_store::checksum::xxh3_64;
use deltafin_store::manifest::ExpertLocation;
use deltafin_store::presence::Presence;

use super::geometry;

/// Verification's cost, measured step against step (feature `measure-verify` only; without it
/// nothing here exists but a `false`).
pub mod measure {
    #[cfg(feature = "measure-verify")]
    static SKIP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

    /// Whether this step's records go unhashed.
    #[inline]
    pub fn skipping() -> bool {
        #[cfg(feature = "measure-verify")]
        return SKIP.load(std::sync::atomic::Ordering::Relaxed);
        #[cfg(not(feature = "measure-verify"))]
        false
    }

    /// Decode step `step` (0-based) begins: with `DELTAFIN_MEASURE_VERIFY` set, odd steps skip
    /// the hash.
    #[cfg_attr(not(feature = "measure-verify"), allow(unused_variables))]
    pub fn step_begins(step: usize) {
        #[cfg(feature = "measure-verify")]
        {
            static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            let on = *ON.get_or_init(|| std::env::var_os("DELTAFIN_MEASURE_VERIFY").is_some());
            SKIP.store(on && step % 2 == 1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// What a record's checksum check needs to know about the store.
#[derive(Clone)]
pub struct RecordCheck {
    pub locs: Arc<HashMap<usize, Vec<ExpertLocation>>>,
    pub presence: Option<Arc<Presence>>,
    pub record_bytes: usize,
}

impl RecordCheck {
    /// Move each range's bytes to their place in the canonical record and check the checksum.
    /// Returns where the record starts in the buffer.
    pub fn check(&self, key: (usize, usize), b: &mut [u8]) -> Result<usize, String> {
        let loc = self.locs.get(&key.0).and_then(|v| v.get(key.1)).ok_or("no such record in the manifest")?;
        let start = geometry::assemble(loc, b);
        let rec = b.get(start..start + self.record_bytes).ok_or("the record does not fit its buffer")?;
        let expected = match &self.presence {
            None => loc.xxh3,
            Some(p) => p.get(key.0, key.1).ok_or("the record is not present in this streaming store")?,
        };
        let actual = if measure::skipping() { expected } else { xxh3_64(rec) };
        if actual != expected {
            return Err(format!("checksum mismatch (stored {expected:016x}, read {actual:016x})"));
        }
        Ok(start)
    }
}

/// A buffer handed to the verifier thread.
struct Job {
    id: u64,
    key: (usize, usize),
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointer targets a pool buffer owned by the flight `id`; the engine does not touch
// it until this job's result has come back (the flight stays open, marked verifying), so the
// verifier thread has it to itself.
unsafe impl Send for Job {}

/// A verified (or rejected) record: where it starts in its buffer, and the time the check took.
pub struct Checked {
    pub id: u64,
    pub result: Result<usize, String>,
    pub took: Duration,
}

/// What [`Verifier::next`] found.
pub enum Next {
    Ready(Checked),
    /// No result yet (none ready, or none within the wait).
    Empty,
    /// The thread is gone: no result will come, and it touches no buffer any more.
    Gone,
}

pub struct Verifier {
    jobs: Option<SyncSender<Job>>,
    results: Receiver<Checked>,
    thread: Option<JoinHandle<()>>,
    /// Set by [`Verifier::kill_for_tests`]: the thread dies on its next job, holding it.
    doomed: Arc<AtomicBool>,
}

impl Verifier {
    /// A verifier for at most `buffers` records outstanding (the source's buffer count): its
    /// queues are bounded by that and allocated once, so verifying allocates nothing per record.
    pub fn start(check: RecordCheck, buffers: usize) -> std::io::Result<Self> {
        let (jtx, jrx) = sync_channel::<Job>(buffers.max(1));
        let (rtx, rrx) = sync_channel(buffers.max(1));
        let doomed = Arc::new(AtomicBool::new(false));
        let dies = doomed.clone();
        let thread = std::thread::Builder::new().name("expert-verify".into()).spawn(move || {
            while let Ok(j) = jrx.recv() {
                if dies.load(Ordering::Relaxed) {
                    // A thread lost with a check outstanding (as a panic in it would leave it).
                    return;
                }
                let t0 = Instant::now();
                // SAFETY: see `Job`: the buffer is this thread's until the result is sent.
                let buf = unsafe { std::slice::from_raw_parts_mut(j.ptr, j.len) };
                let result = check.check(j.key, buf);
                if rtx.send(Checked { id: j.id, result, took: t0.elapsed() }).is_err() {
                    return;
                }
            }
        })?;
        Ok(Verifier { jobs: Some(jtx), results: rrx, thread: Some(thread), doomed })
    }

    /// For tests: the thread ends on the next job it takes, without answering it, as a thread
    /// that died (a panic, the OS) would leave its checks outstanding.
    #[doc(hidden)]
    pub fn kill_for_tests(&self) {
        self.doomed.store(true, Ordering::Relaxed);
    }

    /// Hand flight `id`'s buffer over; false when the thread is gone or its queue is full
    /// (check it in place then).
    pub fn submit(&self, id: u64, key: (usize, usize), buf: &mut [u8]) -> bool {
        let job = Job { id, key, ptr: buf.as_mut_ptr(), len: buf.len() };
        self.jobs.as_ref().is_some_and(|j| j.try_send(job).is_ok())
    }

    /// The next result, waiting as long as it takes; `None` when the thread is gone (then it
    /// touches no buffer any more).
    pub fn next_blocking(&self) -> Option<Checked> {
        self.results.recv().ok()
    }

    /// A result if one is ready; with `wait`, up to that long for one. Tells a thread that is
    /// gone from one that is still checking (a waiter on a dead thread would wait forever).
    pub fn next(&self, wait: Option<Duration>) -> Next {
        let gone = match wait {
            None => match self.results.try_recv() {
                Ok(c) => return Next::Ready(c),
                Err(e) => e == TryRecvError::Disconnected,
            },
            Some(d) => match self.results.recv_timeout(d) {
                Ok(c) => return Next::Ready(c),
                Err(e) => e == RecvTimeoutError::Disconnected,
            },
        };
        if gone { Next::Gone } else { Next::Empty }
    }
}

impl Drop for Verifier {
    fn drop(&mut self) {
        // The owner has collected every result it waits for (no buffer is still being read).
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
