//! The routes: the Hub's model API and `resolve`, and the CDN's `/blobs/{sha256}`.
//!
//! Paths are split by hand in one fallback handler rather than by axum's router, so that every
//! unknown path, method or repo gets a Hub-shaped error and is still counted.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, Method, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use serde_json::{Value, json};

use crate::FaultKind;
use crate::body::{BodyFault, BodyPlan, Source};
use crate::faults::{self, Listener, Shape, Target};
use crate::replies::{self, X_REPO_COMMIT, hub_error, set};
use crate::serve_file::{FileRequest, serve_file};
use crate::snapshot::Snapshot;
use crate::state::{Shared, lock};

pub(crate) fn hub_router(shared: Arc<Shared>) -> Router {
    Router::new().fallback(hub).with_state(shared)
}

pub(crate) fn cdn_router(shared: Arc<Shared>) -> Router {
    Router::new().fallback(cdn).with_state(shared)
}

/// Not a Hub route: the stats as JSON, for benches that run the binary. Not counted itself.
const STATS_PATH: &str = "/_origin/stats";

async fn hub(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    if req.uri().path() == STATS_PATH && req.method() == Method::GET {
        return stats_reply(&shared);
    }
    count_request(&shared, req.headers());
    let resp = hub_answer(&shared, &req);
    count_status(&shared, &resp);
    resp
}

async fn cdn(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    count_request(&shared, req.headers());
    if req.headers().contains_key(header::AUTHORIZATION) {
        shared.stats().cdn_requests_with_authorization += 1;
    }
    let resp = cdn_answer(&shared, &req);
    count_status(&shared, &resp);
    resp
}

fn stats_reply(shared: &Shared) -> Response {
    let s = shared.stats().clone();
    let body = json!({
        "body_bytes_total": s.total_body_bytes(),
        "body_bytes": s.body_bytes,
        "requests": s.requests,
        "range_requests": s.range_requests,
        "api_requests": s.api_requests,
        "status_counts": s.status_counts.iter().map(|(k, v)| (k.to_string(), Value::from(*v))).collect::<serde_json::Map<_, _>>(),
    })
    .to_string();
    let mut resp = Response::new(Body::from(body));
    set(&mut resp, header::CONTENT_TYPE, "application/json");
    resp
}

fn count_request(shared: &Shared, headers: &HeaderMap) {
    let mut stats = shared.stats();
    stats.requests += 1;
    if headers.contains_key(header::RANGE) {
        stats.range_requests += 1;
    }
}

fn count_status(shared: &Shared, resp: &Response) {
    *shared.stats().status_counts.entry(resp.status().as_u16()).or_default() += 1;
}

/// GET is false, HEAD is true, anything else is refused.
fn is_head(req: &Request) -> Option<bool> {
    match *req.method() {
        Method::GET => Some(false),
        Method::HEAD => Some(true),
        _ => None,
    }
}

fn hub_answer(shared: &Shared, req: &Request) -> Response {
    let Some(is_head) = is_head(req) else { return replies::method_not_allowed() };
    let segments: Vec<&str> = req.uri().path().trim_start_matches('/').split('/').collect();
    match segments.as_slice() {
        ["api", "models", org, name] => api(shared, req.headers(), &format!("{org}/{name}"), "main", is_head),
        ["api", "models", org, name, "revision", rev] => {
            api(shared, req.headers(), &format!("{org}/{name}"), rev, is_head)
        }
        [org, name, "resolve", rev, file] => {
            resolve(shared, req.headers(), &format!("{org}/{name}"), rev, file, is_head)
        }
        // A file one folder down (a repository's `figures/`, say).
        [org, name, "resolve", rev, dir, file] => {
            resolve(shared, req.headers(), &format!("{org}/{name}"), rev, &format!("{dir}/{file}"), is_head)
        }
        _ => replies::not_found(),
    }
}

fn cdn_answer(shared: &Shared, req: &Request) -> Response {
    let Some(is_head) = is_head(req) else { return replies::method_not_allowed() };
    let Some(sha) = req.uri().path().strip_prefix("/blobs/") else { return replies::not_found() };
    let Some(blob) = lock(&shared.blobs).get(sha).cloned() else { return replies::not_found() };
    let file = FileRequest {
        listener: Listener::Cdn,
        name: &blob.name,
        path: &blob.path,
        size: blob.size,
        etag: format!("\"{sha}\""),
        commit: None,
    };
    serve_file(shared, req.headers(), is_head, file)
}

/// A revision of a repo that the request may read.
struct Opened {
    commit: String,
    snapshot: Arc<Snapshot>,
}

/// Why a request may not read a revision, in the order the Hub checks.
enum Refusal {
    /// Unknown repo, or a private one without credentials: the Hub answers both alike, so as not
    /// to tell a private repo from a missing one.
    RepoNotFound,
    BadCredentials,
    Gated,
    RevisionNotFound,
}

impl Refusal {
    fn reply(self, repo: &str, rev: &str) -> Response {
        match self {
            Refusal::RepoNotFound => {
                hub_error(StatusCode::UNAUTHORIZED, Some("RepoNotFound"), "Repository not found", None)
            }
            Refusal::BadCredentials => {
                hub_error(StatusCode::UNAUTHORIZED, None, "Invalid credentials in Authorization header", None)
            }
            Refusal::Gated => {
                let message =
                    format!("Access to model {repo} is restricted. You must have access to it and be authenticated.");
                hub_error(StatusCode::FORBIDDEN, Some("GatedRepo"), &message, None)
            }
            Refusal::RevisionNotFound => {
                hub_error(StatusCode::NOT_FOUND, Some("RevisionNotFound"), &format!("Invalid rev id: {rev}"), None)
            }
        }
    }
}

/// The Hub's checks: repo, credentials, gate, revision.
fn open(shared: &Shared, headers: &HeaderMap, repo: &str, rev: &str) -> Result<Opened, Refusal> {
    let repos = lock(&shared.repos);
    let r = repos.get(repo).ok_or(Refusal::RepoNotFound)?;
    if let Some(token) = &r.token {
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")));
        match bearer {
            None => return Err(Refusal::RepoNotFound),
            Some(given) if given.trim() != token => return Err(Refusal::BadCredentials),
            Some(_) => {}
        }
    }
    if r.gated {
        return Err(Refusal::Gated);
    }
    let commit = match r.branches.get(rev) {
        Some(commit) => commit.clone(),
        None => rev.to_string(),
    };
    let snapshot = r.commits.get(&commit).ok_or(Refusal::RevisionNotFound)?;
    Ok(Opened { snapshot: snapshot.clone(), commit })
}

/// `GET /api/models/{repo}/revision/{rev}`: the commit and its files with sizes and hashes (as
/// with `?blobs=true`, which the Hub needs for them; here they are always there).
fn api(shared: &Shared, headers: &HeaderMap, repo: &str, rev: &str, is_head: bool) -> Response {
    shared.stats().api_requests += 1;
    let opened = match open(shared, headers, repo, rev) {
        Ok(opened) => opened,
        Err(refusal) => return refusal.reply(repo, rev),
    };
    let commit = Some(opened.commit.as_str());
    let shape = if is_head { Shape::NoBody } else { Shape::Body { ranged: false } };
    let fault = faults::take(&mut lock(&shared.faults), Listener::Hub, Target::Api, shape);
    let body_fault = match fault {
        Some(FaultKind::Status(code)) => return replies::injected_status(code, commit),
        Some(FaultKind::TooMany { retry_after_s }) => return replies::too_many(retry_after_s, commit),
        Some(FaultKind::Drop { after_bytes }) => Some(BodyFault::Drop { after_bytes }),
        Some(FaultKind::Slow { bytes_per_sec }) => Some(BodyFault::Slow { bytes_per_sec }),
        Some(FaultKind::WrongLength) => Some(BodyFault::WrongLength),
        Some(FaultKind::Corrupt) => Some(BodyFault::Corrupt),
        // Range faults never fire here (the API is not ranged).
        Some(FaultKind::IgnoreRange | FaultKind::WrongRange) | None => None,
    };
    let json = Bytes::from(model_info(repo, &opened).to_string());
    let plan = BodyPlan {
        len: json.len() as u64,
        source: Source::Memory(json),
        start: 0,
        fault: body_fault,
        // Metadata is not a file: body_bytes stays the sum of file bytes.
        count_as: None,
        stats: shared.stats.clone(),
        limiter: shared.limiter.clone(),
    };
    let content_length = plan.content_length();
    let mut resp = Response::new(if is_head { Body::empty() } else { plan.into_body() });
    set(&mut resp, header::CONTENT_LENGTH, &content_length.to_string());
    set(&mut resp, header::CONTENT_TYPE, "application/json");
    set(&mut resp, HeaderName::from_static(X_REPO_COMMIT), &opened.commit);
    resp
}

fn model_info(repo: &str, opened: &Opened) -> Value {
    let siblings: Vec<Value> = opened
        .snapshot
        .files
        .iter()
        .map(|(name, f)| {
            let mut sibling = json!({ "rfilename": name, "size": f.size, "blobId": f.blob_id });
            if let Some(pointer_size) = f.lfs_pointer_size {
                sibling["lfs"] = json!({ "sha256": f.sha256, "size": f.size, "pointerSize": pointer_size });
            }
            sibling
        })
        .collect();
    json!({ "id": repo, "modelId": repo, "sha": opened.commit, "private": false, "siblings": siblings })
}

/// `GET|HEAD /{repo}/resolve/{rev}/{file}`: LFS files redirect to the CDN, others are served here.
fn resolve(shared: &Shared, headers: &HeaderMap, repo: &str, rev: &str, file: &str, is_head: bool) -> Response {
    let opened = match open(shared, headers, repo, rev) {
        Ok(opened) => opened,
        Err(refusal) => return refusal.reply(repo, rev),
    };
    let commit = Some(opened.commit.as_str());
    let Some(entry) = opened.snapshot.files.get(file) else {
        let message = format!("Entry not found: {file}");
        return hub_error(StatusCode::NOT_FOUND, Some("EntryNotFound"), &message, commit);
    };
    if entry.lfs_pointer_size.is_none() {
        let small = FileRequest {
            listener: Listener::Hub,
            name: file,
            path: &entry.path,
            size: entry.size,
            etag: format!("\"{}\"", entry.blob_id),
            commit,
        };
        return serve_file(shared, headers, is_head, small);
    }
    match faults::take(&mut lock(&shared.faults), Listener::Hub, Target::File(file), Shape::NoBody) {
        Some(FaultKind::Status(code)) => return replies::injected_status(code, commit),
        Some(FaultKind::TooMany { retry_after_s }) => return replies::too_many(retry_after_s, commit),
        _ => {}
    }
    // The CDN URL carries no credentials (the real one is signed): a client must not forward
    // its Authorization header there, and the CDN counts the ones that do.
    let etag = format!("\"{}\"", entry.sha256);
    let mut resp = Response::new(Body::empty());
    *resp.status_mut() = StatusCode::FOUND;
    set(&mut resp, header::LOCATION, &format!("{}/blobs/{}", shared.cdn, entry.sha256));
    set(&mut resp, header::ETAG, &etag);
    set(&mut resp, HeaderName::from_static("x-linked-etag"), &etag);
    set(&mut resp, HeaderName::from_static("x-linked-size"), &entry.size.to_string());
    set(&mut resp, HeaderName::from_static(X_REPO_COMMIT), &opened.commit);
    resp
}
