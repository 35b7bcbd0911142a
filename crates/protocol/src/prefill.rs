//! The prefill worker's protocol state machine: its queue of jobs and what ends them.
//!
//! I3: a job refused at admission or aborted is answered (to the gateway and, with
//! `Fenced`, to the decode worker waiting for it) and never computed or transferred
//! afterwards; a running job stops at the next chunk boundary. Every job ends with exactly
//! one final message to its decode worker: `Done` or `Fenced`.

use std::collections::VecDeque;

use bulkhead_kv::{PageRef, RequestId};

use crate::msg::*;

/// Limits of a prefill worker.
#[derive(Clone, Debug)]
pub struct PrefillConfig {
    /// Longest prompt admitted: the model's context and the KV pool's capacity, whichever
    /// is smaller (the incident's prefill pool was smaller than the advertised context).
    pub max_prompt: usize,
    /// Tokens per KV page (the decode worker's must match).
    pub page_size: usize,
}

/// A prompt to compute and send.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefillJob {
    /// The request.
    pub req: RequestId,
    /// Prompt tokens.
    pub tokens: Vec<u32>,
    /// Decode worker receiving the KV.
    pub decode: WorkerId,
    /// Its pages for the prompt, in order.
    pub pages: Vec<PageRef>,
    /// How to pick the first token.
    pub sampling: Sampling,
    /// Where the request came from, for the worker's logs.
    pub trace: TraceContext,
}

/// How the driver's work on a job ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobOutcome {
    /// All chunks sent.
    Done { tokens: u32, first_token: u32, manifest: u64 },
    /// Stopped early because [`PrefillRole::keep_going`] said so.
    Stopped,
    /// Compute failed.
    Failed(String),
}

/// What the driver must send.
#[derive(Debug, PartialEq)]
pub enum PrefillAction {
    /// Send to the gateway.
    ToGateway(Message),
    /// Send on the KV connection to a decode worker.
    ToDecode { to: WorkerId, msg: Message },
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
}

/// The prefill worker's protocol state.
#[derive(Debug)]
pub struct PrefillRole {
    cfg: PrefillConfig,
    queue: VecDeque<PrefillJob>,
    running: Option<(RequestId, WorkerId, bool)>,
    stats: PrefillStats,
    #[cfg(feature = "incident-replay")]
    incident_bug: bool,
}

impl PrefillRole {
    /// An idle prefill role.
    pub fn new(cfg: PrefillConfig) -> Self {
        PrefillRole {
            cfg,
            queue: VecDeque::new(),
            running: None,
            stats: PrefillStats::default(),
            #[cfg(feature = "incident-replay")]
            incident_bug: false,
        }
    }

    /// Test only: the incident's scheduler. A prompt over the limit is not refused; it keeps
    /// flowing as a 1-token placeholder whose "done" the decode side may trust.
    #[cfg(feature = "incident-replay")]
    pub fn replay_incident_bug(&mut self) {
        self.incident_bug = true;
    }

    /// Counters.
    pub fn stats(&self) -> PrefillStats {
        self.stats
    }

    /// Jobs waiting.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Whether a job is being computed.
    pub fn busy(&self) -> bool {
        self.running.is_some()
    }

    /// A message from the gateway.
    pub fn handle(&mut self, m: Message) -> Vec<PrefillAction> {
        let mut out = Vec::new();
        match m {
            Message::Prefill { req, tokens, decode, pages, sampling, trace } => {
                let fence = PrefillAction::ToDecode { to: decode, msg: Message::Fenced { req } };
                let refuse = |reason, detail: String| PrefillAction::ToGateway(Message::Rejected { req, reason, detail });
                let duplicate = self.running.is_some_and(|r| r.0 == req) || self.queue.iter().any(|j| j.req == req);
                #[cfg(feature = "incident-replay")]
                if self.incident_bug && tokens.len() > self.cfg.max_prompt {
                    self.queue.push_back(PrefillJob { req, tokens: tokens.iter().take(1).copied().collect(), decode, pages: pages.iter().take(1).copied().collect(), sampling, trace });
                    return out;
                }
                if tokens.len() > self.cfg.max_prompt {
                    // Worker-side admission (I3, I5): terminal, before any compute or transfer.
                    self.stats.rejected_context += 1;
                    let why = format!("prompt of {} tokens exceeds this prefill worker's {}", tokens.len(), self.cfg.max_prompt);
                    out.push(refuse(RejectReason::ContextLength, why));
                    out.push(fence);
                } else if tokens.is_empty() || pages.len() != tokens.len().div_ceil(self.cfg.page_size) || duplicate {
                    self.stats.rejected_invalid += 1;
                    let why = format!("{} tokens with {} target pages (duplicate: {duplicate})", tokens.len(), pages.len());
                    out.push(refuse(RejectReason::Invalid, why));
                    if !duplicate {
                        out.push(fence);
                    }
                } else {
                    self.stats.admitted += 1;
                    self.queue.push_back(PrefillJob { req, tokens, decode, pages, sampling, trace });
                }
            }
            Message::Abort { req, .. } => {
                if let Some(i) = self.queue.iter().position(|j| j.req == req) {
                    if let Some(j) = self.queue.remove(i) {
                        self.stats.aborted += 1;
                        out.push(PrefillAction::ToDecode { to: j.decode, msg: Message::Fenced { req } });
                    }
                } else if let Some(r) = self.running.as_mut().filter(|r| r.0 == req) {
                    r.2 = true;
                }
            }
            _ => {}
        }
        out
    }

    /// Take the next job to compute. One runs at a time.
    pub fn next_job(&mut self) -> Option<PrefillJob> {
        if self.running.is_some() {
            return None;
        }
        let j = self.queue.pop_front()?;
        self.running = Some((j.req, j.decode, false));
        Some(j)
    }

    /// Between chunks: whether the running job `req` should go on (false once aborted).
    pub fn keep_going(&self, req: RequestId) -> bool {
        self.running.is_some_and(|r| r.0 == req && !r.2)
    }

    /// The driver ended the running job; returns the final message(s) for it.
    pub fn job_ended(&mut self, req: RequestId, outcome: JobOutcome) -> Vec<PrefillAction> {
        let Some((r, decode, aborted)) = self.running.take() else { return Vec::new() };
        if r != req {
            self.running = Some((r, decode, aborted));
            return Vec::new();
        }
        match outcome {
            JobOutcome::Done { tokens, first_token, manifest } if !aborted => {
                self.stats.completed += 1;
                vec![PrefillAction::ToDecode { to: decode, msg: Message::Done { req, tokens, first_token, manifest } }]
            }
            JobOutcome::Done { .. } | JobOutcome::Stopped => {
                self.stats.aborted += 1;
                vec![PrefillAction::ToDecode { to: decode, msg: Message::Fenced { req } }]
            }
            JobOutcome::Failed(detail) => vec![
                PrefillAction::ToDecode { to: decode, msg: Message::Fenced { req } },
                PrefillAction::ToGateway(Message::Failed { req, reason: FailReason::Internal, detail }),
            ],
        }
    }

    /// The KV connection to `decode` closed: its jobs cannot be delivered; drop them.
    pub fn decode_closed(&mut self, decode: WorkerId) -> Vec<PrefillAction> {
        let mut out = Vec::new();
        self.queue.retain(|j| {
            if j.decode == decode {
                out.push(PrefillAction::ToGateway(Message::Failed {
                    req: j.req,
                    reason: FailReason::WorkerLost,
                    detail: "decode worker connection closed".into(),
                }));
                false
            } else {
                true
            }
        });
        if let Some(r) = self.running.as_mut().filter(|r| r.1 == decode) {
            r.2 = true;
        }
        out
    }
}
