//! [`ColocatedBackend`]: the engine in this process, on a dedicated OS thread.
//!
//! Requests are templated, tokenised and checked against the context on the caller's
//! thread, then handed to the engine thread, which admits them between steps (reserving
//! their KV pages all at once, or refusing with 503 when the pool is full) and replies with
//! the outcome before any stream exists. The thread steps while any request is active and
//! blocks on its command channel when none is. Each step's text goes to the request's
//! channel; a request whose receiver was dropped (client gone) is aborted and its pages
//! released before the next step.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;

use bulkhead_engine::{Engine, EngineConfig, EngineError, Event, GenRequest, LoadedModel, SamplingError};
use bulkhead_kv::{KvChecks, KvError, KvPool, PoolConfig, RequestId};
use bulkhead_protocol::admission::{Generate, admit, default_max_tokens};
use tokio::sync::mpsc;

use crate::backend::{Backend, GenEvent, GenerationRequest, ModelCard};
use crate::error::ApiError;
use crate::ids::unix_now;
use crate::prompt::PromptEncoder;

/// Why a [`ColocatedBackend`] could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ColocatedError {
    /// The KV pool could not be made (zero pages or page size, too large, out of memory).
    #[error("cannot create the KV pool: {0}")]
    Pool(#[from] KvError),
    /// The engine thread could not be started.
    #[error("cannot start the engine thread: {0}")]
    Spawn(#[from] std::io::Error),
}

/// A request handed to the engine thread.
struct Admit {
    request_id: String,
    req: GenRequest,
    events: mpsc::Sender<GenEvent>,
    reply: std_mpsc::SyncSender<Result<(), ApiError>>,
}

/// A [`Backend`] that runs [`bulkhead_engine::Engine`] in-process (colocated mode: prefill
/// and decode in one engine).
pub struct ColocatedBackend {
    card: ModelCard,
    encoder: PromptEncoder,
    context_limit: usize,
    commands: std_mpsc::Sender<Admit>,
    alive: Arc<AtomicBool>,
    counters: Arc<Counters>,
}

/// Figures the engine thread publishes after every change.
#[derive(Debug, Default)]
struct Counters {
    active: AtomicUsize,
    aborted: AtomicU64,
}

impl std::fmt::Debug for ColocatedBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ColocatedBackend").field("card", &self.card).field("context_limit", &self.context_limit).finish()
    }
}

impl ColocatedBackend {
    /// Serve `model` under the name `model_id` with a KV pool of at least `kv_pool_tokens`
    /// tokens in pages of `page_size` tokens running `checks`, and start the engine thread.
    ///
    /// The served context (`max_model_len`) is the model's `context_length`, or the pool's
    /// capacity if smaller, so that a request that fits the context always fits an empty
    /// pool and a full pool is a transient 503, never a permanent one.
    pub fn new(
        model: LoadedModel,
        model_id: impl Into<String>,
        kv_pool_tokens: usize,
        page_size: usize,
        checks: KvChecks,
    ) -> Result<Self, ColocatedError> {
        let LoadedModel { model, tokenizer, chat, .. } = model;
        let layout = model.kv_layout(page_size);
        let pool = KvPool::new(PoolConfig { layout, pages: layout.pages_for_tokens(kv_pool_tokens), checks })?;
        let context_limit = model.config.context_length.min(pool.capacity_tokens());
        let tokenizer = Arc::new(tokenizer);
        let engine = Engine::new(Arc::new(model), Arc::clone(&tokenizer), pool, EngineConfig::for_context(context_limit));
        let (commands, inbox) = std_mpsc::channel();
        let alive = Arc::new(AtomicBool::new(true));
        let guard = AliveGuard(Arc::clone(&alive));
        let counters = Arc::new(Counters::default());
        let published = Arc::clone(&counters);
        std::thread::Builder::new().name("bulkhead-engine".into()).spawn(move || {
            let _guard = guard;
            EngineLoop { engine, live: HashMap::new(), counters: published }.run(&inbox);
        })?;
        let card = ModelCard { id: model_id.into(), max_model_len: context_limit, created: unix_now(), owned_by: "bulkhead".into() };
        tracing::info!(model = %card.id, context = context_limit, "colocated engine started");
        Ok(ColocatedBackend { card, encoder: PromptEncoder::new(tokenizer, chat), context_limit, commands, alive, counters })
    }

    /// The most tokens (prompt + completion) one request may use.
    pub fn context_limit(&self) -> usize {
        self.context_limit
    }

    /// Requests the engine is running now (admitted, not yet finished or aborted).
    pub fn active_requests(&self) -> usize {
        self.counters.active.load(Ordering::Acquire)
    }

    /// Requests aborted so far because their receiver was dropped (client gone) or the
    /// engine failed.
    pub fn aborted_requests(&self) -> u64 {
        self.counters.aborted.load(Ordering::Acquire)
    }
}

impl Backend for ColocatedBackend {
    fn models(&self) -> Vec<ModelCard> {
        vec![self.card.clone()]
    }

    fn encoder(&self) -> &PromptEncoder {
        &self.encoder
    }

    fn generate(&self, req: GenerationRequest) -> Result<mpsc::Receiver<GenEvent>, ApiError> {
        if req.model != self.card.id {
            return Err(ApiError::model_not_found(&req.model));
        }
        let prompt = self.encoder.encode(&req.prompt)?;
        // Refuse what cannot fit before the engine reserves anything.
        let limit = self.context_limit;
        let max_tokens = req.max_tokens.unwrap_or_else(|| default_max_tokens(prompt.len(), limit));
        admit(prompt.len(), Generate::Tokens(max_tokens), limit).map_err(|r| ApiError::refused(&r, req.prompt.param()))?;
        // Every step sends at most one event per request, plus the final text and Finished:
        // this capacity means the engine thread never finds the channel full.
        let (events, rx) = mpsc::channel(max_tokens.saturating_add(4));
        let (reply, outcome) = std_mpsc::sync_channel(1);
        let gen_req = GenRequest { prompt, max_tokens, sampling: req.sampling, stop: req.stop };
        self.commands
            .send(Admit { request_id: req.request_id, req: gen_req, events, reply })
            .map_err(|_| ApiError::overloaded("The engine is not running."))?;
        match outcome.recv() {
            Ok(Ok(())) => Ok(rx),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(ApiError::internal("The engine stopped while admitting the request.")),
        }
    }

    fn ready(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// The engine thread is the whole backend: once it is gone nothing brings it back.
    fn healthy(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }
}

/// Clears the `alive` flag when the engine thread ends, however it ends.
struct AliveGuard(Arc<AtomicBool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// A request the engine is running.
struct Live {
    request_id: String,
    events: mpsc::Sender<GenEvent>,
}

/// The engine thread's state.
struct EngineLoop {
    engine: Engine,
    live: HashMap<RequestId, Live>,
    counters: Arc<Counters>,
}

impl EngineLoop {
    /// Step while anything is active; block for commands when idle; return once the backend
    /// is dropped and the last request has ended.
    fn run(mut self, inbox: &std_mpsc::Receiver<Admit>) {
        loop {
            self.counters.active.store(self.engine.active(), Ordering::Release);
            if self.engine.active() == 0 {
                match inbox.recv() {
                    Ok(cmd) => self.admit(cmd),
                    Err(_) => break,
                }
            }
            while let Ok(cmd) = inbox.try_recv() {
                self.admit(cmd);
            }
            self.abort_disconnected();
            if self.engine.active() == 0 {
                continue;
            }
            match self.engine.step() {
                Ok(events) => self.route(events),
                Err(e) => self.fail_all(&e),
            }
        }
        tracing::info!("engine thread stopped");
    }

    fn admit(&mut self, cmd: Admit) {
        let Admit { request_id, req, events, reply } = cmd;
        let (prompt_len, max_tokens) = (req.prompt.len(), req.max_tokens);
        match self.engine.add(req) {
            Ok(id) => {
                tracing::debug!(request_id = %request_id, engine_id = id.0, prompt_tokens = prompt_len, max_tokens, "admitted");
                if reply.send(Ok(())).is_err() {
                    self.abort(id, "caller gone before admission completed");
                } else {
                    self.live.insert(id, Live { request_id, events });
                }
            }
            Err(e) => {
                tracing::debug!(request_id = %request_id, error = %e, "refused");
                let _ = reply.send(Err(admission_error(e)));
            }
        }
    }

    /// Abort every request whose receiver was dropped.
    fn abort_disconnected(&mut self) {
        let gone: Vec<RequestId> = self.live.iter().filter(|(_, l)| l.events.is_closed()).map(|(id, _)| *id).collect();
        for id in gone {
            self.abort(id, "client disconnected");
        }
    }

    fn abort(&mut self, id: RequestId, why: &str) {
        let request_id = self.live.remove(&id).map(|l| l.request_id).unwrap_or_default();
        self.counters.aborted.fetch_add(1, Ordering::AcqRel);
        match self.engine.abort(id) {
            Ok(_) => tracing::debug!(request_id = %request_id, engine_id = id.0, "aborted: {why}"),
            Err(e) => {
                tracing::error!(request_id = %request_id, engine_id = id.0, error = %e, "abort failed")
            }
        }
    }

    /// Send `ev` to request `id`; abort it if its receiver is gone.
    fn send(&mut self, id: RequestId, ev: GenEvent) {
        let Some(live) = self.live.get(&id) else {
            return;
        };
        if live.events.try_send(ev).is_err() {
            self.abort(id, "event channel closed");
        }
    }

    fn route(&mut self, events: Vec<Event>) {
        for ev in events {
            match ev {
                Event::Token { req, token, text, logprobs } => {
                    if !text.is_empty() || logprobs.is_some() {
                        self.send(req, GenEvent::Text { text, logprobs: logprobs.map(|l| (token, l)) });
                    }
                }
                Event::Failed { req, detail } => {
                    if let Some(live) = self.live.remove(&req) {
                        let err = ApiError::internal(detail);
                        let _ = live.events.try_send(GenEvent::Failed(err));
                    }
                }
                // The engine recomputes requests admitted here itself; only sequences that
                // arrived verified from a prefill worker leave it retracted.
                Event::Retracted { req, .. } => {
                    if let Some(live) = self.live.remove(&req) {
                        let err = ApiError::internal("the engine retracted a request it cannot resume");
                        let _ = live.events.try_send(GenEvent::Failed(err));
                    }
                }
                Event::Finished { req, finish, text, prompt_tokens, completion_tokens } => {
                    if !text.is_empty() {
                        self.send(req, GenEvent::Text { text, logprobs: None });
                    }
                    if let Some(live) = self.live.remove(&req) {
                        tracing::debug!(
                            request_id = %live.request_id,
                            prompt_tokens,
                            completion_tokens,
                            reason = finish.as_str(),
                            "finished"
                        );
                        let _ = live.events.try_send(GenEvent::Finished {
                            reason: finish,
                            prompt_tokens: prompt_tokens as usize,
                            completion_tokens: completion_tokens as usize,
                            // The colocated engine has no prefix cache.
                            cached_tokens: 0,
                        });
                    }
                }
            }
        }
    }

    /// A step failed: the batch's state is unknown, so every active request fails.
    fn fail_all(&mut self, e: &EngineError) {
        tracing::error!(error = %e, active = self.live.len(), "engine step failed; failing every active request");
        let err = ApiError::internal(format!("The engine failed: {e}"));
        let ids: Vec<RequestId> = self.live.keys().copied().collect();
        for id in ids {
            if let Some(live) = self.live.get(&id) {
                let _ = live.events.try_send(GenEvent::Failed(err.clone()));
            }
            self.abort(id, "engine step failed");
        }
    }
}

/// The API error for a refused admission.
fn admission_error(e: EngineError) -> ApiError {
    match e {
        EngineError::Refused(r) => ApiError::refused(&r, "messages"),
        EngineError::PoolFull(e) => ApiError::overloaded(format!("The server is at capacity (KV cache full: {e}). Please retry later.")),
        EngineError::Sampling(e @ SamplingError::InvalidTemperature { .. }) => ApiError::invalid_request("temperature", e.to_string()),
        EngineError::Sampling(e @ SamplingError::InvalidTopP { .. }) => ApiError::invalid_request("top_p", e.to_string()),
        e => ApiError::internal(format!("The engine refused the request: {e}")),
    }
}
