//! The registry's loading, leasing and unloading, against stand-in engine processes.

use std::time::{Duration, Instant};

use serde_json::json;

use super::{Registry, Status};
use crate::http::error::ApiError;
use crate::router::ModelSpec;

fn registry(names: &[&str]) -> std::sync::Arc<Registry> {
    registry_running(names, &["true"], Duration::from_secs(1))
}

fn registry_running(
    names: &[&str],
    command: &[&str],
    load_timeout: Duration,
) -> std::sync::Arc<Registry> {
    let specs: Vec<ModelSpec> = names
        .iter()
        .map(|n| ModelSpec {
            name: n.to_string(),
            path: format!("/models/{n}.gguf"),
            config: json!({}),
        })
        .collect();
    Registry::new(
        &specs,
        2,
        0,
        None,
        command.iter().map(|c| c.to_string()).collect(),
        load_timeout,
    )
}

#[test]
fn a_model_is_found_by_name_tag_or_file_name() {
    let r = registry(&["alpha", "bravo"]);
    for asked in ["alpha", "alpha:latest", "alpha.gguf"] {
        assert_eq!(
            r.find(Some(asked)).map(|m| m.name.clone()).ok().as_deref(),
            Some("alpha")
        );
    }
    // Names are exact, as the engine compares them: a padded name would load a model
    // whose engine then refuses the request.
    for asked in [
        "ALPHA", "alpha:v2", "../alpha", "alpha\0", "gamma", " alpha ", "  ",
    ] {
        let e = r.find(Some(asked)).unwrap_err();
        assert!(
            matches!(e, ApiError::ModelNotFound(ref m) if m.contains("alpha, bravo")),
            "{e}"
        );
    }
    // Several models: a request must name one.
    assert!(matches!(r.find(None), Err(ApiError::InvalidRequest(_))));
    assert!(matches!(r.find(Some("")), Err(ApiError::InvalidRequest(_))));
    // One model: a request need not.
    assert_eq!(
        registry(&["solo"])
            .find(None)
            .map(|m| m.name.clone())
            .ok()
            .as_deref(),
        Some("solo")
    );
}

#[test]
fn a_tagless_name_finds_the_model_served_with_the_latest_tag() {
    // A model of Ollama's store is served as `name:tag`; Ollama's clients say `name` for
    // `name:latest`, never for another tag.
    let r = registry(&["tiny:latest", "seer:1b"]);
    for asked in ["tiny", "tiny:latest"] {
        assert_eq!(
            r.find(Some(asked)).map(|m| m.name.clone()).ok().as_deref(),
            Some("tiny:latest")
        );
    }
    assert!(r.find(Some("seer")).is_err());
    assert!(r.find(Some("tiny:1b")).is_err());
}

#[test]
fn a_pulled_model_joins_once_and_answers_to_the_name_it_was_asked_by() {
    let r = registry(&["alpha"]);
    let spec = |name: &str, path: &str| ModelSpec {
        name: name.into(),
        path: path.into(),
        config: json!({}),
    };
    let pulled = r.add(&spec("o/r:Q4_K_M", "/cache/o/r/m-Q4_K_M.gguf"));
    assert_eq!(pulled.name, "o/r:Q4_K_M");
    assert_eq!(r.models().len(), 2);
    // The same name, or the same file under another name: the model served already.
    assert!(std::sync::Arc::ptr_eq(
        &r.add(&spec("o/r:Q4_K_M", "/x.gguf")),
        &pulled
    ));
    let again = r.add(&spec("o/r", "/cache/o/r/m-Q4_K_M.gguf"));
    assert!(std::sync::Arc::ptr_eq(&again, &pulled));
    assert_eq!(r.models().len(), 2);
    // The name a pull was asked by finds it; a model's own name stays its own.
    r.alias("hf.co/o/r:Q4_K_M", &pulled);
    r.alias("alpha", &pulled);
    let found = |n: &str| r.find(Some(n)).map(|m| m.name.clone()).ok();
    assert_eq!(found("hf.co/o/r:Q4_K_M").as_deref(), Some("o/r:Q4_K_M"));
    assert_eq!(found("alpha").as_deref(), Some("alpha"));
}

#[test]
fn a_removed_model_and_its_other_names_are_gone() {
    let r = registry(&["alpha", "bravo"]);
    let alpha = r.find(Some("alpha")).unwrap();
    r.alias("hf.co/alpha", &alpha);
    assert!(r.remove(&alpha));
    assert_eq!(r.names(), "bravo");
    assert!(r.find(Some("alpha")).is_err());
    assert!(r.find(Some("hf.co/alpha")).is_err());
    assert!(!r.is_alias("hf.co/alpha"));
}

#[test]
fn a_models_own_name_comes_before_another_models_tag_or_file_name() {
    // Files alpha.gguf, alpha.gguf.gguf (named "alpha.gguf") and alpha:latest.gguf (named
    // "alpha:latest"): each name finds its own model, whatever the order.
    for names in [
        ["alpha", "alpha.gguf", "alpha:latest"],
        ["alpha:latest", "alpha.gguf", "alpha"],
    ] {
        let r = registry(&names);
        for asked in names {
            assert_eq!(
                r.find(Some(asked)).map(|m| m.name.clone()).ok().as_deref(),
                Some(asked)
            );
        }
        // File names come last: alpha.gguf.gguf is the model named "alpha.gguf".
        assert_eq!(
            r.find(Some("alpha.gguf.gguf"))
                .map(|m| m.name.clone())
                .ok()
                .as_deref(),
            Some("alpha.gguf")
        );
    }
}

#[test]
fn a_long_unknown_name_is_cut_in_the_message() {
    let r = registry(&["alpha"]);
    let Err(ApiError::ModelNotFound(m)) = r.find(Some(&"x".repeat(100_000))) else {
        panic!("not a 404");
    };
    assert!(m.len() < 400, "{}", m.len());
}

#[tokio::test]
async fn an_engine_that_fails_before_it_serves_gives_the_reason_it_wrote_last() {
    // As `_engine.py` does when the file is not a model: one line on stderr, then exit 1.
    // A line that is not UTF-8 (and another model's name) does not stop or replace it.
    let script = "printf 'noise \\377\\n' >&2; \
                  echo 'llamarunner: model bravo: not this one' >&2; \
                  echo 'llamarunner: model alpha: /models/alpha.gguf is not a GGUF model file' >&2; \
                  echo 'a last log line' >&2; exit 1";
    let r = registry_running(
        &["alpha", "bravo"],
        &["sh", "-c", script],
        Duration::from_secs(5),
    );
    let m = r.find(Some("alpha")).unwrap();
    let e = r.lease(&m).await.unwrap_err();
    let ApiError::LoadFailed(why) = e else {
        panic!("{e}");
    };
    assert!(
        why.contains("failed: /models/alpha.gguf is not a GGUF model file (exit status: 1)"),
        "{why}"
    );
}

#[tokio::test]
async fn an_engines_reason_is_cut_to_a_kilobyte() {
    let script = "printf 'llamarunner: model alpha: %0100000d\\n' 0 >&2; exit 1";
    let r = registry_running(&["alpha"], &["sh", "-c", script], Duration::from_secs(5));
    let m = r.find(Some("alpha")).unwrap();
    let ApiError::LoadFailed(why) = r.lease(&m).await.unwrap_err() else {
        panic!("not a load failure");
    };
    assert!(why.contains("000000") && why.len() < 1200, "{}", why.len());
}

#[tokio::test]
async fn an_engine_that_exits_while_loading_fails_the_request_with_its_reason() {
    // `true` exits at once: the load fails, the request is told, the model says failed.
    let r = registry(&["alpha", "bravo"]);
    let m = r.find(Some("alpha")).unwrap();
    let e = r.lease(&m).await.unwrap_err();
    assert!(
        matches!(e, ApiError::LoadFailed(ref why) if why.contains("ended while loading")),
        "{e}"
    );
    assert!(matches!(m.status(), Status::Failed { .. }));
    assert_eq!(r.describe(&m)["status"]["value"], "failed");
}

#[tokio::test]
async fn an_engine_that_hangs_while_loading_is_stopped_at_the_load_timeout() {
    let r = registry_running(&["alpha"], &["sleep", "60"], Duration::from_millis(300));
    let m = r.find(Some("alpha")).unwrap();
    let started = Instant::now();
    let e = r.lease(&m).await.unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5), "{e}");
    // The watchdog marks it failed and kills the process: its place is free again.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !matches!(m.status(), Status::Failed { .. }) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    match m.status() {
        Status::Failed { error } => assert!(error.contains("did not load"), "{error}"),
        other => panic!("{other:?}"),
    }
    assert!(m.lock().process.is_none());
    assert_eq!(m.counts(), (1, 1));
}

#[tokio::test]
async fn a_stale_decision_does_not_unload_a_model_that_took_a_lease_since() {
    let r = registry(&["alpha"]);
    let m = r.find(Some("alpha")).unwrap();
    {
        let mut inner = m.lock();
        inner.status = Status::Loaded { port: 1 };
        inner.in_flight = 1; // a request came after the idle check
    }
    assert!(!r.unload_idle(&m, "test"));
    assert!(matches!(m.status(), Status::Loaded { .. }));
    m.lock().in_flight = 0;
    assert!(r.unload_idle(&m, "test"));
    assert_eq!(m.status(), Status::Unloaded);
}

#[tokio::test]
async fn engines_start_one_at_a_time() {
    // `sleep` never becomes ready: alpha loads until its timeout, and bravo's engine does not
    // start before alpha's is gone.
    let r = registry_running(
        &["alpha", "bravo"],
        &["sleep", "60"],
        Duration::from_secs(2),
    );
    let alpha = r.find(Some("alpha")).unwrap();
    let bravo = r.find(Some("bravo")).unwrap();
    r.load(&alpha).await.unwrap();
    assert!(matches!(alpha.status(), Status::Loading { .. }));
    let waited = tokio::time::timeout(Duration::from_millis(300), r.load(&bravo)).await;
    assert!(waited.is_err(), "bravo started while alpha was loading");
    assert_eq!(bravo.status(), Status::Unloaded);
    // Once alpha is gone (its load timed out), bravo starts.
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), r.load(&bravo))
        .await
        .expect("bravo starts once alpha's load ended")
        .unwrap();
    assert!(started.elapsed() > Duration::from_millis(500));
    assert!(matches!(bravo.status(), Status::Loading { .. }));
    assert!(matches!(alpha.status(), Status::Failed { .. }));
}
