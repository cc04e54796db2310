//! Server-sent events: the keep-alive comments that hold a connection open while a long prompt
//! is processed or a request waits in the queue (clients otherwise time out on a silent stream).

use std::time::Duration;

use axum::response::sse::KeepAlive;

pub fn keep_alive(interval: Duration) -> KeepAlive {
    KeepAlive::new().interval(interval).text("keep-alive")
}
