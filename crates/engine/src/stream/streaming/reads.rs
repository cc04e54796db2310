//! The read table: which records are being read into which buffers, the requests sent to the
//! I/O thread, what comes back (handed to the demand, cached as a prefetch, read again after a
//! first fault, or given up), and the reset to a clean state after a failed step.

use std::time::Instant;

use anyhow::{Result, anyhow, bail};

use super::StreamingExperts;
use crate::fault::{FaultKind, ReadFault};
use crate::stream::cache::LayerCache;
use crate::stream::geometry;
use crate::stream::io_thread::{IoThread, Landed, Next, Outcome, RecordRead};

/// A record with the I/O thread.
pub(super) struct Flight {
    pub key: (usize, usize),
    pub buf: usize,
    pub demanded: bool,
    pub prefetched: bool,
    /// Reads of this record so far (a fault is retried once).
    pub attempts: u8,
}

/// Reads of a record before a fault ends the step.
const MAX_ATTEMPTS: u8 = 2;

impl StreamingExperts {
    /// The I/O thread, started again if an earlier one was lost and could not be restarted at
    /// the reset.
    fn io(&mut self) -> Result<&IoThread> {
        if self.io.is_none() {
            self.io = Some(self.io_spec.start()?);
            self.faults.io_restarts += 1;
        }
        self.io.as_ref().ok_or_else(|| anyhow!("no expert I/O thread"))
    }

    /// Start reading (layer, expert) into a free buffer.
    pub(super) fn start_read(&mut self, key: (usize, usize), demanded: bool) -> Result<()> {
        let buf = self.free.pop().ok_or_else(|| anyhow!("no free expert buffer (plan too small)"))?;
        self.prefetched_unused[buf] = false;
        let id = self.next_id;
        self.next_id += 1;
        self.flights.insert(id, Flight { key, buf, demanded, prefetched: !demanded, attempts: 0 });
        self.by_key.insert(key, id);
        if !demanded {
            self.prefetch_in_flight += 1;
        }
        let submitted = self.submit(id);
        if submitted.is_err()
            && let Some(f) = self.flights.remove(&id)
        {
            // It never reached the I/O thread: its buffer is free again.
            self.by_key.remove(&key);
            if f.prefetched {
                self.prefetch_in_flight -= 1;
            }
            self.free.push(f.buf);
        }
        submitted
    }

    /// Send flight `id` (again) to the I/O thread.
    fn submit(&mut self, id: u64) -> Result<()> {
        let Some(f) = self.flights.get_mut(&id) else { bail!("no read {id} in flight") };
        f.attempts += 1;
        let (key, buf, demanded) = (f.key, f.buf, f.demanded);
        let bytes = geometry::buffer_bytes(self.location(key.0, key.1)?) as u64;
        let read = RecordRead { id, key, buf: self.bufs[buf].as_mut_ptr(), len: self.slot_bytes, urgent: demanded };
        if self.io()?.send(read).is_err() {
            self.io_lost = true;
            bail!("expert source: the I/O thread stopped; the next request starts another");
        }
        let st = self.stats.entry(key.0).or_default();
        st.bytes_read += bytes;
        if demanded {
            st.demand_reads += 1;
        } else {
            st.prefetch_reads += 1;
        }
        self.bytes_read += bytes;
        Ok(())
    }

    /// Wait for the next record to land and take every one that has; finished demanded records
    /// are appended to `ready` as (demand index, buffer). A record whose read failed or whose
    /// bytes fail the checksum is read once more; when a demanded record's retry fails too, the
    /// step ends with its [`ReadFault`], after everything that landed has been taken care of.
    pub(super) fn reap(&mut self, ready: &mut Vec<(usize, usize)>) -> Result<()> {
        let t0 = Instant::now();
        let mut block = true;
        loop {
            let next = self.io.as_ref().map_or(Next::Gone, |io| io.next(block));
            if block {
                self.io_wait += t0.elapsed();
                block = false;
            }
            match next {
                Next::Landed(l) => self.on_landed(l, ready),
                Next::Empty => break,
                Next::Gone => {
                    self.io_lost = true;
                    break;
                }
            }
        }
        if self.io_lost {
            tracing::error!("the expert I/O thread is gone with {} records outstanding", self.flights.len());
            bail!("expert source: the I/O thread stopped with reads outstanding; the next request starts another");
        }
        match self.failure.take() {
            Some(fault) => Err(fault.into()),
            None => Ok(()),
        }
    }

    /// A record came back from the I/O thread: verified, or failed.
    fn on_landed(&mut self, l: Landed, ready: &mut Vec<(usize, usize)>) {
        self.verify_time += l.check;
        let Some(f) = self.flights.get(&l.id) else { return };
        let (key, buf) = (f.key, f.buf);
        let fault = match l.outcome {
            Outcome::Ready(start) => {
                self.bytes_verified += self.record_bytes as u64;
                self.data_start[buf] = start;
                None
            }
            Outcome::Checksum(msg) => {
                self.bytes_verified += self.record_bytes as u64;
                self.faults.checksum_failures += 1;
                Some((FaultKind::Checksum, format!("layer {} expert {}: {msg}", key.0, key.1)))
            }
            Outcome::Io { file, error } => {
                self.faults.read_errors += 1;
                let path = self.paths.get(file).map(|p| p.display().to_string()).unwrap_or_default();
                Some((FaultKind::Io, format!("reading layer {} expert {} from {path}: {error}", key.0, key.1)))
            }
        };
        self.settle_flight(l.id, fault, ready);
    }

    /// A flight's reads and check are done: hand it to the demand, cache it (a prefetch), read
    /// it again (a first fault) or give up on it.
    fn settle_flight(&mut self, id: u64, fault: Option<(FaultKind, String)>, ready: &mut Vec<(usize, usize)>) {
        let Some(f) = self.flights.get(&id) else { return };
        let (key, demanded, attempts) = (f.key, f.demanded, f.attempts);
        if let Some((kind, detail)) = fault {
            if demanded && attempts < MAX_ATTEMPTS {
                tracing::warn!("{detail}; reading it again");
                self.faults.retries += 1;
                if self.submit(id).is_ok() {
                    return;
                }
            }
            if let Some(f) = self.flights.remove(&id) {
                self.by_key.remove(&key);
                if f.prefetched {
                    self.prefetch_in_flight -= 1;
                }
                self.free.push(f.buf);
            }
            if demanded {
                tracing::error!("{detail}");
                self.faults.failed_records += 1;
                self.failure.get_or_insert(ReadFault { layer: key.0, expert: key.1, kind, detail });
            } else {
                // A prefetch is only a guess: its fault costs nothing but the read.
                tracing::warn!("prefetch: {detail}");
            }
            return;
        }
        let Some(f) = self.flights.remove(&id) else { return };
        self.by_key.remove(&f.key);
        if f.prefetched {
            self.prefetch_in_flight -= 1;
        }
        let demand_idx = self.demand.as_ref().and_then(|d| {
            (d.layer == f.key.0 && f.demanded)
                .then(|| d.experts.iter().enumerate().position(|(i, &e)| e == f.key.1 && d.ready[i].is_none()))
                .flatten()
        });
        match demand_idx {
            Some(i) => {
                if let Some(d) = self.demand.as_mut() {
                    d.ready[i] = Some(f.buf);
                }
                ready.push((i, f.buf));
            }
            None => {
                // A prefetch finished: keep it as a probationary cache entry.
                let policy = self.opts.policy;
                let cache = self.caches.entry(f.key.0).or_insert_with(|| LayerCache::new(0, policy));
                match cache.insert(f.key.1, f.buf, &mut self.free) {
                    Ok(()) => self.prefetched_unused[f.buf] = true,
                    // No room in the cache: it waits in its buffer for its layer.
                    Err(b) if self.landed.len() < self.opts.prefetch_buffers => {
                        self.landed.insert(f.key, b);
                    }
                    Err(b) => self.free.push(b),
                }
            }
        }
    }

    /// Let every prefetch in flight land in the cache (between steps; a warm-up or a test
    /// that needs a settled state).
    pub fn finish_prefetches(&mut self) -> Result<()> {
        anyhow::ensure!(self.demand.is_none(), "a step is open");
        let mut ready = Vec::new();
        while !self.flights.is_empty() {
            self.reap(&mut ready)?;
        }
        Ok(())
    }

    /// Back to the state between steps after a failed one (see [`crate::experts::ExpertSource::reset`]).
    pub(super) fn reset_state(&mut self) {
        // Every record with the I/O thread comes back before its buffer can be used again; if
        // the thread is gone, stopping what is left of it lets the kernel's reads land.
        while !self.io_lost && !self.flights.is_empty() {
            match self.io.as_ref().map_or(Next::Gone, |io| io.next(true)) {
                Next::Landed(l) => {
                    if let Some(f) = self.flights.remove(&l.id) {
                        self.free.push(f.buf);
                    }
                }
                Next::Empty => {}
                Next::Gone => self.io_lost = true,
            }
        }
        if self.io_lost
            && let Some(mut io) = self.io.take()
        {
            io.stop();
        }
        self.free.extend(self.flights.drain().map(|(_, f)| f.buf));
        self.by_key.clear();
        self.pending_prefetch.clear();
        self.prefetch_in_flight = 0;
        self.free.extend(self.landed.drain().map(|(_, b)| b));
        if let Some(d) = self.demand.take() {
            let policy = self.opts.policy;
            let cache = self.caches.entry(d.layer).or_insert_with(|| LayerCache::new(0, policy));
            for i in (0..d.experts.len()).filter(|&i| !d.delivered[i]) {
                match (d.cached[i], d.ready[i]) {
                    (true, _) => cache.unpin(d.experts[i]),
                    (false, Some(b)) => self.free.push(b),
                    (false, None) => {}
                }
            }
            self.spare_demand = Some(d);
        }
        self.failure = None;
        self.faults.resets += 1;
        if std::mem::take(&mut self.io_lost) {
            // A new thread for the next request; if the OS refuses one now, the next read tries
            // again (`io`).
            match self.io_spec.start() {
                Ok(io) => {
                    self.io = Some(io);
                    self.faults.io_restarts += 1;
                }
                Err(e) => tracing::warn!("expert I/O thread not restarted ({e:#}); the next request tries again"),
            }
        }
    }
}
