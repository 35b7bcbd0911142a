//! The verified handoff between two pools: a faithful transfer verifies and reads back
//! exactly; every kind of bad chunk or false "done" is refused and never yields a
//! `VerifiedSequence`.

use bulkhead_kv::transfer::{ChunkHeader, Manifest, export_chunks};
use bulkhead_kv::{Generation, Inbound, KvChecks, KvLayout, KvPool, PageRef, PoolConfig, RequestId, SequenceKv, TransferError};

const LAYOUT: KvLayout = KvLayout { layers: 2, kv_heads: 2, head_dim: 4, page_size: 4 };

fn pool(pages: usize) -> KvPool {
    KvPool::new(PoolConfig { layout: LAYOUT, pages, checks: KvChecks::all() }).unwrap()
}

/// Distinct per (request, position, layer, element) and exact in f16 (integers below 2048).
fn value(req: u64, pos: usize, layer: usize, i: usize) -> f32 {
    ((req % 8) * 256 + pos as u64 * 16 + layer as u64 * 8 + i as u64) as f32
}

/// A sender sequence of `n` tokens with KV values that identify (request, position, layer).
fn sender(p: &mut KvPool, req: u64, n: usize) -> SequenceKv {
    let mut s = SequenceKv::new(RequestId(req));
    s.reserve(p, n).unwrap();
    let row = LAYOUT.row_elems();
    for pos in 0..n {
        let (lease, slot) = s.locate(pos).unwrap();
        for layer in 0..LAYOUT.layers {
            let k: Vec<f32> = (0..row).map(|i| value(req, pos, layer, i)).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            p.write(lease, layer, slot, &k, &v).unwrap();
        }
    }
    s.commit(p, n).unwrap();
    s
}

fn chunks(p: &KvPool, s: &SequenceKv, targets: &[PageRef], n: usize) -> (Vec<(ChunkHeader, Vec<u8>)>, u64) {
    let mut m = Manifest::default();
    let c = export_chunks(p, s, targets, 0, n, &mut m).unwrap();
    (c, m.digest())
}

#[test]
fn a_faithful_transfer_verifies_and_the_receiver_reads_exactly_what_was_sent() {
    let (mut sp, mut rp) = (pool(8), pool(8));
    let n = 10;
    let s = sender(&mut sp, 7, n);
    let mut inb = Inbound::reserve(&mut rp, RequestId(7), n, n + 5).unwrap();
    let targets = inb.prompt_pages(LAYOUT.page_size);
    assert_eq!(targets.len(), 3);
    let (cs, digest) = chunks(&sp, &s, &targets, n);
    for (h, d) in &cs {
        inb.accept(&mut rp, h, d).unwrap();
    }
    let v = inb.finish(&rp, n, digest).map_err(|(e, _)| e).unwrap();
    assert_eq!(v.prompt_tokens(), n);
    let seq = v.into_sequence();
    assert_eq!(seq.len(), n);
    for pos in 0..n {
        let (lease, slot) = seq.locate(pos).unwrap();
        for layer in 0..LAYOUT.layers {
            let r = rp.read(lease, layer).unwrap();
            for h in 0..LAYOUT.kv_heads {
                let k = &r.k_head(h)[slot * 4..slot * 4 + 4];
                for (d, x) in k.iter().enumerate() {
                    assert_eq!(x.to_f32(), value(7, pos, layer, h * 4 + d));
                }
            }
        }
    }
}

/// Runs a transfer through `tamper` and returns the first refusal, at accept or at finish.
fn refused(tamper: impl FnOnce(&mut Vec<(ChunkHeader, Vec<u8>)>, &mut usize, &mut u64, &[PageRef])) -> TransferError {
    let (mut sp, mut rp) = (pool(16), pool(16));
    let n = 10;
    let s = sender(&mut sp, 7, n);
    // Another request's reservation in the same receiver pool.
    let other = Inbound::reserve(&mut rp, RequestId(8), 8, 8).unwrap();
    let mut inb = Inbound::reserve(&mut rp, RequestId(7), n, n).unwrap();
    let targets = inb.prompt_pages(LAYOUT.page_size);
    let (mut cs, mut digest) = chunks(&sp, &s, &targets, n);
    let mut claimed = n;
    let mut all = targets.clone();
    all.extend(other.prompt_pages(LAYOUT.page_size));
    tamper(&mut cs, &mut claimed, &mut digest, &all);
    for (h, d) in &cs {
        if let Err(e) = inb.accept(&mut rp, h, d) {
            return e;
        }
    }
    match inb.finish(&rp, claimed, digest) {
        Ok(_) => panic!("tampered transfer verified"),
        Err((e, _)) => e,
    }
}

#[test]
fn a_short_transfer_is_refused_at_finish() {
    let e = refused(|cs, _, d, _| {
        cs.pop();
        let mut m = Manifest::default();
        cs.iter().for_each(|(h, _)| m.add(h));
        *d = m.digest();
    });
    assert!(matches!(e, TransferError::ShortTransfer { received: 8, reserved: 10 }), "{e}");
}

#[test]
fn the_incident_one_page_written_and_done_claimed_is_refused() {
    // The sender wrote one page for a 1-token placeholder and claims completion.
    let e = refused(|cs, claimed, d, _| {
        cs.truncate(1);
        cs[0].0.slot_count = 1;
        cs[0].1.truncate(LAYOUT.bytes_per_token());
        cs[0].0.checksum = bulkhead_kv::transfer::checksum(&cs[0].1);
        *claimed = 1;
        let mut m = Manifest::default();
        m.add(&cs[0].0);
        *d = m.digest();
    });
    assert!(matches!(e, TransferError::TokenCount { claimed: 1, reserved: 10 }), "{e}");
}

#[test]
fn a_chunk_for_a_stale_generation_is_refused() {
    let e = refused(|cs, _, _, _| cs[1].0.generation = Generation(cs[1].0.generation.0 - 1));
    assert!(matches!(e, TransferError::StaleGeneration { .. }), "{e}");
}

#[test]
fn a_chunk_for_another_request_s_page_is_refused() {
    let e = refused(|cs, _, _, all| cs[0].0.page = all[3].page);
    assert!(matches!(e, TransferError::UnknownPage { .. }), "{e}");
}

#[test]
fn a_corrupted_chunk_is_refused() {
    let e = refused(|cs, _, _, _| cs[2].1[5] ^= 0x40);
    assert!(matches!(e, TransferError::Checksum { .. }), "{e}");
}

#[test]
fn chunks_out_of_order_or_repeated_are_refused() {
    let e = refused(|cs, _, _, _| cs.swap(0, 1));
    assert!(matches!(e, TransferError::OutOfOrder { .. }), "{e}");
    let e = refused(|cs, _, _, _| {
        let dup = cs[0].clone();
        cs.insert(1, dup);
    });
    assert!(matches!(e, TransferError::OutOfOrder { .. }), "{e}");
}

#[test]
fn a_chunk_past_the_reserved_prompt_is_refused() {
    let e = refused(|cs, _, _, _| {
        let last = cs.last_mut().unwrap();
        last.0.slot_count += 1;
    });
    assert!(matches!(e, TransferError::BeyondPrompt { .. }), "{e}");
}

#[test]
fn a_wrong_manifest_or_token_count_is_refused() {
    let e = refused(|_, _, d, _| *d ^= 1);
    assert!(matches!(e, TransferError::Manifest { .. }), "{e}");
    let e = refused(|_, c, _, _| *c = 11);
    assert!(matches!(e, TransferError::TokenCount { claimed: 11, .. }), "{e}");
}

#[test]
fn a_refused_transfer_hands_its_pages_back_for_quarantine() {
    let (mut sp, mut rp) = (pool(8), pool(8));
    let s = sender(&mut sp, 1, 6);
    let mut inb = Inbound::reserve(&mut rp, RequestId(1), 6, 6).unwrap();
    let t = inb.prompt_pages(4);
    let (cs, _) = chunks(&sp, &s, &t, 6);
    inb.accept(&mut rp, &cs[0].0, &cs[0].1).unwrap();
    let (_, seq) = inb.finish(&rp, 6, 0).unwrap_err();
    let q = seq.quarantine(&mut rp).unwrap();
    assert_eq!(rp.stats().quarantined_pages, 2);
    for q in q {
        rp.release_quarantined(q).unwrap();
    }
    assert_eq!(rp.stats().free_pages, 8);
    rp.check_invariants();
}

/// Checksums off (measurement only) must be off at both ends: a sender without them sends
/// 0, which a checking receiver refuses and a non-checking one accepts.
#[test]
fn chunks_without_checksums_are_refused_by_a_receiver_that_checks() {
    let off = KvChecks { checksums: false, ..KvChecks::all() };
    let mut sp = KvPool::new(PoolConfig { layout: LAYOUT, pages: 4, checks: off }).unwrap();
    let s = sender(&mut sp, 3, 4);
    for (receiver_checks, accepted) in [(KvChecks::all(), false), (off, true)] {
        let mut rp = KvPool::new(PoolConfig { layout: LAYOUT, pages: 4, checks: receiver_checks }).unwrap();
        let mut inb = Inbound::reserve(&mut rp, RequestId(3), 4, 4).unwrap();
        let (cs, _) = chunks(&sp, &s, &inb.prompt_pages(LAYOUT.page_size), 4);
        assert_eq!(cs[0].0.checksum, 0);
        let r = inb.accept(&mut rp, &cs[0].0, &cs[0].1);
        assert_eq!(r.is_ok(), accepted, "{r:?}");
        if !accepted {
            assert!(matches!(r, Err(TransferError::Checksum { .. })), "{r:?}");
        }
        inb.into_sequence().release(&mut rp).unwrap();
    }
}

/// The receiver holds the first pages already (cached, shared read-only): the sender
/// writes only the rest, addressed from the first position past them, and the verified
/// sequence reads the prefix from the shared pages and the tail from what landed.
#[test]
fn a_shared_prefix_is_covered_by_its_leases_and_only_the_tail_is_sent() {
    use bulkhead_kv::{Fence, PageKey, PrefixCache};
    let (mut sp, mut rp) = (pool(8), pool(12));
    let ps = LAYOUT.page_size;
    let n = 2 * ps + 3;
    let fence = Fence([7; 16]);
    let keys = [PageKey([1; 16]), PageKey([2; 16])];
    // An earlier request of the same scope left its two full prompt pages in the
    // receiver's cache (the same values the sender computes for this request).
    let mut cache = PrefixCache::new(8);
    let earlier = sender(&mut rp, 7, 2 * ps);
    assert_eq!(cache.finish(&mut rp, earlier, &keys, fence), 2);
    let shared = cache.lookup(&mut rp, &keys, 2, RequestId(15), fence, n).unwrap();
    assert_eq!(shared.len(), 2);
    let mut inb = Inbound::reserve_after(&mut rp, RequestId(15), shared, n, n + 1).map_err(|(e, _)| e).unwrap();
    assert_eq!((inb.shared_tokens(), inb.received_tokens()), (2 * ps, 2 * ps));
    let targets = inb.prompt_pages(ps);
    assert_eq!(targets.len(), 1, "only the tail's page is a target");
    let s = sender(&mut sp, 7, n);
    let mut m = Manifest::default();
    let cs = export_chunks_from(&sp, &s, &targets, 2 * ps, n, &mut m);
    assert_eq!(cs.len(), 1, "the shared prefix is not sent");
    for (h, d) in &cs {
        inb.accept(&mut rp, h, d).unwrap();
    }
    let seq = inb.finish(&rp, n, m.digest()).map_err(|(e, _)| e).unwrap().into_sequence();
    assert_eq!(seq.len(), n);
    for pos in [0, ps + 1, 2 * ps, n - 1] {
        let (page, slot) = seq.locate_page(pos).unwrap();
        let read = rp.read(page, 1).unwrap();
        assert_eq!(read.k_head(0)[slot * 4].to_f32(), value(7, pos, 1, 0), "position {pos}");
    }
}

/// A chunk naming one of the shared pages is refused: the receiver's own prompt pages are
/// the only targets, whatever page number a chunk carries.
#[test]
fn a_chunk_for_a_shared_page_is_refused() {
    let (mut rp, mut cache, keys, fence) = one_cached_page();
    let ps = LAYOUT.page_size;
    let shared = cache.lookup(&mut rp, &keys, 1, RequestId(15), fence, ps + 2).unwrap();
    let page = shared[0].page();
    let generation = shared[0].generation();
    let mut inb = Inbound::reserve_after(&mut rp, RequestId(15), shared, ps + 2, ps + 2).map_err(|(e, _)| e).unwrap();
    let h = ChunkHeader { page, generation, slot_start: 0, slot_count: 1, checksum: 0 };
    let data = vec![0u8; LAYOUT.bytes_per_token()];
    assert!(matches!(inb.accept(&mut rp, &h, &data), Err(TransferError::UnknownPage { .. })));
}

/// A prefix that covers the whole prompt, or is leased to another reader, cannot start a
/// reservation; the shared leases come back to be given back.
#[test]
fn a_shared_prefix_must_leave_the_last_position_and_belong_to_the_reader() {
    use bulkhead_kv::KvError;
    let (mut rp, mut cache, keys, fence) = one_cached_page();
    let ps = LAYOUT.page_size;
    let whole = cache.lookup(&mut rp, &keys, 1, RequestId(15), fence, ps).unwrap();
    let (e, back) = Inbound::reserve_after(&mut rp, RequestId(15), whole, ps, ps + 1).err().unwrap();
    assert_eq!((e, back.len()), (KvError::SharedPrefix { pages: 1, prompt: ps }, 1));
    back.into_iter().for_each(|l| rp.unshare(l).unwrap());
    let others = cache.lookup(&mut rp, &keys, 1, RequestId(16), fence, ps + 1).unwrap();
    let (e, back) = Inbound::reserve_after(&mut rp, RequestId(15), others, ps + 1, ps + 1).err().unwrap();
    assert_eq!((e, back.len()), (KvError::SharedPrefix { pages: 1, prompt: ps + 1 }, 1));
}

/// A receiver pool whose cache holds one full page of request 7's KV, under key 1 and
/// fence 7.
fn one_cached_page() -> (KvPool, bulkhead_kv::PrefixCache, [bulkhead_kv::PageKey; 1], bulkhead_kv::Fence) {
    let mut rp = pool(12);
    let (fence, keys) = (bulkhead_kv::Fence([7; 16]), [bulkhead_kv::PageKey([1; 16])]);
    let mut cache = bulkhead_kv::PrefixCache::new(8);
    let earlier = sender(&mut rp, 7, LAYOUT.page_size);
    cache.finish(&mut rp, earlier, &keys, fence);
    (rp, cache, keys, fence)
}

fn export_chunks_from(
    p: &KvPool,
    s: &SequenceKv,
    targets: &[PageRef],
    base: usize,
    to: usize,
    m: &mut Manifest,
) -> Vec<(ChunkHeader, Vec<u8>)> {
    let mut out = Vec::new();
    let mut export = bulkhead_kv::ChunkExport::new(p, s, targets, base, 0, to, m);
    loop {
        let mut data = Vec::new();
        match export.next_into(&mut data) {
            Some(h) => out.push((h.unwrap(), data)),
            None => return out,
        }
    }
}

/// A reservation is computed here only while no sender has written into it: once a chunk
/// landed, a sender knows its pages and the local compute is refused (the reservation comes
/// back whole). Computed here, the rest counts only as what the worker itself wrote and
/// committed: an unwritten position cannot be committed.
#[test]
fn a_reservation_is_computed_here_only_untouched_and_only_what_is_written_counts() {
    use bulkhead_kv::KvError;
    let ps = LAYOUT.page_size;
    let (mut rp, mut cache, keys, fence) = one_cached_page();
    let shared = cache.lookup(&mut rp, &keys, 1, RequestId(15), fence, ps + 2).unwrap();
    let mut inb = Inbound::reserve_after(&mut rp, RequestId(15), shared, ps + 2, ps + 3).map_err(|(e, _)| e).unwrap();
    let mut sp = pool(4);
    let s = sender(&mut sp, 15, ps + 2);
    let mut m = Manifest::default();
    let cs = export_chunks_from(&sp, &s, &inb.prompt_pages(ps), ps, ps + 1, &mut m);
    inb.accept(&mut rp, &cs[0].0, &cs[0].1).unwrap();
    let inb = inb.compute_here().expect_err("a reservation a sender wrote into is not computed here");
    assert_eq!(inb.written_tokens(), 1);

    let shared = cache.lookup(&mut rp, &keys, 1, RequestId(16), fence, ps + 2).unwrap();
    let inb = Inbound::reserve_after(&mut rp, RequestId(16), shared, ps + 2, ps + 3).map_err(|(e, _)| e).unwrap();
    let local = inb.compute_here().expect("an untouched reservation is computed here");
    assert_eq!((local.shared_tokens(), local.prompt_tokens(), local.owner()), (ps, ps + 2, RequestId(16)));
    let mut seq = local.into_sequence();
    assert_eq!(seq.len(), ps, "the shared prefix only");
    assert!(matches!(seq.commit(&rp, 2), Err(KvError::NotWritten { .. })), "nothing written past the prefix yet");
    let row = LAYOUT.row_elems();
    for pos in ps..ps + 2 {
        let (lease, slot) = seq.locate(pos).unwrap();
        for layer in 0..LAYOUT.layers {
            let k: Vec<f32> = (0..row).map(|i| value(16, pos, layer, i)).collect();
            rp.write(lease, layer, slot, &k, &k).unwrap();
        }
    }
    seq.commit(&rp, 2).unwrap();
    assert_eq!(seq.len(), ps + 2);
}
