//! A load generator: `concurrency` clients, each sending one request after another until a
//! request count or a duration is reached (requests in flight at the deadline finish and
//! count). Prompts and output lengths come from seeded distributions, so two runs with one
//! seed send the same requests. Reports throughput, time to first token and inter-token
//! latency.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::ClientError;
use crate::dist::{Dist, Rng, words};
use crate::openai::{Api, Client, CompletionRequest, HangUp, Outcome};
use crate::stats::Summary;

/// Error messages kept per report (the counts cover all).
const ERROR_EXAMPLES: usize = 5;

/// What to send and how much.
#[derive(Debug, Clone)]
pub struct LoadgenConfig {
    /// Endpoint.
    pub api: Api,
    /// The `model` field.
    pub model: String,
    /// Clients sending at once.
    pub concurrency: usize,
    /// Stop after this many requests (not counting warm-up).
    pub requests: Option<u64>,
    /// Stop starting requests after this long.
    pub duration: Option<Duration>,
    /// Prompt length in words (about one token each).
    pub prompt_tokens: Dist,
    /// `max_tokens` of each request.
    pub output_tokens: Dist,
    /// Seed of prompts and lengths.
    pub seed: u64,
    /// Send `ignore_eos: true`, so each request generates exactly `max_tokens`.
    pub ignore_eos: bool,
    /// Stream (needed for TTFT and inter-token latency).
    pub stream: bool,
    /// Sampling temperature.
    pub temperature: f32,
    /// Requests sent one at a time before measuring (not counted).
    pub warmup: u64,
}

impl LoadgenConfig {
    /// Request number `index` of a run: the same for the same seed.
    pub fn request(&self, index: u64) -> CompletionRequest {
        let mut rng = Rng::for_index(self.seed, index);
        let prompt_words = self.prompt_tokens.sample(&mut rng) as usize;
        let max_tokens = self.output_tokens.sample(&mut rng);
        CompletionRequest {
            api: self.api,
            model: self.model.clone(),
            prompt: words(&mut rng, prompt_words),
            max_tokens,
            temperature: self.temperature,
            ignore_eos: self.ignore_eos,
            stream: self.stream,
        }
    }
}

/// One finished request.
#[derive(Debug)]
struct Sample {
    result: Result<Outcome, String>,
    /// Error kind when the request failed.
    kind: Option<String>,
    max_tokens: u32,
}

impl Sample {
    fn new(r: Result<Outcome, ClientError>, streamed: bool, max_tokens: u32) -> Sample {
        let (result, kind) = match classify(r, streamed) {
            Ok(o) => (Ok(o), None),
            Err((kind, msg)) => (Err(msg), Some(kind)),
        };
        Sample { result, kind, max_tokens }
    }
}

/// A request's result as success, or `(kind, message)` of its failure: a client error, a
/// non-2xx status, an error event, or a stream cut short.
/// Failures by kind, with the first few messages (each cut to 300 characters), as the
/// reports show them.
#[derive(Debug, Default)]
pub(crate) struct Failures {
    pub(crate) errors: BTreeMap<String, u64>,
    pub(crate) examples: Vec<String>,
}

impl Failures {
    /// One failure of `kind`; its `message` is kept while fewer than `keep` are.
    pub(crate) fn record(&mut self, kind: &str, message: Option<&str>, keep: usize) {
        *self.errors.entry(kind.to_owned()).or_insert(0) += 1;
        if let Some(m) = message.filter(|_| self.examples.len() < keep) {
            self.examples.push(m.chars().take(300).collect());
        }
    }
}

pub(crate) fn classify(r: Result<Outcome, ClientError>, streamed: bool) -> Result<Outcome, (String, String)> {
    match r {
        Err(e) => Err((e.kind().to_string(), e.to_string())),
        Ok(o) if o.ok(streamed) => Ok(o),
        Ok(o) => {
            let kind = if !(200..300).contains(&o.status) {
                format!("http_{}", o.status)
            } else if o.error.is_some() {
                "stream_error".into()
            } else {
                "incomplete_stream".into()
            };
            let msg = o.error.clone().unwrap_or_else(|| "the stream ended without [DONE]".into());
            Err((kind, msg))
        }
    }
}

/// Where output token counts came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenSource {
    /// Every request's `usage`.
    Usage,
    /// Counted content chunks (the server sent no usage).
    Chunks,
    /// Some of each.
    Mixed,
    /// No successful request.
    None,
}

/// The result of a run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Server.
    pub url: String,
    /// Endpoint.
    pub api: Api,
    /// Model asked for.
    pub model: String,
    /// Clients at once.
    pub concurrency: usize,
    /// Prompt length distribution (words).
    pub prompt_words: Dist,
    /// `max_tokens` distribution.
    pub max_tokens: Dist,
    /// Seed.
    pub seed: u64,
    /// Streamed.
    pub stream: bool,
    /// `ignore_eos` sent.
    pub ignore_eos: bool,
    /// Requests sent (measured ones).
    pub requests: u64,
    /// Requests that succeeded.
    pub ok: u64,
    /// Requests that failed.
    pub failed: u64,
    /// Failures by kind.
    pub errors: BTreeMap<String, u64>,
    /// The first few failure messages.
    pub error_examples: Vec<String>,
    /// Wall time of the measured phase (s).
    pub duration_s: f64,
    /// Successful requests per second.
    pub requests_per_s: f64,
    /// Output tokens of successful requests per second.
    pub output_tokens_per_s: f64,
    /// Output tokens of successful requests.
    pub output_tokens: u64,
    /// Where those counts came from.
    pub output_tokens_from: TokenSource,
    /// Successful requests that returned fewer tokens than `max_tokens` (ended early).
    pub short_outputs: u64,
    /// Mean prompt tokens as the server counted them (`usage`), if it said.
    pub prompt_tokens_mean: Option<f64>,
    /// Time to first token (ms), streamed requests.
    pub ttft_ms: Option<Summary>,
    /// Gaps between content chunks (ms), all streamed requests together.
    pub itl_ms: Option<Summary>,
    /// Whole-request latency (ms).
    pub latency_ms: Option<Summary>,
}

/// Run the load against `client`'s server.
pub async fn run(client: &Client, cfg: &LoadgenConfig) -> Result<Report, ClientError> {
    if cfg.requests.is_none() && cfg.duration.is_none() {
        return Err(ClientError::Config("give a request count or a duration".into()));
    }
    if cfg.concurrency == 0 {
        return Err(ClientError::Config("concurrency must be at least 1".into()));
    }
    for i in 0..cfg.warmup {
        let r = client.complete(&cfg.request(i), HangUp::Never).await;
        tracing::debug!(i, ok = r.as_ref().is_ok_and(|o| o.ok(cfg.stream)), "warm-up request");
    }
    let next = Arc::new(AtomicU64::new(0));
    let samples = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let deadline = cfg.duration.map(|d| start + d);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..cfg.concurrency {
        let (client, cfg, next, samples) = (client.clone(), cfg.clone(), next.clone(), samples.clone());
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if cfg.requests.is_some_and(|n| i >= n) || deadline.is_some_and(|d| Instant::now() >= d) {
                    break;
                }
                let req = cfg.request(cfg.warmup + i);
                let r = client.complete(&req, HangUp::Never).await;
                let s = Sample::new(r, cfg.stream, req.max_tokens);
                samples.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(s);
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        if let Err(e) = r {
            return Err(ClientError::Config(format!("a client task failed: {e}")));
        }
    }
    let elapsed = start.elapsed();
    let samples = std::mem::take(&mut *samples.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
    Ok(report(client, cfg, &samples, elapsed))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn report(client: &Client, cfg: &LoadgenConfig, samples: &[Sample], elapsed: Duration) -> Report {
    let mut failures = Failures::default();
    let (mut ttft, mut itl, mut latency, mut prompt) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut ok, mut tokens, mut short, mut from_usage) = (0u64, 0u64, 0u64, 0u64);
    for s in samples {
        match &s.result {
            Err(msg) => failures.record(s.kind.as_deref().unwrap_or_default(), Some(msg), ERROR_EXAMPLES),
            Ok(o) => {
                ok += 1;
                let n = o.output_tokens();
                tokens += n;
                short += u64::from(n < u64::from(s.max_tokens));
                if let Some(u) = o.usage {
                    from_usage += 1;
                    prompt.push(u.prompt_tokens as f64);
                }
                ttft.extend(o.ttft.map(ms));
                itl.extend(o.itl.iter().copied().map(ms));
                latency.push(ms(o.latency));
            }
        }
    }
    let secs = elapsed.as_secs_f64().max(1e-9);
    Report {
        url: client.config().url.to_string(),
        api: cfg.api,
        model: cfg.model.clone(),
        concurrency: cfg.concurrency,
        prompt_words: cfg.prompt_tokens,
        max_tokens: cfg.output_tokens,
        seed: cfg.seed,
        stream: cfg.stream,
        ignore_eos: cfg.ignore_eos,
        requests: samples.len() as u64,
        ok,
        failed: samples.len() as u64 - ok,
        errors: failures.errors,
        error_examples: failures.examples,
        duration_s: secs,
        requests_per_s: ok as f64 / secs,
        output_tokens_per_s: tokens as f64 / secs,
        output_tokens: tokens,
        output_tokens_from: match (ok, from_usage) {
            (0, _) => TokenSource::None,
            (n, u) if u == n => TokenSource::Usage,
            (_, 0) => TokenSource::Chunks,
            _ => TokenSource::Mixed,
        },
        short_outputs: short,
        prompt_tokens_mean: (!prompt.is_empty()).then(|| prompt.iter().sum::<f64>() / prompt.len() as f64),
        ttft_ms: Summary::of(&ttft),
        itl_ms: Summary::of(&itl),
        latency_ms: Summary::of(&latency),
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "loadgen: {} {} (model {}), {} concurrent, prompt {} words, max_tokens {}{}, seed {}",
            self.url,
            match self.api {
                Api::Completions => "/v1/completions",
                Api::Chat => "/v1/chat/completions",
            },
            self.model,
            self.concurrency,
            self.prompt_words,
            self.max_tokens,
            if self.ignore_eos { " (ignore_eos)" } else { "" },
            self.seed
        )?;
        writeln!(f, "  requests      {} ok, {} failed in {:.2} s", self.ok, self.failed, self.duration_s)?;
        writeln!(f, "  requests/s    {:.3}", self.requests_per_s)?;
        let from = match self.output_tokens_from {
            TokenSource::Usage => "usage",
            TokenSource::Chunks => "streamed chunks",
            TokenSource::Mixed => "usage and streamed chunks",
            TokenSource::None => "-",
        };
        write!(f, "  output tok/s  {:.1}   ({} tokens, counted from {from}", self.output_tokens_per_s, self.output_tokens)?;
        if let Some(p) = self.prompt_tokens_mean {
            write!(f, "; mean prompt {p:.1} tokens")?;
        }
        writeln!(f, ")")?;
        if self.short_outputs > 0 {
            writeln!(f, "  note: {} requests ended before max_tokens", self.short_outputs)?;
        }
        for (name, s) in [("TTFT ms", &self.ttft_ms), ("ITL ms", &self.itl_ms), ("latency ms", &self.latency_ms)] {
            if let Some(s) = s {
                writeln!(f, "  {name:<12}  p50 {:9.2}  p90 {:9.2}  p99 {:9.2}  mean {:9.2}  (n={})", s.p50, s.p90, s.p99, s.mean, s.count)?;
            }
        }
        for (kind, n) in &self.errors {
            writeln!(f, "  errors: {kind} x {n}")?;
        }
        for e in &self.error_examples {
            writeln!(f, "    e.g. {e}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(seed: u64) -> LoadgenConfig {
        LoadgenConfig {
            api: Api::Completions,
            model: "m".into(),
            concurrency: 4,
            requests: Some(10),
            duration: None,
            prompt_tokens: "uniform:20:40".parse().unwrap(),
            output_tokens: "normal:16:4".parse().unwrap(),
            seed,
            ignore_eos: true,
            stream: true,
            temperature: 0.0,
            warmup: 0,
        }
    }

    #[test]
    fn a_seed_fixes_every_request_and_another_seed_changes_them() {
        let (a, b) = (cfg(5), cfg(6));
        let run = |c: &LoadgenConfig| (0..10).map(|i| c.request(i)).collect::<Vec<_>>();
        assert_eq!(run(&a), run(&a));
        assert_ne!(run(&a), run(&b));
        let r = a.request(3);
        let n = r.prompt.split(' ').count();
        assert!((20..=40).contains(&n), "{n} words");
        assert_eq!(r.body()["ignore_eos"], true);
        assert_eq!(r.body()["stream_options"]["include_usage"], true);
    }
}
