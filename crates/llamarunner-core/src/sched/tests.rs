//! The loop against the fake backend.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::Receiver;

use super::Scheduler;
use crate::backend::fake::{FakeBackend, FakeConfig, BOS};
use crate::backend::BatchToken;
use crate::protocol::params::SamplingParams;
use crate::protocol::{
    Completion, DoneReason, EngineErrorKind, EngineHandle, EngineObserver, Event, LoraScales,
    NoObserver, Request, Token,
};

struct Harness {
    handle: EngineHandle,
    thread: Option<JoinHandle<()>>,
    log: Arc<Mutex<Vec<Vec<BatchToken>>>>,
    embed_log: Arc<Mutex<Vec<usize>>>,
    /// (src, dst, len) of every prefix the backend forked.
    forks: Arc<Mutex<Vec<(i32, i32, usize)>>>,
    /// The LoRA scale set of every decoded batch (parallel to `log`).
    lora_log: Arc<Mutex<Vec<LoraScales>>>,
    /// (seq, position, positions) of every image decoded.
    image_log: Arc<Mutex<Vec<(i32, usize, usize)>>>,
    /// Every batch the draft model decoded.
    draft_log: Arc<Mutex<Vec<Vec<BatchToken>>>>,
}

impl Harness {
    fn new(config: FakeConfig, slots: usize) -> Self {
        Self::with_queue(config, slots, 64)
    }

    fn with_queue(config: FakeConfig, slots: usize, max_queue: usize) -> Self {
        Self::with_scheduler(config, slots, max_queue, |s| s)
    }

    fn with_scheduler(
        config: FakeConfig,
        slots: usize,
        max_queue: usize,
        setup: impl FnOnce(Scheduler<FakeBackend>) -> Scheduler<FakeBackend> + Send + 'static,
    ) -> Self {
        Self::observed(config, slots, max_queue, Arc::new(NoObserver), setup)
    }

    /// A harness whose engine starts only when the returned sender is used (or dropped), so that
    /// requests submitted before then are all waiting at its first step, however the threads are
    /// scheduled (a test that needs every slot busy at once cannot rely on submitting fast).
    fn held(config: FakeConfig, slots: usize) -> (Self, std::sync::mpsc::Sender<()>) {
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let h = Self::with_scheduler(config, slots, 64, move |s| {
            // An error means the sender was dropped: start as well.
            let _ = wait.recv();
            s
        });
        (h, go)
    }

    /// A harness whose engine reports to `observer`.
    fn observed(
        config: FakeConfig,
        slots: usize,
        max_queue: usize,
        observer: Arc<dyn EngineObserver>,
        setup: impl FnOnce(Scheduler<FakeBackend>) -> Scheduler<FakeBackend> + Send + 'static,
    ) -> Self {
        let (handle, inbox) = EngineHandle::with_observer(max_queue, observer);
        let backend = FakeBackend::new(config);
        let log = backend.log.clone();
        let embed_log = backend.embed_log.clone();
        let forks = backend.forks.clone();
        let lora_log = backend.lora_log.clone();
        let image_log = backend.image_log.clone();
        let draft_log = backend.draft_log.clone();
        let thread = std::thread::spawn(move || {
            let (observer, queue) = (inbox.observer.clone(), inbox.queue.clone());
            let sched = setup(Scheduler::new(backend, slots, observer, queue));
            crate::engine::Engine::new(sched, inbox).run();
        });
        Self {
            handle,
            thread: Some(thread),
            log,
            embed_log,
            forks,
            lora_log,
            image_log,
            draft_log,
        }
    }

    fn submit(&self, prompt: &str, params: SamplingParams) -> Receiver<Event> {
        self.try_submit(prompt, params, None)
            .expect("queue has room")
    }

    fn try_submit(
        &self,
        prompt: &str,
        params: SamplingParams,
        deadline: Option<Instant>,
    ) -> Result<Receiver<Event>, crate::protocol::SubmitError> {
        let (tx, rx) = crate::protocol::EventSink::channel();
        self.submit_to(tx, prompt, params, deadline)?;
        Ok(rx)
    }

    /// Submits a request whose events go to `events`.
    fn submit_to(
        &self,
        events: crate::protocol::EventSink,
        prompt: &str,
        params: SamplingParams,
        deadline: Option<Instant>,
    ) -> Result<(), crate::protocol::SubmitError> {
        self.handle.submit(Request {
            id: format!("test-{prompt}"),
            prompt: prompt.into(),
            params,
            truncated: false,
            events,
            received: Instant::now(),
            deadline,
            images: Vec::new(),
        })
    }

    /// Waits until the slot table shows every slot free; returns it.
    fn settled(&self) -> Vec<crate::protocol::SlotInfo> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let table = self.handle.health.slot_table();
            if !table.is_empty() && table.iter().all(|s| !s.busy) {
                return table;
            }
            assert!(Instant::now() < deadline, "slots never settled: {table:?}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.handle.shutdown();
        if let Some(t) = self.thread.take() {
            t.join().expect("engine thread must not panic");
        }
    }
}

/// Reads a sequence to its end: (text, final stats).
fn collect(rx: &mut Receiver<Event>) -> (String, Completion) {
    let mut text = String::new();
    assert!(matches!(rx.blocking_recv(), Some(Event::Started { .. })));
    loop {
        match rx
            .blocking_recv()
            .expect("engine ended the stream without Done")
        {
            Event::Text { text: t, .. } => text.push_str(&t),
            Event::Done(c) => return (text, c),
            other => panic!("unexpected event {other:?}"),
        }
    }
}

fn greedy(n: i64) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        num_predict: n,
        ..SamplingParams::default()
    }
}

/// What the fake generates greedily for `prompt`, computed without the scheduler.
fn expected(prompt: &str, n: usize) -> String {
    let mut history: Vec<Token> = vec![BOS];
    history.extend(prompt.bytes().map(Token::from));
    let mut out = String::new();
    for _ in 0..n {
        let t = FakeBackend::next_token(&history, 0);
        out.push(char::from(u8::try_from(t).unwrap()));
        history.push(t);
    }
    out
}

#[test]
fn num_predict_gives_exactly_n_tokens() {
    let h = Harness::new(FakeConfig::default(), 1);
    for n in [1usize, 2, 7, 40] {
        let (text, done) = collect(&mut h.submit("hello", greedy(n as i64)));
        assert_eq!(done.eval_count, n);
        assert_eq!(done.done_reason, DoneReason::Length);
        assert_eq!(text, expected("hello", n));
        assert_eq!(done.prompt_eval_count, 6);
    }
}

#[test]
fn eog_ends_with_stop_and_is_not_emitted() {
    let h = Harness::new(
        FakeConfig {
            eos_at: Some(10),
            ..FakeConfig::default()
        },
        1,
    );
    // prompt = BOS + 5 bytes = 6 tokens; tokens 7..=10 of history are generated, the 5th is EOS.
    let (text, done) = collect(&mut h.submit("hello", greedy(-1)));
    assert_eq!(done.done_reason, DoneReason::Stop);
    assert_eq!(done.eval_count, 5);
    assert_eq!(text, expected("hello", 4));
}

#[test]
fn ignore_eos_keeps_generating() {
    let h = Harness::new(
        FakeConfig {
            eos_at: Some(10),
            ..FakeConfig::default()
        },
        1,
    );
    let params = SamplingParams {
        ignore_eos: true,
        ..greedy(12)
    };
    let (_, done) = collect(&mut h.submit("hello", params));
    assert_eq!(done.eval_count, 12);
    assert_eq!(done.done_reason, DoneReason::Length);
}

#[test]
fn stop_strings_end_the_sequence() {
    let h = Harness::new(FakeConfig::default(), 1);
    let full = expected("stop test", 30);
    let stop = full[10..13].to_string();
    let cut = full.find(&stop).unwrap();
    let params = SamplingParams {
        stop: vec![stop],
        ..greedy(30)
    };
    let (text, done) = collect(&mut h.submit("stop test", params));
    assert_eq!(done.done_reason, DoneReason::Stop);
    assert_eq!(text, full[..cut]);
}

#[test]
fn parallel_sequences_each_match_their_sequential_output() {
    let h = Harness::new(
        FakeConfig {
            batch_capacity: 16,
            ..FakeConfig::default()
        },
        4,
    );
    let prompts: Vec<String> = (0..10)
        .map(|i| format!("prompt number {i} {}", "x".repeat(i * 7)))
        .collect();
    let limits: Vec<usize> = (0..10).map(|i| 5 + i * 3).collect();
    let mut rxs: Vec<_> = prompts
        .iter()
        .zip(&limits)
        .map(|(p, &n)| h.submit(p, greedy(n as i64)))
        .collect();
    for ((p, &n), rx) in prompts.iter().zip(&limits).zip(&mut rxs) {
        let (text, done) = collect(rx);
        assert_eq!(done.eval_count, n, "{p}");
        assert_eq!(text, expected(p, n), "{p}");
    }
    // Never more than the batch capacity per decode, never two slots with one seq id twice per
    // position (the fake asserts positions).
    for batch in h.log.lock().unwrap().iter() {
        assert!(batch.len() <= 16);
    }
}

#[test]
fn long_prompt_does_not_stall_generating_sequences() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 4096,
            batch_capacity: 64,
            decode_delay: std::time::Duration::from_micros(200),
            ..FakeConfig::default()
        },
        4,
    );
    let mut gens: Vec<_> = (0..3)
        .map(|i| h.submit(&format!("g{i}"), greedy(-1)))
        .collect();
    // Let the three start generating.
    for rx in &mut gens {
        assert!(matches!(rx.blocking_recv(), Some(Event::Started { .. })));
        assert!(matches!(rx.blocking_recv(), Some(Event::Text { .. })));
    }
    let long = "y".repeat(2000);
    let mut big = h.submit(&long, greedy(1));
    let (_, done) = collect(&mut big);
    assert_eq!(done.prompt_eval_count, 2001);
    drop(gens);
    // Every decode that carried prompt chunks of the long sequence also carried a token of each
    // sequence that was generating at that time: no step was spent on the prompt alone while
    // others waited.
    let log = h.log.lock().unwrap();
    let long_seq = log
        .iter()
        .flat_map(|b| b.iter())
        .find(|t| t.pos > 1500)
        .map(|t| t.seq)
        .unwrap();
    let mut chunked_steps = 0;
    for batch in log.iter() {
        let long_tokens = batch.iter().filter(|t| t.seq == long_seq).count();
        if long_tokens > 1 {
            chunked_steps += 1;
            let others = batch.iter().filter(|t| t.seq != long_seq).count();
            assert!(
                others >= 1,
                "a prompt chunk stalled the generating sequences"
            );
            assert!(batch.len() <= 64);
        }
    }
    assert!(chunked_steps >= 2000 / 64, "the long prompt was chunked");
}

#[test]
fn cancelled_request_frees_its_slot() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 100_000,
            decode_delay: std::time::Duration::from_millis(1),
            ..FakeConfig::default()
        },
        1,
    );
    let mut rx = h.submit("endless", greedy(-1));
    assert!(matches!(rx.blocking_recv(), Some(Event::Started { .. })));
    assert!(matches!(rx.blocking_recv(), Some(Event::Text { .. })));
    drop(rx);
    // With one slot, this can only run once the first one is gone.
    let (_, done) = collect(&mut h.submit("next", greedy(3)));
    assert_eq!(done.eval_count, 3);
}

#[test]
fn queued_requests_wait_for_a_slot_in_order() {
    let h = Harness::new(FakeConfig::default(), 1);
    let mut rxs: Vec<_> = (0..5)
        .map(|i| h.submit(&format!("q{i}"), greedy(4)))
        .collect();
    for (i, rx) in rxs.iter_mut().enumerate() {
        let (text, _) = collect(rx);
        assert_eq!(text, expected(&format!("q{i}"), 4));
    }
}

#[test]
fn shutdown_fails_running_and_waiting_requests() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 100_000,
            decode_delay: std::time::Duration::from_millis(1),
            ..FakeConfig::default()
        },
        1,
    );
    let mut running = h.submit("a", greedy(-1));
    let mut waiting = h.submit("b", greedy(-1));
    assert!(matches!(
        running.blocking_recv(),
        Some(Event::Started { .. })
    ));
    h.handle.shutdown();
    let last = |rx: &mut Receiver<Event>| {
        let mut last = None;
        while let Some(ev) = rx.blocking_recv() {
            last = Some(ev);
        }
        last
    };
    for rx in [&mut running, &mut waiting] {
        match last(rx) {
            Some(Event::Error(e)) => assert_eq!(e.kind, EngineErrorKind::ShuttingDown),
            other => panic!("expected a shutdown error, got {other:?}"),
        }
    }
}

/// Random arrivals, limits and cancellations over thousands of steps: every request ends
/// (Done, or dropped by its client), nothing panics, and every slot is free at the end.
#[test]
fn random_cancellations_never_leak_a_slot() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 512,
            batch_capacity: 24,
            eos_at: Some(300),
            ..FakeConfig::default()
        },
        3,
    );
    let mut next = xorshift(0x2545_f491_4f6c_dd1d);
    let mut live: Vec<Receiver<Event>> = Vec::new();
    let mut finished = 0;
    for round in 0..2000 {
        if next(3) == 0 || live.is_empty() {
            let len = next(200) as usize + 1;
            let limit = next(60) as i64 - 1; // -1..=58
            live.push(h.submit(&"p".repeat(len), greedy(limit)));
        }
        // Cancel a random live request now and then, at whatever step it is in.
        if !live.is_empty() && next(4) == 0 {
            let i = next(live.len() as u64) as usize;
            drop(live.swap_remove(i));
        }
        // Drain what is ready.
        live.retain_mut(|rx| loop {
            match rx.try_recv() {
                Ok(Event::Done(_)) => {
                    finished += 1;
                    return false;
                }
                Ok(Event::Error(e)) => panic!("round {round}: {e}"),
                Ok(_) => continue,
                Err(_) => return true,
            }
        });
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
    for mut rx in live {
        while let Some(ev) = rx.blocking_recv() {
            if matches!(ev, Event::Done(_)) {
                finished += 1;
            }
        }
    }
    assert!(finished > 50, "only {finished} finished");
    let deadline = Instant::now() + std::time::Duration::from_secs(5);
    while h.handle.health.slots().0 != 0 {
        assert!(Instant::now() < deadline, "a slot stayed busy");
        std::thread::yield_now();
    }
}

/// A seeded xorshift generator: each call gives a number below `n`.
fn xorshift(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut rng = seed;
    move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    }
}

fn params_with(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = greedy(-1);
    f(&mut p);
    p
}

#[test]
fn slot_table_is_published() {
    let h = Harness::new(FakeConfig::default(), 2);
    let (_, _) = collect(&mut h.submit("table", greedy(4)));
    let deadline = Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let table = h.handle.health.slot_table();
        // The table is published after each step, a moment after the final event is sent.
        let settled = table.iter().all(|s| !s.busy);
        if table.len() == 2 && settled && table.iter().any(|s| s.cached_tokens > 0) {
            let used = table.iter().find(|s| s.cached_tokens > 0).unwrap();
            assert_eq!(used.cached_tokens, 6 + 3); // BOS + "table" + 3 of the 4 generated
            assert!(used.last_used_ms > 0);
            break;
        }
        assert!(Instant::now() < deadline);
        std::thread::yield_now();
    }
}

fn embed(
    h: &Harness,
    content: &str,
    truncate: bool,
) -> Result<crate::protocol::Embedding, crate::protocol::EngineError> {
    let (reply, rx) = tokio::sync::oneshot::channel();
    h.handle
        .submit_embed(crate::protocol::EmbedRequest {
            content: content.into(),
            truncate,
            reply,
        })
        .expect("queue has room");
    rx.blocking_recv().expect("engine answered")
}

#[test]
fn a_no_kv_slot_decode_error_fails_that_batch_and_the_engine_keeps_serving() {
    let h = Harness::new(
        FakeConfig {
            fail_decode: Some(3),
            ..FakeConfig::default()
        },
        1,
    );
    let mut rx = h.submit("doomed", greedy(10));
    assert!(matches!(rx.blocking_recv(), Some(Event::Started { .. })));
    let last = std::iter::from_fn(|| rx.blocking_recv()).last();
    match last {
        Some(Event::Error(e)) => {
            assert_eq!(e.kind, EngineErrorKind::Internal);
            assert!(e.message.contains("no KV cache slot"), "{}", e.message);
        }
        other => panic!("expected an error, got {other:?}"),
    }
    let (text, done) = collect(&mut h.submit("next", greedy(4)));
    assert_eq!(done.eval_count, 4);
    assert_eq!(text, expected("next", 4));
}

/// Reads a sequence to its end, keeping each text chunk with its log-probability entries.
fn collect_logprobs(rx: &mut Receiver<Event>) -> Vec<(String, Vec<crate::protocol::TokenLogprob>)> {
    let mut chunks = Vec::new();
    assert!(matches!(rx.blocking_recv(), Some(Event::Started { .. })));
    loop {
        match rx.blocking_recv().expect("stream ended without Done") {
            Event::Text { text, logprobs } => chunks.push((text, logprobs)),
            Event::Done(_) => return chunks,
            other => panic!("unexpected event {other:?}"),
        }
    }
}

#[test]
fn logprobs_travel_with_their_text_and_stop_strings_drop_theirs() {
    let h = Harness::new(FakeConfig::default(), 1);
    let full = expected("hello", 20);
    let params = SamplingParams {
        logprobs: Some(3),
        ..greedy(20)
    };
    // Every chunk carries one entry per byte-token of its text, with the alternatives asked.
    for (text, entries) in collect_logprobs(&mut h.submit("hello", params.clone())) {
        let bytes: Vec<u8> = entries
            .iter()
            .flat_map(|e| e.sampled.bytes.clone())
            .collect();
        assert_eq!(bytes, text.as_bytes());
        assert!(entries.iter().all(|e| e.top.len() == 3));
    }
    // A stop string in the middle: the held-back tokens of its first characters are not
    // reported, and what is reported spells exactly the returned text.
    let stop = full[8..11].to_string();
    let cut = full.find(&stop).unwrap();
    let chunks = collect_logprobs(&mut h.submit(
        "hello",
        SamplingParams {
            stop: vec![stop],
            ..params
        },
    ));
    let text: String = chunks.iter().map(|(t, _)| t.as_str()).collect();
    assert_eq!(text, full[..cut]);
    let reported: Vec<u8> = chunks
        .iter()
        .flat_map(|(_, e)| e.iter().flat_map(|e| e.sampled.bytes.clone()))
        .collect();
    assert_eq!(reported, &full.as_bytes()[..cut]);
}

/// Waits for an event, failing instead of hanging.
fn recv_within(rx: &mut Receiver<Event>, limit: Duration) -> Event {
    let deadline = Instant::now() + limit;
    loop {
        match rx.try_recv() {
            Ok(e) => return e,
            Err(tokio::sync::mpsc::error::TryRecvError::Empty) => {
                assert!(Instant::now() < deadline, "no event within {limit:?}");
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => panic!("stream ended: {e}"),
        }
    }
}

#[test]
fn cancelled_queued_requests_give_their_places_back_at_once() {
    let slow = FakeConfig {
        decode_delay: Duration::from_millis(2),
        ..FakeConfig::default()
    };
    let h = Harness::with_queue(slow, 1, 2);
    let mut running = h.submit("busy", greedy(-1));
    assert_eq!(
        recv_within(&mut running, Duration::from_secs(5)),
        Event::Started { cached: 0 }
    );
    let a = h.submit("a", greedy(1));
    let b = h.submit("b", greedy(1));
    assert_eq!(
        h.try_submit("c", greedy(1), None).unwrap_err(),
        crate::protocol::SubmitError::QueueFull
    );
    drop((a, b));
    // The engine drains the queue every step: both places come back while the slot is busy.
    let deadline = Instant::now() + Duration::from_secs(5);
    while h.handle.queue.waiting() > 0 {
        assert!(
            Instant::now() < deadline,
            "cancelled requests kept their places"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let c = h.submit("c", greedy(1));
    let d = h.submit("d", greedy(1));
    drop(running);
    for mut rx in [c, d] {
        let (_, done) = collect(&mut rx);
        assert_eq!(done.eval_count, 1);
    }
}

/// A grammar that takes exactly `text`, compiled against the fake's vocabulary.
fn exact_grammar(text: &str) -> crate::constrain::Grammar {
    use crate::protocol::TextModel;
    let compiler = crate::constrain::Compiler::new(|| crate::backend::fake::FakeText.vocabulary());
    let mut grammar = crate::constrain::Grammar::new(crate::constrain::GrammarSource::Gbnf(
        format!("root ::= {text:?}"),
    ));
    compiler.compile_into(&mut grammar).expect("compiles");
    grammar
}

#[test]
fn a_grammar_that_is_done_ends_an_endless_generation_with_stop() {
    let h = Harness::new(FakeConfig::default(), 2);
    // num_predict -1 and no EOS in the fake's own output: only the grammar can end it.
    let params = SamplingParams {
        grammar: Some(exact_grammar("hello")),
        ..greedy(-1)
    };
    let (text, done) = collect(&mut h.submit("some prompt", params));
    assert_eq!(text, "hello");
    assert_eq!(done.done_reason, DoneReason::Stop);
    assert_eq!(done.eval_count, 5, "one token per byte, then the end");
    // The same prompt without the grammar runs to its cap: the grammar's end did it.
    let (free, done) = collect(&mut h.submit("some prompt", greedy(12)));
    assert_eq!(done.done_reason, DoneReason::Length);
    assert_ne!(free, "hello");
}

#[test]
fn the_time_limit_ends_running_requests_and_refuses_queued_ones() {
    let slow = FakeConfig {
        decode_delay: Duration::from_millis(2),
        ..FakeConfig::default()
    };
    let h = Harness::new(slow, 1);
    let limit = Instant::now() + Duration::from_millis(100);
    let mut running = h.try_submit("busy", greedy(-1), Some(limit)).unwrap();
    let mut queued = h.try_submit("next", greedy(1), Some(limit)).unwrap();
    let (text, done) = collect(&mut running);
    assert_eq!(done.done_reason, DoneReason::Timeout);
    assert!(!text.is_empty() && Instant::now() >= limit);
    match recv_within(&mut queued, Duration::from_secs(5)) {
        Event::Error(e) => assert_eq!(e.kind, EngineErrorKind::Timeout),
        // Admitted in the same step the running one ended: it then ends by the limit at once.
        Event::Started { .. } => {
            let mut text = String::new();
            loop {
                match recv_within(&mut queued, Duration::from_secs(5)) {
                    Event::Done(c) => {
                        assert_eq!(c.done_reason, DoneReason::Timeout, "{text}");
                        break;
                    }
                    Event::Text { text: t, .. } => text.push_str(&t),
                    other => panic!("{other:?}"),
                }
            }
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(h.handle.queue.waiting(), 0);
    h.settled();
}

#[test]
fn with_fewer_batch_places_than_sequences_none_starves() {
    let (h, go) = Harness::held(
        FakeConfig {
            batch_capacity: 2,
            ..FakeConfig::default()
        },
        4,
    );
    let rxs: Vec<_> = (0..4)
        .map(|i| h.submit(&format!("s{i}"), greedy(12)))
        .collect();
    go.send(()).expect("engine thread waits");
    for (i, mut rx) in rxs.into_iter().enumerate() {
        let (text, done) = collect(&mut rx);
        assert_eq!(done.eval_count, 12, "slot {i}");
        assert_eq!(text, expected(&format!("s{i}"), 12), "slot {i}");
    }
    // Places rotated between the four: they finished together, not two after the other two.
    let log = h.log.lock().unwrap();
    assert!(log.iter().all(|b| b.len() <= 2));
    let last: Vec<usize> = (0..4)
        .map(|seq| {
            log.iter()
                .rposition(|b| b.iter().any(|t| t.seq == seq))
                .unwrap()
        })
        .collect();
    let spread = last.iter().max().unwrap() - last.iter().min().unwrap();
    assert!(spread <= 4, "last batches per slot {last:?}");
}

#[test]
fn batches_list_their_sequences_in_slot_order_whatever_the_rotation() {
    // llama.cpp (one KV stream per sequence) puts into one micro-batch only sequences whose ids
    // follow each other in batch order; the rotation of places must not reorder the batch.
    let (h, go) = Harness::held(
        FakeConfig {
            batch_capacity: 3,
            ..FakeConfig::default()
        },
        4,
    );
    let rxs: Vec<_> = (0..4)
        .map(|i| h.submit(&format!("p{i}"), greedy(9)))
        .collect();
    go.send(()).expect("engine thread waits");
    for (i, mut rx) in rxs.into_iter().enumerate() {
        let (text, done) = collect(&mut rx);
        assert_eq!(done.eval_count, 9, "slot {i}");
        assert_eq!(text, expected(&format!("p{i}"), 9), "slot {i}");
    }
    let log = h.log.lock().unwrap();
    // Places did rotate (3 places, 4 sequences): some batch holds slot 3 and slot 0 together.
    assert!(log
        .iter()
        .any(|b| b.iter().any(|t| t.seq == 3) && b.iter().any(|t| t.seq == 0)));
    for b in log.iter() {
        let seqs: Vec<i32> = b.iter().map(|t| t.seq).collect();
        assert!(
            seqs.windows(2).all(|w| w[0] <= w[1]),
            "batch order {seqs:?}"
        );
    }
}

// --- slot save / restore / erase (`POST /slots/{id}`) -------------------------------------

impl Harness {
    /// Runs a slot operation on the engine and waits for its answer.
    fn slot(
        &self,
        slot: usize,
        action: crate::protocol::SlotAction,
    ) -> Result<crate::protocol::SlotOutcome, crate::protocol::EngineError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.handle
            .submit_slot(crate::protocol::SlotCommand {
                slot,
                action,
                reply,
            })
            .expect("the engine takes slot commands");
        answer.blocking_recv().expect("the engine answers")
    }

    /// The slot table once every slot is free, and the entry of slot `id`.
    fn settled_slot(&self, id: i32) -> crate::protocol::SlotInfo {
        self.settled()
            .into_iter()
            .find(|s| s.id == id)
            .expect("the slot is in the table")
    }
}

mod backpressure;
mod checkpoints;
mod context;
mod draft;
mod embeddings;
mod images;
mod lora;
mod observer;
mod pool_text;
mod prefix_reuse;
mod prompt_cache;
mod shared_cache;
mod slot_files;
mod speculative;
mod step_outcome;
mod whole_text;
