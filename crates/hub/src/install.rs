//! `deltafin install`: a store from a checkpoint on an origin.
//!
//! - Stream mode fetches the small files whole, and of each shard only its safetensors header
//!   and its spine tensors (Range requests into a sparse file of the shard's full size), then
//!   converts the spine. Routed experts are fetched on first use (`fetcher`).
//! - Full mode is the stream install followed by [`upgrade`]: every range still absent is
//!   fetched, each shard is verified against the origin's sha256 and becomes a Hub cache blob,
//!   and the manifest gains every expert's checksum. The disk holds the checkpoint plus the
//!   spine, never two copies of the model. When a local Hub cache already holds the snapshot,
//!   it is used in place and nothing is downloaded.
//!
//! Everything is resumable: the pinned origin is saved before the first byte, every piece is in
//! a fill log once it is on disk, verified shards are renamed into place, and the manifest is
//! written last, by rename.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use anyhow::{Context, Result, bail};
use deltafin_store::checkpoint::text_prefix;
use deltafin_store::checksum::Xxh3;
use deltafin_store::convert::{ConvertOptions, ExpertSums, convert};
use deltafin_store::manifest::{
    Manifest, OriginFile, OriginInfo, SpineAuto, SpineDtype, SpinePrecision, StreamingInfo,
};
use deltafin_store::schema::{Role, checkpoint_name, spine_specs};
use deltafin_store::shard::{TensorEntry, parse_header};
use deltafin_store::{K3Config, Store};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::download::{Target, run, write_synced};
use crate::http::{Expect, Http, HttpConfig};
use crate::layout::{Layout, find_cached_snapshot, hub_caches};
use crate::ranges::{Range, coalesce, missing, missing_in, normalize, pieces, total};
use crate::remote::{INDEX_FILE, OriginKind, Remote, resolve, shard_names};
use deltafin_store::progress::{Progress, human};

pub const PRESENCE_FILE: &str = "presence.bin";
/// In the state directory: the spine was converted from bytes a later verification rejected.
const SPINE_STALE: &str = "spine-stale.json";
/// Shard headers are refused beyond this (the store's own limit).
const MAX_HEADER: u64 = 100_000_000;
/// Gaps between spine tensors of one shard up to this size (one disk block) are fetched
/// rather than split.
const COALESCE_GAP: u64 = 4 << 10;
/// Files that are not shards but larger than this are left out of a stream install.
const SMALL_FILE: u64 = 64 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Full,
    Stream,
}

#[derive(Debug, Clone)]
pub struct InstallOptions {
    pub repo: String,
    pub revision: String,
    pub to: PathBuf,
    pub mode: Mode,
    /// The spine's precision, or how `convert` chooses it.
    pub spine: SpinePrecision,
    pub kind: OriginKind,
    pub endpoint: String,
    pub http: HttpConfig,
    /// Parallel ranged requests.
    pub workers: usize,
    /// Largest ranged request.
    pub piece_bytes: u64,
    /// No progress output (library tests).
    pub quiet: bool,
    /// Look for the snapshot in the local Hub caches first (full mode).
    pub use_hub_cache: bool,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct InstallReport {
    pub commit: String,
    /// Body bytes received from the origin by this run (failed attempts included).
    pub downloaded: u64,
    /// Bytes this run wrote into fetched files (SSD endurance).
    pub written: u64,
    pub requests: u64,
    pub retries: u64,
    /// The local Hub snapshot used in place, if any.
    pub in_place: Option<PathBuf>,
}

/// Endpoint, token and test knobs from the environment, as huggingface_hub reads them.
pub fn env_endpoint() -> String {
    std::env::var("HF_ENDPOINT")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| crate::remote::DEFAULT_ENDPOINT.into())
}

/// `HF_TOKEN`, else the Hub's token file (`HF_TOKEN_PATH`, `HF_HOME/token`,
/// `~/.cache/huggingface/token`).
pub fn env_token() -> Option<String> {
    if let Ok(t) = std::env::var("HF_TOKEN")
        && !t.trim().is_empty()
    {
        return Some(t.trim().to_string());
    }
    let mut files = Vec::new();
    if let Some(p) = std::env::var_os("HF_TOKEN_PATH") {
        files.push(PathBuf::from(p));
    }
    if let Some(p) = std::env::var_os("HF_HOME") {
        files.push(PathBuf::from(p).join("token"));
    }
    if let Some(h) = std::env::var_os("HOME") {
        files.push(PathBuf::from(h).join(".cache/huggingface/token"));
    }
    files.iter().find_map(|f| std::fs::read_to_string(f).ok()).map(|t| t.trim().to_string()).filter(|t| !t.is_empty())
}

/// The HTTP settings: the token from the environment; `DELTAFIN_HTTP_ATTEMPTS` and
/// `DELTAFIN_HTTP_BACKOFF_MS` tune retries (tests shorten them).
pub fn env_http() -> HttpConfig {
    let mut c = HttpConfig { token: env_token(), ..HttpConfig::default() };
    if let Some(n) = std::env::var("DELTAFIN_HTTP_ATTEMPTS").ok().and_then(|v| v.parse().ok()) {
        c.attempts = n;
    }
    if let Some(ms) = std::env::var("DELTAFIN_HTTP_BACKOFF_MS").ok().and_then(|v| v.parse().ok()) {
        c.backoff = std::time::Duration::from_millis(ms);
        c.max_backoff = c.backoff.saturating_mul(16);
    }
    c
}

/// What a shard is to this install: its size and header, and the ranges stream mode needs.
struct ShardPlan {
    file: OriginFile,
    /// The 8-byte length and the JSON header, as fetched.
    header: Vec<u8>,
    /// Header and spine tensors, coalesced.
    needed: Vec<Range>,
}

/// The pinned origin of an install, saved before the first byte is fetched.
#[derive(Serialize, Deserialize)]
struct Pinned {
    origin: OriginInfo,
}

fn save_json(path: &Path, v: &impl Serialize) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let bytes = serde_json::to_vec_pretty(v)?;
    {
        let f = std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        write_synced(&f, &tmp, &bytes, 0)?;
    }
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {}", tmp.display()))?;
    Ok(())
}

/// Pin the origin: a rerun into the same store resumes the commit it pinned first (a branch
/// that moved meanwhile does not mix two revisions into one store).
fn pin(http: &Http, remote: &Remote, opts: &InstallOptions, layout: &Layout) -> Result<OriginInfo> {
    let path = layout.origin_file();
    if let Ok(text) = std::fs::read(&path) {
        let p: Pinned = serde_json::from_slice(&text).with_context(|| format!("{} is damaged", path.display()))?;
        if p.origin.repo != opts.repo || p.origin.revision != opts.revision {
            bail!(
                "{} holds an install of {}@{}; install {}@{} into another directory",
                opts.to.display(),
                p.origin.repo,
                p.origin.revision,
                opts.repo,
                opts.revision
            );
        }
        if !opts.quiet {
            eprintln!("resuming the install of {}@{} at commit {}", p.origin.repo, p.origin.revision, p.origin.commit);
        }
        return Ok(p.origin);
    }
    resolve(http, remote, &opts.revision)
}

/// Install a store (see the module documentation).
pub fn install(opts: &InstallOptions) -> Result<InstallReport> {
    let remote = Remote::new(opts.kind, &opts.endpoint, &opts.repo)?;
    let http = Http::new(&remote.endpoint, opts.http.clone())?;
    let layout = Layout::new(&opts.to, &opts.repo);
    let info = pin(&http, &remote, opts, &layout)?;
    let say = |s: String| {
        if !opts.quiet {
            eprintln!("{s}");
        }
    };
    say(format!("{} at commit {} (revision {}) from {}", opts.repo, info.commit, opts.revision, remote.endpoint));

    if opts.mode == Mode::Full
        && opts.use_hub_cache
        && let Some(snap) = find_cached_snapshot(&info, &hub_caches())
    {
        say(format!(
            "the snapshot is already in a local Hub cache: {}; using it in place, downloading nothing",
            snap.display()
        ));
        std::fs::create_dir_all(&opts.to).with_context(|| format!("creating {}", opts.to.display()))?;
        let co = ConvertOptions {
            spine: opts.spine,
            progress: !opts.quiet,
            origin: Some(info.clone()),
            ..Default::default()
        };
        convert(&snap, &opts.to, &co)?;
        return Ok(InstallReport { commit: info.commit, in_place: Some(snap), ..Default::default() });
    }

    let mut report = stream_install(&http, &remote, &info, &layout, opts)?;
    if opts.mode == Mode::Full {
        let up = upgrade_with(&http, &remote, &layout, opts.workers, opts.piece_bytes, opts.quiet)?;
        report.written += up.written;
    }
    report.downloaded = http.counters.bytes.load(Ordering::Relaxed);
    report.requests = http.counters.requests.load(Ordering::Relaxed);
    report.retries = http.counters.retries.load(Ordering::Relaxed);
    Ok(report)
}

/// A small file whole, into memory: from the store when an earlier run finished it, else from
/// the origin.
fn fetch_whole(http: &Http, remote: &Remote, info: &OriginInfo, layout: &Layout, name: &str) -> Result<Vec<u8>> {
    let f = info.files.iter().find(|f| f.name == name).with_context(|| format!("the snapshot has no {name}"))?;
    if layout.is_finished(f)
        && let Ok(b) = std::fs::read(layout.blob(f))
        && b.len() as u64 == f.size
    {
        return Ok(b);
    }
    // Written whole by a run that was killed before it verified the file: the fill log says so.
    let log = layout.fill_log(name);
    if log.exists()
        && crate::fill::FillLog::open(&log)?.covers((0, f.size))
        && let Ok(b) = std::fs::read(layout.partial(f))
        && b.len() as u64 == f.size
    {
        return Ok(b);
    }
    if f.size > SMALL_FILE {
        bail!("{name} is {} bytes, too large to be read whole", f.size);
    }
    if f.size == 0 {
        return Ok(Vec::new());
    }
    let expect = Expect::of(f);
    http.get_range(&remote.file_url(&info.commit, name), 0, f.size, &expect)
}

/// A shard's header from the store, when an earlier run wrote it (finished, or logged in its
/// partial file).
fn local_header(layout: &Layout, f: &OriginFile) -> Option<Vec<u8>> {
    let (path, log) = if layout.is_finished(f) {
        (layout.blob(f), None)
    } else {
        let p = layout.fill_log(&f.name);
        if !p.exists() {
            return None;
        }
        (layout.partial(f), Some(crate::fill::FillLog::open(&p).ok()?))
    };
    if log.as_ref().is_some_and(|l| !l.covers((0, 8))) {
        return None;
    }
    let file = std::fs::File::open(path).ok()?;
    let mut len = [0u8; 8];
    deltafin_store::os::FileAt::read_exact_at(&file, &mut len, 0).ok()?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER || 8 + n > f.size || log.as_ref().is_some_and(|l| !l.covers((0, 8 + n))) {
        return None;
    }
    let mut h = vec![0u8; 8 + n as usize];
    deltafin_store::os::FileAt::read_exact_at(&file, &mut h, 0).ok()?;
    Some(h)
}

/// The shard headers (length word and JSON), from the store when an earlier run wrote them,
/// else fetched by Range requests in parallel.
fn fetch_headers(
    http: &Http,
    remote: &Remote,
    info: &OriginInfo,
    layout: &Layout,
    shards: &[OriginFile],
    workers: usize,
) -> Result<Vec<Vec<u8>>> {
    let one = |f: &OriginFile| -> Result<Vec<u8>> {
        if let Some(h) = local_header(layout, f) {
            return Ok(h);
        }
        let url = remote.file_url(&info.commit, &f.name);
        let expect = Expect::of(f);
        if f.size < 8 {
            bail!("{} is {} bytes: too short for a safetensors file", f.name, f.size);
        }
        let len = http.get_range(&url, 0, 8, &expect)?;
        let n = u64::from_le_bytes(len[..8].try_into().unwrap_or([0; 8]));
        if n > MAX_HEADER || 8 + n > f.size {
            bail!("{}: header length {n} is not possible in a {}-byte file", f.name, f.size);
        }
        let mut h = len;
        h.extend(http.get_range(&url, 8, 8 + n, &expect)?);
        Ok(h)
    };
    let mut out: Vec<Option<Result<Vec<u8>>>> = (0..shards.len()).map(|_| None).collect();
    for (chunk_files, chunk_out) in shards.chunks(workers.max(1)).zip(out.chunks_mut(workers.max(1))) {
        std::thread::scope(|s| {
            let handles: Vec<_> = chunk_files.iter().map(|f| s.spawn(|| one(f))).collect();
            for (h, o) in handles.into_iter().zip(chunk_out.iter_mut()) {
                *o = Some(h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a header fetch panicked"))));
            }
        });
    }
    out.into_iter().map(|o| o.unwrap_or_else(|| Err(anyhow::anyhow!("a header was not fetched")))).collect()
}

/// Which spine tensors sit where, from the config, the index and the headers.
fn spine_ranges(
    config: &K3Config,
    weight_map: &HashMap<String, String>,
    shards: &mut [ShardPlan],
) -> Result<SpineEstimate> {
    let prefix = text_prefix(weight_map.keys().map(String::as_str));
    let mut entries: HashMap<String, HashMap<String, TensorEntry>> = HashMap::new();
    for s in shards.iter() {
        let parsed = parse_header(Path::new(&s.file.name), &s.header[8..], s.file.size)
            .with_context(|| format!("the header of {}", s.file.name))?;
        entries.insert(s.file.name.clone(), parsed.into_iter().map(|t| (t.name.clone(), t)).collect());
    }
    let mut wanted: HashMap<String, Vec<Range>> = HashMap::new();
    let mut est = SpineEstimate::default();
    for spec in spine_specs(config) {
        let full = checkpoint_name(prefix, &spec.name);
        // A tensor the index does not have is left to the conversion, which names it.
        let Some(file) = weight_map.get(&full) else { continue };
        let Some(t) = entries.get(file).and_then(|m| m.get(&full)) else { continue };
        wanted.entry(file.clone()).or_default().push((t.offset, t.offset + t.len));
        let numel = t.numel() as u64;
        match spec.role {
            Role::Matrix => {
                est.matrix_elems += numel;
                est.matrix_rows += t.shape.first().copied().unwrap_or(1) as u64;
            }
            _ => est.vector_elems += numel,
        }
    }
    for s in shards.iter_mut() {
        let mut r = wanted.remove(&s.file.name).unwrap_or_default();
        r.push((0, s.header.len() as u64));
        s.needed = coalesce(r, COALESCE_GAP);
    }
    Ok(est)
}

/// The converted spine's size, estimated from the headers before its exact layout (for the
/// disk plan, and for `--spine auto`'s choice when deciding whether a store needs converting).
#[derive(Debug, Default)]
struct SpineEstimate {
    matrix_elems: u64,
    matrix_rows: u64,
    vector_elems: u64,
}

impl SpineEstimate {
    /// Bytes with matrices as `d` (int8 with per-row f32 scales); vectors are f32.
    fn bytes(&self, d: SpineDtype) -> u64 {
        let scales = if d == SpineDtype::Int8 { self.matrix_rows * 4 } else { 0 };
        self.matrix_elems * d.element_bytes() as u64 + scales + self.vector_elems * 4
    }

    /// The matrices' dtype the conversion will pick.
    fn dtype(&self, spine: SpinePrecision) -> SpineDtype {
        match spine {
            SpinePrecision::Fixed(d) => d,
            SpinePrecision::Auto { budget } => SpineAuto { budget, bf16_bytes: self.bytes(SpineDtype::Bf16) }.choose(),
        }
    }
}

/// Free bytes on the file system holding `dir` (or its nearest existing ancestor).
fn free_space(dir: &Path) -> Option<u64> {
    let abs = std::path::absolute(dir).ok()?;
    let mut d = abs.as_path();
    loop {
        if d.exists() {
            return fs4::available_space(d).ok();
        }
        d = d.parent()?;
    }
}

fn stream_install(
    http: &Http,
    remote: &Remote,
    info: &OriginInfo,
    layout: &Layout,
    opts: &InstallOptions,
) -> Result<InstallReport> {
    let say = |s: String| {
        if !opts.quiet {
            eprintln!("{s}");
        }
    };
    if let Ok(m) = Manifest::load(&opts.to)
        && m.origin.as_ref() == Some(info)
        && m.streaming.is_none()
    {
        say(format!("{} is a full install of this commit already: nothing to do", opts.to.display()));
        return Ok(InstallReport { commit: info.commit.clone(), ..Default::default() });
    }
    // 1. Metadata, into memory: nothing is written before the disk plan is accepted.
    let index = fetch_whole(http, remote, info, layout, INDEX_FILE)?;
    let config_text = fetch_whole(http, remote, info, layout, "config.json")?;
    let config = K3Config::from_hf_json(&String::from_utf8_lossy(&config_text), "config.json")?;
    let shard_files: Vec<OriginFile> = shard_names(&index)?
        .into_iter()
        .map(|n| {
            info.files
                .iter()
                .find(|f| f.name == n)
                .cloned()
                .with_context(|| format!("the index names {n}, which the snapshot does not have"))
        })
        .collect::<Result<_>>()?;
    let weight_map: HashMap<String, String> = {
        let v: serde_json::Value = serde_json::from_slice(&index)?;
        v.get("weight_map")
            .and_then(|w| w.as_object())
            .map(|m| m.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string()))).collect())
            .unwrap_or_default()
    };
    let headers = fetch_headers(http, remote, info, layout, &shard_files, opts.workers)?;
    let mut shards: Vec<ShardPlan> = shard_files
        .into_iter()
        .zip(headers)
        .map(|(file, header)| ShardPlan { file, header, needed: Vec::new() })
        .collect();
    let estimate = spine_ranges(&config, &weight_map, &mut shards)?;
    let spine_estimate = estimate.bytes(estimate.dtype(opts.spine));
    let small: Vec<&OriginFile> =
        info.files.iter().filter(|f| !shards.iter().any(|s| s.file.name == f.name) && f.size <= SMALL_FILE).collect();

    // 2. The plan, against the disk.
    let (mut fetch_total, mut here) = (0u64, 0u64);
    let logs_dir_exists = layout.state_dir().exists();
    for s in &shards {
        let have = if logs_dir_exists && !layout.is_finished(&s.file) {
            crate::fill::FillLog::open(&layout.fill_log(&s.file.name))?.have()
        } else {
            Vec::new()
        };
        let done = layout.is_finished(&s.file);
        for &r in &s.needed {
            let need = if done { 0 } else { total(&missing_in(r, &have)) };
            fetch_total += need;
            here += (r.1 - r.0) - need;
        }
    }
    for f in &small {
        if layout.is_finished(f) {
            here += f.size;
        } else {
            fetch_total += f.size;
        }
    }
    let spine_on_disk = std::fs::metadata(opts.to.join("spine.bin")).map(|m| m.len()).unwrap_or(0);
    let need_disk = fetch_total + spine_estimate.saturating_sub(spine_on_disk);
    let snapshot_bytes: u64 = info.files.iter().map(|f| f.size).sum();
    let free = free_space(&opts.to);
    say(format!(
        "stream part: headers and spine tensors of {} shards, {} other files\n  to download: {} (of {} in the snapshot); already here: {}\n  disk needed: {} (downloads, and about {} of converted spine); free: {}",
        shards.len(),
        small.len(),
        human(fetch_total),
        human(snapshot_bytes),
        human(here),
        human(need_disk),
        human(spine_estimate),
        free.map(human).unwrap_or_else(|| "unknown".into()),
    ));
    if opts.mode == Mode::Full {
        let full_need = need_disk + shards.iter().map(|s| s.file.size - total(&s.needed)).sum::<u64>();
        say(format!("full install: then the rest of every shard; disk needed in all: about {}", human(full_need)));
        check_space(free, full_need, &opts.to)?;
    } else {
        check_space(free, need_disk, &opts.to)?;
    }

    // 3. Fetch: small files whole, shards' headers (from memory) and spine ranges.
    std::fs::create_dir_all(&opts.to).with_context(|| format!("creating {}", opts.to.display()))?;
    layout.create_dirs(&info.commit)?;
    save_json(&layout.origin_file(), &Pinned { origin: info.clone() })?;
    let mut targets = Vec::new();
    let mut jobs = Vec::new();
    let mut written = 0u64;
    for f in &small {
        if layout.is_finished(f) {
            continue;
        }
        let t = Target::open(f, remote.file_url(&info.commit, &f.name), &layout.partial(f), &layout.fill_log(&f.name))?;
        // The index and the config are in memory already.
        let held = match f.name.as_str() {
            INDEX_FILE => Some(&index),
            "config.json" => Some(&config_text),
            _ => None,
        };
        if let Some(b) = held.filter(|b| b.len() as u64 == f.size && !b.is_empty())
            && !t.log.covers((0, f.size))
        {
            write_synced(&t.file, &t.path, b, 0)?;
            t.log.add(0, b)?;
            written += f.size;
        }
        let gaps = missing(f.size, &t.log.have());
        jobs.extend(pieces(&gaps, opts.piece_bytes).into_iter().map(|r| (targets.len(), r)));
        targets.push(t);
    }
    let first_shard = targets.len();
    for s in &shards {
        if layout.is_finished(&s.file) {
            continue;
        }
        let t = Target::open(
            &s.file,
            remote.file_url(&info.commit, &s.file.name),
            &layout.partial(&s.file),
            &layout.fill_log(&s.file.name),
        )?;
        let hlen = s.header.len() as u64;
        if !t.log.covers((0, hlen)) {
            write_synced(&t.file, &t.path, &s.header, 0)?;
            t.log.add(0, &s.header)?;
            written += hlen;
        }
        let have = t.log.have();
        let mut gaps = Vec::new();
        for &r in &s.needed {
            gaps.extend(missing_in(r, &have));
        }
        jobs.extend(pieces(&normalize(gaps), opts.piece_bytes).into_iter().map(|r| (targets.len(), r)));
        targets.push(t);
    }
    let bytes: u64 = jobs.iter().map(|(_, r)| r.1 - r.0).sum();
    let progress = Progress::new("spine", bytes, opts.quiet);
    written += run(http, &targets, jobs, opts.workers, &progress)?;
    progress.finish();

    // 4. Small files are complete: verify and publish them. Shards stay partial (linked).
    for t in &targets[..first_shard] {
        let f = small.iter().find(|f| f.name == t.name).context("a small file vanished from the plan")?;
        verify_file(t, f)?;
        layout.publish(info, f)?;
    }
    for s in &shards {
        if !layout.is_finished(&s.file) {
            layout.link_partial(&s.file)?;
        }
    }
    for f in &small {
        // A file finished by an earlier run may lack its view link if that run was killed.
        if layout.is_finished(f) {
            layout.publish(info, f)?;
        }
    }

    // 5. The presence map, then the conversion of the spine; the manifest comes last.
    let moe = config.moe_layers();
    deltafin_store::presence::Presence::open_or_create(&opts.to.join(PRESENCE_FILE), &moe, config.num_experts)?;
    let current = Manifest::load(&opts.to).ok();
    let bf16_bytes = estimate.bytes(SpineDtype::Bf16);
    let converted =
        current.as_ref().is_some_and(|m| m.origin.as_ref() == Some(info) && opts.spine.matches(&m.spine, bf16_bytes));
    if let (true, Some(m)) = (converted, &current) {
        say(format!("the spine is converted already ({:?} matrices); kept", m.spine.matrix_dtype));
    } else {
        say("converting the spine".into());
        let co = ConvertOptions {
            spine: opts.spine,
            progress: !opts.quiet,
            origin: Some(info.clone()),
            streaming: Some(StreamingInfo { presence_file: PRESENCE_FILE.into() }),
            expert_sums: ExpertSums::Absent,
            ..Default::default()
        };
        convert(&layout.checkpoint_dir(), &opts.to, &co)?;
    }
    Ok(InstallReport { commit: info.commit.clone(), written, ..Default::default() })
}

fn check_space(free: Option<u64>, need: u64, to: &Path) -> Result<()> {
    if let Some(free) = free
        && need > free
    {
        bail!(
            "not enough disk space at {}: this install needs {} and {} is free; free space or choose another --to",
            to.display(),
            human(need),
            human(free)
        );
    }
    Ok(())
}

/// A complete small file against the origin's size and hash (read back from disk): its sha256
/// (LFS), else its git blob id (sha1 of `blob <len>\0` and the bytes), as the Hub lists it.
fn verify_file(t: &Target, f: &OriginFile) -> Result<()> {
    let len = t.file.metadata()?.len();
    if len != f.size {
        bail!("{}: {len} bytes on disk, the origin has {}", f.name, f.size);
    }
    let (kind, got, want) = if let Some(want) = &f.sha256 {
        ("sha256", sha256_of(&t.path, |_, _| {})?, want.clone())
    } else if let Some(want) = f.blob.as_ref().filter(|b| b.len() == 40) {
        ("git blob id", git_blob_id(&t.path)?, want.to_ascii_lowercase())
    } else {
        return Ok(());
    };
    if got != want {
        t.log.clear()?;
        bail!(
            "{}: {kind} {got} does not match the origin's {want}; its pieces are discarded, rerun to fetch it again",
            f.name
        );
    }
    Ok(())
}

/// Git's blob id of a (small) file.
fn git_blob_id(path: &Path) -> Result<String> {
    use sha1::Digest as _;
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mut h = sha1::Sha1::new();
    h.update(format!("blob {}\0", bytes.len()).as_bytes());
    h.update(&bytes);
    Ok(crate::remote::hex(&h.finalize()))
}

/// The sha256 of a file, read in 8 MiB blocks; `each(offset, block)` sees every block (to hash
/// experts in the same pass).
fn sha256_of(path: &Path, mut each: impl FnMut(u64, &[u8])) -> Result<String> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 8 << 20];
    let mut off = 0u64;
    loop {
        let n = f.read(&mut buf).with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        each(off, &buf[..n]);
        off += n as u64;
    }
    Ok(crate::remote::hex(&h.finalize()))
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct UpgradeReport {
    pub downloaded: u64,
    pub written: u64,
    pub shards_verified: usize,
}

/// `deltafin install --upgrade-to-full STORE`: fetch every range a streaming store lacks,
/// keeping what it has; verify each shard against the origin's sha256 (hashing its experts in
/// the same read); then switch the manifest to a full store.
pub fn upgrade(
    store: &Path,
    endpoint: Option<&str>,
    http_cfg: HttpConfig,
    workers: usize,
    piece_bytes: u64,
    quiet: bool,
) -> Result<UpgradeReport> {
    let m = Manifest::load(store)?;
    let info =
        m.origin.clone().context("this store was not made by `deltafin install` (it has no origin to fetch from)")?;
    let remote = Remote::new(OriginKind::parse(&info.kind)?, endpoint.unwrap_or(&info.endpoint), &info.repo)?;
    let http = Http::new(&remote.endpoint, http_cfg)?;
    let layout = Layout::new(store, &info.repo);
    let mut r = upgrade_with(&http, &remote, &layout, workers, piece_bytes, quiet)?;
    r.downloaded = http.counters.bytes.load(Ordering::Relaxed);
    Ok(r)
}

/// An expert whose record starts in a shard: (layer, expert, its ranges).
type ShardExpert = (usize, usize, Vec<[u64; 3]>);

#[derive(Serialize, Deserialize)]
struct ShardSums {
    /// `[layer, expert, xxh3]` of every expert record in this shard.
    experts: Vec<[u64; 3]>,
}

fn upgrade_with(
    http: &Http,
    remote: &Remote,
    layout: &Layout,
    workers: usize,
    piece_bytes: u64,
    quiet: bool,
) -> Result<UpgradeReport> {
    let store_dir = &layout.store;
    let m = Manifest::load(store_dir)?;
    let info = m.origin.clone().context("this store has no origin")?;
    if m.streaming.is_none() {
        if !quiet {
            eprintln!("{} is already a full store", store_dir.display());
        }
        return Ok(UpgradeReport::default());
    }
    let store = Store::open(store_dir, None)?;
    let presence = store.experts.presence().cloned().context("a streaming store without its presence map")?;
    let ex = &m.experts;
    // Per shard (by expert file index): its experts' ranges, and the present ones.
    let mut experts_of: Vec<Vec<ShardExpert>> = vec![Vec::new(); ex.files.len()];
    for l in &ex.layers {
        for (e, loc) in l.experts.iter().enumerate() {
            if let Some(r) = loc.ranges.first() {
                experts_of[r[0] as usize].push((l.layer, e, loc.ranges.clone()));
            }
        }
    }
    let mut targets = Vec::new();
    let mut jobs = Vec::new();
    let mut files = Vec::new();
    for (fi, name) in ex.files.iter().enumerate() {
        let f =
            info.files.iter().find(|f| &f.name == name).with_context(|| format!("the origin record lacks {name}"))?;
        if layout.is_finished(f) {
            continue;
        }
        let t = Target::open(f, remote.file_url(&info.commit, name), &layout.partial(f), &layout.fill_log(name))?;
        let mut have = t.log.have();
        for (l, e, ranges) in &experts_of[fi] {
            if presence.get(*l, *e).is_some() {
                have.extend(ranges.iter().filter(|r| r[0] as usize == fi).map(|r| (r[1], r[1] + r[2])));
            }
        }
        let gaps = missing(f.size, &normalize(have));
        jobs.extend(pieces(&gaps, piece_bytes).into_iter().map(|r| (targets.len(), r)));
        targets.push(t);
        files.push((fi, f.clone()));
    }
    let bytes: u64 = jobs.iter().map(|(_, r)| r.1 - r.0).sum();
    let free = free_space(store_dir);
    if !quiet {
        eprintln!(
            "upgrade to full: {} of {} shards to complete; to download: {}; free: {}",
            targets.len(),
            ex.files.len(),
            human(bytes),
            free.map(human).unwrap_or_else(|| "unknown".into())
        );
    }
    check_space(free, bytes, store_dir)?;
    let progress = Progress::new("shards", bytes, quiet);
    let written = run(http, &targets, jobs, workers, &progress)?;
    progress.finish();

    // Verify each completed shard, hashing its experts in the same pass; then publish it.
    let mut verified = 0;
    for (t, (fi, f)) in targets.iter().zip(&files) {
        let mine = &experts_of[*fi];
        // Experts of a shard are contiguous single ranges in K3; a record split over several
        // ranges or files is hashed by reading it back below.
        let mut hashers: Vec<(u64, u64, Xxh3)> = Vec::new();
        let single: Vec<bool> = mine.iter().map(|(_, _, r)| r.len() == 1).collect();
        for (_, _, r) in mine.iter().filter(|(_, _, r)| r.len() == 1) {
            hashers.push((r[0][1], r[0][1] + r[0][2], Xxh3::new()));
        }
        let got = sha256_of(&t.path, |off, block| {
            let end = off + block.len() as u64;
            for (s, e, h) in hashers.iter_mut() {
                let (a, b) = ((*s).max(off), (*e).min(end));
                if a < b {
                    h.update(&block[(a - off) as usize..(b - off) as usize]);
                }
            }
        })?;
        if let Some(want) = &f.sha256
            && &got != want
        {
            // Which bytes are wrong cannot be told: every range of this shard is fetched again,
            // the experts fetched on first use included.
            for (l, e, _) in mine {
                presence.unmark(*l, *e)?;
            }
            // The spine was converted from ranges of this shard, which cannot be trusted now:
            // the upgrade converts it again once every shard is verified.
            save_json(&layout.state_dir().join(SPINE_STALE), &f.name)?;
            t.log.clear()?;
            bail!(
                "{}: sha256 {got} does not match the origin's {want}; its ranges are discarded, rerun the upgrade to fetch them again \
                 (if the origin's file itself changed, install again into a new directory)",
                f.name
            );
        }
        if f.sha256.is_none() && !quiet {
            eprintln!("{}: the origin publishes no sha256 (no SHA256SUMS on the mirror): checked by size only", f.name);
        }
        let mut sums = Vec::new();
        let mut hi = hashers.into_iter();
        let mut record = Vec::new();
        for ((l, e, _), one) in mine.iter().zip(single) {
            let sum = if one {
                hi.next().map(|(_, _, h)| h.digest()).context("hasher count")?
            } else {
                store.experts.read_raw(*l, *e, &mut record)?;
                deltafin_store::checksum::xxh3_64(&record)
            };
            if let Some(p) = presence.get(*l, *e)
                && p != sum
            {
                bail!(
                    "layer {l} expert {e}: the verified shard disagrees with the checksum recorded when it was fetched"
                );
            }
            sums.push([*l as u64, *e as u64, sum]);
        }
        save_json(&layout.sums_file(&f.name), &ShardSums { experts: sums })?;
        layout.publish(&info, f)?;
        verified += 1;
    }

    // Every shard is a verified blob now: the manifest gains every expert's checksum and stops
    // streaming. The spine was converted from ranges of these same verified bytes.
    let mut given = HashMap::new();
    for name in &ex.files {
        let p = layout.sums_file(name);
        let s: ShardSums =
            serde_json::from_slice(&std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?)?;
        for [l, e, x] in s.experts {
            given.insert((l as usize, e as usize), x);
        }
    }
    let stale = layout.state_dir().join(SPINE_STALE);
    if stale.exists() {
        // A shard failed its sha256 after its spine ranges were converted: convert the spine
        // again, now from verified bytes (the manifest is written last, as in any conversion).
        if !quiet {
            eprintln!("converting the spine again from the verified shards");
        }
        let co = ConvertOptions {
            spine: m.spine.precision(),
            int8_group: m.spine.int8_group,
            progress: !quiet,
            origin: Some(info.clone()),
            streaming: None,
            expert_sums: ExpertSums::Given(given),
            ..Default::default()
        };
        convert(&layout.checkpoint_dir(), store_dir, &co)?;
        std::fs::remove_file(&stale).with_context(|| format!("removing {}", stale.display()))?;
    } else {
        let mut full = m.clone();
        for l in &mut full.experts.layers {
            for (e, loc) in l.experts.iter_mut().enumerate() {
                loc.xxh3 = *given
                    .get(&(l.layer, e))
                    .with_context(|| format!("no checksum for layer {} expert {e}", l.layer))?;
            }
        }
        full.streaming = None;
        full.save(store_dir)?;
    }
    let _ = std::fs::remove_file(store_dir.join(PRESENCE_FILE));
    if !quiet {
        eprintln!(
            "{} is a full store now; its checkpoint is a Hub snapshot under {}",
            store_dir.display(),
            layout.hub_cache().display()
        );
    }
    Ok(UpgradeReport { downloaded: 0, written, shards_verified: verified })
}
