//! A file's GET or HEAD, on the Hub (small files) or the CDN (LFS objects): ranges, `If-Range`,
//! ETags and the file faults.

use std::path::Path;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, StatusCode, header};
use axum::response::Response;

use crate::FaultKind;
use crate::body::{BodyFault, BodyPlan, Source};
use crate::faults::{self, Listener, Shape, Target};
use crate::ranges::{self, RangeAnswer};
use crate::replies::{self, X_REPO_COMMIT, set};
use crate::state::{Shared, lock};

pub(crate) struct FileRequest<'a> {
    pub listener: Listener,
    /// The file name: what fault rules match and what stats count under.
    pub name: &'a str,
    pub path: &'a Path,
    pub size: u64,
    /// The quoted ETag.
    pub etag: String,
    /// For `X-Repo-Commit` (the Hub sends it, the CDN does not).
    pub commit: Option<&'a str>,
}

pub(crate) fn serve_file(shared: &Shared, headers: &HeaderMap, is_head: bool, f: FileRequest<'_>) -> Response {
    let text = |name: HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
    let mut answer = if ranges::if_range_allows(text(header::IF_RANGE), &f.etag) {
        ranges::answer(text(header::RANGE), f.size)
    } else {
        RangeAnswer::Whole
    };
    let shape = match answer {
        _ if is_head => Shape::NoBody,
        RangeAnswer::Unsatisfiable => Shape::NoBody,
        RangeAnswer::Partial { .. } => Shape::Body { ranged: true },
        RangeAnswer::Whole => Shape::Body { ranged: false },
    };
    let fault = faults::take(&mut lock(&shared.faults), f.listener, Target::File(f.name), shape);
    let mut body_fault = None;
    match fault {
        None => {}
        Some(FaultKind::Status(code)) => return replies::injected_status(code, f.commit),
        Some(FaultKind::TooMany { retry_after_s }) => return replies::too_many(retry_after_s, f.commit),
        Some(FaultKind::IgnoreRange) => answer = RangeAnswer::Whole,
        Some(FaultKind::WrongRange) => answer = shifted(answer, f.size),
        Some(FaultKind::Drop { after_bytes }) => body_fault = Some(BodyFault::Drop { after_bytes }),
        Some(FaultKind::Slow { bytes_per_sec }) => body_fault = Some(BodyFault::Slow { bytes_per_sec }),
        Some(FaultKind::WrongLength) => body_fault = Some(BodyFault::WrongLength),
        Some(FaultKind::Corrupt) => body_fault = Some(BodyFault::Corrupt),
    }

    let (status, start, len) = match answer {
        RangeAnswer::Whole => (StatusCode::OK, 0, f.size),
        RangeAnswer::Partial { start, end } => (StatusCode::PARTIAL_CONTENT, start, end - start + 1),
        RangeAnswer::Unsatisfiable => {
            let mut resp = Response::new(Body::empty());
            *resp.status_mut() = StatusCode::RANGE_NOT_SATISFIABLE;
            set(&mut resp, header::CONTENT_RANGE, &format!("bytes */{}", f.size));
            common_headers(&mut resp, &f);
            return resp;
        }
    };
    let plan = BodyPlan {
        source: Source::File(f.path.to_path_buf()),
        start,
        len,
        fault: body_fault,
        count_as: Some(f.name.to_string()),
        stats: shared.stats.clone(),
        limiter: shared.limiter.clone(),
    };
    let content_length = plan.content_length();
    // hyper keeps our Content-Length on a HEAD reply with an empty body, and never sends one.
    let mut resp = Response::new(if is_head { Body::empty() } else { plan.into_body() });
    *resp.status_mut() = status;
    set(&mut resp, header::CONTENT_LENGTH, &content_length.to_string());
    if status == StatusCode::PARTIAL_CONTENT {
        set(&mut resp, header::CONTENT_RANGE, &format!("bytes {}-{}/{}", start, start + len - 1, f.size));
    }
    common_headers(&mut resp, &f);
    resp
}

fn common_headers(resp: &mut Response, f: &FileRequest<'_>) {
    set(resp, header::ETAG, &f.etag);
    set(resp, header::ACCEPT_RANGES, "bytes");
    set(resp, header::CONTENT_TYPE, "application/octet-stream");
    if let Some(commit) = f.commit {
        set(resp, HeaderName::from_static(X_REPO_COMMIT), commit);
    }
}

/// `WrongRange`: the same length one byte later, or one byte earlier when the range already ends
/// at the last byte (a one-byte file cannot shift and is answered as asked).
fn shifted(answer: RangeAnswer, size: u64) -> RangeAnswer {
    match answer {
        RangeAnswer::Partial { start, end } if end + 1 < size => {
            RangeAnswer::Partial { start: start + 1, end: end + 1 }
        }
        RangeAnswer::Partial { start, end } if start > 0 => RangeAnswer::Partial { start: start - 1, end: end - 1 },
        other => other,
    }
}
