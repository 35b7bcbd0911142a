//! The prompt-cache timing audit (Gu et al., "Auditing Prompt Caching in Language Model
//! APIs", ICML 2025), against any OpenAI-compatible server.
//!
//! A prefix cache shared between tenants is a side channel: a prompt someone else sent
//! recently is prefilled from cache and answers sooner, so timing a guess tells whether
//! another tenant sent it. The audit asks whether that difference is measurable:
//!
//! 1. tenant A sends a random prompt `P_i` (one token of output), so a server that caches
//!    prefixes holds it;
//! 2. tenant B then sends, in random order, `P_i` itself (the *victim-cached* sample) and a
//!    fresh random prompt `Q_i` of the same length (the *fresh* sample), and the time to
//!    first token of each is recorded.
//!
//! Requests go one at a time, so queueing adds no noise, and every prompt starts with a
//! random code, so no two share a prefix beyond what a chat template adds to all alike.
//! After `N` rounds a two-sample Kolmogorov–Smirnov test compares the two groups of times:
//! a p-value under `alpha` with the cached group's median lower means tenant B can tell
//! which prompts tenant A sent. In the *same-tenant* control, B's requests carry A's
//! identity, so a server with any prefix cache should be caught: it shows the audit can see
//! the effect on that server at all.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::ClientError;
use crate::dist::{Rng, code, words};
use crate::openai::{Api, Client, CompletionRequest, HangUp, Outcome};
use crate::probe::MAX_RETRIES;
use crate::report::{Failures, failure};
use crate::stats::{ks_two_sample, percentile};

/// Samples per group below which the command line refuses to run: the test has too little
/// power to mean anything.
pub const MIN_SAMPLES: usize = 20;
/// Samples per group below which the report carries a warning.
pub const RECOMMENDED_SAMPLES: usize = 100;
/// Failed requests after which the audit stops: the server is not answering.
pub const MAX_FAILURES: usize = 10;
/// Unmeasured requests first (connections, lazy initialisation on the server).
pub const WARMUP_REQUESTS: usize = 2;
/// Digits of the random code that starts every prompt.
const PREFIX_CODE_CHARS: usize = 12;
/// Failure messages kept in the report.
const ERROR_EXAMPLES: usize = 5;
/// Pause before the first retry of a request the server shed (429, 503); doubles each time.
const RETRY_PAUSE: Duration = Duration::from_millis(250);

/// What to audit and how.
#[derive(Debug, Clone)]
pub struct TimingConfig {
    /// Endpoint.
    pub api: Api,
    /// The `model` field; default: the first model the server lists.
    pub model: Option<String>,
    /// Samples per group (victim-cached and fresh). The library takes any number from 2; the
    /// command line asks for at least [`MIN_SAMPLES`].
    pub samples: usize,
    /// Random words per prompt (about one token each): enough to span many KV pages.
    pub prompt_words: usize,
    /// Significance level of the verdict.
    pub alpha: f64,
    /// The control: tenant B's requests carry tenant A's identity.
    pub same_tenant: bool,
    /// Seed of prompts and of the order within each pair.
    pub seed: u64,
}

/// Whose identity tenant B's requests carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TimingMode {
    /// B is another tenant: a distinction is a cross-tenant side channel.
    CrossTenant,
    /// B uses A's identity: the control, where a prefix cache should be seen.
    SameTenant,
}

impl TimingMode {
    /// The mode's name, as in the JSON report.
    pub fn name(self) -> &'static str {
        match self {
            TimingMode::CrossTenant => "cross-tenant",
            TimingMode::SameTenant => "same-tenant",
        }
    }
}

/// Times to first token of one group (ms).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GroupStats {
    /// Samples.
    pub n: usize,
    /// Median.
    pub median_ms: f64,
    /// 10th percentile.
    pub p10_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// Mean.
    pub mean_ms: f64,
}

impl GroupStats {
    /// The statistics of `samples` (ms); `None` when there are none.
    pub fn of(samples: &[f64]) -> Option<GroupStats> {
        let mut s = samples.to_vec();
        s.sort_by(f64::total_cmp);
        Some(GroupStats {
            n: s.len(),
            median_ms: percentile(&s, 50.0)?,
            p10_ms: percentile(&s, 10.0)?,
            p90_ms: percentile(&s, 90.0)?,
            mean_ms: s.iter().sum::<f64>() / s.len() as f64,
        })
    }
}

/// The result of an audit.
#[derive(Debug, Clone, Serialize)]
pub struct TimingReport {
    /// Server.
    pub url: String,
    /// Model.
    pub model: String,
    /// Endpoint.
    pub api: Api,
    /// Whose identity tenant B used.
    pub mode: TimingMode,
    /// Samples per group asked for.
    pub samples: usize,
    /// Random words per prompt.
    pub prompt_words: usize,
    /// Seed.
    pub seed: u64,
    /// Significance level.
    pub alpha: f64,
    /// Tenant B's times on prompts tenant A had just sent.
    pub cached: GroupStats,
    /// Tenant B's times on fresh prompts.
    pub fresh: GroupStats,
    /// Kolmogorov–Smirnov statistic of the two groups.
    pub ks_d: f64,
    /// Its asymptotic p-value.
    pub p_value: f64,
    /// `p_value < alpha` and the cached group's median is lower.
    pub distinguishable: bool,
    /// The verdict in words.
    pub verdict: String,
    /// Requests that failed (after retries of shed load); their rounds are left out.
    pub failed_requests: u64,
    /// Those failures by kind, and the first few (`errors`, `error_examples`).
    #[serde(flatten)]
    pub failures: Failures,
    /// Samples timed to the end of the answer because no chunk carried text (a whole JSON
    /// answer, or an empty first token); with one token of output the two nearly agree.
    pub untimed_first_token: usize,
    /// Set when the groups are smaller than [`RECOMMENDED_SAMPLES`].
    pub warning: Option<String>,
    /// Wall time (s).
    pub duration_s: f64,
}

/// Round `i`'s prompts: the one tenant A warms (and B repeats), and B's fresh one, and
/// whether B sends the cached one first. The same seed and round give the same prompts.
fn round(seed: u64, i: u64, prompt_words: usize) -> (String, String, bool) {
    let mut rng = Rng::for_index(seed, i);
    let prompt = |rng: &mut Rng| format!("{} {}", code(rng, PREFIX_CODE_CHARS), words(rng, prompt_words));
    let cached = prompt(&mut rng);
    let fresh = prompt(&mut rng);
    (cached, fresh, rng.below(2) == 0)
}

/// Send `req` (retrying shed load); a successful answer, or the kind and words of its
/// failure.
async fn send(client: &Client, req: &CompletionRequest) -> Result<Outcome, (String, String)> {
    let mut retries = 0;
    loop {
        match client.complete(req, HangUp::Never).await {
            Ok(o) if o.ok(req.stream) => return Ok(o),
            Ok(o) if (o.status == 429 || o.status == 503) && retries < MAX_RETRIES => {}
            Ok(o) => {
                let (kind, why) = failure(&o);
                return Err((kind, format!("HTTP {}: {why:.300}", o.status)));
            }
            Err(e) => return Err((e.kind().to_string(), e.to_string())),
        }
        tokio::time::sleep(RETRY_PAUSE * 2u32.pow(retries)).await;
        retries += 1;
    }
}

/// Count a failed request; stops the audit once [`MAX_FAILURES`] have failed.
fn fail(failures: &mut Failures, (kind, why): (String, String)) -> Result<(), ClientError> {
    tracing::warn!(error = %why, "a timing-audit request failed");
    failures.record(&kind, Some(&why));
    let failed = failures.total();
    if failed >= MAX_FAILURES as u64 {
        return Err(ClientError::TooManyFailures { failed: failed as usize, last: why });
    }
    Ok(())
}

/// Run the audit: tenant A warms each prompt, tenant B (or A again, in the same-tenant
/// control) times it and a fresh one. Tenant clients carry their own keys and headers.
pub async fn run(a: &Client, b: &Client, cfg: &TimingConfig) -> Result<TimingReport, ClientError> {
    if cfg.samples < 2 {
        return Err(ClientError::Config("the timing audit needs at least 2 samples per group".into()));
    }
    if cfg.prompt_words == 0 {
        return Err(ClientError::Config("timing prompts need at least 1 word".into()));
    }
    if !(cfg.alpha > 0.0 && cfg.alpha < 1.0) {
        return Err(ClientError::Config(format!("alpha must be in (0, 1), not {}", cfg.alpha)));
    }
    let start = Instant::now();
    let model = match &cfg.model {
        Some(m) => m.clone(),
        None => a
            .models()
            .await?
            .into_iter()
            .next()
            .map(|m| m.id)
            .ok_or_else(|| ClientError::Config("the server lists no models; pass --model".into()))?,
    };
    let (mode, b) = if cfg.same_tenant { (TimingMode::SameTenant, a) } else { (TimingMode::CrossTenant, b) };
    let req = |prompt: String| CompletionRequest {
        api: cfg.api,
        model: model.clone(),
        prompt,
        max_tokens: 1,
        temperature: 0.0,
        // The one token is then never end-of-sequence, so the first chunk carries text.
        ignore_eos: true,
        stream: true,
    };
    let mut failures = Failures::new(ERROR_EXAMPLES);
    // Warm-up rounds use indices past the measured ones: prompts no measured round sends.
    for w in 0..WARMUP_REQUESTS {
        let (prompt, _, _) = round(cfg.seed, (cfg.samples + w) as u64, cfg.prompt_words);
        if let Err(e) = send(b, &req(prompt)).await {
            fail(&mut failures, e)?;
        }
    }
    let (mut cached, mut fresh, mut untimed) = (Vec::new(), Vec::new(), 0);
    for i in 0..cfg.samples {
        let (p, q, cached_first) = round(cfg.seed, i as u64, cfg.prompt_words);
        // Tenant A warms P_i; a round whose warming failed says nothing.
        if let Err(e) = send(a, &req(p.clone())).await {
            fail(&mut failures, e)?;
            continue;
        }
        let order = if cached_first { [(true, p), (false, q)] } else { [(false, q), (true, p)] };
        let mut pair = [None, None];
        for (is_cached, prompt) in order {
            match send(b, &req(prompt)).await {
                Ok(o) => {
                    untimed += usize::from(o.ttft.is_none());
                    pair[usize::from(is_cached)] = Some(o.ttft.unwrap_or(o.latency).as_secs_f64() * 1e3);
                }
                Err(e) => fail(&mut failures, e)?,
            }
        }
        // Only whole pairs count, so both groups see the same rounds.
        if let [Some(f), Some(c)] = pair {
            fresh.push(f);
            cached.push(c);
        }
    }
    let (Some(cached_stats), Some(fresh_stats), Some(ks)) =
        (GroupStats::of(&cached), GroupStats::of(&fresh), ks_two_sample(&cached, &fresh))
    else {
        let (failed, last) = (failures.total() as usize, failures.error_examples.pop().unwrap_or_default());
        return Err(ClientError::TooManyFailures { failed, last });
    };
    let distinguishable = ks.p_value < cfg.alpha && cached_stats.median_ms < fresh_stats.median_ms;
    let whose = match mode {
        TimingMode::CrossTenant => "of the other tenant",
        TimingMode::SameTenant => "of the same tenant",
    };
    let verdict = if distinguishable {
        format!("DISTINGUISHABLE: cached prompts {whose} are measurably faster (p={:.3e})", ks.p_value)
    } else {
        format!("not distinguishable at alpha={} (p={:.3e})", cfg.alpha, ks.p_value)
    };
    let warning = (cached.len() < RECOMMENDED_SAMPLES).then(|| {
        format!("only {} samples per group (fewer than {RECOMMENDED_SAMPLES}): the test may miss a small difference", cached.len())
    });
    Ok(TimingReport {
        url: a.config().url.to_string(),
        model,
        api: cfg.api,
        mode,
        samples: cfg.samples,
        prompt_words: cfg.prompt_words,
        seed: cfg.seed,
        alpha: cfg.alpha,
        cached: cached_stats,
        fresh: fresh_stats,
        ks_d: ks.d,
        p_value: ks.p_value,
        distinguishable,
        verdict,
        failed_requests: failures.total(),
        failures,
        untimed_first_token: untimed,
        warning,
        duration_s: start.elapsed().as_secs_f64(),
    })
}

impl std::fmt::Display for TimingReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let who = match self.mode {
            TimingMode::CrossTenant => "tenant B repeats tenant A's prompts with its own key",
            TimingMode::SameTenant => "control: tenant B's requests use tenant A's key",
        };
        writeln!(f, "timing audit: {} model {} ({}), mode {} ({who})", self.url, self.model, self.api.path(), self.mode.name())?;
        writeln!(
            f,
            "  {} samples per group, {}-word prompts, max_tokens 1, one request at a time, seed {}, {:.1} s",
            self.cached.n, self.prompt_words, self.seed, self.duration_s
        )?;
        writeln!(f, "  {:<15} {:>5} {:>10} {:>10} {:>10}", "TTFT group", "n", "p10 ms", "median ms", "p90 ms")?;
        for (name, g) in [("victim-cached", &self.cached), ("fresh", &self.fresh)] {
            writeln!(f, "  {name:<15} {:>5} {:>10.2} {:>10.2} {:>10.2}", g.n, g.p10_ms, g.median_ms, g.p90_ms)?;
        }
        writeln!(f, "  Kolmogorov-Smirnov D {:.3}, p-value {:.3e} (alpha {})", self.ks_d, self.p_value, self.alpha)?;
        writeln!(f, "  verdict: {}", self.verdict)?;
        if let Some(w) = &self.warning {
            writeln!(f, "  warning: {w}")?;
        }
        if self.untimed_first_token > 0 {
            writeln!(f, "  note: {} answers carried no text chunk; timed to their end instead", self.untimed_first_token)?;
        }
        if self.failed_requests > 0 {
            writeln!(f, "  FAILED REQUESTS: {} (their rounds are left out)", self.failed_requests)?;
            self.failures.write(f, "  ")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_are_seeded_unique_and_equally_long() {
        let (p, q, first) = round(7, 3, 50);
        assert_eq!(round(7, 3, 50), (p.clone(), q.clone(), first));
        assert_ne!(p, q);
        assert_ne!(round(7, 4, 50).0, p);
        assert_ne!(round(8, 3, 50).0, p);
        assert_eq!(p.split(' ').count(), 51);
        assert_eq!(q.split(' ').count(), 51);
        // The random code leads, so no two prompts share more than a chance digit or two.
        assert!(p.bytes().take(PREFIX_CODE_CHARS).all(|b| b.is_ascii_digit()), "{p}");
        let orders: Vec<bool> = (0..64).map(|i| round(7, i, 5).2).collect();
        assert!(orders.contains(&true) && orders.contains(&false), "both orders occur");
    }

    #[test]
    fn group_statistics_use_the_interpolated_percentiles() {
        let g = GroupStats::of(&[5.0, 1.0, 3.0, 2.0, 4.0]).unwrap();
        assert_eq!((g.n, g.median_ms, g.mean_ms), (5, 3.0, 3.0));
        assert!((g.p10_ms - 1.4).abs() < 1e-12 && (g.p90_ms - 4.6).abs() < 1e-12, "{g:?}");
        assert!(GroupStats::of(&[]).is_none());
    }
}
