//! `bulkhead probe URL`: the isolation acceptance test against any OpenAI-compatible server
//! (the work is in `bulkhead_client::probe`). Exit status: 0 no findings, 2 findings, 1 the
//! probe could not run.
//!
//! `bulkhead probe --timing URL`: the prompt-cache timing audit instead (the work is in
//! `bulkhead_client::timing`). Exit status: 0 for a completed measurement whatever its
//! verdict (it is a measurement, not a pass/fail check), 1 when requests failed or the audit
//! could not run.

use std::time::Duration;

use anyhow::Context;
use bulkhead_client::Client;
use bulkhead_client::dist::Rng;
use bulkhead_client::probe::{self, ProbeConfig};
use bulkhead_client::timing::{self, TimingConfig};
use clap::Args;

use crate::loadgen::{TargetArgs, print_report, runtime};

/// Exit status when the probe found something.
pub const EXIT_FINDINGS: i32 = 2;

#[derive(Args, Debug, Clone)]
pub struct ProbeArgs {
    #[command(flatten)]
    target: TargetArgs,
    /// Tenant A's API key (default: --api-key).
    #[arg(long, env = "BULKHEAD_PROBE_TENANT_A_KEY")]
    tenant_a_key: Option<String>,
    /// Tenant B's API key (default: --api-key).
    #[arg(long, env = "BULKHEAD_PROBE_TENANT_B_KEY")]
    tenant_b_key: Option<String>,
    /// A header on tenant A's requests, "Name: value" (repeatable; env: ';'-separated).
    #[arg(long, env = "BULKHEAD_PROBE_TENANT_A_HEADERS", value_delimiter = ';', value_parser = parse_header)]
    tenant_a_header: Vec<(String, String)>,
    /// A header on tenant B's requests, "Name: value" (repeatable; env: ';'-separated).
    #[arg(long, env = "BULKHEAD_PROBE_TENANT_B_HEADERS", value_delimiter = ';', value_parser = parse_header)]
    tenant_b_header: Vec<(String, String)>,
    /// The served context in tokens (default: what /v1/models or llama.cpp's /props says).
    #[arg(long, env = "BULKHEAD_PROBE_CONTEXT_LENGTH")]
    context_length: Option<u64>,
    /// Rounds of the whole request mix.
    #[arg(long, env = "BULKHEAD_PROBE_ROUNDS", default_value_t = 2)]
    rounds: usize,
    /// Filler words in long prompts (about 1.2 tokens each; clamped to fit the context).
    #[arg(long, env = "BULKHEAD_PROBE_LONG_WORDS", default_value_t = 1500)]
    long_words: usize,
    /// Filler words in short prompts.
    #[arg(long, env = "BULKHEAD_PROBE_SHORT_WORDS", default_value_t = 40)]
    short_words: usize,
    /// Requests in flight at once.
    #[arg(long, env = "BULKHEAD_PROBE_CONCURRENCY", default_value_t = 8)]
    concurrency: usize,
    /// Smallest share of long prompts whose answer must repeat the code at their start.
    #[arg(long, env = "BULKHEAD_PROBE_FACT_MIN_PASS", default_value_t = 0.5)]
    fact_min_pass: f64,
    /// Disconnects happen after a random delay up to this (ms).
    #[arg(long, env = "BULKHEAD_PROBE_DISCONNECT_MAX_MS", default_value_t = 1000)]
    disconnect_max_ms: u64,
    /// Seed of codes, filler and timings (default: random; the report prints it).
    #[arg(long, env = "BULKHEAD_PROBE_SEED")]
    seed: Option<u64>,
    /// Print the report as JSON.
    #[arg(long, env = "BULKHEAD_PROBE_JSON", value_parser = clap::builder::BoolishValueParser::new())]
    json: bool,
    /// Run the prompt-cache timing audit (Gu et al., ICML 2025) instead: is a prompt tenant
    /// A just sent measurably faster for tenant B than a fresh one?
    #[arg(long, env = "BULKHEAD_PROBE_TIMING", value_parser = clap::builder::BoolishValueParser::new())]
    timing: bool,
    /// Timing audit: samples per group (at least 20; under 100 the report warns).
    #[arg(long, env = "BULKHEAD_PROBE_TIMING_SAMPLES", default_value_t = timing::RECOMMENDED_SAMPLES, requires = "timing")]
    timing_samples: usize,
    /// Timing audit: random words per prompt (about one token each, so a prompt spans many
    /// KV pages).
    #[arg(long, env = "BULKHEAD_PROBE_TIMING_PROMPT_WORDS", default_value_t = 300, requires = "timing")]
    timing_prompt_words: usize,
    /// Timing audit: significance level of the Kolmogorov-Smirnov test.
    #[arg(long, env = "BULKHEAD_PROBE_TIMING_ALPHA", default_value_t = 0.01, requires = "timing")]
    timing_alpha: f64,
    /// Timing audit control: tenant B's requests carry tenant A's key and headers, so a
    /// server with a prefix cache should be found distinguishable.
    #[arg(long, env = "BULKHEAD_PROBE_TIMING_SAME_TENANT", value_parser = clap::builder::BoolishValueParser::new(), requires = "timing")]
    timing_same_tenant: bool,
}

fn parse_header(s: &str) -> Result<(String, String), String> {
    match s.split_once(':') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.trim().to_string())),
        _ => Err(format!("expected \"Name: value\", got {s:?}")),
    }
}

pub fn run(a: ProbeArgs) -> anyhow::Result<()> {
    if a.timing {
        return run_timing(a);
    }
    anyhow::ensure!((0.0..=1.0).contains(&a.fact_min_pass), "--fact-min-pass must be in [0, 1]");
    anyhow::ensure!(a.rounds > 0, "--rounds must be at least 1");
    let report = runtime()?.block_on(async {
        let (tenant_a, tenant_b) = tenant_clients(&a)?;
        let cfg = ProbeConfig {
            api: a.target.api.into(),
            model: a.target.model.clone(),
            context_length: a.context_length,
            rounds: a.rounds,
            long_words: a.long_words,
            short_words: a.short_words,
            concurrency: a.concurrency,
            fact_min_pass: a.fact_min_pass,
            disconnect_max: Duration::from_millis(a.disconnect_max_ms),
            seed: a.seed.unwrap_or_else(Rng::entropy),
        };
        probe::run(&tenant_a, &tenant_b, &cfg).await.context("the probe could not run")
    })?;
    print_report(a.json, &report)?;
    if !report.passed() {
        std::process::exit(EXIT_FINDINGS);
    }
    Ok(())
}

/// The two tenants' clients: their own keys (else `--api-key`) and headers.
fn tenant_clients(a: &ProbeArgs) -> anyhow::Result<(Client, Client)> {
    let key = |k: &Option<String>| k.clone().or_else(|| a.target.api_key.clone());
    let tenant_a = a.target.client(key(&a.tenant_a_key), a.tenant_a_header.clone())?;
    let tenant_b = a.target.client(key(&a.tenant_b_key), a.tenant_b_header.clone())?;
    Ok((tenant_a, tenant_b))
}

/// `--timing`: the prompt-cache timing audit.
fn run_timing(a: ProbeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.timing_samples >= timing::MIN_SAMPLES,
        "--timing-samples must be at least {} (got {}): fewer samples cannot tell a cache hit from noise; {} or more is recommended",
        timing::MIN_SAMPLES,
        a.timing_samples,
        timing::RECOMMENDED_SAMPLES
    );
    anyhow::ensure!(a.timing_alpha > 0.0 && a.timing_alpha < 1.0, "--timing-alpha must be in (0, 1)");
    anyhow::ensure!(a.timing_prompt_words > 0, "--timing-prompt-words must be at least 1");
    let report = runtime()?.block_on(async {
        let (tenant_a, tenant_b) = tenant_clients(&a)?;
        let cfg = TimingConfig {
            api: a.target.api.into(),
            model: a.target.model.clone(),
            samples: a.timing_samples,
            prompt_words: a.timing_prompt_words,
            alpha: a.timing_alpha,
            same_tenant: a.timing_same_tenant,
            seed: a.seed.unwrap_or_else(Rng::entropy),
        };
        timing::run(&tenant_a, &tenant_b, &cfg).await.context("the timing audit could not run")
    })?;
    print_report(a.json, &report)?;
    anyhow::ensure!(
        report.failed_requests == 0,
        "{} requests of the timing audit failed (their rounds are left out of the report)",
        report.failed_requests
    );
    Ok(())
}
