//! `deltafin serve`: the OpenAI- and Anthropic-compatible HTTP server.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use deltafin_engine::plan::parse_size;
use deltafin_engine::session::Session;
use deltafin_server::state::{ModelInfo, unix_now};
use deltafin_server::{ServeOptions, serve};
use deltafin_store::Store;
use deltafin_text::tokenizer::Tokenizer;

use crate::run::ModelArgs;

#[derive(clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on (loopback by default: nothing outside this machine can connect).
    #[arg(long, default_value = "127.0.0.1", env = "DELTAFIN_HOST")]
    pub host: String,
    /// Port (0 picks a free one; the chosen address is printed).
    #[arg(long, default_value_t = 8000, env = "DELTAFIN_PORT")]
    pub port: u16,
    /// Require this key (`Authorization: Bearer KEY` or `x-api-key: KEY`) on every endpoint
    /// but /health.
    #[arg(long, env = "DELTAFIN_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Requests that may wait in line (FIFO) while --max-batch generate (agents send a
    /// follow-up, a title and a summary at once); more get HTTP 429. 0: refuse any request
    /// while the batch is full.
    #[arg(long, default_value_t = 16)]
    pub queue: usize,
    /// Generations that share each model step (continuous batching): every spine layer is
    /// read once for all of them and every expert two of them pick once. Each keeps a sequence
    /// state of its own (the memory plan counts them at the full context); requests beyond it
    /// wait in --queue. `auto` (the default): the most the memory plan holds, up to 8 (their
    /// states take at most 12% of the budget, the spine and the expert cache keep the rest). A
    /// number is a cap on that: the plan's count if lower (said at start); 1 runs one request
    /// at a time. A long prompt that no other request decodes beside borrows the expert cache
    /// for larger chunks either way.
    #[arg(long, default_value = "auto", value_name = "N|auto", value_parser = parse_max_batch)]
    pub max_batch: MaxBatch,
    /// Model id clients use (default: the store directory's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Another name the model answers to and is listed under (repeatable), e.g. --alias
    /// gpt-4o --alias kimi-k3.
    #[arg(short = 'a', long = "alias", value_name = "NAME")]
    pub aliases: Vec<String>,
    /// Largest request body accepted (e.g. 8M).
    #[arg(long, default_value = "8M", value_parser = parse_size)]
    pub max_body_bytes: u64,
    /// Seconds between SSE keep-alive comments on streams.
    #[arg(long, default_value_t = 10.0)]
    pub keep_alive_s: f64,
    /// Do not keep the last prompt's state for reuse (saves one sequence state of memory; every
    /// chat turn then reprocesses the whole history).
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// Keep prompt states on disk in DIR: the state after every prompt and every finished turn,
    /// for many conversations and across restarts. A request resumes from the longest stored
    /// prefix of its prompt (`usage.prompt_tokens_details.cached_tokens` says how many tokens).
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<std::path::PathBuf>,
    /// Bytes of snapshots `--state-dir` keeps; the least recently used go first.
    #[arg(long, default_value = "8G", value_parser = parse_size, value_name = "BYTES")]
    pub state_budget: u64,
    #[cfg(feature = "test-instruments")]
    #[command(flatten)]
    pub instruments: InstrumentArgs,
}

/// Test instruments, hidden from `--help` and present only in builds with the
/// `test-instruments` feature (the test suite's).
#[cfg(feature = "test-instruments")]
#[derive(clap::Args)]
pub struct InstrumentArgs {
    /// Test throttle: sleep this many milliseconds after every model step.
    #[arg(long, default_value_t = 0, hide = true)]
    pub token_delay_ms: u64,
    /// Test instrument: scripted replies (JSON `{"replies": [{"when", "text"}]}`) replace the
    /// sampled tokens when the tool results ending the conversation, or else the last user text,
    /// contain `when`.
    #[arg(long, hide = true)]
    pub script: Option<std::path::PathBuf>,
    /// Test instrument: prompts containing `inject-read-fault` / `inject-engine-error` fail in
    /// the engine with a read fault / another engine error (see the server's instruments).
    #[arg(long, hide = true)]
    pub inject_faults: bool,
    /// Test instrument: sleep this many milliseconds before loading the model.
    #[arg(long, default_value_t = 0, hide = true)]
    pub load_delay_ms: u64,
}

pub fn run(a: ServeArgs) -> Result<()> {
    if !(a.keep_alive_s > 0.0 && a.keep_alive_s <= 3600.0) {
        bail!("--keep-alive-s must be a number of seconds in (0, 3600]");
    }
    let path = a.model.store_path()?.to_path_buf();
    let store =
        Store::open(&path, a.model.source.as_deref()).with_context(|| format!("opening store {}", path.display()))?;
    if store.tokenizer_file("tiktoken.model").is_none() {
        bail!("the store {} has no tokenizer (tiktoken.model); the server needs one", path.display());
    }
    let tokenizer = Tokenizer::load(&store.dir)?;
    let mut run_opts = a.model.run_options()?;
    // The live states (one per sequence of the batch), the prefix snapshot (unless
    // --no-prefix-cache), and either the state store's buffer of one snapshot (--state-dir) or,
    // without it, the memory slot of the last shared prompt start (tools and system messages).
    let kept = usize::from(!a.no_prefix_cache) + usize::from(a.state_dir.is_some() || !a.no_prefix_cache);
    // The most sequences the memory plan holds, up to the cap asked for.
    let (cap, asked) = match a.max_batch {
        MaxBatch::Fixed(n) => (n, format!("{n}")),
        MaxBatch::Auto => (AUTO_BATCH_CAP, "auto".to_string()),
    };
    let max_batch = if cap == 1 {
        1
    } else {
        let probe = deltafin_engine::session::RunOptions { state_copies: 1 + kept, ..a.model.run_options()? };
        let (n, one) = Session::batch_size(&store, &probe, cap);
        eprintln!(
            "  --max-batch {asked}: {n} sequences per step (each keeps {} of state at a context of {}; at most {cap}, their states within {}% of the memory budget)",
            deltafin_engine::plan::human(one),
            probe.context_tokens,
            deltafin_engine::plan::BATCH_STATE_SHARE_PERCENT,
        );
        n
    };
    run_opts.state_copies = max_batch + kept;
    run_opts.fetcher = a.model.fetcher_for(&store)?;
    let load_progress = std::sync::Arc::new(deltafin_engine::k3::LoadProgress::default());
    run_opts.load_progress = Some(load_progress.clone());
    // The context and the memory plan are checked now, before the port is bound and the model
    // loads for minutes.
    Session::plan(&store, &run_opts)?;
    let cfg = &store.manifest.config;
    let id = a.served_model_name.clone().unwrap_or_else(|| {
        std::fs::canonicalize(&path)
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "kimi-k3".into())
    });
    let numerics = deltafin_engine::session::numerics(run_opts.approx);
    let mut aliases = Vec::new();
    for a in &a.aliases {
        if a.is_empty() || a.len() > 256 {
            bail!("--alias must be a name of 1 to 256 bytes");
        }
        if *a != id && !aliases.contains(a) {
            aliases.push(a.clone());
        }
    }
    // `--device auto` is settled before the server answers: every response names the device.
    let device = match (&run_opts.gpu, run_opts.gpu_auto) {
        (None, _) => "cpu",
        (Some(_), false) => "gpu",
        (Some(g), true) => {
            let opened = if run_opts.approx {
                Err("--approx runs on the CPU's integer kernels".to_string())
            } else {
                deltafin_gpu::Gpu::open(g).map_err(|e| e.to_string())
            };
            match opened {
                Ok(gpu) => {
                    eprintln!("device auto: the GPU, {}", gpu.adapter());
                    run_opts.gpu_auto = false;
                    "gpu"
                }
                Err(why) => {
                    eprintln!("device auto: the CPU ({why})");
                    run_opts.gpu = None;
                    "cpu"
                }
            }
        }
    };
    let model = ModelInfo {
        id,
        aliases,
        created: unix_now(),
        context: run_opts.context_tokens,
        vocab: cfg.vocab_size,
        numerics: numerics.into(),
        approx: run_opts.approx,
        device: device.into(),
    };
    if a.state_dir.is_some() && a.no_prefix_cache {
        anyhow::bail!("--state-dir keeps prompt states for reuse: it cannot go with --no-prefix-cache");
    }
    // The model's identity for stored states: the store's manifest (its weights, spine dtype and
    // checksums); the run's numerics and experts per token are added once the model is open.
    let state_store = match &a.state_dir {
        Some(dir) => {
            let manifest = std::fs::read(store.dir.join("manifest.json")).context("reading the store's manifest")?;
            Some(deltafin_server::StateStoreOptions {
                dir: dir.clone(),
                budget: a.state_budget,
                identity: deltafin_store::checksum::xxh3_64(&manifest),
            })
        }
        None => None,
    };
    let opts = ServeOptions {
        host: a.host,
        port: a.port,
        api_key: a.api_key,
        queue: a.queue,
        max_batch,
        max_body_bytes: usize::try_from(a.max_body_bytes).unwrap_or(usize::MAX),
        keep_alive: Duration::from_secs_f64(a.keep_alive_s),
        prefix_cache: !a.no_prefix_cache,
        state: state_store,
        load_progress: Some(load_progress),
        #[cfg(feature = "test-instruments")]
        instruments: deltafin_server::instruments::Options {
            step_delay: Duration::from_millis(a.instruments.token_delay_ms),
            script: a.instruments.script,
            inject_faults: a.instruments.inject_faults,
            load_delay: Duration::from_millis(a.instruments.load_delay_ms),
        },
    };
    serve(opts, model, tokenizer, move || {
        let session = Session::open(&store, &run_opts)?;
        eprintln!("{}\n  {}", session.plan.describe(), deltafin_engine::os::cpus::report());
        if session.model.run().approx {
            eprintln!("note: APPROXIMATE numerics: {}", session.numerics());
        }
        crate::run::say_device(&session);
        Ok(session)
    })
}

/// `serve --max-batch`: a number of sequences, or `auto` (from the memory plan).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaxBatch {
    Fixed(usize),
    Auto,
}

/// The most sequences `--max-batch auto` picks.
const AUTO_BATCH_CAP: usize = 8;

fn parse_max_batch(s: &str) -> Result<MaxBatch, String> {
    if s == "auto" {
        return Ok(MaxBatch::Auto);
    }
    match s.parse::<usize>() {
        Ok(n) if (1..=256).contains(&n) => Ok(MaxBatch::Fixed(n)),
        _ => Err(format!("'{s}' is neither a number of sequences from 1 to 256 nor 'auto'")),
    }
}
