//! The handles a [`KvPool`] hands out: each a [`PageTag`] (pool, page, generation, owner)
//! plus one right over the page. [`Lease`]: write and read one's own page; [`Quarantined`]:
//! nothing until the writer is fenced; [`CachedPage`]: the cache's hold on a published page;
//! [`SharedLease`]: read a cached page. None is `Clone`; only the pool makes them.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bulkhead_fingerprint::Fingerprint;

#[cfg(doc)]
use super::KvPool;
use crate::{Fence, Generation, PageId, PoolId, RequestId};

/// What a handle claims about its page: the pool, page, generation and owner. [`Lease`] and
/// [`Quarantined`] are each a tag plus what the holder may do with it, and both dereference
/// to their tag for these accessors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
pub struct PageTag {
    pub(super) pool: PoolId,
    pub(super) page: PageId,
    pub(super) generation: Generation,
    pub(super) owner: RequestId,
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
///
/// # A lease cannot be lost silently
///
/// A lease holds no pool, so its `Drop` cannot give its page back; it can only say that it
/// is gone. It shares its pool's table of held pages and clears its own entry when dropped,
/// and [`KvPool::check_invariants`] fails on any page still leased whose lease is gone (an
/// orphan) and that [`KvPool::revoke_owner`] has not taken back.
///
/// Why an orphan check and not a drop bomb (a panic when an unreleased lease is dropped):
/// dropping leases and then revoking their owner is the documented recovery, used on
/// purpose ([`Unreleased::reclaim`](crate::Unreleased::reclaim), the decode role keeping an
/// unaccountable sequence out of service, the engine and model checker retracting a victim
/// whose stale leases are dropped later), and many tests end with leases still out. A bomb
/// would need an `abandon` at each of those sites in other crates and would still fire on
/// stale leases, which are harmless. The orphan check flags exactly the mistake (a page
/// that nobody can give back and nobody has revoked) wherever `check_invariants` runs:
/// this crate's tests and state-machine model, the protocol tests, and after every fault
/// schedule.
#[must_use = "a dropped lease keeps its page leased; release or quarantine it"]
#[derive(Fingerprint)]
pub struct Lease {
    pub(super) tag: PageTag,
    /// The pool's table of held pages, cleared for this page on drop; `None` only for a
    /// lease forged by a unit test. Not state: it stands for the lease being alive.
    #[fingerprint(skip)]
    holds: Option<Holds>,
}

impl Lease {
    /// The lease of a page just granted, marked held in the pool's table.
    pub(super) fn held(tag: PageTag, holds: &Holds) -> Self {
        holds.hold(tag.page, tag.generation);
        Lease { tag, holds: Some(holds.clone()) }
    }

    /// A lease the pool never granted, for unit tests that bite the checks; it marks nothing.
    #[cfg(test)]
    pub(super) fn forged(tag: PageTag) -> Self {
        Lease { tag, holds: None }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(holds) = &self.holds {
            holds.let_go(self.tag.page, self.tag.generation);
        }
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // As derived before the held-pages table: the tag is all a lease claims.
        f.debug_struct("Lease").field("tag", &self.tag).finish()
    }
}

/// Which pages have their lease alive: entry `page` is the generation of the page's live
/// [`Lease`], 0 once that lease is dropped. The pool marks a page when it grants a lease
/// and a lease clears its own mark when dropped, only if the page has not been leased again
/// since (a stale lease never clears a newer one's mark). Shared (an `Arc`) because a lease
/// outlives every borrow of its pool. Relaxed atomics suffice: whoever reads the table
/// (`check_invariants`) is ordered after a drop on another thread by whatever handed it the
/// pool, as for every other field.
#[derive(Clone)]
pub(super) struct Holds(Arc<[AtomicU64]>);

impl Holds {
    /// A table of `pages` pages, none held.
    pub(super) fn new(pages: usize) -> Self {
        Holds((0..pages).map(|_| AtomicU64::new(0)).collect())
    }

    fn hold(&self, page: PageId, generation: Generation) {
        self.0[page.index()].store(generation.0, Ordering::Relaxed);
    }

    fn let_go(&self, page: PageId, generation: Generation) {
        if let Some(entry) = self.0.get(page.index()) {
            // Fails, and leaves the entry, when the page was leased again since.
            let _ = entry.compare_exchange(generation.0, 0, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// Whether a lease of `page` at `generation` is alive.
    pub(super) fn is_held(&self, page: PageId, generation: Generation) -> bool {
        self.0[page.index()].load(Ordering::Relaxed) == generation.0
    }
}

/// A page taken out of service until its writer is fenced (design I4): neither free nor
/// readable nor writable. Not `Clone`; [`KvPool::release_quarantined`] consumes it.
#[must_use = "a dropped quarantine handle keeps its page out of service forever"]
#[derive(Debug, Fingerprint)]
pub struct Quarantined {
    pub(super) tag: PageTag,
}

/// The cache's hold on a published page (design I7): the page is full, read-only, and
/// belongs to one fence. Not `Clone`; only [`KvPool::publish`] makes one and only
/// [`KvPool::evict`] consumes it. Its tag's owner is the request that wrote the page.
#[must_use = "a dropped cache handle keeps its page cached forever"]
#[derive(Debug, Fingerprint)]
pub struct CachedPage {
    pub(super) tag: PageTag,
    pub(super) fence: Fence,
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
    pub(super) tag: PageTag,
    pub(super) writer: RequestId,
    pub(super) fence: Fence,
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
    pub(super) fn tag(&self) -> &PageTag {
        match self {
            PageHandle::Own(l) => &l.tag,
            PageHandle::Shared(l) => &l.tag,
        }
    }

    /// Who the auditor expects to have written the page's slots in this generation.
    pub(super) fn writer(&self) -> RequestId {
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
