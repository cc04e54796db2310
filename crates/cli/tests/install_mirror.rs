//! `deltafin install --mirror` against a real nginx serving a plain directory (a snapshot's
//! files, with or without `SHA256SUMS`): stream install, generation that fetches experts on
//! first use, upgrade to full, the Hub cache it leaves, and a mirror that lacks a shard.
//!
//! nginx comes from the OS (`scripts/ensure-nginx.sh` installs it for `scripts/test.sh`); where
//! it is not installed, each test says `SKIPPED: nginx not installed` and passes.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

const REPO: &str = "org/k3-small";
const PROMPT: &str = "The lighthouse keeper";

fn fixture_hf() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/k3-small/hf")
}

/// The nginx binary: on PATH, else Debian's /usr/sbin/nginx (not on a user's PATH).
fn nginx_bin() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).map(|d| d.join("nginx")).collect::<Vec<_>>())
        .unwrap_or_default();
    on_path.into_iter().chain([PathBuf::from("/usr/sbin/nginx")]).find(|p| p.is_file())
}

/// An nginx serving `root` on 127.0.0.1, unprivileged (single process, everything under its
/// own temp dir); killed on drop.
struct Nginx {
    child: Child,
    url: String,
    /// Its config and temp paths; removed after the process is gone.
    _dir: tempfile::TempDir,
}

impl Nginx {
    fn start(bin: &Path, root: &Path) -> Nginx {
        let dir = tempfile::tempdir().unwrap();
        // A free port can be taken by someone else between its probe and nginx's bind: retry.
        for _ in 0..5 {
            let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let t = dir.path().display();
            let conf = format!(
                "daemon off;\nmaster_process off;\npid {t}/nginx.pid;\nerror_log stderr;\n\
                 events {{}}\nhttp {{\n  access_log off;\n  client_body_temp_path {t}/body;\n  \
                 proxy_temp_path {t}/proxy;\n  fastcgi_temp_path {t}/fastcgi;\n  uwsgi_temp_path {t}/uwsgi;\n  \
                 scgi_temp_path {t}/scgi;\n  server {{\n    listen 127.0.0.1:{port};\n    root {};\n  }}\n}}\n",
                root.display()
            );
            let conf_path = dir.path().join("nginx.conf");
            std::fs::write(&conf_path, conf).unwrap();
            let log = std::fs::File::create(dir.path().join("stderr.log")).unwrap();
            let mut child = Command::new(bin)
                .arg("-p")
                .arg(dir.path())
                .arg("-e")
                .arg("stderr")
                .arg("-c")
                .arg(&conf_path)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("spawn nginx");
            if wait_ready(&mut child, port) {
                return Nginx { child, url: format!("http://127.0.0.1:{port}"), _dir: dir };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("nginx did not start: {}", std::fs::read_to_string(dir.path().join("stderr.log")).unwrap_or_default());
    }
}

/// Until nginx answers an HTTP request on `port` (false if it exits or 10 s pass).
fn wait_ready(child: &mut Child, port: u16) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(10) {
        if child.try_wait().ok().flatten().is_some() {
            return false;
        }
        if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let mut answer = Vec::new();
            if s.write_all(b"HEAD / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").is_ok()
                && s.read_to_end(&mut answer).is_ok()
                && answer.starts_with(b"HTTP/1.")
            {
                return true;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A mirror directory: a copy of the fixture, with `SHA256SUMS` (as `sha256sum * > SHA256SUMS`
/// writes it) when `sums`.
fn mirror_dir(sums: bool) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let mut lines = String::new();
    for (name, bytes) in fixture_files() {
        std::fs::write(d.path().join(&name), &bytes).unwrap();
        lines.push_str(&format!("{}  {name}\n", hex(&Sha256::digest(&bytes))));
    }
    if sums {
        std::fs::write(d.path().join("SHA256SUMS"), lines).unwrap();
    }
    d
}

/// The fixture's files, sorted by name.
fn fixture_files() -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(fixture_hf())
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().unwrap().is_file())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap()))
        .collect();
    v.sort();
    v
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A deltafin process isolated from the real Hub cache, token and endpoint, with short
/// HTTP back-offs.
struct Env {
    home: tempfile::TempDir,
    hub_cache: tempfile::TempDir,
}

impl Env {
    fn new() -> Env {
        Env { home: tempfile::tempdir().unwrap(), hub_cache: tempfile::tempdir().unwrap() }
    }

    fn run(&self, args: &[&str]) -> Output {
        let mut c = Command::new(env!("CARGO_BIN_EXE_deltafin"));
        for v in ["HF_TOKEN", "HF_ENDPOINT", "HF_HOME", "HF_TOKEN_PATH", "HF_HUB_OFFLINE"] {
            c.env_remove(v);
        }
        for v in ["http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"] {
            c.env_remove(v);
        }
        c.env("HOME", self.home.path())
            .env("HF_HUB_CACHE", self.hub_cache.path())
            .env("NO_PROXY", "127.0.0.1,localhost")
            .env("DELTAFIN_HTTP_BACKOFF_MS", "10")
            .env("DELTAFIN_HTTP_ATTEMPTS", "3")
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("spawn deltafin")
    }

    /// Runs, expects success; returns (stdout, stderr).
    fn ok(&self, args: &[&str]) -> (String, String) {
        let o = self.run(args);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "deltafin {args:?} failed: {err}");
        (String::from_utf8(o.stdout).unwrap(), err)
    }

    /// The greedy tokens of `generate --json` (plus `extra` flags).
    fn tokens(&self, store: &Path, extra: &[&str]) -> Vec<u64> {
        let s = store.to_str().unwrap();
        let mut args = vec!["generate", "--model", s, "--prompt", PROMPT, "--max-tokens", "6", "--json"];
        args.extend_from_slice(extra);
        let (out, _) = self.ok(&args);
        let v: serde_json::Value = serde_json::from_str(&out).expect("one JSON object on stdout");
        let t: Vec<u64> = v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
        assert!(!t.is_empty(), "{out}");
        t
    }

    /// The tokens of a store converted straight from the fixture.
    fn reference_tokens(&self) -> Vec<u64> {
        let d = tempfile::tempdir().unwrap();
        self.ok(&["convert", "--from", fixture_hf().to_str().unwrap(), "--to", d.path().to_str().unwrap()]);
        self.tokens(d.path(), &[])
    }
}

/// The one snapshot directory of the store's Hub cache.
fn snapshot_dir(store: &Path) -> PathBuf {
    let snaps: Vec<PathBuf> = std::fs::read_dir(store.join("hub/models--org--k3-small/snapshots"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(snaps.len(), 1, "one snapshot: {snaps:?}");
    snaps.into_iter().next().unwrap()
}

/// The snapshot holds exactly the fixture's files, byte for byte, linked into `blobs/`, and
/// `refs/main` names it.
fn assert_snapshot_is_the_fixture(store: &Path) {
    let snap = snapshot_dir(store);
    let mut names: Vec<String> =
        std::fs::read_dir(&snap).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    let fixture = fixture_files();
    let want: Vec<&str> = fixture.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, want, "the snapshot's files");
    for (name, bytes) in &fixture {
        let p = snap.join(name);
        let got = std::fs::read(&p).unwrap();
        assert!(got == *bytes, "{name}: the snapshot's bytes differ from the fixture's");
        let target = std::fs::read_link(&p).expect("a snapshot file is a link to its blob");
        assert!(target.starts_with("../../blobs"), "{name} -> {}", target.display());
    }
    let commit = std::fs::read_to_string(store.join("hub/models--org--k3-small/refs/main")).unwrap();
    assert_eq!(Some(commit.trim()), snap.file_name().and_then(|n| n.to_str()));
    for e in std::fs::read_dir(store.join("hub/models--org--k3-small/blobs")).unwrap() {
        let n = e.unwrap().file_name().to_string_lossy().into_owned();
        assert!(!n.ends_with(".deltafin-partial"), "a partial blob is left after a full install: {n}");
    }
}

/// nginx, or None after saying the test is skipped.
fn nginx_or_skip() -> Option<PathBuf> {
    let b = nginx_bin();
    if b.is_none() {
        eprintln!("SKIPPED: nginx not installed");
    }
    b
}

#[test]
fn stream_install_generates_like_the_fixture_then_upgrades_to_the_exact_snapshot() {
    let Some(bin) = nginx_or_skip() else { return };
    let mirror = mirror_dir(true);
    let nginx = Nginx::start(&bin, mirror.path());
    let env = Env::new();
    let want = env.reference_tokens();

    let out = tempfile::tempdir().unwrap();
    let store = out.path().join("store");
    let s = store.to_str().unwrap();
    let (json, _) = env.ok(&["install", REPO, "--mirror", &nginx.url, "--to", s, "--mode", "stream", "--json"]);
    let report: serde_json::Value = serde_json::from_str(&json).expect("a JSON report on stdout");
    let commit = report["commit"].as_str().unwrap().to_string();
    assert_eq!(snapshot_dir(&store).file_name().unwrap().to_str(), Some(commit.as_str()));
    // Only finished files are in the snapshot: the small ones, no shard yet.
    let snap = snapshot_dir(&store);
    assert!(snap.join("config.json").exists() && snap.join("model.safetensors.index.json").exists());
    assert!(!snap.join("model-00002-of-000013.safetensors").exists(), "a partial shard is in the snapshot");

    // Experts are fetched from the mirror on first use.
    assert_eq!(env.tokens(&store, &[]), want, "stream store from the mirror vs. the converted fixture");

    let (json, err) = env.ok(&["install", "--upgrade-to-full", s, "--json"]);
    let up: serde_json::Value = serde_json::from_str(&json).expect("a JSON report on stdout");
    assert_eq!(up["shards_verified"], 13, "{err}");
    assert!(!err.contains("checked by size only"), "SHA256SUMS is on the mirror: {err}");
    assert_snapshot_is_the_fixture(&store);
    assert!(!store.join("presence.bin").exists(), "a full store has no presence map");

    // Offline now: nothing is fetched, even with nginx gone.
    drop(nginx);
    assert_eq!(env.tokens(&store, &["--offline"]), want, "full store, offline");
}

#[test]
fn a_mirror_without_sha256sums_installs_checked_by_size() {
    let Some(bin) = nginx_or_skip() else { return };
    let mirror = mirror_dir(false);
    let nginx = Nginx::start(&bin, mirror.path());
    let env = Env::new();
    let out = tempfile::tempdir().unwrap();
    let store = out.path().join("store");
    let s = store.to_str().unwrap();
    let (_, err) = env.ok(&["install", REPO, "--mirror", &nginx.url, "--to", s, "--mode", "full"]);
    assert!(
        err.contains("the origin publishes no sha256 (no SHA256SUMS on the mirror): checked by size only"),
        "{err}"
    );
    assert!(err.contains("model-00001-of-000013.safetensors: the origin publishes no sha256"), "{err}");
    assert_snapshot_is_the_fixture(&store);
    drop(nginx);
    assert_eq!(env.tokens(&store, &["--offline"]), env.reference_tokens());
}

#[test]
fn a_shard_missing_from_the_mirror_is_a_clear_error() {
    let Some(bin) = nginx_or_skip() else { return };
    let mirror = mirror_dir(true);
    let missing = "model-00005-of-000013.safetensors";
    std::fs::remove_file(mirror.path().join(missing)).unwrap();
    let nginx = Nginx::start(&bin, mirror.path());
    let env = Env::new();
    let out = tempfile::tempdir().unwrap();
    for mode in ["stream", "full"] {
        let store = out.path().join(mode);
        let o = env.run(&["install", REPO, "--mirror", &nginx.url, "--to", store.to_str().unwrap(), "--mode", mode]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{mode}: an install from a mirror lacking {missing} succeeded: {err}");
        assert!(!err.contains("panicked"), "{mode}: {err}");
        assert!(err.contains("404") && err.contains(missing), "{mode}: the error names the file and 404: {err}");
        assert!(!store.join("manifest.json").exists(), "{mode}: a failed install left a manifest");
    }
}
