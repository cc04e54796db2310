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

use crate::run::{Device, ModelArgs};

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Benchmark the compute kernels against the memory and FMA roofs instead of a model.
    #[arg(long)]
    pub kernels: bool,
    /// Seconds per kernel measurement (with --kernels).
    #[arg(long, default_value_t = 0.5)]
    pub kernel_seconds: f64,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Runs, each in a fresh process.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Prompt token ids (default: 5 fixed ids).
    #[arg(long, value_delimiter = ',', conflicts_with = "prompt_length")]
    pub prompt_tokens: Option<Vec<u32>>,
    /// A prompt of this many tokens (fixed pseudo-random ids), for time-to-first-token figures
    /// against their floor.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub prompt_length: Option<u64>,
    /// Decode at a long context without timing its prompt: every MLA layer's latent cache starts
    /// with this many synthetic positions (see generate --context-fill). The floors count the
    /// attention over them.
    #[arg(long, default_value_t = 0, value_name = "TOKENS")]
    pub context_fill: usize,
    /// Tokens to generate per run (the first decode step is excluded from the steady rate).
    #[arg(long, default_value_t = 5)]
    pub max_tokens: usize,
    /// Warm cache: generate once in the process first, then measure a second generation.
    #[arg(long)]
    pub warm: bool,
    /// Replace routing with a synthetic pattern of this locality (see generate).
    #[arg(long)]
    pub routing_locality: Option<f64>,
    /// Replay a recorded router trace (its picks and look-ahead predictions; see generate).
    #[arg(long, conflicts_with = "routing_locality")]
    pub routing_trace: Option<std::path::PathBuf>,
    /// Records read by each raw-bandwidth probe.
    #[arg(long, default_value_t = 256)]
    pub probe_reads: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Interleave configurations differing in one option, e.g. `io-backend=io-uring,pread`,
    /// `cache-policy=lru,slru`, `prefetch=on,off`, `memory-budget=2G,8G`.
    #[arg(long)]
    pub vary: Option<String>,
    /// Continuous batching: interleave configurations of N sequences decoding together (e.g.
    /// `1,2,4,8`), each with its own prompt; reports aggregate tokens/s, per-sequence s/token,
    /// bytes read per generated token and the experts a step shares, beside one stream's figures.
    #[arg(long, value_delimiter = ',', value_name = "N,N,...", conflicts_with_all = ["vary", "warm", "routing_trace", "routing_locality"])]
    pub streams: Option<Vec<u64>>,
    /// With --streams: a new sequence with a prompt of this many tokens joins each run once its
    /// streams have decoded; reports the longest pause it causes them.
    #[arg(long, value_name = "TOKENS", requires = "streams")]
    pub join_prompt: Option<usize>,
}

#[derive(clap::Args)]
pub struct ProbeArgs {
    #[arg(long, required_unless_present = "replay")]
    pub model: Option<std::path::PathBuf>,
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
    /// Replay this read log (a fio iolog written by `generate --read-log`) instead of random
    /// records: the same reads in order, --queue-depth in flight.
    #[arg(long, value_name = "FILE")]
    pub replay: Option<std::path::PathBuf>,
}

pub fn probe(a: ProbeArgs) -> Result<()> {
    let backend = match a.io_backend.as_str() {
        "auto" => None,
        o => Some(o.parse().map_err(|e: String| anyhow::anyhow!(e))?),
    };
    if let Some(log) = &a.replay {
        let reads = deltafin_engine::stream::replay::read_iolog(log)?;
        let r = deltafin_engine::stream::replay::replay(&reads, backend, a.queue_depth)?;
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    let Some(model) = &a.model else { bail!("probe-disk needs --model (or --replay)") };
    let store = Store::open(model, None)?;
    let r = raw_read_bandwidth(&store, backend, a.queue_depth, a.reads, a.seed, a.batched)?;
    println!("{}", serde_json::to_string(&r)?);
    Ok(())
}

/// The median (NaN for none), sorting `v`.
pub(crate) fn median(v: &mut [f64]) -> f64 {
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
    serde_json::to_value(deltafin_engine::os::machine::describe()).unwrap_or(Value::Null)
}

fn storage(path: &std::path::Path) -> Value {
    let (device, size, free) = deltafin_engine::os::machine::storage(path);
    json!({ "device": device, "size_bytes": size, "free_bytes": free })
}

/// The commit the binary was built from (`build.rs`; `+dirty` with uncommitted changes), not
/// the checkout the bench was started in: an A/B run starts an older binary from a newer tree.
fn git_commit() -> Option<String> {
    option_env!("DELTAFIN_BUILD_COMMIT").map(str::to_string)
}

pub fn bench(a: BenchArgs) -> Result<()> {
    if a.kernels {
        return match a.model.device {
            Device::Cpu => crate::kernel_bench::kernel_bench(a.json, a.kernel_seconds),
            Device::Gpu | Device::Auto => {
                crate::gpu_kernel_bench::gpu_kernel_bench(a.json, a.kernel_seconds, a.model.gpu_adapter.clone())
            }
        };
    }
    let m = &a.model;
    let store_dir = m.store_path()?.to_path_buf();
    if a.runs == 0 {
        bail!("--runs must be at least 1");
    }
    if a.max_tokens < 3 {
        bail!("--max-tokens must be at least 3 (the first decode step is excluded from the steady rate)");
    }
    let store = Store::open(&store_dir, m.source.as_deref())?;
    let vocab = store.manifest.config.vocab_size.max(1) as u64;
    let prompt = match (&a.prompt_tokens, a.prompt_length) {
        (Some(ids), _) => ids.clone(),
        // Spread over the vocabulary, the same ids in every run.
        (None, Some(n)) => (0..n).map(|i| ((i * 7919 + 11) % vocab) as u32).collect(),
        (None, None) => vec![11, 22, 33, 44, 55],
    };
    let prompt_s = prompt.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",");
    // The context the runs need, at least --context: the latent cache is reserved for it.
    // With --streams, the streams decode on while a joining prompt goes through.
    let join_room = a.join_prompt.map_or(0, |l| l + 1);
    let context = m.context.max(a.context_fill + prompt.len() + a.max_tokens + join_room);
    let mut gen_args: Vec<String> = vec![
        "generate".into(),
        "--json".into(),
        "--ignore-eos".into(),
        "--threads".into(),
        deltafin_engine::threads().to_string(),
        "--model".into(),
        store_dir.display().to_string(),
        "--prompt-tokens".into(),
        prompt_s.clone(),
        "--max-tokens".into(),
        a.max_tokens.to_string(),
        "--io-backend".into(),
        m.io_backend.clone(),
        "--queue-depth".into(),
        m.queue_depth.to_string(),
        "--context".into(),
        context.to_string(),
        "--context-fill".into(),
        a.context_fill.to_string(),
        "--cache-policy".into(),
        format!("{:?}", m.cache_policy).to_lowercase(),
    ];
    if let Some(b) = m.memory_budget {
        gen_args.extend(["--memory-budget".into(), b.to_string()]);
    }
    if let Some(k) = m.experts_per_token {
        gen_args.extend(["--experts-per-token".into(), k.to_string()]);
    }
    if let Some(r) = m.resident_spine_layers {
        gen_args.extend(["--resident-spine-layers".into(), r.to_string()]);
    }
    if let Some(c) = m.prefill_chunk {
        gen_args.extend(["--prefill-chunk".into(), c.to_string()]);
    }
    if let Some(src) = &m.source {
        gen_args.extend(["--source".into(), src.display().to_string()]);
    }
    if let Some(p) = a.routing_locality {
        gen_args.extend(["--routing-locality".into(), p.to_string()]);
    }
    if let Some(t) = &a.routing_trace {
        gen_args.extend(["--routing-trace".into(), t.display().to_string()]);
    }
    if m.prefetch {
        gen_args.push("--prefetch".into());
    }
    if m.buffered {
        gen_args.push("--buffered".into());
    }
    if m.approx {
        gen_args.push("--approx".into());
    }
    if m.device != Device::Cpu {
        let name = if m.device == Device::Gpu { "gpu" } else { "auto" };
        gen_args.extend(["--device".into(), name.into()]);
        if let Some(name) = &m.gpu_adapter {
            gen_args.extend(["--gpu-adapter".into(), name.clone()]);
        }
        if let Some(b) = m.gpu_memory {
            gen_args.extend(["--gpu-memory".into(), b.to_string()]);
        }
    }
    if a.warm {
        gen_args.extend(["--repeat".into(), "2".into()]);
    }
    let k = m.experts_per_token.unwrap_or(store.manifest.config.num_experts_per_token);
    let probe_args: Vec<String> = vec![
        "probe-disk".into(),
        "--model".into(),
        store_dir.display().to_string(),
        "--io-backend".into(),
        m.io_backend.clone(),
        "--queue-depth".into(),
        k.to_string(),
        "--reads".into(),
        a.probe_reads.to_string(),
    ];

    // Configurations to interleave: the base one, or one per value of --vary.
    let configs: Vec<(String, Vec<String>)> = match &a.vary {
        None if a.streams.is_some() => {
            crate::bench_streams::configs(a.streams.as_deref().unwrap_or_default(), a.join_prompt)?
        }
        None => vec![("base".to_string(), Vec::new())],
        Some(spec) => {
            let (flag, values) = spec.split_once('=').ok_or_else(|| anyhow::anyhow!("--vary wants FLAG=V1,V2"))?;
            values
                .split(',')
                .map(|v| {
                    let extra = match (flag, v) {
                        ("prefetch", "on") => vec!["--prefetch".to_string()],
                        ("prefetch", "off") => vec!["--no-prefetch".to_string()],
                        ("prefetch", _) => bail!("--vary prefetch=on,off"),
                        // The default: the flag left out (e.g. prefill-chunk=32,auto).
                        (_, "auto") => vec![],
                        (f, v) => vec![format!("--{f}"), v.to_string()],
                    };
                    Ok((format!("{flag}={v}"), extra))
                })
                .collect::<Result<_>>()?
        }
    };
    let mut accs: Vec<Acc> = configs.iter().map(|_| Acc::default()).collect();
    // With --device gpu the compute floor counts the GPU's measured FMA rate beside the CPU's
    // (both may compute at once: their sum is the rate no run can beat).
    let gpu_options = deltafin_gpu::GpuOptions { allow_software: false, name: m.gpu_adapter.clone() };
    let gpu = match m.device {
        Device::Gpu => Some(deltafin_gpu::Gpu::open(&gpu_options).context("opening the GPU for its roof")?),
        // What the runs will find: the GPU's roof counts when one opens.
        Device::Auto if !m.approx => deltafin_gpu::Gpu::open(&gpu_options).ok(),
        Device::Auto => None,
        Device::Cpu => None,
    };
    // Each run's reads, for the replay that gives its disk floor.
    let logs = tempfile::tempdir().context("a directory for the runs' read logs")?;
    let fio = crate::drive_limit::fio_available();
    if !fio {
        eprintln!("note: fio is not installed: the disk floor is deltafin's own replay of each run's reads");
    }
    for i in 0..a.runs {
        // Interleave configurations (A B A B ...) and pair every run with fresh probes, so drift
        // affects all alike.
        for (c, (label, extra)) in configs.iter().enumerate() {
            let mut pa = probe_args.clone();
            pa.extend(["--seed".into(), (i * configs.len() + c + 1).to_string()]);
            let p = run_self(&pa)?;
            pa.push("--batched".into());
            let pb = run_self(&pa)?;
            let varied =
                format!("--{}", a.vary.as_deref().and_then(|v| v.split_once('=')).map(|(f, _)| f).unwrap_or(""));
            let mut ga = without_flag(&gen_args, extra.first().map(String::as_str).or(Some(varied.as_str())));
            ga.extend(extra.iter().cloned());
            let log = logs.path().join(format!("run-{i}-{c}.iolog"));
            ga.extend(["--read-log".into(), log.display().to_string()]);
            // The compute and memory roofs, for the floors: measured before and after the run,
            // the higher of each kept (a short probe can catch a slow moment of the host, and a
            // roof below what the machine does gives a floor the run beats).
            let before = roofs_now(gpu.as_ref(), m.approx)?;
            let g = run_self(&ga)?;
            let roofs = before.max(roofs_now(gpu.as_ref(), m.approx)?);
            // The drive's rate for exactly this run's reads, at its queue depth, right after it.
            // A run that streamed its spine had the spine loader's pieces in flight beside the
            // expert reads: the replay gets that depth too.
            let spine_streamed = g["spine"]["bytes_read"].as_u64().is_some_and(|b| b > 0);
            let depth =
                m.queue_depth + if spine_streamed { deltafin_engine::stream::spine::PIECES_IN_FLIGHT } else { 0 };
            let replay = crate::drive_limit::replay(&log, &m.io_backend, depth)?;
            let _ = std::fs::remove_file(&log);
            let records = crate::drive_limit::random_records(
                store.experts.paths(),
                store.manifest.experts.record_bytes,
                m.queue_depth,
                a.probe_reads,
            );
            let acc = &mut accs[c];
            acc.add(&p, &pb, &g, &replay, roofs);
            let peak_gflops = roofs.peak_gflops;
            let last = |v: &[f64]| v.last().copied().unwrap_or(f64::NAN);
            eprintln!(
                "run {}/{} [{label}]: replay of its reads ({}) {:.2} GB/s, raw {:.2} GB/s (batched {:.2}){}, memory {:.1} GB/s, {:.1} GFLOP/s; {:.3} s/token at a context of {} (floor {:.3}: disk {:.3}, memory {:.3}, compute {:.3}), {} per token, achieved {:.2} GB/s ({:.0}% of the replay), disk idle {:.1}% of a step, hit rate {:.1}%, peak RSS {}",
                i + 1,
                a.runs,
                replay["tool"].as_str().unwrap_or("?"),
                last(&acc.replay),
                last(&acc.raw),
                last(&acc.raw_batched),
                records
                    .as_ref()
                    .map(|r| format!(", fio random records {:.2} GB/s", r["gbps"].as_f64().unwrap_or(f64::NAN)))
                    .unwrap_or_default(),
                roofs.mem_gbps,
                roofs.peak_gflops,
                last(&acc.spt),
                a.context_fill + prompt.len(),
                last(&acc.floor),
                last(&acc.floor_disk),
                last(&acc.floor_memory),
                last(&acc.floor_compute),
                human(acc.bpt.last().copied().unwrap_or(0.0) as u64),
                acc.ach.last().copied().unwrap_or(f64::NAN),
                100.0 * last(&acc.ach) / last(&acc.replay),
                100.0 * last(&acc.idle),
                100.0 * acc.hit.last().copied().unwrap_or(0.0),
                human(acc.rss.last().copied().unwrap_or(0.0) as u64)
            );
            if a.prompt_length.is_some() {
                eprintln!(
                    "    prompt of {} tokens: TTFT {:.3} s, floor {:.3} s ({:.2}x): distinct experts {}, spine {}, {:.1} GFLOP at {:.1} GFLOP/s peak{}; {:.3} s in attention ({:.3} s of it in MLA layers, {:.3} s in the GPU's spine products), {:.3} s in feed-forward blocks",
                    prompt.len(),
                    acc.ttft.last().copied().unwrap_or(f64::NAN),
                    acc.ttft_floor.last().copied().unwrap_or(f64::NAN),
                    acc.ttft.last().copied().unwrap_or(f64::NAN) / acc.ttft_floor.last().copied().unwrap_or(f64::NAN),
                    human(acc.prefill_distinct.last().copied().unwrap_or(0.0) as u64),
                    human(acc.prefill_spine.last().copied().unwrap_or(0.0) as u64),
                    acc.prefill_flops.last().copied().unwrap_or(f64::NAN) / 1e9,
                    peak_gflops,
                    if last(&acc.prefill_integer_flops) > 0.0 {
                        format!(
                            " ({:.1} GFLOP of it in integers at {:.1} GOP/s)",
                            last(&acc.prefill_integer_flops) / 1e9,
                            last(&acc.int8_gops)
                        )
                    } else {
                        String::new()
                    },
                    last(&acc.prefill_attention_s),
                    last(&acc.prefill_mla_s),
                    last(&acc.prefill_attention_gpu_s),
                    last(&acc.prefill_ffn_s),
                );
            }
            acc.records.push(records.as_ref().and_then(|r| r["gbps"].as_f64()).unwrap_or(f64::NAN));
            acc.runs.push(json!({ "probe": p, "probe_batched": pb, "replay": replay, "fio_random_records": records, "peak_gflops": peak_gflops, "gpu_peak_gflops": roofs.gpu_gflops, "int8_peak_gops": roofs.int8_gops, "memory_gbps": roofs.mem_gbps, "run": g }));
        }
    }
    let mut summaries: Vec<Value> =
        configs.iter().zip(&accs).map(|((label, _), acc)| acc.summary(label, &a, &prompt, &store_dir)).collect();
    if let Some(streams) = &a.streams {
        for (s, &n) in summaries.iter_mut().zip(streams) {
            crate::bench_streams::per_generated_token(s, n);
        }
        crate::bench_streams::against_solo(&mut summaries);
        if a.json {
            println!("{}", json!({ "streams": streams, "join_prompt": a.join_prompt, "configs": summaries }));
        } else {
            crate::bench_streams::print_table(&summaries);
        }
        return Ok(());
    }
    if a.json {
        if summaries.len() == 1 {
            println!("{}", summaries[0]);
        } else {
            println!("{}", json!({ "vary": a.vary, "configs": summaries }));
        }
    } else {
        for out in &summaries {
            print_summary(out);
        }
    }
    Ok(())
}

/// `args` without `flag` and its value (so a varied option replaces the base one).
fn without_flag(args: &[String], flag: Option<&str>) -> Vec<String> {
    if matches!(flag, Some("--prefetch" | "--no-prefetch")) {
        // A switch without a value: the varied one replaces either spelling.
        return args.iter().filter(|a| !matches!(a.as_str(), "--prefetch" | "--no-prefetch")).cloned().collect();
    }
    let Some(flag) = flag else { return args.to_vec() };
    let mut out = Vec::with_capacity(args.len());
    let mut skip = false;
    for a in args {
        if skip {
            skip = false;
        } else if a == flag {
            skip = true;
        } else {
            out.push(a.clone());
        }
    }
    out
}

/// The compute and memory roofs measured just before a run, with the run's threads.
#[derive(Clone, Copy)]
struct Roofs {
    /// The CPU's FMA rate plus the GPU's where the run computes on one.
    peak_gflops: f64,
    /// The GPU's share of it (0 on the CPU).
    gpu_gflops: f64,
    /// The CPU's int8 dot-product rate (GOP/s) where approximate mode runs products in
    /// integers, else 0.
    int8_gops: f64,
    mem_gbps: f64,
}

impl Roofs {
    /// The higher of each roof.
    fn max(self, other: Roofs) -> Roofs {
        Roofs {
            peak_gflops: self.peak_gflops.max(other.peak_gflops),
            gpu_gflops: self.gpu_gflops.max(other.gpu_gflops),
            int8_gops: self.int8_gops.max(other.int8_gops),
            mem_gbps: self.mem_gbps.max(other.mem_gbps),
        }
    }
}

fn roofs_now(gpu: Option<&deltafin_gpu::Gpu>, integer: bool) -> Result<Roofs> {
    let threads = deltafin_engine::threads();
    // 256 MiB: far beyond any last-level cache, so the read comes from DRAM.
    let buf = vec![1u64; 32 << 20];
    let mem_gbps = deltafin_kernels::roofline::read_bandwidth_gbps(&buf, threads, 0.3);
    drop(buf);
    let gpu_gflops = match gpu {
        // As `bench --kernels --device gpu` measures it (a software adapter's in fewer rounds).
        Some(g) => deltafin_gpu::roofline::fma_peak_gflops(g, if g.is_software() { 32 } else { 4096 }, 0.3)
            .context("measuring the GPU's FMA rate")?,
        None => 0.0,
    };
    let cpu = deltafin_kernels::roofline::fma_peak_gflops(threads, 0.3);
    let int8_gops = if integer { deltafin_kernels::roofline::int8_peak_gops(threads, 0.3) } else { 0.0 };
    Ok(Roofs { peak_gflops: cpu + gpu_gflops, gpu_gflops, int8_gops, mem_gbps })
}

#[derive(Default)]
struct Acc {
    runs: Vec<Value>,
    raw: Vec<f64>,
    raw_batched: Vec<f64>,
    spt: Vec<f64>,
    ttft: Vec<f64>,
    bpt: Vec<f64>,
    spine_bpt: Vec<f64>,
    hit: Vec<f64>,
    ach: Vec<f64>,
    frac: Vec<f64>,
    /// Decode floor per token: the largest of its disk, memory and compute sides.
    floor: Vec<f64>,
    floor_disk: Vec<f64>,
    floor_memory: Vec<f64>,
    floor_compute: Vec<f64>,
    mem_gbps: Vec<f64>,
    decode_flops: Vec<f64>,
    decode_attention_flops: Vec<f64>,
    decode_bytes_touched: Vec<f64>,
    kv_bytes: Vec<f64>,
    prefill_attention_flops: Vec<f64>,
    /// Seconds of each run's prompt in attention and in the feed-forward blocks.
    prefill_attention_s: Vec<f64>,
    prefill_mla_s: Vec<f64>,
    prefill_attention_gpu_s: Vec<f64>,
    prefill_ffn_s: Vec<f64>,
    rss: Vec<f64>,
    iow: Vec<f64>,
    /// Time to first token and what bounds it: distinct expert bytes of the prompt, streamed
    /// spine bytes read, the prompt's FLOPs, and the floor from those and this run's roofs.
    ttft_floor: Vec<f64>,
    prefill_distinct: Vec<f64>,
    prefill_expert_read: Vec<f64>,
    prefill_spine: Vec<f64>,
    prefill_flops: Vec<f64>,
    prefill_integer_flops: Vec<f64>,
    peak_gflops: Vec<f64>,
    int8_gops: Vec<f64>,
    /// Per run: the disk's idle share of the steady decode steps (measured by the run).
    idle: Vec<f64>,
    /// Per run: the drive's rate for the run's own reads, replayed right after it (the disk
    /// limit every floor here uses), and fio's rate for random whole records (NaN without fio).
    replay: Vec<f64>,
    replay_tool: Vec<String>,
    records: Vec<f64>,
}

impl Acc {
    fn add(&mut self, p: &Value, pb: &Value, g: &Value, replay: &Value, roofs: Roofs) {
        let peak_gflops = roofs.peak_gflops;
        let raw_gbps = p["gbps"].as_f64().unwrap_or(f64::NAN);
        // The disk limit: the replay of the run's own reads (the random-record probe only if a
        // replay gave no rate).
        let replay_gbps = replay["gbps"].as_f64().unwrap_or(f64::NAN);
        let limit_gbps = if replay_gbps.is_finite() && replay_gbps > 0.0 { replay_gbps } else { raw_gbps };
        self.replay.push(replay_gbps);
        self.replay_tool.push(replay["tool"].as_str().unwrap_or("none").to_string());
        let list = |v: &Value| -> Vec<f64> {
            v.as_array().map(|v| v.iter().filter_map(|x| x.as_f64()).collect()).unwrap_or_default()
        };
        let steps = list(&g["timing"]["decode_step_s"]);
        let bytes = list(&g["timing"]["decode_step_bytes"]);
        // Steady state: drop the first decode step.
        let s_steps = &steps[1.min(steps.len())..];
        let s_bytes = &bytes[1.min(bytes.len())..];
        let s_per_token = s_steps.iter().sum::<f64>() / s_steps.len().max(1) as f64;
        let expert_bytes = s_bytes.iter().sum::<f64>() / s_bytes.len().max(1) as f64;
        // Streamed spine layers are read for every token too.
        let spine_bytes = g["plan"]["spine_bytes_per_token"].as_f64().unwrap_or(0.0);
        let bytes_per_token = expert_bytes + spine_bytes;
        let achieved = bytes_per_token / s_per_token / 1e9;
        let total_s = g["timing"]["total_s"].as_f64().unwrap_or(f64::NAN);
        self.raw.push(raw_gbps);
        self.raw_batched.push(pb["gbps"].as_f64().unwrap_or(f64::NAN));
        self.spt.push(s_per_token);
        self.ttft.push(g["timing"]["ttft_s"].as_f64().unwrap_or(f64::NAN));
        self.bpt.push(expert_bytes);
        self.spine_bpt.push(spine_bytes);
        self.hit.push(g["stream"]["hit_rate"].as_f64().unwrap_or(f64::NAN));
        self.ach.push(achieved);
        self.frac.push(achieved / raw_gbps);
        let dw = &g["timing"]["decode_work"];
        let num = |k: &str| dw[k].as_f64().unwrap_or(f64::NAN);
        let disk = bytes_per_token / (limit_gbps * 1e9);
        let memory = num("bytes_touched") / (roofs.mem_gbps * 1e9);
        let compute = num("flops") / (peak_gflops * 1e9);
        self.floor.push(disk.max(memory).max(compute));
        self.floor_disk.push(disk);
        self.floor_memory.push(memory);
        self.floor_compute.push(compute);
        self.mem_gbps.push(roofs.mem_gbps);
        self.decode_flops.push(num("flops"));
        self.decode_attention_flops.push(num("attention_flops"));
        self.decode_bytes_touched.push(num("bytes_touched"));
        self.kv_bytes.push(num("kv_bytes"));
        self.prefill_attention_flops.push(g["timing"]["prompt_attention_flops"].as_f64().unwrap_or(f64::NAN));
        self.rss.push(g["peak_rss_bytes"].as_f64().unwrap_or(f64::NAN));
        self.iow.push(g["stream"]["io_wait_s"].as_f64().unwrap_or(f64::NAN) / total_s);
        let pr = &g["timing"]["prompt"];
        let distinct =
            pr["distinct_experts"].as_f64().unwrap_or(0.0) * g["plan"]["record_bytes"].as_f64().unwrap_or(0.0);
        let flops = g["timing"]["prompt_flops"].as_f64().unwrap_or(f64::NAN);
        // Each streamed spine layer must be read at least once, whatever the chunking, and each
        // expert the prompt chose that was not in the cache yet: all of them from a cold start,
        // at most those read with a warm one (--warm).
        let expert_read = pr["expert_bytes_read"].as_f64().unwrap_or(f64::INFINITY);
        let io_floor = (distinct.min(expert_read) + spine_bytes) / (limit_gbps * 1e9);
        // Approximate mode's integer share at the integer roof, the rest at the FMA roof, one
        // after the other: the two share the vector units (on Zen 4 a loop of both takes the
        // sum of their times).
        let integer = g["timing"]["prompt_integer_flops"].as_f64().unwrap_or(0.0).min(flops);
        let compute_floor = if integer > 0.0 && roofs.int8_gops > 0.0 {
            (flops - integer) / (peak_gflops * 1e9) + integer / (roofs.int8_gops * 1e9)
        } else {
            flops / (peak_gflops * 1e9)
        };
        self.ttft_floor.push(io_floor.max(compute_floor));
        self.prefill_integer_flops.push(integer);
        self.int8_gops.push(roofs.int8_gops);
        self.prefill_distinct.push(distinct);
        self.prefill_expert_read.push(pr["expert_bytes_read"].as_f64().unwrap_or(f64::NAN));
        self.prefill_spine.push(pr["spine_bytes_read"].as_f64().unwrap_or(f64::NAN));
        self.prefill_flops.push(flops);
        self.prefill_attention_s.push(pr["attention_s"].as_f64().unwrap_or(f64::NAN));
        self.prefill_ffn_s.push(pr["ffn_s"].as_f64().unwrap_or(f64::NAN));
        self.prefill_mla_s.push(pr["mla_attention_s"].as_f64().unwrap_or(f64::NAN));
        self.prefill_attention_gpu_s.push(pr["attention_gpu_s"].as_f64().unwrap_or(f64::NAN));
        self.peak_gflops.push(peak_gflops);
        let idle = list(&g["timing"]["decode_step_disk_idle_s"]);
        let s_idle = &idle[1.min(idle.len())..];
        self.idle.push(s_idle.iter().sum::<f64>() / s_steps.iter().sum::<f64>().max(1e-12));
    }

    fn summary(&self, label: &str, a: &BenchArgs, prompt: &[u32], store: &std::path::Path) -> Value {
        let med = |v: &[f64]| median(&mut v.to_vec());
        let first = &self.runs[0]["run"];
        let prefill = json!({
            // The share of each steady decode step with no read of the run in flight.
            "disk_idle_fraction": med(&self.idle),
            "ttft_floor_s": med(&self.ttft_floor),
            "ttft_vs_floor": med(&self.ttft) / med(&self.ttft_floor),
            "prefill_tokens": prompt.len(),
            "prefill_chunk": first["timing"]["prompt"]["chunk"],
            "prefill_distinct_expert_bytes": med(&self.prefill_distinct),
            "prefill_expert_bytes_read": med(&self.prefill_expert_read),
            "prefill_spine_bytes": med(&self.prefill_spine),
            "prefill_flops": med(&self.prefill_flops),
            "prefill_integer_flops": med(&self.prefill_integer_flops),
            "int8_peak_gops": med(&self.int8_gops),
            "prefill_attention_flops": med(&self.prefill_attention_flops),
            "prefill_attention_s": med(&self.prefill_attention_s),
            "prefill_mla_attention_s": med(&self.prefill_mla_s),
            "prefill_attention_gpu_s": med(&self.prefill_attention_gpu_s),
            "prefill_ffn_s": med(&self.prefill_ffn_s),
            "peak_gflops": med(&self.peak_gflops),
        });
        // The disk limit: the run's own reads replayed right after it, and fio's random records.
        let disk = json!({
            "replay_gbps": med(&self.replay),
            "replay_tool": self.replay_tool.first(),
            "bandwidth_fraction_of_replay": med(&self.ach) / med(&self.replay),
            "fio_random_records_gbps": med(&self.records),
            "bandwidth_fraction_of_fio_records": med(&self.ach) / med(&self.records),
            "disk_limit": "the drive's rate for this run's own reads, replayed right after it at its queue depth (replay_tool)",
        });
        // The decode floor's three sides and the work they are made of.
        let decode = json!({
            "floor_disk_s_per_token": med(&self.floor_disk),
            "floor_memory_s_per_token": med(&self.floor_memory),
            "floor_compute_s_per_token": med(&self.floor_compute),
            "memory_gbps": med(&self.mem_gbps),
            "context_fill": a.context_fill,
            "decode_context": a.context_fill + prompt.len(),
            "attention_flops": med(&self.decode_attention_flops),
            "decode_flops": med(&self.decode_flops),
            "decode_bytes_touched": med(&self.decode_bytes_touched),
            "kv_bytes": med(&self.kv_bytes),
        });
        let mut out = json!({
            "config": label,
            "s_per_token": med(&self.spt),
            "tokens_per_s": 1.0 / med(&self.spt),
            "ttft_s": med(&self.ttft),
            "expert_bytes_per_token": med(&self.bpt),
            "spine_bytes_per_token": med(&self.spine_bpt),
            "hit_rate": med(&self.hit),
            "achieved_gbps": med(&self.ach),
            "raw_gbps": med(&self.raw),
            "raw_batched_gbps": med(&self.raw_batched),
            "bandwidth_fraction": med(&self.frac),
            "bandwidth_fraction_of_batched": med(&self.ach) / med(&self.raw_batched),
            "floor_s_per_token": med(&self.floor),
            "decode_vs_floor": med(&self.spt) / med(&self.floor),
            "io_wait_fraction": med(&self.iow),
            "peak_rss_bytes": med(&self.rss),
            "memory_budget_bytes": first["memory_budget_bytes"],
            "runs": a.runs,
            "ranges": {
                "s_per_token": stat(&self.spt), "raw_gbps": stat(&self.raw), "raw_batched_gbps": stat(&self.raw_batched),
                "achieved_gbps": stat(&self.ach), "bandwidth_fraction": stat(&self.frac), "hit_rate": stat(&self.hit),
                "peak_rss_bytes": stat(&self.rss), "ttft_s": stat(&self.ttft), "ttft_floor_s": stat(&self.ttft_floor),
                "peak_gflops": stat(&self.peak_gflops), "disk_idle_fraction": stat(&self.idle),
                "memory_gbps": stat(&self.mem_gbps), "floor_s_per_token": stat(&self.floor),
                "replay_gbps": stat(&self.replay), "fio_random_records_gbps": stat(&self.records),
            },
            "cache": if a.warm { "warm (second generation in the same process)" } else { "cold (fresh process, O_DIRECT, empty expert cache)" },
            "prompt_tokens": prompt,
            "generated_tokens": a.max_tokens,
            "model": first["model"],
            "experts_per_token": first["experts_per_token"],
            "modified_top_k": first["modified_top_k"],
            "numerics": first["numerics"],
            "approximate": first["approximate"],
            "kernel_path": first["kernel_path"],
            "threads": first["threads"],
            "io_backend": first["stream"]["io_backend"],
            "o_direct": first["stream"]["o_direct"],
            "cache_policy": first["stream"]["cache_policy"],
            "prefetch": first["stream"]["prefetch"],
            "prefetch_precision": first["stream"]["prefetch_precision"],
            "prefetch_recall": first["stream"]["prefetch_recall"],
            "plan": first["plan"],
            "machine": machine(),
            "storage": storage(store),
            "git_commit": git_commit(),
            "build_profile": if cfg!(debug_assertions) { "debug" } else { "release" },
            "per_run": self.runs,
        });
        // Where the routed experts computed (the literal above is at serde_json's macro depth).
        out["device"] = first["device"].clone();
        out["adapter"] = first["adapter"].clone();
        out["gpu_spine"] = first["gpu_spine"].clone();
        out["gpu_expert_cache"] = first["gpu_expert_cache"].clone();
        if let Some(o) = out.as_object_mut() {
            for part in [prefill, decode, disk] {
                if let Value::Object(p) = part {
                    o.extend(p);
                }
            }
        }
        out
    }
}

fn print_summary(out: &Value) {
    let f = |k: &str| out[k].as_f64().unwrap_or(f64::NAN);
    let r = |k: &str, e: &str| out["ranges"][k][e].as_f64().unwrap_or(f64::NAN);
    println!("== {} ==", out["config"].as_str().unwrap_or(""));
    if out["modified_top_k"].as_bool() == Some(true) {
        println!("NOTE: {} -- not comparable with default-k figures", out["model"].as_str().unwrap_or(""));
    }
    if out["approximate"].as_bool() == Some(true) {
        println!(
            "NOTE: APPROXIMATE numerics ({}) -- not comparable with exact figures",
            out["numerics"].as_str().unwrap_or("")
        );
    }
    println!(
        "{} runs, {}: {:.3} s/token median ({:.3}-{:.3}), {:.4} tokens/s; TTFT {:.3} s; {} backend, kernels {}",
        out["runs"],
        out["cache"].as_str().unwrap_or(""),
        f("s_per_token"),
        r("s_per_token", "min"),
        r("s_per_token", "max"),
        f("tokens_per_s"),
        f("ttft_s"),
        out["io_backend"],
        out["kernel_path"],
    );
    println!(
        "decode at a context of {} ({} synthetic): floor {:.3} s/token = max(disk {:.3}, memory {:.3} for {} touched incl. {} of latent cache at {:.1} GB/s, compute {:.3} for {:.1} GFLOP incl. {:.1} of attention)",
        out["decode_context"],
        out["context_fill"],
        f("floor_s_per_token"),
        f("floor_disk_s_per_token"),
        f("floor_memory_s_per_token"),
        human(f("decode_bytes_touched") as u64),
        human(f("kv_bytes") as u64),
        f("memory_gbps"),
        f("floor_compute_s_per_token"),
        f("decode_flops") / 1e9,
        f("attention_flops") / 1e9,
    );
    println!(
        "expert reads {} per token (+ spine {}), hit rate {:.1}%; achieved {:.2} GB/s vs {:.2} GB/s for the same reads replayed by {} = {:.0}% (random-record probe {:.2} GB/s, in layer-sized batches {:.2}, fio random records {:.2}); disk idle {:.1}% of a step; floor {:.3} s/token, decode/floor {:.2}; I/O wait {:.0}% of the run; peak RSS {} of budget {}",
        human(f("expert_bytes_per_token") as u64),
        human(f("spine_bytes_per_token") as u64),
        100.0 * f("hit_rate"),
        f("achieved_gbps"),
        f("replay_gbps"),
        out["replay_tool"].as_str().unwrap_or("?"),
        100.0 * f("bandwidth_fraction_of_replay"),
        f("raw_gbps"),
        f("raw_batched_gbps"),
        f("fio_random_records_gbps"),
        100.0 * f("disk_idle_fraction"),
        f("floor_s_per_token"),
        f("decode_vs_floor"),
        100.0 * f("io_wait_fraction"),
        human(f("peak_rss_bytes") as u64),
        human(out["memory_budget_bytes"].as_u64().unwrap_or(0)),
    );
    println!(
        "prompt {} tokens in chunks of {}: TTFT {:.3} s ({:.3}-{:.3}) vs floor {:.3} s = {:.2}x; distinct expert bytes {} (read {}), spine read {}, {:.1} GFLOP at a {:.1} GFLOP/s roof",
        out["prefill_tokens"],
        out["prefill_chunk"],
        f("ttft_s"),
        r("ttft_s", "min"),
        r("ttft_s", "max"),
        f("ttft_floor_s"),
        f("ttft_vs_floor"),
        human(f("prefill_distinct_expert_bytes") as u64),
        human(f("prefill_expert_bytes_read") as u64),
        human(f("prefill_spine_bytes") as u64),
        f("prefill_flops") / 1e9,
        f("peak_gflops"),
    );
}
