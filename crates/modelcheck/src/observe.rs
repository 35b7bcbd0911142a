//! Reading the production roles' private state through their `Debug` output.
//!
//! The roles keep their reservations, quarantines and queues private (only the role may
//! touch them); `Debug` is the one complete view they give. These parsers are strict: a
//! change of format that hides a handle makes the pool's counts disagree with the handles
//! found, which the single-lease property reports, so a silent blind spot cannot appear.

use bulkhead_kv::RequestId;

/// A live handle on a decode page: a lease or a quarantine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handle {
    /// Page.
    pub page: u32,
    /// Generation of the lease.
    pub generation: u64,
    /// Request holding it.
    pub owner: RequestId,
    /// Quarantined (not readable or writable, not free).
    pub quarantined: bool,
}

/// A way a chunk for a decode page may still arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteRef {
    /// Page the writer was given.
    pub page: u32,
    /// Generation the writer was given.
    pub generation: u64,
    /// Request it writes for.
    pub req: RequestId,
    /// Where the reference lives.
    pub via: &'static str,
}

/// The number after `key` at or after `from`, and the index past it.
fn number_after(s: &str, from: usize, key: &str) -> Option<(u64, usize)> {
    let at = from + s[from..].find(key)? + key.len();
    let digits = s[at..].bytes().take_while(u8::is_ascii_digit).count();
    Some((s[at..at + digits].parse().ok()?, at + digits))
}

/// Every `Lease` and `Quarantined` handle in a `Debug` dump.
pub fn handles(dump: &str) -> Vec<Handle> {
    let mut out = Vec::new();
    for (marker, quarantined) in [("Lease { tag: Tag {", false), ("Quarantined { tag: Tag {", true)] {
        let mut from = 0;
        while let Some(i) = dump[from..].find(marker) {
            let start = from + i + marker.len();
            let (page, at) = number_after(dump, start, "page: PageId(").expect("a handle names its page");
            let (generation, at) = number_after(dump, at, "generation: Generation(").expect("a handle names its generation");
            let (owner, at) = number_after(dump, at, "owner: RequestId(").expect("a handle names its owner");
            out.push(Handle { page: page as u32, generation, owner: RequestId(owner), quarantined });
            from = at;
        }
    }
    out
}

/// The target pages of every job in a prefill role's queue (`Debug` dump).
pub fn queued_refs(dump: &str) -> Vec<WriteRef> {
    let mut out = Vec::new();
    let marker = "PrefillJob { req: RequestId(";
    let starts: Vec<usize> = dump.match_indices(marker).map(|(i, _)| i).collect();
    for (k, &start) in starts.iter().enumerate() {
        let end = starts.get(k + 1).copied().unwrap_or(dump.len());
        let job = &dump[start..end];
        let (req, mut at) = number_after(job, 0, "RequestId(").expect("a job names its request");
        while let Some((page, next)) = number_after(job, at, "PageRef { page: PageId(") {
            let (generation, next) = number_after(job, next, "generation: Generation(").expect("a page ref names its generation");
            out.push(WriteRef { page: page as u32, generation, req: RequestId(req), via: "prefill queue" });
            at = next;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_kv::transfer::Inbound;
    use bulkhead_kv::{KvPool, KvChecks, PoolConfig};
    use bulkhead_protocol::prefill::{PrefillConfig, PrefillRole};
    use bulkhead_protocol::{Message, Sampling, WorkerId};

    use crate::config::LAYOUT;

    #[test]
    fn handles_are_read_from_the_real_debug_output() {
        let mut pool = KvPool::new(PoolConfig { layout: LAYOUT, pages: 4, checks: KvChecks::all() }).unwrap();
        let inbound = Inbound::reserve(&mut pool, RequestId(7), 3, 4).unwrap();
        let found = handles(&format!("{inbound:?}"));
        assert_eq!(found.len(), 2);
        assert_eq!(found[0], Handle { page: 0, generation: 1, owner: RequestId(7), quarantined: false });
        let q = inbound.into_sequence().quarantine(&mut pool).unwrap();
        let found = handles(&format!("{q:?}"));
        assert_eq!(found[1], Handle { page: 1, generation: 2, owner: RequestId(7), quarantined: true });
    }

    #[test]
    fn queued_jobs_are_read_from_the_real_debug_output() {
        let mut pool = KvPool::new(PoolConfig { layout: LAYOUT, pages: 4, checks: KvChecks::all() }).unwrap();
        let inbound = Inbound::reserve(&mut pool, RequestId(3), 3, 4).unwrap();
        let pages = inbound.prompt_pages(LAYOUT.page_size);
        let mut role = PrefillRole::new(PrefillConfig { max_prompt: 8, page_size: LAYOUT.page_size });
        let sampling = Sampling { temperature: 0.0, top_k: 0, top_p: 1.0, seed: None, ignore_eos: false };
        role.handle(Message::Prefill { req: RequestId(3), tokens: vec![1, 2, 3], decode: WorkerId(1), pages, sampling, trace: Default::default() });
        let refs = queued_refs(&format!("{role:?}"));
        assert_eq!(refs.iter().map(|r| (r.page, r.generation, r.req)).collect::<Vec<_>>(), [(0, 1, RequestId(3)), (1, 2, RequestId(3))]);
    }
}
