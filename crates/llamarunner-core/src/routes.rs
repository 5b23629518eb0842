//! The route table: every path and method, to the dialect or operator handler that serves it,
//! and who answers it behind a router of many models (the model's engine or the server).

use std::sync::LazyLock;

use axum::routing::{get, post, MethodRouter};
use axum::Router;

use crate::dialects::{anthropic, infill, native, ollama, openai, rerank, responses};
use crate::http::fallback::{method_not_allowed, not_found};
use crate::http::{access, middleware, ui, AppState};
use crate::ops::{lora, metrics, props, slots, tokenizer};

/// Who answers a route when many models sit behind one endpoint (`router/front.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scope {
    /// A model's: the router forwards it to that model's engine, and loads the model for a
    /// POST to it.
    Model,
    /// The server's own (health, listings, metrics, the page): the router answers it itself.
    Server,
}

/// One route: its path (`{id}`: one path segment), whether it takes a POST, who answers it,
/// and its handlers.
struct Route {
    path: &'static str,
    post: bool,
    scope: Scope,
    methods: MethodRouter<AppState>,
}

/// A model's route that takes a POST (and maybe other methods).
fn model_post(path: &'static str, methods: MethodRouter<AppState>) -> Route {
    Route {
        path,
        post: true,
        scope: Scope::Model,
        methods,
    }
}

/// A model's route that only reads (GET; DELETE of a stored response).
fn model_read(path: &'static str, methods: MethodRouter<AppState>) -> Route {
    Route {
        path,
        post: false,
        scope: Scope::Model,
        methods,
    }
}

/// The server's own route.
fn server(path: &'static str, methods: MethodRouter<AppState>) -> Route {
    Route {
        path,
        post: false,
        scope: Scope::Server,
        methods,
    }
}

/// The route table: every path, its methods and handlers, and who answers it (`/metrics`
/// answers 501 when the metrics are off, as llama-server's). `router` serves it; the router
/// of many models reads its model routes (`model_posts`, `model_reads`).
fn table() -> Vec<Route> {
    let mut routes = vec![server("/metrics", get(metrics::handler))];
    routes.extend([
        model_post("/completion", post(native::completion)),
        model_post("/embedding", post(native::embedding)),
        model_post("/infill", post(infill::infill)),
        server("/health", get(props::health)),
        model_read("/slots", get(slots::list)),
        model_post("/slots/{id}", post(slots::action)),
        model_post("/tokenize", post(tokenizer::tokenize)),
        model_post("/detokenize", post(tokenizer::detokenize)),
        model_read("/props", get(props::props)),
        model_post("/lora-adapters", get(lora::list).post(lora::set)),
        model_post("/apply-template", post(tokenizer::apply_template)),
        model_post("/v1/chat/completions", post(openai::chat_completions)),
        model_post("/v1/completions", post(openai::completions)),
        model_post("/v1/embeddings", post(openai::embeddings)),
        // The OpenAI routes without `/v1`, as llama-server serves them, for clients given the
        // server's root as their base URL: OpenAI's answers, as those clients expect
        // (llama-server answers its own formats on /completions and /embeddings;
        // docs/endpoints.md); a /completions body naming no model is llama-server's.
        model_post("/chat/completions", post(openai::chat_completions)),
        model_post("/completions", post(openai::completions_at_root)),
        model_post("/embeddings", post(openai::embeddings)),
        model_post("/responses", post(responses::create)),
        // The tokens a request's prompt would have (llama-server's, and OpenAI's for
        // Responses), with and without `/v1`.
        model_post(
            "/v1/chat/completions/input_tokens",
            post(openai::chat_input_tokens),
        ),
        model_post(
            "/chat/completions/input_tokens",
            post(openai::chat_input_tokens),
        ),
        model_post("/v1/responses/input_tokens", post(responses::input_tokens)),
        model_post("/responses/input_tokens", post(responses::input_tokens)),
        model_post("/v1/rerank", post(rerank::rerank)),
        model_post("/v1/reranking", post(rerank::rerank)),
        model_post("/rerank", post(rerank::rerank)),
        model_post("/reranking", post(rerank::rerank)),
        model_post("/v1/responses", post(responses::create)),
        model_read(
            "/v1/responses/{id}",
            get(responses::retrieve).delete(responses::delete),
        ),
        model_post("/v1/messages", post(anthropic::messages)),
        model_post("/v1/messages/count_tokens", post(anthropic::count_tokens)),
        server("/v1/models", get(openai::models)),
        server("/models", get(openai::models)),
        server("/v1/health", get(props::health)),
        server("/v1/models/{*model}", get(openai::model)),
        model_post("/api/generate", post(ollama::generate)),
        model_post("/api/chat", post(ollama::chat)),
        model_post("/api/embed", post(ollama::embed)),
        model_post("/api/embeddings", post(ollama::embeddings)),
        server("/api/tags", get(ollama::tags)),
        model_post("/api/show", post(ollama::show)),
        server("/api/pull", post(ollama::pull)),
        server("/api/ps", get(ollama::ps)),
        server("/api/version", get(ollama::version)),
        server("/", get(ui::root)),
        server("/dashboard", get(ui::dashboard)),
        server("/ui/{name}", get(ui::file)),
    ]);
    routes
}

/// The model routes of the table: (those that take a POST, those that only read).
static MODEL_ROUTES: LazyLock<(Vec<&'static str>, Vec<&'static str>)> = LazyLock::new(|| {
    let model: Vec<Route> = table()
        .into_iter()
        .filter(|r| r.scope == Scope::Model)
        .collect();
    let posts = model.iter().filter(|r| r.post).map(|r| r.path).collect();
    let reads = model.iter().filter(|r| !r.post).map(|r| r.path).collect();
    (posts, reads)
});

/// The paths where a POST acts on a model (`{id}`: any one path segment). Many models'
/// router (`router/front.rs`) loads a model only for these, so that a POST to an unknown path
/// cannot cycle models through memory (`tests/http.rs` checks that each is served).
pub fn model_posts() -> &'static [&'static str] {
    &MODEL_ROUTES.0
}

/// The engine's routes of a model that only read (GET; DELETE of a stored response): a POST
/// to them is a 405 at the router, as at the engine.
pub fn model_reads() -> &'static [&'static str] {
    &MODEL_ROUTES.1
}

/// Whether a POST to `path` acts on a model: it matches one of `model_posts`.
pub fn is_model_post(path: &str) -> bool {
    matches_any(model_posts(), path)
}

/// Whether `path` is one of `model_reads`.
pub fn is_model_read(path: &str) -> bool {
    matches_any(model_reads(), path)
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
    // The start time `/metrics` reports is taken now.
    crate::ops::metrics::process_start_unix();
    let mut routes = Router::new();
    for route in table() {
        routes = routes.route(route.path, route.methods);
    }
    let routes = routes
        // Keep this after the last route: it applies to the routes registered before it.
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            deterministic_header,
        ))
        .with_state(state);
    access::layer(middleware::apply(routes, policy), metrics)
}

/// The header every answer of a generation route carries: whether the request ran
/// deterministically (`--deterministic`: its output depends on the request alone).
pub const DETERMINISTIC_HEADER: &str = "llamarunner-deterministic";

/// The routes that generate text (every dialect's), which `--deterministic` covers; embeddings,
/// reranking and the tokenizer's routes are not generation.
pub const GENERATION_ROUTES: [&str; 11] = [
    "/completion",
    "/infill",
    "/completions",
    "/chat/completions",
    "/responses",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/api/generate",
    "/api/chat",
];

/// Adds `DETERMINISTIC_HEADER` to the answers of generation routes, once the model is loaded.
async fn deterministic_header(
    axum::extract::State(state): axum::extract::State<AppState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let model_route = request.method() == axum::http::Method::POST
        && GENERATION_ROUTES.contains(&request.uri().path());
    let mut response = next.run(request).await;
    if let Some(info) = model_route
        .then(|| state.engine.health.model_info())
        .flatten()
    {
        response.headers_mut().insert(
            DETERMINISTIC_HEADER,
            axum::http::HeaderValue::from_static(if info.deterministic { "true" } else { "false" }),
        );
    }
    response
}

#[cfg(test)]
mod tests {
    use super::is_model_post;

    #[test]
    fn every_generation_route_is_a_model_route() {
        for path in super::GENERATION_ROUTES {
            assert!(is_model_post(path), "{path}");
        }
    }

    #[test]
    fn the_model_routes_are_those_the_router_forwards() {
        // What the router took before the table said it (MODEL_POSTS, MODEL_READS).
        let posts = [
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
            "/chat/completions",
            "/completions",
            "/embeddings",
            "/responses",
            "/v1/chat/completions/input_tokens",
            "/chat/completions/input_tokens",
            "/v1/responses/input_tokens",
            "/responses/input_tokens",
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
        assert_eq!(super::model_posts(), posts);
        assert_eq!(
            super::model_reads(),
            ["/slots", "/props", "/v1/responses/{id}"]
        );
    }

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
