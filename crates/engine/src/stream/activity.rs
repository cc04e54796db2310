//! Whether the drive has work: every read back-end of a run (the expert source's and the spine
//! loader's) reports its reads to one [`DiskActivity`], which measures the time during which no
//! read of ours was in flight. That idle time, per decode step, is what a pipeline that "never
//! lets the disk idle" must drive to zero (BENCHMARKS.md). A read counts from its submission to
//! the moment its completion is reaped, which the expert source's I/O thread does as soon as the
//! kernel reports it (`stream::io_thread`).
//!
//! On request ([`DiskActivity::logging`]) it also keeps every read (file, offset, length) in
//! submission order: the run's own reads, which `stream::replay` or fio replay to measure what
//! the drive gives for exactly them.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::reader::{BackendKind, ReadBackend, ReadReq};

#[derive(Debug)]
struct State {
    in_flight: usize,
    /// Since when nothing has been in flight.
    idle_since: Option<Instant>,
    idle: Duration,
}

/// One read as it went to the drive (an aligned window).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoggedRead {
    pub path: Arc<Path>,
    pub offset: u64,
    pub len: u64,
}

/// Reads in flight across back-ends, and the accumulated time with none.
#[derive(Debug)]
pub struct DiskActivity {
    state: Mutex<State>,
    /// Every read submitted, when logging.
    log: Option<Mutex<Vec<LoggedRead>>>,
}

impl Default for DiskActivity {
    fn default() -> Self {
        DiskActivity {
            state: Mutex::new(State { in_flight: 0, idle_since: Some(Instant::now()), idle: Duration::ZERO }),
            log: None,
        }
    }
}

impl DiskActivity {
    /// An activity that also keeps every read it is told of (see the module comment).
    pub fn logging() -> Self {
        DiskActivity { log: Some(Mutex::new(Vec::new())), ..Default::default() }
    }

    /// The reads logged so far, taken (empty when not logging).
    pub fn take_log(&self) -> Vec<LoggedRead> {
        self.log.as_ref().map(|l| std::mem::take(&mut *l.lock().unwrap_or_else(|p| p.into_inner()))).unwrap_or_default()
    }

    fn note(&self, paths: &[Arc<Path>], reqs: &[ReadReq]) {
        let Some(log) = &self.log else { return };
        let mut log = log.lock().unwrap_or_else(|p| p.into_inner());
        for r in reqs {
            if let Some(path) = paths.get(r.file) {
                log.push(LoggedRead { path: path.clone(), offset: r.offset, len: r.len as u64 });
            }
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut s)
    }

    /// `n` reads were handed to a back-end.
    pub fn started(&self, n: usize) {
        if n == 0 {
            return;
        }
        self.with(|s| {
            if s.in_flight == 0
                && let Some(t) = s.idle_since.take()
            {
                s.idle += t.elapsed();
            }
            s.in_flight += n;
        });
    }

    /// `n` reads completed (or were given up).
    pub fn finished(&self, n: usize) {
        if n == 0 {
            return;
        }
        self.with(|s| {
            s.in_flight = s.in_flight.saturating_sub(n);
            if s.in_flight == 0 {
                s.idle_since = Some(Instant::now());
            }
        });
    }

    /// Time so far with no read in flight (the current idle stretch included).
    pub fn idle(&self) -> Duration {
        self.with(|s| s.idle + s.idle_since.map(|t| t.elapsed()).unwrap_or_default())
    }
}

/// A read back-end that reports its reads to a [`DiskActivity`].
pub struct Watched {
    inner: Box<dyn ReadBackend>,
    activity: Arc<DiskActivity>,
    /// The back-end's files, by the index its requests name.
    paths: Vec<Arc<Path>>,
}

impl Watched {
    /// `paths`: the files `inner` reads, in the order its requests index them.
    pub fn wrap(inner: Box<dyn ReadBackend>, activity: Arc<DiskActivity>, paths: &[PathBuf]) -> Box<dyn ReadBackend> {
        let paths = paths.iter().map(|p| Arc::from(p.as_path())).collect();
        Box::new(Watched { inner, activity, paths })
    }
}

impl ReadBackend for Watched {
    fn kind(&self) -> BackendKind {
        self.inner.kind()
    }

    fn submit(&mut self, reqs: &[ReadReq]) -> io::Result<()> {
        // All or nothing: only reads that were taken count.
        self.inner.submit(reqs)?;
        self.activity.note(&self.paths, reqs);
        self.activity.started(reqs.len());
        Ok(())
    }

    fn wait(&mut self, out: &mut Vec<(u64, io::Result<()>)>) -> io::Result<()> {
        let before = out.len();
        let r = self.inner.wait(out);
        self.activity.finished(out.len() - before);
        r
    }

    fn poll(&mut self, out: &mut Vec<(u64, io::Result<()>)>) -> io::Result<()> {
        let before = out.len();
        let r = self.inner.poll(out);
        self.activity.finished(out.len() - before);
        r
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }

    fn waker(&mut self) -> io::Result<super::reader::Waker> {
        self.inner.waker()
    }

    fn urge(&mut self, tags: std::ops::Range<u64>) {
        self.inner.urge(tags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_time_counts_only_stretches_with_nothing_in_flight() {
        let a = DiskActivity::default();
        std::thread::sleep(Duration::from_millis(20));
        a.started(2);
        let idle0 = a.idle();
        assert!(idle0 >= Duration::from_millis(20));
        std::thread::sleep(Duration::from_millis(30));
        a.finished(1);
        // One read still in flight: not idle.
        assert!(a.idle() - idle0 < Duration::from_millis(5));
        a.finished(1);
        std::thread::sleep(Duration::from_millis(20));
        assert!(a.idle() - idle0 >= Duration::from_millis(20));
    }
}
