//! Prompt processing in chunks (layer by layer, each distinct expert read once per chunk) gives
//! bit-identical logits and state to feeding the tokens one at a time, and reads no more.

mod common;

use common::*;
use deltafin_engine::experts::{ExpertSource, StoreExperts};
use deltafin_engine::generate::argmax;
use deltafin_engine::k3::{K3Model, RunConfig};
use deltafin_store::{ExpertLayout, SpineDtype, Store};

#[test]
fn chunked_prompt_is_bit_identical_and_reads_less() {
    for name in FIXTURES {
        let dir = convert_fixture(name, SpineDtype::Int8, 0, ExpertLayout::Pack);
        let store = Store::open(dir.path(), None).unwrap();
        for resident in [None, Some(1)] {
            let model = K3Model::load(&store, &RunConfig { resident_layers: resident, ..Default::default() }).unwrap();
            for p in reference(name).prompts.iter().filter(|p| p.tokens.len() > 1) {
                let v = model.config.vocab_size;
                // One token at a time.
                let mut a_src = StoreExperts::new(&store);
                let mut a_st = model.new_state();
                let mut a = vec![0f32; v];
                for &t in &p.tokens {
                    model.forward(&mut a_st, &mut a_src, t, &mut a).unwrap();
                }
                // In chunks of 7 (uneven on purpose).
                let mut b_src = StoreExperts::new(&store);
                let mut b_st = model.new_state();
                let mut b = vec![0f32; v];
                for chunk in p.tokens.chunks(7) {
                    model.forward_chunk(&mut b_st, &mut b_src, chunk, &mut b).unwrap();
                }
                let same = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
                assert!(same(&a, &b), "{name}: chunked prompt of {} tokens changed the logits", p.tokens.len());
                assert_eq!(a_st.position, b_st.position);
                assert!(b_src.bytes_read() <= a_src.bytes_read());
                if p.tokens.len() >= 17 {
                    assert!(
                        b_src.bytes_read() < a_src.bytes_read(),
                        "{name}: shared experts must be read once per chunk"
                    );
                }
                // The state carries on identically: three greedy steps after the prompt.
                for _ in 0..3 {
                    let (ta, tb) = (argmax(&a), argmax(&b));
                    assert_eq!(ta, tb);
                    model.forward(&mut a_st, &mut a_src, ta, &mut a).unwrap();
                    model.forward(&mut b_st, &mut b_src, tb, &mut b).unwrap();
                    assert!(same(&a, &b), "{name}: decoding after a chunked prompt diverged");
                }
            }
        }
    }
}
