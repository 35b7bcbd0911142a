//! [`SequenceKv`]: the ordered pages of one sequence and how many of its tokens are committed.

use crate::pool::{PageHandle, PageTag, SharedLease};
use crate::{KvError, KvPool, Lease, PoolId, Quarantined, RequestId};
use bulkhead_fingerprint::Fingerprint;

/// One page of a sequence: its own, which it writes, or a cached one it shares read-only
/// (design I7). Shared pages always come first: they hold a cached prefix.
#[derive(Debug, Fingerprint)]
pub enum SeqPage {
    /// Leased to the sequence's request.
    Own(Lease),
    /// A prefix-cache page, read-only.
    Shared(SharedLease),
}

impl SeqPage {
    /// The handle reads go through.
    pub fn handle(&self) -> PageHandle<'_> {
        match self {
            SeqPage::Own(l) => PageHandle::Own(l),
            SeqPage::Shared(l) => PageHandle::Shared(l),
        }
    }

    /// The shared lease, if the page is one.
    pub fn into_shared(self) -> Option<SharedLease> {
        match self {
            SeqPage::Shared(l) => Some(l),
            SeqPage::Own(_) => None,
        }
    }

    /// Whether the page is shared (read-only).
    pub fn is_shared(&self) -> bool {
        matches!(self, SeqPage::Shared(_))
    }
}

impl std::ops::Deref for SeqPage {
    type Target = PageTag;
    fn deref(&self) -> &PageTag {
        match self {
            SeqPage::Own(l) => l,
            SeqPage::Shared(l) => l,
        }
    }
}

impl<'a> From<&'a SeqPage> for PageHandle<'a> {
    fn from(p: &'a SeqPage) -> Self {
        p.handle()
    }
}

/// The pool a sequence took its pages from, fixed at its first [`SequenceKv::reserve`].
#[derive(Clone, Copy, Debug, Fingerprint)]
struct Binding {
    pool: PoolId,
    page_size: usize,
}

/// The pages of one sequence in order; position `p` lives in page `p / page_size`, slot
/// `p % page_size`. A cached prefix comes first as shared pages, then its own pages.
///
/// Not `Clone`: it owns its leases. Give it back with [`SequenceKv::release`] or
/// [`SequenceKv::quarantine`]; dropping it leaves its pages leased (recover them with
/// [`KvPool::revoke_owner`]; until then [`KvPool::check_invariants`] reports them, see
/// [`Lease`]).
#[derive(Debug, Fingerprint)]
pub struct SequenceKv {
    owner: RequestId,
    pages: Vec<SeqPage>,
    binding: Option<Binding>,
    /// Tokens whose KV is written in every layer; always <= reserved tokens.
    committed: usize,
    /// Positions `0..canary_checked` passed the pool's canary check (see
    /// [`KvPool::check_reads`]); always <= committed.
    canary_checked: usize,
}

impl SequenceKv {
    /// An empty sequence owned by `owner`, bound to no pool yet.
    pub fn new(owner: RequestId) -> Self {
        SequenceKv { owner, pages: Vec::new(), binding: None, committed: 0, canary_checked: 0 }
    }

    /// The request this sequence's pages are leased to.
    pub fn owner(&self) -> RequestId {
        self.owner
    }

    /// Tokens whose KV is written in all layers (committed).
    pub fn len(&self) -> usize {
        self.committed
    }

    /// No token committed.
    pub fn is_empty(&self) -> bool {
        self.committed == 0
    }

    pub(crate) fn canary_checked(&self) -> usize {
        self.canary_checked
    }

    /// Hands the sequence's first own page to `f`, which either turns it into a shared
    /// lease on the same page (published, and shared back to this sequence's owner) or gives
    /// the lease back unchanged. Shared pages stay a prefix, and the page keeps its place
    /// and its KV, so the committed length does not move. `None`: no own page left.
    pub(crate) fn share_first_own(&mut self, f: impl FnOnce(Lease) -> Result<SharedLease, Lease>) -> Option<Result<(), ()>> {
        let i = self.pages.iter().position(|p| !p.is_shared())?;
        let SeqPage::Own(lease) = self.pages.remove(i) else { return None };
        let (page, turned) = match f(lease) {
            Ok(shared) => (SeqPage::Shared(shared), Ok(())),
            Err(lease) => (SeqPage::Own(lease), Err(())),
        };
        self.pages.insert(i, page);
        Some(turned)
    }

    pub(crate) fn set_canary_checked(&mut self, n: usize) {
        self.canary_checked = n.min(self.committed);
    }

    /// The pages, in position order.
    pub fn pages(&self) -> &[SeqPage] {
        &self.pages
    }

    /// Tokens held in shared (cached, read-only) pages: the sequence's first ones.
    pub fn shared_tokens(&self) -> usize {
        self.binding.map_or(0, |b| self.shared_pages() * b.page_size)
    }

    /// Shared (cached, read-only) pages: the sequence's first ones.
    pub fn shared_pages(&self) -> usize {
        self.pages.iter().take_while(|p| p.is_shared()).count()
    }

    /// Token positions the pages can hold.
    pub fn reserved_tokens(&self) -> usize {
        self.binding.map_or(0, |b| self.pages.len() * b.page_size)
    }

    /// Starts an empty sequence with a cached prefix: `shared` pages, full and committed.
    /// They must come from `pool` and be shared to this sequence's owner.
    pub fn attach_shared(&mut self, pool: &KvPool, shared: Vec<SharedLease>) -> Result<(), Vec<SharedLease>> {
        let ok = self.pages.is_empty() && shared.iter().all(|l| l.pool() == pool.id() && l.owner() == self.owner);
        if !ok {
            return Err(shared);
        }
        let page_size = pool.layout().page_size;
        self.committed = shared.len() * page_size;
        self.pages.extend(shared.into_iter().map(SeqPage::Shared));
        self.binding = Some(Binding { pool: pool.id(), page_size });
        Ok(())
    }

    /// Takes the pages out, for a caller that gives each back its own way (a prefix cache
    /// publishing the full ones).
    pub fn into_pages(self) -> Vec<SeqPage> {
        self.pages
    }

    /// Leases pages so that `tokens` positions fit; all or nothing. Never shrinks. A sequence
    /// takes all its pages from one pool; another pool gives [`KvError::ForeignLease`].
    pub fn reserve(&mut self, pool: &mut KvPool, tokens: usize) -> Result<(), KvError> {
        if let Some(b) = self.binding
            && b.pool != pool.id()
        {
            return Err(KvError::ForeignLease { lease_pool: b.pool, pool: pool.id() });
        }
        let need = pool.layout().pages_for_tokens(tokens);
        if need > self.pages.len() {
            // lease_many is all or nothing, so a failure leaves this sequence unchanged.
            let fresh = pool.lease_many(self.owner, need - self.pages.len())?;
            self.pages.extend(fresh.into_iter().map(SeqPage::Own));
        }
        self.binding = Some(Binding { pool: pool.id(), page_size: pool.layout().page_size });
        Ok(())
    }

    /// The page holding position `pos` and the slot within it; an error if `pos` is not
    /// reserved.
    pub fn locate_page(&self, pos: usize) -> Result<(&SeqPage, usize), KvError> {
        let not_reserved = KvError::NotReserved { pos, reserved: self.reserved_tokens() };
        let Some(b) = self.binding else {
            return Err(not_reserved);
        };
        match self.pages.get(pos / b.page_size) {
            Some(page) => Ok((page, pos % b.page_size)),
            None => Err(not_reserved),
        }
    }

    /// The writable lease holding position `pos` and the slot within its page; an error if
    /// `pos` is not reserved or lies in a shared page.
    pub fn locate(&self, pos: usize) -> Result<(&Lease, usize), KvError> {
        match self.locate_page(pos)? {
            (SeqPage::Own(lease), slot) => Ok((lease, slot)),
            (SeqPage::Shared(_), _) => Err(KvError::ReadOnly { pos }),
        }
    }

    /// Marks `n` more tokens as written in all layers, after the forward pass wrote them.
    /// Checks the pool's watermarks: every layer of every page must cover the new positions.
    /// On error nothing is committed.
    pub fn commit(&mut self, pool: &KvPool, n: usize) -> Result<(), KvError> {
        let reserved = self.reserved_tokens();
        let end = self.committed.saturating_add(n);
        if end > reserved {
            return Err(KvError::NotReserved { pos: end - 1, reserved });
        }
        let Some(Binding { page_size, .. }) = self.binding else {
            // Nothing reserved, so end == 0: nothing to commit.
            return Ok(());
        };
        let mut pos = self.committed;
        while pos < end {
            let (lease, slot) = self.locate_page(pos)?;
            let page_start = pos - slot;
            // End (exclusive) of [pos, end) inside this page.
            let page_end = end.min(page_start + page_size);
            let need = page_end - page_start; // slots that must be written in this page
            for layer in 0..pool.layout().layers {
                let watermark = pool.watermark(lease, layer)?;
                // I2: commit only what every layer really wrote in this generation.
                if watermark < need {
                    return Err(KvError::NotWritten { pos: page_start + watermark.max(slot), layer, page: lease.page(), watermark });
                }
            }
            pos = page_end;
        }
        self.committed = end;
        Ok(())
    }

    /// Moves the written extent back to `len` tokens, in one step: the committed length, and
    /// every own page's watermarks past it ([`KvPool::unwrite`]: poisoned again with
    /// canaries, untagged with the auditor), and the canary-checked mark, so a slot written
    /// again is checked again. What a speculative step wrote for drafts it rejected becomes
    /// as unreadable as a page that was never written: a read stops at the watermark, a
    /// commit over it fails with [`KvError::NotWritten`]. The pages stay reserved.
    /// `len` may not reach into the shared (cached) prefix nor past the committed length;
    /// on error nothing moved.
    pub fn roll_back(&mut self, pool: &mut KvPool, len: usize) -> Result<(), KvError> {
        if len > self.committed || len < self.shared_tokens() {
            return Err(KvError::BadRollBack { to: len, committed: self.committed, shared: self.shared_tokens() });
        }
        let Some(Binding { page_size, .. }) = self.binding else { return Ok(()) };
        self.check_all(pool)?;
        // Every own page from the one holding `len` on, reserved ones past the committed
        // length too: a forward pass that failed may have written there without committing.
        for (i, page) in self.pages.iter().enumerate().skip(len / page_size) {
            if let SeqPage::Own(lease) = page {
                pool.unwrite(lease, len.saturating_sub(i * page_size))?;
            }
        }
        self.committed = len;
        self.canary_checked = self.canary_checked.min(len);
        Ok(())
    }

    /// Gives every own page back to the free list and every shared one back to the cache;
    /// returns how many pages. All handles are checked first, so on error nothing was given
    /// back and the sequence comes back inside the error, its own pages still leased to
    /// this owner (see [`Unreleased::reclaim`]).
    pub fn release(self, pool: &mut KvPool) -> Result<usize, Unreleased> {
        if let Err(error) = self.check_all(pool) {
            return Err(Unreleased { error, seq: self });
        }
        let n = self.pages.len();
        for page in self.pages {
            // Checked above, and nothing changed the pool since: cannot fail.
            let released = match page {
                SeqPage::Own(lease) => pool.release(lease),
                SeqPage::Shared(lease) => pool.unshare(lease),
            };
            assert!(released.is_ok(), "a checked lease is released: {released:?}");
        }
        Ok(n)
    }

    /// Quarantines every own page instead of freeing it (I4: a writer may still be in
    /// flight); shared pages, which nobody writes, go back to the cache. All handles are
    /// checked first, so on error nothing was quarantined and the sequence comes back
    /// inside the error.
    pub fn quarantine(self, pool: &mut KvPool) -> Result<Vec<Quarantined>, Unreleased> {
        if let Err(error) = self.check_all(pool) {
            return Err(Unreleased { error, seq: self });
        }
        let mut out = Vec::with_capacity(self.pages.len());
        for page in self.pages {
            match page {
                SeqPage::Own(lease) => match pool.quarantine(lease) {
                    Ok(q) => out.push(q),
                    Err(e) => unreachable!("a checked lease is quarantined: {e}"),
                },
                SeqPage::Shared(lease) => {
                    if let Err(e) = pool.unshare(lease) {
                        unreachable!("a checked shared lease is given back: {e}")
                    }
                }
            }
        }
        Ok(out)
    }

    fn check_all(&self, pool: &KvPool) -> Result<(), KvError> {
        self.pages.iter().try_for_each(|page| pool.check(page))
    }
}

/// A sequence whose pages could not be given back (a lease no longer matches its page),
/// returned with the reason so that its pages cannot leak unnoticed.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct Unreleased {
    /// Why.
    pub error: KvError,
    /// The sequence, untouched: every page it still holds is leased to its owner.
    pub seq: SequenceKv,
}

impl Unreleased {
    /// Takes back every page still leased to the sequence's owner, whatever its handles
    /// say ([`KvPool::revoke_owner`]), and frees them, and drops its shared leases: for
    /// callers that know no writer can still reach those pages. Returns the pages freed.
    pub fn reclaim(self, pool: &mut KvPool) -> usize {
        let owner = self.seq.owner();
        drop(self.seq);
        let mut n = 0;
        for q in pool.revoke_owner(owner) {
            if pool.release_quarantined(q).is_ok() {
                n += 1;
            }
        }
        n
    }
}
