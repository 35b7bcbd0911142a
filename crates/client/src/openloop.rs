//! Open-loop load and goodput: requests arrive as a Poisson process at a set rate, each
//! sent at its arrival time whatever the server is doing (unlike [`crate::loadgen`]'s
//! clients, which wait for an answer before asking again, so a slow server slows its own
//! load). Each rate of a sweep is one *point*; every request's TTFT and TPOT are judged
//! against one or more SLO pairs, and the *goodput* of a pair is the highest rate at which
//! at least 90% of requests meet both of its SLOs.
//!
//! - TTFT is timed from the request's scheduled arrival, so a request the client sent late
//!   (at the in-flight cap) is charged for the wait.
//! - TPOT of a request = (end-to-end latency − TTFT) ÷ (output tokens − 1).
//! - A request that fails meets no SLO.
//! - A point may carry several tenants, each its own Poisson stream and API key (the
//!   noisy-neighbour scenario); attainment is then also reported per tenant.
//!
//! Arrival times and prompts come from the seed: two runs with one seed send the same
//! requests at the same moments. Each request of a run has its own prompt index, so no
//! server can answer a later point from a cache filled by an earlier one.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::Serialize;
use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::ClientError;
use crate::dist::{Dist, Rng};
use crate::loadgen::LoadgenConfig;
use crate::openai::{Api, Client, HangUp};
use crate::report::{Measure, Slo, Tallier, Tally, classify, ms};

/// Attainment a rate must reach to count towards goodput.
pub const GOODPUT_TARGET: f64 = 0.9;
/// Separates the arrival-time stream from the prompt streams drawn from one seed.
const ARRIVAL_STREAM: u64 = 0x4152_5249_5645_0003;
/// Error messages kept per point (the counts cover all).
const ERROR_EXAMPLES: usize = 3;

/// What to send: the requests of [`LoadgenConfig`] (its `concurrency`, `requests` and
/// `duration` are not used), at these rates.
#[derive(Debug, Clone)]
pub struct OpenLoopConfig {
    /// Prompts, lengths, seed, endpoint and warm-up.
    pub requests: LoadgenConfig,
    /// Each point's arrival rate per tenant (requests/s): a sweep has one tenant per point.
    pub points: Vec<Vec<f64>>,
    /// A point's arrivals stop after this many requests (all tenants together)...
    pub max_requests: Option<u64>,
    /// ...or after this long, whichever comes first (at least one is needed)...
    pub window: Option<Duration>,
    /// ...but the window closes on no tenant before it drew this many: at a low rate a
    /// window's handful of arrivals lets one early burst decide the point.
    pub min_requests: Option<u64>,
    /// Requests in flight at most; an arrival past it waits (and is charged for the wait).
    pub max_in_flight: usize,
    /// SLO pairs to judge every request against.
    pub slos: Vec<Slo>,
    /// End a sweep early after a point where every pair's attainment (both SLOs) is below
    /// this: higher rates only overload the server further, and take long to drain.
    pub stop_below: Option<f64>,
    /// A name for the server in reports and plots.
    pub label: String,
}

/// One scheduled request of a point.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Arrival {
    /// Time from the point's start.
    pub at: Duration,
    /// Whose request it is.
    pub tenant: usize,
}

/// The arrivals of point `point`: per tenant a Poisson process at its rate (exponential
/// gaps from a generator seeded by `seed`, the point and the tenant), merged in time order
/// and cut at `max_requests` in all or at `window`, whichever comes first, the window
/// staying open for a tenant until it drew `min_requests`. Rates must be positive and
/// finite, and `max_requests` or `window` given.
pub fn arrivals(
    seed: u64,
    point: usize,
    rates: &[f64],
    max_requests: Option<u64>,
    window: Option<Duration>,
    min_requests: Option<u64>,
) -> Vec<Arrival> {
    let mut all = Vec::new();
    for (tenant, &rate) in rates.iter().enumerate() {
        let mut rng = Rng::for_index(seed ^ ARRIVAL_STREAM, ((point as u64) << 16) | tenant as u64);
        let mut t = 0.0f64;
        let mut n = 0u64;
        loop {
            // 1 - unit() is in (0, 1]: the logarithm is finite.
            t += -(1.0 - rng.unit()).ln() / rate;
            let at = Duration::from_secs_f64(t);
            let window_closed = window.is_some_and(|w| at >= w) && min_requests.is_none_or(|m| n >= m);
            if window_closed || max_requests.is_some_and(|m| n >= m) {
                break;
            }
            all.push(Arrival { at, tenant });
            n += 1;
        }
    }
    all.sort_by_key(|a| a.at);
    if let Some(m) = max_requests {
        all.truncate(usize::try_from(m).unwrap_or(usize::MAX));
    }
    all
}

/// One measured request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestRecord {
    /// Its point (index into the report's points).
    pub point: usize,
    /// Its tenant.
    pub tenant: usize,
    /// Scheduled arrival, from the point's start (s).
    pub arrival_s: f64,
    /// How long after its arrival it was sent (ms): above ~0 only at the in-flight cap.
    pub late_ms: f64,
    /// Whether it succeeded.
    pub ok: bool,
    /// Its failure kind, if it failed.
    pub error: Option<String>,
    /// Time to first token from the scheduled arrival (ms).
    pub ttft_ms: Option<f64>,
    /// End-to-end latency from the scheduled arrival (ms).
    pub latency_ms: Option<f64>,
    /// Output tokens (server's `usage`, else content chunks).
    pub output_tokens: u64,
    /// Time per output token after the first (ms).
    pub tpot_ms: Option<f64>,
}

/// How a goodput figure was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GoodputKind {
    /// Interpolated between the last rate at or above the target and the first below it.
    Interpolated,
    /// Even the lowest rate missed the target: goodput 0.
    BelowLowestRate,
    /// No rate missed the target: goodput is at least the highest rate measured.
    AtLeastHighestRate,
    /// No rates.
    NoData,
}

/// The goodput of one SLO pair.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Goodput {
    /// The pair.
    pub slo: Slo,
    /// Requests/s (a lower bound with [`GoodputKind::AtLeastHighestRate`]).
    pub rate: f64,
    /// How it was found.
    pub kind: GoodputKind,
    /// In words.
    pub note: String,
}

/// Goodput from `(rate, attainment)` points: the rate where attainment crosses `target`,
/// interpolated linearly between the two rates that bracket it. Points are taken in rate
/// order; with a non-monotone curve the *first* crossing counts: the last rate before the
/// first one below `target` (a higher rate that recovers does not raise goodput, since
/// the server already failed a lower load). Exactly `target` meets it. If the lowest rate
/// misses, goodput is 0.
pub fn goodput(slo: Slo, points: &[(f64, f64)], target: f64) -> Goodput {
    let mut p: Vec<(f64, f64)> = points.iter().copied().filter(|(r, a)| r.is_finite() && a.is_finite()).collect();
    p.sort_by(|a, b| a.0.total_cmp(&b.0));
    let pct = |a: f64| a * 100.0;
    let Some(&(r0, a0)) = p.first() else {
        return Goodput { slo, rate: 0.0, kind: GoodputKind::NoData, note: "no rates measured".into() };
    };
    if a0 < target {
        return Goodput {
            slo,
            rate: 0.0,
            kind: GoodputKind::BelowLowestRate,
            note: format!("goodput 0: even the lowest rate, {r0} req/s, met the SLOs for only {:.1}% of requests", pct(a0)),
        };
    }
    match p.windows(2).find(|w| w[1].1 < target) {
        None => {
            let &(rn, an) = p.last().unwrap_or(&(r0, a0));
            Goodput {
                slo,
                rate: rn,
                kind: GoodputKind::AtLeastHighestRate,
                note: format!("at least {rn} req/s: the highest rate measured still met the SLOs for {:.1}% of requests", pct(an)),
            }
        }
        Some(w) => {
            let ((lo, alo), (hi, ahi)) = (w[0], w[1]);
            let rate = lo + (alo - target) / (alo - ahi) * (hi - lo);
            Goodput {
                slo,
                rate,
                kind: GoodputKind::Interpolated,
                note: format!("{rate:.3} req/s: attainment falls from {:.1}% at {lo} req/s to {:.1}% at {hi} req/s", pct(alo), pct(ahi)),
            }
        }
    }
}

/// One tenant's share of a point.
#[derive(Debug, Clone, Serialize)]
pub struct TenantPoint {
    /// The tenant.
    pub tenant: usize,
    /// Its offered rate (requests/s).
    pub rate: f64,
    /// Its requests: `tally.ok + tally.failed`.
    pub sent: u64,
    /// What its requests did, over the point's duration.
    #[serde(flatten)]
    pub tally: Tally,
}

/// The results at one offered rate.
#[derive(Debug, Clone, Serialize)]
pub struct RatePoint {
    /// Offered rate, all tenants together (requests/s).
    pub rate: f64,
    /// Requests sent: `tally.ok + tally.failed`.
    pub sent: u64,
    /// The rate actually drawn: requests sent over the window when it cut the arrivals,
    /// else over the time to the last arrival.
    pub arrival_rate: f64,
    /// Most requests in flight at once.
    pub max_in_flight: usize,
    /// Arrivals that found the in-flight cap full and were sent late.
    pub cap_waits: u64,
    /// What the requests did, all tenants together, from the first arrival to the last
    /// answer; TTFT and latency count from each request's arrival.
    #[serde(flatten)]
    pub tally: Tally,
    /// Per tenant, when the point has several.
    pub tenants: Vec<TenantPoint>,
}

/// Facts about a point's run that its records do not hold.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PointRun {
    /// From the point's start to the last answer.
    pub elapsed: Duration,
    /// The last arrival.
    pub last_arrival: Duration,
    /// The window, when it (not the request count) ended the arrivals.
    pub window_cut: Option<Duration>,
    /// Most requests in flight at once.
    pub max_in_flight: usize,
    /// Arrivals that waited for the in-flight cap.
    pub cap_waits: u64,
}

/// A request as measured, before it is judged.
#[derive(Debug, Clone)]
struct Measured {
    tenant: usize,
    /// Scheduled arrival, from the point's start.
    arrival_s: f64,
    /// How long after its arrival it was sent (ms).
    late_ms: f64,
    /// The answer's measures, when one came (a failure may have one: a stream without
    /// tokens).
    answer: Option<Measure>,
    /// The kind and message of its failure.
    failure: Option<(String, Option<String>)>,
}

impl Measured {
    /// What a tally counts of it: a request succeeded when it has an answer and no failure.
    fn result(&self) -> Result<&Measure, (&str, Option<&str>)> {
        match (&self.failure, &self.answer) {
            (Some((kind, message)), _) => Err((kind, message.as_deref())),
            (None, Some(m)) => Ok(m),
            // `run_point` never builds one without either; were it to, it would not count
            // as a success.
            (None, None) => Err(("no_answer", None)),
        }
    }

    /// Its record in the report, in point `point`.
    fn record(&self, point: usize) -> RequestRecord {
        let a = self.answer.as_ref();
        RequestRecord {
            point,
            tenant: self.tenant,
            arrival_s: self.arrival_s,
            late_ms: self.late_ms,
            ok: self.result().is_ok(),
            error: self.failure.as_ref().map(|(kind, _)| kind.clone()),
            ttft_ms: a.and_then(|m| m.ttft_ms),
            latency_ms: a.map(|m| m.latency_ms),
            output_tokens: a.map_or(0, |m| m.output_tokens),
            tpot_ms: a.and_then(Measure::tpot_ms),
        }
    }
}

/// Summarise one point's requests: all tenants together, and each of several apart.
fn rate_point(rates: &[f64], measured: &[Measured], slos: &[Slo], run: PointRun) -> RatePoint {
    let mut all = Tallier::new(ERROR_EXAMPLES);
    let mut each: Vec<Tallier> = rates.iter().map(|_| Tallier::new(ERROR_EXAMPLES)).collect();
    for m in measured {
        all.add(m.result());
        if let Some(t) = each.get_mut(m.tenant) {
            t.add(m.result());
        }
    }
    let tenants = if rates.len() > 1 {
        each.into_iter()
            .zip(rates)
            .enumerate()
            .map(|(tenant, (t, &rate))| {
                let tally = t.finish(run.elapsed, slos);
                TenantPoint { tenant, rate, sent: tally.requests(), tally }
            })
            .collect()
    } else {
        Vec::new()
    };
    let tally = all.finish(run.elapsed, slos);
    let sent = tally.requests();
    RatePoint {
        rate: rates.iter().sum(),
        sent,
        arrival_rate: sent as f64 / run.window_cut.unwrap_or(run.last_arrival).as_secs_f64().max(1e-9),
        max_in_flight: run.max_in_flight,
        cap_waits: run.cap_waits,
        tally,
        tenants,
    }
}

/// The result of an open-loop run.
#[derive(Debug, Clone, Serialize)]
pub struct OpenLoopReport {
    /// Always `"open-loop"`, so plotting can tell this report from others.
    pub mode: &'static str,
    /// The server's name in plots.
    pub label: String,
    /// Server.
    pub url: String,
    /// Endpoint.
    pub api: Api,
    /// Model asked for.
    pub model: String,
    /// Prompt length distribution (words).
    pub prompt_words: Dist,
    /// `max_tokens` distribution.
    pub max_tokens: Dist,
    /// Seed of prompts and arrival times.
    pub seed: u64,
    /// `ignore_eos` sent.
    pub ignore_eos: bool,
    /// Warm-up requests sent one at a time before the first point (not counted).
    pub warmup: u64,
    /// A point's arrivals stop after this many requests...
    pub max_requests_per_point: Option<u64>,
    /// ...or this many seconds, whichever first...
    pub window_s: Option<f64>,
    /// ...the seconds running on until a tenant drew this many.
    pub min_requests_per_point: Option<u64>,
    /// The in-flight cap.
    pub max_in_flight: usize,
    /// The SLO pairs judged.
    pub slos: Vec<Slo>,
    /// The sweep's early-stop floor, if any.
    pub stop_below: Option<f64>,
    /// The goodput target (0.9).
    pub target: f64,
    /// One per offered rate.
    pub points: Vec<RatePoint>,
    /// Goodput per SLO pair (a sweep, one tenant per point; empty otherwise).
    pub goodput: Vec<Goodput>,
    /// Every measured request, for judging other SLO pairs later.
    pub requests: Vec<RequestRecord>,
}

impl OpenLoopReport {
    /// Whether any request succeeded.
    pub fn any_ok(&self) -> bool {
        self.points.iter().any(|p| p.tally.ok > 0)
    }
}

/// Check the settings before any request is sent ([`run`] does too).
pub fn validate(clients: &[Client], cfg: &OpenLoopConfig) -> Result<(), ClientError> {
    let bad = |m: String| Err(ClientError::Config(m));
    if cfg.points.is_empty() {
        return bad("give at least one rate".into());
    }
    if cfg.max_requests.is_none() && cfg.window.is_none() {
        return bad("give a request count or a duration per rate".into());
    }
    if cfg.max_requests == Some(0) || cfg.window.is_some_and(|w| w.is_zero()) {
        return bad("the request count and duration per rate must be positive".into());
    }
    if let Some(min) = cfg.min_requests {
        if cfg.window.is_none() {
            return bad("a least count per rate keeps a duration open: give a duration per rate too".into());
        }
        if min == 0 || cfg.max_requests.is_some_and(|max| min > max) {
            return bad(format!("the least count per rate ({min}) must be positive and at most the request count"));
        }
    }
    if cfg.max_in_flight == 0 {
        return bad("the in-flight cap must be at least 1".into());
    }
    if !cfg.requests.stream {
        return bad("open-loop runs stream: TTFT and TPOT need the timing of each token".into());
    }
    if cfg.slos.is_empty()
        || cfg.slos.iter().any(|s| !(s.ttft_ms > 0.0 && s.tpot_ms > 0.0 && s.ttft_ms.is_finite() && s.tpot_ms.is_finite()))
    {
        return bad("give at least one SLO pair, each of positive finite values".into());
    }
    for p in &cfg.points {
        if p.is_empty() || p.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
            return bad(format!("rates must be positive and finite: {p:?}"));
        }
        if p.len() > clients.len() {
            return bad(format!("{} tenants' rates but {} clients", p.len(), clients.len()));
        }
    }
    Ok(())
}

/// Run every point against the server, one after another (each waits for the previous
/// point's requests to finish). `progress` sees each point as it completes.
pub async fn run(clients: &[Client], cfg: &OpenLoopConfig, mut progress: impl FnMut(&RatePoint)) -> Result<OpenLoopReport, ClientError> {
    validate(clients, cfg)?;
    let Some(first) = clients.first() else { return Err(ClientError::Config("no client".into())) };
    let base = &cfg.requests;
    for i in 0..base.warmup {
        let r = first.complete(&base.request(i), HangUp::Never).await;
        tracing::debug!(i, ok = r.as_ref().is_ok_and(|o| o.ok(true)), "warm-up request");
    }
    let mut next_index = base.warmup;
    let (mut points, mut requests) = (Vec::new(), Vec::new());
    for (p, rates) in cfg.points.iter().enumerate() {
        let plan = arrivals(base.seed, p, rates, cfg.max_requests, cfg.window, cfg.min_requests);
        let (measured, run) = run_point(clients, cfg, &plan, next_index).await?;
        next_index += plan.len() as u64;
        let point = rate_point(rates, &measured, &cfg.slos, run);
        progress(&point);
        let hopeless = cfg.stop_below.is_some_and(|floor| point.tally.attainment.iter().all(|a| a.both < floor));
        points.push(point);
        requests.extend(measured.iter().map(|m| m.record(p)));
        if hopeless && p + 1 < cfg.points.len() {
            tracing::info!(rate = points[p].rate, "every SLO pair's attainment is below --stop-below: the sweep ends here");
            break;
        }
    }
    let goodput = if cfg.points.iter().all(|p| p.len() == 1) {
        cfg.slos
            .iter()
            .enumerate()
            .map(|(i, &slo)| {
                let curve: Vec<(f64, f64)> = points.iter().filter_map(|p| p.tally.attainment.get(i).map(|a| (p.rate, a.both))).collect();
                goodput(slo, &curve, GOODPUT_TARGET)
            })
            .collect()
    } else {
        Vec::new()
    };
    Ok(OpenLoopReport { points, goodput, requests, ..OpenLoopReport::planned(first.config().url.to_string(), cfg) })
}

/// Send one point's requests at their arrival times and wait for all of them.
async fn run_point(
    clients: &[Client],
    cfg: &OpenLoopConfig,
    plan: &[Arrival],
    first_index: u64,
) -> Result<(Vec<Measured>, PointRun), ClientError> {
    let gate = Arc::new(Semaphore::new(cfg.max_in_flight));
    let measured = Arc::new(Mutex::new(Vec::with_capacity(plan.len())));
    let mut tasks = tokio::task::JoinSet::new();
    let (mut max_in_flight, mut cap_waits) = (0usize, 0u64);
    let start = Instant::now();
    for (k, a) in plan.iter().enumerate() {
        let req = cfg.requests.request(first_index + k as u64);
        let scheduled = start + a.at;
        tokio::time::sleep_until(scheduled).await;
        let permit = match gate.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                cap_waits += 1;
                gate.clone().acquire_owned().await.map_err(|e| ClientError::Config(format!("in-flight gate closed: {e}")))?
            }
        };
        max_in_flight = max_in_flight.max(cfg.max_in_flight - gate.available_permits());
        let (client, measured, a) = (clients[a.tenant].clone(), measured.clone(), *a);
        tasks.spawn(async move {
            let _permit = permit;
            let late = Instant::now() - scheduled;
            let r = classify(client.complete(&req, HangUp::Never).await, true);
            let (answer, failure) = match r {
                Ok(o) => {
                    let answer = Measure::of(&o, req.max_tokens, late);
                    // A stream whose first token never came cannot be judged on TTFT:
                    // count it as a failure, not a success that meets nothing.
                    let failure = answer.ttft_ms.is_none().then(|| ("no_tokens".to_string(), None));
                    (Some(answer), failure)
                }
                Err((kind, message)) => (None, Some((kind, Some(message)))),
            };
            let m = Measured { tenant: a.tenant, arrival_s: a.at.as_secs_f64(), late_ms: ms(late), answer, failure };
            measured.lock().unwrap_or_else(PoisonError::into_inner).push(m);
        });
    }
    let last_arrival = plan.last().map_or(Duration::ZERO, |a| a.at);
    while let Some(r) = tasks.join_next().await {
        if let Err(e) = r {
            return Err(ClientError::Config(format!("a request task failed: {e}")));
        }
    }
    let elapsed = start.elapsed();
    let mut measured = std::mem::take(&mut *measured.lock().unwrap_or_else(PoisonError::into_inner));
    measured.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
    // The window cut the arrivals unless the count did, or the least count held it open.
    let window_cut = cfg.window.filter(|w| cfg.max_requests.is_none_or(|m| (plan.len() as u64) < m) && last_arrival < *w);
    Ok((measured, PointRun { elapsed, last_arrival, window_cut, max_in_flight, cap_waits }))
}

impl RatePoint {
    /// One line of the text table (see [`OpenLoopReport`]'s `Display`).
    pub fn line(&self) -> String {
        let mut s = format!("{:7.2} {:7.2} {:5} {}", self.rate, self.arrival_rate, self.sent, self.tally.cells());
        if self.cap_waits > 0 {
            s.push_str(&format!("  (in-flight cap hit {}x)", self.cap_waits));
        }
        s
    }

    /// The table's header lines for `slos`.
    pub fn header(slos: &[Slo]) -> String {
        format!("{:>7} {:>7} {:>5} {}", "rate", "drawn", "sent", Tally::columns(slos))
    }

    /// The point's row of the table and the lines under it (tenants, errors, short outputs).
    pub fn rows(&self) -> String {
        let mut f = format!("{}\n", self.line());
        for t in &self.tenants {
            f.push_str(&format!("    tenant {} at {:.2} req/s: {} sent, {} ok", t.tenant, t.rate, t.sent, t.tally.ok));
            f.push_str(&t.tally.attainment_words());
            if let (Some(tt), Some(tp)) = (t.tally.ttft_ms, t.tally.tpot_ms) {
                f.push_str(&format!("; TTFT p90 {:.0} ms, TPOT p90 {:.1} ms", tt.p90, tp.p90));
            }
            f.push('\n');
        }
        // Writing to a String cannot fail.
        let _ = self.tally.failures.write(&mut f, "    ").and_then(|()| self.tally.write_short(&mut f, "    "));
        f
    }
}

impl OpenLoopReport {
    /// The report of a run of `cfg` against `url` before any point is measured: what
    /// [`OpenLoopReport::head`] says is known then, so a caller can print it first and the
    /// table's rows as they come ([`RatePoint::rows`]), then [`OpenLoopReport::tail`].
    pub fn planned(url: String, cfg: &OpenLoopConfig) -> Self {
        let base = &cfg.requests;
        OpenLoopReport {
            mode: "open-loop",
            label: cfg.label.clone(),
            url,
            api: base.api,
            model: base.model.clone(),
            prompt_words: base.prompt_tokens,
            max_tokens: base.output_tokens,
            seed: base.seed,
            ignore_eos: base.ignore_eos,
            warmup: base.warmup,
            max_requests_per_point: cfg.max_requests,
            window_s: cfg.window.map(|w| w.as_secs_f64()),
            min_requests_per_point: cfg.min_requests,
            max_in_flight: cfg.max_in_flight,
            slos: cfg.slos.clone(),
            stop_below: cfg.stop_below,
            target: GOODPUT_TARGET,
            points: Vec::new(),
            goodput: Vec::new(),
            requests: Vec::new(),
        }
    }

    /// The text above the table: what was run, the SLO pairs, and the table's header.
    pub fn head(&self) -> String {
        let mut f = format!(
            "open-loop loadgen ({}): {} {} (model {}), prompt {} words, max_tokens {}{}, seed {}\n",
            self.label,
            self.url,
            self.api.path(),
            self.model,
            self.prompt_words,
            self.max_tokens,
            if self.ignore_eos { " (ignore_eos)" } else { "" },
            self.seed
        );
        let n = self.max_requests_per_point.map(|n| format!("{n} requests"));
        let w = self.window_s.map(|w| match self.min_requests_per_point {
            Some(m) => format!("{w} s (or until {m} arrived)"),
            None => format!("{w} s"),
        });
        f.push_str(&format!(
            "  Poisson arrivals seeded by the seed and the rate's index; per rate {} (whichever first), after {} warm-up requests; in-flight cap {}\n",
            [n, w].into_iter().flatten().collect::<Vec<_>>().join(" or "),
            self.warmup,
            self.max_in_flight
        ));
        for (i, s) in self.slos.iter().enumerate() {
            f.push_str(&format!("  SLO {}: {s}\n", i + 1));
        }
        f.push_str(&RatePoint::header(&self.slos));
        f.push('\n');
        f
    }

    /// The text below the table: goodput per SLO pair.
    pub fn tail(&self) -> String {
        self.goodput.iter().enumerate().map(|(i, g)| format!("goodput, SLO {} ({}): {}\n", i + 1, g.slo, g.note)).collect()
    }
}

/// The whole report as text: [`OpenLoopReport::head`], each point's [`RatePoint::rows`],
/// [`OpenLoopReport::tail`].
impl std::fmt::Display for OpenLoopReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.head())?;
        for p in &self.points {
            f.write_str(&p.rows())?;
        }
        f.write_str(&self.tail())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHAT: Slo = Slo { ttft_ms: 2500.0, tpot_ms: 100.0 };

    #[test]
    fn goodput_interpolates_between_the_rates_that_bracket_ninety_percent() {
        let g = goodput(CHAT, &[(1.0, 1.0), (2.0, 0.95), (4.0, 0.85), (8.0, 0.2)], 0.9);
        assert_eq!(g.kind, GoodputKind::Interpolated);
        assert!((g.rate - 3.0).abs() < 1e-9, "{}", g.rate);
        // Given out of order: sorted by rate first.
        let g2 = goodput(CHAT, &[(8.0, 0.2), (4.0, 0.85), (1.0, 1.0), (2.0, 0.95)], 0.9);
        assert_eq!(g2.rate, g.rate);
    }

    #[test]
    fn goodput_is_zero_with_a_message_when_even_the_lowest_rate_misses() {
        let g = goodput(CHAT, &[(0.5, 0.8), (1.0, 0.5)], 0.9);
        assert_eq!((g.rate, g.kind), (0.0, GoodputKind::BelowLowestRate));
        assert!(g.note.contains("goodput 0") && g.note.contains("0.5 req/s") && g.note.contains("80.0%"), "{}", g.note);
        assert_eq!(goodput(CHAT, &[], 0.9).kind, GoodputKind::NoData);
    }

    #[test]
    fn exactly_ninety_percent_meets_the_target() {
        let g = goodput(CHAT, &[(1.0, 1.0), (2.0, 0.9), (3.0, 0.5)], 0.9);
        assert_eq!((g.rate, g.kind), (2.0, GoodputKind::Interpolated));
        let g = goodput(CHAT, &[(1.0, 0.9), (2.0, 0.9)], 0.9);
        assert_eq!((g.rate, g.kind), (2.0, GoodputKind::AtLeastHighestRate));
        assert!(g.note.starts_with("at least 2"), "{}", g.note);
    }

    #[test]
    fn a_non_monotone_curve_takes_the_first_fall_below_the_target() {
        // Falls below at 3, recovers at 4 (noise), falls again at 6: the first crossing counts.
        let g = goodput(CHAT, &[(1.0, 1.0), (2.0, 0.94), (3.0, 0.86), (4.0, 0.95), (6.0, 0.3)], 0.9);
        assert_eq!(g.kind, GoodputKind::Interpolated);
        assert!((g.rate - 2.5).abs() < 1e-9, "{}", g.rate);
    }

    #[test]
    fn arrivals_are_seeded_poisson_and_stop_at_the_first_bound() {
        let a = arrivals(7, 0, &[4.0], Some(2000), None, None);
        assert_eq!(a, arrivals(7, 0, &[4.0], Some(2000), None, None));
        assert_ne!(a, arrivals(8, 0, &[4.0], Some(2000), None, None));
        assert_ne!(a, arrivals(7, 1, &[4.0], Some(2000), None, None), "each point has its own stream");
        assert_eq!(a.len(), 2000);
        assert!(a.windows(2).all(|w| w[0].at <= w[1].at));
        // Mean gap 1/rate; exponential gaps have standard deviation equal to their mean.
        let gaps: Vec<f64> =
            std::iter::once(a[0].at.as_secs_f64()).chain(a.windows(2).map(|w| (w[1].at - w[0].at).as_secs_f64())).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let sd = (gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64).sqrt();
        assert!((mean - 0.25).abs() < 0.02 && (sd - 0.25).abs() < 0.03, "mean {mean} sd {sd}");
        // A window shorter than the count's time stops first.
        let w = arrivals(7, 0, &[4.0], Some(2000), Some(Duration::from_secs(10)), None);
        assert!((25..=60).contains(&w.len()) && w.iter().all(|x| x.at < Duration::from_secs(10)), "{}", w.len());
        assert_eq!(w[..], a[..w.len()], "the same draws, cut earlier");
        // A least count keeps the window open until it is drawn, and no longer.
        let slow = arrivals(7, 0, &[0.05], Some(2000), Some(Duration::from_secs(90)), Some(30));
        assert_eq!(slow.len(), 30, "the window stayed open for the least count only");
        assert!(slow.last().is_some_and(|x| x.at > Duration::from_secs(90)));
        let busy = arrivals(7, 0, &[4.0], Some(2000), Some(Duration::from_secs(10)), Some(5));
        assert_eq!(busy, w, "a least count already drawn changes nothing");
    }

    #[test]
    fn tenants_share_one_window_and_the_count_covers_all_of_them() {
        let a = arrivals(3, 0, &[10.0, 1.0], None, Some(Duration::from_secs(60)), None);
        let n = |t| a.iter().filter(|x| x.tenant == t).count() as f64;
        assert!((n(0) / 600.0 - 1.0).abs() < 0.15 && (n(1) / 60.0 - 1.0).abs() < 0.4, "{} {}", n(0), n(1));
        let capped = arrivals(3, 0, &[10.0, 1.0], Some(100), Some(Duration::from_secs(60)), None);
        assert_eq!(capped.len(), 100);
        assert_eq!(capped[..], a[..100]);
    }

    #[test]
    fn a_point_summarises_attainment_per_tenant() {
        // 128 tokens, the first after `ttft` ms, the rest `tpot` ms apart.
        let m = |tenant, ok: bool, ttft: f64, tpot: f64| Measured {
            tenant,
            arrival_s: 0.0,
            late_ms: 0.0,
            answer: ok.then(|| Measure {
                output_tokens: 128,
                max_tokens: 128,
                ttft_ms: Some(ttft),
                latency_ms: ttft + 127.0 * tpot,
                itl_ms: Vec::new(),
                prompt_tokens: None,
            }),
            failure: (!ok).then(|| ("io".to_string(), Some("boom".to_string()))),
        };
        let ms = [m(0, true, 3000.0, 10.0), m(0, false, 0.0, 0.0), m(1, true, 100.0, 10.0), m(1, true, 200.0, 20.0)];
        let run = PointRun {
            elapsed: Duration::from_secs(2),
            last_arrival: Duration::from_secs(1),
            window_cut: None,
            max_in_flight: 3,
            cap_waits: 0,
        };
        let p = rate_point(&[8.0, 0.5], &ms, &[CHAT], run);
        assert_eq!((p.rate, p.sent, p.tally.ok, p.tally.failed, p.arrival_rate), (8.5, 4, 3, 1, 4.0));
        assert_eq!(p.tally.attainment[0].both, 0.5);
        assert_eq!(p.tenants.len(), 2);
        assert_eq!((p.tenants[0].sent, p.tenants[0].tally.attainment[0].both), (2, 0.0));
        assert_eq!((p.tenants[1].sent, p.tenants[1].tally.attainment[0].both), (2, 1.0));
        assert_eq!(p.tally.failures.errors.get("io"), Some(&1));
        assert_eq!(p.tally.failures.error_examples, vec!["boom".to_string()]);
        assert_eq!(p.tally.ttft_ms.unwrap().count, 3, "failures have no TTFT");
        let records: Vec<RequestRecord> = ms.iter().map(|m| m.record(2)).collect();
        assert_eq!(records[1].error.as_deref(), Some("io"));
        assert!(records.iter().all(|r| r.point == 2) && !records[1].ok && records[2].tpot_ms == Some(10.0));
    }
}
