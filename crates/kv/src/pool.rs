//! [`KvPool`]: page storage, leases, watermarks, quarantine and the checks on every access.

use bulkhead_fingerprint::Fingerprint;
use std::cell::Cell;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use half::f16;

use crate::{Fence, Generation, KvChecks, KvError, KvLayout, PageId, PoolConfig, PoolId, RequestId, SequenceKv};

/// Sentinel written over a page when it returns to the free list (if
/// [`KvChecks::canaries`]): a quiet f16 NaN with a recognisable payload, so a read
/// that escaped the checks yields NaN (loud) instead of another request's KV. Compare with
/// `to_bits()`, since NaN != NaN.
pub const POISON: f16 = f16::from_bits(0x7EAD);

/// What a handle claims about its page: the pool, page, generation and owner. [`Lease`] and
/// [`Quarantined`] are each a tag plus what the holder may do with it, and both dereference
/// to their tag for these accessors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
pub struct PageTag {
    pool: PoolId,
    page: PageId,
    generation: Generation,
    owner: RequestId,
}

impl PageTag {
    /// The page.
    pub fn page(&self) -> PageId {
        self.page
    }
    /// The page's generation when the lease was granted.
    pub fn generation(&self) -> Generation {
        self.generation
    }
    /// The request holding the page.
    pub fn owner(&self) -> RequestId {
        self.owner
    }
    /// The pool the page belongs to.
    pub fn pool(&self) -> PoolId {
        self.pool
    }
}

/// Lease of one page to one request at one generation.
///
/// Only the pool constructs it, and it is neither `Clone` nor `Copy`, so at most one
/// handle exists per (page, generation). Giving it back ([`KvPool::release`],
/// [`KvPool::quarantine`]) consumes it. Dropping it without giving it back leaves the page
/// leased (never reused, so never leaked to another request); [`KvPool::revoke_owner`]
/// recovers such pages.
#[must_use = "a dropped lease keeps its page leased; release or quarantine it"]
#[derive(Debug, Fingerprint)]
pub struct Lease {
    tag: PageTag,
}

/// A page taken out of service until its writer is fenced (design I4): neither free nor
/// readable nor writable. Not `Clone`; [`KvPool::release_quarantined`] consumes it.
#[must_use = "a dropped quarantine handle keeps its page out of service forever"]
#[derive(Debug, Fingerprint)]
pub struct Quarantined {
    tag: PageTag,
}

/// The cache's hold on a published page (design I7): the page is full, read-only, and
/// belongs to one fence. Not `Clone`; only [`KvPool::publish`] makes one and only
/// [`KvPool::evict`] consumes it. Its tag's owner is the request that wrote the page.
#[must_use = "a dropped cache handle keeps its page cached forever"]
#[derive(Debug, Fingerprint)]
pub struct CachedPage {
    tag: PageTag,
    fence: Fence,
}

impl CachedPage {
    /// The fence the page was published under.
    pub fn fence(&self) -> Fence {
        self.fence
    }
}

/// A read-only lease of a cached page to one reader (design I7): [`KvPool::write`] and
/// [`KvPool::import_slots`] take only a [`Lease`], so nothing can write through it. Not
/// `Clone`; [`KvPool::unshare`] consumes it. Its tag's owner is the reader; it also names
/// the page's writer and fence, which every read checks against the page.
///
/// ```compile_fail
/// # use bulkhead_kv::{KvPool, SharedLease};
/// fn write_through(pool: &mut KvPool, shared: &SharedLease) {
///     let _ = pool.write(shared, 0, 0, &[0.0], &[0.0]); // a shared lease cannot write
/// }
/// ```
#[must_use = "a dropped shared lease keeps its page from being evicted"]
#[derive(Debug, Fingerprint)]
pub struct SharedLease {
    tag: PageTag,
    writer: RequestId,
    fence: Fence,
}

impl SharedLease {
    /// The fence the reader asked under (equal to the page's, or the lease was refused).
    pub fn fence(&self) -> Fence {
        self.fence
    }
}

/// A handle that may read a page: a request's own lease or a shared one. What
/// [`KvPool::read`], [`KvPool::export_slots`] and [`KvPool::watermark`] take.
#[derive(Clone, Copy, Debug)]
pub enum PageHandle<'a> {
    /// The reader's own page.
    Own(&'a Lease),
    /// A cached page shared read-only.
    Shared(&'a SharedLease),
}

impl<'a> From<&'a Lease> for PageHandle<'a> {
    fn from(l: &'a Lease) -> Self {
        PageHandle::Own(l)
    }
}

impl<'a> From<&'a SharedLease> for PageHandle<'a> {
    fn from(l: &'a SharedLease) -> Self {
        PageHandle::Shared(l)
    }
}

impl PageHandle<'_> {
    fn tag(&self) -> &PageTag {
        match self {
            PageHandle::Own(l) => &l.tag,
            PageHandle::Shared(l) => &l.tag,
        }
    }

    /// Who the auditor expects to have written the page's slots in this generation.
    fn writer(&self) -> RequestId {
        match self {
            PageHandle::Own(l) => l.tag.owner,
            PageHandle::Shared(l) => l.writer,
        }
    }
}

/// Every handle is a tag plus a right: reading the tag goes through to it.
macro_rules! tag_of {
    ($($handle:ty),*) => {$(
        impl std::ops::Deref for $handle {
            type Target = PageTag;
            fn deref(&self) -> &PageTag {
                &self.tag
            }
        }
    )*};
}
tag_of!(Lease, Quarantined, CachedPage, SharedLease);

/// Many page reads by one task (attention over one sequence's pages), each checked as
/// [`KvPool::read`] checks it, counted here and added to the pool's statistics once, when
/// the reader is dropped: counters shared by every compute thread and bumped on every
/// page read cost a decode step more than the reads themselves.
pub struct PageReader<'p> {
    pool: &'p KvPool,
    reads: Cell<u64>,
    refusals: Cell<u64>,
    fence_checks: Cell<u64>,
    fence_failures: Cell<u64>,
}

impl<'p> PageReader<'p> {
    /// [`KvPool::read`], counted by this reader.
    pub fn read<'h>(&self, lease: impl Into<PageHandle<'h>>, layer: usize) -> Result<PageRead<'p>, KvError> {
        let r = self.pool.read_checked(lease.into(), layer, self);
        let tally = if r.is_ok() { &self.reads } else { &self.refusals };
        tally.set(tally.get() + 1);
        r
    }
}

impl Drop for PageReader<'_> {
    fn drop(&mut self) {
        let p = self.pool;
        for (n, total) in [
            (&self.reads, &p.reads),
            (&self.refusals, &p.refusals),
            (&self.fence_checks, &p.fence_checks),
            (&self.fence_failures, &p.fence_failures),
        ] {
            if n.get() > 0 {
                total.fetch_add(n.get(), Ordering::Relaxed);
            }
        }
    }
}

/// Where a cached page's fence check (I7) is counted: at once in the pool's statistics, or
/// by a [`PageReader`].
trait FenceCount {
    fn fence_checked(&self, failed: bool);
}

impl FenceCount for KvPool {
    fn fence_checked(&self, failed: bool) {
        self.fence_checks.fetch_add(1, Ordering::Relaxed);
        if failed {
            self.fence_failures.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl FenceCount for PageReader<'_> {
    fn fence_checked(&self, failed: bool) {
        self.fence_checks.set(self.fence_checks.get() + 1);
        if failed {
            self.fence_failures.set(self.fence_failures.get() + 1);
        }
    }
}

/// Borrowed view of K and V of one page for one layer, holding only the written slots.
#[derive(Clone, Copy, Debug)]
pub struct PageRead<'a> {
    /// The layer's whole K block, `[kv_head][slot 0..page_size][head_dim]`; only the first
    /// `len` slots of each head are ever handed out.
    k: &'a [f16],
    /// Same for V.
    v: &'a [f16],
    /// Written slots (the watermark at read time).
    len: usize,
    kv_heads: usize,
    head_dim: usize,
    page_size: usize,
}

impl<'a> PageRead<'a> {
    /// Written slots: the layer's watermark in the lease's generation.
    pub fn len(&self) -> usize {
        self.len
    }
    /// No slot written yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// KV heads per slot.
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }
    /// Elements per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// K of head `kv_head`: `len * head_dim` elements, slot-major (slot `s` at `[s*head_dim..]`).
    ///
    /// # Panics
    /// If `kv_head >= kv_heads` (a programmer error: the layout is known to the caller).
    pub fn k_head(&self, kv_head: usize) -> &'a [f16] {
        self.head(self.k, kv_head)
    }
    /// V of head `kv_head`, laid out like [`PageRead::k_head`].
    ///
    /// # Panics
    /// If `kv_head >= kv_heads`.
    pub fn v_head(&self, kv_head: usize) -> &'a [f16] {
        self.head(self.v, kv_head)
    }

    fn head(&self, block: &'a [f16], kv_head: usize) -> &'a [f16] {
        assert!(kv_head < self.kv_heads, "kv_head {kv_head} must be < kv_heads {}", self.kv_heads);
        let start = kv_head * self.page_size * self.head_dim;
        // Only the written prefix: slots >= len hold an earlier generation's data (I2).
        &block[start..start + self.len * self.head_dim]
    }
}

/// Counts of pages by state, and of what the pool did (design I6: checks are counted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Pages in the pool.
    pub total_pages: usize,
    /// Pages on the free list.
    pub free_pages: usize,
    /// Pages leased to a request.
    pub leased_pages: usize,
    /// Pages quarantined.
    pub quarantined_pages: usize,
    /// Pages published to a prefix cache (read-only, shared).
    pub cached_pages: usize,
    /// Shared leases out on cached pages.
    pub shared_leases: usize,
    /// Leases granted since the pool was made.
    pub leases_granted: u64,
    /// Pages returned to the free list (from leased or quarantined).
    pub releases: u64,
    /// Pages quarantined (by [`KvPool::quarantine`] or [`KvPool::revoke_owner`]).
    pub quarantines: u64,
    /// Writes that passed every check.
    pub writes: u64,
    /// Reads that passed every check.
    pub reads: u64,
    /// Accesses refused with an error (stale, foreign, out of range, non-sequential, ...).
    pub refusals: u64,
    /// Leases checked live (page generation == lease generation) before a forward step
    /// attends to them ([`KvPool::check_reads`]); runs whatever the checks configuration.
    pub generation_checks: u64,
    /// Slots checked against the poison canary before first being attended to.
    pub canary_checks: u64,
    /// Slots refused because they still held the poison canary.
    pub poisoned_reads: u64,
    /// Slot reads checked by the KV auditor.
    pub audited_slots: u64,
    /// Slots the auditor refused (shadow tag of another owner or generation).
    pub audit_violations: u64,
    /// Pages published to a prefix cache.
    pub published: u64,
    /// Cached pages evicted back to the free list.
    pub evictions: u64,
    /// Shared leases granted.
    pub shares: u64,
    /// Tenant-fence checks: a shared lease asked for or read under its fence (I7).
    pub fence_checks: u64,
    /// Fence checks refused: a request reached a page of another tenant or salt.
    pub fence_failures: u64,
}

/// Shadow tag of one slot: who wrote it, under which lease generation. Generation 0 is
/// never leased, so the initial tag matches no reader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SlotTag {
    owner: RequestId,
    generation: Generation,
}

const UNWRITTEN: SlotTag = SlotTag { owner: RequestId(0), generation: Generation(0) };

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PageState {
    Free,
    Leased(RequestId),
    Quarantined(RequestId),
    /// Published to a prefix cache: full, read-only, readable only under `fence`.
    Cached {
        fence: Fence,
        writer: RequestId,
    },
}

impl PageState {
    /// The request holding the page, leased or quarantined.
    fn owner(self) -> Option<RequestId> {
        match self {
            PageState::Free | PageState::Cached { .. } => None,
            PageState::Leased(o) | PageState::Quarantined(o) => Some(o),
        }
    }
}

/// Which state a handle requires of its page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Want {
    Leased,
    Quarantined,
}

#[derive(Clone, Copy, Debug)]
struct PageMeta {
    state: PageState,
    /// Generation of the latest lease of this page (0: never leased).
    generation: Generation,
}

/// The page allocator and the only place KV bytes live.
///
/// Invariants (asserted by [`KvPool::check_invariants`]):
/// - every page is exactly one of free (on the free list once), leased, quarantined,
///   cached;
/// - only cached pages have readers, and a cached page with readers is never evicted;
/// - a page's generation only grows, and each lease gets a fresh one (I1);
/// - a page's per-layer watermarks count slots written in its current generation, and are
///   zero unless the page is leased or cached (then full), so nothing written earlier is
///   ever readable (I2).
pub struct KvPool {
    id: PoolId,
    layout: KvLayout,
    checks: KvChecks,
    /// `pages * page_elems` elements; page `p` at `[p * page_elems..]`.
    storage: Vec<f16>,
    meta: Vec<PageMeta>,
    /// `watermarks[page * layers + layer]`: slots written in that layer this generation.
    watermarks: Vec<usize>,
    /// The auditor's shadow tags, `[page][layer][slot]`; empty unless `checks.audit`.
    /// Written only by the pool's own write paths, never read by attention.
    shadow: Vec<SlotTag>,
    /// Free pages, used as a stack (most recently freed reused first).
    free: Vec<PageId>,
    /// `readers[page]`: the requests holding a shared lease on a cached page (one entry per
    /// lease); empty for every other page.
    readers: Vec<Vec<RequestId>>,
    cached: usize,
    published: u64,
    evictions: u64,
    shares: u64,
    /// Last generation handed out, pool-wide; strictly increasing, hence per page too.
    last_generation: u64,
    leased: usize,
    quarantined: usize,
    leases_granted: u64,
    releases: u64,
    quarantines: u64,
    writes: u64,
    /// Atomic so that `read(&self)` can count while the pool stays `Sync`.
    reads: AtomicU64,
    refusals: AtomicU64,
    generation_checks: AtomicU64,
    canary_checks: AtomicU64,
    poisoned_reads: AtomicU64,
    audited_slots: AtomicU64,
    audit_violations: AtomicU64,
    fence_checks: AtomicU64,
    fence_failures: AtomicU64,
}

impl fmt::Debug for KvPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print storage: it is other requests' KV.
        f.debug_struct("KvPool").field("id", &self.id).field("layout", &self.layout).field("stats", &self.stats()).finish_non_exhaustive()
    }
}

impl KvPool {
    /// Makes a pool of `cfg.pages` free pages. Storage is allocated up front with
    /// `try_reserve_exact`, so running out of memory is an error, not an abort.
    pub fn new(cfg: PoolConfig) -> Result<Self, KvError> {
        let layout = cfg.layout;
        layout.validate()?;
        if cfg.pages == 0 {
            return Err(KvError::NoPages);
        }
        let too_large = KvError::TooLarge { pages: cfg.pages, layout };
        // Page ids are u32.
        if u32::try_from(cfg.pages - 1).is_err() {
            return Err(too_large);
        }
        let elems = cfg.pages.checked_mul(layout.page_elems()).ok_or(too_large.clone())?;
        let bytes = elems.checked_mul(2).ok_or(too_large.clone())?;
        cfg.pages.checked_mul(layout.page_size).ok_or(too_large.clone())?;
        let wm_len = cfg.pages.checked_mul(layout.layers).ok_or(too_large.clone())?;
        let shadow_len = if cfg.checks.audit { wm_len.checked_mul(layout.page_size).ok_or(too_large)? } else { 0 };

        let mut storage = Vec::new();
        storage.try_reserve_exact(elems).map_err(|_| KvError::OutOfMemory { bytes })?;
        let mut shadow = Vec::new();
        shadow
            .try_reserve_exact(shadow_len)
            .map_err(|_| KvError::OutOfMemory { bytes: shadow_len.saturating_mul(std::mem::size_of::<SlotTag>()) })?;
        shadow.resize(shadow_len, UNWRITTEN);
        let fill = if cfg.checks.canaries { POISON } else { f16::ZERO };
        storage.resize(elems, fill);

        let meta = vec![PageMeta { state: PageState::Free, generation: Generation(0) }; cfg.pages];
        // Reverse so that page 0 is leased first (deterministic, easier to read in tests).
        let free = (0..cfg.pages)
            .rev()
            .map(|p| PageId(p as u32)) // p < 2^32 checked above
            .collect();
        Ok(KvPool {
            id: PoolId::fresh(),
            layout,
            checks: cfg.checks,
            storage,
            meta,
            watermarks: vec![0; wm_len],
            shadow,
            free,
            readers: vec![Vec::new(); cfg.pages],
            cached: 0,
            published: 0,
            evictions: 0,
            shares: 0,
            last_generation: 0,
            leased: 0,
            quarantined: 0,
            leases_granted: 0,
            releases: 0,
            quarantines: 0,
            writes: 0,
            reads: AtomicU64::new(0),
            refusals: AtomicU64::new(0),
            generation_checks: AtomicU64::new(0),
            canary_checks: AtomicU64::new(0),
            poisoned_reads: AtomicU64::new(0),
            audited_slots: AtomicU64::new(0),
            audit_violations: AtomicU64::new(0),
            fence_checks: AtomicU64::new(0),
            fence_failures: AtomicU64::new(0),
        })
    }

    /// This pool's process-unique id.
    pub fn id(&self) -> PoolId {
        self.id
    }

    /// Shape of every page.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The optional checks this pool runs.
    pub fn checks(&self) -> KvChecks {
        self.checks
    }

    /// Pages in the pool.
    pub fn total_pages(&self) -> usize {
        self.meta.len()
    }

    /// Tokens the whole pool can hold: `pages * page_size` (design I5).
    pub fn capacity_tokens(&self) -> usize {
        self.meta.len() * self.layout.page_size
    }

    /// Leases one free page to `owner` at a fresh generation.
    pub fn lease(&mut self, owner: RequestId) -> Result<Lease, KvError> {
        match self.free.pop() {
            Some(page) => Ok(self.grant(page, owner)),
            None => Err(KvError::Exhausted { requested: 1, free: 0 }),
        }
    }

    /// Leases `n` pages to `owner`, all or nothing: on [`KvError::Exhausted`] no page was taken.
    pub fn lease_many(&mut self, owner: RequestId, n: usize) -> Result<Vec<Lease>, KvError> {
        // All or nothing: decide before taking any page, so a failure leaves nothing leased.
        if n > self.free.len() {
            return Err(KvError::Exhausted { requested: n, free: self.free.len() });
        }
        let mut leases = Vec::with_capacity(n);
        for _ in 0..n {
            leases.push(self.lease(owner)?);
        }
        Ok(leases)
    }

    fn grant(&mut self, page: PageId, owner: RequestId) -> Lease {
        assert!(self.last_generation < u64::MAX, "generations must strictly increase; u64 exhausted");
        self.last_generation += 1;
        let generation = Generation(self.last_generation);
        let meta = &mut self.meta[page.index()];
        assert_eq!(meta.state, PageState::Free, "the free list holds only free pages");
        assert!(meta.generation < generation, "a page's generation strictly increases on every lease");
        meta.state = PageState::Leased(owner);
        meta.generation = generation;
        self.leased += 1;
        self.leases_granted += 1;
        Lease { tag: PageTag { pool: self.id, page, generation, owner } }
    }

    /// Verifies a handle is live: made by this pool, same generation; an own lease's page
    /// leased to the same owner, a shared lease's page cached under its fence with it among
    /// the readers. Every access runs this first; it is public so callers can check before
    /// long work.
    pub fn check<'h>(&self, lease: impl Into<PageHandle<'h>>) -> Result<(), KvError> {
        self.counted(self.verify_handle(lease.into(), self))
    }

    /// The isolation check (I1) shared by every handle. Each condition is separate so that a
    /// test bites each one.
    fn verify(&self, tag: &PageTag, want: Want) -> Result<(), KvError> {
        if tag.pool != self.id {
            return Err(KvError::ForeignLease { lease_pool: tag.pool, pool: self.id });
        }
        let meta = self.meta.get(tag.page.index()).ok_or(KvError::PageOutOfRange { page: tag.page, pages: self.meta.len() })?;
        let state_ok = match want {
            Want::Leased => matches!(meta.state, PageState::Leased(_)),
            Want::Quarantined => matches!(meta.state, PageState::Quarantined(_)),
        };
        let generation_ok = meta.generation == tag.generation;
        let owner_ok = meta.state.owner() == Some(tag.owner);
        if state_ok && generation_ok && owner_ok {
            Ok(())
        } else {
            Err(KvError::StaleLease { page: tag.page, lease_generation: tag.generation, page_generation: meta.generation })
        }
    }

    /// The check of a cached page's handle: live in its generation, written by `writer`,
    /// and (I7) published under `fence`. A fence mismatch is counted apart.
    fn verify_cached(&self, tag: &PageTag, writer: RequestId, fence: Fence, count: &impl FenceCount) -> Result<(), KvError> {
        if tag.pool != self.id {
            return Err(KvError::ForeignLease { lease_pool: tag.pool, pool: self.id });
        }
        let meta = self.meta.get(tag.page.index()).ok_or(KvError::PageOutOfRange { page: tag.page, pages: self.meta.len() })?;
        let stale = KvError::StaleLease { page: tag.page, lease_generation: tag.generation, page_generation: meta.generation };
        let PageState::Cached { fence: page_fence, writer: page_writer } = meta.state else { return Err(stale) };
        if meta.generation != tag.generation || page_writer != writer {
            return Err(stale);
        }
        count.fence_checked(page_fence != fence);
        if page_fence != fence {
            return Err(KvError::FenceMismatch { page: tag.page });
        }
        Ok(())
    }

    /// The check of a shared lease: the cached page's check, and the lease is still one
    /// of the page's readers (not given back, not revoked).
    fn verify_shared(&self, lease: &SharedLease, count: &impl FenceCount) -> Result<(), KvError> {
        self.verify_cached(&lease.tag, lease.writer, lease.fence, count)?;
        if !self.readers[lease.tag.page.index()].contains(&lease.tag.owner) {
            let meta = self.meta[lease.tag.page.index()];
            return Err(KvError::StaleLease {
                page: lease.tag.page,
                lease_generation: lease.tag.generation,
                page_generation: meta.generation,
            });
        }
        Ok(())
    }

    /// The check of whatever handle reads a page.
    fn verify_handle(&self, h: PageHandle<'_>, count: &impl FenceCount) -> Result<(), KvError> {
        match h {
            PageHandle::Own(l) => self.verify(&l.tag, Want::Leased),
            PageHandle::Shared(l) => self.verify_shared(l, count),
        }
    }

    /// Publishes a full page of `lease` to a prefix cache under `fence` (design I7): from
    /// now on nobody writes it, and only [`KvPool::share`] under the same fence reads it.
    /// Refused (the lease comes back) unless the lease is live and every layer is full.
    pub fn publish(&mut self, lease: Lease, fence: Fence) -> Result<CachedPage, (KvError, Lease)> {
        if let Err(e) = self.check(&lease) {
            return Err((e, lease));
        }
        let page = lease.tag.page;
        let ps = self.layout.page_size;
        for layer in 0..self.layout.layers {
            let watermark = self.watermarks[self.wm_index(page, layer)];
            if watermark != ps {
                return Err((KvError::NotFull { page, layer, watermark }, lease));
            }
        }
        self.meta[page.index()].state = PageState::Cached { fence, writer: lease.tag.owner };
        self.leased -= 1;
        self.cached += 1;
        self.published += 1;
        Ok(CachedPage { tag: lease.tag, fence })
    }

    /// [`KvPool::publish`], and the page shared back to its writer in the same step, for a
    /// sequence that goes on attending to it: from now on it reads the page through the
    /// shared lease (which cannot write), and the page always has a reader while it does,
    /// so it cannot be evicted under it.
    pub fn publish_and_keep(&mut self, lease: Lease, fence: Fence) -> Result<(CachedPage, SharedLease), (KvError, Lease)> {
        let owner = lease.tag.owner;
        let page = self.publish(lease, fence)?;
        self.readers[page.tag.page.index()].push(owner);
        self.shares += 1;
        let shared = SharedLease { tag: page.tag, writer: owner, fence };
        Ok((page, shared))
    }

    /// A read-only lease of a cached page for `reader`, who asks under `fence`: refused
    /// with [`KvError::FenceMismatch`] unless the page was published under the same fence,
    /// whatever key led the caller to it (I7).
    pub fn share(&mut self, page: &CachedPage, reader: RequestId, fence: Fence) -> Result<SharedLease, KvError> {
        self.counted(self.verify_cached(&page.tag, page.tag.owner, fence, self))?;
        self.readers[page.tag.page.index()].push(reader);
        self.shares += 1;
        Ok(SharedLease { tag: PageTag { owner: reader, ..page.tag }, writer: page.tag.owner, fence })
    }

    /// Gives a shared lease back.
    pub fn unshare(&mut self, lease: SharedLease) -> Result<(), KvError> {
        self.counted(self.verify_shared(&lease, self))?;
        let readers = &mut self.readers[lease.tag.page.index()];
        if let Some(i) = readers.iter().position(|r| *r == lease.tag.owner) {
            readers.swap_remove(i);
        }
        Ok(())
    }

    /// Shared leases out on a cached page (0 for a stale handle).
    pub fn readers(&self, page: &CachedPage) -> usize {
        match self.verify_cached(&page.tag, page.tag.owner, page.fence, self) {
            Ok(()) => self.readers[page.tag.page.index()].len(),
            Err(_) => 0,
        }
    }

    /// Takes a cached page back to the free list (design I7): refused while any shared
    /// lease is out on it. Its next lease gets a fresh generation like any page's, so
    /// every handle of the cached generation is stale from here on.
    pub fn evict(&mut self, page: CachedPage) -> Result<(), (KvError, CachedPage)> {
        if let Err(e) = self.counted(self.verify_cached(&page.tag, page.tag.owner, page.fence, self)) {
            return Err((e, page));
        }
        let readers = self.readers[page.tag.page.index()].len();
        if readers > 0 {
            return Err((KvError::InUse { page: page.tag.page, readers }, page));
        }
        self.cached -= 1;
        self.evictions += 1;
        self.free_page(page.tag.page);
        Ok(())
    }

    fn check_layer(&self, layer: usize) -> Result<(), KvError> {
        if layer >= self.layout.layers {
            return Err(KvError::LayerOutOfRange { layer, layers: self.layout.layers });
        }
        Ok(())
    }

    /// Counts a refusal (I6) and passes the result through.
    fn counted<T>(&self, r: Result<T, KvError>) -> Result<T, KvError> {
        if r.is_err() {
            self.refusals.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    fn wm_index(&self, page: PageId, layer: usize) -> usize {
        page.index() * self.layout.layers + layer
    }

    /// Start of the K block of `layer` in `page`; the V block follows it.
    fn block_start(&self, page: PageId, layer: usize) -> usize {
        page.index() * self.layout.page_elems() + layer * 2 * self.layout.block_elems()
    }

    /// Returns the page to the free list: watermarks zeroed, storage poisoned if configured.
    fn free_page(&mut self, page: PageId) {
        self.reset_watermarks(page);
        if self.checks.canaries {
            let pe = self.layout.page_elems();
            let start = page.index() * pe;
            self.storage[start..start + pe].fill(POISON);
        }
        self.meta[page.index()].state = PageState::Free;
        self.free.push(page);
        self.releases += 1;
    }

    fn reset_watermarks(&mut self, page: PageId) {
        let start = self.wm_index(page, 0);
        let layers = self.layout.layers;
        self.watermarks[start..start + layers].fill(0);
    }

    /// Gives a leased page back to the free list (watermarks reset, poisoned if configured).
    /// A stale or foreign lease is refused and the page is left as it is.
    pub fn release(&mut self, lease: Lease) -> Result<(), KvError> {
        self.check(&lease)?;
        self.leased -= 1;
        self.free_page(lease.tag.page);
        Ok(())
    }

    /// Takes a leased page out of service until its writer is fenced (I4): it is neither
    /// free nor readable nor writable until [`KvPool::release_quarantined`].
    pub fn quarantine(&mut self, lease: Lease) -> Result<Quarantined, KvError> {
        self.check(&lease)?;
        Ok(self.quarantine_page(lease.tag))
    }

    fn quarantine_page(&mut self, tag: PageTag) -> Quarantined {
        // Nothing may read this generation any more; zeroed watermarks make that visible.
        self.reset_watermarks(tag.page);
        self.meta[tag.page.index()].state = PageState::Quarantined(tag.owner);
        self.leased -= 1;
        self.quarantined += 1;
        self.quarantines += 1;
        Quarantined { tag }
    }

    /// Frees a quarantined page once its writer is fenced (poisoned likewise).
    pub fn release_quarantined(&mut self, q: Quarantined) -> Result<(), KvError> {
        self.counted(self.verify(&q.tag, Want::Quarantined))?;
        self.quarantined -= 1;
        self.free_page(q.tag.page);
        Ok(())
    }

    /// Quarantines every page leased to `owner`, whatever `Lease` values still exist (they
    /// become stale). For aborts whose lease holders cannot be reached, and to recover pages
    /// whose lease was dropped. Returns the handles in page order.
    pub fn revoke_owner(&mut self, owner: RequestId) -> Vec<Quarantined> {
        let mut out = Vec::new();
        for i in 0..self.meta.len() {
            let meta = self.meta[i];
            if meta.state == PageState::Leased(owner) {
                let page = PageId(i as u32); // i < pages <= 2^32, checked in new
                let tag = PageTag { pool: self.id, page, generation: meta.generation, owner };
                out.push(self.quarantine_page(tag));
            }
        }
        // Its shared leases (a dropped sequence's) stop counting as readers.
        for readers in &mut self.readers {
            readers.retain(|r| *r != owner);
        }
        out
    }

    /// Appends one token's K and V at `slot` of `layer`. Each of `k`, `v` holds `row_elems`
    /// f32, head-major (head `h` at `[h*head_dim..]`); they are stored rounded to f16.
    /// Append-only: `slot` must equal the layer's watermark and be `< page_size`.
    /// Nothing is written unless every check passes.
    pub fn write(&mut self, lease: &Lease, layer: usize, slot: usize, k: &[f32], v: &[f32]) -> Result<(), KvError> {
        let r = self.write_checked(lease, layer, slot, k, v);
        self.counted(r)
    }

    fn write_checked(&mut self, lease: &Lease, layer: usize, slot: usize, k: &[f32], v: &[f32]) -> Result<(), KvError> {
        self.verify(&lease.tag, Want::Leased)?;
        self.check_layer(layer)?;
        let page = lease.tag.page;
        let row = self.layout.row_elems();
        if k.len() != row || v.len() != row {
            return Err(KvError::RowLength { expected: row, k: k.len(), v: v.len() });
        }
        let page_size = self.layout.page_size;
        if slot >= page_size {
            return Err(KvError::PageFull { page, layer, slot, page_size });
        }
        let wm = self.wm_index(page, layer);
        let watermark = self.watermarks[wm];
        // Append-only: the written slots are always exactly 0..watermark, no holes.
        if slot != watermark {
            return Err(KvError::NonSequentialWrite { page, layer, slot, watermark });
        }

        let hd = self.layout.head_dim;
        let head_stride = page_size * hd;
        let k_block = self.block_start(page, layer);
        let v_block = k_block + self.layout.block_elems();
        for h in 0..self.layout.kv_heads {
            let at = h * head_stride + slot * hd;
            let src = h * hd..(h + 1) * hd;
            for (dst, x) in self.storage[k_block + at..k_block + at + hd].iter_mut().zip(&k[src.clone()]) {
                *dst = f16::from_f32(*x);
            }
            for (dst, x) in self.storage[v_block + at..v_block + at + hd].iter_mut().zip(&v[src]) {
                *dst = f16::from_f32(*x);
            }
        }
        self.watermarks[wm] = slot + 1;
        self.tag_slots(&lease.tag, layer, slot, 1);
        self.writes += 1;
        Ok(())
    }

    /// K and V of the lease's page for `layer`, limited to the slots written in the lease's
    /// generation (the watermark).
    pub fn read<'h>(&self, lease: impl Into<PageHandle<'h>>, layer: usize) -> Result<PageRead<'_>, KvError> {
        self.reader().read(lease, layer)
    }

    /// A reader for one task's many page reads: [`PageReader::read`] checks each read as
    /// [`KvPool::read`] does, and the reader adds what it counted to the pool's statistics
    /// once, when dropped.
    pub fn reader(&self) -> PageReader<'_> {
        PageReader { pool: self, reads: Cell::new(0), refusals: Cell::new(0), fence_checks: Cell::new(0), fence_failures: Cell::new(0) }
    }

    fn read_checked(&self, lease: PageHandle<'_>, layer: usize, count: &impl FenceCount) -> Result<PageRead<'_>, KvError> {
        self.verify_handle(lease, count)?;
        self.check_layer(layer)?;
        let page = lease.tag().page;
        // Never page_size: slots past the watermark hold earlier generations' KV (I2).
        let len = self.watermarks[self.wm_index(page, layer)];
        let block = self.layout.block_elems();
        let k_start = self.block_start(page, layer);
        Ok(PageRead {
            k: &self.storage[k_start..k_start + block],
            v: &self.storage[k_start + block..k_start + 2 * block],
            len,
            kv_heads: self.layout.kv_heads,
            head_dim: self.layout.head_dim,
            page_size: self.layout.page_size,
        })
    }

    /// Records the writer of slots `start..start + count` of `layer` for the auditor.
    fn tag_slots(&mut self, tag: &PageTag, layer: usize, start: usize, count: usize) {
        if self.checks.audit {
            let at = self.wm_index(tag.page, layer) * self.layout.page_size + start;
            self.shadow[at..at + count].fill(SlotTag { owner: tag.owner, generation: tag.generation });
        }
    }

    /// The checks before a forward step attends to the committed positions of `kv`
    /// (design I1, I2, I6). Always: every lease is live (page generation == lease
    /// generation). With canaries: no slot attended to holds [`POISON`]; each slot is
    /// checked once, when first attended to, since a live lease's written slots cannot
    /// change (writes are append-only and a page changes hands only under a new
    /// generation). With the auditor: every slot of every layer, on every call, carries the
    /// shadow tag of this lease, independently of the watermarks.
    pub fn check_reads(&self, kv: &mut SequenceKv) -> Result<(), KvError> {
        let r = self.check_reads_inner(kv);
        self.counted(r)
    }

    fn check_reads_inner(&self, kv: &mut SequenceKv) -> Result<(), KvError> {
        let (ps, len) = (self.layout.page_size, kv.len());
        for page in kv.pages() {
            self.generation_checks.fetch_add(1, Ordering::Relaxed);
            // A shared page is also checked against its fence (I7), on every step.
            self.verify_handle(page.handle(), self)?;
        }
        if self.checks.canaries {
            let from = kv.canary_checked();
            for pos in from..len {
                let (lease, slot) = kv.locate_page(pos)?;
                for layer in 0..self.layout.layers {
                    // First K element of kv head 0: poison fills whole pages.
                    let at = self.block_start(lease.page(), layer) + slot * self.layout.head_dim;
                    if self.storage[at].to_bits() == POISON.to_bits() {
                        self.poisoned_reads.fetch_add(1, Ordering::Relaxed);
                        return Err(KvError::PoisonedSlot { page: lease.page(), layer, slot });
                    }
                }
            }
            self.canary_checks.fetch_add((len - from.min(len)) as u64, Ordering::Relaxed);
            kv.set_canary_checked(len);
        }
        if self.checks.audit {
            for (i, page) in kv.pages().iter().enumerate() {
                let slots = len.saturating_sub(i * ps).min(ps);
                if slots == 0 {
                    break;
                }
                // A shared page's slots carry its writer's tag, in the cached generation.
                let h = page.handle();
                let want = SlotTag { owner: h.writer(), generation: page.generation() };
                for layer in 0..self.layout.layers {
                    let at = self.wm_index(page.page(), layer) * ps;
                    self.audited_slots.fetch_add(slots as u64, Ordering::Relaxed);
                    if let Some(slot) = self.shadow[at..at + slots].iter().position(|t| *t != want) {
                        self.audit_violations.fetch_add(1, Ordering::Relaxed);
                        let found = self.shadow[at + slot];
                        return Err(KvError::AuditViolation {
                            page: page.page(),
                            layer,
                            slot,
                            written_by: found.owner,
                            written_generation: found.generation,
                            reader: want.owner,
                            reader_generation: want.generation,
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// Bytes of one token's KV across all layers in the transfer layout (f16, little-endian).
    pub fn transfer_bytes_per_token(&self) -> usize {
        self.layout.bytes_per_token()
    }

    /// Storage ranges of slots `start..start + count` of `page`, in the transfer layout's
    /// order: `[layer][K, V][kv_head]`, each range `count * head_dim` elements.
    fn transfer_segments(&self, page: PageId, start: usize, count: usize) -> impl Iterator<Item = std::ops::Range<usize>> + use<> {
        let (hd, heads, block) = (self.layout.head_dim, self.layout.kv_heads, self.layout.block_elems());
        let head_stride = self.layout.page_size * hd;
        let starts: Vec<usize> = (0..self.layout.layers).map(|l| self.block_start(page, l)).collect();
        starts
            .into_iter()
            .flat_map(move |k_block| {
                (0..2).flat_map(move |half| (0..heads).map(move |h| k_block + half * block + h * head_stride + start * hd))
            })
            .map(move |at| at..at + count * hd)
    }

    /// Appends to `out` the KV of slots `start..start + count` of the lease's page, all
    /// layers, in the transfer layout `[layer][K, V][kv_head][slot][head_dim]` as f16 LE.
    /// Only written slots can be exported.
    pub fn export_slots<'h>(&self, lease: impl Into<PageHandle<'h>>, start: usize, count: usize, out: &mut Vec<u8>) -> Result<(), KvError> {
        let r = self.export_checked(lease.into(), start, count, out);
        self.counted(r)
    }

    fn export_checked(&self, lease: PageHandle<'_>, start: usize, count: usize, out: &mut Vec<u8>) -> Result<(), KvError> {
        self.verify_handle(lease, self)?;
        let page = lease.tag().page;
        let end = start.saturating_add(count);
        for layer in 0..self.layout.layers {
            let watermark = self.watermarks[self.wm_index(page, layer)];
            if end > watermark {
                return Err(KvError::NotWritten { pos: end - 1, layer, page, watermark });
            }
        }
        out.reserve(count * self.layout.bytes_per_token());
        for seg in self.transfer_segments(page, start, count) {
            f16_to_le(&self.storage[seg], out);
        }
        Ok(())
    }

    /// Writes slots `start..start + count` of the lease's page, all layers, from `data` in the
    /// transfer layout (see [`KvPool::export_slots`]). Append-only: `start` must equal every
    /// layer's watermark. Nothing is written unless every check passes.
    pub fn import_slots(&mut self, lease: &Lease, start: usize, count: usize, data: &[u8]) -> Result<(), KvError> {
        let r = self.import_checked(lease, start, count, data);
        self.counted(r)
    }

    fn import_checked(&mut self, lease: &Lease, start: usize, count: usize, data: &[u8]) -> Result<(), KvError> {
        self.verify(&lease.tag, Want::Leased)?;
        let page = lease.tag.page;
        let page_size = self.layout.page_size;
        if count == 0 || start.saturating_add(count) > page_size {
            return Err(KvError::PageFull { page, layer: 0, slot: start.saturating_add(count), page_size });
        }
        let expected = count * self.layout.bytes_per_token();
        if data.len() != expected {
            return Err(KvError::RowLength { expected, k: data.len(), v: 0 });
        }
        for layer in 0..self.layout.layers {
            let watermark = self.watermarks[self.wm_index(page, layer)];
            if start != watermark {
                return Err(KvError::NonSequentialWrite { page, layer, slot: start, watermark });
            }
        }
        // `data` is exactly the segments' bytes (checked above), so every split is in range.
        let mut rest = data;
        for seg in self.transfer_segments(page, start, count) {
            let (bytes, tail) = rest.split_at(seg.len() * 2);
            f16_from_le(bytes, &mut self.storage[seg]);
            rest = tail;
        }
        for layer in 0..self.layout.layers {
            let wm = self.wm_index(page, layer);
            self.watermarks[wm] = start + count;
            self.tag_slots(&lease.tag, layer, start, count);
        }
        self.writes += 1;
        Ok(())
    }

    /// Slots written in `layer` of the lease's page in its generation.
    pub fn watermark<'h>(&self, lease: impl Into<PageHandle<'h>>, layer: usize) -> Result<usize, KvError> {
        let lease = lease.into();
        let r = self
            .verify_handle(lease, self)
            .and_then(|()| self.check_layer(layer))
            .map(|()| self.watermarks[self.wm_index(lease.tag().page, layer)]);
        self.counted(r)
    }

    /// Whether every element of `page` holds [`POISON`]. Reveals one bit, never KV values;
    /// meant for tests and canaries ("check that poisoning really ran", I6).
    pub fn page_is_poisoned(&self, page: PageId) -> Result<bool, KvError> {
        if page.index() >= self.meta.len() {
            return Err(KvError::PageOutOfRange { page, pages: self.meta.len() });
        }
        let pe = self.layout.page_elems();
        let start = page.index() * pe;
        Ok(self.storage[start..start + pe].iter().all(|x| x.to_bits() == POISON.to_bits()))
    }

    /// Counts of pages and operations.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            total_pages: self.meta.len(),
            free_pages: self.free.len(),
            leased_pages: self.leased,
            quarantined_pages: self.quarantined,
            cached_pages: self.cached,
            shared_leases: self.readers.iter().map(Vec::len).sum(),
            leases_granted: self.leases_granted,
            releases: self.releases,
            quarantines: self.quarantines,
            writes: self.writes,
            reads: self.reads.load(Ordering::Relaxed),
            refusals: self.refusals.load(Ordering::Relaxed),
            generation_checks: self.generation_checks.load(Ordering::Relaxed),
            canary_checks: self.canary_checks.load(Ordering::Relaxed),
            poisoned_reads: self.poisoned_reads.load(Ordering::Relaxed),
            audited_slots: self.audited_slots.load(Ordering::Relaxed),
            audit_violations: self.audit_violations.load(Ordering::Relaxed),
            published: self.published,
            evictions: self.evictions,
            shares: self.shares,
            fence_checks: self.fence_checks.load(Ordering::Relaxed),
            fence_failures: self.fence_failures.load(Ordering::Relaxed),
        }
    }

    /// Asserts the bookkeeping is consistent; for tests. O(pages * layers).
    ///
    /// # Panics
    /// With a message naming the broken invariant.
    pub fn check_invariants(&self) {
        let pages = self.meta.len();
        assert_eq!(self.storage.len(), pages * self.layout.page_elems(), "storage holds exactly pages * page_elems elements");
        assert_eq!(self.watermarks.len(), pages * self.layout.layers, "one watermark per page and layer");
        let mut on_free_list = vec![false; pages];
        for &p in &self.free {
            assert!(p.index() < pages, "free list holds only pages of this pool ({p})");
            assert!(!on_free_list[p.index()], "free list has no duplicates (page {p} twice)");
            on_free_list[p.index()] = true;
        }
        let (mut free, mut leased, mut quarantined, mut cached) = (0, 0, 0, 0);
        for (i, m) in self.meta.iter().enumerate() {
            match m.state {
                PageState::Free => free += 1,
                PageState::Leased(_) => leased += 1,
                PageState::Quarantined(_) => quarantined += 1,
                PageState::Cached { .. } => cached += 1,
            }
            assert!(self.readers[i].is_empty() || matches!(m.state, PageState::Cached { .. }), "only cached pages have readers (page {i})");
            assert_eq!(on_free_list[i], m.state == PageState::Free, "page {i} is on the free list exactly when its state is Free");
            assert!(m.generation.0 <= self.last_generation, "no page generation exceeds the last one handed out (page {i})");
            if m.state != PageState::Free {
                assert!(m.generation.0 > 0, "a leased or quarantined page has been granted a generation (page {i})");
            }
            let wms = &self.watermarks[i * self.layout.layers..(i + 1) * self.layout.layers];
            assert!(wms.iter().all(|&w| w <= self.layout.page_size), "watermarks never exceed page_size (page {i}: {wms:?})");
            if matches!(m.state, PageState::Cached { .. }) {
                assert!(wms.iter().all(|&w| w == self.layout.page_size), "a cached page is full in every layer (page {i}: {wms:?})");
            } else if !matches!(m.state, PageState::Leased(_)) {
                assert!(wms.iter().all(|&w| w == 0), "a page that is not leased has zero watermarks (page {i}: {wms:?})");
            }
        }
        assert_eq!(free, self.free.len(), "free count matches the free list");
        assert_eq!(leased, self.leased, "leased count matches page states");
        assert_eq!(quarantined, self.quarantined, "quarantined count matches page states");
        assert_eq!(cached, self.cached, "cached count matches page states");
        assert_eq!(free + leased + quarantined + cached, pages, "every page is free, leased, quarantined or cached");
        assert_eq!(
            self.leases_granted - self.releases,
            (leased + quarantined + cached) as u64,
            "every granted lease is either still out (leased/quarantined/cached) or released"
        );
        assert_eq!(self.last_generation, self.leases_granted, "one generation per lease granted");
    }
}

/// Appends `src` to `out` as f16 little-endian: on a little-endian host one copy of the
/// slice's bytes (the transfer runs at memory speed), elsewhere element by element.
fn f16_to_le(src: &[f16], out: &mut Vec<u8>) {
    if cfg!(target_endian = "little") {
        out.extend_from_slice(zerocopy::IntoBytes::as_bytes(src));
    } else {
        out.extend(src.iter().flat_map(|x| x.to_bits().to_le_bytes()));
    }
}

/// Fills `dst` from f16 little-endian `bytes` (exactly `2 × dst.len()` of them), the
/// inverse of [`f16_to_le`].
fn f16_from_le(bytes: &[u8], dst: &mut [f16]) {
    if cfg!(target_endian = "little") {
        zerocopy::IntoBytes::as_mut_bytes(dst).copy_from_slice(bytes);
    } else {
        for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
            *d = f16::from_bits(u16::from_le_bytes([b[0], b[1]]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> KvPool {
        let layout = KvLayout { layers: 2, kv_heads: 2, head_dim: 2, page_size: 4 };
        KvPool::new(PoolConfig { layout, pages: 2, checks: KvChecks::all() }).unwrap()
    }

    /// Leases cannot be forged outside this crate, so a live generation with another owner
    /// cannot happen in safe code; the owner check is defence in depth. Forge one here.
    #[test]
    fn a_lease_with_the_right_generation_but_another_owner_is_refused() {
        let mut p = pool();
        let real = p.lease(RequestId(1)).unwrap();
        let forged = Lease { tag: PageTag { owner: RequestId(2), ..real.tag } };
        let stale = Err(KvError::StaleLease { page: real.page(), lease_generation: real.generation(), page_generation: real.generation() });
        let row = [0.5f32; 4];
        assert_eq!(p.write(&forged, 0, 0, &row, &row), stale);
        assert_eq!(p.read(&forged, 0).map(|r| r.len()), stale.clone().map(|()| 0));
        assert_eq!(p.watermark(&forged, 0), stale.clone().map(|()| 0));
        assert_eq!(p.release(forged), stale);
        p.write(&real, 0, 0, &row, &row).unwrap();
        assert_eq!(p.quarantine(Lease { tag: PageTag { owner: RequestId(2), ..real.tag } }).map(|q| q.page()), stale.map(|()| real.page()));
        p.release(real).unwrap();
        p.check_invariants();
    }

    /// A reader checks each read as `read` does (a forged lease is refused; a shared page
    /// is checked against its fence) and adds its counts to the pool's once, when dropped.
    #[test]
    fn a_page_reader_checks_every_read_and_counts_when_dropped() {
        let mut p = pool();
        let row = [0.5f32; 4];
        let own = p.lease(RequestId(1)).unwrap();
        let full = p.lease(RequestId(1)).unwrap();
        for layer in 0..2 {
            p.write(&own, layer, 0, &row, &row).unwrap();
            for slot in 0..4 {
                p.write(&full, layer, slot, &row, &row).unwrap();
            }
        }
        let cached = p.publish(full, Fence([1; 16])).map_err(|(e, _)| e).unwrap();
        let shared = p.share(&cached, RequestId(2), Fence([1; 16])).unwrap();
        let forged = Lease { tag: PageTag { owner: RequestId(2), ..own.tag } };
        let before = p.stats();
        {
            let r = p.reader();
            assert_eq!(r.read(&own, 1).map(|v| v.len()), Ok(1));
            assert_eq!(r.read(&shared, 0).map(|v| v.len()), Ok(4));
            assert!(matches!(r.read(&forged, 0), Err(KvError::StaleLease { .. })));
            assert!(matches!(r.read(&own, 2), Err(KvError::LayerOutOfRange { .. })));
            let now = p.stats();
            assert_eq!(
                (now.reads, now.refusals, now.fence_checks),
                (before.reads, before.refusals, before.fence_checks),
                "counted on drop only"
            );
        }
        let after = p.stats();
        assert_eq!(after.reads - before.reads, 2);
        assert_eq!(after.refusals - before.refusals, 2);
        assert_eq!((after.fence_checks - before.fence_checks, after.fence_failures), (1, 0));
        p.unshare(shared).unwrap();
        p.release(own).unwrap();
        p.check_invariants();
    }

    #[test]
    fn a_quarantine_handle_with_another_owner_is_refused() {
        let mut p = pool();
        let l = p_lease(&mut p);
        let q = p.quarantine(l).unwrap();
        let forged = Quarantined { tag: PageTag { owner: RequestId(9), ..q.tag } };
        assert!(matches!(p.release_quarantined(forged), Err(KvError::StaleLease { .. })));
        p.release_quarantined(q).unwrap();
        p.check_invariants();
    }

    /// A quarantine handle cannot be made for a leased page in safe code; forge one to bite
    /// the state check on `release_quarantined`.
    #[test]
    fn a_quarantine_handle_for_a_page_that_is_leased_is_refused() {
        let mut p = pool();
        let l = p_lease(&mut p);
        let forged = Quarantined { tag: l.tag };
        assert!(matches!(p.release_quarantined(forged), Err(KvError::StaleLease { .. })));
        assert_eq!(p.stats().leased_pages, 1);
        p.release(l).unwrap();
        p.check_invariants();
    }

    fn p_lease(p: &mut KvPool) -> Lease {
        p.lease(RequestId(1)).unwrap()
    }

    #[test]
    fn a_lease_naming_a_page_outside_the_pool_is_refused() {
        let mut p = pool();
        let real = p_lease(&mut p);
        let forged = Lease { tag: PageTag { page: PageId(7), ..real.tag } };
        assert_eq!(p.check(&forged), Err(KvError::PageOutOfRange { page: PageId(7), pages: 2 }));
        p.release(real).unwrap();
    }

    #[test]
    fn storage_layout_puts_one_heads_written_slots_in_one_contiguous_slice() {
        let mut p = pool();
        let l = p_lease(&mut p);
        // row = [head0: (a,b), head1: (c,d)]
        p.write(&l, 1, 0, &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0]).unwrap();
        p.write(&l, 1, 1, &[9.0, 10.0, 11.0, 12.0], &[13.0, 14.0, 15.0, 16.0]).unwrap();
        let page = l.page().index() * p.layout.page_elems();
        let block = p.layout.block_elems(); // 2 heads * 4 slots * 2 = 16
        let k1 = page + 2 * block; // layer 1 K
        let f = |x: f32| f16::from_f32(x);
        assert_eq!(&p.storage[k1..k1 + 4], &[f(1.0), f(2.0), f(9.0), f(10.0)]);
        assert_eq!(&p.storage[k1 + 8..k1 + 12], &[f(3.0), f(4.0), f(11.0), f(12.0)]);
        let v1 = k1 + block;
        assert_eq!(&p.storage[v1 + 8..v1 + 12], &[f(7.0), f(8.0), f(15.0), f(16.0)]);
        p.release(l).unwrap();
    }

    /// A page that held request 1's KV, freed and leased to request 2, with its watermarks
    /// forced up as a watermark bug would: request 2 commits slots it never wrote. Returns
    /// the pool and request 2's sequence with 3 committed positions (only slot 0 written).
    fn stale_read_setup(checks: KvChecks) -> (KvPool, SequenceKv) {
        let layout = KvLayout { layers: 2, kv_heads: 1, head_dim: 2, page_size: 4 };
        let mut p = KvPool::new(PoolConfig { layout, pages: 1, checks }).unwrap();
        let row = [0.25f32; 2];
        let mut first = SequenceKv::new(RequestId(1));
        first.reserve(&mut p, 4).unwrap();
        for layer in 0..2 {
            for slot in 0..3 {
                p.write(first.locate(0).unwrap().0, layer, slot, &row, &row).unwrap();
            }
        }
        first.release(&mut p).unwrap();
        let mut second = SequenceKv::new(RequestId(2));
        second.reserve(&mut p, 4).unwrap();
        for layer in 0..2 {
            p.write(second.locate(0).unwrap().0, layer, 0, &row, &row).unwrap();
        }
        let page = second.pages()[0].page();
        for layer in 0..2 {
            let wm = p.wm_index(page, layer);
            p.watermarks[wm] = 3;
        }
        second.commit(&p, 3).unwrap();
        (p, second)
    }

    #[test]
    fn the_canary_refuses_a_slot_not_written_since_its_page_was_freed() {
        let (p, mut seq) = stale_read_setup(KvChecks { audit: false, ..KvChecks::all() });
        let page = seq.pages()[0].page();
        assert_eq!(p.check_reads(&mut seq), Err(KvError::PoisonedSlot { page, layer: 0, slot: 1 }));
        let st = p.stats();
        assert_eq!((st.poisoned_reads, st.generation_checks, st.audit_violations), (1, 1, 0));
    }

    #[test]
    fn the_auditor_refuses_a_slot_written_by_the_previous_owner() {
        // Without canaries the stale slot holds request 1's real KV: only the auditor sees it.
        let (p, mut seq) = stale_read_setup(KvChecks { canaries: false, ..KvChecks::all() });
        let page = seq.pages()[0].page();
        assert_eq!(
            p.check_reads(&mut seq),
            Err(KvError::AuditViolation {
                page,
                layer: 0,
                slot: 1,
                written_by: RequestId(1),
                written_generation: Generation(1),
                reader: RequestId(2),
                reader_generation: Generation(2),
            })
        );
        assert_eq!((p.stats().audit_violations, p.stats().poisoned_reads), (1, 0));
    }

    #[test]
    fn without_canaries_or_auditor_the_stale_read_goes_unnoticed() {
        // What the two tests above guard against: the remaining checks pass it.
        let (p, mut seq) = stale_read_setup(KvChecks { canaries: false, checksums: true, audit: false });
        assert_eq!(p.check_reads(&mut seq), Ok(()));
    }

    #[test]
    fn faithful_sequences_pass_every_read_check_and_canaries_run_once_per_slot() {
        let layout = KvLayout { layers: 2, kv_heads: 1, head_dim: 2, page_size: 4 };
        let mut p = KvPool::new(PoolConfig { layout, pages: 2, checks: KvChecks::all() }).unwrap();
        let mut seq = SequenceKv::new(RequestId(5));
        seq.reserve(&mut p, 6).unwrap();
        let row = [0.5f32; 2];
        for pos in 0..6 {
            let (lease, slot) = seq.locate(pos).unwrap();
            for layer in 0..2 {
                p.write(lease, layer, slot, &row, &row).unwrap();
            }
        }
        seq.commit(&p, 6).unwrap();
        p.check_reads(&mut seq).unwrap();
        p.check_reads(&mut seq).unwrap();
        let st = p.stats();
        // Two leases checked twice; 6 slots canary-checked once; 6 slots x 2 layers audited twice.
        assert_eq!((st.generation_checks, st.canary_checks, st.audited_slots), (4, 6, 24));
        assert_eq!((st.poisoned_reads, st.audit_violations, st.refusals), (0, 0, 0));
        seq.release(&mut p).unwrap();
    }

    #[test]
    fn a_sequence_whose_page_changed_hands_fails_the_generation_check() {
        let layout = KvLayout { layers: 1, kv_heads: 1, head_dim: 2, page_size: 4 };
        let mut p = KvPool::new(PoolConfig { layout, pages: 1, checks: KvChecks::default() }).unwrap();
        let mut seq = SequenceKv::new(RequestId(1));
        seq.reserve(&mut p, 2).unwrap();
        let page = seq.pages()[0].page();
        for q in p.revoke_owner(RequestId(1)) {
            p.release_quarantined(q).unwrap();
        }
        let _other = p.lease(RequestId(2)).unwrap();
        assert_eq!(
            p.check_reads(&mut seq),
            Err(KvError::StaleLease { page, lease_generation: Generation(1), page_generation: Generation(2) })
        );
    }
}
