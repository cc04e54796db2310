//! The Kimi K3 text model: embeddings, 93 hybrid layers (KDA or NoPE MLA attention; dense or
//! latent-MoE MLP) joined by block attention residuals, final norm, head.

use anyhow::{Context, Result};
use deltafin_kernels::ops::rms_norm;
use std::sync::Mutex;

use deltafin_store::{AttnKind, K3Config, SpineSource, Store};

use crate::blocks::attn_res::{ResidualBlocks, effective_weight};
use crate::blocks::kda::{Kda, KdaState};
use crate::blocks::mla::{Mla, MlaState};
use crate::blocks::mlp::GatedMlp;
use crate::blocks::moe::{LatentMoe, MoeRun, Routing};
use crate::experts::{ExpertSource, RecordLayout};
use crate::scratch::Scratch;
use crate::spine_stream::SpineStreamer;
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

/// A layer's weights for one step: borrowed from the resident model or owned after streaming.
pub enum LayerRef<'a> {
    Resident(&'a Layer),
    Streamed(Layer),
}

impl std::ops::Deref for LayerRef<'_> {
    type Target = Layer;
    fn deref(&self) -> &Layer {
        match self {
            LayerRef::Resident(l) => l,
            LayerRef::Streamed(l) => l,
        }
    }
}

/// A decoder layer's spine: in memory, or read from the spine file for every token.
pub enum LayerSlot {
    Resident(Layer),
    Streamed,
}

pub struct K3Model {
    pub config: K3Config,
    /// `[vocab, H]`.
    pub embed: Linear,
    pub layers: Vec<LayerSlot>,
    /// Loader of the streamed layers, when the spine does not fit the budget.
    pub spine_stream: Option<Mutex<SpineStreamer>>,
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
    /// Positions of MLA cache reserved when a sequence starts (it still grows past them).
    pub context_reserve: usize,
    /// Approximate mode: routed experts take int8-quantised activations (labelled in outputs).
    pub approx: bool,
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
    /// Per-token buffers, reused from token to token.
    pub scratch: Scratch,
    /// The block attention residuals of the current token (memory reused).
    pub blocks: ResidualBlocks,
}

impl K3State {
    /// Make this state continue `other`'s sequence: recurrent and latent caches, position and
    /// last routing are copied into this state's own buffers (no reallocation within the
    /// reserved context). Per-token scratch is not sequence state and is left alone.
    pub fn copy_sequence_from(&mut self, other: &K3State) {
        assert_eq!(self.layers.len(), other.layers.len(), "states of different models");
        for (a, b) in self.layers.iter_mut().zip(&other.layers) {
            match (a, b) {
                (LayerState::Kda(a), LayerState::Kda(b)) => {
                    for (x, y) in a.conv.iter_mut().zip(&b.conv) {
                        x.copy_from_slice(y);
                    }
                    a.s.copy_from_slice(&b.s);
                }
                (LayerState::Mla(a), LayerState::Mla(b)) => {
                    a.latents.clear();
                    a.latents.extend_from_slice(&b.latents);
                    a.k_pe.clear();
                    a.k_pe.extend_from_slice(&b.k_pe);
                    a.len = b.len;
                }
                (a, b) => assert!(matches!((a, b), (LayerState::None, LayerState::None)), "layer kinds differ"),
            }
        }
        self.position = other.position;
        self.routing.clone_from(&other.routing);
    }
}

/// One decoder layer's spine weights, from the store file or a streamed image of it.
pub fn load_layer(src: &dyn SpineSource, c: &K3Config, l: usize, layout: &RecordLayout) -> Result<Layer> {
    let h = c.hidden_size;
    let p = format!("layers.{l}.");
    let res_w = |p: &str| -> Result<Vec<f32>> {
        Ok(effective_weight(
            &load_vec(src, &format!("{p}_norm.weight"), h)?,
            &load_vec(src, &format!("{p}_proj.weight"), h)?,
        ))
    };
    let attn = match c.attn_kind(l) {
        AttnKind::Kda => Attention::Kda(Box::new(Kda::load(
            src,
            &format!("{p}self_attn."),
            &c.linear_attn_config,
            h,
            c.rms_norm_eps,
        )?)),
        AttnKind::Mla => Attention::Mla(Box::new(Mla::load(src, &format!("{p}self_attn."), c)?)),
    };
    let ffn = if c.is_moe_layer(l) {
        Ffn::Moe(Box::new(LatentMoe::load(src, l, c, layout)?))
    } else {
        Ffn::Dense(Box::new(GatedMlp::load(
            src,
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
    let mut layer = Layer {
        input_norm: load_vec(src, &format!("{p}input_layernorm.weight"), h)?,
        post_norm: load_vec(src, &format!("{p}post_attention_layernorm.weight"), h)?,
        res_w: res,
        attn,
        ffn,
    };
    if let Ffn::Moe(m) = &mut layer.ffn {
        m.top_k = c.num_experts_per_token;
    }
    Ok(layer)
}

impl K3Model {
    /// Load the model with every spine layer resident.
    pub fn load(store: &Store) -> Result<Self> {
        Self::load_with(store, None)
    }

    /// Load the model; `resident_layers` (when given) keeps only the first that many decoder
    /// layers' spine in memory and streams the rest from the spine file for every token.
    pub fn load_with(store: &Store, resident_layers: Option<usize>) -> Result<Self> {
        let c = store.manifest.config.clone();
        let h = c.hidden_size;
        let ex = &store.manifest.experts;
        let layout = RecordLayout::from_manifest(&ex.parts, ex.record_bytes).context("expert record layout")?;
        let resident = resident_layers.unwrap_or(c.num_hidden_layers).min(c.num_hidden_layers);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            layers.push(if l < resident {
                LayerSlot::Resident(load_layer(store, &c, l, &layout)?)
            } else {
                LayerSlot::Streamed
            });
        }
        let spine_stream = if resident < c.num_hidden_layers {
            Some(Mutex::new(SpineStreamer::start(store, (resident..c.num_hidden_layers).collect(), layout.clone())?))
        } else {
            None
        };
        let res_w = |p: &str| -> Result<Vec<f32>> {
            Ok(effective_weight(
                &load_vec(store, &format!("{p}_norm.weight"), h)?,
                &load_vec(store, &format!("{p}_proj.weight"), h)?,
            ))
        };
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
            context_reserve: 256,
            approx: false,
            spine_stream,
            layers,
            config: c,
        })
    }

    /// The next MoE layer after `l`, when predictions are wanted (prefetch or traces).
    fn next_moe(&self, l: usize) -> Option<&LatentMoe> {
        if !self.prefetch && !self.predict {
            return None;
        }
        // Only resident layers are looked into: a streamed layer's router is not in memory yet.
        self.layers[l + 1..].iter().find_map(|ly| match ly {
            LayerSlot::Resident(Layer { ffn: Ffn::Moe(m), .. }) => Some(&**m),
            _ => None,
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
            if let LayerSlot::Resident(Layer { ffn: Ffn::Moe(m), .. }) = l {
                m.top_k = k;
            }
        }
        if let Some(s) = &self.spine_stream {
            s.lock().map_err(|_| anyhow::anyhow!("spine loader poisoned"))?.set_top_k(k);
        }
        self.config.num_experts_per_token = k;
        Ok(())
    }

    pub fn new_state(&self) -> K3State {
        K3State {
            layers: (0..self.config.num_hidden_layers)
                .map(|l| match self.config.attn_kind(l) {
                    AttnKind::Kda => LayerState::Kda(KdaState::new(&self.config.linear_attn_config)),
                    AttnKind::Mla => LayerState::Mla(MlaState::with_capacity(
                        self.context_reserve,
                        self.config.kv_lora_rank,
                        self.config.qk_rope_head_dim,
                    )),
                })
                .collect(),
            position: 0,
            routing: (0..self.layers.len())
                .map(|_| Routing {
                    experts: Vec::with_capacity(self.config.num_experts_per_token),
                    weights: Vec::with_capacity(self.config.num_experts_per_token),
                    pinned: false,
                    predicted_next: Vec::with_capacity(self.config.num_experts_per_token),
                })
                .collect(),
            scratch: Scratch::default(),
            blocks: ResidualBlocks::new(self.config.rms_norm_eps),
        }
    }

    /// Layer `l`'s weights: borrowed when resident, loaded when streamed.
    fn layer(&self, l: usize) -> Result<LayerRef<'_>> {
        Ok(match &self.layers[l] {
            LayerSlot::Resident(layer) => LayerRef::Resident(layer),
            LayerSlot::Streamed => {
                let s = self
                    .spine_stream
                    .as_ref()
                    .ok_or_else(|| anyhow::anyhow!("layer {l} is streamed but no loader runs"))?;
                LayerRef::Streamed(s.lock().map_err(|_| anyhow::anyhow!("spine loader poisoned"))?.get(l)?)
            }
        })
    }

    /// Everything of layer `l` for one token up to the FFN: residual mixing, attention, the
    /// running sum, and the FFN's normed input (left in `normed`).
    /// Shapes: x, hmix, normed, y `[hidden]`.
    #[allow(clippy::too_many_arguments)]
    fn attention_part(
        &self,
        layer: &Layer,
        l: usize,
        state: &mut LayerState,
        blocks: &mut ResidualBlocks,
        x: &mut [f32],
        hmix: &mut [f32],
        normed: &mut [f32],
        y: &mut [f32],
        sc: &mut Scratch,
    ) -> Result<()> {
        let c = &self.config;
        // The attention sub-layer reads either the plain residual or the block mix. At a block
        // start the running sum is stored as a block and restarts from the attention output.
        let block_start = c.attn_res_block_size.is_some_and(|b| l.is_multiple_of(b));
        let mut restart = false;
        match &layer.res_w {
            Some((w_attn, _)) => {
                blocks.mix(x, w_attn, hmix);
                if block_start {
                    blocks.push(x);
                    restart = true;
                }
            }
            None => hmix.copy_from_slice(x),
        }
        rms_norm(hmix, &layer.input_norm, c.rms_norm_eps, normed);
        match (&layer.attn, state) {
            (Attention::Kda(k), LayerState::Kda(s)) => k.forward(s, normed, y, sc),
            (Attention::Mla(m), LayerState::Mla(s)) => m.forward(s, normed, y, sc),
            _ => anyhow::bail!("layer {l}: state does not match the attention kind"),
        }
        if restart {
            x.copy_from_slice(y);
        } else {
            x.iter_mut().zip(y.iter()).for_each(|(a, b)| *a += b);
        }
        match &layer.res_w {
            Some((_, w_mlp)) => blocks.mix(x, w_mlp, hmix),
            None => hmix.copy_from_slice(x),
        }
        rms_norm(hmix, &layer.post_norm, c.rms_norm_eps, normed);
        Ok(())
    }

    /// A chunk of prompt tokens through the model layer by layer: each layer's spine is fetched
    /// once and each distinct expert is read once for the whole chunk. Per token the arithmetic
    /// is that of [`forward`](Self::forward), so logits and state are identical to feeding the
    /// tokens one at a time. Writes the last token's logits. Shapes: logits `[vocab]`.
    pub fn forward_chunk(
        &self,
        st: &mut K3State,
        experts: &mut dyn ExpertSource,
        tokens: &[u32],
        logits: &mut [f32],
    ) -> Result<()> {
        let c = &self.config;
        let h = c.hidden_size;
        let t_n = tokens.len();
        if t_n <= 1 {
            return match tokens.first() {
                Some(&t) => self.forward(st, experts, t, logits),
                None => anyhow::bail!("empty chunk"),
            };
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            anyhow::bail!("token id {t} is outside the vocabulary (size {})", c.vocab_size);
        }
        let K3State { layers: states, routing, scratch: sc, .. } = st;
        let mut xs = vec![0f32; t_n * h]; // [T, H] running sums
        for (t, &tok) in tokens.iter().enumerate() {
            self.embed.row(tok as usize, &mut xs[t * h..(t + 1) * h]);
        }
        let mut blocks: Vec<ResidualBlocks> = (0..t_n).map(|_| ResidualBlocks::new(c.rms_norm_eps)).collect();
        let mut normed = vec![0f32; t_n * h]; // [T, H] FFN inputs
        let mut ys = vec![0f32; t_n * h]; // [T, H] FFN outputs
        let (mut hmix, mut y) = (vec![0f32; h], vec![0f32; h]); // [H] each
        let mut routings: Vec<Routing> = vec![Routing::default(); t_n];
        for l in 0..self.layers.len() {
            let layer = self.layer(l)?;
            for t in 0..t_n {
                let (x, nm) = (&mut xs[t * h..(t + 1) * h], &mut normed[t * h..(t + 1) * h]);
                self.attention_part(&layer, l, &mut states[l], &mut blocks[t], x, &mut hmix, nm, &mut y, sc)?;
            }
            match &layer.ffn {
                Ffn::Dense(m) => {
                    for t in 0..t_n {
                        m.forward(&normed[t * h..(t + 1) * h], &mut ys[t * h..(t + 1) * h], sc);
                    }
                }
                Ffn::Moe(m) => {
                    for r in routings.iter_mut() {
                        r.pinned = false;
                    }
                    m.forward_chunk(&normed, experts, self.approx, &mut routings, &mut ys, sc)?;
                    routing[l].clone_from(&routings[t_n - 1]);
                }
            }
            xs.iter_mut().zip(&ys).for_each(|(a, b)| *a += b);
        }
        let last = &xs[(t_n - 1) * h..];
        let blocks_last = &mut blocks[t_n - 1];
        if let Some(w) = &self.output_res_w {
            blocks_last.mix(last, w, &mut hmix);
        } else {
            hmix.copy_from_slice(last);
        }
        rms_norm(&hmix, &self.norm, c.rms_norm_eps, &mut y);
        match &self.lm_head {
            Some(head) => head.forward(&y, logits),
            None => self.embed.forward(&y, logits),
        }
        st.position += t_n;
        Ok(())
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
        let K3State { layers: states, routing, scratch: sc, blocks, .. } = st;
        blocks.clear();
        let mut x = sc.take(h); // [H] the running partial sum entering each layer
        self.embed.row(tok, &mut x);
        let mut hmix = sc.take(h); // [H] input of a sub-layer after residual mixing
        let mut normed = sc.take(h); // [H]
        let mut y = sc.take(h); // [H] sub-layer output
        for l in 0..self.layers.len() {
            let layer = self.layer(l)?;
            self.attention_part(&layer, l, &mut states[l], blocks, &mut x, &mut hmix, &mut normed, &mut y, sc)?;
            match &layer.ffn {
                Ffn::Dense(m) => m.forward(&normed, &mut y, sc),
                Ffn::Moe(m) => m.forward(
                    &normed,
                    experts,
                    MoeRun { next: self.next_moe(l), hint: self.prefetch, approx: self.approx },
                    &mut routing[l],
                    &mut y,
                    sc,
                )?,
            }
            x.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
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
        for buf in [x, hmix, normed, y] {
            sc.give(buf);
        }
        st.position += 1;
        Ok(())
    }
}
