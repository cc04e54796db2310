//! The per-token loop allocates nothing once warm: every block takes its buffers from the
//! sequence's scratch pool. Counted with a wrapping global allocator, with experts served from
//! memory so only the model's own code is measured (the streaming source's bookkeeping is not
//! part of this test); the streaming source and the spine loader have tests of their own here.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::*;
use deltafin_engine::experts::ExpertSource;
use deltafin_engine::k3::{K3Model, RunConfig};
use deltafin_store::{ExpertLayout, SpineDtype, Store};

struct Counting;

// Counted per thread: the tests of this binary run in parallel.
thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
    /// Set on a thread the test does not run itself (the spine loader): its allocations go to
    /// `SHARED_ALLOCS`, which the test reads.
    static SHARED: Cell<bool> = const { Cell::new(false) };
}

static SHARED_ALLOCS: AtomicUsize = AtomicUsize::new(0);

fn counting(on: bool) {
    COUNTING.with(|c| c.set(on));
}

fn reset() {
    ALLOCS.with(|a| a.set(0));
}

fn allocs() -> usize {
    ALLOCS.with(|a| a.get())
}

fn note_alloc() {
    if COUNTING.with(|c| c.get()) {
        ALLOCS.with(|a| a.set(a.get() + 1));
    }
    if SHARED.with(|c| c.get()) {
        SHARED_ALLOCS.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_alloc();
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_alloc();
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Every record in memory; begin/drain only index.
struct MemExperts {
    records: HashMap<(usize, usize), Vec<u8>>,
    layer: usize,
    pending: Vec<usize>,
}

impl ExpertSource for MemExperts {
    fn begin(&mut self, layer: usize, experts: &[usize]) -> anyhow::Result<()> {
        self.layer = layer;
        self.pending.clear();
        self.pending.extend_from_slice(experts);
        Ok(())
    }
    fn drain(&mut self, f: &mut dyn FnMut(usize, &[u8]) -> anyhow::Result<()>) -> anyhow::Result<()> {
        for (i, e) in self.pending.iter().enumerate() {
            f(i, &self.records[&(self.layer, *e)])?;
        }
        Ok(())
    }
    fn bytes_read(&self) -> u64 {
        0
    }
}

#[test]
fn decode_steps_allocate_nothing_once_warm() {
    for name in FIXTURES {
        let dir = convert_fixture(name, SpineDtype::Int8, 0, ExpertLayout::Pack);
        let store = Store::open(dir.path(), None).unwrap();
        let mut records = HashMap::new();
        for l in store.manifest.config.moe_layers() {
            for e in 0..store.manifest.config.num_experts {
                let mut buf = Vec::new();
                store.experts.read(l, e, &mut buf).unwrap();
                records.insert((l, e), buf);
            }
        }
        let mut src = MemExperts { records, layer: 0, pending: Vec::with_capacity(64) };
        for approx in [false, true] {
            // `predict` exercises the look-ahead predictor too.
            let model = K3Model::load(&store, &RunConfig { predict: true, approx, ..Default::default() }).unwrap();
            let mut st = model.new_state();
            let mut logits = vec![0f32; model.config.vocab_size];
            for t in [3u32, 9, 27] {
                model.forward(&mut st, &mut src, t, &mut logits).unwrap();
            }
            reset();
            counting(true);
            for t in [5u32, 7, 11] {
                model.forward(&mut st, &mut src, t, &mut logits).unwrap();
            }
            counting(false);
            let n = allocs();
            assert_eq!(n, 0, "{name} (approx {approx}): {n} allocations in three warm decode steps");
        }
    }
}

/// The streaming source's per-layer path (hits, misses read with io_uring, prefetch hints, cache
/// insertion and eviction) allocates nothing once warm either.
#[test]
fn streaming_decode_steps_allocate_nothing_once_warm() {
    use deltafin_engine::stream::cache::Policy;
    use deltafin_engine::stream::reader::BackendKind;
    use deltafin_engine::stream::streaming::{StreamOptions, StreamingExperts};
    // The pread pool's channels allocate: this test needs io_uring.
    if !uring_or_skip("streaming decode without allocation") {
        return;
    }
    let dir = convert_fixture("k3-small", SpineDtype::Int8, 0, ExpertLayout::Pack);
    let store = Store::open(dir.path(), None).unwrap();
    let model = K3Model::load(&store, &RunConfig { prefetch: true, ..Default::default() }).unwrap();
    let k = model.config.num_experts_per_token;
    let opts = StreamOptions {
        cache_slots_per_layer: 2,
        policy: Policy::Slru,
        backend: Some(BackendKind::IoUring),
        direct: true,
        queue_depth: 16,
        io_buffers: 2 * k,
        prefetch_buffers: k,
    };
    let mut src = StreamingExperts::new(&store, opts).unwrap();
    let mut st = model.new_state();
    let mut logits = vec![0f32; model.config.vocab_size];
    let tokens: Vec<u32> = (0..40).map(|i| (i * 37 % 500) as u32).collect();
    for &t in &tokens[..30] {
        model.forward(&mut st, &mut src, t, &mut logits).unwrap();
    }
    let reads_before = src.total_stats().demand_reads;
    reset();
    counting(true);
    for &t in &tokens[30..] {
        model.forward(&mut st, &mut src, t, &mut logits).unwrap();
    }
    counting(false);
    let n = allocs();
    assert!(src.total_stats().demand_reads > reads_before, "the measured steps must read from disk");
    assert_eq!(n, 0, "{n} allocations in ten warm streaming decode steps");
}

/// The spine loader reads a streamed layer for every token without allocating, the model's
/// own layer (every block's matrices, vectors and names) included: its requests, landed map and
/// verifier are kept from layer to layer, the response channel is bounded, and a layer is
/// decoded once and then kept between reads, its views pointed at each new image. Counted on
/// the loader thread only; the engine side (handing layers back) is the model's decode step.
#[test]
fn the_spine_loader_reads_layers_without_allocating() {
    use deltafin_engine::experts::RecordLayout;
    use deltafin_engine::k3::{Attention, load_layer};
    use deltafin_engine::stream::reader::BackendKind;
    use deltafin_engine::stream::spine::SpineStreamer;
    // The pread pool's channels allocate: this test needs io_uring.
    if !uring_or_skip("spine loader without allocation") {
        return;
    }
    let dir = convert_fixture("k3-small", SpineDtype::Int8, 0, ExpertLayout::Pack);
    let store = Store::open(dir.path(), None).unwrap();
    let c = store.manifest.config.clone();
    let ex = &store.manifest.experts;
    let layout = RecordLayout::from_manifest(&ex.parts, ex.record_bytes).unwrap();
    let layers: Vec<usize> = (0..c.num_hidden_layers).collect();
    let cfg = c.clone();
    let decode = Box::new(move |img: &deltafin_store::SpineImage<'_>, l: usize| {
        // The first decode marks the loader thread: from here on its allocations are counted.
        SHARED.with(|c| c.set(true));
        load_layer(img, &cfg, l, &layout)
    });
    let mut s = SpineStreamer::start(&store, layers.clone(), Some(BackendKind::IoUring), None, decode).unwrap();
    // What each layer computes, as a fingerprint: its attention's output projection of a fixed
    // input (the matrix is a view into the image being computed on).
    let fingerprint = |ly: &deltafin_engine::k3::Layer| {
        let o = match &ly.attn {
            Attention::Kda(k) => &k.o_proj,
            Attention::Mla(m) => &m.o_proj,
        };
        let x: Vec<f32> = (0..o.cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut y = vec![0f32; o.rows];
        o.forward(&x, &mut y);
        y.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
    };
    let want: Vec<Vec<u32>> = layers.iter().map(|&l| fingerprint(&s.get(l).unwrap())).collect();
    for &l in &layers {
        assert_eq!(fingerprint(&s.get(l).unwrap()), want[l], "layer {l}, read again");
    }
    let mut read_rounds = |rounds: usize| {
        for _ in 0..rounds {
            for &l in &layers {
                let layer = s.get(l).unwrap();
                // Held while the next layer is read into the other buffer, as the engine does.
                assert!(matches!(layer.attn, Attention::Kda(_) | Attention::Mla(_)));
            }
        }
    };
    read_rounds(3);
    let before = SHARED_ALLOCS.load(Ordering::Relaxed);
    let rounds = 30;
    read_rounds(rounds);
    let n = SHARED_ALLOCS.load(Ordering::Relaxed) - before;
    // Not one per read: at most the one-time growth of std's channel waiter lists (two small
    // blocks, 48 and 96 bytes, measured), made the first time the loader waits on a channel in
    // a way it had not yet; a layer decoded again would cost about a hundred.
    assert!(n <= 2, "{n} allocations on the loader thread for {} layer reads", rounds * layers.len());
    for &l in &layers {
        assert_eq!(fingerprint(&s.get(l).unwrap()), want[l], "layer {l}, after {rounds} rounds");
    }
    let decoded = s.counters.decoded.load(Ordering::Relaxed);
    assert_eq!(decoded, layers.len() as u64, "each layer decoded once, then kept");
    assert!(s.counters.rebound.load(Ordering::Relaxed) >= (rounds * layers.len()) as u64);
}
