//! The raw read probe ends cleanly when a read fails while others are in flight: its buffers
//! outlive the back-end, whose drop waits for those reads (run under valgrind, the old order
//! showed writes into freed buffers).

mod common;

use common::*;
use deltafin_engine::stream::probe::raw_read_bandwidth;
use deltafin_engine::stream::reader::BackendKind;
use deltafin_store::{ExpertLayout, SpineDtype, Store};

#[test]
fn a_failed_read_ends_the_probe_cleanly() {
    let dir = convert_fixture("k3-small", SpineDtype::Int8, 0, ExpertLayout::Pack);
    let store = Store::open(dir.path(), None).unwrap();
    // Cut every layer file to a tenth: most records now read past the end.
    for l in store.manifest.config.moe_layers() {
        let f = dir.path().join(format!("experts/layer-{l:03}.bin"));
        let len = std::fs::metadata(&f).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&f).unwrap().set_len(len / 10).unwrap();
    }
    for _ in 0..20 {
        let err = raw_read_bandwidth(&store, Some(BackendKind::Pread), 16, 2000, 7, false).unwrap_err();
        assert!(format!("{err:#}").contains("read"), "{err:#}");
    }
}
