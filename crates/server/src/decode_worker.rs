//! The decode worker process: receives KV from prefill workers, verifies it through the
//! protocol's decode role, and continuously batches verified sequences.
//!
//! Threads: one reader per connection (gateway, each prefill) feeding one channel; the main
//! thread owns the engine, the pool and the role, so protocol decisions and decode steps
//! never race. The worker exits when the gateway connection closes.
//!
//! Log lines about a request run in its span (request, trace id, `x-request-id`) from its
//! `Reserve` on; the worker's metrics go to the gateway every
//! [`PUSH_INTERVAL`](crate::metrics::PUSH_INTERVAL) and before each request's last message.

use std::collections::BTreeMap;
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_engine::{Engine, Event, FinishReason, SamplingParams};
use bulkhead_kv::RequestId;
use bulkhead_protocol::decode::{DecodeAction, DecodeConfig, DecodeEvent, DecodeRole};
use bulkhead_protocol::{FailReason, Finish, Message, Role, WorkerId};
use tracing::Span;

use crate::metrics::{self, Families, Pusher};
use crate::wire::{count_bad_connection, send, spawn_reader, FrameReader};
use crate::worker::{load, register, request_span, WorkerConfig, WorkerError};

enum In {
    Gateway(Message),
    GatewayClosed,
    Prefill(WorkerId, Message),
    PrefillConnected(WorkerId, TcpStream),
    PrefillClosed(WorkerId),
}

/// The engine's sampling settings from the wire's (the prefill worker samples the first token with the same).
pub(crate) fn sampling(s: &bulkhead_protocol::Sampling) -> SamplingParams {
    SamplingParams { temperature: s.temperature, top_k: s.top_k as usize, top_p: s.top_p, seed: s.seed, ignore_eos: s.ignore_eos }
}

/// Run a decode worker until its gateway goes away.
pub fn run(cfg: WorkerConfig) -> Result<(), WorkerError> {
    let loaded = load(&cfg)?;
    let listener = TcpListener::bind(&cfg.kv_listen)?;
    let kv_addr = match &cfg.kv_advertise {
        Some(a) => a.clone(),
        None => listener.local_addr()?.to_string(),
    };
    let (gw, gw_reader, me) = register(&cfg, &loaded, Role::Decode, kv_addr.clone())?;
    tracing::info!(worker = %me, kv_addr, pid = std::process::id(), "decode worker registered");
    let (tx, rx) = channel::<In>();
    spawn_reader(gw_reader, tx.clone(), In::Gateway, In::GatewayClosed);
    {
        let tx = tx.clone();
        std::thread::spawn(move || accept_prefills(listener, tx));
    }
    let crate::worker::Loaded { model, pool, context, .. } = loaded;
    let mut d = Driver {
        engine: Engine::new(Arc::new(model.model), Arc::new(model.tokenizer), pool, 512, context),
        role: DecodeRole::new(DecodeConfig { max_context: context, transfer_timeout_ms: cfg.transfer_timeout_ms }),
        gw,
        prefills: BTreeMap::new(),
        spans: BTreeMap::new(),
        received_bytes: 0,
        pusher: Pusher::new(),
    };
    let start = Instant::now();
    let mut last_tick = 0;
    loop {
        // Block only when nothing is decoding.
        let first = if d.engine.active() > 0 {
            rx.try_recv().ok()
        } else {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(m) => Some(m),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return Ok(()),
            }
        };
        let mut inputs: Vec<In> = first.into_iter().collect();
        inputs.extend(rx.try_iter());
        let now_ms = start.elapsed().as_millis() as u64;
        if now_ms >= last_tick + 50 {
            last_tick = now_ms;
            d.handle(DecodeEvent::Tick { now_ms })?;
            let role = &d.role;
            d.spans.retain(|req, _| role.known(*req));
        }
        for input in inputs {
            let ev = match input {
                In::Gateway(m) => DecodeEvent::Gateway(m),
                In::GatewayClosed => {
                    tracing::info!("gateway connection closed; decode worker exiting");
                    return Ok(());
                }
                In::Prefill(from, m) => DecodeEvent::Prefill { from, msg: m },
                In::PrefillConnected(id, s) => {
                    d.prefills.insert(id, s);
                    DecodeEvent::PrefillConnected { from: id }
                }
                In::PrefillClosed(from) => {
                    d.prefills.remove(&from);
                    DecodeEvent::PrefillClosed { from }
                }
            };
            d.handle(ev)?;
        }
        if d.engine.active() > 0 {
            match d.engine.step() {
                Ok(events) => d.forward(events)?,
                Err(e) => {
                    // A failed step leaves sequences in an unknown state: fail them all.
                    tracing::error!(error = %e, "decode step failed");
                    return Err(WorkerError::Io(std::io::Error::other(e.to_string())));
                }
            }
        }
        if d.pusher.due() {
            d.push_metrics()?;
        }
    }
}

/// What the main thread owns.
struct Driver {
    engine: Engine,
    role: DecodeRole,
    gw: TcpStream,
    prefills: BTreeMap<WorkerId, TcpStream>,
    /// The log span of each request from its `Reserve` until the role no longer holds it
    /// (swept every tick).
    spans: BTreeMap<RequestId, Span>,
    /// KV bytes received in chunks, verified or not.
    received_bytes: u64,
    pusher: Pusher,
}

impl Driver {
    fn span(&self, req: Option<RequestId>) -> Span {
        req.and_then(|r| self.spans.get(&r)).cloned().unwrap_or_else(Span::none)
    }

    fn handle(&mut self, ev: DecodeEvent) -> Result<(), WorkerError> {
        match &ev {
            DecodeEvent::Gateway(Message::Reserve { req, trace, .. }) => {
                self.spans.insert(*req, request_span(*req, trace));
            }
            DecodeEvent::Prefill { msg: Message::KvChunk { data, .. }, .. } => self.received_bytes += data.len() as u64,
            _ => {}
        }
        let actions = self.role.handle(self.engine.pool_mut(), ev);
        self.act(actions)
    }

    fn act(&mut self, actions: Vec<DecodeAction>) -> Result<(), WorkerError> {
        for a in actions {
            let req = match &a {
                DecodeAction::ToGateway(m) | DecodeAction::ToPrefill { msg: m, .. } => m.req(),
                DecodeAction::Start(ds) => Some(ds.req),
                DecodeAction::Stop { req } => Some(*req),
            };
            let span = self.span(req);
            let _in_span = span.enter();
            match a {
                DecodeAction::ToGateway(m) => {
                    if let Message::Failed { req, detail, .. } | Message::Rejected { req, detail, .. } = &m {
                        tracing::warn!(request = %req, %detail, "request ended by the decode worker");
                    }
                    send(&mut self.gw, &m)?
                }
                DecodeAction::ToPrefill { to, msg } => {
                    if let Some(s) = self.prefills.get_mut(&to) {
                        // A broken prefill connection shows up as PrefillClosed from its reader.
                        let _ = send(s, &msg);
                    }
                }
                DecodeAction::Start(ds) => {
                    let req = ds.req;
                    tracing::debug!(prompt_tokens = ds.seq.prompt_tokens(), "KV transfer verified; decoding");
                    match self.engine.add_verified(ds.seq, ds.first_token, ds.max_tokens as usize, sampling(&ds.sampling), ds.stop) {
                        Ok((_, events)) => self.forward(events)?,
                        Err(e) => {
                            self.role.finished(req);
                            send(&mut self.gw, &Message::Failed { req, reason: FailReason::Internal, detail: e.to_string() })?;
                        }
                    }
                }
                DecodeAction::Stop { req } => {
                    let _ = self.engine.abort(req);
                    self.role.finished(req);
                }
            }
        }
        Ok(())
    }

    fn forward(&mut self, events: Vec<Event>) -> Result<(), WorkerError> {
        let mut ended = false;
        for ev in &events {
            if let Event::Finished { id, .. } | Event::Failed { id, .. } = ev {
                self.role.finished(*id);
                ended = true;
            }
        }
        // A request's last message follows the metrics that count it, so a client holding
        // its answer finds them at the gateway.
        if ended {
            self.push_metrics()?;
        }
        for ev in events {
            match ev {
                Event::Token { id, token, text } => send(&mut self.gw, &Message::Token { req: id, token, text })?,
                Event::Finished { id, reason, text, prompt_tokens, completion_tokens } => {
                    let finish = if reason == FinishReason::Length { Finish::Length } else { Finish::Stop };
                    self.span(Some(id)).in_scope(|| tracing::info!(prompt_tokens, completion_tokens, ?finish, "decode finished"));
                    let (prompt_tokens, completion_tokens) = (prompt_tokens as u32, completion_tokens as u32);
                    send(&mut self.gw, &Message::Finished { req: id, finish, text, prompt_tokens, completion_tokens })?;
                }
                Event::Failed { id, error } => {
                    let detail = format!("KV read check failed: {error}");
                    self.span(Some(id)).in_scope(|| tracing::warn!(%detail, "decode failed"));
                    send(&mut self.gw, &Message::Failed { req: id, reason: FailReason::Internal, detail })?;
                }
            }
        }
        Ok(())
    }

    /// Send this worker's metrics to the gateway.
    fn push_metrics(&mut self) -> Result<(), WorkerError> {
        let mut f = Families::new();
        let r = &self.role;
        let requests = [("pending_transfer", r.pending()), ("fencing", r.fencing()), ("decoding", r.decoding())];
        let pool = self.engine.pool();
        metrics::worker_families(&mut f, &pool.stats(), &requests, self.received_bytes);
        metrics::decode_families(&r.stats(), pool.checks().checksums, &mut f);
        self.pusher.pushed();
        send(&mut self.gw, &Message::Metrics { families: f.into_vec() })?;
        Ok(())
    }
}

/// Accept KV connections. The first frame must be `KvHello`; anything else (garbage, a
/// port scanner, an HTTP client) closes that connection and the worker serves on.
fn accept_prefills(listener: TcpListener, tx: Sender<In>) {
    for conn in listener.incoming() {
        let Ok(stream) = conn else { continue };
        let tx = tx.clone();
        std::thread::spawn(move || {
            let _ = stream.set_nodelay(true);
            let Ok(writer) = stream.try_clone() else { return };
            let mut reader = FrameReader::new(stream);
            let from = match reader.recv() {
                Ok(Message::KvHello { prefill }) => prefill,
                Ok(other) => {
                    let total = count_bad_connection();
                    tracing::warn!(?other, bad_connections = total, "KV connection did not start with KvHello; closed");
                    return;
                }
                Err(e) => {
                    let total = count_bad_connection();
                    tracing::warn!(error = %e, bad_connections = total, "bad bytes on the KV port; connection closed");
                    return;
                }
            };
            if tx.send(In::PrefillConnected(from, writer)).is_err() {
                return;
            }
            loop {
                match reader.recv() {
                    Ok(m) => {
                        if tx.send(In::Prefill(from, m)).is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        if matches!(e, crate::wire::WireError::Codec(_)) {
                            let total = count_bad_connection();
                            tracing::warn!(prefill = %from, reason = %e, bad_connections = total, "bad frame on a KV connection; closed");
                        }
                        tracing::info!(prefill = %from, reason = %e, "KV connection closed");
                        let _ = tx.send(In::PrefillClosed(from));
                        return;
                    }
                }
            }
        });
    }
}
