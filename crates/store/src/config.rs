//! The Kimi K3 text-model configuration, normalised from a Hugging Face `config.json`.
//!
//! Field names follow the release's `text_config` (`model_type: kimi_linear`). Every field the
//! forward pass depends on is checked here once, so model code can index without re-validating.

use serde::{Deserialize, Serialize};

use crate::error::StoreError;

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

/// What kind of attention a layer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnKind {
    Kda,
    Mla,
}

impl K3Config {
    /// Parse a Hugging Face `config.json` (with or without a `text_config` wrapper) and validate it.
    /// `source` names the file in errors.
    pub fn from_hf_json(text: &str, source: &str) -> Result<Self, StoreError> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| StoreError::Config { file: source.into(), msg: format!("not valid JSON: {e}") })?;
        let text_cfg = v.get("text_config").cloned().unwrap_or(v);
        let cfg: K3Config = serde_json::from_value(text_cfg)
            .map_err(|e| StoreError::Config { file: source.into(), msg: format!("text_config: {e}") })?;
        cfg.validate(source)?;
        Ok(cfg)
    }

    pub fn validate(&self, source: &str) -> Result<(), StoreError> {
        let bad = |msg: String| StoreError::Config { file: source.into(), msg };
        if self.hidden_act != "situ" {
            return Err(bad(format!("hidden_act '{}' is not supported (K3 uses situ)", self.hidden_act)));
        }
        if self.moe_router_activation_func != "sigmoid" {
            return Err(bad(format!(
                "moe_router_activation_func '{}' is not supported",
                self.moe_router_activation_func
            )));
        }
        if !self.mla_use_nope {
            return Err(bad("only NoPE MLA (mla_use_nope = true) is supported".into()));
        }
        if self.num_expert_group != 1 || self.topk_group != 1 {
            return Err(bad("grouped routing (num_expert_group > 1) is not supported for K3".into()));
        }
        let n = self.num_hidden_layers;
        if n == 0 || self.hidden_size == 0 || self.vocab_size == 0 {
            return Err(bad("num_hidden_layers, hidden_size and vocab_size must be positive".into()));
        }
        let lac = &self.linear_attn_config;
        for &l in &lac.kda_layers {
            if l == 0 || l > n {
                return Err(bad(format!("linear_attn_config.kda_layers has {l}, outside 1..={n}")));
            }
        }
        if lac.num_heads == 0 || lac.head_dim == 0 || lac.short_conv_kernel_size == 0 {
            return Err(bad("linear_attn_config num_heads, head_dim, short_conv_kernel_size must be positive".into()));
        }
        if self.num_experts_per_token == 0 || self.num_experts_per_token > self.num_experts {
            return Err(bad(format!(
                "num_experts_per_token {} must be in 1..={}",
                self.num_experts_per_token, self.num_experts
            )));
        }
        if self.moe_layer_freq == 0 {
            return Err(bad("moe_layer_freq must be positive".into()));
        }
        let lat = self.expert_input_dim();
        if !lat.is_multiple_of(32) || !self.moe_intermediate_size.is_multiple_of(32) {
            return Err(bad(format!(
                "MXFP4 experts need latent ({lat}) and moe_intermediate_size ({}) to be multiples of 32",
                self.moe_intermediate_size
            )));
        }
        if self.attn_res_block_size == Some(0) {
            return Err(bad("attn_res_block_size must be positive".into()));
        }
        Ok(())
    }

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
