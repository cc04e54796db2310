//! Router traces: what every token picked in every MoE layer, written as JSON lines, and their
//! offline replay through the cache policies (`deltafin trace stats`).
//!
//! Tracing is off by default; when off nothing is recorded or formatted.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use crate::blocks::moe::Routing;
use crate::stream::cache::{LayerCache, Policy};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TraceHeader {
    pub deltafin_trace: u32,
    pub experts_per_layer: usize,
    pub experts_per_token: usize,
    pub moe_layers: Vec<usize>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TraceLayer {
    pub layer: usize,
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
    /// The next MoE layer's experts predicted from this layer's input.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub predicted_next: Vec<usize>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TraceToken {
    /// Sequence (request) number within the file.
    pub seq: usize,
    pub pos: usize,
    pub token: u32,
    pub layers: Vec<TraceLayer>,
}

pub struct TraceWriter {
    w: BufWriter<File>,
    moe_layers: Vec<usize>,
}

impl TraceWriter {
    pub fn create(path: &Path, header: TraceHeader) -> Result<Self> {
        let f = File::create(path).with_context(|| format!("creating trace {}", path.display()))?;
        let mut w = BufWriter::new(f);
        serde_json::to_writer(&mut w, &header)?;
        w.write_all(b"\n")?;
        Ok(TraceWriter { w, moe_layers: header.moe_layers })
    }

    pub fn record(&mut self, seq: usize, pos: usize, token: u32, routing: &[Routing]) -> Result<()> {
        let layers = self
            .moe_layers
            .iter()
            .filter_map(|&l| routing.get(l).map(|r| (l, r)))
            .map(|(l, r)| TraceLayer {
                layer: l,
                experts: r.experts.clone(),
                weights: r.weights.clone(),
                predicted_next: r.predicted_next.clone(),
            })
            .collect();
        serde_json::to_writer(&mut self.w, &TraceToken { seq, pos, token, layers })?;
        self.w.write_all(b"\n")?;
        Ok(())
    }

    pub fn finish(mut self) -> Result<()> {
        self.w.flush()?;
        Ok(())
    }
}

pub struct Trace {
    pub header: TraceHeader,
    pub tokens: Vec<TraceToken>,
}

pub fn read_trace(path: &Path) -> Result<Trace> {
    let f = File::open(path).with_context(|| format!("opening trace {}", path.display()))?;
    let mut lines = BufReader::new(f).lines();
    let first = lines.next().with_context(|| format!("{}: empty trace", path.display()))??;
    let header: TraceHeader =
        serde_json::from_str(&first).with_context(|| format!("{}: line 1 is not a trace header", path.display()))?;
    if header.deltafin_trace != 1 {
        bail!("{}: trace version {} is not supported", path.display(), header.deltafin_trace);
    }
    let mut tokens = Vec::new();
    for (i, line) in lines.enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let t: TraceToken =
            serde_json::from_str(&line).with_context(|| format!("{}: line {}", path.display(), i + 2))?;
        for l in &t.layers {
            if l.experts.iter().any(|&e| e >= header.experts_per_layer) {
                bail!("{}: line {}: expert id out of range", path.display(), i + 2);
            }
        }
        tokens.push(t);
    }
    Ok(Trace { header, tokens })
}

/// Hit rate of one policy at one per-layer capacity over a trace (caches start cold and persist
/// across the sequences of a file, as in a server).
pub fn replay(trace: &Trace, policy: Policy, capacity: usize) -> (f64, HashMap<usize, f64>) {
    let mut caches: HashMap<usize, LayerCache<()>> = HashMap::new();
    let mut per: HashMap<usize, (u64, u64)> = HashMap::new();
    let mut evicted = Vec::new();
    for t in &trace.tokens {
        for l in &t.layers {
            let c = caches.entry(l.layer).or_insert_with(|| LayerCache::new(capacity, policy));
            let s = per.entry(l.layer).or_default();
            for &e in &l.experts {
                s.1 += 1;
                if c.get(e).is_some() {
                    s.0 += 1;
                } else {
                    let _ = c.insert(e, (), &mut evicted);
                    evicted.clear();
                }
            }
        }
    }
    let (h, n) = per.values().fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    let per_layer = per.into_iter().map(|(l, (h, n))| (l, h as f64 / n.max(1) as f64)).collect();
    (h as f64 / n.max(1) as f64, per_layer)
}

/// Reuse distance in tokens (same layer, same sequence): histogram over buckets 1, 2, 3-4,
/// 5-8, ... and "first use".
pub fn reuse_distances(trace: &Trace) -> (Vec<(String, u64)>, u64) {
    let mut last: HashMap<(usize, usize, usize), usize> = HashMap::new();
    let mut buckets = vec![0u64; 12];
    let mut first = 0u64;
    for t in &trace.tokens {
        for l in &t.layers {
            for &e in &l.experts {
                match last.insert((t.seq, l.layer, e), t.pos) {
                    Some(p) if t.pos > p => {
                        let d = t.pos - p;
                        let b = (usize::BITS - (d - 1).leading_zeros()) as usize;
                        buckets[b.min(11)] += 1;
                    }
                    _ => first += 1,
                }
            }
        }
    }
    let labels = (0..12)
        .map(|b| match b {
            0 => "1".to_string(),
            11 => format!(">{}", 1 << 10),
            _ => format!("{}-{}", (1 << (b - 1)) + 1, 1 << b),
        })
        .zip(buckets)
        .collect();
    (labels, first)
}

/// Recall of the look-ahead predictor: of the experts a layer actually used, the fraction the
/// previous MoE layer's prediction named. `None` when the trace holds no predictions.
pub fn predictor_recall(trace: &Trace) -> Option<f64> {
    let (mut hit, mut n) = (0u64, 0u64);
    for t in &trace.tokens {
        for w in t.layers.windows(2) {
            if w[0].predicted_next.is_empty() {
                continue;
            }
            n += w[1].experts.len() as u64;
            hit += w[1].experts.iter().filter(|e| w[0].predicted_next.contains(e)).count() as u64;
        }
    }
    (n > 0).then(|| hit as f64 / n as f64)
}

/// Policies replayed offline only (the live cache runs [`Policy`]): least frequently used, and
/// Belady's optimum, which knows the future (the ceiling no policy can beat).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OfflinePolicy {
    /// Evict the entry used least often so far (ties: the least recent).
    Lfu,
    /// Evict the entry whose next use is farthest away (never used again first).
    Belady,
}

/// Hit rate of an offline policy at one per-layer capacity over a trace, as [`replay`] counts:
/// a token's experts are looked up in the order listed, and a miss is inserted (evicting one
/// entry the token itself does not use, when one exists; Belady passes a miss through instead
/// when it is needed later than every cached entry).
pub fn replay_offline(trace: &Trace, policy: OfflinePolicy, capacity: usize) -> f64 {
    // Per layer, the sequence of accesses (token index, expert).
    let mut accesses: HashMap<usize, Vec<(usize, usize)>> = HashMap::new();
    for (ti, t) in trace.tokens.iter().enumerate() {
        for l in &t.layers {
            accesses.entry(l.layer).or_default().extend(l.experts.iter().map(|&e| (ti, e)));
        }
    }
    let (mut hits, mut total) = (0u64, 0u64);
    for acc in accesses.values() {
        // next[i]: the token index of the next access to acc[i]'s expert after acc[i]'s token.
        let mut next = vec![usize::MAX; acc.len()];
        let mut seen: HashMap<usize, usize> = HashMap::new();
        for i in (0..acc.len()).rev() {
            let (ti, e) = acc[i];
            next[i] = seen.get(&e).copied().filter(|&n| n > ti).unwrap_or(usize::MAX);
            // A later access of the same token does not count as the next use.
            if seen.get(&e).is_none_or(|&n| n > ti) {
                seen.insert(e, ti);
            }
        }
        // Cached expert -> (next use, uses so far, last use).
        let mut cache: HashMap<usize, (usize, u64, usize)> = HashMap::new();
        let mut uses: HashMap<usize, u64> = HashMap::new();
        for (i, &(ti, e)) in acc.iter().enumerate() {
            total += 1;
            let n_uses = {
                let u = uses.entry(e).or_default();
                *u += 1;
                *u
            };
            if let Some(entry) = cache.get_mut(&e) {
                hits += 1;
                *entry = (next[i], n_uses, ti);
                continue;
            }
            if capacity == 0 {
                continue;
            }
            if cache.len() >= capacity {
                let victim = cache
                    .iter()
                    .filter(|(_, v)| v.2 < ti) // not one of this token's own experts
                    .max_by_key(|(k, v)| match policy {
                        OfflinePolicy::Belady => (v.0 as u64, 0, **k),
                        // Fewest uses first, then least recent: the largest key is the victim.
                        OfflinePolicy::Lfu => (u64::MAX - v.1, usize::MAX - v.2, **k),
                    })
                    .map(|(k, _)| *k);
                match victim {
                    // The optimum also declines to cache an expert needed later than every
                    // cached one (a cache may always pass a record through without keeping it).
                    Some(k) if policy == OfflinePolicy::Belady && cache[&k].0 <= next[i] => continue,
                    Some(k) => {
                        cache.remove(&k);
                    }
                    None => continue,
                }
            }
            cache.insert(e, (next[i], n_uses, ti));
        }
    }
    hits as f64 / total.max(1) as f64
}

/// Of each token's experts (per layer, within a sequence), the fraction the previous token of
/// the same sequence also used in that layer: the previous token's experts' recall at top-k.
pub fn previous_token_recall(trace: &Trace) -> f64 {
    let (mut hit, mut n) = (0u64, 0u64);
    for w in trace.tokens.windows(2) {
        if w[0].seq != w[1].seq || w[1].pos != w[0].pos + 1 {
            continue;
        }
        for (a, b) in w[0].layers.iter().zip(&w[1].layers) {
            n += b.experts.len() as u64;
            hit += b.experts.iter().filter(|e| a.experts.contains(e)).count() as u64;
        }
    }
    hit as f64 / n.max(1) as f64
}

/// Precision of the look-ahead predictor: of the experts it named for the next MoE layer, the
/// fraction that layer used. `None` when the trace holds no predictions.
pub fn predictor_precision(trace: &Trace) -> Option<f64> {
    let (mut hit, mut n) = (0u64, 0u64);
    for t in &trace.tokens {
        for w in t.layers.windows(2) {
            n += w[0].predicted_next.len() as u64;
            hit += w[0].predicted_next.iter().filter(|e| w[1].experts.contains(e)).count() as u64;
        }
    }
    (n > 0).then(|| hit as f64 / n as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(picks: &[&[usize]]) -> Trace {
        let header = TraceHeader { deltafin_trace: 1, experts_per_layer: 8, experts_per_token: 1, moe_layers: vec![1] };
        let tokens = picks
            .iter()
            .enumerate()
            .map(|(pos, p)| TraceToken {
                seq: 0,
                pos,
                token: 0,
                layers: vec![TraceLayer {
                    layer: 1,
                    experts: p.to_vec(),
                    weights: vec![1.0; p.len()],
                    predicted_next: Vec::new(),
                }],
            })
            .collect();
        Trace { header, tokens }
    }

    #[test]
    fn belady_is_the_ceiling_and_lfu_keeps_the_frequent() {
        // 1 is used every other token; 2..6 once each in between.
        let t = trace(&[&[1], &[2], &[1], &[3], &[1], &[4], &[1], &[5], &[1], &[6]]);
        // One slot: LRU and SLRU always evict 1 for the one-off expert; Belady keeps 1 (4 hits).
        assert_eq!(replay_offline(&t, OfflinePolicy::Belady, 1), 0.4);
        let (lru, _) = replay(&t, Policy::Lru, 1);
        assert_eq!(lru, 0.0);
        // Two slots: LFU keeps 1 (used most) and cycles the other slot.
        assert_eq!(replay_offline(&t, OfflinePolicy::Lfu, 2), 0.4);
        for cap in 1..=4 {
            let b = replay_offline(&t, OfflinePolicy::Belady, cap);
            for p in [Policy::Lru, Policy::Slru] {
                assert!(b >= replay(&t, p, cap).0, "Belady below {p:?} at {cap} slots");
            }
            assert!(b >= replay_offline(&t, OfflinePolicy::Lfu, cap));
        }
    }

    #[test]
    fn previous_token_recall_counts_what_the_last_token_also_used() {
        let t = trace(&[&[1, 2], &[2, 3], &[3, 4], &[5, 6]]);
        // 2 of token 1's, 3 of token 2's, none of token 3's: 2 of 6.
        assert!((previous_token_recall(&t) - 2.0 / 6.0).abs() < 1e-12);
    }
}
