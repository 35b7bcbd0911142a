//! The isolation probe: the acceptance test the incident lacked, against any
//! OpenAI-compatible server.
//!
//! Tenant A plants unique random codes ("canaries") in short and long prompts. Tenant B, at
//! the same time, sends long prompts, prompts over the served context, streams it hangs up
//! on mid-way and requests it disconnects from before the answer, then short follow-ups.
//! Every prompt ends by asking for the code (`What is the code? The code is`, plus the
//! first digit of its own code when it has one), so a request that reads another's KV
//! cache tends to *say* that request's code. Reported as findings:
//!
//! - **leak**: eight digits of a code in a row in the output of any request other than its
//!   owner's;
//! - **over-context not rejected**: a prompt longer than the context answered with anything
//!   but 4xx (the incident answered 200);
//! - **fact ignored**: long prompts whose answer does not repeat the code placed at their
//!   very start, on more than the allowed share of samples (a request attending over the
//!   wrong KV, or a prompt silently truncated, loses that code);
//! - **failed**: a well-formed request that fit the context failed.
//!
//! The content check relies on the model copying a code it saw thousands of tokens earlier
//! (induction). SmolLM2-135M did so in 28 of 28 calibration trials with this prompt form at
//! 300 to 2,000 filler words (the README's probe section has the calibration); for other
//! models the threshold (`fact_min_pass`) is a parameter. Requests the server sheds for
//! load (429, 503) are retried with backoff before they count as failed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::Semaphore;

use crate::ClientError;
use crate::dist::{Rng, code, sentences};
use crate::openai::{Api, Client, CompletionRequest, HangUp, Outcome};
use crate::stats::Summary;

/// Digits of each code.
pub const CODE_CHARS: usize = 10;
/// A leak is any run of this many consecutive digits of a code in another request's
/// output: 10^8 values each, so a chance match is out of the question, while a code copied
/// only in part (cut by `max_tokens`, or continued from a cue) still counts.
pub const MATCH_CHARS: usize = 8;
/// `max_tokens` of every request: room for a code and a few words.
pub const ANSWER_TOKENS: u32 = 24;
/// Times a request the server shed for load (429, 503) is sent again before it counts.
pub const MAX_RETRIES: u32 = 6;
/// Pause before the first retry; it doubles each time (0.25 s up to 8 s, ~16 s in all).
const RETRY_PAUSE: Duration = Duration::from_millis(250);

/// What to probe and how hard.
#[derive(Debug, Clone)]
pub struct ProbeConfig {
    /// Endpoint.
    pub api: Api,
    /// The `model` field; default: the first model the server lists.
    pub model: Option<String>,
    /// The served context in tokens; default: what the server says (`/v1/models`, else
    /// llama.cpp's `/props`). Given, it wins.
    pub context_length: Option<u64>,
    /// Rounds of the whole mix.
    pub rounds: usize,
    /// Words of filler in long prompts (about 1.2 tokens each; clamped to fit the context).
    pub long_words: usize,
    /// Words of filler in short prompts.
    pub short_words: usize,
    /// Requests in flight at once.
    pub concurrency: usize,
    /// Smallest share of long prompts whose answer must repeat their own code.
    pub fact_min_pass: f64,
    /// Disconnects happen after a uniform delay up to this.
    pub disconnect_max: Duration,
    /// Seed of codes, filler and timings.
    pub seed: u64,
}

/// Who sends a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Tenant {
    /// Plants canaries.
    A,
    /// Sends the risky traffic.
    B,
}

/// What a request is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// A: a short prompt with a code.
    CanaryShort,
    /// A: a long prompt with a code at its start (also a content-check sample).
    CanaryLong,
    /// B: a long prompt with its own code at its start (a content-check sample).
    Long,
    /// B: a prompt longer than the context; must get 4xx.
    OverContext,
    /// B: a streamed request hung up on after a few chunks.
    Aborted,
    /// B: a request whose connection is closed before the answer.
    Disconnected,
    /// B: a short prompt without a code, ending with the cue, after the aborts.
    FollowUp,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::CanaryShort => "canary-short",
            Kind::CanaryLong => "canary-long",
            Kind::Long => "long",
            Kind::OverContext => "over-context",
            Kind::Aborted => "aborted",
            Kind::Disconnected => "disconnected",
            Kind::FollowUp => "follow-up",
        }
    }

    /// Requests that fit the context and must succeed.
    fn must_succeed(self) -> bool {
        matches!(self, Kind::CanaryShort | Kind::CanaryLong | Kind::Long | Kind::FollowUp)
    }

    /// Long prompts whose answer must repeat their own code.
    fn fact_sample(self) -> bool {
        matches!(self, Kind::CanaryLong | Kind::Long)
    }
}

/// One request of the probe.
#[derive(Debug, Clone)]
struct Job {
    id: usize,
    tenant: Tenant,
    kind: Kind,
    /// The code in its prompt, if any.
    code: Option<String>,
    req: CompletionRequest,
    hang_up: HangUp,
    /// Close the connection after this long (disconnects).
    disconnect_after: Option<Duration>,
}

/// How a job ended.
#[derive(Debug)]
enum Ended {
    /// An answer (possibly an error status or a hang-up).
    Answer(Outcome),
    /// We closed the connection before it ended, as planned.
    Disconnected,
    /// The request could not be carried out.
    Error(ClientError),
}

#[derive(Debug)]
struct Done {
    job: Job,
    ended: Ended,
    /// Duration of the last attempt.
    elapsed: Duration,
    /// Attempts the server shed (429, 503) before the last.
    retries: u32,
}

/// A problem the probe found.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "finding", rename_all = "kebab-case")]
pub enum Finding {
    /// A request's code appeared in another request's output.
    Leak {
        /// Request that owned the code.
        owner: usize,
        /// Its tenant and kind.
        owner_tenant: Tenant,
        /// Its kind.
        owner_kind: Kind,
        /// Request whose output showed it.
        reader: usize,
        /// Its tenant.
        reader_tenant: Tenant,
        /// Its kind.
        reader_kind: Kind,
        /// The code.
        code: String,
        /// The reader's output.
        output: String,
    },
    /// A prompt over the context was not refused with 4xx.
    OverContextNotRejected {
        /// Request.
        request: usize,
        /// Status (0: no HTTP answer).
        status: u16,
        /// Prompt tokens the server reported, if it did.
        prompt_tokens: Option<u64>,
        /// Time to the answer (ms).
        latency_ms: f64,
        /// What went wrong, in words.
        detail: String,
    },
    /// Too few long prompts were answered with their own code.
    FactIgnored {
        /// Samples answered correctly.
        passed: usize,
        /// Samples.
        samples: usize,
        /// The share required.
        min_pass: f64,
        /// The failing answers (request, code, output).
        failures: Vec<(usize, String, String)>,
    },
    /// A request that fit the context failed.
    Failed {
        /// Request.
        request: usize,
        /// Its tenant.
        tenant: Tenant,
        /// Its kind.
        kind: Kind,
        /// Status (0: no HTTP answer).
        status: u16,
        /// The error.
        error: String,
    },
}

/// Counts and timings of one kind of request.
#[derive(Debug, Clone, Serialize)]
pub struct KindStats {
    /// Requests sent (retries not counted).
    pub sent: usize,
    /// Retries after the server shed load (429, 503).
    pub retries: u32,
    /// Answers by status (`"0"`: no HTTP answer; `"disconnected"`: closed by us first).
    pub statuses: BTreeMap<String, usize>,
    /// Time to the end, the hang-up or the disconnect (ms).
    pub latency_ms: Option<Summary>,
    /// Time to the first content chunk (ms).
    pub ttft_ms: Option<Summary>,
    /// Prompt tokens the server reported (mean).
    pub prompt_tokens_mean: Option<f64>,
}

/// The content check's tally.
#[derive(Debug, Clone, Serialize)]
pub struct FactCheck {
    /// Long prompts answered (successfully).
    pub samples: usize,
    /// Those whose answer repeated their own code.
    pub passed: usize,
    /// The share required.
    pub min_pass: f64,
    /// Filler words in long prompts.
    pub long_words: usize,
}

/// The result of a probe.
#[derive(Debug, Clone, Serialize)]
pub struct ProbeReport {
    /// Server.
    pub url: String,
    /// Model.
    pub model: String,
    /// Endpoint.
    pub api: Api,
    /// Context used for the over-context prompts.
    pub context: u64,
    /// Where it came from: `flag`, `/v1/models` or `/props`.
    pub context_source: String,
    /// What the server said, when a flag overrode it.
    pub server_context: Option<u64>,
    /// Words in over-context prompts.
    pub over_context_words: usize,
    /// Seed.
    pub seed: u64,
    /// Rounds.
    pub rounds: usize,
    /// Wall time (s).
    pub duration_s: f64,
    /// Per kind of request.
    pub requests: BTreeMap<Kind, KindStats>,
    /// The content check.
    pub fact_check: FactCheck,
    /// Codes planted, by tenant.
    pub codes_planted: BTreeMap<Tenant, usize>,
    /// Everything found; empty means the probe passed.
    pub findings: Vec<Finding>,
}

impl ProbeReport {
    /// No findings.
    pub fn passed(&self) -> bool {
        self.findings.is_empty()
    }
}

/// The prompt of a request: the code at the very start (when given), filler, then the
/// question and the cue, which for completions includes the code's first digit. (The form
/// SmolLM2-135M answered best in calibration: a digit code said twice, sentences rather than
/// loose words as filler, a question, and a cue that starts the copy.)
fn prompt(api: Api, code: Option<&str>, filler: &str) -> String {
    let head = code.map(|c| format!("The code is {c}. Remember it. {c} is the code. ")).unwrap_or_default();
    match api {
        Api::Completions => {
            format!("{head}{filler} What is the code? The code is {}", code.map_or("", |c| &c[..CUE_CHARS])).trim_end().to_string()
        }
        Api::Chat => format!("{head}{filler}\n\nWhat is the code? Answer with the code only."),
    }
}

/// Digits of a code given away in a completion prompt's cue.
const CUE_CHARS: usize = 1;

/// What a correct answer to a prompt carrying `code` contains: the rest of the code after
/// the cue (completions) or all of it (chat).
fn expected_answer(api: Api, code: &str) -> &str {
    match api {
        Api::Completions => &code[CUE_CHARS..],
        Api::Chat => code,
    }
}

/// The context: the flag, else `/v1/models`, else llama.cpp's `/props`.
async fn context(client: &Client, cfg: &ProbeConfig, listed: Option<u64>) -> Result<(u64, String, Option<u64>), ClientError> {
    let server = match listed {
        Some(c) => Some((c, "/v1/models")),
        None => match client.get_json("/props").await {
            Ok((200, v)) => v.pointer("/default_generation_settings/n_ctx").and_then(serde_json::Value::as_u64).map(|c| (c, "/props")),
            _ => None,
        },
    };
    match (cfg.context_length, server) {
        (Some(c), s) => Ok((c, "flag".into(), s.map(|s| s.0).filter(|&s| s != c))),
        (None, Some((c, src))) => Ok((c, src.into(), None)),
        (None, None) => Err(ClientError::Config(
            "the server does not say its context length (/v1/models max_model_len, /props n_ctx); pass --context-length".into(),
        )),
    }
}

/// Run the probe. Tenant clients carry their own keys and headers.
pub async fn run(a: &Client, b: &Client, cfg: &ProbeConfig) -> Result<ProbeReport, ClientError> {
    let start = Instant::now();
    let models = a.models().await?;
    let model = match &cfg.model {
        Some(m) => models.iter().find(|x| &x.id == m).cloned().unwrap_or(crate::openai::ModelInfo { id: m.clone(), context: None }),
        None => models.first().cloned().ok_or_else(|| ClientError::Config("the server lists no models; pass --model".into()))?,
    };
    let (ctx, context_source, server_context) = context(a, cfg, model.context).await?;
    // Filler words are 1.1-1.3 tokens each (at least one); leave room for the code, cue and answer.
    let fit = (ctx.saturating_sub(u64::from(ANSWER_TOKENS) + 64) * 2 / 3) as usize;
    let long_words = cfg.long_words.min(fit);
    let short_words = cfg.short_words.min(fit);
    if long_words < 16 {
        return Err(ClientError::Config(format!("a context of {ctx} tokens is too small to probe")));
    }
    let over_words = (ctx + (ctx / 8).max(64)) as usize;
    let mut rng = Rng::new(cfg.seed);
    let mut next_id = 0;
    let mut job = |tenant, kind, with_code: bool, filler_words: usize, rng: &mut Rng| {
        let code = with_code.then(|| code(rng, CODE_CHARS));
        let filler = sentences(rng, filler_words);
        let req = CompletionRequest {
            api: cfg.api,
            model: model.id.clone(),
            prompt: prompt(cfg.api, code.as_deref(), &filler),
            max_tokens: ANSWER_TOKENS,
            temperature: 0.0,
            ignore_eos: false,
            stream: true,
        };
        next_id += 1;
        Job { id: next_id, tenant, kind, code, req, hang_up: HangUp::Never, disconnect_after: None }
    };
    let mut done = Vec::new();
    for round in 0..cfg.rounds {
        // Phase 1: A plants while B sends long, over-context, aborted and disconnected requests.
        let mut plant = vec![
            job(Tenant::A, Kind::CanaryShort, true, short_words, &mut rng),
            job(Tenant::A, Kind::CanaryLong, true, long_words, &mut rng),
            job(Tenant::B, Kind::OverContext, true, over_words, &mut rng),
            job(Tenant::A, Kind::CanaryShort, true, short_words, &mut rng),
        ];
        for _ in 0..2 {
            let mut j = job(Tenant::B, Kind::Aborted, true, long_words / 2, &mut rng);
            j.hang_up = HangUp::AfterChunks(1 + rng.below(3) as usize);
            plant.push(j);
            let mut j = job(Tenant::B, Kind::Disconnected, true, long_words / 2, &mut rng);
            let max_ms = cfg.disconnect_max.as_millis().max(1) as u64;
            j.disconnect_after = Some(Duration::from_millis(rng.below(max_ms)));
            plant.push(j);
        }
        // Phase 2: B reads (long prompts, follow-ups) while A plants again.
        let read = vec![
            job(Tenant::B, Kind::Long, true, long_words, &mut rng),
            job(Tenant::B, Kind::FollowUp, false, short_words, &mut rng),
            job(Tenant::A, Kind::CanaryShort, true, short_words, &mut rng),
            job(Tenant::B, Kind::FollowUp, false, short_words, &mut rng),
        ];
        for (phase, jobs) in [("plant", plant), ("read", read)] {
            tracing::info!(round, phase, requests = jobs.len(), "probe phase");
            done.extend(run_jobs(a, b, jobs, cfg.concurrency).await);
        }
    }
    Ok(analyse(
        done,
        cfg,
        Meta {
            url: a.config().url.to_string(),
            model: model.id,
            context: ctx,
            context_source,
            server_context,
            over_words,
            long_words,
            elapsed: start.elapsed(),
        },
    ))
}

/// Run `jobs` with at most `concurrency` in flight; results in job order.
async fn run_jobs(a: &Client, b: &Client, jobs: Vec<Job>, concurrency: usize) -> Vec<Done> {
    let permits = Arc::new(Semaphore::new(concurrency.max(1)));
    let mut set = tokio::task::JoinSet::new();
    for job in jobs {
        let client = if job.tenant == Tenant::A { a.clone() } else { b.clone() };
        let permits = permits.clone();
        set.spawn(async move {
            // The semaphore is never closed, so acquiring cannot fail.
            let _permit = permits.acquire_owned().await.ok();
            let mut retries = 0;
            loop {
                let t0 = Instant::now();
                let fut = client.complete(&job.req, job.hang_up);
                let ended = match job.disconnect_after {
                    // Dropping the request's future closes its connection: the disconnect.
                    Some(after) => match tokio::time::timeout(after, fut).await {
                        Err(_) => Ended::Disconnected,
                        Ok(r) => r.map_or_else(Ended::Error, Ended::Answer),
                    },
                    None => fut.await.map_or_else(Ended::Error, Ended::Answer),
                };
                // Shedding load is an answer a client is meant to retry, not a failure.
                let shed = matches!(&ended, Ended::Answer(o) if o.status == 429 || o.status == 503);
                if !shed || retries == MAX_RETRIES {
                    return Done { job, ended, elapsed: t0.elapsed(), retries };
                }
                tokio::time::sleep(RETRY_PAUSE * 2u32.pow(retries)).await;
                retries += 1;
            }
        });
    }
    let mut out = Vec::new();
    while let Some(r) = set.join_next().await {
        match r {
            Ok(d) => out.push(d),
            Err(e) => tracing::error!(error = %e, "a probe task failed"),
        }
    }
    out.sort_by_key(|d| d.job.id);
    out
}

struct Meta {
    url: String,
    model: String,
    context: u64,
    context_source: String,
    server_context: Option<u64>,
    over_words: usize,
    long_words: usize,
    elapsed: Duration,
}

fn status_of(e: &Ended) -> u16 {
    match e {
        Ended::Answer(o) => o.status,
        _ => 0,
    }
}

/// Turn the finished requests into the report.
fn analyse(done: Vec<Done>, cfg: &ProbeConfig, m: Meta) -> ProbeReport {
    let mut findings = Vec::new();
    // Leaks: every output against every other request's code.
    let codes: Vec<(&Job, &str)> = done.iter().filter_map(|d| Some((&d.job, d.job.code.as_deref()?))).collect();
    for d in &done {
        let Ended::Answer(o) = &d.ended else { continue };
        for (owner, code) in &codes {
            let shows = |c: &str| c.as_bytes().windows(MATCH_CHARS).any(|w| o.text.as_bytes().windows(MATCH_CHARS).any(|x| x == w));
            if owner.id != d.job.id && shows(code) {
                findings.push(Finding::Leak {
                    owner: owner.id,
                    owner_tenant: owner.tenant,
                    owner_kind: owner.kind,
                    reader: d.job.id,
                    reader_tenant: d.job.tenant,
                    reader_kind: d.job.kind,
                    code: code.to_string(),
                    output: o.text.clone(),
                });
            }
        }
    }
    // Over-context prompts must be refused with 4xx.
    for d in done.iter().filter(|d| d.job.kind == Kind::OverContext) {
        let status = status_of(&d.ended);
        if !(400..500).contains(&status) {
            let (prompt_tokens, detail) = match &d.ended {
                Ended::Answer(o) => (
                    o.usage.map(|u| u.prompt_tokens),
                    format!("answered {status}: {:.200}", o.error.clone().unwrap_or_else(|| o.text.clone())),
                ),
                Ended::Error(e) => (None, e.to_string()),
                Ended::Disconnected => (None, "disconnected".into()),
            };
            findings.push(Finding::OverContextNotRejected { request: d.job.id, status, prompt_tokens, latency_ms: ms(d.elapsed), detail });
        }
    }
    // Well-formed requests must succeed; an aborted one must succeed up to the hang-up.
    for d in &done {
        let failed = match &d.ended {
            Ended::Answer(o) => (d.job.kind.must_succeed() || d.job.kind == Kind::Aborted) && !o.ok(true),
            Ended::Error(_) => d.job.kind.must_succeed() || d.job.kind == Kind::Aborted,
            Ended::Disconnected => false,
        };
        if failed {
            let error = match &d.ended {
                Ended::Answer(o) => o.error.clone().unwrap_or_else(|| "the stream ended without [DONE]".into()),
                Ended::Error(e) => e.to_string(),
                Ended::Disconnected => String::new(),
            };
            findings.push(Finding::Failed {
                request: d.job.id,
                tenant: d.job.tenant,
                kind: d.job.kind,
                status: status_of(&d.ended),
                error,
            });
        }
    }
    // The content check over long prompts that were answered.
    let mut failures = Vec::new();
    let mut samples = 0;
    for d in done.iter().filter(|d| d.job.kind.fact_sample()) {
        let (Ended::Answer(o), Some(code)) = (&d.ended, &d.job.code) else { continue };
        if !o.ok(true) {
            continue;
        }
        samples += 1;
        if !o.text.contains(expected_answer(cfg.api, code)) {
            failures.push((d.job.id, code.clone(), o.text.clone()));
        }
    }
    let passed = samples - failures.len();
    if samples > 0 && (passed as f64) < cfg.fact_min_pass * samples as f64 {
        findings.push(Finding::FactIgnored { passed, samples, min_pass: cfg.fact_min_pass, failures });
    }
    let mut requests: BTreeMap<Kind, Vec<&Done>> = BTreeMap::new();
    for d in &done {
        requests.entry(d.job.kind).or_default().push(d);
    }
    let requests = requests.into_iter().map(|(k, ds)| (k, kind_stats(&ds))).collect();
    let mut codes_planted = BTreeMap::new();
    for (j, _) in &codes {
        *codes_planted.entry(j.tenant).or_insert(0) += 1;
    }
    ProbeReport {
        url: m.url,
        model: m.model,
        api: cfg.api,
        context: m.context,
        context_source: m.context_source,
        server_context: m.server_context,
        over_context_words: m.over_words,
        seed: cfg.seed,
        rounds: cfg.rounds,
        duration_s: m.elapsed.as_secs_f64(),
        requests,
        fact_check: FactCheck { samples, passed, min_pass: cfg.fact_min_pass, long_words: m.long_words },
        codes_planted,
        findings,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn kind_stats(ds: &[&Done]) -> KindStats {
    let mut statuses = BTreeMap::new();
    let (mut latency, mut ttft, mut prompt) = (Vec::new(), Vec::new(), Vec::new());
    for d in ds {
        let key = match &d.ended {
            Ended::Answer(o) if o.hung_up => format!("{} (hung up)", o.status),
            Ended::Answer(o) => o.status.to_string(),
            Ended::Disconnected => "disconnected".into(),
            Ended::Error(e) => format!("error: {}", e.kind()),
        };
        *statuses.entry(key).or_insert(0) += 1;
        latency.push(ms(d.elapsed));
        if let Ended::Answer(o) = &d.ended {
            ttft.extend(o.ttft.map(ms));
            prompt.extend(o.usage.map(|u| u.prompt_tokens as f64));
        }
    }
    KindStats {
        sent: ds.len(),
        retries: ds.iter().map(|d| d.retries).sum(),
        statuses,
        latency_ms: Summary::of(&latency),
        ttft_ms: Summary::of(&ttft),
        prompt_tokens_mean: (!prompt.is_empty()).then(|| prompt.iter().sum::<f64>() / prompt.len() as f64),
    }
}

impl std::fmt::Display for ProbeReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "probe: {} model {}, context {} tokens (from {}", self.url, self.model, self.context, self.context_source)?;
        if let Some(s) = self.server_context {
            write!(f, "; the server says {s}")?;
        }
        writeln!(f, "), {} rounds, seed {}, {:.1} s", self.rounds, self.seed, self.duration_s)?;
        writeln!(
            f,
            "  {:<13} {:>4} {:>7}  {:<34} {:>9} {:>9} {:>9}",
            "requests", "sent", "retries", "answers", "p50 ms", "max ms", "prompt"
        )?;
        for (k, s) in &self.requests {
            let answers = s.statuses.iter().map(|(k, n)| format!("{k} x{n}")).collect::<Vec<_>>().join(", ");
            let (p50, max) = s.latency_ms.map_or((0.0, 0.0), |l| (l.p50, l.max));
            let prompt = s.prompt_tokens_mean.map_or("-".to_string(), |p| format!("{p:.0}"));
            writeln!(f, "  {:<13} {:>4} {:>7}  {:<34} {:>9.0} {:>9.0} {:>9}", k.name(), s.sent, s.retries, answers, p50, max, prompt)?;
        }
        let fc = &self.fact_check;
        writeln!(
            f,
            "  content check: {}/{} long prompts (~{} words, code at the start) answered with their own code; required {:.0}%",
            fc.passed,
            fc.samples,
            fc.long_words,
            fc.min_pass * 100.0
        )?;
        writeln!(f, "  codes planted: {}", self.codes_planted.iter().map(|(t, n)| format!("{t:?} {n}")).collect::<Vec<_>>().join(", "))?;
        if self.findings.is_empty() {
            return writeln!(f, "  findings: none");
        }
        writeln!(f, "  FINDINGS: {}", self.findings.len())?;
        for x in &self.findings {
            match x {
                Finding::Leak { owner, owner_tenant, owner_kind, reader, reader_tenant, reader_kind, code, output } => writeln!(
                    f,
                    "  - LEAK: code {code} of request {owner} (tenant {owner_tenant:?}, {}) in the output of request {reader} (tenant {reader_tenant:?}, {}): {output:?}",
                    owner_kind.name(),
                    reader_kind.name()
                )?,
                Finding::OverContextNotRejected { request, status, prompt_tokens, latency_ms, detail } => writeln!(
                    f,
                    "  - OVER-CONTEXT NOT REJECTED: request {request} ({} words > context {}) got status {status} after {latency_ms:.0} ms, prompt_tokens {}: {detail}",
                    self.over_context_words,
                    self.context,
                    prompt_tokens.map_or("-".to_string(), |p| p.to_string())
                )?,
                Finding::FactIgnored { passed, samples, min_pass, failures } => {
                    writeln!(
                        f,
                        "  - FACT IGNORED: only {passed}/{samples} long prompts answered with their own code (need {:.0}%)",
                        min_pass * 100.0
                    )?;
                    for (id, code, out) in failures {
                        writeln!(f, "      request {id}: code {code}, answer {out:?}")?;
                    }
                }
                Finding::Failed { request, tenant, kind, status, error } => {
                    writeln!(f, "  - FAILED: request {request} (tenant {tenant:?}, {}) status {status}: {error:.300}", kind.name())?
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(status: u16, text: &str) -> Ended {
        Ended::Answer(Outcome { status, text: text.into(), done: true, ..Outcome::default() })
    }

    fn done(id: usize, tenant: Tenant, kind: Kind, code: Option<&str>, ended: Ended) -> Done {
        let req = CompletionRequest {
            api: Api::Completions,
            model: "m".into(),
            prompt: String::new(),
            max_tokens: 1,
            temperature: 0.0,
            ignore_eos: false,
            stream: true,
        };
        Done {
            job: Job { id, tenant, kind, code: code.map(str::to_string), req, hang_up: HangUp::Never, disconnect_after: None },
            ended,
            elapsed: Duration::from_millis(5),
            retries: 0,
        }
    }

    fn cfg() -> ProbeConfig {
        ProbeConfig {
            api: Api::Completions,
            model: None,
            context_length: None,
            rounds: 1,
            long_words: 100,
            short_words: 10,
            concurrency: 4,
            fact_min_pass: 0.5,
            disconnect_max: Duration::from_millis(10),
            seed: 1,
        }
    }

    fn meta() -> Meta {
        Meta {
            url: "u".into(),
            model: "m".into(),
            context: 100,
            context_source: "flag".into(),
            server_context: None,
            over_words: 200,
            long_words: 50,
            elapsed: Duration::ZERO,
        }
    }

    #[test]
    fn a_clean_run_has_no_findings() {
        let r = analyse(
            vec![
                // The answer continues the code after the cue's first digit.
                done(1, Tenant::A, Kind::CanaryLong, Some("1234567890"), outcome(200, "234567890.")),
                done(2, Tenant::B, Kind::OverContext, Some("9876543210"), outcome(400, "")),
                // Seven digits of A's code are a coincidence, not a leak.
                done(3, Tenant::B, Kind::FollowUp, None, outcome(200, " 1234567 and 4567890")),
                done(4, Tenant::B, Kind::Disconnected, Some("5555555555"), Ended::Disconnected),
            ],
            &cfg(),
            meta(),
        );
        assert!(r.passed(), "{r}");
        assert_eq!((r.fact_check.samples, r.fact_check.passed), (1, 1));
    }

    #[test]
    fn each_kind_of_problem_is_a_finding() {
        let r = analyse(
            vec![
                done(1, Tenant::A, Kind::CanaryShort, Some("1234567890"), outcome(200, "234567890")),
                // B says eight digits from the middle of A's code: a leak.
                done(2, Tenant::B, Kind::FollowUp, None, outcome(200, " 34567890.")),
                // The incident: an over-context prompt answered 200.
                done(3, Tenant::B, Kind::OverContext, Some("9876543210"), outcome(200, "fluent")),
                // A long prompt that ignores its own code.
                done(4, Tenant::B, Kind::Long, Some("5550001112"), outcome(200, " something else")),
                // A short request that fit and failed.
                done(5, Tenant::A, Kind::CanaryShort, Some("1112223334"), outcome(500, "")),
            ],
            &cfg(),
            meta(),
        );
        let kinds: Vec<&str> = r
            .findings
            .iter()
            .map(|f| match f {
                Finding::Leak { owner: 1, reader: 2, .. } => "leak",
                Finding::OverContextNotRejected { request: 3, status: 200, .. } => "over",
                Finding::FactIgnored { passed: 0, samples: 1, .. } => "fact",
                Finding::Failed { request: 5, status: 500, .. } => "failed",
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(kinds, ["leak", "over", "failed", "fact"], "{r}");
        assert!(!r.passed());
        assert!(r.to_string().contains("LEAK"));
    }

    #[test]
    fn prompts_put_the_code_first_and_end_with_the_cue() {
        let p = prompt(Api::Completions, Some("7595518512"), "The dog sees the cat.");
        assert_eq!(p, "The code is 7595518512. Remember it. 7595518512 is the code. The dog sees the cat. What is the code? The code is 7");
        assert_eq!(expected_answer(Api::Completions, "7595518512"), "595518512");
        assert_eq!(prompt(Api::Completions, None, "X."), "X. What is the code? The code is");
        assert!(prompt(Api::Chat, Some("7595518512"), "X.").ends_with("Answer with the code only."));
    }
}
