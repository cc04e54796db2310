//! What every handler shares, and the one path by which a request becomes a generation.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use deltafin_text::textgen::TextRequest;
use deltafin_text::tokenizer::Tokenizer;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::blocking::off_runtime;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::worker::{Admission, Admitted, EngineHandle, JobHandle, RequestNote};

/// The served model, as `/v1/models` describes it.
pub struct ModelInfo {
    pub id: String,
    /// Other names the model answers to (`--alias`), listed beside `id`.
    pub aliases: Vec<String>,
    pub created: u64,
    pub context: usize,
    pub vocab: usize,
    /// "exact" or the approximate mode's description: every response carries it.
    pub numerics: String,
    pub approx: bool,
    /// Where the routed experts compute: "cpu" or "gpu" (`--device`); every response says so.
    pub device: String,
}

pub struct AppState {
    pub model: ModelInfo,
    pub tokenizer: Arc<Tokenizer>,
    pub metrics: Arc<Metrics>,
    pub admission: Arc<Admission>,
    pub engine: EngineHandle,
    pub api_key: Option<String>,
    pub queue: usize,
    pub max_body_bytes: usize,
    /// Scripted replies (test instrument).
    #[cfg(feature = "test-instruments")]
    pub script: Vec<crate::instruments::ScriptedReply>,
    /// Interval of SSE keep-alive comments.
    pub keep_alive: std::time::Duration,
    pub tokenizer_gate: TokenizerGate,
    pub readiness: Readiness,
    /// Responses kept for `previous_response_id` (`/v1/responses`).
    pub responses: crate::responses::store::ResponseStore,
}

pub type Shared = Arc<AppState>;

/// Tokenizer jobs (`/tokenize`, `/detokenize`, `/v1/messages/count_tokens`) that run at once.
/// These endpoints skip the engine's admission, and each job holds a parsed body of up to
/// `--max-body-bytes` and its tokens: two bound that memory and leave the blocking pool's other
/// threads to request preparation.
pub const TOKENIZER_JOBS: usize = 2;
/// Tokenizer requests that may wait (body read, not yet parsed) for a running place; more get
/// 429 with `Retry-After`, as busy generations do.
pub const TOKENIZER_QUEUE: usize = 8;

/// Admission for tokenizer jobs: running plus waiting are bounded, and so is running alone.
pub struct TokenizerGate {
    places: Arc<Semaphore>,
    running: Arc<Semaphore>,
}

impl ModelInfo {
    /// Every name the model answers to, `id` first.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.id.as_str()).chain(self.aliases.iter().map(String::as_str))
    }

    pub fn answers_to(&self, name: &str) -> bool {
        self.names().any(|n| n == name)
    }
}

/// Whether the model is open yet: the port is bound before the model loads, and until it is
/// ready every endpoint that needs the model answers 503 `loading`.
pub struct Readiness {
    ready: std::sync::atomic::AtomicBool,
    since: std::time::Instant,
    /// Resident spine layers loaded so far, when the loader counts them.
    pub progress: Option<Arc<deltafin_engine::k3::LoadProgress>>,
}

impl Readiness {
    pub fn new(progress: Option<Arc<deltafin_engine::k3::LoadProgress>>) -> Self {
        Readiness { ready: Default::default(), since: std::time::Instant::now(), progress }
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(std::sync::atomic::Ordering::Acquire)
    }

    pub fn set_ready(&self) {
        self.ready.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Seconds since the server started loading the model.
    pub fn loading_s(&self) -> f64 {
        self.since.elapsed().as_secs_f64()
    }

    /// Where the load stands, for a person: "N s so far" and, once counted, "N of M spine layers".
    pub fn describe(&self) -> String {
        match self.progress.as_ref().map(|p| p.get()) {
            Some((done, total)) if total > 0 => {
                format!("{done} of {total} resident spine layers, {:.0} s so far", self.loading_s())
            }
            _ => format!("{:.0} s so far", self.loading_s()),
        }
    }

    /// `/health`'s body while loading.
    pub fn json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({"status": "loading", "loading_s": self.loading_s()});
        if let Some((done, total)) = self.progress.as_ref().map(|p| p.get()).filter(|&(_, t)| t > 0) {
            v["spine_layers_loaded"] = serde_json::json!(done);
            v["spine_layers_total"] = serde_json::json!(total);
            v["progress"] = serde_json::json!(done as f64 / total as f64);
        }
        v
    }
}

/// A `max_tokens` the request asked for and what it got: the rest of the context, when the
/// request asked for more than fits (agents send large fixed values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    pub tokens: usize,
    /// The request's value, when it was clamped to `tokens`.
    pub clamped_from: Option<usize>,
}

impl Default for TokenizerGate {
    fn default() -> Self {
        TokenizerGate {
            places: Arc::new(Semaphore::new(TOKENIZER_JOBS + TOKENIZER_QUEUE)),
            running: Arc::new(Semaphore::new(TOKENIZER_JOBS)),
        }
    }
}

/// A tokenizer request's place (running or waiting); dropped when the request ends or its
/// client leaves.
pub struct TokenizerPlace {
    _permit: OwnedSemaphorePermit,
}

impl AppState {
    /// A place for a generation (running or waiting), taken before any work on the request;
    /// 429 when there is none.
    pub fn admit(&self) -> Result<Admitted, ApiError> {
        self.admission.try_admit().ok_or_else(|| {
            self.metrics.rejected_busy.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            ApiError::busy(self.queue)
        })
    }

    /// A place for a tokenizer request, taken before its body is read; 429 when running plus
    /// waiting ones are at [`TOKENIZER_JOBS`] + [`TOKENIZER_QUEUE`].
    pub fn tokenizer_place(&self) -> Result<TokenizerPlace, ApiError> {
        self.tokenizer_gate.places.clone().try_acquire_owned().map(|p| TokenizerPlace { _permit: p }).map_err(|_| {
            self.metrics.rejected_busy.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            ApiError::tokenizer_busy(TOKENIZER_JOBS, TOKENIZER_QUEUE)
        })
    }

    /// Run a tokenizer job (parsing included) on the blocking pool once one of the
    /// [`TOKENIZER_JOBS`] running places is free. The places travel with the job, so a client
    /// that leaves mid-job frees them only when the job is really done.
    pub async fn tokenizer_job<T: Send + 'static>(
        &self,
        place: TokenizerPlace,
        f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let running = self
            .tokenizer_gate
            .running
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ApiError::internal("the tokenizer gate is closed"))?;
        off_runtime(move || {
            let _held = (place, running);
            f()
        })
        .await
    }

    /// Hand an admitted generation to the engine; dropping the handle cancels it.
    pub fn submit(&self, admitted: Admitted, req: TextRequest, note: RequestNote) -> Result<JobHandle, ApiError> {
        self.engine
            .submit(admitted, req, note)
            .ok_or_else(|| ApiError::unavailable("the engine thread has stopped; restart the server"))
    }

    /// Tokens that replace sampling for a request: the first scripted reply whose trigger one of
    /// `texts` holds, the texts tried in order (test instrument). Always `None` without the
    /// `test-instruments` feature, where `texts` is never called.
    #[cfg(feature = "test-instruments")]
    pub fn forced(&self, texts: impl FnOnce() -> Vec<String>) -> Option<Vec<u32>> {
        texts().iter().find_map(|t| crate::instruments::scripted(&self.script, t))
    }
    #[cfg(not(feature = "test-instruments"))]
    pub fn forced(&self, _texts: impl FnOnce() -> Vec<String>) -> Option<Vec<u32>> {
        None
    }

    /// The model a request names must be ours (its id or an alias).
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            None => Err(ApiError::missing("model")),
            Some(m) if self.model.answers_to(m) => Ok(()),
            Some(m) => Err(ApiError::model_not_found(m)),
        }
    }

    /// A prompt that fits, and the generation length it leaves: `max_tokens` when given,
    /// clamped to the rest of the context when it asks for more (and the clamp reported), else
    /// the rest of the context.
    pub fn budget(&self, prompt_len: usize, max_tokens: Option<usize>) -> Result<Grant, ApiError> {
        let ctx = self.model.context;
        if prompt_len == 0 {
            return Err(ApiError::bad_request("the prompt is empty"));
        }
        if prompt_len >= ctx {
            return Err(ApiError::context_exceeded(format!(
                "the prompt is {prompt_len} tokens; this server's context is {ctx} tokens (start it with a larger --context)"
            )));
        }
        let room = ctx - prompt_len;
        Ok(match max_tokens {
            Some(m) if m > room => Grant { tokens: room, clamped_from: Some(m) },
            Some(m) => Grant { tokens: m, clamped_from: None },
            None => Grant { tokens: room, clamped_from: None },
        })
    }
}

pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A random id with a prefix, e.g. `chatcmpl-3f9a...`.
pub fn new_id(prefix: &str) -> String {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::SmallRng::from_os_rng();
    format!("{prefix}{:016x}{:08x}", rng.random::<u64>(), rng.random::<u32>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering::Relaxed;

    #[test]
    fn loading_health_counts_the_layers_once_the_loader_does() {
        let p = Arc::new(deltafin_engine::k3::LoadProgress::default());
        let r = Readiness::new(Some(p.clone()));
        assert!(r.json().get("progress").is_none(), "nothing counted yet");
        p.layers_total.store(8, Relaxed);
        p.layers_done.store(2, Relaxed);
        let v = r.json();
        assert_eq!(v["status"], "loading");
        assert_eq!((v["spine_layers_loaded"].as_u64(), v["spine_layers_total"].as_u64()), (Some(2), Some(8)));
        assert_eq!(v["progress"], 0.25);
        assert!(r.describe().starts_with("2 of 8 resident spine layers"), "{}", r.describe());
        assert!(!r.is_ready());
        r.set_ready();
        assert!(r.is_ready());
    }
}
