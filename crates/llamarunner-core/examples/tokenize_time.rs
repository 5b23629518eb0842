//! How long tokenizing a long prompt takes — time the engine thread would stall every decode
//! step for if it tokenized (it does not: the HTTP side tokenizes on tokio's blocking pool).
//!
//!     cargo run --release -p llamarunner-core --example tokenize_time -- MODEL.gguf

use std::time::{Duration, Instant};

use llamarunner_core::{Runner, RunnerConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = std::env::args()
        .nth(1)
        .ok_or("usage: tokenize_time MODEL.gguf")?;
    let config = RunnerConfig {
        model: model.into(),
        port: 0,
        ctx_size: 512,
        ..RunnerConfig::default()
    };
    let runner = Runner::start(config)?;
    let info = loop {
        if let Some(info) = runner.health().model_info() {
            break info;
        }
        if let Some(e) = runner.health().error() {
            return Err(e.into());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let model = info.text.clone();
    let words = [
        "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "again",
    ];
    println!("| words | tokens | tokenize ms |\n|---|---|---|");
    for n in [2_000usize, 20_000, 100_000] {
        let text = (0..n)
            .map(|i| words[(i * 7 + i / 3) % words.len()])
            .collect::<Vec<_>>()
            .join(" ");
        let start = Instant::now();
        let tokens = model.tokenize(&text)?;
        let ms = start.elapsed().as_secs_f64() * 1e3;
        println!("| {n} | {} | {ms:.1} |", tokens.len());
    }
    Ok(())
}
