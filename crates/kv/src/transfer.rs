//! The verified KV handoff (I1, I2): how KV computed in one pool lands in another.
//!
//! The sender exports written slots page by page ([`ChunkExport`]); each chunk names the
//! receiver's page and generation (from its reservation), a slot range and an xxh3-64
//! checksum of the bytes. The receiver's [`Inbound`] checks every chunk against its own
//! leases as it lands, and only [`Inbound::finish`] — after checking that the written slots
//! cover exactly the reserved prompt tokens, in the current generations, with a matching
//! manifest of every chunk — produces a [`VerifiedSequence`], the only thing a decode
//! scheduler accepts. "Transfer complete" from the sender is a claim to check, never trusted.
//!
//! xxh3-64 is a fast non-cryptographic hash: it detects corruption, not forgery (a sender
//! that can write KV can already write wrong KV into its own request's pages).

use bulkhead_fingerprint::Fingerprint;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::{Generation, KvError, KvPool, PageId, RequestId, SequenceKv, SharedLease};

/// A page of a reservation, as handed to the sender.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Fingerprint)]
pub struct PageRef {
    /// Receiver's page.
    pub page: PageId,
    /// The generation the receiver leased it at.
    pub generation: Generation,
}

/// What a chunk claims about its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
pub struct ChunkHeader {
    /// Receiver's page the bytes are for.
    pub page: PageId,
    /// Generation of that page the sender was given.
    pub generation: Generation,
    /// First slot within the page.
    pub slot_start: u32,
    /// Number of slots.
    pub slot_count: u32,
    /// xxh3-64 of the bytes.
    pub checksum: u64,
}

impl ChunkHeader {
    /// Bytes of [`ChunkHeader::bytes`].
    pub const LEN: usize = 28;

    /// The header's fields, little-endian, in declaration order: what the manifest folds and
    /// what a `KvChunk` frame carries.
    pub fn bytes(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..4].copy_from_slice(&self.page.0.to_le_bytes());
        b[4..12].copy_from_slice(&self.generation.0.to_le_bytes());
        b[12..16].copy_from_slice(&self.slot_start.to_le_bytes());
        b[16..20].copy_from_slice(&self.slot_count.to_le_bytes());
        b[20..28].copy_from_slice(&self.checksum.to_le_bytes());
        b
    }
}

/// Checksum of a chunk's bytes (xxh3-64).
pub fn checksum(data: &[u8]) -> u64 {
    xxh3_64(data)
}

/// Digest of a sequence of chunk headers, in order: both sides compute it, the sender sends
/// its value with "done", the receiver compares.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Manifest(u64);

/// Renamed in order of first appearance: a hash over chunk headers (which hold
/// generations), only ever compared for equality.
impl bulkhead_fingerprint::Fingerprint for Manifest {
    fn fingerprint(&self, h: &mut bulkhead_fingerprint::Fingerprinter) {
        h.manifest(self.0);
    }
}

impl Manifest {
    /// Fold in the next chunk.
    pub fn add(&mut self, h: &ChunkHeader) {
        self.0 = xxh3_64_with_seed(&h.bytes(), self.0);
    }

    /// The digest so far.
    pub fn digest(&self) -> u64 {
        self.0
    }
}

/// Why a chunk or a completion was refused. Any of these fails the request.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[allow(missing_docs)] // each variant's `#[error]` message is its documentation
pub enum TransferError {
    #[error("chunk for page {page} generation {generation}, which is not a prompt page of this reservation")]
    UnknownPage { page: PageId, generation: Generation },
    #[error("chunk for page {page} at generation {chunk}, reserved at generation {reserved}")]
    StaleGeneration { page: PageId, chunk: Generation, reserved: Generation },
    #[error("chunk for page {page} starts at position {start}, expected {expected} (chunks arrive in order)")]
    OutOfOrder { page: PageId, start: usize, expected: usize },
    #[error("chunk for page {page} ends at position {end}, past the {prompt} reserved prompt tokens")]
    BeyondPrompt { page: PageId, end: usize, prompt: usize },
    #[error("chunk for page {page} has checksum {actual:#x}, header says {claimed:#x}")]
    Checksum { page: PageId, claimed: u64, actual: u64 },
    #[error("sender reports {claimed} prompt tokens, {reserved} were reserved")]
    TokenCount { claimed: usize, reserved: usize },
    #[error("short transfer: {received} of {reserved} prompt tokens written")]
    ShortTransfer { received: usize, reserved: usize },
    #[error("manifest digest {claimed:#x} does not match the chunks received ({actual:#x})")]
    Manifest { claimed: u64, actual: u64 },
    #[error(transparent)]
    Kv(#[from] KvError),
}

/// The receiving side of one request's handoff: its reservation and what has landed.
#[derive(Debug, Fingerprint)]
pub struct Inbound {
    seq: SequenceKv,
    prompt_tokens: usize,
    received: usize,
    manifest: Manifest,
}

/// A sequence whose prompt KV was verified complete. Only [`Inbound::finish`] makes one.
#[derive(Debug)]
pub struct VerifiedSequence {
    seq: SequenceKv,
    prompt_tokens: usize,
}

impl VerifiedSequence {
    /// Prompt tokens whose KV is in place (the sequence's committed length).
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// The request it belongs to.
    pub fn owner(&self) -> RequestId {
        self.seq.owner()
    }

    /// The sequence, for the decode loop to extend.
    pub fn into_sequence(self) -> SequenceKv {
        self.seq
    }

    /// Publishes the verified prompt's own full pages to `cache` under `fence` (`keys[i]`
    /// names page `i`) and keeps reading them shared ([`PrefixCache::publish_prefix`](crate::PrefixCache::publish_prefix)):
    /// later requests of the scope share them while this one still decodes. Returns the
    /// pages published.
    pub fn publish_prompt(
        &mut self,
        pool: &mut KvPool,
        cache: &mut crate::PrefixCache,
        keys: &[crate::PageKey],
        fence: crate::Fence,
    ) -> usize {
        let full = self.prompt_tokens / pool.layout().page_size;
        cache.publish_prefix(pool, &mut self.seq, keys, full, fence)
    }
}

/// A reservation whose prompt past its shared prefix this worker computes itself instead of
/// receiving it: no sender was told of its pages, so none can write them. Only
/// [`Inbound::compute_here`] makes one. Its positions count only once the worker's own
/// forward pass has written them and [`SequenceKv::commit`] has checked every layer's
/// watermark (I2): the forward pass writes from the committed length on, and attention
/// refuses a position its page does not hold written in this generation.
#[derive(Debug)]
pub struct LocalPrefill {
    seq: SequenceKv,
    prompt_tokens: usize,
}

impl LocalPrefill {
    /// Prompt tokens reserved (the shared prefix and what is to be computed).
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// Leading prompt tokens held in shared (cached) pages: computing starts here.
    pub fn shared_tokens(&self) -> usize {
        self.seq.shared_tokens()
    }

    /// The request it belongs to.
    pub fn owner(&self) -> RequestId {
        self.seq.owner()
    }

    /// The sequence, for the forward pass to write and commit.
    pub fn into_sequence(self) -> SequenceKv {
        self.seq
    }
}

impl Inbound {
    /// Reserve pages for `total_tokens` (prompt + generation), all or nothing, for a prompt of
    /// `prompt_tokens` that a sender will write.
    pub fn reserve(pool: &mut KvPool, owner: RequestId, prompt_tokens: usize, total_tokens: usize) -> Result<Self, KvError> {
        Self::reserve_after(pool, owner, Vec::new(), prompt_tokens, total_tokens).map_err(|(e, _)| e)
    }

    /// Like [`Inbound::reserve`], for a prompt whose first pages this pool holds already:
    /// `shared`, leased read-only to `owner` from this pool's cache (design I10). They count
    /// towards coverage only as these live shared leases; the sender writes the rest, from
    /// the first position past them. At least the prompt's last position must be left to
    /// the sender. On failure the shared leases come back with the error, for the caller to
    /// give back.
    pub fn reserve_after(
        pool: &mut KvPool,
        owner: RequestId,
        shared: Vec<SharedLease>,
        prompt_tokens: usize,
        total_tokens: usize,
    ) -> Result<Self, (KvError, Vec<SharedLease>)> {
        let page_size = pool.layout().page_size;
        let mut seq = SequenceKv::new(owner);
        if !shared.is_empty() {
            let refused = KvError::SharedPrefix { pages: shared.len(), prompt: prompt_tokens };
            if shared.len() * page_size >= prompt_tokens {
                return Err((refused, shared));
            }
            seq.attach_shared(pool, shared).map_err(|shared| (refused, shared))?;
        }
        if let Err(e) = seq.reserve(pool, total_tokens.max(prompt_tokens)) {
            // Reserve is all or nothing: only the shared prefix is held.
            let shared = seq.into_pages().into_iter().filter_map(|p| p.into_shared()).collect();
            return Err((e, shared));
        }
        let received = seq.shared_tokens();
        Ok(Inbound { seq, prompt_tokens, received, manifest: Manifest::default() })
    }

    /// Leading prompt tokens held in shared (cached) pages: the sender writes from here.
    pub fn shared_tokens(&self) -> usize {
        self.seq.shared_tokens()
    }

    /// The pages the sender may write: its own pages holding prompt positions, in order
    /// (the first holds position [`Inbound::shared_tokens`]).
    pub fn prompt_pages(&self, page_size: usize) -> Vec<PageRef> {
        self.seq
            .pages()
            .iter()
            .take(self.prompt_tokens.div_ceil(page_size))
            .filter(|p| !p.is_shared())
            .map(|l| PageRef { page: l.page(), generation: l.generation() })
            .collect()
    }

    /// The request this reservation belongs to.
    pub fn owner(&self) -> RequestId {
        self.seq.owner()
    }

    /// The reservation's pages, in position order (shared prefix, own prompt pages, the rest).
    pub fn pages(&self) -> &[crate::SeqPage] {
        self.seq.pages()
    }

    /// Prompt tokens in place so far: the shared prefix and what was written after it.
    pub fn received_tokens(&self) -> usize {
        self.received
    }

    /// Prompt tokens a sender wrote here so far (past the shared prefix): none means no
    /// writer has touched the reservation.
    pub fn written_tokens(&self) -> usize {
        self.received - self.seq.shared_tokens()
    }

    /// Prompt tokens reserved.
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// Check one chunk against this reservation and, if every check passes, write it.
    pub fn accept(&mut self, pool: &mut KvPool, h: &ChunkHeader, data: &[u8]) -> Result<(), TransferError> {
        let page_size = pool.layout().page_size;
        let prompt_pages = self.prompt_tokens.div_ceil(page_size);
        // Only the reservation's own prompt pages are written: a shared page is never a
        // target, whatever page number a chunk names.
        let own = |l: &crate::SeqPage| !l.is_shared() && l.page() == h.page;
        let Some(index) = self.seq.pages().iter().take(prompt_pages).position(own) else {
            return Err(TransferError::UnknownPage { page: h.page, generation: h.generation });
        };
        let (lease, _) = self.seq.locate(index * page_size)?;
        if lease.generation() != h.generation {
            return Err(TransferError::StaleGeneration { page: h.page, chunk: h.generation, reserved: lease.generation() });
        }
        let start = index * page_size + h.slot_start as usize;
        if start != self.received {
            return Err(TransferError::OutOfOrder { page: h.page, start, expected: self.received });
        }
        let end = start + h.slot_count as usize;
        if end > self.prompt_tokens {
            return Err(TransferError::BeyondPrompt { page: h.page, end, prompt: self.prompt_tokens });
        }
        if pool.checks().checksums {
            let actual = checksum(data);
            if actual != h.checksum {
                return Err(TransferError::Checksum { page: h.page, claimed: h.checksum, actual });
            }
        }
        pool.import_slots(lease, h.slot_start as usize, h.slot_count as usize, data)?;
        self.received = end;
        self.manifest.add(h);
        Ok(())
    }

    /// The sender says it is done: verify coverage, token count and manifest. On failure the
    /// sequence comes back with the error, for the caller to quarantine or release.
    pub fn finish(mut self, pool: &KvPool, claimed_tokens: usize, manifest: u64) -> Result<VerifiedSequence, (TransferError, SequenceKv)> {
        let check = || {
            if claimed_tokens != self.prompt_tokens {
                return Err(TransferError::TokenCount { claimed: claimed_tokens, reserved: self.prompt_tokens });
            }
            if self.received != self.prompt_tokens {
                return Err(TransferError::ShortTransfer { received: self.received, reserved: self.prompt_tokens });
            }
            if manifest != self.manifest.digest() {
                return Err(TransferError::Manifest { claimed: manifest, actual: self.manifest.digest() });
            }
            Ok(())
        };
        if let Err(e) = check() {
            return Err((e, self.seq));
        }
        // commit re-checks every layer's watermark on every page against the positions.
        let written = self.prompt_tokens - self.seq.len();
        match self.seq.commit(pool, written) {
            Ok(()) => Ok(VerifiedSequence { seq: self.seq, prompt_tokens: self.prompt_tokens }),
            Err(e) => Err((e.into(), self.seq)),
        }
    }

    /// Compute the prompt here instead of receiving it (the decode worker holds all but a
    /// short rest). Refused, with the reservation back, once any sender wrote into it.
    pub fn compute_here(self) -> Result<LocalPrefill, Inbound> {
        if self.written_tokens() != 0 {
            return Err(self);
        }
        Ok(LocalPrefill { seq: self.seq, prompt_tokens: self.prompt_tokens })
    }

    /// Give up on the transfer; the caller quarantines or releases the pages.
    pub fn into_sequence(self) -> SequenceKv {
        self.seq
    }
}

/// The chunks the sender makes for the positions `from..to` of its own sequence `src`,
/// addressed to the receiver's `targets` (its prompt pages, in order), one chunk per page
/// segment, each exported into a buffer the caller gives: the frame it travels in, so a
/// chunk's bytes are copied once, out of the pool, and hashed while hot in cache. The
/// manifest is folded as chunks are made.
pub struct ChunkExport<'a> {
    pool: &'a KvPool,
    src: &'a SequenceKv,
    targets: &'a [PageRef],
    /// The position `targets[0]` starts at: the receiver's shared prefix, which is not sent.
    base: usize,
    pos: usize,
    to: usize,
    manifest: &'a mut Manifest,
}

impl<'a> ChunkExport<'a> {
    /// The chunks for `from..to` (none if `from >= to`), addressed to `targets`, the
    /// receiver's pages from position `base` on (a multiple of the page size: the prefix
    /// it holds already). Positions before `base` are never sent.
    pub fn new(
        pool: &'a KvPool,
        src: &'a SequenceKv,
        targets: &'a [PageRef],
        base: usize,
        from: usize,
        to: usize,
        manifest: &'a mut Manifest,
    ) -> Self {
        ChunkExport { pool, src, targets, base, pos: from.max(base), to, manifest }
    }

    /// Append the next chunk's bytes to `out` and return its header; `None` once every chunk
    /// is out. On an error `out` is as it was and no further chunk comes.
    pub fn next_into(&mut self, out: &mut Vec<u8>) -> Option<Result<ChunkHeader, KvError>> {
        if self.pos >= self.to {
            return None;
        }
        let start = out.len();
        let r = self.export_next(out);
        if r.is_err() {
            out.truncate(start);
            self.pos = self.to;
        }
        Some(r)
    }

    fn export_next(&mut self, out: &mut Vec<u8>) -> Result<ChunkHeader, KvError> {
        let page_size = self.pool.layout().page_size;
        let pos = self.pos;
        // Cached (shared) pages travel like the request's own: the receiver verifies both.
        let (lease, slot) = self.src.locate_page(pos)?;
        let count = (page_size - slot).min(self.to - pos);
        let target = self
            .targets
            .get((pos - self.base) / page_size)
            .ok_or(KvError::NotReserved { pos, reserved: self.base + self.targets.len() * page_size })?;
        let start = out.len();
        self.pool.export_slots(lease, slot, count, out)?;
        let h = ChunkHeader {
            page: target.page,
            generation: target.generation,
            slot_start: slot as u32,
            slot_count: count as u32,
            // Without checksums (measurement only) the receiver must not verify either.
            checksum: if self.pool.checks().checksums { checksum(&out[start..]) } else { 0 },
        };
        self.manifest.add(&h);
        self.pos += count;
        Ok(h)
    }
}

/// Every chunk of [`ChunkExport`] for `from..to`, each in its own buffer (tests and the
/// simulated links; the production link exports each straight into its frame).
pub fn export_chunks(
    pool: &KvPool,
    src: &SequenceKv,
    targets: &[PageRef],
    from: usize,
    to: usize,
    manifest: &mut Manifest,
) -> Result<Vec<(ChunkHeader, Vec<u8>)>, KvError> {
    let mut chunks = ChunkExport::new(pool, src, targets, 0, from, to, manifest);
    let mut out = Vec::new();
    loop {
        let mut data = Vec::new();
        match chunks.next_into(&mut data) {
            Some(header) => out.push((header?, data)),
            None => return Ok(out),
        }
    }
}
