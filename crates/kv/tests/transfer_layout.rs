//! The KV handoff's byte layout and bounds, and the manifest: checks `cargo mutants` found
//! unbitten by the other tests (docs/TESTING.md). A transfer that lands K where V belongs,
//! a slot off by its start, an export past the watermark, an import past the page or a
//! chunk swapped in transit must all show.

use bulkhead_kv::transfer::{ChunkHeader, Manifest, checksum, export_chunks};
use bulkhead_kv::{Inbound, KvChecks, KvError, KvLayout, KvPool, PoolConfig, RequestId, SequenceKv, TransferError};
use half::f16;

const LAYOUT: KvLayout = KvLayout { layers: 2, kv_heads: 2, head_dim: 4, page_size: 4 };
const HD: usize = LAYOUT.head_dim;

fn pool(pages: usize) -> KvPool {
    KvPool::new(PoolConfig { layout: LAYOUT, pages, checks: KvChecks::all() }).expect("pool")
}

/// K of (request, position, layer, element); V is its negation. Distinct and exact in f16.
fn k_value(req: u64, pos: usize, layer: usize, i: usize) -> f32 {
    ((req % 4) * 512 + pos as u64 * 16 + layer as u64 * 8 + i as u64) as f32
}

/// A sender sequence of `n` tokens, written and committed.
fn sender(p: &mut KvPool, req: u64, n: usize) -> SequenceKv {
    let mut s = SequenceKv::new(RequestId(req));
    s.reserve(p, n).expect("reserve");
    for pos in 0..n {
        let (lease, slot) = s.locate(pos).expect("locate");
        for layer in 0..LAYOUT.layers {
            let k: Vec<f32> = (0..LAYOUT.row_elems()).map(|i| k_value(req, pos, layer, i)).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            p.write(lease, layer, slot, &k, &v).expect("write");
        }
    }
    s.commit(p, n).expect("commit");
    s
}

/// Asserts every K and V element of positions `0..n` of `seq` in `p` is the sender's.
fn assert_reads_back(p: &KvPool, seq: &SequenceKv, req: u64, n: usize) {
    for pos in 0..n {
        let (lease, slot) = seq.locate(pos).expect("locate");
        for layer in 0..LAYOUT.layers {
            let r = p.read(lease, layer).expect("read");
            for h in 0..LAYOUT.kv_heads {
                for d in 0..HD {
                    let want = k_value(req, pos, layer, h * HD + d);
                    assert_eq!(r.k_head(h)[slot * HD + d].to_f32(), want, "K pos {pos} layer {layer} head {h}");
                    assert_eq!(r.v_head(h)[slot * HD + d].to_f32(), -want, "V pos {pos} layer {layer} head {h}");
                }
            }
        }
    }
}

#[test]
fn export_writes_layer_then_k_and_v_then_head_then_slot_and_import_puts_every_element_back() {
    let mut sp = pool(4);
    assert_eq!((sp.total_pages(), sp.transfer_bytes_per_token()), (4, 2 * 2 * 2 * 4 * 2));
    let s = sender(&mut sp, 1, 4);
    let (lease, _) = s.locate(0).expect("locate");
    let mut bytes = Vec::new();
    sp.export_slots(lease, 1, 3, &mut bytes).expect("export");
    // The documented transfer layout: [layer][K, V][kv_head][slot][head_dim], f16 LE.
    let mut want = Vec::new();
    for layer in 0..LAYOUT.layers {
        for sign in [1.0f32, -1.0] {
            for h in 0..LAYOUT.kv_heads {
                for slot in 1..4 {
                    for d in 0..HD {
                        want.extend(f16::from_f32(sign * k_value(1, slot, layer, h * HD + d)).to_le_bytes());
                    }
                }
            }
        }
    }
    assert!(bytes == want, "export layout differs from [layer][K, V][kv_head][slot][head_dim]");
    // Into another pool: slot 0 first (append-only), then the three exported.
    let mut rp = pool(2);
    let mut seq = SequenceKv::new(RequestId(1));
    seq.reserve(&mut rp, 4).expect("reserve");
    let (target, _) = seq.locate(0).expect("locate");
    assert!(rp.read(target, 0).expect("read").is_empty(), "a fresh lease reads empty");
    let mut first = Vec::new();
    sp.export_slots(lease, 0, 1, &mut first).expect("export slot 0");
    let writes = rp.stats().writes;
    rp.import_slots(target, 0, 1, &first).expect("import slot 0");
    rp.import_slots(target, 1, 3, &bytes).expect("import slots 1..4");
    assert_eq!(rp.stats().writes, writes + 2);
    assert!(!rp.read(target, 1).expect("read").is_empty());
    seq.commit(&rp, 4).expect("every layer covers the page");
    assert_reads_back(&rp, &seq, 1, 4);
}

#[test]
fn export_refuses_slots_past_the_watermark_and_import_refuses_empty_or_overflowing_ranges() {
    let mut sp = pool(2);
    let s = sender(&mut sp, 2, 4);
    let (lease, _) = s.locate(0).expect("locate");
    let mut out = Vec::new();
    assert!(matches!(sp.export_slots(lease, 2, 3, &mut out), Err(KvError::NotWritten { .. })));
    let mut partial = SequenceKv::new(RequestId(3));
    partial.reserve(&mut sp, 2).expect("reserve");
    let (half_written, _) = partial.locate(0).expect("locate");
    let row = vec![1.0; LAYOUT.row_elems()];
    for layer in 0..LAYOUT.layers {
        sp.write(half_written, layer, 0, &row, &row).expect("write");
    }
    assert!(matches!(sp.export_slots(half_written, 0, 2, &mut out), Err(KvError::NotWritten { .. })));
    assert!(out.is_empty(), "nothing exported on refusal");

    let mut rp = pool(2);
    let mut seq = SequenceKv::new(RequestId(2));
    seq.reserve(&mut rp, 4).expect("reserve");
    let (target, _) = seq.locate(0).expect("locate");
    let bpt = LAYOUT.bytes_per_token();
    assert!(matches!(rp.import_slots(target, 0, 0, &[]), Err(KvError::PageFull { .. })), "an empty import");
    let mut three = Vec::new();
    sp.export_slots(lease, 0, 3, &mut three).expect("export");
    rp.import_slots(target, 0, 3, &three).expect("import");
    // Slots 3..6 of a 4-slot page would spill into the storage after it.
    let spill = vec![0u8; 3 * bpt];
    assert!(matches!(rp.import_slots(target, 3, 3, &spill), Err(KvError::PageFull { .. })));
    assert_eq!(rp.watermark(target, 0).expect("watermark"), 3, "nothing written on refusal");
    // Bytes that are not exactly the slots' KV (one short, one over) are refused whole: a
    // short import must not mark a slot written whose bytes never came.
    for len in [bpt - 1, bpt + 1] {
        let r = rp.import_slots(target, 3, 1, &vec![0u8; len]);
        assert!(matches!(r, Err(KvError::RowLength { .. })), "{len} bytes for one slot: {r:?}");
    }
    assert_eq!(rp.watermark(target, 0).expect("watermark"), 3, "nothing written on refusal");
}

#[test]
fn a_transfer_whose_chunks_cut_pages_anywhere_verifies_and_reads_back_k_and_v() {
    let (mut sp, mut rp) = (pool(4), pool(4));
    let n = 10;
    let s = sender(&mut sp, 3, n);
    let mut inb = Inbound::reserve(&mut rp, RequestId(3), n, n).expect("reserve");
    assert_eq!((inb.prompt_tokens(), inb.received_tokens()), (n, 0));
    let targets = inb.prompt_pages(LAYOUT.page_size);
    let mut manifest = Manifest::default();
    let mut headers = Vec::new();
    // Prefill chunks of 3, 4 and 3 tokens: none starts at a page boundary after the first.
    for (from, to) in [(0, 3), (3, 7), (7, 10)] {
        for (h, data) in export_chunks(&sp, &s, &targets, from, to, &mut manifest).expect("export") {
            headers.push((h.page, h.slot_start, h.slot_count));
            inb.accept(&mut rp, &h, &data).expect("accept");
        }
        assert_eq!(inb.received_tokens(), to);
    }
    let p = |i: usize| targets[i].page;
    assert_eq!(headers, [(p(0), 0, 3), (p(0), 3, 1), (p(1), 0, 3), (p(1), 3, 1), (p(2), 0, 2)]);
    let verified = inb.finish(&rp, n, manifest.digest()).map_err(|(e, _)| e).expect("verified");
    assert_reads_back(&rp, &verified.into_sequence(), 3, n);
}

#[test]
fn a_chunk_replaced_in_transit_with_a_matching_checksum_fails_the_manifest() {
    let (mut sp, mut rp) = (pool(8), pool(4));
    let n = 8;
    let s = sender(&mut sp, 4, n);
    let other = sender(&mut sp, 5, n);
    let mut inb = Inbound::reserve(&mut rp, RequestId(4), n, n).expect("reserve");
    let targets = inb.prompt_pages(LAYOUT.page_size);
    let mut manifest = Manifest::default();
    let mut chunks = export_chunks(&sp, &s, &targets, 0, n, &mut manifest).expect("export");
    // Another sequence's bytes for the second page, re-checksummed: every per-chunk check
    // passes, only the digest of what the sender sent can tell.
    let (_, forged) = export_chunks(&sp, &other, &targets, 4, 8, &mut Manifest::default()).expect("export").remove(0);
    chunks[1] = (ChunkHeader { checksum: checksum(&forged), ..chunks[1].0 }, forged);
    for (h, d) in &chunks {
        inb.accept(&mut rp, h, d).expect("each chunk passes its own checks");
    }
    let err = inb.finish(&rp, n, manifest.digest()).map(|_| ()).map_err(|(e, _)| e);
    assert!(matches!(err, Err(TransferError::Manifest { .. })), "{err:?}");
}
