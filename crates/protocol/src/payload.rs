//! A KV chunk's bytes as a received message holds them: a buffer that goes back to its
//! connection's pool when the message is dropped, so a steady stream of chunks reuses a few
//! warm buffers. A fresh `Vec` per ~370 KB chunk is a fresh `mmap` under glibc's allocator
//! (same-sized blocks stay above its moving mmap threshold): page faults and zeroing on
//! every chunk, which cost the transfer more than its copies did.

use std::ops::{Deref, DerefMut};
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
        // A poisoned lock only means a thread panicked holding it; the list is still sound.
        let mut buf = self.0.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_default();
        buf.extend_from_slice(bytes);
        Payload { bytes: buf, home: Some(Arc::clone(self)) }
    }

    fn put(&self, mut buf: Vec<u8>) {
        buf.clear();
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

/// Bytes of a message, in a buffer of its own or lent by a [`PayloadPool`]. Compares,
/// prints and clones as the bytes (a clone owns its buffer).
#[derive(Default)]
pub struct Payload {
    bytes: Vec<u8>,
    home: Option<Arc<PayloadPool>>,
}

impl From<Vec<u8>> for Payload {
    fn from(bytes: Vec<u8>) -> Self {
        Payload { bytes, home: None }
    }
}

impl Deref for Payload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

impl DerefMut for Payload {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.bytes
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
        Payload::from(self.bytes.clone())
    }
}

impl PartialEq for Payload {
    fn eq(&self, other: &Self) -> bool {
        self.bytes == other.bytes
    }
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.bytes.fmt(f)
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
    fn a_pool_keeps_a_bounded_number_of_buffers() {
        let pool = Arc::new(PayloadPool::default());
        let out: Vec<Payload> = (0..KEEP + 5).map(|i| pool.copy_of(&[i as u8])).collect();
        drop(out);
        assert_eq!(pool.free(), KEEP);
    }
}
