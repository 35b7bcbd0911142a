//! The prefill worker process: the protocol's prefill driver
//! ([`bulkhead_protocol::driver::prefill`]) over blocking TCP and the real model.
//!
//! The driver decides and computes; this file only moves frames, keeps the clock, and
//! logs. Threads: one reader per connection (gateway, each decode worker) feeding one
//! bounded channel; the main thread owns the driver, the model and the pool, and handles
//! its inputs between steps (one forward pass over the chunks of every prompt it
//! batches), so an aborted request stops at the next chunk boundary.
//!
//! Each job's log lines run in a span naming its request and trace; the worker's metrics
//! go to the gateway every [`PUSH_INTERVAL`](bulkhead_transport::metrics::PUSH_INTERVAL) and after each
//! step that ended a job.

use std::collections::{BTreeMap, VecDeque};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, sync_channel};
use std::time::{Duration, Instant};

use crate::core_budget::{self, PrefillBudget};
use bulkhead_engine::Prefiller;
use bulkhead_kv::transfer::ChunkExport;
use bulkhead_kv::{KvPool, PrefixCache, RequestId};
use bulkhead_protocol::driver::prefill::{Batching, ChunkSendError, LinkDown, PrefillDriver, PrefillLink, Step};
use bulkhead_protocol::prefill::{JobOutcome, PrefillConfig, PrefillEvent, PrefillRole};
use bulkhead_protocol::{Hello, Message, Purpose, Role, WorkerId};
use bulkhead_transport::handshake::connect_handshake;
use bulkhead_transport::kv_transport::{HELLO_TIMEOUT, KvTransport};
use bulkhead_transport::trust::Trust;

use crate::gateways::{GatewayIn, Gateways, fresh_worker_id};
use crate::worker::{INBOX, WorkerConfig, WorkerError, load, request_span};
use bulkhead_transport::metrics::{self, Families, Histogram, Pusher};
use bulkhead_transport::wire::{ChunkWriteError, FrameReader, FrameWriter, WireError, spawn_reader};

enum In {
    Gateway(GatewayIn),
    Decode(WorkerId, Message),
    DecodeClosed(WorkerId),
}

/// The prefill worker's transport: the gateway connections and one KV connection per
/// decode worker.
struct Link {
    me: WorkerId,
    gateways: Gateways<In>,
    decodes: BTreeMap<WorkerId, FrameWriter>,
    /// The cluster's trust settings: each KV connection authenticates with its key as `me`.
    trust: Trust,
    /// Which road each KV connection's frames may take.
    transport: KvTransport,
    inbox: SyncSender<In>,
    /// Events about the connections this thread opened, for the driver after its call.
    events: Vec<PrefillEvent>,
    /// KV bytes sent in chunks.
    sent_bytes: u64,
    /// When the chunks of the current step started going out.
    sending: Option<Instant>,
    /// The role asked to rejoin the cluster under a new id.
    rejoin: bool,
}

impl PrefillLink for Link {
    fn to_gateway(&mut self, msg: Message) {
        if let Message::Failed { req, detail, .. } | Message::Rejected { req, detail, .. } = &msg {
            tracing::warn!(request = %req, %detail, "request ended by the prefill worker");
        }
        self.gateways.send(&msg);
    }

    fn to_decode(&mut self, to: WorkerId, msg: Message) -> Result<(), LinkDown> {
        let Some(conn) = self.decodes.get_mut(&to) else { return Err(LinkDown(to)) };
        if conn.send(&msg).is_err() {
            return Err(self.lost(to));
        }
        Ok(())
    }

    fn to_decode_chunks(&mut self, to: WorkerId, req: RequestId, chunks: &mut ChunkExport<'_>) -> Result<usize, ChunkSendError> {
        let Some(conn) = self.decodes.get_mut(&to) else { return Err(LinkDown(to).into()) };
        self.sending.get_or_insert_with(Instant::now);
        let mut sent = 0;
        loop {
            match conn.send_kv_chunk(req, chunks) {
                Ok(Some(bytes)) => {
                    self.sent_bytes += bytes as u64;
                    sent += 1;
                }
                Ok(None) => return Ok(sent),
                Err(ChunkWriteError::Export(e)) => return Err(e.into()),
                Err(ChunkWriteError::Wire(_)) => return Err(self.lost(to).into()),
            }
        }
    }

    fn connect(&mut self, decode: WorkerId, addr: &str) {
        let conn = TcpStream::connect(addr).map_err(WireError::from).and_then(|s| {
            s.set_nodelay(true)?;
            let mut reader = FrameReader::new(s.try_clone()?);
            let mut writer = FrameWriter::new(s);
            reader.set_timeout(Some(HELLO_TIMEOUT))?;
            let auth = connect_handshake(&mut reader, &mut writer, &self.trust, Purpose::Kv, self.me.0)?;
            writer.send(&Message::KvHello { prefill: self.me })?;
            let chosen = self.transport.connect(auth.is_some(), &mut reader, &mut writer)?;
            reader.set_timeout(None)?;
            Ok((reader, writer, auth, chosen))
        });
        match conn {
            Ok((reader, writer, auth, chosen)) => {
                spawn_reader(reader, self.inbox.clone(), move |m| In::Decode(decode, m), In::DecodeClosed(decode));
                self.decodes.insert(decode, writer);
                tracing::info!(
                    %decode, addr, authenticated = auth.is_some(), encrypted = auth.is_some_and(|a| a.encrypted),
                    transport = chosen.name(), detail = chosen.detail(), "KV connection open"
                );
                self.events.push(PrefillEvent::DecodeConnected { decode });
            }
            Err(e) => {
                tracing::error!(%decode, addr, error = %e, "cannot open KV connection");
                // The decode worker must not wait for a fence from us for ever.
                self.events.push(PrefillEvent::DecodeLost { decode });
            }
        }
    }

    fn rejoin(&mut self) {
        self.rejoin = true;
    }
}

impl Link {
    /// The KV connection to `to` failed: close it (its reader sees the close and reports it
    /// once, as `DecodeClosed`).
    fn lost(&mut self, to: WorkerId) -> LinkDown {
        if let Some(conn) = self.decodes.remove(&to) {
            conn.shutdown();
        }
        LinkDown(to)
    }

    /// Close every connection of this incarnation.
    fn close_all(&mut self) {
        self.gateways.close_all();
        for (_, c) in std::mem::take(&mut self.decodes) {
            c.shutdown();
        }
    }
}

/// A pause shorter than this between prompts does not end a busy stretch (see
/// `Worker::report_work`).
const BUSY_GAP: Duration = Duration::from_millis(100);

/// The main thread's state for one incarnation.
struct Worker<'p> {
    driver: PrefillDriver,
    link: Link,
    compute: Prefiller,
    pool: &'p mut KvPool,
    /// The core budget shared with a decode worker on this host.
    budget: Option<&'p mut PrefillBudget>,
    /// Time to send each step's chunks.
    transfer: Histogram,
    pusher: Pusher,
    /// When each running job was taken (about: the start of the step that took it), for
    /// its log line.
    job_started: BTreeMap<RequestId, Instant>,
    /// Since when this worker has had prompts without a pause of [`BUSY_GAP`], and when it
    /// last had none: how long prompts have queued, here or at the gateway's prefill window
    /// (the core budget's SLO pace).
    busy: Option<(Instant, Option<Instant>)>,
    started: Instant,
}

/// How an incarnation of the worker (one registration) ended.
enum Ended {
    /// No gateway is left: the worker exits.
    NoGateway,
    /// A KV connection was lost: register anew under a new id.
    Rejoin,
}

/// The shortest and longest wait before registering anew after a lost KV connection. The
/// wait doubles while incarnations keep ending within [`STABLE_INCARNATION`].
const REJOIN_BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(5));
const STABLE_INCARNATION: Duration = Duration::from_secs(10);

/// Run a prefill worker until its last gateway goes away. A lost KV connection makes it
/// leave and register again under a new id (see `protocol::prefill`), with backoff.
pub fn run(cfg: WorkerConfig) -> Result<(), WorkerError> {
    let crate::worker::Loaded { model, mut pool, context, digest } = load(&cfg)?;
    let mut llama = model.model;
    let mut budget = cfg.core_budget.as_ref().and_then(|b| {
        let r = PrefillBudget::join(b).and_then(|budget| {
            llama.set_core_share(budget.core_share())?;
            Ok(budget)
        });
        core_budget::joined(b, "prefill", r)
    });
    let compute = Prefiller::new(Arc::new(llama), Arc::new(model.tokenizer));
    let cache_pages = cfg.prefix_cache_pages.min(pool.total_pages());
    if cache_pages > 0 {
        let tokens = cache_pages * pool.layout().page_size;
        tracing::info!(
            pages = cache_pages,
            tokens,
            "prefix cache on: full prompt pages are shared within one tenant and salt, evicted least recently used"
        );
    } else {
        tracing::info!("prefix cache off");
    }
    let mut backoff = Duration::ZERO;
    loop {
        let started = Instant::now();
        let me = fresh_worker_id()?;
        let hello = Hello::for_pool(Role::Prefill, me, digest, &pool, context, String::new());
        let (inbox, rx) = sync_channel::<In>(INBOX);
        let gateways = Gateways::register_all(&cfg.gateways, &cfg.trust, hello, inbox.clone(), In::Gateway)?;
        tracing::info!(worker = %me, pid = std::process::id(), "prefill worker registered");
        let cache = (cache_pages > 0).then(|| (PrefixCache::new(cache_pages), digest));
        let conns = Conns { gateways, inbox, rx };
        match incarnation(&cfg, conns, &compute, &mut pool, budget.as_mut(), context, cache)? {
            Ended::NoGateway => return Ok(()),
            Ended::Rejoin => {
                if let Some(h) = &cfg.health {
                    h.unregistered();
                }
                let (min, max) = REJOIN_BACKOFF;
                backoff = if started.elapsed() >= STABLE_INCARNATION { min } else { (backoff * 2).clamp(min, max) };
                tracing::warn!(worker = %me, backoff_ms = backoff.as_millis() as u64, "a KV connection was lost: rejoining the cluster under a new id");
                std::thread::sleep(backoff);
            }
        }
    }
}

/// One incarnation's registrations and the inbox their readers feed.
struct Conns {
    gateways: Gateways<In>,
    inbox: SyncSender<In>,
    rx: Receiver<In>,
}

/// One registration: serve until the last gateway goes away or the role asks to rejoin.
fn incarnation(
    cfg: &WorkerConfig,
    Conns { gateways, inbox, rx }: Conns,
    compute: &Prefiller,
    pool: &mut KvPool,
    budget: Option<&mut PrefillBudget>,
    context: usize,
    cache: Option<(PrefixCache, u64)>,
) -> Result<Ended, WorkerError> {
    let page_size = pool.layout().page_size;
    let role = PrefillRole::new(PrefillConfig {
        max_prompt: context,
        page_size,
        keepalive_ms: PrefillConfig::keepalive_for(cfg.transfer_timeout_ms),
    });
    let chunk_tokens = cfg.transfer_batch_pages.max(1) * page_size;
    let batching = Batching { chunk_tokens, step_tokens: cfg.max_prefill_tokens };
    let trust = cfg.trust.clone();
    let link = Link {
        me: gateways.me(),
        gateways,
        decodes: BTreeMap::new(),
        trust,
        transport: cfg.kv_transport,
        inbox,
        events: Vec::new(),
        sent_bytes: 0,
        sending: None,
        rejoin: false,
    };
    let driver = PrefillDriver::new(role, batching);
    let mut w = Worker {
        driver: match cache {
            Some((cache, digest)) => driver.with_cache(cache, digest),
            None => driver,
        },
        link,
        compute: compute.clone(),
        pool,
        budget,
        transfer: Histogram::new(metrics::TRANSFER_BUCKETS),
        pusher: Pusher::new(),
        job_started: BTreeMap::new(),
        busy: None,
        started: Instant::now(),
    };
    loop {
        if let Some(h) = &cfg.health {
            h.beat();
        }
        if !w.pump(&rx)? {
            return Ok(Ended::NoGateway);
        }
        if w.pusher.due() {
            w.push_metrics();
        }
        if w.report_work() {
            w.step();
            // At once, not after the next wait for input: a decode worker stays narrow
            // while it believes prefill busy.
            w.report_work();
        }
        if w.link.rejoin {
            w.link.close_all();
            w.driver.abandon(w.pool);
            return Ok(Ended::Rejoin);
        }
    }
}

impl Worker<'_> {
    /// Whether prompts wait to be computed, told to the core budget's decode workers with
    /// how long this worker has been busy. The gateway hands out prompts through its prefill
    /// window, so a prompt may have waited there while this worker computed others: a busy
    /// stretch, not the oldest job here, says how long first tokens have been queueing.
    fn report_work(&mut self) -> bool {
        let busy = self.driver.has_work();
        let now = Instant::now();
        self.busy = match (self.busy, busy) {
            (None, false) => None,
            (None, true) => Some((now, None)),
            (Some((since, _)), true) => Some((since, None)),
            // The next prompt of the window is a round trip away: a short gap is not a pause.
            (Some((since, idle)), false) => {
                let idle = idle.unwrap_or(now);
                (now.duration_since(idle) < BUSY_GAP).then_some((since, Some(idle)))
            }
        };
        if let Some(b) = self.budget.as_deref_mut() {
            b.report(busy.then(|| self.busy.map_or(Duration::ZERO, |(since, _)| now.duration_since(since))));
        }
        busy
    }

    /// Handle pending inputs (blocking briefly for one when idle) and the clock. Returns
    /// false when no gateway is left.
    fn pump(&mut self, rx: &Receiver<In>) -> Result<bool, WorkerError> {
        let mut inputs = Vec::new();
        if !self.driver.has_work() {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(m) => inputs.push(m),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return Ok(false),
            }
        }
        inputs.extend(rx.try_iter());
        for input in inputs {
            let ev = match input {
                In::Gateway(GatewayIn::Msg(i, msg)) => {
                    // A message read before its connection was counted closed.
                    let Some(from) = self.link.gateways.id(i) else { continue };
                    let span = match &msg {
                        Message::Prefill { req, trace, .. } => request_span(*req, trace),
                        _ => tracing::Span::none(),
                    };
                    let _in_span = span.enter();
                    self.handle(PrefillEvent::Gateway { from, msg });
                    continue;
                }
                In::Gateway(GatewayIn::Closed(i)) => {
                    if let Some(gateway) = self.link.gateways.closed(i) {
                        self.handle(PrefillEvent::GatewayLost { gateway });
                    }
                    if self.link.gateways.connected() == 0 {
                        tracing::info!("no gateway left; prefill worker exiting");
                        return Ok(false);
                    }
                    continue;
                }
                In::Gateway(GatewayIn::Joined(i, r)) => {
                    self.link.gateways.joined(i, r)?;
                    // What this worker's cache holds, for the new gateway's routing.
                    if let Some(c) = self.driver.cache() {
                        self.link.gateways.send_to(i, &Message::CacheReport { stored: c.keys(), evicted: Vec::new() });
                    }
                    continue;
                }
                In::Decode(from, msg) => PrefillEvent::Decode { from, msg },
                In::DecodeClosed(decode) => {
                    tracing::info!(%decode, "KV connection closed");
                    self.link.decodes.remove(&decode);
                    PrefillEvent::DecodeLost { decode }
                }
            };
            self.handle(ev);
        }
        // Also reached between the chunks of a long prompt, so a busy prefill keeps talking.
        let now_ms = self.started.elapsed().as_millis() as u64;
        self.handle(PrefillEvent::Tick { now_ms });
        Ok(true)
    }

    /// Feed one event to the driver, then the events its actions caused here.
    fn handle(&mut self, ev: PrefillEvent) {
        let mut pending = VecDeque::from([ev]);
        while let Some(ev) = pending.pop_front() {
            self.driver.handle(ev, &mut self.link);
            pending.extend(self.link.events.drain(..));
        }
    }

    /// One step of prefill work; each job's ending is logged in its own span.
    fn step(&mut self) {
        let started = Instant::now();
        let steps = self.driver.step(&mut self.compute, self.pool, &mut self.link);
        if let Some(sending) = self.link.sending.take() {
            self.transfer.observe_since(sending);
        }
        for j in self.driver.running() {
            self.job_started.entry(j.req).or_insert(started);
        }
        let mut ended = false;
        for step in steps {
            let Step::Ended { req, outcome, unreleased, trace } = step else { continue };
            ended = true;
            let _in_span = request_span(req, &trace).entered();
            let ms = self.job_started.remove(&req).unwrap_or(started).elapsed().as_millis() as u64;
            match outcome {
                JobOutcome::Done { tokens, cached, .. } => tracing::info!(tokens, cached, ms, "prefill done"),
                JobOutcome::Stopped => tracing::info!(ms, "prefill stopped"),
                JobOutcome::Failed(e) => tracing::warn!(error = %e, "prefill failed"),
            }
            if let Some(e) = unreleased {
                tracing::error!(error = %e, "releasing prefill pages");
            }
        }
        if ended {
            self.push_metrics();
        }
    }

    /// Send this worker's metrics to every gateway.
    fn push_metrics(&mut self) {
        let mut f = Families::new();
        let role = self.driver.role();
        let requests = [("queued", role.queued()), ("running", role.running().count())];
        metrics::worker_families(&mut f, &self.pool.stats(), &requests, self.link.sent_bytes);
        metrics::prefill_families(&role.stats(), &mut f);
        metrics::transfer_seconds(&mut f, &self.transfer);
        if let Some(b) = self.budget.as_deref() {
            let help = "Seconds the prefill forward pass waited for the decode worker's steps (core budget, pause mode).";
            f.counter_seconds("bulkhead:prefill_paused_seconds_total", help, &[], b.paused_seconds());
            f.counter("bulkhead:narrowed_layers_total", core_budget::NARROWED_HELP, &[], b.narrowed_layers());
        }
        if let Some(c) = self.driver.cache() {
            metrics::prefix_cache_families(&c.stats(), c.len(), c.max_pages(), &mut f);
        }
        self.pusher.pushed();
        self.link.gateways.send(&Message::Metrics { families: f.into_vec() });
    }
}
