//! Loading and validating a K3 config: parsing a Hugging Face `config.json`, the supported
//! architecture, and sizes within [`limits`](crate::config::limits) (the tensor shapes come from
//! the schema, which builds on the config's types; this module sits above both).

use crate::config::{AttnKind, K3Config, limits};
use crate::error::StoreError;

/// `field 'NAME': ` for the field a config fails to deserialize at, or nothing. serde's type
/// errors ("invalid value: integer `-5`, expected usize") do not name the field; deserializing
/// the config again from one-field-per-line JSON gives the line, and the line names the field.
fn field_of_error(text_cfg: &serde_json::Value) -> String {
    let Ok(pretty) = serde_json::to_string_pretty(text_cfg) else { return String::new() };
    let Err(e) = serde_json::from_str::<K3Config>(&pretty) else { return String::new() };
    let line = pretty.lines().nth(e.line().saturating_sub(1)).unwrap_or("").trim_start();
    match line.strip_prefix('"').and_then(|l| l.split_once("\": ")) {
        Some((key, _)) if !e.to_string().starts_with("missing field") => format!("field '{key}': "),
        _ => String::new(),
    }
}

impl K3Config {
    /// Parse a Hugging Face `config.json` (with or without a `text_config` wrapper) and validate it.
    /// `source` names the file in errors.
    pub fn from_hf_json(text: &str, source: &str) -> Result<Self, StoreError> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| StoreError::Config { file: source.into(), msg: format!("not valid JSON: {e}") })?;
        let text_cfg = v.get("text_config").cloned().unwrap_or(v);
        let cfg: K3Config = serde_json::from_value(text_cfg.clone()).map_err(|e| StoreError::Config {
            file: source.into(),
            msg: format!("text_config: {}{e}", field_of_error(&text_cfg)),
        })?;
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
        self.check_sizes().map_err(bad)?;
        let lac = &self.linear_attn_config;
        for (field, list) in [("kda_layers", &lac.kda_layers), ("full_attn_layers", &lac.full_attn_layers)] {
            // Each layer at most once: the list is searched for every layer.
            if list.len() > n {
                return Err(bad(format!("linear_attn_config.{field} lists {} layers; the model has {n}", list.len())));
            }
            if let Some(&l) = list.iter().find(|&&l| l == 0 || l > n) {
                return Err(bad(format!("linear_attn_config.{field} has {l}, outside 1..={n}")));
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
        if lat == 0 || self.moe_intermediate_size == 0 {
            return Err(bad("routed_expert_hidden_size and moe_intermediate_size must be positive".into()));
        }
        if self.attn_res_block_size == Some(0) {
            return Err(bad("attn_res_block_size must be positive".into()));
        }
        let layers = 0..n;
        if layers.clone().any(|l| self.attn_kind(l) == AttnKind::Mla)
            && (self.num_attention_heads == 0
                || self.kv_lora_rank == 0
                || self.v_head_dim == 0
                || self.qk_nope_head_dim + self.qk_rope_head_dim == 0
                || self.q_lora_rank == Some(0))
        {
            return Err(bad("MLA layers need positive num_attention_heads, kv_lora_rank, v_head_dim, \
                            q_lora_rank and query head dimensions"
                .into()));
        }
        if layers.clone().any(|l| !self.is_moe_layer(l)) && self.intermediate_size == 0 {
            return Err(bad("dense layers need a positive intermediate_size".into()));
        }
        for (field, v) in [
            ("rms_norm_eps", Some(self.rms_norm_eps)),
            ("routed_scaling_factor", Some(self.routed_scaling_factor)),
            ("activation_situ_beta", self.activation_situ_beta),
            ("activation_situ_linear_beta", self.activation_situ_linear_beta),
            ("linear_attn_config.gate_lower_bound", lac.gate_lower_bound),
        ] {
            if v.is_some_and(|v| !v.is_finite()) {
                return Err(bad(format!("{field} must be a finite number")));
            }
        }
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 {
            return Err(bad("rms_norm_eps must be positive".into()));
        }
        self.check_products().map_err(bad)?;
        Ok(())
    }

    /// Each size within [`limits`], before anything multiplies them.
    fn check_sizes(&self) -> Result<(), String> {
        let lac = &self.linear_attn_config;
        let opt = |v: Option<usize>| v.unwrap_or(0);
        let checks: [(&str, usize, usize); 17] = [
            ("vocab_size", self.vocab_size, limits::VOCAB),
            ("num_hidden_layers", self.num_hidden_layers, limits::LAYERS),
            ("hidden_size", self.hidden_size, limits::WIDTH),
            ("intermediate_size", self.intermediate_size, limits::WIDTH),
            ("moe_intermediate_size", self.moe_intermediate_size, limits::WIDTH),
            ("routed_expert_hidden_size", opt(self.routed_expert_hidden_size), limits::WIDTH),
            ("q_lora_rank", opt(self.q_lora_rank), limits::WIDTH),
            ("kv_lora_rank", self.kv_lora_rank, limits::WIDTH),
            ("qk_nope_head_dim", self.qk_nope_head_dim, limits::WIDTH),
            ("qk_rope_head_dim", self.qk_rope_head_dim, limits::WIDTH),
            ("v_head_dim", self.v_head_dim, limits::WIDTH),
            ("num_attention_heads", self.num_attention_heads, limits::HEADS),
            ("linear_attn_config.num_heads", lac.num_heads, limits::HEADS),
            ("linear_attn_config.head_dim", lac.head_dim, limits::WIDTH),
            ("linear_attn_config.short_conv_kernel_size", lac.short_conv_kernel_size, limits::CONV_KERNEL),
            ("num_experts", self.num_experts, limits::EXPERTS),
            ("num_shared_experts", self.num_shared_experts, limits::EXPERTS),
        ];
        for (field, v, max) in checks {
            if v > max {
                return Err(format!("{field} {v} exceeds {max}, beyond any model this runtime supports"));
            }
        }
        Ok(())
    }

    /// The largest spine tensor, a layer's KDA state and the expert record within [`limits`]
    /// (the sizes are already bounded, so these products cannot overflow).
    fn check_products(&self) -> Result<(), String> {
        for spec in crate::schema::spine_specs(self) {
            let numel: u128 = match &spec.shape {
                crate::schema::ShapeRule::Exact(s) => s.iter().map(|&d| d as u128).product(),
                crate::schema::ShapeRule::Numel(n) | crate::schema::ShapeRule::AtLeast(n) => *n as u128,
            };
            if numel > limits::TENSOR_ELEMS {
                return Err(format!(
                    "spine tensor {} would have {numel} elements (limit {})",
                    spec.name,
                    limits::TENSOR_ELEMS
                ));
            }
        }
        let lac = &self.linear_attn_config;
        let state = lac.num_heads as u128 * lac.head_dim as u128 * lac.head_dim as u128;
        if state > limits::TENSOR_ELEMS {
            return Err(format!("a KDA layer's state would have {state} elements (limit {})", limits::TENSOR_ELEMS));
        }
        let record: u128 = crate::schema::expert_parts(self).iter().map(|(_, s)| s[0] as u128 * s[1] as u128).sum();
        if record > limits::RECORD_BYTES {
            return Err(format!("an expert record would be {record} bytes (limit {})", limits::RECORD_BYTES));
        }
        Ok(())
    }
}
