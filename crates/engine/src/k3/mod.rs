//! The Kimi K3 text model: embeddings, 93 hybrid layers (KDA or NoPE MLA attention; dense or
//! latent-MoE MLP) joined by block attention residuals, final norm, head.
//!
//! `mod.rs` holds the weights and how they load; [`forward`] the one token path (a chunk of one
//! or more tokens, layer by layer); [`state`] what a sequence carries between chunks.

pub mod forward;
pub mod snapshot;
pub mod state;
mod views;

use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use deltafin_store::{AttnKind, K3Config, SpineSource, Store};

use crate::blocks::attn_res::effective_weight;
use crate::blocks::kda::{Kda, KdaState};
use crate::blocks::mla::{LatentDtype, Mla, MlaState};
use crate::blocks::mlp::GatedMlp;
use crate::blocks::moe::{LatentMoe, Routing};
use crate::experts::RecordLayout;
use crate::scratch::Scratch;
use crate::stream::activity::DiskActivity;
use crate::stream::reader::BackendKind;
use crate::stream::spine::{Lent, SpineStreamer};
use crate::weights::{Linear, load_vec};

pub use forward::{BatchBuffers, SeqStep};
pub use state::{K3State, LayerState};

/// Prompt tokens processed together when no memory plan sized the chunk (a model loaded
/// directly, as tests do); a session's plan sizes it from the budget.
pub const DEFAULT_PREFILL_CHUNK: usize = 32;

/// How a loaded model runs: fixed at load, read everywhere, patched nowhere.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// Keep only this many leading decoder layers' spine in memory and stream the rest from the
    /// spine file for every token; `None` keeps every layer resident.
    pub resident_layers: Option<usize>,
    /// Override of the routed experts per token (a different model: callers must say so).
    pub experts_per_token: Option<usize>,
    /// Predict the next MoE layer's experts and hint them to the expert source (prefetch).
    pub prefetch: bool,
    /// Predict the next MoE layer's experts without hinting (recorded in traces).
    pub predict: bool,
    /// Positions of MLA cache reserved when a sequence starts (it still grows past them).
    pub context_reserve: usize,
    /// How the MLA latent cache stores its values; `None` picks by the spine's dtype
    /// ([`LatentDtype::auto`]: f32 for an f32 spine, else bf16). [`K3Model::latent_cache`] says
    /// what the run uses.
    pub latent_cache: Option<LatentDtype>,
    /// Approximate mode: routed experts take int8-quantised activations (labelled in outputs).
    pub approx: bool,
    /// Routed experts computed on the GPU (`--device gpu`), each record uploaded as it arrives.
    pub gpu_experts: Option<Arc<deltafin_gpu::expert::ExpertRunner>>,
    /// Prompt chunks' spine products on the GPU (`--device gpu`), matrices kept there within
    /// its budget ([`crate::spine_gpu`]).
    pub gpu_spine: Option<Arc<deltafin_gpu::spine::SpineRunner>>,
    /// Reader back-end for streamed spine layers; `None` picks io_uring when available.
    pub io_backend: Option<BackendKind>,
    /// Prompt tokens processed together (the memory plan sizes it from the budget).
    pub prefill_chunk: usize,
    /// Larger chunks a long prompt may run on the expert cache's memory (the plan says how
    /// large); `None`: every prompt goes in chunks of `prefill_chunk`.
    pub prompt_borrowing: Option<PromptBorrowing>,
    /// Where the spine loader reports its reads (the run's disk idle time).
    pub disk_activity: Option<Arc<DiskActivity>>,
    /// Counts the resident layers loaded, for whoever waits on the load (a server's `/health`).
    pub load_progress: Option<Arc<LoadProgress>>,
}

/// How far a model's load has come: resident spine layers read and decoded, of how many.
#[derive(Debug, Default)]
pub struct LoadProgress {
    pub layers_done: std::sync::atomic::AtomicUsize,
    pub layers_total: std::sync::atomic::AtomicUsize,
}

impl LoadProgress {
    /// (layers done, layers in all); (0, 0) before the load has counted them.
    pub fn get(&self) -> (usize, usize) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.layers_done.load(Relaxed), self.layers_total.load(Relaxed))
    }
}

/// A prompt longer than the plan's chunk borrows the expert cache's memory (given back before
/// the first new token) for chunks of up to `max_chunk` tokens, `token_bytes` of activations
/// each beyond the plan's own chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptBorrowing {
    pub max_chunk: usize,
    pub token_bytes: u64,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            resident_layers: None,
            experts_per_token: None,
            prefetch: false,
            predict: false,
            context_reserve: 256,
            latent_cache: None,
            approx: false,
            gpu_experts: None,
            gpu_spine: None,
            io_backend: None,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            prompt_borrowing: None,
            disk_activity: None,
            load_progress: None,
        }
    }
}

/// The spine loader's figures for a run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SpineReport {
    pub bytes_read: u64,
    /// Bytes hashed against the tensors' checksums, and the seconds that took (loader thread).
    pub bytes_verified: u64,
    pub verify_s: f64,
    pub retries: u64,
    /// Read back-ends replaced after one failed (each failed the step it was reading for).
    pub restarts: u64,
}

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

/// A layer's weights for one step: borrowed from the resident model, or lent by the spine
/// loader (handed back when dropped).
pub enum LayerRef<'a> {
    Resident(&'a Layer),
    Streamed(Lent<Layer>),
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
    /// The checkpoint's config, with `num_experts_per_token` as this run uses it.
    pub config: K3Config,
    run: RunConfig,
    /// The latent cache's dtype (the run's, or the spine's default).
    latent: LatentDtype,
    /// `[vocab, H]`.
    pub embed: Linear,
    pub layers: Vec<LayerSlot>,
    /// Loader of the streamed layers, when the spine does not fit the budget.
    pub spine_stream: Option<Mutex<SpineStreamer<Layer>>>,
    /// `[H]`.
    pub norm: Vec<f32>,
    /// `[H]`.
    pub output_res_w: Option<Vec<f32>>,
    /// `[vocab, H]`; `None` when tied to the embedding.
    pub lm_head: Option<Linear>,
    /// Where the model's steps spent their time so far.
    pub phases: PhaseTimes,
}

/// Wall time the model's steps spent in attention (each sequence's KDA or MLA over its state,
/// projections included) and in the feed-forward blocks (router, shared and routed experts,
/// waits for expert reads included), summed over every step of the process; a prompt's share is
/// the difference across it ([`PhaseTimes::seconds`]).
#[derive(Debug, Default)]
pub struct PhaseTimes {
    attention_ns: std::sync::atomic::AtomicU64,
    /// The MLA layers' part of `attention_ns`.
    mla_ns: std::sync::atomic::AtomicU64,
    /// The part of `attention_ns` spent uploading spine matrices to the GPU and waiting for its
    /// products (a prompt chunk with `--device gpu`; the rest of attention ran on the CPU).
    attention_gpu_ns: std::sync::atomic::AtomicU64,
    ffn_ns: std::sync::atomic::AtomicU64,
}

impl PhaseTimes {
    pub(crate) fn add(&self, attention: std::time::Duration, mla: bool, gpu_s: f64, ffn: std::time::Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        self.attention_ns.fetch_add(attention.as_nanos() as u64, Relaxed);
        self.attention_gpu_ns.fetch_add((gpu_s * 1e9) as u64, Relaxed);
        if mla {
            self.mla_ns.fetch_add(attention.as_nanos() as u64, Relaxed);
        }
        self.ffn_ns.fetch_add(ffn.as_nanos() as u64, Relaxed);
    }

    /// Seconds so far.
    pub fn seconds(&self) -> PhaseSeconds {
        use std::sync::atomic::Ordering::Relaxed;
        let s = |a: &std::sync::atomic::AtomicU64| a.load(Relaxed) as f64 * 1e-9;
        PhaseSeconds {
            attention: s(&self.attention_ns),
            mla: s(&self.mla_ns),
            attention_gpu: s(&self.attention_gpu_ns),
            ffn: s(&self.ffn_ns),
        }
    }
}

/// [`PhaseTimes`] read out: attention, of it in MLA layers, of it in the GPU's spine products,
/// and the feed-forward blocks.
#[derive(Debug, Clone, Copy, Default)]
pub struct PhaseSeconds {
    pub attention: f64,
    pub mla: f64,
    pub attention_gpu: f64,
    pub ffn: f64,
}

impl std::ops::Sub for PhaseSeconds {
    type Output = PhaseSeconds;
    fn sub(self, o: PhaseSeconds) -> PhaseSeconds {
        PhaseSeconds {
            attention: self.attention - o.attention,
            mla: self.mla - o.mla,
            attention_gpu: self.attention_gpu - o.attention_gpu,
            ffn: self.ffn - o.ffn,
        }
    }
}

/// One decoder layer's spine weights, from the store file or a streamed image of it.
pub fn load_layer(src: &dyn SpineSource, c: &K3Config, l: usize, layout: &RecordLayout) -> Result<Layer> {
    let h = c.hidden_size;
    let p = format!("layers.{l}.");
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
        Some((res_weight(src, h, &format!("{p}self_attention_res"))?, res_weight(src, h, &format!("{p}mlp_res"))?))
    } else {
        None
    };
    Ok(Layer {
        input_norm: load_vec(src, &format!("{p}input_layernorm.weight"), h)?,
        post_norm: load_vec(src, &format!("{p}post_attention_layernorm.weight"), h)?,
        res_w: res,
        attn,
        ffn,
    })
}

/// A block attention residual's effective weight `[H]` from its norm and projection.
fn res_weight(src: &dyn SpineSource, h: usize, p: &str) -> Result<Vec<f32>> {
    Ok(effective_weight(
        &load_vec(src, &format!("{p}_norm.weight"), h)?,
        &load_vec(src, &format!("{p}_proj.weight"), h)?,
    ))
}

impl K3Model {
    /// Load the model for a run: the resident spine layers in memory, a loader for the others.
    pub fn load(store: &Store, run: &RunConfig) -> Result<Self> {
        let mut c = store.manifest.config.clone();
        if let Some(k) = run.experts_per_token {
            anyhow::ensure!(k >= 1 && k <= c.num_experts, "--experts-per-token must be in 1..={}", c.num_experts);
            c.num_experts_per_token = k;
        }
        let h = c.hidden_size;
        let ex = &store.manifest.experts;
        let layout = RecordLayout::from_manifest(&ex.parts, ex.record_bytes).context("expert record layout")?;
        let resident = run.resident_layers.unwrap_or(c.num_hidden_layers).min(c.num_hidden_layers);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        if let Some(p) = &run.load_progress {
            p.layers_total.store(resident, std::sync::atomic::Ordering::Relaxed);
        }
        for l in 0..c.num_hidden_layers {
            layers.push(if l < resident {
                let layer = load_layer(store, &c, l, &layout)?;
                if let Some(p) = &run.load_progress {
                    p.layers_done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                LayerSlot::Resident(layer)
            } else {
                LayerSlot::Streamed
            });
        }
        let spine_stream = if resident < c.num_hidden_layers {
            let (cfg, layout) = (c.clone(), layout.clone());
            Some(Mutex::new(SpineStreamer::start(
                store,
                (resident..c.num_hidden_layers).collect(),
                run.io_backend,
                run.disk_activity.clone(),
                Box::new(move |image, l| load_layer(image, &cfg, l, &layout)),
            )?))
        } else {
            None
        };
        Ok(K3Model {
            embed: Linear::load_shaped(store, "embed_tokens.weight", c.vocab_size, h)?,
            norm: load_vec(store, "norm.weight", h)?,
            output_res_w: if c.attn_res_block_size.is_some() {
                Some(res_weight(store, h, "output_attn_res")?)
            } else {
                None
            },
            lm_head: if c.tie_word_embeddings {
                None
            } else {
                Some(Linear::load_shaped(store, "lm_head.weight", c.vocab_size, h)?)
            },
            latent: run.latent_cache.unwrap_or_else(|| LatentDtype::auto(store.manifest.spine.matrix_dtype)),
            run: run.clone(),
            spine_stream,
            layers,
            config: c,
            phases: PhaseTimes::default(),
        })
    }

    /// How the MLA latent cache of this model's sequences stores its values.
    pub fn latent_cache(&self) -> LatentDtype {
        self.latent
    }

    /// How this model runs.
    pub fn run(&self) -> &RunConfig {
        &self.run
    }

    /// What the spine loader did so far (streamed layers only).
    pub fn spine_report(&self) -> Option<SpineReport> {
        use std::sync::atomic::Ordering::Relaxed;
        let s = self.spine_stream.as_ref()?.lock().ok()?;
        let c = &s.counters;
        Some(SpineReport {
            bytes_read: c.bytes_read.load(Relaxed),
            bytes_verified: c.bytes_verified.load(Relaxed),
            verify_s: c.verify_ns.load(Relaxed) as f64 * 1e-9,
            retries: c.retries.load(Relaxed),
            restarts: c.restarts.load(Relaxed),
        })
    }

    /// Spine bytes read from disk so far (the streamed layers; 0 when all are resident).
    pub fn spine_bytes_read(&self) -> u64 {
        self.spine_report().map(|r| r.bytes_read).unwrap_or(0)
    }

    /// The next MoE layer after `l`, when predictions are wanted (prefetch or traces).
    fn next_moe(&self, l: usize) -> Option<&LatentMoe> {
        if !self.run.prefetch && !self.run.predict {
            return None;
        }
        // Only resident layers are looked into: a streamed layer's router is not in memory yet.
        self.layers[l + 1..].iter().find_map(|ly| match ly {
            LayerSlot::Resident(Layer { ffn: Ffn::Moe(m), .. }) => Some(&**m),
            _ => None,
        })
    }

    /// Make a fresh `st` continue as if `tokens` positions came before it: every MLA layer's
    /// latent cache holds `tokens` synthetic positions ([`MlaState::push_synthetic`]) and the
    /// position moves on, so the next token's attention and RoPE run at that context. KDA's
    /// recurrent state has one size whatever the context and stays as it is. For timing decode at
    /// a long context without the prompt that would have made it (`bench --context-fill`): what
    /// follows is no continuation of any text, and routing is whatever these states produce.
    pub fn fill_context_synthetic(&self, st: &mut K3State, tokens: usize) -> Result<()> {
        anyhow::ensure!(st.position == 0, "a context fill goes into a fresh state");
        let max = self.config.max_position_embeddings;
        anyhow::ensure!(tokens < max, "a context fill of {tokens} tokens reaches the model's {max} positions");
        for (l, ly) in st.layers.iter_mut().enumerate() {
            if let LayerState::Mla(m) = ly {
                m.push_synthetic(tokens, 0x9E37_79B9_7F4A_7C15 ^ l as u64);
            }
        }
        st.position = tokens;
        Ok(())
    }

    pub fn new_state(&self) -> K3State {
        let c = &self.config;
        let routing = || Routing {
            experts: Vec::with_capacity(c.num_experts_per_token),
            weights: Vec::with_capacity(c.num_experts_per_token),
            pinned: false,
            predicted_next: Vec::with_capacity(c.num_experts_per_token),
            pinned_next: Vec::new(),
        };
        K3State {
            layers: (0..c.num_hidden_layers)
                .map(|l| match c.attn_kind(l) {
                    AttnKind::Kda => LayerState::Kda(KdaState::new(&c.linear_attn_config)),
                    AttnKind::Mla => LayerState::Mla(MlaState::with_capacity(
                        self.run.context_reserve,
                        c.kv_lora_rank,
                        c.qk_rope_head_dim,
                        self.latent,
                    )),
                })
                .collect(),
            position: 0,
            routing: (0..self.layers.len()).map(|_| routing()).collect(),
            scratch: Scratch::default(),
            blocks: Vec::new(),
            chunk_routing: vec![routing()],
            part_way: false,
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
}
