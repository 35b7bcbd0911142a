//! What a model run explores: requests, workers, pool sizes, fault budgets and the driver
//! variant (production or a deliberately broken one).

use bulkhead_kv::KvLayout;

/// The KV layout of every pool in the model: one layer, one KV head, two elements per head,
/// two token slots per page. Small prompts then span one or two pages and pools fill up
/// after a few requests.
pub const LAYOUT: KvLayout = KvLayout { layers: 1, kv_heads: 1, head_dim: 2, page_size: 2 };

/// The transfer and request timeouts, and the keepalive interval, in milliseconds. A
/// gateway or prefill tick moves that role's clock by this much; a decode tick by
/// [`Config::decode_tick_ms`], which is this too unless a configuration says otherwise, so
/// one tick times out everything that was waiting before it.
pub const TICK_MS: u64 = 1_000;

/// One client request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// Prompt tokens.
    pub prompt: u32,
    /// Most tokens to generate.
    pub max_tokens: u32,
    /// Its tenant, if it uses the prefix cache. The requests of cache-scoped tenants
    /// share one prompt (tokens 100, 101, ...), and the mock model writes KV values of the
    /// tenant and position, so a read of another tenant's cached page is a wrong read.
    pub tenant: Option<u8>,
}

/// How many times each kind of fault may happen in one behaviour (0 = never).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Clients that go away, each at any point before its request ends.
    pub client_aborts: u8,
    /// Messages lost on any connection (the receiver never sees them).
    pub lose: u8,
    /// Messages delivered twice (the copy arrives right after the original).
    pub duplicate: u8,
    /// Messages that overtake the one ahead of them on the same connection. The production
    /// transport is TCP, whose connections never reorder; see `docs/PROTOCOL.md`.
    pub reorder: u8,
    /// Prefill workers that crash (pool, queue and job gone, connections closed) and are
    /// replaced by a fresh worker under a new id. A worker crashes only while it has
    /// something to do: a job, a queue, or a message on the wire to or from it.
    pub prefill_crashes: u8,
    /// Decode clock steps past the transfer timeout.
    pub decode_ticks: u8,
    /// Gateway clock steps past the request timeout.
    pub gateway_ticks: u8,
    /// Prefill clock steps past the keepalive interval (each sends a `KvKeepalive`).
    pub prefill_ticks: u8,
    /// Closes of a prefill's KV connection that reach the decode worker ahead of frames
    /// sent before them: over UCX the frames and the TCP connection whose end reports the
    /// peer gone are two roads (TCP alone never does this).
    pub close_overtakes: u8,
    /// Gateways that die while requests are in flight on them (never the last one alive):
    /// what they sent still arrives, then their connections close; their clients are gone
    /// with them, and the workers end their requests on their own.
    pub gateway_losses: u8,
}

/// Which driver wraps the production state machines. Everything but [`Variant::Production`]
/// is a deliberately broken driver kept to prove that each property can fail; the
/// production roles and pools are the same in every variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    /// The drivers do what the worker processes (`crates/worker`) do.
    Production,
    /// The decode driver starts a request when `Done` arrives even if the verifier refused
    /// the completion claim ("transfer complete" trusted, the incident's decode side).
    TrustDone,
    /// The decode loop attends over every slot of every reserved page instead of the
    /// written ones (the incident's "attended over all 8 pages").
    ReadPastWatermark,
    /// The prefill driver keeps a job the prefill role rejected in its own queue and runs a
    /// 1-token placeholder for it anyway (the incident's prefill side).
    KeepRejectedJob,
    /// The decode driver treats a transfer timeout as a fence: it hands the role a
    /// `Fenced` for every request that timed out, releasing its quarantined pages.
    ReleaseQuarantineOnTick,
    /// The gateway driver retries a refused request under the same id after the client
    /// already got the refusal.
    RetryAfterReject,
    /// The decode driver drops `Fenced` from prefill workers (as if it were informational),
    /// so quarantined pages wait for a fence that never comes.
    DropFence,
    /// The decode loop makes room for a growing sequence by taking a victim's pages back
    /// through the pool (each gets a new generation) but leaves the victim in the loop,
    /// on its old leases, instead of retracting it.
    KeepRetractedRunning,
    /// The prefill driver keys cached pages without the request's scope (tenant and
    /// salt), as if the salt entered no page's key: equal prompts of two tenants get
    /// equal keys.
    UnscopedCacheKeys,
    /// The decode driver looks every reservation up, and keeps it, under the first cache
    /// scope it saw: a second tenant's prompt hits the first tenant's decode-side pages
    /// (the fence, derived from the same scope, cannot tell).
    OneDecodeScope,
    /// The KV transport writes frames straight into the decode worker's memory (one-sided
    /// RDMA or CMA puts) instead of handing them to its reader: a frame a close overtook
    /// ([`Faults::close_overtakes`]) still lands after the decode worker saw the close and
    /// fenced the writer. The driver is the production one; the transport is what breaks.
    OneSidedWrites,
    /// The decode driver drops the news that a gateway's connection closed: that gateway's
    /// requests keep their pages for clients that are gone.
    IgnoreGatewayLoss,
    /// The decode loop leaves a speculative step's rejected drafts' KV in place instead of
    /// rolling it back (I2 as amended for speculation).
    KeepRejectedDrafts,
}

/// A model configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Name printed with the results.
    pub name: &'static str,
    /// Requests, submitted in this order (each at any point after the previous one).
    pub requests: Vec<Request>,
    /// Gateways, each with its own role and clients (request `i` goes to gateway
    /// `i % gateways`); every worker registers with each.
    pub gateways: usize,
    /// Prefill workers.
    pub prefill_workers: usize,
    /// Pages of each prefill worker's pool.
    pub prefill_pool_pages: usize,
    /// Longest prompt a prefill worker admits.
    pub prefill_max_prompt: usize,
    /// Pages of the decode worker's pool.
    pub decode_pool_pages: usize,
    /// Longest request (prompt + generation) the decode worker admits.
    pub decode_max_context: usize,
    /// Whether the gateway checks the context itself (off: the workers' admission is what
    /// stands between an over-capacity prompt and the pools, as in the incident).
    pub gateway_admission: bool,
    /// Context the gateway serves.
    pub gateway_max_context: usize,
    /// Fault budgets.
    pub faults: Faults,
    /// Milliseconds one decode tick moves the decode worker's clock: [`TICK_MS`] (a tick
    /// times out every waiting transfer), or less to let a keepalive that arrives between
    /// two ticks keep a transfer alive.
    pub decode_tick_ms: u64,
    /// Also check that an over-capacity request the workers refuse is answered with that
    /// refusal (HTTP 400) rather than a failure. Off in the pinned configurations: the
    /// production protocol does not hold it (see `docs/PROTOCOL.md`, findings).
    pub check_original_error: bool,
    /// Whether prefill workers run a prefix cache over their pools.
    pub prefix_cache: bool,
    /// Whether the decode worker keeps ended requests' full pages for later requests of
    /// their scope (the decode-side cache).
    pub decode_cache: bool,
    /// With the decode-side cache: a rest of at most this many prompt tokens is computed on
    /// the decode worker instead of sent (`DecodeConfig::local_prefill_tokens`); 0: never.
    pub decode_local_prefill: usize,
    /// The gateway's prefill window in prompt tokens (`GatewayConfig::prefill_window_tokens`);
    /// 0: none.
    pub prefill_window_tokens: usize,
    /// Most drafts the mock decode loop feeds per step (speculative decoding; 0: none).
    /// Each step accepts a different number of them, so rejections fall everywhere.
    pub speculative_tokens: usize,
    /// Driver variant.
    pub variant: Variant,
}

impl Config {
    /// 3 requests × 2 prefill workers × 1 decode worker, the first generating two tokens
    /// (one decode step), the third with a prompt over the prefill workers' limit (the
    /// gateway's own check off, as in the incident) that needs 3 of the decode worker's 4
    /// pages, so the pool fills up. One client goes away at any point; one transfer
    /// timeout at any point.
    pub fn three_requests() -> Self {
        Config {
            name: "three-requests",
            requests: vec![
                Request { prompt: 1, max_tokens: 2, tenant: None },
                Request { prompt: 3, max_tokens: 1, tenant: None },
                Request { prompt: 4, max_tokens: 1, tenant: None },
            ],
            gateways: 1,
            prefill_workers: 2,
            prefill_pool_pages: 2,
            prefill_max_prompt: 3,
            decode_pool_pages: 4,
            decode_max_context: 6,
            gateway_admission: false,
            gateway_max_context: 3,
            faults: Faults { client_aborts: 1, decode_ticks: 1, ..Faults::default() },
            decode_tick_ms: TICK_MS,
            check_original_error: false,
            prefix_cache: false,
            decode_cache: false,
            decode_local_prefill: 0,
            prefill_window_tokens: 0,
            speculative_tokens: 0,
            variant: Variant::Production,
        }
    }

    /// 2 requests × 2 prefill workers × 1 decode worker under network and worker faults: one
    /// lost message, one prefill crash and restart, one client abort, one transfer timeout
    /// and one gateway timeout.
    pub fn faulty_network() -> Self {
        Config {
            name: "faulty-network",
            requests: vec![Request { prompt: 3, max_tokens: 1, tenant: None }, Request { prompt: 2, max_tokens: 1, tenant: None }],
            gateways: 1,
            prefill_workers: 2,
            prefill_pool_pages: 2,
            prefill_max_prompt: 3,
            decode_pool_pages: 3,
            decode_max_context: 6,
            gateway_admission: false,
            gateway_max_context: 3,
            faults: Faults {
                client_aborts: 1,
                lose: 1,
                duplicate: 0,
                reorder: 0,
                prefill_crashes: 1,
                decode_ticks: 1,
                gateway_ticks: 1,
                prefill_ticks: 0,
                close_overtakes: 0,
                gateway_losses: 0,
            },
            decode_tick_ms: TICK_MS,
            check_original_error: false,
            prefix_cache: false,
            decode_cache: false,
            decode_local_prefill: 0,
            prefill_window_tokens: 0,
            speculative_tokens: 0,
            variant: Variant::Production,
        }
    }

    /// One request (3-token prompt, two chunks) whose connections may duplicate one
    /// message, with a transfer timeout. TCP never duplicates; this configuration shows
    /// what the protocol relies on.
    pub fn duplicating_network() -> Self {
        Config {
            name: "duplicating-network",
            requests: vec![Request { prompt: 3, max_tokens: 1, tenant: None }],
            faults: Faults { duplicate: 1, decode_ticks: 1, ..Faults::default() },
            ..Self::faulty_network()
        }
    }

    /// One request (3-token prompt, two chunks) whose connections may reorder one message.
    /// TCP never reorders; this configuration shows what the protocol relies on.
    pub fn reordering_network() -> Self {
        Config {
            name: "reordering-network",
            requests: vec![Request { prompt: 3, max_tokens: 1, tenant: None }],
            faults: Faults { reorder: 1, ..Faults::default() },
            ..Self::faulty_network()
        }
    }

    /// One prefill worker that crashes and restarts, two one-page requests, no other fault.
    pub fn prefill_restart() -> Self {
        Config {
            name: "prefill-restart",
            requests: vec![Request { prompt: 1, max_tokens: 1, tenant: None }, Request { prompt: 1, max_tokens: 1, tenant: None }],
            prefill_workers: 1,
            faults: Faults { prefill_crashes: 1, ..Faults::default() },
            ..Self::faulty_network()
        }
    }

    /// The UCX road's ordering: one prefill worker that crashes with frames on the wire,
    /// and its close may overtake them (they are dropped with the decode side's reader),
    /// two requests, the first of two pages.
    pub fn ucx_restart() -> Self {
        Config {
            name: "ucx-restart",
            requests: vec![Request { prompt: 3, max_tokens: 1, tenant: None }, Request { prompt: 1, max_tokens: 1, tenant: None }],
            faults: Faults { prefill_crashes: 1, close_overtakes: 1, ..Faults::default() },
            ..Self::prefill_restart()
        }
    }

    /// One request of two chunks, one prefill worker, no fault but time: two decode ticks
    /// of half the transfer timeout and one prefill tick, so a keepalive that arrives
    /// between the two decode ticks keeps the transfer alive and one that does not arrive
    /// lets it time out (and either way every property holds).
    pub fn keepalive() -> Self {
        Config {
            name: "keepalive",
            requests: vec![Request { prompt: 3, max_tokens: 1, tenant: None }],
            prefill_workers: 1,
            faults: Faults { decode_ticks: 2, prefill_ticks: 1, ..Faults::default() },
            decode_tick_ms: TICK_MS / 2,
            ..Self::faulty_network()
        }
    }

    /// KV on demand: two requests whose first slices fit the decode pool together but not
    /// their whole generations, so the older one's growth retracts the newer one when
    /// both run (which then resumes from the token it made). One prefill worker, no fault.
    pub fn growth() -> Self {
        Config {
            name: "growth",
            requests: vec![Request { prompt: 1, max_tokens: 6, tenant: None }, Request { prompt: 1, max_tokens: 3, tenant: None }],
            prefill_workers: 1,
            decode_pool_pages: 4,
            decode_max_context: 8,
            faults: Faults::default(),
            ..Self::faulty_network()
        }
    }

    /// Speculative decoding on KV on demand: [`Config::growth`]'s two requests, the decode
    /// loop feeding up to 2 drafts a step in the slots its sequences hold and accepting a
    /// different number each step (none, some, all), so a rejection falls at every position,
    /// beside growth, retraction and client aborts.
    pub fn speculation() -> Self {
        Config { name: "speculation", speculative_tokens: 2, faults: Faults { client_aborts: 1, ..Faults::default() }, ..Self::growth() }
    }

    /// The prefix cache with two tenants (issue 14): two requests of tenant 0 and one of
    /// tenant 1, all with the same 3-token prompt (one full page and one partial), one
    /// prefill worker whose 2-page pool holds one prompt, so tenant 0's cached page must
    /// be evicted (or shared, by tenant 0 only) when another prompt needs the pool. One
    /// client goes away at any point, also while its request holds a cached page.
    pub fn prefix_cache() -> Self {
        Config {
            name: "prefix-cache",
            requests: vec![
                Request { prompt: 3, max_tokens: 1, tenant: Some(0) },
                Request { prompt: 3, max_tokens: 1, tenant: Some(0) },
                Request { prompt: 3, max_tokens: 1, tenant: Some(1) },
            ],
            prefill_workers: 1,
            prefill_pool_pages: 2,
            decode_pool_pages: 4,
            faults: Faults { client_aborts: 1, ..Faults::default() },
            prefix_cache: true,
            ..Self::faulty_network()
        }
    }

    /// The decode-side cache with two tenants: two requests of tenant 0 and one of tenant
    /// 1, all with the same 3-token prompt (one full page and one partial), so the second
    /// request of tenant 0 may find the first one's full page on the decode worker and
    /// receive only the rest, while tenant 1's never does. The decode pool (2 pages) holds
    /// one two-page reservation, or one cached page beside a hit's own page, so the cached
    /// page is evicted when tenant 1's prompt needs room (never while shared: that prompt
    /// waits for room instead). One client goes away at any point, also during a hit.
    pub fn decode_cache() -> Self {
        Config {
            name: "decode-cache",
            requests: vec![
                Request { prompt: 3, max_tokens: 1, tenant: Some(0) },
                Request { prompt: 3, max_tokens: 1, tenant: Some(0) },
                Request { prompt: 3, max_tokens: 1, tenant: Some(1) },
            ],
            prefill_workers: 1,
            prefill_pool_pages: 2,
            decode_pool_pages: 2,
            faults: Faults { client_aborts: 1, ..Faults::default() },
            decode_cache: true,
            ..Self::faulty_network()
        }
    }

    /// The decode-side cache with a short rest computed on the decode worker: as
    /// [`Config::decode_cache`], but a hit (one full page of a 3-token prompt) has its last
    /// token computed by the decode loop instead of sent, while misses still go through the
    /// prefill worker. One client goes away at any point, also during a local compute.
    pub fn decode_local() -> Self {
        Config { name: "decode-local", decode_local_prefill: 2, ..Self::decode_cache() }
    }

    /// Batched prefill (issue 17): two requests of two pages each on one prefill worker
    /// whose pool holds both, so one step may compute a page of each and their chunks
    /// interleave on the KV connection. One client goes away at any point; one transfer
    /// timeout at any point.
    pub fn batched_prefill() -> Self {
        Config {
            name: "batched-prefill",
            requests: vec![Request { prompt: 3, max_tokens: 1, tenant: None }, Request { prompt: 3, max_tokens: 1, tenant: None }],
            prefill_workers: 1,
            prefill_pool_pages: 4,
            decode_pool_pages: 4,
            faults: Faults { client_aborts: 1, decode_ticks: 1, ..Faults::default() },
            ..Self::faulty_network()
        }
    }

    /// Two gateways over one prefill and one decode worker (issue 34): one request on each,
    /// both of two pages, and a decode pool of three pages, so each gateway, counting only
    /// its own reservations, may ask for pages the other holds (the decode worker refuses
    /// with `Capacity` and offers `Room` when pages free). Either gateway may die while its
    /// request is in flight; one transfer timeout at any point.
    pub fn two_gateways() -> Self {
        Config {
            name: "two-gateways",
            requests: vec![Request { prompt: 3, max_tokens: 1, tenant: None }, Request { prompt: 3, max_tokens: 1, tenant: None }],
            gateways: 2,
            prefill_workers: 1,
            prefill_pool_pages: 4,
            decode_pool_pages: 3,
            faults: Faults { decode_ticks: 1, gateway_losses: 1, ..Faults::default() },
            ..Self::faulty_network()
        }
    }

    /// The same configuration with another driver variant.
    pub fn with_variant(mut self, variant: Variant) -> Self {
        self.variant = variant;
        self
    }

    /// Whether a request can never fit: its prompt exceeds the prefill workers' limit, or
    /// prompt and generation exceed the decode worker's. Such a request must be refused
    /// (HTTP 400), never finished (HTTP 200).
    pub fn over_capacity(&self, r: Request) -> bool {
        r.prompt as usize > self.prefill_max_prompt || (r.prompt + r.max_tokens) as usize > self.decode_max_context
    }
}
