//! The io_uring reader (Linux only): reads go to the kernel in a ring, at most `depth` in its
//! hands at once, demand reads ahead of the others; short reads are finished with a positioned
//! read. See `stream::reader` for the contract every back-end keeps.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use super::reader::{BackendKind, ReadBackend, ReadReq, Waker, other_may_start, pread_req};

/// The user data of the wake poll's completions (read tags count up from 0 and never reach it).
const WAKE_TAG: u64 = u64::MAX;

pub struct Uring {
    ring: io_uring::IoUring,
    files: Arc<Vec<File>>,
    /// Requests by tag, kept to finish short reads synchronously.
    pending: std::collections::HashMap<u64, ReadReq>,
    /// Requests waiting for room: demand reads, and the others.
    urgent: VecDeque<ReadReq>,
    backlog: VecDeque<ReadReq>,
    /// Reads in the kernel's hands (pushed, completion not reaped), at most `depth`; of them,
    /// those that are not demand reads (started only as `other_may_start` allows).
    submitted: usize,
    submitted_other: usize,
    depth: usize,
    /// Completions reaped in one pass (reused).
    cqes: Vec<(u64, i32)>,
    /// The eventfd a [`Waker`] writes to, once one was asked for: a poll on it sits in the ring
    /// (one entry beyond `depth`), so a blocked wait returns as soon as it is written.
    wake_fd: Option<Arc<OwnedFd>>,
}

impl Uring {
    pub fn new(files: Arc<Vec<File>>, depth: u32) -> io::Result<Self> {
        // One entry beyond the reads' depth for the wake poll.
        let ring = io_uring::IoUring::new(depth.max(1) + 1)?;
        Ok(Uring {
            ring,
            files,
            pending: Default::default(),
            urgent: Default::default(),
            backlog: Default::default(),
            submitted: 0,
            submitted_other: 0,
            depth: depth.max(1) as usize,
            cqes: Vec::new(),
            wake_fd: None,
        })
    }

    /// Put a poll for the wake eventfd in the ring (once at setup, again after each wake).
    fn arm_wake(&mut self) -> io::Result<()> {
        let Some(fd) = &self.wake_fd else { return Ok(()) };
        let entry = io_uring::opcode::PollAdd::new(io_uring::types::Fd(fd.as_raw_fd()), libc::POLLIN as u32)
            .build()
            .user_data(WAKE_TAG);
        // SAFETY: a poll names no buffer; the fd is owned by self and outlives the ring's use of
        // it (the ring is dropped first, with the struct).
        unsafe { self.ring.submission().push(&entry) }
            .map_err(|_| io::Error::other("io_uring submission queue full"))?;
        self.ring.submit()?;
        Ok(())
    }

    /// The wake poll completed: empty the eventfd and put the poll back.
    fn rearm_wake(&mut self) {
        if let Some(fd) = &self.wake_fd {
            let mut v = 0u64;
            // SAFETY: reads 8 bytes into a local u64 from an eventfd we own (non-blocking: an
            // already emptied counter returns EAGAIN, which is fine).
            let _ = unsafe { libc::read(fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        }
        if let Err(e) = self.arm_wake() {
            tracing::warn!("io_uring: the wake poll could not be put back ({e}); waits wake only on completions");
            self.wake_fd = None;
        }
    }

    /// Move waiting requests into the ring while fewer than `depth` are in the kernel's hands,
    /// demand reads first, the others only as `other_may_start` allows (a demand read issued
    /// later then waits behind a few guesses at most, not a ring full of prefetches).
    fn push_backlog(&mut self) {
        let mut pushed = false;
        while self.submitted < self.depth
            && let Some(r) = self
                .urgent
                .front()
                .or(self.backlog.front().filter(|_| {
                    other_may_start(self.submitted - self.submitted_other, self.submitted_other, self.depth)
                }))
                .copied()
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
                self.submitted_other += 1;
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

    fn urge(&mut self, tags: std::ops::Range<u64>) {
        let (urgent, pending) = (&mut self.urgent, &mut self.pending);
        self.backlog.retain(|r| {
            let hit = tags.contains(&r.tag);
            if hit {
                // Counted as a demand read from now on, here and when it completes.
                let r = ReadReq { urgent: true, ..*r };
                pending.insert(r.tag, r);
                urgent.push_back(r);
            }
            !hit
        });
        self.push_backlog();
    }

    fn waker(&mut self) -> io::Result<Waker> {
        if self.wake_fd.is_none() {
            // SAFETY: eventfd(2) with valid flags; the returned descriptor is checked and owned.
            let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `fd` is a fresh descriptor that nothing else owns.
            self.wake_fd = Some(Arc::new(unsafe { OwnedFd::from_raw_fd(fd) }));
            if let Err(e) = self.arm_wake() {
                self.wake_fd = None;
                return Err(e);
            }
        }
        let fd = self.wake_fd.clone().ok_or_else(|| io::Error::other("no wake eventfd"))?;
        Ok(Arc::new(move || {
            let one = 1u64;
            // SAFETY: writes 8 bytes from a local u64 to an eventfd this closure keeps open.
            let _ = unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }))
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
            let mut woken = false;
            for cqe in self.ring.completion() {
                if cqe.user_data() == WAKE_TAG {
                    woken = true;
                } else {
                    got.push((cqe.user_data(), cqe.result()));
                }
            }
            if woken {
                self.rearm_wake();
            }
            if got.is_empty() && woken {
                self.cqes = got;
                return Ok(());
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
                if !req.urgent {
                    self.submitted_other = self.submitted_other.saturating_sub(1);
                }
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

    /// Guesses go into the ring only within their share of the depth and only while no demand
    /// read is there; a demand read submitted after them goes in at once, and so does a guess
    /// once urged.
    #[test]
    fn guesses_leave_the_ring_to_the_demand() {
        if !crate::stream::backend::io_uring_for_tests("io_uring demand share").unwrap() {
            return;
        }
        let (_f, files) = blocks_file(10);
        let mut bufs: Vec<AlignedBuf> = (0..10).map(|_| AlignedBuf::new(4096)).collect();
        let mut ring = Uring::new(files, 16).unwrap();
        let others: Vec<ReadReq> = (0..8).map(|i| block_req(&mut bufs, i, false)).collect();
        ring.submit(&others).unwrap();
        assert_eq!((ring.submitted, ring.submitted_other), (2, 2), "guesses took more than their share");
        ring.submit(&[block_req(&mut bufs, 8, true)]).unwrap();
        assert_eq!(ring.submitted, 3, "the demand read waited behind guesses");
        ring.urge(5..6);
        assert_eq!((ring.submitted, ring.submitted_other), (4, 2), "the urged guess did not go in at once");
        let (mut seen, mut out) = (Vec::new(), Vec::new());
        let mut demand_seen = 0;
        while ring.in_flight() > 0 {
            let before = ring.submitted_other;
            out.clear();
            ring.wait(&mut out).unwrap();
            assert!(ring.submitted_other <= 2 && ring.submitted <= 16);
            if ring.submitted > ring.submitted_other {
                // A demand read is still in the ring, so it was there at every push of this wait.
                assert!(ring.submitted_other <= before, "a guess went in while a demand read was there");
            }
            for (tag, res) in out.drain(..) {
                res.as_ref().unwrap();
                demand_seen += usize::from([5, 8].contains(&tag));
                seen.push(tag);
            }
        }
        assert_eq!(demand_seen, 2);
        seen.sort();
        assert_eq!(seen, (0..9).collect::<Vec<u64>>());
        for (i, b) in bufs.iter().enumerate().take(9) {
            assert!(b.as_slice()[..4096].iter().all(|&x| x == i as u8), "block {i} read wrong");
        }
    }
}
