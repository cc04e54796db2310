//! `deltafin synth`: a store with Kimi K3's real routed-expert geometry (hidden 7168, latent
//! 3584, 896 experts of 17,547,264-byte MXFP4 records, top-16) and random weights, for as many
//! layers as asked. It lets a machine's disk be measured at real scale without the 1.56 TB
//! download: two to four layers already exceed the RAM of most machines.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::checksum::{Xxh3, xxh3_64};
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use crate::config::{K3Config, LinearAttnConfig};
use crate::convert::{IO_ALIGN, SpineWriter, align_up, byte_progress};
use crate::error::{StoreError, io_err};
use crate::manifest::record_parts;
use crate::manifest::*;
use crate::schema::{Role, ShapeRule, SpineSpec, expert_parts, spine_specs};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SynthSpine {
    /// K3's real per-layer spine (96-head KDA/MLA attention, two shared experts, full vocab).
    Real,
    /// Only what routing needs (router, latent projections), tiny attention, no shared experts,
    /// small vocab: for expert-only I/O studies.
    Minimal,
}

impl std::str::FromStr for SynthSpine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "real" => Ok(SynthSpine::Real),
            "minimal" => Ok(SynthSpine::Minimal),
            _ => Err(format!("unknown spine '{s}' (expected real or minimal)")),
        }
    }
}

#[derive(Debug, Clone)]
pub struct SynthOptions {
    pub layers: usize,
    pub experts: usize,
    pub spine: SynthSpine,
    pub seed: u64,
    pub progress: bool,
}

/// Kimi K3's text config with `layers` layers, all MoE (no dense first layer, so each layer
/// measures the per-layer expert cost), KDA:MLA 3:1 as in the release.
pub fn k3_config(layers: usize, experts: usize, spine: SynthSpine) -> K3Config {
    let real = spine == SynthSpine::Real;
    let kda: Vec<usize> = (1..=layers).filter(|i| i % 4 != 0).collect();
    let full: Vec<usize> = (1..=layers).filter(|i| i % 4 == 0).collect();
    K3Config {
        vocab_size: if real { 163_840 } else { 4096 },
        hidden_size: 7168,
        num_hidden_layers: layers,
        num_attention_heads: if real { 96 } else { 1 },
        intermediate_size: 33_792,
        rms_norm_eps: 1e-5,
        max_position_embeddings: 1_048_576,
        linear_attn_config: LinearAttnConfig {
            kda_layers: kda,
            full_attn_layers: full,
            num_heads: if real { 96 } else { 1 },
            head_dim: if real { 128 } else { 32 },
            short_conv_kernel_size: 4,
            gate_lower_bound: Some(-5.0),
            use_full_rank_gate: true,
        },
        hidden_act: "situ".into(),
        activation_situ_beta: Some(4.0),
        activation_situ_linear_beta: Some(25.0),
        attn_res_block_size: Some(12),
        q_lora_rank: Some(if real { 1536 } else { 32 }),
        kv_lora_rank: if real { 512 } else { 32 },
        qk_nope_head_dim: if real { 128 } else { 16 },
        qk_rope_head_dim: if real { 64 } else { 16 },
        v_head_dim: if real { 128 } else { 32 },
        mla_use_nope: true,
        mla_use_output_gate: true,
        num_experts: experts,
        num_experts_per_token: 16.min(experts),
        num_shared_experts: if real { 2 } else { 0 },
        moe_intermediate_size: 3072,
        moe_router_activation_func: "sigmoid".into(),
        moe_renormalize: true,
        routed_scaling_factor: 1.0,
        first_k_dense_replace: 0,
        moe_layer_freq: 1,
        num_expert_group: 1,
        topk_group: 1,
        routed_expert_hidden_size: Some(3584),
        latent_moe_use_norm: true,
        tie_word_embeddings: false,
    }
}

/// Deterministic value for a vector tensor, by what the name says it is.
fn vector_value(name: &str, i: usize, rng: &mut SmallRng) -> f32 {
    if name.ends_with("A_log") {
        (1.0 + (i % 15) as f32).ln()
    } else if name.ends_with("conv1d.weight") {
        rng.random_range(-0.3..0.3)
    } else if name.ends_with("res_proj.weight") {
        rng.random_range(-0.02..0.02)
    } else if name.ends_with("norm.weight") || name.ends_with("layernorm.weight") {
        1.0
    } else {
        0.0
    }
}

pub fn synth(out: &Path, o: &SynthOptions) -> Result<Manifest, StoreError> {
    if o.layers == 0 || o.experts < 16 {
        return Err(StoreError::Store { path: out.into(), msg: "synth needs at least 1 layer and 16 experts".into() });
    }
    let cfg = k3_config(o.layers, o.experts, o.spine);
    std::fs::create_dir_all(out.join("experts")).map_err(io_err(out))?;
    let mut rng = SmallRng::seed_from_u64(o.seed);

    // --- spine: int8 matrices with per-row scales giving rows of norm ~1, f32 vectors ---
    let spine_path = out.join("spine.bin");
    let mut w = SpineWriter::create(&spine_path)?;
    let mut tensors = Vec::new();
    let mut last_layer = None;
    for spec in spine_specs(&cfg) {
        if last_layer != Some(spec.layer) {
            w.pad_to(IO_ALIGN)?;
            last_layer = Some(spec.layer);
        }
        w.pad_to(64)?;
        let shape = spec_shape(&spec);
        let mut h = Xxh3::new();
        let offset = w.pos;
        let (mut scales_offset, mut scales_len, mut group) = (0, 0, 0);
        let dtype;
        if spec.role == Role::Matrix {
            dtype = SpineDtype::Int8;
            let (rows, cols) = (shape[0], shape[1]);
            let mut row = vec![0u8; cols];
            for _ in 0..rows {
                rng.fill_bytes(&mut row);
                row.iter_mut().for_each(|b| {
                    if *b == 0x80 {
                        *b = 0x81; // keep int8 symmetric: no -128
                    }
                });
                w.write(&row, Some(&mut h))?;
            }
            w.pad_to(64)?;
            scales_offset = w.pos;
            // Uniform int8 in [-127, 127] has std ~73; scale rows to unit-variance outputs.
            let s = (1.0 / (73.0 * (cols as f32).sqrt())).to_le_bytes();
            let scales: Vec<u8> = (0..rows).flat_map(|_| s).collect();
            w.write(&scales, Some(&mut h))?;
            scales_len = scales.len() as u64;
            group = cols;
        } else {
            dtype = SpineDtype::F32;
            let n: usize = shape.iter().product();
            let bytes: Vec<u8> = (0..n).flat_map(|i| vector_value(&spec.name, i, &mut rng).to_le_bytes()).collect();
            w.write(&bytes, Some(&mut h))?;
        }
        let len = if dtype == SpineDtype::Int8 { (shape[0] * shape[1]) as u64 } else { w.pos - offset };
        tensors.push(SpineTensor {
            name: spec.name.clone(),
            layer: spec.layer,
            dtype,
            shape,
            offset,
            len,
            scales_offset,
            scales_len,
            group,
            xxh3: h.digest(),
        });
    }
    w.pad_to(IO_ALIGN)?;
    let spine_bytes = w.pos;
    w.finish()?;

    // --- experts: packed, 4096-aligned records of random MXFP4 ---
    let parts = expert_parts(&cfg);
    let (part_meta, record_bytes) = record_parts(&parts);
    let stride = align_up(record_bytes, IO_ALIGN);
    let bar = byte_progress(stride * o.experts as u64 * o.layers as u64, o.progress);
    bar.set_message("experts");
    let mut files = Vec::new();
    let mut layers = Vec::new();
    let mut record = vec![0u8; stride as usize];
    for l in 0..o.layers {
        let rel = format!("experts/layer-{l:03}.bin");
        let p = out.join(&rel);
        let f = File::create(&p).map_err(io_err(&p))?;
        let mut w = BufWriter::with_capacity(32 << 20, f);
        let mut experts = Vec::with_capacity(o.experts);
        for e in 0..o.experts {
            for (pm, (name, _)) in part_meta.iter().zip(&parts) {
                let dst = &mut record[pm.offset as usize..(pm.offset + pm.len) as usize];
                if name.ends_with("weight_scale") {
                    // 2^-7 .. 2^-5: keeps a random expert's outputs O(1) at K3's widths.
                    dst.iter_mut().for_each(|b| *b = 120 + (rng.next_u32() % 3) as u8);
                } else {
                    rng.fill_bytes(dst);
                }
            }
            let xxh3 = xxh3_64(&record[..record_bytes as usize]);
            w.write_all(&record).map_err(io_err(&p))?;
            experts.push(ExpertLocation { ranges: vec![[l as u64, e as u64 * stride, record_bytes]], xxh3 });
            bar.inc(stride);
        }
        let f = w.into_inner().map_err(|e| StoreError::Io { path: p.clone(), source: e.into_error() })?;
        f.sync_all().map_err(io_err(&p))?;
        files.push(rel);
        layers.push(ExpertLayer { layer: l, experts });
    }
    bar.finish_and_clear();
    let manifest = packed_manifest(cfg, "synthetic:", spine_bytes, tensors, files, layers);
    manifest.save(out)?;
    Ok(manifest)
}

/// Kimi K3 as released: 93 layers (the first dense, 92 with 896 routed experts, top-16), 69 KDA
/// and 24 MLA layers, the real per-layer spine. The exact positions of the MLA layers do not
/// change a memory plan (their spine sizes do, and the count is the release's): here every
/// fourth layer and the last.
pub fn k3_release_config() -> K3Config {
    let mut c = k3_config(93, 896, SynthSpine::Real);
    c.first_k_dense_replace = 1;
    let full: Vec<usize> = (1..=93).filter(|i| i % 4 == 0 || *i == 93).collect();
    c.linear_attn_config.kda_layers = (1..=93).filter(|i| !full.contains(i)).collect();
    c.linear_attn_config.full_attn_layers = full;
    c
}

/// The manifest a store of `cfg` would have (int8 spine with per-row scales, packed 4096-aligned
/// expert records), without any weights: what `deltafin plan` needs to plan memory for a model
/// that is not on this machine.
pub fn paper_manifest(cfg: &K3Config) -> Manifest {
    let mut pos = 0u64;
    let mut tensors = Vec::new();
    let mut last_layer = None;
    for spec in spine_specs(cfg) {
        if last_layer != Some(spec.layer) {
            pos = align_up(pos, IO_ALIGN);
            last_layer = Some(spec.layer);
        }
        pos = align_up(pos, 64);
        let shape = spec_shape(&spec);
        let numel: usize = shape.iter().product();
        let offset = pos;
        let (dtype, len, scales_offset, scales_len, group) = if spec.role == Role::Matrix {
            let q = numel as u64;
            let scales_offset = align_up(offset + q, 64);
            (SpineDtype::Int8, q, scales_offset, shape[0] as u64 * 4, shape[1])
        } else {
            (SpineDtype::F32, numel as u64 * 4, 0, 0, 0)
        };
        pos = if scales_len > 0 { scales_offset + scales_len } else { offset + len };
        tensors.push(SpineTensor {
            name: spec.name,
            layer: spec.layer,
            dtype,
            shape,
            offset,
            len,
            scales_offset,
            scales_len,
            group,
            xxh3: 0,
        });
    }
    let (_, record_bytes) = record_parts(&expert_parts(cfg));
    let stride = align_up(record_bytes, IO_ALIGN);
    let moe = cfg.moe_layers();
    let layers = moe
        .iter()
        .enumerate()
        .map(|(f, &l)| ExpertLayer {
            layer: l,
            experts: (0..cfg.num_experts)
                .map(|e| ExpertLocation { ranges: vec![[f as u64, e as u64 * stride, record_bytes]], xxh3: 0 })
                .collect(),
        })
        .collect();
    let files = moe.iter().map(|l| format!("experts/layer-{l:03}.bin")).collect();
    packed_manifest(cfg.clone(), "paper:", align_up(pos, IO_ALIGN), tensors, files, layers)
}

/// A spec's shape as stored: the exact shape, or the one-dimensional length a rule names.
fn spec_shape(spec: &SpineSpec) -> Vec<usize> {
    match &spec.shape {
        ShapeRule::Exact(s) => s.clone(),
        ShapeRule::Numel(n) | ShapeRule::AtLeast(n) => vec![*n],
    }
}

/// The manifest of a store laid out here: an int8 spine (per-row scales) of `spine_bytes`, and
/// packed 4096-aligned expert records in `files`, one per MoE layer.
fn packed_manifest(
    cfg: K3Config,
    prefix: &str,
    spine_bytes: u64,
    tensors: Vec<SpineTensor>,
    files: Vec<String>,
    layers: Vec<ExpertLayer>,
) -> Manifest {
    let (parts, record_bytes) = record_parts(&expert_parts(&cfg));
    Manifest {
        format: FORMAT_NAME.into(),
        version: FORMAT_VERSION,
        arch: "kimi_k3".into(),
        config: cfg,
        source: SourceInfo { dir: String::new(), prefix: prefix.into(), shards: Vec::new() },
        spine: SpineInfo {
            file: "spine.bin".into(),
            matrix_dtype: SpineDtype::Int8,
            int8_group: 0,
            router_f32: false,
            keep: Vec::new(),
            auto: None,
            bytes: spine_bytes,
            tensors,
        },
        experts: ExpertsInfo { layout: ExpertLayout::Pack, format: "mxfp4".into(), record_bytes, parts, files, layers },
        tokenizer: None,
        origin: None,
        streaming: None,
    }
}

#[cfg(test)]
mod paper_tests {
    use super::*;

    /// The paper manifest of the release has the release's sizes (MODELS.md): 92 routed layers
    /// of 896 experts of 17,547,264 bytes, 69 KDA and 24 MLA layers, and an int8 spine of
    /// about 60 GB.
    #[test]
    fn the_release_on_paper() {
        let c = k3_release_config();
        assert_eq!((c.linear_attn_config.kda_layers.len(), c.linear_attn_config.full_attn_layers.len()), (69, 24));
        let m = paper_manifest(&c);
        assert_eq!(m.experts.layers.len(), 92);
        assert_eq!(m.experts.record_bytes, 17_547_264);
        let gb = m.spine.bytes as f64 / 1e9;
        assert!((50.0..70.0).contains(&gb), "int8 spine {gb} GB");
    }
}
