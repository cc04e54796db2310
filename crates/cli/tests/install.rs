//! `deltafin install` and `warmup` end to end against a real HTTP origin on loopback (the test
//! origin: the Hub's API and URL layout, LFS redirects to a second "CDN" address, injected
//! faults), through the real binary: stream and full installs, first-use fetches, the upgrade,
//! warmup, offline runs, crash safety under kill -9, a moving branch, and clear errors.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use deltafin_store::Store;
use deltafin_test_origin::{Fault, FaultKind, Origin, RepoSpec, Where, default_commit};

const REPO: &str = "org/k3-small";
const PROMPT: &str = "The lighthouse keeper counted the ships";

fn fixture_hf(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name).join("hf")
}

/// The fixture's files, by name, with their bytes.
fn fixture_files(name: &str) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(fixture_hf(name))
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap()))
        .collect()
}

fn snapshot_bytes(name: &str) -> u64 {
    fixture_files(name).values().map(|b| b.len() as u64).sum()
}

fn start_origin(token: Option<&str>, gated: bool) -> Origin {
    Origin::start(vec![RepoSpec {
        repo: REPO.into(),
        dir: fixture_hf("k3-small"),
        branches: vec![("main".into(), default_commit(REPO))],
        token: token.map(str::to_string),
        gated,
    }])
    .expect("start the test origin")
}

/// The binary, with an environment that never reaches the real Hub, its cache or a token.
struct Env {
    home: tempfile::TempDir,
}

impl Env {
    fn new() -> Self {
        Env { home: tempfile::tempdir().unwrap() }
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_deltafin"));
        c.args(args)
            .env("HOME", self.home.path())
            .env("HF_HUB_CACHE", self.home.path().join("hf-cache"))
            .env_remove("HF_HOME")
            .env_remove("HF_TOKEN")
            .env_remove("HF_TOKEN_PATH")
            .env_remove("HF_ENDPOINT")
            .env("DELTAFIN_HTTP_BACKOFF_MS", "20")
            .env("DELTAFIN_HTTP_ATTEMPTS", "8");
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        self.cmd(args).output().expect("spawn deltafin")
    }

    fn ok(&self, args: &[&str]) -> (String, String) {
        let o = self.run(args);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "deltafin {args:?} failed: {err}");
        (String::from_utf8(o.stdout).unwrap(), err)
    }

    fn fails(&self, args: &[&str]) -> String {
        let o = self.run(args);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(!o.status.success(), "deltafin {args:?} should fail: {err}");
        assert!(!err.contains("panicked"), "deltafin {args:?} panicked: {err}");
        err
    }

    fn install(&self, o: &Origin, store: &Path, mode: &str, extra: &[&str]) -> (serde_json::Value, String) {
        let mut args =
            vec!["install", REPO, "--to", store.to_str().unwrap(), "--mode", mode, "--endpoint", &o.endpoint, "--json"];
        args.extend_from_slice(extra);
        let (out, err) = self.ok(&args);
        (serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}")), err)
    }

    /// `generate --json` of `prompt` on `store` (greedy, 6 tokens).
    fn generate(&self, store: &Path, prompt: &str, extra: &[&str]) -> serde_json::Value {
        let mut args = vec!["generate", "--model", store.to_str().unwrap(), "--prompt", prompt, "--max-tokens", "6"];
        args.extend_from_slice(&["--json"]);
        args.extend_from_slice(extra);
        let (out, _) = self.ok(&args);
        serde_json::from_str(out.trim()).unwrap()
    }

    /// Greedy tokens of `prompt` on `store`.
    fn tokens(&self, store: &Path, prompt: &str, extra: &[&str]) -> Vec<u64> {
        let v = self.generate(store, prompt, extra);
        v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()
    }
}

/// The reference: the fixture converted from disk.
fn reference_tokens(env: &Env, prompt: &str) -> Vec<u64> {
    let d = tempfile::tempdir().unwrap();
    env.ok(&["convert", "--from", fixture_hf("k3-small").to_str().unwrap(), "--to", d.path().to_str().unwrap()]);
    env.tokens(d.path(), prompt, &[])
}

fn snapshot_dir(store: &Path) -> PathBuf {
    store.join("hub/models--org--k3-small/snapshots").join(default_commit(REPO))
}

/// Every file of the store's Hub snapshot is byte-identical to the fixture's.
fn assert_snapshot_identical(store: &Path) {
    let snap = snapshot_dir(store);
    for (name, bytes) in fixture_files("k3-small") {
        let got = std::fs::read(snap.join(&name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(got == bytes, "{name} differs from the origin's file");
    }
}

/// Crash-safety invariants of a store at rest: every expert the presence map calls present
/// reads back with its recorded checksum, and every range a fill log calls on disk holds the
/// origin's bytes.
fn assert_consistent(store: &Path) {
    if store.join("manifest.json").exists() {
        let s = Store::open(store, None).unwrap();
        if let Some(p) = s.experts.presence() {
            let mut buf = Vec::new();
            for &l in p.layers() {
                for e in 0..p.experts_per_layer() {
                    if p.get(l, e).is_some() {
                        s.experts.read(l, e, &mut buf).unwrap_or_else(|err| panic!("layer {l} expert {e}: {err}"));
                    }
                }
            }
        }
    }
    let fixture = fixture_files("k3-small");
    let fill = store.join(".deltafin/fill");
    let Ok(entries) = std::fs::read_dir(&fill) else { return };
    let blobs = store.join("hub/models--org--k3-small/blobs");
    for e in entries {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().trim_end_matches(".fill").to_string();
        let log = deltafin_hub::fill::FillLog::open(&e.path()).unwrap();
        let want = &fixture[&name];
        // The file being filled: the partial blob, or the finished one once renamed.
        let data =
            std::fs::read_dir(&blobs).unwrap().map(|b| b.unwrap().path()).filter_map(|p| std::fs::read(&p).ok()).find(
                |d| {
                    d.len() == want.len()
                        && log.have().iter().all(|&(s, t)| d[s as usize..t as usize] == want[s as usize..t as usize])
                },
            );
        assert!(data.is_some() || log.have().is_empty(), "{name}: a logged range does not hold the origin's bytes");
    }
}

/// Every matching body slowed to `bps` bytes per second, on the Hub and the CDN, until cleared.
fn slow(file: &str, bps: u64) -> Fault {
    Fault { file: file.into(), kind: FaultKind::Slow { bytes_per_sec: bps }, times: u32::MAX, on: Where::Both }
}

fn served(o: &Origin) -> u64 {
    o.stats().total_body_bytes()
}

#[test]
fn stream_install_fetches_headers_and_spine_then_each_expert_once() {
    let env = Env::new();
    let o = start_origin(None, false);
    let d = tempfile::tempdir().unwrap();
    let store = d.path().join("s");
    let (report, err) = env.install(&o, &store, "stream", &[]);
    assert!(err.contains("to download") && err.contains("disk needed") && err.contains("free"), "{err}");
    let after_install = served(&o);
    // The client counts what the origin sent, and the API's file list besides.
    let downloaded = report["downloaded"].as_u64().unwrap();
    assert!(downloaded >= after_install && downloaded < after_install + 16384, "{downloaded} vs {after_install}");
    // Headers and spine tensors only: at least the headers and small files, at most the
    // non-expert tensors and a 4 KiB gap per tensor more, so nothing of the routed experts.
    let (mut headers, mut spine, mut experts, mut tensors) = (0u64, 0u64, 0u64, 0u64);
    let mut small = 0u64;
    for (name, bytes) in fixture_files("k3-small") {
        if !name.ends_with(".safetensors") {
            small += bytes.len() as u64;
            continue;
        }
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        headers += 8 + n;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n as usize]).unwrap();
        for (k, v) in header.as_object().unwrap() {
            if k == "__metadata__" {
                continue;
            }
            let off = v["data_offsets"].as_array().unwrap();
            let len = off[1].as_u64().unwrap() - off[0].as_u64().unwrap();
            if k.contains(".experts.") {
                experts += len;
            } else {
                spine += len;
                tensors += 1;
            }
        }
    }
    assert!(after_install >= headers + small, "{after_install} < {headers} + {small}");
    assert!(after_install <= headers + small + spine + 4096 * tensors, "{after_install} bytes for {spine} of spine");
    assert_eq!(headers + small + spine + experts, snapshot_bytes("k3-small"));
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(store.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["streaming"]["presence_file"], "presence.bin");
    assert_eq!(m["origin"]["commit"].as_str().unwrap(), default_commit(REPO));

    // First generate: experts fetched on first use, each once, each a whole record.
    let record = m["experts"]["record_bytes"].as_u64().unwrap();
    let want = reference_tokens(&env, PROMPT);
    let g1 = env.generate(&store, PROMPT, &[]);
    assert_eq!(g1["tokens"], serde_json::json!(want), "a streaming store computes what the converted one does");
    let first = served(&o) - after_install;
    let present = Store::open(&store, None).unwrap().experts.presence().unwrap().count().0 as u64;
    assert!(present > 0 && first == present * record, "{first} bytes for {present} experts of {record}");
    assert_eq!(g1["fetch"]["experts"].as_u64().unwrap(), present, "{g1}");
    assert_eq!(g1["fetch"]["experts_ahead"].as_u64().unwrap(), 0, "fetch-ahead is off by default");
    assert_eq!(g1["fetch"]["bytes_written"].as_u64().unwrap(), present * record);
    // Second generate: nothing from the network; offline too.
    let before = served(&o);
    assert_eq!(env.tokens(&store, PROMPT, &[]), want);
    assert_eq!(served(&o), before, "the second generate fetched again");
    assert_eq!(env.tokens(&store, PROMPT, &["--offline"]), want);
    let first_bytes = first;
    // Offline, a prompt that needs experts not fetched yet is a clear error naming the fix.
    let err = env.fails(&[
        "generate",
        "--model",
        store.to_str().unwrap(),
        "--offline",
        "--prompt",
        "Quartz zebras vexed a wizard's jumpy glyph 0123456789 ~!@#",
        "--max-tokens",
        "30",
    ]);
    assert!(err.contains("offline") && err.contains("warmup") && err.contains("--fetch"), "{err}");
    assert_eq!(served(&o), before, "--offline touched the network");
    assert_consistent(&store);
    // The background path itself, without a run racing it: hinted absent records are fetched,
    // counted as fetched ahead, and present afterwards; present ones are not fetched again.
    let s = Store::open(&store, None).unwrap();
    let p = s.experts.presence().unwrap().clone();
    let split = |l: usize| -> (Vec<usize>, Vec<usize>) {
        let n = p.experts_per_layer();
        (
            (0..n).filter(|&e| p.get(l, e).is_none()).take(2).collect(),
            (0..n).filter(|&e| p.get(l, e).is_some()).take(1).collect(),
        )
    };
    let layer = *p
        .layers()
        .iter()
        .find(|&&l| split(l).0.len() == 2 && split(l).1.len() == 1)
        .expect("a layer with absent and present experts");
    let (absent, known) = split(layer);
    let f = deltafin_hub::fetcher::HubFetcher::open(&s, Some(&o.endpoint), deltafin_hub::http::HttpConfig::default())
        .unwrap()
        .with_fetch_ahead(true);
    use deltafin_store::presence::ExpertFetcher;
    let before = served(&o);
    f.hint(layer, &[absent[0], known[0], absent[1]]);
    wait_for(|| absent.iter().all(|&e| p.refresh(layer, e).unwrap().is_some()));
    f.settle();
    assert_eq!(f.stats().experts_ahead, 2);
    assert_eq!(served(&o) - before, 2 * record);
    drop(f);
    assert_consistent(&store);
    // With --fetch-ahead, a new prompt's predictions may be fetched in the background too (how
    // many depends on timing): every record fetched is still fetched once, and present after.
    let present = Store::open(&store, None).unwrap().experts.presence().unwrap().count().0 as u64;
    let before = served(&o);
    let g3 = env.generate(&store, "Quartz zebras vexed a wizard", &["--fetch-ahead"]);
    let present3 = Store::open(&store, None).unwrap().experts.presence().unwrap().count().0 as u64;
    assert_eq!(g3["fetch"]["experts"].as_u64().unwrap(), present3 - present, "{g3}");
    assert_eq!(served(&o) - before, (present3 - present) * record);
    assert_consistent(&store);

    eprintln!(
        "bytes: stream install {after_install}, first generate {first_bytes} ({present} experts), second generate 0 (snapshot {})",
        snapshot_bytes("k3-small")
    );
}

#[test]
fn full_install_is_a_byte_identical_hub_snapshot_and_a_hub_cache_is_used_in_place() {
    let env = Env::new();
    let o = start_origin(None, false);
    let d = tempfile::tempdir().unwrap();
    let store = d.path().join("full");
    let (report, err) = env.install(&o, &store, "full", &["--no-hub-cache"]);
    assert!(err.contains("is a full store now"), "{err}");
    assert_eq!(served(&o), snapshot_bytes("k3-small"), "a full install fetches every byte exactly once");
    let downloaded = report["downloaded"].as_u64().unwrap();
    assert!(downloaded >= served(&o) && downloaded < served(&o) + 16384, "{downloaded}");
    assert_snapshot_identical(&store);
    let hub = store.join("hub/models--org--k3-small");
    assert_eq!(std::fs::read_to_string(hub.join("refs/main")).unwrap(), default_commit(REPO));
    for e in std::fs::read_dir(hub.join("blobs")).unwrap() {
        let n = e.unwrap().file_name().to_string_lossy().into_owned();
        assert!(!n.ends_with(".deltafin-partial"), "a partial blob is left: {n}");
    }
    // The store is the one `convert` makes of the same checkpoint, and runs offline.
    let conv = tempfile::tempdir().unwrap();
    env.ok(&["convert", "--from", fixture_hf("k3-small").to_str().unwrap(), "--to", conv.path().to_str().unwrap()]);
    let table = |p: &Path| -> serde_json::Value {
        let m: serde_json::Value = serde_json::from_slice(&std::fs::read(p.join("manifest.json")).unwrap()).unwrap();
        m["experts"]["layers"].clone()
    };
    assert_eq!(table(&store), table(conv.path()), "expert checksums and ranges");
    assert_eq!(std::fs::read(store.join("spine.bin")).unwrap(), std::fs::read(conv.path().join("spine.bin")).unwrap());
    assert_eq!(env.tokens(&store, PROMPT, &["--offline"]), env.tokens(conv.path(), PROMPT, &[]));
    assert!(!store.join("presence.bin").exists());

    // A rerun has nothing to do.
    let before = served(&o);
    let (_, err) = env.install(&o, &store, "full", &["--no-hub-cache"]);
    assert!(err.contains("nothing to do"), "{err}");
    assert_eq!(served(&o), before);

    // A snapshot already in a local Hub cache is used in place: no file downloaded.
    let other = d.path().join("from-cache");
    let mut c =
        env.cmd(&["install", REPO, "--to", other.to_str().unwrap(), "--mode", "full", "--endpoint", &o.endpoint]);
    let out = c.env("HF_HUB_CACHE", store.join("hub")).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("using it in place"), "{err}");
    assert_eq!(served(&o), before, "files were downloaded again");
    assert_eq!(env.tokens(&other, PROMPT, &["--offline"]), env.tokens(conv.path(), PROMPT, &[]));
}

#[test]
fn upgrade_keeps_what_a_stream_store_fetched_and_ends_byte_identical() {
    let env = Env::new();
    let o = start_origin(None, false);
    let d = tempfile::tempdir().unwrap();
    let store = d.path().join("s");
    env.install(&o, &store, "stream", &[]);
    let want = env.tokens(&store, PROMPT, &[]);
    let before = served(&o);
    let (out, err) = env.ok(&["install", "--upgrade-to-full", store.to_str().unwrap(), "--json"]);
    assert!(err.contains("is a full store now"), "{err}");
    let r: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(served(&o), snapshot_bytes("k3-small"), "stream + first use + upgrade fetched each byte once");
    assert_eq!(r["downloaded"].as_u64().unwrap(), served(&o) - before, "the upgrade needs no file list");
    eprintln!("bytes: upgrade {} after {} (snapshot {})", served(&o) - before, before, snapshot_bytes("k3-small"));
    assert_snapshot_identical(&store);
    assert_eq!(env.tokens(&store, PROMPT, &["--offline"]), want);
    // A second upgrade has nothing to do.
    let (_, err) = env.ok(&["install", "--upgrade-to-full", store.to_str().unwrap()]);
    assert!(err.contains("already a full store"), "{err}");
}

#[test]
fn transient_faults_are_retried_and_retry_after_is_honoured() {
    let env = Env::new();
    let o = start_origin(None, false);
    let d = tempfile::tempdir().unwrap();
    let kinds = [
        FaultKind::Drop { after_bytes: 100 },
        FaultKind::Status(503),
        FaultKind::Status(500),
        FaultKind::Status(408),
        FaultKind::TooMany { retry_after_s: 1 },
        FaultKind::WrongRange,
        FaultKind::WrongLength,
        FaultKind::IgnoreRange,
        FaultKind::Slow { bytes_per_sec: 400_000 },
    ];
    for (i, kind) in kinds.into_iter().enumerate() {
        o.reset_stats();
        o.set_faults(vec![Fault { file: "safetensors".into(), kind, times: 3, on: Where::Both }]);
        let store = d.path().join(format!("f{i}"));
        let t0 = Instant::now();
        env.install(&o, &store, "full", &["--no-hub-cache"]);
        let took = t0.elapsed();
        assert_snapshot_identical(&store);
        let st = o.stats();
        if let FaultKind::TooMany { retry_after_s } = kind {
            assert!(st.status_counts.get(&429).copied().unwrap_or(0) >= 1, "{kind:?}: {st:?}");
            assert!(took >= Duration::from_secs(retry_after_s), "{kind:?}: retried before Retry-After ({took:?})");
        }
        if let FaultKind::Status(s) = kind {
            assert!(st.status_counts.get(&s).copied().unwrap_or(0) >= 1, "{kind:?} never fired: {st:?}");
        }
    }
    o.set_faults(vec![]);
}

#[test]
fn corrupt_bytes_are_caught_by_the_checksums_and_fetched_again() {
    let env = Env::new();
    let o = start_origin(None, false);
    let d = tempfile::tempdir().unwrap();
    // A small file corrupted in flight (lengths right): its git blob id catches it.
    o.set_faults(vec![Fault { file: "tiktoken.model".into(), kind: FaultKind::Corrupt, times: 1, on: Where::Both }]);
    let store = d.path().join("s");
    let args = ["install", REPO, "--to", store.to_str().unwrap(), "--mode", "stream", "--endpoint", &o.endpoint];
    let err = env.fails(&args);
    assert!(err.contains("tiktoken.model") && err.contains("does not match"), "{err}");
    assert_consistent(&store);
    env.ok(&args);
    // A shard range corrupted during the upgrade: the shard's sha256 catches it, its ranges are
    // dropped, and a rerun fetches them again and ends byte-identical.
    o.set_faults(vec![Fault {
        file: "model-00005-of-000013".into(),
        kind: FaultKind::Corrupt,
        times: 1,
        on: Where::Both,
    }]);
    let up = ["install", "--upgrade-to-full", store.to_str().unwrap()];
    let err = env.fails(&up);
    assert!(err.contains("model-00005-of-000013") && err.contains("sha256"), "{err}");
    assert_consistent(&store);
    env.ok(&up);
    assert_snapshot_identical(&store);

    // Spine bytes that went bad on disk after a stream install was converted from them: the
    // upgrade's sha256 rejects the shard, and once every shard is verified the spine is
    // converted again, so the full store equals `convert`'s. The install's budget is too small
    // for a bf16 spine, so `--spine auto` takes int8; a rerun keeps that conversion, and so does
    // the conversion after the upgrade.
    let s3 = d.path().join("s3");
    let (_, err) = env.install(&o, &s3, "stream", &["--memory-budget", "1M"]);
    assert!(err.contains("converting the spine") && err.contains("spine: int8: a bf16 spine"), "{err}");
    let (_, err) = env.install(&o, &s3, "stream", &["--memory-budget", "1M"]);
    assert!(err.contains("the spine is converted already (Int8 matrices); kept"), "{err}");
    let (_, err) = env.install(&o, &s3, "stream", &[]);
    assert!(
        err.contains("the spine is converted already") && err.contains("chosen when the store was first converted"),
        "{err}"
    );
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(s3.join("manifest.json")).unwrap()).unwrap();
    let shard = "model-00004-of-000013.safetensors";
    let blob = m["origin"]["files"].as_array().unwrap().iter().find(|f| f["name"] == shard).unwrap()["sha256"]
        .as_str()
        .unwrap()
        .to_string();
    let partial = s3.join("hub/models--org--k3-small/blobs").join(format!("{blob}.deltafin-partial"));
    let fixture = fixture_files("k3-small");
    let hlen = 8 + u64::from_le_bytes(fixture[shard][..8].try_into().unwrap());
    // A byte of a spine tensor the stream install fetched (in the fill log, past the header).
    let log = deltafin_hub::fill::FillLog::open(&s3.join(".deltafin/fill").join(format!("{shard}.fill"))).unwrap();
    let at = log.have().iter().find(|r| r.1 > hlen).map(|r| r.0.max(hlen)).expect("a spine range") as usize;
    let mut bytes = std::fs::read(&partial).unwrap();
    bytes[at] ^= 0x40;
    std::fs::write(&partial, &bytes).unwrap();
    let up3 = ["install", "--upgrade-to-full", s3.to_str().unwrap()];
    let err = env.fails(&up3);
    assert!(err.contains(shard) && err.contains("sha256"), "{err}");
    let (_, err) = env.ok(&up3);
    assert!(err.contains("converting the spine again"), "{err}");
    let conv = tempfile::tempdir().unwrap();
    let c = conv.path().to_str().unwrap();
    env.ok(&["convert", "--from", fixture_hf("k3-small").to_str().unwrap(), "--to", c, "--memory-budget", "1M"]);
    assert_eq!(std::fs::read(s3.join("spine.bin")).unwrap(), std::fs::read(conv.path().join("spine.bin")).unwrap());
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(s3.join("manifest.json")).unwrap()).unwrap();
    assert_eq!((&m["spine"]["matrix_dtype"], &m["spine"]["auto"]["budget"]), (&"int8".into(), &(1u64 << 20).into()));
    assert!(!s3.join(".deltafin/spine-stale.json").exists());

    // An expert whose bytes the origin corrupts on first use (lengths and ETag right) cannot be
    // told from a good one when it arrives alone (the Hub publishes one sha256 per file): it is
    // stored with the checksum of what arrived. The upgrade's sha256 of its shard catches it,
    // marks that shard's experts absent again, and the rerun ends byte-identical.
    let s2 = d.path().join("s2");
    env.install(&o, &s2, "stream", &[]);
    o.set_faults(vec![Fault {
        file: "model-00003-of-000013".into(),
        kind: FaultKind::Corrupt,
        times: 1,
        on: Where::Both,
    }]);
    env.generate(&s2, PROMPT, &[]);
    o.set_faults(vec![]);
    let up2 = ["install", "--upgrade-to-full", s2.to_str().unwrap()];
    let err = env.fails(&up2);
    assert!(err.contains("model-00003-of-000013") && err.contains("sha256"), "{err}");
    env.ok(&up2);
    assert_snapshot_identical(&s2);
    assert_eq!(env.tokens(&s2, PROMPT, &["--offline"]), reference_tokens(&env, PROMPT));
}

#[test]
fn operator_errors_are_clear_and_the_token_never_reaches_the_cdn() {
    let env = Env::new();
    let d = tempfile::tempdir().unwrap();
    let private = start_origin(Some("sekrit"), false);
    let to = d.path().join("p");
    let args = ["install", REPO, "--to", to.to_str().unwrap(), "--mode", "full", "--endpoint", &private.endpoint];
    let err = env.fails(&args);
    assert!(err.contains("401") && err.contains("HF_TOKEN"), "{err}");
    assert!(!to.join(".deltafin").exists(), "a refused install wrote state");
    let out = env.cmd(&args).env("HF_TOKEN", "sekrit").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_snapshot_identical(&to);
    assert_eq!(private.stats().cdn_requests_with_authorization, 0, "the token went to the CDN");
    // The token file huggingface_hub writes works too.
    std::fs::create_dir_all(env.home.path().join(".cache/huggingface")).unwrap();
    std::fs::write(env.home.path().join(".cache/huggingface/token"), "sekrit\n").unwrap();
    let to2 = d.path().join("p2");
    env.ok(&["install", REPO, "--to", to2.to_str().unwrap(), "--mode", "stream", "--endpoint", &private.endpoint]);

    let gated = start_origin(None, true);
    let err =
        env.fails(&["install", REPO, "--to", d.path().join("g").to_str().unwrap(), "--endpoint", &gated.endpoint]);
    assert!(err.contains("gated"), "{err}");
    let o = start_origin(None, false);
    let err =
        env.fails(&["install", "org/nope", "--to", d.path().join("n").to_str().unwrap(), "--endpoint", &o.endpoint]);
    assert!(err.contains("does not exist"), "{err}");
    let err = env.fails(&[
        "install",
        REPO,
        "--revision",
        "no-such-branch",
        "--to",
        d.path().join("r").to_str().unwrap(),
        "--endpoint",
        &o.endpoint,
    ]);
    assert!(err.contains("RevisionNotFound"), "{err}");
    let err =
        env.fails(&["install", "../etc", "--to", d.path().join("x").to_str().unwrap(), "--endpoint", &o.endpoint]);
    assert!(err.contains("org/name"), "{err}");
    // A 4xx that is not 408/429 is not retried.
    o.set_faults(vec![Fault { file: "safetensors".into(), kind: FaultKind::Status(403), times: 1, on: Where::Both }]);
    let err = env.fails(&["install", REPO, "--to", d.path().join("f").to_str().unwrap(), "--endpoint", &o.endpoint]);
    assert!(err.contains("403"), "{err}");
    o.set_faults(vec![]);
    // Another repository into the same store is refused.
    let err =
        env.fails(&["install", REPO, "--revision", "other", "--to", to2.to_str().unwrap(), "--endpoint", &o.endpoint]);
    assert!(err.contains("holds an install of"), "{err}");
}

#[test]
fn a_branch_that_moves_during_the_install_does_not_mix_revisions() {
    let env = Env::new();
    let o = start_origin(None, false);
    let d = tempfile::tempdir().unwrap();
    let store = d.path().join("s");
    o.set_faults(vec![slow("safetensors", 2_000_000)]);
    let mut child = env
        .cmd(&["install", REPO, "--to", store.to_str().unwrap(), "--mode", "full", "--endpoint", &o.endpoint])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for(|| served(&o) > 200_000);
    let moved = "1111111111111111111111111111111111111111";
    o.move_branch(REPO, "main", moved, fixture_hf("k3-tiny"));
    assert!(child.wait().unwrap().success());
    assert_snapshot_identical(&store);
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(store.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["origin"]["commit"].as_str().unwrap(), default_commit(REPO));
    o.set_faults(vec![]);
}

fn wait_for(mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < Duration::from_secs(60), "timed out waiting");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn kill9(mut child: Child) {
    child.kill().unwrap();
    let st = child.wait().unwrap();
    assert!(!st.success(), "the process ended before it was killed");
}

/// A trace of `PROMPT` on a converted store, for warmup.
fn make_trace(env: &Env, dir: &Path) -> PathBuf {
    let conv = dir.join("conv");
    env.ok(&["convert", "--from", fixture_hf("k3-small").to_str().unwrap(), "--to", conv.to_str().unwrap()]);
    let trace = dir.join("trace.jsonl");
    env.ok(&[
        "generate",
        "--model",
        conv.to_str().unwrap(),
        "--prompt",
        PROMPT,
        "--max-tokens",
        "6",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    trace
}

#[test]
fn warmup_ranks_by_the_traces_and_fetches_only_when_asked() {
    let env = Env::new();
    let o = start_origin(None, false);
    let d = tempfile::tempdir().unwrap();
    let trace = make_trace(&env, d.path());
    let store = d.path().join("s");
    env.install(&o, &store, "stream", &[]);
    let s = store.to_str().unwrap();
    let t = trace.to_str().unwrap();
    let before = served(&o);
    let (out, err) = env.ok(&["warmup", "--model", s, "--trace", t, "--json"]);
    assert!(err.contains("add --fetch"), "{err}");
    assert_eq!(served(&o), before, "warmup without --fetch fetched");
    let plan: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let chosen = plan["plan"]["absent_chosen"].as_u64().unwrap();
    assert!(chosen > 3);
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(store.join("manifest.json")).unwrap()).unwrap();
    let record = m["experts"]["record_bytes"].as_u64().unwrap();
    // A budget of three records fetches the three likeliest, exactly.
    let budget = (3 * record + record / 2).to_string();
    let (out, err) = env.ok(&["warmup", "--model", s, "--trace", t, "--budget-bytes", &budget, "--fetch", "--json"]);
    let r: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(r["fetched"]["experts"], 3, "{err}");
    assert_eq!(r["fetched"]["bytes_written"].as_u64().unwrap(), 3 * record);
    assert_eq!(served(&o) - before, 3 * record);
    assert!(err.contains("wrote"), "bytes written to the store are reported: {err}");
    // Without a budget it fetches the rest; then the traced prompt runs offline.
    env.ok(&["warmup", "--model", s, "--trace", t, "--fetch"]);
    assert_eq!(served(&o) - before, chosen * record);
    assert_eq!(env.tokens(&store, PROMPT, &["--offline"]), reference_tokens(&env, PROMPT));
    assert_consistent(&store);
}

/// kill -9 at several points of every phase that writes, then rerun: the store is consistent
/// after the kill, the rerun completes, and the bytes fetched by both runs together exceed what
/// was needed by at most the pieces in flight at the kill (and the metadata, when the kill came
/// before it was written).
#[test]
fn kill_9_at_any_point_leaves_a_consistent_store_and_a_rerun_finishes() {
    let env = Env::new();
    let o = start_origin(None, false);
    let d = tempfile::tempdir().unwrap();
    let trace = make_trace(&env, d.path());
    let snapshot = snapshot_bytes("k3-small");
    let piece = 64 * 1024u64;
    let workers = 4u64;
    // Metadata a killed run may fetch again: the index, the config and the shard headers.
    let meta: u64 = fixture_files("k3-small")
        .iter()
        .map(|(n, b)| {
            if n.ends_with(".safetensors") {
                8 + u64::from_le_bytes(b[..8].try_into().unwrap())
            } else if n == "model.safetensors.index.json" || n == "config.json" {
                b.len() as u64
            } else {
                0
            }
        })
        .sum();
    let mut matrix = Vec::new();
    for phase in ["stream install", "full install", "upgrade", "first-use fetch", "warmup"] {
        for frac in [0.15, 0.6] {
            o.set_faults(vec![]);
            o.reset_stats();
            let store = d.path().join(format!("{}-{}", phase.replace(' ', "-"), (frac * 100.0) as u32));
            let s = store.to_str().unwrap().to_string();
            let piece_s = piece.to_string();
            let w = workers.to_string();
            let install = |mode: &str| {
                vec![
                    "install",
                    REPO,
                    "--to",
                    &s,
                    "--mode",
                    mode,
                    "--endpoint",
                    &o.endpoint,
                    "--piece-size",
                    &piece_s,
                    "--workers",
                    &w,
                ]
                .into_iter()
                .map(String::from)
                .collect::<Vec<_>>()
            };
            // The work before the killed phase, and the command that is killed.
            let (cmd, total): (Vec<String>, u64) = match phase {
                "stream install" => (install("stream"), 0),
                "full install" => (install("full"), snapshot),
                "upgrade" => {
                    env.ok(&install("stream").iter().map(String::as_str).collect::<Vec<_>>());
                    let up = vec!["install", "--upgrade-to-full", &s, "--piece-size", &piece_s, "--workers", &w];
                    (up.into_iter().map(String::from).collect(), snapshot)
                }
                "first-use fetch" => {
                    env.ok(&install("stream").iter().map(String::as_str).collect::<Vec<_>>());
                    let g = vec!["generate", "--model", &s, "--prompt", PROMPT, "--max-tokens", "6"];
                    (g.into_iter().map(String::from).collect(), 0)
                }
                _ => {
                    env.ok(&install("stream").iter().map(String::as_str).collect::<Vec<_>>());
                    let wu = vec!["warmup", "--model", &s, "--trace", trace.to_str().unwrap(), "--fetch"];
                    (wu.into_iter().map(String::from).collect(), 0)
                }
            };
            // What an uninterrupted run of the command fetches, measured on a twin store.
            let twin_need = {
                let twin = d.path().join(format!("twin-{}-{}", phase.replace(' ', "-"), (frac * 100.0) as u32));
                let _ = std::fs::remove_dir_all(&twin);
                if store.exists() {
                    copy_dir(&store, &twin);
                }
                let tw = twin.to_str().unwrap().to_string();
                let twin_cmd: Vec<String> = cmd.iter().map(|a| if *a == s { tw.clone() } else { a.clone() }).collect();
                let b0 = served(&o);
                env.ok(&twin_cmd.iter().map(String::as_str).collect::<Vec<_>>());
                served(&o) - b0
            };
            assert!(total == 0 || twin_need <= total);
            o.set_faults(vec![slow("", 300_000)]);
            let b0 = served(&o);
            let child = env
                .cmd(&cmd.iter().map(String::as_str).collect::<Vec<_>>())
                .stderr(Stdio::null())
                .stdout(Stdio::null())
                .spawn()
                .unwrap();
            let at = ((twin_need as f64) * frac) as u64;
            wait_for(|| served(&o) - b0 >= at.max(1));
            kill9(child);
            o.set_faults(vec![]);
            let killed_run = served(&o) - b0;
            assert_consistent(&store);
            let r0 = served(&o);
            env.ok(&cmd.iter().map(String::as_str).collect::<Vec<_>>());
            let rerun = served(&o) - r0;
            assert_consistent(&store);
            let both = killed_run + rerun;
            let allowance = workers * piece + meta + 24 * 6528;
            assert!(
                both <= twin_need + allowance,
                "{phase} at {frac}: fetched {both} for {twin_need} (allowance {allowance})"
            );
            if phase == "full install" || phase == "upgrade" {
                assert_snapshot_identical(&store);
            }
            if phase == "first-use fetch" || phase == "warmup" {
                assert_eq!(env.tokens(&store, PROMPT, &["--offline"]), reference_tokens(&env, PROMPT));
            }
            matrix.push(format!(
                "{phase:<16} killed after {killed_run:>8} B ({:>3.0}% of {twin_need}): rerun {rerun:>8} B, both {both:>8} B (+{} over an uninterrupted run)",
                100.0 * killed_run as f64 / twin_need.max(1) as f64,
                both as i64 - twin_need as i64
            ));
        }
    }
    eprintln!("kill -9 matrix:\n{}", matrix.join("\n"));
}

fn copy_dir(from: &Path, to: &Path) {
    // Links are copied as links (the checkpoint view and the Hub snapshot are relative links).
    let st = Command::new("cp").arg("-a").arg(from).arg(to).status().unwrap();
    assert!(st.success());
}

#[test]
fn concurrent_readers_see_a_record_absent_or_whole() {
    let env = Env::new();
    let o = start_origin(None, false);
    let d = tempfile::tempdir().unwrap();
    let trace = make_trace(&env, d.path());
    let store = d.path().join("s");
    env.install(&o, &store, "stream", &[]);
    o.set_faults(vec![slow("", 200_000)]);
    let mut child = env
        .cmd(&["warmup", "--model", store.to_str().unwrap(), "--trace", trace.to_str().unwrap(), "--fetch"])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // A second process's view, read again and again while the warmup fills the store.
    let reader = Store::open(&store, None).unwrap();
    let p = reader.experts.presence().unwrap().clone();
    let (mut seen_absent, mut seen_present, mut buf) = (0usize, 0usize, Vec::new());
    loop {
        let done = child.try_wait().unwrap().is_some();
        for &l in p.layers() {
            for e in 0..p.experts_per_layer() {
                match p.refresh(l, e).unwrap() {
                    None => seen_absent += 1,
                    Some(_) => {
                        reader.experts.read(l, e, &mut buf).unwrap_or_else(|err| panic!("layer {l} expert {e}: {err}"));
                        seen_present += 1;
                    }
                }
            }
        }
        if done {
            break;
        }
    }
    assert!(child.wait().unwrap().success());
    assert!(seen_absent > 0 && seen_present > 0);
    o.set_faults(vec![]);
}

#[test]
fn serve_on_a_stream_store_fetches_and_reports_it() {
    let env = Env::new();
    let o = start_origin(None, false);
    let d = tempfile::tempdir().unwrap();
    let store = d.path().join("s");
    env.install(&o, &store, "stream", &[]);
    let log_path = d.path().join("serve.log");
    let mut child = env
        .cmd(&["serve", "--model", store.to_str().unwrap(), "--port", "0", "--served-model-name", "k3"])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let addr = {
        use std::io::BufRead;
        let mut line = String::new();
        loop {
            line.clear();
            assert!(
                out.read_line(&mut line).unwrap() > 0,
                "serve exited: {}",
                std::fs::read_to_string(&log_path).unwrap()
            );
            if let Some(a) = line.split("ready on http://").nth(1) {
                break a.split_whitespace().next().unwrap_or_default().to_string();
            }
        }
    };
    let body = serde_json::json!({"model": "k3", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}).to_string();
    let resp = http(&addr, "POST", "/v1/completions", &body);
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let metrics = http(&addr, "GET", "/metrics", "");
    let value = |name: &str| -> f64 {
        metrics
            .lines()
            .find(|l| l.starts_with(name) && !l.starts_with('#'))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{metrics}"))
    };
    assert!(value("deltafin_stream_experts_fetched_total") > 0.0);
    assert!(value("deltafin_stream_bytes_written_total") > 0.0);
    assert!(value("deltafin_stream_experts_present") > 0.0);
    // With the origin gone, a request that needs an expert not fetched yet costs that request
    // (503, no path in the body), and the server goes on serving what it has.
    drop(o);
    let body = serde_json::json!({"model": "k3", "prompt": "Quartz zebras vexed a wizard's jumpy glyph 0123456789 ~!@#", "max_tokens": 30, "temperature": 0}).to_string();
    let resp = http(&addr, "POST", "/v1/completions", &body);
    assert!(resp.starts_with("HTTP/1.1 503") && resp.contains("expert_fetch_failed"), "{resp}");
    assert!(!resp.contains(d.path().to_str().unwrap()) && !resp.contains("127.0.0.1:"), "{resp}");
    let again = serde_json::json!({"model": "k3", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}).to_string();
    assert!(http(&addr, "POST", "/v1/completions", &again).starts_with("HTTP/1.1 200"));
    child.kill().unwrap();
    child.wait().unwrap();
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(log.contains("fetched") && log.contains("experts on disk"), "serve logs its fetches:\n{log}");
}

/// One HTTP/1.1 request with `Connection: close`; the whole answer.
fn http(addr: &str, method: &str, path: &str, body: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// A tmpfs of `size` mounted for the test, unmounted on drop; `None` where mounting is not
/// allowed (not root, or no mount namespace rights).
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Option<Tmpfs> {
        std::fs::create_dir_all(dir).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Tmpfs(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// A disk too small for the plan is refused before anything is written; a disk that fills up
/// during the install is a clear error, the store stays consistent, and once space is freed the
/// same command finishes it.
#[test]
fn a_full_disk_is_a_clear_error_and_the_store_stays_consistent() {
    let env = Env::new();
    let o = start_origin(None, false);
    let d = tempfile::tempdir().unwrap();
    let Some(small) = Tmpfs::mount(&d.path().join("small"), "2m") else {
        eprintln!("SKIPPED: cannot mount a tmpfs here (needs root)");
        return;
    };
    let store = small.0.join("s");
    let err =
        env.fails(&["install", REPO, "--to", store.to_str().unwrap(), "--mode", "stream", "--endpoint", &o.endpoint]);
    assert!(err.contains("not enough disk space"), "{err}");
    assert!(!store.join(".deltafin").exists(), "a refused install wrote state");
    assert_eq!(
        served(&o),
        fixture_files("k3-small")["model.safetensors.index.json"].len() as u64
            + fixture_files("k3-small")["config.json"].len() as u64
            + {
                // and the shard headers: metadata read into memory to make the plan
                fixture_files("k3-small")
                    .iter()
                    .filter(|(n, _)| n.ends_with(".safetensors"))
                    .map(|(_, b)| 8 + u64::from_le_bytes(b[..8].try_into().unwrap()))
                    .sum::<u64>()
            }
    );
    drop(small);

    // Room for the install with its bf16 spine (`--spine auto` on a machine this large) and the
    // experts the final generation fetches.
    let Some(fs) = Tmpfs::mount(&d.path().join("fill"), "12m") else { panic!("mounted once, not twice") };
    let store = fs.0.join("s");
    o.set_faults(vec![slow("safetensors", 1_000_000)]);
    let args = [
        "install",
        REPO,
        "--to",
        store.to_str().unwrap(),
        "--mode",
        "stream",
        "--endpoint",
        &o.endpoint,
        "--piece-size",
        "64K",
    ];
    let child = env.cmd(&args).stderr(Stdio::piped()).spawn().unwrap();
    wait_for(|| store.join(".deltafin/fill").exists());
    // Fill what is left of the disk.
    let filler = fs.0.join("filler");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&filler).unwrap();
        let block = vec![7u8; 64 << 10];
        while f.write_all(&block).is_ok() {}
        let _ = f.sync_all();
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the install did not notice the full disk: {err}");
    assert!(err.contains("disk is full") && !err.contains("panicked"), "{err}");
    assert_consistent(&store);
    o.set_faults(vec![]);
    std::fs::remove_file(&filler).unwrap();
    env.ok(&args);
    assert_eq!(env.tokens(&store, PROMPT, &[]), reference_tokens(&env, PROMPT));
    assert_consistent(&store);
}

/// A repository with files in folders (a `figures/` beside the weights): the full install is
/// still a valid Hub snapshot with them, and the store's own view holds only what it reads.
#[test]
fn files_in_folders_are_part_of_the_snapshot() {
    let env = Env::new();
    let d = tempfile::tempdir().unwrap();
    let repo_dir = d.path().join("repo");
    std::fs::create_dir_all(repo_dir.join("figures")).unwrap();
    for (name, bytes) in fixture_files("k3-small") {
        std::fs::write(repo_dir.join(name), bytes).unwrap();
    }
    let logo: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(repo_dir.join("figures/logo.png"), &logo).unwrap();
    let o = Origin::start(vec![RepoSpec {
        repo: REPO.into(),
        dir: repo_dir,
        branches: vec![("main".into(), default_commit(REPO))],
        token: None,
        gated: false,
    }])
    .unwrap();
    let store = d.path().join("s");
    env.install(&o, &store, "full", &["--no-hub-cache"]);
    assert_snapshot_identical(&store);
    assert_eq!(std::fs::read(snapshot_dir(&store).join("figures/logo.png")).unwrap(), logo);
    assert!(!store.join("checkpoint/figures").exists());
    assert_eq!(env.tokens(&store, PROMPT, &["--offline"]), reference_tokens(&env, PROMPT));
}
