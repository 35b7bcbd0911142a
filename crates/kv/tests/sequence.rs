//! Behaviour of `SequenceKv`: reserve, locate, commit, release, quarantine.

use bulkhead_kv::{KvChecks, KvError, KvLayout, KvPool, PageId, PoolConfig, RequestId, SequenceKv};

const LAYOUT: KvLayout = KvLayout { layers: 2, kv_heads: 1, head_dim: 2, page_size: 4 };
const A: RequestId = RequestId(7);

fn pool(pages: usize) -> KvPool {
    KvPool::new(PoolConfig { layout: LAYOUT, pages, checks: KvChecks::all() }).unwrap()
}

/// Writes position `pos` of `seq` in the given layers.
fn write(pool: &mut KvPool, seq: &SequenceKv, pos: usize, layers: std::ops::Range<usize>) {
    let (lease, slot) = seq.locate(pos).unwrap();
    for layer in layers {
        let x = [pos as f32, layer as f32];
        pool.write(lease, layer, slot, &x, &x).unwrap();
    }
}

#[test]
fn a_new_sequence_is_empty_and_reserves_nothing() {
    let s = SequenceKv::new(A);
    assert_eq!((s.owner(), s.len(), s.is_empty(), s.pages().len(), s.reserved_tokens()), (A, 0, true, 0, 0));
    assert_eq!(s.locate(0).err(), Some(KvError::NotReserved { pos: 0, reserved: 0 }));
}

#[test]
fn reserve_leases_just_enough_pages_in_order_and_never_shrinks() {
    let mut p = pool(4);
    let mut s = SequenceKv::new(A);
    s.reserve(&mut p, 5).unwrap();
    assert_eq!(s.pages().len(), 2);
    assert_eq!(s.reserved_tokens(), 8);
    assert!(s.pages().iter().all(|l| l.owner() == A));
    s.reserve(&mut p, 8).unwrap();
    assert_eq!(s.pages().len(), 2);
    s.reserve(&mut p, 1).unwrap();
    assert_eq!(s.pages().len(), 2);
    s.reserve(&mut p, 9).unwrap();
    assert_eq!(s.pages().len(), 3);
    assert_eq!(p.stats().leased_pages, 3);
    assert_eq!(s.release(&mut p).ok(), Some(3));
    p.check_invariants();
}

#[test]
fn reserve_is_all_or_nothing_when_the_pool_is_short() {
    let mut p = pool(3);
    let mut s = SequenceKv::new(A);
    s.reserve(&mut p, 4).unwrap();
    assert_eq!(s.reserve(&mut p, 16).err(), Some(KvError::Exhausted { requested: 3, free: 2 }));
    assert_eq!(s.pages().len(), 1);
    assert_eq!(p.stats().free_pages, 2);
    assert_eq!(s.release(&mut p).ok(), Some(1));
    assert_eq!(p.stats().free_pages, 3);
}

#[test]
fn locate_maps_a_position_to_its_page_and_slot_and_refuses_unreserved_positions() {
    let mut p = pool(4);
    let mut s = SequenceKv::new(A);
    s.reserve(&mut p, 6).unwrap();
    for pos in 0..8 {
        let (lease, slot) = s.locate(pos).unwrap();
        assert_eq!(lease.page(), s.pages()[pos / 4].page());
        assert_eq!(slot, pos % 4);
    }
    assert_eq!(s.locate(8).err(), Some(KvError::NotReserved { pos: 8, reserved: 8 }));
    s.release(&mut p).unwrap();
}

#[test]
fn commit_counts_tokens_written_in_every_layer_across_pages() {
    let mut p = pool(4);
    let mut s = SequenceKv::new(A);
    s.reserve(&mut p, 10).unwrap();
    for pos in 0..6 {
        write(&mut p, &s, pos, 0..2);
    }
    s.commit(&p, 6).unwrap();
    assert_eq!((s.len(), s.is_empty()), (6, false));
    write(&mut p, &s, 6, 0..2);
    s.commit(&p, 1).unwrap();
    s.commit(&p, 0).unwrap();
    assert_eq!(s.len(), 7);
    let r = p.read(&s.pages()[1], 1).unwrap();
    assert_eq!(r.len(), 3);
    assert_eq!(r.k_head(0)[4].to_f32(), 6.0);
    s.release(&mut p).unwrap();
}

#[test]
fn commit_is_refused_until_every_layer_is_written() {
    let mut p = pool(4);
    let mut s = SequenceKv::new(A);
    s.reserve(&mut p, 8).unwrap();
    for pos in 0..5 {
        write(&mut p, &s, pos, 0..1);
    }
    let page0 = s.pages()[0].page();
    assert_eq!(s.commit(&p, 5), Err(KvError::NotWritten { pos: 0, layer: 1, page: page0, watermark: 0 }));
    for pos in 0..4 {
        write(&mut p, &s, pos, 1..2);
    }
    let page1 = s.pages()[1].page();
    assert_eq!(s.commit(&p, 5), Err(KvError::NotWritten { pos: 4, layer: 1, page: page1, watermark: 0 }));
    assert_eq!(s.len(), 0, "a refused commit commits nothing");
    s.commit(&p, 4).unwrap();
    assert_eq!(s.commit(&p, 1), Err(KvError::NotWritten { pos: 4, layer: 1, page: page1, watermark: 0 }));
    write(&mut p, &s, 4, 1..2);
    s.commit(&p, 1).unwrap();
    assert_eq!(s.len(), 5);
    s.release(&mut p).unwrap();
}

#[test]
fn commit_past_the_reservation_is_refused() {
    let mut p = pool(2);
    let mut s = SequenceKv::new(A);
    assert_eq!(s.commit(&p, 1), Err(KvError::NotReserved { pos: 0, reserved: 0 }));
    s.reserve(&mut p, 3).unwrap();
    assert_eq!(s.commit(&p, 5), Err(KvError::NotReserved { pos: 4, reserved: 4 }));
    assert_eq!(s.len(), 0);
    s.release(&mut p).unwrap();
}

#[test]
fn release_gives_every_page_back_and_quarantine_holds_them_out() {
    let mut p = pool(4);
    let mut s = SequenceKv::new(A);
    s.reserve(&mut p, 12).unwrap();
    write(&mut p, &s, 0, 0..2);
    let pages: Vec<PageId> = s.pages().iter().map(|l| l.page()).collect();
    let qs = s.quarantine(&mut p).unwrap();
    assert_eq!(qs.iter().map(|q| q.page()).collect::<Vec<_>>(), pages);
    assert!(qs.iter().all(|q| q.owner() == A));
    assert_eq!(p.stats().quarantined_pages, 3);
    p.check_invariants();
    for q in qs {
        p.release_quarantined(q).unwrap();
    }
    let mut s = SequenceKv::new(A);
    s.reserve(&mut p, 16).unwrap();
    assert!(p.read(&s.pages()[0], 0).unwrap().is_empty(), "the new sequence sees nothing of the old one");
    assert_eq!(s.release(&mut p).ok(), Some(4));
    assert_eq!(p.stats().free_pages, 4);
    p.check_invariants();
}

#[test]
fn a_sequence_refuses_a_second_pool() {
    let mut p1 = pool(2);
    let mut p2 = pool(2);
    let mut s = SequenceKv::new(A);
    s.reserve(&mut p1, 1).unwrap();
    let foreign = KvError::ForeignLease { lease_pool: p1.id(), pool: p2.id() };
    assert_eq!(s.reserve(&mut p2, 8).err(), Some(foreign.clone()));
    assert_eq!(p2.stats().free_pages, 2);
    assert_eq!(s.commit(&p2, 0), Ok(()));
    write(&mut p1, &s, 0, 0..2);
    assert_eq!(s.commit(&p2, 1).err(), Some(foreign.clone()));
    let u = s.release(&mut p2).unwrap_err();
    assert_eq!(u.error, foreign);
    // The sequence came back with its pages still leased in p1; reclaim frees them.
    assert_eq!((u.seq.pages().len(), p1.stats().leased_pages), (1, 1));
    assert_eq!(u.reclaim(&mut p1), 1);
    assert_eq!(p1.stats().free_pages, 2);
    p1.check_invariants();
}

#[test]
fn releasing_a_revoked_sequence_is_refused_and_releases_nothing() {
    let mut p = pool(4);
    let mut s = SequenceKv::new(A);
    s.reserve(&mut p, 8).unwrap();
    let qs = p.revoke_owner(A);
    assert!(matches!(s.commit(&p, 0), Ok(())));
    let u = s.release(&mut p).unwrap_err();
    assert!(matches!(u.error, KvError::StaleLease { .. }));
    assert_eq!(u.seq.pages().len(), 2, "the sequence comes back whole");
    assert_eq!(p.stats().quarantined_pages, 2);
    let u = u.seq.quarantine(&mut p).unwrap_err();
    assert!(matches!(u.error, KvError::StaleLease { .. }), "quarantine refuses it too");
    assert_eq!(p.stats().quarantined_pages, 2);
    let mut s = SequenceKv::new(A);
    s.reserve(&mut p, 8).unwrap();
    for q in qs {
        p.release_quarantined(q).unwrap();
    }
    assert!(matches!(s.quarantine(&mut p), Ok(v) if v.len() == 2));
    p.check_invariants();
}

#[test]
fn a_roll_back_unwrites_the_rejected_positions_so_nothing_reads_or_commits_them() {
    let mut p = pool(2);
    let mut s = SequenceKv::new(A);
    s.reserve(&mut p, 8).unwrap();
    for pos in 0..6 {
        write(&mut p, &s, pos, 0..2);
    }
    s.commit(&p, 6).unwrap();
    s.roll_back(&mut p, 3).unwrap();
    assert_eq!(s.len(), 3);
    let (first, second) = (s.locate(0).unwrap().0, s.locate(4).unwrap().0);
    for layer in 0..2 {
        // A read stops at the watermark: the rejected positions are not there to attend.
        assert_eq!(p.read(first, layer).unwrap().len(), 3);
        assert_eq!(p.read(second, layer).unwrap().len(), 0);
    }
    // The second page holds nothing of the rejected positions: poisoned again, whole.
    assert_eq!(p.page_is_poisoned(second.page()), Ok(true));
    assert!(matches!(s.commit(&p, 1), Err(KvError::NotWritten { pos: 3, .. })));
    // Written again, the positions commit and pass the read checks; the pages stayed.
    write(&mut p, &s, 3, 0..2);
    s.commit(&p, 1).unwrap();
    p.check_reads(&mut s).unwrap();
    assert_eq!((s.len(), s.reserved_tokens()), (4, 8));
    assert_eq!(s.release(&mut p).ok(), Some(2));
    p.check_invariants();
}

#[test]
fn a_roll_back_past_the_committed_length_is_refused_and_moves_nothing() {
    let mut p = pool(1);
    let mut s = SequenceKv::new(A);
    s.reserve(&mut p, 4).unwrap();
    write(&mut p, &s, 0, 0..2);
    s.commit(&p, 1).unwrap();
    assert_eq!(s.roll_back(&mut p, 2), Err(KvError::BadRollBack { to: 2, committed: 1, shared: 0 }));
    assert_eq!(s.len(), 1);
    assert_eq!(p.read(s.locate(0).unwrap().0, 0).unwrap().len(), 1);
    s.roll_back(&mut p, 0).unwrap();
    assert_eq!(s.len(), 0);
}
