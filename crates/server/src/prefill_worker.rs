//! The prefill worker process: computes prompt KV in its own pool, chunk by chunk, and
//! streams it to the decode worker that reserved pages for it.
//!
//! The protocol's prefill role decides what runs (admission, aborts); this driver only
//! computes the job the role hands out and checks `keep_going` between chunks, so an
//! aborted or rejected request is never computed or transferred after the decision.
//!
//! Each job runs inside a tracing span naming its request and trace; the worker's metrics
//! go to the gateway every [`PUSH_INTERVAL`](crate::metrics::PUSH_INTERVAL) and at the end
//! of each job.

use std::collections::BTreeMap;
use std::net::TcpStream;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::{Duration, Instant};

use bulkhead_engine::Sampler;
use bulkhead_kv::transfer::{export_chunks, Manifest};
use bulkhead_kv::{KvPool, SequenceKv};
use bulkhead_model::{Llama, SeqInput};
use bulkhead_protocol::prefill::{JobOutcome, PrefillAction, PrefillConfig, PrefillJob, PrefillRole};
use bulkhead_protocol::{Message, Role, WorkerId};

use crate::metrics::{self, Families, Histogram, Pusher};
use crate::wire::{send, spawn_reader, FrameReader};
use crate::worker::{load, register, request_span, WorkerConfig, WorkerError};

enum In {
    Gateway(Message),
    GatewayClosed,
    Decode(Message),
    DecodeClosed(WorkerId),
}

struct Driver {
    me: WorkerId,
    gw: TcpStream,
    decodes: BTreeMap<WorkerId, TcpStream>,
    role: PrefillRole,
    tx: Sender<In>,
    /// KV bytes sent in chunks.
    sent_bytes: u64,
    /// Time to send each transfer batch.
    transfer: Histogram,
    pusher: Pusher,
    /// How often every KV connection gets a `KvKeepalive`, and when they last did: decode
    /// workers fail reservations whose prefill stays silent for `--transfer-timeout-ms`.
    keepalive: Duration,
    last_keepalive: Instant,
}

/// Run a prefill worker until its gateway goes away.
pub fn run(cfg: WorkerConfig) -> Result<(), WorkerError> {
    let loaded = load(&cfg)?;
    let (gw, gw_reader, me) = register(&cfg, &loaded, Role::Prefill, String::new())?;
    tracing::info!(worker = %me, pid = std::process::id(), "prefill worker registered");
    let (tx, rx) = channel::<In>();
    spawn_reader(gw_reader, tx.clone(), In::Gateway, In::GatewayClosed);
    let page_size = loaded.pool.layout().page_size;
    let role = PrefillRole::new(PrefillConfig { max_prompt: loaded.context, page_size });
    let transfer = Histogram::new(metrics::TRANSFER_BUCKETS);
    // Several keepalives per decode timeout, and no more than one a second.
    let keepalive = Duration::from_millis((cfg.transfer_timeout_ms / 4).clamp(10, 1_000));
    let mut d = Driver {
        me,
        gw,
        decodes: BTreeMap::new(),
        role,
        tx,
        sent_bytes: 0,
        transfer,
        pusher: Pusher::new(),
        keepalive,
        last_keepalive: Instant::now(),
    };
    let crate::worker::Loaded { model, mut pool, .. } = loaded;
    let model = model.model;
    let chunk_tokens = (cfg.transfer_batch_pages.max(1) * page_size).max(1);
    loop {
        if !d.pump(&rx, !d.role.busy() && d.role.queued() == 0)? {
            return Ok(());
        }
        if d.pusher.due() {
            d.push_metrics(&pool)?;
        }
        if let Some(job) = d.role.next_job() {
            let span = request_span(job.req, &job.trace);
            let _in_span = span.enter();
            let started = Instant::now();
            let outcome = d.compute(&rx, &model, &mut pool, &job, chunk_tokens)?;
            match &outcome {
                JobOutcome::Done { tokens, .. } => tracing::info!(tokens, ms = started.elapsed().as_millis() as u64, "prefill done"),
                JobOutcome::Stopped => tracing::info!(ms = started.elapsed().as_millis() as u64, "prefill stopped"),
                JobOutcome::Failed(e) => tracing::warn!(error = %e, "prefill failed"),
            }
            let actions = d.role.job_ended(job.req, outcome);
            d.act(actions)?;
            d.push_metrics(&pool)?;
        }
    }
}

impl Driver {
    /// Handle pending inputs; blocks briefly for one if `wait`. Returns false when the
    /// gateway is gone.
    fn pump(&mut self, rx: &Receiver<In>, wait: bool) -> Result<bool, WorkerError> {
        let mut inputs = Vec::new();
        if wait {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(m) => inputs.push(m),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Ok(false),
            }
        }
        inputs.extend(rx.try_iter());
        for i in inputs {
            match i {
                In::Gateway(Message::DecodePeer { worker, addr }) => self.connect_decode(worker, &addr),
                In::Gateway(m) => {
                    let span = match &m {
                        Message::Prefill { req, trace, .. } => request_span(*req, trace),
                        _ => tracing::Span::none(),
                    };
                    let _in_span = span.enter();
                    let actions = self.role.handle(m);
                    self.act(actions)?;
                }
                In::GatewayClosed => {
                    tracing::info!("gateway connection closed; prefill worker exiting");
                    return Ok(false);
                }
                // Decode asks us to stop a transfer (it refused a chunk or timed out).
                In::Decode(m @ Message::Abort { .. }) => {
                    let actions = self.role.handle(m);
                    self.act(actions)?;
                }
                In::Decode(_) => {}
                In::DecodeClosed(w) => {
                    self.decodes.remove(&w);
                    send(&mut self.gw, &Message::KvLost { decode: w })?;
                    let actions = self.role.decode_closed(w);
                    self.act(actions)?;
                }
            }
        }
        // Also reached between the chunks of a long prompt, so a busy prefill keeps talking.
        if self.last_keepalive.elapsed() >= self.keepalive {
            self.last_keepalive = Instant::now();
            for conn in self.decodes.values_mut() {
                // A failed send shows up as that connection's close, handled above next time.
                let _ = send(conn, &Message::KvKeepalive);
            }
        }
        Ok(true)
    }

    fn connect_decode(&mut self, worker: WorkerId, addr: &str) {
        let conn = TcpStream::connect(addr).and_then(|mut s| {
            s.set_nodelay(true)?;
            send(&mut s, &Message::KvHello { prefill: self.me }).map_err(std::io::Error::other)?;
            Ok(s)
        });
        match conn {
            Ok(s) => {
                if let Ok(r) = s.try_clone() {
                    spawn_reader(FrameReader::new(r), self.tx.clone(), In::Decode, In::DecodeClosed(worker));
                }
                self.decodes.insert(worker, s);
                tracing::info!(decode = %worker, addr, "KV connection open");
            }
            Err(e) => {
                tracing::error!(decode = %worker, addr, error = %e, "cannot open KV connection");
                // The decode worker must not wait for a fence from us for ever.
                if let Err(e) = send(&mut self.gw, &Message::KvLost { decode: worker }) {
                    tracing::warn!(error = %e, "cannot tell the gateway");
                }
            }
        }
    }

    fn act(&mut self, actions: Vec<PrefillAction>) -> Result<(), WorkerError> {
        for a in actions {
            match a {
                PrefillAction::ToGateway(m) => {
                    if let Message::Failed { req, detail, .. } | Message::Rejected { req, detail, .. } = &m {
                        tracing::warn!(request = %req, %detail, "request ended by the prefill worker");
                    }
                    send(&mut self.gw, &m)?
                }
                PrefillAction::ToDecode { to, msg } => {
                    if let Some(s) = self.decodes.get_mut(&to) {
                        let _ = send(s, &msg);
                    }
                }
            }
        }
        Ok(())
    }

    /// Send this worker's metrics to the gateway.
    fn push_metrics(&mut self, pool: &KvPool) -> Result<(), WorkerError> {
        let mut f = Families::new();
        let requests = [("queued", self.role.queued()), ("running", usize::from(self.role.busy()))];
        metrics::worker_families(&mut f, &pool.stats(), &requests, self.sent_bytes);
        metrics::prefill_families(&self.role.stats(), &mut f);
        metrics::transfer_seconds(&mut f, &self.transfer);
        self.pusher.pushed();
        send(&mut self.gw, &Message::Metrics { families: f.into_vec() })?;
        Ok(())
    }

    /// Compute the job chunk by chunk, sending each chunk's pages as soon as they exist.
    fn compute(&mut self, rx: &Receiver<In>, model: &Llama, pool: &mut KvPool, job: &PrefillJob, chunk: usize) -> Result<JobOutcome, WorkerError> {
        let mut seq = SequenceKv::new(job.req);
        if let Err(e) = seq.reserve(pool, job.tokens.len()) {
            return Ok(JobOutcome::Failed(format!("prefill KV pool: {e}")));
        }
        let result = self.compute_into(rx, model, pool, job, chunk, &mut seq);
        if let Err(e) = seq.release(pool) {
            tracing::error!(error = %e, "releasing prefill pages");
        }
        result
    }

    fn compute_into(
        &mut self,
        rx: &Receiver<In>,
        model: &Llama,
        pool: &mut KvPool,
        job: &PrefillJob,
        chunk: usize,
        seq: &mut SequenceKv,
    ) -> Result<JobOutcome, WorkerError> {
        let mut manifest = Manifest::default();
        let mut logits = Vec::new();
        let n = job.tokens.len();
        let mut done = 0;
        while done < n {
            // Aborts that arrived while computing take effect here, before more work.
            if !self.pump(rx, false)? {
                return Ok(JobOutcome::Stopped);
            }
            if !self.role.keep_going(job.req) || !self.decodes.contains_key(&job.decode) {
                return Ok(JobOutcome::Stopped);
            }
            let end = (done + chunk).min(n);
            logits = match model.forward(pool, &mut [SeqInput { kv: seq, tokens: &job.tokens[done..end], want_logits: end == n }]) {
                Ok(l) => l,
                Err(e) => return Ok(JobOutcome::Failed(e.to_string())),
            };
            let chunks = match export_chunks(pool, seq, &job.pages, done, end, &mut manifest) {
                Ok(c) => c,
                Err(e) => return Ok(JobOutcome::Failed(e.to_string())),
            };
            let Some(conn) = self.decodes.get_mut(&job.decode) else { return Ok(JobOutcome::Stopped) };
            let sending = Instant::now();
            for (header, data) in chunks {
                let bytes = data.len() as u64;
                if send(conn, &Message::KvChunk { req: job.req, header, data }).is_err() {
                    return Ok(JobOutcome::Stopped);
                }
                self.sent_bytes += bytes;
            }
            self.transfer.observe_since(sending);
            if self.pusher.due() {
                self.push_metrics(pool)?;
            }
            done = end;
        }
        let params = crate::decode_worker::sampling(&job.sampling);
        let first_token = match Sampler::new(params).and_then(|mut sm| sm.sample(&logits)) {
            Ok(t) => t,
            Err(e) => return Ok(JobOutcome::Failed(e.to_string())),
        };
        Ok(JobOutcome::Done { tokens: n as u32, first_token, manifest: manifest.digest() })
    }
}
