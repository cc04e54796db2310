//! CPU work of a request kept off the async workers.

use crate::error::ApiError;

/// Run request preparation (JSON walking, chat rendering, tokenisation: CPU work proportional
/// to the body) on the blocking pool, so that a large or hostile request never stalls the async
/// workers; a panic there (a bug) becomes a 500 instead of a dropped connection.
pub async fn off_runtime<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(|_| ApiError::internal("preparing the request failed"))?
}
