//! Gated MLP with K3's SiTU activation: `down(situ(gate(x), up(x)))`. Used for dense layers and
//! for shared experts.

use anyhow::Result;
use deltafin_kernels::ops::situ;
use deltafin_store::SpineSource;

use crate::scratch::Scratch;
use crate::weights::Linear;

pub struct GatedMlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    pub beta: f32,
    pub linear_beta: Option<f32>,
}

impl GatedMlp {
    /// `prefix` ends with a dot, e.g. `layers.0.mlp.`.
    pub fn load(
        store: &dyn SpineSource,
        prefix: &str,
        hidden: usize,
        inter: usize,
        beta: f32,
        linear_beta: Option<f32>,
    ) -> Result<Self> {
        Ok(GatedMlp {
            gate: Linear::load_shaped(store, &format!("{prefix}gate_proj.weight"), inter, hidden)?,
            up: Linear::load_shaped(store, &format!("{prefix}up_proj.weight"), inter, hidden)?,
            down: Linear::load_shaped(store, &format!("{prefix}down_proj.weight"), hidden, inter)?,
            beta,
            linear_beta,
        })
    }

    /// Shapes: x `[hidden]`, out `[hidden]`.
    pub fn forward(&self, x: &[f32], out: &mut [f32], sc: &mut Scratch) {
        let inter = self.gate.rows;
        let mut g = sc.take(inter); // [inter]
        let mut u = sc.take(inter); // [inter]
        self.gate.forward(x, &mut g);
        self.up.forward(x, &mut u);
        let mut a = sc.take(inter); // [inter]
        situ(&g, &u, self.beta, self.linear_beta, &mut a);
        self.down.forward(&a, out);
        sc.give(g);
        sc.give(u);
        sc.give(a);
    }

    /// [`Self::forward`] for `t_n` tokens at once, bit-identical per token (each matrix is read
    /// once per share of tokens, not once per token). Shapes: xs, outs `[T, hidden]`.
    pub fn forward_batch(&self, xs: &[f32], t_n: usize, outs: &mut [f32], sc: &mut Scratch) {
        if t_n == 1 {
            return self.forward(xs, outs, sc);
        }
        let inter = self.gate.rows;
        let mut g = sc.take(t_n * inter); // [T, inter]
        let mut u = sc.take(t_n * inter); // [T, inter]
        self.gate.forward_batch(xs, t_n, &mut g);
        self.up.forward_batch(xs, t_n, &mut u);
        let mut a = sc.take(t_n * inter); // [T, inter]
        for t in 0..t_n {
            let r = t * inter..(t + 1) * inter;
            situ(&g[r.clone()], &u[r.clone()], self.beta, self.linear_beta, &mut a[r]);
        }
        self.down.forward_batch_exact_inputs(&a, t_n, outs);
        sc.give(g);
        sc.give(u);
        sc.give(a);
    }
}
