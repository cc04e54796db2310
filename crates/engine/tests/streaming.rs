//! Streaming experts from disk must not change a single bit: logits are identical to plain
//! reads for every budget (one cache slot per layer up to every expert resident), both read
//! back-ends, with and without prefetch, in place or packed; and corrupt records are caught.

mod common;

use common::*;
use deltafin_engine::experts::{ExpertSource, StoreExperts};
use std::sync::atomic::Ordering::Relaxed;

use deltafin_engine::k3::{Ffn, K3Model, RunConfig};
use deltafin_engine::stream::cache::Policy;
use deltafin_engine::stream::reader::BackendKind;
use deltafin_engine::stream::streaming::{StreamOptions, StreamingExperts};
use deltafin_store::{ExpertLayout, SpineDtype, Store};

/// Chunked prompts through the streaming source with fewer I/O buffers than a chunk's distinct
/// experts (misses wait for buffers), for every budget: same bits as token by token.
#[test]
fn chunked_prompts_stream_bit_identically() {
    for name in FIXTURES {
        let dir = convert_fixture(name, SpineDtype::Int8, 0, ExpertLayout::InPlace);
        let store = Store::open(dir.path(), None).unwrap();
        let model = K3Model::load(&store, &RunConfig::default()).unwrap();
        let reference = run(&model, &mut StoreExperts::new(&store), name);
        let all = store.manifest.config.num_experts;
        for backend in backends() {
            for slots in [0, 1, all] {
                let mut o = opts(slots, backend, 0, Policy::Slru);
                o.io_buffers = 6;
                let mut src = StreamingExperts::new(&store, o).unwrap();
                let mut idx = 0;
                for p in &reference_prompts(name) {
                    let mut st = model.new_state();
                    let mut logits = vec![0f32; model.config.vocab_size];
                    model.forward_chunk(&mut st, &mut src, p, &mut logits).unwrap();
                    idx += p.len();
                    let want = &reference[idx - 1];
                    assert!(
                        logits.iter().zip(want).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{name} {backend:?} slots {slots}: chunked prompt of {} tokens",
                        p.len()
                    );
                }
            }
        }
    }
}

fn reference_prompts(name: &str) -> Vec<Vec<u32>> {
    reference(name).prompts.into_iter().map(|p| p.tokens).collect()
}

/// Logits at every position of every fixture prompt, one fresh sequence per prompt.
fn run(model: &K3Model, src: &mut dyn ExpertSource, name: &str) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    for p in &reference(name).prompts {
        let mut st = model.new_state();
        for &t in &p.tokens {
            let mut logits = vec![0f32; model.config.vocab_size];
            model.forward(&mut st, src, t, &mut logits).unwrap();
            out.push(logits);
        }
    }
    out
}

fn opts(slots: usize, backend: BackendKind, prefetch: usize, policy: Policy) -> StreamOptions {
    StreamOptions {
        cache_slots_per_layer: slots,
        policy,
        backend: Some(backend),
        direct: true,
        queue_depth: 8,
        io_buffers: 8 + prefetch,
        prefetch_buffers: prefetch,
    }
}

#[test]
fn streaming_is_bit_identical_across_budgets_backends_and_layouts() {
    for name in FIXTURES {
        for layout in [ExpertLayout::InPlace, ExpertLayout::Pack] {
            let dir = convert_fixture(name, SpineDtype::Int8, 0, layout);
            let store = Store::open(dir.path(), None).unwrap();
            let model = K3Model::load(&store, &RunConfig::default()).unwrap();
            let reference = run(&model, &mut StoreExperts::new(&store), name);
            let all = store.manifest.config.num_experts;
            for backend in backends() {
                for slots in [1, 3, all] {
                    for (prefetch, policy) in [(0, Policy::Lru), (8, Policy::Slru)] {
                        let run_config = RunConfig { prefetch: prefetch > 0, ..Default::default() };
                        let model = K3Model::load(&store, &run_config).unwrap();
                        let mut src = StreamingExperts::new(&store, opts(slots, backend, prefetch, policy)).unwrap();
                        let got = run(&model, &mut src, name);
                        let what =
                            format!("{name} {layout:?} {backend:?} slots {slots} prefetch {prefetch} {policy:?}");
                        assert_eq!(got.len(), reference.len());
                        for (a, b) in got.iter().zip(&reference) {
                            assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "{what}: logits differ");
                        }
                        let t = src.total_stats();
                        assert_eq!(t.accesses, t.hits + t.demand_reads, "{what}: every access is a hit or a read");
                        // A hit is the cache's own or speculation's, never both; adopted reads
                        // are speculation's.
                        assert_eq!(t.hits, t.cache_hits + t.prefetch_used, "{what}: hits split");
                        assert!(t.adopted <= t.prefetch_used, "{what}");
                        if prefetch == 0 {
                            assert_eq!((t.prefetch_used, t.adopted), (0, 0), "{what}: no speculation");
                        }
                        if slots == all && prefetch == 0 {
                            // Everything fits: each expert is read at most once.
                            let layers = store.manifest.experts.layers.len() as u64;
                            assert!(t.demand_reads <= layers * all as u64, "{what}");
                        }
                        if prefetch > 0 {
                            assert!(t.prefetch_reads > 0, "{what}: prefetch issued no reads");
                            assert!(t.prefetch_used <= t.prefetch_reads + t.hits);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn corrupt_record_is_caught_by_the_streaming_reader() {
    let dir = convert_fixture("k3-tiny", SpineDtype::Int8, 0, ExpertLayout::Pack);
    let f = dir.path().join("experts/layer-002.bin");
    let mut bytes = std::fs::read(&f).unwrap();
    for b in bytes.iter_mut().step_by(101) {
        *b ^= 0x3C;
    }
    std::fs::write(&f, bytes).unwrap();
    let store = Store::open(dir.path(), None).unwrap();
    let model = K3Model::load(&store, &RunConfig::default()).unwrap();
    for backend in backends() {
        let mut src = StreamingExperts::new(&store, opts(2, backend, 0, Policy::Lru)).unwrap();
        let mut st = model.new_state();
        let mut logits = vec![0f32; model.config.vocab_size];
        let err = model.forward(&mut st, &mut src, 5, &mut logits).unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.contains("layer 2 expert") && msg.contains("checksum"), "{backend:?}: {msg}");
    }
}

/// Spine layers that do not fit are read from the spine file for every token: same bits.
#[test]
fn streamed_spine_layers_are_bit_identical() {
    for name in FIXTURES {
        let dir = convert_fixture(name, SpineDtype::Int8, 0, ExpertLayout::InPlace);
        let store = Store::open(dir.path(), None).unwrap();
        let reference =
            run(&K3Model::load(&store, &RunConfig::default()).unwrap(), &mut StoreExperts::new(&store), name);
        let n = store.manifest.config.num_hidden_layers;
        for resident in [0, 2, n - 1] {
            let model =
                K3Model::load(&store, &RunConfig { resident_layers: Some(resident), ..Default::default() }).unwrap();
            let got = run(&model, &mut StoreExperts::new(&store), name);
            for (a, b) in got.iter().zip(&reference) {
                assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "{name}: {resident} resident layers");
            }
            let mut streamer = model.spine_stream.as_ref().expect("layers are streamed").lock().unwrap();
            let c = &streamer.counters;
            assert!(c.bytes_read.load(Relaxed) > 0);
            // Every byte read was verified, on the loader thread.
            assert!(c.bytes_verified.load(Relaxed) > 0 && c.verify_ns.load(Relaxed) > 0);
            // Each streamed layer was decoded about once (one streamed layer is read into both
            // buffers before its first copy comes back); later tokens pointed the kept layer at
            // its new image (and gave the same bits above).
            let most = (n - resident + deltafin_engine::stream::spine::SPINE_BUFFERS) as u64;
            assert!(
                c.decoded.load(Relaxed) <= most,
                "{name}: {resident} resident layers: {} decoded, {} rebound",
                c.decoded.load(Relaxed),
                c.rebound.load(Relaxed)
            );
            assert!(c.rebound.load(Relaxed) > 0, "{name}: no kept layer was reused");
            // The streamed layer's matrices are views into its image, not copies.
            let layer = streamer.get(n - 1).unwrap();
            let gate = match &layer.ffn {
                Ffn::Moe(m) => &m.gate,
                Ffn::Dense(d) => &d.gate,
            };
            assert!(gate.borrows_image(), "{name}: a streamed layer's weights were copied");
        }
    }
}

#[test]
fn corrupt_streamed_spine_layer_is_caught() {
    let dir = convert_fixture("k3-tiny", SpineDtype::Int8, 0, ExpertLayout::InPlace);
    let store = Store::open(dir.path(), None).unwrap();
    let t = store.spine_tensor_info("layers.6.self_attn.q_proj.weight").unwrap().clone();
    let f = std::fs::OpenOptions::new().read(true).write(true).open(dir.path().join("spine.bin")).unwrap();
    use deltafin_store::os::FileAt;
    let mut b = [0u8];
    f.read_exact_at(&mut b, t.offset + 5).unwrap();
    f.write_all_at(&[b[0] ^ 0x11], t.offset + 5).unwrap();
    let model = K3Model::load(&store, &RunConfig { resident_layers: Some(4), ..Default::default() }).unwrap();
    let mut st = model.new_state();
    let mut logits = vec![0f32; model.config.vocab_size];
    let err = model.forward(&mut st, &mut StoreExperts::new(&store), 3, &mut logits).unwrap_err();
    let msg = format!("{err:#}");
    assert!(msg.contains("layers.6.self_attn.q_proj.weight") && msg.contains("checksum"), "{msg}");
    // It was read twice (a corrupt read is retried once) before the step failed.
    let retries = || model.spine_stream.as_ref().unwrap().lock().unwrap().counters.retries.load(Relaxed);
    assert!(retries() >= 1);
    // The loader survives the fault: once the bytes are right again, the next token is exact.
    f.write_all_at(&b, t.offset + 5).unwrap();
    let reference = K3Model::load(&store, &RunConfig::default()).unwrap();
    let mut want = vec![0f32; model.config.vocab_size];
    reference.forward(&mut reference.new_state(), &mut StoreExperts::new(&store), 3, &mut want).unwrap();
    for _ in 0..2 {
        let mut st = model.new_state();
        model.forward(&mut st, &mut StoreExperts::new(&store), 3, &mut logits).unwrap();
        assert!(logits.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()), "after a spine fault");
    }
}

/// A store whose in-place experts moved (opened with `--source`) can stream its spine: the spine
/// loader works from the open store and never reopens it.
#[test]
fn streamed_spine_works_with_a_moved_checkpoint() {
    let src = tempfile::tempdir().unwrap();
    let hf = src.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    for e in std::fs::read_dir(fixture_dir("k3-tiny").join("hf")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), hf.join(e.file_name())).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let opts = deltafin_store::convert::ConvertOptions {
        spine: SpineDtype::Int8.into(),
        int8_group: 0,
        experts: ExpertLayout::InPlace,
        progress: false,
        ..Default::default()
    };
    deltafin_store::convert::convert(&hf, dir.path(), &opts).unwrap();
    let moved = src.path().join("moved");
    std::fs::rename(&hf, &moved).unwrap();
    assert!(Store::open(dir.path(), None).is_err(), "the checkpoint moved: opening without --source must fail");
    let store = Store::open(dir.path(), Some(&moved)).unwrap();
    let reference =
        run(&K3Model::load(&store, &RunConfig::default()).unwrap(), &mut StoreExperts::new(&store), "k3-tiny");
    let model = K3Model::load(&store, &RunConfig { resident_layers: Some(2), ..Default::default() }).unwrap();
    let got = run(&model, &mut StoreExperts::new(&store), "k3-tiny");
    assert_eq!(got.len(), reference.len());
    for (a, b) in got.iter().zip(&reference) {
        assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "streamed spine with a moved checkpoint");
    }
}
