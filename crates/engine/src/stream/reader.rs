//! Read back-ends for expert records: io_uring where the kernel allows it (Linux only,
//! `stream::uring`), a pool of positioned-read threads otherwise and on every other platform.
//! Both read whole aligned windows, bypassing the system's cache where the file system allows it
//! (`os::files`: the page cache is not our cache), many reads in flight.
//!
//! A back-end takes read requests tagged by the caller and reports completions by tag; it never
//! touches a buffer after reporting its completion. At most `depth` reads are in the device's
//! hands at once; requests beyond that wait, urgent ones (demand reads) ahead of the others
//! (prefetch).

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::path::Path;

use deltafin_store::os::FileAt;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// One read: `len` bytes at `offset` of file `file` into `buf`. With O_DIRECT all three are
/// multiples of 4096. `need` is how many bytes must arrive (a window may run past end of file).
#[derive(Debug, Clone, Copy)]
pub struct ReadReq {
    pub file: usize,
    pub offset: u64,
    pub len: usize,
    pub need: usize,
    pub buf: *mut u8,
    pub tag: u64,
    /// A read a computation waits for (a demand read): it goes ahead of waiting non-urgent ones.
    pub urgent: bool,
}

// SAFETY: the pointer targets a pool buffer that the submitter does not touch until the read's
// completion is reported; moving the request to an I/O thread is therefore sound.
unsafe impl Send for ReadReq {}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BackendKind {
    IoUring,
    Pread,
}

impl std::str::FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "io-uring" | "io_uring" => Ok(BackendKind::IoUring),
            "pread" => Ok(BackendKind::Pread),
            _ => Err(format!("unknown I/O back-end '{s}' (expected io-uring or pread)")),
        }
    }
}

/// Makes a [`ReadBackend::wait`] in progress return, or the next one if none is (a wake is kept
/// until a wait takes it): how a thread blocked on its reads hears that it has new work.
pub type Waker = Arc<dyn Fn() + Send + Sync>;

pub trait ReadBackend: Send {
    fn kind(&self) -> BackendKind;
    /// Queue reads; returns at once.
    fn submit(&mut self, reqs: &[ReadReq]) -> io::Result<()>;
    /// Block until at least one completion is available (if any read is in flight) or a
    /// [`Waker`] of this back-end has been called, and append every available completion to
    /// `out` as `(tag, result)`. A woken wait may append none.
    fn wait(&mut self, out: &mut Vec<(u64, io::Result<()>)>) -> io::Result<()>;
    /// A waker for [`Self::wait`] (set up on first call; a back-end that nobody wakes pays
    /// nothing for it).
    fn waker(&mut self) -> io::Result<Waker>;
    /// Append the completions available now, without blocking. A back-end that cannot tell
    /// appends none (its reads then come back through [`Self::wait`]).
    fn poll(&mut self, _out: &mut Vec<(u64, io::Result<()>)>) -> io::Result<()> {
        Ok(())
    }
    fn in_flight(&self) -> usize;
    /// The reads tagged `tags` were guesses (not urgent) and are now waited for: those that
    /// have not gone to the device yet go ahead of every other waiting guess, as demand reads.
    /// Default: nothing (a back-end without priorities).
    fn urge(&mut self, _tags: std::ops::Range<u64>) {}
}

/// Reads that are not demand reads (prefetch, read-ahead) are guesses. They go to the device
/// only while no demand read is there, and at most [`other_share`] of them at once, so a demand
/// read issued meanwhile finds the device busy with a few guesses at most, never a queue full of
/// them. Measured on the trace replay (bench-results/demand-share): prefetch on went from 0.227
/// to 0.181 s/token with this rule, where a cap alone (any of 4, 8, 16 of 32) gave 0.207-0.221.
pub fn other_may_start(demand_in_flight: usize, other_in_flight: usize, depth: usize) -> bool {
    demand_in_flight == 0 && other_in_flight < other_share(depth)
}

/// How many of `depth` reads in flight may be guesses: an eighth (4 of the default 32), one
/// at least. Large records fill the device at that depth; a demand read waits behind few.
pub fn other_share(depth: usize) -> usize {
    (depth / 8).max(1)
}

/// Open expert files for reading, bypassing the system's cache when the file system supports it.
pub fn open_files(paths: &[std::path::PathBuf], direct: bool) -> io::Result<(Vec<File>, bool)> {
    let mut use_direct = direct;
    let mut files = Vec::with_capacity(paths.len());
    for p in paths {
        files.push(open_one(p, &mut use_direct)?);
    }
    if direct && !use_direct {
        // Reopen everything buffered so the whole store is read one way.
        files = paths.iter().map(File::open).collect::<io::Result<_>>()?;
    }
    Ok((files, use_direct))
}

fn open_one(p: &Path, direct: &mut bool) -> io::Result<File> {
    if *direct {
        let (f, uncached) = crate::os::files::open_uncached(p)?;
        // A file system that refuses (tmpfs, for one) makes the whole store read buffered.
        *direct = uncached;
        return Ok(f);
    }
    File::open(p)
}

/// Positioned read of `req` into its buffer, looping over short reads until `need` bytes.
pub(crate) fn pread_req(file: &File, req: &ReadReq) -> io::Result<()> {
    // SAFETY: `buf` is valid for `len` bytes and exclusively lent to this read (see ReadReq).
    let buf = unsafe { std::slice::from_raw_parts_mut(req.buf, req.len) };
    let mut got = 0usize;
    while got < req.need {
        match file.read_at(&mut buf[got..], req.offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
        // O_DIRECT continues only at aligned positions; a short read happens at end of file.
        if !got.is_multiple_of(crate::stream::aligned::DIRECT_ALIGN) {
            break;
        }
    }
    if got < req.need {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("read {got} of {} bytes", req.need)));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// pread thread pool
// ---------------------------------------------------------------------------------------------

/// What the pool's threads (and its waker) tell the waiting side.
enum Done {
    Read(u64, io::Result<()>),
    Wake,
}

pub struct PreadPool {
    queue: Arc<JobQueue>,
    done: Receiver<Done>,
    /// Kept only to make wakers; the threads hold their own.
    wake: Option<Sender<Done>>,
    threads: Vec<JoinHandle<()>>,
    in_flight: usize,
}

/// Reads waiting for a thread: urgent first. One thread does one read at a time, so the number
/// of threads is the queue depth; reads that are not urgent start only as [`other_may_start`]
/// allows, so a demand read always finds a thread and a device nearly free of guesses.
#[derive(Default)]
struct JobQueue {
    jobs: Mutex<Jobs>,
    ready: Condvar,
}

#[derive(Default)]
struct Jobs {
    urgent: VecDeque<ReadReq>,
    other: VecDeque<ReadReq>,
    /// Reads being done now, urgent and not.
    urgent_running: usize,
    other_running: usize,
    /// The number of threads.
    depth: usize,
    closed: bool,
}

impl Jobs {
    /// The read a free thread should do now, if any: urgent first, then a guess where
    /// [`other_may_start`] allows.
    fn pick(&mut self) -> Option<ReadReq> {
        if let Some(r) = self.urgent.pop_front() {
            self.urgent_running += 1;
            return Some(r);
        }
        if other_may_start(self.urgent_running, self.other_running, self.depth)
            && let Some(r) = self.other.pop_front()
        {
            self.other_running += 1;
            return Some(r);
        }
        None
    }

    /// A read is done; returns whether a waiting guess may start now.
    fn finish(&mut self, urgent: bool) -> bool {
        if urgent {
            self.urgent_running = self.urgent_running.saturating_sub(1);
        } else {
            self.other_running = self.other_running.saturating_sub(1);
        }
        !self.other.is_empty() && other_may_start(self.urgent_running, self.other_running, self.depth)
    }

    /// Waiting guesses tagged `tags` become demand reads; returns how many moved.
    fn urge(&mut self, tags: &std::ops::Range<u64>) -> usize {
        let Jobs { urgent, other, .. } = self;
        let before = urgent.len();
        other.retain(|r| {
            let hit = tags.contains(&r.tag);
            if hit {
                urgent.push_back(ReadReq { urgent: true, ..*r });
            }
            !hit
        });
        urgent.len() - before
    }
}

impl JobQueue {
    /// The next read, or `None` once the pool closes.
    fn next(&self) -> Option<ReadReq> {
        let mut jobs = self.jobs.lock().ok()?;
        loop {
            if let Some(r) = jobs.pick() {
                if !r.urgent
                    && !jobs.other.is_empty()
                    && other_may_start(jobs.urgent_running, jobs.other_running, jobs.depth)
                {
                    // One wake per guess: the next one may start too.
                    self.ready.notify_one();
                }
                return Some(r);
            }
            if jobs.closed {
                return None;
            }
            jobs = self.ready.wait(jobs).ok()?;
        }
    }

    /// A read is done: a waiting guess may be allowed to start now.
    fn done(&self, urgent: bool) {
        let wake = self.jobs.lock().map_or(true, |mut jobs| jobs.finish(urgent));
        if wake {
            self.ready.notify_one();
        }
    }
}

impl PreadPool {
    pub fn new(files: Arc<Vec<File>>, threads: usize) -> Self {
        let (dtx, drx) = channel();
        let queue = Arc::new(JobQueue::default());
        if let Ok(mut jobs) = queue.jobs.lock() {
            jobs.depth = threads.max(1);
        }
        let threads = (0..threads.max(1))
            .map(|_| {
                let (queue, dtx, files) = (queue.clone(), dtx.clone(), files.clone());
                std::thread::spawn(move || {
                    while let Some(req) = queue.next() {
                        let res = match files.get(req.file) {
                            Some(f) => pread_req(f, &req),
                            None => Err(io::Error::other("bad file index")),
                        };
                        queue.done(req.urgent);
                        if dtx.send(Done::Read(req.tag, res)).is_err() {
                            return;
                        }
                    }
                })
            })
            .collect();
        PreadPool { queue, done: drx, wake: Some(dtx), threads, in_flight: 0 }
    }
}

impl ReadBackend for PreadPool {
    fn kind(&self) -> BackendKind {
        BackendKind::Pread
    }

    fn submit(&mut self, reqs: &[ReadReq]) -> io::Result<()> {
        let mut jobs = self.queue.jobs.lock().map_err(|_| io::Error::other("I/O queue poisoned"))?;
        if jobs.closed {
            return Err(io::Error::other("pool stopped"));
        }
        for r in reqs {
            if r.urgent {
                jobs.urgent.push_back(*r)
            } else {
                jobs.other.push_back(*r)
            }
            self.in_flight += 1;
        }
        drop(jobs);
        // One thread per read: waking all of them for one read only makes them race for it.
        for _ in 0..reqs.len().min(self.threads.len()) {
            self.queue.ready.notify_one();
        }
        Ok(())
    }

    fn wait(&mut self, out: &mut Vec<(u64, io::Result<()>)>) -> io::Result<()> {
        if self.in_flight == 0 {
            return Ok(());
        }
        match self.done.recv().map_err(|_| io::Error::other("I/O threads stopped"))? {
            Done::Read(tag, res) => {
                out.push((tag, res));
                self.in_flight -= 1;
            }
            Done::Wake => {}
        }
        self.poll(out)
    }

    fn poll(&mut self, out: &mut Vec<(u64, io::Result<()>)>) -> io::Result<()> {
        while self.in_flight > 0
            && let Ok(c) = self.done.try_recv()
        {
            if let Done::Read(tag, res) = c {
                out.push((tag, res));
                self.in_flight -= 1;
            }
        }
        Ok(())
    }

    fn waker(&mut self) -> io::Result<Waker> {
        let tx = self.wake.clone().ok_or_else(|| io::Error::other("pool stopped"))?;
        Ok(Arc::new(move || {
            // The waiting side gone: nobody to wake.
            let _ = tx.send(Done::Wake);
        }))
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn urge(&mut self, tags: std::ops::Range<u64>) {
        let Ok(mut jobs) = self.queue.jobs.lock() else { return };
        let moved = jobs.urge(&tags);
        drop(jobs);
        for _ in 0..moved.min(self.threads.len()) {
            self.queue.ready.notify_one();
        }
    }
}

impl Drop for PreadPool {
    fn drop(&mut self) {
        // Reads not started are dropped; reads started finish before their buffers can be
        // freed.
        if let Ok(mut jobs) = self.queue.jobs.lock() {
            self.in_flight -= jobs.urgent.len() + jobs.other.len();
            jobs.urgent.clear();
            jobs.other.clear();
            jobs.closed = true;
        }
        self.queue.ready.notify_all();
        self.wake = None;
        while self.in_flight > 0 {
            match self.done.recv() {
                Ok(Done::Read(..)) => self.in_flight -= 1,
                Ok(Done::Wake) => {}
                Err(_) => break,
            }
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::io::Write;

    use super::*;
    use crate::stream::aligned::AlignedBuf;

    /// A file of `blocks` 4096-byte blocks, block i filled with byte i.
    pub(crate) fn blocks_file(blocks: usize) -> (tempfile::NamedTempFile, Arc<Vec<File>>) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        for i in 0..blocks {
            f.write_all(&[i as u8; 4096]).unwrap();
        }
        f.flush().unwrap();
        let file = File::open(f.path()).unwrap();
        (f, Arc::new(vec![file]))
    }

    /// A read of block `i` into `bufs[i]`, tagged `i`.
    pub(crate) fn block_req(bufs: &mut [AlignedBuf], i: usize, urgent: bool) -> ReadReq {
        ReadReq {
            file: 0,
            offset: (i * 4096) as u64,
            len: 4096,
            need: 4096,
            buf: bufs[i].as_mut_ptr(),
            tag: i as u64,
            urgent,
        }
    }

    /// Eight prefetch reads and, last, one demand read, submitted together to a back-end of
    /// depth 1: the demand read is served first. Returns the completion order.
    pub(crate) fn demand_goes_first(be: &mut dyn ReadBackend, bufs: &mut [AlignedBuf]) -> Vec<u64> {
        let mut reqs: Vec<ReadReq> = (0..8).map(|i| block_req(bufs, i, false)).collect();
        reqs.push(block_req(bufs, 8, true));
        be.submit(&reqs).unwrap();
        let (mut order, mut out) = (Vec::new(), Vec::new());
        while be.in_flight() > 0 {
            out.clear();
            be.wait(&mut out).unwrap();
            for (tag, res) in out.drain(..) {
                res.unwrap();
                order.push(tag);
            }
        }
        assert_eq!(order.len(), 9);
        assert_eq!(order[0], 8, "the demand read waited behind prefetch reads: {order:?}");
        for (i, b) in bufs.iter().enumerate() {
            assert!(b.as_slice()[..4096].iter().all(|&x| x == i as u8), "block {i} read wrong");
        }
        order
    }

    /// The pool's rule for guesses: while a demand read runs none starts, at most
    /// `other_share(depth)` run at once, and an urged guess starts as a demand read would.
    #[test]
    fn pread_pool_starts_guesses_only_on_an_idle_device_and_within_their_share() {
        let mut bufs: Vec<AlignedBuf> = (0..10).map(|_| AlignedBuf::new(4096)).collect();
        let mut jobs = Jobs { depth: 16, ..Default::default() };
        assert_eq!(other_share(16), 2);
        jobs.other.extend((0..8).map(|i| block_req(&mut bufs, i, false)));
        let tags = |v: Vec<ReadReq>| v.iter().map(|r| r.tag).collect::<Vec<_>>();
        let first: Vec<ReadReq> = std::iter::from_fn(|| jobs.pick()).collect();
        assert_eq!(tags(first), [0, 1], "guesses beyond their share started");
        jobs.urgent.push_back(block_req(&mut bufs, 8, true));
        assert_eq!(jobs.pick().map(|r| r.tag), Some(8), "the demand read waited for a thread");
        assert!(!jobs.finish(false), "a guess may start while a demand read runs");
        assert!(jobs.pick().is_none(), "a guess started while a demand read runs");
        assert_eq!(jobs.urge(&(5..7)), 2);
        let urged: Vec<ReadReq> = std::iter::from_fn(|| jobs.pick()).collect();
        assert_eq!(tags(urged.clone()), [5, 6], "urged guesses did not start as demand reads");
        assert!(urged.iter().all(|r| r.urgent));
        assert!(!jobs.finish(true) && !jobs.finish(true) && !jobs.finish(false));
        assert!(jobs.finish(true), "the device is idle: a guess may start");
        let rest: Vec<ReadReq> = std::iter::from_fn(|| jobs.pick()).collect();
        assert_eq!(tags(rest), [2, 3]);
    }

    /// The same rule through the threads: every read completes, the urged one among them.
    #[test]
    fn pread_pool_completes_urged_and_capped_guesses() {
        let (_f, files) = blocks_file(9);
        let mut bufs: Vec<AlignedBuf> = (0..9).map(|_| AlignedBuf::new(4096)).collect();
        let mut pool = PreadPool::new(files, 16);
        let reqs: Vec<ReadReq> = (0..8).map(|i| block_req(&mut bufs, i, false)).collect();
        pool.submit(&reqs).unwrap();
        pool.urge(3..4);
        pool.submit(&[block_req(&mut bufs, 8, true)]).unwrap();
        let (mut seen, mut out) = (Vec::new(), Vec::new());
        while pool.in_flight() > 0 {
            out.clear();
            pool.wait(&mut out).unwrap();
            for (tag, res) in out.drain(..) {
                res.unwrap();
                seen.push(tag);
            }
        }
        seen.sort();
        assert_eq!(seen, (0..9).collect::<Vec<u64>>());
        for (i, b) in bufs.iter().enumerate() {
            assert!(b.as_slice()[..4096].iter().all(|&x| x == i as u8), "block {i} read wrong");
        }
    }

    #[test]
    fn pread_pool_serves_demand_reads_first() {
        let (_f, files) = blocks_file(9);
        let mut bufs: Vec<AlignedBuf> = (0..9).map(|_| AlignedBuf::new(4096)).collect();
        let mut pool = PreadPool::new(files, 1);
        demand_goes_first(&mut pool, &mut bufs);
    }
}
