//! Shape of a page ([`KvLayout`]) and pool configuration ([`PoolConfig`]).

use crate::KvError;

/// Shape of one page's storage. Storage dtype is f16 ([`half::f16`]).
///
/// One page holds `page_size` consecutive token positions of one sequence, for every
/// layer, K and V. Storage order inside a page is
/// `[layer][K then V][kv_head][slot 0..page_size][head_dim]`, so the written slots of one
/// head of one layer are one contiguous slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Transformer layers.
    pub layers: usize,
    /// Key/value heads per layer.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Token slots per page.
    pub page_size: usize,
}

impl KvLayout {
    /// Elements of one token's K (or V) for one layer: `kv_heads * head_dim`.
    pub fn row_elems(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Bytes of KV one token needs: K and V, every layer, f16 (2 bytes each).
    pub fn bytes_per_token(&self) -> usize {
        2 * self.layers * self.row_elems() * 2
    }

    /// Elements of one K (or V) block of one layer of one page: `kv_heads * page_size * head_dim`.
    pub fn block_elems(&self) -> usize {
        self.kv_heads * self.page_size * self.head_dim
    }

    /// Elements of one whole page: every layer, K and V, every slot.
    pub fn page_elems(&self) -> usize {
        2 * self.layers * self.block_elems()
    }

    /// Pages needed to hold `tokens` positions (rounded up).
    ///
    /// # Panics
    /// If `page_size` is zero; [`KvLayout::validate`] (run by `KvPool::new`) refuses such layouts.
    pub fn pages_for_tokens(&self, tokens: usize) -> usize {
        assert!(self.page_size > 0, "KvLayout::page_size must be > 0 (validate the layout first)");
        tokens.div_ceil(self.page_size)
    }

    /// Checks every dimension is non-zero and that one page's size in bytes fits in `usize`.
    pub fn validate(&self) -> Result<(), KvError> {
        for (field, value) in
            [("layers", self.layers), ("kv_heads", self.kv_heads), ("head_dim", self.head_dim), ("page_size", self.page_size)]
        {
            if value == 0 {
                return Err(KvError::ZeroDimension { field });
            }
        }
        // bytes of one page = 2 (K,V) * layers * kv_heads * page_size * head_dim * 2 bytes.
        [self.layers, self.kv_heads, self.page_size, self.head_dim, 2]
            .iter()
            .try_fold(2usize, |acc, &x| acc.checked_mul(x))
            .map(|_| ())
            .ok_or(KvError::TooLarge { pages: 1, layout: *self })
    }
}

/// Configuration of a [`KvPool`](crate::KvPool).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Shape of every page.
    pub layout: KvLayout,
    /// Number of pages; the pool holds `pages * layout.page_size` tokens.
    pub pages: usize,
    /// Which of the optional integrity checks run.
    pub checks: KvChecks,
}

/// The integrity checks a pool runs besides the ones that always run (lease generation,
/// owner, watermark). The first two are on in production ([`KvChecks::default`]); turning
/// them off exists only to measure what they cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvChecks {
    /// Canaries: fill a page with [`POISON`](crate::POISON) whenever it returns to the free
    /// list, and refuse to let attention read a slot that still holds it
    /// ([`KvPool::check_reads`](crate::KvPool::check_reads)).
    pub canaries: bool,
    /// Checksum every transferred chunk (xxh3-64, non-cryptographic: it catches corruption,
    /// not forgery) at the sender and verify it at the receiver.
    pub checksums: bool,
    /// The KV auditor: a shadow tag (owner, generation) for every written slot, checked for
    /// every slot a sequence is about to attend to. Costs 16 bytes per slot per layer.
    pub audit: bool,
}

impl Default for KvChecks {
    /// Production: canaries and checksums on, auditor off.
    fn default() -> Self {
        KvChecks { canaries: true, checksums: true, audit: false }
    }
}

impl KvChecks {
    /// Every check on, auditor included: what tests run with.
    pub fn all() -> Self {
        KvChecks { canaries: true, checksums: true, audit: true }
    }
}
