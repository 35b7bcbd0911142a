//! The gateway: OpenAI HTTP API in front, workers behind, the protocol's gateway role in
//! the middle. One actor task owns the role, the worker connections and the client
//! streams, so every decision about a request is made in one place, in order. It also owns
//! the request metrics and the workers' latest reported metrics, and renders `/metrics`.
//!
//! One request, by type: the API's `GenerationRequest` reaches [`backend::ClusterBackend`],
//! which tokenises it, checks it and builds the protocol's `Submission`; the actor
//! ([`actor`]) hands that to the `GatewayRole`, which builds every attempt's `Reserve`
//! (to a decode worker) and `Prefill` (to a prefill worker) from it; the workers' messages
//! come back through [`workers`] and leave to the client as `GenEvent`s.
//!
//! - [`http`]: which client connections are served, and for how long.
//! - [`backend`]: the API's `Backend`: templating, tokenising, the gateway's admission.
//! - [`actor`]: the one task that owns the role, the client streams and the metrics;
//!   [`inbox`] is what it is told, [`shared`] what it shares with the HTTP side.
//! - [`workers`]: the worker port: the door and handshake (written once, in
//!   `bulkhead-transport`), then each worker's connection.
//! - [`supervisor`]: the worker processes `serve` starts on one host, restarted as they exit.
#![forbid(unsafe_code)]

mod actor;
pub mod backend;
pub mod http;
mod inbox;
mod shared;
pub mod supervisor;
mod workers;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bulkhead_api::{ApiError, ModelCard};

use bulkhead_api::{PromptEncoder, Tenants};
use bulkhead_protocol::GatewayId;
use bulkhead_protocol::cache::CacheSecret;
use bulkhead_protocol::gateway::{GatewayConfig, GatewayRole, GatewaySettings};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

use crate::actor::Actor;
use crate::backend::ClusterBackend;
use crate::http::HttpLimits;
use crate::inbox::{ACTOR_INBOX, Cmd};
use crate::shared::{Refused, Shared};
use bulkhead_transport::metrics::{self};
use bulkhead_transport::trust::Trust;

/// Settings of the gateway.
#[derive(Clone, Debug)]
pub struct GatewayOptions {
    /// HTTP listen address.
    pub http_addr: String,
    /// Worker listen address.
    pub workers: String,
    /// Model file (for the tokenizer, chat template and the digest workers must match).
    pub model: PathBuf,
    /// A chat template to use instead of the model's (or for a model without one).
    pub chat_template: Option<PathBuf>,
    /// Names served in the API, the first as the main one; empty: the model file's name
    /// (without `.gguf`), as llama-server names a model by its file.
    pub model_ids: Vec<String>,
    /// Admission, timeouts, the queue, migration and the prefill window: the role's own.
    pub settings: GatewaySettings,
    /// Client connection limits.
    pub http: HttpLimits,
    /// How long a request body may take to arrive (then 408).
    pub body_timeout: Duration,
    /// The cluster key workers must prove, if any.
    pub trust: Trust,
    /// Who may send requests (API keys to tenants).
    pub tenants: Arc<Tenants>,
    /// Whether requests carry a prefix-cache scope to the prefill workers.
    pub prefix_cache: bool,
    /// Serve the chat page at `/` and the dashboard at `/dashboard` ([`bulkhead_api::web`]).
    pub web_ui: bool,
    /// SHA-256 of the operator's key for `/metrics/tenants`; none: that page is not served.
    pub admin_key_sha256: Option<[u8; 32]>,
    /// What requests that leave a sampling field out get (`--default-temperature`).
    pub defaults: bulkhead_api::openai::Defaults,
    /// This gateway's number in a cluster of several (`--gateway-id`): part of every
    /// request id it makes, so that workers shared by several gateways tell their requests
    /// apart.
    pub gateway_id: GatewayId,
}

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Gguf(#[from] bulkhead_gguf::GgufError),
    #[error("{0}")]
    Tokenizer(#[from] bulkhead_tokenizer::TokenizerError),
    #[error("{0}")]
    Model(#[from] bulkhead_model::ModelError),
    #[error(transparent)]
    Load(#[from] bulkhead_engine::LoadError),
    #[error(transparent)]
    Trust(#[from] bulkhead_transport::trust::TrustError),
}

/// A running gateway.
pub struct RunningGateway {
    /// Where HTTP is served.
    pub http_addr: SocketAddr,
    /// Where workers register.
    pub worker_addr: SocketAddr,
    /// The HTTP server; completes after shutdown and draining.
    pub server: tokio::task::JoinHandle<std::io::Result<()>>,
    shutdown: Option<oneshot::Sender<()>>,
    shared: Arc<Shared>,
}

impl RunningGateway {
    /// The gateway cannot serve and cannot recover by itself (its workers cannot be
    /// restarted): `/health` answers 503 from now on.
    pub fn mark_failed(&self) {
        self.shared.failed.store(true, Ordering::Release);
    }

    /// Stop accepting requests; in-flight ones finish (the caller bounds the wait).
    pub fn shutdown(&mut self) {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
    }
}

/// The model's own name: its file name without `.gguf` (`SmolLM2-135M-Instruct.Q4_1`), else
/// the file's `general.name`. The file name comes first because `general.name` is often a
/// training run's label (SmolLM2's reads "Smollm2 135M 8k Lc100K Mix1 Ep2").
fn model_name(f: &bulkhead_gguf::GgufFile, path: &std::path::Path) -> String {
    let stem = path.file_stem().map(|s| s.to_string_lossy().trim().to_owned()).filter(|s| !s.is_empty());
    stem.or_else(|| f.get_str("general.name").ok().map(|n| n.trim().to_owned()).filter(|n| !n.is_empty()))
        .unwrap_or_else(|| "model".to_owned())
}

/// Load the tokenizer, bind both listeners and start serving.
pub async fn start(opts: GatewayOptions) -> Result<RunningGateway, GatewayError> {
    let f = bulkhead_gguf::GgufFile::open(&opts.model)?;
    let config = bulkhead_model::LlamaConfig::from_gguf(&f)?;
    let tokenizer = bulkhead_tokenizer::Tokenizer::from_gguf(&f)?;
    let chat = bulkhead_engine::load::chat_template_of(&f, &opts.model, opts.chat_template.as_deref())?;
    if chat.is_none() {
        tracing::warn!(model = %opts.model.display(), "the model has no chat template (a base model): /v1/chat/completions answers 400; use /v1/completions or --chat-template");
    }
    let mut names = opts.model_ids.clone();
    if names.is_empty() {
        names.push(model_name(&f, &opts.model));
    }
    let model_id = names.remove(0);
    // The file's identity, read a few megabytes at a time: the gateway never holds the weights.
    let digest = f.digest().ok_or_else(|| bulkhead_engine::LoadError::Digest { path: opts.model.clone() })?;
    drop(f);
    // Derived from the cluster key, or random per run: only this process needs it.
    let cache_secret = match (&opts.trust.key, opts.prefix_cache) {
        (_, false) => None,
        (Some(key), true) => Some(CacheSecret::from_cluster_key(key)),
        (None, true) => Some(CacheSecret::from_random(bulkhead_transport::trust::random()?)),
    };
    let (cmds, inbox) = mpsc::channel(ACTOR_INBOX);
    let shared = Arc::new(Shared {
        card: ModelCard { id: model_id.clone(), max_model_len: config.context_length, created: unix_now(), owned_by: "bulkhead".into() },
        max_context: AtomicUsize::new(config.context_length),
        ready: AtomicBool::new(false),
        failed: AtomicBool::new(false),
        encoder: PromptEncoder::new(Arc::new(tokenizer), chat),
        aliases: names,
        cache_secret,
        admission_check: opts.settings.admission_check,
        defaults: opts.defaults,
        refused: Refused::default(),
        http: Arc::default(),
        responses: Default::default(),
        cmds: cmds.clone(),
    });
    let role = GatewayRole::new(GatewayConfig {
        model_context: config.context_length,
        model_digest: digest,
        tenants: opts.tenants.policies(),
        settings: opts.settings,
    })
    .with_id(opts.gateway_id);
    let actor = Actor::new(role, shared.clone(), opts.gateway_id, first_request_number());
    tokio::spawn(actor.run(inbox));
    let ticker = cmds.clone();
    tokio::spawn(async move {
        let start = tokio::time::Instant::now();
        let mut iv = tokio::time::interval(Duration::from_millis(100));
        loop {
            iv.tick().await;
            if ticker.send(Cmd::Tick { now_ms: start.elapsed().as_millis() as u64 }).await.is_err() {
                return;
            }
        }
    });
    let wl = TcpListener::bind(&opts.workers).await?;
    let worker_addr = wl.local_addr()?;
    opts.trust.check_listener("gateway's worker port", worker_addr)?;
    tokio::spawn(workers::accept(wl, cmds.clone(), opts.trust.clone()));
    let hl = TcpListener::bind(&opts.http_addr).await?;
    let http_addr = hl.local_addr()?;
    let backend_shared = shared.clone();
    let tenant_cmds = cmds.clone();
    let mut app = bulkhead_api::router_with_tenants(Arc::new(ClusterBackend(shared)), opts.tenants.clone())
        .route("/metrics", axum::routing::get(move || serve_metrics(cmds.clone(), false)));
    if let Some(digest) = opts.admin_key_sha256 {
        // Per-tenant series name the tenants and their load: the operator's only (I7).
        let page = move |headers: axum::http::HeaderMap| {
            let cmds = tenant_cmds.clone();
            async move {
                match bulkhead_api::tenants::bearer_matches(&headers, &digest) {
                    true => serve_metrics(cmds, true).await,
                    false => axum::response::IntoResponse::into_response(ApiError::invalid_api_key(
                        "/metrics/tenants needs the operator's key (--admin-key) as a bearer token.",
                    )),
                }
            }
        };
        app = app.route("/metrics/tenants", axum::routing::get(page));
    }
    if opts.web_ui {
        app = app.merge(bulkhead_api::web::router(opts.tenants.authenticates()));
    }
    let app = app.layer(axum::Extension(bulkhead_api::BodyTimeout(opts.body_timeout)));
    let (tx, rx) = oneshot::channel::<()>();
    let server = tokio::spawn(crate::http::serve(hl, app, opts.http, Arc::clone(&backend_shared.http), rx));
    tracing::info!(%http_addr, %worker_addr, model = %model_id, "gateway listening");
    Ok(RunningGateway { http_addr, worker_addr, server, shutdown: Some(tx), shared: backend_shared })
}

/// The number of this gateway's first request: the wall clock in microseconds, so that a
/// restarted gateway never reuses an id its previous run gave a request that workers may
/// still hold (they outlive it when other gateways keep them), unless it made more than a
/// request per microsecond. Ids wrap after 2^40 µs (12.7 days), long after any request
/// ended.
fn first_request_number() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_micros() as u64).max(1)
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// `GET /metrics`: the actor renders, so the figures are one consistent snapshot.
async fn serve_metrics(cmds: mpsc::Sender<Cmd>, tenants: bool) -> axum::response::Response {
    use axum::response::IntoResponse;
    let (reply, text) = oneshot::channel();
    if cmds.send(Cmd::Metrics { tenants, reply }).await.is_err() {
        return axum::http::StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    match text.await {
        Ok(text) => ([(axum::http::header::CONTENT_TYPE, metrics::CONTENT_TYPE)], text).into_response(),
        Err(_) => axum::http::StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}
