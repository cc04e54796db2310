//! `deltafin bench`: decode speed paired with the physical limit measured in the same run.
//!
//! Each run is a fresh process (`deltafin generate --json`), and each is preceded by a raw
//! O_DIRECT read probe of the same store at the same record size and queue depth, so a result is
//! a ratio to what this drive delivered at that moment. Medians and ranges, never a best-of.

use std::process::Command;

use anyhow::{Context, Result, bail};
use deltafin_engine::plan::human;
use deltafin_engine::stream::probe::raw_read_bandwidth;
use deltafin_store::Store;
use serde_json::{Value, json};

use crate::run::ModelArgs;

#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Runs, each in a fresh process.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Prompt token ids (default: 5 fixed ids).
    #[arg(long, value_delimiter = ',')]
    pub prompt_tokens: Option<Vec<u32>>,
    /// Tokens to generate per run (the first decode step is excluded from the steady rate).
    #[arg(long, default_value_t = 5)]
    pub max_tokens: usize,
    /// Warm cache: generate once in the process first, then measure a second generation.
    #[arg(long)]
    pub warm: bool,
    /// Replace routing with a synthetic pattern of this locality (see generate).
    #[arg(long)]
    pub routing_locality: Option<f64>,
    /// Records read by each raw-bandwidth probe.
    #[arg(long, default_value_t = 256)]
    pub probe_reads: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args)]
pub struct ProbeArgs {
    #[arg(long)]
    pub model: std::path::PathBuf,
    #[arg(long, default_value = "auto")]
    pub io_backend: String,
    #[arg(long, default_value_t = 16)]
    pub queue_depth: usize,
    #[arg(long, default_value_t = 256)]
    pub reads: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Issue reads in groups of --queue-depth and wait for each whole group.
    #[arg(long)]
    pub batched: bool,
}

pub fn probe(a: ProbeArgs) -> Result<()> {
    let store = Store::open(&a.model, None)?;
    let backend = match a.io_backend.as_str() {
        "auto" => None,
        o => Some(o.parse().map_err(|e: String| anyhow::anyhow!(e))?),
    };
    let r = raw_read_bandwidth(&store, backend, a.queue_depth, a.reads, a.seed, a.batched)?;
    println!("{}", serde_json::to_string(&r)?);
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

fn stat(vals: &[f64]) -> Value {
    let mut v = vals.to_vec();
    let med = median(&mut v);
    json!({ "median": med, "min": v.first(), "max": v.last() })
}

fn run_self(args: &[String]) -> Result<Value> {
    let exe = std::env::current_exe().context("locating the deltafin binary")?;
    let out = Command::new(exe).args(args).output().context("spawning a benchmark run")?;
    if !out.status.success() {
        bail!("benchmark run failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    serde_json::from_slice(&out.stdout).context("parsing a benchmark run's JSON")
}

fn machine() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|t| {
        t.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
    });
    let mem = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| {
        t.lines().next().map(|l| l.split_whitespace().nth(1).unwrap_or("0").parse::<u64>().unwrap_or(0) * 1024)
    });
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").ok().map(|s| s.trim().to_string());
    json!({
        "cpu": cpu,
        "cores": std::thread::available_parallelism().map(|n| n.get()).ok(),
        "ram_bytes": mem,
        "kernel": kernel,
    })
}

fn storage(path: &std::path::Path) -> Value {
    let out = Command::new("df").arg("-B1").arg("--output=source,size,avail").arg(path).output().ok();
    let line = out.and_then(|o| String::from_utf8(o.stdout).ok()).and_then(|s| s.lines().nth(1).map(str::to_string));
    let f: Vec<String> = line.map(|l| l.split_whitespace().map(str::to_string).collect()).unwrap_or_default();
    json!({ "device": f.first(), "size_bytes": f.get(1).and_then(|v| v.parse::<u64>().ok()), "free_bytes": f.get(2).and_then(|v| v.parse::<u64>().ok()) })
}

fn git_commit() -> Option<String> {
    let o = Command::new("git").args(["rev-parse", "--short", "HEAD"]).output().ok()?;
    o.status.success().then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

pub fn bench(a: BenchArgs) -> Result<()> {
    if a.runs == 0 {
        bail!("--runs must be at least 1");
    }
    if a.max_tokens < 3 {
        bail!("--max-tokens must be at least 3 (the first decode step is excluded from the steady rate)");
    }
    let m = &a.model;
    let prompt = a.prompt_tokens.clone().unwrap_or_else(|| vec![11, 22, 33, 44, 55]);
    let prompt_s = prompt.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",");
    let mut gen_args: Vec<String> = vec![
        "generate".into(),
        "--json".into(),
        "--ignore-eos".into(),
        "--model".into(),
        m.model.display().to_string(),
        "--prompt-tokens".into(),
        prompt_s.clone(),
        "--max-tokens".into(),
        a.max_tokens.to_string(),
        "--io-backend".into(),
        m.io_backend.clone(),
        "--queue-depth".into(),
        m.queue_depth.to_string(),
        "--context".into(),
        m.context.to_string(),
        "--cache-policy".into(),
        format!("{:?}", m.cache_policy).to_lowercase(),
    ];
    if let Some(b) = m.memory_budget {
        gen_args.extend(["--memory-budget".into(), b.to_string()]);
    }
    if let Some(k) = m.experts_per_token {
        gen_args.extend(["--experts-per-token".into(), k.to_string()]);
    }
    if let Some(src) = &m.source {
        gen_args.extend(["--source".into(), src.display().to_string()]);
    }
    if let Some(p) = a.routing_locality {
        gen_args.extend(["--routing-locality".into(), p.to_string()]);
    }
    if m.no_prefetch {
        gen_args.push("--no-prefetch".into());
    }
    if m.buffered {
        gen_args.push("--buffered".into());
    }
    if a.warm {
        gen_args.extend(["--repeat".into(), "2".into()]);
    }
    let store = Store::open(&m.model, m.source.as_deref())?;
    let k = m.experts_per_token.unwrap_or(store.manifest.config.num_experts_per_token);
    let probe_args: Vec<String> = vec![
        "probe-disk".into(),
        "--model".into(),
        m.model.display().to_string(),
        "--io-backend".into(),
        m.io_backend.clone(),
        "--queue-depth".into(),
        k.to_string(),
        "--reads".into(),
        a.probe_reads.to_string(),
    ];

    let mut runs = Vec::new();
    let mut raw_batched = Vec::new();
    let (mut raw, mut spt, mut ttft, mut bpt, mut hit, mut ach, mut frac, mut floor, mut rss, mut iow) =
        (vec![], vec![], vec![], vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
    for i in 0..a.runs {
        // Alternate probe and run so drift affects both alike.
        let mut pa = probe_args.clone();
        pa.extend(["--seed".into(), (i + 1).to_string()]);
        let p = run_self(&pa)?;
        pa.push("--batched".into());
        let pb = run_self(&pa)?;
        raw_batched.push(pb["gbps"].as_f64().unwrap_or(f64::NAN));
        let g = run_self(&gen_args)?;
        let raw_gbps = p["gbps"].as_f64().unwrap_or(f64::NAN);
        let steps: Vec<f64> = g["timing"]["decode_step_s"]
            .as_array()
            .map(|v| v.iter().filter_map(|x| x.as_f64()).collect())
            .unwrap_or_default();
        let bytes: Vec<f64> = g["timing"]["decode_step_bytes"]
            .as_array()
            .map(|v| v.iter().filter_map(|x| x.as_f64()).collect())
            .unwrap_or_default();
        // Steady state: drop the first decode step.
        let s_steps = &steps[1.min(steps.len())..];
        let s_bytes = &bytes[1.min(bytes.len())..];
        let s_per_token = s_steps.iter().sum::<f64>() / s_steps.len().max(1) as f64;
        let bytes_per_token = s_bytes.iter().sum::<f64>() / s_bytes.len().max(1) as f64;
        let achieved = bytes_per_token / s_per_token / 1e9;
        let total_s = g["timing"]["total_s"].as_f64().unwrap_or(f64::NAN);
        let io_wait = g["stream"]["io_wait_s"].as_f64().unwrap_or(f64::NAN);
        raw.push(raw_gbps);
        spt.push(s_per_token);
        ttft.push(g["timing"]["ttft_s"].as_f64().unwrap_or(f64::NAN));
        bpt.push(bytes_per_token);
        hit.push(g["stream"]["hit_rate"].as_f64().unwrap_or(f64::NAN));
        ach.push(achieved);
        frac.push(achieved / raw_gbps);
        floor.push(bytes_per_token / (raw_gbps * 1e9));
        rss.push(g["peak_rss_bytes"].as_f64().unwrap_or(f64::NAN));
        iow.push(io_wait / total_s);
        eprintln!(
            "run {}/{}: raw {:.2} GB/s (batched {:.2}); {:.3} s/token, {} per token, achieved {:.2} GB/s ({:.0}% of raw), hit rate {:.1}%, peak RSS {}",
            i + 1,
            a.runs,
            raw_gbps,
            raw_batched.last().copied().unwrap_or(f64::NAN),
            s_per_token,
            human(bytes_per_token as u64),
            achieved,
            100.0 * achieved / raw_gbps,
            100.0 * hit.last().copied().unwrap_or(0.0),
            human(rss.last().copied().unwrap_or(0.0) as u64)
        );
        runs.push(json!({ "probe": p, "probe_batched": pb, "run": g }));
    }
    let med = |v: &[f64]| median(&mut v.to_vec());
    let first = &runs[0]["run"];
    let out = json!({
        "s_per_token": med(&spt),
        "tokens_per_s": 1.0 / med(&spt),
        "ttft_s": med(&ttft),
        "expert_bytes_per_token": med(&bpt),
        "spine_bytes_per_token": 0,
        "hit_rate": med(&hit),
        "achieved_gbps": med(&ach),
        "raw_gbps": med(&raw),
        "raw_batched_gbps": med(&raw_batched),
        "bandwidth_fraction_of_batched": med(&ach) / med(&raw_batched),
        "bandwidth_fraction": med(&frac),
        "floor_s_per_token": med(&floor),
        "decode_vs_floor": med(&spt) / med(&floor),
        "io_wait_fraction": med(&iow),
        "peak_rss_bytes": med(&rss),
        "memory_budget_bytes": first["memory_budget_bytes"],
        "runs": a.runs,
        "ranges": {
            "s_per_token": stat(&spt), "raw_gbps": stat(&raw), "achieved_gbps": stat(&ach),
            "bandwidth_fraction": stat(&frac), "hit_rate": stat(&hit), "raw_batched_gbps": stat(&raw_batched), "peak_rss_bytes": stat(&rss),
        },
        "cache": if a.warm { "warm (second generation in the same process)" } else { "cold (fresh process, O_DIRECT, empty expert cache)" },
        "prompt_tokens": prompt,
        "generated_tokens": a.max_tokens,
        "model": first["model"],
        "experts_per_token": first["experts_per_token"],
        "modified_top_k": first["modified_top_k"],
        "numerics": first["numerics"],
        "kernel_path": first["kernel_path"],
        "io_backend": first["stream"]["io_backend"],
        "o_direct": first["stream"]["o_direct"],
        "prefetch": first["stream"]["prefetch"],
        "prefetch_precision": first["stream"]["prefetch_precision"],
        "prefetch_recall": first["stream"]["prefetch_recall"],
        "plan": first["plan"],
        "machine": machine(),
        "storage": storage(&m.model),
        "git_commit": git_commit(),
        "build_profile": if cfg!(debug_assertions) { "debug" } else { "release" },
    });
    if a.json {
        println!("{out}");
    } else {
        if out["modified_top_k"].as_bool() == Some(true) {
            println!("NOTE: {} -- not comparable with default-k figures", out["model"].as_str().unwrap_or(""));
        }
        println!(
            "{} runs, {}: {:.3} s/token median ({:.3}-{:.3}), {:.4} tokens/s; TTFT {:.3} s",
            a.runs,
            out["cache"].as_str().unwrap_or(""),
            med(&spt),
            stat(&spt)["min"].as_f64().unwrap_or(0.0),
            stat(&spt)["max"].as_f64().unwrap_or(0.0),
            1.0 / med(&spt),
            med(&ttft)
        );
        println!(
            "expert reads {} per token, hit rate {:.1}%; achieved {:.2} GB/s vs raw {:.2} GB/s = {:.0}% (raw in layer-sized batches {:.2} GB/s); floor {:.3} s/token, decode/floor {:.2}; I/O wait {:.0}% of the run; peak RSS {} of budget {}",
            human(med(&bpt) as u64),
            100.0 * med(&hit),
            med(&ach),
            med(&raw),
            100.0 * med(&frac),
            med(&raw_batched),
            med(&floor),
            med(&spt) / med(&floor),
            100.0 * med(&iow),
            human(med(&rss) as u64),
            human(first["memory_budget_bytes"].as_u64().unwrap_or(0)),
        );
    }
    Ok(())
}
