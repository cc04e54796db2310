//! `install` and `warmup`: the only commands, with runs on a streaming store, that use the
//! network.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use deltafin_engine::plan::parse_size;
use deltafin_hub::fetcher::HubFetcher;
use deltafin_hub::install::{InstallOptions, Mode, env_endpoint, env_http, install as run_install, upgrade};
use deltafin_hub::remote::OriginKind;
use deltafin_hub::warmup;
use deltafin_store::Store;
use deltafin_store::progress::human;

#[derive(clap::Args)]
pub struct InstallArgs {
    /// Repository on the Hub, as org/name (e.g. moonshotai/Kimi-K3).
    #[arg(required_unless_present = "upgrade_to_full", conflicts_with = "upgrade_to_full")]
    pub repo: Option<String>,
    /// Branch, tag or commit; the commit it names now is pinned for the whole install.
    #[arg(long, default_value = "main")]
    pub revision: String,
    /// Store directory to create (or to resume).
    #[arg(long, required_unless_present = "upgrade_to_full")]
    pub to: Option<PathBuf>,
    /// full: the whole checkpoint (resumable; offline afterwards). stream: the spine now, each
    /// routed expert fetched on first use.
    #[arg(long, default_value = "stream", value_parser = ["full", "stream"])]
    pub mode: String,
    #[command(flatten)]
    pub spine: crate::spine_choice::SpineArgs,
    /// Hub-compatible endpoint (default: HF_ENDPOINT, else https://huggingface.co).
    #[arg(long, conflicts_with = "mirror")]
    pub endpoint: Option<String>,
    /// A plain HTTP directory holding the snapshot's files (nginx, an S3 bucket): no Hub API;
    /// sha256 from a SHA256SUMS file there when present.
    #[arg(long)]
    pub mirror: Option<String>,
    /// Fill every absent range of this streaming store, keeping what it has; at the end every
    /// shard is byte-identical to the origin's and checked against its sha256.
    #[arg(long, value_name = "STORE")]
    pub upgrade_to_full: Option<PathBuf>,
    /// Parallel ranged requests.
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// Largest ranged request (e.g. 16M, 256K).
    #[arg(long, default_value = "16M", value_parser = parse_size)]
    pub piece_size: u64,
    /// Do not use a snapshot already in the local Hub cache (HF_HUB_CACHE / HF_HOME).
    #[arg(long)]
    pub no_hub_cache: bool,
    /// Print a JSON report on stdout at the end.
    #[arg(long)]
    pub json: bool,
}

pub fn install(a: InstallArgs) -> Result<()> {
    if a.workers == 0 || a.piece_size == 0 {
        bail!("--workers and --piece-size must be at least 1");
    }
    let quiet = false;
    let t0 = std::time::Instant::now();
    if let Some(store) = &a.upgrade_to_full {
        let r =
            upgrade(store, a.endpoint.as_deref().or(a.mirror.as_deref()), env_http(), a.workers, a.piece_size, quiet)?;
        eprintln!(
            "upgrade done in {:.1} s: downloaded {}, wrote {}, verified {} shard(s)",
            t0.elapsed().as_secs_f64(),
            human(r.downloaded),
            human(r.written),
            r.shards_verified
        );
        if a.json {
            println!("{}", serde_json::to_string(&r)?);
        }
        return Ok(());
    }
    let (repo, to) = match (a.repo, a.to) {
        (Some(r), Some(t)) => (r, t),
        _ => bail!("give REPO and --to STORE (or --upgrade-to-full STORE)"),
    };
    let (kind, endpoint) = match (a.mirror, a.endpoint) {
        (Some(m), _) => (OriginKind::Mirror, m),
        (None, Some(e)) => (OriginKind::Hub, e),
        (None, None) => (OriginKind::Hub, env_endpoint()),
    };
    let (spine, budget_source) = a.spine.precision()?;
    let opts = InstallOptions {
        repo,
        revision: a.revision,
        to: to.clone(),
        mode: if a.mode == "full" { Mode::Full } else { Mode::Stream },
        spine,
        kind,
        endpoint,
        http: env_http(),
        workers: a.workers,
        piece_bytes: a.piece_size,
        quiet,
        use_hub_cache: !a.no_hub_cache,
    };
    let r = run_install(&opts).with_context(|| format!("installing into {}", to.display()))?;
    eprintln!(
        "installed {} ({} mode) at commit {} in {:.1} s: downloaded {}, wrote {}; {} requests, {} retries",
        to.display(),
        a.mode,
        r.commit,
        t0.elapsed().as_secs_f64(),
        human(r.downloaded),
        human(r.written),
        r.requests,
        r.retries
    );
    let auto = deltafin_store::Manifest::load(&to).ok().and_then(|m| m.spine.auto);
    if let (Some(auto), Some(source)) = (auto, budget_source) {
        // A resumed install keeps what auto chose when the store was first converted.
        let when = match spine {
            deltafin_store::SpinePrecision::Auto { budget } if budget == auto.budget => source,
            _ => "chosen when the store was first converted".into(),
        };
        eprintln!("spine: {} ({when})", auto.describe());
    }
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    }
    Ok(())
}

/// Where a streaming store fetches: `--endpoint`, else `HF_ENDPOINT` for a Hub install, else
/// the origin it was installed from.
pub fn fetch_endpoint(store: &Store, flag: Option<&str>) -> String {
    if let Some(e) = flag {
        return e.to_string();
    }
    let origin = store.manifest.origin.as_ref();
    match origin {
        Some(o) if o.kind == "hub" => {
            std::env::var("HF_ENDPOINT").ok().filter(|s| !s.is_empty()).unwrap_or_else(|| o.endpoint.clone())
        }
        Some(o) => o.endpoint.clone(),
        None => env_endpoint(),
    }
}

#[derive(clap::Args)]
pub struct WarmupArgs {
    /// Streaming store.
    #[arg(long = "model")]
    pub store: PathBuf,
    /// Router traces (`deltafin generate --trace FILE`).
    #[arg(long = "trace", required = true, num_args = 1..)]
    pub traces: Vec<PathBuf>,
    /// Fetch at most this many bytes (e.g. 20G); default: every expert the traces chose.
    #[arg(long, value_parser = parse_size)]
    pub budget_bytes: Option<u64>,
    /// Fetch. Without it, warmup only says what it would fetch.
    #[arg(long)]
    pub fetch: bool,
    /// Where to fetch from (see `--endpoint` of generate).
    #[arg(long)]
    pub endpoint: Option<String>,
    /// Experts listed in the plan.
    #[arg(long, default_value_t = 10)]
    pub show: usize,
    /// Print the plan (and stats) as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn warmup(a: WarmupArgs) -> Result<()> {
    let store = Store::open(&a.store, None).with_context(|| format!("opening store {}", a.store.display()))?;
    let counts = warmup::count_choices(&a.traces)?;
    let plan = warmup::plan(&store, &counts, a.budget_bytes)?;
    eprintln!(
        "{} of {} experts on disk; the traces chose {} absent expert(s); the likeliest {} fit the budget: {}",
        plan.present,
        plan.total,
        plan.ranked.len(),
        plan.chosen,
        human(plan.chosen_bytes)
    );
    for (l, e, c) in plan.ranked.iter().take(a.show.min(plan.chosen)) {
        eprintln!("  layer {l:>3} expert {e:>4}: chosen {c} time(s)");
    }
    let mut stats = None;
    if a.fetch {
        let endpoint = fetch_endpoint(&store, a.endpoint.as_deref());
        let f = HubFetcher::open(&store, Some(&endpoint), env_http())?;
        let t0 = std::time::Instant::now();
        warmup::fetch(&f, &plan, false)?;
        let s = deltafin_store::presence::ExpertFetcher::stats(&f);
        eprintln!(
            "fetched {} expert(s) in {:.1} s: downloaded {}, wrote {} to the store",
            s.experts,
            t0.elapsed().as_secs_f64(),
            human(s.bytes_downloaded),
            human(s.bytes_written)
        );
        stats = Some(s);
    } else if plan.chosen > 0 {
        eprintln!("nothing fetched: add --fetch to fetch them");
    }
    if a.json {
        println!(
            "{}",
            serde_json::json!({"plan": {"absent_chosen": plan.ranked.len(), "fit": plan.chosen, "bytes": plan.chosen_bytes, "present": plan.present, "total": plan.total}, "fetched": stats})
        );
    }
    Ok(())
}
