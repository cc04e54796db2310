//! Absorbed-MLA attention of a chunk on the GPU against the CPU's scalar kernel
//! (`mla_attend_chunk_on` on the scalar path), on whatever adapter opens (`common`): f32 and bf16
//! caches, K3's row (576 values, a 512-value latent) and a narrow one, heads that fill their
//! workgroups and heads that do not, a chunk after cached positions and one from position 0.

use deltafin_gpu::GpuError;
use deltafin_gpu::attention::MlaAttention;
use deltafin_kernels::attention::{mla_attend_chunk_on, mla_attend_scratch};
use deltafin_kernels::cpu::Path;
use deltafin_kernels::format::LatentRows;
use deltafin_kernels::testdata::bytes;

mod common;
use common::gpu;

/// Values in [-1, 1), as a normed latent's are.
fn vals(n: usize, seed: u64) -> Vec<f32> {
    bytes(n, seed).iter().map(|&b| (f32::from(b) - 127.5) / 128.0).collect()
}

#[test]
fn chunk_attention_matches_the_cpu_kernel() {
    let Some(g) = gpu("chunk_attention_matches_the_cpu_kernel") else { return };
    let mla = MlaAttention::new(&g);
    // (heads, tokens, cached before, width, latent)
    for (heads, t_n, first, width, kvl) in [(20, 24, 37, 576, 512), (32, 17, 0, 576, 512), (5, 9, 3, 24, 16)] {
        let len = first + t_n;
        let scale = (width as f32).powf(-0.5);
        let q: Vec<f32> = vals(heads * t_n * width, 1 + width as u64).iter().map(|v| 3.0 * v * scale).collect();
        let cache = vals(len * width, 2 + heads as u64);
        let bf16: Vec<u16> = cache.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let widened: Vec<f32> = bf16.iter().map(|&b| f32::from_bits(u32::from(b) << 16)).collect();
        for (rows, name) in [(LatentRows::F32(&cache), "f32"), (LatentRows::Bf16(&bf16), "bf16")] {
            let mut want = vec![0f32; t_n * heads * kvl]; // [t_n, heads, kvl]
            let mut sc = vec![0f32; mla_attend_scratch(heads, t_n, width)];
            mla_attend_chunk_on(Path::Scalar, &q, heads, t_n, first, rows, width, kvl, &mut want, &mut sc);
            let mut got = vec![f32::NAN; heads * t_n * kvl]; // [heads, t_n, kvl]
            mla.attend(&g, &q, heads, t_n, first, rows, width, kvl, &mut got).unwrap();
            let src = if name == "f32" { &cache } else { &widened };
            for h in 0..heads {
                for i in 0..t_n {
                    for c in 0..kvl {
                        let (gv, wv) = (got[(h * t_n + i) * kvl + c], want[(i * heads + h) * kvl + c]);
                        assert!(
                            (gv - wv).abs() <= 2e-5,
                            "{name} cache, {heads} heads, width {width}: head {h} token {i} channel {c}: gpu {gv} cpu {wv}"
                        );
                    }
                }
            }
            // The same chunk in two calls over rows uploaded once (as the model runs a long
            // chunk), and a call past the uploaded rows refused.
            let half = t_n / 2;
            let mut two = vec![f32::NAN; heads * t_n * kvl];
            {
                let mut ch = mla.chunk(&g, rows, len, width, kvl).unwrap();
                for (t0, n) in [(0, half), (half, t_n - half)] {
                    let qs: Vec<f32> = (0..heads)
                        .flat_map(|h| q[(h * t_n + t0) * width..(h * t_n + t0 + n) * width].to_vec())
                        .collect();
                    let mut o = vec![0f32; heads * n * kvl];
                    ch.attend(&qs, heads, n, first + t0, &mut o).unwrap();
                    for h in 0..heads {
                        two[(h * t_n + t0) * kvl..(h * t_n + t0 + n) * kvl]
                            .copy_from_slice(&o[h * n * kvl..(h + 1) * n * kvl]);
                    }
                }
                let mut o = vec![0f32; heads * kvl];
                let r = ch.attend(&q[..heads * width], heads, 1, len, &mut o);
                assert!(matches!(r, Err(GpuError::Shape { .. })), "{r:?}");
            }
            let d = two.iter().zip(&got).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(d <= 1e-6, "{name}: two calls over one upload differ from one call by {d}");
            // Token 0 of a chunk from position 0 sees only its own row: its output is that row.
            if first == 0 {
                for h in 0..heads {
                    for c in 0..kvl {
                        assert!((got[h * t_n * kvl + c] - src[c]).abs() <= 1e-6, "{name}: a single position's output");
                    }
                }
            }
        }
    }
}

#[test]
fn shapes_it_cannot_take_are_errors() {
    let Some(g) = gpu("shapes_it_cannot_take_are_errors") else { return };
    let mla = MlaAttention::new(&g);
    let (heads, t_n, width, kvl) = (4, 3, 24, 16);
    let q = vec![0f32; heads * t_n * width];
    let cache = vec![0f32; t_n * width];
    let mut out = vec![0f32; heads * t_n * kvl];
    // A row wider than the shader holds; a width off the vector; a cache shorter than the chunk.
    assert!(!MlaAttention::supports(580, 512) && !MlaAttention::supports(22, 16) && MlaAttention::supports(576, 512));
    let r = mla.attend(&g, &q, heads, t_n, 0, LatentRows::F32(&cache), 22, kvl, &mut out);
    assert!(matches!(r, Err(GpuError::Shape { .. })), "{r:?}");
    let r = mla.attend(&g, &q, heads, t_n, 1, LatentRows::F32(&cache), width, kvl, &mut out);
    assert!(matches!(r, Err(GpuError::Shape { .. })), "{r:?}");
    let r = mla.attend(&g, &q, heads, t_n, 0, LatentRows::F32(&cache), width, kvl, &mut out[1..]);
    assert!(matches!(r, Err(GpuError::Shape { .. })), "{r:?}");
}
