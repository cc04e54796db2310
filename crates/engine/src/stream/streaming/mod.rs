//! Routed experts streamed from disk through a bounded set of aligned buffers: a per-layer cache
//! of recently used experts, demand reads issued all at once as soon as the router has chosen,
//! records handed to compute in the order they land (read and verified by the I/O thread,
//! `stream::io_thread`, while the engine computes), and low-priority prefetch reads for the
//! next layer's likely experts.
//!
//! One file per concern: `reads` (the read table: requests to the I/O thread, what comes back,
//! retries, the reset after a failed step), `demand` (a layer's experts, served as they land),
//! `speculation` (prefetch and a prompt's read-ahead), `lending` (a long prompt borrows the
//! cache's memory), `fetch` (a streaming store's absent records), `stats` (the counters).
//!
//! Faults: a read that fails, or whose bytes fail the record's checksum, is read once more from
//! disk; if that fails too the step ends with a [`ReadFault`] naming the layer and expert, and the
//! source returns itself to a clean state (every read in flight landed, every buffer back, no
//! half-served demand), so the next step is served normally. A failed prefetch costs nothing but
//! its buffer's time. A record that failed its checksum never enters the cache. An I/O thread
//! that is lost ends its step with an error and is started again for the next.
//!
//! [`ReadFault`]: crate::fault::ReadFault

mod demand;
mod fetch;
mod lending;
mod reads;
mod speculation;
mod stats;

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, anyhow};
use deltafin_store::Store;
use deltafin_store::manifest::ExpertLocation;
use deltafin_store::presence::{ExpertFetcher, Presence};

use super::aligned::AlignedBuf;
use super::backend::make_backend;
use super::cache::{LayerCache, Policy};
use super::geometry;
use super::io_thread::IoThread;
use super::reader::{BackendKind, ReadBackend, open_files};
use super::verify::RecordCheck;
use crate::experts::ExpertSource;
use crate::fault::{FaultStats, ReadFault};
use demand::Demand;
use reads::Flight;
pub use stats::LayerStats;

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

/// A decorator applied to every read back-end the source builds (I/O tracing, disk activity,
/// fault injection in tests): kept, so that a restarted I/O thread reads the same way.
type Wrap = Arc<dyn Fn(Box<dyn ReadBackend>) -> Box<dyn ReadBackend> + Send + Sync>;

/// How to start (and, after a loss, restart) the I/O thread.
struct IoSpec {
    files: Arc<Vec<File>>,
    backend: Option<BackendKind>,
    depth: usize,
    wrap: Wrap,
    check: RecordCheck,
    /// Records in flight at most: the source's buffer count.
    records: usize,
}

impl IoSpec {
    fn start(&self) -> Result<IoThread> {
        let backend = (self.wrap)(make_backend(self.files.clone(), self.backend, self.depth.max(1))?);
        Ok(IoThread::start(backend, self.check.clone(), self.records)?)
    }
}

pub struct StreamingExperts {
    // Declared first so it is dropped first: stopping it lets every read in flight land before
    // the buffers they write into are freed.
    io: Option<IoThread>,
    io_spec: IoSpec,
    /// The I/O thread was found gone; the next reset stops what is left of it and starts another.
    io_lost: bool,
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
    /// Records with the I/O thread, by request id.
    flights: HashMap<u64, Flight>,
    by_key: HashMap<(usize, usize), u64>,
    next_id: u64,
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
    demand: Option<Demand>,
    faults: FaultStats,
    /// The fault that ends the current step, once a record's retry failed too.
    failure: Option<ReadFault>,
    opts: StreamOptions,
    pub stats: HashMap<usize, LayerStats>,
    bytes_read: u64,
    /// Time the engine thread waited for records to land.
    pub io_wait: Duration,
    /// Time the I/O thread spent assembling and hashing records, and the bytes hashed: the cost
    /// of verification, reported per run (off the engine thread).
    pub verify_time: Duration,
    pub bytes_verified: u64,
    paths: Vec<PathBuf>,
    // Buffers reused from call to call so the per-layer path allocates nothing once warm.
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

    /// [`Self::new`], with every read back-end it builds passed through `wrap` (a decorator: I/O
    /// tracing, disk activity, or fault injection in tests).
    pub fn with_backend(
        store: &Store,
        opts: StreamOptions,
        wrap: impl Fn(Box<dyn ReadBackend>) -> Box<dyn ReadBackend> + Send + Sync + 'static,
    ) -> Result<Self> {
        let ex = &store.manifest.experts;
        let paths = store.experts.paths().to_vec();
        let (files, o_direct) = open_files(&paths, opts.direct)?;
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
        let io_spec = IoSpec {
            files: Arc::new(files),
            backend: opts.backend,
            depth: opts.queue_depth,
            wrap: Arc::new(wrap),
            check,
            records: n_bufs,
        };
        let io = io_spec.start()?;
        Ok(StreamingExperts {
            backend_kind: io.kind,
            io: Some(io),
            io_spec,
            io_lost: false,
            o_direct,
            record_bytes: ex.record_bytes as usize,
            slot_bytes,
            data_start: vec![0; bufs.len()],
            free: (0..bufs.len()).rev().collect(),
            bufs,
            locs,
            caches,
            flights: HashMap::with_capacity(n_bufs),
            by_key: HashMap::with_capacity(n_bufs),
            next_id: 0,
            pending_prefetch: VecDeque::new(),
            prefetch_in_flight: 0,
            prefetched_unused: vec![false; n_bufs],
            landed: HashMap::new(),
            lent: Vec::new(),
            lent_per_layer: 0,
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
            queue_buf: Vec::new(),
            misses_buf: Vec::new(),
            spare_demand: None,
            presence: store.experts.presence().cloned(),
            fetcher: None,
        })
    }

    fn location(&self, layer: usize, expert: usize) -> Result<&ExpertLocation> {
        self.locs
            .get(&layer)
            .and_then(|v| v.get(expert))
            .ok_or_else(|| anyhow!("no routed expert {expert} in layer {layer}"))
    }

    /// The cache of `layer` (an empty one for a layer the store does not list).
    fn cache(&mut self, layer: usize) -> &mut LayerCache<usize> {
        self.caches.entry(layer).or_insert_with(|| LayerCache::new(0, self.opts.policy))
    }

    /// Whether (layer, expert) is in the cache.
    pub fn is_cached(&self, layer: usize, expert: usize) -> bool {
        self.caches.get(&layer).is_some_and(|c| c.contains(expert))
    }

    pub fn policy(&self) -> Policy {
        self.opts.policy
    }

    /// Nothing in flight, no demand, and every buffer free, cached, waiting as a landed
    /// prefetch or lent: the state between steps. For tests and checks after a fault.
    pub fn check_idle(&self) -> Result<()> {
        anyhow::ensure!(self.demand.is_none(), "a demand is still open");
        anyhow::ensure!(
            self.flights.is_empty() && self.by_key.is_empty(),
            "{} reads are still tracked",
            self.flights.len()
        );
        let cached: usize = self.caches.values().map(|c| c.len()).sum();
        anyhow::ensure!(
            self.free.len() + cached + self.landed.len() + self.lent.len() == self.bufs.len(),
            "buffers unaccounted for: {} free + {cached} cached + {} landed prefetches + {} lent of {}",
            self.free.len(),
            self.landed.len(),
            self.lent.len(),
            self.bufs.len()
        );
        Ok(())
    }

    /// For tests: the I/O thread dies on the next record it finishes, leaving it unanswered (a
    /// thread lost to a panic or the OS).
    #[doc(hidden)]
    pub fn kill_io_thread_for_tests(&self) {
        if let Some(io) = &self.io {
            io.kill_for_tests();
        }
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
        self.hint_prefetch(layer, experts)
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
        self.read_ahead_into_cache(layer);
    }

    fn lend(&mut self, bytes: u64) -> u64 {
        self.lend_cache(bytes)
    }

    fn take_back(&mut self) {
        self.take_back_cache();
    }
}
