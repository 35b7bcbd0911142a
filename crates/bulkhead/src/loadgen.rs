//! `bulkhead loadgen URL`: load any OpenAI-compatible server and report throughput, time to
//! first token and inter-token latency (the work is in `bulkhead_client::loadgen`, and for
//! `--scenario multi-turn` in `bulkhead_client::multiturn`). With `--rate`, `--rates` or
//! `--tenant-rates` the load is open-loop (Poisson arrivals) and the report gives SLO
//! attainment and goodput (`bulkhead_client::openloop`); `bulkhead loadgen-plot` draws such
//! reports.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use bulkhead_client::dist::{Dist, Rng};
use bulkhead_client::http::{Timeouts, Url};
use bulkhead_client::loadgen::{self, LoadgenConfig};
use bulkhead_client::multiturn::{self, MultiTurnConfig};
use bulkhead_client::openloop::{self, OpenLoopConfig, OpenLoopReport, RatePoint};
use bulkhead_client::report::Slo;
use bulkhead_client::{Api, Client, ClientConfig};
use clap::{Args, ValueEnum};

/// Which endpoint to send to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ApiArg {
    /// `/v1/completions` (the prompt as raw text).
    Completions,
    /// `/v1/chat/completions` (the prompt as one user message).
    Chat,
}

impl From<ApiArg> for Api {
    fn from(a: ApiArg) -> Api {
        match a {
            ApiArg::Completions => Api::Completions,
            ApiArg::Chat => Api::Chat,
        }
    }
}

/// What `loadgen` sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Scenario {
    /// Independent prompts from --prompt-tokens, each answered once.
    SingleShot,
    /// Chats: per tenant, --conversations conversations of --turns turns sharing one system
    /// prompt; each turn resends the conversation so far (always the chat API).
    MultiTurn,
}

/// The server under test and how to reach it (shared by `loadgen` and `probe`).
#[derive(Args, Debug, Clone)]
pub struct TargetArgs {
    /// Server base URL, e.g. http://127.0.0.1:8080 (a trailing /v1 is fine).
    #[arg(env = "BULKHEAD_TARGET_URL")]
    pub url: String,
    /// API key, sent as `Authorization: Bearer KEY`.
    #[arg(long, env = "BULKHEAD_API_KEY")]
    pub api_key: Option<String>,
    /// The `model` field of requests (default: the first model the server lists).
    #[arg(long, env = "BULKHEAD_TARGET_MODEL")]
    pub model: Option<String>,
    /// Endpoint to use.
    #[arg(long, env = "BULKHEAD_TARGET_API", value_enum, default_value_t = ApiArg::Completions)]
    pub api: ApiArg,
    /// Limit on connecting and sending a request (s).
    #[arg(long, env = "BULKHEAD_CONNECT_TIMEOUT_S", default_value_t = 10)]
    pub connect_timeout_s: u64,
    /// Limit on any single wait for response bytes (s): a stalled server fails here.
    #[arg(long, env = "BULKHEAD_READ_TIMEOUT_S", default_value_t = 300)]
    pub read_timeout_s: u64,
}

impl TargetArgs {
    /// A client for the target, with `headers` on every request.
    pub fn client(&self, api_key: Option<String>, headers: Vec<(String, String)>) -> anyhow::Result<Client> {
        Ok(Client::new(ClientConfig {
            url: Url::parse(&self.url)?,
            api_key,
            headers,
            timeouts: Timeouts { connect: Duration::from_secs(self.connect_timeout_s), read: Duration::from_secs(self.read_timeout_s) },
        }))
    }

    /// The model named by the flag, else the first the server lists.
    pub async fn model(&self, client: &Client) -> anyhow::Result<String> {
        if let Some(m) = &self.model {
            return Ok(m.clone());
        }
        let models = client.models().await.context("cannot list the server's models (pass --model)")?;
        models.into_iter().next().map(|m| m.id).context("the server lists no models; pass --model")
    }
}

#[derive(Args, Debug, Clone)]
pub struct LoadgenArgs {
    #[command(flatten)]
    target: TargetArgs,
    /// Workload: single-shot prompts, or multi-turn chats of several tenants.
    #[arg(long, env = "BULKHEAD_LOADGEN_SCENARIO", value_enum, default_value_t = Scenario::SingleShot)]
    scenario: Scenario,
    /// Clients sending at once (default 1); multi-turn: conversations in progress at once
    /// (default all of them).
    #[arg(long, short = 'c', env = "BULKHEAD_LOADGEN_CONCURRENCY")]
    concurrency: Option<usize>,
    /// Requests to send (default 100 when no --duration-s is given); open loop: per rate.
    #[arg(long, short = 'n', env = "BULKHEAD_LOADGEN_REQUESTS")]
    requests: Option<u64>,
    /// Stop starting requests after this many seconds (in-flight ones finish and count);
    /// open loop: per rate, whichever of this and --requests comes first.
    #[arg(long, env = "BULKHEAD_LOADGEN_DURATION_S")]
    duration_s: Option<f64>,
    /// Open loop: keep each rate's --duration-s open until this many requests (per tenant)
    /// arrived, so a low rate is not decided by the few arrivals of one window.
    #[arg(long, env = "BULKHEAD_LOADGEN_MIN_REQUESTS", requires = "duration_s")]
    min_requests: Option<u64>,
    /// Open loop: Poisson arrivals at this rate (requests/s, seeded) instead of
    /// --concurrency clients; each request is sent at its arrival time, answered or not.
    #[arg(long, env = "BULKHEAD_LOADGEN_RATE", conflicts_with_all = ["rates", "tenant_rates"])]
    rate: Option<f64>,
    /// Open loop: a sweep of rates (requests/s, ','-separated), one after another, each
    /// waiting for the previous one's requests to finish; reports goodput per SLO pair.
    #[arg(long, env = "BULKHEAD_LOADGEN_RATES", value_delimiter = ',', conflicts_with = "tenant_rates")]
    rates: Vec<f64>,
    /// Open loop: one point with a Poisson stream per tenant at these rates (requests/s,
    /// ','-separated), e.g. 12,0.5 for a noisy neighbour; tenant keys from --tenant-key.
    #[arg(long, env = "BULKHEAD_LOADGEN_TENANT_RATES", value_delimiter = ',')]
    tenant_rates: Vec<f64>,
    /// Open loop: time-to-first-token SLOs (ms, ','-separated), paired in order with
    /// --slo-tpot-ms; every pair is judged on the same requests.
    #[arg(long, env = "BULKHEAD_LOADGEN_SLO_TTFT_MS", value_delimiter = ',', default_value = "2500")]
    slo_ttft_ms: Vec<f64>,
    /// Open loop: time-per-output-token SLOs (ms, ','-separated): a request's (latency -
    /// TTFT) / (output tokens - 1).
    #[arg(long, env = "BULKHEAD_LOADGEN_SLO_TPOT_MS", value_delimiter = ',', default_value = "100")]
    slo_tpot_ms: Vec<f64>,
    /// Open loop: requests in flight at most; an arrival past it waits, is charged for the
    /// wait, and the report says how often it happened.
    #[arg(long, env = "BULKHEAD_LOADGEN_MAX_IN_FLIGHT", default_value_t = 512)]
    max_in_flight: usize,
    /// Open loop: end a sweep after a rate where every SLO pair's attainment (both SLOs) is
    /// below this fraction (e.g. 0.5): higher rates only take longer to drain.
    #[arg(long, env = "BULKHEAD_LOADGEN_STOP_BELOW")]
    stop_below: Option<f64>,
    /// Open loop: the server's name in the report and in plots (default: the URL).
    #[arg(long, env = "BULKHEAD_LOADGEN_LABEL")]
    label: Option<String>,
    /// Also write the report as JSON to this file (open loop: with every request's TTFT
    /// and TPOT, for `bulkhead loadgen-plot`).
    #[arg(long, env = "BULKHEAD_LOADGEN_JSON_OUT")]
    json_out: Option<PathBuf>,
    /// Prompt length in words, about one token each: N, uniform:MIN:MAX or normal:MEAN:STD.
    #[arg(long, env = "BULKHEAD_LOADGEN_PROMPT_TOKENS", default_value = "512")]
    prompt_tokens: Dist,
    /// max_tokens of each request: N, uniform:MIN:MAX or normal:MEAN:STD.
    #[arg(long, env = "BULKHEAD_LOADGEN_OUTPUT_TOKENS", default_value = "128")]
    output_tokens: Dist,
    /// Seed of prompts and lengths (default: random; the report prints it).
    #[arg(long, env = "BULKHEAD_LOADGEN_SEED")]
    seed: Option<u64>,
    /// Do not send ignore_eos: outputs may end before max_tokens.
    #[arg(long, env = "BULKHEAD_LOADGEN_NO_IGNORE_EOS", value_parser = clap::builder::BoolishValueParser::new())]
    no_ignore_eos: bool,
    /// Do not stream (no TTFT or inter-token latency then).
    #[arg(long, env = "BULKHEAD_LOADGEN_NO_STREAM", value_parser = clap::builder::BoolishValueParser::new())]
    no_stream: bool,
    /// Sampling temperature.
    #[arg(long, env = "BULKHEAD_LOADGEN_TEMPERATURE", default_value_t = 0.0)]
    temperature: f32,
    /// Requests sent one at a time first, not measured.
    #[arg(long, env = "BULKHEAD_LOADGEN_WARMUP", default_value_t = 0)]
    warmup: u64,
    /// Print the report as JSON.
    #[arg(long, env = "BULKHEAD_LOADGEN_JSON", value_parser = clap::builder::BoolishValueParser::new())]
    json: bool,
    /// Multi-turn: tenants, each with its own system prompt and API key.
    #[arg(long, env = "BULKHEAD_LOADGEN_TENANTS", default_value_t = 2)]
    tenants: usize,
    /// Multi-turn: conversations per tenant.
    #[arg(long, env = "BULKHEAD_LOADGEN_CONVERSATIONS", default_value_t = 8)]
    conversations: usize,
    /// Multi-turn: user turns per conversation.
    #[arg(long, env = "BULKHEAD_LOADGEN_TURNS", default_value_t = 5)]
    turns: usize,
    /// Multi-turn: words in each tenant's system prompt (about one token each).
    #[arg(long, env = "BULKHEAD_LOADGEN_SYSTEM_PROMPT_TOKENS", default_value_t = 1000)]
    system_prompt_tokens: usize,
    /// Multi-turn and --tenant-rates: the API key of the next tenant, in order (repeatable;
    /// env: ','-separated); tenants without one use --api-key.
    #[arg(long, env = "BULKHEAD_LOADGEN_TENANT_KEYS", value_delimiter = ',')]
    tenant_key: Vec<String>,
}

/// A small runtime for client commands: the work is waiting on sockets.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?)
}

pub fn run(a: LoadgenArgs) -> anyhow::Result<()> {
    if a.scenario == Scenario::MultiTurn {
        anyhow::ensure!(a.rate.is_none() && a.rates.is_empty() && a.tenant_rates.is_empty(), "open-loop rates apply to single-shot");
        return run_multi_turn(a);
    }
    if a.rate.is_some() || !a.rates.is_empty() || !a.tenant_rates.is_empty() {
        return run_open_loop(a);
    }
    anyhow::ensure!(a.tenant_key.is_empty(), "--tenant-key applies to --scenario multi-turn and --tenant-rates only");
    anyhow::ensure!(
        a.min_requests.is_none(),
        "--min-requests keeps an open-loop rate's window open; give --rate, --rates or --tenant-rates"
    );
    let duration = a.duration_s.map(Duration::try_from_secs_f64).transpose().context("--duration-s must be a positive number")?;
    let requests = match (a.requests, duration) {
        (None, None) => Some(100),
        (n, _) => n,
    };
    runtime()?.block_on(async {
        let client = a.target.client(a.target.api_key.clone(), Vec::new())?;
        let cfg = LoadgenConfig {
            api: a.target.api.into(),
            model: a.target.model(&client).await?,
            concurrency: a.concurrency.unwrap_or(1),
            requests,
            duration,
            prompt_tokens: a.prompt_tokens,
            output_tokens: a.output_tokens,
            seed: a.seed.unwrap_or_else(Rng::entropy),
            ignore_eos: !a.no_ignore_eos,
            stream: !a.no_stream,
            temperature: a.temperature,
            warmup: a.warmup,
        };
        let report = loadgen::run(&client, &cfg).await?;
        print_report(a.json, &report)?;
        write_json(a.json_out.as_deref(), &report)?;
        anyhow::ensure!(report.tally.ok > 0, "no request succeeded");
        Ok(())
    })
}

/// A report on stdout: pretty JSON with `--json`, else its text.
pub fn print_report<R: serde::Serialize + std::fmt::Display>(json: bool, report: &R) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if json {
        writeln!(out, "{}", serde_json::to_string_pretty(report)?)?;
    } else {
        write!(out, "{report}")?;
    }
    out.flush()?;
    Ok(())
}

/// Write `report` as pretty JSON to `path`, if given.
fn write_json<R: serde::Serialize>(path: Option<&std::path::Path>, report: &R) -> anyhow::Result<()> {
    if let Some(p) = path {
        let text = serde_json::to_string_pretty(report)?;
        std::fs::write(p, text + "\n").with_context(|| format!("cannot write {}", p.display()))?;
    }
    Ok(())
}

/// `--rate`, `--rates` or `--tenant-rates`: open-loop arrivals, SLO attainment and goodput.
fn run_open_loop(a: LoadgenArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.concurrency.is_none(), "--concurrency does not apply to open-loop runs (--rate, --rates, --tenant-rates)");
    anyhow::ensure!(!a.no_stream, "open-loop runs stream: TTFT and TPOT need every token's timing");
    anyhow::ensure!(
        a.slo_ttft_ms.len() == a.slo_tpot_ms.len(),
        "{} --slo-ttft-ms values but {} --slo-tpot-ms values: they pair up in order",
        a.slo_ttft_ms.len(),
        a.slo_tpot_ms.len()
    );
    let points: Vec<Vec<f64>> = if let Some(r) = a.rate {
        vec![vec![r]]
    } else if !a.rates.is_empty() {
        a.rates.iter().map(|&r| vec![r]).collect()
    } else {
        vec![a.tenant_rates.clone()]
    };
    let tenants = points.iter().map(Vec::len).max().unwrap_or(1);
    anyhow::ensure!(a.tenant_key.len() <= tenants, "{} --tenant-key values for {tenants} tenants", a.tenant_key.len());
    let window = a.duration_s.map(Duration::try_from_secs_f64).transpose().context("--duration-s must be a positive number")?;
    let max_requests = match (a.requests, window) {
        (None, None) => Some(100),
        (n, _) => n,
    };
    let slos = a.slo_ttft_ms.iter().zip(&a.slo_tpot_ms).map(|(&ttft_ms, &tpot_ms)| Slo { ttft_ms, tpot_ms }).collect();
    runtime()?.block_on(async {
        let clients = (0..tenants)
            .map(|i| a.target.client(a.tenant_key.get(i).cloned().or_else(|| a.target.api_key.clone()), Vec::new()))
            .collect::<anyhow::Result<Vec<Client>>>()?;
        let Some(first) = clients.first() else { anyhow::bail!("no tenants") };
        let cfg = OpenLoopConfig {
            requests: LoadgenConfig {
                api: a.target.api.into(),
                model: a.target.model(first).await?,
                concurrency: 1,
                requests: None,
                duration: None,
                prompt_tokens: a.prompt_tokens,
                output_tokens: a.output_tokens,
                seed: a.seed.unwrap_or_else(Rng::entropy),
                ignore_eos: !a.no_ignore_eos,
                stream: true,
                temperature: a.temperature,
                warmup: a.warmup,
            },
            points,
            max_requests,
            window,
            min_requests: a.min_requests,
            max_in_flight: a.max_in_flight,
            slos,
            stop_below: a.stop_below,
            label: a.label.clone().unwrap_or_else(|| a.target.url.clone()),
        };
        // A sweep takes minutes, so the table is printed row by row as each rate is
        // measured, once: as text on stdout (the head first, the goodput last, the same
        // text as the report's), or with --json on stderr (stdout is the JSON report).
        openloop::validate(&clients, &cfg)?;
        let planned = OpenLoopReport::planned(first.config().url.to_string(), &cfg);
        let show = |text: &str| {
            use std::io::Write;
            if a.json {
                eprint!("{text}");
            } else {
                let mut out = std::io::stdout().lock();
                let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
            }
        };
        show(&if a.json { format!("{}\n", RatePoint::header(&cfg.slos)) } else { planned.head() });
        let report = openloop::run(&clients, &cfg, |p| show(&p.rows())).await?;
        if a.json {
            print_report(true, &report)?;
        } else {
            show(&report.tail());
        }
        write_json(a.json_out.as_deref(), &report)?;
        anyhow::ensure!(report.any_ok(), "no request succeeded");
        Ok(())
    })
}

/// `--scenario multi-turn`.
fn run_multi_turn(a: LoadgenArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.requests.is_none() && a.duration_s.is_none(),
        "--requests and --duration-s apply to the single-shot scenario; multi-turn sends --tenants x --conversations x --turns requests"
    );
    anyhow::ensure!(a.tenants > 0 && a.conversations > 0 && a.turns > 0, "--tenants, --conversations and --turns must each be at least 1");
    anyhow::ensure!(a.concurrency != Some(0), "--concurrency must be at least 1");
    anyhow::ensure!(a.tenant_key.len() <= a.tenants, "{} --tenant-key values for {} tenants", a.tenant_key.len(), a.tenants);
    runtime()?.block_on(async {
        let clients = (0..a.tenants)
            .map(|i| a.target.client(a.tenant_key.get(i).cloned().or_else(|| a.target.api_key.clone()), Vec::new()))
            .collect::<anyhow::Result<Vec<Client>>>()?;
        let Some(first) = clients.first() else { anyhow::bail!("no tenants") };
        let cfg = MultiTurnConfig {
            model: a.target.model(first).await?,
            tenants: a.tenants,
            conversations: a.conversations,
            turns: a.turns,
            system_prompt_words: a.system_prompt_tokens,
            output_tokens: a.output_tokens,
            concurrency: a.concurrency,
            seed: a.seed.unwrap_or_else(Rng::entropy),
            ignore_eos: !a.no_ignore_eos,
            stream: !a.no_stream,
            temperature: a.temperature,
        };
        let report = multiturn::run(&clients, &cfg).await?;
        print_report(a.json, &report)?;
        write_json(a.json_out.as_deref(), &report)?;
        anyhow::ensure!(report.tally.ok > 0, "no request succeeded");
        Ok(())
    })
}
