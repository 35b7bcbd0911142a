//! The gateway's actor: the one task that owns the protocol's gateway role, the worker
//! connections' outboxes, the client streams and the metrics, so every decision about a
//! request is made in one place, in order.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use bulkhead_api::{ApiError, GenEvent};

use bulkhead_kv::RequestId;
use bulkhead_protocol::gateway::{ClientOutput, GatewayAction, GatewayEvent, GatewayRole, QUEUE_WAIT_BUCKETS, RegisterError, request_id};
use bulkhead_protocol::{FailReason, GatewayId, Hello, Message, MetricFamily, RejectReason, Role, WorkerId};
use tokio::sync::mpsc;

use bulkhead_transport::metrics::{self, Families, Finish, RequestMetrics};

use crate::inbox::{Cmd, WORKER_OUTBOX};
use crate::shared::{Shared, count};

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

pub(crate) struct Actor {
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
    /// The actor of gateway `gateway_id` over `role`, numbering its requests from `first`.
    pub(crate) fn new(role: GatewayRole, shared: Arc<Shared>, gateway_id: GatewayId, first: u64) -> Actor {
        Actor {
            role,
            shared,
            writers: BTreeMap::new(),
            workers: BTreeMap::new(),
            clients: BTreeMap::new(),
            gateway_id,
            next_req: first,
            registered: [0, 0],
            requests: RequestMetrics::default(),
            tenants: BTreeMap::new(),
        }
    }

    pub(crate) async fn run(mut self, mut inbox: mpsc::Receiver<Cmd>) {
        while let Some(cmd) = inbox.recv().await {
            match cmd {
                Cmd::Submit { submission, arrived, events, prompt_param } => {
                    let req = request_id(self.gateway_id, self.next_req);
                    self.next_req += 1;
                    let client = Client {
                        events,
                        prompt_tokens: submission.tokens.len(),
                        max_tokens: submission.max_tokens as usize,
                        arrived,
                        first_token: None,
                        last_token: None,
                        prompt_param,
                        tenant: Arc::from(submission.trace.tenant.as_str()),
                    };
                    self.clients.insert(req, client);
                    self.apply(GatewayEvent::Submit { req, submission });
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
