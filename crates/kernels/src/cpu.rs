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

/// Whether the AVX-512 (F + BW) kernels may run.
pub fn has_avx512() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Whether the AVX-512 VNNI (+VL) integer dot-product kernels (approximate mode) may run.
pub fn has_avx512_vnni() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            has_avx512() && std::is_x86_feature_detected!("avx512vnni") && std::is_x86_feature_detected!("avx512vl")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// A kernel implementation, for tests and benchmarks that pin one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    Scalar,
    Avx2,
    Avx512,
}

impl Path {
    pub const ALL: [Path; 3] = [Path::Scalar, Path::Avx2, Path::Avx512];

    pub fn available(self) -> bool {
        match self {
            Path::Scalar => true,
            Path::Avx2 => has_avx2_fma(),
            Path::Avx512 => has_avx512() && has_avx2_fma(),
        }
    }

    /// The best path this CPU has.
    pub fn best() -> Path {
        if Path::Avx512.available() {
            Path::Avx512
        } else if Path::Avx2.available() {
            Path::Avx2
        } else {
            Path::Scalar
        }
    }
}

/// The kernel path in use, for reports.
pub fn kernel_path() -> &'static str {
    match Path::best() {
        Path::Avx512 => "avx512",
        Path::Avx2 => "avx2+fma",
        Path::Scalar => "scalar",
    }
}
