//! The io_uring reader (Linux only): reads go to the kernel in a ring, at most `depth` in its
//! hands at once, demand reads ahead of the others; short reads are finished with a positioned
//! read. See `stream::reader` for the contract every back-end keeps.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::reader::{BackendKind, ReadBackend, ReadReq, pread_req};

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
pub fn available() -> bool {
    io_uring::IoUring::new(2).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::aligned::AlignedBuf;
    use crate::stream::reader::tests::{block_req, blocks_file, demand_goes_first};

    #[test]
    fn io_uring_keeps_to_its_depth_and_serves_demand_reads_first() {
        if !crate::stream::backend::io_uring_for_tests("io_uring depth and order").unwrap() {
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
