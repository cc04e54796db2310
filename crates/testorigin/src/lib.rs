//! A stand-in for the Hugging Face Hub on loopback, for tests of `deltafin install`.
//!
//! Two listeners: the Hub (`endpoint`: the model API and `resolve`) and its CDN (`cdn`), to
//! which the Hub redirects LFS files, as the real one does, so that a client's cross-host
//! redirect handling is exercised. Faults (errors, drops, throttling, bad ranges, corruption) are
//! injected per file by rules that tests set and replace while the server runs, and stats count
//! what was sent.

mod body;
mod faults;
mod hub;
mod ranges;
mod rate;
mod replies;
mod serve_file;
mod snapshot;
mod state;

use std::collections::BTreeMap;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::oneshot;

use crate::state::{Repo, Shared, lock};

/// A repo to serve.
#[derive(Debug, Clone)]
pub struct RepoSpec {
    /// "org/name".
    pub repo: String,
    /// A flat directory of files: a HF checkpoint. Every `*.safetensors` is an LFS file.
    pub dir: PathBuf,
    /// Branch -> 40-hex commit; "main" at least. All of them start on `dir`.
    pub branches: Vec<(String, String)>,
    /// When Some, requests need `Authorization: Bearer <token>` (401 otherwise).
    pub token: Option<String>,
    /// 403 with `X-Error-Code: GatedRepo` for everything.
    pub gated: bool,
}

/// Which listener a fault applies on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Where {
    Hub,
    Cdn,
    Both,
}

/// A fault rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// Substring of the file name to match; "" matches all resolve/CDN requests; "api" matches
    /// the API route.
    pub file: String,
    pub kind: FaultKind,
    /// Fires this many times then stops; `u32::MAX` = always. A rule fires only on a request
    /// where it has an effect (a body fault on a response with a body, a range fault on a 206).
    pub times: u32,
    pub on: Where,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// This status instead of the answer, e.g. 500, 503, 404, 408.
    Status(u16),
    /// 429 with `Retry-After`.
    TooMany { retry_after_s: u64 },
    /// The right headers (Content-Length of the full answer), then `after_bytes` of the body,
    /// then the connection is aborted.
    Drop { after_bytes: u64 },
    /// The body throttled to this rate.
    Slow { bytes_per_sec: u64 },
    /// A Range request answered with 200 and the whole file.
    IgnoreRange,
    /// A Range request answered with 206 for the range shifted by one byte (later, or earlier
    /// when it ends at the last byte), with a matching Content-Range and body.
    WrongRange,
    /// A Content-Length larger than the body actually sent, then the connection is closed.
    WrongLength,
    /// One byte of the body flipped (lengths correct).
    Corrupt,
}

/// What the server has seen since start or the last `reset_stats`.
#[derive(Clone, Default, Debug)]
pub struct Stats {
    /// File name -> body bytes sent (Hub + CDN together; API bodies are not counted).
    pub body_bytes: BTreeMap<String, u64>,
    pub requests: u64,
    /// Requests with a `Range` header.
    pub range_requests: u64,
    pub api_requests: u64,
    pub status_counts: BTreeMap<u16, u64>,
    /// Must stay 0: clients must drop Authorization on the cross-host redirect.
    pub cdn_requests_with_authorization: u64,
}

impl Stats {
    pub fn total_body_bytes(&self) -> u64 {
        self.body_bytes.values().sum()
    }
}

/// A running server; dropping it shuts it down.
pub struct Origin {
    /// "http://127.0.0.1:PORT": the Hub.
    pub endpoint: String,
    /// "http://127.0.0.1:PORT2": the CDN the Hub redirects LFS files to.
    pub cdn: String,
    shared: Arc<Shared>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

/// A repeatable 40-hex commit id for a repo (the binary's default).
pub fn default_commit(repo: &str) -> String {
    snapshot::sha256_hex(&format!("deltafin-test-origin commit of {repo}"))[..40].to_string()
}

impl Origin {
    /// Hashes the repos' files, binds both listeners to 127.0.0.1 on free ports and serves them
    /// from a tokio runtime on a background thread. Returns once both are listening.
    pub fn start(repos: Vec<RepoSpec>) -> io::Result<Origin> {
        Origin::start_on_ports(repos, 0, 0)
    }

    /// `start` with given ports (0: any free one), for the binary.
    pub fn start_on_ports(repos: Vec<RepoSpec>, hub_port: u16, cdn_port: u16) -> io::Result<Origin> {
        let hub_listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], hub_port)))?;
        let cdn_listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], cdn_port)))?;
        let endpoint = format!("http://{}", hub_listener.local_addr()?);
        let cdn = format!("http://{}", cdn_listener.local_addr()?);
        let shared = Arc::new(Shared::new(cdn.clone(), repos)?);
        for l in [&hub_listener, &cdn_listener] {
            l.set_nonblocking(true)?;
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("test-origin")
            .enable_all()
            .build()?;
        let (shutdown, stop) = oneshot::channel::<()>();
        let (hub_app, cdn_app) = (hub::hub_router(shared.clone()), hub::cdn_router(shared.clone()));
        // Register the listeners with the runtime here, so that an error is returned by `start`.
        let (hub_listener, cdn_listener) = {
            let _guard = runtime.enter();
            (tokio::net::TcpListener::from_std(hub_listener)?, tokio::net::TcpListener::from_std(cdn_listener)?)
        };
        let thread = std::thread::Builder::new().name("test-origin".into()).spawn(move || {
            runtime.block_on(async move {
                use axum::serve::ListenerExt;
                // No Nagle: a body sent in several writes would otherwise stall 40 ms per write
                // on the client's delayed ACK, which no real CDN does.
                let nodelay = |s: &mut tokio::net::TcpStream| {
                    let _ = s.set_nodelay(true);
                };
                let (hub_listener, cdn_listener) = (hub_listener.tap_io(nodelay), cdn_listener.tap_io(nodelay));
                tokio::spawn(async move { axum::serve(hub_listener, hub_app).await });
                tokio::spawn(async move { axum::serve(cdn_listener, cdn_app).await });
                // Both the sender's send and its drop (a panicking test) stop the server.
                let _ = stop.await;
            });
            // Dropping the tasks closes the listeners and every open connection, slow ones too.
            runtime.shutdown_timeout(Duration::from_secs(2));
        })?;
        Ok(Origin { endpoint, cdn, shared, shutdown: Some(shutdown), thread: Some(thread) })
    }

    /// Limits the bytes per second of every body sent, both listeners together (None:
    /// unlimited), as a link of that bandwidth would; from the next chunk of every transfer, those
    /// in flight included. A `Slow` fault still throttles its own body further.
    pub fn set_rate(&self, bytes_per_sec: Option<u64>) {
        self.shared.limiter.set_rate(bytes_per_sec);
    }

    /// Replaces the fault rules.
    pub fn set_faults(&self, faults: Vec<Fault>) {
        *lock(&self.shared.faults) = faults;
    }

    /// Points `branch` of `repo` at `commit`, whose files are those of `dir` (hashed now), as
    /// when someone pushes during an install. The old commit stays readable by its id.
    ///
    /// # Panics
    /// If `repo` is not served or `dir` cannot be read: both are mistakes in the test.
    pub fn move_branch(&self, repo: &str, branch: &str, commit: &str, dir: PathBuf) {
        let snapshot = self.shared.scan(&dir).unwrap_or_else(|e| panic!("move_branch: {}: {e}", dir.display()));
        let mut repos = lock(&self.shared.repos);
        let r: &mut Repo = repos.get_mut(repo).unwrap_or_else(|| panic!("move_branch: {repo} is not served"));
        r.commits.insert(commit.to_string(), snapshot);
        r.branches.insert(branch.to_string(), commit.to_string());
    }

    pub fn stats(&self) -> Stats {
        self.shared.stats().clone()
    }

    pub fn reset_stats(&self) {
        *self.shared.stats() = Stats::default();
    }
}

impl Drop for Origin {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
