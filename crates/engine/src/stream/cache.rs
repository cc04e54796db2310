//! Expert cache policies, one per MoE layer. The same code runs the live cache (values are
//! buffer ids) and the offline trace replay of `deltafin trace stats` (values are `()`), so the
//! policy we measure is the policy we run.

use std::collections::HashMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// Least recently used.
    Lru,
    /// Segmented LRU: new entries are probationary; a second use promotes them to a protected
    /// segment (80% of capacity), so one-off experts cannot flush the reused ones.
    Slru,
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "lru" => Ok(Policy::Lru),
            "slru" => Ok(Policy::Slru),
            _ => Err(format!("unknown cache policy '{s}' (expected lru or slru)")),
        }
    }
}

#[derive(Debug, Clone)]
struct Entry<V> {
    value: V,
    last_use: u64,
    protected: bool,
    pins: u32,
}

/// The cache of one layer: expert id -> value, at most `capacity` entries.
#[derive(Debug, Clone)]
pub struct LayerCache<V> {
    pub capacity: usize,
    policy: Policy,
    entries: HashMap<usize, Entry<V>>,
    clock: u64,
}

impl<V: Clone> LayerCache<V> {
    pub fn new(capacity: usize, policy: Policy) -> Self {
        LayerCache { capacity, policy, entries: HashMap::new(), clock: 0 }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn contains(&self, expert: usize) -> bool {
        self.entries.contains_key(&expert)
    }

    /// A demand access: returns the value on a hit and records the use.
    pub fn get(&mut self, expert: usize) -> Option<V> {
        self.clock += 1;
        let clock = self.clock;
        let e = self.entries.get_mut(&expert)?;
        e.last_use = clock;
        if self.policy == Policy::Slru && !e.protected {
            e.protected = true;
            self.rebalance();
        }
        self.entries.get(&expert).map(|e| e.value.clone())
    }

    pub fn pin(&mut self, expert: usize) {
        if let Some(e) = self.entries.get_mut(&expert) {
            e.pins += 1;
        }
    }

    pub fn unpin(&mut self, expert: usize) {
        if let Some(e) = self.entries.get_mut(&expert) {
            e.pins = e.pins.saturating_sub(1);
        }
    }

    /// Keep the protected segment within 80% of capacity by demoting its least recent entries.
    fn rebalance(&mut self) {
        let max_protected = (self.capacity * 4 / 5).max(1);
        loop {
            // One pass: how many are protected, and the least recent of them.
            let (mut count, mut oldest) = (0usize, None::<(u64, usize)>);
            for (&k, e) in self.entries.iter().filter(|(_, e)| e.protected) {
                count += 1;
                if oldest.is_none_or(|(t, _)| e.last_use < t) {
                    oldest = Some((e.last_use, k));
                }
            }
            if count <= max_protected {
                return;
            }
            match oldest.and_then(|(_, k)| self.entries.get_mut(&k)) {
                Some(e) => e.protected = false,
                None => return,
            }
        }
    }

    /// The entry to evict: least recent unpinned probationary entry, else least recent unpinned.
    fn victim(&self) -> Option<usize> {
        let pick = |want_probation: bool| {
            self.entries
                .iter()
                .filter(|(_, e)| e.pins == 0 && (!want_probation || !e.protected))
                .min_by_key(|(k, e)| (e.last_use, **k))
                .map(|(&k, _)| k)
        };
        match self.policy {
            Policy::Lru => pick(false),
            Policy::Slru => pick(true).or_else(|| pick(false)),
        }
    }

    /// Set the capacity to `capacity`, evicting least valuable unpinned entries (appended to
    /// `evicted`) until it holds no more; pinned entries beyond it stay until unpinned.
    pub fn resize(&mut self, capacity: usize, evicted: &mut Vec<V>) {
        self.capacity = capacity;
        while self.entries.len() > capacity {
            let Some(e) = self.victim().and_then(|k| self.entries.remove(&k)) else { break };
            evicted.push(e.value);
        }
        if self.policy == Policy::Slru {
            self.rebalance();
        }
    }

    /// Insert `expert`, appending evicted values (to be recycled) to `evicted`; gives `value`
    /// back in `Err` when there is no room (capacity 0, or every entry pinned).
    pub fn insert(&mut self, expert: usize, value: V, evicted: &mut Vec<V>) -> Result<(), V> {
        if self.capacity == 0 {
            return Err(value);
        }
        if let Some(old) = self.entries.remove(&expert) {
            evicted.push(old.value);
        }
        while self.entries.len() >= self.capacity {
            match self.victim() {
                Some(k) => {
                    if let Some(e) = self.entries.remove(&k) {
                        evicted.push(e.value);
                    }
                }
                None => return Err(value),
            }
        }
        self.clock += 1;
        self.entries.insert(expert, Entry { value, last_use: self.clock, protected: false, pins: 0 });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_least_recent() {
        let mut c = LayerCache::new(2, Policy::Lru);
        let ev = &mut Vec::new();
        c.insert(1, (), ev).unwrap();
        c.insert(2, (), ev).unwrap();
        assert!(c.get(1).is_some());
        c.insert(3, (), ev).unwrap();
        assert!(c.contains(1) && c.contains(3) && !c.contains(2));
    }

    #[test]
    fn slru_protects_reused_entries_from_a_scan() {
        let mut c = LayerCache::new(4, Policy::Slru);
        let ev = &mut Vec::new();
        for e in [1, 2] {
            c.insert(e, (), ev).unwrap();
            c.get(e);
        }
        for e in 10..20 {
            c.insert(e, (), ev).unwrap();
        }
        assert!(c.contains(1) && c.contains(2), "reused experts survive a one-off scan");
        let mut l = LayerCache::new(4, Policy::Lru);
        for e in [1, 2] {
            l.insert(e, (), ev).unwrap();
            l.get(e);
        }
        for e in 10..20 {
            l.insert(e, (), ev).unwrap();
        }
        assert!(!l.contains(1) && !l.contains(2), "plain LRU is flushed by the scan");
    }

    #[test]
    fn resizing_evicts_the_least_recent_and_keeps_the_pinned() {
        let mut c = LayerCache::new(4, Policy::Lru);
        let mut ev = Vec::new();
        for e in 1..=4 {
            c.insert(e, e * 10, &mut ev).unwrap();
        }
        c.get(1);
        c.pin(2);
        c.resize(2, &mut ev);
        assert_eq!((c.len(), c.capacity), (2, 2));
        assert!(c.contains(1) && c.contains(2), "the recent and the pinned stay");
        assert_eq!(ev, vec![30, 40]);
        c.resize(0, &mut ev);
        assert!(c.contains(2) && c.len() == 1, "a pinned entry outlives a resize to zero");
        assert_eq!(c.insert(5, 50, &mut ev), Err(50));
        c.resize(4, &mut ev);
        assert_eq!(c.insert(5, 50, &mut ev), Ok(()));
    }

    #[test]
    fn pinned_entries_are_never_evicted() {
        let mut c = LayerCache::new(1, Policy::Lru);
        let mut ev = Vec::new();
        c.insert(1, 10, &mut ev).unwrap();
        c.pin(1);
        assert_eq!(c.insert(2, 20, &mut ev), Err(20));
        c.unpin(1);
        assert_eq!(c.insert(2, 20, &mut ev), Ok(()));
        assert_eq!(ev, vec![10]);
        let mut z: LayerCache<u32> = LayerCache::new(0, Policy::Slru);
        assert_eq!(z.insert(5, 1, &mut ev), Err(1));
    }
}
