//! One macro for "the same body, compiled twice": a portable instantiation (the oracle) and an
//! AVX2+FMA one chosen at run time. The body must be `#[inline(always)]` so each instantiation
//! is compiled with its own target features.

macro_rules! dispatch {
    ($name:ident, $scalar:ident, $avx2:ident, $body:ident, ($($arg:ident : $ty:ty),*)) => {
        /// Run-time dispatched entry point (AVX2 when the CPU has it).
        #[allow(clippy::too_many_arguments)]
        pub fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            if crate::cpu::has_avx2_fma() {
                // SAFETY: the CPU supports AVX2 and FMA.
                unsafe { $avx2($($arg),*) };
                return;
            }
            $body($($arg),*)
        }

        /// The portable path: the oracle the vectorised instantiation is tested against.
        #[allow(clippy::too_many_arguments)]
        pub fn $scalar($($arg: $ty),*) {
            $body($($arg),*)
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $avx2($($arg: $ty),*) {
            $body($($arg),*)
        }
    };
}

pub(crate) use dispatch;
