//! A layer's demand: the experts the router chose, served from the cache, from a prefetch (one
//! that landed, or one still in flight, adopted) or by a demand read started at once, and handed
//! to compute in the order they become available.

use std::collections::VecDeque;

use anyhow::{Result, bail};

use super::StreamingExperts;
use crate::stream::cache::LayerCache;

#[derive(Default)]
pub(super) struct Demand {
    pub layer: usize,
    pub experts: Vec<usize>,
    /// Buffer of each expert once available.
    pub ready: Vec<Option<usize>>,
    /// Whether that buffer is owned by the cache (pinned) rather than by this demand.
    pub cached: Vec<bool>,
    pub delivered: Vec<bool>,
    /// Misses waiting for a free buffer (a prompt chunk can need more experts than there are
    /// I/O buffers); started as delivered records free theirs.
    pub queued: VecDeque<usize>,
}

impl StreamingExperts {
    /// Announce `layer`'s demand: hits are pinned, misses start reading at once (or queue for a
    /// buffer).
    pub(super) fn begin_demand(&mut self, layer: usize, experts: &[usize]) -> Result<()> {
        if self.demand.is_some() {
            bail!("expert source: begin() called twice without drain()");
        }
        // Checked before anything is pinned or read, so a refusal leaves nothing behind.
        for (i, e) in experts.iter().enumerate() {
            if experts[..i].contains(e) {
                bail!("expert {e} of layer {layer} requested twice in one step");
            }
            self.location(layer, *e)?;
        }
        self.ensure_present(layer, experts)?;
        // Speculation for this layer or earlier ones is stale now: drop what was not submitted.
        self.pending_prefetch.retain(|&(l, _)| l > layer);
        let n = experts.len();
        let mut d = self.spare_demand.take().unwrap_or_default();
        d.layer = layer;
        d.experts.clear();
        d.experts.extend_from_slice(experts);
        d.ready.clear();
        d.ready.resize(n, None);
        d.cached.clear();
        d.cached.resize(n, false);
        d.delivered.clear();
        d.delivered.resize(n, false);
        d.queued.clear();
        let mut misses = std::mem::take(&mut self.misses_buf);
        misses.clear();
        for (i, &e) in experts.iter().enumerate() {
            self.stats.entry(layer).or_default().accesses += 1;
            if let Some(b) = self.landed.remove(&(layer, e)) {
                // A prefetch that landed outside the cache: used from its buffer, then cached
                // or freed like a fresh read.
                d.ready[i] = Some(b);
                let st = self.stats.entry(layer).or_default();
                st.hits += 1;
                st.prefetch_used += 1;
            } else if let Some(b) = self.cache(layer).get(e) {
                self.cache(layer).pin(e);
                d.ready[i] = Some(b);
                d.cached[i] = true;
                let prefetched = std::mem::take(&mut self.prefetched_unused[b]);
                let st = self.stats.entry(layer).or_default();
                st.hits += 1;
                if prefetched {
                    st.prefetch_used += 1;
                } else {
                    st.cache_hits += 1;
                }
            } else if let Some(&id) = self.by_key.get(&(layer, e)) {
                // A prefetch is already reading it: adopt that read, and have what of it still
                // waits for the device go ahead of the other guesses.
                if let Some(f) = self.flights.get_mut(&id)
                    && !f.demanded
                {
                    f.demanded = true;
                    if let Some(io) = self.io.as_ref() {
                        io.urge(id);
                    }
                }
                let st = self.stats.entry(layer).or_default();
                st.hits += 1;
                st.adopted += 1;
                st.prefetch_used += 1;
            } else {
                misses.push(e);
            }
        }
        self.demand = Some(d);
        // Landed prefetches of this layer that were not asked for, or of earlier layers, were
        // wrong guesses: their buffers go back.
        let free = &mut self.free;
        self.landed.retain(|k, b| {
            let keep = k.0 > layer;
            if !keep {
                free.push(*b);
            }
            keep
        });
        for &e in &misses {
            if self.free.is_empty() {
                if let Some(d) = self.demand.as_mut() {
                    d.queued.push_back(e);
                }
            } else {
                self.start_read((layer, e), true)?;
            }
        }
        self.misses_buf = misses;
        Ok(())
    }

    /// Hand every demanded record to `f` as it becomes available.
    pub(super) fn drain_demand(&mut self, f: &mut dyn FnMut(usize, &[u8]) -> Result<()>) -> Result<()> {
        let Some(d) = self.demand.as_ref() else { bail!("expert source: drain() without begin()") };
        let layer = d.layer;
        let rb = self.record_bytes;
        // Records already in memory first, in order, while the reads are in flight.
        let mut queue = std::mem::take(&mut self.queue_buf);
        queue.clear();
        queue.extend(d.ready.iter().enumerate().filter_map(|(i, b)| b.map(|b| (i, b))));
        loop {
            for (i, b) in queue.drain(..) {
                let s = self.data_start[b];
                f(i, &self.bufs[b].as_slice()[s..s + rb])?;
                self.settle(i)?;
            }
            let all = self.demand.as_ref().is_some_and(|d| d.delivered.iter().all(|&x| x));
            if all {
                break;
            }
            // Buffers freed by prefetches that landed let waiting misses start.
            self.start_queued()?;
            if self.flights.is_empty() {
                // Waiting would never end: a demand that nothing is reading.
                self.queue_buf = queue;
                bail!("expert source: layer {layer} waits for records that no read will deliver");
            }
            self.reap(&mut queue)?;
        }
        self.queue_buf = queue;
        self.spare_demand = self.demand.take();
        self.pump_prefetch()
    }

    /// After demand record `i` was used: a cache hit is unpinned; a fresh record enters the
    /// cache (or its buffer is freed), and a waiting miss can start in the freed buffer.
    fn settle(&mut self, i: usize) -> Result<()> {
        let Some(d) = self.demand.as_mut() else { bail!("demand vanished") };
        d.delivered[i] = true;
        let (layer, e, cached, b) = (d.layer, d.experts[i], d.cached[i], d.ready[i]);
        match (cached, b) {
            (true, _) => self.cache(layer).unpin(e),
            (false, Some(b)) => {
                let policy = self.opts.policy;
                let cache = self.caches.entry(layer).or_insert_with(|| LayerCache::new(0, policy));
                if let Err(b) = cache.insert(e, b, &mut self.free) {
                    self.free.push(b);
                }
            }
            (false, None) => {}
        }
        self.start_queued()
    }

    /// Start the demand's misses that wait for a buffer, while buffers are free.
    fn start_queued(&mut self) -> Result<()> {
        while !self.free.is_empty() {
            let Some((layer, next)) = self.demand.as_mut().and_then(|d| d.queued.pop_front().map(|e| (d.layer, e)))
            else {
                break;
            };
            self.start_read((layer, next), true)?;
        }
        Ok(())
    }
}
