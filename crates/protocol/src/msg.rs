//! Messages between the roles. Every request is named by the gateway's [`RequestId`], which
//! is also the owner of the KV leases taken for it on every worker.

use bulkhead_fingerprint::Fingerprint;
use bulkhead_kv::{ChunkHeader, KvPool, PageKey, PageRef, RequestId};

use crate::cache::CacheScope;
use crate::payload::Payload;

/// A worker's identity in the cluster: drawn at random by the worker when it starts (and
/// anew each time it rejoins), the same at every gateway it registers with; a gateway
/// refuses a second live worker with the same id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Fingerprint)]
pub struct WorkerId(pub u32);

/// A gateway's number in its cluster (`--gateway-id`), part of every request id it makes
/// ([`crate::gateway::request_id`]), so that the requests of several gateways never share an
/// id on a worker, and a worker knows which gateway each of its requests belongs to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Fingerprint)]
pub struct GatewayId(pub u8);

impl std::fmt::Display for GatewayId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "gateway-{}", self.0)
    }
}

impl std::fmt::Display for WorkerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "worker-{}", self.0)
    }
}

/// What a worker does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
pub enum Role {
    /// Computes prompt KV and sends it to a decode worker.
    Prefill,
    /// Receives prompt KV, verifies it, generates tokens.
    Decode,
}

/// What a worker announces when it connects (I5: capacity is a contract).
#[derive(Clone, Debug, PartialEq, Eq, Fingerprint)]
pub struct Hello {
    /// Role of the worker.
    pub role: Role,
    /// Digest of the model file (the gateway refuses a different model).
    pub model_digest: u64,
    /// Tokens per KV page.
    pub page_size: u32,
    /// KV bytes per token (layout and dtype together).
    pub kv_bytes_per_token: u32,
    /// Tokens the worker's KV pool holds.
    pub capacity_tokens: u64,
    /// Longest request (prompt + generation) the worker accepts.
    pub max_context: u32,
    /// Where prefill workers reach this (decode) worker, `host:port`; empty for prefill.
    pub kv_addr: String,
    /// The worker's id ([`WorkerId`]: its own, the same at every gateway).
    pub worker: WorkerId,
}

impl Hello {
    /// What worker `worker` of `role` serving the model with digest `model_digest` from
    /// `pool` announces: the pool's layout and capacity, and the context it accepts.
    pub fn for_pool(role: Role, worker: WorkerId, model_digest: u64, pool: &KvPool, max_context: usize, kv_addr: String) -> Self {
        let layout = pool.layout();
        Hello {
            role,
            model_digest,
            page_size: layout.page_size as u32,
            kv_bytes_per_token: layout.bytes_per_token() as u32,
            capacity_tokens: pool.capacity_tokens() as u64,
            max_context: max_context as u32,
            kv_addr,
            worker,
        }
    }
}

/// How to pick each token: the one sampling vocabulary of the gateway, the workers and the
/// engine. The default is greedy, with nothing else applied.
///
/// The order every sampler applies them in (vLLM's): the model's logits give the
/// log-probabilities that are reported ([`Sampling::logprobs`]); then the repetition,
/// frequency and presence penalties, `logit_bias`, `min_tokens` and the grammar's mask
/// change the logits; then temperature, `min_p`, `top_k` and `top_p` pick the token.
#[derive(Clone, Debug, PartialEq, Fingerprint)]
pub struct Sampling {
    /// Softmax temperature; 0 = greedy (argmax).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 = off.
    pub top_k: u32,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose mass reaches
    /// `top_p`; 1 = off.
    pub top_p: f32,
    /// Keep only tokens at least `min_p` times as likely as the most likely one; 0 = off.
    pub min_p: f32,
    /// Seed, if reproducibility was asked for.
    pub seed: Option<u64>,
    /// Generate past end-of-generation tokens (only max_tokens or a stop string ends).
    pub ignore_eos: bool,
    /// Show no text for special (control) tokens such as `<|im_start|>` (vLLM's default).
    pub skip_special_tokens: bool,
    /// Subtracted from the logit of every token generated so far, once (OpenAI's range
    /// -2..=2); 0 = off.
    pub presence_penalty: f32,
    /// Subtracted from the logit of every token generated so far, once per occurrence;
    /// 0 = off.
    pub frequency_penalty: f32,
    /// vLLM's: the logits of tokens in the prompt or generated so far are divided by it
    /// (multiplied when negative); 1 = off.
    pub repetition_penalty: f32,
    /// Added to the logits of these tokens (OpenAI's range -100..=100), ascending by id.
    pub logit_bias: Vec<(u32, f32)>,
    /// End-of-generation and `stop_token_ids` tokens cannot be picked before this many
    /// tokens were generated.
    pub min_tokens: u32,
    /// Tokens that end the generation like an end-of-generation token (shown as no text).
    pub stop_token_ids: Vec<u32>,
    /// Report each picked token's log-probability and this many most likely alternatives
    /// (0..=20); `None` = off.
    pub logprobs: Option<u8>,
    /// What the output must match (structured outputs); `None` = anything.
    pub grammar: Option<GrammarSpec>,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            ignore_eos: false,
            skip_special_tokens: true,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            logprobs: None,
            grammar: None,
        }
    }
}

impl Sampling {
    /// Whether these settings select greedy decoding (argmax).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Whether the repetition penalty needs the prompt's tokens (a decode worker gets them
    /// in `Reserve` only then).
    pub fn needs_prompt(&self) -> bool {
        self.repetition_penalty != 1.0
    }
}

/// What a request's output must match (structured outputs). Every worker that samples a
/// token compiles it over its vocabulary (the grammar crate, with llguidance) and masks
/// every token it does not allow, the first token on the prefill worker included.
#[derive(Clone, Debug, PartialEq, Eq, Fingerprint)]
pub enum GrammarSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid under this JSON Schema (its text).
    JsonSchema(String),
    /// Text matching this regular expression (vLLM's `guided_regex`).
    Regex(String),
    /// Exactly one of these strings (vLLM's `guided_choice`).
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark dialect (vLLM's `guided_grammar`; tool calls).
    Lark(String),
}

/// One generated token's log-probability under the model (before penalties, bias and
/// grammar), and the most likely tokens at that step with theirs.
#[derive(Clone, Debug, PartialEq, Fingerprint)]
pub struct TokenLogprobs {
    /// The log-probability of the picked token.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// Where a request came from, carried to every worker so that its log lines can be found
/// from the client's side: the W3C trace id the gateway continued or started, and the
/// HTTP `x-request-id`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Fingerprint)]
pub struct TraceContext {
    /// W3C trace id (16 bytes; all zero when none was set, e.g. in tests).
    pub trace_id: [u8; 16],
    /// The HTTP request's `x-request-id` (the API keeps at most 128 printable ASCII bytes).
    pub request_id: String,
    /// The tenant's name (from its API key), for the workers' log lines of the request.
    pub tenant: String,
}

/// Prometheus type of a [`MetricFamily`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
pub enum MetricKind {
    /// Only goes up (restarts at zero with the process).
    Counter,
    /// Goes up and down.
    Gauge,
    /// Cumulative buckets (`_bucket{le=..}`), `_sum` and `_count`.
    Histogram,
}

/// One sample of a metric family.
#[derive(Clone, Debug, PartialEq, Fingerprint)]
pub struct MetricSample {
    /// Full sample name: the family's, or for a histogram with `_bucket`, `_sum`, `_count`.
    pub name: String,
    /// Label names and values.
    pub labels: Vec<(String, String)>,
    /// Value.
    pub value: f64,
}

/// A metric family as a worker reports it: self-describing, so a gateway renders metrics
/// it does not know by name (a newer worker's) without a protocol change.
#[derive(Clone, Debug, PartialEq, Fingerprint)]
pub struct MetricFamily {
    /// Family name, e.g. `bulkhead:kv_cache_usage_perc`.
    pub name: String,
    /// One line of help text.
    pub help: String,
    /// Prometheus type.
    pub kind: MetricKind,
    /// Its samples.
    pub samples: Vec<MetricSample>,
}

/// Why a request was refused before it ran (I3). Terminal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
pub enum RejectReason {
    /// Prompt plus generation exceeds what the worker can hold.
    ContextLength,
    /// Not enough free KV pages right now.
    Capacity,
    /// The request id is already in use.
    Duplicate,
    /// The request is malformed (empty prompt, zero max tokens).
    Invalid,
}

/// Why a running request failed. Terminal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
pub enum FailReason {
    /// A KV chunk or the completion claim failed verification (I2).
    TransferRefused,
    /// No completion in time.
    Timeout,
    /// A worker went away.
    WorkerLost,
    /// The model failed.
    Internal,
}

/// Why a request is being aborted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
pub enum AbortReason {
    /// The client went away.
    ClientGone,
    /// The gateway gave up waiting.
    Timeout,
    /// Another role failed the request.
    Failed,
    /// Shutting down.
    Shutdown,
}

/// Why a generation ended: the one vocabulary of the engine, the wire and the API.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema), schema(rename_all = "lowercase"))]
pub enum FinishReason {
    /// End-of-generation token or a stop string.
    Stop,
    /// `max_tokens` (or the context) reached.
    Length,
    /// Ended early on purpose (a server shutting down, a caller's abort), with what was
    /// generated so far. Never folded into `Stop`: a client must be able to tell.
    Abort,
}

impl FinishReason {
    /// The OpenAI (and vLLM, for `abort`) `finish_reason` string. The schema's names are
    /// these (`api/tests/openapi.rs` checks it).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// What an internal connection is for; part of its handshake, so a handshake made for one
/// port cannot be replayed on the other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
pub enum Purpose {
    /// Worker → gateway: registration and control.
    Control = 0,
    /// Prefill → decode: KV transfer.
    Kv = 1,
}

/// Every message of protocol version [`crate::codec::VERSION`].
#[derive(Clone, Debug, PartialEq, Fingerprint)]
pub enum Message {
    /// Connecting side, first frame where the cluster has a key ([`crate::auth`]): what the
    /// connection is for, the identity it claims (a prefill worker's id on a KV
    /// connection, else 0), a fresh nonce, and whether it wants frames encrypted.
    AuthHello { purpose: Purpose, claim: u32, nonce: [u8; 32], encrypt: bool },
    /// Accepting side: its fresh nonce, whether the session is encrypted (if either side
    /// wants it) and its proof of the key over the transcript.
    AuthChallenge { nonce: [u8; 32], proof: [u8; 32], encrypt: bool },
    /// Connecting side: its proof of the key. Every later frame carries a tag.
    AuthProof { proof: [u8; 32] },
    /// Either side: the handshake is refused (no key where one is needed, or the other way
    /// round); the connection closes.
    AuthRefused { reason: String },
    /// Worker → gateway, first message: who it is.
    Hello(Hello),
    /// Gateway → worker: registered (under the id of its `Hello`) with this gateway.
    Welcome { gateway: GatewayId },
    /// Gateway → worker: refused (model or layout mismatch); the connection closes.
    Refuse { reason: String },
    /// Gateway → prefill: a decode worker to open a KV connection to.
    DecodePeer { worker: WorkerId, addr: String },
    /// Prefill → decode, first message on a KV connection.
    KvHello { prefill: WorkerId },
    /// Decode → prefill, the answer to every `KvHello`: the UCX worker address this
    /// connection's KV frames may go to, or empty (TCP only). Sent only over an
    /// authenticated session (I9): UCX parses it in C.
    KvUcxAddress { address: Vec<u8> },
    /// Prefill → decode, after a non-empty `KvUcxAddress`: the prefill's own UCX worker
    /// address if the frames that follow go over UCX (this is then the last frame on the
    /// TCP connection from the prefill; the decode side opens an endpoint back, which UCX
    /// needs between network namespaces), or empty if they stay on TCP.
    KvUcxUse { address: Vec<u8> },
    /// Prefill → decode, about every second on each KV connection: the prefill worker is
    /// alive and the link carries its frames. Like every frame from it, it re-arms the
    /// transfer timer of the reservations assigned to it, so prompts queued behind others
    /// do not time out while a silent (cut or hung) prefill still does.
    KvKeepalive,
    /// Prefill → gateway: its KV connection to `decode` closed or could not be opened
    /// (it does not reconnect).
    KvLost { decode: WorkerId },
    /// Gateway → decode: prefill `worker` has no KV connection to this decode worker and
    /// will open none (it left, or reported `KvLost`).
    PrefillUnreachable { worker: WorkerId },
    /// Gateway → prefill: decode worker `worker` left the cluster; stop reconnecting to it.
    /// Gateway → decode: prefill worker `worker` left the cluster: it writes nothing more,
    /// and a KV connection from it that is still on its way is refused.
    PeerLeft { worker: WorkerId },
    /// Decode → gateway: pages freed since this worker last refused a reservation for
    /// want of room; the gateway offers it its queue again.
    Room,
    /// Gateway → decode: reserve pages for a prompt that `prefill` will write. `resume`
    /// holds the tokens a retracted request already generated (and the client already has):
    /// they end the prompt, and the decode loop replays them to pick up where it was.
    /// `prompt` holds the client's prompt tokens: the sampling's penalties, the cache's
    /// keys and speculation's lookups read them. `cache`: the request's prefix-cache scope, as in `Prefill`: the decode worker
    /// shares the prompt's cached pages of this scope and keeps the request's full pages
    /// when it ends.
    Reserve {
        req: RequestId,
        prompt_tokens: u32,
        max_tokens: u32,
        prefill: WorkerId,
        sampling: Sampling,
        stop: Vec<String>,
        resume: Vec<u32>,
        prompt: Vec<u32>,
        trace: TraceContext,
        cache: Option<CacheScope>,
    },
    /// Decode → gateway: reserved. `held`: the leading prompt tokens the decode worker
    /// holds already (cached pages of the request's scope, shared to it); `pages`: the
    /// prompt pages the prefill may write, the first holding position `held`. `local`: the
    /// decode worker computes the rest of the prompt itself (it is short, see
    /// `DecodeConfig::local_prefill_tokens`): no `Prefill` is sent, and no prefill worker
    /// takes part in this attempt.
    Reserved { req: RequestId, held: u32, pages: Vec<PageRef>, local: bool },
    /// Worker → gateway: refused before running. Terminal for the request.
    Rejected {
        req: RequestId,
        reason: RejectReason,
        #[fingerprint(skip)]
        detail: String,
    },
    /// Gateway → prefill: compute this prompt's KV and send positions `held..` into
    /// `decode`'s `pages` (the decode worker holds the first `held`). `skip_draws`:
    /// sampling draws made before (a retracted request's tokens), so a seeded sampler picks
    /// up where it was. `cache`: the request's prefix-cache scope (its tenant and salt),
    /// `None` when it must neither use nor fill the cache.
    Prefill {
        req: RequestId,
        tokens: Vec<u32>,
        decode: WorkerId,
        held: u32,
        pages: Vec<PageRef>,
        sampling: Sampling,
        skip_draws: u32,
        trace: TraceContext,
        cache: Option<CacheScope>,
    },
    /// Prefill → decode: KV bytes for one page segment.
    KvChunk {
        req: RequestId,
        header: ChunkHeader,
        #[fingerprint(skip)]
        data: Payload,
    },
    /// Prefill → decode: all chunks sent. The last message for `req` on this connection.
    /// `cached`: how many of the `tokens` came from the prefill's cache (they were sent and
    /// are verified like the others).
    /// `first_logprobs`: the first token's, when the request asked for them.
    Done {
        req: RequestId,
        tokens: u32,
        first_token: u32,
        #[fingerprint(manifest)]
        manifest: u64,
        cached: u32,
        first_logprobs: Option<TokenLogprobs>,
    },
    /// Prefill → decode: nothing (more) will be sent for `req`. The last message for `req`.
    Fenced { req: RequestId },
    /// Decode → gateway: one generated token, the text it released, and its
    /// log-probabilities when the request asked for them.
    Token { req: RequestId, token: u32, text: String, logprobs: Option<TokenLogprobs> },
    /// Decode → gateway: the request ended normally. Terminal. `cached_tokens`: the prompt
    /// tokens its prefill took from the cache (as `Done` said).
    Finished { req: RequestId, finish: FinishReason, text: String, prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32 },
    /// Decode → gateway: the decode loop needed the request's pages for others and gave
    /// them back (through the pool's release, generation bump included). Not terminal: the
    /// gateway queues it again with `tokens` (everything it generated so far) as `resume`.
    Retracted { req: RequestId, tokens: Vec<u32> },
    /// Worker → gateway: the request failed. Terminal.
    Failed {
        req: RequestId,
        reason: FailReason,
        #[fingerprint(skip)]
        detail: String,
    },
    /// Any direction: end the request.
    Abort { req: RequestId, reason: AbortReason },
    /// Gateway → decode: end a reservation that was never dispatched to a prefill worker, so
    /// no writer can exist for its pages (they are released, not quarantined).
    Cancel { req: RequestId },
    /// Prefill or decode → gateway: pages its prefix cache stored and evicted since its
    /// last report, for cache-aware routing. The gateway learns the index from these, not from guesses.
    CacheReport { stored: Vec<PageKey>, evicted: Vec<PageKey> },
    /// Worker → gateway, periodically and when a request ends on the worker: the worker's
    /// current metrics, replacing what it sent before (I6: evidence leaves the worker).
    Metrics { families: Vec<MetricFamily> },
}

impl Message {
    /// The request a message is about, if any.
    pub fn req(&self) -> Option<RequestId> {
        match self {
            Message::Reserve { req, .. }
            | Message::Reserved { req, .. }
            | Message::Rejected { req, .. }
            | Message::Prefill { req, .. }
            | Message::KvChunk { req, .. }
            | Message::Done { req, .. }
            | Message::Fenced { req }
            | Message::Token { req, .. }
            | Message::Finished { req, .. }
            | Message::Retracted { req, .. }
            | Message::Failed { req, .. }
            | Message::Abort { req, .. }
            | Message::Cancel { req } => Some(*req),
            Message::Hello(_)
            | Message::Welcome { .. }
            | Message::Refuse { .. }
            | Message::DecodePeer { .. }
            | Message::KvHello { .. }
            | Message::KvUcxAddress { .. }
            | Message::KvUcxUse { .. }
            | Message::KvKeepalive
            | Message::KvLost { .. }
            | Message::PrefillUnreachable { .. }
            | Message::PeerLeft { .. }
            | Message::Room
            | Message::Metrics { .. }
            | Message::CacheReport { .. }
            | Message::AuthHello { .. }
            | Message::AuthChallenge { .. }
            | Message::AuthProof { .. }
            | Message::AuthRefused { .. } => None,
        }
    }
}
