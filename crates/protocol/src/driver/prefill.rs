//! The prefill job loop, over any transport and any model.
//!
//! One [`PrefillDriver::step`] is one forward pass over a batch of jobs: end the jobs the
//! role stopped, take queued jobs (leasing their pages in the worker's own pool) while the
//! step's token budget has room and their pages fit, give each running job its next chunk
//! within that budget, compute all the chunks together, then for each job export its
//! chunk's KV addressed to the decode worker's pages, send it, and after its last chunk
//! end the job with the role. Between steps the caller feeds events
//! ([`PrefillDriver::handle`]), so an abort that arrives while a long prompt is computed
//! takes effect at the next chunk boundary (I3).
//!
//! Budget ([`Batching`]): jobs are served in the order they were taken, each at most
//! `chunk_tokens` per step, until `step_tokens` are planned; a chunk that does not end its
//! prompt is a whole number of pages. So a long prompt takes one chunk a step and the rest
//! of the budget goes to the jobs behind it: it does not hold short prompts back, and no
//! job waits for ever (the oldest is always served first). With a cache, a queued job that
//! starts with the same full page as a running job of its scope waits for that job to end,
//! so it shares the pages instead of computing them again beside it.
//!
//! With a prefix cache ([`PrefillDriver::with_cache`]), a job first shares the longest
//! cached run of its prompt's full pages under its own scope (the pool checks the fence,
//! I7), computes only the rest, and still sends the whole prompt's KV, cached pages
//! included, for the decode worker to verify as always. A finished job's new full pages
//! are published to the cache; what was stored and evicted goes to the gateway.

use bulkhead_fingerprint::Fingerprint;
use std::collections::VecDeque;

use bulkhead_kv::transfer::{ChunkExport, Manifest};
use bulkhead_kv::{CacheStats, Fence, KvError, KvPool, PageKey, PrefixCache, RequestId, SequenceKv};

use crate::cache::CacheScope;
use crate::driver::Honest;
use crate::msg::{Message, Sampling, TokenLogprobs, TraceContext, WorkerId};

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

/// One job's part of a prefill step: prompt positions `from..to` of `tokens`, into `seq`
/// (reserved for the whole prompt, `from` positions committed).
#[derive(Debug)]
pub struct Chunk<'a> {
    /// The job's pages in the worker's pool.
    pub seq: &'a mut SequenceKv,
    /// The whole prompt.
    pub tokens: &'a [u32],
    /// First position to compute.
    pub from: usize,
    /// One past the last position to compute.
    pub to: usize,
    /// How to pick the first token, when `to` ends the prompt.
    pub first: FirstToken<'a>,
}

/// The first token after a prompt, with its log-probabilities if the request asked.
pub type First = (u32, Option<TokenLogprobs>);

/// What computes prompt KV: a model, over the worker's own pool.
pub trait PrefillCompute {
    /// The model's error.
    type Error: std::fmt::Display;
    /// Compute and commit the KV of every chunk (in `pool`) in one pass. Returns, for each
    /// chunk in order, the first generated token if the chunk ends its prompt, picked as
    /// its `first` says. On an error nothing is committed (a chunk's KV may be half
    /// written; a later pass overwrites it).
    fn compute(&mut self, pool: &mut KvPool, chunks: &mut [Chunk<'_>]) -> Result<Vec<Option<First>>, Self::Error>;
}

/// How much a step computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
pub struct Batching {
    /// Most prompt positions of one job per step (a whole number of pages).
    pub chunk_tokens: usize,
    /// Most prompt positions of all jobs together per step (`--max-prefill-tokens`).
    pub step_tokens: usize,
}

impl Batching {
    /// One job's chunk at a time: `chunk_tokens` per step in all.
    pub fn one_chunk(chunk_tokens: usize) -> Self {
        Batching { chunk_tokens, step_tokens: chunk_tokens }
    }
}

/// The KV connection to the target decode worker is gone: the job stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("no KV connection to {0}")]
pub struct LinkDown(pub WorkerId);

/// Why a job's chunks stopped going out.
#[derive(Debug, thiserror::Error)]
pub enum ChunkSendError {
    /// A chunk could not be exported: the job fails.
    #[error("exporting a KV chunk: {0}")]
    Export(#[from] KvError),
    /// The KV connection is gone: the job stops.
    #[error(transparent)]
    Down(#[from] LinkDown),
}

/// Where a prefill worker's messages go.
pub trait PrefillLink {
    /// Send to the gateway.
    fn to_gateway(&mut self, msg: Message);
    /// Send on the KV connection to `to`. An error means no message reaches it any more;
    /// the transport reports the loss as [`PrefillEvent::DecodeLost`] as well.
    fn to_decode(&mut self, to: WorkerId, msg: Message) -> Result<(), LinkDown>;
    /// Send every chunk of `chunks` to `to`, in order, as `KvChunk`s of `req`; returns how
    /// many went. By default each is exported into its own message for
    /// [`PrefillLink::to_decode`] (the simulated links look at them); the production link
    /// exports each straight into its frame buffer.
    fn to_decode_chunks(&mut self, to: WorkerId, req: RequestId, chunks: &mut ChunkExport<'_>) -> Result<usize, ChunkSendError> {
        let mut sent = 0;
        loop {
            let mut data = Vec::new();
            let Some(header) = chunks.next_into(&mut data) else { return Ok(sent) };
            self.to_decode(to, Message::KvChunk { req, header: header?, data: data.into() })?;
            sent += 1;
        }
    }
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
#[derive(Debug, Fingerprint)]
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
#[derive(Debug, Fingerprint)]
struct Cache {
    cache: PrefixCache,
    model_digest: u64,
}

/// What one step did to one job, for the caller's logs ([`PrefillDriver::step`] returns
/// one per job it touched; none when there was nothing to do).
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// Computed positions `from..to` of `req` and sent `chunks` chunks of it.
    Computed { req: RequestId, from: usize, to: usize, chunks: usize },
    /// `req` ended; the role sent its final messages. `unreleased` says why its own pages
    /// could not be given back normally (a stale lease: a bug), if so; they were reclaimed.
    /// `trace` is the job's, for the worker's log line of its end.
    Ended { req: RequestId, outcome: JobOutcome, unreleased: Option<KvError>, trace: TraceContext },
}

/// The prefill driver: the role, the running jobs and the step budget.
#[derive(Debug, Fingerprint)]
pub struct PrefillDriver<P: PrefillPolicy = Honest> {
    role: PrefillRole,
    /// Jobs in progress, in the order they were taken.
    jobs: Vec<Job>,
    batching: Batching,
    /// Jobs the policy keeps running outside the role.
    rogue: VecDeque<PrefillJob>,
    policy: P,
    cache: Option<Cache>,
}

impl PrefillDriver<Honest> {
    /// The production driver over `role`, computing as `batching` says.
    pub fn new(role: PrefillRole, batching: Batching) -> Self {
        Self::with_policy(role, batching, Honest)
    }
}

impl<P: PrefillPolicy> PrefillDriver<P> {
    /// A driver that departs from the role where `policy` says so.
    pub fn with_policy(role: PrefillRole, batching: Batching, policy: P) -> Self {
        let chunk_tokens = batching.chunk_tokens.max(1);
        let batching = Batching { chunk_tokens, step_tokens: batching.step_tokens.max(chunk_tokens) };
        PrefillDriver { role, jobs: Vec::new(), batching, rogue: VecDeque::new(), policy, cache: None }
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

    /// The jobs being computed (taken and not yet ended), in the order they were taken.
    pub fn running(&self) -> impl Iterator<Item = &PrefillJob> {
        self.jobs.iter().map(|j| &j.job)
    }

    /// The decode pages every job in progress here may still write: the running jobs'
    /// and the queued ones' (for the model checker's no-late-write property).
    pub fn targets(&self) -> impl Iterator<Item = &PrefillJob> {
        self.running().chain(self.role.queued_jobs()).chain(self.rogue.iter())
    }

    /// Whether a step would do something (queued jobs whose KV connection is down wait).
    pub fn has_work(&self) -> bool {
        !self.jobs.is_empty() || self.role.has_ready_job() || !self.rogue.is_empty()
    }

    /// Whether nothing is queued, running or held.
    pub fn is_idle(&self) -> bool {
        self.jobs.is_empty() && self.role.queued() == 0 && !self.role.busy() && self.rogue.is_empty()
    }

    /// Process one event and carry out the role's actions.
    pub fn handle(&mut self, ev: PrefillEvent, link: &mut impl PrefillLink) {
        let refused_job = match &ev {
            PrefillEvent::Gateway {
                msg: Message::Prefill { req, tokens, decode, held, pages, sampling, skip_draws, trace, cache },
                ..
            } => Some(PrefillJob {
                req: *req,
                tokens: tokens.clone(),
                decode: *decode,
                held: *held,
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
                acts.retain(
                    |a| !matches!(a, PrefillAction::ToGateway(m) | PrefillAction::ToDecode { msg: m, .. } if m.req() == Some(job.req)),
                );
                self.rogue.push_back(keep);
            }
        }
        act(acts, link);
    }

    /// Give up this driver (the worker rejoins under a new id): the running jobs' pages
    /// go back to `pool`, and so does the cache (the gateway's index of it was of the old
    /// id). Nothing is sent: the connections close. Returns the cache's final counts, its
    /// evictions here included.
    pub fn abandon(self, pool: &mut KvPool) -> Option<CacheStats> {
        for j in self.jobs {
            if let Err(u) = j.seq.release(pool) {
                u.reclaim(pool);
            }
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

    /// One step (see the module docs), computing with `model` into the worker's own
    /// `pool`. Returns what happened to each job it touched, in order.
    pub fn step(&mut self, model: &mut impl PrefillCompute, pool: &mut KvPool, link: &mut impl PrefillLink) -> Vec<Step> {
        let mut out = Vec::new();
        // Stopped jobs end first, so their pages are free for the jobs taken next.
        for j in std::mem::take(&mut self.jobs) {
            if j.rogue || self.role.keep_going(j.job.req) {
                self.jobs.push(j);
            } else {
                out.push(self.finish(j, JobOutcome::Stopped, pool, link));
            }
        }
        self.take_jobs(pool, link, &mut out);
        let plan = self.plan(pool.layout().page_size);
        if plan.iter().all(|&(from, to)| from == to) {
            return out;
        }
        let results = compute(model, pool, &mut self.jobs, &plan);
        for ((mut j, (from, to)), result) in std::mem::take(&mut self.jobs).into_iter().zip(plan).zip(results) {
            if from == to {
                self.jobs.push(j);
                continue;
            }
            let req = j.job.req;
            let first = match result {
                Ok(first) => first,
                Err(e) => {
                    out.push(self.finish(j, JobOutcome::Failed(PrefillFailure::Compute(e)), pool, link));
                    continue;
                }
            };
            // The cached prefix travels with the first computed chunk: the decode worker
            // verifies every prompt page, wherever its KV came from; only what the decode
            // worker holds already (`held`) stays here.
            let held = j.job.held as usize;
            let mut chunks = ChunkExport::new(pool, &j.seq, &j.job.pages, held, j.sent, to, &mut j.manifest);
            let sent = match link.to_decode_chunks(j.job.decode, req, &mut chunks) {
                Ok(sent) => sent,
                Err(ChunkSendError::Export(e)) => {
                    out.push(self.finish(j, JobOutcome::Failed(PrefillFailure::Export(e)), pool, link));
                    continue;
                }
                Err(ChunkSendError::Down(_)) => {
                    out.push(self.finish(j, JobOutcome::Stopped, pool, link));
                    continue;
                }
            };
            j.done = to;
            j.sent = to;
            let n = j.job.tokens.len();
            if to < n {
                self.jobs.push(j);
                out.push(Step::Computed { req, from, to, chunks: sent });
                continue;
            }
            let outcome = match first {
                Some((first_token, first_logprobs)) => JobOutcome::Done {
                    tokens: n as u32,
                    first_token,
                    first_logprobs,
                    manifest: j.manifest.digest(),
                    cached: j.cached as u32,
                },
                None => JobOutcome::Failed(PrefillFailure::NoFirstToken),
            };
            out.push(self.finish(j, outcome, pool, link));
        }
        out
    }

    /// Each running job's positions this step, `(from, to)` (equal: none), within the
    /// budget and in the order the jobs were taken.
    fn plan(&self, page_size: usize) -> Vec<(usize, usize)> {
        // At least a page per step, or a job whose prompt is longer would never move.
        let chunk = self.batching.chunk_tokens.max(page_size);
        let mut left = self.batching.step_tokens.max(chunk);
        self.jobs
            .iter()
            .map(|j| {
                let rest = j.job.tokens.len() - j.done;
                let mut n = rest.min(chunk).min(left);
                if n < rest {
                    n -= n % page_size;
                }
                left -= n;
                (j.done, j.done + n)
            })
            .collect()
    }

    /// Take queued jobs (the role's, then the policy's) while the step's budget has room
    /// for them and their pages fit beside the running jobs'. A job is always taken when
    /// none runs, so one that can never fit fails instead of waiting for ever.
    fn take_jobs(&mut self, pool: &mut KvPool, link: &mut impl PrefillLink, out: &mut Vec<Step>) {
        let ps = pool.layout().page_size;
        loop {
            let alone = self.jobs.is_empty();
            let planned: usize = self.plan(ps).iter().map(|(from, to)| to - from).sum();
            // A job taken now gets at least a page (or its whole prompt) this step.
            if !alone && planned + ps > self.batching.step_tokens {
                return;
            }
            let stats = pool.stats();
            // Cached pages nobody reads can be evicted to make room.
            let room = stats.free_pages + stats.cached_pages;
            let fits = |j: &PrefillJob| alone || pool.layout().pages_for_tokens(j.tokens.len()) <= room;
            // A job whose first page missing from the cache a running job of its scope will
            // publish waits for it to end and publish its pages (the siblings of `n > 1`),
            // rather than computing the same prefix beside it. Jobs that share only cached
            // pages (the conversations of one system prompt) run side by side.
            let cache = self.cache.as_ref();
            let jobs = &self.jobs;
            let defer = |j: &PrefillJob| {
                let (Some(c), Some(scope)) = (cache, j.cache) else { return false };
                let keys = scope.page_keys(c.model_digest, &j.tokens, ps);
                let lookup = j.tokens.len().saturating_sub(1) / ps;
                let Some(missing) = keys.iter().take(lookup).find(|k| !c.cache.contains(k)) else { return false };
                jobs.iter().any(|r| !r.rogue && r.job.cache == j.cache && r.keys.contains(missing))
            };
            let (job, rogue) = match self.role.next_job_if(defer, |j| fits(j)) {
                Some(job) => (job, false),
                None => match self.rogue.front() {
                    Some(j) if fits(j) => match self.rogue.pop_front() {
                        Some(j) => (j, true),
                        None => return,
                    },
                    _ => return,
                },
            };
            match self.start(job, rogue, pool) {
                Ok(j) => self.jobs.push(j),
                Err((j, PrefillFailure::NoPages(_))) if !alone && !j.rogue => {
                    // Shared cache pages the running jobs read could not be evicted: wait
                    // for them to end.
                    if let Err(u) = j.seq.release(pool) {
                        u.reclaim(pool);
                    }
                    act(self.role.requeue(j.job), link);
                    return;
                }
                Err((j, why)) => out.push(self.finish(j, JobOutcome::Failed(why), pool, link)),
            }
        }
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
        Step::Ended { req, outcome, unreleased, trace: j.job.trace }
    }
}

/// Computes the planned chunks of `jobs` in one pass. If that fails and there were several,
/// each is computed alone, so one job's failure fails only that job.
fn compute<M: PrefillCompute>(
    model: &mut M,
    pool: &mut KvPool,
    jobs: &mut [Job],
    plan: &[(usize, usize)],
) -> Vec<Result<Option<First>, String>> {
    let planned = plan.iter().filter(|(from, to)| from < to).count();
    let mut chunks: Vec<Chunk<'_>> = jobs
        .iter_mut()
        .zip(plan)
        .filter(|(_, (from, to))| from < to)
        .map(|(j, &(from, to))| Chunk {
            seq: &mut j.seq,
            tokens: &j.job.tokens,
            from,
            to,
            first: FirstToken { sampling: &j.job.sampling, skip_draws: j.job.skip_draws },
        })
        .collect();
    let results: Vec<Result<Option<First>, String>> = match model.compute(pool, &mut chunks) {
        Ok(firsts) if firsts.len() == planned => firsts.into_iter().map(Ok).collect(),
        Ok(firsts) => vec![Err(format!("{} results for {planned} chunks", firsts.len())); planned],
        Err(e) if planned == 1 => vec![Err(e.to_string())],
        Err(_) => chunks
            .iter_mut()
            .map(|c| match model.compute(pool, std::slice::from_mut(c)) {
                Ok(mut first) if first.len() == 1 => Ok(first.pop().flatten()),
                Ok(first) => Err(format!("{} results for 1 chunk", first.len())),
                Err(e) => Err(e.to_string()),
            })
            .collect(),
    };
    // One result per job, planned or not (an unplanned one's is never read). Every arm
    // above gives one per planned chunk; were one missing, its job fails rather than being
    // taken as computed.
    let mut results = results.into_iter();
    plan.iter()
        .map(|(from, to)| if from < to { results.next().unwrap_or_else(|| Err("no result for a planned chunk".into())) } else { Ok(None) })
        .collect()
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
