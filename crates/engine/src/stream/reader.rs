//! Read back-ends for expert records: io_uring where the kernel allows it, a pool of `pread`
//! threads otherwise. Both read whole aligned windows with O_DIRECT when the file system allows
//! it (the page cache is not our cache), many reads in flight.
//!
//! A back-end takes read requests tagged by the caller and reports completions by tag; it never
//! touches a buffer after reporting its completion.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
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
    jobs: Option<Sender<ReadReq>>,
    done: Receiver<(u64, io::Result<()>)>,
    threads: Vec<JoinHandle<()>>,
    in_flight: usize,
}

impl PreadPool {
    pub fn new(files: Arc<Vec<File>>, threads: usize) -> Self {
        let (jtx, jrx) = channel::<ReadReq>();
        let (dtx, drx) = channel();
        let jrx = Arc::new(Mutex::new(jrx));
        let threads = (0..threads.max(1))
            .map(|_| {
                let (jrx, dtx, files) = (jrx.clone(), dtx.clone(), files.clone());
                std::thread::spawn(move || {
                    loop {
                        let job = match jrx.lock() {
                            Ok(rx) => rx.recv(),
                            Err(_) => return,
                        };
                        let Ok(req) = job else { return };
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
        PreadPool { jobs: Some(jtx), done: drx, threads, in_flight: 0 }
    }
}

impl ReadBackend for PreadPool {
    fn kind(&self) -> BackendKind {
        BackendKind::Pread
    }

    fn submit(&mut self, reqs: &[ReadReq]) -> io::Result<()> {
        let tx = self.jobs.as_ref().ok_or_else(|| io::Error::other("pool stopped"))?;
        for r in reqs {
            tx.send(*r).map_err(|_| io::Error::other("I/O threads stopped"))?;
            self.in_flight += 1;
        }
        Ok(())
    }

    fn wait(&mut self, out: &mut Vec<(u64, io::Result<()>)>) -> io::Result<()> {
        if self.in_flight == 0 {
            return Ok(());
        }
        let first = self.done.recv().map_err(|_| io::Error::other("I/O threads stopped"))?;
        out.push(first);
        self.in_flight -= 1;
        while let Ok(c) = self.done.try_recv() {
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
        // Let in-flight reads finish before their buffers can be freed.
        while self.in_flight > 0 {
            if self.done.recv().is_err() {
                break;
            }
            self.in_flight -= 1;
        }
        self.jobs = None;
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
    /// Requests waiting for room in the submission queue.
    backlog: std::collections::VecDeque<ReadReq>,
    /// Completions reaped in one pass (reused).
    cqes: Vec<(u64, i32)>,
}

impl Uring {
    pub fn new(files: Arc<Vec<File>>, depth: u32) -> io::Result<Self> {
        let ring = io_uring::IoUring::new(depth.max(2))?;
        Ok(Uring { ring, files, pending: Default::default(), backlog: Default::default(), cqes: Vec::new() })
    }

    fn push_backlog(&mut self) -> io::Result<()> {
        let mut pushed = false;
        while let Some(r) = self.backlog.front().copied() {
            let f = self.files.get(r.file).ok_or_else(|| io::Error::other("bad file index"))?;
            let entry = io_uring::opcode::Read::new(io_uring::types::Fd(f.as_raw_fd()), r.buf, r.len as u32)
                .offset(r.offset)
                .build()
                .user_data(r.tag);
            // SAFETY: the buffer stays valid and untouched until the completion for this tag is
            // reaped (ReadReq contract), and the fd outlives the ring (both owned by self).
            if unsafe { self.ring.submission().push(&entry) }.is_err() {
                break;
            }
            self.backlog.pop_front();
            pushed = true;
        }
        if pushed {
            self.ring.submit()?;
        }
        Ok(())
    }
}

impl ReadBackend for Uring {
    fn kind(&self) -> BackendKind {
        BackendKind::IoUring
    }

    fn submit(&mut self, reqs: &[ReadReq]) -> io::Result<()> {
        for r in reqs {
            if r.len > u32::MAX as usize {
                return Err(io::Error::other("read too large for one io_uring request"));
            }
            self.pending.insert(r.tag, *r);
            self.backlog.push_back(*r);
        }
        self.push_backlog()
    }

    fn wait(&mut self, out: &mut Vec<(u64, io::Result<()>)>) -> io::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let mut got = std::mem::take(&mut self.cqes);
        loop {
            got.clear();
            for cqe in self.ring.completion() {
                got.push((cqe.user_data(), cqe.result()));
            }
            if got.is_empty() {
                match self.ring.submit_and_wait(1) {
                    Ok(_) => continue,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                }
            }
            for &(tag, res) in &got {
                let Some(req) = self.pending.remove(&tag) else {
                    continue;
                };
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
            self.push_backlog()?;
            return Ok(());
        }
    }

    fn in_flight(&self) -> usize {
        self.pending.len()
    }
}

impl Drop for Uring {
    fn drop(&mut self) {
        // Reap every submitted read so no buffer is freed while the kernel may still write it.
        for r in std::mem::take(&mut self.backlog) {
            self.pending.remove(&r.tag);
        }
        let mut sink = Vec::new();
        while !self.pending.is_empty() {
            let before = self.pending.len();
            if self.wait(&mut sink).is_err() || self.pending.len() == before {
                break;
            }
        }
    }
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
