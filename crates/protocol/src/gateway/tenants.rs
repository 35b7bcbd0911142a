//! The tenants' side of the queue: each tenant's policy (weight and limits), its token
//! bucket, its recent use of prefill, and the choice of which tenant's queue goes next.
//! A request is charged to its tenant's bucket at admission and settled when it ends.

use bulkhead_fingerprint::Fingerprint;

use bulkhead_kv::RequestId;

use super::{BusyReason, GatewayRole, InFlight};

/// A tenant, as the API layer numbers them (from the API key, never from the body).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Fingerprint)]
pub struct TenantId(pub u32);

/// A tenant's share of the queue and its limits (the tenants file's `weight`,
/// `max_concurrent_requests`, `tokens_per_minute`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
pub struct TenantPolicy {
    /// Its share of the queue, at least 1: the queue serves next the tenant whose recent
    /// prefill use divided by its weight is least.
    pub weight: u32,
    /// Requests it may have in flight (queued or running) at once.
    pub max_concurrent_requests: Option<u32>,
    /// Prompt tokens plus `max_tokens` it may be charged per minute (a token bucket of that
    /// size refilled at that rate); what a request did not use is refunded when it ends.
    pub tokens_per_minute: Option<u64>,
}

impl Default for TenantPolicy {
    fn default() -> Self {
        TenantPolicy { weight: 1, max_concurrent_requests: None, tokens_per_minute: None }
    }
}

/// Completion tokens charged at admission for a request that did not set `max_tokens`
/// (the official clients' default), on top of its prompt; its real use is settled when it
/// ends. Charging the rest of the context instead would make such a request larger than a
/// small tenant's whole budget, refused for ever.
pub const IMPLICIT_COMPLETION_CHARGE: u32 = 256;

/// How fast a tenant's recent use of prefill (`Usage`) is forgotten: it halves every this
/// many milliseconds. Long against a prompt's prefill (a second or two), so a light tenant
/// keeps its credit through a burst of its own; short against a busy tenant's minutes.
pub const USAGE_HALF_LIFE_MS: u64 = 30_000;

/// A tenant's recent use of prefill: the prompt tokens the queue gave it, halving every
/// [`USAGE_HALF_LIFE_MS`]. The queue serves the tenant with the least use per weight.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Fingerprint)]
pub(super) struct Usage {
    pub(super) tokens: u64,
    #[fingerprint(clock)]
    pub(super) at_ms: u64,
}

impl Usage {
    /// The tokens left at `now_ms`: halved per half-life passed, and linearly within one
    /// (1 − x/2 for a fraction x of a half-life, close to 2^−x and exact at 0 and 1).
    pub(super) fn at(self, now_ms: u64) -> u64 {
        let passed = now_ms.saturating_sub(self.at_ms);
        let halvings = passed / USAGE_HALF_LIFE_MS;
        let t = if halvings >= 64 { 0 } else { self.tokens >> halvings };
        let rest = passed % USAGE_HALF_LIFE_MS;
        t - (u128::from(t) * u128::from(rest) / u128::from(2 * USAGE_HALF_LIFE_MS)) as u64
    }
}

/// A tenant's token bucket, in token-milliminutes: a full bucket holds `tokens_per_minute`
/// × 60,000 and refills by `tokens_per_minute` every millisecond, so integers suffice. The
/// level goes below zero when a request used more than it was charged at admission (a
/// request without `max_tokens` is charged an estimate): the debt delays the next request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
pub(super) struct Bucket {
    level: i64,
    #[fingerprint(clock)]
    at_ms: u64,
}

const MS_PER_MINUTE: u64 = 60_000;

/// `tokens` in the buckets' unit (token-milliminutes), saturating.
fn milli_minutes(tokens: u64) -> i64 {
    i64::try_from(tokens.saturating_mul(MS_PER_MINUTE)).unwrap_or(i64::MAX)
}

/// A tenant's limit that a request is over at admission.
pub(super) enum OverLimit {
    /// For now (HTTP 429).
    Busy(BusyReason, String),
    /// For ever: it is larger than the tenant's whole bucket (HTTP 400).
    Never(String),
}

impl GatewayRole {
    /// Takes `req` out of whichever queue holds it.
    pub(super) fn unqueue(&mut self, req: RequestId) {
        for q in self.queues.values_mut() {
            q.retain(|r| *r != req);
        }
        self.queues.retain(|_, q| !q.is_empty());
    }

    /// The next tenant to serve: of those with anything queued, the one that used least
    /// prefill lately per unit of weight (a light tenant's burst goes ahead of a tenant
    /// that keeps the server busy; two busy tenants share by weight), the first after the
    /// last served among equals.
    pub(super) fn next_tenant(&self) -> Option<TenantId> {
        let key = |t: TenantId| {
            let used = self.usage.get(&t).map_or(0, |u| u.at(self.now_ms));
            (u128::from(used) << 32) / u128::from(self.policy(t).weight.max(1))
        };
        let waiting = self.queues.iter().filter(|(_, q)| !q.is_empty()).map(|(t, _)| *t);
        let (after, upto): (Vec<TenantId>, Vec<TenantId>) = waiting.partition(|t| self.last_served.is_some_and(|l| *t > l));
        // Round-robin order from the one after the last served; `min_by_key` keeps the first
        // of equal keys.
        after.into_iter().chain(upto).min_by_key(|t| key(*t))
    }

    fn policy(&self, tenant: TenantId) -> TenantPolicy {
        self.cfg.tenants.get(&tenant).copied().unwrap_or_default()
    }

    /// The tenant's limits at admission: `Some` when over one, else the request is charged
    /// to its bucket. A refusal leaves nothing charged.
    pub(super) fn over_limit(&mut self, f: &mut InFlight) -> Option<OverLimit> {
        let policy = self.policy(f.sub.tenant);
        if let Some(most) = policy.max_concurrent_requests {
            let running = self.inflight.values().filter(|o| o.sub.tenant == f.sub.tenant).count();
            if running >= most as usize {
                let detail = format!("this tenant has {running} requests in flight, its max_concurrent_requests is {most}");
                return Some(OverLimit::Busy(BusyReason::ConcurrencyLimit, detail));
            }
        }
        let tpm = policy.tokens_per_minute?.max(1);
        let now = self.now_ms;
        let full = milli_minutes(tpm);
        let bucket = self.buckets.entry(f.sub.tenant).or_insert(Bucket { level: full, at_ms: now });
        // `tpm` token-milliminutes a millisecond.
        let refill = i64::try_from(now.saturating_sub(bucket.at_ms).saturating_mul(tpm)).unwrap_or(i64::MAX);
        bucket.level = bucket.level.saturating_add(refill).min(full);
        bucket.at_ms = now;
        let (completion, what) = if f.sub.max_tokens_set {
            (f.sub.max_tokens, "prompt and max_tokens")
        } else {
            (f.sub.max_tokens.min(IMPLICIT_COMPLETION_CHARGE), "prompt and an estimate of the completion, as max_tokens is not set")
        };
        let tokens = f.sub.tokens.len() as u64 + u64::from(completion);
        let cost = milli_minutes(tokens);
        if cost > full {
            let detail = format!(
                "this request counts {tokens} tokens ({what}), more than this tenant's tokens_per_minute of {tpm}: it can never be admitted; send a shorter prompt or a smaller max_tokens"
            );
            return Some(OverLimit::Never(detail));
        }
        if cost > bucket.level {
            // Refilled at `tpm` per ms: whole seconds until it holds `cost`; finite, as the
            // cost fits a full bucket and a debt is at most one context's tokens.
            let wait_ms = (cost.saturating_sub(bucket.level)).unsigned_abs().div_ceil(tpm);
            let retry_after_s = u32::try_from(wait_ms.div_ceil(1000)).unwrap_or(u32::MAX);
            let detail = format!(
                "this request counts {tokens} tokens ({what}); this tenant's tokens_per_minute ({tpm}) allows it in {retry_after_s} s"
            );
            return Some(OverLimit::Busy(BusyReason::TokenLimit { retry_after_s }, detail));
        }
        bucket.level -= cost;
        f.charged = tokens;
        None
    }

    /// Ends `req`'s record and settles its tenant's bucket: the prompt and the tokens it
    /// generated are used; what it was charged beyond that goes back, what it used beyond
    /// its charge (an estimate, when `max_tokens` was not set) is taken (the level may go
    /// below zero).
    pub(super) fn end(&mut self, req: &RequestId) -> Option<InFlight> {
        let f = self.inflight.remove(req)?;
        let used = (f.sub.tokens.len() + f.sent.len()) as u64;
        let tpm = self.cfg.tenants.get(&f.sub.tenant).and_then(|p| p.tokens_per_minute);
        if let (Some(b), Some(tpm), true) = (self.buckets.get_mut(&f.sub.tenant), tpm, f.charged > 0) {
            let settle = milli_minutes(f.charged).saturating_sub(milli_minutes(used));
            b.level = b.level.saturating_add(settle).min(milli_minutes(tpm));
        }
        Some(f)
    }
}
