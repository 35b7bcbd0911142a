//! Server-sent events, parsed incrementally: bytes in as they arrive (split anywhere, even
//! inside a UTF-8 character or a CRLF), complete events out. Follows the WHATWG rules that
//! matter for OpenAI streams: `data:` lines (one optional space after the colon) joined by
//! `\n`, `event:` names, `:` comments ignored, an event ends at a blank line, and an event
//! not ended by a blank line when the stream closes is dropped.

use crate::ClientError;

/// Longest line accepted (a stream chunk is one line; 16 MiB is far beyond any real one).
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// One event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` name, if any.
    pub event: Option<String>,
    /// The `data:` lines joined by `\n`.
    pub data: String,
}

/// Incremental parser; feed it with [`SseParser::push`].
#[derive(Debug, Default)]
pub struct SseParser {
    /// Bytes of an unfinished line.
    line: Vec<u8>,
    /// A `\r` ended the last line; a `\n` right after it belongs to that line ending.
    after_cr: bool,
    data: Option<String>,
    event: Option<String>,
}

impl SseParser {
    /// A parser at the start of a stream.
    pub fn new() -> Self {
        SseParser::default()
    }

    /// Parse more bytes; returns the events they completed, in order.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<SseEvent>, ClientError> {
        let mut out = Vec::new();
        for &b in bytes {
            if std::mem::take(&mut self.after_cr) && b == b'\n' {
                continue;
            }
            match b {
                b'\r' | b'\n' => {
                    self.after_cr = b == b'\r';
                    let line = std::mem::take(&mut self.line);
                    if let Some(ev) = self.on_line(&String::from_utf8_lossy(&line)) {
                        out.push(ev);
                    }
                }
                _ => {
                    if self.line.len() >= MAX_LINE_BYTES {
                        return Err(ClientError::Protocol(format!("server-sent event line over {MAX_LINE_BYTES} bytes")));
                    }
                    self.line.push(b);
                }
            }
        }
        Ok(out)
    }

    fn on_line(&mut self, line: &str) -> Option<SseEvent> {
        if line.is_empty() {
            let data = self.data.take()?;
            return Some(SseEvent { event: self.event.take(), data });
        }
        if line.starts_with(':') {
            return None;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "data" => match &mut self.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => self.data = Some(value.to_string()),
            },
            "event" => self.event = Some(value.to_string()),
            _ => {} // id, retry and unknown fields do not matter here
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(parts: &[&[u8]]) -> Vec<SseEvent> {
        let mut p = SseParser::new();
        parts.iter().flat_map(|b| p.push(b).unwrap()).collect()
    }

    fn data(s: &str) -> SseEvent {
        SseEvent { event: None, data: s.into() }
    }

    #[test]
    fn events_split_at_every_byte_parse_like_the_whole() {
        let raw = "data: {\"a\":\"é\"}\r\n\r\n: keep-alive\n\nevent: error\ndata: x\n\ndata:[DONE]\n\n".as_bytes();
        let whole = all(&[raw]);
        assert_eq!(whole, vec![data("{\"a\":\"é\"}"), SseEvent { event: Some("error".into()), data: "x".into() }, data("[DONE]")]);
        let bytes: Vec<&[u8]> = raw.chunks(1).collect();
        assert_eq!(all(&bytes), whole, "one byte at a time, CRLF and a two-byte character split");
    }

    #[test]
    fn data_lines_join_with_newlines_and_only_one_space_is_stripped() {
        assert_eq!(all(&[b"data: a\ndata:  b\ndata\n\n"]), vec![data("a\n b\n")]);
    }

    #[test]
    fn an_event_without_its_blank_line_is_not_dispatched() {
        let mut p = SseParser::new();
        assert_eq!(p.push(b"data: one\n\ndata: cut").unwrap(), vec![data("one")]);
        assert!(p.push(b"").unwrap().is_empty());
        assert!(all(&[b"\n\n: only a comment\n\n"]).is_empty(), "blank lines without data are no events");
    }
}
