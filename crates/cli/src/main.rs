//! `deltafin`: convert Hugging Face checkpoints into Deltafin stores and run them.

mod bench;
mod bench_streams;
mod chat_turn;
mod drive_limit;
mod gpu_kernel_bench;
mod install_cmd;
mod kernel_bench;
mod plan_cmd;
mod plan_speed;
mod plan_streams;
mod run;
mod serve_cmd;
mod spine_choice;
mod streams;
mod trace_cmd;
mod trace_streams;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use deltafin_store::convert::{ConvertOptions, convert};
use deltafin_store::synth::{SynthOptions, SynthSpine, synth};
use deltafin_store::{ExpertLayout, KeepRule};

#[derive(Parser)]
#[command(name = "deltafin", version, about = "Run giant mixture-of-experts models from local disk")]
struct Cli {
    /// Compute threads (default: every performance core; all cores where they are alike).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Convert a Hugging Face checkpoint into a Deltafin store.
    Convert {
        /// Hugging Face checkpoint directory (config.json, index, shards).
        #[arg(long)]
        from: PathBuf,
        /// Store directory to write.
        #[arg(long)]
        to: PathBuf,
        #[command(flatten)]
        spine: spine_choice::SpineArgs,
        /// int8 scale group along a row; 0 means one scale per row.
        #[arg(long, default_value_t = 0)]
        int8_group: usize,
        /// Keep the MoE routers' gate matrices in f32 whatever --spine says.
        #[arg(long)]
        router_f32: bool,
        /// Store the spine matrices whose name contains NAME as DTYPE (int8, bf16 or f32)
        /// whatever --spine says; repeatable, the first match wins (for example
        /// --keep lm_head=bf16).
        #[arg(long, value_name = "NAME=DTYPE")]
        keep: Vec<KeepRule>,
        /// Routed experts: in-place (read from the checkpoint's shards) or pack (copied into
        /// 4096-aligned per-layer files).
        #[arg(long, default_value = "in-place")]
        experts: ExpertLayout,
    },
    /// Generate text greedily.
    Generate(run::GenerateArgs),
    /// Print the last position's logits for a prompt as JSON.
    Logits(run::LogitsArgs),
    /// Serve the model over HTTP (OpenAI- and Anthropic-compatible).
    Serve(serve_cmd::ServeArgs),
    /// Measure decode speed against the drive's raw bandwidth (fresh process per run).
    Bench(bench::BenchArgs),
    /// Write a store with Kimi K3's real expert geometry and random weights.
    Synth {
        /// Model geometry to copy.
        #[arg(long, default_value = "kimi-k3")]
        preset: String,
        /// MoE layers to write.
        #[arg(long)]
        layers: usize,
        /// Routed experts per layer.
        #[arg(long, default_value_t = 896)]
        experts: usize,
        /// real: K3's per-layer spine (attention, shared experts, full vocab); minimal: only
        /// what routing needs.
        #[arg(long, default_value = "minimal")]
        spine: SynthSpine,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long)]
        out: PathBuf,
    },
    /// Install a model from the Hugging Face Hub (or a Hub-compatible endpoint, or a plain
    /// HTTP mirror of a snapshot): full (resumable, offline after) or streaming (the spine
    /// first, each expert fetched on first use); or upgrade a streaming store to full.
    Install(install_cmd::InstallArgs),
    /// Fetch the experts recorded router traces chose most, into a streaming store.
    Warmup(install_cmd::WarmupArgs),
    /// Router traces.
    #[command(subcommand)]
    Trace(trace_cmd::TraceCmd),
    /// The memory plan for a model config at given budgets (no weights needed): what is
    /// resident, what is streamed, prompt chunk sizes, bytes read per token.
    Plan(plan_cmd::PlanArgs),
    /// Raw O_DIRECT read bandwidth of a store's expert files (the limit bench compares with).
    #[command(hide = true)]
    ProbeDisk(bench::ProbeArgs),
}

fn main() -> ExitCode {
    use std::io::IsTerminal as _;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour codes only for a person's terminal, never into a log file or journal.
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("DELTAFIN_LOG")
                .unwrap_or_else(|_| "warn,deltafin_hub=info,deltafin::request=info".into()),
        )
        .init();
    let cli = Cli::parse();
    if let Err(e) = deltafin_kernels::cpu::requested_path() {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    match dispatch(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            // A read fault's message names layer and expert only (servers pass it to clients);
            // here, on the operator's own terminal, the file and cause help.
            if let Some(f) = e.chain().find_map(|c| c.downcast_ref::<deltafin_engine::fault::ReadFault>()) {
                eprintln!("  detail: {}", f.detail);
            }
            // ENOSPC, wherever it surfaced (a fetched piece, a fill log, the spine file).
            let enospc =
                e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|io| io.raw_os_error() == Some(28)));
            if enospc && !format!("{e:#}").contains("disk is full") {
                eprintln!(
                    "  the disk is full: free space and run the same command again (what was not finished was not recorded as done)"
                );
            }
            ExitCode::FAILURE
        }
    }
}

fn dispatch(cli: Cli) -> Result<()> {
    deltafin_engine::os::cpus::start(cli.threads).map_err(|e| anyhow::anyhow!("--threads: {e}"))?;
    match cli.cmd {
        Cmd::Convert { from, to, spine, int8_group, router_f32, keep, experts } => {
            let (spine, budget_source) = spine.precision()?;
            let opts =
                ConvertOptions { spine, int8_group, router_f32, keep, experts, progress: true, ..Default::default() };
            let t0 = std::time::Instant::now();
            let r = convert(&from, &to, &opts).with_context(|| format!("converting {}", from.display()))?;
            if let (Some(auto), Some(source)) = (r.spine_auto, budget_source) {
                eprintln!("spine: {} ({source})", auto.describe());
            }
            eprintln!(
                "converted {} -> {} in {:.2}s: spine {} bytes ({:?}), {} expert records of {} bytes in {} byte ranges ({:?})",
                from.display(),
                to.display(),
                t0.elapsed().as_secs_f64(),
                r.spine_bytes,
                r.spine_dtype,
                r.expert_records,
                r.record_bytes,
                r.expert_ranges,
                experts
            );
            Ok(())
        }
        Cmd::Generate(a) => run::generate(a),
        Cmd::Logits(a) => run::logits(a),
        Cmd::Serve(a) => serve_cmd::run(a),
        Cmd::Bench(a) => bench::bench(a),
        Cmd::ProbeDisk(a) => bench::probe(a),
        Cmd::Trace(t) => trace_cmd::run(t),
        Cmd::Plan(a) => plan_cmd::plan(a),
        Cmd::Install(a) => install_cmd::install(a),
        Cmd::Warmup(a) => install_cmd::warmup(a),
        Cmd::Synth { preset, layers, experts, spine, seed, out } => {
            if preset != "kimi-k3" {
                bail!("unknown preset '{preset}' (only kimi-k3)");
            }
            let t0 = std::time::Instant::now();
            let m = synth(&out, &SynthOptions { layers, experts, spine, seed, progress: true })?;
            let expert_bytes: u64 = m.experts.layers.len() as u64 * experts as u64 * m.experts.record_bytes;
            eprintln!(
                "wrote {} in {:.1}s: {layers} layers x {experts} experts of {} bytes ({:.2} GB of experts), spine {} bytes",
                out.display(),
                t0.elapsed().as_secs_f64(),
                m.experts.record_bytes,
                expert_bytes as f64 / 1e9,
                m.spine.bytes
            );
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// The test instruments' flags (`serve --script`, `serve --token-delay-ms`,
    /// `serve --inject-faults`).
    const INSTRUMENT_FLAGS: [&str; 3] = ["script", "token-delay-ms", "inject-faults"];

    /// `serve`'s arguments that are test instruments, by id or long flag.
    fn instrument_args() -> Vec<clap::Arg> {
        let cli = super::Cli::command();
        let Some(serve) = cli.find_subcommand("serve") else { panic!("no serve subcommand") };
        serve
            .get_arguments()
            .filter(|a| {
                let id = a.get_id().as_str().replace('_', "-");
                INSTRUMENT_FLAGS.contains(&id.as_str()) || a.get_long().is_some_and(|l| INSTRUMENT_FLAGS.contains(&l))
            })
            .cloned()
            .collect()
    }

    /// A build without the `test-instruments` feature (a release build) has no test flags.
    #[cfg(not(feature = "test-instruments"))]
    #[test]
    fn serve_has_no_test_instruments() {
        let found: Vec<String> = instrument_args().iter().map(|a| a.get_id().to_string()).collect();
        assert!(found.is_empty(), "serve has test-instrument arguments: {found:?}");
        let err =
            <super::Cli as clap::Parser>::try_parse_from(["deltafin", "serve", "--model", "m", "--script", "x"]).err();
        assert_eq!(err.map(|e| e.kind()), Some(clap::error::ErrorKind::UnknownArgument));
    }

    /// The test suite's build has all of them, hidden from `--help` (and the lookup above finds
    /// them, so its emptiness without the feature means something).
    #[cfg(feature = "test-instruments")]
    #[test]
    fn serve_has_hidden_test_instruments() {
        let found = instrument_args();
        let longs: Vec<&str> = found.iter().filter_map(|a| a.get_long()).collect();
        assert_eq!(longs.len(), INSTRUMENT_FLAGS.len(), "{longs:?}");
        assert!(INSTRUMENT_FLAGS.iter().all(|f| longs.contains(f)), "{longs:?}");
        assert!(found.iter().all(|a| a.is_hide_set()), "a test instrument shows in --help");
    }
}
