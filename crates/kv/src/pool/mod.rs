//! [`KvPool`]: the page allocator and the only place KV bytes live.
//!
//! - `handles`: what callers hold, [`Lease`], [`Quarantined`], [`CachedPage`] and
//!   [`SharedLease`], each a [`PageTag`] plus one right over the page.
//! - `book`: the bookkeeping, who holds each page: where a page is leased, released,
//!   quarantined, revoked, cached and shared, the checks every handle passes, and the
//!   allocator's invariants (stated at its top, asserted by [`KvPool::check_invariants`]).
//! - `storage`: the bytes: writes, reads ([`PageRead`], [`PageReader`]), the checks before
//!   a forward step, export and import in the transfer layout, [`POISON`].
//!
//! Here: the pool itself (its fields, shared by both halves), its construction and its
//! statistics ([`PoolStats`]).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use half::f16;

use crate::{Generation, KvChecks, KvError, KvLayout, PageId, PoolConfig, PoolId, RequestId};

mod book;
mod elems;
mod handles;
mod storage;

use book::{PageMeta, PageState};
use elems::Elems;
use handles::Holds;
pub use handles::{CachedPage, Lease, PageHandle, PageTag, Quarantined, SharedLease};
pub use storage::{POISON, PageRead, PageReader};
use storage::{SlotTag, UNWRITTEN};

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

/// The page allocator and the only place KV bytes live.
///
/// Invariants (asserted by [`KvPool::check_invariants`]; each with its reason at the top of
/// `src/pool/book.rs`):
/// - every page is exactly one of free (on the free list once), leased, quarantined,
///   cached;
/// - only cached pages have readers, and a cached page with readers is never evicted;
/// - a page's generation only grows, and each lease gets a fresh one (I1);
/// - a page's per-layer watermarks count slots written in its current generation, and are
///   zero unless the page is leased or cached (then full), so nothing written earlier is
///   ever readable (I2);
/// - a leased page's [`Lease`] is alive until the page is given back or revoked.
pub struct KvPool {
    id: PoolId,
    layout: KvLayout,
    checks: KvChecks,
    // The bytes (`storage.rs`): storage, watermarks, shadow. Who holds each page (`book.rs`):
    // meta, holds, free, readers and the page counts. The counters are bumped by both.
    /// `pages * page_elems` elements; page `p` at `[p * page_elems..]`.
    storage: Elems,
    meta: Vec<PageMeta>,
    /// Which pages' leases are alive, shared with those leases (see [`Lease`]).
    holds: Holds,
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
    /// Makes a pool of `cfg.pages` free pages. Storage is allocated and written up front, so
    /// running out of address space is an error, not an abort.
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

        let fill = if cfg.checks.canaries { POISON } else { f16::ZERO };
        let storage = Elems::new(elems, fill).ok_or(KvError::OutOfMemory { bytes })?;
        let mut shadow = Vec::new();
        shadow
            .try_reserve_exact(shadow_len)
            .map_err(|_| KvError::OutOfMemory { bytes: shadow_len.saturating_mul(std::mem::size_of::<SlotTag>()) })?;
        shadow.resize(shadow_len, UNWRITTEN);

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
            holds: Holds::new(cfg.pages),
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
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn pool() -> KvPool {
        let layout = KvLayout { layers: 2, kv_heads: 2, head_dim: 2, page_size: 4 };
        KvPool::new(PoolConfig { layout, pages: 2, checks: KvChecks::all() }).unwrap()
    }

    pub(super) fn p_lease(p: &mut KvPool) -> Lease {
        p.lease(RequestId(1)).unwrap()
    }
}
