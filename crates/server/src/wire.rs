//! Moving protocol frames over blocking TCP (the workers use plain threads).

use std::io::{Read, Write};
use std::net::TcpStream;

use bulkhead_protocol::{encode, CodecError, FrameDecoder, Message, DEFAULT_MAX_FRAME};

/// Connections closed for bad bytes (garbage, oversize or unknown frames, a wrong first
/// message), in this process; logged with each closure and exported as
/// `bulkhead:bad_connections_total` (I6).
pub static BAD_CONNECTIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Count one connection closed for bad bytes and return the running total.
pub fn count_bad_connection() -> u64 {
    BAD_CONNECTIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
}

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("connection closed")]
    Closed,
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("protocol error: {0}")]
    Codec(#[from] CodecError),
}

/// Reads whole messages from a stream.
pub struct FrameReader {
    stream: TcpStream,
    decoder: FrameDecoder,
    buf: Vec<u8>,
}

impl FrameReader {
    /// Wrap a stream (typically a `try_clone` of the writer's).
    pub fn new(stream: TcpStream) -> Self {
        FrameReader { stream, decoder: FrameDecoder::new(DEFAULT_MAX_FRAME), buf: vec![0; 64 << 10] }
    }

    /// The next message; `Closed` at end of stream. Any codec error means: close.
    pub fn recv(&mut self) -> Result<Message, WireError> {
        loop {
            if let Some(m) = self.decoder.next_message()? {
                return Ok(m);
            }
            let n = self.stream.read(&mut self.buf)?;
            if n == 0 {
                return Err(WireError::Closed);
            }
            self.decoder.push(&self.buf[..n]);
        }
    }
}

/// Forward every message read from `r` into `tx` as `wrap(message)` on a new thread, then
/// `closed` once the connection ends (EOF, I/O or codec error) or the receiver is gone.
/// A full channel blocks the reader, and TCP carries that back to the sender.
pub fn spawn_reader<T: Send + 'static>(
    mut r: FrameReader,
    tx: std::sync::mpsc::SyncSender<T>,
    wrap: impl Fn(Message) -> T + Send + 'static,
    closed: T,
) {
    std::thread::spawn(move || {
        while let Ok(m) = r.recv() {
            if tx.send(wrap(m)).is_err() {
                return;
            }
        }
        let _ = tx.send(closed);
    });
}

/// Write one message (a whole frame) to a stream.
pub fn send(stream: &mut TcpStream, m: &Message) -> Result<(), WireError> {
    let mut buf = Vec::new();
    encode(m, &mut buf);
    stream.write_all(&buf)?;
    Ok(())
}

/// Digest of a model file, the identity workers and gateway compare (xxh3-64 of the bytes).
pub fn model_digest(path: &std::path::Path) -> std::io::Result<u64> {
    Ok(xxhash_rust::xxh3::xxh3_64(&std::fs::read(path)?))
}
