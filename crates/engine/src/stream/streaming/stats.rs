//! The source's counters, per MoE layer: demand accesses and how each was served (the cache's
//! own hits, a prefetch or read-ahead used, one adopted in flight), and the reads issued.

use std::time::Duration;

use serde::Serialize;

use super::StreamingExperts;

#[derive(Debug, Clone, Default, Serialize)]
pub struct LayerStats {
    /// Demand accesses.
    pub accesses: u64,
    /// Demand accesses served from memory without a demand read (cache or a prefetch).
    pub hits: u64,
    /// Of `hits`, those found in the cache where no prefetch or read-ahead had put them unused:
    /// the cache's own hits, what `hit_rate` reports.
    pub cache_hits: u64,
    /// Of `hits`, those that adopted a prefetch or read-ahead still in flight (the demand waited
    /// for a read that speculation had started).
    pub adopted: u64,
    /// Demand reads issued.
    pub demand_reads: u64,
    pub prefetch_reads: u64,
    /// Prefetched records that a demand later used.
    pub prefetch_used: u64,
    /// Of the prefetch reads, those a large prompt chunk read ahead into free cache room.
    pub read_ahead: u64,
    pub bytes_read: u64,
}

impl StreamingExperts {
    /// Start the counters afresh (a warm run measures its second generation alone); the
    /// cache and everything in flight are untouched.
    pub fn clear_stats(&mut self) {
        self.stats.clear();
        self.io_wait = Duration::ZERO;
        self.verify_time = Duration::ZERO;
        self.bytes_verified = 0;
    }

    pub fn total_stats(&self) -> LayerStats {
        let mut t = LayerStats::default();
        for s in self.stats.values() {
            t.accesses += s.accesses;
            t.hits += s.hits;
            t.cache_hits += s.cache_hits;
            t.adopted += s.adopted;
            t.demand_reads += s.demand_reads;
            t.prefetch_reads += s.prefetch_reads;
            t.prefetch_used += s.prefetch_used;
            t.read_ahead += s.read_ahead;
            t.bytes_read += s.bytes_read;
        }
        t
    }
}
