//! `GET /metrics` on a router: every loaded engine's metrics (each sample labelled with its
//! `model_name`), merged into one exposition with a family's samples together, and the
//! router's own: each model's state, starts and failures.

use std::fmt::Write as _;
use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};

use super::engine_client;
use super::registry::{Registry, Status};

/// The content type of Prometheus's text format.
const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// `GET /metrics`.
pub async fn handler(State(registry): State<Arc<Registry>>) -> Response {
    let mut texts = vec![own(&registry)];
    for model in registry.models() {
        if let Status::Loaded { port } = model.status() {
            // A model that dies or is unloaded during the scrape is left out of it.
            if let Some(text) =
                engine_client::engine_get(port, registry.engine_key(), "/metrics").await
            {
                texts.push(label_bare_samples(&text, &model.name));
            }
        }
    }
    ([(header::CONTENT_TYPE, TEXT_FORMAT)], merge(&texts)).into_response()
}

/// The router's own families.
fn own(registry: &Registry) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HELP llamarunner:router_model_state A model's state (1 for its current one).\n\
         # TYPE llamarunner:router_model_state gauge"
    );
    for m in registry.models() {
        let now = m.status();
        for state in ["unloaded", "loading", "loaded", "failed"] {
            let value = u8::from(now.as_str() == state);
            let _ = writeln!(
                out,
                "llamarunner:router_model_state{{model_name=\"{}\",state=\"{state}\"}} {value}",
                escape(&m.name)
            );
        }
    }
    let counters = [
        (
            "llamarunner:router_model_starts_total",
            "Engine processes started for a model (loads begun).",
            0,
        ),
        (
            "llamarunner:router_model_failures_total",
            "A model's failed loads and engine processes that died.",
            1,
        ),
    ];
    for (name, help, which) in counters {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for m in registry.models() {
            let (starts, failures) = m.counts();
            let value = if which == 0 { starts } else { failures };
            let _ = writeln!(out, "{name}{{model_name=\"{}\"}} {value}", escape(&m.name));
        }
    }
    out
}

/// A label value in the text format: backslash, quote and newline escaped.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// `text` with a `model_name` label on the samples that have no labels (llama-server's
/// `llamacpp:` families), so that two models' samples stay apart.
fn label_bare_samples(text: &str, model: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        match line.split_once(' ') {
            Some((name, value)) if !line.starts_with('#') && !name.contains('{') => {
                let _ = writeln!(out, "{name}{{model_name=\"{}\"}} {value}", escape(model));
            }
            _ => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

/// One exposition from several: each family once, with its HELP and TYPE and every text's
/// samples of it, in the order families are first seen.
pub fn merge(texts: &[String]) -> String {
    struct Family {
        name: String,
        help: Option<String>,
        kind: Option<String>,
        samples: Vec<String>,
    }
    let mut families: Vec<Family> = Vec::new();
    let mut index = std::collections::HashMap::<String, usize>::new();
    let mut family_of = |name: &str, families: &mut Vec<Family>| -> usize {
        *index.entry(name.to_string()).or_insert_with(|| {
            families.push(Family {
                name: name.to_string(),
                help: None,
                kind: None,
                samples: Vec::new(),
            });
            families.len() - 1
        })
    };
    for text in texts {
        let mut current: Option<usize> = None;
        for line in text.lines() {
            let line = line.trim_end();
            if line.is_empty() {
                continue;
            }
            if let Some(rest) = line.strip_prefix("# ") {
                let mut words = rest.splitn(3, ' ');
                let (Some(word), Some(name)) = (words.next(), words.next()) else {
                    continue;
                };
                if word != "HELP" && word != "TYPE" {
                    continue;
                }
                let i = family_of(name, &mut families);
                current = Some(i);
                let slot = if word == "HELP" {
                    &mut families[i].help
                } else {
                    &mut families[i].kind
                };
                if slot.is_none() {
                    *slot = Some(line.to_string());
                }
                continue;
            }
            if line.starts_with('#') {
                continue;
            }
            let sample_name = line
                .split(|c: char| c == '{' || c.is_whitespace())
                .next()
                .unwrap_or_default();
            let i = match current {
                Some(i) if sample_name.starts_with(families[i].name.as_str()) => i,
                _ => family_of(sample_name, &mut families),
            };
            families[i].samples.push(line.to_string());
        }
    }
    let mut out = String::new();
    for f in families {
        for line in f.help.iter().chain(&f.kind).chain(&f.samples) {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_family_appears_once_with_every_models_samples() {
        let engine = |name: &str, n: u32| {
            format!(
                "# HELP llamarunner_requests_total Requests.\n\
                 # TYPE llamarunner_requests_total counter\n\
                 llamarunner_requests_total{{model_name=\"{name}\"}} {n}\n\
                 # HELP llamarunner_ttft_seconds TTFT.\n\
                 # TYPE llamarunner_ttft_seconds histogram\n\
                 llamarunner_ttft_seconds_bucket{{model_name=\"{name}\",le=\"+Inf\"}} {n}\n\
                 llamarunner_ttft_seconds_sum{{model_name=\"{name}\"}} 0.5\n\
                 llamarunner_ttft_seconds_count{{model_name=\"{name}\"}} {n}\n"
            )
        };
        let merged = merge(&[engine("a", 1), engine("b", 2)]);
        assert_eq!(
            merged.matches("# TYPE llamarunner_requests_total").count(),
            1
        );
        assert_eq!(
            merged.matches("# HELP llamarunner_ttft_seconds ").count(),
            1
        );
        let lines: Vec<&str> = merged.lines().collect();
        let at = |s: &str| {
            lines
                .iter()
                .position(|l| l.starts_with(s))
                .unwrap_or(usize::MAX)
        };
        // b's counter sample comes before the histogram's family begins.
        assert!(at("llamarunner_requests_total{model_name=\"b\"}") < at("# HELP llamarunner_ttft"));
        assert_eq!(
            merged
                .lines()
                .filter(|l| l.starts_with("llamarunner_ttft_seconds_count"))
                .count(),
            2
        );
        assert_eq!(merge(&[]), "");
        assert!(merge(&["# odd\n#\n# HELP\nx 1\n".into()]).contains("x 1\n"));
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn bare_samples_get_the_model_s_name() {
        let text =
            "# HELP llamacpp:n_decode_total Calls.\n# TYPE llamacpp:n_decode_total counter\n\
                    llamacpp:n_decode_total 3\nllamarunner:x{model_name=\"a\"} 1\n";
        let labelled = label_bare_samples(text, "m\"1");
        assert!(labelled.contains("llamacpp:n_decode_total{model_name=\"m\\\"1\"} 3\n"));
        assert!(labelled.contains("llamarunner:x{model_name=\"a\"} 1\n"));
        assert!(labelled.starts_with("# HELP llamacpp:n_decode_total Calls.\n"));
    }
}
