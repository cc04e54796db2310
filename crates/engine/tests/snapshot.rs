//! A sequence's state written as a snapshot and restored into a fresh state continues exactly
//! as the original: the same logits bit for bit, token after token, on both fixtures (KDA and
//! MLA layers), after a whole prompt and after a prompt cut across chunk boundaries. A torn,
//! corrupt, foreign or misfitting snapshot is refused before anything is trusted.

mod common;

use common::*;
use deltafin_engine::blocks::mla::{LatentCache, LatentDtype};
use deltafin_engine::experts::StoreExperts;
use deltafin_engine::generate::argmax;
use deltafin_engine::k3::snapshot::{self, SnapshotError};
use deltafin_engine::k3::{K3Model, LayerState, RunConfig};
use deltafin_store::{ExpertLayout, SpineDtype, Store};

#[test]
fn a_restored_state_continues_bit_for_bit() {
    for name in FIXTURES {
        let dir = convert_fixture(name, SpineDtype::Int8, 0, ExpertLayout::Pack);
        let store = Store::open(dir.path(), None).unwrap();
        let model = K3Model::load(&store, &RunConfig::default()).unwrap();
        let v = model.config.vocab_size;
        let prompt = reference(name).prompts.into_iter().max_by_key(|p| p.tokens.len()).unwrap().tokens;
        // The whole prompt in one chunk, and cut after a few tokens into chunks of 3.
        for (cut, size) in [(prompt.len(), prompt.len()), (5.min(prompt.len()), 3)] {
            let mut src = StoreExperts::new(&store);
            let (mut st, mut logits) = (model.new_state(), vec![0f32; v]);
            for chunk in prompt[..cut].chunks(size) {
                model.forward_chunk(&mut st, &mut src, chunk, &mut logits).unwrap();
            }
            let mut bytes = Vec::new();
            snapshot::encode(&st, &logits, &prompt[..cut], 7, &mut bytes);
            assert_eq!(snapshot::tokens(&bytes, 7).unwrap(), &prompt[..cut]);
            let (mut st2, mut logits2) = (model.new_state(), vec![0f32; v]);
            let tokens = snapshot::decode(&bytes, 7, &mut st2, &mut logits2).unwrap();
            assert_eq!(tokens, &prompt[..cut]);
            assert!(same(&logits, &logits2), "{name}: restored logits differ");
            assert_eq!(st.position, st2.position);
            // The rest of the prompt, then greedy tokens, on both.
            let rest = &prompt[cut..];
            if !rest.is_empty() {
                model.forward_chunk(&mut st, &mut src, rest, &mut logits).unwrap();
                model.forward_chunk(&mut st2, &mut src, rest, &mut logits2).unwrap();
            }
            for _ in 0..4 {
                assert!(same(&logits, &logits2), "{name}: the restored sequence diverged (cut {cut})");
                let (t, t2) = (argmax(&logits), argmax(&logits2));
                model.forward(&mut st, &mut src, t, &mut logits).unwrap();
                model.forward(&mut st2, &mut src, t2, &mut logits2).unwrap();
            }
            assert!(same(&logits, &logits2));
        }
    }
}

#[test]
fn bad_snapshots_are_refused() {
    let dir = convert_fixture("k3-tiny", SpineDtype::Int8, 0, ExpertLayout::Pack);
    let store = Store::open(dir.path(), None).unwrap();
    let model = K3Model::load(&store, &RunConfig::default()).unwrap();
    let v = model.config.vocab_size;
    let mut src = StoreExperts::new(&store);
    let (mut st, mut logits) = (model.new_state(), vec![0f32; v]);
    model.forward_chunk(&mut st, &mut src, &[5, 17, 3], &mut logits).unwrap();
    let mut good = Vec::new();
    snapshot::encode(&st, &logits, &[5, 17, 3], 1, &mut good);
    let restore = |b: &[u8], id: u64| {
        let (mut s, mut l) = (model.new_state(), vec![0f32; v]);
        snapshot::decode(b, id, &mut s, &mut l)
    };
    assert!(restore(&good, 1).is_ok());
    assert_eq!(restore(&good, 2), Err(SnapshotError::Identity));
    // Every torn length, and a flipped bit anywhere, is refused (checksum or length checks).
    for n in (0..good.len()).step_by(97).chain([good.len() - 1]) {
        assert!(restore(&good[..n], 1).is_err(), "a snapshot torn at {n} bytes was taken");
    }
    for at in (0..good.len()).step_by(101) {
        let mut bad = good.clone();
        bad[at] ^= 0x10;
        assert!(restore(&bad, 1).is_err(), "a flipped bit at {at} was not caught");
    }
    assert_eq!(restore(b"not a snapshot at all, but long enough", 1), Err(SnapshotError::Magic));
    // A snapshot of the previous format (f32 latents and rope channels apart) is refused by its
    // version, before anything in it is read, with a message that says so.
    let mut v1 = good.clone();
    v1[7] = b'1';
    let err = restore(&v1, 1).unwrap_err();
    assert_eq!(err, SnapshotError::Version(b'1'));
    assert!(err.to_string().contains("version 1"), "{err}");
    // A state whose latent cache is f32 does not restore into a bf16 run (nor the reverse).
    let f32_model =
        K3Model::load(&store, &RunConfig { latent_cache: Some(LatentDtype::F32), ..Default::default() }).unwrap();
    let (mut s32, mut l32) = (f32_model.new_state(), vec![0f32; v]);
    f32_model.forward_chunk(&mut s32, &mut StoreExperts::new(&store), &[5, 17, 3], &mut l32).unwrap();
    let mut as_f32 = Vec::new();
    snapshot::encode(&s32, &l32, &[5, 17, 3], 1, &mut as_f32);
    assert_eq!(restore(&as_f32, 1), Err(SnapshotError::Shape("MLA cache dtype")));
    let (mut back, mut lb) = (f32_model.new_state(), vec![0f32; v]);
    assert!(snapshot::decode(&as_f32, 1, &mut back, &mut lb).is_ok());
    assert_eq!(lb, l32);
    // Well-formed files (right checksum and identity) that do not fit: an MLA cache of another
    // width for the same length, and a token list that is not the state's length.
    let mut wide = model.new_state();
    wide.copy_sequence_from(&st);
    let mut mla = 0;
    for l in wide.layers.iter_mut() {
        if let LayerState::Mla(m) = l {
            let n = m.len * (m.width() + 1);
            match &mut m.cache {
                LatentCache::Bf16(v) => v.resize(n, 0x3f00),
                LatentCache::F32(v) => v.resize(n, 0.5),
            }
            mla += 1;
        }
    }
    assert!(mla > 0, "k3-tiny has MLA layers");
    let mut crafted = Vec::new();
    snapshot::encode(&wide, &logits, &[5, 17, 3], 1, &mut crafted);
    assert!(matches!(restore(&crafted, 1), Err(SnapshotError::Shape(_))));
    let mut short = Vec::new();
    snapshot::encode(&st, &logits, &[5, 17], 1, &mut short);
    assert_eq!(restore(&short, 1), Err(SnapshotError::Shape("position")));
    // Another model's state (k3-small: other layers and widths) does not fit.
    let dir2 = convert_fixture("k3-small", SpineDtype::Int8, 0, ExpertLayout::Pack);
    let store2 = Store::open(dir2.path(), None).unwrap();
    let model2 = K3Model::load(&store2, &RunConfig::default()).unwrap();
    let mut src2 = StoreExperts::new(&store2);
    let (mut st2, mut l2) = (model2.new_state(), vec![0f32; model2.config.vocab_size]);
    model2.forward_chunk(&mut st2, &mut src2, &[5, 17, 3], &mut l2).unwrap();
    let mut other = Vec::new();
    snapshot::encode(&st2, &l2, &[5, 17, 3], 1, &mut other);
    assert!(matches!(restore(&other, 1), Err(SnapshotError::Shape(_))));
}
