//! The harness shared by the fuzz tests of the store, text and server crates (`tests/fuzz.rs` of
//! each; the others include this file by path).
//!
//! The fuzzers are proptest properties, not cargo-fuzz targets, so they run on the stable
//! toolchain in every `cargo test`. Each target first replays every file of its corpus,
//! `fixtures/fuzz/<target>/` (valid seeds, crafted bad inputs and every input that found a bug),
//! then runs generated and mutated cases: a small number by default (CI), or
//! `DELTAFIN_FUZZ_CASES=N` to run long. Every target prints its executions.
//!
//! A case passes when the code under test returns (an error is fine) without panicking and
//! without any single allocation above [`MAX_ALLOC`]: the inputs are small, so a larger request
//! means a length taken from the input was trusted. Requests above [`HARD_CAP`] are refused
//! outright (the process aborts with "memory allocation failed") rather than risk the machine.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::time::Instant;

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestRunner};
use serde_json::Value;

/// Largest single allocation a case may make.
pub const MAX_ALLOC: usize = 256 << 20;
/// Allocations above this fail at once.
pub const HARD_CAP: usize = 4 << 30;

/// The system allocator, recording the largest request of each thread.
pub struct CapAlloc;

thread_local! {
    // Const-initialised and without a destructor: reading it never allocates, so the allocator
    // may use it.
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) -> bool {
    let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
    size <= HARD_CAP
}

// SAFETY: every method forwards to `System` with the caller's own arguments, under the same
// contract; refusing a request by returning null is allowed by `GlobalAlloc`.
unsafe impl GlobalAlloc for CapAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !note(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's layout, passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !note(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's layout, passed on unchanged.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with this layout (every allocation above did).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !note(new_size) {
            return std::ptr::null_mut();
        }
        // SAFETY: `ptr` came from `System` with `layout`; the caller upholds `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Run one case, failing it if it made an allocation above [`MAX_ALLOC`].
pub fn bounded<T>(f: impl FnOnce() -> T) -> Result<T, TestCaseError> {
    LARGEST.with(|l| l.set(0));
    let out = f();
    let largest = LARGEST.with(|l| l.get());
    if largest > MAX_ALLOC {
        return Err(TestCaseError::fail(format!("a single allocation of {largest} bytes (limit {MAX_ALLOC})")));
    }
    Ok(out)
}

/// Generated cases per target: `DELTAFIN_FUZZ_CASES`, else `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var("DELTAFIN_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Every file of `fixtures/fuzz/<target>/`, sorted by name.
pub fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/fuzz").join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .map(|e| e.expect("corpus entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "corpus {} is empty", dir.display());
    files.into_iter().map(|p| (p.clone(), std::fs::read(&p).expect("corpus file"))).collect()
}

/// Replay the corpus of `target` through `check`, then run `default_cases` (or
/// `DELTAFIN_FUZZ_CASES`) generated cases of `strategy`; print the executions.
pub fn fuzz<S: Strategy>(
    target: &str,
    default_cases: u32,
    strategy: S,
    check: impl Fn(&S::Value) -> Result<(), TestCaseError>,
    replay: impl Fn(&[u8]) -> Result<(), TestCaseError>,
) {
    let start = Instant::now();
    let seeds = corpus(target);
    for (path, bytes) in &seeds {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| replay(bytes))) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("{target}: corpus file {} fails: {e}", path.display()),
            Err(_) => panic!("{target}: corpus file {} panics (message above)", path.display()),
        }
    }
    let n = cases(default_cases);
    let config = Config {
        cases: n,
        // Failures are kept in fixtures/fuzz by hand, with a name saying what they found.
        failure_persistence: None,
        max_shrink_iters: 4096,
        ..Config::default()
    };
    let executed = Cell::new(0u64);
    let result = TestRunner::new(config).run(&strategy, |v| {
        executed.set(executed.get() + 1);
        check(&v)
    });
    eprintln!(
        "fuzz {target}: {} corpus files + {} executions (incl. shrinking) in {:.1} s",
        seeds.len(),
        executed.get(),
        start.elapsed().as_secs_f64()
    );
    if let Err(e) = result {
        panic!("{target}: {e}");
    }
}

/// One edit of a byte string; positions are fractions of the length at the time.
#[derive(Debug, Clone)]
pub enum ByteOp {
    Flip(Index, u8),
    Set(Index, u8),
    Insert(Index, Vec<u8>),
    Remove(Index, usize),
    Truncate(Index),
    /// Overwrite 8 bytes with a little-endian value (a length or offset field).
    U64(Index, u64),
    /// Duplicate a slice in place (repeated structure).
    Repeat(Index, usize, usize),
}

/// Values that break arithmetic: zero, edges, powers of two, the top of each width.
pub fn interesting_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(7),
        Just(8),
        Just(255),
        Just(4096),
        Just(100_000_000),
        Just(100_000_001),
        Just(u32::MAX as u64),
        Just(1 << 32),
        Just(1 << 40),
        Just(1 << 60),
        Just(i64::MAX as u64),
        Just(u64::MAX - 1),
        Just(u64::MAX),
        (0u32..64).prop_map(|s| 1u64 << s),
        any::<u64>(),
    ]
}

pub fn byte_op() -> impl Strategy<Value = ByteOp> {
    prop_oneof![
        4 => (any::<Index>(), 1u8..).prop_map(|(i, x)| ByteOp::Flip(i, x)),
        2 => (any::<Index>(), any::<u8>()).prop_map(|(i, b)| ByteOp::Set(i, b)),
        2 => (any::<Index>(), prop::collection::vec(any::<u8>(), 1..16)).prop_map(|(i, b)| ByteOp::Insert(i, b)),
        2 => (any::<Index>(), 1usize..64).prop_map(|(i, n)| ByteOp::Remove(i, n)),
        1 => any::<Index>().prop_map(ByteOp::Truncate),
        2 => (any::<Index>(), interesting_u64()).prop_map(|(i, v)| ByteOp::U64(i, v)),
        1 => (any::<Index>(), 1usize..64, 1usize..8).prop_map(|(i, n, k)| ByteOp::Repeat(i, n, k)),
    ]
}

pub fn byte_ops(max: usize) -> impl Strategy<Value = Vec<ByteOp>> {
    prop::collection::vec(byte_op(), 1..=max)
}

pub fn apply_bytes(b: &mut Vec<u8>, ops: &[ByteOp]) {
    for op in ops {
        let len = b.len();
        let at = |i: &Index| if len == 0 { 0 } else { i.index(len) };
        match op {
            ByteOp::Flip(i, x) if len > 0 => b[at(i)] ^= x,
            ByteOp::Set(i, v) if len > 0 => b[at(i)] = *v,
            ByteOp::Insert(i, bytes) => {
                let p = if len == 0 { 0 } else { i.index(len + 1) };
                b.splice(p..p, bytes.iter().copied());
            }
            ByteOp::Remove(i, n) if len > 0 => {
                let p = at(i);
                b.drain(p..(p + n).min(len));
            }
            ByteOp::Truncate(i) => b.truncate(if len == 0 { 0 } else { i.index(len + 1) }),
            ByteOp::U64(i, v) if len >= 8 => {
                let p = i.index(len - 7);
                b[p..p + 8].copy_from_slice(&v.to_le_bytes());
            }
            ByteOp::Repeat(i, n, k) if len > 0 => {
                let p = at(i);
                let piece = b[p..(p + n).min(len)].to_vec();
                for _ in 0..*k {
                    b.splice(p..p, piece.iter().copied());
                }
            }
            _ => {}
        }
    }
}

/// One edit of a JSON document, at the node of that pre-order position (modulo the count).
#[derive(Debug, Clone)]
pub enum JsonOp {
    Replace(Index, Value),
    /// Remove an object member or array element.
    Remove(Index),
    /// Duplicate an array element, or copy a member under a new key.
    Duplicate(Index, String),
    /// Swap the node with another node's value.
    Swap(Index, Index),
}

/// Numbers that break sizes and arithmetic: zero, negatives, huge, fractional, beyond 64 bits.
pub fn interesting_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        interesting_u64().prop_map(Value::from),
        Just(Value::from(-1)),
        Just(Value::from(i64::MIN)),
        Just(Value::from(0.5)),
        Just(Value::from(-0.0)),
        Just(Value::from(1e300)),
        Just(Value::from(-1e300)),
        Just(Value::from(1e-300)),
        // 2^64 and more: serde_json's f64 for integers past u64.
        Just(serde_json::from_str::<Value>("18446744073709551616").expect("number")),
        Just(serde_json::from_str::<Value>("1e400").unwrap_or(Value::Null)),
        (-100i64..100).prop_map(Value::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
    ]
}

/// JSON values over the given vocabulary of keys and strings: arbitrary trees whose keys and
/// strings are mostly ones the parser looks at, so generated inputs get past the first check.
pub fn json_value(keys: &'static [&'static str], strings: &'static [&'static str]) -> BoxedStrategy<Value> {
    let key = prop_oneof![8 => prop::sample::select(keys).prop_map(String::from), 1 => ".{0,8}"];
    let string = prop_oneof![
        6 => prop::sample::select(strings).prop_map(String::from),
        2 => ".{0,24}",
        1 => (prop::sample::select(strings), 1usize..2000).prop_map(|(s, n)| s.repeat(n)),
    ];
    let leaf = prop_oneof![
        1 => Just(Value::Null),
        1 => any::<bool>().prop_map(Value::Bool),
        2 => interesting_number(),
        6 => string.prop_map(Value::String),
    ];
    leaf.prop_recursive(6, 96, 8, move |inner| {
        let key = key.clone();
        prop_oneof![
            2 => prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            3 => prop::collection::vec((key, inner), 0..8)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
    .boxed()
}

pub fn json_op(values: BoxedStrategy<Value>) -> impl Strategy<Value = JsonOp> {
    prop_oneof![
        6 => (any::<Index>(), values).prop_map(|(i, v)| JsonOp::Replace(i, v)),
        2 => any::<Index>().prop_map(JsonOp::Remove),
        1 => (any::<Index>(), "[a-z_]{0,6}").prop_map(|(i, k)| JsonOp::Duplicate(i, k)),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(a, b)| JsonOp::Swap(a, b)),
    ]
}

fn count_nodes(v: &Value) -> usize {
    1 + match v {
        Value::Array(a) => a.iter().map(count_nodes).sum(),
        Value::Object(o) => o.values().map(count_nodes).sum(),
        _ => 0,
    }
}

/// The node at pre-order position `n` (0 = the root).
fn node_mut(v: &mut Value, n: usize) -> Option<&mut Value> {
    if n == 0 {
        return Some(v);
    }
    let mut rest = n - 1;
    let children: Vec<&mut Value> = match v {
        Value::Array(a) => a.iter_mut().collect(),
        Value::Object(o) => o.values_mut().collect(),
        _ => return None,
    };
    for c in children {
        let size = count_nodes(c);
        if rest < size {
            return node_mut(c, rest);
        }
        rest -= size;
    }
    None
}

/// Apply edits to a document (the root itself is never removed).
pub fn apply_json(doc: &mut Value, ops: &[JsonOp]) {
    for op in ops {
        let n = count_nodes(doc);
        match op {
            JsonOp::Replace(i, with) => {
                if let Some(node) = node_mut(doc, i.index(n)) {
                    *node = with.clone();
                }
            }
            JsonOp::Remove(i) | JsonOp::Duplicate(i, _) => {
                // Act on a container: the chosen node's members.
                let Some(node) = node_mut(doc, i.index(n)) else { continue };
                match (node, op) {
                    (Value::Array(a), JsonOp::Remove(_)) if !a.is_empty() => {
                        a.remove(i.index(a.len()));
                    }
                    (Value::Object(o), JsonOp::Remove(_)) if !o.is_empty() => {
                        let k = o.keys().nth(i.index(o.len())).cloned().unwrap_or_default();
                        o.remove(&k);
                    }
                    (Value::Array(a), JsonOp::Duplicate(..)) if !a.is_empty() => {
                        let x = a[i.index(a.len())].clone();
                        a.push(x);
                    }
                    (Value::Object(o), JsonOp::Duplicate(_, key)) if !o.is_empty() => {
                        let x = o.values().nth(i.index(o.len())).cloned().unwrap_or_default();
                        o.insert(key.clone(), x);
                    }
                    _ => {}
                }
            }
            JsonOp::Swap(a, b) => {
                let other = node_mut(doc, b.index(n)).map(|x| x.clone());
                if let (Some(other), Some(node)) = (other, node_mut(doc, a.index(n))) {
                    *node = other;
                }
            }
        }
    }
}
