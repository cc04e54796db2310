//! Prompt processing in chunks (layer by layer, each distinct expert read once per chunk) gives
//! bit-identical logits and state to feeding the tokens one at a time, and reads no more.

mod common;

use common::*;
use deltafin_engine::experts::{ExpertSource, StoreExperts};
use deltafin_engine::generate::{argmax, generate_greedy};
use deltafin_engine::k3::{K3Model, RunConfig};
use deltafin_store::{ExpertLayout, SpineDtype, Store};

#[test]
fn chunked_prompt_is_bit_identical_and_reads_less() {
    chunked_prompt_matches_token_by_token();
}

/// The same on a pool of three threads whatever this machine has, so the parallel paths of a
/// chunk (KDA's heads, the shares of a batched product) run on several threads and with an odd
/// split.
#[test]
fn chunked_prompt_is_bit_identical_on_three_threads() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    pool.install(chunked_prompt_matches_token_by_token);
}

fn chunked_prompt_matches_token_by_token() {
    for name in FIXTURES {
        let dir = convert_fixture(name, SpineDtype::Int8, 0, ExpertLayout::Pack);
        let store = Store::open(dir.path(), None).unwrap();
        for resident in [None, Some(1)] {
            let model = K3Model::load(&store, &RunConfig { resident_layers: resident, ..Default::default() }).unwrap();
            for p in reference(name).prompts.iter().filter(|p| p.tokens.len() > 1) {
                let v = model.config.vocab_size;
                // In chunks of 3, 7 (uneven on purpose), 16, 32 and the whole prompt, against one
                // token at a time.
                let n = p.tokens.len();
                for size in [3, 7, 16, 32, n] {
                    let mut a_src = StoreExperts::new(&store);
                    let mut a_st = model.new_state();
                    let mut a = vec![0f32; v];
                    for &t in &p.tokens {
                        model.forward(&mut a_st, &mut a_src, t, &mut a).unwrap();
                    }
                    let mut b_src = StoreExperts::new(&store);
                    let mut b_st = model.new_state();
                    let mut b = vec![0f32; v];
                    for chunk in p.tokens.chunks(size) {
                        model.forward_chunk(&mut b_st, &mut b_src, chunk, &mut b).unwrap();
                    }
                    assert!(same(&a, &b), "{name}: chunks of {size} of a {n}-token prompt changed the logits");
                    assert_eq!(a_st.position, b_st.position);
                    assert!(b_src.bytes_read() <= a_src.bytes_read());
                    if n >= 17 && size > 1 {
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
                        assert!(same(&a, &b), "{name}: decoding after chunks of {size} diverged");
                    }
                }
            }
        }
    }
}

/// The generation loop cuts prompts by the plan's chunk size (`RunConfig::prefill_chunk`, set
/// from the budget or `--prefill-chunk`): the prompt's logits and the greedy tokens after it
/// are the same for every size, with the spine resident or streamed, and the prompt's figures
/// (chunks, distinct experts, spine bytes) add up.
#[test]
fn the_generation_loop_gives_the_same_tokens_for_every_chunk_size() {
    let name = FIXTURES[0];
    let dir = convert_fixture(name, SpineDtype::Int8, 0, ExpertLayout::Pack);
    let store = Store::open(dir.path(), None).unwrap();
    let vocab = store.manifest.config.vocab_size as u32;
    // A longer prompt than the references', so several chunk sizes cut it differently.
    let prompt: Vec<u32> = (0..150u32).map(|i| (i * 37 + 11) % vocab).collect();
    for resident in [None, Some(0)] {
        let mut first: Option<(Vec<f32>, Vec<u32>)> = None;
        let mut spine_reads = Vec::new();
        for size in [1, 3, 16, 32, prompt.len()] {
            let run = RunConfig { resident_layers: resident, prefill_chunk: size, ..Default::default() };
            let model = K3Model::load(&store, &run).unwrap();
            let mut src = StoreExperts::new(&store);
            let g = generate_greedy(&model, &mut src, &prompt, 4, None).unwrap();
            let st = &g.timing.prompt;
            assert_eq!((st.tokens, st.chunk, st.chunks), (prompt.len(), size, prompt.len().div_ceil(size)));
            assert!(st.distinct_experts > 0 && st.expert_bytes_read > 0);
            // Every streamed layer is read once per chunk (the loader may have read the next
            // chunk's first layer ahead, so the count is between chunks and chunks + 1 passes).
            match resident {
                Some(0) => spine_reads.push(st.spine_bytes_read),
                _ => assert_eq!(st.spine_bytes_read, 0),
            }
            match &first {
                None => first = Some((g.prompt_logits, g.tokens)),
                Some((logits, tokens)) => {
                    assert!(
                        same(logits, &g.prompt_logits),
                        "{name}: chunk {size} (resident {resident:?}) changed the logits"
                    );
                    assert_eq!(tokens, &g.tokens, "{name}: chunk {size} changed the greedy tokens");
                }
            }
        }
        if let Some(&whole) = spine_reads.last() {
            assert!(whole > 0);
            assert!(spine_reads.windows(2).all(|w| w[0] > w[1]), "fewer chunks read less spine: {spine_reads:?}");
            // Chunks of 1 read 150 passes (151 at most); the whole prompt 1 (2 at most).
            assert!(spine_reads[0] >= 75 * whole && spine_reads[0] <= 151 * whole, "{spine_reads:?}");
        }
    }
}

/// A cancellation is honoured between the layers of a chunk, not only between chunks: a long
/// prompt in one budget-sized chunk stops within a layer of the request, and the source is
/// left ready for the next request, which gives the same tokens as a fresh run.
#[test]
fn a_cancelled_prompt_stops_between_layers() {
    use deltafin_engine::generate::{Driver, Ended, GenerateHooks, run};

    struct StopAfter {
        polls: usize,
        allowed: usize,
    }
    impl Driver for StopAfter {
        fn keep_going(&mut self) -> bool {
            self.polls += 1;
            self.polls <= self.allowed
        }
        fn next(&mut self, _logits: &[f32]) -> anyhow::Result<Option<u32>> {
            panic!("a cancelled prompt must not reach decoding")
        }
    }

    let dir = convert_fixture(FIXTURES[0], SpineDtype::Int8, 0, ExpertLayout::Pack);
    let store = Store::open(dir.path(), None).unwrap();
    let vocab = store.manifest.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..120u32).map(|i| (i * 37 + 11) % vocab).collect();
    for resident in [None, Some(0)] {
        let run_config = RunConfig { resident_layers: resident, prefill_chunk: prompt.len(), ..Default::default() };
        let model = K3Model::load(&store, &run_config).unwrap();
        let layers = model.layers.len();
        assert!(layers >= 3);
        let mut src = StoreExperts::new(&store);
        // One poll before the chunk, then one per layer: stop after the second layer.
        let mut d = StopAfter { polls: 0, allowed: 3 };
        let mut st = model.new_state();
        let mut logits = vec![0f32; model.config.vocab_size];
        let ended =
            run(&model, &mut src, &mut st, &mut logits, &prompt, &mut GenerateHooks::default(), &mut d).unwrap();
        assert_eq!(ended, Ended::Cancelled);
        assert_eq!(d.polls, 4, "stopped at the first poll that said no, within the chunk");
        assert_eq!(st.position, 0, "the part-way state is not advanced");
        // The next request on the same model and source runs as if nothing happened.
        let after = generate_greedy(&model, &mut src, &prompt[..20], 3, None).unwrap();
        let fresh = generate_greedy(&model, &mut StoreExperts::new(&store), &prompt[..20], 3, None).unwrap();
        assert_eq!(after.tokens, fresh.tokens);
        assert!(same(&after.prompt_logits, &fresh.prompt_logits));
    }
}

/// The memory plan reserves `prefill_token_bytes` per prompt token: what a real chunk's scratch
/// pool and residual blocks take stays within it (beyond what a single token already takes).
#[test]
fn a_chunk_takes_no_more_than_the_plan_reserves_per_token() {
    for name in FIXTURES {
        let dir = convert_fixture(name, SpineDtype::Int8, 0, ExpertLayout::Pack);
        let store = Store::open(dir.path(), None).unwrap();
        let model = K3Model::load(&store, &RunConfig::default()).unwrap();
        let k = model.config.num_experts_per_token;
        let per_token = deltafin_engine::plan::prefill_token_bytes(&store.manifest, k) as usize;
        // MLA's attention works on a few tokens at a time whatever the chunk: the plan counts
        // that working set once, in its overhead.
        let working = deltafin_engine::plan::mla_working_bytes(&store.manifest) as usize;
        assert!(working > 0, "{name} has MLA layers");
        let vocab = model.config.vocab_size as u32;
        let held = |st: &deltafin_engine::k3::K3State| {
            st.scratch.pooled_bytes() + st.blocks.iter().map(|b| b.bytes()).sum::<usize>()
        };
        let mut logits = vec![0f32; model.config.vocab_size];
        let mut one = model.new_state();
        model.forward_chunk(&mut one, &mut StoreExperts::new(&store), &[7], &mut logits).unwrap();
        let base = held(&one);
        for t_n in [64usize, 200] {
            let tokens: Vec<u32> = (0..t_n as u32).map(|i| (i * 37 + 11) % vocab).collect();
            let mut st = model.new_state();
            model.forward_chunk(&mut st, &mut StoreExperts::new(&store), &tokens, &mut logits).unwrap();
            let took = held(&st);
            assert!(
                took <= base + per_token * t_n + working,
                "{name}: a chunk of {t_n} holds {took} bytes, the plan reserves {} + {working} + {base}",
                per_token * t_n
            );
        }
    }
}

/// A chunk long enough to route its tokens on the thread pool (and to take every other parallel
/// path a long prompt takes) gives the logits and routing of the same tokens in short chunks,
/// which route serially: on this machine's pool and on three threads.
#[test]
fn a_long_chunk_routes_as_short_ones_do() {
    let check = || {
        for name in FIXTURES {
            let dir = convert_fixture(name, SpineDtype::Int8, 0, ExpertLayout::Pack);
            let store = Store::open(dir.path(), None).unwrap();
            let model = K3Model::load(&store, &RunConfig::default()).unwrap();
            let v = model.config.vocab_size;
            let tokens: Vec<u32> = (0..150u32).map(|i| (i * 37 + 11) % v as u32).collect();
            let (mut a, mut b) = (vec![0f32; v], vec![0f32; v]);
            let mut a_st = model.new_state();
            model.forward_chunk(&mut a_st, &mut StoreExperts::new(&store), &tokens, &mut a).unwrap();
            let mut b_st = model.new_state();
            let mut src = StoreExperts::new(&store);
            for chunk in tokens.chunks(16) {
                model.forward_chunk(&mut b_st, &mut src, chunk, &mut b).unwrap();
            }
            assert!(same(&a, &b), "{name}: a 150-token chunk's logits differ from chunks of 16");
            for (l, (ra, rb)) in a_st.routing.iter().zip(&b_st.routing).enumerate() {
                assert_eq!(ra.experts, rb.experts, "{name}: layer {l}: the last token's experts");
                assert_eq!(ra.weights, rb.weights, "{name}: layer {l}: the last token's weights");
            }
        }
    };
    check();
    rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap().install(check);
}
