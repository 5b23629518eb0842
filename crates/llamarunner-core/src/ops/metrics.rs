//! `GET /metrics`: the Prometheus registry (`http/metrics.rs`) rendered for a scrape.

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use prometheus::{Encoder, TextEncoder};

use crate::http::error::ApiError;
use crate::http::AppState;

/// `GET /metrics`: the Prometheus text format (version 0.0.4).
pub async fn handler(State(state): State<AppState>) -> Result<Response, ApiError> {
    let Some(metrics) = state.metrics.as_ref() else {
        return Err(ApiError::NotFound("metrics are off (--no-metrics)".into()));
    };
    let text = metrics
        .render(&state.engine)
        .map_err(|e| ApiError::Internal(format!("cannot encode the metrics: {e}")))?;
    Ok((
        [(CONTENT_TYPE, TextEncoder::new().format_type().to_string())],
        text,
    )
        .into_response())
}
