//! Delivery of the requests' last events: the scheduler hands each ended request's final text
//! and statistics (or its error) over as an `Ending`; they are offered in order, and what a
//! full client cannot take yet waits here, offered again each turn, until it is taken or the
//! client leaves. A slow reader never holds a slot or the loop.

use crate::protocol::{Ending, Offer};

/// Endings not yet wholly taken by their clients.
#[derive(Debug, Default)]
pub struct Deliveries {
    waiting: Vec<Ending>,
}

impl Deliveries {
    /// Offers `ending`'s events in order; keeps the rest when its client has no room.
    pub fn deliver(&mut self, mut ending: Ending) {
        while let Some(event) = ending.events.pop_front() {
            match ending.sink.offer(event) {
                Offer::Taken => {}
                Offer::Full(event) => {
                    ending.events.push_front(event);
                    self.waiting.push(ending);
                    return;
                }
                Offer::Gone => return,
            }
        }
    }

    /// Offers again what waits.
    pub fn retry(&mut self) {
        for ending in std::mem::take(&mut self.waiting) {
            self.deliver(ending);
        }
    }

    /// Nothing waits.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{EngineError, EngineErrorKind, Event, EventSink, EVENT_CHANNEL_CAPACITY};

    fn text(i: usize) -> Event {
        Event::Text {
            text: i.to_string(),
            logprobs: Vec::new(),
        }
    }

    #[test]
    fn a_full_client_gets_the_rest_in_order_once_it_reads() {
        let (sink, mut rx) = EventSink::channel();
        for i in 0..EVENT_CHANNEL_CAPACITY - 1 {
            assert!(matches!(sink.offer(text(i)), Offer::Taken));
        }
        let mut deliveries = Deliveries::default();
        let err = EngineError::new(EngineErrorKind::Internal, "late");
        deliveries.deliver(Ending {
            sink,
            events: [text(1000), text(1001), Event::Error(err)].into(),
        });
        assert!(
            !deliveries.is_empty(),
            "one place was free: two events wait"
        );
        let mut seen = Vec::new();
        while let Ok(ev) = rx.try_recv() {
            seen.push(ev);
        }
        assert_eq!(seen.len(), EVENT_CHANNEL_CAPACITY);
        assert!(
            matches!(&seen[EVENT_CHANNEL_CAPACITY - 1], Event::Text { text, .. } if text == "1000")
        );
        deliveries.retry();
        assert!(deliveries.is_empty());
        assert!(matches!(rx.try_recv(), Ok(Event::Text { text, .. }) if text == "1001"));
        assert!(matches!(rx.try_recv(), Ok(Event::Error(_))));
    }

    #[test]
    fn a_client_that_left_is_forgotten() {
        let (sink, rx) = EventSink::channel();
        for i in 0..EVENT_CHANNEL_CAPACITY {
            assert!(matches!(sink.offer(text(i)), Offer::Taken));
        }
        let mut deliveries = Deliveries::default();
        deliveries.deliver(Ending {
            sink,
            events: [text(1)].into(),
        });
        assert!(!deliveries.is_empty());
        drop(rx);
        deliveries.retry();
        assert!(deliveries.is_empty());
    }
}
