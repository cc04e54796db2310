//! Run-time CPU feature detection, cached.

use std::sync::OnceLock;

/// Whether the AVX2 + FMA kernels may run.
pub fn has_avx2_fma() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// The kernel path in use, for reports.
pub fn kernel_path() -> &'static str {
    if has_avx2_fma() { "avx2+fma" } else { "scalar" }
}
