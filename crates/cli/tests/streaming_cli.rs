//! The streaming commands end to end: memory plan and budget, traces and their statistics, the
//! experts-per-token label, synth at Kimi K3's real record geometry, and bench's report.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_deltafin")).args(args).output().expect("spawn deltafin")
}

fn ok(args: &[&str]) -> (String, String) {
    let o = run(args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "deltafin {args:?} failed: {err}");
    (String::from_utf8(o.stdout).unwrap(), err)
}

fn fixture_hf(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name).join("hf")
}

fn tiny_store() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    ok(&["convert", "--from", fixture_hf("k3-tiny").to_str().unwrap(), "--to", d.path().to_str().unwrap()]);
    d
}

#[test]
fn plan_is_printed_and_a_too_small_budget_is_refused() {
    let d = tiny_store();
    let s = d.path().to_str().unwrap();
    let (_, err) =
        ok(&["generate", "--model", s, "--prompt-tokens", "1,2", "--max-tokens", "2", "--memory-budget", "1G"]);
    assert!(err.contains("memory plan") && err.contains("spine") && err.contains("expert cache"), "{err}");
    let o = run(&["generate", "--model", s, "--prompt-tokens", "1,2", "--memory-budget", "1M"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("below the minimum") && !err.contains("panicked"), "{err}");
    let o = run(&["generate", "--model", s, "--prompt-tokens", "1,2", "--memory-budget", "lots"]);
    assert!(!o.status.success());
}

#[test]
fn trace_records_routing_and_stats_replays_it() {
    let d = tiny_store();
    let s = d.path().to_str().unwrap();
    let trace = d.path().join("t.jsonl");
    let (out, _) = ok(&[
        "generate",
        "--model",
        s,
        "--prompt-tokens",
        "1,2,3,4,5",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--json",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(&trace).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    // Header + one line per forward pass (5 prompt tokens + 5 decode steps).
    assert_eq!(lines.len(), 1 + 5 + 5);
    assert_eq!(lines[0]["experts_per_token"], 4);
    let moe_layers = lines[0]["moe_layers"].as_array().unwrap().len();
    for l in &lines[1..] {
        let layers = l["layers"].as_array().unwrap();
        assert_eq!(layers.len(), moe_layers);
        for ly in layers {
            assert_eq!(ly["experts"].as_array().unwrap().len(), 4);
            let w: f64 = ly["weights"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).sum();
            assert!((w - 1.0).abs() < 1e-4, "renormalised weights sum to 1 (scaling 1.0)");
        }
    }
    assert_eq!(lines[6]["token"], v["tokens"][0], "the first generated token is fed back next");
    let (stats, _) = ok(&["trace", "stats", trace.to_str().unwrap(), trace.to_str().unwrap()]);
    assert!(stats.contains("20 tokens"), "{stats}");
    assert!(stats.contains("hit rate by cache slots per layer"), "{stats}");
    assert!(stats.contains("look-ahead predictor recall") && stats.contains('%'), "{stats}");
    // A full-size cache hits on everything but first uses.
    assert!(stats.lines().any(|l| l.trim_start().starts_with("16 ")), "{stats}");
    let bad = d.path().join("bad.jsonl");
    std::fs::write(&bad, "not a trace\n").unwrap();
    let o = run(&["trace", "stats", bad.to_str().unwrap()]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("trace header"));
}

#[test]
fn fewer_experts_per_token_is_labelled_everywhere() {
    let d = tiny_store();
    let s = d.path().to_str().unwrap();
    let (out, err) = ok(&[
        "generate",
        "--model",
        s,
        "--prompt-tokens",
        "1,2",
        "--max-tokens",
        "2",
        "--json",
        "--experts-per-token",
        "2",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["modified_top_k"], true);
    assert_eq!(v["experts_per_token"], 2);
    assert!(v["model"].as_str().unwrap().contains("different model"));
    assert!(err.contains("different model"));
    let (out, _) = ok(&["logits", "--model", s, "--prompt-tokens", "1,2", "--experts-per-token", "2"]);
    assert!(out.contains("different model"));
    let (out, _) = ok(&["generate", "--model", s, "--prompt-tokens", "1,2", "--max-tokens", "2", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["modified_top_k"], false);
    let o = run(&["generate", "--model", s, "--prompt-tokens", "1", "--experts-per-token", "99"]);
    assert!(!o.status.success());
}

#[test]
fn approximate_mode_is_labelled_everywhere() {
    let d = tiny_store();
    let s = d.path().to_str().unwrap();
    let (out, err) =
        ok(&["generate", "--model", s, "--prompt-tokens", "1,2", "--max-tokens", "2", "--json", "--approx"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["approximate"], true);
    assert!(v["numerics"].as_str().unwrap().starts_with("approximate"));
    assert!(err.contains("APPROXIMATE"), "{err}");
    let (out, _) = ok(&["logits", "--model", s, "--prompt-tokens", "1,2", "--approx"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["approximate"], true);
    let (out, _) = ok(&["generate", "--model", s, "--prompt-tokens", "1,2", "--max-tokens", "2", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["approximate"], false);
    assert_eq!(v["numerics"], "exact");
}

#[test]
fn synth_has_k3_geometry_and_runs_within_its_budget() {
    let d = tempfile::tempdir().unwrap();
    let s = d.path().join("syn");
    let s = s.to_str().unwrap();
    ok(&["synth", "--preset", "kimi-k3", "--layers", "1", "--experts", "20", "--out", s]);
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(Path::new(s).join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["experts"]["record_bytes"], 17_547_264, "one K3 expert record");
    assert_eq!(m["config"]["hidden_size"], 7168);
    assert_eq!(m["config"]["routed_expert_hidden_size"], 3584);
    assert_eq!(m["config"]["num_experts_per_token"], 16);
    let budget: u64 = 1 << 30;
    let (out, _) = ok(&[
        "generate",
        "--model",
        s,
        "--prompt-tokens",
        "1,2",
        "--max-tokens",
        "2",
        "--json",
        "--memory-budget",
        "1G",
        "--io-backend",
        "pread",
        // With prefetch's buffers the 1 GiB plan cannot cache all 20 experts, so reads stream
        // (prefetch is off by default since the demo model's trace replay).
        "--prefetch",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rss = v["peak_rss_bytes"].as_u64().unwrap();
    assert!(rss as f64 <= budget as f64 * 1.05, "peak RSS {rss} exceeds the 1 GiB budget by more than 5%");
    assert_eq!(v["stream"]["io_backend"], "pread");
    assert!(v["plan"]["cache_slots_per_layer"].as_u64().unwrap() < 20, "the budget cannot hold every expert");
    let o = run(&["synth", "--layers", "1", "--experts", "4", "--out", s]);
    assert!(!o.status.success());
}

#[test]
fn bench_reports_the_paired_limit() {
    let d = tiny_store();
    let s = d.path().to_str().unwrap();
    let (out, _) = ok(&["bench", "--model", s, "--runs", "2", "--max-tokens", "4", "--probe-reads", "16", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    for key in [
        "s_per_token",
        "tokens_per_s",
        "ttft_s",
        "expert_bytes_per_token",
        "spine_bytes_per_token",
        "hit_rate",
        "achieved_gbps",
        "raw_gbps",
        "bandwidth_fraction",
        "floor_s_per_token",
        "peak_rss_bytes",
        "memory_budget_bytes",
        "runs",
    ] {
        assert!(!v[key].is_null(), "bench JSON lacks {key}: {v}");
    }
    assert_eq!(v["runs"], 2);
    assert!(v["raw_gbps"].as_f64().unwrap() > 0.0);
    assert!(v["s_per_token"].as_f64().unwrap() > 0.0);
}

/// The disk floor is the drive's rate for the run's own reads: the replay reads exactly the bytes
/// the run read (experts and streamed spine), fio does it where `scripts/test.sh` installed it
/// (`DELTAFIN_REQUIRE_FIO=1`), and the floor's disk side is the run's bytes per token at that
/// rate.
#[test]
fn the_disk_floor_is_a_replay_of_the_runs_own_reads() {
    let d = tiny_store();
    let s = d.path().to_str().unwrap();
    let (out, _) = ok(&["bench", "--model", s, "--runs", "1", "--max-tokens", "4", "--probe-reads", "16", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let run = &v["per_run"][0];
    let read = run["run"]["stream"]["expert_bytes_read"].as_f64().unwrap()
        + run["run"]["spine"]["bytes_read"].as_f64().unwrap_or(0.0);
    assert!(read > 0.0, "{v}");
    let replay = &run["replay"];
    assert_eq!(replay["logged_bytes"].as_f64(), Some(read), "the read log holds other bytes than the run read: {v}");
    assert_eq!(replay["reads"], replay["logged_reads"], "the replay skipped reads of the log: {v}");
    let replayed = replay["bytes"].as_f64().unwrap();
    assert!(replayed > 0.0 && replayed <= read, "replayed {replayed} of {read} bytes");
    if replay["tool"] == "fio" {
        // fio completed every logged read (checked above), so it moved every logged byte.
        assert_eq!(replayed, read, "{v}");
        // Whether its buffers were registered (pinned once) is said, either way.
        assert!(replay["fixedbufs"].is_boolean(), "{v}");
    }
    let fio = std::env::var("DELTAFIN_REQUIRE_FIO").is_ok_and(|x| x == "1");
    let tool = v["replay_tool"].as_str().unwrap();
    assert!(if fio { tool == "fio" } else { tool == "fio" || tool == "deltafin" }, "replay by {tool}");
    let gbps = v["replay_gbps"].as_f64().unwrap();
    assert!(gbps > 0.0, "{v}");
    let per_token = v["expert_bytes_per_token"].as_f64().unwrap() + v["spine_bytes_per_token"].as_f64().unwrap();
    let disk = v["floor_disk_s_per_token"].as_f64().unwrap();
    assert!((disk - per_token / (gbps * 1e9)).abs() <= 1e-9 * disk.max(1e-9), "disk floor {disk} is not the replay's");
    if fio {
        assert!(v["fio_random_records_gbps"].as_f64().unwrap() > 0.0, "{v}");
    }
}

/// A warm run reports its measured generation alone: the same greedy generation again, with
/// every expert it touches cached by the first, is all cache hits and reads nothing (the
/// counters once mixed in the first generation's reads: a hit rate of ~0.8 with 0 bytes read).
#[test]
fn a_warm_run_counts_its_own_generation() {
    let d = tiny_store();
    let s = d.path().to_str().unwrap();
    let args = ["bench", "--model", s, "--runs", "1", "--max-tokens", "4", "--probe-reads", "16", "--json"];
    let (out, _) = ok(&[&args[..], &["--warm"]].concat());
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["hit_rate"].as_f64(), Some(1.0), "{v}");
    assert_eq!(v["expert_bytes_per_token"].as_f64(), Some(0.0), "{v}");
    // A cold run of the same reads every expert it uses once: fewer hits than accesses.
    let (out, _) = ok(&args);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["hit_rate"].as_f64().unwrap() < 1.0, "{v}");
}
