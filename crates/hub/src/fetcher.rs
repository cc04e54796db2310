//! On-demand fetching for a streaming store: when a run meets experts that are not on disk yet,
//! their byte ranges are fetched from the shards at the origin (offsets from the manifest,
//! which took them from the shard headers), all of a layer's misses in parallel; each record's
//! scales are checked, its bytes written in place and synced, and only then is it marked
//! present with its checksum. A kill -9 at any point leaves either an absent record (fetched
//! again next time) or a present one whose bytes are on disk.
//!
//! Optionally (`--fetch-ahead`), the engine's look-ahead predictions of the next layer's experts
//! arrive as hints, and a background thread fetches the absent ones while the current layer
//! runs, never starting while a demand fetches. A demand for a record the background is
//! fetching waits for it rather than fetching it twice; hints for layers the run has passed are
//! dropped. It is off by default: measured on the bench checkpoint, mispredicted records cost
//! more link time than the overlap saves (BENCHMARKS.md section 8).
//!
//! The Hub publishes a sha256 per file, not per expert, so a record fetched alone is tied to
//! the pinned file by the ETag check of every response (the origin's file must be the pinned
//! one) and by exact lengths and Content-Range; its checksum is computed here and guards every
//! later read of it. `install --upgrade-to-full` checks every shard's sha256 at the end.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use deltafin_store::Store;
use deltafin_store::manifest::{ExpertLocation, OriginFile, OriginInfo};
use deltafin_store::presence::{ExpertFetcher, FetchError, FetchStats, Presence};

use crate::download::write_synced;
use crate::http::{Expect, Http, HttpConfig};
use crate::remote::{OriginKind, Remote};

struct ShardFile {
    origin: OriginFile,
    url: String,
    path: PathBuf,
    file: File,
}

/// Records fetched in parallel for one demand.
const DEMAND_PARALLEL: usize = 16;
/// Records fetched in parallel ahead of demand (fewer: the demand keeps most of the link).
const AHEAD_PARALLEL: usize = 4;
/// Hints kept at most; older ones are dropped first.
const AHEAD_QUEUE: usize = 256;

/// What the background fetcher is asked and doing.
#[derive(Default)]
struct Ahead {
    queue: VecDeque<(usize, usize)>,
    /// Records being fetched now, by either path.
    in_flight: HashSet<(usize, usize)>,
    /// The background has taken a batch off the queue and not finished it.
    batch_running: bool,
    stop: bool,
}

/// How often the log says what demand fetches did.
const LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Demand fetches gathered for the next summary line.
struct FetchLog {
    since: Instant,
    fetches: u64,
    experts: u64,
    bytes: u64,
    seconds: f64,
}

impl FetchLog {
    fn new() -> Self {
        FetchLog { since: Instant::now(), fetches: 0, experts: 0, bytes: 0, seconds: 0.0 }
    }

    fn add(&mut self, experts: u64, bytes: u64, seconds: f64) {
        self.fetches += 1;
        self.experts += experts;
        self.bytes += bytes;
        self.seconds += seconds;
    }

    /// The summary of what was gathered, once [`LOG_EVERY`] has passed since the last one.
    fn take_line(&mut self, present: usize, all: usize) -> Option<String> {
        let span = self.since.elapsed();
        if span < LOG_EVERY {
            return None;
        }
        let line = format!(
            "fetched {} expert(s) in {} demand(s) over the last {:.0} s: {:.1} MB, {:.1} s waiting on the origin ({:.1} MB/s); {present} of {all} experts on disk",
            self.experts,
            self.fetches,
            span.as_secs_f64(),
            self.bytes as f64 / 1e6,
            self.seconds,
            if self.seconds > 0.0 { self.bytes as f64 / 1e6 / self.seconds } else { 0.0 },
        );
        *self = FetchLog::new();
        Some(line)
    }
}

struct Shared {
    http: Http,
    files: Vec<ShardFile>,
    locs: HashMap<usize, Vec<ExpertLocation>>,
    /// (offset, len) of the scale parts inside a record.
    scale_parts: Vec<(usize, usize)>,
    record_bytes: usize,
    presence: Arc<Presence>,
    experts: AtomicU64,
    ahead_experts: AtomicU64,
    written: AtomicU64,
    failures: AtomicU64,
    micros: AtomicU64,
    /// Demand fetches since the last summary line in the log.
    log: Mutex<FetchLog>,
    /// One demand at a time: two engine threads never race on one layer.
    busy: Mutex<()>,
    /// Demands running now: the background waits for them (demand first on the link).
    demanding: AtomicU64,
    /// Whether hints are fetched at all.
    fetch_ahead: std::sync::atomic::AtomicBool,
    ahead: Mutex<Ahead>,
    /// Signalled when a hint arrives, a record lands, or the fetcher stops.
    changed: Condvar,
}

pub struct HubFetcher {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for HubFetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubFetcher").field("files", &self.shared.files.len()).finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl HubFetcher {
    /// A fetcher for a streaming store, from the origin it was installed from (`endpoint`
    /// overrides where that origin is reached).
    pub fn open(store: &Store, endpoint: Option<&str>, http: HttpConfig) -> Result<Self> {
        let m = &store.manifest;
        let info: &OriginInfo = m.origin.as_ref().context("this store was not installed from an origin")?;
        let presence = store.experts.presence().cloned().context("this store is not a streaming store")?;
        let remote = Remote::new(OriginKind::parse(&info.kind)?, endpoint.unwrap_or(&info.endpoint), &info.repo)?;
        let mut files = Vec::new();
        for (name, path) in m.experts.files.iter().zip(store.experts.paths()) {
            let f = info
                .files
                .iter()
                .find(|f| &f.name == name)
                .with_context(|| format!("the origin record lacks {name}"))?;
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)
                .with_context(|| format!("opening {}", path.display()))?;
            files.push(ShardFile {
                origin: f.clone(),
                url: remote.file_url(&info.commit, name),
                path: path.clone(),
                file,
            });
        }
        let scale_parts = m
            .experts
            .parts
            .iter()
            .filter(|p| p.name.ends_with("weight_scale"))
            .map(|p| (p.offset as usize, p.len as usize))
            .collect();
        let shared = Arc::new(Shared {
            http: Http::new(&remote.endpoint, http)?,
            files,
            locs: m.experts.layers.iter().map(|l| (l.layer, l.experts.clone())).collect(),
            scale_parts,
            record_bytes: m.experts.record_bytes as usize,
            presence,
            experts: AtomicU64::new(0),
            ahead_experts: AtomicU64::new(0),
            written: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            micros: AtomicU64::new(0),
            log: Mutex::new(FetchLog::new()),
            busy: Mutex::new(()),
            demanding: AtomicU64::new(0),
            fetch_ahead: std::sync::atomic::AtomicBool::new(false),
            ahead: Mutex::new(Ahead::default()),
            changed: Condvar::new(),
        });
        let bg = Arc::clone(&shared);
        let worker = std::thread::Builder::new()
            .name("deltafin-fetch-ahead".into())
            .spawn(move || bg.fetch_ahead_loop())
            .context("starting the fetch-ahead thread")?;
        Ok(HubFetcher { shared, worker: Some(worker) })
    }

    /// Whether the router's look-ahead hints are fetched in the background (default no: on the
    /// bench checkpoint the mispredictions cost more link time than the overlap saves;
    /// BENCHMARKS.md section 8).
    pub fn with_fetch_ahead(self, on: bool) -> Self {
        self.shared.fetch_ahead.store(on, Ordering::Relaxed);
        self
    }

    /// Fetch these experts of `layer` now, in parallel (records already present are skipped;
    /// records the background is fetching are waited for).
    pub fn fetch_layer(&self, layer: usize, experts: &[usize]) -> Result<()> {
        self.shared.fetch_layer(layer, experts)
    }
}

impl Drop for HubFetcher {
    fn drop(&mut self) {
        lock(&self.shared.ahead).stop = true;
        self.shared.changed.notify_all();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

impl Shared {
    /// Fetch one record unless it is present; if the other path is fetching it, wait for that.
    fn fetch_one(&self, layer: usize, expert: usize, ahead: bool) -> Result<()> {
        {
            let mut a = lock(&self.ahead);
            while a.in_flight.contains(&(layer, expert)) {
                a = self.changed.wait(a).unwrap_or_else(|p| p.into_inner());
            }
            if self.presence.refresh(layer, expert)?.is_some() {
                return Ok(());
            }
            a.in_flight.insert((layer, expert));
        }
        let r = self.fetch_record(layer, expert, ahead);
        lock(&self.ahead).in_flight.remove(&(layer, expert));
        self.changed.notify_all();
        r
    }

    /// Fetch, check, write, sync and mark one record.
    fn fetch_record(&self, layer: usize, expert: usize, ahead: bool) -> Result<()> {
        let loc = self
            .locs
            .get(&layer)
            .and_then(|v| v.get(expert))
            .with_context(|| format!("no expert {expert} in layer {layer}"))?;
        let mut record = Vec::with_capacity(self.record_bytes);
        for r in &loc.ranges {
            let f = self.files.get(r[0] as usize).context("a range names no file")?;
            record.extend(self.http.get_range(&f.url, r[1], r[1] + r[2], &Expect::of(&f.origin))?);
        }
        if record.len() != self.record_bytes {
            bail!(
                "layer {layer} expert {expert}: fetched {} bytes of a {}-byte record",
                record.len(),
                self.record_bytes
            );
        }
        for &(o, l) in &self.scale_parts {
            if let Some(i) = record.get(o..o + l).and_then(deltafin_store::quant::nan_scale) {
                bail!("layer {layer} expert {expert}: the fetched E8M0 scale byte {i} is 0xFF (NaN); not stored");
            }
        }
        let mut pos = 0usize;
        for r in &loc.ranges {
            let f = &self.files[r[0] as usize];
            write_synced(&f.file, &f.path, &record[pos..pos + r[2] as usize], r[1])?;
            pos += r[2] as usize;
        }
        self.written.fetch_add(record.len() as u64, Ordering::Relaxed);
        self.presence.mark(layer, expert, deltafin_store::checksum::xxh3_64(&record))?;
        self.experts.fetch_add(1, Ordering::Relaxed);
        if ahead {
            self.ahead_experts.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Fetch `experts` with `parallel` workers taking the next record as each finishes (no
    /// barrier between batches: the link stays busy until the last record); the first error,
    /// if any.
    fn fetch_all(&self, layer: usize, experts: &[usize], parallel: usize, ahead: bool) -> Option<anyhow::Error> {
        let next = AtomicU64::new(0);
        let first_err: Mutex<Option<anyhow::Error>> = Mutex::new(None);
        std::thread::scope(|s| {
            for _ in 0..parallel.clamp(1, experts.len().max(1)) {
                s.spawn(|| {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                        let Some(&e) = experts.get(i) else { break };
                        if let Err(err) = self.fetch_one(layer, e, ahead) {
                            lock(&first_err).get_or_insert(err);
                        }
                    }
                });
            }
        });
        first_err.into_inner().unwrap_or_else(|p| p.into_inner())
    }

    fn fetch_layer(&self, layer: usize, experts: &[usize]) -> Result<()> {
        let _one = lock(&self.busy);
        // Hints for this layer and the ones before it are stale now (this layer is demanded).
        lock(&self.ahead).queue.retain(|&(l, _)| l > layer);
        let t0 = Instant::now();
        let before = self.http.counters.bytes.load(Ordering::Relaxed);
        self.demanding.fetch_add(1, Ordering::AcqRel);
        let err = self.fetch_all(layer, experts, DEMAND_PARALLEL, false);
        // Under the lock, so the background cannot miss the wake-up between its check and its
        // wait.
        {
            let _a = lock(&self.ahead);
            self.demanding.fetch_sub(1, Ordering::AcqRel);
        }
        self.changed.notify_all();
        let dt = t0.elapsed();
        self.micros.fetch_add(dt.as_micros() as u64, Ordering::Relaxed);
        let got = self.http.counters.bytes.load(Ordering::Relaxed).saturating_sub(before);
        if let Some(e) = err {
            self.failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("fetching {} expert(s) of layer {layer} failed: {e:#}", experts.len());
            return Err(e);
        }
        let (present, all) = self.presence.count();
        tracing::debug!(
            "fetched {} expert(s) of layer {layer}: {:.1} MB in {:.0} ms; {present} of {all} experts on disk",
            experts.len(),
            got as f64 / 1e6,
            dt.as_secs_f64() * 1e3
        );
        // One line per LOG_EVERY for a person to read, not one per layer per token (92 a token
        // on Kimi K3).
        let mut log = lock(&self.log);
        log.add(experts.len() as u64, got, dt.as_secs_f64());
        if let Some(line) = log.take_line(present, all) {
            tracing::info!("{line}");
        }
        Ok(())
    }

    fn hint(&self, layer: usize, experts: &[usize]) {
        if !self.fetch_ahead.load(Ordering::Relaxed) {
            return;
        }
        let mut a = lock(&self.ahead);
        for &e in experts {
            let key = (layer, e);
            if !a.queue.contains(&key) && !a.in_flight.contains(&key) && self.presence.get(layer, e).is_none() {
                a.queue.push_back(key);
            }
        }
        while a.queue.len() > AHEAD_QUEUE {
            a.queue.pop_front();
        }
        drop(a);
        self.changed.notify_all();
    }

    /// The background thread: fetch hinted records, a few at a time, until stopped. A failure
    /// costs nothing but the hint (a demand fetches the record again if it is needed).
    fn fetch_ahead_loop(&self) {
        loop {
            let (layer, batch) = {
                let mut a = lock(&self.ahead);
                // Nothing to do, or a demand is fetching: the demand has the link.
                while (a.queue.is_empty() || self.demanding.load(Ordering::Acquire) > 0) && !a.stop {
                    a = self.changed.wait(a).unwrap_or_else(|p| p.into_inner());
                }
                if a.stop {
                    return;
                }
                let layer = a.queue.front().map(|k| k.0).unwrap_or(0);
                let mut batch = Vec::new();
                while batch.len() < AHEAD_PARALLEL {
                    match a.queue.front() {
                        Some(&(l, e)) if l == layer => {
                            a.queue.pop_front();
                            batch.push(e);
                        }
                        _ => break,
                    }
                }
                a.batch_running = true;
                (layer, batch)
            };
            if let Some(e) = self.fetch_all(layer, &batch, AHEAD_PARALLEL, true) {
                tracing::debug!("fetching ahead in layer {layer} failed: {e:#}");
            }
            lock(&self.ahead).batch_running = false;
            self.changed.notify_all();
        }
    }
}

impl ExpertFetcher for HubFetcher {
    fn fetch(&self, layer: usize, experts: &[usize]) -> Result<(), FetchError> {
        self.shared.fetch_layer(layer, experts).map_err(|e| format!("{e:#}").into())
    }

    fn hint(&self, layer: usize, experts: &[usize]) {
        self.shared.hint(layer, experts);
    }

    fn settle(&self) {
        let mut a = lock(&self.shared.ahead);
        a.queue.clear();
        while !a.in_flight.is_empty() || a.batch_running {
            a = self.shared.changed.wait(a).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn stats(&self) -> FetchStats {
        let s = &self.shared;
        FetchStats {
            experts: s.experts.load(Ordering::Relaxed),
            experts_ahead: s.ahead_experts.load(Ordering::Relaxed),
            bytes_downloaded: s.http.counters.bytes.load(Ordering::Relaxed),
            bytes_written: s.written.load(Ordering::Relaxed),
            failures: s.failures.load(Ordering::Relaxed),
            seconds: s.micros.load(Ordering::Relaxed) as f64 / 1e6,
        }
    }
}
