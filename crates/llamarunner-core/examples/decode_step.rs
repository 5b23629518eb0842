//! What one decode step costs in llama.cpp with several sequences, by KV-cache layout: one KV
//! stream per sequence (`kv_unified` off) or one cache shared by all (`kv_unified` on), and by
//! what the batch holds: every sequence in slot order, the same rotated, two adjacent slots, two
//! slots with a gap between them, and three generating sequences beside a prompt chunk.
//! llama.cpp splits a batch into micro-batches, and each is a full pass over the weights; with
//! one stream per sequence a micro-batch holds only sequences whose ids follow each other in
//! batch order, with as many tokens of each.
//!
//!     cargo run --release -p llamarunner-core --example decode_step -- MODEL.gguf [THREADS]

use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;
use llama_cpp_2::LogOptions;

const SEQS: i32 = 4;
const PROMPT: i32 = 200;
const STEPS: usize = 15;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or("usage: decode_step MODEL.gguf [THREADS]")?;
    let threads: i32 = args.next().map_or(Ok(2), |t| t.parse())?;
    llama_cpp_2::send_logs_to_tracing(LogOptions::default().with_logs_enabled(false));
    let backend = LlamaBackend::init()?;
    let model = LlamaModel::load_from_file(&backend, path, &LlamaModelParams::default())?;
    let cases: [(&str, &[i32], i32); 5] = [
        ("4 sequences, slot order", &[0, 1, 2, 3], 0),
        ("4 sequences, rotated [2,3,0,1]", &[2, 3, 0, 1], 0),
        ("2 sequences, adjacent slots [0,1]", &[0, 1], 0),
        ("2 sequences, a gap [0,2]", &[0, 2], 0),
        ("3 generating + 128-token prompt chunk", &[0, 1, 2], 128),
    ];
    println!("| batch | one stream per sequence ms | unified ms |\n|---|---|---|");
    let mut results = vec![Vec::new(); cases.len()];
    for unified in [false, true] {
        let params = LlamaContextParams::default()
            .with_n_ctx(NonZeroU32::new(2048 * SEQS as u32))
            .with_n_batch(512)
            .with_n_ubatch(512)
            .with_n_seq_max(SEQS as u32)
            .with_n_threads(threads)
            .with_n_threads_batch(threads)
            .with_kv_unified(unified);
        let mut ctx = model.new_context(&backend, params)?;
        let mut batch = LlamaBatch::new(512, SEQS);
        let mut pos = [0i32; SEQS as usize];
        for s in 0..SEQS {
            let tokens: Vec<i32> = (0..PROMPT).map(|p| 1000 + 37 * s + p).collect();
            step(&mut ctx, &mut batch, &mut pos, &[(s, &tokens)])?;
        }
        for (i, (_, seqs, chunk)) in cases.iter().enumerate() {
            let mut times = Vec::new();
            for n in 0..STEPS + 2 {
                let mut parts: Vec<(i32, Vec<i32>)> =
                    seqs.iter().map(|&s| (s, vec![2000 + n as i32])).collect();
                let chunk_start = pos[3];
                if *chunk > 0 {
                    parts.push((3, (0..*chunk).map(|p| 3000 + p).collect()));
                }
                let parts: Vec<(i32, &[i32])> =
                    parts.iter().map(|(s, t)| (*s, t.as_slice())).collect();
                let took = step(&mut ctx, &mut batch, &mut pos, &parts)?;
                if *chunk > 0 {
                    // The same chunk again next time, at the same positions.
                    ctx.clear_kv_cache_seq(Some(3), Some(chunk_start as u32), None)?;
                    pos[3] = chunk_start;
                }
                if n >= 2 {
                    times.push(took);
                }
            }
            times.sort();
            results[i].push(times[times.len() / 2]);
        }
    }
    for ((name, _, _), r) in cases.iter().zip(&results) {
        println!(
            "| {name} | {:.1} | {:.1} |",
            r[0].as_secs_f64() * 1e3,
            r[1].as_secs_f64() * 1e3
        );
    }
    Ok(())
}

/// Decodes the tokens of each (sequence, tokens) part, in that order; logits for each part's
/// last token. Returns how long llama_decode took.
fn step(
    ctx: &mut LlamaContext,
    batch: &mut LlamaBatch,
    pos: &mut [i32],
    parts: &[(i32, &[i32])],
) -> Result<Duration, Box<dyn std::error::Error>> {
    batch.clear();
    for &(seq, tokens) in parts {
        for (j, &t) in tokens.iter().enumerate() {
            let p = &mut pos[seq as usize];
            batch.add(LlamaToken(t), *p, &[seq], j + 1 == tokens.len())?;
            *p += 1;
        }
    }
    let start = Instant::now();
    ctx.decode(batch)?;
    Ok(start.elapsed())
}
