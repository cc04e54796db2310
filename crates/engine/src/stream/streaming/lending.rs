//! A long prompt borrows the expert cache's memory for its chunk's activations: cache slots are
//! given up on every layer and their buffers' pages handed back to the system, then restored
//! when the prompt ends (`generate::LentCache` takes them back on every way out).

use super::StreamingExperts;

impl StreamingExperts {
    /// Lend about `bytes` of cache memory; returns the bytes lent (whole slots on every layer).
    pub(super) fn lend_cache(&mut self, bytes: u64) -> u64 {
        if self.demand.is_some() || bytes == 0 {
            return 0;
        }
        let layers = self.locs.len().max(1);
        let slot = self.slot_bytes as u64;
        let left = self.opts.cache_slots_per_layer - self.lent_per_layer;
        let per_layer = (bytes.div_ceil(slot) as usize).div_ceil(layers).min(left);
        if per_layer == 0 {
            return 0;
        }
        // Prefetches in flight land first (their buffers can then be lent), and what waits for
        // a layer is given up with the rest of the cache.
        if let Err(e) = self.finish_prefetches() {
            tracing::warn!("prefetches before lending the cache: {e:#}");
        }
        self.pending_prefetch.clear();
        self.free.extend(self.landed.drain().map(|(_, b)| b));
        let capacity = left - per_layer;
        let mut evicted = Vec::new();
        for cache in self.caches.values_mut() {
            cache.resize(capacity, &mut evicted);
        }
        for b in evicted {
            self.prefetched_unused[b] = false;
            self.free.push(b);
        }
        self.lent_per_layer += per_layer;
        let mut lent = 0;
        while lent < per_layer * layers {
            let Some(b) = self.free.pop() else { break };
            if !self.bufs[b].release_pages() {
                // The system keeps the pages: lending it would count memory twice.
                self.free.push(b);
                break;
            }
            self.lent.push(b);
            lent += 1;
        }
        lent as u64 * slot
    }

    /// Give the cache its slots and buffers back.
    pub(super) fn take_back_cache(&mut self) {
        let capacity = self.opts.cache_slots_per_layer;
        let mut evicted = Vec::new();
        for cache in self.caches.values_mut() {
            cache.resize(capacity, &mut evicted);
        }
        self.free.append(&mut evicted);
        self.free.append(&mut self.lent);
        self.lent_per_layer = 0;
    }
}
