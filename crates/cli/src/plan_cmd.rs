//! `deltafin plan`: the memory plan for a model that need not be on this machine (a config, or
//! the Kimi K3 release on paper): what stays resident, what is streamed, how large the prompt
//! chunks are, and the bytes each token is expected to read.

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
    let latent_cache: LatentDtype = a.latent_cache.parse().map_err(|e: String| anyhow::anyhow!(e))?;
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
        let plan = make_plan(&m, &Budget::given(b), &req)?;
        let per_token = plan.spine_bytes_per_token + plan.expected_expert_bytes_per_token;
        let longest = longest_context(&m, &Budget::given(b), &req);
        let state_per_1k = state_bytes(&m, 1000, latent_cache.bytes()) - state_bytes(&m, 0, latent_cache.bytes());
        if !a.json {
            println!("{}", plan.describe());
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
        }
        out.push(json!({ "plan": plan, "read_bytes_per_token": per_token, "longest_context": longest,
                         "state_bytes_per_1000_tokens": state_per_1k }));
    }
    if a.json {
        println!(
            "{}",
            json!({
                "model": { "layers": cfg.num_hidden_layers, "experts": cfg.num_experts, "experts_per_token": k,
                           "spine_bytes_int8": m.spine.bytes, "record_bytes": m.experts.record_bytes,
                           "prefill_token_bytes": prefill_token_bytes(&m, k) },
                "plans": out,
            })
        );
    }
    Ok(())
}
