//! Fault injection through the real reader: a failed or corrupt expert read costs one request,
//! never the source. Faults come from a decorator around the real back-end (EIO on chosen reads)
//! or from the files themselves (corrupted or truncated on disk between requests). For each
//! fault: the request fails with a `ReadFault` naming layer and expert (or succeeds after one
//! retry), the source is back in its idle state (no read tracked, every buffer accounted for),
//! the next request gives the same tokens as a fault-free run, and nothing hangs (a watchdog
//! ends the test binary if a scenario does not finish).

mod common;

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use deltafin_engine::experts::{ExpertSource, StoreExperts};
use deltafin_engine::fault::{FaultKind, FaultStats, ReadFault, SpineFault};
use deltafin_engine::generate::generate_greedy;
use deltafin_engine::k3::{K3Model, PromptBorrowing, RunConfig};
use deltafin_engine::stream::cache::Policy;
use deltafin_engine::stream::reader::{BackendKind, ReadBackend, ReadReq, Waker};
use deltafin_engine::stream::streaming::{StreamOptions, StreamingExperts};
use deltafin_store::{ExpertLayout, SpineDtype, Store};

/// Which completions the decorator turns into EIO.
#[derive(Default)]
struct Rules {
    /// Fail the read submitted as number N (0-based, counting every read), once.
    nth: Option<usize>,
    /// Fail every demand read while set.
    all_urgent: bool,
    /// Fail every prefetch read while set.
    all_prefetch: bool,
    submitted: usize,
    /// Completions failed so far.
    failed: usize,
    /// Fail the back-end itself (its next N waits return an error) where it is used for a
    /// streamed spine.
    fail_waits: usize,
}

/// The real back-end, with some completions replaced by EIO (the read itself still happens).
struct Faulty {
    inner: Box<dyn ReadBackend>,
    rules: Arc<Mutex<Rules>>,
    doomed: Vec<u64>,
}

impl ReadBackend for Faulty {
    fn kind(&self) -> BackendKind {
        self.inner.kind()
    }
    fn submit(&mut self, reqs: &[ReadReq]) -> io::Result<()> {
        let mut r = self.rules.lock().unwrap();
        for q in reqs {
            let n = r.submitted;
            r.submitted += 1;
            let fail = r.nth == Some(n) || (q.urgent && r.all_urgent) || (!q.urgent && r.all_prefetch);
            if fail {
                self.doomed.push(q.tag);
            }
        }
        drop(r);
        self.inner.submit(reqs)
    }
    fn wait(&mut self, out: &mut Vec<(u64, io::Result<()>)>) -> io::Result<()> {
        let from = out.len();
        self.inner.wait(out)?;
        {
            let mut r = self.rules.lock().unwrap();
            if r.fail_waits > 0 {
                r.fail_waits -= 1;
                return Err(io::Error::other("injected back-end failure"));
            }
        }
        for (tag, res) in &mut out[from..] {
            if let Some(i) = self.doomed.iter().position(|t| t == tag) {
                self.doomed.swap_remove(i);
                *res = Err(io::Error::from_raw_os_error(libc_eio()));
                self.rules.lock().unwrap().failed += 1;
            }
        }
        Ok(())
    }
    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }
    fn urge(&mut self, tags: std::ops::Range<u64>) {
        self.inner.urge(tags)
    }
    fn waker(&mut self) -> io::Result<Waker> {
        self.inner.waker()
    }
}

fn libc_eio() -> i32 {
    5 // EIO on every Unix
}

fn backends() -> Vec<BackendKind> {
    let mut v = vec![BackendKind::Pread];
    if uring_or_skip("io_uring back-end") {
        v.push(BackendKind::IoUring);
    }
    v
}

struct Fixture {
    dir: tempfile::TempDir,
    store: Store,
    model: K3Model,
    prompt: Vec<u32>,
    /// Greedy tokens of a fault-free run (plain checked reads).
    reference: Vec<u32>,
}

fn fixture(prefetch: bool) -> Fixture {
    let dir = convert_fixture("k3-small", SpineDtype::Int8, 0, ExpertLayout::Pack);
    let store = Store::open(dir.path(), None).unwrap();
    let model = K3Model::load(&store, &RunConfig { prefetch, ..Default::default() }).unwrap();
    let prompt = reference("k3-small").prompts.iter().map(|p| p.tokens.clone()).max_by_key(|t| t.len()).unwrap();
    let reference = generate_greedy(&model, &mut StoreExperts::new(&store), &prompt, 6, None).unwrap().tokens;
    Fixture { dir, store, model, prompt, reference }
}

fn source(
    f: &Fixture,
    backend: BackendKind,
    slots: usize,
    prefetch: bool,
    rules: &Arc<Mutex<Rules>>,
) -> StreamingExperts {
    let k = f.model.config.num_experts_per_token;
    let opts = StreamOptions {
        cache_slots_per_layer: slots,
        policy: Policy::Slru,
        backend: Some(backend),
        direct: true,
        queue_depth: 8,
        io_buffers: 2 * k,
        prefetch_buffers: if prefetch { k } else { 0 },
    };
    let rules = rules.clone();
    StreamingExperts::with_backend(&f.store, opts, move |inner| {
        Box::new(Faulty { inner, rules: rules.clone(), doomed: Vec::new() })
    })
    .unwrap()
}

/// Ends the test binary if a scenario hangs.
struct Watchdog(Arc<AtomicBool>);

impl Watchdog {
    fn start(what: &'static str) -> Self {
        let done = Arc::new(AtomicBool::new(false));
        let d = done.clone();
        std::thread::spawn(move || {
            for _ in 0..1200 {
                std::thread::sleep(Duration::from_millis(100));
                if d.load(Ordering::Relaxed) {
                    return;
                }
            }
            eprintln!("{what}: a request hung for 120 s");
            std::process::exit(101);
        });
        Watchdog(done)
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

fn run(f: &Fixture, src: &mut StreamingExperts) -> anyhow::Result<Vec<u32>> {
    Ok(generate_greedy(&f.model, src, &f.prompt, 6, None)?.tokens)
}

fn fault_of(e: &anyhow::Error) -> &ReadFault {
    e.chain().find_map(|c| c.downcast_ref::<ReadFault>()).unwrap_or_else(|| panic!("not a read fault: {e:#}"))
}

/// The request after a fault is served normally, and the source is idle between requests.
fn recovers(f: &Fixture, src: &mut StreamingExperts, what: &str) {
    src.check_idle().unwrap_or_else(|e| panic!("{what}: after the fault: {e:#}"));
    let tokens = run(f, src).unwrap_or_else(|e| panic!("{what}: the next request failed: {e:#}"));
    assert_eq!(tokens, f.reference, "{what}: the next request's tokens differ from a fault-free run");
    src.check_idle().unwrap_or_else(|e| panic!("{what}: after the next request: {e:#}"));
}

#[test]
fn a_transient_read_error_is_retried_and_costs_nothing() {
    let _w = Watchdog::start("transient");
    let f = fixture(false);
    for backend in backends() {
        let rules = Arc::new(Mutex::new(Rules { nth: Some(3), ..Default::default() }));
        let mut src = source(&f, backend, 0, false, &rules);
        let tokens = run(&f, &mut src).unwrap();
        assert_eq!(tokens, f.reference, "{backend:?}");
        let s = src.faults();
        assert_eq!(rules.lock().unwrap().failed, 1);
        assert_eq!((s.read_errors, s.retries, s.failed_records), (1, 1, 0), "{backend:?}: {s:?}");
        src.check_idle().unwrap();
    }
}

#[test]
fn a_persistent_read_error_fails_one_request_and_the_next_is_served() {
    let _w = Watchdog::start("persistent");
    let f = fixture(false);
    for backend in backends() {
        for slots in [0, 2] {
            let rules = Arc::new(Mutex::new(Rules { all_urgent: true, ..Default::default() }));
            let mut src = source(&f, backend, slots, false, &rules);
            let err = run(&f, &mut src).unwrap_err();
            let fault = fault_of(&err);
            assert_eq!(fault.kind, FaultKind::Io, "{backend:?}");
            let msg = err.to_string();
            assert!(msg.contains(&format!("layer {} expert {}", fault.layer, fault.expert)), "{msg}");
            let dir = f.dir.path().to_string_lossy();
            assert!(!msg.contains(&*dir) && !msg.contains("layer-"), "the message must not carry a path: {msg}");
            // The log detail names the file that failed.
            assert!(fault.detail.contains("experts/layer-"), "{}", fault.detail);
            let s = src.faults();
            assert!(s.retries >= 1 && s.failed_records >= 1 && s.resets >= 1, "{backend:?}: {s:?}");
            rules.lock().unwrap().all_urgent = false;
            recovers(&f, &mut src, &format!("{backend:?} slots {slots}"));
        }
    }
}

#[test]
fn a_failed_prefetch_costs_only_its_read() {
    let _w = Watchdog::start("prefetch");
    let f = fixture(true);
    for backend in backends() {
        let rules = Arc::new(Mutex::new(Rules { all_prefetch: true, ..Default::default() }));
        let mut src = source(&f, backend, 2, true, &rules);
        let tokens = run(&f, &mut src).unwrap();
        assert_eq!(tokens, f.reference, "{backend:?}");
        let s = src.faults();
        assert!(rules.lock().unwrap().failed > 0, "{backend:?}: no prefetch read was failed");
        assert_eq!(s.failed_records, 0, "{backend:?}: {s:?}");
        src.finish_prefetches().unwrap();
        src.check_idle().unwrap();
    }
}

/// Flip bytes of every record of one packed layer file; returns the original bytes.
fn corrupt_layer(f: &Fixture, layer: usize) -> (std::path::PathBuf, Vec<u8>) {
    let path = f.dir.path().join(format!("experts/layer-{layer:03}.bin"));
    let orig = std::fs::read(&path).unwrap();
    let mut bad = orig.clone();
    for b in bad.iter_mut().step_by(61) {
        *b ^= 0x5A;
    }
    std::fs::write(&path, &bad).unwrap();
    (path, orig)
}

#[test]
fn a_record_corrupted_on_disk_between_requests_is_caught_and_never_cached() {
    let _w = Watchdog::start("corrupt");
    let f = fixture(false);
    let layer = f.model.config.moe_layers()[1];
    for backend in backends() {
        let rules = Arc::new(Mutex::new(Rules::default()));
        // One slot per layer: a corrupt record would stay for the next request if it were cached.
        let mut src = source(&f, backend, 1, false, &rules);
        assert_eq!(run(&f, &mut src).unwrap(), f.reference);
        let (path, orig) = corrupt_layer(&f, layer);
        // The cached record of this layer may serve the first token; the rest must be read.
        let err = run(&f, &mut src).unwrap_err();
        let fault = fault_of(&err);
        assert_eq!((fault.kind, fault.layer), (FaultKind::Checksum, layer), "{backend:?}: {err:#}");
        assert!(!src.is_cached(fault.layer, fault.expert), "a record that failed its checksum was cached");
        let s = src.faults();
        assert!(s.checksum_failures >= 2 && s.retries >= 1, "{backend:?}: {s:?}");
        std::fs::write(&path, orig).unwrap();
        recovers(&f, &mut src, &format!("{backend:?}"));
    }
}

#[test]
fn a_file_truncated_while_serving_fails_the_request_cleanly() {
    let _w = Watchdog::start("truncated");
    let f = fixture(false);
    let layer = f.model.config.moe_layers()[0];
    for backend in backends() {
        let rules = Arc::new(Mutex::new(Rules::default()));
        let mut src = source(&f, backend, 0, false, &rules);
        let path = f.dir.path().join(format!("experts/layer-{layer:03}.bin"));
        let orig = std::fs::read(&path).unwrap();
        // Keep the first record only: every other record of the layer reads past the end.
        let record = f.store.manifest.experts.record_bytes as usize;
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(record as u64 / 2).unwrap();
        let err = run(&f, &mut src).unwrap_err();
        let fault = fault_of(&err);
        assert_eq!((fault.kind, fault.layer), (FaultKind::Io, layer), "{backend:?}: {err:#}");
        std::fs::write(&path, orig).unwrap();
        recovers(&f, &mut src, &format!("{backend:?}"));
    }
}

#[test]
fn duplicate_experts_in_one_step_are_refused_and_the_source_stays_usable() {
    let _w = Watchdog::start("duplicates");
    let f = fixture(false);
    let layer = f.model.config.moe_layers()[0];
    for backend in backends() {
        let rules = Arc::new(Mutex::new(Rules::default()));
        let mut src = source(&f, backend, 2, false, &rules);
        let err = src.begin(layer, &[3, 1, 3]).unwrap_err();
        assert!(format!("{err:#}").contains("requested twice"), "{err:#}");
        recovers(&f, &mut src, &format!("{backend:?}"));
    }
}

#[test]
fn an_error_in_the_compute_callback_does_not_poison_the_source() {
    let _w = Watchdog::start("callback");
    let f = fixture(false);
    let layer = f.model.config.moe_layers()[0];
    for backend in backends() {
        let rules = Arc::new(Mutex::new(Rules::default()));
        let mut src = source(&f, backend, 2, false, &rules);
        src.begin(layer, &[0, 1, 2, 3]).unwrap();
        let err = src.drain(&mut |_, _| anyhow::bail!("compute failed")).unwrap_err();
        assert!(format!("{err}").contains("compute failed"));
        recovers(&f, &mut src, &format!("{backend:?}"));
    }
}

/// A prefetched record evicted before any use is not counted as used when the expert is later
/// read and hit the ordinary way.
#[test]
fn prefetch_statistics_forget_evicted_records() {
    let f = fixture(false);
    let layer = f.model.config.moe_layers()[0];
    let rules = Arc::new(Mutex::new(Rules::default()));
    let mut src = source(&f, BackendKind::Pread, 1, true, &rules);
    let step = |src: &mut StreamingExperts, e: usize| {
        src.begin(layer, &[e]).unwrap();
        src.drain(&mut |_, _| Ok(())).unwrap();
    };
    src.prefetch(layer, &[5]).unwrap();
    src.finish_prefetches().unwrap();
    assert!(src.is_cached(layer, 5));
    step(&mut src, 7); // evicts the unused prefetch of 5
    assert!(!src.is_cached(layer, 5));
    step(&mut src, 5); // a plain miss
    step(&mut src, 5); // a plain hit
    assert_eq!(src.total_stats().prefetch_used, 0, "an evicted prefetch was counted as used");
    src.check_idle().unwrap();
}

/// A record stored as more than 256 ranges (a checkpoint that scatters an expert's bytes) reads
/// back exactly: every range's read has its own tag (they once collided with the next record's).
#[test]
fn records_of_many_ranges_read_back_exactly() {
    let _w = Watchdog::start("ranges");
    let f = fixture(false);
    let mut m = f.store.manifest.clone();
    let layer = m.experts.layers[0].layer;
    // Cut experts 0 and 1 of the first MoE layer into 300 ranges each (same bytes, same order).
    for e in 0..2 {
        let loc = &mut m.experts.layers[0].experts[e];
        let [file, off, len] = loc.ranges[0];
        assert_eq!(loc.ranges.len(), 1, "the packed fixture keeps a record in one range");
        let n = 300u64;
        let piece = len.div_ceil(n);
        loc.ranges = (0..n)
            .map(|i| [file, off + i * piece, piece.min(len.saturating_sub(i * piece))])
            .filter(|r| r[2] > 0)
            .collect();
        assert!(loc.ranges.len() > 256);
    }
    m.save(f.dir.path()).unwrap();
    let store = Store::open(f.dir.path(), None).unwrap();
    for backend in backends() {
        let k = f.model.config.num_experts_per_token;
        let opts = StreamOptions {
            cache_slots_per_layer: 0,
            policy: Policy::Lru,
            backend: Some(backend),
            direct: true,
            queue_depth: 8,
            io_buffers: 2 * k,
            prefetch_buffers: 0,
        };
        let mut src = StreamingExperts::new(&store, opts).unwrap();
        let mut plain = StoreExperts::new(&store);
        let mut want: Vec<Vec<u8>> = vec![Vec::new(); 3];
        plain.begin(layer, &[0, 1, 2]).unwrap();
        plain
            .drain(&mut |i, r| {
                want[i] = r.to_vec();
                Ok(())
            })
            .unwrap();
        let mut got: Vec<Vec<u8>> = vec![Vec::new(); 3];
        src.begin(layer, &[0, 1, 2]).unwrap();
        src.drain(&mut |i, r| {
            got[i] = r.to_vec();
            Ok(())
        })
        .unwrap();
        assert_eq!(got, want, "{backend:?}");
        src.check_idle().unwrap();
    }
}

/// With no cache slots (the plan when the spine is streamed), a prefetch that lands before its
/// layer begins waits in its buffer and is used, never read twice; one its layer does not ask
/// for is dropped when the layer begins; every buffer is accounted for afterwards.
#[test]
fn prefetches_land_without_cache_slots_and_are_used() {
    let _w = Watchdog::start("landing");
    let f = fixture(false);
    let layer = f.model.config.moe_layers()[0];
    let rules = Arc::new(Mutex::new(Rules::default()));
    let mut src = source(&f, BackendKind::Pread, 0, true, &rules);
    let mut direct = StoreExperts::new(&f.store);
    src.prefetch(layer, &[3, 5]).unwrap();
    src.finish_prefetches().unwrap();
    assert!(!src.is_cached(layer, 3), "no slot to cache it in");
    let read_before = src.total_stats().demand_reads;
    let mut got = Vec::new();
    src.begin(layer, &[5, 6]).unwrap();
    src.drain(&mut |i, rec| {
        got.push((i, rec.to_vec()));
        Ok(())
    })
    .unwrap();
    let t = src.total_stats();
    assert_eq!(t.prefetch_used, 1, "the landed prefetch of 5 was used");
    assert_eq!(t.demand_reads - read_before, 1, "only 6 was read on demand");
    // The bytes are the expert's own.
    got.sort_by_key(|(i, _)| *i);
    let mut want = Vec::new();
    direct.begin(layer, &[5, 6]).unwrap();
    direct
        .drain(&mut |_, rec| {
            want.push(rec.to_vec());
            Ok(())
        })
        .unwrap();
    assert_eq!(got.into_iter().map(|(_, r)| r).collect::<Vec<_>>(), want);
    // 3 was a wrong guess: dropped when its layer began, its buffer back in the pool.
    src.check_idle().unwrap();
}

/// A long prompt borrows the cache's memory: lending evicts, gives whole slots' pages back and
/// keeps those buffers out of use (every buffer still accounted for); demand reads go on with
/// the rest, the bytes are the experts' own, and after `take_back` the cache fills again.
#[test]
fn lending_the_cache_gives_slots_back_and_take_back_restores_them() {
    let _w = Watchdog::start("lending");
    let f = fixture(false);
    let layers = f.model.config.moe_layers();
    let layer = layers[0];
    let rules = Arc::new(Mutex::new(Rules::default()));
    let mut src = source(&f, BackendKind::Pread, 4, false, &rules);
    let mut direct = StoreExperts::new(&f.store);
    let read = |src: &mut dyn ExpertSource, experts: &[usize]| {
        let mut got = vec![Vec::new(); experts.len()];
        src.begin(layer, experts).unwrap();
        src.drain(&mut |i, rec| {
            got[i] = rec.to_vec();
            Ok(())
        })
        .unwrap();
        got
    };
    let want = read(&mut direct, &[0, 1, 2, 3]);
    assert_eq!(read(&mut src, &[0, 1, 2, 3]), want);
    assert!((0..4).all(|e| src.is_cached(layer, e)));
    let slot = src.slot_bytes as u64;
    // Three slots per layer asked for: whole slots on every MoE layer.
    let lent = src.lend(3 * slot * layers.len() as u64);
    assert_eq!(lent, 3 * slot * layers.len() as u64);
    assert_eq!((0..4).filter(|&e| src.is_cached(layer, e)).count(), 1, "one slot per layer left");
    src.check_idle().unwrap();
    // Lending more than is left lends what is left.
    assert_eq!(src.lend(100 * slot * layers.len() as u64), slot * layers.len() as u64);
    assert!((0..4).all(|e| !src.is_cached(layer, e)));
    assert_eq!(read(&mut src, &[0, 1, 2, 3]), want, "demand reads go on without cache slots");
    assert!((0..4).all(|e| !src.is_cached(layer, e)), "nothing enters a lent cache");
    src.check_idle().unwrap();
    src.take_back();
    src.check_idle().unwrap();
    assert_eq!(read(&mut src, &[0, 1, 2, 3]), want);
    assert!((0..4).all(|e| src.is_cached(layer, e)), "the cache fills again");
    assert_eq!(src.lend(0), 0);
}

/// An I/O thread lost with reads outstanding (it reads and verifies every record) fails that one
/// request with an error, never a hang (the watchdog ends a hung test); the reset after it starts
/// a new thread on a new back-end (the test's fault decorator included), and the next request is
/// served with the tokens of a fault-free run.
#[test]
fn a_lost_io_thread_fails_one_request_and_is_started_again() {
    let _w = Watchdog::start("lost I/O thread");
    let f = fixture(false);
    for backend in backends() {
        let rules = Arc::new(Mutex::new(Rules::default()));
        let mut src = source(&f, backend, 4, false, &rules);
        src.kill_io_thread_for_tests();
        let err = run(&f, &mut src).expect_err("a request whose reads were lost succeeded");
        assert!(format!("{err:#}").contains("I/O thread stopped"), "{backend:?}: {err:#}");
        src.reset();
        src.check_idle().unwrap();
        assert_eq!(src.faults().io_restarts, 1, "{backend:?}");
        // The restarted thread reads through the same decorator: a read it fails is retried.
        {
            let mut r = rules.lock().unwrap();
            r.nth = Some(r.submitted);
        }
        recovers(&f, &mut src, "after the I/O thread was lost");
        assert_eq!(rules.lock().unwrap().failed, 1, "{backend:?}: the new back-end lost its decorator");
        assert_eq!(src.faults().io_restarts, 1, "{backend:?}: restarted again without a loss");
    }
}

/// Passes everything to `inner` and panics at the `at`-th `begin` (a bug inside a prompt), so
/// a test can see what the panic leaves behind. Counts the bytes lent and the take-backs.
struct PanicAt<'a> {
    inner: &'a mut StreamingExperts,
    begins: usize,
    at: usize,
    lent: u64,
    taken_back: usize,
}

impl ExpertSource for PanicAt<'_> {
    fn begin(&mut self, layer: usize, experts: &[usize]) -> anyhow::Result<()> {
        self.begins += 1;
        if self.begins == self.at {
            panic!("injected panic at begin {}", self.at);
        }
        self.inner.begin(layer, experts)
    }
    fn drain(&mut self, f: &mut dyn FnMut(usize, &[u8]) -> anyhow::Result<()>) -> anyhow::Result<()> {
        self.inner.drain(f)
    }
    fn prefetch(&mut self, layer: usize, experts: &[usize]) -> anyhow::Result<()> {
        self.inner.prefetch(layer, experts)
    }
    fn bytes_read(&self) -> u64 {
        self.inner.bytes_read()
    }
    fn reset(&mut self) {
        self.inner.reset()
    }
    fn faults(&self) -> FaultStats {
        self.inner.faults()
    }
    fn read_ahead(&mut self, layer: usize) {
        self.inner.read_ahead(layer)
    }
    fn lend(&mut self, bytes: u64) -> u64 {
        let lent = self.inner.lend(bytes);
        self.lent += lent;
        lent
    }
    fn take_back(&mut self) {
        self.taken_back += 1;
        self.inner.take_back()
    }
}

/// A panic in the middle of a long prompt that borrowed the cache's memory gives that memory
/// back on the way out (a guard in `generate::run`): after the server's clean-up (`reset`) the
/// cache holds as many records as before, and the next request's tokens are a fault-free run's.
#[test]
fn a_panic_inside_a_borrowing_prompt_gives_the_cache_back() {
    let _w = Watchdog::start("panic while lent");
    let f = fixture(false);
    let layers = f.model.config.moe_layers();
    let rules = Arc::new(Mutex::new(Rules::default()));
    let mut src = source(&f, BackendKind::Pread, 4, false, &rules);
    let slot = src.slot_bytes as u64;
    // Chunks of 2 tokens unless the prompt borrows: then as large as the borrowed slots allow.
    let run = RunConfig {
        prefill_chunk: 2,
        prompt_borrowing: Some(PromptBorrowing { max_chunk: 64, token_bytes: slot }),
        ..Default::default()
    };
    let model = K3Model::load(&f.store, &run).unwrap();
    assert!(f.prompt.len() > 2, "the fixture's longest prompt must be longer than one chunk");
    let mut panicking = PanicAt { inner: &mut src, begins: 0, at: 2, lent: 0, taken_back: 0 };
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        generate_greedy(&model, &mut panicking, &f.prompt, 6, None).map(|_| ())
    }));
    assert!(outcome.is_err(), "the injected panic did not happen");
    assert!(panicking.lent > 0, "the prompt borrowed nothing: the test would not test the guard");
    assert_eq!(panicking.taken_back, 1, "the lent cache was not given back on the panic's way out");
    src.reset();
    src.check_idle().unwrap();
    // Every MoE layer holds its 4 slots again: 4 experts read are 4 cached.
    let layer = layers[0];
    src.begin(layer, &[0, 1, 2, 3]).unwrap();
    src.drain(&mut |_, _| Ok(())).unwrap();
    assert!((0..4).all(|e| src.is_cached(layer, e)), "the cache did not get its slots back");
    recovers(&f, &mut src, "after a panic while the cache was lent");
}

/// A large chunk's read-ahead fills the layer's free cache room and no more, leaves the demand's
/// buffers free, and its records serve the demand as hits.
#[test]
fn read_ahead_fills_free_cache_room_and_serves_the_demand() {
    let _w = Watchdog::start("read-ahead");
    let f = fixture(false);
    let layer = f.model.config.moe_layers()[0];
    let rules = Arc::new(Mutex::new(Rules::default()));
    let mut src = source(&f, BackendKind::Pread, 3, false, &rules);
    src.read_ahead(layer);
    src.read_ahead(layer);
    src.finish_prefetches().unwrap();
    assert!((0..3).all(|e| src.is_cached(layer, e)), "the three free slots filled");
    assert!(!src.is_cached(layer, 3), "no more than the room");
    let t = src.total_stats();
    assert_eq!((t.read_ahead, t.prefetch_reads), (3, 3), "a second call found no room");
    let mut direct = StoreExperts::new(&f.store);
    let experts = [0, 1, 2, 3, 4];
    let read = |src: &mut dyn ExpertSource| {
        let mut got = vec![Vec::new(); experts.len()];
        src.begin(layer, &experts).unwrap();
        src.drain(&mut |i, rec| {
            got[i] = rec.to_vec();
            Ok(())
        })
        .unwrap();
        got
    };
    assert_eq!(read(&mut src), read(&mut direct));
    let t = src.total_stats();
    assert_eq!((t.hits, t.prefetch_used, t.demand_reads), (3, 3, 2));
    // The three were read ahead, not found in the cache: none of them is a cache hit.
    assert_eq!(t.cache_hits, 0);
    src.check_idle().unwrap();
}

/// A streamed spine's back-end that fails (its wait errs) fails the step reading that layer,
/// and the loader builds a new back-end, through the same decorator, for the next: before,
/// the loader thread ended and every later step failed with "spine loader stopped".
#[test]
fn a_failed_spine_back_end_fails_one_step_and_is_replaced() {
    use deltafin_engine::stream::spine::SpineStreamer;
    let f = fixture(false);
    let layers: Vec<usize> = (0..f.model.config.num_hidden_layers).collect();
    for backend in backends() {
        let _w = Watchdog::start("a failed spine back-end");
        let rules = Arc::new(Mutex::new(Rules::default()));
        let r = rules.clone();
        let mut s = SpineStreamer::start_wrapped(
            &f.store,
            layers.clone(),
            Some(backend),
            None,
            image_len(),
            Box::new(move |inner| Box::new(Faulty { inner, rules: r.clone(), doomed: Vec::new() })),
        )
        .unwrap();
        let lens: Vec<usize> = layers.iter().map(|&l| s.get(l).unwrap().0).collect();
        for restarts in 1..=2u64 {
            rules.lock().unwrap().fail_waits = 1;
            // A step (one pass over the layers) fails where the loader's next wait failed ...
            let mut failed = None;
            for _ in 0..3 {
                for &l in &layers {
                    match s.get(l) {
                        Ok(n) => assert_eq!(n.0, lens[l], "{backend:?}: layer {l}"),
                        Err(e) => {
                            let f = e.chain().find_map(|c| c.downcast_ref::<SpineFault>());
                            let f = f.unwrap_or_else(|| panic!("{backend:?}: not a spine fault: {e:#}"));
                            assert!(f.detail.0.contains("injected back-end failure"), "{backend:?}: {f:?}");
                            failed = Some(e.to_string());
                        }
                    }
                }
                if failed.is_some() {
                    break;
                }
            }
            let e = failed.unwrap_or_else(|| panic!("{backend:?}: no step failed"));
            assert!(e.contains("reading spine layer"), "{backend:?}: not a spine fault: {e}");
            // ... and the next steps are served by a new back-end, which has the decorator: the
            // second round's failure is injected through it.
            for _ in 0..2 {
                for &l in &layers {
                    let n = s.get(l).unwrap_or_else(|e| panic!("{backend:?}: after the failure, layer {l}: {e:#}"));
                    assert_eq!(n.0, lens[l]);
                }
            }
            assert_eq!(s.counters.restarts.load(Ordering::Relaxed), restarts, "{backend:?}");
        }
    }
}

/// A decoded layer that keeps a view of its image through [`ImageViews::rebind`] (a block
/// whose new matrix was left out of the rebinding) is not kept by the loader: it would hold its
/// buffer for good, and with both buffers held the loader would wait forever. It is decoded
/// afresh for every read instead, and every read still serves the right bytes.
#[test]
fn a_layer_that_keeps_a_view_is_decoded_afresh_and_never_stalls_the_loader() {
    use deltafin_engine::stream::spine::{DecodeLayer, ImageViews, SpineStreamer};
    use deltafin_store::ImageBytes;
    struct Stuck(Arc<dyn ImageBytes>, usize);
    impl ImageViews for Stuck {
        fn rebind(&mut self, _to: &Arc<dyn ImageBytes>) {}
    }
    let f = fixture(false);
    let layers: Vec<usize> = (0..f.model.config.num_hidden_layers).collect();
    for backend in backends() {
        let _w = Watchdog::start("a layer that keeps a view");
        let decode: DecodeLayer<Stuck> = Box::new(|img, _l| Ok(Stuck(img.image.clone(), img.len)));
        let mut s = SpineStreamer::start(&f.store, layers.clone(), Some(backend), None, decode).unwrap();
        let first: Vec<Vec<u8>> = layers.iter().map(|&l| s.get(l).unwrap().0.bytes().to_vec()).collect();
        let rounds = 4;
        for _ in 0..rounds {
            for &l in &layers {
                let got = s.get(l).unwrap();
                assert_eq!(got.1, first[l].len(), "{backend:?}: layer {l}");
                assert!(got.0.bytes() == first[l].as_slice(), "{backend:?}: layer {l}'s image");
            }
        }
        let reads = ((rounds + 1) * layers.len()) as u64;
        assert!(s.counters.decoded.load(Ordering::Relaxed) >= reads, "{backend:?}: every read decoded");
        assert_eq!(s.counters.rebound.load(Ordering::Relaxed), 0, "{backend:?}: nothing kept");
    }
}

/// A chunk that fails part-way (a demand read that keeps failing, through the real back-end)
/// leaves its state marked: a later step on it and saving it as a prompt state are refused,
/// where before they went on from layers advanced by different numbers of tokens. A stop
/// between layers leaves the same mark; a fresh state is served as if nothing happened.
#[test]
fn a_failed_chunk_leaves_its_state_unusable() {
    use deltafin_engine::prefix_store::PrefixStore;
    let _w = Watchdog::start("a failed chunk");
    let f = fixture(false);
    assert!(f.prompt.len() >= 4, "the fixture's longest prompt must hold two chunks of 2");
    let rules = Arc::new(Mutex::new(Rules::default()));
    let mut src = source(&f, BackendKind::Pread, 4, false, &rules);
    let m = &f.model;
    let mut logits = vec![0f32; m.config.vocab_size];
    let dir = tempfile::tempdir().unwrap();
    let mut states = PrefixStore::open(dir.path(), 1 << 30, 7).unwrap();

    let mut st = m.new_state();
    m.forward_chunk(&mut st, &mut src, &f.prompt[..2], &mut logits).unwrap();
    assert!(!st.is_part_way());
    rules.lock().unwrap().all_urgent = true;
    let e = m.forward_chunk(&mut st, &mut src, &f.prompt[2..4], &mut logits).unwrap_err();
    fault_of(&e);
    rules.lock().unwrap().all_urgent = false;
    assert!(st.is_part_way(), "a failed chunk left its state looking whole");
    let e = m.forward_chunk(&mut st, &mut src, &f.prompt[2..4], &mut logits).unwrap_err();
    assert!(format!("{e:#}").contains("part-way"), "{e:#}");
    let e = states.save(&f.prompt[..2], &st, &logits).unwrap_err();
    assert!(e.to_string().contains("part-way"), "{e}");

    // A stop between layers marks the state the same way.
    let mut st = m.new_state();
    src.reset();
    let whole = m.forward_chunk_with(&mut st, &mut src, &f.prompt[..2], &mut logits, &mut |_| false).unwrap();
    assert!(!whole && st.is_part_way());
    assert!(m.forward_chunk(&mut st, &mut src, &f.prompt[2..4], &mut logits).is_err());

    src.reset();
    recovers(&f, &mut src, "a failed chunk");
}
