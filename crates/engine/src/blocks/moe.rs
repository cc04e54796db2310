//! Latent mixture-of-experts (Kimi K3): the router picks experts on the full hidden state; the
//! chosen experts work in a narrower latent space,
//! `y = up(norm(sum_k w_k E_k(down(x)))) + shared(x)`.
//!
//! Routed-expert weights arrive only through [`ExpertSource`] as MXFP4 records.

use anyhow::Result;
use deltafin_kernels::approx::expert_mxfp4_approx;
use deltafin_kernels::expert::{Mxfp4, expert_mxfp4};
use deltafin_kernels::ops::rms_norm_inplace;
use deltafin_store::{K3Config, SpineSource};

use super::mlp::GatedMlp;
use super::router::{select_experts, weights_for};
use crate::experts::{ExpertSource, RecordLayout};
use crate::scratch::Scratch;
use crate::weights::{Linear, load_vec};

pub struct LatentMoe {
    pub layer: usize,
    pub top_k: usize,
    pub renormalize: bool,
    pub scaling: f32,
    /// `[E, H]`.
    pub gate: Linear,
    /// `[E]`.
    pub bias: Vec<f32>,
    /// `[LAT, H]`, absent when experts work at full width.
    pub down: Option<Linear>,
    /// `[LAT]`.
    pub norm: Option<Vec<f32>>,
    /// `[H, LAT]`.
    pub up: Option<Linear>,
    pub shared: Option<GatedMlp>,
    pub inter: usize,
    pub latent: usize,
    pub beta: f32,
    pub linear_beta: Option<f32>,
    pub eps: f32,
    /// Where the six tensors sit in this store's expert records.
    pub layout: RecordLayout,
}

/// How one MoE step runs beyond its input.
#[derive(Clone, Copy, Default)]
pub struct MoeRun<'a> {
    /// The next MoE layer, whose router predicts its picks from this layer's input.
    pub next: Option<&'a LatentMoe>,
    /// Hint the prediction to the expert source (prefetch).
    pub hint: bool,
    /// Approximate mode: int8 activations for the routed experts.
    pub approx: bool,
}

/// What the router chose for one token of one layer (kept for traces and tests).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Routing {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
    /// When set, the next token uses `experts` as given instead of the router's choice (weights
    /// still come from this run's router scores). For studies that separate routing flips from
    /// numerical error.
    pub pinned: bool,
    /// The next MoE layer's experts as predicted from this layer's input (empty unless the
    /// model predicts: for prefetch or for a trace).
    pub predicted_next: Vec<usize>,
}

impl LatentMoe {
    pub fn load(store: &dyn SpineSource, layer: usize, c: &K3Config, layout: &RecordLayout) -> Result<Self> {
        let p = format!("layers.{layer}.block_sparse_moe.");
        let h = c.hidden_size;
        let lat = c.expert_input_dim();
        let (down, norm, up) = match c.routed_expert_hidden_size {
            Some(l) => (
                Some(Linear::load_shaped(store, &format!("{p}routed_expert_down_proj.weight"), l, h)?),
                if c.latent_moe_use_norm {
                    Some(load_vec(store, &format!("{p}routed_expert_norm.weight"), l)?)
                } else {
                    None
                },
                Some(Linear::load_shaped(store, &format!("{p}routed_expert_up_proj.weight"), h, l)?),
            ),
            None => (None, None, None),
        };
        let shared = if c.num_shared_experts > 0 {
            let si = c.moe_intermediate_size * c.num_shared_experts;
            Some(GatedMlp::load(
                store,
                &format!("{p}shared_experts."),
                h,
                si,
                c.situ_beta(),
                c.activation_situ_linear_beta,
            )?)
        } else {
            None
        };
        Ok(LatentMoe {
            layer,
            top_k: c.num_experts_per_token,
            renormalize: c.moe_renormalize,
            scaling: c.routed_scaling_factor,
            gate: Linear::load_shaped(store, &format!("{p}gate.weight"), c.num_experts, h)?,
            bias: load_vec(store, &format!("{p}gate.e_score_correction_bias"), c.num_experts)?,
            down,
            norm,
            up,
            shared,
            inter: c.moe_intermediate_size,
            latent: lat,
            beta: c.situ_beta(),
            linear_beta: c.activation_situ_linear_beta,
            eps: c.rms_norm_eps,
            layout: layout.clone(),
        })
    }

    /// The experts this layer's router would pick for `x` (used on an earlier layer's hidden
    /// state to predict this layer's picks for prefetch). Shape: x `[hidden]`.
    pub fn predict(&self, x: &[f32], ids: &mut Vec<usize>, sc: &mut Scratch) {
        let mut logits = sc.take(self.gate.rows); // [E]
        self.gate.forward(x, &mut logits);
        let mut w = sc.take(0);
        select_experts(&logits, &self.bias, self.top_k, self.renormalize, self.scaling, ids, &mut w, sc);
        sc.give(w);
        sc.give(logits);
    }

    /// One token. Shapes: x `[hidden]` (already normed), out `[hidden]`.
    ///
    /// Reads for the chosen experts start as soon as the router has picked them; the shared
    /// experts (and, with `next`, the next MoE layer's router: its prediction is recorded, and
    /// hinted to the source for prefetch when the flag is set) run while they are in flight;
    /// each expert is computed when its record arrives, into its own slot, and the slots are
    /// summed in routing order so the result does not depend on arrival order.
    pub fn forward(
        &self,
        x: &[f32],
        experts: &mut dyn ExpertSource,
        run: MoeRun<'_>,
        routing: &mut Routing,
        out: &mut [f32],
        sc: &mut Scratch,
    ) -> Result<()> {
        let mut logits = sc.take(self.gate.rows); // [E]
        self.gate.forward(x, &mut logits);
        if routing.pinned {
            anyhow::ensure!(routing.experts.iter().all(|&e| e < self.gate.rows), "pinned expert id out of range");
            weights_for(&logits, &routing.experts, self.renormalize, self.scaling, &mut routing.weights);
        } else {
            select_experts(
                &logits,
                &self.bias,
                self.top_k,
                self.renormalize,
                self.scaling,
                &mut routing.experts,
                &mut routing.weights,
                sc,
            );
        }
        experts.begin(self.layer, &routing.experts)?;

        let mut shared = sc.take(out.len()); // [hidden]
        if let Some(sh) = &self.shared {
            sh.forward(x, &mut shared, sc);
        }
        routing.predicted_next.clear();
        if let Some(n) = run.next {
            n.predict(x, &mut routing.predicted_next, sc);
            if run.hint {
                experts.prefetch(n.layer, &routing.predicted_next)?;
            }
        }

        let mut xl = sc.take(self.latent); // [LAT]
        match &self.down {
            Some(d) => d.forward(x, &mut xl),
            None => xl.copy_from_slice(x),
        }
        let (i, lat) = (self.inter, self.latent);
        let k = routing.experts.len();
        let mut eo = sc.take(k * lat); // [k, LAT] each expert's output, in routing order
        let mut a = sc.take(i); // [I] SiTU activations of the expert being computed
        let mut gu = sc.take(if run.approx { i } else { 0 }); // [I] gate products (approximate mode)
        let (mut xq, mut aq) = (std::mem::take(&mut sc.xq), std::mem::take(&mut sc.aq));
        if run.approx {
            xq.quantize(&xl);
        }
        let mut done = sc.take_ids(); // [k] 1 once an expert's record has been computed
        done.resize(k, 0);
        let layout = &self.layout;
        experts.drain(&mut |slot, record| {
            anyhow::ensure!(record.len() >= layout.record_bytes, "expert record is too short");
            // w1 = gate, w3 = up: [I, LAT]; w2 = down: [LAT, I]. One fused pass per expert.
            let m = |p: usize| Mxfp4 { packed: layout.part(record, p), scales: layout.part(record, p + 1) };
            let out = &mut eo[slot * lat..(slot + 1) * lat];
            if run.approx {
                expert_mxfp4_approx(
                    m(0),
                    m(4),
                    m(2),
                    i,
                    lat,
                    &xq,
                    self.beta,
                    self.linear_beta,
                    &mut gu,
                    &mut a,
                    &mut aq,
                    out,
                );
            } else {
                expert_mxfp4(m(0), m(4), m(2), i, lat, &xl, self.beta, self.linear_beta, &mut a, out);
            }
            done[slot] = 1;
            Ok(())
        })?;
        anyhow::ensure!(
            done.iter().all(|&d| d == 1),
            "expert source did not deliver every expert of layer {}",
            self.layer
        );
        let mut acc = sc.take(lat); // [LAT] weighted sum of expert outputs
        for (slot, &w) in routing.weights.iter().enumerate() {
            for (s, &v) in acc.iter_mut().zip(&eo[slot * lat..(slot + 1) * lat]) {
                *s += w * v;
            }
        }
        if let Some(n) = &self.norm {
            rms_norm_inplace(&mut acc, n, self.eps);
        }
        match &self.up {
            Some(up) => up.forward(&acc, out),
            None => out.copy_from_slice(&acc),
        }
        if self.shared.is_some() {
            for (o, v) in out.iter_mut().zip(&shared) {
                *o += v;
            }
        }
        for buf in [logits, shared, xl, eo, a, gu, acc] {
            sc.give(buf);
        }
        (sc.xq, sc.aq) = (xq, aq);
        sc.give_ids(done);
        Ok(())
    }
}
