//! How long a prompt lookup (`sched::speculative::propose`) takes: the search of a drafting
//! sequence's last tokens for its tail, which the engine thread runs for every such sequence
//! between two decodes. Prints a table of microseconds per lookup by history length, for
//! histories where the tail never occurred (the whole window is searched: the worst case) and
//! for a text that repeats (found near the end).
//!
//!     cargo run --release -p llamarunner-core --no-default-features --example lookup_time

use std::hint::black_box;
use std::time::Instant;

use llamarunner_core::protocol::Token;
use llamarunner_core::sched::speculative::propose;

/// Microseconds per lookup of `last` after `history` (3-grams down to pairs, 8 drafted).
fn time(history: &[Token], last: Token) -> f64 {
    let mut out = Vec::with_capacity(8);
    let runs = 2000;
    let started = Instant::now();
    for _ in 0..runs {
        out.clear();
        black_box(propose(black_box(history), black_box(last), 3, 8, &mut out));
    }
    started.elapsed().as_secs_f64() * 1e6 / f64::from(runs)
}

fn main() {
    // xorshift: the same histories in every run.
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move |below: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        Token::try_from(state % below).unwrap_or(0)
    };
    println!("| history | tokens | µs per lookup |");
    println!("|---|---:|---:|");
    for len in [512, 4096] {
        // Random tokens of a 262,144-token vocabulary and a `last` outside it: no match.
        let history: Vec<Token> = (0..len).map(|_| next(262_144)).collect();
        let us = time(&history, 262_144);
        println!("| no match (262,144-token vocabulary) | {len} | {us:.2} |");
        // 50 distinct tokens, and a `last` outside them: no match.
        let history: Vec<Token> = (0..len).map(|_| next(50)).collect();
        let us = time(&history, 50);
        println!("| no match, `last` absent (50-token vocabulary) | {len} | {us:.2} |");
        // A `last` among them: it occurs every 50 tokens or so, the pair before it seldom.
        let us = time(&history, 7);
        println!("| 50-token vocabulary, `last` common | {len} | {us:.2} |");
        // A text repeating every 100 tokens: the 3-gram matches 100 tokens back.
        let period: Vec<Token> = (0..100).map(|_| next(262_144)).collect();
        let history: Vec<Token> = (0..len).map(|i| period[i % 100]).collect();
        let us = time(&history, period[len % 100]);
        println!("| a text repeating every 100 tokens | {len} | {us:.2} |");
    }
}
