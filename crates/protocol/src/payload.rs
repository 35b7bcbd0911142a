//! A KV chunk's bytes as a received message holds them: a buffer that goes back to its
//! connection's pool when the message is dropped, so a steady stream of chunks reuses a few
//! warm buffers. A fresh `Vec` per ~370 KB chunk came with fresh pages under glibc's
//! allocator (blocks that size are mapped and unmapped each time): page faults and zeroing
//! on every chunk, which `bench-transfer`'s profile showed costing more than the copies.

use std::ops::{Deref, DerefMut, Range};
use std::sync::{Arc, Mutex};

/// Buffers a pool keeps for reuse; more coming back are freed. A decode worker imports each
/// chunk as it arrives, so only the chunks queued between a connection's reader and the
/// worker's loop are out at once.
const KEEP: usize = 16;

/// Free buffers of one connection's decoder.
#[derive(Debug, Default)]
pub struct PayloadPool(Mutex<Vec<Vec<u8>>>);

impl PayloadPool {
    /// A payload holding a copy of `bytes`, in a buffer from this pool.
    pub fn copy_of(self: &Arc<Self>, bytes: &[u8]) -> Payload {
        let mut buf = self.spare();
        buf.clear();
        buf.extend_from_slice(bytes);
        self.adopt(buf, 0..bytes.len())
    }

    /// A payload of `buf[range]`, whose buffer comes back to this pool when it is dropped.
    /// An out-of-range `range` is clamped to the buffer.
    pub fn adopt(self: &Arc<Self>, buf: Vec<u8>, range: Range<usize>) -> Payload {
        let end = range.end.min(buf.len());
        Payload { range: range.start.min(end)..end, bytes: buf, home: Some(Arc::clone(self)) }
    }

    /// A buffer from the pool (empty if it has none), to receive into. What it held before
    /// is still in it: whoever fills it overwrites what it exposes.
    pub fn spare(&self) -> Vec<u8> {
        // A poisoned lock only means a thread panicked holding it; the list is still sound.
        self.0.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_default()
    }

    fn put(&self, buf: Vec<u8>) {
        let mut free = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < KEEP {
            free.push(buf);
        }
    }

    /// Buffers waiting for reuse.
    pub fn free(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// Bytes of a message: `bytes[range]`, in a buffer of its own or lent by a
/// [`PayloadPool`] (a received frame's whole buffer, say, of which the payload is the
/// chunk's data). Compares, prints and clones as those bytes (a clone owns its buffer).
#[derive(Default)]
pub struct Payload {
    bytes: Vec<u8>,
    range: Range<usize>,
    home: Option<Arc<PayloadPool>>,
}

impl From<Vec<u8>> for Payload {
    fn from(bytes: Vec<u8>) -> Self {
        Payload { range: 0..bytes.len(), bytes, home: None }
    }
}

impl Deref for Payload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes[self.range.clone()]
    }
}

impl DerefMut for Payload {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.bytes[self.range.clone()]
    }
}

impl Drop for Payload {
    fn drop(&mut self) {
        if let Some(home) = self.home.take() {
            home.put(std::mem::take(&mut self.bytes));
        }
    }
}

impl Clone for Payload {
    fn clone(&self) -> Self {
        Payload::from(self.to_vec())
    }
}

impl PartialEq for Payload {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_payload_lends_its_buffer_to_the_next() {
        let pool = Arc::new(PayloadPool::default());
        let first = pool.copy_of(&[1, 2, 3]);
        let at = first.as_ptr();
        assert_eq!(pool.free(), 0);
        drop(first);
        assert_eq!(pool.free(), 1);
        let second = pool.copy_of(&[4, 5]);
        assert_eq!((&second[..], second.as_ptr()), (&[4u8, 5][..], at), "the buffer is reused, holding only the new bytes");
        let clone = second.clone();
        drop(clone);
        assert_eq!(pool.free(), 0, "a clone owns its buffer and does not return one");
    }

    #[test]
    fn an_adopted_buffer_shows_only_its_range_and_comes_back_whole() {
        let pool = Arc::new(PayloadPool::default());
        let p = pool.adopt(vec![9, 1, 2, 3, 9], 1..4);
        assert_eq!((&p[..], p.clone()), (&[1u8, 2, 3][..], Payload::from(vec![1, 2, 3])));
        assert_eq!(&pool.adopt(vec![1, 2], 1..7)[..], &[2u8][..], "a range past the end is clamped");
        drop(p);
        assert_eq!(pool.spare().len(), 5, "the whole buffer returns, for the next receive");
    }

    #[test]
    fn a_pool_keeps_a_bounded_number_of_buffers() {
        let pool = Arc::new(PayloadPool::default());
        let out: Vec<Payload> = (0..KEEP + 5).map(|i| pool.copy_of(&[i as u8])).collect();
        drop(out);
        assert_eq!(pool.free(), KEEP);
    }
}
