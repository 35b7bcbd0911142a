//! What the gateway's actor is told: by the HTTP side (a request, a metrics page), by the
//! worker port (a worker's registration, its messages, its leaving) and by the clock.

use std::time::Instant;

use bulkhead_api::GenEvent;
use bulkhead_protocol::gateway::{RegisterError, Submission};
use bulkhead_protocol::{Hello, Message, WorkerId};
use tokio::sync::{mpsc, oneshot};

/// A command to the actor.
pub(crate) enum Cmd {
    /// A request the HTTP side admitted, and what only this process needs of it: when it
    /// arrived, where its events go, and the field an over-context error names.
    Submit {
        submission: Submission,
        arrived: Instant,
        events: mpsc::Sender<GenEvent>,
        prompt_param: &'static str,
    },
    Register {
        hello: Hello,
        writer: mpsc::Sender<Message>,
        reply: oneshot::Sender<Result<WorkerId, RegisterError>>,
    },
    Worker {
        from: WorkerId,
        msg: Message,
    },
    Left {
        id: WorkerId,
    },
    Tick {
        now_ms: u64,
    },
    /// Render `/metrics`, or with `tenants` the operator's per-tenant series.
    Metrics {
        tenants: bool,
        reply: oneshot::Sender<String>,
    },
}

/// Commands that may wait for the actor. Beyond this, HTTP requests get 429 with
/// `Retry-After` (the actor is behind: nothing is lost, the client retries), and worker
/// readers and the ticker wait (backpressure on their connections).
pub const ACTOR_INBOX: usize = 4096;

/// Messages that may wait for one worker's connection. A worker that falls this far
/// behind is disconnected and counted as lost (its requests fail, its pages are fenced by
/// the usual paths), rather than letting the gateway's memory grow without bound or one
/// slow worker stall every other.
pub const WORKER_OUTBOX: usize = 8192;
