//! The one report type of the load generator's modes: a [`Tally`] of finished requests —
//! counts, failures by kind, output tokens, latency percentiles and SLO attainment — with its
//! text lines and its JSON form. The closed loop ([`crate::loadgen`]) and the multi-turn
//! scenario ([`crate::multiturn`]) report one tally each, the open loop
//! ([`crate::openloop`]) one per rate and per tenant of a rate; the timing audit
//! ([`crate::timing`]) keeps only its [`Failures`] (its figures are a statistical test,
//! not a load).
//!
//! A mode embeds its tally with `#[serde(flatten)]`, so the JSON stays flat: scripts read
//! `ok`, `failed`, `errors`, `output_tokens_per_s`, `short_outputs`, `prompt_tokens_mean`,
//! `ttft_ms`/`itl_ms`/`tpot_ms` (`p50`, `p90`, `p99`) and `attainment` (`both`, `ttft`,
//! `tpot`) at the report's (or the point's) top level. No mode may declare a field of the
//! same name beside it: serde would write the key twice.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::Duration;

use serde::Serialize;

use crate::ClientError;
use crate::openai::Outcome;
use crate::stats::Summary;

/// A pair of service-level objectives; a request meets the pair when it meets both.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Slo {
    /// Largest time to first token (ms).
    pub ttft_ms: f64,
    /// Largest mean time per output token after the first (ms).
    pub tpot_ms: f64,
}

impl std::fmt::Display for Slo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TTFT <= {} ms, TPOT <= {} ms", self.ttft_ms, self.tpot_ms)
    }
}

/// The fraction of requests that meet an SLO pair.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Attainment {
    /// The pair.
    pub slo: Slo,
    /// Both objectives.
    pub both: f64,
    /// The TTFT objective alone.
    pub ttft: f64,
    /// The TPOT objective alone.
    pub tpot: f64,
}

/// What an SLO pair judges of one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Judged {
    /// It succeeded (a failure meets nothing).
    pub ok: bool,
    /// Its time to first token (ms).
    pub ttft_ms: Option<f64>,
    /// Its time per output token after the first (ms); `None` for one token.
    pub tpot_ms: Option<f64>,
}

impl Judged {
    /// A failed request.
    pub const FAILED: Judged = Judged { ok: false, ttft_ms: None, tpot_ms: None };

    /// Whether it meets the TTFT objective of `slo`; a success without a first-token time
    /// (not streamed) does not.
    pub fn meets_ttft(&self, slo: &Slo) -> bool {
        self.ok && self.ttft_ms.is_some_and(|t| t <= slo.ttft_ms)
    }

    /// Whether it meets the TPOT objective of `slo`; a successful request of one token has
    /// no TPOT and meets it.
    pub fn meets_tpot(&self, slo: &Slo) -> bool {
        self.ok && self.tpot_ms.is_none_or(|t| t <= slo.tpot_ms)
    }
}

/// Attainment of `slo` over `requests` (failures included, meeting nothing); `None` for
/// no requests.
pub fn attainment(requests: impl IntoIterator<Item = Judged>, slo: Slo) -> Option<Attainment> {
    let (mut n, mut both, mut ttft, mut tpot) = (0u64, 0u64, 0u64, 0u64);
    for r in requests {
        let (a, b) = (r.meets_ttft(&slo), r.meets_tpot(&slo));
        n += 1;
        ttft += u64::from(a);
        tpot += u64::from(b);
        both += u64::from(a && b);
    }
    let frac = |k: u64| k as f64 / n as f64;
    (n > 0).then(|| Attainment { slo, both: frac(both), ttft: frac(ttft), tpot: frac(tpot) })
}

/// TPOT (ms): the time after the first token over the tokens after it; `None` for fewer
/// than two output tokens (nothing to divide).
pub fn tpot_ms(latency_ms: f64, ttft_ms: f64, output_tokens: u64) -> Option<f64> {
    (output_tokens >= 2).then(|| (latency_ms - ttft_ms).max(0.0) / (output_tokens - 1) as f64)
}

/// Milliseconds of `d`.
pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The kind and message of an answer that is not a success: a non-2xx status, an error
/// event, or a stream cut short.
pub(crate) fn failure(o: &Outcome) -> (String, String) {
    let kind = if !(200..300).contains(&o.status) {
        format!("http_{}", o.status)
    } else if o.error.is_some() {
        "stream_error".into()
    } else {
        "incomplete_stream".into()
    };
    (kind, o.error.clone().unwrap_or_else(|| "the stream ended without [DONE]".into()))
}

/// A request's result as success, or `(kind, message)` of its failure: a client error or
/// an answer that is not a success ([`failure`]).
pub(crate) fn classify(r: Result<Outcome, ClientError>, streamed: bool) -> Result<Outcome, (String, String)> {
    match r {
        Err(e) => Err((e.kind().to_string(), e.to_string())),
        Ok(o) if o.ok(streamed) => Ok(o),
        Ok(o) => Err(failure(&o)),
    }
}

/// Failures by kind, with the first few messages (each cut to 300 characters).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Failures {
    /// Failures by kind.
    pub errors: BTreeMap<String, u64>,
    /// The first few failure messages.
    pub error_examples: Vec<String>,
    /// Messages kept at most (the counts cover all).
    #[serde(skip)]
    keep: usize,
}

impl Failures {
    /// None yet; up to `keep` messages will be kept.
    pub fn new(keep: usize) -> Failures {
        Failures { errors: BTreeMap::new(), error_examples: Vec::new(), keep }
    }

    /// One failure of `kind`; its `message` is kept while fewer than `keep` are.
    pub fn record(&mut self, kind: &str, message: Option<&str>) {
        *self.errors.entry(kind.to_owned()).or_insert(0) += 1;
        if let Some(m) = message.filter(|_| self.error_examples.len() < self.keep) {
            self.error_examples.push(m.chars().take(300).collect());
        }
    }

    /// Failures of every kind.
    pub fn total(&self) -> u64 {
        self.errors.values().sum()
    }

    /// `{indent}errors: KIND x N` per kind, then `{indent}  e.g. MESSAGE` per message.
    pub fn write(&self, f: &mut impl Write, indent: &str) -> std::fmt::Result {
        for (kind, n) in &self.errors {
            writeln!(f, "{indent}errors: {kind} x {n}")?;
        }
        for e in &self.error_examples {
            writeln!(f, "{indent}  e.g. {e}")?;
        }
        Ok(())
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

/// One answered request's measures, its times (ms) counted from when it was due.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Measure {
    /// Output tokens (the server's `usage`, else content chunks).
    pub output_tokens: u64,
    /// The `max_tokens` it asked for.
    pub max_tokens: u32,
    /// Time to first token, when streamed and a token came.
    pub ttft_ms: Option<f64>,
    /// Time to the end of the answer.
    pub latency_ms: f64,
    /// Gaps between content chunks.
    pub itl_ms: Vec<f64>,
    /// `usage.prompt_tokens`, when the server sent usage.
    pub prompt_tokens: Option<u64>,
}

impl Measure {
    /// The measures of `o`, a request for `max_tokens` sent `late` after it was due (its
    /// TTFT and latency are charged for the wait).
    pub(crate) fn of(o: &Outcome, max_tokens: u32, late: Duration) -> Measure {
        Measure {
            output_tokens: o.output_tokens(),
            max_tokens,
            ttft_ms: o.ttft.map(|t| ms(t + late)),
            latency_ms: ms(o.latency + late),
            itl_ms: o.itl.iter().copied().map(ms).collect(),
            prompt_tokens: o.usage.map(|u| u.prompt_tokens),
        }
    }

    /// Its TPOT ([`tpot_ms`]); `None` without a first token.
    pub(crate) fn tpot_ms(&self) -> Option<f64> {
        self.ttft_ms.and_then(|t| tpot_ms(self.latency_ms, t, self.output_tokens))
    }
}

/// The figures of a set of finished requests, as every load report gives them.
///
/// Invariants: `ok + failed` is every request added; `failed == failures.total()`; the
/// percentiles and token counts cover successful requests only; attainment covers all of
/// them (a failure meets no SLO), one entry per SLO pair judged.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Tally {
    /// Requests that succeeded.
    pub ok: u64,
    /// Requests that failed.
    pub failed: u64,
    /// Failures by kind and the first few messages (`errors`, `error_examples`).
    #[serde(flatten)]
    pub failures: Failures,
    /// Wall time the requests took (s).
    pub duration_s: f64,
    /// Successful requests per second over `duration_s`.
    pub requests_per_s: f64,
    /// Output tokens of successful requests.
    pub output_tokens: u64,
    /// Output tokens of successful requests per second over `duration_s`.
    pub output_tokens_per_s: f64,
    /// Where those counts came from.
    pub output_tokens_from: TokenSource,
    /// Successful requests that returned fewer tokens than `max_tokens` (ended early).
    pub short_outputs: u64,
    /// Successful responses that carried `usage`.
    pub responses_with_usage: u64,
    /// Sum of their `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// Their mean prompt tokens, if any carried usage.
    pub prompt_tokens_mean: Option<f64>,
    /// Time to first token (ms), streamed requests.
    pub ttft_ms: Option<Summary>,
    /// Time per output token after the first (ms), streamed requests of two tokens or more.
    pub tpot_ms: Option<Summary>,
    /// Gaps between content chunks (ms), all streamed requests together.
    pub itl_ms: Option<Summary>,
    /// Whole-request latency (ms).
    pub latency_ms: Option<Summary>,
    /// Attainment per SLO pair judged (none unless the mode judges SLOs).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub attainment: Vec<Attainment>,
}

/// Finished requests, added one at a time; [`Tallier::finish`] makes their [`Tally`].
#[derive(Debug)]
pub(crate) struct Tallier {
    failures: Failures,
    ok: u64,
    output_tokens: u64,
    short: u64,
    with_usage: u64,
    prompt_tokens: u64,
    ttft: Vec<f64>,
    tpot: Vec<f64>,
    itl: Vec<f64>,
    latency: Vec<f64>,
    /// Every request, failures too, for attainment.
    judged: Vec<Judged>,
}

impl Tallier {
    /// No requests yet; up to `examples` failure messages will be kept.
    pub(crate) fn new(examples: usize) -> Tallier {
        Tallier {
            failures: Failures::new(examples),
            ok: 0,
            output_tokens: 0,
            short: 0,
            with_usage: 0,
            prompt_tokens: 0,
            ttft: Vec::new(),
            tpot: Vec::new(),
            itl: Vec::new(),
            latency: Vec::new(),
            judged: Vec::new(),
        }
    }

    /// One request: its measures, or the kind and message of its failure.
    pub(crate) fn add(&mut self, r: Result<&Measure, (&str, Option<&str>)>) {
        let m = match r {
            Err((kind, message)) => {
                self.failures.record(kind, message);
                self.judged.push(Judged::FAILED);
                return;
            }
            Ok(m) => m,
        };
        let tpot = m.tpot_ms();
        self.ok += 1;
        self.output_tokens += m.output_tokens;
        self.short += u64::from(m.output_tokens < u64::from(m.max_tokens));
        if let Some(p) = m.prompt_tokens {
            self.with_usage += 1;
            self.prompt_tokens += p;
        }
        self.ttft.extend(m.ttft_ms);
        self.tpot.extend(tpot);
        self.itl.extend_from_slice(&m.itl_ms);
        self.latency.push(m.latency_ms);
        self.judged.push(Judged { ok: true, ttft_ms: m.ttft_ms, tpot_ms: tpot });
    }

    /// One request sent when it was due, as [`classify`] left it.
    pub(crate) fn add_outcome(&mut self, r: &Result<Outcome, (String, String)>, max_tokens: u32) {
        match r {
            Ok(o) => self.add(Ok(&Measure::of(o, max_tokens, Duration::ZERO))),
            Err((kind, message)) => self.add(Err((kind, Some(message)))),
        }
    }

    /// The tally of the requests added over `elapsed`, judged against `slos`.
    pub(crate) fn finish(self, elapsed: Duration, slos: &[Slo]) -> Tally {
        let secs = elapsed.as_secs_f64().max(1e-9);
        let failed = self.failures.total();
        Tally {
            ok: self.ok,
            failed,
            duration_s: secs,
            requests_per_s: self.ok as f64 / secs,
            output_tokens: self.output_tokens,
            output_tokens_per_s: self.output_tokens as f64 / secs,
            output_tokens_from: match (self.ok, self.with_usage) {
                (0, _) => TokenSource::None,
                (n, u) if u == n => TokenSource::Usage,
                (_, 0) => TokenSource::Chunks,
                _ => TokenSource::Mixed,
            },
            short_outputs: self.short,
            responses_with_usage: self.with_usage,
            prompt_tokens: self.prompt_tokens,
            prompt_tokens_mean: (self.with_usage > 0).then(|| self.prompt_tokens as f64 / self.with_usage as f64),
            ttft_ms: Summary::of(&self.ttft),
            tpot_ms: Summary::of(&self.tpot),
            itl_ms: Summary::of(&self.itl),
            latency_ms: Summary::of(&self.latency),
            attainment: slos.iter().filter_map(|&s| attainment(self.judged.iter().copied(), s)).collect(),
            failures: self.failures,
        }
    }
}

/// A fraction as a right-aligned percentage, `" 90.0%"`.
fn pct(x: f64) -> String {
    format!("{:5.1}%", x * 100.0)
}

/// p50, p90 and p99 of `s` in a 20-character cell, `-` without samples.
fn ptiles(s: &Option<Summary>) -> String {
    s.map_or_else(|| format!("{:>20}", "-"), |s| format!("{:6.0} {:6.0} {:6.0}", s.p50, s.p90, s.p99))
}

impl Tally {
    /// Requests added, failed ones too.
    pub fn requests(&self) -> u64 {
        self.ok + self.failed
    }

    /// The report's block of lines (two-space indent): requests (`also` after the failed
    /// count, e.g. `", 2 turns skipped"`), requests/s, output tokens/s, the short-output
    /// note, and the TTFT, TPOT, ITL and latency percentiles there are samples of.
    pub fn write_summary(&self, f: &mut impl Write, also: &str) -> std::fmt::Result {
        writeln!(f, "  requests      {} ok, {} failed{also} in {:.2} s", self.ok, self.failed, self.duration_s)?;
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
        self.write_short(f, "  ")?;
        let figures = [("TTFT ms", &self.ttft_ms), ("TPOT ms", &self.tpot_ms), ("ITL ms", &self.itl_ms), ("latency ms", &self.latency_ms)];
        for (name, s) in figures {
            if let Some(s) = s {
                writeln!(f, "  {name:<12}  p50 {:9.2}  p90 {:9.2}  p99 {:9.2}  mean {:9.2}  (n={})", s.p50, s.p90, s.p99, s.mean, s.count)?;
            }
        }
        Ok(())
    }

    /// `{indent}note: N requests ended before max_tokens`, when some did.
    pub fn write_short(&self, f: &mut impl Write, indent: &str) -> std::fmt::Result {
        if self.short_outputs > 0 {
            writeln!(f, "{indent}note: {} requests ended before max_tokens", self.short_outputs)?;
        }
        Ok(())
    }

    /// The header of the tally's table columns ([`Tally::cells`]) for `slos`.
    pub fn columns(slos: &[Slo]) -> String {
        let mut s = format!(
            "{:>5} {:>5} {:>7} {:>8}  {:^20}  {:^20}",
            "ok", "fail", "req/s", "tok/s", "TTFT ms p50/p90/p99", "TPOT ms p50/p90/p99"
        );
        for i in 1..=slos.len() {
            s.push_str(&format!("  {:^20}", format!("SLO {i} both/TTFT/TPOT")));
        }
        s
    }

    /// The tally as cells of a table row: ok, failed, requests/s, output tokens/s, TTFT and
    /// TPOT percentiles, and per SLO pair the attainment of both, TTFT and TPOT.
    pub fn cells(&self) -> String {
        let mut s = format!(
            "{:5} {:5} {:7.3} {:8.1}  {}  {}",
            self.ok,
            self.failed,
            self.requests_per_s,
            self.output_tokens_per_s,
            ptiles(&self.ttft_ms),
            ptiles(&self.tpot_ms)
        );
        for a in &self.attainment {
            s.push_str(&format!("  {} {} {}", pct(a.both), pct(a.ttft), pct(a.tpot)));
        }
        s
    }

    /// Attainment in words, one `; SLO i both X% (TTFT Y%, TPOT Z%)` per pair.
    pub fn attainment_words(&self) -> String {
        let mut s = String::new();
        for (i, a) in self.attainment.iter().enumerate() {
            let [both, ttft, tpot] = [a.both, a.ttft, a.tpot].map(|x| pct(x).trim().to_string());
            s.push_str(&format!("; SLO {} both {both} (TTFT {ttft}, TPOT {tpot})", i + 1));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHAT: Slo = Slo { ttft_ms: 2500.0, tpot_ms: 100.0 };

    fn judged(ok: bool, ttft: f64, tpot: f64) -> Judged {
        if ok { Judged { ok, ttft_ms: Some(ttft), tpot_ms: Some(tpot) } } else { Judged::FAILED }
    }

    fn answer(ttft: f64, latency: f64, output_tokens: u64) -> Measure {
        Measure { output_tokens, max_tokens: 8, ttft_ms: Some(ttft), latency_ms: latency, itl_ms: vec![1.0], prompt_tokens: Some(10) }
    }

    #[test]
    fn tpot_divides_the_time_after_the_first_token_by_the_tokens_after_it() {
        assert_eq!(tpot_ms(1500.0, 230.0, 128), Some(10.0));
        assert_eq!(tpot_ms(500.0, 500.0, 2), Some(0.0));
        assert_eq!(tpot_ms(500.0, 400.0, 1), None, "one token: nothing to divide");
        assert_eq!(tpot_ms(500.0, 400.0, 0), None);
    }

    #[test]
    fn attainment_counts_each_objective_and_failures_meet_neither() {
        let rs = [
            judged(true, 1000.0, 50.0),  // both
            judged(true, 2500.0, 100.0), // both, exactly at the limits
            judged(true, 3000.0, 50.0),  // TPOT only
            judged(true, 1000.0, 150.0), // TTFT only
            judged(false, 0.0, 0.0),     // neither
        ];
        let a = attainment(rs, CHAT).unwrap();
        assert_eq!((a.both, a.ttft, a.tpot), (0.4, 0.6, 0.6));
        assert!(attainment([], CHAT).is_none());
        let one = Judged { ok: true, ttft_ms: Some(100.0), tpot_ms: None };
        assert_eq!(attainment([one], CHAT).unwrap().both, 1.0, "a one-token answer has no TPOT to miss");
    }

    #[test]
    fn a_tally_counts_every_request_once_and_judges_failures_as_missing() {
        let mut t = Tallier::new(1);
        t.add(Ok(&answer(100.0, 800.0, 8))); // TPOT 100: meets the chat pair
        t.add(Ok(&answer(3000.0, 3700.0, 4))); // ended early; misses TTFT
        t.add(Err(("http_503", Some("busy"))));
        t.add(Err(("http_503", Some("still busy"))));
        let t = t.finish(Duration::from_secs(2), &[CHAT]);
        assert_eq!((t.requests(), t.ok, t.failed, t.failures.total()), (4, 2, 2, 2));
        assert_eq!((t.output_tokens, t.short_outputs, t.output_tokens_from), (12, 1, TokenSource::Usage));
        assert_eq!((t.requests_per_s, t.output_tokens_per_s, t.prompt_tokens_mean), (1.0, 6.0, Some(10.0)));
        assert_eq!(t.failures.error_examples, ["busy"], "one message kept");
        assert_eq!(t.ttft_ms.map(|s| s.count), Some(2), "failures have no TTFT");
        assert_eq!(t.tpot_ms.map(|s| s.max), Some(700.0 / 3.0));
        assert_eq!((t.attainment[0].both, t.attainment[0].ttft, t.attainment[0].tpot), (0.25, 0.25, 0.25));
        assert!(Tallier::new(1).finish(Duration::ZERO, &[]).output_tokens_from == TokenSource::None);

        // The JSON is flat: the names scripts read sit at the top level.
        let json = serde_json::to_value(&t).unwrap();
        for key in ["ok", "failed", "errors", "error_examples", "output_tokens_per_s", "short_outputs", "prompt_tokens_mean"] {
            assert!(json.get(key).is_some(), "{key} in {json}");
        }
        assert_eq!((json["errors"]["http_503"].as_u64(), json["attainment"][0]["both"].as_f64()), (Some(2), Some(0.25)));
        assert!(json["ttft_ms"]["p99"].is_number() && json["itl_ms"]["p50"].is_number() && json.get("keep").is_none(), "{json}");
        let unjudged = serde_json::to_value(Tallier::new(1).finish(Duration::ZERO, &[])).unwrap();
        assert!(unjudged.get("attainment").is_none(), "no SLO pairs, no attainment field: {unjudged}");

        // Its text: the summary block, the table cells and the failures.
        let mut text = String::new();
        t.write_summary(&mut text, ", 1 turns skipped").unwrap();
        t.failures.write(&mut text, "  ").unwrap();
        for line in [
            "  requests      2 ok, 2 failed, 1 turns skipped in 2.00 s\n",
            "  output tok/s  6.0   (12 tokens, counted from usage; mean prompt 10.0 tokens)\n",
            "  note: 1 requests ended before max_tokens\n",
            "  errors: http_503 x 2\n    e.g. busy\n",
        ] {
            assert!(text.contains(line), "{line:?} in\n{text}");
        }
        assert_eq!(["TTFT ms", "TPOT ms", "ITL ms", "latency ms"].map(|n| text.matches(n).count()), [1; 4], "{text}");
        assert_eq!(t.cells().len(), Tally::columns(&[CHAT]).len(), "cells line up under their columns");
        assert!(t.cells().ends_with(" 25.0%  25.0%  25.0%"), "{}", t.cells());
        assert_eq!(t.attainment_words(), "; SLO 1 both 25.0% (TTFT 25.0%, TPOT 25.0%)");
    }
}
