//! The prefill worker's protocol state machine: its queue of jobs, its KV connections to
//! decode workers, and what ends a job.
//!
//! I3: a job refused at admission or aborted is answered (to the gateway and, with
//! `Fenced`, to the decode worker waiting for it) and never computed or transferred
//! afterwards; a running job stops at the next chunk boundary. Several jobs may run at
//! once (the driver batches their chunks); each is tracked on its own. Every job ends with exactly
//! one final message to its decode worker: `Done` or `Fenced`.
//!
//! Link liveness is part of the protocol: on every [`PrefillEvent::Tick`] past the
//! keepalive interval the role sends `KvKeepalive` on each open KV connection, because a
//! decode worker fails a reservation whose prefill stays silent for its transfer timeout.
//! A KV connection that is lost (or cannot be opened) to a decode worker that is still in
//! the cluster is not opened again under this worker's identity: after [`REJOIN_AFTER_MS`]
//! (unless the gateway says meanwhile that the decode worker left, `PeerLeft`) the role
//! asks the driver to rejoin, that is to leave the cluster and register anew under a new
//! worker id. A decode worker fences a prefill worker for good when its connection closes,
//! or when it leaves; a writer that came back under the same id could write into a
//! reservation that was released on that fence (I4). Under a new id it only ever gets
//! reservations made for it.

use bulkhead_fingerprint::Fingerprint;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bulkhead_kv::{KvError, PageRef, RequestId};

use crate::admission::{Generate, admit};
use crate::cache::CacheScope;
use crate::gateway::gateway_of;
use crate::msg::*;

/// Limits of a prefill worker.
#[derive(Clone, Debug, Fingerprint)]
pub struct PrefillConfig {
    /// Longest prompt admitted: the model's context and the KV pool's capacity, whichever
    /// is smaller (the incident's prefill pool was smaller than the advertised context).
    pub max_prompt: usize,
    /// Tokens per KV page (the decode worker's must match).
    pub page_size: usize,
    /// How often each open KV connection carries a frame, a `KvKeepalive` if nothing else.
    pub keepalive_ms: u64,
}

impl PrefillConfig {
    /// The keepalive interval for decode workers whose transfer timeout is
    /// `transfer_timeout_ms`: several keepalives per timeout, at most one a second.
    pub fn keepalive_for(transfer_timeout_ms: u64) -> u64 {
        (transfer_timeout_ms / 4).clamp(10, 1_000)
    }
}

/// A prompt to compute and send.
#[derive(Clone, Debug, PartialEq, Fingerprint)]
pub struct PrefillJob {
    /// The request.
    pub req: RequestId,
    /// Prompt tokens.
    pub tokens: Vec<u32>,
    /// Decode worker receiving the KV.
    pub decode: WorkerId,
    /// Leading prompt tokens the decode worker holds already (a multiple of the page
    /// size): they are computed here if need be but never sent.
    pub held: u32,
    /// Its pages for the prompt past `held`, in order.
    pub pages: Vec<PageRef>,
    /// How to pick the first token.
    pub sampling: Sampling,
    /// Sampling draws made before this job (a retracted request's tokens).
    pub skip_draws: u32,
    /// Where the request came from, for the worker's logs.
    pub trace: TraceContext,
    /// Its prefix-cache scope (tenant and salt), if it may use the cache.
    pub cache: Option<CacheScope>,
}

/// Why the driver could not finish a job.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PrefillFailure {
    /// The prefill worker's own pool had no room for the prompt.
    #[error("no room in the prefill KV pool: {0}")]
    NoPages(KvError),
    /// The computed KV could not be exported.
    #[error("exporting KV chunks: {0}")]
    Export(KvError),
    /// The model failed.
    #[error("model: {0}")]
    Compute(String),
    /// The model computed the last chunk without producing a first token.
    #[error("no first token after the last chunk")]
    NoFirstToken,
    /// The prefix cache's lookup was refused (I7: a page of another tenant or salt).
    #[error("prefix cache: {0}")]
    Cache(KvError),
}

/// How the driver's work on a job ended.
#[derive(Clone, Debug, PartialEq)]
pub enum JobOutcome {
    /// All chunks sent.
    /// `cached`: the leading prompt tokens taken from the prefix cache.
    Done { tokens: u32, first_token: u32, first_logprobs: Option<TokenLogprobs>, manifest: u64, cached: u32 },
    /// Stopped early because [`PrefillRole::keep_going`] said so.
    Stopped,
    /// The job could not be finished.
    Failed(PrefillFailure),
}

/// Something that happened to the prefill worker.
#[derive(Debug)]
pub enum PrefillEvent {
    /// A message from gateway `from`.
    Gateway { from: GatewayId, msg: Message },
    /// A message on the KV connection from decode worker `from` (it asks to stop a transfer).
    Decode { from: WorkerId, msg: Message },
    /// The KV connection to `decode` is open (its `KvHello` went out).
    DecodeConnected { decode: WorkerId },
    /// The KV connection to `decode` closed, or could not be opened: nothing more reaches it.
    DecodeLost { decode: WorkerId },
    /// The connection to gateway `gateway` closed: its clients are gone with it, so its
    /// jobs here end as its aborts would have ended them.
    GatewayLost { gateway: GatewayId },
    /// The clock moved.
    Tick { now_ms: u64 },
}

/// What the driver must do.
#[derive(Debug, PartialEq)]
pub enum PrefillAction {
    /// Send to the gateway.
    ToGateway(Message),
    /// Send on the KV connection to a decode worker (dropped if there is none).
    ToDecode { to: WorkerId, msg: Message },
    /// Open a KV connection to decode worker `decode` at `addr`, send `KvHello` first, and
    /// report [`PrefillEvent::DecodeConnected`] or [`PrefillEvent::DecodeLost`].
    Connect { decode: WorkerId, addr: String },
    /// Leave the cluster (close the gateway connection and every KV connection) and
    /// register anew, as a new worker (see the module docs).
    Rejoin,
}

/// Evidence counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefillStats {
    /// Jobs admitted.
    pub admitted: u64,
    /// Jobs refused: prompt over the limit.
    pub rejected_context: u64,
    /// Jobs refused: malformed.
    pub rejected_invalid: u64,
    /// Jobs aborted before or while running.
    pub aborted: u64,
    /// Jobs completed.
    pub completed: u64,
    /// Keepalives sent.
    pub keepalives: u64,
    /// KV connections lost, or that could not be opened.
    pub connections_lost: u64,
    /// Requests a decode worker gave up before their job arrived here, fenced at once and
    /// refused if the job comes later.
    pub fenced_unknown: u64,
}

/// Most requests [`PrefillRole`] remembers as fenced before their job arrived; past that,
/// a decode worker's abort of an unknown job gets no fence (its pages stay quarantined
/// until this worker's KV connection closes, as without the tombstones).
pub const MAX_TOMBSTONES: usize = 1 << 16;

/// How long after losing a KV connection to a decode worker the role asks to rejoin,
/// unless the gateway says meanwhile that the decode worker left (then its loss was
/// expected). The driver adds its own backoff when rejoins follow each other quickly.
pub const REJOIN_AFTER_MS: u64 = 500;

/// The KV connection to a decode worker this prefill worker was introduced to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
enum Link {
    /// The driver is opening it.
    Opening,
    /// Open.
    Open,
    /// Lost while the decode worker is still in the cluster: rejoin at `at_ms`.
    Lost { at_ms: u64 },
    /// Every gateway that introduced it said it left, while its connection was still
    /// open (or opening): no job goes to it, and its loss is expected. A gateway may
    /// introduce it again (it left only the others; several gateways): the connection
    /// serves again, and no second one is opened.
    Departed { open: bool },
}

/// A job being computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
struct Running {
    req: RequestId,
    decode: WorkerId,
    /// Aborted (or its decode worker lost) while computing: it stops at the next chunk.
    aborted: bool,
}

/// The prefill worker's protocol state.
#[derive(Debug, Fingerprint)]
pub struct PrefillRole {
    cfg: PrefillConfig,
    #[fingerprint(clock)]
    now_ms: u64,
    #[fingerprint(clock)]
    last_keepalive_ms: u64,
    queue: VecDeque<PrefillJob>,
    /// Jobs taken and not yet ended, in the order they were taken.
    running: Vec<Running>,
    /// Decode workers known, and the state of the KV connection to each.
    peers: BTreeMap<WorkerId, Link>,
    /// The gateways that introduced each decode worker (`DecodePeer`) and have not said
    /// it left them (`PeerLeft`).
    named_by: BTreeMap<WorkerId, BTreeSet<GatewayId>>,
    /// A rejoin was asked for: the role takes nothing more.
    rejoining: bool,
    /// Requests a decode worker aborted before their job arrived here: each was answered
    /// with its fence, so its job is refused if it still comes (its pages may be another
    /// request's by then). Request ids are never reused.
    tombstones: BTreeSet<RequestId>,
    #[fingerprint(skip)]
    stats: PrefillStats,
}

impl PrefillRole {
    /// An idle prefill role with no KV connection.
    pub fn new(cfg: PrefillConfig) -> Self {
        PrefillRole {
            cfg,
            now_ms: 0,
            last_keepalive_ms: 0,
            queue: VecDeque::new(),
            running: Vec::new(),
            peers: BTreeMap::new(),
            named_by: BTreeMap::new(),
            rejoining: false,
            tombstones: BTreeSet::new(),
            stats: PrefillStats::default(),
        }
    }

    /// Counters.
    pub fn stats(&self) -> PrefillStats {
        self.stats
    }

    /// Jobs waiting.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// The jobs waiting, in order.
    pub fn queued_jobs(&self) -> impl Iterator<Item = &PrefillJob> {
        self.queue.iter()
    }

    /// The requests being computed, in the order they were taken.
    pub fn running(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.running.iter().map(|r| r.req)
    }

    /// Whether a job is being computed.
    pub fn busy(&self) -> bool {
        !self.running.is_empty()
    }

    /// Whether `req` is queued or running here.
    pub fn has_job(&self, req: RequestId) -> bool {
        self.running().any(|r| r == req) || self.queue.iter().any(|j| j.req == req)
    }

    /// Whether `req` was fenced here before its job arrived: the job is refused when it
    /// does (see [`PrefillRole`]'s abort of an unknown job).
    pub fn tombstoned(&self, req: RequestId) -> bool {
        self.tombstones.contains(&req)
    }

    /// Whether the KV connection to `decode` is open.
    pub fn connected(&self, decode: WorkerId) -> bool {
        self.peers.get(&decode) == Some(&Link::Open)
    }

    /// Whether a lost KV connection will make this worker rejoin (its ticks matter).
    pub fn rejoin_pending(&self) -> bool {
        !self.rejoining && self.peers.values().any(|l| matches!(l, Link::Lost { .. }))
    }

    /// Process one event.
    pub fn handle(&mut self, ev: PrefillEvent) -> Vec<PrefillAction> {
        let mut out = Vec::new();
        match ev {
            // One KV connection per decode worker, however many gateways introduce it.
            PrefillEvent::Gateway { from, msg: Message::DecodePeer { worker, addr } } => {
                let named_by = self.named_by.entry(worker).or_default();
                named_by.insert(from);
                match self.peers.get(&worker) {
                    // Lost: the decode worker fenced everything of this id, which must not
                    // write there again (another gateway's introduction, arriving late);
                    // the rejoin under a new id is on its way.
                    Some(Link::Opening | Link::Open | Link::Lost { .. }) => {}
                    Some(Link::Departed { open }) => {
                        let link = if *open { Link::Open } else { Link::Opening };
                        self.peers.insert(worker, link);
                    }
                    None => {
                        self.peers.insert(worker, Link::Opening);
                        out.push(PrefillAction::Connect { decode: worker, addr });
                    }
                }
            }
            // It left gateway `from`; while another gateway still names it, the KV
            // connection serves that gateway's requests (it left only `from`).
            PrefillEvent::Gateway { from, msg: Message::PeerLeft { worker } } => {
                let named_by = self.named_by.entry(worker).or_default();
                named_by.remove(&from);
                if named_by.is_empty() {
                    self.named_by.remove(&worker);
                    match self.peers.get(&worker) {
                        Some(Link::Open) => self.peers.insert(worker, Link::Departed { open: true }),
                        Some(Link::Opening) => self.peers.insert(worker, Link::Departed { open: false }),
                        _ => self.peers.remove(&worker),
                    };
                    self.fail_jobs_for(worker, "decode worker left", &mut out);
                }
            }
            PrefillEvent::Gateway {
                msg: Message::Prefill { req, tokens, decode, held, pages, sampling, skip_draws, trace, cache },
                ..
            } => {
                self.admit(PrefillJob { req, tokens, decode, held, pages, sampling, skip_draws, trace, cache }, &mut out);
            }
            // The gateway ends a request: it knows whether it sent the job.
            PrefillEvent::Gateway { msg: Message::Abort { req, .. }, .. } => self.abort(req, None, &mut out),
            // A decode worker asks to stop a transfer (it refused a chunk, timed out, or lost
            // the request's gateway); it waits for this worker's fence.
            PrefillEvent::Decode { from, msg: Message::Abort { req, .. } } => self.abort(req, Some(from), &mut out),
            PrefillEvent::GatewayLost { gateway } => {
                // The decode workers it introduced stay: they serve the other gateways.
                self.named_by.values_mut().for_each(|by| {
                    by.remove(&gateway);
                });
                let reqs: Vec<RequestId> = self.queue.iter().map(|j| j.req).chain(self.running()).collect();
                for req in reqs.into_iter().filter(|r| gateway_of(*r) == gateway) {
                    self.abort(req, None, &mut out);
                }
            }
            PrefillEvent::Gateway { .. } | PrefillEvent::Decode { .. } => {}
            PrefillEvent::DecodeConnected { decode } => {
                let link = match self.peers.get(&decode) {
                    Some(Link::Departed { .. }) => Link::Departed { open: true },
                    _ => Link::Open,
                };
                self.peers.insert(decode, link);
            }
            PrefillEvent::DecodeLost { decode } => self.decode_lost(decode, &mut out),
            PrefillEvent::Tick { now_ms } => {
                self.now_ms = self.now_ms.max(now_ms);
                let now = self.now_ms;
                if now >= self.last_keepalive_ms.saturating_add(self.cfg.keepalive_ms) {
                    self.last_keepalive_ms = now;
                    for (&to, _) in self.peers.iter().filter(|(_, l)| **l == Link::Open) {
                        self.stats.keepalives += 1;
                        out.push(PrefillAction::ToDecode { to, msg: Message::KvKeepalive });
                    }
                }
                if self.rejoin_pending() && self.peers.values().any(|l| matches!(l, Link::Lost { at_ms } if *at_ms <= now)) {
                    self.rejoin(&mut out);
                }
            }
        }
        out
    }

    /// Worker-side admission (I3, I5): terminal, before any compute or transfer.
    fn admit(&mut self, job: PrefillJob, out: &mut Vec<PrefillAction>) {
        let (req, decode) = (job.req, job.decode);
        if self.tombstones.remove(&req) {
            // Its decode worker gave it up and has its fence: nothing may be written.
            self.stats.aborted += 1;
            return;
        }
        if self.has_job(req) {
            // About the message, not the request: the original job goes on, so no fence.
            let why = format!("request {req} is already queued or running here");
            return self.reject(req, RejectReason::Duplicate, why, None, out);
        }
        if let Err(refusal) = admit(job.tokens.len(), Generate::Elsewhere, self.cfg.max_prompt) {
            return self.reject(req, refusal.reason(), format!("{refusal} (prefill worker)"), Some(decode), out);
        }
        if self.rejoining || !matches!(self.peers.get(&decode), Some(Link::Open | Link::Opening)) {
            // No KV connection to it and none coming under this identity: the decode worker
            // hears of this worker's absence from the gateway (`PrefillUnreachable`).
            let detail = format!("no KV connection to {decode}");
            return out.push(PrefillAction::ToGateway(Message::Failed { req, reason: FailReason::WorkerLost, detail }));
        }
        let (n, held, ps) = (job.tokens.len(), job.held as usize, self.cfg.page_size);
        // The decode worker holds whole pages, and never the last position (its logits pick
        // the first token, so it is always computed and sent).
        if held % ps != 0 || held >= n {
            let why = format!("{held} held tokens of a {n}-token prompt with pages of {ps}");
            return self.reject(req, RejectReason::Invalid, why, Some(decode), out);
        }
        let want = (n - held).div_ceil(ps);
        if job.pages.len() != want {
            let why = format!("{} tokens past {held} held need {want} target pages, {} were given", n - held, job.pages.len());
            return self.reject(req, RejectReason::Invalid, why, Some(decode), out);
        }
        self.stats.admitted += 1;
        self.queue.push_back(job);
    }

    /// Refuse `req`: the gateway hears why, and the decode worker holding its reservation
    /// (if the refusal is about the request) gets its fence, since nothing will be written.
    fn reject(&mut self, req: RequestId, reason: RejectReason, detail: String, fence: Option<WorkerId>, out: &mut Vec<PrefillAction>) {
        match reason {
            RejectReason::ContextLength => self.stats.rejected_context += 1,
            RejectReason::Capacity | RejectReason::Duplicate | RejectReason::Invalid => self.stats.rejected_invalid += 1,
        }
        out.push(PrefillAction::ToGateway(Message::Rejected { req, reason, detail }));
        if let Some(to) = fence {
            out.push(PrefillAction::ToDecode { to, msg: Message::Fenced { req } });
        }
    }

    /// End `req` here: a queued job is fenced at once, a running one stops at its next
    /// chunk. A job not here, aborted by decode worker `by`, is fenced too and refused if
    /// it arrives later: the decode worker cannot tell a job still on its way from one
    /// that never will be (its gateway was lost), and must not wait for ever.
    fn abort(&mut self, req: RequestId, by: Option<WorkerId>, out: &mut Vec<PrefillAction>) {
        if let Some(i) = self.queue.iter().position(|j| j.req == req) {
            if let Some(j) = self.queue.remove(i) {
                self.stats.aborted += 1;
                out.push(PrefillAction::ToDecode { to: j.decode, msg: Message::Fenced { req } });
            }
        } else if let Some(r) = self.running.iter_mut().find(|r| r.req == req) {
            r.aborted = true;
        } else if let Some(decode) = by
            && self.tombstones.len() < MAX_TOMBSTONES
        {
            self.tombstones.insert(req);
            self.stats.fenced_unknown += 1;
            out.push(PrefillAction::ToDecode { to: decode, msg: Message::Fenced { req } });
        }
    }

    /// Nothing reaches `decode` any more: its queued jobs fail (the decode worker released
    /// their reservations when the connection closed), a running one stops, the gateway
    /// hears of it (the decode worker may wait for a fence from this worker that it must
    /// now get from the gateway, as `PrefillUnreachable`), and unless the decode worker
    /// left, this worker rejoins after [`REJOIN_AFTER_MS`].
    fn decode_lost(&mut self, decode: WorkerId, out: &mut Vec<PrefillAction>) {
        self.stats.connections_lost += 1;
        out.push(PrefillAction::ToGateway(Message::KvLost { decode }));
        self.fail_jobs_for(decode, "decode worker connection closed", out);
        let at_ms = self.now_ms.saturating_add(REJOIN_AFTER_MS);
        match self.peers.get(&decode) {
            // It left: its loss was expected.
            Some(Link::Departed { .. }) => {
                self.peers.remove(&decode);
            }
            Some(_) => {
                self.peers.insert(decode, Link::Lost { at_ms });
            }
            None => {}
        }
    }

    /// Leave the cluster to come back under a new id: every queued job fails (the gateway
    /// sends each elsewhere or fails it), a running one stops, and nothing more is taken.
    fn rejoin(&mut self, out: &mut Vec<PrefillAction>) {
        self.rejoining = true;
        let decodes: Vec<WorkerId> = self.peers.keys().copied().collect();
        for decode in decodes {
            self.fail_jobs_for(decode, "the prefill worker rejoins the cluster", out);
        }
        out.push(PrefillAction::Rejoin);
    }

    /// The jobs for `decode` cannot be delivered: queued ones fail, running ones stop.
    fn fail_jobs_for(&mut self, decode: WorkerId, why: &str, out: &mut Vec<PrefillAction>) {
        self.queue.retain(|j| {
            if j.decode != decode {
                return true;
            }
            let detail = why.to_string();
            out.push(PrefillAction::ToGateway(Message::Failed { req: j.req, reason: FailReason::WorkerLost, detail }));
            false
        });
        for r in self.running.iter_mut().filter(|r| r.decode == decode) {
            r.aborted = true;
        }
    }

    /// Take the next job to compute: the first in the queue whose KV connection is open
    /// (the others wait for theirs to open) and that the driver does not `defer` (a job
    /// that will find its prefix in the cache once a running job ends), if `take` accepts
    /// it (the driver asks whether its pages fit beside the jobs already running). A
    /// deferred job may be overtaken; one that `take` refuses is not.
    pub fn next_job_if(&mut self, defer: impl Fn(&PrefillJob) -> bool, take: impl FnOnce(&PrefillJob) -> bool) -> Option<PrefillJob> {
        let i = self.queue.iter().position(|j| self.connected(j.decode) && !defer(j))?;
        if !take(&self.queue[i]) {
            return None;
        }
        let j = self.queue.remove(i)?;
        self.running.push(Running { req: j.req, decode: j.decode, aborted: false });
        Some(j)
    }

    /// [`PrefillRole::next_job_if`] deferring none and accepting any job.
    pub fn next_job(&mut self) -> Option<PrefillJob> {
        self.next_job_if(|_| false, |_| true)
    }

    /// Put the running job `job` back at the head of the queue, untouched: the driver
    /// took it but could not lease its pages while other jobs hold theirs. An aborted one
    /// ends instead (returns its `Fenced`), as if it had been aborted while queued.
    pub fn requeue(&mut self, job: PrefillJob) -> Vec<PrefillAction> {
        let Some(i) = self.running.iter().position(|r| r.req == job.req) else { return Vec::new() };
        let r = self.running.remove(i);
        if r.aborted || !self.connected(r.decode) {
            self.stats.aborted += 1;
            return vec![PrefillAction::ToDecode { to: r.decode, msg: Message::Fenced { req: r.req } }];
        }
        self.queue.push_front(job);
        Vec::new()
    }

    /// Whether a queued job can be taken now.
    pub fn has_ready_job(&self) -> bool {
        self.queue.iter().any(|j| self.connected(j.decode))
    }

    /// Between chunks: whether the running job `req` should go on (false once aborted, or
    /// once its decode worker's KV connection is gone).
    pub fn keep_going(&self, req: RequestId) -> bool {
        self.running.iter().any(|r| r.req == req && !r.aborted && self.connected(r.decode))
    }

    /// The driver ended the running job `req`; returns the final message(s) for it.
    pub fn job_ended(&mut self, req: RequestId, outcome: JobOutcome) -> Vec<PrefillAction> {
        let Some(i) = self.running.iter().position(|r| r.req == req) else { return Vec::new() };
        let r = self.running.remove(i);
        let to = r.decode;
        match outcome {
            JobOutcome::Done { tokens, first_token, first_logprobs, manifest, cached } if !r.aborted => {
                self.stats.completed += 1;
                vec![PrefillAction::ToDecode { to, msg: Message::Done { req, tokens, first_token, manifest, cached, first_logprobs } }]
            }
            JobOutcome::Done { .. } | JobOutcome::Stopped => {
                self.stats.aborted += 1;
                vec![PrefillAction::ToDecode { to, msg: Message::Fenced { req } }]
            }
            JobOutcome::Failed(why) => vec![
                PrefillAction::ToDecode { to, msg: Message::Fenced { req } },
                PrefillAction::ToGateway(Message::Failed { req, reason: FailReason::Internal, detail: why.to_string() }),
            ],
        }
    }
}
