//! Keys of the prefix cache (design I7): what makes a cached page findable, by whom.
//!
//! The gateway holds a secret nobody outside the cluster knows ([`CacheSecret`], derived
//! from the cluster key, or random per run). For each request it derives a [`CacheScope`]
//! from the secret, the tenant (from the API key, never from the body) and the request's
//! `cache_salt`. The scope is the BLAKE3 key under which every page's [`PageKey`] is
//! computed, chaining the parent page's key, the model digest and the page's tokens: the
//! tenant and the salt are in every page's key, not only the first, and nobody without
//! the secret can compute or guess a key. The pool's [`Fence`] of the scope is checked on
//! every shared read, so even a wrong key reaches no other tenant's page.

use bulkhead_fingerprint::Fingerprint;
use bulkhead_kv::{Fence, PageKey};

use crate::auth::ClusterKey;

const SECRET_CONTEXT: &str = "bulkhead 2026-12 prefix cache secret v1";
const FENCE_LABEL: &[u8] = b"bulkhead fence v1";
const PAGE_LABEL: &[u8] = b"bulkhead page v1";

/// The cluster's secret for cache keys. Only the gateway needs it.
#[derive(Clone)]
pub struct CacheSecret([u8; 32]);

impl std::fmt::Debug for CacheSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CacheSecret(..)")
    }
}

impl CacheSecret {
    /// The secret of a cluster with key `cluster_key` (a separate derivation, so it reveals
    /// nothing about the key).
    pub fn from_cluster_key(cluster_key: &ClusterKey) -> Self {
        CacheSecret(cluster_key.derive(SECRET_CONTEXT))
    }

    /// A secret from random bytes (a cluster without a key: one per gateway run).
    pub fn from_random(bytes: [u8; 32]) -> Self {
        CacheSecret(bytes)
    }

    /// The scope of `tenant`'s requests with `salt`. The fields are length-prefixed, so no
    /// (tenant, salt) pair can be spelled as another.
    pub fn scope(&self, tenant: &str, salt: Option<&str>) -> CacheScope {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(&(tenant.len() as u64).to_le_bytes());
        h.update(tenant.as_bytes());
        match salt {
            None => h.update(&[0]),
            Some(s) => h.update(&[1]).update(&(s.len() as u64).to_le_bytes()).update(s.as_bytes()),
        };
        CacheScope(*h.finalize().as_bytes())
    }
}

/// The cache scope of one (tenant, salt): the key of its page keys. Travels from the
/// gateway to the prefill worker with each request.
#[derive(Clone, Copy, PartialEq, Eq, Fingerprint)]
pub struct CacheScope(pub [u8; 32]);

impl std::fmt::Debug for CacheScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CacheScope(..)")
    }
}

impl CacheScope {
    /// The fence the pool checks on every shared read of this scope's pages.
    pub fn fence(&self) -> Fence {
        let h = blake3::keyed_hash(&self.0, FENCE_LABEL);
        let mut f = [0; 16];
        f.copy_from_slice(&h.as_bytes()[..16]);
        Fence(f)
    }

    /// The keys of the full pages of `tokens` (a partial last page has none), each chaining
    /// its parent's key, under this scope and the model with digest `model_digest`.
    pub fn page_keys(&self, model_digest: u64, tokens: &[u32], page_size: usize) -> Vec<PageKey> {
        let mut keys = Vec::with_capacity(tokens.len() / page_size.max(1));
        let mut parent = [0u8; 16];
        for page in tokens.chunks_exact(page_size.max(1)) {
            let mut h = blake3::Hasher::new_keyed(&self.0);
            h.update(PAGE_LABEL).update(&model_digest.to_le_bytes()).update(&parent);
            for t in page {
                h.update(&t.to_le_bytes());
            }
            parent.copy_from_slice(&h.finalize().as_bytes()[..16]);
            keys.push(PageKey(parent));
        }
        keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_differ_by_tenant_salt_model_and_every_earlier_token_and_only_full_pages_have_one() {
        let s = CacheSecret::from_random([7; 32]);
        let toks: Vec<u32> = (0..10).collect();
        let a = s.scope("a", None).page_keys(1, &toks, 4);
        assert_eq!(a.len(), 2, "10 tokens are two full pages and a partial one");
        assert_eq!(a, s.scope("a", None).page_keys(1, &toks[..8], 4), "a key depends on its prefix only");
        for other in [s.scope("b", None), s.scope("a", Some("")), s.scope("a", Some("x"))] {
            let o = other.page_keys(1, &toks, 4);
            // The scope is in every page's key, not only the first.
            assert!(a.iter().zip(&o).all(|(x, y)| x != y));
            assert_ne!(other.fence(), s.scope("a", None).fence());
        }
        assert_ne!(a, s.scope("a", None).page_keys(2, &toks, 4));
        let mut changed = toks.clone();
        changed[0] = 99;
        assert_ne!(a[1], s.scope("a", None).page_keys(1, &changed, 4)[1], "the second key chains the first page");
        // Length prefixes: ("ab", "c") is not ("a", "bc").
        assert_ne!(s.scope("ab", Some("c")).fence(), s.scope("a", Some("bc")).fence());
        // Another secret, other keys.
        assert_ne!(a, CacheSecret::from_random([8; 32]).scope("a", None).page_keys(1, &toks, 4));
        assert_ne!(CacheSecret::from_cluster_key(&ClusterKey::from_bytes([1; 32])).0, [1; 32]);
    }

    #[test]
    fn debug_output_names_the_type_and_never_the_bytes() {
        let s = CacheSecret::from_random([0xab; 32]);
        assert_eq!(format!("{s:?}"), "CacheSecret(..)");
        assert_eq!(format!("{:?}", s.scope("t", None)), "CacheScope(..)");
    }
}
