//! KDA's recurrence over a chunk on the GPU against the CPU's scalar step
//! (`scalar::kda_head_step`), token by token, on whatever adapter opens (`common`): K3's head
//! size and a small one, outputs and the state left behind.

use deltafin_gpu::GpuError;
use deltafin_gpu::kda::KdaRecurrence;
use deltafin_kernels::scalar::kda_head_step;
use deltafin_kernels::testdata::bytes;

mod common;
use common::gpu;

/// Values in [lo, hi).
fn vals(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    bytes(n, seed).iter().map(|&b| lo + (hi - lo) * f32::from(b) / 256.0).collect()
}

/// Each head's segment of each token scaled to unit length (as the model normalises q and k).
fn unit_rows(v: &mut [f32], d: usize) {
    for row in v.chunks_mut(d) {
        let n = row.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
        row.iter_mut().for_each(|x| *x /= n);
    }
}

#[test]
fn chunk_recurrence_matches_the_scalar_steps() {
    let Some(g) = gpu("chunk_recurrence_matches_the_scalar_steps") else { return };
    for (heads, d, t_n) in [(3, 128, 21), (5, 32, 40)] {
        let rec = KdaRecurrence::new(&g, d).unwrap();
        let p = heads * d;
        let (mut q, mut k) = (vals(t_n * p, 1, -1.0, 1.0), vals(t_n * p, 2, -1.0, 1.0));
        unit_rows(&mut q, d);
        unit_rows(&mut k, d);
        let decay = vals(t_n * p, 3, 0.6, 1.0);
        let v = vals(t_n * p, 4, -2.0, 2.0);
        let beta = vals(t_n * heads, 5, 0.05, 0.95);
        let s0 = vals(heads * d * d, 6, -0.5, 0.5);
        let (mut want_s, mut want_y) = (s0.clone(), vec![0f32; t_n * p]);
        let mut delta = vec![0f32; d];
        for t in 0..t_n {
            for h in 0..heads {
                let o = t * p + h * d..t * p + (h + 1) * d;
                kda_head_step(
                    &mut want_s[h * d * d..(h + 1) * d * d],
                    &q[o.clone()],
                    &k[o.clone()],
                    &v[o.clone()],
                    &decay[o.clone()],
                    beta[t * heads + h],
                    &mut delta,
                    &mut want_y[o],
                );
            }
        }
        let (mut s, mut y) = (s0.clone(), vec![f32::NAN; t_n * p]);
        rec.run(&g, &mut s, &q, &k, &decay, &v, &beta, heads, t_n, &mut y).unwrap();
        let scale = want_y.iter().chain(&want_s).fold(0f32, |m, x| m.max(x.abs()));
        for (i, (a, b)) in y.iter().zip(&want_y).enumerate() {
            assert!((a - b).abs() <= 2e-5 * scale, "d {d}: y[{i}] gpu {a} cpu {b} (scale {scale})");
        }
        for (i, (a, b)) in s.iter().zip(&want_s).enumerate() {
            assert!((a - b).abs() <= 2e-5 * scale, "d {d}: state[{i}] gpu {a} cpu {b} (scale {scale})");
        }
        // Twice more from where it left off, in two calls of different lengths: the same as
        // walking the tokens again in one (the buffers are reused and the state carried).
        let (mut s2, mut y2) = (s.clone(), vec![0f32; t_n * p]);
        rec.run(&g, &mut s2, &q, &k, &decay, &v, &beta, heads, t_n, &mut y2).unwrap();
        let half = t_n / 2;
        let (mut s3, mut y3) = (s.clone(), vec![0f32; t_n * p]);
        let (ya, yb) = y3.split_at_mut(half * p);
        rec.run(
            &g,
            &mut s3,
            &q[..half * p],
            &k[..half * p],
            &decay[..half * p],
            &v[..half * p],
            &beta[..half * heads],
            heads,
            half,
            ya,
        )
        .unwrap();
        rec.run(
            &g,
            &mut s3,
            &q[half * p..],
            &k[half * p..],
            &decay[half * p..],
            &v[half * p..],
            &beta[half * heads..],
            heads,
            t_n - half,
            yb,
        )
        .unwrap();
        let scale2 = y2.iter().chain(&s2).fold(0f32, |m, x| m.max(x.abs()));
        for (a, b) in y3.iter().chain(&s3).zip(y2.iter().chain(&s2)) {
            assert!((a - b).abs() <= 1e-5 * scale2, "d {d}: split {a} vs whole {b}");
        }
    }
}

#[test]
fn shapes_it_cannot_take_are_errors() {
    let Some(g) = gpu("shapes_it_cannot_take_are_errors") else { return };
    assert!(!KdaRecurrence::supports(130) && !KdaRecurrence::supports(256) && KdaRecurrence::supports(128));
    assert!(matches!(KdaRecurrence::new(&g, 30), Err(GpuError::Shape { .. })));
    let rec = KdaRecurrence::new(&g, 8).unwrap();
    let (heads, t_n) = (2, 3);
    let n = t_n * heads * 8;
    let x = vec![0f32; n];
    let mut s = vec![0f32; heads * 64];
    let mut y = vec![0f32; n];
    let r = rec.run(&g, &mut s, &x, &x, &x, &x[1..], &[0.5; 6], heads, t_n, &mut y);
    assert!(matches!(r, Err(GpuError::Shape { .. })), "{r:?}");
    let r = rec.run(&g, &mut s[1..], &x, &x, &x, &x, &[0.5; 6], heads, t_n, &mut y);
    assert!(matches!(r, Err(GpuError::Shape { .. })), "{r:?}");
}
