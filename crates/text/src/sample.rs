//! Token sampling: temperature, top-k and top-p (nucleus) over the logits, reproducible from a
//! seed, and the log-probabilities an API reports beside each token.
//!
//! Temperature 0 is greedy (the arg-max, ties to the lowest id, like [`deltafin_engine::generate::argmax`]).
//! Log-probabilities are those of the model's own distribution (before temperature and
//! truncation), as OpenAI reports them.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy; otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1 = all).
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Seed of the random stream; `None` = seeded from the OS.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 1.0, top_p: 1.0, top_k: 0, seed: None }
    }
}

/// Samples tokens for one generation. Owns reusable buffers: no allocation per token once the
/// first token has sized them.
pub struct Sampler {
    params: SamplingParams,
    rng: SmallRng,
    /// Candidate (id, weight) pairs, sorted by descending logit. `[vocab]` at most.
    cand: Vec<(u32, f32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => SmallRng::seed_from_u64(s),
            None => SmallRng::from_os_rng(),
        };
        Sampler { params, rng, cand: Vec::new() }
    }

    /// Pick the next token from `logits` (`[vocab]`).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.temperature <= 0.0 || p.top_k == 1 {
            return deltafin_engine::generate::argmax(logits);
        }
        self.cand.clear();
        self.cand.extend(logits.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, &l)| (i as u32, l)));
        if self.cand.is_empty() {
            return deltafin_engine::generate::argmax(logits);
        }
        // Descending logit, ties to the lower id: a total order, so results do not depend on
        // the sort algorithm.
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < self.cand.len() {
            self.cand.select_nth_unstable_by(p.top_k - 1, by_logit);
            self.cand.truncate(p.top_k);
        }
        self.cand.sort_unstable_by(by_logit);
        // Softmax at the temperature, in f64 for a stable nucleus cut.
        let max = self.cand[0].1;
        let inv_t = 1.0 / p.temperature as f64;
        let mut total = 0f64;
        for c in self.cand.iter_mut() {
            let w = ((c.1 - max) as f64 * inv_t).exp();
            c.1 = w as f32;
            total += w;
        }
        if p.top_p < 1.0 {
            let mut acc = 0f64;
            let mut keep = self.cand.len();
            for (i, c) in self.cand.iter().enumerate() {
                acc += c.1 as f64 / total;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            self.cand.truncate(keep);
            total = self.cand.iter().map(|c| c.1 as f64).sum();
        }
        let mut r = self.rng.random::<f64>() * total;
        for c in &self.cand {
            r -= c.1 as f64;
            if r < 0.0 {
                return c.0;
            }
        }
        self.cand[self.cand.len() - 1].0
    }
}

/// Log-probability of `token` and the `top` most likely tokens with theirs, from raw logits.
pub struct TokenLogprobs {
    pub logprob: f32,
    /// (id, logprob), most likely first.
    pub top: Vec<(u32, f32)>,
}

pub fn logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let max = logits.iter().copied().filter(|l| l.is_finite()).fold(f32::NEG_INFINITY, f32::max);
    let lse = max as f64 + logits.iter().map(|&l| ((l - max) as f64).exp()).sum::<f64>().ln();
    let lp = |id: u32| (logits[id as usize] as f64 - lse) as f32;
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if best.len() < top || l > best[best.len() - 1].1 {
                let pos = best.partition_point(|b| b.1 >= l);
                best.insert(pos, (i as u32, l));
                best.truncate(top);
            }
        }
    }
    TokenLogprobs { logprob: lp(token), top: best.into_iter().map(|(i, _)| (i, lp(i))).collect() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32, top_k: usize, seed: u64) -> SamplingParams {
        SamplingParams { temperature, top_p, top_k, seed: Some(seed) }
    }

    #[test]
    fn greedy_is_argmax() {
        let logits = [0.1, 3.0, -1.0, 3.0];
        let mut s = Sampler::new(params(0.0, 1.0, 0, 1));
        assert_eq!(s.sample(&logits), 1);
        let mut s = Sampler::new(params(1.0, 1.0, 1, 1));
        assert_eq!(s.sample(&logits), 1);
    }

    #[test]
    fn same_seed_same_tokens_different_seed_differs() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 7919) % 13) as f32 * 0.1).collect();
        let run = |seed| {
            let mut s = Sampler::new(params(1.0, 1.0, 0, seed));
            (0..64).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn frequencies_follow_the_softmax() {
        // Two tokens with logits 0 and ln 3: probabilities 1/4 and 3/4.
        let logits = [0.0, 3f32.ln()];
        let mut s = Sampler::new(params(1.0, 1.0, 0, 42));
        let n = 20_000;
        let ones = (0..n).filter(|_| s.sample(&logits) == 1).count() as f64 / n as f64;
        assert!((ones - 0.75).abs() < 0.02, "{ones}");
        // Temperature 0.5 squares the odds: 1/10 and 9/10.
        let mut s = Sampler::new(params(0.5, 1.0, 0, 42));
        let ones = (0..n).filter(|_| s.sample(&logits) == 1).count() as f64 / n as f64;
        assert!((ones - 0.9).abs() < 0.02, "{ones}");
    }

    #[test]
    fn top_k_and_top_p_truncate() {
        // Probabilities ~ 0.5, 0.3, 0.2 (ln of them as logits).
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let mut s = Sampler::new(params(1.0, 1.0, 2, 3));
        assert!((0..2000).all(|_| s.sample(&logits) != 2));
        let mut s = Sampler::new(params(1.0, 0.5, 0, 3));
        assert!((0..2000).all(|_| s.sample(&logits) == 0));
        let mut s = Sampler::new(params(1.0, 0.7, 0, 3));
        let seen: std::collections::HashSet<u32> = (0..2000).map(|_| s.sample(&logits)).collect();
        assert_eq!(seen, [0, 1].into_iter().collect());
    }

    #[test]
    fn logprobs_are_normalised_and_ranked() {
        let logits = [1.0f32, 2.0, 0.5, 2.0];
        let lp = logprobs(&logits, 2, 3);
        let total: f64 = (0..4).map(|i| (logprobs(&logits, i, 0).logprob as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!(lp.logprob < 0.0);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3, 0]);
        assert!((lp.top[0].1 - lp.top[1].1).abs() < 1e-7);
    }
}
