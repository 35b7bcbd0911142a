//! The gateway: OpenAI HTTP API in front, workers behind, the protocol's gateway role in
//! the middle. One actor task owns the role, the worker connections and the client
//! streams, so every decision about a request is made in one place, in order. It also owns
//! the request metrics and the workers' latest reported metrics, and renders `/metrics`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bulkhead_api::{ApiError, Backend, GenEvent, GenerationRequest, ModelCard};

use bulkhead_api::{PromptEncoder, Tenants};
use bulkhead_kv::RequestId;
use bulkhead_protocol::admission::{Generate, admit, default_max_tokens};
use bulkhead_protocol::auth::Server;
use bulkhead_protocol::cache::{CacheScope, CacheSecret};
use bulkhead_protocol::gateway::{
    ClientOutput, GatewayAction, GatewayConfig, GatewayEvent, GatewayRole, QUEUE_WAIT_BUCKETS, RegisterError, TenantId, request_id,
};
use bulkhead_protocol::{
    DEFAULT_MAX_FRAME, FailReason, FrameDecoder, FrameEncoder, GatewayId, Hello, Message, MetricFamily, Purpose, RejectReason, Role,
    Sampling, TraceContext, WorkerId,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};

use crate::door::{self, Door, Refusal, Waiter};
use crate::http::HttpLimits;
use crate::metrics::{self, Families, Finish, RequestMetrics};
use crate::trust::Trust;

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
    /// Check the context limit at the gateway (tests switch it off).
    pub admission_check: bool,
    /// A request not finished after this long fails.
    pub request_timeout_ms: u64,
    /// Requests that may wait for capacity; one more gets 429.
    pub max_queued: usize,
    /// How long a request may wait for capacity before it gets 429.
    pub queue_timeout_ms: u64,
    /// How many times one request may move off a lost decode worker.
    pub migration_limit: u32,
    /// Prompt tokens a prefill worker is given at once (0: no window).
    pub prefill_window_tokens: usize,
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
    Trust(#[from] crate::trust::TrustError),
}

enum Cmd {
    Submit {
        tokens: Vec<u32>,
        max_tokens: u32,
        max_tokens_set: bool,
        sampling: Sampling,
        stop: Vec<String>,
        trace: TraceContext,
        tenant: TenantId,
        cache: Option<CacheScope>,
        priority: i64,
        arrived: Instant,
        events: mpsc::Sender<GenEvent>,
        /// `messages` or `prompt`: the field a context-length error names.
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

/// Requests the gateway refused before running them, by reason (the HTTP side counts them,
/// before anything reaches the actor).
#[derive(Default)]
struct Refused {
    context_length: AtomicU64,
    unavailable: AtomicU64,
    invalid: AtomicU64,
    busy: AtomicU64,
}

struct Shared {
    /// The served model under its main name; `aliases` are its other names.
    card: ModelCard,
    aliases: Vec<String>,
    max_context: AtomicUsize,
    ready: AtomicBool,
    /// Set when the gateway cannot serve and cannot recover by itself (`/health` 503).
    failed: AtomicBool,
    encoder: PromptEncoder,
    /// The secret of cache scopes; `None` with the prefix cache off.
    cache_secret: Option<CacheSecret>,
    admission_check: bool,
    defaults: bulkhead_api::openai::Defaults,
    refused: Refused,
    /// Client connections the HTTP front closed itself, by reason.
    http: Arc<crate::http::HttpStats>,
    /// HTTP responses sent, by status.
    responses: std::sync::Mutex<BTreeMap<u16, u64>>,
    cmds: mpsc::Sender<Cmd>,
}

fn count(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// The [`Backend`] the HTTP layer calls: templating, tokenising and the gateway's own
/// admission check happen here, before anything is sent to a worker.
pub struct ClusterBackend(Arc<Shared>);

impl Backend for ClusterBackend {
    fn models(&self) -> Vec<ModelCard> {
        let mut c = self.0.card.clone();
        c.max_model_len = self.0.max_context.load(Ordering::Acquire);
        let aliases = self.0.aliases.iter().map(|id| ModelCard { id: id.clone(), ..c.clone() }).collect::<Vec<_>>();
        std::iter::once(c).chain(aliases).collect()
    }

    fn encoder(&self) -> &PromptEncoder {
        &self.0.encoder
    }

    fn defaults(&self) -> bulkhead_api::openai::Defaults {
        self.0.defaults
    }

    fn generate(&self, req: GenerationRequest) -> Result<mpsc::Receiver<GenEvent>, ApiError> {
        let arrived = Instant::now();
        let s = &self.0;
        let tokens = s.encoder.encode(&req.prompt).inspect_err(|_| count(&s.refused.invalid))?;
        let limit = s.max_context.load(Ordering::Acquire);
        let max_tokens = req.max_tokens.unwrap_or_else(|| default_max_tokens(tokens.len(), limit));
        let prompt_param = req.prompt.param();
        if s.admission_check
            && let Err(r) = admit(tokens.len(), Generate::Tokens(max_tokens), limit)
        {
            count(if r.reason() == RejectReason::ContextLength { &s.refused.context_length } else { &s.refused.invalid });
            return Err(ApiError::refused(&r, prompt_param));
        }
        let max_tokens = u32::try_from(max_tokens).map_err(|_| {
            count(&s.refused.context_length);
            ApiError::context_length_exceeded(tokens.len(), max_tokens, limit, prompt_param)
        })?;
        // Enough room for every token of the longest request: sends never block the actor.
        let (tx, rx) = mpsc::channel(limit.max(16) + 8);
        let tenant = TenantId(req.tenant.id);
        // The scope comes from the tenant of the API key and the salt; nothing else.
        let cache = s.cache_secret.as_ref().map(|secret| secret.scope(&req.tenant.name, req.cache_salt.as_deref()));
        let trace = TraceContext { trace_id: req.trace_id.0, request_id: req.request_id, tenant: req.tenant.name.to_string() };
        let sampling = req.sampling;
        match s.cmds.try_send(Cmd::Submit {
            tokens,
            max_tokens,
            max_tokens_set: req.max_tokens.is_some(),
            sampling,
            stop: req.stop,
            trace,
            tenant,
            cache,
            priority: req.priority,
            arrived,
            events: tx,
            prompt_param,
        }) {
            Ok(()) => Ok(rx),
            Err(mpsc::error::TrySendError::Full(_)) => {
                count(&s.refused.busy);
                Err(ApiError::too_many_requests("gateway_busy", format!("the gateway has {ACTOR_INBOX} commands waiting; retry shortly")))
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Err(ApiError::internal("the gateway is shutting down")),
        }
    }

    fn ready(&self) -> bool {
        self.0.ready.load(Ordering::Acquire)
    }

    fn healthy(&self) -> bool {
        !self.0.failed.load(Ordering::Acquire) && !self.0.cmds.is_closed()
    }

    fn responded(&self, status: u16) {
        // A poisoned count is still a count: no panic holds it half-written.
        *self.0.responses.lock().unwrap_or_else(std::sync::PoisonError::into_inner).entry(status).or_default() += 1;
    }

    fn refused_early(&self, reason: &'static str) {
        let r = &self.0.refused;
        count(if reason == "context_length" { &r.context_length } else { &r.invalid });
    }
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
    // The digest of the bytes already read: one pass over the file in all.
    let digest = f.digest().unwrap_or_default();
    drop(f);
    // Derived from the cluster key, or random per run: only this process needs it.
    let cache_secret = match (&opts.trust.key, opts.prefix_cache) {
        (_, false) => None,
        (Some(key), true) => Some(CacheSecret::from_cluster_key(key)),
        (None, true) => Some(CacheSecret::from_random(crate::trust::random()?)),
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
        admission_check: opts.admission_check,
        defaults: opts.defaults,
        refused: Refused::default(),
        http: Arc::default(),
        responses: Default::default(),
        cmds: cmds.clone(),
    });
    let role = GatewayRole::new(GatewayConfig {
        model_context: config.context_length,
        model_digest: digest,
        admission_check: opts.admission_check,
        request_timeout_ms: opts.request_timeout_ms,
        max_queued: opts.max_queued,
        queue_timeout_ms: opts.queue_timeout_ms,
        migration_limit: opts.migration_limit,
        prefill_window_tokens: opts.prefill_window_tokens,
        tenants: opts.tenants.policies(),
    })
    .with_id(opts.gateway_id);
    let actor = Actor {
        role,
        shared: shared.clone(),
        writers: BTreeMap::new(),
        workers: BTreeMap::new(),
        clients: BTreeMap::new(),
        gateway_id: opts.gateway_id,
        next_req: first_request_number(),
        registered: [0, 0],
        requests: RequestMetrics::default(),
        tenants: BTreeMap::new(),
    };
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
    tokio::spawn(accept_workers(wl, cmds.clone(), opts.trust.clone()));
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

/// Which metrics page is rendered.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Page {
    /// `/metrics`, for anyone who can reach the port.
    Public,
    /// The cache activity, on `/metrics/tenants` (the operator's key): it tells when a
    /// tenant repeats a prompt and how long the shared part is.
    Operator,
}

/// The error code of a request larger than its tenant's whole `tokens_per_minute` (400).
const OVER_BUDGET: &str = "request_over_tokens_per_minute";

struct Client {
    events: mpsc::Sender<GenEvent>,
    prompt_tokens: usize,
    max_tokens: usize,
    /// When the HTTP side admitted it (before tokenising).
    arrived: Instant,
    /// When its first and its last token reached the gateway; none yet = still waiting.
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// `messages` or `prompt`: the field a context-length error names.
    prompt_param: &'static str,
    /// Its tenant's name, for the per-tenant series.
    tenant: Arc<str>,
}

/// One tenant's series on `/metrics/tenants`.
#[derive(Default)]
struct TenantSeries {
    requests: RequestMetrics,
    /// Requests turned away before running, by the code the client got.
    refused: BTreeMap<&'static str, u64>,
}

struct WorkerInfo {
    role: Role,
    /// Metrics labels naming it: `worker` (`prefill-0`, `decode-1`, …) and `role`.
    labels: Vec<(String, String)>,
    /// The latest metrics it reported.
    metrics: Vec<MetricFamily>,
}

fn role_name(r: Role) -> &'static str {
    match r {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    }
}

struct Actor {
    role: GatewayRole,
    shared: Arc<Shared>,
    writers: BTreeMap<WorkerId, mpsc::Sender<Message>>,
    workers: BTreeMap<WorkerId, WorkerInfo>,
    clients: BTreeMap<RequestId, Client>,
    /// This gateway's id and its next request's number: the two halves of a request id.
    gateway_id: GatewayId,
    next_req: u64,
    /// Workers ever registered per role (prefill, decode): the next metrics label number.
    registered: [u32; 2],
    requests: RequestMetrics,
    /// The same per tenant, by name.
    tenants: BTreeMap<Arc<str>, TenantSeries>,
}

impl Actor {
    async fn run(mut self, mut inbox: mpsc::Receiver<Cmd>) {
        while let Some(cmd) = inbox.recv().await {
            match cmd {
                Cmd::Submit {
                    tokens,
                    max_tokens,
                    max_tokens_set,
                    sampling,
                    stop,
                    trace,
                    tenant,
                    cache,
                    priority,
                    arrived,
                    events,
                    prompt_param,
                } => {
                    let req = request_id(self.gateway_id, self.next_req);
                    self.next_req += 1;
                    let prompt_tokens = tokens.len();
                    let tenant_name: Arc<str> = Arc::from(trace.tenant.as_str());
                    let client = Client {
                        events,
                        prompt_tokens,
                        max_tokens: max_tokens as usize,
                        arrived,
                        first_token: None,
                        last_token: None,
                        prompt_param,
                        tenant: tenant_name,
                    };
                    self.clients.insert(req, client);
                    self.apply(GatewayEvent::Submit {
                        req,
                        tokens,
                        max_tokens,
                        max_tokens_set,
                        sampling,
                        stop,
                        trace,
                        tenant,
                        cache,
                        priority,
                    });
                }
                Cmd::Register { hello, writer, reply } => {
                    let r = self.register(hello, writer);
                    let _ = reply.send(r);
                }
                Cmd::Worker { from, msg: Message::Metrics { families } } => {
                    if let Some(w) = self.workers.get_mut(&from) {
                        w.metrics = families;
                    }
                }
                Cmd::Worker { from, msg } => self.apply(GatewayEvent::FromWorker { from, msg }),
                Cmd::Left { id } => {
                    if self.workers.remove(&id).is_some() {
                        tracing::warn!(worker = %id, "worker left");
                        self.writers.remove(&id);
                        self.apply(GatewayEvent::WorkerLeft { id });
                        self.update_context();
                    }
                }
                Cmd::Tick { now_ms } => {
                    // Clients whose stream was dropped are gone (I3: the abort reaches every role).
                    let gone: Vec<RequestId> = self.clients.iter().filter(|(_, c)| c.events.is_closed()).map(|(r, _)| *r).collect();
                    for req in gone {
                        self.client_gone(req);
                    }
                    self.apply(GatewayEvent::Tick { now_ms });
                }
                Cmd::Metrics { tenants: false, reply } => {
                    let _ = reply.send(self.metrics_text(Page::Public));
                }
                Cmd::Metrics { tenants: true, reply } => {
                    let mut text = self.tenant_metrics_text();
                    text.push_str(&self.metrics_text(Page::Operator));
                    let _ = reply.send(text);
                }
            }
        }
    }

    fn register(&mut self, h: Hello, writer: mpsc::Sender<Message>) -> Result<WorkerId, RegisterError> {
        let id = h.worker;
        let actions = self.role.join(&h)?;
        let name = role_name(h.role);
        let n = &mut self.registered[usize::from(h.role == Role::Decode)];
        let label = format!("{name}-{n}");
        *n += 1;
        tracing::info!(worker = %id, metrics_label = %label, role = ?h.role, capacity = h.capacity_tokens, max_context = h.max_context, "worker registered");
        let labels = vec![("worker".to_string(), label), ("role".to_string(), name.to_string())];
        self.workers.insert(id, WorkerInfo { role: h.role, labels, metrics: Vec::new() });
        self.writers.insert(id, writer);
        self.carry_out(actions);
        self.update_context();
        Ok(id)
    }

    /// Publish the served context (the role's: the smallest any worker accepts, I5) for
    /// `/v1/models` and the HTTP side's admission, and readiness.
    fn update_context(&mut self) {
        self.shared.max_context.store(self.role.max_context(), Ordering::Release);
        self.shared.ready.store(self.role.ready(), Ordering::Release);
    }

    fn apply(&mut self, ev: GatewayEvent) {
        let actions = self.role.handle(ev);
        self.carry_out(actions);
    }

    fn carry_out(&mut self, actions: Vec<GatewayAction>) {
        for a in actions {
            match a {
                GatewayAction::ToWorker { to, msg } => self.send_to_worker(to, msg),
                GatewayAction::ToClient { req, out } => self.deliver_to_client(req, out),
            }
        }
    }

    /// Queue `msg` for worker `to`. A worker whose queue is full is cut off: dropping its
    /// writer closes its connection, and its reader's end reports it as having left.
    fn send_to_worker(&mut self, to: WorkerId, msg: Message) {
        let Some(w) = self.writers.get(&to) else { return };
        if let Err(mpsc::error::TrySendError::Full(_)) = w.try_send(msg) {
            tracing::error!(worker = %to, queued = WORKER_OUTBOX, "worker too far behind; disconnecting it");
            self.writers.remove(&to);
        }
    }

    /// The client of `req` went away: the abort reaches every role (I3).
    fn client_gone(&mut self, req: RequestId) {
        if let Some(c) = self.clients.remove(&req) {
            self.requests.failed("client_gone");
            self.tenants.entry(c.tenant).or_default().requests.failed("client_gone");
            self.apply(GatewayEvent::ClientGone { req });
        }
    }

    /// `/metrics/tenants`: each tenant's request series (latencies, outcomes, tokens),
    /// refusals and requests waiting, labelled with the tenant's name (never a key).
    fn tenant_metrics_text(&self) -> String {
        let mut f = Families::new();
        for (name, s) in &self.tenants {
            let labels = [("tenant", &**name)];
            s.requests.export_labeled(&mut f, &labels);
            for (code, n) in &s.refused {
                let help = "Requests of a tenant turned away before running, by the error code the client got.";
                f.counter("bulkhead:tenant_refusals_total", help, &[("tenant", name), ("code", code)], *n);
            }
            let waiting = self.clients.values().filter(|c| c.tenant == *name && c.last_token.is_none()).count();
            let help = "Requests of a tenant admitted and not generating yet (queued, reserving KV, in prefill).";
            f.gauge("bulkhead:tenant_requests_waiting", help, &labels, waiting as f64);
        }
        metrics::render(std::iter::once((&[][..], &f.into_vec()[..])))
    }

    /// `/metrics` (the public page: every series but the cache activity) or the cache
    /// activity for the operator's page: of the gateway's own families, then every
    /// registered worker's latest.
    fn metrics_text(&self, page: Page) -> String {
        let mut f = Families::new();
        self.requests.export(&mut f);
        let running = self.clients.values().filter(|c| c.last_token.is_some()).count();
        f.gauge("bulkhead:num_requests_running", "Requests generating tokens.", &[], running as f64);
        let help = "Requests admitted and not generating yet (queued, reserving KV, queued for or in prefill).";
        f.gauge("bulkhead:num_requests_waiting", help, &[], (self.clients.len() - running) as f64);
        f.gauge(
            "bulkhead:num_requests_queued",
            "Requests waiting at the gateway for KV capacity or workers.",
            &[],
            self.role.queued() as f64,
        );
        let oldest = self.role.queue_waits_ms().max().unwrap_or(0) as f64 / 1000.0;
        f.gauge("bulkhead:queue_wait_seconds_max", "How long the longest-waiting queued request has waited.", &[], oldest);
        let g = self.role.stats();
        let queue = [
            ("queue_full", g.queue_full),
            ("queue_timeout", g.queue_timeouts),
            ("requeued_capacity", g.requeued_capacity),
            ("retracted", g.retracted),
            ("retried", g.retried),
            ("migrated", g.migrated),
            ("over_limit", g.over_limit),
        ];
        for (event, n) in queue {
            f.counter("bulkhead:requeue_events_total", "Requests turned away from the queue, or sent back to it.", &[("event", event)], n);
        }
        let waits = metrics::Histogram::from_counts(QUEUE_WAIT_BUCKETS, &g.queue_waits, g.queue_wait_ms_total as f64 / 1000.0);
        let help =
            "Time requests waited in the gateway's queue, from arrival until a decode worker reserved pages for them or the queue timeout.";
        f.histogram("bulkhead:queue_wait_seconds", help, &[], &waits);
        let help = "Requests sent to a prefill worker for its cached prefix (cache) or because loads were out of balance (load).";
        f.counter("bulkhead:prefill_routing_total", help, &[("by", "cache")], g.routed_by_cache);
        f.counter("bulkhead:prefill_routing_total", help, &[("by", "load")], g.routed_by_load);
        let help = "Requests sent to a decode worker for its cached prefix of their scope.";
        f.counter("bulkhead:decode_routing_total", help, &[("by", "cache")], g.decode_routed_by_cache);
        let r = &self.shared.refused;
        // The role's own context check only fires if the served context shrank between the
        // HTTP side's check and the actor's.
        let context = r.context_length.load(Ordering::Relaxed) + self.role.stats().rejected_at_gateway;
        f.rejected("gateway", "context_length", context);
        f.rejected("gateway", "unavailable", r.unavailable.load(Ordering::Relaxed));
        f.rejected("gateway", "invalid", r.invalid.load(Ordering::Relaxed));
        f.rejected("gateway", "busy", r.busy.load(Ordering::Relaxed));
        for role in [Role::Prefill, Role::Decode] {
            let n = self.workers.values().filter(|w| w.role == role).count();
            f.gauge("bulkhead:workers", "Registered workers, by role.", &[("role", role_name(role))], n as f64);
        }
        f.refused_connections(&[("worker", "gateway"), ("role", "gateway")]);
        let help =
            "Client connections the HTTP front closed itself, by reason (first_header_deadline, stranger_lifetime, evicted, source_full).";
        for reason in crate::http::Closed::ALL {
            f.counter("bulkhead:http_connections_closed_total", help, &[("reason", reason.as_str())], self.shared.http.closed(reason));
        }
        let responses = self.shared.responses.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        for (status, n) in responses {
            f.counter("bulkhead:http_responses_total", "HTTP responses sent, by status code.", &[("code", &status.to_string())], n);
        }
        let own = f.into_vec();
        let workers = self.workers.values().map(|w| (&w.labels[..], &w.metrics[..]));
        let sources = std::iter::once((&[][..], &own[..])).chain(workers);
        metrics::render_only(sources, |family, labels| metrics::is_cache_activity(family, labels) == (page == Page::Operator))
    }

    fn deliver_to_client(&mut self, req: RequestId, out: ClientOutput) {
        let terminal = out.is_terminal();
        let Some(c) = self.clients.get_mut(&req) else { return };
        let mut events = Vec::new();
        let series = self.tenants.entry(Arc::clone(&c.tenant)).or_default();
        if let ClientOutput::Rejected { reason, .. } = &out {
            let code = match reason {
                RejectReason::ContextLength => "context_length_exceeded",
                RejectReason::Capacity => "overloaded",
                RejectReason::Invalid | RejectReason::Duplicate => "invalid_request",
            };
            *series.refused.entry(code).or_default() += 1;
        }
        match out {
            ClientOutput::Token { token, text, logprobs } => {
                self.requests.token(c.arrived, c.last_token);
                series.requests.token(c.arrived, c.last_token);
                c.last_token = Some(Instant::now());
                c.first_token = c.first_token.or(c.last_token);
                if !text.is_empty() || logprobs.is_some() {
                    events.push(GenEvent::Text { text, logprobs: logprobs.map(|l| (token, l)) });
                }
            }
            ClientOutput::Finished { finish, text, prompt_tokens, completion_tokens, cached_tokens } => {
                if !text.is_empty() {
                    events.push(GenEvent::Text { text, logprobs: None });
                }
                if c.last_token.is_none() && completion_tokens > 0 {
                    self.requests.token(c.arrived, None);
                    series.requests.token(c.arrived, None);
                }
                let done =
                    Finish { arrived: c.arrived, first_token: c.first_token, reason: finish.as_str(), prompt_tokens, completion_tokens };
                self.requests.finished(&done);
                series.requests.finished(&done);
                events.push(GenEvent::Finished {
                    reason: finish,
                    prompt_tokens: prompt_tokens as usize,
                    completion_tokens: completion_tokens as usize,
                    cached_tokens: cached_tokens as usize,
                });
            }
            ClientOutput::Rejected { reason, detail } => events.push(GenEvent::Failed(match reason {
                RejectReason::ContextLength => {
                    let limit = self.role.max_context();
                    let mut e = ApiError::context_length_exceeded(c.prompt_tokens, c.max_tokens, limit, c.prompt_param);
                    e.message = format!("{} ({detail})", e.message);
                    e
                }
                RejectReason::Capacity => ApiError::overloaded(format!("no KV capacity for this request now: {detail}")),
                RejectReason::Invalid | RejectReason::Duplicate => ApiError::bad_request(detail),
            })),
            ClientOutput::Failed { reason, detail } => {
                let (label, e) = match reason {
                    FailReason::WorkerLost => (
                        "worker_lost",
                        ApiError::overloaded(format!("a worker serving this request went away: {detail}")).with_code("worker_lost"),
                    ),
                    FailReason::Timeout => ("timeout", ApiError::internal(format!("the request timed out: {detail}")).with_code("timeout")),
                    FailReason::TransferRefused => (
                        "transfer_refused",
                        ApiError::internal(format!("KV transfer failed verification: {detail}")).with_code("transfer_refused"),
                    ),
                    FailReason::Internal => ("internal", ApiError::internal(detail)),
                };
                self.requests.failed(label);
                series.requests.failed(label);
                events.push(GenEvent::Failed(e));
            }
            ClientOutput::Unavailable { detail } => {
                count(&self.shared.refused.unavailable);
                events.push(GenEvent::Failed(ApiError::overloaded(detail)));
            }
            ClientOutput::OverBudget { detail } => {
                count(&self.shared.refused.invalid);
                *series.refused.entry(OVER_BUDGET).or_default() += 1;
                events.push(GenEvent::Failed(ApiError::bad_request(detail).with_code(OVER_BUDGET)));
            }
            ClientOutput::Busy { reason, detail } => {
                count(&self.shared.refused.busy);
                *series.refused.entry(reason.code()).or_default() += 1;
                events.push(GenEvent::Failed(ApiError::too_many_requests(reason.code(), detail).with_retry_after(reason.retry_after_s())));
            }
        }
        let mut closed = false;
        for e in events {
            if c.events.try_send(e).is_err() {
                closed = true;
            }
        }
        if terminal {
            self.clients.remove(&req);
        } else if closed {
            self.client_gone(req);
        }
    }
}

/// Worker connections the gateway serves at once (registered or still in their handshake);
/// more are closed at once (and counted).
pub const MAX_WORKER_CONNECTIONS: usize = 256;

/// Accept worker connections, at most [`MAX_WORKER_CONNECTIONS`] at once, each through the
/// worker port's [`Door`] (a handshake deadline, a capped waiting room).
async fn accept_workers(l: TcpListener, cmds: mpsc::Sender<Cmd>, trust: Trust) {
    let open = Arc::new(AtomicUsize::new(0));
    let door = Door::new("worker");
    loop {
        let Ok((s, peer)) = l.accept().await else { continue };
        if open.load(Ordering::Acquire) >= MAX_WORKER_CONNECTIONS {
            door::refuse("worker", Some(peer.ip()), Refusal::Full, &format_args!("{MAX_WORKER_CONNECTIONS} worker connections are open"));
            continue;
        }
        let (evict, evicted) = oneshot::channel::<()>();
        let evict: door::Evict = Box::new(move || {
            let _ = evict.send(());
        });
        let waiter = door.enter(peer.ip(), evict);
        open.fetch_add(1, Ordering::AcqRel);
        let (cmds, trust, open) = (cmds.clone(), trust.clone(), Arc::clone(&open));
        tokio::spawn(async move {
            if let Err(e) = serve_worker(s, cmds, &trust, waiter, evicted).await {
                if e.kind() == std::io::ErrorKind::Other {
                    let total = crate::wire::count_bad_connection();
                    tracing::warn!(%peer, error = %e, bad_connections = total, "worker connection closed for bad bytes");
                } else {
                    tracing::warn!(%peer, error = %e, "worker connection closed");
                }
            }
            open.fetch_sub(1, Ordering::AcqRel);
        });
    }
}

async fn read_msg(r: &mut tokio::net::tcp::OwnedReadHalf, d: &mut FrameDecoder) -> std::io::Result<Message> {
    loop {
        if let Some(m) = d.next_message().map_err(std::io::Error::other)? {
            return Ok(m);
        }
        // Never more than one largest frame: before the handshake that is a few hundred bytes.
        let want = crate::wire::READ_BYTES.min(d.max_wire_frame());
        let n = r.read(d.spare(want)).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        d.filled(n);
    }
}

async fn write_msg(w: &mut tokio::net::tcp::OwnedWriteHalf, enc: &mut FrameEncoder, m: &Message) -> std::io::Result<()> {
    let mut b = Vec::new();
    enc.encode(m, &mut b);
    w.write_all(&b).await
}

/// Why a worker connection closed before it was admitted: the refusal's reason and what
/// to log. `None` for a connection that merely ended.
type NotAdmitted = Option<(Refusal, String)>;

fn not_admitted(e: std::io::Error) -> NotAdmitted {
    match e.into_inner().map(|inner| inner.downcast::<bulkhead_protocol::CodecError>()) {
        Some(Ok(codec)) => {
            crate::wire::count_bad_connection();
            let detail = codec.to_string();
            door::refusal_of(&crate::wire::WireError::Codec(*codec)).map(|r| (r, detail))
        }
        // End of stream, a reset, or an eviction (counted when it happened).
        _ => None,
    }
}

/// The worker's introduction (its `Hello`), read through the gateway's side of the cluster
/// handshake ([`crate::wire::accept_handshake`] is the same over blocking sockets): with a
/// key, the first frame must open a handshake that proves it, and both directions are
/// sealed from then on; without one, it must not. A refusal is sent to the worker.
async fn introduce(
    trust: &Trust,
    peer: Option<std::net::IpAddr>,
    r: &mut tokio::net::tcp::OwnedReadHalf,
    w: &mut tokio::net::tcp::OwnedWriteHalf,
    d: &mut FrameDecoder,
    enc: &mut FrameEncoder,
) -> Result<Hello, NotAdmitted> {
    let first = read_msg(r, d).await.map_err(not_admitted)?;
    let first = match (trust.key.as_deref(), first) {
        (None, Message::AuthHello { .. }) => {
            let reason = crate::wire::NO_KEY_HERE.to_string();
            let _ = write_msg(w, enc, &Message::AuthRefused { reason: reason.clone() }).await;
            crate::wire::count_auth_refusal();
            return Err(Some((Refusal::NoKey, reason)));
        }
        (None, first) => first,
        (Some(key), first) => {
            let nonce = crate::trust::random().map_err(|e| Some((Refusal::Proof, e.to_string())))?;
            let result = match Server::start(key, Purpose::Control, first, trust.wants_encryption(peer), nonce) {
                Ok((server, challenge)) => {
                    write_msg(w, enc, &challenge).await.map_err(|_| None)?;
                    server.finish(read_msg(r, d).await.map_err(not_admitted)?)
                }
                Err(e) => Err(e),
            };
            let session = match result {
                Ok(session) => session,
                Err(e) => {
                    let _ = write_msg(w, enc, &Message::AuthRefused { reason: e.to_string() }).await;
                    crate::wire::count_auth_refusal();
                    let reason = door::refusal_of(&crate::wire::WireError::Auth(e.clone())).unwrap_or(Refusal::Proof);
                    return Err(Some((reason, e.to_string())));
                }
            };
            tracing::info!(?peer, encrypted = session.encrypted, "worker connection authenticated");
            d.open_with(session.recv);
            *enc = FrameEncoder::sealed(session.send);
            read_msg(r, d).await.map_err(not_admitted)?
        }
    };
    match first {
        Message::Hello(hello) => Ok(hello),
        other => {
            crate::wire::count_bad_connection();
            Err(Some((Refusal::Unexpected, format!("the first frame was {}, not Hello", other.kind_name()))))
        }
    }
}

async fn serve_worker(
    s: TcpStream,
    cmds: mpsc::Sender<Cmd>,
    trust: &Trust,
    waiter: Waiter,
    evicted: oneshot::Receiver<()>,
) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let peer = s.peer_addr().ok().map(|a| a.ip());
    let (mut r, mut w) = s.into_split();
    let mut d = FrameDecoder::new(door::PRE_AUTH_MAX_FRAME);
    let mut enc = FrameEncoder::plain();
    let intro = tokio::time::timeout(door::HANDSHAKE_DEADLINE, introduce(trust, peer, &mut r, &mut w, &mut d, &mut enc));
    let outcome = tokio::select! {
        o = intro => o.unwrap_or_else(|_| Err(Some((Refusal::Deadline, crate::wire::WireError::Deadline.to_string())))),
        // Made room for a newer connection (counted then).
        _ = evicted => Err(None),
    };
    let hello = match outcome {
        Ok(hello) => hello,
        Err(Some((reason, detail))) => {
            door::refuse("worker", peer, reason, &detail);
            return Ok(());
        }
        Err(None) => return Ok(()),
    };
    // Admitted: full-size frames, and its place in the waiting room is free.
    drop(waiter);
    d.set_max_frame(DEFAULT_MAX_FRAME);
    let (wtx, mut wrx) = mpsc::channel::<Message>(WORKER_OUTBOX);
    let (reply, answer) = oneshot::channel();
    cmds.send(Cmd::Register { hello, writer: wtx, reply }).await.map_err(|_| std::io::Error::other("gateway stopped"))?;
    let id = match answer.await {
        Ok(Ok(id)) => id,
        Ok(Err(why)) => {
            let reason = why.to_string();
            write_msg(&mut w, &mut enc, &Message::Refuse { reason: reason.clone() }).await?;
            return Err(std::io::Error::other(format!("refused: {reason}")));
        }
        Err(_) => return Err(std::io::Error::other("gateway stopped")),
    };
    tokio::spawn(async move {
        let mut b = Vec::new();
        while let Some(m) = wrx.recv().await {
            b.clear();
            enc.encode(&m, &mut b);
            if w.write_all(&b).await.is_err() {
                return;
            }
        }
    });
    let result = loop {
        match read_msg(&mut r, &mut d).await {
            Ok(msg) => {
                if cmds.send(Cmd::Worker { from: id, msg }).await.is_err() {
                    break Ok(());
                }
            }
            Err(e) => break Err(e),
        }
    };
    let _ = cmds.send(Cmd::Left { id }).await;
    result
}
