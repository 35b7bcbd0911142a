//! `bulkhead serve`'s settings: every flag (with its environment variable), the checks
//! of combinations a role would otherwise ignore, and what each role's settings become.
//! A child of `serve --role all` gets these as data (JSON on its standard input).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use bulkhead_api::Tenants;
use bulkhead_engine::Speculation;
use bulkhead_gateway::GatewayOptions;
use bulkhead_gateway::http::HttpLimits;
use bulkhead_kv::KvChecks;
use bulkhead_protocol::gateway::GatewaySettings;
use bulkhead_transport::kv_transport::KvTransport;
use bulkhead_transport::trust::{self, Trust};
use bulkhead_worker::core_budget::{CoreBudget, ShareMode, Slo};
use bulkhead_worker::worker::WorkerConfig;
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::ModelArgs;

/// `--cluster-encryption`; see [`trust::Encryption`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum ClusterEncryption {
    /// With a peer on another host.
    Auto,
    /// Always, loopback included.
    On,
    /// Never asked for by this side.
    Off,
}

impl From<ClusterEncryption> for trust::Encryption {
    fn from(e: ClusterEncryption) -> Self {
        match e {
            ClusterEncryption::Auto => trust::Encryption::Auto,
            ClusterEncryption::On => trust::Encryption::On,
            ClusterEncryption::Off => trust::Encryption::Off,
        }
    }
}

/// `--kv-transport`: which road KV frames take from prefill to decode workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum KvTransportArg {
    /// UCX where it loads, the cluster has a key and the peers share shared memory, CMA or RDMA; TCP otherwise.
    Auto,
    /// UCX on every KV connection (its TCP included), or the connection fails; needs UCX and a cluster key.
    Ucx,
    /// Bulkhead's TCP framing only.
    Tcp,
}

/// `--speculative`: whether decode workers verify drafted tokens beside each sequence's last.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum SpeculativeArg {
    /// One token per sequence per step.
    Off,
    /// N-gram prompt lookup: what followed the sequence's last few tokens where they occurred before (in its prompt or its output) is verified in the same step; no second model.
    Ngram,
    /// A smaller model of the same tokenizer (`--draft-model`) drafts greedily in its own KV pool, verified the same way.
    Draft,
}

impl From<KvTransportArg> for KvTransport {
    fn from(t: KvTransportArg) -> Self {
        match t {
            KvTransportArg::Auto => KvTransport::Auto,
            KvTransportArg::Ucx => KvTransport::Ucx,
            KvTransportArg::Tcp => KvTransport::Tcp,
        }
    }
}

/// `--core-budget`: how the workers on one host share its cores while both have work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum CoreBudgetArg {
    /// Prefill pauses during each decode step; while prompts wait, decode steps keep the pace the SLO allows (--slo-tpot-ms, --slo-ttft-ms), prefill taking the rest.
    Slo,
    /// Each worker runs on one compute thread while the other has work, on all of them alone.
    Split,
    /// Prefill pauses during each decode step; while prompts wait, decode steps start at most once per --decode-interval-ms.
    Pause,
    /// No shared budget: the processes pre-empt each other.
    Off,
}

impl CoreBudgetArg {
    /// The mode a budget runs in, or `None` for no budget.
    fn mode(self) -> Option<ShareMode> {
        match self {
            CoreBudgetArg::Split => Some(ShareMode::Split),
            CoreBudgetArg::Slo | CoreBudgetArg::Pause => Some(ShareMode::Pause),
            CoreBudgetArg::Off => None,
        }
    }
}

/// `--web-ui`: whether the gateway serves the chat page and the dashboard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum WebUi {
    /// Served.
    On,
    /// Not served: `/` and `/dashboard` are 404.
    Off,
}

/// Whether the gateway serves the web UI: as `--web-ui` says, else when it listens on
/// loopback only (a page only this machine reaches) or tenants need API keys (a page that
/// needs one).
pub(crate) fn web_ui_on(flag: Option<WebUi>, host: &str, keys_required: bool) -> bool {
    match flag {
        Some(w) => w == WebUi::On,
        None => keys_required || host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback()),
    }
}

/// Which part of the system this process runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum ServeRole {
    /// Gateway plus one prefill and one decode worker (or as many as asked) on this machine.
    All,
    /// The HTTP gateway only; workers register at --worker-listen.
    Gateway,
    /// A prefill worker registering with --gateway.
    Prefill,
    /// A decode worker registering with --gateway.
    Decode,
}

#[derive(Args, Debug, Clone, Serialize, Deserialize)]
pub struct ServeArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// What to run.
    #[arg(long, env = "BULKHEAD_ROLE", value_enum, default_value_t = ServeRole::All)]
    pub(crate) role: ServeRole,
    /// HTTP address (gateway).
    #[arg(long, env = "BULKHEAD_HOST", default_value = "127.0.0.1")]
    pub(crate) host: String,
    /// HTTP port (gateway).
    #[arg(long, env = "BULKHEAD_PORT", default_value_t = 8080)]
    pub(crate) port: u16,
    /// Where workers register (gateway); port 0 picks one.
    #[arg(long, env = "BULKHEAD_WORKER_LISTEN", default_value = "127.0.0.1:0")]
    pub(crate) worker_listen: String,
    /// The gateways' worker addresses (prefill, decode): one, or several separated by
    /// commas, each a gateway of the same cluster (several need a cluster key). The worker
    /// registers with each, and dials a lost one again while the others keep it busy.
    #[arg(long, env = "BULKHEAD_GATEWAY", value_delimiter = ',')]
    pub(crate) gateway: Vec<String>,
    /// This gateway's number in a cluster of several (gateway): part of every request id
    /// it makes, so workers shared by several gateways tell their requests apart. Give
    /// each gateway of a cluster its own.
    #[arg(long, env = "BULKHEAD_GATEWAY_ID", default_value_t = 0)]
    pub(crate) gateway_id: u8,
    /// Gateways `serve --role all` runs on this host (1 to 8): this process and the rest as
    /// child processes on the next HTTP ports (any free ones with --port 0), each admitting,
    /// queueing and routing on its own over the same workers; a gateway that dies is
    /// restarted like a worker, and the others serve on meanwhile.
    #[arg(long, env = "BULKHEAD_GATEWAYS", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=8))]
    pub(crate) gateways: u8,
    /// Exit when standard input closes: `serve`'s own gateway children, so that they never
    /// outlive it.
    #[arg(long, hide = true, env = "BULKHEAD_EXIT_WITH_STDIN", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) exit_with_stdin: bool,
    /// Read every setting as one JSON line from standard input, before the cluster key (a
    /// child of `serve --role all`: its settings travel as data, never as rebuilt flags).
    /// Alone: any other flag beside it would be replaced by the settings read, so clap
    /// refuses the combination.
    #[arg(long, hide = true, exclusive = true, env = "BULKHEAD_SETTINGS_STDIN", value_parser = clap::builder::BoolishValueParser::new(), num_args = 0, default_missing_value = "true")]
    #[serde(skip)]
    pub(crate) settings_stdin: bool,
    /// Where prefill workers reach this decode worker.
    #[arg(long, env = "BULKHEAD_KV_LISTEN", default_value = "127.0.0.1:0")]
    pub(crate) kv_listen: String,
    /// Address prefill workers are told to reach this decode worker at (default: the
    /// bound --kv-listen address; set it when listening on 0.0.0.0).
    #[arg(long, env = "BULKHEAD_KV_ADVERTISE")]
    pub(crate) kv_advertise: Option<String>,
    /// KV pool size in tokens (default: twice the context).
    #[arg(long, env = "BULKHEAD_KV_POOL_TOKENS", conflicts_with = "kv_memory")]
    pub(crate) kv_pool_tokens: Option<usize>,
    /// KV pool size as a memory budget, e.g. 512MiB or 2GiB.
    #[arg(long, env = "BULKHEAD_KV_MEMORY")]
    pub(crate) kv_memory: Option<String>,
    /// Context length to advertise (default: the model's).
    #[arg(long, env = "BULKHEAD_CONTEXT_LENGTH")]
    pub(crate) context_length: Option<usize>,
    /// Advertise what the KV pool holds instead of refusing to start when it is smaller than the context.
    #[arg(long, env = "BULKHEAD_CLAMP_CONTEXT", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) clamp_context: bool,
    /// Pages per KV transfer batch (also the prefill chunk).
    #[arg(long, env = "BULKHEAD_TRANSFER_BATCH_PAGES", default_value_t = 32)]
    pub(crate) transfer_batch_pages: usize,
    /// Prompt tokens one prefill step computes in all, over as many queued prompts as fit (each at most one chunk of --transfer-batch-pages per step), so short prompts are not held behind a long one; at least one chunk.
    #[arg(long, env = "BULKHEAD_MAX_PREFILL_TOKENS", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) max_prefill_tokens: u32,
    /// How long a decode worker waits for a reservation's prefill worker to send anything (a chunk for any request, or a keepalive) before it fails the transfer (ms); a prefill worker sends keepalives every quarter of this, at most every second, so give both the same value. Queueing at a busy prefill is bounded by --request-timeout-ms.
    #[arg(long, env = "BULKHEAD_TRANSFER_TIMEOUT_MS", default_value_t = 60_000)]
    pub(crate) transfer_timeout_ms: u64,
    /// Decode workers: a request that finds part of its prompt in the decode worker's cache (a conversation's earlier turns) and at most this many prompt tokens missing has the rest computed on the decode worker, beside its decoding sequences, instead of by a prefill worker: no prefill queue, no transfer, and the previous answer, which only the decode worker holds, is not computed again. 0: every prompt goes through a prefill worker.
    #[arg(long, env = "BULKHEAD_MAX_LOCAL_PREFILL_TOKENS", default_value_t = 256)]
    pub(crate) max_local_prefill_tokens: usize,
    /// Decode workers: speculative decoding. With `ngram`, a sequence whose last tokens occurred earlier in its prompt or output feeds what followed them there as drafts beside its last token; a draft is kept only while the pick the step makes anyway equals it, so the text is exactly what `off` gives (greedy or seeded), and a rejected draft's KV is un-written in the same step. Drafts are made only while at most 4 sequences decode, as many per sequence as pay given how often its drafts were accepted and what a drafted row costs (learnt from the steps), and none where none pays. Pays on copying (edits, quotes, code, later turns that repeat earlier ones): see BENCHMARKS.md.
    #[arg(long, env = "BULKHEAD_SPECULATIVE", value_enum, default_value_t = SpeculativeArg::Ngram)]
    pub(crate) speculative: SpeculativeArg,
    /// Decode workers: the draft model of `--speculative draft`, a GGUF whose tokenizer is the model's (refused at start-up, naming the first difference, otherwise). Its KV pool holds 4 requests of the context (counted in the start-up capacity check); it drafts only while at most 4 sequences decode.
    #[arg(long, env = "BULKHEAD_DRAFT_MODEL")]
    pub(crate) draft_model: Option<PathBuf>,
    /// Decode workers: most drafted tokens a sequence feeds per step with `--speculative ngram` or `draft` (1-16; refused with off). Default 4.
    #[arg(long, env = "BULKHEAD_SPECULATIVE_TOKENS", value_parser = clap::value_parser!(u32).range(1..=16))]
    pub(crate) speculative_tokens: Option<u32>,
    /// Which road KV frames take from prefill to decode workers, chosen per connection and logged with it (`bulkhead:kv_connections_total{transport}`); the frames, their MACs and the chunk checks are the same on both.
    #[arg(long, env = "BULKHEAD_KV_TRANSPORT", value_enum, default_value_t = KvTransportArg::Auto)]
    pub(crate) kv_transport: KvTransportArg,
    /// A request not finished after this long fails (ms).
    #[arg(long, env = "BULKHEAD_REQUEST_TIMEOUT_MS", default_value_t = 600_000)]
    pub(crate) request_timeout_ms: u64,
    /// Requests one tenant may have waiting at the gateway for KV capacity or workers; one more gets 429 with Retry-After.
    #[arg(long, env = "BULKHEAD_MAX_QUEUED_REQUESTS", default_value_t = 1024)]
    pub(crate) max_queued_requests: usize,
    /// How long a request may wait at the gateway for KV capacity or workers before it gets 429 (ms).
    #[arg(long, env = "BULKHEAD_QUEUE_TIMEOUT_MS", default_value_t = 120_000)]
    pub(crate) queue_timeout_ms: u64,
    /// How many times one request may move to another decode worker when the one it was on
    /// is lost, resuming from the tokens the client already has; past that its stream ends
    /// with an error event (0: never move).
    #[arg(long, env = "BULKHEAD_MIGRATION_LIMIT", default_value_t = 3)]
    pub(crate) migration_limit: u32,
    /// Prompt tokens the gateway gives one prefill worker at once (being reserved for,
    /// queued there or computed); later prompts wait in the gateway's queue, where tenants
    /// are served by recent use per weight, so one tenant's burst does not fill the prefill worker's own
    /// first-come queue ahead of another's. A prompt always goes to an idle worker. 0: no
    /// window.
    #[arg(long, env = "BULKHEAD_PREFILL_WINDOW_TOKENS", default_value_t = 512)]
    pub(crate) prefill_window_tokens: usize,
    /// The `temperature` of a request that sends none (0 to 2; 0: greedy). OpenAI's default is 1; a seed is drawn for every request without one, so a migrated stream resumes the same text.
    #[arg(long, env = "BULKHEAD_DEFAULT_TEMPERATURE", default_value_t = bulkhead_api::openai::OPENAI_TEMPERATURE, value_parser = temperature)]
    pub(crate) default_temperature: f32,
    /// Client connections served at once. At the cap a new connection takes the place of the oldest idle connection that never carried an authenticated request (of the source address holding the most); with none, it waits in the listen backlog until one closes.
    #[arg(long, env = "BULKHEAD_MAX_CONNECTIONS", default_value_t = 4096)]
    pub(crate) max_connections: usize,
    /// Client connections one source address may hold at once (default: a quarter of --max-connections); one more takes the place of that address's oldest idle connection that never authenticated, or is closed.
    #[arg(long, env = "BULKHEAD_MAX_CONNECTIONS_PER_SOURCE")]
    pub(crate) max_connections_per_source: Option<usize>,
    /// How long a new client connection may take to send its first request's headers; then it is closed (ms).
    #[arg(long, env = "BULKHEAD_HTTP_FIRST_HEADER_TIMEOUT_MS", default_value_t = 5_000)]
    pub(crate) http_first_header_timeout_ms: u64,
    /// How long a client connection may take to send a later request's headers, counted from the end of its previous response (the keep-alive idle timeout); then it is closed (ms).
    #[arg(long, env = "BULKHEAD_HTTP_HEADER_TIMEOUT_MS", default_value_t = 30_000)]
    pub(crate) http_header_timeout_ms: u64,
    /// How long a client connection that never carried an authenticated request (a tenant's key, or any /v1/ request where no keys are configured) may stay open; then its request in flight finishes and it is closed (ms).
    #[arg(long, env = "BULKHEAD_HTTP_STRANGER_TIMEOUT_MS", default_value_t = 15_000)]
    pub(crate) http_stranger_timeout_ms: u64,
    /// How long a request body may take to arrive; then 408 (ms).
    #[arg(long, env = "BULKHEAD_HTTP_BODY_TIMEOUT_MS", default_value_t = 30_000)]
    pub(crate) http_body_timeout_ms: u64,
    /// How long shutdown waits for in-flight requests (s).
    #[arg(long, env = "BULKHEAD_DRAIN_TIMEOUT_S", default_value_t = 30)]
    pub(crate) drain_timeout_s: u64,
    /// Prefill workers to start (role all).
    #[arg(long, env = "BULKHEAD_PREFILL_WORKERS", default_value_t = 1)]
    pub(crate) prefill_workers: usize,
    /// Decode workers to start (role all).
    #[arg(long, env = "BULKHEAD_DECODE_WORKERS", default_value_t = 1)]
    pub(crate) decode_workers: usize,
    /// KV pool size in tokens for prefill workers only (role all; default: --kv-pool-tokens).
    #[arg(long, env = "BULKHEAD_PREFILL_KV_POOL_TOKENS")]
    pub(crate) prefill_kv_pool_tokens: Option<usize>,
    /// How the prefill and decode workers on one host share its cores while both have
    /// work, so that their compute threads stop pre-empting each other. Role all sets the
    /// budget up itself; workers started by hand on one host need --core-budget-dir as well.
    /// Default slo: first tokens first, every running stream within --slo-tpot-ms.
    #[arg(long, env = "BULKHEAD_CORE_BUDGET", value_enum)]
    pub(crate) core_budget: Option<CoreBudgetArg>,
    /// With --core-budget pause only (refused with the other modes): while prompts wait, a
    /// decode step starts at most once per this many ms and prefill gets the rest
    /// (inter-token latency is then about this). Default 15.
    #[arg(long, env = "BULKHEAD_DECODE_INTERVAL_MS")]
    pub(crate) decode_interval_ms: Option<u64>,
    /// Per-token latency target (ms) of --core-budget slo (refused with the other modes):
    /// while a prompt is late, decode steps start at most once per three quarters of this
    /// (half that while prompts wait in time), prefill taking the rest of the cores.
    /// Default 100.
    #[arg(long, env = "BULKHEAD_SLO_TPOT_MS", value_parser = clap::value_parser!(u64).range(4..=60_000))]
    pub(crate) slo_tpot_ms: Option<u64>,
    /// Time-to-first-token target (ms) of --core-budget slo (refused with the other modes):
    /// prompts are late once the prefill worker has been busy for half of this without a
    /// pause. Default 2500.
    #[arg(long, env = "BULKHEAD_SLO_TTFT_MS", value_parser = clap::value_parser!(u64).range(10..=600_000))]
    pub(crate) slo_ttft_ms: Option<u64>,
    /// Prefill and decode workers started by hand on one host: a directory only this user
    /// can enter, the same for all of them, where they meet for the core budget.
    #[arg(long, env = "BULKHEAD_CORE_BUDGET_DIR")]
    pub(crate) core_budget_dir: Option<PathBuf>,
    /// Prefill and decode workers: answer HTTP probes at this address, `GET /health`
    /// (liveness: 200 while loading and while the worker's main loop turned in the last 60
    /// s) and `GET /ready` (200 while registered with the gateway and not stalled). For
    /// Kubernetes httpGet probes; it shows nothing but the state.
    #[arg(long, env = "BULKHEAD_HEALTH_LISTEN")]
    pub(crate) health_listen: Option<String>,
    /// Name of the model in the API; give it more than once (or comma-separated) for
    /// aliases, the first being the main one. Default: the model file's name without
    /// `.gguf` (`SmolLM2-135M-Instruct.Q4_1`), as `GET /v1/models` shows.
    #[arg(long, env = "BULKHEAD_MODEL_ID", value_delimiter = ',')]
    pub(crate) model_id: Vec<String>,
    #[command(flatten)]
    pub(crate) checks: KvCheckArgs,
    /// The cluster key (64 hex digits) every process of the cluster must hold; the file must
    /// not be readable by others. Make one with `bulkhead keygen FILE`. Role all makes a
    /// random key per run when none is given.
    #[arg(long, env = "BULKHEAD_CLUSTER_KEY_FILE")]
    pub(crate) cluster_key_file: Option<PathBuf>,
    /// Let internal listeners (the gateway's worker port, a decode worker's KV port) face
    /// the network without a cluster key: anyone who reaches them can join the cluster.
    /// For benchmarks on a closed network only; logged loudly.
    #[arg(long, env = "BULKHEAD_INSECURE_CLUSTER", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) insecure_cluster: bool,
    /// When this process asks for its internal frames (prompts, tokens, KV) to be encrypted
    /// with AES-256-GCM under the session key, as well as authenticated: auto (with a peer
    /// on another host; not over loopback), on (always; needs a cluster key), off (never
    /// asked by this side). A connection is encrypted if either side asks.
    #[arg(long, env = "BULKHEAD_CLUSTER_ENCRYPTION", value_enum, default_value_t = ClusterEncryption::Auto)]
    pub(crate) cluster_encryption: ClusterEncryption,
    /// Internal: read the cluster key from the first line of stdin (how `serve` hands it to
    /// the workers it starts, so it is never on a command line or in the environment).
    #[arg(long, hide = true, env = "BULKHEAD_CLUSTER_KEY_STDIN", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) cluster_key_stdin: bool,
    /// Tenants and their API keys (gateway): a TOML file with one `[[tenant]]` table per
    /// tenant (`name`, `api_keys` and/or `api_key_sha256`). Every /v1/ request must then
    /// carry one of the keys as `Authorization: Bearer <key>`; the key picks the tenant,
    /// whose prefix cache and queue are its own.
    #[arg(long, env = "BULKHEAD_TENANTS", conflicts_with = "api_key")]
    pub(crate) tenants: Option<PathBuf>,
    /// One API key every /v1/ request must carry (one tenant, `default`); vLLM's flag.
    #[arg(long, env = "BULKHEAD_API_KEY")]
    pub(crate) api_key: Option<String>,
    /// The operator's key (gateway): with it, `/metrics/tenants` serves per-tenant series
    /// (latencies, outcomes, tokens, refusals, waiting requests, labelled with tenant names)
    /// to a bearer of this key only; without it, that page is not served. `/metrics` keeps
    /// cluster-wide series only.
    #[arg(long, env = "BULKHEAD_ADMIN_KEY")]
    pub(crate) admin_key: Option<String>,
    /// The chat page at `/` and the live isolation dashboard at `/dashboard` (gateway): on or
    /// off. Default: on when --host is a loopback address or API keys are required (--tenants,
    /// --api-key), off otherwise.
    #[arg(long, env = "BULKHEAD_WEB_UI", value_enum)]
    pub(crate) web_ui: Option<WebUi>,
    /// Workers: where the laid-out (packed) weights are written once per model and layout and mapped read-only by every worker on this host, so the prefill and decode workers hold one copy between them and a restart maps instead of packing (default: $BULKHEAD_HOME/weights; about the model file's size per model).
    #[arg(long, env = "BULKHEAD_WEIGHTS_CACHE")]
    pub(crate) weights_cache: Option<PathBuf>,
    /// Workers: each holds its own copy of the laid-out weights (nothing written to --weights-cache).
    #[arg(long, env = "BULKHEAD_NO_WEIGHTS_CACHE", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) no_weights_cache: bool,
    /// Do not share KV pages between requests: no prefix cache on the prefill workers, and
    /// none on the decode workers (every turn's whole prompt is then sent).
    #[arg(long, env = "BULKHEAD_NO_PREFIX_CACHE", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) no_prefix_cache: bool,
    /// Most KV pages of a worker's pool its prefix cache keeps, on prefill and decode workers
    /// alike (default: the whole pool; cached pages nobody reads are evicted whenever a
    /// prompt or a growing sequence needs room).
    #[arg(long, env = "BULKHEAD_PREFIX_CACHE_PAGES")]
    pub(crate) prefix_cache_pages: Option<usize>,
    /// Test only: switch the gateway's context check off to show the workers' own holds.
    #[arg(long, hide = true, env = "BULKHEAD_NO_GATEWAY_ADMISSION", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) no_gateway_admission: bool,
}

/// The optional KV integrity checks (design I6). Canaries and checksums are on unless
/// switched off, which exists to measure their cost; the auditor is off unless asked for.
#[derive(Args, Debug, Clone, Serialize, Deserialize)]
pub struct KvCheckArgs {
    /// Run the KV auditor: every slot attention is about to read is checked against a
    /// shadow tag (owner request, page generation). 16 bytes of memory per slot and layer.
    #[arg(long, env = "BULKHEAD_AUDIT_KV", value_parser = clap::builder::BoolishValueParser::new())]
    pub audit_kv: bool,
    /// Measurement only: do not poison freed pages nor check attended slots for the poison.
    #[arg(long, env = "BULKHEAD_NO_KV_CANARIES", value_parser = clap::builder::BoolishValueParser::new())]
    pub no_kv_canaries: bool,
    /// Measurement only: do not checksum KV chunks on handoff. Prefill and decode workers
    /// must agree: a decode worker that checks refuses unchecksummed chunks.
    #[arg(long, env = "BULKHEAD_NO_KV_CHECKSUMS", value_parser = clap::builder::BoolishValueParser::new())]
    pub no_kv_checksums: bool,
}

impl KvCheckArgs {
    /// The pool configuration these flags ask for.
    pub fn checks(&self) -> KvChecks {
        KvChecks { canaries: !self.no_kv_canaries, checksums: !self.no_kv_checksums, audit: self.audit_kv }
    }
}

/// Parse sizes like `512MiB`, `2GiB`, `1000000`.
fn parse_bytes(s: &str) -> anyhow::Result<u64> {
    let s = s.trim();
    let (num, mult) =
        [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("GB", 1_000_000_000), ("MB", 1_000_000), ("KB", 1000), ("B", 1)]
            .iter()
            .find_map(|(suf, m)| s.strip_suffix(suf).map(|n| (n.trim(), *m)))
            .unwrap_or((s, 1));
    let n: f64 = num.parse().with_context(|| format!("invalid size `{s}` (examples: 512MiB, 2GiB)"))?;
    anyhow::ensure!(n.is_finite() && n > 0.0, "size `{s}` must be positive");
    Ok((n * mult as f64) as u64)
}

impl ServeArgs {
    pub(crate) fn pool_tokens(&self, bytes_per_token: usize, context: usize) -> anyhow::Result<usize> {
        if let Some(t) = self.kv_pool_tokens {
            return Ok(t);
        }
        if let Some(m) = &self.kv_memory {
            return Ok((parse_bytes(m)? / bytes_per_token as u64) as usize);
        }
        Ok(2 * context)
    }

    /// Where this process's cluster key comes from: stdin (a worker `serve` started), the key
    /// file, or (role all, neither given) a new random one; none otherwise.
    pub(crate) fn trust(&self) -> anyhow::Result<Trust> {
        let key = if self.cluster_key_stdin {
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).context("cannot read the cluster key from stdin")?;
            Some(bulkhead_protocol::auth::ClusterKey::from_hex(&line).context("the cluster key on stdin")?)
        } else if let Some(path) = &self.cluster_key_file {
            Some(trust::load_key_file(path)?)
        } else if self.role == ServeRole::All {
            Some(trust::generate_key()?)
        } else {
            None
        };
        let t = Trust::new(key, self.insecure_cluster, self.cluster_encryption.into())?;
        tracing::info!(internal_connections = t.describe(), "cluster trust");
        Ok(t)
    }

    pub(crate) fn worker(&self, model: PathBuf, gateways: Vec<String>, trust: Trust) -> anyhow::Result<WorkerConfig> {
        // The model's shape decides bytes per token; read it without loading weights.
        let f = bulkhead_gguf::GgufFile::open_metadata(&model)?;
        let c = bulkhead_model::LlamaConfig::from_gguf(&f)?;
        let context = self.context_length.unwrap_or(c.context_length);
        Ok(WorkerConfig {
            model,
            threads: self.model.threads,
            kernel_sums: self.model.kernel_sums.0,
            gateways,
            pool_tokens: self.pool_tokens(c.kv_bytes_per_token(2), context)?,
            page_size: self.model.page_size as usize,
            context_length: self.context_length,
            clamp_context: self.clamp_context,
            kv_listen: self.kv_listen.clone(),
            kv_advertise: self.kv_advertise.clone(),
            transfer_batch_pages: self.transfer_batch_pages,
            max_prefill_tokens: self.max_prefill_tokens as usize,
            transfer_timeout_ms: self.transfer_timeout_ms,
            max_local_prefill_tokens: self.max_local_prefill_tokens,
            speculation: {
                let tokens = self.speculative_tokens.unwrap_or(DEFAULT_SPECULATIVE_TOKENS) as usize;
                match self.speculative {
                    SpeculativeArg::Off => Speculation::Off,
                    SpeculativeArg::Ngram => Speculation::Ngram { tokens },
                    SpeculativeArg::Draft => Speculation::Draft { tokens },
                }
            },
            draft_model: self.draft_model.clone(),
            weights_cache: self.weights_cache_dir(),
            kv_checks: self.checks.checks(),
            trust,
            prefix_cache_pages: if self.no_prefix_cache { 0 } else { self.prefix_cache_pages.unwrap_or(usize::MAX) },
            kv_transport: self.kv_transport.into(),
            core_budget: self.core_budget_dir.clone().zip(self.budget_mode()).map(|(dir, mode)| CoreBudget {
                dir,
                mode,
                decode_interval: Duration::from_millis(self.decode_interval_ms.unwrap_or(DEFAULT_DECODE_INTERVAL_MS)),
                slo: self.slo(),
            }),
            health: None,
        })
    }
}

/// `--decode-interval-ms` when `--core-budget pause` leaves it unset.
const DEFAULT_DECODE_INTERVAL_MS: u64 = 15;
/// `--speculative-tokens` when unset.
const DEFAULT_SPECULATIVE_TOKENS: u32 = 4;
/// `--slo-tpot-ms` when unset: the chat pair's per-token target.
const DEFAULT_SLO_TPOT_MS: u64 = 100;
/// `--slo-ttft-ms` when unset: the chat pair's first-token target.
const DEFAULT_SLO_TTFT_MS: u64 = 2500;

impl ServeArgs {
    /// The SLO that paces decode, if any (`--core-budget slo`, the default).
    pub(crate) fn slo(&self) -> Option<Slo> {
        (self.core_budget() == CoreBudgetArg::Slo).then(|| Slo {
            tpot: Duration::from_millis(self.slo_tpot_ms.unwrap_or(DEFAULT_SLO_TPOT_MS)),
            ttft: Duration::from_millis(self.slo_ttft_ms.unwrap_or(DEFAULT_SLO_TTFT_MS)),
        })
    }

    fn core_budget(&self) -> CoreBudgetArg {
        self.core_budget.unwrap_or(CoreBudgetArg::Slo)
    }

    /// How the workers share the cores, or `None` for no budget.
    pub(crate) fn budget_mode(&self) -> Option<ShareMode> {
        self.core_budget().mode()
    }

    /// Refuse core budget flags this configuration would otherwise ignore.
    pub(crate) fn check_core_budget(&self) -> anyhow::Result<()> {
        let core_budget = self.core_budget();
        let mode = core_budget.to_possible_value().map(|v| v.get_name().to_string()).unwrap_or_default();
        for (given, flag) in [(self.slo_tpot_ms.is_some(), "--slo-tpot-ms"), (self.slo_ttft_ms.is_some(), "--slo-ttft-ms")] {
            if !given {
                continue;
            }
            if self.role == ServeRole::Gateway {
                anyhow::bail!("{flag} paces the workers' compute; a gateway computes nothing (give it to the workers)");
            }
            if core_budget != CoreBudgetArg::Slo {
                anyhow::bail!("{flag} paces decode under --core-budget slo (the default) only; this is --core-budget {mode}");
            }
        }
        if self.decode_interval_ms.is_some() && core_budget != CoreBudgetArg::Pause {
            anyhow::bail!("--decode-interval-ms paces decode under --core-budget pause only; this is --core-budget {mode}");
        }
        if self.core_budget_dir.is_some() {
            if !matches!(self.role, ServeRole::Prefill | ServeRole::Decode) {
                anyhow::bail!(
                    "--core-budget-dir is for prefill and decode workers started by hand (--role prefill or decode); role all makes its own, and a gateway computes nothing"
                );
            }
            if core_budget == CoreBudgetArg::Off {
                anyhow::bail!("--core-budget-dir names a core budget, but --core-budget is off");
            }
        }
        Ok(())
    }

    /// Refuse a draft model without draft speculation, draft speculation without one, a
    /// draft length with speculation off, and a weights cache directory beside
    /// `--no-weights-cache`.
    pub(crate) fn check_speculation(&self) -> anyhow::Result<()> {
        if self.no_weights_cache && self.weights_cache.is_some() {
            anyhow::bail!("--weights-cache names where workers share their weights, but --no-weights-cache turns sharing off: drop one");
        }
        if self.speculative == SpeculativeArg::Off && self.speculative_tokens.is_some() {
            anyhow::bail!("--speculative-tokens sizes drafts, but --speculative is off: drop one");
        }
        match (self.speculative, &self.draft_model) {
            (SpeculativeArg::Draft, None) => anyhow::bail!("--speculative draft needs --draft-model (a GGUF with the model's tokenizer)"),
            (SpeculativeArg::Off | SpeculativeArg::Ngram, Some(_)) => {
                let mode = self.speculative.to_possible_value().map(|v| v.get_name().to_string()).unwrap_or_default();
                anyhow::bail!("--draft-model drafts for --speculative draft only; this is --speculative {mode}")
            }
            _ => Ok(()),
        }
    }

    /// Refuse gateway flags the role would otherwise ignore.
    pub(crate) fn check_gateways(&self) -> anyhow::Result<()> {
        if self.gateways > 1 && self.role != ServeRole::All {
            anyhow::bail!(
                "--gateways starts gateways beside `serve --role all`; run one --role gateway per gateway (each with its own --gateway-id) instead"
            );
        }
        if self.gateway_id != 0 && self.role != ServeRole::Gateway {
            anyhow::bail!("--gateway-id numbers a gateway started with --role gateway (role all numbers its own)");
        }
        if !self.gateway.is_empty() && !matches!(self.role, ServeRole::Prefill | ServeRole::Decode) {
            anyhow::bail!("--gateway tells a prefill or decode worker where to register; role all registers its workers itself");
        }
        Ok(())
    }
}

/// A `--default-temperature`: a number from 0 to 2, as the API accepts in a request.
pub(crate) fn temperature(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(t) if (0.0..=2.0).contains(&t) => Ok(t),
        _ => Err(format!("{s:?} is not a temperature from 0 to 2")),
    }
}

/// `--max-connections-per-source`, or its default: a quarter of `--max-connections`.
pub(crate) fn max_per_source(a: &ServeArgs) -> usize {
    a.max_connections_per_source.unwrap_or(a.max_connections / 4).max(1)
}

impl ServeArgs {
    /// The tenants the flags name: a tenants file, one API key, or none (open).
    pub(crate) fn tenants(&self) -> anyhow::Result<Tenants> {
        Ok(match (&self.tenants, &self.api_key) {
            (Some(path), _) => Tenants::load(path)?,
            (None, Some(key)) => Tenants::single_key(key)?,
            (None, None) => Tenants::open(),
        })
    }

    /// The gateway's settings, for the gateway of this process.
    pub(crate) fn gateway_options(&self, model: PathBuf, trust: Trust, tenants: Tenants) -> anyhow::Result<GatewayOptions> {
        Ok(GatewayOptions {
            chat_template: self.model.chat_template.clone(),
            http_addr: format!("{}:{}", self.host, self.port),
            workers: self.worker_listen.clone(),
            model,
            model_ids: self.model_id.clone(),
            settings: GatewaySettings {
                admission_check: !self.no_gateway_admission,
                request_timeout_ms: self.request_timeout_ms,
                max_queued: self.max_queued_requests,
                queue_timeout_ms: self.queue_timeout_ms,
                migration_limit: self.migration_limit,
                prefill_window_tokens: self.prefill_window_tokens,
            },
            http: HttpLimits {
                max_connections: self.max_connections,
                max_per_source: max_per_source(self),
                first_header_timeout: Duration::from_millis(self.http_first_header_timeout_ms.max(1)),
                header_timeout: Duration::from_millis(self.http_header_timeout_ms.max(1)),
                stranger_lifetime: Duration::from_millis(self.http_stranger_timeout_ms.max(1)),
            },
            body_timeout: Duration::from_millis(self.http_body_timeout_ms.max(1)),
            trust,
            web_ui: web_ui_on(self.web_ui, &self.host, tenants.authenticates()),
            admin_key_sha256: match self.admin_key.as_deref() {
                Some("") => anyhow::bail!("--admin-key is empty"),
                Some(k) => Some(bulkhead_api::tenants::key_digest(k)),
                None => None,
            },
            tenants: std::sync::Arc::new(tenants),
            prefix_cache: prefix_cache_described(self.no_prefix_cache, self.prefix_cache_pages).is_some(),
            gateway_id: bulkhead_protocol::GatewayId(self.gateway_id),
            defaults: bulkhead_api::openai::Defaults { temperature: self.default_temperature },
        })
    }

    /// The settings of prefill or decode worker `role` that `serve --role all` starts: its
    /// own, with what makes them that worker's. Flags the worker has no use for travel too
    /// and are ignored; those it would refuse are cleared.
    pub(crate) fn worker_settings(
        &self,
        role: ServeRole,
        model: PathBuf,
        gateways: Vec<String>,
        budget_dir: Option<PathBuf>,
        key: bool,
    ) -> ServeArgs {
        let mut w = self.child_settings(role, model, key);
        w.gateway = gateways;
        if role == ServeRole::Prefill {
            w.kv_pool_tokens = self.prefill_kv_pool_tokens.or(self.kv_pool_tokens);
        }
        w.core_budget_dir = budget_dir;
        // Resolved here: a child does not see this process's $BULKHEAD_HOME.
        w.weights_cache = self.weights_cache_dir();
        w
    }

    /// Where workers share laid-out weights, if anywhere.
    pub(crate) fn weights_cache_dir(&self) -> Option<PathBuf> {
        (!self.no_weights_cache).then(|| self.weights_cache.clone().unwrap_or_else(|| bulkhead_fetch::home_dir().join("weights")))
    }

    /// The settings of extra gateway `id` that `serve --role all` starts on `port` with its
    /// worker port at `worker_listen`: its own gateway settings; it exits when its standard
    /// input closes, so it never outlives `serve`.
    pub(crate) fn gateway_settings(&self, id: u8, port: u16, worker_listen: String, model: PathBuf, key: bool) -> ServeArgs {
        let mut g = self.child_settings(ServeRole::Gateway, model, key);
        (g.gateway_id, g.port, g.worker_listen, g.exit_with_stdin) = (id, port, worker_listen, true);
        // Pacing is the workers' business.
        (g.slo_tpot_ms, g.slo_ttft_ms, g.core_budget, g.decode_interval_ms) = (None, None, None, None);
        g
    }

    fn child_settings(&self, role: ServeRole, model: PathBuf, key: bool) -> ServeArgs {
        let mut c = self.clone();
        c.role = role;
        c.model.model = Some(model);
        // The key comes on standard input after the settings, never from a file or flag.
        (c.cluster_key_stdin, c.cluster_key_file) = (key, None);
        (c.gateways, c.gateway_id, c.health_listen) = (1, 0, None);
        if role != ServeRole::Gateway {
            (c.tenants, c.api_key, c.admin_key) = (None, None, None);
        }
        c
    }
}

/// What the gateway's start-up line says of the workers' prefix caches; `None` when they
/// keep none: `--no-prefix-cache`, or `--prefix-cache-pages 0` (which the workers log as off).
pub(crate) fn prefix_cache_described(no_prefix_cache: bool, pages: Option<usize>) -> Option<String> {
    match pages {
        _ if no_prefix_cache => None,
        Some(0) => None,
        Some(p) => Some(format!("on (up to {p} pages per worker)")),
        None => Some("on (up to each worker's pool)".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Serve {
        #[command(flatten)]
        a: ServeArgs,
    }

    fn check(args: &[&str]) -> Result<(), String> {
        let s = Serve::try_parse_from(std::iter::once("serve").chain(args.iter().copied())).map_err(|e| e.to_string())?;
        s.a.check_core_budget().map_err(|e| e.to_string())
    }

    #[test]
    fn a_draft_model_goes_with_draft_speculation_only() {
        let speculation = |args: &[&str]| {
            let s = Serve::try_parse_from(std::iter::once("serve").chain(args.iter().copied())).map_err(|e| e.to_string())?;
            s.a.check_speculation().map_err(|e| e.to_string())
        };
        assert!(speculation(&["--speculative", "draft"]).unwrap_err().contains("needs --draft-model"));
        assert!(speculation(&["--draft-model", "/d.gguf"]).unwrap_err().contains("this is --speculative ngram"));
        assert!(speculation(&["--speculative", "off", "--draft-model", "/d.gguf"]).unwrap_err().contains("this is --speculative off"));
        speculation(&["--speculative", "draft", "--draft-model", "/d.gguf"]).unwrap();
        speculation(&[]).unwrap();
        assert!(speculation(&["--weights-cache", "/w", "--no-weights-cache"]).unwrap_err().contains("--no-weights-cache"));
        speculation(&["--weights-cache", "/w"]).unwrap();
        assert!(speculation(&["--speculative-tokens", "0"]).is_err() && speculation(&["--speculative-tokens", "17"]).is_err());
        assert!(speculation(&["--speculative", "off", "--speculative-tokens", "8"]).unwrap_err().contains("--speculative is off"));
        speculation(&["--speculative-tokens", "8"]).unwrap();
    }

    #[test]
    fn zero_prefix_cache_pages_is_no_prefix_cache_at_the_gateway_too() {
        assert_eq!(prefix_cache_described(false, Some(0)), None);
        assert_eq!(prefix_cache_described(true, None), None);
        assert_eq!(prefix_cache_described(true, Some(8)), None);
        assert_eq!(prefix_cache_described(false, Some(8)).as_deref(), Some("on (up to 8 pages per worker)"));
        assert_eq!(prefix_cache_described(false, None).as_deref(), Some("on (up to each worker's pool)"));
    }

    #[test]
    fn the_web_ui_is_on_for_loopback_or_keys_unless_the_flag_says() {
        assert!(web_ui_on(None, "127.0.0.1", false));
        assert!(web_ui_on(None, "::1", false));
        assert!(web_ui_on(None, "localhost", false));
        assert!(!web_ui_on(None, "0.0.0.0", false));
        assert!(!web_ui_on(None, "10.1.2.3", false));
        assert!(web_ui_on(None, "0.0.0.0", true));
        assert!(!web_ui_on(Some(WebUi::Off), "127.0.0.1", true));
        assert!(web_ui_on(Some(WebUi::On), "0.0.0.0", false));
    }

    #[test]
    fn core_budget_flags_the_mode_would_ignore_are_refused_by_name() {
        assert_eq!(check(&[]), Ok(()));
        assert_eq!(check(&["--core-budget", "pause", "--decode-interval-ms", "30"]), Ok(()));
        assert_eq!(check(&["--role", "decode", "--core-budget-dir", "/tmp/x"]), Ok(()));
        assert_eq!(check(&["--slo-tpot-ms", "100", "--slo-ttft-ms", "2500"]), Ok(()));
        assert_eq!(check(&["--role", "decode", "--slo-tpot-ms", "100", "--core-budget-dir", "/tmp/x"]), Ok(()));
        assert_eq!(check(&["--slo-ttft-ms", "1200", "--core-budget", "slo"]), Ok(()));
        assert_eq!(check(&["--core-budget", "split"]), Ok(()));
        // By default decode is paced by the chat pair; the other modes carry no SLO.
        let a = |args: &[&str]| Serve::try_parse_from(std::iter::once("serve").chain(args.iter().copied())).expect("parses").a;
        let chat = Slo { tpot: Duration::from_millis(100), ttft: Duration::from_millis(2500) };
        assert_eq!((a(&[]).slo(), a(&[]).budget_mode()), (Some(chat), Some(ShareMode::Pause)));
        assert_eq!(a(&["--slo-ttft-ms", "1200"]).slo(), Some(Slo { ttft: Duration::from_millis(1200), ..chat }));
        assert_eq!((a(&["--core-budget", "split"]).slo(), a(&["--core-budget", "split"]).budget_mode()), (None, Some(ShareMode::Split)));
        assert_eq!((a(&["--core-budget", "pause"]).slo(), a(&["--core-budget", "off"]).budget_mode()), (None, None));
        for (args, names) in [
            (&["--decode-interval-ms", "30"][..], "--decode-interval-ms"),
            (&["--core-budget", "off", "--decode-interval-ms", "0"], "--decode-interval-ms"),
            (&["--core-budget-dir", "/tmp/x"], "--core-budget-dir"),
            (&["--role", "gateway", "--core-budget-dir", "/tmp/x"], "--core-budget-dir"),
            (&["--role", "prefill", "--core-budget", "off", "--core-budget-dir", "/tmp/x"], "--core-budget-dir"),
            (&["--slo-tpot-ms", "100", "--core-budget", "split"], "--core-budget split"),
            (&["--slo-ttft-ms", "2500", "--core-budget", "pause"], "--core-budget pause"),
            (&["--slo-tpot-ms", "100", "--core-budget", "off"], "--slo-tpot-ms"),
            (&["--slo-tpot-ms", "100", "--decode-interval-ms", "20"], "--decode-interval-ms"),
            (&["--role", "gateway", "--slo-tpot-ms", "100"], "gateway"),
            (&["--role", "gateway", "--slo-ttft-ms", "100"], "gateway"),
            (&["--slo-tpot-ms", "0"], "--slo-tpot-ms"),
            (&["--slo-tpot-ms=-5"], "--slo-tpot-ms"),
            (&["--slo-tpot-ms", "100", "--slo-ttft-ms", "99999999999"], "--slo-ttft-ms"),
        ] {
            let err = check(args).expect_err(&format!("{args:?} accepted"));
            assert!(err.contains(names), "{args:?}: {err}");
        }
    }

    /// A child of `serve --role all` gets every setting as data: what the parent was given
    /// (any flag, old or new) reaches it unchanged through JSON, and what makes it that
    /// child passes the checks its role runs.
    #[test]
    fn children_get_the_parents_settings_as_data_and_pass_their_roles_checks() {
        let s = Serve::try_parse_from([
            "serve",
            "--slo-tpot-ms",
            "100",
            "--slo-ttft-ms",
            "2500",
            "--default-temperature",
            "0.3",
            "--max-connections-per-source",
            "9",
            "--kv-pool-tokens",
            "4096",
            "--prefill-kv-pool-tokens",
            "2048",
            "--audit-kv",
            "--kernel-sums",
            "lanes",
            "--gateways",
            "2",
            "--tenants",
            "/t.toml",
            "--admin-key",
            "op",
        ])
        .expect("parses");
        let model = PathBuf::from("/m.gguf");
        let round_trip =
            |c: &ServeArgs| -> ServeArgs { serde_json::from_str(&serde_json::to_string(c).expect("to JSON")).expect("from JSON") };
        let p = round_trip(&s.a.worker_settings(ServeRole::Prefill, model.clone(), vec!["127.0.0.1:1".into()], Some("/b".into()), true));
        let d = round_trip(&s.a.worker_settings(ServeRole::Decode, model.clone(), vec!["127.0.0.1:1".into()], Some("/b".into()), true));
        let g = round_trip(&s.a.gateway_settings(1, 8081, "127.0.0.1:0".into(), model.clone(), true));
        for (c, role) in [(&p, ServeRole::Prefill), (&d, ServeRole::Decode), (&g, ServeRole::Gateway)] {
            assert_eq!(c.role, role);
            c.check_core_budget().unwrap_or_else(|e| panic!("{role:?}: {e}"));
            c.check_gateways().unwrap_or_else(|e| panic!("{role:?}: {e}"));
            assert_eq!((c.default_temperature, c.max_connections_per_source, c.checks.audit_kv), (0.3, Some(9), true));
            assert_eq!((c.model.model.as_deref(), c.model.kernel_sums.flag()), (Some(model.as_path()), "lanes"));
            assert!(c.cluster_key_stdin && c.cluster_key_file.is_none() && !c.settings_stdin);
        }
        assert_eq!((p.kv_pool_tokens, d.kv_pool_tokens), (Some(2048), Some(4096)));
        assert_eq!((p.slo_tpot_ms, d.slo_ttft_ms, d.core_budget_dir.as_deref()), (Some(100), Some(2500), Some(std::path::Path::new("/b"))));
        assert!(p.tenants.is_none() && p.admin_key.is_none(), "a worker never holds the tenants' keys");
        assert_eq!((g.gateway_id, g.port, g.exit_with_stdin, g.slo_tpot_ms), (1, 8081, true, None));
        assert_eq!((g.tenants.as_deref(), g.admin_key.as_deref()), (Some(std::path::Path::new("/t.toml")), Some("op")));
        // A child takes its settings whole: a flag beside them would be ignored, so it is
        // refused (alone it is what every served test's children run).
        assert!(Serve::try_parse_from(["serve", "--settings-stdin", "--port", "9"]).is_err());
    }
}
