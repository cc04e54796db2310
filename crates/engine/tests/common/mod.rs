//! Shared helpers for the engine's integration tests: fixture paths, conversion into temp stores,
//! and the reference outputs recorded by mlx-lm 0.32.2 (`tools/make_fixtures.py`).
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use deltafin_store::convert::{ConvertOptions, convert};
use deltafin_store::{ExpertLayout, SpineDtype};
use serde::Deserialize;

pub const FIXTURES: [&str; 2] = ["k3-tiny", "k3-small"];

pub fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name)
}

#[derive(Deserialize)]
pub struct RefPrompt {
    pub tokens: Vec<u32>,
    pub last_logits: Vec<f32>,
    pub greedy: Vec<u32>,
}

#[derive(Deserialize)]
pub struct Reference {
    pub prompts: Vec<RefPrompt>,
    pub all_logits_17: Vec<Vec<f32>>,
}

pub fn reference(name: &str) -> Reference {
    let p = fixture_dir(name).join("reference.json");
    serde_json::from_str(&std::fs::read_to_string(&p).expect("read reference.json")).expect("parse reference.json")
}

/// Convert a fixture into a fresh temporary store.
pub fn convert_fixture(name: &str, spine: SpineDtype, int8_group: usize, experts: ExpertLayout) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = ConvertOptions { spine: spine.into(), int8_group, experts, progress: false, ..Default::default() };
    convert(&fixture_dir(name).join("hf"), dir.path(), &opts).expect("convert");
    dir
}

/// Max absolute difference divided by max |reference|.
/// Bit for bit the same floats (NaNs and signed zeros included).
pub fn same(x: &[f32], y: &[f32]) -> bool {
    x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
}

pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let d = got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    let s = want.iter().fold(0f32, |m, b| m.max(b.abs()));
    d / s
}

/// Copy a directory tree (fixture checkpoints are small).
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let p = e.path();
        if p.is_dir() {
            copy_dir(&p, &to.join(e.file_name()));
        } else {
            std::fs::copy(&p, to.join(e.file_name())).unwrap();
        }
    }
}

/// Whether this test runs its io_uring part: where the kernel refuses a ring it prints SKIPPED
/// and returns false, unless `DELTAFIN_REQUIRE_IO_URING=1` (set by `scripts/test.sh` where a
/// ring was granted), when the test fails.
pub fn uring_or_skip(what: &str) -> bool {
    deltafin_engine::stream::backend::io_uring_for_tests(what).unwrap_or_else(|e| panic!("{e}"))
}

/// The read back-ends this machine offers: pread always; io_uring when the kernel grants a ring
/// (reported as skipped otherwise, and a failure where it is required).
pub fn backends() -> Vec<deltafin_engine::stream::reader::BackendKind> {
    use deltafin_engine::stream::reader::BackendKind;
    if uring_or_skip("io_uring back-end") {
        vec![BackendKind::IoUring, BackendKind::Pread]
    } else {
        vec![BackendKind::Pread]
    }
}

/// What a test of the spine loader alone decodes a layer image into: the image's length (it
/// keeps no view of the image).
pub struct ImageLen(pub usize);

impl deltafin_engine::stream::spine::ImageViews for ImageLen {
    fn rebind(&mut self, _to: &std::sync::Arc<dyn deltafin_store::ImageBytes>) {}
}

/// The loader's decode function for [`ImageLen`].
pub fn image_len() -> deltafin_engine::stream::spine::DecodeLayer<ImageLen> {
    Box::new(|img, _l| Ok(ImageLen(img.len)))
}
