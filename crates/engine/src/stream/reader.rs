//! Read back-ends for expert records: io_uring where the kernel allows it, a pool of `pread`
//! threads otherwise. Both read whole aligned windows with O_DIRECT when the file system allows
//! it (the page cache is not our cache), many reads in flight.
//!
//! A back-end takes read requests tagged by the caller and reports completions by tag; it never
//! touches a buffer after reporting its completion. At most `depth` reads are in the device's
//! hands at once; requests beyond that wait, urgent ones (demand reads) ahead of the others
//! (prefetch).

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::mpsc::{Receiver, channel};
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

pub trait ReadBackend: Send {
    fn kind(&self) -> BackendKind;
    /// Queue reads; returns at once.
    fn submit(&mut self, reqs: &[ReadReq]) -> io::Result<()>;
    /// Block until at least one completion is available (if any read is in flight), and append
    /// every available completion to `out` as `(tag, result)`.
    fn wait(&mut self, out: &mut Vec<(u64, io::Result<()>)>) -> io::Result<()>;
    /// Append the completions available now, without blocking. A back-end that cannot tell
    /// appends none (its reads then come back through [`Self::wait`]).
    fn poll(&mut self, _out: &mut Vec<(u64, io::Result<()>)>) -> io::Result<()> {
        Ok(())
    }
    fn in_flight(&self) -> usize;
}

/// Open expert files for reading, with O_DIRECT when the file system supports it.
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
        match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(p) {
            Ok(f) => return Ok(f),
            // tmpfs and some others refuse O_DIRECT with EINVAL: fall back to buffered reads.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => *direct = false,
            Err(e) => return Err(e),
        }
    }
    File::open(p)
}

/// Positioned read of `req` into its buffer, looping over short reads until `need` bytes.
fn pread_req(file: &File, req: &ReadReq) -> io::Result<()> {
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

pub struct PreadPool {
    queue: Arc<JobQueue>,
    done: Receiver<(u64, io::Result<()>)>,
    threads: Vec<JoinHandle<()>>,
    in_flight: usize,
}

/// Reads waiting for a thread: urgent first. One thread does one read at a time, so the number
/// of threads is the queue depth.
#[derive(Default)]
struct JobQueue {
    jobs: Mutex<Jobs>,
    ready: Condvar,
}

#[derive(Default)]
struct Jobs {
    urgent: VecDeque<ReadReq>,
    other: VecDeque<ReadReq>,
    closed: bool,
}

impl JobQueue {
    /// The next read, or `None` once the pool closes.
    fn next(&self) -> Option<ReadReq> {
        let mut jobs = self.jobs.lock().ok()?;
        loop {
            if let Some(r) = jobs.urgent.pop_front().or_else(|| jobs.other.pop_front()) {
                return Some(r);
            }
            if jobs.closed {
                return None;
            }
            jobs = self.ready.wait(jobs).ok()?;
        }
    }
}

impl PreadPool {
    pub fn new(files: Arc<Vec<File>>, threads: usize) -> Self {
        let (dtx, drx) = channel();
        let queue = Arc::new(JobQueue::default());
        let threads = (0..threads.max(1))
            .map(|_| {
                let (queue, dtx, files) = (queue.clone(), dtx.clone(), files.clone());
                std::thread::spawn(move || {
                    while let Some(req) = queue.next() {
                        let res = match files.get(req.file) {
                            Some(f) => pread_req(f, &req),
                            None => Err(io::Error::other("bad file index")),
                        };
                        if dtx.send((req.tag, res)).is_err() {
                            return;
                        }
                    }
                })
            })
            .collect();
        PreadPool { queue, done: drx, threads, in_flight: 0 }
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
        self.queue.ready.notify_all();
        Ok(())
    }

    fn wait(&mut self, out: &mut Vec<(u64, io::Result<()>)>) -> io::Result<()> {
        if self.in_flight == 0 {
            return Ok(());
        }
        let first = self.done.recv().map_err(|_| io::Error::other("I/O threads stopped"))?;
        out.push(first);
        self.in_flight -= 1;
        self.poll(out)
    }

    fn poll(&mut self, out: &mut Vec<(u64, io::Result<()>)>) -> io::Result<()> {
        while self.in_flight > 0
            && let Ok(c) = self.done.try_recv()
        {
            out.push(c);
            self.in_flight -= 1;
        }
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
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
        while self.in_flight > 0 {
            if self.done.recv().is_err() {
                break;
            }
            self.in_flight -= 1;
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// io_uring
// ---------------------------------------------------------------------------------------------

pub struct Uring {
    ring: io_uring::IoUring,
    files: Arc<Vec<File>>,
    /// Requests by tag, kept to finish short reads synchronously.
    pending: std::collections::HashMap<u64, ReadReq>,
    /// Requests waiting for room: demand reads, and the others.
    urgent: VecDeque<ReadReq>,
    backlog: VecDeque<ReadReq>,
    /// Reads in the kernel's hands (pushed, completion not reaped), at most `depth`.
    submitted: usize,
    depth: usize,
    /// Completions reaped in one pass (reused).
    cqes: Vec<(u64, i32)>,
}

impl Uring {
    pub fn new(files: Arc<Vec<File>>, depth: u32) -> io::Result<Self> {
        let ring = io_uring::IoUring::new(depth.max(2))?;
        Ok(Uring {
            ring,
            files,
            pending: Default::default(),
            urgent: Default::default(),
            backlog: Default::default(),
            submitted: 0,
            depth: depth.max(1) as usize,
            cqes: Vec::new(),
        })
    }

    /// Move waiting requests into the ring while fewer than `depth` are in the kernel's hands,
    /// demand reads first.
    fn push_backlog(&mut self) {
        let mut pushed = false;
        while self.submitted < self.depth
            && let Some(r) = self.urgent.front().or(self.backlog.front()).copied()
        {
            // Checked in `submit` before the request was accepted.
            let Some(f) = self.files.get(r.file) else { break };
            let entry = io_uring::opcode::Read::new(io_uring::types::Fd(f.as_raw_fd()), r.buf, r.len as u32)
                .offset(r.offset)
                .build()
                .user_data(r.tag);
            // SAFETY: the buffer stays valid and untouched until the completion for this tag is
            // reaped (ReadReq contract), and the fd outlives the ring (both owned by self).
            if unsafe { self.ring.submission().push(&entry) }.is_err() {
                break;
            }
            if self.urgent.pop_front().is_none() {
                self.backlog.pop_front();
            }
            self.submitted += 1;
            pushed = true;
        }
        if pushed && let Err(e) = self.ring.submit() {
            // The entries stay in the submission queue; the next `submit_and_wait` hands them
            // to the kernel. Reporting the error here would make the caller believe the reads
            // were never taken and reuse their buffers while they may still be written.
            tracing::debug!("io_uring submit: {e}; the reads go with the next wait");
        }
    }
}

impl ReadBackend for Uring {
    fn kind(&self) -> BackendKind {
        BackendKind::IoUring
    }

    fn submit(&mut self, reqs: &[ReadReq]) -> io::Result<()> {
        // All or nothing: an error means no request of this call was taken.
        for r in reqs {
            if r.len > u32::MAX as usize {
                return Err(io::Error::other("read too large for one io_uring request"));
            }
            if self.files.get(r.file).is_none() {
                return Err(io::Error::other("bad file index"));
            }
        }
        for r in reqs {
            self.pending.insert(r.tag, *r);
            if r.urgent { self.urgent.push_back(*r) } else { self.backlog.push_back(*r) }
        }
        self.push_backlog();
        Ok(())
    }

    fn wait(&mut self, out: &mut Vec<(u64, io::Result<()>)>) -> io::Result<()> {
        self.reap(out, true)
    }

    fn poll(&mut self, out: &mut Vec<(u64, io::Result<()>)>) -> io::Result<()> {
        self.reap(out, false)
    }

    fn in_flight(&self) -> usize {
        self.pending.len()
    }
}

impl Uring {
    /// Take the completions in the ring; with `block`, wait for at least one first.
    fn reap(&mut self, out: &mut Vec<(u64, io::Result<()>)>, block: bool) -> io::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        if self.submitted == 0 {
            self.push_backlog();
        }
        let mut got = std::mem::take(&mut self.cqes);
        loop {
            got.clear();
            for cqe in self.ring.completion() {
                got.push((cqe.user_data(), cqe.result()));
            }
            if got.is_empty() && !block {
                self.cqes = got;
                return Ok(());
            }
            if got.is_empty() {
                match self.ring.submit_and_wait(1) {
                    Ok(_) => continue,
                    Err(e) if is_transient(&e) => continue,
                    Err(e) => {
                        self.cqes = got;
                        return Err(e);
                    }
                }
            }
            for &(tag, res) in &got {
                let Some(req) = self.pending.remove(&tag) else {
                    continue;
                };
                self.submitted = self.submitted.saturating_sub(1);
                let r = if res < 0 {
                    Err(io::Error::from_raw_os_error(-res))
                } else if (res as usize) < req.need {
                    // Short read (rare): finish the remainder synchronously.
                    let done = res as usize;
                    let rest = ReadReq {
                        offset: req.offset + done as u64,
                        // SAFETY: stays inside the request's own buffer.
                        buf: unsafe { req.buf.add(done) },
                        len: req.len - done,
                        need: req.need - done,
                        ..req
                    };
                    match self.files.get(req.file) {
                        Some(f) => pread_req(f, &rest),
                        None => Err(io::Error::other("bad file index")),
                    }
                } else {
                    Ok(())
                };
                out.push((tag, r));
            }
            self.cqes = got;
            self.push_backlog();
            return Ok(());
        }
    }
}

impl Drop for Uring {
    fn drop(&mut self) {
        // Reap every submitted read so no buffer is freed while the kernel may still write it.
        for r in std::mem::take(&mut self.backlog).into_iter().chain(std::mem::take(&mut self.urgent)) {
            self.pending.remove(&r.tag);
        }
        let mut sink = Vec::new();
        let mut failures = 0;
        while !self.pending.is_empty() {
            sink.clear();
            if self.wait(&mut sink).is_err() {
                failures += 1;
                if failures > 100 {
                    // The kernel may still write into buffers the caller is about to free:
                    // stopping the process is the only memory-safe way out.
                    eprintln!("deltafin: io_uring reads could not be reaped; aborting");
                    std::process::abort();
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }
}

/// Errors after which waiting again is the right thing.
fn is_transient(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::Interrupted || matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EBUSY))
}

/// Whether this kernel grants an io_uring ring (some sandboxes disable io_uring).
pub fn io_uring_available() -> bool {
    io_uring::IoUring::new(2).is_ok()
}

/// Pick a back-end: the forced one, or io_uring when the kernel grants a ring, else pread.
pub fn make_backend(
    files: Arc<Vec<File>>,
    force: Option<BackendKind>,
    depth: usize,
) -> io::Result<Box<dyn ReadBackend>> {
    match force {
        Some(BackendKind::Pread) => Ok(Box::new(PreadPool::new(files, depth))),
        Some(BackendKind::IoUring) => Ok(Box::new(Uring::new(files, depth as u32)?)),
        None => match Uring::new(files.clone(), depth as u32) {
            Ok(u) => Ok(Box::new(u)),
            Err(e) => {
                tracing::info!("io_uring unavailable ({e}); using the pread thread pool");
                Ok(Box::new(PreadPool::new(files, depth)))
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;
    use crate::stream::aligned::AlignedBuf;

    /// A file of `blocks` 4096-byte blocks, block i filled with byte i.
    fn blocks_file(blocks: usize) -> (tempfile::NamedTempFile, Arc<Vec<File>>) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        for i in 0..blocks {
            f.write_all(&[i as u8; 4096]).unwrap();
        }
        f.flush().unwrap();
        let file = File::open(f.path()).unwrap();
        (f, Arc::new(vec![file]))
    }

    /// A read of block `i` into `bufs[i]`, tagged `i`.
    fn block_req(bufs: &mut [AlignedBuf], i: usize, urgent: bool) -> ReadReq {
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
    fn demand_goes_first(be: &mut dyn ReadBackend, bufs: &mut [AlignedBuf]) -> Vec<u64> {
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

    #[test]
    fn pread_pool_serves_demand_reads_first() {
        let (_f, files) = blocks_file(9);
        let mut bufs: Vec<AlignedBuf> = (0..9).map(|_| AlignedBuf::new(4096)).collect();
        let mut pool = PreadPool::new(files, 1);
        demand_goes_first(&mut pool, &mut bufs);
    }

    #[test]
    fn io_uring_keeps_to_its_depth_and_serves_demand_reads_first() {
        if !io_uring_available() {
            println!("SKIPPED: this kernel refuses io_uring rings");
            return;
        }
        let (_f, files) = blocks_file(9);
        let mut bufs: Vec<AlignedBuf> = (0..9).map(|_| AlignedBuf::new(4096)).collect();
        let mut ring = Uring::new(files.clone(), 1).unwrap();
        let reqs: Vec<ReadReq> = (0..6).map(|i| block_req(&mut bufs, i, false)).collect();
        ring.submit(&reqs).unwrap();
        assert_eq!(ring.submitted, 1, "io_uring took more reads than its depth");
        let mut out = Vec::new();
        while ring.in_flight() > 0 {
            out.clear();
            ring.wait(&mut out).unwrap();
            assert!(ring.submitted <= 1, "io_uring took more reads than its depth");
        }
        let mut ring = Uring::new(files.clone(), 1).unwrap();
        demand_goes_first(&mut ring, &mut bufs);
        // All or nothing: a refused call takes none of its requests, so the caller may reuse
        // their buffers at once.
        let mut ring = Uring::new(files, 4).unwrap();
        let mut bad = block_req(&mut bufs, 1, true);
        bad.file = 7;
        let reqs = [block_req(&mut bufs, 0, true), bad];
        assert!(ring.submit(&reqs).is_err());
        assert_eq!((ring.in_flight(), ring.submitted), (0, 0), "a refused submit kept some reads");
    }
}
