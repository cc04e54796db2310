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

    /// The best path this CPU has, or the one `DELTAFIN_KERNEL_PATH` asks for where this CPU has
    /// it (to measure or compare a narrower path on a wider CPU: `DELTAFIN_KERNEL_PATH=avx2`).
    /// A request that names no path, or one this CPU lacks, is ignored here; the command line
    /// refuses it at start ([`requested_path`]).
    pub fn best() -> Path {
        static BEST: OnceLock<Path> = OnceLock::new();
        *BEST.get_or_init(|| match requested_path() {
            Ok(Some(p)) if p.available() => p,
            _ => Path::detected(),
        })
    }

    /// The best path this CPU has, whatever was requested.
    pub fn detected() -> Path {
        [Path::Avx512, Path::Avx2, Path::Neon].into_iter().find(|p| p.available()).unwrap_or(Path::Scalar)
    }

    pub fn name(self) -> &'static str {
        match self {
            Path::Avx512 => "avx512",
            Path::Avx2 => "avx2+fma",
            Path::Neon => "neon",
            Path::Scalar => "scalar",
        }
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
    Path::best().name()
}

/// The path `DELTAFIN_KERNEL_PATH` names (`avx512`, `avx2`, `neon` or `scalar`), `None` where it
/// is unset, and an error where it names no path or one this CPU lacks.
pub fn requested_path() -> Result<Option<Path>, String> {
    let Ok(v) = std::env::var("DELTAFIN_KERNEL_PATH") else { return Ok(None) };
    let p = match v.as_str() {
        "avx512" => Path::Avx512,
        "avx2" | "avx2+fma" => Path::Avx2,
        "neon" => Path::Neon,
        "scalar" => Path::Scalar,
        o => return Err(format!("DELTAFIN_KERNEL_PATH={o} names no kernel path (avx512, avx2, neon or scalar)")),
    };
    if !p.available() {
        return Err(format!("DELTAFIN_KERNEL_PATH={v}: this CPU lacks it (its best is {})", Path::detected().name()));
    }
    Ok(Some(p))
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
