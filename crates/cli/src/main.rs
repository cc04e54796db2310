//! `deltafin`: convert Hugging Face checkpoints into Deltafin stores and run them.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use deltafin_engine::experts::StoreExperts;
use deltafin_engine::generate::generate_greedy;
use deltafin_engine::k3::K3Model;
use deltafin_engine::tokenizer::Tokenizer;
use deltafin_store::convert::{ConvertOptions, convert};
use deltafin_store::{ExpertLayout, SpineDtype, Store};

#[derive(Parser)]
#[command(
    name = "deltafin",
    version,
    about = "Run giant mixture-of-experts models from local disk"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args)]
struct ModelArgs {
    /// Deltafin store directory (made by `deltafin convert`).
    #[arg(long)]
    model: PathBuf,
    /// Checkpoint directory holding the in-place experts, if it moved since conversion.
    #[arg(long)]
    source: Option<PathBuf>,
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
        /// Storage of spine matrices: int8 (per-row scales), bf16 or f32.
        #[arg(long, default_value = "int8")]
        spine: SpineDtype,
        /// int8 scale group along a row; 0 means one scale per row.
        #[arg(long, default_value_t = 0)]
        int8_group: usize,
        /// Routed experts: in-place (read from the checkpoint's shards) or pack (copied into
        /// 4096-aligned per-layer files).
        #[arg(long, default_value = "in-place")]
        experts: ExpertLayout,
    },
    /// Generate text greedily.
    Generate {
        #[command(flatten)]
        model: ModelArgs,
        /// Prompt text (needs a store with a tokenizer).
        #[arg(long, conflicts_with = "prompt_tokens")]
        prompt: Option<String>,
        /// Prompt token ids, comma separated.
        #[arg(long, value_delimiter = ',')]
        prompt_tokens: Option<Vec<u32>>,
        #[arg(long, default_value_t = 16)]
        max_tokens: usize,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        /// Keep generating past the end-of-message token.
        #[arg(long)]
        ignore_eos: bool,
    },
    /// Print the last position's logits for a prompt as JSON.
    Logits {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long, value_delimiter = ',', required = true)]
        prompt_tokens: Vec<u32>,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("DELTAFIN_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn open_store(m: &ModelArgs) -> Result<Store> {
    Store::open(&m.model, m.source.as_deref())
        .with_context(|| format!("opening store {}", m.model.display()))
}

fn load_tokenizer(store: &Store) -> Result<Option<Tokenizer>> {
    match store.tokenizer_file("tiktoken.model") {
        Some(_) => Ok(Some(Tokenizer::load(&store.dir)?)),
        None => Ok(None),
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Convert {
            from,
            to,
            spine,
            int8_group,
            experts,
        } => {
            let opts = ConvertOptions {
                spine,
                int8_group,
                experts,
                progress: std::io::stderr().is_terminal(),
            };
            let t0 = std::time::Instant::now();
            let r = convert(&from, &to, &opts)
                .with_context(|| format!("converting {}", from.display()))?;
            eprintln!(
                "converted {} -> {} in {:.2}s: spine {} bytes ({:?}), {} expert records of {} bytes in {} byte ranges ({:?})",
                from.display(),
                to.display(),
                t0.elapsed().as_secs_f64(),
                r.spine_bytes,
                spine,
                r.expert_records,
                r.record_bytes,
                r.expert_ranges,
                experts
            );
        }
        Cmd::Generate {
            model,
            prompt,
            prompt_tokens,
            max_tokens,
            json,
            ignore_eos,
        } => {
            let store = open_store(&model)?;
            let tok = load_tokenizer(&store)?;
            let prompt_ids = match (prompt, prompt_tokens) {
                (Some(text), None) => match &tok {
                    Some(t) => t.encode(&text),
                    None => bail!(
                        "this store has no tokenizer; pass --prompt-tokens instead of --prompt"
                    ),
                },
                (None, Some(ids)) => ids,
                _ => bail!("pass exactly one of --prompt or --prompt-tokens"),
            };
            if prompt_ids.is_empty() {
                bail!("the prompt encodes to no tokens");
            }
            let m = K3Model::load(&store)?;
            let mut src = StoreExperts::new(&store);
            let eos = if ignore_eos {
                None
            } else {
                tok.as_ref().and_then(|t| t.eos_id)
            };
            let g = generate_greedy(&m, &mut src, &prompt_ids, max_tokens, eos)?;
            let text = tok.as_ref().map(|t| t.decode(&g.tokens));
            let decode_tps = if g.timing.decode_step_s.is_empty() {
                None
            } else {
                Some(
                    g.timing.decode_step_s.len() as f64
                        / g.timing.decode_step_s.iter().sum::<f64>(),
                )
            };
            if json {
                let out = serde_json::json!({
                    "prompt_tokens": g.prompt_tokens,
                    "tokens": g.tokens,
                    "text": text,
                    "stopped_at_eos": g.stopped_at_eos,
                    "spine_dtype": store.manifest.spine.matrix_dtype,
                    "experts_per_token": m.config.num_experts_per_token,
                    "timing": {
                        "prompt_s": g.timing.prompt_s,
                        "ttft_s": g.timing.prompt_s,
                        "decode_step_s": g.timing.decode_step_s,
                        "decode_tokens_per_s": decode_tps,
                        "total_s": g.timing.total_s,
                        "expert_bytes_read": g.timing.expert_bytes_read,
                    },
                });
                println!("{out}");
            } else {
                match text {
                    Some(t) => println!("{t}"),
                    None => println!(
                        "{}",
                        g.tokens
                            .iter()
                            .map(|t| t.to_string())
                            .collect::<Vec<_>>()
                            .join(",")
                    ),
                }
                eprintln!(
                    "{} prompt tokens, {} generated; prompt {:.3}s, decode {} tok/s, expert bytes read {}",
                    g.prompt_tokens.len(),
                    g.tokens.len(),
                    g.timing.prompt_s,
                    decode_tps
                        .map(|v| format!("{v:.2}"))
                        .unwrap_or_else(|| "-".into()),
                    g.timing.expert_bytes_read
                );
            }
        }
        Cmd::Logits {
            model,
            prompt_tokens,
        } => {
            let store = open_store(&model)?;
            let m = K3Model::load(&store)?;
            let mut src = StoreExperts::new(&store);
            let g = generate_greedy(&m, &mut src, &prompt_tokens, 0, None)?;
            println!("{}", serde_json::json!({ "logits": g.prompt_logits }));
        }
    }
    Ok(())
}
