//! Prometheus metrics: what each process counts, how it reaches the gateway, and the text
//! exposition the gateway serves at `GET /metrics`.
//!
//! - Each process describes its statistics as [`MetricFamily`]s through a [`Families`]
//!   builder: one function per statistics struct ([`pool_families`], [`decode_families`],
//!   [`prefill_families`]), so exporting a new field is one line there.
//! - Workers send theirs to the gateway in a `Metrics` message on their control connection
//!   every [`PUSH_INTERVAL`] and when a request ends on them ([`Pusher`]; the decode
//!   worker just before the request's last message, so a client holding its answer finds
//!   it counted); the gateway keeps the latest per worker and drops it when the worker
//!   leaves.
//! - [`render`] merges the gateway's own families with every worker's, adding the labels
//!   `worker` (`prefill-0`, `decode-0`, …) and `role`, into the text format (version 0.0.4).
//!   Names and labels a worker sends are checked, so a confused worker cannot make the
//!   output unparsable.
//!
//! Evidence (I6): each check that ran is counted in `bulkhead:isolation_checks_total{check}`
//! and each that failed in `bulkhead:isolation_failures_total{check}`, so "enabled" can be
//! told apart from "verified".

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use bulkhead_kv::{CacheStats, PoolStats};
use bulkhead_protocol::decode::DecodeStats;
use bulkhead_protocol::prefill::PrefillStats;
use bulkhead_protocol::{MetricFamily, MetricKind, MetricSample};

/// How often a worker sends its metrics when nothing else prompts it.
pub const PUSH_INTERVAL: Duration = Duration::from_millis(500);

/// Content type of the exposition.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Time to first token buckets (seconds), vLLM's.
pub const TTFT_BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0];
/// Inter-token latency buckets (seconds), vLLM's.
pub const ITL_BUCKETS: &[f64] =
    &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
/// End-to-end request latency buckets (seconds), vLLM's.
pub const E2E_BUCKETS: &[f64] =
    &[0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0];
/// KV transfer batch send time buckets (seconds).
pub const TRANSFER_BUCKETS: &[f64] = &[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0];

/// A histogram with fixed upper bounds (plus `+Inf`).
#[derive(Clone, Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Per bucket, not cumulative; the last one is `+Inf`.
    counts: Vec<u64>,
    sum: f64,
}

impl Histogram {
    /// An empty histogram over `bounds` (strictly increasing).
    pub fn new(bounds: &'static [f64]) -> Self {
        assert!(bounds.windows(2).all(|w| w[0] < w[1]), "histogram bounds must strictly increase: {bounds:?}");
        Histogram { bounds, counts: vec![0; bounds.len() + 1], sum: 0.0 }
    }

    /// A histogram over `bounds` counted elsewhere: `counts` per bucket (not cumulative,
    /// the last one `+Inf`) and their `sum`.
    pub fn from_counts(bounds: &'static [f64], counts: &[u64], sum: f64) -> Self {
        let mut h = Histogram::new(bounds);
        for (mine, theirs) in h.counts.iter_mut().zip(counts) {
            *mine = *theirs;
        }
        h.sum = sum;
        h
    }

    /// Record one value.
    pub fn observe(&mut self, v: f64) {
        let i = self.bounds.partition_point(|b| *b < v);
        self.counts[i] += 1;
        self.sum += v;
    }

    /// Record the seconds elapsed since `t`.
    pub fn observe_since(&mut self, t: Instant) {
        self.observe(t.elapsed().as_secs_f64());
    }

    /// Values recorded.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }
}

/// Builds a process's metric families; samples of the same family name are grouped.
#[derive(Debug, Default)]
pub struct Families(Vec<MetricFamily>);

impl Families {
    /// No families yet.
    pub fn new() -> Self {
        Families::default()
    }

    fn family(&mut self, name: &str, help: &str, kind: MetricKind) -> &mut MetricFamily {
        let i = match self.0.iter().position(|f| f.name == name) {
            Some(i) => i,
            None => {
                self.0.push(MetricFamily { name: name.into(), help: help.into(), kind, samples: Vec::new() });
                self.0.len() - 1
            }
        };
        &mut self.0[i]
    }

    fn sample(&mut self, family: &str, help: &str, kind: MetricKind, name: String, labels: &[(&str, &str)], value: f64) {
        let labels = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        self.family(family, help, kind).samples.push(MetricSample { name, labels, value });
    }

    /// A counter sample (the name should end in `_total`).
    pub fn counter(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: u64) {
        self.sample(name, help, MetricKind::Counter, name.into(), labels, value as f64);
    }

    /// A counter of seconds (the name should end in `_seconds_total`).
    pub fn counter_seconds(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: f64) {
        self.sample(name, help, MetricKind::Counter, name.into(), labels, value);
    }

    /// A gauge sample.
    pub fn gauge(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: f64) {
        self.sample(name, help, MetricKind::Gauge, name.into(), labels, value);
    }

    /// A histogram's samples: cumulative `_bucket{le}`, `_sum`, `_count`.
    pub fn histogram(&mut self, name: &str, help: &str, labels: &[(&str, &str)], h: &Histogram) {
        let mut cumulative = 0;
        for (i, c) in h.counts.iter().enumerate() {
            cumulative += c;
            let le = h.bounds.get(i).map_or_else(|| "+Inf".to_string(), |b| value_text(*b));
            let mut l = labels.to_vec();
            l.push(("le", &le));
            self.sample(name, help, MetricKind::Histogram, format!("{name}_bucket"), &l, cumulative as f64);
        }
        self.sample(name, help, MetricKind::Histogram, format!("{name}_sum"), labels, h.sum);
        self.sample(name, help, MetricKind::Histogram, format!("{name}_count"), labels, cumulative as f64);
    }

    /// One isolation check: how often it ran and, where the failures are counted apart,
    /// how often it failed.
    pub fn check(&mut self, check: &str, ran: u64, failed: Option<u64>) {
        self.counter("bulkhead:isolation_checks_total", "Isolation checks that ran, by check (I6).", &[("check", check)], ran);
        if let Some(failed) = failed {
            self.counter("bulkhead:isolation_failures_total", "Isolation checks that failed, by check (I6).", &[("check", check)], failed);
        }
    }

    /// Requests refused before running, by reason and by who refused them.
    pub fn rejected(&mut self, place: &str, reason: &str, n: u64) {
        let help = "Requests refused at admission, by reason and where (gateway, prefill or decode worker).";
        self.counter("bulkhead:rejected_admissions_total", help, &[("reason", reason), ("where", place)], n);
    }

    /// Connections this process closed for bad bytes (garbage, oversize or unknown frames),
    /// and handshakes it refused.
    pub fn refused_connections(&mut self, labels: &[(&str, &str)]) {
        use std::sync::atomic::Ordering::Relaxed;
        self.counter(
            "bulkhead:bad_connections_total",
            "Connections closed for bad bytes.",
            labels,
            crate::wire::BAD_CONNECTIONS.load(Relaxed),
        );
        let help = "Internal connections refused by the cluster handshake: no key, a wrong key, or an identity that does not match.";
        self.counter("bulkhead:auth_refusals_total", help, labels, crate::wire::AUTH_REFUSALS.load(Relaxed));
        let help = "Internal connections closed before they authenticated, by reason (deadline, evicted, full, malformed, unexpected, version, proof, no_key, identity).";
        for (reason, n) in crate::door::refusals() {
            let mut l = labels.to_vec();
            l.push(("reason", reason.as_str()));
            self.counter("bulkhead:handshake_refusals_total", help, &l, n);
        }
    }

    /// The families built.
    pub fn into_vec(self) -> Vec<MetricFamily> {
        self.0
    }
}

/// A KV pool's state and what it checked (both worker roles).
pub fn pool_families(s: &PoolStats, f: &mut Families) {
    // Cached pages are reclaimable (evicted on demand), so they count as free here.
    let used = s.leased_pages + s.quarantined_pages;
    let usage = if s.total_pages == 0 { 0.0 } else { used as f64 / s.total_pages as f64 };
    f.gauge(
        "bulkhead:kv_cache_usage_perc",
        "Fraction of KV pages leased or quarantined, 0 to 1 (prefix-cache pages count as free: they are evicted on demand).",
        &[],
        usage,
    );
    f.gauge("bulkhead:kv_pool_pages", "KV pages in the pool.", &[], s.total_pages as f64);
    f.gauge("bulkhead:kv_free_pages", "KV pages free.", &[], s.free_pages as f64);
    f.gauge("bulkhead:kv_leased_pages", "KV pages leased to a request.", &[], s.leased_pages as f64);
    f.gauge("bulkhead:quarantined_pages", "KV pages quarantined until their writer is fenced (I4).", &[], s.quarantined_pages as f64);
    f.counter("bulkhead:quarantined_pages_total", "KV pages put in quarantine.", &[], s.quarantines);
    f.counter("bulkhead:kv_leases_total", "KV page leases granted, each under a new generation.", &[], s.leases_granted);
    f.counter("bulkhead:kv_releases_total", "KV pages returned to the free list.", &[], s.releases);
    // Every read and write checks pool, page state, generation and owner of its lease (I1);
    // a refused access of any kind counts as a failure.
    f.check("lease", s.reads + s.writes + s.refusals, Some(s.refusals));
    // Before each forward step: every lease of every sequence re-checked live (failures are
    // refusals, counted under "lease"), canaries and the auditor over the slots attended to.
    f.check("generation", s.generation_checks, None);
    f.check("canary", s.canary_checks, Some(s.poisoned_reads));
    f.check("audit", s.audited_slots, Some(s.audit_violations));
    // Every shared lease asked for and every shared page attended to: its fence against
    // the page's (I7).
    f.check("tenant_fence", s.fence_checks, Some(s.fence_failures));
    f.gauge("bulkhead:kv_cached_pages", "KV pages held read-only by the prefix cache.", &[], s.cached_pages as f64);
    f.gauge("bulkhead:kv_shared_leases", "Read-only leases out on cached KV pages.", &[], s.shared_leases as f64);
}

/// A worker's prefix cache, prefill or decode side (vLLM's names: queries and hits count
/// prompt tokens).
pub fn prefix_cache_families(s: &CacheStats, pages: usize, max_pages: usize, f: &mut Families) {
    f.counter("bulkhead:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", &[], s.query_tokens);
    f.counter(
        "bulkhead:prefix_cache_hits_total",
        "Prompt tokens found in the prefix cache (same tenant and salt) and not computed.",
        &[],
        s.hit_tokens,
    );
    f.gauge("bulkhead:prefix_cache_pages", "Pages in the prefix cache.", &[], pages as f64);
    f.gauge("bulkhead:prefix_cache_max_pages", "Most pages the prefix cache keeps.", &[], max_pages as f64);
    f.counter("bulkhead:prefix_cache_stored_pages_total", "Pages published to the prefix cache.", &[], s.stored_pages);
    f.counter("bulkhead:prefix_cache_evictions_total", "Pages evicted from the prefix cache.", &[], s.evicted_pages);
}

/// A decode worker's handoff checks and admission; `checksums`: whether its pool verifies
/// chunk checksums (when off, none ran).
pub fn decode_families(s: &DecodeStats, checksums: bool, kv_bytes_per_token: usize, f: &mut Families) {
    f.check("chunk_verified", s.chunks_verified + s.chunks_refused, Some(s.chunks_refused));
    // The checksum is the last per-chunk check: every chunk that passed, and every one
    // refused for its checksum, ran it.
    let checksummed = if checksums { s.chunks_verified + s.checksum_failed } else { 0 };
    f.check("checksum", checksummed, Some(s.checksum_failed));
    f.check("coverage", s.coverage_verified + s.coverage_failed, Some(s.coverage_failed));
    f.counter(
        "bulkhead:fenced_releases_total",
        "Quarantined KV pages released because their writer was fenced (I4).",
        &[],
        s.fenced_releases,
    );
    f.counter("bulkhead:late_chunks_total", "KV chunks for requests no longer receiving, dropped unread.", &[], s.late_chunks);
    f.counter(
        "bulkhead:retired_extent_mismatches_total",
        "Finished sequences kept out of the decode-side cache because their written KV was not exactly the prompt and the generated tokens (a bug, such as a rejected draft's KV left in place); always 0.",
        &[],
        s.extent_mismatches,
    );
    f.counter(
        "bulkhead:kv_transfer_timeouts_total",
        "KV transfers that stalled: no chunk within the transfer timeout of the previous one.",
        &[],
        s.timeouts,
    );
    f.counter("bulkhead:kv_reservations_total", "KV reservations granted to requests.", &[], s.reserved);
    f.counter(
        "bulkhead:kv_held_tokens_total",
        "Prompt tokens a decode worker already held in its cache (shared read-only), so no prefill worker sent them.",
        &[],
        s.held_tokens,
    );
    let held_bytes = s.held_tokens.saturating_mul(kv_bytes_per_token as u64);
    f.counter("bulkhead:kv_held_bytes_total", "KV bytes those held tokens would have taken on the wire.", &[], held_bytes);
    f.counter(
        "bulkhead:kv_transferred_tokens_total",
        "Prompt tokens prefill workers sent and the decode worker verified.",
        &[],
        s.transferred_tokens,
    );
    f.counter(
        "bulkhead:local_prefills_total",
        "Requests whose short rest of the prompt (past what the decode worker held) the decode worker computed itself.",
        &[],
        s.local_prefills,
    );
    f.counter(
        "bulkhead:local_prefill_tokens_total",
        "Prompt tokens decode workers computed themselves (neither held nor sent).",
        &[],
        s.local_prefill_tokens,
    );
    f.rejected("decode", "context_length", s.rejected_context);
    f.rejected("decode", "capacity", s.rejected_capacity);
    f.rejected("decode", "invalid", s.rejected_invalid);
}

/// A prefill worker's admission and jobs.
pub fn prefill_families(s: &PrefillStats, f: &mut Families) {
    f.rejected("prefill", "context_length", s.rejected_context);
    f.rejected("prefill", "invalid", s.rejected_invalid);
    let help = "Prefill jobs by outcome (admitted, completed, aborted).";
    for (outcome, n) in [("admitted", s.admitted), ("completed", s.completed), ("aborted", s.aborted)] {
        f.counter("bulkhead:prefill_jobs_total", help, &[("outcome", outcome)], n);
    }
}

/// What every worker reports besides its role's statistics: its pool, the requests it holds
/// by state, the KV bytes it moved (sent by a prefill worker, received by a decode worker)
/// and the connections it closed for bad bytes or refused at the handshake.
pub fn worker_families(f: &mut Families, pool: &PoolStats, requests: &[(&str, usize)], transfer_bytes: u64) {
    pool_families(pool, f);
    for (state, n) in requests {
        f.gauge("bulkhead:worker_requests", "Requests held by a worker, by state.", &[("state", state)], *n as f64);
    }
    let help = "KV bytes in transfer chunks: sent (prefill worker) or received (decode worker).";
    f.counter("bulkhead:kv_transfer_bytes_total", help, &[], transfer_bytes);
    for (transport, n) in crate::kv_transport::connections() {
        let help = "KV connections opened (prefill) or accepted (decode), by the road their frames take: ucx or tcp.";
        f.counter("bulkhead:kv_connections_total", help, &[("transport", transport)], n);
    }
    f.refused_connections(&[]);
}

/// A prefill worker's time to write one transfer batch (the KV chunks of one prefill
/// compute chunk) to its decode worker's connection.
pub fn transfer_seconds(f: &mut Families, h: &Histogram) {
    let help = "Time for a prefill worker to send one KV transfer batch (the chunks of one compute chunk).";
    f.histogram("bulkhead:kv_transfer_seconds", help, &[], h);
}

/// When a worker should next send its metrics.
#[derive(Debug)]
pub struct Pusher {
    last: Instant,
}

impl Pusher {
    /// Due at once.
    pub fn new() -> Self {
        Pusher { last: Instant::now().checked_sub(PUSH_INTERVAL).unwrap_or_else(Instant::now) }
    }

    /// Whether [`PUSH_INTERVAL`] has passed since the last push; if so, counts this one.
    pub fn due(&mut self) -> bool {
        if self.last.elapsed() < PUSH_INTERVAL {
            return false;
        }
        self.last = Instant::now();
        true
    }

    /// A push happened outside the schedule (a request ended).
    pub fn pushed(&mut self) {
        self.last = Instant::now();
    }
}

impl Default for Pusher {
    fn default() -> Self {
        Pusher::new()
    }
}

/// Per-request metrics the gateway measures: latencies, outcomes and tokens.
#[derive(Debug)]
pub struct RequestMetrics {
    ttft: Histogram,
    itl: Histogram,
    tpot: Histogram,
    e2e: Histogram,
    success: BTreeMap<&'static str, u64>,
    failure: BTreeMap<&'static str, u64>,
    prompt_tokens: u64,
    generation_tokens: u64,
}

/// How a request finished, for [`RequestMetrics::finished`].
pub struct Finish {
    /// When the HTTP side admitted it.
    pub arrived: Instant,
    /// When its first token reached the gateway.
    pub first_token: Option<Instant>,
    /// Its finish reason (`stop`, `length`).
    pub reason: &'static str,
    /// Its prompt tokens.
    pub prompt_tokens: u32,
    /// Tokens it generated.
    pub completion_tokens: u32,
}

impl Default for RequestMetrics {
    fn default() -> Self {
        RequestMetrics {
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            tpot: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            // Both reasons exist from the start, so the series do not appear mid-run.
            success: [("stop", 0), ("length", 0)].into(),
            failure: BTreeMap::new(),
            prompt_tokens: 0,
            generation_tokens: 0,
        }
    }
}

impl RequestMetrics {
    /// A token reached the client: the first (`previous` = None, measured from arrival) or
    /// a later one (measured from the previous token).
    pub fn token(&mut self, arrived: Instant, previous: Option<Instant>) {
        match previous {
            None => self.ttft.observe_since(arrived),
            Some(p) => self.itl.observe_since(p),
        }
    }

    /// A request finished normally. Its time per output token, `(end − first token) ÷
    /// (output tokens − 1)`, is what a per-token SLO is measured on (DistServe's TPOT); a
    /// request of one token has none.
    pub fn finished(&mut self, f: &Finish) {
        self.e2e.observe_since(f.arrived);
        if let (Some(first), Some(gaps)) = (f.first_token, f.completion_tokens.checked_sub(1).filter(|&g| g > 0)) {
            self.tpot.observe(first.elapsed().as_secs_f64() / f64::from(gaps));
        }
        *self.success.entry(f.reason).or_default() += 1;
        self.prompt_tokens += u64::from(f.prompt_tokens);
        self.generation_tokens += u64::from(f.completion_tokens);
    }

    /// A request failed after admission.
    pub fn failed(&mut self, reason: &'static str) {
        *self.failure.entry(reason).or_default() += 1;
    }

    /// Its families.
    pub fn export(&self, f: &mut Families) {
        self.export_labeled(f, &[]);
    }

    /// Its families, each sample with `labels` too (a tenant's, on the operator's
    /// `/metrics/tenants`).
    pub fn export_labeled(&self, f: &mut Families, labels: &[(&str, &str)]) {
        fn with<'a>(labels: &[(&'a str, &'a str)], extra: (&'a str, &'a str)) -> Vec<(&'a str, &'a str)> {
            labels.iter().copied().chain([extra]).collect()
        }
        f.histogram("bulkhead:time_to_first_token_seconds", "Time from request arrival to its first token.", labels, &self.ttft);
        f.histogram("bulkhead:inter_token_latency_seconds", "Time between consecutive tokens of a request.", labels, &self.itl);
        f.histogram(
            "bulkhead:time_per_output_token_seconds",
            "Mean time per output token after the first, per finished request of two tokens or more.",
            labels,
            &self.tpot,
        );
        f.histogram("bulkhead:e2e_request_latency_seconds", "Time from request arrival to its end, finished requests.", labels, &self.e2e);
        for (reason, n) in &self.success {
            f.counter(
                "bulkhead:request_success_total",
                "Requests finished, by finish reason.",
                &with(labels, ("finished_reason", reason)),
                *n,
            );
        }
        for (reason, n) in &self.failure {
            f.counter(
                "bulkhead:request_failure_total",
                "Requests failed after admission, by reason.",
                &with(labels, ("reason", reason)),
                *n,
            );
        }
        f.counter("bulkhead:prompt_tokens_total", "Prompt tokens of finished requests.", labels, self.prompt_tokens);
        f.counter("bulkhead:generation_tokens_total", "Tokens generated by finished requests.", labels, self.generation_tokens);
    }
}

fn valid_name(s: &str) -> bool {
    let mut b = s.bytes();
    b.next().is_some_and(|c| c.is_ascii_alphabetic() || c == b'_' || c == b':')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b':')
}

fn valid_label(s: &str) -> bool {
    let mut b = s.bytes();
    !s.starts_with("__")
        && b.next().is_some_and(|c| c.is_ascii_alphabetic() || c == b'_')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

/// A sample value as the text format writes it.
fn value_text(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf".into() } else { "-Inf".into() }
    } else {
        format!("{v}")
    }
}

fn escape(s: &str, quote: bool) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            '"' if quote => o.push_str("\\\""),
            c => o.push(c),
        }
    }
    o
}

fn kind_text(k: MetricKind) -> &'static str {
    match k {
        MetricKind::Counter => "counter",
        MetricKind::Gauge => "gauge",
        MetricKind::Histogram => "histogram",
    }
}

/// Whether `sample` may appear in family `family` of kind `kind`.
fn belongs(family: &str, kind: MetricKind, sample: &str) -> bool {
    match sample.strip_prefix(family) {
        Some("") => kind != MetricKind::Histogram,
        Some(suffix) => kind == MetricKind::Histogram && ["_bucket", "_sum", "_count"].contains(&suffix),
        None => false,
    }
}

struct Merged<'a> {
    help: &'a str,
    kind: MetricKind,
    lines: String,
}

/// The exposition of every source's families: one `# HELP` and `# TYPE` per family name,
/// all its samples together, each sample with its source's labels first. Families whose
/// name is invalid or whose type disagrees with an earlier source's, samples that do not
/// belong to their family, and labels with invalid or taken names are left out.
pub fn render<'a>(sources: impl IntoIterator<Item = (&'a [(String, String)], &'a [MetricFamily])>) -> String {
    render_only(sources, |_, _| true)
}

/// Series that move when some tenant's prompt is found in a prefix cache, or that tell how
/// much of it was: on a page anyone can read they would show when another tenant repeats
/// a prompt and how long the shared part is (I7); and speculation's acceptance, which tells
/// how much a request's output repeats its input. Served on the operator's page only.
const CACHE_ACTIVITY: [&str; 17] = [
    "bulkhead:prefix_cache_queries_total",
    "bulkhead:prefix_cache_hits_total",
    "bulkhead:prefix_cache_pages",
    "bulkhead:prefix_cache_stored_pages_total",
    "bulkhead:prefix_cache_evictions_total",
    "bulkhead:kv_cached_pages",
    // Free + cached + leased + quarantined = the pool: free would tell cached.
    "bulkhead:kv_free_pages",
    "bulkhead:kv_shared_leases",
    "bulkhead:kv_held_tokens_total",
    "bulkhead:kv_held_bytes_total",
    "bulkhead:kv_transferred_tokens_total",
    "bulkhead:local_prefill_tokens_total",
    "bulkhead:prefill_routing_total",
    "bulkhead:decode_routing_total",
    // Speculation's acceptance tells how much a request's output repeats its own input.
    "bulkhead:spec_decode_num_draft_tokens_total",
    "bulkhead:spec_decode_num_accepted_tokens_total",
    "bulkhead:spec_decode_accepted_length",
];

/// Whether a sample of `family` with `labels` tells one tenant's cache activity
/// ([`CACHE_ACTIVITY`], and the tenant-fence check, which runs once per shared page).
pub fn is_cache_activity(family: &str, labels: &[(String, String)]) -> bool {
    CACHE_ACTIVITY.contains(&family)
        || (family == "bulkhead:isolation_checks_total" && labels.iter().any(|(k, v)| k == "check" && v == "tenant_fence"))
}

/// [`render`] of the samples `keep` accepts (given the family's name and the sample's own
/// labels).
pub fn render_only<'a>(
    sources: impl IntoIterator<Item = (&'a [(String, String)], &'a [MetricFamily])>,
    keep: impl Fn(&str, &[(String, String)]) -> bool,
) -> String {
    let mut merged: BTreeMap<&'a str, Merged<'a>> = BTreeMap::new();
    for (extra, families) in sources {
        for fam in families {
            if !valid_name(&fam.name) {
                continue;
            }
            let kept: Vec<_> = fam.samples.iter().filter(|s| keep(&fam.name, &s.labels)).collect();
            if kept.is_empty() && !fam.samples.is_empty() {
                continue;
            }
            let m = merged.entry(&fam.name).or_insert(Merged { help: &fam.help, kind: fam.kind, lines: String::new() });
            if m.kind != fam.kind {
                continue;
            }
            for s in kept.into_iter().filter(|s| belongs(&fam.name, fam.kind, &s.name)) {
                let own = s.labels.iter().filter(|(k, _)| valid_label(k) && !extra.iter().any(|(e, _)| e == k));
                let labels: Vec<String> = extra.iter().chain(own).map(|(k, v)| format!("{k}=\"{}\"", escape(v, true))).collect();
                let _ = if labels.is_empty() {
                    writeln!(m.lines, "{} {}", s.name, value_text(s.value))
                } else {
                    writeln!(m.lines, "{}{{{}}} {}", s.name, labels.join(","), value_text(s.value))
                };
            }
        }
    }
    let mut out = String::new();
    for (name, m) in merged {
        let _ = writeln!(out, "# HELP {name} {}", escape(m.help, false));
        let _ = writeln!(out, "# TYPE {name} {}", kind_text(m.kind));
        out.push_str(&m.lines);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(l: &[(&str, &str)]) -> Vec<(String, String)> {
        l.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn families_of_several_sources_render_as_one_block_each_with_source_labels_first() {
        let mut gw = Families::new();
        gw.counter("bulkhead:prompt_tokens_total", "Prompt tokens.", &[], 12);
        gw.rejected("gateway", "context_length", 1);
        let mut w = Families::new();
        w.rejected("decode", "capacity", 2);
        w.gauge("bulkhead:kv_cache_usage_perc", "Usage.", &[], 0.25);
        let (gw, w) = (gw.into_vec(), w.into_vec());
        let none = Vec::new();
        let decode = labels(&[("worker", "decode-0"), ("role", "decode")]);
        let text = render([(&none[..], &gw[..]), (&decode[..], &w[..])]);
        let want = "\
# HELP bulkhead:kv_cache_usage_perc Usage.
# TYPE bulkhead:kv_cache_usage_perc gauge
bulkhead:kv_cache_usage_perc{worker=\"decode-0\",role=\"decode\"} 0.25
# HELP bulkhead:prompt_tokens_total Prompt tokens.
# TYPE bulkhead:prompt_tokens_total counter
bulkhead:prompt_tokens_total 12
# HELP bulkhead:rejected_admissions_total Requests refused at admission, by reason and where (gateway, prefill or decode worker).
# TYPE bulkhead:rejected_admissions_total counter
bulkhead:rejected_admissions_total{reason=\"context_length\",where=\"gateway\"} 1
bulkhead:rejected_admissions_total{worker=\"decode-0\",role=\"decode\",reason=\"capacity\",where=\"decode\"} 2
";
        assert_eq!(text, want);
    }

    #[test]
    fn a_histogram_has_cumulative_buckets_an_inf_bucket_a_sum_and_a_count() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        for v in [0.05, 0.1, 0.5, 7.0] {
            h.observe(v);
        }
        assert_eq!(h.count(), 4);
        let mut f = Families::new();
        f.histogram("x_seconds", "X.", &[("k", "v")], &h);
        let text = render([(&[][..], &f.into_vec()[..])]);
        let want = "\
# HELP x_seconds X.
# TYPE x_seconds histogram
x_seconds_bucket{k=\"v\",le=\"0.1\"} 2
x_seconds_bucket{k=\"v\",le=\"1\"} 3
x_seconds_bucket{k=\"v\",le=\"+Inf\"} 4
x_seconds_sum{k=\"v\"} 7.65
x_seconds_count{k=\"v\"} 4
";
        assert_eq!(text, want);
    }

    #[test]
    fn what_a_worker_sends_cannot_break_the_exposition() {
        let fam = |name: &str, kind, samples: Vec<MetricSample>| MetricFamily {
            name: name.into(),
            help: "line\nbreak \\ here".into(),
            kind,
            samples,
        };
        let sample = |name: &str, l: &[(&str, &str)], value| MetricSample { name: name.into(), labels: labels(l), value };
        let sent = [
            fam("bad name", MetricKind::Counter, vec![sample("bad name", &[], 1.0)]),
            fam(
                "ok_total",
                MetricKind::Counter,
                vec![
                    sample("ok_total", &[("v", "a\"b\\c\nd"), ("0bad", "x"), ("__reserved", "x"), ("worker", "spoofed")], f64::NAN),
                    sample("other_total", &[], 1.0),
                    sample("ok_total_bucket", &[], 1.0),
                ],
            ),
            // Same name, another type: left out.
            fam("ok_total", MetricKind::Gauge, vec![sample("ok_total", &[], 2.0)]),
            fam("g", MetricKind::Gauge, vec![sample("g", &[], f64::INFINITY), sample("g", &[], f64::NEG_INFINITY)]),
        ];
        let extra = labels(&[("worker", "prefill-0")]);
        let text = render([(&extra[..], &sent[..])]);
        let want = "\
# HELP g line\\nbreak \\\\ here
# TYPE g gauge
g{worker=\"prefill-0\"} +Inf
g{worker=\"prefill-0\"} -Inf
# HELP ok_total line\\nbreak \\\\ here
# TYPE ok_total counter
ok_total{worker=\"prefill-0\",v=\"a\\\"b\\\\c\\nd\"} NaN
";
        assert_eq!(text, want);
    }

    #[test]
    fn pool_usage_counts_quarantined_pages_and_every_access_is_a_lease_check() {
        let s = PoolStats {
            total_pages: 8,
            free_pages: 2,
            leased_pages: 5,
            quarantined_pages: 1,
            reads: 3,
            writes: 4,
            refusals: 1,
            ..Default::default()
        };
        let mut f = Families::new();
        pool_families(&s, &mut f);
        let text = render([(&[][..], &f.into_vec()[..])]);
        assert!(text.contains("bulkhead:kv_cache_usage_perc 0.75\n"), "{text}");
        assert!(text.contains("bulkhead:isolation_checks_total{check=\"lease\"} 8\n"), "{text}");
        assert!(text.contains("bulkhead:isolation_failures_total{check=\"lease\"} 1\n"), "{text}");
        assert!(text.contains("bulkhead:quarantined_pages 1\n"), "{text}");
    }

    /// docs/OPERATIONS.md lists every metric family the servers export, and nothing else:
    /// the names written in the process crates' sources against the names in its metrics
    /// table.
    #[test]
    fn the_operations_guide_lists_exactly_the_exported_metrics() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/");
        let names_in = |text: &str, open: &str| -> std::collections::BTreeSet<String> {
            text.split(open)
                .skip(1)
                .map(|rest| rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect::<String>())
                .filter(|n| !n.is_empty())
                .collect()
        };
        let mut exported = std::collections::BTreeSet::new();
        // Every process's crate: this one, the gateway's and the workers'.
        let sources = ["src", "../gateway/src", "../worker/src"].map(|d| std::fs::read_dir(format!("{root}{d}")).expect("src"));
        for entry in sources.into_iter().flatten() {
            let path = entry.expect("entry").path();
            if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("source");
                // Test modules use made-up families (`ok_total`) but no made-up `bulkhead:` names.
                exported.extend(names_in(&text, "\"bulkhead:"));
            }
        }
        let guide = std::fs::read_to_string(format!("{root}../../docs/OPERATIONS.md")).expect("docs/OPERATIONS.md");
        let listed = names_in(&guide, "| `bulkhead:");
        assert!(exported.len() > 30, "{exported:?}");
        let missing: Vec<_> = exported.difference(&listed).collect();
        let stale: Vec<_> = listed.difference(&exported).collect();
        assert!(
            missing.is_empty() && stale.is_empty(),
            "docs/OPERATIONS.md's metric table (rows starting with | `bulkhead:NAME`) differs from the code: \
             missing {missing:?}, not exported {stale:?}"
        );
    }
}
