//! Layer 1: run-time CPU feature detection (cached) and the one kernel-path enum, [`Path`].
//! Imports nothing from the crate.
//!
//! Every dispatched operation comes as `op_on(path, ..)`, which runs `path`'s kernel (falling back
//! where `path` is unavailable here or has no kernel for the arguments), and `op(..)`, which is
//! `op_on(Path::best(), ..)`. Finer capabilities inside a path are queries, not paths: AVX-512
//! VNNI is [`has_avx512_vnni`] within [`Path::Avx512`].

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

/// Whether the NEON `sdot` kernel (FEAT_DotProd; every Apple M-series core) may run.
pub fn has_neon_dotprod() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "aarch64")]
        {
            std::arch::is_aarch64_feature_detected!("neon") && std::arch::is_aarch64_feature_detected!("dotprod")
        }
        #[cfg(not(target_arch = "aarch64"))]
        {
            false
        }
    })
}

/// A kernel implementation: an instruction set, or the portable scalar code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    Scalar,
    Avx2,
    Avx512,
    Neon,
}

impl Path {
    pub const ALL: [Path; 4] = [Path::Scalar, Path::Avx2, Path::Avx512, Path::Neon];

    pub fn available(self) -> bool {
        match self {
            Path::Scalar => true,
            Path::Avx2 => has_avx2_fma(),
            Path::Avx512 => has_avx512() && has_avx2_fma(),
            Path::Neon => has_neon(),
        }
    }

    /// The best path this CPU has.
    pub fn best() -> Path {
        [Path::Avx512, Path::Avx2, Path::Neon].into_iter().find(|p| p.available()).unwrap_or(Path::Scalar)
    }

    /// `self` where this CPU has it, else [`Path::Scalar`]: what every `op_on` matches on.
    /// (An available [`Path::Avx512`] implies AVX2 and FMA, so its ops may use AVX2 kernels.)
    pub fn or_scalar(self) -> Path {
        if self.available() { self } else { Path::Scalar }
    }
}

/// Whether the NEON kernels may run (aarch64 always has NEON; checked all the same).
pub fn has_neon() -> bool {
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("neon")
    }
    #[cfg(not(target_arch = "aarch64"))]
    {
        false
    }
}

/// The kernel path in use, for reports.
pub fn kernel_path() -> &'static str {
    match Path::best() {
        Path::Avx512 => "avx512",
        Path::Avx2 => "avx2+fma",
        Path::Neon => "neon",
        Path::Scalar => "scalar",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_fall_back_to_scalar_and_the_best_is_available() {
        assert!(Path::best().available());
        assert_eq!(Path::best().or_scalar(), Path::best());
        for path in Path::ALL {
            let want = if path.available() { path } else { Path::Scalar };
            assert_eq!(path.or_scalar(), want);
        }
        // The AVX-512 path's kernels may use AVX2 + FMA, and VNNI is a capability within it.
        assert!(!Path::Avx512.available() || Path::Avx2.available());
        assert!(!has_avx512_vnni() || has_avx512());
    }
}
