//! Deltafin's installs from an origin (the Hugging Face Hub, a Hub-compatible endpoint, or a
//! plain HTTP mirror of a snapshot): full and streaming installs, the upgrade from one to the
//! other, on-demand expert fetches for streaming stores, and warmup from router traces.
//!
//! - [`remote`]: origins, and pinning a revision's file list to one commit.
//! - [`http`]: ranged GETs checked to the byte, with retries.
//! - [`ranges`], [`fill`], [`download`]: the range scheduler, its crash-safe fill logs.
//! - [`layout`]: where an installed store keeps its files (a Hub cache inside the store).
//! - [`install`]: `deltafin install` (full, stream, upgrade).
//! - [`fetcher`]: fetching a streaming store's experts on first use.
//! - [`warmup`]: `deltafin warmup`.

pub mod download;
pub mod fetcher;
pub mod fill;
pub mod http;
pub mod install;
pub mod layout;
pub mod ranges;
pub mod remote;
pub mod warmup;
