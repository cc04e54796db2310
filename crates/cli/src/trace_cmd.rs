//! `deltafin trace stats`: replay recorded router traces through the cache policies.

use std::path::PathBuf;

use anyhow::{Result, bail};
use deltafin_engine::stream::cache::Policy;
use deltafin_engine::study::trace::{
    OfflinePolicy, Trace, predictor_precision, predictor_recall, previous_token_recall, read_trace, replay,
    replay_offline, reuse_distances,
};

#[derive(clap::Subcommand)]
pub enum TraceCmd {
    /// Hit rate against cache size per policy and per layer, reuse distances, and the
    /// look-ahead predictor's recall.
    Stats {
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Continuous batching on recorded routing: the traces cut into windows of --window tokens
    /// (whole sequences' consecutive tokens), N windows of different traces decoding together;
    /// per step and MoE layer, the distinct experts their tokens picked against N x top-k.
    Streams {
        #[arg(required = true)]
        files: Vec<PathBuf>,
        #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
        streams: Vec<usize>,
        /// Tokens per window (steps of a batch).
        #[arg(long, default_value_t = 64)]
        window: usize,
        #[arg(long)]
        json: bool,
    },
}

pub fn run(c: TraceCmd) -> Result<()> {
    let files = match c {
        TraceCmd::Stats { files } => files,
        TraceCmd::Streams { files, streams, window, json } => {
            return crate::trace_streams::run(&files, &streams, window, json);
        }
    };
    let mut merged: Option<Trace> = None;
    for f in &files {
        let t = read_trace(f)?;
        match &mut merged {
            None => merged = Some(t),
            Some(m) => {
                if m.header.experts_per_layer != t.header.experts_per_layer {
                    bail!("{}: a different model's trace (experts per layer differ)", f.display());
                }
                let base = m.tokens.iter().map(|t| t.seq + 1).max().unwrap_or(0);
                m.tokens.extend(t.tokens.into_iter().map(|mut x| {
                    x.seq += base;
                    x
                }));
            }
        }
    }
    let Some(t) = merged else { bail!("no trace files") };
    let e = t.header.experts_per_layer;
    println!(
        "{} tokens, {} MoE layers, {} experts per layer, top-{}",
        t.tokens.len(),
        t.header.moe_layers.len(),
        e,
        t.header.experts_per_token
    );
    let mut sizes: Vec<usize> = std::iter::successors(Some(1usize), |s| Some(s * 2)).take_while(|&s| s < e).collect();
    sizes.push(e);
    println!("\nhit rate by cache slots per layer:");
    println!("{:>8} {:>8} {:>8} {:>8} {:>8}", "slots", "lru", "slru", "lfu", "belady");
    for &s in &sizes {
        let (l, _) = replay(&t, Policy::Lru, s);
        let (sl, _) = replay(&t, Policy::Slru, s);
        let lfu = replay_offline(&t, OfflinePolicy::Lfu, s);
        let opt = replay_offline(&t, OfflinePolicy::Belady, s);
        println!("{s:>8} {:>7.1}% {:>7.1}% {:>7.1}% {:>7.1}%", 100.0 * l, 100.0 * sl, 100.0 * lfu, 100.0 * opt);
    }
    println!("(lfu and belady are replayed offline only; belady knows the future: the ceiling)");
    let mid = t.header.experts_per_token.max(1) * 2;
    let (_, per) = replay(&t, Policy::Slru, mid.min(e));
    let mut per: Vec<(usize, f64)> = per.into_iter().collect();
    per.sort_by_key(|(l, _)| *l);
    println!("\nper-layer hit rate, slru, {} slots per layer:", mid.min(e));
    for (l, h) in per {
        println!("  layer {l:>3}: {:>5.1}%", 100.0 * h);
    }
    let (hist, first) = reuse_distances(&t);
    println!("\nreuse distance (tokens since the same expert was used in the same layer):");
    for (label, n) in hist.iter().filter(|(_, n)| *n > 0) {
        println!("  {label:>8}: {n}");
    }
    println!("  {:>8}: {first}", "first use");
    println!(
        "\nprevious token's experts, recall at top-{}: {:.1}%",
        t.header.experts_per_token,
        100.0 * previous_token_recall(&t)
    );
    match (predictor_recall(&t), predictor_precision(&t)) {
        (Some(r), Some(p)) => println!(
            "look-ahead predictor recall {:.1}%, precision {:.1}% (next layer's router on this layer's input)",
            100.0 * r,
            100.0 * p
        ),
        _ => println!("look-ahead predictor recall: no predictions in these traces"),
    }
    Ok(())
}
