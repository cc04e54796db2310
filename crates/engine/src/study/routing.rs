//! Routing overrides: replace the router's choice before each token (the `pinned` routing
//! mechanism), to study caches with realistic or tunable locality on stores whose random routers
//! are uniform.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::trace::Trace;
use crate::k3::{K3Model, K3State};

pub enum RoutingOverride {
    /// Replay a recorded trace, token by token (wrapping around): each layer's picks and its
    /// recorded prediction of the next layer's.
    Trace { trace: Trace, next: usize },
    /// Each expert repeats one of the previous token's picks in its layer with probability
    /// `locality`, else is uniform among the rest.
    Synthetic { locality: f64, rng: SmallRng },
}

impl RoutingOverride {
    pub fn synthetic(locality: f64, seed: u64) -> Self {
        RoutingOverride::Synthetic { locality, rng: SmallRng::seed_from_u64(seed) }
    }

    /// Pin the next token's experts in `st`.
    pub fn apply(&mut self, model: &K3Model, st: &mut K3State) {
        let experts = model.config.num_experts;
        let k = model.config.num_experts_per_token;
        match self {
            RoutingOverride::Trace { trace, next } => {
                if trace.tokens.is_empty() {
                    return;
                }
                let t = &trace.tokens[*next % trace.tokens.len()];
                *next += 1;
                // The trace's i-th MoE layer drives the model's i-th MoE layer (a trace of one
                // model replayed on a store of another shape: its first layers, in order).
                let moe = (0..model.layers.len()).filter(|&l| model.config.is_moe_layer(l));
                for (tl, l) in t.layers.iter().zip(moe) {
                    if let Some(r) = st.routing.get_mut(l) {
                        r.experts = tl.experts.iter().copied().filter(|&e| e < experts).take(k).collect();
                        r.pinned = !r.experts.is_empty();
                        // The recorded look-ahead, so that prefetch replays the trained predictor.
                        r.pinned_next = tl.predicted_next.iter().copied().filter(|&e| e < experts).collect();
                    }
                }
            }
            RoutingOverride::Synthetic { locality, rng } => {
                for l in 0..model.layers.len() {
                    if !model.config.is_moe_layer(l) {
                        continue;
                    }
                    let prev = std::mem::take(&mut st.routing[l].experts);
                    let mut pick: Vec<usize> = Vec::with_capacity(k);
                    while pick.len() < k {
                        let e = if !prev.is_empty() && rng.random_bool(*locality) {
                            prev[rng.random_range(0..prev.len())]
                        } else {
                            rng.random_range(0..experts)
                        };
                        if !pick.contains(&e) {
                            pick.push(e);
                        }
                    }
                    st.routing[l].experts = pick;
                    st.routing[l].pinned = true;
                }
            }
        }
    }
}
