//! The pool's storage: the K/V bytes of every page and everything that touches them.
//! Writes ([`KvPool::write`], [`KvPool::import_slots`]) append at a page's watermark;
//! reads ([`KvPool::read`], [`PageReader`], [`KvPool::export_slots`]) see only the slots
//! below it (I2); [`KvPool::check_reads`] runs the generation, canary ([`POISON`]) and
//! auditor (shadow tag) checks before a forward step (I1, I2, I6); a freed page is
//! scrubbed. Every access verifies its handle first with the bookkeeping's `verify` in
//! `book.rs`, which alone decides who holds a page.

use std::cell::Cell;
use std::sync::atomic::Ordering;

use half::f16;

use super::book::{FenceCount, Want};
use super::{KvPool, Lease, PageHandle, PageTag};
use crate::{Generation, KvError, PageId, RequestId, SequenceKv};

/// Sentinel written over a page when it returns to the free list (if
/// [`KvChecks::canaries`](crate::KvChecks::canaries)): a quiet f16 NaN with a recognisable payload, so a read
/// that escaped the checks yields NaN (loud) instead of another request's KV. Compare with
/// `to_bits()`, since NaN != NaN.
pub const POISON: f16 = f16::from_bits(0x7EAD);

/// Many page reads by one task (attention over one sequence's pages), each checked as
/// [`KvPool::read`] checks it, counted here and added to the pool's statistics once, when
/// the reader is dropped: counters shared by every compute thread and bumped on every
/// page read cost a decode step more than the reads themselves.
pub struct PageReader<'p> {
    pool: &'p KvPool,
    reads: Cell<u64>,
    refusals: Cell<u64>,
    fence_checks: Cell<u64>,
    fence_failures: Cell<u64>,
}

impl<'p> PageReader<'p> {
    /// [`KvPool::read`], counted by this reader.
    pub fn read<'h>(&self, lease: impl Into<PageHandle<'h>>, layer: usize) -> Result<PageRead<'p>, KvError> {
        let r = self.pool.read_checked(lease.into(), layer, self);
        let tally = if r.is_ok() { &self.reads } else { &self.refusals };
        tally.set(tally.get() + 1);
        r
    }
}

impl Drop for PageReader<'_> {
    fn drop(&mut self) {
        let p = self.pool;
        for (n, total) in [
            (&self.reads, &p.reads),
            (&self.refusals, &p.refusals),
            (&self.fence_checks, &p.fence_checks),
            (&self.fence_failures, &p.fence_failures),
        ] {
            if n.get() > 0 {
                total.fetch_add(n.get(), Ordering::Relaxed);
            }
        }
    }
}

impl FenceCount for PageReader<'_> {
    fn fence_checked(&self, failed: bool) {
        self.fence_checks.set(self.fence_checks.get() + 1);
        if failed {
            self.fence_failures.set(self.fence_failures.get() + 1);
        }
    }
}

/// Borrowed view of K and V of one page for one layer, holding only the written slots.
#[derive(Clone, Copy, Debug)]
pub struct PageRead<'a> {
    /// The layer's whole K block, `[kv_head][slot 0..page_size][head_dim]`; only the first
    /// `len` slots of each head are ever handed out.
    k: &'a [f16],
    /// Same for V.
    v: &'a [f16],
    /// Written slots (the watermark at read time).
    len: usize,
    kv_heads: usize,
    head_dim: usize,
    page_size: usize,
}

impl<'a> PageRead<'a> {
    /// Written slots: the layer's watermark in the lease's generation.
    pub fn len(&self) -> usize {
        self.len
    }
    /// No slot written yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// KV heads per slot.
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }
    /// Elements per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// K of head `kv_head`: `len * head_dim` elements, slot-major (slot `s` at `[s*head_dim..]`).
    ///
    /// # Panics
    /// If `kv_head >= kv_heads` (a programmer error: the layout is known to the caller).
    pub fn k_head(&self, kv_head: usize) -> &'a [f16] {
        self.head(self.k, kv_head)
    }
    /// V of head `kv_head`, laid out like [`PageRead::k_head`].
    ///
    /// # Panics
    /// If `kv_head >= kv_heads`.
    pub fn v_head(&self, kv_head: usize) -> &'a [f16] {
        self.head(self.v, kv_head)
    }

    fn head(&self, block: &'a [f16], kv_head: usize) -> &'a [f16] {
        assert!(kv_head < self.kv_heads, "kv_head {kv_head} must be < kv_heads {}", self.kv_heads);
        let start = kv_head * self.page_size * self.head_dim;
        // Only the written prefix: slots >= len hold an earlier generation's data (I2).
        &block[start..start + self.len * self.head_dim]
    }
}

/// Shadow tag of one slot: who wrote it, under which lease generation. Generation 0 is
/// never leased, so the initial tag matches no reader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct SlotTag {
    owner: RequestId,
    generation: Generation,
}

pub(super) const UNWRITTEN: SlotTag = SlotTag { owner: RequestId(0), generation: Generation(0) };

impl KvPool {
    pub(super) fn wm_index(&self, page: PageId, layer: usize) -> usize {
        page.index() * self.layout.layers + layer
    }

    /// Start of the K block of `layer` in `page`; the V block follows it.
    fn block_start(&self, page: PageId, layer: usize) -> usize {
        page.index() * self.layout.page_elems() + layer * 2 * self.layout.block_elems()
    }

    /// Makes a page's bytes unreadable before it returns to the free list: watermarks
    /// zeroed, storage poisoned if configured.
    pub(super) fn scrub(&mut self, page: PageId) {
        self.reset_watermarks(page);
        if self.checks.canaries {
            let pe = self.layout.page_elems();
            let start = page.index() * pe;
            self.storage[start..start + pe].fill(POISON);
        }
    }

    pub(super) fn reset_watermarks(&mut self, page: PageId) {
        let start = self.wm_index(page, 0);
        let layers = self.layout.layers;
        self.watermarks[start..start + layers].fill(0);
    }

    /// Appends one token's K and V at `slot` of `layer`. Each of `k`, `v` holds `row_elems`
    /// f32, head-major (head `h` at `[h*head_dim..]`); they are stored rounded to f16.
    /// Append-only: `slot` must equal the layer's watermark and be `< page_size`.
    /// Nothing is written unless every check passes.
    pub fn write(&mut self, lease: &Lease, layer: usize, slot: usize, k: &[f32], v: &[f32]) -> Result<(), KvError> {
        let r = self.write_checked(lease, layer, slot, k, v);
        self.counted(r)
    }

    fn write_checked(&mut self, lease: &Lease, layer: usize, slot: usize, k: &[f32], v: &[f32]) -> Result<(), KvError> {
        self.verify(&lease.tag, Want::Leased)?;
        self.check_layer(layer)?;
        let page = lease.tag.page;
        let row = self.layout.row_elems();
        if k.len() != row || v.len() != row {
            return Err(KvError::RowLength { expected: row, k: k.len(), v: v.len() });
        }
        let page_size = self.layout.page_size;
        if slot >= page_size {
            return Err(KvError::PageFull { page, layer, slot, page_size });
        }
        let wm = self.wm_index(page, layer);
        let watermark = self.watermarks[wm];
        // Append-only: the written slots are always exactly 0..watermark, no holes.
        if slot != watermark {
            return Err(KvError::NonSequentialWrite { page, layer, slot, watermark });
        }

        let hd = self.layout.head_dim;
        let head_stride = page_size * hd;
        let k_block = self.block_start(page, layer);
        let v_block = k_block + self.layout.block_elems();
        for h in 0..self.layout.kv_heads {
            let at = h * head_stride + slot * hd;
            let src = h * hd..(h + 1) * hd;
            for (dst, x) in self.storage[k_block + at..k_block + at + hd].iter_mut().zip(&k[src.clone()]) {
                *dst = f16::from_f32(*x);
            }
            for (dst, x) in self.storage[v_block + at..v_block + at + hd].iter_mut().zip(&v[src]) {
                *dst = f16::from_f32(*x);
            }
        }
        self.watermarks[wm] = slot + 1;
        self.tag_slots(&lease.tag, layer, slot, 1);
        self.writes += 1;
        Ok(())
    }

    /// K and V of the lease's page for `layer`, limited to the slots written in the lease's
    /// generation (the watermark).
    pub fn read<'h>(&self, lease: impl Into<PageHandle<'h>>, layer: usize) -> Result<PageRead<'_>, KvError> {
        self.reader().read(lease, layer)
    }

    /// A reader for one task's many page reads: [`PageReader::read`] checks each read as
    /// [`KvPool::read`] does, and the reader adds what it counted to the pool's statistics
    /// once, when dropped.
    pub fn reader(&self) -> PageReader<'_> {
        PageReader { pool: self, reads: Cell::new(0), refusals: Cell::new(0), fence_checks: Cell::new(0), fence_failures: Cell::new(0) }
    }

    fn read_checked(&self, lease: PageHandle<'_>, layer: usize, count: &impl FenceCount) -> Result<PageRead<'_>, KvError> {
        self.verify_handle(lease, count)?;
        self.check_layer(layer)?;
        let page = lease.tag().page;
        // Never page_size: slots past the watermark hold earlier generations' KV (I2).
        let len = self.watermarks[self.wm_index(page, layer)];
        let block = self.layout.block_elems();
        let k_start = self.block_start(page, layer);
        Ok(PageRead {
            k: &self.storage[k_start..k_start + block],
            v: &self.storage[k_start + block..k_start + 2 * block],
            len,
            kv_heads: self.layout.kv_heads,
            head_dim: self.layout.head_dim,
            page_size: self.layout.page_size,
        })
    }

    /// Records the writer of slots `start..start + count` of `layer` for the auditor.
    fn tag_slots(&mut self, tag: &PageTag, layer: usize, start: usize, count: usize) {
        if self.checks.audit {
            let at = self.wm_index(tag.page, layer) * self.layout.page_size + start;
            self.shadow[at..at + count].fill(SlotTag { owner: tag.owner, generation: tag.generation });
        }
    }

    /// The checks before a forward step attends to the committed positions of `kv`
    /// (design I1, I2, I6). Always: every lease is live (page generation == lease
    /// generation). With canaries: no slot attended to holds [`POISON`]; each slot is
    /// checked once, when first attended to, since a live lease's written slots cannot
    /// change (writes are append-only and a page changes hands only under a new
    /// generation). With the auditor: every slot of every layer, on every call, carries the
    /// shadow tag of this lease, independently of the watermarks.
    pub fn check_reads(&self, kv: &mut SequenceKv) -> Result<(), KvError> {
        let r = self.check_reads_inner(kv);
        self.counted(r)
    }

    fn check_reads_inner(&self, kv: &mut SequenceKv) -> Result<(), KvError> {
        let (ps, len) = (self.layout.page_size, kv.len());
        for page in kv.pages() {
            self.generation_checks.fetch_add(1, Ordering::Relaxed);
            // A shared page is also checked against its fence (I7), on every step.
            self.verify_handle(page.handle(), self)?;
        }
        if self.checks.canaries {
            let from = kv.canary_checked();
            for pos in from..len {
                let (lease, slot) = kv.locate_page(pos)?;
                for layer in 0..self.layout.layers {
                    // First K element of kv head 0: poison fills whole pages.
                    let at = self.block_start(lease.page(), layer) + slot * self.layout.head_dim;
                    if self.storage[at].to_bits() == POISON.to_bits() {
                        self.poisoned_reads.fetch_add(1, Ordering::Relaxed);
                        return Err(KvError::PoisonedSlot { page: lease.page(), layer, slot });
                    }
                }
            }
            self.canary_checks.fetch_add((len - from.min(len)) as u64, Ordering::Relaxed);
            kv.set_canary_checked(len);
        }
        if self.checks.audit {
            for (i, page) in kv.pages().iter().enumerate() {
                let slots = len.saturating_sub(i * ps).min(ps);
                if slots == 0 {
                    break;
                }
                // A shared page's slots carry its writer's tag, in the cached generation.
                let h = page.handle();
                let want = SlotTag { owner: h.writer(), generation: page.generation() };
                for layer in 0..self.layout.layers {
                    let at = self.wm_index(page.page(), layer) * ps;
                    self.audited_slots.fetch_add(slots as u64, Ordering::Relaxed);
                    if let Some(slot) = self.shadow[at..at + slots].iter().position(|t| *t != want) {
                        self.audit_violations.fetch_add(1, Ordering::Relaxed);
                        let found = self.shadow[at + slot];
                        return Err(KvError::AuditViolation {
                            page: page.page(),
                            layer,
                            slot,
                            written_by: found.owner,
                            written_generation: found.generation,
                            reader: want.owner,
                            reader_generation: want.generation,
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// Bytes of one token's KV across all layers in the transfer layout (f16, little-endian).
    pub fn transfer_bytes_per_token(&self) -> usize {
        self.layout.bytes_per_token()
    }

    /// Storage ranges of slots `start..start + count` of `page`, in the transfer layout's
    /// order: `[layer][K, V][kv_head]`, each range `count * head_dim` elements.
    fn transfer_segments(&self, page: PageId, start: usize, count: usize) -> impl Iterator<Item = std::ops::Range<usize>> + use<> {
        let (hd, heads, block) = (self.layout.head_dim, self.layout.kv_heads, self.layout.block_elems());
        let head_stride = self.layout.page_size * hd;
        let starts: Vec<usize> = (0..self.layout.layers).map(|l| self.block_start(page, l)).collect();
        starts
            .into_iter()
            .flat_map(move |k_block| {
                (0..2).flat_map(move |half| (0..heads).map(move |h| k_block + half * block + h * head_stride + start * hd))
            })
            .map(move |at| at..at + count * hd)
    }

    /// Appends to `out` the KV of slots `start..start + count` of the lease's page, all
    /// layers, in the transfer layout `[layer][K, V][kv_head][slot][head_dim]` as f16 LE.
    /// Only written slots can be exported.
    pub fn export_slots<'h>(&self, lease: impl Into<PageHandle<'h>>, start: usize, count: usize, out: &mut Vec<u8>) -> Result<(), KvError> {
        let r = self.export_checked(lease.into(), start, count, out);
        self.counted(r)
    }

    fn export_checked(&self, lease: PageHandle<'_>, start: usize, count: usize, out: &mut Vec<u8>) -> Result<(), KvError> {
        self.verify_handle(lease, self)?;
        let page = lease.tag().page;
        let end = start.saturating_add(count);
        for layer in 0..self.layout.layers {
            let watermark = self.watermarks[self.wm_index(page, layer)];
            if end > watermark {
                return Err(KvError::NotWritten { pos: end - 1, layer, page, watermark });
            }
        }
        out.reserve(count * self.layout.bytes_per_token());
        for seg in self.transfer_segments(page, start, count) {
            f16_to_le(&self.storage[seg], out);
        }
        Ok(())
    }

    /// Writes slots `start..start + count` of the lease's page, all layers, from `data` in the
    /// transfer layout (see [`KvPool::export_slots`]). Append-only: `start` must equal every
    /// layer's watermark. Nothing is written unless every check passes.
    pub fn import_slots(&mut self, lease: &Lease, start: usize, count: usize, data: &[u8]) -> Result<(), KvError> {
        let r = self.import_checked(lease, start, count, data);
        self.counted(r)
    }

    fn import_checked(&mut self, lease: &Lease, start: usize, count: usize, data: &[u8]) -> Result<(), KvError> {
        self.verify(&lease.tag, Want::Leased)?;
        let page = lease.tag.page;
        let page_size = self.layout.page_size;
        if count == 0 || start.saturating_add(count) > page_size {
            return Err(KvError::PageFull { page, layer: 0, slot: start.saturating_add(count), page_size });
        }
        let expected = count * self.layout.bytes_per_token();
        if data.len() != expected {
            return Err(KvError::RowLength { expected, k: data.len(), v: 0 });
        }
        for layer in 0..self.layout.layers {
            let watermark = self.watermarks[self.wm_index(page, layer)];
            if start != watermark {
                return Err(KvError::NonSequentialWrite { page, layer, slot: start, watermark });
            }
        }
        // `data` is exactly the segments' bytes (checked above), so every split is in range.
        let mut rest = data;
        for seg in self.transfer_segments(page, start, count) {
            let (bytes, tail) = rest.split_at(seg.len() * 2);
            f16_from_le(bytes, &mut self.storage[seg]);
            rest = tail;
        }
        for layer in 0..self.layout.layers {
            let wm = self.wm_index(page, layer);
            self.watermarks[wm] = start + count;
            self.tag_slots(&lease.tag, layer, start, count);
        }
        self.writes += 1;
        Ok(())
    }

    /// Un-writes slots `keep..` of every layer of the lease's page (the slots of rejected
    /// speculative positions, design I2 as amended for speculation): each watermark falls to
    /// at most `keep`, so a read ends before them, a commit over them fails and the next
    /// write lands at `keep`; with canaries they are poisoned again and with the auditor
    /// their tags cleared, so they look exactly as never written in this generation.
    pub(crate) fn unwrite(&mut self, lease: &Lease, keep: usize) -> Result<(), KvError> {
        self.verify(&lease.tag, Want::Leased)?;
        let (page, hd, ps) = (lease.tag.page, self.layout.head_dim, self.layout.page_size);
        for layer in 0..self.layout.layers {
            let wm = self.wm_index(page, layer);
            let written = self.watermarks[wm];
            if written <= keep {
                continue;
            }
            self.watermarks[wm] = keep;
            if self.checks.canaries {
                let k_block = self.block_start(page, layer);
                for h in 0..2 * self.layout.kv_heads {
                    // K heads, then V heads: a block is page_size slots of head_dim each.
                    let at = k_block + h * ps * hd;
                    self.storage[at + keep * hd..at + written * hd].fill(POISON);
                }
            }
            if self.checks.audit {
                let at = wm * ps;
                self.shadow[at + keep..at + written].fill(UNWRITTEN);
            }
        }
        Ok(())
    }

    /// Slots written in `layer` of the lease's page in its generation.
    pub fn watermark<'h>(&self, lease: impl Into<PageHandle<'h>>, layer: usize) -> Result<usize, KvError> {
        let lease = lease.into();
        let r = self
            .verify_handle(lease, self)
            .and_then(|()| self.check_layer(layer))
            .map(|()| self.watermarks[self.wm_index(lease.tag().page, layer)]);
        self.counted(r)
    }

    /// Whether every element of `page` holds [`POISON`]. Reveals one bit, never KV values;
    /// meant for tests and canaries ("check that poisoning really ran", I6).
    pub fn page_is_poisoned(&self, page: PageId) -> Result<bool, KvError> {
        if page.index() >= self.meta.len() {
            return Err(KvError::PageOutOfRange { page, pages: self.meta.len() });
        }
        let pe = self.layout.page_elems();
        let start = page.index() * pe;
        Ok(self.storage[start..start + pe].iter().all(|x| x.to_bits() == POISON.to_bits()))
    }
}

/// Appends `src` to `out` as f16 little-endian: on a little-endian host one copy of the
/// slice's bytes (the transfer runs at memory speed), elsewhere element by element.
fn f16_to_le(src: &[f16], out: &mut Vec<u8>) {
    if cfg!(target_endian = "little") {
        out.extend_from_slice(zerocopy::IntoBytes::as_bytes(src));
    } else {
        out.extend(src.iter().flat_map(|x| x.to_bits().to_le_bytes()));
    }
}

/// Fills `dst` from f16 little-endian `bytes` (exactly `2 × dst.len()` of them), the
/// inverse of [`f16_to_le`].
fn f16_from_le(bytes: &[u8], dst: &mut [f16]) {
    if cfg!(target_endian = "little") {
        zerocopy::IntoBytes::as_mut_bytes(dst).copy_from_slice(bytes);
    } else {
        for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
            *d = f16::from_bits(u16::from_le_bytes([b[0], b[1]]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{p_lease, pool};
    use super::*;
    use crate::{Fence, KvChecks, KvLayout, PoolConfig};

    /// A reader checks each read as `read` does (a forged lease is refused; a shared page
    /// is checked against its fence) and adds its counts to the pool's once, when dropped.
    #[test]
    fn a_page_reader_checks_every_read_and_counts_when_dropped() {
        let mut p = pool();
        let row = [0.5f32; 4];
        let own = p.lease(RequestId(1)).unwrap();
        let full = p.lease(RequestId(1)).unwrap();
        for layer in 0..2 {
            p.write(&own, layer, 0, &row, &row).unwrap();
            for slot in 0..4 {
                p.write(&full, layer, slot, &row, &row).unwrap();
            }
        }
        let cached = p.publish(full, Fence([1; 16])).map_err(|(e, _)| e).unwrap();
        let shared = p.share(&cached, RequestId(2), Fence([1; 16])).unwrap();
        let forged = Lease::forged(PageTag { owner: RequestId(2), ..own.tag });
        let before = p.stats();
        {
            let r = p.reader();
            assert_eq!(r.read(&own, 1).map(|v| v.len()), Ok(1));
            assert_eq!(r.read(&shared, 0).map(|v| v.len()), Ok(4));
            assert!(matches!(r.read(&forged, 0), Err(KvError::StaleLease { .. })));
            assert!(matches!(r.read(&own, 2), Err(KvError::LayerOutOfRange { .. })));
            let now = p.stats();
            assert_eq!(
                (now.reads, now.refusals, now.fence_checks),
                (before.reads, before.refusals, before.fence_checks),
                "counted on drop only"
            );
        }
        let after = p.stats();
        assert_eq!(after.reads - before.reads, 2);
        assert_eq!(after.refusals - before.refusals, 2);
        assert_eq!((after.fence_checks - before.fence_checks, after.fence_failures), (1, 0));
        p.unshare(shared).unwrap();
        p.release(own).unwrap();
        p.check_invariants();
    }

    #[test]
    fn storage_layout_puts_one_heads_written_slots_in_one_contiguous_slice() {
        let mut p = pool();
        let l = p_lease(&mut p);
        // row = [head0: (a,b), head1: (c,d)]
        p.write(&l, 1, 0, &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0]).unwrap();
        p.write(&l, 1, 1, &[9.0, 10.0, 11.0, 12.0], &[13.0, 14.0, 15.0, 16.0]).unwrap();
        let page = l.page().index() * p.layout.page_elems();
        let block = p.layout.block_elems(); // 2 heads * 4 slots * 2 = 16
        let k1 = page + 2 * block; // layer 1 K
        let f = |x: f32| f16::from_f32(x);
        assert_eq!(&p.storage[k1..k1 + 4], &[f(1.0), f(2.0), f(9.0), f(10.0)]);
        assert_eq!(&p.storage[k1 + 8..k1 + 12], &[f(3.0), f(4.0), f(11.0), f(12.0)]);
        let v1 = k1 + block;
        assert_eq!(&p.storage[v1 + 8..v1 + 12], &[f(7.0), f(8.0), f(15.0), f(16.0)]);
        p.release(l).unwrap();
    }

    /// A page that held request 1's KV, freed and leased to request 2, with its watermarks
    /// forced up as a watermark bug would: request 2 commits slots it never wrote. Returns
    /// the pool and request 2's sequence with 3 committed positions (only slot 0 written).
    fn stale_read_setup(checks: KvChecks) -> (KvPool, SequenceKv) {
        let layout = KvLayout { layers: 2, kv_heads: 1, head_dim: 2, page_size: 4 };
        let mut p = KvPool::new(PoolConfig { layout, pages: 1, checks }).unwrap();
        let row = [0.25f32; 2];
        let mut first = SequenceKv::new(RequestId(1));
        first.reserve(&mut p, 4).unwrap();
        for layer in 0..2 {
            for slot in 0..3 {
                p.write(first.locate(0).unwrap().0, layer, slot, &row, &row).unwrap();
            }
        }
        first.release(&mut p).unwrap();
        let mut second = SequenceKv::new(RequestId(2));
        second.reserve(&mut p, 4).unwrap();
        for layer in 0..2 {
            p.write(second.locate(0).unwrap().0, layer, 0, &row, &row).unwrap();
        }
        let page = second.pages()[0].page();
        for layer in 0..2 {
            let wm = p.wm_index(page, layer);
            p.watermarks[wm] = 3;
        }
        second.commit(&p, 3).unwrap();
        (p, second)
    }

    #[test]
    fn the_canary_refuses_a_slot_not_written_since_its_page_was_freed() {
        let (p, mut seq) = stale_read_setup(KvChecks { audit: false, ..KvChecks::all() });
        let page = seq.pages()[0].page();
        assert_eq!(p.check_reads(&mut seq), Err(KvError::PoisonedSlot { page, layer: 0, slot: 1 }));
        let st = p.stats();
        assert_eq!((st.poisoned_reads, st.generation_checks, st.audit_violations), (1, 1, 0));
    }

    #[test]
    fn the_auditor_refuses_a_slot_written_by_the_previous_owner() {
        // Without canaries the stale slot holds request 1's real KV: only the auditor sees it.
        let (p, mut seq) = stale_read_setup(KvChecks { canaries: false, ..KvChecks::all() });
        let page = seq.pages()[0].page();
        assert_eq!(
            p.check_reads(&mut seq),
            Err(KvError::AuditViolation {
                page,
                layer: 0,
                slot: 1,
                written_by: RequestId(1),
                written_generation: Generation(1),
                reader: RequestId(2),
                reader_generation: Generation(2),
            })
        );
        assert_eq!((p.stats().audit_violations, p.stats().poisoned_reads), (1, 0));
    }

    /// A sequence of request 2 that wrote 3 positions (canary-checked), rolled back to 1 as
    /// a rejected speculative draft is, and then a planted bug: the pool's watermarks
    /// forced back up and 3 positions committed again, slots 1 and 2 unwritten since.
    fn rolled_back_then_forced(checks: KvChecks) -> (KvPool, SequenceKv) {
        let layout = KvLayout { layers: 2, kv_heads: 2, head_dim: 2, page_size: 4 };
        let mut p = KvPool::new(PoolConfig { layout, pages: 1, checks }).unwrap();
        let row = [0.5f32; 4];
        let mut seq = SequenceKv::new(RequestId(2));
        seq.reserve(&mut p, 4).unwrap();
        for layer in 0..2 {
            for slot in 0..3 {
                p.write(seq.locate(0).unwrap().0, layer, slot, &row, &row).unwrap();
            }
        }
        seq.commit(&p, 3).unwrap();
        p.check_reads(&mut seq).unwrap();
        seq.roll_back(&mut p, 1).unwrap();
        let page = seq.pages()[0].page();
        for layer in 0..2 {
            assert_eq!(p.watermark(seq.locate(0).unwrap().0, layer), Ok(1));
            let wm = p.wm_index(page, layer);
            p.watermarks[wm] = 3;
        }
        seq.commit(&p, 2).unwrap();
        (p, seq)
    }

    #[test]
    fn a_rolled_back_slot_is_poisoned_again_and_checked_again() {
        let (p, mut seq) = rolled_back_then_forced(KvChecks { audit: false, ..KvChecks::all() });
        let page = seq.pages()[0].page();
        // Slot 1 was canary-checked before the roll-back: the mark fell with it.
        assert_eq!(p.check_reads(&mut seq), Err(KvError::PoisonedSlot { page, layer: 0, slot: 1 }));
        // Every K and V head of the un-written slots, not just the first element's.
        let (hd, ps) = (2, 4);
        for layer in 0..2 {
            let block = p.block_start(page, layer);
            for h in 0..4 {
                let at = block + h * ps * hd;
                assert!(p.storage[at..at + hd].iter().all(|x| x.to_bits() != POISON.to_bits()), "slot 0 kept");
                assert!(p.storage[at + hd..at + 3 * hd].iter().all(|x| x.to_bits() == POISON.to_bits()), "slots 1, 2 poisoned");
            }
        }
    }

    #[test]
    fn the_auditor_refuses_a_rolled_back_slot() {
        // Without canaries the slot still holds the rejected draft's KV: the auditor's tag
        // is what says it was un-written.
        let (p, mut seq) = rolled_back_then_forced(KvChecks { canaries: false, ..KvChecks::all() });
        let page = seq.pages()[0].page();
        assert_eq!(
            p.check_reads(&mut seq),
            Err(KvError::AuditViolation {
                page,
                layer: 0,
                slot: 1,
                written_by: RequestId(0),
                written_generation: Generation(0),
                reader: RequestId(2),
                reader_generation: Generation(1),
            })
        );
    }

    #[test]
    fn without_canaries_or_auditor_the_stale_read_goes_unnoticed() {
        // What the two tests above guard against: the remaining checks pass it.
        let (p, mut seq) = stale_read_setup(KvChecks { canaries: false, checksums: true, audit: false });
        assert_eq!(p.check_reads(&mut seq), Ok(()));
    }

    #[test]
    fn faithful_sequences_pass_every_read_check_and_canaries_run_once_per_slot() {
        let layout = KvLayout { layers: 2, kv_heads: 1, head_dim: 2, page_size: 4 };
        let mut p = KvPool::new(PoolConfig { layout, pages: 2, checks: KvChecks::all() }).unwrap();
        let mut seq = SequenceKv::new(RequestId(5));
        seq.reserve(&mut p, 6).unwrap();
        let row = [0.5f32; 2];
        for pos in 0..6 {
            let (lease, slot) = seq.locate(pos).unwrap();
            for layer in 0..2 {
                p.write(lease, layer, slot, &row, &row).unwrap();
            }
        }
        seq.commit(&p, 6).unwrap();
        p.check_reads(&mut seq).unwrap();
        p.check_reads(&mut seq).unwrap();
        let st = p.stats();
        // Two leases checked twice; 6 slots canary-checked once; 6 slots x 2 layers audited twice.
        assert_eq!((st.generation_checks, st.canary_checks, st.audited_slots), (4, 6, 24));
        assert_eq!((st.poisoned_reads, st.audit_violations, st.refusals), (0, 0, 0));
        seq.release(&mut p).unwrap();
    }

    #[test]
    fn a_sequence_whose_page_changed_hands_fails_the_generation_check() {
        let layout = KvLayout { layers: 1, kv_heads: 1, head_dim: 2, page_size: 4 };
        let mut p = KvPool::new(PoolConfig { layout, pages: 1, checks: KvChecks::default() }).unwrap();
        let mut seq = SequenceKv::new(RequestId(1));
        seq.reserve(&mut p, 2).unwrap();
        let page = seq.pages()[0].page();
        for q in p.revoke_owner(RequestId(1)) {
            p.release_quarantined(q).unwrap();
        }
        let _other = p.lease(RequestId(2)).unwrap();
        assert_eq!(
            p.check_reads(&mut seq),
            Err(KvError::StaleLease { page, lease_generation: Generation(1), page_generation: Generation(2) })
        );
    }
}
