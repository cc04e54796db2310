//! The K3 forward pass against mlx-lm 0.32.2's `kimi_k3.py` on the committed fixtures: last
//! position logits within 1e-3 relative and identical 12-token greedy continuations, for both
//! expert layouts, with an f32 spine.

mod common;

use common::*;
use deltafin_engine::experts::StoreExperts;
use deltafin_engine::generate::{all_logits, generate_greedy};
use deltafin_engine::k3::{K3Model, RunConfig};
use deltafin_store::{ExpertLayout, SpineDtype, Store};

fn check_fixture(name: &str, layout: ExpertLayout) {
    let store_dir = convert_fixture(name, SpineDtype::F32, 0, layout);
    let store = Store::open(store_dir.path(), None).unwrap();
    let model = K3Model::load(&store, &RunConfig::default()).unwrap();
    let reference = reference(name);
    assert!(reference.prompts.len() >= 3);
    for p in &reference.prompts {
        let mut src = StoreExperts::new(&store);
        let g = generate_greedy(&model, &mut src, &p.tokens, 12, None).unwrap();
        let rel = rel_err(&g.prompt_logits, &p.last_logits);
        println!("{name} {layout:?} prompt len {:2}: last-logit rel err {rel:.2e}", p.tokens.len());
        assert!(rel < 1e-3, "{name}: prompt of {} tokens: rel err {rel}", p.tokens.len());
        assert_eq!(g.tokens, p.greedy, "{name}: greedy continuation of a {}-token prompt", p.tokens.len());
        assert!(g.timing.expert_bytes_read > 0, "experts must be read through the store");
    }
    // Every position of the 17-token prompt, not only the last.
    let p17 = reference.prompts.iter().find(|p| p.tokens.len() == 17).expect("a 17-token prompt");
    let mut src = StoreExperts::new(&store);
    let rows = all_logits(&model, &mut src, &p17.tokens).unwrap();
    assert_eq!(rows.len(), reference.all_logits_17.len());
    for (i, (got, want)) in rows.iter().zip(&reference.all_logits_17).enumerate() {
        let rel = rel_err(got, want);
        assert!(rel < 1e-3, "{name}: position {i}: rel err {rel}");
    }
}

#[test]
fn tiny_in_place_matches_mlx() {
    check_fixture("k3-tiny", ExpertLayout::InPlace);
}

#[test]
fn tiny_packed_matches_mlx() {
    check_fixture("k3-tiny", ExpertLayout::Pack);
}

#[test]
fn small_in_place_matches_mlx() {
    check_fixture("k3-small", ExpertLayout::InPlace);
}

#[test]
fn small_packed_matches_mlx() {
    check_fixture("k3-small", ExpertLayout::Pack);
}

/// The in-place store must record one byte range per expert where the checkpoint keeps an
/// expert contiguous (k3-tiny, like the release) and the six ranges where it scatters them
/// (k3-small); packed records are 4096-aligned.
#[test]
fn expert_ranges_follow_the_checkpoint_layout() {
    let tiny = convert_fixture("k3-tiny", SpineDtype::F32, 0, ExpertLayout::InPlace);
    let m = Store::open(tiny.path(), None).unwrap().manifest;
    assert!(m.experts.layers.iter().all(|l| l.experts.iter().all(|e| e.ranges.len() == 1)));
    let small = convert_fixture("k3-small", SpineDtype::F32, 0, ExpertLayout::InPlace);
    let m = Store::open(small.path(), None).unwrap().manifest;
    assert!(m.experts.layers.iter().all(|l| l.experts.iter().all(|e| e.ranges.len() == 6)));
    let packed = convert_fixture("k3-small", SpineDtype::F32, 0, ExpertLayout::Pack);
    let m = Store::open(packed.path(), None).unwrap().manifest;
    for l in &m.experts.layers {
        for e in &l.experts {
            assert_eq!(e.ranges.len(), 1);
            assert_eq!(e.ranges[0][1] % 4096, 0, "packed record offset must be 4096-aligned");
        }
    }
}
