//! Bulkhead's KV page pool: the page allocator and the only place KV bytes live.
//!
//! It enforces the isolation contract of the design (I1 ownership, I2 coverage, I4
//! quarantine, I7 sharing): every page is free, leased to one request at one
//! generation, quarantined, or cached read-only for one tenant fence; every read and write goes through a [`Lease`] that is checked against the
//! page's current state, generation and owner; reads see only the slots written in the
//! lease's generation. No model, no I/O, no threads, no `unsafe`.
//!
//! ```
//! use bulkhead_kv::{KvChecks, KvLayout, KvPool, PoolConfig, RequestId, SequenceKv};
//!
//! let layout = KvLayout { layers: 2, kv_heads: 1, head_dim: 2, page_size: 4 };
//! let mut pool = KvPool::new(PoolConfig { layout, pages: 8, checks: KvChecks::all() })?;
//! let mut seq = SequenceKv::new(RequestId(1));
//! seq.reserve(&mut pool, 3)?; // one page
//! for pos in 0..3 {
//!     let (lease, slot) = seq.locate(pos)?;
//!     for layer in 0..layout.layers {
//!         pool.write(lease, layer, slot, &[1.0, 2.0], &[3.0, 4.0])?;
//!     }
//! }
//! seq.commit(&pool, 3)?;
//! let read = pool.read(&seq.pages()[0], 0)?;
//! assert_eq!(read.len(), 3); // only written slots, never the whole page
//! assert_eq!(read.k_head(0).len(), 3 * 2);
//! assert_eq!(seq.release(&mut pool).map_err(|u| u.error)?, 1);
//! # Ok::<(), bulkhead_kv::KvError>(())
//! ```
//!
//! # Layout
//! - `ids`: [`PageId`], [`Generation`], [`RequestId`], [`PoolId`] (process-unique pool ids).
//! - `layout`: [`KvLayout`] (page shape and sizes) and [`PoolConfig`].
//! - `error`: [`KvError`], one typed variant per refusal.
//! - `pool`: [`KvPool`], [`Lease`], [`Quarantined`], [`PageRead`], [`PoolStats`], [`POISON`]:
//!   `pool/book.rs` is the bookkeeping (where a page is leased, quarantined, cached; the
//!   allocator's invariants at its top), `pool/storage.rs` the bytes (writes, reads, read
//!   checks, import and export), `pool/handles.rs` the handles callers hold.
//! - `sequence`: [`SequenceKv`], the page table of one sequence: its own pages after any
//!   shared ones ([`SeqPage`]).
//! - `cache`: [`PrefixCache`], full pages published read-only ([`CachedPage`]) and shared
//!   ([`SharedLease`]) with later requests of the same [`Fence`] (I7).
//! - [`transfer`]: the verified handoff between pools: [`Inbound`] checks every chunk and
//!   alone makes a [`VerifiedSequence`]
//!   (or, for a prompt the worker computes itself, a [`LocalPrefill`]).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod cache;
mod error;
mod huge;
mod ids;
mod layout;
mod pool;
mod sequence;
pub mod transfer;

pub use cache::{CacheStats, PrefixCache};
pub use error::KvError;
pub use huge::{HUGE_PAGE, huge_map};
pub use ids::{Fence, Generation, PageId, PageKey, PoolId, RequestId};
pub use layout::{KvChecks, KvLayout, PoolConfig};
pub use pool::{CachedPage, KvPool, Lease, POISON, PageHandle, PageRead, PageReader, PageTag, PoolStats, Quarantined, SharedLease};
pub use sequence::{SeqPage, SequenceKv, Unreleased};
pub use transfer::{ChunkExport, ChunkHeader, Inbound, LocalPrefill, Manifest, PageRef, TransferError, VerifiedSequence};
