//! `deltafin plan`: the memory plan for a model that need not be on this machine (a config, or
//! the Kimi K3 release on paper): what stays resident, what is streamed, how large the prompt
//! chunks are, the bytes each token is expected to read, and from a drive rate (given, or
//! measured with `--measure DIR`) the seconds per token and to the first token
//! ([`crate::plan_speed`]), and the disk a store needs.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use deltafin_engine::blocks::mla::LatentDtype;
use deltafin_engine::plan::{Budget, PlanRequest, human, longest_context, make_plan, prefill_token_bytes, state_bytes};
use deltafin_store::K3Config;
use deltafin_store::synth::{k3_release_config, paper_manifest};
use serde_json::json;

#[derive(clap::Args)]
pub struct PlanArgs {
    /// A Hugging Face `config.json` (with or without `text_config`).
    #[arg(long, conflicts_with = "preset")]
    pub config: Option<PathBuf>,
    /// A built-in model: kimi-k3 (the release: 93 layers, 896 experts, top-16).
    #[arg(long)]
    pub preset: Option<String>,
    /// Memory budget(s), comma separated (e.g. 24G,32G,48G,64G).
    #[arg(long, value_delimiter = ',', value_parser = deltafin_engine::plan::parse_size, required = true)]
    pub memory_budget: Vec<u64>,
    #[arg(long, default_value_t = 4096)]
    pub context: usize,
    /// How the MLA latent cache stores its values: bf16 (what the engine uses with an int8 or
    /// bf16 spine) or f32.
    #[arg(long, default_value = "bf16")]
    pub latent_cache: String,
    /// Prompt tokens per chunk (default: sized from the budget).
    #[arg(long)]
    pub prefill_chunk: Option<usize>,
    /// Keep only this many leading spine layers resident.
    #[arg(long)]
    pub resident_spine_layers: Option<usize>,
    /// Plan with prefetch buffers (as `--prefetch`).
    #[arg(long, conflicts_with = "no_prefetch")]
    pub prefetch: bool,
    /// Plan without prefetch buffers: the default (kept so that existing scripts work).
    #[arg(long)]
    pub no_prefetch: bool,
    /// Drive read rate(s) in GB/s, comma separated (e.g. 3,7,12): seconds per token and to the
    /// first token at each.
    #[arg(long, value_delimiter = ',')]
    pub disk_gbps: Vec<f64>,
    /// Measure the drive under DIR instead: the raw O_DIRECT random read rate at the model's
    /// expert record size, 32 in flight (writes and deletes a ~1.1 GB scratch file there), and
    /// this machine's compute rate (FMA peak, every thread).
    #[arg(long, value_name = "DIR")]
    pub measure: Option<PathBuf>,
    /// Sustained compute rate in GFLOP/s for the estimates (default: measured with --measure,
    /// else compute is left out and the figures are the drive's alone).
    #[arg(long)]
    pub gflops: Option<f64>,
    /// Prompt length of the time-to-first-token estimate.
    #[arg(long, default_value_t = 2000)]
    pub prompt_length: usize,
    /// Sequences decoding together (continuous batching), comma separated (e.g. 1,2,4,8): per
    /// budget and drive rate, the seconds per step, per generated token and the aggregate rate.
    #[arg(long, value_delimiter = ',')]
    pub streams: Vec<usize>,
    /// GPU memory (e.g. 24G): what it holds of the spine and the routed experts, and what
    /// crosses the bus per prompt chunk and per decode token, beside each budget's plan.
    #[arg(long, value_parser = deltafin_engine::plan::parse_size, value_name = "BYTES")]
    pub gpu_memory: Option<u64>,
    /// With --gpu-memory: the GPU shares the host's memory (Apple's unified memory, an
    /// integrated GPU), so its share comes out of each budget.
    #[arg(long, requires = "gpu_memory")]
    pub unified_memory: bool,
    #[arg(long)]
    pub json: bool,
}

pub fn plan(a: PlanArgs) -> Result<()> {
    let cfg: K3Config = match (&a.config, a.preset.as_deref()) {
        (Some(p), None) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            K3Config::from_hf_json(&text, &p.display().to_string())?
        }
        (None, Some("kimi-k3")) => k3_release_config(),
        (None, Some(other)) => bail!("unknown preset '{other}' (only kimi-k3)"),
        _ => bail!("pass --config CONFIG_JSON or --preset kimi-k3"),
    };
    let m = paper_manifest(&cfg);
    let k = cfg.num_experts_per_token;
    if a.disk_gbps.iter().any(|g| !(g.is_finite() && *g > 0.0)) {
        bail!("--disk-gbps takes positive rates in GB/s, e.g. 3,7,12");
    }
    if a.gflops.is_some_and(|g| !(g.is_finite() && g > 0.0)) {
        bail!("--gflops must be a positive rate");
    }
    let mut rates = a.disk_gbps.clone();
    let mut gflops = a.gflops;
    let mut measured = None;
    if let Some(dir) = &a.measure {
        let r = deltafin_engine::stream::probe::scratch_read_bandwidth(
            dir,
            m.experts.record_bytes,
            64,
            128,
            32,
            &mut |s| eprintln!("plan --measure: {s}"),
        )
        .with_context(|| format!("measuring the drive under {}", dir.display()))?;
        eprintln!("plan --measure: measuring this machine's compute rate (FMA peak, every thread)");
        let threads = rayon::current_num_threads();
        let g = deltafin_kernels::roofline::fma_peak_gflops(threads, 0.3);
        gflops = gflops.or(Some(g));
        eprintln!(
            "plan --measure: drive {:.2} GB/s ({} reads of {} bytes, O_DIRECT {}, {} in flight); compute {:.0} GFLOP/s on {threads} threads",
            r.gbps, r.reads, r.read_bytes, r.o_direct, r.queue_depth, g
        );
        rates.push(r.gbps);
        measured = Some(json!({"disk": r, "gflops": g, "threads": threads}));
    }
    let disk = crate::plan_speed::disk_need(&m);
    if !a.json {
        println!(
            "disk: a full install takes {} (spine {} + experts {}); a streaming install starts at {} (the spine) and grows with the experts used",
            human(disk.full_bytes),
            human(disk.spine_bytes),
            human(disk.expert_bytes),
            human(disk.stream_start_bytes)
        );
        println!(
            "spine precision assumed: {} matrices ({}), f32 vectors: what `convert --spine auto` writes for a model this size\n",
            format!("{:?}", m.spine.matrix_dtype).to_lowercase(),
            if m.spine.int8_group == 0 {
                "one scale per row".to_string()
            } else {
                format!("scale groups of {}", m.spine.int8_group)
            }
        );
    }
    let latent_cache: LatentDtype = a.latent_cache.parse().map_err(|e: String| anyhow::anyhow!(e))?;
    if a.streams.iter().any(|&n| !(1..=256).contains(&n)) {
        bail!("--streams takes sequence counts from 1 to 256, e.g. 1,2,4,8");
    }
    if !a.streams.is_empty() && rates.is_empty() {
        bail!("--streams needs a drive rate: --disk-gbps or --measure");
    }
    let mut out = Vec::new();
    for &b in &a.memory_budget {
        let req = PlanRequest {
            context: a.context,
            experts_per_token: k,
            io_buffers: if a.prefetch { 2 * k } else { k },
            resident_layers: a.resident_spine_layers,
            state_copies: 1,
            prefill_chunk: a.prefill_chunk,
            latent_cache,
        };
        let budget = match a.gpu_memory {
            Some(g) if a.unified_memory => deltafin_engine::gpu_plan::host_budget(Budget::given(b), g)?,
            _ => Budget::given(b),
        };
        let plan = make_plan(&m, &budget, &req)?;
        let gpu = a
            .gpu_memory
            .map(|g| deltafin_engine::gpu_plan::GpuSplit::new(g, plan.spine_bytes + plan.spine_bytes_per_token, &plan));
        let per_token = plan.spine_bytes_per_token + plan.expected_expert_bytes_per_token;
        let longest = longest_context(&m, &Budget::given(b), &req);
        let state_per_1k = state_bytes(&m, 1000, latent_cache.bytes()) - state_bytes(&m, 0, latent_cache.bytes());
        let estimates: Vec<_> =
            rates.iter().map(|&g| crate::plan_speed::estimate(&m, &plan, g, a.prompt_length, gflops)).collect();
        if !a.json {
            println!("{}", plan.describe());
            if let Some(g) = &gpu {
                println!("  {}", g.describe());
            }
            println!(
                "  read per token (cold, uniform routing): {} = streamed spine {} + experts {}",
                human(per_token),
                human(plan.spine_bytes_per_token),
                human(plan.expected_expert_bytes_per_token)
            );
            println!(
                "  longest context this budget holds: {longest} tokens ({} latent cache: {} per 1,000 tokens; the model allows {})\n",
                latent_cache.name(),
                human(state_per_1k),
                cfg.max_position_embeddings
            );
            for e in &estimates {
                println!(
                    "  estimate at {:.1} GB/s{}: decode {:.2} s/token ({}-bound), first token of a {}-token prompt {:.1} s ({} chunk{}, {}-bound)",
                    e.disk_gbps,
                    gflops.map(|g| format!(" and {g:.0} GFLOP/s")).unwrap_or_default(),
                    e.s_per_token,
                    e.decode_bound,
                    e.prompt_tokens,
                    e.ttft_s,
                    e.ttft_chunks,
                    if e.ttft_chunks == 1 { "" } else { "s" },
                    e.ttft_bound
                );
            }
            if !estimates.is_empty() {
                println!(
                    "  (estimates: the larger of the drive's time for the bytes read and {}; cold cache, uniform routing; measured runs land 1.0-2.1x above such floors)",
                    if gflops.is_some() {
                        "the compute time"
                    } else {
                        "nothing else (no --gflops or --measure: compute left out)"
                    }
                );
            }
        }
        let streams = crate::plan_streams::rows(&m, b, &req, &a.streams, &rates, gflops);
        if !a.json {
            if !streams.is_empty() {
                crate::plan_streams::print(&streams);
            }
            println!();
        }
        out.push(json!({ "plan": plan, "gpu": gpu, "read_bytes_per_token": per_token, "longest_context": longest,
                         "state_bytes_per_1000_tokens": state_per_1k, "estimates": estimates.iter().map(|e| e.to_json()).collect::<Vec<_>>(),
                         "streams": streams }));
    }
    if a.json {
        println!(
            "{}",
            json!({
                "model": { "layers": cfg.num_hidden_layers, "experts": cfg.num_experts, "experts_per_token": k,
                           "spine_bytes_int8": m.spine.bytes, "record_bytes": m.experts.record_bytes,
                           "prefill_token_bytes": prefill_token_bytes(&m, k) },
                "plans": out,
                "disk": disk.to_json(),
                "gflops": gflops,
                "measured": measured,
                "spine_dtype": format!("{:?}", m.spine.matrix_dtype).to_lowercase(),
            })
        );
    }
    Ok(())
}
