//! Small copyable identifiers: pages, generations, requests and pools.

use std::fmt;

use bulkhead_fingerprint::{Fingerprint, Fingerprinter};
use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident($inner:ty)) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(pub $inner);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    };
}

id_type!(
    /// Index of a page inside one [`KvPool`](crate::KvPool), `0..pages`.
    PageId(u32)
);
id_type!(
    /// Allocation tag of a page (design I1). Every lease of a page gets a generation
    /// strictly greater than any earlier one of that page, so a lease kept past its
    /// release no longer matches the page and is refused.
    Generation(u64)
);
id_type!(
    /// The request that owns a lease.
    RequestId(u64)
);
id_type!(
    /// Process-unique identity of one [`KvPool`](crate::KvPool); a lease carries the id
    /// of the pool that granted it, so it is refused by every other pool.
    PoolId(u64)
);

/// The (tenant, cache salt) scope a cached page belongs to, as a digest the gateway
/// derives with the cluster's secret (design I7). The pool compares fences and never
/// interprets them: a page written under one fence is never shared under another.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Fingerprint)]
pub struct Fence(pub [u8; 16]);

/// Name of one full page of tokens in a prefix cache: a keyed hash chaining the page's
/// tokens, its parent's key and its fence (computed outside this crate). Equal keys mean
/// equal content under the same fence, up to the hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Fingerprint)]
pub struct PageKey(pub [u8; 16]);

impl PageId {
    /// The page as an index into per-page tables.
    pub(crate) fn index(self) -> usize {
        // u32 -> usize is lossless on every target this crate builds for (>= 32-bit).
        self.0 as usize
    }
}

impl Fingerprint for PageId {
    fn fingerprint(&self, h: &mut Fingerprinter) {
        self.0.fingerprint(h);
    }
}

impl Fingerprint for RequestId {
    fn fingerprint(&self, h: &mut Fingerprinter) {
        self.0.fingerprint(h);
    }
}

/// Renamed in order of first appearance: the pool only compares generations for equality
/// and draws each fresh one above all earlier ones.
impl Fingerprint for Generation {
    fn fingerprint(&self, h: &mut Fingerprinter) {
        h.generation(self.0);
    }
}

/// Nothing: every replay makes new pools, and a pool id is only compared with its own
/// worker's pool.
impl Fingerprint for PoolId {
    fn fingerprint(&self, _: &mut Fingerprinter) {}
}

/// Next pool id; starts at 1 and only grows, so no two pools in a process share an id.
static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

impl PoolId {
    /// A fresh id never handed out before in this process.
    pub(crate) fn fresh() -> Self {
        PoolId(NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed))
    }
}
