//! The disk side of a run's floor: what the drive gives for exactly the reads the run made,
//! measured minutes after it. fio replays the run's read log (its fio iolog: the same files,
//! offsets and lengths, in order) with io_uring, O_DIRECT, at the run's queue depth where fio is
//! installed; our own replay (`stream::replay`, in a fresh process) reads the same log
//! otherwise. With fio, also its rate for random whole records over the same files at the same
//! depth: the drive's rate for the record size, independent of the run's pattern.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

/// Set to `1` (by `scripts/test.sh`, after installing fio) where fio must be used: a missing
/// fio is then an error instead of the internal replay.
pub const REQUIRE_FIO_ENV: &str = "DELTAFIN_REQUIRE_FIO";

/// Whether `fio` runs here.
pub fn fio_available() -> bool {
    Command::new("fio").arg("--version").output().is_ok_and(|o| o.status.success())
}

/// Replays of a run's reads; the fastest is the limit. This drive's rate moves from one
/// replay of the same reads to the next (2.2-2.8 GB/s three times in a row here), and a limit
/// must be what the drive can do, not what it did once.
const REPLAYS: usize = 2;

/// The replay's result as JSON: `tool`, `gbps` (the fastest of [`REPLAYS`]), `trials_gbps`,
/// `bytes`, `seconds`, `queue_depth`; `tool` `none` (and no rate) for a run that read nothing.
pub fn replay(log: &Path, io_backend: &str, queue_depth: usize) -> Result<Value> {
    let text = std::fs::read_to_string(log).with_context(|| format!("reading the run's read log {}", log.display()))?;
    if !text.lines().any(|l| l.contains(" read ")) {
        return Ok(json!({ "tool": "none", "reads": 0, "bytes": 0 }));
    }
    // What the log holds, to check the replay against.
    let (mut reads, mut bytes) = (0u64, 0u64);
    for l in text.lines() {
        if let [_, "read", _, len] = l.split_whitespace().collect::<Vec<_>>()[..] {
            reads += 1;
            bytes += len.parse::<u64>().unwrap_or(0);
        }
    }
    let mut best: Option<Value> = None;
    let mut trials = Vec::new();
    for _ in 0..REPLAYS {
        let mut v = replay_once(log, io_backend, queue_depth)?;
        if v["tool"] == "fio" {
            v = fio_replay_rate(v, reads, bytes)?;
        }
        let gbps = v["gbps"].as_f64().unwrap_or(0.0);
        trials.push(gbps);
        if best.as_ref().is_none_or(|b| b["gbps"].as_f64().unwrap_or(0.0) < gbps) {
            best = Some(v);
        }
    }
    let mut best = best.context("no replay ran")?;
    best["trials_gbps"] = json!(trials);
    best["logged_reads"] = json!(reads);
    best["logged_bytes"] = json!(bytes);
    Ok(best)
}

/// A fio replay's rate over the log's own bytes. fio 3.33 leaves the reads still in flight when
/// a replayed log runs out (queue depth - 1 of them) out of its `io_bytes` and latency samples,
/// though they are in `total_ios` and inside `runtime` (its `iops` is `total_ios / runtime`):
/// at depth 32 on 365 records, 8.5% of the bytes. A replay that completed every logged read
/// moved every logged byte in `runtime`; one that did not is an error, not a rate.
fn fio_replay_rate(mut v: Value, logged_reads: u64, logged_bytes: u64) -> Result<Value> {
    let done = v["reads"].as_u64().unwrap_or(0);
    if done != logged_reads {
        bail!("fio replayed {done} of the log's {logged_reads} reads");
    }
    let seconds = v["seconds"].as_f64().unwrap_or(0.0);
    v["fio_io_bytes"] = v["bytes"].clone();
    v["bytes"] = json!(logged_bytes);
    v["gbps"] = json!(logged_bytes as f64 / seconds / 1e9);
    Ok(v)
}

fn replay_once(log: &Path, io_backend: &str, queue_depth: usize) -> Result<Value> {
    if fio_available() {
        let engine = if io_backend == "pread" { "psync" } else { "io_uring" };
        let depth = queue_depth.max(1).to_string();
        let mut args = vec![
            "--name=replay".to_string(),
            format!("--read_iolog={}", log.display()),
            format!("--ioengine={engine}"),
            "--direct=1".into(),
            "--replay_no_stall=1".into(),
            "--output-format=json".into(),
        ];
        // psync has one read in flight per job: the pread pool's depth is its thread count,
        // which a replay in order cannot split; io_uring takes the depth as it is.
        if engine == "io_uring" {
            args.push(format!("--iodepth={depth}"));
        }
        let mut v = fio_registered(&mut args, engine == "io_uring")?;
        v["queue_depth"] = json!(if engine == "io_uring" { queue_depth.max(1) } else { 1 });
        return Ok(v);
    }
    if std::env::var(REQUIRE_FIO_ENV).is_ok_and(|v| v == "1") {
        bail!("{REQUIRE_FIO_ENV}=1, but fio does not run here");
    }
    let exe = std::env::current_exe().context("locating the deltafin binary")?;
    let out = Command::new(exe)
        .args(["probe-disk", "--replay"])
        .arg(log)
        .args(["--io-backend", io_backend, "--queue-depth", &queue_depth.to_string()])
        .output()
        .context("spawning the replay")?;
    if !out.status.success() {
        bail!("the replay failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    serde_json::from_slice(&out.stdout).context("parsing the replay's JSON")
}

/// fio's rate for `reads` random `record_bytes` reads over `files` at `queue_depth` (io_uring,
/// O_DIRECT); `None` where fio is not installed or a path cannot go into its file list.
pub fn random_records(
    files: &[std::path::PathBuf],
    record_bytes: u64,
    queue_depth: usize,
    reads: usize,
) -> Option<Value> {
    if !fio_available() || files.is_empty() {
        return None;
    }
    let names: Vec<&str> = files.iter().filter_map(|p| p.to_str()).collect();
    if names.len() != files.len() || names.iter().any(|n| n.contains(':') || n.chars().any(char::is_whitespace)) {
        return None;
    }
    // O_DIRECT wants whole 4096-byte blocks.
    let bs = record_bytes.div_ceil(4096) * 4096;
    let mut args = vec![
        "--name=records".to_string(),
        format!("--filename={}", names.join(":")),
        "--rw=randread".into(),
        format!("--bs={bs}"),
        "--ioengine=io_uring".into(),
        format!("--iodepth={}", queue_depth.max(1)),
        "--direct=1".into(),
        "--file_service_type=random".into(),
        "--randrepeat=0".into(),
        format!("--number_ios={}", reads.max(1)),
        "--output-format=json".into(),
    ];
    match fio_registered(&mut args, true) {
        Ok(mut v) => {
            v["queue_depth"] = json!(queue_depth.max(1));
            v["record_bytes"] = json!(bs);
            Some(v)
        }
        Err(e) => {
            eprintln!("warning: fio's random-record read failed: {e:#}");
            None
        }
    }
}

/// fio with its buffers registered with io_uring (`--fixedbufs`: pinned once, not per read)
/// where `io_uring` says the engine is io_uring: the drive's rate without the pinning of 4 KiB
/// pages that holds unregistered O_DIRECT reads of large records below it (BENCHMARKS.md
/// section 14: 1.8-2.0 GB/s against 3.0-3.8 on the same reads). Where registering is refused
/// (a locked-memory limit), fio runs without it and the result says so (`fixedbufs`).
fn fio_registered(args: &mut Vec<String>, io_uring: bool) -> Result<Value> {
    if io_uring {
        args.push("--fixedbufs".into());
        match fio(args) {
            Ok(mut v) => {
                v["fixedbufs"] = json!(true);
                return Ok(v);
            }
            Err(e) => {
                eprintln!("note: fio with registered buffers failed ({e:#}); reading without them");
                args.pop();
            }
        }
    }
    let mut v = fio(args)?;
    v["fixedbufs"] = json!(false);
    Ok(v)
}

/// Run fio with `args` and read its one job's reads: bytes over its runtime.
fn fio(args: &[String]) -> Result<Value> {
    let out = Command::new("fio").args(args).output().context("spawning fio")?;
    if !out.status.success() {
        bail!("fio failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    parse_fio(&String::from_utf8_lossy(&out.stdout))
}

/// fio's JSON output (after any notes it prints first) to `{tool, gbps, bytes, seconds, reads}`.
fn parse_fio(stdout: &str) -> Result<Value> {
    let start = stdout.find('{').context("fio printed no JSON")?;
    let v: Value = serde_json::from_str(&stdout[start..]).context("parsing fio's JSON")?;
    let read = &v["jobs"][0]["read"];
    let bytes = read["io_bytes"].as_f64().context("fio's JSON has no read io_bytes")?;
    let ms = read["runtime"].as_f64().context("fio's JSON has no read runtime")?;
    let ios = read["total_ios"].as_u64().context("fio's JSON has no read total_ios")?;
    // A replay shorter than its queue depth can report 0 bytes though it read (see
    // `fio_replay_rate`): what says it read nothing is its count of reads.
    if ios == 0 || ms <= 0.0 {
        bail!("fio read nothing ({ios} reads in {ms} ms)");
    }
    let seconds = ms / 1e3;
    Ok(json!({
        "tool": "fio",
        "fio_version": v["fio version"],
        "gbps": bytes / seconds / 1e9,
        "bytes": bytes,
        "seconds": seconds,
        "reads": ios,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fio_json_is_read_after_its_notes_and_refused_when_empty() {
        let out = r#"note: both iodepth >= 1 and synchronous I/O engine are selected
{"fio version": "fio-3.33", "jobs": [{"jobname": "replay", "read": {"io_bytes": 2000000000, "runtime": 1000, "total_ios": 114}}]}"#;
        let v = parse_fio(out).unwrap();
        assert_eq!(v["tool"], "fio");
        assert!((v["gbps"].as_f64().unwrap() - 2.0).abs() < 1e-9);
        assert_eq!(v["reads"], 114);
        assert!(parse_fio(r#"{"jobs": [{"read": {"io_bytes": 0, "runtime": 0}}]}"#).is_err());
        assert!(parse_fio(r#"{"jobs": [{"read": {"io_bytes": 0, "runtime": 5, "total_ios": 0}}]}"#).is_err());
        assert!(parse_fio("fio: no JSON").is_err());
    }

    /// fio's replay leaves its last in-flight reads out of `io_bytes`; the rate is the log's
    /// bytes over fio's runtime, and a replay that skipped reads is refused.
    #[test]
    fn a_fio_replay_counts_every_logged_byte() {
        let out = r#"{"fio version": "fio-3.33", "jobs": [{"read": {"io_bytes": 1500000000, "runtime": 1000, "total_ios": 4}}]}"#;
        let v = fio_replay_rate(parse_fio(out).unwrap(), 4, 2_000_000_000).unwrap();
        assert!((v["gbps"].as_f64().unwrap() - 2.0).abs() < 1e-9);
        assert_eq!(v["bytes"], 2_000_000_000u64);
        assert_eq!(v["fio_io_bytes"], 1_500_000_000.0);
        assert!(fio_replay_rate(parse_fio(out).unwrap(), 5, 2_000_000_000).is_err());
        // A log no longer than the queue depth: every read was still in flight at its end.
        let short = r#"{"jobs": [{"read": {"io_bytes": 0, "runtime": 2, "total_ios": 3}}]}"#;
        let v = fio_replay_rate(parse_fio(short).unwrap(), 3, 6_000_000).unwrap();
        assert!((v["gbps"].as_f64().unwrap() - 3.0).abs() < 1e-9);
    }
}
