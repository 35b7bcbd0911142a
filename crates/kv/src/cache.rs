//! [`PrefixCache`]: full pages of earlier prompts, kept read-only in the pool and shared
//! with later requests of the same fence (design I7).
//!
//! Entries are named by chained [`PageKey`]s, so an entry stands for its whole prefix: the
//! map of keys is a radix tree over pages (a key's parent is the entry before it). The
//! keys are computed outside this crate; this crate does not trust them. A hit is
//! granted only through [`KvPool::share`], which compares the requester's [`Fence`] with
//! the page's, so a wrong key (a hash bug, a forged salt) reaches no other tenant's page.
//!
//! Eviction takes least-recently-used entries without children and without readers (the
//! pool refuses the rest), so a cached prefix never loses its middle.

use bulkhead_fingerprint::Fingerprint;
use std::collections::HashMap;

use crate::pool::{CachedPage, SharedLease};
use crate::{Fence, KvError, KvPool, PageKey, RequestId, SeqPage, SequenceKv};

#[derive(Debug, Fingerprint)]
struct Entry {
    page: CachedPage,
    parent: Option<PageKey>,
    children: usize,
    last_used: u64,
}

/// What a cache did, for metrics and for the router's index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Prompt tokens looked up (vLLM's `prefix_cache_queries`).
    pub query_tokens: u64,
    /// Prompt tokens found cached and shared (vLLM's `prefix_cache_hits`).
    pub hit_tokens: u64,
    /// Pages published.
    pub stored_pages: u64,
    /// Pages evicted.
    pub evicted_pages: u64,
    /// Lookups refused by the pool's fence check (a key that led to another tenant's
    /// page): each failed its request.
    pub fence_refusals: u64,
}

/// The prefix cache of one pool. See the module docs.
#[derive(Fingerprint)]
pub struct PrefixCache {
    entries: HashMap<PageKey, Entry>,
    /// Most pages it keeps; more are evicted at once.
    max_pages: usize,
    clock: u64,
    #[fingerprint(skip)]
    stats: CacheStats,
    /// Keys stored and evicted since [`PrefixCache::take_changes`], for the router.
    stored: Vec<PageKey>,
    evicted: Vec<PageKey>,
}

/// Entries in key order: two caches with equal contents print alike whatever their hash
/// maps' iteration order (logs and the model checker's counterexample dumps).
impl std::fmt::Debug for PrefixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let entries: std::collections::BTreeMap<&PageKey, &Entry> = self.entries.iter().collect();
        f.debug_struct("PrefixCache")
            .field("entries", &entries)
            .field("max_pages", &self.max_pages)
            .field("clock", &self.clock)
            .field("stats", &self.stats)
            .field("stored", &self.stored)
            .field("evicted", &self.evicted)
            .finish()
    }
}

impl PrefixCache {
    /// An empty cache keeping at most `max_pages` pages.
    pub fn new(max_pages: usize) -> Self {
        PrefixCache { entries: HashMap::new(), max_pages, clock: 0, stats: CacheStats::default(), stored: Vec::new(), evicted: Vec::new() }
    }

    /// Most pages it keeps.
    pub fn max_pages(&self) -> usize {
        self.max_pages
    }

    /// Pages it holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// What it did so far.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Whether `key` is cached.
    pub fn contains(&self, key: &PageKey) -> bool {
        self.entries.contains_key(key)
    }

    /// Every cached key, in key order: a snapshot for a router that starts listening.
    pub fn keys(&self) -> Vec<PageKey> {
        let mut keys: Vec<PageKey> = self.entries.keys().copied().collect();
        keys.sort_unstable();
        keys
    }

    /// Keys stored and evicted since the last call (each list in order).
    pub fn take_changes(&mut self) -> (Vec<PageKey>, Vec<PageKey>) {
        (std::mem::take(&mut self.stored), std::mem::take(&mut self.evicted))
    }

    /// The longest cached run of `keys` from the first, shared read-only to `reader` under
    /// `fence`, at most `max_pages` pages. `prompt_tokens` is what the lookup counts as
    /// queried. A fence mismatch on any page gives every page of this lookup back and
    /// fails it: the request must not run.
    pub fn lookup(
        &mut self,
        pool: &mut KvPool,
        keys: &[PageKey],
        max_pages: usize,
        reader: RequestId,
        fence: Fence,
        prompt_tokens: usize,
    ) -> Result<Vec<SharedLease>, KvError> {
        self.stats.query_tokens += prompt_tokens as u64;
        self.clock += 1;
        let mut shared = Vec::new();
        for key in keys.iter().take(max_pages) {
            let Some(e) = self.entries.get_mut(key) else { break };
            match pool.share(&e.page, reader, fence) {
                Ok(lease) => {
                    e.last_used = self.clock;
                    shared.push(lease);
                }
                Err(err) => {
                    if matches!(err, KvError::FenceMismatch { .. }) {
                        self.stats.fence_refusals += 1;
                    }
                    for lease in shared {
                        // Granted just now by the same pool: they are live.
                        let _ = pool.unshare(lease);
                    }
                    return Err(err);
                }
            }
        }
        self.stats.hit_tokens += (shared.len() * pool.layout().page_size) as u64;
        Ok(shared)
    }

    /// Evicts least-recently-used pages nobody reads until the pool has `free` free pages
    /// (or nothing more can go). Returns how many were evicted.
    pub fn make_room(&mut self, pool: &mut KvPool, free: usize) -> usize {
        let mut n = 0;
        while pool.stats().free_pages < free && self.evict_one(pool) {
            n += 1;
        }
        n
    }

    /// Evicts the least recently used leaf without readers; false if there is none.
    fn evict_one(&mut self, pool: &mut KvPool) -> bool {
        let victim = self
            .entries
            .iter()
            .filter(|(_, e)| e.children == 0 && pool.readers(&e.page) == 0)
            .min_by_key(|(k, e)| (e.last_used, **k))
            .map(|(k, _)| *k);
        let Some(key) = victim else { return false };
        let Some(e) = self.entries.remove(&key) else { return false };
        if let Err((_, page)) = pool.evict(e.page) {
            // Readers were checked just now; keep the entry rather than lose the page.
            self.entries.insert(key, Entry { page, ..e });
            return false;
        }
        if let Some(parent) = e.parent.and_then(|p| self.entries.get_mut(&p)) {
            parent.children -= 1;
        }
        self.stats.evicted_pages += 1;
        self.evicted.push(key);
        true
    }

    /// Publishes the own full pages of a live sequence's first `pages` (its verified prompt's)
    /// under `fence` (`keys[i]` names page `i`) and keeps reading each through a shared
    /// lease of its owner instead of its lease, so later requests of the scope (the
    /// siblings of `n > 1`) share them while it still runs. Stops at the first page it
    /// cannot publish (its key cached already, or its parent not, the cache full, a partial
    /// page), so the shared pages stay a prefix and the rest stays the sequence's own.
    /// Returns the pages published.
    pub fn publish_prefix(&mut self, pool: &mut KvPool, seq: &mut SequenceKv, keys: &[PageKey], pages: usize, fence: Fence) -> usize {
        self.clock += 1;
        let mut published = 0;
        loop {
            let i = seq.shared_pages();
            let parent = i.checked_sub(1).map(|p| keys.get(p));
            let reachable = match parent {
                None => true,
                Some(Some(p)) => self.entries.contains_key(p),
                Some(None) => false,
            };
            let Some(&key) = keys.get(i).filter(|k| i < pages && reachable && !self.entries.contains_key(k)) else { return published };
            if self.entries.len() >= self.max_pages && !self.evict_one(pool) {
                return published;
            }
            let clock = self.clock;
            let mut entry = None;
            let turned = seq.share_first_own(|lease| {
                let (page, shared) = pool.publish_and_keep(lease, fence).map_err(|(_, lease)| lease)?;
                entry = Some(Entry { page, parent: parent.flatten().copied(), children: 0, last_used: clock });
                Ok(shared)
            });
            if let Some(e) = entry {
                if let Some(p) = e.parent.and_then(|p| self.entries.get_mut(&p)) {
                    p.children += 1;
                }
                self.entries.insert(key, e);
                self.stats.stored_pages += 1;
                self.stored.push(key);
                published += 1;
            }
            if turned != Some(Ok(())) {
                return published;
            }
        }
    }

    /// Ends a sequence: its own full pages whose key is not cached yet are published under
    /// `fence` (`keys[i]` names page `i`), everything else goes back to the pool (own pages
    /// released, shared ones unshared). Returns the pages published.
    pub fn finish(&mut self, pool: &mut KvPool, seq: SequenceKv, keys: &[PageKey], fence: Fence) -> usize {
        self.clock += 1;
        let mut published = 0;
        for (i, page) in seq.into_pages().into_iter().enumerate() {
            let lease = match page {
                SeqPage::Shared(lease) => {
                    let _ = pool.unshare(lease);
                    continue;
                }
                SeqPage::Own(lease) => lease,
            };
            // Only a chain of cached parents makes a reachable entry.
            let parent = i.checked_sub(1).map(|p| keys.get(p));
            let reachable = match parent {
                None => true,
                Some(Some(p)) => self.entries.contains_key(p),
                Some(None) => false,
            };
            let key = keys.get(i).filter(|k| reachable && !self.entries.contains_key(k));
            while key.is_some() && self.entries.len() >= self.max_pages && self.evict_one(pool) {}
            let Some(&key) = key.filter(|_| self.entries.len() < self.max_pages) else {
                let _ = pool.release(lease);
                continue;
            };
            match pool.publish(lease, fence) {
                Ok(page) => {
                    let parent = parent.flatten().copied();
                    if let Some(p) = parent.and_then(|p| self.entries.get_mut(&p)) {
                        p.children += 1;
                    }
                    self.entries.insert(key, Entry { page, parent, children: 0, last_used: self.clock });
                    self.stats.stored_pages += 1;
                    self.stored.push(key);
                    published += 1;
                }
                // Not full (the partial last page): never shared.
                Err((_, lease)) => {
                    let _ = pool.release(lease);
                }
            }
        }
        published
    }
}
