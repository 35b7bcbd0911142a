//! The gateway's per-request state machine: admission, routing to one decode and one
//! prefill worker, and exactly one terminal outcome per request to the client (I3).
//!
//! Lifecycle: `Reserving` (Reserve sent to decode) → `Prefilling` (Prefill sent) →
//! `Decoding` (tokens flowing) → terminal. A request leaves the table at its terminal
//! outcome; anything arriving for it afterwards is ignored, so a second terminal outcome
//! cannot reach the client.

use std::collections::BTreeMap;

use bulkhead_kv::RequestId;

use crate::admission::{admit, Generate};
use crate::msg::*;

/// Limits of the gateway.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// The model's context. The served context is this or the smallest any registered
    /// worker accepts, whichever is smaller (I5).
    pub model_context: usize,
    /// Digest of the model file; a worker serving another model is refused.
    pub model_digest: u64,
    /// Whether the gateway checks the context limit itself (tests turn it off to show the
    /// workers' own admission holds).
    pub admission_check: bool,
    /// A request not finished after this long fails.
    pub request_timeout_ms: u64,
}

/// What happened at the gateway.
#[derive(Debug)]
pub enum GatewayEvent {
    /// A client asked for a generation.
    Submit { req: RequestId, tokens: Vec<u32>, max_tokens: u32, sampling: Sampling, stop: Vec<String>, trace: TraceContext },
    /// The client went away.
    ClientGone { req: RequestId },
    /// A worker sent a message.
    FromWorker { from: WorkerId, msg: Message },
    /// A worker's connection closed.
    WorkerLeft { id: WorkerId },
    /// The clock moved.
    Tick { now_ms: u64 },
}

/// The one terminal outcome of a request, or a streamed token.
#[derive(Clone, Debug, PartialEq)]
pub enum ClientOutput {
    /// Text released by one generated token.
    Token { text: String },
    /// Ended normally.
    Finished { finish: FinishReason, text: String, prompt_tokens: u32, completion_tokens: u32 },
    /// Refused before running (over-context: HTTP 400).
    Rejected { reason: RejectReason, detail: String },
    /// Failed while running.
    Failed { reason: FailReason, detail: String },
    /// No worker of a needed role is available.
    Unavailable,
}

impl ClientOutput {
    /// Whether this ends the request.
    pub fn is_terminal(&self) -> bool {
        !matches!(self, ClientOutput::Token { .. })
    }
}

/// What the driver must do.
#[derive(Debug, PartialEq)]
pub enum GatewayAction {
    /// Send to a worker.
    ToWorker { to: WorkerId, msg: Message },
    /// Deliver to the client of `req`.
    ToClient { req: RequestId, out: ClientOutput },
}

/// Where a request stands at the gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// `Reserve` sent to the decode worker; no `Prefill` sent yet.
    Reserving,
    /// `Prefill` sent; no token yet.
    Prefilling,
    /// Tokens flowing.
    Decoding,
}

/// The KV layout every worker of one gateway must share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    /// Tokens per page.
    pub page_size: u32,
    /// KV bytes per token.
    pub kv_bytes_per_token: u32,
}

/// Why a worker was refused at registration.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    /// It serves another model file.
    #[error("model digest {worker:#x} differs from the gateway's {gateway:#x}")]
    Model { worker: u64, gateway: u64 },
    /// Its KV layout differs from the workers already registered.
    #[error(
        "KV layout (page size {}, {} bytes/token) differs from the registered workers' ({}, {})",
        worker.page_size, worker.kv_bytes_per_token, registered.page_size, registered.kv_bytes_per_token
    )]
    Layout { worker: KvShape, registered: KvShape },
    /// The id is taken.
    #[error("{0} is already registered")]
    Duplicate(WorkerId),
}

/// A registered worker.
#[derive(Clone, Debug)]
struct Member {
    role: Role,
    max_context: usize,
    kv_addr: String,
}

#[derive(Debug)]
struct InFlight {
    phase: Phase,
    decode: WorkerId,
    prefill: WorkerId,
    tokens: Vec<u32>,
    sampling: Sampling,
    trace: TraceContext,
    deadline_ms: u64,
}

/// Counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GatewayStats {
    /// Requests submitted.
    pub submitted: u64,
    /// Refused by the gateway's own admission check.
    pub rejected_at_gateway: u64,
    /// Refused by a worker.
    pub rejected_by_worker: u64,
    /// Finished normally.
    pub finished: u64,
    /// Failed while running.
    pub failed: u64,
    /// Ended because the client left.
    pub client_gone: u64,
}

/// The gateway's protocol state.
#[derive(Debug)]
pub struct GatewayRole {
    cfg: GatewayConfig,
    now_ms: u64,
    /// The served context (see [`GatewayConfig::model_context`]).
    max_context: usize,
    /// The layout of the first registered worker, which every later one must share.
    shape: Option<KvShape>,
    members: BTreeMap<WorkerId, Member>,
    prefills: Vec<WorkerId>,
    decodes: Vec<WorkerId>,
    next_pick: usize,
    inflight: BTreeMap<RequestId, InFlight>,
    stats: GatewayStats,
}

impl GatewayRole {
    /// A gateway with no workers.
    pub fn new(cfg: GatewayConfig) -> Self {
        GatewayRole {
            max_context: cfg.model_context,
            cfg,
            now_ms: 0,
            shape: None,
            members: BTreeMap::new(),
            prefills: Vec::new(),
            decodes: Vec::new(),
            next_pick: 0,
            inflight: BTreeMap::new(),
            stats: GatewayStats::default(),
        }
    }

    /// Counters.
    pub fn stats(&self) -> GatewayStats {
        self.stats
    }

    /// The served context: the model's, or the smallest any registered worker accepts.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Where `req` stands, if it is in flight.
    pub fn phase_of(&self, req: RequestId) -> Option<Phase> {
        self.inflight.get(&req).map(|f| f.phase)
    }

    /// Registered workers of `role`, in the order they joined.
    pub fn workers(&self, role: Role) -> &[WorkerId] {
        match role {
            Role::Prefill => &self.prefills,
            Role::Decode => &self.decodes,
        }
    }

    /// Register worker `id` (the driver names it) from its `Hello`: refused if it serves
    /// another model or KV layout. On success: its `Welcome`, and the introductions that
    /// let prefill workers open KV connections to decode workers (`DecodePeer`).
    pub fn join(&mut self, id: WorkerId, hello: &Hello) -> Result<Vec<GatewayAction>, RegisterError> {
        if hello.model_digest != self.cfg.model_digest {
            return Err(RegisterError::Model { worker: hello.model_digest, gateway: self.cfg.model_digest });
        }
        let worker = KvShape { page_size: hello.page_size, kv_bytes_per_token: hello.kv_bytes_per_token };
        match self.shape {
            Some(registered) if registered != worker => return Err(RegisterError::Layout { worker, registered }),
            _ => {}
        }
        if self.members.contains_key(&id) {
            return Err(RegisterError::Duplicate(id));
        }
        self.shape = Some(worker);
        let mut out = vec![GatewayAction::ToWorker { to: id, msg: Message::Welcome { worker: id } }];
        match hello.role {
            Role::Prefill => {
                for (&d, m) in self.members.iter().filter(|(_, m)| m.role == Role::Decode) {
                    out.push(GatewayAction::ToWorker { to: id, msg: Message::DecodePeer { worker: d, addr: m.kv_addr.clone() } });
                }
                self.prefills.push(id);
            }
            Role::Decode => {
                for &p in &self.prefills {
                    out.push(GatewayAction::ToWorker { to: p, msg: Message::DecodePeer { worker: id, addr: hello.kv_addr.clone() } });
                }
                self.decodes.push(id);
            }
        }
        let member = Member { role: hello.role, max_context: hello.max_context as usize, kv_addr: hello.kv_addr.clone() };
        self.members.insert(id, member);
        self.update_context();
        Ok(out)
    }

    /// The served context is the smallest any worker accepts (I5).
    fn update_context(&mut self) {
        let workers = self.members.values().map(|m| m.max_context).min();
        self.max_context = workers.unwrap_or(self.cfg.model_context).min(self.cfg.model_context);
    }

    /// Requests not yet terminal.
    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// Whether at least one worker of each role is registered.
    pub fn ready(&self) -> bool {
        !self.prefills.is_empty() && !self.decodes.is_empty()
    }

    /// Process one event.
    pub fn handle(&mut self, ev: GatewayEvent) -> Vec<GatewayAction> {
        let mut out = Vec::new();
        match ev {
            GatewayEvent::Submit { req, tokens, max_tokens, sampling, stop, trace } => {
                self.stats.submitted += 1;
                if self.cfg.admission_check
                    && let Err(refusal) = admit(tokens.len(), Generate::Tokens(max_tokens as usize), self.max_context)
                {
                    // Rejected before any Reserve (I3, I5).
                    self.stats.rejected_at_gateway += 1;
                    return vec![Self::reject(req, refusal.reason(), refusal.to_string())];
                }
                if !self.ready() || self.inflight.contains_key(&req) {
                    out.push(GatewayAction::ToClient { req, out: ClientOutput::Unavailable });
                    return out;
                }
                self.next_pick = self.next_pick.wrapping_add(1);
                let decode = self.decodes[self.next_pick % self.decodes.len()];
                let prefill = self.prefills[self.next_pick % self.prefills.len()];
                let prompt_tokens = tokens.len() as u32;
                out.push(GatewayAction::ToWorker {
                    to: decode,
                    msg: Message::Reserve { req, prompt_tokens, max_tokens, prefill, sampling: sampling.clone(), stop, trace: trace.clone() },
                });
                let deadline_ms = self.now_ms.saturating_add(self.cfg.request_timeout_ms);
                self.inflight.insert(req, InFlight { phase: Phase::Reserving, decode, prefill, tokens, sampling, trace, deadline_ms });
            }
            GatewayEvent::ClientGone { req } => {
                if let Some(f) = self.inflight.remove(&req) {
                    self.stats.client_gone += 1;
                    Self::abort_workers(req, &f, AbortReason::ClientGone, None, &mut out);
                }
            }
            GatewayEvent::FromWorker { from, msg } => self.on_worker(from, msg, &mut out),
            GatewayEvent::WorkerLeft { id } => {
                let Some(left) = self.members.remove(&id) else { return out };
                self.prefills.retain(|w| *w != id);
                self.decodes.retain(|w| *w != id);
                self.update_context();
                if left.role == Role::Prefill {
                    // A decode worker it never connected to has no other way to learn that
                    // it can no longer write there (its quarantines would never end).
                    // Found by the fault schedules.
                    for &to in &self.decodes {
                        out.push(GatewayAction::ToWorker { to, msg: Message::PrefillUnreachable { worker: id } });
                    }
                }
                let lost: Vec<RequestId> = self.inflight.iter().filter(|(_, f)| f.decode == id || f.prefill == id).map(|(r, _)| *r).collect();
                for req in lost {
                    self.fail(req, FailReason::WorkerLost, format!("{id} went away"), Some(id), &mut out);
                }
            }
            GatewayEvent::Tick { now_ms } => {
                self.now_ms = now_ms;
                let late: Vec<RequestId> = self.inflight.iter().filter(|(_, f)| f.deadline_ms <= now_ms).map(|(r, _)| *r).collect();
                for req in late {
                    self.fail(req, FailReason::Timeout, "request timed out".into(), None, &mut out);
                }
            }
        }
        out
    }

    /// Refuse `req` before anything was reserved for it (I3).
    fn reject(req: RequestId, reason: RejectReason, detail: String) -> GatewayAction {
        GatewayAction::ToClient { req, out: ClientOutput::Rejected { reason, detail } }
    }

    fn abort_workers(req: RequestId, f: &InFlight, reason: AbortReason, except: Option<WorkerId>, out: &mut Vec<GatewayAction>) {
        if f.phase == Phase::Reserving {
            // No Prefill was sent: no worker can write the reservation, so the decode
            // worker may release it at once instead of waiting for a fence.
            if Some(f.decode) != except {
                out.push(GatewayAction::ToWorker { to: f.decode, msg: Message::Cancel { req } });
            }
            return;
        }
        for to in [f.decode, f.prefill].into_iter().filter(|t| Some(*t) != except) {
            out.push(GatewayAction::ToWorker { to, msg: Message::Abort { req, reason } });
        }
    }

    fn fail(&mut self, req: RequestId, reason: FailReason, detail: String, except: Option<WorkerId>, out: &mut Vec<GatewayAction>) {
        if let Some(f) = self.inflight.remove(&req) {
            self.stats.failed += 1;
            Self::abort_workers(req, &f, AbortReason::Failed, except, out);
            out.push(GatewayAction::ToClient { req, out: ClientOutput::Failed { reason, detail } });
        }
    }

    fn on_worker(&mut self, from: WorkerId, msg: Message, out: &mut Vec<GatewayAction>) {
        // A prefill lost its KV connection to `decode` (or never had one): the decode worker
        // must not wait for fences from it.
        if let Message::KvLost { decode } = msg {
            if self.decodes.contains(&decode) {
                out.push(GatewayAction::ToWorker { to: decode, msg: Message::PrefillUnreachable { worker: from } });
            }
            return;
        }
        let Some(req) = msg.req() else { return };
        let Some(f) = self.inflight.get_mut(&req) else { return };
        // Only the workers assigned to a request speak for it.
        if from != f.decode && from != f.prefill {
            return;
        }
        match msg {
            Message::Reserved { pages, .. } if f.phase == Phase::Reserving && from == f.decode => {
                f.phase = Phase::Prefilling;
                out.push(GatewayAction::ToWorker {
                    to: f.prefill,
                    msg: Message::Prefill {
                        req,
                        tokens: std::mem::take(&mut f.tokens),
                        decode: f.decode,
                        pages,
                        sampling: f.sampling.clone(),
                        trace: f.trace.clone(),
                    },
                });
            }
            Message::Token { text, .. } if from == f.decode => {
                f.phase = Phase::Decoding;
                out.push(GatewayAction::ToClient { req, out: ClientOutput::Token { text } });
            }
            Message::Finished { finish, text, prompt_tokens, completion_tokens, .. } if from == f.decode => {
                self.inflight.remove(&req);
                self.stats.finished += 1;
                out.push(GatewayAction::ToClient { req, out: ClientOutput::Finished { finish, text, prompt_tokens, completion_tokens } });
            }
            Message::Rejected { reason, detail, .. } => {
                if let Some(f) = self.inflight.remove(&req) {
                    self.stats.rejected_by_worker += 1;
                    // A prefill rejection leaves a reservation on the decode worker.
                    if from == f.prefill {
                        out.push(GatewayAction::ToWorker { to: f.decode, msg: Message::Abort { req, reason: AbortReason::Failed } });
                    }
                    out.push(Self::reject(req, reason, detail));
                }
            }
            Message::Failed { reason, detail, .. } => self.fail(req, reason, detail, Some(from), out),
            _ => {}
        }
    }
}
