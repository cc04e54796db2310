//! The GPU's MXFP4 products against their CPU scalar twin (`deltafin_kernels::scalar`), on
//! whatever adapter this machine has: Mesa's llvmpipe in CI (chosen on purpose: a CPU-type
//! adapter is allowed here), the H200 in the benchmark runs. `DELTAFIN_GPU_ADAPTER` picks one
//! by name.
//! Where no adapter opens: `common`.

use deltafin_gpu::mxfp4::Mxfp4Product;
use deltafin_gpu::roofline::{fma_peak_gflops, read_bandwidth_gbps};
use deltafin_gpu::{Gpu, GpuError, GpuOptions};

mod common;
use common::gpu;
use deltafin_kernels::format::{BLOCK, E2M1_LUT, mxfp4_decode_row};
use deltafin_kernels::scalar::mxfp4_matvec;
use deltafin_kernels::testdata::{bytes, scales};

/// The scalar twin token by token, and per output the sum of |w x| its error is measured against.
/// Shapes: xs `[n, cols]`; returns out `[n, rows]` twice.
fn reference(packed: &[u8], sc: &[u8], rows: usize, cols: usize, xs: &[f32], n: usize) -> (Vec<f32>, Vec<f32>) {
    let mut out = vec![0f32; n * rows];
    let mut mag = vec![0f32; n * rows];
    let mut w = vec![0f32; cols];
    for t in 0..n {
        let x = &xs[t * cols..(t + 1) * cols];
        mxfp4_matvec(packed, sc, rows, cols, x, &mut out[t * rows..(t + 1) * rows]);
    }
    for r in 0..rows {
        mxfp4_decode_row(
            &packed[r * cols / 2..(r + 1) * cols / 2],
            &sc[r * cols / BLOCK..(r + 1) * cols / BLOCK],
            &mut w,
        );
        for t in 0..n {
            mag[t * rows + r] = w.iter().zip(&xs[t * cols..(t + 1) * cols]).map(|(a, b)| (a * b).abs()).sum();
        }
    }
    (out, mag)
}

fn inputs(n: usize, cols: usize, seed: u64) -> Vec<f32> {
    bytes(n * cols, seed).iter().map(|&b| (b as f32 - 127.5) / 64.0).collect()
}

/// Run the GPU product on random weights and compare: each output within 2e-6 of the sum of
/// |w x| (f32 sums in another order: a few ulps of the largest partial sum).
fn check(g: &Gpu, k: &Mxfp4Product, rows: usize, cols: usize, n: usize, seed: u64) {
    let packed = bytes(rows * cols / 2, seed);
    let sc = scales(rows * cols / BLOCK, seed + 1, 118, 12);
    let xs = inputs(n, cols, seed + 2);
    let w = g.upload_mxfp4(&packed, &sc, rows, cols).unwrap();
    let xg = g.upload_f32(&xs).unwrap();
    let og = g.zeros_f32(n * rows).unwrap();
    let p = k.bind(g, &w, &xg, n, &og).unwrap();
    p.run(g).unwrap();
    let got = g.read_f32(&og).unwrap();
    let (want, mag) = reference(&packed, &sc, rows, cols, &xs, n);
    for i in 0..n * rows {
        let tol = 2e-6 * mag[i] + 1e-30;
        assert!(
            (got[i] - want[i]).abs() <= tol,
            "{rows} x {cols}, {n} tokens: token {} row {}: gpu {} cpu {} (|w x| sum {})",
            i / rows,
            i % rows,
            got[i],
            want[i],
            mag[i]
        );
    }
}

#[test]
fn one_token_products_match_the_scalar_twin() {
    let Some(g) = gpu("one_token_products_match_the_scalar_twin") else { return };
    let k = Mxfp4Product::new(&g);
    // Rows off the 8-row workgroup, rows of one block, of fewer blocks than a team has lanes, of
    // more (K3's expert down rows: 3,072 columns = 96 blocks).
    for (i, &(rows, cols)) in [(1, 32), (7, 64), (37, 96), (9, 1056), (20, 3072)].iter().enumerate() {
        check(&g, &k, rows, cols, 1, 10 + i as u64);
    }
}

#[test]
fn chunk_products_match_the_scalar_twin() {
    let Some(g) = gpu("chunk_products_match_the_scalar_twin") else { return };
    let k = Mxfp4Product::new(&g);
    // Tokens and rows inside one tile, across tiles and off their edges (64 rows x 32 tokens).
    for (i, &(rows, cols, n)) in [(1, 32, 2), (5, 64, 3), (64, 96, 32), (70, 128, 33), (130, 64, 70)].iter().enumerate()
    {
        check(&g, &k, rows, cols, n, 40 + i as u64);
    }
}

/// Every nibble in both halves of a byte decodes to its E2M1 value times the scale, exactly:
/// row r holds nibble r everywhere, and a one-hot input picks one element. Scales from 2^-27 to
/// 2^33, whose products stay normal f32 (a GPU may flush subnormals, and the chunk kernel scales
/// each weight before the sum, where the scalar twin scales the block's sum).
#[test]
fn every_nibble_and_scale_decode_exactly() {
    let Some(g) = gpu("every_nibble_and_scale_decode_exactly") else { return };
    let k = Mxfp4Product::new(&g);
    let (rows, cols) = (16, 64);
    let packed: Vec<u8> = (0..rows).flat_map(|r| std::iter::repeat_n((r as u8) | (r as u8) << 4, cols / 2)).collect();
    for scale in [100u8, 118, 125, 127, 140, 160] {
        let sc = vec![scale; rows * cols / BLOCK];
        let w = g.upload_mxfp4(&packed, &sc, rows, cols).unwrap();
        for hot in [0usize, 1, 30, 33, 63] {
            for n in [1usize, 2] {
                let mut xs = vec![0f32; n * cols];
                xs[(n - 1) * cols + hot] = 1.0;
                let xg = g.upload_f32(&xs).unwrap();
                let og = g.zeros_f32(n * rows).unwrap();
                let p = k.bind(&g, &w, &xg, n, &og).unwrap();
                p.run(&g).unwrap();
                let got = g.read_f32(&og).unwrap();
                let s = deltafin_kernels::e8m0_to_f32(scale);
                for r in 0..rows {
                    let want = E2M1_LUT[r] * s;
                    let v = got[(n - 1) * rows + r];
                    assert!(
                        v == want || (want == 0.0 && v == 0.0),
                        "nibble {r}, scale {scale}, column {hot}, {n} tokens: {v} != {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn bad_shapes_are_errors_not_panics() {
    let Some(g) = gpu("bad_shapes_are_errors_not_panics") else { return };
    let k = Mxfp4Product::new(&g);
    assert!(matches!(g.upload_mxfp4(&[0; 8], &[0; 1], 1, 16), Err(GpuError::Shape { .. })));
    assert!(matches!(g.upload_mxfp4(&[0; 15], &[0; 1], 1, 32), Err(GpuError::Shape { .. })));
    let w = g.upload_mxfp4(&[0; 32], &[127; 2], 2, 32).unwrap();
    let x = g.upload_f32(&[0.0; 32]).unwrap();
    let o = g.zeros_f32(2).unwrap();
    assert!(matches!(k.bind(&g, &w, &x, 2, &o), Err(GpuError::Shape { .. })));
    assert!(matches!(k.bind(&g, &w, &x, 0, &o), Err(GpuError::Shape { .. })));
    assert!(k.bind(&g, &w, &x, 1, &o).is_ok());
}

#[test]
fn the_roofs_measure_something() {
    let Some(g) = gpu("the_roofs_measure_something") else { return };
    let bw = read_bandwidth_gbps(&g, 16 << 20, 0.05).unwrap();
    let fma = fma_peak_gflops(&g, 64, 0.05).unwrap();
    assert!(bw.is_finite() && bw > 0.0, "read bandwidth {bw}");
    assert!(fma.is_finite() && fma > 0.0, "FMA rate {fma}");
}

/// Asking for an adapter that is not there says so and lists what there is; it never panics
/// and never falls back silently (this runs on machines without any GPU too).
#[test]
fn a_missing_adapter_is_a_clear_error() {
    let opts = GpuOptions { allow_software: true, name: Some("no-such-adapter-7f3a".into()) };
    let Err(e) = Gpu::open(&opts) else { panic!("an adapter named no-such-adapter-7f3a opened") };
    let m = e.to_string();
    assert!(m.starts_with("no usable GPU adapter named like \"no-such-adapter-7f3a\""), "{m}");
}
