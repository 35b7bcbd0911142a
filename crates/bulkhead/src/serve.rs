//! `bulkhead serve`: the gateway, prefill and decode roles. With no `--role`, all three on
//! this machine: the gateway in this process, each worker a child process of this binary
//! talking to it over loopback TCP. Children exit when their gateway connection closes, so
//! they never outlive this process.

use std::collections::VecDeque;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bulkhead_api::Tenants;
use bulkhead_kv::KvChecks;
use bulkhead_server::core_budget::{CoreBudget, ShareMode, Slo};
use bulkhead_server::gateway::{self, GatewayOptions};
use bulkhead_server::http::HttpLimits;
use bulkhead_server::kv_transport::KvTransport;
use bulkhead_server::trust::{self, Trust};
use bulkhead_server::worker::{WorkerConfig, WorkerError};
use clap::{Args, ValueEnum};

use crate::ModelArgs;

/// `--cluster-encryption`; see [`trust::Encryption`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum KvTransportArg {
    /// UCX where it loads, the cluster has a key and the peers share shared memory, CMA or RDMA; TCP otherwise.
    Auto,
    /// UCX on every KV connection (its TCP included), or the connection fails; needs UCX and a cluster key.
    Ucx,
    /// Bulkhead's TCP framing only.
    Tcp,
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CoreBudgetArg {
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
            CoreBudgetArg::Pause => Some(ShareMode::Pause),
            CoreBudgetArg::Off => None,
        }
    }
}

/// `--web-ui`: whether the gateway serves the chat page and the dashboard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum WebUi {
    /// Served.
    On,
    /// Not served: `/` and `/dashboard` are 404.
    Off,
}

/// Whether the gateway serves the web UI: as `--web-ui` says, else when it listens on
/// loopback only (a page only this machine reaches) or tenants need API keys (a page that
/// needs one).
fn web_ui_on(flag: Option<WebUi>, host: &str, keys_required: bool) -> bool {
    match flag {
        Some(w) => w == WebUi::On,
        None => keys_required || host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback()),
    }
}

/// Which part of the system this process runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
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

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// What to run.
    #[arg(long, env = "BULKHEAD_ROLE", value_enum, default_value_t = ServeRole::All)]
    role: ServeRole,
    /// HTTP address (gateway).
    #[arg(long, env = "BULKHEAD_HOST", default_value = "127.0.0.1")]
    host: String,
    /// HTTP port (gateway).
    #[arg(long, env = "BULKHEAD_PORT", default_value_t = 8080)]
    port: u16,
    /// Where workers register (gateway); port 0 picks one.
    #[arg(long, env = "BULKHEAD_WORKER_LISTEN", default_value = "127.0.0.1:0")]
    worker_listen: String,
    /// The gateways' worker addresses (prefill, decode): one, or several separated by
    /// commas, each a gateway of the same cluster (several need a cluster key). The worker
    /// registers with each, and dials a lost one again while the others keep it busy.
    #[arg(long, env = "BULKHEAD_GATEWAY", value_delimiter = ',')]
    gateway: Vec<String>,
    /// This gateway's number in a cluster of several (gateway): part of every request id
    /// it makes, so workers shared by several gateways tell their requests apart. Give
    /// each gateway of a cluster its own.
    #[arg(long, env = "BULKHEAD_GATEWAY_ID", default_value_t = 0)]
    gateway_id: u8,
    /// Gateways `serve --role all` runs on this host (1 to 8): this process and the rest as
    /// child processes on the next HTTP ports (any free ones with --port 0), each admitting,
    /// queueing and routing on its own over the same workers; a gateway that dies is
    /// restarted like a worker, and the others serve on meanwhile.
    #[arg(long, env = "BULKHEAD_GATEWAYS", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=8))]
    gateways: u8,
    /// Exit when standard input closes: `serve`'s own gateway children, so that they never
    /// outlive it.
    #[arg(long, hide = true, env = "BULKHEAD_EXIT_WITH_STDIN", value_parser = clap::builder::BoolishValueParser::new())]
    exit_with_stdin: bool,
    /// Where prefill workers reach this decode worker.
    #[arg(long, env = "BULKHEAD_KV_LISTEN", default_value = "127.0.0.1:0")]
    kv_listen: String,
    /// Address prefill workers are told to reach this decode worker at (default: the
    /// bound --kv-listen address; set it when listening on 0.0.0.0).
    #[arg(long, env = "BULKHEAD_KV_ADVERTISE")]
    kv_advertise: Option<String>,
    /// KV pool size in tokens (default: twice the context).
    #[arg(long, env = "BULKHEAD_KV_POOL_TOKENS", conflicts_with = "kv_memory")]
    kv_pool_tokens: Option<usize>,
    /// KV pool size as a memory budget, e.g. 512MiB or 2GiB.
    #[arg(long, env = "BULKHEAD_KV_MEMORY")]
    kv_memory: Option<String>,
    /// Context length to advertise (default: the model's).
    #[arg(long, env = "BULKHEAD_CONTEXT_LENGTH")]
    context_length: Option<usize>,
    /// Advertise what the KV pool holds instead of refusing to start when it is smaller than the context.
    #[arg(long, env = "BULKHEAD_CLAMP_CONTEXT", value_parser = clap::builder::BoolishValueParser::new())]
    clamp_context: bool,
    /// Pages per KV transfer batch (also the prefill chunk).
    #[arg(long, env = "BULKHEAD_TRANSFER_BATCH_PAGES", default_value_t = 32)]
    transfer_batch_pages: usize,
    /// Prompt tokens one prefill step computes in all, over as many queued prompts as fit (each at most one chunk of --transfer-batch-pages per step), so short prompts are not held behind a long one; at least one chunk.
    #[arg(long, env = "BULKHEAD_MAX_PREFILL_TOKENS", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    max_prefill_tokens: u32,
    /// How long a decode worker waits for a reservation's prefill worker to send anything (a chunk for any request, or a keepalive) before it fails the transfer (ms); a prefill worker sends keepalives every quarter of this, at most every second, so give both the same value. Queueing at a busy prefill is bounded by --request-timeout-ms.
    #[arg(long, env = "BULKHEAD_TRANSFER_TIMEOUT_MS", default_value_t = 60_000)]
    transfer_timeout_ms: u64,
    /// Decode workers: a request that finds part of its prompt in the decode worker's cache (a conversation's earlier turns) and at most this many prompt tokens missing has the rest computed on the decode worker, beside its decoding sequences, instead of by a prefill worker: no prefill queue, no transfer, and the previous answer, which only the decode worker holds, is not computed again. 0: every prompt goes through a prefill worker.
    #[arg(long, env = "BULKHEAD_MAX_LOCAL_PREFILL_TOKENS", default_value_t = 256)]
    max_local_prefill_tokens: usize,
    /// Which road KV frames take from prefill to decode workers, chosen per connection and logged with it (`bulkhead:kv_connections_total{transport}`); the frames, their MACs and the chunk checks are the same on both.
    #[arg(long, env = "BULKHEAD_KV_TRANSPORT", value_enum, default_value_t = KvTransportArg::Auto)]
    kv_transport: KvTransportArg,
    /// A request not finished after this long fails (ms).
    #[arg(long, env = "BULKHEAD_REQUEST_TIMEOUT_MS", default_value_t = 600_000)]
    request_timeout_ms: u64,
    /// Requests one tenant may have waiting at the gateway for KV capacity or workers; one more gets 429 with Retry-After.
    #[arg(long, env = "BULKHEAD_MAX_QUEUED_REQUESTS", default_value_t = 1024)]
    max_queued_requests: usize,
    /// How long a request may wait at the gateway for KV capacity or workers before it gets 429 (ms).
    #[arg(long, env = "BULKHEAD_QUEUE_TIMEOUT_MS", default_value_t = 120_000)]
    queue_timeout_ms: u64,
    /// How many times one request may move to another decode worker when the one it was on
    /// is lost, resuming from the tokens the client already has; past that its stream ends
    /// with an error event (0: never move).
    #[arg(long, env = "BULKHEAD_MIGRATION_LIMIT", default_value_t = 3)]
    migration_limit: u32,
    /// Prompt tokens the gateway gives one prefill worker at once (being reserved for,
    /// queued there or computed); later prompts wait in the gateway's queue, where tenants
    /// are served by recent use per weight, so one tenant's burst does not fill the prefill worker's own
    /// first-come queue ahead of another's. A prompt always goes to an idle worker. 0: no
    /// window.
    #[arg(long, env = "BULKHEAD_PREFILL_WINDOW_TOKENS", default_value_t = 512)]
    prefill_window_tokens: usize,
    /// The `temperature` of a request that sends none (0 to 2; 0: greedy). OpenAI's default is 1; a seed is drawn for every request without one, so a migrated stream resumes the same text.
    #[arg(long, env = "BULKHEAD_DEFAULT_TEMPERATURE", default_value_t = bulkhead_api::openai::OPENAI_TEMPERATURE, value_parser = temperature)]
    default_temperature: f32,
    /// Client connections served at once. At the cap a new connection takes the place of the oldest idle connection that never carried an authenticated request (of the source address holding the most); with none, it waits in the listen backlog until one closes.
    #[arg(long, env = "BULKHEAD_MAX_CONNECTIONS", default_value_t = 4096)]
    max_connections: usize,
    /// Client connections one source address may hold at once (default: a quarter of --max-connections); one more takes the place of that address's oldest idle connection that never authenticated, or is closed.
    #[arg(long, env = "BULKHEAD_MAX_CONNECTIONS_PER_SOURCE")]
    max_connections_per_source: Option<usize>,
    /// How long a new client connection may take to send its first request's headers; then it is closed (ms).
    #[arg(long, env = "BULKHEAD_HTTP_FIRST_HEADER_TIMEOUT_MS", default_value_t = 5_000)]
    http_first_header_timeout_ms: u64,
    /// How long a client connection may take to send a later request's headers, counted from the end of its previous response (the keep-alive idle timeout); then it is closed (ms).
    #[arg(long, env = "BULKHEAD_HTTP_HEADER_TIMEOUT_MS", default_value_t = 30_000)]
    http_header_timeout_ms: u64,
    /// How long a client connection that never carried an authenticated request (a tenant's key, or any /v1/ request where no keys are configured) may stay open; then its request in flight finishes and it is closed (ms).
    #[arg(long, env = "BULKHEAD_HTTP_STRANGER_TIMEOUT_MS", default_value_t = 15_000)]
    http_stranger_timeout_ms: u64,
    /// How long a request body may take to arrive; then 408 (ms).
    #[arg(long, env = "BULKHEAD_HTTP_BODY_TIMEOUT_MS", default_value_t = 30_000)]
    http_body_timeout_ms: u64,
    /// How long shutdown waits for in-flight requests (s).
    #[arg(long, env = "BULKHEAD_DRAIN_TIMEOUT_S", default_value_t = 30)]
    drain_timeout_s: u64,
    /// Prefill workers to start (role all).
    #[arg(long, env = "BULKHEAD_PREFILL_WORKERS", default_value_t = 1)]
    prefill_workers: usize,
    /// Decode workers to start (role all).
    #[arg(long, env = "BULKHEAD_DECODE_WORKERS", default_value_t = 1)]
    decode_workers: usize,
    /// KV pool size in tokens for prefill workers only (role all; default: --kv-pool-tokens).
    #[arg(long, env = "BULKHEAD_PREFILL_KV_POOL_TOKENS")]
    prefill_kv_pool_tokens: Option<usize>,
    /// How the prefill and decode workers on one host share its cores while both have
    /// work, so that their compute threads stop pre-empting each other. Role all sets the
    /// budget up itself; workers started by hand on one host need --core-budget-dir as well.
    /// Default split (pause paced by the SLO with --slo-tpot-ms).
    #[arg(long, env = "BULKHEAD_CORE_BUDGET", value_enum)]
    core_budget: Option<CoreBudgetArg>,
    /// With --core-budget pause only (refused with the other modes): while prompts wait, a
    /// decode step starts at most once per this many ms and prefill gets the rest
    /// (inter-token latency is then about this). Default 15.
    #[arg(long, env = "BULKHEAD_DECODE_INTERVAL_MS")]
    decode_interval_ms: Option<u64>,
    /// Per-token latency target (ms): the core budget pauses prefill during decode steps,
    /// and while a prompt is late decode steps start at most once per three quarters of
    /// this (half that while prompts wait in time), prefill taking the rest of the cores.
    /// Takes the place of --core-budget and --decode-interval-ms (combining them is refused).
    #[arg(long, env = "BULKHEAD_SLO_TPOT_MS", value_parser = clap::value_parser!(u64).range(4..=60_000))]
    slo_tpot_ms: Option<u64>,
    /// Time-to-first-token target (ms), with --slo-tpot-ms only: prompts are late once the
    /// prefill worker has been busy for half of this without a pause. Without it every
    /// waiting prompt is late.
    #[arg(long, env = "BULKHEAD_SLO_TTFT_MS", value_parser = clap::value_parser!(u64).range(10..=600_000))]
    slo_ttft_ms: Option<u64>,
    /// Prefill and decode workers started by hand on one host: a directory only this user
    /// can enter, the same for all of them, where they meet for the core budget.
    #[arg(long, env = "BULKHEAD_CORE_BUDGET_DIR")]
    core_budget_dir: Option<PathBuf>,
    /// Prefill and decode workers: answer HTTP probes at this address, `GET /health`
    /// (liveness: 200 while loading and while the worker's main loop turned in the last 60
    /// s) and `GET /ready` (200 while registered with the gateway and not stalled). For
    /// Kubernetes httpGet probes; it shows nothing but the state.
    #[arg(long, env = "BULKHEAD_HEALTH_LISTEN")]
    health_listen: Option<String>,
    /// Name of the model in the API; give it more than once (or comma-separated) for
    /// aliases, the first being the main one. Default: the model file's name without
    /// `.gguf` (`SmolLM2-135M-Instruct.Q4_1`), as `GET /v1/models` shows.
    #[arg(long, env = "BULKHEAD_MODEL_ID", value_delimiter = ',')]
    model_id: Vec<String>,
    #[command(flatten)]
    checks: KvCheckArgs,
    /// The cluster key (64 hex digits) every process of the cluster must hold; the file must
    /// not be readable by others. Make one with `bulkhead keygen FILE`. Role all makes a
    /// random key per run when none is given.
    #[arg(long, env = "BULKHEAD_CLUSTER_KEY_FILE")]
    cluster_key_file: Option<PathBuf>,
    /// Let internal listeners (the gateway's worker port, a decode worker's KV port) face
    /// the network without a cluster key: anyone who reaches them can join the cluster.
    /// For benchmarks on a closed network only; logged loudly.
    #[arg(long, env = "BULKHEAD_INSECURE_CLUSTER", value_parser = clap::builder::BoolishValueParser::new())]
    insecure_cluster: bool,
    /// When this process asks for its internal frames (prompts, tokens, KV) to be encrypted
    /// with AES-256-GCM under the session key, as well as authenticated: auto (with a peer
    /// on another host; not over loopback), on (always; needs a cluster key), off (never
    /// asked by this side). A connection is encrypted if either side asks.
    #[arg(long, env = "BULKHEAD_CLUSTER_ENCRYPTION", value_enum, default_value_t = ClusterEncryption::Auto)]
    cluster_encryption: ClusterEncryption,
    /// Internal: read the cluster key from the first line of stdin (how `serve` hands it to
    /// the workers it starts, so it is never on a command line or in the environment).
    #[arg(long, hide = true, env = "BULKHEAD_CLUSTER_KEY_STDIN", value_parser = clap::builder::BoolishValueParser::new())]
    cluster_key_stdin: bool,
    /// Tenants and their API keys (gateway): a TOML file with one `[[tenant]]` table per
    /// tenant (`name`, `api_keys` and/or `api_key_sha256`). Every /v1/ request must then
    /// carry one of the keys as `Authorization: Bearer <key>`; the key picks the tenant,
    /// whose prefix cache and queue are its own.
    #[arg(long, env = "BULKHEAD_TENANTS", conflicts_with = "api_key")]
    tenants: Option<PathBuf>,
    /// One API key every /v1/ request must carry (one tenant, `default`); vLLM's flag.
    #[arg(long, env = "BULKHEAD_API_KEY")]
    api_key: Option<String>,
    /// The operator's key (gateway): with it, `/metrics/tenants` serves per-tenant series
    /// (latencies, outcomes, tokens, refusals, waiting requests, labelled with tenant names)
    /// to a bearer of this key only; without it, that page is not served. `/metrics` keeps
    /// cluster-wide series only.
    #[arg(long, env = "BULKHEAD_ADMIN_KEY")]
    admin_key: Option<String>,
    /// The chat page at `/` and the live isolation dashboard at `/dashboard` (gateway): on or
    /// off. Default: on when --host is a loopback address or API keys are required (--tenants,
    /// --api-key), off otherwise.
    #[arg(long, env = "BULKHEAD_WEB_UI", value_enum)]
    web_ui: Option<WebUi>,
    /// Do not share KV pages between requests: no prefix cache on the prefill workers, and
    /// none on the decode workers (every turn's whole prompt is then sent).
    #[arg(long, env = "BULKHEAD_NO_PREFIX_CACHE", value_parser = clap::builder::BoolishValueParser::new())]
    no_prefix_cache: bool,
    /// Most KV pages of a worker's pool its prefix cache keeps, on prefill and decode workers
    /// alike (default: the whole pool; cached pages nobody reads are evicted whenever a
    /// prompt or a growing sequence needs room).
    #[arg(long, env = "BULKHEAD_PREFIX_CACHE_PAGES")]
    prefix_cache_pages: Option<usize>,
    /// Test only: switch the gateway's context check off to show the workers' own holds.
    #[arg(long, hide = true, env = "BULKHEAD_NO_GATEWAY_ADMISSION", value_parser = clap::builder::BoolishValueParser::new())]
    no_gateway_admission: bool,
}

/// The optional KV integrity checks (design I6). Canaries and checksums are on unless
/// switched off, which exists to measure their cost; the auditor is off unless asked for.
#[derive(Args, Debug, Clone)]
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

    /// The same flags for a child process.
    fn child_args(&self) -> Vec<&'static str> {
        [(self.audit_kv, "--audit-kv"), (self.no_kv_canaries, "--no-kv-canaries"), (self.no_kv_checksums, "--no-kv-checksums")]
            .into_iter()
            .filter_map(|(on, flag)| on.then_some(flag))
            .collect()
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
    fn pool_tokens(&self, bytes_per_token: usize, context: usize) -> anyhow::Result<usize> {
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
    fn trust(&self) -> anyhow::Result<Trust> {
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

    fn worker(&self, model: PathBuf, gateways: Vec<String>, trust: Trust) -> anyhow::Result<WorkerConfig> {
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

impl ServeArgs {
    /// The SLO that paces decode, if any.
    fn slo(&self) -> Option<Slo> {
        self.slo_tpot_ms.map(|tpot| Slo { tpot: Duration::from_millis(tpot), ttft: self.slo_ttft_ms.map(Duration::from_millis) })
    }

    /// How the workers share the cores, or `None` for no budget.
    fn budget_mode(&self) -> Option<ShareMode> {
        match (self.slo_tpot_ms, self.core_budget) {
            (Some(_), _) => Some(ShareMode::Pause),
            (None, b) => b.unwrap_or(CoreBudgetArg::Split).mode(),
        }
    }

    /// Refuse core budget flags this configuration would otherwise ignore.
    fn check_core_budget(&self) -> anyhow::Result<()> {
        if self.slo_ttft_ms.is_some() && self.slo_tpot_ms.is_none() {
            anyhow::bail!("--slo-ttft-ms says when decode steps slow to the per-token target's pace; it needs --slo-tpot-ms");
        }
        if self.slo_tpot_ms.is_some() {
            if self.core_budget.is_some() || self.decode_interval_ms.is_some() {
                anyhow::bail!(
                    "--slo-tpot-ms sets how decode and prefill share the cores; it takes the place of --core-budget and --decode-interval-ms, drop them"
                );
            }
            if self.role == ServeRole::Gateway {
                anyhow::bail!("--slo-tpot-ms paces the workers' compute; a gateway computes nothing (give it to the workers)");
            }
        }
        let core_budget = self.core_budget.unwrap_or(CoreBudgetArg::Split);
        let mode = core_budget.to_possible_value().map(|v| v.get_name().to_string()).unwrap_or_default();
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

    /// Refuse gateway flags the role would otherwise ignore.
    fn check_gateways(&self) -> anyhow::Result<()> {
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

/// The exit status of a `serve` process that cannot start for a reason a restart does not
/// change (sysexits' `EX_CONFIG`): its settings, its files, the capacity check.
pub const EXIT_CANNOT_START: i32 = 78;

/// Why a process cannot start, when a restart would fail the same way: `main` exits with
/// [`EXIT_CANNOT_START`], and the `serve` that started it gives up at once naming it.
#[derive(Debug)]
pub struct CannotStart(anyhow::Error);

impl std::fmt::Display for CannotStart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#}", self.0)
    }
}

impl std::error::Error for CannotStart {}

fn cannot_start(e: impl Into<anyhow::Error>) -> anyhow::Error {
    anyhow::Error::new(CannotStart(e.into()))
}

/// The checks of `a` that need no model loaded, and the model's path and the cluster key.
fn settle(a: &ServeArgs) -> anyhow::Result<(PathBuf, Trust)> {
    a.check_core_budget()?;
    a.check_gateways()?;
    let model = a.model.path()?;
    let trust = a.trust()?;
    if a.role != ServeRole::Gateway {
        KvTransport::from(a.kv_transport).check(&trust).map_err(anyhow::Error::msg)?;
    }
    if a.health_listen.is_some() && !matches!(a.role, ServeRole::Prefill | ServeRole::Decode) {
        anyhow::bail!(
            "--health-listen is for prefill and decode workers (--role prefill or decode); the gateway answers /health and /ready on its HTTP port"
        );
    }
    Ok((model, trust))
}

pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    let (model, trust) = settle(&a).map_err(cannot_start)?;
    if a.exit_with_stdin {
        // After the key (if any) was read from it: `serve` holds the other end.
        std::thread::spawn(|| {
            let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
            tracing::warn!("standard input closed: the serve that started this gateway is gone; exiting");
            std::process::exit(0);
        });
    }
    match a.role {
        ServeRole::Prefill | ServeRole::Decode => {
            if a.gateway.is_empty() {
                return Err(cannot_start(anyhow::anyhow!("--gateway HOST:PORT is required for a worker role")));
            }
            let gw = a.gateway.clone();
            // Bound before the model loads, so probes see a worker that is starting.
            let health = match &a.health_listen {
                Some(addr) => {
                    let l = std::net::TcpListener::bind(addr)
                        .with_context(|| format!("cannot listen for health probes on {addr} (--health-listen)"))?;
                    tracing::info!(addr = %l.local_addr()?, "health probes: GET /health, GET /ready");
                    let h = bulkhead_server::health::Health::new();
                    bulkhead_server::health::spawn(l, h.clone());
                    Some(h)
                }
                None => None,
            };
            let mut cfg = a.worker(model, gw, trust).map_err(cannot_start)?;
            cfg.health = health;
            let ran = if a.role == ServeRole::Prefill {
                bulkhead_server::prefill_worker::run(cfg)
            } else {
                bulkhead_server::decode_worker::run(cfg)
            };
            ran.map_err(|e| if matches!(e, WorkerError::CannotStart(_)) { cannot_start(e) } else { e.into() })
        }
        ServeRole::Gateway | ServeRole::All => {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
            rt.block_on(serve_gateway(a, model, trust))
        }
    }
}

/// What the gateway's start-up line says of the workers' prefix caches; `None` when they
/// keep none: `--no-prefix-cache`, or `--prefix-cache-pages 0` (which the workers log as off).
fn prefix_cache_described(no_prefix_cache: bool, pages: Option<usize>) -> Option<String> {
    match pages {
        _ if no_prefix_cache => None,
        Some(0) => None,
        Some(p) => Some(format!("on (up to {p} pages per worker)")),
        None => Some("on (up to each worker's pool)".into()),
    }
}

async fn serve_gateway(a: ServeArgs, model: PathBuf, trust: Trust) -> anyhow::Result<()> {
    let secret = trust.key.as_ref().map(|k| k.to_hex());
    let tenants = match (&a.tenants, &a.api_key) {
        (Some(path), _) => Tenants::load(path)?,
        (None, Some(key)) => Tenants::single_key(key)?,
        (None, None) => Tenants::open(),
    };
    let access =
        if tenants.authenticates() { format!("{} tenant(s), API keys required", tenants.len()) } else { "open (no API key)".into() };
    let cache = prefix_cache_described(a.no_prefix_cache, a.prefix_cache_pages);
    let opts = GatewayOptions {
        chat_template: a.model.chat_template.clone(),
        http_addr: format!("{}:{}", a.host, a.port),
        workers: a.worker_listen.clone(),
        model: model.clone(),
        model_ids: a.model_id.clone(),
        admission_check: !a.no_gateway_admission,
        request_timeout_ms: a.request_timeout_ms,
        max_queued: a.max_queued_requests,
        queue_timeout_ms: a.queue_timeout_ms,
        migration_limit: a.migration_limit,
        prefill_window_tokens: a.prefill_window_tokens,
        http: HttpLimits {
            max_connections: a.max_connections,
            max_per_source: max_per_source(&a),
            first_header_timeout: Duration::from_millis(a.http_first_header_timeout_ms.max(1)),
            header_timeout: Duration::from_millis(a.http_header_timeout_ms.max(1)),
            stranger_lifetime: Duration::from_millis(a.http_stranger_timeout_ms.max(1)),
        },
        body_timeout: Duration::from_millis(a.http_body_timeout_ms.max(1)),
        trust,
        web_ui: web_ui_on(a.web_ui, &a.host, tenants.authenticates()),
        admin_key_sha256: match a.admin_key.as_deref() {
            Some("") => anyhow::bail!("--admin-key is empty"),
            Some(k) => Some(bulkhead_api::tenants::key_digest(k)),
            None => None,
        },
        tenants: Arc::new(tenants),
        prefix_cache: cache.is_some(),
        gateway_id: bulkhead_protocol::GatewayId(a.gateway_id),
        defaults: bulkhead_api::openai::Defaults { temperature: a.default_temperature },
    };
    let mut gw = gateway::start(opts).await.with_context(|| format!("cannot start the gateway on {}:{}", a.host, a.port))?;
    // Declared before the workers, so it is removed after they are stopped.
    let budget = if a.role == ServeRole::All && a.budget_mode().is_some() { Some(BudgetDir::new()?) } else { None };
    let mut workers = Supervisor { slots: Vec::new(), secret };
    let mut banner = format!("bulkhead: serving on http://{} (workers register at {})", gw.http_addr, gw.worker_addr);
    if a.role == ServeRole::All {
        let exe = std::env::current_exe()?;
        let mut gw_addrs = vec![gw.worker_addr.to_string()];
        for i in 1..a.gateways {
            let (http, at) = workers.start_gateway(&a, &exe, &model, i).with_context(|| format!("cannot start gateway {i}"))?;
            banner.push_str(&format!(", gateway {i} on http://{http} (workers register at {at})"));
            gw_addrs.push(at);
        }
        let gw_addr = gw_addrs.join(",");
        for (role, n) in [("prefill", a.prefill_workers), ("decode", a.decode_workers)] {
            for _ in 0..n {
                let mut cmd = Command::new(&exe);
                cmd.args(["serve", "--role", role, "--gateway", &gw_addr, "--model"]).arg(&model);
                cmd.args(["--threads", &a.model.threads.to_string(), "--page-size", &a.model.page_size.to_string()]);
                cmd.args(["--kernel-sums", a.model.kernel_sums.flag()]);
                cmd.args(["--transfer-batch-pages", &a.transfer_batch_pages.to_string()]);
                cmd.args(["--max-prefill-tokens", &a.max_prefill_tokens.to_string()]);
                cmd.args(["--transfer-timeout-ms", &a.transfer_timeout_ms.to_string()]);
                cmd.args(["--max-local-prefill-tokens", &a.max_local_prefill_tokens.to_string()]);
                let pool = if role == "prefill" { a.prefill_kv_pool_tokens.or(a.kv_pool_tokens) } else { a.kv_pool_tokens };
                if let Some(t) = pool {
                    cmd.args(["--kv-pool-tokens", &t.to_string()]);
                } else if let Some(m) = &a.kv_memory {
                    cmd.args(["--kv-memory", m]);
                }
                if let Some(c) = a.context_length {
                    cmd.args(["--context-length", &c.to_string()]);
                }
                if a.clamp_context {
                    cmd.arg("--clamp-context");
                }
                cmd.args(a.checks.child_args());
                if a.no_prefix_cache {
                    cmd.arg("--no-prefix-cache");
                } else if let Some(p) = a.prefix_cache_pages {
                    cmd.args(["--prefix-cache-pages", &p.to_string()]);
                }
                if workers.secret.is_some() {
                    cmd.arg("--cluster-key-stdin");
                }
                if let Some(e) = a.cluster_encryption.to_possible_value() {
                    cmd.args(["--cluster-encryption", e.get_name()]);
                }
                if let Some(t) = a.kv_transport.to_possible_value() {
                    cmd.args(["--kv-transport", t.get_name()]);
                }
                if let Some(b) = a.core_budget.and_then(|b| b.to_possible_value()) {
                    cmd.args(["--core-budget", b.get_name()]);
                }
                for (flag, ms) in
                    [("--decode-interval-ms", a.decode_interval_ms), ("--slo-tpot-ms", a.slo_tpot_ms), ("--slo-ttft-ms", a.slo_ttft_ms)]
                {
                    if let Some(ms) = ms {
                        cmd.args([flag, &ms.to_string()]);
                    }
                }
                if let Some(b) = &budget {
                    cmd.arg("--core-budget-dir").arg(&b.0);
                }
                // Workers must not bind the gateway's HTTP port or inherit its role.
                cmd.env_remove("BULKHEAD_ROLE")
                    .env_remove("BULKHEAD_PORT")
                    .env_remove("BULKHEAD_CONFIG")
                    .env_remove("BULKHEAD_HEALTH_LISTEN")
                    .env_remove("BULKHEAD_API_KEY")
                    .env_remove("BULKHEAD_TENANTS");
                workers.add(role, cmd).with_context(|| format!("cannot start a {role} worker"))?;
            }
        }
    }
    tracing::info!(%access, prefix_cache = %cache.as_deref().unwrap_or("off"), "serving");
    println!("{banner}");
    let outcome = tokio::select! {
        () = shutdown_signal() => Ok(()),
        e = workers.supervise() => Err(e),
    };
    if outcome.is_err() {
        // Nothing here can bring the workers back: say so to probes, and keep saying it for
        // a while before exiting, so that a supervisor polling /health sees the 503.
        gw.mark_failed();
        tracing::error!(seconds = FAILED_HEALTH_LINGER.as_secs(), "answering /health with 503 before exiting");
        tokio::select! {
            () = shutdown_signal() => {}
            () = tokio::time::sleep(FAILED_HEALTH_LINGER) => {}
        }
    }
    tracing::info!("shutting down: draining in-flight requests");
    gw.shutdown();
    if tokio::time::timeout(Duration::from_secs(a.drain_timeout_s), &mut gw.server).await.is_err() {
        tracing::warn!(drain_timeout_s = a.drain_timeout_s, "drain timed out; exiting with requests in flight");
    }
    outcome
}

/// How long `serve` keeps answering `/health` with 503 after a worker crash-looped, before it
/// exits non-zero (a signal cuts it short).
const FAILED_HEALTH_LINGER: Duration = Duration::from_secs(5);

/// Wait for SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

/// Exits of one worker within [`CRASH_LOOP_WINDOW`] that end the server: restarting it
/// again would only hide the fault from an outer supervisor (Kubernetes, systemd).
const CRASH_LOOP_EXITS: usize = 5;
const CRASH_LOOP_WINDOW: Duration = Duration::from_secs(60);
/// Restart delay after the first exit; doubles with each recent exit, up to the maximum.
const RESTART_BACKOFF: Duration = Duration::from_millis(100);
const RESTART_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How often children are checked for exits (which also reaps them).
const SUPERVISE_EVERY: Duration = Duration::from_millis(100);

/// One worker process of `serve --role all` and its restarts.
struct Slot {
    /// What it is, in logs: `prefill`, `decode`, `gateway-1`, ….
    role: String,
    cmd: Command,
    child: Option<Child>,
    /// Its standard input, held open while it runs: a gateway child exits when it closes.
    stdin: Option<ChildStdin>,
    /// Forwards its standard error to ours; ends with its last `error:` line.
    errors: Option<Errors>,
    /// Recent exits, oldest first, within the crash-loop window.
    exits: VecDeque<Instant>,
    restart_at: Option<Instant>,
}

/// The worker processes: each restarted with backoff when it exits (it registers again
/// under a new id; the pages its old incarnation held are fenced by the protocol), reaped
/// as it exits, and killed when this is dropped.
struct Supervisor {
    slots: Vec<Slot>,
    /// The cluster key in hex, written to each worker's stdin as it starts.
    secret: Option<String>,
}

impl Supervisor {
    fn add(&mut self, role: &'static str, mut cmd: Command) -> std::io::Result<()> {
        let (child, stdin, errors) = spawn(&mut cmd, self.secret.as_deref())?;
        self.slots.push(Slot { role: role.to_string(), cmd, child: Some(child), stdin, errors, exits: VecDeque::new(), restart_at: None });
        Ok(())
    }

    /// Start gateway `i` beside this process's own: the same gateway settings under its
    /// own id, on the next HTTP port (or any free one with `--port 0`) and any free worker
    /// port, both kept when it is restarted. Returns its HTTP and worker addresses, read
    /// from the line it prints.
    fn start_gateway(&mut self, a: &ServeArgs, exe: &Path, model: &Path, i: u8) -> anyhow::Result<(String, String)> {
        let port = if a.port == 0 { 0 } else { a.port.checked_add(u16::from(i)).context("no HTTP port left above --port")? };
        let host = a.worker_listen.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h);
        let mut cmd = gateway_command(a, exe, model, i, port, &format!("{host}:0"));
        cmd.stdout(Stdio::piped());
        let (mut child, stdin, errors) = spawn(&mut cmd, self.secret.as_deref())?;
        let out = child.stdout.take().context("no stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            // Its first line names its addresses; the rest is drained so it never blocks.
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let line = match rx.recv_timeout(GATEWAY_START_TIMEOUT) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                anyhow::bail!("it printed no address within {} s (its log says why)", GATEWAY_START_TIMEOUT.as_secs());
            }
        };
        let http = line.split("http://").nth(1).and_then(|r| r.split_whitespace().next()).map(str::to_string);
        let at = line.split("register at ").nth(1).and_then(|r| r.split(')').next()).map(str::to_string);
        let (Some(http), Some(at)) = (http, at) else {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!("unexpected first line {line:?}");
        };
        let http_port = http.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).unwrap_or(port);
        let mut restart = gateway_command(a, exe, model, i, http_port, &at);
        restart.stdout(Stdio::null());
        tracing::info!(gateway = i, %http, workers = %at, pid = child.id(), "gateway started");
        let role = format!("gateway-{i}");
        self.slots.push(Slot { role, cmd: restart, child: Some(child), stdin, errors, exits: VecDeque::new(), restart_at: None });
        Ok((http, at))
    }

    /// Restart workers as they exit; returns only when one crash-loops.
    async fn supervise(&mut self) -> anyhow::Error {
        loop {
            tokio::time::sleep(SUPERVISE_EVERY).await;
            if let Err(e) = self.poll(Instant::now()) {
                tracing::error!(error = %e, "worker crash loop");
                return e;
            }
        }
    }

    fn poll(&mut self, now: Instant) -> anyhow::Result<()> {
        for slot in &mut self.slots {
            let exited = match slot.child.as_mut().map(Child::try_wait) {
                Some(Ok(Some(status))) => Some((status.to_string(), status.code())),
                Some(Err(e)) => Some((format!("cannot wait for it: {e}"), None)),
                Some(Ok(None)) | None => None,
            };
            if let Some((status, code)) = exited {
                slot.child = None;
                let cause = slot.errors.take().and_then(Errors::last);
                let how = cause.as_ref().map_or_else(|| status.clone(), |c| format!("{status}: {c}"));
                // Its own word that a restart fails the same way, or a command line that
                // does not parse (clap's 2): give up now, naming why.
                if matches!(code, Some(EXIT_CANNOT_START | 2)) {
                    anyhow::bail!("the {} worker cannot start ({how}); a restart would fail the same way, so serve stops", slot.role);
                }
                slot.exited(now, &how)?;
            }
            if slot.child.is_none() && slot.restart_at.is_some_and(|t| t <= now) {
                slot.restart_at = None;
                match spawn(&mut slot.cmd, self.secret.as_deref()) {
                    Ok((c, stdin, errors)) => {
                        tracing::info!(role = %slot.role, pid = c.id(), "{} restarted", slot.role);
                        slot.child = Some(c);
                        slot.stdin = stdin;
                        slot.errors = errors;
                    }
                    // A worker that cannot even be started crash-loops too.
                    Err(e) => slot.exited(now, &format!("cannot start it: {e}"))?,
                }
            }
        }
        Ok(())
    }
}

impl Slot {
    /// Its process is gone: schedule a restart, or give up if it keeps exiting.
    fn exited(&mut self, now: Instant, how: &str) -> anyhow::Result<()> {
        self.exits.push_back(now);
        while self.exits.front().is_some_and(|t| now.duration_since(*t) > CRASH_LOOP_WINDOW) {
            self.exits.pop_front();
        }
        let n = self.exits.len();
        anyhow::ensure!(
            n < CRASH_LOOP_EXITS,
            "the {} worker exited {n} times within {} s (last: {how}); giving up so that an outer supervisor can take over",
            self.role,
            CRASH_LOOP_WINDOW.as_secs()
        );
        let backoff = RESTART_BACKOFF.saturating_mul(1 << (n - 1)).min(RESTART_BACKOFF_MAX);
        tracing::warn!(role = self.role, status = how, backoff_ms = backoff.as_millis() as u64, "worker exited; restarting it");
        self.restart_at = Some(now + backoff);
        Ok(())
    }
}

/// The core budget's directory for the workers of `serve --role all`: made private to this
/// user, removed when dropped.
struct BudgetDir(PathBuf);

/// Name prefix of the core budget's directories in the temporary directory.
const BUDGET_DIR_PREFIX: &str = "bulkhead-cores-";

impl BudgetDir {
    fn new() -> anyhow::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let tmp = std::env::temp_dir();
        sweep_budget_dirs(&tmp);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let dir = tmp.join(format!("{BUDGET_DIR_PREFIX}{}-{nanos:x}", std::process::id()));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("cannot make the core budget's directory {}", dir.display()))?;
        Ok(BudgetDir(dir))
    }
}

/// Remove this user's core budget directories in `tmp` whose `serve` process is gone: one
/// killed (SIGKILL) never dropped its [`BudgetDir`]. A directory whose process id is alive,
/// or whose liveness cannot be told (no `/proc`), is kept. (A `/tmp` shared by the same
/// user between pid namespaces defeats the liveness test: a `serve` in another namespace
/// would lose its budget's sockets. Give each its own `TMPDIR` there.)
fn sweep_budget_dirs(tmp: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(me) = std::fs::metadata("/proc/self").map(|m| m.uid()) else { return };
    let Ok(entries) = std::fs::read_dir(tmp) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(BUDGET_DIR_PREFIX))
            .and_then(|r| r.split_once('-'))
            .and_then(|(p, _)| p.parse::<u32>().ok())
        else {
            continue;
        };
        let mine = e.metadata().is_ok_and(|m| m.uid() == me);
        if mine && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

impl Drop for BudgetDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A child's standard error, copied line by line to ours by a thread that keeps the last
/// line the child's `main` printed for the error it exits with.
struct Errors(std::thread::JoinHandle<Option<String>>);

impl Errors {
    fn forward(from: std::process::ChildStderr) -> Errors {
        Errors(std::thread::spawn(move || {
            use std::io::BufRead;
            let mut last = None;
            for line in std::io::BufReader::new(from).lines().map_while(Result::ok) {
                eprintln!("{line}");
                if let Some(e) = line.strip_prefix("error: ") {
                    last = Some(e.to_string());
                }
            }
            last
        }))
    }

    /// The child's last error line, once its standard error closed (it exited).
    fn last(self) -> Option<String> {
        self.0.join().ok().flatten()
    }
}

/// Start a worker, handing it the cluster key (if any) on its stdin.
fn spawn(cmd: &mut Command, secret: Option<&str>) -> std::io::Result<(Child, Option<ChildStdin>, Option<Errors>)> {
    cmd.stderr(Stdio::piped());
    if secret.is_some() {
        cmd.stdin(Stdio::piped());
    }
    let mut child = cmd.spawn()?;
    let errors = child.stderr.take().map(Errors::forward);
    let Some(secret) = secret else { return Ok((child, None, errors)) };
    let sent = child.stdin.take().ok_or_else(|| std::io::Error::other("no stdin")).and_then(|mut i| writeln!(i, "{secret}").map(|()| i));
    match sent {
        Ok(stdin) => Ok((child, Some(stdin), errors)),
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(e)
        }
    }
}

/// A `--default-temperature`: a number from 0 to 2, as the API accepts in a request.
fn temperature(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(t) if (0.0..=2.0).contains(&t) => Ok(t),
        _ => Err(format!("{s:?} is not a temperature from 0 to 2")),
    }
}

/// `--max-connections-per-source`, or its default: a quarter of `--max-connections`.
fn max_per_source(a: &ServeArgs) -> usize {
    a.max_connections_per_source.unwrap_or(a.max_connections / 4).max(1)
}

/// How long a gateway child may take to print its addresses.
const GATEWAY_START_TIMEOUT: Duration = Duration::from_secs(60);

/// The command line of gateway `i` beside `serve`'s own: the gateway settings of `a`, its
/// id and ports; it reads the cluster key from its standard input and exits when that
/// closes (it never outlives `serve`).
fn gateway_command(a: &ServeArgs, exe: &Path, model: &Path, i: u8, port: u16, worker_listen: &str) -> Command {
    let mut cmd = Command::new(exe);
    cmd.args(["serve", "--role", "gateway", "--cluster-key-stdin", "--exit-with-stdin", "--gateway-id", &i.to_string()]);
    cmd.args(["--host", &a.host, "--port", &port.to_string(), "--worker-listen", worker_listen, "--model"]).arg(model);
    let numbers = [
        ("--request-timeout-ms", a.request_timeout_ms),
        ("--max-queued-requests", a.max_queued_requests as u64),
        ("--queue-timeout-ms", a.queue_timeout_ms),
        ("--migration-limit", a.migration_limit.into()),
        ("--prefill-window-tokens", a.prefill_window_tokens as u64),
        ("--max-connections", a.max_connections as u64),
        ("--max-connections-per-source", max_per_source(a) as u64),
        ("--http-first-header-timeout-ms", a.http_first_header_timeout_ms),
        ("--http-header-timeout-ms", a.http_header_timeout_ms),
        ("--http-stranger-timeout-ms", a.http_stranger_timeout_ms),
        ("--http-body-timeout-ms", a.http_body_timeout_ms),
        ("--drain-timeout-s", a.drain_timeout_s),
    ];
    for (flag, v) in numbers {
        cmd.args([flag, &v.to_string()]);
    }
    cmd.args(["--default-temperature", &a.default_temperature.to_string()]);
    if let Some(t) = &a.model.chat_template {
        cmd.arg("--chat-template").arg(t);
    }
    if !a.model_id.is_empty() {
        cmd.args(["--model-id", &a.model_id.join(",")]);
    }
    if let Some(t) = &a.tenants {
        cmd.arg("--tenants").arg(t);
    }
    for (on, flag) in [
        (a.no_prefix_cache, "--no-prefix-cache"),
        (a.no_gateway_admission, "--no-gateway-admission"),
        (a.insecure_cluster, "--insecure-cluster"),
    ] {
        if on {
            cmd.arg(flag);
        }
    }
    for (flag, v) in
        [("--web-ui", a.web_ui.and_then(|w| w.to_possible_value())), ("--cluster-encryption", a.cluster_encryption.to_possible_value())]
    {
        if let Some(v) = v {
            cmd.args([flag, v.get_name()]);
        }
    }
    // Everything else of this process's environment (a config file, worker settings) is
    // not the child's; keys travel in its environment, not on its command line.
    for (k, _) in std::env::vars_os() {
        if k.to_str().is_some_and(|k| k.starts_with("BULKHEAD_") && k != "BULKHEAD_LOG") {
            cmd.env_remove(k);
        }
    }
    for (var, key) in [("BULKHEAD_API_KEY", &a.api_key), ("BULKHEAD_ADMIN_KEY", &a.admin_key)] {
        if let Some(k) = key {
            cmd.env(var, k);
        }
    }
    cmd
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        for c in self.slots.iter_mut().filter_map(|s| s.child.as_mut()) {
            let _ = c.kill();
            let _ = c.wait();
        }
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
    fn budget_dirs_of_dead_serve_processes_are_swept_and_live_ones_kept() {
        let tmp = std::env::temp_dir().join(format!("bulkhead-sweep-test-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        // A process id that was alive and is gone: a reaped child's.
        let mut child = Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let dead_dir = tmp.join(format!("{BUDGET_DIR_PREFIX}{dead}-1f"));
        let live_dir = tmp.join(format!("{BUDGET_DIR_PREFIX}{}-2f", std::process::id()));
        let other = tmp.join(format!("{BUDGET_DIR_PREFIX}x-3f"));
        for d in [&dead_dir, &live_dir, &other] {
            std::fs::create_dir_all(d.join("inner")).unwrap();
        }
        sweep_budget_dirs(&tmp);
        let (dead_gone, live_kept, other_kept) = (!dead_dir.exists(), live_dir.exists(), other.exists());
        std::fs::remove_dir_all(&tmp).unwrap();
        assert!(dead_gone, "a dead process's directory was kept");
        assert!(live_kept && other_kept, "a live or unparsable directory was removed");
    }

    #[test]
    fn core_budget_flags_the_mode_would_ignore_are_refused_by_name() {
        assert_eq!(check(&[]), Ok(()));
        assert_eq!(check(&["--core-budget", "pause", "--decode-interval-ms", "30"]), Ok(()));
        assert_eq!(check(&["--role", "decode", "--core-budget-dir", "/tmp/x"]), Ok(()));
        assert_eq!(check(&["--slo-tpot-ms", "100", "--slo-ttft-ms", "2500"]), Ok(()));
        assert_eq!(check(&["--role", "decode", "--slo-tpot-ms", "100", "--core-budget-dir", "/tmp/x"]), Ok(()));
        for (args, names) in [
            (&["--decode-interval-ms", "30"][..], "--decode-interval-ms"),
            (&["--core-budget", "off", "--decode-interval-ms", "0"], "--decode-interval-ms"),
            (&["--core-budget-dir", "/tmp/x"], "--core-budget-dir"),
            (&["--role", "gateway", "--core-budget-dir", "/tmp/x"], "--core-budget-dir"),
            (&["--role", "prefill", "--core-budget", "off", "--core-budget-dir", "/tmp/x"], "--core-budget-dir"),
            (&["--slo-ttft-ms", "2500"], "--slo-tpot-ms"),
            (&["--slo-tpot-ms", "100", "--core-budget", "split"], "--core-budget"),
            (&["--slo-tpot-ms", "100", "--core-budget", "pause"], "--core-budget"),
            (&["--slo-tpot-ms", "100", "--decode-interval-ms", "20"], "--decode-interval-ms"),
            (&["--role", "gateway", "--slo-tpot-ms", "100"], "gateway"),
            (&["--slo-tpot-ms", "0"], "--slo-tpot-ms"),
            (&["--slo-tpot-ms=-5"], "--slo-tpot-ms"),
            (&["--slo-tpot-ms", "100", "--slo-ttft-ms", "99999999999"], "--slo-ttft-ms"),
        ] {
            let err = check(args).expect_err(&format!("{args:?} accepted"));
            assert!(err.contains(names), "{args:?}: {err}");
        }
    }
}
