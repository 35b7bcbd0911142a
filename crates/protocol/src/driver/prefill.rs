//! The prefill job loop, over any transport and any model.
//!
//! One [`PrefillDriver::step`] is one unit of work: take the next job and lease its pages
//! in the worker's own pool, then (if the role says it may go on and its KV connection is
//! up) compute one chunk of it, export the chunk's KV addressed to the decode worker's
//! pages, send those chunks, and after the last one end the job with the role. Between
//! steps the caller feeds events ([`PrefillDriver::handle`]), so an abort that arrives
//! while a long prompt is computed takes effect at the next chunk boundary (I3).
//!
//! With a prefix cache ([`PrefillDriver::with_cache`]), a job first shares the longest
//! cached run of its prompt's full pages under its own scope (the pool checks the fence,
//! I7), computes only the rest, and still sends the whole prompt's KV, cached pages
//! included, for the decode worker to verify as always. A finished job's new full pages
//! are published to the cache; what was stored and evicted goes to the gateway.

use std::collections::VecDeque;

use bulkhead_kv::transfer::{export_chunks, Manifest};
use bulkhead_kv::{CacheStats, Fence, KvError, KvPool, PageKey, PrefixCache, RequestId, SequenceKv};

use crate::cache::CacheScope;
use crate::driver::Honest;
use crate::msg::{Message, Sampling, TokenLogprobs, WorkerId};

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
    /// position, the first generated token, picked as `first` says, with its
    /// log-probabilities if the request asked for them.
    fn compute(&mut self, pool: &mut KvPool, seq: &mut SequenceKv, tokens: &[u32], from: usize, to: usize, first: FirstToken<'_>) -> Result<Option<(u32, Option<TokenLogprobs>)>, Self::Error>;
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
    /// The keys of the full pages of a job's prompt in the prefix cache. An honest driver
    /// keys them under the job's scope ([`CacheScope::page_keys`]); a broken one may leave
    /// the scope out, which the pool's fence then has to catch.
    fn page_keys(&mut self, scope: &CacheScope, model_digest: u64, tokens: &[u32], page_size: usize) -> Vec<PageKey> {
        scope.page_keys(model_digest, tokens, page_size)
    }
}

impl PrefillPolicy for Honest {}

/// A job in progress: its pages, how far it got, the manifest of what it sent.
#[derive(Debug)]
struct Job {
    job: PrefillJob,
    seq: SequenceKv,
    /// Prompt positions whose KV exists (cached or computed).
    done: usize,
    /// Prompt positions whose KV was sent.
    sent: usize,
    /// Leading positions taken from the cache.
    cached: usize,
    /// The prompt's page keys and fence, if it uses the cache.
    keys: Vec<PageKey>,
    fence: Option<Fence>,
    manifest: Manifest,
    /// Run for the policy, outside the role (only a broken policy makes these).
    rogue: bool,
}

impl Job {
    fn new(job: PrefillJob, seq: SequenceKv, rogue: bool) -> Self {
        Job { job, seq, done: 0, sent: 0, cached: 0, keys: Vec::new(), fence: None, manifest: Manifest::default(), rogue }
    }
}

/// A prefill worker's prefix cache and what its keys need.
#[derive(Debug)]
struct Cache {
    cache: PrefixCache,
    model_digest: u64,
}

/// What one step did, for the caller's logs.
#[derive(Clone, Debug, PartialEq)]
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
    cache: Option<Cache>,
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
        PrefillDriver { role, job: None, chunk_tokens: chunk_tokens.max(1), rogue: VecDeque::new(), policy, cache: None }
    }

    /// The same driver with a prefix cache over the worker's pool, for the model with
    /// digest `model_digest` (part of every page key).
    pub fn with_cache(mut self, cache: PrefixCache, model_digest: u64) -> Self {
        self.cache = Some(Cache { cache, model_digest });
        self
    }

    /// The prefix cache, if there is one.
    pub fn cache(&self) -> Option<&PrefixCache> {
        self.cache.as_ref().map(|c| &c.cache)
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
            PrefillEvent::Gateway(Message::Prefill { req, tokens, decode, pages, sampling, skip_draws, trace, cache }) => Some(PrefillJob {
                req: *req,
                tokens: tokens.clone(),
                decode: *decode,
                pages: pages.clone(),
                sampling: sampling.clone(),
                skip_draws: *skip_draws,
                trace: trace.clone(),
                cache: *cache,
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

    /// Give up this driver (the worker rejoins under a new id): the running job's pages
    /// go back to `pool`, and so does the cache (the gateway's index of it was of the old
    /// id). Nothing is sent: the connections close. Returns the cache's final counts, its
    /// evictions here included.
    pub fn abandon(self, pool: &mut KvPool) -> Option<CacheStats> {
        if let Some(j) = self.job
            && let Err(u) = j.seq.release(pool)
        {
            u.reclaim(pool);
        }
        self.cache.map(|mut c| {
            c.cache.make_room(pool, pool.total_pages());
            c.cache.stats()
        })
    }

    /// Starts `job`: shares its cached prefix (if it uses the cache), makes room and
    /// leases pages for the rest. On failure the job comes back with why; nothing is held.
    fn start(&mut self, job: PrefillJob, rogue: bool, pool: &mut KvPool) -> Result<Job, (Job, PrefillFailure)> {
        let n = job.tokens.len();
        let seq = SequenceKv::new(job.req);
        let mut j = Job::new(job, seq, rogue);
        if let (Some(c), Some(scope)) = (self.cache.as_mut(), j.job.cache) {
            let ps = pool.layout().page_size;
            j.keys = self.policy.page_keys(&scope, c.model_digest, &j.job.tokens, ps);
            let fence = scope.fence();
            j.fence = Some(fence);
            // The last position is always computed: its logits pick the first token.
            let most = n.saturating_sub(1) / ps;
            match c.cache.lookup(pool, &j.keys, most, j.job.req, fence, n) {
                Ok(shared) => {
                    let pages = shared.len();
                    if let Err(shared) = j.seq.attach_shared(pool, shared) {
                        shared.into_iter().for_each(|l| drop(pool.unshare(l)));
                    } else {
                        j.cached = pages * ps;
                    }
                }
                Err(e) => return Err((j, PrefillFailure::Cache(e))),
            }
            // A cache under pressure gives way: what a cold pool would serve is served.
            let need = pool.layout().pages_for_tokens(n) - j.seq.pages().len();
            c.cache.make_room(pool, need);
        }
        j.done = j.cached;
        if let Err(e) = j.seq.reserve(pool, n) {
            // Reserve is all or nothing: only the shared prefix is held, and finish gives
            // it back.
            return Err((j, PrefillFailure::NoPages(e)));
        }
        Ok(j)
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
            match self.start(job, rogue, pool) {
                Ok(j) => self.job = Some(j),
                Err((j, why)) => return self.finish(j, JobOutcome::Failed(why), pool, link),
            }
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
        // The cached prefix travels with the first computed chunk: the decode worker
        // verifies every prompt page, wherever its KV came from.
        let chunks = match export_chunks(pool, &j.seq, &j.job.pages, j.sent, to, &mut j.manifest) {
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
        j.sent = to;
        if to < n {
            self.job = Some(j);
            return Step::Computed { req, from, to, chunks: sent };
        }
        let outcome = match first {
            Some((first_token, first_logprobs)) => JobOutcome::Done { tokens: n as u32, first_token, first_logprobs, manifest: j.manifest.digest(), cached: j.cached as u32 },
            None => JobOutcome::Failed(PrefillFailure::NoFirstToken),
        };
        self.finish(j, outcome, pool, link)
    }

    /// End a job: a finished one's new full pages go to the cache, every other page goes
    /// back, the role sends its final messages, the gateway hears what the cache changed.
    fn finish(&mut self, j: Job, outcome: JobOutcome, pool: &mut KvPool, link: &mut impl PrefillLink) -> Step {
        let req = j.job.req;
        let done = matches!(outcome, JobOutcome::Done { .. });
        let unreleased = match (self.cache.as_mut(), j.fence) {
            (Some(c), Some(fence)) if done => {
                c.cache.finish(pool, j.seq, &j.keys, fence);
                None
            }
            _ => match j.seq.release(pool) {
                Ok(_) => None,
                Err(u) => {
                    // Only a stale lease fails here, and nothing else can reach these pages.
                    let why = u.error.clone();
                    u.reclaim(pool);
                    Some(why)
                }
            },
        };
        if let Some(c) = self.cache.as_mut() {
            let (stored, evicted) = c.cache.take_changes();
            if !stored.is_empty() || !evicted.is_empty() {
                link.to_gateway(Message::CacheReport { stored, evicted });
            }
        }
        if j.rogue {
            if let JobOutcome::Done { tokens, first_token, first_logprobs, manifest, cached } = outcome.clone() {
                let _ = link.to_decode(j.job.decode, Message::Done { req, tokens, first_token, manifest, cached, first_logprobs });
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
