//! Sigmoid router with an additive correction bias used for selection only (DeepSeek-V3 / K3).

use deltafin_kernels::ops::sigmoid;

use crate::scratch::Scratch;

/// Pick `top_k` experts from router logits. Shapes: logits, bias `[E]`.
///
/// Scores are `sigmoid(logits)`; selection ranks `score + bias`; the returned weights are the
/// unbiased scores of the chosen experts, renormalised to sum to one when `renormalize` (with
/// the reference's 1e-20 guard), then multiplied by `scaling`. Ties rank the lower id first.
#[allow(clippy::too_many_arguments)]
pub fn select_experts(
    logits: &[f32],
    bias: &[f32],
    top_k: usize,
    renormalize: bool,
    scaling: f32,
    out_ids: &mut Vec<usize>,
    out_weights: &mut Vec<f32>,
    sc: &mut Scratch,
) {
    let mut key = sc.take(logits.len()); // [E] selection score: sigmoid + bias
    for ((k, &l), &b) in key.iter_mut().zip(logits).zip(bias) {
        *k = sigmoid(l) + b;
    }
    let mut order = sc.take_ids(); // [E]
    order.extend(0..logits.len());
    // Only the top k need ordering: partition, then sort those k (ties: lower id first).
    let cmp = |a: &usize, b: &usize| key[*b].total_cmp(&key[*a]).then(a.cmp(b));
    if top_k < order.len() {
        order.select_nth_unstable_by(top_k - 1, cmp);
    }
    order[..top_k].sort_unstable_by(cmp);
    out_ids.clear();
    out_ids.extend_from_slice(&order[..top_k]);
    weights_for(logits, out_ids, renormalize, scaling, out_weights);
    sc.give(key);
    sc.give_ids(order);
}

/// Weights for a given choice of experts (used when the choice is pinned, e.g. to replay another
/// run's routing): the same normalisation as [`select_experts`].
pub fn weights_for(logits: &[f32], ids: &[usize], renormalize: bool, scaling: f32, out_weights: &mut Vec<f32>) {
    out_weights.clear();
    out_weights.extend(ids.iter().map(|&i| sigmoid(logits[i])));
    if ids.len() > 1 && renormalize {
        let denom: f32 = out_weights.iter().sum::<f32>() + 1e-20;
        for w in out_weights.iter_mut() {
            *w /= denom;
        }
    }
    for w in out_weights.iter_mut() {
        *w *= scaling;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bias_selects_but_does_not_weight() {
        let logits = [0.0, 1.0, 2.0, -1.0];
        let bias = [10.0, 0.0, 0.0, 0.0];
        let (mut ids, mut w) = (vec![], vec![]);
        select_experts(&logits, &bias, 2, true, 2.0, &mut ids, &mut w, &mut Scratch::default());
        assert_eq!(ids, vec![0, 2]);
        let (s0, s2) = (sigmoid(0.0), sigmoid(2.0));
        assert!((w[0] - 2.0 * s0 / (s0 + s2)).abs() < 1e-6);
        assert!((w[1] - 2.0 * s2 / (s0 + s2)).abs() < 1e-6);
    }
}
