//! The test origin against the k3-tiny checkpoint, through a raw HTTP/1.1 client (one request
//! per connection, read to EOF), so that what a downloader would see is checked byte for byte,
//! short bodies and aborted connections included.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use deltafin_test_origin::{Fault, FaultKind, Origin, RepoSpec, Where, default_commit};
use serde_json::Value;
use sha2::{Digest, Sha256};

const REPO: &str = "deltafin/k3-tiny";
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const BIG: &str = "model-00002-of-000011.safetensors";
const SMALL: &str = "config.json";

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/k3-tiny/hf")
}

fn spec(repo: &str) -> RepoSpec {
    RepoSpec {
        repo: repo.into(),
        dir: fixture(),
        branches: vec![("main".into(), COMMIT.into())],
        token: None,
        gated: false,
    }
}

fn start() -> Origin {
    Origin::start(vec![spec(REPO)]).unwrap()
}

fn file(name: &str) -> Vec<u8> {
    std::fs::read(fixture().join(name)).unwrap()
}

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn fault(file: &str, kind: FaultKind, times: u32, on: Where) -> Fault {
    Fault { file: file.into(), kind, times, on }
}

struct Reply {
    status: u16,
    headers: BTreeMap<String, String>,
    body: Vec<u8>,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    fn content_length(&self) -> usize {
        self.header("content-length").unwrap().parse().unwrap()
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

/// One request on a fresh connection. The body is whatever arrived before EOF or a reset, so a
/// dropped connection shows as a short body.
fn request(url: &str, method: &str, headers: &[(&str, &str)]) -> Reply {
    let rest = url.strip_prefix("http://").unwrap();
    let (host, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let mut stream = TcpStream::connect(host).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).unwrap();

    let mut reader = BufReader::new(stream);
    let mut status_line = String::new();
    reader.read_line(&mut status_line).unwrap();
    let status = status_line.split(' ').nth(1).unwrap().parse().unwrap();
    let mut headers = BTreeMap::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let (k, v) = line.split_once(':').unwrap();
        headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
    }
    let mut body = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match reader.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => body.extend_from_slice(&buf[..n]),
        }
    }
    Reply { status, headers, body }
}

fn get(url: &str) -> Reply {
    request(url, "GET", &[])
}

fn resolve_url(o: &Origin, rev: &str, name: &str) -> String {
    format!("{}/{REPO}/resolve/{rev}/{name}", o.endpoint)
}

fn cdn_url(o: &Origin, name: &str) -> String {
    format!("{}/blobs/{}", o.cdn, sha256(&file(name)))
}

fn fixture_names() -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(fixture()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    names
}

#[test]
fn api_lists_every_file_with_sizes_and_hashes() {
    let o = start();
    for url in [
        format!("{}/api/models/{REPO}/revision/main", o.endpoint),
        format!("{}/api/models/{REPO}/revision/main?blobs=true", o.endpoint),
        format!("{}/api/models/{REPO}/revision/{COMMIT}", o.endpoint),
    ] {
        let r = get(&url);
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-repo-commit"), Some(COMMIT));
        let info = r.json();
        assert_eq!(info["id"], REPO);
        assert_eq!(info["sha"], COMMIT);
        let siblings = info["siblings"].as_array().unwrap();
        let listed: Vec<&str> = siblings.iter().map(|s| s["rfilename"].as_str().unwrap()).collect();
        assert_eq!(listed, fixture_names());
        for s in siblings {
            let name = s["rfilename"].as_str().unwrap();
            let bytes = file(name);
            assert_eq!(s["size"].as_u64(), Some(bytes.len() as u64), "{name}");
            let blob_id = s["blobId"].as_str().unwrap();
            assert!(blob_id.len() == 40 && blob_id.bytes().all(|b| b.is_ascii_hexdigit()), "{name}");
            if name.ends_with(".safetensors") {
                assert_eq!(s["lfs"]["sha256"].as_str(), Some(sha256(&bytes).as_str()), "{name}");
                assert_eq!(s["lfs"]["size"].as_u64(), Some(bytes.len() as u64));
                assert!(s["lfs"]["pointerSize"].as_u64().unwrap() > 100);
            } else {
                assert!(s.get("lfs").is_none(), "{name} is not LFS");
            }
        }
    }
    assert_eq!(o.stats().api_requests, 3);
}

#[test]
fn lfs_files_redirect_to_the_cdn_which_serves_them() {
    let o = start();
    let bytes = file(BIG);
    let sha = sha256(&bytes);
    for method in ["GET", "HEAD"] {
        let r = request(&resolve_url(&o, "main", BIG), method, &[("Authorization", "Bearer x")]);
        assert_eq!(r.status, 302);
        assert_eq!(r.header("location"), Some(format!("{}/blobs/{sha}", o.cdn).as_str()));
        assert_eq!(r.header("x-linked-etag"), Some(format!("\"{sha}\"").as_str()));
        assert_eq!(r.header("etag"), Some(format!("\"{sha}\"").as_str()));
        assert_eq!(r.header("x-linked-size"), Some(bytes.len().to_string().as_str()));
        assert_eq!(r.header("x-repo-commit"), Some(COMMIT));
    }
    let location = get(&resolve_url(&o, "main", BIG)).header("location").unwrap().to_string();
    let r = get(&location);
    assert_eq!(r.status, 200);
    assert_eq!(r.body, bytes);
    assert_eq!(r.content_length(), bytes.len());
    assert_eq!(r.header("etag"), Some(format!("\"{sha}\"").as_str()));
    assert_eq!(r.header("accept-ranges"), Some("bytes"));
    assert_eq!(get(&format!("{}/blobs/{}", o.cdn, "0".repeat(64))).status, 404);
}

#[test]
fn small_files_are_served_by_the_hub_with_their_blob_id() {
    let o = start();
    let info = get(&format!("{}/api/models/{REPO}/revision/main", o.endpoint)).json();
    let sibling = info["siblings"].as_array().unwrap().iter().find(|s| s["rfilename"] == SMALL).unwrap().clone();
    let r = get(&resolve_url(&o, "main", SMALL));
    assert_eq!(r.status, 200);
    assert_eq!(r.body, file(SMALL));
    assert_eq!(r.header("etag"), Some(format!("\"{}\"", sibling["blobId"].as_str().unwrap()).as_str()));
    assert_eq!(r.header("x-repo-commit"), Some(COMMIT));
    assert_eq!(r.header("accept-ranges"), Some("bytes"));
    // A commit id works as a revision too.
    assert_eq!(get(&resolve_url(&o, COMMIT, SMALL)).body, file(SMALL));
}

#[test]
fn ranges_on_the_cdn_and_the_hub() {
    let o = start();
    for (url, bytes) in [(cdn_url(&o, BIG), file(BIG)), (resolve_url(&o, "main", SMALL), file(SMALL))] {
        let n = bytes.len();
        let cases = [
            ("bytes=10-99".to_string(), 10, 99),
            ("bytes=100-".to_string(), 100, n - 1),
            ("bytes=-50".to_string(), n - 50, n - 1),
            (format!("bytes=5-{}", n + 1000), 5, n - 1),
        ];
        for (range, a, b) in cases {
            let r = request(&url, "GET", &[("Range", &range)]);
            assert_eq!(r.status, 206, "{range}");
            assert_eq!(r.header("content-range"), Some(format!("bytes {a}-{b}/{n}").as_str()), "{range}");
            assert_eq!(r.content_length(), b - a + 1);
            assert_eq!(r.body, &bytes[a..=b], "{range}");
        }
        let r = request(&url, "GET", &[("Range", &format!("bytes={n}-"))]);
        assert_eq!(r.status, 416);
        assert_eq!(r.header("content-range"), Some(format!("bytes */{n}").as_str()));
        assert!(r.body.is_empty());
    }
}

#[test]
fn head_gives_the_headers_of_the_would_be_body() {
    let o = start();
    let n = file(BIG).len();
    let r = request(&cdn_url(&o, BIG), "HEAD", &[]);
    assert_eq!((r.status, r.content_length(), r.body.len()), (200, n, 0));
    let r = request(&cdn_url(&o, BIG), "HEAD", &[("Range", "bytes=0-9")]);
    assert_eq!((r.status, r.content_length(), r.body.len()), (206, 10, 0));
    assert_eq!(r.header("content-range"), Some(format!("bytes 0-9/{n}").as_str()));
    let r = request(&resolve_url(&o, "main", SMALL), "HEAD", &[]);
    assert_eq!((r.status, r.content_length(), r.body.len()), (200, file(SMALL).len(), 0));
    assert_eq!(o.stats().total_body_bytes(), 0);
}

#[test]
fn if_range_honours_the_range_only_for_the_current_etag() {
    let o = start();
    let bytes = file(BIG);
    let etag = format!("\"{}\"", sha256(&bytes));
    let r = request(&cdn_url(&o, BIG), "GET", &[("Range", "bytes=1000-"), ("If-Range", &etag)]);
    assert_eq!(r.status, 206);
    assert_eq!(r.body, &bytes[1000..]);
    let r = request(&cdn_url(&o, BIG), "GET", &[("Range", "bytes=1000-"), ("If-Range", "\"stale\"")]);
    assert_eq!(r.status, 200);
    assert_eq!(r.body, bytes);
}

#[test]
fn hub_errors_carry_their_codes() {
    let mut private = spec("deltafin/private");
    private.token = Some("sekrit".into());
    let mut gated = spec("deltafin/gated");
    gated.gated = true;
    let o = Origin::start(vec![spec(REPO), private, gated]).unwrap();
    let code = |r: &Reply| r.header("x-error-code").map(str::to_string);

    let r = get(&format!("{}/nobody/nothing/resolve/main/{SMALL}", o.endpoint));
    assert_eq!((r.status, code(&r).as_deref()), (401, Some("RepoNotFound")));
    assert!(r.json()["error"].is_string());
    let r = get(&format!("{}/api/models/nobody/nothing/revision/main", o.endpoint));
    assert_eq!((r.status, code(&r).as_deref()), (401, Some("RepoNotFound")));

    let private_url = format!("{}/deltafin/private/resolve/main/{SMALL}", o.endpoint);
    assert_eq!(get(&private_url).status, 401);
    assert_eq!(request(&private_url, "GET", &[("Authorization", "Bearer wrong")]).status, 401);
    let r = request(&private_url, "GET", &[("Authorization", "Bearer sekrit")]);
    assert_eq!((r.status, r.body), (200, file(SMALL)));

    let r = get(&format!("{}/deltafin/gated/resolve/main/{SMALL}", o.endpoint));
    assert_eq!((r.status, code(&r).as_deref()), (403, Some("GatedRepo")));
    let r = get(&format!("{}/api/models/deltafin/gated/revision/main", o.endpoint));
    assert_eq!((r.status, code(&r).as_deref()), (403, Some("GatedRepo")));

    let r = get(&resolve_url(&o, "main", "missing.bin"));
    assert_eq!((r.status, code(&r).as_deref()), (404, Some("EntryNotFound")));
    assert_eq!(r.header("x-repo-commit"), Some(COMMIT));
    let r = get(&resolve_url(&o, "nosuchbranch", SMALL));
    assert_eq!((r.status, code(&r).as_deref()), (404, Some("RevisionNotFound")));
    let r = get(&format!("{}/api/models/{REPO}/revision/{}", o.endpoint, "f".repeat(40)));
    assert_eq!((r.status, code(&r).as_deref()), (404, Some("RevisionNotFound")));

    assert_eq!(request(&resolve_url(&o, "main", SMALL), "POST", &[("Content-Length", "0")]).status, 405);
    let s = o.stats();
    assert_eq!(s.status_counts[&401], 4);
    assert_eq!(s.status_counts[&404], 3);
}

#[test]
fn status_faults_count_down() {
    let o = start();
    o.set_faults(vec![fault(SMALL, FaultKind::Status(503), 2, Where::Hub)]);
    let url = resolve_url(&o, "main", SMALL);
    assert_eq!(get(&url).status, 503);
    // Other files are not matched.
    assert_eq!(get(&resolve_url(&o, "main", "tiktoken.model")).status, 200);
    assert_eq!(get(&url).status, 503);
    assert_eq!(get(&url).status, 200);
    assert_eq!(o.stats().status_counts[&503], 2);

    o.set_faults(vec![fault("", FaultKind::TooMany { retry_after_s: 7 }, 1, Where::Cdn)]);
    // The Hub's redirect is not on the CDN: unaffected.
    assert_eq!(get(&resolve_url(&o, "main", BIG)).status, 302);
    let r = get(&cdn_url(&o, BIG));
    assert_eq!((r.status, r.header("retry-after")), (429, Some("7")));
    assert_eq!(get(&cdn_url(&o, BIG)).status, 200);

    // A Hub fault on an LFS file hits the redirect.
    o.set_faults(vec![fault("00002", FaultKind::Status(500), u32::MAX, Where::Hub)]);
    for _ in 0..3 {
        assert_eq!(get(&resolve_url(&o, "main", BIG)).status, 500);
    }
    assert_eq!(get(&cdn_url(&o, BIG)).status, 200);
}

#[test]
fn api_faults_match_only_the_api() {
    let o = start();
    o.set_faults(vec![fault("api", FaultKind::Status(500), 1, Where::Both)]);
    assert_eq!(get(&resolve_url(&o, "main", SMALL)).status, 200);
    let api = format!("{}/api/models/{REPO}/revision/main", o.endpoint);
    assert_eq!(get(&api).status, 500);
    assert_eq!(get(&api).status, 200);

    o.set_faults(vec![fault("api", FaultKind::Drop { after_bytes: 20 }, 1, Where::Hub)]);
    let r = get(&api);
    assert_eq!(r.status, 200);
    assert_eq!(r.body.len(), 20);
    assert!(r.content_length() > 20);
}

#[test]
fn drop_sends_headers_then_part_of_the_body_then_eof() {
    let o = start();
    let bytes = file(BIG);
    o.set_faults(vec![fault("00002", FaultKind::Drop { after_bytes: 1000 }, 1, Where::Cdn)]);
    let r = get(&cdn_url(&o, BIG));
    assert_eq!(r.status, 200);
    assert_eq!(r.content_length(), bytes.len());
    assert_eq!(r.body, &bytes[..1000]);
    assert_eq!(o.stats().body_bytes[BIG], 1000);
    // Spent: the next try gets everything.
    assert_eq!(get(&cdn_url(&o, BIG)).body, bytes);

    // On a range, the cut counts from the range's start.
    o.set_faults(vec![fault("", FaultKind::Drop { after_bytes: 70_000 }, 1, Where::Both)]);
    let r = request(&cdn_url(&o, BIG), "GET", &[("Range", "bytes=1000-")]);
    assert_eq!((r.status, r.content_length()), (206, bytes.len() - 1000));
    assert_eq!(r.body, &bytes[1000..71_000]);
}

#[test]
fn slow_throttles_the_body() {
    let o = start();
    let name = "model-00010-of-000011.safetensors";
    let bytes = file(name);
    o.set_faults(vec![fault(name, FaultKind::Slow { bytes_per_sec: 10_000 }, 1, Where::Cdn)]);
    let t = Instant::now();
    let r = get(&cdn_url(&o, name));
    let elapsed = t.elapsed();
    assert_eq!(r.body, bytes);
    // 5808 bytes at 10 kB/s: about 0.58 s.
    assert!(elapsed >= Duration::from_millis(450), "{elapsed:?}");
    assert!(elapsed < Duration::from_secs(5), "{elapsed:?}");
    let t = Instant::now();
    assert_eq!(get(&cdn_url(&o, name)).body, bytes);
    assert!(t.elapsed() < Duration::from_millis(400));
}

#[test]
fn range_faults_fire_only_on_ranged_requests() {
    let o = start();
    let bytes = file(BIG);
    let n = bytes.len();
    o.set_faults(vec![fault("", FaultKind::IgnoreRange, 1, Where::Cdn)]);
    // A plain GET does not use the rule up.
    assert_eq!(get(&cdn_url(&o, BIG)).status, 200);
    let r = request(&cdn_url(&o, BIG), "GET", &[("Range", "bytes=100-199")]);
    assert_eq!((r.status, r.content_length()), (200, n));
    assert_eq!(r.body, bytes);
    assert_eq!(request(&cdn_url(&o, BIG), "GET", &[("Range", "bytes=100-199")]).status, 206);

    o.set_faults(vec![fault("", FaultKind::WrongRange, 2, Where::Cdn)]);
    let r = request(&cdn_url(&o, BIG), "GET", &[("Range", "bytes=100-199")]);
    assert_eq!(r.status, 206);
    assert_eq!(r.header("content-range"), Some(format!("bytes 101-200/{n}").as_str()));
    assert_eq!(r.body, &bytes[101..=200]);
    // A range that ends at the last byte shifts back instead.
    let r = request(&cdn_url(&o, BIG), "GET", &[("Range", "bytes=-10")]);
    assert_eq!(r.header("content-range"), Some(format!("bytes {}-{}/{n}", n - 11, n - 2).as_str()));
    assert_eq!(r.body, &bytes[n - 11..n - 1]);
}

#[test]
fn wrong_length_announces_more_than_it_sends() {
    let o = start();
    let bytes = file(SMALL);
    o.set_faults(vec![fault(SMALL, FaultKind::WrongLength, 1, Where::Hub)]);
    let r = get(&resolve_url(&o, "main", SMALL));
    assert_eq!(r.status, 200);
    assert!(r.content_length() > bytes.len());
    assert_eq!(r.body, bytes);
}

#[test]
fn corrupt_flips_exactly_one_byte() {
    let o = start();
    let bytes = file(BIG);
    o.set_faults(vec![fault(BIG, FaultKind::Corrupt, 1, Where::Both)]);
    let r = get(&cdn_url(&o, BIG));
    assert_eq!((r.status, r.content_length(), r.body.len()), (200, bytes.len(), bytes.len()));
    assert_eq!(r.body.iter().zip(&bytes).filter(|(a, b)| a != b).count(), 1);
    assert_eq!(get(&cdn_url(&o, BIG)).body, bytes);
}

#[test]
fn stats_count_requests_and_body_bytes() {
    let o = start();
    get(&format!("{}/api/models/{REPO}/revision/main", o.endpoint));
    o.reset_stats();
    let mut expected = 0;
    for name in fixture_names() {
        let r = get(&resolve_url(&o, "main", &name));
        let r = if r.status == 302 { get(r.header("location").unwrap()) } else { r };
        assert_eq!(r.body, file(&name));
        expected += r.body.len() as u64;
    }
    request(&cdn_url(&o, BIG), "GET", &[("Range", "bytes=0-99")]);
    request(&cdn_url(&o, BIG), "HEAD", &[("Authorization", "Bearer leaked")]);
    let s = o.stats();
    assert_eq!(s.total_body_bytes(), expected + 100);
    assert_eq!(s.body_bytes[BIG], file(BIG).len() as u64 + 100);
    assert_eq!(s.body_bytes[SMALL], file(SMALL).len() as u64);
    let lfs = fixture_names().iter().filter(|n| n.ends_with(".safetensors")).count() as u64;
    assert_eq!(s.requests, fixture_names().len() as u64 + lfs + 2);
    assert_eq!(s.status_counts[&302], lfs);
    assert_eq!(s.range_requests, 1);
    assert_eq!(s.api_requests, 0);
    assert_eq!(s.cdn_requests_with_authorization, 1);
}

#[test]
fn the_rate_limit_holds_over_both_listeners_together() {
    let o = start();
    let index = "model.safetensors.index.json";
    // Per client: the largest shard twice from the CDN and the index from the Hub.
    let per_client = 2 * file(BIG).len() + file(index).len();
    let clients = 4;
    let fetch_all = |o: &Origin| {
        let (cdn, hub) = (cdn_url(o, BIG), resolve_url(o, COMMIT, index));
        let t = Instant::now();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..clients)
                .map(|_| {
                    s.spawn(|| {
                        let n = get(&cdn).body.len() + get(&hub).body.len() + get(&cdn).body.len();
                        assert_eq!(n, per_client);
                    })
                })
                .collect();
            handles.into_iter().for_each(|h| h.join().unwrap());
        });
        t.elapsed().as_secs_f64()
    };
    let rate = 1_000_000u64;
    o.set_rate(Some(rate));
    let expected = (clients * per_client) as f64 / rate as f64; // 1.43 s
    let took = fetch_all(&o);
    // Every byte is paid for before it is sent: never faster than the rate (a little slack for
    // timer rounding), and not much slower than it either.
    assert!(took >= 0.95 * expected, "{took:.3} s for {expected:.3} s of bytes at the rate");
    assert!(took <= 1.5 * expected, "{took:.3} s for {expected:.3} s of bytes at the rate");
    o.set_rate(None);
    let took = fetch_all(&o);
    assert!(took < 0.5 * expected, "unlimited again: {took:.3} s");
}

#[test]
fn move_branch_changes_the_commit_and_the_files() {
    let o = start();
    let dir = tempfile::tempdir().unwrap();
    for name in fixture_names() {
        std::fs::copy(fixture().join(&name), dir.path().join(&name)).unwrap();
    }
    std::fs::write(dir.path().join(SMALL), b"{\"moved\": true}\n").unwrap();
    let mut weights = file(BIG);
    weights[500] ^= 1;
    std::fs::write(dir.path().join(BIG), &weights).unwrap();
    let new_commit = "fedcba9876543210fedcba9876543210fedcba98";
    o.move_branch(REPO, "main", new_commit, dir.path().to_path_buf());

    let info = get(&format!("{}/api/models/{REPO}/revision/main", o.endpoint)).json();
    assert_eq!(info["sha"], new_commit);
    let r = get(&resolve_url(&o, "main", SMALL));
    assert_eq!(r.header("x-repo-commit"), Some(new_commit));
    assert_eq!(r.body, b"{\"moved\": true}\n");
    let redirect = get(&resolve_url(&o, "main", BIG));
    assert_eq!(get(redirect.header("location").unwrap()).body, weights);
    // The old commit is still readable by id, old blob included.
    let r = get(&resolve_url(&o, COMMIT, SMALL));
    assert_eq!((r.header("x-repo-commit"), &r.body), (Some(COMMIT), &file(SMALL)));
    assert_eq!(get(&cdn_url(&o, BIG)).body, file(BIG));
}

#[test]
fn binary_prints_its_urls_and_serves() {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_deltafin-test-origin"))
        .arg("--repo")
        .arg(format!("{REPO}={}", fixture().display()))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let result = std::panic::catch_unwind(|| {
        let (endpoint, cdn) = line.trim().split_once(' ').unwrap();
        let endpoint = endpoint.strip_prefix("endpoint=").unwrap();
        assert!(cdn.starts_with("cdn=http://127.0.0.1:"));
        let r = get(&format!("{endpoint}/api/models/{REPO}/revision/main"));
        assert_eq!(r.status, 200);
        assert_eq!(r.json()["sha"].as_str(), Some(default_commit(REPO).as_str()));
    });
    child.kill().unwrap();
    child.wait().unwrap();
    result.unwrap();
}

#[test]
fn binary_limits_its_rate_and_reports_its_stats() {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_deltafin-test-origin"))
        .arg("--repo")
        .arg(format!("{REPO}={}", fixture().display()))
        .args(["--rate", "500000"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let result = std::panic::catch_unwind(|| {
        let (endpoint, cdn) = line.trim().split_once(' ').unwrap();
        let (endpoint, cdn) = (endpoint.strip_prefix("endpoint=").unwrap(), cdn.strip_prefix("cdn=").unwrap());
        let t = Instant::now();
        let r = get(&format!("{cdn}/blobs/{}", sha256(&file(BIG))));
        let took = t.elapsed().as_secs_f64();
        assert_eq!(r.body, file(BIG));
        // 127,376 bytes at 500 kB/s: 0.25 s.
        assert!((0.24..0.6).contains(&took), "{took:.3} s");
        let s = get(&format!("{endpoint}/_origin/stats")).json();
        assert_eq!(s["body_bytes_total"].as_u64(), Some(file(BIG).len() as u64));
        assert_eq!(s["body_bytes"][BIG].as_u64(), Some(file(BIG).len() as u64));
        assert_eq!(s["requests"].as_u64(), Some(1));
    });
    child.kill().unwrap();
    child.wait().unwrap();
    result.unwrap();
}

#[test]
fn dropping_the_origin_ends_transfers_in_flight() {
    let o = start();
    o.set_faults(vec![fault("", FaultKind::Slow { bytes_per_sec: 1000 }, 1, Where::Cdn)]);
    let url = cdn_url(&o, BIG);
    let client = std::thread::spawn(move || get(&url));
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    drop(o);
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    let r = client.join().unwrap();
    assert_eq!(r.status, 200);
    assert!(r.body.len() < file(BIG).len());
}
