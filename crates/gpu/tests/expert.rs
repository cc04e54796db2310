//! A routed expert on the GPU (gate and up products, SiTU, down product) against its CPU scalar
//! twin `deltafin_kernels::scalar::expert_mxfp4`, token by token, on whatever adapter opens
//! (`common`).

use deltafin_gpu::expert::{ExpertProgram, GpuExpert, Situ};
use deltafin_gpu::{Gpu, GpuError};
use deltafin_kernels::format::{BLOCK, Mxfp4, mxfp4_decode_row};
use deltafin_kernels::scalar::expert_mxfp4;
use deltafin_kernels::testdata::{bytes, scales};

mod common;
use common::gpu;

struct HostExpert {
    m: [(Vec<u8>, Vec<u8>); 3],
}

impl HostExpert {
    /// w1, w3 `[inter, latent]`, w2 `[latent, inter]`; scales wide enough that some gates
    /// saturate SiTU's tanh and sigmoid.
    fn new(inter: usize, latent: usize, seed: u64) -> Self {
        let n = inter * latent;
        let mat = |s: u64| (bytes(n / 2, s), scales(n / BLOCK, s + 1, 120, 10));
        HostExpert { m: [mat(seed), mat(seed + 10), mat(seed + 20)] }
    }
    fn mx(&self, i: usize) -> Mxfp4<'_> {
        Mxfp4 { packed: &self.m[i].0, scales: &self.m[i].1 }
    }
}

/// The scalar twin's outputs `[latent]` of expert `h` for one token `x`.
fn cpu_expert(h: &HostExpert, inter: usize, latent: usize, x: &[f32], situ: Situ) -> Vec<f32> {
    let (mut act, mut out) = (vec![0f32; inter], vec![0f32; latent]);
    expert_mxfp4(h.mx(0), h.mx(1), h.mx(2), inter, latent, x, situ.beta, situ.linear_beta, &mut act, &mut out);
    out
}

fn check(g: &Gpu, p: &ExpertProgram, inter: usize, latent: usize, n: usize, situ: Situ, seed: u64) {
    let h = HostExpert::new(inter, latent, seed);
    let e = GpuExpert::upload(g, (&h.m[0].0, &h.m[0].1), (&h.m[1].0, &h.m[1].1), (&h.m[2].0, &h.m[2].1), inter, latent)
        .unwrap();
    let xs: Vec<f32> = bytes(n * latent, seed + 3).iter().map(|&b| (f32::from(b) - 127.5) / 32.0).collect();
    let xg = g.upload_f32(&xs).unwrap();
    let b = p.bind(g, &e, &xg, n, situ).unwrap();
    p.run(g, &b).unwrap();
    let got = g.read_f32(&b.out).unwrap();
    let (mut act, mut want) = (vec![0f32; inter], vec![0f32; latent]);
    let mut w2 = vec![0f32; inter];
    for t in 0..n {
        expert_mxfp4(
            h.mx(0),
            h.mx(1),
            h.mx(2),
            inter,
            latent,
            &xs[t * latent..(t + 1) * latent],
            situ.beta,
            situ.linear_beta,
            &mut act,
            &mut want,
        );
        for r in 0..latent {
            mxfp4_decode_row(
                &h.m[2].0[r * inter / 2..(r + 1) * inter / 2],
                &h.m[2].1[r * inter / BLOCK..(r + 1) * inter / BLOCK],
                &mut w2,
            );
            // The down product's terms, each carrying the activation's error (products in
            // another order, the GPU's tanh and exp): 2e-5 of their magnitude.
            let mag: f32 = w2.iter().zip(&act).map(|(a, b)| (a * b).abs()).sum();
            let v = got[t * latent + r];
            assert!(
                (v - want[r]).abs() <= 2e-5 * mag + 1e-30,
                "expert {inter} x {latent}, {n} tokens, {situ:?}: token {t} row {r}: gpu {v} cpu {} (|w2 act| sum {mag})",
                want[r]
            );
        }
    }
}

#[test]
fn experts_match_the_scalar_twin() {
    let Some(g) = gpu("experts_match_the_scalar_twin") else { return };
    let p = ExpertProgram::new(&g);
    // One token and chunks, off and across the tiles; SiTU with and without its linear bound.
    for (i, &(inter, latent, n)) in [(64, 96, 1), (96, 64, 1), (64, 96, 3), (160, 64, 70)].iter().enumerate() {
        for situ in [Situ { beta: 4.0, linear_beta: Some(25.0) }, Situ { beta: 4.0, linear_beta: None }] {
            check(&g, &p, inter, latent, n, situ, 7 + 31 * i as u64);
        }
    }
}

#[test]
fn mismatched_expert_shapes_are_errors() {
    let Some(g) = gpu("mismatched_expert_shapes_are_errors") else { return };
    let p = ExpertProgram::new(&g);
    let m = |r: usize, c: usize| (vec![0u8; r * c / 2], vec![127u8; r * c / BLOCK]);
    let (a, b) = (m(64, 32), m(64, 32));
    // A w2 of the wrong size does not upload.
    let c = m(64, 64);
    let e = GpuExpert::upload(&g, (&a.0, &a.1), (&b.0, &b.1), (&c.0, &c.1), 64, 32);
    assert!(matches!(e, Err(GpuError::Shape { .. })), "a w2 of the wrong size uploads");
    // Matrices of the right sizes in the wrong shapes do not bind: w2 must be [latent, inter].
    let up = |p: &(Vec<u8>, Vec<u8>), r, c| g.upload_mxfp4(&p.0, &p.1, r, c).unwrap();
    let x = g.upload_f32(&[0.0; 32]).unwrap();
    let wrong = GpuExpert { w1: up(&a, 64, 32), w3: up(&b, 64, 32), w2: up(&a, 64, 32) };
    assert!(matches!(p.bind(&g, &wrong, &x, 1, Situ { beta: 4.0, linear_beta: None }), Err(GpuError::Shape { .. })));
    let c = m(32, 64);
    let e = GpuExpert::upload(&g, (&a.0, &a.1), (&b.0, &b.1), (&c.0, &c.1), 64, 32).unwrap();
    assert!(p.bind(&g, &e, &x, 1, Situ { beta: 4.0, linear_beta: None }).is_ok());
    assert!(matches!(p.bind(&g, &e, &x, 2, Situ { beta: 4.0, linear_beta: None }), Err(GpuError::Shape { .. })));
}

/// The model's runner: experts submitted without waiting, more of them than it has slots (so it
/// finishes a round in the middle of a submission), with token counts that change between
/// experts (rebinding and regrowing its slots), each delivered once under its own tag with its
/// own outputs.
#[test]
fn the_runner_delivers_every_queued_expert_under_its_tag() {
    use deltafin_gpu::expert::{ExpertRunner, SLOTS};
    let Some(g) = gpu("the_runner_delivers_every_queued_expert_under_its_tag") else { return };
    let (inter, latent) = (64, 96);
    let situ = Situ { beta: 4.0, linear_beta: Some(25.0) };
    let runner = ExpertRunner::new(g, inter, latent, situ).unwrap();
    let count = SLOTS + 5;
    let experts: Vec<HostExpert> = (0..count).map(|i| HostExpert::new(inter, latent, 100 + 7 * i as u64)).collect();
    let tokens = |i: usize| [1, 3, 2, 1, 5][i % 5];
    let inputs: Vec<Vec<f32>> = (0..count)
        .map(|i| bytes(tokens(i) * latent, 900 + i as u64).iter().map(|&b| (f32::from(b) - 127.5) / 32.0).collect())
        .collect();
    let got: std::cell::RefCell<Vec<Option<Vec<f32>>>> = std::cell::RefCell::new(vec![None; count]);
    let mut deliver = |tag: usize, out: &[f32]| {
        let mut got = got.borrow_mut();
        assert!(got[tag].is_none(), "expert {tag} delivered twice");
        got[tag] = Some(out.to_vec());
    };
    for (i, h) in experts.iter().enumerate() {
        let m = |j: usize| (h.m[j].0.as_slice(), h.m[j].1.as_slice());
        runner.enqueue(None, m(0), m(1), m(2), &inputs[i], tokens(i), i, &mut deliver).unwrap();
        // Nothing comes back until the slots run out; then the first round, all of it.
        let back = got.borrow().iter().filter(|o| o.is_some()).count();
        assert_eq!(back, if i < SLOTS { 0 } else { SLOTS }, "delivered after submitting expert {i}");
    }
    runner.finish(&mut deliver).unwrap();
    // A finish with nothing in flight delivers nothing.
    runner.finish(&mut |t, _| panic!("expert {t} delivered after the round ended")).unwrap();
    let got = got.into_inner();
    for (i, h) in experts.iter().enumerate() {
        let out = got[i].as_ref().unwrap_or_else(|| panic!("expert {i} never delivered"));
        assert_eq!(out.len(), tokens(i) * latent, "expert {i}'s outputs");
        for t in 0..tokens(i) {
            let want = cpu_expert(h, inter, latent, &inputs[i][t * latent..(t + 1) * latent], situ);
            let scale: f32 = want.iter().map(|v| v.abs()).sum::<f32>() / latent as f32;
            for r in 0..latent {
                let v = out[t * latent + r];
                assert!(
                    (v - want[r]).abs() <= 1e-4 * scale.max(1e-20),
                    "expert {i}, token {t}, row {r}: gpu {v} cpu {}",
                    want[r]
                );
            }
        }
    }
    // Bad shapes are errors, and leave the runner usable.
    let h = &experts[0];
    let m = |j: usize| (h.m[j].0.as_slice(), h.m[j].1.as_slice());
    let short = (&h.m[2].0[1..], h.m[2].1.as_slice());
    assert!(matches!(
        runner.enqueue(None, m(0), m(1), short, &inputs[0], 1, 0, &mut |_, _| {}),
        Err(GpuError::Shape { .. })
    ));
    assert!(matches!(
        runner.enqueue(None, m(0), m(1), m(2), &inputs[0], 2, 0, &mut |_, _| {}),
        Err(GpuError::Shape { .. })
    ));
    let mut out = vec![0f32; latent];
    runner.run(m(0), m(1), m(2), &inputs[0], 1, &mut out).unwrap();
    assert_eq!(&out, got[0].as_ref().unwrap(), "the same expert and input, run again");
}

/// The runner's expert cache: a key it holds is computed from its copy on the GPU, in the same
/// round it was first written as well as later (the bytes passed are not read: junk here gives
/// the cached expert's outputs); the least recently used key makes room, and a key no longer
/// held is read from the bytes passed again.
#[test]
fn the_runner_caches_experts_by_key_and_evicts_the_least_recently_used() {
    use deltafin_gpu::expert::ExpertRunner;
    let Some(g) = gpu("the_runner_caches_experts_by_key_and_evicts_the_least_recently_used") else { return };
    let (inter, latent) = (64, 96);
    let situ = Situ { beta: 4.0, linear_beta: Some(25.0) };
    let runner = ExpertRunner::new(g, inter, latent, situ).unwrap().with_cache(2);
    let hosts: Vec<HostExpert> = (0..4).map(|i| HostExpert::new(inter, latent, 300 + 11 * i)).collect();
    let junk = HostExpert::new(inter, latent, 999);
    let x: Vec<f32> = bytes(latent, 77).iter().map(|&b| (f32::from(b) - 127.5) / 32.0).collect();
    let want = |h: &HostExpert| cpu_expert(h, inter, latent, &x, situ);
    let close = |got: &[f32], want: &[f32], what: &str| {
        let scale = want.iter().map(|v| v.abs()).sum::<f32>() / latent as f32;
        for (r, (a, b)) in got.iter().zip(want).enumerate() {
            assert!((a - b).abs() <= 1e-4 * scale.max(1e-20), "{what}: row {r}: gpu {a} cpu {b}");
        }
    };
    // One round of (key, host bytes) submissions; the outputs in submission order.
    let round = |subs: &[(usize, &HostExpert)]| -> Vec<Vec<f32>> {
        let mut got = vec![Vec::new(); subs.len()];
        let mut put = |tag: usize, o: &[f32]| got[tag] = o.to_vec();
        for (tag, (key, h)) in subs.iter().enumerate() {
            let m = |j: usize| (h.m[j].0.as_slice(), h.m[j].1.as_slice());
            runner.enqueue(Some((7, *key)), m(0), m(1), m(2), &x, 1, tag, &mut put).unwrap();
        }
        runner.finish(&mut put).unwrap();
        got
    };
    let (a, b, c, d) = (&hosts[0], &hosts[1], &hosts[2], &hosts[3]);
    // Keys 0 and 1 written; key 0 again in the same round, with junk bytes, is the cached one.
    let r1 = round(&[(0, a), (1, b), (0, &junk)]);
    close(&r1[0], &want(a), "key 0");
    close(&r1[1], &want(b), "key 1");
    assert_eq!(r1[2], r1[0], "key 0 from the cache in the round that wrote it");
    // Key 0 held (used last), key 2 makes room by dropping key 1.
    let r2 = round(&[(0, &junk), (2, c)]);
    assert_eq!(r2[0], r1[0], "key 0 from the cache a round later");
    close(&r2[1], &want(c), "key 2");
    // Key 1 is no longer held: its bytes are read again (here another expert's).
    let r3 = round(&[(1, d)]);
    close(&r3[0], &want(d), "key 1 after its eviction");
    let (capacity, held, hits, misses) = runner.cache_stats();
    assert_eq!((capacity, held, hits, misses), (2, 2, 2, 4));
}
