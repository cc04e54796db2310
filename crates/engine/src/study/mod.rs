//! Research instruments, off the serving path: router traces (recorded while generating, replayed
//! through the cache policies offline) and routing overrides (replay a trace, or synthetic
//! locality) for cache studies on stores whose random routers are uniform.

pub mod routing;
pub mod trace;
