//! The one HTTP client of installs and fetches: ranged GETs that are checked to the byte, and
//! retried with exponential back-off and jitter (honouring `Retry-After`) when the failure can
//! pass (a dropped connection, a short or wrong body, 408, 429, 5xx). Any other 4xx stops at
//! once with a message that says what to do (a wrong name, a missing token, a gated repo).
//!
//! The token goes only to the endpoint's own host; reqwest drops `Authorization` when a
//! redirect leaves that host (the Hub sends file bodies from a CDN).

use std::io::Read;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Result, bail};
use rand::{Rng, SeedableRng};
use reqwest::StatusCode;
use reqwest::blocking::{Client, Response};
use reqwest::header::{HeaderMap, RANGE};

#[derive(Debug, Clone)]
pub struct HttpConfig {
    pub token: Option<String>,
    /// Tries per request before giving up.
    pub attempts: u32,
    /// First back-off; doubles per retry up to `max_backoff`, with jitter.
    pub backoff: Duration,
    pub max_backoff: Duration,
    /// Connect, read and write timeout of one request.
    pub timeout: Duration,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            token: None,
            attempts: 8,
            backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(60),
            timeout: Duration::from_secs(120),
        }
    }
}

/// Bytes and requests, counted for reports.
#[derive(Debug, Default)]
pub struct NetCounters {
    /// Body bytes received (every attempt, failed ones included).
    pub bytes: AtomicU64,
    pub requests: AtomicU64,
    pub retries: AtomicU64,
}

/// A failure of one attempt: whether it may pass, and how long the origin asked us to wait.
#[derive(Debug)]
enum Failure {
    Fatal(String),
    Transient(String, Option<Duration>),
}

/// What the bytes of a file must match.
#[derive(Debug, Clone)]
pub struct Expect<'a> {
    /// For messages.
    pub name: &'a str,
    pub size: u64,
    /// The origin's sha256 of the file: an ETag that is a sha256 must equal it.
    pub sha256: Option<&'a str>,
    /// A mirror's validator at pinning time (ETag, else Last-Modified): it must not change.
    pub validator: Option<&'a str>,
}

impl<'a> Expect<'a> {
    pub fn of(f: &'a deltafin_store::manifest::OriginFile) -> Self {
        Expect { name: &f.name, size: f.size, sha256: f.sha256.as_deref(), validator: f.validator.as_deref() }
    }
}

/// A response's validator: its ETag, else its Last-Modified.
pub fn validator(h: &HeaderMap) -> Option<String> {
    ["etag", "last-modified"].iter().find_map(|n| h.get(*n).and_then(|v| v.to_str().ok()).map(|v| v.trim().to_string()))
}

pub struct Http {
    client: Client,
    cfg: HttpConfig,
    /// `host:port` the token may be sent to.
    token_host: Option<String>,
    pub counters: Arc<NetCounters>,
}

fn host_port(url: &str) -> Option<String> {
    let u = reqwest::Url::parse(url).ok()?;
    Some(format!("{}:{}", u.host_str()?, u.port_or_known_default()?))
}

impl Http {
    /// A client for `endpoint` (the token is sent to its host only).
    pub fn new(endpoint: &str, cfg: HttpConfig) -> Result<Self> {
        let client = Client::builder()
            .timeout(cfg.timeout)
            .connect_timeout(Duration::from_secs(20))
            .user_agent(concat!("deltafin/", env!("CARGO_PKG_VERSION")))
            .redirect(reqwest::redirect::Policy::limited(10))
            .build()?;
        Ok(Http { client, token_host: host_port(endpoint), cfg, counters: Arc::new(NetCounters::default()) })
    }

    fn request(&self, url: &str, range: Option<(u64, u64)>) -> Result<Response, Failure> {
        let mut rq = self.client.get(url);
        if let (Some(t), Some(h)) = (&self.cfg.token, &self.token_host)
            && host_port(url).as_ref() == Some(h)
        {
            rq = rq.bearer_auth(t);
        }
        if let Some((s, e)) = range {
            rq = rq.header(RANGE, format!("bytes={s}-{}", e - 1));
        }
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        let resp = rq.send().map_err(|e| Failure::Transient(format!("request failed: {}", plain(&e)), None))?;
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        Err(classify(status, resp.headers()))
    }

    /// Run `attempt` until it succeeds, a fatal failure, or the tries run out.
    fn with_retries<T>(&self, what: &str, mut attempt: impl FnMut() -> Result<T, Failure>) -> Result<T> {
        let mut last = String::new();
        for i in 0..self.cfg.attempts.max(1) {
            match attempt() {
                Ok(v) => return Ok(v),
                Err(Failure::Fatal(m)) => bail!("{what}: {m}"),
                Err(Failure::Transient(m, after)) => {
                    last = m;
                    if i + 1 == self.cfg.attempts.max(1) {
                        break;
                    }
                    self.counters.retries.fetch_add(1, Ordering::Relaxed);
                    let exp = self.cfg.backoff.saturating_mul(1u32 << i.min(16)).min(self.cfg.max_backoff);
                    // Full jitter in [exp/2, exp]: many workers hitting one throttled origin
                    // must not retry in lockstep.
                    let mut rng = rand::rngs::SmallRng::from_os_rng();
                    let jittered = exp.mul_f64(rng.random_range(0.5..=1.0));
                    let wait = after.map_or(jittered, |a| a.min(Duration::from_secs(300)).max(jittered));
                    tracing::warn!("{what}: {last}; retrying in {:.1} s", wait.as_secs_f64());
                    std::thread::sleep(wait);
                }
            }
        }
        bail!("{what}: {last} (gave up after {} tries)", self.cfg.attempts.max(1))
    }

    /// A whole small resource (API JSON, a config file), at most `cap` bytes; with its headers.
    pub fn get_small(&self, url: &str, what: &str, cap: u64) -> Result<(Vec<u8>, HeaderMap)> {
        self.with_retries(what, || {
            let resp = self.request(url, None)?;
            let headers = resp.headers().clone();
            let mut body = Vec::new();
            let n = resp
                .take(cap + 1)
                .read_to_end(&mut body)
                .map_err(|e| Failure::Transient(format!("reading the body failed: {e}"), None))?;
            self.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
            if n as u64 > cap {
                return Err(Failure::Fatal(format!("the answer is larger than {cap} bytes")));
            }
            Ok((body, headers))
        })
    }

    /// The size and validator of a file on a plain server (a mirror), from `Range: bytes=0-0`.
    pub fn size_of(&self, url: &str, what: &str) -> Result<(u64, Option<String>)> {
        self.with_retries(what, || {
            let resp = self.request(url, Some((0, 1)))?;
            let v = validator(resp.headers());
            let total = match resp.status() {
                StatusCode::PARTIAL_CONTENT => {
                    content_range(resp.headers()).map(|r| r.2).ok_or_else(|| bad_range("no Content-Range"))?
                }
                _ => resp.content_length().ok_or_else(|| bad_range("no Content-Length"))?,
            };
            Ok((total, v))
        })
    }

    /// Bytes `[start, end)` of a file, exactly: a 206 whose Content-Range, length and body
    /// match, or a 200 when the range is the whole file. Anything else is retried.
    pub fn get_range(&self, url: &str, start: u64, end: u64, expect: &Expect) -> Result<Vec<u8>> {
        let what = format!("{} bytes {start}-{}", expect.name, end.saturating_sub(1));
        if end <= start || end > expect.size {
            bail!("{what}: not a range of the {}-byte file", expect.size);
        }
        let len = end - start;
        self.with_retries(&what, || {
            let resp = self.request(url, Some((start, end)))?;
            check_etag(resp.headers(), expect)?;
            match resp.status() {
                StatusCode::PARTIAL_CONTENT => {
                    let r = content_range(resp.headers()).ok_or_else(|| bad_range("206 without a Content-Range"))?;
                    if r != (start, end - 1, expect.size) {
                        return Err(Failure::Transient(
                            format!(
                                "the origin answered bytes {}-{}/{} for bytes {start}-{}/{}",
                                r.0,
                                r.1,
                                r.2,
                                end - 1,
                                expect.size
                            ),
                            None,
                        ));
                    }
                }
                StatusCode::OK if start == 0 && end == expect.size => {}
                StatusCode::OK => {
                    return Err(Failure::Transient(
                        "the origin ignored the Range header (it must support ranged GETs)".into(),
                        None,
                    ));
                }
                s => return Err(Failure::Transient(format!("unexpected status {s}"), None)),
            }
            if let Some(cl) = resp.content_length()
                && cl != len
            {
                return Err(Failure::Transient(format!("Content-Length {cl} for a {len}-byte range"), None));
            }
            let mut body = Vec::with_capacity(len as usize);
            let read = resp.take(len + 1).read_to_end(&mut body);
            self.counters.bytes.fetch_add(body.len() as u64, Ordering::Relaxed);
            if let Err(e) = read {
                return Err(Failure::Transient(format!("the body broke off after {} bytes: {e}", body.len()), None));
            }
            if body.len() as u64 != len {
                return Err(Failure::Transient(format!("got {} bytes of a {len}-byte range", body.len()), None));
            }
            Ok(body)
        })
    }
}

fn bad_range(m: &str) -> Failure {
    Failure::Transient(m.into(), None)
}

/// An error without its URL (which carries no secret, but is noise in every line).
fn plain(e: &reqwest::Error) -> String {
    let mut s = e.without_url_ref().to_string();
    let mut src = std::error::Error::source(e);
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

trait WithoutUrl {
    fn without_url_ref(&self) -> String;
}

impl WithoutUrl for reqwest::Error {
    fn without_url_ref(&self) -> String {
        if self.is_timeout() {
            "timed out".into()
        } else if self.is_connect() {
            "could not connect".into()
        } else if self.is_redirect() {
            "too many redirects".into()
        } else {
            "transport error".into()
        }
    }
}

/// `Content-Range: bytes a-b/total` as (a, b, total).
fn content_range(h: &HeaderMap) -> Option<(u64, u64, u64)> {
    let v = h.get(reqwest::header::CONTENT_RANGE)?.to_str().ok()?;
    let rest = v.strip_prefix("bytes ")?;
    let (span, total) = rest.split_once('/')?;
    let (a, b) = span.split_once('-')?;
    Some((a.trim().parse().ok()?, b.trim().parse().ok()?, total.trim().parse().ok()?))
}

/// An ETag (or the Hub's `X-Linked-Etag`) that is a sha256 must be the pinned file's: anything
/// else means the file changed at the origin since the install pinned it.
fn check_etag(h: &HeaderMap, expect: &Expect) -> Result<(), Failure> {
    if let (Some(pinned), Some(now)) = (expect.validator, validator(h))
        && pinned != now
    {
        return Err(Failure::Fatal(format!(
            "the origin's {} changed since this install pinned it (validator {now}, pinned {pinned}); \
             install again into a new directory to take the new version",
            expect.name
        )));
    }
    let Some(want) = expect.sha256 else { return Ok(()) };
    for name in ["x-linked-etag", "etag"] {
        if let Some(v) = h.get(name).and_then(|v| v.to_str().ok()) {
            let tag = v.trim().trim_start_matches("W/").trim_matches('"');
            if tag.len() == 64 && tag.bytes().all(|b| b.is_ascii_hexdigit()) && !tag.eq_ignore_ascii_case(want) {
                return Err(Failure::Fatal(format!(
                    "the origin's {} changed since this install pinned it (ETag {tag}, expected {want}); \
                     start a new install to pin the new revision",
                    expect.name
                )));
            }
        }
    }
    Ok(())
}

fn retry_after(h: &HeaderMap) -> Option<Duration> {
    let v = h.get(reqwest::header::RETRY_AFTER)?.to_str().ok()?;
    v.trim().parse::<u64>().ok().map(Duration::from_secs)
}

/// What a non-success status means for the operator.
fn classify(status: StatusCode, h: &HeaderMap) -> Failure {
    let code = h.get("x-error-code").and_then(|v| v.to_str().ok()).unwrap_or("");
    let n = status.as_u16();
    match n {
        408 | 429 | 500..=599 => Failure::Transient(format!("HTTP {status}"), retry_after(h)),
        401 => Failure::Fatal(format!(
            "HTTP 401 {code}: the repository does not exist, or it is private and needs a token \
             (set HF_TOKEN, or log in so the Hub's token file exists)"
        )),
        403 if code == "GatedRepo" => Failure::Fatal(
            "HTTP 403 GatedRepo: the repository is gated; accept its conditions on its Hub page \
             with your account, then set HF_TOKEN"
                .into(),
        ),
        403 => Failure::Fatal(format!("HTTP 403 {code}: access denied (check HF_TOKEN)")),
        404 if code == "RevisionNotFound" => {
            Failure::Fatal("HTTP 404 RevisionNotFound: no such revision (branch, tag or commit)".into())
        }
        404 if code == "EntryNotFound" => {
            Failure::Fatal("HTTP 404 EntryNotFound: no such file at this revision".into())
        }
        404 => Failure::Fatal(format!(
            "HTTP 404{}: not found (check the repository name, the revision, and --endpoint or --mirror)",
            if code.is_empty() { String::new() } else { format!(" {code}") }
        )),
        416 => Failure::Fatal("HTTP 416: the range lies outside the origin's file (did it change?)".into()),
        _ => Failure::Fatal(format!("HTTP {status} {code}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    #[test]
    fn statuses_are_classified_for_the_operator() {
        let mut h = HeaderMap::new();
        assert!(matches!(classify(StatusCode::SERVICE_UNAVAILABLE, &h), Failure::Transient(..)));
        assert!(matches!(classify(StatusCode::REQUEST_TIMEOUT, &h), Failure::Transient(..)));
        h.insert("retry-after", HeaderValue::from_static("7"));
        match classify(StatusCode::TOO_MANY_REQUESTS, &h) {
            Failure::Transient(_, Some(d)) => assert_eq!(d, Duration::from_secs(7)),
            other => panic!("{other:?}"),
        }
        h.insert("x-error-code", HeaderValue::from_static("GatedRepo"));
        match classify(StatusCode::FORBIDDEN, &h) {
            Failure::Fatal(m) => assert!(m.contains("gated") && m.contains("HF_TOKEN")),
            other => panic!("{other:?}"),
        }
        assert!(
            matches!(classify(StatusCode::UNAUTHORIZED, &HeaderMap::new()), Failure::Fatal(m) if m.contains("HF_TOKEN"))
        );
    }

    #[test]
    fn content_range_and_etag() {
        let mut h = HeaderMap::new();
        h.insert("content-range", HeaderValue::from_static("bytes 10-19/100"));
        assert_eq!(content_range(&h), Some((10, 19, 100)));
        let sha = "a".repeat(64);
        let e = Expect { name: "f", size: 100, sha256: Some(&sha), validator: None };
        h.insert("etag", HeaderValue::from_str(&format!("\"{}\"", "b".repeat(64))).unwrap());
        assert!(matches!(check_etag(&h, &e), Err(Failure::Fatal(_))));
        h.insert("etag", HeaderValue::from_str(&format!("\"{sha}\"")).unwrap());
        assert!(check_etag(&h, &e).is_ok());
        h.insert("etag", HeaderValue::from_static("\"5f2a-1234\""));
        assert!(check_etag(&h, &e).is_ok(), "a plain server's ETag says nothing about the sha256");
        let pinned = Expect { name: "f", size: 100, sha256: None, validator: Some("\"5f2a-1234\"") };
        assert!(check_etag(&h, &pinned).is_ok());
        h.insert("etag", HeaderValue::from_static("\"5f2b-1234\""));
        assert!(matches!(check_etag(&h, &pinned), Err(Failure::Fatal(m)) if m.contains("changed")));
    }
}
