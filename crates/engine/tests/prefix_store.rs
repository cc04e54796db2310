//! The prefix-state store on disk: a prompt resumes from the longest stored prefix with the
//! logits it would have computed from scratch, bit for bit, also after a restart (a new store
//! over the same directory) and with two conversations interleaved; torn, corrupt and
//! interrupted snapshots are detected, deleted and never used; eviction is least recently used
//! within the budget; another model's identity is never served.

mod common;

use common::*;
use deltafin_engine::experts::StoreExperts;
use deltafin_engine::k3::{K3Model, K3State, RunConfig};
use deltafin_engine::prefix_store::PrefixStore;
use deltafin_store::{ExpertLayout, SpineDtype, Store};

struct Fixture {
    _dir: tempfile::TempDir,
    store: Store,
}

fn fixture() -> Fixture {
    let dir = convert_fixture("k3-small", SpineDtype::Int8, 0, ExpertLayout::Pack);
    let store = Store::open(dir.path(), None).unwrap();
    Fixture { _dir: dir, store }
}

/// Logits and state after `tokens` from scratch.
fn run(model: &K3Model, store: &Store, tokens: &[u32]) -> (K3State, Vec<f32>) {
    let mut src = StoreExperts::new(store);
    let (mut st, mut logits) = (model.new_state(), vec![0f32; model.config.vocab_size]);
    model.forward_chunk(&mut st, &mut src, tokens, &mut logits).unwrap();
    (st, logits)
}

/// Resume `prompt` from `ps` and compute the rest; returns (tokens taken from the store, logits).
fn resume(ps: &mut PrefixStore, model: &K3Model, store: &Store, prompt: &[u32]) -> (usize, Vec<f32>) {
    let (mut st, mut logits) = (model.new_state(), vec![0f32; model.config.vocab_size]);
    let got = ps.restore_longest(prompt, prompt.len() - 1, &mut st, &mut logits).unwrap_or(0);
    if got == 0 {
        st = model.new_state();
    }
    let mut src = StoreExperts::new(store);
    model.forward_chunk(&mut st, &mut src, &prompt[got..], &mut logits).unwrap();
    (got, logits)
}

fn conversation(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + seed * 101) % 250 + 3).collect()
}

#[test]
fn prompts_resume_bit_for_bit_across_restarts_and_interleaved_conversations() {
    let f = fixture();
    let model = K3Model::load(&f.store, &RunConfig::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (conversation(1, 40), conversation(2, 40));
    {
        let mut ps = PrefixStore::open(dir.path(), 1 << 30, 42).unwrap();
        // Two conversations, their first turns stored in turn.
        for conv in [&a, &b] {
            let (st, logits) = run(&model, &f.store, &conv[..20]);
            ps.save(&conv[..20], &st, &logits).unwrap();
        }
        assert_eq!(ps.held().0, 2);
        // Interleaved follow-ups: each resumes from its own 20 tokens and matches from scratch.
        for conv in [&a, &b, &a] {
            let (got, logits) = resume(&mut ps, &model, &f.store, &conv[..30]);
            assert_eq!(got, 20);
            assert!(same(&logits, &run(&model, &f.store, &conv[..30]).1));
        }
        assert_eq!((ps.counters.hits, ps.counters.misses), (3, 0));
    }
    // A restart: a new store over the same directory serves them, and a deeper snapshot wins.
    let mut ps = PrefixStore::open(dir.path(), 1 << 30, 42).unwrap();
    let (st, logits) = run(&model, &f.store, &a[..30]);
    ps.save(&a[..30], &st, &logits).unwrap();
    // The process ends (dropping the store waits for the write its thread is doing).
    drop(ps);
    let mut ps = PrefixStore::open(dir.path(), 1 << 30, 42).unwrap();
    let (got, logits) = resume(&mut ps, &model, &f.store, &a);
    assert_eq!(got, 30);
    assert!(same(&logits, &run(&model, &f.store, &a).1));
    // Another model identity sees none of them; a prompt that shares no stored prefix misses.
    let mut other = PrefixStore::open(dir.path(), 1 << 30, 43).unwrap();
    assert_eq!(resume(&mut other, &model, &f.store, &a).0, 0);
    assert_eq!(resume(&mut ps, &model, &f.store, &conversation(3, 25)).0, 0);
}

#[test]
fn torn_corrupt_and_interrupted_snapshots_are_never_used() {
    let f = fixture();
    let model = K3Model::load(&f.store, &RunConfig::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let a = conversation(1, 40);
    let mut ps = PrefixStore::open(dir.path(), 1 << 30, 7).unwrap();
    for n in [10, 20, 30] {
        let (st, logits) = run(&model, &f.store, &a[..n]);
        ps.save(&a[..n], &st, &logits).unwrap();
    }
    // The last write runs on its own thread: its file is in place once flushed.
    ps.flush().unwrap();
    let file = |n: usize| {
        std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.to_string_lossy().ends_with(&format!("-{n}.dfstate")))
            .unwrap()
    };
    // The deepest is torn (cut short, as a crash of a store without the rename would leave
    // it), the next has a flipped bit: both are refused, deleted, and the 10-token one serves.
    let torn = file(30);
    let len = std::fs::metadata(&torn).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&torn).unwrap().set_len(len / 2).unwrap();
    let flipped = file(20);
    let mut bytes = std::fs::read(&flipped).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    std::fs::write(&flipped, bytes).unwrap();
    // An interrupted write leaves a temporary file that nobody holds locked: the next open
    // deletes it. One that is locked (here by a handle this test holds, as another process's
    // write in progress in a shared directory would be) is kept, as is the lock.
    let tmp = |n: u32| dir.path().join(format!("0000000000000007-000000000000000{n}-5.41-1-0.dfstate-tmp"));
    let (stale, writing) = (tmp(1), tmp(2));
    let unnamed = dir.path().join("0000000000000007-0000000000000004-5.dfstate-tmp"); // an older version's
    for p in [&stale, &writing, &unnamed] {
        std::fs::write(p, b"half a snap").unwrap();
    }
    let writer = std::fs::File::options().write(true).open(&writing).unwrap();
    writer.lock().unwrap();
    let mut ps = PrefixStore::open(dir.path(), 1 << 30, 7).unwrap();
    assert!(!stale.exists() && !unnamed.exists() && writing.exists());
    drop(writer);
    PrefixStore::open(dir.path(), 1 << 30, 7).unwrap();
    assert!(!writing.exists(), "unlocked once its writer is done");
    let (got, logits) = resume(&mut ps, &model, &f.store, &a);
    assert_eq!(got, 10);
    assert!(same(&logits, &run(&model, &f.store, &a).1));
    assert_eq!(ps.counters.dropped, 2);
    assert!(!torn.exists() && !flipped.exists());
    assert_eq!(ps.held().0, 1);
    // A snapshot another process evicted behind this store's back is forgotten: not counted as
    // dropped (nothing was wrong with it), no longer counted in the budget.
    std::fs::remove_file(file(10)).unwrap();
    let (got, _) = resume(&mut ps, &model, &f.store, &a);
    assert_eq!((got, ps.counters.dropped, ps.held().0), (0, 2, 0));
}

#[test]
fn eviction_is_least_recently_used_within_the_budget() {
    let f = fixture();
    let model = K3Model::load(&f.store, &RunConfig::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let convs: Vec<Vec<u32>> = (1..=3).map(|s| conversation(s, 24)).collect();
    // Measure one snapshot, then allow two.
    let size = {
        let mut ps = PrefixStore::open(&dir.path().join("probe"), 1 << 30, 1).unwrap();
        let (st, logits) = run(&model, &f.store, &convs[0][..16]);
        ps.save(&convs[0][..16], &st, &logits).unwrap();
        ps.held().1
    };
    let mut ps = PrefixStore::open(dir.path(), 2 * size + size / 2, 1).unwrap();
    for c in &convs[..2] {
        let (st, logits) = run(&model, &f.store, &c[..16]);
        ps.save(&c[..16], &st, &logits).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Using the first makes the second the least recent: the third evicts it.
    assert_eq!(resume(&mut ps, &model, &f.store, &convs[0]).0, 16);
    std::thread::sleep(std::time::Duration::from_millis(20));
    let (st, logits) = run(&model, &f.store, &convs[2][..16]);
    ps.save(&convs[2][..16], &st, &logits).unwrap();
    assert_eq!(ps.counters.evictions, 1);
    assert!(ps.held().1 <= 2 * size + size / 2);
    assert_eq!(resume(&mut ps, &model, &f.store, &convs[1]).0, 0, "the least recently used was kept");
    assert_eq!(resume(&mut ps, &model, &f.store, &convs[0]).0, 16);
    assert_eq!(resume(&mut ps, &model, &f.store, &convs[2]).0, 16);
    // Recency survives a restart: after reopening with room for one, the last used stays.
    let mut ps = PrefixStore::open(dir.path(), size + size / 2, 1).unwrap();
    assert_eq!(ps.held().0, 1);
    assert_eq!(resume(&mut ps, &model, &f.store, &convs[2]).0, 16);
}

#[test]
fn a_failed_background_write_is_reported_and_keeps_nothing() {
    let f = fixture();
    let model = K3Model::load(&f.store, &RunConfig::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let states = dir.path().join("states");
    let a = conversation(1, 24);
    let mut ps = PrefixStore::open(&states, 1 << 30, 9).unwrap();
    // The directory vanishes under the store: the writer thread cannot create its file.
    std::fs::remove_dir_all(&states).unwrap();
    let (st, logits) = run(&model, &f.store, &a[..16]);
    ps.save(&a[..16], &st, &logits).unwrap();
    let err = ps.flush().expect_err("the write could not have succeeded");
    assert_eq!(err.kind(), std::io::ErrorKind::NotFound, "{err}");
    assert_eq!((ps.counters.write_errors, ps.counters.snapshots_written, ps.held().0), (1, 0, 0));
    // The buffer came back: the next save writes once the directory is there again.
    std::fs::create_dir_all(&states).unwrap();
    ps.save(&a[..16], &st, &logits).unwrap();
    ps.flush().unwrap();
    assert_eq!((ps.counters.snapshots_written, ps.held().0), (1, 1));
    let (got, logits) = resume(&mut ps, &model, &f.store, &a);
    assert_eq!(got, 16);
    assert!(same(&logits, &run(&model, &f.store, &a).1));
}
