//! Answers for requests no route takes: an unknown path (404) or a method the path does not
//! serve (405), each in the shape of the dialect the path belongs to.

use super::error::{self, ApiError, Dialect};

/// Unknown routes: a 404 in the shape of the dialect the path belongs to.
pub async fn not_found(
    method: axum::http::Method,
    uri: axum::http::Uri,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let path = uri.path();
    if path.starts_with("/api/") {
        let why = if matches!(
            path,
            "/api/push" | "/api/create" | "/api/copy" | "/api/delete"
        ) {
            "; llamarunner serves the models it was started with (and pulls, with \
             --allow-pull) and cannot push, create, copy or delete models"
        } else {
            ""
        };
        return error::OllamaError(ApiError::NotFound(format!(
            "no route for {method} {path}{why}"
        )))
        .into_response();
    }
    Dialect::of_path(path).respond(ApiError::NotFound(format!("no route for {method} {path}")))
}

/// A route asked with a method it does not serve: a 405 in the dialect's shape (axum adds the
/// `Allow` header).
pub async fn method_not_allowed(
    method: axum::http::Method,
    uri: axum::http::Uri,
) -> axum::response::Response {
    let path = uri.path();
    Dialect::of_path(path).respond(ApiError::MethodNotAllowed(format!(
        "{path} does not accept {method}"
    )))
}
