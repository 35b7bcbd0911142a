//! Deliberately broken driver policies, for the checkers only (feature `sabotage`).
//!
//! Each plants one of the incident's bugs (or a cousin) into the driver core through its
//! policy trait, so the model checker (`crates/modelcheck`) and the fault schedules
//! (`crates/faultsim`) can show that they catch it. Both checkers take them from here, the
//! driver core's own crate, so neither depends on the other. Production never builds them.

use bulkhead_fingerprint::Fingerprint;
use bulkhead_kv::{PageKey, RequestId};

use crate::Message;
use crate::cache::CacheScope;
use crate::decode::{DecodeAction, DecodeEvent};
use crate::driver::decode::DecodePolicy;
use crate::driver::prefill::PrefillPolicy;
use crate::prefill::PrefillJob;

/// A decode driver that breaks the fence (I4) or the decode-side cache's scopes (I10).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
pub enum DecodeSabotage {
    /// Honest: what production does.
    None,
    /// `Fenced` from a prefill worker is taken for information and dropped, so quarantined
    /// pages wait for a fence that never comes.
    DropFences,
    /// A transfer timeout is taken for a fence: the quarantined pages of every timed-out
    /// transfer are released while its prefill worker may still write into them.
    FenceOnTimeout,
    /// Every reservation is looked up and kept under the first cache scope the driver saw,
    /// whatever its own (a driver that mixes up scopes): requests of every tenant share one
    /// decode-side cache, and the fence, derived from the same scope, cannot tell them apart.
    OneScope(Option<CacheScope>),
    /// A lost gateway is not the decode worker's business: its requests stay reserved and
    /// decoding for clients that are gone.
    IgnoreGatewayLoss,
}

impl DecodePolicy for DecodeSabotage {
    fn inbound(&mut self, ev: DecodeEvent) -> Option<DecodeEvent> {
        match (ev, self) {
            (DecodeEvent::Prefill { msg: Message::Fenced { .. }, .. }, DecodeSabotage::DropFences) => None,
            (DecodeEvent::GatewayLost { .. }, DecodeSabotage::IgnoreGatewayLoss) => None,
            (
                DecodeEvent::Gateway {
                    from,
                    msg:
                        Message::Reserve { req, prompt_tokens, max_tokens, prefill, sampling, stop, resume, prompt, trace, cache: Some(scope) },
                },
                DecodeSabotage::OneScope(first),
            ) => {
                let cache = Some(*first.get_or_insert(scope));
                let reserve = Message::Reserve { req, prompt_tokens, max_tokens, prefill, sampling, stop, resume, prompt, trace, cache };
                Some(DecodeEvent::Gateway { from, msg: reserve })
            }
            (ev, _) => Some(ev),
        }
    }

    fn outbound(&mut self, acts: Vec<DecodeAction>, feedback: &mut Vec<DecodeEvent>) -> Vec<DecodeAction> {
        if *self == DecodeSabotage::FenceOnTimeout {
            let fences = acts.iter().filter_map(DecodeAction::timeout_abort);
            feedback.extend(fences.map(|(from, req)| DecodeEvent::Prefill { from, msg: Message::Fenced { req } }));
        }
        acts
    }
}

/// A prefill driver that breaks admission (I1) or the tenant fence (I7).
#[derive(Debug, Fingerprint)]
pub struct PrefillSabotage {
    /// The incident's scheduler: a job the role refused is kept, and a 1-token placeholder
    /// of the refused prompt runs behind the role's back.
    keeps_rejected: bool,
    /// Cached pages are keyed without the request's scope (tenant and salt): equal prompts
    /// of two tenants get equal keys, and only the pool's fence stands in the way.
    unscoped_keys: bool,
    /// Requests the role refused, whatever the policy did with the refusal (for the
    /// checkers' ghost state: from then on they must not reach transfer or decode).
    pub refused: Vec<RequestId>,
}

impl PrefillSabotage {
    /// Honest: what production does (the refusals are still recorded).
    pub fn none() -> Self {
        PrefillSabotage { keeps_rejected: false, unscoped_keys: false, refused: Vec::new() }
    }

    /// Keep refused jobs and run a placeholder of each.
    pub fn keep_rejected() -> Self {
        PrefillSabotage { keeps_rejected: true, ..Self::none() }
    }

    /// Key cached pages without the scope.
    pub fn unscoped_keys() -> Self {
        PrefillSabotage { unscoped_keys: true, ..Self::none() }
    }
}

impl PrefillPolicy for PrefillSabotage {
    fn refused(&mut self, job: &PrefillJob) -> Option<PrefillJob> {
        self.refused.push(job.req);
        self.keeps_rejected.then(|| PrefillJob { tokens: job.tokens[..1.min(job.tokens.len())].to_vec(), ..job.clone() })
    }

    fn page_keys(&mut self, scope: &CacheScope, model_digest: u64, tokens: &[u32], page_size: usize) -> Vec<PageKey> {
        // Broken: one key space for every tenant and salt.
        let scope = if self.unscoped_keys { CacheScope([0; 32]) } else { *scope };
        scope.page_keys(model_digest, tokens, page_size)
    }
}
