//! The tensors a Kimi K3 text model must have, with the shapes its config implies.
//!
//! One table drives conversion (what to copy, what to check) and loading (what the engine may ask
//! for), so a missing or mis-shaped tensor is reported by name before any arithmetic runs.

use crate::config::{AttnKind, K3Config};

/// How a spine tensor is stored and used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A weight matrix `[out, in]` used in matrix-vector products: eligible for int8/bf16.
    Matrix,
    /// Norm weights, biases, gates' correction bias, A_log, dt_bias, conv taps: always f32.
    Vector,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ShapeRule {
    Exact(Vec<usize>),
    /// Any shape with exactly this many elements (e.g. `dt_bias` as `[P]` or `[heads, D]`).
    Numel(usize),
    /// Any 1-D shape with at least this many elements: the release stores `A_log` head_dim long
    /// with only the first `num_heads` entries real.
    AtLeast(usize),
}

impl ShapeRule {
    pub fn accepts(&self, shape: &[usize]) -> bool {
        let numel: usize = shape.iter().product();
        match self {
            ShapeRule::Exact(s) => s == shape,
            ShapeRule::Numel(n) => numel == *n,
            ShapeRule::AtLeast(n) => shape.len() == 1 && numel >= *n,
        }
    }
}

#[derive(Debug, Clone)]
pub struct SpineSpec {
    /// Name inside the store: the checkpoint name without the `language_model.model.` prefix
    /// (`lm_head.weight` for the head).
    pub name: String,
    /// Layer the tensor belongs to; `None` for embeddings, final norm and head.
    pub layer: Option<usize>,
    pub role: Role,
    pub shape: ShapeRule,
}

fn mat(layer: Option<usize>, name: String, rows: usize, cols: usize) -> SpineSpec {
    SpineSpec { name, layer, role: Role::Matrix, shape: ShapeRule::Exact(vec![rows, cols]) }
}

fn vec1(layer: Option<usize>, name: String, n: usize) -> SpineSpec {
    SpineSpec { name, layer, role: Role::Vector, shape: ShapeRule::Exact(vec![n]) }
}

fn vrule(layer: Option<usize>, name: String, shape: ShapeRule) -> SpineSpec {
    SpineSpec { name, layer, role: Role::Vector, shape }
}

/// Every spine tensor of the model, in the order the store lays them out (per layer, then the
/// top-level tensors), so a spine too large for RAM can be read layer by layer.
pub fn spine_specs(c: &K3Config) -> Vec<SpineSpec> {
    let h = c.hidden_size;
    let mut v = Vec::new();
    v.push(mat(None, "embed_tokens.weight".into(), c.vocab_size, h));
    for l in 0..c.num_hidden_layers {
        let p = format!("layers.{l}.");
        let ly = Some(l);
        v.push(vec1(ly, format!("{p}input_layernorm.weight"), h));
        v.push(vec1(ly, format!("{p}post_attention_layernorm.weight"), h));
        if c.attn_res_block_size.is_some() {
            for r in ["self_attention_res", "mlp_res"] {
                v.push(vec1(ly, format!("{p}{r}_norm.weight"), h));
                v.push(vrule(ly, format!("{p}{r}_proj.weight"), ShapeRule::Exact(vec![1, h])));
            }
        }
        let a = format!("{p}self_attn.");
        match c.attn_kind(l) {
            AttnKind::Kda => {
                let lac = &c.linear_attn_config;
                let (nh, d, k) = (lac.num_heads, lac.head_dim, lac.short_conv_kernel_size);
                let pd = nh * d;
                for n in ["q", "k", "v"] {
                    v.push(mat(ly, format!("{a}{n}_proj.weight"), pd, h));
                    v.push(vrule(ly, format!("{a}{n}_conv1d.weight"), ShapeRule::Numel(pd * k)));
                }
                v.push(mat(ly, format!("{a}f_a_proj.weight"), d, h));
                v.push(mat(ly, format!("{a}f_b_proj.weight"), pd, d));
                v.push(mat(ly, format!("{a}b_proj.weight"), nh, h));
                if lac.use_full_rank_gate {
                    v.push(mat(ly, format!("{a}g_proj.weight"), pd, h));
                } else {
                    v.push(mat(ly, format!("{a}g_a_proj.weight"), d, h));
                    v.push(mat(ly, format!("{a}g_b_proj.weight"), pd, d));
                }
                v.push(vrule(ly, format!("{a}A_log"), ShapeRule::AtLeast(nh)));
                v.push(vrule(ly, format!("{a}dt_bias"), ShapeRule::Numel(pd)));
                v.push(vec1(ly, format!("{a}o_norm.weight"), d));
                v.push(mat(ly, format!("{a}o_proj.weight"), h, pd));
            }
            AttnKind::Mla => {
                let nh = c.num_attention_heads;
                let qd = c.qk_nope_head_dim + c.qk_rope_head_dim;
                match c.q_lora_rank {
                    Some(r) => {
                        v.push(mat(ly, format!("{a}q_a_proj.weight"), r, h));
                        v.push(vec1(ly, format!("{a}q_a_layernorm.weight"), r));
                        v.push(mat(ly, format!("{a}q_b_proj.weight"), nh * qd, r));
                    }
                    None => v.push(mat(ly, format!("{a}q_proj.weight"), nh * qd, h)),
                }
                v.push(mat(ly, format!("{a}kv_a_proj_with_mqa.weight"), c.kv_lora_rank + c.qk_rope_head_dim, h));
                v.push(vec1(ly, format!("{a}kv_a_layernorm.weight"), c.kv_lora_rank));
                v.push(mat(
                    ly,
                    format!("{a}kv_b_proj.weight"),
                    nh * (c.qk_nope_head_dim + c.v_head_dim),
                    c.kv_lora_rank,
                ));
                if c.mla_use_output_gate {
                    v.push(mat(ly, format!("{a}g_proj.weight"), nh * c.v_head_dim, h));
                }
                v.push(mat(ly, format!("{a}o_proj.weight"), h, nh * c.v_head_dim));
            }
        }
        if c.is_moe_layer(l) {
            let m = format!("{p}block_sparse_moe.");
            v.push(mat(ly, format!("{m}gate.weight"), c.num_experts, h));
            v.push(vec1(ly, format!("{m}gate.e_score_correction_bias"), c.num_experts));
            if let Some(lat) = c.routed_expert_hidden_size {
                v.push(mat(ly, format!("{m}routed_expert_down_proj.weight"), lat, h));
                if c.latent_moe_use_norm {
                    v.push(vec1(ly, format!("{m}routed_expert_norm.weight"), lat));
                }
                v.push(mat(ly, format!("{m}routed_expert_up_proj.weight"), h, lat));
            }
            if c.num_shared_experts > 0 {
                let si = c.moe_intermediate_size * c.num_shared_experts;
                v.push(mat(ly, format!("{m}shared_experts.gate_proj.weight"), si, h));
                v.push(mat(ly, format!("{m}shared_experts.up_proj.weight"), si, h));
                v.push(mat(ly, format!("{m}shared_experts.down_proj.weight"), h, si));
            }
        } else {
            let i = c.intermediate_size;
            v.push(mat(ly, format!("{p}mlp.gate_proj.weight"), i, h));
            v.push(mat(ly, format!("{p}mlp.up_proj.weight"), i, h));
            v.push(mat(ly, format!("{p}mlp.down_proj.weight"), h, i));
        }
    }
    v.push(vec1(None, "norm.weight".into(), h));
    if c.attn_res_block_size.is_some() {
        v.push(vec1(None, "output_attn_res_norm.weight".into(), h));
        v.push(vrule(None, "output_attn_res_proj.weight".into(), ShapeRule::Exact(vec![1, h])));
    }
    if !c.tie_word_embeddings {
        v.push(mat(None, "lm_head.weight".into(), c.vocab_size, h));
    }
    v
}

/// The six tensors of one routed expert, in the record's canonical order (name order, as the K3
/// release stores them): `(suffix, shape)`.
pub fn expert_parts(c: &K3Config) -> Vec<(&'static str, [usize; 2])> {
    let lat = c.expert_input_dim();
    let i = c.moe_intermediate_size;
    vec![
        ("w1.weight_packed", [i, lat / 2]),
        ("w1.weight_scale", [i, lat / 32]),
        ("w2.weight_packed", [lat, i / 2]),
        ("w2.weight_scale", [lat, i / 32]),
        ("w3.weight_packed", [i, lat / 2]),
        ("w3.weight_scale", [i, lat / 32]),
    ]
}

/// Full checkpoint name of a store spine name.
pub fn checkpoint_name(prefix: &str, store_name: &str) -> String {
    if store_name == "lm_head.weight" {
        // `language_model.model.` -> `language_model.lm_head.weight`
        let outer = prefix.strip_suffix("model.").unwrap_or(prefix);
        format!("{outer}lm_head.weight")
    } else {
        format!("{prefix}{store_name}")
    }
}

pub fn expert_tensor_name(prefix: &str, layer: usize, expert: usize, suffix: &str) -> String {
    format!("{prefix}layers.{layer}.block_sparse_moe.experts.{expert}.{suffix}")
}
