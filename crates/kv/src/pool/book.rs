//! The pool's bookkeeping: who holds each page. This is where a page is leased
//! ([`KvPool::lease`], `grant`), released, quarantined and freed once fenced, revoked,
//! published to a prefix cache, shared and evicted, and where every handle is verified
//! before any access. It never touches K/V bytes: a freed page is scrubbed by
//! `storage.rs`, and reads and writes live there.
//!
//! # The allocator's invariants
//!
//! Each holds after every public call. `verify` enforces the access rules on every call;
//! [`KvPool::check_invariants`] asserts the rest from the pool's state (after every step of
//! the state-machine test, in the protocol tests and after every fault schedule).
//! - **One state per page**: free (and on the free list exactly once), leased to one
//!   request, quarantined, or cached. So no page is ever in two leases (I1).
//! - **Generations only grow**: every lease draws a fresh one from one pool-wide counter
//!   (`last_generation == leases_granted`), so each earlier handle of the page is stale (I1).
//! - **No access without a live handle**: `verify` passes only a handle of this pool, at
//!   the page's generation, in the state the access needs, of the page's owner; a shared
//!   lease must also match the page's fence and still be among its readers (I1, I7).
//! - **Watermarks are zero unless the page is leased, and full if cached**: freeing and
//!   quarantining reset them, so nothing written in an earlier generation is readable (I2).
//! - **Quarantine is not free**: a quarantined page is neither read, written nor leased
//!   until `release_quarantined`, so a late write cannot land in a reused page (I4).
//! - **Only cached pages have readers, and a cached page with readers is never evicted**:
//!   a shared lease always reads the page it was granted (I7).
//! - **Every grant is accounted for**: granted = released + leased + quarantined + cached.
//! - **A lease cannot be lost silently**: a leased page's lease is alive, or the page has
//!   been revoked; [`Lease`] says why this is checked here rather than by a drop bomb.

use std::sync::atomic::Ordering;

use super::{CachedPage, KvPool, Lease, PageHandle, PageTag, Quarantined, SharedLease};
use crate::{Fence, Generation, KvError, PageId, RequestId};

/// Who holds a page (see the invariants above).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PageState {
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
pub(super) enum Want {
    Leased,
    Quarantined,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct PageMeta {
    pub(super) state: PageState,
    /// Generation of the latest lease of this page (0: never leased).
    pub(super) generation: Generation,
}

/// Where a cached page's fence check (I7) is counted: at once in the pool's statistics, or
/// by a [`PageReader`](super::PageReader).
pub(super) trait FenceCount {
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

impl KvPool {
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
        Lease::held(PageTag { pool: self.id, page, generation, owner }, &self.holds)
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
    pub(super) fn verify(&self, tag: &PageTag, want: Want) -> Result<(), KvError> {
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
    pub(super) fn verify_handle(&self, h: PageHandle<'_>, count: &impl FenceCount) -> Result<(), KvError> {
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

    /// Returns the page to the free list, its bytes scrubbed first (watermarks zeroed,
    /// storage poisoned if configured).
    fn free_page(&mut self, page: PageId) {
        self.scrub(page);
        self.meta[page.index()].state = PageState::Free;
        self.free.push(page);
        self.releases += 1;
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
            if let PageState::Leased(owner) = m.state {
                // A lease cannot be lost silently (see `Lease`): only revoke_owner may take a
                // page whose lease was dropped.
                assert!(
                    self.holds.is_held(PageId(i as u32), m.generation),
                    "page {i} is leased to request {owner} at generation {} but its Lease is gone: dropped without release, quarantine or revoke_owner",
                    m.generation
                );
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

#[cfg(test)]
mod tests {
    use super::super::tests::{p_lease, pool};
    use super::*;

    /// Leases cannot be forged outside this crate, so a live generation with another owner
    /// cannot happen in safe code; the owner check is defence in depth. Forge one here.
    #[test]
    fn a_lease_with_the_right_generation_but_another_owner_is_refused() {
        let mut p = pool();
        let real = p.lease(RequestId(1)).unwrap();
        let forged = Lease::forged(PageTag { owner: RequestId(2), ..real.tag });
        let stale = Err(KvError::StaleLease { page: real.page(), lease_generation: real.generation(), page_generation: real.generation() });
        let row = [0.5f32; 4];
        assert_eq!(p.write(&forged, 0, 0, &row, &row), stale);
        assert_eq!(p.read(&forged, 0).map(|r| r.len()), stale.clone().map(|()| 0));
        assert_eq!(p.watermark(&forged, 0), stale.clone().map(|()| 0));
        assert_eq!(p.release(forged), stale);
        p.write(&real, 0, 0, &row, &row).unwrap();
        assert_eq!(p.quarantine(Lease::forged(PageTag { owner: RequestId(2), ..real.tag })).map(|q| q.page()), stale.map(|()| real.page()));
        p.release(real).unwrap();
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

    #[test]
    fn a_lease_naming_a_page_outside_the_pool_is_refused() {
        let mut p = pool();
        let real = p_lease(&mut p);
        let forged = Lease::forged(PageTag { page: PageId(7), ..real.tag });
        assert_eq!(p.check(&forged), Err(KvError::PageOutOfRange { page: PageId(7), pages: 2 }));
        p.release(real).unwrap();
    }
}
