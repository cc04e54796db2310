//! A run's own reads, replayed: what the drive gives for exactly what the engine read (the same
//! files, offsets and lengths, in the same order, at the engine's queue depth, O_DIRECT) — a
//! limit a run cannot beat, measured minutes after it. The log is written in fio's iolog format
//! (version 2), so that fio replays the very same file where it is installed (`deltafin bench`
//! prefers it); [`replay`] reads it with our own back-ends otherwise.

use std::collections::HashMap;
use std::io::{BufRead, BufWriter, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde::Serialize;

use super::activity::LoggedRead;
use super::aligned::AlignedBuf;
use super::backend::make_backend;
use super::reader::{BackendKind, ReadReq, open_files};

const HEADER: &str = "fio version 2 iolog";

/// Write `reads` as a fio iolog (version 2): each file added and opened once, the reads in
/// order, then each file closed.
pub fn write_iolog(reads: &[LoggedRead], out: &Path) -> Result<()> {
    let mut files: Vec<&Path> = Vec::new();
    for r in reads {
        if !files.contains(&&*r.path) {
            let name = r.path.to_str().context("a read log names a file whose path is not UTF-8")?;
            if name.chars().any(char::is_whitespace) {
                bail!("fio's iolog cannot name a file whose path has spaces: {name}");
            }
            files.push(&r.path);
        }
    }
    let f = std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    let mut w = BufWriter::new(f);
    writeln!(w, "{HEADER}")?;
    for p in &files {
        writeln!(w, "{} add", p.display())?;
    }
    for p in &files {
        writeln!(w, "{} open", p.display())?;
    }
    for r in reads {
        writeln!(w, "{} read {} {}", r.path.display(), r.offset, r.len)?;
    }
    for p in &files {
        writeln!(w, "{} close", p.display())?;
    }
    w.flush()?;
    Ok(())
}

/// The reads of an iolog written by [`write_iolog`] (other actions are skipped).
pub fn read_iolog(path: &Path) -> Result<Vec<LoggedRead>> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut lines = std::io::BufReader::new(f).lines();
    let first = lines.next().transpose()?.unwrap_or_default();
    if first.trim() != HEADER {
        bail!("{} is not a fio version 2 iolog", path.display());
    }
    let mut names: HashMap<String, Arc<Path>> = HashMap::new();
    let mut reads = Vec::new();
    for (n, line) in lines.enumerate() {
        let line = line?;
        let parts: Vec<&str> = line.split_whitespace().collect();
        match parts.as_slice() {
            [file, "read", off, len] => {
                let bad = || format!("{}: line {}: a bad read: {line}", path.display(), n + 2);
                let offset: u64 = off.parse().with_context(bad)?;
                let len: u64 = len.parse().with_context(bad)?;
                let path = names.entry(file.to_string()).or_insert_with(|| Arc::from(Path::new(file))).clone();
                reads.push(LoggedRead { path, offset, len });
            }
            [_, "add" | "open" | "close"] | [] => {}
            _ => bail!("{}: line {}: not understood: {line}", path.display(), n + 2),
        }
    }
    Ok(reads)
}

#[derive(Debug, Clone, Serialize)]
pub struct ReplayResult {
    pub tool: &'static str,
    pub gbps: f64,
    pub bytes: u64,
    pub seconds: f64,
    pub reads: usize,
    pub queue_depth: usize,
    pub backend: BackendKind,
    pub o_direct: bool,
}

/// Read `reads` in order, `queue_depth` in flight, O_DIRECT, and report the rate.
pub fn replay(reads: &[LoggedRead], backend: Option<BackendKind>, queue_depth: usize) -> Result<ReplayResult> {
    if reads.is_empty() {
        bail!("no reads to replay");
    }
    let mut paths: Vec<std::path::PathBuf> = Vec::new();
    let mut index: HashMap<&Path, usize> = HashMap::new();
    for r in reads {
        index.entry(&r.path).or_insert_with(|| {
            paths.push(r.path.to_path_buf());
            paths.len() - 1
        });
    }
    let qd = queue_depth.max(1);
    let max_len = reads.iter().map(|r| r.len).max().unwrap_or(4096) as usize;
    // Declared before the back-end so they are dropped after it: its drop waits for the reads
    // still in flight into them.
    let mut bufs: Vec<AlignedBuf> = (0..qd).map(|_| AlignedBuf::new(max_len)).collect();
    // Their pages exist before the clock starts (a fresh allocation's first write faults them
    // in, which is not the drive's time; the engine's buffers are long in place when it reads).
    for b in &mut bufs {
        b.as_mut_slice().fill(0);
    }
    let (files, o_direct) = open_files(&paths, true)?;
    let mut be = make_backend(Arc::new(files), backend, qd)?;
    let mut free: Vec<usize> = (0..qd).collect();
    let (mut next, mut completed, mut bytes) = (0usize, 0usize, 0u64);
    let mut done = Vec::new();
    let t0 = Instant::now();
    while completed < reads.len() {
        while next < reads.len()
            && let Some(b) = free.pop()
        {
            let r = &reads[next];
            let req = ReadReq {
                file: index[&*r.path],
                offset: r.offset,
                len: r.len as usize,
                need: r.len as usize,
                buf: bufs[b].as_mut_ptr(),
                tag: b as u64,
                urgent: true,
            };
            be.submit(&[req])?;
            bytes += r.len;
            next += 1;
        }
        done.clear();
        be.wait(&mut done)?;
        for (tag, res) in done.drain(..) {
            // A window may run past the end of its file (the engine asks for what is there).
            if let Err(e) = res
                && e.kind() != std::io::ErrorKind::UnexpectedEof
            {
                return Err(e.into());
            }
            free.push(tag as usize);
            completed += 1;
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    Ok(ReplayResult {
        tool: "deltafin",
        gbps: bytes as f64 / seconds / 1e9,
        bytes,
        seconds,
        reads: reads.len(),
        queue_depth: qd,
        backend: be.kind(),
        o_direct,
    })
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn an_iolog_round_trips_and_replays_every_read() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&vec![7u8; 64 * 4096]).unwrap();
        f.flush().unwrap();
        let path: Arc<Path> = Arc::from(f.path());
        let reads: Vec<LoggedRead> = (0..40)
            .map(|i| LoggedRead { path: path.clone(), offset: (i * 7 % 60) * 4096, len: 4096 * (1 + i % 4) })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("reads.iolog");
        write_iolog(&reads, &log).unwrap();
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(text.starts_with("fio version 2 iolog\n"));
        assert_eq!(text.lines().filter(|l| l.contains(" read ")).count(), 40);
        assert_eq!(read_iolog(&log).unwrap(), reads);
        let r = replay(&reads, Some(BackendKind::Pread), 4).unwrap();
        assert_eq!(r.reads, 40);
        assert_eq!(r.bytes, reads.iter().map(|r| r.len).sum::<u64>());
        assert!(r.gbps > 0.0);
        // Bad input is an error, not a panic.
        std::fs::write(&log, "fio version 2 iolog\nx read 1\n").unwrap();
        assert!(read_iolog(&log).is_err());
        std::fs::write(&log, "hello\n").unwrap();
        assert!(read_iolog(&log).is_err());
    }
}
