//! The decode worker process: the protocol's decode driver
//! ([`bulkhead_protocol::driver::decode`]) over blocking TCP and the real engine.
//!
//! Threads: one reader per connection (each gateway, each prefill) feeding one bounded
//! channel; the main thread owns the driver (the role, the engine and its pool), so protocol
//! decisions and decode steps never race. A lost gateway's requests end here and the
//! gateway is dialled again ([`crate::gateways`]); the worker exits when it has no gateway
//! left.
//!
//! KV connections: at most [`MAX_KV_CONNECTIONS`] at once, one reader thread each (one
//! per prefill worker in a healthy cluster); each comes in through the KV port's [`Door`]
//! (a handshake deadline and a capped waiting room, [`crate::door`]), and one that has not
//! authenticated and sent its `KvHello` by the deadline is closed and counted.
//!
//! Log lines about a request run in its span (request, trace id, `x-request-id`) from its
//! `Reserve` on; the worker's metrics go to the gateway every
//! [`PUSH_INTERVAL`](bulkhead_transport::metrics::PUSH_INTERVAL) and before each request's last message.

use std::collections::BTreeMap;
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::mpsc::{RecvTimeoutError, SyncSender, sync_channel};
use std::time::{Duration, Instant};

use crate::core_budget::{self, DecodeBudget, DecodeShare};
use bulkhead_engine::speculate::ACCEPTED_BOUNDS;
use bulkhead_engine::{DraftModel, Engine, EngineConfig, SpecCounters};
use bulkhead_kv::{KvPool, PrefixCache, RequestId};
use bulkhead_protocol::decode::{DecodeConfig, DecodeEvent, DecodeRole};
use bulkhead_protocol::driver::decode::{DecodeDriver, DecodeLink};
use bulkhead_protocol::{Hello, Message, Purpose, Role, WorkerId};
use bulkhead_transport::handshake::{Admitted, Authenticated, admit};
use bulkhead_transport::kv_transport::{HELLO_TIMEOUT, KvTransport};
use bulkhead_transport::trust::Trust;
use tracing::Span;

use crate::gateways::{GatewayIn, Gateways, fresh_worker_id};
use crate::worker::{INBOX, WorkerConfig, WorkerError, load, request_span};
use bulkhead_transport::door::{Port, Refusal, Waiter};
use bulkhead_transport::metrics::{self, Families, Pusher};
use bulkhead_transport::wire::{FrameWriter, WireError, count_bad_connection};

/// KV connections served at once; more are closed at once (and counted).
pub const MAX_KV_CONNECTIONS: usize = 256;

enum In {
    Gateway(GatewayIn),
    Prefill(WorkerId, Message),
    PrefillConnected(WorkerId, FrameWriter),
    PrefillClosed(WorkerId),
}

/// Run a decode worker until its last gateway goes away.
pub fn run(cfg: WorkerConfig) -> Result<(), WorkerError> {
    let loaded = load(&cfg)?;
    let listener = TcpListener::bind(&cfg.kv_listen).map_err(|source| WorkerError::KvListen { addr: cfg.kv_listen.clone(), source })?;
    cfg.trust.check_listener("decode worker's KV port", listener.local_addr()?)?;
    let kv_addr = match &cfg.kv_advertise {
        Some(a) => a.clone(),
        None => listener.local_addr()?.to_string(),
    };
    let hello = Hello::for_pool(Role::Decode, fresh_worker_id()?, loaded.digest, &loaded.pool, loaded.context, kv_addr.clone());
    let (tx, rx) = sync_channel::<In>(INBOX);
    let gateways = Gateways::register_all(&cfg.gateways, &cfg.trust, hello, tx.clone(), In::Gateway)?;
    tracing::info!(worker = %gateways.me(), kv_addr, pid = std::process::id(), "decode worker registered");
    {
        let (tx, trust, transport) = (tx.clone(), cfg.trust.clone(), cfg.kv_transport);
        std::thread::spawn(move || accept_prefills(listener, tx, trust, transport));
    }
    let crate::worker::Loaded { model, pool, context, digest, .. } = loaded;
    let mut llama = model.model;
    let mut budget = cfg.core_budget.as_ref().and_then(|b| {
        let r = DecodeBudget::join(b).and_then(|budget| {
            llama.set_core_share(budget.core_share() as Arc<dyn bulkhead_model::CoreShare>)?;
            Ok(budget)
        });
        core_budget::joined(b, "decode", r)
    });
    let cache_pages = cfg.prefix_cache_pages.min(pool.total_pages());
    let engine_cfg = EngineConfig { speculation: cfg.speculation, ..EngineConfig::for_context(context) };
    let draft = match &cfg.draft_model {
        Some(path) => Some(load_draft(path, &cfg, &model.tokenizer, context).map_err(|e| WorkerError::CannotStart(Box::new(e)))?),
        None => None,
    };
    let mut engine = Engine::new(Arc::new(llama), Arc::new(model.tokenizer), pool, engine_cfg);
    if let Some(d) = draft {
        engine.set_draft_model(d);
    }
    let spec = engine.spec_counters();
    let role = DecodeRole::new(DecodeConfig {
        max_context: context,
        transfer_timeout_ms: cfg.transfer_timeout_ms,
        local_prefill_tokens: cfg.max_local_prefill_tokens,
    });
    let role = if cache_pages > 0 {
        tracing::info!(
            pages = cache_pages,
            "decode-side cache on: an ended request's full pages stay, shared within one tenant and salt; the next turn receives only what is new"
        );
        role.with_cache(PrefixCache::new(cache_pages), digest)
    } else {
        role
    };
    let mut driver = DecodeDriver::new(role, engine);
    let share = budget.as_ref().map(DecodeBudget::core_share);
    let mut link =
        Link { gateways, prefills: BTreeMap::new(), spans: BTreeMap::new(), received_bytes: 0, pusher: Pusher::new(), share, spec };
    let start = Instant::now();
    let mut last_tick = 0;
    loop {
        if let Some(h) = &cfg.health {
            h.beat();
        }
        // Block only when nothing is decoding, or while the core budget leaves prefill its share.
        let decoding = driver.engine().active() > 0;
        let pace = match &mut budget {
            Some(b) if decoding => b.wait(Instant::now(), driver.engine().step_tokens()),
            _ => Duration::ZERO,
        };
        let first = if decoding && pace.is_zero() {
            rx.try_recv().ok()
        } else {
            match rx.recv_timeout(if decoding { pace } else { Duration::from_millis(50) }) {
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
            driver.handle(DecodeEvent::Tick { now_ms }, &mut link);
            let role = driver.role();
            link.spans.retain(|req, _| role.known(*req));
        }
        for input in inputs {
            let ev = match input {
                In::Gateway(GatewayIn::Msg(i, msg)) => {
                    // A message read before its connection was counted closed.
                    let Some(from) = link.gateways.id(i) else { continue };
                    if let Message::Reserve { req, trace, .. } = &msg {
                        link.spans.insert(*req, request_span(*req, trace));
                    }
                    DecodeEvent::Gateway { from, msg }
                }
                In::Gateway(GatewayIn::Closed(i)) => {
                    if let Some(gateway) = link.gateways.closed(i) {
                        driver.handle(DecodeEvent::GatewayLost { gateway }, &mut link);
                    }
                    if link.gateways.connected() == 0 {
                        tracing::info!("no gateway left; decode worker exiting");
                        return Ok(());
                    }
                    continue;
                }
                In::Gateway(GatewayIn::Joined(i, r)) => {
                    link.gateways.joined(i, r)?;
                    // What this worker's cache holds, for the new gateway's routing.
                    if let Some(c) = driver.role().cache() {
                        link.gateways.send_to(i, &Message::CacheReport { stored: c.keys(), evicted: Vec::new() });
                    }
                    continue;
                }
                In::Prefill(from, msg) => {
                    if let Message::KvChunk { data, .. } = &msg {
                        link.received_bytes += data.len() as u64;
                    }
                    DecodeEvent::Prefill { from, msg }
                }
                In::PrefillConnected(from, s) => {
                    link.prefills.insert(from, s);
                    DecodeEvent::PrefillConnected { from }
                }
                In::PrefillClosed(from) => {
                    link.prefills.remove(&from);
                    DecodeEvent::PrefillClosed { from }
                }
            };
            driver.handle(ev, &mut link);
        }
        if driver.engine().active() > 0
            && budget.as_mut().is_none_or(|b| b.wait(Instant::now(), driver.engine().step_tokens()).is_zero())
            && let Err(e) = {
                let _held = budget.as_mut().map(DecodeBudget::hold);
                driver.step(&mut link)
            }
        {
            // A failed step leaves sequences in an unknown state: the worker ends.
            tracing::error!(error = %e, "decode step failed");
            return Err(WorkerError::Io(std::io::Error::other(e.to_string())));
        }
        if link.pusher.due() {
            link.push_metrics(driver.role(), driver.engine().pool());
        }
    }
}

/// The decode worker's transport: the gateway connections and the prefill workers' KV
/// connections, plus the log span of each request.
struct Link {
    gateways: Gateways<In>,
    prefills: BTreeMap<WorkerId, FrameWriter>,
    /// The log span of each request from its `Reserve` until the role no longer holds it
    /// (swept every tick).
    spans: BTreeMap<RequestId, Span>,
    /// KV bytes received in chunks, verified or not.
    received_bytes: u64,
    pusher: Pusher,
    /// The model's share of the core budget, for its count of narrowed layers.
    share: Option<Arc<DecodeShare>>,
    /// What the decode loop's speculation did.
    spec: Arc<SpecCounters>,
}

impl Link {
    fn span(&self, req: Option<RequestId>) -> Span {
        req.and_then(|r| self.spans.get(&r)).cloned().unwrap_or_else(Span::none)
    }

    /// Send this worker's metrics to every gateway.
    fn push_metrics(&mut self, role: &DecodeRole, pool: &KvPool) {
        let mut f = Families::new();
        let requests = [("pending_transfer", role.pending()), ("fencing", role.fencing()), ("decoding", role.decoding())];
        metrics::worker_families(&mut f, &pool.stats(), &requests, self.received_bytes);
        metrics::decode_families(&role.stats(), pool.checks().checksums, pool.layout().bytes_per_token(), &mut f);
        if let Some(c) = role.cache() {
            metrics::prefix_cache_families(&c.stats(), c.len(), c.max_pages(), &mut f);
        }
        if let Some(s) = &self.share {
            f.counter("bulkhead:narrowed_layers_total", core_budget::NARROWED_HELP, &[], s.narrowed_layers());
            f.counter("bulkhead:slo_paced_steps_total", core_budget::SLO_PACED_HELP, &[], s.slo_paced_steps());
        }
        speculation_families(&self.spec, &mut f);
        self.pusher.pushed();
        self.gateways.send(&Message::Metrics { families: f.into_vec() });
    }
}

/// Speculative decoding's evidence, under vLLM's names with Bulkhead's prefix.
fn speculation_families(s: &SpecCounters, f: &mut Families) {
    let (drafted, accepted, _) = s.totals();
    f.counter("bulkhead:spec_decode_num_draft_tokens_total", "Drafted tokens fed to verification (speculative decoding).", &[], drafted);
    f.counter(
        "bulkhead:spec_decode_num_accepted_tokens_total",
        "Drafted tokens accepted: each was the step's own pick, emitted as without speculation.",
        &[],
        accepted,
    );
    let h = metrics::Histogram::from_counts(&ACCEPTED_BOUNDS, &s.by_accepted(), accepted as f64);
    f.histogram("bulkhead:spec_decode_accepted_length", "Drafts accepted per verification (one sequence, one step).", &[], &h);
}

impl DecodeLink for Link {
    fn to_gateway(&mut self, msg: Message) {
        let span = self.span(msg.req());
        let _in_span = span.enter();
        match &msg {
            Message::Failed { detail, .. } | Message::Rejected { detail, .. } => {
                tracing::warn!(%detail, "request ended by the decode worker")
            }
            Message::Finished { prompt_tokens, completion_tokens, finish, .. } => {
                tracing::info!(prompt_tokens, completion_tokens, finish = finish.as_str(), "decode finished");
            }
            // What the decode-side cache saved: the prompt's leading tokens this worker held
            // (and, computing the rest here, that nothing is sent).
            Message::Reserved { held, pages, local, .. } => {
                tracing::info!(held_tokens = held, target_pages = pages.len(), local, "reserved")
            }
            _ => {}
        }
        self.gateways.send(&msg);
    }

    fn to_prefill(&mut self, to: WorkerId, msg: Message) {
        if let Some(s) = self.prefills.get_mut(&to) {
            // A broken prefill connection shows up as PrefillClosed from its reader.
            let _ = s.send(&msg);
        }
    }

    fn disconnect(&mut self, prefill: WorkerId) {
        tracing::warn!(%prefill, "KV connection from a prefill worker that left the cluster; closed");
        if let Some(s) = self.prefills.remove(&prefill) {
            s.shutdown();
        }
    }

    /// A request's last message follows the metrics that count it, so a client holding
    /// its answer finds them at the gateway.
    fn ending(&mut self, role: &DecodeRole, pool: &KvPool) {
        self.push_metrics(role, pool);
    }
}

/// Accept KV connections, at most [`MAX_KV_CONNECTIONS`] at once, each through the KV
/// port's [`Door`] (a handshake deadline, a capped waiting room). With a cluster key, the
/// handshake comes first and must prove the key; then (or without a key, at once) the
/// first frame must be `KvHello` naming the identity the handshake claimed. Anything else
/// (garbage, a port scanner, an HTTP client, silence, a trickle, no key or a wrong one,
/// another prefill's id) closes that connection and the worker serves on.
fn accept_prefills(listener: TcpListener, tx: SyncSender<In>, trust: Trust, transport: KvTransport) {
    let port = Port::new("kv", MAX_KV_CONNECTIONS);
    for conn in listener.incoming() {
        let Ok(stream) = conn else { continue };
        let Some((open, waiter)) = port.enter(&stream) else { continue };
        let (tx, trust) = (tx.clone(), trust.clone());
        std::thread::spawn(move || {
            serve_prefill(stream, waiter, &tx, &trust, transport);
            drop(open);
        });
    }
}

fn serve_prefill(stream: TcpStream, waiter: Waiter, tx: &SyncSender<In>, trust: &Trust, transport: KvTransport) {
    let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    // The introduction must name the prefill the handshake proved (I9).
    let introduce = |auth: Option<&Authenticated>, first: Message| match first {
        Message::KvHello { prefill } if auth.is_none_or(|a| a.claim == prefill.0) => Ok(prefill),
        Message::KvHello { prefill } => {
            let claim = auth.map_or(0, |a| a.claim);
            Err((Refusal::Identity, format!("this connection authenticated as worker-{claim}, not {prefill}")))
        }
        other => Err((Refusal::Unexpected, format!("the first frame was {}, not KvHello", other.kind_name()))),
    };
    let Some(Admitted { mut reader, mut writer, auth, intro: from }) = admit(stream, waiter, "kv", trust, Purpose::Kv, introduce) else {
        return;
    };
    if reader.set_timeout(Some(HELLO_TIMEOUT)).is_err() {
        return;
    }
    let chosen = match transport.accept(auth.is_some(), &mut reader, &mut writer) {
        Ok(c) => c,
        Err(e) => {
            if matches!(e, WireError::Codec(_)) {
                count_bad_connection();
            }
            tracing::warn!(%peer, prefill = %from, error = %e, "KV connection: no transport agreed; closed");
            return;
        }
    };
    tracing::info!(
        %peer, prefill = %from, authenticated = auth.is_some(), encrypted = auth.is_some_and(|a| a.encrypted),
        transport = chosen.name(), detail = chosen.detail(), "KV connection from a prefill worker"
    );
    // Once set up, a prefill may stay quiet between keepalives as long as it likes.
    if reader.set_timeout(None).is_err() {
        return;
    }
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
                if matches!(e, WireError::Codec(_)) {
                    let total = count_bad_connection();
                    tracing::warn!(prefill = %from, reason = %e, bad_connections = total, "bad frame on a KV connection; closed");
                }
                tracing::info!(prefill = %from, reason = %e, "KV connection closed");
                let _ = tx.send(In::PrefillClosed(from));
                return;
            }
        }
    }
}

/// The draft model of `--draft-model`, with a pool for every sequence that may draft at
/// once (counted in the capacity check, I5), refused when its tokenizer is not the target's.
fn load_draft(
    path: &std::path::Path,
    cfg: &WorkerConfig,
    target: &bulkhead_tokenizer::Tokenizer,
    context: usize,
) -> Result<DraftModel, WorkerError> {
    let m = bulkhead_engine::load_model_with(path, cfg.threads, None, cfg.weights_cache.as_deref())?;
    let tokens = DraftModel::pool_tokens(context);
    let draft = DraftModel::new(Arc::new(m.model), &m.tokenizer, target, cfg.page_size, tokens, context, cfg.kv_checks)
        .map_err(|source| WorkerError::Draft { path: path.to_path_buf(), source })?;
    tracing::info!(path = %path.display(), pool_tokens = draft.pool().capacity_tokens(), "draft model loaded: it drafts, the model verifies");
    Ok(draft)
}
