//! The route table: every path and method, to the dialect or operator handler that serves it.

use axum::routing::{get, post};
use axum::Router;

use crate::dialects::{anthropic, infill, native, ollama, openai, rerank, responses};
use crate::http::fallback::{method_not_allowed, not_found};
use crate::http::{access, middleware, ui, AppState};
use crate::ops::{lora, metrics, props, slots, tokenizer};

/// The paths where a POST acts on a model (`{id}`: any one path segment). Many models'
/// router (`router/front.rs`) loads a model only for these, so that a POST to an unknown path
/// cannot cycle models through memory. Every POST route of `router` below is one of them
/// (`tests/http.rs` checks that each is served).
pub const MODEL_POSTS: [&str; 23] = [
    "/completion",
    "/embedding",
    "/infill",
    "/slots/{id}",
    "/tokenize",
    "/detokenize",
    "/lora-adapters",
    "/apply-template",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/rerank",
    "/v1/reranking",
    "/rerank",
    "/reranking",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/api/generate",
    "/api/chat",
    "/api/embed",
    "/api/embeddings",
    "/api/show",
];

/// The engine's routes of a model that only read (GET; DELETE of a stored response): a POST
/// to them is a 405 at the router, as at the engine.
pub const MODEL_READS: [&str; 3] = ["/props", "/slots", "/v1/responses/{id}"];

/// Whether a POST to `path` acts on a model: it matches one of `MODEL_POSTS`.
pub fn is_model_post(path: &str) -> bool {
    matches_any(&MODEL_POSTS, path)
}

/// Whether `path` is one of `MODEL_READS`.
pub fn is_model_read(path: &str) -> bool {
    matches_any(&MODEL_READS, path)
}

/// Whether `path` matches one of `patterns` (`{id}`: any one path segment).
fn matches_any(patterns: &[&str], path: &str) -> bool {
    patterns.iter().any(|pattern| {
        let mut want = pattern.split('/');
        let mut got = path.split('/');
        loop {
            match (want.next(), got.next()) {
                (None, None) => return true,
                (Some("{id}"), Some(segment)) if !segment.is_empty() => {}
                (Some(w), Some(g)) if w == g => {}
                _ => return false,
            }
        }
    })
}

/// All routes, behind the request policy's layers (`middleware.rs`), all behind the access
/// layer (`access.rs`: request ids, outcomes, access lines).
pub fn router(state: AppState) -> Router {
    let policy = state.policy.clone();
    let metrics = state.metrics.clone();
    let mut routes = Router::new();
    if metrics.is_some() {
        routes = routes.route("/metrics", get(metrics::handler));
    }
    // A POST route added here must be added to `MODEL_POSTS` too.
    let routes = routes
        .route("/completion", post(native::completion))
        .route("/embedding", post(native::embedding))
        .route("/infill", post(infill::infill))
        .route("/health", get(props::health))
        .route("/slots", get(slots::list))
        .route("/slots/{id}", post(slots::action))
        .route("/tokenize", post(tokenizer::tokenize))
        .route("/detokenize", post(tokenizer::detokenize))
        .route("/props", get(props::props))
        .route("/lora-adapters", get(lora::list).post(lora::set))
        .route("/apply-template", post(tokenizer::apply_template))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/embeddings", post(openai::embeddings))
        .route("/v1/rerank", post(rerank::rerank))
        .route("/v1/reranking", post(rerank::rerank))
        .route("/rerank", post(rerank::rerank))
        .route("/reranking", post(rerank::rerank))
        .route("/v1/responses", post(responses::create))
        .route(
            "/v1/responses/{id}",
            get(responses::retrieve).delete(responses::delete),
        )
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{*model}", get(openai::model))
        .route("/api/generate", post(ollama::generate))
        .route("/api/chat", post(ollama::chat))
        .route("/api/embed", post(ollama::embed))
        .route("/api/embeddings", post(ollama::embeddings))
        .route("/api/tags", get(ollama::tags))
        .route("/api/show", post(ollama::show))
        .route("/api/ps", get(ollama::ps))
        .route("/api/version", get(ollama::version))
        .route("/", get(ui::root))
        .route("/dashboard", get(ui::dashboard))
        .route("/ui/{name}", get(ui::file))
        // Keep this after the last route: it applies to the routes registered before it.
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        .with_state(state);
    access::layer(middleware::apply(routes, policy), metrics)
}

#[cfg(test)]
mod tests {
    use super::is_model_post;

    #[test]
    fn model_posts_match_whole_paths_and_one_segment_ids() {
        for path in ["/v1/chat/completions", "/api/chat", "/slots/3", "/slots/x"] {
            assert!(is_model_post(path), "{path}");
        }
        for path in [
            "/",
            "",
            "/v1/chat",
            "/v1/chat/completions/",
            "/v1/chat/completions/x",
            "/slots",
            "/slots/",
            "/slots/1/2",
            "/api/pull",
            "/api/delete",
            "/no/such/route",
            "//api/chat",
            "/API/chat",
        ] {
            assert!(!is_model_post(path), "{path}");
        }
    }
}
