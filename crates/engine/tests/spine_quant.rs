//! Fidelity of the quantised spines against the f32 path, over every position of every fixture
//! prompt: top-1 agreement and mean KL(p_f32 || p_quant). Tiny random models are sensitive (near
//! tie router choices flip), so these figures judge the quantisation scheme rather than a model;
//! the bounds below are regression bounds set from measured values (see docs/numerics.md).

mod common;

use common::*;
use deltafin_engine::blocks::mla::LatentDtype;
use deltafin_engine::blocks::moe::Routing;
use deltafin_engine::experts::StoreExperts;
use deltafin_engine::generate::argmax;
use deltafin_engine::k3::{K3Model, RunConfig};
use deltafin_store::{ExpertLayout, SpineDtype, Store};

fn log_softmax(v: &[f32]) -> Vec<f64> {
    let m = v.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let lse = v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
    v.iter().map(|&x| x as f64 - lse).collect()
}

/// Logits at every position of every fixture prompt, and the routing chosen at each
/// (position, layer). With `pin`, each position replays the given routing instead of choosing.
/// The MLA latent cache stays f32 unless `latent` says otherwise, so the spine schemes are
/// judged alone.
fn positions(
    name: &str,
    spine: SpineDtype,
    group: usize,
    pin: Option<&[Vec<Routing>]>,
    latent: LatentDtype,
) -> (Vec<Vec<f32>>, Vec<Vec<Routing>>) {
    let dir = convert_fixture(name, spine, group, ExpertLayout::InPlace);
    let store = Store::open(dir.path(), None).unwrap();
    let model = K3Model::load(&store, &RunConfig { latent_cache: Some(latent), ..Default::default() }).unwrap();
    let (mut logits_out, mut routes) = (Vec::new(), Vec::new());
    for p in &reference(name).prompts {
        let mut src = StoreExperts::new(&store);
        let mut st = model.new_state();
        for &t in &p.tokens {
            if let Some(pin) = pin {
                st.routing = pin[routes.len()].clone();
                st.routing.iter_mut().for_each(|r| r.pinned = true);
            }
            let mut logits = vec![0f32; model.config.vocab_size];
            model.forward(&mut st, &mut src, t, &mut logits).unwrap();
            logits_out.push(logits);
            routes.push(st.routing.clone());
        }
    }
    (logits_out, routes)
}

/// (top-1 agreement, mean KL) of `q` against `base`.
fn compare(base: &[Vec<f32>], q: &[Vec<f32>]) -> (f64, f64) {
    let mut agree = 0usize;
    let mut kl = 0f64;
    for (b, x) in base.iter().zip(q) {
        agree += (argmax(b) == argmax(x)) as usize;
        let (lb, lx) = (log_softmax(b), log_softmax(x));
        kl += lb.iter().zip(&lx).map(|(p, q)| p.exp() * (p - q)).sum::<f64>();
    }
    (agree as f64 / base.len() as f64, kl / base.len() as f64)
}

#[test]
fn quantised_spines_against_f32() {
    // Regression bounds per fixture and scheme: [free routing: min top-1 agreement, max mean KL,
    // pinned routing: min top-1 agreement, max mean KL]. Measured values are in docs/numerics.md; the
    // bounds leave ~15% headroom. The fixtures' weights are bf16, so the bf16 spine is exact.
    let bf16 = [1.0, 1e-9, 1.0, 1e-9];
    let none = [0.0, f64::INFINITY, 0.0, f64::INFINITY]; // printed for comparison only
    for name in FIXTURES {
        let (per_row, g32) = match name {
            "k3-tiny" => ([0.31, 2.5, 0.62, 0.45], [0.32, 2.3, 0.6, 0.39]),
            _ => ([0.35, 1.5, 0.7, 0.14], [0.31, 1.65, 0.66, 0.062]),
        };
        let schemes: [(&str, SpineDtype, usize, [f64; 4]); 5] = [
            ("bf16", SpineDtype::Bf16, 0, bf16),
            ("int8 per-row", SpineDtype::Int8, 0, per_row),
            ("int8 group-128", SpineDtype::Int8, 128, none),
            ("int8 group-64", SpineDtype::Int8, 64, none),
            ("int8 group-32", SpineDtype::Int8, 32, g32),
        ];
        let (base, routes) = positions(name, SpineDtype::F32, 0, None, LatentDtype::F32);
        for (label, dtype, group, b) in schemes {
            let (q, _) = positions(name, dtype, group, None, LatentDtype::F32);
            let (agree, kl) = compare(&base, &q);
            let (qp, _) = positions(name, dtype, group, Some(&routes), LatentDtype::F32);
            let (agree_p, kl_p) = compare(&base, &qp);
            println!(
                "{name:9} {label:14} positions {:3}  free routing: top-1 {:.3} KL {:.2e}  |  pinned routing: top-1 {:.3} KL {:.2e}",
                base.len(),
                agree,
                kl,
                agree_p,
                kl_p
            );
            assert!(agree >= b[0], "{name} {label}: top-1 agreement {agree} fell below {}", b[0]);
            assert!(kl <= b[1], "{name} {label}: mean KL {kl} rose above {}", b[1]);
            assert!(agree_p >= b[2], "{name} {label}: pinned top-1 agreement {agree_p} fell below {}", b[2]);
            assert!(kl_p <= b[3], "{name} {label}: pinned mean KL {kl_p} rose above {}", b[3]);
        }
    }
}

/// The bf16 latent cache (the default with int8 and bf16 spines) against the f32 cache, on the
/// f32 spine, at every position of every fixture prompt: what the cache's rounding alone
/// changes. Random tiny models flip near-tie router choices easily, so the bounds are regression
/// bounds from measured values (printed; docs/numerics.md); pinned routing
/// shows the rounding's own size.
#[test]
fn bf16_latent_cache_against_f32() {
    for name in FIXTURES {
        // [free: min top-1, max KL, pinned: min top-1, max KL]
        // Measured: k3-tiny top-1 1.000 / KL 3.2e-3, pinned 1.000 / 3.8e-5; k3-small 1.000 /
        // 4.9e-6 both ways.
        let b = match name {
            "k3-tiny" => [0.95, 6e-3, 0.95, 8e-5],
            _ => [0.95, 1e-5, 0.95, 1e-5],
        };
        let (base, routes) = positions(name, SpineDtype::F32, 0, None, LatentDtype::F32);
        let (q, _) = positions(name, SpineDtype::F32, 0, None, LatentDtype::Bf16);
        let (agree, kl) = compare(&base, &q);
        let (qp, _) = positions(name, SpineDtype::F32, 0, Some(&routes), LatentDtype::Bf16);
        let (agree_p, kl_p) = compare(&base, &qp);
        println!(
            "{name:9} bf16 latent cache positions {:3}  free routing: top-1 {agree:.3} KL {kl:.2e}  |  pinned routing: top-1 {agree_p:.3} KL {kl_p:.2e}",
            base.len()
        );
        assert!(kl > 0.0, "{name}: the bf16 cache changed nothing (is it in use?)");
        assert!(agree >= b[0] && kl <= b[1], "{name}: free routing top-1 {agree}, KL {kl}");
        assert!(agree_p >= b[2] && kl_p <= b[3], "{name}: pinned routing top-1 {agree_p}, KL {kl_p}");
    }
}
