//! The record checksum's speed: XXH3-64 of one Kimi K3 expert record (17,547,264 bytes) through
//! the store's `checksum` module (twox-hash, AVX2 or NEON chosen at run time) and through
//! xxhash-rust (instruction set fixed at compile time: SSE2 in a portable x86-64 build), in
//! cache (one buffer) and from memory (eight buffers in turn, 140 MB, beyond the caches).
//!
//!     cargo bench -p deltafin-store --bench checksum

use criterion::{Criterion, Throughput, criterion_group, criterion_main};

const RECORD: usize = 17_547_264;

fn checksum(c: &mut Criterion) {
    let bufs: Vec<Vec<u8>> =
        (0..8u8).map(|k| (0..RECORD).map(|i| (i as u8).wrapping_mul(31).wrapping_add(k)).collect()).collect();
    let mut g = c.benchmark_group("record_checksum");
    g.throughput(Throughput::Bytes(RECORD as u64));
    g.sample_size(20);
    g.bench_function("twox-hash, in cache", |b| b.iter(|| deltafin_store::checksum::xxh3_64(&bufs[0])));
    g.bench_function("xxhash-rust, in cache", |b| b.iter(|| xxhash_rust::xxh3::xxh3_64(&bufs[0])));
    let mut i = 0;
    g.bench_function("twox-hash, from memory", |b| {
        b.iter(|| {
            i = (i + 1) % bufs.len();
            deltafin_store::checksum::xxh3_64(&bufs[i])
        })
    });
    g.bench_function("xxhash-rust, from memory", |b| {
        b.iter(|| {
            i = (i + 1) % bufs.len();
            xxhash_rust::xxh3::xxh3_64(&bufs[i])
        })
    });
    g.finish();
}

criterion_group!(benches, checksum);
criterion_main!(benches);
