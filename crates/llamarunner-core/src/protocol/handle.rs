//! The HTTP side's handle on the engine thread, and the engine's end of the channels.
//!
//! Generation requests and embedding requests travel on separate channels: an embedding runs
//! on its own context between decode steps and must never wait behind requests that wait for a
//! generation slot. The number of requests waiting for a slot is counted here (`max_queue`): the
//! engine drains its channel every step, so a request whose client left is dropped from the
//! queue at once and gives its place back.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::Arc;

use crate::protocol::model::Health;
use crate::protocol::observer::{EngineObserver, NoObserver};
use crate::protocol::{EmbedRequest, Message, Request, SlotCommand};

/// Why a request could not be queued.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SubmitError {
    /// The waiting queue is full.
    #[error("the server is busy: too many requests are waiting for a slot")]
    QueueFull,
    /// The engine thread is gone.
    #[error("the engine is not running")]
    Stopped,
}

/// Requests waiting for a slot: taken by `submit`, given back by the engine when a request
/// leaves the queue (admitted, cancelled, timed out or failed).
#[derive(Debug, Default)]
pub struct QueueGauge {
    waiting: AtomicUsize,
}

impl QueueGauge {
    /// Requests waiting now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    fn try_take(&self, max: usize) -> bool {
        self.waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok()
    }

    /// One request left the queue.
    pub fn release(&self) {
        let _ = self
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }
}

/// The HTTP side's handle on the engine: cheap to clone, never blocks.
#[derive(Clone, Debug)]
pub struct EngineHandle {
    tx: SyncSender<Message>,
    embed_tx: SyncSender<EmbedRequest>,
    /// Load state and slot gauges.
    pub health: Arc<Health>,
    /// Requests waiting for a slot.
    pub queue: Arc<QueueGauge>,
    max_queue: usize,
    shutdown: Arc<AtomicBool>,
}

impl EngineHandle {
    /// Creates the handle and the engine's end of the channels; at most `max_queue` requests
    /// wait for a slot (and as many embedding inputs for the embedding context). The engine
    /// reports to no observer.
    pub fn new(max_queue: usize) -> (Self, EngineInbox) {
        Self::with_observer(max_queue, Arc::new(NoObserver))
    }

    /// As `new`, with the engine reporting what it does to `observer` (the metrics).
    pub fn with_observer(
        max_queue: usize,
        observer: Arc<dyn EngineObserver>,
    ) -> (Self, EngineInbox) {
        let max_queue = max_queue.max(1);
        // Room for every counted request plus wake-ups, so a counted request is never refused
        // by a full channel.
        let (tx, rx) = std::sync::mpsc::sync_channel(max_queue + 16);
        let (embed_tx, embed_rx) = std::sync::mpsc::sync_channel(max_queue);
        let shutdown = Arc::new(AtomicBool::new(false));
        let health = Arc::new(Health::default());
        let queue = Arc::new(QueueGauge::default());
        (
            Self {
                tx,
                embed_tx,
                health: health.clone(),
                queue: queue.clone(),
                max_queue,
                shutdown: shutdown.clone(),
            },
            EngineInbox {
                rx,
                embed_rx,
                shutdown,
                health,
                queue,
                observer,
            },
        )
    }

    /// Queues a request for a slot.
    pub fn submit(&self, request: Request) -> Result<(), SubmitError> {
        if self.shutdown.load(Ordering::Acquire) {
            return Err(SubmitError::Stopped);
        }
        if !self.queue.try_take(self.max_queue) {
            return Err(SubmitError::QueueFull);
        }
        match self.tx.try_send(Message::Request(Box::new(request))) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.queue.release();
                Err(match e {
                    TrySendError::Full(_) => SubmitError::QueueFull,
                    TrySendError::Disconnected(_) => SubmitError::Stopped,
                })
            }
        }
    }

    /// Queues an embedding request; it never waits for a generation slot.
    pub fn submit_embed(&self, request: EmbedRequest) -> Result<(), SubmitError> {
        if self.shutdown.load(Ordering::Acquire) {
            return Err(SubmitError::Stopped);
        }
        match self.embed_tx.try_send(request) {
            Ok(()) => {
                // Wake an idle engine; a full channel means it is awake anyway.
                let _ = self.tx.try_send(Message::Wake);
                Ok(())
            }
            Err(TrySendError::Full(_)) => Err(SubmitError::QueueFull),
            Err(TrySendError::Disconnected(_)) => Err(SubmitError::Stopped),
        }
    }

    /// Sends a slot operation; the engine runs it between two steps. Not counted in the
    /// waiting queue: it never waits for a slot (a busy slot is refused).
    pub fn submit_slot(&self, command: SlotCommand) -> Result<(), SubmitError> {
        if self.shutdown.load(Ordering::Acquire) {
            return Err(SubmitError::Stopped);
        }
        self.tx
            .try_send(Message::Slot(Box::new(command)))
            .map_err(|e| match e {
                TrySendError::Full(_) => SubmitError::QueueFull,
                TrySendError::Disconnected(_) => SubmitError::Stopped,
            })
    }

    /// Whether shutdown was requested.
    pub fn stopping(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }

    /// Asks the engine thread to finish: running requests get a shutdown error.
    pub fn shutdown(&self) {
        self.shutdown.store(true, Ordering::Release);
        // A full queue means the engine is awake anyway and will see the flag.
        let _ = self.tx.try_send(Message::Wake);
    }
}

/// The engine thread's end: requests, the shutdown flag and the health to report into.
#[derive(Debug)]
pub struct EngineInbox {
    /// Generation requests (and wake-ups).
    pub rx: Receiver<Message>,
    /// Embedding requests.
    pub embed_rx: Receiver<EmbedRequest>,
    /// Set when the engine must stop.
    pub shutdown: Arc<AtomicBool>,
    /// Where load state and gauges are published.
    pub health: Arc<Health>,
    /// Requests waiting for a slot (the engine gives places back).
    pub queue: Arc<QueueGauge>,
    /// Where the loop reports what it does (the metrics).
    pub observer: Arc<dyn EngineObserver>,
}

impl EngineInbox {
    /// Whether shutdown was requested.
    pub fn stopping(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }
}
