//! What prefill and decode workers share: configuration, the capacity contract (I5),
//! loading, and registering with the gateway.

use std::path::PathBuf;

use bulkhead_api::trace::TraceId;
use bulkhead_engine::LoadedModel;
use bulkhead_kv::{KvChecks, KvPool, PoolConfig};
use bulkhead_protocol::TraceContext;

use bulkhead_transport::trust::Trust;
use bulkhead_transport::wire::WireError;

/// Messages a worker's connection readers may queue for its main thread before they
/// block: a bound on its memory (frames are at most 16 MiB, KV chunks of the default model
/// ~370 KB) and backpressure on whoever sends faster than the worker handles. Its main
/// thread never sends into this channel, so it cannot block itself.
pub const INBOX: usize = 256;

/// Settings of a worker process.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// GGUF model file.
    pub model: PathBuf,
    /// Compute threads (0 = one per core).
    pub threads: usize,
    /// The quantised kernels' arithmetic (`None`: the faster on this CPU).
    pub kernel_sums: Option<bulkhead_model::Sums>,
    /// The gateways' worker addresses, `host:port` (one or several: see [`crate::gateways`]).
    pub gateways: Vec<String>,
    /// KV pool size in tokens.
    pub pool_tokens: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// Context to advertise (default: the model's).
    pub context_length: Option<usize>,
    /// Lower the advertised context to what the pool holds instead of refusing to start.
    pub clamp_context: bool,
    /// Decode only: where prefill workers connect, `host:port` (port 0 = any).
    pub kv_listen: String,
    /// Decode only: the address prefill workers are told to use (default: the bound
    /// listen address; needed when listening on 0.0.0.0).
    pub kv_advertise: Option<String>,
    /// Prefill only: pages per transfer batch (also the prefill compute chunk).
    pub transfer_batch_pages: usize,
    /// Prefill only: prompt tokens per step over all the prompts it batches.
    pub max_prefill_tokens: usize,
    /// Decode: how long a reservation may go without any frame from its prefill worker
    /// before it fails. Prefill: sets how often it sends `KvKeepalive` (a quarter of this,
    /// at most every second).
    pub transfer_timeout_ms: u64,
    /// Decode only: a rest of a prompt this short, past what the worker's cache holds, is
    /// computed here (`DecodeConfig::local_prefill_tokens`); 0: never.
    pub max_local_prefill_tokens: usize,
    /// Decode workers: speculative decoding.
    pub speculation: bulkhead_engine::Speculation,
    /// Decode workers: the draft model of [`bulkhead_engine::Speculation::Draft`].
    pub draft_model: Option<PathBuf>,
    /// Where the laid-out weights are shared with this host's other workers, if anywhere
    /// ([`bulkhead_model::shared`]).
    pub weights_cache: Option<PathBuf>,
    /// Optional KV integrity checks (canaries, checksums, auditor).
    pub kv_checks: KvChecks,
    /// The cluster key, if any (every internal connection authenticates with it).
    pub trust: Trust,
    /// Most pages of the pool the prefix cache keeps (0: no cache): a prefill worker's
    /// cache of prompt pages, a decode worker's cache of ended requests' pages.
    pub prefix_cache_pages: usize,
    /// Which road KV frames may take between prefill and decode workers.
    pub kv_transport: bulkhead_transport::kv_transport::KvTransport,
    /// The core budget shared with the other workers on this host, if any.
    pub core_budget: Option<crate::core_budget::CoreBudget>,
    /// The main loop's heartbeat for the health listener (`--health-listen`), if any.
    pub health: Option<std::sync::Arc<crate::health::Health>>,
}

/// Why a worker could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(
        "the KV pool holds {pool} tokens but the advertised context is {context}: one maximum-length request would not fit. \
         Raise --kv-pool-tokens (or --kv-memory) to at least {context}, lower --context-length to at most {pool}, \
         or pass --clamp-context to advertise {pool}"
    )]
    Capacity { pool: usize, context: usize },
    #[error(transparent)]
    Load(#[from] bulkhead_engine::LoadError),
    #[error("draft model {path}: {source}")]
    Draft { path: PathBuf, source: bulkhead_engine::DraftError },
    #[error(transparent)]
    Kv(#[from] bulkhead_kv::KvError),
    #[error("cannot reach the gateway at {addr}: {source}")]
    Connect { addr: String, source: std::io::Error },
    #[error("cannot listen for KV connections on {addr} (--kv-listen): {source}")]
    KvListen { addr: String, source: std::io::Error },
    #[error("the gateway refused this worker: {0}")]
    Refused(String),
    #[error("gateway connection: {0}")]
    Wire(#[from] WireError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Model(#[from] bulkhead_model::ModelError),
    #[error(transparent)]
    Trust(#[from] bulkhead_transport::trust::TrustError),
    /// Loading the model, sizing the pool or the capacity check failed: with the same
    /// settings and files a restart fails the same way, so a supervisor should not retry.
    #[error("{0}")]
    CannotStart(Box<WorkerError>),
}

/// The context a worker advertises given its pool (I5): the check the incident lacked.
pub fn advertised_context(model_context: usize, requested: Option<usize>, pool_tokens: usize, clamp: bool) -> Result<usize, WorkerError> {
    let context = requested.unwrap_or(model_context).min(model_context);
    if pool_tokens >= context {
        return Ok(context);
    }
    if clamp {
        tracing::warn!(pool_tokens, context, "KV pool smaller than the context: advertising {pool_tokens} tokens (--clamp-context)");
        return Ok(pool_tokens);
    }
    Err(WorkerError::Capacity { pool: pool_tokens, context })
}

/// The isolation checks a worker runs, for its start-up log line (design I6).
pub fn active_checks(c: KvChecks) -> String {
    let mut on = vec!["lease generation", "owner", "watermark", "coverage", "manifest", "quarantine until fenced"];
    let optional = [(c.canaries, "poison canaries"), (c.checksums, "chunk checksum (xxh3-64)"), (c.audit, "KV auditor (shadow tags)")];
    let mut off = Vec::new();
    for (enabled, name) in optional {
        if enabled { on.push(name) } else { off.push(name) }
    }
    if off.is_empty() { format!("on: {}", on.join(", ")) } else { format!("on: {}; OFF: {}", on.join(", "), off.join(", ")) }
}

/// A loaded worker: model, pool, advertised context.
pub struct Loaded {
    /// Model, tokenizer, chat template.
    pub model: LoadedModel,
    /// KV pool.
    pub pool: KvPool,
    /// Longest request served.
    pub context: usize,
    /// Model file digest.
    pub digest: u64,
}

/// Load the model and size the pool, checking the capacity contract; any failure is
/// [`WorkerError::CannotStart`].
pub fn load(cfg: &WorkerConfig) -> Result<Loaded, WorkerError> {
    try_load(cfg).map_err(|e| WorkerError::CannotStart(Box::new(e)))
}

fn try_load(cfg: &WorkerConfig) -> Result<Loaded, WorkerError> {
    let mut model = bulkhead_engine::load_model_with(&cfg.model, cfg.threads, None, cfg.weights_cache.as_deref())?;
    if let Some(s) = cfg.kernel_sums {
        model.model.set_sums(s);
    }
    let layout = model.model.kv_layout(cfg.page_size);
    let pages = layout.pages_for_tokens(cfg.pool_tokens.max(1));
    let pool = KvPool::new(PoolConfig { layout, pages, checks: cfg.kv_checks })?;
    let context = advertised_context(model.model.config.context_length, cfg.context_length, pool.capacity_tokens(), cfg.clamp_context)?;
    let digest = model.digest;
    tracing::info!(isa = model.model.isa().name(), kernels = %model.model.kernels_line(), "model loaded");
    tracing::info!(
        pool_tokens = pool.capacity_tokens(),
        kv_bytes_per_token = layout.bytes_per_token(),
        context,
        checks = %active_checks(cfg.kv_checks),
        "KV pool sized"
    );
    Ok(Loaded { model, pool, context, digest })
}

/// The span a worker's log lines about one request run in: the request, its W3C trace id,
/// the client's `x-request-id` and the tenant. A root span, so a line logged for one request while a
/// worker is busy with another names only the request it is about.
pub fn request_span(req: bulkhead_kv::RequestId, trace: &TraceContext) -> tracing::Span {
    tracing::info_span!(parent: None, "request", req = %req, trace_id = %TraceId(trace.trace_id), request_id = %trace.request_id, tenant = %trace.tenant)
}
