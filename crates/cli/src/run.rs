//! `generate` and `logits`: the options every model-running command shares, and the two
//! commands themselves.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use deltafin_engine::generate::{GenerateHooks, generate_with};
use deltafin_engine::plan::{parse_size, peak_rss_bytes};
use deltafin_engine::session::{RunOptions, Session};
use deltafin_engine::stream::cache::Policy;
use deltafin_engine::study::routing::RoutingOverride;
use deltafin_engine::study::trace::{TraceHeader, TraceWriter, read_trace};
use deltafin_hub::fetcher::HubFetcher;
use deltafin_store::Store;
use deltafin_store::presence::ExpertFetcher;
use deltafin_text::tokenizer::Tokenizer;

use crate::chat_turn::{chat_conversation, chat_prompt, chat_turn};

#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum Device {
    Cpu,
    Gpu,
    Auto,
}

#[derive(clap::Args, Clone)]
pub struct ModelArgs {
    /// Deltafin store directory (made by `deltafin convert`, `deltafin install` or `deltafin
    /// synth`). Required.
    #[arg(short = 'm', long = "model", env = "DELTAFIN_MODEL")]
    pub store: Option<PathBuf>,
    /// Checkpoint directory holding the in-place experts, if it moved since conversion.
    #[arg(long)]
    pub source: Option<PathBuf>,
    /// Memory budget (e.g. 20G, 512M); default 85% of available memory, or of the headroom under
    /// this process' cgroup memory limit when that is smaller.
    #[arg(long, value_parser = parse_size)]
    pub memory_budget: Option<u64>,
    /// Context length the plan reserves attention cache for (up to the model's maximum; a
    /// context the budget cannot hold is refused at start, with the longest one it can).
    #[arg(short = 'c', long, visible_alias = "ctx-size", default_value_t = 4096, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=(1u64 << 24)))]
    pub context: usize,
    /// How the MLA latent cache stores its values: auto (f32 with an f32 spine, else bf16),
    /// bf16 (half the memory and bandwidth, f32 accumulation) or f32.
    #[arg(long, default_value = "auto")]
    pub latent_cache: String,
    /// Expert read back-end: auto (io_uring when the kernel allows, else pread), io-uring, pread.
    #[arg(long, default_value = "auto")]
    pub io_backend: String,
    /// Reads in flight at most.
    #[arg(long, default_value_t = 32)]
    pub queue_depth: usize,
    /// Expert cache policy: slru or lru.
    #[arg(long, default_value = "slru")]
    pub cache_policy: Policy,
    /// Prefetch the next MoE layer's predicted experts while a layer computes. Off by default:
    /// replaying the trained demo model's router traces (77-78% precise predictions) on a
    /// K3-shaped store, it read 31-40% more and decoded 0-21% slower at about 10, 18 and 33 cache
    /// slots per layer (docs/streaming.md, "Traces of a trained router").
    #[arg(long, conflicts_with = "no_prefetch")]
    pub prefetch: bool,
    /// No look-ahead prefetch: the default (kept so that existing scripts work).
    #[arg(long)]
    pub no_prefetch: bool,
    /// Read experts through the page cache instead of O_DIRECT.
    #[arg(long)]
    pub buffered: bool,
    /// Routed experts per token (default: the model's). Fewer experts is a different model.
    #[arg(long)]
    pub experts_per_token: Option<usize>,
    /// Keep only this many leading spine layers in memory and stream the rest (default: as many
    /// as the budget holds).
    #[arg(long)]
    pub resident_spine_layers: Option<usize>,
    /// Approximate mode: routed experts take int8-quantised activations, and on CPUs with
    /// AVX-512 VNNI a prompt chunk's int8 spine products run in integers on int8 activations
    /// (faster, not exact; every output says so).
    #[arg(long)]
    pub approx: bool,
    /// Where the model computes: cpu, or gpu (WGSL on Vulkan, Metal or DirectX 12): the routed
    /// experts (each record uploaded as it arrives, recently used ones kept on the GPU) and a
    /// prompt chunk's spine products (each matrix kept on the GPU, within --gpu-memory) and MLA
    /// attention; KDA's recurrence and decode steps' spine stay on the CPU. With no usable
    /// adapter, gpu is an error that says why; auto takes a hardware GPU when one opens (not
    /// with --approx), else the CPU, and says which and why at start. With `bench --kernels`:
    /// whose kernels (auto: the GPU's).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// With --device gpu: the adapter whose name contains this (case-insensitive); a CPU-type
    /// adapter such as Mesa's llvmpipe is taken only when named here.
    #[arg(long, value_name = "NAME")]
    pub gpu_adapter: Option<String>,
    /// With --device gpu: GPU memory for the spine's matrices (which prompt chunks run there; a
    /// matrix past it stays on the CPU) and, in what they leave, routed experts cached between
    /// uses (e.g. 24G; 0: neither) [default: 8G]
    #[arg(long, value_parser = parse_size, value_name = "BYTES")]
    pub gpu_memory: Option<u64>,
    /// Never touch the network: on a streaming store (`install --mode stream`), an expert not
    /// fetched yet is an error that says how to fetch it.
    #[arg(long)]
    pub offline: bool,
    /// Where a streaming store fetches missing experts (default: HF_ENDPOINT for a Hub install,
    /// else the origin it was installed from).
    #[arg(long)]
    pub endpoint: Option<String>,
    /// On a streaming store, also fetch the router's look-ahead predictions of the next layer's
    /// experts in the background while a layer computes (off by default: mispredictions cost
    /// link time and bytes; measured in BENCHMARKS.md section 8).
    #[arg(long)]
    pub fetch_ahead: bool,
    /// Prompt tokens processed together (each streamed spine layer and each distinct expert is
    /// read once per chunk). Default: sized from the memory budget, up to the context length.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub prefill_chunk: Option<u64>,
}

/// Where the model computes, said at start when it is the GPU.
pub fn say_device(session: &Session) {
    if let Some(choice) = session.device_choice() {
        eprintln!("{choice}");
    }
    if let Some(note) = session.gpu_note() {
        eprintln!("{note}");
    }
    if let Some(a) = session.adapter() {
        eprintln!("routed experts on the GPU: {a}");
        match session.gpu_spine_bytes() {
            Some(_) => eprintln!("prompt chunks' spine products, MLA attention and KDA recurrence on the GPU too"),
            None => eprintln!("spine on the CPU and no expert cached on the GPU (--gpu-memory 0)"),
        }
        if let Some(split) = session.gpu_split() {
            eprintln!("{} (--gpu-memory)", split.describe());
        }
    }
}

impl ModelArgs {
    /// The store directory; `--model` is optional only so `bench --kernels` can run without one.
    pub fn store_path(&self) -> Result<&std::path::Path> {
        self.store.as_deref().ok_or_else(|| anyhow::anyhow!("pass --model STORE"))
    }

    pub fn run_options(&self) -> Result<RunOptions> {
        if self.gpu_memory.is_some() && self.device == Device::Cpu {
            bail!("--gpu-memory sizes what the GPU holds: it needs --device gpu (or auto)");
        }
        let backend = match self.io_backend.as_str() {
            "auto" => None,
            other => Some(other.parse().map_err(|e: String| anyhow::anyhow!(e))?),
        };
        Ok(RunOptions {
            memory_budget: self.memory_budget,
            context_tokens: self.context,
            backend,
            queue_depth: self.queue_depth,
            policy: self.cache_policy,
            prefetch: self.prefetch,
            direct: !self.buffered,
            experts_per_token: self.experts_per_token,
            resident_spine_layers: self.resident_spine_layers,
            approx: self.approx,
            predict: false,
            state_copies: 1,
            prefill_chunk: self.prefill_chunk.map(|n| n as usize),
            latent_cache: match self.latent_cache.as_str() {
                "auto" => None,
                o => Some(o.parse().map_err(|e: String| anyhow::anyhow!(e))?),
            },
            fetcher: None,
            log_reads: false,
            load_progress: None,
            gpu: (self.device != Device::Cpu)
                .then(|| deltafin_gpu::GpuOptions { allow_software: false, name: self.gpu_adapter.clone() }),
            gpu_auto: self.device == Device::Auto,
            gpu_memory: self.gpu_memory,
        })
    }

    /// The fetcher a streaming store uses for experts met for the first time: none for a full
    /// store, or offline.
    pub fn fetcher_for(&self, store: &Store) -> Result<Option<Arc<dyn ExpertFetcher>>> {
        if store.manifest.streaming.is_none() {
            return Ok(None);
        }
        let (present, all) = store.experts.presence().map(|p| p.count()).unwrap_or((0, 0));
        if self.offline {
            eprintln!("streaming store: {present} of {all} experts on disk; offline: a missing expert is an error");
            return Ok(None);
        }
        let endpoint = crate::install_cmd::fetch_endpoint(store, self.endpoint.as_deref());
        eprintln!(
            "streaming store: {present} of {all} experts on disk; missing ones are fetched on first use from {endpoint}"
        );
        let f = HubFetcher::open(store, Some(&endpoint), deltafin_hub::install::env_http())?
            .with_fetch_ahead(self.fetch_ahead);
        Ok(Some(Arc::new(f)))
    }

    pub fn open(&self) -> Result<(Store, Session)> {
        self.open_with(&self.run_options()?)
    }

    /// [`Self::open`] with run options the caller adjusted.
    pub fn open_with(&self, opts: &RunOptions) -> Result<(Store, Session)> {
        let path = self.store_path()?;
        let store =
            Store::open(path, self.source.as_deref()).with_context(|| format!("opening store {}", path.display()))?;
        let opts = RunOptions { fetcher: self.fetcher_for(&store)?, ..opts.clone() };
        let session = Session::open(&store, &opts)?;
        eprintln!("{}\n  {}", session.plan.describe(), deltafin_engine::os::cpus::report());
        if session.modified_top_k() {
            eprintln!("note: {}", session.variant());
        }
        if session.model.run().approx {
            eprintln!("note: APPROXIMATE numerics: {}", session.numerics());
        }
        crate::run::say_device(&session);
        Ok((store, session))
    }
}

#[derive(clap::Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt text (needs a store with a tokenizer).
    #[arg(long, conflicts_with = "prompt_tokens")]
    pub prompt: Option<String>,
    /// Prompt token ids, comma separated.
    #[arg(long, value_delimiter = ',')]
    pub prompt_tokens: Option<Vec<u32>>,
    /// Chat: send this as a user message in the model's chat format (Kimi K3's, as `serve` renders
    /// a chat request), stop at the end of the assistant's message, and print its reasoning and
    /// its answer apart (`reasoning`, `content`, `tool_calls` with --json). Needs a tokenizer.
    #[arg(long, conflicts_with_all = ["prompt", "prompt_tokens"])]
    pub chat: Option<String>,
    /// With --chat: a system message before the user's.
    #[arg(long)]
    pub system: Option<String>,
    /// With --chat: how much the model thinks (low, medium, high, max; `none` turns thinking off).
    /// Default: max, as K3's API.
    #[arg(long)]
    pub reasoning_effort: Option<String>,
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Keep generating past the end-of-message token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Record every token's router choices to this file (JSON lines).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Replace the router's choices with a synthetic pattern: each pick repeats one of the
    /// previous token's experts with this probability (0..1), else is uniform. For cache studies.
    #[arg(long)]
    pub routing_locality: Option<f64>,
    /// Replace the router's choices with a recorded trace's. For cache studies.
    #[arg(long, conflicts_with = "routing_locality")]
    pub routing_trace: Option<PathBuf>,
    /// Keep prompt states on disk in DIR and resume from the longest stored prefix of the
    /// prompt (as `serve --state-dir`; `cached_prompt_tokens` in the JSON says how many).
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Bytes of snapshots `--state-dir` keeps; the least recently used go first.
    #[arg(long, default_value = "8G", value_parser = parse_size, value_name = "BYTES")]
    pub state_budget: u64,
    /// Start as if this many tokens came before the prompt: every MLA layer's latent cache holds
    /// that many synthetic positions, so decode is timed at that context without computing its
    /// prompt (`bench --context-fill`). The text that follows means nothing.
    #[arg(long, default_value_t = 0, value_name = "TOKENS")]
    pub context_fill: usize,
    /// Generate this many times in this process and report the last (warm-cache measurement).
    #[arg(long, default_value_t = 1, hide = true)]
    pub repeat: usize,
    /// Write every read of the run (experts and streamed spine: file, offset, length, in order)
    /// to this file as a fio iolog, for `bench` to replay (the drive's rate for exactly these
    /// reads).
    #[arg(long, hide = true, value_name = "FILE")]
    pub read_log: Option<PathBuf>,
    /// Decode N sequences together (continuous batching), each with its own prompt: stream 0's
    /// is the prompt, stream i's moves every id by i x 7,919. Prints each stream's tokens and
    /// the batch's figures (what `bench --streams` measures).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=256))]
    pub streams: Option<u64>,
    /// With --streams: once the streams have decoded their tokens, a sequence with a prompt of
    /// this many tokens joins while they go on decoding; reports the longest pause it caused.
    #[arg(long, value_name = "TOKENS", requires = "streams")]
    pub join_prompt: Option<usize>,
}

#[derive(clap::Args)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[arg(long, value_delimiter = ',', required = true)]
    pub prompt_tokens: Vec<u32>,
    /// Write every position's logits (after each prompt token, teacher-forced) to this file as
    /// little-endian f32 `[tokens, vocab]`, and print a summary instead of the last logits.
    #[arg(long)]
    pub all_positions: Option<PathBuf>,
}

pub(crate) fn load_tokenizer(store: &Store) -> Result<Option<Tokenizer>> {
    match store.tokenizer_file("tiktoken.model") {
        Some(_) => Ok(Some(Tokenizer::load(&store.dir)?)),
        None => Ok(None),
    }
}

pub fn generate(a: GenerateArgs) -> Result<()> {
    if let Some(n) = a.streams {
        return crate::streams::generate_streams(&a, n as usize);
    }
    if a.join_prompt.is_some() {
        bail!("--join-prompt goes with --streams");
    }
    if let Some(p) = a.routing_locality
        && !(0.0..=1.0).contains(&p)
    {
        bail!("--routing-locality must be between 0 and 1");
    }
    // Argument mistakes are reported before minutes of loading, not after.
    if [a.prompt.is_some(), a.prompt_tokens.is_some(), a.chat.is_some()].iter().filter(|&&x| x).count() != 1 {
        bail!("pass exactly one of --prompt, --prompt-tokens or --chat");
    }
    if a.chat.is_none() && (a.system.is_some() || a.reasoning_effort.is_some()) {
        bail!("--system and --reasoning-effort go with --chat");
    }
    let effort = a.reasoning_effort.as_deref().unwrap_or("max");
    let chat = a.chat.as_deref().map(|m| chat_conversation(m, a.system.as_deref(), effort)).transpose()?;
    // A trace records each layer's prediction of the next layer's picks.
    // With --state-dir the state store holds one snapshot's bytes besides the live state.
    let opts = RunOptions {
        predict: a.trace.is_some(),
        state_copies: 1 + usize::from(a.state_dir.is_some()),
        log_reads: a.read_log.is_some(),
        ..a.model.run_options()?
    };
    let (store, mut s) = a.model.open_with(&opts)?;
    let tok = load_tokenizer(&store)?;
    let prompt_ids = match (&a.prompt, &a.prompt_tokens, &chat) {
        (Some(text), None, None) => match &tok {
            Some(t) => t.encode(text),
            None => bail!("this store has no tokenizer; pass --prompt-tokens instead of --prompt"),
        },
        (None, Some(ids), None) => ids.clone(),
        (None, None, Some((conv, opts))) => match &tok {
            Some(t) => chat_prompt(conv, *opts, t)?,
            None => bail!("this store has no tokenizer, which --chat needs"),
        },
        _ => bail!("pass exactly one of --prompt, --prompt-tokens or --chat"),
    };
    if prompt_ids.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    // The latent cache is reserved for --context positions: a longer sequence would grow it past
    // what the memory plan holds.
    let needed = a.context_fill + prompt_ids.len() + a.max_tokens;
    if needed > a.model.context {
        let fill = if a.context_fill > 0 { format!(" after --context-fill {}", a.context_fill) } else { String::new() };
        bail!(
            "a prompt of {} tokens{fill} and --max-tokens {} need a context of {needed} tokens, more than --context {} (`deltafin plan` says the longest this budget holds)",
            prompt_ids.len(),
            a.max_tokens,
            a.model.context
        );
    }
    if a.context_fill > 0 && a.state_dir.is_some() {
        bail!("--context-fill cannot go with --state-dir (a synthetic context is no prompt's state)");
    }
    let eos = if a.ignore_eos { None } else { tok.as_ref().and_then(|t| t.eos_id) };
    let mut trace = match &a.trace {
        Some(p) => Some(TraceWriter::create(
            p,
            TraceHeader {
                deltafin_trace: 1,
                experts_per_layer: s.model.config.num_experts,
                experts_per_token: s.model.config.num_experts_per_token,
                moe_layers: s.model.config.moe_layers(),
            },
        )?),
        None => None,
    };
    let mut routing = match (&a.routing_locality, &a.routing_trace) {
        (Some(p), _) => Some(RoutingOverride::synthetic(*p, 7)),
        (None, Some(path)) => Some(RoutingOverride::Trace { trace: read_trace(path)?, next: 0 }),
        _ => None,
    };
    if a.state_dir.is_some() && (a.trace.is_some() || a.routing_locality.is_some() || a.routing_trace.is_some()) {
        // Forced routing gives states the model would not compute, and a trace needs every
        // position computed: neither may meet stored states.
        bail!("--state-dir cannot go with --trace, --routing-locality or --routing-trace");
    }
    let mut states = match &a.state_dir {
        Some(dir) => {
            let manifest = std::fs::read(store.dir.join("manifest.json")).context("reading the store's manifest")?;
            let id = deltafin_engine::prefix_store::identity(
                deltafin_store::checksum::xxh3_64(&manifest),
                &s.state_numerics(),
                &s.variant(),
            );
            let ps = deltafin_engine::prefix_store::PrefixStore::open(dir, a.state_budget, id)
                .with_context(|| format!("opening the prompt-state directory {}", dir.display()))?;
            eprintln!("  {}", ps.describe());
            Some(ps)
        }
        None => None,
    };
    let mut g = None;
    for seq in 0..a.repeat.max(1) {
        // The report covers the generation it reports (the last): a warm run's counters do not
        // mix in the generation that warmed the cache.
        if seq > 0 {
            s.experts.clear_stats();
        }
        let mut bar = PromptBar::new(prompt_ids.len(), a.json);
        let mut progress = |p| bar.update(p);
        let hooks = GenerateHooks {
            trace: trace.as_mut(),
            seq,
            routing: routing.as_mut(),
            progress: Some(&mut progress),
            states: states.as_mut(),
            context_fill: a.context_fill,
        };
        g = Some(generate_with(&s.model, &mut s.experts, &prompt_ids, a.max_tokens, eos, hooks)?);
        bar.finish();
    }
    let g = g.ok_or_else(|| anyhow::anyhow!("nothing generated"))?;
    // The last snapshot's write finishes (its thread ran beside the generation) before the
    // figures are reported.
    if let Some(ps) = states.as_mut()
        && let Err(e) = ps.flush()
    {
        eprintln!("warning: keeping a prompt state on disk failed: {e}");
    }
    if let Some(t) = trace {
        t.finish()?;
    }
    if let Some(path) = &a.read_log {
        deltafin_engine::stream::replay::write_iolog(&s.take_read_log(), path)?;
    }
    let text = tok.as_ref().map(|t| t.decode(&g.tokens));
    let turn = match (&chat, &tok) {
        (Some((_, opts)), Some(t)) => Some(chat_turn(t, opts.thinking, &g.tokens)),
        _ => None,
    };
    let steps = &g.timing.decode_step_s;
    let decode_tps = (!steps.is_empty()).then(|| steps.len() as f64 / steps.iter().sum::<f64>());
    let report = s.report();
    let k = s.model.config.num_experts_per_token;
    let cached = a.context_fill + g.cached_prompt_tokens;
    let (prompt_flops, prompt_attention_flops) = deltafin_engine::plan::prompt_flops(
        &store.manifest,
        k,
        cached,
        g.prompt_tokens.len() - g.cached_prompt_tokens,
        g.timing.prompt.chunks,
    );
    // What approximate mode may have run in integers (prompt chunks' products on the CPU's
    // integer kernels): the bench puts it at the integer roof in the prompt's floor.
    let prompt_integer_flops = if s.model.run().approx && deltafin_kernels::approx::has_integer_spine() {
        deltafin_engine::plan::prompt_integer_flops(&store.manifest, k, g.prompt_tokens.len() - g.cached_prompt_tokens)
    } else {
        0.0
    };
    let last_context = a.context_fill + g.prompt_tokens.len() + g.tokens.len().saturating_sub(1);
    let decode_work =
        deltafin_engine::plan::decode_work(&store.manifest, k, last_context, s.model.latent_cache().bytes());
    if a.json {
        let out = serde_json::json!({
            "prompt_tokens": g.prompt_tokens,
            "cached_prompt_tokens": g.cached_prompt_tokens,
            "prompt_states": states.as_ref().map(|s| serde_json::json!({
                "counters": s.counters,
                "snapshots": s.held().0,
                "bytes": s.held().1,
            })),
            "tokens": g.tokens,
            "text": text,
            "reasoning": turn.as_ref().map(|t| &t.reasoning),
            "content": turn.as_ref().map(|t| &t.content),
            "tool_calls": turn.as_ref().map(|t| t.tool_calls.iter().map(|(name, args)| serde_json::json!({"name": name, "arguments": args})).collect::<Vec<_>>()),
            "stopped_at_eos": g.stopped_at_eos,
            "model": s.variant(),
            "experts_per_token": s.model.config.num_experts_per_token,
            "modified_top_k": s.modified_top_k(),
            "spine_dtype": store.manifest.spine.matrix_dtype,
            "numerics": s.numerics(),
            "approximate": s.model.run().approx,
            "device": s.device(),
            "adapter": s.adapter(),
            "gpu_spine": s.gpu_spine_bytes().map(|(used, budget)| serde_json::json!({"bytes_on_gpu": used, "budget_bytes": budget, "mla_attention_tokens": s.gpu_mla_tokens().unwrap_or(0), "kda_recurrence_tokens": s.gpu_kda_tokens().unwrap_or(0), "streamed_bytes": s.gpu_streamed_bytes().unwrap_or(0)})),
            "gpu_expert_cache": s.gpu_expert_cache().map(|(capacity, held, hits, misses)| serde_json::json!({"capacity": capacity, "held": held, "hits": hits, "misses": misses})),
            "latent_cache": s.model.latent_cache(),
            "kernel_path": deltafin_engine::kernel_path(),
            "threads": deltafin_engine::threads(),
            "timing": {
                "prompt_s": g.timing.prompt_s,
                "ttft_s": g.timing.prompt_s,
                "prompt": g.timing.prompt,
                "prompt_flops": prompt_flops,
                "prompt_attention_flops": prompt_attention_flops,
                "prompt_integer_flops": prompt_integer_flops,
                "context_fill": a.context_fill,
                // One decode step at the context the last token was generated at.
                "decode_work": decode_work,
                "decode_step_s": g.timing.decode_step_s,
                "decode_step_bytes": g.timing.decode_step_bytes,
                "decode_step_disk_idle_s": g.timing.decode_step_disk_idle_s,
                "decode_tokens_per_s": decode_tps,
                "total_s": g.timing.total_s,
                "expert_bytes_read": g.timing.expert_bytes_read,
            },
            "plan": s.plan,
            "stream": report,
            "spine": s.model.spine_report(),
            "fetch": s.experts.fetch_stats(),
            "memory_budget_bytes": s.plan.budget_bytes,
            "peak_rss_bytes": peak_rss_bytes(),
        });
        println!("{out}");
    } else {
        let shown = match (&turn, text) {
            (Some(turn), _) => Some(turn.shown()),
            (None, t) => t,
        };
        match shown {
            Some(t) if std::io::stdout().is_terminal() => println!("{}", terminal_safe(&t)),
            Some(t) => println!("{t}"),
            None => println!("{}", g.tokens.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",")),
        }
        eprintln!(
            "{} prompt tokens ({} chunk(s) of up to {}), {} generated; time to first token {:.3}s, decode {} tok/s; experts: hit rate {:.1}%, {} bytes read ({:?}, O_DIRECT {}); peak RSS {}",
            g.prompt_tokens.len(),
            g.timing.prompt.chunks,
            g.timing.prompt.chunk,
            g.tokens.len(),
            g.timing.prompt_s,
            decode_tps.map(|v| format!("{v:.2}")).unwrap_or_else(|| "-".into()),
            100.0 * report.hit_rate,
            report.expert_bytes_read,
            report.io_backend,
            report.o_direct,
            peak_rss_bytes().map(deltafin_engine::plan::human).unwrap_or_default(),
        );
        if let Some(f) = s.experts.fetch_stats() {
            eprintln!(
                "fetched {} expert(s) from the origin ({} ahead of demand): downloaded {}, wrote {} to the store",
                f.experts,
                f.experts_ahead,
                deltafin_engine::plan::human(f.bytes_downloaded),
                deltafin_engine::plan::human(f.bytes_written)
            );
        }
    }
    Ok(())
}

/// A progress bar for a long prompt (shown after two seconds, on a terminal or as a line every
/// five seconds in a log), counting tokens through the model's layers.
struct PromptBar {
    started: std::time::Instant,
    tokens: usize,
    bar: Option<deltafin_store::progress::Progress>,
    quiet: bool,
}

impl PromptBar {
    fn new(tokens: usize, quiet: bool) -> Self {
        PromptBar { started: std::time::Instant::now(), tokens, bar: None, quiet }
    }

    fn update(&mut self, p: deltafin_engine::generate::PromptProgress) {
        if self.quiet || (self.bar.is_none() && self.started.elapsed().as_secs_f64() < 2.0) {
            return;
        }
        let layers = (p.layers_total / p.tokens_total.max(1) as u64).max(1);
        let bar = self.bar.get_or_insert_with(|| {
            deltafin_store::progress::Progress::counted("prompt", self.tokens as u64, "tokens", false)
        });
        bar.set_position(p.layers_done / layers);
    }

    fn finish(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish();
        }
    }
}

/// Control characters other than newline and tab, shown escaped: generated text must not be
/// able to drive the user's terminal (a random demo model emits arbitrary bytes).
fn terminal_safe(t: &str) -> String {
    t.chars()
        .map(|c| if c.is_control() && c != '\n' && c != '\t' { c.escape_default().to_string() } else { c.to_string() })
        .collect()
}

pub fn logits(a: LogitsArgs) -> Result<()> {
    let (_store, mut s) = a.model.open()?;
    if let Some(path) = &a.all_positions {
        // One token at a time (bit-identical to any chunking): each step's logits are written as
        // they come, so a long text needs one vocabulary row of memory.
        let vocab = s.model.config.vocab_size;
        let mut st = s.model.new_state();
        let mut row = vec![0f32; vocab];
        let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
        let mut w = std::io::BufWriter::new(file);
        for &t in &a.prompt_tokens {
            s.model.forward_chunk(&mut st, &mut s.experts, &[t], &mut row)?;
            for x in &row {
                w.write_all(&x.to_le_bytes())?;
            }
        }
        w.flush().with_context(|| format!("writing {}", path.display()))?;
        println!(
            "{}",
            serde_json::json!({ "positions": a.prompt_tokens.len(), "vocab": vocab, "dtype": "f32-le", "model": s.variant(), "numerics": s.numerics(), "approximate": s.model.run().approx, "device": s.device(), "adapter": s.adapter() })
        );
        return Ok(());
    }
    let g = generate_with(&s.model, &mut s.experts, &a.prompt_tokens, 0, None, GenerateHooks::default())?;
    println!(
        "{}",
        serde_json::json!({ "logits": g.prompt_logits, "model": s.variant(), "numerics": s.numerics(), "approximate": s.model.run().approx, "device": s.device(), "adapter": s.adapter() })
    );
    Ok(())
}
