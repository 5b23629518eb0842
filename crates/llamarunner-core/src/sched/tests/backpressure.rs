//! Back-pressure: a client that does not read pauses its sequence, and loses its slot after
//! the pause limit.

use super::*;

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
    let bound = crate::protocol::EVENT_CHANNEL_CAPACITY + crate::sched::OUTBOX_CAP_BYTES + 8;
    assert!(
        last < bound,
        "{last} decode steps for an unread stream (bound {bound})"
    );
    // Reading resumes it, and nothing was lost.
    let mut text = String::new();
    assert!(matches!(rx.blocking_recv(), Some(Event::Started { .. })));
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
            Ok(Event::Started { .. }) => break,
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
