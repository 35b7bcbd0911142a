//! Moving protocol frames over blocking TCP (the workers use plain threads), or over UCX
//! once a KV connection chose it ([`crate::kv_transport`]): the same frames, encoder and
//! decoder (MACs, checks) either way; only the bytes' road differs.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use bulkhead_kv::transfer::ChunkExport;
use bulkhead_kv::{KvError, RequestId};
use bulkhead_protocol::auth::AuthError;
use bulkhead_protocol::{CodecError, DEFAULT_MAX_FRAME, FrameDecoder, FrameEncoder, Message};

/// Connections closed for bad bytes (garbage, oversize or unknown frames, a wrong first
/// message), in this process; logged with each closure and exported as
/// `bulkhead:bad_connections_total` (I6).
pub static BAD_CONNECTIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Count one connection closed for bad bytes and return the running total.
pub fn count_bad_connection() -> u64 {
    BAD_CONNECTIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
}

/// Handshakes refused in this process (no key, a wrong key, a claimed identity that does
/// not match), exported as `bulkhead:auth_refusals_total`.
pub static AUTH_REFUSALS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Count one refused handshake and return the running total.
pub fn count_auth_refusal() -> u64 {
    AUTH_REFUSALS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
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
    #[error("cluster handshake: {0}")]
    Auth(#[from] AuthError),
    #[error("UCX: {0}")]
    Ucx(#[from] bulkhead_ucx::UcxError),
    #[error("{0}")]
    Transport(String),
    #[error("the handshake did not finish within {} s", crate::door::HANDSHAKE_DEADLINE.as_secs())]
    Deadline,
}

/// How long one frame may take over UCX before the link counts as down (a stalled or
/// vanished peer: UCX's shared-memory transports do not report a dead one).
const UCX_FRAME_TIMEOUT: Duration = Duration::from_secs(30);
/// Why a connection on UCX closes when its TCP side carries data.
const STRAY_TCP: &str = "bytes on TCP after the switch to UCX";

/// Bytes asked of the socket per read (the readers here and the gateway's).
pub const READ_BYTES: usize = 256 << 10;

/// Reads whole messages from a stream.
pub struct FrameReader {
    stream: TcpStream,
    decoder: FrameDecoder,
    /// Once the connection chose UCX: where its frames arrive (and a buffer for the next),
    /// while the TCP stream only says when the peer is gone.
    ucx: Option<(bulkhead_ucx::Receiver, Vec<u8>)>,
    /// Before the peer is admitted: when its handshake must be over.
    deadline: Option<Instant>,
}

impl FrameReader {
    /// Wrap a stream (typically a `try_clone` of the writer's).
    pub fn new(stream: TcpStream) -> Self {
        FrameReader { stream, decoder: FrameDecoder::new(DEFAULT_MAX_FRAME), ucx: None, deadline: None }
    }

    /// The accepting side of a connection that has not yet proved anything: frames (and
    /// reads) of at most [`crate::door::PRE_AUTH_MAX_FRAME`] bytes, and the whole handshake
    /// by `deadline`, until [`FrameReader::admitted`].
    pub fn before_handshake(stream: TcpStream, deadline: Instant) -> Self {
        FrameReader { stream, decoder: FrameDecoder::new(crate::door::PRE_AUTH_MAX_FRAME), ucx: None, deadline: Some(deadline) }
    }

    /// The peer authenticated and introduced itself: full-size frames, no deadline.
    pub fn admitted(&mut self) -> Result<(), WireError> {
        self.decoder.set_max_frame(DEFAULT_MAX_FRAME);
        self.deadline = None;
        Ok(self.stream.set_read_timeout(None)?)
    }

    /// From now on, frames come over UCX. The peer's last frame on TCP must have been the
    /// last bytes it sent there.
    pub fn use_ucx(&mut self, receiver: bulkhead_ucx::Receiver) -> Result<(), WireError> {
        if self.decoder.buffered() > 0 {
            return Err(WireError::Transport(STRAY_TCP.into()));
        }
        self.ucx = Some((receiver, Vec::new()));
        Ok(())
    }

    /// Set (or clear) the TCP read timeout, for the first frames of a connection.
    pub fn set_timeout(&self, t: Option<Duration>) -> Result<(), WireError> {
        Ok(self.stream.set_read_timeout(t)?)
    }

    /// From now on, check every frame's MAC (after a handshake).
    pub fn open_with(&mut self, session_recv: bulkhead_protocol::auth::Opener) {
        self.decoder.open_with(session_recv);
    }

    /// The stream and the decoder (its session and any bytes read past the last message),
    /// for a caller that reads on with async I/O (the gateway, after [`crate::handshake::admit`]).
    pub fn into_parts(self) -> (TcpStream, FrameDecoder) {
        (self.stream, self.decoder)
    }

    /// The next message; `Closed` at end of stream. Any codec error means: close.
    pub fn recv(&mut self) -> Result<Message, WireError> {
        loop {
            if let Some(m) = self.decoder.next_message()? {
                return Ok(m);
            }
            if let Some((rx, spare)) = &mut self.ucx {
                let limit = self.decoder.max_wire_frame();
                match rx.recv(self.stream.as_raw_fd(), limit, UCX_FRAME_TIMEOUT, std::mem::take(spare))? {
                    bulkhead_ucx::Received::Message(frame) => *spare = self.decoder.feed_owned(frame),
                    // The peer sends nothing more on TCP once on UCX: this is its end.
                    bulkhead_ucx::Received::Watch => {
                        return match self.stream.read(&mut [0u8; 1])? {
                            0 => Err(WireError::Closed),
                            _ => Err(WireError::Transport(STRAY_TCP.into())),
                        };
                    }
                }
                continue;
            }
            if let Some(d) = self.deadline {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(WireError::Deadline);
                }
                self.stream.set_read_timeout(Some(left))?;
            }
            // Straight into the decoder's buffer: KV chunks are most of these bytes. Never
            // more than one largest frame: before the handshake that is a few hundred bytes.
            let want = READ_BYTES.min(self.decoder.max_wire_frame());
            let n = match self.stream.read(self.decoder.spare(want)) {
                Err(e) if self.deadline.is_some() && matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    return Err(WireError::Deadline);
                }
                r => r?,
            };
            if n == 0 {
                return Err(WireError::Closed);
            }
            self.decoder.filled(n);
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

/// Why [`FrameWriter::send_kv_chunk`] sent nothing.
#[derive(Debug, thiserror::Error)]
pub enum ChunkWriteError {
    /// The chunk could not be exported; the connection is as it was.
    #[error("exporting a KV chunk: {0}")]
    Export(KvError),
    /// The connection failed.
    #[error(transparent)]
    Wire(WireError),
}

/// Writes whole messages to a stream, sealed once a handshake gave it a session key.
pub struct FrameWriter {
    stream: TcpStream,
    encoder: FrameEncoder,
    buf: Vec<u8>,
    /// Once the connection chose UCX: where its frames go (one message each); the TCP
    /// stream then carries none and only says when the peer is gone.
    ucx: Option<bulkhead_ucx::Sender>,
}

impl FrameWriter {
    /// Frames without MACs (before a handshake, or in a cluster without a key).
    pub fn new(stream: TcpStream) -> Self {
        FrameWriter { stream, encoder: FrameEncoder::plain(), buf: Vec::new(), ucx: None }
    }

    /// The stream and the encoder (with its session), for a caller that writes on with
    /// async I/O (the gateway, after [`crate::handshake::admit`]).
    pub fn into_parts(self) -> (TcpStream, FrameEncoder) {
        (self.stream, self.encoder)
    }

    /// From now on, frames go over UCX.
    pub fn use_ucx(&mut self, sender: bulkhead_ucx::Sender) {
        self.ucx = Some(sender);
    }

    /// Write one message (a whole frame, and its MAC).
    pub fn send(&mut self, m: &Message) -> Result<(), WireError> {
        self.buf.clear();
        self.encoder.encode(m, &mut self.buf);
        self.write_buf()
    }

    /// Export the next chunk of `chunks` straight into a `KvChunk` frame of `req` (the
    /// bytes [`FrameWriter::send`] of the message would write, without the chunk's own
    /// buffer and its copy) and write it; the chunk's data bytes, or `None` once every
    /// chunk is out.
    pub fn send_kv_chunk(&mut self, req: RequestId, chunks: &mut ChunkExport<'_>) -> Result<Option<usize>, ChunkWriteError> {
        self.buf.clear();
        let mut len = 0;
        let exported = self.encoder.encode_kv_chunk(req, &mut self.buf, |out| {
            let start = out.len();
            let header = chunks.next_into(out);
            len = out.len() - start;
            header
        });
        match exported {
            None => Ok(None),
            Some(Err(e)) => Err(ChunkWriteError::Export(e)),
            Some(Ok(())) => self.write_buf().map(|()| Some(len)).map_err(ChunkWriteError::Wire),
        }
    }

    fn write_buf(&mut self) -> Result<(), WireError> {
        match &mut self.ucx {
            Some(tx) => self.buf = tx.send(std::mem::take(&mut self.buf), self.stream.as_raw_fd(), UCX_FRAME_TIMEOUT)?,
            None => self.stream.write_all(&self.buf)?,
        }
        Ok(())
    }

    /// The peer's address, if the socket still knows it.
    pub fn peer_ip(&self) -> Option<std::net::IpAddr> {
        self.stream.peer_addr().ok().map(|a| a.ip())
    }

    /// This end's address, if the socket still knows it.
    pub fn local_ip(&self) -> Option<std::net::IpAddr> {
        self.stream.local_addr().ok().map(|a| a.ip())
    }

    /// Close both directions (the connection's reader sees it end).
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    /// From now on, seal every frame (after a handshake; `bench-transfer` uses it with an
    /// in-memory one).
    pub fn seal_with(&mut self, session_send: bulkhead_protocol::auth::Sealer) {
        self.encoder = FrameEncoder::sealed(session_send);
    }
}
