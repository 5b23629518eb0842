//! The browser face: the chat page and live dashboard (`GET /`, `GET /dashboard`) and their
//! assets (`GET /ui/{name}`), embedded in the binary from `http/ui/` (no CDN, no build step).
//! Every answer carries a strict Content-Security-Policy: scripts, styles and fetches from this
//! origin only, images from this origin or `data:`/`blob:` URLs (attached images), no frames.
//! `GET /` still answers API clients (no `text/html` in `Accept`) with the plain text that
//! Ollama's clients look for. The page is open without an API key (it holds no data); the API
//! calls it makes are not, and it asks for the key when one is refused.
//!
//! `LLAMARUNNER_UI_DIR`, for developing the page: its files are read from that directory on
//! each request (the same three names; nothing else is served from it).

use axum::extract::Path;
use axum::http::header::{
    HeaderValue, ACCEPT, CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, REFERRER_POLICY,
    X_CONTENT_TYPE_OPTIONS, X_FRAME_OPTIONS,
};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

/// The policy of every page answer.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
    img-src 'self' data: blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; \
    frame-ancestors 'none'";

/// The embedded assets: name, content type, bytes.
const ASSETS: [(&str, &str, &str); 3] = [
    (
        "index.html",
        "text/html; charset=utf-8",
        include_str!("ui/index.html"),
    ),
    (
        "app.js",
        "text/javascript; charset=utf-8",
        include_str!("ui/app.js"),
    ),
    (
        "app.css",
        "text/css; charset=utf-8",
        include_str!("ui/app.css"),
    ),
];

/// The paths of the page and its assets, served without an API key (nothing else is: not
/// another name under `/ui/`, which a router would forward to an engine).
pub fn is_open_path(path: &str) -> bool {
    path == "/"
        || path == "/dashboard"
        || path
            .strip_prefix("/ui/")
            .is_some_and(|name| ASSETS.iter().any(|(n, _, _)| *n == name))
}

/// The total size of the embedded page, in bytes (what `/props` and the docs report).
pub fn page_bytes() -> usize {
    ASSETS.iter().map(|(_, _, body)| body.len()).sum()
}

/// One asset's answer, from the development directory when one is set.
fn asset(name: &str) -> Response {
    let Some((_, content_type, embedded)) = ASSETS.iter().find(|(n, _, _)| *n == name) else {
        return (StatusCode::NOT_FOUND, "no such asset").into_response();
    };
    let body = match std::env::var_os("LLAMARUNNER_UI_DIR") {
        Some(dir) if !dir.is_empty() => {
            match std::fs::read(std::path::Path::new(&dir).join(name)) {
                Ok(bytes) => bytes,
                Err(e) => {
                    return (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!("LLAMARUNNER_UI_DIR: {name}: {e}"),
                    )
                        .into_response()
                }
            }
        }
        _ => embedded.as_bytes().to_vec(),
    };
    let mut response = body.into_response();
    let h = response.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// Whether the client asked for a web page.
fn wants_html(headers: &HeaderMap) -> bool {
    headers
        .get_all(ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.to_ascii_lowercase().contains("text/html"))
}

/// `GET /`: the page for a browser, the plain "is running" line for everyone else.
pub async fn root(headers: HeaderMap) -> Response {
    if wants_html(&headers) {
        asset("index.html")
    } else {
        "llamarunner is running".into_response()
    }
}

/// `GET /dashboard`: the same page, which opens on its dashboard tab.
pub async fn dashboard() -> Response {
    asset("index.html")
}

/// `GET /ui/{name}`: a script or style sheet of the page.
pub async fn file(Path(name): Path<String>) -> Response {
    asset(&name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_embedded_names_are_served() {
        for name in ["index.html", "app.js", "app.css"] {
            assert_eq!(asset(name).status(), StatusCode::OK, "{name}");
        }
        for name in ["../Cargo.toml", "", "ui.rs", "index.html/", "APP.JS"] {
            assert_eq!(asset(name).status(), StatusCode::NOT_FOUND, "{name}");
        }
    }

    #[test]
    fn api_clients_get_the_plain_line_and_browsers_the_page() {
        let mut browser = HeaderMap::new();
        browser.insert(ACCEPT, HeaderValue::from_static("text/html,*/*;q=0.8"));
        assert!(wants_html(&browser));
        assert!(!wants_html(&HeaderMap::new()));
        let mut api = HeaderMap::new();
        api.insert(ACCEPT, HeaderValue::from_static("application/json"));
        assert!(!wants_html(&api));
    }

    #[test]
    fn only_the_page_and_its_three_files_are_open() {
        for path in [
            "/",
            "/dashboard",
            "/ui/index.html",
            "/ui/app.js",
            "/ui/app.css",
        ] {
            assert!(is_open_path(path), "{path}");
        }
        for path in [
            "/ui/",
            "/ui/a/b",
            "/ui/app.js/x",
            "/ui/../slots",
            "//",
            "/dashboard/",
            "/slots",
            "/ui",
        ] {
            assert!(!is_open_path(path), "{path}");
        }
    }

    #[test]
    fn every_asset_carries_the_policy() {
        let r = asset("app.js");
        assert_eq!(r.headers()[CONTENT_SECURITY_POLICY], CSP);
        assert_eq!(r.headers()[X_CONTENT_TYPE_OPTIONS], "nosniff");
    }
}
