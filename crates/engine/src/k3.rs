//! The Kimi K3 text model: embeddings, 93 hybrid layers (KDA or NoPE MLA attention; dense or
//! latent-MoE MLP) joined by block attention residuals, final norm, head.

use anyhow::{Context, Result};
use deltafin_kernels::ops::rms_norm;
use deltafin_store::{AttnKind, K3Config, Store};

use crate::blocks::attn_res::{ResidualBlocks, effective_weight};
use crate::blocks::kda::{Kda, KdaState};
use crate::blocks::mla::{Mla, MlaState};
use crate::blocks::mlp::GatedMlp;
use crate::blocks::moe::{LatentMoe, Routing};
use crate::experts::{ExpertSource, RecordLayout};
use crate::weights::{Linear, load_vec};

pub enum Attention {
    Kda(Box<Kda>),
    Mla(Box<Mla>),
}

pub enum Ffn {
    Dense(Box<GatedMlp>),
    Moe(Box<LatentMoe>),
}

pub struct Layer {
    /// `[H]`.
    pub input_norm: Vec<f32>,
    /// `[H]`.
    pub post_norm: Vec<f32>,
    /// Attention-residual effective weights `[H]` before attention and before the MLP.
    pub res_w: Option<(Vec<f32>, Vec<f32>)>,
    pub attn: Attention,
    pub ffn: Ffn,
}

pub struct K3Model {
    pub config: K3Config,
    /// `[vocab, H]`.
    pub embed: Linear,
    pub layers: Vec<Layer>,
    /// `[H]`.
    pub norm: Vec<f32>,
    /// `[H]`.
    pub output_res_w: Option<Vec<f32>>,
    /// `[vocab, H]`; `None` when tied to the embedding.
    pub lm_head: Option<Linear>,
    /// Predict the next MoE layer's experts and hint them to the expert source.
    pub prefetch: bool,
    /// Predict the next MoE layer's experts without hinting (recorded in traces).
    pub predict: bool,
}

pub enum LayerState {
    Kda(KdaState),
    Mla(MlaState),
    None,
}

/// Everything one sequence carries between tokens.
pub struct K3State {
    pub layers: Vec<LayerState>,
    pub position: usize,
    /// Router choices of the last token, per layer (empty for dense layers).
    pub routing: Vec<Routing>,
}

impl K3Model {
    pub fn load(store: &Store) -> Result<Self> {
        let c = store.manifest.config.clone();
        let h = c.hidden_size;
        let res_w = |p: &str| -> Result<Vec<f32>> {
            Ok(effective_weight(
                &load_vec(store, &format!("{p}_norm.weight"), h)?,
                &load_vec(store, &format!("{p}_proj.weight"), h)?,
            ))
        };
        let ex = &store.manifest.experts;
        let layout = RecordLayout::from_manifest(&ex.parts, ex.record_bytes).context("expert record layout")?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let p = format!("layers.{l}.");
            let attn = match c.attn_kind(l) {
                AttnKind::Kda => Attention::Kda(Box::new(Kda::load(
                    store,
                    &format!("{p}self_attn."),
                    &c.linear_attn_config,
                    h,
                    c.rms_norm_eps,
                )?)),
                AttnKind::Mla => Attention::Mla(Box::new(Mla::load(store, &format!("{p}self_attn."), &c)?)),
            };
            let ffn = if c.is_moe_layer(l) {
                Ffn::Moe(Box::new(LatentMoe::load(store, l, &c, &layout)?))
            } else {
                Ffn::Dense(Box::new(GatedMlp::load(
                    store,
                    &format!("{p}mlp."),
                    h,
                    c.intermediate_size,
                    c.situ_beta(),
                    c.activation_situ_linear_beta,
                )?))
            };
            let res = if c.attn_res_block_size.is_some() {
                Some((res_w(&format!("{p}self_attention_res"))?, res_w(&format!("{p}mlp_res"))?))
            } else {
                None
            };
            layers.push(Layer {
                input_norm: load_vec(store, &format!("{p}input_layernorm.weight"), h)?,
                post_norm: load_vec(store, &format!("{p}post_attention_layernorm.weight"), h)?,
                res_w: res,
                attn,
                ffn,
            });
        }
        Ok(K3Model {
            embed: Linear::load_shaped(store, "embed_tokens.weight", c.vocab_size, h)?,
            norm: load_vec(store, "norm.weight", h)?,
            output_res_w: if c.attn_res_block_size.is_some() { Some(res_w("output_attn_res")?) } else { None },
            lm_head: if c.tie_word_embeddings {
                None
            } else {
                Some(Linear::load_shaped(store, "lm_head.weight", c.vocab_size, h)?)
            },
            prefetch: false,
            predict: false,
            layers,
            config: c,
        })
    }

    /// The next MoE layer after `l`, when predictions are wanted (prefetch or traces).
    fn next_moe(&self, l: usize) -> Option<&LatentMoe> {
        if !self.prefetch && !self.predict {
            return None;
        }
        self.layers[l + 1..].iter().find_map(|ly| match &ly.ffn {
            Ffn::Moe(m) => Some(&**m),
            Ffn::Dense(_) => None,
        })
    }

    /// Override the number of routed experts per token (a different model: callers must say so).
    pub fn set_experts_per_token(&mut self, k: usize) -> Result<()> {
        anyhow::ensure!(
            k >= 1 && k <= self.config.num_experts,
            "--experts-per-token must be in 1..={}",
            self.config.num_experts
        );
        for l in &mut self.layers {
            if let Ffn::Moe(m) = &mut l.ffn {
                m.top_k = k;
            }
        }
        self.config.num_experts_per_token = k;
        Ok(())
    }

    pub fn new_state(&self) -> K3State {
        K3State {
            layers: self
                .layers
                .iter()
                .map(|l| match &l.attn {
                    Attention::Kda(k) => LayerState::Kda(k.new_state()),
                    Attention::Mla(m) => LayerState::Mla(m.new_state()),
                })
                .collect(),
            position: 0,
            routing: vec![Routing::default(); self.layers.len()],
        }
    }

    /// Run one token through the model, advancing `st`; writes the next-token logits.
    /// Shapes: logits `[vocab]`.
    pub fn forward(
        &self,
        st: &mut K3State,
        experts: &mut dyn ExpertSource,
        token: u32,
        logits: &mut [f32],
    ) -> Result<()> {
        let c = &self.config;
        let h = c.hidden_size;
        let tok = token as usize;
        if tok >= c.vocab_size {
            anyhow::bail!("token id {tok} is outside the vocabulary (size {})", c.vocab_size);
        }
        let mut x = vec![0f32; h]; // [H] the running partial sum entering each layer
        self.embed.row(tok, &mut x);
        let mut blocks = ResidualBlocks::new(c.rms_norm_eps);
        let mut hmix = vec![0f32; h]; // [H] input of a sub-layer after residual mixing
        let mut normed = vec![0f32; h]; // [H]
        let mut y = vec![0f32; h]; // [H] sub-layer output
        for (l, layer) in self.layers.iter().enumerate() {
            // The attention sub-layer reads either the plain residual or the block mix.
            let mut partial: Option<Vec<f32>> = Some(std::mem::take(&mut x));
            let block_start = c.attn_res_block_size.is_some_and(|b| l % b == 0);
            match &layer.res_w {
                Some((w_attn, _)) => {
                    let p = partial.as_deref().unwrap_or(&[]);
                    blocks.mix(p, w_attn, &mut hmix);
                    if block_start {
                        blocks.push(p);
                        partial = None;
                    }
                }
                None => hmix.copy_from_slice(partial.as_deref().unwrap_or(&[])),
            }
            rms_norm(&hmix, &layer.input_norm, c.rms_norm_eps, &mut normed);
            match (&layer.attn, &mut st.layers[l]) {
                (Attention::Kda(k), LayerState::Kda(s)) => k.forward(s, &normed, &mut y),
                (Attention::Mla(m), LayerState::Mla(s)) => m.forward(s, &normed, &mut y),
                _ => anyhow::bail!("layer {l}: state does not match the attention kind"),
            }
            let mut part = match partial {
                Some(mut p) => {
                    p.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
                    p
                }
                None => y.clone(),
            };
            match &layer.res_w {
                Some((_, w_mlp)) => blocks.mix(&part, w_mlp, &mut hmix),
                None => hmix.copy_from_slice(&part),
            }
            rms_norm(&hmix, &layer.post_norm, c.rms_norm_eps, &mut normed);
            match &layer.ffn {
                Ffn::Dense(m) => m.forward(&normed, &mut y),
                Ffn::Moe(m) => {
                    m.forward(&normed, experts, self.next_moe(l), self.prefetch, &mut st.routing[l], &mut y)?
                }
            }
            part.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
            x = part;
        }
        if let Some(w) = &self.output_res_w {
            blocks.mix(&x, w, &mut hmix);
        } else {
            hmix.copy_from_slice(&x);
        }
        rms_norm(&hmix, &self.norm, c.rms_norm_eps, &mut normed);
        match &self.lm_head {
            Some(head) => head.forward(&normed, logits),
            None => self.embed.forward(&normed, logits),
        }
        st.position += 1;
        Ok(())
    }
}
