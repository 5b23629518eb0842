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
        let thread = std::thread::spawn(move || setup(Scheduler::new(backend, inbox, slots)).run());
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
        let (tx, rx) = tokio::sync::mpsc::channel(crate::protocol::EVENT_CHANNEL_CAPACITY);
        self.handle.submit(Request {
            id: format!("test-{prompt}"),
            prompt: prompt.into(),
            params,
            truncated: false,
            events: tx,
            received: Instant::now(),
            deadline,
            images: Vec::new(),
        })?;
        Ok(rx)
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
    assert_eq!(rx.blocking_recv(), Some(Event::Started));
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
fn a_full_slot_ends_with_length() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 20,
            ..FakeConfig::default()
        },
        1,
    );
    let params = params_with(|p| p.shift = false);
    let (text, done) = collect(&mut h.submit("hello", params));
    assert_eq!(done.done_reason, DoneReason::Length);
    // 6 prompt tokens + 14 decoded generated tokens fill 20 cells; the 15th is sampled last.
    assert_eq!(done.eval_count, 15);
    assert_eq!(text.len(), 15);
}

#[test]
fn too_long_prompt_is_a_context_length_error_and_the_slot_survives() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 8,
            ..FakeConfig::default()
        },
        1,
    );
    let params = params_with(|p| p.truncate = false);
    let mut rx = h.submit("much too long", params);
    match rx.blocking_recv() {
        Some(Event::Error(e)) => {
            assert_eq!(e.kind, EngineErrorKind::ContextLength);
            assert!(
                e.message.contains("exceeds the context length"),
                "{}",
                e.message
            );
        }
        other => panic!("expected an error, got {other:?}"),
    }
    let (_, done) = collect(&mut h.submit("ok", greedy(3)));
    assert_eq!(done.eval_count, 3);
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
        assert_eq!(rx.blocking_recv(), Some(Event::Started));
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
fn second_identical_prompt_reuses_the_cache() {
    let h = Harness::new(FakeConfig::default(), 1);
    let (a, first) = collect(&mut h.submit("the same prompt", greedy(5)));
    assert_eq!(first.prompt_cached_count, 0);
    let (b, second) = collect(&mut h.submit("the same prompt", greedy(5)));
    assert_eq!(a, b);
    // All but one prompt token come from the cache.
    assert_eq!(second.prompt_cached_count, second.prompt_eval_count - 1);
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
    assert_eq!(rx.blocking_recv(), Some(Event::Started));
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
    assert_eq!(running.blocking_recv(), Some(Event::Started));
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

#[test]
fn after_a_stop_the_cache_holds_only_the_returned_text() {
    let h = Harness::new(FakeConfig::default(), 1);
    let full = expected("cache trim", 30);
    let stop = full[10..12].to_string();
    let cut = full.find(&stop).unwrap();
    let params = SamplingParams {
        stop: vec![stop],
        ..greedy(30)
    };
    let (text, done) = collect(&mut h.submit("cache trim", params));
    assert_eq!(text, full[..cut]);
    assert_eq!(done.done_reason, DoneReason::Stop);
    // The follow-up prompt is the old prompt + exactly the returned text: all of it is cached
    // but the one token that is always decoded again.
    let follow = format!("cache trim{text}");
    let (_, second) = collect(&mut h.submit(&follow, greedy(1)));
    assert_eq!(second.prompt_cached_count, second.prompt_eval_count - 1);
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
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
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

fn params_with(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = greedy(-1);
    f(&mut p);
    p
}

#[test]
fn long_prompt_is_truncated_keeping_num_keep_and_the_tail() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 64,
            ..FakeConfig::default()
        },
        1,
    );
    let prompt: String = (0..100)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    let params = params_with(|p| {
        p.num_keep = 4;
        p.num_predict = 3;
    });
    let (_, done) = collect(&mut h.submit(&prompt, params));
    assert!(done.truncated);
    assert!(done.prompt_eval_count < 64);
    assert_eq!(done.eval_count, 3);
    // The fake's KV holds BOS + the first 4 bytes, then a contiguous tail of the prompt.
    let log = h.log.lock().unwrap();
    let decoded: Vec<Token> = log.iter().flatten().map(|t| t.token).collect();
    assert_eq!(&decoded[..5], &[BOS, 97, 98, 99, 100]);
    assert_eq!(
        decoded[done.prompt_eval_count - 1],
        Token::from(prompt.as_bytes()[99])
    );
}

#[test]
fn long_prompt_without_truncate_is_rejected() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 16,
            ..FakeConfig::default()
        },
        1,
    );
    let params = params_with(|p| p.truncate = false);
    match h.submit(&"x".repeat(40), params).blocking_recv() {
        Some(Event::Error(e)) => assert_eq!(e.kind, EngineErrorKind::ContextLength),
        other => panic!("{other:?}"),
    }
}

#[test]
fn full_slot_shifts_and_keeps_generating() {
    for can_shift in [true, false] {
        let h = Harness::new(
            FakeConfig {
                slot_ctx: 32,
                can_shift,
                ..FakeConfig::default()
            },
            1,
        );
        let params = params_with(|p| {
            p.num_predict = 200;
            p.num_keep = 2;
        });
        let (text, done) = collect(&mut h.submit("shifty", params));
        assert_eq!(done.eval_count, 200, "can_shift={can_shift}");
        assert_eq!(done.done_reason, DoneReason::Length);
        assert_eq!(text.len(), 200);
        // The kept prefix (BOS + "sh") stays at the start of the slot whatever happened.
        let log = h.log.lock().unwrap();
        let first = &log[0];
        assert_eq!(first[0].token, BOS);
        for batch in log.iter() {
            assert!(batch.iter().all(|t| (t.pos as usize) < 32));
        }
    }
}

#[test]
fn full_slot_without_shift_ends_with_length() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 32,
            ..FakeConfig::default()
        },
        1,
    );
    let params = params_with(|p| {
        p.shift = false;
        p.num_predict = 200;
    });
    let (_, done) = collect(&mut h.submit("shifty", params));
    assert_eq!(done.done_reason, DoneReason::Length);
    assert_eq!(done.prompt_eval_count + done.eval_count, 33);
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

#[test]
fn unlimited_generation_stops_at_ten_contexts() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 16,
            ..FakeConfig::default()
        },
        1,
    );
    let (_, done) = collect(&mut h.submit("loop", greedy(-1)));
    assert_eq!(done.done_reason, DoneReason::Length);
    assert_eq!(done.eval_count, 160);
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
fn embeddings_share_the_loop_and_never_crash_on_long_input() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 32,
            ..FakeConfig::default()
        },
        1,
    );
    // Beside a running completion.
    let mut running = h.submit("gen", params_with(|p| p.num_predict = 20));
    let e = embed(&h, "hello", false).unwrap();
    assert_eq!(e.prompt_eval_count, 6);
    assert_eq!(e.vector.len(), 8);
    assert_eq!(embed(&h, "hello", false).unwrap(), e, "deterministic");
    let (_, done) = collect(&mut running);
    assert_eq!(done.eval_count, 20);
    // Too long: an error, or truncated when asked.
    let long = "x".repeat(100);
    let err = embed(&h, &long, false).unwrap_err();
    assert_eq!(err.kind, EngineErrorKind::ContextLength);
    let cut = embed(&h, &long, true).unwrap();
    assert!(cut.truncated);
    assert_eq!(cut.prompt_eval_count, 32);
}

#[test]
fn multiuser_cache_forks_a_shared_prefix_into_another_slot() {
    let h = Harness::with_scheduler(
        FakeConfig {
            decode_delay: std::time::Duration::from_micros(300),
            ..FakeConfig::default()
        },
        2,
        64,
        |s| s.with_multiuser_cache(true),
    );
    let forks = h.forks.clone();
    let system = "You are a helpful assistant. Answer briefly. ";
    // User A fills slot 0 with the system prompt and keeps generating (busy).
    let mut a = h.submit(&format!("{system}user A"), greedy(-1));
    assert_eq!(a.blocking_recv(), Some(Event::Started));
    assert!(matches!(a.blocking_recv(), Some(Event::Text { .. })));
    // User B: the shared prefix is forked from A's busy slot into slot 1.
    let (text, done) = collect(&mut h.submit(&format!("{system}user B"), greedy(5)));
    let shared = 1 + system.len() + "user ".len();
    assert_eq!(done.prompt_cached_count, shared);
    assert_eq!(
        text,
        expected(&format!("{system}user B"), 5),
        "forked KV is exact"
    );
    assert_eq!(forks.lock().unwrap().as_slice(), &[(0, 1, shared)]);
    drop(a);
}

#[test]
fn without_partial_removal_the_slot_is_cleared_and_the_prompt_decoded_again() {
    let h = Harness::new(
        FakeConfig {
            partial_remove: false,
            ..FakeConfig::default()
        },
        1,
    );
    let (a, _) = collect(&mut h.submit("recurrent model", greedy(5)));
    let (b, second) = collect(&mut h.submit("recurrent model", greedy(5)));
    assert_eq!(a, b);
    assert_eq!(second.prompt_cached_count, 0);
}

#[test]
fn a_cut_past_a_sliding_window_decodes_the_prompt_again_and_a_continuation_reuses_it() {
    let h = Harness::new(
        FakeConfig {
            window: Some(4),
            ..FakeConfig::default()
        },
        1,
    );
    let (answer, first) = collect(&mut h.submit("window test", greedy(20)));
    assert_eq!(first.prompt_cached_count, 0);
    // Only the start is shared: cut back 20 tokens, the window before the cut is gone.
    let (text, cut) = collect(&mut h.submit("window other", greedy(6)));
    assert_eq!(
        cut.prompt_cached_count, 0,
        "a lost window must not be reused"
    );
    assert_eq!(text, expected("window other", 6));
    // A conversation that goes on from where the slot is keeps its cache.
    collect(&mut h.submit("window again", greedy(3)));
    let follow = format!("window again{}", expected("window again", 3));
    let (text, next) = collect(&mut h.submit(&follow, greedy(4)));
    assert_eq!(text, expected(&follow, 4));
    assert!(next.prompt_cached_count > "window again".len(), "{next:?}");
    drop(answer);
}

#[test]
fn a_fork_that_would_lose_a_sliding_window_decodes_the_prompt_in_full() {
    let h = Harness::with_scheduler(
        FakeConfig {
            window: Some(4),
            ..FakeConfig::default()
        },
        2,
        64,
        |s| s.with_multiuser_cache(true),
    );
    let forks = h.forks.clone();
    // Slot 0 holds "shared prefix, user A" and 30 generated tokens past it.
    let (_, a) = collect(&mut h.submit("shared prefix, user A", greedy(30)));
    assert_eq!(a.eval_count, 30);
    // User B shares only the prefix: forking it would cut 30+ tokens back past the window.
    let (text, b) = collect(&mut h.submit("shared prefix, user B", greedy(5)));
    assert_eq!(
        text,
        expected("shared prefix, user B", 5),
        "exact after the failed fork"
    );
    assert_eq!(b.prompt_cached_count, 0);
    assert!(forks.lock().unwrap().is_empty());
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
    assert_eq!(rx.blocking_recv(), Some(Event::Started));
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
    assert_eq!(rx.blocking_recv(), Some(Event::Started));
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
        Event::Started
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

#[test]
fn embeddings_never_wait_for_a_generation_slot() {
    let slow = FakeConfig {
        decode_delay: Duration::from_millis(2),
        ..FakeConfig::default()
    };
    let h = Harness::new(slow, 1);
    let mut running = h.submit("busy", greedy(-1));
    assert_eq!(
        recv_within(&mut running, Duration::from_secs(5)),
        Event::Started
    );
    // A queued completion too: the embedding must not wait behind it either.
    let mut queued = h.submit("waiting", greedy(1));
    // The running request never ends on its own (num_predict -1) and holds the only slot, so
    // an embedding that waited for a slot would never be answered (`embed` blocks).
    let e = embed(&h, "hello", false).unwrap();
    assert_eq!(e.prompt_eval_count, 6);
    // Answered while the generation was still running and the queued one still waiting.
    loop {
        match running.try_recv() {
            Ok(Event::Text { .. }) => {}
            Err(tokio::sync::mpsc::error::TryRecvError::Empty) => break,
            other => panic!("the running generation ended before the embedding: {other:?}"),
        }
    }
    assert!(
        matches!(
            queued.try_recv(),
            Err(tokio::sync::mpsc::error::TryRecvError::Empty)
        ),
        "the queued request got a slot before the embedding was answered"
    );
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
        Event::Started => {
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

#[test]
fn after_a_context_shift_a_stop_string_leaves_the_cache_at_the_returned_text() {
    // Generate past two shifts, then stop at a string found later in the output. The cache
    // must then hold one token more than a twin run that ended (by num_predict) right before
    // the stop string: the returned tokens, with the stop string's tokens trimmed.
    let config = FakeConfig {
        slot_ctx: 16,
        ..FakeConfig::default()
    };
    let keep2 = |n| {
        params_with(|p| {
            p.temperature = 0.0;
            p.num_predict = n;
            p.num_keep = 2;
        })
    };
    let h = Harness::new(config.clone(), 1);
    let (full, _) = collect(&mut h.submit("shift", keep2(40)));
    drop(h);
    let at = 30;
    let stop = full[at..at + 3].to_string();
    let cut = full.find(&stop).unwrap();
    assert!(
        cut > 20,
        "the stop string must come after a shift: {full} {stop}"
    );
    let h = Harness::new(config.clone(), 1);
    let params = SamplingParams {
        stop: vec![stop],
        ..keep2(40)
    };
    let (text, done) = collect(&mut h.submit("shift", params));
    assert_eq!(
        (text.as_str(), done.done_reason),
        (&full[..cut], DoneReason::Stop)
    );
    let with_stop = h.settled()[0].cached_tokens;
    drop(h);
    let twin = Harness::new(config, 1);
    let (_, d) = collect(&mut twin.submit("shift", keep2(i64::try_from(cut).unwrap())));
    assert_eq!(d.done_reason, DoneReason::Length);
    let without = twin.settled()[0].cached_tokens;
    assert_eq!(with_stop, without + 1);
}

#[test]
fn a_client_that_does_not_read_pauses_its_sequence_instead_of_growing_buffers() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 4096,
            ..FakeConfig::default()
        },
        1,
    );
    let n = 40_000usize;
    let mut rx = h.submit("unread", params_with(|p| p.num_predict = n as i64));
    // Nobody reads: the channel fills (64 events), then the outbox up to its cap, then the
    // sequence waits. Count its decode steps until they stop growing.
    let steps = || h.log.lock().unwrap().len();
    let mut last = steps();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let now = steps();
        if now == last {
            break;
        }
        last = now;
        assert!(Instant::now() < deadline, "the sequence never paused");
    }
    let bound = crate::protocol::EVENT_CHANNEL_CAPACITY + super::OUTBOX_CAP_BYTES + 8;
    assert!(
        last < bound,
        "{last} decode steps for an unread stream (bound {bound})"
    );
    // Reading resumes it, and nothing was lost.
    let mut text = String::new();
    assert_eq!(rx.blocking_recv(), Some(Event::Started));
    loop {
        match rx.blocking_recv().expect("stream ended without Done") {
            Event::Text { text: t, .. } => text.push_str(&t),
            Event::Done(c) => {
                assert_eq!(c.eval_count, n);
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(text.len(), n);
}

#[test]
fn a_client_that_never_reads_loses_its_slot_after_the_pause_limit() {
    let h = Harness::with_scheduler(
        FakeConfig {
            slot_ctx: 4096,
            ..FakeConfig::default()
        },
        1,
        8,
        |s| s.with_pause_limit(Duration::from_millis(200)),
    );
    let _unread = h.submit("unread", params_with(|p| p.num_predict = 40_000));
    // The stalled sequence gives its slot back: the next request is served.
    let mut next = h.submit("next", greedy(3));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match next.try_recv() {
            Ok(Event::Started) => break,
            Ok(other) => panic!("{other:?}"),
            Err(_) => {
                assert!(Instant::now() < deadline, "the unread stream kept the slot");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
    let mut text = String::new();
    loop {
        match next.blocking_recv().expect("Done") {
            Event::Text { text: t, .. } => text.push_str(&t),
            Event::Done(c) => {
                assert_eq!(c.eval_count, 3);
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(text, expected("next", 3));
}

#[test]
fn a_long_embedding_is_decoded_in_pieces_between_decode_steps() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 256,
            embed_piece: 8,
            decode_delay: Duration::from_millis(1),
            ..FakeConfig::default()
        },
        1,
    );
    let mut running = h.submit("gen", params_with(|p| p.num_predict = 400));
    assert_eq!(
        recv_within(&mut running, Duration::from_secs(5)),
        Event::Started
    );
    let steps_before = h.log.lock().unwrap().len();
    let long = "y".repeat(99); // BOS + 99 = 100 tokens: 13 pieces of at most 8
    let e = embed(&h, &long, false).unwrap();
    let steps_after = h.log.lock().unwrap().len();
    assert_eq!(e.prompt_eval_count, 100);
    let pieces = h.embed_log.lock().unwrap().clone();
    assert_eq!(pieces.iter().sum::<usize>(), 100);
    assert!(pieces.iter().all(|&n| n <= 8), "{pieces:?}");
    // The generation kept stepping while the embedding was decoded, a step per piece.
    assert!(
        steps_after - steps_before >= pieces.len() - 1,
        "{} decode steps during {} pieces",
        steps_after - steps_before,
        pieces.len()
    );
    // The same vector as an input decoded in one piece.
    let one = Harness::new(
        FakeConfig {
            slot_ctx: 256,
            embed_piece: 1000,
            ..FakeConfig::default()
        },
        1,
    );
    assert_eq!(embed(&one, &long, false).unwrap(), e);
    loop {
        match running.blocking_recv().expect("Done") {
            Event::Done(done) => {
                assert_eq!(done.eval_count, 400);
                break;
            }
            Event::Text { .. } => {}
            other => panic!("{other:?}"),
        }
    }
}

/// Records what the engine reports, in order.
#[derive(Debug, Default)]
struct Recorder(Mutex<Vec<String>>);

impl Recorder {
    fn push(&self, what: String) {
        self.0.lock().unwrap().push(what);
    }

    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

impl EngineObserver for Recorder {
    fn admitted(&self, queued: Duration, prompt: usize, cached: usize, truncated: bool) {
        assert!(queued < Duration::from_secs(60));
        self.push(format!("admitted {prompt} {cached} {truncated}"));
    }

    fn first_token(&self, _since_arrival: Duration) {
        self.push("first".into());
    }

    fn next_token(&self, _gap: Duration) {
        self.push("next".into());
    }

    fn context_shift(&self) {
        self.push("shift".into());
    }

    fn embedded(&self, tokens: usize) {
        self.push(format!("embedded {tokens}"));
    }
}

#[test]
fn the_observer_sees_admissions_tokens_shifts_truncations_and_embeddings() {
    let recorder = Arc::new(Recorder::default());
    let ctx = 32;
    let h = Harness::observed(
        FakeConfig {
            slot_ctx: ctx,
            ..FakeConfig::default()
        },
        1,
        64,
        recorder.clone(),
        |s| s,
    );
    // 5 tokens: admitted with its 4 prompt tokens (BOS + "abc"), a first token, 4 more.
    let (_, done) = collect(&mut h.submit("abc", greedy(5)));
    assert_eq!(done.eval_count, 5);
    assert!(done.queue_duration_ns <= done.prompt_eval_duration_ns + 60_000_000_000);
    let mut want = vec!["admitted 4 0 false".to_string(), "first".into()];
    want.extend(std::iter::repeat_n("next".to_string(), 4));
    assert_eq!(recorder.take(), want);

    // The same prompt again: all but its last token come from the cache.
    collect(&mut h.submit("abc", greedy(1)));
    assert_eq!(recorder.take(), ["admitted 4 3 false", "first"]);

    // A prompt longer than the slot is cut (the engine tokenizes this text itself).
    let long = "y".repeat(40);
    let (_, done) = collect(&mut h.submit(&long, greedy(1)));
    assert!(done.truncated);
    let events = recorder.take();
    assert_eq!(events.len(), 2, "{events:?}");
    assert!(events[0].ends_with(" true"), "{events:?}");

    // 100 tokens in a 32-token slot: as many shifts as the slot filled, each counted once.
    let params = params_with(|p| {
        p.num_predict = 100;
        p.num_keep = 0;
    });
    let (_, done) = collect(&mut h.submit("shift", params));
    assert_eq!(done.eval_count, 100);
    let keep = 1; // BOS
    let (mut cached, mut shifts) = (6, 0); // BOS + "shift"
    for generated in 1..=100 {
        if generated == 100 {
            break; // the last token ends the sequence before any shift
        }
        if cached >= ctx {
            cached -= crate::kv::shift_discard(ctx, keep, cached);
            shifts += 1;
        }
        cached += 1;
    }
    assert!(shifts >= 2);
    let events = recorder.take();
    assert_eq!(events.iter().filter(|e| *e == "shift").count(), shifts);
    assert_eq!(events.iter().filter(|e| *e == "next").count(), 99);

    // An embedding's tokens.
    let e = embed(&h, "hello", false).unwrap();
    assert_eq!(
        recorder.take(),
        [format!("embedded {}", e.prompt_eval_count)]
    );
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

use crate::protocol::{SlotAction, SlotOutcome, SlotPhase};

/// Saves slot `slot` and returns its tokens and state.
fn save(h: &Harness, slot: usize) -> (Vec<Token>, Vec<u8>) {
    match h.slot(slot, SlotAction::Save) {
        Ok(SlotOutcome::Saved { tokens, state, .. }) => (tokens, state),
        other => panic!("save failed: {other:?}"),
    }
}

#[test]
fn a_restored_slot_serves_the_same_prefix_from_its_cache_after_a_restart() {
    let prompt = "a long system prompt, then a question";
    let first = Harness::new(FakeConfig::default(), 2);
    let (text, done) = collect(&mut first.submit(prompt, greedy(6)));
    assert_eq!(done.prompt_cached_count, 0);
    let cached = first.settled_slot(0).cached_tokens;
    let (tokens, state) = save(&first, 0);
    // The cache holds the prompt (with BOS) and every generated token but the last.
    assert_eq!(tokens.len(), cached);
    assert_eq!(tokens.len(), 1 + prompt.len() + 5);
    assert_eq!(tokens[0], BOS);
    drop(first);

    // A new engine (a restarted server): restore into slot 1, so that reuse proves the
    // restore (slot 0 is as empty as slot 1 was).
    let second = Harness::new(FakeConfig::default(), 2);
    let n = tokens.len();
    assert_eq!(
        second.slot(
            1,
            SlotAction::Restore {
                tokens,
                state,
                lora: LoraScales::base(),
            }
        ),
        Ok(SlotOutcome::Restored(n))
    );
    assert_eq!(second.settled_slot(1).cached_tokens, n);
    let (again, done) = collect(&mut second.submit(prompt, greedy(6)));
    // Every prompt token but the last (re-decoded for logits) came from the restored cache,
    // and the fake's output, a hash of the KV it holds, is the same.
    assert_eq!(done.prompt_cached_count, done.prompt_eval_count - 1);
    assert_eq!(done.prompt_eval_count, 1 + prompt.len());
    assert_eq!(again, text);
    // A longer prompt that starts with the saved one reuses all of it.
    let longer = format!("{prompt}{text} and more");
    let (_, done) = collect(&mut second.submit(&longer, greedy(2)));
    assert_eq!(done.prompt_cached_count, n);
}

#[test]
fn erase_empties_the_slot_so_nothing_is_reused() {
    let h = Harness::new(FakeConfig::default(), 1);
    let (_, _) = collect(&mut h.submit("erase me", greedy(3)));
    let cached = h.settled_slot(0).cached_tokens;
    assert!(cached > 0);
    assert_eq!(
        h.slot(0, SlotAction::Erase),
        Ok(SlotOutcome::Erased(cached))
    );
    assert_eq!(h.settled_slot(0).cached_tokens, 0);
    let (text, done) = collect(&mut h.submit("erase me", greedy(3)));
    assert_eq!(done.prompt_cached_count, 0);
    assert_eq!(text, expected("erase me", 3));
    let (tokens, state) = save(&h, 0);
    assert!(!tokens.is_empty() && state.len() == 4 * tokens.len());
}

#[test]
fn busy_and_unknown_slots_are_refused_and_the_running_request_is_untouched() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 100_000,
            decode_delay: Duration::from_millis(1),
            ..FakeConfig::default()
        },
        2,
    );
    let mut rx = h.submit("busy", greedy(200));
    assert_eq!(rx.blocking_recv(), Some(Event::Started));
    // The request holds slot 0 (the lowest free one).
    for action in [
        SlotAction::Save,
        SlotAction::Erase,
        SlotAction::Restore {
            tokens: vec![],
            state: vec![],
            lora: LoraScales::base(),
        },
    ] {
        let err = h.slot(0, action).unwrap_err();
        assert_eq!(err.kind, EngineErrorKind::SlotBusy, "{err}");
    }
    let err = h.slot(2, SlotAction::Erase).unwrap_err();
    assert_eq!(err.kind, EngineErrorKind::SlotNotFound);
    assert!(err.message.contains("0..2"), "{err}");
    // The free slot can be saved meanwhile.
    assert!(h.slot(1, SlotAction::Save).is_ok());
    let mut text = String::new();
    loop {
        match rx.blocking_recv().expect("the stream ends with Done") {
            Event::Text { text: t, .. } => text.push_str(&t),
            Event::Done(c) => {
                assert_eq!(c.eval_count, 200);
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(text, expected("busy", 200));
}

#[test]
fn a_state_the_backend_refuses_leaves_the_slot_empty_and_the_engine_serving() {
    let h = Harness::new(FakeConfig::default(), 1);
    let (_, _) = collect(&mut h.submit("kept", greedy(3)));
    let (tokens, state) = save(&h, 0);
    for (tokens, state, why) in [
        // Not a whole number of cells.
        (tokens.clone(), vec![1, 2, 3], "whole number"),
        // Cells that do not match the tokens named.
        (
            tokens.clone(),
            state[..state.len() - 4].to_vec(),
            "positions",
        ),
    ] {
        let err = h
            .slot(
                0,
                SlotAction::Restore {
                    tokens,
                    state,
                    lora: LoraScales::base(),
                },
            )
            .unwrap_err();
        assert_eq!(err.kind, EngineErrorKind::InvalidSlotState, "{err}");
        assert!(err.message.contains(why), "{err}");
        assert_eq!(h.settled_slot(0).cached_tokens, 0);
        let (text, done) = collect(&mut h.submit("kept", greedy(3)));
        assert_eq!(done.prompt_cached_count, 0);
        assert_eq!(text, expected("kept", 3));
    }
    let too_many = vec![1; 257];
    let err = h
        .slot(
            0,
            SlotAction::Restore {
                tokens: too_many,
                state: vec![0; 257 * 4],
                lora: LoraScales::base(),
            },
        )
        .unwrap_err();
    assert_eq!(err.kind, EngineErrorKind::ContextLength);
}

#[test]
fn the_slot_table_shows_what_each_request_is_doing() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 100_000,
            decode_delay: Duration::from_millis(1),
            ..FakeConfig::default()
        },
        2,
    );
    let idle = h.settled_slot(1);
    assert_eq!(idle.activity, crate::protocol::SlotActivity::default());
    let mut rx = h.submit("watch this", greedy(100_000));
    assert_eq!(rx.blocking_recv(), Some(Event::Started));
    let mut received = 0;
    while received < 5 {
        if let Some(Event::Text { text, .. }) = rx.blocking_recv() {
            received += text.len();
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    let busy = loop {
        let table = h.handle.health.slot_table();
        if let Some(s) = table
            .iter()
            .find(|s| s.busy && s.activity.generated_tokens >= 5)
        {
            break s.clone();
        }
        assert!(Instant::now() < deadline, "{table:?}");
        std::thread::yield_now();
    };
    let a = &busy.activity;
    assert_eq!(a.phase, SlotPhase::Decode);
    assert_eq!(a.prompt_tokens, 1 + "watch this".len());
    assert_eq!(a.prompt_processed_tokens, a.prompt_tokens);
    assert_eq!(a.prompt_cached_tokens, 0);
    assert!(!a.paused);
    drop(rx);
    assert_eq!(h.settled_slot(busy.id).activity.phase, SlotPhase::Idle);
}

mod checkpoints;
mod draft;
mod images;
mod lora;
mod prompt_cache;
mod speculative;
