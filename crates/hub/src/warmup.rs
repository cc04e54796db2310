//! `deltafin warmup`: rank a streaming store's absent experts by how often recorded router
//! traces chose them, say what fetching the likeliest would cost, and (only when asked) fetch
//! them, likeliest first, within a byte budget.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::Path;

use anyhow::{Context, Result, bail};
use deltafin_store::Store;
use serde::{Deserialize, Serialize};

use crate::fetcher::HubFetcher;

#[derive(Deserialize)]
struct TraceLine {
    #[serde(default)]
    layers: Vec<TraceLayer>,
}

#[derive(Deserialize)]
struct TraceLayer {
    layer: usize,
    experts: Vec<usize>,
}

/// How many times each (layer, expert) was chosen in these trace files (`deltafin generate
/// --trace` JSON lines: a header, then one line per token).
pub fn count_choices(traces: &[impl AsRef<Path>]) -> Result<HashMap<(usize, usize), u64>> {
    let mut counts = HashMap::new();
    for t in traces {
        let t = t.as_ref();
        let f = std::fs::File::open(t).with_context(|| format!("opening trace {}", t.display()))?;
        for (i, line) in BufReader::new(f).lines().enumerate() {
            let line = line.with_context(|| format!("reading trace {}", t.display()))?;
            if i == 0 {
                if !line.contains("deltafin_trace") {
                    bail!("{} is not a Deltafin router trace (its first line is no trace header)", t.display());
                }
                continue;
            }
            if line.trim().is_empty() {
                continue;
            }
            let tok: TraceLine =
                serde_json::from_str(&line).with_context(|| format!("{} line {}", t.display(), i + 1))?;
            for l in tok.layers {
                for e in l.experts {
                    *counts.entry((l.layer, e)).or_insert(0) += 1;
                }
            }
        }
    }
    Ok(counts)
}

#[derive(Debug, Clone, Serialize)]
pub struct WarmupPlan {
    /// Absent experts the traces chose, likeliest first, with their counts.
    pub ranked: Vec<(usize, usize, u64)>,
    /// How many of `ranked` fit the budget.
    pub chosen: usize,
    pub chosen_bytes: u64,
    pub record_bytes: u64,
    pub present: usize,
    pub total: usize,
}

/// Rank the absent experts of `store` by the traces' counts (ties: lower layer, then id).
pub fn plan(store: &Store, counts: &HashMap<(usize, usize), u64>, budget: Option<u64>) -> Result<WarmupPlan> {
    let p = store.experts.presence().context("this store is not a streaming store: every expert is on disk already")?;
    let mut ranked: Vec<(usize, usize, u64)> = counts
        .iter()
        .filter(|((l, e), _)| store.experts.location(*l, *e).is_some() && p.get(*l, *e).is_none())
        .map(|(&(l, e), &c)| (l, e, c))
        .collect();
    ranked.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(&b.0)).then(a.1.cmp(&b.1)));
    let rb = store.experts.record_bytes;
    let fit = budget.map_or(ranked.len(), |b| (b / rb.max(1)) as usize).min(ranked.len());
    let (present, total) = p.count();
    Ok(WarmupPlan { chosen: fit, chosen_bytes: fit as u64 * rb, record_bytes: rb, ranked, present, total })
}

/// Fetch the plan's chosen experts, likeliest first, a layer's batch at a time.
pub fn fetch(fetcher: &HubFetcher, plan: &WarmupPlan, quiet: bool) -> Result<()> {
    let chosen = &plan.ranked[..plan.chosen];
    // Keep the ranking's order, but send each run of one layer's experts as one parallel batch.
    let mut i = 0;
    let progress = deltafin_store::progress::Progress::new("warmup", plan.chosen_bytes, quiet);
    while i < chosen.len() {
        let layer = chosen[i].0;
        let mut batch = Vec::new();
        while i < chosen.len() && batch.len() < 16 {
            if chosen[i].0 != layer {
                break;
            }
            batch.push(chosen[i].1);
            i += 1;
        }
        fetcher.fetch_layer(layer, &batch)?;
        progress.inc(batch.len() as u64 * plan.record_bytes);
    }
    progress.finish();
    Ok(())
}
