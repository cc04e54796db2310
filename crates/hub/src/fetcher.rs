//! On-demand fetching for a streaming store: when a run meets experts that are not on disk yet,
//! their byte ranges are fetched from the shards at the origin (offsets from the manifest,
//! which took them from the shard headers), all of a layer's misses in parallel; each record's
//! scales are checked, its bytes written in place and synced, and only then is it marked
//! present with its checksum. A kill -9 at any point leaves either an absent record (fetched
//! again next time) or a present one whose bytes are on disk.
//!
//! The Hub publishes a sha256 per file, not per expert, so a record fetched alone is tied to
//! the pinned file by the ETag check of every response (the origin's file must be the pinned
//! one) and by exact lengths and Content-Range; its checksum is computed here and guards every
//! later read of it. `install --upgrade-to-full` checks every shard's sha256 at the end.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use deltafin_store::Store;
use deltafin_store::manifest::{ExpertLocation, OriginInfo};
use deltafin_store::presence::{ExpertFetcher, FetchError, FetchStats, Presence};
use std::sync::Arc;

use crate::download::write_synced;
use crate::http::{Expect, Http, HttpConfig};
use crate::remote::{OriginKind, Remote};

struct ShardFile {
    name: String,
    url: String,
    size: u64,
    sha256: Option<String>,
    path: PathBuf,
    file: File,
}

pub struct HubFetcher {
    http: Http,
    files: Vec<ShardFile>,
    locs: HashMap<usize, Vec<ExpertLocation>>,
    /// (offset, len) of the scale parts inside a record.
    scale_parts: Vec<(usize, usize)>,
    record_bytes: usize,
    presence: Arc<Presence>,
    /// Records fetched in parallel at most.
    parallel: usize,
    experts: AtomicU64,
    written: AtomicU64,
    failures: AtomicU64,
    micros: AtomicU64,
    /// One layer's fetch at a time: two engine threads never race on one record.
    busy: Mutex<()>,
}

impl std::fmt::Debug for HubFetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubFetcher").field("files", &self.files.len()).finish()
    }
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
                name: name.clone(),
                url: remote.file_url(&info.commit, name),
                size: f.size,
                sha256: f.sha256.clone(),
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
        Ok(HubFetcher {
            http: Http::new(&remote.endpoint, http)?,
            files,
            locs: m.experts.layers.iter().map(|l| (l.layer, l.experts.clone())).collect(),
            scale_parts,
            record_bytes: m.experts.record_bytes as usize,
            presence,
            parallel: 16,
            experts: AtomicU64::new(0),
            written: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            micros: AtomicU64::new(0),
            busy: Mutex::new(()),
        })
    }

    /// Fetch, check, write, sync and mark one record.
    fn fetch_one(&self, layer: usize, expert: usize) -> Result<()> {
        if self.presence.refresh(layer, expert)?.is_some() {
            return Ok(());
        }
        let loc = self
            .locs
            .get(&layer)
            .and_then(|v| v.get(expert))
            .with_context(|| format!("no expert {expert} in layer {layer}"))?;
        let mut record = Vec::with_capacity(self.record_bytes);
        for r in &loc.ranges {
            let f = self.files.get(r[0] as usize).context("a range names no file")?;
            let expect = Expect { name: &f.name, size: f.size, sha256: f.sha256.as_deref() };
            record.extend(self.http.get_range(&f.url, r[1], r[1] + r[2], &expect)?);
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
            let bytes = &record[pos..pos + r[2] as usize];
            write_synced(&f.file, &f.path, bytes, r[1])?;
            pos += r[2] as usize;
        }
        self.written.fetch_add(record.len() as u64, Ordering::Relaxed);
        self.presence.mark(layer, expert, xxhash_rust::xxh3::xxh3_64(&record))?;
        self.experts.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Fetch these experts of `layer`, in parallel.
    pub fn fetch_layer(&self, layer: usize, experts: &[usize]) -> Result<()> {
        let _one = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        let t0 = Instant::now();
        let before = self.http.counters.bytes.load(Ordering::Relaxed);
        let mut first_err = None;
        for chunk in experts.chunks(self.parallel.max(1)) {
            std::thread::scope(|s| {
                let hs: Vec<_> = chunk.iter().map(|&e| s.spawn(move || self.fetch_one(layer, e))).collect();
                for h in hs {
                    let r = h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a fetch thread panicked")));
                    if let Err(e) = r {
                        first_err.get_or_insert(e);
                    }
                }
            });
        }
        let dt = t0.elapsed();
        self.micros.fetch_add(dt.as_micros() as u64, Ordering::Relaxed);
        let got = self.http.counters.bytes.load(Ordering::Relaxed) - before;
        if let Some(e) = first_err {
            self.failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("fetching {} expert(s) of layer {layer} failed: {e:#}", experts.len());
            return Err(e);
        }
        let (present, all) = self.presence.count();
        tracing::info!(
            "fetched {} expert(s) of layer {layer}: {:.1} MB in {:.0} ms; {present} of {all} experts on disk",
            experts.len(),
            got as f64 / 1e6,
            dt.as_secs_f64() * 1e3
        );
        Ok(())
    }
}

impl ExpertFetcher for HubFetcher {
    fn fetch(&self, layer: usize, experts: &[usize]) -> Result<(), FetchError> {
        self.fetch_layer(layer, experts).map_err(|e| format!("{e:#}").into())
    }

    fn stats(&self) -> FetchStats {
        FetchStats {
            experts: self.experts.load(Ordering::Relaxed),
            bytes_downloaded: self.http.counters.bytes.load(Ordering::Relaxed),
            bytes_written: self.written.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
            seconds: self.micros.load(Ordering::Relaxed) as f64 / 1e6,
        }
    }
}
