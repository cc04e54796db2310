//! Deltafin's HTTP server: OpenAI- and Anthropic-compatible endpoints over one engine thread.
//!
//! The async runtime (tokio, two worker threads) only parses requests and moves bytes; the
//! model runs on the engine thread ([`worker`]), one generation at a time, with a bounded FIFO
//! queue in front of it and 429 beyond that.

pub mod anthropic;
mod batch_worker;
pub mod blocking;
pub mod error;
pub mod generation;
#[cfg(feature = "test-instruments")]
pub mod instruments;
pub mod metrics;
pub mod ollama;
pub mod openai;
pub mod params;
pub mod prompt;
pub mod responses;
pub mod routes;
pub mod sse;
pub mod state;
pub mod worker;

pub use worker::StateStoreOptions;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use deltafin_engine::session::Session;
use deltafin_text::tokenizer::Tokenizer;

use crate::metrics::Metrics;
use crate::state::{AppState, ModelInfo};
use crate::worker::Admission;

pub struct ServeOptions {
    pub host: String,
    pub port: u16,
    pub api_key: Option<String>,
    /// Requests that may wait while the batch is full.
    pub queue: usize,
    /// Generations that share each model step (continuous batching); 1 runs one at a time.
    pub max_batch: usize,
    pub max_body_bytes: usize,
    pub keep_alive: Duration,
    /// Test instruments (scripted replies, a step delay).
    #[cfg(feature = "test-instruments")]
    pub instruments: instruments::Options,
    /// Keep the last prompt's state for a next prompt that extends it.
    pub prefix_cache: bool,
    /// Keep prompt states on disk too (`--state-dir`).
    pub state: Option<StateStoreOptions>,
    /// Counts the model's load (the same as the session's `RunOptions::load_progress`).
    pub load_progress: Option<Arc<deltafin_engine::k3::LoadProgress>>,
}

/// How often a loading server says how far it has come.
const LOAD_REPORT_EVERY: Duration = Duration::from_secs(10);

/// Threads of the async runtime's blocking pool (request preparation, tokenizer jobs).
const BLOCKING_THREADS: usize = 8;

/// How long a shutdown waits for responses in flight.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// Bind, print `deltafin serve: listening on http://ADDR`, load the model (endpoints that need
/// it answer 503 `loading` meanwhile, `/health` with how long it has been loading), print
/// `deltafin serve: ready on http://ADDR`, and serve until interrupted. A model that fails to
/// load ends the server with that error.
pub fn serve(
    opts: ServeOptions,
    model: ModelInfo,
    tokenizer: Tokenizer,
    open: impl FnOnce() -> Result<Session> + Send + 'static,
) -> Result<()> {
    let tokenizer = Arc::new(tokenizer);
    #[cfg(feature = "test-instruments")]
    let script = match &opts.instruments.script {
        Some(p) => instruments::load_script(p, &tokenizer)?,
        None => Vec::new(),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        // Tokio's default of 512 blocking threads would let a burst of large requests each
        // parse and tokenise its body at once. What runs there is bounded anyway (request
        // preparation by admission, tokenizer jobs by their gate); this bounds the threads too,
        // and the rest wait in tokio's queue.
        .max_blocking_threads(BLOCKING_THREADS)
        .thread_name("deltafin-http")
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    // The port first: a port in use is reported at once, not after minutes of loading.
    let listener = rt
        .block_on(tokio::net::TcpListener::bind((opts.host.as_str(), opts.port)))
        .with_context(|| format!("listening on {}:{} (is another server using the port?)", opts.host, opts.port))?;
    let local = listener.local_addr()?;
    let metrics = Arc::new(Metrics::default());
    let admission = Admission::with_batch(opts.max_batch, opts.queue);
    let (engine, loaded) = worker::spawn(
        open,
        tokenizer.clone(),
        admission.clone(),
        metrics.clone(),
        worker::EngineOptions {
            max_batch: opts.max_batch.max(1),
            prefix_cache: opts.prefix_cache,
            state: opts.state.clone(),
            #[cfg(feature = "test-instruments")]
            step_delay: opts.instruments.step_delay,
            #[cfg(feature = "test-instruments")]
            inject_faults: opts.instruments.inject_faults,
            #[cfg(feature = "test-instruments")]
            load_delay: opts.instruments.load_delay,
        },
    )?;
    let state = Arc::new(AppState {
        model,
        tokenizer,
        metrics,
        admission,
        engine,
        api_key: opts.api_key.clone(),
        queue: opts.queue,
        max_body_bytes: opts.max_body_bytes,
        #[cfg(feature = "test-instruments")]
        script,
        keep_alive: opts.keep_alive,
        tokenizer_gate: Default::default(),
        readiness: state::Readiness::new(opts.load_progress.clone()),
        responses: Default::default(),
    });
    println!("deltafin serve: listening on http://{local} (loading the model; /health answers 503 until it is ready)");
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    let served = rt.block_on(async move {
        let app = routes::router(state.clone());
        // On a signal, stop accepting and let responses in flight finish, but no longer than
        // SHUTDOWN_GRACE: an open stream could otherwise hold the process for a whole
        // generation.
        let (signalled, mut on_signal) = tokio::sync::watch::channel(false);
        let graceful = async move {
            shutdown_signal().await;
            let _ = signalled.send(true);
        };
        let deadline = async move {
            let _ = on_signal.changed().await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        };
        let ready = async move {
            // A person watching a load of minutes sees it move.
            let mut loaded = loaded;
            let mut every = tokio::time::interval(LOAD_REPORT_EVERY);
            every.tick().await;
            let loaded = loop {
                tokio::select! {
                    r = &mut loaded => break r,
                    _ = every.tick() => eprintln!("deltafin serve: loading the model: {}", state.readiness.describe()),
                }
            };
            match loaded {
                Ok(Ok(())) => {
                    state.readiness.set_ready();
                    println!(
                        "deltafin serve: ready on http://{local} (model loaded in {:.1} s)",
                        state.readiness.loading_s()
                    );
                    let _ = std::io::stdout().flush();
                    std::future::pending::<Result<()>>().await
                }
                Ok(Err(e)) => Err(e.context("loading the model")),
                Err(_) => Err(anyhow::anyhow!("the engine thread died while loading the model")),
            }
        };
        tokio::select! {
            r = axum::serve(listener, app).with_graceful_shutdown(graceful) => r.context("serving")?,
            _ = deadline => eprintln!("deltafin serve: closed the connections still open"),
            r = ready => r?,
        }
        Ok::<(), anyhow::Error>(())
    });
    // Open streams are not waited for: the engine thread ends with the process. Also after a
    // failed load, so that no blocking task holds the exit.
    rt.shutdown_timeout(Duration::from_secs(1));
    served
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    eprintln!("deltafin serve: shutting down");
}
