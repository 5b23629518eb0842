//! HTTP plumbing under every route: the request policy (`middleware.rs`: auth, hosts, origins,
//! body limits), request ids and the access log (`access.rs`), the Prometheus registry
//! (`metrics.rs`), the mapping of errors to statuses and dialect shapes (`error.rs`), the 404
//! and 405 answers (`fallback.rs`), the state every handler reaches (`state.rs`), text cut to fit
//! (`text.rs`), and the server
//! itself (`server.rs`: binding, the accept loop, its thread) under a runner and a router alike.
//! It knows no route: `routes.rs` at the crate root assembles them.

pub mod access;
pub mod error;
pub mod fallback;
pub mod llama_server_metrics;
pub mod metrics;
pub mod middleware;
pub mod response_store;
pub mod server;
pub mod state;
pub mod text;
pub mod ui;

pub use state::{AppState, Limits, IMAGES_IN_FLIGHT};
