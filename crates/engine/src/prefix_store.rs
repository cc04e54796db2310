//! Prompt states kept on disk (issue 15): a directory of snapshots ([`crate::k3::snapshot`]),
//! each the state after an exact token prefix, for one model identity. A new prompt resumes from
//! the longest stored prefix of it and computes only the rest; a restart finds the snapshots
//! again.
//!
//! - A snapshot's file name carries what a lookup needs without reading it:
//!   `{identity:016x}-{prefix hash:016x}-{tokens}.dfstate`. The prefix hash is XXH3-64 of the
//!   tokens as little-endian u32s; a candidate is confirmed against the token list inside the
//!   snapshot before use, so a hash collision costs a read, never a wrong state.
//! - Writes are crash-safe: a temporary file in the same directory, synced, renamed over the final
//!   name, the directory synced. kill -9 in the middle leaves at most a temporary file, which the
//!   next open deletes.
//! - Writes are off the engine's path: [`PrefixStore::save`] encodes the state into the store's
//!   one buffer and hands it to a writer thread, which writes, syncs and renames while the model
//!   goes on (on Kimi K3 a snapshot is ~434 MB and 1-2 s of writing, once per prompt chunk and
//!   before the first token). The next use of the buffer (a save or a lookup) waits only for a
//!   write still in progress, and dropping the store waits for it. A torn or corrupt snapshot fails its checksum when read: it is deleted
//!   and the lookup goes on to the next shorter prefix.
//! - Eviction is least-recently-used within the byte budget; recency is the file's modification
//!   time (set on every use), so it survives restarts.
//! - Snapshots of other model identities in the same directory are left alone and not counted.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use deltafin_store::checksum::xxh3_64;

use crate::k3::K3State;
use crate::k3::snapshot;

const EXT: &str = "dfstate";
const TMP_EXT: &str = "dfstate-tmp";
/// Where the file system cannot lock files: a temporary file untouched this long (either way,
/// should the clock have moved) is what an interrupted write left; a snapshot is written in
/// seconds.
const STALE_TMP: std::time::Duration = std::time::Duration::from_secs(600);

/// Temporary files written by this process so far (part of their names).
static TMP_SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Replace `buf`'s contents with the file at `path` (its capacity is kept for the next one).
fn read_into(path: &Path, buf: &mut Vec<u8>) -> io::Result<()> {
    use std::io::Read;
    buf.clear();
    File::open(path)?.read_to_end(buf)?;
    Ok(())
}

/// Whether the temporary file at `path` is left over from an interrupted write. Its writer holds
/// an exclusive lock on it from creation to rename, and the system drops the lock when the
/// writer dies, however it dies: a file that can be locked has no writer. That holds across
/// processes, containers sharing a volume and (on file systems that lock) machines. Where locks
/// are not supported, the file's age decides.
fn stale_tmp(path: &Path) -> bool {
    let Ok(f) = File::options().read(true).write(true).open(path) else { return false };
    match f.try_lock() {
        Ok(()) => true,
        Err(std::fs::TryLockError::WouldBlock) => false,
        Err(std::fs::TryLockError::Error(_)) => f
            .metadata()
            .and_then(|m| m.modified())
            .map(|t| SystemTime::now().duration_since(t).unwrap_or_else(|e| e.duration()) >= STALE_TMP)
            .unwrap_or(false),
    }
}

/// What the store did, for `/metrics` and reports.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct StoreCounters {
    pub hits: u64,
    pub misses: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub snapshots_written: u64,
    pub evictions: u64,
    /// Snapshots found torn or corrupt (or unreadable) and deleted.
    pub dropped: u64,
    /// Nanoseconds spent reading and restoring snapshots.
    pub read_ns: u64,
    /// Nanoseconds the caller spent encoding snapshots into the buffer (on its own thread).
    pub encode_ns: u64,
    /// Nanoseconds the writer threads spent writing and syncing snapshots (beside the caller).
    pub write_ns: u64,
    /// Nanoseconds the caller waited for an earlier snapshot's write to finish: with
    /// `encode_ns`, all the time snapshots took from the caller.
    pub wait_ns: u64,
    /// Snapshot writes that failed (each also logged, and returned by the next call).
    pub write_errors: u64,
}

/// A snapshot being written by its own thread; joining it gives the buffer back.
struct Pending {
    bytes: u64,
    writer: std::thread::JoinHandle<Written>,
}

/// What a writer thread hands back: the buffer, and the entry once the snapshot is in place.
struct Written {
    buf: Vec<u8>,
    result: io::Result<Entry>,
    ns: u64,
}

#[derive(Debug, Clone)]
struct Entry {
    tokens: usize,
    key: u64,
    bytes: u64,
    used: SystemTime,
    path: PathBuf,
}

pub struct PrefixStore {
    dir: PathBuf,
    budget: u64,
    identity: u64,
    entries: Vec<Entry>,
    /// One snapshot's bytes, reused to encode and to read: about one sequence state (which the
    /// memory plan reserves as a state copy when a state directory is in use) plus the logits
    /// and the token list.
    buf: Vec<u8>,
    /// The write in progress, which holds `buf` until it is joined.
    pending: Option<Pending>,
    pub counters: StoreCounters,
}

impl Drop for PrefixStore {
    fn drop(&mut self) {
        if let Err(e) = self.flush() {
            tracing::warn!("keeping a prompt state on disk failed: {e}");
        }
    }
}

/// The identity stored states are kept under: the store's manifest (its weights, spine dtype
/// and checksums, hashed), the run's numerics, the model variant (experts per token) and the
/// kernel path: any of them changes the states a prompt leads to.
pub fn identity(manifest_hash: u64, numerics: &str, variant: &str) -> u64 {
    // The kernel path too: SIMD reductions differ from the scalar ones in their last bits, so a
    // directory shared between machines never mixes them.
    xxh3_64(format!("{manifest_hash:016x}|{numerics}|{variant}|{}", crate::kernel_path()).as_bytes())
}

/// Tokens as the bytes their keys hash: little-endian u32s.
fn token_bytes(tokens: &[u32]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

/// The key of a token prefix.
pub fn prefix_key(tokens: &[u32]) -> u64 {
    xxh3_64(&token_bytes(tokens))
}

impl PrefixStore {
    /// Open (creating) `dir` for snapshots of model `identity`, keeping at most `budget` bytes
    /// of them. Temporary files left by an interrupted write are deleted; those of another
    /// process's write in progress (a shared directory) are not: see `stale_tmp`.
    pub fn open(dir: &Path, budget: u64, identity: u64) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut entries = Vec::new();
        let prefix = format!("{identity:016x}-");
        for e in std::fs::read_dir(dir)? {
            let e = e?;
            let path = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if name.ends_with(TMP_EXT) {
                if stale_tmp(&path) {
                    let _ = std::fs::remove_file(&path);
                }
                continue;
            }
            let Some(rest) = name.strip_prefix(&prefix).and_then(|r| r.strip_suffix(&format!(".{EXT}"))) else {
                continue;
            };
            let Some((key, tokens)) = rest.split_once('-') else { continue };
            let (Ok(key), Ok(tokens)) = (u64::from_str_radix(key, 16), tokens.parse::<usize>()) else { continue };
            // Another process sharing the directory may have evicted it since the listing.
            let Ok(meta) = e.metadata() else { continue };
            let Ok(used) = meta.modified() else { continue };
            entries.push(Entry { tokens, key, bytes: meta.len(), used, path });
        }
        let mut s = PrefixStore {
            dir: dir.to_path_buf(),
            budget,
            identity,
            entries,
            buf: Vec::new(),
            pending: None,
            counters: Default::default(),
        };
        s.evict_to(budget);
        Ok(s)
    }

    /// One line for the plan printed at start: what is held, the budget, where.
    pub fn describe(&self) -> String {
        let (n, bytes) = self.held();
        format!(
            "prompt states    {} of at most {} on disk in {} ({n} snapshots; least recently used evicted first)",
            crate::units::human(bytes),
            crate::units::human(self.budget),
            self.dir.display()
        )
    }

    /// Snapshots held, and their bytes (a snapshot being written counts).
    pub fn held(&self) -> (usize, u64) {
        let pending = self.pending.as_ref().map_or(0, |p| p.bytes);
        (
            self.entries.len() + self.pending.is_some() as usize,
            self.entries.iter().map(|e| e.bytes).sum::<u64>() + pending,
        )
    }

    /// Wait for the snapshot being written, if any: its file is then in place (or the error of
    /// its write is returned, its temporary file removed).
    pub fn flush(&mut self) -> io::Result<()> {
        let Some(p) = self.pending.take() else { return Ok(()) };
        let t0 = std::time::Instant::now();
        let joined = p.writer.join();
        self.counters.wait_ns += t0.elapsed().as_nanos() as u64;
        let written = joined.map_err(|_| {
            self.counters.write_errors += 1;
            io::Error::other("the prompt state writer panicked")
        })?;
        self.buf = written.buf;
        self.counters.write_ns += written.ns;
        match written.result {
            Ok(entry) => {
                self.counters.bytes_written += entry.bytes;
                self.counters.snapshots_written += 1;
                self.entries.push(entry);
                Ok(())
            }
            Err(e) => {
                self.counters.write_errors += 1;
                Err(e)
            }
        }
    }

    /// Restore the longest stored prefix of `prompt` (at most `max_tokens` long) into `st` and
    /// `logits`; returns its length, or `None` when no snapshot serves. Snapshots that fail
    /// their checks are deleted on the way. After `None`, `st` and `logits` may hold a refused
    /// snapshot's partial contents: the caller starts from a fresh state.
    pub fn restore_longest(
        &mut self,
        prompt: &[u32],
        max_tokens: usize,
        st: &mut K3State,
        logits: &mut [f32],
    ) -> Option<usize> {
        // The buffer (and the entry of the snapshot being written) first.
        if let Err(e) = self.flush() {
            tracing::warn!("keeping a prompt state on disk failed: {e}");
        }
        // The prompt's bytes once; each entry's key is the hash of a prefix of them.
        let prompt_bytes = token_bytes(prompt);
        let mut candidates: Vec<usize> = (0..self.entries.len())
            .filter(|&i| {
                let e = &self.entries[i];
                e.tokens > 0
                    && e.tokens <= prompt.len().min(max_tokens)
                    && e.key == xxh3_64(&prompt_bytes[..4 * e.tokens])
            })
            .collect();
        candidates.sort_by_key(|&i| std::cmp::Reverse(self.entries[i].tokens));
        let t0 = std::time::Instant::now();
        let mut dead = Vec::new();
        let mut forgotten = Vec::new();
        let mut found = None;
        for i in candidates {
            let e = &self.entries[i];
            // Into the one buffer that `save` encodes into: the store holds at most one
            // snapshot's bytes in memory (the plan counts one state copy for it).
            let read = read_into(&e.path, &mut self.buf);
            let bytes = match read {
                Ok(()) => Some(&self.buf),
                Err(err) => {
                    // Gone (another process sharing the directory evicted it) or unreadable:
                    // forgotten, so it no longer counts towards the budget, but not deleted
                    // (the error may pass, or the name may hold another process's new file).
                    tracing::warn!("prompt state {} unreadable ({err}); forgotten", e.path.display());
                    forgotten.push(i);
                    None
                }
            };
            let restored = bytes.and_then(|bytes| {
                self.counters.bytes_read += bytes.len() as u64;
                match snapshot::decode(bytes, self.identity, st, logits) {
                    Ok(tokens) if tokens == prompt[..e.tokens] => Some(()),
                    Ok(_) => None, // a hash collision: another prefix, not this one
                    Err(err) => {
                        tracing::warn!("prompt state {} refused ({err}); deleted", e.path.display());
                        dead.push(i);
                        None
                    }
                }
            });
            if restored.is_some() {
                found = Some(i);
                break;
            }
        }
        self.counters.read_ns += t0.elapsed().as_nanos() as u64;
        for &i in &dead {
            let _ = std::fs::remove_file(&self.entries[i].path);
            self.counters.dropped += 1;
        }
        let tokens = found.map(|i| {
            let e = &mut self.entries[i];
            e.used = SystemTime::now();
            // Recency survives restarts; a failure to record it only ages the snapshot.
            let _ = File::options().write(true).open(&e.path).and_then(|f| f.set_modified(e.used));
            e.tokens
        });
        let mut i = 0;
        self.entries.retain(|_| {
            i += 1;
            !dead.contains(&(i - 1)) && !forgotten.contains(&(i - 1))
        });
        match tokens {
            Some(_) => self.counters.hits += 1,
            None => self.counters.misses += 1,
        }
        tokens
    }

    /// Keep the state after `tokens` (with the logits after the last of them). A prefix already
    /// held is only marked used. Crash-safe (see the module); evicts the least recently used
    /// snapshots to stay within the budget; a snapshot larger than the whole budget is not kept.
    /// The state is encoded here and written by a thread of its own ([`Self::flush`] waits for
    /// it); an earlier write's failure is returned here, after this state is handed over.
    pub fn save(&mut self, tokens: &[u32], st: &K3State, logits: &[f32]) -> io::Result<()> {
        if tokens.is_empty() {
            return Ok(());
        }
        // The buffer back from the previous write (and its entry, so a prefix it held is seen).
        let earlier = self.flush();
        self.save_now(tokens, st, logits)?;
        earlier
    }

    fn save_now(&mut self, tokens: &[u32], st: &K3State, logits: &[f32]) -> io::Result<()> {
        if st.is_part_way() {
            return Err(io::Error::other("a state left part-way through a chunk is not saved"));
        }
        if tokens.len() != st.position {
            return Err(io::Error::other(format!(
                "a state after {} tokens cannot stand for {} tokens",
                st.position,
                tokens.len()
            )));
        }
        let key = prefix_key(tokens);
        if let Some(e) = self.entries.iter_mut().find(|e| e.tokens == tokens.len() && e.key == key) {
            e.used = SystemTime::now();
            let _ = File::options().write(true).open(&e.path).and_then(|f| f.set_modified(e.used));
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        self.buf.clear();
        snapshot::encode(st, logits, tokens, self.identity, &mut self.buf);
        let bytes = self.buf.len() as u64;
        if bytes > self.budget {
            return Ok(());
        }
        self.evict_to(self.budget - bytes);
        let name = format!("{:016x}-{key:016x}-{}", self.identity, tokens.len());
        // The temporary name is this write's own (process, clock, serial), so that no two
        // writers, in one process or several sharing the directory, write into one file; the
        // lock, held until the rename publishes the whole snapshot, tells a start that the
        // file is being written (see `stale_tmp`).
        let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let serial = TMP_SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = self.dir.join(format!("{name}.{}-{nanos}-{serial}.{TMP_EXT}", std::process::id()));
        let path = self.dir.join(format!("{name}.{EXT}"));
        let (buf, dir, n) = (std::mem::take(&mut self.buf), self.dir.clone(), tokens.len());
        self.counters.encode_ns += t0.elapsed().as_nanos() as u64;
        let writer = std::thread::Builder::new().name("deltafin-state-writer".into()).spawn(move || {
            let t0 = std::time::Instant::now();
            let written = (|| {
                let mut f = File::options().write(true).create_new(true).open(&tmp)?;
                // A file system without locks still gets the snapshot (starts then go by age).
                if let Err(e) = f.lock() {
                    tracing::debug!("locking {}: {e}", tmp.display());
                }
                f.write_all(&buf)?;
                f.sync_all()?;
                std::fs::rename(&tmp, &path)
            })();
            let result = match written {
                Ok(()) => {
                    // The snapshot is in place (and counted) whether or not the directory's entry
                    // is durable yet: a system that refuses to sync a directory still has the file.
                    if let Err(e) = sync_dir(&dir) {
                        tracing::debug!("syncing {}: {e}", dir.display());
                    }
                    Ok(Entry { tokens: n, key, bytes, used: SystemTime::now(), path })
                }
                Err(e) => {
                    let _ = std::fs::remove_file(&tmp);
                    Err(e)
                }
            };
            Written { buf, result, ns: t0.elapsed().as_nanos() as u64 }
        })?;
        self.pending = Some(Pending { bytes, writer });
        Ok(())
    }

    /// Delete least recently used snapshots until at most `room` bytes are held.
    fn evict_to(&mut self, room: u64) {
        self.entries.sort_by_key(|e| e.used);
        let mut held: u64 = self.entries.iter().map(|e| e.bytes).sum();
        while held > room && !self.entries.is_empty() {
            let e = self.entries.remove(0);
            let _ = std::fs::remove_file(&e.path);
            held -= e.bytes;
            self.counters.evictions += 1;
        }
    }
}

/// Make a rename in `dir` durable (a no-op where directories cannot be opened: Windows).
fn sync_dir(dir: &Path) -> io::Result<()> {
    #[cfg(unix)]
    {
        File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}
