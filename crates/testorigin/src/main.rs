//! `deltafin-test-origin --repo org/name=DIR [--repo ...] [--commit 40hex] [--token T] [--gated]
//! [--port P] [--cdn-port Q] [--rate BYTES_PER_SEC]`: serves the repos as a Hub on loopback until
//! killed, for benches and manual runs of `deltafin install`. Prints `endpoint=URL cdn=URL` once
//! listening. `--rate` limits the body bytes of both listeners together, as a link of that
//! bandwidth would; `GET ENDPOINT/_origin/stats` answers the bytes and requests served so far.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use deltafin_test_origin::{Origin, RepoSpec, default_commit};

const USAGE: &str = "usage: deltafin-test-origin --repo org/name=DIR [--repo ...] [--commit 40hex] [--token T] \
                     [--gated] [--port P] [--cdn-port Q] [--rate BYTES_PER_SEC]";

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("deltafin-test-origin: {message}\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<(), String> {
    let mut repos: Vec<(String, PathBuf)> = Vec::new();
    let (mut commit, mut token, mut gated, mut port, mut cdn_port) = (None, None, false, 0u16, 0u16);
    let mut rate: Option<u64> = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--repo" => {
                let v = value()?;
                let (repo, dir) = v.split_once('=').ok_or("--repo takes org/name=DIR")?;
                if repo.split('/').count() != 2 {
                    return Err(format!("{repo}: a repo is org/name"));
                }
                repos.push((repo.to_string(), PathBuf::from(dir)));
            }
            "--commit" => {
                let v = value()?;
                if v.len() != 40 || !v.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(format!("{v}: a commit is 40 hex digits"));
                }
                commit = Some(v.to_ascii_lowercase());
            }
            "--token" => token = Some(value()?),
            "--gated" => gated = true,
            "--port" => port = value()?.parse().map_err(|e| format!("--port: {e}"))?,
            "--cdn-port" => cdn_port = value()?.parse().map_err(|e| format!("--cdn-port: {e}"))?,
            "--rate" => {
                let r: u64 = value()?.parse().map_err(|e| format!("--rate: {e}"))?;
                if r == 0 {
                    return Err("--rate: bytes per second, at least 1".into());
                }
                rate = Some(r);
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if repos.is_empty() {
        return Err("no --repo given".into());
    }
    let specs = repos
        .into_iter()
        .map(|(repo, dir)| RepoSpec {
            branches: vec![("main".into(), commit.clone().unwrap_or_else(|| default_commit(&repo)))],
            repo,
            dir,
            token: token.clone(),
            gated,
        })
        .collect();
    let origin = Origin::start_on_ports(specs, port, cdn_port).map_err(|e| e.to_string())?;
    origin.set_rate(rate);
    let mut out = std::io::stdout();
    writeln!(out, "endpoint={} cdn={}", origin.endpoint, origin.cdn).map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    // The server runs on its own thread; this one only keeps the process (and `origin`) alive.
    loop {
        std::thread::park();
    }
}
