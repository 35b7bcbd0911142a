//! A fake OpenAI-compatible server for the client's tests: every connection's request is
//! parsed and handed to a function that returns the response as a script of timed writes.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use bulkhead_client::http::{Timeouts, Url};
use bulkhead_client::{Client, ClientConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// One write of a scripted response, after a pause.
pub type Script = Vec<(Duration, Vec<u8>)>;

/// A request as the fake server saw it.
pub struct Request {
    /// Request line and headers.
    pub head: String,
    /// The body as JSON (`null` when it is not JSON or absent).
    pub body: serde_json::Value,
}

impl Request {
    /// The value of header `name` (any case).
    pub fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    }

    /// The request line's path.
    pub fn path(&self) -> &str {
        self.head.split(' ').nth(1).unwrap_or("")
    }
}

/// Serve on a free local port; returns the base URL.
pub async fn serve(respond: impl Fn(&Request) -> Script + Send + Sync + 'static) -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let respond = Arc::new(respond);
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else { return };
            let respond = respond.clone();
            tokio::spawn(async move {
                let _ = s.set_nodelay(true);
                let mut buf = Vec::new();
                let mut tmp = [0u8; 8192];
                let (head, body) = loop {
                    let Ok(n) = s.read(&mut tmp).await else { return };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&tmp[..n]);
                    let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
                    let head = String::from_utf8_lossy(&buf[..i]).to_string();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap_or(0)))
                        .unwrap_or(0);
                    if buf.len() >= i + 4 + len {
                        break (head, buf[i + 4..i + 4 + len].to_vec());
                    }
                };
                let req = Request { head, body: serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null) };
                for (pause, bytes) in respond(&req) {
                    tokio::time::sleep(pause).await;
                    if s.write_all(&bytes).await.is_err() || s.flush().await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    url
}

/// A client of `url` with `key` as its API key.
pub fn client(url: &str, key: &str) -> Client {
    Client::new(ClientConfig {
        url: Url::parse(url).unwrap(),
        api_key: Some(key.into()),
        headers: Vec::new(),
        timeouts: Timeouts { connect: Duration::from_secs(5), read: Duration::from_secs(5) },
    })
}

/// One SSE event as an HTTP chunk.
pub fn chunk(payload: &str) -> Vec<u8> {
    let event = format!("data: {payload}\n\n");
    format!("{:x}\r\n{event}\r\n", event.len()).into_bytes()
}

/// The head of a streamed answer.
pub const SSE_HEAD: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";

/// A streamed answer: the head at once, then after `first` the text chunks (chat deltas
/// or completion text, per `chat`), then `usage`, `[DONE]` and the end.
pub fn stream(first: Duration, chat: bool, texts: &[&str], usage: serde_json::Value) -> Script {
    let mut s = vec![(Duration::ZERO, SSE_HEAD.to_vec())];
    for (i, t) in texts.iter().enumerate() {
        let choice = if chat {
            serde_json::json!({"index": 0, "delta": {"content": t}, "finish_reason": null})
        } else {
            serde_json::json!({"index": 0, "text": t, "finish_reason": null})
        };
        let pause = if i == 0 { first } else { Duration::ZERO };
        s.push((pause, chunk(&serde_json::json!({"choices": [choice]}).to_string())));
    }
    s.push((Duration::ZERO, chunk(&serde_json::json!({"choices": [], "usage": usage}).to_string())));
    s.push((Duration::ZERO, chunk("[DONE]")));
    s.push((Duration::ZERO, b"0\r\n\r\n".to_vec()));
    s
}

/// A whole JSON error answer.
pub fn error(status: u16, message: &str) -> Script {
    let body = serde_json::json!({"error": {"message": message}}).to_string();
    vec![(
        Duration::ZERO,
        format!("HTTP/1.1 {status} Error\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len()).into_bytes(),
    )]
}
