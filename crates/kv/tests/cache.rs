//! Shared pages and the prefix cache (design I7): a cached page is read-only, readable
//! only under its fence, never evicted while read, and stale once evicted.

use bulkhead_kv::{Fence, KvChecks, KvError, KvLayout, KvPool, PageKey, PoolConfig, PrefixCache, RequestId, SequenceKv};

const LAYOUT: KvLayout = KvLayout { layers: 2, kv_heads: 1, head_dim: 2, page_size: 4 };
const PS: usize = 4;
const T1: Fence = Fence([1; 16]);
const T2: Fence = Fence([2; 16]);

fn pool(pages: usize) -> KvPool {
    KvPool::new(PoolConfig { layout: LAYOUT, pages, checks: KvChecks::all() }).unwrap()
}

/// A sequence of `req` with `tokens` positions written (value `seed` everywhere).
fn written(pool: &mut KvPool, req: RequestId, tokens: usize, seed: f32) -> SequenceKv {
    let mut seq = SequenceKv::new(req);
    seq.reserve(pool, tokens).unwrap();
    for pos in 0..tokens {
        let (lease, slot) = seq.locate(pos).unwrap();
        for layer in 0..LAYOUT.layers {
            pool.write(lease, layer, slot, &[seed, seed], &[seed, seed]).unwrap();
        }
    }
    seq.commit(pool, tokens).unwrap();
    seq
}

/// One full page written by `req` (value `seed`) and published under `T1`.
fn published(pool: &mut KvPool, req: RequestId, seed: f32) -> bulkhead_kv::CachedPage {
    let seq = written(pool, req, PS, seed);
    let Some(bulkhead_kv::SeqPage::Own(lease)) = seq.into_pages().pop() else { panic!("one own page") };
    pool.publish(lease, T1).unwrap()
}

fn key(n: u8) -> PageKey {
    PageKey([n; 16])
}

#[test]
fn a_full_page_is_published_shared_under_its_fence_only_and_read_only() {
    let mut p = pool(4);
    let seq = written(&mut p, RequestId(1), PS + 1, 7.0);
    let mut pages = seq.into_pages().into_iter();
    let (Some(bulkhead_kv::SeqPage::Own(full)), Some(bulkhead_kv::SeqPage::Own(partial))) = (pages.next(), pages.next()) else {
        panic!("two own pages")
    };
    // The partial page cannot be published: only full pages are ever shared.
    let (err, partial) = p.publish(partial, T1).unwrap_err();
    assert!(matches!(err, KvError::NotFull { .. }), "{err}");
    p.release(partial).unwrap();
    let cached = p.publish(full, T1).unwrap();

    // Another tenant's request, led to this page by whatever key, is refused and counted.
    let before = p.stats();
    let err = p.share(&cached, RequestId(2), T2).unwrap_err();
    assert_eq!(err, KvError::FenceMismatch { page: cached.page() });
    assert_eq!(p.stats().fence_failures, before.fence_failures + 1);
    assert_eq!(p.stats().shared_leases, 0);

    // The same tenant reads it, through a sequence whose first page it is.
    let shared = p.share(&cached, RequestId(3), T1).unwrap();
    assert_eq!(p.read(&shared, 0).unwrap().len(), PS);
    let mut seq = SequenceKv::new(RequestId(3));
    seq.attach_shared(&p, vec![shared]).unwrap();
    seq.reserve(&mut p, PS + 2).unwrap();
    assert_eq!((seq.len(), seq.shared_tokens()), (PS, PS));
    // Nothing can write a shared position: the sequence hands out no writable lease there.
    assert_eq!(seq.locate(1).unwrap_err(), KvError::ReadOnly { pos: 1 });
    let (own, slot) = seq.locate(PS).unwrap();
    p.write(own, 0, slot, &[1.0, 1.0], &[1.0, 1.0]).unwrap();
    p.write(own, 1, slot, &[1.0, 1.0], &[1.0, 1.0]).unwrap();
    seq.commit(&p, 1).unwrap();
    // Every read check passes on the shared prefix: generation, fence, canary, auditor.
    let fence_checks = p.stats().fence_checks;
    p.check_reads(&mut seq).unwrap();
    assert!(p.stats().fence_checks > fence_checks, "the per-step check compares the fence");
    assert_eq!(p.stats().audit_violations, 0);
    p.check_invariants();

    // Not evictable while read; evictable once given back, and then stale.
    let (err, cached) = p.evict(cached).unwrap_err();
    assert_eq!(err, KvError::InUse { page: cached.page(), readers: 1 });
    assert_eq!(seq.release(&mut p).unwrap(), 2);
    let page = cached.page();
    let shared_again = p.share(&cached, RequestId(4), T1).unwrap();
    p.unshare(shared_again).unwrap();
    p.evict(cached).unwrap();
    assert!(p.page_is_poisoned(page).unwrap(), "an evicted page is poisoned like any freed page");
    assert_eq!(p.stats().cached_pages, 0);
    p.check_invariants();
}

#[test]
fn an_evicted_page_reused_by_another_tenant_fails_every_old_shared_lease() {
    let mut p = pool(1);
    let cached = published(&mut p, RequestId(1), 1.0);
    let reader = p.share(&cached, RequestId(2), T1).unwrap();
    // A reader that lost its share (revoked) is stale at once.
    drop(p.revoke_owner(RequestId(2)));
    assert!(matches!(p.read(&reader, 0), Err(KvError::StaleLease { .. })));
    p.evict(cached).unwrap();
    let other = written(&mut p, RequestId(3), PS, 9.0);
    // The old handle names the cached generation; the page has a new one.
    assert!(matches!(p.read(&reader, 0), Err(KvError::StaleLease { .. })));
    assert!(p.stats().refusals > 0);
    other.release(&mut p).unwrap();
    p.check_invariants();
}

/// The cache's key is computed outside the pool. With a key that leaves the tenant out
/// (a hash bug, or a salt a client chose), two tenants' prompts get the same key: the
/// pool's fence check still refuses the hit, and the request fails instead of reading.
#[test]
fn a_key_that_collides_across_tenants_is_caught_by_the_fence_check() {
    let mut p = pool(4);
    let mut cache = PrefixCache::new(4);
    let keys = [key(1), key(2)];
    let seq = written(&mut p, RequestId(1), 2 * PS, 3.0);
    assert_eq!(cache.finish(&mut p, seq, &keys, T1), 2);
    let err = cache.lookup(&mut p, &keys, 2, RequestId(2), T2, 2 * PS + 1).unwrap_err();
    assert!(matches!(err, KvError::FenceMismatch { .. }), "{err}");
    assert_eq!(cache.stats().fence_refusals, 1);
    assert_eq!(cache.stats().hit_tokens, 0);
    assert_eq!(p.stats().shared_leases, 0, "a refused lookup holds nothing");
    // The owner's own tenant still hits.
    let hit = cache.lookup(&mut p, &keys, 2, RequestId(3), T1, 2 * PS + 1).unwrap();
    assert_eq!(hit.len(), 2);
    for l in hit {
        p.unshare(l).unwrap();
    }
    p.check_invariants();
}

#[test]
fn the_cache_keeps_full_pages_hits_the_longest_prefix_and_evicts_lru_leaves_nobody_reads() {
    let mut p = pool(6);
    let mut cache = PrefixCache::new(6);
    // Three full pages and a partial one: three published, the partial released.
    let seq = written(&mut p, RequestId(1), 3 * PS + 2, 1.0);
    let a = [key(1), key(2), key(3), key(4)];
    assert_eq!(cache.finish(&mut p, seq, &a, T1), 3);
    assert_eq!((cache.len(), p.stats().cached_pages, p.stats().free_pages), (3, 3, 3));
    // A prompt sharing the first two pages only.
    let b = [key(1), key(2), key(9)];
    let hit = cache.lookup(&mut p, &b, 3, RequestId(2), T1, 3 * PS).unwrap();
    assert_eq!(hit.len(), 2);
    let mut seq = SequenceKv::new(RequestId(2));
    seq.attach_shared(&p, hit).unwrap();
    // Pressure: the request needs all free pages and more. Only the unread leaf (key 3)
    // can go; the pages it reads and their parents stay.
    assert_eq!(cache.make_room(&mut p, 6), 1);
    assert!(!cache.contains(&key(3)) && cache.contains(&key(1)) && cache.contains(&key(2)));
    assert_eq!(cache.take_changes(), (vec![key(1), key(2), key(3)], vec![key(3)]));
    seq.reserve(&mut p, 2 * PS + 6 * PS).unwrap_err();
    seq.reserve(&mut p, 2 * PS + 4 * PS).unwrap();
    assert_eq!(seq.release(&mut p).unwrap(), 6);
    // Nobody reads now: everything can go, leaves first.
    assert_eq!(cache.make_room(&mut p, 6), 2);
    assert!(cache.is_empty());
    assert_eq!(p.stats().free_pages, 6);
    assert_eq!(cache.stats().evicted_pages, 3);
    p.check_invariants();
}

#[test]
fn a_full_cache_makes_room_for_new_pages_by_evicting_old_ones() {
    let mut p = pool(4);
    let mut cache = PrefixCache::new(2);
    let seq = written(&mut p, RequestId(1), 2 * PS, 1.0);
    assert_eq!(cache.finish(&mut p, seq, &[key(1), key(2)], T1), 2);
    let seq = written(&mut p, RequestId(2), 2 * PS, 2.0);
    assert_eq!(cache.finish(&mut p, seq, &[key(5), key(6)], T2), 2);
    assert_eq!(cache.len(), 2);
    assert!(cache.contains(&key(5)) && cache.contains(&key(6)));
    p.check_invariants();
}

/// What the counters and accessors say is what happened (I6: the evidence must be right).
#[test]
fn the_cache_and_the_pool_count_exactly_what_they_did() {
    let mut p = pool(8);
    let mut cache = PrefixCache::new(5);
    assert_eq!(cache.max_pages(), 5);
    assert!(cache.is_empty());
    let keys = [key(1), key(2), key(3)];
    let seq = written(&mut p, RequestId(1), 3 * PS, 1.0);
    assert_eq!(cache.finish(&mut p, seq, &keys, T1), 3);
    assert!(!cache.is_empty());
    assert_eq!((cache.stats().stored_pages, p.stats().published), (3, 3));
    let hit = cache.lookup(&mut p, &keys, 2, RequestId(2), T1, 3 * PS).unwrap();
    assert_eq!((cache.stats().query_tokens, cache.stats().hit_tokens), ((3 * PS) as u64, (2 * PS) as u64));
    let _ = cache.lookup(&mut p, &keys[..1], 1, RequestId(3), T1, 5).map(|h| h.into_iter().for_each(|l| p.unshare(l).unwrap()));
    assert_eq!((cache.stats().query_tokens, cache.stats().hit_tokens), ((3 * PS + 5) as u64, (3 * PS) as u64));
    assert_eq!((p.stats().shares, p.stats().shared_leases), (3, 2));
    for l in hit {
        p.unshare(l).unwrap();
    }
    // Five free pages; asking for six evicts exactly one, the leaf (key 3): the other two
    // have a child each, though all three are equally old.
    assert_eq!(cache.make_room(&mut p, 6), 1);
    assert!(cache.contains(&key(1)) && cache.contains(&key(2)) && !cache.contains(&key(3)));
    assert_eq!((cache.stats().evicted_pages, p.stats().evictions), (1, 1));
    // Enough free already: nothing more goes.
    assert_eq!(cache.make_room(&mut p, 6), 0);
    p.check_invariants();
}

/// The least recently used page is evicted first, but never one somebody reads: the read
/// page is skipped and the next one goes.
#[test]
fn eviction_skips_the_pages_being_read_even_when_they_are_the_oldest() {
    let mut p = pool(3);
    let mut cache = PrefixCache::new(3);
    let seq = written(&mut p, RequestId(1), PS, 1.0);
    cache.finish(&mut p, seq, &[key(1)], T1);
    // Key 1 is older (its hit came before key 2 was published), but read.
    let reading = cache.lookup(&mut p, &[key(1)], 1, RequestId(3), T1, PS).unwrap();
    let seq = written(&mut p, RequestId(2), PS, 2.0);
    cache.finish(&mut p, seq, &[key(2)], T1);
    let seq = written(&mut p, RequestId(4), PS, 3.0);
    // The seq holds the third page; the cache must give one back for another page.
    assert_eq!(cache.make_room(&mut p, 1), 1);
    assert!(cache.contains(&key(1)) && !cache.contains(&key(2)));
    seq.release(&mut p).unwrap();
    reading.into_iter().for_each(|l| p.unshare(l).unwrap());
    p.check_invariants();
}

/// A cache at its limit whose pages are all read cannot make room: a new page goes back to
/// the pool instead of growing the cache past its limit. A page already cached is not
/// published twice (its second copy goes back to the pool).
#[test]
fn a_full_cache_that_cannot_evict_stays_within_its_limit_and_never_holds_a_key_twice() {
    let mut p = pool(4);
    let mut cache = PrefixCache::new(1);
    let seq = written(&mut p, RequestId(1), PS, 1.0);
    cache.finish(&mut p, seq, &[key(1)], T1);
    let reading = cache.lookup(&mut p, &[key(1)], 1, RequestId(2), T1, PS).unwrap();
    let seq = written(&mut p, RequestId(3), PS, 2.0);
    assert_eq!(cache.finish(&mut p, seq, &[key(5)], T1), 0);
    assert_eq!((cache.len(), p.stats().cached_pages), (1, 1));
    reading.into_iter().for_each(|l| p.unshare(l).unwrap());
    // The same prompt computed again (a cache that was off for it): one copy is kept.
    let seq = written(&mut p, RequestId(4), PS, 1.0);
    assert_eq!(cache.finish(&mut p, seq, &[key(1)], T1), 0);
    assert_eq!((cache.len(), p.stats().cached_pages, p.stats().free_pages), (1, 1, 3));
    p.check_invariants();
}

/// A shared lease from before an eviction stays stale even when the same writer publishes
/// the same page again and the same reader shares it anew: the generation differs.
#[test]
fn a_shared_lease_of_an_earlier_generation_is_stale_whoever_writes_the_page_again() {
    let mut p = pool(1);
    let cached = published(&mut p, RequestId(1), 1.0);
    let old = p.share(&cached, RequestId(2), T1).unwrap();
    drop(p.revoke_owner(RequestId(2)));
    p.evict(cached).unwrap();
    let cached = published(&mut p, RequestId(1), 2.0);
    let new = p.share(&cached, RequestId(2), T1).unwrap();
    assert!(matches!(p.read(&old, 0), Err(KvError::StaleLease { .. })));
    assert_eq!(p.read(&new, 0).unwrap().len(), PS);
    p.unshare(new).unwrap();
    p.check_invariants();
}

/// Least recently used goes first: by when a page was published or last hit, whatever its
/// key; and of a chain published at once, the leaf, never a parent.
#[test]
fn eviction_takes_the_least_recently_used_leaf() {
    let mut p = pool(5);
    let mut cache = PrefixCache::new(5);
    // A chain of three pages published together: the leaf goes first, although the
    // parents are as old and their keys sort first.
    let seq = written(&mut p, RequestId(1), 3 * PS, 1.0);
    cache.finish(&mut p, seq, &[key(1), key(2), key(3)], T1);
    assert_eq!(cache.make_room(&mut p, 3), 1);
    assert!(!cache.contains(&key(3)) && cache.contains(&key(2)));
    // Key 9 published after the chain, then key 1 hit: key 2 (touched with the chain's
    // publication only) is now the oldest leaf, before key 9.
    let seq = written(&mut p, RequestId(2), PS, 2.0);
    cache.finish(&mut p, seq, &[key(9)], T1);
    let hit = cache.lookup(&mut p, &[key(1)], 1, RequestId(3), T1, PS).unwrap();
    hit.into_iter().for_each(|l| p.unshare(l).unwrap());
    assert_eq!(cache.make_room(&mut p, 3), 1);
    assert!(!cache.contains(&key(2)) && cache.contains(&key(9)) && cache.contains(&key(1)));
    // Then key 9 (published before key 1's hit), then key 1.
    assert_eq!(cache.make_room(&mut p, 4), 1);
    assert!(!cache.contains(&key(9)) && cache.contains(&key(1)));
    // Of two pages published one after the other, the first goes first (after key 1,
    // hit before both).
    let seq = written(&mut p, RequestId(4), PS, 3.0);
    cache.finish(&mut p, seq, &[key(8)], T1);
    let seq = written(&mut p, RequestId(5), PS, 4.0);
    cache.finish(&mut p, seq, &[key(7)], T1);
    assert_eq!(cache.make_room(&mut p, 4), 2);
    assert!(!cache.contains(&key(1)) && !cache.contains(&key(8)) && cache.contains(&key(7)));
    p.check_invariants();
}

/// Two caches built the same way print the same (the model checker fingerprints this
/// text): entries come out in key order, not in their hash maps' per-instance order.
#[test]
fn equal_caches_print_alike() {
    let keys: Vec<PageKey> = (0..16).map(key).collect();
    let print = || {
        let mut p = pool(16);
        let mut cache = PrefixCache::new(16);
        let seq = written(&mut p, RequestId(1), 16 * PS, 1.0);
        assert_eq!(cache.finish(&mut p, seq, &keys, T1), 16);
        // Pool ids differ per pool (the checker drops them too).
        let text = format!("{cache:?}");
        text.split("PoolId(").map(|s| s.trim_start_matches(|c: char| c.is_ascii_digit())).collect::<Vec<_>>().join("PoolId(")
    };
    assert_eq!(print(), print());
}

/// A live sequence's full prompt pages published while it runs (the siblings of `n > 1`):
/// it keeps reading them, now through shared leases, a sibling of the same fence shares
/// them at once, another fence cannot, and they cannot be evicted while either reads them;
/// the partial page stays its own. When both end, the pages stay cached for later requests.
#[test]
fn a_running_sequence_publishes_its_full_prompt_pages_and_keeps_reading_them() {
    let mut p = pool(8);
    let mut cache = PrefixCache::new(8);
    let mut seq = written(&mut p, RequestId(1), 2 * PS + 1, 5.0);
    let keys = [key(1), key(2), key(3)];
    assert_eq!(cache.publish_prefix(&mut p, &mut seq, &keys, 2, T1), 2, "both full pages, not the partial one");
    assert_eq!((seq.shared_pages(), seq.len()), (2, 2 * PS + 1), "shared in place; the committed length did not move");
    assert!(!seq.pages()[2].is_shared(), "the partial page stays its own");
    p.check_reads(&mut seq).unwrap();
    let (lease, _) = seq.locate_page(0).unwrap();
    assert_eq!(p.read(lease, 1).unwrap().k_head(0)[0].to_f32(), 5.0, "it reads the same KV through its shared lease");
    assert!(matches!(seq.locate(0), Err(KvError::ReadOnly { .. })), "and can no longer write it");
    // Published again (a second call) changes nothing: the keys are cached.
    assert_eq!(cache.publish_prefix(&mut p, &mut seq, &keys, 2, T1), 0);

    assert!(matches!(cache.lookup(&mut p, &keys, 2, RequestId(3), T2, 2 * PS), Err(KvError::FenceMismatch { .. })));
    let sibling = cache.lookup(&mut p, &keys, 2, RequestId(2), T1, 2 * PS + 1).unwrap();
    assert_eq!(sibling.len(), 2, "a sibling shares both at once");
    assert_eq!(cache.make_room(&mut p, 8), 0, "nothing is evicted while read");
    sibling.into_iter().for_each(|l| p.unshare(l).unwrap());
    assert_eq!(cache.finish(&mut p, seq, &keys, T1), 0, "nothing new to publish at the end");
    assert_eq!((cache.len(), p.stats().cached_pages, p.stats().shared_leases), (2, 2, 0));
}
