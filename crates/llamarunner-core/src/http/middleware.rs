//! What every request passes before a handler sees it: the `Host` and `Origin` checks that keep
//! web pages away from a loopback server (DNS rebinding, drive-by posts), CORS for the origins
//! that are allowed, API keys, and the body limit. Rejections are answered in the dialect of
//! the path (`error::Dialect`). Connection-level limits (header and idle timeouts, the
//! connection cap) live in `runner.rs`, where connections are accepted.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header::{
    ACCESS_CONTROL_ALLOW_CREDENTIALS, ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS,
    ACCESS_CONTROL_ALLOW_ORIGIN, ACCESS_CONTROL_MAX_AGE, ACCESS_CONTROL_REQUEST_HEADERS,
    ACCESS_CONTROL_REQUEST_METHOD, AUTHORIZATION, CONTENT_LENGTH, EXPECT, HOST, ORIGIN, VARY,
    WWW_AUTHENTICATE,
};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{from_fn_with_state, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::{ConfigError, RunnerConfig, DEFAULT_MAX_BODY};
use crate::http::error::{ApiError, Dialect};

/// Schemes of pages that run on the user's machine (desktop apps, extensions' views, local
/// files), allowed as Ollama allows them.
const LOCAL_APP_SCHEMES: [&str; 5] = ["app", "file", "tauri", "vscode-webview", "vscode-file"];

/// How much of a too-large body is read (and thrown away) before answering 413, so that the
/// client is not reset while it still sends and gets to read the answer.
const DRAIN_LIMIT: usize = 1 << 20;

/// How long that draining may take.
const DRAIN_TIME: Duration = Duration::from_secs(2);

/// The request policy: who may call, from where, with how large a body.
#[derive(Clone)]
pub struct HttpPolicy {
    /// SHA-256 of each API key; empty = no authentication. Digests, so that comparing them in
    /// constant time does not reveal a key's length either.
    keys: Vec<[u8; 32]>,
    /// Refuse `Host` headers that do not name a loopback host (set when bound to loopback).
    check_host: bool,
    /// Allowed origins besides the loopback ones: lowercase patterns where `*` matches any run
    /// of characters (`*` alone: every origin).
    origins: Vec<String>,
    /// Largest request body, in bytes.
    max_body: usize,
}

impl std::fmt::Debug for HttpPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpPolicy")
            .field("keys", &self.keys.len())
            .field("check_host", &self.check_host)
            .field("origins", &self.origins)
            .field("max_body", &self.max_body)
            .finish()
    }
}

impl Default for HttpPolicy {
    /// No keys, loopback `Host` checks, loopback origins only, an 8 MiB body limit.
    fn default() -> Self {
        Self::new(&[], &[], true, DEFAULT_MAX_BODY)
    }
}

impl HttpPolicy {
    /// A policy with these API keys (none = open), extra allowed origins, `Host` checks when
    /// `loopback` (the server listens on a loopback address) and a body limit in bytes.
    pub fn new(
        api_keys: &[String],
        allow_origin: &[String],
        loopback: bool,
        max_body: u64,
    ) -> Self {
        Self {
            keys: api_keys
                .iter()
                .map(|k| Sha256::digest(k.as_bytes()).into())
                .collect(),
            check_host: loopback,
            origins: allow_origin
                .iter()
                .map(|o| o.trim().trim_end_matches('/').to_ascii_lowercase())
                .collect(),
            max_body: usize::try_from(max_body).unwrap_or(usize::MAX),
        }
    }

    /// The policy `config` asks for (reading `api_key_file`), for a server bound to loopback
    /// or not.
    pub fn from_config(config: &RunnerConfig, loopback: bool) -> Result<Self, ConfigError> {
        Ok(Self::new(
            &config.api_keys()?,
            &config.allow_origin,
            loopback,
            config.max_body,
        ))
    }

    /// Whether requests need an API key.
    pub fn requires_key(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Whether the request carries one of the keys, as a bearer token or in `X-Api-Key`.
    /// Every presented value is compared with every key, in constant time.
    fn authorized(&self, headers: &HeaderMap) -> bool {
        let bearer = headers
            .get_all(AUTHORIZATION)
            .iter()
            .filter_map(|v| bearer_token(v.as_bytes()));
        let api_key = headers
            .get_all("x-api-key")
            .iter()
            .map(|v| v.as_bytes().trim_ascii());
        let mut ok = subtle::Choice::from(0);
        for presented in bearer.chain(api_key) {
            let digest: [u8; 32] = Sha256::digest(presented).into();
            for key in &self.keys {
                ok |= key.ct_eq(&digest);
            }
        }
        ok.into()
    }

    /// Whether a browser page from `origin` may call.
    fn origin_allowed(&self, origin: &str) -> bool {
        let origin = origin.to_ascii_lowercase();
        is_local_origin(&origin) || self.origins.iter().any(|p| glob_match(p, &origin))
    }
}

/// The token of an `Authorization: Bearer TOKEN` value.
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let (scheme, token) = value.trim_ascii().split_at_checked(6)?;
    if !scheme.eq_ignore_ascii_case(b"bearer") || !token.first()?.is_ascii_whitespace() {
        return None;
    }
    Some(token.trim_ascii())
}

/// `host[:port]`, `[v6]:port`, `v6` or `[v6]` -> the host, without brackets.
fn strip_port(authority: &str) -> &str {
    if let Some(rest) = authority.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match authority.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') && port.bytes().all(|b| b.is_ascii_digit()) => {
            host
        }
        _ => authority,
    }
}

/// `localhost`, a `*.localhost` name (browsers resolve those to loopback) or a loopback IP.
fn is_loopback_host(host: &str) -> bool {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    host == "localhost"
        || host.ends_with(".localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Whether `origin` is the server's own (its `host[:port]` is the request's `Host`): the chat
/// page served from the address the server is reached at (a LAN address). Taken only when the
/// server requires a key: a DNS-rebinding page is same-origin too, but cannot have the key
/// (the page keeps it in the real origin's storage).
fn is_same_origin(origin: &str, host: Option<&HeaderValue>) -> bool {
    let Some(host) = host.and_then(|h| h.to_str().ok()) else {
        return false;
    };
    let authority = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    authority.is_some_and(|a| !a.is_empty() && a.eq_ignore_ascii_case(host))
}

/// An `http(s)://` origin on a loopback host (any port), or a local app's scheme.
fn is_local_origin(origin: &str) -> bool {
    let Some((scheme, rest)) = origin.split_once("://") else {
        return false;
    };
    match scheme {
        "http" | "https" => !rest.contains('/') && is_loopback_host(strip_port(rest)),
        _ => LOCAL_APP_SCHEMES.contains(&scheme),
    }
}

/// Whether `text` matches `pattern`, where `*` matches any run of characters.
fn glob_match(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = text.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty(); // no `*`: an exact match
    };
    for part in middle {
        match rest.find(part) {
            Some(i) => rest = &rest[i + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

/// Adds the policy's layers to `router` (whose routes and fallback are all in place). The last
/// added runs first: `Host`/`Origin` and CORS, then the key, then the body limit.
pub fn apply(router: Router, policy: Arc<HttpPolicy>) -> Router {
    router
        // `limit_body` enforces the limit (in the dialect's shape); this only keeps axum's own
        // 2 MB default out of the way.
        .layer(DefaultBodyLimit::max(policy.max_body))
        .layer(from_fn_with_state(policy.clone(), limit_body))
        .layer(from_fn_with_state(policy.clone(), authenticate))
        .layer(from_fn_with_state(policy, check_host_and_origin))
}

/// Methods a page may use, as preflights are told (`DELETE /v1/responses/{id}` among them;
/// `HEAD` is a CORS-safelisted method that needs no listing). llama-server's list.
const CORS_METHODS: &str = "GET, POST, DELETE, OPTIONS";

/// How long a browser may cache a preflight's answer, in seconds.
const CORS_MAX_AGE: &str = "600";

/// The headers a preflight's answer varies by.
const PREFLIGHT_VARY: &str =
    "origin, access-control-request-method, access-control-request-headers";

/// The answer to a CORS preflight from an allowed `origin`: 200 (as llama-server answers; any
/// 2xx is a preflight's "ok status"), the methods, the headers it asked for (`Authorization`
/// among them, which a wildcard would not cover: llama-server's `*` does not let a page send
/// its key), credentials allowed (as llama-server allows them: no answer here depends on a
/// cookie, keys come in `Authorization`) and no body.
fn preflight(origin: &HeaderValue, headers: &HeaderMap) -> Response {
    let mut response = StatusCode::OK.into_response();
    let h = response.headers_mut();
    h.insert(ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone());
    h.insert(
        ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static(CORS_METHODS),
    );
    h.insert(
        ACCESS_CONTROL_ALLOW_CREDENTIALS,
        HeaderValue::from_static("true"),
    );
    if let Some(asked) = headers.get(ACCESS_CONTROL_REQUEST_HEADERS) {
        h.insert(ACCESS_CONTROL_ALLOW_HEADERS, asked.clone());
    }
    h.insert(
        ACCESS_CONTROL_MAX_AGE,
        HeaderValue::from_static(CORS_MAX_AGE),
    );
    h.insert(VARY, HeaderValue::from_static(PREFLIGHT_VARY));
    response
}

/// The answer to a CORS preflight from an origin that is not allowed: 200 without any CORS
/// header, so the browser itself stops the call (as llama-server answers); the call, were it
/// made anyway, is refused with 403.
fn preflight_refused() -> Response {
    let mut response = StatusCode::OK.into_response();
    response
        .headers_mut()
        .insert(VARY, HeaderValue::from_static(PREFLIGHT_VARY));
    response
}

/// 403 for a `Host` that is not loopback on a loopback server, and for an `Origin` that is not
/// allowed; CORS for the origins that are: preflights are answered here (before the key is
/// checked: browsers send none with them), other answers get `Access-Control-Allow-Origin`.
async fn check_host_and_origin(
    State(policy): State<Arc<HttpPolicy>>,
    req: Request,
    next: Next,
) -> Response {
    let refuse =
        |message: String| Dialect::of_path(req.uri().path()).respond(ApiError::Forbidden(message));
    if policy.check_host {
        let host = match req.headers().get(HOST) {
            Some(h) => h.to_str().ok(),
            None => Some(req.uri().host().unwrap_or("")),
        };
        match host {
            Some(h) if h.is_empty() || is_loopback_host(strip_port(h)) => {}
            _ => {
                let shown = host.unwrap_or("(not text)");
                return refuse(format!(
                    "Host {shown:?} is refused: this server listens on a loopback address and \
                     answers only requests addressed to localhost or a loopback IP"
                ));
            }
        }
    }
    let Some(origin) = req.headers().get(ORIGIN).cloned() else {
        return next.run(req).await;
    };
    let shown = origin.to_str().unwrap_or("(not text)");
    let same_origin = policy.requires_key() && is_same_origin(shown, req.headers().get(HOST));
    let is_preflight = req.method() == Method::OPTIONS
        && req.headers().contains_key(ACCESS_CONTROL_REQUEST_METHOD);
    if !same_origin && !policy.origin_allowed(shown) {
        if is_preflight {
            return preflight_refused();
        }
        return refuse(format!(
            "Origin {shown:?} is not allowed: only pages on localhost can call this server \
             unless it is started with --allow-origin"
        ));
    }
    if is_preflight {
        return preflight(&origin, req.headers());
    }
    let mut response = next.run(req).await;
    let h = response.headers_mut();
    h.insert(ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(
        ACCESS_CONTROL_ALLOW_CREDENTIALS,
        HeaderValue::from_static("true"),
    );
    h.append(VARY, HeaderValue::from_static("origin"));
    response
}

/// 401 without a valid key, when keys are configured; `GET /health` stays open (probes), and so
/// do the page's static files (`ui.rs`: they hold no data, and the page asks for the key).
async fn authenticate(State(policy): State<Arc<HttpPolicy>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let open = (path == "/health" || super::ui::is_open_path(path))
        && matches!(*req.method(), Method::GET | Method::HEAD);
    if !policy.requires_key() || open || policy.authorized(req.headers()) {
        return next.run(req).await;
    }
    let mut response = Dialect::of_path(req.uri().path()).respond(ApiError::Unauthorized);
    response
        .headers_mut()
        .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// Reads the whole body, refusing one over `max_body` with 413, so that handlers (which take
/// the body as bytes) get it whole or not at all.
async fn limit_body(State(policy): State<Arc<HttpPolicy>>, req: Request, next: Next) -> Response {
    let dialect = Dialect::of_path(req.uri().path());
    let max = policy.max_body;
    let too_large = || {
        dialect.respond(ApiError::PayloadTooLarge(format!(
            "the request body is larger than this server's limit of {max} bytes (--max-body)"
        )))
    };
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let (parts, body) = req.into_parts();
    if declared.is_some_and(|n| n > max as u64) {
        // A client waiting for `100 Continue` has not sent the body: answering at once spares
        // it. Otherwise read (and drop) a moderate excess, so the answer is not lost in a reset.
        let waits = parts.headers.contains_key(EXPECT);
        if !waits && declared.is_some_and(|n| n - max as u64 <= DRAIN_LIMIT as u64) {
            drain(body).await;
        }
        return too_large();
    }
    let read = tokio::time::timeout(BODY_TIMEOUT, Limited::new(body, max).collect());
    let Ok(read) = read.await else {
        return dialect.respond(ApiError::RequestTimeout(format!(
            "the request body did not arrive within {} seconds",
            BODY_TIMEOUT.as_secs()
        )));
    };
    match read {
        Ok(collected) => {
            next.run(Request::from_parts(parts, Body::from(collected.to_bytes())))
                .await
        }
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => too_large(),
        Err(e) => dialect.respond(ApiError::InvalidJson(format!(
            "cannot read the request body: {e}"
        ))),
    }
}

/// How long a request's body may take to arrive once its headers have (a client trickling a
/// body byte by byte would otherwise hold its connection for ever).
pub const BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Reads and drops up to `DRAIN_LIMIT` bytes of `body`, for at most `DRAIN_TIME`.
async fn drain(body: Body) {
    let _ = tokio::time::timeout(DRAIN_TIME, Limited::new(body, DRAIN_LIMIT).collect()).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts_with_or_without_ports() {
        for ok in [
            "localhost",
            "LOCALHOST:8080",
            "localhost.",
            "app.localhost:3000",
            "127.0.0.1",
            "127.0.0.1:8080",
            "127.1.2.3",
            "[::1]:8080",
            "[::1]",
        ] {
            assert!(is_loopback_host(strip_port(ok)), "{ok}");
        }
        for refused in [
            "example.com",
            "evil.localhost.example.com",
            "localhost.evil.com:80",
            "10.0.0.1:8080",
            "[::2]:80",
            "0.0.0.0",
            "",
        ] {
            assert!(!is_loopback_host(strip_port(refused)), "{refused}");
        }
    }

    #[test]
    fn local_origins_and_patterns() {
        let policy = HttpPolicy::new(
            &[],
            &[
                "https://app.example.com".into(),
                "chrome-extension://*".into(),
                "https://*.corp.net".into(),
            ],
            true,
            1,
        );
        for ok in [
            "http://localhost",
            "http://localhost:5173",
            "https://127.0.0.1:8443",
            "http://[::1]:3000",
            "app://desktop",
            "file://",
            "tauri://localhost",
            "https://app.example.com",
            "https://APP.example.com",
            "chrome-extension://abcdef",
            "https://x.corp.net",
        ] {
            assert!(policy.origin_allowed(ok), "{ok}");
        }
        for refused in [
            "null",
            "http://example.com",
            "http://localhost.example.com",
            "https://app.example.com.evil.io",
            "ftp://localhost",
            "https://corp.net",
            "http://localhost/path",
        ] {
            assert!(!policy.origin_allowed(refused), "{refused}");
        }
        let any = HttpPolicy::new(&[], &["*".into()], true, 1);
        assert!(any.origin_allowed("https://anything.example"));
        assert!(any.origin_allowed("null"));
    }

    #[test]
    fn glob_patterns() {
        assert!(glob_match("a*c", "abc"));
        assert!(glob_match("a*c", "ac"));
        assert!(!glob_match("a*c", "ab"));
        assert!(glob_match("*", ""));
        assert!(glob_match("a*b*c", "a-b-b-c"));
        assert!(!glob_match("ab*ba", "aba"));
        assert!(!glob_match("abc", "abcd"));
    }

    #[test]
    fn keys_from_either_header_any_of_several() {
        let policy = HttpPolicy::new(&["first".into(), "second".into()], &[], true, 1);
        let with = |name: &str, value: &str| {
            let mut h = HeaderMap::new();
            h.insert(
                axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
            policy.authorized(&h)
        };
        assert!(with("authorization", "Bearer first"));
        assert!(with("authorization", "bearer   second "));
        assert!(with("x-api-key", "second"));
        assert!(!with("authorization", "Bearer third"));
        assert!(!with("authorization", "Basic first"));
        assert!(!with("authorization", "Bearerfirst"));
        assert!(!with("authorization", "first"));
        assert!(!with("x-api-key", "firs"));
        assert!(!with("x-api-key", ""));
        assert!(!policy.authorized(&HeaderMap::new()));
    }
}
