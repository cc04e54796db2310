//! Reads nobody waits for yet: the router's look-ahead hints for the next layer (prefetch, in
//! at most `prefetch_buffers` buffers) and a large prompt chunk's read-ahead of a layer's
//! experts into free cache room. Both are guesses: a fault or a refusal costs only the read.

use anyhow::Result;

use super::StreamingExperts;

impl StreamingExperts {
    /// Queue prefetches of `layer`'s likely experts and start what the prefetch room allows.
    pub(super) fn hint_prefetch(&mut self, layer: usize, experts: &[usize]) -> Result<()> {
        if self.opts.prefetch_buffers == 0 {
            return Ok(());
        }
        let mut absent = std::mem::take(&mut self.misses_buf);
        absent.clear();
        for &e in experts {
            if self.location(layer, e).is_err() {
                // A hint about an expert the store does not have: nothing to read.
                continue;
            }
            if !self.present(layer, e) {
                // Not fetched yet: the fetcher may fetch it in the background; nothing to read.
                absent.push(e);
                continue;
            }
            let key = (layer, e);
            if !self.is_cached(layer, e) && !self.by_key.contains_key(&key) && !self.pending_prefetch.contains(&key) {
                self.pending_prefetch.push_back(key);
            }
        }
        if let Some(f) = self.fetcher.as_ref().filter(|_| !absent.is_empty()) {
            f.hint(layer, &absent);
        }
        self.misses_buf = absent;
        self.pump_prefetch()
    }

    /// Submit queued prefetches while prefetch buffers are available.
    pub(super) fn pump_prefetch(&mut self) -> Result<()> {
        while self.prefetch_in_flight + self.landed.len() < self.opts.prefetch_buffers && !self.free.is_empty() {
            let Some(key) = self.pending_prefetch.pop_front() else {
                break;
            };
            if self.is_cached(key.0, key.1) || self.by_key.contains_key(&key) || self.landed.contains_key(&key) {
                continue;
            }
            if let Err(e) = self.start_read(key, false) {
                // A prefetch is only a guess: a read that cannot start costs nothing else.
                tracing::warn!("prefetch of layer {} expert {} not started: {e:#}", key.0, key.1);
                break;
            }
        }
        Ok(())
    }

    /// Between a prompt chunk's layers: read `layer`'s experts into its free cache room (the
    /// demand's own buffers stay free).
    pub(super) fn read_ahead_into_cache(&mut self, layer: usize) {
        if self.demand.is_some() {
            return;
        }
        let Some(cache) = self.caches.get(&layer) else { return };
        let reading = self.flights.values().filter(|f| f.key.0 == layer && !f.demanded).count();
        let mut room = cache.capacity.saturating_sub(cache.len() + reading);
        let experts = self.locs.get(&layer).map_or(0, |v| v.len());
        for e in 0..experts {
            if room == 0 || self.free.len() <= self.opts.io_buffers {
                break;
            }
            let key = (layer, e);
            if self.is_cached(layer, e)
                || self.by_key.contains_key(&key)
                || self.landed.contains_key(&key)
                || !self.present(layer, e)
            {
                continue;
            }
            if let Err(err) = self.start_read(key, false) {
                tracing::warn!("read-ahead of layer {layer} expert {e} not started: {err:#}");
                break;
            }
            self.stats.entry(layer).or_default().read_ahead += 1;
            room -= 1;
        }
    }
}
