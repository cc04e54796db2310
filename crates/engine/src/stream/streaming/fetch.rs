//! A streaming store (`install --mode stream`) holds only some records: an absent one is looked
//! up again, then fetched from the origin before any read of it starts, or refused offline.

use std::sync::Arc;

use anyhow::{Result, bail};
use deltafin_store::presence::{ExpertFetcher, FetchStats};

use super::StreamingExperts;
use crate::fault::FetchFault;

impl StreamingExperts {
    /// Let this source fetch a streaming store's absent records on first use (without one,
    /// an absent record ends the step with an error that says how to fetch it).
    pub fn set_fetcher(&mut self, fetcher: Option<Arc<dyn ExpertFetcher>>) {
        self.fetcher = fetcher;
    }

    /// What the fetcher has done, when this source has one, once its background fetches have
    /// landed.
    pub fn fetch_stats(&self) -> Option<FetchStats> {
        self.fetcher.as_ref().map(|f| {
            f.settle();
            f.stats()
        })
    }

    /// Experts on disk, of all, in a streaming store.
    pub fn presence_count(&self) -> Option<(usize, usize)> {
        self.presence.as_ref().map(|p| p.count())
    }

    /// Whether (layer, expert) is on disk (always, outside streaming stores).
    pub(super) fn present(&self, layer: usize, expert: usize) -> bool {
        self.presence.as_ref().is_none_or(|p| p.get(layer, expert).is_some())
    }

    /// Make every listed record of `layer` present before a read of it starts: absent ones are
    /// looked up on disk again (another process may have fetched them), then fetched, all at
    /// once; without a fetcher an absent record is an error naming how to fetch it.
    pub(super) fn ensure_present(&mut self, layer: usize, experts: &[usize]) -> Result<()> {
        let Some(p) = &self.presence else { return Ok(()) };
        let mut absent = Vec::new();
        for &e in experts {
            if p.get(layer, e).is_none() && p.refresh(layer, e)?.is_none() {
                absent.push(e);
            }
        }
        if absent.is_empty() {
            return Ok(());
        }
        let fault = |offline: bool, detail: String| FetchFault {
            layer,
            expert: absent[0],
            count: absent.len(),
            experts: absent.clone(),
            offline,
            detail,
        };
        let Some(f) = &self.fetcher else {
            return Err(fault(true, String::new()).into());
        };
        f.fetch(layer, &absent).map_err(|e| fault(false, e.to_string()))?;
        if let Some(&e) = absent.iter().find(|&&e| p.get(layer, e).is_none()) {
            bail!("layer {layer} expert {e}: the fetcher returned without making it present");
        }
        Ok(())
    }
}
