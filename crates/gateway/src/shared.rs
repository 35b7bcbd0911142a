//! What the gateway's HTTP side and its actor share: the served model's card and encoder,
//! readiness, the admission settings and the counters of requests refused early.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use bulkhead_api::{ModelCard, PromptEncoder};
use bulkhead_protocol::cache::CacheSecret;
use tokio::sync::mpsc;

use crate::inbox::Cmd;

/// Requests the gateway refused before running them, by reason (the HTTP side counts them,
/// before anything reaches the actor).
#[derive(Default)]
pub(crate) struct Refused {
    pub(crate) context_length: AtomicU64,
    pub(crate) unavailable: AtomicU64,
    pub(crate) invalid: AtomicU64,
    pub(crate) busy: AtomicU64,
}

/// What the HTTP side and the actor share.
pub(crate) struct Shared {
    /// The served model under its main name; `aliases` are its other names.
    pub(crate) card: ModelCard,
    pub(crate) aliases: Vec<String>,
    pub(crate) max_context: AtomicUsize,
    pub(crate) ready: AtomicBool,
    /// Set when the gateway cannot serve and cannot recover by itself (`/health` 503).
    pub(crate) failed: AtomicBool,
    pub(crate) encoder: PromptEncoder,
    /// The secret of cache scopes; `None` with the prefix cache off.
    pub(crate) cache_secret: Option<CacheSecret>,
    pub(crate) admission_check: bool,
    pub(crate) defaults: bulkhead_api::openai::Defaults,
    pub(crate) refused: Refused,
    /// Client connections the HTTP front closed itself, by reason.
    pub(crate) http: Arc<crate::http::HttpStats>,
    /// HTTP responses sent, by status.
    pub(crate) responses: std::sync::Mutex<BTreeMap<u16, u64>>,
    pub(crate) cmds: mpsc::Sender<Cmd>,
}

pub(crate) fn count(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}
