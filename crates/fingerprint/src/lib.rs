//! Typed state fingerprints: which worlds the model checker treats as one state.
//!
//! The checker's state is a history of actions; the production state it stands for is
//! rebuilt by replaying it. Two histories are one state when their worlds are equal up to
//! what the production code cannot tell apart. Each type says what of it is state by
//! implementing [`Fingerprint`], almost always with `#[derive(Fingerprint)]`, which writes
//! every field in order (a field added later is state unless it says otherwise):
//!
//! - **Generations and manifest digests** are renamed in order of first appearance
//!   ([`Fingerprinter::generation`], [`Fingerprinter::manifest`]): the pool only compares
//!   generations for equality and draws fresh ones above all earlier ones, and a manifest
//!   is a hash over chunk headers that hold generations, compared only for equality.
//! - **Counters, error text and chunk bytes** are skipped (`#[fingerprint(skip)]`): no
//!   decision reads a counter, error text quotes numbers for people, and a chunk's bytes
//!   are the mock model's values for positions its header names (its checksum stays).
//! - **Clocks and round-robin positions** (`#[fingerprint(clock)]`, `#[fingerprint(turn)]`)
//!   are written only while they can still matter: the caller says when a role can tick
//!   no more ([`Fingerprinter::clocks_dead`]) or when every request is submitted
//!   ([`Fingerprinter::turns_dead`]).
//! - Pool ids write nothing (each replay makes new pools, and a pool id is only compared
//!   with the one pool of its worker); hash maps and sets are written in key order.
//!
//! The encoding is unambiguous: enums write their variant index, sequences their length,
//! options a tag. The fingerprint is the 128-bit xxh3 of those bytes.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::hash::BuildHasher;
use std::sync::Arc;

pub use bulkhead_fingerprint_derive::Fingerprint;

/// A type whose values are (part of) a model-checker state. See the crate docs.
pub trait Fingerprint {
    /// Writes what of `self` is state into `h`.
    fn fingerprint(&self, h: &mut Fingerprinter);
}

/// Collects a state's canonical bytes and hashes them.
#[derive(Debug, Default)]
pub struct Fingerprinter {
    bytes: Vec<u8>,
    generations: Vec<u64>,
    manifests: Vec<u64>,
    clocks_dead: bool,
    turns_dead: bool,
}

impl Fingerprinter {
    /// An empty fingerprint.
    pub fn new() -> Self {
        Self::default()
    }

    /// Writes `v`.
    pub fn write(&mut self, v: &(impl Fingerprint + ?Sized)) -> &mut Self {
        v.fingerprint(self);
        self
    }

    /// Writes raw bytes (their length is the caller's to write where it varies).
    pub fn bytes(&mut self, b: &[u8]) {
        self.bytes.extend_from_slice(b);
    }

    /// Writes an enum's variant index.
    pub fn tag(&mut self, index: u32) {
        self.bytes(&index.to_le_bytes());
    }

    /// Writes a generation as its rank among the generations seen so far.
    pub fn generation(&mut self, g: u64) {
        let rank = rank(&mut self.generations, g);
        self.tag(rank);
    }

    /// Writes a manifest digest as its rank among the digests seen so far.
    pub fn manifest(&mut self, m: u64) {
        let rank = rank(&mut self.manifests, m);
        self.tag(rank);
    }

    /// Whether what follows belongs to a role that can tick no more: its clocks are dead
    /// state until this is set back.
    pub fn clocks_dead(&mut self, dead: bool) -> &mut Self {
        self.clocks_dead = dead;
        self
    }

    /// Whether round-robin positions are dead state (every request is submitted).
    pub fn turns_dead(&mut self, dead: bool) -> &mut Self {
        self.turns_dead = dead;
        self
    }

    /// Writes a clock through `f`, or a placeholder while clocks are dead.
    pub fn clock(&mut self, f: impl FnOnce(&mut Self)) {
        if self.clocks_dead { self.tag(u32::MAX) } else { f(self) }
    }

    /// Writes a round-robin position through `f`, or a placeholder while turns are dead.
    pub fn turn(&mut self, f: impl FnOnce(&mut Self)) {
        if self.turns_dead { self.tag(u32::MAX) } else { f(self) }
    }

    /// The 128-bit fingerprint of everything written.
    pub fn finish(&self) -> u128 {
        xxhash_rust::xxh3::xxh3_128(&self.bytes)
    }
}

/// The rank of `v` in `seen`, appending it if new.
fn rank(seen: &mut Vec<u64>, v: u64) -> u32 {
    let i = seen.iter().position(|x| *x == v).unwrap_or_else(|| {
        seen.push(v);
        seen.len() - 1
    });
    u32::try_from(i).unwrap_or(u32::MAX)
}

macro_rules! le_bytes {
    ($($t:ty),*) => {$(
        impl Fingerprint for $t {
            fn fingerprint(&self, h: &mut Fingerprinter) {
                h.bytes(&self.to_le_bytes());
            }
        }
    )*};
}
le_bytes!(u8, u16, u32, u64, u128, i8, i16, i32, i64, f32, f64);

impl Fingerprint for usize {
    fn fingerprint(&self, h: &mut Fingerprinter) {
        (*self as u64).fingerprint(h);
    }
}

impl Fingerprint for bool {
    fn fingerprint(&self, h: &mut Fingerprinter) {
        h.bytes(&[u8::from(*self)]);
    }
}

impl Fingerprint for char {
    fn fingerprint(&self, h: &mut Fingerprinter) {
        u32::from(*self).fingerprint(h);
    }
}

impl Fingerprint for () {
    fn fingerprint(&self, _: &mut Fingerprinter) {}
}

impl Fingerprint for str {
    fn fingerprint(&self, h: &mut Fingerprinter) {
        self.len().fingerprint(h);
        h.bytes(self.as_bytes());
    }
}

impl Fingerprint for String {
    fn fingerprint(&self, h: &mut Fingerprinter) {
        self.as_str().fingerprint(h);
    }
}

impl<T: Fingerprint + ?Sized> Fingerprint for &T {
    fn fingerprint(&self, h: &mut Fingerprinter) {
        (**self).fingerprint(h);
    }
}

impl<T: Fingerprint + ?Sized> Fingerprint for Box<T> {
    fn fingerprint(&self, h: &mut Fingerprinter) {
        (**self).fingerprint(h);
    }
}

impl<T: Fingerprint + ?Sized> Fingerprint for Arc<T> {
    fn fingerprint(&self, h: &mut Fingerprinter) {
        (**self).fingerprint(h);
    }
}

impl<T: Fingerprint> Fingerprint for Option<T> {
    fn fingerprint(&self, h: &mut Fingerprinter) {
        match self {
            None => h.tag(0),
            Some(v) => {
                h.tag(1);
                v.fingerprint(h);
            }
        }
    }
}

impl<T: Fingerprint, E: Fingerprint> Fingerprint for Result<T, E> {
    fn fingerprint(&self, h: &mut Fingerprinter) {
        match self {
            Ok(v) => {
                h.tag(0);
                v.fingerprint(h);
            }
            Err(e) => {
                h.tag(1);
                e.fingerprint(h);
            }
        }
    }
}

/// A sequence: its length, then its items in order.
fn sequence<'a, T: Fingerprint + 'a>(h: &mut Fingerprinter, len: usize, items: impl Iterator<Item = &'a T>) {
    len.fingerprint(h);
    for v in items {
        v.fingerprint(h);
    }
}

impl<T: Fingerprint> Fingerprint for [T] {
    fn fingerprint(&self, h: &mut Fingerprinter) {
        sequence(h, self.len(), self.iter());
    }
}

impl<T: Fingerprint, const N: usize> Fingerprint for [T; N] {
    fn fingerprint(&self, h: &mut Fingerprinter) {
        self.as_slice().fingerprint(h);
    }
}

impl<T: Fingerprint> Fingerprint for Vec<T> {
    fn fingerprint(&self, h: &mut Fingerprinter) {
        self.as_slice().fingerprint(h);
    }
}

impl<T: Fingerprint> Fingerprint for VecDeque<T> {
    fn fingerprint(&self, h: &mut Fingerprinter) {
        sequence(h, self.len(), self.iter());
    }
}

impl<T: Fingerprint> Fingerprint for BTreeSet<T> {
    fn fingerprint(&self, h: &mut Fingerprinter) {
        sequence(h, self.len(), self.iter());
    }
}

impl<K: Fingerprint, V: Fingerprint> Fingerprint for BTreeMap<K, V> {
    fn fingerprint(&self, h: &mut Fingerprinter) {
        self.len().fingerprint(h);
        for (k, v) in self {
            k.fingerprint(h);
            v.fingerprint(h);
        }
    }
}

/// In key order: two equal sets iterate in different orders.
impl<T: Fingerprint + Ord, S: BuildHasher> Fingerprint for HashSet<T, S> {
    fn fingerprint(&self, h: &mut Fingerprinter) {
        let sorted: BTreeSet<&T> = self.iter().collect();
        sorted.fingerprint(h);
    }
}

/// In key order: two equal maps iterate in different orders.
impl<K: Fingerprint + Ord, V: Fingerprint, S: BuildHasher> Fingerprint for HashMap<K, V, S> {
    fn fingerprint(&self, h: &mut Fingerprinter) {
        let sorted: BTreeMap<&K, &V> = self.iter().collect();
        sorted.fingerprint(h);
    }
}

macro_rules! tuple {
    ($($name:ident $i:tt),*) => {
        impl<$($name: Fingerprint),*> Fingerprint for ($($name,)*) {
            fn fingerprint(&self, h: &mut Fingerprinter) {
                $(self.$i.fingerprint(h);)*
            }
        }
    };
}
tuple!(A 0);
tuple!(A 0, B 1);
tuple!(A 0, B 1, C 2);
tuple!(A 0, B 1, C 2, D 3);

#[cfg(test)]
mod tests {
    use super::*;

    fn of(v: &impl Fingerprint) -> u128 {
        Fingerprinter::new().write(v).finish()
    }

    #[test]
    fn generations_and_manifests_are_renamed_in_order_of_first_appearance() {
        let fp = |gens: &[u64], manifest: u64| {
            let mut h = Fingerprinter::new();
            for g in gens {
                h.generation(*g);
            }
            h.manifest(manifest);
            h.finish()
        };
        assert_eq!(fp(&[7, 9, 7], 55), fp(&[3, 12, 3], 8));
        assert_ne!(fp(&[3, 3], 1), fp(&[3, 4], 1));
    }

    #[test]
    fn the_encoding_is_unambiguous() {
        assert_ne!(of(&(vec![1u8], vec![2u8, 3])), of(&(vec![1u8, 2], vec![3u8])));
        assert_ne!(of(&(Some(0u8), None::<u8>)), of(&(None::<u8>, Some(0u8))));
        assert_ne!(of(&("ab".to_string(), "c".to_string())), of(&("a".to_string(), "bc".to_string())));
    }

    #[test]
    fn hash_maps_are_written_in_key_order() {
        let a: HashMap<u32, u32> = (0..64).map(|i| (i, i * 3)).collect();
        let b: HashMap<u32, u32> = (0..64).rev().map(|i| (i, i * 3)).collect();
        assert_eq!(of(&a), of(&b));
    }

    #[test]
    fn dead_clocks_and_turns_are_placeholders() {
        let fp = |clock: u64, dead: bool| {
            let mut h = Fingerprinter::new();
            h.clocks_dead(dead).turns_dead(dead);
            h.clock(|h| clock.fingerprint(h));
            h.turn(|h| clock.fingerprint(h));
            h.finish()
        };
        assert_ne!(fp(1, false), fp(2, false));
        assert_eq!(fp(1, true), fp(2, true));
    }
}
