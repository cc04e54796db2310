//! Header-only and error replies, shaped like the Hub's: a small JSON body, `X-Error-Code` where
//! the Hub sends one (clients branch on it), and `X-Repo-Commit` once the commit is known.

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::Response;
use serde_json::json;

pub(crate) const X_REPO_COMMIT: &str = "x-repo-commit";
pub(crate) const X_ERROR_CODE: &str = "x-error-code";
pub(crate) const X_ERROR_MESSAGE: &str = "x-error-message";

/// Sets a header, skipping values that are not valid header text (they come from request paths).
pub(crate) fn set(resp: &mut Response, name: impl Into<HeaderName>, value: &str) {
    if let Ok(v) = HeaderValue::from_str(value) {
        resp.headers_mut().insert(name.into(), v);
    }
}

/// An error as the Hub words it.
pub(crate) fn hub_error(status: StatusCode, code: Option<&str>, message: &str, commit: Option<&str>) -> Response {
    let body = json!({ "error": message }).to_string();
    let mut resp = Response::new(Body::from(body));
    *resp.status_mut() = status;
    set(&mut resp, header::CONTENT_TYPE, "application/json");
    set(&mut resp, HeaderName::from_static(X_ERROR_MESSAGE), message);
    if let Some(code) = code {
        set(&mut resp, HeaderName::from_static(X_ERROR_CODE), code);
    }
    if let Some(commit) = commit {
        set(&mut resp, HeaderName::from_static(X_REPO_COMMIT), commit);
    }
    resp
}

/// A `Status` fault: the code asked for (500 if it is not a valid status).
pub(crate) fn injected_status(code: u16, commit: Option<&str>) -> Response {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    hub_error(status, None, "injected fault", commit)
}

/// A `TooMany` fault: 429 with `Retry-After` in seconds.
pub(crate) fn too_many(retry_after_s: u64, commit: Option<&str>) -> Response {
    let mut resp = hub_error(StatusCode::TOO_MANY_REQUESTS, None, "rate limited (injected fault)", commit);
    set(&mut resp, header::RETRY_AFTER, &retry_after_s.to_string());
    resp
}

pub(crate) fn not_found() -> Response {
    hub_error(StatusCode::NOT_FOUND, None, "Not Found", None)
}

pub(crate) fn method_not_allowed() -> Response {
    hub_error(StatusCode::METHOD_NOT_ALLOWED, None, "Method Not Allowed", None)
}
