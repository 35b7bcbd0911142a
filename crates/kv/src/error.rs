//! [`KvError`]: every refusal of the pool, with the facts that caused it.

use crate::{Generation, KvLayout, PageId, PoolId, RequestId};

/// Errors of the KV pool. Every refused access returns one of these; none reads or writes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// A pool needs at least one page.
    #[error("KV pool must have at least one page")]
    NoPages,
    /// A layout dimension is zero.
    #[error("KV layout field `{field}` is zero")]
    ZeroDimension {
        /// Name of the zero field.
        field: &'static str,
    },
    /// The pool's size does not fit in addressable memory (or page ids exceed `u32`).
    #[error("{pages} KV pages of layout {layout:?} exceed addressable memory or page ids")]
    TooLarge {
        /// Pages requested.
        pages: usize,
        /// Layout requested.
        layout: KvLayout,
    },
    /// The allocator refused the pool's storage.
    #[error("cannot allocate {bytes} bytes of KV storage")]
    OutOfMemory {
        /// Bytes requested.
        bytes: usize,
    },
    /// Not enough free pages; nothing was leased.
    #[error("KV pool exhausted: requested {requested} pages, {free} free")]
    Exhausted {
        /// Pages requested.
        requested: usize,
        /// Pages free at the time.
        free: usize,
    },
    /// A shared prefix that cannot start a reservation: not leased from this pool to its
    /// owner, or covering the whole prompt (the sender must write at least its last
    /// position, whose logits pick the first token).
    #[error("a shared prefix of {pages} pages cannot start a reservation of {prompt} prompt tokens")]
    SharedPrefix {
        /// Shared pages offered.
        pages: usize,
        /// Prompt tokens reserved.
        prompt: usize,
    },
    /// A lease (or quarantine handle) made by another pool.
    #[error("lease from KV pool {lease_pool} presented to KV pool {pool}")]
    ForeignLease {
        /// Pool that made the lease.
        lease_pool: PoolId,
        /// Pool it was presented to.
        pool: PoolId,
    },
    /// The lease no longer matches its page: the page is not (or no longer) in the state
    /// the handle claims, or was re-leased (generation differs), or to another owner.
    #[error("stale lease on page {page}: lease generation {lease_generation}, page generation {page_generation}")]
    StaleLease {
        /// Page named by the lease.
        page: PageId,
        /// Generation the lease carries.
        lease_generation: Generation,
        /// Page's current generation.
        page_generation: Generation,
    },
    /// Layer index past the layout's layers.
    #[error("layer {layer} out of range: layout has {layers} layers")]
    LayerOutOfRange {
        /// Layer asked for.
        layer: usize,
        /// Layers in the layout.
        layers: usize,
    },
    /// Writes are append-only: the slot must equal the layer's watermark.
    #[error("non-sequential write to page {page} layer {layer}: slot {slot}, watermark {watermark}")]
    NonSequentialWrite {
        /// Page written.
        page: PageId,
        /// Layer written.
        layer: usize,
        /// Slot asked for.
        slot: usize,
        /// Slots already written in this layer and generation.
        watermark: usize,
    },
    /// Slot past the end of the page.
    #[error("page {page} layer {layer} is full: slot {slot} >= page size {page_size}")]
    PageFull {
        /// Page written.
        page: PageId,
        /// Layer written.
        layer: usize,
        /// Slot asked for.
        slot: usize,
        /// Slots per page.
        page_size: usize,
    },
    /// A K or V row of the wrong length.
    #[error("KV row length: expected {expected} elements, got k {k}, v {v}")]
    RowLength {
        /// `kv_heads * head_dim`.
        expected: usize,
        /// Length of K given.
        k: usize,
        /// Length of V given.
        v: usize,
    },
    /// Page id past the pool's pages.
    #[error("page {page} out of range: pool has {pages} pages")]
    PageOutOfRange {
        /// Page asked for.
        page: PageId,
        /// Pages in the pool.
        pages: usize,
    },
    /// A sequence position (or commit end) past the pages the sequence reserved.
    #[error("position {pos} not reserved: sequence holds {reserved} token slots")]
    NotReserved {
        /// Position asked for.
        pos: usize,
        /// Token slots reserved.
        reserved: usize,
    },
    /// A roll-back to a length past the committed one, or into the shared prefix.
    #[error("cannot roll back to {to} tokens: {committed} committed, the first {shared} shared")]
    BadRollBack {
        /// Length asked for.
        to: usize,
        /// Committed length.
        committed: usize,
        /// Tokens in shared (read-only) pages.
        shared: usize,
    },
    /// A commit covers a position whose KV is not written in some layer.
    #[error("cannot commit position {pos}: page {page} layer {layer} has only {watermark} slots written")]
    NotWritten {
        /// First position not written.
        pos: usize,
        /// Layer missing it.
        layer: usize,
        /// Page holding it.
        page: PageId,
        /// That layer's watermark on that page.
        watermark: usize,
    },
    /// A slot about to be attended to still holds [`POISON`](crate::POISON): it was never
    /// written since its page was last freed (a canary, design I2/I6).
    #[error("page {page} layer {layer} slot {slot} holds the poison canary: it was not written in this lease")]
    PoisonedSlot {
        /// Page holding the slot.
        page: PageId,
        /// Layer.
        layer: usize,
        /// Slot within the page.
        slot: usize,
    },
    /// The KV auditor found a slot about to be attended to whose shadow tag names another
    /// writer than the reader's lease (design I1/I2).
    #[error(
        "KV audit: page {page} layer {layer} slot {slot} was written by request {written_by} at generation {written_generation}, read by request {reader} at generation {reader_generation}"
    )]
    AuditViolation {
        /// Page holding the slot.
        page: PageId,
        /// Layer.
        layer: usize,
        /// Slot within the page.
        slot: usize,
        /// Request whose write the shadow tag records.
        written_by: RequestId,
        /// Generation of that write's lease.
        written_generation: Generation,
        /// Request about to read the slot.
        reader: RequestId,
        /// Generation of the reader's lease.
        reader_generation: Generation,
    },
    /// A cached page was asked for, or read, under another (tenant, salt) fence than the
    /// one it was written under (design I7): the cache key pointed at the wrong entry.
    #[error("page {page} is cached for another tenant or salt: fence mismatch")]
    FenceMismatch {
        /// The cached page.
        page: PageId,
    },
    /// A shared page cannot be written; only its writer's own lease could, before it was
    /// published (design I7).
    #[error("position {pos} lies in a shared read-only page")]
    ReadOnly {
        /// The position.
        pos: usize,
    },
    /// Only a page written to the last slot in every layer can be published to the cache.
    #[error("page {page} is not full (layer {layer} holds {watermark} slots): only full pages are shared")]
    NotFull {
        /// The page.
        page: PageId,
        /// A layer that is not full.
        layer: usize,
        /// Its watermark.
        watermark: usize,
    },
    /// A cached page with readers cannot be evicted (design I7).
    #[error("page {page} has {readers} readers: it cannot be evicted")]
    InUse {
        /// The page.
        page: PageId,
        /// Shared leases on it.
        readers: usize,
    },
    /// Shared pages must come first in a sequence, before any page of its own.
    #[error("shared pages can only start an empty sequence")]
    NotEmpty,
}
