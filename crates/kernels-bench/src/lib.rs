//! The kernels' criterion benchmarks (`cargo bench -p deltafin-kernels-bench`), in a crate of
//! their own: criterion and its dependencies are then built only for them, not for every build
//! of `deltafin-kernels`' tests (CI cross-builds those for aarch64 and runs them under qemu).
