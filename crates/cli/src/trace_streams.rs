//! `deltafin trace streams`: how much a continuous batch shares on recorded routing. The traces
//! are cut into windows of consecutive tokens of one sequence; N windows, taken from the traces
//! in turn (so that streams are different conversations), step together: at step t each feeds
//! its t-th token. Per step and MoE layer the batch reads the union of its tokens' picks once;
//! without sharing it would read N x top-k. What the cache already holds is left out: these are
//! the records a step needs, the most it can read.

use std::collections::HashSet;
use std::path::PathBuf;

use anyhow::{Result, bail};
use deltafin_engine::study::trace::{TraceToken, read_trace};
use serde_json::json;

pub fn run(files: &[PathBuf], streams: &[usize], window: usize, json_out: bool) -> Result<()> {
    if window == 0 {
        bail!("--window must be at least 1");
    }
    // Windows per trace file, each a run of one sequence's tokens in order.
    let mut per_file: Vec<Vec<Vec<TraceToken>>> = Vec::new();
    let mut header = None;
    for f in files {
        let t = read_trace(f)?;
        if let Some(h) = &header
            && *h != (t.header.experts_per_layer, t.header.experts_per_token)
        {
            bail!("{}: a different model's trace (experts per layer or per token differ)", f.display());
        }
        header = Some((t.header.experts_per_layer, t.header.experts_per_token));
        let mut tokens = t.tokens;
        tokens.sort_by_key(|x| (x.seq, x.pos));
        let mut windows = Vec::new();
        for seq in tokens.chunk_by(|a, b| a.seq == b.seq) {
            windows.extend(seq.chunks_exact(window).map(|w| w.to_vec()));
        }
        per_file.push(windows);
    }
    let Some((experts, k)) = header else { bail!("no trace files") };
    // Round-robin over the files: stream j is the next window of file j mod files.
    let mut order: Vec<&Vec<TraceToken>> = Vec::new();
    let most = per_file.iter().map(Vec::len).max().unwrap_or(0);
    for i in 0..most {
        order.extend(per_file.iter().filter_map(|w| w.get(i)));
    }
    let mut rows = Vec::new();
    for &n in streams {
        if n == 0 || n > order.len() {
            bail!("--streams {n}: the traces hold {} windows of {window} tokens", order.len());
        }
        // Groups of n windows, as many as there are; every step of every group.
        let (mut distinct, mut cells) = (0usize, 0usize);
        for group in order.chunks_exact(n) {
            for t in 0..window {
                let mut by_layer: std::collections::BTreeMap<usize, HashSet<usize>> = Default::default();
                for w in group {
                    for l in &w[t].layers {
                        by_layer.entry(l.layer).or_default().extend(l.experts.iter().copied());
                    }
                }
                distinct += by_layer.values().map(HashSet::len).sum::<usize>();
                cells += by_layer.len();
            }
        }
        let per_step = distinct as f64 / cells.max(1) as f64;
        // A router that picked uniformly at random would share this many.
        let random = experts as f64 * (1.0 - (1.0 - k as f64 / experts as f64).powi(n as i32));
        rows.push(json!({
            "streams": n,
            "groups": order.len() / n,
            "distinct_experts_per_layer_per_step": per_step,
            "experts_per_layer_per_step_if_unshared": n * k,
            "expert_reads_per_generated_token_vs_solo": per_step / (n * k) as f64,
            "distinct_if_routing_were_uniform": random,
        }));
    }
    if json_out {
        println!(
            "{}",
            json!({ "window": window, "windows": order.len(), "experts_per_layer": experts, "experts_per_token": k, "rows": rows })
        );
        return Ok(());
    }
    println!(
        "{} windows of {window} tokens from {} trace file(s); {experts} experts per layer, top-{k}",
        order.len(),
        files.len()
    );
    println!(
        "{:>7} | {:>6} | {:>22} | {:>9} | {:>20} | {:>16}",
        "streams", "groups", "distinct/layer/step", "unshared", "expert reads/token", "if uniform"
    );
    for r in &rows {
        let f = |key: &str| r[key].as_f64().unwrap_or(f64::NAN);
        println!(
            "{:>7} | {:>6} | {:>22.2} | {:>9} | {:>19.3}x | {:>16.2}",
            r["streams"].as_u64().unwrap_or(0),
            r["groups"].as_u64().unwrap_or(0),
            f("distinct_experts_per_layer_per_step"),
            r["experts_per_layer_per_step_if_unshared"].as_u64().unwrap_or(0),
            f("expert_reads_per_generated_token_vs_solo"),
            f("distinct_if_routing_were_uniform"),
        );
    }
    println!("expert reads/token: the records a step needs per generated token, against one stream's top-{k}");
    Ok(())
}
