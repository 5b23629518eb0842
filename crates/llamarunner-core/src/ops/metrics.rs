//! `GET /metrics`: the Prometheus registry (`http/metrics.rs`) rendered for a scrape.

use axum::extract::State;
use axum::http::header::{HeaderName, CONTENT_TYPE};
use axum::response::{IntoResponse, Response};
use prometheus::{Encoder, TextEncoder};

use crate::http::error::ApiError;
use crate::http::AppState;

/// `GET /metrics`: the Prometheus text format (version 0.0.4).
pub async fn handler(State(state): State<AppState>) -> Result<Response, ApiError> {
    let Some(metrics) = state.metrics.as_ref() else {
        // 501 `not_supported`, as llama-server answers when its metrics are off.
        return Err(ApiError::NotSupported(
            "metrics are off (--no-metrics)".into(),
        ));
    };
    let text = metrics
        .render(&state.engine)
        .map_err(|e| ApiError::Internal(format!("cannot encode the metrics: {e}")))?;
    Ok((
        [
            (CONTENT_TYPE, TextEncoder::new().format_type().to_string()),
            // As llama-server: when this process started (seconds since the epoch), so that a
            // scraper sees a restart even between two scrapes that reset no counter.
            (
                HeaderName::from_static("process-start-time-unix"),
                process_start_unix().to_string(),
            ),
        ],
        text,
    )
        .into_response())
}

/// When this process started, seconds since the epoch: read from the first call (the router
/// makes that call when it builds the routes, so it is the server's start).
pub fn process_start_unix() -> u64 {
    static START: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *START.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    })
}
