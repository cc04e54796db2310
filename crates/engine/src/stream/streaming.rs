//! Routed experts streamed from disk through a bounded set of aligned buffers: a per-layer cache
//! of recently used experts, demand reads issued all at once as soon as the router has chosen,
//! records handed to compute in completion order, and low-priority prefetch reads for the next
//! layer's likely experts.
//!
//! Faults: a read that fails, or whose bytes fail the record's checksum, is read once more from
//! disk; if that fails too the step ends with a [`ReadFault`] naming the layer and expert, and the
//! source returns itself to a clean state (every read in flight landed, every buffer back, no
//! half-served demand), so the next step is served normally. A failed prefetch costs nothing but
//! its buffer's time. A record that failed its checksum never enters the cache.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use deltafin_store::Store;
use deltafin_store::manifest::ExpertLocation;
use deltafin_store::presence::{ExpertFetcher, FetchStats, Presence};
use serde::Serialize;

use super::aligned::AlignedBuf;
use super::backend::make_backend;
use super::cache::{LayerCache, Policy};
use super::geometry;
use super::reader::{BackendKind, ReadBackend, ReadReq, open_files};
use super::verify::{Next, RecordCheck, Verifier};
use crate::experts::ExpertSource;
use crate::fault::{FaultKind, FaultStats, FetchFault, ReadFault};

#[derive(Debug, Clone)]
pub struct StreamOptions {
    /// Cache slots of each MoE layer (0: every expert is read when used).
    pub cache_slots_per_layer: usize,
    pub policy: Policy,
    /// Force a back-end; `None` picks io_uring when available.
    pub backend: Option<BackendKind>,
    /// Use O_DIRECT (falls back to buffered reads where the file system refuses it).
    pub direct: bool,
    /// Reads in flight at most (io_uring ring size; pread threads).
    pub queue_depth: usize,
    /// Buffers for reads in flight, beyond the cache slots: the demand set plus prefetch room.
    pub io_buffers: usize,
    /// How many of `io_buffers` prefetch may hold; the rest stay free for demand reads.
    pub prefetch_buffers: usize,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct LayerStats {
    /// Demand accesses.
    pub accesses: u64,
    /// Demand accesses served from memory without a demand read (cache or a prefetch).
    pub hits: u64,
    /// Of `hits`, those found in the cache where no prefetch or read-ahead had put them unused:
    /// the cache's own hits, what `hit_rate` reports.
    pub cache_hits: u64,
    /// Of `hits`, those that adopted a prefetch or read-ahead still in flight (the demand waited
    /// for a read that speculation had started).
    pub adopted: u64,
    /// Demand reads issued.
    pub demand_reads: u64,
    pub prefetch_reads: u64,
    /// Prefetched records that a demand later used.
    pub prefetch_used: u64,
    /// Of the prefetch reads, those a large prompt chunk read ahead into free cache room.
    pub read_ahead: u64,
    pub bytes_read: u64,
}

struct Flight {
    key: (usize, usize),
    buf: usize,
    parts_left: usize,
    demanded: bool,
    prefetched: bool,
    /// Reads of this record so far (a fault is retried once).
    attempts: u8,
    /// The first failed range's error, with the file it read.
    error: Option<(usize, std::io::Error)>,
}

/// Reads of a record before a fault ends the step.
const MAX_ATTEMPTS: u8 = 2;

/// How long the engine waits for a check before looking at the reads again, while both are
/// outstanding.
const CHECK_POLL: Duration = Duration::from_micros(200);

#[derive(Default)]
struct Demand {
    layer: usize,
    experts: Vec<usize>,
    /// Buffer of each expert once available.
    ready: Vec<Option<usize>>,
    /// Whether that buffer is owned by the cache (pinned) rather than by this demand.
    cached: Vec<bool>,
    delivered: Vec<bool>,
    /// Misses waiting for a free buffer (a prompt chunk can need more experts than there are
    /// I/O buffers); started as delivered records free theirs.
    queued: VecDeque<usize>,
}

pub struct StreamingExperts {
    // Declared first so it is dropped first: it waits for in-flight reads before the buffers
    // they write into are freed.
    backend: Box<dyn ReadBackend>,
    // Dropped next: it finishes the check in hand (its buffer still alive) and stops.
    verifier: Option<Verifier>,
    /// Checks handed to the verifier whose results have not come back.
    verifying: usize,
    /// The verifier thread was found gone with checks outstanding; the next reset starts another.
    verifier_lost: bool,
    /// How a record is checked (on the verifier thread, or here when it is unavailable).
    check: RecordCheck,
    pub backend_kind: BackendKind,
    pub o_direct: bool,
    locs: Arc<HashMap<usize, Vec<ExpertLocation>>>,
    record_bytes: usize,
    pub slot_bytes: usize,
    bufs: Vec<AlignedBuf>,
    /// Where the record starts inside each buffer.
    data_start: Vec<usize>,
    free: Vec<usize>,
    caches: HashMap<usize, LayerCache<usize>>,
    flights: HashMap<u64, Flight>,
    /// Read tag -> (flight id, file read): one tag per submitted range.
    tags: HashMap<u64, (u64, usize)>,
    by_key: HashMap<(usize, usize), u64>,
    next_id: u64,
    next_tag: u64,
    pending_prefetch: VecDeque<(usize, usize)>,
    prefetch_in_flight: usize,
    /// Per buffer: it holds a cached record brought in by prefetch and not used yet.
    prefetched_unused: Vec<bool>,
    /// Prefetched records the cache had no room for (no slots, as when the spine is streamed,
    /// or every slot pinned), held in their read buffers until their layer asks for them or
    /// passes them by: a prefetch that lands early is never thrown away unused. At most
    /// `prefetch_buffers` (they count against the prefetch room).
    landed: HashMap<(usize, usize), usize>,
    /// Buffers lent out (their pages given back to the system) while a long prompt's chunk uses
    /// that memory, and the cache slots per layer given up with them.
    lent: Vec<usize>,
    lent_per_layer: usize,
    /// Buffers whose reads could not be confirmed landed (the back-end failed while they were
    /// in flight): never reused, so the kernel can never write into a buffer in use.
    lost: usize,
    demand: Option<Demand>,
    faults: FaultStats,
    /// The fault that ends the current step, once a record's retry failed too.
    failure: Option<ReadFault>,
    opts: StreamOptions,
    pub stats: HashMap<usize, LayerStats>,
    bytes_read: u64,
    pub io_wait: Duration,
    /// Time spent assembling and hashing records on arrival (on the engine thread), and the
    /// bytes hashed: the cost of verification, reported per run.
    pub verify_time: Duration,
    pub bytes_verified: u64,
    paths: Vec<PathBuf>,
    // Buffers reused from call to call so the per-layer path allocates nothing once warm.
    reqs: Vec<ReadReq>,
    done_buf: Vec<(u64, std::io::Result<()>)>,
    queue_buf: Vec<(usize, usize)>,
    misses_buf: Vec<usize>,
    spare_demand: Option<Demand>,
    /// A streaming store's presence map: absent records are fetched (or refused) before any
    /// read of them starts, and present ones are checked against its checksums.
    presence: Option<Arc<Presence>>,
    /// Fills absent records from the origin; `None` (offline) makes an absent record an error.
    fetcher: Option<Arc<dyn ExpertFetcher>>,
}

impl StreamingExperts {
    pub fn new(store: &Store, opts: StreamOptions) -> Result<Self> {
        Self::with_backend(store, opts, |b| b)
    }

    /// [`Self::new`], with the read back-end passed through `wrap` (a decorator: I/O tracing,
    /// or fault injection in tests).
    pub fn with_backend(
        store: &Store,
        opts: StreamOptions,
        wrap: impl FnOnce(Box<dyn ReadBackend>) -> Box<dyn ReadBackend>,
    ) -> Result<Self> {
        let ex = &store.manifest.experts;
        let paths = store.experts.paths().to_vec();
        let (files, o_direct) = open_files(&paths, opts.direct)?;
        let files = Arc::new(files);
        let backend = wrap(make_backend(files, opts.backend, opts.queue_depth.max(1))?);
        let locs: HashMap<usize, Vec<ExpertLocation>> =
            ex.layers.iter().map(|l| (l.layer, l.experts.clone())).collect();
        // A buffer holds the aligned windows of all of a record's ranges back to back.
        let slot_bytes = geometry::slot_bytes(locs.values().flatten());
        let layers = locs.len();
        let n_bufs = opts.cache_slots_per_layer * layers + opts.io_buffers.max(1);
        let bufs: Vec<AlignedBuf> = (0..n_bufs).map(|_| AlignedBuf::new(slot_bytes)).collect();
        let caches = locs.keys().map(|&l| (l, LayerCache::new(opts.cache_slots_per_layer, opts.policy))).collect();
        let locs = Arc::new(locs);
        let check = RecordCheck {
            locs: locs.clone(),
            presence: store.experts.presence().cloned(),
            record_bytes: ex.record_bytes as usize,
        };
        // Without a verifier thread (the OS refused one) records are checked in place.
        let verifier = Verifier::start(check.clone(), n_bufs)
            .map_err(|e| tracing::warn!("expert verifier thread not started ({e}); checking records in place"))
            .ok();
        Ok(StreamingExperts {
            backend_kind: backend.kind(),
            backend,
            verifier,
            verifying: 0,
            verifier_lost: false,
            check,
            o_direct,
            record_bytes: ex.record_bytes as usize,
            slot_bytes,
            data_start: vec![0; bufs.len()],
            free: (0..bufs.len()).rev().collect(),
            bufs,
            locs,
            caches,
            flights: HashMap::new(),
            tags: HashMap::new(),
            by_key: HashMap::new(),
            next_id: 0,
            pending_prefetch: VecDeque::new(),
            prefetch_in_flight: 0,
            prefetched_unused: vec![false; n_bufs],
            landed: HashMap::new(),
            lent: Vec::new(),
            lent_per_layer: 0,
            lost: 0,
            next_tag: 0,
            demand: None,
            faults: FaultStats::default(),
            failure: None,
            stats: HashMap::new(),
            bytes_read: 0,
            io_wait: Duration::ZERO,
            verify_time: Duration::ZERO,
            bytes_verified: 0,
            paths,
            opts,
            reqs: Vec::new(),
            done_buf: Vec::new(),
            queue_buf: Vec::new(),
            misses_buf: Vec::new(),
            spare_demand: None,
            presence: store.experts.presence().cloned(),
            fetcher: None,
        })
    }

    /// Let this source fetch a streaming store's absent records on first use (without one,
    /// an absent record ends the step with an error that says how to fetch it).
    pub fn set_fetcher(&mut self, fetcher: Option<Arc<dyn ExpertFetcher>>) {
        self.fetcher = fetcher;
    }

    /// What the fetcher has done, when this source has one, once its background fetches have
    /// landed.
    pub fn fetch_stats(&self) -> Option<FetchStats> {
        self.fetcher.as_ref().map(|f| {
            f.settle();
            f.stats()
        })
    }

    /// Experts on disk, of all, in a streaming store.
    pub fn presence_count(&self) -> Option<(usize, usize)> {
        self.presence.as_ref().map(|p| p.count())
    }

    /// Whether (layer, expert) is on disk (always, outside streaming stores).
    fn present(&self, layer: usize, expert: usize) -> bool {
        self.presence.as_ref().is_none_or(|p| p.get(layer, expert).is_some())
    }

    /// Make every listed record of `layer` present before a read of it starts: absent ones are
    /// looked up on disk again (another process may have fetched them), then fetched, all at
    /// once; without a fetcher an absent record is an error naming how to fetch it.
    fn ensure_present(&mut self, layer: usize, experts: &[usize]) -> Result<()> {
        let Some(p) = &self.presence else { return Ok(()) };
        let mut absent = Vec::new();
        for &e in experts {
            if p.get(layer, e).is_none() && p.refresh(layer, e)?.is_none() {
                absent.push(e);
            }
        }
        if absent.is_empty() {
            return Ok(());
        }
        let fault = |offline: bool, detail: String| FetchFault {
            layer,
            expert: absent[0],
            count: absent.len(),
            offline,
            detail,
        };
        let Some(f) = &self.fetcher else {
            return Err(fault(true, String::new()).into());
        };
        f.fetch(layer, &absent).map_err(|e| fault(false, e.to_string()))?;
        if let Some(&e) = absent.iter().find(|&&e| p.get(layer, e).is_none()) {
            bail!("layer {layer} expert {e}: the fetcher returned without making it present");
        }
        Ok(())
    }

    fn location(&self, layer: usize, expert: usize) -> Result<&ExpertLocation> {
        self.locs
            .get(&layer)
            .and_then(|v| v.get(expert))
            .ok_or_else(|| anyhow!("no routed expert {expert} in layer {layer}"))
    }

    /// Start reading (layer, expert) into a free buffer.
    fn start_read(&mut self, key: (usize, usize), demanded: bool) -> Result<()> {
        let buf = self.free.pop().ok_or_else(|| anyhow!("no free expert buffer (plan too small)"))?;
        self.prefetched_unused[buf] = false;
        let id = self.next_id;
        self.next_id += 1;
        self.flights
            .insert(id, Flight { key, buf, parts_left: 0, demanded, prefetched: !demanded, attempts: 0, error: None });
        self.by_key.insert(key, id);
        if !demanded {
            self.prefetch_in_flight += 1;
        }
        let submitted = self.submit(id);
        if submitted.is_err()
            && let Some(f) = self.flights.remove(&id)
        {
            // Nothing of it is in flight: its buffer is free again.
            self.by_key.remove(&key);
            if f.prefetched {
                self.prefetch_in_flight -= 1;
            }
            self.free.push(f.buf);
        }
        submitted
    }

    /// Submit (again) every range of flight `id` into its buffer.
    fn submit(&mut self, id: u64) -> Result<()> {
        let Some(f) = self.flights.get_mut(&id) else { bail!("no read {id} in flight") };
        let (key, buf, demanded) = (f.key, f.buf, f.demanded);
        f.attempts += 1;
        f.error = None;
        let locs = Arc::clone(&self.locs);
        let loc = locs
            .get(&key.0)
            .and_then(|v| v.get(key.1))
            .ok_or_else(|| anyhow!("no routed expert {} in layer {}", key.1, key.0))?;
        let mut reqs = std::mem::take(&mut self.reqs);
        reqs.clear();
        let mut pos = 0usize;
        let base = self.bufs[buf].as_mut_ptr();
        for w in geometry::windows(loc) {
            let tag = self.next_tag;
            self.next_tag += 1;
            reqs.push(ReadReq {
                file: w.file,
                offset: w.offset,
                len: w.len,
                need: w.need,
                // SAFETY: `pos + window` fits in the buffer by construction of `slot_bytes`.
                buf: unsafe { base.add(pos) },
                tag,
                urgent: demanded,
            });
            self.tags.insert(tag, (id, w.file));
            pos += w.len;
        }
        if let Some(f) = self.flights.get_mut(&id) {
            f.parts_left = reqs.len();
        }
        let bytes: u64 = reqs.iter().map(|r| r.len as u64).sum();
        let st = self.stats.entry(key.0).or_default();
        st.bytes_read += bytes;
        if demanded {
            st.demand_reads += 1;
        } else {
            st.prefetch_reads += 1;
        }
        self.bytes_read += bytes;
        let submitted = self.backend.submit(&reqs);
        if submitted.is_err() {
            // Nothing of this flight reached the back-end: forget its tags.
            for r in &reqs {
                self.tags.remove(&r.tag);
            }
        }
        self.reqs = reqs;
        submitted?;
        Ok(())
    }

    /// Reap completions; finished demanded records are returned as (demand index, buffer). A
    /// record whose read failed or whose bytes fail the checksum is read once more; when a
    /// demanded record's retry fails too, the step ends with its [`ReadFault`], after every
    /// other completion of this pass has been taken care of.
    fn reap(&mut self, ready: &mut Vec<(usize, usize)>) -> Result<()> {
        let mut done = std::mem::take(&mut self.done_buf);
        done.clear();
        let t0 = Instant::now();
        let waited = if self.verifying > 0 {
            // Checks and reads both finish: wait briefly for a check, then take whatever reads
            // have landed without blocking.
            let wait = if self.backend.in_flight() > 0 { CHECK_POLL } else { Duration::from_secs(1) };
            self.collect_checked(ready, Some(wait));
            self.backend.poll(&mut done)
        } else {
            self.backend.wait(&mut done)
        };
        self.io_wait += t0.elapsed();
        for (tag, res) in done.drain(..) {
            let Some((id, file)) = self.tags.remove(&tag) else {
                continue;
            };
            let Some(f) = self.flights.get_mut(&id) else {
                continue;
            };
            if let Err(e) = res {
                f.error.get_or_insert((file, e));
            }
            f.parts_left = f.parts_left.saturating_sub(1);
            if f.parts_left == 0 {
                self.complete(id, ready);
            }
        }
        self.done_buf = done;
        waited?;
        self.collect_checked(ready, None);
        if self.verifier_lost {
            bail!(
                "expert source: the checksum verifier thread is gone; the records it held are read again by the next request"
            );
        }
        match self.failure.take() {
            Some(fault) => Err(fault.into()),
            None => Ok(()),
        }
    }

    /// Every range of flight `id` has landed: verify it, then hand it to the demand, cache it
    /// (a prefetch), read it again (a first fault) or give up on it.
    fn complete(&mut self, id: u64, ready: &mut Vec<(usize, usize)>) {
        let Some(f) = self.flights.get_mut(&id) else { return };
        let (key, buf) = (f.key, f.buf);
        if let Some((file, e)) = f.error.take() {
            self.faults.read_errors += 1;
            let path = self.paths.get(file).map(|p| p.display().to_string()).unwrap_or_default();
            let detail = format!("reading layer {} expert {} from {path}: {e}", key.0, key.1);
            return self.settle_flight(id, Some((FaultKind::Io, detail)), ready);
        }
        // The checksum is checked on the verifier thread; the flight keeps its buffer until the
        // result comes back (`collect_checked`).
        if let Some(v) = &self.verifier
            && v.submit(id, key, self.bufs[buf].as_mut_slice())
        {
            self.verifying += 1;
            return;
        }
        let t0 = Instant::now();
        let checked = self.check.check(key, self.bufs[buf].as_mut_slice());
        self.verify_time += t0.elapsed();
        self.checked(id, checked, ready);
    }

    /// Flight `id`'s checksum check came back: `Ok(start)` of the record in its buffer, or why
    /// it was rejected.
    fn checked(&mut self, id: u64, result: std::result::Result<usize, String>, ready: &mut Vec<(usize, usize)>) {
        let Some(f) = self.flights.get(&id) else { return };
        let (key, buf) = (f.key, f.buf);
        self.bytes_verified += self.record_bytes as u64;
        let fault = match result {
            Ok(start) => {
                self.data_start[buf] = start;
                None
            }
            Err(msg) => {
                self.faults.checksum_failures += 1;
                Some((FaultKind::Checksum, format!("layer {} expert {}: {msg}", key.0, key.1)))
            }
        };
        self.settle_flight(id, fault, ready);
    }

    /// Take the checks the verifier has finished; with `wait`, wait up to that long for the
    /// first.
    fn collect_checked(&mut self, ready: &mut Vec<(usize, usize)>, wait: Option<Duration>) {
        let mut wait = wait;
        while self.verifying > 0 {
            let Some(v) = self.verifier.as_ref() else { break };
            match v.next(wait.take()) {
                Next::Ready(c) => {
                    self.verifying -= 1;
                    self.verify_time += c.took;
                    self.checked(c.id, c.result, ready);
                }
                Next::Empty => break,
                Next::Gone => {
                    // Its checks will never come back: this request fails (`reap`), and the
                    // reset after it starts a new thread. Their buffers are no longer touched.
                    tracing::error!("the expert verifier thread is gone with {} checks outstanding", self.verifying);
                    self.verifying = 0;
                    self.verifier_lost = true;
                    break;
                }
            }
        }
    }

    /// Wait until every check handed to the verifier has come back, discarding the results
    /// (a reset: every flight's buffer is freed next, so none may still be in the verifier's
    /// hands).
    fn discard_checks(&mut self) {
        while self.verifying > 0 {
            // `None`: the thread is gone and touches no buffer any more.
            if self.verifier.as_ref().and_then(|v| v.next_blocking()).is_none() {
                self.verifying = 0;
                break;
            }
            self.verifying -= 1;
        }
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
                let cache = self.caches.entry(f.key.0).or_insert_with(|| LayerCache::new(0, self.opts.policy));
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

    /// Nothing in flight, no demand, and every buffer free, cached or (after a back-end failure)
    /// retired: the state between steps. For tests and checks after a fault.
    pub fn check_idle(&self) -> Result<()> {
        anyhow::ensure!(self.demand.is_none(), "a demand is still open");
        anyhow::ensure!(
            self.flights.is_empty() && self.tags.is_empty() && self.by_key.is_empty(),
            "{} reads are still tracked",
            self.flights.len()
        );
        anyhow::ensure!(self.backend.in_flight() == 0, "{} reads are in flight", self.backend.in_flight());
        anyhow::ensure!(self.verifying == 0, "{} checks are with the verifier", self.verifying);
        let cached: usize = self.caches.values().map(|c| c.len()).sum();
        anyhow::ensure!(
            self.free.len() + cached + self.landed.len() + self.lent.len() + self.lost == self.bufs.len(),
            "buffers unaccounted for: {} free + {cached} cached + {} landed prefetches + {} lent + {} retired of {}",
            self.free.len(),
            self.landed.len(),
            self.lent.len(),
            self.lost,
            self.bufs.len()
        );
        Ok(())
    }

    /// Let every prefetch in flight land in the cache (between steps; a warm-up or a test
    /// that needs a settled state).
    pub fn finish_prefetches(&mut self) -> Result<()> {
        anyhow::ensure!(self.demand.is_none(), "a step is open");
        let mut ready = Vec::new();
        while !self.flights.is_empty() && (self.backend.in_flight() > 0 || self.verifying > 0) {
            self.reap(&mut ready)?;
        }
        Ok(())
    }

    /// Whether (layer, expert) is in the cache.
    pub fn is_cached(&self, layer: usize, expert: usize) -> bool {
        self.caches.get(&layer).is_some_and(|c| c.contains(expert))
    }

    /// Back to the state between steps after a failed one (see [`ExpertSource::reset`]).
    fn reset_state(&mut self) {
        // Every read in flight must land before its buffer can be used again.
        let mut done = std::mem::take(&mut self.done_buf);
        while self.backend.in_flight() > 0 {
            done.clear();
            if self.backend.wait(&mut done).is_err() {
                break;
            }
        }
        done.clear();
        self.done_buf = done;
        self.discard_checks();
        let landed = self.backend.in_flight() == 0;
        for (_, f) in self.flights.drain() {
            if landed {
                self.free.push(f.buf);
            } else {
                self.lost += 1;
            }
        }
        self.tags.clear();
        self.by_key.clear();
        self.pending_prefetch.clear();
        self.prefetch_in_flight = 0;
        self.free.extend(self.landed.drain().map(|(_, b)| b));
        if let Some(d) = self.demand.take() {
            let cache = self.caches.entry(d.layer).or_insert_with(|| LayerCache::new(0, self.opts.policy));
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
        if self.verifier_lost {
            // The lost thread's checks were outstanding: their flights were dropped above with
            // the rest. A new thread for the next request (records are checked in place if the
            // OS refuses one).
            self.verifier = Verifier::start(self.check.clone(), self.bufs.len())
                .map_err(|e| tracing::warn!("expert verifier thread not restarted ({e}); checking records in place"))
                .ok();
            self.verifier_lost = false;
            self.faults.verifier_restarts += 1;
        }
    }

    /// For tests: the verifier thread dies on the next record it takes, leaving that check
    /// outstanding (a thread lost to a panic or the OS).
    #[doc(hidden)]
    pub fn kill_verifier_for_tests(&self) {
        if let Some(v) = &self.verifier {
            v.kill_for_tests();
        }
    }

    /// Submit queued prefetches while prefetch buffers are available.
    fn pump_prefetch(&mut self) -> Result<()> {
        while self.prefetch_in_flight + self.landed.len() < self.opts.prefetch_buffers && !self.free.is_empty() {
            let Some(key) = self.pending_prefetch.pop_front() else {
                break;
            };
            let cached = self.caches.get(&key.0).is_some_and(|c| c.contains(key.1));
            if cached || self.by_key.contains_key(&key) || self.landed.contains_key(&key) {
                continue;
            }
            if let Err(e) = self.start_read(key, false) {
                // A prefetch is only a guess: a read that cannot start costs nothing else.
                tracing::warn!("prefetch of layer {} expert {} not started: {e:#}", key.0, key.1);
                break;
            }
        }
        Ok(())
    }

    /// After demand record `i` was used: a cache hit is unpinned; a fresh record enters the
    /// cache (or its buffer is freed), and a waiting miss can start in the freed buffer.
    fn settle(&mut self, i: usize) -> Result<()> {
        let Some(d) = self.demand.as_mut() else { bail!("demand vanished") };
        d.delivered[i] = true;
        let (layer, e, cached, b) = (d.layer, d.experts[i], d.cached[i], d.ready[i]);
        let cache = self.caches.entry(layer).or_insert_with(|| LayerCache::new(0, self.opts.policy));
        match (cached, b) {
            (true, _) => cache.unpin(e),
            (false, Some(b)) => {
                if let Err(b) = cache.insert(e, b, &mut self.free) {
                    self.free.push(b);
                }
            }
            (false, None) => {}
        }
        self.start_queued()
    }

    /// Start the demand's misses that wait for a buffer, while buffers are free.
    fn start_queued(&mut self) -> Result<()> {
        while !self.free.is_empty() {
            let Some((layer, next)) = self.demand.as_mut().and_then(|d| d.queued.pop_front().map(|e| (d.layer, e)))
            else {
                break;
            };
            self.start_read((layer, next), true)?;
        }
        Ok(())
    }

    pub fn policy(&self) -> Policy {
        self.opts.policy
    }

    /// Start the counters afresh (a warm run measures its second generation alone); the
    /// cache and everything in flight are untouched.
    pub fn clear_stats(&mut self) {
        self.stats.clear();
        self.io_wait = Duration::ZERO;
        self.verify_time = Duration::ZERO;
        self.bytes_verified = 0;
    }

    pub fn total_stats(&self) -> LayerStats {
        let mut t = LayerStats::default();
        for s in self.stats.values() {
            t.accesses += s.accesses;
            t.hits += s.hits;
            t.cache_hits += s.cache_hits;
            t.adopted += s.adopted;
            t.demand_reads += s.demand_reads;
            t.prefetch_reads += s.prefetch_reads;
            t.prefetch_used += s.prefetch_used;
            t.read_ahead += s.read_ahead;
            t.bytes_read += s.bytes_read;
        }
        t
    }
}

impl ExpertSource for StreamingExperts {
    fn begin(&mut self, layer: usize, experts: &[usize]) -> Result<()> {
        let began = self.begin_demand(layer, experts);
        if began.is_err() {
            self.reset_state();
        }
        began
    }

    fn drain(&mut self, f: &mut dyn FnMut(usize, &[u8]) -> Result<()>) -> Result<()> {
        let drained = self.drain_demand(f);
        if drained.is_err() {
            self.reset_state();
        }
        drained
    }

    fn prefetch(&mut self, layer: usize, experts: &[usize]) -> Result<()> {
        if self.opts.prefetch_buffers == 0 {
            return Ok(());
        }
        let mut absent = std::mem::take(&mut self.misses_buf);
        absent.clear();
        for &e in experts {
            if self.location(layer, e).is_err() {
                // A hint about an expert the store does not have: nothing to read.
                continue;
            }
            if !self.present(layer, e) {
                // Not fetched yet: the fetcher may fetch it in the background; nothing to read.
                absent.push(e);
                continue;
            }
            let key = (layer, e);
            let cached = self.caches.get(&layer).is_some_and(|c| c.contains(e));
            if !cached && !self.by_key.contains_key(&key) && !self.pending_prefetch.contains(&key) {
                self.pending_prefetch.push_back(key);
            }
        }
        if let Some(f) = self.fetcher.as_ref().filter(|_| !absent.is_empty()) {
            f.hint(layer, &absent);
        }
        self.misses_buf = absent;
        self.pump_prefetch()
    }

    fn bytes_read(&self) -> u64 {
        self.bytes_read
    }

    fn reset(&mut self) {
        self.reset_state();
    }

    fn faults(&self) -> FaultStats {
        self.faults
    }

    fn read_ahead(&mut self, layer: usize) {
        if self.demand.is_some() {
            return;
        }
        let Some(cache) = self.caches.get(&layer) else { return };
        let reading = self.flights.values().filter(|f| f.key.0 == layer && !f.demanded).count();
        let mut room = cache.capacity.saturating_sub(cache.len() + reading);
        let experts = self.locs.get(&layer).map_or(0, |v| v.len());
        for e in 0..experts {
            // The demand's own buffers stay free.
            if room == 0 || self.free.len() <= self.opts.io_buffers {
                break;
            }
            let key = (layer, e);
            let cached = self.caches.get(&layer).is_some_and(|c| c.contains(e));
            if cached || self.by_key.contains_key(&key) || self.landed.contains_key(&key) || !self.present(layer, e) {
                continue;
            }
            if let Err(err) = self.start_read(key, false) {
                tracing::warn!("read-ahead of layer {layer} expert {e} not started: {err:#}");
                break;
            }
            self.stats.entry(layer).or_default().read_ahead += 1;
            room -= 1;
        }
    }

    fn lend(&mut self, bytes: u64) -> u64 {
        if self.demand.is_some() || bytes == 0 {
            return 0;
        }
        let layers = self.locs.len().max(1);
        let slot = self.slot_bytes as u64;
        let left = self.opts.cache_slots_per_layer - self.lent_per_layer;
        let per_layer = (bytes.div_ceil(slot) as usize).div_ceil(layers).min(left);
        if per_layer == 0 {
            return 0;
        }
        // Prefetches in flight land first (their buffers can then be lent), and what waits for
        // a layer is given up with the rest of the cache.
        if let Err(e) = self.finish_prefetches() {
            tracing::warn!("prefetches before lending the cache: {e:#}");
        }
        self.pending_prefetch.clear();
        self.free.extend(self.landed.drain().map(|(_, b)| b));
        let capacity = left - per_layer;
        let mut evicted = Vec::new();
        for cache in self.caches.values_mut() {
            cache.resize(capacity, &mut evicted);
        }
        for b in evicted {
            self.prefetched_unused[b] = false;
            self.free.push(b);
        }
        self.lent_per_layer += per_layer;
        let mut lent = 0;
        while lent < per_layer * layers {
            let Some(b) = self.free.pop() else { break };
            if !self.bufs[b].release_pages() {
                // The system keeps the pages: lending it would count memory twice.
                self.free.push(b);
                break;
            }
            self.lent.push(b);
            lent += 1;
        }
        lent as u64 * slot
    }

    fn take_back(&mut self) {
        let capacity = self.opts.cache_slots_per_layer;
        let mut evicted = Vec::new();
        for cache in self.caches.values_mut() {
            cache.resize(capacity, &mut evicted);
        }
        self.free.append(&mut evicted);
        self.free.append(&mut self.lent);
        self.lent_per_layer = 0;
    }
}

impl StreamingExperts {
    /// Announce `layer`'s demand: hits are pinned, misses start reading at once (or queue for a
    /// buffer).
    fn begin_demand(&mut self, layer: usize, experts: &[usize]) -> Result<()> {
        if self.demand.is_some() {
            bail!("expert source: begin() called twice without drain()");
        }
        // Checked before anything is pinned or read, so a refusal leaves nothing behind.
        for (i, e) in experts.iter().enumerate() {
            if experts[..i].contains(e) {
                bail!("expert {e} of layer {layer} requested twice in one step");
            }
            self.location(layer, *e)?;
        }
        self.ensure_present(layer, experts)?;
        // Speculation for this layer or earlier ones is stale now: drop what was not submitted.
        self.pending_prefetch.retain(|&(l, _)| l > layer);
        let n = experts.len();
        let mut d = self.spare_demand.take().unwrap_or_default();
        d.layer = layer;
        d.experts.clear();
        d.experts.extend_from_slice(experts);
        d.ready.clear();
        d.ready.resize(n, None);
        d.cached.clear();
        d.cached.resize(n, false);
        d.delivered.clear();
        d.delivered.resize(n, false);
        d.queued.clear();
        let mut misses = std::mem::take(&mut self.misses_buf);
        misses.clear();
        for (i, &e) in experts.iter().enumerate() {
            self.location(layer, e)?;
            let st = self.stats.entry(layer).or_default();
            st.accesses += 1;
            let cache = self.caches.entry(layer).or_insert_with(|| LayerCache::new(0, self.opts.policy));
            if let Some(b) = self.landed.remove(&(layer, e)) {
                // A prefetch that landed outside the cache: used from its buffer, then cached
                // or freed like a fresh read.
                d.ready[i] = Some(b);
                st.hits += 1;
                st.prefetch_used += 1;
            } else if let Some(b) = cache.get(e) {
                cache.pin(e);
                d.ready[i] = Some(b);
                d.cached[i] = true;
                st.hits += 1;
                if std::mem::take(&mut self.prefetched_unused[b]) {
                    st.prefetch_used += 1;
                } else {
                    st.cache_hits += 1;
                }
            } else if let Some(&id) = self.by_key.get(&(layer, e)) {
                // A prefetch is already reading it: adopt that read.
                if let Some(f) = self.flights.get_mut(&id) {
                    f.demanded = true;
                }
                st.hits += 1;
                st.adopted += 1;
                st.prefetch_used += 1;
            } else {
                misses.push(e);
            }
        }
        self.demand = Some(d);
        // Landed prefetches of this layer that were not asked for, or of earlier layers, were
        // wrong guesses: their buffers go back.
        let free = &mut self.free;
        self.landed.retain(|k, b| {
            let keep = k.0 > layer;
            if !keep {
                free.push(*b);
            }
            keep
        });
        for &e in &misses {
            if self.free.is_empty() {
                if let Some(d) = self.demand.as_mut() {
                    d.queued.push_back(e);
                }
            } else {
                self.start_read((layer, e), true)?;
            }
        }
        self.misses_buf = misses;
        Ok(())
    }

    /// Hand every demanded record to `f` as it becomes available.
    fn drain_demand(&mut self, f: &mut dyn FnMut(usize, &[u8]) -> Result<()>) -> Result<()> {
        let Some(d) = self.demand.as_ref() else { bail!("expert source: drain() without begin()") };
        let layer = d.layer;
        let rb = self.record_bytes;
        // Records already in memory first, in order, while the reads are in flight.
        let mut queue = std::mem::take(&mut self.queue_buf);
        queue.clear();
        queue.extend(d.ready.iter().enumerate().filter_map(|(i, b)| b.map(|b| (i, b))));
        loop {
            for (i, b) in queue.drain(..) {
                let s = self.data_start[b];
                f(i, &self.bufs[b].as_slice()[s..s + rb])?;
                self.settle(i)?;
            }
            let all = self.demand.as_ref().is_some_and(|d| d.delivered.iter().all(|&x| x));
            if all {
                break;
            }
            // Buffers freed by prefetches that landed let waiting misses start.
            self.start_queued()?;
            if self.backend.in_flight() == 0 && self.verifying == 0 {
                // Waiting would return at once forever: a demand that nothing is reading.
                self.queue_buf = queue;
                bail!("expert source: layer {layer} waits for records that no read will deliver");
            }
            self.reap(&mut queue)?;
        }
        self.queue_buf = queue;
        self.spare_demand = self.demand.take();
        self.pump_prefetch()
    }
}
