//! The role's event handling: admission of a submission, workers joining and leaving,
//! workers' messages about a request's current attempt, requeues and migrations, timeouts,
//! and the one terminal outcome each request gets.

use std::collections::VecDeque;

use bulkhead_kv::RequestId;

use super::tenants::OverLimit;
use super::*;
use crate::admission::{Generate, admit};

impl GatewayRole {
    /// Register a worker from its `Hello`, under the id it names: refused if it serves
    /// another model or KV layout, or a live worker has that id. On success: its
    /// `Welcome`, the introductions that let prefill workers open KV connections to decode
    /// workers (`DecodePeer`), and any queued requests it lets go.
    pub fn join(&mut self, hello: &Hello) -> Result<Vec<GatewayAction>, RegisterError> {
        let id = hello.worker;
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
        let mut out = vec![GatewayAction::ToWorker { to: id, msg: Message::Welcome { gateway: self.id } }];
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
        self.lost_since_ms[role_index(hello.role)] = None;
        let member = Member { role: hello.role, max_context: hello.max_context as usize, kv_addr: hello.kv_addr.clone() };
        self.members.insert(id, member);
        self.update_context();
        self.dispatch(&mut out);
        Ok(out)
    }

    /// The served context is the smallest any worker accepts (I5).
    fn update_context(&mut self) {
        let workers = self.members.values().map(|m| m.max_context).min();
        self.max_context = workers.unwrap_or(self.cfg.model_context).min(self.cfg.model_context);
    }

    /// Process one event.
    pub fn handle(&mut self, ev: GatewayEvent) -> Vec<GatewayAction> {
        let mut out = Vec::new();
        match ev {
            GatewayEvent::Submit { req, submission } => {
                let f = InFlight {
                    sub: submission,
                    phase: Phase::Queued,
                    attempt: 0,
                    route: None,
                    resume: Vec::new(),
                    deadline_ms: self.now_ms.saturating_add(self.cfg.settings.request_timeout_ms),
                    queued_at_ms: Some(self.now_ms),
                    retried: false,
                    waited_for_room: false,
                    sent: Vec::new(),
                    migrations: 0,
                    charged: 0,
                    avoid: None,
                    first_key: None,
                };
                self.submit(req, f, &mut out);
            }
            GatewayEvent::ClientGone { req } => {
                if let Some(f) = self.end(&req) {
                    self.stats.client_gone += 1;
                    self.unqueue(req);
                    Self::abort_workers(req, &f, AbortReason::ClientGone, None, &mut out);
                }
            }
            GatewayEvent::FromWorker { from, msg } => self.on_worker(from, msg, &mut out),
            GatewayEvent::WorkerLeft { id } => self.worker_left(id, &mut out),
            GatewayEvent::Tick { now_ms } => {
                self.now_ms = now_ms;
                // A tenant whose use has faded away and who waits for nothing is forgotten.
                let queues = &self.queues;
                self.usage.retain(|t, u| u.at(now_ms) > 0 || queues.contains_key(t));
                self.expire(&mut out);
                // Capacity may have freed without a word from the decode worker (a request
                // it held failed on another path): try again.
                self.full.clear();
                self.dispatch(&mut out);
            }
        }
        out
    }

    fn submit(&mut self, req: RequestId, f: InFlight, out: &mut Vec<GatewayAction>) {
        self.stats.submitted += 1;
        if self.cfg.settings.admission_check
            && let Err(refusal) = admit(f.sub.tokens.len(), Generate::Tokens(f.sub.max_tokens as usize), self.max_context)
        {
            // Rejected before any Reserve (I3, I5).
            self.stats.rejected_at_gateway += 1;
            return out.push(Self::reject(req, refusal.reason(), refusal.to_string()));
        }
        if self.inflight.contains_key(&req) || req.0 >= CLIENT_ID_LIMIT {
            let detail = format!("request id {req} is in use or out of range");
            return out.push(GatewayAction::ToClient { req, out: ClientOutput::Unavailable { detail } });
        }
        // A role that never had a worker: the server is starting, say so at once. A role
        // that lost its last worker: wait in the queue for one to rejoin (a restarted worker
        // takes seconds), up to the queue timeout.
        if let Some(detail) = self.unavailable().filter(|_| !self.may_rejoin()) {
            return out.push(GatewayAction::ToClient { req, out: ClientOutput::Unavailable { detail } });
        }
        let waiting = self.queues.get(&f.sub.tenant).map_or(0, VecDeque::len);
        if waiting >= self.cfg.settings.max_queued {
            self.stats.queue_full += 1;
            let detail = format!("{waiting} requests of this tenant are waiting, the most this server queues per tenant");
            return out.push(GatewayAction::ToClient { req, out: ClientOutput::Busy { reason: BusyReason::QueueFull, detail } });
        }
        let mut f = f;
        if let Some(over) = self.over_limit(&mut f) {
            self.stats.over_limit += 1;
            let out_ = match over {
                OverLimit::Busy(reason, detail) => ClientOutput::Busy { reason, detail },
                OverLimit::Never(detail) => ClientOutput::OverBudget { detail },
            };
            return out.push(GatewayAction::ToClient { req, out: out_ });
        }
        // Within the tenant's queue, lower priority values first, first come first served
        // among equals, never ahead of a request sent back to the queue (it was admitted
        // before); another tenant's queue is never affected.
        let inflight = &self.inflight;
        let queue = self.queues.entry(f.sub.tenant).or_default();
        let behind = |o: &InFlight| o.attempt == 0 && o.sub.priority > f.sub.priority;
        let at = queue.iter().position(|r| inflight.get(r).is_some_and(behind)).unwrap_or(queue.len());
        queue.insert(at, req);
        self.inflight.insert(req, f);
        self.dispatch(out);
    }

    fn on_worker(&mut self, from: WorkerId, msg: Message, out: &mut Vec<GatewayAction>) {
        // A prefill lost its KV connection to `decode` (or never had one): the decode worker
        // must not wait for fences from it.
        if let Message::KvLost { decode } = msg {
            if self.decodes.contains(&decode) {
                out.push(GatewayAction::ToWorker { to: decode, msg: Message::PrefillUnreachable { worker: from } });
                // New requests take other routes at once (not this one until it rejoins).
                if self.prefills.contains(&from) {
                    self.unreachable.insert((from, decode));
                }
            }
            return;
        }
        if let Message::CacheReport { stored, evicted } = msg {
            if self.prefills.contains(&from) || self.decodes.contains(&from) {
                let set = self.cached.entry(from).or_default();
                set.extend(stored);
                for k in &evicted {
                    set.remove(k);
                }
            }
            return;
        }
        if msg == Message::Room {
            if self.full.remove(&from) {
                self.dispatch(out);
            }
            return;
        }
        let Some(attempt) = msg.req() else { return };
        let req = client_of(attempt);
        // Only the workers of the current attempt speak for a request.
        let Some(route) = self.current(attempt).and_then(|f| f.route) else { return };
        if from != route.decode && from != route.prefill {
            return;
        }
        if from == route.decode && matches!(msg, Message::Finished { .. } | Message::Failed { .. } | Message::Retracted { .. }) {
            // It let go of something: it may have room again.
            self.full.remove(&from);
        }
        let Some(f) = self.inflight.get_mut(&req) else { return };
        match msg {
            Message::Reserved { local: true, .. } if f.phase == Phase::Reserving && from == route.decode => {
                // The decode worker computes the rest itself: it is this attempt's only
                // worker, and the prefill worker picked for it never hears of it.
                f.phase = Phase::Prefilling;
                f.route = Some(Route { decode: route.decode, prefill: route.decode });
                if let Some(since) = f.queued_at_ms.take() {
                    record_queue_wait(&mut self.stats, since, self.now_ms);
                }
            }
            Message::Reserved { held, pages, .. } if f.phase == Phase::Reserving && from == route.decode => {
                if !self.prefills.contains(&route.prefill) {
                    // Its prefill worker left since: send the request elsewhere.
                    return self.requeue(req, None, out);
                }
                f.phase = Phase::Prefilling;
                if let Some(since) = f.queued_at_ms.take() {
                    record_queue_wait(&mut self.stats, since, self.now_ms);
                }
                let mut tokens = f.sub.tokens.clone();
                tokens.extend_from_slice(&f.resume);
                let msg = Message::Prefill {
                    req: attempt,
                    tokens,
                    decode: route.decode,
                    held,
                    pages,
                    sampling: f.sub.sampling.clone(),
                    skip_draws: f.resume.len() as u32,
                    trace: f.sub.trace.clone(),
                    cache: f.sub.cache,
                };
                out.push(GatewayAction::ToWorker { to: route.prefill, msg });
            }
            Message::Token { token, text, logprobs, .. } if from == route.decode => {
                f.phase = Phase::Decoding;
                f.sent.push(token);
                out.push(GatewayAction::ToClient { req, out: ClientOutput::Token { token, text, logprobs } });
            }
            Message::Finished { finish, text, prompt_tokens, completion_tokens, cached_tokens, .. } if from == route.decode => {
                self.end(&req);
                self.stats.finished += 1;
                let cached_tokens = cached_tokens.min(prompt_tokens);
                out.push(GatewayAction::ToClient {
                    req,
                    out: ClientOutput::Finished { finish, text, prompt_tokens, completion_tokens, cached_tokens },
                });
            }
            Message::Retracted { tokens, .. } if from == route.decode => {
                // The decode loop gave its pages to others; it resumes from what it made.
                self.stats.retracted += 1;
                self.full.insert(from);
                f.resume = tokens;
                self.requeue(req, Some(from), out);
            }
            Message::Rejected { reason: RejectReason::Capacity, .. } if from == route.decode && f.phase == Phase::Reserving => {
                // No room there now: wait for it.
                if !f.waited_for_room {
                    f.waited_for_room = true;
                    self.stats.requeued_capacity += 1;
                }
                self.full.insert(from);
                self.requeue(req, Some(from), out);
            }
            Message::Rejected { reason, detail, .. } => {
                self.end(&req);
                self.stats.rejected_by_worker += 1;
                // A prefill rejection leaves a reservation on the decode worker.
                if from == route.prefill && from != route.decode {
                    out.push(GatewayAction::ToWorker {
                        to: route.decode,
                        msg: Message::Abort { req: attempt, reason: AbortReason::Failed },
                    });
                }
                out.push(Self::reject(req, reason, detail));
            }
            // The prompt never reached the decode worker and this attempt streamed nothing
            // (what earlier ones streamed is in `resume`): one more try, on another
            // prefill worker if there is one.
            Message::Failed { reason: FailReason::WorkerLost, .. } if !f.retried && f.phase == Phase::Prefilling => {
                self.stats.retried += 1;
                f.retried = true;
                f.avoid = Some(route.prefill);
                self.requeue(req, Some(from), out);
            }
            Message::Failed { reason, detail, .. } => self.fail(req, reason, detail, Some(from), out),
            _ => {}
        }
        self.dispatch(out);
    }

    fn worker_left(&mut self, id: WorkerId, out: &mut Vec<GatewayAction>) {
        let Some(left) = self.members.remove(&id) else { return };
        self.cached.remove(&id);
        self.prefills.retain(|w| *w != id);
        self.decodes.retain(|w| *w != id);
        self.full.remove(&id);
        self.unreachable.retain(|&(p, d)| p != id && d != id);
        if self.workers(left.role).is_empty() {
            self.lost_since_ms[role_index(left.role)] = Some(self.now_ms);
        }
        self.update_context();
        match left.role {
            Role::Prefill => {
                // A decode worker it never connected to has no other way to learn that it
                // can no longer write there (its quarantines would never end; found by the
                // fault schedules), nor that a connection from it still on its way must be
                // refused.
                for &to in &self.decodes {
                    out.push(GatewayAction::ToWorker { to, msg: Message::PeerLeft { worker: id } });
                }
                // Not yet sent to it: send elsewhere. Sent to it: the decode worker reports
                // whether the prompt had arrived (then it streams on) or not (then it is
                // retried, see `on_worker`).
                let waiting: Vec<RequestId> = self.routed_to(id, |p| p == Phase::Reserving);
                for req in waiting {
                    self.requeue(req, Some(id), out);
                }
            }
            Role::Decode => {
                for &to in &self.prefills {
                    out.push(GatewayAction::ToWorker { to, msg: Message::PeerLeft { worker: id } });
                }
                let lost: Vec<RequestId> = self.routed_to(id, |_| true);
                for req in lost {
                    self.migrate(req, id, out);
                }
            }
        }
        self.dispatch(out);
    }

    /// Back to the queue's front as a new attempt (it was admitted before everything that
    /// waits behind it). The workers of the old attempt, but `except`, are told to let it go.
    fn requeue(&mut self, req: RequestId, except: Option<WorkerId>, out: &mut Vec<GatewayAction>) {
        let now = self.now_ms;
        let Some(f) = self.inflight.get_mut(&req) else { return };
        let old = attempt_id(req, f.attempt);
        Self::abort_attempt(old, f, AbortReason::Failed, except, out);
        f.attempt += 1;
        f.phase = Phase::Queued;
        f.route = None;
        f.queued_at_ms.get_or_insert(now);
        self.queues.entry(f.sub.tenant).or_default().push_front(req);
    }

    /// `req`'s decode worker `lost` is gone (I11): a new attempt resumes from every token
    /// the client has (as a retracted one does: same tokens, same draws skipped), unless the
    /// request moved `migration_limit` times already, or nothing is left to generate (its
    /// end was lost with the worker): then it fails as before. The new attempt waits in
    /// the queue like any other, bounded by the request timeout once it has streamed.
    fn migrate(&mut self, req: RequestId, lost: WorkerId, out: &mut Vec<GatewayAction>) {
        let Some(f) = self.inflight.get_mut(&req) else { return };
        let left = f.sub.max_tokens.saturating_sub(f.sent.len() as u32);
        if f.migrations >= self.cfg.settings.migration_limit || left == 0 {
            let why = if left == 0 { "its last token was sent but not its end" } else { "it reached the migration limit" };
            return self.fail(req, FailReason::WorkerLost, format!("decode {lost} was lost; {why}"), Some(lost), out);
        }
        f.migrations += 1;
        f.resume = f.sent.clone();
        self.stats.migrated += 1;
        self.requeue(req, Some(lost), out);
    }

    /// Requests whose current attempt went to worker `id`, in a phase `phase` accepts.
    fn routed_to(&self, id: WorkerId, phase: impl Fn(Phase) -> bool) -> Vec<RequestId> {
        let on = |r: &Route| r.decode == id || r.prefill == id;
        self.inflight.iter().filter(|(_, f)| f.route.as_ref().is_some_and(on) && phase(f.phase)).map(|(r, _)| *r).collect()
    }

    /// Requests that waited too long: 429 from the queue, a failure elsewhere.
    fn expire(&mut self, out: &mut Vec<GatewayAction>) {
        let now = self.now_ms;
        let waited: Vec<RequestId> = self
            .queues
            .values()
            .flatten()
            .copied()
            // A retracted request has streamed tokens: a 429 now would cut a live stream, so
            // only the request timeout bounds its wait (it waits at the queue's head).
            .filter(|r| {
                self.inflight
                    .get(r)
                    .filter(|f| f.resume.is_empty())
                    .and_then(|f| f.queued_at_ms)
                    .is_some_and(|t| t.saturating_add(self.cfg.settings.queue_timeout_ms) <= now)
            })
            .collect();
        for req in waited {
            self.unqueue(req);
            if let Some(f) = self.end(&req) {
                self.stats.queue_timeouts += 1;
                record_queue_wait(&mut self.stats, f.queued_at_ms.unwrap_or(now), now);
                // No worker of a role came back while it waited: 503, not 429.
                let client = match self.unavailable() {
                    Some(detail) => ClientOutput::Unavailable { detail },
                    None => {
                        let detail = format!("waited {} ms in the queue for capacity", self.cfg.settings.queue_timeout_ms);
                        ClientOutput::Busy { reason: BusyReason::QueueTimeout, detail }
                    }
                };
                out.push(GatewayAction::ToClient { req, out: client });
            }
        }
        let late: Vec<RequestId> = self.inflight.iter().filter(|(_, f)| f.deadline_ms <= now).map(|(r, _)| *r).collect();
        for req in late {
            self.fail(req, FailReason::Timeout, "request timed out".into(), None, out);
        }
    }

    fn fail(&mut self, req: RequestId, reason: FailReason, detail: String, except: Option<WorkerId>, out: &mut Vec<GatewayAction>) {
        if let Some(f) = self.end(&req) {
            self.unqueue(req);
            self.stats.failed += 1;
            Self::abort_workers(req, &f, AbortReason::Failed, except, out);
            out.push(GatewayAction::ToClient { req, out: ClientOutput::Failed { reason, detail } });
        }
    }

    /// Refuse `req` before anything was reserved for it (I3).
    pub(super) fn reject(req: RequestId, reason: RejectReason, detail: String) -> GatewayAction {
        GatewayAction::ToClient { req, out: ClientOutput::Rejected { reason, detail } }
    }

    fn abort_workers(req: RequestId, f: &InFlight, reason: AbortReason, except: Option<WorkerId>, out: &mut Vec<GatewayAction>) {
        Self::abort_attempt(attempt_id(req, f.attempt), f, reason, except, out);
    }

    /// Tell the workers of attempt `attempt` (but `except`) to end it.
    fn abort_attempt(attempt: RequestId, f: &InFlight, reason: AbortReason, except: Option<WorkerId>, out: &mut Vec<GatewayAction>) {
        let Some(route) = f.route else { return };
        if f.phase == Phase::Reserving {
            // No Prefill was sent: no worker can write the reservation, so the decode
            // worker may release it at once instead of waiting for a fence.
            if Some(route.decode) != except {
                out.push(GatewayAction::ToWorker { to: route.decode, msg: Message::Cancel { req: attempt } });
            }
            return;
        }
        // A locally computed attempt names its decode worker twice: tell it once.
        let prefill = Some(route.prefill).filter(|p| *p != route.decode);
        for to in [Some(route.decode), prefill].into_iter().flatten().filter(|t| Some(*t) != except) {
            out.push(GatewayAction::ToWorker { to, msg: Message::Abort { req: attempt, reason } });
        }
    }
}
