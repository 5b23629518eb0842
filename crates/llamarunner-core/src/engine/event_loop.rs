//! The engine thread's loop: it receives the HTTP side's messages (requests, slot-file actions,
//! wake-ups) and embedding requests, gives the scheduler (`sched/`) one turn per iteration,
//! serves embeddings between its steps, and publishes the slot table. When there is nothing to
//! do it blocks on the inbox; it never spins.

use std::sync::mpsc::{RecvTimeoutError, TryRecvError};
use std::time::Duration;

use super::delivery::Deliveries;
use super::embeddings::EmbedQueue;
use crate::backend::Backend;
use crate::protocol::{EngineError, EngineErrorKind, EngineInbox, Message, SlotCommand};
use crate::sched::Scheduler;

/// The scheduler, with the inbox it serves.
pub struct Engine<B: Backend> {
    sched: Scheduler<B>,
    inbox: EngineInbox,
    embeddings: EmbedQueue,
    /// Ended requests' last events that their clients have not taken yet.
    deliveries: Deliveries,
    /// The last step decoded nothing although sequences are running (all paused for their
    /// clients): the next receive waits a moment instead of spinning.
    stalled: bool,
}

impl<B: Backend> Engine<B> {
    /// An engine that serves `inbox` with `sched`.
    pub fn new(sched: Scheduler<B>, inbox: EngineInbox) -> Self {
        Self {
            sched,
            inbox,
            embeddings: EmbedQueue::default(),
            deliveries: Deliveries::default(),
            stalled: false,
        }
    }

    /// An engine over `backend` with `slots` slots and the scheduler's defaults.
    pub fn with_backend(backend: B, slots: usize, inbox: EngineInbox) -> Self {
        let sched = Scheduler::new(backend, slots, inbox.observer.clone(), inbox.queue.clone());
        Self::new(sched, inbox)
    }

    /// Runs until shutdown is requested or every handle is dropped.
    pub fn run(mut self) {
        let total = u32::try_from(self.sched.slot_count()).unwrap_or(u32::MAX);
        if self.inbox.health.model_info().is_none() {
            // A backend without a model file (the fake) still gets a description.
            if let Some(info) = self.sched.backend_mut().describe() {
                self.inbox.health.set_model_info(info);
            }
        }
        // The table is there from the first moment the server says ready.
        self.publish_slots();
        self.inbox.health.set_ready(total);
        while self.receive() {
            if self.inbox.stopping() {
                break;
            }
            // Clients that left free their slots and queue places before anything else runs.
            self.sched.drop_cancelled();
            self.embeddings
                .step(self.sched.backend_mut(), self.inbox.observer.as_ref());
            self.stalled = self.sched.turn().stalled;
            // The table first: a client that has its answer finds its slot free (`/slots`,
            // the busy-slot gauges).
            self.publish_slots();
            self.deliver();
        }
        self.fail_everything();
    }

    /// Delivers what the scheduler ended this turn, and what earlier endings still hold.
    fn deliver(&mut self) {
        self.deliveries.retry();
        for ending in self.sched.take_endings() {
            self.deliveries.deliver(ending);
        }
    }

    fn publish_slots(&self) {
        self.inbox.health.set_slots(self.sched.slot_table());
    }

    fn idle(&self) -> bool {
        self.sched.idle() && self.embeddings.is_idle()
    }

    /// Moves every new message into the scheduler's waiting queue (its length is bounded by
    /// the handle's gauge) and new embedding requests into `embeddings`; blocks when there is
    /// nothing to do. False = exit.
    fn receive(&mut self) -> bool {
        if self.stalled {
            match self.inbox.rx.recv_timeout(Duration::from_millis(2)) {
                Ok(m) => self.handle(m),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return false,
            }
        } else if self.idle() {
            let msg = if !self.deliveries.is_empty() {
                self.inbox.rx.recv_timeout(Duration::from_millis(5))
            } else {
                self.inbox
                    .rx
                    .recv()
                    .map_err(|_| RecvTimeoutError::Disconnected)
            };
            match msg {
                Ok(m) => self.handle(m),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return false,
            }
        }
        while let Ok(e) = self.inbox.embed_rx.try_recv() {
            self.embeddings.push(e);
        }
        loop {
            match self.inbox.rx.try_recv() {
                Ok(m) => self.handle(m),
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return !self.idle(),
            }
        }
    }

    fn handle(&mut self, msg: Message) {
        match msg {
            Message::Request(r) => self.sched.enqueue(*r),
            Message::Slot(command) => {
                let SlotCommand {
                    slot,
                    action,
                    reply,
                } = *command;
                let outcome = self.sched.slot_action(slot, action);
                // `GET /slots` shows the change once the caller has its answer.
                self.publish_slots();
                let _ = reply.send(outcome);
            }
            Message::Wake => {}
        }
    }

    /// The server stops: every request still queued, waiting or running gets the error.
    fn fail_everything(&mut self) {
        let err = EngineError::new(EngineErrorKind::ShuttingDown, "the server is shutting down");
        while let Ok(m) = self.inbox.rx.try_recv() {
            self.handle(m);
        }
        self.embeddings.fail_all(&err);
        while let Ok(r) = self.inbox.embed_rx.try_recv() {
            let _ = r.reply.send(Err(err.clone()));
        }
        self.sched.fail_all(&err);
        self.deliver();
        self.publish_slots();
    }
}
