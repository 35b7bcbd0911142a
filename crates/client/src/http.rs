//! A minimal HTTP/1.1 client over tokio TCP: one request per connection (`Connection: close`),
//! response bodies framed by `Content-Length`, `chunked` or the connection closing. No TLS, no
//! redirects, no pooling: what a load generator and a probe need, with every wait bounded.
//! Dropping a [`Response`] closes its connection, which is how a client "disconnects".

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::ClientError;

/// Largest response head (status line and headers) accepted.
const MAX_HEAD_BYTES: usize = 64 << 10;
/// Largest chunk-size or trailer line accepted in a chunked body.
const MAX_LINE_BYTES: usize = 4 << 10;
/// Bytes asked of the socket per read.
const READ_BYTES: usize = 16 << 10;

/// Where a server is: `http://host[:port][/base]`. A trailing `/v1` is dropped, so both the
/// server root and an OpenAI-style base URL work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Url {
    /// Host name or address (IPv6 without brackets).
    pub host: String,
    /// TCP port (80 when not given).
    pub port: u16,
    /// Path prefix without a trailing `/` (often empty).
    pub base: String,
}

impl Url {
    /// Parse `http://host[:port][/path]`.
    pub fn parse(s: &str) -> Result<Url, ClientError> {
        let bad = |why: &str| ClientError::Url { url: s.to_string(), why: why.to_string() };
        let rest = match s.split_once("://") {
            Some(("http", rest)) => rest,
            Some(("https", _)) => return Err(bad("https is not supported (no TLS); use http://")),
            Some(_) => return Err(bad("only http:// URLs are supported")),
            None => s, // "host:port" alone
        };
        let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (h, after) = v6.split_once(']').ok_or_else(|| bad("unclosed '[' in the host"))?;
            (h, after.strip_prefix(':'))
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            }
        };
        if host.is_empty() {
            return Err(bad("no host"));
        }
        let port = match port {
            None => 80,
            Some(p) => p.parse().map_err(|_| bad("the port is not a number in 0..=65535"))?,
        };
        let base = path.trim_end_matches('/');
        let base = base.strip_suffix("/v1").unwrap_or(base).to_string();
        Ok(Url { host: host.to_string(), port, base })
    }

    /// `host:port` for connecting and for the `Host` header.
    pub fn authority(&self) -> String {
        if self.host.contains(':') { format!("[{}]:{}", self.host, self.port) } else { format!("{}:{}", self.host, self.port) }
    }
}

impl std::fmt::Display for Url {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "http://{}{}", self.authority(), self.base)
    }
}

/// Time limits of one exchange.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// Connecting and sending the request.
    pub connect: Duration,
    /// Any single wait for response bytes (head or body): a stalled server fails here.
    pub read: Duration,
}

/// Send one request and read the response head. The body is read through the returned
/// [`Response`].
pub async fn send(
    url: &Url,
    method: &str,
    path: &str,
    headers: &[(String, String)],
    body: Option<&[u8]>,
    t: Timeouts,
) -> Result<Response, ClientError> {
    let mut req = format!("{method} {}{path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n", url.base, url.authority());
    for (k, v) in headers {
        if [k, v].iter().any(|s| s.contains(['\r', '\n'])) {
            return Err(ClientError::Header(k.clone()));
        }
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        req.push_str(&format!("Content-Length: {}\r\n", b.len()));
    }
    req.push_str("\r\n");
    let connect = async {
        let mut s = TcpStream::connect(url.authority()).await?;
        s.set_nodelay(true)?;
        s.write_all(req.as_bytes()).await?;
        if let Some(b) = body {
            s.write_all(b).await?;
        }
        s.flush().await?;
        Ok::<_, std::io::Error>(s)
    };
    let stream = tokio::time::timeout(t.connect, connect)
        .await
        .map_err(|_| ClientError::Timeout { what: "connecting and sending the request", after: t.connect })?
        .map_err(|e| ClientError::Io { what: "connecting and sending the request", source: e })?;
    Response::read_head(Box::new(stream), t.read).await
}

/// How the body of a response ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// This many bytes remain.
    Length(u64),
    /// Chunked transfer coding, in this state.
    Chunked(Chunk),
    /// Until the connection closes.
    Eof,
    /// Nothing more.
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// Expecting a `hex-size[;ext]\r\n` line.
    Size,
    /// Inside a chunk with this many data bytes left.
    Data(u64),
    /// Expecting the `\r\n` after a chunk's data.
    DataEnd,
    /// After the zero-size chunk: trailer lines until an empty one.
    Trailer,
}

/// A response whose head has been read; the body arrives through [`Response::chunk`].
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Headers in order, names lower-cased.
    pub headers: Vec<(String, String)>,
    io: Box<dyn AsyncRead + Unpin + Send>,
    /// Bytes read from the socket, not yet returned.
    buf: Vec<u8>,
    framing: Framing,
    read_timeout: Duration,
}

impl std::fmt::Debug for Response {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Response").field("status", &self.status).field("framing", &self.framing).finish_non_exhaustive()
    }
}

impl Response {
    /// Read a response head from `io` (any byte stream: a socket, or a pipe in tests).
    pub async fn read_head(io: Box<dyn AsyncRead + Unpin + Send>, read_timeout: Duration) -> Result<Response, ClientError> {
        let mut r = Response { status: 0, headers: Vec::new(), io, buf: Vec::new(), framing: Framing::Eof, read_timeout };
        let end = loop {
            if let Some(i) = find(&r.buf, b"\r\n\r\n") {
                break i;
            }
            if r.buf.len() > MAX_HEAD_BYTES {
                return Err(ClientError::Protocol(format!("response head over {MAX_HEAD_BYTES} bytes")));
            }
            if r.fill("the response head").await? == 0 {
                return Err(ClientError::Protocol(if r.buf.is_empty() {
                    "the server closed the connection without answering".into()
                } else {
                    "the connection closed inside the response head".into()
                }));
            }
        };
        let head = String::from_utf8_lossy(&r.buf[..end]).into_owned();
        r.buf.drain(..end + 4);
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap_or_default();
        r.status = match status_line.split_whitespace().collect::<Vec<_>>().as_slice() {
            [v, code, ..] if v.starts_with("HTTP/1.") => code.parse().ok(),
            _ => None,
        }
        .ok_or_else(|| ClientError::Protocol(format!("bad status line {status_line:?}")))?;
        for line in lines {
            let (k, v) = line.split_once(':').ok_or_else(|| ClientError::Protocol(format!("bad header line {line:?}")))?;
            r.headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
        r.framing = if r.header("transfer-encoding").is_some_and(|te| te.to_ascii_lowercase().contains("chunked")) {
            Framing::Chunked(Chunk::Size)
        } else if let Some(n) = r.header("content-length") {
            Framing::Length(n.parse().map_err(|_| ClientError::Protocol(format!("bad content-length {n:?}")))?)
        } else {
            Framing::Eof
        };
        Ok(r)
    }

    /// The first header of this (lower-case) name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// Read more bytes into `buf`; 0 means the connection closed.
    async fn fill(&mut self, what: &'static str) -> Result<usize, ClientError> {
        let at = self.buf.len();
        self.buf.resize(at + READ_BYTES, 0);
        let read = tokio::time::timeout(self.read_timeout, self.io.read(&mut self.buf[at..])).await;
        let n = match read {
            Ok(Ok(n)) => n,
            Ok(Err(e)) => {
                self.buf.truncate(at);
                return Err(ClientError::Io { what, source: e });
            }
            Err(_) => {
                self.buf.truncate(at);
                return Err(ClientError::Timeout { what, after: self.read_timeout });
            }
        };
        self.buf.truncate(at + n);
        Ok(n)
    }

    /// Take up to `left` buffered body bytes (reading if none are buffered).
    async fn take(&mut self, left: u64) -> Result<Vec<u8>, ClientError> {
        if self.buf.is_empty() && self.fill("the response body").await? == 0 {
            return Err(ClientError::Protocol("the connection closed inside the response body".into()));
        }
        let n = usize::try_from(left).unwrap_or(usize::MAX).min(self.buf.len());
        Ok(self.buf.drain(..n).collect())
    }

    /// One CRLF-terminated line of a chunked body, without the CRLF.
    async fn line(&mut self) -> Result<String, ClientError> {
        loop {
            if let Some(i) = find(&self.buf, b"\r\n") {
                let line = String::from_utf8_lossy(&self.buf[..i]).into_owned();
                self.buf.drain(..i + 2);
                return Ok(line);
            }
            if self.buf.len() > MAX_LINE_BYTES {
                return Err(ClientError::Protocol("chunk-size line too long".into()));
            }
            if self.fill("the response body").await? == 0 {
                return Err(ClientError::Protocol("the connection closed inside a chunked body".into()));
            }
        }
    }

    /// The next piece of the body (as it arrived, de-chunked), or `None` at its end.
    pub async fn chunk(&mut self) -> Result<Option<Vec<u8>>, ClientError> {
        loop {
            match self.framing {
                Framing::Done | Framing::Length(0) => {
                    self.framing = Framing::Done;
                    return Ok(None);
                }
                Framing::Length(left) => {
                    let data = self.take(left).await?;
                    self.framing = Framing::Length(left - data.len() as u64);
                    return Ok(Some(data));
                }
                Framing::Eof => {
                    if self.buf.is_empty() && self.fill("the response body").await? == 0 {
                        self.framing = Framing::Done;
                        return Ok(None);
                    }
                    return Ok(Some(std::mem::take(&mut self.buf)));
                }
                Framing::Chunked(Chunk::Size) => {
                    let line = self.line().await?;
                    let hex = line.split(';').next().unwrap_or_default().trim();
                    let n = u64::from_str_radix(hex, 16).map_err(|_| ClientError::Protocol(format!("bad chunk size {line:?}")))?;
                    self.framing = Framing::Chunked(if n == 0 { Chunk::Trailer } else { Chunk::Data(n) });
                }
                Framing::Chunked(Chunk::Data(left)) => {
                    let data = self.take(left).await?;
                    let left = left - data.len() as u64;
                    self.framing = Framing::Chunked(if left == 0 { Chunk::DataEnd } else { Chunk::Data(left) });
                    return Ok(Some(data));
                }
                Framing::Chunked(Chunk::DataEnd) => {
                    let line = self.line().await?;
                    if !line.is_empty() {
                        return Err(ClientError::Protocol("chunk data longer than its size".into()));
                    }
                    self.framing = Framing::Chunked(Chunk::Size);
                }
                Framing::Chunked(Chunk::Trailer) => {
                    if self.line().await?.is_empty() {
                        self.framing = Framing::Done;
                    }
                }
            }
        }
    }

    /// The whole body, refusing more than `limit` bytes.
    pub async fn body(&mut self, limit: usize) -> Result<Vec<u8>, ClientError> {
        let mut out = Vec::new();
        while let Some(c) = self.chunk().await? {
            out.extend_from_slice(&c);
            if out.len() > limit {
                return Err(ClientError::Protocol(format!("response body over {limit} bytes")));
            }
        }
        Ok(out)
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A response delivered through a pipe of `cap` bytes, so reads see it in small pieces.
    async fn response(raw: &'static [u8], cap: usize) -> Response {
        let (mut w, r) = tokio::io::duplex(cap);
        tokio::spawn(async move {
            let _ = w.write_all(raw).await;
        });
        Response::read_head(Box::new(r), Duration::from_secs(5)).await.unwrap()
    }

    #[test]
    fn urls_parse_with_defaults_and_drop_a_trailing_v1() {
        let u = Url::parse("http://127.0.0.1:8080").unwrap();
        assert_eq!((u.host.as_str(), u.port, u.base.as_str()), ("127.0.0.1", 8080, ""));
        let u = Url::parse("http://example.test/proxy/v1/").unwrap();
        assert_eq!((u.host.as_str(), u.port, u.base.as_str()), ("example.test", 80, "/proxy"));
        let u = Url::parse("http://[::1]:9000/v1").unwrap();
        assert_eq!((u.host.as_str(), u.port, u.authority()), ("::1", 9000, "[::1]:9000".to_string()));
        assert_eq!(Url::parse("localhost:8080").unwrap().port, 8080);
        for bad in ["https://x", "ftp://x", "http://:80", "http://x:port", "http://x:70000"] {
            assert!(Url::parse(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn a_chunked_body_split_into_tiny_reads_comes_back_whole() {
        let raw = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n\
                    5\r\nhello\r\nc;ext=1\r\n, chunked wo\r\n3\r\nrld\r\n0\r\nx-trailer: 1\r\n\r\n";
        let mut r = response(raw, 3).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.header("content-type"), Some("text/event-stream"));
        assert_eq!(r.body(1 << 20).await.unwrap(), b"hello, chunked world");
        assert_eq!(r.chunk().await.unwrap(), None, "nothing after the last chunk");
    }

    #[tokio::test]
    async fn content_length_and_close_delimited_bodies_end_where_they_should() {
        let mut r = response(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 4\r\n\r\nabcdEXTRA", 64).await;
        assert_eq!((r.status, r.body(100).await.unwrap()), (400, b"abcd".to_vec()));
        let mut r = response(b"HTTP/1.0 200 OK\r\n\r\nuntil close", 4).await;
        assert_eq!(r.body(100).await.unwrap(), b"until close");
    }

    #[tokio::test]
    async fn truncated_and_malformed_bodies_are_errors_not_short_reads() {
        let mut r = response(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", 64).await;
        assert!(matches!(r.body(100).await, Err(ClientError::Protocol(_))));
        let mut r = response(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 64).await;
        assert!(matches!(r.body(100).await, Err(ClientError::Protocol(_))));
        let mut r = response(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcdef\r\n0\r\n\r\n", 64).await;
        assert!(matches!(r.body(100).await, Err(ClientError::Protocol(_))));
        let mut r = response(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456789", 64).await;
        assert!(matches!(r.body(5).await, Err(ClientError::Protocol(_))), "over the limit");
    }

    #[tokio::test]
    async fn a_silent_server_times_out() {
        let (_w, r) = tokio::io::duplex(64);
        let e = Response::read_head(Box::new(r), Duration::from_millis(50)).await.unwrap_err();
        assert!(matches!(e, ClientError::Timeout { .. }), "{e}");
    }
}
