//! The API's [`Backend`] over the gateway: templating, tokenising and the gateway's own
//! admission check, before anything is sent to the actor.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use bulkhead_api::{ApiError, Backend, GenEvent, GenerationRequest, ModelCard};

use bulkhead_api::PromptEncoder;
use bulkhead_protocol::admission::{Generate, admit, default_max_tokens};
use bulkhead_protocol::gateway::{Submission, TenantId};
use bulkhead_protocol::{RejectReason, TraceContext};
use tokio::sync::mpsc;

use crate::inbox::{ACTOR_INBOX, Cmd};
use crate::shared::{Shared, count};

/// The [`Backend`] the HTTP layer calls: templating, tokenising and the gateway's own
/// admission check happen here, before anything is sent to a worker.
pub struct ClusterBackend(pub(crate) Arc<Shared>);

impl Backend for ClusterBackend {
    fn models(&self) -> Vec<ModelCard> {
        let mut c = self.0.card.clone();
        c.max_model_len = self.0.max_context.load(Ordering::Acquire);
        let aliases = self.0.aliases.iter().map(|id| ModelCard { id: id.clone(), ..c.clone() }).collect::<Vec<_>>();
        std::iter::once(c).chain(aliases).collect()
    }

    fn encoder(&self) -> &PromptEncoder {
        &self.0.encoder
    }

    fn defaults(&self) -> bulkhead_api::openai::Defaults {
        self.0.defaults
    }

    fn generate(&self, req: GenerationRequest) -> Result<mpsc::Receiver<GenEvent>, ApiError> {
        let arrived = Instant::now();
        let s = &self.0;
        let tokens = s.encoder.encode(&req.prompt).inspect_err(|_| count(&s.refused.invalid))?;
        let limit = s.max_context.load(Ordering::Acquire);
        let max_tokens = req.max_tokens.unwrap_or_else(|| default_max_tokens(tokens.len(), limit));
        let prompt_param = req.prompt.param();
        if s.admission_check
            && let Err(r) = admit(tokens.len(), Generate::Tokens(max_tokens), limit)
        {
            count(if r.reason() == RejectReason::ContextLength { &s.refused.context_length } else { &s.refused.invalid });
            return Err(ApiError::refused(&r, prompt_param));
        }
        let max_tokens = u32::try_from(max_tokens).map_err(|_| {
            count(&s.refused.context_length);
            ApiError::context_length_exceeded(tokens.len(), max_tokens, limit, prompt_param)
        })?;
        // Enough room for every token of the longest request: sends never block the actor.
        let (tx, rx) = mpsc::channel(limit.max(16) + 8);
        let tenant = TenantId(req.tenant.id);
        // The scope comes from the tenant of the API key and the salt; nothing else.
        let cache = s.cache_secret.as_ref().map(|secret| secret.scope(&req.tenant.name, req.cache_salt.as_deref()));
        let trace = TraceContext { trace_id: req.trace_id.0, request_id: req.request_id, tenant: req.tenant.name.to_string() };
        let submission = Submission {
            tokens,
            max_tokens,
            max_tokens_set: req.max_tokens.is_some(),
            sampling: req.sampling,
            stop: req.stop,
            trace,
            tenant,
            cache,
            priority: req.priority,
        };
        match s.cmds.try_send(Cmd::Submit { submission, arrived, events: tx, prompt_param }) {
            Ok(()) => Ok(rx),
            Err(mpsc::error::TrySendError::Full(_)) => {
                count(&s.refused.busy);
                Err(ApiError::too_many_requests("gateway_busy", format!("the gateway has {ACTOR_INBOX} commands waiting; retry shortly")))
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Err(ApiError::internal("the gateway is shutting down")),
        }
    }

    fn ready(&self) -> bool {
        self.0.ready.load(Ordering::Acquire)
    }

    fn healthy(&self) -> bool {
        !self.0.failed.load(Ordering::Acquire) && !self.0.cmds.is_closed()
    }

    fn responded(&self, status: u16) {
        // A poisoned count is still a count: no panic holds it half-written.
        *self.0.responses.lock().unwrap_or_else(std::sync::PoisonError::into_inner).entry(status).or_default() += 1;
    }

    fn refused_early(&self, reason: &'static str) {
        let r = &self.0.refused;
        count(if reason == "context_length" { &r.context_length } else { &r.invalid });
    }
}
