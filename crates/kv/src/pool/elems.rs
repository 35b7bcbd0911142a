//! Where the pool's K and V elements live: memory of their own, advised for transparent
//! huge pages ([`crate::huge_map`]).

use half::f16;
use zerocopy::FromBytes;

/// The pool's f16 elements. Attention reads one layer's K (or V) block of each page in
/// turn, a whole page's size apart (Gemma 3 270M: 8 KB every 288 KB), so through 4 KB pages
/// nearly every block costs TLB misses once a sequence's pages pass the TLB's reach; 2 MB
/// pages hold several of them. Where no map can be made (or the kernel declines the
/// advice), the elements live in ordinary memory, with the same values.
pub(super) enum Elems {
    /// An anonymous map advised `MADV_HUGEPAGE`, whose bytes are checked at construction to
    /// view as f16s (page-aligned, an even length).
    Map(memmap2::MmapMut),
    /// Ordinary memory.
    Vec(Vec<f16>),
}

impl Elems {
    /// `len` elements, each `fill`, every byte written now (so a pool too large for the
    /// host fails at start-up, not at its first long request). `None`: no memory for them.
    pub(super) fn new(len: usize, fill: f16) -> Option<Elems> {
        if let Some(mut map) = crate::huge_map(len.checked_mul(2)?)
            && let Ok(e) = <[f16]>::mut_from_bytes(&mut map)
        {
            e.fill(fill);
            return Some(Elems::Map(map));
        }
        let mut v = Vec::new();
        v.try_reserve_exact(len).ok()?;
        v.resize(len, fill);
        Some(Elems::Vec(v))
    }
}

impl std::ops::Deref for Elems {
    type Target = [f16];
    fn deref(&self) -> &[f16] {
        match self {
            // Cannot fail: checked when the map was made, and a map neither moves nor resizes.
            Elems::Map(m) => <[f16]>::ref_from_bytes(m).unwrap_or_default(),
            Elems::Vec(v) => v,
        }
    }
}

impl std::ops::DerefMut for Elems {
    fn deref_mut(&mut self) -> &mut [f16] {
        match self {
            Elems::Map(m) => <[f16]>::mut_from_bytes(m).unwrap_or_default(),
            Elems::Vec(v) => v,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HUGE_PAGE;

    #[test]
    fn elements_hold_their_fill_and_what_is_written() {
        for len in [HUGE_PAGE / 2, 3 << 20] {
            let mut e = Elems::new(len, f16::from_f32(-2.5)).expect("memory for a test pool");
            assert_eq!(e.len(), len);
            assert!(e.iter().all(|x| x.to_f32() == -2.5));
            e[len - 1] = f16::from_f32(7.0);
            assert_eq!(e[len - 1].to_f32(), 7.0);
            assert!(matches!(e, Elems::Map(_)), "an anonymous map where the OS makes one");
        }
        for len in [1, 4099] {
            let e = Elems::new(len, f16::from_f32(-2.5)).expect("memory for a test pool");
            assert!(matches!(e, Elems::Vec(_)) && e.len() == len && e.iter().all(|x| x.to_f32() == -2.5), "small pools in ordinary memory");
        }
    }
}
