//! The per-token loop allocates nothing once warm: every block takes its buffers from the
//! sequence's scratch pool. Counted with a wrapping global allocator, with experts served from
//! memory so only the model's own code is measured (the streaming source's bookkeeping is not
//! part of this test).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use common::*;
use deltafin_engine::experts::ExpertSource;
use deltafin_engine::k3::K3Model;
use deltafin_store::{ExpertLayout, SpineDtype, Store};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
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
        let mut model = K3Model::load(&store).unwrap();
        model.predict = true; // exercise the look-ahead predictor too
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
            model.approx = approx;
            let mut st = model.new_state();
            let mut logits = vec![0f32; model.config.vocab_size];
            for t in [3u32, 9, 27] {
                model.forward(&mut st, &mut src, t, &mut logits).unwrap();
            }
            ALLOCS.store(0, Ordering::Relaxed);
            COUNTING.store(true, Ordering::Relaxed);
            for t in [5u32, 7, 11] {
                model.forward(&mut st, &mut src, t, &mut logits).unwrap();
            }
            COUNTING.store(false, Ordering::Relaxed);
            let n = ALLOCS.load(Ordering::Relaxed);
            assert_eq!(n, 0, "{name} (approx {approx}): {n} allocations in three warm decode steps");
        }
    }
}
