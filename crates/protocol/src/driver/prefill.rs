//! The prefill job loop, over any transport and any model.
//!
//! One [`PrefillDriver::step`] is one unit of work: take the next job and lease its pages
//! in the worker's own pool, then (if the role says it may go on and its KV connection is
//! up) compute one chunk of it, export the chunk's KV addressed to the decode worker's
//! pages, send those chunks, and after the last one end the job with the role. Between
//! steps the caller feeds events ([`PrefillDriver::handle`]), so an abort that arrives
//! while a long prompt is computed takes effect at the next chunk boundary (I3).

use std::collections::VecDeque;

use bulkhead_kv::transfer::{export_chunks, Manifest};
use bulkhead_kv::{KvError, KvPool, RequestId, SequenceKv};

use crate::driver::Honest;
use crate::msg::{Message, Sampling, WorkerId};

use crate::prefill::{JobOutcome, PrefillAction, PrefillEvent, PrefillFailure, PrefillJob, PrefillRole};

/// How the first token after a prompt is picked.
#[derive(Clone, Copy, Debug)]
pub struct FirstToken<'a> {
    /// The request's sampling settings.
    pub sampling: &'a Sampling,
    /// Draws the request's sampler made before (a retracted request's tokens): a seeded
    /// sampler skips them, so it picks up where it was.
    pub skip_draws: u32,
}

/// What computes prompt KV: a model, over the worker's own pool.
pub trait PrefillCompute {
    /// The model's error.
    type Error: std::fmt::Display;
    /// Compute and commit the KV of prompt positions `from..to` into `seq` (in `pool`,
    /// reserved for the whole prompt, `from` positions committed). After the last
    /// position, the first generated token, picked as `first` says.
    fn compute(&mut self, pool: &mut KvPool, seq: &mut SequenceKv, tokens: &[u32], from: usize, to: usize, first: FirstToken<'_>) -> Result<Option<u32>, Self::Error>;
}

/// The KV connection to the target decode worker is gone: the job stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("no KV connection to {0}")]
pub struct LinkDown(pub WorkerId);

/// Where a prefill worker's messages go.
pub trait PrefillLink {
    /// Send to the gateway.
    fn to_gateway(&mut self, msg: Message);
    /// Send on the KV connection to `to`. An error means no message reaches it any more;
    /// the transport reports the loss as [`PrefillEvent::DecodeLost`] as well.
    fn to_decode(&mut self, to: WorkerId, msg: Message) -> Result<(), LinkDown>;
    /// Open a KV connection to `decode` at `addr` and send `KvHello` on it; report the
    /// outcome as [`PrefillEvent::DecodeConnected`] or [`PrefillEvent::DecodeLost`].
    fn connect(&mut self, decode: WorkerId, addr: &str);
    /// Leave the cluster and register anew under a new id: close the gateway connection
    /// and every KV connection, then start over with a fresh driver (see
    /// [`PrefillDriver::abandon`]).
    fn rejoin(&mut self);
}

/// Where a driver may depart from the role's decisions. Production uses [`Honest`]; the
/// broken implementations live in the checkers' crates.
pub trait PrefillPolicy {
    /// The role refused `job` at admission. An honest driver sends the refusal and drops
    /// the job. The incident's scheduler recorded the error where nobody read it and kept a
    /// placeholder of the refused prompt running: returning one here swallows the refusal
    /// and runs the placeholder behind the role's back, its chunks and "done" included.
    fn refused(&mut self, job: &PrefillJob) -> Option<PrefillJob> {
        let _ = job;
        None
    }
}

impl PrefillPolicy for Honest {}

/// A job in progress: its own pages, how far it got, the manifest of what it sent.
#[derive(Debug)]
struct Job {
    job: PrefillJob,
    seq: SequenceKv,
    done: usize,
    manifest: Manifest,
    /// Run for the policy, outside the role (only a broken policy makes these).
    rogue: bool,
}

/// What one step did, for the caller's logs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Nothing to do.
    Idle,
    /// Computed positions `from..to` of `req` and sent `chunks` chunks of it.
    Computed { req: RequestId, from: usize, to: usize, chunks: usize },
    /// `req` ended; the role sent its final messages. `unreleased` says why its own pages
    /// could not be given back normally (a stale lease: a bug), if so; they were reclaimed.
    Ended { req: RequestId, outcome: JobOutcome, unreleased: Option<KvError> },
}

/// The prefill driver: the role, the running job and the chunk size.
#[derive(Debug)]
pub struct PrefillDriver<P: PrefillPolicy = Honest> {
    role: PrefillRole,
    job: Option<Job>,
    /// Prompt positions per step (a whole number of pages).
    chunk_tokens: usize,
    /// Jobs the policy keeps running outside the role.
    rogue: VecDeque<PrefillJob>,
    policy: P,
}

impl PrefillDriver<Honest> {
    /// The production driver over `role`, computing `chunk_tokens` positions per step.
    pub fn new(role: PrefillRole, chunk_tokens: usize) -> Self {
        Self::with_policy(role, chunk_tokens, Honest)
    }
}

impl<P: PrefillPolicy> PrefillDriver<P> {
    /// A driver that departs from the role where `policy` says so.
    pub fn with_policy(role: PrefillRole, chunk_tokens: usize, policy: P) -> Self {
        PrefillDriver { role, job: None, chunk_tokens: chunk_tokens.max(1), rogue: VecDeque::new(), policy }
    }

    /// The role, for its counters and state.
    pub fn role(&self) -> &PrefillRole {
        &self.role
    }

    /// The policy, for what a checker's broken policy recorded.
    pub fn policy_mut(&mut self) -> &mut P {
        &mut self.policy
    }

    /// The request being computed, if any (a job taken and not yet ended).
    pub fn current(&self) -> Option<RequestId> {
        self.current_job().map(|j| j.req)
    }

    /// The job being computed, if any.
    pub fn current_job(&self) -> Option<&PrefillJob> {
        self.job.as_ref().map(|j| &j.job)
    }

    /// The decode pages every job in progress here may still write: the running job's
    /// and the queued ones' (for the model checker's no-late-write property).
    pub fn targets(&self) -> impl Iterator<Item = &PrefillJob> {
        self.job.iter().map(|j| &j.job).chain(self.role.queued_jobs()).chain(self.rogue.iter())
    }

    /// Whether a step would do something (queued jobs whose KV connection is down wait).
    pub fn has_work(&self) -> bool {
        self.job.is_some() || self.role.has_ready_job() || !self.rogue.is_empty()
    }

    /// Whether nothing is queued, running or held.
    pub fn is_idle(&self) -> bool {
        self.job.is_none() && self.role.queued() == 0 && !self.role.busy() && self.rogue.is_empty()
    }

    /// Process one event and carry out the role's actions.
    pub fn handle(&mut self, ev: PrefillEvent, link: &mut impl PrefillLink) {
        let refused_job = match &ev {
            PrefillEvent::Gateway(Message::Prefill { req, tokens, decode, pages, sampling, skip_draws, trace }) => Some(PrefillJob {
                req: *req,
                tokens: tokens.clone(),
                decode: *decode,
                pages: pages.clone(),
                sampling: sampling.clone(),
                skip_draws: *skip_draws,
                trace: trace.clone(),
            }),
            _ => None,
        };
        let mut acts = self.role.handle(ev);
        if let Some(job) = refused_job {
            let refused = acts.iter().any(|a| matches!(a, PrefillAction::ToGateway(Message::Rejected { req, .. }) if *req == job.req));
            if refused && let Some(keep) = self.policy.refused(&job) {
                acts.retain(|a| !matches!(a, PrefillAction::ToGateway(m) | PrefillAction::ToDecode { msg: m, .. } if m.req() == Some(job.req)));
                self.rogue.push_back(keep);
            }
        }
        act(acts, link);
    }

    /// Give up this driver (the worker rejoins under a new id): the running job's own pages
    /// go back to `pool`. Nothing is sent: the connections close.
    pub fn abandon(self, pool: &mut KvPool) {
        if let Some(j) = self.job
            && let Err(u) = j.seq.release(pool)
        {
            u.reclaim(pool);
        }
    }

    /// One unit of work (see the module docs), computing with `model` into the worker's
    /// own `pool`.
    pub fn step(&mut self, model: &mut impl PrefillCompute, pool: &mut KvPool, link: &mut impl PrefillLink) -> Step {
        if self.job.is_none() {
            let (job, rogue) = match self.role.next_job() {
                Some(job) => (job, false),
                None => match self.rogue.pop_front() {
                    Some(job) => (job, true),
                    None => return Step::Idle,
                },
            };
            let mut seq = SequenceKv::new(job.req);
            if let Err(e) = seq.reserve(pool, job.tokens.len()) {
                // Reserve is all or nothing: nothing is leased.
                let outcome = JobOutcome::Failed(PrefillFailure::NoPages(e));
                return self.finish(Job { job, seq, done: 0, manifest: Manifest::default(), rogue }, outcome, pool, link);
            }
            self.job = Some(Job { job, seq, done: 0, manifest: Manifest::default(), rogue });
        }
        let Some(mut j) = self.job.take() else { return Step::Idle };
        let req = j.job.req;
        if !j.rogue && !self.role.keep_going(req) {
            return self.finish(j, JobOutcome::Stopped, pool, link);
        }
        let n = j.job.tokens.len();
        let (from, to) = (j.done, (j.done + self.chunk_tokens).min(n));
        let first_token = FirstToken { sampling: &j.job.sampling, skip_draws: j.job.skip_draws };
        let first = match model.compute(pool, &mut j.seq, &j.job.tokens, from, to, first_token) {
            Ok(first) => first,
            Err(e) => return self.finish(j, JobOutcome::Failed(PrefillFailure::Compute(e.to_string())), pool, link),
        };
        let chunks = match export_chunks(pool, &j.seq, &j.job.pages, from, to, &mut j.manifest) {
            Ok(chunks) => chunks,
            Err(e) => return self.finish(j, JobOutcome::Failed(PrefillFailure::Export(e)), pool, link),
        };
        let sent = chunks.len();
        for (header, data) in chunks {
            if link.to_decode(j.job.decode, Message::KvChunk { req, header, data }).is_err() {
                return self.finish(j, JobOutcome::Stopped, pool, link);
            }
        }
        j.done = to;
        if to < n {
            self.job = Some(j);
            return Step::Computed { req, from, to, chunks: sent };
        }
        let outcome = match first {
            Some(first_token) => JobOutcome::Done { tokens: n as u32, first_token, manifest: j.manifest.digest() },
            None => JobOutcome::Failed(PrefillFailure::NoFirstToken),
        };
        self.finish(j, outcome, pool, link)
    }

    /// End a job: its own pages go back, the role sends its final messages.
    fn finish(&mut self, j: Job, outcome: JobOutcome, pool: &mut KvPool, link: &mut impl PrefillLink) -> Step {
        let req = j.job.req;
        let unreleased = match j.seq.release(pool) {
            Ok(_) => None,
            Err(u) => {
                // Only a stale lease fails here, and nothing else can reach these pages.
                let why = u.error.clone();
                u.reclaim(pool);
                Some(why)
            }
        };
        if j.rogue {
            if let JobOutcome::Done { tokens, first_token, manifest } = outcome {
                let _ = link.to_decode(j.job.decode, Message::Done { req, tokens, first_token, manifest });
            }
        } else {
            act(self.role.job_ended(req, outcome.clone()), link);
        }
        Step::Ended { req, outcome, unreleased }
    }
}

fn act(acts: Vec<PrefillAction>, link: &mut impl PrefillLink) {
    for a in acts {
        match a {
            PrefillAction::ToGateway(m) => link.to_gateway(m),
            // A connection that is gone was reported (or will be) as `DecodeLost`, which
            // fails or fences what was meant to travel on it.
            PrefillAction::ToDecode { to, msg } => {
                let _ = link.to_decode(to, msg);
            }
            PrefillAction::Connect { decode, addr } => link.connect(decode, &addr),
            PrefillAction::Rejoin => link.rejoin(),
        }
    }
}
