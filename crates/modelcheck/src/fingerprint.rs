//! The state fingerprint: which replayed worlds the checker treats as one state.
//!
//! The model's state is the history of actions; the production state it stands for is
//! rebuilt by replaying that history. Two histories are the same state when their worlds
//! are the same up to renamings the production code cannot tell apart:
//!
//! - **Generations** are renamed in order of first appearance. The pool only ever compares
//!   generations for equality and draws fresh ones above all earlier ones, so two worlds
//!   whose generations differ by a consistent renaming behave alike.
//! - **Manifest digests** (in the verifier, in a prefill job and in `Done`) are renamed
//!   likewise: they are hashes over chunk headers, which contain generations, and are only
//!   compared for equality.
//! - **Pool ids** are dropped: every replay makes new pools, and a pool id is only ever
//!   compared with the one pool of the same worker.
//! - **Counters** (`stats` of every role and pool) are dropped: no decision reads them.
//! - **Error details** (`detail` strings) are dropped: they are text for people, and they
//!   quote page and generation numbers.
//! - **Chunk bytes** are dropped; the chunk's checksum stays (the bytes are the mock
//!   model's values for the chunk's request and positions).
//!
//! Everything else that the `Debug` output of the roles shows stays, so state that the
//! production code adds later is part of the fingerprint without a change here. Two things
//! the roles do not show are left out: the order of each pool's free list and the bytes of
//! pages. Pages are interchangeable (a free page differs from another only by its number,
//! and a stale reference to a free page is refused whatever that number), and the bytes of
//! a leased page are a function of who wrote how much, which is in the fingerprint.

use std::fmt::Write as _;

use xxhash_rust::xxh3::xxh3_128;

/// The canonical form of a world description (see the module docs).
pub fn canonical(s: &str) -> String {
    fn rename<'a>(table: &mut Vec<&'a str>, v: &'a str) -> usize {
        match table.iter().position(|x| *x == v) {
            Some(i) => i,
            None => {
                table.push(v);
                table.len() - 1
            }
        }
    }
    // Find every pattern with std's substring search (fast even in a debug build), then copy
    // the text between them in bulk.
    #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
    enum Kind {
        Generation,
        Manifest,
        ManifestField,
        Pool,
        Stats,
        Detail,
        Data,
    }
    let patterns = [
        ("Generation(", Kind::Generation),
        ("Manifest(", Kind::Manifest),
        ("manifest: ", Kind::ManifestField),
        ("PoolId(", Kind::Pool),
        ("stats: ", Kind::Stats),
        ("detail: \"", Kind::Detail),
        ("data: [", Kind::Data),
    ];
    let mut hits: Vec<(usize, Kind)> = Vec::new();
    for (p, k) in patterns {
        hits.extend(s.match_indices(p).map(|(i, _)| (i, k)));
    }
    hits.sort_unstable();
    let b = s.as_bytes();
    let digits = |from: usize| b[from..].iter().take_while(|c| c.is_ascii_digit()).count();
    let mut out = String::with_capacity(s.len());
    let mut generations: Vec<&str> = Vec::new();
    let mut manifests: Vec<&str> = Vec::new();
    let mut i = 0;
    for (at, kind) in hits {
        if at < i {
            continue; // inside something already skipped
        }
        out.push_str(&s[i..at]);
        i = at;
        match kind {
            Kind::Generation | Kind::Manifest | Kind::ManifestField => {
                let plen = match kind {
                    Kind::Generation => 11,
                    Kind::Manifest => 9,
                    _ => 10,
                };
                let n = digits(at + plen);
                if n == 0 {
                    continue;
                }
                let v = &s[at + plen..at + plen + n];
                let id = if kind == Kind::Generation { rename(&mut generations, v) } else { rename(&mut manifests, v) };
                let _ = write!(out, "{}#{id}", &s[at..at + plen]);
                i = at + plen + n;
            }
            Kind::Pool => {
                out.push_str("PoolId(_");
                i = at + 7 + digits(at + 7);
            }
            Kind::Stats => {
                // `stats: XStats { ... }`, and the separator after it.
                if !s[at + 7..].starts_with(|c: char| c.is_ascii_uppercase()) {
                    continue;
                }
                let open = at + s[at..].find('{').expect("a stats struct has a body");
                i = skip_balanced(b, open, b'{', b'}');
                if s[i..].starts_with(", ") {
                    i += 2;
                }
            }
            Kind::Detail => {
                out.push_str("detail: _");
                i = skip_string(b, at + 8);
            }
            Kind::Data => {
                out.push_str("data: _");
                i = skip_balanced(b, at + 6, b'[', b']');
            }
        }
    }
    out.push_str(&s[i..]);
    out
}

/// The 128-bit hash of the canonical form.
pub fn fingerprint(description: &str) -> u128 {
    xxh3_128(canonical(description).as_bytes())
}

/// Index just past the bracket matching the one at `open`.
fn skip_balanced(b: &[u8], open: usize, l: u8, r: u8) -> usize {
    let mut depth = 0usize;
    let mut i = open;
    while i < b.len() {
        match b[i] {
            c if c == l => depth += 1,
            c if c == r => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            b'"' => {
                i = skip_string(b, i);
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    b.len()
}

/// Index just past the string literal whose opening quote is at `quote`.
fn skip_string(b: &[u8], quote: usize) -> usize {
    let mut i = quote + 1;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => return i + 1,
            _ => i += 1,
        }
    }
    b.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_and_manifests_are_renamed_consistently() {
        let a = canonical("Lease { pool: PoolId(4), generation: Generation(7) } Generation(9) Generation(7) Manifest(55) manifest: 55");
        let b = canonical("Lease { pool: PoolId(11), generation: Generation(3) } Generation(12) Generation(3) Manifest(8) manifest: 8");
        assert_eq!(a, b);
        assert_eq!(a, "Lease { pool: PoolId(_), generation: Generation(#0) } Generation(#1) Generation(#0) Manifest(#0) manifest: #0");
        let c = canonical("Generation(3) Generation(3)");
        assert_ne!(c, canonical("Generation(3) Generation(4)"));
    }

    #[test]
    fn counters_details_and_bytes_are_dropped() {
        let s = canonical(
            r#"X { a: 1, stats: DecodeStats { reserved: 3, x: Y { z: 1 } }, now_ms: 5 } Failed { detail: "page 3 \"q\" {", b: 2 } KvChunk { data: [1, 2, 3], c: 4 }"#,
        );
        assert_eq!(s, "X { a: 1, now_ms: 5 } Failed { detail: _, b: 2 } KvChunk { data: _, c: 4 }");
    }
}
