//! A load generator: `concurrency` clients, each sending one request after another until a
//! request count or a duration is reached (requests in flight at the deadline finish and
//! count). Prompts and output lengths come from seeded distributions, so two runs with one
//! seed send the same requests. Reports throughput, time to first token and inter-token
//! latency as a [`Tally`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::ClientError;
use crate::dist::{Dist, Rng, words};
use crate::openai::{Api, Client, CompletionRequest, HangUp, Outcome};
use crate::report::{Tallier, Tally, classify};

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

/// One finished request, as [`classify`] left it.
#[derive(Debug)]
struct Sample {
    result: Result<Outcome, (String, String)>,
    max_tokens: u32,
}

/// The result of a run: its settings and the [`Tally`] of its measured requests.
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
    /// Requests sent (measured ones): `tally.ok + tally.failed`.
    pub requests: u64,
    /// What the measured requests did, over the measured phase's wall time.
    #[serde(flatten)]
    pub tally: Tally,
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
                let s = Sample { result: classify(r, cfg.stream), max_tokens: req.max_tokens };
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

fn report(client: &Client, cfg: &LoadgenConfig, samples: &[Sample], elapsed: Duration) -> Report {
    let mut tally = Tallier::new(ERROR_EXAMPLES);
    for s in samples {
        tally.add_outcome(&s.result, s.max_tokens);
    }
    let tally = tally.finish(elapsed, &[]);
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
        requests: tally.requests(),
        tally,
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "loadgen: {} {} (model {}), {} concurrent, prompt {} words, max_tokens {}{}, seed {}",
            self.url,
            self.api.path(),
            self.model,
            self.concurrency,
            self.prompt_words,
            self.max_tokens,
            if self.ignore_eos { " (ignore_eos)" } else { "" },
            self.seed
        )?;
        self.tally.write_summary(f, "")?;
        self.tally.failures.write(f, "  ")
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
