//! What the GPU tests share: opening the adapter they run on.
//!
//! Any adapter, a CPU-type one included (Mesa's llvmpipe in CI, chosen on purpose);
//! `DELTAFIN_GPU_ADAPTER` picks one by name. Where none opens, a test prints SKIPPED and returns,
//! unless DELTAFIN_REQUIRE_GPU=1 (scripts/test.sh sets it after installing Mesa's Vulkan
//! driver): then it fails.

use deltafin_gpu::{Gpu, GpuOptions};

pub fn gpu(test: &str) -> Option<Gpu> {
    let opts = GpuOptions { allow_software: true, name: std::env::var("DELTAFIN_GPU_ADAPTER").ok() };
    match Gpu::open(&opts) {
        Ok(g) => {
            eprintln!("{test}: on {}", g.adapter());
            Some(g)
        }
        Err(e) if std::env::var("DELTAFIN_REQUIRE_GPU").as_deref() == Ok("1") => {
            panic!("{test}: DELTAFIN_REQUIRE_GPU=1 but no GPU adapter opened: {e}")
        }
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            None
        }
    }
}
