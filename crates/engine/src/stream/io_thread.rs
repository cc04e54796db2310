//! The expert source's I/O thread. It owns the read back-end: it submits the records the engine
//! asks for, takes each completion as the back-end reports it (blocked in the back-end's wait,
//! woken by new requests), checks a record's checksum the moment its last range has landed, and
//! hands the engine each finished record through one queue. The engine thread only sends
//! requests and waits on that queue, so reading, checking and the engine's kernels overlap: a
//! record that lands while an expert computes is checked at once, not when the compute ends.
//!
//! Ownership of a buffer: from [`IoThread::send`] until its [`Landed`] comes back, a record's
//! buffer is this thread's (the back-end writes it, then the check assembles it in place). When
//! the thread ends (stopped, or lost to a panic or a failed back-end) its back-end is dropped
//! first, which waits for every read the kernel still holds; [`IoThread::stop`] returns only
//! after that, so every buffer is the engine's again.

use std::collections::HashMap;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::geometry;
use super::reader::{BackendKind, ReadBackend, ReadReq, Waker};
use super::verify::RecordCheck;

/// Read record `key` into the buffer at `buf` (`len` bytes, the source's slot size).
#[derive(Debug, Clone, Copy)]
pub struct RecordRead {
    pub id: u64,
    pub key: (usize, usize),
    pub buf: *mut u8,
    pub len: usize,
    /// A demand read (served before prefetch reads waiting for the device).
    pub urgent: bool,
}

// SAFETY: the buffer is lent to the I/O thread from `send` until the record's `Landed` comes
// back (see the module comment); the engine does not touch it meanwhile.
unsafe impl Send for RecordRead {}

/// What the engine asks of the I/O thread.
enum Request {
    Read(RecordRead),
    /// Record `id`, sent as a guess, is now waited for: its ranges not yet on the device go
    /// ahead of the other guesses.
    Urge(u64),
}

/// How a record's read ended.
#[derive(Debug)]
pub enum Outcome {
    /// Landed and verified: the canonical record starts at this offset of its buffer.
    Ready(usize),
    /// A range failed to read (`file` is the store file's index), or the back-end refused the
    /// record.
    Io { file: usize, error: io::Error },
    /// The bytes landed but fail the record's checksum.
    Checksum(String),
}

/// A finished record, as the engine receives it.
#[derive(Debug)]
pub struct Landed {
    pub id: u64,
    pub outcome: Outcome,
    /// Time the checksum check took (zero when it was not run).
    pub check: Duration,
}

/// What [`IoThread::next`] found.
pub enum Next {
    Landed(Landed),
    /// Nothing yet.
    Empty,
    /// The thread has ended: nothing more will land, and (once [`IoThread::stop`] has returned)
    /// no read is in flight into any buffer.
    Gone,
}

pub struct IoThread {
    requests: Option<SyncSender<Request>>,
    landed: Receiver<Landed>,
    waker: Waker,
    thread: Option<JoinHandle<()>>,
    /// Set by [`IoThread::kill_for_tests`]: the thread ends on the next record it finishes,
    /// without answering it.
    doomed: Arc<AtomicBool>,
    pub kind: BackendKind,
}

impl IoThread {
    /// Start the thread on `backend`, for at most `records` records in flight at once (the
    /// source's buffer count): queues and tables are sized once, so a warm step allocates
    /// nothing here.
    pub fn start(mut backend: Box<dyn ReadBackend>, check: RecordCheck, records: usize) -> io::Result<Self> {
        let records = records.max(1);
        let waker = backend.waker()?;
        let kind = backend.kind();
        // Each record in flight is sent once and urged at most once: the queue never fills, so
        // a send never blocks while the thread sleeps in the back-end's wait.
        let (rtx, rrx) = sync_channel::<Request>(2 * records);
        let (ltx, lrx) = sync_channel::<Landed>(records);
        let doomed = Arc::new(AtomicBool::new(false));
        let dies = doomed.clone();
        let thread = std::thread::Builder::new().name("expert-io".into()).spawn(move || {
            let mut io = Reads::new(backend, check, records);
            io.run(&rrx, &ltx, &dies);
            // The back-end goes first: it waits for what the kernel still holds, and only then
            // does the engine see this thread gone.
            drop(io);
            drop(ltx);
        })?;
        Ok(IoThread { requests: Some(rtx), landed: lrx, waker, thread: Some(thread), doomed, kind })
    }

    /// Hand a record read to the thread; the request back when the thread is gone.
    pub fn send(&self, r: RecordRead) -> Result<(), RecordRead> {
        let Some(tx) = &self.requests else { return Err(r) };
        tx.send(Request::Read(r)).map_err(|_| r)?;
        (self.waker)();
        Ok(())
    }

    /// Record `id`, sent as a guess (not urgent), is now demanded: what of it has not gone to
    /// the device yet goes ahead of every other guess. Call at most once per record. A thread
    /// that is gone is noticed by the next wait, not here.
    pub fn urge(&self, id: u64) {
        if let Some(tx) = &self.requests
            && tx.send(Request::Urge(id)).is_ok()
        {
            (self.waker)();
        }
    }

    /// The next finished record: waiting for one with `block`, else only if one is ready.
    pub fn next(&self, block: bool) -> Next {
        let r = if block { self.landed.recv().map_err(|_| TryRecvError::Disconnected) } else { self.landed.try_recv() };
        match r {
            Ok(l) => Next::Landed(l),
            Err(TryRecvError::Empty) => Next::Empty,
            Err(TryRecvError::Disconnected) => Next::Gone,
        }
    }

    /// End the thread and wait for it: every read it had in flight has landed (or been given
    /// up by the kernel) when this returns. Results not taken are dropped.
    pub fn stop(&mut self) {
        self.requests = None;
        (self.waker)();
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            tracing::error!("the expert I/O thread panicked");
        }
    }

    /// For tests: the thread ends on the next record it finishes, leaving it unanswered (a
    /// thread lost to a panic or the OS).
    #[doc(hidden)]
    pub fn kill_for_tests(&self) {
        self.doomed.store(true, Ordering::Relaxed);
    }
}

impl Drop for IoThread {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A record in flight on the I/O thread.
struct Flight {
    key: (usize, usize),
    /// The tags of its ranges' reads.
    tags: std::ops::Range<u64>,
    buf: *mut u8,
    len: usize,
    parts_left: usize,
    /// The first failed range's error, with the file it read.
    error: Option<(usize, io::Error)>,
}

/// The I/O thread's side: the back-end and the records in its hands.
struct Reads {
    // Declared first so it is dropped first: it waits for reads in flight.
    backend: Box<dyn ReadBackend>,
    check: RecordCheck,
    flights: HashMap<u64, Flight>,
    /// Read tag -> (record id, file read).
    tags: HashMap<u64, (u64, usize)>,
    next_tag: u64,
    reqs: Vec<ReadReq>,
    done: Vec<(u64, io::Result<()>)>,
    /// Records whose every range has landed, not yet checked.
    finished: Vec<u64>,
}

impl Reads {
    fn new(backend: Box<dyn ReadBackend>, check: RecordCheck, records: usize) -> Self {
        let ranges = check.locs.values().flatten().map(|l| l.ranges.len()).max().unwrap_or(1);
        Reads {
            backend,
            check,
            flights: HashMap::with_capacity(records),
            tags: HashMap::with_capacity(records * ranges),
            next_tag: 0,
            reqs: Vec::with_capacity(ranges),
            done: Vec::with_capacity(records * ranges),
            finished: Vec::with_capacity(records),
        }
    }

    fn run(&mut self, requests: &Receiver<Request>, landed: &SyncSender<Landed>, doomed: &AtomicBool) {
        loop {
            // New work: waited for only when nothing is in flight.
            if self.backend.in_flight() == 0 {
                match requests.recv() {
                    Ok(r) => self.take(r, landed),
                    Err(_) => return,
                }
            }
            loop {
                match requests.try_recv() {
                    Ok(r) => self.take(r, landed),
                    Err(TryRecvError::Empty) => break,
                    // The engine is stopping the thread: the back-end's drop lets the reads in
                    // flight land.
                    Err(TryRecvError::Disconnected) => return,
                }
            }
            if self.backend.in_flight() == 0 {
                continue;
            }
            let mut done = std::mem::take(&mut self.done);
            done.clear();
            let waited = self.backend.wait(&mut done);
            self.absorb(&mut done);
            self.done = done;
            if let Err(e) = waited {
                // The back-end can no longer report its reads: the thread ends, and the engine
                // fails the step that waits for them (its buffers are free once the back-end's
                // drop has let the kernel's reads land).
                tracing::error!("expert reads: the back-end failed ({e}); the I/O thread stops");
                return;
            }
            while let Some(id) = self.finished.pop() {
                if doomed.load(Ordering::Relaxed) {
                    return;
                }
                let l = self.finish(id);
                if landed.send(l).is_err() {
                    return;
                }
                // Completions that arrived during the check are taken before the next one, so
                // the back-end's count of reads in flight follows the kernel's.
                let mut done = std::mem::take(&mut self.done);
                done.clear();
                if let Err(e) = self.backend.poll(&mut done) {
                    // What it did not report comes back through the next wait.
                    tracing::debug!("expert reads: poll: {e}");
                }
                self.absorb(&mut done);
                self.done = done;
            }
        }
    }

    fn take(&mut self, r: Request, landed: &SyncSender<Landed>) {
        match r {
            Request::Read(r) => self.start(r, landed),
            Request::Urge(id) => {
                // A record already finished (or refused) has nothing left to urge.
                if let Some(f) = self.flights.get(&id) {
                    self.backend.urge(f.tags.clone());
                }
            }
        }
    }

    /// Submit every range of a record; a refusal comes back as that record's failure.
    fn start(&mut self, r: RecordRead, landed: &SyncSender<Landed>) {
        let Some(loc) = self.check.locs.get(&r.key.0).and_then(|v| v.get(r.key.1)) else {
            let error = io::Error::other(format!("no routed expert {} in layer {}", r.key.1, r.key.0));
            let _ = landed.send(Landed { id: r.id, outcome: Outcome::Io { file: 0, error }, check: Duration::ZERO });
            return;
        };
        self.reqs.clear();
        let mut pos = 0usize;
        for w in geometry::windows(loc) {
            if pos + w.len > r.len {
                break;
            }
            let tag = self.next_tag;
            self.next_tag += 1;
            self.reqs.push(ReadReq {
                file: w.file,
                offset: w.offset,
                len: w.len,
                need: w.need,
                // SAFETY: `pos + w.len <= r.len`, checked above: inside the record's buffer.
                buf: unsafe { r.buf.add(pos) },
                tag,
                urgent: r.urgent,
            });
            pos += w.len;
        }
        let parts = self.reqs.len();
        let file = self.reqs.first().map_or(0, |q| q.file);
        let refused = if parts < loc.ranges.len() {
            Err(io::Error::other("the record does not fit its buffer"))
        } else {
            self.backend.submit(&self.reqs)
        };
        if let Err(error) = refused {
            // Nothing of it reached the back-end (all or nothing): the buffer is the engine's.
            let _ = landed.send(Landed { id: r.id, outcome: Outcome::Io { file, error }, check: Duration::ZERO });
            return;
        }
        for q in &self.reqs {
            self.tags.insert(q.tag, (r.id, q.file));
        }
        let tags = self.reqs.first().map_or(0, |q| q.tag)..self.next_tag;
        self.flights.insert(r.id, Flight { key: r.key, tags, buf: r.buf, len: r.len, parts_left: parts, error: None });
    }

    /// Count completions against their records; records complete go to `finished`.
    fn absorb(&mut self, done: &mut Vec<(u64, io::Result<()>)>) {
        for (tag, res) in done.drain(..) {
            let Some((id, file)) = self.tags.remove(&tag) else { continue };
            let Some(f) = self.flights.get_mut(&id) else { continue };
            if let Err(e) = res {
                f.error.get_or_insert((file, e));
            }
            f.parts_left = f.parts_left.saturating_sub(1);
            if f.parts_left == 0 {
                self.finished.push(id);
            }
        }
    }

    /// Every range of record `id` has landed: check it (unless a read failed).
    fn finish(&mut self, id: u64) -> Landed {
        let Some(f) = self.flights.remove(&id) else {
            let error = io::Error::other("a record finished twice");
            return Landed { id, outcome: Outcome::Io { file: 0, error }, check: Duration::ZERO };
        };
        if let Some((file, error)) = f.error {
            return Landed { id, outcome: Outcome::Io { file, error }, check: Duration::ZERO };
        }
        let t0 = Instant::now();
        // SAFETY: every range of the record has landed and the back-end no longer touches the
        // buffer; the engine does not touch it until this result reaches it (module comment).
        let buf = unsafe { std::slice::from_raw_parts_mut(f.buf, f.len) };
        let outcome = match self.check.check(f.key, buf) {
            Ok(start) => Outcome::Ready(start),
            Err(msg) => Outcome::Checksum(msg),
        };
        Landed { id, outcome, check: t0.elapsed() }
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::io::Write;

    use deltafin_store::checksum::xxh3_64;
    use deltafin_store::manifest::ExpertLocation;

    use super::*;
    use crate::stream::aligned::AlignedBuf;
    use crate::stream::backend::{io_uring_for_tests, make_backend};

    const REC: usize = 8192;

    /// Records 0..n of one file, `REC` bytes each; record `bad`'s checksum is wrong.
    fn records(n: usize, bad: usize) -> (tempfile::NamedTempFile, RecordCheck) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let mut locs = Vec::new();
        for i in 0..n {
            let data: Vec<u8> = (0..REC).map(|j| (i * 31 + j * 7) as u8).collect();
            f.write_all(&data).unwrap();
            let xxh3 = xxh3_64(&data) ^ u64::from(i == bad);
            locs.push(ExpertLocation { ranges: vec![[0, (i * REC) as u64, REC as u64]], xxh3 });
        }
        f.flush().unwrap();
        let check =
            RecordCheck { locs: Arc::new([(0, locs)].into_iter().collect()), presence: None, record_bytes: REC };
        (f, check)
    }

    fn read(id: u64, expert: usize, buf: &mut AlignedBuf) -> RecordRead {
        RecordRead { id, key: (0, expert), buf: buf.as_mut_ptr(), len: REC, urgent: true }
    }

    fn kinds() -> Vec<BackendKind> {
        let mut v = vec![BackendKind::Pread];
        if io_uring_for_tests("the I/O thread on io_uring").unwrap() {
            v.push(BackendKind::IoUring);
        }
        v
    }

    /// Records are read and checked while the engine looks away (as it does while an expert
    /// computes): after the pause every result is waiting, none needs the engine to reap it.
    #[test]
    fn records_are_read_and_checked_while_the_engine_computes() {
        for kind in kinds() {
            let (f, check) = records(4, 3);
            let files = Arc::new(vec![File::open(f.path()).unwrap()]);
            let backend = make_backend(files, Some(kind), 4).unwrap();
            let mut io = IoThread::start(backend, check, 8).unwrap();
            let mut bufs: Vec<AlignedBuf> = (0..4).map(|_| AlignedBuf::new(REC)).collect();
            for (i, b) in bufs.iter_mut().enumerate() {
                io.send(read(i as u64, i, b)).unwrap();
            }
            std::thread::sleep(Duration::from_millis(300));
            let mut ready = Vec::new();
            for _ in 0..4 {
                match io.next(false) {
                    Next::Landed(l) => ready.push(l),
                    _ => panic!("{kind:?}: a record was not read and checked while the engine looked away"),
                }
            }
            ready.sort_by_key(|l| l.id);
            for l in &ready[..3] {
                assert!(matches!(l.outcome, Outcome::Ready(0)), "{kind:?}: {:?}", l.outcome);
            }
            assert!(matches!(&ready[3].outcome, Outcome::Checksum(m) if m.contains("mismatch")), "{kind:?}");
            for (i, b) in bufs.iter().enumerate().take(3) {
                let want: Vec<u8> = (0..REC).map(|j| (i * 31 + j * 7) as u8).collect();
                assert!(b.as_slice()[..REC] == want[..], "{kind:?}: record {i} read wrong");
            }
            io.stop();
            assert!(matches!(io.next(true), Next::Gone), "{kind:?}: a stopped thread still answers");
        }
    }

    /// A new request reaches the device while the thread is blocked on a read that does not
    /// land (a pipe nobody writes yet): the waker breaks its wait. Without it the second record
    /// would wait behind the first. Linux only: it reads a pipe through io_uring (a positional
    /// read of a pipe is refused by pread, and the ring exists only on Linux).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_request_wakes_a_thread_blocked_on_its_reads() {
        use std::time::Instant;

        if !io_uring_for_tests("waking the I/O thread").unwrap() {
            return;
        }
        let (f, mut check) = records(2, usize::MAX);
        // Record 0 reads from a pipe (file 1), record 1 from the file.
        let (rx, tx) = std::io::pipe().unwrap();
        let piped: Vec<u8> = vec![9; REC];
        let mut locs = check.locs.get(&0).unwrap().clone();
        locs[0] = ExpertLocation { ranges: vec![[1, 0, REC as u64]], xxh3: xxh3_64(&piped) };
        check.locs = Arc::new([(0, locs)].into_iter().collect());
        let files = Arc::new(vec![File::open(f.path()).unwrap(), File::from(std::os::fd::OwnedFd::from(rx))]);
        let backend = make_backend(files, Some(BackendKind::IoUring), 4).unwrap();
        let mut bufs: Vec<AlignedBuf> = (0..2).map(|_| AlignedBuf::new(REC)).collect();
        let mut io = IoThread::start(backend, check, 4).unwrap();
        // Dropped before `io` if the test fails: the closed pipe ends the read, so stopping the
        // thread does not wait for it forever.
        let mut tx = tx;
        let (b0, b1) = bufs.split_at_mut(1);
        io.send(read(0, 0, &mut b0[0])).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        io.send(read(1, 1, &mut b1[0])).unwrap();
        let t0 = Instant::now();
        let first = loop {
            match io.next(false) {
                Next::Landed(l) => break l,
                Next::Gone => panic!("the I/O thread ended"),
                Next::Empty if t0.elapsed() > Duration::from_secs(5) => {
                    panic!("the second request waited behind a read that had not landed")
                }
                Next::Empty => std::thread::sleep(Duration::from_millis(1)),
            }
        };
        assert_eq!(first.id, 1);
        assert!(matches!(first.outcome, Outcome::Ready(0)), "{:?}", first.outcome);
        tx.write_all(&piped).unwrap();
        let Next::Landed(second) = io.next(true) else { panic!("the piped record never landed") };
        assert_eq!(second.id, 0);
        assert!(matches!(second.outcome, Outcome::Ready(0)), "{:?}", second.outcome);
        io.stop();
    }
}
