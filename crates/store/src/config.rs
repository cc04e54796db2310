//! The Kimi K3 text-model configuration, normalised from a Hugging Face `config.json`.
//!
//! Field names follow the release's `text_config` (`model_type: kimi_linear`). Every field the
//! forward pass depends on is checked here once, so model code can index without re-validating.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinearAttnConfig {
    /// 1-based indices of Kimi Delta Attention layers.
    pub kda_layers: Vec<usize>,
    /// 1-based indices of full (MLA) attention layers.
    #[serde(default)]
    pub full_attn_layers: Vec<usize>,
    pub num_heads: usize,
    pub head_dim: usize,
    #[serde(default = "default_conv")]
    pub short_conv_kernel_size: usize,
    #[serde(default)]
    pub gate_lower_bound: Option<f32>,
    #[serde(default)]
    pub use_full_rank_gate: bool,
}

fn default_conv() -> usize {
    4
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct K3Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    #[serde(default)]
    pub max_position_embeddings: usize,
    pub linear_attn_config: LinearAttnConfig,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default)]
    pub activation_situ_beta: Option<f32>,
    #[serde(default)]
    pub activation_situ_linear_beta: Option<f32>,
    #[serde(default)]
    pub attn_res_block_size: Option<usize>,
    #[serde(default)]
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    #[serde(default = "default_true")]
    pub mla_use_nope: bool,
    #[serde(default)]
    pub mla_use_output_gate: bool,
    pub num_experts: usize,
    #[serde(default = "default_topk")]
    pub num_experts_per_token: usize,
    #[serde(default)]
    pub num_shared_experts: usize,
    pub moe_intermediate_size: usize,
    #[serde(default = "default_sigmoid")]
    pub moe_router_activation_func: String,
    #[serde(default = "default_true")]
    pub moe_renormalize: bool,
    #[serde(default = "default_one")]
    pub routed_scaling_factor: f32,
    #[serde(default)]
    pub first_k_dense_replace: usize,
    #[serde(default = "default_one_usize")]
    pub moe_layer_freq: usize,
    #[serde(default = "default_one_usize")]
    pub num_expert_group: usize,
    #[serde(default = "default_one_usize")]
    pub topk_group: usize,
    #[serde(default)]
    pub routed_expert_hidden_size: Option<usize>,
    #[serde(default)]
    pub latent_moe_use_norm: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

fn default_eps() -> f32 {
    1e-5
}
fn default_act() -> String {
    "situ".into()
}
fn default_true() -> bool {
    true
}
fn default_topk() -> usize {
    16
}
fn default_sigmoid() -> String {
    "sigmoid".into()
}
fn default_one() -> f32 {
    1.0
}
fn default_one_usize() -> usize {
    1
}

/// Bounds on a config's sizes. A config drives allocations long before any weight is read
/// (recurrent state, caches, scratch, expert buffers), so sizes no real model has are refused at
/// load instead of overflowing arithmetic or exhausting memory later. Each is far above Kimi
/// K3's (in parentheses), and together they keep every size product the store and the engine
/// form from a config well inside 64 bits.
pub mod limits {
    /// Vocabulary (163,840).
    pub const VOCAB: usize = 1 << 24;
    /// Decoder layers (93).
    pub const LAYERS: usize = 1 << 12;
    /// Any width: hidden, intermediate, latent, LoRA ranks, head dimensions (largest 33,792).
    pub const WIDTH: usize = 1 << 18;
    /// Attention heads, KDA or MLA (96).
    pub const HEADS: usize = 1 << 12;
    /// Routed experts per MoE layer, and shared experts (896; 2 shared).
    pub const EXPERTS: usize = 1 << 16;
    /// KDA short convolution taps (4).
    pub const CONV_KERNEL: usize = 1 << 10;
    /// Elements of one spine tensor, or of one layer's KDA state (embedding: 1.2e9).
    pub const TENSOR_ELEMS: u128 = 1 << 36;
    /// Bytes of one MXFP4 expert record (17,547,264).
    pub const RECORD_BYTES: u128 = 1 << 30;
}

/// What kind of attention a layer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnKind {
    Kda,
    Mla,
}

impl K3Config {
    pub fn attn_kind(&self, layer: usize) -> AttnKind {
        if self.linear_attn_config.kda_layers.contains(&(layer + 1)) { AttnKind::Kda } else { AttnKind::Mla }
    }

    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.num_experts > 0 && layer >= self.first_k_dense_replace && layer.is_multiple_of(self.moe_layer_freq)
    }

    pub fn moe_layers(&self) -> Vec<usize> {
        (0..self.num_hidden_layers).filter(|&l| self.is_moe_layer(l)).collect()
    }

    /// Width the routed experts work in: the latent size for latent MoE, else hidden.
    pub fn expert_input_dim(&self) -> usize {
        self.routed_expert_hidden_size.unwrap_or(self.hidden_size)
    }

    pub fn situ_beta(&self) -> f32 {
        self.activation_situ_beta.unwrap_or(1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_field_names_file_and_field() {
        let err = K3Config::from_hf_json(r#"{"text_config": {"hidden_size": 8}}"#, "x/config.json").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("x/config.json"), "{msg}");
        assert!(msg.contains("missing field"), "{msg}");
    }
}
