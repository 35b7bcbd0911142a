//! The decode worker process: receives KV from prefill workers, verifies it through the
//! protocol's decode role, and continuously batches verified sequences.
//!
//! Threads: one reader per connection (gateway, each prefill) feeding one channel; the main
//! thread owns the engine, the pool and the role, so protocol decisions and decode steps
//! never race. The worker exits when the gateway connection closes.

use std::collections::BTreeMap;
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_engine::{Engine, Event, FinishReason, SamplingParams};
use bulkhead_protocol::decode::{DecodeAction, DecodeConfig, DecodeEvent, DecodeRole};
use bulkhead_protocol::{Finish, Message, Role, WorkerId};

use crate::wire::{count_bad_connection, send, spawn_reader, FrameReader};
use crate::worker::{load, register, WorkerConfig, WorkerError};

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
    let (mut gw, gw_reader, me) = register(&cfg, &loaded, Role::Decode, kv_addr.clone())?;
    tracing::info!(worker = %me, kv_addr, pid = std::process::id(), "decode worker registered");
    let (tx, rx) = channel::<In>();
    spawn_reader(gw_reader, tx.clone(), In::Gateway, In::GatewayClosed);
    {
        let tx = tx.clone();
        std::thread::spawn(move || accept_prefills(listener, tx));
    }
    let crate::worker::Loaded { model, pool, context, .. } = loaded;
    let mut engine = Engine::new(Arc::new(model.model), Arc::new(model.tokenizer), pool, 512, context);
    let mut role = DecodeRole::new(DecodeConfig { max_context: context, transfer_timeout_ms: cfg.transfer_timeout_ms });
    let mut prefills: BTreeMap<WorkerId, TcpStream> = BTreeMap::new();
    let start = Instant::now();
    let mut last_tick = 0;
    loop {
        // Block only when nothing is decoding.
        let first = if engine.active() > 0 {
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
            let actions = role.handle(engine.pool_mut(), DecodeEvent::Tick { now_ms });
            act(actions, &mut engine, &mut role, &mut gw, &mut prefills)?;
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
                    prefills.insert(id, s);
                    continue;
                }
                In::PrefillClosed(from) => {
                    prefills.remove(&from);
                    DecodeEvent::PrefillClosed { from }
                }
            };
            let actions = role.handle(engine.pool_mut(), ev);
            act(actions, &mut engine, &mut role, &mut gw, &mut prefills)?;
        }
        if engine.active() > 0 {
            match engine.step() {
                Ok(events) => forward(events, &mut role, &mut gw)?,
                Err(e) => {
                    // A failed step leaves sequences in an unknown state: fail them all.
                    tracing::error!(error = %e, "decode step failed");
                    return Err(WorkerError::Io(std::io::Error::other(e.to_string())));
                }
            }
        }
    }
}

fn act(
    actions: Vec<DecodeAction>,
    engine: &mut Engine,
    role: &mut DecodeRole,
    gw: &mut TcpStream,
    prefills: &mut BTreeMap<WorkerId, TcpStream>,
) -> Result<(), WorkerError> {
    for a in actions {
        match a {
            DecodeAction::ToGateway(m) => {
                if let Message::Failed { req, detail, .. } | Message::Rejected { req, detail, .. } = &m {
                    tracing::warn!(request = %req, %detail, "request ended by the decode worker");
                }
                send(gw, &m)?
            }
            DecodeAction::ToPrefill { to, msg } => {
                if let Some(s) = prefills.get_mut(&to) {
                    // A broken prefill connection shows up as PrefillClosed from its reader.
                    let _ = send(s, &msg);
                }
            }
            DecodeAction::Start(ds) => {
                let req = ds.req;
                match engine.add_verified(ds.seq, ds.first_token, ds.max_tokens as usize, sampling(&ds.sampling), ds.stop) {
                    Ok((_, events)) => forward(events, role, gw)?,
                    Err(e) => {
                        role.finished(req);
                        send(gw, &Message::Failed { req, reason: bulkhead_protocol::FailReason::Internal, detail: e.to_string() })?;
                    }
                }
            }
            DecodeAction::Stop { req } => {
                let _ = engine.abort(req);
                role.finished(req);
            }
        }
    }
    Ok(())
}

fn forward(events: Vec<Event>, role: &mut DecodeRole, gw: &mut TcpStream) -> Result<(), WorkerError> {
    for ev in events {
        match ev {
            Event::Token { id, token, text } => send(gw, &Message::Token { req: id, token, text })?,
            Event::Finished { id, reason, text, prompt_tokens, completion_tokens } => {
                role.finished(id);
                let finish = if reason == FinishReason::Length { Finish::Length } else { Finish::Stop };
                send(
                    gw,
                    &Message::Finished { req: id, finish, text, prompt_tokens: prompt_tokens as u32, completion_tokens: completion_tokens as u32 },
                )?;
            }
        }
    }
    Ok(())
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
