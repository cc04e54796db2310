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
