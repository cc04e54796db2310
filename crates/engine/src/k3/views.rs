//! How a streamed layer's decoded weights are pointed at another read of their image
//! ([`ImageViews`], used by the spine loader to keep a layer between reads instead of decoding
//! it for every token). Every matrix of every block is a view; vectors are owned copies and stay
//! as they are. The patterns name every field, so a field added to a block without being
//! listed here does not compile; a view missed anyway costs only speed (the loader sees that the
//! old image is still held, and decodes the layer afresh next time).

use std::sync::Arc;

use deltafin_store::ImageBytes;

use super::{Attention, Ffn, Layer};
use crate::blocks::kda::{Gate, Kda};
use crate::blocks::mla::{Mla, QProj};
use crate::blocks::mlp::GatedMlp;
use crate::blocks::moe::LatentMoe;
use crate::stream::spine::ImageViews;

impl ImageViews for Layer {
    fn rebind(&mut self, to: &Arc<dyn ImageBytes>) {
        let Layer { input_norm: _, post_norm: _, res_w: _, attn, ffn } = self;
        match attn {
            Attention::Kda(k) => k.rebind(to),
            Attention::Mla(m) => m.rebind(to),
        }
        match ffn {
            Ffn::Dense(d) => d.rebind(to),
            Ffn::Moe(m) => m.rebind(to),
        }
    }
}

impl ImageViews for Kda {
    fn rebind(&mut self, to: &Arc<dyn ImageBytes>) {
        let Kda {
            heads: _,
            head_dim: _,
            kernel: _,
            q_proj,
            k_proj,
            v_proj,
            conv: _,
            f_a,
            f_b,
            b_proj,
            gate,
            a_log: _,
            dt_bias: _,
            o_norm: _,
            o_proj,
            lower_bound: _,
            eps: _,
        } = self;
        for m in [q_proj, k_proj, v_proj, f_a, f_b, b_proj, o_proj] {
            m.rebind(to);
        }
        match gate {
            Gate::FullRank(g) => g.rebind(to),
            Gate::LowRank(a, b) => {
                a.rebind(to);
                b.rebind(to);
            }
        }
    }
}

impl ImageViews for Mla {
    fn rebind(&mut self, to: &Arc<dyn ImageBytes>) {
        let Mla { heads: _, nope: _, rope: _, v_dim: _, kv_lora: _, q, kv_a, kv_a_norm: _, kv_b, gate, o_proj } = self;
        match q {
            QProj::LowRank { a, norm: _, b } => {
                a.rebind(to);
                b.rebind(to);
            }
            QProj::Full(m) => m.rebind(to),
        }
        for m in [kv_a, kv_b, o_proj] {
            m.rebind(to);
        }
        if let Some(g) = gate {
            g.rebind(to);
        }
    }
}

impl ImageViews for GatedMlp {
    fn rebind(&mut self, to: &Arc<dyn ImageBytes>) {
        let GatedMlp { gate, up, down, beta: _, linear_beta: _ } = self;
        for m in [gate, up, down] {
            m.rebind(to);
        }
    }
}

impl ImageViews for LatentMoe {
    fn rebind(&mut self, to: &Arc<dyn ImageBytes>) {
        let LatentMoe {
            layer: _,
            top_k: _,
            renormalize: _,
            scaling: _,
            gate,
            bias: _,
            down,
            norm: _,
            up,
            shared,
            inter: _,
            latent: _,
            beta: _,
            linear_beta: _,
            eps: _,
            layout: _,
        } = self;
        gate.rebind(to);
        for m in [down, up].into_iter().flatten() {
            m.rebind(to);
        }
        if let Some(s) = shared {
            s.rebind(to);
        }
    }
}
