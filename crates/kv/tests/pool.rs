//! Behaviour of `KvPool`: leases, isolation checks, watermarks, poisoning, quarantine.

use bulkhead_kv::{Generation, KvChecks, KvError, KvLayout, KvPool, POISON, PageId, PoolConfig, RequestId, SequenceKv};

const LAYOUT: KvLayout = KvLayout { layers: 2, kv_heads: 2, head_dim: 3, page_size: 4 };
const ROW: usize = 6; // kv_heads * head_dim
const A: RequestId = RequestId(1);
const B: RequestId = RequestId(2);

fn pool(pages: usize, poison: bool) -> KvPool {
    KvPool::new(PoolConfig { layout: LAYOUT, pages, checks: KvChecks { canaries: poison, ..KvChecks::all() } }).unwrap()
}

fn row(seed: f32) -> Vec<f32> {
    (0..ROW).map(|i| seed + i as f32 * 0.25).collect()
}

fn stale(page: PageId, lease_generation: Generation, page_generation: Generation) -> KvError {
    KvError::StaleLease { page, lease_generation, page_generation }
}

#[test]
fn layout_sizes_follow_the_shape() {
    assert_eq!(LAYOUT.row_elems(), 6);
    assert_eq!(LAYOUT.bytes_per_token(), 2 * 2 * 6 * 2);
    assert_eq!(LAYOUT.page_elems(), 2 * 2 * 6 * 4);
    assert_eq!(LAYOUT.pages_for_tokens(0), 0);
    assert_eq!(LAYOUT.pages_for_tokens(4), 1);
    assert_eq!(LAYOUT.pages_for_tokens(5), 2);
    // SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64 -> 23,040 bytes per token in f16.
    let smol = KvLayout { layers: 30, kv_heads: 3, head_dim: 64, page_size: 16 };
    assert_eq!(smol.bytes_per_token(), 23_040);
}

#[test]
fn a_pool_with_zero_pages_or_a_zero_dimension_is_refused() {
    let cfg = |layout, pages| PoolConfig { layout, pages, checks: KvChecks { canaries: false, ..KvChecks::all() } };
    assert_eq!(KvPool::new(cfg(LAYOUT, 0)).err(), Some(KvError::NoPages));
    for (field, layout) in [
        ("layers", KvLayout { layers: 0, ..LAYOUT }),
        ("kv_heads", KvLayout { kv_heads: 0, ..LAYOUT }),
        ("head_dim", KvLayout { head_dim: 0, ..LAYOUT }),
        ("page_size", KvLayout { page_size: 0, ..LAYOUT }),
    ] {
        assert_eq!(KvPool::new(cfg(layout, 1)).err(), Some(KvError::ZeroDimension { field }));
    }
}

#[test]
#[cfg(target_pointer_width = "64")]
fn a_pool_too_large_for_memory_is_an_error_not_an_abort() {
    let huge = KvLayout { layers: 1, kv_heads: 1, head_dim: 1 << 31, page_size: 1 };
    let cfg = |pages| PoolConfig { layout: huge, pages, checks: KvChecks { canaries: false, ..KvChecks::all() } };
    // 2^30 pages * 2^32 elements * 2 bytes = 2^63 bytes > isize::MAX: allocator refuses.
    assert_eq!(KvPool::new(cfg(1 << 30)).err(), Some(KvError::OutOfMemory { bytes: 1 << 63 }));
    // Element count overflows usize.
    assert!(matches!(KvPool::new(cfg(1 << 33)).err(), Some(KvError::TooLarge { .. })));
    // Page ids are u32.
    let tiny = KvLayout { layers: 1, kv_heads: 1, head_dim: 1, page_size: 1 };
    let r = KvPool::new(PoolConfig { layout: tiny, pages: (1 << 32) + 1, checks: KvChecks { canaries: false, ..KvChecks::all() } });
    assert!(matches!(r.err(), Some(KvError::TooLarge { .. })));
}

#[test]
fn a_new_pool_is_all_free_and_reports_its_capacity() {
    let p = pool(3, true);
    assert_eq!(p.capacity_tokens(), 12);
    assert_eq!(p.layout(), &LAYOUT);
    let s = p.stats();
    assert_eq!((s.total_pages, s.free_pages, s.leased_pages, s.quarantined_pages), (3, 3, 0, 0));
    p.check_invariants();
}

#[test]
fn generations_strictly_increase_on_every_lease_of_a_page() {
    let mut p = pool(1, false);
    let mut last = Generation(0);
    for _ in 0..5 {
        let l = p.lease(A).unwrap();
        assert_eq!(l.page(), PageId(0));
        assert_eq!(l.owner(), A);
        assert!(l.generation() > last);
        last = l.generation();
        p.release(l).unwrap();
        p.check_invariants();
    }
}

#[test]
fn a_page_is_never_leased_twice_at_once() {
    let mut p = pool(2, false);
    let a = p.lease(A).unwrap();
    let b = p.lease(B).unwrap();
    assert_ne!(a.page(), b.page());
    assert_eq!(p.lease(A).err(), Some(KvError::Exhausted { requested: 1, free: 0 }));
    p.release(a).unwrap();
    p.release(b).unwrap();
    p.check_invariants();
}

/// Bites the generation compare: same page, same owner, page Leased, only the generation differs.
#[test]
fn a_lease_kept_past_revoke_and_re_lease_to_the_same_owner_is_refused() {
    let mut p = pool(1, false);
    let old = p.lease(A).unwrap();
    p.write(&old, 0, 0, &row(1.0), &row(2.0)).unwrap();
    for q in p.revoke_owner(A) {
        p.release_quarantined(q).unwrap();
    }
    let new = p.lease(A).unwrap();
    assert_eq!((new.page(), new.owner()), (old.page(), old.owner()));
    let err = stale(old.page(), old.generation(), new.generation());

    assert_eq!(p.read(&old, 0).err(), Some(err.clone()));
    assert_eq!(p.watermark(&old, 0).err(), Some(err.clone()));
    assert_eq!(p.write(&old, 0, 0, &row(3.0), &row(3.0)).err(), Some(err.clone()));
    assert_eq!(p.check(&old).err(), Some(err.clone()));
    // The new lease is untouched by the refused write and sees nothing of the old generation.
    assert_eq!(p.watermark(&new, 0), Ok(0));
    assert!(p.read(&new, 0).unwrap().is_empty());
    assert_eq!(p.quarantine(old).err(), Some(err.clone()));
    assert_eq!(p.stats().leased_pages, 1);
    p.check_invariants();
    p.release(new).unwrap();
    p.check_invariants();
}

#[test]
fn releasing_a_lease_kept_past_its_page_being_re_leased_is_refused_and_leaves_the_page_leased() {
    let mut p = pool(1, false);
    let old = p.lease(A).unwrap();
    for q in p.revoke_owner(A) {
        p.release_quarantined(q).unwrap();
    }
    let new = p.lease(B).unwrap();
    let err = stale(old.page(), old.generation(), new.generation());
    assert_eq!(p.release(old).err(), Some(err));
    assert_eq!(p.stats().leased_pages, 1);
    p.write(&new, 0, 0, &row(1.0), &row(1.0)).unwrap();
    p.release(new).unwrap();
    p.check_invariants();
}

/// Bites the state == Leased check: generation and owner still match, only the state differs.
#[test]
fn a_revoked_lease_is_refused_while_its_page_is_quarantined() {
    let mut p = pool(2, false);
    let l = p.lease(A).unwrap();
    p.write(&l, 0, 0, &row(1.0), &row(2.0)).unwrap();
    let qs = p.revoke_owner(A);
    assert_eq!(qs.len(), 1);
    assert_eq!((qs[0].page(), qs[0].generation(), qs[0].owner()), (l.page(), l.generation(), A));
    let err = stale(l.page(), l.generation(), l.generation());
    assert_eq!(p.read(&l, 0).err(), Some(err.clone()));
    assert_eq!(p.watermark(&l, 0).err(), Some(err.clone()));
    assert_eq!(p.write(&l, 0, 1, &row(1.0), &row(2.0)).err(), Some(err.clone()));
    let s = p.stats();
    assert_eq!((s.free_pages, s.leased_pages, s.quarantined_pages), (1, 0, 1));
    p.check_invariants();
    // Once free, still refused.
    for q in qs {
        p.release_quarantined(q).unwrap();
    }
    assert_eq!(p.read(&l, 0).err(), Some(err.clone()));
    assert_eq!(p.release(l).err(), Some(err));
    assert_eq!(p.stats().free_pages, 2);
    p.check_invariants();
}

#[test]
fn a_quarantined_page_is_neither_free_nor_leasable_until_released() {
    let mut p = pool(1, true);
    let l = p.lease(A).unwrap();
    p.write(&l, 0, 0, &row(1.0), &row(2.0)).unwrap();
    let q = p.quarantine(l).unwrap();
    assert_eq!(p.lease(B).err(), Some(KvError::Exhausted { requested: 1, free: 0 }));
    assert!(!p.page_is_poisoned(q.page()).unwrap(), "poisoning happens when the page is freed");
    p.check_invariants();
    p.release_quarantined(q).unwrap();
    assert!(p.page_is_poisoned(PageId(0)).unwrap());
    let s = p.stats();
    assert_eq!((s.free_pages, s.quarantined_pages, s.quarantines, s.releases), (1, 0, 1, 1));
    p.check_invariants();
}

/// Bites the foreign-pool check: in both pools page 0 is leased to A at generation 1.
#[test]
fn a_lease_from_another_pool_is_refused_even_when_page_generation_and_owner_match() {
    let mut p1 = pool(1, false);
    let mut p2 = pool(1, false);
    let l1 = p1.lease(A).unwrap();
    let l2 = p2.lease(A).unwrap();
    assert_eq!((l1.page(), l1.generation()), (l2.page(), l2.generation()));
    assert_ne!(p1.id(), p2.id());
    let err = KvError::ForeignLease { lease_pool: p1.id(), pool: p2.id() };
    p1.write(&l1, 0, 0, &row(1.0), &row(1.0)).unwrap();
    assert_eq!(p2.read(&l1, 0).err(), Some(err.clone()));
    assert_eq!(p2.watermark(&l1, 0).err(), Some(err.clone()));
    assert_eq!(p2.write(&l1, 0, 0, &row(1.0), &row(1.0)).err(), Some(err.clone()));
    assert_eq!(p2.release(l1).err(), Some(err.clone()));
    assert_eq!(p2.stats().leased_pages, 1);
    let q2 = p2.quarantine(l2).unwrap();
    let l1 = p1.lease(A);
    assert!(l1.is_err(), "p1's only page stays leased after the refused release");
    let q1 = p1.revoke_owner(A).pop().unwrap();
    assert_eq!(p1.release_quarantined(q2).err(), Some(KvError::ForeignLease { lease_pool: p2.id(), pool: p1.id() }));
    p1.release_quarantined(q1).unwrap();
    p1.check_invariants();
    p2.check_invariants();
}

#[test]
fn writes_must_append_at_the_watermark() {
    let mut p = pool(1, false);
    let l = p.lease(A).unwrap();
    let page = l.page();
    assert_eq!(p.write(&l, 0, 1, &row(1.0), &row(1.0)), Err(KvError::NonSequentialWrite { page, layer: 0, slot: 1, watermark: 0 }));
    p.write(&l, 0, 0, &row(1.0), &row(1.0)).unwrap();
    // Overwriting a written slot is refused too.
    assert_eq!(p.write(&l, 0, 0, &row(9.0), &row(9.0)), Err(KvError::NonSequentialWrite { page, layer: 0, slot: 0, watermark: 1 }));
    assert_eq!(p.write(&l, 0, 3, &row(1.0), &row(1.0)), Err(KvError::NonSequentialWrite { page, layer: 0, slot: 3, watermark: 1 }));
    // Layers have their own watermarks.
    p.write(&l, 1, 0, &row(5.0), &row(5.0)).unwrap();
    assert_eq!((p.watermark(&l, 0), p.watermark(&l, 1)), (Ok(1), Ok(1)));
    let r = p.read(&l, 0).unwrap();
    assert_eq!(r.k_head(0)[0].to_f32(), 1.0, "refused overwrite changed nothing");
    p.release(l).unwrap();
}

#[test]
fn a_write_past_the_last_slot_is_refused_as_page_full() {
    let mut p = pool(2, false);
    let l = p.lease(A).unwrap();
    let neighbour = p.lease(B).unwrap();
    for slot in 0..LAYOUT.page_size {
        p.write(&l, 0, slot, &row(slot as f32), &row(-(slot as f32))).unwrap();
    }
    let page = l.page();
    assert_eq!(p.write(&l, 0, 4, &row(7.0), &row(7.0)), Err(KvError::PageFull { page, layer: 0, slot: 4, page_size: 4 }));
    assert_eq!(p.watermark(&l, 0), Ok(4));
    assert!(p.read(&neighbour, 0).unwrap().is_empty());
    assert!(p.read(&neighbour, 1).unwrap().is_empty());
    assert_eq!(p.read(&l, 1).unwrap().len(), 0);
    p.check_invariants();
    p.release(l).unwrap();
    p.release(neighbour).unwrap();
}

#[test]
fn a_layer_out_of_range_or_a_row_of_the_wrong_length_is_refused_and_nothing_is_written() {
    let mut p = pool(1, false);
    let l = p.lease(A).unwrap();
    let oob = KvError::LayerOutOfRange { layer: 2, layers: 2 };
    assert_eq!(p.write(&l, 2, 0, &row(1.0), &row(1.0)), Err(oob.clone()));
    assert_eq!(p.read(&l, 2).err(), Some(oob.clone()));
    assert_eq!(p.watermark(&l, 2), Err(oob));
    assert_eq!(p.write(&l, 0, 0, &row(1.0)[..5], &row(1.0)), Err(KvError::RowLength { expected: 6, k: 5, v: 6 }));
    assert_eq!(p.write(&l, 0, 0, &row(1.0), &[0.0; 7]), Err(KvError::RowLength { expected: 6, k: 6, v: 7 }));
    assert_eq!(p.watermark(&l, 0), Ok(0));
    assert_eq!(p.stats().writes, 0);
    assert_eq!(p.stats().refusals, 5);
    p.release(l).unwrap();
}

#[test]
fn a_read_returns_exactly_the_written_values_rounded_to_f16_head_by_head() {
    let mut p = pool(1, false);
    let l = p.lease(A).unwrap();
    let k0 = [0.1, 0.2, 0.3, 1.1, 1.2, 1.3];
    let v0 = [-0.1, -0.2, -0.3, -1.1, -1.2, -1.3];
    let k1 = [2.1, 2.2, 2.3, 3.1, 3.2, 3.3];
    let v1 = [-2.1, -2.2, -2.3, -3.1, -3.2, -3.3];
    p.write(&l, 1, 0, &k0, &v0).unwrap();
    p.write(&l, 1, 1, &k1, &v1).unwrap();
    let r = p.read(&l, 1).unwrap();
    assert_eq!((r.len(), r.kv_heads(), r.head_dim()), (2, 2, 3));
    let h = |x: &[f32]| x.iter().map(|&v| half::f16::from_f32(v)).collect::<Vec<_>>();
    assert_eq!(r.k_head(0), h(&[0.1, 0.2, 0.3, 2.1, 2.2, 2.3]).as_slice());
    assert_eq!(r.k_head(1), h(&[1.1, 1.2, 1.3, 3.1, 3.2, 3.3]).as_slice());
    assert_eq!(r.v_head(0), h(&[-0.1, -0.2, -0.3, -2.1, -2.2, -2.3]).as_slice());
    assert_eq!(r.v_head(1), h(&[-1.1, -1.2, -1.3, -3.1, -3.2, -3.3]).as_slice());
    assert!(p.read(&l, 0).unwrap().is_empty());
    assert_eq!(p.stats().reads, 2);
    p.release(l).unwrap();
}

/// Bites the watermark limit on read: without poisoning, the page still holds the previous
/// generation's four slots; the new lease must see only the one slot it wrote.
#[test]
fn a_read_never_exposes_slots_beyond_the_watermark() {
    let mut p = pool(1, false);
    let first = p.lease(A).unwrap();
    for slot in 0..4 {
        p.write(&first, 0, slot, &row(100.0), &row(100.0)).unwrap();
    }
    p.release(first).unwrap();
    let second = p.lease(B).unwrap();
    let r = p.read(&second, 0).unwrap();
    assert!(r.is_empty());
    assert!(r.k_head(0).is_empty() && r.v_head(1).is_empty());
    p.write(&second, 0, 0, &row(1.0), &row(2.0)).unwrap();
    let r = p.read(&second, 0).unwrap();
    assert_eq!(r.len(), 1);
    for h in 0..2 {
        assert_eq!(r.k_head(h).len(), 3);
        assert_eq!(r.v_head(h).len(), 3);
        assert!(r.k_head(h).iter().chain(r.v_head(h)).all(|x| x.to_f32() < 100.0));
    }
    p.release(second).unwrap();
}

#[test]
#[should_panic(expected = "kv_head 2 must be < kv_heads 2")]
fn asking_a_page_read_for_a_head_past_the_layout_panics() {
    let mut p = pool(1, false);
    let l = p.lease(A).unwrap();
    let _ = p.read(&l, 0).unwrap().k_head(2);
    p.release(l).unwrap();
}

#[test]
fn a_released_page_is_poisoned_and_a_new_lease_reads_empty() {
    let mut p = pool(1, true);
    assert!(p.page_is_poisoned(PageId(0)).unwrap(), "a fresh poisoning pool starts poisoned");
    let l = p.lease(A).unwrap();
    p.write(&l, 0, 0, &row(1.0), &row(2.0)).unwrap();
    p.write(&l, 1, 0, &row(3.0), &row(4.0)).unwrap();
    assert!(!p.page_is_poisoned(PageId(0)).unwrap());
    p.release(l).unwrap();
    assert!(p.page_is_poisoned(PageId(0)).unwrap());
    assert!(POISON.is_nan());
    let l = p.lease(B).unwrap();
    assert!(p.read(&l, 0).unwrap().is_empty());
    assert!(p.read(&l, 1).unwrap().is_empty());
    assert_eq!(p.page_is_poisoned(PageId(1)), Err(KvError::PageOutOfRange { page: PageId(1), pages: 1 }));
    p.release(l).unwrap();
}

#[test]
fn without_poisoning_a_released_page_keeps_its_bytes_but_not_its_watermarks() {
    let mut p = pool(1, false);
    assert!(!p.page_is_poisoned(PageId(0)).unwrap());
    let l = p.lease(A).unwrap();
    p.write(&l, 0, 0, &row(1.0), &row(2.0)).unwrap();
    p.release(l).unwrap();
    assert!(!p.page_is_poisoned(PageId(0)).unwrap());
    let l = p.lease(B).unwrap();
    assert_eq!(p.watermark(&l, 0), Ok(0));
    p.release(l).unwrap();
    p.check_invariants();
}

/// Bites the all-or-nothing check of lease_many.
#[test]
fn lease_many_is_all_or_nothing_on_exhaustion() {
    let mut p = pool(4, false);
    let one = p.lease(A).unwrap();
    assert_eq!(p.lease_many(B, 4).err(), Some(KvError::Exhausted { requested: 4, free: 3 }));
    let s = p.stats();
    assert_eq!((s.free_pages, s.leased_pages, s.leases_granted), (3, 1, 1));
    p.check_invariants();
    let three = p.lease_many(B, 3).unwrap();
    assert_eq!(three.len(), 3);
    assert!(three.iter().all(|l| l.owner() == B && l.page() != one.page()));
    assert_eq!(p.lease_many(B, 0).unwrap().len(), 0);
    assert_eq!(p.lease_many(B, 1).err(), Some(KvError::Exhausted { requested: 1, free: 0 }));
    for l in three {
        p.release(l).unwrap();
    }
    p.release(one).unwrap();
    assert_eq!(p.stats().free_pages, 4);
    p.check_invariants();
}

#[test]
fn revoke_owner_quarantines_only_that_owners_leased_pages() {
    let mut p = pool(4, false);
    let a = p.lease_many(A, 2).unwrap();
    let b = p.lease(B).unwrap();
    let qs = p.revoke_owner(A);
    assert_eq!(qs.iter().map(|q| q.page()).collect::<Vec<_>>(), a.iter().map(|l| l.page()).collect::<Vec<_>>());
    assert!(p.revoke_owner(A).is_empty());
    assert_eq!(p.watermark(&b, 0), Ok(0));
    let s = p.stats();
    assert_eq!((s.free_pages, s.leased_pages, s.quarantined_pages), (1, 1, 2));
    for q in qs {
        p.release_quarantined(q).unwrap();
    }
    p.release(b).unwrap();
    assert_eq!(p.stats().free_pages, 4);
    p.check_invariants();
}

#[test]
fn stats_count_grants_releases_quarantines_writes_reads_and_refusals() {
    let mut p = pool(2, false);
    let l = p.lease(A).unwrap();
    p.write(&l, 0, 0, &row(1.0), &row(1.0)).unwrap();
    let _ = p.read(&l, 0).unwrap();
    let _ = p.write(&l, 0, 0, &row(1.0), &row(1.0)).unwrap_err();
    let q = p.quarantine(l).unwrap();
    p.release_quarantined(q).unwrap();
    let s = p.stats();
    assert_eq!((s.leases_granted, s.releases, s.quarantines, s.writes, s.reads, s.refusals), (1, 1, 1, 1, 1, 1));
}

/// Runs `check_invariants` and returns its panic message, `None` if it passed.
fn invariant_failure(p: &KvPool) -> Option<String> {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| p.check_invariants()));
    r.err().map(|e| e.downcast_ref::<String>().cloned().unwrap_or_default())
}

/// The guard that a lease cannot be lost silently: a lease dropped without being given back
/// leaves its page leased to nobody who can release it, and the invariant check says so.
#[test]
#[should_panic(expected = "its Lease is gone: dropped without release, quarantine or revoke_owner")]
fn a_lease_dropped_without_being_given_back_fails_the_invariant_check() {
    let mut p = pool(2, false);
    let _kept = p.lease(A).unwrap();
    drop(p.lease(A).unwrap());
    p.check_invariants();
}

/// The mistake a new code path would make: dropping a sequence instead of releasing it.
#[test]
#[should_panic(expected = "page 0 is leased to request 1 at generation 1 but its Lease is gone")]
fn a_sequence_dropped_without_release_fails_the_invariant_check() {
    let mut p = pool(3, false);
    let mut seq = SequenceKv::new(A);
    seq.reserve(&mut p, 2 * LAYOUT.page_size).unwrap();
    drop(seq);
    p.check_invariants();
}

/// What the guard must let through: a dropped lease whose owner is revoked (the deliberate
/// path, which `Unreleased::reclaim` takes), and a stale lease dropped after its page was
/// leased again, which must neither be reported nor hide the new lease being dropped.
#[test]
fn a_revoked_owners_dropped_leases_pass_the_invariant_check_and_a_stale_drop_hides_no_orphan() {
    let mut p = pool(1, false);
    drop(p.lease(A).unwrap());
    assert!(invariant_failure(&p).is_some(), "an orphan is reported");
    for q in p.revoke_owner(A) {
        p.release_quarantined(q).unwrap();
    }
    assert_eq!(invariant_failure(&p), None, "revoke_owner takes the page back");

    let stale = p.lease(A).unwrap();
    for q in p.revoke_owner(A) {
        p.release_quarantined(q).unwrap();
    }
    let live = p.lease(B).unwrap();
    assert_eq!(live.page(), stale.page());
    drop(stale);
    assert_eq!(invariant_failure(&p), None, "dropping a stale lease says nothing of the page's live one");
    drop(live);
    let msg = invariant_failure(&p).expect("the live lease's drop is reported");
    assert!(msg.contains("page 0 is leased to request 2 at generation 3"), "{msg}");
}
